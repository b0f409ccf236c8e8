"""kvcm.Connector end to end: a real server subprocess; the scheduler, the two TP ranks and the
reader are separate processes; real bytes at the URIs kvcm hands out, on file and on shm."""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import pytest

from kvcm.connector import Connector, Report, Ticket
from kvcm.errors import InvalidArgument
from kvcm.testing import start_subprocess, stop_subprocess
from tests.helpers import add_file_storage, add_group, add_shm_storage, remove_shm, shm_prefix, wait_for

BLOCK = 16  # tokens per block
PROMPT = list(range(1000, 1100))  # 100 tokens: 6 whole blocks, 4 tokens left over
SPEC = 4096  # bytes per block and spec
SPECS = {"tp0": SPEC, "tp1": SPEC}
CTX = mp.get_context("spawn")


def payload(tag: str, index: int, spec: str) -> bytes:
    """The bytes of one block's spec: different for every (prompt, block, spec)."""
    seed = f"{tag}/{index}/{spec}".encode()
    return (seed * (SPEC // len(seed) + 1))[:SPEC]


# -- the processes ---------------------------------------------------------------------------------


def rank_proc(endpoint: str, instance: str, spec: str, tickets: Any, out: Any) -> None:
    """One TP rank, running for the whole test (one connector, as an engine's worker keeps): for
    each ``(ticket, tag)`` it gets, write its spec of every block, send the report back."""
    with Connector(endpoint, instance_id=instance, block_size=BLOCK) as kv:
        while (job := tickets.get(timeout=120)) is not None:
            ticket, tag = job
            with kv.rank_write(ticket, spec) as mine:
                for block in mine.blocks:
                    mine.write(block.index, payload(tag, block.index, spec))
            out.put(bytes(mine.report()))


def scheduler_proc(endpoint: str, instance: str, prompts: list[tuple[str, list[int]]], control: Any, out: Any) -> None:
    """Process A: starts two rank processes, then for each prompt starts the write, hands the
    ticket to both ranks, adds their reports, finishes. Waits for the test's go-ahead between
    prompts (the test changes the group's storages meanwhile), so long-running connectors meet a
    storage added after they started."""
    with Connector(endpoint, instance_id=instance, block_size=BLOCK, specs=SPECS, instance_group=instance) as kv:
        reports = CTX.Queue()
        inboxes = {spec: CTX.Queue() for spec in SPECS}
        ranks = [CTX.Process(target=rank_proc, args=(endpoint, instance, spec, inboxes[spec], reports))
                 for spec in SPECS]
        for p in ranks:
            p.start()
        try:
            for n, (tag, tokens) in enumerate(prompts):
                if n:
                    control.get(timeout=60)
                with kv.begin_write(tokens) as session:
                    ticket = bytes(session.ticket())
                    for inbox in inboxes.values():
                        inbox.put((ticket, tag))
                    for _ in ranks:
                        session.add_report(reports.get(timeout=60))
                out.put((tag, session.result, [sorted(b.uris.values()) for b in session.new_blocks]))
        finally:
            for inbox in inboxes.values():
                inbox.put(None)
            for p in ranks:
                p.join(timeout=60)


def reader_proc(endpoint: str, instance: str, tag: str, tokens: list[int], out: Any) -> None:
    """Process B: read every cached block of the prompt back, compare byte for byte."""
    with Connector(endpoint, instance_id=instance, block_size=BLOCK) as kv:
        blocks = kv.read(tokens)
        bad = []
        for block in blocks:
            for spec in SPECS:
                got = bytearray(SPEC)
                block.read_into(spec, got)
                if bytes(got) != payload(tag, block.index, spec) or block.read(spec) != got:
                    bad.append((block.index, spec))
        out.put((kv.lookup(tokens).tokens, len(blocks), bad))


# -- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture
def server(tmp_path):
    running = start_subprocess(str(tmp_path / "data"), f"ipc://{tmp_path}/kvcm.sock",
                               ["--set", "reclaim.enabled=false", "--set", "events.enabled=false"])
    yield running
    stop_subprocess(running)


@pytest.fixture
def shm():
    prefixes: list[str] = []

    def make() -> str:
        prefixes.append(shm_prefix())
        return prefixes[-1]

    yield make
    for prefix in prefixes:
        remove_shm(prefix)


def _storage(c: Any, kind: str, name: str, tmp_path: Any, shm: Any) -> None:
    if kind == "file":
        os.makedirs(tmp_path / name)
        add_file_storage(c, name, tmp_path / name)
    else:
        add_shm_storage(c, name, shm())


def _read_back(endpoint: str, instance: str, tag: str, tokens: list[int]) -> tuple[int, int, list[Any]]:
    out = CTX.Queue()
    p = CTX.Process(target=reader_proc, args=(endpoint, instance, tag, tokens, out))
    p.start()
    result = out.get(timeout=120)
    p.join(timeout=60)
    return result  # type: ignore[no-any-return]


# -- tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "shm"])
def test_two_ranks_write_another_process_reads_and_a_new_storage_is_picked_up(server, tmp_path, shm, kind):
    instance = f"conn-{kind}"
    with server.client() as c:
        _storage(c, kind, f"{kind}-a", tmp_path, shm)
        add_group(c, instance, [f"{kind}-a"])
    second = [t + 7 for t in PROMPT]  # another prompt: no block in common with the first
    control, out = CTX.Queue(), CTX.Queue()
    a = CTX.Process(target=scheduler_proc, args=(server.endpoint, instance, [("one", PROMPT), ("two", second)],
                                                 control, out))
    a.start()
    try:
        tag, result, uris = out.get(timeout=120)
        assert (tag, result) == ("one", {"served": 6, "failed": 0})
        assert all(u.startswith(f"{kind}://{kind}-a/") for block in uris for u in block), uris
        assert _read_back(server.endpoint, instance, "one", PROMPT) == (6 * BLOCK, 6, [])

        # While A runs: a new storage first in the group's candidates; A's next write lands there.
        with server.client() as c:
            _storage(c, kind, f"{kind}-b", tmp_path, shm)
            group = c.call("get_instance_group", {"name": instance})["instance_group"]
            c.call("update_instance_group", {"current_version": group["version"], "instance_group": {
                "name": instance, "storage_candidates": [f"{kind}-b", f"{kind}-a"]}})
        control.put("go")
        tag, result, uris = out.get(timeout=120)
        assert (tag, result) == ("two", {"served": 6, "failed": 0})
        assert all(u.startswith(f"{kind}://{kind}-b/") for block in uris for u in block), uris
        assert _read_back(server.endpoint, instance, "two", second) == (6 * BLOCK, 6, [])
    finally:
        a.join(timeout=60)
        if a.is_alive():
            a.kill()
    assert a.exitcode == 0


def _statuses(kv: Connector, tokens: list[int]) -> list[str]:
    reply = kv.client.call("get_cache_meta", {"instance_id": kv.instance_id, "token_ids": tokens})
    return [m["status"] for m in reply["metas"]]


def test_an_exception_inside_begin_write_leaves_nothing_writing(server):
    with Connector(server.endpoint, instance_id="boom", block_size=BLOCK, specs=SPECS) as kv:
        with pytest.raises(RuntimeError, match="engine died"), kv.begin_write(PROMPT) as session:
            for spec in SPECS:  # block 0 complete: still failed, as the write as a whole raised
                session.new_blocks[0].write(spec, payload("x", 0, spec))
            assert "writing" in _statuses(kv, PROMPT)
            raise RuntimeError("engine died")
        assert session.result == {"served": 0, "failed": 6}
        assert "writing" not in _statuses(kv, PROMPT)
        assert kv.lookup(PROMPT).blocks == 0


def test_only_fully_written_blocks_are_served_and_a_silent_rank_fails_its_blocks(server):
    with Connector(server.endpoint, instance_id="partial", block_size=BLOCK, specs=SPECS) as kv:
        with kv.begin_write(PROMPT) as session:
            ticket = Ticket.from_bytes(bytes(session.ticket()))
            assert [b.index for b in ticket.blocks] == list(range(6))
            for block in session.new_blocks[:4]:
                block.write("tp0", payload("p", block.index, "tp0"))
            # rank tp1 reports blocks 0..2 only; block 3 lacks tp1, blocks 4-5 lack both
            with kv.rank_write(ticket, "tp1") as rank:
                for block in rank.blocks[:3]:
                    rank.write(block.index, payload("p", block.index, "tp1"))
            session.add_report(bytes(rank.report()))
            assert session.missing() == {3: ["tp1"], 4: ["tp0", "tp1"], 5: ["tp0", "tp1"]}
        assert session.result == {"served": 3, "failed": 3}
        assert kv.lookup(PROMPT).blocks == 3
        assert [b.read("tp1") for b in kv.read(PROMPT)] == [payload("p", i, "tp1") for i in range(3)]
        # once the failed copies are freed, a second write of the prompt gets just those blocks
        assert wait_for(lambda: _statuses(kv, PROMPT)[3:] == ["not_found"] * 3, timeout=20)
        with kv.begin_write(PROMPT) as again:
            assert [b.index for b in again.new_blocks] == [3, 4, 5] and again.cached == 3
            again.fail()
        assert again.result == {"served": 0, "failed": 3}


def test_a_rank_that_raises_reports_nothing(server):
    with Connector(server.endpoint, instance_id="rank-raises", block_size=BLOCK, specs=SPECS) as kv:
        with kv.begin_write(PROMPT) as session:
            for block in session.new_blocks:
                block.write("tp0", payload("r", block.index, "tp0"))
            with pytest.raises(OSError), kv.rank_write(session.ticket(), "tp1") as rank:
                rank.write(0, payload("r", 0, "tp1"))
                raise OSError("device lost")
            assert rank.report().written == []
            session.add_report(rank.report())
        assert session.result == {"served": 0, "failed": 6}


def test_tickets_and_reports_are_checked(server):
    with Connector(server.endpoint, instance_id="checks", block_size=BLOCK, specs=SPECS) as kv:
        with pytest.raises(InvalidArgument, match="ticket"):
            kv.rank_write(b"\x01garbage", "tp0")
        with kv.begin_write(PROMPT) as session:
            with pytest.raises(InvalidArgument, match="not of this session"):
                session.add_report(Report("another", "tp0", [0]))
            with pytest.raises(InvalidArgument, match="block 99"):
                session.add_report(Report(session.session_id, "tp0", [99]))
            with pytest.raises(InvalidArgument, match="spec 'tp9'"):
                session.new_blocks[0].write("tp9", b"x")
            with pytest.raises(InvalidArgument):
                session.new_blocks[0].write("tp0", b"short")  # not the spec's size
            session.fail()
    with Connector(server.endpoint, instance_id="checks-2", block_size=BLOCK, specs=SPECS) as other, \
            other.begin_write(PROMPT) as session:
        with pytest.raises(InvalidArgument, match="instance"):
            Connector.rank_write(kv_with_closed_client(server, "checks"), bytes(session.ticket()), "tp0")
        session.fail()


def kv_with_closed_client(server: Any, instance: str) -> Connector:
    kv = Connector(server.endpoint, instance_id=instance, block_size=BLOCK)
    kv.close()
    return kv


def test_short_prompts_ask_nothing(server):
    with Connector(server.endpoint, instance_id="short", block_size=BLOCK, specs=SPECS) as kv:
        assert kv.lookup(PROMPT[:BLOCK - 1]).tokens == 0
        assert kv.read([]) == []
        with kv.begin_write(PROMPT[:BLOCK - 1]) as session:
            assert session.new_blocks == []
        assert session.result == {"served": 0, "failed": 0}

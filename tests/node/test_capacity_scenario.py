"""A cache that behaves like a cache, over the RPC port of a real ``kvcm serve``: a new group at
its quota, one block written every 50 ms and block 1 read after every write.

* no write is refused while cold blocks exist (the write evicts in-line);
* usage is back under the watermark within two reclaimer rounds of the last write;
* block 1, read after every write, outlives every colder block — through the group's first
  round, and across a kill -9 and restart in the middle (its recency is journalled each round).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvcm.errors import KvcmError
from kvcm.testing import RunningServer, start_subprocess, stop_subprocess
from tests.block_bytes import read_problems, served, storage_roots, write_session
from tests.helpers import wait_for

SPEC = 1024  # one spec per block: a block is SPEC bytes
QUOTA_BLOCKS = 20
WATERMARK = 0.5
INTERVAL = 2.0  # reclaim.interval_s: some 30 writes per round, so writes meet a full group
HOT = 1  # the block read after every write


@pytest.fixture
def sock_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvcm-t-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(data: str, sock_dir: str) -> RunningServer:
    return start_subprocess(data, f"ipc://{sock_dir}/rpc", ["--set", f"reclaim.interval_s={INTERVAL}",
                                                            "--set", "store.sync=false"])


def _setup(c: Any) -> None:
    c.call("create_instance_group", {"instance_group": {
        "name": "hot", "storage_candidates": ["default-file"], "quota": {"capacity": QUOTA_BLOCKS * SPEC},
        "reclaim_strategy": {"reclaim_policy": "lru", "used_percentage": WATERMARK, "delay_before_delete_ms": 0}}})
    c.call("register_instance", {"instance_group": "hot", "instance_id": "i", "block_size": 16,
                                 "location_spec_infos": [{"name": "tp0", "size": SPEC}]})


def _metric(c: Any, name: str, **labels: str) -> float:
    rows = c.call("get_metrics")["metrics"].get(name, [])
    return sum(r["value"] for r in rows if all(r.get("labels", {}).get(k) == v for k, v in labels.items()))


def _write_then_read(c: Any, key: int, refused: list[int], read: bool = True) -> None:
    try:
        session = c.call("start_write_cache", {"instance_id": "i", "block_keys": [key]})
    except KvcmError as exc:
        refused.append(key)
        assert exc.code.name == "QUOTA_EXCEEDED", exc
        return
    write_session(session, "i", [key], storage_roots(c))
    c.call("finish_write_cache", {"instance_id": "i", "write_session_id": session["write_session_id"],
                                  "success_blocks": {"offset": 1}})
    if read:
        assert HOT in served(c, "i", [HOT]), f"block {HOT} is gone after writing block {key}"
    time.sleep(0.05)  # pacing: writes spread over the reclaimer's rounds


def test_hot_block_outlives_cold_ones_no_write_refused_across_a_kill(tmp_path: Any, sock_dir: str) -> None:
    data = str(tmp_path / "data")
    refused: list[int] = []
    server = _start(data, sock_dir)
    try:
        with server.client() as c:
            _setup(c)
            for key in range(1, 31):  # block 1 first, then 29 more: over the quota, several rounds
                _write_then_read(c, key, refused)
            # Kill in the middle, with the group full: right after a round, the next writes
            # fill it again (the round brought it down to the watermark), and their reads of
            # block 1 are not journalled yet. After the restart the first write must evict; in
            # write order block 1 would go first, with its recency restored colder blocks go.
            rounds = _metric(c, "kvcm_reclaim_rounds_total")
            wait_for(lambda: _metric(c, "kvcm_reclaim_rounds_total") != rounds, timeout=60, interval=0.02)
            for key in range(31, 31 + QUOTA_BLOCKS // 2 + 2):
                _write_then_read(c, key, refused)
    finally:
        stop_subprocess(server, kill=True)
    server = _start(data, sock_dir)
    try:
        with server.client() as c:
            for key in range(51, 81):
                _write_then_read(c, key, refused)
            assert refused == [], f"writes refused while cold blocks existed: {refused}"
            # The usage gauge is what a round saw as it began: the third round's start shows
            # what the two rounds after the last write left.
            rounds = _metric(c, "kvcm_reclaim_rounds_total")
            wait_for(lambda: _metric(c, "kvcm_reclaim_rounds_total") >= rounds + 3, timeout=60, interval=INTERVAL / 3)
            used = _metric(c, "kvcm_group_usage_bytes", group="hot")
            assert used <= WATERMARK * QUOTA_BLOCKS * SPEC, f"{used} bytes used two rounds after the last write"
            alive = served(c, "i", range(1, 81))
            assert HOT in alive
            assert max(alive) == 80 and len(alive) > 1  # the newest stay too: only the cold went
            assert read_problems(c, "i", sorted(alive), storage_roots(c)) == []
            inline = _metric(c, "kvcm_reclaim_blocks_total", reason="inline")
            background = _metric(c, "kvcm_reclaim_blocks_total", reason="watermark")
            assert inline > 0 and background >= 0
    finally:
        stop_subprocess(server)


@pytest.mark.both_stores  # the kill -9 scenario above stays on LMDB: 11 s, over the suite's Redis budget
def test_a_pinned_block_outlives_the_cold_ones_until_unpinned(sock_dir: str) -> None:
    """Over RPC: the coldest block, pinned, is passed over by the reclaimer's rounds and by
    in-line eviction; unpinned, it is the next to go."""
    from kvcm.testing import serve_in_thread

    with serve_in_thread(overrides={"reclaim": {"interval_s": 0.05}}) as srv, srv.client() as c:
        _setup(c)
        c.call("pin_cache", {"instance_id": "i", "block_keys": [HOT], "ttl_seconds": 600})
        refused: list[int] = []
        for key in range(1, 41):  # block 1 is written first and never read
            session = c.call("start_write_cache", {"instance_id": "i", "block_keys": [key]})
            write_session(session, "i", [key], storage_roots(c))
            c.call("finish_write_cache", {"instance_id": "i", "write_session_id": session["write_session_id"],
                                          "success_blocks": {"offset": 1}})
        assert refused == []
        alive = served(c, "i", range(1, 41))
        assert HOT in alive and 2 not in alive and 40 in alive
        c.call("unpin_cache", {"instance_id": "i", "block_keys": [HOT]})
        for key in range(41, 61):
            session = c.call("start_write_cache", {"instance_id": "i", "block_keys": [key]})
            c.call("finish_write_cache", {"instance_id": "i", "write_session_id": session["write_session_id"],
                                          "success_blocks": {"offset": 1}})
        assert HOT not in served(c, "i", [HOT])

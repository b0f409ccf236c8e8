"""Router-grade match_engines over a real server (ipc:// RPC, real ZeroMQ publishers): scores
from tier weights and loads, pods, top_k, matched tokens, speculative entries, the storage tier
in the same answer, and Tair's get_host_cache_state (docs/routers.md)."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.engines.scoring import parse_weights
from kvcm.errors import InvalidArgument, NotFound
from kvcm.proto.results import EngineMatches, HostCacheState, Routed
from kvcm.testing import FakeEnginePublisher, serve_in_thread
from tests.helpers import TIME_FACTOR, register, wait_for

BLOCK = 4
TOKENS = list(range(100, 132))  # 8 full blocks
ROOT = Path(__file__).resolve().parents[2]


def _register(kv) -> None:
    register(kv, "llm", block_size=BLOCK, specs=[{"name": "tp0", "size": 1024}], deployment=None)


def _follow(kv, engine, source_id: str, **extra) -> None:
    kv.call("add_event_source", {"source_id": source_id, "instance_id": "llm", "endpoint": engine.endpoint,
                                 "replay_endpoint": engine.replay_endpoint, **extra})


def _match(kv, **extra) -> dict:
    return kv.call("match_engines", {"instance_id": "llm", "token_ids": TOKENS, **extra})


def _entry(reply: dict, source_id: str) -> dict | None:
    return next((s for s in reply["sources"] if s["source_id"] == source_id), None)


def _hold(kv, engine, n: int, medium: str, source_id: str) -> None:
    """The engine stores the first ``n`` blocks of TOKENS on ``medium``; wait until kvcm sees it."""
    engine.store(list(range(1, n + 1)), TOKENS[: n * BLOCK], block_size=BLOCK, medium=medium)

    def seen() -> bool:
        entry = _entry(_match(kv), source_id)
        return entry is not None and entry["media"].get(medium) == n

    assert wait_for(seen), f"{source_id} never showed {n} blocks on {medium}"


def _held_without_matching(kv, engine, n: int, source_id: str) -> None:
    """:func:`_hold` on GPU, waiting through list_event_sources: no match runs meanwhile."""
    engine.store(list(range(1, n + 1)), TOKENS[: n * BLOCK], block_size=BLOCK, medium="GPU")

    def seen() -> bool:
        listed = kv.call("list_event_sources", {"instance_id": "llm"})["sources"]
        return any(s["source_id"] == source_id and s["blocks_by_medium"].get("GPU") == n for s in listed)

    assert wait_for(seen), f"{source_id} never held {n} blocks"


def _order(reply: dict) -> list[str]:
    return [s["source_id"] for s in reply["sources"]]


@pytest.fixture
def ranked():
    """pod-gpu holds 5 blocks on GPU, pod-cpu 6 on CPU."""
    with serve_in_thread() as server, server.client() as kv, \
            FakeEnginePublisher() as gpu, FakeEnginePublisher() as cpu:
        _register(kv)
        _follow(kv, gpu, "pod-gpu")
        _follow(kv, cpu, "pod-cpu")
        _hold(kv, gpu, 5, "GPU", "pod-gpu")
        _hold(kv, cpu, 6, "CPU", "pod-cpu")
        yield server, kv, gpu


def test_gpu_holdings_outrank_larger_cpu_holdings_at_default_weights(ranked):
    _, kv, _ = ranked
    reply = _match(kv)
    assert _order(reply) == ["pod-gpu", "pod-cpu"]
    gpu, cpu = reply["sources"]
    assert gpu["score"] == pytest.approx(5 * 1.0) and cpu["score"] == pytest.approx(6 * 0.8)
    assert (gpu["matched_blocks"], cpu["matched_blocks"]) == (5, 6)
    assert gpu["media"] == {"GPU": 5} and cpu["media"] == {"CPU": 6}
    assert gpu["media_tokens"] == {"GPU": 20} and cpu["matched_tokens"] == 24
    assert "speculative" not in gpu and "storage" not in reply and reply["stale_sources"] == 0
    # every source's freshness rides along (kept for events.poll_ms, so it may trail a replay's end)
    assert wait_for(lambda: _match(kv)["freshness"]["pod-gpu"]["state"] == "live")
    typed = kv.match_engines(instance_id="llm", token_ids=TOKENS)
    assert isinstance(typed, EngineMatches) and [s.score for s in typed.sources] == [gpu["score"], cpu["score"]]
    assert typed.pods[0].pod == "pod-gpu" and typed.storage is None


def test_loads_change_the_order_as_the_formula_says(ranked):
    _, kv, _ = ranked
    reply = _match(kv, loads={"pod-gpu": 0.5, "pod-cpu": 0, "pod-gone": 7})
    assert _order(reply) == ["pod-cpu", "pod-gpu"]  # 4.8 - 0 > 5.0 - 0.5
    assert reply["sources"][1]["score"] == pytest.approx(5.0 - 0.5)
    assert [p["pod"] for p in reply["pods"]] == ["pod-cpu", "pod-gpu"]
    assert reply["pods"][1]["score"] == pytest.approx(4.5)
    reply = _match(kv, loads={"pod-gpu": 0.1})
    assert _order(reply) == ["pod-gpu", "pod-cpu"]  # 4.9 > 4.8
    assert reply["sources"][0]["score"] == pytest.approx(4.9)


def test_top_k_and_bad_requests(ranked):
    _, kv, _ = ranked
    reply = _match(kv, top_k=1)
    assert _order(reply) == ["pod-gpu"] and [p["pod"] for p in reply["pods"]] == ["pod-gpu"]
    assert _order(_match(kv, limit=1)) == ["pod-gpu"]
    bad = [{"top_k": -1}, {"top_k": 1, "limit": 2}, {"loads": {"pod-gpu": -1}}, {"loads": {"pod-gpu": 1e13}},
           {"loads": {"pod-gpu": float("nan")}}, {"loads": {"pod-gpu": True}}, {"loads": {"x" * 201: 1}},
           {"loads": {f"p{i}": 1 for i in range(129)}}, {"loads": ["pod-gpu"]}, {"load": {"pod-gpu": 1}}]
    for extra in bad:
        with pytest.raises(InvalidArgument):
            _match(kv, **extra)


def test_pods_group_dp_ranks_and_tokens_count_whole_blocks_only():
    with serve_in_thread() as server, server.client() as kv, FakeEnginePublisher() as r0, \
            FakeEnginePublisher() as r1, FakeEnginePublisher() as other:
        _register(kv)
        _follow(kv, r0, "pod-a/dp0", pod="pod-a", dp_rank=0)
        _follow(kv, r1, "pod-a/dp1", pod="pod-a", dp_rank=1)
        _follow(kv, other, "pod-b")
        _hold(kv, r0, 2, "GPU", "pod-a/dp0")
        _hold(kv, r1, 8, "GPU", "pod-a/dp1")
        _hold(kv, other, 3, "GPU", "pod-b")
        prompt = [*TOKENS, 7, 8]  # 8 full blocks and a partial one, never cached by an engine
        reply = kv.call("match_engines", {"instance_id": "llm", "token_ids": prompt})
        assert (reply["num_blocks"], reply["num_tokens"]) == (8, 34)
        assert _order(reply) == ["pod-a/dp1", "pod-b", "pod-a/dp0"]
        assert [(s["pod"], s["dp_rank"]) for s in reply["sources"]] == [("pod-a", 1), ("pod-b", 0), ("pod-a", 0)]
        assert reply["sources"][0]["matched_tokens"] == 32  # the 2 tokens of the partial block are not held
        pods = reply["pods"]
        assert [p["pod"] for p in pods] == ["pod-a", "pod-b"]
        assert pods[0]["sources"] == ["pod-a/dp1", "pod-a/dp0"] and pods[0]["best_source"] == "pod-a/dp1"
        assert (pods[0]["matched_blocks"], pods[0]["matched_tokens"], pods[0]["score"]) == (8, 32, 8.0)
        assert pods[1] == {"pod": "pod-b", "matched_blocks": 3, "matched_tokens": 12, "best_source": "pod-b",
                           "sources": ["pod-b"], "score": 3.0}
        listed = {s["source_id"]: s["pod"] for s in kv.call("list_event_sources", {})["sources"]}
        assert listed == {"pod-a/dp0": "pod-a", "pod-a/dp1": "pod-a", "pod-b": "pod-b"}
        with pytest.raises(InvalidArgument):
            kv.call("add_event_source", {"source_id": "x", "instance_id": "llm", "endpoint": r0.endpoint,
                                         "pod": "bad pod!"})


def test_a_source_added_again_is_not_answered_from_its_old_entries(ranked):
    """Replies are assembled from encoded entries kept per slot: a source removed and added again
    (its slot id reused, with another pod and rank) must show its new fields."""
    _, kv, _ = ranked
    cpu = _entry(_match(kv), "pod-cpu")
    assert cpu is not None and (cpu["pod"], cpu["dp_rank"]) == ("pod-cpu", 0)
    endpoints = {s["source_id"]: s for s in kv.call("list_event_sources", {})["sources"]}["pod-cpu"]
    kv.call("remove_event_source", {"source_id": "pod-cpu"})
    kv.call("add_event_source", {"source_id": "pod-cpu", "instance_id": "llm", "endpoint": endpoints["endpoint"],
                                 "replay_endpoint": endpoints["replay_endpoint"], "pod": "rack-1", "dp_rank": 2})

    def renamed() -> dict | None:
        entry = _entry(_match(kv), "pod-cpu")  # the engine's replay refills the same 6 CPU blocks
        return entry if entry is not None and entry["matched_blocks"] == 6 else None

    entry = wait_for(renamed)
    assert entry is not None and (entry["pod"], entry["dp_rank"]) == ("rack-1", 2)


def test_speculative_entries_appear_are_confirmed_and_expire(ranked):
    server, kv, gpu = ranked
    routed = kv.note_routed(instance_id="llm", source_id="pod-gpu", token_ids=TOKENS, ttl_s=30)
    assert isinstance(routed, Routed) and routed.num_blocks == 8
    entry = _entry(_match(kv), "pod-gpu")
    assert entry is not None and entry["speculative"] is True and entry["speculative_blocks"] == 3
    assert entry["matched_blocks"] == 8 and entry["media"] == {"GPU": 5}  # media: what it really holds
    assert entry["score"] == pytest.approx(5 * 1.0 + 3 * 0.9)
    assert _match(kv, lora_name="other")["sources"] == []  # an entry counts in its adapter's namespace only
    # the engine's BlockStored for the whole prompt confirms the entry: the flag drops at once
    _held_without_matching(kv, gpu, 8, "pod-gpu")
    entry = _entry(_match(kv), "pod-gpu")
    assert entry is not None and "speculative" not in entry and entry["score"] == pytest.approx(8.0)
    assert server.app.engines.speculative.ended["confirmed"] == 1 and len(server.app.engines.speculative) == 0
    # a short-lived entry on a source that holds nothing of the prompt yet, then its ttl ends
    kv.call("note_routed", {"instance_id": "llm", "source_id": "pod-cpu", "token_ids": [*TOKENS, *TOKENS],
                            "ttl_s": 0.3})
    entry = _entry(_match(kv), "pod-cpu")
    assert entry is not None and entry["speculative"] is True and entry["matched_blocks"] == 8
    assert entry["speculative_blocks"] == 2 and entry["score"] == pytest.approx(6 * 0.8 + 2 * 0.9)
    time.sleep(0.35 * TIME_FACTOR)  # past the entry's 0.3 s ttl on the server's real clock
    entry = _entry(_match(kv), "pod-cpu")
    assert entry is not None and "speculative" not in entry and entry["matched_blocks"] == 6
    assert server.app.engines.speculative.ended["expired"] == 1
    for bad, error in (({"ttl_s": 0}, InvalidArgument), ({"ttl_s": 61}, InvalidArgument),
                       ({"source_id": "nope"}, NotFound), ({"ttl_s": 1, "extra": 1}, InvalidArgument)):
        with pytest.raises(error):
            kv.call("note_routed", {"instance_id": "llm", "source_id": "pod-gpu", "token_ids": TOKENS, **bad})


def test_speculative_entries_are_bounded(ranked):
    server, kv, _ = ranked
    entries = server.app.engines.speculative
    entries.max_entries = 3
    for i in range(5):
        kv.call("note_routed", {"instance_id": "llm", "source_id": "pod-cpu", "block_keys": [i + 1], "ttl_s": 30})
    assert len(entries) == 3 and entries.ended["dropped"] == 2
    entries.max_keys = 4  # the keys of all entries are bounded too
    kv.call("note_routed", {"instance_id": "llm", "source_id": "pod-cpu", "block_keys": [7, 8, 9], "ttl_s": 30})
    assert len(entries) == 2 and entries.ended["dropped"] == 4  # 1 + 3 keys fit in 4
    kv.call("remove_event_source", {"source_id": "pod-cpu"})
    assert len(entries) == 0 and entries.ended["removed"] == 2


def test_expired_entries_end_on_later_notes_without_any_query():
    """Entries nobody queries still end at their ttl: each note_routed ends the oldest expired
    ones first, so a router that only notes never grows the entries past what is live."""
    from kvcm.engines.speculative import SpeculativeEntries

    now = [0.0]
    entries = SpeculativeEntries(max_entries=1000, max_ttl_s=60, clock=lambda: now[0])
    for i in range(3):
        entries.note("llm", "pod-a", [i + 1, i + 2], ttl_s=1.0)
    now[0] = 2.0
    entries.note("llm", "pod-a", [9], ttl_s=1.0)
    assert len(entries) == 1 and entries.ended["expired"] == 3 and entries.ended["dropped"] == 0
    assert not entries.matched("llm", [1, 2])  # and what ended is no longer counted


def test_a_stale_source_is_left_out_unless_asked_for_over_rpc():
    """Stale (not heard for stale_after_s, never expired here): match_engines and
    get_host_cache_state leave it out and count it; ``include_stale`` brings it back, flagged."""
    events = {"probe_interval_s": 0.2, "stale_after_s": 0.5, "expire_after_s": 0, "poll_ms": 20}
    with serve_in_thread(overrides={"events": events}) as server, server.client() as kv:
        _register(kv)
        kv.report_events(source_id="push-a", op="register", instance_id="llm")
        kv.report_events(source_id="push-a", op="events", seq=0, events=[
            {"type": "add", "block_hashes": [1, 2], "token_ids": TOKENS[: 2 * BLOCK], "block_size": BLOCK}])
        assert _entry(_match(kv), "push-a") is not None
        assert wait_for(lambda: _match(kv)["stale_sources"] == 1)
        reply = _match(kv)
        assert reply["sources"] == [] and reply["freshness"]["push-a"]["state"] == "stale"
        kept = _match(kv, include_stale=True)
        assert _order(kept) == ["push-a"] and kept["stale_sources"] == 0 and kept["sources"][0]["matched_blocks"] == 2
        hosts = kv.call("get_host_cache_state", {"instance_id": "llm", "token_ids": TOKENS, "include_storage": False})
        assert hosts["hosts"] == []  # a stale host is not listed, holding or not
        hosts = kv.call("get_host_cache_state", {"instance_id": "llm", "token_ids": TOKENS, "include_storage": False,
                                                 "include_stale": True})  # fmt: skip
        assert [(h["host_ip_port"], h["local"]) for h in hosts["hosts"]] == [("push-a", 2)]


def test_include_storage_adds_the_storage_tier_as_a_pseudo_source(ranked):
    _, kv, _ = ranked
    keys = token_ids_to_block_keys(TOKENS, BLOCK)
    session = kv.call("start_write_cache", {"instance_id": "llm", "block_keys": keys[:7]})
    kv.call("finish_write_cache", {"instance_id": "llm", "write_session_id": session["write_session_id"],
                                   "success_blocks": {"offset": 7}})
    reply = _match(kv, include_storage=True)
    assert _order(reply) == ["pod-gpu", "pod-cpu"]  # never ranked among the engines
    storage = reply["storage"]
    assert storage["source_id"] == "storage" and storage["matched_blocks"] == 7
    assert storage["media"] == {"file": 7} and storage["matched_tokens"] == 28
    assert storage["score"] == pytest.approx(7 * 0.5)  # events.tier_weights' STORAGE
    assert "storage" not in _match(kv)
    typed = kv.match_engines(instance_id="llm", token_ids=TOKENS, include_storage=True)
    assert typed.storage is not None and typed.storage.matched_blocks == 7


def test_get_host_cache_state_answers_in_tairs_shape(ranked):
    _, kv, _ = ranked
    keys = token_ids_to_block_keys(TOKENS, BLOCK)
    reply = kv.call("get_host_cache_state", {"instance_id": "llm", "block_cache_keys": keys,
                                             "query_type": "QT_PREFIX_MATCH"})
    assert reply["global"] == 6 and reply["num_blocks"] == 8
    assert [(h["host_ip_port"], h["local"], h["p2p_1_fetch"], h["p2p_1_total_match"]) for h in reply["hosts"]] == [
        ("pod-gpu", 5, 1, 6), ("pod-cpu", 6, 0, 6)]
    typed = kv.get_host_cache_state(instance_id="llm", token_ids=TOKENS, medium=["CPU"], top_k=1)
    assert isinstance(typed, HostCacheState) and [h.host_ip_port for h in typed.hosts] == ["pod-cpu"]
    assert typed.global_ == 6
    # a host holding nothing of the prompt is listed too, with local 0 (Tair lists every host)
    reply = kv.call("get_host_cache_state", {"instance_id": "llm", "token_ids": TOKENS, "medium": ["GPU"]})
    assert [(h["host_ip_port"], h["local"], h["p2p_1_total_match"]) for h in reply["hosts"]] == [
        ("pod-gpu", 5, 5), ("pod-cpu", 0, 5)]
    # loads: each host's score is its best rank's score minus that rank's load, best first
    reply = kv.call("get_host_cache_state", {"instance_id": "llm", "token_ids": TOKENS, "loads": {"pod-gpu": 2.0}})
    assert [(h["host_ip_port"], h["score"]) for h in reply["hosts"]] == [("pod-cpu", pytest.approx(4.8)),
                                                                           ("pod-gpu", pytest.approx(3.0))]
    reply = kv.call("get_host_cache_state", {"instance_id": "llm", "token_ids": TOKENS, "medium": ["GPU"],
                                             "loads": {"pod-cpu": 1.5}})  # fmt: skip
    assert [(h["host_ip_port"], h["score"]) for h in reply["hosts"]] == [("pod-gpu", pytest.approx(5.0)),
                                                                           ("pod-cpu", pytest.approx(-1.5))]
    for bad in ({"query_type": "batch_get"}, {"block_keys": keys, "block_cache_keys": keys}, {"top_k": -1}):
        with pytest.raises(InvalidArgument):
            kv.call("get_host_cache_state", {"instance_id": "llm", "token_ids": TOKENS, **bad})


def test_mixed_media_count_each_block_at_its_best_tier():
    weights = parse_weights("GPU=1.0,CPU=0.8,*=0.5,STORAGE=0.4,STORAGE.MOONCAKE=0.7")
    assert weights.weighted_blocks({"GPU": 4, "CPU": 6}) == pytest.approx(4 * 1.0 + 2 * 0.8)
    assert weights.weighted_blocks({"CPU": 6, "GPU": 4, "DISK": 7}) == pytest.approx(4 + 2 * 0.8 + 0.5)
    assert (weights.of_storage("file"), weights.of_storage("mooncake")) == (0.4, 0.7)
    assert parse_weights("GPU=2").of("NVME") == 2.0  # unlisted: the lowest listed weight
    for bad in ("GPU", "GPU=x", "GPU=-1", "GPU=nan", "GPU=1,gpu=2", "=1"):
        with pytest.raises(ValueError):
            parse_weights(bad)


def test_routers_doc_example():
    """docs/routers.md's example, run as written against a real server and engine."""
    page = (ROOT / "docs" / "routers.md").read_text()
    code = re.search(r"<!-- test: by tests/engines/test_engine_ranking.py::test_routers_doc_example -->\n```python\n(.*?)```",
                     page, re.S)
    assert code, "the example block is gone from docs/routers.md"
    assert len(code.group(1).strip().splitlines()) <= 10
    with serve_in_thread() as server, server.client() as kv, FakeEnginePublisher() as a, FakeEnginePublisher() as b:
        _register(kv)
        _follow(kv, a, "pod-a")
        _follow(kv, b, "pod-b")
        _hold(kv, a, 2, "GPU", "pod-a")
        _hold(kv, b, 4, "GPU", "pod-b")
        # every source on GPU: the reply comes from the encoded runs as they are; top_k takes the
        # general path (sorted fragments): the same answer
        whole, sorted_path = _match(kv), _match(kv, top_k=2)
        assert _order(whole) == ["pod-b", "pod-a"] and [p["pod"] for p in whole["pods"]] == ["pod-b", "pod-a"]
        assert whole["pods"][1] == {"pod": "pod-a", "matched_blocks": 2, "matched_tokens": 8, "best_source": "pod-a",
                                    "sources": ["pod-a"], "score": 2.0}
        assert {**whole, "freshness": None} == {**sorted_path, "freshness": None}
        scope = {"endpoint": server.endpoint, "prompt_token_ids": TOKENS, "queued": {"pod-a": 0.0, "pod-b": 3.0}}
        exec(compile(code.group(1), "docs/routers.md", "exec"), scope)
        assert scope["engine"] == "pod-a"  # 4 - 3 < 2 - 0
        assert _entry(_match(kv), "pod-a")["speculative"] is True  # the example tells kvcm where it went


def test_the_fast_walk_agrees_with_the_index_match_on_random_holdings():
    """The encoded-runs walk against EngineIndex.match (the per-source merge), over sources with
    random prefixes, holes (a middle block removed) and queries diverging part-way."""
    from kvcm.cache.keys import token_ids_to_block_keys as keys_of
    from kvcm.engines.service import EngineService
    from kvcm.engines.sources import SourceSpec
    from kvcm.proto.kv_events import BlockRemoved, BlockStored, DecodedBatch

    rng = random.Random(7)
    tokens = [rng.randrange(1000) for _ in range(40 * BLOCK)]
    svc = EngineService(None, lambda _: BLOCK)
    try:
        for i in range(30):
            state = svc.index.add_source(SourceSpec(f"s{i:02d}", "llm", f"tcp://127.0.0.1:{i + 1}"))
            n = rng.randrange(1, 41)
            events: list = [BlockStored(list(range(1, n + 1)), None, tokens[: n * BLOCK], BLOCK, None, "GPU", None)]
            if n > 3 and rng.random() < 0.4:
                events.append(BlockRemoved([rng.randrange(2, n)], "GPU"))  # a hole: the prefix ends before it
            svc.index.apply(f"s{i:02d}", state.generation, 0, DecodedBatch(1.0, events))
        for _ in range(20):
            cut = rng.randrange(1, 40) * BLOCK
            query = keys_of(tokens[:cut] + [rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 4) * BLOCK)], BLOCK)
            expected = sorted(((m.matched_blocks, m.source_id) for m in svc.index.match("llm", query)),
                              key=lambda t: (-t[0], t[1]))  # fmt: skip
            for reply in (svc.match("llm", block_keys=query), svc.match("llm", block_keys=query, limit=len(expected) + 1)):
                assert [(s["matched_blocks"], s["source_id"]) for s in reply["sources"]] == expected
                assert [s["score"] for s in reply["sources"]] == [float(n) for n, _ in expected]
    finally:
        svc.stop()


def test_a_source_added_again_with_another_pod_only_shows_its_new_pod():
    """The runs memo keeps encoded entries while the table's slots compare equal: a source
    removed and added again with the same rank and medium gets an equal slot, yet its new pod
    must show (the memo starts afresh when a source is added)."""
    from kvcm.cache.keys import token_ids_to_block_keys as keys_of
    from kvcm.engines.service import EngineService
    from kvcm.engines.sources import SourceSpec
    from kvcm.proto.kv_events import BlockStored, DecodedBatch

    svc = EngineService(None, lambda _: BLOCK)
    query = keys_of(TOKENS, BLOCK)
    try:
        state = svc.index.add_source(SourceSpec("s0", "llm", "tcp://127.0.0.1:2"))  # keeps the table
        event = BlockStored([1, 2], None, TOKENS[: 2 * BLOCK], BLOCK, None, "GPU", None)
        svc.index.apply("s0", state.generation, 0, DecodedBatch(1.0, [event]))
        for pod in ("pod-a", "rack-1"):
            state = svc.index.add_source(SourceSpec("s1", "llm", "tcp://127.0.0.1:1", pod=pod))
            event = BlockStored([1, 2, 3], None, TOKENS[: 3 * BLOCK], BLOCK, None, "GPU", None)
            svc.index.apply("s1", state.generation, 0, DecodedBatch(1.0, [event]))
            reply = svc.match("llm", block_keys=query)
            assert [(s["pod"], s["matched_blocks"]) for s in reply["sources"]] == [(pod, 3), ("s0", 2)]
            assert [p["pod"] for p in reply["pods"]] == [pod, "s0"]
            svc.index.remove_source("s1")
    finally:
        svc.stop()

"""vLLM's report modes (``kv_cache_report_mode``, vllm-project/vllm#45261; docs/engines.md,
"Report modes"): a ``full``-mode engine re-reports the blocks it reuses from its prefix cache, once
per request, while ``BlockRemoved`` still comes once per physical block. A source declares its
mode; under ``full`` a re-reported held block is made newest and never held twice, and a kvcm that
joined late fills in a prefix from the next request over it."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from kvcm.backends.metastore import LmdbStore, MemoryStore
from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.config import ConfigError
from kvcm.engines.index import EngineIndex
from kvcm.engines.sources import SourceSpec, SubscriberSettings, build_spec, static_specs
from kvcm.errors import Conflict, InvalidArgument
from kvcm.proto.kv_events import BlockRemoved, BlockStored, DecodedBatch
from kvcm.testing import FakeEnginePublisher, serve_in_thread
from tests.helpers import register, wait_for

B = 16
_RNG = random.Random(3)
TOKENS = [_RNG.randrange(150_000) for _ in range(64 * B)]
KEYS = token_ids_to_block_keys(TOKENS, B)


def chain(first: int, count: int, tokens: list[int] = TOKENS, salt: int = 0) -> BlockStored:
    """Blocks ``first .. first+count-1`` of ``tokens``, chained to block ``first-1`` (engine hashes
    are the block's end position, plus ``salt`` for another document)."""
    hashes = [salt + first + i + 1 for i in range(count)]
    parent = salt + first if first else None
    return BlockStored(hashes, parent, tokens[first * B : (first + count) * B], B, medium="GPU")


def make(report_mode: str, store: Any = None, **bounds: Any):
    index = EngineIndex(store or MemoryStore(), lambda _: B, **bounds)
    gen = index.add_source(SourceSpec("pod", "inst", "tcp://h:1", report_mode=report_mode)).generation
    seq = Counter[str]()

    def apply(*events: Any) -> Any:
        seq["pod"] += 1
        return index.apply("pod", gen, seq["pod"] - 1, DecodedBatch(1.0, list(events)))

    return index, apply


def held(index: EngineIndex, keys: list[int] = KEYS) -> int:
    found = index.match("inst", keys)
    return found[0].matched_blocks if found else 0


def test_a_thousand_requests_reusing_a_prefix_then_one_eviction_leave_nothing_held() -> None:
    """Each request re-reports the 20-block prefix from its root (as vLLM's full mode does at the
    request's first schedule) and stores its own continuation; the engine then evicts the prefix's
    blocks once each (one physical block each): the prefix is gone."""
    index, apply = make("full")
    apply(chain(0, 20))
    for request in range(1000):
        tail = random.Random(request).choices(range(150_000), k=B)
        own = BlockStored([10_000 + request], 20, tail, B, medium="GPU")  # its own next block
        assert apply(chain(0, 20), own).errors == {}
    assert held(index) == 20
    blocks = index.get("pod").blocks  # type: ignore[union-attr]
    assert all(blk.refs == {"GPU": 1} for blk in blocks.values())  # a re-report is never a second holding
    apply(BlockRemoved(list(range(1, 21)), "GPU"))
    assert held(index) == 0
    assert index.blocks_held("pod") == {"GPU": 1000}  # the requests' own blocks, which nothing removed


def test_incremental_mode_still_counts_a_hash_stored_twice() -> None:
    """Without re-reports, a second store of a held hash is a second physical block (vLLM caches
    one prefix twice when two requests computed it at once): it takes two removals."""
    index, apply = make("incremental")
    apply(chain(0, 10))
    apply(chain(0, 10))
    apply(BlockRemoved(list(range(1, 11)), "GPU"))
    assert held(index) == 10
    apply(BlockRemoved(list(range(1, 11)), "GPU"))
    assert held(index) == 0


@pytest.mark.parametrize(("mode", "kept"), [("full", 10), ("incremental", 0)])
def test_a_re_report_makes_the_prefix_newest_for_the_bounds(mode: str, kept: int) -> None:
    """Under full mode a re-reported prefix is in use again: past its bound the source loses its
    oldest blocks, which are then another prefix's. An incremental store of a held block is a
    duplicate and changes no order."""
    other = random.Random(9).choices(range(150_000), k=40 * B)
    index, apply = make(mode, max_blocks_per_source=40)
    apply(chain(0, 10))  # prefix A
    apply(chain(0, 25, other, salt=1_000))  # prefix B, newer
    apply(chain(0, 10))  # a request reuses A
    apply(chain(25, 8, other, salt=1_000))  # 43 blocks: down to 38, the 5 oldest go
    assert held(index) == kept
    assert index.check() == []


def test_a_re_report_heals_a_prefix_whose_parents_kvcm_never_saw() -> None:
    index, apply = make("full")
    stats = apply(chain(5, 5))  # kvcm joined late: block 5's parent was stored before it listened
    assert stats.errors == {"unknown_parent": 1} and held(index) == 0
    apply(chain(0, 10))  # the next request over the prefix re-reports it from its root
    assert held(index) == 10


def test_report_mode_is_persisted_with_the_source(tmp_path: Any) -> None:
    store = LmdbStore(str(tmp_path / "engines"), map_size=1 << 24, sync=False)
    index, apply = make("full", store=store)
    apply(chain(0, 4), chain(0, 4))
    index.flush()
    restored = EngineIndex(store, lambda _: B)
    (state,) = restored.load()
    assert state.spec.report_mode == "full"
    seq = state.last_seq
    restored.apply("pod", state.generation, seq + 1, DecodedBatch(1.0, [chain(0, 4)]))  # re-reported after the restart
    restored.apply("pod", state.generation, seq + 2, DecodedBatch(1.0, [BlockRemoved([1, 2, 3, 4], "GPU")]))
    assert held(restored) == 0


@pytest.mark.parametrize("bad", ["Full", "fulll", "", 1, None, True, ["full"]])
def test_report_mode_is_validated_strictly(bad: Any) -> None:
    params = {"source_id": "p", "instance_id": "i", "endpoint": "tcp://h:1", "report_mode": bad}
    with pytest.raises(InvalidArgument, match="report_mode"):
        build_spec(params, SubscriberSettings())
    with pytest.raises(ConfigError, match=r"events.sources\[0\]: report_mode"):
        static_specs([params], SubscriberSettings())


def test_a_static_source_declares_its_mode_in_the_config() -> None:
    (spec,) = static_specs(['{"source_id": "p", "instance_id": "i", "endpoint": "tcp://h:1", "report_mode": "full"}'],
                           SubscriberSettings())  # fmt: skip
    assert spec.report_mode == "full" and spec.static
    (plain,) = static_specs(['{"source_id": "p", "instance_id": "i", "endpoint": "tcp://h:1"}'], SubscriberSettings())
    assert plain.report_mode == "incremental"


# --- over real sockets ------------------------------------------------------------------------------------------


def _register(kv: Any) -> None:
    register(kv, "llm", block_size=B, specs=[{"name": "tp0", "size": 1024}], deployment=None)


def _source(kv: Any, source_id: str) -> dict[str, Any]:
    return next(s for s in kv.call("list_event_sources", {})["sources"] if s["source_id"] == source_id)


def _matched(kv: Any, source_id: str, n: int) -> int:
    reply = kv.call("match_engines", {"instance_id": "llm", "token_ids": TOKENS[: n * B]})
    return next((s["matched_blocks"] for s in reply["sources"] if s["source_id"] == source_id), 0)


def test_a_kvcm_started_after_the_replay_buffer_rolled_over_indexes_the_prefix_after_one_full_request() -> None:
    """The engine stored a 20-block prefix one block per batch; its replay buffer keeps the last 4
    batches. kvcm starts after that: the replayed stores name parents it never saw, are skipped and
    counted (unknown_parent, with a hint); the engine's next request over the prefix re-reports it
    from its root, and the whole prefix is indexed."""
    with FakeEnginePublisher(buffer_steps=4) as engine:
        for i in range(20):
            engine.publish([chain(i, 1)])
        with serve_in_thread() as server, server.client() as kv:
            _register(kv)
            kv.call("add_event_source", {"source_id": "late", "instance_id": "llm", "endpoint": engine.endpoint,
                                         "replay_endpoint": engine.replay_endpoint, "report_mode": "full"})  # fmt: skip
            assert wait_for(lambda: _source(kv, "late")["unknown_parent"] == 4), _source(kv, "late")
            listed = _source(kv, "late")
            assert listed["report_mode"] == "full" and "re-reports it from its root" in listed["unknown_parent_hint"]
            assert _matched(kv, "late", 20) == 0
            engine.publish([chain(0, 20), BlockStored([501], 20, TOKENS[20 * B : 21 * B], B, medium="GPU")])
            assert wait_for(lambda: _matched(kv, "late", 21) == 21)
            engine.publish([BlockRemoved(list(range(1, 21)), "GPU")])  # one eviction of the prefix's blocks
            assert wait_for(lambda: _matched(kv, "late", 21) == 0)


def test_unknown_parent_is_listed_per_source_with_a_hint_for_incremental_sources_too() -> None:
    with serve_in_thread() as server, server.client() as kv, FakeEnginePublisher() as a, FakeEnginePublisher() as b:
        _register(kv)
        for source_id, engine in (("a", a), ("b", b)):
            kv.call("add_event_source", {"source_id": source_id, "instance_id": "llm", "endpoint": engine.endpoint,
                                         "replay_endpoint": engine.replay_endpoint})  # fmt: skip
        a.publish([chain(3, 2)])
        b.publish([chain(0, 2)])
        assert wait_for(lambda: _source(kv, "a")["unknown_parent"] == 1 and _matched(kv, "b", 2) == 2)
        listed_a, listed_b = _source(kv, "a"), _source(kv, "b")
        assert listed_a["report_mode"] == "incremental" and "kv_cache_report_mode" in listed_a["unknown_parent_hint"]
        assert listed_b["unknown_parent"] == 0 and "unknown_parent_hint" not in listed_b
        with pytest.raises(InvalidArgument, match="report_mode"):
            kv.call("add_event_source", {"source_id": "c", "instance_id": "llm", "endpoint": a.endpoint,
                                         "report_mode": "Full"})  # fmt: skip


def test_a_push_source_registers_its_mode() -> None:
    with serve_in_thread() as server, server.client() as kv:
        _register(kv)

        def report(**fields: Any) -> dict[str, Any]:
            return kv.call("report_events", {"source_id": "lmcache-0", "generation": 1, **fields})

        kv.report_events(source_id="lmcache-0", op="register", generation=1, instance_id="llm", report_mode="full")
        assert _source(kv, "lmcache-0")["report_mode"] == "full"
        report(op="register", instance_id="llm", report_mode="full")  # the same registration: no change
        for seq in range(3):  # three requests re-reporting one prefix
            report(op="events", seq=seq, events=[{"type": "add", "block_hashes": [1, 2], "token_ids": TOKENS[: 2 * B],
                                                  "block_size": B}])  # fmt: skip
        report(op="events", seq=3, events=[{"type": "remove", "block_hashes": [1, 2]}])
        assert _matched(kv, "lmcache-0", 2) == 0
        with pytest.raises(Conflict):
            report(op="register", instance_id="llm")  # another mode at the same generation
        with pytest.raises(InvalidArgument, match="report_mode"):
            report(op="heartbeat", report_mode="full")  # only register takes it
        with pytest.raises(InvalidArgument):
            report(op="register", instance_id="llm", generation=2, report_mode="all")

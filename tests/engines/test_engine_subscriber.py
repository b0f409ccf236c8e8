"""The subscriber against real publishers (FakeEnginePublisher: PUB + replay ROUTER sockets).

Every test drives ``poll_once`` itself (no thread) and waits for an *outcome* with a generous
deadline; nothing asserts on timing.
"""

from __future__ import annotations

import time

import pytest
import zmq

from kvcm.backends.metastore import LmdbStore, MemoryStore
from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.engines.service import EngineService
from kvcm.engines.sources import SubscriberSettings
from kvcm.errors import NotFound
from kvcm.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from kvcm.testing.fake_engine import FakeEnginePublisher
from tests.helpers import TIME_FACTOR, wait_for

BS = 16
TOKENS = list(range(1, 16 * BS + 1))  # 16 blocks
KEYS = token_ids_to_block_keys(TOKENS, BS)
FAST = SubscriberSettings(backoff_initial_s=0.05, backoff_max_s=0.2, replay_timeout_s=0.5, poll_ms=20)


def lookup(instance_id: str) -> int:
    if instance_id.startswith("inst"):
        return BS
    raise NotFound(f"no instance {instance_id}")


@pytest.fixture
def svc():
    service = EngineService(MemoryStore(), lookup, FAST)
    yield service
    service.stop()


@pytest.fixture
def pubs():
    made: list[FakeEnginePublisher] = []

    def make(**kw) -> FakeEnginePublisher:
        pub = FakeEnginePublisher(**kw)
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()


def pump(svc: EngineService, pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout * TIME_FACTOR
    while time.monotonic() < deadline:
        svc.subscriber.poll_once(0.01)
        if pred():
            return
    raise AssertionError(f"condition not reached; sources={svc.list_sources()}")


def add(svc: EngineService, pub: FakeEnginePublisher, source_id: str = "pod-a", **kw):
    params = {"source_id": source_id, "instance_id": "inst", "endpoint": pub.endpoint,
              "replay_endpoint": pub.replay_endpoint or None, **kw}  # fmt: skip
    return svc.add_source(params)


def matched(svc: EngineService, source_id: str = "pod-a", medium: str = "GPU", **kw) -> int:
    for entry in svc.match("inst", block_keys=KEYS, **kw)["sources"]:
        if entry["source_id"] == source_id:
            return entry["media"].get(medium, 0)
    return 0


def info(svc: EngineService, source_id: str = "pod-a") -> dict:
    return next(s for s in svc.list_sources()["sources"] if s["source_id"] == source_id)


def store_blocks(pub: FakeEnginePublisher, first: int, count: int, **kw) -> int:
    """Publish blocks ``first .. first+count-1`` of TOKENS as one event, hashes 100+i."""
    parent = None if first == 0 else 100 + first - 1
    toks = TOKENS[first * BS : (first + count) * BS]
    return pub.store([100 + i for i in range(first, first + count)], toks, parent=parent, block_size=BS, **kw)


@pytest.mark.parametrize("encoding,style", [("map", "topic"), ("array", "legacy"), ("mixed", "topic")])
def test_initial_replay_recovers_what_was_published_before_connecting(svc, pubs, encoding, style):
    pub = pubs(encoding=encoding, replay_style=style, topic="kv@pod-a")
    store_blocks(pub, 0, 4)
    store_blocks(pub, 4, 2)
    add(svc, pub, topic="kv@pod-a")
    pump(svc, lambda: matched(svc) == 6)
    assert pub.replay_requests[0] == 0
    assert info(svc)["last_seq"] == 1 and info(svc)["connected"]


def test_dropped_range_is_healed_by_replay_exactly_once(svc, pubs):
    pub = pubs()
    add(svc, pub)
    store_blocks(pub, 0, 1)
    pump(svc, lambda: matched(svc) == 1 and not info(svc)["replaying"])
    pub.drop_next(3)
    for i in range(1, 8):
        store_blocks(pub, i, 1)
    pump(svc, lambda: matched(svc) == 8)
    src = info(svc)
    assert src["missed"] == 3 and src["last_seq"] == 7
    assert 1 in pub.replay_requests  # from last_seq + 1
    assert svc.index.blocks_held("pod-a") == {"GPU": 8}
    # exactly once: every block's holding count is 1 (a double apply would make it 2)
    assert all(b.refs == {"GPU": 1} for b in svc.index.get("pod-a").blocks.values())
    text = _metrics_text(svc)
    assert 'kvcm_engine_event_missed_events_total{source="pod-a"} 3.0' in text


def test_reconnect_after_publisher_dies_and_comes_back(svc, pubs):
    pub = pubs()
    add(svc, pub)
    store_blocks(pub, 0, 2)
    pump(svc, lambda: matched(svc) == 2)
    pub.stop()
    pump(svc, lambda: not info(svc)["connected"])
    pub.start()  # same engine, same seq numbering; the next batch is published before we reconnect
    store_blocks(pub, 2, 2)
    pump(svc, lambda: matched(svc) == 4)
    src = info(svc)
    assert src["connections"] >= 2 and src["disconnections"] >= 1 and src["restarts"] == 0
    assert src["last_seq"] == 1


def test_publisher_restart_clears_the_source_and_rebuilds(svc, pubs):
    pub = pubs()
    add(svc, pub)
    store_blocks(pub, 0, 6)
    pump(svc, lambda: matched(svc) == 6)
    pub.restart()  # a new engine process: seq 0, empty cache
    store_blocks(pub, 0, 2)
    pump(svc, lambda: info(svc)["restarts"] >= 1 and matched(svc) == 2)
    assert svc.index.blocks_held("pod-a") == {"GPU": 2}


def test_live_seq_going_back_is_a_restart(svc, pubs):
    pub = pubs(replay_endpoint="")  # no replay: detection must come from the live stream
    add(svc, pub)
    while matched(svc) == 0:  # the slow joiner: repeat until the subscription is live
        store_blocks(pub, 0, 1)
        svc.subscriber.poll_once(0.02)
    for i in range(1, 4):
        store_blocks(pub, i, 1)
    pump(svc, lambda: matched(svc) == 4)
    pub.seq = 0  # restart without the socket noticing
    store_blocks(pub, 0, 1)
    pump(svc, lambda: info(svc)["restarts"] == 1)
    pump(svc, lambda: matched(svc) == 1)


def test_all_blocks_cleared_clears_only_that_source(svc, pubs):
    a, b = pubs(), pubs()
    add(svc, a, "pod-a")
    add(svc, b, "pod-b")
    store_blocks(a, 0, 3)
    store_blocks(b, 0, 5)
    pump(svc, lambda: matched(svc, "pod-a") == 3 and matched(svc, "pod-b") == 5)
    a.clear()
    pump(svc, lambda: matched(svc, "pod-a") == 0)
    assert matched(svc, "pod-b") == 5
    assert svc.index.blocks_held("pod-a") == {}


def test_overlapping_sources_remove_from_one_leaves_the_other(svc, pubs):
    a, b = pubs(), pubs()
    add(svc, a, "pod-a")
    add(svc, b, "pod-b")
    store_blocks(a, 0, 4)
    store_blocks(b, 0, 4)
    store_blocks(b, 4, 2)
    pump(svc, lambda: matched(svc, "pod-a") == 4 and matched(svc, "pod-b") == 6)
    a.remove([102])  # pod-a evicts its block 2
    pump(svc, lambda: matched(svc, "pod-a") == 2)
    assert matched(svc, "pod-b") == 6
    ranking = [s["source_id"] for s in svc.match("inst", block_keys=KEYS)["sources"]]
    assert ranking == ["pod-b", "pod-a"]
    svc.remove_source("pod-b")
    pump(svc, lambda: "pod-b" not in svc.subscriber.snapshot())
    assert matched(svc, "pod-b") == 0 and matched(svc, "pod-a") == 2
    assert 'source="pod-b"' not in _metrics_text(svc)
    # The same id again: its series come back (nothing kept from the removed one, however cached).
    again = pubs()
    add(svc, again, "pod-b")
    store_blocks(again, 0, 3)
    pump(svc, lambda: matched(svc, "pod-b") == 3)
    text = _metrics_text(svc)
    assert 'kvcm_engine_event_events_processed_total{event_type="BlockStored",source="pod-b"} 1.0' in text, text
    assert 'kvcm_engine_event_last_sequence_id{source="pod-b"} 0.0' in text, text


def test_dp_ranks_are_separate_sources(svc, pubs):
    rank0, rank1 = pubs(data_parallel_rank=0), pubs(data_parallel_rank=1)
    add(svc, rank0, "pod-a/dp0", dp_rank=0)
    add(svc, rank1, "pod-a/dp1", dp_rank=1)
    store_blocks(rank0, 0, 2)
    store_blocks(rank1, 0, 7)
    pump(svc, lambda: matched(svc, "pod-a/dp0") == 2 and matched(svc, "pod-a/dp1") == 7)
    best = svc.match("inst", block_keys=KEYS)["sources"][0]
    assert (best["source_id"], best["dp_rank"], best["matched_blocks"]) == ("pod-a/dp1", 1, 7)
    assert info(svc, "pod-a/dp0")["errors_by_kind"] == {}


def test_host_form_offsets_ports_by_dp_rank(svc):
    out = svc.add_source({"source_id": "h", "instance_id": "inst", "host": "::1", "dp_rank": 2})
    assert out["source"]["endpoint"] == "tcp://[::1]:5559"
    assert out["source"]["replay_endpoint"] == "tcp://[::1]:5560"


def test_garbage_between_good_payloads_is_counted_and_skipped(svc, pubs):
    pub = pubs()
    add(svc, pub)
    store_blocks(pub, 0, 1)
    pub.publish_raw(b"\xc1garbage")
    pub.publish_raw(encode_batch([BlockStored([1], None, [1], 1), AllBlocksCleared()], 1.0)[:-5])
    pub.publish([{"not": "an event"}] if False else [])  # an empty batch is fine
    store_blocks(pub, 1, 2)
    pump(svc, lambda: matched(svc) == 3)
    src = info(svc)
    assert src["errors_by_kind"].get("decode") == 2 and src["missed"] == 0 and src["last_seq"] == 4


def test_silent_replay_endpoint_does_not_stall_other_sources(svc, pubs):
    silent, good = pubs(replay_style="silent"), pubs()
    add(svc, silent, "pod-silent")
    add(svc, good, "pod-good")
    store_blocks(good, 0, 3)
    pump(svc, lambda: matched(svc, "pod-good") == 3)
    pump(svc, lambda: info(svc, "pod-silent")["connected"])
    store_blocks(silent, 0, 2)  # held until the replay times out, then applied
    store_blocks(good, 3, 1)
    pump(svc, lambda: matched(svc, "pod-good") == 4)
    pump(svc, lambda: matched(svc, "pod-silent") == 2)
    assert info(svc, "pod-silent")["replay_failures"] >= 1
    assert info(svc, "pod-good")["replay_failures"] == 0


def test_ipc_endpoints(svc, pubs, tmp_path):
    base = f"ipc://{tmp_path}/e"
    if len(base) > 90:
        pytest.skip("tmp path too long for an ipc socket")
    pub = pubs(endpoint=base + ".pub", replay_endpoint=base + ".replay")
    store_blocks(pub, 0, 2)
    add(svc, pub)
    pump(svc, lambda: matched(svc) == 2)


def test_ipv6_endpoint(svc, pubs):
    try:
        pub = pubs(endpoint="tcp://[::1]:*", replay_endpoint="tcp://[::1]:*")
    except zmq.ZMQError:
        pytest.skip("no IPv6 loopback here")
    store_blocks(pub, 0, 2)
    add(svc, pub)
    pump(svc, lambda: matched(svc) == 2)


def test_kvcm_restart_resumes_from_last_seq_plus_one(tmp_path, pubs):
    pub = pubs()
    store = LmdbStore(str(tmp_path / "eng"), sync=False)
    first = EngineService(store, lookup, FAST)
    add(first, pub)
    store_blocks(pub, 0, 3)
    pump(first, lambda: matched(first) == 3)
    first.stop()
    store.close()
    store_blocks(pub, 3, 2)  # published while kvcm is down: only replay can bring it
    store = LmdbStore(str(tmp_path / "eng"), sync=False)
    second = EngineService(store, lookup, FAST)
    try:
        assert matched(second) == 3  # restored from disk before any event arrives
        assert info(second)["last_seq"] == 0
        pump(second, lambda: matched(second) == 5)
        # asked from last_seq (its batch proves the same publisher), applied from last_seq + 1:
        # the stored blocks were not applied twice
        assert pub.replay_requests[-1] == 0
        assert all(b.refs == {"GPU": 1} for b in second.index.get("pod-a").blocks.values())
        assert info(second)["last_seq"] == 1 and info(second)["restarts"] == 0
    finally:
        second.stop()
        store.close()


def test_unknown_instance_is_refused(svc, pubs):
    pub = pubs()
    with pytest.raises(NotFound):
        svc.add_source({"source_id": "x", "instance_id": "nope", "endpoint": pub.endpoint})


def test_subscriber_thread_runs_and_stops(pubs):
    pub = pubs()
    service = EngineService(None, lookup, FAST)
    service.start()
    try:
        add(service, pub)
        store_blocks(pub, 0, 2)
        wait_for(lambda: matched(service) == 2, timeout=10 * TIME_FACTOR, interval=0.02)
        assert matched(service) == 2
    finally:
        service.stop()


def _metrics_text(svc: EngineService) -> str:
    from prometheus_client import generate_latest

    return generate_latest(svc.metrics.registry).decode()


def test_restart_that_overtakes_last_seq_is_still_detected(svc, pubs):
    pub = pubs()
    add(svc, pub)
    for i in range(3):
        store_blocks(pub, i, 1)  # seq 0..2
    pump(svc, lambda: matched(svc) == 3)
    pub.restart()
    store_blocks(pub, 0, 1)  # the new engine: seq 0..4, beyond our last_seq 2
    for _ in range(4):
        pub.remove([100])
        store_blocks(pub, 0, 1)
    # its batch 2 is not the one we applied as 2 (newer ts): clear, rebuild from 0
    pump(svc, lambda: info(svc)["restarts"] >= 1 and info(svc)["last_seq"] == 8)
    assert svc.index.blocks_held("pod-a") == {"GPU": 1}
    assert matched(svc) == 1


def test_malformed_frames_are_counted_and_skipped(svc, pubs):
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    try:
        svc.add_source({"source_id": "raw", "instance_id": "inst", "endpoint": f"tcp://127.0.0.1:{port}"})
        good = encode_batch([BlockStored([100], None, TOKENS[:BS], BS, None, "GPU", None)], time.time(), 0)
        deadline = time.monotonic() + 10 * TIME_FACTOR
        while matched(svc, "raw") == 0 and time.monotonic() < deadline:  # slow joiner
            raw.send_multipart([b"", b"\x00" * 7, good])  # 7-byte seq
            raw.send_multipart([b"only one frame"])
            raw.send_multipart([b"", (0).to_bytes(8, "big"), good])
            svc.subscriber.poll_once(0.02)
        assert matched(svc, "raw") == 1
        assert info(svc, "raw")["errors_by_kind"]["bad_frames"] >= 2
    finally:
        raw.close(0)
        ctx.term()


def test_unusable_endpoint_backs_off_without_hurting_others(svc, pubs):
    good = pubs()
    svc.add_source({"source_id": "bad", "instance_id": "inst", "endpoint": "tcp://no-port-here"})
    add(svc, good, "pod-good")
    store_blocks(good, 0, 2)
    pump(svc, lambda: matched(svc, "pod-good") == 2)
    pump(svc, lambda: info(svc, "bad")["errors_by_kind"].get("connect", 0) >= 2)  # retried after backoff
    text = _metrics_text(svc)
    for family in ("connections_total", "events_received_total", "events_processed_total", "errors_total",
                   "replay_requests_total", "connection_status", "last_sequence_id", "processing_latency_seconds"):
        assert f"kvcm_engine_event_{family}" in text, family


def test_event_series_count_every_event_by_type(svc, pubs):
    """``_events_received_total`` counts each decoded event, ``_events_processed_total`` each
    applied one, by type; ``_last_sequence_id`` follows the batches."""
    pub = pubs()
    add(svc, pub)
    toks = TOKENS[: 3 * BS]
    pub.publish([
        BlockStored([100], None, toks[:BS], BS, None, "GPU", None),
        BlockStored([101, 102], 100, toks[BS:], BS, None, "GPU", None),
        BlockRemoved([102], "GPU"),
    ])  # fmt: skip
    store_blocks(pub, 2, 1)
    pump(svc, lambda: matched(svc) == 3)
    text = _metrics_text(svc)
    for family, event_type, n in [("received", "BlockStored", 3), ("received", "BlockRemoved", 1),
                                  ("processed", "BlockStored", 3), ("processed", "BlockRemoved", 1)]:  # fmt: skip
        line = f'kvcm_engine_event_events_{family}_total{{event_type="{event_type}",source="pod-a"}} {n}.0'
        assert line in text, text
    assert 'kvcm_engine_event_last_sequence_id{source="pod-a"} 1.0' in text, text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies on purpose
def test_running_is_false_once_the_thread_is_gone():
    """``report_events`` persists each report inline while no subscriber thread flushes: a loop
    that ended any way other than stop() must not read as running."""
    svc = EngineService(MemoryStore(), lambda _: BS)
    try:
        svc.start()
        assert svc.subscriber.running
        svc.subscriber.poll_once = lambda timeout=0.1: (_ for _ in ()).throw(SystemExit)  # not caught by the loop
        svc.subscriber._thread.join(5 * TIME_FACTOR)
        assert not svc.subscriber._thread.is_alive() and not svc.subscriber.running
    finally:
        svc.stop()

"""kvcm's own event publisher (consumed by kvcm's own subscriber), the event log, RPCs and CLI."""

from __future__ import annotations

import argparse
import base64
import json
import threading
import time

import msgpack
import pytest
import zmq

from kvcm.api.engines import AddEventSourceRequest, MatchEnginesRequest, methods
from kvcm.backends.metastore import MemoryStore
from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.engines.cli import add_events_parser, run_events
from kvcm.engines.service import EngineService
from kvcm.engines.sources import SubscriberSettings
from kvcm.errors import InvalidArgument, NotFound
from kvcm.proto.kv_events import BlockRemoved, BlockStored, decode_batch
from kvcm.publish.eventlog import EventLog
from kvcm.publish.publisher import EventPublisher
from kvcm.testing.fake_engine import FakeEnginePublisher
from tests.helpers import TIME_FACTOR, wait_until

FAST = SubscriberSettings(backoff_initial_s=0.05, backoff_max_s=0.2, replay_timeout_s=0.5, poll_ms=20)
TOKENS = list(range(1000, 1000 + 16 * 8))
KEYS = token_ids_to_block_keys(TOKENS, 16)


def lookup(instance_id: str) -> int:
    if instance_id == "inst":
        return 16
    raise NotFound(instance_id)


def wait(step, pred, timeout=10.0):
    deadline = time.monotonic() + timeout * TIME_FACTOR
    while time.monotonic() < deadline:
        step()
        if pred():
            return
    raise AssertionError("condition not reached")


@pytest.fixture
def publisher():
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kvcm")
    yield pub
    pub.stop()


def test_kvcm_events_are_consumable_by_a_vllm_subscriber(publisher):
    # kvcm's subscriber follows kvcm's publisher like any engine: storage keys map back 1:1
    publisher.block_stored("inst", KEYS[:4], None, TOKENS[:64], 16, "FILE")
    publisher.block_stored("inst", KEYS[4:6], KEYS[3], TOKENS[64:96], 16, "FILE")
    publisher.poll_once(0)
    svc = EngineService(MemoryStore(), lookup, FAST)
    try:
        svc.add_source({"source_id": "kvcm", "instance_id": "inst", "endpoint": publisher.endpoint,
                        "replay_endpoint": publisher.replay_endpoint, "topic": "kvcm"})  # fmt: skip

        def step():
            publisher.poll_once(0.005)
            svc.subscriber.poll_once(0.005)

        def held(n):
            return lambda: svc.match("inst", block_keys=KEYS)["sources"] and \
                svc.match("inst", block_keys=KEYS)["sources"][0]["media"].get("FILE") == n

        wait(step, held(6))  # via replay from 0: published before the subscriber existed
        publisher.block_removed("inst", [KEYS[2]], "FILE")
        wait(step, held(2))
        publisher.all_cleared("inst")
        wait(step, lambda: svc.match("inst", block_keys=KEYS)["sources"] == [])
    finally:
        svc.stop()


def test_published_payload_shape_and_replay_frames(publisher):
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    try:
        publisher.block_stored("inst", [-1], None, [], 0)
        publisher.block_removed("inst", [5])
        publisher.poll_once(0)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        wait(lambda: publisher.poll_once(0.01), lambda: dealer.poll(0))
        while dealer.poll(1000):
            frames.append(dealer.recv_multipart())
            if frames[-1][2] == b"\xff" * 8:
                break
        assert [f[1] for f in frames] == [b"kvcm", b""]
        payload = frames[0][3]
        assert payload[:1] == b"\x83"  # a map-shaped batch, like current vLLM main
        batch = decode_batch(payload)
        assert batch.events == [BlockStored([2**64 - 1], None, [], 0, None, "STORAGE", None), BlockRemoved([5], "STORAGE")]
        raw = msgpack.unpackb(payload)
        assert [e["instance_id"] for e in raw["events"]] == ["inst", "inst"]
    finally:
        dealer.close(0)
        ctx.term()


def test_publisher_thread_and_full_queue_leaves_a_gap():
    pub = EventPublisher("tcp://127.0.0.1:*", None, max_queue=2)
    try:
        for key in range(5):
            pub.block_removed("inst", [key])
        assert pub.dropped._value.get() == 3
        pub.poll_once(0)
        assert pub.seq == 2  # one seq skipped for the drops, one for the batch
        pub.start()
        pub.all_cleared("inst")
        wait_until(lambda: pub.seq == 3, interval=0.01)
    finally:
        pub.stop()
        pub.stop()  # idempotent


def test_event_log_is_read_by_the_optimizer(tmp_path):
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path)
    log.get_cache_location("inst", "prefix_match", KEYS[:2], TOKENS[:32], {"offset": 0})
    log.start_write_cache("inst", "s1", KEYS[:4], TOKENS[:64], {"offset": 2}, ["default"], 30)
    log.finish_write_cache("inst", "s1", {"offset": 2})
    log.cache_reclaim_submit("inst", KEYS[:1], [["loc-1"]], 1000)
    log.close()
    with open(path) as f:
        lines = [json.loads(x) for x in f]
    assert [x["type"] for x in lines] == ["GetCacheLocation", "StartWriteCache", "FinishWriteCache", "CacheReclaimSubmit"]
    assert all({"id", "source", "component", "type", "trigger_time_us"} <= set(x) for x in lines)
    assert lines[3]["component"] == "cache_reclaimer"
    from kvcm.optimizer import trace_readers as traces
    records = list(traces.read_trace(path, "kvcm_events", block_size=16))
    assert [r.op for r in records] == ["read", "write"]
    with pytest.raises(ValueError):
        EventLog(str(tmp_path / "x.jsonl")).write({"type": "Nope"})


def test_rpc_methods_and_validation():
    svc = EngineService(MemoryStore(), lookup, FAST)
    table = {m.name: m for m in methods(svc)}
    with FakeEnginePublisher() as pub:
        pub.store([1, 2], TOKENS[:32], block_size=16)
        out = table["add_event_source"].handler(AddEventSourceRequest(
            source_id="p", instance_id="inst", endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint))
        assert out["source"]["source_id"] == "p"
        wait(lambda: svc.subscriber.poll_once(0.01),
             lambda: table["list_event_sources"].handler(table["list_event_sources"].request())["sources"][0]["blocks_held"] == 2)
        res = msgpack.unpackb(table["match_engines"].handler(MatchEnginesRequest(instance_id="inst", token_ids=TOKENS)).data)
        assert res["num_blocks"] == 8 and res["sources"][0]["media"] == {"GPU": 2}
        res = msgpack.unpackb(table["match_engines"].handler(MatchEnginesRequest(instance_id="inst", block_keys=KEYS, medium="CPU")).data)
        assert res["sources"] == []
        with pytest.raises(InvalidArgument):
            table["match_engines"].handler(MatchEnginesRequest(instance_id="inst"))
        with pytest.raises(NotFound):
            table["match_engines"].handler(MatchEnginesRequest(instance_id="other", block_keys=[1]))
        for bad in ({"endpoint": "http://x"}, {}, {"host": "h", "endpoint": "tcp://h:1"}, {"host": "h", "dp_rank": -1}):
            with pytest.raises(InvalidArgument):
                svc.add_source({"source_id": "q", "instance_id": "inst", **bad})
        table["remove_event_source"].handler(table["remove_event_source"].request(source_id="p"))
        with pytest.raises(NotFound):
            svc.remove_source("p")
    svc.stop()


def test_static_sources_from_config(tmp_path):
    cfg = [json.dumps({"source_id": "s0", "instance_id": "inst", "host": "127.0.0.1", "port": 1, "replay": False})]
    svc = EngineService(MemoryStore(), lookup, FAST, static_sources=cfg)
    [src] = svc.list_sources()["sources"]
    assert src["static"] and src["endpoint"] == "tcp://127.0.0.1:1" and src["replay_endpoint"] is None
    svc.stop()


def test_cli_record_and_decode(tmp_path, capsys):
    out = tmp_path / "rec.jsonl"
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_events_parser(sub)
    with FakeEnginePublisher(encoding="array") as pub:
        pub.store([1], TOKENS[:16], block_size=16)  # buffered: comes through --replay
        args = parser.parse_args(["events", "record", pub.endpoint, "--out", str(out), "--replay",
                                  pub.replay_endpoint, "--count", "3", "--duration", "20"])  # fmt: skip
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(run_events(args)))
        thread.start()
        deadline = time.monotonic() + 20 * TIME_FACTOR
        while thread.is_alive() and time.monotonic() < deadline:
            pub.remove([1])  # until the recorder's subscription is live
            time.sleep(0.02)  # pacing the real recorder: remove again until its subscription is live
        thread.join()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert result == [0] and len(lines) == 3
    assert set(lines[0]) == {"ts", "source", "seq", "topic", "payload_b64"}
    assert decode_batch(base64.b64decode(lines[0]["payload_b64"])).events[0].block_hashes == [1]
    assert run_events(parser.parse_args(["events", "decode", str(out)])) == 0
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert printed[0]["events"][0]["type"] == "BlockStored"

"""kvcm's own storage-tier events: vLLM-format PUB stream, the JSON-lines event log read back by
the optimizer, and engine holders folded into get_cache_location."""

from __future__ import annotations

import json
import time

import zmq

from kvcm.optimizer.trace_readers import read_trace
from kvcm.proto.kv_events import decode_batch
from kvcm.testing import FakeEnginePublisher, serve_in_thread
from tests.helpers import TIME_FACTOR, wait_for

BLOCK = 4
INSTANCE = {"instance_group": "default", "instance_id": "llm", "block_size": BLOCK,
            "location_spec_infos": [{"name": "tp0", "size": 256}]}


def _events(sub: zmq.Socket, want: int, timeout: float = 10.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < want and sub.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        _topic, _seq, payload = sub.recv_multipart()
        out.extend(decode_batch(payload).events)
    return out


def test_publisher_and_event_log(tmp_path):
    log_path = tmp_path / "events.jsonl"
    sock = f"ipc://{tmp_path}/pub"
    overrides = {"publisher": {"enabled": True, "endpoint": sock, "replay_endpoint": f"ipc://{tmp_path}/rep",
                               "event_log": str(log_path)}}
    tokens = list(range(1, 13))  # 3 blocks
    with serve_in_thread(overrides=overrides) as server, server.client() as kv:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(sock)
        time.sleep(0.3 * TIME_FACTOR)  # PUB/SUB slow joiner: a subscription's arrival cannot be observed
        kv.call("register_instance", INSTANCE)
        started = kv.call("start_write_cache", {"instance_id": "llm", "token_ids": tokens})
        kv.call("finish_write_cache", {"instance_id": "llm", "write_session_id": started["write_session_id"],
                                         "success_blocks": {"offset": 3}})
        stored = _events(sub, 1)
        assert type(stored[0]).__name__ == "BlockStored" and len(stored[0].block_hashes) == 3
        assert stored[0].medium == "STORAGE"

        kv.call("get_cache_location", {"instance_id": "llm", "query_type": "prefix_match", "token_ids": tokens})
        kv.call("remove_cache", {"instance_id": "llm", "token_ids": tokens})
        removed = _events(sub, 1)
        assert type(removed[0]).__name__ == "BlockRemoved" and sorted(removed[0].block_hashes) == sorted(stored[0].block_hashes)
        sub.close(0)

    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [e["type"] for e in events] == ["StartWriteCache", "FinishWriteCache", "GetCacheLocation"]
    start, finish, lookup = events
    assert start["write_session_id"] == finish["write_session_id"] == started["write_session_id"]
    assert start["tokens"] == tokens and len(start["keys"]) == 3 and start["block_mask"] == {"offset": 0}
    assert finish["success_block"] == {"offset": 3}
    assert lookup["query_type"] == "prefix_match" and lookup["keys"] == start["keys"]
    assert lookup["tokens"] == tokens and lookup["block_mask"] is None
    records = list(read_trace(log_path, "kvcm_events"))
    ops = [r.op for r in records]
    assert ops, "the event log produced no trace records"
    assert all(r.instance == "llm" for r in records)
    assert any(len(r.keys) == 3 for r in records)


def test_get_cache_location_includes_engine_holders():
    tokens = list(range(50, 58))  # 2 blocks
    with serve_in_thread() as server, FakeEnginePublisher().start() as engine, server.client() as kv:
        kv.call("register_instance", INSTANCE)
        kv.call("add_event_source", {"source_id": "pod-a", "instance_id": "llm", "endpoint": engine.endpoint,
                                     "replay_endpoint": engine.replay_endpoint})
        engine.store([7, 8], tokens, block_size=BLOCK)
        def engine_holders() -> list:
            return kv.call("get_cache_location", {"instance_id": "llm", "query_type": "batch_get",
                                                  "token_ids": tokens, "include_engines": True})["engine_locations"]

        wait_for(lambda: all(engine_holders()))
        holders = engine_holders()
        assert len(holders) == 2 and all(h and h[0]["source_id"] == "pod-a" for h in holders)
        plain = kv.call("get_cache_location", {"instance_id": "llm", "query_type": "batch_get", "token_ids": tokens})
        assert "engine_locations" not in plain

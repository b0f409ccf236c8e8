"""The engine tier through a real kvcm server: a fake vLLM engine publishes, a router asks."""

from __future__ import annotations

import pytest

from kvcm.errors import NotFound
from kvcm.testing import FakeEnginePublisher, serve_in_thread
from tests.helpers import wait_for

BLOCK = 4




def test_router_sees_engine_blocks_over_rpc():
    tokens = list(range(100, 116))  # 4 full blocks
    with serve_in_thread() as server, FakeEnginePublisher().start() as engine, server.client() as kv:
        kv.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": BLOCK,
                                      "location_spec_infos": [{"name": "tp0", "size": 1024}]})
        kv.call("add_event_source", {"source_id": "pod-a", "instance_id": "llm", "endpoint": engine.endpoint,
                                     "replay_endpoint": engine.replay_endpoint})
        engine.store([11, 12, 13], tokens[:12], block_size=BLOCK)

        def matched():
            reply = kv.call("match_engines", {"instance_id": "llm", "token_ids": tokens})
            return reply["sources"] and reply["sources"][0]["matched_blocks"] == 3 and reply

        reply = wait_for(matched)
        assert reply, "engine blocks never became visible"
        assert reply["sources"][0]["source_id"] == "pod-a" and reply["sources"][0]["media"] == {"GPU": 3}
        listed = kv.call("list_event_sources", {})["sources"]
        assert listed[0]["source_id"] == "pod-a" and listed[0]["last_seq"] >= 0

        engine.remove([13])
        assert wait_for(lambda: kv.call("match_engines", {"instance_id": "llm", "token_ids": tokens})
                     ["sources"][0]["matched_blocks"] == 2)
        kv.call("remove_event_source", {"source_id": "pod-a"})
        assert kv.call("match_engines", {"instance_id": "llm", "token_ids": tokens})["sources"] == []
        with pytest.raises(NotFound):
            kv.call("add_event_source", {"source_id": "x", "instance_id": "nope", "endpoint": engine.endpoint})

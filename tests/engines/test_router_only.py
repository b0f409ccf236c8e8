"""A router-only instance: registered without storage specs, used by the engine tier alone."""

from __future__ import annotations

import pytest

from kvcm.errors import InvalidArgument
from kvcm.testing import FakeEnginePublisher, serve_in_thread
from tests.helpers import wait_for

BLOCK = 4
TOKENS = list(range(100, 132))  # 8 full blocks


def test_router_only_instance_follows_engines_and_refuses_writes():
    with serve_in_thread() as server, server.client() as kv, FakeEnginePublisher() as engine:
        params = {"instance_group": "default", "instance_id": "llm", "block_size": BLOCK}
        assert kv.call("register_instance", params)["created"] is True
        assert kv.call("get_instance_info", {"instance_id": "llm"})["instance_info"]["location_spec_infos"] == []
        kv.call("add_event_source", {"source_id": "pod-a", "instance_id": "llm", "endpoint": engine.endpoint,
                                     "replay_endpoint": engine.replay_endpoint})
        engine.store([1, 2, 3], TOKENS[: 3 * BLOCK], block_size=BLOCK, medium="GPU")

        def held() -> bool:
            reply = kv.call("match_engines", {"instance_id": "llm", "token_ids": TOKENS})
            return any(s["source_id"] == "pod-a" and s["media"].get("GPU") == 3 for s in reply["sources"])

        assert wait_for(held), "the engine's blocks never showed"
        with pytest.raises(InvalidArgument, match="router-only instance"):
            kv.call("start_write_cache", {"instance_id": "llm", "block_keys": [1, 2]})
        located = kv.call("get_cache_location", {"instance_id": "llm", "query_type": "prefix_match",
                                                 "token_ids": TOKENS})
        assert located["locations"] == []
        assert kv.call("register_instance", params)["created"] is False  # the same registration again

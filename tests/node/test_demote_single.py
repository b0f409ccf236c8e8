"""``leader_demote`` on a node without the lease (``ha.enabled`` off), Tair's semantics: the node
stops leading for its campaign delay (``is_leader`` false, writes refused with
``SERVER_NOT_LEADER`` naming no leader, reads answered, nobody leads), then leads again alone.
A real server over its RPC port (kvcm.Client) and its side HTTP port (Tair's routes)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import requests

import kvcm.client
from kvcm import Client
from kvcm.errors import KvcmError
from kvcm.testing import serve_in_thread
from tests.helpers import TIME_FACTOR, locate, register, start, wait_until, write

HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


@pytest.fixture
def server():
    with serve_in_thread() as running:
        yield running


def _health(c: Client) -> bool:
    return bool(c.call("check_health", {})["is_leader"])


def test_a_demoted_single_node_follows_for_the_campaign_delay_then_leads_again(server, monkeypatch):
    delay_s = 3.0 * TIME_FACTOR  # long enough for the checks below to run inside it
    with Client(server.endpoint) as c:
        register(c)
        write(c, [1, 2])
        c.call("update_leader_elector_config", {"campaign_delay_time_ms": int(delay_s * 1000)})
        assert _health(c)
        demoted_at = time.monotonic()
        reply = c.call("leader_demote", {})
        assert reply["demoted"] is True and reply["campaign_delay_time_ms"] == int(delay_s * 1000)

        assert _health(c) is False
        cluster = c.call("get_manager_cluster_info", {})
        assert cluster["leader"] is False and cluster["leader_node_id"] == ""  # nobody leads
        monkeypatch.setattr(kvcm.client, "MAX_FOLLOWS", 0)  # the refusal itself, not the client's retry
        with pytest.raises(KvcmError) as refused:
            start(c, [3])
        assert refused.value.code.name == "SERVER_NOT_LEADER"
        assert "leader_endpoint" not in refused.value.detail  # no leader to follow
        assert len(locate(c, [1, 2])) == 2  # reads answered, as a follower's
        with pytest.raises(KvcmError) as again:  # Tair: a node that does not lead cannot demote
            c.call("leader_demote", {})
        assert again.value.code.name == "SERVER_NOT_LEADER"
        assert time.monotonic() - demoted_at < delay_s, "the checks did not run inside the delay"

        wait_until(lambda: _health(c), timeout=delay_s + 5, what="the node did not lead again")
        assert time.monotonic() - demoted_at >= delay_s - 0.05  # not before its delay ended
        write(c, [3])
        assert len(locate(c, [1, 2, 3])) == 3
        assert c.call("get_manager_cluster_info", {})["leader"] is True


def test_a_client_rides_through_a_demote(server):
    """The refusal names no leader, so kvcm's client pauses and asks again (as during a
    failover): a write sent during the delay lands once the node leads again."""
    with Client(server.endpoint) as c:
        register(c)
        c.call("update_leader_elector_config", {"campaign_delay_time_ms": 1000})
        demoted_at = time.monotonic()
        c.call("leader_demote", {})
        write(c, [7])
        assert time.monotonic() - demoted_at >= 0.95
        assert len(locate(c, [7])) == 1


class Tair:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/api/"

    def call(self, method: str, body: object, code: str = "OK") -> dict:
        reply = requests.post(self.url + method, data=json.dumps(body), headers=HEADERS, timeout=10)
        data = reply.json()
        assert data["header"]["status"]["code"] == code, (method, data)
        return data


def test_tair_leader_demote_on_a_single_node(server):
    tair = Tair(server.http_port)
    instance = f"i-{uuid.uuid4().hex[:8]}"
    tair.call("registerInstance", {
        "trace_id": "t", "instance_group": "default", "instance_id": instance, "block_size": 4,
        "location_spec_infos": [{"name": "tp0", "size": "64"}],
        "model_deployment": {"model_name": "m", "dtype": "FP16", "tp_size": 1}})
    write_body = {"trace_id": "t", "instance_id": instance, "block_keys": ["1"], "write_timeout_seconds": 30}
    started = tair.call("startWriteCache", write_body)
    tair.call("finishWriteCache", {"instance_id": instance, "write_session_id": started["write_session_id"],
                                   "success_blocks": {"offset": 1}, "locations": started["locations"]})
    delay_s = 3.0 * TIME_FACTOR
    tair.call("updateLeaderElectorConfig", {"trace_id": "t", "campaign_delay_time_ms": str(int(delay_s * 1000))})
    assert tair.call("checkHealth", {"trace_id": "t"})["is_leader"] is True
    demoted_at = time.monotonic()
    tair.call("leaderDemote", {"trace_id": "t"})

    health = tair.call("checkHealth", {"trace_id": "t"})
    assert health["is_leader"] is False and health["is_health"] is True
    cluster = tair.call("getManagerClusterInfo", {"trace_id": "t"})
    assert cluster["leader_node_id"] == "" and "leader_endpoint" not in cluster
    tair.call("startWriteCache", {**write_body, "block_keys": ["2"]}, code="SERVER_NOT_LEADER")
    found = tair.call("getCacheLocation", {"instance_id": instance, "query_type": "QT_PREFIX_MATCH",
                                           "block_keys": ["1"]})
    assert len(found["locations"]) == 1
    tair.call("leaderDemote", {"trace_id": "t"}, code="SERVER_NOT_LEADER")
    assert time.monotonic() - demoted_at < delay_s, "the checks did not run inside the delay"

    wait_until(lambda: tair.call("checkHealth", {})["is_leader"], timeout=delay_s + 5,
               what="the node did not lead again")
    tair.call("startWriteCache", {**write_body, "block_keys": ["2"]})


def test_background_work_pauses_while_demoted(server):
    """A follower runs no background work: a write session that times out during the delay is
    expired only once the node leads again (the sweep runs every cache.session_check_ms)."""
    sessions = server.app.cache.sessions
    delay_s = 3.0 * TIME_FACTOR
    with Client(server.endpoint) as c:
        register(c)
        c.call("update_leader_elector_config", {"campaign_delay_time_ms": int(delay_s * 1000)})
        start(c, [9], write_timeout_seconds=0.3)
        demoted_at = time.monotonic()
        c.call("leader_demote", {})
        time.sleep(1.0)  # past the session's timeout, several sweeps
        assert len(sessions) == 1
        assert time.monotonic() - demoted_at < delay_s, "the check did not run inside the delay"
        wait_until(lambda: len(sessions) == 0, timeout=delay_s + 5, what="the session never expired")
        assert time.monotonic() - demoted_at >= delay_s - 0.05

"""Tair's reclaim triggers and limits on a real server: ``trigger_strategy.used_percentage`` as a
fraction of the quota with any positive value (above 1: never by share), ``used_size`` as a
watermark in bytes (kvcm's ``reclaim_strategy.used_bytes``) and ``meta_indexer_config.max_key_count``
as a bound on indexed blocks enforced at write time (kvcm's ``max_block_count``). Tair's side is
driven over real HTTP with a plain ``requests`` client, kvcm's over its RPC."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from kvcm.errors import KvcmError
from kvcm.testing import RunningServer, serve_in_thread
from tests.helpers import TIME_FACTOR, error_code, register, wait_until, write

SPEC = 1024  # bytes of one block: one spec, as Tair's reclaimer test registers
# Rounds often enough that "within 2 s" holds on a loaded machine; the settings are Tair's.
OVERRIDES = {"reclaim": {"interval_s": 0.25}, "cache": {"delete_poll_ms": 20}}


class Tair:
    """POST /api/<lowerCamelName> with proto3 JSON, as Tair's clients do."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/api/"
        self.session = requests.Session()

    def call(self, method: str, body: object, code: str = "OK") -> dict[str, Any]:
        reply = self.session.post(self.url + method, data=json.dumps(body), timeout=10,
                                  headers={"Content-Type": "application/json"})
        assert reply.status_code == 200, (method, reply.text)
        data: dict[str, Any] = reply.json()
        assert data["header"]["status"]["code"] == code, (method, data["header"]["status"])
        return data

    def start(self, instance: str, key: int) -> dict[str, Any]:
        return self.call("startWriteCache", {"instance_id": instance, "block_keys": [key], "token_ids": [key + 100],
                                             "write_timeout_seconds": 30})

    def write(self, instance: str, key: int) -> None:
        started = self.start(instance, key)
        self.call("finishWriteCache", {"instance_id": instance, "write_session_id": started["write_session_id"],
                                       "success_blocks": {"bool_masks": {"values": [True]}}})

    def refused(self, instance: str, key: int) -> str:
        reply = self.session.post(self.url + "startWriteCache", timeout=10, headers={"Content-Type": "application/json"},
                                  data=json.dumps({"instance_id": instance, "block_keys": [key],
                                                   "write_timeout_seconds": 30})).json()
        status = reply["header"]["status"]
        assert status["code"] != "OK", status
        return str(status["message"])



def present(server: RunningServer, instance: str, keys: list[int]) -> list[int]:
    """The keys with a serving copy, read through kvcm's RPC (what Tair's reply prints is not the point)."""
    with server.client() as c:
        metas = c.call("get_cache_meta", {"instance_id": instance, "block_keys": keys})["metas"]
    return [k for k, meta in zip(keys, metas) if meta["status"] == "serving"]


def tair_group(name: str, used_percentage: float, max_key_count: int = 0, used_size: int = 0,
               capacity: int = 32 * SPEC, file_capacity: int = 16 * SPEC) -> dict[str, Any]:
    """Tair's reclaimer test group (its integration_test reclaiming case), on kvcm's file storage."""
    return {
        "name": name, "storage_candidates": ["default-file"], "global_quota_group_name": "quota_group_test",
        "max_instance_count": 8,
        "quota": {"capacity": capacity, "quota_config": [{"storage_type": 3, "capacity": 16 * SPEC},
                                                         {"storage_type": 4, "capacity": file_capacity}]},
        "cache_config": {
            "reclaim_strategy": {"storage_unique_name": "default-file", "reclaim_policy": 1,
                                 "trigger_strategy": {"used_percentage": used_percentage, "used_size": used_size},
                                 "delay_before_delete_ms": 100},
            "data_storage_strategy": 2,
            "meta_indexer_config": {"max_key_count": max_key_count, "mutex_shard_num": 16,
                                    "meta_storage_backend_config": {"storage_type": "local", "storage_uri": "file:///x"},
                                    "meta_cache_policy_config": {"capacity": 1 << 30, "type": "LRU"}},
        },
        "user_data": "user-defined info", "version": 1,
    }


def tair_instance(tair: Tair, group: str, instance: str) -> None:
    tair.call("registerInstance", {"instance_group": group, "instance_id": instance, "block_size": 128,
                                   "model_deployment": {"model_name": "m", "dtype": "FP8", "tp_size": 1},
                                   "location_spec_infos": [{"name": "tp0", "size": SPEC}]})


@pytest.fixture
def server(tmp_path: Any) -> Iterator[RunningServer]:
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=OVERRIDES) as srv:
        yield srv


@pytest.fixture
def tair(server: RunningServer) -> Iterator[Tair]:
    assert server.http_port is not None
    client = Tair(server.http_port)
    yield client
    client.session.close()


def test_sixteen_keys_then_the_seventeenth_refused_until_a_lower_watermark_reclaims(server: RunningServer,
                                                                                   tair: Tair) -> None:
    group = tair_group("tg", used_percentage=3.2, max_key_count=16)
    tair.call("createInstanceGroup", {"instance_group": group})
    tair_instance(tair, "tg", "ti")
    for key in range(16):
        tair.write("ti", key)
    message = tair.refused("ti", 16)
    assert "block count exceeded: 16 of 16" in message and "used_percentage above 1" in message, message
    time.sleep(3 * OVERRIDES["reclaim"]["interval_s"])  # a few rounds: 3.2 never triggers by share
    assert present(server, "ti", list(range(16))) == list(range(16))
    group["cache_config"]["reclaim_strategy"]["trigger_strategy"]["used_percentage"] = 0.1
    tair.call("updateInstanceGroup", {"instance_group": {**group, "version": 2}, "current_version": 1})
    time.sleep(2)  # Tair's test: "2 sec is enough to make sure the reclaiming happen"
    tair.write("ti", 16)
    assert present(server, "ti", [16]) == [16]
    hostile = {**tair_group("bad", 0.5), "cache_config": {"meta_indexer_config": "16"}}
    reply = tair.call("createInstanceGroup", {"instance_group": hostile}, code="INVALID_ARGUMENT")
    assert "meta_indexer_config: expected an object" in reply["header"]["status"]["message"]


def test_max_block_count_evicts_in_line_when_the_group_reclaims(server: RunningServer) -> None:
    with server.client() as c:
        c.call("create_instance_group", {"instance_group": {
            "name": "g", "storage_candidates": ["default-file"], "max_block_count": 4,
            "reclaim_strategy": {"used_percentage": 3.2, "delay_before_delete_ms": 0}}})
        register(c, "a", group="g")
        for key in range(1, 5):
            write(c, [key], "a")
        assert error_code(write, c, [5], "a") == "QUOTA_EXCEEDED"
        assert error_code(write, c, [5, 6, 7, 8, 9], "a") == "QUOTA_EXCEEDED"  # never fits: nothing evicted
        c.call("update_instance_group", {"instance_group": {
            "name": "g", "reclaim_strategy": {"used_percentage": 1.0, "delay_before_delete_ms": 0}}, "current_version": 1})
        write(c, [5], "a")  # in-line: the least recently used block makes room
        metas = c.call("get_cache_meta", {"instance_id": "a", "block_keys": [1, 2, 3, 4, 5]})["metas"]
        assert [m["status"] for m in metas][1:] == ["serving"] * 4 and metas[0]["status"] != "serving", metas
        assert server.app.cache.usage("g")["keys"] == 4


def test_the_reclaimer_keeps_the_block_count_under_its_share(server: RunningServer) -> None:
    with server.client() as c:
        c.call("create_instance_group", {"instance_group": {
            "name": "g", "storage_candidates": ["default-file"], "max_block_count": 8,
            "reclaim_strategy": {"used_percentage": 0.5, "delay_before_delete_ms": 0}}})
        register(c, "a", group="g")
        for key in range(1, 4):
            write(c, [key], "a")
        time.sleep(4 * OVERRIDES["reclaim"]["interval_s"])  # 3 of 8 copies: under the 4-copy mark
        assert present(server, "a", [1, 2, 3]) == [1, 2, 3]
        write(c, [4], "a")  # 4 of 8 reached: down to 0.45 * 8, 3 copies, the oldest going
        wait_until(lambda: present(server, "a", [1, 2, 3, 4]) == [2, 3, 4], timeout=5 * TIME_FACTOR,
                   what="the block-count mark did not trigger reclaim")


def test_used_size_triggers_reclaim_at_its_byte_watermark(server: RunningServer, tair: Tair) -> None:
    group = tair_group("bytes", used_percentage=3.2, used_size=4 * SPEC, capacity=0, file_capacity=0)
    group["quota"] = {"capacity": 0}
    tair.call("createInstanceGroup", {"instance_group": group})
    tair_instance(tair, "bytes", "bi")
    got = tair.call("getInstanceGroup", {"name": "bytes"})["instance_group"]["cache_config"]["reclaim_strategy"]
    assert got["trigger_strategy"] == {"used_size": str(4 * SPEC), "used_percentage": 3.2}
    for key in range(3):
        tair.write("bi", key)
    time.sleep(4 * OVERRIDES["reclaim"]["interval_s"])  # under the mark: rounds pass, nothing goes
    assert present(server, "bi", [0, 1, 2]) == [0, 1, 2]
    tair.write("bi", 3)  # 4 KiB reached: reclaim down to 95% of it, one block, the oldest
    wait_until(lambda: present(server, "bi", [0, 1, 2, 3]) == [1, 2, 3], timeout=5 * TIME_FACTOR,
               what="used_size did not trigger reclaim")
    time.sleep(4 * OVERRIDES["reclaim"]["interval_s"])
    assert present(server, "bi", [1, 2, 3]) == [1, 2, 3]  # under the mark again: nothing more


def test_used_percentage_above_one_never_triggers_by_share(server: RunningServer) -> None:
    with server.client() as c:
        c.call("create_instance_group", {"instance_group": {
            "name": "g", "storage_candidates": ["default-file"], "quota": {"capacity": 4 * 2 * SPEC},
            "reclaim_strategy": {"used_percentage": 3.2, "delay_before_delete_ms": 0}}})
        register(c, "a", group="g")  # two specs of 1024: a block is 2 KiB
        for key in range(1, 5):
            write(c, [key], "a")
        time.sleep(4 * OVERRIDES["reclaim"]["interval_s"])
        metas = c.call("get_cache_meta", {"instance_id": "a", "block_keys": [1, 2, 3, 4]})["metas"]
        assert [m["status"] for m in metas] == ["serving"] * 4
        assert error_code(write, c, [5], "a") == "QUOTA_EXCEEDED"  # full, and no in-line eviction either
        for bad in (0.0, -1.0, float("inf")):
            with pytest.raises(KvcmError, match="used_percentage: must be a positive number"):
                c.call("update_instance_group", {"instance_group": {
                    "name": "g", "reclaim_strategy": {"used_percentage": bad}}, "current_version": 1})
        with pytest.raises(KvcmError, match="used_bytes: must not be negative"):
            c.call("update_instance_group", {"instance_group": {"name": "g", "reclaim_strategy": {"used_bytes": -1}},
                                             "current_version": 1})
        with pytest.raises(KvcmError, match="max_block_count: must not be negative"):
            c.call("update_instance_group", {"instance_group": {"name": "g", "max_block_count": -1},
                                             "current_version": 1})


def test_restart_keeps_the_triggers_and_the_bound(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=OVERRIDES) as srv, srv.client() as c:
        c.call("create_instance_group", {"instance_group": {
            "name": "g", "storage_candidates": ["default-file"], "max_block_count": 16,
            "reclaim_strategy": {"used_percentage": 3.2, "used_bytes": 12345}}})
    with serve_in_thread(data_dir=data, overrides=OVERRIDES) as srv, srv.client() as c:
        group = c.call("get_instance_group", {"name": "g"})["instance_group"]
        assert group["max_block_count"] == 16
        assert group["reclaim_strategy"]["used_percentage"] == 3.2
        assert group["reclaim_strategy"]["used_bytes"] == 12345
        assert srv.http_port is not None
        tair = Tair(srv.http_port)
        got = tair.call("getInstanceGroup", {"name": "g"})["instance_group"]["cache_config"]
        assert got["meta_indexer_config"]["max_key_count"] == "16"
        assert got["reclaim_strategy"]["trigger_strategy"] == {"used_size": "12345", "used_percentage": 3.2}
        tair.session.close()

"""The routing table both sides share, the client's routing state and the ``[shard]`` settings."""

from __future__ import annotations

import pytest

from kvcm.client_shards import MAX_ROUTES, Routes, merge
from kvcm.config import ConfigError, load
from kvcm.errors import Code, Unavailable, error_from_wire
from kvcm.proto.methods import METHODS
from kvcm.proto.shards import FAN_OUT, MAX_SHARDS, ROUTES, Kind, route_of, shard_from_detail, shards_from_map


def test_every_routed_method_exists_and_names_a_field_of_its_request():
    for method, route in ROUTES.items():
        assert method in METHODS, method
        fields = METHODS[method].request.__struct_fields__
        assert route.field.split(".")[0] in fields, (method, route.field)
    assert set(FAN_OUT) <= set(METHODS)


@pytest.mark.parametrize(("method", "params", "expected"), [
    ("get_cache_location", {"instance_id": "i1", "block_keys": [1]}, (Kind.INSTANCE, "i1")),
    ("register_instance", {"instance_group": "g", "instance_id": "i"}, (Kind.GROUP, "g")),
    ("create_instance_group", {"instance_group": {"name": "g"}}, (Kind.GROUP, "g")),
    ("list_instance_info", {"instance_group_name": ""}, None),  # all groups: fanned out, not routed
    ("list_event_sources", {}, None),
    ("add_storage", {"storage": {}}, None),
    ("get_cache_location", {"instance_id": 5}, None),
    ("get_cache_location", {"instance_id": "x" * 300}, None),
    ("create_instance_group", {"instance_group": "g"}, None),
])
def test_route_of(method, params, expected):
    assert route_of(method, params) == expected


def _wrong(shard: str, kind: str, name: str, leader: str = "tcp://b1:1", endpoints: str = "tcp://b1:1,tcp://b2:1"):
    return error_from_wire({"code": int(Code.WRONG_SHARD), "message": "elsewhere", "detail": {
        "shard": shard, "leader_endpoint": leader, "endpoints": endpoints, "kind": kind, "name": name}})


def test_a_redirect_is_learnt_and_routes_later_calls_of_that_name_only():
    routes = Routes()
    assert routes.shard_for("get_cache_location", {"instance_id": "i1"}) is None
    exc = _wrong("b", "instance", "i1")
    assert isinstance(exc, Unavailable) and exc.code is Code.WRONG_SHARD
    info = routes.learn(exc)
    assert info is not None and info.name == "b" and info.endpoints == ("tcp://b1:1", "tcp://b2:1")
    assert routes.shard_for("start_write_cache", {"instance_id": "i1"}) == info
    assert routes.shard_for("start_write_cache", {"instance_id": "i2"}) is None
    assert routes.shard_for("get_instance_group", {"name": "i1"}) is None  # a group, not the instance


def test_a_redirect_without_endpoints_or_with_foreign_ones_gives_nowhere_to_go():
    routes = Routes()
    assert routes.learn(_wrong("b", "instance", "i1", leader="", endpoints="")) is None
    assert routes.learn(_wrong("b", "instance", "i1", leader="http://x", endpoints="file:///etc/passwd")) is None
    assert shard_from_detail({"leader_endpoint": "tcp://x:1"}) is None  # no shard named


def test_routes_are_bounded():
    routes = Routes()
    for n in range(MAX_ROUTES + 5):
        routes.learn(_wrong("b", "instance", f"i{n}"))
    assert len(routes._owners) <= MAX_ROUTES
    for n in range(MAX_SHARDS + 5):  # a server naming ever more shards
        routes.learn(_wrong(f"s{n}", "instance", f"j{n}"))
    routes.take_map({"shards": [{"name": f"m{n}", "leader_endpoint": "tcp://x:1", "endpoints": []}
                                for n in range(1000)]}, [])
    assert len(routes.shards) == MAX_SHARDS


def test_shard_maps_and_merges():
    shards = shards_from_map({"shards": [
        {"name": "a", "leader_endpoint": "tcp://a1:1", "endpoints": ["tcp://a2:1"]},
        {"name": "b", "leader_endpoint": "", "endpoints": ["tcp://b1:1", 7, "http://no"]},
        {"name": 5}, "junk"]})
    assert shards["a"].endpoints == ("tcp://a1:1", "tcp://a2:1")
    assert shards["b"].endpoints == ("tcp://b1:1",)
    assert set(shards) == {"a", "b"}
    assert merge([{"instance_group": [1], "x": 1}, {"instance_group": [2, 3]}], "instance_group") == {
        "instance_group": [1, 2, 3], "x": 1}


def _shard(**values):
    return load(None, environ={}, overrides={"shard": values, "store": {"backend": "redis"},
                                             "ha": {"enabled": True, "node_id": "n1"}})


def test_shard_settings():
    cfg = _shard(directory="prod", name="s1")
    assert (cfg.shard.directory, cfg.shard.name) == ("prod", "s1")
    assert load(None, environ={}).shard.directory == ""


@pytest.mark.parametrize(("values", "extra", "message"), [
    ({"directory": "prod"}, {}, "shard.directory and shard.name go together"),
    ({"directory": "a b", "name": "s"}, {}, "shard.directory must be"),
    ({"directory": "d", "name": "s/1"}, {}, "shard.name must be"),
    ({"directory": "d", "name": "s"}, {"ha": {"enabled": False}}, "a shard"),
    ({"directory": "d", "name": "s"}, {"store": {"backend": "lmdb"}, "ha": {"enabled": False}}, "a shard"),
])
def test_bad_shard_settings_fail_naming_the_key(values, extra, message):
    overrides = {"shard": values, "store": {"backend": "redis"}, "ha": {"enabled": True, "node_id": "n1"}}
    overrides.update(extra)
    with pytest.raises(ConfigError, match=message):
        load(None, environ={}, overrides=overrides)


@pytest.mark.parametrize("url", ["redis+cluster://h:1", "redis+cluster://h:1,h2:2/0", "rediss+cluster://u:p@h:1/"])
def test_cluster_urls_are_accepted(url):
    assert load(None, environ={}, overrides={"store": {"redis_url": url}}).store.redis_url == url


@pytest.mark.parametrize("url", ["redis+cluster://h", "redis+cluster://h:x", "redis+cluster://h:1/3",
                                 "redis+cluster://h:70000", "redis+cluster://h:0",
                                 "redis+cluster://" + ",".join(f"h:{n}" for n in range(1, 18))])
def test_bad_cluster_urls_are_refused(url):
    with pytest.raises(ConfigError, match=r"store\.redis_url of a cluster"):
        load(None, environ={}, overrides={"store": {"redis_url": url}})

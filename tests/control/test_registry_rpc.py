"""Control-plane RPCs through the dispatcher: msgpack bytes in, bytes out, no sockets."""

from __future__ import annotations

import itertools
import tempfile
from typing import Any

import pytest

from kvcm.api import control as registry_api
from kvcm.api import system as system_api
from kvcm.backends.metastore import MemoryStore
from kvcm.control.registry import Registry
from kvcm.errors import Code, KvcmError
from kvcm.metrics import Metrics
from kvcm.proto import wire
from kvcm.rpc.dispatch import Dispatcher

INFO = {"node_id": "node-1", "endpoint": "tcp://127.0.0.1:6381"}

# Test storages live under /mnt (never created: these tests open no backend), /dev/shm and temp dirs.
ROOTS = ("/mnt", "/dev/shm", tempfile.gettempdir())


class Rpc:
    """Calls methods through ``Dispatcher.handle`` and unpacks the reply."""

    def __init__(self, store: Any, data_dir: str) -> None:
        self.registry = Registry(store, data_dir, allowed_roots=ROOTS)
        self.metrics = Metrics()
        table = registry_api.methods(self.registry, INFO) + system_api.methods(self.metrics, lambda: dict(INFO))
        self.dispatcher = Dispatcher(table, metrics=self.metrics, group=store.group)
        self._ids = itertools.count(1)

    def raw(self, method: str, params: dict[str, Any] | None = None) -> tuple[Any, Any]:
        msgid = next(self._ids)
        reply = self.dispatcher.handle(wire.pack_request(msgid, method, params or {}))
        got_id, error, result = wire.parse_response(reply)
        assert got_id == msgid
        return error, result

    def ok(self, method: str, params: dict[str, Any] | None = None) -> Any:
        error, result = self.raw(method, params)
        assert error is None, error
        return result

    def fail(self, method: str, params: dict[str, Any] | None, code: Code) -> str:
        error, _result = self.raw(method, params)
        assert error is not None and error["code"] == int(code) and error["name"] == code.name, error
        return str(error["message"])


@pytest.fixture
def rpc(store, tmp_path):
    return Rpc(store, str(tmp_path / "data"))


NFS = {
    "global_unique_name": "nfs1",
    "storage_type": "file",
    "storage_spec": {"root_path": "/mnt/nfs/", "key_count_per_file": 8},
}
GROUP = {"name": "g1", "storage_candidates": ["nfs1"], "quota": {"capacity": 1 << 40}}
REGISTER = {
    "trace_id": "t-1",
    "instance_group": "g1",
    "instance_id": "i1",
    "block_size": 64,
    "location_spec_infos": [{"name": "tp0", "size": 4096}, {"name": "tp1", "size": 4096}],
    "location_spec_groups": [{"name": "full", "spec_names": ["tp1", "tp0"]}],
    "model_deployment": {"model_name": "qwen", "dtype": "bf16", "tp_size": 2},
}


@pytest.fixture
def ready(rpc):
    rpc.ok("add_storage", {"storage": NFS})
    rpc.ok("create_instance_group", {"instance_group": GROUP})
    return rpc


def test_method_flags(rpc):
    methods = rpc.dispatcher.methods
    assert not methods["register_instance"].admin and methods["register_instance"].writes
    assert methods["register_instance"].idempotent
    assert not methods["get_instance_info"].admin and not methods["get_instance_info"].writes
    for name in (
        "add_storage",
        "remove_storage",
        "create_instance_group",
        "update_instance_group",
        "add_account",
        "load_config_snapshot",
        "list_account",
        "gen_config_snapshot",
        "remove_instance",
        "get_metrics",
    ):
        assert methods[name].admin, name
    for name in (
        "list_storage",
        "get_instance_group",
        "list_instance_groups",
        "list_instance_info",
        "check_health",
        "gen_config_snapshot",
        "get_manager_cluster_info",
        "get_metrics",
        "list_account",
    ):
        assert not methods[name].writes and methods[name].idempotent, name
    assert not methods["update_instance_group"].idempotent  # a retry would hit VERSION_CONFLICT


def test_storage_rpcs(rpc):
    added = rpc.ok("add_storage", {"storage": NFS, "trace_id": "t"})["storage"]
    assert added["global_unique_name"] == "nfs1" and added["enabled"] and added["available"]
    assert "nfs1" in rpc.fail("add_storage", {"storage": NFS}, Code.DUPLICATE_ENTITY)
    assert rpc.ok("disable_storage", {"storage_unique_name": "nfs1"})["storage"]["enabled"] is False
    assert rpc.ok("enable_storage", {"storage_unique_name": "nfs1"})["storage"]["enabled"] is True
    spec = {**NFS["storage_spec"], "root_path": "/mnt/other/"}
    updated = rpc.ok("update_storage", {"storage": {**NFS, "storage_spec": spec}, "force_update": True})["storage"]
    assert updated["storage_spec"]["root_path"] == "/mnt/other"  # normalized by the file backend
    assert updated["storage_spec"]["key_count_per_file"] == 8 and updated["storage_spec"]["create_root"] is True
    names = [s["global_unique_name"] for s in rpc.ok("list_storage")["storage"]]
    assert names == ["default-file", "nfs1"]
    assert rpc.ok("remove_storage", {"storage_unique_name": "nfs1"}) == {}
    rpc.fail("remove_storage", {"storage_unique_name": "nfs1"}, Code.NOT_FOUND)
    rpc.fail("enable_storage", {"storage_unique_name": "nfs1"}, Code.NOT_FOUND)


def test_instance_group_rpcs(ready):
    got = ready.ok("get_instance_group", {"name": "g1"})["instance_group"]
    assert got["version"] == 1 and got["reclaim_strategy"]["reclaim_policy"] == "lru"
    ready.fail("create_instance_group", {"instance_group": GROUP}, Code.DUPLICATE_ENTITY)
    change = {"name": "g1", "reclaim_strategy": {"reclaim_policy": "lfu"}}
    updated = ready.ok("update_instance_group", {"instance_group": change, "current_version": 1})["instance_group"]
    assert updated["version"] == 2 and updated["reclaim_strategy"]["reclaim_policy"] == "lfu"
    ready.fail("update_instance_group", {"instance_group": change, "current_version": 1}, Code.VERSION_CONFLICT)
    assert (
        ready.ok("update_instance_group", {"instance_group": change, "expected_version": 2})["instance_group"][
            "version"
        ]
        == 3
    )
    msg = ready.fail("update_instance_group", {"instance_group": change}, Code.INVALID_ARGUMENT)
    assert "current_version" in msg
    names = [g["name"] for g in ready.ok("list_instance_groups")["instance_group"]]
    assert names == ["default", "g1"]
    msg = ready.fail("remove_storage", {"storage_unique_name": "nfs1"}, Code.STILL_REFERENCED)
    assert "g1" in msg
    assert ready.ok("remove_instance_group", {"name": "g1"}) == {}
    ready.fail("get_instance_group", {"name": "g1"}, Code.NOT_FOUND)
    ready.ok("remove_storage", {"storage_unique_name": "nfs1"})


def test_register_instance_rpc(ready):
    reply = ready.ok("register_instance", REGISTER)
    assert reply["created"] is True
    assert [s["global_unique_name"] for s in reply["storage_configs"]] == ["nfs1"]
    assert reply["storage_configs"][0]["storage_spec"]["key_count_per_file"] == 8
    again = ready.ok("register_instance", {**REGISTER, "location_spec_infos": REGISTER["location_spec_infos"][::-1]})
    assert again["created"] is False
    for change in (
        {"block_size": 32},
        {"instance_group": "default"},
        {"location_spec_infos": [{"name": "tp0", "size": 4096}, {"name": "tp1", "size": 1}]},
        {"location_spec_groups": []},
        {"model_deployment": {"model_name": "other", "dtype": "bf16"}},
    ):
        ready.fail("register_instance", {**REGISTER, **change}, Code.DUPLICATE_ENTITY)
    ready.fail("register_instance", {**REGISTER, "instance_id": "i2", "instance_group": "nope"}, Code.NOT_FOUND)

    info = ready.ok("get_instance_info", {"instance_id": "i1"})
    assert info["instance_group"] == "g1"
    assert info["instance_info"]["instance_group_name"] == "g1"
    assert info["instance_info"]["location_spec_groups"] == [{"name": "full", "spec_names": ["tp0", "tp1"]}]
    ready.fail("get_instance_info", {"instance_id": "nope"}, Code.INSTANCE_NOT_EXIST)

    ready.ok("register_instance", {**REGISTER, "instance_id": "i0", "instance_group": "default"})
    assert [i["instance_id"] for i in ready.ok("list_instance_info")["instance_info"]] == ["i0", "i1"]
    listed = ready.ok("list_instance_info", {"instance_group_name": "g1"})["instance_info"]
    assert [i["instance_id"] for i in listed] == ["i1"]
    assert "i1" in ready.fail("remove_instance_group", {"name": "g1"}, Code.STILL_REFERENCED)
    assert ready.ok("remove_instance", {"instance_id": "i1", "instance_group": "ignored"}) == {}
    ready.fail("remove_instance", {"instance_id": "i1"}, Code.INSTANCE_NOT_EXIST)
    ready.fail("get_instance_info", {"instance_id": "i1"}, Code.INSTANCE_NOT_EXIST)


def test_one_batch_sees_its_own_writes(rpc):
    payloads = [
        wire.pack_request(1, "add_storage", {"storage": NFS}),
        wire.pack_request(2, "create_instance_group", {"instance_group": GROUP}),
        wire.pack_request(3, "register_instance", REGISTER),
        wire.pack_request(4, "register_instance", {**REGISTER, "block_size": 1}),
    ]
    replies = [wire.parse_response(r) for r in rpc.dispatcher.handle_batch(payloads)]
    assert [r[1] for r in replies[:3]] == [None, None, None]
    assert replies[2][2]["storage_configs"][0]["global_unique_name"] == "nfs1"
    assert replies[3][1]["code"] == Code.DUPLICATE_ENTITY
    assert rpc.registry.get_instance("i1").block_size == 64


@pytest.mark.parametrize(
    ("method", "params", "field"),
    [
        ("register_instance", {**REGISTER, "block_size": "64"}, "block_size"),
        ("register_instance", {k: v for k, v in REGISTER.items() if k != "instance_id"}, "instance_id"),
        ("register_instance", {**REGISTER, "location_spec_infos": [{"name": "tp0", "size": 1.5}]}, "size"),
        ("register_instance", {**REGISTER, "block_size": 0}, "block_size"),
        ("register_instance", {**REGISTER, "model_deployment": {"tp_size": "2"}}, "tp_size"),
        ("add_storage", {"storage": {**NFS, "storage_spec": {"root_path": 1}}}, "storage_spec.root_path"),
        ("add_storage", {"storage": {**NFS, "storage_spec": {"root_path": "/x", "root_pth": "/y"}}}, "storage_spec.root_pth"),
        ("add_storage", {"storage": {**NFS, "storage_type": "floppy"}}, "storage_type"),
        ("add_storage", {"storage": {**NFS, "enabled": "yes"}}, "enabled"),
        ("add_storage", {}, "storage"),
        ("create_instance_group", {"instance_group": {**GROUP, "quota": {"capacity": "1T"}}}, "capacity"),
        ("create_instance_group", {"instance_group": {**GROUP, "storage_candidates": "nfs1"}}, "storage_candidates"),
        ("update_instance_group", {"instance_group": {"name": "default", "quota": []}, "current_version": 1}, "quota"),
        ("update_instance_group", {"instance_group": {"name": "default"}, "current_version": "1"}, "current_version"),
        ("enable_storage", {"storage_unique_name": 7}, "storage_unique_name"),
        ("add_account", {"user_name": "u", "password": 1234}, "password"),
        ("add_account", {"user_name": "u", "password": "p", "role": "root"}, "role"),
        ("load_config_snapshot", {"config_snapshot": 5}, "config_snapshot"),
        ("load_config_snapshot", {"config_snapshot": "{not json"}, "config_snapshot"),
        ("load_config_snapshot", {"config_snapshot": "[" * 100_000}, "config_snapshot"),  # was INTERNAL_ERROR
        ("load_config_snapshot", {"config_snapshot": {}}, "format"),  # was: an empty registry
        ("get_instance_info", {"instance_id": ["i1"]}, "instance_id"),
    ],
)
def test_bad_input_names_the_field(rpc, method, params, field):
    assert field in rpc.fail(method, params, Code.INVALID_ARGUMENT)


def test_unknown_fields_refused(ready):
    message = ready.fail("register_instance", {**REGISTER, "future_field": {"x": 1}}, Code.INVALID_ARGUMENT)
    assert "unknown field future_field" in message
    assert ready.ok("list_instance_info")["instance_info"] == []
    ready.fail("check_health", {"whatever": True, "trace_id": "abc"}, Code.INVALID_ARGUMENT)
    ready.ok("check_health", {"trace_id": "abc"})


def test_account_rpcs_never_reveal_secrets(rpc):
    secret = "Corr3ct-Horse-Battery"
    replies = [
        rpc.ok("add_account", {"user_name": "root", "password": secret, "role": "admin"}),
        rpc.ok("add_account", {"user_name": "bob", "password": secret}),
        rpc.ok("update_account", {"user_name": "bob", "password": secret + "2", "role": "admin"}),
        rpc.ok("list_account"),
        rpc.ok("gen_config_snapshot"),
    ]
    assert replies[0] == {"account": {"user_name": "root", "role": "admin", "groups": []}}
    assert replies[1]["account"]["role"] == "user"
    assert replies[3] == {"accounts": [{"user_name": "bob", "role": "admin", "groups": []},
                                       {"user_name": "root", "role": "admin", "groups": []}]}
    assert all(secret not in repr(r) for r in replies)
    assert all(a["password_hash"].startswith("scrypt2$") for a in replies[4]["config_snapshot"]["accounts"])
    rpc.fail("add_account", {"user_name": "bob", "password": "x"}, Code.DUPLICATE_ENTITY)
    assert rpc.ok("delete_account", {"user_name": "bob"}) == {}
    rpc.fail("delete_account", {"user_name": "root"}, Code.STILL_REFERENCED)
    rpc.fail("delete_account", {"user_name": "bob"}, Code.NOT_FOUND)


def test_snapshot_rpcs_round_trip(ready, tmp_path):
    ready.ok("register_instance", REGISTER)
    ready.ok("add_account", {"user_name": "root", "password": "pw", "role": "admin"})
    snapshot = ready.ok("gen_config_snapshot")["config_snapshot"]
    other = Rpc(MemoryStore(), str(tmp_path / "other"))
    loaded = other.ok("load_config_snapshot", {"config_snapshot": snapshot})["loaded"]
    assert loaded == {"storage": 2, "instance_group": 2, "instance": 1, "account": 1, "token": 0}
    for method in ("list_storage", "list_instance_groups", "list_instance_info", "list_account"):
        assert other.ok(method) == ready.ok(method), method
    assert other.ok("get_instance_info", {"instance_id": "i1"}) == ready.ok("get_instance_info", {"instance_id": "i1"})
    bad = {**snapshot, "instances": [{**snapshot["instances"][0], "instance_group_name": "ghost"}]}
    assert "ghost" in other.fail("load_config_snapshot", {"config_snapshot": bad}, Code.INVALID_ARGUMENT)
    assert other.ok("list_instance_info")["instance_info"]  # nothing was replaced


def test_health_cluster_info_and_metrics(ready):
    health = ready.ok("check_health")
    assert health["status"] == "ok" and health["is_health"] and health["is_leader"]
    assert health["counts"]["storage"] == 2 and health["storages"]["nfs1"] == {"enabled": True, "available": True}
    info = ready.ok("get_manager_cluster_info")
    assert info["leader"] is True and info["self"]["node_id"] == "node-1"
    assert info["nodes"] == [info["self"]] and info["leader_node_id"] == "node-1"
    assert info["self"]["endpoint"] == INFO["endpoint"]
    metrics = ready.ok("get_metrics")
    assert metrics["node"] == INFO and metrics["timestamp"] > 0
    counts = {tuple(s["labels"].items()): s["value"] for s in metrics["metrics"]["kvcm_rpc_requests_total"]}
    assert counts[(("method", "add_storage"),)] == 1


def test_in_process_call(ready):
    """The HTTP side port's path: ``Dispatcher.call`` with a params map."""
    ready.dispatcher.call("register_instance", dict(REGISTER))
    assert ready.dispatcher.call("get_instance_info", {"instance_id": "i1"})["instance_group"] == "g1"
    with pytest.raises(KvcmError) as exc:
        ready.dispatcher.call("get_instance_info", {"instance_id": "nope"})
    assert exc.value.code == Code.INSTANCE_NOT_EXIST


def test_info_may_be_a_callable(store, tmp_path):
    """The app passes ``App.info`` (a method): facts such as the bound port are read per call."""
    facts = {"endpoint": "tcp://127.0.0.1:0"}
    registry = Registry(store, str(tmp_path), allowed_roots=ROOTS)
    dispatcher = Dispatcher(registry_api.methods(registry, lambda: dict(facts)), group=store.group)
    facts["endpoint"] = "tcp://127.0.0.1:45678"  # bound after the method table was built
    _, error, result = wire.parse_response(dispatcher.handle(wire.pack_request(1, "get_manager_cluster_info", {})))
    assert error is None and result["self_node_id"] == "tcp://127.0.0.1:45678"
    _, error, result = wire.parse_response(dispatcher.handle(wire.pack_request(2, "check_health", {})))
    assert result["node"] == facts

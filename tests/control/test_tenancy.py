"""Tenancy: an account uses only the instance groups it lists; another tenant's instance answers
exactly like a missing one, and list methods show only what the caller may use."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvcm.client import Client
from kvcm.control.records import Account, check_snapshot, parse_snapshot
from kvcm.control.registry import Registry
from kvcm.errors import Code, InvalidArgument, KvcmError
from kvcm.testing import RunningServer, serve_in_thread
from tests.helpers import register

pytestmark = pytest.mark.both_stores

ADMIN_PW = "tenant-Admin-pw"
SERVER_ON = {"auth": {"enabled": True, "admin_user": "admin", "admin_password": ADMIN_PW}}
SPECS = [{"name": "tp0", "size": 64}]


def _register(c: Client, instance_id: str, group: str) -> dict[str, Any]:
    return register(c, instance_id, group, specs=SPECS, deployment=None)


#: Every instance-scoped method a user may call, with otherwise valid parameters.
SCOPED: list[tuple[str, dict[str, Any]]] = [
    ("get_instance_info", {}),
    ("get_storage_specs", {}),
    ("get_cache_location", {"query_type": "prefix_match", "block_keys": [1, 2]}),
    ("get_cache_location", {"query_type": "prefix_match", "token_ids": list(range(8))}),
    ("get_cache_meta", {"block_keys": [1]}),
    ("start_write_cache", {"block_keys": [1]}),
    ("finish_write_cache", {"write_session_id": "s-1"}),
    ("remove_cache", {"block_keys": [1]}),
    ("trim_cache", {"strategy": "remove_all_cache"}),
    ("pin_cache", {"block_keys": [1], "ttl_seconds": 60}),
    ("unpin_cache", {"block_keys": [1]}),
    ("match_engines", {"block_keys": [1]}),
    ("match_engines", {"token_ids": list(range(8))}),
]


@pytest.fixture(scope="module")
def tenants(kvcm_store: str) -> Iterator[tuple[RunningServer, Client, Client, Client]]:
    """A server with groups ga and gb, instance ia in ga and ib in gb, an engine source on each,
    and clients for the admin, alice (ga) and bob (gb)."""
    sock_dir = tempfile.mkdtemp(prefix="kvcm-tenancy-", dir="/tmp")
    with serve_in_thread(overrides=SERVER_ON) as srv:
        admin = srv.client(auth={"user": "admin", "password": ADMIN_PW})
        for group in ("ga", "gb"):
            admin.call("create_instance_group", {"instance_group": {"name": group,
                                                                    "storage_candidates": ["default-file"]}})
        admin.call("add_account", {"user_name": "alice", "password": "alice-pw", "groups": ["ga"]})
        admin.call("add_account", {"user_name": "bob", "password": "bob-pw", "groups": ["gb"]})
        alice_token = admin.call("add_token", {"user_name": "alice"})["token"]
        alice = srv.client(auth={"token": alice_token})
        bob = srv.client(auth={"user": "bob", "password": "bob-pw"})
        _register(alice, "ia", "ga")
        _register(bob, "ib", "gb")
        for name in ("a", "b"):
            admin.call("add_event_source", {"source_id": f"s{name}", "instance_id": f"i{name}",
                                            "endpoint": f"ipc://{sock_dir}/{name}-pub"})
        try:
            yield srv, admin, alice, bob
        finally:
            for c in (admin, alice, bob):
                c.close()
            shutil.rmtree(sock_dir, ignore_errors=True)


def failure(c: Client, method: str, params: dict[str, Any]) -> KvcmError:
    with pytest.raises(KvcmError) as exc:
        c.call(method, params, retry=False)
    return exc.value


def outcome(c: Client, method: str, params: dict[str, Any]) -> tuple[str, str]:
    """``("ok", "")`` or the error's code and message."""
    try:
        c.call(method, params, retry=False)
    except KvcmError as exc:
        return exc.code.name, exc.message
    return "ok", ""


@pytest.mark.parametrize(("method", "params"), SCOPED, ids=[f"{m}-{i}" for i, (m, _) in enumerate(SCOPED)])
def test_another_tenants_instance_answers_like_a_missing_one(tenants, method, params):
    _, _, alice, bob = tenants
    foreign = outcome(alice, method, {**params, "instance_id": "ib"})
    missing = outcome(alice, method, {**params, "instance_id": "no-such"})
    assert foreign[0] == "INSTANCE_NOT_EXIST"
    assert foreign == (missing[0], missing[1].replace("no-such", "ib"))
    assert outcome(bob, method, {**params, "instance_id": "ib"})[0] != "INSTANCE_NOT_EXIST"  # its owner gets in
    assert outcome(alice, method, {**params, "instance_id": "ia"})[0] != "INSTANCE_NOT_EXIST"


def test_register_only_into_an_allowed_group(tenants):
    _, admin, alice, _ = tenants
    error = failure(alice, "register_instance", {"instance_group": "gb", "instance_id": "ia2", "block_size": 4,
                                                 "location_spec_infos": SPECS})
    assert error.code == Code.PERMISSION_DENIED and "gb" in error.message
    taken = failure(alice, "register_instance", {"instance_group": "ga", "instance_id": "ib", "block_size": 4,
                                                 "location_spec_infos": SPECS})
    assert taken.code == Code.DUPLICATE_ENTITY
    assert "gb" not in taken.message and "instance_group" not in taken.message  # nothing about the owner
    assert _register(alice, "ia", "ga")["created"] is False  # its own, again: idempotent
    assert "ia2" not in [i["instance_id"] for i in admin.call("list_instance_info")["instance_info"]]


def test_writes_and_reads_within_the_own_group(tenants):
    _, _, alice, _ = tenants
    session = alice.call("start_write_cache", {"instance_id": "ia", "block_keys": [7, 8]}, retry=False)
    alice.call("finish_write_cache", {"instance_id": "ia", "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": 2}}, retry=False)
    found = alice.call("get_cache_location", {"instance_id": "ia", "query_type": "prefix_match",
                                              "block_keys": [7, 8]})
    assert len(found["locations"]) == 2
    alice.call("remove_cache", {"instance_id": "ia", "block_keys": [7]}, retry=False)
    alice.call("trim_cache", {"instance_id": "ia", "strategy": "remove_all_cache"}, retry=False)


def test_lists_show_only_the_callers_groups(tenants):
    _, admin, alice, bob = tenants
    ids = lambda reply: sorted(i["instance_id"] for i in reply["instance_info"])  # noqa: E731
    assert ids(alice.call("list_instance_info")) == ["ia"]
    assert ids(alice.call("list_instance_info", {"instance_group_name": "gb"})) == []
    assert ids(bob.call("list_instance_info")) == ["ib"]
    assert ids(admin.call("list_instance_info")) == ["ia", "ib"]
    sources = lambda reply: sorted(s["source_id"] for s in reply["sources"])  # noqa: E731
    assert sources(alice.call("list_event_sources")) == ["sa"]
    assert sources(alice.call("list_event_sources", {"instance_id": "ib"})) == []  # filtered, not failed
    assert sources(bob.call("list_event_sources")) == ["sb"]
    assert sources(admin.call("list_event_sources")) == ["sa", "sb"]
    # nothing of bob's instance leaks (compared field by field: the endpoints' random temp dir
    # names can contain "ib" by chance)
    assert [(s["source_id"], s["instance_id"]) for s in alice.call("list_event_sources")["sources"]] == [("sa", "ia")]


def test_accounts_carry_groups(tenants):
    srv, admin, _, _ = tenants
    accounts = {a["user_name"]: a for a in admin.call("list_account")["accounts"]}
    assert accounts["alice"]["groups"] == ["ga"] and accounts["admin"]["groups"] == ["*"]
    assert "password_hash" not in accounts["alice"]
    made = admin.call("add_account", {"user_name": "carol", "password": "carol-pw"})
    assert made["account"]["groups"] == []  # deny by default: groups must be granted
    with srv.client(auth={"user": "carol", "password": "carol-pw"}) as carol:
        assert failure(carol, "get_instance_info", {"instance_id": "ia"}).code == Code.INSTANCE_NOT_EXIST
        assert carol.call("list_instance_info")["instance_info"] == []
        admin.call("update_account", {"user_name": "carol", "groups": ["*"]})
        assert carol.call("get_instance_info", {"instance_id": "ib"})["instance_group"] == "gb"  # next request
        assert carol.call("whoami")["groups"] == ["*"]
        admin.call("update_account", {"user_name": "carol", "groups": ["ga"]})
        assert failure(carol, "get_instance_info", {"instance_id": "ib"}).code == Code.INSTANCE_NOT_EXIST
    for bad in (["*", "ga"], ["ga", "ga"], ["bad name"]):
        assert failure(admin, "update_account", {"user_name": "carol", "groups": bad}).code == Code.INVALID_ARGUMENT
    admin.call("delete_account", {"user_name": "carol"})


def test_records_and_snapshots_without_groups_keep_loading(store, tmp_path):
    old_record = msgspec.msgpack.encode({"user_name": "legacy", "role": "user", "password_hash": "x"})
    assert msgspec.msgpack.decode(old_record, type=Account).groups == ["*"]  # as before tenancy: every group
    reg = Registry(store, str(tmp_path / "data"))
    reg.add_account("root", "root-pw", "admin")
    snapshot = reg.gen_config_snapshot()
    for account in snapshot["accounts"]:
        del account["groups"]
    del snapshot["tokens"]
    assert check_snapshot(parse_snapshot(snapshot)).accounts[0].groups == ["*"]
    reg.load_config_snapshot(snapshot)
    assert reg.get_account("root").groups == ["*"]
    with pytest.raises(InvalidArgument, match="groups"):
        reg.add_account("x", "x-pw", "user", ["*", "ga"])
    assert reg.add_account("y", "y-pw").groups == []  # deny by default here too

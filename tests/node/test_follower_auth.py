"""A follower serving reads (``ha.follower_reads``) with ``auth.enabled``: the same front door as
the leader's. Two real ``kvcm serve`` nodes on one Redis prefix; every call goes to the follower
on a bare socket (no following), so the answer is the follower's own: no credentials and wrong
ones are refused, a tenant reads only its own groups' instances (another tenant's answers like
a missing one), and an account, group or token change on the leader applies to the follower's
next request."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from kvcm import Client
from kvcm.errors import Code
from tests.node.test_ha import Pair, _raw_call

ADMIN_PW = "follower-Admin-pw"
SPECS = [{"name": "tp0", "size": 1024}]
TOKENS = list(range(100, 116))

#: Every read a follower serves, with parameters naming an instance ("" = filled per call).
READS: list[tuple[str, dict[str, Any]]] = [
    ("get_cache_location", {"query_type": "prefix_match", "block_keys": [1, 2]}),
    ("get_cache_location_len", {"query_type": "prefix_match", "block_keys": [1, 2]}),
    ("get_cache_meta", {"block_keys": [1, 2]}),
    ("get_instance_info", {}),
    ("get_storage_specs", {}),
    ("match_engines", {"token_ids": TOKENS}),
    ("get_host_cache_state", {"token_ids": TOKENS}),
]


class AuthPair(Pair):
    """A :class:`Pair` whose role questions carry the admin's credentials (auth is on)."""

    def info(self, node: str) -> dict:
        with Client(self.endpoints[node], timeout=1.0, retries=0, auth={"user": "admin", "password": ADMIN_PW}) as c:
            return c.call("get_manager_cluster_info")


class Tenants:
    """The pair, the follower's endpoint, and each account's credentials."""

    def __init__(self, pair: AuthPair, leader: str, follower: str, creds: dict[str, dict[str, str]]) -> None:
        self.pair = pair
        self.leader = pair.endpoints[leader]
        self.follower = pair.endpoints[follower]
        self.creds = creds

    def admin(self) -> Client:
        return Client(self.leader, timeout=5.0, auth=self.creds["admin"])

    def ask(self, who: str | None, method: str, params: dict[str, Any]) -> tuple[Any, Any]:
        """The follower's own answer to ``method`` sent as ``who`` (None: no credentials)."""
        auth = {"auth": self.creds[who]} if who is not None else {}
        return _raw_call(self.follower, method, {**params, **auth})


def _setup(admin: Client) -> dict[str, dict[str, str]]:
    """Groups ga and gb, alice (ga, a token) and bob (gb, a password), instance ia in ga and ib
    in gb, each with blocks 1 and 2 written."""
    for group in ("ga", "gb"):
        admin.call("create_instance_group", {"instance_group": {"name": group, "storage_candidates": ["default-file"]}})
    admin.call("add_account", {"user_name": "alice", "password": "alice-pw", "groups": ["ga"]})
    admin.call("add_account", {"user_name": "bob", "password": "bob-pw", "groups": ["gb"]})
    creds = {"admin": {"user": "admin", "password": ADMIN_PW}, "bob": {"user": "bob", "password": "bob-pw"},
             "alice": {"token": admin.call("add_token", {"user_name": "alice"})["token"]}}
    for instance, group in (("ia", "ga"), ("ib", "gb")):
        admin.call("register_instance", {"instance_group": group, "instance_id": instance, "block_size": 4,
                                         "location_spec_infos": SPECS})
        session = admin.call("start_write_cache", {"instance_id": instance, "block_keys": [1, 2]})
        admin.call("finish_write_cache", {"instance_id": instance, "write_session_id": session["write_session_id"],
                                          "success_blocks": {"offset": 2}})
    return creds


@pytest.fixture
def tenants(redis_factory, tmp_path) -> Iterator[Tenants]:
    server = redis_factory("--appendonly", "yes", "--appendfsync", "always")
    sock_dir = tempfile.mkdtemp(prefix="kvcm-fa-", dir="/tmp")
    pair = AuthPair(server.url, str(tmp_path), sock_dir, extra=[
        "--set", "auth.enabled=true", "--set", f"auth.admin_password={ADMIN_PW}"])
    try:
        pair.start("n1")
        pair.start("n2")
        leader = pair.leader()
        follower = "n2" if leader == "n1" else "n1"
        with Client(pair.endpoints[leader], timeout=5.0, auth={"user": "admin", "password": ADMIN_PW}) as admin:
            creds = _setup(admin)
        t = Tenants(pair, leader, follower, creds)
        assert t.ask("admin", "check_health", {})[1]["is_leader"] is False  # the follower it is
        yield t
    finally:
        pair.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _served(reply: tuple[Any, Any]) -> Any:
    err, result = reply
    assert err is None, err
    return result


@pytest.mark.parametrize(("method", "params"), READS, ids=[m for m, _ in READS])
def test_a_follower_refuses_its_reads_without_valid_credentials(tenants, method, params):
    params = {**params, "instance_id": "ia"}
    for who in (None, "wrong"):
        tenants.creds["wrong"] = {"user": "alice", "password": "not-alice-pw"}
        err, _ = tenants.ask(who, method, params)
        assert err is not None and err["code"] == Code.UNAUTHENTICATED, (who, err)
    _served(tenants.ask("alice", method, params))  # the same read with credentials: served there


def test_a_follower_refuses_list_event_sources_without_credentials(tenants):
    err, _ = tenants.ask(None, "list_event_sources", {})
    assert err is not None and err["code"] == Code.UNAUTHENTICATED
    assert _served(tenants.ask("alice", "list_event_sources", {}))["sources"] == []


@pytest.mark.parametrize(("method", "params"), READS, ids=[m for m, _ in READS])
def test_a_tenant_cannot_read_another_tenant_s_instance_through_a_follower(tenants, method, params):
    foreign_err, _ = tenants.ask("alice", method, {**params, "instance_id": "ib"})
    missing_err, _ = tenants.ask("alice", method, {**params, "instance_id": "no-such"})
    assert foreign_err is not None and foreign_err["code"] == Code.INSTANCE_NOT_EXIST, foreign_err
    assert foreign_err["message"] == missing_err["message"].replace("no-such", "ib")  # nothing tells them apart
    _served(tenants.ask("bob", method, {**params, "instance_id": "ib"}))  # its owner reads it there
    _served(tenants.ask("alice", method, {**params, "instance_id": "ia"}))


def test_a_tenant_s_locations_through_a_follower_are_its_own_only(tenants):
    own = _served(tenants.ask("alice", "get_cache_location", {"instance_id": "ia", "query_type": "prefix_match",
                                                               "block_keys": [1, 2]}))
    assert len(own["locations"]) == 2
    err, got = tenants.ask("alice", "get_cache_location", {"instance_id": "ib", "query_type": "prefix_match",
                                                            "block_keys": [1, 2]})
    assert err is not None and got is None  # no location of bob's blocks in any form


def test_account_changes_on_the_leader_apply_to_the_follower_s_next_read(tenants):
    params = {"instance_id": "ia", "query_type": "prefix_match", "block_keys": [1, 2]}
    with tenants.admin() as admin:
        token = admin.call("add_token", {"user_name": "bob"})
        tenants.creds["bob-token"] = {"token": token["token"]}
        err, _ = tenants.ask("bob-token", "get_cache_location", params)
        assert err["code"] == Code.INSTANCE_NOT_EXIST  # known at once, and limited to bob's groups
        admin.call("update_account", {"user_name": "bob", "groups": ["ga", "gb"]})
        assert len(_served(tenants.ask("bob-token", "get_cache_location", params))["locations"]) == 2
        admin.call("revoke_token", {"token_id": token["token_id"]})
        err, _ = tenants.ask("bob-token", "get_cache_location", params)
        assert err["code"] == Code.UNAUTHENTICATED  # a revoked token is refused from the next read on
        admin.call("update_account", {"user_name": "alice", "groups": []})
        err, _ = tenants.ask("alice", "get_cache_location", params)
        assert err["code"] == Code.INSTANCE_NOT_EXIST  # a narrowed account loses its instances at once

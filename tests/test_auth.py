"""Authentication and authorization: the dispatcher's ``authorize`` hook over registry accounts."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvcm import model
from kvcm.api import registry as registry_api
from kvcm.auth import Authenticator
from kvcm.config import AuthConfig, ConfigError
from kvcm.dispatch import Dispatcher, Method
from kvcm.errors import AccessDenied, Code
from kvcm.proto import wire
from kvcm.registry import Registry

ADMIN_PW = "b00tstrap-Admin-pw"
ON = AuthConfig(enabled=True, admin_user="admin", admin_password=ADMIN_PW)
USER_METHOD = Method("get_instance_info", lambda req: {}, admin=False)
ADMIN_METHOD = Method("add_storage", lambda req: {}, admin=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def reg(store, tmp_path):
    return Registry(store, str(tmp_path / "data"))


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def auth(reg, clock):
    return Authenticator(reg, ON, cache_seconds=60, clock=clock)


@pytest.fixture
def count_hashes(monkeypatch):
    """Counts scrypt verifications (the slow part the cache exists for)."""
    calls = {"n": 0}
    real = model.verify_password

    def counting(password: str, encoded: str) -> bool:
        calls["n"] += 1
        return real(password, encoded)

    monkeypatch.setattr("kvcm.auth.verify_password", counting)
    return calls


def creds(user: str = "admin", password: str = ADMIN_PW) -> dict[str, str]:
    return {"user": user, "password": password}


def denied(auth: Authenticator, method: Method, credentials: Any) -> Code:
    with pytest.raises(AccessDenied) as exc:
        auth(method, credentials)
    return exc.value.code


def test_disabled_allows_everything(reg):
    auth = Authenticator(reg, AuthConfig(enabled=False))
    auth(ADMIN_METHOD, None)
    auth(USER_METHOD, {"user": "nobody", "password": "x"})
    assert reg.list_accounts() == []  # no bootstrap when off


def test_bootstrap_admin_on_first_start(reg, auth, store, tmp_path):
    [account] = reg.list_accounts()
    assert (account.user_name, account.role) == ("admin", "admin")
    assert ADMIN_PW not in account.password_hash
    reg.add_account("ops", "pw", "admin")
    reg.delete_account("admin")
    Authenticator(Registry(store, str(tmp_path / "data")), ON)  # an admin exists: nothing recreated
    assert [a.user_name for a in reg.list_accounts()] == ["ops"]


def test_bootstrap_needs_a_password(reg):
    with pytest.raises(ConfigError, match="admin_password"):
        Authenticator(reg, AuthConfig(enabled=True, admin_password=""))


def test_credentials_required(auth):
    assert denied(auth, USER_METHOD, None) == Code.UNAUTHENTICATED
    assert denied(auth, USER_METHOD, "admin:pw") == Code.UNAUTHENTICATED
    assert denied(auth, USER_METHOD, {"user": "admin"}) == Code.UNAUTHENTICATED
    assert denied(auth, USER_METHOD, {"user": "admin", "password": 1}) == Code.UNAUTHENTICATED
    assert denied(auth, USER_METHOD, creds(password="wrong")) == Code.UNAUTHENTICATED
    assert denied(auth, USER_METHOD, creds(user="ghost")) == Code.UNAUTHENTICATED


def test_roles(auth, reg):
    reg.add_account("alice", "alice-pw", "user")
    auth(USER_METHOD, creds("alice", "alice-pw"))
    assert denied(auth, ADMIN_METHOD, creds("alice", "alice-pw")) == Code.PERMISSION_DENIED
    auth(ADMIN_METHOD, creds())
    auth(USER_METHOD, creds())


def test_same_message_for_unknown_user_and_wrong_password(auth):
    with pytest.raises(AccessDenied) as unknown:
        auth(USER_METHOD, creds(user="ghost"))
    with pytest.raises(AccessDenied) as wrong:
        auth(USER_METHOD, creds(password="nope"))
    assert unknown.value.message == wrong.value.message
    assert ADMIN_PW not in unknown.value.message


def test_success_is_cached_then_expires(auth, clock, count_hashes):
    auth(USER_METHOD, creds())
    auth(USER_METHOD, creds())
    auth(ADMIN_METHOD, creds())
    assert count_hashes["n"] == 1
    clock.now += 61
    auth(USER_METHOD, creds())
    assert count_hashes["n"] == 2


def test_failures_are_not_cached(auth, count_hashes):
    for _ in range(2):
        denied(auth, USER_METHOD, creds(password="wrong"))
    assert count_hashes["n"] == 2


def test_account_change_invalidates_cache(auth, reg):
    reg.add_account("alice", "old-pw", "admin")
    auth(ADMIN_METHOD, creds("alice", "old-pw"))
    reg.update_account("alice", role="user")
    assert denied(auth, ADMIN_METHOD, creds("alice", "old-pw")) == Code.PERMISSION_DENIED
    reg.update_account("alice", password="new-pw")
    assert denied(auth, USER_METHOD, creds("alice", "old-pw")) == Code.UNAUTHENTICATED
    auth(USER_METHOD, creds("alice", "new-pw"))
    reg.delete_account("alice")
    assert denied(auth, USER_METHOD, creds("alice", "new-pw")) == Code.UNAUTHENTICATED


# -- through the dispatcher ------------------------------------------------------------------------


@pytest.fixture
def call(reg, auth, store):
    dispatcher = Dispatcher(registry_api.methods(reg), group=store.group, authorize=auth)
    ids = itertools.count(1)

    def call(method: str, params: dict[str, Any]) -> tuple[Any, Any]:
        _, error, result = wire.parse_response(dispatcher.handle(wire.pack_request(next(ids), method, params)))
        return error, result

    return call


def test_dispatcher_enforces_roles(call, reg):
    reg.add_account("eng", "eng-pw", "user")
    user = {"auth": creds("eng", "eng-pw")}
    error, _ = call("list_storage", {})
    assert error["code"] == Code.UNAUTHENTICATED
    error, _ = call("list_storage", user)
    assert error["code"] == Code.PERMISSION_DENIED
    error, result = call("check_health", user)
    assert error is None and result["status"] == "ok"
    register = {
        "instance_group": "default",
        "instance_id": "i1",
        "block_size": 16,
        "location_spec_infos": [{"name": "tp0", "size": 64}],
    }
    error, _ = call("register_instance", {**register, **user})
    assert error is None
    error, result = call("get_instance_info", {"instance_id": "i1", **user})
    assert error is None and result["instance_group"] == "default"
    error, result = call("list_storage", {"auth": creds()})
    assert error is None and result["storage"]


def test_secret_never_in_replies(call):
    params = {"user_name": "new", "password": "Zebra-Secret-77", "role": "user", "auth": creds()}
    replies = [
        call("add_account", params),
        call("list_account", {"auth": creds()}),
        call("gen_config_snapshot", {"auth": creds()}),
        call("list_storage", {"auth": creds(password="wrong")}),
    ]
    text = repr(replies)
    assert "Zebra-Secret-77" not in text and ADMIN_PW not in text


# -- end to end, over a real server ----------------------------------------------------------------


def test_auth_on_over_the_wire_and_typed_decoding_only_when_off():
    from kvcm.client import Client
    from kvcm.testing import serve_in_thread

    on = {"auth": {"enabled": True, "admin_user": "admin", "admin_password": ADMIN_PW}}
    with serve_in_thread(overrides=on) as srv, Client(srv.endpoint) as c:
        assert not srv.app.dispatcher.typed_decode  # the hook needs the raw "auth" map
        with pytest.raises(AccessDenied) as exc:
            c.call("check_health", {})
        assert exc.value.code == Code.UNAUTHENTICATED
        with pytest.raises(AccessDenied) as exc:
            c.call("list_storage", {"auth": creds(password="wrong")})
        assert exc.value.code == Code.UNAUTHENTICATED
        assert "storage" in c.call("list_storage", {"auth": creds()})
    with serve_in_thread() as srv, Client(srv.endpoint) as c:
        assert srv.app.dispatcher.typed_decode
        # Off: an "auth" map is accepted and ignored, on the typed path too.
        assert "storage" in c.call("list_storage", {"auth": creds(password="anything")})
        assert c.call("check_health", {})

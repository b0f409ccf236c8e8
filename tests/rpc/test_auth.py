"""Authentication and authorization: the dispatcher's ``authorize(method, request, peer)`` hook
over registry accounts, the password-check thread and its bounds, and the admin guards."""

from __future__ import annotations

import hashlib
import itertools
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvcm.api import control as registry_api
from kvcm.client import Client
from kvcm.config import AuthConfig, ConfigError
from kvcm.control import passwords
from kvcm.control.registry import Registry
from kvcm.errors import AccessDenied, Code, Conflict, InvalidArgument, KvcmError, Unavailable
from kvcm.proto import wire
from kvcm.proto.schema import Credentials, RequestBase
from kvcm.rpc.auth import Authenticator
from kvcm.rpc.dispatch import Deferred, Dispatcher, Method
from kvcm.testing import serve_in_thread

ADMIN_PW = "b00tstrap-Admin-pw"
ON = AuthConfig(enabled=True, admin_user="admin", admin_password=ADMIN_PW)
USER_METHOD = Method("get_instance_info", lambda req: {}, admin=False)
ADMIN_METHOD = Method("add_storage", lambda req: {}, admin=True)
SERVER_ON = {"auth": {"enabled": True, "admin_user": "admin", "admin_password": ADMIN_PW}}


class Req(RequestBase, kw_only=True):
    instance_id: str = ""


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


def make_auth(reg: Registry, clock: Clock, **config: Any) -> Authenticator:
    cfg = AuthConfig(**{"enabled": True, "admin_user": "admin", "admin_password": ADMIN_PW, **config})
    return Authenticator(reg, cfg, clock=clock)


@pytest.fixture
def auth(reg, clock) -> Iterator[Authenticator]:
    a = make_auth(reg, clock)
    yield a
    a.close()


@pytest.fixture
def scrypt_runs(monkeypatch):
    """The thread names of every password verification (the slow scrypt part)."""
    runs: list[str] = []
    real = passwords.verify_password

    def counting(password: str, encoded: str) -> bool:
        runs.append(threading.current_thread().name)
        return real(password, encoded)

    monkeypatch.setattr("kvcm.rpc.auth.verify_password", counting)
    return runs


@pytest.fixture
def gate(monkeypatch):
    """Holds every password check on the checker thread until ``gate.set()``."""
    event = threading.Event()
    real = passwords.verify_password

    def held(password: str, encoded: str) -> bool:
        event.wait(10)
        return real(password, encoded)

    monkeypatch.setattr("kvcm.rpc.auth.verify_password", held)
    yield event
    event.set()


def req(user: str = "admin", password: str = ADMIN_PW, **fields: Any) -> Req:
    return Req(auth=Credentials(user=user, password=password), **fields)


def settle(auth: Authenticator, method: Method, request: Any, peer: bytes = b"p1") -> None:
    """Call the hook the way the dispatcher does: again, a moment later, while it defers (a
    verdict is one scrypt, well under a second, but a loaded 2-core machine can starve it)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return auth(method, request, peer)
        except Deferred:
            assert time.monotonic() < deadline, "the verdict never came"
            time.sleep(0.002)


def refused(auth: Authenticator, method: Method, request: Any, peer: bytes = b"p1") -> KvcmError:
    with pytest.raises(KvcmError) as exc:
        settle(auth, method, request, peer)
    return exc.value


def test_disabled_allows_everything(reg):
    auth = Authenticator(reg, AuthConfig(enabled=False))
    auth(ADMIN_METHOD, Req(), b"")
    auth(USER_METHOD, req("nobody", "x"), b"")
    assert reg.list_accounts() == []  # no bootstrap when off


def test_bootstrap_admin_on_first_start(reg, auth, store, tmp_path):
    [account] = reg.list_accounts()
    assert (account.user_name, account.role, account.groups) == ("admin", "admin", ["*"])
    assert ADMIN_PW not in account.password_hash
    reg.add_account("ops", "pw", "admin")
    reg.delete_account("admin")
    Authenticator(Registry(store, str(tmp_path / "data")), ON)  # an admin exists: nothing recreated
    assert [a.user_name for a in reg.list_accounts()] == ["ops"]


def test_bootstrap_needs_a_password(reg):
    with pytest.raises(ConfigError, match="admin_password"):
        Authenticator(reg, AuthConfig(enabled=True, admin_password=""))


@pytest.mark.parametrize(
    "auth_field",
    [None, "admin:pw", {"user": "admin"}, {"user": "admin", "password": 1}, {"user": "admin", "pw": "x"},
     {"token": "kvcm_x" * 5, "password": ADMIN_PW}],
)
def test_credentials_required(auth, auth_field):
    request = {"auth": auth_field} if auth_field is not None else {}
    assert refused(auth, USER_METHOD, request).code == Code.UNAUTHENTICATED


def test_wrong_or_unknown_credentials(auth):
    assert refused(auth, USER_METHOD, req(password="wrong")).code == Code.UNAUTHENTICATED
    assert refused(auth, USER_METHOD, req(user="ghost")).code == Code.UNAUTHENTICATED
    assert refused(auth, USER_METHOD, req(user="not a name!")).code == Code.UNAUTHENTICATED


def test_roles(auth, reg):
    reg.add_account("alice", "alice-pw", "user")
    settle(auth, USER_METHOD, req("alice", "alice-pw"))
    assert refused(auth, ADMIN_METHOD, req("alice", "alice-pw")).code == Code.PERMISSION_DENIED
    settle(auth, ADMIN_METHOD, req())
    settle(auth, USER_METHOD, req())


def test_same_message_for_unknown_user_and_wrong_password(auth):
    unknown = refused(auth, USER_METHOD, req(user="ghost"))
    wrong = refused(auth, USER_METHOD, req(password="nope"))
    assert unknown.message == wrong.message
    assert ADMIN_PW not in unknown.message


def test_password_is_checked_on_the_checker_thread_then_cached(auth, clock, scrypt_runs):
    with pytest.raises(Deferred):
        auth(USER_METHOD, req(), b"p1")  # the RPC thread only queues the check
    settle(auth, USER_METHOD, req())
    settle(auth, ADMIN_METHOD, req(), b"another-peer")
    assert scrypt_runs == ["kvcm-auth"]
    clock.now += 61  # auth.verdict_cache_s = 60
    settle(auth, USER_METHOD, req())
    assert scrypt_runs == ["kvcm-auth", "kvcm-auth"]


def test_a_wrong_password_runs_scrypt_once(auth, clock, scrypt_runs):
    for _ in range(3):
        assert refused(auth, USER_METHOD, req(password="wrong")).code == Code.UNAUTHENTICATED
    assert len(scrypt_runs) == 1  # the failure is remembered for auth.failed_cache_s
    clock.now += 11
    refused(auth, USER_METHOD, req(password="wrong"))
    assert len(scrypt_runs) == 2


def test_failed_logins_are_rate_limited_per_peer(reg, clock, scrypt_runs):
    auth = make_auth(reg, clock, failed_login_limit=3, failed_login_window_s=30)
    reg.add_account("alice", "alice-pw", "user")
    settle(auth, USER_METHOD, req("alice", "alice-pw"), b"mallory")  # a cached login, from the same peer
    for i in range(3):
        assert refused(auth, USER_METHOD, req(password=f"guess-{i}"), b"mallory").code == Code.UNAUTHENTICATED
    runs = len(scrypt_runs)
    limited = refused(auth, USER_METHOD, req(password="guess-3"), b"mallory")
    assert limited.code == Code.RATE_LIMITED and "retry in 30 s" in limited.message
    assert len(scrypt_runs) == runs  # refused before any scrypt
    assert refused(auth, USER_METHOD, req(password="guess-0"), b"mallory").code == Code.RATE_LIMITED
    settle(auth, USER_METHOD, req("alice", "alice-pw"), b"mallory")  # a known good verdict still passes
    settle(auth, USER_METHOD, req(), b"someone-else")  # other connections are not affected
    clock.now += 31
    assert refused(auth, USER_METHOD, req(password="guess-4"), b"mallory").code == Code.UNAUTHENTICATED
    auth.close()


def test_failed_logins_are_rate_limited_per_user_name(reg, clock):
    auth = make_auth(reg, clock, failed_login_limit=100, failed_login_limit_per_user=2)
    for i in range(2):
        refused(auth, USER_METHOD, req(password=f"guess-{i}"), f"peer-{i}".encode())
    assert refused(auth, USER_METHOD, req(password="guess-2"), b"peer-2").code == Code.RATE_LIMITED
    reg.add_account("bob", "bob-pw", "user")
    settle(auth, USER_METHOD, req("bob", "bob-pw"), b"peer-2")  # another user name is not affected
    auth.close()


def test_pending_checks_are_bounded(reg, clock, gate):
    auth = make_auth(reg, clock, max_pending_checks=3, max_pending_per_peer=2, max_pending_per_user=2)
    reg.add_account("bob", "bob-pw", "user")
    for password, peer in (("a", b"p1"), ("b", b"p1")):
        with pytest.raises(Deferred):
            auth(USER_METHOD, req(password=password), peer)
    with pytest.raises(Deferred):
        auth(USER_METHOD, req(password="a"), b"p1")  # the same check again: waits, costs no slot
    with pytest.raises(Unavailable) as per_peer:
        auth(USER_METHOD, req("bob", "c"), b"p1")
    with pytest.raises(Unavailable) as per_user:
        auth(USER_METHOD, req(password="d"), b"p2")
    with pytest.raises(Deferred):
        auth(USER_METHOD, req("bob", "e"), b"p2")
    with pytest.raises(Unavailable) as full:
        auth(USER_METHOD, req("bob", "f"), b"p3")
    assert {per_peer.value.code, per_user.value.code, full.value.code} == {Code.RATE_LIMITED}
    assert "3 password checks are queued" in full.value.message
    gate.set()
    assert refused(auth, USER_METHOD, req(password="a"), b"p1").code == Code.UNAUTHENTICATED
    settle(auth, USER_METHOD, req("bob", "bob-pw"), b"p3")  # slots are released
    auth.close()


def test_account_change_invalidates_cache(auth, reg):
    reg.add_account("alice", "old-pw", "admin")
    settle(auth, ADMIN_METHOD, req("alice", "old-pw"))
    reg.update_account("alice", role="user")
    assert refused(auth, ADMIN_METHOD, req("alice", "old-pw")).code == Code.PERMISSION_DENIED
    reg.update_account("alice", password="new-pw")
    assert refused(auth, USER_METHOD, req("alice", "old-pw")).code == Code.UNAUTHENTICATED
    settle(auth, USER_METHOD, req("alice", "new-pw"))
    reg.delete_account("alice")
    assert refused(auth, USER_METHOD, req("alice", "new-pw")).code == Code.UNAUTHENTICATED


def test_a_verdict_computed_across_a_change_is_not_trusted(auth, reg, gate):
    reg.add_account("alice", "old-pw", "user")
    with pytest.raises(Deferred):
        auth(USER_METHOD, req("alice", "old-pw"), b"p1")  # checked against the old hash...
    reg.update_account("alice", password="new-pw")  # ...which changes meanwhile
    gate.set()
    assert refused(auth, USER_METHOD, req("alice", "old-pw")).code == Code.UNAUTHENTICATED


def test_verdicts_are_kept_under_a_keyed_digest(auth):
    settle(auth, USER_METHOD, req())
    refused(auth, USER_METHOD, req(password="wrong"))
    keys = [*auth._good, *auth._bad]
    assert len(keys) == 2
    for password in (ADMIN_PW, "wrong"):
        plain = [password.encode(), hashlib.sha256(password.encode()).digest(),
                 hashlib.sha256(("admin" + password).encode()).digest()]
        assert not any(p in k or k == p for k in keys for p in plain)


def test_nul_and_control_characters_are_refused(auth, reg, scrypt_runs):
    for control in ("\0", "\n", "\x7f", "\x9b"):
        with pytest.raises(InvalidArgument, match="control characters"):
            reg.add_account("carol", "pw" + control, "user")
        with pytest.raises(InvalidArgument, match="control characters"):
            reg.update_account("admin", password=control + "pw")
        error = refused(auth, USER_METHOD, req(password=ADMIN_PW + control))
        assert error.code == Code.UNAUTHENTICATED and "control characters" in error.message
    assert scrypt_runs == []  # refused before any scrypt
    settle(auth, USER_METHOD, req())


def test_why_a_trailing_nul_used_to_match():
    # scrypt keys HMAC-SHA256 with the password, and HMAC zero-pads short keys: raw, "pw" and
    # "pw\0" are one key. The first hash format fed the password raw; the current one feeds its
    # SHA-256, and login refuses control characters before looking at either.
    assert passwords._scrypt(b"adm1n-pw", b"salt", 16, 1, 1) == passwords._scrypt(b"adm1n-pw\0", b"salt", 16, 1, 1)
    salt = b"0123456789abcdef"
    digest = passwords._scrypt(b"adm1n-pw", salt, 1 << 14, 8, 1)
    old_format = "$".join(["scrypt", "16384", "8", "1", passwords._b64(salt), passwords._b64(digest)])
    assert passwords.verify_password("adm1n-pw", old_format)  # old hashes keep working
    assert not passwords.verify_password("adm1n-pw\0", old_format)
    new_format = passwords.hash_password("adm1n-pw")
    assert new_format.startswith("scrypt2$")
    assert passwords.verify_password("adm1n-pw", new_format)
    key = passwords._scrypt_key("adm1n-pw", "scrypt2")
    assert key != passwords._scrypt_key("adm1n-pw\0", "scrypt2") and len(key) == 32


def test_close_stops_the_checker_thread(reg, clock):
    auth = make_auth(reg, clock)
    settle(auth, USER_METHOD, req())
    thread = auth._thread
    assert thread is not None and thread.is_alive()
    auth.close()
    assert not thread.is_alive()
    auth.close()  # idempotent


# -- admin guards ----------------------------------------------------------------------------------


def test_snapshot_cannot_remove_the_last_admin(reg):
    reg.add_account("admin", "pw", "admin")
    reg.add_account("eve", "pw", "user")
    snapshot = reg.gen_config_snapshot()
    for accounts in ([], [a for a in snapshot["accounts"] if a["role"] != "admin"],
                     [{**a, "role": "user"} for a in snapshot["accounts"]]):
        with pytest.raises(Conflict, match="no admin account") as exc:
            reg.load_config_snapshot({**snapshot, "accounts": accounts, "tokens": []})
        assert exc.value.code == Code.STILL_REFERENCED
    assert [a.user_name for a in reg.list_accounts()] == ["admin", "eve"]  # nothing was loaded
    reg.load_config_snapshot(snapshot)


def test_an_admin_cannot_lock_itself_out(reg):
    reg.add_account("root", "pw", "admin")
    reg.add_account("ops", "pw", "admin")
    with pytest.raises(Conflict, match="calling as"):
        reg.delete_account("root", caller="root")
    with pytest.raises(Conflict, match="calling as"):
        reg.update_account("root", role="user", caller="root")
    snapshot = reg.gen_config_snapshot()
    without_root = {**snapshot, "accounts": [a for a in snapshot["accounts"] if a["user_name"] != "root"]}
    with pytest.raises(Conflict, match="calling as"):
        reg.load_config_snapshot(without_root, caller="root")
    reg.load_config_snapshot(without_root, caller="ops")  # another admin may
    assert [a.user_name for a in reg.list_accounts()] == ["ops"]
    with pytest.raises(Conflict, match="last admin"):
        reg.delete_account("ops")
    with pytest.raises(Conflict, match="last admin"):
        reg.update_account("ops", role="user")


# -- through the dispatcher ------------------------------------------------------------------------


@pytest.fixture
def call(reg, auth, store):
    dispatcher = Dispatcher(registry_api.methods(reg, auth=auth), group=store.group, authorize=auth)
    ids = itertools.count(1)

    def call(method: str, params: dict[str, Any]) -> tuple[Any, Any]:
        _, error, result = wire.parse_response(dispatcher.handle(wire.pack_request(next(ids), method, params)))
        return error, result

    return call


def creds(user: str = "admin", password: str = ADMIN_PW) -> dict[str, str]:
    return {"user": user, "password": password}


def test_dispatcher_enforces_roles(call, reg):
    reg.add_account("eng", "eng-pw", "user", ["default"])
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


def test_admin_rpcs_cannot_lock_the_caller_out(call):
    error, _ = call("add_account", {"user_name": "ops", "password": "ops-pw", "role": "admin", "auth": creds()})
    assert error is None
    error, _ = call("delete_account", {"user_name": "admin", "auth": creds()})
    assert error["code"] == Code.STILL_REFERENCED and "calling as" in error["message"]
    error, _ = call("update_account", {"user_name": "admin", "role": "user", "auth": creds()})
    assert error["code"] == Code.STILL_REFERENCED
    error, result = call("gen_config_snapshot", {"auth": creds()})
    snapshot = result["config_snapshot"]
    error, _ = call("load_config_snapshot", {"config_snapshot": {**snapshot, "accounts": []}, "auth": creds()})
    assert error["code"] == Code.STILL_REFERENCED and "no admin" in error["message"]
    error, _ = call("delete_account", {"user_name": "admin", "auth": creds("ops", "ops-pw")})
    assert error is None  # another admin may


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


def test_auth_on_over_the_wire():
    with serve_in_thread(overrides=SERVER_ON) as srv, Client(srv.endpoint) as c:
        with pytest.raises(AccessDenied) as exc:
            c.call("check_health", {})
        assert exc.value.code == Code.UNAUTHENTICATED
        with pytest.raises(AccessDenied) as exc:
            c.call("list_storage", {"auth": creds(password="wrong")})
        assert exc.value.code == Code.UNAUTHENTICATED
        assert "storage" in c.call("list_storage", {"auth": creds()})
        assert c.call("whoami", {"auth": creds()})["authenticated_by"] == "password"
        with pytest.raises(AccessDenied):
            c.call("check_health", {"auth": creds(password=ADMIN_PW + "\0")})
    with serve_in_thread() as srv, Client(srv.endpoint) as c:
        # Off: an "auth" map is accepted and ignored.
        assert "storage" in c.call("list_storage", {"auth": creds(password="anything")})
        assert c.call("whoami", {})["auth_enabled"] is False


def test_wrong_password_flood_is_rate_limited_and_never_slows_the_rpc_thread(scrypt_runs):
    overrides = {"auth": {**SERVER_ON["auth"], "failed_login_limit": 5}}
    with serve_in_thread(overrides=overrides) as srv:
        with srv.client(auth=creds()) as admin:
            token = admin.call("add_token", {"user_name": "admin", "name": "bench"})["token"]
        stop = threading.Event()
        codes: dict[str, int] = {}

        def flood(n: int) -> None:
            with srv.client(timeout=30) as c:  # one connection: one peer
                i = 0
                while not stop.is_set():
                    i += 1
                    try:
                        c.call("check_health", {"auth": creds(password=f"guess-{n}-{i}")}, retry=False)
                    except KvcmError as exc:
                        codes[exc.code.name] = codes.get(exc.code.name, 0) + 1

        floods = [threading.Thread(target=flood, args=(n,)) for n in range(8)]
        for t in floods:
            t.start()
        latencies = []
        with srv.client(auth={"token": token}) as c:
            for _ in range(200):
                started = time.perf_counter()
                c.call("check_health", {})
                latencies.append(time.perf_counter() - started)
        stop.set()
        for t in floods:
            t.join()
    assert codes.get("RATE_LIMITED", 0) > 0 and codes.get("UNAUTHENTICATED", 0) > 0
    assert "kvcm-rpc" not in scrypt_runs and set(scrypt_runs) <= {"kvcm-auth"}
    assert statistics.median(latencies) < 0.05  # generous: without the checker thread it was ~0.4 s

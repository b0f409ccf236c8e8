"""API tokens: created and shown once, stored as a digest only, used, expired, revoked; and
``kvcm call`` credentials (KVCM_PASSWORD, --password-file, --token, KVCM_TOKEN)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from kvcm.backends.metastore import LmdbStore
from kvcm.cli import main
from kvcm.config import CLIENT_ENV, AuthConfig, load
from kvcm.control.records import token_digest
from kvcm.control.registry import Registry
from kvcm.errors import AccessDenied, Code, InvalidArgument, KvcmError, NotFound
from kvcm.proto.schema import Credentials, RequestBase
from kvcm.rpc.auth import Authenticator
from kvcm.rpc.dispatch import Method
from kvcm.testing import serve_in_thread

pytestmark = pytest.mark.both_stores

ADMIN_PW = "t0ken-Admin-pw"
SERVER_ON = {"auth": {"enabled": True, "admin_user": "admin", "admin_password": ADMIN_PW}}
ADMIN = {"user": "admin", "password": ADMIN_PW}
USER_METHOD = Method("check_health", lambda req: {})
ADMIN_METHOD = Method("list_storage", lambda req: {}, admin=True)


class Req(RequestBase, kw_only=True):
    pass


def with_token(token: str) -> Req:
    return Req(auth=Credentials(token=token))


@pytest.fixture
def server():
    with serve_in_thread(overrides=SERVER_ON) as srv:
        yield srv


def denied(call: Any, *args: Any) -> KvcmError:
    with pytest.raises(KvcmError) as exc:
        call(*args)
    return exc.value


def test_create_use_revoke(server):
    with server.client(auth=ADMIN) as admin:
        admin.call("add_account", {"user_name": "ci", "password": "ci-password", "groups": ["default"]})
        made = admin.call("add_token", {"user_name": "ci", "name": "ci-runner"})
        assert made["token"].startswith("kvcm_") and len(made["token"]) > 40
        assert (made["user_name"], made["name"], made["expire_time"]) == ("ci", "ci-runner", 0)
        with server.client(auth={"token": made["token"]}) as ci:
            assert ci.call("whoami") == {"auth_enabled": True, "user_name": "ci", "role": "user", "groups": ["default"],
                                         "authenticated_by": "token", "token_id": made["token_id"]}
            assert denied(ci.call, "list_storage").code == Code.PERMISSION_DENIED  # the account's role
            assert denied(ci.call, "add_token", {"user_name": "ci"}).code == Code.PERMISSION_DENIED
            listed = admin.call("list_tokens", {"user_name": "ci"})["tokens"]
            assert [t["token_id"] for t in listed] == [made["token_id"]]
            assert admin.call("revoke_token", {"token_id": made["token_id"]}) == {"token_id": made["token_id"],
                                                                                 "user_name": "ci"}
            assert denied(ci.call, "whoami").code == Code.UNAUTHENTICATED  # the very next request
        assert denied(admin.call, "revoke_token", {"token_id": made["token_id"]}).code == Code.NOT_FOUND
        assert admin.call("list_tokens", {})["tokens"] == []
        assert denied(admin.call, "add_token", {"user_name": "ghost"}).code == Code.NOT_FOUND


def test_deleting_the_account_kills_its_tokens(server):
    with server.client(auth=ADMIN) as admin:
        admin.call("add_account", {"user_name": "temp", "password": "temp-password"})
        token = admin.call("add_token", {"user_name": "temp"})["token"]
        with server.client(auth={"token": token}) as temp:
            assert temp.call("whoami")["user_name"] == "temp"
            admin.call("delete_account", {"user_name": "temp"})
            assert denied(temp.call, "whoami").code == Code.UNAUTHENTICATED
        assert admin.call("list_tokens", {})["tokens"] == []


def test_token_expires_after_its_ttl(server):
    with server.client(auth=ADMIN) as admin:
        made = admin.call("add_token", {"user_name": "admin", "ttl_seconds": 1})
        assert made["expire_time"] - made["create_time"] == 1000
        with server.client(auth={"token": made["token"]}) as c:
            assert c.call("whoami")["authenticated_by"] == "token"
            time.sleep(1.2)  # the one-second ttl runs out on the server's own wall clock
            assert denied(c.call, "whoami").code == Code.UNAUTHENTICATED
        assert admin.call("list_tokens", {})["tokens"][0]["expired"] is True


def test_expiry_with_an_injected_clock(store, tmp_path):
    reg = Registry(store, str(tmp_path / "data"))
    wall = [time.time()]
    auth = Authenticator(reg, AuthConfig(enabled=True, admin_password=ADMIN_PW), wall=lambda: wall[0])
    token, _ = reg.add_token("admin", "short", ttl_seconds=60)
    auth(ADMIN_METHOD, with_token(token), b"p")
    wall[0] += 59
    auth(ADMIN_METHOD, with_token(token), b"p")
    wall[0] += 2
    with pytest.raises(AccessDenied) as exc:
        auth(ADMIN_METHOD, with_token(token), b"p")
    assert exc.value.code == Code.UNAUTHENTICATED and "expired" in exc.value.message
    forever, _ = reg.add_token("admin")
    wall[0] += 10 * 365 * 86400
    auth(ADMIN_METHOD, with_token(forever), b"p")
    with pytest.raises(InvalidArgument, match="ttl_seconds"):
        reg.add_token("admin", ttl_seconds=-1)
    with pytest.raises(InvalidArgument, match="name"):
        reg.add_token("admin", name="a\nb")
    auth.close()


@pytest.mark.parametrize("bad", ["", "kvcm_", "nope", "kvcm_" + "A" * 43 + "!", "kvcm_" + "A" * 2_000_000])
def test_malformed_tokens_are_refused_cheaply(store, tmp_path, bad, monkeypatch):
    reg = Registry(store, str(tmp_path / "data"))
    auth = Authenticator(reg, AuthConfig(enabled=True, admin_password=ADMIN_PW))
    hashed: list[int] = []
    monkeypatch.setattr("kvcm.rpc.auth.token_digest", lambda token: hashed.append(len(token)) or token_digest(token))
    with pytest.raises(AccessDenied) as exc:
        auth(USER_METHOD, with_token(bad), b"p")
    assert exc.value.code == Code.UNAUTHENTICATED
    assert hashed == []  # refused by its shape, before any hashing
    with pytest.raises(AccessDenied):  # a user name that is not the token's account
        token, _ = reg.add_token("admin")
        auth(USER_METHOD, Req(auth=Credentials(user="someone", token=token)), b"p")
    auth.close()


@pytest.mark.lmdb_only("reads the stored bytes back from the LMDB files under the data dir")
def test_only_the_digest_is_stored_and_exported(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=SERVER_ON) as srv:
        with srv.client(auth=ADMIN) as admin:
            made = admin.call("add_token", {"user_name": "admin", "name": "backup"})
            token = made["token"]
            listed = admin.call("list_tokens", {})
            snapshot = admin.call("gen_config_snapshot", {})["config_snapshot"]
        with srv.client(auth={"token": token}) as c:
            c.call("whoami")
        assert token not in repr(listed) and token_digest(token) not in repr(listed)
        assert "digest" not in listed["tokens"][0]
        [exported] = snapshot["tokens"]
        assert exported["digest"] == token_digest(token) and token not in json.dumps(snapshot)
    raw = b"".join(p.read_bytes() for p in (tmp_path / "data").rglob("*") if p.is_file())
    assert token_digest(token).encode() in raw
    assert token.encode() not in raw and token[5:].encode() not in raw
    assert token not in caplog.text and token[5:] not in caplog.text


@pytest.mark.store_independent
def test_tokens_travel_in_snapshots(tmp_path):
    source = Registry(LmdbStore(str(tmp_path / "a"), map_size=1 << 20), str(tmp_path / "a-data"))
    source.add_account("admin", ADMIN_PW, "admin")
    token, _ = source.add_token("admin", "kept")
    snapshot = source.gen_config_snapshot()
    # The snapshot's storages live in a-data: the target must allow them (storage.allowed_roots).
    target = Registry(LmdbStore(str(tmp_path / "b"), map_size=1 << 20), str(tmp_path / "b-data"),
                      allowed_roots=(str(tmp_path),))
    loaded = target.load_config_snapshot(snapshot)
    assert loaded["token"] == 1
    auth = Authenticator(target, AuthConfig(enabled=True, admin_password=ADMIN_PW))
    auth(ADMIN_METHOD, with_token(token), b"p")  # the token works on the restored registry
    orphan = {**snapshot, "tokens": [{**snapshot["tokens"][0], "user_name": "ghost"}]}
    with pytest.raises(InvalidArgument, match="unknown account 'ghost'"):
        target.load_config_snapshot(orphan)
    bad_digest = {**snapshot, "tokens": [{**snapshot["tokens"][0], "digest": "xyz"}]}
    with pytest.raises(InvalidArgument, match="digest"):
        target.load_config_snapshot(bad_digest)
    target.load_config_snapshot({**snapshot, "tokens": []})
    with pytest.raises(AccessDenied):
        auth(ADMIN_METHOD, with_token(token), b"p")  # dropped by the load: gone at once
    auth.close()


# -- kvcm call credentials -------------------------------------------------------------------------


def run_call(capsys: Any, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_kvcm_call_credentials(server, capsys, monkeypatch, tmp_path):
    base = ["call", "whoami", "{}", "--endpoint", server.endpoint]
    monkeypatch.delenv("KVCM_PASSWORD", raising=False)
    monkeypatch.delenv("KVCM_TOKEN", raising=False)

    monkeypatch.setenv("KVCM_PASSWORD", ADMIN_PW)
    code, out, err = run_call(capsys, [*base, "--user", "admin"])
    assert code == 0 and json.loads(out)["authenticated_by"] == "password" and err == ""
    monkeypatch.delenv("KVCM_PASSWORD")

    secret = tmp_path / "pw"
    secret.write_text(ADMIN_PW + "\n")
    code, out, _ = run_call(capsys, [*base, "--user", "admin", "--password-file", str(secret)])
    assert code == 0 and json.loads(out)["user_name"] == "admin"
    secret.write_text(ADMIN_PW + "x\n")
    assert run_call(capsys, [*base, "--user", "admin", "--password-file", str(secret)])[0] == 1

    code, _, err = run_call(capsys, [*base, "--user", "admin", "--password", ADMIN_PW])
    assert code == 0 and "visible" in err and "process list" in err

    code, _, err = run_call(capsys, [*base, "--user", "admin"])  # no password, stdin is no terminal
    assert code == 2 and "KVCM_PASSWORD" in err
    code, _, err = run_call(capsys, [*base, "--user", "admin", "--password-file", str(tmp_path / "missing")])
    assert code == 2 and "cannot read" in err

    with server.client(auth=ADMIN) as admin:
        token = admin.call("add_token", {"user_name": "admin"})["token"]
    monkeypatch.setenv("KVCM_TOKEN", token)
    code, out, err = run_call(capsys, base)
    assert code == 0 and json.loads(out)["authenticated_by"] == "token" and err == ""
    monkeypatch.delenv("KVCM_TOKEN")
    code, out, err = run_call(capsys, [*base, "--token", token])
    assert code == 0 and json.loads(out)["authenticated_by"] == "token" and "visible" in err
    assert run_call(capsys, [*base, "--token", token, "--password", "x"])[0] == 2


def test_kvcm_call_in_a_subprocess_reads_kvcm_password(server):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    env["KVCM_PASSWORD"] = ADMIN_PW
    done = subprocess.run(
        [sys.executable, "-m", "kvcm", "call", "whoami", "{}", "--endpoint", server.endpoint, "--user", "admin"],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["user_name"] == "admin"
    assert ADMIN_PW not in done.stderr


@pytest.mark.store_independent
def test_client_variables_are_no_server_settings():
    assert CLIENT_ENV == ("KVCM_PASSWORD", "KVCM_TOKEN")
    load(None, environ={"KVCM_PASSWORD": "x", "KVCM_TOKEN": "y"})  # ignored, not refused
    with pytest.raises(Exception, match="KVCM_PASSWORDS"):
        load(None, environ={"KVCM_PASSWORDS": "x"})


def test_unknown_token_id_is_not_found(store, tmp_path):
    reg = Registry(store, str(tmp_path / "data"))
    with pytest.raises(NotFound):
        reg.revoke_token("0" * 16)


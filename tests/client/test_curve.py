"""CURVE on the RPC port and on kvcm's event publisher, with ZAP deciding which client keys get in.

Every test runs a real server (kvcm.testing) with key files written by ``kvcm keys generate``'s
own code; refused clients are real ZeroMQ handshakes that fail.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import pathlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest
import zmq

from kvcm.cli import main
from kvcm.client import Client
from kvcm.config import ConfigError, load
from kvcm.errors import Code, InvalidArgument, Unavailable
from kvcm.proto.kv_events import decode_batch
from kvcm.rpc.curve import (
    CurveServer,
    KeyPair,
    apply_client,
    apply_server,
    create_certificates,
    load_keypair,
    load_public_key,
)
from kvcm.testing import serve_in_thread

CURVE_MESSAGE = "CURVE handshake failed or server unreachable"
BLOCK = 4
INSTANCE = {"instance_group": "default", "instance_id": "llm", "block_size": BLOCK,
            "location_spec_infos": [{"name": "tp0", "size": 256}]}


@dataclass
class Keys:
    server_public: str  # the server's .key file
    server_secret: str  # its .key_secret file
    server: KeyPair
    allowed_dir: str
    alice_secret: str  # a client whose public key is in allowed_dir
    alice: KeyPair
    bob_secret: str  # a client with a key of its own, not allowed
    bob: KeyPair

    def secrets(self) -> list[bytes]:
        return [self.server.secret, self.alice.secret, self.bob.secret]


@pytest.fixture
def keys(tmp_path) -> Keys:
    server_public, server_secret, server = create_certificates(str(tmp_path / "server"), "server")
    alice_public, alice_secret, alice = create_certificates(str(tmp_path / "alice"), "alice")
    _, bob_secret, bob = create_certificates(str(tmp_path / "bob"), "bob")
    allowed = tmp_path / "allowed"  # public certificates only, as an operator would hand them over
    allowed.mkdir()
    shutil.copy(alice_public, allowed)
    return Keys(server_public, server_secret, server, str(allowed), alice_secret, alice, bob_secret, bob)


@pytest.fixture
def sockdir():
    # inproc:// skips ZeroMQ's security handshake altogether, so these tests use ipc://, whose
    # paths must stay short (Unix sockets).
    path = tempfile.mkdtemp(prefix="kvcm-curve-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _curve(keys: Keys, allowed: bool = True, **extra) -> dict:
    server = {"curve_secret_key_file": keys.server_secret}
    if allowed:
        server["curve_allowed_clients_dir"] = keys.allowed_dir
        # With auth off, an allow-list and the side port refuse to start (tests/sideport/test_http_hostile2.py).
        extra.setdefault("http", {"enabled": False})
    return {"server": server, **extra}


def _rejected(app) -> float:
    for line in app.metrics.exposition().decode().splitlines():
        if line.startswith("kvcm_curve_rejected_clients_total "):
            return float(line.split()[1])
    raise AssertionError("kvcm_curve_rejected_clients_total is not exported")


def _requests_of(app, method: str) -> bool:
    return f'method="{method}"' in app.metrics.exposition().decode()


def _refused(client: Client, method: str = "check_health") -> Unavailable:
    with pytest.raises(Unavailable) as info:
        client.call(method, retry=False)
    return info.value


def test_allowed_client_key_is_served(keys, caplog):
    caplog.set_level(logging.DEBUG)
    with serve_in_thread(overrides=_curve(keys)) as server:
        with server.client(curve_server_key=keys.server_public, curve_client_keys=keys.alice_secret) as kv:
            assert kv.call("check_health")["status"] == "ok"
            kv.call("register_instance", INSTANCE)
            tokens = list(range(1, 9))
            started = kv.call("start_write_cache", {"instance_id": "llm", "token_ids": tokens})
            kv.call("finish_write_cache", {"instance_id": "llm", "write_session_id": started["write_session_id"],
                                           "success_blocks": {"offset": 2}})
            found = kv.call("get_cache_location", {"instance_id": "llm", "query_type": "prefix_match",
                                                   "token_ids": tokens})
            assert len(found["locations"]) == 2
        # the server key as z85 text and the client keys as a (public, secret) pair work the same
        with server.client(curve_server_key=keys.server.public.decode(),
                           curve_client_keys=(keys.alice.public, keys.alice.secret)) as kv:
            assert kv.call("check_health")["status"] == "ok"
        assert _rejected(server.app) == 0
        internal = server.app.curve.internal.secret
    assert caplog.records  # the server did log: the check below looks at something
    for secret in [*keys.secrets(), internal]:
        assert secret.decode() not in caplog.text


def test_unknown_client_key_times_out_and_is_counted(keys, caplog):
    caplog.set_level(logging.DEBUG)
    with serve_in_thread(overrides=_curve(keys)) as server:
        with server.client(timeout=1.0, retries=0, curve_server_key=keys.server_public,
                           curve_client_keys=keys.bob_secret) as kv:
            err = _refused(kv, "list_storage")
        assert err.code is Code.TIMEOUT and CURVE_MESSAGE in err.message
        assert _rejected(server.app) >= 1
        assert not _requests_of(server.app, "list_storage")  # nothing reached the dispatcher
        # an ephemeral key is unknown too in allow-list mode
        with server.client(timeout=1.0, retries=0, curve_server_key=keys.server_public) as kv:
            assert CURVE_MESSAGE in _refused(kv).message
    warnings = [r for r in caplog.records if r.name == "kvcm.curve" and r.levelno == logging.WARNING]
    assert warnings and "refused" in warnings[0].getMessage()
    text = caplog.text
    for secret in keys.secrets():
        assert secret.decode() not in text
    assert keys.bob.public.decode() not in text  # refusals are logged without key material


def test_plaintext_client_times_out_and_nothing_is_served(keys):
    with serve_in_thread(overrides=_curve(keys)) as server:
        with server.client(timeout=1.0, retries=0) as kv:
            err = _refused(kv, "list_storage")
        assert err.code is Code.TIMEOUT
        assert not _requests_of(server.app, "list_storage")
        with server.client(curve_server_key=keys.server_public, curve_client_keys=keys.alice_secret) as kv:
            kv.call("list_storage")
        assert _requests_of(server.app, "list_storage")  # the check above can see a served call


def test_any_key_mode_allows_ephemeral_keys_not_plaintext(keys):
    with serve_in_thread(overrides=_curve(keys, allowed=False)) as server:
        with server.client(curve_server_key=keys.server_public) as kv:  # ephemeral client pair
            assert kv.call("check_health")["status"] == "ok"
        with server.client(curve_server_key=keys.server_public, curve_client_keys=keys.bob_secret) as kv:
            assert kv.call("check_health")["status"] == "ok"
        with server.client(timeout=1.0, retries=0) as kv:
            assert _refused(kv).code is Code.TIMEOUT
        # a client that trusts another server key cannot complete the handshake
        with server.client(timeout=1.0, retries=0, curve_server_key=keys.bob.public) as kv:
            assert CURVE_MESSAGE in _refused(kv).message


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_http_api_works_with_curve_and_an_allow_list(keys):
    """The side port's internal key gets its calls past the allow-list; auth on, each needs an
    account's credentials there, as on the RPC port."""
    admin = {"user": "admin", "password": "Curve-admin-passw0rd"}
    overrides = _curve(keys, http={"port": 0}, auth={"enabled": True, "admin_password": admin["password"]})
    with serve_in_thread(overrides=overrides) as server:
        status, body = _post(server.http_port, "/api/check_health", {"auth": admin})
        assert status == 200 and body["result"]["status"] == "ok"
        status, body = _post(server.http_port, "/api/list_storage", {"auth": admin})
        assert status == 200 and body["result"]["storage"]
        status, body = _post(server.http_port, "/api/list_storage", {})
        assert status == 401 and body["error"]["name"] == "UNAUTHENTICATED"
        assert _rejected(server.app) == 0


def _receive(sock: zmq.Socket, timeout: float) -> list[list[bytes]]:
    got = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1):
        got.append(sock.recv_multipart())
    return got


def _write_blocks(kv: Client, first: int) -> None:
    tokens = list(range(first, first + 2 * BLOCK))
    started = kv.call("start_write_cache", {"instance_id": "llm", "token_ids": tokens})
    kv.call("finish_write_cache", {"instance_id": "llm", "write_session_id": started["write_session_id"],
                                   "success_blocks": {"offset": 2}})


def test_publisher_with_curve(keys, tmp_path):
    pub, rep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/rep"
    overrides = _curve(keys, publisher={"enabled": True, "curve": True, "endpoint": pub, "replay_endpoint": rep})
    ctx = zmq.Context()
    try:
        with serve_in_thread(overrides=overrides) as server, \
                server.client(curve_server_key=keys.server_public, curve_client_keys=keys.alice_secret) as kv:
            subs = {}
            for name, pair in (("alice", keys.alice), ("bob", keys.bob), ("plain", None)):
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                if pair is not None:
                    apply_client(sock, keys.server.public, pair)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(pub)
                subs[name] = sock
            kv.call("register_instance", INSTANCE)
            got: list[list[bytes]] = []
            deadline = time.monotonic() + 10
            first = 1
            while not got and time.monotonic() < deadline:  # PUB/SUB joins late: write until it sees one
                _write_blocks(kv, first)
                first += 100
                got = _receive(subs["alice"], 0.3)
            assert got, "the allowed subscriber never received kvcm's events"
            assert type(decode_batch(got[0][2]).events[0]).__name__ == "BlockStored"
            assert _receive(subs["bob"], 0.5) == [] and _receive(subs["plain"], 0.1) == []
            assert _rejected(server.app) >= 1  # bob's SUB was refused by key

            def replay(pair: KeyPair | None) -> list[list[bytes]]:
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                if pair is not None:
                    apply_client(dealer, keys.server.public, pair)
                dealer.connect(rep)
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                frames = _receive(dealer, 2.0 if pair is not None else 1.0)
                dealer.close(0)
                return frames

            answered = replay(keys.alice)
            assert answered and answered[-1][2] == (-1).to_bytes(8, "big", signed=True)  # the end marker
            assert replay(None) == []
            for sock in subs.values():
                sock.close(0)
    finally:
        ctx.term()


def test_zap_handler_is_required(sockdir):
    """Without a running ZAP handler libzmq would admit every CURVE client: enforced, it admits none."""
    ctx = zmq.Context()
    server_keys, client_keys = KeyPair.generate(), KeyPair.generate()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        apply_server(router, server_keys)
        router.bind(f"ipc://{sockdir}/no-zap")
        apply_client(dealer, server_keys.public, client_keys)
        dealer.connect(f"ipc://{sockdir}/no-zap")
        dealer.send(b"hello")
        assert router.poll(1000) == 0
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_curve_server_admits_its_internal_key_and_stops_cleanly(keys, sockdir):
    curve = CurveServer(load_keypair(keys.server_secret), keys.allowed_dir).start()
    router, dealer = curve.context.socket(zmq.ROUTER), curve.context.socket(zmq.DEALER)
    try:
        curve.setup(router)
        router.bind(f"ipc://{sockdir}/internal")
        options = curve.client_options()
        apply_client(dealer, load_public_key(options["curve_server_key"]), options["curve_client_keys"])
        dealer.connect(f"ipc://{sockdir}/internal")
        dealer.send(b"ping")
        assert router.poll(2000) == zmq.POLLIN  # admitted, though not in the allowed directory
        assert curve.gate.rejected == 0
    finally:
        router.close(0)
        dealer.close(0)
        curve.stop()
        curve.stop()  # idempotent


def test_keys_generate_cli(tmp_path, capsys):
    out = tmp_path / "keys"
    assert main(["keys", "generate", str(out), "--name", "node1"]) == 0
    printed = capsys.readouterr().out.strip()
    secret, public = out / "node1.key_secret", out / "node1.key"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700
    pair = load_keypair(str(secret))
    assert pair.public.decode() == printed and load_public_key(str(public)) == pair.public
    assert zmq.curve_public(pair.secret) == pair.public
    assert main(["keys", "generate", str(out), "--name", "node1"]) == 1  # never overwrites
    assert "exists" in capsys.readouterr().err
    assert main(["keys", "generate", str(out), "--name", "../escape"]) == 1
    assert not (tmp_path / "escape.key").exists()


def test_call_cli_with_curve(keys, capsys):
    with serve_in_thread(overrides=_curve(keys)) as server:
        argv = ["call", "check_health", "{}", "--endpoint", server.endpoint, "--curve-server-key", keys.server_public]
        assert main([*argv, "--curve-client-key", keys.alice_secret]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "ok"
        # "=" form: a z85 key may start with "-", which argparse would take for an option
        assert main([*argv, f"--curve-server-key={keys.server.public.decode()}", "--curve-client-key",
                     keys.alice_secret]) == 0
        capsys.readouterr()
        assert main([*argv, "--curve-client-key", keys.bob_secret, "--timeout", "0.5"]) == 1
        assert CURVE_MESSAGE in capsys.readouterr().err
        assert main(["call", "check_health", "{}", "--endpoint", server.endpoint,
                     "--curve-client-key", keys.alice_secret]) == 1  # a client key needs the server's
        assert "curve_server_key" in capsys.readouterr().err


def test_client_key_arguments_are_checked(keys):
    with pytest.raises(InvalidArgument, match="neither a certificate file nor a z85 key"):
        Client("ipc:///tmp/unused", curve_server_key="/no/such/file.key")
    with pytest.raises(InvalidArgument, match="z85"):
        Client("ipc:///tmp/unused", curve_server_key="x" * 39 + "\x01")
    with pytest.raises(InvalidArgument, match="public key only"):
        Client("ipc:///tmp/unused", curve_server_key=keys.server_public, curve_client_keys=keys.server_public)
    with pytest.raises(InvalidArgument, match="does not belong"):
        Client("ipc:///tmp/unused", curve_server_key=keys.server_public,
               curve_client_keys=(keys.alice.public, keys.bob.secret))
    assert keys.alice.secret.decode() not in repr(keys.alice)


def _load(**server) -> None:
    load(None, environ={}, overrides={"server": server} if server else {})


def test_config_checks_the_curve_files(keys, tmp_path):
    _load(curve_secret_key_file=keys.server_secret, curve_allowed_clients_dir=keys.allowed_dir)
    with pytest.raises(ConfigError, match=re.escape("server.curve_secret_key_file")):
        _load(curve_secret_key_file=str(tmp_path / "missing.key_secret"))
    with pytest.raises(ConfigError, match="public key only"):
        _load(curve_secret_key_file=keys.server_public)
    with pytest.raises(ConfigError, match=re.escape("server.curve_allowed_clients_dir")):
        _load(curve_secret_key_file=keys.server_secret, curve_allowed_clients_dir=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=re.escape("needs server.curve_secret_key_file")):
        _load(curve_allowed_clients_dir=keys.allowed_dir)
    with pytest.raises(ConfigError, match=re.escape("publisher.curve")):
        load(None, environ={}, overrides={"publisher": {"curve": True}})
    mixed = tmp_path / "mixed.key_secret"
    mixed.write_text(f'curve\n    public-key = "{keys.alice.public.decode()}"\n'
                     f'    secret-key = "{keys.bob.secret.decode()}"\n')
    with pytest.raises(ConfigError, match="does not belong"):
        _load(curve_secret_key_file=str(mixed))


DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "curve.md"


def _doc_commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", DOCS.read_text(), re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_docs_commands_work(sockdir):
    """Every shell command of docs/curve.md, run as written (in a scratch directory)."""
    cwd = pathlib.Path(sockdir)
    commands = _doc_commands()
    assert any(c.startswith("kvcm serve") for c in commands) and any(c.startswith("kvcm call") for c in commands)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    env["KVCM_HTTP_PORT"] = "0"  # the docs' server would take the default side port
    server = None
    try:
        for command in commands:
            argv = shlex.split(command)
            if argv[0] == "kvcm":
                argv = [sys.executable, "-m", "kvcm", *argv[1:]]
            if command.startswith("kvcm serve"):
                server = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE)
                _wait_for_curve_server(cwd, server)
                continue
            done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{command}\n{done.stderr}"
            if command.startswith("kvcm call"):
                assert json.loads(done.stdout)["status"] == "ok"
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
            server.stderr.close()


def _wait_for_curve_server(cwd: pathlib.Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    options = {"curve_server_key": str(cwd / "keys/server/server.key"),
               "curve_client_keys": str(cwd / "keys/router/router.key_secret")}
    with Client(f"ipc://{cwd}/kvcm.sock", timeout=0.5, retries=0, **options) as kv:
        while True:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                kv.call("check_health")
                return
            except Unavailable:
                assert time.monotonic() < deadline, "the docs' server never answered"

"""The side HTTP port under hostile input, round 2: bodies sent before credentials, a client that
reconnects as fast as it is cut, a CURVE allow-list bypassed through the port, one tenant's storage
directories shown to another, and lenient JSON (null in lists, NaN, duplicate keys, foreign URI
schemes). Raw sockets for the attacker; real servers, real CURVE keys, real accounts and tokens."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcm.errors import StartRefused
from kvcm.rpc.curve import create_certificates
from kvcm.tair.uris import CallerRoots
from kvcm.testing import RunningServer, make_test_config, serve_in_thread
from tests.helpers import wait_for
from tests.sideport.test_http_hostile import Reply, _read_reply, closed_within, refused

ADMIN_PW = "Hostile2-admin-passw0rd"
ADMIN = {"user": "admin", "password": ADMIN_PW}
AUTH_ON = {"auth": {"enabled": True, "admin_password": ADMIN_PW}, "http": {"read_timeout_s": 5.0}}
FLOOD_BYTES = 3_700_000  # the reported reportEvent flood: 3.7 MB, 52,000 events
SLACK = 4.0  # seconds past a deadline a cut may take on a loaded 2-core box


Headers = list[tuple[str, str]]


def _head(port: int, path: str, length: int, headers: Headers | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json",
             f"Content-Length: {length}", *(f"{k}: {v}" for k, v in headers or [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _call(port: int, path: str, body: bytes, headers: Headers | None = None, source: str = "127.0.0.1") -> Reply:
    with socket.create_connection(("127.0.0.1", port), timeout=20, source_address=(source, 0)) as sock:
        sock.sendall(_head(port, path, len(body), [("Connection", "close"), *(headers or [])]) + body)
        return _read_reply(sock)


def _json(port: int, path: str, params: Any, headers: Headers | None = None) -> Reply:
    return _call(port, path, json.dumps(params).encode(), headers)


def _tair_status(reply: Reply) -> dict[str, Any]:
    assert reply.status == 200, (reply.status, reply.body)
    status: dict[str, Any] = reply.json()["header"]["status"]
    return status


def _token(server: RunningServer, user: str, groups: list[str]) -> str:
    with server.client(auth=ADMIN) as kv:
        kv.call("add_account", {"user_name": user, "password": f"{user}-Passw0rd-long", "role": "user", "groups": groups})
        token: str = kv.call("add_token", {"user_name": user, "name": "t"})["token"]
    return token


# -- 4: credentials before the body ---------------------------------------------------------------


def _answer_without_the_body(port: int, path: str, headers: Headers) -> Reply:
    """Headers announcing a 3.7 MB body, and then nothing: a server that waited for the body would
    say nothing until read_timeout_s and then drop the connection (EOFError here)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_head(port, path, FLOOD_BYTES, headers))
        return _read_reply(sock)


def test_without_valid_credentials_a_big_body_is_answered_before_it_is_sent():
    with serve_in_thread(overrides=AUTH_ON) as server:
        port = server.http_port
        for headers in ([], [("Authorization", "Bearer not-a-real-token")], [("Authorization", "Basic eDp5")]):
            reply = _answer_without_the_body(port, "/api/report_events", headers)
            assert reply.status == 401 and reply.json()["error"]["name"] == "UNAUTHENTICATED", (headers, reply.body)
            assert reply.header("Connection") == "close" and reply.header("WWW-Authenticate")
            tair = _answer_without_the_body(port, "/api/reportEvent", headers)
            status = _tair_status(tair)
            assert status["code"] == "INVALID_ARGUMENT" and status["message"].startswith("UNAUTHENTICATED: "), status
            assert tair.header("Connection") == "close"
        assert "http.max_unauthenticated_body_bytes" in _answer_without_the_body(
            port, "/api/report_events", []).json()["error"]["message"]
        assert refused(server).get("unauthenticated", 0) >= 7
        assert refused(server).get("timeout", 0) == 0  # nothing waited for a body


def test_an_invalid_bearer_token_is_refused_even_with_good_credentials_in_the_body():
    with serve_in_thread(overrides=AUTH_ON) as server:
        reply = _json(server.http_port, "/api/whoami", {"auth": ADMIN}, [("Authorization", "Bearer not-a-real-token")])
        assert reply.status == 401, reply.body
        assert _json(server.http_port, "/api/whoami", {"auth": ADMIN}).status == 200


def _whoami_refusals(server: RunningServer) -> float:
    families = text_string_to_metric_families(server.app.metrics.exposition().decode())
    return sum(sample.value for family in families if family.name == "kvcm_rpc_errors" for sample in family.samples
               if sample.name.endswith("_total") and sample.labels == {"method": "whoami", "code": "UNAUTHENTICATED"})


def test_a_refused_token_is_refused_from_memory_for_a_second():
    """A flood of one bad token costs the RPC loop one whoami a second, not one a request."""
    with serve_in_thread(overrides=AUTH_ON) as server:
        bad = [("Authorization", "Bearer not-a-real-token")]
        assert [_json(server.http_port, "/api/whoami", {}, bad).status for _ in range(10)] == [401] * 10
        assert 1 <= _whoami_refusals(server) <= 3  # ten refusals well within a few seconds


def test_a_valid_token_may_send_a_big_body_and_body_credentials_a_small_one():
    """The cap holds only for bodies read before their credentials are known: a valid bearer
    token's big body is read and served, the same body with its credentials inside is not."""
    with serve_in_thread(overrides=AUTH_ON) as server:
        port = server.http_port
        token = _token(server, "reporter", ["default"])
        bearer = [("Authorization", f"Bearer {token}")]
        padding = b" " * 100_000  # JSON allows whitespace: a body over the 64 KiB cap
        assert _call(port, "/api/whoami", b"{}" + padding, bearer).json()["result"]["user_name"] == "reporter"
        inside = json.dumps({"auth": {"token": token}}).encode()
        assert _call(port, "/api/whoami", inside).status == 200
        reply = _call(port, "/api/whoami", inside + padding)
        assert reply.status == 401 and "http.max_unauthenticated_body_bytes" in reply.json()["error"]["message"]
        # A real flood's shape, from a reporter with a token: 10,000 Tair block adds in one call (within server.turn_budget_ms).
        base = {"instance_id": "llm", "host_ip_port": "10.0.0.1:80", "storage_type": "ST_EVENT_REPORT_L2"}
        register = {**base, "events": [{"event_type": "EVENT_NODE_REGISTER", "node_register": {"mediums": ["hbm"]}}]}
        with server.client(auth=ADMIN) as kv:
            kv.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": 4,
                                          "location_spec_infos": [{"name": "tp0", "size": 64}]})
        assert _tair_status(_json(port, "/api/reportEvent", register, bearer))["code"] == "OK"
        adds = {**base, "events": [{"event_type": "EVENT_BLOCK_ADD", "block_add": {"block_key": str(i), "medium": "hbm"}}
                                   for i in range(10_000)]}
        big = json.dumps(adds).encode()
        assert len(big) > 10 * 65536
        status = _tair_status(_call(port, "/api/reportEvent", big, bearer))
        assert status["code"] == "OK", status


# -- 5: one reconnecting client, and probes past the cap ------------------------------------------


@contextmanager
def _flood(port: int, source: str, hold: int) -> Iterator[list[int]]:
    """A client at ``source`` that keeps ``hold`` silent connections open and reconnects the moment
    one is cut or refused; yields the count of its connects."""
    stop = threading.Event()
    connects = [0]

    def run() -> None:
        socks: list[socket.socket] = []
        try:
            while not stop.is_set():
                for sock in [s for s in socks if closed_within(s, 0.0) is not None]:
                    socks.remove(sock)
                    sock.close()
                while len(socks) < hold and not stop.is_set():
                    try:
                        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5,
                                                              source_address=(source, 0)))
                        connects[0] += 1
                    except OSError:
                        break
                time.sleep(0.01)  # pacing the hostile peer's reconnects
        finally:
            for sock in socks:
                sock.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield connects
    finally:
        stop.set()
        thread.join(10)


def _until(check: Any, seconds: float = 10.0) -> bool:
    return bool(wait_for(check, seconds))


def _get(port: int, path: str, source: str = "127.0.0.1") -> int:
    """The status of a GET; 503 also when the connection was reset (a connection turned away on the
    accept thread may lose its 503 to the reset of the request it did not read)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
            return _read_reply(sock).status
    except (EOFError, ConnectionError):
        return 503


def test_a_reconnecting_flood_from_one_address_leaves_room_for_everyone_else():
    """The reported attack: one client holding as many connections as it can, reconnecting as soon
    as one is cut. It holds its address's share only; every other client and every probe is served."""
    overrides = {"http": {"max_connections": 6, "max_connections_per_peer": 3, "read_timeout_s": 1.0}}
    with serve_in_thread(overrides=overrides) as server:
        port = server.http_port
        with _flood(port, "127.0.0.2", hold=20) as connects:
            assert _until(lambda: sum(refused(server).values()) >= 5), refused(server)  # it is turned away: it holds all it may
            statuses = [_call(port, "/api/check_health", b"{}", source="127.0.0.3").status for _ in range(20)]
            probes = [_get(port, path) for path in ("/livez", "/readyz") * 5]
            assert connects[0] > 20  # it was cut and came back, all along
        assert statuses == [200] * 20 and probes == [200] * 10, (statuses, probes, refused(server))
        assert refused(server).get("peer_cap", 0) >= 5 and refused(server).get("connection_cap", 0) == 0


def test_probes_are_answered_while_the_cap_is_full():
    overrides = {"http": {"max_connections": 4, "max_connections_per_peer": 2, "read_timeout_s": 30.0}}
    with serve_in_thread(overrides=overrides) as server:
        port = server.http_port
        held = [socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
                for source in ("127.0.0.10", "127.0.0.10", "127.0.0.11", "127.0.0.11")]
        try:
            assert _until(lambda: _get(port, "/metrics", "127.0.0.20") == 503)  # every slot taken
            assert _call(port, "/api/check_health", b"{}", source="127.0.0.20").status == 503
            for i in range(3):  # a probe slot frees once its probe is answered
                assert _get(port, "/livez", f"127.0.0.{30 + i}") == 200
                assert _get(port, "/readyz", f"127.0.0.{40 + i}") == 200
            # One probe slot per address: a silent connection holds its address's, briefly.
            with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.20", 0)) as silent:
                assert _until(lambda: _get(port, "/livez", "127.0.0.20") == 503, 5.0)
                assert _get(port, "/livez", "127.0.0.50") == 200
                took = closed_within(silent, 1.0 + SLACK)
                assert took is not None
            # the slot is given back once the connection's thread ends, after the close the
            # client saw: on a loaded 2-core box that can take seconds
            seen: list[tuple[float, int]] = []  # (seconds since the close, status): what a failure shows
            closed = time.monotonic()

            def answered() -> bool:
                seen.append((round(time.monotonic() - closed, 2), _get(port, "/livez", "127.0.0.20")))
                return seen[-1][1] == 200

            assert _until(answered, 5.0 + SLACK), (refused(server), seen)
            # An address at its share of the cap has no probe slot either.
            assert _get(port, "/livez", "127.0.0.10") == 503
            assert refused(server).get("peer_cap", 0) >= 1
        finally:
            for sock in held:
                sock.close()
        assert _until(lambda: _get(port, "/metrics") == 200)


# -- 10: a CURVE allow-list with auth off ---------------------------------------------------------


@pytest.fixture
def curve(tmp_path) -> Iterator[tuple[dict[str, Any], str]]:
    """A server key pair and an allow-list holding one client key (not the test's), plus a short
    directory for ipc:// sockets."""
    _, server_secret, _ = create_certificates(str(tmp_path / "server"), "server")
    alice_public, _, _ = create_certificates(str(tmp_path / "alice"), "alice")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(alice_public, allowed)
    sock_dir = tempfile.mkdtemp(prefix="kvcm-h2-", dir="/tmp")
    try:
        yield {"curve_secret_key_file": server_secret, "curve_allowed_clients_dir": str(allowed)}, sock_dir
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_an_allow_list_with_auth_off_does_not_start_a_side_port_that_bypasses_it(curve, tmp_path):
    from kvcm.node.app import App

    server, sock_dir = curve
    config = make_test_config(str(tmp_path / "d"), f"ipc://{sock_dir}/rpc", {"server": server})
    with pytest.raises(StartRefused, match=r"http\.allow_unauthenticated_with_curve = true") as refusal:
        App(config)
    assert "auth.enabled = true" in refusal.value.message and "\n" not in refusal.value.message
    assert not os.path.exists(f"{sock_dir}/rpc")  # refused before anything was bound
    # kvcm serve: one line and exit code 2.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    done = subprocess.run([sys.executable, "-m", "kvcm", "serve", "--endpoint", f"ipc://{sock_dir}/cli",
                           "--data-dir", str(tmp_path / "cli"), "--http-port", "0",
                           "--set", f"server.curve_secret_key_file={server['curve_secret_key_file']}",
                           "--set", f"server.curve_allowed_clients_dir={server['curve_allowed_clients_dir']}"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "http.allow_unauthenticated_with_curve" in done.stderr


def test_with_auth_on_the_side_port_lets_no_keyless_process_make_an_admin(curve):
    server, _ = curve
    evil = {"user_name": "evil", "password": "Evil-passw0rd-long", "role": "admin"}
    with serve_in_thread(overrides={"server": server, **AUTH_ON}) as running:
        reply = _json(running.http_port, "/api/add_account", evil)
        assert reply.status == 401, reply.body
        status = _tair_status(_json(running.http_port, "/api/addAccount", {**evil, "role": "ROLE_ADMIN"}))
        assert status["message"].startswith("UNAUTHENTICATED: "), status
        with running.client(auth=ADMIN, **running.app.curve.client_options()) as kv:
            assert "evil" not in {a["user_name"] for a in kv.call("list_account")["accounts"]}


def test_the_operator_may_serve_it_anyway_by_saying_so(curve):
    server, _ = curve
    overrides = {"server": server, "http": {"allow_unauthenticated_with_curve": True}}
    with serve_in_thread(overrides=overrides) as running:
        assert _json(running.http_port, "/api/check_health", {}).status == 200


# -- 12: Tair's storage directories are per caller ------------------------------------------------


def test_one_tenant_never_sees_another_tenant_s_storage_directory(tmp_path):
    roots = {name: str(tmp_path / f"root-{name}") for name in ("a", "b")}
    with serve_in_thread(overrides=AUTH_ON) as server:
        port = server.http_port
        with server.client(auth=ADMIN) as kv:
            for name, root in roots.items():
                kv.call("add_storage", {"storage": {"global_unique_name": f"s{name}", "storage_type": "file",
                                                    "storage_spec": {"root_path": root}}})
                kv.call("create_instance_group", {"instance_group": {"name": f"g{name}", "storage_candidates": [f"s{name}"],
                                                                     "quota": {"capacity": 0}}})
        bearer = {name: [("Authorization", f"Bearer {_token(server, f'u{name}', [f'g{name}'])}")] for name in roots}
        for name in roots:
            register = {"instance_group": f"g{name}", "instance_id": f"i{name}", "block_size": 4,
                        "location_spec_infos": [{"name": "tp0", "size": "64"}]}
            assert _tair_status(_json(port, "/api/registerInstance", register, bearer[name]))["code"] == "OK"
        # Tenant a's call teaches the listener a's directory.
        started = _json(port, "/api/startWriteCache", {"instance_id": "ia", "block_keys": ["1"]}, bearer["a"]).json()
        assert started["locations"][0]["location_specs"][0]["uri"].startswith(f"file://sa{roots['a']}/")
        # Tenant b names a's storage: to b it is a storage kvcm does not know, and a's root stays unsaid.
        location = {"type": "ST_NFS", "spec_size": 64,
                    "location_specs": [{"name": "tp0", "uri": "file://sa/elsewhere/s64/0000000a-00000000.kv?blkid=1&size=64"}]}
        finish = {"instance_id": "ib", "write_session_id": "w", "success_blocks": {"offset": 1}, "locations": [location]}
        status = _tair_status(_json(port, "/api/finishWriteCache", finish, bearer["b"]))
        assert status["code"] == "INVALID_ARGUMENT" and "names no file storage kvcm knows" in status["message"], status
        assert roots["a"] not in status["message"] and "root-a" not in status["message"]
        # The same call by tenant a says where a's directory is: the message above was b's view.
        finish_a = {**finish, "instance_id": "ia"}
        assert roots["a"] in _tair_status(_json(port, "/api/finishWriteCache", finish_a, bearer["a"]))["message"]


def test_caller_roots_key_credentials_not_the_relay_s_client_name():
    roots = CallerRoots()
    token = {"token": "kvcm_x"}
    assert roots.of(None) is roots.of(None)
    assert roots.of({**token, "client": "10.0.0.1"}) is roots.of({**token, "client": "10.0.0.2"})
    assert roots.of(token) is not roots.of({"token": "kvcm_y"}) and roots.of(token) is not roots.of(None)
    assert roots.of({"user": "a", "password": "p"}) is not roots.of({"user": "a", "password": "q"})
    kept = roots.of(token)
    roots.clear()  # a storage changed: every caller asks again
    assert roots.of(token) is not kept


# -- 18: lenient inputs ---------------------------------------------------------------------------


def _kvcm_refusal(port: int, path: str, body: bytes) -> str:
    reply = _call(port, path, body)
    assert reply.status == 400 and reply.json()["error"]["name"] == "INVALID_ARGUMENT", (body, reply.body)
    message: str = reply.json()["error"]["message"]
    return message


def _tair_refusal(port: int, path: str, body: bytes) -> str:
    status = _tair_status(_call(port, path, body))
    assert status["code"] == "INVALID_ARGUMENT", (body, status)
    message: str = status["message"]
    return message


@pytest.fixture(scope="module")
def plain() -> Iterator[RunningServer]:
    with serve_in_thread() as running:
        with running.client() as kv:
            kv.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": 4,
                                          "location_spec_infos": [{"name": "tp0", "size": 64}]})
        yield running


@pytest.mark.parametrize(("body", "path"), [
    (b'{"instance_id": "llm", "instance_id": "other", "query_type": "prefix_match", "block_keys": [1]}', "instance_id"),
    (b'{"instance_id": "llm", "auth": {"user": "x", "user": "admin"}}', "auth.user"),
    (b'{"source_id": "s", "op": "events", "ts": NaN, "events": []}', "ts"),
    (b'{"source_id": "s", "op": "events", "ts": -Infinity, "events": []}', "ts"),
    (b'{"source_id": "s", "op": "events", "events": [{"type": "add", "ts": 1e400}]}', "events[0].ts"),
])
def test_kvcm_routes_refuse_duplicate_keys_and_non_finite_numbers_by_path(plain, body, path):
    for route in ("/api/get_cache_location", "/api/report_events"):
        message = _kvcm_refusal(plain.http_port, route, body)
        assert message.startswith(f"{path}: "), message


def test_kvcm_routes_refuse_null_block_keys(plain):
    body = b'{"instance_id": "llm", "query_type": "prefix_match", "block_keys": [null]}'
    assert "block_keys" in _kvcm_refusal(plain.http_port, "/api/get_cache_location", body)


@pytest.mark.parametrize(("route", "body", "path"), [
    ("getCacheLocation", {"instance_id": "llm", "query_type": "QT_BATCH_GET", "block_keys": [None]}, "block_keys[0]"),
    ("getCacheLocation", {"instance_id": "llm", "query_type": "QT_BATCH_GET", "block_keys": ["1", None]}, "block_keys[1]"),
    ("getCacheLocation", {"instance_id": "llm", "query_type": "QT_BATCH_GET", "block_keys": [1],
                          "location_spec_names": [None]}, "location_spec_names[0]"),
    ("getHostCacheState", {"instance_id": "llm", "block_cache_keys": [None]}, "block_cache_keys[0]"),
    ("reportEvent", {"instance_id": "llm", "host_ip_port": "h:1", "storage_type": "ST_EVENT_REPORT_L2",
                     "events": [None]}, "events[0]"),
    ("finishWriteCache", {"instance_id": "llm", "write_session_id": "w", "locations": [
        {"type": "ST_NFS", "location_specs": [{"name": "tp0", "uri": "gopher://evil.example/1/s64/x.kv"}]}]},
     "locations[0].location_specs[0].uri"),
    ("finishWriteCache", {"instance_id": "llm", "write_session_id": "w", "locations": [
        {"type": "ST_3FS", "location_specs": [{"name": "tp0", "uri": "hf3fs://x/../../etc/passwd"}]}]},
     "locations[0].location_specs[0].uri"),
    ("createInstanceGroup", {"instance_group": {"name": "g", "cache_config": {"reclaim_strategy": {
        "trigger_strategy": {"used_percentage": "NaN"}}}}},
     "instance_group.cache_config.reclaim_strategy.trigger_strategy.used_percentage"),
])
def test_tair_routes_refuse_nulls_in_lists_foreign_uris_and_nan_by_path(plain, route, body, path):
    message = _tair_refusal(plain.http_port, f"/api/{route}", json.dumps(body).encode())
    assert message.startswith(f"{route}: {path}: "), message


@pytest.mark.parametrize(("body", "path"), [
    (b'{"instance_id": "llm", "query_type": "QT_BATCH_GET", "query_type": "QT_PREFIX_MATCH", "block_keys": ["1"]}',
     "query_type"),
    (b'{"instance_id": "llm", "block_mask": {"offset": 1, "offset": 0}, "block_keys": ["1"]}', "block_mask.offset"),
    (b'{"instance_id": "llm", "query_type": "QT_BATCH_GET", "block_keys": ["1"], "sw_size": NaN}', "sw_size"),
])
def test_tair_routes_refuse_duplicate_keys_and_nan_in_tair_s_reply(plain, body, path):
    for route in ("getCacheLocation", "removeCache"):
        message = _tair_refusal(plain.http_port, f"/api/{route}", body)
        assert message.startswith(f"{path}: "), message


# -- an address that keeps being refused waits in the slow lane -------------------------------------


def _lane_server(rate: float) -> Any:
    overrides = {**AUTH_ON, "http": {**AUTH_ON["http"], "suspect_after_failures": 3,
                                     "suspect_connections_per_s": rate}}  # fmt: skip
    return serve_in_thread(overrides=overrides)


def test_an_address_refused_over_and_over_is_served_through_the_slow_lane_and_others_are_not():
    """More than http.suspect_after_failures refusals within a second make the address a suspect:
    its next connections (a good one included) are served through the slow lane, one at a time;
    another address is served directly. A flood of refused requests then costs the process what
    the lane admits, not what the attacker sends (scripts/bench_hostile http_unauth)."""
    with _lane_server(50.0) as server:
        port = server.http_port
        token = _token(server, "lane", ["default"])
        for _ in range(4):  # no credentials: 401 each
            assert _call(port, "/api/check_health", b"{}", source="127.0.0.9").status == 401
        assert refused(server).get("slow_lane", 0) == 0  # counted from the refusals on
        good = _call(port, "/api/check_health", b"{}", [("Authorization", f"Bearer {token}")], source="127.0.0.9")
        assert good.status == 200, good.body  # the suspect's own good request is still served
        assert refused(server).get("slow_lane", 0) == 1
        other = _call(port, "/api/check_health", b"{}", [("Authorization", f"Bearer {token}")], source="127.0.0.10")
        assert other.status == 200 and refused(server).get("slow_lane", 0) == 1  # not through the lane


def test_a_full_slow_lane_turns_the_suspect_away_at_once():
    with _lane_server(0.2) as server:
        port = server.http_port
        for _ in range(4):
            assert _call(port, "/api/check_health", b"{}", source="127.0.0.9").status == 401
        waiting = [socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.9", 0))
                   for _ in range(10)]  # fmt: skip
        try:
            assert _until(lambda: refused(server).get("slow_lane_full", 0) >= 1, 5.0), refused(server)
            # a probe from another address is answered meanwhile
            assert _get(port, "/livez", "127.0.0.11") == 200
        finally:
            for sock in waiting:
                sock.close()

"""The side HTTP port under hostile input: browsers (CSRF, DNS rebinding), slow or silent
connections, and bodies framed to confuse. Raw sockets, so every byte is the test's own."""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcm.errors import Code
from kvcm.http.guards import Authorities, http_status, split_authority
from kvcm.testing import RunningServer, serve_in_thread
from tests.helpers import wait_for

FAST = {"http": {"read_timeout_s": 2.0, "idle_timeout_s": 1.0}}
SLACK = 4.0  # seconds past a deadline a cut may take on a loaded 2-core box
ADMIN_PW = "b00tstrap-Admin-pw"


class Reply:
    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def json(self) -> Any:
        return json.loads(self.body)


def _request(port: int, method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] | None = None,
             host: str | None = "default", length: bool = True) -> bytes:
    """Request bytes: Host (unless None), Connection: close, the given headers, Content-Length."""
    lines = [f"{method} {path} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {f'127.0.0.1:{port}' if host == 'default' else host}")
    lines.append("Connection: close")
    lines += [f"{k}: {v}" for k, v in headers or []]
    if length and (body or method == "POST"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _read_replies(sock: socket.socket, n: int = 1) -> list[Reply]:
    """``n`` replies in a row (pipelined replies may arrive in one segment)."""
    buf, replies = b"", []
    while len(replies) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise EOFError(f"connection closed before a reply: {buf!r}")
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]
        length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
        while len(buf) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
        replies.append(Reply(int(status_line.split()[1]), headers, buf[:length]))
        buf = buf[length:]
    return replies


def _read_reply(sock: socket.socket) -> Reply:
    return _read_replies(sock)[0]


def exchange(port: int, data: bytes, timeout: float = 10.0) -> Reply:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return _read_reply(sock)


def post(port: int, method: str, params: dict[str, Any], headers: list[tuple[str, str]] | None = None,
         host: str | None = "default") -> Reply:
    heads = headers if headers is not None else [("Content-Type", "application/json")]
    return exchange(port, _request(port, "POST", f"/api/{method}", json.dumps(params).encode(), heads, host))


def get(port: int, path: str, headers: list[tuple[str, str]] | None = None, host: str | None = "default") -> Reply:
    return exchange(port, _request(port, "GET", path, headers=headers, host=host))


def accounts(server: RunningServer) -> set[str]:
    with server.client() as c:
        return {a["user_name"] for a in c.call("list_account")["accounts"]}


def refused(server: RunningServer) -> dict[str, float]:
    families = text_string_to_metric_families(server.app.metrics.exposition().decode())
    family = next((f for f in families if f.name == "kvcm_http_refused"), None)
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")} if family else {}


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), reading and discarding; None if
    it stayed open for ``seconds``."""
    start = time.monotonic()
    while True:
        ready, _, _ = select.select([sock], [], [], max(0.0, start + seconds - time.monotonic()))
        if ready:
            try:
                if not sock.recv(65536):
                    return time.monotonic() - start
            except OSError:
                return time.monotonic() - start
        elif time.monotonic() - start >= seconds:
            return None


EVIL = [("Content-Type", "text/plain"), ("Origin", "http://evil.example")]


# -- browsers ---------------------------------------------------------------------------------------


def test_csrf_requests_are_refused_and_create_no_account():
    """What a web page can send without a CORS preflight, and its near misses: none runs."""
    admin = {"user_name": "evil", "password": "Evil-passw0rd-long", "role": "admin"}
    with serve_in_thread() as server:
        port = server.http_port
        cases = [
            (EVIL, 403),  # the reported attack: text/plain plus a foreign Origin
            ([("Content-Type", "text/plain")], 415),  # no Origin: the content type alone stops it
            ([("Content-Type", "application/x-www-form-urlencoded")], 415),
            ([], 415),
            ([("Content-Type", "application/json"), ("Origin", "http://evil.example")], 403),
            ([("Content-Type", "application/json"), ("Origin", "null")], 403),  # sandboxed frames
            ([("Content-Type", "application/json"), ("Origin", f"http://127.0.0.1:{port + 1}")], 403),
            ([("Content-Type", "application/json"), ("Sec-Fetch-Site", "cross-site")], 403),
            ([("Content-Type", "application/json"), ("Sec-Fetch-Site", "same-site")], 403),
        ]
        for headers, status in cases:
            reply = post(port, "add_account", admin, headers)
            assert reply.status == status, (headers, reply.body)
            assert "evil" not in accounts(server), headers
        assert refused(server).get("origin", 0) >= 6 and refused(server).get("content_type", 0) >= 3
        # The same call from this server's own origin works, so the refusals above were the checks.
        ok = post(port, "add_account", admin, [("Content-Type", "application/json; charset=utf-8"),
                                               ("Origin", f"http://127.0.0.1:{port}"), ("Sec-Fetch-Site", "same-origin")])
        assert ok.status == 200, ok.body
        assert "evil" in accounts(server)


def test_csrf_add_storage_changes_nothing(tmp_path):
    victim = tmp_path / "victim"
    storage = {"storage": {"global_unique_name": "stolen", "storage_type": "file",
                           "storage_spec": {"root_path": str(victim)}}}
    with serve_in_thread() as server:
        with server.client() as c:
            before = c.call("list_storage")["storage"]
        reply = post(server.http_port, "add_storage", storage, EVIL)
        assert reply.status == 403
        with server.client() as c:
            assert c.call("list_storage")["storage"] == before
        assert not victim.exists()


def test_rebinding_host_is_refused_everywhere_and_no_snapshot_leaves():
    with serve_in_thread() as server:
        port = server.http_port
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}", f"localhost:{port + 1}",
                     f"127.0.0.2:{port}", "127.0.0.1:0", f"user@127.0.0.1:{port}", "[::1"):
            reply = post(port, "gen_config_snapshot", {}, host=host)
            assert reply.status == 421, (host, reply.body)
            assert b"config_snapshot" not in reply.body
            assert get(port, "/metrics", host=host).status == 421
        assert get(port, "/livez", host=None).status == 400  # HTTP/1.1 without Host
        two = _request(port, "GET", "/livez", headers=[("Host", f"127.0.0.1:{port}")])
        assert exchange(port, two).status == 400
        assert refused(server).get("host", 0) >= 18
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
            reply = post(port, "gen_config_snapshot", {}, host=host)
            assert reply.status == 200 and "config_snapshot" in reply.json()["result"], host


def test_allowed_hosts_extend_the_own_names():
    overrides = {"http": {"allowed_hosts": ("kvcm.internal", "metrics.example:9000")}}
    with serve_in_thread(overrides=overrides) as server:
        port = server.http_port
        assert get(port, "/livez", host="kvcm.internal").status == 200  # a proxy in front: any port
        assert get(port, "/livez", host=f"kvcm.internal:{port}").status == 200
        assert get(port, "/livez", host="metrics.example:9000").status == 200
        assert get(port, "/livez", host="metrics.example").status == 421  # that entry names a port
        origin = [("Content-Type", "application/json"), ("Origin", "https://kvcm.internal")]
        assert post(port, "check_health", {}, origin, host="kvcm.internal").status == 200
        evil = [("Content-Type", "application/json"), ("Origin", "http://kvcm.internal.evil.example")]
        assert post(port, "check_health", {}, evil, host="kvcm.internal").status == 403


def test_options_and_every_reply_carry_no_cors_headers_and_reflect_nothing():
    with serve_in_thread() as server:
        port = server.http_port
        preflight = [("Origin", f"http://127.0.0.1:{port}"), ("Access-Control-Request-Method", "POST"),
                     ("Access-Control-Request-Headers", "content-type")]
        replies = {
            "options": exchange(port, _request(port, "OPTIONS", "/api/add_account", headers=preflight)),
            "options-foreign": exchange(port, _request(port, "OPTIONS", "/api/add_account",
                                                       headers=[("Origin", "http://evil.example")])),
            "put": exchange(port, _request(port, "PUT", "/api/check_health", b"{}")),
            "get-api": get(port, "/api/check_health"),
            "nope": get(port, "/nope<script>alert(1)</script>"),
            "ok": post(port, "check_health", {}, [("Content-Type", "application/json"), ("X-Evil", "<script>x</script>")]),
            "bad-line": exchange(port, b"GET /livez HTTP/9.9<script>\r\nHost: x\r\n\r\n"),
        }
        assert replies["options"].status == 204 and replies["options"].header("Allow") == "POST, OPTIONS"
        assert replies["options-foreign"].status == 403
        assert replies["put"].status == 405 and replies["get-api"].status == 405
        assert replies["nope"].status == 404 and replies["ok"].status == 200
        assert 400 <= replies["bad-line"].status < 600
        for name, reply in replies.items():
            assert not [k for k, _ in reply.headers if k.lower().startswith("access-control-")], name
            raw = reply.body + "".join(f"{k}:{v}" for k, v in reply.headers).encode()
            assert b"script" not in raw and b"evil" not in raw, (name, raw)
            assert reply.header("X-Content-Type-Options") == "nosniff", name


# -- slow and silent connections -----------------------------------------------------------------


@contextmanager
def connections(port: int, n: int) -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        yield socks
    finally:
        for sock in socks:
            sock.close()


def test_slowloris_and_silent_connections_are_cut_at_the_deadline_and_the_cap_holds():
    """cap + 20 connections: half trickle a header byte every 0.25 s (a per-read timeout would
    never fire), half say nothing. The server runs at most max_connections threads, cuts every
    one by read_timeout_s, and then serves a normal request."""
    cap, timeout = 8, 2.0
    overrides = {"http": {"read_timeout_s": timeout, "idle_timeout_s": 1.0, "max_connections": cap}}
    with serve_in_thread(overrides=overrides) as server:
        port = server.http_port
        baseline = threading.active_count()
        peak = baseline
        with connections(port, cap + 20) as socks:
            start = time.monotonic()
            trickle = {s: iter(f"GET /livez HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Pad: {'a' * 400}".encode())
                       for s in socks[::2]}
            open_socks = set(socks)
            cut: dict[socket.socket, float] = {}
            while open_socks and time.monotonic() - start < timeout + SLACK + 6:
                peak = max(peak, threading.active_count())
                for sock in list(open_socks):
                    if closed_within(sock, 0.0) is not None:
                        cut[sock] = time.monotonic() - start
                        open_socks.discard(sock)
                    elif sock in trickle:
                        try:
                            sock.send(bytes([next(trickle[sock], 97)]))
                        except OSError:
                            pass
                time.sleep(0.25)  # pacing the trickling peers: one byte a quarter second
            assert not open_socks, f"{len(open_socks)} connections still open"
            assert max(cut.values()) < timeout + SLACK, sorted(cut.values())
            assert peak - baseline <= cap + 1 + 2, (peak, baseline)  # + the one probe slot of this address
        assert get(port, "/livez").status == 200
        counts = refused(server)
        assert counts.get("timeout", 0) + counts.get("connection_cap", 0) >= cap + 20, counts
        assert counts.get("timeout", 0) >= 1 and counts.get("connection_cap", 0) >= 1, counts


def test_connections_past_the_cap_get_503_at_once_and_slots_come_back():
    with serve_in_thread(overrides={"http": {"max_connections": 2, "read_timeout_s": 30.0}}) as server:
        port = server.http_port
        with connections(port, 2) as held:
            wait_for(lambda: _busy(port), timeout=10)  # until both are accepted
            assert _busy(port)
            assert refused(server).get("connection_cap", 0) >= 1
            for sock in held:
                sock.close()
        wait_for(lambda: not _busy(port), timeout=10)  # the held threads see EOF and end
        assert get(port, "/livez").status == 200


def _busy(port: int) -> bool:
    """A request that is not a probe is turned away (probes have slots of their own past the cap)."""
    try:
        reply = get(port, "/metrics")
    except (EOFError, OSError):
        return True  # the 503 was lost to the reset: still turned away
    return reply.status == 503


def test_keep_alive_serves_several_requests_then_closes_when_idle():
    with serve_in_thread(overrides=FAST) as server:
        port = server.http_port
        head = f"GET /livez HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        body = b"{}"
        api = (f"POST /api/check_health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for data, n in ((head, 1), (api, 1), (head + api + head, 3)):  # the last three pipelined
                sock.sendall(data)
                assert [r.status for r in _read_replies(sock, n)] == [200] * n
            assert closed_within(sock, 1.0 + SLACK) is not None  # idle_timeout_s


def test_a_short_body_is_dropped_at_the_deadline_and_nothing_runs():
    """Declares 200 bytes, sends 10: the read ends at read_timeout_s, the connection closes
    without a reply, and the method never runs."""
    with serve_in_thread(overrides=FAST) as server:
        port = server.http_port
        head = _request(port, "POST", "/api/add_account", b"", [("Content-Type", "application/json"),
                                                                 ("Content-Length", "200")], length=False)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b'{"user_nam')
            took = closed_within(sock, 2.0 + SLACK)
        assert took is not None
        assert refused(server).get("timeout") == 1
        with server.client() as c:
            assert c.call("list_account")["accounts"] == []


# -- framing ----------------------------------------------------------------------------------------


def _account_body(name: str) -> bytes:
    return json.dumps({"user_name": name, "password": "Passw0rd-long-enough", "role": "admin"}).encode()


def test_ambiguous_or_unsupported_framing_is_refused_and_nothing_runs():
    body = _account_body("framed")
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    json_type = ("Content-Type", "application/json")
    cases = [
        ([json_type, ("Content-Length", str(len(body))), ("Content-Length", str(len(body)))], body, 400),
        ([json_type, ("Content-Length", str(len(body))), ("Content-Length", "2")], body, 400),
        ([json_type, ("Transfer-Encoding", "chunked")], chunked, 411),
        ([json_type, ("Transfer-Encoding", "gzip")], body, 411),
        ([json_type, ("Transfer-Encoding", "chunked"), ("Content-Length", str(len(body)))], chunked, 400),
        ([json_type], body, 411),  # no Content-Length at all
        ([json_type, ("Content-Length", f"+{len(body)}")], body, 400),
        ([json_type, ("Content-Length", f" {len(body)} 0")], body, 400),
        ([json_type, ("Content-Length", "-1")], body, 400),
        ([json_type, ("Content-Length", "0x10")], body, 400),
        ([json_type, ("Content-Length", "\u0661\u0662")], body, 400),  # int() would take Arabic digits
    ]
    with serve_in_thread() as server:
        port = server.http_port
        for headers, payload, status in cases:
            data = _request(port, "POST", "/api/add_account", payload, headers, length=False)
            reply = exchange(port, data)
            assert reply.status == status, (headers, reply.body)
            assert reply.header("Connection") == "close", headers
        with server.client() as c:
            assert "framed" not in {a["user_name"] for a in c.call("list_account")["accounts"]}
        counts = refused(server)
        assert counts.get("length", 0) >= 9 and counts.get("transfer_encoding", 0) == 2, counts


def test_huge_bodies_get_413_before_any_byte_is_read():
    with serve_in_thread(overrides={"server": {"max_message_bytes": 4096}}) as server:
        port = server.http_port
        for length in ("1000000000", "4097", "9" * 40):
            data = _request(port, "POST", "/api/check_health", b"",
                            [("Content-Type", "application/json"), ("Content-Length", length)], length=False)
            reply = exchange(port, data)
            assert reply.status == 413, (length, reply.body)
            assert reply.json()["error"]["name"] == "MESSAGE_TOO_LARGE"
        body = b'{"trace_id": "' + b"x" * 3000 + b'"}'
        assert exchange(port, _request(port, "POST", "/api/check_health", body,
                                       [("Content-Type", "application/json")])).status == 200
        assert refused(server).get("too_large") == 3


def test_status_table():
    assert http_status(Code.RATE_LIMITED) == 429
    assert {http_status(c) for c in (Code.TOO_LARGE, Code.MESSAGE_TOO_LARGE, Code.TOO_MANY_KEYS)} == {413}
    assert http_status(Code.UNAUTHENTICATED) == 401 and http_status(Code.PERMISSION_DENIED) == 403
    assert http_status(Code.METHOD_NOT_FOUND) == 404 and http_status(Code.INSTANCE_NOT_EXIST) == 404
    assert http_status(Code.DUPLICATE_ENTITY) == 409 and http_status(Code.TIMEOUT) == 504
    assert http_status(Code.SHUTTING_DOWN) == 503 and http_status(Code.INTERNAL_ERROR) == 500


def test_too_many_keys_maps_to_413_end_to_end():
    with serve_in_thread(overrides={"server": {"max_keys": 4}}) as server:
        port = server.http_port
        with server.client() as c:
            c.call("create_instance_group", {"instance_group": {"name": "g", "storage_candidates": ["default-file"],
                                                                "quota": {"capacity": 0}}})
            c.call("register_instance", {"instance_group": "g", "instance_id": "i", "block_size": 16,
                                         "location_spec_infos": [{"name": "tp0", "size": 1024}],
                                         "model_deployment": {"model_name": "m", "dtype": "fp16"}})
        reply = post(port, "get_cache_location", {"instance_id": "i", "query_type": "prefix_match",
                                                 "block_keys": list(range(10))})
        assert reply.status == 413 and reply.json()["error"]["name"] == "TOO_MANY_KEYS", reply.body


def test_authorities():
    assert split_authority("LocalHost:80") == ("localhost", 80)
    assert split_authority("[::1]:8080") == ("[::1]", 8080)
    assert split_authority("[::1]") == ("[::1]", None)
    for bad in ("", "a:b", "a:0", "a:65536", "a b", "[::1]x", "a@b", "a/b", "::1", "a:+1"):
        assert split_authority(bad) is None, bad
    v4 = Authorities("127.0.0.1", 6382, ())
    assert v4.accepts("127.0.0.1:6382", "127.0.0.1") and v4.accepts("localhost:6382", "127.0.0.1")
    assert not v4.accepts("127.0.0.1", "127.0.0.1")  # no port means 80
    v6 = Authorities("::1", 6382, ())
    assert v6.accepts("[::1]:6382", "::1") and v6.accepts("localhost:6382", "::1")
    wild = Authorities("0.0.0.0", 6382, ())
    assert wild.accepts("10.1.2.3:6382", "10.1.2.3")  # the address the connection came in on
    assert not wild.accepts("localhost:6382", "10.1.2.3") and not wild.accepts("10.1.2.4:6382", "10.1.2.3")
    named = Authorities("kvcm.local", 6382, ("proxy.example", "other:1"))
    assert named.accepts("kvcm.local:6382", "10.0.0.1") and named.accepts("proxy.example:443", "10.0.0.1")
    assert named.accepts_origin("https://proxy.example", "10.0.0.1")
    assert not named.accepts_origin("ftp://proxy.example", "10.0.0.1")
    assert not named.accepts_origin("https://proxy.example/path", "10.0.0.1")
    assert not named.accepts_origin("null", "10.0.0.1")
    with pytest.raises(ValueError, match="allowed_hosts"):
        Authorities("127.0.0.1", 1, ("http://x",))


def test_bad_allowed_hosts_fail_at_start_up():
    from kvcm.config import ConfigError, load

    for bad in (("http://x",), ("x/y",), ("x:port",), ("",)):
        with pytest.raises(ConfigError, match="allowed_hosts"):
            load(None, environ={}, overrides={"http": {"allowed_hosts": bad}})
    for key, value in (("read_timeout_s", 0), ("idle_timeout_s", -1), ("max_connections", 0)):
        with pytest.raises(ConfigError, match=key):
            load(None, environ={}, overrides={"http": {key: value}})
    assert load(None, environ={"KVCM_HTTP_ALLOWED_HOSTS": "a.example, b.example:81"}).http.allowed_hosts == (
        "a.example", "b.example:81")


# -- auth on -------------------------------------------------------------------------------------------


AUTH_ON = {"auth": {"enabled": True, "admin_password": ADMIN_PW}}


def test_auth_on_metrics_and_api_need_credentials_probes_stay_open():
    with serve_in_thread(overrides=AUTH_ON) as server:
        port = server.http_port
        assert get(port, "/livez").status == 200 and get(port, "/readyz").status == 200
        for headers in ([], [("Authorization", "Basic YWRtaW46eA==")], [("Authorization", "Bearer")],
                        [("Authorization", "Bearer a b")], [("Authorization", "Bearer x"), ("Authorization", "Bearer y")]):
            reply = get(port, "/metrics", headers)
            assert reply.status == 401, (headers, reply.body)
            assert (reply.header("WWW-Authenticate") or "").startswith("Bearer"), headers
            assert b"kvcm_" not in reply.body
        json_type = ("Content-Type", "application/json")
        reply = post(port, "check_health", {}, [json_type])
        assert reply.status == 401 and (reply.header("WWW-Authenticate") or "").startswith("Bearer")
        reply = post(port, "check_health", {}, [json_type, ("Authorization", "Bearer not-a-real-token")])
        assert reply.status == 401 and reply.json()["error"]["name"] == "UNAUTHENTICATED"
        reply = post(port, "check_health", {"auth": {"user": "admin", "password": ADMIN_PW}}, [json_type])
        assert reply.status == 200, reply.body
        assert refused(server).get("unauthenticated", 0) >= 6


def test_auth_on_metrics_takes_a_valid_bearer_token_only():
    with serve_in_thread(overrides=AUTH_ON) as server:
        port = server.http_port
        reply = get(port, "/metrics", [("Authorization", "Bearer not-a-real-token")])
        assert reply.status == 401 and reply.header("WWW-Authenticate") is not None
        with server.client(auth={"user": "admin", "password": ADMIN_PW}) as c:
            c.call("add_account", {"user_name": "scraper", "password": "Scraper-passw0rd-long", "role": "user"})
            issued = c.call("add_token", {"user_name": "scraper", "name": "prometheus"})
        token = issued["token"]
        bearer = [("Authorization", f"Bearer {token}")]
        reply = get(port, "/metrics", bearer)
        assert reply.status == 200 and b"kvcm_http_refused_total" in reply.body
        assert token.encode() not in reply.body
        reply = post(port, "whoami", {}, [("Content-Type", "application/json"), *bearer])
        assert reply.status == 200 and reply.json()["result"]["user_name"] == "scraper", reply.body
        with server.client(auth={"user": "admin", "password": ADMIN_PW}) as c:
            c.call("revoke_token", {"token_id": issued["token_id"]})
        # the positive answer is remembered a few seconds only
        wait_for(lambda: get(port, "/metrics", bearer).status != 200, timeout=30, interval=0.2)
        assert get(port, "/metrics", bearer).status == 401


def test_the_port_survives_resets_and_garbage():
    """Connections reset mid-request, binary garbage, a huge request line: the port keeps serving."""
    with serve_in_thread(overrides=FAST) as server:
        port = server.http_port
        for data in (b"\x00\xff" * 1000 + b"\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
                     b"POST /api/check_health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
                try:
                    sock.sendall(data)
                except OSError:
                    pass
        assert get(port, "/livez").status == 200


def _post_from(source: str, port: int, method: str, params: dict[str, Any]) -> Reply:
    body = json.dumps(params).encode()
    head = (f"POST /api/{method} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=20, source_address=(source, 0)) as sock:
        sock.sendall(head + body)
        return _read_reply(sock)


def test_one_addresses_failed_logins_do_not_rate_limit_other_http_users():
    """Every HTTP user reaches the RPC port through the side port's few connections; the side
    port names the remote address, so the login limits count per address, not per connection."""
    overrides = {"auth": {"enabled": True, "admin_password": ADMIN_PW, "failed_login_limit": 3,
                          "failed_login_limit_per_user": 1000}}
    with serve_in_thread(overrides=overrides) as server:
        port = server.http_port
        statuses = [_post_from("127.0.0.2", port, "check_health",
                               {"auth": {"user": "admin", "password": f"wrong-{i}"}}).status for i in range(6)]
        assert statuses[0] == 401 and statuses[-1] == 429, statuses
        ok = _post_from("127.0.0.3", port, "check_health", {"auth": {"user": "admin", "password": ADMIN_PW}})
        assert ok.status == 200, ok
        assert _post_from("127.0.0.2", port, "check_health",
                          {"auth": {"user": "admin", "password": "wrong-again"}}).status == 429

"""The side HTTP port: Prometheus metrics, probes, and JSON calls forwarded to the RPC loop."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvcm.errors import InvalidArgument
from kvcm.testing import serve_in_thread
from tests.helpers import wait_for


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_probes_metrics_and_api():
    with serve_in_thread() as server:
        port = server.http_port
        assert _get(port, "/livez")[0] == 200
        assert _get(port, "/readyz")[0] == 200
        with server.client() as c:
            c.call("check_health")
            c.call("list_storage")
        status, body = _get(port, "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        assert "kvcm_rpc_requests" in families
        methods = {s.labels.get("method") for s in families["kvcm_rpc_requests"].samples}
        assert {"check_health", "list_storage"} <= methods
        # kvcm's own families, plus prometheus_client's standard process and platform collectors
        assert all(name.startswith(("kvcm_", "process_")) or name == "python_info" for name in families)

        status, body = _post(port, "/api/list_storage", b"{}")
        assert status == 200 and any(s["global_unique_name"] == "default-file" for s in body["result"]["storage"])
        status, body = _post(port, "/api/get_instance_info", b'{"instance_id": "nope"}')
        assert status == 404 and body["error"]["name"] == "INSTANCE_NOT_EXIST"
        status, body = _post(port, "/api/no_such_method", b"{}")
        assert status == 404 and body["error"]["name"] == "METHOD_NOT_FOUND"
        status, body = _post(port, "/api/check_health", b"not json")
        assert status == 400
        assert _get(port, "/nope")[0] == 404

        with server.client() as c:
            snap = c.call("get_metrics")
        assert "kvcm_rpc_requests_total" in snap["metrics"]


def test_readyz_fails_while_draining():
    with serve_in_thread() as server:
        server.app.server.draining = True
        assert _get(server.http_port, "/readyz")[0] == 503
        assert _get(server.http_port, "/livez")[0] == 200
        server.app.server.draining = False


def test_livez_fails_while_the_rpc_loop_is_wedged():
    """The loop stuck in one request (here: waiting for the LMDB writer lock,
    which the test holds) turns /livez and /readyz to 503; once it moves again they recover."""
    with serve_in_thread(overrides={"server": {"live_after_s": 1.0}}) as server:
        port = server.http_port
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(server.endpoint)
        try:
            with server.app.store.write():  # a write transaction: the next writer waits for it
                group = {"name": "g", "storage_candidates": ["default-file"], "quota": {"capacity": 0}}
                dealer.send(msgpack.packb([0, 1, "create_instance_group", [{"instance_group": group}]]))
                wait_for(lambda: _get(port, "/livez")[0] != 200, timeout=30, interval=0.1)
                assert _get(port, "/livez")[0] == 503
                assert _get(port, "/readyz")[0] == 503
            assert dealer.poll(10_000), "the loop never came back"
            assert msgpack.unpackb(dealer.recv())[2] is None  # the waiting request then succeeded
            assert _get(port, "/livez")[0] == 200
            assert _get(port, "/readyz")[0] == 200
        finally:
            dealer.close(0)


def _raw_post(port: int, body: bytes, headers: dict[str, str], path: str = "/api/check_health") -> tuple[int, dict]:
    """A POST with headers exactly as given (urllib would fix a bad Content-Length); JSON, as
    the port requires."""
    headers = {"Content-Type": "application/json", **headers}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("POST", path)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        conn.send(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_hostile_bodies_get_a_typed_400_and_the_port_keeps_serving():
    """Each of these used to end in a traceback and a dropped connection (or, for a negative
    Content-Length, a handler reading until the client gave up)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    cases = [
        (b"{}", {"Content-Length": "abc"}, "/api/check_health", "Content-Length"),
        (b"{}", {"Content-Length": "-1"}, "/api/check_health", "Content-Length"),
        (deep, {"Content-Length": str(len(deep))}, "/api/check_health", "RecursionError"),
        (b'{"a":' * 33 + b"1" + b"}" * 33, {}, "/api/check_health", "deeper than 32"),
        (b'{"instance_id": "i", "block_keys": [1180591620717411303424]}', {}, "/api/get_cache_location",
         "64 bits"),
    ]
    with serve_in_thread() as server:
        port = server.http_port
        for body, headers, path, words in cases:
            headers = {"Content-Length": str(len(body)), **headers}
            status, reply = _raw_post(port, body, headers, path)
            assert status == 400, (headers, reply)
            assert reply["error"]["name"] == "INVALID_ARGUMENT" and words in reply["error"]["message"], reply
        assert _post(port, "/api/check_health", b"{}")[0] == 200
        with server.client() as c, pytest.raises(InvalidArgument, match=r"64 bits|cannot be sent"):
            c.call("get_cache_location", {"instance_id": "i", "block_keys": [1 << 70]})

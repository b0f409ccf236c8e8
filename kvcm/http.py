"""The side HTTP port: ``/metrics`` (Prometheus), ``/livez``, ``/readyz`` and ``POST /api/<method>``.

``/api`` calls are forwarded to the RPC front door through a normal :class:`~kvcm.client.Client`,
so every method still runs on the RPC thread, with the same validation, auth and group commit.
Replies are JSON: ``{"result": {...}}`` with status 200, or ``{"error": {...}}`` with 400/404/500.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvcm.client import Client
from kvcm.errors import Code, InvalidArgument, KvcmError, ServerError
from kvcm.metrics import Metrics

log = logging.getLogger("kvcm.http")

_MAX_BODY = 4 << 20
_STATUS = {Code.INVALID_ARGUMENT: 400, Code.METHOD_NOT_FOUND: 404, Code.NOT_FOUND: 404,
           Code.INSTANCE_NOT_EXIST: 404, Code.UNAUTHENTICATED: 401, Code.PERMISSION_DENIED: 403}


class SideHttp:
    """Serves the side port on its own threads. ``live()``/``ready()`` are probes of the app."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Metrics,
        rpc_endpoint: str,
        live: Callable[[], bool],
        ready: Callable[[], bool],
    ) -> None:
        self.metrics = metrics
        self.rpc_endpoint = rpc_endpoint
        self.live = live
        self.ready = ready
        self._local = threading.local()
        self._httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvcm-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

    def call(self, method: str, params: dict[str, Any]) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = Client(self.rpc_endpoint, timeout=30.0, retries=0)
        return client.call(method, params, retry=False)


def _handler_for(side: SideHttp) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kvcm"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("http: " + fmt, *args)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, side.metrics.exposition(), "text/plain; version=0.0.4")
            elif self.path == "/livez":
                self._probe(side.live())
            elif self.path == "/readyz":
                self._probe(side.ready())
            else:
                self._json(404, {"error": {"message": f"no such path {self.path}"}})

        def do_POST(self) -> None:
            if not self.path.startswith("/api/"):
                self._json(404, {"error": {"message": f"no such path {self.path}"}})
                return
            try:
                params = self._body()
                result = side.call(self.path[len("/api/"):], params)
                self._json(200, {"result": result})
            except KvcmError as exc:
                self._json(_STATUS.get(exc.code, 500), {"error": exc.to_wire()})
            except Exception as exc:  # every request gets an answer, whatever failed
                log.exception("http: POST %s failed", self.path[:200])
                self._json(500, {"error": ServerError(f"internal error: {type(exc).__name__}").to_wire()})

        def _body(self) -> dict[str, Any]:
            header = self.headers.get("Content-Length") or "0"
            try:
                length = int(header)
            except ValueError:
                length = -1
            if length < 0:
                self.close_connection = True  # the rest of the stream cannot be framed
                raise InvalidArgument(f"Content-Length {header[:40]!r} is not a byte count")
            if length > _MAX_BODY:
                self.close_connection = True
                raise InvalidArgument(f"body of {length} bytes is too large", Code.MESSAGE_TOO_LARGE)
            raw = self.rfile.read(length) if length else b"{}"
            try:
                params = json.loads(raw or b"{}")
            except (ValueError, RecursionError) as exc:
                raise InvalidArgument(f"body is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
            if not isinstance(params, dict):
                raise InvalidArgument("body must be a JSON object")
            _check_json(params)
            return params

        def _probe(self, ok: bool) -> None:
            self._send(200 if ok else 503, b"ok\n" if ok else b"not ok\n", "text/plain")

        def _json(self, status: int, body: Any) -> None:
            self._send(status, json.dumps(body, default=_jsonable).encode(), "application/json")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


_MAX_DEPTH = 32
_INT_RANGE = range(-(1 << 63), 1 << 64)  # what msgpack, and so the RPC front door, can carry


def _check_json(body: dict[str, Any]) -> None:
    """Refuse what the RPC side could not carry: nesting deeper than any request needs (json
    parses far deeper) and integers outside int64/uint64 (msgpack cannot pack them)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise InvalidArgument(f"body nests deeper than {_MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, int) and not isinstance(value, bool) and value not in _INT_RANGE:
            raise InvalidArgument(f"integer {str(value)[:40]} does not fit in 64 bits")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot encode {type(value).__name__}")

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
from kvcm.errors import Code, InvalidArgument, KvcmError
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

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY:
                raise InvalidArgument(f"body of {length} bytes is too large", Code.MESSAGE_TOO_LARGE)
            raw = self.rfile.read(length) if length else b"{}"
            try:
                params = json.loads(raw or b"{}")
            except ValueError as exc:
                raise InvalidArgument(f"body is not JSON: {exc}") from None
            if not isinstance(params, dict):
                raise InvalidArgument("body must be a JSON object")
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


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot encode {type(value).__name__}")

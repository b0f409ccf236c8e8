"""One connection of the side port: reads with deadlines, keep-alive, the guards before a body
is read, and the routes (``/livez``, ``/readyz``, ``/metrics``, ``POST /api/<method>``, Tair's
``POST /api/<lowerCamelName>``); what it needs of its port is :class:`Side`."""

from __future__ import annotations

import io
import json
import logging
import re
import select
import socket
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Protocol

from kvcm.config import HttpConfig
from kvcm.errors import AccessDenied, Code, InvalidArgument, KvcmError, ServerError, Unavailable, error
from kvcm.http.guards import Authorities, Refused, Suspects, http_status, unauthenticated
from kvcm.http.json_body import NotJson, jsonable, parse_body
from kvcm.http.server import BoundedServer
from kvcm.metrics import Metrics
from kvcm.proto.wire import Decoded, DecodedMap, EncodableMap
from kvcm.tair import translate as tair

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

log = logging.getLogger("kvcm.http")
_LINGER_S = 1.0  # after a refusal, unread request bytes are drained this long before closing
_LINGER_BYTES = 256 << 10  # enough for a reply the client reads late; a flood's rest is cut
_METHOD_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_BEARER = re.compile(r"bearer +([A-Za-z0-9._~+/-]{1,4096}=*)", re.IGNORECASE)
_PROBE_READ_S = 1.0
_PROBES = frozenset({"/livez", "/readyz"})


# -- sockets with a deadline ----------------------------------------------------------------------


class _DeadlineReader(io.RawIOBase):
    """Socket reads that end at ``deadline`` (monotonic), however slowly bytes trickle in: a plain
    socket timeout restarts with every byte, so one byte a second would hold the thread forever."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline = time.monotonic()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _SocketWriter(io.BufferedIOBase):
    """Unbuffered writes, each bounded by ``timeout`` in total (a client that never reads its
    reply cannot hold the thread)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self._timeout = timeout

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        self._sock.settimeout(self._timeout)
        self._sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes


class Side(Protocol):
    """What a connection's handler needs of its port (:class:`kvcm.http.side.SideHttp`)."""

    config: HttpConfig
    metrics: Metrics
    live: Callable[[], bool]
    ready: Callable[[], bool]
    role: Callable[[], str] | None
    max_body: int
    auth_required: bool
    suspects: Suspects
    authorities: Authorities
    admin_authorities: Authorities

    def call(self, method: str, params: EncodableMap) -> Decoded: ...

    def tair(self, name: str, params: DecodedMap, admin: bool, local_ip: str) -> tuple[int, object]: ...

    def refused(self, reason: str) -> None: ...

    def check_token(self, token: str, client: str = "") -> None: ...


class Handler(BaseHTTPRequestHandler):
    """One connection of the side port (or of the admin port: ``admin``), one thread: reads its
    requests within their deadlines, refuses what the guards refuse before a body is read, and
    answers probes, ``/metrics`` and ``/api`` calls through :attr:`side`. Made per port by
    :func:`handler_for`."""

    side: Side
    admin: bool = False
    server_version = "kvcm"
    protocol_version = "HTTP/1.1"  # keep-alive for clients that want it

    def setup(self) -> None:
        self.connection = self.request
        # A reply is two writes (headers, body): with Nagle on, the body waits for the
        # client's delayed ACK of the headers, 40 ms on Linux, on every kept-alive request.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server = self.server if isinstance(self.server, BoundedServer) else None
        self._probe_only = server is not None and server.probe_only(self.request)
        self._reader = _DeadlineReader(self.connection)
        self._reader.deadline = time.monotonic() + (min(self.side.config.read_timeout_s, _PROBE_READ_S) if self._probe_only
                                                    else self.side.config.read_timeout_s)
        self._buffered = io.BufferedReader(self._reader)
        self.rfile = self._buffered
        self.wfile = _SocketWriter(self.connection, self.side.config.read_timeout_s)
        # A request was answered: the next one may be idle first (so was one on a connection
        # the last stage handed over).
        self._served = server is not None and self.request in server.adopted
        self._linger = False  # a refusal left request bytes unread

    def log_message(self, fmt: str, *args: object) -> None:
        log.debug("http: " + fmt, *args)

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection:
            self.handle_one_request()
        if self._linger:
            self._drain()

    def handle_one_request(self) -> None:
        if self._served and not self._next_request_arrived():
            self.close_connection = True
            return
        self._served = True
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
            elif not self.raw_requestline:
                self.close_connection = True
            elif self.parse_request():
                self._route()
        except TimeoutError:
            self.side.refused("timeout")  # an incomplete request is dropped: nothing ran
            self.close_connection = True

    def _next_request_arrived(self) -> bool:
        """Keep-alive: wait up to the idle timeout for the next request's first byte; its
        deadline then runs from there."""
        self._reader.deadline = time.monotonic() + self.side.config.idle_timeout_s
        if not self._pipelined() and not self._wait_readable():
            return False
        try:
            arrived = bool(self._buffered.peek(1))
        except (TimeoutError, OSError):
            return False
        self._reader.deadline = time.monotonic() + self.side.config.read_timeout_s
        return arrived

    def _pipelined(self) -> bool:
        """Bytes of a next request already read into the buffer (no socket read: the reader's
        deadline is set in the past for the look)."""
        deadline, self._reader.deadline = self._reader.deadline, 0.0
        try:
            return bool(self._buffered.peek(1))
        except (TimeoutError, OSError):
            return False
        finally:
            self._reader.deadline = deadline

    def _wait_readable(self) -> bool:
        """Until the idle deadline, for the next request's first byte. False at the deadline, or
        when the port is handed to the next stage meanwhile: the connection is then kept for it
        (any request the client sends on it waits in the socket)."""
        server: BoundedServer = self.server  # type: ignore[assignment]
        while True:
            if server.handing_over.is_set():
                server.kept.add(self.connection)
                return False
            left = self._reader.deadline - time.monotonic()
            if left <= 0:
                return False
            poller = select.poll()  # not select(): a busy process has descriptors past 1024
            try:
                poller.register(self.connection, select.POLLIN)
                poller.register(server.wake_fd(), select.POLLIN)
                ready = poller.poll(left * 1000)
            except (OSError, ValueError):  # the stage closed its sockets: end the connection
                return False
            if any(fd == self.connection.fileno() for fd, _ in ready):
                return True

    def _drain(self) -> None:
        """Read what the client still sends (briefly) before closing: closing a socket with
        unread bytes resets it, and the client may lose the reply it has not read yet."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            end, got, sink = time.monotonic() + _LINGER_S, 0, bytearray(65536)
            while got < _LINGER_BYTES and (left := end - time.monotonic()) > 0:
                self.connection.settimeout(left)
                read = self.connection.recv_into(sink)  # into one buffer: a flood allocates nothing
                if not read:
                    return
                got += read
        except OSError:
            pass

    # -- routing ----------------------------------------------------------------------------

    def _route(self) -> None:
        try:
            if self._probe_only:
                self._only_a_probe()
            self._check_host()
            self._check_origin()
            if self.command == "GET":
                self._get()
            elif self.command == "POST":
                self._post()
            elif self.command == "OPTIONS":
                self._options()
            else:
                raise Refused(405, "method", ServerError(f"HTTP method not allowed: use {self._allow()}",
                                                         Code.UNSUPPORTED), [("Allow", self._allow())])
        except Refused as refusal:
            self._refuse(refusal)

    def _only_a_probe(self) -> None:
        """A connection past the cap, on a probe slot: one probe, then the slot is free again."""
        self.close_connection = True
        if self.command != "GET" or self._path() not in _PROBES:
            raise Refused(503, "connection_cap", Unavailable("too many connections", Code.SERVICE_NOT_READY))

    def _path(self) -> str:
        return self.path.partition("?")[0]

    def _allow(self) -> str:
        path = self._path()
        return "POST, OPTIONS" if path.startswith("/api/") else "GET, OPTIONS"

    def _local_ip(self) -> str:
        return str(self.connection.getsockname()[0])

    def _check_host(self) -> None:
        hosts = self.headers.get_all("Host") or []
        if len(hosts) != 1:
            raise Refused(400, "host", InvalidArgument("exactly one Host header is required"))
        if not self._authorities().accepts(hosts[0], self._local_ip()):
            raise Refused(421, "host", AccessDenied(
                "Host is not an address of this server (add the name to http.allowed_hosts)",
                Code.PERMISSION_DENIED))

    def _check_origin(self) -> None:
        origins = self.headers.get_all("Origin") or []
        site = (self.headers.get("Sec-Fetch-Site") or "none").strip().lower()
        foreign = len(origins) > 1 or any(not self._authorities().accepts_origin(o, self._local_ip())
                                          for o in origins)
        if foreign or site not in ("none", "same-origin"):
            raise Refused(403, "origin", AccessDenied("cross-origin requests are refused", Code.PERMISSION_DENIED))

    def _authorities(self) -> Authorities:
        return self.side.admin_authorities if self.admin else self.side.authorities

    def _get(self) -> None:
        path = self._path()
        if self.admin and not path.startswith("/api/"):
            raise Refused(404, "path", error(Code.NOT_FOUND, "no such path (the self.admin port serves /api only)"))
        if path == "/metrics":
            if self.side.auth_required:
                self._check_bearer()
            self._send(200, self.side.metrics.exposition(), "text/plain; version=0.0.4")
        elif path == "/livez":
            self._probe(self.side.live())
        elif path == "/readyz":
            self._ready_probe()
        elif path.startswith("/api/"):
            raise Refused(405, "method", ServerError("use POST for /api", Code.UNSUPPORTED), [("Allow", "POST, OPTIONS")])
        else:
            raise Refused(404, "path", error(Code.NOT_FOUND, "no such path"))

    def _options(self) -> None:
        if self._path() not in ("/metrics", "/livez", "/readyz") and not self._path().startswith("/api/"):
            raise Refused(404, "path", error(Code.NOT_FOUND, "no such path"))
        self.close_connection = self.close_connection or self._has_body()
        self._send(204, b"", "", [("Allow", self._allow())])

    def _has_body(self) -> bool:
        return "Transfer-Encoding" in self.headers or (self.headers.get("Content-Length") or "0").strip() != "0"

    def _check_bearer(self) -> None:
        token = self._bearer()
        if token is None:
            raise unauthenticated("credentials required: Authorization: Bearer <token>")
        self._verify(token)

    def _verify(self, token: str) -> None:
        try:
            self.side.check_token(token, self._client())
        except AccessDenied as exc:
            if exc.code is Code.UNAUTHENTICATED:
                raise unauthenticated("invalid token") from None
            raise Refused(403, "permission", exc) from None
        except KvcmError as exc:
            raise Refused(http_status(exc.code), "auth_check", exc) from None

    def _bearer(self) -> str | None:
        values = self.headers.get_all("Authorization") or []
        if not values:
            return None
        match = _BEARER.fullmatch(values[0].strip()) if len(values) == 1 else None
        if match is None:
            raise unauthenticated("Authorization must be one 'Bearer <token>' header")
        return match.group(1)

    def _client(self) -> str:
        return str(self.client_address[0])[:64]

    def _post(self) -> None:
        path = self._path()
        name = path[len("/api/"):]
        is_tair = path.startswith("/api/") and tair.TAIR_NAME.fullmatch(name) is not None
        if not is_tair and (self.admin or not path.startswith("/api/") or not _METHOD_NAME.fullmatch(name)):
            raise Refused(404, "path", error(Code.NOT_FOUND, "no such path"))
        length = self._framing()
        if is_tair:
            self._tair_post(name, length)
            return
        bearer = self._admit(length)
        try:
            params = self._read_json(length)
        except KvcmError as exc:  # read whole but unusable: answer and close
            raise Refused(http_status(exc.code), "body", exc) from None
        self._credentials(params, bearer)
        self._forward(name, params)

    def _admit(self, length: int) -> str | None:
        """Auth on: whether a body of ``length`` bytes may be read, decided from the headers
        alone, so a request without valid credentials costs no read or parse of its body. A
        bearer token must be valid (returned); without one, the credentials can only be in
        the body, which may then be ``http.max_unauthenticated_body_bytes`` at most."""
        if not self.side.auth_required:
            return None
        token = self._bearer()
        if token is not None:
            self._verify(token)
            return token
        cap = self.side.config.max_unauthenticated_body_bytes
        if length > cap:
            raise unauthenticated(f"credentials required: a body over {cap} bytes is read only with "
                                   "Authorization: Bearer <token> (http.max_unauthenticated_body_bytes)")
        return None

    def _credentials(self, params: DecodedMap, bearer: str | None) -> None:
        """The call's ``auth``: the body's own, else the bearer token (Refused without either)."""
        if self.side.auth_required and "auth" not in params:
            if bearer is None:
                raise unauthenticated('credentials required: Authorization: Bearer <token>, or "auth" in the body')
            params["auth"] = {"token": bearer}
        auth = params.get("auth")
        if isinstance(auth, dict):
            # Every HTTP user reaches the RPC port through this side's few connections: name
            # the remote address, so one address's failed logins do not rate-limit the others.
            auth["client"] = self._client()

    def _tair_post(self, name: str, length: int) -> None:
        """A Tair call: every answer is Tair's (missing credentials too: HTTP 200 and the
        header's status, which Tair's client reads), except a body that does not parse."""
        try:
            bearer = self._admit(length)
        except Refused as refusal:  # the body stays unread: the connection cannot carry another request
            self.close_connection = self._linger = True
            self._tair_refused(refusal, {})
            return
        try:
            params = self._read_json(length)
        except NotJson:  # Tair's server answers a body it cannot parse with 400 and {}
            self.side.refused("body")
            self.close_connection = self._linger = True
            self._json(400, {})
            return
        except InvalidArgument as exc:  # JSON, but not what a request may hold: Tair's answer
            self.side.refused("body")
            self._json(200, tair.refused(exc, {}))
            return
        try:
            self._credentials(params, bearer)
        except Refused as refusal:
            self._tair_refused(refusal, params)
            return
        self._json(*self.side.tair(name, params, self.admin, self._local_ip()))

    def _count_refusal(self, refusal: Refused) -> None:
        # the client's own fault (credentials, Host, Origin, framing...), not the server's
        # capacity: a client that behaves is not refused ten times a second
        if refusal.status < 500:
            self.side.suspects.failed(self._client())

    def _tair_refused(self, refusal: Refused, params: DecodedMap) -> None:
        self.side.refused(refusal.reason)
        self._count_refusal(refusal)
        self._json(200, tair.refused(refusal.error, params), refusal.headers)

    def _forward(self, name: str, params: DecodedMap) -> None:
        try:
            self._json(200, {"result": self.side.call(name, params)})
        except KvcmError as exc:
            status = http_status(exc.code)
            extra = [("WWW-Authenticate", 'Bearer realm="kvcm"')] if status == 401 else []
            self._json(status, {"error": exc.to_wire()}, extra)
        except Exception as exc:  # every request gets an answer, whatever failed
            log.exception("http: POST %s failed", name)
            self._json(500, {"error": ServerError(f"internal error: {type(exc).__name__}").to_wire()})

    # -- the body ---------------------------------------------------------------------------

    def _framing(self) -> int:
        """The body's length, from headers that frame it one way only (nothing read yet)."""
        self._check_content_type()
        return self._content_length()

    def _read_json(self, length: int) -> DecodedMap:
        raw = self.rfile.read(length) if length else b""
        if len(raw) < length:  # the client closed its side before sending it all
            raise Refused(400, "length", InvalidArgument("body shorter than its Content-Length"))
        return parse_body(raw)

    def _check_content_type(self) -> None:
        kinds = self.headers.get_all("Content-Type") or []
        media = kinds[0].partition(";")[0].strip().lower() if len(kinds) == 1 else ""
        if media != "application/json":
            raise Refused(415, "content_type", InvalidArgument("/api takes Content-Type: application/json"))

    def _content_length(self) -> int:
        lengths = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers:
            if lengths:  # two framings: how a smuggled request hides
                raise Refused(400, "length", InvalidArgument("Content-Length and Transfer-Encoding together"))
            raise Refused(411, "transfer_encoding", InvalidArgument(
                "Transfer-Encoding is not supported: send the body with a Content-Length"))
        if not lengths:
            raise Refused(411, "length", InvalidArgument("Content-Length is required"))
        if len(lengths) > 1:
            raise Refused(400, "length", InvalidArgument("more than one Content-Length header"))
        text = lengths[0].strip()
        if not text.isascii() or not text.isdigit():
            raise Refused(400, "length", InvalidArgument("Content-Length must be a decimal byte count"))
        if len(text) > 19 or int(text) > self.side.max_body:
            raise Refused(413, "too_large", InvalidArgument(
                f"body larger than {self.side.max_body} bytes (server.max_message_bytes)", Code.MESSAGE_TOO_LARGE))
        return int(text)

    # -- replies ----------------------------------------------------------------------------

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The parser's own errors (bad request line, header limits): a fixed JSON body that
        echoes nothing of the request."""
        phrase = self.responses.get(code, ("error", ""))[0]
        self._refuse(Refused(code, "malformed", error(Code.INVALID_ARGUMENT, f"bad request: {phrase}")))

    def _refuse(self, refusal: Refused) -> None:
        self.side.refused(refusal.reason)
        self._count_refusal(refusal)
        self.close_connection = True
        self._linger = True
        self._json(refusal.status, {"error": refusal.error.to_wire()}, refusal.headers)

    def _ready_probe(self) -> None:
        """Under the lease only the leader is ready (a follower refuses every write); the body
        and ``X-Kvcm-Role`` name the role either way."""
        if self.side.role is None:
            self._probe(self.side.ready())
            return
        role = self.side.role()
        ok = self.side.ready() and role == "leader"
        self._send(200 if ok else 503, (b"ok\n" if ok else b"not ok\n") + f"role: {role}\n".encode(),
                   "text/plain", [("X-Kvcm-Role", role)])

    def _probe(self, ok: bool) -> None:
        self._send(200 if ok else 503, b"ok\n" if ok else b"not ok\n", "text/plain")

    def _json(self, status: int, body: object, headers: Iterable[tuple[str, str]] = ()) -> None:
        self._send(status, json.dumps(body, default=jsonable).encode(), "application/json", headers)

    def _send(self, status: int, body: bytes, kind: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        if self.request_version == "HTTP/0.9":  # a status line even then: no client speaks 0.9
            self.request_version = "HTTP/1.0"
        self.send_response(status)
        if status != 204:
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)



def handler_for(side: Side, admin: bool = False) -> type[Handler]:
    """The handler class of a port: ``admin``, the admin port, serves Tair's AdminService RPCs
    only (the server makes one instance per connection, so the port's parts are class fields)."""
    return type("Handler", (Handler,), {"side": side, "admin": admin})

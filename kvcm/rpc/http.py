"""The side HTTP port: ``/metrics`` (Prometheus), ``/livez``, ``/readyz`` and ``POST /api/<method>``.

``POST /api/<lowerCamelName>`` is Tair KVCM's RPC of that name, in Tair's JSON (:mod:`kvcm.tair`;
kvcm's own names are snake_case, so the two never clash). With ``http.admin_port`` a second
listener serves Tair's AdminService RPCs and nothing else, and the side port Tair's MetaService.

``/api`` calls are forwarded to the RPC front door through pooled :class:`~kvcm.client.Client`\\ s,
so every method still runs on the RPC thread, with the same validation, auth and group commit.
Replies are JSON: ``{"result": {...}}`` with status 200, or ``{"error": {"code", "name",
"message"}}`` with the status below.

The port is for programs (Prometheus, probes, scripts), never for browsers. Any web page a user
visits can make the browser send requests to a loopback port, so the port refuses what only a
browser would send: a foreign ``Origin`` or ``Sec-Fetch-Site``, a ``Host`` that is not this
server's own address (DNS rebinding), and ``/api`` bodies that are not ``application/json`` (a
page can post ``text/plain`` without a CORS preflight). No CORS header is ever sent.

Each connection has one thread, at most ``http.max_connections`` of them, and at most
``http.max_connections_per_peer`` from one remote address; a connection past either gets a canned
503 and is closed on the accept thread. Past the cap, a few more slots (one per address) each
serve a single ``/livez`` or ``/readyz``, so probes are answered while the cap is full. A request
(line, headers and body) must arrive within ``http.read_timeout_s`` of its first byte (of the
connection, for the first request), however slowly it trickles in; a kept-alive connection idle
for ``http.idle_timeout_s`` is closed.

With auth on, a request's credentials are checked before its body is read: a bearer token with
RPC ``whoami`` (remembered briefly), and without one the body, which must then carry them, may be
``http.max_unauthenticated_body_bytes`` at most. Refused, the body is never read or parsed, only
drained briefly before the connection closes.

======  ============================================================================================
Status  When
======  ============================================================================================
200     the call succeeded (``/livez``, ``/readyz``: the probe passed)
204     ``OPTIONS`` of a known path (an ``Allow`` header, no CORS headers)
400     bad request line or headers, two ``Content-Length``, ``Content-Length`` with
        ``Transfer-Encoding``, a body that is not a JSON object, or has a key twice in an object, a
        non-finite number, an integer past 64 bits or nesting past 32 levels (named by its path);
        INVALID_ARGUMENT from the call
401     auth on and no or bad credentials, or no bearer token for a body over
        ``http.max_unauthenticated_body_bytes`` (``WWW-Authenticate: Bearer``; Tair's routes answer
        200 in Tair's reply, docs/tair.md); UNAUTHENTICATED
403     a foreign ``Origin`` or a cross-site ``Sec-Fetch-Site``; PERMISSION_DENIED
404     unknown path; METHOD_NOT_FOUND, NOT_FOUND, INSTANCE_NOT_EXIST, WRITE_SESSION_*
405     a method other than GET (probes, metrics), POST (``/api``) or OPTIONS
409     DUPLICATE_ENTITY, VERSION_CONFLICT, STILL_REFERENCED
411     ``/api`` POST without ``Content-Length``, or with ``Transfer-Encoding`` (chunked)
413     body larger than ``server.max_message_bytes``; MESSAGE_TOO_LARGE, TOO_MANY_KEYS, TOO_LARGE
415     ``/api`` body not sent as ``Content-Type: application/json``
421     ``Host`` is not an address of this server nor in ``http.allowed_hosts``
429     RATE_LIMITED
500     INTERNAL_ERROR, IO_ERROR, UNSUPPORTED, or a failure of the HTTP side itself
503     probe failed; connection cap (or the address's share of it) reached; SERVICE_NOT_READY,
        SHUTTING_DOWN, SERVER_NOT_LEADER
504     TIMEOUT: the RPC loop did not answer in time
507     QUOTA_EXCEEDED, NO_STORAGE_AVAILABLE, CAPACITY_EXHAUSTED, REACH_MAX_ENTITY_CAPACITY
======  ============================================================================================

The HTTP parser itself may also answer 414 (request line over 64 KiB) or 431 (too many or too long
headers). A refusal by the port itself (any status above that it decides before or instead of a
call) closes the connection and echoes nothing of the request; a call's own answer keeps it open.
``docs/http.md`` has the same table and the reasons behind each check.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import ipaddress
import json
import logging
import math
import queue
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvcm.client import IDEMPOTENT_METHODS, Client, Endpoints
from kvcm.config import Config, HttpConfig
from kvcm.errors import AccessDenied, Code, InvalidArgument, KvcmError, ServerError, StartRefused, Unavailable, error
from kvcm.metrics import Metrics
from kvcm.proto import wire
from kvcm.tair import translate as tair

log = logging.getLogger("kvcm.rpc.http")

_TOKEN_CACHE_S = 5.0  # a verified bearer token is trusted this long before whoami is asked again
_BAD_TOKEN_CACHE_S = 1.0  # a token whoami refused is refused from memory this long (a flood of one costs one call)
_MAX_CACHED_TOKENS = 1024
_LINGER_S = 1.0  # after a refusal, unread request bytes are drained this long before closing
_LINGER_BYTES = 256 << 10  # enough for a reply the client reads late; a flood's rest is cut
_RPC_TIMEOUT_S = 30.0
# A role change waits this long for the side port's requests in flight to be answered by the
# stage that took them, before the stage stops (a request needs milliseconds; the bound keeps a
# stuck one from holding a takeover); the accept loop of a held port looks for the change this often.
_HAND_OVER_S = 1.0
_HELD_POLL_S = 0.05
_OWN_POLL_S = 0.1
# The leader's cluster info, asked by a follower for Tair's getClusterInfo (its HTTP port) and
# before a Tair call follows SERVER_NOT_LEADER to it: well under Tair's client timeout (1 s by
# default), so a dead leader is reported before the client gives up. The verdict is kept briefly.
_ASK_TIMEOUT_S = 0.5
_LEADER_VERDICT_S = 1.0
# How long a Tair call a follower sends on to the leader waits for its answer: past Tair's client
# timeout already, far below the RPC timeout (a leader that stopped within the verdict's second).
_FORWARD_TIMEOUT_S = 2.0
_METHOD_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_BEARER = re.compile(r"bearer +([A-Za-z0-9._~+/-]{1,4096}=*)", re.IGNORECASE)
_DIGITS = re.compile(r"[0-9]{1,19}")
_HOST_NAME = re.compile(r"[a-z0-9_.-]{1,253}|\[[0-9a-f:.]{2,45}\]")
_BUSY_BODY = b'{"error": {"code": 4, "name": "SERVICE_NOT_READY", "message": "too many connections"}}'
# Connection slots past http.max_connections, each serving one /livez or /readyz (so probes are
# answered while the cap is full), at most one per remote address; a request must arrive on one
# within this, so a silent connection holds it briefly.
_PROBE_SLOTS = 4
#: How long an address stays a suspect after its last burst of refusals (:class:`Suspects`).
_SUSPECT_S = 10.0
#: Addresses whose refusals are counted, and suspects, at most (a flood of addresses is forgotten).
_MAX_TRACKED = 4096
#: Connections of suspects waiting in the slow lane at most.
_LANE_DEPTH = 8
_PROBE_READ_S = 1.0
_PROBES = frozenset({"/livez", "/readyz"})
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
         b"Connection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))

_STATUS: dict[Code, int] = {
    Code.INVALID_ARGUMENT: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.METHOD_NOT_FOUND: 404, Code.NOT_FOUND: 404, Code.INSTANCE_NOT_EXIST: 404,
    Code.WRITE_SESSION_UNKNOWN: 404, Code.WRITE_SESSION_EXPIRED: 404,
    Code.DUPLICATE_ENTITY: 409, Code.VERSION_CONFLICT: 409, Code.STILL_REFERENCED: 409,
    # The request asks for more than the server takes: the same status as an oversized body.
    Code.MESSAGE_TOO_LARGE: 413, Code.TOO_MANY_KEYS: 413, Code.TOO_LARGE: 413,
    Code.RATE_LIMITED: 429,
    Code.SERVICE_NOT_READY: 503, Code.SHUTTING_DOWN: 503, Code.SERVER_NOT_LEADER: 503,
    Code.TIMEOUT: 504,
    Code.QUOTA_EXCEEDED: 507, Code.NO_STORAGE_AVAILABLE: 507, Code.CAPACITY_EXHAUSTED: 507,
    Code.REACH_MAX_ENTITY_CAPACITY: 507,
}


def http_status(code: Code) -> int:
    """The HTTP status of a kvcm error code: the one mapping of the side port."""
    return _STATUS.get(code, 500)


class Refused(Exception):
    """A request the side port turns away itself; ``reason`` labels ``kvcm_http_refused_total``."""

    def __init__(self, status: int, reason: str, err: KvcmError, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(err.message)
        self.status = status
        self.reason = reason
        self.error = err
        self.headers = tuple(headers)


def _unauthenticated(message: str) -> Refused:
    return Refused(401, "unauthenticated", AccessDenied(message, Code.UNAUTHENTICATED),
                   [("WWW-Authenticate", 'Bearer realm="kvcm"')])


# -- which Host and Origin values are this server's own -------------------------------------------


def split_authority(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` or ``[v6]:port`` -> (lower-case host, port or None); None when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[: end + 1], value[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text = value.partition(":")
        port_text = port_text if sep else None
    if not _HOST_NAME.fullmatch(host):
        return None
    if port_text is None:
        return host, None
    if not _DIGITS.fullmatch(port_text) or not 0 < int(port_text) < 65536:
        return None
    return host, int(port_text)


def _literal(address: str) -> str:
    """An IP address as it is written in a Host header (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


class Authorities:
    """The ``Host``/``Origin`` authorities this server answers to.

    Its own: the bind host when it is a name or a literal (not a wildcard), the local address a
    connection arrived at, and ``localhost`` when that address is a loopback one — all at the
    bound port. Plus ``http.allowed_hosts``: ``name`` (any port, e.g. behind a proxy) or
    ``name:port``. A rebinding attack brings its own DNS name, which is none of these."""

    def __init__(self, bind_host: str, port: int, allowed: Iterable[str]) -> None:
        self.port = port
        bind = bind_host.strip().lower()
        self._own = set() if bind in ("", "0.0.0.0", "::", "[::]") else {_literal(bind.strip("[]"))}
        self._any_port: set[str] = set()
        self._exact: set[tuple[str, int]] = set()
        for entry in allowed:
            parsed = split_authority(entry)
            if parsed is None:
                raise ValueError(f"http.allowed_hosts: {entry!r} is not a host or host:port")
            if parsed[1] is None:
                self._any_port.add(parsed[0])
            else:
                self._exact.add((parsed[0], parsed[1]))

    def accepts(self, authority: str, local_ip: str, default_port: int = 80) -> bool:
        parsed = split_authority(authority)
        if parsed is None:
            return False
        host, port = parsed[0], default_port if parsed[1] is None else parsed[1]
        if host in self._any_port or (host, port) in self._exact:
            return True
        return port == self.port and host in self._own_at(local_ip)

    def _own_at(self, local_ip: str) -> set[str]:
        own = {*self._own, _literal(local_ip)}
        try:
            if ipaddress.ip_address(local_ip).is_loopback:
                own.add("localhost")
        except ValueError:
            pass
        return own

    def accepts_origin(self, origin: str, local_ip: str) -> bool:
        """``scheme://host[:port]`` whose authority is one of ours (``null`` never is)."""
        scheme, sep, authority = origin.strip().lower().partition("://")
        ports = {"http": 80, "https": 443}
        if not sep or scheme not in ports or "/" in authority or "@" in authority:
            return False
        return self.accepts(authority, local_ip, ports[scheme])


# -- sockets with a deadline ----------------------------------------------------------------------


class _DeadlineReader(io.RawIOBase):
    """Socket reads that end at ``deadline`` (monotonic), however slowly bytes trickle in: a plain
    socket timeout restarts with every byte, so one byte a second would hold the thread forever."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline = time.monotonic()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
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

    def write(self, data: Any) -> int:
        self._sock.settimeout(self._timeout)
        self._sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes


ANY, PROBE = "any", "probe"  # the kinds of connection slot (:class:`Slots`)


class Slots:
    """The connection slots of one listener: ``total`` for any request, plus :data:`_PROBE_SLOTS`
    taken only when those are full, each serving one probe; at most ``per_peer`` of both held by
    one remote address, so a client that reconnects as fast as it is cut cannot hold them all."""

    def __init__(self, total: int, per_peer: int) -> None:
        self._total = total
        self._per_peer = per_peer
        self._lock = threading.Lock()
        self._used = {ANY: 0, PROBE: 0}
        self._peers: dict[str, int] = {}
        self._probing: set[str] = set()  # the peers holding a probe slot (one each)

    def take(self, peer: str) -> str:
        """:data:`ANY`, :data:`PROBE`, or why there is no slot (``peer_cap``, ``connection_cap``)."""
        with self._lock:
            if self._peers.get(peer, 0) >= self._per_peer:
                return "peer_cap"
            if self._used[ANY] < self._total:
                kind = ANY
            elif self._used[PROBE] < _PROBE_SLOTS and peer not in self._probing:
                kind = PROBE
                self._probing.add(peer)
            else:
                return "connection_cap"
            self._used[kind] += 1
            self._peers[peer] = self._peers.get(peer, 0) + 1
            return kind

    def give_back(self, peer: str, kind: str) -> None:
        with self._lock:
            self._used[kind] -= 1
            if kind == PROBE:
                self._probing.discard(peer)
            left = self._peers.pop(peer) - 1
            if left:
                self._peers[peer] = left


class Suspects:
    """Addresses whose requests the side port keeps refusing. More than ``limit`` refusals for
    the client's own fault (no or bad credentials, a foreign Host or Origin, a malformed request)
    within one second make an address a suspect for
    :data:`_SUSPECT_S`; its new connections then wait in the :class:`SlowLane`. A client that
    floods unauthenticated requests costs the process a thread, a parse and a reply each, and
    those share the interpreter with the RPC loop: the lane caps what one address gets of it,
    while another address's requests (and the suspect's own, at the lane's pace) are served."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._counts: dict[str, tuple[int, int]] = {}  # peer -> (second, refusals in it)
        self._until: dict[str, float] = {}  # peer -> suspect until (monotonic)

    def failed(self, peer: str) -> None:
        now = time.monotonic()
        second = int(now)
        with self._lock:
            was, count = self._counts.get(peer, (second, 0))
            count = count + 1 if was == second else 1
            if len(self._counts) >= _MAX_TRACKED and peer not in self._counts:
                self._counts.clear()  # a flood of addresses: start counting afresh
            self._counts[peer] = (second, count)
            if count > self._limit:
                if len(self._until) >= _MAX_TRACKED and peer not in self._until:
                    self._until = {p: t for p, t in self._until.items() if t > now}
                    if len(self._until) >= _MAX_TRACKED:
                        return
                self._until[peer] = now + _SUSPECT_S

    def suspect(self, peer: str) -> bool:
        until = self._until.get(peer)
        return until is not None and until > time.monotonic()


class SlowLane:
    """Connections of suspect addresses, served one every ``1 / rate`` seconds on one thread
    (which only starts their handling); at most :data:`_LANE_DEPTH` wait, the rest are turned
    away (503) on the accept thread."""

    def __init__(self, rate: float, serve: Callable[[socket.socket, Any], None],
                 turn_away: Callable[[socket.socket], None]) -> None:
        self._gap = 1.0 / rate
        self._serve = serve
        self._turn_away = turn_away
        self._queue: queue.Queue[tuple[socket.socket, Any] | None] = queue.Queue(_LANE_DEPTH)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def offer(self, request: socket.socket, client_address: Any) -> bool:
        """Queue the connection (False when the lane is full)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvcm-http-slow-lane", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait((request, client_address))
            return True
        except queue.Full:
            return False

    def close(self) -> None:
        """Turn away what waits and end the thread."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._turn_away(item[0])
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._serve(*item)
            except Exception:  # one connection's failure ends only that connection
                log.debug("http: a slow-lane connection failed", exc_info=True)
            time.sleep(self._gap)


def _peer(client_address: Any) -> str:
    """The remote address a connection's slots are counted under (no port: one host is one peer)."""
    if isinstance(client_address, tuple) and client_address:
        return str(client_address[0])
    return str(client_address)


class _BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with capped connection threads (:class:`Slots`) and a handle on live
    connections."""

    daemon_threads = True
    block_on_close = False  # stop() closes the connections instead of waiting for them
    request_queue_size = 128  # a burst of connects waits in the backlog rather than being dropped

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 slots: Slots, refused: Callable[[str], None],
                 held: tuple[SidePort, bool] | None = None, suspects: Suspects | None = None,
                 lane_rate: float = 5.0) -> None:
        """``held``: the :class:`SidePort` whose listener this server accepts on (not bound, nor
        closed, here) and whether it is the admin listener. ``suspects``: addresses whose new
        connections wait in a :class:`SlowLane` served ``lane_rate`` times a second."""
        self._slots = slots
        self._suspects = suspects
        self._lane = SlowLane(lane_rate, self._start, self._turn_away)
        self._live: dict[socket.socket, tuple[str, str]] = {}  # connection -> (peer, slot kind)
        self._live_lock = threading.Lock()
        self._refused = refused
        self._held = held
        self.kept: set[socket.socket] = set()  # connections to give to the next stage, not close
        self.adopted: set[socket.socket] = set()  # connections of the last stage: idle, served before
        # Readable once this server hands its connections over: wakes every idle connection thread.
        self.handing_over = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        super().__init__(address, handler, bind_and_activate=held is None)
        if held is not None:
            self.socket.close()
            self.socket = held[0].listener(held[1])
            self.server_address = self.socket.getsockname()
            self.server_name, self.server_port = address[0], int(self.server_address[1])  # as server_bind sets

    def wake_fd(self) -> socket.socket:
        return self._wake_r

    def begin_hand_over(self) -> None:
        """Idle connection threads end their wait and leave their connection to the next stage."""
        self.handing_over.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def live_count(self) -> int:
        with self._live_lock:
            return len(self._live)

    def probe_only(self, request: socket.socket) -> bool:
        """The connection holds a probe slot: it may ask for one probe, nothing else."""
        with self._live_lock:
            return self._live.get(request, ("", ANY))[1] == PROBE

    def adopt(self, request: socket.socket, client_address: Any) -> None:
        """Serve a connection the last stage handed over (its thread starts with the idle wait)."""
        self.adopted.add(request)
        self.process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        # The slot goes back before the client can see the close: a client that reconnects as
        # soon as its answer ends must not find its own last connection still counted.
        self._release(request)
        if self._held is not None and request in self.kept:
            self.kept.discard(request)
            try:
                peer = request.getpeername()
            except OSError:  # the client went away meanwhile
                super().shutdown_request(request)
                return
            self._held[0].keep(request, peer, self._held[1])
            return
        super().shutdown_request(request)

    def server_close(self) -> None:
        self._lane.close()
        if self._held is None:
            super().server_close()
        for sock in (self._wake_r, self._wake_w):
            sock.close()

    def process_request(self, request: Any, client_address: Any) -> None:
        if self._suspects is not None and self._suspects.suspect(_peer(client_address)):
            if self._lane.offer(request, client_address):
                self._refused("slow_lane")  # served later, at the lane's pace
            else:
                self._refused("slow_lane_full")
                self._turn_away(request)
            return
        self._start(request, client_address)

    def _start(self, request: Any, client_address: Any) -> None:
        """A connection's slot and thread (or 503 when no slot is left)."""
        peer = _peer(client_address)
        kind = self._slots.take(peer)
        if kind not in (ANY, PROBE):
            self._refused(kind)
            self._turn_away(request)
            return
        with self._live_lock:
            self._live[request] = (peer, kind)
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread: give the slot back (e.g. threads exhausted)
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: socket.socket) -> None:
        self.adopted.discard(request)
        with self._live_lock:
            held = self._live.pop(request, None)
        if held is not None:
            self._slots.give_back(*held)

    def _turn_away(self, request: socket.socket) -> None:
        """On the accept thread: never block, never spawn a thread."""
        try:
            request.setblocking(False)
            request.send(_BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("http: connection ended with an error", exc_info=True)

    def close_connections(self) -> None:
        """Wake every connection thread: their reads and writes fail and they end."""
        with self._live_lock:
            live = list(self._live)
        for sock in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Server6(_BoundedServer):
    address_family = socket.AF_INET6


# -- the side port --------------------------------------------------------------------------------


class SidePort:
    """The side port's listening sockets, and the kept-alive connections between two stages, held
    by a node under the leader lease for its whole life: each role change serves the port from
    another stage's :class:`SideHttp`, and the port must neither close (a connect in between would
    be refused) nor drop its connections (a request sent on one would be cut off). A connect while
    no stage serves waits in the listen backlog, a request on a kept connection in its socket,
    until the next stage serves them."""

    def __init__(self, config: HttpConfig) -> None:
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self._listeners = [_listen(family, config.host, config.port)]
        if config.admin_port >= 0:
            try:
                self._listeners.append(_listen(family, config.host, config.admin_port))
            except BaseException:
                self._listeners[0].close()
                raise
        self._waiting: list[tuple[socket.socket, Any, bool]] = []
        self._lock = threading.Lock()

    def listener(self, admin: bool) -> socket.socket:
        return self._listeners[1 if admin else 0]

    def keep(self, sock: socket.socket, peer: Any, admin: bool) -> None:
        with self._lock:
            self._waiting.append((sock, peer, admin))

    def take(self) -> list[tuple[socket.socket, Any, bool]]:
        """The connections waiting for a stage (each given to one stage only)."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        return waiting

    def close(self) -> None:
        for sock, _, _ in self.take():
            sock.close()
        for listener in self._listeners:
            listener.close()


def _listen(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds
        sock.bind((host, port))
        sock.listen(_BoundedServer.request_queue_size)
    except BaseException:
        sock.close()
        raise
    return sock


class _NoFollow(Endpoints):
    """Endpoints that never follow: a SERVER_NOT_LEADER is the call's answer (Tair's calls, which
    :meth:`SideHttp.tair_call` sends on to the leader only when it answers)."""

    def follow(self, exc: KvcmError, follows: int) -> float:
        raise exc


class _ClientPool:
    """RPC clients for handler threads: a client is used by one thread at a time, and connection
    threads come and go, so clients are pooled rather than kept per thread.
    ``follow=False``: SERVER_NOT_LEADER is not followed (:class:`_NoFollow`)."""

    def __init__(self, endpoint: str, options: dict[str, Any] | None = None, follow: bool = True) -> None:
        self._endpoint = endpoint
        self._options = options or {}  # more Client arguments (CURVE keys)
        self._follow = follow
        self._idle: list[Client] = []
        self._lock = threading.Lock()

    def call(self, method: str, params: dict[str, Any], timeout: float | None = None) -> Any:
        with self._lock:
            client = self._idle.pop() if self._idle else None
        if client is None:
            client = Client(self._endpoint, timeout=_RPC_TIMEOUT_S, retries=0, routing_id_prefix=wire.RELAY_ID_PREFIX,
                            **self._options)
            if not self._follow:
                client.endpoints = _NoFollow(self._endpoint)
        try:
            return client.call(method, params, timeout=timeout, retry=False)
        finally:
            with self._lock:
                self._idle.append(client)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()


def refuse_unguarded(config: Config) -> None:
    """StartRefused when the side port would undo a CURVE allow-list: it forwards ``/api`` with
    the server's own key, which the allow-list admits, so with auth off every process that can
    reach the port could call every method, admin ones included, with no key of its own."""
    if (config.http.enabled and config.server.curve_allowed_clients_dir and not config.auth.enabled
            and not config.http.allow_unauthenticated_with_curve):
        raise StartRefused(
            "the HTTP side port would let any process past server.curve_allowed_clients_dir (it calls the "
            "RPC port with the server's own key) while auth is off: set auth.enabled = true, or "
            "http.enabled = false, or http.allow_unauthenticated_with_curve = true to serve it anyway")


class SideHttp:
    """Serves the side port on its own threads. ``live()``/``ready()`` are probes of the app.

    ``auth_required`` (``auth.enabled``): ``/metrics`` and ``/api`` then need credentials, an
    ``Authorization: Bearer`` token (``/api`` also takes ``auth`` in a body of at most
    ``http.max_unauthenticated_body_bytes``)."""

    def __init__(
        self,
        config: HttpConfig,
        metrics: Metrics,
        rpc_endpoint: str,
        live: Callable[[], bool],
        ready: Callable[[], bool],
        *,
        max_body: int = 4 << 20,
        auth_required: bool = False,
        client_options: dict[str, Any] | None = None,
        role: Callable[[], str] | None = None,
        port: SidePort | None = None,
    ) -> None:
        """``client_options``: more ``Client`` arguments for forwarding /api (CURVE keys).
        ``role``: the node's role under the leader lease (``leader``/``follower``), shown by
        ``/readyz``; None without the lease. ``port``: the listeners (and kept connections) of a
        node under the lease, served by this stage and left to the next one (:meth:`hand_over`);
        None binds ``config``'s own."""
        self.config = config
        self.metrics = metrics
        self.rpc_endpoint = rpc_endpoint
        self.live = live
        self.ready = ready
        self.role = role
        self.max_body = max_body
        self.auth_required = auth_required
        self._pool = _ClientPool(rpc_endpoint, client_options)
        self._tair_pool = _ClientPool(rpc_endpoint, client_options, follow=False)
        self._leader_pools: dict[str, _ClientPool] = {}  # Tair calls a follower sends on, by leader
        self._tair_roots = tair.CallerRoots()  # storage directories for Tair's URIs, across calls
        self._leaders: dict[str, tuple[dict[str, Any] | None, float]] = {}  # endpoint -> (info, until)
        self._leaders_lock = threading.Lock()
        self._client_options = client_options or {}
        self._tokens: dict[bytes, tuple[bool, float]] = {}  # sha256(token) -> (valid, until when)
        self._tokens_lock = threading.Lock()
        self._held = port
        kind = _Server6 if ":" in config.host else _BoundedServer
        self.suspects = Suspects(config.suspect_after_failures)
        self._httpd = kind((config.host, config.port), _handler_for(self), self._new_slots(), self.refused,
                           None if port is None else (port, False), self.suspects, config.suspect_connections_per_s)
        self.port = int(self._httpd.server_address[1])
        self.authorities = Authorities(config.host, self.port, config.allowed_hosts)
        self._thread = self._serving(self._httpd, "kvcm-http")
        self._admin = self._bind_admin(kind) if config.admin_port >= 0 else None
        self.admin_port = int(self._admin.server_address[1]) if self._admin is not None else None
        self.admin_authorities = Authorities(config.host, self.admin_port or 0, config.allowed_hosts)
        self._admin_thread = None if self._admin is None else self._serving(self._admin, "kvcm-http-admin")
        self._handed_over = False

    def _new_slots(self) -> Slots:
        return Slots(self.config.max_connections, self.config.max_connections_per_peer)

    def _serving(self, httpd: _BoundedServer, name: str) -> threading.Thread:
        # A held port's accept loop looks for a hand-over often: a role change waits for it.
        # An own port's loop wakes less often; a stop waits for its next wake-up.
        poll = _HELD_POLL_S if self._held is not None else _OWN_POLL_S
        return threading.Thread(target=httpd.serve_forever, args=(poll,), name=name, daemon=True)

    def _bind_admin(self, kind: type[_BoundedServer]) -> _BoundedServer:
        """Tair's port layout: its AdminService on a port of its own (``http.admin_port``)."""
        try:
            return kind((self.config.host, self.config.admin_port), _handler_for(self, admin=True),
                        self._new_slots(), self.refused,
                        None if self._held is None else (self._held, True), self.suspects,
                        self.config.suspect_connections_per_s)
        except OSError as exc:
            self._httpd.server_close()
            raise StartRefused(f"cannot bind the admin HTTP port {self.config.host}:{self.config.admin_port} "
                               f"({exc.strerror or exc}); change http.admin_port") from None

    def _servers(self) -> list[tuple[_BoundedServer, threading.Thread]]:
        return [(h, t) for h, t in ((self._httpd, self._thread), (self._admin, self._admin_thread))
                if h is not None and t is not None]

    def start(self) -> None:
        if self._handed_over:  # the role changed before this stage served: the next one serves
            return
        self._thread.start()
        if self._admin_thread is not None:
            self._admin_thread.start()
        if self._held is not None:  # the connections the last stage kept alive
            for sock, peer, admin in self._held.take():
                target = self._admin if admin else self._httpd
                if target is None:
                    sock.close()
                else:
                    target.adopt(sock, peer)

    def hand_over(self, timeout: float = _HAND_OVER_S) -> None:
        """A held port at a role change: stop accepting (connects wait in the backlog for the next
        stage), let the requests in flight be answered (up to ``timeout``: the stage still serves
        them), and leave every kept-alive connection to the next stage instead of closing it.
        Idempotent; a no-op without a held port."""
        if self._held is None or self._handed_over:
            return
        self._handed_over = True
        for httpd, thread in self._servers():
            if thread.is_alive():
                httpd.shutdown()
            httpd.begin_hand_over()
        deadline = time.monotonic() + timeout
        while any(h.live_count() for h, _ in self._servers()) and time.monotonic() < deadline:
            time.sleep(0.005)

    def stop(self) -> None:
        """A held port is handed over first (its listeners stay open for the next stage); what is
        still in flight past the hand-over's bound is cut off, as every connection of an own port."""
        self.hand_over()
        for httpd, thread in self._servers():
            if thread.is_alive():
                httpd.shutdown()
            httpd.close_connections()
            httpd.server_close()
        self._pool.close()
        self._tair_pool.close()
        with self._leaders_lock:
            pools, self._leader_pools = list(self._leader_pools.values()), {}
        for pool in pools:
            pool.close()

    def tair(self, name: str, params: dict[str, Any], admin: bool, local_ip: str) -> tuple[int, dict[str, Any]]:
        """A Tair RPC (``POST /api/<lowerCamelName>``) through :mod:`kvcm.tair`."""
        surface = "admin" if admin else "meta" if self.admin_port is not None else "both"
        ctx = tair.Context(http_port=self.port, admin_port=self.admin_port, local_host=local_ip, ask=self._ask,
                          roots=self._tair_roots)
        return tair.serve(name, params, surface, ctx, self.tair_call)

    def tair_call(self, method: str, params: dict[str, Any]) -> Any:
        """A translated Tair call: to this node, and from a follower on to the leader it names only
        if that leader answers now. Otherwise its SERVER_NOT_LEADER is the answer at once, naming
        the leader, rather than a wait of the RPC timeout on a dead or stopped one: Tair's client
        rediscovers on it and retries. Every call starts here, so a follower answers reads itself.
        A forwarded call waits ``_FORWARD_TIMEOUT_S`` at most (:meth:`_unanswered`): the leader may
        have stopped since the verdict that it answers."""
        try:
            return self._tair_pool.call(method, params)
        except KvcmError as exc:
            leader = str(exc.detail.get("leader_endpoint") or "")
            if exc.code is not Code.SERVER_NOT_LEADER or not leader or leader == self.rpc_endpoint:
                raise
            if not self._leader_answers(leader):
                stale = Unavailable(f"{exc.message}, which does not answer now; retry", Code.SERVER_NOT_LEADER)
                stale.detail = dict(exc.detail)
                raise stale from None
            refusal = exc
        try:  # a deposed leader's refusal is the answer
            return self._leader_pool(leader).call(method, params, timeout=_FORWARD_TIMEOUT_S)
        except KvcmError as failed:
            if failed.code is not Code.TIMEOUT:
                raise
            raise self._unanswered(method, leader, refusal) from None

    def _unanswered(self, method: str, leader: str, refusal: KvcmError) -> KvcmError:
        """The leader did not answer a forwarded call in time (stopped or dead since it last
        answered): it is taken as not answering for the verdict's time, so the next call is
        refused at once. This one is SERVER_NOT_LEADER, so Tair's client rediscovers and resends
        it, when a resend cannot change the outcome (an idempotent method); any other may have
        run there and is TIMEOUT, never resent behind the caller's back (kvcm's client rule)."""
        with self._leaders_lock:
            self._leaders[leader] = (None, time.monotonic() + _LEADER_VERDICT_S)
        late = f"{refusal.message}, which did not answer {method} within {_FORWARD_TIMEOUT_S:g}s"
        if method not in IDEMPOTENT_METHODS:
            return Unavailable(f"{late}: it may have run there; not resent", Code.TIMEOUT)
        stale = Unavailable(f"{late}; retry", Code.SERVER_NOT_LEADER)
        stale.detail = dict(refusal.detail)
        return stale

    def _leader_pool(self, endpoint: str) -> _ClientPool:
        stale: list[_ClientPool] = []
        with self._leaders_lock:
            pool = self._leader_pools.get(endpoint)
            if pool is None:
                if len(self._leader_pools) >= 4:
                    stale, self._leader_pools = list(self._leader_pools.values()), {}
                pool = self._leader_pools[endpoint] = _ClientPool(endpoint, self._client_options, follow=False)
        for old in stale:  # leaders of past terms: idle clients closed, a busy one is dropped with its pool
            old.close()
        return pool

    def _ask(self, endpoint: str) -> dict[str, Any] | None:
        """``get_manager_cluster_info`` of another node (the leader), or None if it does not
        answer within ``_ASK_TIMEOUT_S``; either answer is remembered ``_LEADER_VERDICT_S``."""
        now = time.monotonic()
        with self._leaders_lock:
            known = self._leaders.get(endpoint)
        if known is not None and known[1] > now:
            return known[0]
        info: dict[str, Any] | None = None
        try:
            with Client(endpoint, timeout=_ASK_TIMEOUT_S, retries=0, **self._client_options) as client:
                info = client.call("get_manager_cluster_info", {}, retry=False)
        except KvcmError:
            pass
        with self._leaders_lock:
            if len(self._leaders) >= 64:
                self._leaders.clear()
            self._leaders[endpoint] = (info, time.monotonic() + _LEADER_VERDICT_S)
        return info

    def _leader_answers(self, endpoint: str) -> bool:
        """The node at ``endpoint`` answers now and says it leads."""
        info = self._ask(endpoint)
        return info is not None and bool(info.get("leader"))

    def call(self, method: str, params: dict[str, Any]) -> Any:
        return self._pool.call(method, params)

    def refused(self, reason: str) -> None:
        self.metrics.http_refused.labels(reason).inc()

    def check_token(self, token: str, client: str = "") -> None:
        """Raise unless ``token`` is valid: asks RPC ``whoami`` (as ``client``, the remote address,
        for the login limits); the answer is remembered under the token's digest, a yes for
        :data:`_TOKEN_CACHE_S`, a no for :data:`_BAD_TOKEN_CACHE_S` (the token itself is never kept
        or logged)."""
        digest = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        with self._tokens_lock:
            valid, until = self._tokens.get(digest, (False, 0.0))
        if until > now:
            if valid:
                return
            raise AccessDenied("invalid token", Code.UNAUTHENTICATED)
        try:
            self.call("whoami", {"auth": {"token": token, "client": client}})
        except AccessDenied as exc:
            if exc.code is Code.UNAUTHENTICATED:
                self._remember(digest, False, now + _BAD_TOKEN_CACHE_S)
            raise
        self._remember(digest, True, now + _TOKEN_CACHE_S)

    def _remember(self, digest: bytes, valid: bool, until: float) -> None:
        with self._tokens_lock:
            if len(self._tokens) >= _MAX_CACHED_TOKENS:
                self._tokens.clear()
            self._tokens[digest] = (valid, until)


def _handler_for(side: SideHttp, admin: bool = False) -> type[BaseHTTPRequestHandler]:
    """``admin``: the handler of the admin port, which serves Tair's AdminService RPCs only."""
    read_timeout = side.config.read_timeout_s
    idle_timeout = side.config.idle_timeout_s

    class Handler(BaseHTTPRequestHandler):
        server_version = "kvcm"
        protocol_version = "HTTP/1.1"  # keep-alive for clients that want it

        def setup(self) -> None:
            self.connection = self.request
            # A reply is two writes (headers, body): with Nagle on, the body waits for the
            # client's delayed ACK of the headers, 40 ms on Linux, on every kept-alive request.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server = self.server if isinstance(self.server, _BoundedServer) else None
            self._probe_only = server is not None and server.probe_only(self.request)
            self._reader = _DeadlineReader(self.connection)
            self._reader.deadline = time.monotonic() + (min(read_timeout, _PROBE_READ_S) if self._probe_only
                                                        else read_timeout)
            self._buffered = io.BufferedReader(self._reader)
            self.rfile = self._buffered
            self.wfile = _SocketWriter(self.connection, read_timeout)
            # A request was answered: the next one may be idle first (so was one on a connection
            # the last stage handed over).
            self._served = server is not None and self.request in server.adopted
            self._linger = False  # a refusal left request bytes unread

        def log_message(self, fmt: str, *args: Any) -> None:
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
                side.refused("timeout")  # an incomplete request is dropped: nothing ran
                self.close_connection = True

        def _next_request_arrived(self) -> bool:
            """Keep-alive: wait up to the idle timeout for the next request's first byte; its
            deadline then runs from there."""
            self._reader.deadline = time.monotonic() + idle_timeout
            if not self._pipelined() and not self._wait_readable():
                return False
            try:
                arrived = bool(self._buffered.peek(1))
            except (TimeoutError, OSError):
                return False
            self._reader.deadline = time.monotonic() + read_timeout
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
            server: _BoundedServer = self.server  # type: ignore[assignment]
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
            return side.admin_authorities if admin else side.authorities

        def _get(self) -> None:
            path = self._path()
            if admin and not path.startswith("/api/"):
                raise Refused(404, "path", error(Code.NOT_FOUND, "no such path (the admin port serves /api only)"))
            if path == "/metrics":
                if side.auth_required:
                    self._check_bearer()
                self._send(200, side.metrics.exposition(), "text/plain; version=0.0.4")
            elif path == "/livez":
                self._probe(side.live())
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
                raise _unauthenticated("credentials required: Authorization: Bearer <token>")
            self._verify(token)

        def _verify(self, token: str) -> None:
            try:
                side.check_token(token, self._client())
            except AccessDenied as exc:
                if exc.code is Code.UNAUTHENTICATED:
                    raise _unauthenticated("invalid token") from None
                raise Refused(403, "permission", exc) from None
            except KvcmError as exc:
                raise Refused(http_status(exc.code), "auth_check", exc) from None

        def _bearer(self) -> str | None:
            values = self.headers.get_all("Authorization") or []
            if not values:
                return None
            match = _BEARER.fullmatch(values[0].strip()) if len(values) == 1 else None
            if match is None:
                raise _unauthenticated("Authorization must be one 'Bearer <token>' header")
            return match.group(1)

        def _client(self) -> str:
            return str(self.client_address[0])[:64]

        def _post(self) -> None:
            path = self._path()
            name = path[len("/api/"):]
            is_tair = path.startswith("/api/") and tair.TAIR_NAME.fullmatch(name) is not None
            if not is_tair and (admin or not path.startswith("/api/") or not _METHOD_NAME.fullmatch(name)):
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
            if not side.auth_required:
                return None
            token = self._bearer()
            if token is not None:
                self._verify(token)
                return token
            cap = side.config.max_unauthenticated_body_bytes
            if length > cap:
                raise _unauthenticated(f"credentials required: a body over {cap} bytes is read only with "
                                       "Authorization: Bearer <token> (http.max_unauthenticated_body_bytes)")
            return None

        def _credentials(self, params: dict[str, Any], bearer: str | None) -> None:
            """The call's ``auth``: the body's own, else the bearer token (Refused without either)."""
            if side.auth_required and "auth" not in params:
                if bearer is None:
                    raise _unauthenticated('credentials required: Authorization: Bearer <token>, or "auth" in the body')
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
                side.refused("body")
                self.close_connection = self._linger = True
                self._json(400, {})
                return
            except InvalidArgument as exc:  # JSON, but not what a request may hold: Tair's answer
                side.refused("body")
                self._json(200, tair.refused(exc, {}))
                return
            try:
                self._credentials(params, bearer)
            except Refused as refusal:
                self._tair_refused(refusal, params)
                return
            self._json(*side.tair(name, params, admin, self._local_ip()))

        def _count_refusal(self, refusal: Refused) -> None:
            # the client's own fault (credentials, Host, Origin, framing...), not the server's
            # capacity: a client that behaves is not refused ten times a second
            if refusal.status < 500:
                side.suspects.failed(self._client())

        def _tair_refused(self, refusal: Refused, params: dict[str, Any]) -> None:
            side.refused(refusal.reason)
            self._count_refusal(refusal)
            self._json(200, tair.refused(refusal.error, params), refusal.headers)

        def _forward(self, name: str, params: dict[str, Any]) -> None:
            try:
                self._json(200, {"result": side.call(name, params)})
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

        def _read_json(self, length: int) -> dict[str, Any]:
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
            if len(text) > 19 or int(text) > side.max_body:
                raise Refused(413, "too_large", InvalidArgument(
                    f"body larger than {side.max_body} bytes (server.max_message_bytes)", Code.MESSAGE_TOO_LARGE))
            return int(text)

        # -- replies ----------------------------------------------------------------------------

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The parser's own errors (bad request line, header limits): a fixed JSON body that
            echoes nothing of the request."""
            phrase = self.responses.get(code, ("error", ""))[0]
            self._refuse(Refused(code, "malformed", error(Code.INVALID_ARGUMENT, f"bad request: {phrase}")))

        def _refuse(self, refusal: Refused) -> None:
            side.refused(refusal.reason)
            self._count_refusal(refusal)
            self.close_connection = True
            self._linger = True
            self._json(refusal.status, {"error": refusal.error.to_wire()}, refusal.headers)

        def _ready_probe(self) -> None:
            """Under the lease only the leader is ready (a follower refuses every write); the body
            and ``X-Kvcm-Role`` name the role either way."""
            if side.role is None:
                self._probe(side.ready())
                return
            role = side.role()
            ok = side.ready() and role == "leader"
            self._send(200 if ok else 503, (b"ok\n" if ok else b"not ok\n") + f"role: {role}\n".encode(),
                       "text/plain", [("X-Kvcm-Role", role)])

        def _probe(self, ok: bool) -> None:
            self._send(200 if ok else 503, b"ok\n" if ok else b"not ok\n", "text/plain")

        def _json(self, status: int, body: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
            self._send(status, json.dumps(body, default=_jsonable).encode(), "application/json", headers)

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

    return Handler


# -- request bodies -------------------------------------------------------------------------------

_MAX_DEPTH = 32
_INT_MIN, _INT_END = -(1 << 63), 1 << 64  # what msgpack, and so the RPC front door, can carry
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # a member name an error message shows as it is
_MAX_PATH = 200


class NotJson(InvalidArgument):
    """A body that is not a JSON object at all (Tair's server answers it 400 and ``{}``)."""


class _DuplicateKey(Exception):
    """Raised out of the parser at an object with a key twice (its path is found afterwards)."""


class _Members(list[tuple[str, Any]]):
    """An object's members in order, a repeated key kept: only to name where it repeats."""


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body: a JSON object whose keys are unique in every object (the last of two would
    win silently), nested at most 32 levels, with integers in int64/uint64 and only finite
    numbers (Python's parser takes NaN, Infinity and 1e400). Every refusal is INVALID_ARGUMENT
    naming the path of what it refuses; :class:`NotJson` when the body is no JSON object at all."""
    try:
        body = json.loads(raw or b"{}", object_pairs_hook=_unique)
    except _DuplicateKey:
        raise InvalidArgument(f"{_repeated_key(raw)}: given twice in one JSON object") from None
    except (ValueError, RecursionError) as exc:
        raise NotJson(f"body is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise NotJson("body must be a JSON object")
    if not _plain(body):
        raise InvalidArgument(_fault(body))
    return body


def _unique(members: list[tuple[str, Any]]) -> dict[str, Any]:
    # The parser's hook for every object: building the dict here costs ~20% of the parse, and a
    # length check finds a repeated key.
    obj = dict(members)
    if len(obj) != len(members):
        raise _DuplicateKey
    return obj


def _plain(body: dict[str, Any]) -> bool:
    """True when nothing in ``body`` is refused; :func:`_fault` says where, when it is not. A pass
    over whole levels checking exact types: the hot path, several times faster than walking values
    one by one with their depth (a 52,000-event report is a few hundred thousand values)."""
    level: list[Any] = [body]
    for _ in range(_MAX_DEPTH - 1):  # the values of containers at depths 1..31 (depths 2..32)
        nested: list[Any] = []
        for container in level:
            for value in container.values() if type(container) is dict else container:
                kind = type(value)
                if kind is str:
                    continue
                if kind is dict or kind is list:
                    nested.append(value)
                elif kind is int:
                    if not _INT_MIN <= value < _INT_END:
                        return False
                elif kind is float and not math.isfinite(value):
                    return False
        if not nested:
            return True
        level = nested
    return not any(level)  # a value inside a container at depth 32 would be at depth 33


def _fault(body: dict[str, Any]) -> str:
    """The first refused value of ``body`` in document order, named by its path (the slow walk,
    run only once :func:`_plain` has found something)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        at = where[:_MAX_PATH] or "body"
        if depth > _MAX_DEPTH:
            return f"{at}: nests deeper than {_MAX_DEPTH} levels"
        if type(value) is int and not _INT_MIN <= value < _INT_END:
            return f"{at}: integer {str(value)[:40]} does not fit in 64 bits"
        if type(value) is float and not math.isfinite(value):
            return f"{at}: {value} is not a finite number"
        if type(value) is dict:
            stack.extend((v, _member(where, k), depth + 1) for k, v in reversed(value.items()))
        elif type(value) is list:
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in reversed(list(enumerate(value))))
    return "body: refused"


def _repeated_key(raw: bytes) -> str:
    """The path of the first key that repeats within one object (parsed again keeping every member)."""
    stack: list[tuple[Any, str]] = [(json.loads(raw, object_pairs_hook=_Members), "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, _Members):
            seen: set[str] = set()
            for key, _ in value:
                if key in seen:
                    return _member(where, key)[:_MAX_PATH]
                seen.add(key)
            stack.extend((v, _member(where, k)) for k, v in reversed(value))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(value))))
    return "body"


def _member(where: str, key: str) -> str:
    """``where.key``; a key that is not a plain name is not echoed (the reply is no place for it)."""
    name = key if _KEY.fullmatch(key) else "<key>"
    return f"{where}.{name}" if where else name


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot encode {type(value).__name__}")

"""What the side port decides before it reads a body: the HTTP status of each kvcm error code,
the ``Host``/``Origin`` checks that keep browsers and DNS rebinding out (:class:`Authorities`),
connection slots per remote address (:class:`Slots`), and the addresses that keep failing
(:class:`Suspects`), whose connections wait in a slow lane (:class:`SlowLane`)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable

from kvcm.errors import AccessDenied, Code, KvcmError

log = logging.getLogger("kvcm.http")
_DIGITS = re.compile(r"[0-9]{1,19}")
_HOST_NAME = re.compile(r"[a-z0-9_.-]{1,253}|\[[0-9a-f:.]{2,45}\]")
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


def unauthenticated(message: str) -> Refused:
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

    def __init__(self, rate: float, serve: Callable[[socket.socket, object], None],
                 turn_away: Callable[[socket.socket], None]) -> None:
        self._gap = 1.0 / rate
        self._serve = serve
        self._turn_away = turn_away
        self._queue: queue.Queue[tuple[socket.socket, object] | None] = queue.Queue(_LANE_DEPTH)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def offer(self, request: socket.socket, client_address: object) -> bool:
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


def peer_of(client_address: object) -> str:
    """The remote address a connection's slots are counted under (no port: one host is one peer)."""
    if isinstance(client_address, tuple) and client_address:
        return str(client_address[0])
    return str(client_address)

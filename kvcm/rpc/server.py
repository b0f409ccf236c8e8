"""The RPC front door: one ZMQ ROUTER socket driven by a ``zmq.Poller`` loop.

The server knows frames and bytes only. It is handed a handler (the dispatcher's
``serve(arrivals) -> replies`` and ``wait_ms()``, or a plain ``handle_batch(payloads, senders)``)
and timers; it never imports the manager, the index or a store.

Per wake-up it drains every ready message (up to ``drain_max``) and hands them over as one turn,
so the dispatcher can commit all their writes at once; then it sends the replies that are ready
and runs the timers that are due. The dispatcher may carry a request over to later turns (a long
prompt being hashed, heavy work past the turn's budget, a password being checked elsewhere): its
reply is sent in the turn it finishes, and while work is carried the loop does not sleep in poll. Envelopes: ``[identity, payload]`` from DEALER clients and
``[identity, b"", payload]`` from REQ clients, answered in kind. Nothing a peer sends can raise
out of the loop: malformed frames are answered with an error when a reply is possible, else
dropped and counted. ``ROUTER_MANDATORY`` plus ``NOBLOCK`` make replies to vanished or stalled
peers fail fast (counted) instead of vanishing silently or blocking the loop.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import zmq

from kvcm.errors import Code, ServerError, error
from kvcm.metrics import Metrics
from kvcm.proto import wire

log = logging.getLogger("kvcm.rpc.server")

#: ``handle_batch(payloads, senders) -> replies``: one reply (or None) per payload, all in one turn.
BatchHandler = Callable[[Sequence[bytes], Sequence[bytes]], list[bytes | None]]


@runtime_checkable
class TurnHandler(Protocol):
    """What the dispatcher offers the loop: requests may finish in a later turn than they came."""

    def serve(self, arrivals: Sequence[tuple[Any, bytes, bytes]]) -> list[tuple[Any, bytes | None]]:
        """``(tag, sender, payload)`` in; ``(tag, reply or None)`` of every request finished."""
        ...

    def wait_ms(self) -> int | None:
        """0: work is carried and runnable now; N: look again within N ms; None: nothing carried."""
        ...


class _WholeBatches:
    """A :data:`BatchHandler` seen as a :class:`TurnHandler` (every request ends in its turn)."""

    def __init__(self, handle_batch: BatchHandler) -> None:
        self._handle_batch = handle_batch

    def serve(self, arrivals: Sequence[tuple[Any, bytes, bytes]]) -> list[tuple[Any, bytes | None]]:
        replies = self._handle_batch([a[2] for a in arrivals], [a[1] for a in arrivals])
        if len(replies) != len(arrivals):
            raise RuntimeError(f"handler returned {len(replies)} replies for {len(arrivals)} requests")
        return [(a[0], reply) for a, reply in zip(arrivals, replies)]

    def wait_ms(self) -> int | None:
        return None


@dataclass
class Timer:
    """A callable run on the RPC thread every ``interval`` seconds, between polls."""

    name: str
    interval: float
    fn: Callable[[], object]
    due: float = field(default=0.0)


class Server:
    """Owns the ROUTER socket; only the thread running :meth:`serve` touches it."""

    def __init__(
        self,
        endpoint: str,
        handler: BatchHandler | TurnHandler,
        metrics: Metrics | None = None,
        timers: Sequence[Timer] = (),
        max_message_bytes: int = 4 << 20,
        drain_max: int = 256,
        poll_ms: int = 100,
        sndhwm: int = 10000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        socket_setup: Callable[[zmq.Socket[bytes]], None] | None = None,
        drain_grace_s: float = 5.0,
    ) -> None:
        """``socket_setup`` runs on the ROUTER socket before it binds (CURVE keys, for one)."""
        self._socket_setup = socket_setup
        self._handler: TurnHandler = handler if isinstance(handler, TurnHandler) else _WholeBatches(handler)
        self.metrics = metrics or Metrics()
        self._timers = list(timers)
        # The earliest ``due`` of the timers, kept by _run_timers: every loop turn asks for it,
        # and rescanning the timers each time cost more than the rest of an idle turn.
        self._next_due = min((t.due for t in self._timers), default=float("inf"))
        self._max_bytes = max_message_bytes
        self._drain_max = drain_max
        self._poll_ms = poll_ms
        self._drain_grace_s = drain_grace_s
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._closed = threading.Event()
        self.heartbeat = time.monotonic()
        self.draining = False
        self._socket = self._bind(endpoint, sndhwm)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_file = _ipc_identity(self.endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)

    def _bind(self, endpoint: str, sndhwm: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, sndhwm)
        # A hard cap far above the per-request limit: an attacker's 1 GiB frame is cut off in
        # libzmq (peer disconnected), while merely oversize requests still get a typed reply.
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes * 4 + 4096)
        try:
            # ZeroMQ binds an ipc:// path by replacing the file, silently taking the address
            # from a live server; refuse that like a taken TCP port.
            if endpoint.startswith("ipc://") and endpoint_in_use(endpoint):
                raise zmq.ZMQError(errno.EADDRINUSE)
            if self._socket_setup is not None:
                self._socket_setup(sock)
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(f"{endpoint} is already in use by another process", Code.SERVICE_NOT_READY) from None
            raise error(Code.SERVICE_NOT_READY, f"cannot bind {endpoint}: {exc}") from None
        return sock

    # -- loop ---------------------------------------------------------------------------------

    def serve(self) -> None:
        """Run until :meth:`stop`; then answer what is already queued and close the socket."""
        poller = self._poller
        self.metrics.up.set(1)
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                carried = self._handler.wait_ms()
                if poller.poll(self._next_timeout(carried)) or carried == 0:
                    self._serve_ready()
                elif carried is not None:
                    self._turn([])  # carried work whose wait is up (e.g. a verdict came back)
                self._run_timers()
            self.draining = True
            self._serve_ready()  # in-flight requests already received get their answers
            self._finish_carried()
        finally:
            self.metrics.up.set(0)
            self._socket.close(linger=1000)
            _unlink_ipc(self._ipc_file)
            self._closed.set()

    def _serve_ready(self) -> None:
        """Drain ready messages into one turn; reply to each request that finished."""
        arrivals: list[tuple[Any, bytes, bytes]] = []
        self._drain(arrivals)
        self._turn(arrivals)

    def _turn(self, arrivals: list[tuple[Any, bytes, bytes]]) -> None:
        for head, reply in self._safe_serve(arrivals):
            if reply is not None:
                # the loop moves: a liveness probe right after this reply must see it alive
                self.heartbeat = time.monotonic()
                self._send(head, reply)

    def _finish_carried(self) -> None:
        """On the way out: let carried requests finish (bounded), so each gets its answer."""
        deadline = time.monotonic() + self._drain_grace_s
        while (wait := self._handler.wait_ms()) is not None and time.monotonic() < deadline:
            if wait:
                time.sleep(wait / 1000.0)
            self._turn([])

    def _drain(self, arrivals: list[tuple[Any, bytes, bytes]]) -> None:
        sock, poll = self._socket, self._poller.poll
        for _ in range(self._drain_max):
            try:
                # A ROUTER prepends the sender's identity to every message, so the first frame
                # always has more; asking (a getsockopt, about 1.5 us) starts after the second.
                frames = [sock.recv(zmq.NOBLOCK), sock.recv(zmq.NOBLOCK)]
                while sock.getsockopt(zmq.RCVMORE):  # recv_multipart's loop, minus its wrapper
                    frames.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            except zmq.ZMQError as exc:  # pragma: no cover - socket-level trouble, keep serving
                log.warning("recv failed: %s", exc)
                break
            self._accept(frames, arrivals)
            # Look before the next recv: a zero-timeout poll costs about 1.5 us, the zmq.Again
            # a recv raises on an empty queue about 11 us (a third of a small request).
            if not poll(0):
                break

    def _accept(self, frames: list[bytes], arrivals: list[tuple[Any, bytes, bytes]]) -> None:
        envelope = _split(frames)
        if envelope is None:
            self.metrics.bad_messages.labels("frames").inc()
            return
        head, payload = envelope
        if len(payload) > self._max_bytes:
            self.metrics.bad_messages.labels("too_large").inc()
            too_large = error(Code.MESSAGE_TOO_LARGE, f"message of {len(payload)} bytes exceeds {self._max_bytes}")
            self._send(head, wire.pack_response(wire.peek_msgid(payload), too_large.to_wire(), None))
            return
        arrivals.append((head, head[0], payload))

    def _safe_serve(self, arrivals: list[tuple[Any, bytes, bytes]]) -> list[tuple[Any, bytes | None]]:
        try:
            return self._handler.serve(arrivals)
        except Exception:
            log.exception("request handler failed")
        failure = ServerError("internal error").to_wire()
        return [(head, wire.pack_response(wire.peek_msgid(p), failure, None)) for head, _, p in arrivals]

    def _send(self, head: list[bytes], reply: bytes) -> None:
        try:
            # send_multipart's frames, minus its per-call checks (a reply is a few frames of
            # bytes); a multipart message is queued whole or not at all, so only the first
            # frame can meet the high-water mark or an unknown peer.
            sock = self._socket
            for frame in head:
                sock.send(frame, zmq.NOBLOCK | zmq.SNDMORE)
            sock.send(reply, zmq.NOBLOCK)
        except zmq.Again:
            self.metrics.replies_dropped.labels("hwm").inc()
        except zmq.ZMQError as exc:
            reason = "gone" if exc.errno == zmq.EHOSTUNREACH else "error"
            self.metrics.replies_dropped.labels(reason).inc()

    # -- timers -------------------------------------------------------------------------------

    def _next_timeout(self, carried: int | None = None) -> int:
        limit = self._poll_ms if carried is None else min(self._poll_ms, carried)
        if not self._timers:
            return limit
        wait = self._next_due - time.monotonic()
        return max(0, min(limit, int(wait * 1000) + 1))

    def _run_timers(self) -> None:
        now = time.monotonic()
        if now < self._next_due:
            return
        self._run_due(now)
        self._next_due = min((t.due for t in self._timers), default=float("inf"))

    def _run_due(self, now: float) -> None:
        for timer in self._timers:
            if now < timer.due:
                continue
            timer.due = now + timer.interval
            try:
                timer.fn()
            except Exception:
                log.exception("timer %s failed", timer.name)

    # -- lifecycle ----------------------------------------------------------------------------

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the loop to finish (any thread); wait up to ``timeout`` for the socket to close."""
        self._stop.set()
        return self._closed.wait(timeout) if timeout is not None else True

    def close_unserved(self) -> None:
        """Close the socket of a server whose loop never ran."""
        if not self._closed.is_set():
            self._socket.close(linger=0)
            _unlink_ipc(self._ipc_file)
            self._closed.set()


class AddressInUse(ServerError):
    """The RPC endpoint is bound by another socket (a TCP port, or a live ``ipc://`` path)."""


def endpoint_in_use(endpoint: str) -> bool:
    """Whether another socket already holds ``endpoint`` (checked without binding it for good).

    ``tcp://HOST:PORT`` (HOST a name, an address, ``[v6]`` or ``*``): a trial bind with
    SO_REUSEADDR, as ZeroMQ binds. ``ipc://PATH``: a connect, since a file without a listener
    is stale and a bind may replace it. Other forms (interface names, ``*`` ports) are False:
    the real bind reports them."""
    if endpoint.startswith("ipc://"):
        name = endpoint[len("ipc://"):]
        path = "\0" + name[1:] if name.startswith("@") else name
        if not name.startswith("@") and not os.path.exists(path):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:
                return False
            return True
    if not endpoint.startswith("tcp://"):
        return False
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    # ZeroMQ binds IPv4 unless the address is an IPv6 literal; probe the same family.
    family = socket.AF_INET6 if host.startswith("[") or host.count(":") > 1 else socket.AF_INET
    host = "0.0.0.0" if host == "*" else host.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, int(port), family, socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError):  # e.g. an interface name ZeroMQ resolves itself
        return False
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _ipc_identity(endpoint: str) -> tuple[str, int, int] | None:
    """``(path, st_dev, st_ino)`` of the socket file an ``ipc://`` bind made, else None."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):  # "@": abstract, no file
        return None
    path = endpoint[len("ipc://"):]
    try:
        st = os.stat(path)
    except OSError:
        return None
    return path, st.st_dev, st.st_ino


def _unlink_ipc(identity: tuple[str, int, int] | None) -> None:
    """Remove our socket file on stop, but only if it is still ours: another server may have
    bound the same path since (its bind replaces the file), and its socket must stay."""
    if identity is None:
        return
    path, dev, ino = identity
    try:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == (dev, ino):
            os.unlink(path)
    except OSError:
        pass  # already gone, or not ours to remove


def _split(frames: list[bytes]) -> tuple[list[bytes], bytes] | None:
    """``(reply head, payload)`` for DEALER ``[id, payload]`` or REQ ``[id, b"", payload]``."""
    if len(frames) == 2 and frames[1]:
        return frames[:1], frames[1]
    if len(frames) == 3 and frames[1] == b"" and frames[2]:
        return frames[:2], frames[2]
    return None

"""The side port's listening sockets: a threaded HTTP server bounded by connection slots, with
probe-only slots past the cap and a slow lane for suspects (:class:`BoundedServer`), and the
listeners a node under the leader lease hands from one stage to the next (:class:`SidePort`)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvcm.config import HttpConfig
from kvcm.http.guards import ANY, PROBE, Slots, SlowLane, Suspects, peer_of

log = logging.getLogger("kvcm.http")
_BUSY_BODY = b'{"error": {"code": 4, "name": "SERVICE_NOT_READY", "message": "too many connections"}}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
         b"Connection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class BoundedServer(ThreadingHTTPServer):
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

    def adopt(self, request: socket.socket, client_address: object) -> None:
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

    def process_request(self, request: Any, client_address: object) -> None:
        if self._suspects is not None and self._suspects.suspect(peer_of(client_address)):
            if self._lane.offer(request, client_address):
                self._refused("slow_lane")  # served later, at the lane's pace
            else:
                self._refused("slow_lane_full")
                self._turn_away(request)
            return
        self._start(request, client_address)

    def _start(self, request: socket.socket, client_address: object) -> None:
        """A connection's slot and thread (or 503 when no slot is left)."""
        peer = peer_of(client_address)
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

    def process_request_thread(self, request: Any, client_address: object) -> None:
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

    def handle_error(self, request: object, client_address: object) -> None:
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


class Server6(BoundedServer):
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
        self._waiting: list[tuple[socket.socket, object, bool]] = []
        self._lock = threading.Lock()

    def listener(self, admin: bool) -> socket.socket:
        return self._listeners[1 if admin else 0]

    def keep(self, sock: socket.socket, peer: object, admin: bool) -> None:
        with self._lock:
            self._waiting.append((sock, peer, admin))

    def take(self) -> list[tuple[socket.socket, object, bool]]:
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
        sock.listen(BoundedServer.request_queue_size)
    except BaseException:
        sock.close()
        raise
    return sock

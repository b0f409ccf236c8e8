"""The event subscriber: one thread, one ``zmq.Poller`` over every source's SUB, replay DEALER and
connection monitor, keeping the :class:`~kvcm.engines.index.EngineIndex` in sync.

Per source:

* frames ``[topic, seq(8B BE), payload]``; anything else is counted (``bad_frames``) and dropped;
* on the first connection, replay from 0 (or from ``last_seq + 1`` when the index was restored
  from disk); after a reconnect, from ``last_seq + 1``; on a gap (``seq > last_seq + 1``) the
  missed batches are counted and replayed from ``last_seq + 1``. Live messages are held while a
  replay runs and applied after its ``-1`` end marker, in seq order, duplicates dropped;
* replies may have 2 (``[seq, payload]``) or 3 (``[topic, seq, payload]``) frames; a first
  replayed seq above the one requested means the publisher's buffer no longer has the gap: the
  source is cleared rather than left with blocks whose removal was missed;
* publisher restart: a live seq below the last live seq on the same connection, or a seq at or
  below ``last_seq`` whose batch timestamp is newer than the last applied one (a duplicate keeps
  its old timestamp) -> clear that source and rebuild by replay from 0;
* liveness: a source is *heard* on every live message and replay answer. One silent for
  ``probe_interval_s`` is probed through its replay ROUTER: a replay from ``last_seq`` itself,
  answered by that batch and the end marker (so a probe also catches an engine that restarted in
  place and stayed silent). Not heard for ``stale_after_s`` it is ``stale`` (``stale_ids``,
  left out of matches by the service); for ``expire_after_s`` it is ``expired``: its blocks
  are dropped and counted, and it is rebuilt from 0 when heard again. A restart or a replay
  buffer that no longer reaches back is a full rebuild (blocks dropped, ``rebuilds`` counted);
  a gap accepted without replay leaves the source in state ``gap`` until its next rebuild;
* a replay that does not finish within its timeout is a failure: the DEALER is re-created (so
  stale frames cannot leak into the next replay), held messages are applied with the gap
  accepted, and further replays of that source back off 1 s -> 30 s (x2). Socket set-up failures
  back off the same way; TCP reconnects use libzmq's own backoff set to the same numbers.

Capacity: each source holds :data:`SOCKETS_PER_SOURCE` ZeroMQ sockets and about
:data:`FDS_PER_SOURCE` file descriptors. A context allows 1,023 sockets unless told otherwise,
and past that socket creation fails ("Too many open files") while the source looks registered;
so the context is sized for ``settings.max_sources`` up front, and the process's open-file limit
is raised (soft up to hard) or start-up refused when they cannot fit.

Nothing blocks: every receive is non-blocking, each socket is drained at most ``_DRAIN`` messages
per wake-up, and a silent replay endpoint only ever delays its own source.

Thread ownership: every socket and :class:`SourceConn` belongs to the thread calling :meth:`poll_once`
(the subscriber thread). Other threads use :meth:`add`/:meth:`remove`/:meth:`snapshot`, and the
read-only :meth:`freshness`/:meth:`instance_freshness`/``stale_ids``, only.

Push sources (``spec.kind == "push"``, fed by ``report_events``: :mod:`kvcm.engines.push`) have a
:class:`SourceConn` without sockets, so liveness, ``stale_ids`` and freshness treat them exactly
like ZeroMQ sources. They are added and removed at once (:meth:`add_push`, :meth:`remove`), not at
the next wake-up, because the report that registers one is answered before that. Their sequencing
fields belong to the RPC thread, which changes them, and marks them heard (:meth:`heard_push`),
holding the index lock; the subscriber thread only ages them, and expires one under the same
lock after checking it was not heard meanwhile, so an expiry never drops a report it raced with.
"""

from __future__ import annotations

import logging
import queue
import resource
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvcm.cache.keys import native_states
from kvcm.config import ConfigError
from kvcm.engines.entries import Item
from kvcm.engines.index import EngineIndex
from kvcm.engines.metrics import EventMetrics
from kvcm.engines.sources import SourceSpec, SubscriberSettings, is_ipv6
from kvcm.proto.kv_events import DecodedBatch, EventDecodeError, decode_batch
from kvcm.threads import gc_paused

log = logging.getLogger("kvcm.engines.subscriber")

END_SEQ = b"\xff" * 8
_SEQ = struct.Struct(">Q")
_DRAIN = 1000
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
SOCKETS_PER_SOURCE = 4  # SUB, replay DEALER, and the SUB's monitor (a PAIR socket at each end)
FDS_PER_SOURCE = 6  # one mailbox per socket, plus the SUB's and the DEALER's connection
_SPARE_SOCKETS = 16
_MAX_FRESH = 1024  # instances whose freshness map is cached
_FD_RESERVE = 256  # for the rest of the process: stores, the RPC port and its peers, HTTP


def size_context(ctx: zmq.Context[zmq.Socket[bytes]], max_sources: int) -> None:
    """Make room in ``ctx`` (before its first socket) and in the process for ``max_sources``
    sources; raise ConfigError naming ``events.max_sources`` when they cannot fit."""
    sockets = SOCKETS_PER_SOURCE * max_sources + _SPARE_SOCKETS
    if sockets > ctx.get(zmq.MAX_SOCKETS):
        limit = ctx.get(zmq.SOCKET_LIMIT)
        if sockets > limit:
            raise ConfigError(f"events.max_sources={max_sources} needs {sockets} ZeroMQ sockets; "
                              f"this libzmq allows at most {limit}")
        ctx.set(zmq.MAX_SOCKETS, sockets)
    ensure_open_files(FDS_PER_SOURCE * max_sources + _FD_RESERVE, max_sources)


def ensure_open_files(needed: int, max_sources: int) -> None:
    """Raise the soft RLIMIT_NOFILE up to the hard one when ``needed`` is above it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(f"events.max_sources={max_sources} needs about {needed} open files, but the "
                          f"process may open at most {hard} (hard RLIMIT_NOFILE, ulimit -Hn): lower "
                          f"events.max_sources or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    log.info("raised the open-file limit from %d to %d for events.max_sources=%d", soft, needed, max_sources)


class SourceConn:
    """Connection and sequencing state of one source (subscriber thread only; a push source's
    sequencing fields are the RPC thread's, see the module docstring)."""

    def __init__(
        self, spec: SourceSpec, generation: int, last_seq: int, last_ts: float, cfg: SubscriberSettings, now: float
    ) -> None:
        self.spec = spec
        self.generation = generation
        self.last_seq = last_seq  # last seq applied or queued for applying
        self.last_ts = last_ts
        self.last_live: int | None = None  # highest seq seen live on the current connection
        self.sub: zmq.Socket[bytes] | None = None
        self.dealer: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.connected = False
        self.ever_connected = False
        self.replay_start: int | None = None  # seq requested by the replay in flight
        self.replay_deadline = 0.0
        self.replay_first: int | None = None
        self.replay_check: tuple[int, float] | None = None
        self.replay_not_before = 0.0
        self.held: list[tuple[int, DecodedBatch | None]] = []
        self.open_at = 0.0
        self.replay_timeout = spec.replay_timeout_s or cfg.replay_timeout_s
        self.backoff_initial = spec.backoff_initial_s or cfg.backoff_initial_s
        self.backoff_max = spec.backoff_max_s or cfg.backoff_max_s
        self.backoff = self.backoff_initial
        self.replay_backoff = self.backoff_initial
        self.heard_at = now  # monotonic; a source never heard ages from when it was added
        self.heard_wall: float | None = None  # wall time of the last message, None = never heard
        self.probing = False  # the replay in flight is a liveness probe
        self.probe_at = 0.0
        self.gap = False  # a gap was accepted without replay: blocks may be stale until a rebuild
        self.expired = False
        self.stale = False
        self.stats: dict[str, Any] = {
            "connections": 0, "disconnections": 0, "missed": 0, "replays": 0, "replay_failures": 0,
            "duplicates": 0, "restarts": 0, "errors": 0, "errors_by_kind": {}, "last_event_time": None,
            "probes": 0, "probe_failures": 0, "rebuilds": 0, "expired": 0, "expired_blocks": 0,
        }  # fmt: skip

    def next_backoff(self, attr: str, factor: float) -> float:
        delay = float(getattr(self, attr))
        setattr(self, attr, min(delay * factor, self.backoff_max))
        return delay


class EventSubscriber:
    """Subscribes to every event source and applies their batches (see the module docstring)."""

    def __init__(
        self,
        index: EngineIndex,
        settings: SubscriberSettings | None = None,
        metrics: EventMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.settings = settings or SubscriberSettings()
        self.metrics = metrics or EventMetrics()
        self._clock = clock
        self._ctx = zmq.Context()
        try:
            size_context(self._ctx, self.settings.max_sources)
        except BaseException:
            self._ctx.term()
            raise
        self._conns: dict[str, SourceConn] = {}
        self._owner: dict[Any, tuple[SourceConn, str]] = {}
        self._poller = zmq.Poller()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._ops: list[tuple[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._looping = False  # the thread is in its loop (read for every push report: no is_alive())
        self._stop = threading.Event()
        self._closed = False
        #: sources not heard for ``stale_after_s`` (replaced whole, so readers need no lock)
        self.stale_ids: frozenset[str] = frozenset()
        self._fresh: dict[str, tuple[float, int, dict[str, dict[str, Any]], bytes]] = {}  # per instance
        #: bumped whenever a source starts or stops being followed: a cached freshness map made
        #: before is stale at once (a new source's blocks may be matched within ``poll_ms``)
        self._roster = 0

    # --- control (any thread) -------------------------------------------------------------------

    def add(self, spec: SourceSpec, generation: int, last_seq: int = -1, last_ts: float = 0.0) -> None:
        """Start following a source (takes effect at the next :meth:`poll_once`; a push source at once)."""
        if spec.push:  # loaded at start-up: it cannot be replayed, so it needs a snapshot
            self.add_push(spec, generation, last_seq, last_ts).gap = True
            return
        self._commands.put(lambda: self._add(spec, generation, last_seq, last_ts))

    def remove(self, source_id: str) -> None:
        conn = self._conns.get(source_id)
        if conn is not None and conn.spec.push:
            self._conns.pop(source_id, None)
            self._roster += 1
            self.metrics.remove_source(source_id)
            return
        self._commands.put(lambda: self._remove(source_id))

    def add_push(self, spec: SourceSpec, generation: int, last_seq: int = -1, last_ts: float = 0.0) -> SourceConn:
        """A push source's liveness and counters, in effect at once (no sockets: see the module docstring)."""
        conn = SourceConn(spec, generation, last_seq, last_ts, self.settings, self._clock())
        conn.connected = True  # it reaches us; "connected" means nothing more for a push source
        self._conns[spec.source_id] = conn
        self._roster += 1
        return conn

    def push_conn(self, source_id: str) -> SourceConn | None:
        conn = self._conns.get(source_id)
        return conn if conn is not None and conn.spec.push else None

    def heard_push(self, conn: SourceConn) -> None:
        """A report or heartbeat arrived (RPC thread, index lock held). A stale source is matched
        again from the very next query, not only after the subscriber's next timer pass."""
        self._heard(conn)
        if conn.spec.source_id in self.stale_ids:
            self.stale_ids = self.stale_ids - {conn.spec.source_id}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Connection facts per source, for ``list_event_sources``."""
        out = {}
        for source_id, conn in list(self._conns.items()):
            stats = dict(conn.stats)
            stats["errors_by_kind"] = dict(stats["errors_by_kind"])
            stats["connected"] = conn.connected
            stats["replaying"] = conn.replay_start is not None and not conn.probing
            stats["state"], stats["age_s"] = self._freshness(conn)
            stats["last_heard"] = conn.heard_wall
            out[source_id] = stats
        return out

    def freshness(self, source_id: str) -> tuple[str, float] | None:
        """``(state, age_s)`` of a followed source (None if not followed): state is ``live``,
        ``replaying``, ``gap``, ``stale`` or ``expired``; age is seconds since it was last heard."""
        conn = self._conns.get(source_id)
        return None if conn is None else self._freshness(conn)

    def instance_freshness(self, instance_id: str) -> tuple[dict[str, dict[str, Any]], bytes]:
        """``{source_id: {"state", "age_s"}}`` of the instance's sources, and its msgpack, for
        ``match_engines`` replies. Kept for ``poll_ms`` (a reply's ages are at most that old), as
        a router may ask thousands of times a second about an instance with a hundred sources."""
        now, roster = self._clock(), self._roster
        known = self._fresh.get(instance_id)
        if known is None or now - known[0] >= self.settings.poll_ms / 1000 or known[1] != roster:
            fresh = {}
            for source_id, conn in list(self._conns.items()):
                if conn.spec.instance_id == instance_id:
                    state, age = self._freshness(conn)
                    fresh[source_id] = {"state": state, "age_s": round(age, 2)}
            if len(self._fresh) >= _MAX_FRESH:  # instances come and go; ids are registered ones
                self._fresh = {}
            known = self._fresh[instance_id] = (now, roster, fresh, msgspec.msgpack.encode(fresh))
        return known[2], known[3]

    def _freshness(self, conn: SourceConn) -> tuple[str, float]:
        age = max(0.0, self._clock() - conn.heard_at)
        if conn.expired:
            return "expired", age
        if age >= self.settings.stale_after_s:
            return "stale", age
        if conn.replay_start is not None and not conn.probing:
            return "replaying", age
        return ("gap" if conn.gap else "live"), age

    @property
    def running(self) -> bool:
        """The subscriber thread runs (and so flushes the index at every wake-up)."""
        return self._looping and not self._stop.is_set()

    def start(self) -> None:
        """Run :meth:`poll_once` on a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="kvcm-events", daemon=True)
        self._looping = True  # cleared by the thread when its loop ends, however it ends
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.poll_once(self._poll_timeout())
                except Exception:
                    log.exception("event subscriber iteration failed")
                    self._stop.wait(0.1)
        finally:
            self._looping = False

    def _poll_timeout(self) -> float:
        """The shortest ``poll_ms`` of the settings and of any source that sets its own."""
        per_source = [c.spec.poll_ms for c in list(self._conns.values()) if c.spec.poll_ms]
        return min([self.settings.poll_ms, *per_source]) / 1000

    def stop(self, timeout: float = 5.0) -> None:
        """Idempotent: stop the thread, close every socket."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        if not self._closed:
            self._closed = True
            for conn in list(self._conns.values()):
                self._close_sockets(conn)
            self._ctx.term()

    # --- the loop body ----------------------------------------------------------------------------

    def poll_once(self, timeout: float = 0.1) -> int:
        """One wake-up: run commands and timers, poll up to ``timeout`` seconds, apply what arrived.

        Returns the number of messages handled.
        """
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                break
        self._timers(self._clock())
        handled = 0
        events = dict(self._poller.poll(int(timeout * 1000))) if self._owner else {}
        if not self._owner and timeout > 0:
            self._stop.wait(timeout)
        with gc_paused():  # decoded batches and new blocks: one collection after, not one per few batches
            for sock in events:
                owner = self._owner.get(sock)
                if owner is not None:
                    handled += self._drain(owner[0], owner[1], sock)
            self._timers(self._clock())
            self._apply_ops()
            self.index.flush()  # push sources' reports since the last wake-up (kvcm.engines.push)
        return handled

    def _drain(self, conn: SourceConn, role: str, sock: zmq.Socket[bytes]) -> int:
        n = 0
        while n < _DRAIN and sock in self._owner:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            if role == "sub":
                self._on_live(conn, frames)
            elif role == "dealer":
                self._on_replay(conn, frames)
            else:
                self._on_monitor(conn, frames)
        return n

    # --- sources ----------------------------------------------------------------------------------

    def _add(self, spec: SourceSpec, generation: int, last_seq: int, last_ts: float) -> None:
        if spec.source_id in self._conns:
            self._remove(spec.source_id)
        conn = SourceConn(spec, generation, last_seq, last_ts, self.settings, self._clock())
        self._conns[spec.source_id] = conn
        self._roster += 1
        self.metrics.status.labels(spec.source_id).set(0)
        self._open(conn)

    def _remove(self, source_id: str) -> None:
        conn = self._conns.pop(source_id, None)
        if conn is not None:
            self._roster += 1
            self._close_sockets(conn)
            self._ops = [op for op in self._ops if op[1][0] != source_id]
            self.metrics.remove_source(source_id)  # again: closing set the status gauge

    def _open(self, conn: SourceConn) -> None:
        """Create and connect the source's sockets; on failure, retry after a backoff."""
        try:
            conn.sub = self._socket(zmq.SUB, conn)
            conn.sub.setsockopt(zmq.SUBSCRIBE, conn.spec.topic.encode())
            conn.sub.setsockopt(zmq.RCVHWM, self.settings.rcvhwm)
            conn.sub.setsockopt(zmq.MAXMSGSIZE, self.settings.max_payload_bytes + 4096)
            conn.monitor = conn.sub.get_monitor_socket(_MONITORED)
            conn.sub.connect(conn.spec.endpoint)
            if conn.spec.replay_endpoint:
                self._open_dealer(conn)
        except zmq.ZMQError as exc:
            self._close_sockets(conn)
            self._error(conn, "connect")
            delay = conn.next_backoff("backoff", self.settings.backoff_factor)
            conn.open_at = self._clock() + delay
            log.warning("source %s: cannot connect (%s); retry in %.1fs", conn.spec.source_id, exc, delay)
            return
        self._own(conn.sub, conn, "sub")
        self._own(conn.monitor, conn, "monitor")

    def _open_dealer(self, conn: SourceConn) -> None:
        assert conn.spec.replay_endpoint
        conn.dealer = self._socket(zmq.DEALER, conn)
        conn.dealer.connect(conn.spec.replay_endpoint)
        self._own(conn.dealer, conn, "dealer")

    def _socket(self, kind: int, conn: SourceConn) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(conn.backoff_initial * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(conn.backoff_max * 1000)))
        if is_ipv6(conn.spec.endpoint) or is_ipv6(conn.spec.replay_endpoint or ""):
            sock.setsockopt(zmq.IPV6, 1)
        return sock

    def _own(self, sock: zmq.Socket[bytes] | None, conn: SourceConn, role: str) -> None:
        if sock is not None:
            self._owner[sock] = (conn, role)
            self._poller.register(sock, zmq.POLLIN)

    def _disown(self, sock: zmq.Socket[bytes] | None) -> None:
        if sock is not None and self._owner.pop(sock, None) is not None:
            self._poller.unregister(sock)
        if sock is not None:
            sock.close(linger=0)

    def _close_sockets(self, conn: SourceConn) -> None:
        if conn.sub is not None:
            try:
                conn.sub.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (conn.sub, conn.dealer, conn.monitor):
            self._disown(sock)
        conn.sub = conn.dealer = conn.monitor = None
        if conn.connected:
            conn.connected = False
            self.metrics.status.labels(conn.spec.source_id).set(0)

    # --- timers -----------------------------------------------------------------------------------

    def _timers(self, now: float) -> None:
        stale = []
        for conn in list(self._conns.values()):
            if conn.sub is None and now >= conn.open_at and not conn.spec.push:
                self.metrics.reconnect_attempts.labels(conn.spec.source_id).inc()
                self._open(conn)
            if conn.replay_start is not None and now >= conn.replay_deadline:
                if conn.probing:
                    self._probe_failed(conn)
                else:
                    self._replay_failed(conn, "replay_timeout")
            if self._liveness(conn, now):
                stale.append(conn.spec.source_id)
        if len(stale) != len(self.stale_ids) or not self.stale_ids.issuperset(stale):
            self.stale_ids = frozenset(stale)

    def _liveness(self, conn: SourceConn, now: float) -> bool:
        """Probe a silent source, mark it stale, expire it; True while it is stale."""
        cfg, idle = self.settings, now - conn.heard_at
        if (idle >= cfg.probe_interval_s and now >= conn.probe_at and conn.replay_start is None
                and conn.dealer is not None and now >= conn.replay_not_before):
            self._probe(conn, now)
        stale = idle >= cfg.stale_after_s
        if stale != conn.stale:
            conn.stale = stale
            self.metrics.stale.labels(conn.spec.source_id).set(int(stale))
        if stale and cfg.expire_after_s > 0 and idle >= cfg.expire_after_s and not conn.expired:
            if conn.spec.push:
                self._expire_push(conn)
            else:
                self._expire(conn)
        return stale

    def _heard(self, conn: SourceConn) -> None:
        conn.heard_at = self._clock()
        conn.heard_wall = time.time()
        conn.expired = False

    def _probe(self, conn: SourceConn, now: float) -> None:
        """Ask from ``last_seq`` itself, like a reconnect: the answer proves the publisher is up
        and still the incarnation whose blocks we hold."""
        conn.probe_at = now + self.settings.probe_interval_s
        if conn.last_seq >= 0:
            self._start_replay(conn, conn.last_seq, (conn.last_seq, conn.last_ts), probe=True)
        else:
            self._start_replay(conn, 0, probe=True)

    def _probe_failed(self, conn: SourceConn) -> None:
        """An unanswered probe: the source just stays unheard (no replay backoff: probes are
        already spaced by ``probe_interval_s``)."""
        conn.stats["probe_failures"] += 1
        self.metrics.probe_failures.labels(conn.spec.source_id).inc()
        self._end_probe(conn)

    def _end_probe(self, conn: SourceConn) -> None:
        conn.replay_start = None
        conn.probing = False
        if conn.dealer is not None:  # a late answer must not leak into the next replay
            self._renew_dealer(conn)
        self._release_held(conn)

    def _expire(self, conn: SourceConn) -> None:
        """Not heard for ``expire_after_s``: drop its blocks; when heard again it rebuilds from 0."""
        log.warning("source %s: not heard for %.0fs, dropping its blocks", conn.spec.source_id,
                    self.settings.expire_after_s)
        conn.expired = True
        conn.gap = False
        conn.stats["expired"] += 1
        self.metrics.expired.labels(conn.spec.source_id).inc()
        self._ops.append(("expire", (conn.spec.source_id, conn.generation)))
        conn.last_seq, conn.last_ts = -1, 0.0

    def _expire_push(self, conn: SourceConn) -> None:
        """:meth:`_expire` for a push source, at once and under the index lock (see the module
        docstring). It cannot be replayed: ``gap`` stays set, so its replies ask for a snapshot."""
        with self.index.lock:
            if self._clock() - conn.heard_at < self.settings.expire_after_s or conn.expired:
                return  # reported meanwhile
            log.warning("push source %s: not heard for %.0fs, dropping its blocks", conn.spec.source_id,
                        self.settings.expire_after_s)
            conn.expired = conn.gap = True
            conn.stats["expired"] += 1
            self.metrics.expired.labels(conn.spec.source_id).inc()
            self._count_expired(conn.spec.source_id)
            self.index.clear_source(conn.spec.source_id, conn.generation)
        self.index.flush()

    def _rebuild(self, conn: SourceConn, reason: str) -> None:
        """Drop every block of the source; the replay that follows (or the next events) refill it."""
        conn.stats["rebuilds"] += 1
        conn.stats["last_rebuild"] = reason
        self.metrics.rebuilds.labels(conn.spec.source_id).inc()
        conn.gap = False
        self._ops.append(("clear", (conn.spec.source_id, conn.generation)))

    # --- live messages ----------------------------------------------------------------------------

    def _on_live(self, conn: SourceConn, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._error(conn, "bad_frames")
            return
        self._heard(conn)
        if conn.probing:  # the message answers the probe; holding it for the probe would delay it
            self._end_probe(conn)
        seq = _SEQ.unpack(frames[1])[0]
        batch = self._decode(conn, frames[2])
        if conn.last_live is not None and seq < conn.last_live:
            conn.last_live = seq
            self._restart(conn, seq, batch)
            return
        conn.last_live = seq if conn.last_live is None else max(conn.last_live, seq)
        if conn.replay_start is not None:
            self._hold(conn, seq, batch)
            return
        self._sequence(conn, seq, batch, allow_replay=True)

    def _sequence(self, conn: SourceConn, seq: int, batch: DecodedBatch | None, allow_replay: bool) -> None:
        """Place one batch (live or replayed) against ``last_seq``: apply, drop, replay or reset."""
        last = conn.last_seq
        if seq == last + 1 or (last < 0 and not self._can_replay(conn, allow_replay)):
            if seq > last + 1:
                self._missed(conn, seq - last - 1)
            self._queue_apply(conn, seq, batch)
        elif seq <= last:
            if batch is not None and batch.ts > conn.last_ts:
                self._restart(conn, seq, batch)
            else:
                conn.stats["duplicates"] += 1
        elif self._can_replay(conn, allow_replay):
            self._missed(conn, seq - last - 1)
            self._hold(conn, seq, batch)
            self._start_replay(conn, last + 1)
        else:
            self._missed(conn, seq - last - 1)
            conn.gap = True  # removals in the gap are lost: held blocks may be stale
            self._queue_apply(conn, seq, batch)

    def _can_replay(self, conn: SourceConn, allow: bool) -> bool:
        return allow and conn.dealer is not None and self._clock() >= conn.replay_not_before

    def _restart(self, conn: SourceConn, seq: int | None, batch: DecodedBatch | None) -> None:
        """The publisher restarted (its seq went back): clear the source and rebuild by replay."""
        log.info("source %s: publisher restart detected (seq %s after %d)", conn.spec.source_id, seq, conn.last_seq)
        conn.stats["restarts"] += 1
        self._error(conn, "publisher_restart")
        self._rebuild(conn, "publisher_restart")
        conn.last_seq, conn.last_ts = -1, 0.0
        if conn.replay_start is not None and conn.dealer is not None:
            self._renew_dealer(conn)  # replies of the abandoned replay must not be applied
        conn.replay_start = None
        if seq is not None:
            self._hold(conn, seq, batch)
        if conn.dealer is not None:
            self._start_replay(conn, 0)
        else:
            self._release_held(conn)

    def _hold(self, conn: SourceConn, seq: int, batch: DecodedBatch | None) -> None:
        if len(conn.held) >= self.settings.max_held:
            conn.held.pop(0)
            self._error(conn, "held_overflow")
        conn.held.append((seq, batch))

    def _queue_apply(self, conn: SourceConn, seq: int, batch: DecodedBatch | None) -> None:
        conn.last_seq = seq
        if batch is not None:
            conn.last_ts = batch.ts
            conn.stats["last_event_time"] = time.time()
        empty = DecodedBatch(conn.last_ts, [])
        self._ops.append(("apply", (conn.spec.source_id, conn.generation, seq, batch or empty)))

    def _decode(self, conn: SourceConn, payload: bytes) -> DecodedBatch | None:
        """The batch, or None for garbage (counted; its seq is still consumed)."""
        try:
            batch = decode_batch(payload, packed_tokens=native_states() is not None)
        except EventDecodeError:
            self._error(conn, "decode")
            return None
        self.metrics.received(conn.spec.source_id, batch.events)
        for kind in batch.errors:
            self._error(conn, kind)
        if batch.data_parallel_rank is not None and batch.data_parallel_rank != conn.spec.dp_rank:
            self._error(conn, "dp_rank_mismatch")
        return batch

    # --- replay -----------------------------------------------------------------------------------

    def _start_replay(
        self, conn: SourceConn, start: int, check: tuple[int, float] | None = None, probe: bool = False
    ) -> None:
        """Ask for every buffered batch from ``start``. With ``check = (seq, ts)`` the first reply
        must be that very batch, proving the publisher is the incarnation we last heard from."""
        if conn.dealer is None:
            return
        conn.replay_check = check
        try:
            conn.dealer.send_multipart([b"", _SEQ.pack(start)], zmq.NOBLOCK)
        except zmq.ZMQError:
            self._replay_failed(conn, "replay_send")
            return
        conn.replay_start = start
        conn.replay_first = None
        conn.replay_deadline = self._clock() + conn.replay_timeout
        conn.probing = probe
        if probe:
            conn.stats["probes"] += 1
            self.metrics.probes.labels(conn.spec.source_id).inc()
        else:
            conn.stats["replays"] += 1
            self.metrics.replay_requests.labels(conn.spec.source_id).inc()

    def _on_replay(self, conn: SourceConn, frames: list[bytes]) -> None:
        if frames and frames[0] == b"":
            frames = frames[1:]
        if len(frames) == 3:
            frames = frames[1:]  # vLLM >= 0.26 puts the topic first
        if len(frames) != 2 or len(frames[0]) != 8:
            self._error(conn, "bad_replay_frames")
            return
        self._heard(conn)  # any well-formed answer, even a late one, shows the publisher is up
        if conn.replay_start is None:
            return  # a late reply to a replay we gave up on
        if frames[0] == END_SEQ or not frames[1]:
            if conn.replay_check is not None:
                # our last batch is not buffered any more: a restarted publisher (or one whose
                # buffer rolled over); either way our blocks may be stale
                self._restart(conn, None, None)
                return
            self._replay_done(conn)
            return
        seq = _SEQ.unpack(frames[0])[0]
        batch = self._decode(conn, frames[1])
        if conn.replay_first is None:
            conn.replay_first = seq
            check, conn.replay_check = conn.replay_check, None
            if check is not None and seq == check[0] and batch is not None and batch.ts != check[1]:
                self._restart(conn, None, None)  # same seq, another batch: a new publisher
                return
            if check is not None and seq == check[0]:
                return  # the batch we applied last, unchanged: proof, not a duplicate
            if seq > conn.replay_start:
                self._unrecoverable(conn, seq)
        conn.replay_deadline = self._clock() + conn.replay_timeout  # progress extends the deadline
        self._sequence(conn, seq, batch, allow_replay=False)

    def _unrecoverable(self, conn: SourceConn, first: int) -> None:
        """The publisher no longer buffers the gap: drop the source's (possibly stale) blocks."""
        self._error(conn, "replay_gap")
        if conn.last_seq >= 0:
            self._missed(conn, first - conn.last_seq - 1)
            self._rebuild(conn, "replay_gap")
        conn.last_seq = first - 1

    def _replay_done(self, conn: SourceConn) -> None:
        conn.replay_start = None
        conn.replay_backoff = conn.backoff_initial
        if conn.probing:
            conn.probing = False
        else:
            conn.stats["replays_ok"] = conn.stats.get("replays_ok", 0) + 1
            self.metrics.replay_success.labels(conn.spec.source_id).inc()
        self._release_held(conn)

    def _replay_failed(self, conn: SourceConn, kind: str) -> None:
        conn.replay_start = None
        conn.probing = False
        conn.stats["replay_failures"] += 1
        self.metrics.replay_failures.labels(conn.spec.source_id).inc()
        self._error(conn, kind)
        conn.replay_not_before = self._clock() + conn.next_backoff("replay_backoff", self.settings.backoff_factor)
        if conn.dealer is not None:  # stale replies must not leak into the next replay
            self._renew_dealer(conn)
        self._release_held(conn)

    def _renew_dealer(self, conn: SourceConn) -> None:
        self._disown(conn.dealer)
        conn.dealer = None
        try:
            self._open_dealer(conn)
        except zmq.ZMQError:
            self._error(conn, "connect")

    def _release_held(self, conn: SourceConn) -> None:
        held, conn.held = sorted(conn.held, key=lambda x: x[0]), []
        for seq, batch in held:
            self._sequence(conn, seq, batch, allow_replay=False)

    # --- connection monitor ------------------------------------------------------------------------

    def _on_monitor(self, conn: SourceConn, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)["event"]
        except Exception:  # noqa: BLE001 - a malformed monitor frame is not worth dying for
            return
        source_id = conn.spec.source_id
        if event == zmq.EVENT_CONNECTED:
            conn.connected = True
            conn.stats["connections"] += 1
            self.metrics.connections.labels(source_id).inc()
            self.metrics.status.labels(source_id).set(1)
            conn.last_live = None
            conn.backoff = conn.backoff_initial
            reconnect, conn.ever_connected = conn.ever_connected, True
            if conn.probing:  # a probe sent while away: the reconnect replay below replaces it
                self._end_probe(conn)
            if conn.dealer is not None and conn.replay_start is None:
                # Ask from last_seq itself (applying resumes at last_seq + 1): its batch must come
                # back unchanged, else the publisher restarted while we were away.
                if conn.last_seq >= 0:
                    self._start_replay(conn, conn.last_seq, (conn.last_seq, conn.last_ts))
                else:
                    self._start_replay(conn, 0)
            elif reconnect:
                log.info("source %s reconnected without replay; gaps will be counted", source_id)
        elif event == zmq.EVENT_DISCONNECTED:
            conn.connected = False
            conn.stats["disconnections"] += 1
            self.metrics.disconnections.labels(source_id).inc()
            self.metrics.status.labels(source_id).set(0)
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.metrics.reconnect_attempts.labels(source_id).inc()

    # --- applying -----------------------------------------------------------------------------------

    def _apply_ops(self) -> None:
        ops, self._ops = self._ops, []
        i = 0
        while i < len(ops):
            kind, arg = ops[i]
            if kind in ("clear", "expire"):
                if kind == "expire":
                    self._count_expired(arg[0])
                self.index.clear_source(arg[0], arg[1])
                self.index.set_position(arg[0], arg[1], -1)
                i += 1
                continue
            j = i
            while j < len(ops) and ops[j][0] == "apply":
                j += 1
            self._apply(ops[i:j])
            i = j
        if ops:
            self.index.flush()

    def _count_expired(self, source_id: str) -> None:
        dropped = sum(self.index.blocks_held(source_id).values())
        self.metrics.expired_blocks.labels(source_id).inc(dropped)
        conn = self._conns.get(source_id)
        if conn is not None:
            conn.stats["expired_blocks"] += dropped

    def _apply(self, ops: list[tuple[str, Any]]) -> None:
        items: list[Item] = [arg for _, arg in ops]
        start = time.perf_counter()
        results = self.index.apply_many(items)
        elapsed = (time.perf_counter() - start) / max(1, len(items))
        for (source_id, _, seq, _), stats in zip(items, results):
            if stats is None:
                continue
            self.metrics.applied(source_id, seq, elapsed)
            self.metrics.processed(source_id, stats.processed)
            conn = self._conns.get(source_id)
            for kind, n in stats.errors.items():
                if conn is not None and kind not in ("unknown_event", "bad_event"):
                    self._error(conn, kind, n)  # decode kinds were counted on receipt

    # --- counting ---------------------------------------------------------------------------------------

    def _missed(self, conn: SourceConn, n: int) -> None:
        if n > 0:
            conn.stats["missed"] += n
            self.metrics.missed.labels(conn.spec.source_id).inc(n)

    def count_error(self, conn: SourceConn, kind: str, n: int = 1) -> None:
        """Count ``n`` errors of ``kind`` for a source (push sources count their own)."""
        self._error(conn, kind, n)

    def _error(self, conn: SourceConn, kind: str, n: int = 1) -> None:
        conn.stats["errors"] += n
        by_kind = conn.stats["errors_by_kind"]
        by_kind[kind] = by_kind.get(kind, 0) + n
        self.metrics.error(conn.spec.source_id, kind, n)

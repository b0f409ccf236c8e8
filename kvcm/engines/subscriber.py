"""The event subscriber: one thread, one ``zmq.Poller`` over every source's SUB, replay DEALER and
connection monitor, keeping the :class:`~kvcm.engines.index.EngineIndex` in sync.

This module owns the sockets and carries out decisions; the rules are elsewhere:

* :mod:`kvcm.engines.sequencer` decides what each batch, replay answer, reconnect or timeout
  means (apply, count a duplicate or a gap, replay, rebuild after a publisher restart);
* :mod:`kvcm.engines.liveness` says when a silent source is probed, stale or expired.

Per source, frames ``[topic, seq(8B BE), payload]`` are read from the SUB (anything else is
counted, ``bad_frames``, and dropped); replay answers from the DEALER may have 2 (``[seq,
payload]``) or 3 (``[topic, seq, payload]``) frames, and ``-1`` (or an empty payload) ends a
replay. The first connection replays from 0 (or from ``last_seq`` when the index was restored
from disk). A failed replay re-creates the DEALER; socket set-up failures back off 1 s -> 30 s
(x2), and TCP reconnects use libzmq's own backoff set to the same numbers.

Capacity: the ZeroMQ context is sized for ``settings.max_sources`` up front
(:func:`~kvcm.engines.sourceconn.size_context`).

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
import struct
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvcm.cache.keys import native_states
from kvcm.engines import sequencer
from kvcm.engines.entries import Item
from kvcm.engines.index import EngineIndex
from kvcm.engines.liveness import Freshness
from kvcm.engines.metrics import EventMetrics
from kvcm.engines.sourceconn import SourceConn, size_context
from kvcm.engines.sources import SourceSpec, SubscriberSettings
from kvcm.proto.kv_events import DecodedBatch, EventDecodeError, decode_batch
from kvcm.threads import gc_paused

log = logging.getLogger("kvcm.engines.subscriber")

END_SEQ = b"\xff" * 8
_SEQ = struct.Struct(">Q")
_DRAIN = 1000
_MAX_FRESH = 1024  # instances whose freshness map is cached


class _Clear(NamedTuple):
    """An index operation: drop every block of a source (``expire``: because it expired)."""

    source_id: str
    generation: int
    expire: bool


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
        self._owner: dict[zmq.Socket[bytes], tuple[SourceConn, str]] = {}
        self._poller = zmq.Poller()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._ops: list[Item | _Clear] = []
        self._thread: threading.Thread | None = None
        self._looping = False  # the thread is in its loop (read for every push report: no is_alive())
        self._stop = threading.Event()
        self._closed = False
        #: sources not heard for ``stale_after_s`` (replaced whole, so readers need no lock)
        self.stale_ids: frozenset[str] = frozenset()
        self._fresh: dict[str, tuple[float, int, dict[str, Freshness], bytes]] = {}  # per instance
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

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Connection facts per source, for ``list_event_sources``."""
        out = {}
        for source_id, conn in list(self._conns.items()):
            stats: dict[str, object] = dict(conn.stats)
            stats["errors_by_kind"] = dict(conn.stats["errors_by_kind"])
            stats["connected"] = conn.connected
            stats["replaying"] = conn.seq.replaying and not conn.seq.probing
            stats["state"], stats["age_s"] = self._freshness(conn)
            stats["last_heard"] = conn.liveness.heard_wall
            out[source_id] = stats
        return out

    def freshness(self, source_id: str) -> tuple[str, float] | None:
        """``(state, age_s)`` of a followed source (None if not followed): state is ``live``,
        ``replaying``, ``gap``, ``stale`` or ``expired``; age is seconds since it was last heard."""
        conn = self._conns.get(source_id)
        return None if conn is None else self._freshness(conn)

    def instance_freshness(self, instance_id: str) -> tuple[dict[str, Freshness], bytes]:
        """``{source_id: {"state", "age_s"}}`` of the instance's sources, and its msgpack, for
        ``match_engines`` replies. Kept for ``poll_ms`` (a reply's ages are at most that old), as
        a router may ask thousands of times a second about an instance with a hundred sources."""
        now, roster = self._clock(), self._roster
        known = self._fresh.get(instance_id)
        if known is None or now - known[0] >= self.settings.poll_ms / 1000 or known[1] != roster:
            fresh: dict[str, Freshness] = {}
            for source_id, conn in list(self._conns.items()):
                if conn.spec.instance_id == instance_id:
                    state, age = self._freshness(conn)
                    fresh[source_id] = {"state": state, "age_s": round(age, 2)}
            if len(self._fresh) >= _MAX_FRESH:  # instances come and go; ids are registered ones
                self._fresh = {}
            known = self._fresh[instance_id] = (now, roster, fresh, msgspec.msgpack.encode(fresh))
        return known[2], known[3]

    def _freshness(self, conn: SourceConn) -> tuple[str, float]:
        replaying = conn.seq.replaying and not conn.seq.probing
        return conn.liveness.state(self._clock(), replaying, conn.seq.gap)

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

    # --- sources and their sockets ----------------------------------------------------------------

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
            self._ops = [op for op in self._ops if op[0] != source_id]
            self.metrics.remove_source(source_id)  # again: closing set the status gauge

    def _open(self, conn: SourceConn) -> None:
        """Create and connect the source's sockets; on failure, retry after a backoff."""
        try:
            conn.open_sockets(self._ctx, self.settings)
        except zmq.ZMQError as exc:
            self._close_sockets(conn)
            self._error(conn, "connect")
            delay = conn.backoff.next()
            conn.open_at = self._clock() + delay
            log.warning("source %s: cannot connect (%s); retry in %.1fs", conn.spec.source_id, exc, delay)
            return
        self._own(conn.sub, conn, "sub")
        self._own(conn.monitor, conn, "monitor")
        self._own(conn.dealer, conn, "dealer")

    def _renew_dealer(self, conn: SourceConn) -> None:
        """A fresh DEALER: the answers to an abandoned replay must not reach the next one."""
        self._disown(conn.dealer)
        conn.dealer = None
        try:
            self._own(conn.open_dealer(self._ctx), conn, "dealer")
        except zmq.ZMQError:
            self._error(conn, "connect")

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

    # --- timers and liveness ----------------------------------------------------------------------

    def _timers(self, now: float) -> None:
        stale = []
        for conn in list(self._conns.values()):
            if not conn.spec.push:
                if conn.sub is None and now >= conn.open_at:
                    self.metrics.reconnect_attempts.labels(conn.spec.source_id).inc()
                    self._open(conn)
                self._carry_out(conn, conn.seq.tick(now))
            if self._liveness(conn, now):
                stale.append(conn.spec.source_id)
        if len(stale) != len(self.stale_ids) or not self.stale_ids.issuperset(stale):
            self.stale_ids = frozenset(stale)

    def _liveness(self, conn: SourceConn, now: float) -> bool:
        """Probe a silent source, mark it stale, expire it; True while it is stale."""
        live = conn.liveness
        if live.probe_due(now) and conn.seq.can_probe(now):
            live.probed(now)
            self._carry_out(conn, conn.seq.probe(now))
        stale = live.update_stale(now)
        if stale is not None:
            self.metrics.stale.labels(conn.spec.source_id).set(int(stale))
        if live.expire_due(now):
            if conn.spec.push:
                self._expire_push(conn)
            else:
                self._expire(conn)
        return live.stale

    def _heard(self, conn: SourceConn) -> None:
        conn.liveness.heard(self._clock(), time.time())

    def _expire(self, conn: SourceConn) -> None:
        """Not heard for ``expire_after_s``: drop its blocks; when heard again it rebuilds from 0."""
        log.warning("source %s: not heard for %.0fs, dropping its blocks", conn.spec.source_id,
                    self.settings.expire_after_s)
        conn.expired = True
        conn.stats["expired"] += 1
        self.metrics.expired.labels(conn.spec.source_id).inc()
        self._ops.append(_Clear(conn.spec.source_id, conn.generation, expire=True))
        conn.seq.reset()

    def _expire_push(self, conn: SourceConn) -> None:
        """:meth:`_expire` for a push source, at once and under the index lock (see the module
        docstring). It cannot be replayed: ``gap`` stays set, so its replies ask for a snapshot."""
        with self.index.lock:
            if self._clock() - conn.liveness.heard_at < self.settings.expire_after_s or conn.expired:
                return  # reported meanwhile
            log.warning("push source %s: not heard for %.0fs, dropping its blocks", conn.spec.source_id,
                        self.settings.expire_after_s)
            conn.expired = conn.gap = True
            conn.stats["expired"] += 1
            self.metrics.expired.labels(conn.spec.source_id).inc()
            self._count_expired(conn.spec.source_id)
            self.index.clear_source(conn.spec.source_id, conn.generation)
        self.index.flush()

    # --- frames -----------------------------------------------------------------------------------

    def _on_live(self, conn: SourceConn, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._error(conn, "bad_frames")
            return
        self._heard(conn)
        # a probe ends first: the DEALER it renews is the one the batch may then replay through
        self._carry_out(conn, conn.seq.end_probe(self._clock()))
        seq = _SEQ.unpack(frames[1])[0]
        batch = self._decode(conn, frames[2])
        self._carry_out(conn, conn.seq.live(seq, batch, self._clock()))

    def _on_replay(self, conn: SourceConn, frames: list[bytes]) -> None:
        if frames and frames[0] == b"":
            frames = frames[1:]
        if len(frames) == 3:
            frames = frames[1:]  # vLLM >= 0.26 puts the topic first
        if len(frames) != 2 or len(frames[0]) != 8:
            self._error(conn, "bad_replay_frames")
            return
        self._heard(conn)  # any well-formed answer, even a late one, shows the publisher is up
        if not conn.seq.replaying:
            return  # a late answer to a replay we gave up on (not decoded, not counted)
        if frames[0] == END_SEQ or not frames[1]:
            self._carry_out(conn, conn.seq.replay_end(self._clock()))
            return
        seq = _SEQ.unpack(frames[0])[0]
        batch = self._decode(conn, frames[1])
        self._carry_out(conn, conn.seq.replayed(seq, batch, self._clock()))

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
            conn.backoff.reset()
            reconnect, conn.ever_connected = conn.ever_connected, True
            # a probe sent while away ends first: the reconnect replay replaces it
            self._carry_out(conn, conn.seq.end_probe(self._clock()))
            decisions = conn.seq.connected(self._clock())
            if reconnect and not any(isinstance(d, sequencer.AskReplay) for d in decisions):
                log.info("source %s reconnected without replay; gaps will be counted", source_id)
            self._carry_out(conn, decisions)
        elif event == zmq.EVENT_DISCONNECTED:
            conn.connected = False
            conn.stats["disconnections"] += 1
            self.metrics.disconnections.labels(source_id).inc()
            self.metrics.status.labels(source_id).set(0)
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.metrics.reconnect_attempts.labels(source_id).inc()

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

    # --- carrying out the sequencer's decisions ---------------------------------------------------

    def _carry_out(self, conn: SourceConn, decisions: list[sequencer.Decision]) -> None:
        """Do what the sequencer decided, in order; a replay it asks for ends the list, and the
        sequencer, told how the asking went, may decide more."""
        while decisions:
            ask = None
            for decision in decisions:
                if isinstance(decision, sequencer.AskReplay):
                    ask = decision
                else:
                    self._do(conn, decision)
            decisions = self._ask_replay(conn, ask) if ask is not None else []

    def _ask_replay(self, conn: SourceConn, ask: sequencer.AskReplay) -> list[sequencer.Decision]:
        if conn.dealer is None:  # its renewal, just decided, failed
            return conn.seq.unsent(self._clock())
        try:
            conn.dealer.send_multipart([b"", _SEQ.pack(ask.start)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return conn.seq.send_failed(self._clock())
        if ask.probe:
            conn.stats["probes"] += 1
            self.metrics.probes.labels(conn.spec.source_id).inc()
        else:
            conn.stats["replays"] += 1
            self.metrics.replay_requests.labels(conn.spec.source_id).inc()
        return conn.seq.sent(self._clock())

    def _do(self, conn: SourceConn, decision: sequencer.Decision) -> None:
        source_id = conn.spec.source_id
        match decision:
            case sequencer.Apply(seq, batch, garbage):
                if not garbage:
                    conn.stats["last_event_time"] = time.time()
                self._ops.append((source_id, conn.generation, seq, batch))
            case sequencer.Duplicate():
                conn.stats["duplicates"] += 1
            case sequencer.Missed(count):
                conn.stats["missed"] += count
                self.metrics.missed.labels(source_id).inc(count)
            case sequencer.Fault(kind):
                self._error(conn, kind)
            case sequencer.Restarted(seq, last_seq):
                log.info("source %s: publisher restart detected (seq %s after %d)", source_id, seq, last_seq)
                conn.stats["restarts"] += 1
                self._error(conn, "publisher_restart")
            case sequencer.Rebuild(reason):
                conn.stats["rebuilds"] += 1
                conn.stats["last_rebuild"] = reason
                self.metrics.rebuilds.labels(source_id).inc()
                self._ops.append(_Clear(source_id, conn.generation, expire=False))
            case sequencer.RenewChannel():
                self._renew_dealer(conn)
            case _:
                self._do_replay_outcome(conn, decision)

    def _do_replay_outcome(self, conn: SourceConn, decision: sequencer.Decision) -> None:
        source_id = conn.spec.source_id
        if isinstance(decision, sequencer.ReplayOk):
            conn.stats["replays_ok"] = conn.stats.get("replays_ok", 0) + 1
            self.metrics.replay_success.labels(source_id).inc()
        elif isinstance(decision, sequencer.ReplayFailed):
            conn.stats["replay_failures"] += 1
            self.metrics.replay_failures.labels(source_id).inc()
            self._error(conn, decision.kind)
        elif isinstance(decision, sequencer.ProbeFailed):
            conn.stats["probe_failures"] += 1
            self.metrics.probe_failures.labels(source_id).inc()

    # --- applying ---------------------------------------------------------------------------------

    def _apply_ops(self) -> None:
        ops, self._ops = self._ops, []
        i = 0
        while i < len(ops):
            op = ops[i]
            if isinstance(op, _Clear):
                if op.expire:
                    self._count_expired(op.source_id)
                self.index.clear_source(op.source_id, op.generation)
                self.index.set_position(op.source_id, op.generation, -1)
                i += 1
                continue
            items: list[Item] = []
            while i < len(ops) and not isinstance(op := ops[i], _Clear):
                items.append(op)
                i += 1
            self._apply(items)
        if ops:
            self.index.flush()

    def _count_expired(self, source_id: str) -> None:
        dropped = sum(self.index.blocks_held(source_id).values())
        self.metrics.expired_blocks.labels(source_id).inc(dropped)
        conn = self._conns.get(source_id)
        if conn is not None:
            conn.stats["expired_blocks"] += dropped

    def _apply(self, items: list[Item]) -> None:
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

    # --- counting ---------------------------------------------------------------------------------

    def count_error(self, conn: SourceConn, kind: str, n: int = 1) -> None:
        """Count ``n`` errors of ``kind`` for a source (push sources count their own)."""
        self._error(conn, kind, n)

    def _error(self, conn: SourceConn, kind: str, n: int = 1) -> None:
        conn.stats["errors"] += n
        by_kind = conn.stats["errors_by_kind"]
        by_kind[kind] = by_kind.get(kind, 0) + n
        self.metrics.error(conn.spec.source_id, kind, n)

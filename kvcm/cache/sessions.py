"""Write sessions of the two-phase write, persisted so they survive a restart (Tair kept them in
memory only).

The ``sessions`` database maps a session id to its :class:`Session` (instance, the new keys and
the location id created for each, and a wall-clock deadline). Expiry itself runs on a monotonic
clock: each session gets a monotonic deadline when it is created or loaded, so a wall-clock jump
neither mass-expires sessions nor keeps them alive. At load time the remaining lifetime is
``deadline - now`` clamped to ``[0, timeout]`` (a clock set back cannot extend a session).

Thread ownership: the RPC thread (create, take, the expiry timer). The in-memory heap is never
touched by other threads.

:class:`InFlight` bounds what one instance may hold in unfinished writes: open sessions and
bytes of ``writing`` copies. A hold counts from the moment it is made (so requests of one
uncommitted group commit see each other and a cap is never overshot) and is undone if its
transaction never commits; a release counts once it commits. The counts are rebuilt from the
store at start-up (sessions from their records, bytes from the ``writing`` copies).
"""

from __future__ import annotations

import heapq
import os
import string
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvcm.backends.metastore.base import ReadTxn, WriteTxn

DB = "sessions"
_ALPHABET = string.ascii_lowercase + string.digits
_EXPIRED_MEMORY = 4096  # recently expired ids remembered, to answer WRITE_SESSION_EXPIRED
_HEAP_SLACK = 64  # stale heap entries tolerated beyond the live sessions before a compaction


class Session(msgspec.Struct, array_like=True):
    id: str
    instance: str
    group: str
    keys: list[int]  # the session's new keys, in the order of the returned locations
    loc_ids: list[str]  # location id created for each key ("" when nothing was allocated)
    created: float  # wall clock
    deadline: float  # wall clock
    timeout: float  # seconds


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Session).decode
decode_session = _decode


# byte -> [a-z0-9]; 256 % 36 leaves a tiny bias, irrelevant for ids (not secrets).
_TO_ALNUM = bytes(ord(_ALPHABET[b % len(_ALPHABET)]) for b in range(256))


def random_id(n: int) -> str:
    """``n`` random ``[a-z0-9]`` characters, cheaply (one ``urandom`` call)."""
    return os.urandom(n).translate(_TO_ALNUM).decode()


def new_session_id() -> str:
    """32 random ``[a-z0-9]`` characters (Tair's format)."""
    return random_id(32)


class InFlight:
    """Per instance: ``[open sessions, bytes in writing]``, plus refusals per cap (metrics).

    Changed by the RPC thread (holds, session and write releases) and the deleter thread
    (purges of removed instances release their ``writing`` bytes): hence the lock."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self.refused: dict[str, int] = {}  # config key of the cap -> refusals (RPC thread only)

    def of(self, instance: str) -> tuple[int, int]:
        """``(open sessions, bytes in writing)`` of ``instance``, holds not yet committed included."""
        with self._lock:
            row = self._counts.get(instance)
            return (row[0], row[1]) if row else (0, 0)

    def hold(self, txn: WriteTxn, instance: str, sessions: int, nbytes: int) -> None:
        """Count now; uncount if ``txn``'s changes never commit."""
        self._apply(instance, sessions, nbytes)
        txn.on_abort(lambda: self._apply(instance, -sessions, -nbytes))

    def release(self, txn: WriteTxn, instance: str, sessions: int, nbytes: int) -> None:
        """Uncount once ``txn`` commits (until then the hold stands: caps err on the safe side)."""
        if sessions or nbytes:
            txn.on_commit(lambda: self._apply(instance, -sessions, -nbytes))

    def reset(self, counts: dict[str, list[int]]) -> None:
        with self._lock:
            self._counts = {k: list(v) for k, v in counts.items() if v[0] or v[1]}

    def snapshot(self) -> dict[str, list[int]]:
        with self._lock:
            return {k: list(v) for k, v in self._counts.items()}

    def _apply(self, instance: str, sessions: int, nbytes: int) -> None:
        with self._lock:
            row = self._counts.setdefault(instance, [0, 0])
            row[0] += sessions
            row[1] += nbytes
            if row == [0, 0]:
                del self._counts[instance]


class InFlightStats:
    """``kvcm_write_sessions_open{instance}``, ``kvcm_writing_bytes{instance}`` and
    ``kvcm_write_refused_total{cap}``, built only when scraped (nothing on the write path)."""

    def __init__(self, inflight: InFlight) -> None:
        self.inflight = inflight

    def collect(self) -> Iterator[Metric]:
        sessions = GaugeMetricFamily("kvcm_write_sessions_open", "Open write sessions", labels=["instance"])
        nbytes = GaugeMetricFamily("kvcm_writing_bytes", "Bytes of copies in writing state", labels=["instance"])
        for instance, (n, b) in sorted(self.inflight.snapshot().items()):
            sessions.add_metric([instance], n)
            nbytes.add_metric([instance], b)
        refused = CounterMetricFamily("kvcm_write_refused", "start_write_cache refused by an in-flight cap",
                                      labels=["cap"])
        for cap, n in sorted(dict(self.inflight.refused).items()):
            refused.add_metric([cap], n)
        yield from (sessions, nbytes, refused)


class Sessions:
    """Persisted sessions plus an in-memory expiry heap."""

    def __init__(self, clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.monotonic = monotonic
        self._heap: list[tuple[float, str]] = []
        self._deadline: dict[str, float] = {}  # live session id -> monotonic deadline
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.inflight = InFlight()

    def __len__(self) -> int:
        return len(self._deadline)

    def load(self, view: ReadTxn, owner: dict[str, str] | None = None) -> int:
        """Rebuild the heap and the open-session counts from the store (start-up); fills
        ``owner`` (session id -> instance), which attributes ``writing`` bytes to instances."""
        now, mono = self.clock(), self.monotonic()
        owner = {} if owner is None else owner
        counts: dict[str, list[int]] = {}
        for _, raw in view.scan(DB):
            session = _decode(raw)
            left = min(max(session.deadline - now, 0.0), session.timeout)
            self._track(session.id, mono + left)
            owner[session.id] = session.instance
            counts.setdefault(session.instance, [0, 0])[0] += 1
        self.inflight.reset(counts)
        return len(self._deadline)

    def create(self, txn: WriteTxn, instance: str, group: str, keys: list[int], loc_ids: list[str],
               timeout: float, sid: str | None = None) -> Session:
        now = self.clock()
        session = Session(sid or new_session_id(), instance, group, keys, loc_ids, now, now + timeout, timeout)
        txn.put(DB, session.id.encode(), _encode(session))
        self.inflight.hold(txn, instance, 1, 0)
        mono_deadline = self.monotonic() + timeout
        txn.on_commit(lambda: self._track(session.id, mono_deadline))
        return session

    def _track(self, sid: str, mono_deadline: float) -> None:
        self._deadline[sid] = mono_deadline
        heapq.heappush(self._heap, (mono_deadline, sid))

    def get(self, view: ReadTxn, sid: str) -> Session | None:
        raw = view.get(DB, sid.encode())
        return None if raw is None else _decode(raw)

    def is_due(self, sid: str) -> bool:
        deadline = self._deadline.get(sid)
        return deadline is not None and deadline <= self.monotonic()

    def was_expired(self, sid: str) -> bool:
        return sid in self._expired

    def consume(self, txn: WriteTxn, session: Session, expired: bool = False) -> None:
        """Delete a session in ``txn``; forget it in memory once that commits."""
        sid = session.id
        txn.delete(DB, sid.encode())
        self.inflight.release(txn, session.instance, 1, 0)
        txn.on_commit(lambda: self._forget(sid, expired))

    def _forget(self, sid: str, expired: bool) -> None:
        self._deadline.pop(sid, None)
        # A finished session's heap entry would otherwise stay until its deadline: at a high
        # rate of short writes with long lifetimes, far more entries than open sessions.
        if len(self._heap) > 2 * len(self._deadline) + _HEAP_SLACK:
            self._compact()
        if expired:
            self._expired[sid] = None
            while len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)

    def _compact(self) -> None:
        """The heap of the live sessions only: amortized O(1) per session (it runs once the
        heap holds twice the live ones), and a session popped by :meth:`due` whose expiry is
        still under way is put back, as :meth:`requeue` would."""
        self._heap = [(deadline, sid) for sid, deadline in self._deadline.items()]
        heapq.heapify(self._heap)

    def heap_size(self) -> int:
        """Entries in the expiry heap, live and stale (tests; it stays within twice the live)."""
        return len(self._heap)

    def due(self, limit: int = 100000) -> list[str]:
        """Every live session whose deadline has passed (all of them, not one per tick)."""
        now = self.monotonic()
        out: list[str] = []
        heap = self._heap
        seen: set[str] = set()
        while heap and heap[0][0] <= now and len(out) < limit:
            deadline, sid = heapq.heappop(heap)
            if self._deadline.get(sid) == deadline and sid not in seen:  # a compaction may have put one back
                out.append(sid)
                seen.add(sid)
        return out

    def requeue(self, sids: list[str]) -> None:
        """Put back sessions whose expiry failed (retried next tick)."""
        for sid in sids:
            deadline = self._deadline.get(sid)
            if deadline is not None:
                heapq.heappush(self._heap, (deadline, sid))

"""Write sessions of the two-phase write, persisted so they survive a restart (Tair kept them in
memory only, §18.16).

The ``sessions`` database maps a session id to its :class:`Session` (instance, the new keys and
the location id created for each, and a wall-clock deadline). Expiry itself runs on a monotonic
clock: each session gets a monotonic deadline when it is created or loaded, so a wall-clock jump
neither mass-expires sessions nor keeps them alive. At load time the remaining lifetime is
``deadline - now`` clamped to ``[0, timeout]`` (a clock set back cannot extend a session).

Thread ownership: the RPC thread (create, take, the expiry timer). The in-memory heap is never
touched by other threads.
"""

from __future__ import annotations

import heapq
import os
import string
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from kvcm.backends.base import ReadTxn, WriteTxn

DB = "sessions"
_ALPHABET = string.ascii_lowercase + string.digits
_EXPIRED_MEMORY = 4096  # recently expired ids remembered, to answer WRITE_SESSION_EXPIRED


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


# byte -> [a-z0-9]; 256 % 36 leaves a tiny bias, irrelevant for ids (not secrets).
_TO_ALNUM = bytes(ord(_ALPHABET[b % len(_ALPHABET)]) for b in range(256))


def random_id(n: int) -> str:
    """``n`` random ``[a-z0-9]`` characters, cheaply (one ``urandom`` call)."""
    return os.urandom(n).translate(_TO_ALNUM).decode()


def new_session_id() -> str:
    """32 random ``[a-z0-9]`` characters (Tair's format)."""
    return random_id(32)


class Sessions:
    """Persisted sessions plus an in-memory expiry heap."""

    def __init__(self, clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.monotonic = monotonic
        self._heap: list[tuple[float, str]] = []
        self._deadline: dict[str, float] = {}  # live session id -> monotonic deadline
        self._expired: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._deadline)

    def load(self, view: ReadTxn) -> int:
        """Rebuild the heap from the store (start-up)."""
        now, mono = self.clock(), self.monotonic()
        for _, raw in view.scan(DB):
            session = _decode(raw)
            left = min(max(session.deadline - now, 0.0), session.timeout)
            self._track(session.id, mono + left)
        return len(self._deadline)

    def create(self, txn: WriteTxn, instance: str, group: str, keys: list[int], loc_ids: list[str],
               timeout: float, sid: str | None = None) -> Session:
        now = self.clock()
        session = Session(sid or new_session_id(), instance, group, keys, loc_ids, now, now + timeout, timeout)
        txn.put(DB, session.id.encode(), _encode(session))
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

    def consume(self, txn: WriteTxn, sid: str, expired: bool = False) -> None:
        """Delete a session in ``txn``; forget it in memory once that commits."""
        txn.delete(DB, sid.encode())
        txn.on_commit(lambda: self._forget(sid, expired))

    def _forget(self, sid: str, expired: bool) -> None:
        self._deadline.pop(sid, None)
        if expired:
            self._expired[sid] = None
            while len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)

    def due(self, limit: int = 100000) -> list[str]:
        """Every live session whose deadline has passed (all of them, not one per tick: §18.16)."""
        now = self.monotonic()
        out: list[str] = []
        heap = self._heap
        while heap and heap[0][0] <= now and len(out) < limit:
            deadline, sid = heapq.heappop(heap)
            if self._deadline.get(sid) == deadline:
                out.append(sid)
        return out

    def requeue(self, sids: list[str]) -> None:
        """Put back sessions whose expiry failed (retried next tick)."""
        for sid in sids:
            deadline = self._deadline.get(sid)
            if deadline is not None:
                heapq.heappush(self._heap, (deadline, sid))

    def live_ids(self) -> set[str]:
        return set(self._deadline)

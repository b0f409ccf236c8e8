"""Soft pins: block keys an instance asks to keep whatever its eviction policy says, until a deadline.

A pin names ``(instance, block key)`` and an expiry on the wall clock. It protects the key from
*eviction* only — the reclaimer's victim choice, in-line eviction, a policy's TTL — never from an
explicit ``remove_cache``, ``trim_cache``, ``report_lost`` or the purge of a removed instance. A pin
may name a key that is not stored (yet): a system prompt is pinned before it is written, and the
pin covers it from the moment it is.

Persisted in the ``pins`` database: key ``namespace(instance) + i64(block key)`` (the blocks
database's layout: block keys are signed int64), value ``u64(expiry in ms since the epoch)``.
Mirrored in memory, ``{instance id: {key: expiry seconds}}``, loaded at start-up, so that
:meth:`Pins.is_pinned` is two dict lookups.

Thread ownership: every write (``pin``, ``unpin``, ``expire``, the clean-up of a removed
instance) runs on the RPC thread (its handlers and its timers). Readers on any thread — the
reclaimer calls :meth:`Pins.is_pinned` — see committed state only: the mirror is changed in
``txn.on_commit`` callbacks, and an instance's inner dict is replaced whole, never changed in
place, so a reader iterating one (:meth:`Pins.pinned`) never sees it change under it.

Within one group commit, a request reads the pins of the requests before it through its write
transaction (never the mirror, which is committed state only), so a cap is never overshot by a
batch, and the dict it commits is the whole of the instance's pins as its transaction saw them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

from kvcm.backends.metastore.base import ReadTxn, WriteTxn, from_i64, from_u64, i64, u64
from kvcm.cache.meta_index import namespace
from kvcm.errors import Code, error

log = logging.getLogger("kvcm.cache.pins")

DB = "pins"
_NS = 8  # bytes of an instance's namespace prefix


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000.0))


class Pins:
    """The pins of every instance; see the module docstring."""

    def __init__(self, max_per_instance: int = 4096, max_ttl_s: float = 86400.0) -> None:
        self.max_per_instance = max_per_instance
        self.max_ttl_s = max_ttl_s
        self._mirror: dict[str, dict[int, float]] = {}  # instance -> key -> expiry (wall-clock s)
        self._soonest: dict[str, float] = {}  # instance -> its earliest expiry (the sweep's schedule)
        self._removed: set[str] = set()  # instances gone from the registry whose rows remain
        self._clearing: set[str] = set()  # of those, cleared by a transaction not committed yet

    # -- reads (any thread) ---------------------------------------------------------------------

    def is_pinned(self, instance_id: str, key: int, now: float) -> bool:
        """``key`` of ``instance_id`` has a pin lasting past ``now`` (wall-clock seconds,
        ``time.time()``; the manager's ``clock``). Safe from any thread."""
        keys = self._mirror.get(instance_id)
        if keys is None:
            return False
        expiry = keys.get(key)
        return expiry is not None and expiry > now

    def pinned(self, instance_id: str, now: float) -> set[int]:
        """The keys of ``instance_id`` pinned past ``now``."""
        keys = self._mirror.get(instance_id)
        if not keys:
            return set()
        return {k for k, expiry in keys.items() if expiry > now}

    def count(self, instance_id: str) -> int:
        """Committed pins of ``instance_id``, lapsed ones not swept yet included."""
        return len(self._mirror.get(instance_id, ()))

    def expiry(self, instance_id: str, key: int) -> float | None:
        """The committed expiry of one pin (wall-clock seconds), or None."""
        return self._mirror.get(instance_id, {}).get(key)

    # -- start-up -------------------------------------------------------------------------------

    def load(self, view: ReadTxn, instances: Iterable[str]) -> list[bytes]:
        """Fill the mirror from the store (before the RPC thread starts). Returns the namespaces
        whose pins belong to no registered instance (removed while the server was down, or
        before its clean-up ran): the caller deletes them (:meth:`drop_namespaces`)."""
        owners = {namespace(i): i for i in instances}
        loaded: dict[str, dict[int, float]] = {}
        orphans: list[bytes] = []
        for dbkey, value in view.scan(DB):
            ns = dbkey[:_NS]
            instance_id = owners.get(ns)
            if instance_id is None:
                if not orphans or orphans[-1] != ns:
                    orphans.append(ns)
                continue
            loaded.setdefault(instance_id, {})[from_i64(dbkey[_NS:])] = from_u64(value) / 1000.0
        for instance_id, keys in loaded.items():
            self._set(instance_id, keys)
        return orphans

    @staticmethod
    def drop_namespaces(txn: WriteTxn, namespaces: Sequence[bytes]) -> int:
        dropped = 0
        for ns in namespaces:
            dropped += txn.delete_many(DB, [k for k, _ in txn.scan(DB, prefix=ns)])
        return dropped

    # -- writes (RPC thread) --------------------------------------------------------------------

    def pin(self, txn: WriteTxn, instance_id: str, keys: Sequence[int], ttl_s: float, now: float) -> tuple[int, float]:
        """Pin ``keys`` until ``now + ttl_s`` (a re-pinned key takes the new expiry, earlier or
        later); ``(distinct keys pinned, expiry)``. Lapsed pins of the instance are dropped first,
        so they do not count against the cap.

        :raises KvcmError: INVALID_ARGUMENT for a TTL out of range, QUOTA_EXCEEDED past the cap.
        """
        if not math.isfinite(ttl_s) or ttl_s <= 0:
            raise error(Code.INVALID_ARGUMENT, "ttl_seconds: must be a finite number of seconds > 0")
        if ttl_s > self.max_ttl_s:
            raise error(Code.INVALID_ARGUMENT, f"ttl_seconds: {ttl_s:g} is over the limit of {self.max_ttl_s:g} "
                                               "(cache.max_pin_ttl_s)")
        expiry_ms = _ms(now + ttl_s)
        expiry = expiry_ms / 1000.0
        current = self._current(txn, instance_id, now)
        wanted = list(dict.fromkeys(keys))
        total = len(current) + sum(1 for k in wanted if k not in current)
        if total > self.max_per_instance:
            raise error(Code.QUOTA_EXCEEDED, f"pin_cache: instance {instance_id[:200]!r} would hold {total} pins; "
                                             f"the limit is {self.max_per_instance} (cache.max_pins_per_instance)")
        ns = namespace(instance_id)
        value = u64(expiry_ms)
        txn.put_many(DB, [(ns + i64(k), value) for k in wanted])
        current.update(dict.fromkeys(wanted, expiry))
        self._commit(txn, instance_id, current)
        return len(wanted), expiry

    def unpin(self, txn: WriteTxn, instance_id: str, keys: Sequence[int], now: float) -> int:
        """Drop the pins of ``keys``; returns how many were pinned (lapsed ones do not count)."""
        current = self._current(txn, instance_id, now)
        gone = [k for k in dict.fromkeys(keys) if k in current]
        if gone:
            ns = namespace(instance_id)
            txn.delete_many(DB, [ns + i64(k) for k in gone])
            for key in gone:
                del current[key]
            self._commit(txn, instance_id, current)
        return len(gone)

    def due(self, now: float) -> bool:
        """Anything for :meth:`expire` to do (cheap: the timer asks on every tick)."""
        return bool(self._removed) or any(t <= now for t in self._soonest.values())

    def expire(self, txn: WriteTxn, now: float) -> int:
        """Delete every pin lapsed at ``now`` and the rows of removed instances; returns the
        pins dropped. The caller's transaction holds nothing else uncommitted of pins (a timer
        between turns), so the mirror is the store's state."""
        dropped = self.drop_namespaces(txn, [namespace(i) for i in self._removed])
        for instance_id in list(self._removed):
            txn.on_commit(self._dropper(instance_id))
        for instance_id, soonest in list(self._soonest.items()):
            if soonest > now or instance_id in self._removed:
                continue
            keys = dict(self._mirror.get(instance_id, {}))
            lapsed = [k for k, expiry in keys.items() if expiry <= now]
            ns = namespace(instance_id)
            dropped += txn.delete_many(DB, [ns + i64(k) for k in lapsed])
            for key in lapsed:
                del keys[key]
            self._commit(txn, instance_id, keys)
        return dropped

    def forget(self, instance_id: str) -> None:
        """The instance left the registry (a committed change, RPC thread): its pins stop
        counting now; their rows go at the next :meth:`expire`, or at its next pin if the id is
        registered again before that."""
        self._removed.add(instance_id)
        self._mirror.pop(instance_id, None)
        self._soonest.pop(instance_id, None)

    def check(self, view: ReadTxn, instances: Iterable[str]) -> None:
        """Assert the mirror equals the store for every registered instance (a quiet server)."""
        owners = {namespace(i): i for i in instances if i not in self._removed}
        stored: dict[str, dict[int, float]] = {}
        for dbkey, value in view.scan(DB):
            instance_id = owners.get(dbkey[:_NS])
            if instance_id is not None:
                stored.setdefault(instance_id, {})[from_i64(dbkey[_NS:])] = from_u64(value) / 1000.0
        mirrored = {i: keys for i, keys in self._mirror.items() if i in owners.values()}
        assert mirrored == stored, f"pins in memory {mirrored} != pins in the store {stored}"
        for instance_id, keys in self._mirror.items():
            assert self._soonest.get(instance_id) == min(keys.values()), f"pin schedule of {instance_id!r} is stale"

    # -- helpers --------------------------------------------------------------------------------

    def _current(self, txn: WriteTxn, instance_id: str, now: float) -> dict[int, float]:
        """The instance's live pins as ``txn`` sees them; rows of lapsed pins (and of an earlier
        instance of the same id) are deleted in ``txn``."""
        ns = namespace(instance_id)
        if instance_id in self._removed and instance_id not in self._clearing:
            # Once per transaction: a later request of the same group commit must see (and
            # keep) the pins this one writes, not clear them again.
            self.drop_namespaces(txn, [ns])
            self._clearing.add(instance_id)
            txn.on_commit(lambda: self._cleared(instance_id))
            txn.on_abort(lambda: self._clearing.discard(instance_id))
            return {}
        live: dict[int, float] = {}
        lapsed: list[bytes] = []
        now_ms = _ms(now)
        for dbkey, value in txn.scan(DB, prefix=ns):
            expiry_ms = from_u64(value)
            if expiry_ms <= now_ms:
                lapsed.append(dbkey)
            else:
                live[from_i64(dbkey[_NS:])] = expiry_ms / 1000.0
        if lapsed:
            txn.delete_many(DB, lapsed)
        return live

    def _commit(self, txn: WriteTxn, instance_id: str, keys: dict[int, float]) -> None:
        txn.on_commit(lambda: self._set(instance_id, keys))

    def _set(self, instance_id: str, keys: dict[int, float]) -> None:
        if keys:
            self._mirror[instance_id] = keys  # replaced whole: readers never see it change
            self._soonest[instance_id] = min(keys.values())
        else:
            self._drop(instance_id)

    def _cleared(self, instance_id: str) -> None:
        self._removed.discard(instance_id)
        self._clearing.discard(instance_id)

    def _dropper(self, instance_id: str) -> Callable[[], None]:
        return lambda: self._drop(instance_id)

    def _drop(self, instance_id: str) -> None:
        self._removed.discard(instance_id)
        self._mirror.pop(instance_id, None)
        self._soonest.pop(instance_id, None)

"""MetaIndex: block records per instance on top of the metadata store (Tair's ``MetaIndexer``).

* **Reads are lock-free**: a read transaction (a consistent LMDB snapshot) plus a bounded search
  cache of record values.
* **Writes** go through :meth:`MetaIndex.read_modify_write`: the caller's write transaction is
  already open (lock order: transaction first, then shards), the keys are split into
  shard-aligned batches (:func:`kvcm.cache.locks.make_batches`) and each batch runs under its shard
  locks. Every key is read, modified and written back *one at a time* inside the transaction,
  so a key that appears twice in one call sees its own first update (Tair loses one of them).
  A batch is atomic because the whole transaction is; a failing modifier rolls everything back.
* The **search cache** is invalidated when a write commits (``txn.on_commit``), and a reader only
  fills it if no block write committed since its snapshot began (the ``epoch`` check), so the
  cache can never keep a value older than the committed one.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from kvcm.backends.metastore.base import MetaStore, ReadTxn, WriteTxn, from_i64, i64
from kvcm.cache.locks import ShardedLocks, make_batches

DB = "blocks"
_U64 = struct.Struct(">Q")
_SIGN = 1 << 63  # i64(): sign bit flipped so signed keys sort numerically
_MIN_HIT_RATIO = 0.05  # below this the search cache is mostly bypassed (SearchCache.worth_it)
KEEP = object()  # modifier result: leave the key as it is
Modifier = Callable[[int, int, Any], Any]  # (index, key, record or None) -> record | None | KEEP
# (index, key, stored value) -> (new value, the record's tag before the change), or None: decode
RawModifier = Callable[[int, int, bytes], tuple[bytes | None, Any] | None]  # new value (None: delete), tag


def _same(value: Any) -> Any:
    return value


class CachedRead(NamedTuple):
    """A read transaction and the search-cache epoch taken before it began: what the read finds
    may fill the cache only if no block write committed since (else it could be stale)."""

    view: ReadTxn
    epoch: int  # search-cache epoch when the view began


def namespace(instance_id: str) -> bytes:
    """8-byte key prefix of an instance's blocks (fixed width keeps keys ordered per instance)."""
    return hashlib.blake2b(instance_id.encode(), digest_size=8).digest()


class SearchCache:
    """Bounded, approximately-LRU map of block db key -> stored value.

    Two generations of plain dicts: inserts go to ``young``; when it is full, ``old`` is dropped
    whole and ``young`` becomes ``old``. A hit in ``old`` is promoted. Eviction is O(1) and a miss
    costs two dict lookups (an ``OrderedDict`` LRU costs more than the LMDB read it saves), and
    while the recent hit ratio is below 5 % the cache is mostly bypassed (:meth:`worth_it`).
    Thread-safe under the GIL: every operation is a single dict call, and a racing promotion at
    worst drops one entry.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._half = max(1, self.capacity // 2)
        self._young: dict[bytes, bytes] = {}
        self._old: dict[bytes, bytes] = {}
        self.epoch = 0  # bumped after every committed block write
        self.hits = 0
        self.misses = 0
        self.hit_ratio = 1.0  # moving average over recent lookups
        self._calls = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def get(self, key: bytes) -> bytes | None:
        value = self._young.get(key)
        if value is None:
            value = self._old.get(key)
            if value is not None:
                self.put(key, value)
        return value

    def worth_it(self) -> bool:
        """False while recent lookups almost never hit — a uniformly random workload over a
        store much bigger than the cache, where feeding the cache costs more than it saves;
        every 16th call still goes through the cache, so a change of workload is noticed."""
        if not self.capacity:
            return False
        self._calls += 1
        return self.hit_ratio >= _MIN_HIT_RATIO or self._calls % 16 == 0

    def observe(self, hits: int, n: int) -> None:
        if n:
            self.hit_ratio = 0.8 * self.hit_ratio + 0.2 * (hits / n)

    def lookup(self, keys: list[bytes]) -> list[bytes | None]:
        """``get`` of many keys; hits in the old generation are promoted."""
        yget = self._young.get
        values = [yget(k) for k in keys]
        if None in values and self._old:
            oget = self._old.get
            promote = []
            for i in [i for i, v in enumerate(values) if v is None]:
                value = oget(keys[i])
                if value is not None:
                    values[i] = value
                    promote.append((keys[i], value))
            if promote:
                self.put_many(promote)
        self.hits += len(values) - values.count(None)
        return values

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Insert a batch; rotates generations at most once (a batch larger than a generation
        keeps only its last ``capacity // 2`` items)."""
        if not self.capacity:
            return
        if len(items) > self._half:
            items = items[-self._half :]
        young = self._young
        if len(young) + len(items) > self._half:
            self._old = young
            self._young = young = {}
        young.update(items)

    def put(self, key: bytes, value: bytes) -> None:
        if not self.capacity:
            return
        young = self._young
        if len(young) >= self._half and key not in young:
            self._old = young
            self._young = young = {}
        young[key] = value

    def invalidate(self, keys: Sequence[bytes]) -> None:
        self.epoch += 1
        young, old = self._young, self._old
        for key in keys:
            young.pop(key, None)
            old.pop(key, None)

    def items(self) -> list[tuple[bytes, bytes]]:
        merged = dict(self._old)
        merged.update(self._young)
        return list(merged.items())

    def clear(self) -> None:
        self.epoch += 1
        self._young, self._old = {}, {}


class MetaIndex:
    """Block records of every instance. Thread-safe: reads on any thread, writes on the thread
    that owns the given write transaction (RPC thread, deleter, reclaimer)."""

    def __init__(
        self,
        store: MetaStore,
        shards: int = 64,
        batch_size: int = 16,
        cache_size: int = 65536,
        encode: Callable[[Any], bytes] = _same,
        decode: Callable[[bytes], Any] = _same,
        check_value: Callable[[bytes], None] | None = None,
        tag: Callable[[Any], int | None] | None = None,
        drop_tag: Callable[[WriteTxn, bytes, int], None] | None = None,
    ) -> None:
        """``encode``/``decode`` convert records to stored bytes (the index itself is agnostic of
        the record format; :mod:`kvcm.cache.record_codec` provides the block codec). ``check_value``
        asserts a stored value's own invariants in :meth:`check`. ``tag(record)`` names a
        derived entry built from the record (a run); whenever the record is written or deleted,
        ``drop_tag(txn, ns, tag)`` is called in the same transaction so the entry never outlives
        a change of any record it was built from."""
        self.store = store
        self.encode = encode
        self.decode = decode
        self._check_value = check_value
        self._tag = tag
        self._drop_tag = drop_tag
        self.locks = ShardedLocks(shards)
        self.batch_size = batch_size
        self.cache = SearchCache(cache_size)
        self._writers = 0  # RMW calls in progress (check() needs a quiet index)
        self._writers_lock = threading.Lock()

    # -- reads (lock-free) ----------------------------------------------------------------------

    @contextmanager
    def read(self) -> Iterator[CachedRead]:
        """A read transaction plus the cache epoch taken *before* it began."""
        epoch = self.cache.epoch
        with self.store.read() as view:
            yield CachedRead(view, epoch)

    def get_values(self, snap: CachedRead, ns: bytes, keys: Sequence[int], stop_at_missing: bool = False) -> list[bytes | None]:
        """Stored values of ``keys`` (None = no record), through the search cache.

        ``stop_at_missing``: end the list at the first key without a record (prefix walks).
        This is the hot path of every lookup: loops are comprehensions over local names and the
        store is asked once, for all cache misses together (``get_many``).
        """
        pack, off = _U64.pack, _SIGN
        dbkeys = [ns + pack(k + off) for k in keys]
        cache = self.cache
        if not cache.worth_it():
            values: list[bytes | None] = snap.view.get_many(DB, dbkeys)
        else:
            values = cache.lookup(dbkeys)
            cache.observe(len(values) - values.count(None), len(values))
            missing = [i for i, v in enumerate(values) if v is None]
            if len(missing) == len(values):  # cold keys: one store call, no merging
                values = snap.view.get_many(DB, dbkeys)
                fills = [(k, v) for k, v in zip(dbkeys, values) if v is not None]
            elif missing:
                found = snap.view.get_many(DB, [dbkeys[i] for i in missing])
                fills = []
                for i, value in zip(missing, found):
                    if value is not None:
                        values[i] = value
                        fills.append((dbkeys[i], value))
            if missing:
                cache.misses += len(missing)
                if fills and cache.epoch == snap.epoch:
                    # Only when no write committed since this snapshot began (module doc).
                    cache.put_many(fills)
        if stop_at_missing and None in values:
            return values[: values.index(None)]
        return values

    def scan(self, view: ReadTxn, ns: bytes, start: int | None = None, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        """``(key, value)`` of one instance in key order, from ``start`` (inclusive)."""
        begin = ns + i64(start) if start is not None else ns
        for dbkey, value in view.scan(DB, start=begin, prefix=ns, limit=limit):
            yield from_i64(dbkey[8:]), value

    def chunks(self, ns: bytes, size: int = 1024) -> Iterator[list[tuple[int, bytes]]]:
        """An instance's records in chunks, each from its own short read transaction
        (a long-lived reader makes LMDB grow: its pages cannot be reused while it reads)."""
        start: int | None = None
        while True:
            with self.store.read() as view:
                chunk = list(self.scan(view, ns, start, size + 1))
            yield chunk[:size]
            if len(chunk) <= size:
                return
            start = chunk[size][0]

    # -- writes ---------------------------------------------------------------------------------

    def read_modify_write(self, txn: WriteTxn, ns: bytes, keys: Sequence[int], fn: Modifier,
                          values: dict[int, bytes] | None = None, raw: RawModifier | None = None) -> list[Any]:
        """Apply ``fn(index, key, record)`` to every key; returns what ``fn`` returned, per index.

        ``fn`` returns the new record, ``None`` to delete the key, or :data:`KEEP`.
        It must not do IO or take locks. The caller's write transaction must be open.
        ``values`` gets the stored bytes of every key written (what :meth:`delete_unchanged`
        later compares against). ``raw(index, key, value)``, tried first on every stored value,
        may rewrite the bytes itself (a change it can make without decoding the record) and
        return ``(new value, tag)`` (a new value None deletes the key, and its tag goes with
        it); on None ``fn`` gets the decoded record as usual.
        """
        results: list[Any] = [KEEP] * len(keys)
        written: list[bytes] = []
        with self._writers_lock:
            self._writers += 1
        try:
            # A request no bigger than one batch is one batch (what make_batches would return).
            batches = [range(len(keys))] if len(keys) <= self.batch_size else make_batches(keys, self.locks.n, self.batch_size)
            for batch in batches:
                taken = self.locks.acquire([keys[i] for i in batch])
                try:
                    self._modify_batch(txn, ns, keys, batch, fn, results, written, values, raw)
                finally:
                    self.locks.release(taken)
        finally:
            with self._writers_lock:
                self._writers -= 1
        if written:
            txn.on_commit(lambda: self.cache.invalidate(written))
        return results

    def _modify_batch(self, txn: WriteTxn, ns: bytes, keys: Sequence[int], batch: Sequence[int], fn: Modifier,
                      results: list[Any], written: list[bytes], values: dict[int, bytes] | None = None,
                      raw_fn: RawModifier | None = None) -> None:
        """One batch: one ``get_many``, the modifiers in request order, one ``put_many``.

        ``staged`` holds the batch's own new values, so a key repeated in the batch sees its
        earlier update (the transaction would too, but only after the writes)."""
        pack, off = _U64.pack, _SIGN
        dbkeys = [ns + pack(keys[i] + off) for i in batch]
        stored = txn.get_many(DB, dbkeys)  # never the cache: the txn may hold newer, uncommitted data
        staged: dict[bytes, bytes | None] = {}
        existed: set[bytes] = set()
        dropped: set[Any] = set()  # tags dropped in this batch: a run's blocks often change together
        decode, encode, tag_of = self.decode, self.encode, self._tag
        value: bytes | None
        for i, dbkey, raw in zip(batch, dbkeys, stored):
            if dbkey in staged:
                raw = staged[dbkey]
            elif raw is not None:
                existed.add(dbkey)
            hit = None if raw_fn is None or raw is None else raw_fn(i, keys[i], raw)
            if hit is not None:
                results[i] = value, tag = hit
                staged[dbkey] = value
            else:
                old = None if raw is None else decode(raw)
                tag = None if old is None or tag_of is None else tag_of(old)  # before fn mutates it
                new = fn(i, keys[i], old)
                results[i] = new
                if new is KEEP or (new is None and raw is None):
                    continue
                staged[dbkey] = value = None if new is None else encode(new)
            if values is not None and value is not None:
                values[keys[i]] = value
            if tag is not None and self._drop_tag is not None and tag not in dropped:
                dropped.add(tag)
                self._drop_tag(txn, ns, tag)
        if staged:
            # the values read above are the ones the writes replace
            txn.remember(DB, [(k, v) for k, v in zip(dbkeys, stored) if k in staged])
            txn.put_many(DB, [(k, v) for k, v in staged.items() if v is not None])
            txn.delete_many(DB, [k for k, v in staged.items() if v is None and k in existed])
            written.extend(staged)

    def delete_if(self, txn: WriteTxn, ns: bytes, keys: Sequence[int],
                  pick: Callable[[bytes], tuple[Any, Any] | None]) -> tuple[list[tuple[int, Any]], list[int]]:
        """Delete each of the distinct ``keys`` whose stored value ``pick`` takes: it returns
        ``(what to report, the record's tag)`` (the tag is dropped with it), or None to leave
        the record. Returns ``([(key, report)] of the deleted, the other keys with a record)``.

        :meth:`read_modify_write` with only a raw modifier that deletes, for in-line eviction:
        nothing is decoded past what ``pick`` reads, and no batch bookkeeping is done."""
        pack, off = _U64.pack, _SIGN
        dbkeys = [ns + pack(k + off) for k in keys]
        with self._writers_lock:
            self._writers += 1
        taken = self.locks.acquire(keys)
        try:
            stored = txn.get_many(DB, dbkeys)  # never the cache: the txn may hold newer, uncommitted data
            taken_keys: list[tuple[int, Any]] = []
            others: list[int] = []
            doomed: list[tuple[bytes, bytes]] = []
            tags: dict[Any, None] = {}
            for key, dbkey, raw in zip(keys, dbkeys, stored):
                if raw is None:
                    continue
                hit = pick(raw)
                if hit is None:
                    others.append(key)
                    continue
                taken_keys.append((key, hit[0]))
                doomed.append((dbkey, raw))
                if hit[1] is not None:
                    tags[hit[1]] = None
            if doomed:
                self._delete_read(txn, doomed)
                if self._drop_tag is not None:
                    for tag in tags:
                        self._drop_tag(txn, ns, tag)
        finally:
            self.locks.release(taken)
            with self._writers_lock:
                self._writers -= 1
        return taken_keys, others

    def delete_unchanged(self, txn: WriteTxn, ns: bytes, expected: Sequence[tuple[int, bytes]]) -> list[bool]:
        """Delete each key whose stored value is still byte for byte ``expected`` (a
        compare-and-delete that decodes nothing); per item, whether it was deleted.

        Equal bytes mean no write touched the record since that value was stored, so whatever
        the caller knew of it then still holds. The record's tag is not dropped: it was when
        that value was written, and a tag built since cannot include an unchanged record."""
        pack, off = _U64.pack, _SIGN
        dbkeys = [ns + pack(k + off) for k, _ in expected]
        with self._writers_lock:
            self._writers += 1
        taken = self.locks.acquire([k for k, _ in expected])  # ascending, as every batch takes them
        try:
            stored = txn.get_many(DB, dbkeys)
            same = [raw is not None and raw == value for raw, (_, value) in zip(stored, expected)]
            doomed = [(k, raw) for k, raw, ok in zip(dbkeys, stored, same) if ok]
            if doomed:
                self._delete_read(txn, doomed)
        finally:
            self.locks.release(taken)
            with self._writers_lock:
                self._writers -= 1
        return same

    def _delete_read(self, txn: WriteTxn, doomed: Sequence[tuple[bytes, bytes | None]]) -> None:
        """Delete ``(db key, value)`` records just read in ``txn`` (under their shard locks)."""
        txn.remember(DB, doomed)  # the values just read are the ones the deletes remove
        gone = [k for k, _ in doomed]
        txn.delete_many(DB, gone)
        txn.on_commit(lambda: self.cache.invalidate(gone))

    def put_records(self, txn: WriteTxn, ns: bytes, items: Sequence[tuple[int, Any]], absent: bool = False) -> None:
        """Blind upserts (new blocks, bulk loads, restores); invalidates like any write.

        ``absent``: the caller read every key in this same write block and found no record (so
        the savepoint's undo log need not read them again)."""
        dbkeys = [ns + i64(k) for k, _ in items]
        if absent:
            txn.remember(DB, [(k, None) for k in dbkeys])
        txn.put_many(DB, zip(dbkeys, (self.encode(r) for _, r in items)))
        txn.on_commit(lambda: self.cache.invalidate(dbkeys))

    # -- invariants -----------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the index's invariants (tests and ``stress_index``); call on a quiet index."""
        assert self._writers == 0, "check() called while writes are in progress"
        assert not self.locks.held(), f"shard locks held on a quiet index: {self.locks.held()}"
        assert len(self.cache) <= max(self.cache.capacity, 1), "search cache over capacity"
        with self.store.read() as view:
            for dbkey, cached in self.cache.items():
                stored = view.get(DB, dbkey)
                assert stored == cached, f"stale cache entry for {dbkey.hex()}"
            for dbkey, value in view.scan(DB):
                assert len(dbkey) == 16, f"bad block key width {dbkey.hex()}"
                # An older format need not come back byte for byte, but what it becomes must.
                again = self.encode(self.decode(value))
                assert self.encode(self.decode(again)) == again, f"value does not round-trip at {dbkey.hex()}"
                if self._check_value is not None:
                    self._check_value(value)

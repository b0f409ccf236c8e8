"""Everything that takes copies out of service: ``remove_cache``, ``trim_cache``, eviction, lost
blocks (found by a storage or reported by a client) and purges of removed instances.

A copy leaves service by one CAS, :func:`mark_deleting`: it becomes ``deleting`` (no query returns
it again) and its free is scheduled on the deleter after the group's grace delay, so a reader that
already holds its URIs still finds the bytes.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from kvcm.backends.metastore.base import WriteTxn, from_i64
from kvcm.backends.storage.base import SlotStorage
from kvcm.cache.deleter import DB as DELETES
from kvcm.cache.deleter import schedule_many
from kvcm.cache.keys import derive_keys
from kvcm.cache.masks import BlockMask, check_mask, unmasked_indices
from kvcm.cache.meta_index import KEEP, namespace
from kvcm.cache.placement import InstanceView
from kvcm.cache.record_codec import Location, Record, Status, decode, mark_sole, sole_serving
from kvcm.cache.room import Victim
from kvcm.cache.state import CacheState
from kvcm.cache.usage import FreeKey, Key
from kvcm.errors import InvalidArgument, NotFound
from kvcm.proto.wire import Encodable

log = logging.getLogger("kvcm.cache.removal")

TRIM_STRATEGIES = ("remove_all_cache", "remove_all_meta", "timestamp")

Doomed = dict[str, list[bytes]]  # storage -> addresses of copies dropped in a transaction, not yet freed


class _Marking:
    """What one :func:`mark_deleting` call marks: the read-modify-write callbacks over its
    records, and the copies, keys and bytes they marked."""

    __slots__ = ("dead", "freed", "gone", "marked", "marked_keys", "now", "only", "serving_only", "storage_type")

    def __init__(self, now: float, serving_only: bool, storage_type: str | None,
                 only: Callable[[int, Location], bool] | None, marked_keys: list[int] | None) -> None:
        self.now = now
        self.serving_only = serving_only
        self.storage_type = storage_type
        self.only = only
        self.marked_keys = marked_keys
        self.marked: list[tuple[int, Location]] = []
        self.gone: list[int] = []  # keys with no serving copy left
        self.dead: dict[int, int] = {}  # key -> copies, for records every copy of which this call marked
        self.freed = [0, 0]  # serving bytes, writing bytes

    def _picked(self, key: int, loc: Location) -> bool:
        if loc.status == Status.DELETING or (self.serving_only and loc.status != Status.SERVING):
            return False
        if self.storage_type is not None and loc.type != self.storage_type:
            return False
        return self.only is None or self.only(key, loc)

    def modify(self, _: int, key: int, record: Record | None) -> Any:
        if record is None:
            return KEEP
        marked = self.marked
        had = any(x.status == Status.SERVING for x in record.locs)
        before = len(marked)
        for loc in record.locs:
            if not self._picked(key, loc):
                continue
            if loc.status == Status.SERVING:
                self.freed[0] += loc.nbytes
            elif loc.status == Status.WRITING:
                self.freed[1] += loc.nbytes
            loc.status = Status.DELETING
            marked.append((key, loc))
        if had and not any(x.status == Status.SERVING for x in record.locs):
            self.gone.append(key)
        if not marked or marked[-1][0] != key:
            return KEEP
        record.updated = self.now
        if len(marked) - before == len(record.locs):
            self.dead[key] = len(record.locs)  # the deleter may then drop it without decoding it
        if self.marked_keys is not None:
            self.marked_keys.append(key)
        return record

    def sole(self, _: int, key: int, value: bytes) -> tuple[bytes, int | None] | None:
        """The common eviction victim, a record of one serving copy, without decoding it
        (the same result as :meth:`modify`)."""
        hit = mark_sole(value, self.now)
        if hit is None or (self.storage_type is not None and hit[1].type != self.storage_type):
            return None
        loc = hit[1]
        self.freed[0] += loc.nbytes
        self.marked.append((key, loc))
        self.gone.append(key)
        self.dead[key] = 1
        if self.marked_keys is not None:
            self.marked_keys.append(key)
        return hit[0], hit[2]


def mark_deleting(s: CacheState, txn: WriteTxn, instance_id: str, group: str, keys: Sequence[int], delay: float,
                  serving_only: bool = False, storage_type: str | None = None,
                  only: Callable[[int, Location], bool] | None = None,
                  marked_keys: list[int] | None = None) -> tuple[int, int]:
    """CAS copies to ``deleting``, schedule their free and count them as being freed;
    ``(copies marked, serving bytes)``.

    ``serving_only`` (eviction) never touches ``writing`` copies; ``only(key, location)``
    picks the copies to mark (lost ones); ``marked_keys`` gets each key with a copy marked."""
    now = s.clock()
    m = _Marking(now, serving_only, storage_type, only, marked_keys)
    values: dict[int, bytes] = {}
    s.index.read_modify_write(txn, namespace(instance_id), list(dict.fromkeys(keys)), m.modify, values,
                              raw=m.sole if only is None else None)
    freeing: dict[FreeKey, int] = defaultdict(int)
    schedule_many(txn, now + delay, group, instance_id, m.marked, {k: (values[k], n) for k, n in m.dead.items()})
    for _, loc in m.marked:
        freeing[(group, loc.type)] += loc.nbytes
    s.being_freed.add(txn, freeing)
    s.inflight.release(txn, instance_id, 0, m.freed[1])
    gone = m.gone
    if gone:
        txn.on_commit(lambda: s.listeners.removed(instance_id, gone))
    return len(m.marked), m.freed[0]


def evict_inline(s: CacheState, txn: WriteTxn, group: str, victims: Sequence[Victim], marked: list[Victim],
                 dropped: dict[str, int], doomed: Doomed, usage: dict[Key, list[int]]) -> int:
    """In-line eviction (:mod:`kvcm.cache.room`): take the serving copy of each victim's type
    out of service in the request's transaction ``txn``.

    With a grace delay the copy is marked ``deleting`` and freed after it, as every removal is.
    Without one (``delay_before_delete_ms = 0``) a record whose only copy is that serving one
    is dropped in ``txn`` (:func:`drop_sole`), and its slots go to the write's new blocks or are
    freed after the commit: the same outcome as the deleter's next poll, minus the ``deleting``
    state, the delete entry and the deleter's second transaction. Other records are marked as
    with a delay.

    Victims of instances outside ``group`` are skipped (evicting them would free nothing this
    group counts); so are victims with no serving copy of that type left. ``marked`` gets the
    victims taken, as they are taken (so an abort half-way gives back exactly those);
    ``dropped`` gets the bytes dropped per type (no longer in the group's usage), ``doomed`` the
    dropped copies and ``usage`` their usage deltas (see :func:`drop_sole`). Returns the serving
    bytes taken."""
    delay = s.delay(group)
    by_instance: dict[tuple[str, str], list[int]] = defaultdict(list)
    for instance_id, key, kind in dict.fromkeys(victims):
        if _group_of(s, instance_id) == group:
            by_instance[(instance_id, kind)].append(key)
    freed = 0
    for (instance_id, kind), keys in by_instance.items():
        done: list[int] = []
        if delay == 0:
            nbytes, keys = drop_sole(s, txn, instance_id, group, keys, kind, done, doomed, usage)
            freed += nbytes
            if nbytes:
                dropped[kind] = dropped.get(kind, 0) + nbytes
        freed += mark_deleting(s, txn, instance_id, group, keys, delay, serving_only=True, storage_type=kind,
                               marked_keys=done)[1] if keys else 0
        marked.extend((instance_id, key, kind) for key in done)
        if done and s.listeners:
            txn.on_commit(_tell_evicted(s, instance_id, done, delay))
    return freed


def drop_sole(s: CacheState, txn: WriteTxn, instance_id: str, group: str, keys: Sequence[int], storage_type: str,
              dropped_keys: list[int], doomed: Doomed, usage: dict[Key, list[int]]) -> tuple[int, list[int]]:
    """Drop, in ``txn``, each record of ``keys`` whose only copy is a serving one of
    ``storage_type``; ``(bytes dropped, the other keys that have a record)``. ``dropped_keys``
    gets the keys dropped, ``doomed`` their copies' addresses per storage, ``usage`` their usage
    deltas: the caller (a write making room) may give some of those slots to its new blocks
    (they are then never freed), hands the rest to :func:`free_after_commit` once ``txn``
    commits (the deleter frees them at its next wake-up, ``cache.delete_poll_ms``), and adds
    the deltas to the usage book in ``txn`` with its own (they often cancel).

    Freeing after the commit keeps the deleter's rule that no metadata names a freed slot: the
    record is gone before its bytes are, and a slot goes back to its storage only after both
    (a crash in between leaves bytes nothing names, which the storage's start-up reserve gives
    back). Callers: eviction without a grace delay only."""
    def pick(value: bytes) -> tuple[Location, int | None] | None:
        hit = sole_serving(value)
        return None if hit is None or hit[0].type != storage_type else hit

    taken, other = s.index.delete_if(txn, namespace(instance_id), list(dict.fromkeys(keys)), pick)
    locs: list[Location] = [loc for _, loc in taken]
    gone = [key for key, _ in taken]
    if not locs:
        return 0, other
    nbytes = sum(loc.nbytes for loc in locs)
    delta = usage.setdefault((group, instance_id, storage_type), [0, 0])
    delta[0] -= nbytes
    delta[1] -= len(locs)
    for loc in locs:
        doomed.setdefault(loc.storage, []).append(loc.addr)
    dropped_keys.extend(gone)
    txn.on_commit(lambda: s.listeners.removed(instance_id, gone))
    return nbytes, other


def free_after_commit(s: CacheState, doomed: Doomed) -> None:
    """Hand the dropped copies to the deleter: it frees them at its next wake-up, in one batch
    with the others (formatting their URIs there, off the request path)."""
    for name, addrs in doomed.items():
        if addrs:
            s.deleter.free_later(name, addrs)


def _tell_evicted(s: CacheState, instance_id: str, keys: list[int], delay: float) -> Callable[[], None]:
    return lambda: s.listeners.evicted(instance_id, keys, delay)


def _group_of(s: CacheState, instance_id: str) -> str | None:
    group = s.known.get(instance_id)
    if group is not None:
        return group
    try:
        return s.instance(instance_id).group
    except (NotFound, InvalidArgument):
        return None


def _request_keys(s: CacheState, instance_id: str, block_keys: Sequence[int] | None,
                  token_ids: Sequence[int] | None, mask: BlockMask | None) -> tuple[InstanceView, list[int]]:
    """The instance and the unmasked keys of a destructive request."""
    inst = s.instance(instance_id)
    keys = derive_keys(block_keys, token_ids, inst.block_size)
    mask = check_mask(mask, len(keys), destructive=True)
    return inst, [keys[i] for i in unmasked_indices(mask, len(keys))]


def remove_cache(s: CacheState, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                 mask: BlockMask | None) -> dict[str, Encodable]:
    """Mark every copy of the unmasked keys ``deleting`` now; the deleter frees them after
    the group's ``delay_before_delete_ms`` (readers that already hold URIs get that grace)."""
    inst, keys = _request_keys(s, instance_id, block_keys, token_ids, mask)
    with s.store.write() as txn:
        marked, _ = mark_deleting(s, txn, inst.instance_id, inst.group, keys, s.delay(inst.group))
    return {"removed": marked}


def trim_cache(s: CacheState, instance_id: str, strategy: str, begin_us: int = 0, end_us: int = 0) -> dict[str, Encodable]:
    """``remove_all_cache``: every block, freed after the delay; ``remove_all_meta``: forget
    the metadata now (space is released, data left as is); ``timestamp``: blocks last
    modified in ``[begin_timestamp, end_timestamp)`` (wall-clock µs, end 0 = no bound)."""
    inst = s.instance(instance_id)
    if strategy not in TRIM_STRATEGIES:
        raise InvalidArgument(f"strategy: {strategy!r} is not one of {', '.join(TRIM_STRATEGIES)}")
    _check_trim_range(strategy, begin_us, end_us)
    with s.store.write() as txn:
        items = list(s.index.scan(txn, inst.ns))
        if strategy == "remove_all_meta":
            return {"removed": _forget_all(s, txn, inst, items)}
        keys = [k for k, v in items if strategy == "remove_all_cache" or _in_range(v, begin_us, end_us)]
        marked, _ = mark_deleting(s, txn, inst.instance_id, inst.group, keys, s.delay(inst.group))
        if strategy == "remove_all_cache":
            txn.on_commit(lambda: s.listeners.cleared(inst.instance_id))
    return {"removed": marked}


def _forget_all(s: CacheState, txn: WriteTxn, inst: InstanceView, items: list[tuple[int, bytes]]) -> int:
    released: dict[str, list[str]] = defaultdict(list)
    deltas: dict[Key, list[int]] = defaultdict(lambda: [0, 0])
    deleting: dict[tuple[int, str], Location] = {}
    writing = 0
    for key, value in items:
        for loc in decode(value).locs:
            released[loc.storage].extend(loc.uris())
            writing += loc.nbytes if loc.status == Status.WRITING else 0
            if loc.status == Status.DELETING:
                deleting[(key, loc.id)] = loc
            deltas[(inst.group, inst.instance_id, loc.type)][0] -= loc.nbytes
            deltas[(inst.group, inst.instance_id, loc.type)][1] -= 1
    s.index.read_modify_write(txn, inst.ns, [k for k, _ in items], lambda i, k, r: None)
    s.usage_book.add(txn, dict(deltas))
    s.inflight.release(txn, inst.instance_id, 0, writing)
    _forget_deletes(s, txn, inst.instance_id, deleting)

    def release() -> None:
        for name, uris in released.items():
            backend = s.pool.get(name)
            if backend is not None:
                backend.release(uris)
        s.listeners.cleared(inst.instance_id)

    txn.on_commit(release)
    return sum(-d[1] for d in deltas.values())


def _forget_deletes(s: CacheState, txn: WriteTxn, instance_id: str, deleting: dict[tuple[int, str], Location]) -> None:
    """Drop the pending deletes of an instance whose records were just forgotten, and their
    being-freed bytes: every pending delete then still names a ``deleting`` location, which is
    what lets the counter be rebuilt from the ``deletes`` database alone. A scan of the pending
    deletes, once per ``remove_all_meta``."""
    doomed: list[bytes] = []
    freeing: dict[FreeKey, int] = defaultdict(int)
    for entry, value in txn.scan(DELETES):
        fields = msgpack.unpackb(value)
        if fields[1] != instance_id:
            continue
        doomed.append(entry)
        loc = deleting.get((fields[2], fields[3]))
        if loc is not None:
            freeing[(fields[0], loc.type)] -= loc.nbytes
    txn.delete_many(DELETES, doomed)
    s.being_freed.add(txn, freeing)


def evict(s: CacheState, instance_id: str, keys: list[int], storage_type: str | None = None) -> int:
    """Reclaimer: ``serving -> deleting`` by CAS (never ``writing``), freed after the group's
    delay. Returns the bytes reclaimed."""
    group = s.known.get(instance_id) or s.instance(instance_id).group
    delay = s.delay(group)
    with s.store.write() as txn:
        _, freed = mark_deleting(s, txn, instance_id, group, keys, delay, serving_only=True, storage_type=storage_type)
        if freed and s.listeners:
            txn.on_commit(lambda: s.listeners.evicted(instance_id, list(keys), delay))
    return freed


def purge_instance(s: CacheState, instance_id: str) -> int:
    """Schedule the free of every copy of a removed instance (no delay: nobody can read them)."""
    group = s.known.get(instance_id, "")
    ns = namespace(instance_id)
    marked = 0
    for chunk in s.index.chunks(ns):
        with s.store.write() as txn:
            marked += mark_deleting(s, txn, instance_id, group, [k for k, _ in chunk], 0.0)[0]
    s.listeners.cleared(instance_id)
    return marked


# -- lost blocks ----------------------------------------------------------------------------------


def mark_lost(s: CacheState, storage: str, lost: Callable[[list[str]], set[str]], source: str) -> int:
    """Every copy on ``storage`` with a URI ``lost(uris)`` names (its bytes are gone) becomes
    ``deleting`` at once: no query returns it again, its key is writable again, and the
    deleter releases its slots and usage. One pass over every record (rare: only when a
    storage reports damage). Returns the copies marked, counted in ``kvcm_blocks_lost_total``."""
    hits: dict[bytes, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for chunk in s.all_chunks():
        for dbkey, value in chunk:
            for loc in decode(value).locs:
                if loc.storage == storage and loc.status != Status.DELETING and lost(loc.uris()):
                    hits[dbkey[:8]][from_i64(dbkey[8:])].add(loc.id)
    owners = s.owners()
    marked = 0
    for ns, by_key in hits.items():
        group, instance_id = owners.get(ns, ("", ""))
        if not instance_id:
            continue
        with s.store.write() as txn:
            marked += mark_deleting(s, txn, instance_id, group, list(by_key), 0.0, only=_picked(by_key))[0]
    if marked:
        log.warning("storage %r: %d cop(ies) lost their bytes (%s); no longer served", storage, marked, source)
        s.lost.add(source, marked)
    return marked


def report_lost(s: CacheState, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                mask: BlockMask | None) -> dict[str, Encodable]:
    """A client could not read these blocks (``report_lost``): their serving copies become
    ``deleting`` now (no grace delay: the bytes are bad for every reader) and count as lost."""
    inst, keys = _request_keys(s, instance_id, block_keys, token_ids, mask)
    with s.store.write() as txn:
        marked, _ = mark_deleting(s, txn, inst.instance_id, inst.group, keys, 0.0, serving_only=True)
        if marked:
            txn.on_commit(lambda: s.lost.add("client", marked))
    return {"lost": marked}


def scan_lost(s: CacheState) -> int:
    """Ask every storage that can look (``rescan``) whether containers vanished or shrank,
    and mark the copies in them lost. Deleter thread, every ``cache.lost_scan_s``."""
    marked = 0
    for name in s.pool.names():
        backend = s.pool.get(name)
        if not isinstance(backend, SlotStorage) or not backend.rescan():
            continue
        marked += mark_lost(s, name, backend.lost, "scan")
    return marked


def _picked(by_key: dict[int, set[str]]) -> Callable[[int, Location], bool]:
    """A :func:`mark_deleting` filter: the copies whose ids ``by_key`` lists for their key."""
    return lambda key, loc: loc.id in by_key.get(key, ())


def _check_trim_range(strategy: str, begin_us: int, end_us: int) -> None:
    """A trim's range only ever narrows it: a range that is inverted, negative, empty for
    ``timestamp`` or given to another strategy (which would ignore it) is refused, never read
    as "every block"."""
    if begin_us < 0 or end_us < 0:
        raise InvalidArgument("begin_timestamp/end_timestamp: must not be negative")
    if strategy != "timestamp":
        if begin_us or end_us:
            raise InvalidArgument(f"begin_timestamp/end_timestamp: only for strategy 'timestamp', not {strategy!r}")
        return
    if not begin_us and not end_us:
        raise InvalidArgument("begin_timestamp/end_timestamp: strategy 'timestamp' needs at least one of them "
                              "(remove_all_cache removes every block)")
    if end_us and end_us <= begin_us:
        raise InvalidArgument("begin_timestamp/end_timestamp: need begin < end (end 0 = open)")


def _in_range(value: bytes, begin_us: int, end_us: int) -> bool:
    updated_us = int(decode(value).updated * 1e6)
    return updated_us >= begin_us and (not end_us or updated_us < end_us)

"""Two-phase writes: ``start_write_cache`` / ``finish_write_cache`` and session expiry (Tair KVCM's
semantics), without Tair's leaks: no orphan ``writing`` records or storage space after a failure.

Everything one request changes (block records, usage, the session, scheduled deletes) happens in
the caller's write transaction; under group commit that is a child of the batch's transaction,
committed before any reply. Storage space allocated for a request is released again whenever
its changes do not commit: the request fails, or its whole group aborts (``txn.on_abort``).

* A key counts as existing (masked in the reply) if it has a ``writing``, ``serving`` or
  ``deleting`` copy on a usable storage — or if it appeared earlier in the same request, so a
  duplicate key is allocated once (Tair allocated it twice and orphaned one copy).
* Concurrent writers of one key: the second sees the first's ``writing`` copy (committed, or
  uncommitted in the same group) and gets it masked, so at most one ``writing`` copy exists.
* ``finish_write_cache`` validates instance, session and mask before consuming the session;
  ``writing -> serving`` is a compare-and-set that never resurrects a ``deleting`` copy;
  failed copies become ``deleting`` and are freed by the deleter at once.
* In-flight writes are bounded per instance (``cache.max_open_sessions_per_instance``,
  ``cache.max_writing_bytes_per_instance``): a start past either cap is ``QUOTA_EXCEEDED``
  naming the cap, checked before anything is allocated. Because of it, the ``writing`` bytes
  that abandoned sessions hold against a group quota can never exceed the cap, whatever the
  requested lifetime (itself capped by ``cache.max_write_timeout_seconds``).
* Group quotas admit ``used - being_freed + needed <= quota`` (:mod:`kvcm.cache.placement`). A
  start that does not fit makes room in-line when the manager has a room maker
  (:mod:`kvcm.cache.room`): victims are marked ``deleting`` in the request's own transaction,
  given back to the maker if it does not commit; only if that cannot cover the need is it
  ``QUOTA_EXCEEDED``, saying what is ``writing``, what is being freed and why.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.backends.metastore.base import WriteTxn, i64
from kvcm.backends.storage.base import SlotStorage, StorageBackend, is_slot_storage
from kvcm.cache.blockcount import bound_blocks, evicts_inline
from kvcm.cache.deleter import schedule
from kvcm.cache.keys import derive_keys
from kvcm.cache.locations import address, addresses, is_compact, pack_wire, persist, remember, skeleton_of, wire_uris
from kvcm.cache.locations import wire as wire_of
from kvcm.cache.masks import BlockMask, success_flags, write_mask
from kvcm.cache.meta_index import KEEP
from kvcm.cache.placement import GroupView, InstanceView, Target, shortfall, write_targets
from kvcm.cache.record_codec import RUNS_DB, Location, Record, Status, encode_run
from kvcm.cache.removal import Doomed, evict_inline, free_after_commit
from kvcm.cache.room import RoomMaker, Victim
from kvcm.cache.sessions import Session, new_session_id, random_id
from kvcm.cache.state import CacheState
from kvcm.cache.usage import FreeKey, Key, Usage
from kvcm.errors import CapacityError, Code, InvalidArgument, NotFound
from kvcm.proto.wire import Encodable, EncodableMap, Raw, pack_array_raw, pack_map_raw

log = logging.getLogger("kvcm.cache.writes")

NOTHING_TO_WRITE_TIMEOUT = 10.0  # Tair: a session with no new blocks lives 10 s


def _location_id(taken: set[str]) -> str:
    """8 random ``[a-z0-9]`` characters, unique within the block (Tair's format)."""
    while True:
        lid = random_id(8)
        if lid not in taken:
            return lid


def start_write_cache(
    s: CacheState,
    instance_id: str,
    block_keys: Sequence[int] | None,
    token_ids: Sequence[int] | None,
    spec_group_names: Sequence[str] | None,
    timeout: float | None,
) -> Raw:
    inst = s.instance(instance_id)
    keys = derive_keys(block_keys, token_ids, inst.block_size)
    specs = inst.specs_for(spec_group_names, len(keys))
    lifetime = _timeout(s, timeout)
    # join: under the dispatcher each request already runs in its own savepoint, and every
    # error here propagates out of it.
    with s.store.write(join=True) as txn:
        exists, records = _existing(s, txn, inst, keys)
        new = [i for i, there in enumerate(exists) if not there]
        mask = write_mask(exists)
        if not new:
            _check_caps(s, instance_id, 0)
            session = s.sessions.create(txn, instance_id, inst.group, [], [], NOTHING_TO_WRITE_TIMEOUT)
            _tell_started(s, txn, instance_id, session.id, keys, token_ids, mask, spec_group_names, timeout)
            return _reply(session.id, mask, [])
        needed = sum(size for i in new for _, size in specs[i])
        _check_caps(s, instance_id, needed)
        usage: dict[Key, list[int]] = {}  # the usage deltas of what evicting in-line drops, added with the new blocks'
        target, uris, reused = _allocate(s, txn, inst, keys, [specs[i] for i in new], needed, usage)
        # The space is taken now, outside the transaction: give it back if the request fails,
        # and also if the request succeeds but its group never commits (a leak Tair has, in its batched form).
        # Not the slots handed over by victims: an abort brings those victims back.
        taken = [u for u, addr in zip(uris, reused) if addr is None]
        txn.on_abort(lambda: _release(s, target.storage, taken))
        session, wires = _record_new(s, txn, inst, keys, new, [records[i] is None for i in new], specs, target,
                                     uris, reused, lifetime, usage)
        _tell_started(s, txn, instance_id, session.id, keys, token_ids, mask, spec_group_names, timeout)
    return _reply(session.id, mask, wires)


def _tell_started(s: CacheState, txn: WriteTxn, instance_id: str, session_id: str, keys: list[int],
                  token_ids: Sequence[int] | None, mask: EncodableMap, spec_group_names: Sequence[str] | None,
                  timeout: float | None) -> None:
    if s.listeners:
        txn.on_commit(lambda: s.listeners.write_started(instance_id, session_id, keys, token_ids, mask,
                                                        spec_group_names, timeout))


def _timeout(s: CacheState, timeout: float | None) -> float:
    """Refused, not clamped, past the cap: a client told its session lives an hour would
    write for an hour and then find the session gone; the error says so at once."""
    if timeout is None or timeout == 0:
        return s.default_write_timeout
    if not 0 < timeout <= s.max_write_timeout:
        raise InvalidArgument(f"write_timeout_seconds: must be in (0, {s.max_write_timeout:g}] "
                              f"(cache.max_write_timeout_seconds), got {timeout}")
    return float(timeout)


def _check_caps(s: CacheState, instance_id: str, needed: int) -> None:
    """Refuse a start past the instance's in-flight caps (holds of the uncommitted group
    commit included, so a batch cannot overshoot them)."""
    sessions, writing = s.inflight.of(instance_id)
    if sessions >= s.max_open_sessions:
        _refuse(s, "cache.max_open_sessions_per_instance",
                f"instance {instance_id!r} has {sessions} write sessions open, the cap "
                f"(cache.max_open_sessions_per_instance) is {s.max_open_sessions}")
    if writing + needed > s.max_writing_bytes:
        _refuse(s, "cache.max_writing_bytes_per_instance",
                f"instance {instance_id!r} has {writing} bytes in writing and asks for {needed} more, the cap "
                f"(cache.max_writing_bytes_per_instance) is {s.max_writing_bytes}")


def _refuse(s: CacheState, cap: str, message: str) -> None:
    s.inflight.refused[cap] = s.inflight.refused.get(cap, 0) + 1
    raise CapacityError(message + "; finish the open sessions (or let them expire) first", Code.QUOTA_EXCEEDED)


def _existing(s: CacheState, txn: WriteTxn, inst: InstanceView, keys: list[int]) -> tuple[list[bool], list[Record | None]]:
    """Per request key: already present (any live copy on a usable storage) or a repeat; and
    the record each key has in ``txn`` (None: no record at all)."""
    unusable = s.pool.unusable
    seen: set[int] = set()
    out: list[bool] = []
    records = s.records_in(txn, inst.ns, keys)
    for record, key in zip(records, keys):
        there = key in seen or (record is not None and any(loc.storage not in unusable for loc in record.locs))
        seen.add(key)
        out.append(there)
    return out, records


def _allocate(s: CacheState, txn: WriteTxn, inst: InstanceView, keys: list[int],
              specs: list[tuple[tuple[str, int], ...]], needed: int, usage: dict[Key, list[int]]
              ) -> tuple[Target, list[list[str]], list[bytes | None]]:
    """URIs per new block (one per spec of that block), on the first target that can take them,
    and per block the address of the victim's slots it took over (None: allocated);
    ``keys``: every key of the request (never evicted to make room for it); ``usage`` gets the
    usage deltas of the copies dropped to make room (the caller adds them to the usage book)."""
    group, own = s.group_view(inst.group), frozenset((inst.instance_id, k) for k in keys)
    record = s.registry.get_group(inst.group)
    bound_blocks(s, txn, record, len(specs), own, usage)
    spare: Doomed = {}  # copies the in-line eviction dropped: their slots may take the new blocks
    targets = _targets(s, txn, group, needed, own, spare, usage, evicts_inline(record))
    last: CapacityError | None = None
    for attempt in range(2):
        for target in targets:
            try:
                return (target, *_allocate_on(s, target, specs, spare.get(target.storage)))
            except CapacityError as exc:  # full or closed: fall over to the next candidate
                last = exc
        # Every target full: the slots of copies dropped by earlier evictions may still wait for
        # the deleter's next wake-up; freed now, they take this write.
        if attempt or not s.deleter.free_queued():
            break
    assert last is not None
    raise last


def _targets(s: CacheState, txn: WriteTxn, group: GroupView, needed: int,
             spare: frozenset[tuple[str, int]], doomed: Doomed, usage: dict[Key, list[int]], inline: bool
             ) -> list[Target]:
    """:func:`write_targets` under the group's quotas, making room in-line when they are met
    and a room maker is set (:mod:`kvcm.cache.room`); ``doomed`` gets the copies it dropped,
    ``usage`` their usage deltas."""
    if not (group.capacity or group.type_capacity):
        # Usage only matters to a group with a quota (the scan is a fifth of an unlimited write).
        return write_targets(group, needed, 0, {}, {}, s.pool.storage_type, s.pool.usable)
    used_total, used_by_type = Usage.group_used(txn, group.name)

    def admit() -> list[Target] | CapacityError:
        """The targets, or the quota refusal (other errors propagate)."""
        try:
            return write_targets(group, needed, used_total, used_by_type, s.being_freed.of(group.name),
                                 s.pool.storage_type, s.pool.usable)
        except CapacityError as exc:
            if exc.code != Code.QUOTA_EXCEEDED:
                raise
            return exc

    maker = s.room_maker if inline else None
    why = ("off for this group (used_percentage above 1 and no used_bytes: never reclaimed by share)" if not inline
           else "no room maker (in-line eviction off): the reclaimer's next round frees space")
    if maker is not None:
        eviction = _InlineEviction(s, txn, maker, group, needed, used_total, used_by_type, spare, doomed, usage)
        needs = eviction.missing()
        if needs:  # it does not fit as is (what admit() would refuse): make room first
            why = eviction.run(needs)
            used_total, used_by_type = eviction.used()
        else:  # it fits, or evicting cannot help (the refusal below, if any, says which)
            why = eviction.nothing_to_evict()
    admitted = admit()
    if not isinstance(admitted, CapacityError):
        return admitted
    refused = admitted
    writing = sum(s.inflight.of(i.instance_id)[1] for i in s.registry.list_instances(group.name))
    raise CapacityError(f"{refused}; {writing} bytes of the group are writing; in-line eviction: {why}",
                        Code.QUOTA_EXCEEDED) from None


INLINE_ROUNDS = 3  # make_room calls per request: later ones replace victims the maker's lagging view got wrong


@dataclass
class _InlineEviction:
    """One request's in-line eviction: ask the maker for victims and mark them ``deleting`` in
    ``txn`` until the write fits, the victims limit is reached, or the maker has nothing more.

    Marked victims go back to the maker if ``txn`` does not commit. Victims in ``spare`` (the
    request's own keys) are never marked: evicting the stored prefix a write builds on would
    leave the new blocks unreachable by ``prefix_match``; they go back to the maker when the
    request is done asking (not earlier, or it would offer them again).

    Copies dropped without a grace delay go to ``doomed``; the write may take over their slots
    (:func:`_reuse`), and what it leaves is handed to the deleter once ``txn`` commits."""

    s: CacheState
    txn: WriteTxn
    maker: RoomMaker
    group: GroupView
    needed: int
    used_total: int
    used_by_type: dict[str, int]
    spare: frozenset[tuple[str, int]]
    doomed: Doomed
    usage: dict[Key, list[int]]  # the dropped copies' usage deltas: the write adds them with its own
    marked: list[Victim] = field(default_factory=list)
    spared: list[Victim] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)  # type -> bytes dropped (out of the usage)

    def run(self, needs: dict[str, int]) -> str:
        """Make room for what :meth:`missing` returned (``needs``); returns why the write
        still does not fit ("" if it does)."""
        marked, maker, doomed, s = self.marked, self.maker, self.doomed, self.s
        self.txn.on_abort(lambda: maker.give_back(list(marked)) if marked else None)
        self.txn.on_commit(lambda: free_after_commit(s, doomed) if doomed else None)
        try:
            return self._rounds(needs)
        finally:
            if self.spared:
                try:
                    maker.give_back(self.spared)
                except Exception:
                    log.exception("in-line eviction: the room maker failed to take victims back")

    def used(self) -> tuple[int, dict[str, int]]:
        """The group's usage in ``txn`` now: as read before, less what was dropped."""
        by_type = dict(self.used_by_type)
        for kind, nbytes in self.dropped.items():
            by_type[kind] = by_type.get(kind, 0) - nbytes
        return self.used_total - sum(self.dropped.values()), by_type

    def missing(self) -> dict[str, int]:
        used_total, used_by_type = self.used()
        return shortfall(self.group, self.needed, used_total, used_by_type,
                         self.s.being_freed.of(self.group.name), self.s.pool.storage_type, self.s.pool.usable)

    def nothing_to_evict(self) -> str:
        return f"nothing to evict for: {self.needed} bytes do not fit the quota even in an empty group"

    def _rounds(self, needs: dict[str, int]) -> str:
        why = ""
        for _ in range(INLINE_ROUNDS):
            left = self.s.inline_limit - len(self.marked)
            if left <= 0:
                why = f"{len(self.marked)} victims marked, the most per request (reclaim.inline_max_blocks)"
                break
            try:
                room = self.maker.make_room(self.group.name, needs, left)
            except Exception:  # a broken maker must not break writes: refuse as without one
                log.exception("in-line eviction: the room maker failed for group %r", self.group.name)
                why = "the room maker failed (see the log)"
                break
            offered = room.victims[:left]
            self.spared.extend(v for v in offered if (v[0], v[1]) in self.spare)
            freed = evict_inline(self.s, self.txn, self.group.name,
                                 [v for v in offered if (v[0], v[1]) not in self.spare], self.marked, self.dropped,
                                 self.doomed, self.usage)
            why = room.why
            if set(needs) == {""} and freed >= needs[""]:
                return ""  # only the group total was short, and it is covered (what missing() would say)
            needs = self.missing()
            if not needs:
                return ""
            if not offered:
                break  # the maker has nothing more
        return f"{len(self.marked)} victim(s) marked, {_needs(needs)} still missing" + (f": {why}" if why else "")


def _needs(needs: dict[str, int]) -> str:
    return ", ".join(f"{n} bytes of {kind or 'any type'}" for kind, n in sorted(needs.items()))


def _allocate_on(s: CacheState, target: Target, specs: list[tuple[tuple[str, int], ...]],
                 spare: list[bytes] | None = None) -> tuple[list[list[str]], list[bytes | None]]:
    """One backend call per distinct spec size (Tair's "merge" mode when all sizes are equal),
    spec-major order; all or nothing. Blocks that take over a dropped victim's slots from
    ``spare`` (:func:`_reuse`) need no allocation: per block, the address taken over or None
    (such a block's URIs are left empty: its wire and address come from that address)."""
    backend = s.pool.get(target.storage)
    if backend is None:
        raise CapacityError(f"storage {target.storage!r} is not open", Code.NO_STORAGE_AVAILABLE)
    out: list[list[str]] = [[""] * len(s) for s in specs]
    reused: list[bytes | None] = _reuse(backend, target, specs, spare) if spare else [None] * len(specs)
    slots: dict[int, list[tuple[int, int]]] = defaultdict(list)  # size -> [(block, spec position)]
    width = max(len(s) for s in specs)
    for pos in range(width):
        for block, block_specs in enumerate(specs):
            if pos < len(block_specs) and reused[block] is None:
                slots[block_specs[pos][1]].append((block, pos))
    done: list[str] = []
    try:
        for size, places in slots.items():
            uris = backend.allocate(len(places), size)
            done.extend(uris)
            for (block, pos), uri in zip(places, uris):
                out[block][pos] = uri
    except BaseException:
        _release(s, target.storage, done)
        if spare is not None:  # not taken after all: freed after the commit, as if never offered
            spare.extend(addr for addr in reused if addr is not None)
        raise
    return out, reused


def _reuse(backend: StorageBackend, target: Target, specs: list[tuple[tuple[str, int], ...]], spare: list[bytes]
           ) -> list[bytes | None]:
    """Hand slots of copies this transaction dropped (``spare``: addresses on ``target``'s
    storage) straight to new blocks of the same layout; per block the address taken over, or
    None. The slot stays reserved throughout: it is not freed and allocated again, nor its URIs
    formatted and parsed back, nor its hole punched (the writer overwrites it). Safe because the
    same transaction drops the victim's record and names the slot again: if it commits, only
    the new block names the slot; if not, the victim does, and no release gives the slot back
    (:func:`start_write_cache`). Only for storages that can vouch for a slot (``reusable``:
    ``file``, ``shm``), and never across a grace delay (only copies dropped without one are in
    ``spare``)."""
    reused: list[bytes | None] = [None] * len(specs)
    if not is_slot_storage(backend):
        return reused
    by_layout: dict[tuple[int, tuple[str, ...]], list[bytes]] = {}  # (bytes, spec names) -> addresses
    for addr in spare:
        if is_compact(addr):  # a verbatim one (a rare URI shape) is simply freed
            skeleton = skeleton_of(addr)
            if skeleton.storage == target.storage and skeleton.type == target.type:
                by_layout.setdefault((skeleton.nbytes, skeleton.names), []).append(addr)
    picked: list[tuple[int, bytes]] = []
    last: tuple[tuple[str, int], ...] | None = None  # consecutive blocks usually share one specs tuple
    layout: tuple[int, tuple[str, ...]] = (0, ())
    for block, block_specs in enumerate(specs):
        if block_specs is not last:
            last, layout = block_specs, (sum(size for _, size in block_specs), tuple(name for name, _ in block_specs))
        candidates = by_layout.get(layout)
        if candidates:
            picked.append((block, candidates.pop()))
    if not picked:
        return reused
    taken = set()
    for (block, addr), ok in zip(picked, _vouched(backend, specs, picked)):
        if ok:
            reused[block] = addr
            taken.add(addr)
    if taken:
        spare[:] = [addr for addr in spare if addr not in taken]
    return reused


def _vouched(backend: SlotStorage, specs: list[tuple[tuple[str, int], ...]],
             picked: list[tuple[int, bytes]]) -> list[bool]:
    """Per picked (block, address): whether the storage lets the block take those slots as they
    are. A one-spec block's slot has the block's size, which its layout matched: an intact
    storage (open, no container lost or damaged, so every slot a record names is reserved in a
    container in service) vouches for all of them at once. Otherwise each slot is looked at."""
    if all(len(specs[block]) == 1 for block, _ in picked) and backend.intact():
        return [True] * len(picked)
    uri_lists = [wire_uris(addr) for _, addr in picked]
    ok = backend.reusable([uri for uris in uri_lists for uri in uris], [size for block, _ in picked for _, size in specs[block]])
    out, pos = [], 0
    for (block, _), uris in zip(picked, uri_lists):
        out.append(len(uris) == len(specs[block]) and all(ok[pos : pos + len(uris)]))
        pos += len(uris)
    return out


def _release(s: CacheState, storage: str, uris: Sequence[str | list[str]]) -> None:
    flat = [u for item in uris for u in (item if isinstance(item, list) else [item])]
    backend = s.pool.get(storage)
    if backend is not None and flat:
        backend.release(flat)


def _new_locations(target: Target, specs: list[tuple[tuple[str, int], ...]], uris: list[list[str]],
                   reused: list[bytes | None], addrs: list[bytes], now: float) -> tuple[list[bytes], list[Location]]:
    """The wire form and the ``writing`` location of each new block (``specs[j]``, at
    ``uris[j]``, addressed ``addrs[j]``)."""
    wires, locs = [], []
    for j, block_specs in enumerate(specs):
        if reused[j] is not None:  # the victim's own wire: the same URIs, most likely cached
            wire = wire_of(addrs[j])
        else:
            wire = pack_wire(target.type, [(name, uri) for (name, _), uri in zip(block_specs, uris[j])])
            remember(addrs[j], wire)  # the finish and the first lookups need it again
        wires.append(wire)
        locs.append(Location("", Status.WRITING, target.storage, target.type, sum(s for _, s in block_specs),
                             now, 0.0, "", addrs[j]))
    return wires, locs


def _record_new(s: CacheState, txn: WriteTxn, inst: InstanceView, keys: list[int], new: list[int],
                fresh: list[bool], specs: list[tuple[tuple[str, int], ...]], target: Target, uris: list[list[str]],
                reused: list[bytes | None], timeout: float, usage: dict[Key, list[int]]) -> tuple[Session, list[bytes]]:
    """Records, usage and the session of the new keys. ``fresh[j]``: ``keys[new[j]]`` has no
    record in ``txn`` (read by :func:`_existing` in this same block), so its record is written
    blind; a key whose record holds only copies on unusable storages gets one more location by
    read-modify-write. ``reused[j]``: the address of the victim's slots block j took over.
    ``usage``: deltas of copies this request dropped, added in the same call (a write that
    evicted as much as it adds, of one instance and type, changes no usage record at all)."""
    now = s.clock()
    # Records name their session and the session names their location ids: take the id first.
    sid = new_session_id()
    new_keys = [keys[i] for i in new]
    addrs = _new_addresses(target, [specs[i] for i in new], uris, reused)
    wires, locs = _new_locations(target, [specs[i] for i in new], uris, reused, addrs, now)
    persist(txn, s.store, addrs)

    def add(j: int, key: int, record: Record | None) -> Record:
        loc = locs[j]
        loc.session = sid
        if record is None:
            i = new[j]
            loc.id = _location_id(set())
            return Record(keys[i - 1] if i > 0 else None, now, now, [loc])
        loc.id = _location_id({x.id for x in record.locs})
        record.locs.append(loc)
        record.updated = now
        return record

    blind = [(new_keys[j], add(j, new_keys[j], None)) for j in range(len(new)) if fresh[j]]
    if blind:
        s.index.put_records(txn, inst.ns, blind, absent=True)
    if len(blind) < len(new):
        rest = [j for j in range(len(new)) if not fresh[j]]
        s.index.read_modify_write(txn, inst.ns, [new_keys[j] for j in rest], lambda n, key, rec: add(rest[n], key, rec))
    nbytes = sum(x.nbytes for x in locs)
    delta = usage.setdefault((inst.group, inst.instance_id, target.type), [0, 0])
    delta[0] += nbytes
    delta[1] += len(locs)
    s.usage_book.add(txn, usage)
    s.inflight.hold(txn, inst.instance_id, 0, nbytes)
    session = s.sessions.create(txn, inst.instance_id, inst.group, new_keys, [x.id for x in locs], timeout, sid=sid)
    return session, wires


def _new_addresses(target: Target, specs: list[tuple[tuple[str, int], ...]], uris: list[list[str]],
                   reused: list[bytes | None]) -> list[bytes]:
    """:func:`_addresses`, but a block that took over a victim's slots keeps that address (the
    same URIs: nothing to parse)."""
    fresh = [j for j, addr in enumerate(reused) if addr is None]
    if len(fresh) == len(reused):
        return _addresses(target, specs, uris)
    out = list(reused)
    made = _addresses(target, [specs[j] for j in fresh], [uris[j] for j in fresh]) if fresh else []
    for j, addr in zip(fresh, made):
        out[j] = addr
    return out  # type: ignore[return-value]  # every None was replaced


def _addresses(target: Target, specs: list[tuple[tuple[str, int], ...]], uris: list[list[str]]) -> list[bytes]:
    """Compact addresses of new locations (:mod:`kvcm.cache.locations`), in one batch when every
    block has the same specs (the usual request)."""
    if specs and all(s == specs[0] for s in specs):
        names = [name for name, _ in specs[0]]
        return addresses(target.type, target.storage, sum(s for _, s in specs[0]), names, uris)
    return [address(target.type, target.storage, sum(s for _, s in block_specs),
                              [(name, uri) for (name, _), uri in zip(block_specs, block_uris)])
            for block_specs, block_uris in zip(specs, uris)]


def _reply(session_id: str, mask: EncodableMap, wires: list[bytes]) -> Raw:
    return pack_map_raw({"write_session_id": session_id, "block_mask": mask, "locations": pack_array_raw(wires)})


# -- finish ---------------------------------------------------------------------------------------


def finish_write_cache(s: CacheState, instance_id: str, session_id: str, success: BlockMask | None) -> dict[str, Encodable]:
    s.instance(instance_id)
    with s.store.write(join=True) as txn:
        session = s.sessions.get(txn, session_id)
        if session is None or s.sessions.is_due(session_id):
            if session is not None or s.sessions.was_expired(session_id):
                raise NotFound(f"write session {session_id[:64]!r} has expired", Code.WRITE_SESSION_EXPIRED)
            raise NotFound(f"write session {session_id[:64]!r} is unknown (never started, or already finished)",
                           Code.WRITE_SESSION_UNKNOWN)
        if session.instance != instance_id:
            raise InvalidArgument(f"write session {session_id[:64]!r} belongs to another instance")
        ok = success_flags(success, len(session.keys))  # validated before the session is consumed
        s.sessions.consume(txn, session)
        served = settle(s, txn, session, ok)
        if s.listeners:
            txn.on_commit(lambda: s.listeners.write_finished(instance_id, session_id, success))
    return {"served": served, "failed": len(ok) - served}


def settle(s: CacheState, txn: WriteTxn, session: Session, ok: list[bool]) -> int:
    """Successes ``writing -> serving`` (CAS), failures ``writing -> deleting`` (freed at once).

    Consecutive successes become a run (:mod:`kvcm.cache.record_codec`) so later prefix lookups of them
    cost one read."""
    now = s.clock()
    first: list[int | None] = _segments(session.keys, ok) if s.runs else [None] * len(ok)
    served: list[tuple[int, Location, int | None]] = []
    failed: list[tuple[int, Location]] = []
    members: dict[int, Location] = {}  # session position -> its (only) serving copy
    settled = [0]  # bytes that leave writing

    def modify(j: int, key: int, record: Record | None) -> Any:
        loc = None if record is None else next((x for x in record.locs if x.id == session.loc_ids[j]), None)
        if record is None or loc is None or loc.status != Status.WRITING:
            return KEEP  # removed, trimmed or already deleting meanwhile: never resurrect
        loc.session = ""
        settled[0] += loc.nbytes
        if ok[j]:
            loc.status, loc.written = Status.SERVING, now
            served.append((key, loc, record.parent))
            if first[j] is not None and sum(x.status == Status.SERVING for x in record.locs) == 1:
                record.run = first[j]
                members[j] = loc
        else:
            loc.status = Status.DELETING
            failed.append((key, loc))
        record.updated = now
        return record

    ns = s.namespace_of(session.instance)
    s.index.read_modify_write(txn, ns, session.keys, modify)
    s.inflight.release(txn, session.instance, 0, settled[0])
    freeing: dict[FreeKey, int] = defaultdict(int)
    for key, loc in failed:
        schedule(txn, now, session.group, session.instance, key, loc)
        freeing[(session.group, loc.type)] += loc.nbytes
    s.being_freed.add(txn, freeing)
    if members:
        _store_runs(txn, ns, session.keys, first, members)
    if served and s.listeners:
        txn.on_commit(lambda: s.listeners.served(session.instance, served, now))
    return len(served)


def _segments(keys: list[int], ok: list[bool]) -> list[int | None]:
    """For each position: the first key of the run of consecutive successes it belongs to."""
    out: list[int | None] = []
    for j, good in enumerate(ok):
        out.append(None if not good else (out[-1] if j and ok[j - 1] else keys[j]))
    return out


def _store_runs(txn: WriteTxn, ns: bytes, keys: list[int], first: list[int | None], members: dict[int, Location]) -> None:
    """One run per segment, cut at its first block that is not run-eligible (a member with a
    second serving copy, or one removed meanwhile); runs of one block are not worth a record."""
    j = 0
    while j < len(keys):
        start = j
        while j < len(keys) and first[j] == first[start] and j in members:
            j += 1
        if j - start >= 2:
            locs = [members[i] for i in range(start, j)]
            value = encode_run(locs[0].storage, keys[start:j], [x.wire for x in locs], [x.addr for x in locs])
            txn.put(RUNS_DB, ns + i64(keys[start]), value)
        j = max(j, start + 1)
        while j < len(keys) and first[j] is not None and first[j] == first[start]:
            j += 1  # the rest of a cut segment stays without a run

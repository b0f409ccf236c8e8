"""Invariants of the data plane, checked on a quiet server (tests, crash tests, tools).

* usage persisted in the store == usage recounted from the block records == usage in memory;
* the bytes being freed in memory == the ``deleting`` copies recounted from the block records ==
  what the ``deletes`` database says, and each pending delete names one ``deleting`` copy with
  its bytes and type, each ``deleting`` copy exactly one pending delete;
* no ``writing`` copy outlives its write session;
* every run is exact: each member names it and has exactly that one serving copy;
* every location skeleton a record names is stored (:mod:`kvcm.cache.locations`);
* the index's own invariants (:meth:`kvcm.cache.meta_index.MetaIndex.check`);
* every storage agrees with the metadata, both ways (:func:`check_storages`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack

from kvcm.backends.metastore.base import from_i64, i64
from kvcm.backends.storage.base import Inventory
from kvcm.cache.deleter import DB as DELETES
from kvcm.cache.deleter import pending_bytes
from kvcm.cache.locations import check as check_skeletons
from kvcm.cache.locations import wire as location_wire
from kvcm.cache.meta_index import DB as BLOCKS
from kvcm.cache.record_codec import RUNS_DB, STATUS_NAMES, Status, decode, run_entries, run_members
from kvcm.cache.state import CacheState
from kvcm.cache.usage import FreeKey, Key, Usage, tally


def recount(s: CacheState) -> dict[Key, list[int]]:
    """Usage from the block records: ``{(group, instance, type): [bytes, copies]}``."""
    owners = s.owners()
    rows: list[tuple[Key, int]] = []
    for chunk in s.all_chunks():
        for dbkey, value in chunk:
            group, instance = owners.get(dbkey[:8], ("?", dbkey[:8].hex()))
            rows.extend(((group, instance, loc.type), loc.nbytes) for loc in decode(value).locs)
    return tally(rows)


def check(s: CacheState) -> None:
    s.index.check()
    counted = recount(s)
    with s.store.read() as view:
        persisted = Usage.persisted(view)
        live = {k.decode() for k, _ in view.scan("sessions")}
    assert counted == persisted, f"usage {persisted} != recount {counted}"
    assert persisted == s.usage_book.snapshot(), "in-memory usage differs from the store"
    for chunk in s.all_chunks():
        addrs = []
        for dbkey, value in chunk:
            for loc in decode(value).locs:
                addrs.append(loc.addr)
                if loc.status == Status.WRITING:
                    assert loc.session in live, f"writing copy of {from_i64(dbkey[8:])} outlived its session"
        with s.store.read() as view:
            check_skeletons(view, addrs)
    check_being_freed(s)
    check_runs(s)
    check_storages(s)


def recount_being_freed(s: CacheState) -> dict[FreeKey, int]:
    """Bytes of ``deleting`` copies per (group, type), from the block records."""
    owners = s.owners()
    out: Counter[FreeKey] = Counter()
    for chunk in s.all_chunks():
        for dbkey, value in chunk:
            group = owners.get(dbkey[:8], ("?", ""))[0]
            for loc in decode(value).locs:
                if loc.status == Status.DELETING:
                    out[(group, loc.type)] += loc.nbytes
    return {k: v for k, v in out.items() if v}


def check_being_freed(s: CacheState) -> None:
    counted = recount_being_freed(s)
    owners = s.owners()
    deleting: Counter[tuple[bytes, int, str]] = Counter()  # (namespace, key, location id) -> entries
    with s.store.read() as view:
        from_deletes = pending_bytes(view)
        for _, value in view.scan(DELETES):
            group, instance, key, loc_id, *rest = msgpack.unpackb(value)
            ns = s.namespace_of(instance)
            raw = view.get(BLOCKS, ns + i64(key))
            loc = None if raw is None else next((x for x in decode(raw).locs if x.id == loc_id), None)
            assert loc is not None and loc.status == Status.DELETING, \
                f"pending delete of {instance!r} block {key} names no deleting copy {loc_id!r}"
            assert rest[:4] == [loc.nbytes, loc.type, loc.storage, loc.addr][: len(rest[:4])], \
                f"pending delete of {instance!r} block {key} says {rest}, the copy is {loc.nbytes} bytes of {loc.type}"
            assert owners.get(ns, (group, ""))[0] == group, f"pending delete of {instance!r} names group {group!r}"
            deleting[(ns, key, loc_id)] += 1
    for chunk in s.all_chunks():
        for dbkey, value in chunk:
            for loc in decode(value).locs:
                if loc.status == Status.DELETING:
                    n = deleting[(dbkey[:8], from_i64(dbkey[8:]), loc.id)]
                    assert n == 1, f"deleting copy of block {from_i64(dbkey[8:])} has {n} pending deletes"
    assert from_deletes == counted, f"being freed by the deletes database {from_deletes} != recount {counted}"
    assert s.being_freed.snapshot() == counted, f"being freed in memory {s.being_freed.snapshot()} != recount {counted}"


def check_runs(s: CacheState) -> None:
    with s.store.read() as view:
        for run_key, value in view.scan(RUNS_DB):
            storage, keys, wires = run_members(value)
            assert i64(keys[0]) == run_key[8:], "run stored under another key than its first block"
            addrs = run_entries(value)  # format 3: each member's compact entry is its address
            assert addrs is None or [location_wire(a) for a in addrs] == wires, f"run {run_key.hex()}: entries differ"
            for key, wire in zip(keys, wires):
                raw = view.get(BLOCKS, run_key[:8] + i64(key))
                assert raw is not None, f"run {run_key.hex()} names a missing block"
                record = decode(raw)
                serving = [x for x in record.locs if x.status == Status.SERVING]
                assert record.run == from_i64(run_key[8:]), f"block of run {run_key.hex()} does not name it"
                assert len(serving) == 1 and serving[0].wire == wire and serving[0].storage == storage, \
                    f"run {run_key.hex()} is stale"


# -- storages against the metadata ------------------------------------------------------------

MAX_REPORTED = 20  # mismatches spelled out in one failure; the count says how many there were


@dataclass
class Recorded:
    """What the block records say one storage holds: each URI with how many copies name it
    and the first copy naming it (for messages), and the copies' bytes."""

    uris: Counter[str] = field(default_factory=Counter)
    first: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # uri -> (instance, key, status)
    nbytes: int = 0
    foreign: list[str] = field(default_factory=list)  # uris whose host is another storage

    def who(self, uri: str) -> str:
        instance, key, status = self.first.get(uri, ("?", 0, 0))
        return f"block {key} of {instance!r} ({_status(status)})"


def recorded_by_storage(s: CacheState) -> dict[str, Recorded]:
    """Every URI of every copy in the block records (any status), by storage name."""
    owners = s.owners()
    out: dict[str, Recorded] = {}
    for chunk in s.all_chunks():
        for dbkey, value in chunk:
            instance = owners.get(dbkey[:8], ("?", dbkey[:8].hex()))[1]
            for loc in decode(value).locs:
                rec = out.get(loc.storage) or out.setdefault(loc.storage, Recorded())
                rec.nbytes += loc.nbytes
                for uri in loc.uris():
                    rec.uris[uri] += 1
                    if uri not in rec.first:
                        rec.first[uri] = (instance, from_i64(dbkey[8:]), loc.status)
                        if _host(uri) != loc.storage:
                            rec.foreign.append(uri)
    return out


def check_storages(s: CacheState) -> None:
    """Compare every opened storage with the block records, both ways:

    * every recorded URI names its storage, is reserved there and is named by no other copy;
    * every slot a storage holds reserved is named by a recorded URI (else it leaked);
    * the storage's slot and byte counts equal the metadata's;
    * for storages with containers on disk (``file``, ``shm``): every recorded URI's container
      exists and is large enough for its byte range, every container accounted holds a used
      slot, every kvcm-named file on disk is accounted, and no orphan awaits a sweep.

    Storages removed from the pool are skipped: their records are being dropped, nothing is
    left to compare them with. Raises AssertionError listing the mismatches."""
    recorded = recorded_by_storage(s)
    problems = [f"storage {name!r}: uri {uri} of {rec.who(uri)} names storage {_host(uri)!r}"
                for name, rec in sorted(recorded.items()) for uri in rec.foreign]
    for name in s.pool.names():
        backend = s.pool.get(name)
        if backend is not None:
            problems.extend(compare_storage(name, backend.inventory(), recorded.get(name, Recorded())))
    if problems:
        shown = "\n  ".join(problems[:MAX_REPORTED])
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise AssertionError(f"{len(problems)} storage/metadata mismatch(es):\n  {shown}{more}")


def compare_storage(name: str, inv: Inventory, rec: Recorded) -> list[str]:
    """The mismatches between one storage's inventory and what the records say it holds."""
    where = f"storage {name!r}"
    problems = [f"{where}: uri {uri} is named by {n} copies ({rec.who(uri)} and others)"
                for uri, n in rec.uris.items() if n > 1]
    problems += [f"{where}: uri {uri} of {rec.who(uri)} is recorded but not reserved in the storage"
                 for uri in rec.uris if uri not in inv.reserved]
    problems += [f"{where}: uri {uri} (container {slot.container or '-'}) is reserved but no block record "
                 f"names it (leaked slot)" for uri, slot in inv.reserved.items() if uri not in rec.uris]
    total = sum(rec.uris.values())
    if not inv.slots_used == len(inv.reserved) == total:
        problems.append(f"{where}: {inv.slots_used} slots used by its count, {len(inv.reserved)} reserved, "
                        f"{total} uris recorded in the metadata")
    if inv.bytes_used != rec.nbytes:
        problems.append(f"{where}: {inv.bytes_used} bytes used by its count, {rec.nbytes} recorded in the metadata")
    if inv.on_disk is not None:
        problems += _compare_disk(where, inv, inv.on_disk, rec)
    return problems


def _compare_disk(where: str, inv: Inventory, on_disk: Mapping[str, int], rec: Recorded) -> list[str]:
    problems: list[str] = []
    reported: set[str] = set()  # one line per missing container, not one per block in it
    for uri in rec.uris:
        slot = inv.reserved.get(uri)
        if slot is None:
            continue  # reported above as not reserved
        size = on_disk.get(slot.container)
        if size is None:
            if slot.container not in reported:
                reported.add(slot.container)
                problems.append(f"{where}: container {slot.container} of uri {uri} ({rec.who(uri)}) "
                                f"is missing on disk")
        elif slot.offset + slot.size > size:
            problems.append(f"{where}: container {slot.container} is {size} bytes, too small for uri {uri} "
                            f"(needs {slot.offset + slot.size})")
    used = Counter(slot.container for slot in inv.reserved.values())
    for container, count in inv.containers.items():
        if count != used[container]:
            problems.append(f"{where}: container {container} counts {count} used slots, holds {used[container]}")
        if not count:
            problems.append(f"{where}: container {container} is accounted with no used slot (never unlinked)")
    problems += [f"{where}: file {f} on disk is not in the storage's accounting"
                 for f in sorted(on_disk) if f not in inv.containers and f not in inv.orphans]
    problems += [f"{where}: orphan {f} found at open was never swept" for f in sorted(inv.orphans)]
    return problems


def _host(uri: str) -> str:
    """The host of ``scheme://host/path?query`` as :func:`parse_uri` reads it ("" if none),
    without building the rest: check() reads it for every URI on record."""
    rest = uri.partition("://")[2]
    return rest.partition("?")[0].partition("/")[0]


def _status(value: int) -> str:
    try:
        return STATUS_NAMES[Status(value)]
    except (ValueError, KeyError):
        return f"status {value}"

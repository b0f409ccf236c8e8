"""Invariants of the data plane, checked on a quiet server (tests, crash tests, tools).

* usage persisted in the store == usage recounted from the block records == usage in memory;
* no ``writing`` copy outlives its write session;
* every run is exact: each member names it and has exactly that one serving copy;
* the index's own invariants (:meth:`kvcm.index.MetaIndex.check`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcm.backends.base import from_i64, i64
from kvcm.index import DB as BLOCKS
from kvcm.records import RUNS_DB, Status, decode, run_members
from kvcm.usage import Key, Usage, tally

if TYPE_CHECKING:
    from kvcm.manager import CacheManager


def recount(m: CacheManager) -> dict[Key, list[int]]:
    """Usage from the block records: ``{(group, instance, type): [bytes, copies]}``."""
    owners = m.owners()
    rows: list[tuple[Key, int]] = []
    for chunk in m.all_chunks():
        for dbkey, value in chunk:
            group, instance = owners.get(dbkey[:8], ("?", dbkey[:8].hex()))
            rows.extend(((group, instance, loc.type), loc.nbytes) for loc in decode(value).locs)
    return tally(rows)


def check(m: CacheManager) -> None:
    m.index.check()
    counted = recount(m)
    with m.store.read() as view:
        persisted = Usage.persisted(view)
        live = {k.decode() for k, _ in view.scan("sessions")}
    assert counted == persisted, f"usage {persisted} != recount {counted}"
    assert persisted == m.usage_book.snapshot(), "in-memory usage differs from the store"
    for chunk in m.all_chunks():
        for dbkey, value in chunk:
            for loc in decode(value).locs:
                if loc.status == Status.WRITING:
                    assert loc.session in live, f"writing copy of {from_i64(dbkey[8:])} outlived its session"
    check_runs(m)


def check_runs(m: CacheManager) -> None:
    with m.store.read() as view:
        for run_key, value in view.scan(RUNS_DB):
            storage, keys, wires = run_members(value)
            assert i64(keys[0]) == run_key[8:], "run stored under another key than its first block"
            for key, wire in zip(keys, wires):
                raw = view.get(BLOCKS, run_key[:8] + i64(key))
                assert raw is not None, f"run {run_key.hex()} names a missing block"
                record = decode(raw)
                serving = [x for x in record.locs if x.status == Status.SERVING]
                assert record.run == from_i64(run_key[8:]), f"block of run {run_key.hex()} does not name it"
                assert len(serving) == 1 and serving[0].wire == wire and serving[0].storage == storage, \
                    f"run {run_key.hex()} is stale"

"""Every format kvcm keeps on disk or in Redis, its version history and what an upgrade does.

Each :class:`Format` names where it lives, the version this kvcm writes (``current``), every
earlier version known (``past``) and what becomes of each (:class:`Fate`):

* ``upgrade``: a step run when the data is opened (:data:`LMDB_LAYOUT_STEPS`, the schema key);
* ``on_write``: read as it is, written in the current version the next time it changes;
* ``rebuild``: derived data, set aside and rebuilt from the metadata store;
* ``refuse``: not read; the message names the version found, the one expected and what to do.

A version newer than ``current`` was written by a newer kvcm: refused, except in the formats
whose ``newer`` says they read it as it is. The stores keep their codecs; they ask
:meth:`Format.refusal` about the version they found and run the steps listed here.

Changing a format: bump ``current``, add the old version to ``past`` with its fate (and its step
when it is an upgrade), add a test to ``tests/backends/test_migrations.py`` that writes the old version for
real and opens it, and a row to the table in ``docs/operations.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import lmdb


class Fate(enum.Enum):
    """What a kvcm does with data of one version of a format."""

    CURRENT = "current"
    UPGRADE = "upgrade"
    ON_WRITE = "on_write"
    REBUILD = "rebuild"
    REFUSE = "refuse"
    READ = "read"  # a newer version read as it is (the fields this kvcm knows)


@dataclass(frozen=True)
class Past:
    """One earlier version of a format and its fate here."""

    version: int
    shape: str  # what data of this version looks like
    fate: Fate
    how: str  # what an upgrade does, or what an operator does about a refusal


@dataclass(frozen=True)
class Format:
    """One persisted format: where it lives, the version written, the versions read."""

    name: str
    where: str
    current: int
    past: tuple[Past, ...] = ()
    newer: Fate = Fate.REFUSE  # a version above ``current``
    older: Fate = Fate.REFUSE  # a version below ``current`` not listed in ``past``
    remedy: str = "start the kvcm version that wrote it"

    @property
    def marker(self) -> bytes:
        """The current version as a store keeps it (ASCII digits)."""
        return str(self.current).encode()

    def fate(self, version: int) -> Fate:
        if version == self.current:
            return Fate.CURRENT
        for past in self.past:
            if past.version == version:
                return past.fate
        return self.newer if version > self.current else self.older

    def refusal(self, found: object) -> str | None:
        """None when this kvcm reads data of version ``found`` (an int, or its ASCII digits);
        else why not and what to do, naming the version found and the one expected."""
        version = _version(found)
        if version is None:
            return (f"{self.name}: version {found!r} is not one kvcm writes (this kvcm writes "
                    f"{self.current}); {self.remedy}")
        fate = self.fate(version)
        if fate is not Fate.REFUSE:
            return None
        if version > self.current:
            return (f"{self.name}: version {version} is newer than this kvcm supports ({self.current}): a newer "
                    f"kvcm wrote it; {self.remedy}")
        past = next((p for p in self.past if p.version == version), None)
        how = past.how if past is not None else self.remedy
        return f"{self.name}: version {version} is not read by this kvcm (it reads {self.current}); {how}"


def _version(found: object) -> int | None:
    if isinstance(found, bool):
        return None
    if isinstance(found, int):
        return found
    if isinstance(found, bytes | str):
        text = found.decode("ascii", "replace") if isinstance(found, bytes) else found
        return int(text) if text.isascii() and text.isdigit() else None
    return None


# -- the metadata store ------------------------------------------------------------------------

#: A step over an LMDB environment's layout: ``(env, its write transaction, the names of the
#: databases present, kvcm's databases)``. Each is a no-op once done: they run at every open.
LayoutStep = Callable[
    ["lmdb.Environment", "lmdb.Transaction[bytes]", set[bytes], Mapping[str, "lmdb._Database"]], None
]


def _access_into_runs(env: lmdb.Environment, txn: lmdb.Transaction[bytes], names: set[bytes],
                      dbs: Mapping[str, lmdb._Database]) -> None:
    """The runs table was once called ``access``: moved into ``runs``, entry by entry."""
    if b"access" in names:
        old = env.open_db(b"access", txn=txn)
        for key, value in txn.cursor(db=old):
            txn.put(key, value, db=dbs["runs"])
        txn.drop(old, delete=True)


def _drop_engine_hashes(env: lmdb.Environment, txn: lmdb.Transaction[bytes], names: set[bytes],
                        dbs: Mapping[str, lmdb._Database]) -> None:
    """``engine_hashes`` was reserved, never written: dropped."""
    if b"engine_hashes" in names:
        txn.drop(env.open_db(b"engine_hashes", txn=txn), delete=True)


#: The LMDB layout changes made before the schema key counted them, in order.
LMDB_LAYOUT_STEPS: tuple[LayoutStep, ...] = (_access_into_runs, _drop_engine_hashes)


def upgrade_lmdb_layout(env: lmdb.Environment, dbs: Mapping[str, lmdb._Database]) -> None:
    """Run :data:`LMDB_LAYOUT_STEPS` in one write transaction (all or none)."""
    with env.begin(write=True) as txn:
        names = {bytes(k) for k, _ in txn.cursor()}
        for step in LMDB_LAYOUT_STEPS:
            step(env, txn, names, dbs)


METASTORE = Format(
    "metadata store schema",
    "key registry.schema of the meta database (LMDB: <data_dir>/meta; Redis: the store's prefix)",
    current=1,
    past=(Past(0, "no registry.schema key: a new store, or one from before the key", Fate.UPGRADE,
               "the key is written at the first open (LMDB: the layout steps run first)"),),
    remedy="start the kvcm version that wrote it, or give this one another data dir (store.redis_prefix on Redis)",
)

BLOCK_RECORD = Format(
    "block record",
    "the value per (instance, block key) in the blocks database (first byte: 0/1 format 1, 2/3 format 2)",
    current=2,
    past=(Past(1, "the pre-packed wire in a header, float seconds", Fate.ON_WRITE,
               "read as it is; a block's record is written in format 2 when the block next changes"),),
)

ENGINE_INDEX = Format(
    "engine index",
    "databases engine_sources and engine_log (format 1: engine_blocks, one record per block)",
    current=2,
    past=(Past(1, "one engine_blocks record per block; sources' groups as [group, kind]", Fate.ON_WRITE,
               "loaded first, the log replayed over it; a source's next rewrite deletes its engine_blocks"),),
)

STORAGE_MARKER = Format(
    "storage ownership marker",
    "JSON .kvcm-storage in a file root, <prefix>kvcm-storage for shm (field kvcm_marker)",
    current=3,
    past=(Past(1, "unsigned", Fate.UPGRADE,
               "taken as kvcm's when it names the storage and data dir the metadata records; signed at the open"),
          Past(2, "signed with the data dir's key only; no host", Fate.UPGRADE,
               "its owner signs it again at its next open, adding the host and the host key's signature; until "
               "then its root is never taken over (release it with kvcm storage release)")),
    newer=Fate.READ,
)

RECLAIM_SNAPSHOT = Format(
    "reclaimer snapshot",
    "msgpack <data_dir>/reclaim/snapshot (field version), with its journal.<gen>",
    current=1,
    remedy="derived data: set aside as snapshot.bad, recency rebuilt from the metadata store",
)

REGISTRY_SNAPSHOT = Format(
    "registry snapshot",
    "gen_config_snapshot's JSON, read by load_config_snapshot (fields format, version)",
    current=1,
    older=Fate.READ,
    remedy="export it again from a kvcm that reads it, or load it with the kvcm that wrote it",
)

TRACE = Format(
    "kvcm_schema trace",
    "JSON lines, header {\"kvcm_schema\": N} (kvcm optimize --dump-schema)",
    current=1,
    older=Fate.READ,
    remedy="dump it again with this kvcm (kvcm optimize --dump-schema) from the trace it came from",
)

#: Every format kvcm persists that carries a version (the event log, password hashes and CURVE
#: key files are described in docs/operations.md: Tair's line format, a tagged hash, ZeroMQ's).
FORMATS: tuple[Format, ...] = (METASTORE, BLOCK_RECORD, ENGINE_INDEX, STORAGE_MARKER, RECLAIM_SNAPSHOT,
                               REGISTRY_SNAPSHOT, TRACE)

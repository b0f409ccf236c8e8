"""The metadata store contract: named sub-databases of ordered byte keys, batch-first, transactional.

Every store (LMDB, in-memory) implements :class:`MetaStore`. Callers never see ``lmdb``:

* ``with store.read() as txn`` — a consistent snapshot of committed data;
* ``with store.write() as txn`` — one atomic change, committed (and, for LMDB with ``sync``,
  on disk) when the block exits; rolled back if it raises;
* ``with store.group():`` — group commit. ``write()`` blocks opened on the same thread inside it
  become *children* of one shared transaction: each child still commits or rolls back on its own,
  but nothing is durable until the group exits and commits once. The RPC loop wraps all requests
  drained in one wake-up in a group, so their writes cost one fsync.

``txn.on_commit(fn)`` defers in-memory side effects (caches, counters) until the outermost
transaction has really committed, so a rolled-back request leaves no trace anywhere.
``txn.on_abort(fn)`` is its mirror for what cannot wait for the commit (storage space taken
for the request's new blocks): ``fn`` runs once the block's changes are certain never to commit
— its own rollback, an enclosing block's, or the abort or failed commit of the group.

Keys are bytes and sort bytewise; callers encode integers fixed-width big-endian
(:func:`u64`, :func:`i64`) so that cursor scans come out ordered. A key is 1 to
:data:`MAX_KEY` bytes (LMDB's limit): reading any other key finds nothing (a name no record can
have is simply not there), writing one raises :class:`~kvcm.errors.InvalidArgument`.

Lock order, to rule out deadlocks between the RPC thread and the background threads:
open the write transaction first, then take in-memory shard locks (``locks.ShardedLocks``).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar, runtime_checkable

from kvcm.errors import InvalidArgument, KvcmError

log = logging.getLogger("kvcm.backends.metastore")

#: Every sub-database a store provides. Adding a concept means adding its name here.
DATABASES: tuple[str, ...] = (
    "meta",  # store-level facts: schema version, counters
    "storages",  # storage name -> record
    "groups",  # instance group name -> record
    "instances",  # instance id -> record
    "accounts",  # user name -> record
    "tokens",  # API token id -> record (the token's digest, never the token)
    "blocks",  # (instance, block key) -> block record with its locations
    "skeletons",  # location skeleton id -> skeleton (what block records' locations share)
    "sessions",  # write session id -> session record
    "deletes",  # pending asynchronous deletes
    "usage",  # usage counters per group / storage / instance
    "runs",  # (instance, first key of a run) -> blocks one write session stored together
    "pins",  # (instance, block key) -> expiry of a soft pin (kvcm.cache.pins)
    "engine_sources",  # event source id -> record (config, last_seq)
    "source_defs",  # event source id -> its definition, in the main store: every node follows it
    "engine_blocks",  # (source, group, engine hash) -> engine block record (the format before engine_log)
    "engine_log",  # (source, serial) -> the engine blocks one flush changed (kvcm.engines.entries)
)

#: Longest key a store accepts (LMDB's compile-time ``MDB_MAXKEYSIZE``).
MAX_KEY = 511

_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")


def run_aborts(fns: list[Callable[[], None]]) -> None:
    """Run abort callbacks newest first; one failing must not stop the others (nor hide the
    error that caused the abort)."""
    for fn in reversed(fns):
        try:
            fn()
        except Exception:  # logged; the abort itself goes on
            log.exception("abort callback failed")
    fns.clear()


V = TypeVar("V")


class Callbacks(Protocol):
    """What a write transaction's group keeps of its committed savepoints."""

    @property
    def callbacks(self) -> list[Callable[[], None]]: ...

    @property
    def aborts(self) -> list[Callable[[], None]]: ...


class Savepoint(Callbacks, Protocol[V]):
    """A savepoint with an undo log (None: a savepoint whose rollback aborts its group): the
    state of each ``(database, key)`` it changed, as ``V``, before its first change."""

    @property
    def undo(self) -> dict[tuple[str, bytes], V] | None: ...


def merge_savepoint(child: Savepoint[V], stack: Sequence[Savepoint[V]], group: Callbacks) -> None:
    """A savepoint that ended without error hands its undo log (where kept) and its callbacks
    to the savepoint around it, or, outermost, its callbacks to the group: a committed child
    follows its parent's fate, and a parent that rolls back later takes its children down.
    ``child.undo`` maps a slot to its value before the child's first change; where both hold a
    slot, the parent's is the older one and stays."""
    if stack:
        parent = stack[-1]
        if parent.undo is not None and child.undo:
            setdefault = parent.undo.setdefault
            for slot, old in child.undo.items():
                setdefault(slot, old)
        parent.callbacks.extend(child.callbacks)
        parent.aborts.extend(child.aborts)
    else:
        group.callbacks.extend(child.callbacks)
        group.aborts.extend(child.aborts)


def key_fits(key: bytes) -> bool:
    """A key a store can hold (see the module docstring)."""
    return 0 < len(key) <= MAX_KEY


def bad_key() -> InvalidArgument:
    """The error of a write with a key that does not fit, from every store alike."""
    return InvalidArgument(f"a metadata key (name or id) is empty or longer than {MAX_KEY} bytes")


def u64(value: int) -> bytes:
    """8-byte big-endian unsigned key part."""
    return _U64.pack(value)


def i64(value: int) -> bytes:
    """8-byte key part for a signed int64 that still sorts numerically (sign bit flipped)."""
    return _U64.pack((value + (1 << 63)) & 0xFFFFFFFFFFFFFFFF)


def from_i64(raw: bytes) -> int:
    """Inverse of :func:`i64`."""
    return int(_U64.unpack(raw)[0]) - (1 << 63)


def from_u64(raw: bytes) -> int:
    return int(_U64.unpack(raw)[0])


class ReadTxn(Protocol):
    """A consistent read view. Only the thread that opened it may use it."""

    def get(self, db: str, key: bytes) -> bytes | None: ...

    def get_many(self, db: str, keys: Iterable[bytes]) -> list[bytes | None]: ...

    def scan(
        self, db: str, start: bytes = b"", prefix: bytes = b"", limit: int | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Items in key order, from ``start`` (inclusive), restricted to keys with ``prefix``."""
        ...

    def count(self, db: str) -> int: ...


class WriteTxn(ReadTxn, Protocol):
    """A read view that can also change data; reads see this transaction's own writes."""

    def put(self, db: str, key: bytes, value: bytes) -> None: ...

    def put_many(self, db: str, items: Iterable[tuple[bytes, bytes]]) -> None: ...

    def delete(self, db: str, key: bytes) -> bool: ...

    def delete_many(self, db: str, keys: Iterable[bytes]) -> int: ...

    def drop(self, db: str) -> None:
        """Delete every key of ``db``."""
        ...

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` after the outermost transaction commits; dropped on rollback."""
        ...

    def on_abort(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` if this block's changes end up not committed; dropped on commit."""
        ...

    def remember(self, db: str, items: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Hint: ``(key, value)`` pairs the caller just read in this block and has not changed
        since (``None``: absent), so a savepoint's undo log need not read them again before a
        put or delete. A store without an undo log ignores it."""
        ...


class MetaStore(Protocol):
    """A metadata store: see the module docstring for the contract."""

    path: str | None

    def read(self) -> AbstractContextManager[ReadTxn]: ...

    def write(self, join: bool = False) -> AbstractContextManager[WriteTxn]:
        """A savepoint of this thread's write transaction (see the module docstring). ``join``:
        inside an open ``write()`` block of this thread, hand out that block instead of a new
        savepoint — for callers whose errors always propagate out of the enclosing block."""
        ...

    def group(self) -> AbstractContextManager[None]: ...

    def sample(self, db: str, n: int, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        """Up to ``n`` items chosen at random (for sampled eviction)."""
        ...

    def stats(self) -> dict[str, int]:
        """Size facts for metrics: map size, used bytes, entries per database, readers."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class GrowableStore(Protocol):
    """The optional capability of a store whose map can be grown while it serves (LMDB); checked
    with ``isinstance``."""

    def grow(self) -> bool:
        """Grow the map now; False when it cannot (at its limit, or not from this thread now)."""
        ...


@runtime_checkable
class SharedStore(Protocol):
    """The optional capability of a store other processes share (Redis): it can be lost to this
    deployment, be unreachable, and says what it is. Checked with ``isinstance``."""

    def describe(self) -> str:
        """One line for the start-up block (no secrets)."""
        ...

    def watch(self) -> None:
        """The periodic check that the store still holds this deployment."""
        ...

    def lost_error(self) -> KvcmError | None:
        """What every request is answered while the store is lost; None while it is not."""
        ...

    def reachable(self) -> bool:
        """Whether the store answered its last probe."""
        ...

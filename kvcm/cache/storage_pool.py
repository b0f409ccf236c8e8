"""Opened storage backends by name, kept in step with the registry.

A storage is *usable* (takes writes, and its copies are readable) when the registry says it is
enabled and available (``enable_storage``/``disable_storage`` and the health thread set those)
and its backend opened. The pool keeps the set of unusable names as one frozenset, rebuilt on
every registry change, so the read path pays one membership test per copy — and nothing at all
while every storage is usable (the common case).

A storage that cannot be opened *for now* (its lock is held by another process: a paused
leader that has not stepped down yet) is *waiting*: never recorded unavailable in the registry
(the registry is shared, and the storage is fine), unusable on this node, and opened again by
the storage-health thread (:meth:`StoragePool.reopen_waiting`) once the lock frees, with its
slots rebuilt from the metadata as at start-up; the deleter keeps its frees until then.

Thread ownership: rebuilt on the thread that commits a registry change (RPC thread, or the
health thread via ``set_storage_available`` and reopens); read from any thread (attributes are
replaced whole, never mutated).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import msgspec

from kvcm.backends.storage.base import SlotStorage, StorageBackend
from kvcm.backends.storage.ownership import ForeignDirectory, Owner, marker_key
from kvcm.cache.record_codec import decode
from kvcm.control.records import Storage
from kvcm.control.registry import STORAGE, Registry, new_id
from kvcm.errors import InvalidArgument, ServerError
from kvcm.lockfile import LockBusy

log = logging.getLogger("kvcm.storage_pool")

Opener = Callable[[Storage, "str | None", Owner], StorageBackend]


class Recorder(Protocol):
    """What a storage reopened while serving needs from the data plane (the cache manager):
    every block record, to reserve the slots they name, and a way to retire lost copies."""

    def all_chunks(self) -> Iterator[list[tuple[bytes, bytes]]]: ...

    def mark_lost(self, storage: str, lost: Callable[[list[str]], set[str]], source: str) -> int: ...


def default_opener(storage: Storage, data_dir: str | None, owner: Owner) -> StorageBackend:
    """Open a backend through the storage registry (``kvcm.backends.storage.registry``)."""
    from kvcm.backends.storage.registry import open_backend

    return open_backend(storage.storage_type, storage.global_unique_name, storage.storage_spec, data_dir, owner)


class StoragePool:
    """Backends of every registered storage; see the module docstring."""

    def __init__(self, registry: Registry, data_dir: str | None, opener: Opener | None = None,
                 orphans: str = "refuse", takeover_orphans: str = "keep") -> None:
        self.registry = registry
        self.data_dir = data_dir
        # At start-up only: what to do with a storage directory another data dir's marker names
        # (``kvcm serve --adopt-orphans`` / ``--discard-orphans``); later opens always refuse.
        self.orphans = orphans
        # Every open (start-up and add_storage): the containers of a root's owner proven gone,
        # once taken over, are kept unindexed ("keep") or deleted ("delete"): ``storage.orphans``.
        self.takeover_orphans = takeover_orphans
        self.foreign: dict[str, ForeignDirectory] = {}  # storages refused at start-up, and why
        self._opener = opener or default_opener
        self._backends: dict[str, StorageBackend] = {}
        self._types: dict[str, str] = {}
        self._specs: dict[str, object] = {}
        self._lock = threading.Lock()
        self.unusable: frozenset[str] = frozenset()
        self.removed: frozenset[str] = frozenset()  # removed since start: their copies are unreadable
        self._following = False  # a follower's pool (:meth:`follow`)
        # Waiting storages (module docstring): name -> (record with its id, on_foreign, id to record).
        self._waiting: dict[str, tuple[Storage, str, bool]] = {}
        self._recovering: frozenset[str] = frozenset()  # reopened, slots not rebuilt yet: unusable
        self._key: bytes | None = None  # the data dir's marker key, read (or made) on first use
        # One rebuild at a time: the RPC and health threads both rebuild, and a rebuild computed
        # before another one's change must not be stored after it.
        self._rebuilding = threading.Lock()

    def open_all(self) -> None:
        for storage in self.registry.list_storages():
            self._open(storage, persist=True, on_foreign=self.orphans)
        self._rebuild()
        self.registry.on_change(self._on_change)
        self.registry.preflight(self.try_open)

    def follow(self) -> None:
        """Instead of :meth:`open_all` on a follower, which reads the leader's metadata and
        opens no backend (the leader owns the storages' directories and lock files): a storage
        is usable when the registry says it is enabled and available, and one removed since
        this start is not."""
        self._following = True
        self._rebuild()
        self.registry.on_change(self._on_change)

    def owner(self, storage: Storage, on_foreign: str = "refuse") -> Owner:
        storages = self.registry.list_storages()
        name = storage.global_unique_name
        taken = frozenset(s.storage_id for s in storages if s.global_unique_name != name and s.storage_id)
        recorded = bool(storage.storage_id) and any(
            s.global_unique_name == name and s.storage_id == storage.storage_id for s in storages)
        return Owner(storage.storage_id, self.registry.data_dir_id, self.data_dir or "", on_foreign, taken,
                     key=self._marker_key(), recorded=recorded, takeover_orphans=self.takeover_orphans)

    def _marker_key(self) -> bytes:
        if self._key is None:
            self._key = marker_key(self.data_dir) if self.data_dir else b""
        return self._key

    def try_open(self, storage: Storage, on_foreign: str = "refuse") -> None:
        """Open and close ``storage`` once; raises why it cannot be opened (``add_storage``
        refuses it then, instead of storing a storage that only logs a line). A storage that
        cannot be opened is the caller's bad argument, not a server fault: INVALID_ARGUMENT.
        The open writes the ownership marker, so the open after the commit finds its own."""
        try:
            backend = self._opener(storage, self.data_dir, self.owner(storage, on_foreign))
        except ServerError as exc:
            raise InvalidArgument(f"storage {storage.global_unique_name!r} cannot be opened: {exc.message}") from None
        _close(backend)

    def _open(self, storage: Storage, persist: bool = False, on_foreign: str = "refuse") -> None:
        """``persist``: record a failure as ``available: false`` in the registry (at start-up;
        from inside a commit callback only the in-memory reason is set).

        A storage from before ownership markers (no ``storage_id``) is opened with a fresh id,
        adopting its directory: the registry shows kvcm made it, and files named the old way are
        only ever deleted through the URIs the metadata records, never swept. The id is
        recorded once that open succeeded."""
        name = storage.global_unique_name
        self._types[name] = storage.storage_type
        self._specs[name] = storage.storage_spec
        legacy = not storage.storage_id
        if legacy:
            storage = msgspec.structs.replace(storage, storage_id=new_id())
            on_foreign = "adopt"
        try:
            backend = self._opener(storage, self.data_dir, self.owner(storage, on_foreign))
            if legacy and persist:
                self.registry.assign_storage_id(name, storage.storage_id)
        except LockBusy as exc:
            self._wait(name, (storage, on_foreign, legacy and persist), exc)
            return
        except Exception as exc:  # noqa: BLE001 - one broken storage must not stop the others
            self._failed(name, storage, exc, persist)
            return
        self._install(name, backend)

    def _failed(self, name: str, storage: Storage, exc: Exception, persist: bool) -> None:
        if isinstance(exc, ForeignDirectory):
            self.foreign[name] = exc
        log.error("storage %r (%s) cannot be opened: %s", name, storage.storage_type, exc)
        reason = f"cannot be opened: {getattr(exc, 'message', None) or exc}"
        if persist:
            self._mark_unavailable(name, reason)
        else:
            self.registry.unavailable_reasons[name] = reason

    def _wait(self, name: str, attempt: tuple[Storage, str, bool], exc: LockBusy) -> None:
        """A transient failure: kept out of the registry (another node may serve the storage
        well), retried by :meth:`reopen_waiting`."""
        with self._lock:
            first = name not in self._waiting
            self._waiting[name] = attempt
        if first:
            log.warning("storage %r waits: %s; it opens once that lock is free", name, exc.message)
        self.registry.unavailable_reasons[name] = f"waiting for its lock: {exc.message}"

    def _install(self, name: str, backend: StorageBackend) -> None:
        with self._lock:
            old = self._backends.get(name)
            self._backends[name] = backend
            self._waiting.pop(name, None)
        if old is not None and old is not backend:
            _close(old)

    def waiting(self) -> frozenset[str]:
        """The storages waiting to be opened again (module docstring): the deleter keeps their
        frees until then."""
        return frozenset(self._waiting)

    def reopen_waiting(self, recorder: Recorder) -> list[str]:
        """Try every waiting storage again (the storage-health thread, each round); one that
        opens gets its slots rebuilt from the metadata (``reserve``, lost copies, ``sweep``)
        before it takes writes or serves reads. Returns the storages opened."""
        opened: list[str] = []
        for name, (storage, on_foreign, record_id) in list(self._waiting.items()):
            try:
                backend = self._opener(storage, self.data_dir, self.owner(storage, on_foreign))
            except LockBusy:
                continue
            except Exception as exc:  # noqa: BLE001 - no longer transient: as at start-up
                with self._lock:
                    self._waiting.pop(name, None)
                self._failed(name, storage, exc, persist=True)
                continue
            try:
                if record_id:
                    self.registry.assign_storage_id(name, storage.storage_id)
            except Exception:  # removed meanwhile, or the store failed: the next round tries again
                log.exception("storage %r: cannot record its id", name)
                _close(backend)
                continue
            self._recover(name, backend, recorder)
            opened.append(name)
        return opened

    def _recover(self, name: str, backend: StorageBackend, recorder: Recorder) -> None:
        """Reserve what the metadata records on ``backend``, then let it serve. Installed first
        (unusable): frees from here on reach it, and it knows not to reserve those again."""
        with self._lock:
            removed = self._waiting.pop(name, None) is None  # by remove_storage, meanwhile
            if not removed:
                self._backends[name] = backend
                self._recovering = self._recovering | {name}
        if removed:
            _close(backend)
            return
        self._rebuild()
        try:
            backend.reserve(_recorded_uris(recorder, name))
            if isinstance(backend, SlotStorage) and backend.damaged():
                recorder.mark_lost(name, backend.lost, "startup")
            swept = backend.sweep()
            log.info("storage %r opened again (%d orphan container(s) removed)", name, swept)
        except Exception:  # as at start-up: no sweep, the storage still serves what it reserved
            log.exception("recovering storage %r failed", name)
        finally:
            self._recovering = self._recovering - {name}
            self.registry.unavailable_reasons.pop(name, None)
            self._rebuild()

    def _mark_unavailable(self, name: str, reason: str) -> None:
        try:
            self.registry.set_storage_available(name, False, reason)
        except Exception:  # the reason is in the log line above either way
            log.exception("storage %r: cannot record it as unavailable", name)

    def _on_change(self, kind: str, name: str) -> None:
        if kind != STORAGE:
            return
        if self._following:
            self._follow_change(name)
            return
        try:
            storage = self.registry.get_storage(name)
        except Exception:  # noqa: BLE001 - NotFound: the storage was removed
            storage = None
        if storage is None:
            with self._lock:
                backend = self._backends.pop(name, None)
                self._waiting.pop(name, None)
            if backend is not None:
                _close(backend)
            self.removed = self.removed | {name}
        elif name in self._waiting:
            pass  # reopened by the health thread, which rebuilds its slots first
        elif name not in self._backends:
            self._open(storage)
            self.removed = self.removed - {name}
        elif self._spec_changed(storage):
            # Re-opening would forget which slots the metadata holds (they are reserved at
            # start-up only): the new spec applies from the next start.
            log.warning("storage %r: spec changed; it takes effect when kvcm restarts", name)
        self._rebuild()

    def _follow_change(self, name: str) -> None:
        try:
            self.registry.get_storage(name)
            self.removed = self.removed - {name}
        except Exception:  # noqa: BLE001 - NotFound: the leader removed it
            self.removed = self.removed | {name}
        self._rebuild()

    def _spec_changed(self, storage: Storage) -> bool:
        return bool(self._specs.get(storage.global_unique_name) != storage.storage_spec)

    def _rebuild(self) -> None:
        with self._rebuilding:
            opened = None if self._following else self._backends
            bad = {s.global_unique_name for s in self.registry.list_storages()
                   if not (s.enabled and s.available) or (opened is not None and s.global_unique_name not in opened)}
            self.unusable = frozenset(bad | self.removed | self._recovering)

    # -- lookups ----------------------------------------------------------------------------------

    def get(self, name: str) -> StorageBackend | None:
        return self._backends.get(name)

    def usable(self, name: str) -> bool:
        return bool(name in self._backends and name not in self.unusable)

    def storage_type(self, name: str) -> str | None:
        return self._types.get(name)

    def names(self) -> list[str]:
        return list(self._backends)

    def backends(self) -> list[StorageBackend]:
        """Every opened backend (the storage-health prober's view)."""
        return list(self._backends.values())

    def close(self) -> None:
        with self._lock:
            backends, self._backends = list(self._backends.values()), {}
        for backend in backends:
            _close(backend)


def _recorded_uris(recorder: Recorder, name: str) -> list[str]:
    """Every URI a block record names on storage ``name``, whatever the copy's status."""
    out: list[str] = []
    for chunk in recorder.all_chunks():
        for _, value in chunk:
            out.extend(uri for loc in decode(value).locs if loc.storage == name for uri in loc.uris())
    return out


def _close(backend: StorageBackend) -> None:
    try:
        backend.close()
    except Exception:
        log.exception("closing storage backend failed")

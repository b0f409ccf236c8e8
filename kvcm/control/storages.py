"""Storages in the registry: add (with placement and ownership preflights), update, enable, disable, availability, remove."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvcm.backends.metastore.base import ReadTxn, WriteTxn
from kvcm.backends.storage.roots import check_placement
from kvcm.control.records import (
    Storage,
    check_storage,
    now_ms,
)
from kvcm.control.registry_core import STORAGE, RegistryCore, names_of, new_id
from kvcm.errors import Code, Conflict, InvalidArgument


class StorageRegistry(RegistryCore):
    """Storages in the registry: add (with placement and ownership preflights), update, enable, disable, availability, remove."""

    def preflight(self, check: Callable[[Storage, str], None]) -> None:
        """Run ``check(storage, on_foreign)`` before ``add_storage`` commits (the storage pool
        opens the backend once there), so a storage that cannot be opened is refused to the
        admin. ``on_foreign`` is "adopt" when the admin asked to take over a directory that
        carries no (or another) ownership marker, else "refuse"."""
        self._preflights.append(check)

    def add_storage(self, storage: Storage, adopt: bool = False) -> Storage:
        """:raises Conflict: DUPLICATE_ENTITY if the name is taken (nothing is overwritten).

        ``adopt``: take over a directory that is not empty and carries no ownership marker of
        this kvcm (see :mod:`kvcm.backends.storage.ownership`); refused otherwise."""
        if storage.storage_id:
            raise InvalidArgument("storage.storage_id: assigned by kvcm when the storage is added; leave it out")
        storage = check_storage(storage, self._data_dir)
        with self._store.write() as txn:
            if self._storages.read(txn, storage.global_unique_name) is not None:
                raise Conflict(f"storage {storage.global_unique_name!r} already exists", Code.DUPLICATE_ENTITY)
            return self._put_new_storage(txn, storage, preflight="adopt" if adopt else "refuse")

    def _put_new_storage(self, txn: WriteTxn, storage: Storage, preflight: str = "") -> Storage:
        now = now_ms()
        storage = check_storage(
            msgspec.structs.replace(storage, create_time=now, update_time=now, storage_id=new_id()), self._data_dir
        )
        self._check_placement(txn, storage)
        for check in self._preflights if preflight else ():
            check(storage, preflight)
        self._storages.put(txn, storage, self._changed)
        return storage

    def _check_placement(self, txn: ReadTxn, storage: Storage) -> None:
        others = [(s.global_unique_name, s.storage_type, s.storage_spec) for s in self._storages.all(txn)]
        check_placement(storage.storage_type, storage.global_unique_name, storage.storage_spec, others, self.roots)

    def update_storage(self, storage: Storage) -> Storage:
        """Replace a storage's spec; its type cannot change, ``enabled``/``available`` are kept."""
        storage = check_storage(storage, self._data_dir)
        with self._store.write() as txn:
            old = self._must(txn, self._storages, storage.global_unique_name)
            if old.storage_type != storage.storage_type:
                raise InvalidArgument(
                    f"storage.storage_type: cannot change {old.storage_type!r} to {storage.storage_type!r}; "
                    "add a new storage instead"
                )
            if storage.storage_id not in ("", old.storage_id):
                raise InvalidArgument("storage.storage_id: cannot change (kvcm assigned it); leave it out")
            self._check_placement(txn, storage)
            new = msgspec.structs.replace(
                storage, enabled=old.enabled, available=old.available, create_time=old.create_time, update_time=now_ms(),
                storage_id=old.storage_id,
            )
            if new.storage_spec != old.storage_spec and new.storage_id:
                for check in self._preflights:  # the new spec must open too, or the next start fails
                    check(new, "refuse")
            self._storages.put(txn, new, self._changed)
            return new

    def set_storage_enabled(self, name: str, enabled: bool) -> Storage:
        """Admin switch (``enable_storage`` / ``disable_storage``)."""
        with self._store.write() as txn:
            old = self._must(txn, self._storages, name)
            new = msgspec.structs.replace(old, enabled=enabled, update_time=now_ms())
            self._storages.put(txn, new, self._changed)
            return new

    def assign_storage_id(self, name: str, storage_id: str) -> Storage:
        """Record the id of a storage from before ownership markers (its first open under this
        kvcm wrote the marker); a storage that has an id keeps it."""
        with self._store.write() as txn:
            old = self._must(txn, self._storages, name)
            if old.storage_id:
                return old
            new = msgspec.structs.replace(old, storage_id=storage_id)
            self._storages.put(txn, new, self._changed)
            return new

    def set_storage_available(self, name: str, available: bool, reason: str = "") -> None:
        """Health verdict; writes only when it changes. Unknown names are ignored (removed meanwhile)."""
        if available:
            self.unavailable_reasons.pop(name, None)
        else:
            self.unavailable_reasons[name] = reason or self.unavailable_reasons.get(name) or "health probe failed"
        cached = self._storages.cache.get(name)
        if cached is None or cached.available == available:
            return
        with self._store.write() as txn:
            old = self._storages.read(txn, name)
            if old is not None and old.available != available:
                self._storages.put(txn, msgspec.structs.replace(old, available=available), self._changed)

    def remove_storage(self, name: str) -> None:
        """:raises Conflict: STILL_REFERENCED while a group lists it as a candidate."""
        with self._store.write() as txn:
            self._must(txn, self._storages, name)
            users = [g.name for g in self._groups.all(txn) if name in g.storage_candidates]
            if users:
                raise Conflict(
                    f"storage {name!r} is still a storage candidate of instance group(s) {names_of(users)}; "
                    "remove it from their storage_candidates first",
                    Code.STILL_REFERENCED,
                )
            self._run_guards(txn, STORAGE, name)
            self._storages.delete(txn, name, self._changed)

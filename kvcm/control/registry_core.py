"""The registry's shared parts: one table of records per entity kind, mirrored in memory, and the
change hooks (observers, removal guards) every entity's operations use."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec

from kvcm.backends.metastore.base import MetaStore, ReadTxn, WriteTxn
from kvcm.backends.storage.roots import StorageRoots
from kvcm.control.records import (
    Account,
    Instance,
    InstanceGroup,
    Storage,
    Token,
    decoder,
    encode,
)
from kvcm.errors import Code, Conflict, NotFound, error

log = logging.getLogger("kvcm.control.registry")


R = TypeVar("R", bound=msgspec.Struct)


#: Kinds passed to ``on_change`` observers, one per table.
STORAGE, GROUP, INSTANCE, ACCOUNT, TOKEN = "storage", "instance_group", "instance", "account", "token"


DEFAULT_STORAGE, DEFAULT_GROUP = "default-file", "default"


Observer = Callable[[str, str], None]


#: ``guard(txn, kind, name) -> reason or None``; a reason refuses the removal (STILL_REFERENCED).
RemovalGuard = Callable[[ReadTxn, str, str], "str | None"]


def new_id() -> str:
    """A fresh storage or data-dir id: 8 hex digits (32 random bits)."""
    return secrets.token_hex(4)


def instance_not_found(instance_id: str) -> NotFound:
    """The one answer for an unknown instance id (tenancy gives it for another tenant's too)."""
    return NotFound(f"instance {instance_id[:200]!r} is not registered", Code.INSTANCE_NOT_EXIST)


class Registration(NamedTuple):
    """What ``register_instance`` did: the stored instance, whether it is new, and the group's
    candidate storages in order (Tair's ``storage_configs``)."""

    instance: Instance
    created: bool
    storages: list[Storage]


class Table(Generic[R]):
    """One sub-database of records keyed by name, mirrored in ``cache``."""

    def __init__(self, kind: str, db: str, record: type[R], key: Callable[[R], str]) -> None:
        self.kind, self.db, self.key = kind, db, key
        self.cache: dict[str, R] = {}
        self._decode = decoder(record).decode

    def load(self, view: ReadTxn) -> None:
        self.cache = {k.decode(): self._decode(v) for k, v in view.scan(self.db)}

    def read(self, view: ReadTxn, name: str) -> R | None:
        raw = view.get(self.db, name.encode())
        return None if raw is None else self._decode(raw)

    def all(self, view: ReadTxn) -> list[R]:
        return [self._decode(v) for _, v in view.scan(self.db)]

    def put(self, txn: WriteTxn, record: R, changed: Callable[[str, str, R | None], None]) -> None:
        name = self.key(record)
        txn.put(self.db, name.encode(), encode(record))
        txn.on_commit(lambda: changed(self.kind, name, record))

    def delete(self, txn: WriteTxn, name: str, changed: Callable[[str, str, R | None], None]) -> None:
        txn.delete(self.db, name.encode())
        txn.on_commit(lambda: changed(self.kind, name, None))


def merge(base: Mapping[str, object], changes: Mapping[str, object]) -> dict[str, object]:
    """Nested maps merge key by key; anything else (lists included) is replaced."""
    out = dict(base)
    for key, value in changes.items():
        current = out.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            out[key] = merge(current, value)
        else:
            out[key] = value
    return out


def names_of(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class RegistryCore:
    """The registry's tables and change hooks, which each entity's operations share."""

    _store: MetaStore
    _data_dir: str | None
    roots: StorageRoots
    unavailable_reasons: dict[str, str]
    _preflights: list[Callable[[Storage, str], None]]
    _storages: Table[Storage]
    _groups: Table[InstanceGroup]
    _instances: Table[Instance]
    _accounts: Table[Account]
    _tokens: Table[Token]
    _tables: dict[str, Table[Any]]
    _observers: list[Observer]
    _guards: list[RemovalGuard]
    data_dir_id: str

    def on_change(self, callback: Observer) -> None:
        """Call ``callback(kind, name)`` after each committed change (kind: storage, instance_group,
        instance, account). It runs on the committing thread and must not raise or block."""
        self._observers.append(callback)

    def guard_removal(self, guard: RemovalGuard) -> None:
        """Add a check run inside ``remove_storage``/``remove_instance_group``/``remove_instance``."""
        self._guards.append(guard)

    def _changed(self, kind: str, name: str, record: Any) -> None:
        cache = self._tables[kind].cache
        if record is None:
            cache.pop(name, None)
        else:
            cache[name] = record
        self._notify(kind, name)

    def _notify(self, kind: str, name: str) -> None:
        for callback in self._observers:
            try:
                callback(kind, name)
            except Exception:
                log.exception("registry observer failed on %s %r", kind, name)

    @staticmethod
    def _must(txn: ReadTxn, table: Table[R], name: str) -> R:
        record = table.read(txn, name)
        if record is None:
            code = Code.INSTANCE_NOT_EXIST if table.kind == INSTANCE else Code.NOT_FOUND
            raise error(code, f"{table.kind.replace('_', ' ')} {name[:200]!r} does not exist")
        return record

    def _run_guards(self, txn: ReadTxn, kind: str, name: str) -> None:
        for guard in self._guards:
            reason = guard(txn, kind, name)
            if reason:
                raise Conflict(reason, Code.STILL_REFERENCED)

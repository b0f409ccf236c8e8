"""The control plane: storages, instance groups, instances, accounts and API tokens, persisted in the store.

The whole registry is small, so it is also held in memory: every record is cached in a dict,
loaded once at start and refreshed by ``txn.on_commit`` callbacks, so the data plane's
:meth:`Registry.get_instance` (called on every request) is one dict lookup and a rolled-back
write leaves the cache untouched. Write paths never trust the cache: inside a group commit an
earlier request of the same batch may have changed a record that is not committed yet, so
writes read through their transaction.

Owned by the RPC thread for writes; reads (``get_*``, ``list_*``) are safe from any thread
(the ``list_*`` copy the cache with one C-level ``list()`` call, so a concurrent commit cannot
change a dict under their iteration), and :meth:`Registry.set_storage_available` is meant for
the storage-health thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kvcm.backends.metastore.base import MetaStore, ReadTxn
from kvcm.backends.migrations import METASTORE
from kvcm.backends.storage.roots import StorageRoots, check_placement
from kvcm.control.accounts import AccountRegistry
from kvcm.control.groups import GroupRegistry
from kvcm.control.instances import InstanceRegistry
from kvcm.control.records import (
    SNAPSHOT_FORMAT,
    Account,
    Instance,
    InstanceGroup,
    ReclaimStrategy,
    Snapshot,
    Storage,
    Token,
    check_snapshot,
    now_ms,
    parse_snapshot,
    to_wire,
)
from kvcm.control.registry_core import (
    ACCOUNT,
    DEFAULT_GROUP,
    DEFAULT_STORAGE,
    GROUP,
    INSTANCE,
    STORAGE,
    TOKEN,
    Observer,
    Registration,
    RemovalGuard,
    Table,
    instance_not_found,
    new_id,
)
from kvcm.control.storages import StorageRegistry
from kvcm.errors import Code, Conflict, NotFound, error
from kvcm.proto.wire import DecodedMap

_SCHEMA_KEY, _SCHEMA = b"registry.schema", METASTORE.marker
# The id of this data dir's metadata, named by the ownership marker of every storage it records
# (kvcm.backends.storage.ownership): a store made anew gets a new id, so its storages can tell.
_DATA_DIR_ID_KEY = b"data_dir.id"
_DEFAULTS_KEY = b"registry.defaults_created"


class Registry(StorageRegistry, GroupRegistry, InstanceRegistry, AccountRegistry):
    """CRUD over the registry with Tair's rules (and without its known bugs): each entity's
    operations in its own module (:mod:`.storages`, :mod:`.groups`, :mod:`.instances`,
    :mod:`.accounts`), the reads from memory and the snapshots here."""

    def __init__(
        self, store: MetaStore, data_dir: str | None = None, allowed_roots: tuple[str, ...] = ()
    ) -> None:
        self._store = store
        # Resolves relative ``file`` root paths (as the storage backends do); None refuses them.
        self._data_dir = None if data_dir is None else os.path.abspath(data_dir)
        # Where storages may live (config ``storage.allowed_roots``; empty = the default).
        self.roots = StorageRoots(self._data_dir, tuple(allowed_roots))
        # Why a storage is unavailable, for check_health (in memory: a restart re-probes).
        self.unavailable_reasons: dict[str, str] = {}
        self._preflights: list[Callable[[Storage, str], None]] = []
        self._storages = Table(STORAGE, "storages", Storage, lambda s: s.global_unique_name)
        self._groups = Table(GROUP, "groups", InstanceGroup, lambda g: g.name)
        self._instances = Table(INSTANCE, "instances", Instance, lambda i: i.instance_id)
        self._accounts = Table(ACCOUNT, "accounts", Account, lambda a: a.user_name)
        self._tokens = Table(TOKEN, "tokens", Token, lambda t: t.token_id)
        self._tables: dict[str, Table[Any]] = {t.kind: t for t in self._all_tables()}
        self._observers: list[Observer] = []
        self._guards: list[RemovalGuard] = []
        self._open()
        if data_dir is not None:
            self.ensure_defaults(data_dir)

    def _all_tables(self) -> tuple[Table[Any], ...]:
        return (self._storages, self._groups, self._instances, self._accounts, self._tokens)

    def _open(self) -> None:
        with self._store.write() as txn:
            schema = txn.get("meta", _SCHEMA_KEY)
            self.data_dir_id = (txn.get("meta", _DATA_DIR_ID_KEY) or b"").decode()
            if not self.data_dir_id:
                self.data_dir_id = new_id()
                txn.put("meta", _DATA_DIR_ID_KEY, self.data_dir_id.encode())
            if schema is None:
                txn.put("meta", _SCHEMA_KEY, _SCHEMA)
            elif (problem := METASTORE.refusal(schema)) is not None:
                raise error(Code.UNSUPPORTED, problem)
        with self._store.read() as view:
            for table in self._all_tables():
                table.load(view)

    @property
    def databases(self) -> tuple[str, ...]:
        """The store databases the registry mirrors in memory."""
        return tuple(t.db for t in self._all_tables())

    def reload(self) -> int:
        """Read every table again (a follower, after the leader changed the registry) and tell
        the observers about each record that changed, appeared or went; returns how many."""
        changed: list[tuple[str, str]] = []
        with self._store.read() as view:
            for table in self._all_tables():
                old = table.cache
                table.load(view)
                new = table.cache
                changed += [(table.kind, name) for name in old.keys() | new.keys() if old.get(name) != new.get(name)]
        for kind, name in changed:
            self._notify(kind, name)
        return len(changed)

    def ensure_defaults(self, data_dir: str) -> None:
        """On the first start only: a ``file`` storage under ``data_dir`` and a ``default`` group."""
        if self.roots.data_dir is None:  # a memory store: the defaults still live in data_dir
            self.roots = StorageRoots(os.path.abspath(data_dir), self.roots.configured)
        with self._store.write() as txn:
            if txn.get("meta", _DEFAULTS_KEY) is not None:
                return
            root = os.path.join(os.path.abspath(data_dir), "blocks")
            if self._storages.read(txn, DEFAULT_STORAGE) is None:
                # Absolute already; the spec is normalized like any other (backend defaults filled
                # in) and the directory is created when the storage pool opens it, not here.
                spec = {"root_path": root}  # packed files of file_size bytes
                self._put_new_storage(
                    txn, Storage(global_unique_name=DEFAULT_STORAGE, storage_type="file", storage_spec=spec)
                )
            if self._groups.read(txn, DEFAULT_GROUP) is None:
                group = InstanceGroup(
                    name=DEFAULT_GROUP,
                    storage_candidates=[DEFAULT_STORAGE],
                    reclaim_strategy=ReclaimStrategy(reclaim_policy="lru", used_percentage=0.9),
                )
                self._put_new_group(txn, group)
            txn.put("meta", _DEFAULTS_KEY, b"1")

    def get_instance(self, instance_id: str) -> Instance:
        """O(1). :raises NotFound: INSTANCE_NOT_EXIST."""
        try:
            return self._instances.cache[instance_id]
        except KeyError:
            raise instance_not_found(instance_id) from None

    def get_group(self, name: str) -> InstanceGroup:
        try:
            return self._groups.cache[name]
        except KeyError:
            raise NotFound(f"instance group {name[:200]!r} does not exist") from None

    def get_storage(self, name: str) -> Storage:
        try:
            return self._storages.cache[name]
        except KeyError:
            raise NotFound(f"storage {name[:200]!r} does not exist") from None

    def group_of(self, instance_id: str) -> str | None:
        """O(1): the instance's group, or None if it is not registered (the tenancy check)."""
        instance = self._instances.cache.get(instance_id)
        return None if instance is None else instance.instance_group

    def get_account(self, user_name: str) -> Account | None:
        return self._accounts.cache.get(user_name)

    def get_token(self, token_id: str) -> Token | None:
        return self._tokens.cache.get(token_id)

    def list_tokens(self, user_name: str = "") -> list[Token]:
        """Every token, or those of ``user_name`` ("" = all)."""
        found = [t for t in list(self._tokens.cache.values()) if not user_name or t.user_name == user_name]
        return sorted(found, key=lambda t: (t.user_name, t.create_time, t.token_id))

    def list_storages(self) -> list[Storage]:
        return sorted(list(self._storages.cache.values()), key=lambda s: s.global_unique_name)

    def list_groups(self) -> list[InstanceGroup]:
        return sorted(list(self._groups.cache.values()), key=lambda g: g.name)

    def list_instances(self, group: str = "") -> list[Instance]:
        """Every instance, or those of ``group`` ("" = all)."""
        found = [i for i in list(self._instances.cache.values()) if not group or i.instance_group == group]
        return sorted(found, key=lambda i: i.instance_id)

    def list_accounts(self) -> list[Account]:
        return sorted(list(self._accounts.cache.values()), key=lambda a: a.user_name)

    def counts(self) -> dict[str, int]:
        """Entries per table, read from the store (a cheap liveness check of the store)."""
        with self._store.read() as view:
            return {t.kind: view.count(t.db) for t in self._all_tables()}

    def gen_config_snapshot(self) -> DecodedMap:
        """Everything in the registry (accounts with their hashes, tokens as digests), as one map."""
        with self._store.read() as view:
            snapshot = Snapshot(
                format=SNAPSHOT_FORMAT,
                created_time=now_ms(),
                storages=self._storages.all(view),
                instance_groups=self._groups.all(view),
                instances=self._instances.all(view),
                accounts=self._accounts.all(view),
                tokens=self._tokens.all(view),
            )
        return to_wire(snapshot)

    def load_config_snapshot(self, data: Mapping[str, object] | str, caller: str | None = None) -> dict[str, int]:
        """Validate a whole snapshot, then replace the registry with it in one transaction.

        Refused (STILL_REFERENCED) if it would leave no admin while there is one now, or drop
        ``caller`` (the admin making the call) as an admin: either would lock people out.
        """
        snapshot = check_snapshot(parse_snapshot(data), self._data_dir)
        for i, s in enumerate(snapshot.storages):
            others = [(o.global_unique_name, o.storage_type, o.storage_spec) for o in snapshot.storages[:i]]
            check_placement(s.storage_type, s.global_unique_name, s.storage_spec, others, self.roots)
        tables: dict[str, list[Any]] = {
            STORAGE: snapshot.storages,
            GROUP: snapshot.instance_groups,
            INSTANCE: snapshot.instances,
            ACCOUNT: snapshot.accounts,
            TOKEN: snapshot.tokens,
        }
        with self._store.write() as txn:
            self._check_snapshot_admins(txn, snapshot.accounts, caller)
            snapshot.storages = [self._keep_storage_id(txn, s) for s in snapshot.storages]
            for kind, records in tables.items():
                table = self._tables[kind]
                # Delete only what the snapshot lacks: a delete-then-put of a kept record would tell
                # observers it was removed (and the data plane would drop its blocks).
                keep = {table.key(r) for r in records}
                for name in [k.decode() for k, _ in txn.scan(table.db)]:
                    if name not in keep:
                        table.delete(txn, name, self._changed)
                for record in records:
                    table.put(txn, record, self._changed)
        return {kind: len(records) for kind, records in tables.items()}

    def _keep_storage_id(self, txn: ReadTxn, storage: Storage) -> Storage:
        """A loaded storage keeps the id this registry gave it (its marker names it), else the
        snapshot's, else a new one."""
        current = self._storages.read(txn, storage.global_unique_name)
        sid = (current.storage_id if current is not None else "") or storage.storage_id or new_id()
        return msgspec.structs.replace(storage, storage_id=sid)

    def _check_snapshot_admins(self, txn: ReadTxn, accounts: list[Account], caller: str | None) -> None:
        admins = {a.user_name for a in accounts if a.role == "admin"}
        if not admins and any(a.role == "admin" for a in self._accounts.all(txn)):
            raise Conflict(
                "config_snapshot.accounts: no admin account; loading it would remove every admin "
                "(and lock everyone out when auth is on)",
                Code.STILL_REFERENCED,
            )
        if caller is not None and caller not in admins:
            raise Conflict(
                f"config_snapshot.accounts: {caller!r}, the account you are calling as, is not an admin in it; "
                "add it to the snapshot (or load it as one of the snapshot's admins)",
                Code.STILL_REFERENCED,
            )


__all__ = [
    "ACCOUNT", "DEFAULT_GROUP", "DEFAULT_STORAGE", "GROUP", "INSTANCE", "STORAGE", "TOKEN", "Observer",
    "Registration", "Registry", "RemovalGuard", "instance_not_found", "new_id",
]

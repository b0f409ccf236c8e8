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

import logging
import os
import secrets
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec

from kvcm.backends.metastore.base import MetaStore, ReadTxn, WriteTxn
from kvcm.backends.storage.roots import StorageRoots, check_placement
from kvcm.control.passwords import hash_password
from kvcm.control.records import (
    ALL_GROUPS,
    SNAPSHOT_FORMAT,
    Account,
    Instance,
    InstanceGroup,
    ReclaimStrategy,
    Snapshot,
    Storage,
    Token,
    check_account,
    check_group,
    check_instance,
    check_snapshot,
    check_storage,
    check_token_label,
    convert,
    decoder,
    encode,
    identity_difference,
    new_token,
    now_ms,
    parse_snapshot,
    to_wire,
)
from kvcm.errors import Code, Conflict, InvalidArgument, NotFound, error
from kvcm.proto import schema

log = logging.getLogger("kvcm.control.registry")

R = TypeVar("R", bound=msgspec.Struct)

#: Kinds passed to ``on_change`` observers, one per table.
STORAGE, GROUP, INSTANCE, ACCOUNT, TOKEN = "storage", "instance_group", "instance", "account", "token"
DEFAULT_STORAGE, DEFAULT_GROUP = "default-file", "default"
_SCHEMA_KEY, _SCHEMA = b"registry.schema", b"1"
# The id of this data dir's metadata, named by the ownership marker of every storage it records
# (kvcm.backends.storage.ownership): a store made anew gets a new id, so its storages can tell.
_DATA_DIR_ID_KEY = b"data_dir.id"


def new_id() -> str:
    """A fresh storage or data-dir id: 8 hex digits (32 random bits)."""
    return secrets.token_hex(4)
_DEFAULTS_KEY = b"registry.defaults_created"

Observer = Callable[[str, str], None]
#: ``guard(txn, kind, name) -> reason or None``; a reason refuses the removal (STILL_REFERENCED).
RemovalGuard = Callable[[ReadTxn, str, str], "str | None"]


def instance_not_found(instance_id: str) -> NotFound:
    """The one answer for an unknown instance id (tenancy gives it for another tenant's too)."""
    return NotFound(f"instance {instance_id[:200]!r} is not registered", Code.INSTANCE_NOT_EXIST)


class Registration(NamedTuple):
    """What ``register_instance`` did: the stored instance, whether it is new, and the group's
    candidate storages in order (Tair's ``storage_configs``)."""

    instance: Instance
    created: bool
    storages: list[Storage]


class _Table(Generic[R]):
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


class Registry:
    """CRUD over the registry with Tair's rules (and without its known bugs)."""

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
        self._storages = _Table(STORAGE, "storages", Storage, lambda s: s.global_unique_name)
        self._groups = _Table(GROUP, "groups", InstanceGroup, lambda g: g.name)
        self._instances = _Table(INSTANCE, "instances", Instance, lambda i: i.instance_id)
        self._accounts = _Table(ACCOUNT, "accounts", Account, lambda a: a.user_name)
        self._tokens = _Table(TOKEN, "tokens", Token, lambda t: t.token_id)
        self._tables: dict[str, _Table[Any]] = {t.kind: t for t in self._all_tables()}
        self._observers: list[Observer] = []
        self._guards: list[RemovalGuard] = []
        self._open()
        if data_dir is not None:
            self.ensure_defaults(data_dir)

    def _all_tables(self) -> tuple[_Table[Any], ...]:
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
            elif schema != _SCHEMA:
                raise error(
                    Code.UNSUPPORTED, f"registry schema {schema!r} is newer than this kvcm supports ({_SCHEMA!r})"
                )
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

    # -- hooks --------------------------------------------------------------------------------

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

    # -- reads (cache) ------------------------------------------------------------------------

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

    # -- storages -----------------------------------------------------------------------------

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
                    f"storage {name!r} is still a storage candidate of instance group(s) {_names(users)}; "
                    "remove it from their storage_candidates first",
                    Code.STILL_REFERENCED,
                )
            self._run_guards(txn, STORAGE, name)
            self._storages.delete(txn, name, self._changed)

    # -- instance groups ----------------------------------------------------------------------

    def create_group(self, group: InstanceGroup) -> InstanceGroup:
        """:raises Conflict: DUPLICATE_ENTITY if it exists. Version starts at 1."""
        group = check_group(group)
        with self._store.write() as txn:
            if self._groups.read(txn, group.name) is not None:
                raise Conflict(f"instance group {group.name!r} already exists", Code.DUPLICATE_ENTITY)
            return self._put_new_group(txn, group)

    def _put_new_group(self, txn: WriteTxn, group: InstanceGroup) -> InstanceGroup:
        self._check_candidates(txn, group)
        now = now_ms()
        group = msgspec.structs.replace(group, version=1, create_time=now, update_time=now)
        self._groups.put(txn, group, self._changed)
        return group

    def update_group(self, changes: dict[str, Any], current_version: int) -> InstanceGroup:
        """Merge ``changes`` (a partial group map with its ``name``) into the group if its version
        is still ``current_version``; the stored version becomes ``current_version + 1``.

        :raises Conflict: VERSION_CONFLICT when the group changed since the caller read it.
        :raises InvalidArgument: for any key, at any depth, that is not a group field — first,
            whatever the version, so a typo is never reported as a conflict.
        """
        schema.check_partial(changes, InstanceGroup, "instance_group")
        name = changes.get("name")
        if not isinstance(name, str):
            raise InvalidArgument("instance_group.name: required")
        with self._store.write() as txn:
            old = self._must(txn, self._groups, name)
            if old.version != current_version:
                raise Conflict(
                    f"instance group {name!r} is at version {old.version}, not {current_version}; re-read it and retry",
                    Code.VERSION_CONFLICT,
                )
            merged = _merge(to_wire(old), {k: v for k, v in changes.items() if k not in _GROUP_SERVER_FIELDS})
            new = check_group(convert(merged, InstanceGroup, "instance_group"))
            self._check_candidates(txn, new)
            new = msgspec.structs.replace(
                new, version=old.version + 1, create_time=old.create_time, update_time=now_ms()
            )
            self._groups.put(txn, new, self._changed)
            return new

    def _check_candidates(self, txn: ReadTxn, group: InstanceGroup) -> None:
        for i, name in enumerate(group.storage_candidates):
            if self._storages.read(txn, name) is None:
                raise InvalidArgument(f"instance_group.storage_candidates[{i}]: storage {name!r} does not exist")

    def remove_group(self, name: str) -> None:
        """:raises Conflict: STILL_REFERENCED while instances belong to it."""
        with self._store.write() as txn:
            self._must(txn, self._groups, name)
            members = [i.instance_id for i in self._instances.all(txn) if i.instance_group == name]
            if members:
                raise Conflict(
                    f"instance group {name!r} still has {len(members)} instance(s) ({_names(members)}); "
                    "remove them first",
                    Code.STILL_REFERENCED,
                )
            self._run_guards(txn, GROUP, name)
            self._groups.delete(txn, name, self._changed)

    # -- instances ----------------------------------------------------------------------------

    def register_instance(self, instance: Instance, given: frozenset[str] | None = None) -> Registration:
        """Register, or confirm a registration of the same instance (Tair's idempotency).

        ``given``: the optional identity fields the caller gave (``OPTIONAL_IDENTITY_FIELDS``);
        those left out are not compared, so a worker attaches to an instance an operator
        registered without restating its deployment. None compares every field.

        :raises Conflict: DUPLICATE_ENTITY if the id exists with another group, block size, specs,
            spec groups or deployment (order of specs and groups does not matter); the message
            names the field and both values.
        :raises NotFound: the group does not exist.
        """
        instance = check_instance(instance)
        with self._store.write() as txn:
            old = self._instances.read(txn, instance.instance_id)
            if old is not None:
                difference = identity_difference(old, instance, given)
                if difference is not None:
                    raise Conflict(
                        f"instance {instance.instance_id!r} is already registered with another {difference}",
                        Code.DUPLICATE_ENTITY,
                    )
                return Registration(
                    old, False, self._candidates(txn, self._must(txn, self._groups, old.instance_group))
                )
            group = self._must(txn, self._groups, instance.instance_group)
            self._check_capacity(txn, group)
            new = msgspec.structs.replace(
                instance, quota_group_name=group.global_quota_group_name, create_time=now_ms()
            )
            self._instances.put(txn, new, self._changed)
            return Registration(new, True, self._candidates(txn, group))

    def _candidates(self, view: ReadTxn, group: InstanceGroup) -> list[Storage]:
        found = (self._storages.read(view, name) for name in group.storage_candidates)
        return [s for s in found if s is not None]

    def _check_capacity(self, txn: ReadTxn, group: InstanceGroup) -> None:
        if group.max_instance_count <= 0:
            return
        count = sum(1 for i in self._instances.all(txn) if i.instance_group == group.name)
        if count >= group.max_instance_count:
            raise error(
                Code.REACH_MAX_ENTITY_CAPACITY,
                f"instance group {group.name!r} already has max_instance_count={group.max_instance_count} instances",
            )

    def remove_instance(self, instance_id: str) -> Instance:
        """Unregister; observers learn of it (the data plane then drops the instance's blocks)."""
        with self._store.write() as txn:
            old = self._instances.read(txn, instance_id)
            if old is None:
                raise instance_not_found(instance_id)
            self._run_guards(txn, INSTANCE, instance_id)
            self._instances.delete(txn, instance_id, self._changed)
            return old

    # -- accounts -----------------------------------------------------------------------------

    def add_account(
        self, user_name: str, password: str, role: str = "user", groups: list[str] | None = None
    ) -> Account:
        """``groups``: the instance groups the account may use; none by default (``["*"]`` = all)."""
        normalized = check_account(user_name, role, [] if groups is None else groups)
        password_hash = hash_password(password)  # slow: outside the write transaction
        with self._store.write() as txn:
            if self._accounts.read(txn, user_name) is not None:
                raise Conflict(f"account {user_name!r} already exists", Code.DUPLICATE_ENTITY)
            now = now_ms()
            account = Account(
                user_name=user_name,
                role=role,
                password_hash=password_hash,
                groups=normalized or [],
                create_time=now,
                update_time=now,
            )
            self._accounts.put(txn, account, self._changed)
            return account

    def update_account(
        self,
        user_name: str,
        password: str | None = None,
        role: str | None = None,
        groups: list[str] | None = None,
        caller: str | None = None,
    ) -> Account:
        """Change a password, role and/or groups. The last admin cannot be demoted, nor can
        ``caller`` (the admin making the call) demote itself."""
        normalized = check_account(user_name, role or "user", groups)
        password_hash = None if password is None else hash_password(password)
        with self._store.write() as txn:
            old = self._must(txn, self._accounts, user_name)
            if role == "user" and old.role == "admin":
                self._not_the_caller(user_name, caller, "demote")
                self._keep_an_admin(txn, user_name)
            new = msgspec.structs.replace(
                old,
                role=role or old.role,
                password_hash=password_hash or old.password_hash,
                groups=old.groups if normalized is None else normalized,
                update_time=now_ms(),
            )
            self._accounts.put(txn, new, self._changed)
            return new

    def delete_account(self, user_name: str, caller: str | None = None) -> None:
        """The last admin cannot be deleted (it would lock everyone out when auth is on), nor can
        ``caller`` delete itself. The account's API tokens go with it, in the same commit."""
        self._not_the_caller(user_name, caller, "delete")
        with self._store.write() as txn:
            old = self._must(txn, self._accounts, user_name)
            if old.role == "admin":
                self._keep_an_admin(txn, user_name)
            for token in self._tokens.all(txn):
                if token.user_name == user_name:
                    self._tokens.delete(txn, token.token_id, self._changed)
            self._accounts.delete(txn, user_name, self._changed)

    def _keep_an_admin(self, txn: ReadTxn, leaving: str) -> None:
        if not any(a.role == "admin" and a.user_name != leaving for a in self._accounts.all(txn)):
            raise Conflict(f"account {leaving!r} is the last admin; add another admin first", Code.STILL_REFERENCED)

    @staticmethod
    def _not_the_caller(user_name: str, caller: str | None, what: str) -> None:
        if caller is not None and caller == user_name:
            raise Conflict(
                f"you cannot {what} the account you are calling as ({user_name!r}); another admin can",
                Code.STILL_REFERENCED,
            )

    def ensure_admin(self, user_name: str, password: str) -> bool:
        """Create ``user_name`` as admin unless some admin exists. Returns True if created."""
        if any(a.role == "admin" for a in self._accounts.cache.values()):
            return False
        if self._accounts.cache.get(user_name) is not None:
            self.update_account(user_name, password, "admin", [ALL_GROUPS])
        else:
            self.add_account(user_name, password, "admin", [ALL_GROUPS])
        return True

    # -- API tokens ---------------------------------------------------------------------------

    def add_token(self, user_name: str, name: str = "", ttl_seconds: float = 0.0) -> tuple[str, Token]:
        """A new token for ``user_name``: returns the token (its only appearance) and the stored
        record (its digest). ``ttl_seconds`` 0 = it never expires."""
        check_token_label(name)
        if not 0 <= ttl_seconds <= _MAX_TOKEN_TTL_S:
            raise InvalidArgument(f"ttl_seconds: must be in 0..{_MAX_TOKEN_TTL_S} (0 = no expiry)")
        token_id, token, digest = new_token()
        with self._store.write() as txn:
            self._must(txn, self._accounts, user_name)
            now = now_ms()
            expire = now + max(1, int(ttl_seconds * 1000)) if ttl_seconds else 0
            record = Token(
                token_id=token_id, user_name=user_name, digest=digest, name=name, create_time=now, expire_time=expire
            )
            self._tokens.put(txn, record, self._changed)
        return token, record

    def revoke_token(self, token_id: str) -> Token:
        """Delete a token; it stops working with the next request."""
        with self._store.write() as txn:
            old = self._must(txn, self._tokens, token_id)
            self._tokens.delete(txn, token_id, self._changed)
            return old

    # -- snapshots ----------------------------------------------------------------------------

    def gen_config_snapshot(self) -> dict[str, Any]:
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

    def load_config_snapshot(self, data: dict[str, Any] | str, caller: str | None = None) -> dict[str, int]:
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

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _must(txn: ReadTxn, table: _Table[R], name: str) -> R:
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


#: Longest token lifetime ``add_token`` accepts (ten years); 0 means no expiry.
_MAX_TOKEN_TTL_S = 10 * 365 * 86400

#: Group fields the server owns: an update never takes them from the caller.
_GROUP_SERVER_FIELDS = ("version", "create_time", "update_time")


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Nested maps merge key by key; anything else (lists included) is replaced."""
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")

"""Registry records (storages, instance groups, instances, accounts) and their validation.

Records are ``msgspec.Struct``s. Field names are Tair KVCM's proto field names (snake_case); enums
are lower-case strings (``"file"``, ``"lru"``, ``"admin"``). The same encoding serves three uses:
values in the store (:func:`encode` / :func:`decoder`, msgpack), wire replies
(:func:`to_wire`, plain maps) and config snapshots.

Validation lives next to the records: each ``check_*`` function raises
:class:`~kvcm.errors.InvalidArgument` naming the offending field, and returns the normalized
record (defaults filled in, spec groups sorted) that the registry stores. Storage specs are the
one exception: their fields belong to the storage backends, so :func:`check_storage` hands them
to :func:`kvcm.backends.storage.registry.normalize_spec` rather than keeping a second set of rules.

Passwords are kept only as salted scrypt hashes, ``scrypt2$N$r$p$<salt>$<digest>`` (base64
parts), so the cost travels with the hash and can be raised later; they are verified in
constant time. API tokens are kept only as SHA-256 digests (:class:`Token`). A :class:`Snapshot` is the whole registry; :func:`parse_snapshot` and
:func:`check_snapshot` validate one completely before ``load_config_snapshot`` touches the store.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import msgspec

from kvcm.backends.migrations import REGISTRY_SNAPSHOT
from kvcm.backends.storage.registry import STORAGE_BACKENDS, normalize_spec
from kvcm.control.passwords import CONTROL_CHARS, check_password_hash
from kvcm.errors import InvalidArgument
from kvcm.proto import schema
from kvcm.proto.requests import control
from kvcm.proto.wire import DecodedMap

T = TypeVar("T")
C = TypeVar("C")  # a checked record

# The shapes requests carry are the records stored: one declaration each, in kvcm.proto.
InstanceGroup = control.InstanceGroup
Quota = control.Quota
QuotaConfig = control.QuotaConfig
ReclaimStrategy = control.ReclaimStrategy
LocationSpecInfo = control.LocationSpecInfo
LocationSpecGroup = control.LocationSpecGroup
ModelDeployment = control.ModelDeployment

#: Storage types (those of the storage backends), and the Tair spellings accepted on input for them.
STORAGE_TYPES: tuple[str, ...] = tuple(STORAGE_BACKENDS)
STORAGE_TYPE_ALIASES: dict[str, str] = {
    "nfs": "file",
    "hf3fs": "3fs",
    "pace": "tairmempool",
    "tair_mem_pool": "tairmempool",
}
RECLAIM_POLICIES: tuple[str, ...] = ("lru", "lfu", "ttl", "leaf_lru")
ROLES: tuple[str, ...] = ("user", "admin")

# Storage and group names become URI hosts, so they keep to host-safe characters.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Instance ids and spec names become path segments of file URIs: no "/" and no "." / "..".
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,255}")
_MAX_BLOCK_SIZE = 1 << 20
_MAX_SPECS = 4096


def now_ms() -> int:
    """Wall-clock milliseconds, the unit of every ``*_time`` field."""
    return int(time.time() * 1000)


# -- storages ------------------------------------------------------------------------------------


class Storage(control.Storage):
    """One data store kvcm hands out URIs on, strict (the fields are the reply's,
    :class:`kvcm.proto.results.StorageConfig`). ``enabled`` is the admin switch, ``available``
    the health probe's verdict; a storage takes writes only when both are true.

    ``storage_spec`` is stored normalized (:func:`check_storage`): complete, with every default
    of the backend filled in and paths absolute. For typed access, open or build the backend
    (:data:`kvcm.backends.storage.registry.STORAGE_BACKENDS`); its ``spec`` is this same map.
    ``storage_id`` is assigned by kvcm when the storage is added (8 hex digits, never reused):
    written in the ownership marker of its directory and in every container name it generates;
    "" only on records from before ownership markers, until their first open assigns one."""

    @property
    def usable(self) -> bool:
        return self.enabled and self.available


def check_storage(storage: Storage, data_dir: str | None = None) -> Storage:
    """Validate a storage definition; return it with its type normalized (Tair aliases resolved)
    and its spec complete.

    The spec is the backend's business: :func:`kvcm.backends.storage.registry.normalize_spec` checks it
    with the backend's own reader (fields, defaults, unknown fields refused) and fills in every
    default, so the registry never accepts what the backend would refuse or vice versa. A
    relative ``file`` ``root_path`` is resolved under ``data_dir`` (refused without one)."""
    check_name(storage.global_unique_name, "storage.global_unique_name")
    kind = STORAGE_TYPE_ALIASES.get(storage.storage_type, storage.storage_type)
    spec = normalize_spec(kind, storage.global_unique_name, storage.storage_spec, data_dir)
    return msgspec.structs.replace(storage, storage_type=kind, storage_spec=spec)


# -- instance groups -----------------------------------------------------------------------------


def check_group(group: InstanceGroup) -> InstanceGroup:
    """Validate a group on its own (that its candidates exist is the registry's check)."""
    check_name(group.name, "instance_group.name")
    if not group.storage_candidates:
        raise InvalidArgument("instance_group.storage_candidates: at least one storage is required")
    _check_unique(group.storage_candidates, "instance_group.storage_candidates")
    for i, name in enumerate(group.storage_candidates):
        check_name(name, f"instance_group.storage_candidates[{i}]")
    if group.max_instance_count < 0:
        raise InvalidArgument("instance_group.max_instance_count: must not be negative")
    if group.max_block_count < 0:
        raise InvalidArgument("instance_group.max_block_count: must not be negative (0 = unlimited)")
    _check_quota(group.quota)
    _check_reclaim(group.reclaim_strategy)
    return group


def _check_quota(quota: Quota) -> None:
    if quota.capacity < 0:
        raise InvalidArgument("instance_group.quota.capacity: must not be negative")
    seen: set[str] = set()
    for i, item in enumerate(quota.quota_config):
        where = f"instance_group.quota.quota_config[{i}]"
        item.storage_type = STORAGE_TYPE_ALIASES.get(item.storage_type, item.storage_type)
        if item.storage_type not in STORAGE_TYPES:
            raise InvalidArgument(
                f"{where}.storage_type: {item.storage_type!r} is not one of {', '.join(STORAGE_TYPES)}"
            )
        if item.storage_type in seen:
            raise InvalidArgument(f"{where}.storage_type: {item.storage_type!r} appears twice")
        if item.capacity < 0:
            raise InvalidArgument(f"{where}.capacity: must not be negative")
        seen.add(item.storage_type)


def _check_reclaim(strategy: ReclaimStrategy) -> None:
    where = "instance_group.reclaim_strategy"
    if strategy.reclaim_policy not in RECLAIM_POLICIES:
        raise InvalidArgument(
            f"{where}.reclaim_policy: {strategy.reclaim_policy!r} is not one of {', '.join(RECLAIM_POLICIES)}"
        )
    # > 1 is allowed: Tair's way of saying "never by share" (the quota bounds usage at 1).
    if not 0 < strategy.used_percentage < math.inf:
        raise InvalidArgument(f"{where}.used_percentage: must be a positive number, got {strategy.used_percentage}")
    if strategy.used_bytes < 0:
        raise InvalidArgument(f"{where}.used_bytes: must not be negative (0 = no byte watermark)")
    if strategy.delay_before_delete_ms < 0:
        raise InvalidArgument(f"{where}.delay_before_delete_ms: must not be negative")
    if strategy.ttl_seconds < 0 or (strategy.reclaim_policy == "ttl" and strategy.ttl_seconds == 0):
        raise InvalidArgument(f"{where}.ttl_seconds: must be positive for the 'ttl' policy and never negative")


# -- instances -----------------------------------------------------------------------------------


class Instance(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One model deployment. Stored with spec groups sorted by name (spec names sorted too)."""

    instance_id: str
    instance_group: str = msgspec.field(name="instance_group_name")
    quota_group_name: str = ""
    block_size: int
    location_spec_infos: list[LocationSpecInfo]
    location_spec_groups: list[LocationSpecGroup] = []
    model_deployment: ModelDeployment = msgspec.field(default_factory=ModelDeployment)
    create_time: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all specs."""
        return sum(spec.size for spec in self.location_spec_infos)


def check_instance(instance: Instance) -> Instance:
    """Validate an instance; return it with its spec groups in canonical (sorted) order."""
    check_name(instance.instance_id, "instance_id", _ID)
    check_name(instance.instance_group, "instance_group")
    if not 0 < instance.block_size <= _MAX_BLOCK_SIZE:
        raise InvalidArgument(f"block_size: must be in 1..{_MAX_BLOCK_SIZE}, got {instance.block_size}")
    specs = instance.location_spec_infos
    if len(specs) > _MAX_SPECS:  # none: a router-only instance, refused by the write RPCs
        raise InvalidArgument(f"location_spec_infos: at most {_MAX_SPECS} specs")
    for i, spec in enumerate(specs):
        check_name(spec.name, f"location_spec_infos[{i}].name", _ID)
        if spec.size <= 0:
            raise InvalidArgument(f"location_spec_infos[{i}].size: must be positive, got {spec.size}")
    _check_unique([s.name for s in specs], "location_spec_infos")
    groups = [_check_spec_group(g, i, {s.name for s in specs}) for i, g in enumerate(instance.location_spec_groups)]
    _check_unique([g.name for g in groups], "location_spec_groups")
    return msgspec.structs.replace(instance, location_spec_groups=sorted(groups, key=lambda g: g.name))


def _check_spec_group(group: LocationSpecGroup, i: int, spec_names: set[str]) -> LocationSpecGroup:
    where = f"location_spec_groups[{i}]"
    check_name(group.name, f"{where}.name", _ID)
    if not group.spec_names:
        raise InvalidArgument(f"{where}.spec_names: at least one spec name is required")
    _check_unique(group.spec_names, f"{where}.spec_names")
    unknown = [n for n in group.spec_names if n not in spec_names]
    if unknown:
        raise InvalidArgument(f"{where}.spec_names: {unknown[0]!r} is not in location_spec_infos")
    return LocationSpecGroup(group.name, sorted(group.spec_names))


#: The fields of an instance that must match for a repeated ``register_instance`` to be the same
#: registration, each as a comparable value: spec and group order do not matter (unlike Tair),
#: the instance group does, and a deployment's ``user_data`` is opaque.
IDENTITY_FIELDS = ("instance_group", "block_size", "location_spec_infos", "location_spec_groups", "model_deployment")

#: The fields a caller may leave out of ``register_instance`` to attach to an existing instance
#: whatever its value there; a new instance takes their defaults.
OPTIONAL_IDENTITY_FIELDS = frozenset({"location_spec_infos", "location_spec_groups", "model_deployment"})


def identity_value(instance: Instance, name: str) -> object:
    """One identity field of ``instance`` in its comparable form."""
    if name == "location_spec_infos":
        return sorted((s.name, s.size) for s in instance.location_spec_infos)
    if name == "location_spec_groups":
        return sorted((g.name, tuple(sorted(g.spec_names))) for g in instance.location_spec_groups)
    if name == "model_deployment":
        return msgspec.structs.replace(instance.model_deployment, user_data="")
    return getattr(instance, name)


def identity_difference(old: Instance, new: Instance, given: frozenset[str] | None = None) -> str | None:
    """The first identity field (among ``given``; all when None) in which ``new`` differs from
    ``old``, as ``"field: registered X, requested Y"``; None when they are the same registration."""
    for name in IDENTITY_FIELDS:
        if given is not None and name in OPTIONAL_IDENTITY_FIELDS and name not in given:
            continue
        before, after = identity_value(old, name), identity_value(new, name)
        if before != after:
            return f"{name}: registered {_shown(before)}, requested {_shown(after)}"
    return None


def _shown(value: object) -> str:
    if isinstance(value, ModelDeployment):
        changed = {f: getattr(value, f) for f in value.__struct_fields__
                   if f != "user_data" and getattr(value, f) != getattr(ModelDeployment(), f)}
        return repr(changed)
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


# -- accounts and API tokens ---------------------------------------------------------------------

#: The ``groups`` entry that means every instance group.
ALL_GROUPS = "*"
_MAX_GROUPS = 256


class Account(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A user. Only a salted scrypt hash of the password is ever stored (:func:`hash_password`).

    ``groups`` are the instance groups the account may use (``["*"]`` = every group; an admin
    may use every group whatever it says). A record or snapshot without the field reads as
    ``["*"]``: accounts from before tenancy could use every group, and keep doing so."""

    user_name: str
    role: str = "user"
    password_hash: str
    groups: list[str] = msgspec.field(default_factory=lambda: [ALL_GROUPS])
    create_time: int = 0
    update_time: int = 0


def check_account(user_name: str, role: str, groups: list[str] | None = None) -> list[str] | None:
    """Validate an account's name and role; return ``groups`` normalized (None stays None)."""
    check_name(user_name, "user_name", _ID)
    if role not in ROLES:
        raise InvalidArgument(f"role: {role!r} is not one of {', '.join(ROLES)}")
    return None if groups is None else check_groups(groups)


def is_user_name(value: str) -> bool:
    """Could ``value`` name an account (the rule :func:`check_account` applies)?"""
    return _ID.fullmatch(value) is not None


def check_groups(groups: list[str]) -> list[str]:
    """``["*"]``, or distinct instance-group names (they need not exist yet); returned sorted."""
    if len(groups) > _MAX_GROUPS:
        raise InvalidArgument(f"groups: at most {_MAX_GROUPS} names")
    _check_unique(groups, "groups")
    for i, name in enumerate(groups):
        if name != ALL_GROUPS:
            check_name(name, f"groups[{i}]")
    if ALL_GROUPS in groups and len(groups) > 1:
        raise InvalidArgument("groups: '*' already means every group; give it alone")
    return sorted(groups)


#: Every API token starts with this, so a token is recognisable (in a leak scan, say) and never
#: mistaken for a password.
TOKEN_PREFIX = "kvcm_"
_TOKEN_BYTES = 32
# The shape of a token; anything else (a huge string, say) is refused before it is hashed.
_TOKEN_TEXT = re.compile(r"kvcm_[A-Za-z0-9_-]{16,123}")
_TOKEN_ID = re.compile(r"[0-9a-f]{16}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_MAX_LABEL = 128


class Token(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An API token of an account. Only the SHA-256 ``digest`` of the token is stored; the token
    itself is shown once, by ``add_token``. It carries 256 random bits, so a fast unsalted digest
    leaves nothing to brute-force and a check stays one hash and one dict lookup."""

    token_id: str  # the public handle (list_tokens, revoke_token); reveals nothing of the token
    user_name: str
    digest: str  # hex SHA-256 of the token
    name: str = ""  # a label for people ("ci-runner")
    create_time: int = 0
    expire_time: int = 0  # wall-clock ms; 0 = never

    def expired(self, now: int) -> bool:
        return 0 < self.expire_time <= now


def new_token() -> tuple[str, str, str]:
    """A fresh ``(token_id, token, digest)``."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(_TOKEN_BYTES)
    return secrets.token_hex(8), token, token_digest(token)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def looks_like_token(token: str) -> bool:
    """Cheap shape check before hashing: prefix, bounded length, URL-safe base64 characters."""
    return _TOKEN_TEXT.fullmatch(token) is not None


def check_token_label(name: str) -> str:
    if len(name) > _MAX_LABEL or CONTROL_CHARS.search(name):
        raise InvalidArgument(f"name: at most {_MAX_LABEL} characters, no control characters")
    return name


def check_token(token: Token) -> Token:
    """A token record as a snapshot carries it (digest only)."""
    if not _TOKEN_ID.fullmatch(token.token_id):
        raise InvalidArgument("token_id: 16 lower-case hex digits expected")
    check_name(token.user_name, "user_name", _ID)
    if not _DIGEST.fullmatch(token.digest):
        raise InvalidArgument("digest: a lower-case hex SHA-256 expected")
    check_token_label(token.name)
    if token.expire_time < 0:
        raise InvalidArgument("expire_time: must not be negative")
    return token


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


# -- snapshots -------------------------------------------------------------------------------------


SNAPSHOT_FORMAT, SNAPSHOT_VERSION = "kvcm-registry", REGISTRY_SNAPSHOT.current


class Snapshot(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The whole registry, as ``gen_config_snapshot`` exports it.

    ``format`` is required: loading replaces the registry, so a map that is not a snapshot at
    all (``{}``, or a storage record passed by mistake) must not read as an empty one."""

    format: str
    version: int = SNAPSHOT_VERSION
    created_time: int = 0
    storages: list[Storage] = []
    instance_groups: list[InstanceGroup] = []
    instances: list[Instance] = []
    accounts: list[Account] = []
    tokens: list[Token] = []  # digests only: a snapshot never holds a usable token


def parse_snapshot(data: Mapping[str, object] | str) -> Snapshot:
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested beyond any snapshot
            raise InvalidArgument(f"config_snapshot: not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    snapshot = convert(data, Snapshot, "config_snapshot")
    if snapshot.format != SNAPSHOT_FORMAT:
        raise InvalidArgument(f"config_snapshot: format {snapshot.format!r} is not {SNAPSHOT_FORMAT!r}")
    if (problem := REGISTRY_SNAPSHOT.refusal(snapshot.version)) is not None:
        raise InvalidArgument(f"config_snapshot: {problem}")
    return snapshot


def check_snapshot(snapshot: Snapshot, data_dir: str | None = None) -> Snapshot:
    """Every record valid, names unique, every reference resolved: else nothing is loaded.
    ``data_dir`` resolves relative ``file`` root paths, as in :func:`check_storage`."""
    storages = [_at(lambda s: check_storage(s, data_dir), s, "storages", i) for i, s in enumerate(snapshot.storages)]
    groups = [_at(check_group, g, "instance_groups", i) for i, g in enumerate(snapshot.instance_groups)]
    instances = [_at(check_instance, x, "instances", i) for i, x in enumerate(snapshot.instances)]
    accounts = [_at(_check_snapshot_account, a, "accounts", i) for i, a in enumerate(snapshot.accounts)]
    tokens = [_at(check_token, t, "tokens", i) for i, t in enumerate(snapshot.tokens)]
    storage_names = _unique([s.global_unique_name for s in storages], "storages")
    group_names = _unique([g.name for g in groups], "instance_groups")
    _unique([x.instance_id for x in instances], "instances")
    user_names = _unique([a.user_name for a in accounts], "accounts")
    _unique([t.token_id for t in tokens], "tokens")
    _unique([t.digest for t in tokens], "tokens (digest)")
    for token in tokens:
        if token.user_name not in user_names:
            raise InvalidArgument(f"config_snapshot.tokens: {token.token_id!r} names unknown account {token.user_name!r}")
    for group in groups:
        for name in group.storage_candidates:
            if name not in storage_names:
                raise InvalidArgument(f"config_snapshot.instance_groups: {group.name!r} names unknown storage {name!r}")
    for instance in instances:
        if instance.instance_group not in group_names:
            raise InvalidArgument(
                f"config_snapshot.instances: {instance.instance_id!r} names unknown group {instance.instance_group!r}"
            )
    return msgspec.structs.replace(
        snapshot, storages=storages, instance_groups=groups, instances=instances, accounts=accounts, tokens=tokens
    )


def _check_snapshot_account(account: Account) -> Account:
    groups = check_account(account.user_name, account.role, account.groups)
    check_password_hash(account.password_hash)
    return msgspec.structs.replace(account, groups=groups)


def _at(check: Callable[[T], C], record: T, field: str, index: int) -> C:
    try:
        return check(record)
    except InvalidArgument as exc:
        raise InvalidArgument(f"config_snapshot.{field}[{index}]: {exc.message}") from None


def _unique(names: Iterable[str], field: str) -> set[str]:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidArgument(f"config_snapshot.{field}: {name!r} appears twice")
        seen.add(name)
    return seen


# -- shared helpers ------------------------------------------------------------------------------


def check_name(value: str, field: str, pattern: re.Pattern[str] = _NAME) -> None:
    """Names are identifiers: they end up in URIs, file paths and log lines."""
    if not pattern.fullmatch(value):
        raise InvalidArgument(
            f"{field}: {value[:200]!r} is not a valid name (letters, digits and {_allowed(pattern)}; "
            "starting with a letter or digit)"
        )


def _allowed(pattern: re.Pattern[str]) -> str:
    return "'._-'" if pattern is _NAME else "'._:@+=-'"


def _check_unique(values: list[str], field: str) -> None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise InvalidArgument(f"{field}: {value[:200]!r} appears twice")
        seen.add(value)


def convert(obj: object, kind: type[T], where: str) -> T:
    """``msgspec.convert`` (strict) with errors as InvalidArgument naming the field under ``where``
    (unknown fields with their path and a "did you mean", see :func:`kvcm.proto.schema.describe`)."""
    try:
        return msgspec.convert(obj, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(schema.describe(kind, exc, where)) from None


def encode(record: msgspec.Struct) -> bytes:
    """Store encoding of a record (msgpack)."""
    return msgspec.msgpack.encode(record)


def decoder(kind: type[T]) -> msgspec.msgpack.Decoder[T]:
    return msgspec.msgpack.Decoder(kind)


def to_wire(record: msgspec.Struct) -> DecodedMap:
    """A record as a plain map with Tair field names (wire replies, snapshots)."""
    out: DecodedMap = msgspec.to_builtins(record)
    return out

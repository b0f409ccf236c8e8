"""Control-plane requests: storages, instance groups, instances, accounts, snapshots, health.

Field names are Tair's proto field names; every request may carry ``trace_id`` and ``auth``; an
unknown field, at any depth, is INVALID_ARGUMENT (:mod:`kvcm.proto.schema`). The record shapes
a request carries (:class:`Storage`, :class:`InstanceGroup`, the location specs) are the ones
the server stores, strict here: the server's records are these classes.
"""

from __future__ import annotations

import msgspec

from kvcm.proto import results
from kvcm.proto.schema import RequestBase

__all__ = [
    "AddAccountRequest", "AddStorageRequest", "CreateInstanceGroupRequest", "Empty", "GroupNameRequest",
    "InstanceGroup", "InstanceIdRequest", "ListInstanceInfoRequest", "LoadConfigSnapshotRequest",
    "LocationSpecGroup", "LocationSpecInfo", "ModelDeployment", "Quota", "QuotaConfig", "ReclaimStrategy",
    "RegisterInstanceRequest", "Storage", "StorageNameRequest", "StorageSpecsRequest", "UpdateAccountRequest",
    "UpdateInstanceGroupRequest", "UpdateStorageRequest", "UserNameRequest",
]


# -- the record shapes requests carry ---------------------------------------------------------------


class Storage(results.StorageConfig, forbid_unknown_fields=True):
    """One data store kvcm hands out URIs on (the reply's :class:`~kvcm.proto.results.StorageConfig`,
    strict). ``storage_spec`` is the storage type's own: the server checks it with the backend's reader."""


class QuotaConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    storage_type: str
    capacity: int = 0  # bytes; 0 = unlimited


class Quota(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    capacity: int = 0  # total bytes of the group; 0 = unlimited
    quota_config: list[QuotaConfig] = []


class ReclaimStrategy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    reclaim_policy: str = "lru"
    # Reclaim when usage / quota reaches this share (any positive value: above 1 it never fires,
    # Tair's "never trigger by share"), or when usage reaches used_bytes, whichever comes first.
    used_percentage: float = 0.9
    used_bytes: int = 0  # absolute watermark in bytes (Tair's trigger_strategy.used_size); 0 = none
    delay_before_delete_ms: int = 1000  # grace between "deleting" and freeing the data
    ttl_seconds: int = 0  # > 0: blocks written this long ago are reclaimed (reads do not extend it)


class InstanceGroup(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Quota owner of a set of instances. ``version`` is bumped on every update (CAS)."""

    name: str
    storage_candidates: list[str]
    global_quota_group_name: str = ""
    max_instance_count: int = 0  # 0 = unlimited
    # Most block copies the group indexes (Tair's meta_indexer_config.max_key_count); 0 = unlimited.
    max_block_count: int = 0
    quota: Quota = msgspec.field(default_factory=Quota)
    reclaim_strategy: ReclaimStrategy = msgspec.field(default_factory=ReclaimStrategy)
    user_data: str = ""
    version: int = 1
    create_time: int = 0
    update_time: int = 0


class LocationSpecInfo(results.SpecInfo, forbid_unknown_fields=True):
    """A location spec (bytes of one shard for one block), strict: as stored and as requests send it."""


class LocationSpecGroup(results.SpecGroup, forbid_unknown_fields=True):
    """Named specs written together, strict."""


class ModelDeployment(results.ModelDeployment, forbid_unknown_fields=True, omit_defaults=False):
    """A deployment, strict and with every field written (``user_data`` is opaque: not part of
    the identity of a deployment)."""


# -- requests -------------------------------------------------------------------------------------


# msgspec.Struct named again only so that linters see a Struct (its defaults are copied, not shared).
class _Request(RequestBase, msgspec.Struct, kw_only=True):
    pass


class Empty(_Request):
    pass


class AddStorageRequest(_Request):
    storage: Storage
    # Take over a directory that is not empty and carries no ownership marker of this kvcm
    # (files kvcm did not name are still never swept or deleted).
    adopt_directory: bool = False


class UpdateStorageRequest(_Request):
    storage: Storage
    force_update: bool = False  # accepted for Tair compatibility; updates are always in place


class StorageNameRequest(_Request):
    storage_unique_name: str


class CreateInstanceGroupRequest(_Request):
    instance_group: InstanceGroup
    shard: str = ""  # sharded deployments: the shard to place the group on ("" = the least loaded)


class UpdateInstanceGroupRequest(_Request):
    instance_group: dict[str, object]  # partial: the fields given replace the stored ones
    current_version: int | None = None
    expected_version: int | None = None  # alias of current_version


class GroupNameRequest(_Request):
    name: str


class RegisterInstanceRequest(_Request):
    instance_group: str
    instance_id: str
    block_size: int
    # Left out: attach to the registered instance whatever its value; a new instance takes the
    # default (no specs = a router-only instance, engine tier only).
    location_spec_infos: list[LocationSpecInfo] | msgspec.UnsetType = msgspec.UNSET
    model_deployment: ModelDeployment | msgspec.UnsetType = msgspec.UNSET
    location_spec_groups: list[LocationSpecGroup] | msgspec.UnsetType = msgspec.UNSET


class InstanceIdRequest(_Request):
    instance_id: str
    instance_group: str = ""  # accepted and ignored, as in Tair


class StorageSpecsRequest(_Request):
    instance_id: str


class ListInstanceInfoRequest(_Request):
    instance_group_name: str = ""  # "" = all groups


class AddAccountRequest(_Request):
    user_name: str
    password: str
    role: str = "user"
    groups: list[str] = []  # instance groups the account may use; none by default, ["*"] = all


class UpdateAccountRequest(_Request):
    user_name: str
    password: str | None = None
    role: str | None = None
    groups: list[str] | None = None  # replaces the account's groups when given


class UserNameRequest(_Request):
    user_name: str


class LoadConfigSnapshotRequest(_Request):
    config_snapshot: dict[str, object] | str  # a gen_config_snapshot map, or its JSON text

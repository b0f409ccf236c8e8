"""Control-plane RPCs: storages, instance groups, instances, accounts, snapshots, health.

The requests are :mod:`kvcm.proto.requests.control`'s. Replies are plain maps; lists keep
Tair's (singular) field names (``storage``, ``instance_group``, ``instance_info``, ``accounts``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import msgspec

from kvcm.control.records import (
    OPTIONAL_IDENTITY_FIELDS,
    Account,
    Instance,
    Storage,
    to_wire,
)
from kvcm.control.registry import Registry
from kvcm.errors import InvalidArgument
from kvcm.proto.requests import control
from kvcm.proto.requests.control import (
    AddAccountRequest,
    AddStorageRequest,
    CreateInstanceGroupRequest,
    Empty,
    GroupNameRequest,
    InstanceIdRequest,
    ListInstanceInfoRequest,
    LoadConfigSnapshotRequest,
    ModelDeployment,
    RegisterInstanceRequest,
    StorageNameRequest,
    StorageSpecsRequest,
    UpdateAccountRequest,
    UpdateInstanceGroupRequest,
    UpdateStorageRequest,
    UserNameRequest,
)
from kvcm.proto.schema import RequestBase
from kvcm.rpc.auth import Authenticator
from kvcm.rpc.dispatch import Method

T = TypeVar("T")


def _given(value: T | msgspec.UnsetType, default: Callable[[], T]) -> T:
    return default() if value is msgspec.UNSET else value


def _record(storage: control.Storage) -> Storage:
    """The request's storage as the registry's record (the same fields)."""
    return Storage(**msgspec.structs.asdict(storage))


class _Handlers:
    """Thin adapters from request Structs to :class:`Registry` calls and reply maps."""

    def __init__(
        self, registry: Registry, info: Callable[[], Mapping[str, object]], auth: Authenticator | None = None
    ) -> None:
        self.registry = registry
        self.info = info
        self.auth = auth
        self.started = time.time()

    def _caller(self, req: RequestBase) -> str | None:
        """The calling account when auth is on: guards refuse to let it lock itself out."""
        return None if self.auth is None else self.auth.caller(req)

    # storages
    def add_storage(self, req: AddStorageRequest) -> dict[str, object]:
        return {"storage": to_wire(self.registry.add_storage(_record(req.storage), adopt=req.adopt_directory))}

    def update_storage(self, req: UpdateStorageRequest) -> dict[str, object]:
        return {"storage": to_wire(self.registry.update_storage(_record(req.storage)))}

    def enable_storage(self, req: StorageNameRequest) -> dict[str, object]:
        return {"storage": to_wire(self.registry.set_storage_enabled(req.storage_unique_name, True))}

    def disable_storage(self, req: StorageNameRequest) -> dict[str, object]:
        return {"storage": to_wire(self.registry.set_storage_enabled(req.storage_unique_name, False))}

    def remove_storage(self, req: StorageNameRequest) -> dict[str, object]:
        self.registry.remove_storage(req.storage_unique_name)
        return {}

    def list_storage(self, req: Empty) -> dict[str, object]:
        return {"storage": [to_wire(s) for s in self.registry.list_storages()]}

    # instance groups
    def create_instance_group(self, req: CreateInstanceGroupRequest) -> dict[str, object]:
        return {"instance_group": to_wire(self.registry.create_group(req.instance_group))}

    def update_instance_group(self, req: UpdateInstanceGroupRequest) -> dict[str, object]:
        version = req.current_version if req.current_version is not None else req.expected_version
        if version is None:
            raise InvalidArgument("current_version: required (the version you read; see get_instance_group)")
        return {"instance_group": to_wire(self.registry.update_group(req.instance_group, version))}

    def remove_instance_group(self, req: GroupNameRequest) -> dict[str, object]:
        self.registry.remove_group(req.name)
        return {}

    def get_instance_group(self, req: GroupNameRequest) -> dict[str, object]:
        return {"instance_group": to_wire(self.registry.get_group(req.name))}

    def list_instance_groups(self, req: Empty) -> dict[str, object]:
        return {"instance_group": [to_wire(g) for g in self.registry.list_groups()]}

    # instances
    def register_instance(self, req: RegisterInstanceRequest) -> dict[str, object]:
        given = frozenset(name for name in OPTIONAL_IDENTITY_FIELDS if getattr(req, name) is not msgspec.UNSET)
        instance = Instance(
            instance_id=req.instance_id,
            instance_group=req.instance_group,
            block_size=req.block_size,
            location_spec_infos=_given(req.location_spec_infos, list),
            location_spec_groups=_given(req.location_spec_groups, list),
            model_deployment=_given(req.model_deployment, ModelDeployment),
        )
        done = self.registry.register_instance(instance, given)
        # Every data-plane user registers: its storage specs are the client-visible fields only,
        # as get_storage_specs shows them (a connection URL may embed credentials).
        return {"storage_configs": [_visible(s) for s in done.storages], "created": done.created}

    def get_instance_info(self, req: InstanceIdRequest) -> dict[str, object]:
        instance = self.registry.get_instance(req.instance_id)
        return {"instance_group": instance.instance_group, "instance_info": to_wire(instance)}

    def get_storage_specs(self, req: StorageSpecsRequest) -> dict[str, object]:
        """The client-visible part of the storages the instance may use (its group's candidates,
        in order): what :mod:`kvcm.blocks` needs to turn a URI into bytes, and nothing else."""
        instance = self.registry.get_instance(req.instance_id)
        names = self.registry.get_group(instance.instance_group).storage_candidates
        known = {s.global_unique_name: s for s in self.registry.list_storages()}
        return {"storages": [client_storage(known[name]) for name in names if name in known]}

    def list_instance_info(self, req: ListInstanceInfoRequest) -> dict[str, object]:
        instances = self.registry.list_instances(req.instance_group_name)
        visible = None if self.auth is None else self.auth.visible(req)
        if visible is not None:  # a non-admin sees the instances of its own groups only
            instances = [i for i in instances if visible(i.instance_id)]
        return {"instance_info": [to_wire(i) for i in instances]}

    def remove_instance(self, req: InstanceIdRequest) -> dict[str, object]:
        self.registry.remove_instance(req.instance_id)
        return {}

    # accounts
    def add_account(self, req: AddAccountRequest) -> dict[str, object]:
        return {"account": _account(self.registry.add_account(req.user_name, req.password, req.role, req.groups))}

    def update_account(self, req: UpdateAccountRequest) -> dict[str, object]:
        account = self.registry.update_account(
            req.user_name, req.password, req.role, req.groups, caller=self._caller(req)
        )
        return {"account": _account(account)}

    def delete_account(self, req: UserNameRequest) -> dict[str, object]:
        self.registry.delete_account(req.user_name, caller=self._caller(req))
        return {}

    def list_account(self, req: Empty) -> dict[str, object]:
        return {"accounts": [_account(a) for a in self.registry.list_accounts()]}

    # snapshots
    def gen_config_snapshot(self, req: Empty) -> dict[str, object]:
        return {"config_snapshot": self.registry.gen_config_snapshot()}

    def load_config_snapshot(self, req: LoadConfigSnapshotRequest) -> dict[str, object]:
        return {"loaded": self.registry.load_config_snapshot(req.config_snapshot, caller=self._caller(req))}

    # health
    def check_health(self, req: Empty) -> dict[str, object]:
        storages = self.registry.list_storages()
        node = self.info()
        ha = node.get("ha")  # the role, when this node may not lead (the lease, or a demote)
        return {
            "status": "ok",
            "is_health": True,
            "is_leader": bool(ha.get("is_leader")) if isinstance(ha, dict) else True,
            "uptime_s": round(time.time() - self.started, 3),
            "counts": self.registry.counts(),  # read from the store: proves it answers
            "storages": {s.global_unique_name: _storage_health(s, self.registry.unavailable_reasons) for s in storages},
            "node": node,
        }

    def get_manager_cluster_info(self, req: Empty) -> dict[str, object]:
        return cluster_info(self.info(), self.started)


def cluster_info(info: Mapping[str, object], started: float) -> dict[str, object]:
    """``get_manager_cluster_info`` from a node's facts. With the leader lease, ``info["ha"]``
    holds the lease's view (``is_leader``, ``leader_node_id``, ``leader_endpoint``, ``epoch``,
    ``lease_expires_at``); without it this node is the only one and leads forever."""
    ha = info.get("ha")
    node_id = str(info.get("node_id") or info.get("endpoint") or "local")
    if not isinstance(ha, dict):
        me = {**info, "node_id": node_id, "leader": True}
        return {
            "leader": True,
            "self": me,
            "nodes": [me],
            "self_node_id": node_id,
            "leader_node_id": node_id,
            "leader_endpoint": me,
            "info_updated_time": int(started * 1000),
            "self_leader_expiration_time": 0,  # single node: the lease never expires
            "self_leader_since_time": int(started * 1000),
        }
    leader = bool(ha.get("is_leader"))
    me = {**info, "node_id": node_id, "leader": leader}
    leader_node = {"node_id": ha.get("leader_node_id") or "", "endpoint": ha.get("leader_endpoint") or "",
                   "leader": True}
    nodes = [me] if leader or not leader_node["node_id"] else [me, leader_node]
    members = _members(ha.get("members"))
    listed = {n["node_id"] for n in nodes}
    nodes += [{**m, "leader": m["node_id"] == leader_node["node_id"]} for m in members if m["node_id"] not in listed]
    return {
        "leader": leader,
        "self": me,
        "nodes": nodes,
        # every node that announced itself within a lease, at the endpoint clients reach it on
        "members": members,
        "self_node_id": node_id,
        "leader_node_id": leader_node["node_id"],
        "leader_endpoint": me if leader else leader_node,
        "epoch": int(ha.get("epoch") or 0),
        "info_updated_time": int(time.time() * 1000),
        # Wall-clock ms the lease would expire without a renew (0 = not the leader).
        "self_leader_expiration_time": int(float(ha.get("lease_expires_at") or 0) * 1000),
        # Wall-clock ms this node won its current term (0 = not the leader): failover timing.
        "self_leader_since_time": int(float(ha.get("leader_since") or 0) * 1000),
    }


def _members(raw: object) -> list[dict[str, object]]:
    """The lease's ``members`` as plain maps (none when the facts hold no list)."""
    if not isinstance(raw, list):
        return []
    return [{"node_id": str(m["node_id"]), "endpoint": str(m["endpoint"])} for m in raw
            if isinstance(m, dict) and "node_id" in m and "endpoint" in m]


#: The spec fields a data-plane user sees, per storage type: a whitelist, so a field added to a
#: backend later stays hidden until someone decides clients need it. Only what resolving a URI
#: (or plugging a transfer for it) needs; never capacity, probe addresses, or connection URLs,
#: which may embed credentials (``metadata_connstring``, ``service_discovery_url``). A type not
#: listed here shows its name and type only.
CLIENT_SPEC_FIELDS: dict[str, tuple[str, ...]] = {
    "file": ("root_path", "file_size", "key_count_per_file"),
    "shm": ("shm_dir", "prefix", "segment_size"),
    "3fs": ("mountpoint", "root_dir", "key_count_per_file"),
    "mooncake": ("protocol", "key_prefix", "master_service_entry"),
    "tairmempool": ("domain", "media_type", "node_id", "range_id", "timeout"),
}


def client_storage(storage: Storage) -> dict[str, object]:
    """One storage as ``get_storage_specs`` shows it: name, type and the whitelisted spec fields."""
    return {"global_unique_name": storage.global_unique_name, "storage_type": storage.storage_type,
            "storage_spec": _visible_spec(storage)}


def _visible_spec(storage: Storage) -> dict[str, object]:
    """The storage's spec cut to :data:`CLIENT_SPEC_FIELDS`."""
    fields = CLIENT_SPEC_FIELDS.get(storage.storage_type, ())
    return {key: storage.storage_spec[key] for key in fields if key in storage.storage_spec}


def _visible(storage: Storage) -> dict[str, object]:
    """A storage's wire form with its spec cut to :data:`CLIENT_SPEC_FIELDS`."""
    return {**to_wire(storage), "storage_spec": _visible_spec(storage)}


def _account(account: Account) -> dict[str, object]:
    """Never the hash: an account on the wire is its name, role and instance groups."""
    return {"user_name": account.user_name, "role": account.role, "groups": list(account.groups)}


# name, request type, writes, idempotent, admin
_TABLE: tuple[tuple[str, type, bool, bool, bool], ...] = (
    ("add_storage", AddStorageRequest, True, False, True),
    ("update_storage", UpdateStorageRequest, True, True, True),
    ("enable_storage", StorageNameRequest, True, True, True),
    ("disable_storage", StorageNameRequest, True, True, True),
    ("remove_storage", StorageNameRequest, True, False, True),
    ("list_storage", Empty, False, True, True),
    ("create_instance_group", CreateInstanceGroupRequest, True, False, True),
    ("update_instance_group", UpdateInstanceGroupRequest, True, False, True),
    ("remove_instance_group", GroupNameRequest, True, False, True),
    ("get_instance_group", GroupNameRequest, False, True, True),
    ("list_instance_groups", Empty, False, True, True),
    ("register_instance", RegisterInstanceRequest, True, True, False),
    ("get_instance_info", InstanceIdRequest, False, True, False),
    ("get_storage_specs", StorageSpecsRequest, False, True, False),
    ("list_instance_info", ListInstanceInfoRequest, False, True, False),  # filtered to the caller's groups
    ("remove_instance", InstanceIdRequest, True, False, True),
    ("add_account", AddAccountRequest, True, False, True),
    ("update_account", UpdateAccountRequest, True, True, True),
    ("delete_account", UserNameRequest, True, False, True),
    ("list_account", Empty, False, True, True),
    ("gen_config_snapshot", Empty, False, True, True),
    ("load_config_snapshot", LoadConfigSnapshotRequest, True, True, True),
    ("check_health", Empty, False, True, False),
    ("get_manager_cluster_info", Empty, False, True, False),
)


def methods(
    registry: Registry,
    info: Mapping[str, object] | Callable[[], Mapping[str, object]] | None = None,
    auth: Authenticator | None = None,
) -> list[Method]:
    """Every control-plane method. ``info``: facts about this node (e.g. ``node_id``, ``endpoint``,
    ``version``) for ``check_health`` and ``get_manager_cluster_info``; a callable is asked on
    every call, so facts known only after start (the bound port) show up. ``auth`` (when on)
    filters ``list_instance_info`` to the caller's groups and keeps admins from locking
    themselves out."""
    if callable(info):
        handlers = _Handlers(registry, info, auth)
    else:
        facts = dict(info or {})
        handlers = _Handlers(registry, lambda: dict(facts), auth)
    return [
        Method(name, getattr(handlers, name), request=request, writes=writes, idempotent=idempotent, admin=admin)
        for name, request, writes, idempotent, admin in _TABLE
    ]


def _storage_health(storage: Storage, reasons: dict[str, str]) -> dict[str, object]:
    """``enabled``/``available`` of one storage, and why it is unavailable when it is."""
    out: dict[str, object] = {"enabled": storage.enabled, "available": storage.available}
    reason = reasons.get(storage.global_unique_name)
    if not storage.available:
        out["unavailable_reason"] = reason or "unavailable at the last probe"
    elif reason is not None:
        # Available in the shared registry, but this node cannot open it yet (a lock another
        # process holds): it serves nothing here until the health thread reopens it.
        out["waiting"] = reason
    return out

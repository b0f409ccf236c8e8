"""Registry unit tests, run against both stores (the ``store`` fixture of conftest)."""

from __future__ import annotations

import itertools
import tempfile

import msgspec
import pytest

from kvcm.backends.metastore import LmdbStore, MemoryStore
from kvcm.control.passwords import verify_password
from kvcm.control.records import (
    Instance,
    InstanceGroup,
    LocationSpecGroup,
    LocationSpecInfo,
    ModelDeployment,
    Quota,
    QuotaConfig,
    ReclaimStrategy,
    Storage,
)
from kvcm.control.registry import DEFAULT_GROUP, DEFAULT_STORAGE, Registry
from kvcm.errors import Code, Conflict, InvalidArgument, KvcmError, NotFound

# Test storages live under /mnt (never created: these tests open no backend), /dev/shm and temp dirs.
ROOTS = ("/mnt", "/dev/shm", tempfile.gettempdir())


@pytest.fixture
def reg(store, tmp_path):
    return Registry(store, str(tmp_path / "data"), allowed_roots=ROOTS)


def nfs(name: str = "nfs1", root: str = "/mnt/nfs/") -> Storage:
    return Storage(
        global_unique_name=name, storage_type="file", storage_spec={"root_path": root, "key_count_per_file": 8}
    )


def group(name: str = "g1", candidates: list[str] | None = None, **kw) -> InstanceGroup:
    return InstanceGroup(name=name, storage_candidates=candidates or ["nfs1"], **kw)


SPECS = [LocationSpecInfo("tp0", 1024), LocationSpecInfo("tp1", 1024), LocationSpecInfo("tp0_L1", 512)]
GROUPS = [LocationSpecGroup("F0", ["tp0", "tp1"]), LocationSpecGroup("all", ["tp0", "tp1", "tp0_L1"])]


def inst(instance_id: str = "i1", grp: str = "g1", **kw) -> Instance:
    fields = dict(
        block_size=16,
        location_spec_infos=list(SPECS),
        location_spec_groups=list(GROUPS),
        model_deployment=ModelDeployment(model_name="qwen", dtype="bf16", tp_size=2),
    )
    fields.update(kw)
    return Instance(instance_id=instance_id, instance_group=grp, **fields)


def code_of(excinfo: pytest.ExceptionInfo[KvcmError]) -> Code:
    return excinfo.value.code


# -- defaults ------------------------------------------------------------------------------------


def test_defaults_created_on_first_start(reg, tmp_path):
    storage = reg.get_storage(DEFAULT_STORAGE)
    assert storage.storage_type == "file"
    assert storage.storage_spec["root_path"] == str(tmp_path / "data" / "blocks")
    default = reg.get_group(DEFAULT_GROUP)
    assert default.storage_candidates == [DEFAULT_STORAGE]
    assert default.quota.capacity == 0
    assert default.reclaim_strategy.reclaim_policy == "lru"
    assert default.reclaim_strategy.used_percentage == 0.9


def test_defaults_only_on_first_start(store, tmp_path):
    reg = Registry(store, str(tmp_path), allowed_roots=ROOTS)
    reg.remove_group(DEFAULT_GROUP)
    reg.remove_storage(DEFAULT_STORAGE)
    again = Registry(store, str(tmp_path), allowed_roots=ROOTS)  # a restart must not bring them back
    assert again.list_groups() == [] and again.list_storages() == []


def test_no_defaults_without_data_dir(store):
    assert Registry(store, allowed_roots=ROOTS).list_storages() == []


# -- storages ------------------------------------------------------------------------------------


def test_storage_crud(reg):
    added = reg.add_storage(nfs())
    assert added.create_time > 0 and added.enabled and added.available
    assert reg.get_storage("nfs1") == added
    with pytest.raises(Conflict) as exc:
        reg.add_storage(nfs(root="/other/"))
    assert code_of(exc) == Code.DUPLICATE_ENTITY
    assert reg.get_storage("nfs1").storage_spec["root_path"] == "/mnt/nfs"  # not overwritten (Tair bug)

    assert not reg.set_storage_enabled("nfs1", False).enabled
    updated = reg.update_storage(nfs(root="/mnt/new/"))
    assert updated.storage_spec["root_path"] == "/mnt/new" and updated.create_time == added.create_time
    assert not updated.enabled  # update_storage never flips the admin switch
    assert reg.set_storage_enabled("nfs1", True).enabled
    assert [s.global_unique_name for s in reg.list_storages()] == [DEFAULT_STORAGE, "nfs1"]
    reg.remove_storage("nfs1")
    with pytest.raises(NotFound):
        reg.get_storage("nfs1")
    with pytest.raises(NotFound):
        reg.remove_storage("nfs1")


def test_storage_spec_defaults_and_aliases(reg):
    """The stored spec is the backend's: complete, with the backend's own defaults."""
    shm = reg.add_storage(Storage(global_unique_name="shm1", storage_type="shm"))
    assert shm.storage_spec == {
        "segment_size": 64 << 20, "prefix": "kvcm.shm1.", "shm_dir": "/dev/shm", "capacity_bytes": 0
    }
    mc = reg.add_storage(Storage(global_unique_name="mc1", storage_type="mooncake"))
    assert mc.storage_spec["protocol"] == "tcp" and mc.storage_spec["key_prefix"] == "kvcm/"
    assert mc.storage_spec["rdma_device"] == "" and mc.storage_spec["probe_address"] == ""
    fs = reg.add_storage(
        Storage(global_unique_name="fs1", storage_type="hf3fs", storage_spec={"mountpoint": "/3fs", "root_dir": "kv"})
    )
    assert fs.storage_type == "3fs" and fs.storage_spec["key_count_per_file"] == 1
    assert fs.storage_spec["check_storage_available_when_open"] is False
    pool = reg.add_storage(
        Storage(global_unique_name="pool1", storage_type="pace", storage_spec={"domain": "d", "node_id": 3})
    )
    assert pool.storage_type == "tairmempool"
    assert pool.storage_spec == {
        "domain": "d", "timeout": 0, "service_discovery_url": "", "enable_vipserver": False,
        "media_type": "dram", "node_id": 3, "range_id": 0, "capacity_bytes": 0, "probe_address": "",
    }
    nfs1 = reg.add_storage(
        Storage(global_unique_name="nfs1", storage_type="nfs", storage_spec={"root_path": "/mnt/nfs/"})
    )
    assert nfs1.storage_type == "file"
    assert nfs1.storage_spec == {
        "root_path": "/mnt/nfs", "key_count_per_file": 0, "file_size": 64 << 20, "capacity_bytes": 0, "create_root": True
    }


def test_storage_accepts_every_backend_field(reg):
    """What the backend supports, the registry accepts (it used to refuse these)."""
    specs = {
        "file": {"root_path": "/mnt/nfs", "capacity_bytes": 1 << 30, "create_root": False},
        "shm": {"shm_dir": "/dev/shm", "prefix": "side.", "capacity_bytes": 1 << 20},
        "3fs": {"mountpoint": "/3fs", "root_dir": "kv", "check_storage_available_when_open": True,
                "probe_address": "127.0.0.1:9000"},
        "mooncake": {"key_prefix": "m/", "capacity_bytes": 5},
        "tairmempool": {"domain": "d", "enable_vipserver": True, "media_type": "ssd", "range_id": 2},
    }
    for kind, spec in specs.items():
        stored = reg.add_storage(Storage(global_unique_name=f"s-{kind}", storage_type=kind, storage_spec=spec))
        assert spec.items() <= stored.storage_spec.items(), kind
        # Normalizing again changes nothing (update_storage with a listed spec is a no-op).
        assert reg.update_storage(stored).storage_spec == stored.storage_spec


def test_relative_root_path_is_resolved_under_the_data_dir(reg, tmp_path):
    stored = reg.add_storage(Storage(global_unique_name="rel", storage_type="file", storage_spec={"root_path": "kv"}))
    assert stored.storage_spec["root_path"] == str(tmp_path / "data" / "kv")
    assert not (tmp_path / "data" / "kv").exists()  # validation creates nothing; the pool does on open
    with pytest.raises(InvalidArgument, match=r"storage_spec\.root_path .*data dir"):
        Registry(MemoryStore(), allowed_roots=ROOTS).add_storage(
            Storage(global_unique_name="rel", storage_type="file", storage_spec={"root_path": "kv"})
        )


@pytest.mark.parametrize(
    ("storage_type", "spec", "field"),
    [
        ("file", {}, "storage_spec.root_path"),
        ("file", {"root_path": "/x", "key_count_per_file": -1}, "storage_spec.key_count_per_file"),
        ("file", {"root_path": "/x", "root_pth": "/y"}, "storage_spec.root_pth"),
        ("file", {"root_path": 5}, "storage_spec.root_path"),
        ("file", {"root_path": "/x", "create_root": "no"}, "storage_spec.create_root"),
        ("shm", {"segment_size": 0}, "storage_spec.segment_size"),
        ("shm", {"prefix": "a/b"}, "storage_spec.prefix"),
        ("shm", {"shm_dir": "shm"}, "storage_spec.shm_dir"),
        ("3fs", {"mountpoint": "/m"}, "storage_spec.root_dir"),
        ("3fs", {"mountpoint": "m", "root_dir": "r"}, "storage_spec.mountpoint"),
        ("mooncake", {"protocol": "rdma"}, "storage_spec.rdma_device"),
        ("mooncake", {"protocol": "udp"}, "storage_spec.protocol"),
        ("mooncake", {"probe_address": "10.0.0.1:80"}, "storage_spec.probe_address"),
        ("tairmempool", {}, "storage_spec.domain"),
        ("floppy", {}, "storage_type"),
    ],
)
def test_storage_validation_names_the_field(reg, storage_type, spec, field):
    with pytest.raises(InvalidArgument) as exc:
        reg.add_storage(Storage(global_unique_name="s", storage_type=storage_type, storage_spec=spec))
    assert field in exc.value.message


@pytest.mark.parametrize("name", ["", "a/b", "-x", "x" * 200, "a b", "a:1"])
def test_storage_name_rules(reg, name):
    with pytest.raises(InvalidArgument, match="global_unique_name"):
        reg.add_storage(nfs(name))


def test_storage_type_cannot_change(reg):
    reg.add_storage(nfs())
    with pytest.raises(InvalidArgument, match="storage_type"):
        reg.update_storage(Storage(global_unique_name="nfs1", storage_type="shm"))


def test_set_storage_available_writes_only_on_change(reg, store):
    reg.add_storage(nfs())
    seen: list[tuple[str, str]] = []
    reg.on_change(lambda kind, name: seen.append((kind, name)))
    reg.set_storage_available("nfs1", True)
    assert seen == []
    reg.set_storage_available("nfs1", False)
    assert seen == [("storage", "nfs1")] and not reg.get_storage("nfs1").available
    assert not Registry(store, allowed_roots=ROOTS).get_storage("nfs1").available  # persisted
    reg.set_storage_available("gone", False)  # ignored


def test_storage_still_referenced(reg):
    reg.add_storage(nfs())
    reg.create_group(group())
    with pytest.raises(Conflict) as exc:
        reg.remove_storage("nfs1")
    assert code_of(exc) == Code.STILL_REFERENCED and "'g1'" in exc.value.message
    reg.update_group({"name": "g1", "storage_candidates": [DEFAULT_STORAGE]}, 1)
    reg.remove_storage("nfs1")


# -- groups --------------------------------------------------------------------------------------


def test_group_crud_and_version_cas(reg):
    reg.add_storage(nfs())
    created = reg.create_group(
        group(quota=Quota(capacity=1 << 30, quota_config=[QuotaConfig(storage_type="nfs", capacity=10)]))
    )
    assert created.version == 1 and created.quota.quota_config[0].storage_type == "file"
    with pytest.raises(Conflict) as exc:
        reg.create_group(group())
    assert code_of(exc) == Code.DUPLICATE_ENTITY

    updated = reg.update_group({"name": "g1", "reclaim_strategy": {"used_percentage": 0.5}, "version": 99}, 1)
    assert updated.version == 2
    assert updated.reclaim_strategy.used_percentage == 0.5
    assert updated.reclaim_strategy.reclaim_policy == "lru"  # nested maps merge
    assert updated.quota.capacity == 1 << 30  # untouched fields keep their value
    assert updated.create_time == created.create_time
    with pytest.raises(Conflict) as exc:
        reg.update_group({"name": "g1", "user_data": "x"}, 1)  # stale version
    assert code_of(exc) == Code.VERSION_CONFLICT
    assert reg.get_group("g1").user_data == ""
    assert reg.update_group({"name": "g1", "user_data": "x"}, 2).version == 3
    assert [g.name for g in reg.list_groups()] == [DEFAULT_GROUP, "g1"]
    reg.remove_group("g1")
    with pytest.raises(NotFound):
        reg.get_group("g1")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"storage_candidates": []}, "storage_candidates"),
        ({"storage_candidates": ["nope"]}, "storage_candidates[0]"),
        ({"storage_candidates": ["nfs1", "nfs1"]}, "storage_candidates"),
        ({"quota": {"capacity": -1}}, "quota.capacity"),
        ({"quota": {"capacity": "big"}}, "instance_group.quota.capacity"),
        ({"quota": {"quota_config": [{"storage_type": "tape"}]}}, "quota_config[0].storage_type"),
        ({"reclaim_strategy": {"reclaim_policy": "random"}}, "reclaim_policy"),
        ({"reclaim_strategy": {"used_percentage": 0}}, "used_percentage"),
        ({"reclaim_strategy": {"used_bytes": -1}}, "used_bytes"),
        ({"max_block_count": -1}, "max_block_count"),
        ({"reclaim_strategy": {"reclaim_policy": "ttl"}}, "ttl_seconds"),
        ({"reclaim_strategy": {"delay_before_delete_ms": -1}}, "delay_before_delete_ms"),
        ({"max_instance_count": -1}, "max_instance_count"),
    ],
)
def test_group_validation_names_the_field(reg, changes, field):
    reg.add_storage(nfs())
    reg.create_group(group())
    with pytest.raises(InvalidArgument) as exc:
        reg.update_group({"name": "g1", **changes}, 1)
    assert field in exc.value.message
    assert reg.get_group("g1").version == 1  # nothing changed


def test_group_needs_existing_candidates(reg):
    with pytest.raises(InvalidArgument, match=r"storage_candidates\[0\]"):
        reg.create_group(group(candidates=["missing"]))


def test_group_still_referenced(reg):
    reg.add_storage(nfs())
    reg.create_group(group())
    reg.register_instance(inst())
    with pytest.raises(Conflict) as exc:
        reg.remove_group("g1")
    assert code_of(exc) == Code.STILL_REFERENCED and "'i1'" in exc.value.message
    reg.remove_instance("i1")
    reg.remove_group("g1")


def test_removal_guard(reg):
    reg.remove_group(DEFAULT_GROUP)
    reg.guard_removal(lambda txn, kind, name: "storage holds 3 blocks" if kind == "storage" else None)
    with pytest.raises(Conflict, match="holds 3 blocks") as exc:
        reg.remove_storage(DEFAULT_STORAGE)
    assert code_of(exc) == Code.STILL_REFERENCED
    assert reg.get_storage(DEFAULT_STORAGE)


# -- instances -----------------------------------------------------------------------------------


@pytest.fixture
def reg_g1(reg):
    reg.add_storage(nfs())
    reg.create_group(group())
    return reg


def test_register_and_get(reg_g1):
    done = reg_g1.register_instance(inst())
    assert done.created and [s.global_unique_name for s in done.storages] == ["nfs1"]
    got = reg_g1.get_instance("i1")
    assert got.block_size == 16 and got.block_bytes == 2560
    assert [g.name for g in got.location_spec_groups] == ["F0", "all"]
    assert got.location_spec_groups[1].spec_names == ["tp0", "tp0_L1", "tp1"]  # stored sorted
    with pytest.raises(NotFound) as exc:
        reg_g1.get_instance("nope")
    assert code_of(exc) == Code.INSTANCE_NOT_EXIST


def test_register_is_idempotent(reg_g1):
    first = reg_g1.register_instance(inst()).instance
    again = reg_g1.register_instance(
        inst(model_deployment=ModelDeployment(model_name="qwen", dtype="bf16", tp_size=2, user_data="ignored"))
    )
    assert not again.created and again.instance == first


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_register_order_insensitive(reg_g1, order):
    reg_g1.register_instance(inst())
    specs = [SPECS[i] for i in order]
    groups = [LocationSpecGroup(g.name, list(reversed(g.spec_names))) for g in reversed(GROUPS)]
    assert not reg_g1.register_instance(inst(location_spec_infos=specs, location_spec_groups=groups)).created


@pytest.mark.parametrize(
    ("change", "label"),
    [
        ({"block_size": 32}, "block_size"),
        (
            {
                "location_spec_infos": [
                    LocationSpecInfo("tp0", 1024),
                    LocationSpecInfo("tp1", 2048),
                    LocationSpecInfo("tp0_L1", 512),
                ]
            },
            "location_spec_infos",
        ),
        ({"location_spec_infos": SPECS[:2], "location_spec_groups": [GROUPS[0]]}, "location_spec_infos"),
        ({"location_spec_groups": [GROUPS[0]]}, "location_spec_groups"),
        ({"model_deployment": ModelDeployment(model_name="llama", dtype="bf16", tp_size=2)}, "model_deployment"),
        ({"grp": "default"}, "instance_group"),
    ],
)
def test_register_duplicate_entity(reg_g1, change, label):
    reg_g1.register_instance(inst())
    with pytest.raises(Conflict) as exc:
        reg_g1.register_instance(inst(**change))
    assert code_of(exc) == Code.DUPLICATE_ENTITY and label in exc.value.message


def test_register_needs_group(reg_g1):
    with pytest.raises(NotFound, match="missing"):
        reg_g1.register_instance(inst(grp="missing"))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"location_spec_infos": []}, "location_spec_infos"),
        ({"location_spec_infos": [LocationSpecInfo("tp0", 0)], "location_spec_groups": []}, "size"),
        (
            {
                "location_spec_infos": [LocationSpecInfo("tp0", 1), LocationSpecInfo("tp0", 1)],
                "location_spec_groups": [],
            },
            "appears twice",
        ),
        ({"location_spec_groups": [LocationSpecGroup("x", ["nope"])]}, "spec_names"),
        ({"location_spec_groups": [LocationSpecGroup("x", [])]}, "spec_names"),
        ({"instance_id": "../etc"}, "instance_id"),
    ],
)
def test_register_validation(reg_g1, change, field):
    fields = {"instance_id": "i1", **change}
    with pytest.raises(InvalidArgument) as exc:
        reg_g1.register_instance(inst(**fields))
    assert field in exc.value.message


def test_max_instance_count_enforced(reg_g1):
    reg_g1.update_group({"name": "g1", "max_instance_count": 1}, 1)
    reg_g1.register_instance(inst("a"))
    with pytest.raises(KvcmError) as exc:
        reg_g1.register_instance(inst("b"))
    assert code_of(exc) == Code.REACH_MAX_ENTITY_CAPACITY
    assert not reg_g1.register_instance(inst("a")).created  # re-registering is still fine


def test_list_and_remove_instances(reg_g1):
    reg_g1.register_instance(inst("b"))
    reg_g1.register_instance(inst("a"))
    reg_g1.register_instance(inst("c", grp=DEFAULT_GROUP))
    assert [i.instance_id for i in reg_g1.list_instances()] == ["a", "b", "c"]
    assert [i.instance_id for i in reg_g1.list_instances("g1")] == ["a", "b"]
    assert reg_g1.list_instances("unknown") == []
    reg_g1.remove_instance("a")
    with pytest.raises(NotFound) as exc:
        reg_g1.remove_instance("a")
    assert code_of(exc) == Code.INSTANCE_NOT_EXIST


# -- cache and observers -------------------------------------------------------------------------


def test_cache_follows_commits_not_rollbacks(reg_g1, store):
    seen: list[tuple[str, str]] = []
    reg_g1.on_change(lambda kind, name: seen.append((kind, name)))
    with pytest.raises(RuntimeError), store.write():
        reg_g1.register_instance(inst("x"))
        raise RuntimeError("roll back")
    assert seen == []
    with pytest.raises(NotFound):
        reg_g1.get_instance("x")
    with store.group():  # two requests of one batch: the second sees the first before commit
        reg_g1.create_group(group("g2"))
        reg_g1.register_instance(inst("y", grp="g2"))
        with pytest.raises(NotFound):
            reg_g1.get_instance("y")  # not committed yet
    assert reg_g1.get_instance("y").instance_group == "g2"
    assert seen == [("instance_group", "g2"), ("instance", "y")]


def test_observer_errors_do_not_break_commits(reg_g1):
    reg_g1.on_change(lambda kind, name: 1 / 0)
    reg_g1.register_instance(inst())
    assert reg_g1.get_instance("i1")


# -- accounts ------------------------------------------------------------------------------------


def test_accounts(reg):
    account = reg.add_account("alice", "s3cret-pw", "admin")
    assert account.role == "admin" and "s3cret-pw" not in account.password_hash
    assert verify_password("s3cret-pw", account.password_hash)
    assert not verify_password("wrong", account.password_hash)
    with pytest.raises(Conflict):
        reg.add_account("alice", "x", "user")
    reg.add_account("bob", "pw", "user")
    assert [(a.user_name, a.role) for a in reg.list_accounts()] == [("alice", "admin"), ("bob", "user")]
    with pytest.raises(Conflict, match="last admin"):
        reg.delete_account("alice")
    with pytest.raises(Conflict, match="last admin"):
        reg.update_account("alice", role="user")
    reg.update_account("bob", password="new-pw", role="admin")
    assert verify_password("new-pw", reg.get_account("bob").password_hash)
    reg.delete_account("alice")
    assert reg.get_account("alice") is None
    with pytest.raises(InvalidArgument, match="role"):
        reg.add_account("carol", "pw", "root")
    with pytest.raises(InvalidArgument, match="password"):
        reg.add_account("carol", "", "user")


def test_salts_differ(reg):
    a = reg.add_account("a", "same", "user").password_hash
    b = reg.add_account("b", "same", "user").password_hash
    assert a != b


def test_secret_never_in_store_bytes(tmp_path):
    path = tmp_path / "db"
    store = LmdbStore(str(path), map_size=1 << 20)
    reg = Registry(store, str(tmp_path), allowed_roots=ROOTS)
    reg.add_account("alice", "Very-Secret-Passw0rd", "admin")
    reg.update_account("alice", password="Other-Secret-Passw0rd")
    store.close()
    raw = b"".join(p.read_bytes() for p in path.rglob("*") if p.is_file())
    assert b"alice" in raw
    assert b"Very-Secret-Passw0rd" not in raw and b"Other-Secret-Passw0rd" not in raw


# -- persistence and snapshots -------------------------------------------------------------------


def populate(reg: Registry) -> None:
    reg.add_storage(nfs())
    reg.add_storage(Storage(global_unique_name="shm1", storage_type="shm"))
    reg.create_group(
        group(candidates=["shm1", "nfs1"], reclaim_strategy=ReclaimStrategy(reclaim_policy="ttl", ttl_seconds=60))
    )
    reg.register_instance(inst("i1"))
    reg.register_instance(inst("i2", grp=DEFAULT_GROUP))
    reg.add_account("admin", "pw", "admin")
    reg.set_storage_enabled("shm1", False)


def registry_state(reg: Registry) -> tuple[list, ...]:
    return reg.list_storages(), reg.list_groups(), reg.list_instances(), reg.list_accounts()


def test_persists_across_reopen(tmp_path):
    path = str(tmp_path / "db")
    store = LmdbStore(path, map_size=1 << 20)
    reg = Registry(store, str(tmp_path), allowed_roots=ROOTS)
    populate(reg)
    before = registry_state(reg)
    store.close()
    store = LmdbStore(path, map_size=1 << 20)
    try:
        again = Registry(store, str(tmp_path), allowed_roots=ROOTS)
        assert registry_state(again) == before
        assert again.get_instance("i1").location_spec_groups == before[2][0].location_spec_groups
    finally:
        store.close()


def test_snapshot_round_trip_into_fresh_store(reg, tmp_path):
    populate(reg)
    snapshot = reg.gen_config_snapshot()
    assert snapshot["format"] == "kvcm-registry"
    fresh = Registry(MemoryStore(), str(tmp_path / "elsewhere"), allowed_roots=ROOTS)  # has its own defaults
    seen: list[tuple[str, str]] = []
    fresh.on_change(lambda kind, name: seen.append((kind, name)))
    loaded = fresh.load_config_snapshot(msgspec.json.decode(msgspec.json.encode(snapshot)))
    assert loaded == {"storage": 3, "instance_group": 2, "instance": 2, "account": 1, "token": 0}
    assert registry_state(fresh) == registry_state(reg)
    assert verify_password("pw", fresh.get_account("admin").password_hash)
    assert ("instance", "i1") in seen
    assert fresh.gen_config_snapshot() | {"created_time": 0} == snapshot | {"created_time": 0}


def test_snapshot_load_accepts_json_text(reg):
    populate(reg)
    text = msgspec.json.encode(reg.gen_config_snapshot()).decode()
    fresh = Registry(MemoryStore(), allowed_roots=ROOTS)
    fresh.load_config_snapshot(text)
    assert registry_state(fresh) == registry_state(reg)


def test_snapshot_keeps_unchanged_records_alive(reg_g1):
    reg_g1.register_instance(inst())
    seen: list[tuple[str, str, bool]] = []
    reg_g1.on_change(
        lambda kind, name: seen.append((kind, name, name in {i.instance_id for i in reg_g1.list_instances()}))
    )
    reg_g1.load_config_snapshot(reg_g1.gen_config_snapshot())
    assert ("instance", "i1", True) in seen and ("instance", "i1", False) not in seen


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s["instances"][0].update(instance_group_name="ghost"), "unknown group"),
        (lambda s: s["instance_groups"][0]["storage_candidates"].append("ghost"), "unknown storage"),
        (lambda s: s["storages"].append(dict(s["storages"][0])), "appears twice"),
        (lambda s: s["accounts"][0].update(password_hash="plain"), "password_hash"),
        (lambda s: s["accounts"][0].update(password_hash="scrypt$1048576000$8$1$AA==$AA=="), "password_hash"),
        (lambda s: s["instances"][0].update(block_size="16"), "config_snapshot.instances[0].block_size"),
        (lambda s: s.update(format="other"), "format"),
        (lambda s: s.pop("format"), "format"),  # not a snapshot: never read as an empty one
    ],
)
def test_snapshot_load_validates_everything_first(reg, mutate, message):
    populate(reg)
    before = registry_state(reg)
    snapshot = reg.gen_config_snapshot()
    mutate(snapshot)
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        reg.load_config_snapshot(snapshot)
    assert registry_state(reg) == before


def test_unknown_schema_refused(store):
    with store.write() as txn:
        txn.put("meta", b"registry.schema", b"99")
    with pytest.raises(KvcmError) as exc:
        Registry(store, allowed_roots=ROOTS)
    assert exc.value.code == Code.UNSUPPORTED


def test_health_thread_writes_alongside_rpc_writes(tmp_path):
    """``set_storage_available`` from another thread interleaves safely with RPC-thread writes."""
    import threading

    store = LmdbStore(str(tmp_path / "db"), map_size=1 << 22)
    try:
        reg = Registry(store, str(tmp_path), allowed_roots=ROOTS)
        reg.add_storage(nfs())
        reg.create_group(group())
        stop = threading.Event()

        def flap() -> None:
            flag = False
            while not stop.is_set():
                reg.set_storage_available("nfs1", flag)
                flag = not flag

        health = threading.Thread(target=flap)
        health.start()
        try:
            for n in range(50):
                with store.group():
                    reg.register_instance(inst(f"i{n}"))
                reg.list_storages(), reg.list_instances()
        finally:
            stop.set()
            health.join()
        assert len(reg.list_instances("g1")) == 50
        assert Registry(store, allowed_roots=ROOTS).get_storage("nfs1").available == reg.get_storage("nfs1").available
    finally:
        store.close()

"""URI-only external stores: Tair's URI formats, usage accounting, deletes as owner tasks."""

from __future__ import annotations

import re
import socket

import pytest

from kvcm.backends.storage.external import MooncakeStorage, TairMemPoolStorage, ThreeFsStorage
from kvcm.backends.storage.registry import open_backend
from kvcm.errors import CapacityError, Code, InvalidArgument
from kvcm.proto.uris import parse_uri

HEX = "[0-9a-f]{32}"


def test_3fs_single_key_files():
    backend = open_backend("3fs", "hf_01", {"mountpoint": "/mnt/3fs", "root_dir": "/kvcm/"}, None)
    uris = backend.allocate(2, 1024)
    for uri in uris:
        assert re.fullmatch(rf"hf3fs://hf_01/mnt/3fs/kvcm/{HEX}\?size=1024", uri)
    assert len(set(uris)) == 2
    assert backend.delete(uris) == uris  # whole files: the URIs themselves are the tasks


def test_3fs_batched_files_never_lose_live_neighbours():
    backend = open_backend("3fs", "hf", {"mountpoint": "/m", "root_dir": "r", "key_count_per_file": 4}, None)
    uris = backend.allocate(5, 10)
    paths = [parse_uri(u).path for u in uris]
    assert len(set(paths[:4])) == 1 and paths[4] != paths[0]
    assert [parse_uri(u).params["blkid"] for u in uris] == ["0", "1", "2", "3", "0"]  # blkid even on a 1-key tail
    assert backend.delete(uris[:2]) == uris[:2]  # ranges: other blocks still live in that file
    assert backend.delete(uris[2:]) == [f"hf3fs://hf{paths[0]}", f"hf3fs://hf{paths[4]}"]  # whole files
    assert backend.usage() == {"bytes_used": 0, "bytes_capacity": 0, "slots_used": 0}


def test_3fs_touch_and_check_available(tmp_path):
    spec = {"mountpoint": str(tmp_path), "root_dir": "kv", "touch_file_when_create": True,
            "check_storage_available_when_open": True, "cluster_name": "unused"}
    with pytest.raises(Exception, match="does not exist"):
        open_backend("3fs", "hf", spec, None)
    (tmp_path / "kv").mkdir()
    backend = open_backend("3fs", "hf", spec, None)
    assert backend.health()
    uri = backend.allocate(1, 8)[0]
    assert (tmp_path / "kv" / parse_uri(uri).path.rsplit("/", 1)[1]).exists()
    (tmp_path / "kv" / parse_uri(uri).path.rsplit("/", 1)[1]).unlink()
    (tmp_path / "kv").rmdir()
    assert not backend.health()


def test_mooncake_format_and_spec():
    backend = open_backend("mooncake", "mc_01", {}, None)
    assert isinstance(backend, MooncakeStorage)
    assert backend.master_service_entry == "localhost:50051" and backend.protocol == "tcp"
    uri = backend.allocate(1, 1024)[0]
    assert re.fullmatch(rf"mooncake://mc_01/\?key=kvcm/{HEX}&size=1024", uri)
    assert parse_uri(uri).params["key"].startswith("kvcm/")
    with pytest.raises(InvalidArgument, match="rdma_device"):
        open_backend("mooncake", "mc", {"protocol": "rdma"}, None)
    assert open_backend("mooncake", "mc", {"protocol": "rdma", "rdma_device": "mlx5_0"}, None).health()
    with pytest.raises(InvalidArgument, match="protocol"):
        open_backend("mooncake", "mc", {"protocol": "udp"}, None)


def test_tairmempool_offsets_survive_restart():
    spec = {"domain": "pool.example", "node_id": 3}
    backend = open_backend("tairmempool", "tmp_01", spec, None)
    uris = backend.allocate(2, 100)
    assert uris == [
        "pace://tmp_01/0?media_type=dram&node_id=3&range_id=0&size=100",
        "pace://tmp_01/100?media_type=dram&node_id=3&range_id=0&size=100",
    ]
    again = open_backend("tairmempool", "tmp_01", spec, None)
    again.reserve(uris[1:])
    assert again.allocate(1, 50) == ["pace://tmp_01/200?media_type=dram&node_id=3&range_id=0&size=50"]
    with pytest.raises(InvalidArgument, match="domain"):
        open_backend("tairmempool", "t", {}, None)
    assert isinstance(again, TairMemPoolStorage)


@pytest.mark.parametrize("kind,spec", [
    ("3fs", {"mountpoint": "/m", "root_dir": "r"}),
    ("mooncake", {}),
    ("tairmempool", {"domain": "d"}),
])
def test_accounting_contract(kind, spec):
    backend = open_backend(kind, "ext", {**spec, "capacity_bytes": 1000}, None)
    uris = backend.allocate(4, 100)
    assert backend.usage() == {"bytes_used": 400, "bytes_capacity": 1000, "slots_used": 4}
    with pytest.raises(CapacityError) as exc:
        backend.allocate(7, 100)
    assert exc.value.code == Code.CAPACITY_EXHAUSTED
    backend.release(uris[:1])  # never committed: no task
    assert not backend.exists(uris[0]) and backend.exists(uris[1])
    assert backend.delete(uris[1:2]) == uris[1:2]
    assert backend.delete(uris[1:2]) == uris[1:2]  # unknown now, still the owner's to delete
    assert backend.usage()["bytes_used"] == 200

    restarted = open_backend(kind, "ext", spec, None)
    restarted.reserve(uris[2:])
    restarted.reserve(uris[2:])
    assert restarted.usage()["bytes_used"] == 200 and restarted.sweep() == 0
    assert restarted.allocate(1, 100)[0] not in uris
    with pytest.raises(InvalidArgument):
        restarted.delete(["file://ext/s1/00000000.kv?blkid=0&size=1"])
    with pytest.raises(InvalidArgument):
        restarted.reserve([uris[2].replace("ext", "other", 1)])
    restarted.close()
    with pytest.raises(CapacityError) as exc:
        restarted.allocate(1, 1)
    assert exc.value.code == Code.NO_STORAGE_AVAILABLE
    assert not restarted.health()


def test_probe_address_is_loopback_only_and_probed():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    backend = open_backend("mooncake", "mc", {"probe_address": f"localhost:{port}"}, None)
    assert backend.health()
    listener.close()
    assert not backend.health()
    assert open_backend("mooncake", "mc", {"probe_address": f"[::1]:{port}"}, None).probe_address == ("::1", port)
    for bad in ("10.0.0.1:50051", "example.com:80", "127.0.0.1", "127.0.0.1:x"):
        with pytest.raises(InvalidArgument, match="probe_address"):
            open_backend("mooncake", "mc", {"probe_address": bad}, None)


def test_3fs_spec_errors_name_the_field():
    with pytest.raises(InvalidArgument, match="mountpoint"):
        open_backend("3fs", "hf", {"root_dir": "r"}, None)
    with pytest.raises(InvalidArgument, match="mountpoint"):
        open_backend("3fs", "hf", {"mountpoint": "rel", "root_dir": "r"}, None)
    with pytest.raises(InvalidArgument, match="root_dir"):
        open_backend("3fs", "hf", {"mountpoint": "/m"}, None)
    with pytest.raises(InvalidArgument, match="bogus"):
        open_backend("3fs", "hf", {"mountpoint": "/m", "root_dir": "r", "bogus": 1}, None)
    assert isinstance(open_backend("3fs", "hf", {"mountpoint": "/m", "root_dir": "r"}, None), ThreeFsStorage)


def test_registry_normalized_specs_with_empty_strings():
    """The registry stores every field, unset strings as "" (Tair proto style)."""
    mc = open_backend("mooncake", "mc", {"local_hostname": "localhost", "metadata_connstring": "http://localhost:8080/metadata",
                                         "protocol": "tcp", "rdma_device": "", "master_service_entry": "localhost:50051"}, None)
    assert isinstance(mc, MooncakeStorage) and mc.rdma_device is None
    fs = open_backend("3fs", "hf", {"mountpoint": "/m", "root_dir": "r", "key_count_per_file": 1,
                                    "touch_file_when_create": False, "cluster_name": ""}, None)
    assert fs.allocate(1, 1)[0].startswith("hf3fs://hf/m/r/")
    pool = open_backend("tairmempool", "p", {"domain": "d", "timeout": 0, "service_discovery_url": ""}, None)
    assert isinstance(pool, TairMemPoolStorage) and pool.service_discovery_url is None
    with pytest.raises(InvalidArgument, match="domain"):
        open_backend("tairmempool", "p", {"domain": ""}, None)


def test_external_reserve_keeps_valid_uris():
    backend = open_backend("mooncake", "mc", {}, None)
    good = backend.allocate(2, 8)
    again = open_backend("mooncake", "mc", {}, None)
    with pytest.raises(InvalidArgument, match="1 uri"):
        again.reserve([good[0], "mooncake://other/?key=x&size=8", good[1]])
    assert again.usage()["slots_used"] == 2

"""Where storages may live (``storage.allowed_roots``), storages that cannot be opened, and no
lock or socket file left behind by ``remove_storage`` or a clean stop."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvcm.errors import Code, KvcmError
from kvcm.testing import serve_in_thread, start_subprocess, stop_subprocess

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX storages")


def _add(kv: Any, name: str, storage_type: str, spec: dict[str, Any]) -> dict[str, Any]:
    reply: dict[str, Any] = kv.call("add_storage", {"storage": {
        "global_unique_name": name, "storage_type": storage_type, "storage_spec": spec}})
    return reply


def _refused(kv: Any, name: str, storage_type: str, spec: dict[str, Any]) -> str:
    with pytest.raises(KvcmError) as info:
        _add(kv, name, storage_type, spec)
    assert info.value.code == Code.INVALID_ARGUMENT, info.value
    names = {s["global_unique_name"] for s in kv.call("list_storage")["storage"]}
    assert name not in names
    return str(info.value)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A unique shm prefix; every /dev/shm file starting with it is removed afterwards."""
    tag = f"kvcmtest{uuid.uuid4().hex[:8]}"
    yield tag
    for entry in os.listdir("/dev/shm"):
        if entry.startswith(tag):
            os.unlink(os.path.join("/dev/shm", entry))


@pytest.fixture
def outside() -> Iterator[str]:
    """A directory outside the default allowed roots (the data dir) of a production config."""
    path = tempfile.mkdtemp(prefix="kvcm-outside-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_default_roots_refuse_system_and_foreign_paths(outside: str) -> None:
    with serve_in_thread(overrides={"storage": {"allowed_roots": []}}) as server, server.client() as kv:
        for i, root in enumerate(["/", "/etc", "/proc/self", outside, "../../../escaped",
                                  f"{server.data_dir}/../../../etc", "blocks/../.."]):
            reason = _refused(kv, f"bad{i}", "file", {"root_path": root})
            assert "outside the allowed roots" in reason or "data dir itself" in reason, (root, reason)
        for i, root in enumerate(["a\x00b", "a\nb", "a\rb"]):
            assert "control character" in _refused(kv, f"ctl{i}", "file", {"root_path": root})
        # The default storage's own directory, and the data dir that holds it, are taken.
        assert "is the directory of storage 'default-file'" in _refused(
            kv, "twice", "file", {"root_path": os.path.join(server.data_dir, "blocks")})
        assert "data dir itself" in _refused(kv, "datadir", "file", {"root_path": server.data_dir})
        # Default: shm under /dev/shm is fine, but not a file storage there.
        _refused(kv, "devshm", "file", {"root_path": "/dev/shm/kvcm-nope"})
        # A subdirectory of the data dir (not nested with blocks/) is accepted.
        _add(kv, "sub", "file", {"root_path": "more"})
    for path in ("/etc/.kvcm-lock", "/.kvcm-lock", "/proc/self/.kvcm-lock", os.path.join(outside, ".kvcm-lock")):
        assert not os.path.exists(path)
    assert os.listdir(outside) == []


def test_symlinks_are_resolved(tmp_path: Any) -> None:
    with serve_in_thread(data_dir=str(tmp_path / "data")) as server, server.client() as kv:
        os.symlink("/etc", tmp_path / "to-etc")
        assert "outside the allowed roots" in _refused(kv, "out", "file", {"root_path": str(tmp_path / "to-etc")})
        assert "outside the allowed roots" in _refused(
            kv, "outdeep", "file", {"root_path": str(tmp_path / "to-etc" / "not-yet" / "deeper")})
        os.symlink(tmp_path / "data" / "blocks", tmp_path / "to-default")
        assert "storage 'default-file'" in _refused(kv, "alias", "file", {"root_path": str(tmp_path / "to-default")})
    assert not os.path.exists("/etc/not-yet")


def test_nested_and_same_roots_refused(tmp_path: Any) -> None:
    with serve_in_thread() as server, server.client() as kv:
        _add(kv, "outer", "file", {"root_path": str(tmp_path / "outer")})
        assert "nested" in _refused(kv, "inner", "file", {"root_path": str(tmp_path / "outer" / "inner")})
        assert "nested" in _refused(kv, "around", "file", {"root_path": str(tmp_path)})
        assert "is the directory of" in _refused(kv, "same", "file", {"root_path": str(tmp_path / "outer") + "/"})
        # update_storage goes through the same rule.
        _add(kv, "other", "file", {"root_path": str(tmp_path / "other")})
        with pytest.raises(KvcmError) as info:
            kv.call("update_storage", {"storage": {"global_unique_name": "other", "storage_type": "file",
                                                   "storage_spec": {"root_path": str(tmp_path / "outer" / "x")}}})
        assert info.value.code == Code.INVALID_ARGUMENT and "nested" in str(info.value)
    assert not (tmp_path / "outer" / "inner").exists()


def test_shm_prefix_overlap_refused(prefix: str) -> None:
    with serve_in_thread() as server, server.client() as kv:
        _add(kv, "seg1", "shm", {"prefix": f"{prefix}seg1"})
        assert "overlaps prefix" in _refused(kv, "seg", "shm", {"prefix": f"{prefix}seg"})
        assert "overlaps prefix" in _refused(kv, "seg12", "shm", {"prefix": f"{prefix}seg12"})
        _add(kv, "other", "shm", {"prefix": f"{prefix}other"})  # disjoint prefixes share /dev/shm


def test_snapshot_with_overlapping_storages_refused(tmp_path: Any) -> None:
    with serve_in_thread() as server, server.client() as kv:
        snap = kv.call("gen_config_snapshot")["config_snapshot"]
        default = next(s for s in snap["storages"] if s["global_unique_name"] == "default-file")
        snap["storages"].append({**default, "global_unique_name": "copy"})
        with pytest.raises(KvcmError) as info:
            kv.call("load_config_snapshot", {"config_snapshot": snap})
        assert info.value.code == Code.INVALID_ARGUMENT and "storage 'default-file'" in str(info.value)


def test_configured_roots_widen(tmp_path: Any, outside: str) -> None:
    overrides = {"storage": {"allowed_roots": [outside]}}
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=overrides) as server, server.client() as kv:
        _add(kv, "wide", "file", {"root_path": os.path.join(outside, "blocks")})
        _refused(kv, "tmp", "file", {"root_path": str(tmp_path / "elsewhere")})
        assert "outside the allowed roots" in _refused(kv, "shm", "shm", {"prefix": "kvcmtest-nope"})


def test_unopenable_storage_refused_then_reported(tmp_path: Any) -> None:
    (tmp_path / "a-file").write_bytes(b"x")
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data) as server, server.client() as kv:
        with pytest.raises(KvcmError) as info:
            _add(kv, "isfile", "file", {"root_path": str(tmp_path / "a-file")})
        assert "cannot open" in str(info.value) or "not a directory" in str(info.value)
        assert "isfile" not in {s["global_unique_name"] for s in kv.call("list_storage")["storage"]}
        (tmp_path / "later").mkdir()
        _add(kv, "later", "file", {"root_path": str(tmp_path / "later"), "create_root": False})
        assert kv.call("check_health")["storages"]["later"] == {"enabled": True, "available": True}
    shutil.rmtree(tmp_path / "later")  # the mount went away between runs
    with serve_in_thread(data_dir=data) as server, server.client() as kv:
        health = kv.call("check_health")["storages"]["later"]
        assert health["available"] is False
        assert "is not a directory" in health["unavailable_reason"]


def test_no_lock_left_after_remove_and_stop(prefix: str, tmp_path: Any) -> None:
    with serve_in_thread() as server, server.client() as kv:
        _add(kv, "shm1", "shm", {"prefix": f"{prefix}a."})
        _add(kv, "file1", "file", {"root_path": str(tmp_path / "f")})
        assert os.path.exists(f"/dev/shm/{prefix}a.lock")
        assert (tmp_path / "f" / ".kvcm-lock").exists()
        kv.call("remove_storage", {"storage_unique_name": "shm1"})
        assert not os.path.exists(f"/dev/shm/{prefix}a.lock")
        _add(kv, "shm2", "shm", {"prefix": f"{prefix}b."})
        assert os.path.exists(f"/dev/shm/{prefix}b.lock")
        data_dir = server.data_dir
    assert not os.path.exists(f"/dev/shm/{prefix}b.lock")
    assert not (tmp_path / "f" / ".kvcm-lock").exists()
    assert not os.path.exists(os.path.join(data_dir, "blocks", ".kvcm-lock"))


def test_sigterm_leaves_no_socket_or_lock(tmp_path: Any) -> None:
    sock_dir = tempfile.mkdtemp(prefix="kvcm-", dir="/tmp")
    try:
        sock = os.path.join(sock_dir, "rpc")
        data = str(tmp_path / "data")
        server = start_subprocess(data, f"ipc://{sock}")
        assert os.path.exists(sock) and os.path.exists(os.path.join(data, "blocks", ".kvcm-lock"))
        assert os.path.exists(os.path.join(data, "kvcm.lock"))
        assert stop_subprocess(server) == 0
        assert not os.path.exists(sock)
        assert not os.path.exists(os.path.join(data, "blocks", ".kvcm-lock"))
        assert not os.path.exists(os.path.join(data, "kvcm.lock"))
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_socket_of_another_server_is_kept(tmp_path: Any) -> None:
    """A server whose path was re-bound by another one leaves that one's socket file alone."""
    from kvcm.rpc.server import Server

    sock = tempfile.mkdtemp(prefix="kvcm-", dir="/tmp") + "/rpc"
    try:
        first = Server(f"ipc://{sock}", lambda batch: [])
        os.unlink(sock)
        os.mknod(sock)  # stands in for the next server's socket file
        first.close_unserved()
        assert os.path.exists(sock)
    finally:
        shutil.rmtree(os.path.dirname(sock), ignore_errors=True)

"""``CacheManager.check`` compares every storage with the metadata, both ways: recorded URIs are
reserved and their containers on disk hold them; reserved slots are recorded; counts agree;
no kvcm file on disk escapes the accounting. Real servers, real files, real bytes."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections import Counter

import pytest

from kvcm.backends.storage.file import FileStorage
from kvcm.cache.consistency import Recorded, compare_storage
from kvcm.testing import serve_in_thread, start_subprocess, stop_subprocess
from tests.block_bytes import container_files, read_problems, storage_roots, write_session
from tests.helpers import add_group, register, remove_shm, shm_prefix, start, wait_for

QUIET = {"cache": {"session_check_ms": 50, "delete_poll_ms": 20}, "reclaim": {"enabled": False}}
SPECS = [{"name": "tp0", "size": 1024}, {"name": "tp1", "size": 1024}]


@pytest.fixture
def shm():
    prefix = shm_prefix()
    yield prefix
    remove_shm(prefix)


def _add_storages(c, root: str, shm: str | None) -> list[str]:
    c.call("add_storage", {"storage": {"global_unique_name": "packed", "storage_type": "file",
                                       "storage_spec": {"root_path": root, "key_count_per_file": 256}}})
    names = ["packed"]
    if shm is not None:
        c.call("add_storage", {"storage": {"global_unique_name": "mem", "storage_type": "shm",
                                           "storage_spec": {"prefix": shm, "segment_size": 64 << 10}}})
        names.append("mem")
    return names


def _write(c, instance: str, keys: list[int], roots: dict[str, str]) -> dict:
    session = start(c, keys, instance)
    write_session(session, instance, keys, roots)
    c.call("finish_write_cache", {"instance_id": instance, "write_session_id": session["write_session_id"],
                                  "success_blocks": {"offset": len(keys)}})
    return session


def _populate(c, root: str, shm: str | None) -> dict[str, list[int]]:
    """Two instances, one per storage, 300 written blocks each (more than one packed file),
    plus an open session with its bytes written; returns the finished keys per instance."""
    written = {}
    for storage in _add_storages(c, root, shm):
        add_group(c, f"g-{storage}", [storage])
        register(c, f"i-{storage}", group=f"g-{storage}", specs=SPECS)
        roots = storage_roots(c)
        keys = list(range(1, 301))
        for i in range(0, len(keys), 100):
            _write(c, f"i-{storage}", keys[i:i + 100], roots)
        open_session = start(c, [1000, 1001], f"i-{storage}", write_timeout_seconds=600)
        write_session(open_session, f"i-{storage}", [1000, 1001], roots)
        written[f"i-{storage}"] = keys
    return written


def _quiet(cache) -> None:
    wait_for(lambda: cache.deleter.pending() == 0, timeout=30)


def _backend(srv, name: str):
    return srv.app.cache.pool.get(name)


def _uris(session) -> list[str]:
    return [s["uri"] for loc in session["locations"] for s in loc["location_specs"]]


@pytest.mark.parametrize("kill", [False, True], ids=["stop", "kill9"])
def test_restart_keeps_every_live_block_file(tmp_path, shm, kill):
    """Blocks with real bytes on a packed file storage and on shm survive a restart (clean or
    kill -9): check() passes with the storages compared, every byte reads back, and the files
    on disk are exactly the containers the storage accounts. A restart that reserved nothing
    (so its sweep deleted the live files) fails here, in check() and in the bytes."""
    data, root = str(tmp_path / "data"), str(tmp_path / "packed")
    if kill:
        sock = tempfile.mkdtemp(prefix="kvcm-chk-", dir="/tmp")
        server = start_subprocess(data, f"ipc://{sock}/rpc")
        try:
            with server.client() as c:
                written = _populate(c, root, shm)
        finally:
            assert stop_subprocess(server, kill=True) == -9
            shutil.rmtree(sock, ignore_errors=True)
    else:
        with serve_in_thread(data_dir=data, overrides=QUIET) as srv, srv.client() as c:
            written = _populate(c, root, shm)
            srv.app.cache.check()
    with serve_in_thread(data_dir=data, overrides=QUIET) as srv, srv.client() as c:
        _quiet(srv.app.cache)
        srv.app.cache.check()
        roots = storage_roots(c)
        for instance, keys in written.items():
            assert read_problems(c, instance, keys, roots) == []
        inventory = _backend(srv, "packed").inventory()
        assert container_files(root) == set(inventory.containers)
        assert len(inventory.containers) >= 3  # 602 slots of 256 per file: packed, several files
        assert inventory.slots_used == 2 * (300 + 2)


def test_check_catches_a_file_deleted_behind_kvcms_back(tmp_path):
    root = str(tmp_path / "packed")
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as srv, srv.client() as c:
        written = _populate(c, root, None)
        srv.app.cache.check()
        victim = sorted(_backend(srv, "packed").inventory().containers)[0]
        os.unlink(os.path.join(root, victim))
        with pytest.raises(AssertionError, match=f"storage 'packed': container {re.escape(victim)} of uri .* is missing on disk"):
            srv.app.cache.check()
        assert any("is gone" in p for p in read_problems(c, "i-packed", written["i-packed"], storage_roots(c)))


def test_check_catches_a_leaked_slot(tmp_path):
    """A slot reserved in the storage that no block record names (lost until a restart)."""
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as srv, srv.client() as c:
        _populate(c, str(tmp_path / "packed"), None)
        backend = _backend(srv, "packed")
        leaked = backend.allocate(1, 1024)
        with pytest.raises(AssertionError, match=f"uri {re.escape(leaked[0])} .*is reserved but no block record names it"):
            srv.app.cache.check()
        backend.release(leaked)
        srv.app.cache.check()


def test_check_catches_a_recorded_uri_the_storage_freed(tmp_path):
    """The other way round: a recorded URI whose slot the storage no longer holds (it could be
    handed out again over live data)."""
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as srv, srv.client() as c:
        _populate(c, str(tmp_path / "packed"), None)
        session = _write(c, "i-packed", [500], storage_roots(c))
        uri = _uris(session)[0]
        _backend(srv, "packed").delete([uri])
        with pytest.raises(AssertionError, match=f"uri {re.escape(uri)} of block 500 of 'i-packed' .*not reserved"):
            srv.app.cache.check()


def test_check_catches_stray_and_truncated_files(tmp_path):
    root = str(tmp_path / "packed")
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as srv, srv.client() as c:
        _populate(c, root, None)
        backend = _backend(srv, "packed")
        stray = f"s1024/{backend.storage_id}-00009999.kv"  # named as this storage names its files
        open(os.path.join(root, stray), "wb").close()
        with pytest.raises(AssertionError, match=f"file {re.escape(stray)} on disk is not in the storage's accounting"):
            srv.app.cache.check()
        os.unlink(os.path.join(root, stray))
        victim = sorted(backend.inventory().containers)[0]
        os.truncate(os.path.join(root, victim), 1024)
        with pytest.raises(AssertionError, match=f"container {re.escape(victim)} is 1024 bytes, too small for uri"):
            srv.app.cache.check()


def test_check_compares_external_storages_by_uri(tmp_path):
    """A URI-only storage has nothing on disk to list, but its live URIs still must match."""
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as srv, srv.client() as c:
        c.call("add_storage", {"storage": {"global_unique_name": "mc", "storage_type": "mooncake",
                                           "storage_spec": {}}})
        add_group(c, "g", ["mc"])
        register(c, "ext", group="g", specs=SPECS)
        session = start(c, [1, 2, 3], "ext")
        c.call("finish_write_cache", {"instance_id": "ext", "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": 3}})
        srv.app.cache.check()
        backend = _backend(srv, "mc")
        assert backend.inventory().on_disk is None
        leaked = backend.allocate(1, 1024)
        with pytest.raises(AssertionError, match="reserved but no block record names it"):
            srv.app.cache.check()
        backend.release(leaked)
        backend.release(_uris(session)[:1])
        with pytest.raises(AssertionError, match="recorded but not reserved"):
            srv.app.cache.check()


def test_orphans_found_at_open_are_reported_until_swept(tmp_path):
    """A container file no reserved URI claims is an orphan until the start-up sweep removes it;
    check() names it, and after the sweep neither the file nor the finding remains."""
    root = tmp_path / "r"
    first = FileStorage("f", {"root_path": str(root)})
    first.open()  # marks the directory as storage f's
    first.close()
    sid = first.storage_id
    orphan = f"s1024/{sid}-00000003.kv"
    (root / "s1024").mkdir(parents=True)
    (root / orphan).write_bytes(b"\0" * 4096)
    backend = FileStorage("f", {"root_path": str(root)})
    backend.open()
    try:
        inventory = backend.inventory()
        assert inventory.orphans == {orphan}
        assert compare_storage("f", inventory, Recorded()) == [f"storage 'f': orphan {orphan} found at "
                                                               "open was never swept"]
        assert backend.sweep() == 1
        assert compare_storage("f", backend.inventory(), Recorded()) == []
        assert container_files(str(root)) == set()
    finally:
        backend.close()


def test_orphan_left_while_stopped_is_swept_at_start(tmp_path):
    root = str(tmp_path / "packed")
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as srv, srv.client() as c:
        written = _populate(c, root, None)
        sid = _backend(srv, "packed").storage_id
    stray = os.path.join(root, "s1024", f"{sid}-00000777.kv")
    with open(stray, "wb") as f:
        f.truncate(256 * 1024)
    with serve_in_thread(data_dir=data, overrides=QUIET) as srv, srv.client() as c:
        assert not os.path.exists(stray)
        srv.app.cache.check()
        assert read_problems(c, "i-packed", written["i-packed"], storage_roots(c)) == []


def test_compare_storage_names_double_claims_and_count_mismatches(tmp_path):
    """Two copies naming one slot (one would overwrite the other's bytes), and counts that differ."""
    backend = FileStorage("f", {"root_path": str(tmp_path / "r")})
    backend.open()
    try:
        uri = backend.allocate(1, 1024)[0]
        double = Recorded(uris=Counter({uri: 2}), first={uri: ("inst", 7, 3)}, nbytes=2048)
        assert compare_storage("f", backend.inventory(), double) == [
            f"storage 'f': uri {uri} is named by 2 copies (block 7 of 'inst' (serving) and others)",
            "storage 'f': 1 slots used by its count, 1 reserved, 2 uris recorded in the metadata",
            "storage 'f': 1024 bytes used by its count, 2048 recorded in the metadata",
        ]
        assert compare_storage("f", backend.inventory(), Recorded(uris=Counter({uri: 1}), nbytes=1024)) == []
    finally:
        backend.close()

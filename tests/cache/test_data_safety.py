"""Data safety: kvcm never deletes what it did not create, never serves a block that is gone, and
never wipes data because its metadata file is missing or broken.

Real servers (threads for most, ``kvcm serve`` subprocesses where the exit code matters), real
LMDB in temp dirs, real files and shm segments; the test writes real bytes at the URIs kvcm hands
out and reads them back.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvcm.backends.storage.file import resolve_file_uri
from kvcm.backends.storage.shm import resolve_shm_uri
from kvcm.errors import Code, KvcmError
from kvcm.testing import serve_in_thread
from tests.helpers import add_group, finish, locate, register, start, wait_for

pytestmark = pytest.mark.both_stores

SPECS = [{"name": "tp0", "size": 4096}, {"name": "tp1", "size": 4096}]
QUIET = {"reclaim": {"enabled": False}, "cache": {"delete_poll_ms": 20, "session_check_ms": 50}}


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    prefix = f"kvcm.safety.{uuid.uuid4().hex[:8]}."
    yield prefix
    for path in glob.glob(f"/dev/shm/{prefix}*"):
        os.unlink(path)


def _pattern(key: int, spec: str, size: int) -> bytes:
    seed = f"{key}:{spec}:".encode()
    return (seed * (size // len(seed) + 1))[:size]


def _write_blocks(c: Any, keys: list[int], instance: str = "inst", root: str = "") -> dict[int, list[str]]:
    """start, write real bytes at every URI (file or shm), finish; ``{key: [uri per spec]}``."""
    session = start(c, keys, instance)
    out: dict[int, list[str]] = {}
    for key, loc in zip(keys, session["locations"]):
        out[key] = []
        for spec in loc["location_specs"]:
            _put(spec["uri"], root, _pattern(key, spec["name"], 4096))
            out[key].append(spec["uri"])
    finish(c, session, instance=instance)
    return out


def _put(uri: str, root: str, data: bytes) -> None:
    path, offset, _ = resolve_shm_uri(uri, root or "/dev/shm") if uri.startswith("shm://") else resolve_file_uri(uri, root)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _get(uri: str, root: str) -> bytes:
    path, offset, size = resolve_shm_uri(uri, root or "/dev/shm") if uri.startswith("shm://") else resolve_file_uri(uri, root)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def _root(c: Any, name: str = "default-file") -> str:
    storage = next(s for s in c.call("list_storage")["storage"] if s["global_unique_name"] == name)
    return str(storage["storage_spec"]["root_path"])


def _served(c: Any, keys: list[int], instance: str = "inst") -> list[bool]:
    found = c.call("get_cache_location", {"instance_id": instance, "query_type": "batch_get", "block_keys": keys})
    return [bool(loc["location_specs"][0]["uri"]) for loc in found["locations"]]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _snapshot(directory: str) -> dict[str, bytes]:
    return {os.path.relpath(p, directory): _read(p)
            for p in glob.glob(os.path.join(directory, "**"), recursive=True) if os.path.isfile(p)}


# -- finding 1: foreign directories, overlapping prefixes -----------------------------------------


def test_foreign_shm_directory_is_refused_then_adopted_without_losing_a_file(tmp_path: Any) -> None:
    foreign = tmp_path / "backups"
    foreign.mkdir()
    for name in ("backup.1", "backup.2", "backup.20261201"):
        (foreign / name).write_bytes(b"precious " + name.encode())
    before = _snapshot(str(foreign))
    data = str(tmp_path / "data")
    spec = {"shm_dir": str(foreign), "prefix": "backup.", "segment_size": 1 << 20}
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        with pytest.raises(KvcmError) as info:
            c.call("add_storage", {"storage": {"global_unique_name": "bk", "storage_type": "shm", "storage_spec": spec}})
        assert info.value.code is Code.INVALID_ARGUMENT and "no kvcm ownership marker" in info.value.message
        c.call("add_storage", {"storage": {"global_unique_name": "bk", "storage_type": "shm", "storage_spec": spec},
                               "adopt_directory": True})
        add_group(c, "g", ["bk"])
        register(c, group="g", specs=SPECS)
        written = _write_blocks(c, [1, 2, 3], root=str(foreign))
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        assert _served(c, [1, 2, 3]) == [True, True, True]
        for key, uris in written.items():
            assert [_get(u, str(foreign)) for u in uris] == [_pattern(key, s["name"], 4096) for s in SPECS]
        server.app.cache.check()
    after = _snapshot(str(foreign))
    assert {k: v for k, v in after.items() if k in before} == before  # every foreign file, byte for byte
    assert all(name.startswith("backup.") for name in after)


def test_foreign_file_directory_keeps_its_kv_files(tmp_path: Any) -> None:
    foreign = tmp_path / "theirs"
    (foreign / "s4096").mkdir(parents=True)
    for name in ("00000012.kv", "00000013.kv"):  # named exactly like kvcm's own files once were
        (foreign / "s4096" / name).write_bytes(b"x" * 4096)
    before = _snapshot(str(foreign))
    data = str(tmp_path / "data")
    storage = {"global_unique_name": "theirs", "storage_type": "file", "storage_spec": {"root_path": str(foreign)}}
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        with pytest.raises(KvcmError, match="no kvcm ownership marker"):
            c.call("add_storage", {"storage": storage})
        c.call("add_storage", {"storage": storage, "adopt_directory": True})
        add_group(c, "g", ["theirs"])
        register(c, group="g", specs=SPECS)
        _write_blocks(c, [1, 2], root=str(foreign))
        c.call("remove_cache", {"instance_id": "inst", "block_keys": [1, 2]})
        wait_for(lambda: not any(_served(c, [1, 2])))
    with serve_in_thread(data_dir=data, overrides=QUIET) as server:  # the start-up sweep runs here
        assert server.app.storages.get("theirs").usage()["foreign"] == 2
    after = _snapshot(str(foreign))
    assert {k: v for k, v in after.items() if k in before} == before


def test_another_kvcms_blocks_are_never_touched(tmp_path: Any) -> None:
    first = str(tmp_path / "first")
    with serve_in_thread(data_dir=first, overrides=QUIET) as server, server.client() as c:
        register(c, specs=SPECS)
        _write_blocks(c, list(range(1, 43)), root=_root(c))
        blocks = _root(c)
    before = _snapshot(blocks)
    storage = {"global_unique_name": "stolen", "storage_type": "file", "storage_spec": {"root_path": blocks}}
    second = str(tmp_path / "second")
    with serve_in_thread(data_dir=second, overrides=QUIET) as server, server.client() as c:
        with pytest.raises(KvcmError) as info:
            c.call("add_storage", {"storage": storage})
        assert "belongs to storage 'default-file'" in info.value.message and "nothing there was touched" in info.value.message
        c.call("add_storage", {"storage": storage, "adopt_directory": True})  # even when adopted
    with serve_in_thread(data_dir=second, overrides=QUIET):
        pass  # a restart: recovery and the sweep run over the adopted directory
    assert {k: v for k, v in _snapshot(blocks).items() if not k.startswith(".kvcm-")} == \
        {k: v for k, v in before.items() if not k.startswith(".kvcm-")}


def test_overlapping_shm_prefixes_never_sweep_each_other(tmp_path: Any, shm_prefix: str) -> None:
    """``seg1`` holds live segments; a storage with prefix ``seg`` (a prefix of it) is refused by
    placement, and even opened directly its sweep leaves ``seg1``'s segments alone."""
    from kvcm.backends.storage.ownership import Owner
    from kvcm.backends.storage.registry import open_backend

    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        c.call("add_storage", {"storage": {"global_unique_name": "one", "storage_type": "shm",
                                           "storage_spec": {"prefix": shm_prefix + "seg1", "segment_size": 1 << 20}}})
        add_group(c, "g", ["one"])
        register(c, group="g", specs=SPECS)
        _write_blocks(c, list(range(1, 13)))
        with pytest.raises(KvcmError, match="overlaps prefix"):
            c.call("add_storage", {"storage": {"global_unique_name": "two", "storage_type": "shm",
                                               "storage_spec": {"prefix": shm_prefix + "seg"}}})
    live = sorted(glob.glob(f"/dev/shm/{shm_prefix}seg1*"))
    contents = {p: _read(p) for p in live}
    with pytest.raises(KvcmError, match="no kvcm ownership marker"):  # bypassing placement
        open_backend("shm", "two", {"prefix": shm_prefix + "seg"}, None)
    sneaky = open_backend("shm", "two", {"prefix": shm_prefix + "seg"}, None, Owner("0123abcd", on_foreign="adopt"))
    sneaky.reserve([])
    assert sneaky.sweep() == 0
    sneaky.close()
    assert {p: _read(p) for p in sorted(glob.glob(f"/dev/shm/{shm_prefix}seg1*"))} == contents
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        assert _served(c, list(range(1, 13))) == [True] * 12
        server.app.cache.check()


def test_container_names_carry_the_storage_id_and_the_marker_names_the_data_dir(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        register(c, specs=SPECS)
        written = _write_blocks(c, [1], root=_root(c))
        storage = next(s for s in c.call("list_storage")["storage"] if s["global_unique_name"] == "default-file")
        sid = storage["storage_id"]
        assert len(sid) == 8 and all(u.split("/")[-1].startswith(f"{sid}-") for u in written[1])
        marker = json.loads(_read(os.path.join(_root(c), ".kvcm-storage")))
        assert marker["storage_id"] == sid and marker["data_dir_id"] == server.app.registry.data_dir_id
        with pytest.raises(KvcmError, match="storage_id"):
            c.call("add_storage", {"storage": {"global_unique_name": "x", "storage_type": "file", "storage_id": sid,
                                               "storage_spec": {"root_path": str(tmp_path / "x")}}})


@pytest.mark.store_independent
def test_symlinks_out_of_a_storage_are_not_followed(tmp_path: Any) -> None:
    from kvcm.backends.storage.registry import open_backend

    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    backend = open_backend("file", "f", {"root_path": str(root)}, None)
    backend.close()
    victim = outside / f"{backend.storage_id}-00000000.kv"  # a name the storage would sweep as its own
    victim.write_bytes(b"keep me")
    os.symlink(outside, root / "s4096")
    backend = open_backend("file", "f", {"root_path": str(root)}, None)
    backend.reserve([])
    assert backend.sweep() == 0
    with pytest.raises(KvcmError, match="symbolic link"):
        backend.allocate(1, 4096)
    backend.close()
    assert victim.read_bytes() == b"keep me"


@pytest.mark.lmdb_only("builds its pre-marker registry on an LmdbStore directly")
def test_a_storage_from_before_markers_is_adopted_and_keeps_serving(tmp_path: Any) -> None:
    """Records written before storage ids (no ``storage_id``) open once with a new id and adopt
    their directory; old-style file names are served through the metadata but never swept."""
    import msgspec

    from kvcm.backends.metastore import LmdbStore
    from kvcm.cache.storage_pool import StoragePool
    from kvcm.control.records import Storage
    from kvcm.control.registry import Registry, new_id

    root = tmp_path / "old"
    (root / "s4096").mkdir(parents=True)
    (root / "s4096" / "00000007.kv").write_bytes(b"old orphan")  # no metadata names it
    store = LmdbStore(str(tmp_path / "data"))
    try:
        registry = Registry(store, str(tmp_path / "data"), (str(tmp_path),))
        registry.add_storage(Storage(global_unique_name="old", storage_type="file",
                                     storage_spec={"root_path": str(root)}), adopt=True)
        record = msgspec.structs.replace(registry.get_storage("old"), storage_id="")
        with store.write() as txn:  # as a kvcm from before storage ids left it
            registry._storages.put(txn, record, registry._changed)
        assert not (root / ".kvcm-storage").exists()  # no pool opened it yet
        pool = StoragePool(registry, str(tmp_path / "data"))
        pool.open_all()
        backend = pool.get("old")
        assert backend is not None
        sid = registry.get_storage("old").storage_id
        assert len(sid) == 8 and sid != new_id()
        backend.reserve([])
        assert backend.sweep() == 0
        assert (root / "s4096" / "00000007.kv").read_bytes() == b"old orphan"
        assert backend.allocate(1, 4096)[0].startswith(f"file://old/s4096/{sid}-")
        pool.close()
    finally:
        store.close()


# -- finding 2: lost blocks ----------------------------------------------------------------------


def _lost_metric(server: Any, source: str) -> float:
    value = server.app.metrics.registry.get_sample_value("kvcm_blocks_lost_total", {"source": source})
    return float(value or 0)


def test_vanished_file_is_lost_not_served_and_can_be_rewritten(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        register(c, specs=SPECS)
        root = _root(c)
        _write_blocks(c, [1, 2, 3], root=root)
    for path in glob.glob(os.path.join(root, "s4096", "*.kv")):
        os.unlink(path)
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        assert locate(c, [1, 2, 3]) == []
        metas = c.call("get_cache_meta", {"instance_id": "inst", "block_keys": [1, 2, 3]})["metas"]
        # Never served again: deleting until the deleter has dropped them, then gone.
        assert {m["status"] for m in metas} <= {"deleting", "not_found"}
        assert _lost_metric(server, "startup") == 3  # copies (a copy holds every spec of a block)
        # The deleter frees lost copies at once: their slots and usage come back.
        assert wait_for(lambda: server.app.storages.get("default-file").usage()["slots_used"] == 0)
        assert wait_for(lambda: server.app.cache.usage("default")["bytes"] == 0)  # usage released
        assert wait_for(lambda: {m["status"] for m in c.call(
            "get_cache_meta", {"instance_id": "inst", "block_keys": [1, 2, 3]})["metas"]} == {"not_found"})
        session = start(c, [1, 2, 3])
        assert session["block_mask"] != {"offset": 3} and len(session["locations"]) == 3
        rewritten = {k: [s["uri"] for s in loc["location_specs"]] for k, loc in zip([1, 2, 3], session["locations"])}
        for key, uris in rewritten.items():
            for uri, spec in zip(uris, SPECS):
                _put(uri, root, _pattern(key, spec["name"], 4096))
        finish(c, session)
        assert len(locate(c, [1, 2, 3])) == 3
        server.app.cache.check()
        for key, uris in rewritten.items():
            assert [_get(u, root) for u in uris] == [_pattern(key, s["name"], 4096) for s in SPECS]


def test_truncated_file_loses_only_the_blocks_past_its_end(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        register(c, specs=[{"name": "tp0", "size": 4096}])
        root = _root(c)
        written = _write_blocks_one_spec(c, [1, 2, 3], root)
    (path,) = glob.glob(os.path.join(root, "s4096", "*.kv"))
    os.truncate(path, 4096)  # only the first slot's bytes remain
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        assert _served(c, [1, 2, 3]) == [True, False, False]
        assert _get(written[1], root) == _pattern(1, "tp0", 4096)
        assert _lost_metric(server, "startup") == 2


def _write_blocks_one_spec(c: Any, keys: list[int], root: str) -> dict[int, str]:
    session = start(c, keys)
    out = {}
    for key, loc in zip(keys, session["locations"]):
        uri = loc["location_specs"][0]["uri"]
        _put(uri, root, _pattern(key, "tp0", 4096))
        out[key] = uri
    finish(c, session)
    return out


def test_a_file_vanishing_while_serving_is_found_by_the_scan(tmp_path: Any) -> None:
    overrides = {**QUIET, "cache": {**QUIET["cache"], "lost_scan_s": 0.1}}
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=overrides) as server, server.client() as c:
        register(c, specs=SPECS)
        root = _root(c)
        _write_blocks(c, [1, 2], root=root)
        assert _served(c, [1, 2]) == [True, True]
        for path in glob.glob(os.path.join(root, "s4096", "*.kv")):
            os.unlink(path)
        assert wait_for(lambda: _served(c, [1, 2]) == [False, False])
        assert _lost_metric(server, "scan") == 2
        assert len(start(c, [1, 2])["locations"]) == 2  # writable again


def test_report_lost_stops_serving_and_frees_the_key(tmp_path: Any) -> None:
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as server, server.client() as c:
        register(c, specs=SPECS)
        _write_blocks(c, [1, 2, 3], root=_root(c))
        assert c.call("report_lost", {"instance_id": "inst", "block_keys": [2]}) == {"lost": 1}
        assert _served(c, [1, 2, 3]) == [True, False, True]
        assert _lost_metric(server, "client") == 1
        assert c.call("report_lost", {"instance_id": "inst", "block_keys": [2]}) == {"lost": 0}  # idempotent
        # Freed by the deleter at once (no grace delay), then the key takes a new write.
        assert wait_for(lambda: c.call("get_cache_meta", {"instance_id": "inst", "block_keys": [2]})
                        ["metas"][0]["status"] == "not_found")
        session = start(c, [1, 2, 3])
        assert len(session["locations"]) == 1  # only key 2 needs writing again
        with pytest.raises(KvcmError) as info:
            c.call("report_lost", {"instance_id": "inst", "block_key": [2]})
        assert info.value.code is Code.INVALID_ARGUMENT and "block_key" in info.value.message


# -- finding 4: missing or corrupt metadata ------------------------------------------------------


def _serve(data: str, *extra: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """``kvcm serve`` in a subprocess; stopped by SIGTERM once it printed that it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "kvcm", "serve", "--data-dir", data, "--endpoint",
                             f"ipc://{data}/rpc.sock", "--http-port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.startswith("kvcm serving"):
        proc.terminate()
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, line + out, err)


@pytest.fixture
def data_with_blocks(tmp_path: Any) -> Iterator[tuple[str, str, dict[str, bytes]]]:
    data = tempfile_dir(tmp_path)
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        register(c, specs=SPECS)
        root = _root(c)
        _write_blocks(c, list(range(1, 9)), root=root)
    (tmp_path / "keep").write_text("")
    yield data, root, _snapshot(root)


def tempfile_dir(tmp_path: Any) -> str:
    path = os.path.join(str(tmp_path), "d")
    os.makedirs(path)
    return path


@pytest.mark.lmdb_only("deletes data.mdb; Redis: test_redis_store.py::test_an_empty_prefix_beside_stored_blocks_refuses_the_start")
def test_missing_metadata_refuses_to_start_and_deletes_nothing(data_with_blocks: Any) -> None:
    data, root, before = data_with_blocks
    os.unlink(os.path.join(data, "meta", "data.mdb"))
    done = _serve(data)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.mdb is missing" in lines[0] and "--adopt-orphans" in lines[0], lines
    assert _snapshot(root) == before
    assert not os.path.exists(os.path.join(data, "meta", "data.mdb"))  # nothing created either
    again = _serve(data)  # the same answer every time until the admin decides
    assert again.returncode == 2 and _snapshot(root) == before


@pytest.mark.lmdb_only("deletes data.mdb to make the orphans")
def test_adopt_orphans_keeps_the_files_and_discard_deletes_only_kvcms(data_with_blocks: Any) -> None:
    data, root, before = data_with_blocks
    blocks = [k for k in before if k.endswith(".kv")]
    stray = os.path.join(root, "s4096", "00000099.kv")  # named like a container, but by no marked storage
    _write(stray, b"someone else's")
    os.unlink(os.path.join(data, "meta", "data.mdb"))
    adopted = _serve(data, "--adopt-orphans")
    assert adopted.returncode == 0, adopted.stderr
    assert {k: v for k, v in _snapshot(root).items() if k in blocks} == {k: before[k] for k in blocks}
    os.unlink(os.path.join(data, "meta", "data.mdb"))
    assert _serve(data).returncode == 2  # adopted files are still recorded by no metadata
    discarded = _serve(data, "--discard-orphans")
    assert discarded.returncode == 0, discarded.stderr
    left = _snapshot(root)
    assert not any(k in left for k in blocks)  # the blocks kvcm named are gone
    assert left[os.path.relpath(stray, root)] == b"someone else's"  # the stray file stays


@pytest.mark.lmdb_only("corrupts the LMDB meta pages")
def test_corrupt_metadata_exits_2_with_one_line_and_deletes_nothing(data_with_blocks: Any) -> None:
    data, root, before = data_with_blocks
    meta = os.path.join(data, "meta", "data.mdb")
    with open(meta, "r+b") as f:
        f.write(os.urandom(8192))  # both meta pages
    done = _serve(data)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and meta in lines[0] and "cannot be read" in lines[0] and "Traceback" not in done.stderr
    assert _snapshot(root) == before


@pytest.mark.lmdb_only("corrupts LMDB pages")
def test_corrupt_pages_past_the_header_exit_2_too(data_with_blocks: Any) -> None:
    data, root, before = data_with_blocks
    meta = os.path.join(data, "meta", "data.mdb")
    size = os.path.getsize(meta)
    with open(meta, "r+b") as f:
        f.seek(2 * 4096)
        f.write(b"\xff" * (size - 2 * 4096))
    done = _serve(data)
    assert done.returncode == 2, done
    assert "cannot be read" in done.stderr and "Traceback" not in done.stderr
    assert _snapshot(root) == before


def test_unopenable_storage_files_are_not_swept_on_a_fresh_shm_prefix(shm_prefix: str, tmp_path: Any) -> None:
    """A shm prefix already holding unrelated files is refused: kvcm writes no marker there."""
    _write(f"/dev/shm/{shm_prefix}7", b"not kvcm's")
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as server, server.client() as c, \
            pytest.raises(KvcmError, match="no kvcm ownership marker"):
        c.call("add_storage", {"storage": {"global_unique_name": "s", "storage_type": "shm",
                                           "storage_spec": {"prefix": shm_prefix}}})
    assert _read(f"/dev/shm/{shm_prefix}7") == b"not kvcm's"
    assert not os.path.exists(f"/dev/shm/{shm_prefix}kvcm-storage")
    shutil.rmtree(str(tmp_path / "data"), ignore_errors=True)


def test_update_storage_refuses_a_spec_that_would_not_open(tmp_path: Any) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "theirs.txt").write_text("keep")
    (tmp_path / "a-file").write_text("x")
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as server, server.client() as c:
        c.call("add_storage", {"storage": {"global_unique_name": "f", "storage_type": "file",
                                           "storage_spec": {"root_path": str(tmp_path / "mine")}}})
        for root, why in ((foreign, "no kvcm ownership marker"), (tmp_path / "a-file", "cannot be opened")):
            with pytest.raises(KvcmError, match=why):
                c.call("update_storage", {"storage": {"global_unique_name": "f", "storage_type": "file",
                                                      "storage_spec": {"root_path": str(root)}}})
        listed = next(s for s in c.call("list_storage")["storage"] if s["global_unique_name"] == "f")
        assert listed["storage_spec"]["root_path"] == str(tmp_path / "mine")
        moved = c.call("update_storage", {"storage": {"global_unique_name": "f", "storage_type": "file",
                                                      "storage_spec": {"root_path": str(tmp_path / "new")}}})
        assert moved["storage"]["storage_id"] == listed["storage_id"]
    assert sorted(os.listdir(foreign)) == ["theirs.txt"]


def test_the_default_storage_packs_blocks_into_few_files(tmp_path: Any) -> None:
    """A 6-block, 2-rank prompt was 12 files with one block per file; packed, it is one file, and
    a thousand more blocks still fit in it."""
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as server, server.client() as c:
        register(c, specs=SPECS)
        root = _root(c)
        _write_blocks(c, list(range(1, 7)), root=root)
        assert len(glob.glob(os.path.join(root, "s4096", "*.kv"))) == 1
        _write_blocks(c, list(range(100, 1100)), root=root)
        assert len(glob.glob(os.path.join(root, "s4096", "*.kv"))) == 1
        assert server.app.storages.get("default-file").usage()["slots_used"] == 2 * 1006
        server.app.cache.check()  # its scans of 1006 records cross the store's scan pages

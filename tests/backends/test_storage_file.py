"""``file`` storage: real sparse files in a tmp dir, written and read back like a client would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from kvcm.backends.storage.file import FileStorage, resolve_file_uri
from kvcm.backends.storage.ownership import standalone_owner
from kvcm.backends.storage.registry import open_backend
from kvcm.errors import CapacityError, Code, Conflict, InvalidArgument
from kvcm.proto.uris import parse_uri

SID = standalone_owner("file", "f1").storage_id  # the id in every container name
SID_DEFAULT = standalone_owner("file", "default-file").storage_id
BLOCK = 64 * 1024  # several filesystem blocks, so punched holes show up in st_blocks


def make(tmp_path, **spec) -> FileStorage:
    spec.setdefault("root_path", "store")
    spec.setdefault("key_count_per_file", 4)
    backend = open_backend("file", "f1", spec, str(tmp_path))
    assert isinstance(backend, FileStorage)
    return backend


def write_block(backend: FileStorage, uri: str, fill: bytes) -> None:
    """What a client does: resolve the URI against root_path and pwrite at blkid*size."""
    path, offset, size = resolve_file_uri(uri, backend.root)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, fill * size, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_block(backend: FileStorage, uri: str) -> bytes:
    path, offset, size = resolve_file_uri(uri, backend.root)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def files(backend: FileStorage) -> list[str]:
    """Block files under the root (not the .kvcm-lock file)."""
    return sorted(
        os.path.relpath(os.path.join(d, n), backend.root)
        for d, _, ns in os.walk(backend.root) for n in ns if not n.startswith(".")
    )


def test_uri_format_and_relative_root(tmp_path):
    backend = make(tmp_path)
    uris = backend.allocate(5, 4096)
    assert backend.root == str(tmp_path / "store")
    assert uris[0] == f"file://f1/s4096/{SID}-00000000.kv?blkid=0&size=4096"
    assert {parse_uri(u).params["blkid"] for u in uris[:4]} == {"0", "1", "2", "3"}
    assert uris[4] == f"file://f1/s4096/{SID}-00000001.kv?blkid=0&size=4096"
    assert files(backend) == [f"s4096/{SID}-00000000.kv", f"s4096/{SID}-00000001.kv"]
    assert os.path.getsize(backend.file_path(uris[0])) == 4 * 4096  # sparse, full length


def test_client_writes_and_reads_at_blkid_times_size(tmp_path):
    backend = make(tmp_path)
    uris = backend.allocate(4, BLOCK)
    for i, uri in enumerate(uris):
        write_block(backend, uri, bytes([65 + i]))
    for i, uri in enumerate(uris):
        assert read_block(backend, uri) == bytes([65 + i]) * BLOCK
    with open(backend.file_path(uris[0]), "rb") as f:
        whole = f.read()
    assert whole == b"".join(bytes([65 + i]) * BLOCK for i in range(4))
    assert all(backend.exists(u) for u in uris)


def test_size_classes_get_their_own_files(tmp_path):
    backend = make(tmp_path)
    a, b = backend.allocate(1, 4096)[0], backend.allocate(1, 8192)[0]
    assert parse_uri(a).path != parse_uri(b).path
    assert files(backend) == [f"s4096/{SID}-00000000.kv", f"s8192/{SID}-00000001.kv"]


def test_freed_slots_are_reused_first(tmp_path):
    backend = make(tmp_path)
    uris = backend.allocate(4, 4096)
    assert backend.delete([uris[2]]) == []
    assert not backend.exists(uris[2])
    again = backend.allocate(1, 4096)
    assert again == [uris[2]]
    assert len(files(backend)) == 1
    assert backend.usage()["slots_used"] == 4


def test_fully_freed_file_is_unlinked(tmp_path):
    backend = make(tmp_path)
    first, second = backend.allocate(4, 4096), backend.allocate(2, 4096)
    backend.delete(first[:3])
    backend.release(first[3:])
    assert files(backend) == [f"s4096/{SID}-00000001.kv"]
    backend.delete(second)
    assert files(backend) == []
    assert backend.usage() | {} == {
        "bytes_used": 0, "bytes_capacity": 0, "slots_used": 0, "bytes_allocated": 0,
        "files": 0, "orphans": 0, "foreign": 0, "lost": 0,
    }
    # names are never reused: a late delete of an old URI cannot hit a new file
    assert backend.allocate(1, 4096) == [f"file://f1/s4096/{SID}-00000002.kv?blkid=0&size=4096"]


def test_delete_really_returns_disk_space(tmp_path):
    backend = make(tmp_path)
    uris = backend.allocate(4, BLOCK)
    for uri in uris:
        write_block(backend, uri, b"x")
    path = backend.file_path(uris[0])
    full = os.stat(path).st_blocks
    assert full * 512 >= 4 * BLOCK
    backend.delete(uris[1:3])
    after = os.stat(path).st_blocks
    if after == full:
        pytest.skip("filesystem under tmp_path does not punch holes")
    assert (full - after) * 512 >= 2 * BLOCK
    assert read_block(backend, uris[0]) == b"x" * BLOCK  # neighbours untouched
    assert read_block(backend, uris[3]) == b"x" * BLOCK
    assert read_block(backend, uris[1]) == b"\0" * BLOCK


def test_delete_is_idempotent_and_rejects_foreign_uris(tmp_path):
    backend = make(tmp_path)
    uris = backend.allocate(2, 4096)
    backend.delete(uris[:1])
    backend.delete(uris[:1])
    assert backend.usage()["slots_used"] == 1
    for bad in (
        "file://other/s4096/00000000.kv?blkid=0&size=4096",
        "file://f1/../../etc/passwd?blkid=0&size=4096",
        "file://f1/s4096/00000000.kv?blkid=0&size=8192",
        "file://f1/s4096/00000000.kv?size=4096",
        "shm://f1/s4096/00000000.kv?blkid=0&size=4096",
    ):
        with pytest.raises(InvalidArgument):
            backend.delete([bad, uris[1]])
    assert backend.exists(uris[1])  # a bad batch changes nothing


def test_capacity_and_closed(tmp_path):
    backend = make(tmp_path, capacity_bytes=3 * 4096)
    backend.allocate(2, 4096)
    with pytest.raises(CapacityError) as exc:
        backend.allocate(2, 4096)
    assert exc.value.code == Code.CAPACITY_EXHAUSTED
    assert backend.usage()["slots_used"] == 2  # all or nothing
    backend.close()
    with pytest.raises(CapacityError) as exc:
        backend.allocate(1, 4096)
    assert exc.value.code == Code.NO_STORAGE_AVAILABLE
    with pytest.raises(InvalidArgument):
        make(tmp_path).allocate(1, 0)


def test_failed_allocation_rolls_back(tmp_path, monkeypatch):
    backend = make(tmp_path)
    backend.allocate(3, 4096)
    real = os.ftruncate
    calls = []

    def flaky(fd, length):
        calls.append(length)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(fd, length)

    monkeypatch.setattr(os, "ftruncate", flaky)
    with pytest.raises(CapacityError):
        backend.allocate(10, 4096)  # 1 reused slot + a new file + a failing one
    assert backend.usage()["slots_used"] == 3
    assert files(backend) == [f"s4096/{SID}-00000000.kv"]


def test_reserve_recovers_after_restart(tmp_path):
    backend = make(tmp_path)
    uris = backend.allocate(6, 4096)  # file 0: 4 slots, file 1: 2 slots
    orphan = backend.allocate(1, 8192)  # never committed: kvcm "crashes" now
    write_block(backend, uris[0], b"k")
    backend.close()

    again = make(tmp_path)
    assert again.usage()["orphans"] == 3
    again.reserve(uris[:2] + uris[4:5])
    again.reserve(uris[:1])  # idempotent
    assert again.sweep() == 1  # only the 8192 file had no reserved URI
    assert files(again) == [f"s4096/{SID}-00000000.kv", f"s4096/{SID}-00000001.kv"]
    assert again.usage()["slots_used"] == 3 and again.usage()["files"] == 2
    assert read_block(again, uris[0]) == b"k" * 4096
    assert not again.exists(orphan[0]) and again.exists(uris[4]) and not again.exists(uris[5])
    reused = again.allocate(5, 4096)  # the free slots of adopted files come first
    assert {parse_uri(u).path for u in reused} == {f"/s4096/{SID}-00000000.kv", f"/s4096/{SID}-00000001.kv"}
    assert set(uris[2:4] + uris[5:6]) <= set(reused)
    assert again.allocate(1, 4096)[0].startswith(f"file://f1/s4096/{SID}-00000003.kv")  # past every old name


def test_reserve_of_missing_file_is_accounted_but_lost(tmp_path):
    backend = make(tmp_path)
    uris = backend.allocate(2, 4096)
    backend.close()
    os.unlink(backend.file_path(uris[0]))
    again = make(tmp_path)
    again.reserve(uris)
    assert again.usage()["lost"] == 1 and again.usage()["slots_used"] == 2
    assert not again.exists(uris[0])
    fresh = again.allocate(1, 4096)[0]
    assert parse_uri(fresh).path != parse_uri(uris[0]).path  # never allocates into a lost file
    again.delete(uris)
    assert again.usage()["lost"] == 0 and again.usage()["slots_used"] == 1


def test_reusable_vouches_only_for_slots_allocate_could_hand_out(tmp_path):
    """In-line eviction hands a victim's reserved slot straight to a new block only when the
    storage says it could have handed that slot out: reserved, of the size asked, in a
    container still in service, of an open storage. Asking changes nothing."""
    backend = make(tmp_path)
    uris = backend.allocate(3, 4096)
    backend.delete(uris[2:])
    assert backend.reusable(uris, [4096, 4096, 4096]) == [True, True, False]  # the third is free
    assert backend.reusable(uris[:1], [8192]) == [False]  # another size
    assert backend.reusable(["file://f1/s4096/nope.kv?blkid=0&size=4096", "mooncake://f1/?key=k&size=4096"],
                            [4096, 4096]) == [False, False]  # malformed, or another storage's kind
    elsewhere = uris[0].replace("-00000000.kv", "-00000009.kv")
    assert backend.file_path(elsewhere)  # a well-formed URI of this storage ...
    assert backend.reusable([elsewhere], [4096]) == [False]  # ... in a container it does not hold
    assert backend.usage()["slots_used"] == 2  # nothing changed
    assert backend.allocate(1, 4096) == uris[2:3]
    assert backend.intact()  # it would say yes to every reserved slot
    backend.close()
    assert not backend.intact()

    again = make(tmp_path)
    again.reserve(uris[:3])
    assert again.intact()
    os.unlink(again.file_path(uris[0]))
    again.rescan()  # the container vanished: its slots are lost, never handed out again
    assert again.reusable(uris[:1], [4096]) == [False] and not again.intact()
    again.close()
    assert again.reusable(uris[:1], [4096]) == [False]  # closed: hands out nothing


def test_concurrent_allocate_and_delete(tmp_path):
    backend = make(tmp_path)
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(50):
                uris = backend.allocate(3, 4096)
                assert len(set(uris)) == 3
                backend.delete(uris)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert backend.usage()["slots_used"] == 0 and files(backend) == []


def test_health_probe(tmp_path):
    backend = make(tmp_path)
    assert backend.health()
    assert sorted(os.listdir(backend.root)) == [".kvcm-lock", ".kvcm-storage"]  # the probe cleans up
    shutil.rmtree(backend.root)
    assert not backend.health()  # and does not recreate a vanished root
    assert not os.path.exists(backend.root)
    os.makedirs(backend.root)
    assert backend.health()
    backend.close()
    assert not backend.health()


def test_health_flips_when_root_becomes_unwritable(tmp_path):
    backend = make(tmp_path)
    if os.geteuid() == 0:
        lock, unlock = ["chattr", "+i", backend.root], ["chattr", "-i", backend.root]
        if subprocess.run(lock, check=False, capture_output=True).returncode != 0:
            pytest.skip("root, and chattr +i is not available to make a directory unwritable")
    else:
        os.chmod(backend.root, 0o500)
        lock, unlock = [], []
    try:
        assert not backend.health()
    finally:
        if unlock:
            subprocess.run(unlock, check=True)
        os.chmod(backend.root, 0o755)
    assert backend.health()


def test_spec_validation(tmp_path):
    with pytest.raises(InvalidArgument, match="root_path"):
        open_backend("file", "f1", {}, str(tmp_path))
    with pytest.raises(InvalidArgument, match="key_count_per_file"):
        open_backend("file", "f1", {"root_path": "x", "key_count_per_file": -1}, str(tmp_path))
    with pytest.raises(InvalidArgument, match="key_count_perfile"):
        open_backend("file", "f1", {"root_path": "x", "key_count_perfile": 8}, str(tmp_path))
    with pytest.raises(InvalidArgument, match="data dir"):
        open_backend("file", "f1", {"root_path": "x"}, None)
    absolute = open_backend("file", "f1", {"root_path": str(tmp_path / "abs")}, None)
    assert isinstance(absolute, FileStorage) and absolute.root == str(tmp_path / "abs")
    # Packed by default: as many blocks per file as fit in 64 MiB.
    assert absolute.key_count_per_file == 0 and absolute.file_size == 64 << 20
    assert absolute.slots_per_container(4096) == 16384 and absolute.slots_per_container(1 << 30) == 1
    with pytest.raises(Exception, match="not a directory"):
        open_backend("file", "f1", {"root_path": str(tmp_path / "nfs"), "create_root": False}, None)


LOCKER = r"""
import sys, time
from kvcm.backends.storage.registry import open_backend
open_backend("file", "f1", {"root_path": sys.argv[1]}, None)
print("locked", flush=True)
time.sleep(30)
"""


def test_one_process_per_root(tmp_path):
    root = str(tmp_path / "shared")
    child = subprocess.Popen([sys.executable, "-c", LOCKER, root], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        with pytest.raises(Conflict, match="another process"):
            open_backend("file", "f1", {"root_path": root}, None)
    finally:
        child.kill()
        child.wait()
    first = open_backend("file", "f1", {"root_path": root}, None)
    second = open_backend("file", "f1", {"root_path": root}, None)  # same process: a spec update re-opens
    second.close()
    first.close()


def test_reserve_keeps_every_valid_uri_when_some_are_bad(tmp_path):
    backend = make(tmp_path)
    uris = backend.allocate(3, 4096)
    backend.close()
    again = make(tmp_path)
    past_the_end = f"file://f1/s4096/{SID}-00000000.kv?blkid=9&size=4096"  # the file holds 4 slots
    with pytest.raises(InvalidArgument, match="1 uri"):
        again.reserve([uris[0], f"file://f1/s4096/{SID}-00000000.kv?blkid=0&size=8192", past_the_end, uris[2]])
    assert again.exists(uris[0]) and again.exists(uris[2]) and not again.exists(uris[1])
    # A slot past the end of its file has no bytes: reserved (deletes balance) but lost.
    assert again.lost([uris[0], past_the_end, uris[2]]) == {past_the_end} and not again.exists(past_the_end)


def test_registry_shaped_spec_and_record(tmp_path):
    spec = {"root_path": str(tmp_path / "blocks"), "key_count_per_file": 1}
    record = SimpleNamespace(global_unique_name="default-file", storage_type="file", storage_spec=spec)
    backend = open_backend(record, str(tmp_path))  # the registry's form: open_backend(storage, data_dir)
    assert backend.name == "default-file" and backend.spec_source == spec
    assert backend.allocate(1, 10) == [f"file://default-file/s10/{SID_DEFAULT}-00000000.kv?blkid=0&size=10"]


def test_a_lock_taken_on_a_file_unlinked_meanwhile_is_taken_again(tmp_path, monkeypatch):
    """Another kvcm dropping its lock unlinks the lock file while holding it; a process that
    opened the file just before then locks an inode no path names. The lock only counts once
    the path still names the locked file (the race is replayed by unlinking and recreating the
    file between open and flock, as the other process would)."""
    import fcntl

    from kvcm import lockfile

    path = str(tmp_path / "lockfile")
    real_flock = fcntl.flock
    raced = []

    def flock_after_the_other_process_dropped_it(fd, op):
        if not raced:
            raced.append(os.fstat(fd).st_ino)
            os.unlink(path)
            with open(path, "w"):
                pass  # the next kvcm's fresh lock file at the same path
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_other_process_dropped_it)
    lockfile.hold_lock_file(path, "owner", "test storage")
    try:
        held_fd = lockfile._held[path][0]
        assert os.fstat(held_fd).st_ino == os.stat(path).st_ino != raced[0]  # locked what the path names
    finally:
        lockfile.drop_lock_file(path)

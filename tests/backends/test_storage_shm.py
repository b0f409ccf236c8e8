"""``shm`` storage: real POSIX shared-memory segments, written by another process."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import uuid

import pytest

from kvcm.backends.storage.ownership import standalone_owner
from kvcm.backends.storage.registry import open_backend
from kvcm.backends.storage.shm import ShmStorage, resolve_shm_uri
from kvcm.errors import CapacityError, Conflict, InvalidArgument
from kvcm.proto.uris import parse_uri

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

BLOCK = 64 * 1024
S = standalone_owner("shm", "sidecar").storage_id  # the storage id in its segment names
S2 = standalone_owner("shm", "s").storage_id


@pytest.fixture
def prefix():
    """A prefix of our own; every segment with it is gone after the test, whatever happened."""
    p = f"kvcm.test.{uuid.uuid4().hex[:12]}."
    yield p
    for path in glob.glob(f"/dev/shm/{p}*"):
        os.unlink(path)


def make(prefix: str, **spec) -> ShmStorage:
    spec.setdefault("segment_size", 4 * BLOCK)
    backend = open_backend("shm", "sidecar", {"prefix": prefix, **spec}, None)
    assert isinstance(backend, ShmStorage)
    return backend


def segments(prefix: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/{prefix}[0-9a-f]*"))


CHILD = r"""
import mmap, os, sys
from kvcm.backends.storage.shm import resolve_shm_uri
for uri in sys.argv[1:]:
    path, offset, size = resolve_shm_uri(uri)
    fd = os.open(path, os.O_RDWR)
    with mmap.mmap(fd, 0) as mem:
        mem[offset:offset + size] = bytes([offset // size + 97]) * size
    os.close(fd)
"""


def test_another_process_maps_and_writes_blocks(prefix):
    backend = make(prefix)
    uris = backend.allocate(3, BLOCK)
    assert uris[1] == f"shm://sidecar/{prefix}{S}-0?offset={BLOCK}&size={BLOCK}"
    subprocess.run([sys.executable, "-c", CHILD, *uris], check=True, timeout=30)
    for i, uri in enumerate(uris):
        path, offset, size = resolve_shm_uri(uri)
        assert path == backend.segment_path(uri)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, size, offset) == bytes([97 + i]) * size
        finally:
            os.close(fd)
    assert all(backend.exists(u) for u in uris)


def test_slots_reused_segments_unlinked_and_memory_returned(prefix):
    backend = make(prefix)
    first = backend.allocate(4, BLOCK)
    second = backend.allocate(1, BLOCK)
    assert segments(prefix) == [f"{prefix}{S}-0", f"{prefix}{S}-1"]
    subprocess.run([sys.executable, "-c", CHILD, *first], check=True, timeout=30)
    path = backend.segment_path(first[0])
    full = os.stat(path).st_blocks
    backend.delete(first[1:3])
    assert (full - os.stat(path).st_blocks) * 512 >= 2 * BLOCK  # tmpfs gave the memory back
    assert backend.allocate(1, BLOCK)[0] in first[1:3]  # a freed slot, not a new segment
    backend.delete(second)
    assert segments(prefix) == [f"{prefix}{S}-0"]
    assert backend.usage()["segments"] == 1 and backend.usage()["slots_used"] == 3


def test_close_keeps_segments_and_restart_recovers(prefix):
    backend = make(prefix)
    kept = backend.allocate(2, BLOCK)
    backend.allocate(1, 2 * BLOCK)  # an orphan: its metadata never committed
    subprocess.run([sys.executable, "-c", CHILD, *kept], check=True, timeout=30)
    backend.close()
    assert segments(prefix) == [f"{prefix}{S}-0", f"{prefix}{S}-1"]

    again = make(prefix)
    again.reserve(kept)
    assert again.sweep() == 1
    assert segments(prefix) == [f"{prefix}{S}-0"]
    path, offset, size = resolve_shm_uri(kept[1])
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(size) == b"b" * size
    assert again.allocate(1, BLOCK)[0] == f"shm://sidecar/{prefix}{S}-0?offset={2 * BLOCK}&size={BLOCK}"
    assert again.allocate(3, BLOCK)[-1].startswith(f"shm://sidecar/{prefix}{S}-2?")  # past old names
    assert again.destroy() == 2
    assert segments(prefix) == []


def test_lost_segments_after_reboot(prefix):
    backend = make(prefix)
    uris = backend.allocate(2, BLOCK)
    backend.destroy()  # what a reboot does to /dev/shm
    again = make(prefix)
    again.reserve(uris)
    assert again.usage()["lost"] == 1 and not again.exists(uris[0])
    again.delete(uris)
    assert again.usage()["slots_used"] == 0


def test_health_and_validation(prefix):
    backend = make(prefix)
    assert backend.health()
    assert segments(prefix) == []  # the probe segment is removed again
    with pytest.raises(CapacityError, match="segment_size"):
        backend.allocate(1, 8 * BLOCK)
    with pytest.raises(InvalidArgument):
        backend.delete([f"shm://sidecar/{prefix}{S}-0?offset=7&size={BLOCK}"])
    with pytest.raises(InvalidArgument):
        backend.delete(["shm://sidecar/other.0?offset=0&size=8"])
    with pytest.raises(InvalidArgument, match="prefix"):
        open_backend("shm", "s", {"prefix": "a/b"}, None)
    default = ShmStorage("s1", None)
    assert default.prefix == "kvcm.s1." and default.segment_size == 64 << 20
    assert parse_uri(backend.allocate(1, 1000)[0]).params == {"offset": "0", "size": "1000"}
    backend.destroy()
    assert not backend.health()


def test_registry_shaped_spec_and_lock(prefix):
    backend = open_backend("shm", "s", {"prefix": prefix, "segment_size": 1 << 30}, None)
    assert os.path.exists(f"/dev/shm/{prefix}lock")
    assert backend.allocate(1, 4096)[0] == f"shm://s/{prefix}{S2}-0?offset=0&size=4096"
    assert os.stat(f"/dev/shm/{prefix}{S2}-0").st_blocks == 0  # a 1 GiB segment costs nothing until written
    backend.destroy()
    assert not os.path.exists(f"/dev/shm/{prefix}lock")


def test_two_storages_cannot_share_a_prefix(prefix):
    first = make(prefix)
    with pytest.raises(Conflict, match="already used by storage 'sidecar'"):
        open_backend("shm", "other", {"prefix": prefix}, None)
    again = make(prefix)  # the same storage re-opened (spec update): allowed
    again.close()
    first.destroy()
    open_backend("shm", "other", {"prefix": prefix}, None).destroy()  # free again after close

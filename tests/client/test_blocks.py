"""kvcm.blocks against a real server: real ``start_write_cache`` URIs on ``file`` and ``shm``
storages, bytes written through :class:`kvcm.blocks.BlockIO` and read back by a separate process
and with plain ``os.pread`` / ``mmap``; a storage added later found by refresh; URI-only stores
raise Unsupported with the URI decoded; hostile URIs never touch anything outside the storage."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from kvcm import blocks
from kvcm.blocks import BlockIO, StorageSpec, UnknownStorage, Unsupported
from kvcm.client import Client
from kvcm.errors import Code, InvalidArgument, KvcmError
from kvcm.testing import RunningServer, serve_in_thread
from tests.helpers import add_file_storage, add_group, add_shm_storage, remove_shm, shm_prefix, wait_for

SIZE = 64 << 10  # one spec per block, 64 KiB
SPECS = [{"name": "tp0", "size": SIZE}]


def payload(seed: str, size: int = SIZE) -> bytes:
    digest = hashlib.sha256(seed.encode()).digest()
    return (digest * (size // len(digest) + 1))[:size]


class Env:
    def __init__(self, server: RunningServer, client: Client, root: str, prefix: str) -> None:
        self.server, self.client, self.root, self.prefix = server, client, root, prefix

    def uris(self, instance: str, keys: list[int]) -> list[str]:
        started = self.client.call("start_write_cache", {"instance_id": instance, "block_keys": keys})
        self.client.call("finish_write_cache", {"instance_id": instance, "write_session_id": started["write_session_id"],
                                                "success_blocks": {"offset": len(started["locations"])}})
        return [spec["uri"] for loc in started["locations"] for spec in loc["location_specs"]]

    def io(self, instance: str, **options: Any) -> BlockIO:
        return BlockIO.for_instance(self.client, instance, **options)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    root = tempfile.mkdtemp(prefix="kvcm-blocks-")
    prefix = shm_prefix()
    with serve_in_thread() as server:
        c = server.client()
        add_file_storage(c, "blk-file", os.path.join(root, "file"))
        add_shm_storage(c, "blk-shm", prefix, segment_size=4 * SIZE)
        add_group(c, "g-file", ["blk-file"])
        add_group(c, "g-shm", ["blk-shm"])
        for instance, group in (("i-file", "g-file"), ("i-shm", "g-shm")):
            c.call("register_instance", {"instance_group": group, "instance_id": instance, "block_size": 4,
                                         "location_spec_infos": SPECS})
        try:
            yield Env(server, c, root, prefix)
        finally:
            c.close()
            remove_shm(prefix)
            subprocess.run(["rm", "-rf", root], check=False)


READER = r"""
import json, sys
from kvcm.blocks import BlockIO
from kvcm.client import Client
endpoint, instance, uris = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with Client(endpoint) as c, BlockIO.for_instance(c, instance) as io:
    print(json.dumps([io.read(uri).hex() for uri in uris]))
"""


def read_elsewhere(env: Env, instance: str, uris: list[str]) -> list[bytes]:
    done = subprocess.run([sys.executable, "-c", READER, env.server.endpoint, instance, json.dumps(uris)],
                          capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    return [bytes.fromhex(h) for h in json.loads(done.stdout)]


# --------------------------------------------------------------------------- file and shm bytes


@pytest.mark.parametrize("instance", ["i-file", "i-shm"])
def test_written_bytes_are_read_back_by_another_process_and_by_plain_syscalls(env: Env, instance: str) -> None:
    uris = env.uris(instance, [101, 102, 103])
    data = [payload(f"{instance}/{i}") for i in range(len(uris))]
    with env.io(instance) as io:
        io.write(uris[0], data[0])  # bytes
        io.write(uris[1], bytearray(data[1]))
        io.write(uris[2], memoryview(data[2]))
        assert [bytes(io.read(u)) for u in uris] == data
        resolved = [io.resolve(u) for u in uris]
    assert read_elsewhere(env, instance, uris) == data
    for where, expected in zip(resolved, data, strict=True):
        assert where.size == SIZE
        fd = os.open(where.path, os.O_RDONLY)
        try:
            if instance == "i-file":
                assert where.path.startswith(os.path.join(env.root, "file") + "/")
                assert os.pread(fd, where.size, where.offset) == expected
            else:
                assert where.path.startswith("/dev/shm/" + env.prefix)
                with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mem:
                    assert mem[where.offset:where.offset + where.size] == expected
        finally:
            os.close(fd)


@pytest.mark.parametrize("instance", ["i-file", "i-shm"])
def test_read_into_fills_the_callers_buffer(env: Env, instance: str) -> None:
    (uri,) = env.uris(instance, [201])
    with env.io(instance) as io:
        io.write(uri, payload("into"))
        out = bytearray(SIZE)
        io.read_into(uri, out)
        assert out == payload("into")
        with pytest.raises(InvalidArgument, match="writable"):
            io.read_into(uri, bytes(SIZE))
        with pytest.raises(InvalidArgument, match=f"the block is {SIZE} bytes"):
            io.write(uri, b"short")
        with pytest.raises(InvalidArgument, match="a block needs a buffer"):
            io.write(uri, "text")  # type: ignore[arg-type]


@pytest.mark.parametrize("instance", ["i-file", "i-shm"])
def test_views_are_read_into_as_they_are_and_checked_by_their_bytes(env: Env, instance: str) -> None:
    (uri,) = env.uris(instance, [251])
    with env.io(instance) as io:
        io.write(uri, payload("views"))  # the place is remembered: the reads below take the fast path
        flat = bytearray(SIZE)
        for view in (memoryview(flat), memoryview(flat).cast("H"), memoryview(flat).cast("B", (64, SIZE // 64))):
            flat[:] = bytes(SIZE)
            io.read_into(uri, view)
            assert flat == payload("views")
        wide = bytearray(2 * SIZE)  # as many 2-byte elements as the block has bytes: twice its size
        with pytest.raises(InvalidArgument, match=f"the block is {SIZE} bytes, the buffer {2 * SIZE}"):
            io.read_into(uri, memoryview(wide).cast("H"))
        assert wide == bytes(2 * SIZE)
        with pytest.raises(InvalidArgument, match="writable"):
            io.read_into(uri, memoryview(bytes(SIZE)))
        with pytest.raises(InvalidArgument, match="C-contiguous"):
            io.read_into(uri, memoryview(wide)[::2])
        with pytest.raises(InvalidArgument, match=f"the block is {SIZE} bytes"):
            io.read_into(uri, memoryview(flat)[1:])


@pytest.mark.parametrize("instance", ["i-file", "i-shm"])
def test_numpy_buffers(env: Env, instance: str) -> None:
    np = pytest.importorskip("numpy")
    (uri,) = env.uris(instance, [301])
    block = np.arange(SIZE // 2, dtype=np.float16).reshape(64, -1)  # 2-D, 2-byte elements
    with env.io(instance) as io:
        io.write(uri, block)
        out = np.zeros_like(block)
        io.read_into(uri, out)
        assert np.array_equal(out, block)
        assert bytes(io.read(uri)) == block.tobytes()
        with pytest.raises(InvalidArgument, match="C-contiguous"):
            io.write(uri, np.zeros((SIZE, 2), dtype=np.uint8)[:, 0])
    assert read_elsewhere(env, instance, [uri]) == [block.tobytes()]


def test_o_direct_file_io(env: Env) -> None:
    uris = env.uris("i-file", [401, 402])
    with env.io("i-file", direct=True) as io:
        aligned = mmap.mmap(-1, SIZE)  # page-aligned: written without the bounce buffer
        aligned[:] = payload("direct-0")
        try:
            io.write(uris[0], memoryview(aligned))
        except KvcmError as exc:
            if "Invalid argument" in str(exc):
                pytest.skip(f"the tmp filesystem refuses O_DIRECT: {exc}")
            raise
        io.write(uris[1], payload("direct-1"))  # read-only bytes: through the bounce buffer
        assert bytes(io.read(uris[0])) == payload("direct-0")
        out = mmap.mmap(-1, SIZE)
        io.read_into(uris[1], memoryview(out))
        assert bytes(out) == payload("direct-1")
    assert read_elsewhere(env, "i-file", uris) == [payload("direct-0"), payload("direct-1")]


def test_a_shared_blockio_serves_many_threads(env: Env) -> None:
    from concurrent.futures import ThreadPoolExecutor

    uris = env.uris("i-shm", [501, 502])
    file_uris = env.uris("i-file", [501, 502, 503, 504])
    with env.io("i-file", max_files=1) as io_file, env.io("i-shm", max_segments=1) as io_shm:
        jobs = [(io_file, u) for u in file_uris] + [(io_shm, u) for u in uris]

        def roundtrip(job: tuple[BlockIO, str]) -> bool:
            io, uri = job
            for _ in range(20):
                io.write(uri, payload(uri))
                if bytes(io.read(uri)) != payload(uri):
                    return False
            return True

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(roundtrip, jobs * 2))


# ---------------------------------------------------------------------------------- refresh


def test_a_storage_added_later_is_found_by_refresh(env: Env, tmp_path: Any) -> None:
    c = env.client
    add_group(c, "g-late", ["blk-file"])
    c.call("register_instance", {"instance_group": "g-late", "instance_id": "i-late", "block_size": 4,
                                 "location_spec_infos": SPECS})
    fetched: list[int] = []

    def fetch() -> list[StorageSpec]:
        fetched.append(1)
        return blocks.specs_of_reply(c.call("get_storage_specs", {"instance_id": "i-late"}))

    with BlockIO(fetch) as io:
        (first,) = env.uris("i-late", [601])
        io.write(first, payload("before"))
        assert len(fetched) == 1
        add_file_storage(c, "blk-late", tmp_path / "late")
        version = c.call("get_instance_group", {"name": "g-late"})["instance_group"]["version"]
        c.call("update_instance_group", {"instance_group": {"name": "g-late", "storage_candidates": ["blk-late"]},
                                         "current_version": version})
        (second,) = env.uris("i-late", [602])
        assert second.startswith("file://blk-late/")
        io.write(second, payload("after"))  # unknown name: one refresh, then it works
        assert len(fetched) == 2
        assert bytes(io.read(second)) == payload("after")
        assert io.resolve(second).path.startswith(str(tmp_path / "late") + "/")
        with pytest.raises(UnknownStorage, match="'nowhere' is not among the instance's storages") as exc:
            io.write(second.replace("blk-late", "nowhere"), payload("x"))
        assert exc.value.code is Code.NOT_FOUND and len(fetched) == 3


# ------------------------------------------------------------------------- URI-only stores


EXTERNAL = [
    ("3fs", "hf3fs://t3/mnt/3fs/kv/9f0c?blkid=2&size=4096", blocks.ThreeFsUri,
     {"path": "/mnt/3fs/kv/9f0c", "blkid": 2, "size": 4096, "offset": 8192}),
    ("3fs", "hf3fs://t3/mnt/3fs/kv/9f0c?size=4096", blocks.ThreeFsUri, {"path": "/mnt/3fs/kv/9f0c", "blkid": None}),
    ("mooncake", "mooncake://mc/?key=kvcm/abc&size=4096", blocks.MooncakeUri, {"key": "kvcm/abc", "size": 4096}),
    ("tairmempool", "pace://tp/8192?media_type=dram&node_id=3&range_id=7&size=4096", blocks.PaceUri,
     {"offset": 8192, "media_type": "dram", "node_id": 3, "range_id": 7, "size": 4096}),
]


@pytest.mark.parametrize(("kind", "uri", "cls", "parts"), EXTERNAL)
def test_uri_only_stores_raise_unsupported_with_the_parts(kind: str, uri: str, cls: type, parts: dict[str, Any]) -> None:
    block = blocks.parse(uri)
    assert isinstance(block, cls) and block.storage_type == kind
    for key, value in parts.items():
        assert getattr(block, key) == value, key
    spec = StorageSpec(block.storage, kind, {})
    io = BlockIO(lambda: [spec])
    for call in (lambda: io.write(uri, bytes(block.size)), lambda: io.read(uri), lambda: io.resolve(uri)):
        with pytest.raises(Unsupported) as exc:
            call()
        assert exc.value.code is Code.UNSUPPORTED and exc.value.block == block and exc.value.spec == spec
        assert exc.value.parts["storage"] == block.storage and kind in str(exc.value)


def test_a_registered_handler_takes_a_uri_only_store() -> None:
    store: dict[str, bytes] = {}

    class Mooncake:
        def write(self, block: blocks.BlockUri, spec: StorageSpec, data: memoryview) -> None:
            assert isinstance(block, blocks.MooncakeUri)
            store[block.key] = bytes(data)

        def read_into(self, block: blocks.BlockUri, spec: StorageSpec, out: memoryview) -> None:
            assert isinstance(block, blocks.MooncakeUri)
            out[:] = store[block.key]

    io = BlockIO(lambda: [StorageSpec("mc", "mooncake", {"key_prefix": "kvcm/"})])
    io.register("mooncake", Mooncake())
    uri = "mooncake://mc/?key=kvcm/k1&size=8"
    io.write(uri, b"12345678")
    assert store == {"kvcm/k1": b"12345678"} and io.read(uri) == bytearray(b"12345678")


# ----------------------------------------------------------------------------- hostile URIs


@pytest.mark.parametrize("uri", [
    "file://blk-file/../../etc/passwd?blkid=0&size=4096",
    "file://blk-file/s65536/../../../x.kv?blkid=0&size=65536",
    "file://blk-file//etc/s65536/00000001.kv?blkid=0&size=65536",
    "file://blk-file/s65536/00000001.kv?blkid=-1&size=65536",
    "file://blk-file/s65536/00000001.kv?blkid=0&size=-65536",
    "file://blk-file/s65536/00000001.kv?blkid=0&size=4096",  # size is not the file's size class
    "file://blk-file/s65536/00000001.kv?blkid=0&size=65536&extra=1",
    "file://blk-file/s65536/00000001.kv?blkid=99999999999999999999&size=65536",
    "file://blk-file/s65536/00000001.kv?blkid=" + "9" * 5000 + "&size=65536",
    "shm://blk-shm/../etc/passwd?offset=0&size=65536",
    "shm://blk-shm/a/b?offset=0&size=65536",
    "shm://blk-shm/seg?offset=100&size=65536",  # not a multiple of the size
    "shm://blk-shm/seg?offset=0&size=0",
    "hf3fs://t3/mnt/../etc?size=1",
    "mooncake://mc/x?key=k&size=1",
    "pace://tp/-4?media_type=dram&node_id=0&range_id=0&size=1",
    "gopher://blk-file/x?size=1",
    "not a uri",
], ids=lambda uri: uri[:70])
def test_malformed_uris_are_refused_before_any_io(env: Env, uri: str) -> None:
    with pytest.raises(InvalidArgument):
        blocks.parse(uri)
    with env.io("i-file") as io, pytest.raises(InvalidArgument):
        io.write(uri, bytes(SIZE))


def test_well_formed_but_hostile_uris_never_write_outside_the_storage(env: Env) -> None:
    (real,) = env.uris("i-file", [701])
    (shm,) = env.uris("i-shm", [701])
    block = blocks.parse(real)
    assert isinstance(block, blocks.FileUri)
    before = _tree(env.root)
    with env.io("i-file") as io, env.io("i-shm") as io_shm:
        past = real.replace(f"blkid={block.blkid}", "blkid=100000")
        with pytest.raises(InvalidArgument, match="past the end"):
            io.write(past, bytes(SIZE))
        shm_block = blocks.parse(shm)
        assert isinstance(shm_block, blocks.ShmUri)
        with pytest.raises(InvalidArgument, match="past the end"):
            io_shm.write(shm.replace(f"offset={shm_block.offset}", f"offset={SIZE * 1000}"), bytes(SIZE))
        with pytest.raises(InvalidArgument, match="is a shm uri, but storage 'blk-file' is file"):
            io.write(shm.replace("blk-shm", "blk-file"), bytes(SIZE))
        with pytest.raises(KvcmError, match="no such file"):  # a missing container is never created
            io.write(real.replace(block.path.split("/")[1], "deadbeef-99999999.kv"), bytes(SIZE))
        # A symbolic link planted where a size class directory would be is not followed.
        outside = tempfile.mkdtemp(prefix="kvcm-outside-")
        os.symlink(outside, os.path.join(env.root, "file", "s8192"))
        with open(os.path.join(outside, "00000001.kv"), "wb") as f:
            f.truncate(8192)
        with pytest.raises(KvcmError):
            io.write("file://blk-file/s8192/00000001.kv?blkid=0&size=8192", bytes(8192))
        with open(os.path.join(outside, "00000001.kv"), "rb") as f:
            assert f.read() == bytes(8192)
        os.unlink(os.path.join(env.root, "file", "s8192"))
        subprocess.run(["rm", "-rf", outside], check=False)
        huge = 1 << 62  # read() checks the block before allocating its size
        with pytest.raises(KvcmError, match="no such file"):
            io.read(f"file://blk-file/s{huge}/00000001.kv?blkid=0&size={huge}")
        with pytest.raises(InvalidArgument, match="past the end"):
            io_shm.read(shm.replace(f"size={shm_block.size}", f"size={huge}").replace(
                f"offset={shm_block.offset}", "offset=0"))
    assert _tree(env.root) == before  # no file created, none grown


def _tree(root: str) -> dict[str, int]:
    return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_size for d, _, names in os.walk(root) for n in names}


def test_spec_without_a_usable_path_is_a_clear_error() -> None:
    io = BlockIO(lambda: [StorageSpec("f", "file", {"root_path": "relative/dir"})])
    with pytest.raises(InvalidArgument, match="no absolute root_path"):
        io.write("file://f/s8/00000001.kv?blkid=0&size=8", bytes(8))


def test_the_servers_backends_and_the_client_share_one_parser() -> None:
    from kvcm.backends.storage import file, shm

    uri = "file://x/s4096/0a0b0c0d-00000012.kv?blkid=3&size=4096"
    assert file.resolve_file_uri(uri, "/r") == ("/r/s4096/0a0b0c0d-00000012.kv", 3 * 4096, 4096)
    assert shm.resolve_shm_uri("shm://y/kvcm.y.0?offset=8192&size=4096") == ("/dev/shm/kvcm.y.0", 8192, 4096)
    for resolver, bad in ((lambda u: file.resolve_file_uri(u, "/r"), "file://x/../s4096/1.kv?blkid=0&size=4096"),
                          (shm.resolve_shm_uri, "shm://y/kvcm.y.0?offset=1&size=4096")):
        with pytest.raises(InvalidArgument):
            resolver(bad)


def test_a_cached_descriptor_of_a_freed_file_is_let_go(env: Env, tmp_path: Any) -> None:
    """kvcm unlinks a container whose blocks are all deleted; the cache must not keep the disk."""
    c = env.client
    add_file_storage(c, "blk-free", tmp_path / "free")
    add_group(c, "g-free", ["blk-free"])
    c.call("register_instance", {"instance_group": "g-free", "instance_id": "i-free", "block_size": 4,
                                 "location_spec_infos": SPECS})
    def both() -> list[StorageSpec]:  # the storages of two instances, to open a second file later
        return [spec for instance in ("i-free", "i-file")
                for spec in blocks.specs_of_reply(c.call("get_storage_specs", {"instance_id": instance}))]

    with BlockIO(both) as io:
        (uri,) = env.uris("i-free", [801])
        io.write(uri, payload("freed"))
        path = io.resolve(uri).path
        c.call("remove_cache", {"instance_id": "i-free", "block_keys": [801]})
        assert wait_for(lambda: not os.path.exists(path))
        assert _open_deleted(path)  # still cached, as nothing else was opened since
        held = next(iter(io._handlers["file"]._fds.items.values()))  # type: ignore[attr-defined]
        (other,) = env.uris("i-file", [802])
        io.write(other, payload("other"))  # a miss: the cache drops what was unlinked first
        assert held.live is False
        del held
        assert not _open_deleted(path)




def _open_deleted(path: str) -> bool:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return f"{path} (deleted)" in links


def test_a_remembered_place_is_used_only_while_it_is_the_cached_handle(tmp_path: Any) -> None:
    """A URI's remembered descriptor is used only while the handler's cache still holds it: once
    evicted, the URI is resolved again, even if something else keeps the old descriptor alive
    (an I/O still running on another thread) and the file was replaced meanwhile."""
    size = 4096
    for n in range(2):
        os.makedirs(tmp_path / "s4096", exist_ok=True)
        (tmp_path / "s4096" / f"{n:08d}.kv").write_bytes(bytes(4 * size))
    spec = StorageSpec("st", "file", {"root_path": str(tmp_path)})
    first, second = (f"file://st/s4096/{n:08d}.kv?blkid=0&size={size}" for n in range(2))
    with BlockIO(lambda: [spec], max_files=1) as io:
        io.write(first, b"a" * size)
        fds = io._handlers["file"]._fds.items  # type: ignore[attr-defined]
        still_used = fds[(str(tmp_path), "s4096/00000000.kv")]  # e.g. by a pwrite on another thread
        io.write(second, b"b" * size)  # max_files=1: the first file's descriptor leaves the cache
        path = tmp_path / "s4096" / "00000000.kv"
        path.unlink()
        path.write_bytes(bytes(4 * size))  # the container was freed and made again under its name
        io.write(first, b"z" * size)
        assert path.read_bytes()[:size] == b"z" * size  # the new file, not the old descriptor's inode
        out = bytearray(size)
        io.read_into(first, out)
        assert out == b"z" * size
        again = fds[(str(tmp_path), "s4096/00000000.kv")]
        io.write(second, b"b" * size)  # evicted once more, still held
        path.unlink()
        path.write_bytes(bytes(4 * size))
        io.read_into(first, out)
        assert out == bytes(size)  # read from the new file too, not from the old inode's "z"s
        del again
        assert still_used.live is False  # let go by the cache: never used from a remembered place
        current = fds[(str(tmp_path), "s4096/00000000.kv")]
        io._handlers["file"]._fds.clear()  # type: ignore[attr-defined]
        assert current.live is False
        del still_used, current


def test_a_remembered_shm_place_is_used_only_while_its_mapping_is_the_cached_one(tmp_path: Any) -> None:
    """The shm twin of the test above: a remembered place holds the mapping itself, and the
    cache clears it from the place when it lets the mapping go, so a segment freed and made
    again under its name is written and read through a new mapping, never the old one, even
    while something else keeps the old mapping open."""
    size = 4096
    for n in range(2):
        (tmp_path / f"kvcm.t.{n}").write_bytes(bytes(4 * size))
    spec = StorageSpec("sh", "shm", {"shm_dir": str(tmp_path)})
    first, second = (f"shm://sh/kvcm.t.{n}?offset={size}&size={size}" for n in range(2))
    with BlockIO(lambda: [spec], max_segments=1) as io:
        io.write(first, b"a" * size)
        maps = io._handlers["shm"]._maps.items  # type: ignore[attr-defined]
        still_used = maps[(str(tmp_path), "kvcm.t.0")]  # e.g. by a copy on another thread
        place = io._places[first]  # type: ignore[attr-defined]
        assert place.map is still_used.map
        io.write(second, b"b" * size)  # max_segments=1: the first segment's mapping leaves the cache
        assert place.map is None and place.view is None and still_used.live is False
        path = tmp_path / "kvcm.t.0"
        path.unlink()
        path.write_bytes(bytes(4 * size))  # the segment was freed and made again under its name
        io.write(first, b"z" * size)
        assert path.read_bytes()[size : 2 * size] == b"z" * size  # the new segment, not the old mapping
        assert still_used.map[size : 2 * size] == b"a" * size
        out = bytearray(size)
        io.read_into(first, out)
        assert out == b"z" * size
        io.write(second, b"b" * size)  # evicted once more
        path.unlink()
        path.write_bytes(bytes(4 * size))
        io.read_into(first, out)
        assert out == bytes(size)  # read from the new segment too, not from the old one's "z"s
        current = maps[(str(tmp_path), "kvcm.t.0")]
        remembered = io._places[first]  # type: ignore[attr-defined]
        assert remembered.map is current.map
        io._handlers["shm"]._maps.clear()  # type: ignore[attr-defined]
        assert current.live is False and remembered.map is None
        del still_used, current


def test_a_handle_hands_out_no_usable_place_once_retired_and_keeps_a_bounded_number(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A place made for a handle its cache let go meanwhile (another thread's eviction, between
    the lookup and the remembering) is never usable; and a handle keeps one place per block,
    letting the oldest go past the bound rather than growing with every remembering."""
    import kvcm.blocks.places as blocks

    size = 4096
    (tmp_path / "kvcm.t.0").write_bytes(bytes(8 * size))
    spec = StorageSpec("sh", "shm", {"shm_dir": str(tmp_path)})
    with BlockIO(lambda: [spec]) as io:
        io.write(f"shm://sh/kvcm.t.0?offset=0&size={size}", b"a" * size)
        handle = io._handlers["shm"]._maps.items[(str(tmp_path), "kvcm.t.0")]  # type: ignore[attr-defined]
        assert handle.place(0, size, "p") is handle.place(0, size, "p")  # one per block
        monkeypatch.setattr(blocks, "_PLACES_MAX", 2)
        made = [handle.place(i * size, size, "p") for i in range(3)]
        assert len(handle.places) <= 2 and made[0].map is None and made[2].map is handle.map
        handle.retire()
        late = handle.place(5 * size, size, "p")
        assert late.map is None and late.view is None


def test_a_mapping_let_go_under_a_running_copy_stays_mapped_until_the_copy_is_done(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Places hold a segment's view, not its handle, so the handle can die while a copy on
    another thread still holds a slice of the view: its mapping then goes with the copy's
    slice, quietly, instead of failing to close under it."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    size = 4096
    (tmp_path / "kvcm.t.0").write_bytes(bytes(4 * size))
    spec = StorageSpec("sh", "shm", {"shm_dir": str(tmp_path)})
    uri = f"shm://sh/kvcm.t.0?offset=0&size={size}"
    with BlockIO(lambda: [spec]) as io:
        io.write(uri, b"a" * size)
        place = io._places[uri]  # type: ignore[attr-defined]
        running = place.view[0:size]  # a copy's slice, taken just before the eviction
        io._handlers["shm"]._maps.clear()  # type: ignore[attr-defined]  # the handle goes now
        assert place.map is None and place.view is None
        assert bytes(running) == b"a" * size  # still mapped under the running copy
        del running
    assert unraisable == []


def test_a_refresh_forgets_remembered_places(tmp_path: Any) -> None:
    """A storage's spec may change between fetches (its root moved): after a refresh, URIs met
    before are resolved against the new spec, not written through the old root's descriptors."""
    size = 4096
    for root in ("old", "new"):
        os.makedirs(tmp_path / root / "s4096")
        (tmp_path / root / "s4096" / "00000000.kv").write_bytes(bytes(2 * size))
    specs = [StorageSpec("st", "file", {"root_path": str(tmp_path / "old")})]
    uri = f"file://st/s4096/00000000.kv?blkid=1&size={size}"
    with BlockIO(lambda: list(specs)) as io:
        io.write(uri, b"o" * size)
        specs[0] = StorageSpec("st", "file", {"root_path": str(tmp_path / "new")})
        io.refresh()
        io.write(uri, b"n" * size)
    assert (tmp_path / "old" / "s4096" / "00000000.kv").read_bytes()[size:] == b"o" * size
    assert (tmp_path / "new" / "s4096" / "00000000.kv").read_bytes()[size:] == b"n" * size

"""``shm`` storages: a copy into / out of a cached ``mmap`` of the whole segment."""

from __future__ import annotations

import os

from kvcm.blocks.places import OPEN_FLAGS, HandleCache, Map, Place, io_error, nlink, open_regular
from kvcm.blocks.specs import StorageSpec, expect
from kvcm.errors import InvalidArgument
from kvcm.proto.uris import BlockUri, ShmUri


class ShmHandler:
    """``shm`` storages: a copy into / out of the segment mapped whole (``shm_dir/<segment>``)."""

    def __init__(self, max_segments: int = 64) -> None:
        self._maps: HandleCache[tuple[str, str], Map] = HandleCache(max_segments)
        self._dirs: dict[str, tuple[StorageSpec, str]] = {}

    def close(self) -> None:
        self._maps.clear()

    def write(self, block: BlockUri, spec: StorageSpec, data: memoryview) -> None:
        shm = expect(block, ShmUri)
        self._map(shm, spec)[shm.offset:shm.offset + shm.size] = data

    def read_into(self, block: BlockUri, spec: StorageSpec, out: memoryview) -> None:
        shm = expect(block, ShmUri)
        out[:] = self._map(shm, spec)[shm.offset:shm.offset + shm.size]

    def check(self, block: BlockUri, spec: StorageSpec) -> None:
        """Map the block's segment and check the block lies inside it."""
        self._map(expect(block, ShmUri), spec)

    def place(self, block: BlockUri, spec: StorageSpec) -> Place | None:
        """Where the (just used) block is, for :class:`BlockIO` to remember."""
        if not isinstance(block, ShmUri):
            return None
        self._map(block, spec)  # checks the bounds
        shm_dir = self._dirs[spec.name][1]
        key = (shm_dir, block.segment)
        mapped: Map | None = self._maps.items.get(key)
        if mapped is None:
            return None
        return mapped.place(block.offset, block.size, os.path.join(*key))

    def _map(self, block: ShmUri, spec: StorageSpec) -> memoryview:
        shm_dir = self._dirs.get(spec.name)
        if shm_dir is None or shm_dir[0] is not spec:
            shm_dir = self._dirs[spec.name] = (spec, spec.path_field("shm_dir"))
        key = (shm_dir[1], block.segment)
        mapped: Map | None = self._maps.items.get(key)  # the hot path: one dict read, no lock
        if mapped is None:
            try:
                mapped = self._maps.get(key, _map_segment, nlink)
            except OSError as exc:
                raise io_error("map", os.path.join(*key), exc) from exc
        end = block.offset + block.size
        if end > len(mapped.map):
            raise InvalidArgument(f"uri {block.uri[:200]!r}: bytes {block.offset}..{end} lie past the end of "
                                  f"segment {os.path.join(*key)} ({len(mapped.map)} bytes)")
        return mapped.view


def _map_segment(key: tuple[str, str]) -> Map:
    path = os.path.join(*key)
    handle = open_regular(path, OPEN_FLAGS)
    if handle.size == 0:
        raise InvalidArgument(f"segment {path} is empty")
    return Map(handle)

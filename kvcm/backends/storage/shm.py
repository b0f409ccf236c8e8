"""``shm`` storage: POSIX shared-memory segments on this host, for a sidecar next to inference nodes.

A segment is a file in the tmpfs behind ``shm_open`` (``/dev/shm/<prefix><n>``), cut into
slots of one block size like a ``file`` container, so all the slot machinery is shared with
:class:`~kvcm.backends.storage.directory.DirectoryStorage`. URIs keep the storage name as host (as
every kvcm URI does) and name the segment in the path::

    shm://<storage name>/<segment>?offset=O&size=S

Another process on the host maps the segment by name and reads or writes ``size`` bytes at
``offset`` (:mod:`kvcm.blocks`). kvcm itself never maps segments: it creates them sparse
(``ftruncate``), punches freed ranges (tmpfs returns the memory) and unlinks emptied ones.

Segments outlive the kvcm process on purpose: ``close()`` keeps them, so a restarted kvcm
re-adopts them through ``reserve()``. :meth:`ShmStorage.destroy` removes them all (tests, trim).
A reboot empties ``/dev/shm``; the metadata that still points there is then reported as
``lost`` in ``usage()`` and its URIs as not existing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping

from kvcm.backends.storage.directory import DirectoryStorage
from kvcm.backends.storage.ownership import Owner
from kvcm.backends.storage.slots import Container
from kvcm.backends.storage.specs import Spec, SpecReader, check_component, spec_int, spec_text
from kvcm.errors import CapacityError, Code, InvalidArgument
from kvcm.proto.uris import ShmUri, parse_block_uri

DEFAULT_SEGMENT_SIZE = 64 << 20


class ShmStorage(DirectoryStorage):
    """``shm`` storage: spec ``segment_size`` (64 MiB; a segment holds ``segment_size // size``
    blocks), ``prefix`` (``kvcm.<name>.``; segments are ``<prefix><n>``), ``shm_dir``
    (``/dev/shm``), ``capacity_bytes`` (0 = limited by the tmpfs only).

    Thread ownership: as :class:`DirectoryStorage` (RPC, deleter and health threads)."""

    type_name = "shm"
    container_label = "segments"

    def __init__(self, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None,
                 owner: Owner | None = None) -> None:
        self.spec = self.read_spec(name, spec, data_dir)
        self.segment_size = spec_int(self.spec, "segment_size")
        self.prefix = spec_text(self.spec, "prefix")
        super().__init__(name, spec_text(self.spec, "shm_dir"), spec_int(self.spec, "capacity_bytes"), owner)
        # ``<prefix><storage id>-<n>``; segments from before storage ids are ``<prefix><n>``.
        self._segment = re.compile(re.escape(self.prefix) + r"(?:([0-9a-f]{8})-)?([0-9]+)")

    @classmethod
    def read_spec(cls, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None) -> Spec:
        """The normalized spec (defaults filled, ``shm_dir`` absolute). Creates no segment."""
        reader = SpecReader(cls.type_name, name, spec)
        reader.integer("segment_size", DEFAULT_SEGMENT_SIZE, minimum=1)
        check_component(f"storage {name!r}: storage_spec.prefix", reader.text("prefix", f"kvcm.{name}."))
        shm_dir = reader.text("shm_dir", "/dev/shm")
        reader.integer("capacity_bytes", 0)
        out = reader.finish()
        if not os.path.isabs(shm_dir):
            raise reader.fail("shm_dir", f"must be an absolute path, got {shm_dir!r}")
        out["shm_dir"] = os.path.normpath(shm_dir)
        return out

    def _slots_per_container(self, size: int) -> int:
        slots = self.segment_size // size
        if slots == 0:  # a capacity problem of this storage: the caller may fall over to another
            raise CapacityError(
                f"storage {self.name!r}: block size {size} exceeds segment_size {self.segment_size}",
                Code.CAPACITY_EXHAUSTED,
            )
        return slots

    def _container_name(self, size: int, index: int) -> str:
        return f"{self.prefix}{self.storage_id}-{index}"

    def _marker_name(self) -> str:
        return f"{self.prefix}kvcm-storage"

    def _is_control(self, name: str) -> bool:
        rest = name[len(self.prefix):]
        return rest == "lock" or rest.startswith(("kvcm-storage", "probe."))

    def _namespace_label(self) -> str:
        return f"{self.directory}/{self.prefix}*"

    def _entries(self) -> Iterator[str]:
        for entry in os.scandir(self.directory):
            if entry.name.startswith(self.prefix):
                yield entry.name

    def _probe_stem(self) -> str:
        return f"{self.prefix}probe."

    def _lock_name(self) -> str:
        return f"{self.prefix}lock"

    def _scan(self) -> Iterator[tuple[str, int, str]]:
        for entry in os.scandir(self.directory):
            match = self._segment.fullmatch(entry.name)
            if match and entry.is_file(follow_symlinks=False):
                yield entry.name, int(match.group(2)), match.group(1) or ""

    def _index_of(self, container_name: str) -> int:
        match = self._segment.fullmatch(container_name)
        return int(match.group(2)) if match and match.group(1) == self.storage_id else 0

    def _uri(self, container: Container, slot: int) -> str:
        return f"shm://{self.name}/{container.name}?offset={slot * container.size}&size={container.size}"

    def _locate(self, uri: str) -> tuple[str, int, int]:
        block = parse_block_uri(uri)
        if not isinstance(block, ShmUri) or block.storage != self.name or not self._segment.fullmatch(block.segment):
            raise InvalidArgument(f"{uri[:200]!r} is not a uri of shm storage {self.name!r}")
        return block.segment, block.offset // block.size, block.size

    def segment_path(self, uri: str) -> str:
        """The file behind ``uri``'s segment (what ``shm_open(segment)`` opens)."""
        return self.path_of(self._locate(uri)[0])

    def destroy(self) -> int:
        """Unlink every segment of this storage, data or not (tests, ``trim``); closes it."""
        self.close()
        with self._lock:
            names = [c.name for c in self._pool] + list(self._unclaimed)
            for container in self._pool:
                self._pool.remove(container)
            self._unclaimed.clear()
        for name in [*names, self._lock_name(), self._marker_name()]:
            try:
                os.unlink(self.path_of(name))
            except FileNotFoundError:
                pass
        return len(names)


def resolve_shm_uri(uri: str, shm_dir: str = "/dev/shm") -> tuple[str, int, int]:
    """``(segment file path, offset, size)`` of a ``shm://`` URI (``shm_open`` the segment name,
    or open the path, and ``mmap`` it). Client code uses :mod:`kvcm.blocks`, which also does
    the I/O; this stays for tools and tests."""
    block = parse_block_uri(uri)
    if not isinstance(block, ShmUri):
        raise InvalidArgument(f"{uri[:200]!r} is not a shm storage uri")
    return os.path.join(shm_dir, block.segment), block.offset, block.size

"""``file`` storage: KV blocks packed into sparse files in one directory (local disk or NFS).

A file ("container") holds ``key_count_per_file`` slots of one block size; instances with a
different block size get their own files (``s<size>/<index>.kv``), so a slot always sits at
``blkid * size``. URIs::

    file://<storage name>/s4096/00000012.kv?blkid=3&size=4096

The path is relative to the storage's ``root_path`` (shown by ``get_storage_specs``), so hosts
that mount the same NFS export at different places can still resolve it (:mod:`kvcm.blocks`).

Unlike Tair's NFS backend (whose deletes never free anything), freed slots are reused
first, a partially freed file gets the freed ranges punched out (``fallocate``), and a fully
freed file is unlinked, so disk space really returns.

:class:`~kvcm.backends.storage.directory.DirectoryStorage` holds the slot machinery, shared with
``shm``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

from kvcm.backends.storage.directory import DirectoryStorage
from kvcm.backends.storage.ownership import Owner
from kvcm.backends.storage.slots import Container
from kvcm.backends.storage.specs import Spec, SpecReader, spec_flag, spec_int, spec_text
from kvcm.errors import InvalidArgument
from kvcm.proto.uris import FILE_PATH, FileUri, parse_block_uri

#: Default ``file_size``: how big a packed file grows (its block count is file_size // block size).
DEFAULT_FILE_SIZE = 64 << 20


class FileStorage(DirectoryStorage):
    """``file`` storage: spec ``root_path`` (required; a relative path is resolved under the
    data dir, and normalized to the absolute path), ``file_size`` (64 MiB) and
    ``key_count_per_file`` (0 = as many blocks as fit in ``file_size``, at least one),
    ``capacity_bytes`` (0 = limited by the filesystem only), ``create_root`` (true; set false on
    NFS so a missing mount fails instead of filling the local disk)."""

    type_name = "file"
    container_label = "files"

    def __init__(self, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None,
                 owner: Owner | None = None) -> None:
        self.spec = self.read_spec(name, spec, data_dir)
        self.key_count_per_file = spec_int(self.spec, "key_count_per_file")
        self.file_size = spec_int(self.spec, "file_size")
        self.create_root = spec_flag(self.spec, "create_root")
        super().__init__(name, spec_text(self.spec, "root_path"), spec_int(self.spec, "capacity_bytes"), owner)
        self.root = self.directory

    @classmethod
    def read_spec(cls, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None) -> Spec:
        """The normalized spec (defaults filled, ``root_path`` absolute). Touches nothing on disk."""
        reader = SpecReader(cls.type_name, name, spec)
        root = reader.text("root_path")
        reader.integer("key_count_per_file", 0)
        reader.integer("file_size", DEFAULT_FILE_SIZE, minimum=1)
        reader.integer("capacity_bytes", 0)
        reader.boolean("create_root", True)
        out = reader.finish()
        if not os.path.isabs(root):
            if data_dir is None:
                raise reader.fail("root_path", f"is relative ({root!r}), which needs a data dir")
            root = os.path.join(data_dir, root)
        out["root_path"] = os.path.abspath(root)
        return out

    def _prepare_directory(self) -> None:
        if self.create_root:
            os.makedirs(self.root, 0o700, exist_ok=True)
        super()._prepare_directory()

    def _slots_per_container(self, size: int) -> int:
        return self.key_count_per_file or max(1, self.file_size // size)

    def _container_name(self, size: int, index: int) -> str:
        return f"s{size}/{self.storage_id}-{index:08d}.kv"

    def _entries(self) -> Iterator[str]:
        for entry in os.scandir(self.root):
            yield entry.name

    def _scan(self) -> Iterator[tuple[str, int, str]]:
        for entry in os.scandir(self.root):
            if entry.is_dir(follow_symlinks=False) and entry.name[:1] == "s" and entry.name[1:].isdigit():
                for child in os.scandir(entry.path):
                    match = FILE_PATH.fullmatch(f"{entry.name}/{child.name}")
                    if match and child.is_file(follow_symlinks=False):
                        yield match.group(0), int(match.group(3)), match.group(2) or ""

    def _index_of(self, container_name: str) -> int:
        match = FILE_PATH.fullmatch(container_name)
        return int(match.group(3)) if match and match.group(2) == self.storage_id else 0

    def _uri(self, container: Container, slot: int) -> str:
        return f"file://{self.name}/{container.name}?blkid={slot}&size={container.size}"

    def _locate(self, uri: str) -> tuple[str, int, int]:
        block = parse_block_uri(uri)
        if not isinstance(block, FileUri) or block.storage != self.name:
            raise InvalidArgument(f"{uri[:200]!r} is not a uri of file storage {self.name!r}")
        return block.path, block.blkid, block.size

    def file_path(self, uri: str) -> str:
        """The absolute path of the file holding ``uri``'s block (it starts at ``blkid*size``)."""
        return self.path_of(self._locate(uri)[0])


def resolve_file_uri(uri: str, root_path: str) -> tuple[str, int, int]:
    """``(absolute file path, byte offset, length)`` of a ``file://`` URI, given the storage's
    ``root_path`` (or this host's mount point of it). Client code uses :mod:`kvcm.blocks`,
    which also does the I/O; this stays for tools and tests."""
    block = parse_block_uri(uri)
    if not isinstance(block, FileUri):
        raise InvalidArgument(f"{uri[:200]!r} is not a file storage uri")
    return os.path.join(root_path, block.path), block.offset, block.size

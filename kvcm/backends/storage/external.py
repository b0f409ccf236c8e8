"""URI-only external stores: ``3fs``, ``mooncake``, ``tairmempool``.

Their space belongs to another system, so kvcm only invents unique URIs in the store's own
format, accounts their bytes, and on ``delete`` hands the URIs back as
*tasks* for the owner to execute (kvcm never talks to these stores). Formats::

    3fs          hf3fs://<name><mountpoint>/<root_dir>/<id>?size=S                (key_count_per_file = 1)
                 hf3fs://<name><mountpoint>/<root_dir>/<id>?blkid=N&size=S        (> 1: blocks share a file)
    mooncake     mooncake://<name>/?key=<key_prefix><id>&size=S
    tairmempool  pace://<name>/<offset>?media_type=M&node_id=N&range_id=R&size=S

3FS tasks fix Tair's collateral delete, where deleting one block URI removed the
whole shared file: with ``key_count_per_file > 1`` a task with ``blkid`` frees one block's
range of a file other live blocks still use, and when the last live block of a file goes the
task is the bare file URI (no query), meaning "remove the whole file". With one block per file
the block URI itself names the file.

``health()`` is true while open, unless a ``probe_address`` is configured and refuses a TCP
connection. Only loopback probe addresses are accepted: kvcm never opens connections to other
hosts on its own.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import posixpath
import socket
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping

from kvcm.backends.storage.base import Inventory, Slot
from kvcm.backends.storage.ownership import Owner
from kvcm.backends.storage.safe_files import PRIVATE, SAFE_OPEN
from kvcm.backends.storage.specs import Spec, SpecReader, spec_flag, spec_int, spec_text
from kvcm.errors import CapacityError, Code, InvalidArgument, ServerError
from kvcm.proto.uris import ParsedUri, format_uri, parse_uri

log = logging.getLogger("kvcm.backends.storage")

PROBE_TIMEOUT_S = 1.0


class ExternalStorage(ABC):
    """Accounting of URIs handed out in a store kvcm does not own.

    Thread ownership: shared by the RPC thread (allocate, release), the deleter thread (delete)
    and the health thread (health); ``self._lock`` guards the live-URI table."""

    type_name = ""
    scheme = ""
    spec_source: Mapping[str, object] | None = None  # the spec it was opened with (set by open_backend)

    def __init__(self, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None,
                 owner: Owner | None = None) -> None:
        # ``owner`` (kvcm.backends.storage.ownership.Owner) is unused: kvcm creates no files here, the
        # external system owns the space, so there is nothing a marker would protect.
        self.name = name
        self.spec = self.read_spec(name, spec, data_dir)
        self.capacity_bytes = spec_int(self.spec, "capacity_bytes")
        self.probe_address = _loopback_address(name, spec_text(self.spec, "probe_address") or None)
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}  # uri -> size
        self._bytes_used = 0
        self._opened = False

    @classmethod
    def read_spec(cls, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None) -> Spec:
        """The normalized spec (defaults filled). Pure: touches nothing, connects nowhere."""
        reader = SpecReader(cls.type_name, name, spec)
        cls._read_fields(name, reader)
        reader.integer("capacity_bytes", 0)
        _loopback_address(name, reader.optional_text("probe_address"))
        out = reader.finish()
        cls._check_fields(name, out)
        return out

    # --------------------------------------------------------------------- subclass hooks

    @classmethod
    def _read_fields(cls, name: str, reader: SpecReader) -> None:
        """Read the type's own spec fields (the shared ones are read by ``read_spec``)."""

    @classmethod
    def _check_fields(cls, name: str, spec: Spec) -> None:
        """Checks across fields, on the complete spec."""

    @abstractmethod
    def _new_uris(self, count: int, size: int) -> list[str]:
        ...

    def _tasks(self, freed: list[str]) -> list[str]:
        """The owner's deletion tasks for URIs just dropped from the live table."""
        return freed

    def _on_reserve(self, parsed: ParsedUri, size: int) -> None:
        """Recovery hook (e.g. advance an offset counter past recovered URIs)."""

    # ------------------------------------------------------------------------- lifecycle

    def open(self) -> None:
        with self._lock:
            self._opened = True

    def close(self) -> None:
        with self._lock:
            self._opened = False

    def sweep(self) -> int:
        return 0  # nothing of ours to find: the owner's store is opaque to kvcm

    # ------------------------------------------------------------------------ accounting

    def allocate(self, count: int, size: int) -> list[str]:
        if count < 0 or size <= 0:
            raise InvalidArgument(f"allocate needs count >= 0 and size > 0, got {count}, {size}")
        with self._lock:
            if not self._opened:
                raise CapacityError(f"storage {self.name!r} is closed", Code.NO_STORAGE_AVAILABLE)
            if self.capacity_bytes and self._bytes_used + count * size > self.capacity_bytes:
                raise CapacityError(
                    f"storage {self.name!r}: {count * size} more bytes exceed capacity_bytes {self.capacity_bytes}",
                    Code.CAPACITY_EXHAUSTED,
                )
            uris = self._new_uris(count, size)
            for uri in uris:
                self._add(uri, size)
            return uris

    def release(self, uris: Iterable[str]) -> None:
        checked = [self._check(uri)[0] for uri in uris]
        with self._lock:
            self._tasks(self._drop(checked))  # keeps per-file counts right; nothing to hand out

    def reserve(self, uris: Iterable[str]) -> None:
        """Account every valid URI, then raise InvalidArgument if some were not ours."""
        with self._lock:
            bad = 0
            for uri in uris:
                try:
                    _, parsed, size = self._check(uri)
                    if uri not in self._live:
                        self._on_reserve(parsed, size)
                        self._add(uri, size)
                except InvalidArgument as exc:
                    bad += 1
                    log.warning("storage %s: not reserving: %s", self.name, exc)
        if bad:
            raise InvalidArgument(f"storage {self.name!r}: {bad} uri(s) could not be reserved (see log)")

    def delete(self, uris: Iterable[str]) -> list[str]:
        """Every URI comes back as a task, known or not: after a crash the owner may still hold
        data kvcm no longer accounts, and deleting twice is harmless for the owner."""
        checked = [self._check(uri)[0] for uri in uris]
        with self._lock:
            known = self._drop(checked)
            seen = set(known)
            unknown = [uri for uri in dict.fromkeys(checked) if uri not in seen]
            return self._tasks(known) + unknown

    def exists(self, uri: str) -> bool:
        with self._lock:
            return uri in self._live

    def inventory(self) -> Inventory:
        """The live URIs; no containers and no disk listing: the space is the owner's."""
        with self._lock:
            reserved = {uri: Slot("", 0, size) for uri, size in self._live.items()}
            return Inventory(reserved, {}, None, frozenset(), len(self._live), self._bytes_used)

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"bytes_used": self._bytes_used, "bytes_capacity": self.capacity_bytes, "slots_used": len(self._live)}

    def health(self) -> bool:
        if not self._opened:
            return False
        if self.probe_address is None:
            return True
        try:
            socket.create_connection(self.probe_address, timeout=PROBE_TIMEOUT_S).close()
        except OSError:
            return False
        return True

    def _add(self, uri: str, size: int) -> None:
        self._live[uri] = size
        self._bytes_used += size

    def _drop(self, uris: list[str]) -> list[str]:
        dropped = []
        for uri in uris:
            size = self._live.pop(uri, None)
            if size is not None:
                self._bytes_used -= size
                dropped.append(uri)
        return dropped

    def _check(self, uri: str) -> tuple[str, ParsedUri, int]:
        parsed = parse_uri(uri)
        if parsed.scheme != self.scheme or parsed.host != self.name:
            raise InvalidArgument(f"{uri!r} is not a uri of {self.type_name} storage {self.name!r}")
        return uri, parsed, parsed.int_param("size")


def _loopback_address(name: str, address: str | None) -> tuple[str, int] | None:
    """Parse ``host:port`` / ``[v6]:port`` and insist on loopback (kvcm probes nothing else)."""
    if address is None:
        return None
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not sep or not (port.isascii() and port.isdigit()) or not loopback:
        raise InvalidArgument(f"storage {name!r}: storage_spec.probe_address must be a loopback host:port, got {address!r}")
    return host, int(port)


def _new_id() -> str:
    return uuid.uuid4().hex  # 122 random bits: unique across processes and restarts


class ThreeFsStorage(ExternalStorage):
    """``3fs`` (HF3FS): spec ``mountpoint`` (absolute), ``root_dir``, ``key_count_per_file`` (1),
    ``touch_file_when_create`` (false; needs the mount on this host), ``cluster_name`` (unused),
    ``check_storage_available_when_open`` (false; true = open and health require the directory
    on this host), ``capacity_bytes``, ``probe_address``."""

    type_name = "3fs"
    scheme = "hf3fs"  # what Tair's code emits (its proto comment says 3fs://)

    def __init__(self, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None,
                 owner: Owner | None = None) -> None:
        super().__init__(name, spec, data_dir, owner)
        self.directory = posixpath.normpath(posixpath.join(spec_text(self.spec, "mountpoint"), spec_text(self.spec, "root_dir").strip("/")))
        self.key_count_per_file = spec_int(self.spec, "key_count_per_file")
        self.touch_file_when_create = spec_flag(self.spec, "touch_file_when_create")
        self.check_available = spec_flag(self.spec, "check_storage_available_when_open")
        self._files: dict[str, int] = {}  # file path -> live blocks in it

    @classmethod
    def _read_fields(cls, name: str, reader: SpecReader) -> None:
        if not reader.text("mountpoint").startswith("/"):
            raise reader.fail("mountpoint", "must be an absolute path")
        reader.text("root_dir")
        reader.integer("key_count_per_file", 1, minimum=1)
        reader.boolean("touch_file_when_create", False)
        reader.boolean("check_storage_available_when_open", False)
        reader.optional_text("cluster_name")

    def open(self) -> None:
        if self.check_available and not os.path.isdir(self.directory):
            raise ServerError(f"storage {self.name!r}: {self.directory} does not exist", Code.IO_ERROR)
        super().open()

    def health(self) -> bool:
        return super().health() and (not self.check_available or os.path.isdir(self.directory))

    def _new_uris(self, count: int, size: int) -> list[str]:
        uris: list[str] = []
        per = self.key_count_per_file
        for start in range(0, count, per):
            path = f"{self.directory}/{_new_id()}"
            n = min(per, count - start)
            self._touch(path)
            self._files[path] = n
            uris += [self._block_uri(path, blkid, size) for blkid in range(n)]
        return uris

    def _block_uri(self, path: str, blkid: int, size: int) -> str:
        params = {"size": size} if self.key_count_per_file == 1 else {"blkid": blkid, "size": size}
        return format_uri(self.scheme, self.name, path, params)

    def _touch(self, path: str) -> None:
        if self.touch_file_when_create:
            try:
                # A fresh random name: new (O_EXCL) and private, like every file kvcm makes in a shared place.
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_OPEN, PRIVATE))
            except OSError as exc:
                raise ServerError(f"storage {self.name!r}: touch {path}: {exc.strerror}", Code.IO_ERROR) from exc

    def _on_reserve(self, parsed: ParsedUri, size: int) -> None:
        self._files[parsed.path] = self._files.get(parsed.path, 0) + 1

    def _tasks(self, freed: list[str]) -> list[str]:
        if self.key_count_per_file == 1:  # one block per file: its URI already names the file
            for uri in freed:
                self._files.pop(parse_uri(uri).path, None)
            return freed
        tasks: list[str] = []
        emptied: dict[str, None] = {}
        for uri in freed:
            path = parse_uri(uri).path
            self._files[path] = self._files.get(path, 1) - 1
            if self._files[path] > 0:
                tasks.append(uri)
            else:
                del self._files[path]
                emptied[path] = None
        # Block tasks for a file emptied in this same call are subsumed by removing the file.
        tasks = [uri for uri in tasks if parse_uri(uri).path not in emptied]
        return tasks + [format_uri(self.scheme, self.name, path) for path in emptied]


class MooncakeStorage(ExternalStorage):
    """``mooncake``: one object per block. Spec ``local_hostname`` ("localhost"),
    ``metadata_connstring`` ("http://localhost:8080/metadata"), ``protocol`` ("tcp" | "rdma";
    rdma needs ``rdma_device``), ``master_service_entry`` ("localhost:50051"), ``key_prefix``
    ("kvcm/"), ``capacity_bytes``, ``probe_address``. Connection fields are kept for clients;
    kvcm itself never connects."""

    type_name = "mooncake"
    scheme = "mooncake"

    def __init__(self, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None,
                 owner: Owner | None = None) -> None:
        super().__init__(name, spec, data_dir, owner)
        self.local_hostname = spec_text(self.spec, "local_hostname")
        self.metadata_connstring = spec_text(self.spec, "metadata_connstring")
        self.protocol = spec_text(self.spec, "protocol")
        self.rdma_device = spec_text(self.spec, "rdma_device") or None
        self.master_service_entry = spec_text(self.spec, "master_service_entry")
        self.key_prefix = spec_text(self.spec, "key_prefix")

    @classmethod
    def _read_fields(cls, name: str, reader: SpecReader) -> None:
        reader.text("local_hostname", "localhost")
        reader.text("metadata_connstring", "http://localhost:8080/metadata")
        reader.text("protocol", "tcp")
        reader.optional_text("rdma_device")
        reader.text("master_service_entry", "localhost:50051")
        reader.text("key_prefix", "kvcm/")

    @classmethod
    def _check_fields(cls, name: str, spec: Spec) -> None:
        if spec["protocol"] not in ("tcp", "rdma"):
            raise InvalidArgument(f"storage {name!r}: storage_spec.protocol must be tcp or rdma, got {spec['protocol']!r}")
        if spec["protocol"] == "rdma" and not spec["rdma_device"]:
            raise InvalidArgument(f"storage {name!r}: storage_spec.rdma_device is required with protocol rdma")
        if any(c in spec_text(spec, "key_prefix") for c in "&=?"):
            raise InvalidArgument(f"storage {name!r}: storage_spec.key_prefix must not contain & = ?")

    def _new_uris(self, count: int, size: int) -> list[str]:
        return [format_uri(self.scheme, self.name, "/", {"key": self.key_prefix + _new_id(), "size": size}) for _ in range(count)]


class TairMemPoolStorage(ExternalStorage):
    """``tairmempool``: spec ``domain`` (required), ``timeout`` (ms, 0 = client default),
    ``service_discovery_url``, ``enable_vipserver`` (false), ``media_type`` ("dram"), ``node_id`` (0), ``range_id`` (0), ``capacity_bytes``,
    ``probe_address``. Offsets are handed out by a bump counter that recovery advances past
    every reserved URI, so they stay unique across restarts."""

    type_name = "tairmempool"
    scheme = "pace"

    def __init__(self, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None,
                 owner: Owner | None = None) -> None:
        super().__init__(name, spec, data_dir, owner)
        self.domain = spec_text(self.spec, "domain")
        self.timeout_ms = spec_int(self.spec, "timeout")
        self.service_discovery_url = spec_text(self.spec, "service_discovery_url") or None
        self.enable_vipserver = spec_flag(self.spec, "enable_vipserver")
        self.media_type = spec_text(self.spec, "media_type")
        self.node_id = spec_int(self.spec, "node_id")
        self.range_id = spec_int(self.spec, "range_id")
        self._next_offset = 0

    @classmethod
    def _read_fields(cls, name: str, reader: SpecReader) -> None:
        reader.text("domain")
        reader.integer("timeout", 0)
        reader.optional_text("service_discovery_url")
        reader.boolean("enable_vipserver", False)
        reader.text("media_type", "dram")
        reader.integer("node_id", 0)
        reader.integer("range_id", 0)

    def _new_uris(self, count: int, size: int) -> list[str]:
        first, self._next_offset = self._next_offset, self._next_offset + count * size
        return [self._uri(first + i * size, size) for i in range(count)]

    def _uri(self, offset: int, size: int) -> str:
        params = {"media_type": self.media_type, "node_id": self.node_id, "range_id": self.range_id, "size": size}
        return format_uri(self.scheme, self.name, f"/{offset}", params)

    def _on_reserve(self, parsed: ParsedUri, size: int) -> None:
        offset = parsed.path[1:]
        if not (offset.isascii() and offset.isdigit()):
            raise InvalidArgument(f"{parsed}: the path must be a byte offset")
        self._next_offset = max(self._next_offset, int(offset) + size)

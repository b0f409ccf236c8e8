"""What block I/O works with: the storages' client-visible specs, the errors it raises, and the
contract of a storage type's transfer (:class:`BlockHandler`, with its optional capabilities)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import msgspec

from kvcm.errors import Code, InvalidArgument, NotFound, ServerError
from kvcm.proto.uris import BlockUri
from kvcm.proto.wire import Decoded

U = TypeVar("U", bound=BlockUri)


@dataclass(frozen=True)
class StorageSpec:
    """The client-visible part of one storage (``get_storage_specs``): name, type, and the spec
    fields a client needs (``root_path`` of ``file``, ``shm_dir`` of ``shm``, ...)."""

    name: str
    type: str
    spec: Mapping[str, Decoded] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_wire(cls, item: object) -> StorageSpec:
        if not isinstance(item, Mapping):
            raise InvalidArgument(f"a storage spec must be a map, got {type(item).__name__}")
        name, kind, spec = item.get("global_unique_name"), item.get("storage_type"), item.get("storage_spec", {})
        if not isinstance(name, str) or not isinstance(kind, str) or not isinstance(spec, Mapping):
            raise InvalidArgument(f"a storage spec needs global_unique_name, storage_type, storage_spec: {item!r:.200}")
        return cls(name, kind, dict(spec))

    def path_field(self, key: str) -> str:
        """An absolute path of the spec (``root_path``, ``shm_dir``); InvalidArgument otherwise."""
        value = self.spec.get(key)
        if not isinstance(value, str) or not os.path.isabs(value):
            raise InvalidArgument(f"{self.type} storage {self.name!r}: its spec has no absolute {key} ({value!r:.200})")
        return value


def specs_of_reply(reply: object) -> list[StorageSpec]:
    """The storages of a ``get_storage_specs`` reply."""
    items = reply.get("storages") if isinstance(reply, Mapping) else None
    if not isinstance(items, list):
        raise InvalidArgument("a get_storage_specs reply holds a list 'storages'")
    return [StorageSpec.from_wire(item) for item in items]


class UnknownStorage(NotFound):
    """A URI names a storage the instance's specs do not list, even after a refresh."""


class Unsupported(ServerError):
    """kvcm.blocks has no transfer for this storage type (the URI-only stores). ``block`` is the
    decoded URI (``parts`` the same as a dict) and ``spec`` the storage's client-visible spec,
    everything a transfer of one's own needs; :meth:`BlockIO.register` plugs one in."""

    def __init__(self, block: BlockUri, spec: StorageSpec) -> None:
        self.block = block
        self.spec = spec
        self.parts = msgspec.structs.asdict(block)
        super().__init__(
            f"{spec.type} storage {spec.name!r}: no built-in transfer for this URI-only store; register a handler "
            f"with BlockIO.register({spec.type!r}, handler). URI parts: {self.parts}",
            Code.UNSUPPORTED,
        )


class BlockHandler(Protocol):
    """The transfer of one storage type. ``data`` and ``out`` are flat byte views of exactly
    ``block.size`` bytes; ``out`` is writable. Called from any thread (see the module doc)."""

    def write(self, block: BlockUri, spec: StorageSpec, data: memoryview) -> None: ...

    def read_into(self, block: BlockUri, spec: StorageSpec, out: memoryview) -> None: ...


@runtime_checkable
class ClosingHandler(Protocol):
    """A handler that holds resources (descriptors, mappings): :meth:`BlockIO.close` closes it."""

    def close(self) -> None: ...


@runtime_checkable
class CheckingHandler(Protocol):
    """A handler that checks a block against its spec before a read allocates the block's size
    (a hostile size must fail, not exhaust memory)."""

    def check(self, block: BlockUri, spec: StorageSpec) -> None: ...



@dataclass(frozen=True)
class Resolved:
    """Where a ``file`` or ``shm`` block's bytes are: ``size`` bytes at ``offset`` of ``path``."""

    path: str
    offset: int
    size: int



def expect(block: BlockUri, kind: type[U]) -> U:
    if not isinstance(block, kind):
        raise InvalidArgument(f"uri {block.uri[:200]!r} is a {block.storage_type} uri, not {kind.storage_type}")
    return block


"""Block I/O at the URIs kvcm hands out: decode a URI, find its storage, write and read the bytes.

kvcm never moves KV bytes; a client writes each block at the URI ``start_write_cache`` returned
and reads it at the URI ``get_cache_location`` returns. This package does that for the storages
kvcm owns the space of, from the client-visible storage specs of ``get_storage_specs``::

    with kvcm.Client(endpoint) as client, BlockIO.for_instance(client, "qwen-7b-a") as io:
        io.write(uri, block)            # bytes, memoryview, numpy array: any contiguous buffer
        io.read_into(uri, out)          # into the caller's buffer, no copy in between

* ``file``: ``os.pwrite`` / ``os.preadv`` on a cache of open descriptors (``O_DIRECT`` optional).
* ``shm``: a copy into / out of a cached ``mmap`` of the segment.
* ``3fs``, ``mooncake``, ``tairmempool`` (kvcm only invents their URIs): :class:`Unsupported`,
  carrying the decoded URI, unless a handler for the type is registered (:meth:`BlockIO.register`).

Docs: docs/blocks.md (URI formats, the spec RPC, thread-safety, O_DIRECT, custom handlers).

Thread-safety: one :class:`BlockIO` may be shared by any number of threads. Reads and writes are
positional (``pwrite``/``preadv``, or a copy at an offset of a mapping), so they never share a
file position; the caches are dicts changed only under a lock, and an evicted descriptor or
mapping is closed only when the last operation using it lets go of it (reference counting),
never under a running copy.

One module per concept: :mod:`~kvcm.blocks.specs` (storage specs, errors, the handler
contract), :mod:`~kvcm.blocks.io` (:class:`BlockIO`), :mod:`~kvcm.blocks.files` and
:mod:`~kvcm.blocks.shm` (the built-in handlers), :mod:`~kvcm.blocks.places` (the caches of open
descriptors and mappings). Their public names are all here.
"""

from __future__ import annotations

from kvcm.blocks.files import DIRECT_ALIGN, FileHandler
from kvcm.blocks.io import BlockIO
from kvcm.blocks.shm import ShmHandler
from kvcm.blocks.specs import (
    BlockHandler,
    CheckingHandler,
    ClosingHandler,
    Resolved,
    StorageSpec,
    UnknownStorage,
    Unsupported,
    specs_of_reply,
)
from kvcm.proto.uris import BlockUri, FileUri, MooncakeUri, PaceUri, ShmUri, ThreeFsUri, parse_block_uri

__all__ = [
    "DIRECT_ALIGN", "BlockHandler", "BlockIO", "BlockUri", "CheckingHandler", "ClosingHandler", "FileHandler",
    "FileUri", "MooncakeUri", "PaceUri", "Resolved", "ShmHandler", "ShmUri", "StorageSpec", "ThreeFsUri",
    "UnknownStorage", "Unsupported", "parse", "specs_of_reply",
]

#: Decode any URI kvcm hands out (``file``, ``shm``, ``hf3fs``, ``mooncake``, ``pace``) into its
#: typed form; InvalidArgument on anything else. The same decoder the server's backends use.
parse = parse_block_uri

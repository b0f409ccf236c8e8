"""The round trip of a KV connector — which blocks exist, write the new ones, read them back —
in a few calls over :class:`kvcm.Client` and :mod:`kvcm.blocks`.

>>> with Connector("tcp://127.0.0.1:6381", instance_id="llama-8b", block_size=16,
...                specs={"tp0": 65536}) as kv:                    # doctest: +SKIP
...     kv.lookup(tokens).tokens                                  # tokens already cached
...     with kv.begin_write(tokens) as w:                         # the blocks not cached yet
...         for block in w.new_blocks:
...             block.write("tp0", kv_bytes_of(block.index))
...     for block in kv.read(tokens):                             # another process, later
...         block.read_into("tp0", buffer_of(block.index))

**Writes finish with exactly what was written.** Leaving the ``begin_write`` block finishes the
session: a block counts as written when every spec it has was written (here or by a rank, see
below); the others are reported failed, so kvcm frees their space at once. An exception inside
the block fails every block of the session and propagates: nothing is left ``writing``.

**Several ranks.** With tensor parallelism each rank holds its own slice of every block (one
spec per rank). One rank — the scheduler — starts the session and hands
:meth:`WriteSession.ticket` (a few hundred bytes, ``bytes(ticket)``) to the others. Each rank
opens :meth:`Connector.rank_write` with the ticket and its spec name, writes its blocks, and
sends :meth:`RankWrite.report` back the same way; the scheduler passes each report to
:meth:`WriteSession.add_report`. The session finishes when the scheduler leaves its block: a
block a rank did not report (the rank died, timed out, or failed it) is failed, never served
half-written. How tickets and reports travel is the caller's (vLLM returns worker output to the
scheduler; any pipe, queue or RPC does).

**Prompts with more than tokens.** ``lookup``, ``read`` and ``begin_write`` take the prompt's
extra keys: ``extra_keys`` (one entry per block, as vLLM's ``BlockStored`` carries them), or
``mm_features`` (``{"identifier", "offset", "length"}`` per image), ``lora_name`` and
``cache_salt``, from which kvcm derives them as vLLM does. Blocks of the same tokens with other
images, another adapter or another salt are other blocks (docs/engines.md, "Keys").

Threads: a ``Connector`` is used from one thread at a time (its client is not thread-safe);
:mod:`kvcm.blocks` I/O itself may run on several threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeVar

import msgspec

from kvcm.blocks import BlockIO
from kvcm.client import Client
from kvcm.errors import InvalidArgument, NotFound
from kvcm.proto.extra_keys import MmFeature
from kvcm.proto.results import CacheLocations
from kvcm.proto.wire import Decoded, DecodedMap, Encodable, EncodableMap

DEFAULT_ENDPOINT = "tcp://127.0.0.1:6381"
DEFAULT_GROUP = "default"  # the instance group the embedded default creates
ENDPOINT_ENV = "KVCM_SERVER_ENDPOINT"  # the same variable ``kvcm call`` and ``kvcm serve`` read


class IoOptions(TypedDict, total=False):
    """The :class:`kvcm.blocks.BlockIO` options a connector passes on (``io_options``)."""

    mounts: Mapping[str, str] | None
    direct: bool
    max_files: int
    max_segments: int


@dataclass(frozen=True)
class Match:
    """What :meth:`Connector.lookup` found: the cached prefix, in blocks and in tokens."""

    blocks: int
    tokens: int


class _TicketBlock(msgspec.Struct, array_like=True, frozen=True):
    index: int  # the block's position in the prompt
    uris: dict[str, str]  # spec name -> URI


class Ticket(msgspec.Struct, array_like=True, frozen=True):
    """A write session as the other ranks need it: serialisable with ``bytes(ticket)`` and
    :meth:`from_bytes` (msgpack, a few hundred bytes for a typical prompt)."""

    instance_id: str
    session_id: str
    blocks: list[_TicketBlock]

    def __bytes__(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, raw: bytes | Ticket) -> Ticket:
        return _decoded(cls, raw, "write ticket")


class Report(msgspec.Struct, array_like=True, frozen=True):
    """What one rank wrote of a session: its spec and the prompt indices of the blocks done."""

    session_id: str
    spec: str
    written: list[int]

    def __bytes__(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, raw: bytes | Report) -> Report:
        return _decoded(cls, raw, "rank report")


M = TypeVar("M", Ticket, Report)


def _decoded(cls: type[M], raw: bytes | M, what: str) -> M:
    """``raw`` as a ``cls`` (already one: as it is); InvalidArgument when it is not one."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        return raw
    try:
        return msgspec.msgpack.decode(raw, type=cls)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"not a kvcm {what}: {exc}") from None


@dataclass
class NewBlock:
    """One block of a write session: ``index`` is its position in the prompt (its tokens are
    ``token_ids[index * block_size:(index + 1) * block_size]``), ``uris`` one URI per spec."""

    index: int
    uris: dict[str, str]
    _io: BlockIO = field(repr=False)
    written: set[str] = field(default_factory=set)

    def write(self, spec: str, data: object) -> None:
        """Write this block's bytes of ``spec`` (any buffer of exactly the spec's size)."""
        uri = self.uris.get(spec)
        if uri is None:
            raise InvalidArgument(f"block {self.index} has no spec {spec!r} (it has {', '.join(self.uris)})")
        self._io.write(uri, data)
        self.written.add(spec)

    @property
    def done(self) -> bool:
        """Every spec written."""
        return self.written >= self.uris.keys()


@dataclass
class ReadBlock:
    """One cached block of a prompt: ``index`` its position, ``uris`` one URI per spec."""

    index: int
    uris: dict[str, str]
    _io: BlockIO = field(repr=False)

    def read_into(self, spec: str, out: object) -> None:
        """Read this block's bytes of ``spec`` into ``out`` (a writable buffer of the spec's size)."""
        self._io.read_into(self._uri(spec), out)

    def read(self, spec: str) -> bytearray:
        """This block's bytes of ``spec``, in a new buffer."""
        return self._io.read(self._uri(spec))

    def _uri(self, spec: str) -> str:
        uri = self.uris.get(spec)
        if uri is None:
            raise InvalidArgument(f"block {self.index} has no spec {spec!r} (it has {', '.join(self.uris)})")
        return uri


class WriteState:
    """What a started write knows, sync or async alike: its blocks, the ranks' reports, and the
    ``finish_write_cache`` request that follows from them."""

    def __init__(self, instance_id: str, session_id: str, new_blocks: list[NewBlock], cached: int) -> None:
        self.instance_id = instance_id
        self.session_id = session_id
        self.new_blocks = new_blocks
        self.cached = cached
        self.result: DecodedMap | None = None  # the finish reply, once finished
        self._by_index = {b.index: b for b in new_blocks}

    def ticket(self) -> Ticket:
        """What the other ranks need to write their specs (``bytes(ticket)`` to send it)."""
        return Ticket(self.instance_id, self.session_id, [_TicketBlock(b.index, b.uris) for b in self.new_blocks])

    def add_report(self, report: bytes | Report) -> None:
        """Count what a rank wrote (its :meth:`RankWrite.report`)."""
        got = Report.from_bytes(report)
        if got.session_id != self.session_id:
            raise InvalidArgument(f"report of session {got.session_id!r}, not of this session {self.session_id!r}")
        for index in got.written:
            block = self._by_index.get(index)
            if block is None or got.spec not in block.uris:
                raise InvalidArgument(f"report names block {index} spec {got.spec!r}, which this session has not")
            block.written.add(got.spec)

    def missing(self) -> dict[int, list[str]]:
        """Per block not fully written yet, the specs still missing."""
        return {b.index: sorted(b.uris.keys() - b.written) for b in self.new_blocks if not b.done}

    def _finish_params(self, succeeded: bool) -> dict[str, Encodable]:
        """The finish request: the fully written blocks served (when ``succeeded``), the rest failed."""
        done = [succeeded and b.done for b in self.new_blocks]
        mask: EncodableMap = {"offset": len(done)} if all(done) else {"bool_masks": done}
        return {"instance_id": self.instance_id, "write_session_id": self.session_id, "success_blocks": mask}


class WriteSession(WriteState):
    """A started write (see :meth:`Connector.begin_write`): ``new_blocks`` are the blocks to
    write, ``cached`` how many of the prompt's blocks kvcm already had (or has being written by
    another writer). Leave the ``with`` block to finish it; or call :meth:`finish` / :meth:`fail`."""

    def __init__(self, client: Client, instance_id: str, session_id: str, new_blocks: list[NewBlock],
                 cached: int) -> None:
        super().__init__(instance_id, session_id, new_blocks, cached)
        self._client = client

    def __enter__(self) -> WriteSession:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if self.result is None:
            self._finish(exc_type is None)  # an exception fails every block, and propagates

    def finish(self) -> DecodedMap:
        """Finish: the fully written blocks are served, the others failed. Returns the reply
        (``served``, ``failed``)."""
        return self._finish(True)

    def fail(self) -> DecodedMap:
        """Finish with every block failed (their space is freed at once)."""
        return self._finish(False)

    def _finish(self, succeeded: bool) -> DecodedMap:
        if self.result is None:
            self.result = dict(self._client.call("finish_write_cache", self._finish_params(succeeded)))
        return self.result


class RankWrite:
    """One rank's part of a session (see :meth:`Connector.rank_write`): write ``spec`` of every
    block of ``blocks``, then send :meth:`report` to the scheduler. An exception inside the
    ``with`` block reports nothing written, so the scheduler fails those blocks."""

    def __init__(self, io: BlockIO, ticket: Ticket, spec: str) -> None:
        self.ticket = ticket
        self.spec = spec
        self.blocks = [NewBlock(b.index, {spec: b.uris[spec]}, io) for b in ticket.blocks if spec in b.uris]
        self._failed = False

    def __enter__(self) -> RankWrite:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self._failed = exc_type is not None

    def write(self, index: int, data: object) -> None:
        """Write block ``index`` (its prompt position) of this rank's spec."""
        for block in self.blocks:
            if block.index == index:
                block.write(self.spec, data)
                return
        raise InvalidArgument(f"block {index} is not among this rank's blocks")

    def report(self) -> Report:
        """What this rank wrote (``bytes(report)`` to send it)."""
        written = [] if self._failed else [b.index for b in self.blocks if b.done]
        return Report(self.ticket.session_id, self.spec, written)


class Connector:
    """An instance's KV connector: lookups, writes and reads over one client.

    ``specs`` (spec name -> bytes per block) registers the instance when it is not registered
    yet, in ``instance_group`` (default ``"default"``), and otherwise attaches to it: the block
    size and specs must be the registered ones, while the group and the deployment are compared
    only when given (an instance an operator registered is attached to as it is). A real
    difference is ``DUPLICATE_ENTITY`` naming the field and both values. Without ``specs`` the
    instance must exist and have this ``block_size`` (else InvalidArgument naming both).
    ``client`` reuses a client (its endpoint wins); other keyword arguments go to
    :class:`kvcm.Client`; ``io_options`` to :class:`kvcm.blocks.BlockIO` (``mounts``,
    ``direct`` ...). ``endpoint`` defaults to ``$KVCM_SERVER_ENDPOINT``, else
    ``tcp://127.0.0.1:6381``. :class:`kvcm.aio_connector.AsyncConnector` is the same for asyncio."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        instance_id: str,
        block_size: int,
        specs: Mapping[str, int] | None = None,
        instance_group: str | None = None,
        model_deployment: Mapping[str, Encodable] | None = None,
        client: Client | None = None,
        io_options: IoOptions | None = None,
        **client_options: Any,
    ) -> None:
        check_block_size(block_size)
        self.instance_id = instance_id
        self.block_size = block_size
        self._own_client = client is None
        self.client = client if client is not None else Client(default_endpoint(endpoint), **client_options)
        try:
            self._attach(specs, instance_group, model_deployment)
            self.io = BlockIO.for_instance(self.client, instance_id, **(io_options if io_options is not None else IoOptions()))
        except BaseException:
            self.close()
            raise

    def _attach(self, specs: Mapping[str, int] | None, group: str | None,
                deployment: Mapping[str, Encodable] | None) -> None:
        registered = None
        if specs is None or group is None:  # the registered instance decides the group, or is required
            registered = registered_info(self.client.call, self.instance_id, must_exist=specs is None)
        if specs is None:
            check_same_block_size(self.instance_id, registered, self.block_size)
            return
        self.client.call("register_instance", registration(self.instance_id, self.block_size, specs,
                                                           group_of(group, registered), deployment))

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the block I/O caches, and the client if this connector made it."""
        io = getattr(self, "io", None)
        if io is not None:
            io.close()
        if self._own_client:
            self.client.close()

    # -- the round trip ----------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], **extras: Any) -> Match:
        """The longest cached prefix of the prompt (whole blocks only). Asks for the matched
        length alone (``get_cache_location_len``): no locations travel or get decoded.
        ``extras``: the prompt's extra keys (:func:`extras_of`, module docstring)."""
        if len(token_ids) < self.block_size:
            return Match(0, 0)  # not one whole block: nothing to ask
        blocks = self.client.get_cache_location_len(instance_id=self.instance_id, query_type="prefix_match",
                                                    token_ids=list(token_ids), **extras_of(**extras)).cache_location_len
        return Match(blocks, blocks * self.block_size)

    def read(self, token_ids: Sequence[int], **extras: Any) -> list[ReadBlock]:
        """The cached prefix's blocks, in prompt order, each readable per spec."""
        if len(token_ids) < self.block_size:
            return []  # not one whole block: nothing to ask
        # The typed call: msgspec's Structs cost 0.5-0.65 of the client CPU of call()'s dicts.
        reply = self.client.get_cache_location(instance_id=self.instance_id, query_type="prefix_match",
                                               token_ids=list(token_ids), **extras_of(**extras))
        return read_blocks(reply, self.io)

    def begin_write(self, token_ids: Sequence[int], timeout_s: float | None = None, **extras: Any) -> WriteSession:
        """Start writing the prompt's blocks kvcm does not have; use as a context manager
        (see the module docstring). ``timeout_s``: the session's lifetime (server default if None)."""
        reply = self.client.call("start_write_cache", start_params(self.instance_id, token_ids, timeout_s,
                                                                   **extras))
        blocks, cached = new_blocks(reply, len(token_ids) // self.block_size, self.io)
        return WriteSession(self.client, self.instance_id, reply["write_session_id"], blocks, cached)

    def rank_write(self, ticket: bytes | Ticket, spec: str) -> RankWrite:
        """This rank's part of a session another rank started (see the module docstring)."""
        return RankWrite(self.io, checked_ticket(ticket, self.instance_id), spec)


# -- what the sync and async connectors share ----------------------------------------------------


def check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise InvalidArgument(f"block_size must be at least 1, got {block_size}")


def default_endpoint(endpoint: str | None) -> str:
    return endpoint if endpoint is not None else os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT


def registered_info(call: Callable[[str, dict[str, Encodable]], Decoded], instance_id: str,
                    must_exist: bool) -> DecodedMap | None:
    """The registered instance (``get_instance_info``'s ``instance_info``); None when it is not
    registered and need not be."""
    try:
        return instance_info_of(call("get_instance_info", {"instance_id": instance_id}))
    except NotFound:
        if must_exist:
            raise
        return None


def instance_info_of(reply: Decoded) -> DecodedMap:
    """``get_instance_info``'s ``instance_info`` map, a copy."""
    info = reply.get("instance_info") if isinstance(reply, dict) else None
    if not isinstance(info, dict):
        raise InvalidArgument("get_instance_info reply has no instance_info map")
    return dict(info)


def check_same_block_size(instance_id: str, registered: DecodedMap | None, block_size: int) -> None:
    """A reader's block size is the registered one: any other would split prompts into other
    blocks, and a lookup would count blocks of the wrong size (a wrong answer, not an error)."""
    if registered is not None and registered["block_size"] != block_size:
        raise InvalidArgument(f"instance {instance_id!r} is registered with block_size {registered['block_size']!s}, "
                              f"this connector was given block_size {block_size}")


def group_of(group: str | None, registered: DecodedMap | None) -> str:
    """The group to register in: the one given, else the registered instance's, else the default."""
    if group is not None:
        return group
    return str(registered["instance_group_name"]) if registered is not None else DEFAULT_GROUP


def registration(instance_id: str, block_size: int, specs: Mapping[str, int], group: str,
                 deployment: Mapping[str, Encodable] | None) -> dict[str, Encodable]:
    """``register_instance``'s params: the deployment only when given, so attaching to an
    instance registered without one (or with another the caller does not know) succeeds."""
    params: dict[str, Encodable] = {
        "instance_group": group, "instance_id": instance_id, "block_size": block_size,
        "location_spec_infos": [{"name": name, "size": size} for name, size in specs.items()],
    }
    if deployment is not None:
        params["model_deployment"] = dict(deployment)
    return params


def extras_of(
    *,
    extra_keys: Sequence[object] | None = None,
    mm_features: Sequence[MmFeature | Mapping[str, object]] | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """A prompt's extra keys as request fields (those given): per block ``extra_keys``, or
    ``mm_features``, ``lora_name`` and ``cache_salt`` (a misspelled name is a TypeError here)."""
    given = {"extra_keys": None if extra_keys is None else list(extra_keys),
             "mm_features": None if mm_features is None else list(mm_features),
             "lora_name": lora_name, "cache_salt": cache_salt}  # fmt: skip
    return {k: v for k, v in given.items() if v is not None}


def start_params(instance_id: str, token_ids: Sequence[int], timeout_s: float | None, **extras: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"instance_id": instance_id, "token_ids": list(token_ids), **extras_of(**extras)}
    if timeout_s is not None:
        params["write_timeout_seconds"] = timeout_s
    return params


def new_blocks(reply: Mapping[str, Any], blocks: int, io: BlockIO) -> tuple[list[NewBlock], int]:
    """The blocks a start reply hands out to write, and how many of the prompt's it masked."""
    locations = reply.get("locations") or []
    indices = _new_indices(reply.get("block_mask"), blocks, len(locations))
    written = [NewBlock(i, _uris(loc), io) for i, loc in zip(indices, locations)]
    return written, blocks - len(written)


def read_blocks(reply: CacheLocations, io: BlockIO) -> list[ReadBlock]:
    return [ReadBlock(i, {spec.name: spec.uri for spec in loc.location_specs}, io)
            for i, loc in enumerate(reply.locations)]


def checked_ticket(ticket: bytes | Ticket, instance_id: str) -> Ticket:
    got = Ticket.from_bytes(ticket)
    if got.instance_id != instance_id:
        raise InvalidArgument(f"ticket of instance {got.instance_id!r}, not {instance_id!r}")
    return got


def _uris(location: Mapping[str, Any]) -> dict[str, str]:
    return {spec["name"]: spec["uri"] for spec in location.get("location_specs") or []}


def _new_indices(mask: Any, blocks: int, new: int) -> list[int]:
    """Prompt positions of a start reply's new blocks: the keys its ``block_mask`` leaves out."""
    if not mask:
        indices = list(range(blocks))
    elif "offset" in mask:
        indices = list(range(int(mask["offset"]), blocks))
    else:
        flags = mask.get("bool_masks")
        flags = flags.get("values", []) if isinstance(flags, Mapping) else flags or []
        indices = [i for i, cached in enumerate(flags) if not cached]
    if len(indices) != new:
        raise InvalidArgument(f"start_write_cache reply: {new} locations for {len(indices)} unmasked blocks")
    return indices


def iter_blocks(token_ids: Sequence[int], block_size: int) -> Iterator[tuple[int, Sequence[int]]]:
    """``(index, tokens)`` of each whole block of a prompt (a trailing partial block has none)."""
    for i in range(len(token_ids) // block_size):
        yield i, token_ids[i * block_size:(i + 1) * block_size]


__all__ = ["DEFAULT_GROUP", "Connector", "Match", "NewBlock", "RankWrite", "ReadBlock", "Report", "Ticket", "WriteSession",
           "WriteState",
           "iter_blocks"]

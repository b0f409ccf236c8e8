"""The KV connector's round trip for asyncio: :class:`AsyncConnector` is
:class:`kvcm.connector.Connector` over :class:`kvcm.aio.Client`.

>>> async with AsyncConnector(instance_id="llama-8b", block_size=16,
...                           specs={"tp0": 65536}) as kv:                # doctest: +SKIP
...     cached = (await kv.lookup(tokens)).tokens
...     async with await kv.begin_write(tokens) as write:
...         for block in write.new_blocks:
...             block.write("tp0", kv_bytes(block.index))
...     for block in await kv.read(tokens):
...         block.read_into("tp0", buffer_of(block.index))

The RPCs are awaited; the block I/O itself (``block.write``, ``block.read_into``) stays a plain
call, because it is a local ``pwrite``/``preadv`` or a copy into a mapping, not network I/O: for
blocks large enough to hold the loop up, run it in a thread (``await asyncio.to_thread(
block.write, "tp0", data)``; one :class:`kvcm.blocks.BlockIO` is safe from many threads).
Registration and attachment, write sessions, tickets and reports behave exactly as the sync
connector's (see :mod:`kvcm.connector`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcm.aio import Client
from kvcm.blocks import BlockIO, StorageSpec, parse, specs_of_reply
from kvcm.connector import (
    IoOptions,
    Match,
    NewBlock,
    RankWrite,
    ReadBlock,
    Ticket,
    WriteState,
    check_block_size,
    check_same_block_size,
    checked_ticket,
    default_endpoint,
    extras_of,
    group_of,
    instance_info_of,
    new_blocks,
    read_blocks,
    registration,
    start_params,
)
from kvcm.errors import NotFound
from kvcm.proto.wire import DecodedMap, Encodable


class AsyncWriteSession(WriteState):
    """A started write (see :meth:`AsyncConnector.begin_write`); leave its ``async with`` block
    to finish it, or await :meth:`finish` / :meth:`fail`."""

    def __init__(self, client: Client, instance_id: str, session_id: str, blocks: list[NewBlock], cached: int) -> None:
        super().__init__(instance_id, session_id, blocks, cached)
        self._client = client

    async def __aenter__(self) -> AsyncWriteSession:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if self.result is None:
            await self._finish(exc_type is None)  # an exception fails every block, and propagates

    async def finish(self) -> DecodedMap:
        """The fully written blocks are served, the others failed; the reply."""
        return await self._finish(True)

    async def fail(self) -> DecodedMap:
        """Every block failed (their space is freed at once)."""
        return await self._finish(False)

    async def _finish(self, succeeded: bool) -> DecodedMap:
        if self.result is None:
            self.result = dict(await self._client.call("finish_write_cache", self._finish_params(succeeded)))
        return self.result


class AsyncConnector:
    """An instance's KV connector over the asyncio client; the arguments are
    :class:`kvcm.connector.Connector`'s. The registration (or attachment) is a round trip, so it
    happens when the connector is entered (``async with``), awaited with :meth:`open`, or at
    the first call, whichever comes first."""

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
        self._registration = (specs, instance_group, model_deployment)
        self._opened = False
        self._specs: list[StorageSpec] = []
        # BlockIO asks for the specs synchronously; this connector refreshes them (awaited)
        # before handing out a URI of a storage it has not seen, so the list is always current.
        self.io = BlockIO(lambda: self._specs, **(io_options if io_options is not None else IoOptions()))

    async def open(self) -> AsyncConnector:
        """Register or attach (see :class:`kvcm.connector.Connector`) and fetch the storage
        specs; once. On failure the connector is closed and the error raised."""
        if not self._opened:
            try:
                await self._attach(*self._registration)
                await self._refresh_specs()
            except BaseException:
                await self.close()
                raise
            self._opened = True
        return self

    async def _attach(self, specs: Mapping[str, int] | None, group: str | None,
                      deployment: Mapping[str, Encodable] | None) -> None:
        registered = None
        if specs is None or group is None:
            registered = await self._registered(must_exist=specs is None)
        if specs is None:
            check_same_block_size(self.instance_id, registered, self.block_size)
            return
        await self.client.call("register_instance", registration(self.instance_id, self.block_size, specs,
                                                                 group_of(group, registered), deployment))

    async def _registered(self, must_exist: bool) -> DecodedMap | None:
        try:
            reply = await self.client.call("get_instance_info", {"instance_id": self.instance_id})
        except NotFound:
            if must_exist:
                raise
            return None
        return instance_info_of(reply)

    async def _refresh_specs(self) -> None:
        reply = await self.client.call("get_storage_specs", {"instance_id": self.instance_id})
        self._specs = specs_of_reply(reply)
        self.io.refresh()

    async def _know_storages_of(self, uris: Sequence[str]) -> None:
        """Refresh the specs once if a URI names a storage added since they were fetched."""
        known = {spec.name for spec in self._specs}
        if any(parse(uri).storage not in known for uri in uris):
            await self._refresh_specs()

    async def __aenter__(self) -> AsyncConnector:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the block I/O caches, and the client if this connector made it."""
        self.io.close()
        if self._own_client:
            await self.client.close()

    # -- the round trip ----------------------------------------------------------------------

    async def lookup(self, token_ids: Sequence[int], **extras: Any) -> Match:
        """The longest cached prefix of the prompt, in whole blocks (its length only).
        ``extras``: the prompt's extra keys (:func:`kvcm.connector.extras_of`)."""
        await self.open()
        if len(token_ids) < self.block_size:
            return Match(0, 0)
        found = await self.client.get_cache_location_len(instance_id=self.instance_id, query_type="prefix_match",
                                                         token_ids=list(token_ids), **extras_of(**extras))
        return Match(found.cache_location_len, found.cache_location_len * self.block_size)

    async def read(self, token_ids: Sequence[int], **extras: Any) -> list[ReadBlock]:
        """The cached prefix's blocks, in prompt order, each readable per spec."""
        await self.open()
        if len(token_ids) < self.block_size:
            return []
        reply = await self.client.get_cache_location(instance_id=self.instance_id, query_type="prefix_match",
                                                     token_ids=list(token_ids), **extras_of(**extras))
        found = read_blocks(reply, self.io)
        await self._know_storages_of([uri for block in found for uri in block.uris.values()])
        return found

    async def begin_write(self, token_ids: Sequence[int], timeout_s: float | None = None,
                          **extras: Any) -> AsyncWriteSession:
        """Start writing the prompt's blocks kvcm does not have (``async with`` the session)."""
        await self.open()
        reply = await self.client.call("start_write_cache", start_params(self.instance_id, token_ids, timeout_s,
                                                                         **extras))
        blocks, cached = new_blocks(reply, len(token_ids) // self.block_size, self.io)
        session = AsyncWriteSession(self.client, self.instance_id, reply["write_session_id"], blocks, cached)
        try:
            await self._know_storages_of([uri for block in blocks for uri in block.uris.values()])
        except BaseException:
            await session.fail()
            raise
        return session

    def rank_write(self, ticket: bytes | Ticket, spec: str) -> RankWrite:
        """This rank's part of a session another rank started (no RPC: plain block I/O)."""
        return RankWrite(self.io, checked_ticket(ticket, self.instance_id), spec)


__all__ = ["AsyncConnector", "AsyncWriteSession"]

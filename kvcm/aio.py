"""asyncio kvcm client: one DEALER socket, many requests in flight, replies matched by msgid.

>>> async with kvcm.aio.Client("tcp://127.0.0.1:6381") as kv:          # doctest: +SKIP
...     health = await kv.check_health()

The same typed surface as :class:`kvcm.Client` (same method names, keyword arguments and
:mod:`kvcm.proto.results` structs; the methods are generated from the sync client's by
``scripts/gen_aio_client``), plus ``call()``. Any number of calls may be awaited at once from one
task (``asyncio.gather``): each request gets a msgid, a reader task routes every reply to the
future of its msgid, and a reply nobody awaits any more (a late reply to a timed-out attempt)
is dropped. ``timeout`` is per attempt; a call with no reply in time raises
:class:`~kvcm.errors.Unavailable` with code ``TIMEOUT``. Only idempotent methods are retried,
under a new msgid, so a late reply to the first attempt cannot be taken for the retry's.
:meth:`Client.close` fails every pending call with ``Unavailable`` (``SHUTTING_DOWN``).
One client belongs to one event loop. Several endpoints and ``SERVER_NOT_LEADER`` are handled
as by :class:`kvcm.Client` (follow the leader for any method; on a timeout, the next endpoint).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from kvcm.client import (
    IDEMPOTENT_METHODS,
    METHODS,
    ClientState,
    CurveClientKeys,
    Endpoints,
    Ints,
    MmFeatures,
    QueryType,
    ReportOp,
    TrimStrategy,
    _listed,
    _Skip,
    build_request,
    decode_reply,
    drop_unset,
    follows_leader,
    timeout_error,
)
from kvcm.errors import Code, InvalidArgument, KvcmError, Unavailable
from kvcm.proto import wire
from kvcm.proto.results import (
    HEAD,
    AdminReply,
    CacheLocationLen,
    CacheLocations,
    CacheMeta,
    EngineMatches,
    Envelope,
    EventsReported,
    Health,
    HostCacheState,
    InstanceInfoReply,
    Lost,
    Mask,
    ModelDeployment,
    Pinned,
    Registered,
    Removed,
    Routed,
    SpecGroup,
    SpecInfo,
    StorageSpecs,
    Unpinned,
    WriteFinished,
    WriteSession,
    decoder,
)
from kvcm.rpc.curve import KeyPair, apply_client, client_keypair, load_public_key

T = TypeVar("T")

#: What a timer puts in a pending future when its attempt ran out of time.
_TIMED_OUT = object()
#: Sockets left behind by moving to another server, kept reading for calls still in flight on them.
_RETIRED_MAX = 2


class Client:
    """An asyncio connection to a kvcm server (the leader of several). Use ``async with``, or
    await :meth:`close`."""

    def __init__(
        self,
        endpoint: str | Sequence[str] = "tcp://127.0.0.1:6381",
        timeout: float = 5.0,
        retries: int = 2,
        auth: dict[str, str] | None = None,
        context: zmq.asyncio.Context | None = None,
        curve_server_key: str | bytes | os.PathLike[str] | None = None,
        curve_client_keys: CurveClientKeys | None = None,
    ) -> None:
        self.endpoints = Endpoints(endpoint)
        self._curve: tuple[bytes, KeyPair] | None = None
        if curve_server_key is not None:
            self._curve = (load_public_key(curve_server_key), client_keypair(curve_client_keys))
        elif curve_client_keys is not None:
            raise InvalidArgument("curve_client_keys need curve_server_key (the server's public key)")
        self.timeout = timeout
        self.retries = retries
        self.auth = auth
        self._ctx = context or zmq.asyncio.Context.instance()
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "big"))
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._retired: list[tuple[zmq.asyncio.Socket, asyncio.Task[None]]] = []  # sockets left by a move
        self.state = ClientState.OPEN

    @property
    def endpoint(self) -> str:
        """The server this client talks to now."""
        return self.endpoints.current

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered, timed out or failed."""
        return len(self._pending)

    async def close(self) -> None:
        """Idempotent: fail every pending call, stop the reader, close the socket."""
        self.state = ClientState.CLOSED
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(Unavailable(f"client of {self.endpoint} closed", Code.SHUTTING_DOWN))
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            try:
                await reader
            except asyncio.CancelledError:
                pass
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        retired, self._retired = self._retired, []
        for sock, task in retired:
            self._close_socket(sock, task)

    @staticmethod
    def _close_socket(sock: zmq.asyncio.Socket, reader: asyncio.Task[None]) -> None:
        reader.cancel()
        sock.close(linger=0)

    async def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        retry: bool | None = None,
    ) -> Any:
        """Send one request and return its result map; raise the mapped KvcmError on error."""
        may_retry = method in IDEMPOTENT_METHODS if retry is None else retry
        return await self._request(method, dict(params or {}), decoder(Any), timeout, may_retry)

    async def _typed(self, method: str, reply: type[T], timeout: float | None, **params: Any) -> T:
        result: T = await self._request(method, drop_unset(params), decoder(reply), timeout,
                                        method in IDEMPOTENT_METHODS)
        return result

    async def _request(self, method: str, params: dict[str, Any], dec: msgspec.msgpack.Decoder[Envelope[Any]],
                       timeout: float | None, may_retry: bool) -> Any:
        if self.state is ClientState.CLOSED:
            raise RuntimeError("client is closed")
        wait = self.timeout if timeout is None else timeout
        attempts = 1 + (self.retries if may_retry else 0)
        timeouts = follows = 0
        while True:
            # A new msgid per attempt: the first attempt's late reply finds no future and is dropped.
            msgid = self._next_id()
            payload = build_request(method, msgid, params, self.auth)
            sent_to = self.endpoint
            data = await self._attempt(msgid, payload, wait)
            if data is not _TIMED_OUT:
                try:
                    return decode_reply(dec, data, msgid)
                except _Skip:  # the reader routes by msgid: cannot happen, but never a wrong result
                    continue
                except KvcmError as exc:
                    if not follows_leader(exc, follows):
                        raise
                    await self._move(self.endpoints.follow(exc, follows))
                    follows += 1
                    continue
            timeouts += 1
            where = self.endpoint
            # The retry (or the next call) asks another server, unless a concurrent call has
            # moved the client already (to the leader it was told of: stay there).
            if sent_to == where and self.endpoints.rotate():
                await self._move(0.0)
            if timeouts >= attempts:
                raise timeout_error(method, where, wait, attempts, self._curve is not None)

    async def _move(self, pause: float) -> None:
        """Connect to ``self.endpoint`` (changed by the caller) for the next attempts, after
        ``pause`` seconds. The old socket keeps its reader for a while: calls in flight on it still
        get their replies (routed by msgid), a refusal they follow in turn."""
        if self._socket is not None and self._reader is not None:
            self._retired.append((self._socket, self._reader))
        self._socket, self._reader = None, None
        while len(self._retired) > _RETIRED_MAX:
            self._close_socket(*self._retired.pop(0))
        if pause:
            await asyncio.sleep(pause)

    async def _attempt(self, msgid: int, payload: bytes, wait: float) -> Any:
        """The reply bytes to ``msgid``, or ``_TIMED_OUT``."""
        sock = self._connected()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending[msgid] = fut
        timer = loop.call_later(wait, _expire, fut)
        try:
            sent = asyncio.ensure_future(sock.send(payload))
            if not sent.done():  # no usable pipe yet (no high-water mark is set, so nothing else)
                await asyncio.wait((sent, fut), return_when=asyncio.FIRST_COMPLETED)
                if not sent.done():  # only the timer or close() ends fut before the send
                    sent.cancel()
            return await fut
        finally:
            timer.cancel()
            self._pending.pop(msgid, None)

    def _next_id(self) -> int:
        while True:
            msgid = next(self._ids) & wire.MAX_MSGID
            if msgid not in self._pending:  # after a wrap-around, skip ids still awaited
                return msgid

    def _connected(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # No high-water marks: the pending calls (each with its timeout) bound both queues.
            # A send limit would park calls in pyzmq's send queue, whose cost grows with its
            # length; a receive limit would only make the server drop replies in a burst.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            if self._curve is not None:
                apply_client(sock, *self._curve)
            sock.connect(self.endpoint)
            self._socket = sock
            self._reader = asyncio.get_running_loop().create_task(self._read(sock))
        return self._socket

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        """Route every reply to the future of its msgid; drop replies nobody awaits."""
        while True:
            data = await sock.recv()
            try:
                msgid = HEAD.decode(data).msgid
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue  # no msgid to route by: the caller's timeout reports it
            fut = self._pending.get(msgid)
            if fut is not None and not fut.done():
                fut.set_result(data)

    # --- typed methods: begin (generated by scripts/gen_aio_client from kvcm/client.py) ---
    # One method per RPC. Keyword arguments are the request's fields (docs/rpc.md); None means
    # "not sent", so the server's default applies. ``timeout`` is per attempt, as in call().

    # storages, instance groups, instances (admin except where said)
    async def add_storage(self, *, storage: dict[str, Any], adopt_directory: bool | None = None,
                          trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Add a storage (``{global_unique_name, storage_type, storage_spec}``); ``{"storage": ...}``."""
        return await self._typed("add_storage", AdminReply, timeout, storage=storage, adopt_directory=adopt_directory,
                                 trace_id=trace_id)

    async def update_storage(self, *, storage: dict[str, Any], force_update: bool | None = None,
                             trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Replace a storage's ``storage_spec`` (the whole spec); ``{"storage": ...}``."""
        return await self._typed("update_storage", AdminReply, timeout, storage=storage, force_update=force_update,
                                 trace_id=trace_id)

    async def enable_storage(self, *, storage_unique_name: str, trace_id: str | None = None,
                             timeout: float | None = None) -> AdminReply:
        """Turn a storage's admin switch on; ``{"storage": ...}``."""
        return await self._typed("enable_storage", AdminReply, timeout, storage_unique_name=storage_unique_name,
                                 trace_id=trace_id)

    async def disable_storage(self, *, storage_unique_name: str, trace_id: str | None = None,
                              timeout: float | None = None) -> AdminReply:
        """Turn a storage's admin switch off; ``{"storage": ...}``."""
        return await self._typed("disable_storage", AdminReply, timeout, storage_unique_name=storage_unique_name,
                                 trace_id=trace_id)

    async def remove_storage(self, *, storage_unique_name: str, trace_id: str | None = None,
                             timeout: float | None = None) -> AdminReply:
        """Remove a storage no instance group lists; ``{}``."""
        return await self._typed("remove_storage", AdminReply, timeout, storage_unique_name=storage_unique_name,
                                 trace_id=trace_id)

    async def list_storage(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Every storage; ``{"storage": [...]}``."""
        return await self._typed("list_storage", AdminReply, timeout, trace_id=trace_id)

    async def create_instance_group(self, *, instance_group: dict[str, Any], trace_id: str | None = None,
                                    timeout: float | None = None) -> AdminReply:
        """Create an instance group; ``{"instance_group": ...}`` at version 1."""
        return await self._typed("create_instance_group", AdminReply, timeout, instance_group=instance_group,
                                 trace_id=trace_id)

    async def update_instance_group(self, *, instance_group: dict[str, Any], current_version: int | None = None,
                                    expected_version: int | None = None, trace_id: str | None = None,
                                    timeout: float | None = None) -> AdminReply:
        """Merge a partial group into the stored one, compare-and-set on ``current_version``."""
        return await self._typed("update_instance_group", AdminReply, timeout, instance_group=instance_group,
                                 current_version=current_version, expected_version=expected_version, trace_id=trace_id)

    async def remove_instance_group(self, *, name: str, trace_id: str | None = None,
                                    timeout: float | None = None) -> AdminReply:
        """Remove a group no instance belongs to; ``{}``."""
        return await self._typed("remove_instance_group", AdminReply, timeout, name=name, trace_id=trace_id)

    async def get_instance_group(self, *, name: str, trace_id: str | None = None,
                                 timeout: float | None = None) -> AdminReply:
        """One group; ``{"instance_group": ...}``."""
        return await self._typed("get_instance_group", AdminReply, timeout, name=name, trace_id=trace_id)

    async def list_instance_groups(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Every group; ``{"instance_group": [...]}``."""
        return await self._typed("list_instance_groups", AdminReply, timeout, trace_id=trace_id)

    async def register_instance(self, *, instance_group: str, instance_id: str, block_size: int,
                                location_spec_infos: Sequence[SpecInfo | dict[str, Any]] | None = None,
                                model_deployment: ModelDeployment | dict[str, Any] | None = None,
                                location_spec_groups: Sequence[SpecGroup | dict[str, Any]] | None = None,
                                trace_id: str | None = None, timeout: float | None = None) -> Registered:
        """Register an instance, or attach to it (data plane; the same registration again gives
        ``created=False``). Fields left out (None) are not compared with a registered instance's;
        a new instance without ``location_spec_infos`` is router-only (engine tier only)."""
        return await self._typed("register_instance", Registered, timeout, instance_group=instance_group,
                                 instance_id=instance_id, block_size=block_size,
                                 location_spec_infos=_listed(location_spec_infos), model_deployment=model_deployment,
                                 location_spec_groups=_listed(location_spec_groups), trace_id=trace_id)

    async def get_instance_info(self, *, instance_id: str, instance_group: str | None = None,
                                trace_id: str | None = None, timeout: float | None = None) -> InstanceInfoReply:
        """One instance (data plane); INSTANCE_NOT_EXIST (a NotFound) for an unknown id."""
        return await self._typed("get_instance_info", InstanceInfoReply, timeout, instance_id=instance_id,
                                 instance_group=instance_group, trace_id=trace_id)

    async def get_storage_specs(self, *, instance_id: str, trace_id: str | None = None,
                                timeout: float | None = None) -> StorageSpecs:
        """The storages the instance may use, as a client needs them (data plane: what
        :mod:`kvcm.blocks` resolves URIs with)."""
        return await self._typed("get_storage_specs", StorageSpecs, timeout, instance_id=instance_id, trace_id=trace_id)

    async def list_instance_info(self, *, instance_group_name: str | None = None, trace_id: str | None = None,
                                 timeout: float | None = None) -> AdminReply:
        """The instances of one group (every group when not given); ``{"instance_info": [...]}``."""
        return await self._typed("list_instance_info", AdminReply, timeout, instance_group_name=instance_group_name,
                                 trace_id=trace_id)

    async def remove_instance(self, *, instance_id: str, instance_group: str | None = None,
                              trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Unregister an instance; its cached blocks are dropped afterwards. ``{}``."""
        return await self._typed("remove_instance", AdminReply, timeout, instance_id=instance_id,
                                 instance_group=instance_group, trace_id=trace_id)

    # accounts, snapshots, health
    async def add_account(self, *, user_name: str, password: str, role: str | None = None,
                          groups: Sequence[str] | None = None, trace_id: str | None = None,
                          timeout: float | None = None) -> AdminReply:
        """Add an account (role ``user`` unless given); ``{"account": ...}``."""
        return await self._typed("add_account", AdminReply, timeout, user_name=user_name, password=password, role=role,
                                 groups=_listed(groups), trace_id=trace_id)

    async def update_account(self, *, user_name: str, password: str | None = None, role: str | None = None,
                             groups: Sequence[str] | None = None, trace_id: str | None = None,
                             timeout: float | None = None) -> AdminReply:
        """Change an account's password, role or groups; ``{"account": ...}``."""
        return await self._typed("update_account", AdminReply, timeout, user_name=user_name, password=password, role=role,
                                 groups=_listed(groups), trace_id=trace_id)

    async def delete_account(self, *, user_name: str, trace_id: str | None = None,
                             timeout: float | None = None) -> AdminReply:
        """Delete an account (never the last admin); ``{}``."""
        return await self._typed("delete_account", AdminReply, timeout, user_name=user_name, trace_id=trace_id)

    async def list_account(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Every account (never a password); ``{"accounts": [...]}``."""
        return await self._typed("list_account", AdminReply, timeout, trace_id=trace_id)

    async def gen_config_snapshot(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The whole registry; ``{"config_snapshot": ...}`` (password hashes included)."""
        return await self._typed("gen_config_snapshot", AdminReply, timeout, trace_id=trace_id)

    async def load_config_snapshot(self, *, config_snapshot: dict[str, Any] | str, trace_id: str | None = None,
                                   timeout: float | None = None) -> AdminReply:
        """Replace the whole registry with a snapshot (a map or its JSON text); ``{"loaded": ...}``."""
        return await self._typed("load_config_snapshot", AdminReply, timeout, config_snapshot=config_snapshot,
                                 trace_id=trace_id)

    async def check_health(self, *, trace_id: str | None = None, timeout: float | None = None) -> Health:
        """Whether the server answers and its store reads; registry counts and storage states."""
        return await self._typed("check_health", Health, timeout, trace_id=trace_id)

    async def get_manager_cluster_info(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The (single) node, always the leader, with Tair's fields."""
        return await self._typed("get_manager_cluster_info", AdminReply, timeout, trace_id=trace_id)

    async def leader_demote(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The leader hands the lease over (never retried: each call is one step-down)."""
        return await self._typed("leader_demote", AdminReply, timeout, trace_id=trace_id)

    async def get_leader_elector_config(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """This node's ``campaign_delay_time_ms`` (and lease timings with the lease)."""
        return await self._typed("get_leader_elector_config", AdminReply, timeout, trace_id=trace_id)

    async def update_leader_elector_config(self, *, campaign_delay_time_ms: int, trace_id: str | None = None,
                                           timeout: float | None = None) -> AdminReply:
        """Change this node's ``campaign_delay_time_ms`` until its restart."""
        return await self._typed("update_leader_elector_config", AdminReply, timeout,
                                 campaign_delay_time_ms=campaign_delay_time_ms, trace_id=trace_id)

    # data plane
    async def get_cache_location(self, *, instance_id: str, query_type: QueryType | str, block_keys: Ints | None = None,
                                 token_ids: Ints | None = None, block_mask: Mask | None = None, sw_size: int | None = None,
                                 location_spec_names: Sequence[str] | None = None, include_engines: bool | None = None,
                                 lora_name: str | None = None, extra_keys: Sequence[Any] | None = None,
                                 mm_features: MmFeatures | None = None, cache_salt: str | None = None,
                                 trace_id: str | None = None, timeout: float | None = None) -> CacheLocations:
        """Locations of the blocks of ``block_keys`` or ``token_ids``: the matched prefix
        (``prefix_match``) or one entry per key (``batch_get``, ``reverse_roll_sw_match``)."""
        return await self._typed("get_cache_location", CacheLocations, timeout, instance_id=instance_id,
                                 query_type=query_type, block_keys=block_keys, token_ids=token_ids, block_mask=block_mask,
                                 sw_size=sw_size, location_spec_names=_listed(location_spec_names),
                                 include_engines=include_engines, lora_name=lora_name, extra_keys=_listed(extra_keys),
                                 mm_features=_listed(mm_features), cache_salt=cache_salt, trace_id=trace_id)

    async def get_cache_location_len(self, *, instance_id: str, query_type: QueryType | str, block_keys: Ints | None = None,
                                     token_ids: Ints | None = None, block_mask: Mask | None = None,
                                     sw_size: int | None = None, location_spec_names: Sequence[str] | None = None,
                                     extra_keys: Sequence[Any] | None = None, mm_features: MmFeatures | None = None,
                                     lora_name: str | None = None, cache_salt: str | None = None,
                                     trace_id: str | None = None, timeout: float | None = None) -> CacheLocationLen:
        """How many locations :meth:`get_cache_location` would answer, without them: for
        ``prefix_match`` the matched prefix in blocks (Tair's ``getCacheLocationLen``). The
        cheapest lookup on both sides: the reply is a few bytes, whatever the prompt."""
        return await self._typed("get_cache_location_len", CacheLocationLen, timeout, instance_id=instance_id,
                                 query_type=query_type, block_keys=block_keys, token_ids=token_ids, block_mask=block_mask,
                                 sw_size=sw_size, location_spec_names=_listed(location_spec_names),
                                 extra_keys=_listed(extra_keys), mm_features=_listed(mm_features), lora_name=lora_name,
                                 cache_salt=cache_salt, trace_id=trace_id)

    async def get_cache_meta(self, *, instance_id: str, block_keys: Ints | None = None, token_ids: Ints | None = None,
                             block_mask: Mask | None = None, detail_level: int | None = None,
                             extra_keys: Sequence[Any] | None = None, mm_features: MmFeatures | None = None,
                             lora_name: str | None = None, cache_salt: str | None = None, trace_id: str | None = None,
                             timeout: float | None = None) -> CacheMeta:
        """What kvcm knows of each key: one location and one :class:`BlockMeta` per request key."""
        return await self._typed("get_cache_meta", CacheMeta, timeout, instance_id=instance_id, block_keys=block_keys,
                                 token_ids=token_ids, block_mask=block_mask, detail_level=detail_level,
                                 extra_keys=_listed(extra_keys), mm_features=_listed(mm_features), lora_name=lora_name,
                                 cache_salt=cache_salt, trace_id=trace_id)

    async def start_write_cache(self, *, instance_id: str, block_keys: Ints | None = None, token_ids: Ints | None = None,
                                location_spec_group_names: Sequence[str] | None = None,
                                write_timeout_seconds: float | None = None, extra_keys: Sequence[Any] | None = None,
                                mm_features: MmFeatures | None = None, lora_name: str | None = None,
                                cache_salt: str | None = None, trace_id: str | None = None,
                                timeout: float | None = None) -> WriteSession:
        """Allocate space for the keys not there yet (never retried: a write is not idempotent)."""
        return await self._typed("start_write_cache", WriteSession, timeout, instance_id=instance_id,
                                 block_keys=block_keys, token_ids=token_ids,
                                 location_spec_group_names=_listed(location_spec_group_names),
                                 write_timeout_seconds=write_timeout_seconds, extra_keys=_listed(extra_keys),
                                 mm_features=_listed(mm_features), lora_name=lora_name, cache_salt=cache_salt,
                                 trace_id=trace_id)

    async def finish_write_cache(self, *, instance_id: str, write_session_id: str, success_blocks: Mask | None = None,
                                 locations: Sequence[Mapping[str, Any]] | None = None, trace_id: str | None = None,
                                 timeout: float | None = None) -> WriteFinished:
        """End a write session; ``success_blocks`` is indexed over the session's locations.
        ``locations``: Tair's clients echo the session's locations back (checked, not used)."""
        return await self._typed("finish_write_cache", WriteFinished, timeout, instance_id=instance_id,
                                 write_session_id=write_session_id, success_blocks=success_blocks,
                                 locations=_listed(locations), trace_id=trace_id)

    async def remove_cache(self, *, instance_id: str, block_keys: Ints | None = None, token_ids: Ints | None = None,
                           block_mask: Mask | None = None, extra_keys: Sequence[Any] | None = None,
                           mm_features: MmFeatures | None = None, lora_name: str | None = None,
                           cache_salt: str | None = None, trace_id: str | None = None,
                           timeout: float | None = None) -> Removed:
        """Mark every copy of the unmasked keys ``deleting``; the count of copies marked."""
        return await self._typed("remove_cache", Removed, timeout, instance_id=instance_id, block_keys=block_keys,
                                 token_ids=token_ids, block_mask=block_mask, extra_keys=_listed(extra_keys),
                                 mm_features=_listed(mm_features), lora_name=lora_name, cache_salt=cache_salt,
                                 trace_id=trace_id)

    async def report_lost(self, *, instance_id: str, block_keys: Ints | None = None, token_ids: Ints | None = None,
                          block_mask: Mask | None = None, extra_keys: Sequence[Any] | None = None,
                          mm_features: MmFeatures | None = None, lora_name: str | None = None,
                          cache_salt: str | None = None, trace_id: str | None = None, timeout: float | None = None) -> Lost:
        """Blocks this client could not read: they stop being served and are freed at once."""
        return await self._typed("report_lost", Lost, timeout, instance_id=instance_id, block_keys=block_keys,
                                 token_ids=token_ids, block_mask=block_mask, extra_keys=_listed(extra_keys),
                                 mm_features=_listed(mm_features), lora_name=lora_name, cache_salt=cache_salt,
                                 trace_id=trace_id)

    async def trim_cache(self, *, instance_id: str, strategy: TrimStrategy | str, begin_timestamp: int | None = None,
                         end_timestamp: int | None = None, trace_id: str | None = None,
                         timeout: float | None = None) -> Removed:
        """Drop an instance's blocks: all, all metadata, or by time (Unix microseconds)."""
        return await self._typed("trim_cache", Removed, timeout, instance_id=instance_id, strategy=strategy,
                                 begin_timestamp=begin_timestamp, end_timestamp=end_timestamp, trace_id=trace_id)

    async def pin_cache(self, *, instance_id: str, block_keys: Ints, ttl_seconds: float, trace_id: str | None = None,
                        timeout: float | None = None) -> Pinned:
        """Keep keys out of eviction for ``ttl_seconds`` (a soft pin)."""
        return await self._typed("pin_cache", Pinned, timeout, instance_id=instance_id, block_keys=block_keys,
                                 ttl_seconds=ttl_seconds, trace_id=trace_id)

    async def unpin_cache(self, *, instance_id: str, block_keys: Ints, trace_id: str | None = None,
                          timeout: float | None = None) -> Unpinned:
        """End the pins of ``block_keys``; the count of keys that were pinned."""
        return await self._typed("unpin_cache", Unpinned, timeout, instance_id=instance_id, block_keys=block_keys,
                                 trace_id=trace_id)

    # engine tier
    async def add_event_source(self, *, source_id: str, instance_id: str, endpoint: str | None = None,
                               replay_endpoint: str | None = None, host: str | None = None, port: int | None = None,
                               replay_port: int | None = None, replay: bool | None = None, topic: str | None = None,
                               dp_rank: int | None = None, replay_timeout_s: float | None = None,
                               backoff_initial_s: float | None = None, backoff_max_s: float | None = None,
                               poll_ms: int | None = None, report_mode: str | None = None, pod: str | None = None,
                               trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Add one engine event source (``endpoint`` or ``host``); ``{"source": ...}``. ``pod``: the
        pod a DP rank belongs to (``match_engines`` groups by it; absent, the source is its own)."""
        return await self._typed("add_event_source", AdminReply, timeout, source_id=source_id, instance_id=instance_id,
                                 endpoint=endpoint, replay_endpoint=replay_endpoint, host=host, port=port,
                                 replay_port=replay_port, replay=replay, topic=topic, dp_rank=dp_rank, pod=pod,
                                 replay_timeout_s=replay_timeout_s, backoff_initial_s=backoff_initial_s,
                                 backoff_max_s=backoff_max_s, poll_ms=poll_ms, report_mode=report_mode, trace_id=trace_id)

    async def remove_event_source(self, *, source_id: str, trace_id: str | None = None,
                                  timeout: float | None = None) -> AdminReply:
        """Remove a source and the blocks it held; ``{"source_id", "instance_id"}``."""
        return await self._typed("remove_event_source", AdminReply, timeout, source_id=source_id, trace_id=trace_id)

    async def list_event_sources(self, *, instance_id: str | None = None, trace_id: str | None = None,
                                 timeout: float | None = None) -> AdminReply:
        """The sources (of one instance, when given); ``{"sources": [...]}``."""
        return await self._typed("list_event_sources", AdminReply, timeout, instance_id=instance_id, trace_id=trace_id)

    async def match_engines(self, *, instance_id: str, token_ids: Ints | None = None, block_keys: Ints | None = None,
                            lora_name: str | None = None, media: Sequence[str] | None = None, medium: str | None = None,
                            group_idx: int | None = None, limit: int | None = None, top_k: int | None = None,
                            loads: Mapping[str, float] | None = None, include_stale: bool | None = None,
                            include_storage: bool | None = None, extra_keys: Sequence[Any] | None = None,
                            mm_features: MmFeatures | None = None, cache_salt: str | None = None,
                            trace_id: str | None = None, timeout: float | None = None) -> EngineMatches:
        """Per engine source and pod, the longest prefix of the query it holds, scored, best first
        (sources not heard for ``events.stale_after_s`` left out unless ``include_stale``;
        ``include_storage`` adds kvcm's own storage tier as ``storage``). The prompt's extra keys
        (an image, a salt) as vLLM sends them per block (``extra_keys``), or ``mm_features``,
        ``lora_name`` and ``cache_salt``, enter the keys of ``token_ids``."""
        return await self._typed("match_engines", EngineMatches, timeout, instance_id=instance_id, token_ids=token_ids,
                                 block_keys=block_keys, lora_name=lora_name, media=_listed(media), medium=medium,
                                 group_idx=group_idx, limit=limit, top_k=top_k,
                                 loads=None if loads is None else dict(loads), include_stale=include_stale,
                                 include_storage=include_storage, extra_keys=_listed(extra_keys),
                                 mm_features=_listed(mm_features), cache_salt=cache_salt, trace_id=trace_id)

    async def note_routed(self, *, instance_id: str, source_id: str, token_ids: Ints | None = None,
                          block_keys: Ints | None = None, ttl_s: float | None = None, lora_name: str | None = None,
                          extra_keys: Sequence[Any] | None = None, mm_features: MmFeatures | None = None,
                          cache_salt: str | None = None, trace_id: str | None = None,
                          timeout: float | None = None) -> Routed:
        """The router sent this prompt to ``source_id``: count its blocks there, ``speculative``,
        until the engine's event confirms them or ``ttl_s`` ends."""
        return await self._typed("note_routed", Routed, timeout, instance_id=instance_id, source_id=source_id,
                                 token_ids=token_ids, block_keys=block_keys, ttl_s=ttl_s, lora_name=lora_name,
                                 extra_keys=_listed(extra_keys), mm_features=_listed(mm_features), cache_salt=cache_salt,
                                 trace_id=trace_id)

    async def get_host_cache_state(self, *, instance_id: str, block_cache_keys: Ints | None = None,
                                   block_keys: Ints | None = None, token_ids: Ints | None = None,
                                   medium: Sequence[str] | None = None, top_k: int | None = None,
                                   loads: Mapping[str, float] | None = None, include_stale: bool | None = None,
                                   include_storage: bool | None = None, lora_name: str | None = None,
                                   extra_keys: Sequence[Any] | None = None, mm_features: MmFeatures | None = None,
                                   cache_salt: str | None = None, query_type: str | int | None = None,
                                   p2p_host_count: int | None = None, trace_id: str | None = None,
                                   timeout: float | None = None) -> HostCacheState:
        """Tair KVCM's ``GetHostCacheState``: per host (pod), local and global prefix hits
        (``query_type``: prefix matching only; ``p2p_host_count``: accepted, not used)."""
        return await self._typed("get_host_cache_state", HostCacheState, timeout, instance_id=instance_id,
                                 query_type=query_type, p2p_host_count=p2p_host_count,
                                 block_cache_keys=block_cache_keys, block_keys=block_keys, token_ids=token_ids,
                                 medium=_listed(medium), top_k=top_k, loads=None if loads is None else dict(loads),
                                 include_stale=include_stale, include_storage=include_storage, lora_name=lora_name,
                                 extra_keys=_listed(extra_keys), mm_features=_listed(mm_features), cache_salt=cache_salt,
                                 trace_id=trace_id)

    async def report_events(self, *, source_id: str, op: ReportOp, generation: int | None = None,
                            instance_id: str | None = None, dp_rank: int | None = None, pod: str | None = None, medium: str | None = None, report_mode: str | None = None, seq: int | None = None,
                            ts: float | None = None, events: Sequence[dict[str, Any]] | None = None,
                            payloads: Sequence[dict[str, Any]] | None = None, trace_id: str | None = None,
                            timeout: float | None = None) -> EventsReported:
        """A push source's report (docs/engines.md#push-ingestion): ``register``, ``heartbeat``,
        ``payloads`` (``[{"seq", "payload"}]``, vLLM-encoded), ``events`` / ``snapshot`` (decoded
        ``add`` / ``remove`` / ``clear`` events) or ``down``; ``resync`` in the reply asks for a snapshot."""
        return await self._typed("report_events", EventsReported, timeout, source_id=source_id, op=op,
                                 generation=generation, instance_id=instance_id, dp_rank=dp_rank, pod=pod, medium=medium, report_mode=report_mode,
                                 seq=seq, ts=ts, events=_listed(events), payloads=_listed(payloads), trace_id=trace_id)

    # system, tokens
    async def get_metrics(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The numbers of ``/metrics`` as a map (admin)."""
        return await self._typed("get_metrics", AdminReply, timeout, trace_id=trace_id)

    async def add_token(self, *, user_name: str, name: str | None = None, ttl_seconds: float | None = None,
                        trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """A new API token of ``user_name``, shown once (admin)."""
        return await self._typed("add_token", AdminReply, timeout, user_name=user_name, name=name, ttl_seconds=ttl_seconds,
                                 trace_id=trace_id)

    async def revoke_token(self, *, token_id: str, trace_id: str | None = None,
                           timeout: float | None = None) -> AdminReply:
        """Revoke an API token (admin)."""
        return await self._typed("revoke_token", AdminReply, timeout, token_id=token_id, trace_id=trace_id)

    async def list_tokens(self, *, user_name: str | None = None, trace_id: str | None = None,
                          timeout: float | None = None) -> AdminReply:
        """API tokens (of one account, when given): ids, owners, labels, times (admin)."""
        return await self._typed("list_tokens", AdminReply, timeout, user_name=user_name, trace_id=trace_id)

    async def whoami(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The caller's account, role, groups and how it authenticated."""
        return await self._typed("whoami", AdminReply, timeout, trace_id=trace_id)

    # --- typed methods: end ---


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(_TIMED_OUT)


__all__ = ["METHODS", "Client"]

"""asyncio kvcm client: one DEALER socket, many requests in flight, replies matched by msgid.

>>> async with kvcm.aio.Client("tcp://127.0.0.1:6381") as kv:          # doctest: +SKIP
...     health = await kv.check_health()

The same typed surface as :class:`kvcm.Client` (same method names, keyword arguments and
:mod:`kvcm.proto.results` structs; both generated from the protocol by ``scripts/gen_client``,
:mod:`kvcm.aio_methods`), plus ``call()``. Many calls may be awaited at once from one
task (``asyncio.gather``): each request gets a msgid, a reader task routes every reply to the
future of its msgid, and a reply nobody awaits any more (a late reply to a timed-out attempt)
is dropped. ``timeout`` is per attempt; a call with no reply in time raises
:class:`~kvcm.errors.Unavailable` with code ``TIMEOUT``. Only idempotent methods are retried,
under a new msgid, so a late reply to the first attempt cannot be taken for the retry's.
:meth:`Client.close` fails every pending call with ``Unavailable`` (``SHUTTING_DOWN``).
One client belongs to one event loop. Several endpoints and ``SERVER_NOT_LEADER`` are handled
as by :class:`kvcm.Client` (follow the leader for any method; on a timeout, the next endpoint),
and so is ``read_from="any"`` (reads spread over the nodes, each over a socket of its own).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from kvcm.aio_methods import AsyncClientMethods
from kvcm.client import (
    DISCOVER_S,
    IDEMPOTENT_METHODS,
    METHODS,
    READER_CONNECT_S,
    ClientState,
    CurveClientKeys,
    Endpoints,
    Spread,
    _Skip,
    add_members,
    build_request,
    check_read_from,
    decode_reply,
    drop_unset,
    elsewhere,
    follows_leader,
    timeout_error,
)
from kvcm.client_shards import MAP_WAIT_S, MAX_REDIRECTS, Routes, applied_everywhere, merge, redirected, serves
from kvcm.errors import Code, InvalidArgument, KvcmError, Unavailable
from kvcm.proto import wire
from kvcm.proto.methods import FOLLOWER_READS
from kvcm.proto.results import HEAD, Envelope, decoder
from kvcm.proto.shards import ShardInfo
from kvcm.rpc.curve import KeyPair, apply_client, client_keypair, load_public_key

T = TypeVar("T")

class _TimedOut:
    """What a timer puts in a pending future when its attempt ran out of time."""


_TIMED_OUT = _TimedOut()
#: A pending call's future: the reply's bytes, or _TIMED_OUT.
Pending = asyncio.Future[bytes | _TimedOut]
#: Sockets left behind by moving to another server, kept reading for calls still in flight on them.
_RETIRED_MAX = 2


class Client(AsyncClientMethods):
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
        read_from: str = "leader",
        routed: bool = True,
    ) -> None:
        """``read_from``: ``"leader"``, or ``"any"`` to spread reads over the nodes; ``routed``:
        follow ``WRONG_SHARD`` to the owning shard (both as :class:`kvcm.Client`)."""
        self._options: dict[str, Any] = dict(timeout=timeout, retries=retries, auth=auth, context=context,
                                             curve_server_key=curve_server_key,
                                             curve_client_keys=curve_client_keys, read_from=read_from)
        self._routes: Routes | None = Routes() if routed else None
        self._shard_clients: dict[str, Client] = {}
        check_read_from(read_from)
        self.endpoints = Endpoints(endpoint)
        self.read_from = read_from
        self._spread = Spread(self.endpoints) if read_from == "any" else None
        self._readers: dict[str, tuple[zmq.asyncio.Socket, asyncio.Task[None]]] = {}
        self._discover_at = 0.0
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
        self._pending: dict[int, Pending] = {}
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
        shards, self._shard_clients = list(self._shard_clients.values()), {}
        for shard in shards:
            await shard.close()
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
        for endpoint in list(self._readers):
            self._drop_reader(endpoint)
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
        params: Mapping[str, object] | None = None,
        timeout: float | None = None,
        retry: bool | None = None,
    ) -> Any:
        """Send one request and return its result map; raise the mapped KvcmError on error."""
        may_retry = method in IDEMPOTENT_METHODS if retry is None else retry
        sent = dict(params or {})
        if self._routes is None:
            return await self._request(method, sent, decoder(object), timeout, may_retry)
        return await self._routed(method, sent, lambda c: c._request(method, sent, decoder(object), timeout, may_retry))

    async def _typed(self, method: str, reply: type[T], timeout: float | None, **params: object) -> T:
        sent = drop_unset(params)
        may_retry = method in IDEMPOTENT_METHODS
        if self._routes is None:
            return await self._request(method, sent, decoder(reply), timeout, may_retry)
        return await self._routed(method, sent, lambda c: c._request(method, sent, decoder(reply), timeout, may_retry))

    async def _routed(self, method: str, params: Mapping[str, object],
                      once: Callable[[Client], Awaitable[T]]) -> T:
        """As :meth:`kvcm.Client._routed`: to the call's shard, following ``WRONG_SHARD``."""
        routes = self._routes
        assert routes is not None  # internal: only a routed client
        key = routes.fans_out(method, params)
        everywhere = routes.everywhere(method)
        if (key is not None or everywhere) and routes.map_due():
            await self._take_map(routes)
        if key is not None and routes.shards:
            replies = [await once(self._shard_client(s)) for s in sorted(routes.shards.values())]
            return merge(list(replies), key)  # type: ignore[return-value]
        if everywhere and routes.shards:
            return await self._everywhere(routes, once)
        shard = routes.shard_for(method, params)
        target = self if shard is None or key is not None else self._shard_client(shard)
        for redirects in range(MAX_REDIRECTS + 1):
            try:
                return await once(target)
            except KvcmError as exc:
                if not redirected(exc) or redirects == MAX_REDIRECTS:
                    raise
                shard = routes.learn(exc)
                if shard is None:
                    raise
                if not routes.mapped:  # sharded after all: the seeds' shard's other nodes, once
                    await self._take_map(routes)
                target = self._shard_client(shard)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def _everywhere(self, routes: Routes, once: Callable[[Client], Awaitable[T]]) -> T:
        """A change of what every shard keeps a copy of: sent to each (:meth:`kvcm.Client._fan_out`)."""
        outcomes: list[tuple[str, object | KvcmError]] = []
        for shard in sorted(routes.shards.values()):
            try:
                outcomes.append((shard.name, await once(self._shard_client(shard))))
            except KvcmError as exc:
                outcomes.append((shard.name, exc))
        got = applied_everywhere(outcomes)
        if isinstance(got, KvcmError):
            raise got
        return got  # type: ignore[return-value]

    async def _take_map(self, routes: Routes) -> None:
        try:
            reply = await self._request("get_shard_map", {}, decoder(object), min(self.timeout, MAP_WAIT_S), True)
        except KvcmError:
            reply = None
        routes.take_map(reply, self.endpoints.all)

    def _shard_client(self, shard: ShardInfo) -> Client:
        known = self._shard_clients.get(shard.name)
        if known is not None and serves(shard, known.endpoints.all):
            return known
        if known is not None:
            self._retire_client(known)
        client = self._shard_clients[shard.name] = Client(list(shard.endpoints), routed=False, **self._options)
        return client

    @staticmethod
    def _retire_client(client: Client) -> None:
        """A shard's client replaced by one of its new nodes: closed off the caller's path."""
        asyncio.get_running_loop().create_task(client.close())

    async def _request(self, method: str, params: dict[str, object], dec: msgspec.msgpack.Decoder[Envelope[T]],
                       timeout: float | None, may_retry: bool) -> T:
        if self.state is ClientState.CLOSED:
            raise RuntimeError("client is closed")
        wait = self.timeout if timeout is None else timeout
        if self._spread is not None and method in FOLLOWER_READS:
            spread = await self._read_spread(method, params, dec, wait)
            if not isinstance(spread, _TimedOut):
                return spread
        attempts = 1 + (self.retries if may_retry else 0)
        timeouts = follows = 0
        while True:
            # A new msgid per attempt: the first attempt's late reply finds no future and is dropped.
            msgid = self._next_id()
            payload = build_request(method, msgid, params, self.auth)
            sent_to = self.endpoint
            data = await self._attempt(msgid, payload, wait)
            if not isinstance(data, _TimedOut):
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

    async def _read_spread(self, method: str, params: dict[str, object],
                           dec: msgspec.msgpack.Decoder[Envelope[T]], wait: float) -> T | _TimedOut:
        """One read over the nodes in turn (``read_from="any"``): the first answer, or
        ``_TIMED_OUT`` when no node answered it (the leader path takes it then)."""
        assert self._spread is not None  # internal: only with read_from="any"
        if asyncio.get_running_loop().time() >= self._discover_at:
            await self._discover()
        for endpoint in self._spread.order():
            msgid = self._next_id()
            payload = build_request(method, msgid, params, self.auth)
            data = await self._attempt(msgid, payload, wait, self._read_socket(endpoint))
            if not isinstance(data, _TimedOut):
                try:
                    return decode_reply(dec, data, msgid)
                except KvcmError as exc:
                    if not elsewhere(exc):
                        raise
                except _Skip:
                    pass
            self._spread.failed(endpoint)
            self._drop_reader(endpoint)
        return _TIMED_OUT

    async def _discover(self) -> None:
        """Add the nodes the deployment lists to the endpoints reads go to (:class:`kvcm.Client`)."""
        self._discover_at = asyncio.get_running_loop().time() + DISCOVER_S
        try:
            info = await self.call("get_manager_cluster_info", timeout=min(self.timeout, MAP_WAIT_S), retry=False)
        except KvcmError:
            return
        add_members(self.endpoints, info)

    def _read_socket(self, endpoint: str) -> zmq.asyncio.Socket:
        """The socket reads to ``endpoint`` use (queueing nothing while it is not connected)."""
        found = self._readers.get(endpoint)
        if found is None:
            sock = self._open(endpoint, immediate=True)
            found = self._readers[endpoint] = (sock, asyncio.get_running_loop().create_task(self._read(sock)))
        return found[0]

    def _drop_reader(self, endpoint: str) -> None:
        found = self._readers.pop(endpoint, None)
        if found is not None:
            self._close_socket(*found)

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

    async def _attempt(self, msgid: int, payload: bytes, wait: float,
                       reader: zmq.asyncio.Socket | None = None) -> bytes | _TimedOut:
        """The reply bytes to ``msgid``, or ``_TIMED_OUT``. ``reader``: a node's read socket,
        whose connection is waited for :data:`~kvcm.client.READER_CONNECT_S` at most."""
        sock = reader or self._connected()
        loop = asyncio.get_running_loop()
        fut: Pending = loop.create_future()
        self._pending[msgid] = fut
        timer = loop.call_later(wait, _expire, fut)
        try:
            sent = asyncio.ensure_future(sock.send(payload))
            if not sent.done():  # no usable pipe yet (no high-water mark is set, so nothing else)
                connect = min(wait, READER_CONNECT_S) if reader is not None else None
                await asyncio.wait((sent, fut), timeout=connect, return_when=asyncio.FIRST_COMPLETED)
                if not sent.done():  # the timer, close() or the reader's connect wait came first
                    sent.cancel()
                    if not fut.done():
                        return _TIMED_OUT
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
            sock = self._socket = self._open(self.endpoint)
            self._reader = asyncio.get_running_loop().create_task(self._read(sock))
        return self._socket

    def _open(self, endpoint: str, immediate: bool = False) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # No high-water marks: the pending calls (each with its timeout) bound both queues.
        # A send limit would park calls in pyzmq's send queue, whose cost grows with its
        # length; a receive limit would only make the server drop replies in a burst.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if immediate:  # queue nothing for a node not connected (yet): its reads go elsewhere
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if self._curve is not None:
            apply_client(sock, *self._curve)
        sock.connect(endpoint)
        return sock

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


def _expire(fut: Pending) -> None:
    if not fut.done():
        fut.set_result(_TIMED_OUT)


__all__ = ["METHODS", "Client"]

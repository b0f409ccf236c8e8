"""Synchronous kvcm client: one DEALER socket, request ids, per-call timeouts, safe retries.

>>> with Client("tcp://127.0.0.1:6381") as kv:          # doctest: +SKIP
...     kv.call("check_health")
...     kv.get_cache_location(instance_id="llm", query_type="prefix_match", block_keys=[1, 2])
{'status': 'ok', ...}
CacheLocations(locations=[...])

Besides the generic :meth:`Client.call` (a plain map back), there is one typed method per RPC,
with the request's fields as keyword arguments and a :mod:`kvcm.proto.results` Struct (or, for the
open-ended admin replies, a dict) as its result, decoded straight from the reply's bytes
(docs/client.md). The typed methods are generated from the protocol's method table and request
Structs (:mod:`kvcm.client_methods`, ``scripts/gen_client``); :mod:`kvcm.aio` has the same
methods for asyncio.

Errors come back as :class:`~kvcm.errors.KvcmError` subclasses, mapped in one place
(:func:`kvcm.errors.error_from_wire`). A call that gets no reply in time raises
:class:`~kvcm.errors.Unavailable` with code ``TIMEOUT``. Only idempotent methods are retried
(Lazy Pirate: drop the socket, reconnect, resend); a write such as ``start_write_cache`` is
never sent twice behind the caller's back. Not thread-safe: one client per thread.

Several servers (the leader lease, docs/ha.md): ``Client(["tcp://a:6381", "tcp://b:6381"])``
or ``"tcp://a:6381,tcp://b:6381"``. A ``SERVER_NOT_LEADER`` answer is followed for any method
(the follower refused before executing anything): to the ``leader_endpoint`` it names, else to
the next endpoint after a short pause, and the request is sent again there. A timeout moves to
the next endpoint; only an idempotent call is resent after one.

Reads from followers: with ``read_from="any"`` the reads every node answers
(:data:`kvcm.proto.methods.FOLLOWER_READS`) go to the given endpoints in turn, leader included,
each over a connection of its own; everything else goes to the leader as above. A node that does
not answer a read in time, or refuses to serve it (not ready, not serving reads, shutting down),
is left out of the turn for :data:`READER_DOWN_S` and the read is sent to the next node; when
none is left, to the leader. The nodes a deployment lists (``get_manager_cluster_info``'s
``members``) are added to the given endpoints, asked every :data:`DISCOVER_S`. A follower's
read sees every write acknowledged before it was sent (docs/ha.md).

CURVE (a server with ``server.curve_secret_key_file``): pass ``curve_server_key`` (the server's
public key: z85 text or its ``.key`` certificate file) and ``curve_client_keys`` (this client's
secret certificate file, or a ``(public, secret)`` pair); without client keys an ephemeral pair
is made, which only a server admitting any key accepts. A refused CURVE handshake is silent in
ZeroMQ, so it surfaces as the ``TIMEOUT`` error, whose message then says so.
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import zmq

from kvcm.client_methods import ClientMethods
from kvcm.client_shards import MAP_WAIT_S, MAX_REDIRECTS, Routes, applied_everywhere, merge, redirected, serves
from kvcm.errors import Code, InvalidArgument, KvcmError, ServerError, Unavailable, error_from_wire
from kvcm.proto import methods, wire
from kvcm.proto.methods import FOLLOWER_READS
from kvcm.proto.results import HEAD, Envelope, decoder
from kvcm.proto.shards import ShardInfo
from kvcm.rpc.curve import KeyPair, apply_client, client_keypair, load_public_key

CurveClientKeys = str | os.PathLike[str] | tuple[str | bytes, str | bytes] | KeyPair

#: Every RPC method the server answers (``kvcm call --help`` lists them): the names of the
#: protocol's method table, which a test holds equal to the running server's.
METHODS: tuple[str, ...] = tuple(sorted(methods.METHODS))

#: Methods that may be re-sent after a timeout without changing the outcome.
IDEMPOTENT_METHODS: frozenset[str] = methods.IDEMPOTENT


T = TypeVar("T")

# One encoder for every request: msgspec writes the envelope and its params (dicts, lists,
# Structs such as Mask) in one C call, into a fresh bytes of the exact size.
_ENCODER = msgspec.msgpack.Encoder()


def build_request(method: str, msgid: int, params: dict[str, object], auth: dict[str, str] | None) -> bytes:
    """``[0, msgid, method, [params]]`` as bytes; params the server cannot get are InvalidArgument."""
    if auth is not None and "auth" not in params:
        params["auth"] = auth
    try:
        return _ENCODER.encode((wire.REQUEST, msgid, method, (params,)))
    except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as exc:  # e.g. an int beyond 64 bits
        raise InvalidArgument(f"{method}: params cannot be sent: {type(exc).__name__}: {exc}") from None


def drop_unset(params: Mapping[str, object]) -> dict[str, object]:
    """A typed method's keyword arguments as request params: ``None`` means "not sent"."""
    return {k: v for k, v in params.items() if v is not None}


class _Skip(Exception):
    """The reply is not the one awaited (a late reply to an earlier, timed-out request)."""


def decode_reply(dec: msgspec.msgpack.Decoder[Envelope[T]], payload: bytes, msgid: int) -> T:
    """The result of the reply to ``msgid`` decoded with ``dec``; raises the mapped KvcmError,
    :class:`ServerError` for a malformed reply, and ``_Skip`` for a reply to another msgid."""
    try:
        env = dec.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        if _peek_msgid(payload) not in (msgid, None):
            raise _Skip from None  # another request's reply, of another shape
        raise ServerError(f"malformed reply from server: {exc}") from None
    if env.msgid != msgid:
        raise _Skip
    if env.error is not None:
        raise error_from_wire(env.error)
    if env.kind != wire.RESPONSE or env.result is None:
        raise ServerError("malformed reply from server: expected [1, msgid, error, result]")
    return env.result


def _peek_msgid(payload: bytes) -> int | None:
    try:
        return HEAD.decode(payload).msgid
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def timeout_error(method: str, endpoint: str, wait: float, attempts: int, curve: bool) -> Unavailable:
    why = "; CURVE handshake failed or server unreachable" if curve else ""
    return Unavailable(
        f"no reply to {method} from {endpoint} within {wait:g}s ({attempts} attempt(s)){why}", Code.TIMEOUT
    )


#: How many ``SERVER_NOT_LEADER`` answers one call follows before it gives up (a failover
#: without a leader lasts about ``ha.lease_ms + ha.renew_ms``; the pauses below outlast it).
MAX_FOLLOWS = 40
#: The longest pause before resending when no leader is known (it grows from 20 ms).
FOLLOW_PAUSE_MAX_S = 0.25


class Endpoints:
    """The servers a client may talk to and the one it talks to now (``current``)."""

    def __init__(self, endpoint: str | Sequence[str]) -> None:
        items = endpoint.split(",") if isinstance(endpoint, str) else list(endpoint)
        self.all = [e.strip() for e in items if isinstance(e, str) and e.strip()]
        if not self.all:
            raise InvalidArgument("no endpoint given")
        self.current = self.all[0]

    def rotate(self) -> bool:
        """Move to the next endpoint; False when there is only one."""
        if len(self.all) < 2:
            return False
        at = self.all.index(self.current) if self.current in self.all else -1
        self.current = self.all[(at + 1) % len(self.all)]
        return True

    def follow(self, exc: KvcmError, follows: int) -> float:
        """Move to where a ``SERVER_NOT_LEADER`` points; returns the pause before resending."""
        leader = exc.detail.get("leader_endpoint", "")
        if leader and leader != self.current:
            if leader not in self.all:
                self.all.append(leader)
            self.current = leader
            return 0.0 if follows < 2 else min(0.02 * 1.5 ** follows, FOLLOW_PAUSE_MAX_S)
        self.rotate()  # no leader known now (a failover): ask the others, a little later each time
        return min(0.02 * 1.5 ** follows, FOLLOW_PAUSE_MAX_S)


def follows_leader(exc: KvcmError, follows: int) -> bool:
    """This error is a refusal a call follows (not yet too many times)."""
    return exc.code is Code.SERVER_NOT_LEADER and follows < MAX_FOLLOWS


#: How long a node that failed a read (no answer in time, or a refusal to serve it) is left out
#: of the spread of reads (``read_from="any"``).
READER_DOWN_S = 2.0
#: How long a read waits for a node's connection before asking the next one: a node that is
#: down is passed over at once instead of after the call's whole timeout.
READER_CONNECT_S = 0.25
#: How often a client spreading reads asks for the deployment's nodes (seconds): nodes that
#: joined since are read from after at most this long.
DISCOVER_S = 10.0
#: Endpoints a client spreads reads over at most (the given ones and those discovered).
MAX_READERS = 64
#: Refusals of a read that say "not here" rather than "not at all": the next node is asked.
_ELSEWHERE = frozenset({Code.SERVICE_NOT_READY, Code.SERVER_NOT_LEADER, Code.SHUTTING_DOWN})


def add_members(endpoints: Endpoints, info: object) -> None:
    """Add the nodes a ``get_manager_cluster_info`` reply lists (``members``) to ``endpoints``
    (``tcp://`` and ``ipc://`` ones, up to :data:`MAX_READERS` in all)."""
    members = info.get("members") if isinstance(info, dict) else None
    for member in members if isinstance(members, list) else []:
        endpoint = member.get("endpoint") if isinstance(member, dict) else None
        if (isinstance(endpoint, str) and endpoint.startswith(("tcp://", "ipc://"))
                and endpoint not in endpoints.all and len(endpoints.all) < MAX_READERS):
            endpoints.all.append(endpoint)


def check_read_from(read_from: str) -> None:
    if read_from not in ("leader", "any"):
        raise InvalidArgument(f"read_from: must be 'leader' or 'any', got {read_from!r}")


def elsewhere(exc: KvcmError) -> bool:
    """A refusal of a read that says "not here" rather than "not at all": ask the next node."""
    return exc.code in _ELSEWHERE


class Spread:
    """Which node a read goes to (``read_from="any"``): the endpoints in turn, minus those that
    failed a read within :data:`READER_DOWN_S`."""

    def __init__(self, endpoints: Endpoints) -> None:
        self._endpoints = endpoints
        self._turn = 0
        self._down: dict[str, float] = {}

    def order(self) -> list[str]:
        """The nodes to try for the next read, the next one in turn first."""
        nodes = self._endpoints.all
        if self._down:  # the turn goes round the nodes still up, so each keeps an even share
            now = time.monotonic()
            nodes = [e for e in nodes if self._down.get(e, 0.0) <= now]
            if not nodes:
                return []
        start = self._turn % len(nodes)
        self._turn += 1
        return nodes[start:] + nodes[:start]

    def failed(self, endpoint: str) -> None:
        self._down[endpoint] = time.monotonic() + READER_DOWN_S


class _Link:
    """One DEALER socket, the receive timeout set on it, and how long a send waits for its
    connection (``connect_s``; a reader's is short: another node can answer)."""

    __slots__ = ("connect_s", "rcvtimeo", "sock")

    def __init__(self, sock: zmq.Socket[bytes], connect_s: float = float("inf")) -> None:
        self.sock = sock
        self.connect_s = connect_s
        self.rcvtimeo = -1  # -1: none set


class ClientState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Client(ClientMethods):
    """A connection to a kvcm server (the leader of several). Use as a context manager, or call
    :meth:`close`."""

    def __init__(
        self,
        endpoint: str | Sequence[str] = "tcp://127.0.0.1:6381",
        timeout: float = 5.0,
        retries: int = 2,
        auth: dict[str, str] | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        curve_server_key: str | bytes | os.PathLike[str] | None = None,
        curve_client_keys: CurveClientKeys | None = None,
        routing_id_prefix: bytes = b"",
        read_from: str = "leader",
        routed: bool = True,
    ) -> None:
        """``routing_id_prefix``: the socket's ZeroMQ routing id starts with it (then random
        bytes); kvcm's own relays use :data:`kvcm.proto.wire.RELAY_ID_PREFIX`. ``read_from``:
        ``"leader"``, or ``"any"`` to spread reads over the endpoints (see the module doc).
        ``routed``: follow ``WRONG_SHARD`` to the shard that owns a call's instance or group
        (:mod:`kvcm.client_shards`); False: raise it (a client of one shard's nodes)."""
        self._options: dict[str, Any] = dict(
            timeout=timeout, retries=retries, auth=auth, context=context, curve_server_key=curve_server_key,
            curve_client_keys=curve_client_keys, routing_id_prefix=routing_id_prefix, read_from=read_from)
        check_read_from(read_from)
        self.endpoints = Endpoints(endpoint)
        self.read_from = read_from
        self._spread = Spread(self.endpoints) if read_from == "any" else None
        self._readers: dict[str, _Link] = {}
        self._discover_at = 0.0  # monotonic: when a spreading client asks for the nodes again
        self._routing_prefix = routing_id_prefix
        self._curve: tuple[bytes, KeyPair] | None = None
        if curve_server_key is not None:
            self._curve = (load_public_key(curve_server_key), client_keypair(curve_client_keys))
        elif curve_client_keys is not None:
            raise InvalidArgument("curve_client_keys need curve_server_key (the server's public key)")
        self.timeout = timeout
        self.retries = retries
        self.auth = auth
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "big"))
        self._link: _Link | None = None  # to the current endpoint
        #: a sharded deployment's shards this client learnt of (None: a client of one shard)
        self._routes: Routes | None = Routes() if routed else None
        self._shard_clients: dict[str, Client] = {}
        self.state = ClientState.OPEN

    @property
    def endpoint(self) -> str:
        """The server this client talks to now."""
        return self.endpoints.current

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent; the client refuses calls afterwards."""
        for shard in list(self._shard_clients.values()):
            shard.close()
        self._shard_clients.clear()
        self._drop_socket()
        for endpoint in list(self._readers):
            self._drop_reader(endpoint)
        self.state = ClientState.CLOSED

    def call(
        self,
        method: str,
        params: Mapping[str, object] | None = None,
        timeout: float | None = None,
        retry: bool | None = None,
    ) -> Any:
        """Send one request and return its result map; raise the mapped KvcmError on error."""
        if self._routes is None:
            return self._call_here(method, params, timeout, retry)
        return self._routed(method, params or {}, lambda c: c._call_here(method, params, timeout, retry))

    def _call_here(self, method: str, params: Mapping[str, object] | None, timeout: float | None,
                   retry: bool | None) -> Any:
        if self.state is ClientState.CLOSED:
            raise RuntimeError("client is closed")
        sent = dict(params or {})
        if self.auth is not None and "auth" not in sent:
            sent["auth"] = self.auth
        msgid = next(self._ids) & wire.MAX_MSGID
        try:
            payload = wire.pack_request(msgid, method, sent)
        except (OverflowError, TypeError, ValueError) as exc:  # e.g. an int beyond 64 bits
            raise InvalidArgument(f"{method}: params cannot be sent: {type(exc).__name__}: {exc}") from None
        may_retry = method in IDEMPOTENT_METHODS if retry is None else retry
        wait = self.timeout if timeout is None else timeout

        if self._spread is not None and method in FOLLOWER_READS:
            spread = self._read_spread(lambda link: _here(self._roundtrip(payload, msgid, wait, link)))
            if not isinstance(spread, _NoReply):
                return _result(spread)

        def once() -> object:
            reply = self._roundtrip(payload, msgid, wait)
            return _NO_REPLY if reply is None else _result(reply)
        return self._send_until_answered(method, once, may_retry, wait)

    def _read_spread(self, exchange: Callable[[_Link], T | None]) -> T | _NoReply:
        """One read over the nodes in turn (``read_from="any"``): the first answer, or
        ``_NO_REPLY`` when no node answered it (the leader path takes it then)."""
        assert self._spread is not None  # internal: only with read_from="any"
        if time.monotonic() >= self._discover_at:
            self._discover()
        for endpoint in self._spread.order():
            link = self._reader(endpoint)
            if link is None:
                got = None
            else:
                try:
                    got = exchange(link)
                except KvcmError as exc:
                    if not elsewhere(exc):
                        raise
                    got = None
            if got is not None:
                return got
            self._spread.failed(endpoint)
            self._drop_reader(endpoint)  # a late reply must not be read as the next call's
        return _NO_REPLY

    def _send_until_answered(self, method: str, once: Callable[[], T | _NoReply], may_retry: bool, wait: float,
                             first: T | _NoReply | KvcmError | None = None) -> T:
        """Run ``once`` (one send and wait) until it answers: a timeout is retried (when
        ``may_retry``) on the next endpoint, a ``SERVER_NOT_LEADER`` is followed. ``first``: the
        outcome of an attempt already made (``_NO_REPLY`` or the refusal), None = none made."""
        attempts = 1 + (self.retries if may_retry else 0)
        timeouts = follows = 0
        while True:
            try:
                if first is None:
                    got = once()
                else:
                    earlier, first = first, None
                    if isinstance(earlier, KvcmError):
                        raise earlier
                    got = earlier
            except KvcmError as exc:
                if not follows_leader(exc, follows):
                    raise
                self._drop_socket()  # a late reply of the old server must not be read as this one's
                pause = self.endpoints.follow(exc, follows)
                follows += 1
                if pause:
                    time.sleep(pause)
                continue
            if not isinstance(got, _NoReply):
                return got
            self._drop_socket()  # Lazy Pirate: a fresh socket discards any late reply
            timeouts += 1
            where = self.endpoint
            self.endpoints.rotate()  # the next call (or the retry) asks another server
            if timeouts >= attempts:
                raise timeout_error(method, where, wait, attempts, self._curve is not None)

    def _typed(self, method: str, reply: type[T], timeout: float | None, **params: object) -> T:
        """One typed call: the reply is decoded straight into ``reply`` (:mod:`kvcm.proto.results`)."""
        if self._routes is None:
            return self._typed_here(method, reply, timeout, **params)
        return self._routed(method, params, lambda c: c._typed_here(method, reply, timeout, **params))

    def _routed(self, method: str, params: Mapping[str, object], once: Callable[[Client], T]) -> T:
        """``once`` on the client of the shard the call belongs to, following ``WRONG_SHARD``."""
        routes = self._routes
        assert routes is not None  # internal: only a routed client
        key = routes.fans_out(method, params)
        if key is not None or routes.everywhere(method):
            return self._fan_out(routes, key, once)
        shard = routes.shard_for(method, params)
        target = self if shard is None else self._shard_client(shard)
        for redirects in range(MAX_REDIRECTS + 1):
            try:
                return once(target)
            except KvcmError as exc:
                if not redirected(exc) or redirects == MAX_REDIRECTS:
                    raise
                shard = routes.learn(exc)
                if shard is None:
                    raise
                if not routes.mapped:  # sharded after all: the seeds' shard's other nodes, once
                    self._take_map(routes)
                target = self._shard_client(shard)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _fan_out(self, routes: Routes, key: str | None, once: Callable[[Client], T]) -> T:
        """A call every shard answers for its part: a list (merged under ``key``), or a change
        of what each shard keeps a copy of (``key`` None: the first reply, or the first error
        naming the shards that took it)."""
        if routes.map_due():
            self._take_map(routes)
        if not routes.shards:
            return once(self)  # not sharded: this deployment is the whole
        if key is not None:
            return merge([once(self._shard_client(s)) for s in sorted(routes.shards.values())], key)  # type: ignore[return-value]
        outcomes: list[tuple[str, object | KvcmError]] = []
        for shard in sorted(routes.shards.values()):
            try:
                outcomes.append((shard.name, once(self._shard_client(shard))))
            except KvcmError as exc:
                outcomes.append((shard.name, exc))
        got = applied_everywhere(outcomes)
        if isinstance(got, KvcmError):
            raise got
        return got  # type: ignore[return-value]

    def _take_map(self, routes: Routes) -> None:
        """Ask for the shard map (an answer that does not come is no shard map)."""
        try:
            reply = self._call_here("get_shard_map", None, min(self.timeout, MAP_WAIT_S), None)
        except KvcmError:
            reply = None
        routes.take_map(reply, self.endpoints.all)

    def _shard_client(self, shard: ShardInfo) -> Client:
        """The client of ``shard``'s nodes (made again when the shard's nodes changed)."""
        known = self._shard_clients.get(shard.name)
        if known is not None and serves(shard, known.endpoints.all):
            return known
        if known is not None:
            known.close()
        client = self._shard_clients[shard.name] = Client(list(shard.endpoints), routed=False, **self._options)
        return client

    def _typed_here(self, method: str, reply: type[T], timeout: float | None, **params: object) -> T:
        if self.state is ClientState.CLOSED:
            raise RuntimeError("client is closed")
        msgid = next(self._ids) & wire.MAX_MSGID
        payload = build_request(method, msgid, drop_unset(params), self.auth)
        dec = decoder(reply)
        wait = self.timeout if timeout is None else timeout
        if self._spread is not None and method in FOLLOWER_READS:
            spread = self._read_spread(lambda link: self._exchange(payload, dec, msgid, wait, link))
            if not isinstance(spread, _NoReply):
                return spread

        first: T | KvcmError | None
        try:  # the common case without the retry loop's frames: one attempt, answered
            first = self._exchange(payload, dec, msgid, wait)
        except KvcmError as exc:
            if not follows_leader(exc, 0):
                raise
            first = exc
        if first is not None and not isinstance(first, KvcmError):
            return first

        def once() -> T | _NoReply:
            got = self._exchange(payload, dec, msgid, wait)
            return _NO_REPLY if got is None else got
        return self._send_until_answered(method, once, method in IDEMPOTENT_METHODS, wait,
                                         first=_NO_REPLY if first is None else first)

    def _exchange(self, payload: bytes, dec: msgspec.msgpack.Decoder[Envelope[T]], msgid: int,
                  wait: float, link: _Link | None = None) -> T | None:
        """Send and await the reply to ``msgid``; its decoded result, or None on timeout.

        Cheaper than :meth:`_roundtrip`: the send is tried first without a poll (a DEALER queues
        at once once connected; only a socket with no usable pipe needs the poll), and the wait
        is one blocking recv bounded by ``RCVTIMEO``, set only when the wait changes. ``link``:
        the connection to use (default: the current endpoint's)."""
        link = link or self._connected()
        sock = link.sock
        deadline = time.monotonic() + wait
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            if not self._send_polled(sock, payload, min(wait, link.connect_s)):
                return None
        ms = int(wait * 1000) + 1
        while True:
            if ms != link.rcvtimeo:
                sock.setsockopt(zmq.RCVTIMEO, ms)
                link.rcvtimeo = ms
            try:
                data = sock.recv()
            except zmq.Again:
                return None
            try:
                return decode_reply(dec, data, msgid)
            except _Skip:
                pass  # a late reply to an earlier, timed-out call
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ms = int(left * 1000) + 1

    @staticmethod
    def _send_polled(sock: zmq.Socket[bytes], payload: bytes, wait: float) -> bool:
        # Never a blocking send: a DEALER with no usable pipe (a server that refused the CURVE
        # handshake, or not there yet) would block in send() for ever, past every timeout.
        try:
            if not sock.poll(int(wait * 1000) + 1, zmq.POLLOUT):
                return False
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _roundtrip(self, payload: bytes, msgid: int, wait: float,
                   link: _Link | None = None) -> tuple[object, object] | None:
        link = link or self._connected()
        sock = link.sock
        deadline = time.monotonic() + wait
        # Never a blocking send: a DEALER with no usable pipe (a server that refused the CURVE
        # handshake, or not there yet) would block in send() for ever, past every timeout.
        try:
            if not sock.poll(int(min(wait, link.connect_s) * 1000) + 1, zmq.POLLOUT):
                return None
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            return None
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            try:
                got, err, result = wire.parse_response(sock.recv())
            except wire.BadEnvelope as exc:
                raise ServerError(f"malformed reply from server: {exc}") from None
            if got == msgid:
                return err, result
            # a late reply to an earlier, timed-out call: skip it
        return None

    def _discover(self) -> None:
        """Add the nodes ``get_manager_cluster_info`` lists (``members``) to the endpoints reads
        go to; a deployment without the lease, or a call that fails, adds none (asked again in
        :data:`DISCOVER_S`)."""
        self._discover_at = time.monotonic() + DISCOVER_S
        try:
            info = self.call("get_manager_cluster_info", timeout=min(self.timeout, MAP_WAIT_S), retry=False)
        except KvcmError:
            return
        add_members(self.endpoints, info)

    def _connected(self) -> _Link:
        if self._link is None:
            self._link = _Link(self._open(self.endpoint))
        return self._link

    def _open(self, endpoint: str, immediate: bool = False) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if immediate:  # queue nothing for a node not connected (yet): its reads go elsewhere
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if self._routing_prefix:
            sock.setsockopt(zmq.ROUTING_ID, self._routing_prefix + os.urandom(8))
        if self._curve is not None:
            apply_client(sock, *self._curve)
        sock.connect(endpoint)
        return sock

    def _reader(self, endpoint: str) -> _Link | None:
        """The connection reads to ``endpoint`` use; None when it is not up within
        :data:`READER_CONNECT_S`."""
        link = self._readers.get(endpoint)
        if link is None:
            link = self._readers[endpoint] = _Link(self._open(endpoint, immediate=True), READER_CONNECT_S)
            if not link.sock.poll(int(READER_CONNECT_S * 1000), zmq.POLLOUT):
                return None
        return link

    def _drop_reader(self, endpoint: str) -> None:
        link = self._readers.pop(endpoint, None)
        if link is not None:
            link.sock.close(linger=0)

    def _drop_socket(self) -> None:
        if self._link is not None:
            self._link.sock.close(linger=0)
            self._link = None


class _NoReply:
    """What an attempt that got no reply in time returns."""


_NO_REPLY = _NoReply()


def _result(reply: tuple[object, object]) -> object:
    err, result = reply
    if err is not None:
        raise error_from_wire(err)
    return result


__all__ = ["IDEMPOTENT_METHODS", "METHODS", "Client", "ClientState", "Endpoints", "KvcmError"]



def _here(reply: tuple[object, object] | None) -> tuple[object, object] | None:
    """A classic ``(error, result)`` reply, raised when its error says to ask another node."""
    if reply is not None and isinstance(reply[0], dict) and reply[0].get("code") in _ELSEWHERE:
        raise error_from_wire(reply[0])
    return reply

"""Synchronous kvcm client: one DEALER socket, request ids, per-call timeouts, safe retries.

>>> with Client("tcp://127.0.0.1:6381") as kv:          # doctest: +SKIP
...     kv.call("check_health")
...     kv.get_cache_location(instance_id="llm", query_type="prefix_match", block_keys=[1, 2])
{'status': 'ok', ...}
CacheLocations(locations=[...])

Besides the generic :meth:`Client.call` (a plain map back), there is one typed method per RPC,
with the request's fields as keyword arguments and a :mod:`kvcm.proto.results` Struct (or, for the
open-ended admin replies, a dict) as its result, decoded straight from the reply's bytes
(docs/client.md). :mod:`kvcm.aio` has the same methods for asyncio.

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
from typing import Any, Literal, TypeVar

import msgspec
import zmq

from kvcm.errors import Code, InvalidArgument, KvcmError, ServerError, Unavailable, error_from_wire
from kvcm.proto import wire
from kvcm.proto.extra_keys import MmFeature
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

CurveClientKeys = str | os.PathLike[str] | tuple[str | bytes, str | bytes] | KeyPair

#: Every RPC method the server answers (``kvcm call --help`` lists them; a test holds this equal
#: to the running server's method table, so it cannot drift).
METHODS: tuple[str, ...] = (
    "add_account", "add_event_source", "add_storage", "add_token", "check_health", "create_instance_group",
    "delete_account", "disable_storage", "enable_storage", "finish_write_cache", "gen_config_snapshot",
    "get_cache_location", "get_cache_location_len", "get_cache_meta", "get_instance_group", "get_instance_info",
    "get_leader_elector_config",
    "get_manager_cluster_info", "get_metrics", "leader_demote", "get_storage_specs", "list_account", "list_event_sources", "list_instance_groups", "list_instance_info",
    "list_storage", "list_tokens", "load_config_snapshot", "match_engines", "note_routed", "get_host_cache_state", "pin_cache", "register_instance",
    "remove_cache", "remove_event_source", "remove_instance", "remove_instance_group", "remove_storage",
    "report_events", "report_lost", "revoke_token", "start_write_cache", "trim_cache", "unpin_cache", "update_account",
    "update_instance_group", "update_leader_elector_config", "update_storage", "whoami",
)

#: Methods that may be re-sent after a timeout without changing the outcome.
IDEMPOTENT_METHODS = frozenset(
    {
        "check_health", "get_manager_cluster_info", "get_metrics", "get_instance_info",
        "list_instance_info", "get_cache_location", "get_cache_location_len", "get_cache_meta", "get_instance_group",
        "list_instance_groups", "list_storage", "list_account", "gen_config_snapshot", "whoami", "list_tokens",
        "register_instance", "list_event_sources", "match_engines", "get_host_cache_state", "enable_storage",
        "disable_storage", "get_storage_specs", "get_leader_elector_config", "update_leader_elector_config",
    }
)


T = TypeVar("T")
#: Block keys or token ids of a request (msgspec encodes lists and tuples as they are).
Ints = list[int] | tuple[int, ...]
#: A prompt's multimodal inputs: ``{"identifier", "offset", "length"}`` each (kvcm.proto.extra_keys).
MmFeatures = Sequence[MmFeature | Mapping[str, Any]]
QueryType = Literal["prefix_match", "batch_get", "reverse_roll_sw_match"]
TrimStrategy = Literal["remove_all_cache", "remove_all_meta", "timestamp"]
ReportOp = Literal["register", "heartbeat", "payloads", "events", "snapshot", "down"]

# One encoder for every request: msgspec writes the envelope and its params (dicts, lists,
# Structs such as Mask) in one C call, into a fresh bytes of the exact size.
_ENCODER = msgspec.msgpack.Encoder()


def build_request(method: str, msgid: int, params: dict[str, Any], auth: dict[str, str] | None) -> bytes:
    """``[0, msgid, method, [params]]`` as bytes; params the server cannot get are InvalidArgument."""
    if auth is not None and "auth" not in params:
        params["auth"] = auth
    try:
        return _ENCODER.encode((wire.REQUEST, msgid, method, (params,)))
    except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as exc:  # e.g. an int beyond 64 bits
        raise InvalidArgument(f"{method}: params cannot be sent: {type(exc).__name__}: {exc}") from None


def drop_unset(params: dict[str, Any]) -> dict[str, Any]:
    """A typed method's keyword arguments as request params: ``None`` means "not sent"."""
    return {k: v for k, v in params.items() if v is not None}


class _Skip(Exception):
    """The reply is not the one awaited (a late reply to an earlier, timed-out request)."""


def decode_reply(dec: msgspec.msgpack.Decoder[Envelope[Any]], payload: Any, msgid: int) -> Any:
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


def _peek_msgid(payload: Any) -> int | None:
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


class ClientState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Client:
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
    ) -> None:
        """``routing_id_prefix``: the socket's ZeroMQ routing id starts with it (then random
        bytes); kvcm's own relays use :data:`kvcm.proto.wire.RELAY_ID_PREFIX`."""
        self.endpoints = Endpoints(endpoint)
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
        self._socket: zmq.Socket[bytes] | None = None
        self._rcvtimeo = -1  # RCVTIMEO of the current socket (-1: none set)
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
        self._drop_socket()
        self.state = ClientState.CLOSED

    def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        retry: bool | None = None,
    ) -> Any:
        """Send one request and return its result map; raise the mapped KvcmError on error."""
        if self.state is ClientState.CLOSED:
            raise RuntimeError("client is closed")
        params = dict(params or {})
        if self.auth is not None and "auth" not in params:
            params["auth"] = self.auth
        msgid = next(self._ids) & wire.MAX_MSGID
        try:
            payload = wire.pack_request(msgid, method, params)
        except (OverflowError, TypeError, ValueError) as exc:  # e.g. an int beyond 64 bits
            raise InvalidArgument(f"{method}: params cannot be sent: {type(exc).__name__}: {exc}") from None
        may_retry = method in IDEMPOTENT_METHODS if retry is None else retry
        wait = self.timeout if timeout is None else timeout

        def once() -> Any:
            reply = self._roundtrip(payload, msgid, wait)
            return _NO_REPLY if reply is None else _result(reply)
        return self._send_until_answered(method, once, may_retry, wait)

    def _send_until_answered(self, method: str, once: Callable[[], Any], may_retry: bool, wait: float,
                             first: Any = None) -> Any:
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
                    got, first = first, None
                    if isinstance(got, KvcmError):
                        raise got
            except KvcmError as exc:
                if not follows_leader(exc, follows):
                    raise
                self._drop_socket()  # a late reply of the old server must not be read as this one's
                pause = self.endpoints.follow(exc, follows)
                follows += 1
                if pause:
                    time.sleep(pause)
                continue
            if got is not _NO_REPLY:
                return got
            self._drop_socket()  # Lazy Pirate: a fresh socket discards any late reply
            timeouts += 1
            where = self.endpoint
            self.endpoints.rotate()  # the next call (or the retry) asks another server
            if timeouts >= attempts:
                raise timeout_error(method, where, wait, attempts, self._curve is not None)

    def _typed(self, method: str, reply: type[T], timeout: float | None, **params: Any) -> T:
        """One typed call: the reply is decoded straight into ``reply`` (:mod:`kvcm.proto.results`)."""
        if self.state is ClientState.CLOSED:
            raise RuntimeError("client is closed")
        msgid = next(self._ids) & wire.MAX_MSGID
        payload = build_request(method, msgid, drop_unset(params), self.auth)
        dec = decoder(reply)
        wait = self.timeout if timeout is None else timeout

        try:  # the common case without the retry loop's frames: one attempt, answered
            first = self._exchange(payload, dec, msgid, wait)
        except KvcmError as exc:
            if not follows_leader(exc, 0):
                raise
            first = exc
        if first is not None and not isinstance(first, KvcmError):
            result: T = first
            return result

        def once() -> Any:
            got = self._exchange(payload, dec, msgid, wait)
            return _NO_REPLY if got is None else got
        result = self._send_until_answered(method, once, method in IDEMPOTENT_METHODS, wait,
                                           first=_NO_REPLY if first is None else first)
        return result

    def _exchange(self, payload: bytes, dec: msgspec.msgpack.Decoder[Envelope[Any]], msgid: int,
                  wait: float) -> Any:
        """Send and await the reply to ``msgid``; its decoded result, or None on timeout.

        Cheaper than :meth:`_roundtrip`: the send is tried first without a poll (a DEALER queues
        at once once connected; only a socket with no usable pipe needs the poll), and the wait
        is one blocking recv bounded by ``RCVTIMEO``, set only when the wait changes."""
        sock = self._connected()
        deadline = time.monotonic() + wait
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            if not self._send_polled(sock, payload, wait):
                return None
        ms = int(wait * 1000) + 1
        while True:
            if ms != self._rcvtimeo:
                sock.setsockopt(zmq.RCVTIMEO, ms)
                self._rcvtimeo = ms
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

    # --- typed methods: begin (scripts/gen_aio_client copies this block into kvcm/aio.py) ---
    # One method per RPC. Keyword arguments are the request's fields (docs/rpc.md); None means
    # "not sent", so the server's default applies. ``timeout`` is per attempt, as in call().

    # storages, instance groups, instances (admin except where said)
    def add_storage(self, *, storage: dict[str, Any], adopt_directory: bool | None = None,
                    trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Add a storage (``{global_unique_name, storage_type, storage_spec}``); ``{"storage": ...}``."""
        return self._typed("add_storage", AdminReply, timeout, storage=storage, adopt_directory=adopt_directory,
                           trace_id=trace_id)

    def update_storage(self, *, storage: dict[str, Any], force_update: bool | None = None,
                       trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Replace a storage's ``storage_spec`` (the whole spec); ``{"storage": ...}``."""
        return self._typed("update_storage", AdminReply, timeout, storage=storage, force_update=force_update,
                           trace_id=trace_id)

    def enable_storage(self, *, storage_unique_name: str, trace_id: str | None = None,
                       timeout: float | None = None) -> AdminReply:
        """Turn a storage's admin switch on; ``{"storage": ...}``."""
        return self._typed("enable_storage", AdminReply, timeout, storage_unique_name=storage_unique_name,
                           trace_id=trace_id)

    def disable_storage(self, *, storage_unique_name: str, trace_id: str | None = None,
                        timeout: float | None = None) -> AdminReply:
        """Turn a storage's admin switch off; ``{"storage": ...}``."""
        return self._typed("disable_storage", AdminReply, timeout, storage_unique_name=storage_unique_name,
                           trace_id=trace_id)

    def remove_storage(self, *, storage_unique_name: str, trace_id: str | None = None,
                       timeout: float | None = None) -> AdminReply:
        """Remove a storage no instance group lists; ``{}``."""
        return self._typed("remove_storage", AdminReply, timeout, storage_unique_name=storage_unique_name,
                           trace_id=trace_id)

    def list_storage(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Every storage; ``{"storage": [...]}``."""
        return self._typed("list_storage", AdminReply, timeout, trace_id=trace_id)

    def create_instance_group(self, *, instance_group: dict[str, Any], trace_id: str | None = None,
                              timeout: float | None = None) -> AdminReply:
        """Create an instance group; ``{"instance_group": ...}`` at version 1."""
        return self._typed("create_instance_group", AdminReply, timeout, instance_group=instance_group,
                           trace_id=trace_id)

    def update_instance_group(self, *, instance_group: dict[str, Any], current_version: int | None = None,
                              expected_version: int | None = None, trace_id: str | None = None,
                              timeout: float | None = None) -> AdminReply:
        """Merge a partial group into the stored one, compare-and-set on ``current_version``."""
        return self._typed("update_instance_group", AdminReply, timeout, instance_group=instance_group,
                           current_version=current_version, expected_version=expected_version, trace_id=trace_id)

    def remove_instance_group(self, *, name: str, trace_id: str | None = None,
                              timeout: float | None = None) -> AdminReply:
        """Remove a group no instance belongs to; ``{}``."""
        return self._typed("remove_instance_group", AdminReply, timeout, name=name, trace_id=trace_id)

    def get_instance_group(self, *, name: str, trace_id: str | None = None,
                           timeout: float | None = None) -> AdminReply:
        """One group; ``{"instance_group": ...}``."""
        return self._typed("get_instance_group", AdminReply, timeout, name=name, trace_id=trace_id)

    def list_instance_groups(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Every group; ``{"instance_group": [...]}``."""
        return self._typed("list_instance_groups", AdminReply, timeout, trace_id=trace_id)

    def register_instance(self, *, instance_group: str, instance_id: str, block_size: int,
                          location_spec_infos: Sequence[SpecInfo | dict[str, Any]] | None = None,
                          model_deployment: ModelDeployment | dict[str, Any] | None = None,
                          location_spec_groups: Sequence[SpecGroup | dict[str, Any]] | None = None,
                          trace_id: str | None = None, timeout: float | None = None) -> Registered:
        """Register an instance, or attach to it (data plane; the same registration again gives
        ``created=False``). Fields left out (None) are not compared with a registered instance's;
        a new instance without ``location_spec_infos`` is router-only (engine tier only)."""
        return self._typed("register_instance", Registered, timeout, instance_group=instance_group,
                           instance_id=instance_id, block_size=block_size,
                           location_spec_infos=_listed(location_spec_infos), model_deployment=model_deployment,
                           location_spec_groups=_listed(location_spec_groups), trace_id=trace_id)

    def get_instance_info(self, *, instance_id: str, instance_group: str | None = None,
                          trace_id: str | None = None, timeout: float | None = None) -> InstanceInfoReply:
        """One instance (data plane); INSTANCE_NOT_EXIST (a NotFound) for an unknown id."""
        return self._typed("get_instance_info", InstanceInfoReply, timeout, instance_id=instance_id,
                           instance_group=instance_group, trace_id=trace_id)

    def get_storage_specs(self, *, instance_id: str, trace_id: str | None = None,
                          timeout: float | None = None) -> StorageSpecs:
        """The storages the instance may use, as a client needs them (data plane: what
        :mod:`kvcm.blocks` resolves URIs with)."""
        return self._typed("get_storage_specs", StorageSpecs, timeout, instance_id=instance_id, trace_id=trace_id)

    def list_instance_info(self, *, instance_group_name: str | None = None, trace_id: str | None = None,
                           timeout: float | None = None) -> AdminReply:
        """The instances of one group (every group when not given); ``{"instance_info": [...]}``."""
        return self._typed("list_instance_info", AdminReply, timeout, instance_group_name=instance_group_name,
                           trace_id=trace_id)

    def remove_instance(self, *, instance_id: str, instance_group: str | None = None,
                        trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Unregister an instance; its cached blocks are dropped afterwards. ``{}``."""
        return self._typed("remove_instance", AdminReply, timeout, instance_id=instance_id,
                           instance_group=instance_group, trace_id=trace_id)

    # accounts, snapshots, health
    def add_account(self, *, user_name: str, password: str, role: str | None = None,
                    groups: Sequence[str] | None = None, trace_id: str | None = None,
                    timeout: float | None = None) -> AdminReply:
        """Add an account (role ``user`` unless given); ``{"account": ...}``."""
        return self._typed("add_account", AdminReply, timeout, user_name=user_name, password=password, role=role,
                           groups=_listed(groups), trace_id=trace_id)

    def update_account(self, *, user_name: str, password: str | None = None, role: str | None = None,
                       groups: Sequence[str] | None = None, trace_id: str | None = None,
                       timeout: float | None = None) -> AdminReply:
        """Change an account's password, role or groups; ``{"account": ...}``."""
        return self._typed("update_account", AdminReply, timeout, user_name=user_name, password=password, role=role,
                           groups=_listed(groups), trace_id=trace_id)

    def delete_account(self, *, user_name: str, trace_id: str | None = None,
                       timeout: float | None = None) -> AdminReply:
        """Delete an account (never the last admin); ``{}``."""
        return self._typed("delete_account", AdminReply, timeout, user_name=user_name, trace_id=trace_id)

    def list_account(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Every account (never a password); ``{"accounts": [...]}``."""
        return self._typed("list_account", AdminReply, timeout, trace_id=trace_id)

    def gen_config_snapshot(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The whole registry; ``{"config_snapshot": ...}`` (password hashes included)."""
        return self._typed("gen_config_snapshot", AdminReply, timeout, trace_id=trace_id)

    def load_config_snapshot(self, *, config_snapshot: dict[str, Any] | str, trace_id: str | None = None,
                             timeout: float | None = None) -> AdminReply:
        """Replace the whole registry with a snapshot (a map or its JSON text); ``{"loaded": ...}``."""
        return self._typed("load_config_snapshot", AdminReply, timeout, config_snapshot=config_snapshot,
                           trace_id=trace_id)

    def check_health(self, *, trace_id: str | None = None, timeout: float | None = None) -> Health:
        """Whether the server answers and its store reads; registry counts and storage states."""
        return self._typed("check_health", Health, timeout, trace_id=trace_id)

    def get_manager_cluster_info(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The (single) node, always the leader, with Tair's fields."""
        return self._typed("get_manager_cluster_info", AdminReply, timeout, trace_id=trace_id)

    def leader_demote(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The leader hands the lease over (never retried: each call is one step-down)."""
        return self._typed("leader_demote", AdminReply, timeout, trace_id=trace_id)

    def get_leader_elector_config(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """This node's ``campaign_delay_time_ms`` (and lease timings with the lease)."""
        return self._typed("get_leader_elector_config", AdminReply, timeout, trace_id=trace_id)

    def update_leader_elector_config(self, *, campaign_delay_time_ms: int, trace_id: str | None = None,
                                     timeout: float | None = None) -> AdminReply:
        """Change this node's ``campaign_delay_time_ms`` until its restart."""
        return self._typed("update_leader_elector_config", AdminReply, timeout,
                           campaign_delay_time_ms=campaign_delay_time_ms, trace_id=trace_id)

    # data plane
    def get_cache_location(self, *, instance_id: str, query_type: QueryType | str, block_keys: Ints | None = None,
                           token_ids: Ints | None = None, block_mask: Mask | None = None, sw_size: int | None = None,
                           location_spec_names: Sequence[str] | None = None, include_engines: bool | None = None,
                           lora_name: str | None = None, extra_keys: Sequence[Any] | None = None,
                           mm_features: MmFeatures | None = None, cache_salt: str | None = None,
                           trace_id: str | None = None, timeout: float | None = None) -> CacheLocations:
        """Locations of the blocks of ``block_keys`` or ``token_ids``: the matched prefix
        (``prefix_match``) or one entry per key (``batch_get``, ``reverse_roll_sw_match``)."""
        return self._typed("get_cache_location", CacheLocations, timeout, instance_id=instance_id,
                           query_type=query_type, block_keys=block_keys, token_ids=token_ids, block_mask=block_mask,
                           sw_size=sw_size, location_spec_names=_listed(location_spec_names),
                           include_engines=include_engines, lora_name=lora_name, extra_keys=_listed(extra_keys),
                           mm_features=_listed(mm_features), cache_salt=cache_salt, trace_id=trace_id)

    def get_cache_location_len(self, *, instance_id: str, query_type: QueryType | str, block_keys: Ints | None = None,
                               token_ids: Ints | None = None, block_mask: Mask | None = None,
                               sw_size: int | None = None, location_spec_names: Sequence[str] | None = None,
                               extra_keys: Sequence[Any] | None = None, mm_features: MmFeatures | None = None,
                               lora_name: str | None = None, cache_salt: str | None = None,
                               trace_id: str | None = None, timeout: float | None = None) -> CacheLocationLen:
        """How many locations :meth:`get_cache_location` would answer, without them: for
        ``prefix_match`` the matched prefix in blocks (Tair's ``getCacheLocationLen``). The
        cheapest lookup on both sides: the reply is a few bytes, whatever the prompt."""
        return self._typed("get_cache_location_len", CacheLocationLen, timeout, instance_id=instance_id,
                           query_type=query_type, block_keys=block_keys, token_ids=token_ids, block_mask=block_mask,
                           sw_size=sw_size, location_spec_names=_listed(location_spec_names),
                           extra_keys=_listed(extra_keys), mm_features=_listed(mm_features), lora_name=lora_name,
                           cache_salt=cache_salt, trace_id=trace_id)

    def get_cache_meta(self, *, instance_id: str, block_keys: Ints | None = None, token_ids: Ints | None = None,
                       block_mask: Mask | None = None, detail_level: int | None = None,
                       extra_keys: Sequence[Any] | None = None, mm_features: MmFeatures | None = None,
                       lora_name: str | None = None, cache_salt: str | None = None, trace_id: str | None = None,
                       timeout: float | None = None) -> CacheMeta:
        """What kvcm knows of each key: one location and one :class:`BlockMeta` per request key."""
        return self._typed("get_cache_meta", CacheMeta, timeout, instance_id=instance_id, block_keys=block_keys,
                           token_ids=token_ids, block_mask=block_mask, detail_level=detail_level,
                           extra_keys=_listed(extra_keys), mm_features=_listed(mm_features), lora_name=lora_name,
                           cache_salt=cache_salt, trace_id=trace_id)

    def start_write_cache(self, *, instance_id: str, block_keys: Ints | None = None, token_ids: Ints | None = None,
                          location_spec_group_names: Sequence[str] | None = None,
                          write_timeout_seconds: float | None = None, extra_keys: Sequence[Any] | None = None,
                          mm_features: MmFeatures | None = None, lora_name: str | None = None,
                          cache_salt: str | None = None, trace_id: str | None = None,
                          timeout: float | None = None) -> WriteSession:
        """Allocate space for the keys not there yet (never retried: a write is not idempotent)."""
        return self._typed("start_write_cache", WriteSession, timeout, instance_id=instance_id,
                           block_keys=block_keys, token_ids=token_ids,
                           location_spec_group_names=_listed(location_spec_group_names),
                           write_timeout_seconds=write_timeout_seconds, extra_keys=_listed(extra_keys),
                           mm_features=_listed(mm_features), lora_name=lora_name, cache_salt=cache_salt,
                           trace_id=trace_id)

    def finish_write_cache(self, *, instance_id: str, write_session_id: str, success_blocks: Mask | None = None,
                           locations: Sequence[Mapping[str, Any]] | None = None, trace_id: str | None = None,
                           timeout: float | None = None) -> WriteFinished:
        """End a write session; ``success_blocks`` is indexed over the session's locations.
        ``locations``: Tair's clients echo the session's locations back (checked, not used)."""
        return self._typed("finish_write_cache", WriteFinished, timeout, instance_id=instance_id,
                           write_session_id=write_session_id, success_blocks=success_blocks,
                           locations=_listed(locations), trace_id=trace_id)

    def remove_cache(self, *, instance_id: str, block_keys: Ints | None = None, token_ids: Ints | None = None,
                     block_mask: Mask | None = None, extra_keys: Sequence[Any] | None = None,
                     mm_features: MmFeatures | None = None, lora_name: str | None = None,
                     cache_salt: str | None = None, trace_id: str | None = None,
                     timeout: float | None = None) -> Removed:
        """Mark every copy of the unmasked keys ``deleting``; the count of copies marked."""
        return self._typed("remove_cache", Removed, timeout, instance_id=instance_id, block_keys=block_keys,
                           token_ids=token_ids, block_mask=block_mask, extra_keys=_listed(extra_keys),
                           mm_features=_listed(mm_features), lora_name=lora_name, cache_salt=cache_salt,
                           trace_id=trace_id)

    def report_lost(self, *, instance_id: str, block_keys: Ints | None = None, token_ids: Ints | None = None,
                    block_mask: Mask | None = None, extra_keys: Sequence[Any] | None = None,
                    mm_features: MmFeatures | None = None, lora_name: str | None = None,
                    cache_salt: str | None = None, trace_id: str | None = None, timeout: float | None = None) -> Lost:
        """Blocks this client could not read: they stop being served and are freed at once."""
        return self._typed("report_lost", Lost, timeout, instance_id=instance_id, block_keys=block_keys,
                           token_ids=token_ids, block_mask=block_mask, extra_keys=_listed(extra_keys),
                           mm_features=_listed(mm_features), lora_name=lora_name, cache_salt=cache_salt,
                           trace_id=trace_id)

    def trim_cache(self, *, instance_id: str, strategy: TrimStrategy | str, begin_timestamp: int | None = None,
                   end_timestamp: int | None = None, trace_id: str | None = None,
                   timeout: float | None = None) -> Removed:
        """Drop an instance's blocks: all, all metadata, or by time (Unix microseconds)."""
        return self._typed("trim_cache", Removed, timeout, instance_id=instance_id, strategy=strategy,
                           begin_timestamp=begin_timestamp, end_timestamp=end_timestamp, trace_id=trace_id)

    def pin_cache(self, *, instance_id: str, block_keys: Ints, ttl_seconds: float, trace_id: str | None = None,
                  timeout: float | None = None) -> Pinned:
        """Keep keys out of eviction for ``ttl_seconds`` (a soft pin)."""
        return self._typed("pin_cache", Pinned, timeout, instance_id=instance_id, block_keys=block_keys,
                           ttl_seconds=ttl_seconds, trace_id=trace_id)

    def unpin_cache(self, *, instance_id: str, block_keys: Ints, trace_id: str | None = None,
                    timeout: float | None = None) -> Unpinned:
        """End the pins of ``block_keys``; the count of keys that were pinned."""
        return self._typed("unpin_cache", Unpinned, timeout, instance_id=instance_id, block_keys=block_keys,
                           trace_id=trace_id)

    # engine tier
    def add_event_source(self, *, source_id: str, instance_id: str, endpoint: str | None = None,
                         replay_endpoint: str | None = None, host: str | None = None, port: int | None = None,
                         replay_port: int | None = None, replay: bool | None = None, topic: str | None = None,
                         dp_rank: int | None = None, replay_timeout_s: float | None = None,
                         backoff_initial_s: float | None = None, backoff_max_s: float | None = None,
                         poll_ms: int | None = None, report_mode: str | None = None, pod: str | None = None,
                         trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """Add one engine event source (``endpoint`` or ``host``); ``{"source": ...}``. ``pod``: the
        pod a DP rank belongs to (``match_engines`` groups by it; absent, the source is its own)."""
        return self._typed("add_event_source", AdminReply, timeout, source_id=source_id, instance_id=instance_id,
                           endpoint=endpoint, replay_endpoint=replay_endpoint, host=host, port=port,
                           replay_port=replay_port, replay=replay, topic=topic, dp_rank=dp_rank, pod=pod,
                           replay_timeout_s=replay_timeout_s, backoff_initial_s=backoff_initial_s,
                           backoff_max_s=backoff_max_s, poll_ms=poll_ms, report_mode=report_mode, trace_id=trace_id)

    def remove_event_source(self, *, source_id: str, trace_id: str | None = None,
                            timeout: float | None = None) -> AdminReply:
        """Remove a source and the blocks it held; ``{"source_id", "instance_id"}``."""
        return self._typed("remove_event_source", AdminReply, timeout, source_id=source_id, trace_id=trace_id)

    def list_event_sources(self, *, instance_id: str | None = None, trace_id: str | None = None,
                           timeout: float | None = None) -> AdminReply:
        """The sources (of one instance, when given); ``{"sources": [...]}``."""
        return self._typed("list_event_sources", AdminReply, timeout, instance_id=instance_id, trace_id=trace_id)

    def match_engines(self, *, instance_id: str, token_ids: Ints | None = None, block_keys: Ints | None = None,
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
        return self._typed("match_engines", EngineMatches, timeout, instance_id=instance_id, token_ids=token_ids,
                           block_keys=block_keys, lora_name=lora_name, media=_listed(media), medium=medium,
                           group_idx=group_idx, limit=limit, top_k=top_k,
                           loads=None if loads is None else dict(loads), include_stale=include_stale,
                           include_storage=include_storage, extra_keys=_listed(extra_keys),
                           mm_features=_listed(mm_features), cache_salt=cache_salt, trace_id=trace_id)

    def note_routed(self, *, instance_id: str, source_id: str, token_ids: Ints | None = None,
                    block_keys: Ints | None = None, ttl_s: float | None = None, lora_name: str | None = None,
                    extra_keys: Sequence[Any] | None = None, mm_features: MmFeatures | None = None,
                    cache_salt: str | None = None, trace_id: str | None = None,
                    timeout: float | None = None) -> Routed:
        """The router sent this prompt to ``source_id``: count its blocks there, ``speculative``,
        until the engine's event confirms them or ``ttl_s`` ends."""
        return self._typed("note_routed", Routed, timeout, instance_id=instance_id, source_id=source_id,
                           token_ids=token_ids, block_keys=block_keys, ttl_s=ttl_s, lora_name=lora_name,
                           extra_keys=_listed(extra_keys), mm_features=_listed(mm_features), cache_salt=cache_salt,
                           trace_id=trace_id)

    def get_host_cache_state(self, *, instance_id: str, block_cache_keys: Ints | None = None,
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
        return self._typed("get_host_cache_state", HostCacheState, timeout, instance_id=instance_id,
                           query_type=query_type, p2p_host_count=p2p_host_count,
                           block_cache_keys=block_cache_keys, block_keys=block_keys, token_ids=token_ids,
                           medium=_listed(medium), top_k=top_k, loads=None if loads is None else dict(loads),
                           include_stale=include_stale, include_storage=include_storage, lora_name=lora_name,
                           extra_keys=_listed(extra_keys), mm_features=_listed(mm_features), cache_salt=cache_salt,
                           trace_id=trace_id)

    def report_events(self, *, source_id: str, op: ReportOp, generation: int | None = None,
                      instance_id: str | None = None, dp_rank: int | None = None, pod: str | None = None, medium: str | None = None, report_mode: str | None = None, seq: int | None = None,
                      ts: float | None = None, events: Sequence[dict[str, Any]] | None = None,
                      payloads: Sequence[dict[str, Any]] | None = None, trace_id: str | None = None,
                      timeout: float | None = None) -> EventsReported:
        """A push source's report (docs/engines.md#push-ingestion): ``register``, ``heartbeat``,
        ``payloads`` (``[{"seq", "payload"}]``, vLLM-encoded), ``events`` / ``snapshot`` (decoded
        ``add`` / ``remove`` / ``clear`` events) or ``down``; ``resync`` in the reply asks for a snapshot."""
        return self._typed("report_events", EventsReported, timeout, source_id=source_id, op=op,
                           generation=generation, instance_id=instance_id, dp_rank=dp_rank, pod=pod, medium=medium, report_mode=report_mode,
                           seq=seq, ts=ts, events=_listed(events), payloads=_listed(payloads), trace_id=trace_id)

    # system, tokens
    def get_metrics(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The numbers of ``/metrics`` as a map (admin)."""
        return self._typed("get_metrics", AdminReply, timeout, trace_id=trace_id)

    def add_token(self, *, user_name: str, name: str | None = None, ttl_seconds: float | None = None,
                  trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """A new API token of ``user_name``, shown once (admin)."""
        return self._typed("add_token", AdminReply, timeout, user_name=user_name, name=name, ttl_seconds=ttl_seconds,
                           trace_id=trace_id)

    def revoke_token(self, *, token_id: str, trace_id: str | None = None,
                     timeout: float | None = None) -> AdminReply:
        """Revoke an API token (admin)."""
        return self._typed("revoke_token", AdminReply, timeout, token_id=token_id, trace_id=trace_id)

    def list_tokens(self, *, user_name: str | None = None, trace_id: str | None = None,
                    timeout: float | None = None) -> AdminReply:
        """API tokens (of one account, when given): ids, owners, labels, times (admin)."""
        return self._typed("list_tokens", AdminReply, timeout, user_name=user_name, trace_id=trace_id)

    def whoami(self, *, trace_id: str | None = None, timeout: float | None = None) -> AdminReply:
        """The caller's account, role, groups and how it authenticated."""
        return self._typed("whoami", AdminReply, timeout, trace_id=trace_id)

    # --- typed methods: end ---

    def _roundtrip(self, payload: bytes, msgid: int, wait: float) -> tuple[Any, Any] | None:
        sock = self._connected()
        deadline = time.monotonic() + wait
        # Never a blocking send: a DEALER with no usable pipe (a server that refused the CURVE
        # handshake, or not there yet) would block in send() for ever, past every timeout.
        try:
            if not sock.poll(int(wait * 1000) + 1, zmq.POLLOUT):
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

    def _connected(self) -> zmq.Socket[bytes]:
        if self._socket is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self._routing_prefix:
                sock.setsockopt(zmq.ROUTING_ID, self._routing_prefix + os.urandom(8))
            if self._curve is not None:
                apply_client(sock, *self._curve)
            sock.connect(self.endpoint)
            self._socket = sock
        return self._socket

    def _drop_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
            self._rcvtimeo = -1


_NO_REPLY = object()  # an attempt that got no reply in time


def _listed(items: Sequence[Any] | None) -> list[Any] | tuple[Any, ...] | None:
    """A sequence msgspec can encode (lists and tuples are sent as they are)."""
    return items if items is None or isinstance(items, (list, tuple)) else list(items)


def _result(reply: tuple[Any, Any]) -> Any:
    err, result = reply
    if err is not None:
        raise error_from_wire(err)
    return result


__all__ = ["IDEMPOTENT_METHODS", "METHODS", "Client", "ClientState", "Endpoints", "KvcmError"]

"""Synchronous kvcm client: one DEALER socket, request ids, per-call timeouts, safe retries.

>>> with Client("tcp://127.0.0.1:6381") as kv:          # doctest: +SKIP
...     kv.call("check_health")
{'status': 'ok', ...}

Errors come back as :class:`~kvcm.errors.KvcmError` subclasses, mapped in one place
(:func:`kvcm.errors.error_from_wire`). A call that gets no reply in time raises
:class:`~kvcm.errors.Unavailable` with code ``TIMEOUT``. Only idempotent methods are retried
(Lazy Pirate: drop the socket, reconnect, resend); a write such as ``start_write_cache`` is
never sent twice behind the caller's back. Not thread-safe: one client per thread.

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
from typing import Any

import zmq

from kvcm.errors import Code, InvalidArgument, KvcmError, ServerError, Unavailable, error_from_wire
from kvcm.rpc import wire
from kvcm.rpc.curve import KeyPair, apply_client, client_keypair, load_public_key

CurveClientKeys = str | os.PathLike[str] | tuple[str | bytes, str | bytes] | KeyPair

#: Every RPC method the server answers (``kvcm call --help`` lists them; a test holds this equal
#: to the running server's method table, so it cannot drift).
METHODS: tuple[str, ...] = (
    "add_account", "add_event_source", "add_storage", "add_token", "check_health", "create_instance_group",
    "delete_account", "disable_storage", "enable_storage", "finish_write_cache", "gen_config_snapshot",
    "get_cache_location", "get_cache_meta", "get_instance_group", "get_instance_info", "get_manager_cluster_info",
    "get_metrics", "get_storage_specs", "list_account", "list_event_sources", "list_instance_groups", "list_instance_info",
    "list_storage", "list_tokens", "load_config_snapshot", "match_engines", "pin_cache", "register_instance",
    "remove_cache", "remove_event_source", "remove_instance", "remove_instance_group", "remove_storage",
    "report_lost", "revoke_token", "start_write_cache", "trim_cache", "unpin_cache", "update_account",
    "update_instance_group", "update_storage", "whoami",
)

#: Methods that may be re-sent after a timeout without changing the outcome.
IDEMPOTENT_METHODS = frozenset(
    {
        "check_health", "get_manager_cluster_info", "get_metrics", "get_instance_info",
        "list_instance_info", "get_cache_location", "get_cache_meta", "get_instance_group",
        "list_instance_groups", "list_storage", "list_account", "gen_config_snapshot", "whoami", "list_tokens",
        "register_instance", "list_event_sources", "match_engines", "enable_storage",
        "disable_storage", "get_storage_specs",
    }
)


class ClientState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Client:
    """A connection to one kvcm server. Use as a context manager, or call :meth:`close`."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:6381",
        timeout: float = 5.0,
        retries: int = 2,
        auth: dict[str, str] | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        curve_server_key: str | bytes | os.PathLike[str] | None = None,
        curve_client_keys: CurveClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
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
        self.state = ClientState.OPEN

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
        attempts = 1 + (self.retries if may_retry else 0)
        wait = self.timeout if timeout is None else timeout
        for _ in range(attempts):
            reply = self._roundtrip(payload, msgid, wait)
            if reply is not None:
                return _result(reply)
            self._drop_socket()  # Lazy Pirate: a fresh socket discards any late reply
        curve = "; CURVE handshake failed or server unreachable" if self._curve is not None else ""
        raise Unavailable(
            f"no reply to {method} from {self.endpoint} within {wait:g}s ({attempts} attempt(s)){curve}",
            Code.TIMEOUT,
        )

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
            if self._curve is not None:
                apply_client(sock, *self._curve)
            sock.connect(self.endpoint)
            self._socket = sock
        return self._socket

    def _drop_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


def _result(reply: tuple[Any, Any]) -> Any:
    err, result = reply
    if err is not None:
        raise error_from_wire(err)
    return result


__all__ = ["IDEMPOTENT_METHODS", "METHODS", "Client", "ClientState", "KvcmError"]

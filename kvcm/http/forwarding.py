"""The pooled RPC clients the side port forwards ``/api`` calls through, one per thread, that
follow ``SERVER_NOT_LEADER`` or (for Tair's calls, which answer it themselves) do not."""

from __future__ import annotations

import threading

from kvcm.client import Client, Endpoints
from kvcm.errors import KvcmError
from kvcm.proto import wire
from kvcm.proto.wire import Decoded, EncodableMap
from kvcm.rpc.curve import CurveOptions

_RPC_TIMEOUT_S = 30.0


class NoFollow(Endpoints):
    """Endpoints that never follow: a SERVER_NOT_LEADER is the call's answer (Tair's calls, which
    :meth:`SideHttp.tair_call` sends on to the leader only when it answers)."""

    def follow(self, exc: KvcmError, follows: int) -> float:
        raise exc


class ClientPool:
    """RPC clients for handler threads: a client is used by one thread at a time, and connection
    threads come and go, so clients are pooled rather than kept per thread.
    ``follow=False``: SERVER_NOT_LEADER is not followed (:class:`NoFollow`)."""

    def __init__(self, endpoint: str, options: CurveOptions | None = None, follow: bool = True) -> None:
        self._endpoint = endpoint
        self._options = options or {}  # more Client arguments (CURVE keys)
        self._follow = follow
        self._idle: list[Client] = []
        self._lock = threading.Lock()

    def call(self, method: str, params: EncodableMap, timeout: float | None = None) -> Decoded:
        with self._lock:
            client = self._idle.pop() if self._idle else None
        if client is None:
            client = Client(self._endpoint, timeout=_RPC_TIMEOUT_S, retries=0, routing_id_prefix=wire.RELAY_ID_PREFIX,
                            **self._options)
            if not self._follow:
                client.endpoints = NoFollow(self._endpoint)
        try:
            reply: Decoded = client.call(method, dict(params), timeout=timeout, retry=False)
            return reply
        finally:
            with self._lock:
                self._idle.append(client)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()

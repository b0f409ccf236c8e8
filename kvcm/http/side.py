"""The side port (:class:`SideHttp`): binds and serves its listeners (and the admin port's),
forwards ``/api`` calls to the RPC front door, sends a follower's Tair calls on to the leader,
and remembers bearer-token verdicts briefly."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

from kvcm.client import IDEMPOTENT_METHODS, Client
from kvcm.config import Config, HttpConfig
from kvcm.errors import AccessDenied, Code, KvcmError, StartRefused, Unavailable
from kvcm.http.forwarding import ClientPool
from kvcm.http.guards import Authorities, Slots, Suspects
from kvcm.http.handler import handler_for
from kvcm.http.server import BoundedServer, Server6, SidePort
from kvcm.metrics import Metrics
from kvcm.proto.wire import Decoded, DecodedMap, EncodableMap
from kvcm.rpc.curve import CurveOptions
from kvcm.tair import translate as tair

_TOKEN_CACHE_S = 5.0  # a verified bearer token is trusted this long before whoami is asked again
_BAD_TOKEN_CACHE_S = 1.0  # a token whoami refused is refused from memory this long (a flood of one costs one call)
_MAX_CACHED_TOKENS = 1024
# A role change waits this long for the side port's requests in flight to be answered by the
# stage that took them, before the stage stops (a request needs milliseconds; the bound keeps a
# stuck one from holding a takeover); the accept loop of a held port looks for the change this often.
_HAND_OVER_S = 1.0
_HELD_POLL_S = 0.05
_OWN_POLL_S = 0.1
# The leader's cluster info, asked by a follower for Tair's getClusterInfo (its HTTP port) and
# before a Tair call follows SERVER_NOT_LEADER to it: well under Tair's client timeout (1 s by
# default), so a dead leader is reported before the client gives up. The verdict is kept briefly.
_ASK_TIMEOUT_S = 0.5
_LEADER_VERDICT_S = 1.0
# How long a Tair call a follower sends on to the leader waits for its answer: past Tair's client
# timeout already, far below the RPC timeout (a leader that stopped within the verdict's second).
_FORWARD_TIMEOUT_S = 2.0


def refuse_unguarded(config: Config) -> None:
    """StartRefused when the side port would undo a CURVE allow-list: it forwards ``/api`` with
    the server's own key, which the allow-list admits, so with auth off every process that can
    reach the port could call every method, admin ones included, with no key of its own."""
    if (config.http.enabled and config.server.curve_allowed_clients_dir and not config.auth.enabled
            and not config.http.allow_unauthenticated_with_curve):
        raise StartRefused(
            "the HTTP side port would let any process past server.curve_allowed_clients_dir (it calls the "
            "RPC port with the server's own key) while auth is off: set auth.enabled = true, or "
            "http.enabled = false, or http.allow_unauthenticated_with_curve = true to serve it anyway")


class SideHttp:
    """Serves the side port on its own threads. ``live()``/``ready()`` are probes of the app.

    ``auth_required`` (``auth.enabled``): ``/metrics`` and ``/api`` then need credentials, an
    ``Authorization: Bearer`` token (``/api`` also takes ``auth`` in a body of at most
    ``http.max_unauthenticated_body_bytes``)."""

    def __init__(
        self,
        config: HttpConfig,
        metrics: Metrics,
        rpc_endpoint: str,
        live: Callable[[], bool],
        ready: Callable[[], bool],
        *,
        max_body: int = 4 << 20,
        auth_required: bool = False,
        client_options: CurveOptions | None = None,
        role: Callable[[], str] | None = None,
        port: SidePort | None = None,
    ) -> None:
        """``client_options``: more ``Client`` arguments for forwarding /api (CURVE keys).
        ``role``: the node's role under the leader lease (``leader``/``follower``), shown by
        ``/readyz``; None without the lease. ``port``: the listeners (and kept connections) of a
        node under the lease, served by this stage and left to the next one (:meth:`hand_over`);
        None binds ``config``'s own."""
        self.config = config
        self.metrics = metrics
        self.rpc_endpoint = rpc_endpoint
        self.live = live
        self.ready = ready
        self.role = role
        self.max_body = max_body
        self.auth_required = auth_required
        self._pool = ClientPool(rpc_endpoint, client_options)
        self._tair_pool = ClientPool(rpc_endpoint, client_options, follow=False)
        self._leader_pools: dict[str, ClientPool] = {}  # Tair calls a follower sends on, by leader
        self._tair_roots = tair.CallerRoots()  # storage directories for Tair's URIs, across calls
        self._leaders: dict[str, tuple[DecodedMap | None, float]] = {}  # endpoint -> (info, until)
        self._leaders_lock = threading.Lock()
        self._client_options: CurveOptions = client_options or {}
        self._tokens: dict[bytes, tuple[bool, float]] = {}  # sha256(token) -> (valid, until when)
        self._tokens_lock = threading.Lock()
        self._held = port
        kind = Server6 if ":" in config.host else BoundedServer
        self.suspects = Suspects(config.suspect_after_failures)
        self._httpd = kind((config.host, config.port), handler_for(self), self._new_slots(), self.refused,
                           None if port is None else (port, False), self.suspects, config.suspect_connections_per_s)
        self.port = int(self._httpd.server_address[1])
        self.authorities = Authorities(config.host, self.port, config.allowed_hosts)
        self._thread = self._serving(self._httpd, "kvcm-http")
        self._admin = self._bind_admin(kind) if config.admin_port >= 0 else None
        self.admin_port = int(self._admin.server_address[1]) if self._admin is not None else None
        self.admin_authorities = Authorities(config.host, self.admin_port or 0, config.allowed_hosts)
        self._admin_thread = None if self._admin is None else self._serving(self._admin, "kvcm-http-admin")
        self._handed_over = False

    def _new_slots(self) -> Slots:
        return Slots(self.config.max_connections, self.config.max_connections_per_peer)

    def _serving(self, httpd: BoundedServer, name: str) -> threading.Thread:
        # A held port's accept loop looks for a hand-over often: a role change waits for it.
        # An own port's loop wakes less often; a stop waits for its next wake-up.
        poll = _HELD_POLL_S if self._held is not None else _OWN_POLL_S
        return threading.Thread(target=httpd.serve_forever, args=(poll,), name=name, daemon=True)

    def _bind_admin(self, kind: type[BoundedServer]) -> BoundedServer:
        """Tair's port layout: its AdminService on a port of its own (``http.admin_port``)."""
        try:
            return kind((self.config.host, self.config.admin_port), handler_for(self, admin=True),
                        self._new_slots(), self.refused,
                        None if self._held is None else (self._held, True), self.suspects,
                        self.config.suspect_connections_per_s)
        except OSError as exc:
            self._httpd.server_close()
            raise StartRefused(f"cannot bind the admin HTTP port {self.config.host}:{self.config.admin_port} "
                               f"({exc.strerror or exc}); change http.admin_port") from None

    def _servers(self) -> list[tuple[BoundedServer, threading.Thread]]:
        return [(h, t) for h, t in ((self._httpd, self._thread), (self._admin, self._admin_thread))
                if h is not None and t is not None]

    def start(self) -> None:
        if self._handed_over:  # the role changed before this stage served: the next one serves
            return
        self._thread.start()
        if self._admin_thread is not None:
            self._admin_thread.start()
        if self._held is not None:  # the connections the last stage kept alive
            for sock, peer, admin in self._held.take():
                target = self._admin if admin else self._httpd
                if target is None:
                    sock.close()
                else:
                    target.adopt(sock, peer)

    def hand_over(self, timeout: float = _HAND_OVER_S) -> None:
        """A held port at a role change: stop accepting (connects wait in the backlog for the next
        stage), let the requests in flight be answered (up to ``timeout``: the stage still serves
        them), and leave every kept-alive connection to the next stage instead of closing it.
        Idempotent; a no-op without a held port."""
        if self._held is None or self._handed_over:
            return
        self._handed_over = True
        for httpd, thread in self._servers():
            if thread.is_alive():
                httpd.shutdown()
            httpd.begin_hand_over()
        deadline = time.monotonic() + timeout
        while any(h.live_count() for h, _ in self._servers()) and time.monotonic() < deadline:
            time.sleep(0.005)

    def stop(self) -> None:
        """A held port is handed over first (its listeners stay open for the next stage); what is
        still in flight past the hand-over's bound is cut off, as every connection of an own port."""
        self.hand_over()
        for httpd, thread in self._servers():
            if thread.is_alive():
                httpd.shutdown()
            httpd.close_connections()
            httpd.server_close()
        self._pool.close()
        self._tair_pool.close()
        with self._leaders_lock:
            pools, self._leader_pools = list(self._leader_pools.values()), {}
        for pool in pools:
            pool.close()

    def tair(self, name: str, params: DecodedMap, admin: bool, local_ip: str) -> tuple[int, object]:
        """A Tair RPC (``POST /api/<lowerCamelName>``) through :mod:`kvcm.tair`."""
        surface = "admin" if admin else "meta" if self.admin_port is not None else "both"
        ctx = tair.Context(http_port=self.port, admin_port=self.admin_port, local_host=local_ip, ask=self._ask,
                          roots=self._tair_roots)
        return tair.serve(name, params, surface, ctx, self.tair_call)

    def tair_call(self, method: str, params: EncodableMap) -> Decoded:
        """A translated Tair call: to this node, and from a follower on to the leader it names only
        if that leader answers now. Otherwise its SERVER_NOT_LEADER is the answer at once, naming
        the leader, rather than a wait of the RPC timeout on a dead or stopped one: Tair's client
        rediscovers on it and retries. Every call starts here, so a follower answers reads itself.
        A forwarded call waits ``_FORWARD_TIMEOUT_S`` at most (:meth:`_unanswered`): the leader may
        have stopped since the verdict that it answers."""
        try:
            return self._tair_pool.call(method, params)
        except KvcmError as exc:
            leader = str(exc.detail.get("leader_endpoint") or "")
            if exc.code is not Code.SERVER_NOT_LEADER or not leader or leader == self.rpc_endpoint:
                raise
            if not self._leader_answers(leader):
                stale = Unavailable(f"{exc.message}, which does not answer now; retry", Code.SERVER_NOT_LEADER)
                stale.detail = dict(exc.detail)
                raise stale from None
            refusal = exc
        try:  # a deposed leader's refusal is the answer
            return self._leader_pool(leader).call(method, params, timeout=_FORWARD_TIMEOUT_S)
        except KvcmError as failed:
            if failed.code is not Code.TIMEOUT:
                raise
            raise self._unanswered(method, leader, refusal) from None

    def _unanswered(self, method: str, leader: str, refusal: KvcmError) -> KvcmError:
        """The leader did not answer a forwarded call in time (stopped or dead since it last
        answered): it is taken as not answering for the verdict's time, so the next call is
        refused at once. This one is SERVER_NOT_LEADER, so Tair's client rediscovers and resends
        it, when a resend cannot change the outcome (an idempotent method); any other may have
        run there and is TIMEOUT, never resent behind the caller's back (kvcm's client rule)."""
        with self._leaders_lock:
            self._leaders[leader] = (None, time.monotonic() + _LEADER_VERDICT_S)
        late = f"{refusal.message}, which did not answer {method} within {_FORWARD_TIMEOUT_S:g}s"
        if method not in IDEMPOTENT_METHODS:
            return Unavailable(f"{late}: it may have run there; not resent", Code.TIMEOUT)
        stale = Unavailable(f"{late}; retry", Code.SERVER_NOT_LEADER)
        stale.detail = dict(refusal.detail)
        return stale

    def _leader_pool(self, endpoint: str) -> ClientPool:
        stale: list[ClientPool] = []
        with self._leaders_lock:
            pool = self._leader_pools.get(endpoint)
            if pool is None:
                if len(self._leader_pools) >= 4:
                    stale, self._leader_pools = list(self._leader_pools.values()), {}
                pool = self._leader_pools[endpoint] = ClientPool(endpoint, self._client_options, follow=False)
        for old in stale:  # leaders of past terms: idle clients closed, a busy one is dropped with its pool
            old.close()
        return pool

    def _ask(self, endpoint: str) -> DecodedMap | None:
        """``get_manager_cluster_info`` of another node (the leader), or None if it does not
        answer within ``_ASK_TIMEOUT_S``; either answer is remembered ``_LEADER_VERDICT_S``."""
        now = time.monotonic()
        with self._leaders_lock:
            known = self._leaders.get(endpoint)
        if known is not None and known[1] > now:
            return known[0]
        info: DecodedMap | None = None
        try:
            with Client(endpoint, timeout=_ASK_TIMEOUT_S, retries=0, **self._client_options) as client:
                reply = client.call("get_manager_cluster_info", {}, retry=False)
                info = reply if isinstance(reply, dict) else None
        except KvcmError:
            pass
        with self._leaders_lock:
            if len(self._leaders) >= 64:
                self._leaders.clear()
            self._leaders[endpoint] = (info, time.monotonic() + _LEADER_VERDICT_S)
        return info

    def _leader_answers(self, endpoint: str) -> bool:
        """The node at ``endpoint`` answers now and says it leads."""
        info = self._ask(endpoint)
        return info is not None and bool(info.get("leader"))

    def call(self, method: str, params: EncodableMap) -> Decoded:
        return self._pool.call(method, params)

    def refused(self, reason: str) -> None:
        self.metrics.http_refused.labels(reason).inc()

    def check_token(self, token: str, client: str = "") -> None:
        """Raise unless ``token`` is valid: asks RPC ``whoami`` (as ``client``, the remote address,
        for the login limits); the answer is remembered under the token's digest, a yes for
        :data:`_TOKEN_CACHE_S`, a no for :data:`_BAD_TOKEN_CACHE_S` (the token itself is never kept
        or logged)."""
        digest = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        with self._tokens_lock:
            valid, until = self._tokens.get(digest, (False, 0.0))
        if until > now:
            if valid:
                return
            raise AccessDenied("invalid token", Code.UNAUTHENTICATED)
        try:
            self.call("whoami", {"auth": {"token": token, "client": client}})
        except AccessDenied as exc:
            if exc.code is Code.UNAUTHENTICATED:
                self._remember(digest, False, now + _BAD_TOKEN_CACHE_S)
            raise
        self._remember(digest, True, now + _TOKEN_CACHE_S)

    def _remember(self, digest: bytes, valid: bool, until: float) -> None:
        with self._tokens_lock:
            if len(self._tokens) >= _MAX_CACHED_TOKENS:
                self._tokens.clear()
            self._tokens[digest] = (valid, until)

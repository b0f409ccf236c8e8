"""Request authentication and authorization: accounts, API tokens, roles and tenancy.

Plugged into the dispatcher as ``Dispatcher(authorize=Authenticator(registry, config.auth))``.
With ``auth.enabled`` off every request is allowed. With it on, every request carries
``"auth"``: ``{"token": ...}`` or ``{"user": ..., "password": ...}``. Methods flagged ``admin``
need the ``admin`` role; every other method is limited to the caller's instance groups.

The hook runs on the RPC thread, so nothing slow may happen in it:

* A **token** is checked with one SHA-256 and one dict lookup (the digest map below is kept in
  step with the registry by ``on_change``), so it costs microseconds.
* A **password** needs scrypt (tens of ms, on purpose). A verdict already known is answered
  from memory; otherwise the check is queued for the ``kvcm-auth`` thread (``hashlib.scrypt``
  releases the GIL) and the hook raises :class:`~kvcm.rpc.dispatch.Deferred`: the dispatcher carries
  the request and asks again a few ms later, which is then a dict lookup. Verdicts are kept
  under a keyed BLAKE2b of (user, password), its key random per process, never the password:
  good ones for ``auth.verdict_cache_s``, wrong ones for ``auth.failed_cache_s`` (so a repeated
  wrong password never runs scrypt again). Any account or token change forgets them all.
* Everything is bounded: at most ``auth.max_pending_checks`` queued checks (also per connection
  and per user name); past that, or after ``auth.failed_login_limit`` failed logins from one
  connection (``..._per_user`` for one user name) in ``auth.failed_login_window_s``, new
  password checks get RATE_LIMITED at once, naming when to retry. A caller whose verdict is
  cached, and every token caller, is never held up by any of this.

Tenancy: a non-admin may use an instance only if its group is in the account's ``groups``
(``"*"`` = all). Another tenant's instance answers exactly as a missing one does
(INSTANCE_NOT_EXIST), so instance ids of other tenants cannot be probed; list methods filter
(:meth:`Authenticator.visible`). The instance's group comes from the registry's in-memory
cache: one dict lookup per request.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, NoReturn, TypeVar

import msgspec

from kvcm.config import AuthConfig, ConfigError
from kvcm.control.passwords import hash_password, password_problem, verify_password
from kvcm.control.records import (
    ALL_GROUPS,
    Account,
    Token,
    is_user_name,
    looks_like_token,
    token_digest,
)
from kvcm.control.registry import ACCOUNT, TOKEN, Registry, instance_not_found
from kvcm.errors import AccessDenied, Code, Conflict, NotFound, Unavailable
from kvcm.proto.schema import Credentials
from kvcm.rpc.dispatch import Deferred, Method

log = logging.getLogger("kvcm.rpc.auth")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Verdicts kept at most (each map); past it the oldest is dropped.
_MAX_VERDICTS = 4096
#: Connections / user names whose failed logins are tracked at most; past it the oldest is dropped.
_MAX_TRACKED = 16384
#: Methods that filter what they show instead of refusing (they check no single instance).
FILTERED_METHODS = frozenset({"list_event_sources", "list_instance_info"})
_BAD_LOGIN = "invalid user name or password"


class Principal:
    """Who a request is from: the account, and how it proved it (``via``: password or token).
    Built once per account and kind of proof, then reused: requests only read it."""

    __slots__ = ("admin", "all_groups", "groups", "role", "token_id", "user_name", "via")

    def __init__(self, account: Account, via: str, token_id: str = "") -> None:
        self.user_name = account.user_name
        self.role = account.role
        self.groups = frozenset(account.groups)
        self.via = via
        self.token_id = token_id
        self.admin = account.role == "admin"
        #: May use every instance group (admins, and ``groups = ["*"]``).
        self.all_groups = self.admin or ALL_GROUPS in self.groups

    def may_use(self, group: str) -> bool:
        return self.all_groups or group in self.groups

    def describe(self) -> dict[str, str | list[str]]:
        """``whoami``: never a secret."""
        out: dict[str, str | list[str]] = {
            "user_name": self.user_name,
            "role": self.role,
            "groups": sorted(self.groups),
            "authenticated_by": self.via,
        }
        if self.token_id:
            out["token_id"] = self.token_id
        return out


@dataclass(frozen=True)
class _Check:
    """A password check queued for the checker thread."""

    key: bytes
    user: str
    password: str
    peer: bytes
    generation: int


class _Failures(Generic[K]):
    """Failed logins per key (connection or user name) in a sliding window; bounded memory."""

    def __init__(self, limit: int, window_s: float, what: str) -> None:
        self.limit, self.window_s, self.what = limit, window_s, what
        self._hits: dict[K, deque[float]] = {}

    def retry_after(self, key: K, now: float) -> float | None:
        """Seconds until ``key`` may try again, or None if it may now."""
        hits = self._hits.get(key)
        if hits is None or len(hits) < self.limit:
            return None
        wait = hits[0] + self.window_s - now
        return wait if wait > 0 else None

    def add(self, key: K, now: float) -> None:
        hits = self._hits.get(key)
        if hits is None:
            if len(self._hits) >= _MAX_TRACKED:
                self._hits.pop(next(iter(self._hits)))
            hits = self._hits[key] = deque(maxlen=self.limit)  # the last `limit` failures are enough
        hits.append(now)

    def clear(self, key: K) -> None:
        self._hits.pop(key, None)


class Authenticator:
    """The dispatcher's ``authorize`` hook (see the module docstring). Called on the RPC thread;
    the checker thread only fills the verdict maps, under ``_lock``."""

    def __init__(
        self,
        registry: Registry,
        config: AuthConfig,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``clock`` times caches and limits; ``wall`` (seconds) is compared with token expiry."""
        self.enabled = config.enabled
        self._registry = registry
        self._config = config
        self._clock = clock
        self._wall = wall
        # Keys the verdict maps' digests: without it they cannot be tested against guessed passwords.
        self._secret = secrets.token_bytes(32)
        self._lock = threading.Lock()
        self._generation = 0  # bumped on every account or token change: older verdicts are void
        self._good: dict[bytes, tuple[float, str]] = {}  # key -> (expiry, user name)
        self._bad: dict[bytes, float] = {}  # key -> expiry
        self._pending: dict[bytes, _Check] = {}
        self._pending_peer: dict[bytes, int] = {}
        self._pending_user: dict[str, int] = {}
        self._peer_failures: _Failures[bytes] = _Failures(
            config.failed_login_limit, config.failed_login_window_s, "from this connection"
        )
        self._user_failures: _Failures[str] = _Failures(
            config.failed_login_limit_per_user, config.failed_login_window_s, "for this user name"
        )
        self._principals: dict[tuple[str, str, str], Principal] = {}  # (user, via, token id) -> principal
        self._tokens: dict[str, Token] = {}  # digest -> record
        self._token_digests: dict[str, str] = {}  # token id -> digest
        self._queue: queue.SimpleQueue[_Check | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        if self.enabled:
            self._bootstrap(config)
            # Unknown users are checked against this hash too, so timing does not reveal them.
            self._dummy_hash = hash_password("kvcm-no-such-user")
            self._load_tokens()
            registry.on_change(self._on_change)

    def _bootstrap(self, config: AuthConfig) -> None:
        if any(a.role == "admin" for a in self._registry.list_accounts()):
            return
        if not config.admin_password:
            raise ConfigError("auth.admin_password: required to create the first admin account when auth.enabled is on")
        self._registry.ensure_admin(config.admin_user, config.admin_password)
        log.info("created the bootstrap admin account %r", config.admin_user)

    def _load_tokens(self) -> None:
        for token in self._registry.list_tokens():
            self._tokens[token.digest] = token
            self._token_digests[token.token_id] = token.digest

    def _token_changed(self, token_id: str) -> None:
        old = self._token_digests.pop(token_id, None)
        if old is not None:
            self._tokens.pop(old, None)
        token = self._registry.get_token(token_id)
        if token is not None:
            self._tokens[token.digest] = token
            self._token_digests[token_id] = token.digest

    def _on_change(self, kind: str, name: str) -> None:
        if kind not in (ACCOUNT, TOKEN):
            return
        if kind == TOKEN:
            self._token_changed(name)
        with self._lock:
            # A changed password, role, group list or token takes effect on the next request.
            self._generation += 1
            self._good.clear()
            self._bad.clear()
            self._principals.clear()

    def close(self) -> None:
        """Stop the checker thread (idempotent); queued checks are dropped."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(5.0)

    # -- the hook -------------------------------------------------------------------------------

    def __call__(self, method: Method, request: object, peer: bytes = b"") -> None:
        """Allow the call, or raise AccessDenied (UNAUTHENTICATED / PERMISSION_DENIED), RATE_LIMITED,
        INSTANCE_NOT_EXIST (another tenant's instance) or :class:`Deferred` (ask again soon)."""
        if not self.enabled:
            return
        auth = _auth_of(request)
        principal = self.authenticate(auth, _bucket(peer, auth), submit=True)
        if method.admin and not principal.admin:
            raise AccessDenied(f"{method.name} needs the admin role", Code.PERMISSION_DENIED)
        if not principal.all_groups and method.name not in FILTERED_METHODS:
            self._check_tenancy(method, request, principal)

    def authenticate(self, auth: object, peer: bytes = b"", submit: bool = False) -> Principal:
        """The caller of a request whose ``auth`` is ``auth`` (a Credentials, a map or None).
        A password without a known verdict is queued for checking (:class:`Deferred`) only with
        ``submit``; otherwise it is refused."""
        user, password, token = _credentials(auth)
        if token is not None:
            return self._by_token(token, user, peer)
        if user is None or password is None:
            raise AccessDenied('"auth" needs "token", or "user" and "password"', Code.UNAUTHENTICATED)
        return self._by_password(user, password, peer, submit)

    def principal(self, request: object) -> Principal | None:
        """The already authorized caller of ``request`` (None when auth is off). Cheap: it finds
        the verdict the hook just used; for handlers that show less to non-admins."""
        if not self.enabled:
            return None
        return self.authenticate(_auth_of(request))

    def visible(self, request: object) -> Callable[[str], bool] | None:
        """A filter on instance ids for what the caller of ``request`` may see; None = all."""
        principal = self.principal(request)
        if principal is None or principal.all_groups:
            return None
        group_of = self._registry.group_of

        def visible(instance_id: str) -> bool:
            group = group_of(instance_id)
            return group is not None and principal.may_use(group)

        return visible

    def check_reporter(self, request: object, owner: str, instance_id: str, source_id: str) -> None:
        """``report_events`` for an already registered push source: an admin may report for any;
        anyone else only for a source its own account registered (``owner``), of an instance in
        its groups. Another tenant's source answers as a missing one, like its instances do."""
        principal = self.principal(request)
        if principal is None or principal.admin:
            return
        group = self._registry.group_of(instance_id)
        if group is None or not principal.may_use(group):
            raise NotFound(f"event source {source_id[:200]!r} is not registered: report_events needs a push "
                           f"source (op register first)")
        if owner != principal.user_name:
            raise AccessDenied(f"report_events: event source {source_id[:200]!r} was registered by another "
                               f"account; only it (or an admin) may report for it", Code.PERMISSION_DENIED)

    def caller(self, request: object) -> str | None:
        """The account name of the caller of ``request`` (None when auth is off)."""
        principal = self.principal(request)
        return None if principal is None else principal.user_name

    # -- tokens ---------------------------------------------------------------------------------

    def _by_token(self, token: str, user: str | None, peer: bytes) -> Principal:
        record = self._tokens.get(token_digest(token)) if looks_like_token(token) else None
        if record is not None and not record.expired(int(self._wall() * 1000)):
            account = self._registry.get_account(record.user_name)
            if account is not None and user in (None, account.user_name):
                return self._principal(account, "token", record.token_id)
        with self._lock:
            self._refuse(peer, None, self._clock(), "invalid or expired token")

    # -- passwords ------------------------------------------------------------------------------

    def _by_password(self, user: str, password: str, peer: bytes, submit: bool) -> Principal:
        now = self._clock()
        # No account can match these (names and passwords are checked when set): no scrypt needed.
        problem = None if is_user_name(user) else _BAD_LOGIN
        if problem is None and password_problem(password) is not None:
            problem = f"password: {password_problem(password)}"
        if problem is not None:
            with self._lock:
                self._refuse(peer, None, now, problem)
        key = self._key(user, password)
        with self._lock:
            good = self._good.get(key)
            if good is not None and good[0] > now:
                account = self._registry.get_account(good[1])
                if account is not None:
                    return self._principal(account, "password")
            if not submit:
                raise AccessDenied("credentials changed during the request: send it again", Code.UNAUTHENTICATED)
            if key in self._pending:
                raise Deferred()
            bad = self._bad.get(key)
            if bad is not None and bad > now:
                self._refuse(peer, user, now, _BAD_LOGIN)
            self._check_limits(peer, user, now)
            self._submit(_Check(key, user, password, peer, self._generation))
        raise Deferred()

    def _principal(self, account: Account, via: str, token_id: str = "") -> Principal:
        key = (account.user_name, via, token_id)
        found = self._principals.get(key)
        if found is None:
            if len(self._principals) >= _MAX_VERDICTS:
                self._principals.clear()
            found = self._principals[key] = Principal(account, via, token_id)
        return found

    def _key(self, user: str, password: str) -> bytes:
        """Keyed (per-process secret) BLAKE2b of (user, password): the verdict maps' key."""
        name = user.encode()
        message = len(name).to_bytes(4, "big") + name + password.encode()
        return hashlib.blake2b(message, key=self._secret, digest_size=32).digest()

    def _refuse(self, peer: bytes, user: str | None, now: float, message: str) -> NoReturn:
        """A failed login (lock held): RATE_LIMITED when over a limit, else UNAUTHENTICATED, counted."""
        self._raise_if_limited(peer, user, now)
        self._peer_failures.add(peer, now)
        if user is not None:
            self._user_failures.add(user, now)
        raise AccessDenied(message, Code.UNAUTHENTICATED)

    def _raise_if_limited(self, peer: bytes, user: str | None, now: float) -> None:
        _raise_if_over(self._peer_failures, peer, now)
        if user is not None:
            _raise_if_over(self._user_failures, user, now)

    def _check_limits(self, peer: bytes, user: str, now: float) -> None:
        """Before a new scrypt run (lock held): the failure limits, then the queue's bounds."""
        self._raise_if_limited(peer, user, now)
        config = self._config
        if len(self._pending) >= config.max_pending_checks:
            busy = f"{len(self._pending)} password checks are queued"
        elif self._pending_peer.get(peer, 0) >= config.max_pending_per_peer:
            busy = "this connection has password checks queued"
        elif self._pending_user.get(user, 0) >= config.max_pending_per_user:
            busy = "this user name has password checks queued"
        else:
            return
        raise Unavailable(f"{busy}: retry in 1 s (or use an API token)", Code.RATE_LIMITED)

    def _submit(self, check: _Check) -> None:
        """Queue ``check`` (lock held); start the checker thread on first use."""
        if self._closed:
            raise Unavailable("the server is stopping", Code.SHUTTING_DOWN)
        self._pending[check.key] = check
        self._pending_peer[check.peer] = self._pending_peer.get(check.peer, 0) + 1
        self._pending_user[check.user] = self._pending_user.get(check.user, 0) + 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvcm-auth", daemon=True)
            self._thread.start()
        self._queue.put(check)

    def _run(self) -> None:
        while True:
            check = self._queue.get()
            if check is None:
                return
            try:
                ok = self._verify(check)
            except Exception:  # a failed check must still release its slot, as a refusal
                log.exception("password check failed")
                ok = False
            self._record(check, ok)

    def _verify(self, check: _Check) -> bool:
        account = self._registry.get_account(check.user)
        matched = verify_password(check.password, account.password_hash if account else self._dummy_hash)
        return matched and account is not None

    def _record(self, check: _Check, ok: bool) -> None:
        now = self._clock()
        with self._lock:
            self._pending.pop(check.key, None)
            _decrement(self._pending_peer, check.peer)
            _decrement(self._pending_user, check.user)
            if check.generation != self._generation:
                return  # an account changed meanwhile: the retried request checks again
            if ok:
                _bounded_put(self._good, check.key, (now + self._config.verdict_cache_s, check.user))
                self._user_failures.clear(check.user)
            else:
                _bounded_put(self._bad, check.key, now + self._config.failed_cache_s)

    # -- tenancy --------------------------------------------------------------------------------

    def _check_tenancy(self, method: Method, request: object, principal: Principal) -> None:
        instance_id = getattr(request, "instance_id", None)
        if not isinstance(instance_id, str):
            instance_id = ""
        owner = self._registry.group_of(instance_id) if instance_id else None
        if method.name == "register_instance":
            group = getattr(request, "instance_group", "")
            if not isinstance(group, str) or not principal.may_use(group):
                raise AccessDenied(
                    f"register_instance: account {principal.user_name!r} may not use instance group {str(group)[:200]!r}",
                    Code.PERMISSION_DENIED,
                )
            if owner is not None and not principal.may_use(owner):
                # Instance ids are one namespace: a taken id is refused, without saying whose it is.
                raise Conflict(f"instance id {instance_id[:200]!r} is taken", Code.DUPLICATE_ENTITY)
        elif owner is not None and not principal.may_use(owner):
            raise instance_not_found(instance_id)


def _bucket(peer: bytes, auth: object) -> bytes:
    """The login rate-limit key of a request: its connection, split by the end client a relay
    names (never merged with another connection's, so naming a client cannot blame someone else)."""
    client = auth.get("client") if isinstance(auth, dict) else getattr(auth, "client", None)
    return peer if not isinstance(client, str) or not client else peer + b"|" + client.encode()


def _auth_of(request: object) -> object:
    if isinstance(request, dict):
        return request.get("auth")
    return getattr(request, "auth", None)


def _credentials(auth: object) -> tuple[str | None, str | None, str | None]:
    """``(user, password, token)`` of a request's ``auth``; refuses anything else."""
    if auth is None:
        raise AccessDenied(
            'authentication required: add "auth": {"token": ...} or {"user": ..., "password": ...}',
            Code.UNAUTHENTICATED,
        )
    if isinstance(auth, dict):
        try:
            auth = msgspec.convert(auth, Credentials, strict=True)
        except msgspec.ValidationError:
            auth = None
    if not isinstance(auth, Credentials):
        raise AccessDenied('"auth" must be {"token": str} or {"user": str, "password": str}', Code.UNAUTHENTICATED)
    if auth.token is not None and auth.password is not None:
        raise AccessDenied('"auth": give a token or a password, not both', Code.UNAUTHENTICATED)
    return auth.user, auth.password, auth.token


def _raise_if_over(failures: _Failures[K], key: K, now: float) -> None:
    wait = failures.retry_after(key, now)
    if wait is not None:
        raise Unavailable(
            f"too many failed logins {failures.what}: retry in {math.ceil(wait)} s (or use an API token)",
            Code.RATE_LIMITED,
        )


def _decrement(counts: dict[K, int], key: K) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _bounded_put(verdicts: dict[bytes, V], key: bytes, value: V) -> None:
    verdicts.pop(key, None)  # re-inserted last: the oldest entry is always first
    if len(verdicts) >= _MAX_VERDICTS:
        verdicts.pop(next(iter(verdicts)))
    verdicts[key] = value

"""Request authentication and authorization against the registry's accounts.

Plugged into the dispatcher as ``Dispatcher(authorize=Authenticator(registry, config.auth))``.
With ``auth.enabled`` off every request is allowed. With it on, every request carries
``"auth": {"user": ..., "password": ...}``; the password is checked against the account's scrypt
hash, and methods flagged ``admin`` need the ``admin`` role.

scrypt is deliberately slow (tens of ms), too slow for every data-plane request, so a
successful check is remembered for ``cache_seconds`` under ``(user, sha256(password))`` — the
password itself is never kept — and forgotten as soon as any account changes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kvcm.config import AuthConfig, ConfigError
from kvcm.dispatch import Method
from kvcm.errors import AccessDenied, Code
from kvcm.model import hash_password, verify_password
from kvcm.registry import ACCOUNT, Registry

log = logging.getLogger("kvcm.auth")

_MAX_CACHED = 4096


class Authenticator:
    """The dispatcher's ``authorize`` hook. Called on the RPC thread (and the HTTP thread)."""

    def __init__(
        self,
        registry: Registry,
        config: AuthConfig,
        cache_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = config.enabled
        self._registry = registry
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._verified: dict[tuple[str, bytes], tuple[float, str]] = {}  # -> (expiry, role)
        if self.enabled:
            self._bootstrap(config)
            # Unknown users are checked against this hash too, so timing does not reveal them.
            self._dummy_hash = hash_password("kvcm-no-such-user")
            registry.on_change(self._on_change)

    def _bootstrap(self, config: AuthConfig) -> None:
        if any(a.role == "admin" for a in self._registry.list_accounts()):
            return
        if not config.admin_password:
            raise ConfigError("auth.admin_password: required to create the first admin account when auth.enabled is on")
        self._registry.ensure_admin(config.admin_user, config.admin_password)
        log.info("created the bootstrap admin account %r", config.admin_user)

    def _on_change(self, kind: str, name: str) -> None:
        if kind == ACCOUNT:
            self._verified.clear()  # a changed password or role takes effect on the next request

    def __call__(self, method: Method, auth: Any) -> None:
        """Allow the call or raise :class:`AccessDenied` (UNAUTHENTICATED / PERMISSION_DENIED)."""
        if not self.enabled:
            return
        role = self._authenticate(auth)
        if method.admin and role != "admin":
            raise AccessDenied(f"{method.name} needs the admin role", Code.PERMISSION_DENIED)

    def _authenticate(self, auth: Any) -> str:
        user, password = _credentials(auth)
        key = (user, hashlib.sha256(password.encode()).digest())
        now = self._clock()
        hit = self._verified.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        account = self._registry.get_account(user)
        ok = verify_password(password, account.password_hash if account else self._dummy_hash)
        if account is None or not ok:
            raise AccessDenied("invalid user name or password", Code.UNAUTHENTICATED)
        if len(self._verified) >= _MAX_CACHED:
            self._verified.clear()
        self._verified[key] = (now + self._cache_seconds, account.role)
        return account.role


def _credentials(auth: Any) -> tuple[str, str]:
    if auth is None:
        raise AccessDenied('authentication required: add "auth": {"user": ..., "password": ...}', Code.UNAUTHENTICATED)
    if not isinstance(auth, dict) or not isinstance(auth.get("user"), str) or not isinstance(auth.get("password"), str):
        raise AccessDenied('"auth" must be {"user": str, "password": str}', Code.UNAUTHENTICATED)
    return auth["user"], auth["password"]

"""API-token RPCs and ``whoami``.

``add_token`` {user_name, name?, ttl_seconds?} returns the token once (only its SHA-256 is
stored); ``revoke_token`` {token_id}; ``list_tokens`` {user_name?} shows ids, owners, labels and
times, never a token nor its digest; all three are admin-only. ``whoami`` (any authenticated
caller) tells the caller's account, role, groups and how it authenticated.
"""

from __future__ import annotations

from kvcm.control.records import Token, now_ms
from kvcm.control.registry import Registry
from kvcm.proto.requests.admin import AddTokenRequest, ListTokensRequest, RevokeTokenRequest, WhoamiRequest
from kvcm.rpc.auth import Authenticator
from kvcm.rpc.dispatch import Method


def describe_token(token: Token, now: int) -> dict[str, object]:
    """A token on the wire: never the token, never its digest."""
    return {
        "token_id": token.token_id,
        "user_name": token.user_name,
        "name": token.name,
        "create_time": token.create_time,
        "expire_time": token.expire_time,
        "expired": token.expired(now),
    }


class _Handlers:
    def __init__(self, registry: Registry, auth: Authenticator) -> None:
        self.registry = registry
        self.auth = auth

    def add_token(self, req: AddTokenRequest) -> dict[str, object]:
        token, record = self.registry.add_token(req.user_name, req.name, req.ttl_seconds)
        return {"token": token, **describe_token(record, record.create_time)}

    def revoke_token(self, req: RevokeTokenRequest) -> dict[str, object]:
        record = self.registry.revoke_token(req.token_id)
        return {"token_id": record.token_id, "user_name": record.user_name}

    def list_tokens(self, req: ListTokensRequest) -> dict[str, object]:
        now = now_ms()
        return {"tokens": [describe_token(t, now) for t in self.registry.list_tokens(req.user_name)]}

    def whoami(self, req: WhoamiRequest) -> dict[str, object]:
        principal = self.auth.principal(req)
        if principal is None:
            return {"auth_enabled": False, "user_name": "", "role": "admin", "groups": ["*"],
                    "authenticated_by": "none"}  # fmt: skip
        return {"auth_enabled": True, **principal.describe()}


def methods(registry: Registry, auth: Authenticator) -> list[Method]:
    h = _Handlers(registry, auth)
    return [
        Method("add_token", h.add_token, AddTokenRequest, writes=True, idempotent=False, admin=True),
        Method("revoke_token", h.revoke_token, RevokeTokenRequest, writes=True, idempotent=False, admin=True),
        Method("list_tokens", h.list_tokens, ListTokensRequest, admin=True),
        Method("whoami", h.whoami, WhoamiRequest),
    ]


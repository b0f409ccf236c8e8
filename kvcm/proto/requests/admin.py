"""Admin requests: API tokens and ``whoami``, ``get_metrics``, and the leader lease
(``leader_demote`` and the elector's config, Tair's LeaderDemote).

``add_token`` returns the token once (only its SHA-256 is stored); ``list_tokens`` shows ids,
owners, labels and times, never a token nor its digest.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvcm.proto.schema import RequestBase

__all__ = [
    "AddTokenRequest", "GetLeaderElectorConfigRequest", "GetMetricsRequest", "LeaderDemoteRequest",
    "ListTokensRequest", "RevokeTokenRequest", "UpdateLeaderElectorConfigRequest", "WhoamiRequest",
]


class AddTokenRequest(RequestBase, kw_only=True):
    user_name: str
    name: str = ""  # a label for people, e.g. "ci-runner"
    ttl_seconds: float = 0.0  # 0 = never expires


class RevokeTokenRequest(RequestBase, kw_only=True):
    token_id: str


class ListTokensRequest(RequestBase, kw_only=True):
    user_name: str = ""  # "" = every account's tokens


class WhoamiRequest(RequestBase, kw_only=True):
    pass


class GetMetricsRequest(RequestBase, kw_only=True):
    pass


class LeaderDemoteRequest(RequestBase, kw_only=True):
    pass


class GetLeaderElectorConfigRequest(RequestBase, kw_only=True):
    pass


class UpdateLeaderElectorConfigRequest(RequestBase, kw_only=True):
    campaign_delay_time_ms: Annotated[int, msgspec.Meta(ge=0, le=3_600_000)]

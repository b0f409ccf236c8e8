"""Engine-tier RPCs: ``add_event_source``, ``remove_event_source``, ``list_event_sources``,
``match_engines``.

``match_engines`` is what a KV-aware router asks: for this prompt (``token_ids``, hashed with the
instance's block size, or ready ``block_keys``), how many leading blocks does each engine source
hold, per medium, best first.

Request schemas accept ``trace_id`` and ``auth`` and refuse unknown fields (INVALID_ARGUMENT
naming the field); replies are plain maps.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvcm.engines.service import EngineService
from kvcm.errors import InvalidArgument
from kvcm.rpc.auth import Authenticator
from kvcm.rpc.dispatch import Estimate, Method, TokenWork
from kvcm.rpc.wire import Raw
from kvcm.schema import Keys, RequestBase, Tokens


# msgspec.Struct named again only so that linters see a Struct (its defaults are copied, not shared).
class _Request(RequestBase, msgspec.Struct, kw_only=True):
    pass


class AddEventSourceRequest(_Request):
    source_id: str
    instance_id: str
    endpoint: str | None = None  # PUB endpoint as given (tcp://, ipc://, inproc://)
    replay_endpoint: str | None = None  # replay ROUTER; absent = no replay (endpoint form)
    host: str | None = None  # instead of endpoint: tcp://host:port+dp_rank (IPv4, IPv6, DNS)
    port: int | None = None  # default events.pub_port (5557)
    replay_port: int | None = None  # default events.replay_port (5558)
    replay: bool = True  # host form only: false = no replay ROUTER
    topic: str = ""
    dp_rank: int = 0
    replay_timeout_s: float | None = None
    backoff_initial_s: float | None = None
    backoff_max_s: float | None = None
    poll_ms: int | None = None


class RemoveEventSourceRequest(_Request):
    source_id: str


class ListEventSourcesRequest(_Request):
    instance_id: str | None = None


class MatchEnginesRequest(_Request):
    instance_id: str
    token_ids: Tokens = []
    block_keys: Keys = []
    lora_name: str | None = None
    media: list[str] | None = None  # e.g. ["GPU"]; absent = every medium
    medium: str | None = None  # shorthand for media=[medium]
    group_idx: int | None = None  # absent = full-attention-like groups
    limit: int = 0  # 0 = every source with a match
    include_stale: bool = False  # also match sources not heard for events.stale_after_s


#: RequestBase's fields: the dispatcher's business, never part of a source's definition.
_COMMON = frozenset(RequestBase.__struct_fields__)


class _Handlers:
    def __init__(self, service: EngineService, auth: Authenticator | None = None) -> None:
        self.service = service
        self.auth = auth

    def add_event_source(self, req: AddEventSourceRequest) -> dict[str, Any]:
        params = {f: getattr(req, f) for f in req.__struct_fields__ if f not in _COMMON}
        return self.service.add_source(params)

    def remove_event_source(self, req: RemoveEventSourceRequest) -> dict[str, Any]:
        return self.service.remove_source(req.source_id)

    def list_event_sources(self, req: ListEventSourcesRequest) -> dict[str, Any]:
        # A non-admin sees the sources (endpoints included) of its own groups' instances only.
        visible = None if self.auth is None else self.auth.visible(req)
        return self.service.list_sources(req.instance_id, visible)

    def match_tokens(self, req: MatchEnginesRequest) -> TokenWork | None:
        """Keys of a token query, derived by the dispatcher a slice at a time before the match."""
        if req.block_keys or not req.token_ids:
            return None

        def done(keys: list[int]) -> None:
            req.block_keys = keys

        return TokenWork(req.token_ids, self.service.instance_lookup(req.instance_id), done)

    def match_cost(self, req: MatchEnginesRequest) -> Estimate:
        return Estimate(len(req.block_keys) * _MATCH_US_PER_KEY, 0, _MATCH_US_PER_KEY)

    def match_engines(self, req: MatchEnginesRequest) -> Raw:
        if req.limit < 0:
            raise InvalidArgument("limit must be >= 0")
        media = req.media if req.media is not None else ([req.medium] if req.medium else None)
        return Raw(self.service.match_packed(
            req.instance_id, req.token_ids, req.block_keys,
            lora_name=req.lora_name, media=media, group_idx=req.group_idx, limit=req.limit,
            include_stale=req.include_stale,
        ))  # fmt: skip


# Work per key of match_engines on the RPC thread (microseconds; docs/limits.md).
_MATCH_US_PER_KEY = 0.5


def methods(service: EngineService, auth: Authenticator | None = None) -> list[Method]:
    """The engine-tier method table for the dispatcher; ``auth`` filters ``list_event_sources``."""
    h = _Handlers(service, auth)
    return [
        Method("add_event_source", h.add_event_source, AddEventSourceRequest, writes=True, admin=True),
        Method("remove_event_source", h.remove_event_source, RemoveEventSourceRequest, writes=True, idempotent=False, admin=True),
        Method("list_event_sources", h.list_event_sources, ListEventSourcesRequest),
        Method("match_engines", h.match_engines, MatchEnginesRequest, cost=h.match_cost, tokens=h.match_tokens),
    ]

"""Engine-tier RPCs: ``add_event_source``, ``remove_event_source``, ``list_event_sources``,
``match_engines``, ``note_routed``, ``get_host_cache_state``.

``match_engines`` is what a KV-aware router asks: for this prompt (``token_ids``, hashed with the
instance's block size, or ready ``block_keys``), how many leading blocks does each engine source
hold, per medium, scored by tier and the caller's loads, best first, grouped by pod too
(docs/routers.md).

Request schemas accept ``trace_id`` and ``auth`` and refuse unknown fields (INVALID_ARGUMENT
naming the field); replies are plain maps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from kvcm.cache.manager import CacheManager
from kvcm.engines.scoring import BLOCKS, MAX_LOAD, SCORE, SOURCE, pod_summary
from kvcm.engines.service import EngineService
from kvcm.errors import InvalidArgument
from kvcm.rpc.auth import Authenticator
from kvcm.rpc.dispatch import Estimate, Method, TokenWork
from kvcm.rpc.wire import Raw
from kvcm.schema import Keys, RequestBase, Tokens

#: ``loads``: source id -> load, each checked while decoding (a router sends a hundred per call).
#: NaN fails the bounds too.
Loads = dict[Annotated[str, msgspec.Meta(max_length=200)], Annotated[float, msgspec.Meta(ge=0.0, le=MAX_LOAD)]]


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
    pod: str | None = None  # the pod this DP rank belongs to (match_engines groups by it); absent = source_id
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
    top_k: int = 0  # the same as limit (the name routers use); give one of them
    loads: Loads | None = None  # source_id -> load, subtracted from its score (docs/routers.md)
    include_storage: bool = False  # add the storage tier's prefix as the pseudo-source "storage"


class NoteRoutedRequest(_Request):
    instance_id: str
    source_id: str
    token_ids: Tokens = []
    block_keys: Keys = []
    lora_name: str | None = None  # the adapter the prompt runs with (matches of that adapter count it)
    ttl_s: float = 2.0  # at most events.speculative_max_ttl_s


class GetHostCacheStateRequest(_Request):
    """Tair KVCM's GetHostCacheState, answered from match_engines (docs/routers.md)."""

    instance_id: str
    block_cache_keys: Keys = []  # Tair's name of block_keys
    block_keys: Keys = []
    token_ids: Tokens = []
    query_type: str | int = "prefix_match"  # prefix matching only: "prefix_match", "QT_PREFIX_MATCH" or 2
    medium: list[str] | None = None  # Tair's media filter; absent or empty = every medium
    p2p_host_count: int = 0  # Tair's P2P peer count: accepted, kvcm does not plan P2P fetches
    top_k: int = 0  # 0 = every host
    loads: Loads | None = None
    include_stale: bool = False
    include_storage: bool = True


#: RequestBase's fields: the dispatcher's business, never part of a source's definition.
_COMMON = frozenset(RequestBase.__struct_fields__)


class _Handlers:
    def __init__(
        self, service: EngineService, auth: Authenticator | None = None, cache: Callable[[], CacheManager | None] | None = None
    ) -> None:
        self.service = service
        self.auth = auth
        self.cache = cache

    def add_event_source(self, req: AddEventSourceRequest) -> dict[str, Any]:
        params = {f: getattr(req, f) for f in req.__struct_fields__ if f not in _COMMON}
        return self.service.add_source(params)

    def remove_event_source(self, req: RemoveEventSourceRequest) -> dict[str, Any]:
        return self.service.remove_source(req.source_id)

    def list_event_sources(self, req: ListEventSourcesRequest) -> dict[str, Any]:
        # A non-admin sees the sources (endpoints included) of its own groups' instances only.
        visible = None if self.auth is None else self.auth.visible(req)
        return self.service.list_sources(req.instance_id, visible)

    def match_tokens(self, req: MatchEnginesRequest | NoteRoutedRequest | GetHostCacheStateRequest) -> TokenWork | None:
        """Keys of a token query, derived by the dispatcher a slice at a time before the match."""
        if req.block_keys or not req.token_ids or getattr(req, "block_cache_keys", None):
            return None

        def done(keys: list[int]) -> None:
            req.block_keys = keys

        return TokenWork(req.token_ids, self.service.instance_lookup(req.instance_id), done)

    def match_cost(self, req: MatchEnginesRequest) -> Estimate:
        return Estimate(len(req.block_keys) * _MATCH_US_PER_KEY, 0, _MATCH_US_PER_KEY)

    def host_cost(self, req: GetHostCacheStateRequest) -> Estimate:
        n = len(req.block_keys or req.block_cache_keys)
        return Estimate(n * _MATCH_US_PER_KEY, 0, _MATCH_US_PER_KEY)

    def match_engines(self, req: MatchEnginesRequest) -> Raw:
        media = req.media if req.media is not None else ([req.medium] if req.medium else None)
        storage = self._storage_prefix(req.instance_id, req.token_ids, req.block_keys) if req.include_storage else None
        return Raw(self.service.match_packed(
            req.instance_id, req.token_ids, req.block_keys,
            lora_name=req.lora_name, media=media, group_idx=req.group_idx, limit=_top_k(req.limit, req.top_k),
            include_stale=req.include_stale, loads=_check_loads(req.loads, self.service.settings.max_sources),
            storage=storage,
        ))  # fmt: skip

    def _storage_prefix(self, instance_id: str, token_ids: list[int], block_keys: list[int]) -> dict[str, int]:
        """Storage type -> blocks of the storage tier's prefix of the query: what
        ``get_cache_location`` with ``prefix_match`` answers for the instance."""
        cache = self.cache() if self.cache is not None else None
        if cache is None:
            raise InvalidArgument("include_storage: this server has no storage tier to ask")
        keys = self.service.keys_for(instance_id, token_ids, block_keys)
        if not keys:
            return {}
        reply = cache.get_cache_location(instance_id, "prefix_match", keys, None, None)
        counts: dict[str, int] = {}
        for loc in _LOCATIONS.decode(reply.data).locations:
            counts[loc.type] = counts.get(loc.type, 0) + 1
        return counts

    def note_routed(self, req: NoteRoutedRequest) -> dict[str, Any]:
        return self.service.note_routed(req.instance_id, req.source_id, req.token_ids, req.block_keys, req.ttl_s,
                                        req.lora_name)  # fmt: skip

    def get_host_cache_state(self, req: GetHostCacheStateRequest) -> dict[str, Any]:
        """Tair's per-host answer from the same ranking: ``local`` is the pod's own prefix,
        ``p2p_1_total_match`` the longest prefix held anywhere (any engine, or kvcm's storage
        tier) and ``p2p_1_fetch`` the blocks the pod would fetch to reach it."""
        if req.query_type not in ("prefix_match", "QT_PREFIX_MATCH", 2):
            raise InvalidArgument(f"query_type: only prefix matching is answered, got {str(req.query_type)[:40]!r}")
        if req.block_cache_keys and req.block_keys:
            raise InvalidArgument("block_cache_keys and block_keys: give one of them")
        if not 0 <= req.p2p_host_count <= _MAX_TOP_K:
            raise InvalidArgument(f"p2p_host_count must be in 0..{_MAX_TOP_K}")
        service = self.service
        block_size = service.instance_lookup(req.instance_id)
        keys = service.keys_for(req.instance_id, req.token_ids, req.block_cache_keys or req.block_keys)
        storage = self._storage_prefix(req.instance_id, [], keys) if req.include_storage else {}
        ranked = service.ranked(req.instance_id, keys, block_size, media=req.medium or None,
                                include_stale=req.include_stale,
                                loads=_check_loads(req.loads, service.settings.max_sources))  # fmt: skip
        pods = pod_summary(ranked)
        shared = max([sum(storage.values())] + [best[BLOCKS] for _, best, _ in pods])
        hosts = [_host(pod, best[BLOCKS], shared, best[SCORE], best[SOURCE], ranks) for pod, best, ranks in pods]
        listed = {h["host_ip_port"] for h in hosts}
        for pod, ranks in service.pods_of(req.instance_id, req.include_stale).items():
            if pod not in listed:  # Tair lists every host of the instance, holding nothing or not
                hosts.append(_host(pod, 0, shared, -(req.loads or {}).get(ranks[0], 0.0), ranks[0], ranks))
        limit = _top_k(0, req.top_k)
        return {"instance_id": req.instance_id, "num_blocks": len(keys), "global": shared,
                "storage": sum(storage.values()), "hosts": hosts[:limit] if limit else hosts}  # fmt: skip


def _host(pod: str, local: int, shared: int, score: float, best: str, ranks: list[str]) -> dict[str, Any]:
    return {"host_ip_port": pod, "local": local, "p2p_1_fetch": max(0, shared - local),
            "p2p_1_total_match": max(shared, local), "score": score, "best_source": best, "sources": ranks}  # fmt: skip


class _Location(msgspec.Struct):
    type: str


class _Locations(msgspec.Struct):
    locations: list[_Location]


_LOCATIONS = msgspec.msgpack.Decoder(_Locations)


def _top_k(limit: int, top_k: int) -> int:
    for name, value in (("limit", limit), ("top_k", top_k)):
        if not 0 <= value <= _MAX_TOP_K:
            raise InvalidArgument(f"{name} must be in 0..{_MAX_TOP_K}, got {value}")
    if limit and top_k and limit != top_k:
        raise InvalidArgument(f"top_k ({top_k}) and limit ({limit}) disagree: give one of them")
    return top_k or limit


def _check_loads(loads: dict[str, float] | None, most: int) -> dict[str, float] | None:
    """Loads are per source: at most one per followed source (each id and value is bounded by
    the request schema, :data:`Loads`)."""
    if not loads:
        return None
    if len(loads) > most:
        raise InvalidArgument(f"loads: {len(loads)} entries, more than the {most} sources followed at most "
                              f"(events.max_sources)")  # fmt: skip
    return loads


# Work per key of match_engines on the RPC thread (microseconds; docs/limits.md).
_MATCH_US_PER_KEY = 0.5
_MAX_TOP_K = 1 << 16


def methods(
    service: EngineService, auth: Authenticator | None = None, cache: Callable[[], CacheManager | None] | None = None
) -> list[Method]:
    """The engine-tier method table for the dispatcher; ``auth`` filters ``list_event_sources``;
    ``cache`` returns the data plane (built after the engine tier) for ``include_storage``."""
    h = _Handlers(service, auth, cache)
    return [
        Method("add_event_source", h.add_event_source, AddEventSourceRequest, writes=True, admin=True),
        Method("remove_event_source", h.remove_event_source, RemoveEventSourceRequest, writes=True, idempotent=False, admin=True),
        Method("list_event_sources", h.list_event_sources, ListEventSourcesRequest),
        Method("match_engines", h.match_engines, MatchEnginesRequest, cost=h.match_cost, tokens=h.match_tokens),
        Method("note_routed", h.note_routed, NoteRoutedRequest, idempotent=False, tokens=h.match_tokens),
        Method("get_host_cache_state", h.get_host_cache_state, GetHostCacheStateRequest, cost=h.host_cost,
               tokens=h.match_tokens),
    ]

"""The engine tier as one object: sources, index, subscriber and metrics wired together.

:class:`EngineService` is what ``kvcm/api/engines.py`` calls and what ``app.py`` starts and stops.
It validates requests, keeps the index and the subscriber in step (the index owns the persisted
source list; the subscriber owns the sockets), and shapes replies.

Thread ownership: public methods are called from the RPC thread; the subscriber runs on its own
thread (:meth:`start`), or is driven by tests through ``service.subscriber.poll_once``.

At most ``settings.max_sources`` sources are followed, static and persisted ones included: past
it ``add_event_source`` is refused (REACH_MAX_ENTITY_CAPACITY) rather than accepted and never
connected, and a start-up that would exceed it (a lowered limit, too many static sources) fails
with a ConfigError. With auth on, a non-admin account's push registrations stop earlier: at
``settings.max_sources_per_account`` sources of its own, and when only the
``settings.reserved_admin_sources`` kept for admins are left, so no tenant can take every slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from kvcm.backends.metastore.base import MetaStore
from kvcm.cache.keys import derive_keys
from kvcm.config import ConfigError
from kvcm.engines.budget import WorkBudget
from kvcm.engines.entries import SourceMatch, SourceState
from kvcm.engines.index import EngineIndex, Run
from kvcm.engines.metrics import EventMetrics
from kvcm.engines.push import PushIngest, Report, Reporter
from kvcm.engines.queries import EngineLocation
from kvcm.engines.scoring import (
    ENTRY,
    STORAGE,
    Fragment,
    encode_loaded,
    encode_pods,
    encode_runs,
    encode_sources,
    fragment,
    map_header,
    order_ties,
    parse_weights,
    sort_ranked,
    with_loads,
)
from kvcm.engines.sources import (
    SourceSpec,
    StaticSource,
    SubscriberSettings,
    build_spec,
    static_specs,
)
from kvcm.engines.speculative import SpeculativeEntries, with_speculative
from kvcm.engines.subscriber import EventSubscriber
from kvcm.errors import Code, InvalidArgument, NotFound, error
from kvcm.proto.wire import Encodable

#: The main store's database of event-source definitions (see ``EngineService(shared=...)``).
DEFINITIONS = "source_defs"

log = logging.getLogger("kvcm.engines")
_ENCODER = msgspec.msgpack.Encoder()
# match_engines' reply: {instance_id, num_blocks, num_tokens, sources, pods, stale_sources,
# freshness[, storage]}, assembled from encoded pieces (kvcm.engines.scoring).
_REPLY_HEAD = map_header(7) + _ENCODER.encode("instance_id")
_REPLY_HEAD_STORAGE = map_header(8) + _ENCODER.encode("instance_id")
_NUM_BLOCKS = _ENCODER.encode("num_blocks")
_NUM_TOKENS = _ENCODER.encode("num_tokens")
_SOURCES = _ENCODER.encode("sources")
_PODS = _ENCODER.encode("pods")
_STALE = _ENCODER.encode("stale_sources")
_FRESHNESS = _ENCODER.encode("freshness")
_STORAGE = _ENCODER.encode(STORAGE)


def _unknown_parent(errors: Mapping[str, int], report_mode: str) -> dict[str, Encodable]:
    """``unknown_parent`` (stores skipped since start-up because kvcm never saw their parent
    block) and, when there are any, what to make of them."""
    n = errors.get("unknown_parent", 0)
    if not n:
        return {"unknown_parent": 0}
    if report_mode == "full":
        hint = ("stores named a parent block kvcm never saw (kvcm joined after the engine's replay buffer rolled "
                "over, or the parent was evicted here): their blocks are not indexed; the engine's next request "
                "over such a prefix re-reports it from its root (report_mode full) and fills it in")
    else:
        hint = ("stores named a parent block kvcm never saw (kvcm joined after the engine's replay buffer rolled "
                "over, or the parent was evicted here): their blocks stay unindexed until the engine stores the "
                "prefix again from its root; with vLLM's kv_cache_report_mode \"full\" on the engine's requests and "
                "report_mode full here, the next request over a prefix fills it in")
    return {"unknown_parent": n, "unknown_parent_hint": hint}


class EngineService:
    """Sources + engine index + subscriber (see the module docstring).

    :param store: where the engine index and source positions persist (None = memory only).
        It may be a separate non-syncing LMDB environment: the engine index can be rebuilt
        from the engines, so it needs to survive a kvcm crash, not a power loss.
    :param instance_lookup: ``instance_id -> block_size``; raises ``NotFound`` for unknown ids.
    """

    def __init__(
        self,
        store: MetaStore | None,
        instance_lookup: Callable[[str], int],
        settings: SubscriberSettings | None = None,
        registry: CollectorRegistry | None = None,
        static_sources: Sequence[StaticSource] = (),
        shared: MetaStore | None = None,
    ) -> None:
        """:param shared: the main metadata store, where the sources added by RPC are defined
            once for every node (:meth:`follow_definitions`); None = this node's own only."""
        self.settings = settings or SubscriberSettings()
        self.shared = shared
        self.instance_lookup = instance_lookup
        try:
            self.weights = parse_weights(self.settings.tier_weights)
        except ValueError as exc:
            raise ConfigError(f"events.tier_weights: {exc}") from None
        self.push_budget = WorkBudget(self.settings.push_budget_ms_per_s)
        self.speculative = SpeculativeEntries(self.settings.speculative_max_entries, self.settings.speculative_max_ttl_s)
        self.metrics = EventMetrics(registry)
        self.index = EngineIndex(store, instance_lookup, self.settings.max_blocks_per_source, self.settings.max_blocks)
        self.subscriber = EventSubscriber(self.index, self.settings, self.metrics)
        self.push = PushIngest(self.index, self.subscriber, self.metrics, instance_lookup, self._check_push_room)
        loaded = self.index.load()
        statics = static_specs(tuple(static_sources), self.settings)
        self._check_start_count(loaded, statics)
        for state in loaded:
            self.subscriber.add(state.spec, state.generation, state.last_seq, state.last_ts)
        for spec in statics:
            self._add_static(spec)

    def _check_start_count(self, loaded: Sequence[SourceState], statics: Sequence[SourceSpec]) -> None:
        ids = {state.spec.source_id for state in loaded} | {spec.source_id for spec in statics}
        if len(ids) > self.settings.max_sources:
            raise ConfigError(
                f"{len(ids)} event sources ({len(statics)} static, {len(loaded)} registered) exceed "
                f"events.max_sources={self.settings.max_sources}: raise it, or drop sources "
                f"(events.sources, remove_event_source)"
            )

    def _add_static(self, spec: SourceSpec) -> None:
        old = self.index.get(spec.source_id)
        if old is not None and old.spec != spec:
            # the config changed under a persisted source: its blocks may be another pod's
            self.subscriber.remove(spec.source_id)
            self.index.remove_source(spec.source_id)
        elif old is not None:
            return
        state = self.index.add_source(spec)
        self.subscriber.add(spec, state.generation)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self.subscriber.start()

    def stop(self) -> None:
        self.subscriber.stop()
        self.index.flush()

    # --- sources --------------------------------------------------------------------------------

    def add_source(self, params: dict[str, Any]) -> dict[str, Encodable]:
        """Validate, persist and start following a source. Re-adding an identical spec is a no-op."""
        spec = build_spec({k: v for k, v in params.items() if v is not None}, self.settings)
        self.instance_lookup(spec.instance_id)  # raises NotFound for an unknown instance
        existed = self.index.get(spec.source_id) is not None
        if not existed:
            self._check_room()
        state = self.index.add_source(spec)
        if not existed:
            self.subscriber.add(spec, state.generation, state.last_seq, state.last_ts)
        if self.shared is not None:
            with self.shared.write(join=True) as txn:
                txn.put(DEFINITIONS, spec.source_id.encode(), msgspec.msgpack.encode(spec.to_dict()))
        return {"source": self._describe(state, {})}

    def _check_room(self) -> None:
        count, limit = len(self.index.sources()), self.settings.max_sources
        if count >= limit:
            raise error(Code.REACH_MAX_ENTITY_CAPACITY,
                        f"{count} event sources are followed, the most allowed (events.max_sources={limit}); "
                        f"remove one first")

    def _check_push_room(self, reporter: Reporter | None) -> None:
        """Room for a new push source: the server-wide limit, and for a non-admin account its own
        quota and the slots kept for admins (module docstring)."""
        self._check_room()
        if reporter is None or reporter.admin:
            return
        sources = self.index.sources()
        owned = sum(1 for s in sources if s.spec.push and s.spec.owner == reporter.name)
        quota = self.settings.max_sources_per_account
        if owned >= quota:
            raise error(Code.REACH_MAX_ENTITY_CAPACITY,
                        f"account {reporter.name[:200]!r} has {owned} push sources, the most one account may "
                        f"register (events.max_sources_per_account={quota}); send op down for one first")
        open_to_users = self.settings.max_sources - self.settings.reserved_admin_sources
        if len(sources) >= open_to_users:
            raise error(Code.REACH_MAX_ENTITY_CAPACITY,
                        f"the event source slots open to non-admin accounts are taken; the last "
                        f"{self.settings.reserved_admin_sources} of events.max_sources={self.settings.max_sources} "
                        f"are kept for admins (events.reserved_admin_sources)")

    def report_events(self, report: Report, reporter: Reporter | None = None) -> dict[str, Encodable]:
        """``report_events``: a push source registers, heartbeats, reports or goes down
        (:mod:`kvcm.engines.push`); ``reporter`` is the caller with auth on (None: auth off).
        Push sources are this node's own: never shared definitions."""
        return self.push.report(report, reporter)

    def remove_source(self, source_id: str) -> dict[str, Encodable]:
        """Stop following a source and drop exactly its blocks and metrics."""
        state = self.index.remove_source(source_id)
        self.subscriber.remove(source_id)
        self.speculative.forget_source(source_id)
        self.metrics.remove_source(source_id)
        if self.shared is not None and not state.spec.push:
            with self.shared.write(join=True) as txn:
                txn.delete(DEFINITIONS, source_id.encode())
        return {"source_id": source_id, "instance_id": state.spec.instance_id}

    def adopt_definitions(self) -> tuple[int, int]:
        """The leader, at start. While the shared store defines no source yet (the first
        leader, or a data dir from before shared definitions) it defines the RPC-added sources
        this node follows there; otherwise the shared definitions win, as on a follower
        (:meth:`follow_definitions`). Returns (added, removed) here, or (defined, 0)."""
        if self.shared is None:
            return 0, 0
        with self.shared.read() as view:
            empty = not any(True for _ in view.scan(DEFINITIONS, limit=1))
        if not empty:
            return self.follow_definitions()
        mine = [s.spec for s in self.index.sources() if not s.spec.static and not s.spec.push]
        if mine:
            with self.shared.write() as txn:
                for spec in mine:
                    txn.put(DEFINITIONS, spec.source_id.encode(), msgspec.msgpack.encode(spec.to_dict()))
        return len(mine), 0

    def follow_definitions(self) -> tuple[int, int]:
        """A follower, when the shared definitions changed: follow every source defined there,
        drop the RPC-added ones no longer defined (the config's own stay); returns (added,
        removed)."""
        if self.shared is None:
            return 0, 0
        with self.shared.read() as view:
            defined = {k.decode(): SourceSpec.from_dict(msgspec.msgpack.decode(v)) for k, v in view.scan(DEFINITIONS)}
        added = removed = 0
        for state in self.index.sources():
            spec = state.spec
            if not spec.static and not spec.push and defined.get(spec.source_id) != spec:
                self.subscriber.remove(spec.source_id)
                self.index.remove_source(spec.source_id)
                self.metrics.remove_source(spec.source_id)
                removed += 1
        for source_id, spec in defined.items():
            if self.index.get(source_id) is None:
                state = self.index.add_source(spec)
                self.subscriber.add(spec, state.generation, state.last_seq, state.last_ts)
                added += 1
        return added, removed

    def list_sources(
        self, instance_id: str | None = None, visible: Callable[[str], bool] | None = None
    ) -> dict[str, Encodable]:
        """Every source, or those of ``instance_id``; ``visible(instance_id)`` (tenancy) hides
        the sources of the instances it refuses, as if they did not exist."""
        snap = self.subscriber.snapshot()
        out = [
            self._describe(state, snap.get(state.spec.source_id, {}))
            for state in sorted(self.index.sources(), key=lambda s: s.spec.source_id)
            if (instance_id is None or state.spec.instance_id == instance_id)
            and (visible is None or visible(state.spec.instance_id))
        ]
        return {"sources": out}

    def _describe(self, state: SourceState, conn: dict[str, Any]) -> dict[str, Encodable]:
        spec = state.spec
        held = self.index.blocks_held(spec.source_id)
        for medium, n in held.items():
            self.metrics.note("blocks", spec.source_id, medium)
            self.metrics.blocks.labels(spec.source_id, medium).set(n)
        return {
            "source_id": spec.source_id,
            "instance_id": spec.instance_id,
            "endpoint": spec.endpoint,
            "replay_endpoint": spec.replay_endpoint,
            "topic": spec.topic,
            "dp_rank": spec.dp_rank,
            "pod": spec.pod or spec.source_id,
            "static": spec.static,
            "kind": spec.kind,
            "connected": bool(conn.get("connected", False)),
            "replaying": bool(conn.get("replaying", False)),
            "last_seq": state.last_seq,
            "missed": conn.get("missed", 0),
            "replays": conn.get("replays", 0),
            "replay_failures": conn.get("replay_failures", 0),
            "restarts": conn.get("restarts", 0),
            "duplicates": conn.get("duplicates", 0),
            "errors": conn.get("errors", 0),
            "errors_by_kind": conn.get("errors_by_kind", {}),
            "connections": conn.get("connections", 0),
            "disconnections": conn.get("disconnections", 0),
            "blocks_held": sum(held.values()),
            "blocks_by_medium": held,
            "last_event_time": state.last_event_time or None,
            "state": conn.get("state", "live"),
            "age_s": round(conn.get("age_s", 0.0), 3),
            "last_heard": conn.get("last_heard"),
            "last_rebuild": conn.get("last_rebuild"),
            "probes": conn.get("probes", 0),
            "probe_failures": conn.get("probe_failures", 0),
            "rebuilds": conn.get("rebuilds", 0),
            "expired": conn.get("expired", 0),
            "expired_blocks": conn.get("expired_blocks", 0),
            "evicted_blocks": state.evicted,
            "report_mode": spec.report_mode,
            **_unknown_parent(conn.get("errors_by_kind", {}), spec.report_mode),
            **({"generation": spec.generation, "medium": spec.medium or "GPU"} if spec.push else {}),
        }

    # --- liveness ---------------------------------------------------------------------------------

    def freshness(self, source_id: str) -> tuple[str, float]:
        """``(state, age_s)`` of a source: ``live``, ``replaying``, ``gap``, ``stale`` or
        ``expired``, and seconds since it was last heard (see ``kvcm.engines.subscriber``).

        :raises NotFound: for a source that is not followed."""
        if self.index.get(source_id) is None:
            raise NotFound(f"no event source {source_id[:200]!r}")
        known = self.subscriber.freshness(source_id)
        return known if known is not None else ("live", 0.0)  # added, not yet picked up

    def _left_out(self, instance_id: str, include_stale: bool) -> frozenset[str]:
        """The instance's stale sources, which a match leaves out unless asked for them."""
        stale = self.subscriber.stale_ids
        if include_stale or not stale:
            return frozenset()
        return frozenset(s for s in stale if (st := self.index.get(s)) is not None and st.spec.instance_id == instance_id)

    # --- queries ----------------------------------------------------------------------------------

    def keys_for(self, instance_id: str, token_ids: Sequence[int] | None, block_keys: Sequence[int] | None) -> list[int]:
        """The query's kvcm keys: ``block_keys`` verbatim, else hashed from ``token_ids``."""
        return derive_keys(block_keys, token_ids, self.instance_lookup(instance_id))

    def match(
        self,
        instance_id: str,
        token_ids: Sequence[int] | None = None,
        block_keys: Sequence[int] | None = None,
        **options: Any,
    ) -> dict[str, Encodable]:
        """``match_engines`` as a map (:meth:`match_packed`'s options)."""
        reply: dict[str, Any] = msgspec.msgpack.decode(self.match_packed(instance_id, token_ids, block_keys, **options))
        return reply

    def match_packed(
        self,
        instance_id: str,
        token_ids: Sequence[int] | None = None,
        block_keys: Sequence[int] | None = None,
        *,
        lora_name: str | None = None,
        media: Sequence[str] | None = None,
        group_idx: int | None = None,
        limit: int = 0,
        include_stale: bool = False,
        loads: Mapping[str, float] | None = None,
        storage: Mapping[str, int] | None = None,
    ) -> bytes:
        """``match_engines``' reply bytes: per source and per pod, the longest held prefix split
        by medium, scored (:mod:`kvcm.engines.scoring`), best first; ``limit`` keeps the best
        N sources; stale sources are left out (and counted) unless ``include_stale``;
        ``storage`` (storage type -> blocks of the storage tier's prefix) adds the ``storage``
        pseudo-source."""
        block_size = self.instance_lookup(instance_id)
        # ready keys are only read below: no copy of a long list per call
        keys = block_keys if block_keys else derive_keys(block_keys, token_ids, block_size)
        left_out = self._left_out(instance_id, include_stale)
        distinct = self.index.pods_distinct(instance_id)
        runs = self.index.ranked(instance_id, keys, block_size=block_size, weight=self.weights.of,
                                 lora_name=lora_name, media=media, group_idx=group_idx, exclude=left_out)  # fmt: skip
        if runs is not None and runs[1] and not loads and limit <= 0 and not self.speculative.active(instance_id):
            # every source weighs the same: the walk's order is the ranking, kept encoded per run
            middle = encode_runs(runs[0], block_size, distinct, _SOURCES, _PODS)
        else:
            ranked, in_order = self._matched(instance_id, keys, block_size, lora_name, media, group_idx, left_out, runs)
            if loads:
                if not in_order:
                    order_ties(ranked)
                sources, pods = encode_loaded(ranked, loads, limit, block_size, distinct)
            else:
                sort_ranked(ranked, in_order)
                if limit > 0:
                    del ranked[limit:]
                sources, pods = encode_sources(ranked), encode_pods(ranked, block_size, distinct)
            middle = [_SOURCES, sources, _PODS, pods]
        num_tokens = len(token_ids) if token_ids else len(keys) * block_size
        parts = [
            _REPLY_HEAD if storage is None else _REPLY_HEAD_STORAGE, _ENCODER.encode(instance_id),
            _NUM_BLOCKS, _ENCODER.encode(len(keys)), _NUM_TOKENS, _ENCODER.encode(num_tokens), *middle,
            _STALE, _ENCODER.encode(len(left_out)), _FRESHNESS, self.subscriber.instance_freshness(instance_id)[1],
        ]  # fmt: skip
        if storage is not None:
            parts += (_STORAGE, self.storage_fragment(storage, block_size)[ENTRY])
        return b"".join(parts)

    def ranked(
        self,
        instance_id: str,
        keys: Sequence[int],
        block_size: int,
        lora_name: str | None = None,
        media: Sequence[str] | None = None,
        group_idx: int | None = None,
        include_stale: bool = False,
        loads: Mapping[str, float] | None = None,
    ) -> list[Fragment]:
        """The matching sources' fragments, best first (speculative entries and loads in;
        stale sources left out unless ``include_stale``)."""
        left_out = self._left_out(instance_id, include_stale)
        runs = self.index.ranked(instance_id, keys, block_size=block_size, weight=self.weights.of,
                                 lora_name=lora_name, media=media, group_idx=group_idx, exclude=left_out)  # fmt: skip
        ranked, in_order = self._matched(instance_id, keys, block_size, lora_name, media, group_idx, left_out, runs)
        if loads:
            ranked = with_loads(ranked, loads)
        sort_ranked(ranked, in_order)
        return ranked

    def _matched(
        self,
        instance_id: str,
        keys: Sequence[int],
        block_size: int,
        lora_name: str | None,
        media: Sequence[str] | None,
        group_idx: int | None,
        left_out: frozenset[str],
        runs: tuple[list[Run], bool] | None,
    ) -> tuple[list[Fragment], bool]:
        """The matching sources' fragments, speculative entries in, and whether they are in
        tie order already (:func:`~kvcm.engines.scoring.sort_ranked`). ``runs``: the index's
        fast-path answer (:meth:`EngineIndex.ranked`), None if a source needs merging."""
        ranked = None if runs is None else list(chain.from_iterable(run[0] for run in runs[0]))
        in_order = ranked is not None
        explained: dict[str, dict[str, Encodable]] = {}  # hybrid sources: their groups' detail
        if ranked is None:  # a source with several media or groups: merge per source first
            found = self.index.match(instance_id, keys, lora_name=lora_name, media=media, group_idx=group_idx,
                                     exclude=left_out)  # fmt: skip
            ranked = [self._merged_fragment(m, block_size) for m in found]
            explained = {m.source_id: _explanation(m) for m in found if m.groups is not None}
        if self.speculative.active(instance_id):
            ranked = with_speculative(self.speculative, self.index, instance_id, lora_name, keys, ranked, block_size,
                                      left_out, self.settings.speculative_weight, explained)  # fmt: skip
            in_order = False
        return ranked, in_order

    def _merged_fragment(self, m: SourceMatch, block_size: int) -> Fragment:
        state = self.index.get(m.source_id)
        pod = (state.spec.pod if state is not None else "") or m.source_id
        extra = _explanation(m) if m.groups is not None else None
        return fragment(m.source_id, m.dp_rank, pod, m.media, m.matched_blocks, block_size,
                        self.weights.weighted_blocks(m.media), extra)  # fmt: skip

    def storage_fragment(self, storage: Mapping[str, int], block_size: int) -> Fragment:
        """The storage tier as a pseudo-source: per storage type its blocks of the prefix, each
        at its storage type's weight (the types hold disjoint blocks of one prefix)."""
        total = sum(storage.values())
        score = sum(self.weights.of_storage(t) * n for t, n in storage.items())
        return fragment(STORAGE, 0, STORAGE, storage, total, block_size, score)

    def pods_of(self, instance_id: str, include_stale: bool = False) -> dict[str, list[str]]:
        """The instance's pods (stale sources left out unless ``include_stale``), each with its
        sources by id."""
        left_out = self._left_out(instance_id, include_stale)
        pods: dict[str, list[str]] = {}
        for state in sorted(self.index.sources(), key=lambda s: s.spec.source_id):
            spec = state.spec
            if spec.instance_id == instance_id and spec.source_id not in left_out:
                pods.setdefault(spec.pod or spec.source_id, []).append(spec.source_id)
        return pods

    # --- speculative entries ----------------------------------------------------------------------

    def note_routed(self, instance_id: str, source_id: str, token_ids: Sequence[int] | None,
                    block_keys: Sequence[int] | None, ttl_s: float, lora_name: str | None = None) -> dict[str, Encodable]:
        """A router sent this prompt to ``source_id``: count its blocks for that source until
        the engine's event confirms them or ``ttl_s`` ends (:mod:`kvcm.engines.speculative`).
        A prompt shorter than one block has nothing to count: nothing is noted (``num_blocks`` 0).

        A source of another instance answers exactly as a missing one: the instance named is
        the caller's (tenancy checked it), the source's may be another tenant's."""
        state = self.index.get(source_id)
        if state is None or state.spec.instance_id != instance_id:
            raise NotFound(f"no event source {source_id[:200]!r} of instance {instance_id[:200]!r}")
        if not 0 < ttl_s <= self.speculative.max_ttl_s:
            raise InvalidArgument(f"ttl_s must be in (0, {self.speculative.max_ttl_s:g}] "
                                  f"(events.speculative_max_ttl_s), got {ttl_s}")  # fmt: skip
        keys = self.keys_for(instance_id, token_ids, block_keys)
        self.speculative.note(instance_id, source_id, keys, ttl_s, lora_name)
        return {"instance_id": instance_id, "source_id": source_id, "num_blocks": len(keys), "ttl_s": ttl_s}

    def engine_locations(self, instance_id: str, keys: Sequence[int], lora_name: str | None = None) -> list[list[EngineLocation]]:
        """Per key, the engines holding it: for ``get_cache_location(include_engines=true)``."""
        return self.index.locations(instance_id, keys, lora_name=lora_name)


def _explanation(m: SourceMatch) -> dict[str, Encodable]:
    """A hybrid source's entry fields that say why its prefix is what it is."""
    return {"groups": m.groups} if m.unsupported is None else {"groups": m.groups, "unsupported": m.unsupported}

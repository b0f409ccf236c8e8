"""The engine tier as one object: sources, index, subscriber and metrics wired together.

:class:`EngineService` is what ``kvcm/api/engines.py`` calls and what ``app.py`` starts and stops.
It validates requests, keeps the index and the subscriber in step (the index owns the persisted
source list; the subscriber owns the sockets), and shapes replies.

Thread ownership: public methods are called from the RPC thread; the subscriber runs on its own
thread (:meth:`start`), or is driven by tests through ``service.subscriber.poll_once``.

At most ``settings.max_sources`` sources are followed, static and persisted ones included: past
it ``add_event_source`` is refused (REACH_MAX_ENTITY_CAPACITY) rather than accepted and never
connected, and a start-up that would exceed it (a lowered limit, too many static sources) fails
with a ConfigError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from kvcm.cache.keys import derive_keys
from kvcm.config import ConfigError
from kvcm.engines.entries import SourceMatch, SourceState
from kvcm.engines.index import EngineIndex
from kvcm.engines.metrics import EventMetrics
from kvcm.engines.sources import (
    SourceSpec,
    SubscriberSettings,
    build_spec,
    static_specs,
)
from kvcm.engines.subscriber import EventSubscriber
from kvcm.errors import Code, NotFound, error
from kvcm.store.base import MetaStore

#: The main store's database of event-source definitions (see ``EngineService(shared=...)``).
DEFINITIONS = "source_defs"

log = logging.getLogger("kvcm.engines")
_ENCODER = msgspec.msgpack.Encoder()
_REPLY_HEAD = b"\x85" + _ENCODER.encode("instance_id")
_NUM_BLOCKS = _ENCODER.encode("num_blocks")
_SOURCES = _ENCODER.encode("sources")
_STALE = _ENCODER.encode("stale_sources")
_FRESHNESS = _ENCODER.encode("freshness")


class MatchReply(msgspec.Struct, gc=False):
    """The ``match_engines`` result map."""

    instance_id: str
    num_blocks: int
    sources: list[SourceMatch]
    stale_sources: int  # the instance's stale sources left out (include_stale=False)
    freshness: dict[str, dict[str, Any]]  # every source of the instance: {"state", "age_s"}


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
        static_sources: Sequence[Any] = (),
        shared: MetaStore | None = None,
    ) -> None:
        """:param shared: the main metadata store, where the sources added by RPC are defined
            once for every node (:meth:`follow_definitions`); None = this node's own only."""
        self.settings = settings or SubscriberSettings()
        self.shared = shared
        self.instance_lookup = instance_lookup
        self.metrics = EventMetrics(registry)
        self.index = EngineIndex(store, instance_lookup)
        self.subscriber = EventSubscriber(self.index, self.settings, self.metrics)
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

    def add_source(self, params: dict[str, Any]) -> dict[str, Any]:
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

    def remove_source(self, source_id: str) -> dict[str, Any]:
        """Stop following a source and drop exactly its blocks and metrics."""
        state = self.index.remove_source(source_id)
        self.subscriber.remove(source_id)
        self.metrics.remove_source(source_id)
        if self.shared is not None:
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
        mine = [s.spec for s in self.index.sources() if not s.spec.static]
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
            if not spec.static and defined.get(spec.source_id) != spec:
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
    ) -> dict[str, Any]:
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

    def _describe(self, state: SourceState, conn: dict[str, Any]) -> dict[str, Any]:
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
            "static": spec.static,
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
        *,
        lora_name: str | None = None,
        media: Sequence[str] | None = None,
        group_idx: int | None = None,
        limit: int = 0,
        include_stale: bool = False,
    ) -> dict[str, Any]:
        """``match_engines``: per source, the longest held prefix split by medium, best first;
        stale sources are left out (and counted) unless ``include_stale``."""
        reply: dict[str, Any] = msgspec.to_builtins(
            self._match(instance_id, token_ids, block_keys, lora_name, media, group_idx, limit, include_stale)
        )
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
    ) -> bytes:
        """:meth:`match` as msgpack bytes (the RPC path: no intermediate dicts)."""
        keys = self.keys_for(instance_id, token_ids, block_keys)
        left_out = self._left_out(instance_id, include_stale)
        packed = self.index.match_packed(
            instance_id, keys, lora_name=lora_name, media=media, group_idx=group_idx, limit=limit, exclude=left_out
        )
        if packed is None:  # a source with several media or groups: merge in Python
            return _ENCODER.encode(
                self._match(instance_id, None, keys, lora_name, media, group_idx, limit, include_stale)
            )
        head = _REPLY_HEAD + _ENCODER.encode(instance_id) + _NUM_BLOCKS + _ENCODER.encode(len(keys)) + _SOURCES
        fresh = self.subscriber.instance_freshness(instance_id)[1]
        return head + packed + _STALE + _ENCODER.encode(len(left_out)) + _FRESHNESS + fresh

    def _match(
        self,
        instance_id: str,
        token_ids: Sequence[int] | None,
        block_keys: Sequence[int] | None,
        lora_name: str | None,
        media: Sequence[str] | None,
        group_idx: int | None,
        limit: int,
        include_stale: bool = False,
    ) -> MatchReply:
        keys = self.keys_for(instance_id, token_ids, block_keys)
        left_out = self._left_out(instance_id, include_stale)
        sources = self.index.match(
            instance_id, keys, lora_name=lora_name, media=media, group_idx=group_idx, exclude=left_out
        )
        fresh = self.subscriber.instance_freshness(instance_id)[0]
        return MatchReply(instance_id, len(keys), sources[:limit] if limit > 0 else sources, len(left_out), fresh)

    def engine_locations(self, instance_id: str, keys: Sequence[int], lora_name: str | None = None) -> list[list[dict[str, Any]]]:
        """Per key, the engines holding it: for ``get_cache_location(include_engines=true)``."""
        return self.index.locations(instance_id, keys, lora_name=lora_name)

"""Reclaimer state: per-group limits, per-group policies, and the reclaimer's metrics.

:class:`Limits` is what :class:`~kvcm.reclaimer.Reclaimer` reads of an instance group every tick
(:func:`limits_from_registry` builds it from the registry's ``InstanceGroup`` records).
:class:`GroupState` holds one group's eviction policies — one per storage type, keyed
``(instance_id, block_key)`` — and the bytes it has evicted that the deleter has not freed yet.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcm.control.records import InstanceGroup
from kvcm.policies import POLICIES, TTL, BasePolicy, make_policy
from kvcm.policies.compact_lru import CompactLRU

IKey = tuple[str, int]  # (instance_id, block_key): block keys are per-instance namespaces
# Inside a group the policies key a block by one int, ``index(instance) << 64 | key + 2**63``
# (block keys are int64), not by an ``(instance, key)`` tuple: a tuple per block cost 56 bytes
# more than the int it wraps, at every tracked block of every group.
_OFF = 1 << 63
_M64 = (1 << 64) - 1
_COUNTS_EVERY_READ = frozenset({"lfu"})  # policies for which two reads differ from one
def _split(packed: Any) -> list[int]:
    """A key_of() int as two msgpack-sized halves (the instance index is above bit 64)."""
    return [packed >> 64, packed & _M64]


def _join(raw: Any) -> int:
    return (int(raw[0]) << 64) | int(raw[1])


_SIZES: dict[int, int] = {}  # block sizes: few distinct values, so one int object each, not one per block


def _intern(nbytes: int) -> int:
    if len(_SIZES) < 4096:
        return _SIZES.setdefault(nbytes, nbytes)
    return _SIZES.get(nbytes, nbytes)
_FULL_ORDER = frozenset({"lru", "lfu", "leaf_lru"})  # victims(len) is the whole order




@dataclass(frozen=True)
class Limits:
    """What the reclaimer needs of one instance group; read fresh every tick.

    ``quota``/``type_quotas`` are bytes, ``<= 0`` meaning unlimited. ``used_percentage`` is the
    watermark as a fraction of quota (above 1: never), ``used_bytes > 0`` a second one in bytes
    (whichever is reached first triggers); ``max_blocks > 0`` bounds the group's block copies,
    ``used_percentage`` of it being a third mark. ``ttl_seconds > 0`` enables the TTL sweep whatever the
    policy (with policy ``ttl`` it is that policy's TTL). ``sample_size=None`` uses the config's.
    """

    policy: str = "lru"
    used_percentage: float = 0.9
    used_bytes: int = 0
    max_blocks: int = 0
    delay_before_delete_ms: int = 0
    ttl_seconds: float = 0.0
    quota: int = 0
    type_quotas: Mapping[str, int] = field(default_factory=dict)
    sample_size: int | None = None


def _access(policy: BasePolicy, base: int, keys: Iterable[int], now: float) -> None:
    # a hit may have been evicted since (or live on another tier): only tracked keys count
    if type(policy) is CompactLRU:  # it skips untracked keys itself: one lookup per key, not two
        policy.access_many(map(base.__add__, keys), now)
        return
    policy.access_many(filter(policy.sizes.__contains__, map(base.__add__, keys)), now)  # C-level loop


def limits_of(group: InstanceGroup) -> Limits:
    """:class:`Limits` of a registry ``InstanceGroup`` (``kvcm.control.records``)."""
    strategy, quota = group.reclaim_strategy, group.quota
    return Limits(
        policy=strategy.reclaim_policy,
        used_percentage=strategy.used_percentage,
        used_bytes=strategy.used_bytes,
        max_blocks=group.max_block_count,
        delay_before_delete_ms=strategy.delay_before_delete_ms,
        ttl_seconds=float(strategy.ttl_seconds),
        quota=quota.capacity,
        type_quotas={item.storage_type: item.capacity for item in quota.quota_config},
    )


class GroupSource(Protocol):
    """What :func:`limits_from_registry` reads: the registry's instance groups."""

    def list_groups(self) -> Iterable[InstanceGroup]: ...


def limits_from_registry(registry: GroupSource) -> Callable[[], dict[str, Limits]]:
    """The ``limits`` callable for a :class:`~kvcm.control.registry.Registry`: every group, read afresh
    (the registry's reads are in-memory and thread-safe), so updates apply on the next tick."""

    def read() -> dict[str, Limits]:
        return {group.name: limits_of(group) for group in registry.list_groups()}

    return read


def build_policy(name: str, sample_size: int = 0, ttl_seconds: float = 0.0, compact: bool = True) -> BasePolicy:
    """``make_policy`` with only the options ``name`` accepts (TTL has no sampled mode, ...).

    Exact ``lru`` is :class:`~kvcm.policies.compact_lru.CompactLRU` unless ``compact`` is off
    (``reclaim.compact_lru``): the same victims as ``LRU`` without an ``OrderedDict`` entry and an
    int object per tracked block, for about twice the CPU per read folded in."""
    if name == "lru" and not sample_size and compact:
        return CompactLRU()
    accepted = inspect.signature(POLICIES[name].__init__).parameters
    opts: dict[str, Any] = {}
    if sample_size and "sample_size" in accepted:
        opts["sample_size"] = sample_size
    if ttl_seconds > 0 and "ttl_seconds" in accepted:
        opts["ttl_seconds"] = ttl_seconds
    return make_policy(name, **opts)


class GroupState:
    """One group's policies (one per storage type) plus its in-flight evictions.

    Owned by the reclaimer thread.
    """

    def __init__(self, name: str, limits: Limits, sample_size: int, compact: bool = True) -> None:
        self.compact = compact
        self.name = name
        self.limits = limits
        self.sample_size = sample_size
        self.policies: dict[str, BasePolicy] = {}
        self.ttls: dict[str, TTL] = {}  # side TTL trackers, when the main policy is not ``ttl``
        # type -> [[due, bytes, seen freed]], one entry per evict() call
        self.inflight: dict[str, list[list[Any]]] = {}
        self.marked_since_sample: dict[str, int] = {}  # type -> bytes evicted since the round's usage sample
        self.inline_bytes: dict[str, int] = {}  # type -> bytes make_room has chosen, ever (jobs diff it)
        self.stale = True  # rebuild from serving_keys before use
        self._iids: list[str] = []  # instance index (see _OFF) -> instance id; only grows
        self._index: dict[str, int] = {}

    def _base(self, iid: str) -> int:
        idx = self._index.get(iid)
        if idx is None:
            idx = self._index[iid] = len(self._iids)
            self._iids.append(iid)
        return (idx << 64) + _OFF

    def key_of(self, iid: str, key: int) -> int:
        """The policies' key of block ``key`` of instance ``iid``."""
        return self._base(iid) + key

    def instances(self) -> Collection[str]:
        """Every instance id this group's keys were ever made for."""
        return self._index.keys()

    def ikey(self, packed: int) -> IKey:
        """Inverse of :meth:`key_of`."""
        return self._iids[packed >> 64], (packed & _M64) - _OFF

    @property
    def policy_name(self) -> str:
        return self.limits.policy if self.limits.policy in POLICIES else "lru"

    def shape(self) -> tuple[str, int, bool]:
        """What a rebuild is needed for when it changes."""
        return self.policy_name, self.sample_size, self.limits.ttl_seconds > 0

    def update(self, limits: Limits, sample_size: int) -> None:
        before = self.shape()
        self.limits, self.sample_size = limits, sample_size
        if self.shape() != before:
            self.stale = True
            return
        if limits.ttl_seconds > 0:  # the order is write order either way: no rebuild needed
            for tracker in self._ttl_trackers():
                tracker.ttl_seconds = limits.ttl_seconds

    def reset(self) -> None:
        self.policies.clear()
        self.ttls.clear()
        self.stale = False

    def dump(self) -> dict[str, Any]:
        """Plain data for :class:`~kvcm.reclaimer.persist.RecencyFile` (see :meth:`load`)."""
        return {"shape": list(self.shape()), "ttl": self.limits.ttl_seconds, "instances": list(self._iids),
                "policies": {t: p.dump(_split) for t, p in self.policies.items()},
                "ttls": {t: p.dump(_split) for t, p in self.ttls.items()}}

    def load(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`dump`'s output. Taken under another policy shape, it is restored in
        that shape: the caller's next :meth:`update` with the current limits then marks the
        group stale, and its rebuild carries the old order over."""
        shape = tuple(data["shape"])
        if shape != self.shape():
            ttl = float(data.get("ttl", 0.0)) if shape[2] else 0.0
            self.limits = replace(self.limits, policy=shape[0], ttl_seconds=ttl)
            self.sample_size = int(shape[1])
        self.reset()
        self._iids = list(data["instances"])
        self._index = {iid: i for i, iid in enumerate(self._iids)}
        for stype, state in data["policies"].items():
            self._policy(stype).load(state, key=_join)
        for stype, state in data["ttls"].items():
            if stype in self.ttls:
                self.ttls[stype].load(state, key=_join)

    def carried_order(self, now: float) -> dict[str, dict[Hashable, int]]:  # keys: key_of()
        """Per storage type, each tracked block's place in the current policy's eviction order
        (0 = first to go), for a rebuild under another policy that should keep what this one
        learnt. Empty for policies without a full order (``random_lru``) and when nothing is tracked."""
        out: dict[str, dict[Hashable, int]] = {}
        for stype, policy in self.policies.items():
            if policy.name in _FULL_ORDER and len(policy):
                out[stype] = {k: i for i, k in enumerate(policy.victims(len(policy), now))}
        return out

    def _ttl_trackers(self) -> Iterable[TTL]:
        main = [p for p in self.policies.values() if isinstance(p, TTL)]
        return [*main, *self.ttls.values()]

    def _policy(self, storage_type: str) -> BasePolicy:
        policy = self.policies.get(storage_type)
        if policy is None:
            policy = build_policy(self.policy_name, self.sample_size, self.limits.ttl_seconds, self.compact)
            self.policies[storage_type] = policy
            if self.limits.ttl_seconds > 0 and not isinstance(policy, TTL):
                self.ttls[storage_type] = TTL(self.limits.ttl_seconds)
        return policy

    def serve(self, iid: str, key: int, nbytes: int, stype: str, parent: int | None, now: float) -> None:
        base = self._base(iid)
        nbytes = _intern(nbytes)
        self._policy(stype).on_write(base + key, now, nbytes, None if parent is None else base + parent)
        ttl = self.ttls.get(stype)
        if ttl is not None:
            ttl.on_write(base + key, now, nbytes)

    def read(self, iid: str, keys: Sequence[int], now: float) -> None:
        """One read hit of ``keys``."""
        self.read_many(iid, [keys], [now])

    def read_many(self, iid: str, key_lists: Sequence[Sequence[int]], times: Sequence[float]) -> None:
        """Several read hits of one instance, oldest first, ``times[i]`` the time of
        ``key_lists[i]`` (``lfu`` credits each read at its own time; the others need only the order).

        For recency policies only each key's *last* read matters, so hot prefixes read by many
        requests between two ticks are applied once each: same order, a fraction of the work.
        """
        unique: list[int] | None = None
        base = self._base(iid)
        for policy in self.policies.values():
            if policy.name in _COUNTS_EVERY_READ:
                for keys, at in zip(key_lists, times):
                    _access(policy, base, keys, at)
                continue
            if unique is None:
                last_first = dict.fromkeys(chain.from_iterable(map(reversed, reversed(key_lists))))
                unique = list(last_first)
                unique.reverse()
            _access(policy, base, unique, times[-1])

    def remove(self, iid: str, keys: Iterable[int]) -> None:
        base = self._base(iid)
        for key in keys:
            for stype in self.policies:
                self.forget(stype, base + key)

    def forget(self, stype: str, packed: Hashable) -> None:
        self.policies[stype].on_remove(packed)
        ttl = self.ttls.get(stype)
        if ttl is not None:
            ttl.on_remove(packed)

    def purge_instance(self, iid: str) -> None:
        idx = self._index.get(iid)
        if idx is None:
            return
        for stype, policy in self.policies.items():
            for packed in [k for k in policy.sizes if k >> 64 == idx]:  # type: ignore[operator]  # keys are ints
                self.forget(stype, packed)

    def expired(self, now: float) -> dict[str, list[Hashable]]:
        out: dict[str, list[Hashable]] = {}
        for stype, policy in self.policies.items():
            tracker = self.ttls.get(stype, policy)
            keys = tracker.expired(now)
            if keys:
                out[stype] = keys
        return out

    def add_inflight(self, stype: str, nbytes: int, due: float) -> None:
        """``nbytes`` were marked ``deleting``, to be freed at ``due``; they count in usage until then."""
        if nbytes > 0:
            self.inflight.setdefault(stype, []).append([due, nbytes, False])
            self.marked_since_sample[stype] = self.marked_since_sample.get(stype, 0) + nbytes

    def inflight_bytes(self, stype: str) -> int:
        return sum(entry[1] for entry in self.inflight.get(stype, ()))

    def expire_inflight(self, settled: Callable[[float], bool], confirm: bool = False) -> None:
        """Forget the entries whose deletes the deleter has done (``settled(due)``).

        ``confirm``: only one round after first seeing them done. Watching the real deleter's
        queue, its commit becomes visible a moment before its usage counters drop (they follow
        in a commit callback); forgetting an entry while usage still counts its bytes would
        evict them a second time.
        """
        for stype, pending in self.inflight.items():
            if confirm:
                pending = [e for e in pending if not e[2]]
                for entry in pending:
                    entry[2] = settled(entry[0])
                self.inflight[stype] = pending
            else:
                self.inflight[stype] = [e for e in pending if not settled(e[0])]


class Tracked:
    """One (group, storage type) policy seen with ``(instance_id, key)`` keys (tests, tools)."""

    def __init__(self, state: GroupState, policy: BasePolicy) -> None:
        self._state, self._policy = state, policy

    def __len__(self) -> int:
        return len(self._policy)

    def __contains__(self, ikey: object) -> bool:
        if not (isinstance(ikey, tuple) and len(ikey) == 2 and ikey[0] in self._state.instances()):
            return False
        return self._state.key_of(*ikey) in self._policy

    def __getattr__(self, name: str) -> Any:  # name, ttl_seconds, size_total, check, ...
        return getattr(self._policy, name)

    @property
    def sizes(self) -> dict[IKey, int]:
        return {self._state.ikey(k): v for k, v in self._policy.sizes.items()}  # type: ignore[arg-type]

    def victims(self, n: int, now: float) -> list[IKey]:
        return [self._state.ikey(k) for k in self._policy.victims(n, now)]  # type: ignore[arg-type]


class ReclaimMetrics:
    """The reclaimer's Prometheus families (``kvcm_usage_*``, ``kvcm_quota_*``, ``kvcm_group_*``,
    ``kvcm_reclaim_*``).

    Group-wide numbers have their own ``kvcm_group_*`` names rather than a ``storage_type`` label
    value of their own: a label value that is the sum of the others makes every ``sum()`` over
    the family count each byte twice."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, g, gt = registry, ["group"], ["group", "storage_type"]
        self.usage_bytes = Gauge("kvcm_usage_bytes", "Bytes used, per group and storage type", gt, registry=r)
        self.usage_keys = Gauge("kvcm_usage_keys", "Block locations, per group and storage type", gt, registry=r)
        self.quota_bytes = Gauge("kvcm_quota_bytes", "Quota in bytes per storage type (0 = unlimited)", gt, registry=r)
        self.group_usage_bytes = Gauge("kvcm_group_usage_bytes", "Bytes used by the whole group", g, registry=r)
        self.group_usage_keys = Gauge("kvcm_group_usage_keys", "Block locations of the whole group", g, registry=r)
        self.group_quota_bytes = Gauge("kvcm_group_quota_bytes", "Quota of the whole group (0 = unlimited)", g,
                                       registry=r)
        self.tracked = Gauge("kvcm_reclaim_tracked_blocks", "Serving blocks known to the policy", gt, registry=r)
        self.inflight = Gauge("kvcm_reclaim_inflight_bytes", "Evicted bytes not yet freed", gt, registry=r)
        self.rounds = Counter("kvcm_reclaim_rounds", "Reclaimer rounds run", registry=r)
        self.triggered = Counter("kvcm_reclaim_triggered", "Rounds in which a group was over", ["group"], registry=r)
        labels = ["group", "storage_type", "policy", "reason"]
        self.blocks = Counter("kvcm_reclaim_blocks", "Blocks reclaimed", labels, registry=r)
        self.bytes = Counter("kvcm_reclaim_bytes", "Bytes reclaimed", labels, registry=r)
        self.rebuilds = Counter("kvcm_reclaim_rebuilds", "Policy state rebuilt from the store", ["group"], registry=r)
        self.dropped_reads = Counter("kvcm_reclaim_dropped_reads", "Read hits not folded (buffer full)", registry=r)
        self.round_seconds = Histogram(
            "kvcm_reclaim_round_seconds", "Time per reclaimer round",
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0), registry=r,
        )
        self._usage_types: dict[str, set[str]] = {}  # group -> storage types with a usage series
        # The labelled children of ``blocks``/``bytes``: counted on every in-line eviction, where
        # two ``labels()`` lookups cost more than the rest of the counting.
        self._reclaimed: dict[tuple[str, str, str, str], tuple[Counter, Counter]] = {}

    def count(self, labels: tuple[str, str, str, str], blocks: int, nbytes: int) -> None:
        """``blocks`` blocks of ``nbytes`` bytes reclaimed (group, storage type, policy, reason)."""
        children = self._reclaimed.get(labels)
        if children is None:
            children = self._reclaimed[labels] = (self.blocks.labels(*labels), self.bytes.labels(*labels))
        children[0].inc(blocks)
        children[1].inc(nbytes)

    def record(self, state: GroupState, usage: Mapping[str, Any], by_type: Mapping[str, int]) -> None:
        """A group's usage sample (``by_type``: less what is on its way out), quotas and tracked blocks."""
        name, lim = state.name, state.limits
        self.set_usage(name, usage)
        self.group_quota_bytes.labels(name).set(max(lim.quota, 0))
        for stype, u in usage.get("by_type", {}).items():
            self.inflight.labels(name, stype).set(u.get("bytes", 0) - by_type.get(stype, 0))
        for stype, quota in lim.type_quotas.items():
            self.quota_bytes.labels(name, stype).set(max(quota, 0))
        for stype, policy in state.policies.items():
            self.tracked.labels(name, stype).set(len(policy))

    def set_usage(self, group: str, usage: Mapping[str, Any]) -> None:
        """The group's totals and its per-type usage; a type that no longer has usage reads 0
        (not its last value), so the per-type series always add up to the group's."""
        self.group_usage_bytes.labels(group).set(usage.get("bytes", 0))
        self.group_usage_keys.labels(group).set(usage.get("keys", 0))
        by_type = usage.get("by_type", {})
        for stype in self._usage_types.get(group, set()) - set(by_type):
            self.usage_bytes.labels(group, stype).set(0)
            self.usage_keys.labels(group, stype).set(0)
        for stype, u in by_type.items():
            self.usage_bytes.labels(group, stype).set(u.get("bytes", 0))
            self.usage_keys.labels(group, stype).set(u.get("keys", 0))
        self._usage_types.setdefault(group, set()).update(by_type)

    def forget_group(self, group: str) -> None:
        self._usage_types.pop(group, None)
        for counted in [k for k in self._reclaimed if k[0] == group]:
            del self._reclaimed[counted]
        for gauge in (self.usage_bytes, self.usage_keys, self.quota_bytes, self.tracked, self.inflight):
            for labels in [s.labels for m in gauge.collect() for s in m.samples if s.labels.get("group") == group]:
                try:
                    gauge.remove(labels["group"], labels["storage_type"])
                except KeyError:
                    pass
        for gauge in (self.group_usage_bytes, self.group_usage_keys, self.group_quota_bytes):
            try:
                gauge.remove(group)
            except KeyError:
                pass

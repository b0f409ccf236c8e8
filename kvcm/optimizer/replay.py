"""Replay a trace through groups of tiered caches and count hits per instance.

What one record does (see :mod:`kvcm.optimizer.trace` for the ops):

* a lookup (``turn`` or ``read``) skips the masked blocks (already on the device: *internal*
  hits, as kvcm's ``prefix_match`` does), then counts the leading blocks some tier holds
  (*external* hits). A ``read`` refreshes the blocks it hit;
* a ``turn`` / ``write`` then touches every block it carries, in order: blocks some tier holds
  are accessed, the others are written to the first tier (parent = the previous block). Touching
  the blocks after a miss too is what keeps plain LRU a stack algorithm, so its hit rate can
  only grow with capacity;
* after every write, each tier over ``capacity * watermark`` evicts — exactly the excess
  (``exact``) or whole batches of ``batch_size`` blocks (``batched``, Tair's rough modes) —
  and demotes its victims to the next tier; the last tier drops them. Policies with a TTL
  also drop expired blocks before each record of their group.
* a ``pin`` protects its keys until ``ts + ttl`` (trace time): while it lasts, a pinned key is
  never a victim — neither of a tier's eviction (the replay skips it and asks the policy for
  more) nor of a policy's TTL — as the live reclaimer skips pinned keys. ``unpin`` ends it; an
  explicit ``remove`` / ``clear`` still removes a pinned block (pins guard against eviction only).
  A pin may name a key that is not cached yet.

Instances of one group share its tiers and one policy per tier, so eviction order is global to
the group, as in the live reclaimer. Their keys are kept apart by adding ``slot << 66`` (the
first instance of a group keeps its keys unchanged, so single-instance replays pay nothing).

Token hit counts cap each lookup's hits at its prompt length (``Record.tokens``), so the last,
partial block of a prompt counts only its real tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from typing import cast

from kvcm.optimizer.radix import RadixTree
from kvcm.optimizer.spec import GroupSpec, InstanceSpec, ReplaySpec, TierSpec
from kvcm.optimizer.stats import GroupResult, HitStats, ReplayResult, TierResult, TimelineRow
from kvcm.optimizer.trace import Record
from kvcm.policies import BasePolicy, make_policy

_SHIFT = 66  # namespacing stride: keys are int64 or uint64, so they fit below 2**65 - 2**63
_BIAS = 1 << 63


class _Tier:
    __slots__ = ("limit", "policy", "spec")

    def __init__(self, spec: TierSpec, watermark: float) -> None:
        self.spec = spec
        self.policy: BasePolicy = make_policy(spec.policy, **spec.policy_options)
        cap = spec.capacity
        self.limit = None if cap is None else int(cap.amount * watermark)


class _Instance:
    __slots__ = ("block_size", "cached", "group", "id", "offset", "size", "slot", "stats",
                 "timeline", "tree")  # fmt: skip

    def __init__(self, spec: InstanceSpec, group: _Group, block_size: int, trees: bool) -> None:
        self.id = spec.id
        self.group = group
        self.slot = len(group.instances)
        self.offset = self.slot << _SHIFT
        self.block_size = block_size
        self.size = spec.block_bytes if group.unit == "bytes" else 1
        self.stats = HitStats(tier_hit_blocks=[0] * len(group.tiers))
        self.timeline: list[TimelineRow] = []
        self.tree = RadixTree() if trees else None
        self.cached = 0
        group.instances.append(self)


class _Group:
    __slots__ = ("has_ttl", "instances", "parents", "peak", "peak_blocks", "pins", "single", "spec",
                 "step", "tiers", "unit")  # fmt: skip

    def __init__(self, spec: GroupSpec, replay: ReplaySpec) -> None:
        self.spec = spec
        self.tiers = [_Tier(t, replay.watermark) for t in spec.tiers]
        self.instances: list[_Instance] = []
        caps = [t.capacity for t in spec.tiers if t.capacity is not None]
        self.unit = caps[0].unit if caps else "blocks"
        self.has_ttl = any(t.policy.has_ttl for t in self.tiers)
        self.single = len(self.tiers) == 1
        self.peak = self.peak_blocks = 0
        self.parents: dict[int, int | None] = {}  # multi-tier only: for demoting with parents
        self.pins: dict[int, float] = {}  # namespaced key -> end of its pin (trace time)
        sizes = [i.block_bytes for i in spec.instances] + [spec.block_bytes]
        self.step = 1 if self.unit == "blocks" else max(max(sizes), 1)

    def owner(self, key: int) -> _Instance:
        return self.instances[(key + _BIAS) >> _SHIFT]

    def blocks(self) -> int:
        return sum(len(t.policy) for t in self.tiers)


class Replayer:
    """Feeds records through the groups of a :class:`ReplaySpec`; one instance per replay.

    ``block_size_of(instance)`` gives tokens per block for instances whose spec does not say.
    """

    def __init__(self, spec: ReplaySpec, block_size_of: Callable[[str], int], label: str = "") -> None:
        self.spec = spec.validate()
        self.label = label or "+".join(sorted({t.policy for g in spec.groups for t in g.tiers}))
        self.block_size_of = block_size_of
        self.groups = [_Group(g, spec) for g in spec.groups]
        self._listed = {i.id: grp for grp in self.groups for i in grp.spec.instances}
        self._default = next((g for g in self.groups if g.spec.name == "default"), None)
        self._instances: dict[str, _Instance | None] = {}
        self._batch = spec.batch_size if spec.mode == "batched" else 0
        self._timeline = spec.timeline
        self.records = self.dropped = 0
        self.first_ts = self.last_ts = 0.0
        self._wall = 0.0

    # --- driving -------------------------------------------------------------------------------

    def run(self, records: Iterable[Record]) -> ReplayResult:
        """Replay every record, then return :meth:`result`."""
        start = time.perf_counter()
        feed = self.feed
        for record in records:
            feed(record)
        self._wall += time.perf_counter() - start
        return self.result()

    def feed(self, rec: Record) -> None:
        """Apply one record."""
        try:
            inst = self._instances[rec.instance]
        except KeyError:
            inst = self._resolve(rec.instance)
        if inst is None:
            self.dropped += 1
            return
        now = rec.ts
        if not self.records:
            self.first_ts = now
        self.records += 1
        self.last_ts = now
        group = inst.group
        if group.has_ttl:
            self._expire(group, now)
        op = rec.op
        if op == "turn":
            self._turn(inst, rec, now)
        elif op == "read":
            n, internal, external = self._lookup(inst, rec, now, refresh=True)
            self._count(inst, rec, n, internal, external, now)
        elif op == "write":
            self._write(inst, rec, now)
        elif op == "remove":
            self._remove(inst, rec.keys)
        elif op == "clear":
            self._clear(inst)
        elif op == "pin":
            until = now + rec.ttl
            group.pins.update((k, until) for k in _ns(rec.keys, inst.offset))
        elif op == "unpin":
            for key in _ns(rec.keys, inst.offset):
                group.pins.pop(key, None)
        else:
            raise ValueError(f"unknown record op {op!r}")

    def _resolve(self, instance_id: str) -> _Instance | None:
        group = self._listed.get(instance_id, self._default)
        inst = None
        if group is not None:
            spec = group.spec.instance(instance_id)
            block_size = spec.block_size or self.block_size_of(instance_id)
            inst = _Instance(spec, group, block_size, self.spec.trees)
        self._instances[instance_id] = inst
        return inst

    # --- lookups -------------------------------------------------------------------------------

    def _turn(self, inst: _Instance, rec: Record, now: float) -> None:
        group = inst.group
        if rec.mask or not group.single or inst.tree is not None:
            n, internal, external = self._lookup(inst, rec, now, refresh=False)
            self._write(inst, rec, now)
            self._count(inst, rec, n, internal, external, now)
            return
        # Hot path (one tier, no mask): the first block the write had to add is the first
        # miss, so the lookup needs no pass of its own; eviction is called only when needed.
        offset, tier = inst.offset, group.tiers[0]
        keys = [k + offset for k in rec.keys] if offset else rec.keys
        parent = rec.parent if rec.parent is None else rec.parent + offset
        policy = tier.policy
        written = _ints(policy.touch_chain(keys, now, parent, inst.size))
        if written:
            inst.cached += len(written)
            inst.stats.written_blocks += len(written)
            external = keys.index(written[0])
            if tier.limit is not None and policy.size_total > tier.limit:
                self._evict(group, now)
            elif policy.size_total > group.peak:
                group.peak, group.peak_blocks = policy.size_total, len(policy)
        else:
            external = len(keys)
        inst.stats.tier_hit_blocks[0] += external
        self._count(inst, rec, len(keys), 0, external, now)

    def _lookup(
        self, inst: _Instance, rec: Record, now: float, refresh: bool
    ) -> tuple[int, int, int]:
        """(blocks, internal hits, external hits) of a lookup; ``refresh`` touches the hits."""
        if inst.tree is not None:
            inst.tree.match(rec.keys, rec.mask, now)
        keys = _ns(rec.keys, inst.offset)
        n = len(keys)
        mask = rec.mask
        if isinstance(mask, int):
            internal = min(n, mask)
            look = keys[internal:] if internal else keys
        else:
            internal = sum(1 for m in mask[:n] if m)
            look = [k for k, m in zip(keys, mask) if not m]
        group = inst.group
        if group.single:
            sizes = group.tiers[0].policy.sizes
            external = 0
            for key in look:
                if key not in sizes:
                    break
                external += 1
            inst.stats.tier_hit_blocks[0] += external
            if refresh and external:
                group.tiers[0].policy.access_many(look[:external], now)
        else:
            external = self._lookup_tiers(inst, look, now, refresh)
        return n, internal, external

    def _lookup_tiers(self, inst: _Instance, look: list[int], now: float, refresh: bool) -> int:
        tiers, per_tier = inst.group.tiers, inst.stats.tier_hit_blocks
        hits = 0
        for key in look:
            where = _where(tiers, key)
            if where < 0:
                break
            per_tier[where] += 1
            hits += 1
            if refresh:
                self._touch_in(inst.group, where, key, now)
        if refresh and self.spec.promote:
            self._evict(inst.group, now)
        return hits

    def _count(self, inst: _Instance, rec: Record, n: int, internal: int, external: int, now: float) -> None:
        """Add one lookup to the instance's counters (and timeline, after the record applied)."""
        stats, bs = inst.stats, inst.block_size
        tokens = rec.tokens if rec.tokens is not None else n * bs
        hit_tokens = min((internal + external) * bs, tokens)
        internal_tokens = min(internal * bs, tokens)
        stats.reads += 1
        stats.read_blocks += n
        stats.internal_hit_blocks += internal
        stats.external_hit_blocks += external
        stats.read_tokens += tokens
        stats.internal_hit_tokens += internal_tokens
        stats.hit_tokens += hit_tokens
        if self._timeline:
            group = inst.group
            cached = len(group.tiers[0].policy) if group.single else group.blocks()
            inst.timeline.append(
                (now, inst.cached, cached, n, internal, external, tokens, internal_tokens, hit_tokens)
            )

    # --- writes --------------------------------------------------------------------------------

    def _write(self, inst: _Instance, rec: Record, now: float) -> list[int]:
        """Touch/write the record's blocks, then evict; returns the keys written."""
        keys = _ns(rec.keys, inst.offset)
        parent = rec.parent
        if parent is not None:
            parent += inst.offset
        group = inst.group
        if group.single:
            written = _ints(group.tiers[0].policy.touch_chain(keys, now, parent, inst.size))
        else:
            written = self._touch_tiers(group, keys, now, parent, inst.size)
        if written:
            inst.cached += len(written)
            inst.stats.written_blocks += len(written)
            if inst.tree is not None:
                inst.tree.insert(rec.keys, now, rec.parent)
        self._evict(group, now)
        return written

    def _touch_tiers(
        self, group: _Group, keys: list[int], now: float, parent: int | None, size: int
    ) -> list[int]:
        first, tiers, written = group.tiers[0].policy, group.tiers, []
        for key in keys:
            where = _where(tiers, key)
            if where < 0:
                first.on_write(key, now, size, parent)
                group.parents[key] = parent
                written.append(key)
            else:
                self._touch_in(group, where, key, now)
            parent = key
        return written

    def _touch_in(self, group: _Group, where: int, key: int, now: float) -> None:
        """Access ``key`` in tier ``where``; with ``promote``, move it to the first tier."""
        policy = group.tiers[where].policy
        if where == 0 or not self.spec.promote:
            policy.on_access(key, now)
            return
        size = policy.sizes[key]
        policy.on_remove(key)
        group.tiers[0].policy.on_write(key, now, size, group.parents.get(key))

    # --- eviction ------------------------------------------------------------------------------

    def _evict(self, group: _Group, now: float) -> None:
        last = len(group.tiers) - 1
        for index, tier in enumerate(group.tiers):
            limit, policy = tier.limit, tier.policy
            while limit is not None and policy.size_total > limit:
                n = self._count_to_evict(group, policy.size_total - limit)
                victims = _ints(policy.evict(n, now)) if not group.pins else self._unpinned(group, policy, n, now)
                if not victims:
                    break
                if index < last:
                    self._demote(group, index + 1, victims, now)
                else:
                    self._drop(group, victims, evicted=True)
        usage = group.tiers[0].policy.size_total
        if usage > group.peak:
            group.peak = usage
            group.peak_blocks = len(group.tiers[0].policy)

    def _unpinned(self, group: _Group, policy: BasePolicy, n: int, now: float) -> list[int]:
        """Up to ``n`` victims none of which is pinned at ``now``, removed from ``policy``: the
        policy's own order with the pinned keys skipped, asking it for more while they fill
        the answer. Pins that ended are forgotten on the way."""
        ask = n
        while True:
            offered = _ints(policy.victims(ask, now))
            free = [k for k in offered if not self._pinned(group, k, now)]
            if len(free) >= n or len(offered) < ask or ask >= len(policy):
                break
            ask += n - len(free)  # as many more as pinned keys took places
        chosen = free[:n]
        for key in chosen:
            policy.on_remove(key)
        return chosen

    @staticmethod
    def _pinned(group: _Group, key: int, now: float) -> bool:
        until = group.pins.get(key)
        if until is None:
            return False
        if until > now:
            return True
        del group.pins[key]
        return False

    def _count_to_evict(self, group: _Group, excess: int) -> int:
        n = -(-excess // group.step)
        if self._batch:
            n = -(-n // self._batch) * self._batch
        return n

    def _demote(self, group: _Group, index: int, keys: list[int], now: float) -> None:
        policy = group.tiers[index].policy
        for key in keys:
            policy.on_write(key, now, group.owner(key).size, group.parents.get(key))

    def _drop(self, group: _Group, keys: list[int], evicted: bool) -> None:
        """``keys`` left every tier: update owners' counts, trees and the parent map."""
        if not keys:
            return
        if len(group.instances) == 1:
            self._drop_owned(group.instances[0], keys, evicted)
        else:
            owned: dict[int, list[int]] = {}
            for key in keys:
                owned.setdefault((key + _BIAS) >> _SHIFT, []).append(key)
            for slot, own in owned.items():
                self._drop_owned(group.instances[slot], own, evicted)
        if not group.single:
            for key in keys:
                group.parents.pop(key, None)

    def _drop_owned(self, inst: _Instance, keys: list[int], evicted: bool) -> None:
        inst.cached -= len(keys)
        if evicted:
            inst.stats.evicted_blocks += len(keys)
        else:
            inst.stats.removed_blocks += len(keys)
        if inst.tree is not None:
            inst.tree.remove([k - inst.offset for k in keys], clean=True)

    def _expire(self, group: _Group, now: float) -> None:
        for tier in group.tiers:
            gone = _ints(tier.policy.expired(now))
            if group.pins:
                gone = [k for k in gone if not self._pinned(group, k, now)]
            for key in gone:
                tier.policy.on_remove(key)
            self._drop(group, gone, evicted=True)

    # --- removals ------------------------------------------------------------------------------

    def _remove(self, inst: _Instance, raw: list[int]) -> None:
        group, gone = inst.group, []
        for key in _ns(raw, inst.offset):
            for tier in group.tiers:
                if key in tier.policy.sizes:
                    tier.policy.on_remove(key)
                    gone.append(key)
                    break
        self._drop(group, gone, evicted=False)

    def _clear(self, inst: _Instance) -> None:
        group, gone = inst.group, []
        for tier in group.tiers:
            keys = _ints(list(tier.policy.sizes))
            mine = [k for k in keys if len(group.instances) == 1 or group.owner(k) is inst]
            for key in mine:
                tier.policy.on_remove(key)
            gone += mine
        self._drop(group, gone, evicted=False)

    # --- results -------------------------------------------------------------------------------

    def result(self) -> ReplayResult:
        """What was measured so far."""
        instances = [i for g in self.groups for i in g.instances]
        return ReplayResult(
            label=self.label,
            instances={i.id: i.stats for i in instances},
            block_sizes={i.id: i.block_size for i in instances},
            groups=[_group_result(g) for g in self.groups],
            timelines={i.id: i.timeline for i in instances} if self.spec.timeline else {},
            records=self.records,
            dropped_records=self.dropped,
            first_ts=self.first_ts,
            last_ts=self.last_ts,
            wall_seconds=self._wall,
            trees={i.id: i.tree for i in instances if i.tree is not None},
        )


def _group_result(group: _Group) -> GroupResult:
    tiers = [_tier_result(t) for t in group.tiers]
    return GroupResult(group.spec.name, group.unit, tiers, [i.id for i in group.instances],
                       group.peak, group.peak_blocks)  # fmt: skip


def _tier_result(tier: _Tier) -> TierResult:
    capacity = None if tier.spec.capacity is None else tier.spec.capacity.amount
    return {
        "name": tier.spec.name,
        "policy": tier.spec.policy,
        "capacity": capacity,
        "limit": tier.limit,
        "usage": tier.policy.size_total,
        "blocks": len(tier.policy),
    }


def _ints(keys: list[Hashable]) -> list[int]:
    """Policies take any hashable key; the replay's keys are ints (a typing boundary only)."""
    return cast("list[int]", keys)


def _ns(keys: list[int], offset: int) -> list[int]:
    return [k + offset for k in keys] if offset else keys


def _where(tiers: list[_Tier], key: int) -> int:
    for index, tier in enumerate(tiers):
        if key in tier.policy.sizes:
            return index
    return -1


def replay(
    records: Iterable[Record],
    spec: ReplaySpec | None = None,
    block_size_of: Callable[[str], int] | int = 16,
    label: str = "",
) -> ReplayResult:
    """Replay ``records`` with ``spec`` (default: one unbounded LRU group) and return the result."""
    size_of = block_size_of if callable(block_size_of) else (lambda _i, bs=block_size_of: bs)
    return Replayer(spec or ReplaySpec(), size_of, label).run(records)

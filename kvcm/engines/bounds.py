"""Bounds on the engine index's memory.

Bounds (a source is fed by an engine or a tenant's reporter, so the index it fills is someone
else's memory): a source holds at most ``max_blocks_per_source`` blocks and all sources
together ``max_blocks``, each block weighing its kvcm keys (:func:`~kvcm.engines.entries.weight`).
Past its own bound a source loses its oldest blocks; past the total, the source that stores
loses its own oldest while it holds more than its fair share (the total over the sources
followed), else the largest source does. Either way down to :data:`_LOW_WATER` of the bound, so
evictions come in batches (each walks the dict's front once). A source holds at most
:data:`MAX_SLOTS` (medium, group) slots per adapter and :data:`MAX_GROUPS` groups, with media
and adapter names of at most :data:`MAX_LABEL` characters: a slot is a bit of every holder mask
of its table, so slots unbounded would make every mask, not just the source, grow. Stores past
these are refused and counted. Start-up applies the same bounds while it loads, so a lowered
bound (or an index written before the bounds) never loads more than it allows.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from itertools import accumulate, chain, islice, repeat
from operator import attrgetter, itemgetter

from kvcm.engines.entries import M64, EngineBlock, SourceState, weight
from kvcm.engines.indexstate import IndexState

#: An eviction takes a source (or the total) down to this share of its bound.
_LOW_WATER = 31 / 32


class BoundedIndex(IndexState):
    """Evictions that keep every source, and all of them together, within their bounds."""

    def _make_room(self, state: SourceState) -> None:
        """After a store by ``state``: back within the per-source bound and the total (module
        docstring)."""
        if state.size > self.max_per_source:
            self._evict(state, state.size - int(self.max_per_source * _LOW_WATER))
        if self._total <= self.max_total:
            return
        target = int(self.max_total * _LOW_WATER)
        fair = self.max_total // max(1, len(self._sources))
        while self._total > target:
            victim = state if state.size > fair else max(self._sources.values(), key=_BY_SIZE)
            most = victim.size - fair if victim is state and state.size > fair else victim.size
            if not self._evict(victim, min(self._total - target, most)):
                return

    def _evict(self, state: SourceState, n: int) -> int:
        """Drop the source's oldest blocks (in the order they were stored) until ``n`` of its
        size is gone; persisted as tombstones at the next flush. Returns the size freed."""
        state.spill()  # a fresh block dropped must not be persisted from SourceState.fresh
        early = self._evict_migrated(state, n)  # older than every block of the dict
        if early >= n:
            return early
        n -= early
        gone, freed = _oldest(state.blocks, n)
        ids = list(map(itemgetter(0), gone))
        deque(map(state.blocks.__delitem__, ids), maxlen=0)
        state.dirty.extend(ids)
        for (lora, medium, group), keys in _held_keys(gone).items():  # one table pass per slot, not per block
            self._release_keys(state, lora, medium, group, keys)
        state.evicted += len(gone)
        self._grown(state, -freed)
        self._dirty.add(state.spec.source_id)
        return freed + early

    def _evict_migrated(self, state: SourceState, n: int) -> int:
        """Evict up to ``n`` of the source's migrated blocks, the oldest first; how many went."""
        if state.compact is None or not len(state.compact):
            return 0
        gone = state.compact.oldest(self._key_table(state), n)
        if not gone:
            return 0
        state.dirty.extend(bid for bid, _, _ in gone)
        by_group: dict[int, list[int]] = {}
        for _, group, key in gone:
            by_group.setdefault(group, []).append(key)
        for group, keys in by_group.items():
            self._release_keys(state, "", state.compact.primary, group, keys)
        state.evicted += len(gone)
        self._grown(state, -len(gone))
        self._dirty.add(state.spec.source_id)
        return len(gone)


    def _trim_loaded(self) -> None:
        """At start-up, before any block is indexed: the total within its bound, the largest
        sources losing their oldest blocks first."""
        while self._total > self.max_total:
            victim = max(self._sources.values(), key=_BY_SIZE)
            if not self._drop_loaded(victim, min(self._total - self.max_total, victim.size)):
                return

    def _drop_loaded(self, state: SourceState, n: int, counted: bool = True) -> int:
        """Drop a loading source's oldest blocks worth ``n`` (they are in no table yet); its
        records are rewritten at the next flush, so the persisted index is within bounds too.
        ``counted``: its size counts its blocks already (else the caller counts what is left)."""
        gone, freed = _oldest(state.blocks, n)
        for bid, _ in gone:
            del state.blocks[bid]
        state.evicted += len(gone)
        if counted:
            self._grown(state, -freed)
        state.cleared = True
        self._dirty.add(state.spec.source_id)
        return freed


    def check(self) -> list[str]:
        """Problems with the bounds' bookkeeping (tests): each source's size is what its blocks
        weigh, the total their sum, and both within their bounds."""
        with self._lock:
            problems = []
            for state in self._sources.values():
                weighed = sum(map(weight, state.blocks.values())) + (len(state.compact) if state.compact else 0)
                if weighed != state.size:
                    problems.append(f"{state.spec.source_id}: size {state.size}, its blocks weigh {weighed}")
                if state.size > self.max_per_source:
                    problems.append(f"{state.spec.source_id}: size {state.size} over {self.max_per_source}")
            total = sum(s.size for s in self._sources.values())
            if total != self._total:
                problems.append(f"total {self._total}, the sources' sizes sum to {total}")
            if total > self.max_total:
                problems.append(f"total {total} over {self.max_total}")
            return problems



_KEYS = attrgetter("keys")
_REFS = attrgetter("refs")
_LORA = attrgetter("lora")
_BY_SIZE = attrgetter("size")


def _oldest(blocks: dict[int, EngineBlock], n: int) -> tuple[list[tuple[int, EngineBlock]], int]:
    """The first-stored blocks that weigh at least ``n`` together, and their weight. Each
    weighs at least 1, so they are among the first ``n``: their weights are summed with C-level
    iteration (:func:`~kvcm.engines.entries.weight`: the keys, at least 1) and the prefix cut there."""
    first = list(islice(blocks.items(), max(0, n)))
    sums = list(accumulate(map(max, map(len, map(_KEYS, map(itemgetter(1), first))), repeat(1))))
    cut = bisect_left(sums, n) + 1 if sums and sums[-1] >= n else len(first)
    return first[:cut], sums[cut - 1] if cut else 0


def _held_keys(gone: list[tuple[int, EngineBlock]]) -> dict[tuple[str, str, int], list[int]]:
    """The kvcm keys dropped blocks held, per ``(lora, medium, group)`` slot: each medium of a
    block holds its keys once in the table, however many holdings. The usual eviction (blocks of
    one adapter and group, held once on one medium: their ``refs`` is one shared map) is grouped
    with C-level iteration; anything else block by block."""
    blks = list(map(itemgetter(1), gone))
    if (
        blks
        and max(map(itemgetter(0), gone)) <= M64
        and len(set(map(id, map(_REFS, blks)))) == 1
        and len(set(map(_LORA, blks))) == 1
    ):
        keys = list(chain.from_iterable(map(_KEYS, blks)))
        return {(blks[0].lora, medium, 0): keys for medium in blks[0].refs} if keys else {}
    held: dict[tuple[str, str, int], list[int]] = {}
    for bid, blk in gone:
        if blk.keys:
            for medium in blk.refs:
                held.setdefault((blk.lora, medium, bid >> 64), []).extend(blk.keys)
    return held

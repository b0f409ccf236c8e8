"""Eviction policies, shared by the live reclaimer and the offline optimizer.

One interface (:class:`Policy`), one registry (:data:`POLICIES`, :func:`make_policy`). A policy
only *orders* blocks; it never deletes anything. The caller reports what happens to blocks
(``on_write``, ``on_access``, ``on_remove``) and asks which ones to drop (``victims``,
``expired``), then calls ``on_remove`` for each block it really removed. Keys are any hashable:
block keys (ints) in the optimizer, ``(instance_id, block_key)`` tuples in the reclaimer.
``now`` is in seconds; a clock that goes backwards is clamped to the latest value seen, so the
write-time order of :class:`TTL` stays sorted. No policy is thread-safe: one owner at a time.

=============  =====================================================  ==========================
name           evicts first                                           structure (exact mode)
=============  =====================================================  ==========================
``lru``        least recently used (reads and writes refresh)         ``OrderedDict``, O(1)
``lfu``        lowest exponentially decayed use count (``half_life``  lazy-deletion heap,
               seconds; ties: least recent)                           O(log n)
``ttl``        past ``ttl_seconds`` since written (:meth:`expired`);  ``OrderedDict`` in write
               under pressure, oldest written first                   order, O(1)
``leaf_lru``   least recently used among *leaves*: a block is a       lazy-deletion heap over
               candidate only when no tracked block names it as       leaves, O(log n)
               ``parent``, so suffixes go before their prefixes
``random_lru`` Tair KVCM's RandomLRU (``tair_kvcm.md`` §12.5): the     arrays + swap-pop, O(1);
               oldest of ``batch_size / sample_rate`` draws, with     victims O(s log s)
               replacement, from a fixed-seed xorshift64
=============  =====================================================  ==========================

**Exact and sampled modes.** ``lru``, ``lfu`` and ``leaf_lru`` take ``sample_size=k``: instead of
keeping candidates ordered, they keep them in a dense array and, like Redis' approximated LRU,
each victim is the best of ``k`` candidates drawn uniformly at random (seeded by ``seed``).
Updates become O(1) dict writes, which pays off for very large key spaces. The error is bounded
by order statistics: the victim is the worst of k uniform draws, so it lies outside the worst
fraction ``q`` of candidates with probability ``(1 - q) ** k`` (k=16: 18.5% for q=10%, 1% for
q=25%; k=64: 3.7% for q=5%) and its expected rank is the worst ``1 / (k + 1)``. ``ttl`` has no
sampled mode (its write-order list costs nothing on reads), ``random_lru`` is sampled by
definition. ``sample_size=0`` (the default) is exact.

Every policy has :meth:`check`, asserting its invariants, for tests and stress runs.
"""

from __future__ import annotations

import heapq
import inspect
import math
import random
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from itertools import islice
from typing import Any, ClassVar, Protocol, runtime_checkable

_M64 = (1 << 64) - 1


@runtime_checkable
class Policy(Protocol):
    """What the reclaimer and the optimizer rely on. Implementations also offer ``check()``."""

    name: str
    size_total: int

    def on_write(
        self, key: Hashable, now: float, size: int = 1, parent: Hashable | None = None
    ) -> None:
        """A block was written (new) or re-written (tracked: refreshed, size updated)."""

    def on_access(self, key: Hashable, now: float) -> None:
        """A read hit on ``key``; an untracked key is ignored."""

    def on_remove(self, key: Hashable) -> None:
        """``key`` is gone for any reason; idempotent, an untracked key is ignored."""

    def victims(self, n: int, now: float) -> list[Hashable]:
        """Up to ``n`` keys in eviction order. Does not remove them."""

    def expired(self, now: float) -> list[Hashable]:
        """Keys past their TTL at ``now`` (always empty for policies without one)."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class BasePolicy(ABC):
    """Size bookkeeping and the batch helpers every policy shares.

    ``sizes`` maps each tracked key to its size; it is public *read-only* so that a hot loop can
    test membership at C speed (``key in policy.sizes``) instead of through ``__contains__``.
    """

    name: ClassVar[str] = ""
    has_ttl: ClassVar[bool] = False

    def __init__(self) -> None:
        self.sizes: dict[Hashable, int] = {}
        self.size_total = 0
        self._clock = -math.inf

    def __len__(self) -> int:
        return len(self.sizes)

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} blocks={len(self)} size={self.size_total}>"

    def _tick(self, now: float) -> float:
        """Monotone clock: a time earlier than one already seen counts as that time."""
        self._clock = max(self._clock, now)
        return self._clock

    @abstractmethod
    def on_write(
        self, key: Hashable, now: float, size: int = 1, parent: Hashable | None = None
    ) -> None:
        ...

    @abstractmethod
    def on_access(self, key: Hashable, now: float) -> None:
        ...

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        ...

    @abstractmethod
    def victims(self, n: int, now: float) -> list[Hashable]:
        ...

    def expired(self, now: float) -> list[Hashable]:
        return []

    def touch_chain(
        self, keys: Sequence[Hashable], now: float, parent: Hashable | None = None, size: int = 1
    ) -> list[Hashable]:
        """Touch the blocks of one request in order: tracked ones are accessed, the others written.

        Block ``i``'s parent is ``keys[i - 1]`` (``parent`` for block 0). Returns the new keys.
        """
        written: list[Hashable] = []
        sizes = self.sizes
        for key in keys:
            if key in sizes:
                self.on_access(key, now)
            else:
                self.on_write(key, now, size, parent)
                written.append(key)
            parent = key
        return written

    def access_many(self, keys: Iterable[Hashable], now: float) -> None:
        """``on_access`` for each key, in order."""
        for key in keys:
            self.on_access(key, now)

    def evict(self, n: int, now: float) -> list[Hashable]:
        """Pick up to ``n`` victims and remove them; returns the removed keys."""
        chosen = self.victims(n, now)
        for key in chosen:
            self.on_remove(key)
        return chosen

    def check(self) -> None:
        """Assert the size bookkeeping; subclasses add their own invariants."""
        assert self.size_total == sum(self.sizes.values()), (self.size_total, len(self.sizes))
        assert all(s >= 0 for s in self.sizes.values())

    def _add_size(self, key: Hashable, size: int) -> bool:
        """Record ``key``'s size; True if the key is new."""
        old = self.sizes.get(key)
        self.sizes[key] = size
        self.size_total += size - (old or 0)
        return old is None

    def _drop_size(self, key: Hashable) -> bool:
        """Forget ``key``'s size; True if it was tracked."""
        old = self.sizes.pop(key, None)
        if old is None:
            return False
        self.size_total -= old
        return True


# --- candidate indexes: exact (lazy heap) and sampled (dense array) --------------------------


class _HeapIndex:
    """Candidates ordered by rank in a binary heap; stale entries are skipped lazily.

    Ranks are tuples ending in a unique sequence number, so keys are never compared.
    """

    __slots__ = ("_heap", "rank")

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[Any, ...], Hashable]] = []
        self.rank: dict[Hashable, tuple[Any, ...]] = {}

    def __len__(self) -> int:
        return len(self.rank)

    def __contains__(self, key: object) -> bool:
        return key in self.rank

    def update(self, key: Hashable, rank: tuple[Any, ...]) -> None:
        self.rank[key] = rank
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 2 * len(self.rank) + 64:
            self._compact()

    def discard(self, key: Hashable) -> None:
        self.rank.pop(key, None)

    def best(self, n: int) -> list[Hashable]:
        """The ``n`` lowest-ranked candidates, best first (heap left as it was, minus stale)."""
        heap, rank = self._heap, self.rank
        out: list[Hashable] = []
        popped: list[tuple[tuple[Any, ...], Hashable]] = []
        while heap and len(out) < n:
            item = heapq.heappop(heap)
            if rank.get(item[1]) == item[0]:
                out.append(item[1])
                popped.append(item)
        for item in popped:
            heapq.heappush(heap, item)
        return out

    def _compact(self) -> None:
        self._heap = [(r, k) for k, r in self.rank.items()]
        heapq.heapify(self._heap)

    def check(self) -> None:
        live = {(r, k) for r, k in self._heap if self.rank.get(k) == r}
        assert len(live) == len(self.rank), "every candidate has exactly one live heap entry"


class _SampleIndex:
    """Candidates in a dense array for O(1) uniform sampling (swap-pop removal)."""

    __slots__ = ("_items", "_pos", "_rng", "k", "rank")

    def __init__(self, k: int, seed: int) -> None:
        self._items: list[Hashable] = []
        self._pos: dict[Hashable, int] = {}
        self.rank: dict[Hashable, tuple[Any, ...]] = {}
        self.k = k
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def update(self, key: Hashable, rank: tuple[Any, ...]) -> None:
        self.rank[key] = rank
        if key not in self._pos:
            self._pos[key] = len(self._items)
            self._items.append(key)

    def discard(self, key: Hashable) -> None:
        pos = self._pos.pop(key, None)
        if pos is None:
            return
        del self.rank[key]
        last = self._items.pop()
        if pos < len(self._items):
            self._items[pos] = last
            self._pos[last] = pos

    def best(self, n: int) -> list[Hashable]:
        """``n`` victims, each the lowest-ranked of ``k`` fresh random draws (Redis-style)."""
        items, rank = self._items, self.rank
        n = min(n, len(items))
        if 2 * n >= len(items) or len(items) <= self.k:  # cheap enough, and exact
            return sorted(items, key=rank.__getitem__)[:n]
        chosen: dict[Hashable, None] = {}
        while len(chosen) < n:
            pool = [k for k in self._rng.sample(items, self.k) if k not in chosen]
            if pool:
                chosen[min(pool, key=rank.__getitem__)] = None
        return list(chosen)

    def check(self) -> None:
        assert len(self._items) == len(self._pos) == len(self.rank)
        assert all(self._items[i] == k for k, i in self._pos.items())


def _index(sample_size: int, seed: int) -> _HeapIndex | _SampleIndex:
    if sample_size < 0:
        raise ValueError(f"sample_size must be >= 0, got {sample_size}")
    return _SampleIndex(sample_size, seed) if sample_size else _HeapIndex()


# --- the policies ------------------------------------------------------------------------------


class LRU(BasePolicy):
    """Least recently used; reads and writes both refresh.

    Exact mode keeps ``sizes`` itself as an ``OrderedDict`` in recency order (least recent
    first), so every operation is one C-level dict operation.
    """

    name = "lru"

    def __init__(self, sample_size: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.sample_size = sample_size
        self._seq = 0
        self._od: OrderedDict[Hashable, int] | None = None
        self._cand: _HeapIndex | _SampleIndex | None = None
        if sample_size:
            self._cand = _index(sample_size, seed)
        else:
            self._od = OrderedDict()
            self.sizes = self._od

    def on_write(
        self, key: Hashable, now: float, size: int = 1, parent: Hashable | None = None
    ) -> None:
        self._add_size(key, size)
        self._refresh(key)

    def on_access(self, key: Hashable, now: float) -> None:
        if key in self.sizes:
            self._refresh(key)

    def _refresh(self, key: Hashable) -> None:
        if self._od is not None:
            self._od.move_to_end(key)
        else:
            self._seq += 1
            self._cand.update(key, (self._seq,))  # type: ignore[union-attr]

    def on_remove(self, key: Hashable) -> None:
        if self._drop_size(key) and self._cand is not None:
            self._cand.discard(key)

    def victims(self, n: int, now: float) -> list[Hashable]:
        if self._od is not None:
            return list(islice(self._od, max(n, 0)))
        return self._cand.best(n)  # type: ignore[union-attr]

    # Fast paths for the replay loop (same results as the generic versions, fewer calls).
    def touch_chain(
        self, keys: Sequence[Hashable], now: float, parent: Hashable | None = None, size: int = 1
    ) -> list[Hashable]:
        od = self._od
        if od is None:
            return super().touch_chain(keys, now, parent, size)
        move = od.move_to_end
        written: list[Hashable] = []
        for key in keys:
            if key in od:
                move(key)
            else:
                od[key] = size
                written.append(key)
        self.size_total += size * len(written)
        return written

    def access_many(self, keys: Iterable[Hashable], now: float) -> None:
        od = self._od
        if od is None:
            return super().access_many(keys, now)
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        try:
            deque(map(od.move_to_end, keys), maxlen=0)
        except KeyError:
            # A key we do not track (removed meanwhile): redo one by one, skipping unknowns.
            # Moving the same keys again in the same order gives the same final order.
            for key in keys:
                if key in od:
                    od.move_to_end(key)

    def evict(self, n: int, now: float) -> list[Hashable]:
        od = self._od
        if od is None:
            return super().evict(n, now)
        keys = list(islice(od, max(n, 0)))
        self.size_total -= sum(map(od.pop, keys))
        return keys

    def check(self) -> None:
        super().check()
        if self._cand is not None:
            self._cand.check()
            assert set(self._cand.rank) == set(self.sizes)


class LFU(BasePolicy):
    """Least frequently used, with ageing: each use is worth ``2 ** (-age / half_life)``.

    The decayed count of a key is ``sum(2 ** ((t_i - now) / half_life))`` over its uses. Every
    key's count decays by the same factor as time passes, so the order only changes when a key is
    used: storing ``log(sum(2 ** (t_i / half_life)))`` gives a rank that is fixed between uses
    (kept in log space so it never overflows). ``half_life <= 0`` disables ageing (plain counts).
    Ties go to the least recently used key.
    """

    name = "lfu"

    def __init__(self, half_life: float = 600.0, sample_size: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.half_life = half_life
        self._rate = math.log(2) / half_life if half_life > 0 else 0.0
        self._t0: float | None = None
        self._score: dict[Hashable, float] = {}
        self._seq = 0
        self._cand = _index(sample_size, seed)

    def _credit(self, now: float) -> float:
        """log of one use at ``now`` in the time-anchored scale (0 for plain counts)."""
        if self._t0 is None:
            self._t0 = now
        return self._rate * (self._tick(now) - self._t0)

    def _use(self, key: Hashable, now: float) -> None:
        credit = self._credit(now)
        old = self._score.get(key)
        if old is None:
            score = credit
        elif self._rate:
            hi, lo = (old, credit) if old > credit else (credit, old)
            score = hi + math.log1p(math.exp(lo - hi))
        else:
            score = math.log(math.exp(old) + 1.0)
        self._score[key] = score
        self._seq += 1
        self._cand.update(key, (score, self._seq))

    def on_write(
        self, key: Hashable, now: float, size: int = 1, parent: Hashable | None = None
    ) -> None:
        self._add_size(key, size)
        self._use(key, now)

    def on_access(self, key: Hashable, now: float) -> None:
        if key in self.sizes:
            self._use(key, now)

    def on_remove(self, key: Hashable) -> None:
        if self._drop_size(key):
            del self._score[key]
            self._cand.discard(key)

    def victims(self, n: int, now: float) -> list[Hashable]:
        return self._cand.best(n)

    def count(self, key: Hashable, now: float) -> float:
        """The decayed use count of ``key`` at ``now`` (0 if untracked)."""
        score = self._score.get(key)
        if score is None:
            return 0.0
        if not self._rate:
            return math.exp(score)
        return math.exp(score - self._rate * (max(now, self._clock) - (self._t0 or 0.0)))

    def check(self) -> None:
        super().check()
        self._cand.check()
        assert set(self._score) == set(self.sizes) == set(self._cand.rank)


class TTL(BasePolicy):
    """Time to live by write time: :meth:`expired` lists blocks written ``ttl_seconds`` ago or
    more; under capacity pressure the oldest-written go first. Reads do not extend a TTL.

    ``sizes`` is an ``OrderedDict`` in write order (a re-write moves the key to the end).
    """

    name = "ttl"
    has_ttl = True

    def __init__(self, ttl_seconds: float = 3600.0) -> None:
        super().__init__()
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        self.ttl_seconds = ttl_seconds
        self._od: OrderedDict[Hashable, int] = OrderedDict()
        self.sizes = self._od
        self._written: dict[Hashable, float] = {}

    def on_write(
        self, key: Hashable, now: float, size: int = 1, parent: Hashable | None = None
    ) -> None:
        self._add_size(key, size)
        self._od.move_to_end(key)
        self._written[key] = self._tick(now)

    def on_access(self, key: Hashable, now: float) -> None:
        return None  # by definition: a TTL counts from the write

    def on_remove(self, key: Hashable) -> None:
        if self._drop_size(key):
            del self._written[key]

    def victims(self, n: int, now: float) -> list[Hashable]:
        return list(islice(self._od, max(n, 0)))

    def expired(self, now: float) -> list[Hashable]:
        deadline = now - self.ttl_seconds
        out = []
        for key in self._od:
            if self._written[key] > deadline:
                break
            out.append(key)
        return out

    def check(self) -> None:
        super().check()
        assert set(self._written) == set(self._od)
        times = [self._written[k] for k in self._od]
        assert times == sorted(times), "write-order list is sorted by write time"


class LeafLRU(BasePolicy):
    """LRU over leaves: a block is evictable only when no tracked block has it as ``parent``.

    Suffix blocks therefore go before their prefixes, and a parent is never evicted while a
    child remains. Child counts are kept even for untracked parents, so blocks may arrive in
    any order (a child before its parent, as when tiers demote leaves first). A block that
    becomes a leaf competes with its own last-use time, so the order stays exact.

    :meth:`victims` returns current leaves only; parents freed by removing them show up on the
    next call (:meth:`evict` does this, one victim at a time).
    """

    name = "leaf_lru"

    def __init__(self, sample_size: int = 0, seed: int = 0) -> None:
        super().__init__()
        self._parent: dict[Hashable, Hashable | None] = {}
        self._children: dict[Hashable, int] = {}
        self._last: dict[Hashable, int] = {}
        self._seq = 0
        self._cand = _index(sample_size, seed)

    def on_write(
        self, key: Hashable, now: float, size: int = 1, parent: Hashable | None = None
    ) -> None:
        if not self._add_size(key, size):
            self.on_access(key, now)
            return
        self._parent[key] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            self._cand.discard(parent)
        self._seq += 1
        self._last[key] = self._seq
        if not self._children.get(key):
            self._cand.update(key, (self._seq,))

    def on_access(self, key: Hashable, now: float) -> None:
        if key not in self.sizes:
            return
        self._seq += 1
        self._last[key] = self._seq
        if key in self._cand:
            self._cand.update(key, (self._seq,))

    def on_remove(self, key: Hashable) -> None:
        if not self._drop_size(key):
            return
        self._cand.discard(key)
        del self._last[key]
        parent = self._parent.pop(key)
        if parent is None:
            return
        left = self._children[parent] - 1
        if left:
            self._children[parent] = left
            return
        del self._children[parent]
        if parent in self.sizes:
            self._cand.update(parent, (self._last[parent],))

    def victims(self, n: int, now: float) -> list[Hashable]:
        return self._cand.best(n)

    def evict(self, n: int, now: float) -> list[Hashable]:
        out: list[Hashable] = []
        while len(out) < n:
            chosen = self._cand.best(1)
            if not chosen:
                break
            self.on_remove(chosen[0])
            out.append(chosen[0])
        return out

    def is_leaf(self, key: Hashable) -> bool:
        """True if ``key`` is tracked and no tracked block has it as parent."""
        return key in self.sizes and not self._children.get(key)

    def check(self) -> None:
        super().check()
        self._cand.check()
        counts: dict[Hashable, int] = {}
        for parent in self._parent.values():
            if parent is not None:
                counts[parent] = counts.get(parent, 0) + 1
        assert counts == self._children, "child counts match the parent links"
        leaves = {k for k in self.sizes if not counts.get(k)}
        assert leaves == set(self._cand.rank), "candidates are exactly the tracked leaves"
        assert set(self._parent) == set(self._last) == set(self.sizes)


class RandomLRU(BasePolicy):
    """Tair KVCM's RandomLRU (``optimizer/eviction_policy``), reproduced draw for draw.

    Blocks and their last-use times sit in parallel arrays. For ``n`` victims, ``k = min(n,
    blocks, s)`` with ``s = int(batch_size / sample_rate)`` (``sample_rate <= 0`` means 0.1):
    draw ``s`` indices *with replacement* from a xorshift64 generator (seed
    ``0x12345678ABCDEF01``, shifts 13/7/17, index = state mod blocks), sort the draws by time
    (stable) and take the first ``k``, skipping duplicates — so fewer than ``k`` may come back,
    exactly as in Tair. Removal is swap-with-last.
    """

    name = "random_lru"
    SEED = 0x12345678ABCDEF01

    def __init__(self, batch_size: int = 100, sample_rate: float = 0.1) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        rate = sample_rate if sample_rate > 0 else 0.1
        self.sampling_size = max(1, int(batch_size / rate))
        self._keys: list[Hashable] = []
        self._times: list[float] = []
        self._pos: dict[Hashable, int] = {}
        self._state = self.SEED

    def _draw(self, count: int, size: int) -> list[int]:
        """``count`` xorshift64 indices below ``size`` (inlined: this is the hot loop)."""
        x = self._state
        out: list[int] = []
        append = out.append
        for _ in range(count):
            x ^= (x << 13) & _M64
            x ^= x >> 7
            x ^= (x << 17) & _M64
            append(x % size)
        self._state = x
        return out

    def on_write(
        self, key: Hashable, now: float, size: int = 1, parent: Hashable | None = None
    ) -> None:
        if self._add_size(key, size):
            self._pos[key] = len(self._keys)
            self._keys.append(key)
            self._times.append(now)
        else:
            self._times[self._pos[key]] = now

    def on_access(self, key: Hashable, now: float) -> None:
        pos = self._pos.get(key)
        if pos is not None:
            self._times[pos] = now

    def on_remove(self, key: Hashable) -> None:
        if not self._drop_size(key):
            return
        pos = self._pos.pop(key)
        last_key, last_time = self._keys.pop(), self._times.pop()
        if pos < len(self._keys):
            self._keys[pos], self._times[pos] = last_key, last_time
            self._pos[last_key] = pos

    def victims(self, n: int, now: float) -> list[Hashable]:
        size = len(self._keys)
        k = min(n, size, self.sampling_size)
        if k <= 0:
            return []
        draws = self._draw(self.sampling_size, size)
        # Tair partial-sorts by time; nsmallest is a stable partial sort.
        oldest = heapq.nsmallest(k, draws, key=self._times.__getitem__)
        return [self._keys[i] for i in dict.fromkeys(oldest)]

    def check(self) -> None:
        super().check()
        assert len(self._keys) == len(self._times) == len(self._pos) == len(self.sizes)
        assert all(self._keys[i] == k for k, i in self._pos.items())


POLICIES: dict[str, type[BasePolicy]] = {
    cls.name: cls for cls in (LRU, LFU, TTL, LeafLRU, RandomLRU)
}


def make_policy(name: str, **opts: Any) -> BasePolicy:
    """Build the policy registered as ``name`` with its options.

    :raises ValueError: unknown name (the message lists the valid ones) or unknown option.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(POLICIES)}")
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no option {', '.join(unknown)}; "
            f"options: {', '.join(accepted) or 'none'}"
        )
    return cls(**opts)

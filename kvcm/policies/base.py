"""The policy interface, the shared base class and the candidate indexes (exact heap, sampled
array) the policies order their victims with."""

from __future__ import annotations

import heapq
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
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

    def dump(self, key: Callable[[Hashable], object] = lambda k: k) -> dict[str, object]:
        """The whole state as plain data (lists, numbers, keys as ``key`` gives them), for
        :meth:`load` into a fresh policy with the same options: victims come out as before."""
        return {"sizes": [[key(k), v] for k, v in self.sizes.items()], "clock": self._clock, **self._dump(key)}

    def load(self, state: dict[str, Any], key: Callable[[object], Hashable] = lambda k: k) -> None:
        """Restore :meth:`dump`'s output; ``key`` turns a stored key back into a key (tuples come
        back from msgpack as lists)."""
        self.sizes.clear()
        self.sizes.update((key(k), v) for k, v in state["sizes"])
        self.size_total = sum(self.sizes.values())
        self._clock = state["clock"]
        self._load(state, key)

    @abstractmethod
    def _dump(self, key: Callable[[Hashable], object]) -> dict[str, object]:
        ...

    @abstractmethod
    def _load(self, state: dict[str, Any], key: Callable[[object], Hashable]) -> None:
        ...

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
        self._heap: list[tuple[tuple[float, ...], Hashable]] = []
        self.rank: dict[Hashable, tuple[float, ...]] = {}

    def __len__(self) -> int:
        return len(self.rank)

    def __contains__(self, key: object) -> bool:
        return key in self.rank

    def update(self, key: Hashable, rank: tuple[float, ...]) -> None:
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
        popped: list[tuple[tuple[float, ...], Hashable]] = []
        seen: set[Hashable] = set()
        while heap and len(out) < n:
            item = heapq.heappop(heap)
            # a key dropped and put back at its old rank (a leaf_lru parent) has two live entries
            if rank.get(item[1]) == item[0] and item[1] not in seen:
                seen.add(item[1])
                out.append(item[1])
                popped.append(item)  # stale entries and repeats stay out
        for item in popped:
            heapq.heappush(heap, item)
        return out

    def _compact(self) -> None:
        self._heap = [(r, k) for k, r in self.rank.items()]
        heapq.heapify(self._heap)

    def dump(self, key: Callable[[Hashable], object]) -> list[object]:
        return [[key(k), list(r)] for k, r in self.rank.items()]

    def load(self, rows: list[Any], key: Callable[[object], Hashable]) -> None:
        self.rank = {key(k): tuple(r) for k, r in rows}
        self._compact()

    def check(self) -> None:
        live = {(r, k) for r, k in self._heap if self.rank.get(k) == r}
        assert len(live) == len(self.rank), "every candidate has exactly one live heap entry"


class _SampleIndex:
    """Candidates in a dense array for O(1) uniform sampling (swap-pop removal)."""

    __slots__ = ("_items", "_pos", "_rng", "k", "rank")

    def __init__(self, k: int, seed: int) -> None:
        self._items: list[Hashable] = []
        self._pos: dict[Hashable, int] = {}
        self.rank: dict[Hashable, tuple[float, ...]] = {}
        self.k = k
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def update(self, key: Hashable, rank: tuple[float, ...]) -> None:
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

    def dump(self, key: Callable[[Hashable], object]) -> list[object]:
        state = self._rng.getstate()
        return [[[key(k), list(self.rank[k])] for k in self._items], [state[0], list(state[1]), state[2]]]

    def load(self, rows: list[Any], key: Callable[[object], Hashable]) -> None:
        items, rng = rows
        self._items = [key(k) for k, _ in items]
        self._pos = {k: i for i, k in enumerate(self._items)}
        self.rank = {k: tuple(r) for k, (_, r) in zip(self._items, items)}
        self._rng.setstate((rng[0], tuple(rng[1]), rng[2]))

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

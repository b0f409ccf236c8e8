"""``lru``: least recently used first; reads and writes refresh a block."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import islice
from typing import Any

from kvcm.policies.base import BasePolicy, _HeapIndex, _index, _SampleIndex


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

    def _dump(self, key: Callable[[Hashable], object]) -> dict[str, object]:
        return {"seq": self._seq, "cand": None if self._cand is None else self._cand.dump(key)}

    def _load(self, state: dict[str, Any], key: Callable[[object], Hashable]) -> None:
        self._seq = state["seq"]
        if self._cand is not None:
            self._cand.load(state["cand"], key)

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

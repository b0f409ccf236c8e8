"""``random_lru``: Tair KVCM's RandomLRU, sampled with replacement from a
fixed-seed xorshift64."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from typing import Any

from kvcm.policies.base import _M64, BasePolicy


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

    def _dump(self, key: Callable[[Hashable], object]) -> dict[str, object]:
        return {"keys": [key(k) for k in self._keys], "times": list(self._times), "state": self._state}

    def _load(self, state: dict[str, Any], key: Callable[[object], Hashable]) -> None:
        self._keys = [key(k) for k in state["keys"]]
        self._times = list(state["times"])
        self._pos = {k: i for i, k in enumerate(self._keys)}
        self._state = state["state"]

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

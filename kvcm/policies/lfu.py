"""``lfu``: lowest exponentially decayed use count first (ties: least recent)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

from kvcm.policies.base import BasePolicy, _index


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

    def _dump(self, key: Callable[[Hashable], object]) -> dict[str, object]:
        return {"t0": self._t0, "seq": self._seq, "score": [[key(k), v] for k, v in self._score.items()],
                "cand": self._cand.dump(key)}

    def _load(self, state: dict[str, Any], key: Callable[[object], Hashable]) -> None:
        self._t0, self._seq = state["t0"], state["seq"]
        self._score = {key(k): v for k, v in state["score"]}
        self._cand.load(state["cand"], key)

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

"""``ttl``: blocks past their time to live since written; under pressure, oldest written first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from itertools import islice
from typing import Any

from kvcm.policies.base import BasePolicy


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

    def _dump(self, key: Callable[[Hashable], object]) -> dict[str, object]:
        return {"written": [[key(k), t] for k, t in self._written.items()]}

    def _load(self, state: dict[str, Any], key: Callable[[object], Hashable]) -> None:
        self._written = {key(k): t for k, t in state["written"]}

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

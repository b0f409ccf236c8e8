"""``leaf_lru``: least recently used among leaves, so suffixes go before their prefixes."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from kvcm.policies.base import BasePolicy, _index


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

    def _dump(self, key: Callable[[Hashable], object]) -> dict[str, object]:
        return {"seq": self._seq, "parent": [[key(k), None if p is None else key(p)] for k, p in self._parent.items()],
                "children": [[key(k), n] for k, n in self._children.items()],
                "last": [[key(k), n] for k, n in self._last.items()], "cand": self._cand.dump(key)}

    def _load(self, state: dict[str, Any], key: Callable[[object], Hashable]) -> None:
        self._seq = state["seq"]
        self._parent = {key(k): None if p is None else key(p) for k, p in state["parent"]}
        self._children = {key(k): n for k, n in state["children"]}
        self._last = {key(k): n for k, n in state["last"]}
        self._cand.load(state["cand"], key)

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

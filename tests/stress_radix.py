#!/usr/bin/env python3
"""Seeded stress test of kvcm.optimizer.radix.RadixTree against a plain model.

Weighted random actions (insert from the root, under an existing block, under an unknown
parent; prefix queries with masks; removals with and without cleaning; full cleans) run on a
tree and on a model (a dict of parents and a set of live keys). After every action the tree's
``check()`` runs and its answers must equal the model's. Not collected by pytest (the file name
does not start with ``test_``); run it with::

    python tests/stress_radix.py --seed 1 --iterations 20000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcm.cache.keys import mix
from kvcm.optimizer.radix import RadixTree

ACTIONS: list[tuple[int, Callable[[State], None]]] = []


def actor(weight: int) -> Callable[[Callable[[State], None]], Callable[[State], None]]:
    """Register a random action with its weight."""

    def register(fn: Callable[[State], None]) -> Callable[[State], None]:
        ACTIONS.append((weight, fn))
        return fn

    return register


class State:
    """The tree, the model and the random source of one run."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.tree = RadixTree()
        self.parent: dict[int, int | None] = {}  # every key in the tree -> the block before it
        self.live: set[int] = set()
        self.now = 0.0

    def path(self, start: int | None, depth: int) -> list[int]:
        """Prefix-dependent keys of a random walk below ``start`` over a 3-letter alphabet."""
        keys, h = [], start or 0
        for _ in range(depth):
            h = mix(h, self.rng.randrange(3))
            keys.append(h)
        return keys

    def insert(self, keys: list[int], anchor: int | None) -> None:
        expected = [k for k in dict.fromkeys(keys) if k not in self.live]
        written = self.tree.insert(keys, self.now, anchor)
        assert written == expected, (written, expected)
        top = anchor if anchor in self.parent else None
        for k in keys:
            self.parent.setdefault(k, top)
            top = k
        self.live.update(keys)

    def sync_after_clean(self) -> None:
        """Cleaning may delete tombstones: they must have been dead; forget them in the model."""
        for key in [k for k in self.parent if k not in self.tree._where]:
            assert key not in self.live, f"clean deleted live block {key}"
            del self.parent[key]

    def verify(self) -> None:
        self.tree.check()
        assert set(self.tree._live) == self.live
        assert set(self.tree._where) == set(self.parent)
        sample = self.rng.sample(sorted(self.parent), min(20, len(self.parent)))
        for key in sample:
            assert self.tree.parent_of(key) == self.parent[key], key


@actor(6)
def insert_from_root(s: State) -> None:
    s.insert(s.path(None, s.rng.randint(1, 12)), None)


@actor(3)
def insert_below_a_block(s: State) -> None:
    if s.parent:
        anchor = s.rng.choice(sorted(s.parent))
        s.insert(s.path(anchor, s.rng.randint(1, 6)), anchor)


@actor(1)
def insert_below_unknown_parent(s: State) -> None:
    unknown = s.rng.getrandbits(63)
    s.insert(s.path(unknown, s.rng.randint(1, 4)), unknown)


@actor(6)
def prefix_query(s: State) -> None:
    keys = s.path(None, s.rng.randint(0, 12))
    if s.rng.random() < 0.5:
        mask: int | list[bool] = s.rng.randint(0, 3)
        look = keys[min(mask, len(keys)) :]
        internal = min(mask, len(keys))
    else:
        mask = [s.rng.random() < 0.3 for _ in keys]
        look = [k for k, m in zip(keys, mask) if not m]
        internal = sum(mask)
    external = 0
    for key in look:
        if key not in s.live:
            break
        external += 1
    assert s.tree.match(keys, mask, s.now) == (internal, external)


@actor(4)
def remove_some(s: State) -> None:
    if not s.live:
        return
    keys = s.rng.sample(sorted(s.live), min(len(s.live), s.rng.randint(1, 8)))
    keys.append(s.rng.getrandbits(63))  # unknown keys are ignored
    clean = s.rng.random() < 0.5
    assert s.tree.remove(keys, clean=clean) == len(keys) - 1
    s.live.difference_update(keys)
    if clean:
        s.sync_after_clean()


@actor(1)
def clean_everything(s: State) -> None:
    s.tree.clean()
    s.sync_after_clean()
    for node in s.tree.nodes():
        if node is not s.tree.root and not node.children:
            assert node.keys[-1] in s.live, "after clean() no branch ends in a tombstone"


def run(seed: int, iterations: int) -> State:
    """Run ``iterations`` weighted random actions with ``seed``; raises on the first mismatch."""
    state = State(seed)
    weights = [w for w, _ in ACTIONS]
    actions = [fn for _, fn in ACTIONS]
    for i in range(iterations):
        state.now += 1.0
        action = state.rng.choices(actions, weights)[0]
        try:
            action(state)
            state.verify()
        except AssertionError:
            print(f"seed {seed}: iteration {i}, action {action.__name__} failed", file=sys.stderr)
            raise
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=10000)
    args = parser.parse_args()
    start = time.perf_counter()
    state = run(args.seed, args.iterations)
    print(f"seed {args.seed}: {args.iterations} actions OK in {time.perf_counter() - start:.1f} s; "
          f"{len(state.tree)} live / {state.tree.total_blocks} blocks, "
          f"{sum(1 for _ in state.tree.nodes())} nodes")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

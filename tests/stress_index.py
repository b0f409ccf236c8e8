"""Seeded stress test of MetaIndex (not collected by pytest: run it directly).

    python tests/stress_index.py --seed 7 --ops 20000 --threads 4 --store lmdb

Weighted random actions (put, delete, append, keep, read, scan) run from several threads
against an in-memory model; every ``--check-every`` operations the threads pause and
``index.check()`` plus a comparison with the model must pass. Exits non-zero on the first
violation, printing the seed.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
from collections.abc import Callable

from kvcm.backends.metastore import LmdbStore, MemoryStore
from kvcm.cache.meta_index import KEEP, MetaIndex, namespace

ACTIONS: list[tuple[str, int]] = [("put", 30), ("append", 20), ("delete", 10), ("keep", 5), ("read", 30), ("scan", 5)]
NAMESPACES = [namespace(f"inst{i}") for i in range(3)]


class Stress:
    def __init__(self, index: MetaIndex, seed: int, key_space: int) -> None:
        self.index = index
        self.seed = seed
        self.key_space = key_space
        self.model: dict[tuple[bytes, int], bytes] = {}
        self.model_lock = threading.Lock()  # the model mirrors commits in commit order
        self.errors: list[str] = []

    def keys(self, rng: random.Random) -> list[int]:
        return [rng.randrange(-self.key_space, self.key_space) for _ in range(rng.randint(1, 12))]

    def run(self, rng: random.Random, ops: int, pause: threading.Barrier | None, every: int) -> None:
        names = [name for name, _ in ACTIONS]
        weights = [w for _, w in ACTIONS]
        for n in range(ops):
            action = rng.choices(names, weights)[0]
            getattr(self, "do_" + action)(rng, rng.choice(NAMESPACES))
            if pause is not None and (n + 1) % every == 0:
                try:
                    pause.wait()  # all threads stop here while the checker runs
                    pause.wait()
                except threading.BrokenBarrierError:
                    return  # the checker failed and aborted the run

    def _write(self, ns: bytes, keys: list[int], fn: Callable[[bytes | None], object]) -> None:
        # The model lock spans the commit, so model order == commit order.
        with self.model_lock, self.index.store.write() as txn:
            results = self.index.read_modify_write(txn, ns, keys, lambda i, k, old: fn(old))
            changes = [((ns, k), r) for k, r in zip(keys, results) if r is not KEEP]
            txn.on_commit(lambda: self._apply(changes))

    def _apply(self, changes: list[tuple[tuple[bytes, int], object]]) -> None:
        for key, result in changes:  # in call order: a repeated key ends with its last result
            if result is None:
                self.model.pop(key, None)
            else:
                self.model[key] = result  # type: ignore[assignment]

    def do_put(self, rng: random.Random, ns: bytes) -> None:
        value = rng.randbytes(rng.randint(1, 40))
        self._write(ns, self.keys(rng), lambda old: value)

    def do_append(self, rng: random.Random, ns: bytes) -> None:
        self._write(ns, self.keys(rng), lambda old: (old or b"") + b"+")

    def do_delete(self, rng: random.Random, ns: bytes) -> None:
        self._write(ns, self.keys(rng), lambda old: None)

    def do_keep(self, rng: random.Random, ns: bytes) -> None:
        self._write(ns, self.keys(rng), lambda old: KEEP)

    def do_read(self, rng: random.Random, ns: bytes) -> None:
        with self.index.read() as snap:
            self.index.get_values(snap, ns, self.keys(rng))

    def do_scan(self, rng: random.Random, ns: bytes) -> None:
        keys = [k for chunk in self.index.chunks(ns, size=rng.randint(1, 50)) for k, _ in chunk]
        if keys != sorted(keys):
            self.errors.append("scan out of order")

    def verify(self) -> None:
        self.index.check()
        with self.index.read() as snap:
            for (ns, key), value in self.model.items():
                got = self.index.get_values(snap, ns, [key])[0]
                assert got == value, f"key {key}: stored {got!r}, model {value!r}"
        with self.index.store.read() as view:
            count = view.count("blocks")
        assert count == len(self.model), f"{count} records stored, model has {len(self.model)}"
        assert not self.errors, self.errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ops", type=int, default=5000, help="operations per thread")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--keys", type=int, default=200, help="key space is [-keys, keys)")
    parser.add_argument("--check-every", type=int, default=500)
    parser.add_argument("--store", choices=("lmdb", "memory"), default="lmdb")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--cache", type=int, default=64)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = LmdbStore(tmp, map_size=64 << 20) if args.store == "lmdb" else MemoryStore()
        index = MetaIndex(store, shards=args.shards, batch_size=3, cache_size=args.cache)
        stress = Stress(index, args.seed, args.keys)
        barrier = threading.Barrier(args.threads + 1)
        threads = [threading.Thread(target=stress.run, args=(random.Random(args.seed * 1000 + i), args.ops, barrier,
                                                             args.check_every)) for i in range(args.threads)]
        for t in threads:
            t.start()
        rounds = args.ops // args.check_every
        try:
            for _r in range(rounds):
                barrier.wait()
                stress.verify()
                barrier.wait()
            for t in threads:
                t.join()
            stress.verify()
        except AssertionError as exc:
            print(f"FAILED (seed {args.seed}): {exc}", file=sys.stderr)
            barrier.abort()
            return 1
        finally:
            store.close()
    print(f"ok: seed {args.seed}, {args.threads} threads x {args.ops} ops, {rounds + 1} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())

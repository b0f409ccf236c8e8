"""kvcm.engines.compact: the numpy/numba tables against dict/set models, batch by batch."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

pytest.importorskip("numba")

from kvcm.engines.compact import (
    MAX_LOAD,
    CompactTable,
    HolderSets,
    KeyTable,
    SourceMap,
    as_u64,
    to_signed_list,
)
from kvcm.engines.table import HolderTable

M64 = (1 << 64) - 1
EDGE = [0, 1, M64, M64 - 1, 1 << 63, (1 << 63) - 1, 0xFFFFFFFF]  # unsigned forms


def mix(key: int) -> int:
    """The tables' home hash (splitmix64's finaliser), in Python."""
    z = key & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def home(key: int, bits: int) -> int:
    return mix(key) >> (64 - bits)


def colliding(n: int, bits: int, rng: random.Random, cell: int = 0) -> list[int]:
    """``n`` distinct keys whose home is ``cell`` in every index of up to ``bits`` bits
    (the same top ``bits`` bits of their mix)."""
    out: set[int] = set()
    while len(out) < n:
        k = rng.getrandbits(64)
        if home(k, bits) == cell:
            out.add(k)
    return sorted(out)


def key_pool(rng: random.Random, n: int) -> list[int]:
    """Unsigned keys: random, the edges, and a cluster colliding in small tables."""
    pool = set(EDGE) | {rng.getrandbits(64) for _ in range(n)} | set(colliding(24, 5, rng))
    return sorted(pool)


def signed(k: int) -> int:
    return k - (1 << 64) if k >= 1 << 63 else k


# --- KeyTable ----------------------------------------------------------------------------------


def check_keytable(kt: KeyTable, model: dict[int, int]) -> None:
    keys, sets = kt.items()
    assert dict(zip(keys.tolist(), sets.tolist())) == model
    assert len(kt) == len(model)
    assert len(kt) <= MAX_LOAD * kt.capacity
    probe = list(model) + [k ^ 0x5A5A for k in list(model)[:50]]
    got = kt.lookup_many(np.array(probe, dtype=np.uint64)).tolist()
    assert got == [model.get(k, 0) for k in probe]


@pytest.mark.parametrize("seed", range(6))
def test_keytable_matches_dict(seed: int) -> None:
    rng = random.Random(seed)
    pool = key_pool(rng, 3000)
    kt = KeyTable()  # 8 cells: grows through many doublings
    model: dict[int, int] = {}
    bits_seen = {kt.bits}
    for _ in range(150):
        op = rng.random()
        batch = rng.choices(pool, k=rng.randrange(1, 120))
        if op < 0.55:  # insert (duplicates in the batch included) and give each key a set
            rows = kt.locate_many(np.array(batch, dtype=np.uint64), insert=True)
            for k, r in zip(batch, rows.tolist()):
                assert r >= 0
                value = rng.randrange(1, 1 << 32)
                kt.sets[r] = value
                model[k] = value
            # a key named twice got one row
            assert len(set(rows.tolist())) == len(set(batch))
        elif op < 0.8:  # some keys' sets become empty: drop_empty deletes exactly those
            rows = kt.locate_many(np.array(batch, dtype=np.uint64), insert=False)
            absent = [k for k, r in zip(batch, rows.tolist()) if r < 0]
            assert all(k not in model for k in absent)
            emptied = [r for k, r in zip(batch, rows.tolist()) if r >= 0 and rng.random() < 0.7]
            for k, r in zip(batch, rows.tolist()):
                if r in emptied:
                    kt.sets[r] = 0
                    model.pop(k, None)
            kt.drop_empty(np.array(rows.tolist() + rows.tolist(), dtype=np.int64))  # named twice: freed once
        else:
            kt.remove_many(np.array(batch, dtype=np.uint64))
            for k in batch:
                model.pop(k, None)
        bits_seen.add(kt.bits)
        check_keytable(kt, model)
    assert max(bits_seen) >= 11  # several doublings happened
    kt.remove_many(np.array(list(model), dtype=np.uint64))
    model.clear()
    check_keytable(kt, model)
    assert kt.bits <= 5  # a table emptied gives its memory back


def test_keytable_signed_keys_and_edges() -> None:
    kt = KeyTable()
    signed_keys = [0, -1, 1, -(1 << 63), (1 << 63) - 1]
    rows = kt.locate_many(signed_keys, insert=True)
    kt.sets[rows] = np.arange(1, 6, dtype=np.uint32)
    assert kt.lookup_many(signed_keys).tolist() == [1, 2, 3, 4, 5]
    assert kt.lookup_many([M64]).tolist() == [2]  # -1 and 2**64 - 1 are one key
    assert sorted(to_signed_list(kt.items()[0])) == sorted(signed_keys)
    assert kt.lookup_many([2, 3]).tolist() == [0, 0]


def test_keytable_forced_collisions_tiny_table() -> None:
    rng = random.Random(7)
    keys = colliding(6, 3, rng, cell=7)  # home at the last cell: the probe run wraps around
    kt = KeyTable(capacity=6)
    assert kt.capacity == 8
    rows = kt.locate_many(keys, insert=True)
    assert kt.capacity == 8  # 6 <= 0.8 * 8: no growth, one run wrapping over the end
    kt.sets[rows] = 9
    for victim in [keys[1], keys[4], keys[0]]:
        r = kt.locate_many([victim], insert=False)
        kt.sets[r] = 0
        kt.drop_empty(r)
        keys.remove(victim)
        assert kt.lookup_many(keys).tolist() == [9] * len(keys)
        assert kt.lookup_many([victim]).tolist() == [0]
    more = colliding(3, 3, rng, cell=7)
    kt.sets[kt.locate_many(more, insert=True)] = 4  # rows of the deleted keys are reused
    assert int(kt.meta[1]) == 6
    assert kt.lookup_many(keys + more).tolist() == [9] * len(keys) + [4] * 3


@pytest.mark.parametrize("seed", range(4))
def test_backward_shift_keeps_keys_findable(seed: int) -> None:
    """Deleting inside probe runs, the index never grows or is rebuilt between deletions: a
    plain emptied cell would cut every run through it (keys past it not found)."""
    rng = random.Random(seed)
    kt = KeyTable(capacity=64)  # 128 cells, filled to 0.8 with colliding clusters
    bits = kt.bits
    keys = colliding(30, bits, rng, cell=(1 << bits) - 3)  # wraps
    keys += colliding(30, bits, rng, cell=40)
    keys += [k for k in (rng.getrandbits(64) for _ in range(200)) if k not in keys][:40]
    rows = kt.locate_many(keys, insert=True)
    assert kt.bits == bits
    kt.sets[rows] = 1
    live = list(keys)
    rng.shuffle(keys)
    for victim in keys[:80]:
        r = kt.locate_many([victim], insert=False)
        kt.sets[r] = 0
        kt.drop_empty(r)
        live.remove(victim)
        assert kt.lookup_many(live).tolist() == [1] * len(live), victim
    assert kt.lookup_many(keys[:80]).tolist() == [0] * 80


# --- SourceMap ------------------------------------------------------------------------------------


def check_sourcemap(sm: SourceMap, model: OrderedDict[int, int]) -> None:
    hashes, keys = sm.items()
    assert list(zip(hashes.tolist(), keys.tolist())) == list(model.items())
    assert len(sm) == len(model)
    probe = [*list(model)[:100], 1234567]
    found, got = sm.get_many(np.array(probe, dtype=np.uint64))
    assert found.tolist() == [h in model for h in probe]
    assert got.tolist() == [model.get(h, 0) for h in probe]


@pytest.mark.parametrize("seed", range(6))
def test_sourcemap_matches_ordered_dict(seed: int) -> None:
    rng = random.Random(seed)
    pool = key_pool(rng, 2500)
    sm = SourceMap()
    model: OrderedDict[int, int] = OrderedDict()
    for _ in range(200):
        op = rng.random()
        if op < 0.5:  # insert, re-inserting some present hashes and naming some twice
            hashes = rng.choices(pool, k=rng.randrange(1, 150))
            keys = [rng.choice(pool) for _ in hashes]
            had, old = sm.insert_many(np.array(hashes, dtype=np.uint64), np.array(keys, dtype=np.uint64))
            for h, k, was, prev in zip(hashes, keys, had.tolist(), old.tolist()):
                assert was == (h in model)
                assert prev == model.get(h, 0)
                model.pop(h, None)
                model[h] = k  # the newest
        elif op < 0.75:
            hashes = rng.choices(pool, k=rng.randrange(1, 150))
            found, keys = sm.remove_many(np.array(hashes, dtype=np.uint64))
            for h, was, k in zip(hashes, found.tolist(), keys.tolist()):
                assert was == (h in model)
                if was:
                    assert k == model.pop(h)
        else:
            n = rng.randrange(0, 200)
            hashes, keys = sm.oldest(n)
            expect = [model.popitem(last=False) for _ in range(min(n, len(model)))]
            assert list(zip(hashes.tolist(), keys.tolist())) == expect
        check_sourcemap(sm, model)
    rows_before = len(sm.hashes)
    sm.oldest(len(sm))
    model.clear()
    check_sourcemap(sm, model)
    assert len(sm.hashes) <= max(8, rows_before)  # emptied: packed, not grown


def test_sourcemap_grows_and_evicts_in_order() -> None:
    sm = SourceMap()
    n = 100_000
    hashes = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for lo in range(0, n, 1000):
        sm.insert_many(hashes[lo : lo + 1000], np.arange(lo, lo + 1000))
    assert len(sm) == n and sm.capacity >= n / MAX_LOAD
    sm.insert_many(hashes[:10], np.arange(10) + 7)  # re-inserted: now the newest
    got_h, got_k = sm.oldest(5)
    assert got_h.tolist() == hashes[10:15].tolist() and got_k.tolist() == list(range(10, 15))
    found, keys = sm.remove_many(hashes[:10])
    assert found.all() and keys.tolist() == list(range(7, 17))
    h, k = sm.items()
    assert h.tolist() == hashes[15:].tolist() and k.tolist() == list(range(15, n))
    assert len(sm.oldest(10 * n)[0]) == n - 15 and len(sm) == 0


def test_sourcemap_edge_hashes() -> None:
    sm = SourceMap()
    edges = np.array(EDGE, dtype=np.uint64)
    sm.insert_many(edges, edges[::-1].copy())
    found, keys = sm.get_many(edges)
    assert found.all() and keys.tolist() == EDGE[::-1]
    found, keys = sm.remove_many(np.array([0, M64], dtype=np.uint64))
    assert found.tolist() == [True, True] and keys.tolist() == [EDGE[-1], EDGE[-3]]
    assert sm.items()[0].tolist() == EDGE[1:2] + EDGE[3:]


# --- HolderSets and CompactTable --------------------------------------------------------------------


def test_holder_sets_refcounts_and_reuse() -> None:
    hs = HolderSets()
    ids = np.zeros(10, dtype=np.uint32)
    ids = hs.move(ids, 3)  # ten keys gain slot 3
    a = int(ids[0])
    assert a and hs.masks[a] == 1 << 3 and hs.refs[a] == 10 and hs.slots(a) == {3}
    ids[:4] = hs.move(ids[:4], 5)
    b = int(ids[0])
    assert hs.masks[b] == (1 << 3) | (1 << 5) and hs.refs[b] == 4 and hs.refs[a] == 6
    assert hs.contains(ids, 5).tolist() == [True] * 4 + [False] * 6
    assert hs.move(ids[:4], 5).tolist() == [b] * 4 and hs.refs[b] == 4  # no change: no refs moved
    ids[:4] = hs.move(ids[:4], ~3)  # {5}
    c = int(ids[0])
    assert hs.masks[c] == 1 << 5 and b not in hs._ids.values() and hs.refs[b] == 0
    ids[:] = hs.move(ids, ~3)
    ids[:] = hs.move(ids, ~5)
    assert ids.tolist() == [0] * 10 and len(hs) == 1 and not any(hs.refs)
    live = set(hs._ids.values())
    for src, steps in enumerate(hs._next):  # no transition cached from or to a freed id
        assert not steps or src in live
        assert set(steps.values()) <= live
    freed = {a, b, c}
    d = int(hs.move(np.zeros(1, dtype=np.uint32), 9)[0])
    assert d in freed  # ids are reused
    assert hs.masks[d] == 1 << 9 and hs.refs[d] == 1


def model_release(table: HolderTable, sid: int, keys: list[int]) -> None:
    table.release(sid, keys)


@pytest.mark.parametrize("seed", range(8))
def test_compact_table_matches_holder_table(seed: int) -> None:
    """The same holds, releases and forgets on a HolderTable and a CompactTable: the same
    masks per key, counts, extra holdings and runs, after every batch; then every holding
    released: refcounts back to zero, the key table empty."""
    rng = random.Random(seed)
    ref = HolderTable()
    ct = CompactTable()
    sids = [ref.slot(f"s{i}", "GPU", 0, True) for i in range(12)]
    pool = [signed(k) for k in key_pool(rng, 1500)]
    chains = [rng.sample(pool, 64) for _ in range(6)]  # prefixes engines share
    held: dict[int, list[int]] = {sid: [] for sid in sids}  # multiset of the model's holdings
    for _ in range(250):
        sid = rng.choice(sids)
        op = rng.random()
        if op < 0.5:
            if rng.random() < 0.5:
                keys = rng.choice(chains)[: rng.randrange(1, 65)]
            else:
                keys = rng.choices(pool, k=rng.randrange(1, 80))  # duplicates: extra holdings
            ref.hold(sid, keys)
            ct.hold(sid, keys)
            held[sid] += keys
        elif op < 0.9:
            mine = held[sid]
            keys = rng.sample(mine, min(len(mine), rng.randrange(0, 80))) + rng.choices(pool, k=rng.randrange(0, 5))
            ref.release(sid, keys)
            ct.release(sid, keys)
            for k in keys:
                if k in mine:
                    mine.remove(k)
        else:
            keys = list(set(held[sid]))
            ref.forget(1 << sid, keys)
            ref.counts[sid], ref.extra[sid] = 0, {}
            ct.forget(sid, keys)
            held[sid] = []
        assert ct.holders() == dict(ref.holders), sid
        for s in sids:
            assert ct.count(s) == len(set(held[s]))
            assert ct.extra.get(s, {}) == ref.extra[s]
        query = rng.choice(chains)
        allowed = rng.getrandbits(len(sids))
        assert ct.runs(query, allowed) == ref.runs(query, allowed)
        assert ct.masks(query) == [ref.holders[k] for k in query]
        masks = ct.sets.masks
        _, ids = ct.keys.items()
        counts: dict[int, int] = {}
        for i in ids.tolist():
            counts[i] = counts.get(i, 0) + 1
        assert all(ct.sets.refs[i] == n for i, n in counts.items())  # refcount = keys of the set
        assert all(ct.sets.slots(i) == {s for s in sids if masks[i] >> s & 1} for i in counts)
    for sid in sids:
        while held[sid]:
            keys = held[sid][:50]
            ct.release(sid, keys)
            for k in keys:
                held[sid].remove(k)
    assert len(ct.keys) == 0 and ct.holders() == {} and not ct.counts and not ct.extra
    assert len(ct.sets) == 1 and not any(ct.sets.refs)


def test_as_u64_forms() -> None:
    assert as_u64([-1, 0, 5]).tolist() == [M64, 0, 5]
    assert as_u64([M64, 1 << 63]).tolist() == [M64, 1 << 63]
    arr = np.array([-2], dtype=np.int64)
    assert as_u64(arr).tolist() == [M64 - 1]
    assert to_signed_list(as_u64([-5, 7])) == [-5, 7]

"""The compact engine-index tables (kvcm.engines.flat, keytable, holdersets, sourcemap, compact)
against dict/set models, batch by batch."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from kvcm.engines.compact import CompactTable
from kvcm.engines.flat import MAX_LOAD, MAX_POS, as_u64, to_signed_list
from kvcm.engines.holdersets import HolderSets
from kvcm.engines.keytable import KeyTable
from kvcm.engines.sourcemap import SourceMap

M64 = (1 << 64) - 1
EDGE = [0, 1, M64, M64 - 1, 1 << 63, (1 << 63) - 1, 0xFFFFFFFF]  # unsigned forms


def mix(key: int) -> int:
    """The tables' home hash (splitmix64's finaliser), in Python."""
    z = key & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def home(key: int, cells: int) -> int:
    """The home cell in an index of ``cells`` cells: the mix's top 32 bits, scaled."""
    return ((mix(key) >> 32) * cells) >> 32


def colliding(n: int, cells: int, rng: random.Random, cell: int = 0) -> list[int]:
    """``n`` distinct keys whose home is ``cell`` in an index of ``cells`` cells."""
    out: set[int] = set()
    while len(out) < n:
        k = rng.getrandbits(64)
        if home(k, cells) == cell:
            out.add(k)
    return sorted(out)


def key_pool(rng: random.Random, n: int) -> list[int]:
    """Unsigned keys: random, the edges, and a cluster colliding in small tables."""
    pool = set(EDGE) | {rng.getrandbits(64) for _ in range(n)} | set(colliding(24, 32, rng))
    return sorted(pool)


def signed(k: int) -> int:
    return k - (1 << 64) if k >= 1 << 63 else k


# --- KeyTable ----------------------------------------------------------------------------------


def check_keytable(kt: KeyTable, model: dict[int, int], pos: dict[int, int], rows: dict[int, int], peak: int) -> None:
    """``model``: key -> set; ``pos``: key -> position (-1: none); ``rows``: key -> the row it got
    when inserted (must still be its row); ``peak``: most live keys since the table was empty
    (rows are reused before new ones are taken, so rows used == peak)."""
    keys, sets = kt.items()
    assert dict(zip(keys.tolist(), sets.tolist())) == model
    assert len(kt) == len(model)
    assert len(kt) <= MAX_LOAD * kt.capacity
    probe = list(model) + [k ^ 0x5A5A for k in list(model)[:50]]
    got = kt.lookup_many(np.array(probe, dtype=np.uint64)).tolist()
    assert got == [model.get(k, 0) for k in probe]
    assert kt.pos_many(np.array(probe, dtype=np.uint64)).tolist() == [pos.get(k, -1) for k in probe]
    live = list(model)
    assert kt.locate_many(np.array(live, dtype=np.uint64), insert=False).tolist() == [rows[k] for k in live]
    assert kt.pos_of(np.array([rows[k] for k in live], dtype=np.int64)).tolist() == [pos[k] for k in live]
    assert sorted(kt.rows().tolist()) == sorted(rows[k] for k in live)
    assert int(kt.meta[1]) == peak


@pytest.mark.parametrize("seed", range(6))
def test_keytable_matches_dict(seed: int) -> None:
    """Sets, positions (keep-first) and rows (a key's row never changes while it lives) against
    dicts, through growth from 8 cells, deletions, index shrinking, and emptying."""
    rng = random.Random(seed)
    pool = key_pool(rng, 3000)
    kt = KeyTable()  # 8 cells: grows through many doublings
    model: dict[int, int] = {}
    pos: dict[int, int] = {}
    rows_of: dict[int, int] = {}
    peak = 0
    bits_seen = {kt.bits}
    mismatches = 0
    for step in range(300):
        op = rng.random()
        if step > 150:  # drain: the index shrinks while keys (and their rows) live on
            op = 0.7
        batch = rng.choices(pool, k=rng.randrange(1, 120))
        if op < 0.55:  # insert (duplicates in the batch included), with positions or not
            q = np.array(batch, dtype=np.uint64)
            if rng.random() < 0.6:
                given = [rng.choice([16, 32, MAX_POS, 0, rng.randrange(1 << 20)]) for _ in batch]
                rows, bad = kt.insert_many(q, given)
                for k, p, flagged in zip(batch, given, bad.tolist()):
                    if k not in model:
                        model[k], pos[k] = 0, -1
                    if pos[k] == -1:
                        pos[k] = p
                        assert not flagged
                    else:
                        assert flagged == (pos[k] != p)
                        mismatches += flagged
            else:
                rows = kt.locate_many(q, insert=True)
                for k in batch:
                    if k not in model:
                        model[k], pos[k] = 0, -1
            for k, r in zip(batch, rows.tolist()):
                assert r >= 0
                assert rows_of.setdefault(k, r) == r  # a live key keeps its row
                value = rng.randrange(1, 1 << 32)
                kt.sets[r] = value
                model[k] = value
            assert len(set(rows.tolist())) == len(set(batch))  # a key named twice got one row
            peak = max(peak, len(model))
        elif op < 0.8:  # some keys' sets become empty: drop_empty deletes exactly those
            rows = kt.locate_many(np.array(batch, dtype=np.uint64), insert=False)
            absent = [k for k, r in zip(batch, rows.tolist()) if r < 0]
            assert all(k not in model for k in absent)
            emptied = [r for k, r in zip(batch, rows.tolist()) if r >= 0 and rng.random() < 0.7]
            for k, r in zip(batch, rows.tolist()):
                if r in emptied:
                    kt.sets[r] = 0
                    if k in model:
                        del model[k], pos[k], rows_of[k]
            kt.drop_empty(np.array(rows.tolist() + rows.tolist(), dtype=np.int64))  # named twice: freed once
        else:
            kt.remove_many(np.array(batch, dtype=np.uint64))
            for k in batch:
                if k in model:
                    del model[k], pos[k], rows_of[k]
        if not model and int(kt.meta[1]) == 0:
            peak = 0  # emptied: started over
        bits_seen.add(kt.bits)
        check_keytable(kt, model, pos, rows_of, peak)
    assert max(bits_seen) >= 11  # several doublings happened
    assert kt.bits < max(bits_seen)  # and the index shrank while keys lived
    assert mismatches
    kt.remove_many(np.array(list(model), dtype=np.uint64))
    model.clear()
    pos.clear()
    check_keytable(kt, model, pos, {}, 0)
    assert kt.bits <= 5  # a table emptied gives its memory back


def test_keytable_positions_keep_first() -> None:
    kt = KeyTable()
    rows, bad = kt.insert_many([10, 11, 10], [160, 176, 999])  # named twice in a batch: first wins
    assert bad.tolist() == [False, False, True]
    assert kt.pos_many([10, 11, 12]).tolist() == [160, 176, -1]
    rows2, bad = kt.insert_many([11, 10], [176, 161])
    assert rows2.tolist() == rows[:2][::-1].tolist() and bad.tolist() == [False, True]
    assert kt.pos_of(rows).tolist() == [160, 176, 160]
    r = kt.locate_many([12], insert=True)  # no position yet: the first one given is taken
    assert kt.pos_of(r).tolist() == [-1]
    assert kt.set_pos(r, [48]).tolist() == [False] and kt.pos_many([12]).tolist() == [48]
    assert kt.set_pos(r, [48]).tolist() == [False] and kt.set_pos(r, [64]).tolist() == [True]
    kt.remove_many([10])  # deleted and inserted again: a new key, a new position
    _, bad = kt.insert_many([10], [0])
    assert bad.tolist() == [False] and kt.pos_many([10]).tolist() == [0]
    for wrong in ([-1], [MAX_POS + 1], [1 << 40]):
        with pytest.raises(ValueError):
            kt.insert_many([13], wrong)
    with pytest.raises(ValueError):
        kt.set_pos(r, [1, 2])


def test_keytable_rows_stable_through_growth_and_shrink() -> None:
    """Rows recorded at insertion name the same keys after the table grew 10 doublings, lost
    most keys (the index halving) and took new keys into the freed rows."""
    rng = random.Random(11)
    kt = KeyTable()
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    rows = kt.locate_many(keys, insert=True)
    kt.sets[rows] = 1
    keep = keys[::10]
    kept_rows = rows[::10].copy()
    gone = [k for i, k in enumerate(keys) if i % 10]
    kt.remove_many(gone)
    assert kt.capacity < 20_000 / MAX_LOAD  # the index shrank
    assert kt.keys[kept_rows].tolist() == keep and kt.locate_many(keep, insert=False).tolist() == kept_rows.tolist()
    fresh = [rng.getrandbits(64) for _ in range(5_000)]
    new_rows = kt.locate_many(fresh, insert=True)
    assert int(kt.meta[1]) == 20_000  # freed rows taken before new ones
    assert not set(new_rows.tolist()) & set(kept_rows.tolist())
    assert kt.keys[kept_rows].tolist() == keep


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
    keys = colliding(6, 8, rng, cell=7)  # home at the last cell: the probe run wraps around
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
    more = colliding(3, 8, rng, cell=7)
    kt.sets[kt.locate_many(more, insert=True)] = 4  # rows of the deleted keys are reused
    assert int(kt.meta[1]) == 6
    assert kt.lookup_many(keys + more).tolist() == [9] * len(keys) + [4] * 3


@pytest.mark.parametrize("seed", range(4))
def test_backward_shift_keeps_keys_findable(seed: int) -> None:
    """Deleting inside probe runs, the index never grows or is rebuilt between deletions: a
    plain emptied cell would cut every run through it (keys past it not found)."""
    rng = random.Random(seed)
    kt = KeyTable(capacity=100)  # 145 cells, filled to 0.7 with colliding clusters
    bits, cells = kt.bits, kt.capacity
    keys = colliding(30, cells, rng, cell=cells - 3)  # wraps
    keys += colliding(30, cells, rng, cell=40)
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
            keys = [rng.choice([0, 1, 0xFFFFFFFE, rng.randrange(1 << 32 - 1)]) for _ in hashes]  # rows
            had, old = sm.insert_many(np.array(hashes, dtype=np.uint64), np.array(keys, dtype=np.int64))
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
    sm.insert_many(edges, np.arange(len(EDGE))[::-1].copy())
    found, rows = sm.get_many(edges)
    assert found.all() and rows.tolist() == list(range(len(EDGE)))[::-1]
    found, rows = sm.remove_many(np.array([0, M64], dtype=np.uint64))
    assert found.tolist() == [True, True] and rows.tolist() == [len(EDGE) - 1, len(EDGE) - 3]
    for wrong in ([-1], [1 << 32], [0xFFFFFFFF]):  # not a KeyTable row
        with pytest.raises(ValueError):
            sm.insert_many([5], wrong)
    assert sm.items()[0].tolist() == EDGE[1:2] + EDGE[3:]


# --- HolderSets and CompactTable --------------------------------------------------------------------


def test_holder_sets_refcounts_and_reuse() -> None:
    hs = HolderSets()
    col = np.zeros(10, dtype=np.uint32)  # ten keys' set ids
    counts = np.zeros(16, dtype=np.int64)
    rows = np.arange(10, dtype=np.int64)

    def hold(at: slice, slot: int) -> np.ndarray:
        return hs.hold(col, rows[at], np.full(len(rows[at]), slot, dtype=np.int64), counts)

    def release(at: slice, slot: int) -> np.ndarray:
        return hs.release(col, rows[at], np.full(len(rows[at]), slot, dtype=np.int64), counts)

    assert not len(hold(slice(None), 3))  # ten keys gain slot 3
    a = int(col[0])
    assert a and hs.masks[a] == 1 << 3 and hs.refs[a] == 10 and hs.slots(a) == {3} and counts[3] == 10
    hold(slice(0, 4), 5)
    b = int(col[0])
    assert hs.masks[b] == (1 << 3) | (1 << 5) and hs.refs[b] == 4 and hs.refs[a] == 6 and counts[5] == 4
    assert hold(slice(0, 4), 5).tolist() == [0, 1, 2, 3]  # held already: beyond the first
    assert col[:4].tolist() == [b] * 4 and hs.refs[b] == 4 and counts[5] == 4  # no refs moved
    assert not len(release(slice(0, 4), 3))  # {5}
    c = int(col[0])
    assert hs.masks[c] == 1 << 5 and b not in hs._ids.values() and hs.refs[b] == 0
    assert not len(release(slice(4, 10), 5))  # not in their set: nothing
    assert release(slice(None), 3).tolist() == list(range(4, 10))  # left with nobody
    assert release(slice(None), 5).tolist() == list(range(4))
    assert col.tolist() == [0] * 10 and len(hs) == 1 and not any(hs.refs) and not counts.any()
    freed = {a, b, c}
    hs.hold(col, rows[:1], np.array([9], dtype=np.int64), counts)
    d = int(col[0])
    assert d in freed  # ids are reused, and no stale transition leads to their old sets
    assert hs.masks[d] == 1 << 9 and hs.refs[d] == 1
    hs.hold(col, rows[1:2], np.array([3], dtype=np.int64), counts)  # {3}: a transition cached for a freed id
    assert hs.masks[int(col[1])] == 1 << 3 and hs.refs[int(col[1])] == 1


def test_holder_sets_many_sets_and_slots_against_a_model() -> None:
    """Thousands of distinct sets over 200 slots, churned: the transition cache grows, goes
    stale and is rebuilt, and every key's set is still the model's."""
    rng = random.Random(7)
    hs = HolderSets()
    n = 3000
    col = np.zeros(n, dtype=np.uint32)
    counts = np.zeros(256, dtype=np.int64)
    model = [0] * n
    for _ in range(30):
        rows = np.array(rng.sample(range(n), 500), dtype=np.int64)
        slots = np.array([rng.randrange(200) for _ in range(500)], dtype=np.int64)
        if rng.random() < 0.6:
            hs.hold(col, rows, slots, counts)
            for r, s in zip(rows.tolist(), slots.tolist()):
                model[r] |= 1 << s
        else:
            hs.release(col, rows, slots, counts)
            for r, s in zip(rows.tolist(), slots.tolist()):
                model[r] &= ~(1 << s)
        assert [hs.masks[i] for i in col.tolist()] == model
        assert counts.tolist() == [sum(m >> s & 1 for m in model) for s in range(256)]
        live = {}
        for i in col.tolist():
            live[i] = live.get(i, 0) + 1
        assert all(hs.refs[i] == k for i, k in live.items() if i)
        assert len(hs) == len(set(live) | {0})


def _model_masks(held: dict[int, list[int]]) -> dict[int, int]:
    """Key -> bit mask of the slots holding it at least once."""
    out: dict[int, int] = {}
    for sid, keys in held.items():
        for key in set(keys):
            out[key] = out.get(key, 0) | 1 << sid
    return out


def _model_runs(masks: list[int], allowed: int) -> list[tuple[int, int, int]]:
    """HolderTable.runs' triples, one key at a time: ``(length, running AND before, after)``
    wherever the running AND of the allowed slots changes."""
    found: list[tuple[int, int, int]] = []
    if not allowed or not masks or not masks[0] & allowed:
        return found
    running, length = masks[0] & allowed, 1
    for mask in masks[1:]:
        kept = running & mask
        if kept != running:
            found.append((length, running, kept))
            if not kept:
                return found
            running = kept
        length += 1
    found.append((length, running, 0))
    return found


@pytest.mark.parametrize("seed", range(8))
def test_compact_table_matches_holder_table(seed: int) -> None:
    """Holds, releases and forgets on a CompactTable against a multiset model of the holdings:
    the same masks per key, counts, extra holdings and runs as HolderTable's dict form gave,
    after every batch; then every holding released: refcounts back to zero, the key table empty."""
    rng = random.Random(seed)
    ct = CompactTable()
    sids = list(range(12))
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
            if rng.random() < 0.3:  # one batch over several slots, as a wake-up settles
                slots = [rng.choice(sids) for _ in keys]
                ct.hold_many(np.array(slots, dtype=np.int64), keys)
                for s, k in zip(slots, keys):
                    held[s].append(k)
            else:
                ct.hold(sid, keys)
                held[sid] += keys
        elif op < 0.6:
            pairs = [(s, k) for s in rng.sample(sids, 3) for k in rng.sample(held[s], min(len(held[s]), 20))]
            pairs += [(rng.choice(sids), k) for k in rng.choices(pool, k=3)]
            rng.shuffle(pairs)
            ct.release_many(np.array([s for s, _ in pairs], dtype=np.int64), [k for _, k in pairs])
            for s, k in pairs:
                if k in held[s]:
                    held[s].remove(k)
        elif op < 0.9:
            mine = held[sid]
            keys = rng.sample(mine, min(len(mine), rng.randrange(0, 80))) + rng.choices(pool, k=rng.randrange(0, 5))
            ct.release(sid, keys)
            for k in keys:
                if k in mine:
                    mine.remove(k)
        else:
            keys = list(set(held[sid]))
            ct.forget(sid, keys)
            held[sid] = []
        model = _model_masks(held)
        assert ct.holders() == model, sid
        for s in sids:
            assert ct.count(s) == len(set(held[s]))
            assert ct.extra.get(s, {}) == {k: held[s].count(k) - 1 for k in set(held[s]) if held[s].count(k) > 1}
        query = rng.choice(chains)
        allowed = rng.getrandbits(len(sids))
        assert ct.runs(query, allowed) == _model_runs([model.get(k, 0) for k in query], allowed)
        assert ct.masks(query) == [model.get(k, 0) for k in query]
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


# --- SourceMaps over a CompactTable: rows as values, positions per key --------------------------


@pytest.mark.parametrize("seed", range(6))
def test_sourcemaps_of_rows_match_models(seed: int) -> None:
    """What the engine index will do: per source a SourceMap of hash -> KeyTable row, holdings
    in one CompactTable. Stores (some re-storing present hashes, some under alias hashes of the
    same key: extra holdings, some with a wrong position: flagged, kept out of the map and
    released), removals and evictions release by the rows the maps give back. Against dict
    models after every batch: each map's (hash, key) in age order, every key's position (the
    first given while it lives) and row (unchanged while it lives), holder masks and counts."""
    rng = random.Random(seed)
    ct = CompactTable()
    slots = range(6)
    maps = {s: SourceMap() for s in slots}
    model: dict[int, OrderedDict[int, int]] = {s: OrderedDict() for s in slots}  # hash -> key
    held: dict[int, dict[int, int]] = {s: {} for s in slots}  # key -> holdings by the slot
    first_pos: dict[int, int] = {}  # live key -> its position
    first_row: dict[int, int] = {}  # live key -> its row
    chains = [[signed(rng.getrandbits(64)) for _ in range(rng.randrange(20, 200))] for _ in range(12)]
    flagged = 0

    def engine_hash(key: int, alias: int) -> int:
        return (mix(key) + alias) & M64

    def release(s: int, keys: list[int]) -> None:
        for k in keys:
            held[s][k] -= 1
            if not held[s][k]:
                del held[s][k]
                if not any(k in held[t] for t in slots):
                    del first_pos[k], first_row[k]

    for _ in range(220):
        s = rng.choice(list(slots))
        op = rng.random()
        if op < 0.5:  # a store: a stretch of a chain, positions (i + 1) * 16 (+16 when rogue)
            chain = rng.choice(chains)
            a = rng.randrange(len(chain))
            b = min(len(chain), a + rng.randrange(1, 64))
            keys = chain[a:b]
            rogue = rng.random() < 0.1
            pos = [(i + 1) * 16 + (16 if rogue else 0) for i in range(a, b)]
            alias = rng.choice([0, 0, 0, 1])
            hashes = [engine_hash(k, alias) for k in keys]
            rows, bad = ct.hold(s, keys, pos)
            for k, p, r, f in zip(keys, pos, rows.tolist(), bad.tolist()):
                held[s][k] = held[s].get(k, 0) + 1
                assert first_row.setdefault(k, r) == r
                assert f == (first_pos.setdefault(k, p) != p)
            flagged += int(bad.sum())
            ct.release_rows(s, rows[bad])  # the caller keeps them out (an overlay block in the index)
            release(s, [k for k, f in zip(keys, bad.tolist()) if f])
            ok = ~bad
            had, old = maps[s].insert_many(np.array(hashes, dtype=np.uint64)[ok], rows[ok])
            ct.release_rows(s, old[had])  # a re-stored hash: its previous holding goes
            for h, k, was in zip(
                [h for h, f in zip(hashes, bad.tolist()) if not f],
                [k for k, f in zip(keys, bad.tolist()) if not f],
                had.tolist(),
            ):
                assert was == (h in model[s])
                if was:
                    release(s, [model[s].pop(h)])
                model[s][h] = k
        elif op < 0.75:  # removals, some of hashes the source does not have
            present = list(model[s])
            hashes = rng.sample(present, min(len(present), rng.randrange(0, 40)))
            hashes += [rng.getrandbits(64) for _ in range(rng.randrange(0, 3))]
            found, rows = maps[s].remove_many(np.array(hashes, dtype=np.uint64))
            assert found.tolist() == [h in model[s] for h in hashes]
            assert ct.keys.keys[rows[found]].tolist() == [model[s][h] & M64 for h in hashes if h in model[s]]
            ct.release_rows(s, rows[found])
            release(s, [model[s].pop(h) for h in hashes if h in model[s]])
        else:  # eviction of the oldest
            n = rng.randrange(0, 80)
            hashes, rows = maps[s].oldest(n)
            expect = [model[s].popitem(last=False) for _ in range(min(n, len(model[s])))]
            assert hashes.tolist() == [h for h, _ in expect]
            ct.release_rows(s, rows)
            release(s, [k for _, k in expect])
        for t in slots:
            hashes, rows = maps[t].items()
            assert list(zip(hashes.tolist(), to_signed_list(ct.keys.keys[rows]))) == list(model[t].items())
            assert ct.keys.pos_of(rows).tolist() == [first_pos[k] for k in model[t].values()]
            assert ct.count(t) == len(held[t])
            assert ct.extra.get(t, {}) == {k: n - 1 for k, n in held[t].items() if n > 1}
        live = list(first_row)
        assert ct.keys.locate_many(live, insert=False).tolist() == [first_row[k] for k in live]
        assert ct.keys.pos_many(live).tolist() == [first_pos[k] for k in live]
        assert ct.holders() == {k: sum(1 << t for t in slots if k in held[t]) for k in live}
    assert flagged
    for t in slots:  # everything evicted: nothing left anywhere
        ct.release_rows(t, maps[t].oldest(len(maps[t]))[1])
    assert len(ct.keys) == 0 and not ct.counts and not ct.extra and len(ct.sets) == 1

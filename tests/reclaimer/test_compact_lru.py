"""kvcm.policies.compact_lru: the reclaimer's exact ``lru`` chooses the same victims as ``LRU``."""

from __future__ import annotations

import random

import msgpack
import pytest

from kvcm.policies import LRU
from kvcm.policies import compact_lru as compact_mod
from kvcm.policies.compact_lru import CompactLRU
from kvcm.reclaimer.state import GroupState, Limits, build_policy

M64 = (1 << 64) - 1
# instance parts above bit 64: the reclaimer's small indexes, and huge ones stored by code
HIGHS = [0, 1, 2, 7, (1 << 31) - 1, 1 << 31, (1 << 40) + 3, 1 << 90]


def _key(rng: random.Random, space: int, highs: list[int]) -> int:
    # few distinct low parts shared by several instances: same-low keys of other instances collide
    lo = rng.choice([rng.randrange(space), M64 - rng.randrange(space), rng.randrange(space) << 40])
    return (rng.choice(highs) << 64) | lo


def _split(k: int) -> list[int]:  # msgpack-sized parts, however large the key
    return [k >> 128, (k >> 64) & M64, k & M64]


def _join(raw: list[int]) -> int:
    return (int(raw[0]) << 128) | (int(raw[1]) << 64) | int(raw[2])


def _same(new: CompactLRU, ref: LRU, now: float) -> None:
    assert len(new) == len(ref) and new.size_total == ref.size_total
    assert list(new.sizes) == list(ref.sizes)
    assert list(new.sizes.items()) == list(ref.sizes.items())
    assert list(new.sizes.values()) == list(ref.sizes.values())
    assert new.victims(len(ref) + 3, now) == ref.victims(len(ref) + 3, now)


def _drive(new: CompactLRU, ref: LRU, rng: random.Random, steps: int, space: int, highs: list[int],
           now: float) -> float:
    for _ in range(steps):
        now += rng.random()
        op = rng.random()
        if op < 0.35:  # a write: new or a re-write (refreshed, size updated)
            key, size = _key(rng, space, highs), rng.randrange(0, 9000)
            ref.on_write(key, now, size)
            new.on_write(key, now, size)
        elif op < 0.5:
            key = _key(rng, space, highs)
            ref.on_access(key, now)
            new.on_access(key, now)
        elif op < 0.65:
            keys = [_key(rng, space, highs) for _ in range(rng.randrange(30))]
            if rng.random() < 0.5:  # the reclaimer's shape: filtered by sizes, a lazy iterator
                ref.access_many(filter(ref.sizes.__contains__, iter(keys)), now)
                new.access_many(filter(new.sizes.__contains__, iter(keys)), now)
            else:  # unknown keys in the batch too
                ref.access_many(keys, now)
                new.access_many(keys, now)
        elif op < 0.8:
            key = _key(rng, space, highs)
            if rng.random() < 0.5 and len(ref):
                key = rng.choice(ref.victims(len(ref), now))
            ref.on_remove(key)
            new.on_remove(key)
        elif op < 0.9:
            n = rng.randrange(-1, 12)
            assert new.victims(n, now) == ref.victims(n, now)
        elif op < 0.97:
            n = rng.randrange(6)
            assert new.evict(n, now) == ref.evict(n, now)
        else:  # the reclaimer's selection: in, [] and on_remove on the same key objects
            for key in new.victims(rng.randrange(8), now):
                assert key in new.sizes and new.sizes[key] == ref.sizes[key]
                new.on_remove(key)
                ref.on_remove(key)
        key = _key(rng, space, highs)
        assert (key in new.sizes) == (key in ref.sizes) == (key in new)
        assert new.sizes.get(key) == ref.sizes.get(key) and new.sizes.get(key, -5) == ref.sizes.get(key, -5)
        assert len(new) == len(ref) and new.size_total == ref.size_total
    return now


@pytest.mark.parametrize("seed", range(30))
def test_same_victims_as_lru_on_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    space = rng.choice([2, 20, 200, 2000])
    highs = rng.sample(HIGHS, rng.randrange(1, len(HIGHS) + 1))
    new, ref = CompactLRU(), LRU()
    now = 0.0
    for _ in range(6):
        now = _drive(new, ref, rng, 700, space, highs, now)
        new.check()
        _same(new, ref, now)


def test_many_keys_grow_compact_and_shrink_the_arrays() -> None:
    """Enough keys for rehashes, log compactions, the mostly-free rebuild and the empty reset."""
    rng = random.Random(7)
    new, ref = CompactLRU(), LRU()
    keys = [(rng.randrange(4) << 64) | rng.getrandbits(64) for _ in range(20_000)]
    for i, key in enumerate(keys):
        new.on_write(key, i, 4096)
        ref.on_write(key, i, 4096)
    for i in range(60_000):  # many more log records than live entries
        key = keys[rng.randrange(len(keys))]
        new.on_access(key, i)
        ref.on_access(key, i)
    assert len(new._log) <= 2 * len(new) + compact_mod._SLACK + 1
    new.check()
    _same(new, ref, 1.0)
    assert new.evict(19_000, 2.0) == ref.evict(19_000, 2.0)
    assert len(new._lo) < 8 * len(new) + 1  # shrunk: the arrays follow the live entries
    new.check()
    _same(new, ref, 2.0)
    assert new.evict(5000, 3.0) == ref.evict(5000, 3.0)
    assert len(new) == 0 and len(new._lo) == 0 and len(new._slots) == 8 and new.size_total == 0
    new.on_write(keys[0], 4.0, 1)
    assert new.victims(5, 4.0) == [keys[0]]
    new.check()


def test_wide_arrays_past_the_narrow_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``_NARROW_MAX`` live entries, entry numbers and log positions switch to 8 bytes."""
    monkeypatch.setattr(compact_mod, "_NARROW_MAX", 64)
    rng = random.Random(3)
    new, ref = CompactLRU(), LRU()
    assert new._slots.typecode == "i"
    for k in range(200):
        new.on_write(k * 7919, k, k)
        ref.on_write(k * 7919, k, k)
    now = _drive(new, ref, rng, 1000, 400, [0, 5, 1 << 70], 200.0)
    assert len(new) > 64 and new._slots.typecode == new._log.typecode == new._pos.typecode == "q"
    new.check()
    _same(new, ref, now)


@pytest.mark.parametrize("seed", range(10))
def test_dump_then_load_gives_the_same_victims_now_and_later(seed: int) -> None:
    rng = random.Random(seed)
    live, ref = CompactLRU(), LRU()
    now = _drive(live, ref, rng, 1500, 50, HIGHS, 0.0)
    assert live.dump(_split) == ref.dump(_split)  # LRU's format: snapshots load into either
    restored = CompactLRU()
    restored.on_write(12345, 0.0, 9)  # load replaces what was there
    state = live.dump(_split)
    state["clock"] = now
    restored.load(msgpack.unpackb(msgpack.packb(state)), key=_join)
    restored.check()
    assert restored.dump()["clock"] == now
    _same(restored, ref, now)
    from_lru = CompactLRU()
    from_lru.load(msgpack.unpackb(msgpack.packb(ref.dump(_split))), key=_join)
    _same(from_lru, ref, now)
    # both go on identically
    twin = LRU()
    twin.load(msgpack.unpackb(msgpack.packb(ref.dump(_split))), key=_join)
    now1 = _drive(live, ref, random.Random(seed + 100), 800, 50, HIGHS, now)
    _drive(restored, twin, random.Random(seed + 100), 800, 50, HIGHS, now)
    _same(restored, ref, now1)
    _same(live, ref, now1)


def test_keys_must_be_non_negative_ints() -> None:
    p = CompactLRU()
    with pytest.raises(ValueError, match="non-negative"):
        p.on_write(-1, 0.0, 1)
    with pytest.raises(TypeError, match="ints"):
        p.on_write("a", 0.0, 1)
    with pytest.raises(TypeError, match="ints"):
        p.on_write(("i", 1), 0.0, 1)
    p.on_write(True, 0.0, 3)  # a bool is the int 1, as in a dict
    assert 1 in p and p.sizes[1] == 3 and p.victims(2, 0.0) == [1] and type(p.victims(1, 0.0)[0]) is int
    for other in ("a", -1, -(1 << 70), 1.5, None, ("i", 1), 2, 1 << 64 | 1, 5 << 80 | 1):
        assert other not in p and other not in p.sizes and p.sizes.get(other) is None
        p.on_access(other, 1.0)
        p.on_remove(other)
    with pytest.raises(KeyError):
        p.sizes[2]
    assert len(p) == 1 and p.size_total == 3
    p.check()


def test_check_finds_broken_state() -> None:
    p = CompactLRU()
    for k in range(10):
        p.on_write(k, 0.0, 2)
    p.check()
    p.size_total += 1
    with pytest.raises(AssertionError):
        p.check()
    p.size_total -= 1
    p._pos[3] = -1  # an entry lost from the log
    with pytest.raises(AssertionError):
        p.check()


def test_iterating_sizes_while_it_changes_fails() -> None:
    p = CompactLRU()
    for k in range(5):
        p.on_write(k, 0.0, 1)
    with pytest.raises(RuntimeError, match="changed during iteration"):
        for k in p.sizes:
            p.on_access(4 - k, 1.0)


def test_the_reclaimer_uses_it_for_exact_lru_only() -> None:
    assert type(build_policy("lru")) is CompactLRU
    assert type(build_policy("lru", sample_size=16)) is LRU
    assert type(build_policy("lru", ttl_seconds=30)) is CompactLRU
    state = GroupState("g", Limits(policy="lru", ttl_seconds=30), 0)
    state.serve("a", -5, 100, "mem", None, 1.0)
    state.serve("b", -5, 200, "mem", None, 2.0)  # the same block key in another instance
    state.serve("a", 1 << 62, 300, "mem", -5, 3.0)
    state.read("a", [-5, 99], 4.0)
    policy = state.policies["mem"]
    assert type(policy) is CompactLRU
    assert [state.ikey(k) for k in policy.victims(5, 5.0)] == [("b", -5), ("a", 1 << 62), ("a", -5)]
    assert [state.ikey(k) for k in state.ttls["mem"].victims(5, 5.0)] == [("a", -5), ("b", -5), ("a", 1 << 62)]
    state.purge_instance("b")
    assert [state.ikey(k) for k in policy.victims(5, 5.0)] == [("a", 1 << 62), ("a", -5)]
    restored = GroupState("g", Limits(policy="lru", ttl_seconds=30), 0)
    restored.load(msgpack.unpackb(msgpack.packb(state.dump())))
    assert restored.policies["mem"].victims(5, 5.0) == policy.victims(5, 5.0)
    assert restored.policies["mem"].size_total == 400


def test_a_removed_key_written_again_reuses_its_slot() -> None:
    """Tombstones are reused: churn on the same keys does not fill the index (nor rehash it)."""
    p = CompactLRU()
    keys = [(1 << 64) | (k * 0x9E3779B97F4A7C15 & M64) for k in range(100)]
    for k in keys:
        p.on_write(k, 0.0, 1)
    used, slots = p._used, len(p._slots)
    for t in range(1, 200):
        for k in keys[:5]:
            p.on_remove(k)
            p.on_write(k, float(t), 2)
    assert p._used == used and len(p._slots) == slots
    assert p.victims(3, 300.0) == keys[5:8] and p.size_total == 100 + 5
    p.check()


def test_reclaim_compact_lru_off_keeps_the_ordered_dict_lru():
    from kvcm.config import ReclaimConfig
    from kvcm.reclaimer import Reclaimer
    from tests.reclaimer.test_reclaimer import FakeManager

    assert type(build_policy("lru", compact=False)) is LRU
    mgr = FakeManager(groups={"g": ["i"]})
    rec = Reclaimer(mgr, lambda: {"g": Limits(quota=1000)}, ReclaimConfig(compact_lru=False))
    rec.run_once(0.0)
    mgr.write("i", 1, now=1.0)
    rec.run_once(2.0)
    assert type(rec.tracked("g", "file")._policy) is LRU


def test_the_read_memo_stays_bounded_and_right():
    """Reads are answered from a memo of keys read lately; it never outgrows its bound, and a
    key removed (its entry reused by another key) is never refreshed through it."""
    from kvcm.policies.compact_lru import _MEMO

    p, ref = CompactLRU(), LRU()
    keys = list(range(_MEMO + 5000))
    for k in keys:
        p.on_write(k, 0.0, 1)
        ref.on_write(k, 0.0, 1)
    for policy in (p, ref):
        policy.access_many(iter(keys), 0.0)  # more distinct keys than the memo holds
    assert 0 < len(p._memo) <= _MEMO
    p.check()
    for policy in (p, ref):
        policy.on_remove(keys[-1])  # in the memo; its entry is reused by the next write
        policy.on_write(10**9, 0.0, 1)
        policy.access_many(iter([keys[-1], keys[0]]), 0.0)
    p.check()
    assert p.victims(10, 0.0) == ref.victims(10, 0.0)

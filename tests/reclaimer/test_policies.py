"""kvcm.policies: the shared contract, then each policy's characteristic behaviour."""

from __future__ import annotations

import random

import pytest

from kvcm.policies import (
    LFU,
    LRU,
    POLICIES,
    TTL,
    LeafLRU,
    Policy,
    RandomLRU,
    make_policy,
)

ALL = [
    ("lru", {}),
    ("lru", {"sample_size": 4}),
    ("lfu", {}),
    ("lfu", {"sample_size": 4}),
    ("lfu", {"half_life": 0}),
    ("ttl", {"ttl_seconds": 50}),
    ("leaf_lru", {}),
    ("leaf_lru", {"sample_size": 4}),
    ("random_lru", {"batch_size": 4, "sample_rate": 0.5}),
]
IDS = [f"{name}{opts or ''}" for name, opts in ALL]


# --- registry -----------------------------------------------------------------------------------


def test_registry_has_the_five_policies():
    assert set(POLICIES) == {"lru", "lfu", "ttl", "leaf_lru", "random_lru"}
    for name, cls in POLICIES.items():
        assert cls.name == name
        assert isinstance(make_policy(name), Policy)


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown eviction policy 'fifo'.*lru, lfu, ttl, leaf_lru"):
        make_policy("fifo")


def test_unknown_option_lists_valid_options():
    with pytest.raises(ValueError, match=r"no option ttl_seconds.*sample_size, seed"):
        make_policy("lru", ttl_seconds=3)


@pytest.mark.parametrize("name, opts", [("lru", {"sample_size": -1}), ("ttl", {"ttl_seconds": 0}),
                                        ("random_lru", {"batch_size": 0})])  # fmt: skip
def test_bad_option_values_fail(name, opts):
    with pytest.raises(ValueError):
        make_policy(name, **opts)


# --- the contract every policy keeps ------------------------------------------------------------


@pytest.mark.parametrize("name, opts", ALL, ids=IDS)
def test_contract_under_random_operations(name, opts):
    """Random writes/reads/removals/evictions: membership and sizes match a model, invariants hold."""
    rng = random.Random(7)
    policy = make_policy(name, **opts)
    model: dict[int, int] = {}
    now = 0.0
    for step in range(1500):
        now += rng.random()
        key = rng.randrange(60)
        op = rng.random()
        if op < 0.45:
            size = rng.randint(1, 3)
            parent = key - 1 if key % 5 else None
            policy.on_write(key, now, size, parent)
            model[key] = size
        elif op < 0.7:
            policy.on_access(key, now)
        elif op < 0.8:
            policy.on_remove(key)
            model.pop(key, None)
        else:
            chosen = policy.victims(rng.randint(1, 5), now)
            assert len(chosen) == len(set(chosen)) and set(chosen) <= set(model)
            assert len(policy) == len(model), "victims() removes nothing"
            for victim in chosen[:2]:
                policy.on_remove(victim)
                del model[victim]
        if step % 50 == 0:
            policy.check()
        assert len(policy) == len(model)
        assert policy.size_total == sum(model.values())
    policy.check()
    assert all(k in policy for k in model) and 999 not in policy


@pytest.mark.parametrize("name, opts", ALL, ids=IDS)
def test_remove_is_idempotent_and_unknown_keys_are_ignored(name, opts):
    policy = make_policy(name, **opts)
    policy.on_remove("never seen")
    policy.on_access("never seen", 1.0)
    policy.on_write(("inst", 1), 1.0, size=5)  # reclaimer-style tuple keys
    policy.on_remove(("inst", 1))
    policy.on_remove(("inst", 1))
    assert len(policy) == 0 and policy.size_total == 0
    assert policy.victims(3, 2.0) == [] and policy.expired(1e9) == []
    policy.check()


@pytest.mark.parametrize("name, opts", ALL, ids=IDS)
def test_rewrite_updates_size(name, opts):
    policy = make_policy(name, **opts)
    policy.on_write("a", 1.0, size=3)
    policy.on_write("a", 2.0, size=7)
    assert policy.size_total == 7 and len(policy) == 1
    policy.check()


@pytest.mark.parametrize("name, opts", ALL, ids=IDS)
def test_evict_removes_what_it_returns(name, opts):
    policy = make_policy(name, **opts)
    for i in range(20):
        policy.on_write(i, float(i))
    gone = policy.evict(5, 30.0)
    assert 1 <= len(gone) <= 5
    assert all(k not in policy for k in gone) and len(policy) == 20 - len(gone)
    policy.check()


# --- lru ----------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_and_reads_refresh():
    lru = LRU()
    for k in "abcd":
        lru.on_write(k, 0.0)
    lru.on_access("a", 1.0)
    assert lru.victims(4, 2.0) == ["b", "c", "d", "a"]
    lru.on_write("b", 3.0)  # a re-write refreshes too
    assert lru.victims(2, 3.0) == ["c", "d"]


def test_lru_touch_chain_accesses_known_and_writes_new_in_order():
    lru = LRU()
    lru.on_write("x", 0.0)
    lru.on_write("b", 0.0)
    assert lru.touch_chain(["a", "b", "c"], 1.0) == ["a", "c"]
    assert lru.victims(4, 1.0) == ["x", "a", "b", "c"]
    assert lru.size_total == 4


def test_sampled_lru_victims_come_from_the_oldest():
    """Each victim is the oldest of 16 draws: with 1000 keys, it is in the oldest 30% with
    probability 1 - 0.7**16 > 99.6%; over 100 victims, at most a handful may miss."""
    lru = LRU(sample_size=16, seed=3)
    for i in range(1000):
        lru.on_write(i, float(i))
    chosen = lru.victims(100, 1000.0)
    assert len(set(chosen)) == 100
    assert sum(1 for k in chosen if k >= 300) <= 3
    assert LRU(sample_size=16, seed=3).victims(1, 0.0) == []


def test_sampled_lru_is_deterministic_for_a_seed():
    def run(seed):
        lru = LRU(sample_size=8, seed=seed)
        for i in range(500):
            lru.on_write(i, float(i))
        return lru.victims(20, 0.0)

    assert run(1) == run(1)
    assert run(1) != run(2)


# --- lfu ----------------------------------------------------------------------------------------


def test_lfu_keeps_the_frequent_block():
    lfu = LFU(half_life=1e9)
    for k in "abc":
        lfu.on_write(k, 0.0)
    for _ in range(3):
        lfu.on_access("a", 1.0)
    lfu.on_access("c", 2.0)
    assert lfu.victims(3, 3.0) == ["b", "c", "a"]


def test_lfu_ties_go_to_the_least_recent():
    lfu = LFU(half_life=0)
    for i, k in enumerate("abc"):
        lfu.on_write(k, float(i))
    lfu.on_access("c", 4.0)
    lfu.on_access("a", 5.0)
    lfu.on_access("b", 6.0)
    assert lfu.victims(3, 7.0) == ["c", "a", "b"]


def test_lfu_counts_halve_every_half_life():
    lfu = LFU(half_life=10.0)
    lfu.on_write("a", 0.0)
    for _ in range(3):
        lfu.on_access("a", 0.0)
    assert lfu.count("a", 0.0) == pytest.approx(4.0)
    assert lfu.count("a", 10.0) == pytest.approx(2.0)
    assert lfu.count("a", 30.0) == pytest.approx(0.5)
    assert lfu.count("zz", 0.0) == 0.0


def test_lfu_ageing_lets_old_popularity_decay():
    """A block used 8 times long ago loses to one used twice recently; without ageing it wins."""
    for half_life, first in ((10.0, "old"), (0.0, "new")):
        lfu = LFU(half_life=half_life)
        lfu.on_write("old", 0.0)
        for _ in range(7):
            lfu.on_access("old", 0.0)
        lfu.on_write("new", 100.0)
        lfu.on_access("new", 100.0)
        assert lfu.victims(1, 100.0) == [first]


# --- ttl ----------------------------------------------------------------------------------------


def test_ttl_expires_by_write_time_and_reads_do_not_extend():
    ttl = TTL(ttl_seconds=10)
    ttl.on_write("a", 0.0)
    ttl.on_write("b", 5.0)
    ttl.on_access("a", 9.0)
    assert ttl.expired(9.9) == []
    assert ttl.expired(10.0) == ["a"]
    assert ttl.expired(15.0) == ["a", "b"]
    ttl.on_write("a", 12.0)  # a re-write restarts the clock
    assert ttl.expired(16.0) == ["b"]


def test_ttl_victims_are_oldest_written_first():
    ttl = TTL(ttl_seconds=100)
    for i, k in enumerate("abc"):
        ttl.on_write(k, float(i))
    ttl.on_access("a", 5.0)
    assert ttl.victims(2, 5.0) == ["a", "b"]


def test_ttl_clamps_a_clock_going_backwards():
    ttl = TTL(ttl_seconds=10)
    ttl.on_write("a", 100.0)
    ttl.on_write("b", 50.0)  # treated as written at 100
    assert ttl.expired(105.0) == []
    assert ttl.expired(110.0) == ["a", "b"]
    ttl.check()


# --- leaf_lru -----------------------------------------------------------------------------------


def _chain(policy, keys, now, parent=None):
    for k in keys:
        policy.on_write(k, now, 1, parent)
        parent = k


def test_leaf_lru_never_evicts_a_parent_while_a_child_remains():
    leaf = LeafLRU()
    _chain(leaf, ["p0", "p1", "p2"], 0.0)  # p0 is the oldest, but it has a child
    assert leaf.victims(3, 1.0) == ["p2"]
    assert leaf.evict(3, 1.0) == ["p2", "p1", "p0"]  # suffix before prefix


def test_leaf_lru_orders_leaves_by_recency_and_exposes_freed_parents():
    leaf = LeafLRU()
    _chain(leaf, ["root", "a1", "a2"], 0.0)
    leaf.on_write("b1", 1.0, 1, "root")
    leaf.on_access("a2", 2.0)
    assert leaf.victims(5, 3.0) == ["b1", "a2"]
    leaf.on_access("root", 4.0)
    assert leaf.evict(2, 5.0) == ["b1", "a2"]
    # a1 became a leaf; it competes with its own last use, older than root's
    assert leaf.is_leaf("a1") and not leaf.is_leaf("root")
    assert leaf.evict(2, 5.0) == ["a1", "root"]


def test_leaf_lru_accepts_a_child_before_its_parent():
    leaf = LeafLRU()
    leaf.on_write("child", 0.0, 1, "parent")
    leaf.on_write("parent", 1.0)
    assert leaf.victims(2, 2.0) == ["child"]
    leaf.check()
    leaf.on_remove("child")
    assert leaf.victims(2, 2.0) == ["parent"]


def test_leaf_lru_vs_lru_on_a_shared_prefix():
    """A shared prompt touched before its suffixes is LRU's first victim, never leaf_lru's."""
    lru, leaf = LRU(), LeafLRU()
    for policy in (lru, leaf):
        policy.touch_chain(["sys", "q1"], 0.0)
        policy.touch_chain(["sys", "q2"], 1.0)
    assert lru.victims(1, 2.0) == ["q1"]
    lru.on_access("q1", 2.0)
    assert lru.victims(1, 2.0) == ["sys"]
    leaf.on_access("q1", 2.0)
    assert leaf.victims(3, 2.0) == ["q2", "q1"]


# --- random_lru ---------------------------------------------------------------------------------


def _xorshift_indices(count: int, n: int) -> list[int]:
    x, out, m = 0x12345678ABCDEF01, [], (1 << 64) - 1
    for _ in range(count):
        x ^= (x << 13) & m
        x ^= x >> 7
        x ^= (x << 17) & m
        out.append(x % n)
    return out


def test_random_lru_reproduces_tair_draws():
    policy = RandomLRU(batch_size=2, sample_rate=0.5)  # sampling size 4
    assert policy.sampling_size == 4
    for i in range(10):
        policy.on_write(f"k{i}", float(10 - i))  # k9 is the oldest
    draws = _xorshift_indices(4, 10)
    expected = sorted(draws, key=lambda i: 10 - i)[:2]
    assert policy.victims(2, 0.0) == [f"k{i}" for i in dict.fromkeys(expected)]


def test_random_lru_may_return_fewer_than_asked_like_tair():
    policy = RandomLRU(batch_size=1, sample_rate=0.1)  # 10 draws with replacement
    for k in "ab":
        policy.on_write(k, 0.0)
    # two keys, ten draws with replacement: the two oldest draws are often the same key
    sizes = {len(policy.victims(2, 0.0)) for _ in range(20)}
    assert sizes <= {1, 2} and 1 in sizes


def test_random_lru_default_sampling_is_1000():
    assert RandomLRU().sampling_size == 1000
    assert RandomLRU(sample_rate=0).sampling_size == 1000  # <= 0 means 0.1


def test_lru_access_many_ignores_unknown_keys():
    from kvcm.policies import make_policy

    policy = make_policy("lru")
    for key in (1, 2, 3):
        policy.on_write(key, now=float(key))
    policy.access_many(iter([1, 99, 2]), now=10.0)  # 99 was never written
    assert policy.victims(3, now=11.0) == [3, 1, 2]


# -- dump / load: the reclaimer persists policy state across restarts ----------------------------

_DUMPED = [("lru", {}), ("lru", {"sample_size": 4}), ("lfu", {}), ("lfu", {"sample_size": 4}),
           ("ttl", {"ttl_seconds": 30.0}), ("leaf_lru", {}), ("leaf_lru", {"sample_size": 4}),
           ("random_lru", {"batch_size": 4, "sample_rate": 0.5})]


def _drive(policy: object, rng: random.Random, steps: int, t: float) -> float:
    for _ in range(steps):
        t += rng.random()
        op, key = rng.random(), ("i", rng.randrange(60))
        if op < 0.45:
            parent = ("i", key[1] - 1) if key[1] % 4 else None
            policy.on_write(key, t, rng.choice([1, 2, 3]), parent)  # type: ignore[attr-defined]
        elif op < 0.85:
            policy.access_many([key, ("i", rng.randrange(60))], t)  # type: ignore[attr-defined]
        elif op < 0.95:
            policy.on_remove(key)  # type: ignore[attr-defined]
        else:
            policy.evict(2, t)  # type: ignore[attr-defined]
    return t


@pytest.mark.parametrize(("name", "opts"), _DUMPED, ids=[f"{n}-{o}" for n, o in _DUMPED])
def test_dump_then_load_gives_the_same_victims_now_and_later(name: str, opts: dict) -> None:
    import msgpack

    for seed in range(20):
        rng = random.Random(seed)
        live = make_policy(name, **opts)
        t = _drive(live, rng, 300, 0.0)
        restored = make_policy(name, **opts)
        restored.load(msgpack.unpackb(msgpack.packb(live.dump())), key=tuple)
        restored.check()
        assert restored.victims(50, t) == live.victims(50, t)
        assert restored.expired(t + 20) == live.expired(t + 20)
        # both go on identically (random draws included)
        t1 = _drive(live, random.Random(seed + 100), 200, t)
        _drive(restored, random.Random(seed + 100), 200, t)
        assert restored.victims(50, t1) == live.victims(50, t1)
        assert len(restored) == len(live) and restored.size_total == live.size_total

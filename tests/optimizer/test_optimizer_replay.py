"""Replay: the pinned Mooncake figure, exact LRU, monotonicity, and each feature's behaviour."""

from __future__ import annotations

import gzip
import json
from collections import OrderedDict

import pytest

from kvcm.optimizer.cli import SAMPLES_DIR
from kvcm.optimizer.replay import Replayer, replay
from kvcm.optimizer.spec import (
    Capacity,
    GroupSpec,
    InstanceSpec,
    ReplaySpec,
    SpecError,
    TierSpec,
)
from kvcm.optimizer.sweep import capacity_points
from kvcm.optimizer.trace import Record
from kvcm.optimizer.trace_readers import read_trace

# The sample kvcm ships (Mooncake's synthetic trace, Apache-2.0, Mooncake FAST'25), so the pinned
# figures never depend on a directory outside the repo.
MOONCAKE = SAMPLES_DIR / "mooncake.jsonl.gz"


def one_group(capacity=None, policy="lru", unit="blocks", **replay_opts) -> ReplaySpec:
    cap = None if capacity is None else Capacity(capacity, unit)
    return ReplaySpec(groups=(GroupSpec(tiers=(TierSpec(capacity=cap, policy=policy),)),), **replay_opts)


def turns(*paths, instance="i", t0=0.0):
    return [Record(t0 + i, instance, "turn", list(p)) for i, p in enumerate(paths)]


# --- the shipped Mooncake trace -----------------------------------------------------------------


@pytest.fixture(scope="module")
def mooncake():
    trace = read_trace(MOONCAKE, "mooncake")
    records = list(trace)
    raw = [json.loads(line) for line in gzip.decompress(MOONCAKE.read_bytes()).decode().splitlines() if line.strip()]
    return records, raw


def lru_simulator(raw, capacity):
    """A minimal independent LRU: keys are the tuples of hash ids up to each block; a request's
    hits are its leading cached blocks; then all its blocks are touched in order; then the
    least recently used go until ``capacity`` remain. Returns (hit blocks, hit tokens)."""
    cache: OrderedDict = OrderedDict()
    hit_blocks = hit_tokens = 0
    for req in raw:
        ids = req["hash_ids"]
        keys = [tuple(ids[: i + 1]) for i in range(len(ids))]
        hits = 0
        while hits < len(keys) and keys[hits] in cache:
            hits += 1
        hit_blocks += hits
        hit_tokens += min(hits * 512, req["input_length"])
        for key in keys:
            cache[key] = True
            cache.move_to_end(key)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hit_blocks, hit_tokens


def test_unbounded_replay_reports_the_mooncake_prefix_hit_ratio(mooncake):
    records, raw = mooncake
    total = replay(records, block_size_of=512).total
    # the same figure, computed here from the raw file in a few lines
    seen, hit, inputs = set(), 0, 0
    for req in raw:
        prefixes = [tuple(req["hash_ids"][: i + 1]) for i in range(len(req["hash_ids"]))]
        n = next((i for i, p in enumerate(prefixes) if p not in seen), len(prefixes))
        hit += min(n * 512, req["input_length"])
        inputs += req["input_length"]
        seen.update(prefixes)
    assert total.hit_tokens == hit and total.read_tokens == inputs
    assert round(total.token_hit_rate, 3) == 0.651  # Mooncake paper, Table 2: "66%"
    assert total.token_hit_rate == pytest.approx(0.65124, abs=1e-5)
    assert (total.hit_blocks, total.read_blocks) == (77953, 121877)
    assert total.reads == 3993 and total.internal_hit_blocks == 0


@pytest.mark.parametrize("capacity", [1, 500, 7000, 30000])
def test_lru_replay_equals_an_independent_lru_simulator(mooncake, capacity):
    records, raw = mooncake
    total = replay(records, one_group(capacity), block_size_of=512).total
    assert (total.hit_blocks, total.hit_tokens) == lru_simulator(raw, capacity)


def test_lru_hit_rate_is_monotone_in_capacity(mooncake):
    records, _ = mooncake
    rates = []
    for capacity in capacity_points(43924, 12, low=50):
        stats = replay(records, one_group(capacity, timeline=False), block_size_of=512).total
        rates.append((stats.hit_blocks, stats.hit_tokens))
    assert rates == sorted(rates) and rates[0] < rates[-1]
    assert rates[-1] == (77953, 39852661)  # at the working set, nothing useful is evicted


# --- lookups, masks and ops ---------------------------------------------------------------------


def test_masks_count_internal_hits_and_skip_the_lookup():
    records = [
        *turns([1, 2, 3, 4]),
        Record(5, "i", "read", [1, 2, 3, 4], mask=2),
        Record(6, "i", "read", [9, 9 + 1, 3, 4], mask=2),  # masked blocks need not be cached
        Record(7, "i", "read", [1, 2, 3, 4], mask=[False, True, True, False]),
        Record(8, "i", "read", [1, 2], mask=9),
    ]
    s = replay(records, block_size_of=4).instances["i"]
    assert (s.reads, s.read_blocks) == (5, 18)
    assert s.internal_hit_blocks == 2 + 2 + 2 + 2
    assert s.external_hit_blocks == 0 + 2 + 2 + 2 + 0


def test_token_hits_cap_at_the_prompt_length():
    records = [Record(0, "i", "turn", [1, 2], tokens=20), Record(1, "i", "turn", [1, 2], tokens=20)]
    s = replay(records, block_size_of=16).instances["i"]
    assert (s.read_tokens, s.hit_tokens, s.hit_blocks) == (40, 20, 2)
    assert s.token_hit_rate == 0.5 and s.block_hit_rate == 0.5


def test_reads_refresh_and_writes_store():
    records = [
        Record(0, "i", "write", [1, 2]),
        Record(1, "i", "write", [5]),
        Record(2, "i", "read", [1, 2]),  # 1, 2 become more recent than 5
        Record(3, "i", "write", [7]),  # capacity 3: 5 goes
        Record(4, "i", "read", [5]),
        Record(5, "i", "read", [1, 2, 7]),
    ]
    s = replay(records, one_group(3), block_size_of=1).instances["i"]
    assert s.external_hit_blocks == 2 + 0 + 3 and s.evicted_blocks == 1 and s.written_blocks == 4


def test_remove_and_clear_records():
    records = [*turns([1, 2, 3], [4]), Record(3, "i", "remove", [2, 99]), Record(4, "i", "read", [1, 2, 3]), Record(5, "i", "clear"), Record(6, "i", "read", [4])]
    result = replay(records, block_size_of=1)
    s = result.instances["i"]
    assert s.external_hit_blocks == 1 and s.removed_blocks == 1 + 3 and s.evicted_blocks == 0
    assert result.groups[0].tiers[0]["blocks"] == 0


def test_a_turn_touches_blocks_after_the_first_miss():
    """After a miss the engine recomputes and rewrites the rest; cached ones count as used."""
    records = turns([1, 2, 3], [9, 2], [1, 7], [1, 2, 3])
    s = replay(records, one_group(4), block_size_of=1).instances["i"]
    # [9, 2] refreshed 2 (not a hit), so 3 was the one evicted, not 2
    assert s.external_hit_blocks == 0 + 0 + 1 + 2


# --- instances and groups -----------------------------------------------------------------------


def test_instances_of_a_group_share_capacity_but_not_keys():
    spec = ReplaySpec(groups=(GroupSpec("g", (TierSpec(capacity=Capacity(4)),),
                                        (InstanceSpec("a"), InstanceSpec("b", block_size=8))),))  # fmt: skip
    records = [
        Record(0, "a", "turn", [1, 2]),
        Record(1, "b", "turn", [1, 2]),  # same keys, other instance: no hit
        Record(2, "a", "turn", [1, 2, 3]),  # group full: b's are older -> b loses one
        Record(3, "b", "turn", [1, 2]),
    ]
    result = replay(records, spec, block_size_of=16)
    a, b = result.instances["a"], result.instances["b"]
    assert (a.external_hit_blocks, b.external_hit_blocks) == (2, 0)
    assert b.evicted_blocks >= 1 and result.block_sizes == {"a": 16, "b": 8}
    assert result.groups[0].instances == ["a", "b"] and result.groups[0].tiers[0]["blocks"] <= 4


def test_unlisted_instances_go_to_default_or_are_dropped():
    listed = GroupSpec("g", instances=(InstanceSpec("a"),))
    records = turns([1], instance="a") + turns([1], instance="zz")
    dropped = replay(records, ReplaySpec(groups=(listed,)), block_size_of=1)
    assert dropped.dropped_records == 1 and set(dropped.instances) == {"a"}
    kept = replay(records, ReplaySpec(groups=(listed, GroupSpec("default"))), block_size_of=1)
    assert kept.dropped_records == 0 and set(kept.instances) == {"a", "zz"}


def test_byte_capacity_counts_each_instances_block_bytes():
    group = GroupSpec("g", (TierSpec(capacity=Capacity(1000, "bytes")),),
                      (InstanceSpec("big", block_bytes=300), InstanceSpec("small", block_bytes=100)))  # fmt: skip
    records = [Record(0, "big", "turn", [1, 2, 3]), Record(1, "small", "turn", [1, 2])]
    result = replay(records, ReplaySpec(groups=(group,)), block_size_of=1)
    tier = result.groups[0].tiers[0]
    assert tier["usage"] == 300 * 2 + 100 * 2 and result.instances["big"].evicted_blocks == 1
    with pytest.raises(SpecError, match="block_bytes"):
        ReplaySpec(groups=(GroupSpec(tiers=(TierSpec(capacity=Capacity(10, "bytes")),)),)).validate()


def test_watermark_and_batched_eviction():
    records = turns(*[[k] for k in range(1, 31)])
    exact = replay(records, one_group(10, watermark=0.8), block_size_of=1)
    assert exact.groups[0].tiers[0]["blocks"] == 8
    batched = replay(records, one_group(10, mode="batched", batch_size=4), block_size_of=1)
    # over 10 -> evict a whole batch of 4 (down to 7), refill to 10, ...
    assert batched.groups[0].tiers[0]["blocks"] == 10
    assert batched.instances["i"].evicted_blocks == 20


# --- tiers --------------------------------------------------------------------------------------


def _tiers(c0, c1, promote, policy="lru"):
    tiers = (TierSpec("fast", Capacity(c0), policy), TierSpec("slow", Capacity(c1), policy))
    return ReplaySpec(groups=(GroupSpec(tiers=tiers),), promote=promote)


def _random_turns(n, seed=5):
    import random

    rng, out = random.Random(seed), []
    for i in range(n):
        ids = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        out.append(Record(float(i), "i", "turn", [hash(tuple(ids[: j + 1])) for j in range(len(ids))]))
    return out


def test_two_lru_tiers_with_promotion_equal_one_lru_of_their_sum():
    records = _random_turns(400)
    tiered = replay(records, _tiers(5, 20, promote=True), block_size_of=1).instances["i"]
    flat = replay(records, one_group(25), block_size_of=1).instances["i"]
    assert tiered.hit_blocks == flat.hit_blocks
    assert tiered.tier_hit_blocks[0] > 0 and tiered.tier_hit_blocks[1] > 0
    assert sum(tiered.tier_hit_blocks) == tiered.external_hit_blocks


def test_slow_tier_catches_what_the_fast_tier_evicts():
    records = _random_turns(400)
    alone = replay(records, one_group(5), block_size_of=1).instances["i"]
    tiered = replay(records, _tiers(5, 20, promote=False), block_size_of=1)
    s = tiered.instances["i"]
    assert s.hit_blocks > alone.hit_blocks and s.tier_hit_blocks[1] > 0
    fast, slow = tiered.groups[0].tiers
    assert fast["blocks"] <= 5 and slow["blocks"] <= 20
    assert s.written_blocks - s.evicted_blocks == fast["blocks"] + slow["blocks"]


def test_leaf_lru_tiers_demote_with_parents():
    records = _random_turns(300)
    result = replay(records, _tiers(4, 10, promote=True, policy="leaf_lru"), block_size_of=1)
    assert result.instances["i"].hit_blocks > 0


# --- policies in replay -------------------------------------------------------------------------


def test_leaf_lru_keeps_a_shared_prefix_that_lru_loses():
    records = turns([1, 2], [1, 3, 4, 5, 6], [1, 7])
    lru = replay(records, one_group(4), block_size_of=1).instances["i"]
    leaf = replay(records, one_group(4, policy="leaf_lru"), block_size_of=1).instances["i"]
    # the long second request leaves 1 and 2 as the oldest: LRU drops the shared prefix 1,
    # leaf_lru drops the leaves 2 and 6 instead
    assert lru.external_hit_blocks == 1 + 0
    assert leaf.external_hit_blocks == 1 + 1


def test_ttl_expires_blocks_before_a_lookup():
    spec = ReplaySpec(groups=(GroupSpec(tiers=(TierSpec(policy="ttl", policy_options={"ttl_seconds": 10}),)),))
    records = [Record(0, "i", "turn", [1, 2]), Record(5, "i", "turn", [1, 2]), Record(12, "i", "turn", [1, 2])]
    s = replay(records, spec, block_size_of=1).instances["i"]
    assert s.external_hit_blocks == 2 and s.evicted_blocks == 2


def test_every_policy_replays_and_random_lru_is_deterministic():
    records = _random_turns(200)
    for policy in ("lru", "lfu", "ttl", "leaf_lru", "random_lru"):
        first = replay(records, one_group(8, policy), block_size_of=1).total
        again = replay(records, one_group(8, policy), block_size_of=1).total
        assert first == again and 0 < first.hit_blocks < first.read_blocks


# --- trees --------------------------------------------------------------------------------------


def test_radix_trees_follow_the_replay():
    records = _random_turns(300)
    removed = records[-1].keys[0]
    records.append(Record(400, "i", "remove", [removed]))
    plain = replay(records, one_group(12), block_size_of=1)
    with_trees = replay(records, one_group(12, trees=True), block_size_of=1)  # the general path
    assert with_trees.total == plain.total and with_trees.timelines == plain.timelines
    tree = with_trees.trees["i"]
    tree.check()
    assert len(tree) == with_trees.groups[0].tiers[0]["blocks"] and removed not in tree
    assert tree.total_blocks >= len(tree)


def test_timeline_has_one_row_per_lookup():
    result = replay(turns([1, 2], [1, 2, 3], [1]), one_group(2), block_size_of=1)
    rows = result.timelines["i"]
    # the second turn pushed 1 out (touched first), so the third misses
    assert len(rows) == 3 and [r[4:6] for r in rows] == [(0, 0), (0, 2), (0, 0)]
    assert rows[1][1] == rows[1][2] == 2  # cached after the record (capacity 2)


def test_replayer_streams_records_one_by_one():
    replayer = Replayer(one_group(), lambda _i: 4)
    for record in turns([1], [1]):
        replayer.feed(record)
    result = replayer.result()
    assert result.records == 2 and result.total.hit_blocks == 1 and result.duration == 1.0

"""The reclaimer on a real cache manager, against a naive model of its victim order.

hypothesis generates streams of prompts sharing a two-block "system prompt" prefix: writes of
new chains, several prefix lookups (read hits) per tick on overlapping prefixes, removals,
clock steps and ticks (and restarts, in their own tests). They run against an in-process
:class:`~kvcm.node.app.App` (LMDB in a temp dir; the dispatcher called directly, no socket, no
background thread: the test runs the deleter and ``reclaimer.run_once(now)`` itself, at the
times of an injected clock). A naive :class:`Model` applies every event one at a time, in
order, and at every tick the reclaimer's ``Round.victims`` must equal the model's: same keys,
same order, same reason. After a victim is chosen, both sides forget it.

The model does not reuse any of ``kvcm.policies``: per block it keeps the write time, the
parent, every use time (``lfu``) and the event number of the last use (``lru``, ``leaf_lru``),
and sorts the blocks each time it is asked.

In-line eviction is off here (``reclaim.inline = false``): a write past the hard quota is
refused, so every eviction is a round's and the model compares all of them; in-line eviction
has its own tests (``test_inline_eviction.py``, ``test_capacity_scenario.py``).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvcm.errors import CapacityError
from kvcm.node.app import App
from kvcm.proto import wire
from kvcm.reclaimer import Round
from kvcm.testing import make_test_config

GROUP, INSTANCE, STYPE = "model", "inst", "file"
BLOCK = 1024  # bytes per block: one location spec
QUOTA_BLOCKS = 8  # the hard quota: a write past it is refused
WATERMARK = 0.75  # reclaim when 6 blocks or more are serving ...
HYSTERESIS = 0.25  # ... down to 4
HIGH, LOW = 6 * BLOCK, 4 * BLOCK
TTL_S = 8
LFU_HALF_LIFE = 600.0  # kvcm.policies.LFU's default; the reclaimer passes no other
# The App's reclaimer stamps the due time of what it evicts with the wall clock (its own clock,
# taken when the App is built, before the test can inject one). A test clock far past the wall
# clock makes every such delete due at once, so the deleter frees it when the test runs it.
CLOCK_BASE = 4.0e9

# The prompt tree: block key -> parent. Every prompt but the last two starts with the system
# prompt (1, 2); a prompt is the path from a root to any node, so prompts share prefixes.
TREE: dict[int, int | None] = {
    1: None, 2: 1,
    10: 2, 11: 10, 12: 11,
    20: 2, 21: 20,
    30: 2, 31: 30, 32: 31,
    40: 2,
    50: None, 51: 50,
}
KEYS = sorted(TREE)


def path(key: int) -> list[int]:
    out = [key]
    while (parent := TREE[out[-1]]) is not None:
        out.append(parent)
    return out[::-1]


PROMPTS = [path(k) for k in KEYS]
WHOLE = [p for p in PROMPTS if p[-1] not in TREE.values()]  # root to leaf


# -- the naive model ----------------------------------------------------------------------------


@dataclass
class Block:
    written: float
    parent: int | None
    uses: list[float]  # the write, then every read hit (lfu)
    last: int  # event number of the latest write or read hit (lru, leaf_lru)


@dataclass
class Model:
    """One group, one instance, one storage type: the serving blocks and what the reclaimer
    should evict at a tick."""

    policy: str
    ttl: int = 0
    blocks: dict[int, Block] = field(default_factory=dict)  # serving, in write order
    deleting: set[int] = field(default_factory=set)  # removed or evicted, until the deleter runs
    events: int = 0

    def serve(self, key: int, parent: int | None, now: float) -> None:
        assert key not in self.blocks, key  # the manager only writes keys it does not serve
        self.events += 1
        self.blocks[key] = Block(now, parent, [now], self.events)

    def read(self, keys: list[int], now: float) -> None:
        for key in keys:
            block = self.blocks[key]  # a hit is a serving block
            self.events += 1
            block.uses.append(now)
            block.last = self.events

    def remove(self, keys: list[int]) -> None:
        for key in keys:
            if self.blocks.pop(key, None) is not None:
                self.deleting.add(key)

    def written(self, prompt: list[int]) -> list[int]:
        """What a write of ``prompt`` adds: a ``deleting`` copy still counts as present."""
        return [k for k in dict.fromkeys(prompt) if k not in self.blocks and k not in self.deleting]

    def hits(self, prompt: list[int]) -> list[int]:
        """What ``prefix_match`` finds: the prompt up to its first block not serving."""
        out: list[int] = []
        for key in prompt:
            if key not in self.blocks:
                break
            out.append(key)
        return out

    # victim order

    def _lfu_rank(self, key: int) -> tuple[float, int]:
        block = self.blocks[key]
        count = sum(2.0 ** ((t - CLOCK_BASE) / LFU_HALF_LIFE) for t in block.uses)
        return count, block.last  # ties: the least recently used

    def best(self) -> int | None:
        """The next victim under pressure."""
        if not self.blocks:
            return None
        if self.policy == "lru":
            return min(self.blocks, key=lambda k: self.blocks[k].last)
        if self.policy == "lfu":
            return min(self.blocks, key=self._lfu_rank)
        if self.policy == "ttl":
            return next(iter(self.blocks))  # the oldest written; reads do not count
        if self.policy == "leaf_lru":
            parents = {b.parent for b in self.blocks.values()}
            leaves = [k for k in self.blocks if k not in parents]
            return min(leaves, key=lambda k: self.blocks[k].last)
        raise AssertionError(self.policy)

    def victims(self, now: float) -> list[tuple[int, str]]:
        """One round: blocks past their TTL (oldest written first), then, when usage is at the
        high mark, the policy's best until usage is at the low mark.

        Usage is what the manager counts at the start of the round (the deleter has just freed
        everything due: nothing is on its way out), minus this round's TTL sweep."""
        used = BLOCK * len(self.blocks)
        out: list[tuple[int, str]] = []
        self.deleting.clear()  # the deleter ran just before the round
        if self.ttl:
            for key in [k for k, b in self.blocks.items() if b.written <= now - self.ttl]:
                del self.blocks[key]
                out.append((key, "ttl"))
        used -= BLOCK * len(out)
        if used >= HIGH:
            for _ in range(math.ceil((used - LOW) / BLOCK)):
                key = self.best()
                if key is None:
                    break
                del self.blocks[key]
                out.append((key, "watermark"))
        self.deleting.update(k for k, _ in out)
        return out

    def restarted(self) -> None:
        """A clean restart changes nothing the model knows: recency, counts and parents survive."""


# -- the real thing -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = CLOCK_BASE

    def __call__(self) -> float:
        return self.now


class Node:
    """An in-process kvcm on a temp data dir with group ``GROUP`` and instance ``INSTANCE``."""

    def __init__(self, data_dir: str, policy: str, ttl: int = 0) -> None:
        self.dir = data_dir
        self.clock = Clock()
        self.app = self._open()
        self.add_group(GROUP, INSTANCE, policy, ttl)

    def add_group(self, group: str, instance: str, policy: str, ttl: int = 0) -> None:
        self.call("create_instance_group", {"instance_group": {
            "name": group, "storage_candidates": ["default-file"], "quota": {"capacity": QUOTA_BLOCKS * BLOCK},
            "reclaim_strategy": {"reclaim_policy": policy, "used_percentage": WATERMARK,
                                 "delay_before_delete_ms": 0, "ttl_seconds": ttl}}})
        self.call("register_instance", {"instance_group": group, "instance_id": instance, "block_size": 4,
                                        "location_spec_infos": [{"name": "tp0", "size": BLOCK}],
                                        "model_deployment": {"model_name": "m", "dtype": "fp16"}})

    def _open(self) -> App:
        config = make_test_config(os.path.join(self.dir, "data"), f"ipc://{self.dir}/rpc", {
            "http": {"enabled": False}, "events": {"enabled": False}, "store": {"sync": False, "map_size": 4 << 20},
            "reclaim": {"hysteresis": HYSTERESIS, "inline": False}})
        app = App(config)  # never started: no RPC loop, no deleter or reclaimer thread
        app.cache.clock = self.clock  # CacheManager has no clock option through App
        return app

    @property
    def reclaimer(self) -> Any:
        assert self.app.reclaimer is not None
        return self.app.reclaimer

    def call(self, method: str, params: dict[str, Any]) -> Any:
        reply = self.app.dispatcher.call(method, params)
        return msgpack.unpackb(reply.data) if isinstance(reply, wire.Raw) else reply

    def write(self, keys: list[int], instance: str = INSTANCE) -> list[int] | None:
        """Write a prompt; returns the keys it added (None: refused by the hard quota)."""
        try:
            started = self.call("start_write_cache", {"instance_id": instance, "block_keys": keys})
        except CapacityError:
            return None
        mask = started["block_mask"]
        there = [i < mask["offset"] for i in range(len(keys))] if "offset" in mask else mask["bool_masks"]
        new = [k for k, present in zip(keys, there) if not present]
        assert len(started["locations"]) == len(new)
        done = self.call("finish_write_cache", {"instance_id": instance, "write_session_id": started["write_session_id"],
                                                "success_blocks": {"offset": len(new)}})
        assert done == {"served": len(new), "failed": 0}, done
        return new

    def read(self, keys: list[int], instance: str = INSTANCE) -> int:
        reply = self.call("get_cache_location", {"instance_id": instance, "query_type": "prefix_match",
                                                 "block_keys": keys})
        return len(reply["locations"])

    def remove(self, keys: list[int]) -> None:
        self.call("remove_cache", {"instance_id": INSTANCE, "block_keys": keys})

    def tick(self) -> tuple[int, Round]:
        """Free what is due, then one reclaimer round at the clock's time; returns the usage
        that round found, and the round."""
        self.app.cache.deleter.run_once(self.clock.now)
        used = int(self.app.cache.usage(GROUP).get("bytes", 0))
        return used, self.reclaimer.run_once(self.clock.now)

    def serving(self) -> set[int]:
        return {row[0] for row in self.app.cache.serving_keys(INSTANCE)}

    def set_policy(self, policy: str, ttl: int = 0) -> None:
        group = self.call("get_instance_group", {"name": GROUP})["instance_group"]
        self.call("update_instance_group", {"current_version": group["version"], "instance_group": {
            "name": GROUP, "reclaim_strategy": {"reclaim_policy": policy, "used_percentage": WATERMARK,
                                                "delay_before_delete_ms": 0, "ttl_seconds": ttl}}})

    def restart(self) -> None:
        """A clean stop, and a new App (manager, reclaimer) on the same data dir."""
        self.app.stop()
        self.app = self._open()

    def close(self) -> None:
        self.app.stop()


@contextmanager
def node(policy: str, ttl: int = 0) -> Iterator[Node]:
    where = tempfile.mkdtemp(prefix="kvcm-rm-", dir="/tmp")  # short: the ipc path has a length limit
    n = None
    try:
        n = Node(where, policy, ttl)
        n.tick()  # the group's first round: its (empty) state is built before any event
        yield n
    finally:
        if n is not None:
            n.close()
        shutil.rmtree(where, ignore_errors=True)


def victims_of(report: Round, group: str = GROUP, instance: str = INSTANCE) -> list[tuple[int, str]]:
    out = []
    for name, stype, (iid, key), reason in report.victims:
        assert (name, stype, iid) == (group, STYPE, instance)
        out.append((key, reason))
    return out


# -- streams ------------------------------------------------------------------------------------

PROMPT = st.sampled_from(PROMPTS)
WRITE = st.tuples(st.just("write"), st.one_of(PROMPT, st.sampled_from(WHOLE)))
READ = st.tuples(st.just("read"), PROMPT)
REMOVE = st.tuples(st.just("remove"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
ADVANCE = st.tuples(st.just("advance"), st.integers(0, 3))
RESTART = st.tuples(st.just("restart"))


def between_ticks(other: st.SearchStrategy[tuple[Any, ...]]) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """The requests between two ticks, then the tick: a few writes, several lookups (on
    overlapping prefixes), a few removals or clock steps, in any order."""
    parts = st.tuples(st.lists(WRITE, max_size=3), st.lists(READ, min_size=1, max_size=6), st.lists(other, max_size=2))
    return parts.flatmap(lambda p: st.permutations([*p[0], *p[1], *p[2]])).map(lambda ops: [*ops, ("tick",)])


def streams(other: st.SearchStrategy[tuple[Any, ...]]) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    return st.lists(between_ticks(other), min_size=1, max_size=12).map(lambda ticks: [op for t in ticks for op in t])


STREAMS = streams(st.one_of(REMOVE, ADVANCE))
RESTART_STREAMS = streams(st.one_of(REMOVE, ADVANCE, RESTART))


def run_stream(policy: str, ttl: int, ops: list[tuple[Any, ...]]) -> None:
    model = Model(policy, ttl)
    with node(policy, ttl) as n:
        for op in ops:
            kind = op[0]
            if kind == "write":
                new = n.write(op[1])
                expected = model.written(op[1])
                # admission leaves out the deleting copies: their bytes are on their way out
                over = BLOCK * (len(model.blocks) + len(expected)) > QUOTA_BLOCKS * BLOCK
                assert new == (None if over and expected else expected)
                for key in new or []:
                    model.serve(key, TREE[key], n.clock.now)
            elif kind == "read":
                hits = model.hits(op[1])
                assert n.read(op[1]) == len(hits)
                if hits:
                    model.read(hits, n.clock.now)
            elif kind == "remove":
                n.remove(op[1])
                model.remove(op[1])
            elif kind == "advance":
                n.clock.now += op[1]
            elif kind == "restart":
                n.restart()
                model.restarted()
            else:
                used, report = n.tick()
                assert used == BLOCK * len(model.blocks)
                assert victims_of(report) == model.victims(n.clock.now)
                assert n.serving() == set(model.blocks)
                n.clock.now += 1


POLICIES = [("lru", 0), ("lfu", 0), ("ttl", TTL_S), ("leaf_lru", 0), ("lru", TTL_S)]
POLICY_IDS = [f"{p}-ttl{t}" for p, t in POLICIES]
# Derandomized: the same streams in every run, as tests/cache/test_cache_model.py. No explain phase:
# it traces every line of the server code and makes a shrink take minutes.
SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])


@pytest.mark.parametrize(("policy", "ttl"), POLICIES, ids=POLICY_IDS)
@SETTINGS
@given(ops=STREAMS)
def test_victims_match_the_model(policy: str, ttl: int, ops: list[tuple[Any, ...]]) -> None:
    run_stream(policy, ttl, ops)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("policy", "ttl"), POLICIES, ids=POLICY_IDS)
@settings(SETTINGS, max_examples=3000)
@given(ops=STREAMS)
def test_victims_match_the_model_long(policy: str, ttl: int, ops: list[tuple[Any, ...]]) -> None:
    run_stream(policy, ttl, ops)


@pytest.mark.parametrize(("policy", "ttl"), POLICIES, ids=POLICY_IDS)
@SETTINGS
@given(ops=RESTART_STREAMS)
def test_victims_match_the_model_across_restarts(policy: str, ttl: int, ops: list[tuple[Any, ...]]) -> None:
    run_stream(policy, ttl, ops)


# -- plain scenarios ------------------------------------------------------------------------------


def at(n: Node, seconds: float) -> None:
    n.clock.now = CLOCK_BASE + seconds


def test_lru_keeps_the_system_prompt_every_request_reads() -> None:
    """Reads of one tick are folded as a batch: each key counts at its *last* read. Every
    request starts with the system prompt (1, 2), so it is the most recent of all."""
    with node("lru") as n:
        at(n, 10)
        assert n.write([1, 2, 10, 11]) == [1, 2, 10, 11]
        assert n.write([1, 2, 20]) == [20]
        assert n.tick()[1].victims == []  # 5 blocks: under the high mark
        at(n, 20)
        assert n.read([1, 2, 10, 11]) == 4
        assert n.read([1, 2, 20]) == 3
        assert n.write([1, 2, 30]) == [30]  # 6 blocks: 2 must go
        victims = victims_of(n.tick()[1])
        assert not {1, 2} & {k for k, _ in victims}, f"the system prompt was evicted: {victims}"
        assert victims == [(10, "watermark"), (11, "watermark")]
        assert n.serving() == {1, 2, 20, 30}


def _late_group_with_a_hot_block(n: Node) -> None:
    """A group created after the reclaimer's rounds began: 6 blocks, one a second (the high
    mark), then block 101 read."""
    n.add_group("late", "late-inst", "lru")
    for k in range(101, 107):
        at(n, k - 100)
        n.write([k], "late-inst")
    at(n, 10)
    assert n.read([101], "late-inst") == 1


def test_new_group_first_round_keeps_the_block_read_after_every_write() -> None:
    with node("lru") as n:  # the reclaimer runs rounds already
        _late_group_with_a_hot_block(n)
        _, report = n.tick()  # the reclaimer's first round for the group
        assert victims_of(report, "late", "late-inst") == [(102, "watermark"), (103, "watermark")]


def test_reads_folded_before_a_new_groups_first_sync_still_count() -> None:
    """A tick between rounds folds the buffered events in (and journals them); a group created
    since the last round must be known by then, or its reads are lost and the block read after
    every write goes first."""
    with node("lru") as n:
        _late_group_with_a_hot_block(n)
        n.reclaimer._next_round = time.monotonic() + 3600  # so the tick only folds the events in
        assert n.reclaimer.tick() is None
        _, report = n.tick()
        assert victims_of(report, "late", "late-inst") == [(102, "watermark"), (103, "watermark")]


@pytest.mark.parametrize("to", ["leaf_lru", "lfu"])
def test_policy_change_keeps_reads_made_just_before_it(to: str) -> None:
    with node("lru") as n:
        for k in range(101, 106):  # unrelated one-block prompts: all leaves, one use each
            at(n, k - 100)
            n.write([k])
        assert n.tick()[1].victims == []
        at(n, 10)
        assert n.read([101]) == 1  # 101: the oldest written, but read since
        n.set_policy(to)
        at(n, 11)
        assert n.write([106]) == [106]  # 6 blocks: 2 must go
        assert victims_of(n.tick()[1]) == [(102, "watermark"), (103, "watermark")]


def test_lfu_credits_each_read_at_its_own_time() -> None:
    """The stream hypothesis found (``test_victims_match_the_model_long[lfu-ttl0]``)."""
    with node("lfu") as n:
        at(n, 1)
        assert n.write([1, 2, 40]) == [1, 2, 40]
        assert n.read([1]) == 1
        at(n, 2)
        assert n.write([1, 2, 10, 11, 12]) == [10, 11, 12]
        assert n.read([1, 2, 10, 11]) == 4  # 10, 11: used at 2 and 2
        at(n, 3)
        assert n.read([1, 2, 40]) == 3  # 40: used at 1 and 3, in the same batch of reads as the one before
        # 6 blocks: 2 must go. 12 has one use; 2**(1/600) + 2**(3/600) > 2 * 2**(2/600) (convexity),
        # so 10 is used less than 40 (and ties with 11, read after it). Credited at the batch's last
        # read (3), 10 would count 2**(2/600) + 2**(3/600), more than 40.
        assert victims_of(n.tick()[1]) == [(12, "watermark"), (10, "watermark")]


@pytest.mark.parametrize("pending", [False, True], ids=["folded", "pending"])
def test_lru_read_recency_across_restarts(pending: bool) -> None:
    """``pending``: the read is still in the reclaimer's queue at the stop (no tick since)."""
    with node("lru") as n:
        for k in range(101, 106):
            at(n, k - 100)
            n.write([k])
        at(n, 10)
        assert n.read([101]) == 1
        if not pending:
            assert n.tick()[1].victims == []
        n.restart()
        at(n, 20)
        assert n.write([106]) == [106]
        assert victims_of(n.tick()[1]) == [(102, "watermark"), (103, "watermark")]

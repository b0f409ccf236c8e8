"""The engine index without sockets: key mapping, re-chunking, refcounts, namespaces, persistence,
and ``match`` against a brute-force model in a randomized test."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvcm.backends.metastore import MemoryStore
from kvcm.cache.keys import derive_keys, token_ids_to_block_keys
from kvcm.engines.hashing import chain_states, chain_states_many, to_signed
from kvcm.engines.index import EngineIndex
from kvcm.engines.sources import SourceSpec
from kvcm.proto.extra_keys import request_extras
from kvcm.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch

TOKENS = [random.Random(7).randrange(50_000) for _ in range(256)]


def make(block_size: int = 16, store=None, sources=("a",)):
    index = EngineIndex(store, lambda _: block_size)
    gens = {s: index.add_source(SourceSpec(s, "inst", f"tcp://h:{i + 1}")).generation for i, s in enumerate(sources)}
    seqs = Counter()

    def apply(source, *events):
        seqs[source] += 1
        return index.apply(source, gens[source], seqs[source] - 1, DecodedBatch(1.0, list(events)))

    return index, apply


def stored(hashes, first_block, count, bs=16, parent=None, **kw):
    toks = TOKENS[first_block * bs : (first_block + count) * bs]
    return BlockStored(list(hashes), parent, toks, bs, medium=kw.pop("medium", "GPU"), **kw)


def best(index, keys, source="a", medium="GPU", **kw):
    for entry in index.match("inst", keys, **kw):
        if entry.source_id == source:
            return entry.media.get(medium, 0)
    return 0


def test_fast_chain_equals_blockkeys():
    rng = random.Random(1)
    for _ in range(50):
        toks = [rng.randrange(-(2**63), 2**63) if rng.random() < 0.1 else rng.randrange(200_000) for _ in range(64)]
        bs = rng.choice([1, 2, 4, 8, 16])
        assert [to_signed(u) for u in chain_states(0, toks, bs)] == token_ids_to_block_keys(toks, bs)
    lists = [[rng.randrange(1000) for _ in range(16 * rng.randrange(0, 9))] for _ in range(40)]
    seeds = [rng.randrange(2**64) for _ in lists]
    assert chain_states_many(seeds, lists, 16) == [chain_states(s, t, 16) for s, t in zip(seeds, lists)]


@pytest.mark.parametrize("high", [2**32 - 1, 2**32, 2**64 - 1, 2**70])
def test_lanes_take_every_id_the_scalar_chain_takes(high: int) -> None:
    """The lanes pack ids below 2**32 in 4 bytes, wider ones in 8, and mask the rest to 64 bits:
    each form gives exactly the scalar chain's states (ids at the edge of each form included)."""
    rng = random.Random(high)
    edge = [0, 1, 255, 256, 2**31, high - 1, high]
    lists = [[rng.choice(edge) if rng.random() < 0.3 else rng.randrange(high) for _ in range(8 * rng.randrange(1, 6))]
             for _ in range(12)]  # fmt: skip
    lists[3] = [-1, -(2**63), *lists[3][2:]] if high > 2**64 else lists[3]  # negatives enter as their low 64 bits
    seeds = [rng.randrange(2**64) for _ in lists]
    assert chain_states_many(seeds, lists, 8) == [chain_states(s, t, 8) for s, t in zip(seeds, lists)]


def test_keys_are_the_storage_tier_keys_chained_through_parents():
    index, apply = make()
    apply("a", stored([1, 2], 0, 2), stored([3], 2, 1, parent=2))
    apply("a", stored([4], 3, 1, parent=3))
    keys = token_ids_to_block_keys(TOKENS[: 16 * 6], 16)
    assert best(index, keys) == 4
    other = token_ids_to_block_keys([7, *TOKENS[1:96]], 16)  # first token differs: every key differs
    assert best(index, other) == 0


@pytest.mark.parametrize("engine_bs,instance_bs", [(32, 16), (64, 16), (8, 16), (4, 16), (16, 16)])
def test_rechunking_when_sizes_divide(engine_bs, instance_bs):
    index, apply = make(instance_bs)
    n = 128 // engine_bs
    apply("a", stored(range(1, n // 2 + 1), 0, n // 2, engine_bs))
    apply("a", stored(range(n // 2 + 1, n + 1), n // 2, n - n // 2, engine_bs, parent=n // 2))
    keys = token_ids_to_block_keys(TOKENS[:128], instance_bs)
    assert best(index, keys) == len(keys)


def test_sizes_that_do_not_divide_are_refused():
    index, apply = make(16)
    stats = apply("a", stored([1], 0, 1, 12))
    assert stats.errors == Counter({"block_size_mismatch": 1})
    assert index.match("inst", token_ids_to_block_keys(TOKENS, 16)) == []


def test_unknown_parent_is_skipped_not_rooted():
    index, apply = make()
    stats = apply("a", stored([5], 1, 1, parent=999))
    assert stats.errors["unknown_parent"] == 1
    assert index.get("a").blocks == {}


def test_bad_shape_and_tokenless_tier_events():
    index, apply = make()
    stats = apply("a", BlockStored([1, 2], None, TOKENS[:20], 16, medium="GPU"))
    assert stats.errors["bad_shape"] == 1
    apply("a", stored([1, 2], 0, 2))
    stats = apply("a", BlockStored([1, 2, 77], None, [], 0, medium="cpu"))  # offload placeholder
    assert stats.errors["unknown_hash"] == 1
    keys = token_ids_to_block_keys(TOKENS, 16)
    assert best(index, keys, medium="CPU") == 2 and best(index, keys, medium="GPU") == 2
    assert best(index, keys, media=["CPU"], medium="GPU") == 0
    apply("a", BlockRemoved([1], "GPU"))
    assert best(index, keys, medium="GPU") == 0 and best(index, keys, medium="CPU") == 2


def test_duplicate_stores_are_refcounted_and_unknown_removes_ignored():
    index, apply = make()
    keys = token_ids_to_block_keys(TOKENS, 16)
    apply("a", stored([1], 0, 1), stored([1], 0, 1))
    apply("a", BlockRemoved([1, 12345], "GPU"))
    assert best(index, keys) == 1
    apply("a", BlockRemoved([1], None))  # None medium = the GPU block pool
    assert best(index, keys) == 0 and index.get("a").blocks == {}


def test_bytes_hashes_match_their_int_mode():
    index, apply = make()
    digest = bytes(24) + (7).to_bytes(8, "big")
    apply("a", BlockStored([digest], None, TOKENS[:16], 16, medium="GPU"))
    apply("a", stored([8], 1, 1, parent=7))  # the child names its parent in int mode
    assert best(index, token_ids_to_block_keys(TOKENS, 16)) == 2


def test_lora_namespaces_and_groups():
    index, apply = make()
    keys = token_ids_to_block_keys(TOKENS, 16)
    apply("a", stored([1], 0, 1, lora_name="ad-1"))
    apply("a", stored([2, 3], 0, 2, group_idx=1, kv_cache_spec_kind="sliding_window"))
    assert best(index, keys) == 0  # base model holds nothing; SWA group is not a prefix holder
    # two groups make a hybrid source, and a sliding-window group without a window is one kvcm
    # cannot reason about: it holds nothing by default, and says why (tests/engines/test_hybrid.py)
    (found,) = index.match("inst", keys)
    assert found.matched_blocks == 0 and "without a window" in (found.unsupported or "")
    # the adapter's name is the extra key of each of its blocks (docs/engines.md "Keys")
    lora_keys = derive_keys(None, TOKENS, 16, request_extras(tokens=len(TOKENS), block_size=16, lora_name="ad-1"))
    assert best(index, lora_keys, lora_name="ad-1", group_idx=0) == 1
    assert best(index, keys, lora_name="ad-1", group_idx=0) == 0
    assert best(index, keys, group_idx=1) == 2


def test_all_blocks_cleared_and_other_sources_untouched():
    index, apply = make(sources=("a", "b"))
    keys = token_ids_to_block_keys(TOKENS, 16)
    apply("a", stored([1, 2], 0, 2))
    apply("b", stored([1, 2, 3], 0, 3))
    apply("a", AllBlocksCleared())
    assert best(index, keys, "a") == 0 and best(index, keys, "b") == 3
    index.remove_source("b")
    assert index.match("inst", keys) == []


def test_persistence_roundtrip_and_removal():
    store = MemoryStore()
    index, apply = make(store=store, sources=("a", "b"))
    apply("a", stored([1, 2], 0, 2), stored([9], 0, 1, medium="CPU"))
    apply("b", stored([1, 2, 3], 0, 3))
    apply("a", BlockRemoved([2], "GPU"))
    index.flush()
    again = EngineIndex(store, lambda _: 16)
    again.load()
    keys = token_ids_to_block_keys(TOKENS, 16)
    assert again.match("inst", keys) == index.match("inst", keys)
    assert again.get("a").last_seq == 1 and again.get("b").last_seq == 0
    apply("a", AllBlocksCleared())
    index.remove_source("b")
    index.flush()
    third = EngineIndex(store, lambda _: 16)
    third.load()
    assert third.match("inst", keys) == [] and [s.spec.source_id for s in third.sources()] == ["a"]


# --- randomized: match against a brute-force model ----------------------------------------------------


class Model:
    """What each source holds, kept the naive way: the full token prefix of every engine block."""

    def __init__(self, instance_bs):
        self.b = instance_bs
        self.blocks: dict[str, dict[int, dict]] = {}

    def held_keys(self, source, medium, lora):
        out = set()
        for blk in self.blocks.get(source, {}).values():
            if blk["refs"].get(medium, 0) > 0 and blk["lora"] == lora:
                prefix, e = blk["prefix"], blk["e"]
                keys = lora_keys(prefix, self.b, lora)
                for j, k in enumerate(keys):
                    if len(prefix) - e < (j + 1) * self.b <= len(prefix):
                        out.add(k)
        return out

    def expected(self, keys, lora):
        out = {}
        for source in self.blocks:
            media = {}
            for medium in ("GPU", "CPU"):
                held = self.held_keys(source, medium, lora)
                n = 0
                while n < len(keys) and keys[n] in held:
                    n += 1
                if n:
                    media[medium] = n
            if media:
                out[source] = media
        return out


def lora_keys(tokens, b, lora):
    """kvcm keys of a prompt run with adapter ``lora`` (its name is every block's extra key)."""
    extras = request_extras(tokens=len(tokens), block_size=b, lora_name=lora or None)
    return derive_keys(None, tokens, b, extras) if tokens else []


def engine_hash(prefix, lora):
    return hash(("vllm", tuple(prefix), lora)) & (2**64 - 1)


@pytest.mark.parametrize("seed", range(6))
def test_match_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    b = rng.choice([4, 8])
    sources = [f"s{i}" for i in range(rng.randint(2, 6))]
    engine_bs = {s: rng.choice([b // 2, b, 2 * b]) for s in sources}
    base = [rng.randrange(100) for _ in range(16)]
    docs = [base[: rng.choice([0, 4, 8, 16])] + [rng.randrange(100) for _ in range(96)] for _ in range(5)]
    store = MemoryStore()
    index, _ = make(b, store, sources)
    gens = {s: index.get(s).generation for s in sources}
    model = Model(b)
    seqs = Counter()
    for _round in range(40):
        items = []
        for _ in range(rng.randint(1, 5)):
            source = rng.choice(sources)
            events = [_random_event(rng, model, source, engine_bs[source], docs) for _ in range(rng.randint(1, 8))]
            items.append((source, gens[source], seqs[source], DecodedBatch(1.0, events)))
            seqs[source] += 1
        index.apply_many(items)
        for _ in range(5):
            doc, lora = rng.choice(docs), rng.choice([None, None, "ad"])
            keys = lora_keys(doc[: rng.randrange(len(doc) + 1)], b, lora)
            full = index.match("inst", keys, lora_name=lora)
            got = {r.source_id: r.media for r in full}
            assert got == model.expected(keys, lora or "")
    index.flush()
    restored = EngineIndex(store, lambda _: b)
    restored.load()
    for doc in docs:
        keys = token_ids_to_block_keys(doc, b)
        assert restored.match("inst", keys) == index.match("inst", keys)


def _random_event(rng, model, source, e, docs):
    """One random event for ``source``, applied to the model as the index should apply it."""
    blocks = model.blocks.setdefault(source, {})
    roll = rng.random()
    if roll < 0.05:
        blocks.clear()
        return AllBlocksCleared()
    if roll < 0.3 and blocks:
        h = rng.choice(list(blocks))
        medium = rng.choice(["GPU", "CPU"])
        blk = blocks[h]
        if blk["refs"].get(medium, 0) > 0:
            blk["refs"][medium] -= 1
            if not blk["refs"][medium]:
                del blk["refs"][medium]
            if not blk["refs"]:
                del blocks[h]
        return BlockRemoved([h, 424242], medium)
    if roll < 0.4 and blocks:  # tier-only store through the hash map
        hashes = rng.sample(list(blocks), min(len(blocks), 3))
        for h in hashes:
            blocks[h]["refs"]["CPU"] = blocks[h]["refs"].get("CPU", 0) + 1
        return BlockStored(hashes, None, [], 0, medium="CPU")
    lora = rng.choice(["", "", "ad"])
    doc = rng.choice(docs)
    parents = [(h, blk) for h, blk in blocks.items() if blk["lora"] == lora and blk["e"] == e and list(blk["prefix"]) == doc[: len(blk["prefix"])]]
    start, parent = 0, None
    if parents and rng.random() < 0.7:
        parent, pblk = rng.choice(parents)
        start = len(pblk["prefix"])
    n = min(rng.randint(1, 4), (len(doc) - start) // e)
    if n <= 0:
        return BlockStored([], None, [], e, medium="GPU")
    hashes, medium = [], rng.choice(["GPU", "GPU", "CPU"])
    for i in range(n):
        prefix = tuple(doc[: start + (i + 1) * e])
        h = engine_hash(prefix, lora)
        hashes.append(h)
        blk = blocks.setdefault(h, {"prefix": prefix, "lora": lora, "e": e, "refs": {}})
        blk["refs"][medium] = blk["refs"].get(medium, 0) + 1
    return BlockStored(hashes, parent, doc[start : start + n * e], e, None, medium, lora or None)


def test_keyed_adds_are_held_once_per_medium_and_a_second_medium_is_held_too():
    """Keyed adds (Tair's reporters) are idempotent per medium: the same keys again change nothing
    and one remove drops them; the same keys on another medium are held there as well, and a
    remove on the first leaves them held on the second."""
    from kvcm.backends.metastore import MemoryStore
    from kvcm.engines.index import KEYED
    from kvcm.proto.kv_events import BlockRemoved, BlockStored, DecodedBatch

    index = EngineIndex(MemoryStore(), lambda _: 16)
    gen = index.add_source(SourceSpec("tair/pod", "inst", "push://pod")).generation
    keys = [11, 12, 13, (1 << 64) - 5]  # the last one a kvcm key past 2**63 (signed: -5)
    signed = [11, 12, 13, -5]

    def add(seq: int, medium: str, hashes: list[int]) -> None:
        ev = BlockStored(list(hashes), None, [], 0, None, medium, None, KEYED, None)
        index.apply("tair/pod", gen, seq, DecodedBatch(1.0, [ev]))

    add(0, "GPU", keys + keys[:2])  # named twice in one report: held once
    add(1, "GPU", keys)
    assert index.blocks_held("tair/pod") == {"GPU": 4}
    add(2, "CPU", keys[:3])
    assert index.blocks_held("tair/pod") == {"GPU": 4, "CPU": 3}
    found = index.match("inst", signed, media=["CPU"])
    assert [(m.source_id, m.media) for m in found] == [("tair/pod", {"CPU": 3})]
    index.apply("tair/pod", gen, 3, DecodedBatch(1.0, [BlockRemoved(keys, "GPU")]))
    assert index.blocks_held("tair/pod") == {"CPU": 3}
    assert index.check() == []
    # a key no slot holds any more leaves the holder table (its memory is someone's bound)
    assert sorted(index._tables[("inst", "")].holders) == sorted(signed[:3])

"""Hybrid-aware matching (docs/engines.md, "Hybrid models"): a source whose engine has several
KV-cache groups holds, by default, the prefix every group can reuse, never what its
full-attention group alone holds.

The fixtures are shaped like vLLM's group layouts: full attention + a sliding window of 1,024
tokens at 16-token blocks (Gemma 3) and of 128 tokens (gpt-oss); full attention at 16-token blocks
+ Mamba at 64 (Qwen3-Next / Nemotron-H with ``--mamba-block-size 64``). Events are shaped as vLLM
sends them: one dense ``BlockStored`` per group, the engine hash of a block naming its prefix end
(the same hash in every group, as vLLM's block hashes are), ``BlockRemoved`` per group.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvcm.backends.metastore import LmdbStore, MemoryStore
from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.engines.entries import SourceMatch
from kvcm.engines.hybrid import FULL_KINDS, STATE_KINDS, WINDOW_KINDS
from kvcm.engines.index import EngineIndex
from kvcm.engines.sources import SourceSpec
from kvcm.errors import Code, KvcmError
from kvcm.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch
from kvcm.proto.results import EngineMatches
from kvcm.testing import FakeEnginePublisher, serve_in_thread
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
B = 16  # the instance's block size
#: group -> (kind, window, engine block size)
GEMMA3 = {0: ("full_attention", None, 16), 1: ("sliding_window", 1024, 16)}
GPT_OSS = {0: ("full_attention", None, 16), 1: ("sliding_window", 128, 16)}
QWEN3_NEXT = {0: ("full_attention", None, 16), 1: ("mamba", None, 64)}
#: three kinds and three block sizes: a prefix must be a multiple of 64 tokens (4 instance blocks)
MIXED = {0: ("full_attention", None, 32), 1: ("sliding_window_mla", 100, 16), 2: ("mamba", None, 64)}
PLAIN = {0: (None, None, 16)}


def doc(seed: int, blocks: int = 160, shared: Sequence[int] = ()) -> list[int]:
    rng = random.Random(seed)
    return list(shared) + [rng.randrange(150_000) for _ in range(blocks * B - len(shared))]


DOC = doc(1)
KEYS = token_ids_to_block_keys(DOC, B)


def engine_hash(prefix: Sequence[int]) -> int:
    """A block's engine hash: its prefix end, the same in every group (as vLLM's)."""
    digest = hashlib.blake2b(repr(tuple(prefix)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Engine:
    """vLLM-shaped events of one engine with the given groups, over documents of tokens."""

    def __init__(self, groups: dict[int, tuple[str | None, int | None, int]]) -> None:
        self.groups = groups
        self._hashes: dict[tuple[int, int], int] = {}

    def hash_at(self, tokens: Sequence[int], end: int) -> int:
        key = (id(tokens), end)
        found = self._hashes.get(key)
        if found is None:
            found = self._hashes[key] = engine_hash(tokens[:end])
        return found

    def store(
        self, group: int, first: int, count: int, tokens: Sequence[int] = DOC, medium: str = "GPU"
    ) -> BlockStored:
        """Engine blocks ``first .. first+count-1`` of ``group`` (in its own block size)."""
        kind, window, e = self.groups[group]
        hashes = [self.hash_at(tokens, (first + i + 1) * e) for i in range(count)]
        parent = self.hash_at(tokens, first * e) if first else None
        return BlockStored(hashes, parent, list(tokens[first * e : (first + count) * e]), e, medium=medium,
                           group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)  # fmt: skip

    def request(self, blocks: int, tokens: Sequence[int] = DOC, medium: str = "GPU") -> list[BlockStored]:
        """One prefill of ``blocks`` instance blocks: a store per group, group 0 first (as vLLM)."""
        out = []
        for group, (_, _, e) in self.groups.items():
            n = blocks * B // e
            if n:
                out.append(self.store(group, 0, n, tokens, medium))
        return out

    def remove(
        self, group: int, indices: Sequence[int], tokens: Sequence[int] = DOC, medium: str = "GPU"
    ) -> BlockRemoved:
        e = self.groups[group][2]
        return BlockRemoved([self.hash_at(tokens, (i + 1) * e) for i in indices], medium, group)


def make(sources: dict[str, dict[int, tuple[str | None, int | None, int]]], store: Any = None, **spec: Any):
    index = EngineIndex(store or MemoryStore(), lambda _: B)
    gens = {s: index.add_source(SourceSpec(s, "inst", f"tcp://h:{i + 1}", **spec)).generation
            for i, s in enumerate(sources)}  # fmt: skip
    seqs: Counter[str] = Counter()

    def apply(source: str, *events: Any) -> Any:
        seqs[source] += 1
        return index.apply(source, gens[source], seqs[source] - 1, DecodedBatch(1.0, list(events)))

    return index, apply, {s: Engine(g) for s, g in sources.items()}


def entry(index: EngineIndex, keys: Sequence[int] = KEYS, source: str = "pod", **kw: Any) -> SourceMatch | None:
    return next((m for m in index.match("inst", keys, **kw) if m.source_id == source), None)


def reusable(index: EngineIndex, keys: Sequence[int] = KEYS, source: str = "pod", **kw: Any) -> int:
    found = entry(index, keys, source, **kw)
    return 0 if found is None else found.matched_blocks


def by_group(found: SourceMatch | None) -> dict[int, dict[str, Any]]:
    assert found is not None and found.groups is not None
    return {g["group_idx"]: g for g in found.groups}


# --- sliding window (Gemma 3: 1,024 tokens at 16-token blocks) ----------------------------------------------


def test_a_window_that_lost_its_old_blocks_still_serves_the_long_prompt_but_not_a_shorter_one() -> None:
    """The window group freed blocks 0..50 (vLLM frees what slid out of the window first); the full
    group kept all 160. The whole prompt is reusable (its last 64 blocks are held in both groups),
    a 100-block prefix is not: its window [36, 100) lost 36..50, and no shorter prefix is whole."""
    index, apply, engines = make({"pod": GEMMA3})
    gemma = engines["pod"]
    apply("pod", *gemma.request(160))
    apply("pod", gemma.remove(1, range(51)))
    assert reusable(index) == 160
    found = entry(index, KEYS[:100])
    assert found is not None and found.matched_blocks == 0 and found.media == {}
    detail = by_group(found)
    assert detail[0] == {
        "group_idx": 0,
        "kind": "full_attention",
        "block_size": 16,
        "held_blocks": 100,
        "reusable_blocks": 100,
    }  # the full group alone would have said 100: the over-report
    assert detail[1]["window"] == 1024 and detail[1]["held_blocks"] == 0 and detail[1]["reusable_blocks"] == 0
    assert reusable(index, KEYS[:100], group_idx=0) == 100  # a query naming a group gets that group's own prefix


def test_a_window_that_lost_its_newest_blocks_caps_the_prefix_where_its_window_ends() -> None:
    index, apply, engines = make({"pod": GEMMA3})
    gemma = engines["pod"]
    apply("pod", *gemma.request(160))
    apply("pod", gemma.remove(1, range(150, 160)))
    assert reusable(index) == 150
    assert by_group(entry(index))[1]["reusable_blocks"] == 150
    apply("pod", gemma.remove(1, [120]))  # a hole inside the window: below it the whole window must fit
    assert reusable(index) == 120  # [56, 120) held
    apply("pod", gemma.remove(1, [60]))  # now every window past 60 has a hole; 60 itself is [0, 60)...
    assert reusable(index) == 60  # ... whose window [0, 60) is shorter than 64 blocks and held
    apply("pod", gemma.remove(1, [0]))
    assert reusable(index) == 0


def test_gpt_oss_window_of_128_tokens_needs_eight_blocks_and_the_full_group_bounds_everything() -> None:
    """A 128-token window needs ceil(127 / 16) = 8 blocks before the prefix's end."""
    index, apply, engines = make({"pod": GPT_OSS})
    oss = engines["pod"]
    apply("pod", *oss.request(40))
    apply("pod", oss.remove(1, range(30)))  # the window group keeps 30..39
    assert reusable(index) == 40
    apply("pod", oss.remove(1, [30, 31]))  # and then exactly the 8 blocks 32..39
    assert reusable(index) == 40
    apply("pod", oss.remove(1, [32]))
    assert reusable(index) == 0  # 40 needs 32..39; 32 and below need blocks 24..31, gone
    stats = apply("pod", oss.store(1, 32, 1, DOC))  # the engine stores block 32 again: its parent is gone
    assert stats.errors["unknown_parent"] == 1 and reusable(index) == 0  # skipped, never rooted
    apply("pod", oss.store(1, 0, 40))  # the window group stores the prompt again from its root
    assert reusable(index) == 40
    apply("pod", oss.remove(0, [35]))  # and the full group loses block 35
    assert reusable(index) == 35


# --- Mamba (Qwen3-Next / Nemotron-H: full attention at 16, Mamba at 64) -------------------------------------


def test_a_mamba_state_exists_only_at_its_block_end() -> None:
    index, apply, engines = make({"pod": QWEN3_NEXT})
    qwen = engines["pod"]
    apply("pod", *qwen.request(128))  # 2,048 tokens: 128 full blocks, 32 Mamba blocks
    assert reusable(index) == 128
    assert reusable(index, KEYS[:127]) == 124  # a state at 1,984 tokens, none at 2,032
    apply("pod", qwen.remove(1, [31]))  # the state at 2,048 is evicted; the full group keeps everything
    assert reusable(index) == 124
    apply("pod", qwen.remove(1, range(16, 31)))  # states at 1,088 .. 1,984 gone too
    assert reusable(index) == 64
    detail = by_group(entry(index))
    assert detail[1] == {"group_idx": 1, "kind": "mamba", "block_size": 64, "held_blocks": 64, "reusable_blocks": 64}
    assert detail[0]["held_blocks"] == 128
    apply("pod", qwen.remove(0, [10]))  # the full group loses block 10: the states past it are no use
    assert reusable(index) == 8
    assert reusable(index, group_idx=1) == 64  # the Mamba group's own prefix, as a query naming it gets


def test_mixed_block_sizes_align_the_prefix_to_every_group() -> None:
    """Full attention at 32, a 100-token MLA window at 16, Mamba at 64: a prefix ends on a 64-token
    boundary (4 instance blocks) and the window needs ceil(99 / 16) = 7 blocks before it."""
    index, apply, engines = make({"pod": MIXED})
    mixed = engines["pod"]
    apply("pod", *mixed.request(50))  # 800 tokens: full 25 blocks, window 50, Mamba 12 (768 tokens)
    assert reusable(index) == 48
    apply("pod", mixed.remove(1, [42]))  # 48 needs window blocks 41..47
    assert reusable(index) == 40  # 40 needs 33..39, and its state at 640 is held
    apply("pod", mixed.remove(2, [9]))  # the state at 640 is gone
    assert reusable(index) == 36


# --- what kvcm does not reason about -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "window", "e", "why"),
    [
        ("chunked_local_attention", None, 16, "no attention chunk size"),
        ("cross_attention", None, 16, "cross-attention"),
        ("encoder_only_attention", None, 16, "encoder-only"),
        ("unknown", None, 16, "kind 'unknown'"),
        ("linear_attention_v9", None, 16, "kind 'linear_attention_v9'"),
        ("sliding_window", None, 16, "without a window"),
        ("mamba", None, 24, "not a multiple of the instance's 16"),
    ],
)
def test_a_group_kvcm_cannot_reason_about_means_the_source_holds_nothing_and_says_why(kind, window, e, why) -> None:
    index, apply, engines = make({"pod": {0: ("full_attention", None, 16), 1: (kind, window, e)}})
    apply("pod", *engines["pod"].request(24))
    found = entry(index)
    assert found is not None and found.matched_blocks == 0 and found.media == {}
    assert found.unsupported is not None and why in found.unsupported and found.unsupported.startswith("group 1")
    assert reusable(index, group_idx=0) == 24  # the groups themselves are indexed as ever


def test_a_hostile_kind_name_is_kept_short() -> None:
    index, apply, engines = make({"pod": {0: ("full_attention", None, 16), 1: ("x" * 100_000, None, 16)}})
    apply("pod", *engines["pod"].request(4))
    found = entry(index)
    assert found is not None and found.matched_blocks == 0 and len(found.unsupported or "") < 200
    assert len(index.get("pod").groups[1].kind or "") <= 67  # type: ignore[union-attr]


def test_a_group_whose_block_size_changed_is_not_reasoned_about() -> None:
    index, apply, engines = make({"pod": GEMMA3})
    gemma = engines["pod"]
    apply("pod", *gemma.request(8))
    assert reusable(index) == 8
    apply("pod", BlockStored([99], None, DOC[:32], 32, medium="GPU", group_idx=1,
                             kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=1024))  # fmt: skip
    found = entry(index)
    assert found is not None and found.matched_blocks == 0 and "different block sizes" in (found.unsupported or "")


def test_full_report_mode_does_not_trust_window_or_mamba_groups() -> None:
    """vLLM's full report mode re-reports a reused window or Mamba prefix as dense from its root,
    naming the blocks the group skipped: kvcm cannot tell them from held ones."""
    index, apply, engines = make({"pod": QWEN3_NEXT}, report_mode="full")
    apply("pod", *engines["pod"].request(64))
    found = entry(index)
    assert found is not None and found.matched_blocks == 0 and "57358" in (found.unsupported or "")
    two_full, apply2, engines2 = make({"pod": {0: ("full_attention", None, 16), 1: ("mla_attention", None, 16)}},
                                      report_mode="full")  # fmt: skip
    apply2("pod", *engines2["pod"].request(64))
    apply2("pod", engines2["pod"].remove(1, [40]))
    assert reusable(two_full) == 40


def test_sources_that_only_ever_sent_one_group_are_matched_as_before() -> None:
    """One group: the default walk (and its fast path), and a sliding-window-only source is still
    matched only when a query names its group."""
    index, apply, engines = make({"pod": PLAIN, "swa": {1: ("sliding_window", 1024, 16)}})
    apply("pod", *engines["pod"].request(20))
    apply("swa", *engines["swa"].request(20))
    found = entry(index)
    assert found is not None and found.matched_blocks == 20 and found.groups is None
    assert entry(index, source="swa") is None and reusable(index, source="swa", group_idx=1) == 20
    runs = index.ranked("inst", KEYS, block_size=B, weight=lambda _: 1.0)
    assert runs is not None  # the fast path still answers: no hybrid source in the table
    hybrid, apply2, engines2 = make({"pod": GEMMA3})
    apply2("pod", engines2["pod"].store(0, 0, 4))
    assert reusable(hybrid) == 4  # one group so far: matched as a plain source
    apply2("pod", engines2["pod"].store(1, 0, 2))  # its second group arrives: hybrid from now on
    assert reusable(hybrid) == 2
    assert hybrid.ranked("inst", KEYS, block_size=B, weight=lambda _: 1.0) is None  # merged by match()


def test_a_sparse_mamba_store_is_refused_not_guessed() -> None:
    """vLLM's Mamba "align" mode sends one hash with several blocks' tokens (vllm-project/vllm#44451):
    which block the hash names is not in the event, so the store is refused (bad_shape)."""
    index, apply, engines = make({"pod": QWEN3_NEXT})
    qwen = engines["pod"]
    apply("pod", qwen.store(0, 0, 16))
    sparse = BlockStored([qwen.hash_at(DOC, 256)], None, DOC[:256], 64, medium="GPU", group_idx=1,
                         kv_cache_spec_kind="mamba")  # fmt: skip
    stats = apply("pod", sparse)
    assert stats.errors["bad_shape"] == 1 and reusable(index) == 0


# --- where else the rule holds ----------------------------------------------------------------------------------


def test_media_are_answered_each_on_their_own() -> None:
    index, apply, engines = make({"pod": GEMMA3})
    gemma = engines["pod"]
    apply("pod", *gemma.request(100, medium="GPU"), *gemma.request(100, medium="CPU"))
    apply("pod", gemma.remove(1, range(70, 100), medium="CPU"))
    found = entry(index)
    assert found is not None and found.media == {"GPU": 100, "CPU": 70} and found.matched_blocks == 100
    assert reusable(index, media=["CPU"]) == 70


def test_engine_locations_list_a_hybrid_source_within_its_reusable_prefix_only() -> None:
    index, apply, engines = make({"pod": QWEN3_NEXT})
    apply("pod", *engines["pod"].request(16))
    apply("pod", engines["pod"].remove(1, [3]))  # the state at 256 is gone: 12 reusable
    located = index.locations("inst", KEYS[:16])
    assert all(any(h["group_idx"] == 0 for h in located[i]) for i in range(12))
    assert located[12:] == [[], [], [], []]


def test_groups_survive_a_restart_and_records_of_the_older_form_load(tmp_path: Any) -> None:
    store = LmdbStore(str(tmp_path / "engines"), map_size=1 << 26, sync=False)
    index, apply, engines = make({"pod": GEMMA3}, store=store)
    apply("pod", *engines["pod"].request(100))
    apply("pod", engines["pod"].remove(1, range(40, 100)))
    index.flush()
    restored = EngineIndex(store, lambda _: B)
    restored.load()
    assert reusable(restored) == reusable(index) == 40
    assert restored.get("pod").groups == index.get("pod").groups  # type: ignore[union-attr]
    from kvcm.engines.hybrid import group_from_record

    assert group_from_record([1, "sliding_window"]) == (1, ("sliding_window", None, 0))


# --- a randomized replay against a brute-force model --------------------------------------------------------------


class Model:
    """What the index should hold, written from the rule (docs/engines.md), not from the code:
    per (source, group, medium) a count per engine block, and the kvcm keys each block covers."""

    def __init__(self, layouts: dict[str, dict[int, tuple[str | None, int | None, int]]], full: set[str]) -> None:
        self.layouts = layouts
        self.full = full
        self.refs: dict[tuple[str, int, str], Counter[int]] = {}
        #: (engine block size, engine hash) -> the kvcm keys of its block (one hash names one prefix
        #: end in every group, as vLLM's do, so a group of larger blocks covers more keys with it)
        self.covers: dict[tuple[int, int], list[int]] = {}
        self.held: dict[tuple[str, int, str], Counter[int]] = {}  # keys held, with the blocks holding each
        self.seen: dict[str, set[int]] = {}  # groups a source ever named: one group is matched as before

    def exists(self, source: str, group: int, h: int) -> bool:
        return any(self.refs.get((source, group, m), Counter())[h] > 0 for m in ("GPU", "CPU"))

    def store(self, source: str, ev: BlockStored, covers: list[list[int]]) -> None:
        group = ev.group_idx or 0
        self.seen.setdefault(source, set()).add(group)
        if ev.parent_block_hash is not None and not self.exists(source, group, ev.parent_block_hash):
            return  # unknown_parent: skipped
        refs = self.refs.setdefault((source, group, ev.medium or "GPU"), Counter())
        held = self.held.setdefault((source, group, ev.medium or "GPU"), Counter())
        e = self.layouts[source][group][2]
        for h, keys in zip(ev.block_hashes, covers):
            self.covers[(e, h)] = keys
            if refs[h] and source in self.full:
                continue  # a re-report
            refs[h] += 1
            if refs[h] == 1:
                held.update(keys)

    def remove(self, source: str, ev: BlockRemoved) -> None:
        key = (source, ev.group_idx or 0, ev.medium or "GPU")
        refs, held = self.refs.setdefault(key, Counter()), self.held.setdefault(key, Counter())
        e = self.layouts[source][key[1]][2]
        for h in ev.block_hashes:
            if refs[h] > 0:
                refs[h] -= 1
                if not refs[h]:
                    held.subtract(self.covers[(e, h)])

    def clear(self, source: str) -> None:
        for key in [k for k in self.refs if k[0] == source]:
            del self.refs[key]
            self.held.pop(key, None)

    def expected(self, source: str, keys: Sequence[int]) -> dict[str, int]:
        layout = {g: v for g, v in self.layouts[source].items() if g in self.seen.get(source, ())}
        out = {}
        for medium in ("GPU", "CPU"):
            has = {g: {k for k, n in self.held.get((source, g, medium), Counter()).items() if n > 0} for g in layout}
            best = self.best(layout, has, keys, source in self.full)
            if best:
                out[medium] = best
        return out

    @staticmethod
    def best(layout: dict[int, tuple[str | None, int | None, int]], has: dict[int, set[int]], keys: Sequence[int],
             full_mode: bool) -> int:  # fmt: skip
        if not layout:
            return 0
        if len(layout) == 1:
            ((group, (kind, _, _)),) = layout.items()
            if kind not in FULL_KINDS:
                return 0
            n = 0
            while n < len(keys) and keys[n] in has[group]:
                n += 1
            return n
        align = 1
        for kind, _, e in layout.values():
            if full_mode and kind not in FULL_KINDS:
                return 0
            align = max(align, e // B)  # the test layouts' sizes divide each other
        for end in range(len(keys) // align * align, 0, -align):
            ok = True
            for group, (kind, window, e) in layout.items():
                if kind in FULL_KINDS:
                    need = range(0, end)
                elif kind in WINDOW_KINDS:
                    assert window is not None
                    blocks = -(-(window - 1) // e)
                    first_block = max(0, end * B // e - blocks)
                    need = range(first_block * e // B, end)
                else:
                    assert kind in STATE_KINDS
                    need = range(end - e // B, end)
                if any(keys[i] not in has[group] for i in need):
                    ok = False
                    break
            if ok:
                return end
        return 0


@pytest.mark.heavy
def test_randomized_replay_of_100000_events_agrees_with_a_brute_force_model() -> None:
    """Several sources (Gemma 3, gpt-oss, Qwen3-Next, mixed block sizes, one plain and one in full
    report mode) store prefixes of shared documents on two media, lose blocks group by group,
    re-report and clear; after every few hundred events each source's answer for random prompts
    is exactly the model's: no residency the rule does not allow, none it allows left out."""
    rng = random.Random(42)
    layouts = {"gemma": GEMMA3, "oss": GPT_OSS, "qwen": QWEN3_NEXT, "mixed": MIXED, "plain": PLAIN,
               "full": {0: ("full_attention", None, 16), 1: ("mla_attention", None, 32)}}  # fmt: skip
    index, apply, engines = make({s: layouts[s] for s in layouts if s != "full"})
    full_gen = index.add_source(SourceSpec("full", "inst", "tcp://h:99", report_mode="full")).generation
    engines["full"] = Engine(layouts["full"])
    model = Model(layouts, {"full"})
    base = doc(100, 40)
    docs = [doc(i, 96, shared=base[: rng.choice((0, 160, 320, 640))]) for i in range(5)]
    keys_of = [token_ids_to_block_keys(d, B) for d in docs]
    seq = Counter[str]()
    events = 0
    seen = Counter[str]()  # what the comparisons covered: the test must not pass on empty answers

    def one_event(source: str) -> tuple[Any, list[list[int]] | None]:
        engine = engines[source]
        layout = layouts[source]
        roll = rng.random()
        group = rng.choice(list(layout))
        medium = "GPU" if rng.random() < 0.8 else "CPU"
        e = layout[group][2]
        d = rng.randrange(len(docs))
        if roll < 0.5:  # a store: from the root, or continuing a prefix
            limit = len(docs[d]) // e
            first = 0 if rng.random() < 0.4 else rng.randrange(limit)
            count = rng.randint(1, min(12, limit - first))
            ev = engine.store(group, first, count, docs[d], medium)
            return ev, [keys_of[d][(first + i) * e // B : (first + i + 1) * e // B] for i in range(count)]
        if roll < 0.995:  # a removal, mostly of a block the group holds
            refs = model.refs.get((source, group, medium))
            held = [h for h, n in refs.items() if n > 0] if refs else []
            if held and rng.random() < 0.9:
                hashes = rng.sample(held, min(len(held), rng.randint(1, 6)))
            else:
                hashes = [engine_hash([rng.randrange(10**6)])]
            return BlockRemoved(hashes, medium, group), None
        return AllBlocksCleared(), None

    while events < 100_000:
        source = rng.choice(list(layouts))
        batch, covered = [], []
        for _ in range(rng.randint(1, 6)):
            ev, cov = one_event(source)
            batch.append(ev)
            covered.append(cov)
        gen = full_gen if source == "full" else None
        if gen is None:
            apply(source, *batch)
        else:
            index.apply(source, gen, seq[source], DecodedBatch(1.0, batch))
            seq[source] += 1
        for ev, cov in zip(batch, covered):
            if type(ev) is BlockStored:
                assert cov is not None
                model.store(source, ev, cov)
            elif type(ev) is BlockRemoved:
                model.remove(source, ev)
            else:
                model.clear(source)
        events += len(batch)
        if events // 200 != (events - len(batch)) // 200:
            for _ in range(4):
                d = rng.randrange(len(docs))
                keys = keys_of[d][: rng.randint(1, len(keys_of[d]))]
                got = {m.source_id: m.media for m in index.match("inst", keys) if m.media}
                want = {s: model.expected(s, keys) for s in layouts}
                assert got == {s: m for s, m in want.items() if m}, (events, len(keys))
                for s in ("gemma", "oss", "qwen", "mixed"):
                    alone = reusable(index, keys, s, group_idx=0)  # what the full group alone would claim
                    seen["hybrid held"] += bool(want[s])
                    seen["full group alone would over-report"] += alone > want[s].get("GPU", 0)
    assert index.check() == []
    assert seen["hybrid held"] > 1000 and seen["full group alone would over-report"] > 1000, seen


# --- over real sockets ------------------------------------------------------------------------------------------


@contextmanager
def gemma_pod() -> Iterator[tuple[str, Any]]:
    """A real server following a fake vLLM publisher of Gemma 3's layout whose window group lost
    its newest 60 of 100 blocks; yields the client once kvcm has applied it all."""
    gemma = Engine(GEMMA3)
    with serve_in_thread() as server, server.client() as kv, FakeEnginePublisher() as engine:
        kv.call("register_instance", {"instance_group": "default", "instance_id": "gemma", "block_size": B,
                                      "location_spec_infos": [{"name": "tp0", "size": 1024}]})  # fmt: skip
        kv.call("add_event_source", {"source_id": "pod-a", "instance_id": "gemma", "endpoint": engine.endpoint,
                                     "replay_endpoint": engine.replay_endpoint})  # fmt: skip
        engine.publish(gemma.request(100))
        engine.publish([gemma.remove(1, range(40, 100))])

        def applied() -> bool:
            listed = kv.call("list_event_sources", {})["sources"]
            # blocks_held: distinct keys per group, summed (100 full, 40 window)
            return bool(listed) and listed[0]["last_seq"] == 1 and listed[0]["blocks_held"] == 140

        assert wait_for(applied), kv.call("list_event_sources", {})
        yield server.endpoint, kv


PROMPT = DOC[: 100 * B]


def test_a_gemma_pod_over_real_sockets_answers_what_it_can_reuse_with_its_groups() -> None:
    """match_engines (raw and typed), get_host_cache_state and the engine locations of
    get_cache_location all answer the 40 blocks the engine can reuse, not the full group's 100."""
    with gemma_pod() as (_, kv):
        reply = kv.call("match_engines", {"instance_id": "gemma", "token_ids": PROMPT})
        (found,) = reply["sources"]
        assert (found["matched_blocks"], found["matched_tokens"], found["media"]) == (40, 640, {"GPU": 40})
        assert found["groups"] == [
            {"group_idx": 0, "kind": "full_attention", "block_size": 16, "held_blocks": 100, "reusable_blocks": 100},
            {"group_idx": 1, "kind": "sliding_window", "block_size": 16, "window": 1024, "held_blocks": 40,
             "reusable_blocks": 40},
        ]  # fmt: skip
        typed = kv.match_engines(instance_id="gemma", token_ids=PROMPT)
        assert isinstance(typed, EngineMatches)
        (source,) = typed.sources
        assert source.matched_blocks == 40 and source.groups is not None and source.groups[1].window == 1024
        hosts = kv.call("get_host_cache_state", {"instance_id": "gemma", "token_ids": PROMPT,
                                                 "include_storage": False})["hosts"]  # fmt: skip
        assert [(h["host_ip_port"], h["local"]) for h in hosts] == [("pod-a", 40)]
        located = kv.call("get_cache_location", {"instance_id": "gemma", "query_type": "prefix_match",
                                                 "token_ids": PROMPT, "include_engines": True})["engine_locations"]  # fmt: skip
        assert [bool(held) for held in located] == [True] * 40 + [False] * 60


def test_routers_doc_hybrid_example() -> None:
    """docs/routers.md's hybrid example, run as written against a real server and engine."""
    page = (ROOT / "docs" / "routers.md").read_text()
    code = re.search(r"<!-- test: by tests/engines/test_hybrid.py::test_routers_doc_hybrid_example -->\n```python\n(.*?)```",
                     page, re.S)  # fmt: skip
    assert code, "the example block is gone from docs/routers.md"
    with gemma_pod() as (endpoint, _):
        scope = {"endpoint": endpoint, "prompt_token_ids": PROMPT}
        exec(compile(code.group(1), "docs/routers.md", "exec"), scope)
        assert scope["reusable_tokens"] == 640
        assert scope["held"] == {"full_attention": 100, "sliding_window": 40}


def _push_event(ev: Any) -> dict[str, Any]:
    """A vLLM-shaped store or removal as a push ``report_events`` event."""
    if isinstance(ev, BlockRemoved):
        return {"type": "remove", "block_hashes": ev.block_hashes, "group_idx": ev.group_idx}
    return {"type": "add", "block_hashes": ev.block_hashes, "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids), "block_size": ev.block_size, "group_idx": ev.group_idx,
            "kv_cache_spec_kind": ev.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": ev.kv_cache_spec_sliding_window}  # fmt: skip


def test_a_push_source_declares_its_window_and_is_matched_as_a_hybrid_source() -> None:
    """report_events carries kv_cache_spec_sliding_window as vLLM's BlockStored does: a pushed
    Gemma 3 stream whose window lost its newest 60 blocks answers 40, with the window shown."""
    gemma = Engine(GEMMA3)
    with serve_in_thread() as server, server.client() as kv:
        kv.call("register_instance", {"instance_group": "default", "instance_id": "gemma", "block_size": B,
                                      "location_spec_infos": [{"name": "tp0", "size": 1024}]})  # fmt: skip
        kv.call("report_events", {"source_id": "gemma/pod-a", "op": "register", "instance_id": "gemma"})
        events = [*gemma.request(100), gemma.remove(1, range(40, 100))]
        kv.call("report_events", {"source_id": "gemma/pod-a", "op": "events", "seq": 0,
                                  "events": [_push_event(ev) for ev in events]})  # fmt: skip
        (found,) = kv.call("match_engines", {"instance_id": "gemma", "token_ids": PROMPT})["sources"]
        assert found["matched_blocks"] == 40
        assert [(g["kind"], g.get("window"), g["held_blocks"]) for g in found["groups"]] == [
            ("full_attention", None, 100), ("sliding_window", 1024, 40)]


def test_the_cost_of_a_default_query_grows_with_the_hybrid_slots_it_answers_for() -> None:
    """A default match_engines over a table with hybrid sources is costed per key and hybrid slot
    (kvcm.api.costs), so a request whose hybrid answer would pass the turn budget is refused with
    the key count that fits; naming one group_idx costs the plain walk only."""
    from kvcm.api.costs import US_PER_KEY

    budget_ms = 20.0
    with serve_in_thread(overrides={"server": {"turn_budget_ms": budget_ms}}) as server, server.client() as kv:
        kv.call("register_instance", {"instance_group": "default", "instance_id": "gemma", "block_size": B,
                                      "location_spec_infos": [{"name": "tp0", "size": 1024}]})  # fmt: skip
        keys = list(range(1, 20_001))
        plain = budget_ms * 1000 / US_PER_KEY["match_engines"]
        assert len(keys) < plain  # without hybrid sources the request fits
        kv.call("match_engines", {"instance_id": "gemma", "block_keys": keys})
        sources = 8
        for i in range(sources):
            kv.call("report_events", {"source_id": f"gemma/pod-{i}", "op": "register", "instance_id": "gemma"})
            kv.call("report_events", {"source_id": f"gemma/pod-{i}", "op": "events", "seq": 0,
                                      "events": [_push_event(ev) for ev in Engine(GEMMA3).request(4)]})  # fmt: skip
        per_key = US_PER_KEY["match_engines"] + US_PER_KEY["hybrid"] + 2 * sources * US_PER_KEY["hybrid_slot"]
        fits = int(budget_ms * 1000 / per_key)
        assert fits < len(keys)
        with pytest.raises(KvcmError) as refused:
            kv.call("match_engines", {"instance_id": "gemma", "block_keys": keys}, retry=False)
        assert refused.value.code is Code.TOO_LARGE and f"send at most {fits} keys" in refused.value.message
        kv.call("match_engines", {"instance_id": "gemma", "block_keys": keys[:fits]})
        kv.call("match_engines", {"instance_id": "gemma", "block_keys": keys, "group_idx": 0})


def test_a_routed_prompt_on_a_hybrid_source_keeps_its_groups_detail() -> None:
    """note_routed over the gemma pod's whole prompt: the entry is speculative past the 40 blocks
    it can reuse, and still says why it reuses 40 (its groups), as without the note."""
    with gemma_pod() as (_, kv):
        kv.call("note_routed", {"instance_id": "gemma", "source_id": "pod-a", "token_ids": PROMPT, "ttl_s": 30})
        (found,) = kv.call("match_engines", {"instance_id": "gemma", "token_ids": PROMPT})["sources"]
        assert found["speculative"] is True and found["matched_blocks"] == 100
        assert found["speculative_blocks"] == 60 and found["media"] == {"GPU": 40}
        assert [(g["kind"], g["held_blocks"], g["reusable_blocks"]) for g in found["groups"]] == [
            ("full_attention", 100, 100), ("sliding_window", 40, 40)]

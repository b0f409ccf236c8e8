"""The compiled block hash (``server.hash_kernel = "numba"``): the same bits as the Python forms,
Python for what it declines, and a server configured for it hashing reports, queries and writes."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm.backends.metastore import MemoryStore
from kvcm.cache import hash_kernel as kernel
from kvcm.cache import keys
from kvcm.cache.keys import ChainHasher, token_ids_to_block_keys
from kvcm.config import ConfigError, load
from kvcm.engines.hashing import chain_states, chain_states_many
from kvcm.engines.service import EngineService
from kvcm.engines.sources import SourceSpec
from kvcm.proto.kv_events import BlockStored, DecodedBatch, encode_batch
from kvcm.testing import make_test_config, serve_in_thread
from tests.helpers import register

M64 = (1 << 64) - 1


@pytest.fixture
def python_only() -> Iterator[None]:
    """The Python forms while the test runs, and after it (the kernel is process-wide)."""
    keys.set_native(None)
    yield
    keys.set_native(None)


def python_states(seeds: list[int], lists: list[list[int]], step: int) -> list[list[int]]:
    keys.set_native(None)
    return chain_states_many(seeds, lists, step)


chains = st.lists(
    st.tuples(st.integers(-(1 << 63), M64), st.lists(st.integers(0, (1 << 32) - 1), max_size=80)), max_size=6
)


@settings(max_examples=200, deadline=None)
@given(chains, st.integers(1, 20))
def test_kernel_gives_the_python_states(chain_list: list[tuple[int, list[int]]], step: int) -> None:
    seeds = [s for s, _ in chain_list]
    lists = [t[: len(t) // step * step] for _, t in chain_list]  # whole blocks, as every caller passes
    try:
        expected = python_states(seeds, lists, step)
        assert kernel.states_many(seeds, lists, step) == expected
        kernel.load()
        assert chain_states_many(seeds, lists, step) == expected  # the hook takes the kernel
    finally:
        keys.set_native(None)


@pytest.mark.parametrize("token", [0, 1, 127, 128, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1])
@pytest.mark.parametrize("seed", [0, 1, -1, -(1 << 63), (1 << 63) - 1, M64, 0x9E3779B97F4A7C15])
def test_edge_tokens_and_seeds(python_only: None, token: int, seed: int) -> None:
    lists = [[token] * 32, [token, 5] * 16]
    assert kernel.states_many([seed, seed ^ 1], lists, 16) == python_states([seed, seed ^ 1], lists, 16)


def test_engine_chains_are_token_ids_to_block_keys(python_only: None) -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(200_000) for _ in range(64 * 16)]
    expected = token_ids_to_block_keys(tokens, 16)
    kernel.load()
    assert chain_states(0, tokens, 16) == expected  # long: the kernel
    assert chain_states_many([0, 0], [tokens, tokens[:48]], 16) == [expected, expected[:3]]


@pytest.mark.heavy
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 600), max_size=6), st.sampled_from([1, 3, 16, 64, 300]), st.randoms(use_true_random=False))
def test_a_prompt_fed_in_slices_gets_the_python_keys(cuts: list[int], block_size: int, rng: random.Random) -> None:
    """``ChainHasher.feed`` hands whole blocks of a long slice to the kernel and finishes a
    started block, and the rest, in Python: the keys never depend on where the slices fall."""
    tokens = [rng.randrange(1 << 32) for _ in range(sum(cuts) + rng.randrange(0, 40))]
    keys.set_native(None)
    expected = token_ids_to_block_keys(tokens, block_size)
    try:
        kernel.load()
        hasher, at = ChainHasher(block_size), 0
        for n in [*cuts, len(tokens)]:
            hasher.feed(tokens[at : at + n])
            at = min(len(tokens), at + n)
        assert hasher.keys == expected
        assert token_ids_to_block_keys(tokens, block_size) == expected
    finally:
        keys.set_native(None)


@pytest.mark.parametrize("bad", [1 << 32, -1, 1 << 64, -(1 << 70)])
def test_ids_outside_32_bits_are_declined_and_hashed_in_python(python_only: None, bad: int) -> None:
    rng = random.Random(4)
    lists = [[rng.randrange(1000) for _ in range(320)] for _ in range(3)]
    lists[1][7] = bad
    assert kernel.states_many([1, 2, 3], lists, 16) is None
    expected = python_states([1, 2, 3], lists, 16)
    prompt = token_ids_to_block_keys(lists[1], 16)
    kernel.load()
    assert chain_states_many([1, 2, 3], lists, 16) == expected
    assert chain_states(2, lists[1], 16) == expected[1]
    assert token_ids_to_block_keys(lists[1], 16) == prompt


def test_the_hooks_take_long_lists_and_drains(python_only: None) -> None:
    calls: list[int] = []

    def marked(seeds, lists, step):  # type: ignore[no-untyped-def]
        calls.append(len(seeds))
        return [[7] * (len(t) // step) for t in lists]

    keys.set_native(marked)
    assert chain_states(0, [1] * 256, 16) == [7] * 16  # a long chain
    assert chain_states(0, [1] * 32, 16) != [7, 7]  # a short one: the Python loop
    assert chain_states_many([0, 1], [[1] * 32, [2] * 16], 16) == [[7, 7], [7]]  # a drain, however short
    assert token_ids_to_block_keys([1] * 260, 16) == [7] * 16  # a prompt's whole blocks
    assert token_ids_to_block_keys([1] * 32, 16) != [7, 7]
    assert calls == [1, 2, 1]
    keys.set_native(lambda seeds, lists, step: None)  # declined: the Python forms answer
    assert chain_states_many([0, 1], [[1] * 32, [2] * 16], 16) == python_states([0, 1], [[1] * 32, [2] * 16], 16)


def test_index_batches_apply_alike_in_both_forms(python_only: None) -> None:
    """A drain of chained batches from several sources: the same holders either way."""
    rng = random.Random(6)
    items = []
    parents: dict[str, int] = {}
    for i in range(24):
        source = f"pod-{i % 4}"
        hashes = list(range(1 + 32 * i, 33 + 32 * i))
        tokens = [rng.randrange(150_000) for _ in range(32 * 16)]
        items.append((source, BlockStored(hashes, parents.get(source), tokens, 16, None, "GPU", None)))
        parents[source] = hashes[-1]

    def holders(compiled: bool) -> dict[int, int]:
        keys.set_native(kernel.states_many if compiled else None)
        svc = EngineService(MemoryStore(), lambda _: 16)
        try:
            gens = {f"pod-{j}": svc.index.add_source(SourceSpec(f"pod-{j}", "inst", f"tcp://127.0.0.1:{j + 1}")).generation
                    for j in range(4)}  # fmt: skip
            svc.index.apply_many([(s, gens[s], seq, DecodedBatch(1.0, [ev])) for seq, (s, ev) in enumerate(items)])
            return dict(svc.index._tables[("inst", "")].holders)
        finally:
            svc.stop()

    python, compiled = holders(False), holders(True)
    assert python == compiled and len(python) == 24 * 32


def _register(kv: Any) -> None:
    register(kv, block_size=16, specs=[{"name": "tp0", "size": 64}])


def test_a_server_configured_for_numba_hashes_reports_queries_and_writes_alike(python_only: None) -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(150_000) for _ in range(40 * 16)]
    expected = token_ids_to_block_keys(tokens, 16)  # Python, before the server loads the kernel
    payload = encode_batch([BlockStored(list(range(1, 41)), None, tokens, 16, None, "GPU", None)], 1.0, 0, "mixed")
    with serve_in_thread(overrides={"server": {"hash_kernel": "numba"}}) as server, server.client() as kv:
        assert keys.native_states() is kernel.states_many  # loaded at start-up
        _register(kv)
        kv.call("report_events", {"source_id": "pod-a", "op": "register", "instance_id": "inst"})
        kv.call("report_events", {"source_id": "pod-a", "op": "payloads", "payloads": [{"seq": 0, "payload": payload}]})
        by_tokens = kv.call("match_engines", {"instance_id": "inst", "token_ids": tokens})
        by_keys = kv.call("match_engines", {"instance_id": "inst", "block_keys": expected})
        assert [(s["source_id"], s["matched_blocks"]) for s in by_tokens["sources"]] == [("pod-a", 40)]
        assert by_keys["sources"] == by_tokens["sources"]
        session = kv.call("start_write_cache", {"instance_id": "inst", "token_ids": tokens})
        kv.call("finish_write_cache", {"instance_id": "inst", "write_session_id": session["write_session_id"],
                                       "success_blocks": {"offset": len(session["locations"])}})  # fmt: skip
        hit = kv.call("get_cache_location", {"instance_id": "inst", "query_type": "prefix_match", "block_keys": expected})
        assert len(hit["locations"]) == 40  # written under the keys Python derives


def test_numba_missing_is_a_start_up_error(python_only: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import kvcm.cache
    from kvcm.node.app import App

    monkeypatch.delattr(kvcm.cache, "hash_kernel", raising=False)
    monkeypatch.setitem(sys.modules, "kvcm.cache.hash_kernel", None)  # importing it raises ImportError
    config = make_test_config(str(tmp_path / "data"), f"ipc://{tmp_path}/rpc", {"server": {"hash_kernel": "numba"}})
    with pytest.raises(ConfigError, match=r"server\.hash_kernel = numba needs numba and numpy \(pip install 'kvcm\[fast\]'\)"):
        App(config)
    assert keys.native_states() is None


def test_server_hash_kernel_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"server\.hash_kernel must be python or numba"):
        load(environ={}, overrides={"server": {"hash_kernel": "cython"}})


def test_a_kernel_that_cannot_be_built_is_a_start_up_error(python_only: None, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Any) -> None:
    from kvcm.node.app import App

    def broken() -> None:
        raise RuntimeError("no LLVM target")

    monkeypatch.setattr(kernel, "load", broken)
    config = make_test_config(str(tmp_path / "data"), f"ipc://{tmp_path}/rpc", {"server": {"hash_kernel": "numba"}})
    with pytest.raises(ConfigError, match="the kernel could not be built: RuntimeError: no LLVM target"):
        App(config)
    assert keys.native_states() is None

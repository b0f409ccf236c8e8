#!/usr/bin/env python3
"""A KV connector shaped like vLLM's ``KVConnectorBase_V1`` save/load pair, on kvcm.

No vLLM needed: a toy "engine" with a paged KV cache (one bytearray per block and TP rank)
drives the same hooks vLLM calls, in the same order, on the same two sides:

* scheduler side: ``get_num_new_matched_tokens`` (how many prompt tokens kvcm can supply),
  ``update_state_after_alloc`` (remember what to load), ``request_finished`` (what to save);
* worker side: ``start_load_kv`` (read the cached blocks into the paged cache),
  ``save_kv_layer`` / ``wait_for_save`` (write the request's new blocks).

Run it as is and it starts its own kvcm (in this process, in a temp dir); or point it at a
running server with ``--endpoint``. It serves one prompt (nothing cached: computes, saves), then
the same prompt again (all whole blocks cached: loads them instead of computing, and checks the
bytes), then a prompt that shares only a prefix.

    python3 examples/connector.py [--endpoint tcp://127.0.0.1:6381]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvcm.connector import Connector

BLOCK = 16  # tokens per block (vLLM's block_size)
RANKS = ("tp0", "tp1")  # one spec per tensor-parallel rank
BYTES = 2048  # KV bytes per block and rank


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0


@dataclass
class PagedKV:
    """The engine's KV cache: block id -> one buffer per rank. ``compute`` stands for the model."""

    blocks: dict[int, dict[str, bytearray]] = field(default_factory=dict)
    computed: int = 0  # blocks the "model" had to compute

    def allocate(self, n: int) -> list[int]:
        first = len(self.blocks)
        for i in range(first, first + n):
            self.blocks[i] = {rank: bytearray(BYTES) for rank in RANKS}
        return list(range(first, first + n))

    def compute(self, block_id: int, tokens: list[int]) -> None:
        self.computed += 1
        for rank in RANKS:
            self.blocks[block_id][rank][:] = kv_bytes(tokens, rank)


def kv_bytes(tokens: list[int], rank: str) -> bytes:
    """What the "model" computes for one block: a function of the prefix, as real KV is."""
    seed = hashlib.sha256(f"{rank}:{tokens}".encode()).digest()
    return (seed * (BYTES // len(seed)))[:BYTES]


class KvcmConnector:
    """The two sides of a vLLM KV connector over ``kvcm.Connector`` (one process here; in vLLM
    the scheduler and each worker rank hold their own instance)."""

    def __init__(self, endpoint: str, kv: PagedKV) -> None:
        self.kvcm = Connector(endpoint, instance_id="example-llm", block_size=BLOCK,
                              specs={rank: BYTES for rank in RANKS}, model_deployment={"model_name": "toy", "tp_size": 2})
        self.kv = kv
        self._load: dict[str, list[int]] = {}  # request -> block ids to fill from kvcm

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvcm can supply (never the last token:
        the engine must compute at least one to sample from), and whether loading is async."""
        cached = self.kvcm.lookup(request.prompt_token_ids[:-1]).tokens
        return max(0, cached - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self._load[request.request_id] = block_ids[: num_external_tokens // BLOCK]

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """The request is done: save its whole blocks that kvcm does not have yet."""
        self.save(request, block_ids)

    # -- worker side ---------------------------------------------------------------------------

    def start_load_kv(self, request: Request) -> int:
        """Read the cached prefix straight into the paged cache's buffers; blocks loaded."""
        ids = self._load.pop(request.request_id, [])
        blocks = self.kvcm.read(request.prompt_token_ids[: len(ids) * BLOCK])
        for block, block_id in zip(blocks, ids):
            for rank in RANKS:
                block.read_into(rank, self.kv.blocks[block_id][rank])
        return len(blocks)

    def save(self, request: Request, block_ids: list[int]) -> dict[str, int]:
        """``save_kv_layer`` for every layer then ``wait_for_save``, folded into one call: write
        each new block's bytes of every rank; the session finishes with exactly those."""
        with self.kvcm.begin_write(request.prompt_token_ids) as write:
            for block in write.new_blocks:
                for rank in RANKS:
                    block.write(rank, self.kv.blocks[block_ids[block.index]][rank])
        return write.result or {}

    def close(self) -> None:
        self.kvcm.close()


def serve(engine: KvcmConnector, kv: PagedKV, request: Request) -> tuple[int, int]:
    """One request through the hooks, as vLLM's scheduler and workers would call them;
    returns (blocks loaded from kvcm, blocks computed)."""
    external, _ = engine.get_num_new_matched_tokens(request, 0)
    block_ids = kv.allocate(len(request.prompt_token_ids) // BLOCK)
    engine.update_state_after_alloc(request, block_ids, external)
    loaded = engine.start_load_kv(request)
    before = kv.computed
    tokens = request.prompt_token_ids
    for i, block_id in enumerate(block_ids):
        block_tokens = tokens[: (i + 1) * BLOCK]
        if i < loaded:
            for rank in RANKS:  # loaded, not computed: it must be exactly what the model makes
                assert kv.blocks[block_id][rank] == kv_bytes(block_tokens, rank), "loaded bytes differ"
        else:
            kv.compute(block_id, block_tokens)
    engine.request_finished(request, block_ids)
    return loaded, kv.computed - before


@contextlib.contextmanager
def kvcm_endpoint(endpoint: str | None) -> Iterator[str]:
    if endpoint:
        yield endpoint
        return
    from kvcm.testing import serve_in_thread  # a real kvcm in this process, in a temp dir

    with serve_in_thread() as server:
        yield server.endpoint


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="a running kvcm (default: start one here)")
    args = parser.parse_args()
    prompt = list(range(7, 7 + 100))  # 100 tokens: 6 whole blocks
    with kvcm_endpoint(args.endpoint) as endpoint:
        kv = PagedKV()
        engine = KvcmConnector(endpoint, kv)
        try:
            for request_id, tokens in (("first", prompt), ("again", prompt), ("shared-prefix", prompt[:64] + [1] * 40)):
                loaded, computed = serve(engine, kv, Request(request_id, tokens))
                print(f"{request_id:13s}: {loaded} block(s) loaded from kvcm, {computed} computed")
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

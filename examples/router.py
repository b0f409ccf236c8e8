#!/usr/bin/env python3
"""A KV-aware router on kvcm's engine tier, with the asyncio client.

Two fake vLLM engines (real ZMQ PUB sockets publishing vLLM's KV events, as
``--kv-events-config`` makes vLLM do) hold different prompt prefixes in their GPU caches; kvcm
subscribes to both. For each incoming prompt the router asks kvcm which engine holds the longest
prefix (``match_engines``) — many prompts in flight on one socket from one asyncio task — and
sends the prompt there, breaking ties by the engine's current load.

Run it as is and it starts its own kvcm (in this process, in a temp dir); or point it at a
running server (admin rights needed to add the event sources) with ``--endpoint``.

    python3 examples/router.py [--endpoint tcp://127.0.0.1:6381]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections import Counter
from collections.abc import Iterator

import kvcm.aio
from kvcm.testing import FakeEnginePublisher

BLOCK = 16
INSTANCE = "router-llm"
SYSTEM = list(range(1, 1 + 4 * BLOCK))  # a shared system prompt: 4 blocks


def prompt(user: int) -> list[int]:
    """The system prompt, then 2 blocks of one user's conversation."""
    return SYSTEM + [10_000 + user * 100 + i for i in range(2 * BLOCK)]


async def route(kv: kvcm.aio.Client, tokens: list[int], load: Counter[str]) -> tuple[str, int]:
    """The engine to send ``tokens`` to: most blocks already cached, then least loaded."""
    reply = await kv.match_engines(instance_id=INSTANCE, token_ids=tokens, timeout=2.0)
    held = {s.source_id: s.matched_blocks for s in reply.sources}
    engine = max(("engine-a", "engine-b"), key=lambda e: (held.get(e, 0), -load[e]))
    load[engine] += 1
    return engine, held.get(engine, 0)


async def run(endpoint: str, engines: dict[str, FakeEnginePublisher]) -> int:
    async with kvcm.aio.Client(endpoint) as kv:
        await kv.register_instance(instance_group="default", instance_id=INSTANCE, block_size=BLOCK,
                                   location_spec_infos=[{"name": "tp0", "size": 4096}],
                                   model_deployment={"model_name": "toy"})
        for name, engine in engines.items():
            await kv.add_event_source(source_id=name, instance_id=INSTANCE, endpoint=engine.endpoint,
                                      replay_endpoint=engine.replay_endpoint)
        # engine-a has served users 0-9 (system prompt + their turns), engine-b users 10-19
        for name, users in (("engine-a", range(10)), ("engine-b", range(10, 20))):
            for user in users:
                tokens = prompt(user)
                # block hashes are the engine's own ids: the system prompt's 4, then the user's 2
                engines[name].store([1, 2, 3, 4, 100 + 2 * user, 101 + 2 * user], tokens, block_size=BLOCK)
        await wait_until_indexed(kv)

        load: Counter[str] = Counter()
        started = time.perf_counter()
        users = list(range(20)) * 5  # 100 requests in flight at once, from this one task
        decisions = await asyncio.gather(*(route(kv, prompt(u), load) for u in users))
        took = time.perf_counter() - started
        right = sum(engine == ("engine-a" if u < 10 else "engine-b") for u, (engine, _) in zip(users, decisions))
        hits = sum(blocks for _, blocks in decisions)
        print(f"{len(users)} prompts routed in {took * 1000:.0f} ms: {right} to the engine holding their "
              f"prefix, {hits} of {len(users) * 6} blocks cached where they went; load {dict(load)}")
        return 0 if right == len(users) else 1


async def wait_until_indexed(kv: kvcm.aio.Client, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        a = await kv.match_engines(instance_id=INSTANCE, token_ids=prompt(0))
        b = await kv.match_engines(instance_id=INSTANCE, token_ids=prompt(19))
        if a.sources and b.sources and a.sources[0].matched_blocks == 6 == b.sources[0].matched_blocks:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("kvcm never indexed the engines' blocks")


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
    with kvcm_endpoint(args.endpoint) as endpoint, FakeEnginePublisher().start() as a, \
            FakeEnginePublisher().start() as b:
        return asyncio.run(run(endpoint, {"engine-a": a, "engine-b": b}))


if __name__ == "__main__":
    sys.exit(main())

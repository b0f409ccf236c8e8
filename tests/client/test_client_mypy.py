"""The typed clients type-check: a program using both passes ``mypy --strict``, and a program
that misuses a result or an argument is rejected."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import kvcm

ROOT = pathlib.Path(kvcm.__file__).resolve().parent.parent

GOOD = '''
from __future__ import annotations

import asyncio

import kvcm
import kvcm.aio
from kvcm.proto.results import CacheLocations, Mask, SpecInfo


def lookup(kv: kvcm.Client, keys: list[int]) -> int:
    kv.register_instance(instance_group="default", instance_id="m", block_size=4,
                         location_spec_infos=[SpecInfo("tp0", 1024)])
    reply: CacheLocations = kv.get_cache_location(instance_id="m", query_type="prefix_match", block_keys=keys,
                                                  block_mask=Mask(offset=1))
    uris: list[str] = [spec.uri for loc in reply.locations for spec in loc.location_specs]
    session = kv.start_write_cache(instance_id="m", block_keys=keys)
    done = kv.finish_write_cache(instance_id="m", write_session_id=session.write_session_id,
                                 success_blocks=Mask(offset=len(session.locations)))
    return len(uris) + done.served + kv.pin_cache(instance_id="m", block_keys=keys, ttl_seconds=5.0).pinned


async def routed(kv: kvcm.aio.Client, tokens: list[int]) -> list[str]:
    matches = await kv.match_engines(instance_id="m", token_ids=tokens, limit=2)
    health = await kv.check_health(timeout=1.0)
    locs = await asyncio.gather(*(kv.get_cache_location(instance_id="m", query_type="batch_get",
                                                        block_keys=[k]) for k in tokens))
    raw = await kv.call("whoami")
    return [s.source_id for s in matches.sources] + [health.status, str(len(locs)), str(raw)]


async def main() -> None:
    async with kvcm.aio.Client("ipc:///nowhere", timeout=0.1) as kv:
        await routed(kv, [1, 2, 3])
'''

BAD = '''
from __future__ import annotations

import kvcm
import kvcm.aio


def wrong(kv: kvcm.Client) -> str:
    reply = kv.get_cache_location(instance_id="m", query_type="prefix_match", block_keys=[1])
    return reply.locations[0].spec_size


def missing(kv: kvcm.Client) -> None:
    kv.pin_cache(instance_id="m", block_keys=[1])


async def not_awaited(kv: kvcm.aio.Client) -> int:
    health = kv.check_health()
    return health.counts["storage"]
'''


def run_mypy(tmp_path: pathlib.Path, source: str) -> subprocess.CompletedProcess[str]:
    program = tmp_path / "program.py"
    program.write_text(source)
    env = {**os.environ, "MYPYPATH": str(ROOT)}  # this tree's kvcm, whatever is installed
    return subprocess.run(
        # the project's config: kvcm's own settings (msgpack has no stubs), --strict on top
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--strict", "--no-incremental",
         "--cache-dir", str(tmp_path / "cache"), str(program)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )


def test_typed_client_program_passes_mypy_strict(tmp_path: pathlib.Path) -> None:
    done = run_mypy(tmp_path, GOOD)
    assert done.returncode == 0, done.stdout + done.stderr


def test_misuse_is_rejected_by_mypy(tmp_path: pathlib.Path) -> None:
    done = run_mypy(tmp_path, BAD)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert 'Incompatible return value type (got "int", expected "str")' in out, out
    assert 'Missing named argument "ttl_seconds"' in out, out
    assert '"Coroutine[Any, Any, Health]" has no attribute "counts"' in out, out

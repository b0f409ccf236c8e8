"""scripts/bench_floor runs (docs/benchmarks.md quotes it): one tiny round prints the in-process
split and one line per server and client, each reply checked by the bench itself, and the
ratios when a redis-server is found. The figures are the benchmark's, not asserted here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from kvcm.testing.redis_server import NoRedisServer, find_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _has_redis() -> bool:
    try:
        find_server()
    except NoRedisServer:
        return False
    return True


def test_bench_floor_prints_every_figure():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_floor"), "--blocks", "2560", "--requests", "300",
         "--rounds", "1", "--clients", "2", "--seconds", "0.2"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(re.match(r"floor 64 keys, in process: Dispatcher.serve [\d.]+ us/request", line) for line in lines), lines
    figures = {line.split(":")[0].strip() for line in lines if re.search(r": +[\d.]+ us/request \(worst round", line)}
    rates = {line.split(":")[0].strip() for line in lines if re.search(r": +\d+ req/s \(worst round \d+\)", line)}
    wanted = {"echo, bare DEALER", "handler alone, bare DEALER", "kvcm, bare DEALER", "kvcm, typed kvcm.Client"}
    if _has_redis():
        wanted.add("redis MGET")
        for head in ("floor 64 keys, redis / typed kvcm", "floor 64 keys, 2 clients, typed kvcm / redis"):
            assert any(re.match(re.escape(head) + r": median [\d.]+x, worst round [\d.]+x; the ceiling", line)
                       for line in lines), lines
    assert figures == {f"floor 64 keys, {name}" for name in wanted}, lines
    assert rates == {f"floor 64 keys, 2 clients, {name}" for name in wanted}, lines

"""scripts/bench_events --memory runs (docs/benchmarks.md quotes it): a tiny mix prints its
description, the holdings applied, RssAnon per holding and where the bytes go. The figure is the
benchmark's, not asserted here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_events_memory_prints_bytes_per_holding():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_events"), "--memory", "--holdings", "40000",
         "--memory-sources", "16"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    mix = re.search(r"^memory mix +: 16 sources;.*: ([\d,]+) holdings of ([\d,]+) distinct blocks$", out, re.M)
    assert mix, out
    applied = re.search(r"^memory holdings +: ([\d,]+) \(source, block\) holdings applied", out, re.M)
    assert applied and applied.group(1) == mix.group(1), out
    assert re.search(r"^memory RssAnon +: \+[\d,]+ MiB, [\d.]+ B per holding", out, re.M), out
    where = re.findall(r"^memory where +: (.+): ([\d.]+) B per holding", out, re.M)
    # a flushed index keeps its common blocks in compact maps, and every key in a key table
    found = dict(where)
    assert float(found["migrated blocks (compact source maps)"]) > 0, out
    assert float(found["holder tables (compact: key table, holder sets)"]) > 0, out
    assert "sum of the objects" in out, out

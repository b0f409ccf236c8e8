"""scripts/bench_memory runs (docs/storages.md and docs/capacity.md quote it): a small run against
a real server subprocess prints its figures, one line each. The figures at 1,000,000 blocks are
measured by the benchmark, not asserted here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RSS = "server anonymous RSS per block"
MARGINAL = "server anonymous RSS per block, marginal (second half)"


def test_bench_memory_prints_one_line_per_figure():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_memory"), "--blocks", "4000",
                           "--batch", "32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = {}
    for line in proc.stdout.splitlines():
        found = re.fullmatch(r"([A-Za-z +,()]+): (-?[\d.]+)( B)?", line)
        if found:
            figures[found.group(1)] = float(found.group(2))
    assert set(figures) == {"metadata bytes per block on disk", "metadata bytes per block in used pages",
                            "metadata bytes per block, blocks + runs databases", "files in the storage",
                            RSS, MARGINAL}, proc.stdout
    assert 0 < figures["metadata bytes per block, blocks + runs databases"] <= figures["metadata bytes per block on disk"]
    assert figures["files in the storage"] >= 1
    # the server's heap grows with the blocks it was sent: at least a reclaimer entry each (a
    # figure read from another process would be about 0), and by no absurd amount
    assert 16 < figures[RSS] < 20_000, proc.stdout
    readings = re.search(r"^# server RssAnon: ([\d.]+) MiB after the first request, ([\d.]+) MiB at \d+ blocks, "
                         r"([\d.]+) MiB at 4000; RssFile [\d.]+ MiB$", proc.stdout, re.M)
    assert readings, proc.stdout
    start, half, end = map(float, readings.groups())
    assert start < half < end, proc.stdout  # three readings, each after more blocks

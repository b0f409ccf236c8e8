"""scripts/bench_long runs (docs/benchmarks.md quotes it): one tiny round prints one line per
figure, each query's reply checked by the bench itself. The figures are the benchmark's, not
asserted here (its exit status says whether the targets were met: either is fine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_long_prints_one_line_per_figure():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_long"),
            "--blocks",
            "300",
            "--long",
            "1500",
            "--sources",
            "5",
            "--rounds",
            "2",
            "--calls",
            "3",
            "--full",
            "1000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    figures = [line for line in lines if re.match(r"long \w.* : p50 +[\d.]+ ms  p99 +[\d.]+ ms  worst round", line)]
    names = [line.split(":")[0].strip() for line in figures]
    assert names == [
        "long match_engines 300 blocks",
        "long prefix_match length-only 300 blocks",
        "long prefix_match length-only 1,500 blocks",
        "long match_engines 1,500 blocks",
        "long prefix_match full locations 1,000 blocks, typed",
        "long prefix_match full locations 1,000 blocks, typed, every URI",
        "long prefix_match full locations 1,000 blocks, call()",
    ], lines
    assert all("rounds: " in line for line in figures) and sum("target p50 <=" in line for line in figures) == 4, lines
    assert lines[0].startswith("long setup: 1,500 blocks written, 5 push sources reported"), lines

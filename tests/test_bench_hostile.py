"""scripts/bench_hostile runs (docs/limits.md quotes it): one short round of two scenarios prints
its figures. The figures themselves are measured by the benchmark, not asserted here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_hostile_prints_one_line_per_figure():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_hostile"), "--only",
                           "costs,tokens_3_9m", "--seconds", "0.5", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    costs = [line for line in lines if line.startswith("hostile costs ")]
    assert len(costs) == 7 and all(re.search(r": +[\d.]+ us per key", line) for line in costs), lines
    attacked = [line for line in lines if line.startswith("hostile tokens_3_9m")]
    assert len(attacked) == 3 and all("ms attacked" in line for line in attacked[:2]), lines
    assert "worst round" in attacked[1] and "target" in attacked[2], lines

"""scripts/bench_hostile runs (docs/limits.md quotes it): one short round of two scenarios prints
its figures. The figures themselves are measured by the benchmark, not asserted here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from kvcm.api.costs import US_PER_KEY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_hostile_prints_one_line_per_figure():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_hostile"), "--only",
                           "costs,tokens_3_9m", "--seconds", "0.5", "--rounds", "1", "--cost-keys", "2000",
                           "--cost-sources", "5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    costs = dict(re.findall(r"^hostile costs (.+?) *: +(-?[\d.]+) us per ", proc.stdout, re.M))
    # every entry of the dispatcher's cost table is measured, under its own name
    measured = {*US_PER_KEY, "pin_cache_held", "start_write_cache_file_per_block", "match_engines option"}
    assert measured <= set(costs), (sorted(measured - set(costs)), lines)
    assert all(float(v) >= 0 for v in costs.values()), lines
    attacked = [line for line in lines if line.startswith("hostile tokens_3_9m")]
    assert len(attacked) == 3 and all("ms attacked" in line for line in attacked[:2]), lines
    assert "worst round" in attacked[1] and "target" in attacked[2], lines

"""scripts/bench_memory runs (docs/storages.md quotes it): a small run prints its figures, one
line each. The figures at 1,000,000 blocks are measured by the benchmark, not asserted here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_memory_prints_one_line_per_figure():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_memory"), "--blocks", "300",
                           "--batch", "32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = {}
    for line in proc.stdout.splitlines():
        found = re.fullmatch(r"([a-z +,]+): ([\d.]+)", line)
        if found:
            figures[found.group(1)] = float(found.group(2))
    assert set(figures) == {"metadata bytes per block on disk", "metadata bytes per block in used pages",
                            "metadata bytes per block, blocks + runs databases", "files in the storage"}, proc.stdout
    assert 0 < figures["metadata bytes per block, blocks + runs databases"] <= figures["metadata bytes per block on disk"]
    assert figures["files in the storage"] >= 1

"""Long soak runs, excluded from the default suite (``-m slow``); ``scripts/soak`` runs them."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("store", ["lmdb", "memory"])
def test_stress_index(store):
    done = subprocess.run([sys.executable, str(HERE / "stress_index.py"), "--seed", "7", "--ops", "20000",
                           "--store", store], capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_stress_radix():
    done = subprocess.run([sys.executable, str(HERE / "stress_radix.py"), "--seed", "7", "--iterations", "50000"],
                          capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

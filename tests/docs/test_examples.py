"""The runnable examples run: each as a subprocess from the repository's root, exactly as the
docs show the command, each starting its own kvcm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_connector_example():
    """docs/connectors.md: ``python3 examples/connector.py``."""
    lines = _run("examples/connector.py").splitlines()
    assert lines == [
        "first        : 0 block(s) loaded from kvcm, 6 computed",
        "again        : 6 block(s) loaded from kvcm, 0 computed",
        "shared-prefix: 4 block(s) loaded from kvcm, 2 computed",
    ]


def test_router_example():
    """docs/client.md: ``python3 examples/router.py``."""
    out = _run("examples/router.py")
    assert "100 prompts routed" in out
    assert "100 to the engine holding their prefix, 600 of 600 blocks cached where they went" in out
    assert "'engine-a': 50, 'engine-b': 50" in out

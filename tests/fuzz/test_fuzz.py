"""Fuzzing: the saved corpus and crashes replay cleanly, and a short
coverage-guided run of every target finds nothing.

The long runs (5 minutes a target) are ``scripts/fuzz``; this keeps what they found as
regression tests and proves the harness itself works.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.fuzz import targets

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)


def _saved_inputs(target: str) -> list[str]:
    corpus = os.path.join(HERE, "fuzz", "corpus", target)
    crashes = os.path.join(HERE, "fuzz", "crashes")
    paths = [os.path.join(corpus, name) for name in sorted(os.listdir(corpus))]
    if os.path.isdir(crashes):
        paths += [os.path.join(crashes, n) for n in sorted(os.listdir(crashes)) if n.startswith(f"{target}-")]
    return paths


@pytest.mark.parametrize("target", sorted(targets.TARGETS))
def test_saved_inputs_replay_cleanly(target):
    paths = _saved_inputs(target)
    assert len(paths) >= 5, f"the seed corpus of {target} is missing (scripts/fuzz --write-seeds)"
    check = targets.TARGETS[target]
    for path in paths:
        with open(path, "rb") as f:
            check(f.read())  # raises FuzzBug (or anything else) on a regression


def test_oracle_catches_an_internal_error():
    """The rpc oracle is not vacuous: a reply with INTERNAL_ERROR or IO_ERROR is a finding."""
    from kvcm.errors import Code
    from kvcm.proto import wire

    for code in (Code.INTERNAL_ERROR, Code.IO_ERROR):
        reply = wire.pack_response(1, {"code": int(code), "name": code.name, "message": "boom"}, None)
        with pytest.raises(targets.FuzzBug):
            targets._check_reply(b"request", reply)
    with pytest.raises(targets.FuzzBug):
        targets._check_reply(b"request", b"\x93\x01\x02\x03")  # not [1, msgid, error, result]
    targets._check_reply(b"request", wire.pack_response(1, {"code": 5, "name": "INVALID_ARGUMENT"}, None))


def test_structured_requests_are_deterministic():
    data = bytes(range(200))
    assert targets.structured_request(data) == targets.structured_request(data)
    assert len({targets.structured_request(bytes([i]) + data) for i in range(40)}) > 20


def test_short_coverage_guided_run_finds_nothing():
    pytest.importorskip("atheris")
    before = set(os.listdir(os.path.join(HERE, "fuzz", "crashes")))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fuzz"), "--seconds", "4"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == len(targets.TARGETS), proc.stdout
    for line in lines:
        execs = int(re.search(r":\s+(\d+) execs", line).group(1))
        assert execs > 1000, line
        assert "0 crash(es)" in line, line
    assert set(os.listdir(os.path.join(HERE, "fuzz", "crashes"))) == before

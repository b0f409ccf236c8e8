"""LoopThread: a failing iteration is logged and survived; the same failure again is one line
per REPEAT_LOG_S, not a traceback per iteration (a store away for minutes floods no log)."""

from __future__ import annotations

import logging
import time

import kvcm.threads
from kvcm.threads import LoopThread
from tests.helpers import wait_for


def test_the_same_failure_is_logged_once_then_counted(caplog, monkeypatch):
    monkeypatch.setattr(kvcm.threads, "REPEAT_LOG_S", 0.2)
    calls = []

    def body() -> None:
        calls.append(1)
        raise RuntimeError("store away" if len(calls) < 40 else "something else")

    loop = LoopThread("t", body, 0.01)
    with caplog.at_level(logging.ERROR, logger="kvcm.threads"):
        began = time.monotonic()
        loop.start()
        wait_for(lambda: len(calls) >= 45, timeout=10, interval=0.01)
        loop.stop()
    elapsed = time.monotonic() - began
    assert loop.alive is False and loop.failures == len(calls) >= 45
    records = [r for r in caplog.records if r.name == "kvcm.threads"]
    tracebacks = [r for r in records if r.exc_info]
    assert [str(r.exc_info[1]) for r in tracebacks] == ["store away", "something else"]  # once each
    repeats = [r for r in records if "still failing" in r.getMessage()]
    assert 1 <= len(repeats) <= elapsed / 0.2 + 1  # at most a line per 0.2 s of the same failure
    assert len(records) < len(calls) / 2

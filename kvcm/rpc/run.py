"""Running a turn's admitted requests: reads at once; writes inside one group commit, each in its
own savepoint, so a failing request rolls back alone and nothing is answered before the commit
that makes it durable. A full map that can still grow is grown and the group run once more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kvcm.errors import StoreFull
from kvcm.metrics import Metrics
from kvcm.rpc.outcome import Outcome

log = logging.getLogger("kvcm.rpc.dispatch")

#: ``wired(exc, where)``: the wire error a failure answers (counted and logged once).
Wired = Callable[[BaseException, str], dict[str, Any]]


class Runner:
    """Runs outcomes' handlers (see the module docstring)."""

    def __init__(self, metrics: Metrics, wired: Wired, group: Callable[[], AbstractContextManager[object]],
                 atomic: Callable[[], AbstractContextManager[object]], grow: Callable[[], bool] | None,
                 access_log: bool) -> None:
        self._metrics = metrics
        self._wired = wired
        self._group = group
        self._atomic = atomic
        self._grow = grow
        self._access_log = access_log

    def run(self, outcomes: list[Outcome], grouped: bool) -> None:
        """Run every outcome; ``grouped``: writes share group commits (else one commit each)."""
        if grouped:
            self._run_grouped(outcomes)
            return
        for outcome in outcomes:
            self._run_alone(outcome)

    def _run_grouped(self, outcomes: list[Outcome]) -> None:
        """Reads run at once; writes wait in one group that commits when it must (before a read
        of a peer with a write in it, and at the end) — so every reply follows its commit."""
        writes: list[Outcome] = []
        writers: set[bytes] = set()
        for outcome in outcomes:
            assert outcome.method is not None  # internal: the caller passes runnable outcomes
            if outcome.method.writes:
                writes.append(outcome)
                writers.add(outcome.peer)
                continue
            if outcome.peer in writers:
                self._commit_group(writes)
                writes, writers = [], set()
            self._execute(outcome)
        if writes:
            self._commit_group(writes)

    def _commit_group(self, writes: list[Outcome]) -> None:
        if not writes:
            return
        inputs = [o.params for o in writes]  # a retry starts from the requests again
        try:
            self._commit_once(writes)
            return
        except StoreFull as exc:
            failure: Exception = exc
            if self._grow is not None and self._grow():
                log.warning("metadata store full during a batch of %d writes: map grown, batch run again", len(writes))
                for outcome, params in zip(writes, inputs):
                    outcome.error, outcome.result, outcome.params = None, None, params
                try:
                    self._commit_once(writes)
                    return
                except Exception as again:  # noqa: BLE001
                    failure = again
        except Exception as exc:  # noqa: BLE001 - the shared commit failed: nothing was durable
            failure = exc
        wired = self._wired(failure, "commit")
        for outcome in writes:
            if outcome.error is None:
                outcome.error, outcome.result = wired, None

    def _commit_once(self, writes: list[Outcome]) -> None:
        with self._group():
            for outcome in writes:
                self._execute(outcome)
        self._metrics.commits.inc()

    def _run_alone(self, outcome: Outcome) -> None:
        assert outcome.method is not None  # internal: the caller passes runnable outcomes
        if not outcome.method.writes:
            self._execute(outcome)
            return
        self._commit_group([outcome])

    def run_read(self, outcome: Outcome) -> None:
        """Run one read now (the dispatcher's express lane): nothing to commit."""
        assert outcome.method is not None and not outcome.method.writes  # internal: reads only
        self._execute(outcome)

    def _execute(self, outcome: Outcome) -> None:
        method = outcome.method
        assert method is not None  # internal invariant: only called for resolved methods
        started = time.perf_counter()
        try:
            if method.writes:
                with self._atomic():
                    outcome.result = method.handler(outcome.params)
            else:
                outcome.result = method.handler(outcome.params)
        except Exception as exc:  # noqa: BLE001 - the single exception boundary of a request
            outcome.error, outcome.result = self._wired(exc, method.name), None
        elapsed = time.perf_counter() - started
        self._metrics.rpc.request(method.name, elapsed)
        if self._access_log:
            status = "ok" if outcome.error is None else outcome.error["name"]
            log.info("rpc %s %s %.0fus", method.name, status, elapsed * 1e6)

"""LoopThread: the one way kvcm runs a background loop (reclaimer, deleter, health, ...).

The body is a plain method (``run_once``-style) so tests can call it without a thread. The
thread names itself, survives and logs a failing iteration, and exits within one interval of
``stop()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kvcm.threads")


class LoopThread:
    """Runs ``body()`` every ``interval`` seconds on its own daemon thread until stopped."""

    def __init__(self, name: str, body: Callable[[], object], interval: float) -> None:
        self.name = name
        self._body = body
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvcm-{name}", daemon=True)
        self.iterations = 0
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._body()
            except Exception:
                self.failures += 1
                log.exception("%s: iteration failed", self.name)
            self.iterations += 1
            self._stop.wait(self._interval)

    def stop(self, timeout: float = 5.0) -> None:
        """Idempotent; joins the thread (if it was started) for up to ``timeout`` seconds."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s did not stop within %.1fs", self.name, timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

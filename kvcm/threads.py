"""LoopThread: the one way kvcm runs a background loop (reclaimer, deleter, health, ...).

The body is a plain method (``run_once``-style) so tests can call it without a thread. The
thread names itself, survives and logs a failing iteration, and exits within one interval of
``stop()``.

:class:`gc_paused`: the cyclic collector off for one bounded burst of work (a loop's wake-up, an
RPC turn), so it runs once after the burst instead of every few hundred allocations during it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvcm.threads")

REPEAT_LOG_S = 30.0  # the same failure again is one line per this, not a traceback per iteration


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
        self._last_failure = ("", 0.0, 0)  # (message, when logged, repeats since)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._body()
            except Exception as exc:  # noqa: BLE001 - a loop survives and logs any failing iteration
                self.failures += 1
                self._log_failure(exc)
            self.iterations += 1
            self._stop.wait(self._interval)

    def _log_failure(self, exc: Exception) -> None:
        """A new failure with its traceback; the same one again (a store away for a while, each
        iteration failing alike) at most once per :data:`REPEAT_LOG_S`, with its count."""
        message, logged, repeats = self._last_failure
        now = time.monotonic()
        if str(exc) != message:
            log.exception("%s: iteration failed", self.name)
            self._last_failure = (str(exc), now, 0)
        elif now - logged >= REPEAT_LOG_S:
            log.error("%s: iteration still failing (%d more times): %s", self.name, repeats + 1, exc)
            self._last_failure = (message, now, 0)
        else:
            self._last_failure = (message, logged, repeats + 1)

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


class gc_paused:  # noqa: N801 - used like a function: ``with gc_paused():``
    """The cyclic collector off for one burst of work whose objects mostly die with it (a drain
    of engine batches applied, hashed or flushed; an RPC turn). Every young collection during
    the burst re-walks what the burst still holds (an engine drain's token lists, a turn's
    decoded requests) and each engine block brings a tracked tuple, so a 64-block store alone
    nears the young generation's threshold; one collection after the burst walks only the
    survivors. Left alone when it is already off (the process's choice, or another thread's
    pause: at worst that thread's burst runs with it back on).

    A class rather than a ``contextmanager`` generator: it wraps every engine apply and flush,
    and the generator's machinery cost about four times its own work (the dispatcher pauses
    the collector for its turns inline, for the same reason)."""

    __slots__ = ("_paused",)

    def __enter__(self) -> None:
        self._paused = gc.isenabled()
        if self._paused:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._paused:
            gc.enable()

"""The compiled block hash (``server.hash_kernel = "numba"``), loaded once per process at start."""

from __future__ import annotations

import logging
import time

from kvcm.cache.keys import native_states
from kvcm.config import Config, ConfigError

log = logging.getLogger("kvcm.app")


def load_hash_kernel(config: Config) -> None:
    """``server.hash_kernel = "numba"``: the compiled block hash for the whole process (idempotent),
    or a start-up error naming what is missing."""
    if config.server.hash_kernel != "numba" or native_states() is not None:
        return  # off, or loaded already (an HA node builds an App per leader term)
    started = time.monotonic()
    try:
        from kvcm.cache import hash_kernel
    except ImportError as exc:
        raise ConfigError(f"server.hash_kernel = numba needs numba and numpy (pip install 'kvcm[fast]'): {exc}") from None
    try:
        hash_kernel.load()
    except Exception as exc:  # noqa: BLE001 - numba's build errors are many; each is a start-up refusal
        raise ConfigError(f"server.hash_kernel = numba: the kernel could not be built: {type(exc).__name__}: {exc}") from None
    log.info("server.hash_kernel: the numba kernel is loaded (%.1f s)", time.monotonic() - started)


__all__ = ["load_hash_kernel"]

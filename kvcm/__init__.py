"""kvcm: a KV-cache metadata manager for LLM inference.

The public API is small on purpose: the client, the connectors, the config, and the error types.
The connectors load on first use (``kvcm.Connector``): they bring the block I/O, which a
router or ``kvcm call`` never needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcm.client import Client
from kvcm.config import Config, ConfigError
from kvcm.errors import (
    AccessDenied,
    CapacityError,
    Code,
    Conflict,
    InvalidArgument,
    KvcmError,
    NotFound,
    ServerError,
    Unavailable,
)
from kvcm.version import __version__

if TYPE_CHECKING:
    from kvcm.aio_connector import AsyncConnector
    from kvcm.connector import Connector

_LAZY = {"Connector": "kvcm.connector", "AsyncConnector": "kvcm.aio_connector"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


__all__ = [
    "AccessDenied",
    "AsyncConnector",
    "CapacityError",
    "Client",
    "Code",
    "Config",
    "ConfigError",
    "Conflict",
    "Connector",
    "InvalidArgument",
    "KvcmError",
    "NotFound",
    "ServerError",
    "Unavailable",
    "__version__",
]

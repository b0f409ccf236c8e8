"""kvcm: a KV-cache metadata manager for LLM inference.

The public API is small on purpose: the client, the config, and the error types.
"""

from __future__ import annotations

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

__all__ = [
    "AccessDenied",
    "CapacityError",
    "Client",
    "Code",
    "Config",
    "ConfigError",
    "Conflict",
    "InvalidArgument",
    "KvcmError",
    "NotFound",
    "ServerError",
    "Unavailable",
    "__version__",
]

"""The one error table of kvcm, shared by server and client.

Codes keep Tair KVCM's numbers where Tair has them, and add precise codes where Tair collapses
everything into ``INTERNAL_ERROR``. On the wire an error is ``{"code", "name", "message"}``, plus
``"detail"`` (a map of strings) when the error names something a client acts on (the leader's
endpoint of ``SERVER_NOT_LEADER``, the owning shard of ``WRONG_SHARD``);
the server maps exceptions to it in ``dispatch`` and the client maps it back with
:func:`error_from_wire`, each in exactly one place.

Hierarchy::

    KvcmError
    ├── InvalidArgument        (INVALID_ARGUMENT, MESSAGE_TOO_LARGE, TOO_MANY_KEYS, TOO_LARGE,
    │                           METHOD_NOT_FOUND)
    ├── NotFound               (NOT_FOUND, INSTANCE_NOT_EXIST, WRITE_SESSION_UNKNOWN, WRITE_SESSION_EXPIRED)
    ├── Conflict               (DUPLICATE_ENTITY, VERSION_CONFLICT, STILL_REFERENCED)
    ├── CapacityError          (REACH_MAX_ENTITY_CAPACITY, QUOTA_EXCEEDED, NO_STORAGE_AVAILABLE,
    │   │                       CAPACITY_EXHAUSTED)
    │   └── StoreFull          (CAPACITY_EXHAUSTED: the metadata store itself ran out of room)
    ├── AccessDenied           (UNAUTHENTICATED, PERMISSION_DENIED)
    ├── Unavailable            (SERVICE_NOT_READY, SERVER_NOT_LEADER, SHUTTING_DOWN, TIMEOUT, RATE_LIMITED,
    │                           WRONG_SHARD)
    └── ServerError            (INTERNAL_ERROR, UNSUPPORTED, IO_ERROR)
        └── StartRefused       (IO_ERROR: the data dir cannot be served as it is; exit code 2)
"""

from __future__ import annotations

from enum import IntEnum


class Code(IntEnum):
    """Wire error codes. Values below 100 are Tair KVCM's; 100 and up are kvcm's own."""

    OK = 0
    UNSUPPORTED = 2
    INTERNAL_ERROR = 3
    SERVICE_NOT_READY = 4
    INVALID_ARGUMENT = 5
    DUPLICATE_ENTITY = 6
    REACH_MAX_ENTITY_CAPACITY = 7
    INSTANCE_NOT_EXIST = 8
    SERVER_NOT_LEADER = 9
    IO_ERROR = 20
    NOT_FOUND = 100
    QUOTA_EXCEEDED = 101
    NO_STORAGE_AVAILABLE = 102
    WRITE_SESSION_UNKNOWN = 103
    WRITE_SESSION_EXPIRED = 104
    CAPACITY_EXHAUSTED = 105
    MESSAGE_TOO_LARGE = 106
    TOO_MANY_KEYS = 107
    UNAUTHENTICATED = 108
    PERMISSION_DENIED = 109
    METHOD_NOT_FOUND = 110
    SHUTTING_DOWN = 111
    VERSION_CONFLICT = 112
    STILL_REFERENCED = 113
    TIMEOUT = 114
    TOO_LARGE = 115  # the work or the reply of a request would exceed a configured limit
    RATE_LIMITED = 116  # too many attempts (failed logins) from this peer or account; retry later
    WRONG_SHARD = 117  # another shard owns the instance or group; the detail names it (kvcm.proto.shards)


class KvcmError(Exception):
    """Base of every error kvcm raises on purpose; carries a wire :class:`Code`."""

    default_code = Code.INTERNAL_ERROR

    def __init__(self, message: str, code: Code | None = None) -> None:
        super().__init__(message)
        self.code = code if code is not None else self.default_code
        self.message = message
        self.detail: dict[str, str] = {}  # facts a client acts on, e.g. ``leader_endpoint``

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def to_wire(self) -> dict[str, int | str | dict[str, str]]:
        out: dict[str, int | str | dict[str, str]] = {"code": int(self.code), "name": self.code.name, "message": self.message}
        if self.detail:
            out["detail"] = dict(self.detail)
        return out


class InvalidArgument(KvcmError):
    default_code = Code.INVALID_ARGUMENT


class NotFound(KvcmError):
    default_code = Code.NOT_FOUND


class Conflict(KvcmError):
    default_code = Code.DUPLICATE_ENTITY


class CapacityError(KvcmError):
    default_code = Code.CAPACITY_EXHAUSTED


class StoreFull(CapacityError):
    """The metadata store has no room left for a transaction (LMDB ``MDB_MAP_FULL``)."""


class AccessDenied(KvcmError):
    default_code = Code.PERMISSION_DENIED


class Unavailable(KvcmError):
    default_code = Code.SERVICE_NOT_READY


class ServerError(KvcmError):
    default_code = Code.INTERNAL_ERROR


class StartRefused(ServerError):
    """kvcm will not start on this data dir as it is: its metadata is unreadable, or missing
    while storages still hold blocks it recorded. Nothing was changed or deleted; ``kvcm
    serve`` prints the one-line reason and exits with code 2."""

    default_code = Code.IO_ERROR


_FAMILY: dict[Code, type[KvcmError]] = {
    Code.INVALID_ARGUMENT: InvalidArgument,
    Code.MESSAGE_TOO_LARGE: InvalidArgument,
    Code.TOO_MANY_KEYS: InvalidArgument,
    Code.METHOD_NOT_FOUND: InvalidArgument,
    Code.TOO_LARGE: InvalidArgument,
    Code.NOT_FOUND: NotFound,
    Code.INSTANCE_NOT_EXIST: NotFound,
    Code.WRITE_SESSION_UNKNOWN: NotFound,
    Code.WRITE_SESSION_EXPIRED: NotFound,
    Code.DUPLICATE_ENTITY: Conflict,
    Code.VERSION_CONFLICT: Conflict,
    Code.STILL_REFERENCED: Conflict,
    Code.REACH_MAX_ENTITY_CAPACITY: CapacityError,
    Code.QUOTA_EXCEEDED: CapacityError,
    Code.NO_STORAGE_AVAILABLE: CapacityError,
    Code.CAPACITY_EXHAUSTED: CapacityError,
    Code.UNAUTHENTICATED: AccessDenied,
    Code.PERMISSION_DENIED: AccessDenied,
    Code.SERVICE_NOT_READY: Unavailable,
    Code.SERVER_NOT_LEADER: Unavailable,
    Code.SHUTTING_DOWN: Unavailable,
    Code.TIMEOUT: Unavailable,
    Code.RATE_LIMITED: Unavailable,
    Code.WRONG_SHARD: Unavailable,
    Code.INTERNAL_ERROR: ServerError,
    Code.UNSUPPORTED: ServerError,
    Code.IO_ERROR: ServerError,
}


def family_of(code: Code) -> type[KvcmError]:
    """The exception class that stands for ``code``."""
    return _FAMILY.get(code, ServerError)


def error(code: Code, message: str) -> KvcmError:
    """Build the exception of the right family for ``code``."""
    return family_of(code)(message, code)


def error_from_wire(obj: object) -> KvcmError:
    """Map a wire error map back to an exception (the client's single mapping point)."""
    if not isinstance(obj, dict):
        return ServerError(f"malformed error from server: {obj!r}", Code.INTERNAL_ERROR)
    raw = obj.get("code", Code.INTERNAL_ERROR)
    try:
        code = Code(raw)
    except ValueError:
        code = Code.INTERNAL_ERROR
    exc = error(code, str(obj.get("message", "")))
    detail = obj.get("detail")
    if isinstance(detail, dict):  # from the network: only string pairs are kept
        exc.detail = {k: v for k, v in detail.items() if isinstance(k, str) and isinstance(v, str)}
    return exc

"""The method table's contract: what an RPC method declares (:class:`Method`: its handler,
request Struct, cost, hooks) and what the dispatcher lets those hooks see and raise. The API
modules build their methods from these; :mod:`kvcm.rpc.dispatch` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from kvcm.errors import KvcmError

__all__ = ["Admission", "Authorizer", "Deferred", "Estimate", "Gate", "Limits", "Method", "Preparation",
           "Prepare", "Refuse"]


class Estimate(NamedTuple):
    """What a validated request will cost: RPC-thread microseconds, and the fewest bytes its
    reply can take. ``per_key_micros`` (when the cost grows with the keys) lets the refusal say
    how many keys would fit. A NamedTuple rather than a frozen dataclass: every costed request
    makes one, and a frozen dataclass's ``__init__`` (``object.__setattr__`` per field) cost
    about four times as much."""

    micros: float
    reply_bytes: int = 0
    per_key_micros: float = 0.0
    #: the keys the estimate counted (0: not said): the rest of ``micros`` is the request's
    #: fixed cost, and ``reply_bytes`` grows with them, so the refusal's key count fits both
    keys: int = 0


#: ``refuse(method, estimate, per_key)``: raise the TOO_LARGE refusal of an estimate over the
#: limits (:meth:`kvcm.rpc.dispatch.Dispatcher.refuse`).
Refuse = Callable[["Method", Estimate, "tuple[int, str] | None"], None]


class Preparation(Protocol):
    """Work a request needs before it can be costed, done over as many turns as it takes."""

    #: why a request is carried while this is unfinished (the ``kvcm_rpc_carried_total`` label)
    reason: str

    def advance(self, deadline: float) -> bool:
        """Work until done (True) or ``deadline`` (``time.perf_counter``) has passed (False: the
        request is carried and this is called again in a later turn)."""


class Admission:
    """What a prepare hook may ask of the dispatcher about the request it prepares."""

    __slots__ = ("_limits", "_method", "_refuse", "_request")

    def __init__(self, method: Method, request: object, limits: Limits, refuse: Refuse) -> None:
        self._method, self._request, self._limits, self._refuse = method, request, limits, refuse

    @property
    def method(self) -> str:
        return self._method.name

    @property
    def max_keys(self) -> int:
        return self._limits.max_keys

    def refuse_if_too_large(self, keys: int, per_key: tuple[int, str] | None = None) -> None:
        """TOO_LARGE now for a request that will have ``keys`` keys once prepared and would be
        refused then: the method's estimate without keys, plus ``keys`` at its rate.
        ``per_key``: ``(n, what)`` — each key stands for ``n`` of the request's ``what``, named
        in the refusal's hint."""
        cost = self._method.cost
        if cost is None:
            return
        bare = cost(self._request)  # no keys yet: the fixed cost, and the rate per key
        if bare.per_key_micros <= 0:
            return
        projected = Estimate(bare.micros + keys * bare.per_key_micros, 0, bare.per_key_micros, keys)
        if projected.micros > self._limits.turn_budget_ms * 1000.0:
            self._refuse(self._method, projected, per_key)


R_contra = TypeVar("R_contra", contravariant=True)


class Prepare(Protocol, Generic[R_contra]):
    """A method's prepare hook: the work its validated request needs before it is costed (None:
    none), or the request's error. Asked once per request, before its first turn's estimate."""

    def __call__(self, request: R_contra, admission: Admission, /) -> Preparation | None: ...


@dataclass(frozen=True)
class Method:
    """One RPC method.

    :param handler: called with the validated request (a ``request`` Struct, or the raw map)
    :param request: ``msgspec.Struct`` type the params map must convert to, or None
    :param writes: runs inside the batch's group commit
    :param idempotent: a client may retry it after a timeout
    :param admin: needs the admin role when auth is on
    :param cost: estimates the work of a validated request (keys already derived); None = small
    :param prepare: the work a request needs before it is costed (:class:`Prepare`; asked of
        every request of the method), or None
    :param settle: called once at the end of a turn in which the method ran, before any reply
        of that turn is built (``report_events`` persists the turn's engine batches with it:
        one transaction for the turn, every reply after it); if it raises, the turn's
        successful requests of the method get that error instead
    :param admitted: called once per turn with the requests of the method that run in it (not
        those carried to a later turn), before the first of them runs (``report_events`` hashes
        their batches together); if it raises, they get that error and do not run
    """

    name: str
    handler: Callable[[Any], object]
    request: type | None = None
    writes: bool = False
    idempotent: bool = True
    admin: bool = False
    cost: Callable[[Any], Estimate] | None = None
    prepare: Prepare[Any] | None = None
    settle: Callable[[], object] | None = None
    admitted: Callable[[list[Any]], object] | None = None


class ServerLimits(Protocol):
    """The settings :meth:`Limits.of` reads (:class:`kvcm.config.ServerConfig` has them)."""

    @property
    def max_keys(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def max_reply_bytes(self) -> int: ...
    @property
    def turn_budget_ms(self) -> float: ...
    @property
    def defer_timeout_s(self) -> float: ...
    @property
    def refusal_hold_ms(self) -> float: ...


@dataclass(frozen=True)
class Limits:
    """Per-request limits (``server.*`` in the config; docs/limits.md has the measured defaults)."""

    max_keys: int = 131072
    max_tokens: int = 524288
    max_reply_bytes: int = 16 << 20
    turn_budget_ms: float = 50.0
    defer_timeout_s: float = 30.0
    max_carried: int = 4096
    refusal_hold_ms: float = 100.0

    @classmethod
    def of(cls, server: ServerLimits) -> Limits:
        """The limits a ``server`` config section (:class:`kvcm.config.ServerConfig`) sets."""
        return cls(max_keys=server.max_keys, max_tokens=server.max_tokens, max_reply_bytes=server.max_reply_bytes,
                   turn_budget_ms=server.turn_budget_ms, defer_timeout_s=server.defer_timeout_s,
                   refusal_hold_ms=server.refusal_hold_ms)


#: ``authorize(method, request, peer)``: allow the call, or raise :class:`~kvcm.errors.AccessDenied`
#: (or :class:`Deferred`). ``request`` is the validated Struct (its ``auth`` field carries the
#: credentials); ``peer`` is the sender's routing identity (``b""`` in-process).
Authorizer = Callable[[Method, Any, bytes], None]

#: ``gate(method)``: None to let the request run, or the error that answers it instead, before
#: anything else is done for it (a follower's ``SERVER_NOT_LEADER``). ``method`` is None for a
#: name not in this table (a follower's table is small: the leader knows the name).
Gate = Callable[[Method | None], KvcmError | None]


class Deferred(Exception):
    """Raised by an authorize hook whose verdict is not ready yet (e.g. a password check running
    on another thread): the request is carried to a later loop turn and tried again then."""

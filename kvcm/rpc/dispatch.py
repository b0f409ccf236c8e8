"""The method table: bytes in, bytes out, with validation, costing, scheduling and the one
exception-to-wire mapping.

The server hands each loop turn's drained requests to :meth:`Dispatcher.serve`. A request goes
through these steps, each of which can only fail *that* request:

1. **parse**: the envelope and the method's ``msgspec.Struct`` (strict: an unknown field is
   ``INVALID_ARGUMENT`` naming it). Any decoder failure, a ``RecursionError`` on absurd nesting
   included, is the request's own ``INVALID_ARGUMENT``.
2. **size**: lists of keys past ``max_keys`` and ``token_ids`` past ``max_tokens`` are refused
   before anything is derived from them.
3. **authorize**: the auth hook may answer later (:class:`Deferred`: e.g. a password being checked
   on another thread); the request is then carried to a later turn.
4. **keys**: ``token_ids`` are hashed into ``block_keys`` a slice at a time, so a long prompt
   spreads over several turns instead of holding everyone else up.
5. **cost**: the method's estimate of its work (microseconds) and of its smallest reply; over the
   per-request budget or ``max_reply_bytes`` it is ``TOO_LARGE``, before any work.
6. **schedule**: small requests run first; heavy ones run while the turn's budget lasts and the
   rest wait for the next turn (new small requests go ahead of them then too). One peer's
   requests never overtake each other: behind a carried request, its peer's later ones wait.
7. **run**: reads at once; writes inside one ``group()`` (one store commit, made before any reply
   of the turn is produced), each in its own ``write()`` block (a savepoint), so a failing request
   rolls back alone. If the shared commit itself fails, every write of the group is answered with
   that error: nothing is acknowledged that is not durable. A full map that can still grow is the
   exception: the map grows and the group runs once more (handlers change memory only in
   ``on_commit``/``on_abort`` callbacks).

Handlers receive the validated request and return a result map, or :class:`kvcm.proto.wire.Raw`
bytes; a reply larger than ``max_reply_bytes`` is replaced by ``TOO_LARGE``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from kvcm.cache.keys import ChainHasher
from kvcm.errors import Code, InvalidArgument, KvcmError, ServerError, StoreFull, Unavailable, error
from kvcm.metrics import Metrics
from kvcm.proto import schema, wire
from kvcm.proto.extra_keys import BlockExtras
from kvcm.rpc.tarpit import Tarpit

log = logging.getLogger("kvcm.rpc.dispatch")

#: List fields whose length is capped by ``max_keys`` before any handler runs.
KEY_FIELDS = ("block_keys", "bool_masks", "success_blocks")
_SIZED_NAMES = (*KEY_FIELDS, "token_ids")
#: Tokens hashed per slice before the turn's hashing time is looked at again (about 0.3 ms).
_HASH_SLICE = 1024
#: Hashing of token_ids one turn does at most (microseconds; every request gets at least one
#: slice a turn): the rest is carried to the next turn, so the requests that arrive meanwhile
#: are answered between slices instead of after all of a long prompt's hashing. The turn's
#: replies are sent when it ends, so this, not the turn budget, is what one client's long
#: prompt adds to everyone else's latency (scripts/bench_hostile ``largest``).
_HASH_TURN_US = 500.0
#: A request estimated at no more than this share of the budget is "small": it is never held back
#: for the budget's sake, only behind its own peer's carried requests.
_SMALL_SHARE = 0.02
#: While a request waits for a verdict from another thread, the loop looks again this often.
_AUTH_POLL_MS = 2


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


@dataclass(frozen=True)
class TokenWork:
    """Keys to derive before the handler runs: ``done(keys)`` stores them on the request.
    ``extras``: the prompt's extra keys (:func:`kvcm.proto.extra_keys.request_extras`), mixed in."""

    tokens: Sequence[int]
    block_size: int
    done: Callable[[list[int]], None]
    extras: BlockExtras | None = None


@dataclass(frozen=True)
class Method:
    """One RPC method.

    :param handler: called with the validated request (a ``request`` Struct, or the raw map)
    :param request: ``msgspec.Struct`` type the params map must convert to, or None
    :param writes: runs inside the batch's group commit
    :param idempotent: a client may retry it after a timeout
    :param admin: needs the admin role when auth is on
    :param cost: estimates the work of a validated request (keys already derived); None = small
    :param tokens: the ``token_ids`` hashing a request needs before it runs, or None (asked
        of every request of the method: None when it has no ``token_ids`` to hash)
    :param settle: called once at the end of a turn in which the method ran, before any reply
        of that turn is built (``report_events`` persists the turn's engine batches with it:
        one transaction for the turn, every reply after it); if it raises, the turn's
        successful requests of the method get that error instead
    :param admitted: called once per turn with the requests of the method that run in it (not
        those carried to a later turn), before the first of them runs (``report_events`` hashes
        their batches together); if it raises, they get that error and do not run
    """

    name: str
    handler: Callable[[Any], Any]
    request: type | None = None
    writes: bool = False
    idempotent: bool = True
    admin: bool = False
    cost: Callable[[Any], Estimate] | None = None
    tokens: Callable[[Any], TokenWork | None] | None = None
    settle: Callable[[], object] | None = None
    admitted: Callable[[list[Any]], object] | None = None


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
    def of(cls, server: Any) -> Limits:
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


class _Outcome:
    __slots__ = ("authorized", "carried", "derived", "error", "hasher", "method", "msgid", "params", "peer",
                 "result", "since", "size", "tag", "told_until", "waiting")

    def __init__(self, msgid: int | None, method: Method | None, tag: Any = None, peer: bytes = b"") -> None:
        self.msgid = msgid
        self.method = method
        self.tag = tag
        self.peer = peer
        self.error: dict[str, Any] | None = None
        self.result: Any = None  # the raw params map until the handler replaces it
        self.params: Any = None  # the validated request
        self.since = time.monotonic()
        self.authorized = False
        self.carried = False  # kept over from an earlier turn at least once
        self.hasher: ChainHasher | None = None  # token hashing in progress
        self.derived = False  # keys derived (or none to derive): a carried request is not asked again
        self.waiting = False  # carried for a verdict of another thread (not runnable yet)
        self.size = 0  # the request's bytes (a big refusal may be held: kvcm.rpc.tarpit)
        self.told_until: float | None = None  # refused unread: its sender was told to wait until then


class _Carry(Exception):
    """Internal: the request goes on in a later turn (``reason`` is counted)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


#: (peer, method) pairs told to wait that are remembered at most (see Dispatcher._remember_waits).
MAX_TOLD_TO_WAIT = 4096
#: Requests smaller than this are read even from a peer told to wait: the box spares the loop
#: decoding big requests, and a small one (a heartbeat) may be one the refusal did not concern.
TOLD_TO_WAIT_MIN_BYTES = 16 << 10

# Fast path: ``[0, msgid, method, [ {map} ]]``: the envelope's head read by hand
# (:func:`kvcm.proto.wire.split_request`), the params decoded by msgspec straight from the bytes
# into the method's Struct (no intermediate dicts, about 3x cheaper than unpack + convert).
# Anything it does not take — notifications, a bare params map — is parsed again by the slow
# path, which answers alike.


class Dispatcher:
    """Owned by the RPC thread. Holds the method table and maps exceptions to wire errors."""

    def __init__(
        self,
        methods: Iterable[Method],
        metrics: Metrics | None = None,
        group: Callable[[], AbstractContextManager[Any]] | None = None,
        atomic: Callable[[], AbstractContextManager[Any]] | None = None,
        authorize: Authorizer | None = None,
        max_keys: int | None = None,
        group_commit: bool = True,
        access_log: bool = False,
        grow: Callable[[], bool] | None = None,
        limits: Limits | None = None,
        gate: Gate | None = None,
    ) -> None:
        """``grow``: make room in the store after :class:`~kvcm.errors.StoreFull`; True when it
        did (the failed batch is then run again, once). ``max_keys`` overrides ``limits``.
        ``gate``: the node's role check (:data:`Gate`); None = every request may run."""
        self.methods: dict[str, Method] = {}
        for method in methods:
            if method.name in self.methods:
                raise ValueError(f"method {method.name!r} registered twice")
            self.methods[method.name] = method
        self.metrics = metrics or Metrics()
        self._group = group or nullcontext
        # Each write request runs in its own write() block (a savepoint), so a request that
        # fails half-way rolls back alone, whatever the handler did before it raised.
        self._atomic = atomic or nullcontext
        self._grow = grow
        self._authorize = authorize
        self._gate = gate
        limits = limits or Limits()
        if max_keys is not None:
            limits = Limits(**{**limits.__dict__, "max_keys": max_keys})
        self.limits = limits
        self._budget_us = limits.turn_budget_ms * 1000.0
        self._group_commit = group_commit
        self._access_log = access_log
        self._decoders: dict[type, Callable[[Any], Any]] = {}
        self._fast: dict[str, tuple[Method, Callable[[Any], Any]]] = {}
        self._carried: list[_Outcome] = []
        # (peer, method) -> (until when, the refusal): see _remember_waits
        self._told_to_wait: dict[tuple[bytes, str], tuple[float, str]] = {}
        self._sized: dict[type, tuple[tuple[str, int], ...]] = {}  # request type -> its list fields under a limit
        self._hashing_us = 0.0
        self._tarpit = Tarpit(limits.refusal_hold_ms / 1000.0)
        self._settling = any(m.settle is not None for m in self.methods.values())
        self._admitting = any(m.admitted is not None for m in self.methods.values())
        for method in self.methods.values():
            if method.request is not None:
                decoder = msgspec.msgpack.Decoder(tuple[method.request], ext_hook=wire.refuse_ext)  # type: ignore[name-defined]
                self._fast[method.name] = (method, decoder.decode)

    @property
    def typed_decode(self) -> bool:
        """Requests are decoded straight into their Structs."""
        return bool(self._fast)

    # -- entry points ---------------------------------------------------------------------------

    def serve(self, arrivals: Sequence[tuple[Any, bytes, bytes]]) -> list[tuple[Any, bytes | None]]:
        """One loop turn: ``(tag, peer, payload)`` of the requests that just arrived in, ``(tag,
        reply)`` of every request finished in this turn out — earlier carried ones included;
        ``reply`` is None for notifications. Unfinished requests stay carried (:meth:`wait_ms`).

        The collector is paused for the turn (bounded by ``server.turn_budget_ms``): what its
        requests decode and build (a report's engine batches, pooled for the whole turn) dies
        with the turn, and a collection every few requests would walk it again each time."""
        if arrivals:
            self.metrics.rpc.batch(len(arrivals))
        if not gc.isenabled():  # the process's choice, or another thread's pause (see gc_paused)
            return self._turn(arrivals)
        gc.disable()  # gc_paused, inline: this runs every turn
        try:
            return self._turn(arrivals)  # its requests are freed on return, before the collector runs
        finally:
            gc.enable()

    def _turn(self, arrivals: Sequence[tuple[Any, bytes, bytes]]) -> list[tuple[Any, bytes | None]]:
        outcomes = self._carried + [self._parse(payload, tag, peer) for tag, peer, payload in arrivals]
        self._carried = []
        finished = self._schedule(outcomes)
        self._remember_waits(finished)
        runnable = [o for o in finished if o.error is None and o.method is not None]
        if self._admitting:
            runnable = self._admit_turn(runnable)
        if self._group_commit:
            self._run_grouped(runnable)
        else:
            for outcome in runnable:
                self._run_alone(outcome)
        if self._settling:
            self._settle(runnable)
        return self._answer(finished)

    def _answer(self, finished: list[_Outcome]) -> list[tuple[Any, bytes | None]]:
        """The replies to send now: a big request's refusal for its sender's fault is held
        (:mod:`kvcm.rpc.tarpit`) and sent in a later turn with those held before whose time came."""
        out: list[tuple[Any, bytes | None]] = []
        for outcome in finished:
            error = outcome.error
            hold = 0.0
            if error is not None and outcome.msgid is not None:
                hold = self._tarpit.hold_for(error.get("code", 0), outcome.size, outcome.told_until)
                if hold > 0 and outcome.told_until is not None:
                    error.setdefault("detail", {})["retry_after_ms"] = "1"  # the wait is over when it arrives
            reply = self._reply(outcome)
            if hold > 0 and reply is not None:
                self._tarpit.hold(outcome.tag, reply, hold)
                self.metrics.refusals_held.inc()
                continue
            out.append((outcome.tag, reply))
        if len(self._tarpit):
            out.extend(self._tarpit.due())
        return out

    def _admit_turn(self, runnable: list[_Outcome]) -> list[_Outcome]:
        """Each method with an ``admitted`` hook is told its requests of the turn
        (:attr:`Method.admitted`); the outcomes that still run."""
        hooks: dict[str, tuple[Callable[[list[Any]], object], list[_Outcome]]] = {}
        for outcome in runnable:
            method = outcome.method
            assert method is not None  # internal: runnable outcomes have their method
            if method.admitted is not None:
                hooks.setdefault(method.name, (method.admitted, []))[1].append(outcome)
        failed = False
        for name, (hook, outcomes) in hooks.items():
            try:
                hook([o.params for o in outcomes])
            except Exception as exc:  # noqa: BLE001 - what the turn's requests of it answer
                wired = self._to_error(exc, name)
                for outcome in outcomes:
                    outcome.error = wired
                failed = True
        return [o for o in runnable if o.error is None] if failed else runnable

    def _settle(self, ran: list[_Outcome]) -> None:
        """Each settling method that ran in the turn settles once (:attr:`Method.settle`)."""
        settled: set[str] = set()
        for outcome in ran:
            method = outcome.method
            assert method is not None  # internal: runnable outcomes have their method
            if method.settle is None or method.name in settled:
                continue
            settled.add(method.name)
            try:
                method.settle()
            except Exception as exc:  # noqa: BLE001 - what the turn's requests of it answer
                wired = self._to_error(exc, method.name)
                for other in ran:
                    if other.method is method and other.error is None:
                        other.error, other.result = wired, None

    def wait_ms(self) -> int | None:
        """How soon the loop must turn again for carried work or a held refusal: 0 = at once, None =
        nothing carried or held."""
        if not self._carried:
            return self._tarpit.wait_ms()  # held refusals alone; carried work turns the loop sooner
        return _AUTH_POLL_MS if all(o.waiting for o in self._carried) else 0

    def handle_batch(self, payloads: Sequence[bytes], peers: Sequence[bytes] | None = None) -> list[bytes | None]:
        """Handle requests to completion, over as many turns as they need (tests, tools); one
        reply (or None) per payload, in order."""
        senders = peers if peers is not None else [b""] * len(payloads)
        replies: dict[int, bytes | None] = {}
        mine = set(range(len(payloads)))
        arrivals = [((self, i), senders[i], p) for i, p in enumerate(payloads)]
        while True:
            for tag, reply in self.serve(arrivals):
                if isinstance(tag, tuple) and tag[0] is self and tag[1] in mine:
                    replies[tag[1]] = reply
            arrivals = []
            if len(replies) == len(payloads):
                return [replies[i] for i in range(len(payloads))]
            wait = self.wait_ms()
            if wait:
                time.sleep(wait / 1000.0)

    def handle(self, payload: bytes) -> bytes | None:
        """One request (tests, tools)."""
        return self.handle_batch([payload])[0]

    def call(self, name: str, params: dict[str, Any]) -> Any:
        """Run one method in-process, to completion; raises KvcmError."""
        method = self.methods.get(name)
        if method is None:
            raise error(Code.METHOD_NOT_FOUND, f"unknown method {name!r}")
        try:
            payload = wire.pack_request(0, name, params)
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{name}: params cannot be encoded: {type(exc).__name__}") from None
        reply = self.handle(payload)
        assert reply is not None  # internal: a request (msgid 0) always gets a reply
        _, err, result = wire.parse_response(reply)
        if err is not None:
            raise error(Code(err["code"]), err["message"])
        return result

    # -- parse ----------------------------------------------------------------------------------

    def _parse(self, payload: bytes, tag: Any = None, peer: bytes = b"") -> _Outcome:
        outcome = self._parse_one(payload, tag, peer)
        outcome.size = len(payload)
        return outcome

    def _parse_one(self, payload: bytes, tag: Any, peer: bytes) -> _Outcome:
        try:
            if self._told_to_wait:
                waiting = self._still_waiting(payload, tag, peer)
                if waiting is not None:
                    return waiting
            fast = self._parse_fast(payload, tag, peer)
            if fast is not None:
                return fast
            return self._parse_slow(payload, tag, peer)
        except Exception as exc:  # noqa: BLE001 - one request's decode failure is its own error
            outcome = _Outcome(wire.peek_msgid(payload), None, tag, peer)
            outcome.error = self._to_error(_decode_failure(exc), "decode")
            return outcome

    def _parse_slow(self, payload: bytes, tag: Any, peer: bytes) -> _Outcome:
        try:
            request = wire.parse_request(payload)
        except wire.BadEnvelope as exc:
            self.metrics.bad_messages.labels("envelope").inc()
            # msgid 0 when unreadable: a REQ client must get *some* reply or it is stuck.
            outcome = _Outcome(exc.msgid if exc.msgid is not None else wire.peek_msgid(payload), None, tag, peer)
            outcome.error = InvalidArgument(str(exc)).to_wire()
            return outcome
        method = self.methods.get(request.method)
        outcome = _Outcome(request.msgid, method, tag, peer)
        refused = self._gate(method) if self._gate is not None and method is None else None
        if refused is not None:
            outcome.error = self._to_error(refused, "gate")
            return outcome
        if method is None:
            self.metrics.bad_messages.labels("unknown_method").inc()
            outcome.error = error(Code.METHOD_NOT_FOUND, f"unknown method {request.method[:100]!r}").to_wire()
            return outcome
        outcome.result = request.params
        try:
            outcome.params = self._validate(method, request.params)
        except Exception as exc:  # noqa: BLE001 - the request's own validation error
            outcome.error = self._to_error(exc, method.name)
        return outcome

    def _parse_fast(self, payload: bytes, tag: Any, peer: bytes) -> _Outcome | None:
        split = wire.split_request(payload)
        if split is None:
            return None  # anything the fast path does not take, the slow path explains
        msgid, name, raw = split
        entry = self._fast.get(name)
        if entry is None:
            return None
        method = entry[0]
        outcome = _Outcome(msgid, method, tag, peer)
        try:
            (outcome.params,) = entry[1](raw)
            self._check_sizes(outcome.params)
        except msgspec.ValidationError as exc:
            # A field of [ {map} ] is wrong: answer from here. Decoding it all again in the slow
            # path would cost a multi-megabyte request twice (the schema caps lists by their
            # header, before any element is decoded).
            message = str(exc)
            if "`$[0]" not in message:
                return None  # e.g. a bare params map: the slow path takes it
            relative = msgspec.ValidationError(message.replace("`$[0]", "`$"))
            outcome.error = self._to_error(_schema_error(method, relative), method.name)
        except KvcmError as exc:
            outcome.error = self._to_error(exc, method.name)
        except Exception:  # noqa: BLE001 - e.g. RecursionError: the slow path explains
            return None
        return outcome

    # -- told to wait ---------------------------------------------------------------------------

    def _remember_waits(self, finished: list[_Outcome]) -> None:
        """A request refused ``RATE_LIMITED`` with ``retry_after_ms``: its peer's big requests of
        the same method are refused from their envelope's head until then, undecoded. A client
        that does not wait (a flood) then costs the loop microseconds a request, not a decode."""
        for outcome in finished:
            error = outcome.error
            if error is None or error.get("code") != Code.RATE_LIMITED or outcome.method is None \
                    or outcome.peer.startswith(wire.RELAY_ID_PREFIX):
                continue
            retry_ms = (error.get("detail") or {}).get("retry_after_ms")
            if retry_ms is None:
                continue
            if len(self._told_to_wait) >= MAX_TOLD_TO_WAIT:
                now = time.monotonic()
                self._told_to_wait = {k: v for k, v in self._told_to_wait.items() if v[0] > now}
                if len(self._told_to_wait) >= MAX_TOLD_TO_WAIT:
                    continue
            until = time.monotonic() + int(retry_ms) / 1000.0
            self._told_to_wait[(outcome.peer, outcome.method.name)] = (until, str(error.get("message", "")))

    def _still_waiting(self, payload: bytes, tag: Any, peer: bytes) -> _Outcome | None:
        if len(payload) < TOLD_TO_WAIT_MIN_BYTES:
            return None  # cheap to read: read it (a heartbeat of a source over its budget goes through)
        split = wire.split_request(payload)
        if split is None:
            return None
        msgid, name, _ = split
        told = self._told_to_wait.get((peer, name))
        if told is None:
            return None
        left = told[0] - time.monotonic()
        if left <= 0:
            del self._told_to_wait[(peer, name)]
            return None
        outcome = _Outcome(msgid, self.methods.get(name), tag, peer)
        outcome.told_until = told[0]
        refused = error(Code.RATE_LIMITED, f"{name}: told to retry in {left:.3f} s and sent again sooner "
                                          f"(not read); earlier: {told[1][:300]}")
        refused.detail["retry_after_ms"] = str(max(1, round(left * 1000)))
        self.metrics.bad_messages.labels("told_to_wait").inc()
        outcome.error = refused.to_wire()
        return outcome

    # -- schedule -------------------------------------------------------------------------------

    def _schedule(self, outcomes: list[_Outcome]) -> list[_Outcome]:
        """Admit what runs this turn (small first, then heavy within the budget); carry the rest.
        Returns the finished outcomes (errors included) in the order they are to run."""
        self._hashing_us = 0.0  # real time this turn spent hashing token_ids
        spent = 0.0  # estimated microseconds of the heavy work admitted this turn
        small: list[_Outcome] = []
        heavy: list[_Outcome] = []
        blocked: set[bytes] = set()  # peers with a carried request: their later ones wait too
        in_heavy: set[bytes] = set()  # peers with a heavy request admitted: their later ones follow it
        for outcome in outcomes:
            if outcome.peer in blocked:
                self._carry(outcome, "order")
                continue
            try:
                if outcome.error is None and outcome.method is not None:
                    estimate = self._admit(outcome, spent, bool(heavy))
                    if estimate is not None:
                        spent += estimate
                        heavy.append(outcome)
                        in_heavy.add(outcome.peer)
                        continue
            except _Carry as carry:
                self._carry(outcome, carry.reason)
                blocked.add(outcome.peer)
                continue
            except Exception as exc:  # noqa: BLE001 - admission failures are the request's own
                outcome.error = self._to_error(exc, outcome.method.name if outcome.method else "admit")
            (heavy if outcome.peer in in_heavy else small).append(outcome)
        return small + heavy

    def _admit(self, outcome: _Outcome, spent: float, heavy_admitted: bool) -> float | None:
        """Prepare one request; None when it is small, else its estimated microseconds (heavy).
        Raises :class:`_Carry` to keep it for a later turn, or the request's error."""
        method, params = outcome.method, outcome.params
        assert method is not None  # internal: only called for resolved methods
        if self._gate is not None:
            refused = self._gate(method)  # before auth: the follower did nothing, the client resends
            if refused is not None:
                raise refused
        if outcome.carried and time.monotonic() - outcome.since > self.limits.defer_timeout_s:
            raise error(Code.TIMEOUT, f"{method.name}: waited over {self.limits.defer_timeout_s:g}s for its turn")
        if not outcome.authorized and self._authorize is not None:
            try:
                self._authorize(method, params, outcome.peer)
            except Deferred:
                outcome.waiting = True
                raise _Carry("auth") from None
            outcome.waiting = False
        outcome.authorized = True
        # Keys come from token_ids only; the hook is asked of every request of the method, so
        # it also refuses extra keys sent without token_ids (they would be left out silently).
        if method.tokens is not None and not self._derive_keys(outcome, method):
            raise _Carry("hashing")
        if method.cost is None:
            return None
        estimate = method.cost(params)
        if estimate.micros > self._budget_us or estimate.reply_bytes > self.limits.max_reply_bytes:
            self._refuse(method, estimate)
        if estimate.micros <= self._budget_us * _SMALL_SHARE:
            return None
        if heavy_admitted and spent + self._hashing_us + estimate.micros > self._budget_us:
            raise _Carry("budget")
        return estimate.micros

    def _derive_keys(self, outcome: _Outcome, method: Method) -> bool:
        """Hash the request's ``token_ids`` a slice at a time while the turn's hashing allowance
        (:data:`_HASH_TURN_US`) lasts; True once its keys are set."""
        tokens_of = method.tokens
        assert tokens_of is not None  # internal: checked by the caller
        if outcome.derived:
            return True
        work = tokens_of(outcome.params)  # cheap: the instance's block size and the token list
        if work is None:
            outcome.derived = True
            return True
        hasher = outcome.hasher
        if hasher is None:
            keys = len(work.tokens) // work.block_size
            if keys > self.limits.max_keys:
                raise error(Code.TOO_MANY_KEYS, f"{method.name}: token_ids make {keys} blocks of {work.block_size}; "
                                                f"the limit is {self.limits.max_keys} (server.max_keys)")
            self._refuse_before_hashing(outcome, method, keys, work.block_size)
            hasher = outcome.hasher = ChainHasher(work.block_size, extras=work.extras)
        step = max(1, _HASH_SLICE // work.block_size) * work.block_size  # whole blocks per slice
        fed = len(hasher.keys) * work.block_size
        began = time.perf_counter()
        try:
            while fed < len(work.tokens):
                if fed and self._hashing_us + (time.perf_counter() - began) * 1e6 > _HASH_TURN_US:
                    return False
                hasher.feed(work.tokens[fed:fed + step])
                fed += step
        finally:
            self._hashing_us += (time.perf_counter() - began) * 1e6
        work.done(hasher.keys)
        outcome.hasher = None
        outcome.derived = True
        return True

    def _refuse_before_hashing(self, outcome: _Outcome, method: Method, keys: int, block_size: int) -> None:
        """TOO_LARGE before any hashing for a request whose ``keys`` (from its token ids) would
        be refused once hashed: the method's estimate without keys, plus ``keys`` at its rate."""
        if method.cost is None:
            return
        bare = method.cost(outcome.params)  # no keys yet: the fixed cost, and the rate per key
        if bare.per_key_micros <= 0:
            return
        projected = Estimate(bare.micros + keys * bare.per_key_micros, 0, bare.per_key_micros, keys)
        if projected.micros > self._budget_us:
            self._refuse(method, projected, block_size)

    def _refuse(self, method: Method, estimate: Estimate, block_size: int = 0) -> None:
        """TOO_LARGE for an estimate over the turn's budget or ``max_reply_bytes``, naming the
        most keys (and token ids, for a request by ``token_ids`` of ``block_size``) that fit."""
        fits = self._fits(estimate)
        hint = "" if fits is None else f"; send at most {fits} keys per request" + \
            (f" ({fits * block_size} token_ids)" if block_size else "")
        if estimate.micros > self._budget_us:
            raise error(Code.TOO_LARGE, f"{method.name}: estimated at {estimate.micros / 1000:.0f} ms of work, over "
                                        f"the {self.limits.turn_budget_ms:g} ms a request may take "
                                        f"(server.turn_budget_ms){hint}")
        if estimate.reply_bytes > self.limits.max_reply_bytes:
            raise error(Code.TOO_LARGE, f"{method.name}: the reply would take at least {estimate.reply_bytes} bytes, "
                                        f"over server.max_reply_bytes ({self.limits.max_reply_bytes}){hint}")

    def _fits(self, estimate: Estimate) -> int | None:
        """The most keys a request like the estimated one may carry: its fixed cost plus that
        many keys within the budget, and (keys said) their reply within ``max_reply_bytes``;
        None when its cost does not grow with its keys."""
        rate = estimate.per_key_micros
        if rate <= 0:
            return None
        fixed = max(0.0, estimate.micros - estimate.keys * rate) if estimate.keys else 0.0
        fits = int((self._budget_us - fixed) / rate)
        while fits > 0 and fixed + fits * rate > self._budget_us:  # float rounding: fit for sure
            fits -= 1
        if estimate.keys and estimate.reply_bytes:
            fits = min(fits, self.limits.max_reply_bytes * estimate.keys // estimate.reply_bytes)
        return max(0, min(fits, self.limits.max_keys))

    def _carry(self, outcome: _Outcome, reason: str) -> None:
        if len(self._carried) >= self.limits.max_carried:
            outcome.error = self._to_error(Unavailable(f"server busy: {len(self._carried)} requests waiting; retry"),
                                           outcome.method.name if outcome.method else "carry")
            outcome.waiting = False
            return
        self.metrics.carried.labels(reason).inc()
        outcome.carried = True
        self._carried.append(outcome)

    # -- run ------------------------------------------------------------------------------------

    def _run_grouped(self, outcomes: list[_Outcome]) -> None:
        """Reads run at once; writes wait in one group that commits when it must (before a read
        of a peer with a write in it, and at the end) — so every reply follows its commit."""
        writes: list[_Outcome] = []
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

    def _commit_group(self, writes: list[_Outcome]) -> None:
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
        wired = self._to_error(failure, "commit")
        for outcome in writes:
            if outcome.error is None:
                outcome.error, outcome.result = wired, None

    def _commit_once(self, writes: list[_Outcome]) -> None:
        with self._group():
            for outcome in writes:
                self._execute(outcome)
        self.metrics.commits.inc()

    def _run_alone(self, outcome: _Outcome) -> None:
        assert outcome.method is not None  # internal: the caller passes runnable outcomes
        if not outcome.method.writes:
            self._execute(outcome)
            return
        self._commit_group([outcome])

    def _execute(self, outcome: _Outcome) -> None:
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
            outcome.error, outcome.result = self._to_error(exc, method.name), None
        elapsed = time.perf_counter() - started
        self.metrics.rpc.request(method.name, elapsed)
        if self._access_log:
            status = "ok" if outcome.error is None else outcome.error["name"]
            log.info("rpc %s %s %.0fus", method.name, status, elapsed * 1e6)

    def _check_sizes(self, params: Any) -> None:
        """``max_keys`` / ``max_tokens`` (the schema's ceilings are checked by the decoder)."""
        if isinstance(params, dict):  # a method without a Struct: its raw map
            for name, limit in self._limited(_SIZED_NAMES):
                self._check_size(name, params.get(name), limit)
            return
        # Every request passes here: the Struct type's limited fields are looked up once, and
        # only a list over its limit costs more than a length read.
        for name, limit in self._sized_fields(type(params)):
            value = getattr(params, name)
            if isinstance(value, list) and len(value) > limit:
                self._check_size(name, value, limit)

    def _sized_fields(self, kind: type) -> tuple[tuple[str, int], ...]:
        fields = self._sized.get(kind)
        if fields is None:
            names = getattr(kind, "__struct_fields__", ())
            fields = self._sized[kind] = self._limited(tuple(n for n in _SIZED_NAMES if n in names))
        return fields

    def _limited(self, names: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
        """``(field, its length limit)`` of each name."""
        return tuple((n, self.limits.max_tokens if n == "token_ids" else self.limits.max_keys) for n in names)

    def _check_size(self, name: str, value: Any, limit: int) -> None:
        if not isinstance(value, list) or len(value) <= limit:
            return
        key = "server.max_tokens" if name == "token_ids" else "server.max_keys"
        raise error(Code.TOO_MANY_KEYS, f"{name} has {len(value)} entries; the limit is {limit} ({key})")

    def _validate(self, method: Method, params: dict[str, Any]) -> Any:
        self._check_sizes(params)
        if method.request is None:
            return params
        decode = self._decoders.get(method.request)
        if decode is None:
            decode = self._decoders[method.request] = _struct_decoder(method.request)
        try:
            return decode(params)
        except msgspec.ValidationError as exc:
            raise _schema_error(method, exc) from None

    def _to_error(self, exc: BaseException, where: str) -> dict[str, Any]:
        if not isinstance(exc, KvcmError):
            log.exception("internal error in %s", where, exc_info=exc)
            exc = ServerError(f"internal error in {where}: {type(exc).__name__}")
        if exc.code == Code.CAPACITY_EXHAUSTED:
            self.metrics.store_errors.labels("map_full").inc()
        self.metrics.errors.labels(where, exc.code.name).inc()
        return exc.to_wire()

    def _reply(self, outcome: _Outcome) -> bytes | None:
        if outcome.msgid is None:
            return None  # notifications are never answered, errors included
        try:
            result = None if outcome.error is not None else ({} if outcome.result is None else outcome.result)
            if isinstance(result, wire.Raw) and len(result.data) > self.limits.max_reply_bytes:
                raise self._too_large(outcome, len(result.data))
            reply = wire.pack_response(outcome.msgid, outcome.error, result)
            if len(reply) > self.limits.max_reply_bytes:
                raise self._too_large(outcome, len(reply))
            return reply
        except KvcmError as exc:
            where = outcome.method.name if outcome.method else "reply"
            return wire.pack_response(outcome.msgid, self._to_error(exc, where), None)
        except Exception as exc:
            log.exception("cannot pack the reply of msgid %s", outcome.msgid, exc_info=exc)
            return wire.pack_response(outcome.msgid, ServerError("reply could not be encoded").to_wire(), None)

    def _too_large(self, outcome: _Outcome, size: int) -> KvcmError:
        name = outcome.method.name if outcome.method else "reply"
        return error(Code.TOO_LARGE, f"{name}: the reply of {size} bytes exceeds server.max_reply_bytes "
                                     f"({self.limits.max_reply_bytes}); ask for fewer keys")


def _schema_error(method: Method, exc: msgspec.ValidationError) -> KvcmError:
    """The request's validation error; a list over the schema's ceiling is TOO_MANY_KEYS."""
    assert method.request is not None  # internal: only Struct requests are validated
    refused = schema.invalid(method.name, method.request, exc)
    if "Expected `array` of length <=" in str(exc):
        return error(Code.TOO_MANY_KEYS, refused.message)
    return refused


def _decode_failure(exc: Exception) -> KvcmError:
    if isinstance(exc, KvcmError):
        return exc
    if isinstance(exc, RecursionError):
        return InvalidArgument("request is nested too deeply")
    return InvalidArgument(f"request cannot be decoded: {type(exc).__name__}")


def _struct_decoder(kind: type) -> Callable[[Any], Any]:
    def decode(params: Any) -> Any:
        return msgspec.convert(params, kind, strict=True)

    return decode

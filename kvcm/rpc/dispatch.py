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
4. **prepare**: the method's ``prepare`` hook does what must happen before the request can be
   costed (``token_ids`` hashed into ``block_keys``: :mod:`kvcm.api.token_keys`) a slice at a
   time, within the turn's preparation allowance, so a long prompt spreads over several turns
   instead of holding everyone else up.
5. **cost**: the method's estimate of its work (microseconds) and of its smallest reply; over the
   per-request budget or ``max_reply_bytes`` it is ``TOO_LARGE``, before any work.
6. **schedule**: small requests run first; heavy ones run while the turn's budget lasts and the
   rest wait for the next turn (new small requests go ahead of them then too). One peer's
   requests never overtake each other: behind a carried request, its peer's later ones wait.
   The common case skips the scheduling: a small read (a method with a Struct, no write and no
   turn-wide hook) whose peer has nothing carried or pending before it is admitted and run as
   soon as it is parsed (the express lane).
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
from typing import Any

import msgspec

from kvcm.errors import Code, InvalidArgument, KvcmError, ServerError, Unavailable, error
from kvcm.metrics import Metrics
from kvcm.proto import wire
from kvcm.rpc.methods import (
    Admission,
    Authorizer,
    Deferred,
    Estimate,
    Gate,
    Limits,
    Method,
    Preparation,
    Prepare,
)
from kvcm.rpc.outcome import Outcome
from kvcm.rpc.run import Runner
from kvcm.rpc.tarpit import Tarpit
from kvcm.rpc.told import ToldToWait
from kvcm.rpc.validation import RequestDecoder, SizeCheck, decode_failure, schema_error

__all__ = ["Admission", "Authorizer", "Deferred", "Dispatcher", "Estimate", "Gate", "Limits", "Method",
           "Preparation", "Prepare"]

log = logging.getLogger("kvcm.rpc.dispatch")

#: Preparation (``token_ids`` hashing) one turn does at most (microseconds; a request not
#: started yet always gets a first slice): the rest is carried to the next turn, so the requests
#: that arrive meanwhile are answered between slices instead of after all of a long prompt's
#: hashing. The turn's replies are sent when it ends, so this, not the turn budget, is what one
#: client's long prompt adds to everyone else's latency (scripts/bench_hostile ``largest``).
_PREPARE_TURN_US = 500.0
#: A request estimated at no more than this share of the budget is "small": it is never held back
#: for the budget's sake, only behind its own peer's carried requests.
_SMALL_SHARE = 0.02
#: While a request waits for a verdict from another thread, the loop looks again this often.
_AUTH_POLL_MS = 2


class _Carry(Exception):
    """Internal: the request goes on in a later turn (``reason`` is counted)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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
        group: Callable[[], AbstractContextManager[object]] | None = None,
        atomic: Callable[[], AbstractContextManager[object]] | None = None,
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
        self._authorize = authorize
        self._gate = gate
        limits = limits or Limits()
        if max_keys is not None:
            limits = Limits(**{**limits.__dict__, "max_keys": max_keys})
        self.limits = limits
        self.budget_us = limits.turn_budget_ms * 1000.0
        self._group_commit = group_commit
        # Each write request runs in its own write() block (a savepoint), so a request that
        # fails half-way rolls back alone, whatever the handler did before it raised.
        self._runner = Runner(self.metrics, self._to_error, group or nullcontext, atomic or nullcontext, grow,
                              access_log)
        self._requests = RequestDecoder()
        self._sizes = SizeCheck(limits)
        self._fast: dict[str, tuple[Method, Callable[[memoryview], tuple[object]]]] = {}
        self._carried: list[Outcome] = []
        self._told_to_wait = ToldToWait()
        self._preparing_us = 0.0
        self._tarpit = Tarpit(limits.refusal_hold_ms / 1000.0)
        self._settling = any(m.settle is not None for m in self.methods.values())
        self._admitting = any(m.admitted is not None for m in self.methods.values())
        #: the methods of the express lane (:meth:`_express`): reads decoded straight into their
        #: Struct, with no turn-wide hook
        self._express_methods = frozenset(
            m.name for m in self.methods.values()
            if m.request is not None and not m.writes and m.settle is None and m.admitted is None)
        for method in self.methods.values():
            if method.request is not None:
                decoder = msgspec.msgpack.Decoder(tuple[method.request], ext_hook=wire.refuse_ext)  # type: ignore[name-defined]
                self._fast[method.name] = (method, decoder.decode)

    @property
    def typed_decode(self) -> bool:
        """Requests are decoded straight into their Structs."""
        return bool(self._fast)

    # -- entry points ---------------------------------------------------------------------------

    def serve(self, arrivals: Sequence[tuple[object, bytes, bytes]]) -> list[tuple[object, bytes | None]]:
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

    def _turn(self, arrivals: Sequence[tuple[object, bytes, bytes]]) -> list[tuple[object, bytes | None]]:
        self._preparing_us = 0.0  # real time this turn spent preparing requests
        fresh = [self._parse(payload, tag, peer) for tag, peer, payload in arrivals]
        carried, self._carried = self._carried, []
        ran, rest = self._express(fresh, {o.peer for o in carried}) if self._express_methods else ([], fresh)
        self._remember_waits(ran)
        if not rest and not carried:
            return self._answer(ran)
        # what the express lane carried waits for a later turn, and its peers' later requests too
        finished = self._schedule(carried + rest, {o.peer for o in self._carried})
        self._remember_waits(finished)
        runnable = [o for o in finished if o.error is None and o.method is not None]
        if self._admitting:
            runnable = self._admit_turn(runnable)
        self._runner.run(runnable, self._group_commit)
        if self._settling:
            self._settle(runnable)
        return self._answer(ran + finished if ran else finished)

    # -- the express lane -----------------------------------------------------------------------

    def _express(self, fresh: list[Outcome], slow: set[bytes]) -> tuple[list[Outcome], list[Outcome]]:
        """Small reads run at once, in arrival order, without the scheduling below: ``(ran,
        rest)``. A request of any other kind (a write, heavy work, a refusal to explain) goes to
        the full path, one that must wait (a verdict, a long preparation) is carried, and so
        goes every later request of its peer, which must not overtake it (nor a peer's carried
        ones: ``slow`` holds the peers with one)."""
        ran: list[Outcome] = []
        rest: list[Outcome] = []
        for outcome in fresh:
            method = outcome.method
            if (outcome.peer not in slow and method is not None and method.name in self._express_methods
                    and outcome.error is None):
                try:
                    if self._run_express(outcome):
                        ran.append(outcome)
                        continue
                except _Carry as carry:  # each step runs once: what it began goes on in a later turn
                    self._carry(outcome, carry.reason)
                    if outcome.error is not None:  # nothing more may wait: answered now
                        rest.append(outcome)
                    slow.add(outcome.peer)
                    continue
            slow.add(outcome.peer)
            rest.append(outcome)
        return ran, rest

    def _run_express(self, outcome: Outcome) -> bool:
        """Admit and run one small read now (True), or leave it, as far as it got, to the full
        path (False: heavy work, or an error found here, answered there). Raises
        :class:`_Carry` for a request that must wait."""
        try:
            if self._admit(outcome, 0.0, False) is not None:
                return False  # heavy: scheduled against the turn's budget
        except _Carry:
            raise
        except Exception as exc:  # noqa: BLE001 - admission failures are the request's own
            assert outcome.method is not None  # internal: only resolved methods are expressed
            outcome.error = self._to_error(exc, outcome.method.name)
            return False
        self._runner.run_read(outcome)
        return True

    def _answer(self, finished: list[Outcome]) -> list[tuple[object, bytes | None]]:
        """The replies to send now: a big request's refusal for its sender's fault is held
        (:mod:`kvcm.rpc.tarpit`) and sent in a later turn with those held before whose time came."""
        out: list[tuple[object, bytes | None]] = []
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

    def _admit_turn(self, runnable: list[Outcome]) -> list[Outcome]:
        """Each method with an ``admitted`` hook is told its requests of the turn
        (:attr:`Method.admitted`); the outcomes that still run."""
        hooks: dict[str, tuple[Callable[[list[Any]], object], list[Outcome]]] = {}
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

    def _settle(self, ran: list[Outcome]) -> None:
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

    def _parse(self, payload: bytes, tag: object = None, peer: bytes = b"") -> Outcome:
        outcome = self._parse_one(payload, tag, peer)
        outcome.size = len(payload)
        return outcome

    def _parse_one(self, payload: bytes, tag: object, peer: bytes) -> Outcome:
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
            outcome = Outcome(wire.peek_msgid(payload), None, tag, peer)
            outcome.error = self._to_error(decode_failure(exc), "decode")
            return outcome

    def _parse_slow(self, payload: bytes, tag: object, peer: bytes) -> Outcome:
        try:
            request = wire.parse_request(payload)
        except wire.BadEnvelope as exc:
            self.metrics.bad_messages.labels("envelope").inc()
            # msgid 0 when unreadable: a REQ client must get *some* reply or it is stuck.
            outcome = Outcome(exc.msgid if exc.msgid is not None else wire.peek_msgid(payload), None, tag, peer)
            outcome.error = InvalidArgument(str(exc)).to_wire()
            return outcome
        method = self.methods.get(request.method)
        outcome = Outcome(request.msgid, method, tag, peer)
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

    def _parse_fast(self, payload: bytes, tag: object, peer: bytes) -> Outcome | None:
        split = wire.split_request(payload)
        if split is None:
            return None  # anything the fast path does not take, the slow path explains
        msgid, name, raw = split
        entry = self._fast.get(name)
        if entry is None:
            return None
        method = entry[0]
        outcome = Outcome(msgid, method, tag, peer)
        try:
            (outcome.params,) = entry[1](raw)
            self._sizes.check(outcome.params)
        except msgspec.ValidationError as exc:
            # A field of [ {map} ] is wrong: answer from here. Decoding it all again in the slow
            # path would cost a multi-megabyte request twice (the schema caps lists by their
            # header, before any element is decoded).
            message = str(exc)
            if "`$[0]" not in message:
                return None  # e.g. a bare params map: the slow path takes it
            relative = msgspec.ValidationError(message.replace("`$[0]", "`$"))
            outcome.error = self._to_error(schema_error(method, relative), method.name)
        except KvcmError as exc:
            outcome.error = self._to_error(exc, method.name)
        except Exception:  # noqa: BLE001 - e.g. RecursionError: the slow path explains
            return None
        return outcome

    # -- told to wait ---------------------------------------------------------------------------

    def _remember_waits(self, finished: list[Outcome]) -> None:
        for outcome in finished:
            if outcome.error is not None and outcome.method is not None:
                self._told_to_wait.remember(outcome.peer, outcome.method.name, outcome.error)

    def _still_waiting(self, payload: bytes, tag: object, peer: bytes) -> Outcome | None:
        waiting = self._told_to_wait.refusal(payload, peer)
        if waiting is None:
            return None
        outcome = Outcome(waiting.msgid, self.methods.get(waiting.method), tag, peer)
        outcome.told_until = waiting.until
        self.metrics.bad_messages.labels("told_to_wait").inc()
        outcome.error = waiting.refusal.to_wire()
        return outcome

    # -- schedule -------------------------------------------------------------------------------

    def _schedule(self, outcomes: list[Outcome], blocked: set[bytes]) -> list[Outcome]:
        """Admit what runs this turn (small first, then heavy within the budget); carry the rest
        (and every request of the ``blocked`` peers: they have one carried already). Returns the
        finished outcomes (errors included) in the order they are to run."""
        spent = 0.0  # estimated microseconds of the heavy work admitted this turn
        small: list[Outcome] = []
        heavy: list[Outcome] = []
        # blocked: peers with a carried request: their later ones wait too
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

    def _admit(self, outcome: Outcome, spent: float, heavy_admitted: bool) -> float | None:
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
        if method.prepare is not None and not self._prepare(outcome, method):
            assert outcome.preparing is not None  # internal: unfinished work is kept
            raise _Carry(outcome.preparing.reason)
        if method.cost is None:
            return None
        estimate = method.cost(params)
        if estimate.micros > self.budget_us or estimate.reply_bytes > self.limits.max_reply_bytes:
            self.refuse(method, estimate)
        if estimate.micros <= self.budget_us * _SMALL_SHARE:
            return None
        if heavy_admitted and spent + self._preparing_us + estimate.micros > self.budget_us:
            raise _Carry("budget")
        return estimate.micros

    def _prepare(self, outcome: Outcome, method: Method) -> bool:
        """Advance the request's preparation while the turn's allowance
        (:data:`_PREPARE_TURN_US`) lasts; True once it is prepared."""
        if outcome.prepared:
            return True
        preparing = outcome.preparing
        if preparing is None:
            assert method.prepare is not None  # internal: checked by the caller
            preparing = method.prepare(outcome.params, Admission(method, outcome.params, self.limits, self.refuse))
            if preparing is None:
                outcome.prepared = True
                return True
            outcome.preparing = preparing
        began = time.perf_counter()
        try:
            done = preparing.advance(began + (_PREPARE_TURN_US - self._preparing_us) / 1e6)
        finally:
            self._preparing_us += (time.perf_counter() - began) * 1e6
        if done:
            outcome.preparing, outcome.prepared = None, True
        return done

    def refuse(self, method: Method, estimate: Estimate, per_key: tuple[int, str] | None = None) -> None:
        """TOO_LARGE for an estimate over the turn's budget or ``max_reply_bytes``, naming the
        most keys that fit (and, given ``per_key = (n, what)``, the ``what`` they stand for)."""
        fits = self._fits(estimate)
        hint = "" if fits is None else f"; send at most {fits} keys per request" + \
            (f" ({fits * per_key[0]} {per_key[1]})" if per_key else "")
        if estimate.micros > self.budget_us:
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
        fits = int((self.budget_us - fixed) / rate)
        while fits > 0 and fixed + fits * rate > self.budget_us:  # float rounding: fit for sure
            fits -= 1
        if estimate.keys and estimate.reply_bytes:
            fits = min(fits, self.limits.max_reply_bytes * estimate.keys // estimate.reply_bytes)
        return max(0, min(fits, self.limits.max_keys))

    def _carry(self, outcome: Outcome, reason: str) -> None:
        if len(self._carried) >= self.limits.max_carried:
            outcome.error = self._to_error(Unavailable(f"server busy: {len(self._carried)} requests waiting; retry"),
                                           outcome.method.name if outcome.method else "carry")
            outcome.waiting = False
            return
        self.metrics.carried.labels(reason).inc()
        outcome.carried = True
        self._carried.append(outcome)

    def _validate(self, method: Method, params: dict[str, object]) -> object:
        self._sizes.check(params)
        if method.request is None:
            return params
        return self._requests.decode(method, params)

    def _to_error(self, exc: BaseException, where: str) -> dict[str, Any]:
        if not isinstance(exc, KvcmError):
            log.exception("internal error in %s", where, exc_info=exc)
            exc = ServerError(f"internal error in {where}: {type(exc).__name__}")
        if exc.code == Code.CAPACITY_EXHAUSTED:
            self.metrics.store_errors.labels("map_full").inc()
        self.metrics.errors.labels(where, exc.code.name).inc()
        return exc.to_wire()

    def _reply(self, outcome: Outcome) -> bytes | None:
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

    def _too_large(self, outcome: Outcome, size: int) -> KvcmError:
        name = outcome.method.name if outcome.method else "reply"
        return error(Code.TOO_LARGE, f"{name}: the reply of {size} bytes exceeds server.max_reply_bytes "
                                     f"({self.limits.max_reply_bytes}); ask for fewer keys")

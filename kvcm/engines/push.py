"""Push ingestion: engines that cannot expose a ZeroMQ PUB socket report through ``report_events``.

LMCache in multi-process mode, storage tiers, SGLang behind HTTP and TRT-LLM can call an RPC but
not host a socket kvcm subscribes to. A *push source* registers itself, heartbeats, and sends its
batches; kvcm applies them to the same :class:`~kvcm.engines.index.EngineIndex` as the
subscriber's, so ``match_engines`` sees push and ZeroMQ sources alike. One report is one
:class:`Report`, with an ``op``:

* ``register``: create the source (``instance_id``, ``dp_rank``, ``pod``, ``medium``,
  ``report_mode``) at a ``generation``; the same registration again is a no-op, a higher
  generation replaces the source (a restarted engine: its blocks are dropped);
* ``heartbeat``: heard, nothing else;
* ``payloads``: vLLM-encoded ``KVEventBatch`` bytes with their seq, decoded by the subscriber's
  own lenient codec (:func:`kvcm.proto.kv_events.decode_batch`: a broken event is counted and skipped);
* ``events``: one batch of decoded events (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``) at a seq; a batch of keyed events (kvcm keys, no tokens: Tair's
  reporters) may have none, and is then applied as it comes, the position unchanged;
* ``snapshot``: the source's whole content (stores only), replacing every block it held in one
  step; a higher generation here also replaces the registration;
* ``down``: the engine is going away: the source and its blocks are dropped.

Generations: a report of a generation lower than the source's is refused (VERSION_CONFLICT): it
comes from an engine incarnation that was replaced, and applying it would mix two caches. Only
``register`` and ``snapshot`` may raise the generation; any other op at a higher one is refused
too (the reporter must say what the new incarnation holds first).

Sequence numbers: within a generation, a batch at or below the last applied seq is a duplicate
(ignored, counted: a retried report is harmless); one past ``last_seq + 1`` is a gap. A push
source cannot be replayed, so the batch is applied, the missed batches are counted, the source's
state is ``gap``, and every reply says ``resync: true`` until a snapshot arrives. An expired push
source (not heard for ``events.expire_after_s``: its blocks were dropped) is in the same state
when heard again. The first batch after a registration, or after a snapshot sent without a seq,
sets the baseline.

Ownership (auth on): a source records the account that registered it; later reports must come
from it or an admin (:class:`Reporter`). A non-admin may only register ids in the namespace of
the instance it registers for, ``<instance_id>/...`` (Tair's reporters: ``tair/<instance_id>/...``):
instance ids are one namespace with a tenant each, so no tenant can take an id another tenant's
engines will use (Tair's ids are predictable). Registering counts against the account's quota and
leaves the slots kept for admins (``EngineService``).

Liveness is the subscriber's (:class:`~kvcm.engines.subscriber.EventSubscriber` keeps a socket-less
connection per push source): every report is heard, so a source that neither reports nor
heartbeats turns stale and then expires exactly like a silent ZeroMQ publisher.

Each report is applied and persisted before it is answered: ``register``, ``snapshot`` and
``down`` by themselves, batches (``payloads``, ``events``) at the end of their dispatcher turn
(the method's ``settle``: one engine-store transaction for all the turn's reports, in the RPC
thread, before any of its replies). A kvcm crash loses no acknowledged batch. The engine store
is not synced, so a power loss may still lose the last ones, and since no push source can be
replayed, every push source loaded at start-up is in state ``gap`` (``resync: true``) until its
next snapshot.

Speed: a reporter sends one batch per request, and one chain's re-hash is the slow part of
applying it. :meth:`PushIngest.prepare` decodes a report's batches (the method's cost hook, which
needs the decoded sizes anyway); :meth:`PushIngest.pool` is told the reports that run in the
dispatcher turn (the method's ``admitted`` hook, before any of them runs: a report carried to a
later turn is not among them, so no batch is hashed twice) and pools their batches; the first
report applied hashes the whole pool at once (:func:`kvcm.engines.hashing.chain_states_many`);
the rest find their states ready.

Thread ownership: the RPC thread calls :meth:`PushIngest.prepare`, :meth:`PushIngest.pool` and
:meth:`PushIngest.report`; they change a push source's sequencing state and the index under the
index lock (see ``kvcm.engines.subscriber``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import msgspec

from kvcm.cache.keys import native_states
from kvcm.engines.entries import ApplyStats, Item, SourceState, Tally
from kvcm.engines.hashing import Precomputed
from kvcm.engines.hybrid import INCREMENTAL
from kvcm.engines.index import EngineIndex
from kvcm.engines.metrics import EventMetrics
from kvcm.engines.sourceconn import SourceConn
from kvcm.engines.sources import SourceSpec, push_spec
from kvcm.engines.subscriber import EventSubscriber
from kvcm.errors import AccessDenied, Code, Conflict, InvalidArgument, NotFound, error
from kvcm.proto.kv_events import BlockRemoved, BlockStored, DecodedBatch, Event, EventDecodeError, decode_batch
from kvcm.proto.wire import Encodable

OPS = ("register", "heartbeat", "payloads", "events", "snapshot", "down")
#: Batches pooled for one turn's hashing at most (beyond, reports hash on their own).
MAX_POOL = 4096

#: ``authorize(spec)``: allow the caller to report for this registered source, or raise.
Authorize = Callable[[SourceSpec], None]


@dataclasses.dataclass(frozen=True)
class Reporter:
    """The caller of a report with auth on (None everywhere when auth is off: anyone may report)."""

    name: str  # the account: a source it registers is its own
    admin: bool  # reports for any source, registers any id, past the accounts' quotas
    authorize: Authorize  # may it report for this registered source? (raises if not)


#: ``check_room(reporter)``: raise unless a new push source of ``reporter`` fits the limits.
CheckRoom = Callable[[Reporter | None], None]


class Report(msgspec.Struct):
    """One ``report_events`` request, validated by the API layer (``kvcm/api/engines.py``). A
    Struct: one is made per request, and its constructor is C (a dataclass's ran ~80 opcodes)."""

    source_id: str
    op: str
    generation: int = 0
    instance_id: str | None = None
    dp_rank: int = 0
    pod: str = ""
    medium: str = ""
    report_mode: str = INCREMENTAL  # register: vLLM's kv_cache_report_mode of the engine's requests
    seq: int | None = None
    ts: float | None = None
    events: list[Event] = msgspec.field(default_factory=list)
    payloads: list[tuple[int, bytes]] = msgspec.field(default_factory=list)
    #: ``(seq, batch)`` decoded by :meth:`PushIngest.prepare` (None: a payload that is no batch)
    batches: list[tuple[int, DecodedBatch | None]] | None = None
    #: the hashing pool its batches were put in (:attr:`PushIngest._pool_id`; 0: none)
    pooled: int = 0


class _Outcome:
    """What one report did, for its reply (a plain class: one is made per report)."""

    __slots__ = ("applied", "duplicates", "errors", "missed")

    def __init__(self) -> None:
        self.applied = self.duplicates = self.missed = 0
        self.errors: Tally = defaultdict(int)


class PushIngest:
    """``report_events`` over the engine index and the subscriber's liveness (module docstring)."""

    def __init__(
        self,
        index: EngineIndex,
        subscriber: EventSubscriber,
        metrics: EventMetrics,
        instance_lookup: Callable[[str], int],
        check_room: CheckRoom,
    ) -> None:
        self.index = index
        self.subscriber = subscriber
        self.metrics = metrics
        self.instance_lookup = instance_lookup
        self.check_room = check_room
        self._pool: list[Item] = []
        self._hashed: Precomputed | None = None  # the pool's states, once the first report used them
        self._pending = 0  # pooled reports that have not run yet
        self._pool_id = 1  # of the current pool (a report names the pool it is in)

    def prepare(self, r: Report) -> None:
        """Decode the report's batches (idempotent)."""
        if r.batches is None:
            r.batches = _batches(r)

    def pool(self, reports: Sequence[Report]) -> None:
        """The reports about to run, together: their batches are hashed at once when the first
        of them is applied (module docstring). A new pool replaces any earlier one."""
        self._new_pool()
        for r in reports:
            state = self.index.get(r.source_id)
            if state is None or not state.spec.push or len(self._pool) >= MAX_POOL or r.pooled == self._pool_id:
                continue
            self.prepare(r)
            self._pool += [(r.source_id, state.generation, seq, b) for seq, b in r.batches or () if b is not None]
            r.pooled = self._pool_id
            self._pending += 1

    def _new_pool(self) -> None:
        self._pool, self._hashed, self._pending = [], None, 0
        self._pool_id += 1

    def _pooled(self, r: Report) -> Precomputed:
        if r.pooled != self._pool_id:
            return {}
        if self._hashed is None:
            self._hashed = self.index.precompute(self._pool) if len(self._pool) > 1 else {}
        return self._hashed

    def report(self, r: Report, reporter: Reporter | None = None) -> dict[str, Encodable]:
        """Handle one report; ``reporter`` is its caller with auth on (a new source's owner)."""
        try:
            return self._report(r, reporter)
        finally:
            self._ran(r)

    def _ran(self, r: Report) -> None:
        """The pool is dropped once its last report ran: its batches and states would otherwise
        live on until the next turn, walked by every collection in between."""
        if r.pooled == self._pool_id:
            r.pooled = 0
            self._pending -= 1
            if not self._pending:
                self._new_pool()

    def _report(self, r: Report, reporter: Reporter | None) -> dict[str, Encodable]:
        if r.op == "register":
            return self._register(r, reporter)
        state = self.index.get(r.source_id)
        if state is None or not state.spec.push:
            what = "is a ZeroMQ source (add_event_source)" if state is not None else "is not registered"
            raise NotFound(f"event source {r.source_id[:200]!r} {what}: report_events needs a push source "
                           f"(op register first)")
        if reporter is not None:
            reporter.authorize(state.spec)
        state = self._generation(state, r)
        if r.op == "down":
            return self._down(state)
        conn = self._conn(state)
        outcome = _Outcome()
        if r.batches is None:
            r.batches = _batches(r)
        if r.op == "snapshot":
            self._snapshot(state, conn, r, outcome)
        else:
            items = self._place(state, conn, r, outcome)
            with self.index.lock:
                self.subscriber.heard_push(conn)
                results = self.index.apply_many(items, self._pooled(r)) if items else []
            self._count(conn, items, results, outcome)
        if r.op == "snapshot" or not self.subscriber.running:
            self.index.flush()  # batches: the turn's settle persists them (module docstring)
        return self._reply(state.spec, conn, outcome)

    # --- registration -----------------------------------------------------------------------------

    def _register(self, r: Report, reporter: Reporter | None) -> dict[str, Encodable]:
        if r.instance_id is None:
            raise InvalidArgument("report_events: op register needs instance_id")
        spec = push_spec(r.source_id, r.instance_id, dp_rank=r.dp_rank, pod=r.pod, medium=r.medium,
                         generation=r.generation, owner=reporter.name if reporter is not None else "",
                         report_mode=r.report_mode)  # fmt: skip
        state = self.index.get(r.source_id)
        if state is None:
            self.instance_lookup(spec.instance_id)  # raises NotFound for an unknown instance
            _check_namespace(spec, reporter)
            self.check_room(reporter)
            state = self._create(spec)
            return self._reply(spec, self._conn(state), _Outcome())
        old = state.spec
        if not old.push:
            raise Conflict(f"event source {r.source_id[:200]!r} is a ZeroMQ source (add_event_source); "
                           f"a push source needs another source_id")
        if reporter is not None:
            reporter.authorize(old)
        if spec.instance_id != old.instance_id:
            _check_namespace(spec, reporter)
        self._check_not_older(old, r.generation)
        spec = dataclasses.replace(spec, owner=old.owner)  # an admin re-registering keeps the owner
        if spec != old:
            if r.generation == old.generation:
                raise Conflict(f"push source {r.source_id[:200]!r} is registered at generation {old.generation} "
                               f"with other fields; register with a higher generation to replace it")
            self.instance_lookup(spec.instance_id)
            state = self._replace(state, spec)
        conn = self._conn(state)
        with self.index.lock:
            self.subscriber.heard_push(conn)
        return self._reply(spec, conn, _Outcome())

    def _create(self, spec: SourceSpec) -> SourceState:
        state = self.index.add_source(spec)
        with self.index.lock:
            conn = self.subscriber.add_push(spec, state.generation)
            self.subscriber.heard_push(conn)
        return state

    def _replace(self, state: SourceState, spec: SourceSpec) -> SourceState:
        """A new incarnation: the old one's blocks, position and counters are dropped."""
        self.subscriber.remove(state.spec.source_id)
        self.index.remove_source(state.spec.source_id)
        return self._create(spec)

    def _generation(self, state: SourceState, r: Report) -> SourceState:
        """The source to apply ``r`` to: refused if older; replaced by a snapshot's newer one."""
        spec = state.spec
        self._check_not_older(spec, r.generation)
        if r.generation == spec.generation:
            return state
        if r.op != "snapshot":
            raise error(Code.VERSION_CONFLICT,
                        f"push source {spec.source_id[:200]!r} is at generation {spec.generation}; a new generation "
                        f"({r.generation}) starts with op register or snapshot")  # fmt: skip
        return self._replace(state, dataclasses.replace(spec, generation=r.generation))

    @staticmethod
    def _check_not_older(spec: SourceSpec, generation: int) -> None:
        if generation < spec.generation:
            raise error(Code.VERSION_CONFLICT,
                        f"push source {spec.source_id[:200]!r} is at generation {spec.generation}: a report of "
                        f"generation {generation} comes from a replaced engine and is refused")  # fmt: skip

    def _down(self, state: SourceState) -> dict[str, Encodable]:
        source_id = state.spec.source_id
        self.subscriber.remove(source_id)
        self.index.remove_source(source_id)
        return {"source_id": source_id, "generation": state.spec.generation, "state": "down", "resync": False,
                "last_seq": state.last_seq}

    def _conn(self, state: SourceState) -> SourceConn:
        conn = self.subscriber.push_conn(state.spec.source_id)
        if conn is None:  # removed by a race: follow it again, not knowing what it missed
            conn = self.subscriber.add_push(state.spec, state.generation, state.last_seq, state.last_ts)
            conn.gap = True
        return conn

    # --- batches --------------------------------------------------------------------------------------

    def _place(self, state: SourceState, conn: SourceConn, r: Report, outcome: _Outcome) -> list[Item]:
        """The report's batches in seq order against ``last_seq``: duplicates dropped, gaps counted."""
        items: list[Item] = []
        for seq, batch in sorted(r.batches or (), key=lambda b: b[0]):
            self._received(conn, batch, outcome)
            last = conn.last_seq
            if r.seq is None and r.op == "events":
                seq = last  # unsequenced (Tair's reporters): applied as it comes, the position kept
            elif last >= 0 and seq <= last:
                outcome.duplicates += 1
                conn.stats["duplicates"] += 1
                continue
            elif last >= 0 and seq > last + 1:
                outcome.missed += seq - last - 1
                conn.stats["missed"] += seq - last - 1
                self.metrics.missed.labels(state.spec.source_id).inc(seq - last - 1)
                conn.gap = True  # removals may be among the missed: held blocks may be stale
            conn.last_seq = seq
            if batch is None:
                batch = DecodedBatch(conn.last_ts, [])  # garbage: its seq is still consumed
            _default_medium(batch.events, state.spec.medium)
            conn.last_ts = batch.ts
            items.append((state.spec.source_id, state.generation, seq, batch))
        return items

    def _snapshot(self, state: SourceState, conn: SourceConn, r: Report, outcome: _Outcome) -> None:
        assert r.batches  # internal: _batches gives a snapshot its one batch
        seq, batch = r.batches[0]
        assert batch is not None  # internal: decoded events always make a batch
        _default_medium(batch.events, state.spec.medium)
        item: Item = (state.spec.source_id, state.generation, seq, batch)
        with self.index.lock:
            self.subscriber.heard_push(conn)
            result = self.index.replace_source(item, self._pooled(r))
            conn.last_seq, conn.last_ts = seq, batch.ts
            conn.gap = conn.expired = False
        self._count(conn, [item], [result], outcome)

    def _received(self, conn: SourceConn, batch: DecodedBatch | None, outcome: _Outcome) -> None:
        """Counted like the subscriber's: garbage, broken events, another DP rank's batch."""
        if batch is None:
            outcome.errors["decode"] += 1
            return
        self.metrics.received(conn.spec.source_id, batch.events)
        for kind in batch.errors:
            outcome.errors[kind] += 1
        if batch.data_parallel_rank is not None and batch.data_parallel_rank != conn.spec.dp_rank:
            outcome.errors["dp_rank_mismatch"] += 1

    def _count(self, conn: SourceConn, items: Sequence[Item], results: Sequence[ApplyStats | None],
               outcome: _Outcome) -> None:  # fmt: skip
        source_id = conn.spec.source_id
        for item, stats in zip(items, results):
            if stats is None:
                continue
            outcome.applied += stats.blocks
            self.metrics.applied(source_id, item[2])
            self.metrics.processed(source_id, stats.processed)
            for kind, n in stats.errors.items():
                if kind not in ("unknown_event", "bad_event"):  # decode kinds: counted on receipt
                    outcome.errors[kind] += n
        if items:
            conn.stats["last_event_time"] = time.time()
        for kind, n in outcome.errors.items():
            self.subscriber.count_error(conn, kind, n)

    def _reply(self, spec: SourceSpec, conn: SourceConn, outcome: _Outcome) -> dict[str, Encodable]:
        state, _ = self.subscriber.freshness(spec.source_id) or ("live", 0.0)
        return {
            "source_id": spec.source_id, "generation": spec.generation, "state": state,
            "resync": conn.gap, "last_seq": conn.last_seq, "applied_blocks": outcome.applied,
            "duplicates": outcome.duplicates, "missed": outcome.missed, "errors": dict(outcome.errors),
        }  # fmt: skip


def _check_namespace(spec: SourceSpec, reporter: Reporter | None) -> None:
    """A non-admin registers ids of its instance's namespace only (module docstring)."""
    if reporter is None or reporter.admin or namespace_of(spec.source_id) == spec.instance_id:
        return
    raise AccessDenied(f"report_events: a push source of instance {spec.instance_id[:200]!r} registered by a "
                       f"non-admin account must be named {spec.instance_id[:200] + '/'!r}... (or Tair's "
                       f"'tair/{spec.instance_id[:200]}/...'): the ids of other instances are their tenants'",
                       Code.PERMISSION_DENIED)


def namespace_of(source_id: str) -> str:
    """The instance whose namespace a push source id is in: ``<instance>/...``, or for Tair's
    reporters ``tair/<instance>/...`` (instance ids hold no ``/``); "" for an id without one."""
    parts = source_id.split("/", 2)
    if parts[0] == "tair" and len(parts) == 3:
        return parts[1]
    return parts[0] if len(parts) > 1 else ""


def _batches(r: Report) -> list[tuple[int, DecodedBatch | None]]:
    """The report's ``(seq, batch)``: payloads decoded leniently, like the subscriber does
    (garbage is None, broken events are skipped and named in ``batch.errors``)."""
    if r.op == "payloads":
        return [(seq, _decode(payload)) for seq, payload in r.payloads]
    if r.op in ("events", "snapshot"):
        seq = -1 if r.seq is None else r.seq  # a snapshot without seq: the next batch sets it
        return [(seq, DecodedBatch(time.time() if r.ts is None else r.ts, list(r.events)))]
    return []


def _decode(payload: bytes) -> DecodedBatch | None:
    try:
        return decode_batch(payload, packed_tokens=native_states() is not None)
    except EventDecodeError:
        return None


def _default_medium(events: Sequence[Event], medium: str) -> None:
    """Events that name no medium are held on the source's registered one."""
    if not medium:
        return
    for event in events:
        if (type(event) is BlockStored or type(event) is BlockRemoved) and event.medium is None:
            event.medium = medium

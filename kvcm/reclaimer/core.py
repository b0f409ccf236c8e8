"""Capacity management: the reclaimer keeps every instance group under its watermark.

Every ``reclaim.interval_s`` :meth:`Reclaimer.run_once` does, in order:

1. **sync** — read each group's :class:`Limits` (quota, per-type quotas, watermark, policy, TTL)
   afresh, so ``update_instance_group`` takes effect on the next tick without a restart. A changed
   policy (or sample size, or TTL switched on/off) rebuilds that group's policy state from
   ``manager.serving_keys``; a changed TTL value applies in place.
2. **drain** — fold the events the manager's listener hooks buffered since the last tick
   (blocks turned ``serving``, read hits, removals) into the policies, in arrival order. Reads are
   batched here, so a read hit costs the request path one ``deque.append``, not a write.
3. **TTL sweep** — blocks written ``ttl_seconds`` ago or more are reclaimed whatever the usage.
4. **watermark** — per group and storage type, when ``usage >= quota * used_percentage``, pick
   victims with the group's policy until ``usage <= quota * (used_percentage - hysteresis)``;
   likewise when usage reaches ``used_bytes`` (down to ``used_bytes * (1 - hysteresis)``),
   whichever mark asks more.
   A per-type quota frees bytes of that type; the group quota's excess is shared across types in
   proportion to their usage. Victims go to ``manager.evict``, which marks only ``serving``
   locations ``deleting`` (never ``writing`` ones) and hands them to the deleter after the group's
   ``delay_before_delete_ms``.

Policies are per group *and* per storage type (a block can live on several tiers), keyed
``(instance_id, block_key)``, built by :func:`kvcm.policies.make_policy` — the same classes the
offline optimizer replays, so an offline measurement holds online.

Fairness: all eviction jobs of a round (every group, every storage type) take turns, one chunk of
at most :data:`CHUNK` victims each, until satisfied or the round's ``max_victims_per_round``
budget is spent — one busy type or group cannot starve the others.

Overshoot guard: bytes handed to the deleter still count in ``manager.usage`` until they are
freed, ``delay_before_delete_ms`` later — or later still when the deleter lags under load. The
reclaimer remembers what each ``evict`` call marked ("in flight", with its due time) and
subtracts it until the head of the deleter's queue has moved past that due time, so it never
evicts again for bytes already on their way out (which, with a lagging deleter, would evict the
hot set too). (``on_removed`` cannot tell: the manager reports a key
removed when it stops serving, before its space is freed.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from prometheus_client import CollectorRegistry

from kvcm.cache.listeners import CacheListener
from kvcm.cache.room import Room
from kvcm.config import ReclaimConfig
from kvcm.reclaimer import plan
from kvcm.reclaimer.hooks import CacheHooks, ExactUsage, PinnedCache, deleter_head
from kvcm.reclaimer.persist import RecencyFile
from kvcm.reclaimer.state import GroupState, IKey, Limits, ReclaimMetrics, Tracked
from kvcm.reclaimer.victims import Job, Picker

log = logging.getLogger("kvcm.reclaimer")

CHUNK = 256  # victims per evict() call: keeps each write transaction short
_MAX_EVENTS = 1_000_000  # past this many buffered events, read hits are dropped (and counted)
_SERVE, _READ, _REMOVE = 0, 1, 2
_MAX_GIVEN = 65536  # in-line victims remembered for give_back (a request evicts at most inline_max_blocks)


@dataclass
class Round:
    """What one :meth:`Reclaimer.run_once` did (tests, the bench and logs read it)."""

    now: float
    victims: list[tuple[str, str, IKey, str]] = field(default_factory=list)  # group, type, key, reason
    freed: int = 0
    triggered: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Reclaimer(CacheListener):
    """Keeps usage of every instance group under its watermark (see the module docstring).

    Threads: the listener hooks (:meth:`on_serving`, :meth:`on_read`, :meth:`on_removed`) run on
    the RPC thread (and the deleter); they only append to a ``deque`` (atomic in CPython).
    :meth:`run_once` runs on the reclaimer thread (or in a test calling ``run_once(now)``),
    :meth:`make_room` on the RPC thread; both take the reclaimer's lock to read or change the
    policies, and neither holds it while the manager evicts.

    :param manager: the cache manager (see :class:`CacheHooks`); the reclaimer subscribes itself.
    :param limits: returns ``{group name: Limits}``; see :func:`~kvcm.reclaimer.state.limits_from_registry`.
    :param pace: called with the seconds of work after each evicted chunk; the thread uses it to
        sleep and bound its CPU share (``reclaim.duty_cycle``), tests leave it out.
    :param free_grace_s: only for a manager whose deleter queue cannot be watched
        (:func:`~kvcm.reclaimer.hooks.deleter_head`): how long after its delete delay an
        evicted location is assumed freed.
    :param state_dir: where recency survives restarts (:mod:`kvcm.reclaimer.persist`); None:
        policies are rebuilt from the store at start-up, in write order.
    """

    def __init__(
        self,
        manager: CacheHooks,
        limits: Callable[[], Mapping[str, Limits]],
        config: ReclaimConfig | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] | None = None,
        pace: Callable[[float], None] | None = None,
        free_grace_s: float = 0.25,
        state_dir: str | None = None,
    ) -> None:
        self._manager = manager
        self._limits = limits
        self._config = config or ReclaimConfig()
        self._clock: Callable[[], float] = clock or manager.clock
        self._pace = pace
        self._grace = free_grace_s
        self._deleter_head = deleter_head(manager)
        self.metrics = ReclaimMetrics(registry if registry is not None else CollectorRegistry())
        self._events: deque[tuple[Any, ...]] = deque()
        self._groups: dict[str, GroupState] = {}
        self._group_of: dict[str, str] = {}  # instance_id -> group
        self._picker = Picker(manager.pins if isinstance(manager, PinnedCache) else None)
        # Guards the policies and group states: the reclaimer thread and in-line eviction both
        # choose victims. Never held while the manager evicts (lock order: the write
        # transaction first, then in-memory locks).
        self._lock = threading.RLock()
        self._persist = RecencyFile(state_dir) if state_dir else None
        self._journal: list[Any] = []  # events folded in since the last append
        self._restored = self._persist is None
        self._next_round: float | None = None  # monotonic time of the next round (tick)
        self._learned_at = float("-inf")  # monotonic time of the last sync for unknown instances (_learn_groups)
        # in-line victims -> their size, until their eviction commits (give_back re-tracks them)
        self._given: dict[tuple[str, int, str], int] = {}
        self._given_types: set[str] = set()
        manager.add_listener(self)

    # -- listener hooks (RPC thread: append only) ------------------------------------------------

    def on_serving(self, instance_id: str, key: int, nbytes: int, storage_type: str, parent: int | None, now: float) -> None:
        self._events.append((_SERVE, instance_id, key, nbytes, storage_type, parent, now))

    def on_read(self, instance_id: str, keys: list[int], now: float) -> None:
        if len(self._events) >= _MAX_EVENTS:  # recency is best effort; never grow without bound
            self.metrics.dropped_reads.inc()
            return
        self._events.append((_READ, instance_id, keys, now))

    def on_removed(self, instance_id: str, keys: list[int]) -> None:
        given = self._given
        if given:  # in-line victims were forgotten (and journalled) when make_room chose them
            types = tuple(self._given_types)  # one C-level copy: make_room may add a type meanwhile
            keys = [k for k in keys if not any((instance_id, k, t) in given for t in types)]
            if not keys:
                return
        self._events.append((_REMOVE, instance_id, keys))

    def queued(self) -> int:
        """Events buffered by the hooks and not folded in yet (inspection, tests)."""
        return len(self._events)

    def on_evicted(self, instance_id: str, keys: list[int], delay_s: float) -> None:
        if self._given:  # in-line victims whose eviction committed: nothing left to give back
            with self._lock:
                for key in keys:
                    for stype in self._given_types:
                        self._given.pop((instance_id, key, stype), None)

    # -- the round ------------------------------------------------------------------------------

    @property
    def period(self) -> float:
        """How often the thread should call :meth:`tick`: every round, and more often to
        journal recency when it persists it (``reclaim.journal_interval_s``)."""
        interval = self._config.interval_s
        return interval if self._persist is None else min(interval, self._config.journal_interval_s)

    def tick(self) -> Round | None:
        """The LoopThread body: a round at the injected clock's time when one is due, otherwise
        (with a state dir) fold the buffered events in and journal them, so a killed process
        loses at most ``reclaim.journal_interval_s`` of recency, not a whole round's."""
        mono = time.monotonic()
        if self._next_round is None or mono >= self._next_round:
            self._next_round = mono + self._config.interval_s - self.period / 2
            return self.run_once(self._clock())
        with self._lock:
            self._prepare(self._clock())
            self._save()
        return None

    def run_once(self, now: float) -> Round:
        """Sync limits, fold events, sweep TTLs, then bring every group under its watermark."""
        started = time.perf_counter()
        report = Round(now)
        with self._lock:
            self._sync(now)
            # Usage first, events second: every serving block the snapshot counts has then been
            # reported (on_serving fires on commit), so the policies know every block they may
            # need to evict; read after the drain, blocks served meanwhile would count but be
            # unknown.
            usages = {name: self._manager.usage(name) for name in self._groups}
            manager = self._manager
            nets = manager.usage_net_of_frees(list(self._groups)) if isinstance(manager, ExactUsage) else {}
            for state in self._groups.values():
                state.marked_since_sample = {}
            self._prepare(now)
            ttl_jobs = plan.ttl_jobs(self._groups.values(), now)
        budget = self._config.max_victims_per_round
        budget -= self._run_jobs(ttl_jobs, budget, now, report)
        with self._lock:
            jobs = self._watermark_jobs(usages, nets, report)
        self._run_jobs(jobs, budget, now, report)
        with self._lock:
            self._save()
        report.seconds = time.perf_counter() - started
        self.metrics.rounds.inc()
        self.metrics.round_seconds.observe(report.seconds)
        return report

    def tracked(self, group: str, storage_type: str) -> Tracked | None:
        """The live policy of one (group, storage type), keyed ``(instance_id, key)``, for tests
        and inspection."""
        state = self._groups.get(group)
        policy = None if state is None else state.policies.get(storage_type)
        return None if state is None or policy is None else Tracked(state, policy)

    def close(self) -> None:
        """Fold what is buffered and write the snapshot: a clean stop loses no recency."""
        with self._lock:
            if self._persist is None:
                return
            try:
                now = self._clock()
                self._sync(now)
                self._prepare(now)  # restores first if no round ran: what it read then is kept
                self._persist.append(self._journal)
                self._journal = []
                self._persist.snapshot(self._dump())
            except OSError as exc:  # a full disk must not fail the stop: recency is derived data
                log.warning("reclaimer: recency not saved (%s); the next start rebuilds it", exc)
            finally:
                self._persist.close()

    # -- in-line eviction (the RPC thread, inside the write's transaction) ----------------------

    def make_room(self, group: str, needs: Mapping[str, int], limit: int) -> Room:
        """Victims freeing ``needs[type]`` bytes per storage type (``""``: any type) by the
        group's own policy, at most ``limit``, never pinned; no longer tracked once returned.
        ``start_write_cache`` calls it when a write would exceed a quota (:mod:`kvcm.cache.room`)."""
        now = self._clock()
        picked: list[tuple[str, int, str]] = []
        pinned = [0]
        with self._lock:
            if group not in self._groups:
                self._sync(now)
            state = self._groups.get(group)
            if state is None:
                return Room([], f"instance group {group!r} is not known to the reclaimer yet")
            self._prepare(now)
            for stype, need in needs.items():
                self._room_of_type(state, stype, need, limit, now, picked, pinned)
        why = f"{pinned[0]} pinned block(s) passed over" if pinned[0] else ""
        return Room(picked, why)

    def _room_of_type(self, state: GroupState, stype: str, need: int, limit: int, now: float,
                      picked: list[tuple[str, int, str]], pinned: list[int]) -> None:
        """make_room's victims of one storage type (``""``: any, the best-stocked type first)."""
        for job in self._inline_jobs(state, stype, need):
            job.need = need
            while not job.done and len(picked) < limit:
                chosen = self._picker.select(job, min(CHUNK, limit - len(picked)), now, pinned)
                if not chosen:
                    break
                self._give(job, chosen, now, picked)
            need = max(job.need, 0)
            if not need:
                break

    def _give(self, job: Job, chosen: list[tuple[int, int]], now: float, picked: list[tuple[str, int, str]]) -> None:
        """In-line victims handed to the cache: remembered (give_back tracks them again if their
        eviction does not commit), journalled as removed, counted as in flight."""
        state = job.state
        nbytes = sum(size for _, size in chosen)
        job.need -= nbytes
        job.done = job.need <= 0
        self._given_types.add(job.stype)
        forgotten: dict[str, list[int]] = {}
        for packed, size in chosen:
            iid, key = state.ikey(packed)
            picked.append((iid, key, job.stype))
            self._given[(iid, key, job.stype)] = size
            forgotten.setdefault(iid, []).append(key)
        # Forgotten now, so journalled now: the cache's removal event for them is not folded in
        # again (on_removed); give_back journals them back.
        self._journal.extend((_REMOVE, iid, keys) for iid, keys in forgotten.items())
        while len(self._given) > _MAX_GIVEN:  # victims the cache dropped unmarked
            del self._given[next(iter(self._given))]
        self._count(state, job.stype, "inline", len(chosen), nbytes)
        state.inline_bytes[job.stype] = state.inline_bytes.get(job.stype, 0) + nbytes
        state.add_inflight(job.stype, nbytes, now + state.limits.delay_before_delete_ms / 1000.0)

    def give_back(self, victims: Sequence[tuple[str, int, str]]) -> None:
        """The transaction that evicted ``victims`` did not commit: they still serve, and are
        tracked again at once (as just written: their old place in the order is lost)."""
        now = self._clock()
        with self._lock:
            for iid, key, stype in victims:
                size = self._given.pop((iid, key, stype), None)
                group = self._group_of.get(iid)
                state = self._groups.get(group) if group is not None else None
                if size is not None and state is not None and not state.stale:
                    state.serve(iid, key, size, stype, None, now)
                    self._journal.append((_SERVE, iid, key, size, stype, None, now))

    def _inline_jobs(self, state: GroupState, stype: str, need: int) -> list[Job]:
        if stype:
            return [Job(state, stype, "inline", need=need)] if stype in state.policies else []
        # any type: the best-stocked type first, then the others
        ranked = sorted(state.policies, key=lambda t: -state.policies[t].size_total)
        return [Job(state, t, "inline", need=need) for t in ranked]

    # -- sync, drain, rebuild, persistence -------------------------------------------------------

    def _sync(self, now: float) -> None:
        limits = dict(self._limits())
        for name in [g for g in self._groups if g not in limits]:
            del self._groups[name]
            self.metrics.forget_group(name)
        sample = self._config.sample_size
        for name, lim in limits.items():
            size = sample if lim.sample_size is None else lim.sample_size
            state = self._groups.get(name)
            if state is None:
                self._groups[name] = GroupState(name, lim, size, self._config.compact_lru)
            else:
                state.update(lim, size)
        settled = self._settled(now)
        for state in self._groups.values():
            state.expire_inflight(settled, confirm=self._deleter_head is not None)
        self._refresh_instances()

    def _settled(self, now: float) -> Callable[[float], bool]:
        """Whether the evictions due at a given time have been freed by the deleter."""
        if self._deleter_head is None:  # cannot watch the queue: assume freed a grace after due
            return lambda due: due + self._grace <= now
        head = self._deleter_head()
        if head is None:
            return lambda due: True  # queue empty: everything handed over is freed
        return lambda due: due < head

    def _refresh_instances(self) -> None:
        group_of: dict[str, str] = {}
        for name, state in self._groups.items():
            members = self._manager.instances_of_group(name)
            for iid in members:
                group_of[iid] = name
            if not state.stale:
                for gone in {i for i, g in self._group_of.items() if g == name} - set(members):
                    state.purge_instance(gone)
        self._group_of = group_of

    def _prepare(self, now: float) -> None:
        """Restore (first time), rebuild stale groups, *then* fold every buffered event in: none
        is dropped, so reads made before a group's first round or a policy change still count.

        A block whose ``serving`` event is still buffered is left to that event, not read from
        the store: the event puts it in its true place among the reads (the store's write
        times are milliseconds, and ties would fall back to key order)."""
        pop = self._events.popleft
        events = [pop() for _ in range(len(self._events))]
        self._learn_groups({e[1] for e in events}, now)
        if not self._restored or any(state.stale for state in self._groups.values()):  # rare
            pending = {(e[1], e[2], e[4]) for e in events if e[0] == _SERVE}
            if not self._restored:
                self._restore(now, pending)  # may leave a group stale (its policy changed meanwhile)
            for state in self._groups.values():
                if state.stale:
                    self._rebuild(state, now, pending)
        self._drain(events, journal=True)

    def _learn_groups(self, instances: set[str], now: float) -> None:
        """Sync the limits when events name an instance of no group known here (a group created
        since the last round), so that group's state is built before its events fold in:
        otherwise they are dropped, and the block read after every write goes first. At most
        once a second, for instances of groups without limits."""
        if instances <= self._group_of.keys():
            return
        mono = time.monotonic()
        if mono - self._learned_at < 1.0:
            return
        self._learned_at = mono
        self._sync(now)

    def _drain(self, events: Iterable[tuple[Any, ...]], journal: bool) -> None:
        """Apply ``events`` in order (buffered ones; or a journal replayed at start-up, which is
        not journalled again).

        Consecutive reads of a group are applied as one batch (see ``GroupState.read_many``),
        flushed before that group's next write or removal, so the result is that of applying
        every event in order. A ``serving`` event for a block the policy already tracks is one a
        rebuild or a reconcile has read from the store meanwhile (a served block is never served
        again before its removal is reported): it is skipped, not applied twice.
        """
        log_to = self._journal if journal else None
        refreshed = False
        reads: dict[GroupState, dict[str, tuple[list[list[int]], list[float]]]] = {}
        for event in events:
            group = self._group_of.get(event[1])
            if group is None and not refreshed:  # registered since the sync
                self._refresh_instances()
                refreshed, group = True, self._group_of.get(event[1])
            state = self._groups.get(group) if group is not None else None
            if state is None or state.stale:
                continue  # a group the limits do not know yet: its rebuild will read the store
            if log_to is not None:
                log_to.append(event)
            if event[0] == _READ:
                key_lists, times = reads.setdefault(state, {}).setdefault(event[1], ([], []))
                key_lists.append(event[2])
                times.append(event[3])
                continue
            if state in reads:
                _flush_reads(state, reads.pop(state))
            if event[0] == _SERVE:
                if state.key_of(event[1], event[2]) in state.policies.get(event[4], ()):
                    continue  # already read from the store by a rebuild or a reconcile: not twice
                state.serve(*event[1:])
            else:
                state.remove(event[1], event[2])
        for state, pending in reads.items():
            _flush_reads(state, pending)

    def _rebuild(self, state: GroupState, now: float, pending: Collection[tuple[str, int, str]] = ()) -> None:
        """Reload one group's policies from the store (start-up without a snapshot, policy
        change): in the old policy's order where it had one, else oldest write first."""
        carried = state.carried_order(now) if state.policy_name != "ttl" else {}
        state.reset()
        rows: list[tuple[Any, ...]] = []
        for iid in self._manager.instances_of_group(state.name):
            for row in self._manager.serving_keys(iid):
                if (iid, row[0], row[2]) not in pending:
                    rows.append((row[3], iid, row[0], row[1], row[2], row[4] if len(row) > 4 else None))
        inf = len(rows) + 1
        rows.sort(key=lambda r: (carried.get(r[4], {}).get(state.key_of(r[1], r[2]), inf), r[0]))
        for written_at, iid, key, nbytes, stype, parent in rows:
            state.serve(iid, key, nbytes, stype, parent, written_at)
        self.metrics.rebuilds.labels(state.name).inc()
        log.info("reclaimer: rebuilt group %s (%s, %d blocks)", state.name, state.policy_name, len(rows))

    def _restore(self, now: float, pending: Collection[tuple[str, int, str]]) -> None:
        """Start-up with a state dir: the snapshot, the journal after it (the journal alone when
        there is no snapshot yet: it then starts from an empty state), then the store's word on
        what still serves (after a crash the journal may miss the last round)."""
        assert self._persist is not None  # only called when a state dir was given
        self._restored = True
        groups, rounds = self._persist.load()
        current = {name: (st.limits, st.sample_size) for name, st in self._groups.items()}
        for name, state in self._groups.items():
            if groups is not None and name in groups:
                state.load(groups[name])
            else:
                state.reset()
        for events in rounds:
            self._drain((tuple(e) for e in events), journal=False)
        for name, state in self._groups.items():
            self._reconcile(state, pending)
            state.update(*current[name])  # a policy changed meanwhile: rebuilt, keeping the order
        self._journal = []
        log.info("reclaimer: recency restored for %d group(s) (%s)", len(self._groups),
                 "snapshot and journal" if groups is not None else "journal only")

    def _reconcile(self, state: GroupState, pending: Collection[tuple[str, int, str]]) -> None:
        """Forget tracked blocks the store no longer serves; add those it serves that the
        policies miss (by write time, after the others: they are the newest)."""
        serving: dict[str, set[int]] = {}
        missing: list[tuple[Any, ...]] = []
        for iid in self._manager.instances_of_group(state.name):
            for row in self._manager.serving_keys(iid):
                packed = state.key_of(iid, row[0])
                serving.setdefault(row[2], set()).add(packed)
                if packed not in state.policies.get(row[2], ()) and (iid, row[0], row[2]) not in pending:
                    missing.append((row[3], iid, row[0], row[1], row[2], row[4] if len(row) > 4 else None))
        for iid, key, stype in pending:  # served, in the buffered events: not gone
            if self._group_of.get(iid) == state.name:
                serving.setdefault(stype, set()).add(state.key_of(iid, key))
        for stype, policy in list(state.policies.items()):
            live = serving.get(stype, set())
            for gone in [k for k in policy.sizes if k not in live]:
                state.forget(stype, gone)
        for written_at, iid, key, nbytes, stype, parent in sorted(missing, key=itemgetter(0)):
            state.serve(iid, key, nbytes, stype, parent, written_at)

    def _dump(self) -> dict[str, Any]:
        return {name: state.dump() for name, state in self._groups.items() if not state.stale}

    def _save(self) -> None:
        """Append this round's events to the journal; compact it into a snapshot when due."""
        if self._persist is None:
            self._journal = []  # nowhere to write it: recency lives in memory only
            return
        events, self._journal = self._journal, []
        try:
            self._persist.append(events)
            if self._persist.wants_snapshot():
                self._persist.snapshot(self._dump())
        except OSError as exc:  # a full disk costs recency only; the next round tries again
            log.warning("reclaimer: recency journal not written (%s)", exc)

    # -- planning -------------------------------------------------------------------------------

    def _watermark_jobs(self, usages: Mapping[str, Mapping[str, Any]],
                        nets: Mapping[str, tuple[int, dict[str, int]]], report: Round) -> list[Job]:
        jobs: list[Job] = []
        for state in self._groups.values():
            if state.name not in usages:
                continue  # appeared since the usage snapshot: next round
            needs = self._group_needs(state, usages[state.name], nets.get(state.name))
            if needs:
                report.triggered.append(state.name)
                self.metrics.triggered.labels(state.name).inc()
            jobs += [Job(state, t, "watermark", need=n) for t, n in needs.items() if t in state.policies]
        return jobs

    def _group_needs(self, state: GroupState, usage: Mapping[str, Any],
                     net: tuple[int, dict[str, int]] | None = None) -> dict[str, int]:
        """Bytes to free per storage type so the group and each type end under their floors."""
        by_type, total = plan.usage_less_inflight(state, usage, net)
        self.metrics.record(state, usage, by_type)
        sample = (int(usage.get("bytes", 0)), int(usage.get("keys", 0)))
        return plan.needs(state, by_type, total, self._config.hysteresis, sample)

    # -- execution ------------------------------------------------------------------------------

    def _run_jobs(self, jobs: list[Job], budget: int, now: float, report: Round) -> int:
        """Round-robin one chunk per job until all are done or ``budget`` victims are spent."""
        spent = 0
        active = [j for j in jobs if not j.done]
        while active and spent < budget:
            share = max(1, min(CHUNK, (budget - spent) // len(active)))  # a fair turn each
            for job in active:
                started = time.perf_counter()
                spent += self._step(job, min(share, budget - spent), now, report)
                if self._pace is not None:
                    self._pace(time.perf_counter() - started)
                if spent >= budget:
                    break
            for job in [j for j in active if j.done]:
                active.remove(job)
                plan.pass_on(job, active)
        return spent

    def _step(self, job: Job, limit: int, now: float, report: Round) -> int:
        with self._lock:
            # In-line eviction ran between two chunks: what it freed is freed for this job too
            # (else the job, planned before, would take the hot set once in-line took the cold).
            inline = job.state.inline_bytes.get(job.stype, 0)
            if job.keys is None and job.inline_seen >= 0:
                job.need -= inline - job.inline_seen
            job.inline_seen = inline
            if job.keys is None and job.need <= 0:
                job.done = True
                return 0
            chosen = self._picker.select(job, limit, now, [0]) if job.state.policies.get(job.stype) is not None else []
        if not chosen:
            job.done = True
            return 0
        freed = self._evict(job, chosen, now, report)
        if job.keys is None:
            job.need -= freed
            job.done = job.need <= 0
        else:
            job.done = not job.keys
        return len(chosen)

    def _evict(self, job: Job, chosen: list[tuple[int, int]], now: float, report: Round) -> int:
        state, stype = job.state, job.stype
        by_instance: dict[str, list[int]] = {}
        ikeys = [state.ikey(packed) for packed, _ in chosen]
        for iid, key in ikeys:
            by_instance.setdefault(iid, []).append(key)
        freed = sum(self._manager.evict(iid, keys, stype) for iid, keys in by_instance.items())
        # Watching the deleter's queue, ``due`` must not be earlier than the manager's own (it
        # read its clock during evict()); otherwise the injected ``now`` keeps tests exact.
        marked_at = self._clock() if self._deleter_head is not None else now
        with self._lock:
            state.add_inflight(stype, freed, marked_at + state.limits.delay_before_delete_ms / 1000.0)
        report.victims += [(state.name, stype, ikey, job.reason) for ikey in ikeys]
        report.freed += freed
        self._count(state, stype, job.reason, len(chosen), freed)
        return freed

    def _count(self, state: GroupState, stype: str, reason: str, blocks: int, nbytes: int) -> None:
        self.metrics.count((state.name, stype, state.policy_name, reason), blocks, nbytes)


def _flush_reads(state: GroupState, batch: dict[str, tuple[list[list[int]], list[float]]]) -> None:
    for iid, (key_lists, times) in batch.items():
        state.read_many(iid, key_lists, times)


def duty_pacer(duty_cycle: float) -> Callable[[float], None] | None:
    """A ``pace`` callback that sleeps so the reclaimer uses at most ``duty_cycle`` of a core."""
    if duty_cycle >= 1.0:
        return None
    factor = (1.0 - duty_cycle) / duty_cycle

    def pace(worked: float) -> None:
        time.sleep(worked * factor)

    return pace


__all__ = ["CHUNK", "CacheHooks", "Reclaimer", "Round", "Tracked", "duty_pacer"]

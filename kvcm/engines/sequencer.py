"""The sequencing rules of one event source, as a state machine without sockets, threads or clock.

:class:`Sequencer` is fed what arrived — a live batch ``(seq, batch, now)``, a replay answer, the
replay's end marker, a reconnect, the passing of time — and returns the decisions the socket
owner (:mod:`kvcm.engines.subscriber`) carries out, in order: apply a batch, count a duplicate
or a gap, drop every block of the source, ask for a replay, re-create the replay channel. It
reads no clock (``now`` comes with every input) and touches no socket, so the rules are tested
by feeding it (``tests/engines/test_engine_sequencer.py``), as h11 separates HTTP from sockets.

The rules, against ``last_seq`` (the last seq applied or queued for applying):

* ``seq == last_seq + 1`` is applied. Applying resumes from 0 after a reset (``last_seq = -1``);
  a first batch above 0 with no replay possible is applied with the batches before it counted
  as missed.
* ``seq <= last_seq`` is a duplicate, unless its batch is newer than the last applied one (a
  duplicate keeps its old timestamp): then the publisher restarted.
* ``seq > last_seq + 1`` is a gap: the missed batches are counted and replayed from
  ``last_seq + 1``; without a replay channel (or while replays back off) the gap is accepted
  and the source is in state ``gap`` until its next rebuild.
* Live batches that arrive while a replay runs are held (at most ``max_held``, the oldest
  dropped first) and sequenced after its end marker, in seq order; replayed batches are
  sequenced as they come, and never start another replay.
* A first replayed seq above the one asked for means the publisher's buffer no longer holds the
  gap: the source is rebuilt (its blocks dropped) rather than left with blocks whose removal was
  missed.
* A publisher restart — a live seq below the highest one seen on the same connection, a newer
  batch at or below ``last_seq``, or a check that fails (below) — rebuilds the source by replay
  from 0.
* On a reconnect and on a liveness probe the replay asks from ``last_seq`` itself, with a check:
  its first answer must be that very batch (same seq, same timestamp), proving the publisher is
  the incarnation whose blocks are held; an end marker instead, or another batch under that
  seq, is a restart.
* A replay that ends without its end marker within ``replay_timeout`` has failed: held batches
  are sequenced with the gap accepted, the replay channel is re-created (so stale answers cannot
  leak into the next replay) and further replays back off (``backoff``). An unanswered probe
  only ends the probe: probes are already spaced by the liveness rules.

Protocol: an :class:`AskReplay` decision is always the last of its list, and the machine waits
for its outcome — :meth:`Sequencer.sent`, :meth:`Sequencer.send_failed` or
:meth:`Sequencer.unsent` (no channel to send on) — before any other input, since what follows
(the rest of a held list being released) depends on it. A probe in flight is ended by a live
batch or a reconnect: the owner calls :meth:`Sequencer.end_probe` first, so that the channel
renewal it decides is carried out before the batch is sequenced against the channel's presence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvcm.proto.kv_events import DecodedBatch


class Backoff:
    """A delay that grows by ``factor`` at each use up to ``maximum``, and starts over on reset."""

    def __init__(self, initial: float, maximum: float, factor: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.delay = initial

    def next(self) -> float:
        """The delay to wait now; the next one is longer."""
        delay = float(self.delay)
        self.delay = min(delay * self.factor, self.maximum)
        return delay

    def reset(self) -> None:
        self.delay = self.initial


@dataclass(frozen=True, slots=True)
class Apply:
    """Apply ``batch`` as the source's ``seq``. A payload that did not decode still consumes its
    seq (``garbage``): ``batch`` is then empty, stamped with the last applied batch's time."""

    seq: int
    batch: DecodedBatch
    garbage: bool = False


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A batch already applied (counted, dropped)."""

    seq: int


@dataclass(frozen=True, slots=True)
class Missed:
    """``count`` batches were missed (healed by the replay that follows, or accepted)."""

    count: int


@dataclass(frozen=True, slots=True)
class Fault:
    """An error of ``kind`` to count (``held_overflow``, ``replay_gap``)."""

    kind: str


@dataclass(frozen=True, slots=True)
class Restarted:
    """The publisher restarted: ``seq`` (None when a replay check found it) came after ``last_seq``.
    A :class:`Rebuild` follows."""

    seq: int | None
    last_seq: int


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Drop every block of the source (``publisher_restart`` or ``replay_gap``); what follows refills it."""

    reason: str


@dataclass(frozen=True, slots=True)
class AskReplay:
    """Ask the replay channel for every buffered batch from ``start`` (a liveness probe when
    ``probe``). Last of its list: answer with ``sent``, ``send_failed`` or ``unsent``."""

    start: int
    probe: bool = False


@dataclass(frozen=True, slots=True)
class RenewChannel:
    """Re-create the replay channel: answers to an abandoned replay must not reach the next one."""


@dataclass(frozen=True, slots=True)
class ReplayOk:
    """A replay (not a probe) reached its end marker."""


@dataclass(frozen=True, slots=True)
class ReplayFailed:
    """A replay (or the sending of one) failed with ``kind``: counted, and replays back off."""

    kind: str


@dataclass(frozen=True, slots=True)
class ProbeFailed:
    """A liveness probe went unanswered."""


Decision = (
    Apply | Duplicate | Missed | Fault | Restarted | Rebuild | AskReplay | RenewChannel | ReplayOk | ReplayFailed
    | ProbeFailed
)
Held = tuple[int, DecodedBatch | None]


class Sequencer:
    """The sequencing state of one source (see the module docstring for the rules).

    ``replayable`` says whether the owner has a replay channel open; the owner keeps it true.
    """

    def __init__(
        self, last_seq: int = -1, last_ts: float = 0.0, *, replay_timeout: float = 5.0, max_held: int = 100_000,
        backoff: Backoff | None = None, replayable: bool = False,
    ) -> None:
        self.last_seq = last_seq  # last seq applied or queued for applying
        self.last_ts = last_ts
        self.last_live: int | None = None  # highest seq seen live on the current connection
        self.replayable = replayable
        self.replay_timeout = replay_timeout
        self.max_held = max_held
        self.backoff = backoff or Backoff(1.0, 30.0, 2.0)  # of replays after a failed one
        self.replay_start: int | None = None  # seq asked for by the replay in flight
        self.replay_deadline = 0.0
        self.replay_first: int | None = None
        self.replay_check: tuple[int, float] | None = None  # (seq, ts) the first answer must be
        self.replay_not_before = 0.0
        self.probing = False  # the replay in flight is a liveness probe
        self.gap = False  # a gap was accepted without replay: blocks may be stale until a rebuild
        self.held: list[Held] = []
        self._releasing: list[deque[Held]] = []  # held lists being sequenced, innermost last
        self._asking: AskReplay | None = None
        self._now = 0.0
        self._out: list[Decision] = []

    # --- inputs -----------------------------------------------------------------------------------

    @property
    def replaying(self) -> bool:
        """A replay or a probe is in flight (its answers are awaited)."""
        return self.replay_start is not None

    def live(self, seq: int, batch: DecodedBatch | None, now: float) -> list[Decision]:
        """A live batch (``batch`` None: its payload did not decode)."""
        self._begin(now)
        if self.probing:  # the batch answers the probe; holding it for the probe would delay it
            self._end_probe()
        if self.last_live is not None and seq < self.last_live:
            self.last_live = seq
            self._restart(seq, batch)
        else:
            self.last_live = seq if self.last_live is None else max(self.last_live, seq)
            if self.replay_start is not None:
                self._hold(seq, batch)
            else:
                self._sequence(seq, batch, allow_replay=True)
        return self._end()

    def replayed(self, seq: int, batch: DecodedBatch | None, now: float) -> list[Decision]:
        """One answer of the replay in flight (none in flight: a late answer, ignored)."""
        self._begin(now)
        if self.replay_start is None:
            return self._end()
        if self.replay_first is None:
            self.replay_first = seq
            check, self.replay_check = self.replay_check, None
            if check is not None and seq == check[0] and batch is not None and batch.ts != check[1]:
                self._restart(None, None)  # same seq, another batch: a new publisher
                return self._end()
            if check is not None and seq == check[0]:
                return self._end()  # the batch we applied last, unchanged: proof, not a duplicate
            if seq > self.replay_start:
                self._unrecoverable(seq)
        self.replay_deadline = now + self.replay_timeout  # progress extends the deadline
        self._sequence(seq, batch, allow_replay=False)
        return self._end()

    def replay_end(self, now: float) -> list[Decision]:
        """The replay's end marker."""
        self._begin(now)
        if self.replay_start is None:
            return self._end()
        if self.replay_check is not None:
            # our last batch is not buffered any more: a restarted publisher (or one whose
            # buffer rolled over); either way our blocks may be stale
            self._restart(None, None)
        else:
            self._replay_done()
        return self._end()

    def connected(self, now: float) -> list[Decision]:
        """The live connection was (re-)established: replay what was missed meanwhile."""
        self._begin(now)
        self.last_live = None
        if self.probing:  # a probe sent while away: the reconnect replay replaces it
            self._end_probe()
        if self.replayable and self.replay_start is None:
            # Ask from last_seq itself (applying resumes at last_seq + 1): its batch must come
            # back unchanged, else the publisher restarted while we were away.
            if self.last_seq >= 0:
                self._start_replay(self.last_seq, (self.last_seq, self.last_ts))
            else:
                self._start_replay(0)
        return self._end()

    def end_probe(self, now: float) -> list[Decision]:
        """End the probe in flight, if any (before a live batch or a reconnect: see the module docstring)."""
        self._begin(now)
        if self.probing:
            self._end_probe()
        return self._end()

    def can_probe(self, now: float) -> bool:
        """A probe may be sent now: no replay in flight, a channel, replays not backing off."""
        return self.replay_start is None and self.replayable and now >= self.replay_not_before

    def probe(self, now: float) -> list[Decision]:
        """Ask from ``last_seq`` itself, like a reconnect: the answer proves the publisher is up
        and still the incarnation whose blocks are held."""
        self._begin(now)
        if self.last_seq >= 0:
            self._start_replay(self.last_seq, (self.last_seq, self.last_ts), probe=True)
        else:
            self._start_replay(0, probe=True)
        return self._end()

    def tick(self, now: float) -> list[Decision]:
        """Time passed: a replay past its deadline has failed (a probe, only ended)."""
        self._begin(now)
        if self.replay_start is not None and now >= self.replay_deadline:
            if self.probing:
                self._out.append(ProbeFailed())
                self._end_probe()
            else:
                self._replay_failed("replay_timeout")
        return self._end()

    def reset(self) -> None:
        """Forget the position (the source's blocks were dropped): the next batches rebuild it from 0."""
        self.gap = False
        self.last_seq, self.last_ts = -1, 0.0

    # --- the outcome of an AskReplay ---------------------------------------------------------------

    def sent(self, now: float) -> list[Decision]:
        """The replay request went out: await its answers until ``now + replay_timeout``."""
        ask = self._answered(now)
        self.replay_start = ask.start
        self.replay_first = None
        self.replay_deadline = now + self.replay_timeout
        self.probing = ask.probe
        self._release_more()
        return self._end()

    def send_failed(self, now: float) -> list[Decision]:
        """The replay request could not be sent: a failed replay."""
        self._answered(now)
        self._replay_failed("replay_send")
        self._release_more()
        return self._end()

    def unsent(self, now: float) -> list[Decision]:
        """There was no channel to send on (its renewal failed): sequence what is held without replay."""
        self._answered(now)
        self.replayable = False
        self._release_held()
        self._release_more()
        return self._end()

    # --- the rules --------------------------------------------------------------------------------

    def _sequence(self, seq: int, batch: DecodedBatch | None, allow_replay: bool) -> None:
        """Place one batch (live or replayed) against ``last_seq``: apply, drop, replay or reset."""
        last = self.last_seq
        if seq == last + 1 or (last < 0 and not self._can_replay(allow_replay)):
            self._missed(seq - last - 1)
            self._apply(seq, batch)
        elif seq <= last:
            if batch is not None and batch.ts > self.last_ts:
                self._restart(seq, batch)
            else:
                self._out.append(Duplicate(seq))
        elif self._can_replay(allow_replay):
            self._missed(seq - last - 1)
            self._hold(seq, batch)
            self._start_replay(last + 1)
        else:
            self._missed(seq - last - 1)
            self.gap = True  # removals in the gap are lost: held blocks may be stale
            self._apply(seq, batch)

    def _can_replay(self, allow: bool) -> bool:
        return allow and self.replayable and self._now >= self.replay_not_before

    def _restart(self, seq: int | None, batch: DecodedBatch | None) -> None:
        """The publisher restarted: clear the source and rebuild it by replay from 0."""
        self._out.append(Restarted(seq, self.last_seq))
        self._rebuild("publisher_restart")
        self.last_seq, self.last_ts = -1, 0.0
        if self.replay_start is not None and self.replayable:
            self._out.append(RenewChannel())  # answers of the abandoned replay must not be applied
        self.replay_start = None
        if seq is not None:
            self._hold(seq, batch)
        if self.replayable:
            self._start_replay(0)
        else:
            self._release_held()

    def _rebuild(self, reason: str) -> None:
        self.gap = False
        self._out.append(Rebuild(reason))

    def _unrecoverable(self, first: int) -> None:
        """The publisher no longer buffers the gap: drop the source's (possibly stale) blocks."""
        self._out.append(Fault("replay_gap"))
        if self.last_seq >= 0:
            self._missed(first - self.last_seq - 1)
            self._rebuild("replay_gap")
        self.last_seq = first - 1

    def _hold(self, seq: int, batch: DecodedBatch | None) -> None:
        if len(self.held) >= self.max_held:
            self.held.pop(0)
            self._out.append(Fault("held_overflow"))
        self.held.append((seq, batch))

    def _apply(self, seq: int, batch: DecodedBatch | None) -> None:
        self.last_seq = seq
        if batch is not None:
            self.last_ts = batch.ts
        self._out.append(Apply(seq, batch or DecodedBatch(self.last_ts, []), garbage=batch is None))

    def _missed(self, n: int) -> None:
        if n > 0:
            self._out.append(Missed(n))

    # --- replays ----------------------------------------------------------------------------------

    def _start_replay(self, start: int, check: tuple[int, float] | None = None, probe: bool = False) -> None:
        """Ask for every buffered batch from ``start``; with ``check = (seq, ts)`` the first answer
        must be that very batch. Nothing else is decided until the owner says how the asking went."""
        if not self.replayable:
            return
        self.replay_check = check
        self._asking = AskReplay(start, probe)
        self._out.append(self._asking)

    def _replay_done(self) -> None:
        self.replay_start = None
        self.backoff.reset()
        if self.probing:
            self.probing = False
        else:
            self._out.append(ReplayOk())
        self._release_held()

    def _replay_failed(self, kind: str) -> None:
        self.replay_start = None
        self.probing = False
        self._out.append(ReplayFailed(kind))
        self.replay_not_before = self._now + self.backoff.next()
        if self.replayable:  # stale answers must not leak into the next replay
            self._out.append(RenewChannel())
        self._release_held()

    def _end_probe(self) -> None:
        self.replay_start = None
        self.probing = False
        if self.replayable:  # a late answer must not leak into the next replay
            self._out.append(RenewChannel())
        self._release_held()

    def _release_held(self) -> None:
        """Sequence the held batches in seq order (without replay: the gaps left are accepted)."""
        held, self.held = deque(sorted(self.held, key=lambda x: x[0])), []
        self._releasing.append(held)
        self._release_more()

    def _release_more(self) -> None:
        """Go on sequencing held batches, the innermost release first, until a replay is asked."""
        while self._releasing and self._asking is None:
            held = self._releasing[-1]
            if not held:
                self._releasing.pop()
                continue
            seq, batch = held.popleft()
            self._sequence(seq, batch, allow_replay=False)

    # --- one input at a time ------------------------------------------------------------------------

    def _begin(self, now: float) -> None:
        if self._asking is not None:
            raise RuntimeError(f"{self._asking!r} awaits its outcome (sent, send_failed or unsent)")
        self._now = now
        self._out = []

    def _answered(self, now: float) -> AskReplay:
        ask = self._asking
        if ask is None:
            raise RuntimeError("no replay was asked for")
        self._asking = None
        self._now = now
        self._out = []
        return ask

    def _end(self) -> list[Decision]:
        out, self._out = self._out, []
        return out

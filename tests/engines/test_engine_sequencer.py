"""The sequencing rules (kvcm.engines.sequencer) and the liveness verdicts (kvcm.engines.liveness),
fed by hand: no ZeroMQ, no background work, no waiting — time is a number passed in."""

from __future__ import annotations

import pytest

from kvcm.engines.liveness import Liveness, LivenessRules
from kvcm.engines.sequencer import (
    Apply,
    AskReplay,
    Backoff,
    Decision,
    Duplicate,
    Fault,
    Missed,
    ProbeFailed,
    Rebuild,
    RenewChannel,
    ReplayFailed,
    ReplayOk,
    Restarted,
    Sequencer,
)
from kvcm.proto.kv_events import DecodedBatch

pytestmark = pytest.mark.quick


def b(ts: float) -> DecodedBatch:
    return DecodedBatch(ts, [])


def with_channel(last_seq: int = -1, last_ts: float = 0.0, max_held: int = 100) -> Sequencer:
    """A sequencer whose owner has a replay channel; replays time out after 5, back off 1 -> 30 (x2)."""
    return Sequencer(last_seq, last_ts, replayable=True, replay_timeout=5.0, max_held=max_held,
                     backoff=Backoff(1.0, 30.0, 2.0))


def fed(m: Sequencer, *seqs: int, now: float = 0.0) -> list[Decision]:
    """Feed live batches ``seqs`` (each stamped with its seq as time); every decision they led to."""
    out: list[Decision] = []
    for seq in seqs:
        out += m.live(seq, b(float(seq)), now)
    return out


# --- in order, duplicates, restarts -----------------------------------------------------------------


def test_batches_in_order_are_applied_and_move_the_position() -> None:
    m = Sequencer()
    assert fed(m, 0, 1, 2) == [Apply(0, b(0.0)), Apply(1, b(1.0)), Apply(2, b(2.0))]
    assert (m.last_seq, m.last_ts, m.gap) == (2, 2.0, False)


def test_garbage_consumes_its_seq_as_an_empty_batch_of_the_last_time() -> None:
    m = Sequencer()
    fed(m, 0, 1)
    assert m.live(2, None, 0.0) == [Apply(2, b(1.0), garbage=True)]
    assert (m.last_seq, m.last_ts) == (2, 1.0)


def test_a_batch_already_applied_is_a_duplicate() -> None:
    m = Sequencer()
    fed(m, 0, 1, 2)
    m.connected(1.0)  # a new connection: the seqs seen live start over
    assert m.live(1, b(1.0), 1.0) == [Duplicate(1)]
    assert m.live(2, None, 1.0) == [Duplicate(2)]  # garbage has no time: never a restart
    assert m.last_seq == 2


def test_a_newer_batch_at_an_applied_seq_is_a_publisher_restart() -> None:
    m = with_channel()
    fed(m, 0, 1, 2)
    m.last_live = None  # as after a reconnect whose replay was not asked
    assert m.live(1, b(10.0), 2.0) == [Restarted(1, 2), Rebuild("publisher_restart"), AskReplay(0)]
    assert (m.last_seq, m.last_ts, m.held) == (-1, 0.0, [(1, b(10.0))])


def test_a_live_seq_going_back_on_one_connection_is_a_restart_even_with_an_old_time() -> None:
    m = with_channel()
    fed(m, 0, 1, 2, 3)
    assert m.live(2, b(0.5), 1.0) == [Restarted(2, 3), Rebuild("publisher_restart"), AskReplay(0)]
    assert m.last_live == 2


def test_a_restart_without_a_channel_applies_what_follows_from_where_it_is() -> None:
    m = Sequencer()
    fed(m, 0, 1, 2, 3)
    assert m.live(2, b(7.0), 1.0) == [Restarted(2, 3), Rebuild("publisher_restart"), Missed(2), Apply(2, b(7.0))]
    assert (m.last_seq, m.gap) == (2, False)


def test_a_rebuild_clears_the_gap_state() -> None:
    m = Sequencer()
    fed(m, 0, 5)
    assert m.gap
    m.live(1, b(1.0), 1.0)  # goes back: a restart
    assert not m.gap


# --- gaps and replays ------------------------------------------------------------------------------


def test_a_gap_is_counted_and_replayed_while_live_batches_are_held() -> None:
    m = with_channel()
    fed(m, 0)
    assert fed(m, 3, now=1.0) == [Missed(2), AskReplay(1)]
    assert m.sent(1.0) == []
    assert m.replaying and m.replay_deadline == 6.0
    assert fed(m, 4, now=1.5) == []  # held until the replay ends
    assert m.replayed(1, b(1.0), 2.0) == [Apply(1, b(1.0))]
    assert m.replay_deadline == 7.0  # progress extends the deadline
    assert m.replayed(2, b(2.0), 2.0) == [Apply(2, b(2.0))]
    assert m.replayed(3, b(3.0), 2.0) == [Apply(3, b(3.0))]
    assert m.replay_end(2.0) == [ReplayOk(), Duplicate(3), Apply(4, b(4.0))]
    assert (m.last_seq, m.gap, m.replaying, m.held) == (4, False, False, [])


def test_held_batches_are_released_in_seq_order() -> None:
    m = with_channel()
    fed(m, 0, 5)
    m.sent(0.0)
    assert m.connected(0.0) == []  # a new connection during the replay: its seqs start over ...
    assert fed(m, 3, 4) == []  # ... so these are no restart, and are held behind 5
    assert m.replayed(1, b(1.0), 0.0) + m.replayed(2, b(2.0), 0.0) == [Apply(1, b(1.0)), Apply(2, b(2.0))]
    assert m.replay_end(0.0) == [ReplayOk(), Apply(3, b(3.0)), Apply(4, b(4.0)), Apply(5, b(5.0))]


def test_replayed_batches_never_start_another_replay() -> None:
    m = with_channel()
    fed(m, 0, 2)
    m.sent(0.0)
    assert m.replayed(4, b(4.0), 0.0) == [Fault("replay_gap"), Missed(3), Rebuild("replay_gap"), Apply(4, b(4.0))]
    assert m.replayed(6, b(6.0), 0.0) == [Missed(1), Apply(6, b(6.0))]  # accepted, not replayed
    assert m.gap


def test_a_replay_that_no_longer_reaches_back_rebuilds_the_source() -> None:
    m = with_channel()
    fed(m, 0)
    fed(m, 5)
    m.sent(0.0)
    decisions = m.replayed(3, b(3.0), 0.0)
    assert decisions == [Fault("replay_gap"), Missed(2), Rebuild("replay_gap"), Apply(3, b(3.0))]
    assert m.replayed(4, b(4.0), 0.0) == [Apply(4, b(4.0))]
    assert m.replay_end(0.0) == [ReplayOk(), Apply(5, b(5.0))]


def test_a_replay_answered_from_one_past_the_seq_asked_for_is_a_rebuild() -> None:
    m = with_channel()
    fed(m, 0, 3)  # asks from 1
    m.sent(0.0)
    assert m.replayed(2, b(2.0), 0.0) == [Fault("replay_gap"), Missed(1), Rebuild("replay_gap"), Apply(2, b(2.0))]


def test_a_first_replay_answer_above_zero_before_anything_was_applied_is_no_rebuild() -> None:
    m = with_channel()
    assert m.connected(0.0) == [AskReplay(0)]
    m.sent(0.0)
    assert m.replayed(7, b(7.0), 0.0) == [Fault("replay_gap"), Apply(7, b(7.0))]


def test_a_replay_past_its_deadline_fails_accepts_the_gap_and_backs_off() -> None:
    m = with_channel()
    fed(m, 0)
    fed(m, 3, now=10.0)
    m.sent(10.0)
    assert m.tick(14.9) == []
    assert m.tick(15.0) == [ReplayFailed("replay_timeout"), RenewChannel(), Missed(2), Apply(3, b(3.0))]
    assert m.gap and not m.replaying and m.replay_not_before == 16.0
    assert fed(m, 6, now=15.5) == [Missed(2), Apply(6, b(6.0))]  # backing off: no replay
    assert fed(m, 9, now=16.0) == [Missed(2), AskReplay(7)]
    assert m.send_failed(16.0) == [ReplayFailed("replay_send"), RenewChannel(), Missed(2), Apply(9, b(9.0))]
    assert m.replay_not_before == 18.0  # 1 s, then 2 s


def test_a_replay_that_ends_resets_the_backoff() -> None:
    m = with_channel()
    fed(m, 0)
    fed(m, 2)
    m.sent(0.0)
    m.tick(5.0)
    assert m.backoff.delay == 2.0
    fed(m, 4, now=6.0)
    m.sent(6.0)
    m.replay_end(6.0)
    assert m.backoff.delay == 1.0


def test_a_late_answer_is_ignored() -> None:
    m = with_channel()
    fed(m, 0)
    assert m.replayed(1, b(1.0), 0.0) == []
    assert m.replay_end(0.0) == []
    assert m.last_seq == 0


def test_held_batches_beyond_the_bound_drop_the_oldest() -> None:
    m = with_channel(max_held=2)
    fed(m, 0, 2)
    m.sent(0.0)
    assert fed(m, 3) == []
    assert fed(m, 4) == [Fault("held_overflow")]
    assert [seq for seq, _ in m.held] == [3, 4]  # 2 (the gap's own) went first


def test_without_a_channel_a_gap_is_accepted_and_the_state_is_gap() -> None:
    m = Sequencer()
    assert fed(m, 3) == [Missed(3), Apply(3, b(3.0))]  # nothing applied yet: no gap state
    assert not m.gap
    assert fed(m, 6) == [Missed(2), Apply(6, b(6.0))]
    assert m.gap


# --- reconnects and their check --------------------------------------------------------------------


def test_a_reconnect_asks_from_last_seq_itself_and_its_unchanged_batch_is_proof() -> None:
    m = with_channel(last_seq=4, last_ts=4.0)  # restored from disk
    assert m.connected(0.0) == [AskReplay(4)]
    m.sent(0.0)
    assert m.replayed(4, b(4.0), 0.0) == []  # proof, not a duplicate
    assert m.replayed(5, b(5.0), 0.0) == [Apply(5, b(5.0))]
    assert m.replay_end(0.0) == [ReplayOk()]


def test_a_reconnect_finding_another_batch_at_last_seq_is_a_restart() -> None:
    m = with_channel(last_seq=4, last_ts=4.0)
    m.connected(0.0)
    m.sent(0.0)
    restart = [Restarted(None, 4), Rebuild("publisher_restart"), RenewChannel(), AskReplay(0)]
    assert m.replayed(4, b(9.0), 0.0) == restart
    assert m.last_seq == -1


def test_a_reconnect_whose_last_batch_is_gone_is_a_restart() -> None:
    m = with_channel(last_seq=4, last_ts=4.0)
    m.connected(0.0)
    m.sent(0.0)
    assert m.replay_end(0.0) == [Restarted(None, 4), Rebuild("publisher_restart"), RenewChannel(), AskReplay(0)]


def test_a_reconnect_without_a_channel_asks_nothing() -> None:
    m = Sequencer(last_seq=4, last_ts=4.0)
    assert m.connected(0.0) == []


def test_a_reconnect_during_a_replay_asks_nothing_more() -> None:
    m = with_channel()
    fed(m, 0, 2)
    m.sent(0.0)
    assert m.connected(1.0) == []
    assert m.replay_start == 1


# --- probes ----------------------------------------------------------------------------------------


def test_an_answered_probe_is_no_replay() -> None:
    m = with_channel()
    fed(m, 0, 1)
    assert m.can_probe(0.0)
    assert m.probe(0.0) == [AskReplay(1, probe=True)]
    m.sent(0.0)
    assert m.probing and not m.can_probe(0.0)
    assert m.replayed(1, b(1.0), 0.0) == []
    assert m.replay_end(0.0) == []  # no ReplayOk: probes are not replays
    assert not m.probing


def test_an_unanswered_probe_only_ends() -> None:
    m = with_channel()
    fed(m, 0, 1)
    m.probe(0.0)
    m.sent(0.0)
    assert m.tick(5.0) == [ProbeFailed(), RenewChannel()]
    assert not m.replaying and m.can_probe(5.0)  # no backoff


def test_a_live_batch_ends_a_probe_and_is_applied_at_once() -> None:
    m = with_channel()
    fed(m, 0, 1)
    m.probe(0.0)
    m.sent(0.0)
    assert m.end_probe(1.0) == [RenewChannel()]
    assert fed(m, 2) == [Apply(2, b(2.0))]
    m.probe(2.0)
    m.sent(2.0)
    assert fed(m, 3) == [RenewChannel(), Apply(3, b(3.0))]  # ended by live() itself too


def test_a_probe_of_a_source_never_applied_asks_from_zero() -> None:
    m = with_channel()
    assert m.probe(0.0) == [AskReplay(0, probe=True)]


def test_no_probe_without_a_channel_or_while_replays_back_off() -> None:
    assert not Sequencer().can_probe(0.0)
    m = with_channel()
    fed(m, 0, 2)
    m.sent(0.0)
    m.tick(5.0)
    assert not m.can_probe(5.5) and m.can_probe(6.0)


# --- the outcome of an AskReplay -------------------------------------------------------------------


def test_nothing_else_is_decided_while_an_ask_awaits_its_outcome() -> None:
    m = with_channel()
    fed(m, 0, 2)
    with pytest.raises(RuntimeError):
        m.live(3, b(3.0), 0.0)
    m.sent(0.0)
    with pytest.raises(RuntimeError):
        m.sent(0.0)


def test_a_replay_with_no_channel_to_send_on_sequences_what_is_held() -> None:
    m = with_channel()
    fed(m, 0, 1, 2)
    m.last_live = None
    m.live(1, b(10.0), 0.0)  # a restart asks from 0 ...
    assert m.unsent(0.0) == [Missed(1), Apply(1, b(10.0))]  # ... but its channel is gone
    assert not m.replayable


def test_a_restart_found_among_held_batches_suspends_their_release_until_the_ask_is_answered() -> None:
    def failing() -> Sequencer:
        m = with_channel(last_seq=1, last_ts=2.0)
        m.connected(0.0)
        m.sent(0.0)
        assert m.live(0, b(5.0), 1.0) + m.live(2, b(6.0), 1.0) == []  # held
        assert m.tick(5.0) == [
            ReplayFailed("replay_timeout"), RenewChannel(), Restarted(0, 1), Rebuild("publisher_restart"), AskReplay(0)
        ]
        return m

    m = failing()
    assert m.sent(5.0) == [Missed(2), Apply(2, b(6.0))]  # the rest of the release, after the ask
    assert m.held == [(0, b(5.0))] and m.replay_start == 0
    m = failing()
    # failing too: its own release (the restart's batch) first, then the rest
    assert m.send_failed(5.0) == [ReplayFailed("replay_send"), RenewChannel(), Apply(0, b(5.0)), Missed(1), Apply(2, b(6.0))]


# --- the backoff -----------------------------------------------------------------------------------


def test_backoff_grows_to_its_maximum_and_starts_over() -> None:
    backoff = Backoff(1.0, 5.0, 2.0)
    assert [backoff.next() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    backoff.reset()
    assert backoff.next() == 1.0


# --- liveness --------------------------------------------------------------------------------------

RULES = LivenessRules(probe_interval_s=5.0, stale_after_s=30.0, expire_after_s=600.0)


def test_a_silent_source_is_due_a_probe_each_interval() -> None:
    live = Liveness(RULES, now=100.0)
    assert not live.probe_due(104.9)
    assert live.probe_due(105.0)
    live.probed(105.0)
    assert not live.probe_due(109.9) and live.probe_due(110.0)
    live.heard(110.0, wall=1e9)
    assert not live.probe_due(114.0)


def test_a_silent_source_turns_stale_then_expires_and_hearing_it_revives_it() -> None:
    live = Liveness(RULES, now=0.0)
    assert live.update_stale(29.0) is None and not live.stale
    assert live.update_stale(30.0) is True
    assert live.update_stale(31.0) is None  # unchanged
    assert not live.expire_due(599.0) and live.expire_due(600.0)
    live.expired = True
    assert not live.expire_due(700.0)
    live.heard(700.0, wall=1e9)
    assert not live.expired and live.heard_wall == 1e9
    assert live.update_stale(700.0) is False


def test_expire_after_zero_never_expires() -> None:
    live = Liveness(LivenessRules(5.0, 30.0, 0.0), now=0.0)
    live.update_stale(1e6)
    assert not live.expire_due(1e6)


@pytest.mark.parametrize(("expired", "age", "replaying", "gap", "state"), [
    (True, 1.0, True, True, "expired"),
    (False, 30.0, True, True, "stale"),
    (False, 1.0, True, True, "replaying"),
    (False, 1.0, False, True, "gap"),
    (False, 1.0, False, False, "live"),
])  # fmt: skip
def test_the_state_a_source_is_reported_in(expired: bool, age: float, replaying: bool, gap: bool, state: str) -> None:
    live = Liveness(RULES, now=0.0)
    live.expired = expired
    assert live.state(age, replaying, gap) == (state, age)
    assert live.state(-1.0, False, False) == ("expired" if expired else "live", 0.0)  # a clock never ages it below 0

"""Engine-source liveness against real publishers (FakeEnginePublisher: PUB + replay ROUTER).

A silent publisher that is up is probed and stays live; a dead one becomes stale (left out of
``match_engines``), then expired (blocks dropped, counted); an in-place restart and a replay
buffer that no longer reaches back are full rebuilds. Intervals come from the config, short
(probe 0.2 s, stale 1 s, expire 2 s); tests drive ``poll_once`` themselves and wait for outcomes
with generous deadlines, never asserting on timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client import generate_latest

from kvcm.backends.metastore import MemoryStore
from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.config import ConfigError, load
from kvcm.engines.push import Report
from kvcm.engines.service import EngineService
from kvcm.engines.sources import SubscriberSettings
from kvcm.errors import NotFound
from kvcm.testing.fake_engine import FakeEnginePublisher
from tests.engines.test_engine_subscriber import pump

BS = 16
TOKENS = list(range(1, 8 * BS + 1))
KEYS = token_ids_to_block_keys(TOKENS, BS)
EVENTS = {"probe_interval_s": 0.2, "stale_after_s": 1.0, "expire_after_s": 2.0, "replay_timeout_s": 0.3,
          "backoff_initial_s": 0.05, "backoff_max_s": 0.2, "poll_ms": 20}  # fmt: skip


def lookup(instance_id: str) -> int:
    if instance_id == "inst":
        return BS
    raise NotFound(f"no instance {instance_id}")


@pytest.fixture
def svc() -> Iterator[EngineService]:
    settings = SubscriberSettings.from_config(load(environ={}, overrides={"events": EVENTS}).events)
    service = EngineService(MemoryStore(), lookup, settings)
    yield service
    service.stop()


@pytest.fixture
def pubs() -> Iterator[Callable[..., FakeEnginePublisher]]:
    made: list[FakeEnginePublisher] = []

    def make(**kw: Any) -> FakeEnginePublisher:
        made.append(FakeEnginePublisher(**kw))
        return made[-1]

    yield make
    for pub in made:
        pub.close()


def service_with(**events: float) -> EngineService:
    """A service on EVENTS with ``events`` changed (the caller stops it)."""
    cfg = load(environ={}, overrides={"events": {**EVENTS, **events}}).events
    return EngineService(MemoryStore(), lookup, SubscriberSettings.from_config(cfg))


def unprobed() -> EngineService:
    """A service that never probes, nor marks a source stale, within a test's time: only the
    event stream itself moves a source's state."""
    return service_with(probe_interval_s=60.0, stale_after_s=120.0, expire_after_s=240.0)


def pump_for(svc: EngineService, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        svc.subscriber.poll_once(0.01)


def add(svc: EngineService, pub: FakeEnginePublisher, source_id: str = "pod-a") -> None:
    svc.add_source({"source_id": source_id, "instance_id": "inst", "endpoint": pub.endpoint,
                    "replay_endpoint": pub.replay_endpoint})  # fmt: skip


def info(svc: EngineService, source_id: str = "pod-a") -> dict[str, Any]:
    return next(s for s in svc.list_sources()["sources"] if s["source_id"] == source_id)


def entry(svc: EngineService, source_id: str = "pod-a", **kw: Any) -> dict[str, Any] | None:
    """The source's match entry, with its freshness from the same reply merged in."""
    reply = svc.match("inst", block_keys=KEYS, **kw)
    hit = next((e for e in reply["sources"] if e["source_id"] == source_id), None)
    return None if hit is None else {**hit, **reply["freshness"][source_id]}


def store(pub: FakeEnginePublisher, first: int, count: int, base: int = 100) -> int:
    """Blocks ``first .. first+count-1`` of TOKENS as one event, engine hashes ``base + i``."""
    parent = None if first == 0 else base + first - 1
    toks = TOKENS[first * BS : (first + count) * BS]
    return pub.store([base + i for i in range(first, first + count)], toks, parent=parent, block_size=BS)


def hashes(svc: EngineService, source_id: str = "pod-a") -> set[int]:
    state = svc.index.get(source_id)
    assert state is not None
    return {key & (2**64 - 1) for key in svc.index.blocks_of(source_id)}  # block ids: group << 64 | engine hash


def metric(svc: EngineService, family: str, source_id: str = "pod-a") -> float:
    for line in generate_latest(svc.metrics.registry).decode().splitlines():
        if line.startswith(f'kvcm_engine_event_{family}{{source="{source_id}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def packed(svc: EngineService, **kw: Any) -> dict[str, Any]:
    """``match_engines`` as the RPC path answers it (pre-packed entries)."""
    reply: dict[str, Any] = msgspec.msgpack.decode(svc.match_packed("inst", block_keys=KEYS, **kw))
    return reply


def test_silent_publisher_that_is_up_is_probed_and_stays_live(svc, pubs):
    pub = pubs()
    add(svc, pub)
    store(pub, 0, 2)
    pump(svc, lambda: entry(svc) is not None and not info(svc)["replaying"])
    first_heard = info(svc)["last_heard"]
    assert first_heard is not None
    quiet_since = time.monotonic()
    pump(svc, lambda: time.monotonic() - quiet_since > 1.6 and info(svc)["probes"] >= 3)  # past stale_after_s
    src = info(svc)
    assert src["state"] == "live" and src["age_s"] < 1.0, src
    assert src["last_heard"] > first_heard  # advanced by the probes' answers, no event since
    assert src["replays"] == 1 and src["duplicates"] == 0  # probes are neither replays nor duplicates
    assert pub.replay_requests.count(0) >= 3  # each asked from last_seq (0) itself
    hit = entry(svc)
    assert hit is not None and hit["matched_blocks"] == 2 and hit["state"] == "live"
    assert svc.freshness("pod-a")[0] == "live"
    assert svc.match("inst", block_keys=KEYS)["stale_sources"] == 0
    assert metric(svc, "probes_total") >= 3
    assert packed(svc) == svc.match("inst", block_keys=KEYS)  # the RPC path agrees


def test_dead_publisher_goes_stale_then_expires_and_rebuilds_when_back(svc, pubs):
    pub, other = pubs(), pubs()
    add(svc, pub)
    add(svc, other, "pod-b")
    store(pub, 0, 2)
    store(other, 0, 1)
    pump(svc, lambda: entry(svc) is not None and entry(svc, "pod-b") is not None)
    pub.stop()
    pump(svc, lambda: svc.freshness("pod-a")[0] == "stale" and "pod-a" in svc.subscriber.stale_ids)
    reply = svc.match("inst", block_keys=KEYS)
    assert [e["source_id"] for e in reply["sources"]] == ["pod-b"] and reply["stale_sources"] == 1
    assert reply["freshness"]["pod-a"]["state"] == "stale" and reply["freshness"]["pod-b"]["state"] == "live"
    rpc = packed(svc)
    assert [e["source_id"] for e in rpc["sources"]] == ["pod-b"] and rpc["stale_sources"] == 1
    assert [e["source_id"] for e in packed(svc, include_stale=True)["sources"]] == ["pod-a", "pod-b"]
    kept = entry(svc, include_stale=True)
    assert kept is not None and kept["state"] == "stale" and kept["age_s"] >= 1.0 and kept["matched_blocks"] == 2
    assert info(svc)["blocks_held"] == 2  # stale: left out, not dropped yet
    assert metric(svc, "stale") == 1.0

    pump(svc, lambda: info(svc)["state"] == "expired")
    src = info(svc)
    assert src["blocks_held"] == 0 and src["expired"] == 1 and src["expired_blocks"] == 2
    assert hashes(svc) == set() and entry(svc, include_stale=True) is None
    assert metric(svc, "expired_total") == 1.0 and metric(svc, "expired_blocks_total") == 2.0
    assert entry(svc, "pod-b") is not None  # the live source keeps its blocks
    assert info(svc, "pod-b")["state"] == "live"

    pub.start()  # back: heard again, rebuilt from its replay buffer
    pump(svc, lambda: (e := entry(svc)) is not None and e["matched_blocks"] == 2 and e["state"] == "live")
    assert svc.match("inst", block_keys=KEYS)["stale_sources"] == 0


def test_restart_in_place_is_a_full_rebuild(svc, pubs):
    pub = pubs()
    add(svc, pub)
    store(pub, 0, 4)
    pump(svc, lambda: (e := entry(svc)) is not None and e["matched_blocks"] == 4)
    pub.restart()  # seq back to 0, empty buffer, same endpoints; then silent
    pump(svc, lambda: info(svc)["rebuilds"] >= 1)
    pump(svc, lambda: info(svc)["blocks_held"] == 0)
    assert hashes(svc) == set() and info(svc)["last_rebuild"] == "publisher_restart"
    store(pub, 0, 1, base=500)  # the new incarnation's own blocks refill the source
    pump(svc, lambda: hashes(svc) == {500})
    hit = entry(svc)
    assert hit is not None and hit["matched_blocks"] == 1


def test_restart_seen_in_the_live_stream_is_a_rebuild(pubs):
    """With no replay ROUTER (nothing to probe or replay), only the live stream reveals a
    restart: the new incarnation's first batch reuses a seq already seen, with a later timestamp."""
    pub, service = pubs(replay_endpoint=""), unprobed()
    try:
        service.add_source({"source_id": "pod-a", "instance_id": "inst", "endpoint": pub.endpoint})
        while not hashes(service):  # the slow joiner
            store(pub, 0, 1)
            pump_for(service, 0.02)
        for i in range(1, 30):
            store(pub, min(i, 3), 1)  # seqs up to 30 or so: as many reused seqs for the new incarnation
        pump(service, lambda: hashes(service) == {100, 101, 102, 103} and info(service)["last_seq"] == pub.seq - 1)
        last = info(service)["last_seq"]
        pub.restart()
        for i in range(last):  # until a batch gets through the reconnect; every seq < last is a reused one
            store(pub, 0, 1, base=500 + 10 * i)
            pump_for(service, 0.1)
            if info(service)["rebuilds"]:
                break
        src = info(service)
        assert src["rebuilds"] == 1 and src["last_rebuild"] == "publisher_restart" and src["restarts"] == 1
        assert not hashes(service) & {100, 101, 102, 103}  # nothing of the old incarnation kept
        assert hashes(service) and hashes(service) <= {500 + 10 * i for i in range(last)}
    finally:
        service.stop()


def test_a_replay_in_progress_is_state_replaying(pubs):
    """A replay ROUTER that never answers: from the gap until the replay times out the source
    is ``replaying`` (its blocks may trail the engine's), then the gap is accepted."""
    pub, svc = pubs(), unprobed()
    mute = zmq.Context.instance().socket(zmq.ROUTER)  # takes replay requests, answers none
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        svc.add_source({"source_id": "pod-a", "instance_id": "inst", "endpoint": pub.endpoint,
                        "replay_endpoint": f"tcp://127.0.0.1:{port}", "replay_timeout_s": 1.0})  # fmt: skip
        # the slow joiner, and the catch-up replay a new subscription asks of the mute ROUTER
        # (held batches wait for its timeout): a batch now and then until one is applied
        for _ in range(200):
            store(pub, 0, 1)
            pump_for(svc, 0.05)
            if info(svc)["last_seq"] >= 0 and not info(svc)["replaying"]:
                break
        pump(svc, lambda: not info(svc)["replaying"] and info(svc)["last_seq"] >= 0)
        pump_for(svc, 0.3)  # past the backoff that failed replay started (backoff_initial_s 0.05)
        pub.drop_next(1)
        store(pub, 1, 1)
        store(pub, 2, 1)  # a gap: replay from the lost seq, asked of the mute ROUTER
        pump(svc, lambda: info(svc)["replaying"])
        assert info(svc)["state"] == "replaying" and svc.freshness("pod-a")[0] == "replaying"
        # the reply's freshness map is kept for poll_ms, so it may trail by that much
        pump(svc, lambda: packed(svc)["freshness"]["pod-a"]["state"] == "replaying")
        assert info(svc)["replaying"]  # still asking: the reply's state is the replay's, not a stale copy
        pump(svc, lambda: info(svc)["state"] == "gap")  # timed out: the gap is accepted, flagged
    finally:
        mute.close(linger=0)
        svc.stop()


def test_replay_buffer_that_no_longer_reaches_back_is_a_rebuild(svc, pubs):
    pub = pubs(buffer_steps=3)
    add(svc, pub)
    store(pub, 0, 2)  # seq 0
    pump(svc, lambda: hashes(svc) == {100, 101} and not info(svc)["replaying"])
    pub.drop_next(5)
    pub.remove([100, 101])  # seq 1, lost: without a rebuild these blocks would be kept, stale
    for _ in range(4):
        pub.remove([999])  # seqs 2-5, lost; the buffer keeps only seqs 4-6
    store(pub, 0, 3, base=200)  # seq 6, live: gap -> replay from 1 -> first answer is seq 4
    pump(svc, lambda: hashes(svc) == {200, 201, 202} and not info(svc)["replaying"])
    src = info(svc)
    assert src["rebuilds"] == 1 and src["last_rebuild"] == "replay_gap" and src["state"] == "live"
    assert src["errors_by_kind"].get("replay_gap") == 1 and src["last_seq"] == 6
    assert metric(svc, "rebuilds_total") == 1.0


def test_gap_accepted_without_replay_is_state_gap(svc, pubs):
    pub = pubs(replay_endpoint="")
    svc.add_source({"source_id": "pod-a", "instance_id": "inst", "endpoint": pub.endpoint})
    while entry(svc) is None:  # the slow joiner: repeat until the subscription is live
        store(pub, 0, 1)
        svc.subscriber.poll_once(0.02)
    pub.drop_next(2)
    store(pub, 1, 1)
    store(pub, 2, 1)
    store(pub, 3, 1)
    pump(svc, lambda: info(svc)["state"] == "gap")
    assert info(svc)["missed"] >= 2


def test_freshness_of_an_unknown_source_is_not_found(svc):
    with pytest.raises(NotFound):
        svc.freshness("nope")


@pytest.mark.parametrize(
    "events, needle",
    [
        ({"probe_interval_s": 0}, "events.probe_interval_s"),
        ({"probe_interval_s": 5, "stale_after_s": 5}, "events.stale_after_s"),
        ({"stale_after_s": 30, "expire_after_s": 10}, "events.expire_after_s"),
    ],
)
def test_liveness_settings_are_validated(events, needle):
    with pytest.raises(ConfigError, match=needle):
        load(environ={}, overrides={"events": events})


def test_expire_zero_never_drops(pubs):
    service = service_with(expire_after_s=0)
    try:
        pub = pubs()
        add(service, pub)
        store(pub, 0, 2)
        pump(service, lambda: entry(service) is not None)
        pub.stop()
        pump(service, lambda: info(service)["state"] == "stale")
        pump_for(service, 1.5)  # past where expire_after_s=2 would have dropped them
        assert info(service)["state"] == "stale" and info(service)["blocks_held"] == 2
    finally:
        service.stop()


def test_a_source_followed_or_dropped_shows_in_the_very_next_freshness_map(svc, pubs):
    """The freshness map is kept for ``poll_ms``, but not across a source added or removed: a
    new source's blocks can be matched within that time, and its reply entry needs its freshness."""
    now = [1000.0]
    svc.subscriber._clock = lambda: now[0]  # frozen: only a change of the sources renews the map
    assert svc.subscriber.instance_freshness("inst")[0] == {}
    svc.report_events(Report(source_id="push-a", op="register", instance_id="inst"))
    assert set(svc.subscriber.instance_freshness("inst")[0]) == {"push-a"}
    pub = pubs()
    add(svc, pub)
    svc.subscriber.poll_once(0)  # the subscriber thread's command: follow pod-a
    assert set(svc.subscriber.instance_freshness("inst")[0]) == {"push-a", "pod-a"}
    svc.remove_source("pod-a")
    svc.subscriber.poll_once(0)
    assert set(svc.subscriber.instance_freshness("inst")[0]) == {"push-a"}
    svc.report_events(Report(source_id="push-a", op="down"))
    fresh, packed = svc.subscriber.instance_freshness("inst")
    assert fresh == {} and msgspec.msgpack.decode(packed) == {}

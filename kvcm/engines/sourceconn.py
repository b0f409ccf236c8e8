"""One followed event source: its sockets, sequencer, liveness and counters, and what each costs.

:class:`SourceConn` is the subscriber's record of one source (:mod:`kvcm.engines.subscriber`
owns its sockets and carries out its :class:`~kvcm.engines.sequencer.Sequencer`'s decisions).
A push source (:mod:`kvcm.engines.push`) has one too, without sockets.

Capacity: each source holds :data:`SOCKETS_PER_SOURCE` ZeroMQ sockets and about
:data:`FDS_PER_SOURCE` file descriptors. A context allows 1,023 sockets unless told otherwise,
and past that socket creation fails ("Too many open files") while the source looks registered;
so :func:`size_context` sizes the context for ``events.max_sources`` up front, and raises the
process's open-file limit (soft up to hard) or refuses start-up when they cannot fit.
"""

from __future__ import annotations

import logging
import resource
from typing import TypedDict

import zmq

from kvcm.config import ConfigError
from kvcm.engines.liveness import Liveness, LivenessRules
from kvcm.engines.sequencer import Backoff, Sequencer
from kvcm.engines.sources import SourceSpec, SubscriberSettings, is_ipv6

log = logging.getLogger("kvcm.engines.subscriber")  # the subscriber sizes the context: its log says so

SOCKETS_PER_SOURCE = 4  # SUB, replay DEALER, and the SUB's monitor (a PAIR socket at each end)
FDS_PER_SOURCE = 6  # one mailbox per socket, plus the SUB's and the DEALER's connection
_SPARE_SOCKETS = 16
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
_FD_RESERVE = 256  # for the rest of the process: stores, the RPC port and its peers, HTTP


def size_context(ctx: zmq.Context[zmq.Socket[bytes]], max_sources: int) -> None:
    """Make room in ``ctx`` (before its first socket) and in the process for ``max_sources``
    sources; raise ConfigError naming ``events.max_sources`` when they cannot fit."""
    sockets = SOCKETS_PER_SOURCE * max_sources + _SPARE_SOCKETS
    if sockets > ctx.get(zmq.MAX_SOCKETS):
        limit = ctx.get(zmq.SOCKET_LIMIT)
        if sockets > limit:
            raise ConfigError(f"events.max_sources={max_sources} needs {sockets} ZeroMQ sockets; "
                              f"this libzmq allows at most {limit}")
        ctx.set(zmq.MAX_SOCKETS, sockets)
    ensure_open_files(FDS_PER_SOURCE * max_sources + _FD_RESERVE, max_sources)


def ensure_open_files(needed: int, max_sources: int) -> None:
    """Raise the soft RLIMIT_NOFILE up to the hard one when ``needed`` is above it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(f"events.max_sources={max_sources} needs about {needed} open files, but the "
                          f"process may open at most {hard} (hard RLIMIT_NOFILE, ulimit -Hn): lower "
                          f"events.max_sources or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    log.info("raised the open-file limit from %d to %d for events.max_sources=%d", soft, needed, max_sources)


class _SometimesStats(TypedDict, total=False):
    replays_ok: int  # once a replay succeeded
    last_rebuild: str  # once the source was rebuilt: why


class SourceStats(_SometimesStats):
    """One source's counters, as ``list_event_sources`` shows them."""

    connections: int
    disconnections: int
    missed: int
    replays: int
    replay_failures: int
    duplicates: int
    restarts: int
    errors: int
    errors_by_kind: dict[str, int]
    last_event_time: float | None
    probes: int
    probe_failures: int
    rebuilds: int
    expired: int
    expired_blocks: int


def _new_stats() -> SourceStats:
    return {
        "connections": 0, "disconnections": 0, "missed": 0, "replays": 0, "replay_failures": 0,
        "duplicates": 0, "restarts": 0, "errors": 0, "errors_by_kind": {}, "last_event_time": None,
        "probes": 0, "probe_failures": 0, "rebuilds": 0, "expired": 0, "expired_blocks": 0,
    }  # fmt: skip


class SourceConn:
    """Sockets, sequencing and liveness of one source (subscriber thread only; a push source's
    sequencing fields are the RPC thread's: see :mod:`kvcm.engines.subscriber`)."""

    def __init__(
        self, spec: SourceSpec, generation: int, last_seq: int, last_ts: float, cfg: SubscriberSettings, now: float
    ) -> None:
        self.spec = spec
        self.generation = generation
        self.backoff_initial = spec.backoff_initial_s or cfg.backoff_initial_s
        self.backoff_max = spec.backoff_max_s or cfg.backoff_max_s
        self.seq = Sequencer(
            last_seq, last_ts, replay_timeout=spec.replay_timeout_s or cfg.replay_timeout_s, max_held=cfg.max_held,
            backoff=Backoff(self.backoff_initial, self.backoff_max, cfg.backoff_factor),
        )
        self.liveness = Liveness(LivenessRules(cfg.probe_interval_s, cfg.stale_after_s, cfg.expire_after_s), now)
        self.sub: zmq.Socket[bytes] | None = None
        self._dealer: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.connected = False
        self.ever_connected = False
        self.open_at = 0.0
        self.backoff = Backoff(self.backoff_initial, self.backoff_max, cfg.backoff_factor)  # of socket set-up
        self.stats = _new_stats()

    def open_sockets(self, ctx: zmq.Context[zmq.Socket[bytes]], settings: SubscriberSettings) -> None:
        """Create and connect the SUB, its monitor and (with a replay endpoint) the DEALER. On a
        ``ZMQError`` what was made is left in place, for the owner to close."""
        self.sub = self._socket(ctx, zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
        self.sub.setsockopt(zmq.RCVHWM, settings.rcvhwm)
        self.sub.setsockopt(zmq.MAXMSGSIZE, settings.max_payload_bytes + 4096)
        self.monitor = self.sub.get_monitor_socket(_MONITORED)
        self.sub.connect(self.spec.endpoint)
        if self.spec.replay_endpoint:
            self.open_dealer(ctx)

    def open_dealer(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        assert self.spec.replay_endpoint
        dealer = self._socket(ctx, zmq.DEALER)
        self.dealer = dealer
        dealer.connect(self.spec.replay_endpoint)
        return dealer

    def _socket(self, ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(self.backoff_initial * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self.backoff_max * 1000)))
        if is_ipv6(self.spec.endpoint) or is_ipv6(self.spec.replay_endpoint or ""):
            sock.setsockopt(zmq.IPV6, 1)
        return sock

    @property
    def dealer(self) -> zmq.Socket[bytes] | None:
        return self._dealer

    @dealer.setter
    def dealer(self, sock: zmq.Socket[bytes] | None) -> None:
        self._dealer = sock
        self.seq.replayable = sock is not None  # the sequencer replays only through an open DEALER

    # The position and gap state are the sequencer's, the expiry the liveness's; push sources
    # (kvcm.engines.push) read and set them here.
    @property
    def last_seq(self) -> int:
        return self.seq.last_seq

    @last_seq.setter
    def last_seq(self, seq: int) -> None:
        self.seq.last_seq = seq

    @property
    def last_ts(self) -> float:
        return self.seq.last_ts

    @last_ts.setter
    def last_ts(self, ts: float) -> None:
        self.seq.last_ts = ts

    @property
    def gap(self) -> bool:
        return self.seq.gap

    @gap.setter
    def gap(self, gap: bool) -> None:
        self.seq.gap = gap

    @property
    def expired(self) -> bool:
        return self.liveness.expired

    @expired.setter
    def expired(self, expired: bool) -> None:
        self.liveness.expired = expired


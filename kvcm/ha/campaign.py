"""One node's part in electing the leader, whatever holds the lease: what a term is, how it is
renewed, given up and handed over, and what followers are told.

Two coordinations hold the lease: a Redis key (:class:`kvcm.ha.lease.Lease`, nodes on several
hosts sharing a Redis store) and a lock file in a directory the nodes of one host share
(:class:`kvcm.ha.filelease.FileLease`, over the LMDB store of a shared data dir). Each
implements one attempt to acquire, one renew, one release and one read of the holder; the
round, the step-down of ``leader_demote``, the thread and the role-change notices are here.

Time: a holder counts its term from the moment it *sent* the acquire or renew, on the monotonic
clock, and stops calling itself leader at ``VALID_SHARE`` of ``lease_ms`` after that unless a
renew confirmed it meanwhile: a process paused past that (SIGSTOP, swap) resumes as a follower
until its next renew says whether the term is still its own.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from kvcm.errors import Code, Unavailable
from kvcm.ha.floor import EpochFloor
from kvcm.proto.wire import Encodable

log = logging.getLogger("kvcm.ha")

#: The share of ``lease_ms`` (from sending the renew) during which a holder acts as leader: the
#: rest covers clock-rate drift between hosts and the delay of the coordination receiving it.
VALID_SHARE = 0.8


@dataclass(frozen=True)
class Holder:
    """Who holds the lease: what followers tell clients."""

    node_id: str
    endpoint: str
    epoch: int


#: Nodes a deployment lists at most (``get_manager_cluster_info``): announcements past it are
#: not read, so nodes that come and go cannot grow what every node reads each second.
MAX_MEMBERS = 64
#: How often a node reads the list of nodes again (seconds); what it shows may be this old.
MEMBERS_EVERY_S = 1.0


@dataclass(frozen=True)
class Member:
    """A node of the deployment as it announced itself (``at``: its wall clock, seconds)."""

    node_id: str
    endpoint: str
    at: float


def parse_member(raw: str | bytes | None) -> Member | None:
    """The node an announcement names, None when it is not one kvcm wrote."""
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
        return Member(str(obj["node_id"]), str(obj["endpoint"]), float(obj["at"]))
    except (ValueError, TypeError, KeyError):
        return None


def parse_holder(raw: str | bytes | None) -> Holder | None:
    """The holder in a leader record, None when absent or not a record kvcm wrote."""
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
        return Holder(str(obj["node_id"]), str(obj["endpoint"]), int(obj["epoch"]))
    except (ValueError, TypeError, KeyError):
        return None


class Campaign(ABC):
    """The leader lease of one node. ``start()`` runs the contend-and-renew thread;
    :meth:`is_leader` is the truth (cheap: one monotonic read), ``on_change(leader)`` is told
    each change from the lease thread. ``floor``: the highest epoch this node has seen, kept
    outside the coordination (:class:`~kvcm.ha.floor.EpochFloor`): no epoch at or below it is
    issued, and every holder read raises it."""

    #: What the coordination is ("redis" or "file"): the store a leader of it opens.
    coordination = ""
    #: What an unreachable coordination raises: a round survives it (the term ends by the clock).
    errors: tuple[type[Exception], ...] = ()

    def __init__(self, node_id: str, endpoint: str, lease_ms: int, renew_ms: int,
                 on_change: Callable[[bool], None] | None = None, campaign_delay_ms: int = 5000,
                 floor: EpochFloor | None = None) -> None:
        if not 0 < renew_ms < lease_ms:
            raise ValueError(f"renew_ms ({renew_ms}) must be below lease_ms ({lease_ms})")
        self.node_id = node_id
        self.endpoint = endpoint
        self.lease_ms = lease_ms
        self.renew_ms = renew_ms
        self._on_change = on_change
        self._floor = floor
        self._record: bytes | None = None  # our record while we hold (or think we hold) the lease
        self._deadline = 0.0  # monotonic: act as leader until then
        self._expires_wall = 0.0  # wall-clock estimate of the lease's expiry, for display only
        self._since_wall = 0.0  # wall-clock time the current term's lease was won (0: not leader)
        #: How long a node that stepped down (:meth:`demote`) waits before it contends again, so
        #: another node takes the lease (Tair's ``campaign_delay_time_ms``); changeable at run time.
        self.campaign_delay_ms = campaign_delay_ms
        self._demote = threading.Event()
        self._hold_until = 0.0  # monotonic: no acquire attempt before this (after a demote)
        self.holder: Holder | None = None  # the last holder seen (ourselves included)
        self._holder_at = 0.0  # monotonic time self.holder was read
        self.epoch = 0  # our term's epoch while leader
        self._was: tuple[bool, int] = (False, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._members: list[Member] = []
        self._members_at = float("-inf")

    # -- one coordination's primitives -----------------------------------------------------------

    @abstractmethod
    def try_acquire(self) -> bool:
        """One attempt; True when this node holds the lease now."""

    @abstractmethod
    def renew(self) -> bool:
        """One renew; False once the lease is no longer ours (raises one of :attr:`errors`)."""

    @abstractmethod
    def _give_up(self, record: bytes) -> None:
        """Release the term ``record`` names in the coordination (raises one of :attr:`errors`)."""

    @abstractmethod
    def _read_holder(self) -> Holder | None:
        """The current holder as the coordination says now (raises one of :attr:`errors`)."""

    @abstractmethod
    def _announce(self, record: bytes) -> None:
        """Store this node's announcement (raises one of :attr:`errors`)."""

    @abstractmethod
    def _read_members(self) -> list[bytes]:
        """At most :data:`MAX_MEMBERS` announcements (raises one of :attr:`errors`)."""

    @abstractmethod
    def _forget_members(self, node_ids: list[str]) -> None:
        """Remove these nodes' announcements (the leader's clean-up; raises one of :attr:`errors`)."""

    # -- the nodes of the deployment -----------------------------------------------------------------

    def announce(self) -> None:
        """Say this node is here (every round): what ``get_manager_cluster_info`` lists, and
        where ``Client(read_from="any")`` sends reads."""
        self._announce(json.dumps({"node_id": self.node_id, "endpoint": self.endpoint,
                                   "at": round(time.time(), 3)}).encode())

    def members(self) -> list[Member]:
        """The nodes that announced themselves within ``lease_ms`` (sorted by node id; read at
        most every :data:`MEMBERS_EVERY_S`; a coordination error keeps the last reading). The
        leader forgets the announcements of nodes silent for ten leases."""
        now_mono = time.monotonic()
        if now_mono - self._members_at > MEMBERS_EVERY_S:
            self._members_at = now_mono
            try:
                found = [m for m in map(parse_member, self._read_members()) if m is not None]
            except self.errors:
                return self._members
            now = time.time()
            live = now - self.lease_ms / 1000.0
            self._members = sorted((m for m in found if m.at >= live), key=lambda m: m.node_id)
            gone = [m.node_id for m in found if m.at < now - 10 * self.lease_ms / 1000.0]
            if gone and self.is_leader():
                try:
                    self._forget_members(gone)
                except self.errors:
                    pass
        return self._members

    # -- state ----------------------------------------------------------------------------------

    def is_leader(self) -> bool:
        return self._record is not None and time.monotonic() < self._deadline

    def since(self) -> float:
        """Wall-clock time (seconds) this node sent the acquire that won its current term; 0 = none."""
        return self._since_wall if self.is_leader() else 0.0

    def expires_at(self) -> float:
        """Wall-clock time (seconds) the lease would expire without a renew; 0 = none."""
        return self._expires_wall if self.is_leader() else 0.0

    def _won(self, record: bytes, epoch: int, sent: float, wall: float) -> None:
        self.epoch = epoch
        self._record = record
        self._extend(sent, wall)
        self._since_wall = wall
        log.info("lease acquired: node %s is leader, epoch %d", self.node_id, self.epoch)

    def _extend(self, sent: float, wall: float) -> None:
        self._deadline = sent + VALID_SHARE * self.lease_ms / 1000.0
        self._expires_wall = wall + self.lease_ms / 1000.0

    def _lose(self, why: str) -> None:
        if self._record is not None:
            log.warning("lease lost by node %s (epoch %d): %s", self.node_id, self.epoch, why)
        self._record = None

    # -- the holder, for followers ----------------------------------------------------------------

    def refresh_holder(self) -> Holder | None:
        """Read the current holder (followers name the leader with it)."""
        at = time.monotonic()
        self._saw(self._read_holder(), at)
        return self.holder

    def _saw(self, holder: Holder | None, at: float) -> None:
        """Note the holder just read; its epoch raises the floor (before a won term acts)."""
        self.holder = holder
        self._holder_at = at
        if holder is not None and self._floor is not None:
            self._floor.raise_to(holder.epoch)

    def known_holder(self, max_age_s: float = 0.1) -> Holder | None:
        """The holder, read again when the last reading is older than ``max_age_s`` (a deposed
        leader's own record is stale at once). Bounded cost: one read per ``max_age_s`` at most;
        a coordination error keeps the old reading."""
        if time.monotonic() - self._holder_at > max_age_s:
            try:
                self.refresh_holder()
            except self.errors:
                self._holder_at = time.monotonic()
        return self.holder

    # -- rounds -----------------------------------------------------------------------------------

    def release(self) -> None:
        """Give the lease up (clean stop), so a follower takes over at once, not after expiry."""
        record, self._record = self._record, None
        if record is None:
            return
        try:
            self._give_up(record)
        except self.errors as exc:
            log.warning("lease release failed (%s): another node takes over once it lapses", exc)
        self._notify()

    def demote(self) -> bool:
        """Step down: at its next round the lease thread gives the lease up and contends again
        only after ``campaign_delay_ms``, so a follower takes over. False when not the leader."""
        if not self.is_leader():
            return False
        self._demote.set()
        return True

    def step(self) -> None:
        """One round of the thread: renew while leader, else try to acquire."""
        if self._demote.is_set():
            self._demote.clear()
            self._hold_until = time.monotonic() + self.campaign_delay_ms / 1000.0
            log.info("node %s steps down (epoch %d); contends again in %d ms", self.node_id, self.epoch,
                     self.campaign_delay_ms)
            self.release()  # tells the change
            return
        try:
            if self._record is not None:
                if not self.is_leader():
                    self._lose(f"not renewed within {VALID_SHARE * self.lease_ms:.0f} ms")
                else:
                    self.renew()
            if self._record is None and time.monotonic() >= self._hold_until:
                self.try_acquire()
            self.announce()
        except self.errors as exc:
            log.warning("lease: %s coordination unavailable (%s)", self.coordination, exc)
            if self._record is not None and not self.is_leader():
                self._lose(f"coordination unavailable past the renew deadline ({exc})")
        self._notify()

    def _notify(self) -> None:
        """Tell each change of role, and a new term without a pause in between (lost and won
        again within one round): state built for the old term carries the old fencing token."""
        leader = self.is_leader()
        now = (leader, self.epoch if leader else 0)
        if now != self._was:
            self._was = now
            if self._on_change is not None:
                self._on_change(leader)

    # -- thread ---------------------------------------------------------------------------------

    def start(self) -> Campaign:
        self._thread = threading.Thread(target=self._run, name="kvcm-lease", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self._pause())

    def _pause(self) -> float:
        """Renew every renew_ms; past the deadline of a failing renew, wake up at the deadline."""
        pause = self.renew_ms / 1000.0
        if self._record is not None:
            pause = max(0.0, min(pause, self._deadline - time.monotonic()))
        return pause

    def stop(self, release: bool = True) -> None:
        """Stop the thread; ``release`` gives the lease up (a clean stop)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.lease_ms / 1000.0 + 5.0)
        if release:
            self.release()


def lease_facts(lease: Campaign) -> dict[str, Encodable]:
    """The lease's view for ``get_manager_cluster_info``: the role, the leader, the epoch."""
    leader = lease.is_leader()
    holder = lease.holder if leader else lease.known_holder()  # a follower's reading, at most 0.1 s old
    return {
        "is_leader": leader,
        "leader_node_id": lease.node_id if leader else (holder.node_id if holder else ""),
        "leader_endpoint": lease.endpoint if leader else (holder.endpoint if holder else ""),
        "epoch": lease.epoch if leader else (holder.epoch if holder else 0),
        "lease_expires_at": lease.expires_at(),
        "leader_since": lease.since(),
        "members": [{"node_id": m.node_id, "endpoint": m.endpoint} for m in lease.members()],
    }


def not_leader(holder: Holder | None, node_id: str) -> Unavailable:
    """SERVER_NOT_LEADER naming the leader (its endpoint in the error's detail), if one is known."""
    if holder is None or holder.node_id == node_id:
        return Unavailable(f"node {node_id} is not the leader and no leader is known now; retry",
                           Code.SERVER_NOT_LEADER)
    exc = Unavailable(f"node {node_id} is not the leader; the leader is {holder.node_id} at {holder.endpoint}",
                      Code.SERVER_NOT_LEADER)
    exc.detail = {"leader_endpoint": holder.endpoint, "leader_node_id": holder.node_id}
    return exc


__all__ = ["VALID_SHARE", "Campaign", "Holder", "lease_facts", "not_leader", "parse_holder"]

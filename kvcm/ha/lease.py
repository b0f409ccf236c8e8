"""The leader lease: one kvcm node per Redis prefix writes, the others follow.

Keys (beside the store's, under the same hash tag ``{P}``):

* ``{P}:leader`` — the holder's record, a JSON map ``{"node_id", "endpoint", "epoch"}``, set
  with ``PX lease_ms NX``: it vanishes by itself when the holder stops renewing;
* ``{P}:epoch`` — the fencing epoch the store's commit script checks. Acquiring runs ``SET NX``
  and ``INCR`` in one Lua script, so every term has its own epoch and the new holder's commits
  carry it (:attr:`RedisStore.fencing_token`) while a deposed holder's are refused. The node's
  epoch floor (:mod:`kvcm.ha.floor`, in its data dir) keeps a Redis that lost the key from
  issuing an epoch again.

The record embeds the epoch, so it is unique per term: renewing (``PEXPIRE`` only while the value
is still ours) and releasing (compare-and-delete) can never touch a later term, not even one a
restarted process with the same node id holds.

Time: a holder counts its lease from the moment it *sent* the acquire or renew (Redis starts the
expiry later than that), on the monotonic clock, and stops calling itself leader at
``VALID_SHARE`` of ``lease_ms`` after that, before Redis can have let the key expire. A jump of
this host's wall clock changes nothing here; Redis expires keys by its own wall clock, so a jump
forward on the Redis host ends a term early, and then the fencing epoch, not the deadline, keeps
the deposed holder's commits out (docs/ha.md). A process paused past its lease (SIGSTOP, a long
GC or swap) resumes past its deadline and finds itself follower; a commit it had already started
is refused by the fencing epoch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from kvcm.errors import Code, Unavailable
from kvcm.ha.floor import EpochFloor
from kvcm.proto.wire import Encodable

log = logging.getLogger("kvcm.ha")

#: The share of ``lease_ms`` (from sending the renew) during which a holder acts as leader: the
#: rest covers clock-rate drift between hosts and the delay of Redis receiving the command.
VALID_SHARE = 0.8

# KEYS: leader, epoch. ARGV: node id, endpoint, lease ms, the epoch floor (kvcm.ha.floor). {1,
# record} when acquired, else {0, the current holder's record}. The floor lifts an epoch that a
# Redis which lost {P}:epoch would start again from 1: a term's token is never issued twice.
_ACQUIRE = """
local held = redis.call('GET', KEYS[1])
if held then return {0, held} end
local epoch = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[4]) or 0
if epoch <= floor then
  epoch = floor + 1
  redis.call('SET', KEYS[2], epoch)
end
local record = cjson.encode({node_id = ARGV[1], endpoint = ARGV[2], epoch = epoch})
redis.call('SET', KEYS[1], record, 'PX', ARGV[3], 'NX')
return {1, record}
"""

# KEYS: leader. ARGV: our record, lease ms. 1 when renewed (still ours), else 0.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS: leader. ARGV: our record. 1 when deleted (was ours), else 0.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True)
class Holder:
    """Who holds the lease: what followers tell clients."""

    node_id: str
    endpoint: str
    epoch: int


def parse_holder(raw: str | bytes | None) -> Holder | None:
    """The holder in a ``{P}:leader`` value, None when absent or not a record kvcm wrote."""
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
        return Holder(str(obj["node_id"]), str(obj["endpoint"]), int(obj["epoch"]))
    except (ValueError, TypeError, KeyError):
        return None


class Lease:
    """The leader lease of one node. ``start()`` runs the contend-and-renew thread;
    :meth:`is_leader` is the truth (cheap: one monotonic read), ``on_change(leader)`` is told
    each change from the lease thread.

    ``fence(epoch)``: called with the new term's epoch right after acquiring, before
    :meth:`is_leader` turns true (hand it to the store as its fencing token). ``floor``: the
    highest epoch this node has seen, kept outside Redis (:class:`~kvcm.ha.floor.EpochFloor`):
    no epoch at or below it is issued, and every holder read raises it."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        node_id: str,
        endpoint: str,
        lease_ms: int = 3000,
        renew_ms: int = 1000,
        fence: Callable[[int], None] | None = None,
        on_change: Callable[[bool], None] | None = None,
        campaign_delay_ms: int = 5000,
        floor: EpochFloor | None = None,
    ) -> None:
        if not 0 < renew_ms < lease_ms:
            raise ValueError(f"renew_ms ({renew_ms}) must be below lease_ms ({lease_ms})")
        tag = "{" + prefix + "}"
        self.leader_key = f"{tag}:leader".encode()
        self.epoch_key = f"{tag}:epoch".encode()
        self.node_id = node_id
        self.endpoint = endpoint
        self.lease_ms = lease_ms
        self.renew_ms = renew_ms
        self._client = client
        self._fence = fence
        self._on_change = on_change
        self._floor = floor
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._record: bytes | None = None  # our record while we hold (or think we hold) the lease
        self._deadline = 0.0  # monotonic: act as leader until then
        self._expires_wall = 0.0  # wall-clock estimate of the Redis expiry, for display only
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

    # -- state ----------------------------------------------------------------------------------

    def is_leader(self) -> bool:
        return self._record is not None and time.monotonic() < self._deadline

    def since(self) -> float:
        """Wall-clock time (seconds) this node sent the acquire that won its current term; 0 = none."""
        return self._since_wall if self.is_leader() else 0.0

    def expires_at(self) -> float:
        """Wall-clock time (seconds) the lease would expire in Redis without a renew; 0 = none."""
        return self._expires_wall if self.is_leader() else 0.0

    # -- one step each (the thread calls them; tests too) ----------------------------------------

    def try_acquire(self) -> bool:
        """One attempt; True when this node holds the lease now."""
        sent = time.monotonic()
        wall = time.time()
        floor = self._floor.get() if self._floor is not None else 0
        got, raw = self._acquire(keys=[self.leader_key, self.epoch_key],
                                 args=[self.node_id, self.endpoint, self.lease_ms, floor])
        self._saw(parse_holder(raw), sent)
        if not int(got) or self.holder is None:
            return False
        if self._fence is not None:
            self._fence(self.holder.epoch)
        self.epoch = self.holder.epoch
        self._record = raw if isinstance(raw, bytes) else str(raw).encode()
        self._extend(sent, wall)
        self._since_wall = wall
        log.info("lease acquired: node %s is leader, epoch %d", self.node_id, self.epoch)
        return True

    def renew(self) -> bool:
        """One renew; False once the lease is no longer ours (raises on a Redis error)."""
        record = self._record
        if record is None:
            return False
        sent = time.monotonic()
        wall = time.time()
        if int(self._renew(keys=[self.leader_key], args=[record, self.lease_ms])):
            self._extend(sent, wall)
            return True
        self._lose("the lease is held by another node")
        return False

    def release(self) -> None:
        """Give the lease up (clean stop), so a follower takes over at once, not after expiry."""
        record, self._record = self._record, None
        if record is None:
            return
        try:
            self._release(keys=[self.leader_key], args=[record])
        except redis.RedisError as exc:
            log.warning("lease release failed (%s): it expires by itself in %d ms", exc, self.lease_ms)
        self._notify()

    def refresh_holder(self) -> Holder | None:
        """Read the current holder (followers name the leader with it)."""
        at = time.monotonic()
        self._saw(parse_holder(self._client.get(self.leader_key)), at)
        return self.holder

    def _saw(self, holder: Holder | None, at: float) -> None:
        """Note the holder just read; its epoch raises the floor (before a won term acts)."""
        self.holder = holder
        self._holder_at = at
        if holder is not None and self._floor is not None:
            self._floor.raise_to(holder.epoch)

    def known_holder(self, max_age_s: float = 0.1) -> Holder | None:
        """The holder, read again when the last reading is older than ``max_age_s`` (a deposed
        leader's own record is stale at once). Bounded cost: one GET per ``max_age_s`` at most;
        a Redis error keeps the old reading."""
        if time.monotonic() - self._holder_at > max_age_s:
            try:
                self.refresh_holder()
            except redis.RedisError:
                self._holder_at = time.monotonic()
        return self.holder

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
        except redis.RedisError as exc:
            log.warning("lease: Redis unavailable (%s)", exc)
            if self._record is not None and not self.is_leader():
                self._lose(f"Redis unavailable past the renew deadline ({exc})")
        self._notify()

    def _extend(self, sent: float, wall: float) -> None:
        self._deadline = sent + VALID_SHARE * self.lease_ms / 1000.0
        self._expires_wall = wall + self.lease_ms / 1000.0

    def _lose(self, why: str) -> None:
        if self._record is not None:
            log.warning("lease lost by node %s (epoch %d): %s", self.node_id, self.epoch, why)
        self._record = None

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

    def start(self) -> Lease:
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


def lease_facts(lease: Lease) -> dict[str, Encodable]:
    """The lease's view for ``get_manager_cluster_info``: the role, the leader, the epoch."""
    leader = lease.is_leader()
    holder = lease.holder
    return {
        "is_leader": leader,
        "leader_node_id": lease.node_id if leader else (holder.node_id if holder else ""),
        "leader_endpoint": lease.endpoint if leader else (holder.endpoint if holder else ""),
        "epoch": lease.epoch if leader else (holder.epoch if holder else 0),
        "lease_expires_at": lease.expires_at(),
        "leader_since": lease.since(),
    }


def not_leader(holder: Holder | None, node_id: str) -> Unavailable:
    """SERVER_NOT_LEADER naming the leader (its endpoint in the error's detail), if one is known."""
    if holder is None or holder.node_id == node_id:
        exc = Unavailable(f"node {node_id} is not the leader and no leader is known now; retry",
                          Code.SERVER_NOT_LEADER)
        return exc
    exc = Unavailable(f"node {node_id} is not the leader; the leader is {holder.node_id} at {holder.endpoint}",
                      Code.SERVER_NOT_LEADER)
    exc.detail = {"leader_endpoint": holder.endpoint, "leader_node_id": holder.node_id}
    return exc

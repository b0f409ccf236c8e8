"""The leader lease: one kvcm node per Redis prefix writes, the others follow.

Keys (beside the store's, under the same hash tag ``{P}``):

* ``{P}:leader`` — the holder's record, a JSON map ``{"node_id", "endpoint", "epoch"}``, set
  with ``PX lease_ms NX``: it vanishes by itself when the holder stops renewing;
* ``{P}:members`` — a hash: node id → that node's announcement ``{"node_id", "endpoint", "at"}``,
  written every round by each node (what ``get_manager_cluster_info`` lists);
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

import time
from collections.abc import Callable

import redis

from kvcm.ha.campaign import MAX_MEMBERS, VALID_SHARE, Campaign, Holder, lease_facts, not_leader, parse_holder
from kvcm.ha.floor import EpochFloor

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


class Lease(Campaign):
    """The leader lease of one node on a Redis prefix (see :class:`~kvcm.ha.campaign.Campaign`).

    ``fence(epoch)``: called with the new term's epoch right after acquiring, before
    :meth:`is_leader` turns true (hand it to the store as its fencing token)."""

    coordination = "redis"
    errors = (redis.RedisError,)

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
        super().__init__(node_id, endpoint, lease_ms, renew_ms, on_change, campaign_delay_ms, floor)
        tag = "{" + prefix + "}"
        self.leader_key = f"{tag}:leader".encode()
        self.epoch_key = f"{tag}:epoch".encode()
        self.members_key = f"{tag}:members".encode()
        self._client = client
        self._fence = fence
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def try_acquire(self) -> bool:
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
        self._won(raw if isinstance(raw, bytes) else str(raw).encode(), self.holder.epoch, sent, wall)
        return True

    def renew(self) -> bool:
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

    def _give_up(self, record: bytes) -> None:
        self._release(keys=[self.leader_key], args=[record])

    def _read_holder(self) -> Holder | None:
        return parse_holder(self._client.get(self.leader_key))

    def _announce(self, record: bytes) -> None:
        self._client.hset(self.members_key, self.node_id, record)

    def _read_members(self) -> list[bytes]:
        # HSCAN pages rather than HGETALL: a hash grown past the bound is read no further
        found: list[bytes] = []
        for _, value in self._client.hscan_iter(self.members_key, count=MAX_MEMBERS):
            found.append(value)
            if len(found) >= MAX_MEMBERS:
                break
        return found

    def _forget_members(self, node_ids: list[str]) -> None:
        self._client.hdel(self.members_key, *node_ids)


__all__ = ["VALID_SHARE", "Holder", "Lease", "lease_facts", "not_leader", "parse_holder"]

"""The leader role over RPC (admin): ``leader_demote`` steps the leader down, and
``get_leader_elector_config`` / ``update_leader_elector_config`` read and change how long a node
that stepped down waits before it contends again (Tair's LeaderDemote and its elector config).

With the lease (``ha.enabled``) a demote hands the lease over at the lease thread's next round.
Without it the node is the only one and :class:`LocalElector` stands in for Tair's elector on its
own lock: the node stops leading for the campaign delay (refusing writes, ``is_leader`` false,
nobody leads), then leads again, as a lone Tair node that campaigns again and wins."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvcm.errors import Code, Unavailable, error
from kvcm.proto.requests.admin import (
    GetLeaderElectorConfigRequest,
    LeaderDemoteRequest,
    UpdateLeaderElectorConfigRequest,
)
from kvcm.proto.wire import Encodable
from kvcm.rpc.dispatch import Method

if TYPE_CHECKING:  # a node without HA has no lease: it need not import redis-py at all
    from kvcm.ha.campaign import Campaign

log = logging.getLogger("kvcm.ha")

#: The elector's own methods: answered whatever the role (Tair guards none of them as leader-only;
#: ``leader_demote`` itself answers SERVER_NOT_LEADER on a node that does not lead).
ELECTOR_METHODS = frozenset({"leader_demote", "get_leader_elector_config", "update_leader_elector_config"})


class LocalElector:
    """The role of a node without the lease. It leads except for ``campaign_delay_ms`` after a
    :meth:`demote` (the delay in force at the demote, as Tair's elector fixes its next campaign
    time then). Monotonic clock: a wall-clock jump neither ends nor extends the pause."""

    def __init__(self, campaign_delay_ms: int) -> None:
        self.campaign_delay_ms = campaign_delay_ms  # changeable at run time (update_leader_elector_config)
        self._until = 0.0  # monotonic: not leading before this

    def is_leader(self) -> bool:
        return time.monotonic() >= self._until

    def demote(self) -> bool:
        """Stop leading for the campaign delay; False when not leading now (a second demote)."""
        now = time.monotonic()
        if now < self._until:
            return False
        self._until = now + self.campaign_delay_ms / 1000.0
        log.info("leader_demote: this node stops leading; it leads again in %d ms (no other node: "
                 "ha.enabled is off)", self.campaign_delay_ms)
        return True

    def remaining_ms(self) -> int:
        return max(0, round((self._until - time.monotonic()) * 1000))

    def refusal(self) -> Unavailable:
        """SERVER_NOT_LEADER naming no leader (no detail: a client finds none to follow, so it
        pauses and asks again, as during a failover)."""
        return Unavailable(f"this node is not the leader: it stepped down (leader_demote) and leads again in "
                           f"{self.remaining_ms()} ms; no leader now; retry", Code.SERVER_NOT_LEADER)

    def facts(self) -> dict[str, Encodable] | None:
        """The role in the shape of the lease's facts (nobody leads) while not leading; None while
        leading (a single node's facts carry no ``ha``)."""
        if self.is_leader():
            return None
        return {"is_leader": False, "leader_node_id": "", "leader_endpoint": "", "epoch": 0,
                "lease_expires_at": 0.0, "leader_since": 0.0}


class _Elector:
    def __init__(self, lease: Campaign | None, local: LocalElector) -> None:
        self.lease = lease
        self.local = local  # used without a lease

    def leader_demote(self, req: LeaderDemoteRequest) -> dict[str, object]:
        if self.lease is None:
            if not self.local.demote():
                raise self.local.refusal()
            return {"demoted": True, "campaign_delay_time_ms": self.local.campaign_delay_ms}
        if not self.lease.demote():
            raise error(Code.SERVER_NOT_LEADER, f"leader_demote: node {self.lease.node_id} is not the leader")
        # The lease thread gives the lease up at its next round (within ha.renew_ms).
        return {"demoted": True, "node_id": self.lease.node_id, "campaign_delay_time_ms": self.lease.campaign_delay_ms}

    def get_leader_elector_config(self, req: GetLeaderElectorConfigRequest) -> dict[str, object]:
        return self._config()

    def update_leader_elector_config(self, req: UpdateLeaderElectorConfigRequest) -> dict[str, object]:
        self.local.campaign_delay_ms = req.campaign_delay_time_ms
        if self.lease is not None:
            self.lease.campaign_delay_ms = req.campaign_delay_time_ms
        return self._config()

    def _config(self) -> dict[str, object]:
        lease = self.lease
        if lease is None:
            return {"campaign_delay_time_ms": self.local.campaign_delay_ms, "ha": False}
        return {"campaign_delay_time_ms": lease.campaign_delay_ms, "ha": True, "node_id": lease.node_id,
                "lease_ms": lease.lease_ms, "renew_ms": lease.renew_ms}


def methods(lease: Campaign | None, campaign_delay_ms: int, local: LocalElector | None = None) -> list[Method]:
    """The elector methods of one node (each node answers for its own role; the change is not
    persisted: ``ha.campaign_delay_ms`` is the value after a restart). ``local``: the role of a
    node without the lease, shared with its request gate (one is made when not given)."""
    e = _Elector(lease, local if local is not None else LocalElector(campaign_delay_ms))
    return [
        Method("leader_demote", e.leader_demote, LeaderDemoteRequest, idempotent=False, admin=True),
        Method("get_leader_elector_config", e.get_leader_elector_config, GetLeaderElectorConfigRequest, admin=True),
        Method("update_leader_elector_config", e.update_leader_elector_config, UpdateLeaderElectorConfigRequest,
               admin=True),
    ]

"""The leader lease over RPC (admin): ``leader_demote`` hands the lease over, and
``get_leader_elector_config`` / ``update_leader_elector_config`` read and change how long a node
that stepped down waits before it contends again (Tair's LeaderDemote and its elector config).

Without the lease (``ha.enabled`` off) the node is the only one: there is no one to hand over to,
so ``leader_demote`` is UNSUPPORTED; the delay is still read and kept (it takes effect when the
node runs with the lease)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcm.errors import Code, error
from kvcm.proto.requests.admin import (
    GetLeaderElectorConfigRequest,
    LeaderDemoteRequest,
    UpdateLeaderElectorConfigRequest,
)
from kvcm.rpc.dispatch import Method

if TYPE_CHECKING:  # a node without HA has no lease: it need not import redis-py at all
    from kvcm.ha.lease import Lease


class _Elector:
    def __init__(self, lease: Lease | None, campaign_delay_ms: int) -> None:
        self.lease = lease
        self.delay_ms = campaign_delay_ms  # kept here without a lease

    def leader_demote(self, req: LeaderDemoteRequest) -> dict[str, object]:
        if self.lease is None:
            raise error(Code.UNSUPPORTED, "leader_demote: this node runs without the leader lease (ha.enabled "
                                          "is off), so it is the only node and has no one to hand over to")
        if not self.lease.demote():
            raise error(Code.SERVER_NOT_LEADER, f"leader_demote: node {self.lease.node_id} is not the leader")
        # The lease thread gives the lease up at its next round (within ha.renew_ms).
        return {"demoted": True, "node_id": self.lease.node_id, "campaign_delay_time_ms": self.lease.campaign_delay_ms}

    def get_leader_elector_config(self, req: GetLeaderElectorConfigRequest) -> dict[str, object]:
        return self._config()

    def update_leader_elector_config(self, req: UpdateLeaderElectorConfigRequest) -> dict[str, object]:
        self.delay_ms = req.campaign_delay_time_ms
        if self.lease is not None:
            self.lease.campaign_delay_ms = req.campaign_delay_time_ms
        return self._config()

    def _config(self) -> dict[str, object]:
        lease = self.lease
        if lease is None:
            return {"campaign_delay_time_ms": self.delay_ms, "ha": False}
        return {"campaign_delay_time_ms": lease.campaign_delay_ms, "ha": True, "node_id": lease.node_id,
                "lease_ms": lease.lease_ms, "renew_ms": lease.renew_ms}


def methods(lease: Lease | None, campaign_delay_ms: int) -> list[Method]:
    """The elector methods of one node (each node answers for its own lease; the change is not
    persisted: ``ha.campaign_delay_ms`` is the value after a restart)."""
    e = _Elector(lease, campaign_delay_ms)
    return [
        Method("leader_demote", e.leader_demote, LeaderDemoteRequest, idempotent=False, admin=True),
        Method("get_leader_elector_config", e.get_leader_elector_config, GetLeaderElectorConfigRequest, admin=True),
        Method("update_leader_elector_config", e.update_leader_elector_config, UpdateLeaderElectorConfigRequest,
               admin=True),
    ]

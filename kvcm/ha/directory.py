"""The shard directory: the one state shards share, in Redis under a hash tag of its own.

Keys (``D`` = ``kvcmdir:<shard.directory>``; one slot, so one master of a Redis Cluster):

* ``{D}:nodes`` — a hash, ``<shard>/<node_id>`` -> ``{"shard", "node_id", "endpoint", "leader",
  "epoch", "at"}``: every node rewrites its own entry each renew interval; entries older than a
  lease are not listed, those silent for :data:`FORGET_LEASES` leases are removed by any leader;
* ``{D}:groups`` — a hash, instance group -> the shard that owns it (set once, when the group
  is created: ``HSETNX``, so two shards racing for one name agree on the first);
* ``{D}:instances`` — a hash, instance id -> its group (written by the group's shard when the
  instance registers).

The directory is a hint for routing, never the source of truth of an entity: a shard's own
store says whether an instance or group exists. Written ahead of the shard's commit, a hint may
name a shard where the entity was never created (that shard answers ``INSTANCE_NOT_EXIST`` as
any would); removals are written after the commit, so an entity that exists is never hidden.

Bounds: at most :data:`MAX_NODES` node entries are read; names are at most
:data:`~kvcm.proto.shards.MAX_NAME` characters; groups and instances are written only by shard
leaders, after their own registry's capacity checks.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import redis

from kvcm.proto.shards import ShardInfo

log = logging.getLogger("kvcm.ha.directory")

#: Node entries read at most (64 shards of 64 nodes).
MAX_NODES = 4096
#: A node silent for this many leases is removed from the directory by a leader.
FORGET_LEASES = 10
_SCAN = 512  # entries per HSCAN round trip


def tag(name: str) -> str:
    """The hash tag of directory ``name``: every key of it sits on this one slot."""
    return f"kvcmdir:{name}"


class Directory:
    """The directory ``name`` on ``client`` (a connection to the master holding its slot)."""

    def __init__(self, client: redis.Redis, name: str, lease_ms: int) -> None:
        self.client = client
        self.name = name
        self.lease_ms = lease_ms
        prefix = "{" + tag(name) + "}"
        self.nodes_key = f"{prefix}:nodes".encode()
        self.groups_key = f"{prefix}:groups".encode()
        self.instances_key = f"{prefix}:instances".encode()

    # -- nodes ----------------------------------------------------------------------------------

    def announce(self, shard: str, node_id: str, endpoint: str, leader: bool, epoch: int) -> None:
        record = {"shard": shard, "node_id": node_id, "endpoint": endpoint, "leader": leader, "epoch": epoch,
                  "at": time.time()}
        self.client.hset(self.nodes_key, f"{shard}/{node_id}".encode(), json.dumps(record).encode())

    def _node_entries(self) -> Iterator[tuple[bytes, dict[str, object]]]:
        read = 0
        for field, raw in self.client.hscan_iter(self.nodes_key, count=_SCAN):
            read += 1
            if read > MAX_NODES:
                return
            try:
                entry = json.loads(raw)
            except (TypeError, ValueError):
                continue
            if isinstance(entry, dict):
                yield field, entry

    def shards(self) -> dict[str, ShardInfo]:
        """Every shard with a node heard from within a lease: its leader (the live entry of the
        highest epoch that says it leads; "" when none does) and its nodes' endpoints."""
        live_after = time.time() - self.lease_ms / 1000.0
        nodes: dict[str, list[tuple[bool, int, str]]] = {}
        for _, entry in self._node_entries():
            shard, endpoint, at = entry.get("shard"), entry.get("endpoint"), entry.get("at")
            epoch = entry.get("epoch")
            if (not isinstance(shard, str) or not isinstance(endpoint, str) or not isinstance(at, (int, float))
                    or not isinstance(epoch, int) or at < live_after):
                continue
            nodes.setdefault(shard, []).append((entry.get("leader") is True, epoch, endpoint))
        out = {}
        for shard, found in nodes.items():
            leaders = sorted((epoch, endpoint) for leads, epoch, endpoint in found if leads)
            leader = leaders[-1][1] if leaders else ""
            rest = sorted({endpoint for _, _, endpoint in found} - {leader})
            out[shard] = ShardInfo(shard, leader, ((leader,) if leader else ()) + tuple(rest))
        return out

    def forget_silent(self) -> int:
        """Remove the entries of nodes silent for :data:`FORGET_LEASES` leases (a leader's chore)."""
        silent_before = time.time() - FORGET_LEASES * self.lease_ms / 1000.0
        gone = [field for field, entry in self._node_entries()
                if not isinstance(entry.get("at"), (int, float)) or float(entry["at"]) < silent_before]  # type: ignore[arg-type]
        if gone:
            self.client.hdel(self.nodes_key, *gone)
        return len(gone)

    # -- groups and instances -------------------------------------------------------------------

    def group_shard(self, group: str) -> str | None:
        return _text(self.client.hget(self.groups_key, group.encode()))

    def instance_group(self, instance_id: str) -> str | None:
        return _text(self.client.hget(self.instances_key, instance_id.encode()))

    def claim_group(self, group: str, shard: str) -> tuple[str, bool]:
        """Place ``group`` on ``shard`` unless it is placed already: (the owner, whether this
        call placed it)."""
        placed = bool(self.client.hsetnx(self.groups_key, group.encode(), shard.encode()))
        if placed:
            return shard, True
        owner = self.group_shard(group)
        return (owner or shard), False

    def release_group(self, group: str, shard: str) -> None:
        """Forget ``group``'s placement if ``shard`` holds it (a removed group, a failed create)."""
        if self.group_shard(group) == shard:
            self.client.hdel(self.groups_key, group.encode())

    def record_instance(self, instance_id: str, group: str) -> None:
        self.client.hset(self.instances_key, instance_id.encode(), group.encode())

    def forget_instance(self, instance_id: str, group: str) -> None:
        if self.instance_group(instance_id) == group:
            self.client.hdel(self.instances_key, instance_id.encode())

    def groups_per_shard(self, limit: int = 1_000_000) -> dict[str, int]:
        """How many groups each shard owns (the placement's load measure); reads at most ``limit``."""
        counts: dict[str, int] = {}
        for n, (_, shard) in enumerate(self.client.hscan_iter(self.groups_key, count=_SCAN)):
            if n >= limit:
                break
            name = _text(shard)
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
        return counts


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


__all__ = ["FORGET_LEASES", "MAX_NODES", "Directory", "tag"]

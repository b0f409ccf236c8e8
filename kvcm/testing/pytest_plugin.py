"""pytest plugin (entry point ``kvcm``): the ``kvcm_server`` fixture for users' integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def kvcm_server(tmp_path: Any) -> Iterator[Any]:
    """A real kvcm server in a thread, on an ipc endpoint, with a temp data dir.

    Yields a :class:`kvcm.testing.RunningServer` (``.endpoint``, ``.client()``, ``.app``).
    """
    from kvcm.testing import serve_in_thread

    with serve_in_thread(data_dir=str(tmp_path / "kvcm-data")) as server:
        yield server

from __future__ import annotations

import os

import pytest

from kvcm.store import LmdbStore, MemoryStore

TIME_FACTOR = float(os.environ.get("KVCM_TEST_TIME_FACTOR", "1"))


@pytest.fixture(params=["lmdb", "memory"])
def store(request, tmp_path):
    """One store of each kind: the contract suite runs against both."""
    s = LmdbStore(str(tmp_path / "data"), map_size=1 << 20) if request.param == "lmdb" else MemoryStore()
    yield s
    s.close()

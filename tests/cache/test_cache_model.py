"""Model-based test of the data plane: hypothesis drives random sequences of
start / finish / remove / lookups / meta / restart against a real server over ZMQ and checks
every reply against a small in-memory model.

The model knows each key of the instance as ``writing`` (by which session), ``serving`` or
``deleting``. Every reply must be deterministic (hypothesis needs that to shrink a failure), so
the instances' group delays deletes by an hour — a removed copy stays ``deleting`` for the whole
example — and after a finish with failures (freed at once, without that delay) the test waits
until the deleter has freed them.
Every example uses a new instance on one shared server, so examples cannot see each other's
keys; a restart (at most one per example) reopens the same data dir.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from kvcm.client import Client
from kvcm.errors import NotFound
from kvcm.node.app import App
from kvcm.testing import _wait_ready, make_test_config
from tests.helpers import add_group, register, uris, wait_for

KEYS = st.lists(st.integers(1, 10), min_size=1, max_size=5)
WRITING, SERVING, DELETING = "writing", "serving", "deleting"
GROUP = "model"


class SharedServer:
    """One in-process kvcm for every example of a test; ``restart`` reopens its data dir."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvcm-model-", dir="/tmp")
        self.endpoint = f"ipc://{self.dir}/rpc"
        self.app = self._start()
        with Client(self.endpoint) as c:
            add_group(c, GROUP, ["default-file"], delay_ms=3_600_000)

    def _start(self) -> App:
        config = make_test_config(os.path.join(self.dir, "data"), self.endpoint, {"cache": {"delete_poll_ms": 10}})
        app = App(config).start()
        _wait_ready(self.endpoint)
        return app

    def restart(self) -> None:
        self.app.stop()
        self.app = self._start()

    def close(self) -> None:
        self.app.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class CacheModel(RuleBasedStateMachine):
    server: ClassVar[SharedServer]
    _ids = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.instance = f"model-{next(self._ids)}"
        self.client = Client(self.server.endpoint, timeout=20)
        register(self.client, self.instance, group=GROUP)
        self.state: dict[int, tuple[str, str | None]] = {}  # key -> (status, writing session)
        self.uris: dict[int, list[str]] = {}  # key -> URIs of its live copy, from start_write_cache
        self.open: list[tuple[str, list[int]]] = []  # (session, its new keys in reply order), oldest first
        self.finished: list[str] = []
        self.restarts = 0

    def teardown(self) -> None:
        self.client.close()

    def _status(self, key: int) -> str | None:
        entry = self.state.get(key)
        return None if entry is None else entry[0]

    # -- writes -----------------------------------------------------------------------------------

    @rule(keys=KEYS)
    def start(self, keys: list[int]) -> None:
        reply = self.client.call("start_write_cache", {"instance_id": self.instance, "block_keys": keys})
        mask = reply["block_mask"]
        there = [i < mask["offset"] for i in range(len(keys))] if "offset" in mask else mask["bool_masks"]
        assert len(there) == len(keys)
        new: list[int] = []
        seen: set[int] = set()
        for key, masked in zip(keys, there):
            status = self._status(key)
            assert masked == (key in seen or status is not None), f"key {key} ({status}): masked={masked}"
            if not masked:
                new.append(key)
            seen.add(key)
        assert len(reply["locations"]) == len(new)
        sid = reply["write_session_id"]
        for key, location in zip(new, reply["locations"]):
            self.state[key] = (WRITING, sid)
            self.uris[key] = uris(location)
        self.open.append((sid, new))

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def finish(self, data: Any) -> None:
        sid, keys = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        ok = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
        mask = {"bool_masks": ok} if data.draw(st.booleans()) or not all(ok) else {"offset": len(ok)}
        reply = self.client.call("finish_write_cache", {"instance_id": self.instance, "write_session_id": sid,
                                                        "success_blocks": mask})
        served, failed = 0, []
        for key, good in zip(keys, ok):
            if self.state.get(key) != (WRITING, sid):
                continue  # removed while writing: never resurrected
            if good:
                self.state[key] = (SERVING, None)
                served += 1
            else:
                failed.append(key)
        assert reply == {"served": served, "failed": len(keys) - served}
        self.finished.append(sid)
        if failed:
            assert wait_for(lambda: self._statuses(failed) == ["not_found"] * len(failed))
            for key in failed:
                del self.state[key]

    @precondition(lambda self: self.finished)
    @rule(data=st.data())
    def finish_again(self, data: Any) -> None:
        sid = self.finished[data.draw(st.integers(0, len(self.finished) - 1))]
        with pytest.raises(NotFound) as info:
            self.client.call("finish_write_cache", {"instance_id": self.instance, "write_session_id": sid,
                                                    "success_blocks": {"offset": 0}})
        assert info.value.code.name == "WRITE_SESSION_UNKNOWN"

    @rule(keys=KEYS)
    def remove(self, keys: list[int]) -> None:
        reply = self.client.call("remove_cache", {"instance_id": self.instance, "block_keys": keys})
        live = [k for k in dict.fromkeys(keys) if self._status(k) in (WRITING, SERVING)]
        assert reply == {"removed": len(live)}
        for key in live:
            self.state[key] = (DELETING, None)

    # -- reads ------------------------------------------------------------------------------------

    @rule(keys=KEYS)
    def prefix_match(self, keys: list[int]) -> None:
        got = self._locate("prefix_match", keys)
        n = next((i for i, k in enumerate(keys) if self._status(k) != SERVING), len(keys))
        assert len(got) == n
        for key, location in zip(keys, got):
            assert uris(location) == self.uris[key]

    @rule(keys=KEYS)
    def batch_get(self, keys: list[int]) -> None:
        got = self._locate("batch_get", keys)
        assert len(got) == len(keys)
        for key, location in zip(keys, got):
            expected = self.uris[key] if self._status(key) == SERVING else [""] * len(location["location_specs"])
            assert uris(location) == expected

    @rule(keys=KEYS)
    def meta(self, keys: list[int]) -> None:
        assert self._statuses(keys) == [self._status(k) or "not_found" for k in keys]

    def _statuses(self, keys: list[int]) -> list[str]:
        metas = self.client.call("get_cache_meta", {"instance_id": self.instance, "block_keys": keys})["metas"]
        return [m["status"] for m in metas]

    def _locate(self, query: str, keys: list[int]) -> list[dict[str, Any]]:
        params = {"instance_id": self.instance, "query_type": query, "block_keys": keys}
        locations: list[dict[str, Any]] = self.client.call("get_cache_location", params)["locations"]
        return locations

    # -- crash-free restart -------------------------------------------------------------------------

    @precondition(lambda self: self.restarts == 0)
    @rule()
    def restart(self) -> None:
        """Sessions, records and pending deletes survive: the model does not change."""
        self.client.close()
        self.server.restart()
        self.client = Client(self.server.endpoint, timeout=20)
        self.restarts += 1


def _run(examples: int, steps: int) -> None:
    server = SharedServer()
    CacheModel.server = server
    try:
        # No shrinking: each replay costs real requests (and a restart), and a bug can make the
        # server's timing part of the outcome; the failing example is printed as found.
        run_state_machine_as_test(CacheModel, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
            suppress_health_check=list(HealthCheck), database=None,
            phases=[Phase.explicit, Phase.generate]))
    finally:
        server.close()


def test_data_plane_against_a_model():
    _run(examples=30, steps=30)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_data_plane_against_a_model_long():
    """The full budget: 2,000 examples (13 minutes here, passed; ``scripts/soak``)."""
    _run(examples=2000, steps=50)

"""What an operator scrapes: families that add up, storage availability, build and process info,
and one shape for every family — against real servers, over HTTP and the ``get_metrics`` RPC."""

from __future__ import annotations

import os
import platform
import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvcm.errors import KvcmError
from kvcm.reclaimer.state import ReclaimMetrics
from kvcm.testing import serve_in_thread
from kvcm.version import __version__
from tests.helpers import (
    add_file_storage,
    add_group,
    add_shm_storage,
    register,
    remove_shm,
    shm_prefix,
    wait_for,
    write,
)

FAST = {"cache": {"session_check_ms": 50, "delete_poll_ms": 20, "storage_health_interval_s": 0.05},
        "reclaim": {"interval_s": 0.05}}


def scrape(port: int) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """``/metrics`` parsed: family name -> [(sample name, labels, value)]."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {f.name: [(s.name, dict(s.labels), s.value) for s in f.samples]
            for f in text_string_to_metric_families(text)}


def values(families, name: str, **match: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of family ``name`` whose labels include ``match``: sorted labels -> value."""
    return {tuple(sorted(labels.items())): value for _, labels, value in families.get(name, [])
            if all(labels.get(k) == v for k, v in match.items())}


@pytest.fixture
def shm():
    prefix = shm_prefix()
    yield prefix
    remove_shm(prefix)


# -- 1. no double counting ------------------------------------------------------------------------


def test_group_totals_are_their_own_families_and_the_per_type_series_add_up(tmp_path, shm):
    with serve_in_thread(overrides=FAST) as srv, srv.client() as c:
        add_file_storage(c, "disk", tmp_path / "disk")
        add_shm_storage(c, "mem", shm)
        # room for two blocks of shm, not three, and never full: nothing for the reclaimer to do
        add_group(c, "typed", ["mem", "disk"], capacity=10 * 2048, per_type={"shm": 2 * 2048 + 1024})
        register(c, "a", group="typed")
        write(c, [1, 2], "a")  # all the shm type quota can take ...
        write(c, [3], "a")  # ... so this one goes to the file storage
        assert srv.http_port is not None

        def settled():
            fams = scrape(srv.http_port)
            return fams if values(fams, "kvcm_group_usage_keys", group="typed") == {(("group", "typed"),): 3} else None

        fams = wait_for(settled)
        assert fams, "the reclaimer never reported group typed's 3 keys"

    for family, samples in fams.items():  # no family anywhere has a label value that sums others
        assert all("all" not in labels.values() for _, labels, _ in samples), family
    by_type = values(fams, "kvcm_usage_bytes", group="typed")
    assert by_type == {(("group", "typed"), ("storage_type", "shm")): 4096,
                       (("group", "typed"), ("storage_type", "file")): 2048}
    total = values(fams, "kvcm_group_usage_bytes", group="typed")
    assert total == {(("group", "typed"),): 6144}
    assert sum(by_type.values()) == sum(total.values())
    assert sum(values(fams, "kvcm_usage_keys", group="typed").values()) == 3
    # summed over every label (all groups), the per-type family equals the group family
    assert sum(values(fams, "kvcm_usage_bytes").values()) == sum(values(fams, "kvcm_group_usage_bytes").values())
    assert sum(values(fams, "kvcm_usage_keys").values()) == sum(values(fams, "kvcm_group_usage_keys").values())
    assert values(fams, "kvcm_group_quota_bytes", group="typed") == {(("group", "typed"),): 10 * 2048}
    assert values(fams, "kvcm_quota_bytes", group="typed") == {(("group", "typed"), ("storage_type", "shm")): 5120}


def test_a_type_whose_usage_is_gone_reads_zero_and_a_forgotten_group_has_no_series():
    registry = CollectorRegistry()
    m = ReclaimMetrics(registry)
    m.set_usage("g", {"bytes": 300, "keys": 3, "by_type": {"file": {"bytes": 100, "keys": 1},
                                                          "shm": {"bytes": 200, "keys": 2}}})
    m.set_usage("g", {"bytes": 100, "keys": 1, "by_type": {"file": {"bytes": 100, "keys": 1}}})
    per_type = {s.labels["storage_type"]: s.value for f in m.usage_bytes.collect() for s in f.samples}
    assert per_type == {"file": 100, "shm": 0}  # not the 200 it last had: the sum must stay 100
    assert registry.get_sample_value("kvcm_group_usage_bytes", {"group": "g"}) == sum(per_type.values())
    m.forget_group("g")
    left = [s for f in registry.collect() for s in f.samples if s.labels.get("group") == "g"]
    assert left == []


# -- 2. kvcm_storage_available --------------------------------------------------------------------


def test_storage_available_follows_the_health_probe_and_removal(tmp_path):
    root, moved = tmp_path / "disk", tmp_path / "disk-gone"
    with serve_in_thread(overrides=FAST) as srv, srv.client() as c:
        add_file_storage(c, "disk", root)
        port = srv.http_port
        assert port is not None

        def available(name: str) -> float | None:
            return values(scrape(port), "kvcm_storage_available", storage=name).get((("storage", name),))

        assert wait_for(lambda: available("disk") == 1.0), available("disk")
        assert available("default-file") == 1.0
        os.rename(root, moved)  # the mount point vanished: the probe cannot write its file
        assert wait_for(lambda: available("disk") == 0.0), available("disk")
        assert c.call("check_health")["storages"]["disk"]["available"] is False  # the same verdict
        snapshot = c.call("get_metrics")["metrics"]["kvcm_storage_available"]
        assert {"labels": {"storage": "disk"}, "value": 0.0} in snapshot
        assert available("default-file") == 1.0  # only the broken one
        os.rename(moved, root)
        assert wait_for(lambda: available("disk") == 1.0), available("disk")
        c.call("remove_storage", {"storage_unique_name": "disk"})
        assert available("disk") is None
        assert available("default-file") == 1.0


# -- 3. build info and the standard collectors ----------------------------------------------------


def test_build_info_and_process_collectors_on_each_apps_own_registry():
    with serve_in_thread() as one, serve_in_thread() as two:  # two apps, one process
        for srv in (one, two):
            assert srv.http_port is not None
            fams = scrape(srv.http_port)
            assert fams["kvcm_build_info"] == [
                ("kvcm_build_info", {"version": __version__, "python": platform.python_version()}, 1.0)]
            assert fams["process_resident_memory_bytes"][0][2] > 0
            assert fams["process_open_fds"][0][2] > 0
            assert "process_cpu_seconds" in fams and "process_start_time_seconds" in fams
            assert fams["python_info"][0][1]["implementation"] == platform.python_implementation()
            with srv.client() as c:
                snap = c.call("get_metrics")["metrics"]
            assert snap["kvcm_build_info"] == [
                {"labels": {"version": __version__, "python": platform.python_version()}, "value": 1.0}]
            assert snap["process_resident_memory_bytes"][0]["value"] > 0
    assert REGISTRY.get_sample_value("kvcm_build_info", {"version": __version__,
                                                         "python": platform.python_version()}) is None


# -- 4. one rule for _created ---------------------------------------------------------------------


def test_no_family_has_created_samples():
    with serve_in_thread(overrides=FAST) as srv, srv.client() as c:
        c.call("check_health")
        with pytest.raises(KvcmError):
            c.call("get_instance_group", {"name": "nobody"})  # counts in kvcm_rpc_errors_total
        assert wait_for(lambda: scrape(srv.http_port).get("kvcm_reclaim_rounds", [("", {}, 0)])[0][2] > 0)
        fams = scrape(srv.http_port)
        snap = c.call("get_metrics")["metrics"]
    # counters and histograms made with prometheus_client's own classes are in the output ...
    assert any(v >= 1 for v in values(fams, "kvcm_rpc_errors").values())
    assert "kvcm_reclaim_round_seconds" in fams and "kvcm_rpc_latency_seconds" in fams
    # ... and, like the custom collectors' families, none has a _created sample
    created = [name for samples in fams.values() for name, _, _ in samples if name.endswith("_created")]
    assert created == []
    assert [name for name in snap if name.endswith("_created")] == []
    assert "kvcm_rpc_errors_total" in snap and "kvcm_reclaim_round_seconds_count" in snap

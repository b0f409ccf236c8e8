"""The benchmarks' CPU budgets (:mod:`kvcm.testing.cgroup`): a process in a budget of a fifth of a
CPU gets about that and the kernel's throttling counters show it; where the controller is missing
or unusable the helper says why instead of running unbudgeted."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvcm.testing.cgroup import CPU_ROOT, CpuBudget, NoCpuControl, cpu_seconds, machine_busy_s, saturation, unavailable

SPIN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass\n"


def test_a_budgeted_process_gets_its_share_and_is_throttled():
    why = unavailable()
    if why is not None:  # no controller here: the helper must say so, and refuse to build a budget
        with pytest.raises(NoCpuControl):
            CpuBudget(f"kvcm-test-{os.getpid()}", 0.2)
        assert "cpu" in why
        return
    budget = CpuBudget(f"kvcm-test-{os.getpid()}", 0.2)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        budget.add(spinner.pid)
        assert budget.members() == [spinner.pid]
        used0, began = cpu_seconds(spinner.pid), time.monotonic()
        time.sleep(1.5)
        share = (cpu_seconds(spinner.pid) - used0) / (time.monotonic() - began)
        throttling = budget.throttling()
    finally:
        spinner.kill()
        spinner.wait()
        budget.close()
    assert 0.1 < share < 0.3, share  # a busy loop held to a fifth of a CPU
    assert throttling.periods > 5 and throttling.throttled > 0.5 * throttling.periods
    assert not os.path.exists(budget.path)


def test_without_a_usable_controller_the_reason_is_given(tmp_path):
    why = unavailable(str(tmp_path))
    assert why is not None and "no cgroup v1 cpu controller" in why
    with pytest.raises(NoCpuControl, match=r"cpu\.cfs_quota_us missing"):
        CpuBudget("kvcm-test", 0.4, root=str(tmp_path))
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")  # looks like one, but cannot hold a group
    with pytest.raises(NoCpuControl, match="cannot create a cgroup"):
        CpuBudget("missing/parent", 0.4, root=str(tmp_path))
    with pytest.raises(ValueError, match="share of one CPU"):
        CpuBudget("kvcm-test", 0.0, root=CPU_ROOT)


def test_saturation_names_the_busiest_helper_and_the_machine():
    calm = saturation([0.2, 0.3], total_cpu_s=1.0, wall_s=1.0, cores=2)
    assert not calm.saturated and calm.busiest == pytest.approx(0.3) and calm.machine == pytest.approx(0.5)
    assert saturation([0.95], total_cpu_s=1.0, wall_s=1.0, cores=2).saturated  # one helper at its core
    assert saturation([0.5], total_cpu_s=1.96, wall_s=1.0, cores=2).saturated  # every core busy


def test_the_machine_s_busy_time_counts_whoever_used_the_cpu():
    before, began = machine_busy_s(), time.perf_counter()
    while time.perf_counter() - began < 0.5:  # half a second of one core, busy
        pass
    assert machine_busy_s() - before >= 0.4

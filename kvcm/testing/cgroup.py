"""CPU budgets for the processes of a benchmark: each in a cgroup of its own (cgroup v1 ``cpu``
controller, ``cpu.cfs_quota_us``), so that a node, not the machine, is what runs out of CPU.

On a shared box every kvcm node, the load generators and Redis take turns on the same cores, so
a second node mostly shares the first one's cores instead of adding its own. Giving each node a
budget well under a core (``--node-cpu 0.4``) reproduces a deployment in which each node has
cores of its own: with the generators and Redis left unbounded and below saturation, a figure
comparing node counts measures the nodes. :func:`cpu_seconds` and :func:`saturation` are what a
benchmark checks before it prints such a figure.

Needs the controller mounted and writable (root, or a delegated subtree): :class:`NoCpuControl`
says why not otherwise, for the benchmark to print and skip its budgeted figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Where the cgroup v1 ``cpu`` controller is usually mounted.
CPU_ROOT = "/sys/fs/cgroup/cpu"
#: The CFS period the budgets are expressed in (microseconds). Shorter than the kernel's 100 ms
#: default: a node past its quota stalls for the rest of the period, and a synchronous client
#: waiting on it stalls too, so a long period turns "0.4 of a core" into 60 ms pauses that no
#: machine with a core per node has.
PERIOD_US = 10_000


class NoCpuControl(Exception):
    """Budgets cannot be set here; the message says why and what would allow it."""


@dataclass(frozen=True)
class Throttling:
    """``cpu.stat`` of a budget: CFS periods with runnable work, those cut short by the quota."""

    periods: int
    throttled: int
    throttled_s: float


class CpuBudget:
    """One cgroup with ``share`` of one CPU; processes are moved into it with :meth:`add` and
    back to the root by :meth:`close` (which then removes the group)."""

    def __init__(self, name: str, share: float, root: str = CPU_ROOT) -> None:
        if not 0.01 <= share <= float(os.cpu_count() or 1):
            raise ValueError(f"a CPU budget is a share of one CPU in 0.01..{os.cpu_count()}, got {share}")
        self.share = share
        self.root = root
        self.path = os.path.join(root, name)
        _check_controller(root)
        try:
            os.mkdir(self.path)
        except FileExistsError:
            pass  # a group left by an earlier run: reused, its quota set again below
        except OSError as exc:
            raise NoCpuControl(f"cannot create a cgroup under {root}: {exc.strerror} (needs root or a delegated "
                               "cpu controller)") from None
        self._write("cpu.cfs_period_us", PERIOD_US)
        self._write("cpu.cfs_quota_us", int(share * PERIOD_US))

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the budget."""
        self._write("cgroup.procs", pid)

    def members(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]

    def throttling(self) -> Throttling:
        with open(os.path.join(self.path, "cpu.stat")) as f:
            stat = dict(line.split() for line in f if line.strip())
        return Throttling(int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0)),
                          int(stat.get("throttled_time", 0)) / 1e9)

    def close(self) -> None:
        """Move what is left back to the root group and remove this one (best effort)."""
        try:
            for pid in self.members():
                try:
                    with open(os.path.join(self.root, "cgroup.procs"), "w") as f:
                        f.write(str(pid))
                except OSError:
                    pass  # exited meanwhile
            os.rmdir(self.path)
        except OSError:
            pass

    def _write(self, name: str, value: int) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(str(value))
        except OSError as exc:
            raise NoCpuControl(f"cannot write {os.path.join(self.path, name)}: {exc.strerror}") from None


def unavailable(root: str = CPU_ROOT) -> str | None:
    """Why budgets cannot be set under ``root``, or None when they can."""
    try:
        _check_controller(root)
    except NoCpuControl as exc:
        return str(exc)
    return None


def _check_controller(root: str) -> None:
    if not os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")):
        raise NoCpuControl(f"no cgroup v1 cpu controller at {root} (cpu.cfs_quota_us missing): CPU budgets need it "
                           "mounted (cgroup v2 machines are not supported by this helper)")
    if not os.access(root, os.W_OK):
        raise NoCpuControl(f"the cpu controller at {root} is not writable by this user (needs root or a delegated "
                           "subtree)")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy so far (``/proc/stat``: all but idle
    and iowait), whoever used them: what a sum over known processes would miss (the kernel,
    interrupts, other tenants of the host) included."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Saturation:
    """Whether the unbounded parts of a run limited it: ``busiest`` is the highest CPU share of
    one core any single-threaded helper (a generator, Redis) used; ``machine`` the share of all
    cores everything used."""

    busiest: float
    machine: float

    #: a single-threaded process above this share of its core is the bottleneck
    PROCESS_LIMIT = 0.9
    #: above this share of every core, everything waits for CPU
    MACHINE_LIMIT = 0.9

    @property
    def saturated(self) -> bool:
        return self.busiest > self.PROCESS_LIMIT or self.machine > self.MACHINE_LIMIT


def saturation(helpers_cpu_s: list[float], total_cpu_s: float, wall_s: float,
               cores: int | None = None) -> Saturation:
    """:class:`Saturation` of a run of ``wall_s`` seconds in which the helpers used
    ``helpers_cpu_s`` each and the machine ``total_cpu_s`` (:func:`machine_busy_s`)."""
    cores = cores or os.cpu_count() or 1
    busiest = max(helpers_cpu_s, default=0.0) / wall_s
    return Saturation(busiest, total_cpu_s / (wall_s * cores))

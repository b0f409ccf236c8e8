"""Sweeps, the cost model, reports and plots."""

from __future__ import annotations

import csv
import sys
from itertools import pairwise

import pytest

from kvcm.optimizer import plot, report
from kvcm.optimizer.cost import CostModel, marginal
from kvcm.optimizer.replay import replay
from kvcm.optimizer.spec import ReplaySpec
from kvcm.optimizer.stats import HitStats
from kvcm.optimizer.sweep import capacity_points, run_sweep, unbounded_run, working_set
from kvcm.optimizer.trace import Record


def _records(n=150):
    out = []
    for i in range(n):
        ids = [(i * 7 + j) % 5 for j in range(1 + i % 6)]
        out.append(Record(float(i), "i", "turn", [hash(tuple(ids[: j + 1])) for j in range(len(ids))],
                          tokens=(len(ids) - 1) * 16 + 5))  # fmt: skip
    return out


# --- capacity points and sweeps -----------------------------------------------------------------


def test_capacity_points_are_log_spaced_up_to_the_working_set():
    points = capacity_points(43924, 40)
    assert points[0] == 43 and points[-1] == 43924 and len(points) == 40
    assert points == sorted(set(points))
    ratios = [b / a for a, b in pairwise(points[10:])]
    assert max(ratios) / min(ratios) < 1.01  # geometric steps once rounding stops mattering
    assert capacity_points(100, 40, low=1)[:3] == [1, 2, 3]  # rounding merges small points
    assert capacity_points(500, 1) == [500] and capacity_points(0) == []


def test_unbounded_run_measures_the_working_set():
    records = _records()
    ceiling = unbounded_run(records, ReplaySpec(), lambda _i: 16)
    distinct = len({k for r in records for k in r.keys})
    assert working_set(ceiling) == distinct
    assert ceiling.total == replay(records, block_size_of=16).total


def test_run_sweep_orders_points_and_matches_in_parallel():
    records, seen = _records(), []
    args = (records, ReplaySpec(), lambda _i: 16, [2, 5, 9], ["leaf_lru", "lru"])
    serial = run_sweep(*args, progress=seen.append)
    assert [(p.policy, p.capacity) for p in serial] == [
        ("leaf_lru", 2), ("leaf_lru", 5), ("leaf_lru", 9), ("lru", 2), ("lru", 5), ("lru", 9)
    ]  # fmt: skip
    assert len(seen) == 6
    parallel = run_sweep(*args, jobs=2)
    assert [p.total for p in parallel] == [p.total for p in serial]
    lru = [p.total.hit_blocks for p in serial if p.policy == "lru"]
    assert lru == sorted(lru)


def test_run_sweep_passes_options_per_policy():
    records = _records()
    (short,) = run_sweep(records, ReplaySpec(), lambda _i: 16, [1000], ["ttl"],
                         policy_options={"ttl": {"ttl_seconds": 0.5}})  # fmt: skip
    (long,) = run_sweep(records, ReplaySpec(), lambda _i: 16, [1000], ["ttl"])
    assert short.total.hit_blocks == 0 < long.total.hit_blocks


# --- cost ---------------------------------------------------------------------------------------


def test_cost_prices_external_hit_tokens_only():
    stats = HitStats(read_tokens=10_000, hit_tokens=7_000, internal_hit_tokens=2_000)
    model = CostModel(prefill_tokens_per_s=1000, gpu_price_per_hour=3.6,
                      storage_price_per_gib_hour=0.5, block_bytes=1 << 20)  # fmt: skip
    value = model.value(stats, duration_s=1800, capacity_bytes=model.capacity_bytes(2048, "blocks"))
    assert value.tokens_saved == 5_000
    assert value.gpu_seconds_saved == 5.0
    assert value.money_saved == pytest.approx(5.0 / 3600 * 3.6)
    assert value.gpu_hours_saved_per_hour == pytest.approx(5.0 / 3600 * 2)
    assert value.money_saved_per_hour == pytest.approx(0.01)
    assert value.storage_cost_per_hour == pytest.approx(2 * 0.5)  # 2048 MiB = 2 GiB
    assert value.net_per_hour == pytest.approx(0.01 - 1.0)
    in_bytes = model.value(stats, 1800, model.capacity_bytes(3 << 30, "bytes"))
    assert in_bytes.storage_cost_per_hour == pytest.approx(1.5)


def test_cost_config_errors_and_marginal_value():
    with pytest.raises(ValueError, match="unknown key 'gpu'"):
        CostModel.from_config({"prefill_tokens_per_s": 1, "gpu": 2})
    with pytest.raises(ValueError, match="prefill_tokens_per_s is required"):
        CostModel.from_config({"gpu_price_per_hour": 2})
    with pytest.raises(ValueError):
        CostModel(prefill_tokens_per_s=0)
    model = CostModel(prefill_tokens_per_s=1, gpu_price_per_hour=3600)
    values = [model.value(HitStats(hit_tokens=t), 3600) for t in (0, 100, 150)]
    assert marginal([10, 20, 40], values) == [None, 10.0, 2.5]


# --- reports ------------------------------------------------------------------------------------


def test_timeline_csv_has_cumulative_rates(tmp_path):
    result = replay([Record(0, "a/b", "turn", [1, 2]), Record(1, "a/b", "turn", [1, 2, 3])],
                    block_size_of=4)  # fmt: skip
    (path,) = report.write_timelines(result, str(tmp_path))
    assert path.endswith("a_b_hit_rates.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["ExternalHitBlocks"] for r in rows] == ["0", "2"]
    assert float(rows[1]["HitRate"]) == pytest.approx(2 / 3)
    assert float(rows[1]["AccHitRate"]) == pytest.approx(2 / 5)


def test_sweep_csv_json_and_tables_carry_cost(tmp_path):
    records = _records()
    ceiling = unbounded_run(records, ReplaySpec(), lambda _i: 16)
    points = run_sweep(records, ReplaySpec(), lambda _i: 16, [3, 30], ["lru", "lfu"])
    cost = CostModel(prefill_tokens_per_s=100, gpu_price_per_hour=1)
    report.write_sweep_csv(points, str(tmp_path / "s.csv"), cost, duration=150)
    with open(tmp_path / "s.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy"], r["capacity"]) for r in rows] == [("lru", "3"), ("lru", "30"),
                                                            ("lfu", "3"), ("lfu", "30")]  # fmt: skip
    assert float(rows[1]["token_hit_rate"]) == pytest.approx(points[1].total.token_hit_rate, abs=1e-6)
    assert float(rows[1]["money_saved"]) > float(rows[0]["money_saved"])
    data = report.sweep_json(points, ceiling, cost, 150)
    assert data["unbounded"]["working_set"] == working_set(ceiling)
    assert data["points"][0]["cost"]["marginal_money_per_hour_per_unit"] is None
    assert data["points"][1]["cost"]["marginal_money_per_hour_per_unit"] > 0
    table = report.sweep_table(points, ceiling, cost, 150)
    assert "unbounded: working set" in table and "money/h" in table and len(table.splitlines()) == 6


# --- plots --------------------------------------------------------------------------------------


def test_sweep_figure_has_labelled_axes_and_one_line_per_policy(tmp_path):
    points = run_sweep(_records(), ReplaySpec(), lambda _i: 16, [2, 8, 30], ["lru", "lfu", "leaf_lru"])
    fig = plot.sweep_figure(points, ceiling=0.5)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "cache capacity (blocks, log scale)" and ax.get_ylabel() == "token hit rate"
    assert ax.get_xscale() == "log"
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["lru", "lfu", "leaf_lru", "unbounded"]
    assert all(len(line.get_xdata()) == 3 for line in ax.get_lines()[:3])
    out = plot.plot_sweep(points, str(tmp_path / "s.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_timeline_figure(tmp_path):
    result = replay(_records(), ReplaySpec(), block_size_of=16)
    ax = plot.timeline_figure(result, window=10).axes[0]
    assert ax.get_xlabel() == "trace time (s)" and len(ax.get_lines()) == 2
    assert plot.plot_timeline(result, str(tmp_path / "t.png")).endswith("t.png")


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(plot.PlotUnavailable, match="pip install 'kvcm\\[plot\\]'"):
        plot.sweep_figure([])
    with pytest.raises(ValueError, match="unknown metric"):
        plot.sweep_figure([], metric="speed")

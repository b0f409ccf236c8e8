"""Results as text tables, CSV and JSON.

Files written by :func:`write_outputs` into an output directory:

* ``{instance}_hit_rates.csv`` — one row per lookup (Tair's per-instance CSV, in seconds and
  with token columns): cache sizes, the lookup's blocks and hits, its rates and the cumulative
  ("Acc") rates so far;
* ``summary.json`` — a single replay: totals, per instance, groups, trace counters (and cost);
* ``sweep.csv`` / ``sweep.json`` — one row per (policy, capacity) point (and its cost).
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Sequence

from kvcm.optimizer.cost import CostModel, Value, marginal
from kvcm.optimizer.stats import GroupResult, ReplayResult, TimelineRow
from kvcm.optimizer.sweep import SweepPoint

TIMELINE_HEADER = (
    "TimestampS", "CachedBlocksInstance", "CachedBlocksGroup", "ReadBlocks", "InternalHitBlocks",
    "ExternalHitBlocks", "HitRate", "InternalHitRate", "ExternalHitRate", "ReadTokens",
    "HitTokens", "TokenHitRate", "AccHitRate", "AccInternalHitRate", "AccExternalHitRate",
    "AccTokenHitRate",
)  # fmt: skip

SWEEP_COLUMNS = (
    "policy", "capacity", "unit", "block_hit_rate", "token_hit_rate", "internal_block_hit_rate",
    "external_block_hit_rate", "external_token_hit_rate", "read_blocks", "hit_blocks",
    "read_tokens", "hit_tokens", "evicted_blocks", "wall_seconds",
)  # fmt: skip


def fmt_capacity(amount: int | None, unit: str) -> str:
    """``10000`` for blocks, ``640.0GiB`` for bytes, ``inf`` for no limit."""
    if amount is None:
        return "inf"
    if unit != "bytes":
        return str(amount)
    value, suffix = float(amount), "B"
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or suffix == "PiB":
            break
        value /= 1024
    return f"{value:.1f}{suffix}" if suffix != "B" else f"{amount}B"


def _rate(a: float, b: float) -> float:
    return a / b if b else 0.0


def timeline_rows(rows: Sequence[TimelineRow]) -> list[list[float]]:
    """Replay timeline tuples -> CSV rows with per-lookup and cumulative rates."""
    out = []
    acc_read = acc_int = acc_ext = acc_tok = acc_hit_tok = 0
    for ts, cached_inst, cached_group, n, internal, external, tokens, _int_tok, hit_tok in rows:
        acc_read += n
        acc_int += internal
        acc_ext += external
        acc_tok += tokens
        acc_hit_tok += hit_tok
        out.append([
            ts, cached_inst, cached_group, n, internal, external,
            round(_rate(internal + external, n), 6), round(_rate(internal, n), 6),
            round(_rate(external, n), 6), tokens, hit_tok, round(_rate(hit_tok, tokens), 6),
            round(_rate(acc_int + acc_ext, acc_read), 6), round(_rate(acc_int, acc_read), 6),
            round(_rate(acc_ext, acc_read), 6), round(_rate(acc_hit_tok, acc_tok), 6),
        ])  # fmt: skip
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "instance"


def write_timelines(result: ReplayResult, out_dir: str) -> list[str]:
    """One ``{instance}_hit_rates.csv`` per instance; returns the paths written."""
    paths = []
    for instance, rows in result.timelines.items():
        path = os.path.join(out_dir, f"{_safe(instance)}_hit_rates.csv")
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(TIMELINE_HEADER)
            writer.writerows(timeline_rows(rows))
        paths.append(path)
    return paths


def result_json(
    result: ReplayResult, counts: dict[str, int] | None = None, cost: CostModel | None = None
) -> dict[str, object]:
    """A JSON-able summary of one replay."""
    out: dict[str, object] = {
        "label": result.label,
        "records": result.records,
        "dropped_records": result.dropped_records,
        "trace_seconds": result.duration,
        "wall_seconds": result.wall_seconds,
        "total": result.total.to_json(),
        "instances": {k: v.to_json() for k, v in result.instances.items()},
        "groups": [vars(g) for g in result.groups],
        "trace_counts": dict(counts or {}),
    }
    if cost is not None:
        out["cost"] = _value_of(result, cost).to_json()
    return out


def _value_of(result: ReplayResult, cost: CostModel) -> Value:
    held = sum(cost.capacity_bytes(t["capacity"] or 0, g.unit) for g in result.groups for t in g.tiers)
    return cost.value(result.total, result.duration, held)


def sweep_json(
    points: Sequence[SweepPoint],
    ceiling: ReplayResult | None = None,
    cost: CostModel | None = None,
    duration: float = 0.0,
) -> dict[str, object]:
    """A JSON-able sweep: its points (with cost when given) and the unbounded ceiling."""
    rows = [p.to_json() for p in points]
    if cost is not None:
        for row, value, extra in zip(rows, *_priced(points, cost, duration)):
            row["cost"] = {**value.to_json(), "marginal_money_per_hour_per_unit": extra}
    out: dict[str, object] = {"points": rows}
    if ceiling is not None:
        out["unbounded"] = {"working_set": max((g.peak_usage for g in ceiling.groups), default=0),
                            **ceiling.total.to_json()}  # fmt: skip
    return out


def _priced(
    points: Sequence[SweepPoint], cost: CostModel, duration: float
) -> tuple[list[Value], list[float | None]]:
    # The swept capacity is what is priced (other tiers, if any, are the same at every point).
    values = [cost.value(p.total, duration, cost.capacity_bytes(p.capacity, p.unit)) for p in points]
    margins: list[float | None] = []
    start = 0
    for end in range(1, len(points) + 1):
        if end == len(points) or points[end].policy != points[start].policy:
            caps = [p.capacity for p in points[start:end]]
            margins += marginal(caps, values[start:end])
            start = end
    return values, margins


def write_sweep_csv(
    points: Sequence[SweepPoint], path: str, cost: CostModel | None = None, duration: float = 0.0
) -> None:
    """``sweep.csv``: one row per point (plus cost columns when ``cost`` is given)."""
    cost_cols = ["tokens_saved", "gpu_seconds_saved", "money_saved", "money_saved_per_hour",
                 "storage_cost_per_hour", "net_per_hour"]  # fmt: skip
    values = _priced(points, cost, duration)[0] if cost is not None else []
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(list(SWEEP_COLUMNS) + (cost_cols if cost is not None else []))
        for i, p in enumerate(points):
            row = p.to_json()
            line = [_fmt(row[c]) for c in SWEEP_COLUMNS]
            if cost is not None:
                v = values[i].to_json()
                line += [_fmt(v[c]) for c in cost_cols]
            writer.writerow(line)


def _fmt(value: object) -> object:
    return round(value, 6) if isinstance(value, float) else value


def write_json(obj: object, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# --- text tables --------------------------------------------------------------------------------


def result_table(result: ReplayResult, cost: CostModel | None = None) -> str:
    """A human summary of one replay: a line per instance and the total."""
    lines = [
        (
            f"replay {result.label}: {result.records} records, {result.duration:.0f} s of trace, "
            f"{result.wall_seconds:.2f} s wall"
        ),
        (
            f"{'instance':<24} {'reads':>8} {'blocks':>10} {'block hit':>9} {'int':>7} "
            f"{'ext':>7} {'token hit':>9}"
        ),
    ]
    rows = list(result.instances.items())
    if len(rows) > 1:
        rows.append(("TOTAL", result.total))
    for name, s in rows:
        lines.append(
            f"{name[:24]:<24} {s.reads:>8} {s.read_blocks:>10} {s.block_hit_rate:>9.4f} "
            f"{s.internal_block_hit_rate:>7.4f} {s.external_block_hit_rate:>7.4f} "
            f"{s.token_hit_rate:>9.4f}"
        )
    for g in result.groups:
        tiers = ", ".join(f"{t['name']}: {t['policy']} cap={fmt_capacity(t['capacity'], g.unit)} "
                          f"used={fmt_capacity(t['usage'], g.unit)}" for t in g.tiers)  # fmt: skip
        unit = " blocks" if g.unit == "blocks" else ""
        lines.append(f"group {g.name}: {tiers}; peak {fmt_capacity(g.peak_usage, g.unit)}{unit}")
        if len(g.tiers) > 1:
            lines.append(_tier_hits(result, g))
    if cost is not None:
        lines.append(_cost_line(_value_of(result, cost).to_json()))
    return "\n".join(lines)


def _tier_hits(result: ReplayResult, group: GroupResult) -> str:
    reads = sum(result.instances[i].read_blocks for i in group.instances)
    hits = [sum(result.instances[i].tier_hit_blocks[t] for i in group.instances)
            for t in range(len(group.tiers))]  # fmt: skip
    shares = ", ".join(f"{t['name']} {_rate(h, reads):.4f}" for t, h in zip(group.tiers, hits))
    return f"  block hits by tier: {shares}"


def _cost_line(v: dict[str, float]) -> str:
    return (
        f"saved {v['tokens_saved']} prefill tokens = {v['gpu_seconds_saved']:.0f} GPU-s, worth "
        f"{v['money_saved']:.2f}\nper hour of this traffic: {v['gpu_hours_saved_per_hour']:.2f} "
        f"GPU-h saved, worth {v['money_saved_per_hour']:.2f}; the capacity costs "
        f"{v['storage_cost_per_hour']:.2f}; net {v['net_per_hour']:.2f}"
    )


def sweep_table(
    points: Sequence[SweepPoint],
    ceiling: ReplayResult | None = None,
    cost: CostModel | None = None,
    duration: float = 0.0,
) -> str:
    """A human summary of a sweep: one line per point."""
    lines = []
    unit = points[0].unit if points else "blocks"
    if ceiling is not None:
        ws = fmt_capacity(max((g.peak_usage for g in ceiling.groups), default=0), unit)
        lines.append(f"unbounded: working set {ws}, block hit {ceiling.total.block_hit_rate:.4f}, "
                     f"token hit {ceiling.total.token_hit_rate:.4f}")  # fmt: skip
    head = f"{'policy':<11} {'capacity':>12} {'block hit':>9} {'token hit':>9}"
    lines.append(head + (f" {'money/h':>9} {'net/h':>9}" if cost is not None else ""))
    values = _priced(points, cost, duration)[0] if cost is not None else []
    for i, p in enumerate(points):
        cap = fmt_capacity(p.capacity, p.unit)
        line = f"{p.policy:<11} {cap:>12} {p.total.block_hit_rate:>9.4f} {p.total.token_hit_rate:>9.4f}"
        if cost is not None:
            line += f" {values[i].money_saved_per_hour:>9.2f} {values[i].net_per_hour:>9.2f}"
        lines.append(line)
    return "\n".join(lines)

"""``kvcm optimize``: replay a trace, sweep capacities and policies, plot, price the hits.

:func:`add_optimize_parser` adds the subcommand to a parent parser, :func:`run_optimize` runs
it (exit status 0 on success, 1 on a bad trace, 2 on bad arguments or configuration), and
:func:`main` is ``python -m kvcm.optimizer``. The library does the work; this module only turns
arguments into a :class:`~kvcm.optimizer.spec.ReplaySpec` and prints or writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvcm.optimizer import plot, report
from kvcm.optimizer.cost import CostModel
from kvcm.optimizer.replay import Replayer
from kvcm.optimizer.spec import (
    ReplaySpec,
    SpecError,
    load_toml,
    parse_capacity,
    spec_from_config,
)
from kvcm.optimizer.stats import ReplayResult
from kvcm.optimizer.sweep import (
    UNBOUNDED,
    capacity_points,
    run_sweep,
    unbounded_run,
    with_first_tiers,
    working_set,
)
from kvcm.optimizer.trace import Record, TraceError
from kvcm.optimizer.trace_readers import READERS, Trace, dump_schema, parse_options, read_trace
from kvcm.policies import POLICIES

DESCRIPTION = "Replay a KV-cache trace offline: hit rates per policy and capacity, plots, cost."

#: Where the sample traces live: package data, installed with kvcm (``pip install .``), so the
#: quick start needs no checkout and no download.
SAMPLES_DIR = Path(__file__).resolve().parent / "samples"


@dataclass(frozen=True)
class Sample:
    """A trace shipped with kvcm: its file under :data:`SAMPLES_DIR` and its format."""

    file: str
    format: str
    about: str

    @property
    def path(self) -> Path:
        return SAMPLES_DIR / self.file


SAMPLES: dict[str, Sample] = {
    "mooncake": Sample("mooncake.jsonl.gz", "mooncake",
                       "Mooncake's synthetic trace (FAST'25, Apache-2.0): 3993 requests, 512-token blocks"),
}


def sample_path(name: str) -> Path:
    """The path of the shipped sample ``name``; ValueError naming the valid ones otherwise."""
    sample = SAMPLES.get(name)
    if sample is None:
        raise ValueError(f"unknown sample {name!r}; valid: {', '.join(sorted(SAMPLES))} (--list-samples)")
    return sample.path


def add_optimize_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``optimize`` to an ``argparse`` subparsers object; returns the new parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "optimize", help=DESCRIPTION, description=DESCRIPTION
    )
    _add_arguments(p)
    p.set_defaults(run=run_optimize, func=run_optimize)  # kvcm.cli dispatches on ``run``
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("trace")
    t.add_argument("trace", nargs="?", help="trace file (.jsonl, or .jsonl.gz); or [trace] path")
    t.add_argument("--sample", metavar="NAME", help="replay a trace shipped with kvcm (see --list-samples)")
    t.add_argument("--list-samples", action="store_true", help="print the shipped sample traces and exit")
    t.add_argument("--format", "-f", choices=sorted(READERS), help="trace format (default mooncake)")
    t.add_argument("--block-size", type=int, help="tokens per block (default: the format's)")
    t.add_argument("--trace-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="reader option, e.g. time_scale=0.001 (repeatable)")  # fmt: skip
    t.add_argument("--limit", type=int, help="replay only the first N records")
    t.add_argument("--dump-schema", metavar="FILE", help="write the trace as kvcm_schema and exit")
    r = p.add_argument_group("replay")
    r.add_argument("--config", "-c", help="TOML file: groups, instances, tiers, cost")
    r.add_argument("--policy", choices=sorted(POLICIES), help="eviction policy (default lru)")
    r.add_argument("--policies", help="comma-separated policies to compare, e.g. lru,lfu,leaf_lru")
    r.add_argument("--policy-opt", action="append", default=[], metavar="[POLICY.]KEY=VALUE",
                   help="policy option, e.g. ttl.ttl_seconds=600 (repeatable)")  # fmt: skip
    r.add_argument("--capacity", help="first-tier capacity: blocks (10000) or bytes (40GiB)")
    r.add_argument("--block-bytes", type=int, help="bytes per block, for byte capacities")
    r.add_argument("--watermark", type=float, help="evict down to capacity * watermark")
    r.add_argument("--mode", choices=("exact", "batched"), help="eviction mode (default exact)")
    r.add_argument("--batch-size", type=int, help="blocks per eviction batch in batched mode")
    s = p.add_argument_group("sweep")
    s.add_argument("--sweep", action="store_true", help="sweep capacities up to the working set")
    s.add_argument("--points", type=int, default=40, help="capacities in a sweep (default 40)")
    s.add_argument("--min-capacity", type=int, help="smallest swept capacity")
    s.add_argument("--capacities", help="explicit comma-separated capacities to sweep")
    s.add_argument("--jobs", "-j", type=int, default=1, help="parallel replays (default 1)")
    o = p.add_argument_group("output")
    o.add_argument("--out", "-o", help="directory for CSV / JSON results")
    o.add_argument("--plot", metavar="PNG", help="write a plot (sweep: vs capacity; else: over time)")
    o.add_argument("--metric", choices=sorted(plot.METRICS), default="token_hit_rate",
                   help="hit rate plotted against capacity")  # fmt: skip
    o.add_argument("--export-tree", metavar="DIR", help="write each instance's radix tree")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    c = p.add_argument_group("cost")
    c.add_argument("--prefill-tps", type=float, help="prefill tokens/s per GPU (enables cost)")
    c.add_argument("--gpu-price", type=float, help="price of one GPU-hour")
    c.add_argument("--storage-price", type=float, help="price of one GiB-hour of cache")


def run_optimize(args: argparse.Namespace) -> int:
    """Run ``kvcm optimize`` for parsed ``args``; returns the exit status."""
    try:
        return _run(args)
    except TraceError as exc:
        print(f"kvcm optimize: {exc}", file=sys.stderr)
        return 1
    except (SpecError, ValueError, FileNotFoundError, plot.PlotUnavailable) as exc:
        print(f"kvcm optimize: error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcm.optimizer ARGS`` (the same arguments as ``kvcm optimize``)."""
    parser = argparse.ArgumentParser(prog="python -m kvcm.optimizer", description=DESCRIPTION)
    _add_arguments(parser)
    return run_optimize(parser.parse_args(argv))


# --- setup --------------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    if args.list_samples:
        for name, sample in sorted(SAMPLES.items()):
            print(f"{name}\t{sample.format}\t{sample.path}\t{sample.about}")
        return 0
    if args.plot:  # before anything runs or is written: the replay may take long
        plot.require()
    if args.sample is not None:
        if args.trace:
            raise ValueError("give either TRACE or --sample, not both")
        path = sample_path(args.sample)
        if not path.is_file():  # a broken install, not a user error in the arguments
            raise FileNotFoundError(f"sample {args.sample!r} is missing from this install: {path}")
        args.trace = str(path)
        if args.format is None:
            args.format = SAMPLES[args.sample].format
    config = load_toml(args.config) if args.config else {}
    spec = _spec(args, config)
    cost = _cost(args, config)
    policies = _policies(args, spec)
    options = _policy_options(args.policy_opt, policies)
    if len(policies) == 1 and policies[0] in options:
        spec = with_first_tiers(spec, policies[0], options[policies[0]]).validate()
    with _Progress(args.quiet) as progress:
        trace = _open_trace(args, config, progress)
        if args.dump_schema:
            n = dump_schema(trace, args.dump_schema)
            print(f"wrote {n} records to {args.dump_schema}", file=sys.stderr)
            return 0
        for directory in (args.out, os.path.dirname(args.plot or "")):
            if directory:
                os.makedirs(directory, exist_ok=True)
        if args.sweep or len(policies) > 1:
            return _sweep(args, trace, spec, policies, options, cost, progress)
        return _single(args, trace, spec, cost, progress)


def _spec(args: argparse.Namespace, config: dict[str, Any]) -> ReplaySpec:
    spec = spec_from_config(config)
    changes = {k: v for k, v in (("watermark", args.watermark), ("mode", args.mode),
                                 ("batch_size", args.batch_size)) if v is not None}  # fmt: skip
    spec = replace(spec, timeline=bool(args.out or args.plot) and not args.sweep,
                   trees=bool(args.export_tree), **changes)  # fmt: skip
    if args.block_bytes is not None:
        spec = replace(spec, groups=tuple(replace(g, block_bytes=args.block_bytes) for g in spec.groups))
    if args.capacity is not None:
        spec = spec.map_groups(capacity=parse_capacity(args.capacity))
    if args.policy is not None:
        spec = with_first_tiers(spec, args.policy)
    return spec.validate()


def _policies(args: argparse.Namespace, spec: ReplaySpec) -> list[str]:
    if not args.policies:
        return [spec.groups[0].tiers[0].policy]
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; valid: {', '.join(POLICIES)}")
    return names


def _policy_options(items: Sequence[str], policies: Sequence[str]) -> dict[str, dict[str, object]]:
    """``[POLICY.]KEY=VALUE`` items -> {policy: {key: value}}; no POLICY = every policy."""
    out: dict[str, dict[str, object]] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"bad --policy-opt {item!r}: expected [POLICY.]KEY=VALUE")
        policy, dot, key = name.rpartition(".")
        for target in [policy] if dot else policies:
            out.setdefault(target, {})[key] = _value(raw)
    return out


def _value(raw: str) -> int | float | bool | str:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def _cost(args: argparse.Namespace, config: dict[str, Any]) -> CostModel | None:
    table = dict(config.get("cost", {}))
    for key, value in (("prefill_tokens_per_s", args.prefill_tps), ("gpu_price_per_hour",
                       args.gpu_price), ("storage_price_per_gib_hour", args.storage_price)):  # fmt: skip
        if value is not None:
            table[key] = value
    if args.block_bytes is not None:
        table.setdefault("block_bytes", args.block_bytes)
    if not table:
        return None
    return CostModel.from_config(table)


def _open_trace(args: argparse.Namespace, config: dict[str, Any], progress: _Progress) -> Trace:
    section = dict(config.get("trace", {}))
    unknown = sorted(set(section) - {"path", "format", "block_size", "options"})
    if unknown:
        raise SpecError(f"[trace]: unknown key {unknown[0]!r}; valid: block_size, format, options, path")
    path = args.trace or section.get("path")
    if not path:
        raise ValueError("no trace: give TRACE or [trace] path in the config")
    fmt = args.format or section.get("format", "mooncake")
    options = {**section.get("options", {}), **parse_options(fmt, args.trace_opt)}
    block_size = args.block_size or section.get("block_size")
    size = os.path.getsize(path) if os.path.exists(path) and not path.endswith(".gz") else None
    trace = read_trace(path, fmt, block_size=block_size, progress=progress.bar("read", size),
                       **options)  # fmt: skip
    if args.limit is not None:
        trace.records = _limited(trace.records, args.limit)
    return trace


def _limited(records: Iterator[Record], n: int) -> Iterator[Record]:
    for i, record in enumerate(records):
        if i >= n:
            return
        yield record


class _Progress:
    """tqdm bars on stderr, only when it is a terminal and not ``--quiet``."""

    def __init__(self, quiet: bool) -> None:
        self.enabled = not quiet and sys.stderr.isatty()
        self._bars: list[Any] = []

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the bars opened so far."""
        for bar in self._bars:
            bar.close()
        self._bars.clear()

    def bar(self, desc: str, total: int | None, unit: str = "B") -> Callable[[int], object] | None:
        """A callable advancing a new bar by its argument (a no-op when disabled)."""
        if not self.enabled:
            return None
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

        bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                   leave=False, dynamic_ncols=True)  # fmt: skip
        self._bars.append(bar)
        update: Callable[[int], object] = bar.update
        return update


# --- runs ---------------------------------------------------------------------------------------


def _single(
    args: argparse.Namespace, trace: Trace, spec: ReplaySpec, cost: CostModel | None,
    progress: _Progress,
) -> int:  # fmt: skip
    result = Replayer(spec, trace.block_size_of).run(trace)
    summary = report.result_json(result, trace.counts, cost)
    if args.out:
        report.write_timelines(result, args.out)
        report.write_json(summary, os.path.join(args.out, "summary.json"))
    if args.plot:
        plot.plot_timeline(result, args.plot)
    if args.export_tree:
        _export_trees(result, args.export_tree)
    _print(args, summary, lambda: report.result_table(result, cost))
    return 0


def _sweep(
    args: argparse.Namespace, trace: Trace, spec: ReplaySpec, policies: list[str],
    options: dict[str, dict[str, object]], cost: CostModel | None, progress: _Progress,
) -> int:  # fmt: skip
    records = list(trace)
    progress.close()
    ceiling: ReplayResult | None = None
    if args.sweep:
        ceiling = unbounded_run(records, spec, trace.block_size_of)
        capacities = _capacities(args, working_set(ceiling))
    else:
        first = spec.groups[0].tiers[0].capacity
        capacities = [first.amount if first is not None else UNBOUNDED]
    bar = progress.bar("sweep", len(capacities) * len(policies), unit="replay")
    points = run_sweep(records, spec, trace.block_size_of, capacities, policies, args.jobs,
                       (lambda _p: bar(1)) if bar else None, options)  # fmt: skip
    duration = _duration(records)
    summary = report.sweep_json(points, ceiling, cost, duration)
    summary["trace_counts"] = dict(trace.counts)
    if args.out:
        report.write_sweep_csv(points, os.path.join(args.out, "sweep.csv"), cost, duration)
        report.write_json(summary, os.path.join(args.out, "sweep.json"))
    if args.plot:
        top = ceiling.total if ceiling is not None else None
        plot.plot_sweep(points, args.plot, args.metric, ceiling=getattr(top, args.metric, None))
    _print(args, summary, lambda: report.sweep_table(points, ceiling, cost, duration))
    return 0


def _capacities(args: argparse.Namespace, ws: int) -> list[int]:
    if args.capacities:
        try:
            return sorted({int(c) for c in args.capacities.split(",") if c.strip()})
        except ValueError:
            raise ValueError(f"bad --capacities {args.capacities!r}: integers only") from None
    points = capacity_points(ws, args.points, args.min_capacity)
    if not points:
        raise ValueError("the trace has no blocks to sweep over")
    return points


def _duration(records: Sequence[Record]) -> float:
    return max(records[-1].ts - records[0].ts, 0.0) if records else 0.0


def _export_trees(result: ReplayResult, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for instance, tree in result.trees.items():
        base = os.path.join(out_dir, f"radix_tree_{report._safe(instance)}")
        report.write_json(tree.export(), base + ".json")
        with open(base + ".dot", "w", encoding="utf-8") as f:
            f.write(tree.to_dot())


def _print(args: argparse.Namespace, summary: object, table: Callable[[], str]) -> None:
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table())

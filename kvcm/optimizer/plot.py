"""PNG plots: hit rate against capacity (one line per policy) and hit rate over time.

matplotlib is an optional extra (``pip install 'kvcm[plot]'``); it is imported only when a plot
is drawn, through the object API (no pyplot global state, no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcm.optimizer.report import timeline_rows
from kvcm.optimizer.stats import ReplayResult, TimelineRow
from kvcm.optimizer.sweep import SweepPoint

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRICS = {
    "token_hit_rate": "token hit rate",
    "block_hit_rate": "block hit rate",
    "external_token_hit_rate": "external token hit rate",
    "external_block_hit_rate": "external block hit rate",
}


_MARKERS = ("o", "s", "^", "D", "v", "x", "P")
_DASHES = ("-", "--", "-.", ":")


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require() -> None:
    """Raise :class:`PlotUnavailable` unless matplotlib imports: ``kvcm optimize --plot`` calls
    this before a sweep, so a missing extra fails in a second, not after a long replay."""
    _figure_class()


def _figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(
            "plotting needs matplotlib: pip install 'kvcm[plot]' (or pip install matplotlib)"
        ) from None
    return Figure


def _figure(width: float = 8.0, height: float = 5.0) -> Figure:
    return _figure_class()(figsize=(width, height), dpi=110, layout="constrained")


def plot_sweep(
    points: Sequence[SweepPoint],
    path: str,
    metric: str = "token_hit_rate",
    title: str = "",
    ceiling: float | None = None,
) -> str:
    """Write :func:`sweep_figure` as a PNG to ``path``; returns ``path``."""
    sweep_figure(points, metric, title, ceiling).savefig(path)
    return path


def sweep_figure(
    points: Sequence[SweepPoint],
    metric: str = "token_hit_rate",
    title: str = "",
    ceiling: float | None = None,
) -> Figure:
    """Hit rate against capacity (log scale), one line per policy.

    ``ceiling`` (the unbounded hit rate) is drawn as a dashed grey line.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")
    fig = _figure()
    ax = fig.add_subplot()
    by_policy: dict[str, list[SweepPoint]] = {}
    for p in points:
        by_policy.setdefault(p.policy, []).append(p)
    for i, (policy, pts) in enumerate(by_policy.items()):
        pts = sorted(pts, key=lambda p: p.capacity)
        xs = [max(p.capacity, 1) for p in pts]
        # Policies often overlap; distinct markers and dashes keep every line visible.
        ax.plot(xs, [getattr(p.total, metric) for p in pts], label=policy,
                marker=_MARKERS[i % len(_MARKERS)], markersize=4,
                linestyle=_DASHES[i % len(_DASHES)])  # fmt: skip
    if ceiling is not None:
        ax.axhline(ceiling, color="grey", linestyle="--", linewidth=1, label="unbounded")
    unit = points[0].unit if points else "blocks"
    ax.set_xscale("log")
    ax.set_xlabel(f"cache capacity ({unit}, log scale)")
    ax.set_ylabel(METRICS[metric])
    ax.set_ylim(0, 1)
    ax.set_title(title or f"{METRICS[metric]} vs capacity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="policy")
    return fig


def plot_timeline(result: ReplayResult, path: str, window: int = 200, title: str = "") -> str:
    """Write :func:`timeline_figure` as a PNG to ``path``; returns ``path``."""
    timeline_figure(result, window, title).savefig(path)
    return path


def timeline_figure(result: ReplayResult, window: int = 200, title: str = "") -> Figure:
    """Token hit rate over trace time per instance: cumulative (solid) and over the last
    ``window`` lookups (faint)."""
    fig = _figure()
    ax = fig.add_subplot()
    for instance, rows in result.timelines.items():
        if not rows:
            continue
        t0 = rows[0][0]
        xs = [r[0] - t0 for r in rows]
        line = ax.plot(xs, [r[-1] for r in timeline_rows(rows)], label=f"{instance} cumulative")
        ax.plot(xs, _windowed(rows, window), color=line[0].get_color(), alpha=0.35,
                linewidth=0.8, label=f"{instance} last {window}")  # fmt: skip
    ax.set_xlabel("trace time (s)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(title or f"hit rate over time ({result.label})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def _windowed(rows: Sequence[TimelineRow], window: int) -> list[float]:
    """Token hit rate over the last ``window`` lookups, at every lookup."""
    out, tokens, hits = [], 0, 0
    for i, row in enumerate(rows):
        tokens += row[6]
        hits += row[8]
        if i >= window:
            tokens -= rows[i - window][6]
            hits -= rows[i - window][8]
        out.append(hits / tokens if tokens else 0.0)
    return out

"""The planner's figure: every evaluated plan's peak memory against its time, the frontier, the budget and the
choice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipefold.files import check_figure_path, save_figure
from pipefold.plan.budget import Point

if TYPE_CHECKING:
    from pipefold.plan.cluster import Cluster
    from pipefold.plan.cluster_plan import ClusterPlan, Training

__all__ = ["plot_cluster", "plot_frontier"]


_FRONTIER_COLOR = "#0072B2"  # blue, as forwards
_BUDGET_COLOR = "#D55E00"  # vermillion: the constraint and the answer it picks


def plot_frontier(points: Sequence[Point], frontier: Sequence[Point], budget: float, chosen: Point, path: str, *,
                  title: str | None = None, unit: str = "M") -> None:
    """Save the planner's memory/makespan trade-off as a ``.png`` or ``.svg`` file.

    x is peak memory per device (in M, or with ``unit="bytes"`` in MiB of everything a device holds), y
    makespan (or seconds per step). Every evaluated point is a
    faint dot; the frontier is a step line (the best makespan any budget up to
    x buys) with each of its points labelled; the budget is a dashed vertical
    line and the chosen point a large marker.
    """
    from matplotlib.figure import Figure

    check_figure_path(path, "a frontier plot")
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax = fig.add_subplot()
    if unit == "bytes":  # a measured model's plans: MiB and milliseconds read better than bytes and seconds
        scale = 1 / 2**20

        def mem(pt: Point) -> float:
            return pt.memory * scale

        def span(pt: Point) -> float:
            return pt.makespan * 1e3
        budget = budget * scale
        units = ("MiB", "peak memory per device (MiB): weights, gradients, optimizer state, activations",
                 "step time (ms)")
    else:
        def mem(pt: Point) -> float:
            return pt.memory

        def span(pt: Point) -> float:
            return pt.makespan
        units = ("M", "peak activation memory per device (M)", "makespan")
    right = max([mem(pt) for pt in points] + [budget]) * 1.04
    ax.axvspan(budget, right, color=_BUDGET_COLOR, alpha=0.05, linewidth=0, zorder=0)
    ax.axvline(budget, color=_BUDGET_COLOR, linestyle="--", linewidth=1.2, zorder=1,
               label=f"budget {budget:.4g} {units[0]}")
    ax.scatter([mem(pt) for pt in points], [span(pt) for pt in points], s=14, color="#888888", alpha=0.3,
               linewidths=0, zorder=2, label=f"{len(points)} evaluated")
    xs, ys = [mem(pt) for pt in frontier], [span(pt) for pt in frontier]
    ax.step(xs + [right], ys + ys[-1:], where="post", color=_FRONTIER_COLOR, linewidth=1.6, zorder=3,
            label="frontier")
    ax.scatter(xs, ys, s=22, color=_FRONTIER_COLOR, zorder=4)
    for i, pt in enumerate(frontier):
        # Alternate above and below: neighbouring frontier points are often close in both axes.
        dy = 5 if i % 2 == 0 else -11
        ax.annotate(pt.spec, (mem(pt), span(pt)), xytext=(4, dy), textcoords="offset points", fontsize=7.5,
                    color=_BUDGET_COLOR if pt == chosen else "#333333")
    ax.scatter([mem(chosen)], [span(chosen)], s=140, marker="*", color=_BUDGET_COLOR, edgecolors="white",
               linewidths=0.6, zorder=5, label=f"chosen {chosen.spec}")
    ax.set_xlim(0, right)
    ax.set_xlabel(units[1])
    ax.set_ylabel(units[2])
    ax.grid(color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="upper right", frameon=False, fontsize=8)
    if title is None:
        title = (f"p={len(chosen.peak_memory)}, budget {budget:.4g} M: {chosen.spec}, "
                 f"makespan {chosen.makespan:.4g}, peak {chosen.memory:.4g} M")
    ax.set_title(title, fontsize=10, loc="left")
    save_figure(fig, path)
    fig.clear()


def plot_cluster(answer: ClusterPlan, cluster: Cluster, training: Training, path: str) -> None:
    """Save a cluster plan as a ``.png`` or ``.svg`` file: every configuration's memory per GPU against its tokens
    per second per GPU, coloured by pipeline depth, those that do not fit faint; the usable memory a dashed line,
    the frontier a step line, the best a large marker."""
    from matplotlib.figure import Figure

    check_figure_path(path, "a cluster plot")
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax = fig.add_subplot()
    gib, per_gpu = 1 / 2**30, 1 / cluster.devices
    depths = sorted({p.pp for p in answer.points})
    palette = ["#0072B2", "#009E73", "#E69F00", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
    for i, pp in enumerate(depths):
        fit = [p for p in answer.points if p.pp == pp and p.fits]
        over = [p for p in answer.points if p.pp == pp and not p.fits]
        color = palette[i % len(palette)]
        ax.scatter([p.memory * gib for p in over], [p.tokens_per_second * per_gpu for p in over], s=6, color=color,
                   alpha=0.15, linewidths=0)
        ax.scatter([p.memory * gib for p in fit], [p.tokens_per_second * per_gpu for p in fit], s=10, color=color,
                   alpha=0.7, linewidths=0, label=f"pp {pp}")
    usable = cluster.accelerator.memory_bytes * cluster.accelerator.usable_memory * gib
    ax.axvline(usable, color=_BUDGET_COLOR, linestyle="--", linewidth=1, label=f"usable memory {usable:.0f} GiB")
    front = sorted(answer.frontier, key=lambda p: p.memory)
    ax.step([p.memory * gib for p in front], [p.tokens_per_second * per_gpu for p in front], where="post",
            color="#444444", linewidth=1, label="frontier")
    if answer.best is not None:
        b = answer.best
        ax.scatter([b.memory * gib], [b.tokens_per_second * per_gpu], s=120, marker="*", color=_BUDGET_COLOR,
                   zorder=5, label=f"best: {b.layout} {b.schedule}, MFU {b.mfu:.0%}")
    beyond = sum(p.memory * gib > 1.5 * usable for p in answer.points)
    ax.set_xlim(0, 1.5 * usable)
    if beyond:
        ax.text(0.99, 0.98, f"{beyond} configurations need more than {1.5 * usable:.0f} GiB (not shown)",
                transform=ax.transAxes, ha="right", va="top", fontsize=8, color="#666666")
    ax.set_xlabel("memory per GPU (GiB)")
    ax.set_ylabel("tokens per second per GPU")
    ax.set_title(f"{training.model.name} on {cluster.devices} x {cluster.accelerator.name}: "
                 f"{answer.evaluated} configurations, global batch {training.global_batch} x {training.seq} tokens",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    save_figure(fig, path)

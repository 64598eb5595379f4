"""Drawings of a simulated timeline: a coloured terminal timeline, a Gantt + memory figure, a Chrome trace.

All three read a :class:`~pipefold.sim.simulate.SimResult` and share one palette:
forward blue, input-gradient backward orange, weight-gradient backward green,
fused backward purple (the Okabe-Ito colours, safe for colour-blind readers).
On a device holding several stages, later chunks are lighter shades of the
same colour. The terminal form of zb-h1 on 3 devices, 4 microbatches, looks
like this (each box is a run of background colour in the terminal)::

    dev 0 0 1 2 ····0 0 3 1 1 2 2 3 3
    dev 1 ··0 1 ··0 2 1 0 3 2 1 3 2 3
    dev 2 ····0 0 1 1 2 2 0 3 3 1 2 3
     F   B   W  1 col = 0.5 time units
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from rich.style import Style
from rich.text import Text

from pipefold.errors import ConfigError
from pipefold.files import check_figure_path, save_figure, write_json
from pipefold.ir import KINDS, Action, Schedule
from pipefold.ir.ref import ScheduleRef
from pipefold.sim.simulate import Interval, SimResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from pipefold.sim.network import Network

__all__ = ["ascii_timeline", "chrome_trace", "draw_gantt", "draw_memory", "plot_timeline",
           "write_chrome_trace"]

_LIGHTEST = 0.55  # the last chunk is mixed this far towards white
_IDLE = "·"
_EPS = 1e-9


# --------------------------------------------------------------------------- palette


def _chunk_count(schedule: Schedule) -> int:
    return max(len(schedule.stages_of(d)) for d in range(schedule.devices))


def _chunk_table(schedule: Schedule) -> list[int]:
    """Chunk index of every stage (computed once; ``chunk_of`` scans the placement each call)."""
    return [schedule.chunk_of(s) for s in range(schedule.stages)]


def _box_color(kind: str, chunk: int, chunks: int) -> str:
    """Hex colour of a box: the kind's colour (:data:`pipefold.ir.KINDS`), lighter for later chunks."""
    base = KINDS[kind].color
    if chunks <= 1 or chunk == 0:
        return base
    mix = _LIGHTEST * chunk / (chunks - 1)
    rgb = [int(base[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def _ink(background: str) -> str:
    """Black or white, whichever contrasts more with ``background`` (WCAG relative luminance)."""
    def channel(c: int) -> float:
        x = c / 255
        return x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(int(background[i:i + 2], 16)) for i in (1, 3, 5))
    lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#000000" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "#ffffff"


def _kinds_present(*schedules: Schedule) -> list[str]:
    seen = {a.kind for schedule in schedules for row in schedule.actions for a in row}
    return [k for k in KINDS if k in seen]


def _chunk_of(action: Action, chunk_of: list[int]) -> int:
    """The chunk an action's box is shaded as: its stage's, or its first part's; a vocabulary shard's, the first."""
    if not action.parts and KINDS[action.kind].shard:
        return 0
    return chunk_of[(action.parts[0] if action.parts else action).stage]


def _box_label(action: Action, seq_chunks: int = 1) -> str:
    """What a box shows: the microbatch (with sequence chunks, ``microbatch.chunk`` where asked), or the kind of a
    whole-stage action."""
    def unit(m: int) -> str:
        return f"{m // seq_chunks}.{m % seq_chunks}" if seq_chunks > 1 else str(m)

    if action.parts:
        return "+".join(unit(p.microbatch) for p in action.parts)
    return unit(action.microbatch) if action.microbatch >= 0 else action.kind


def _title(result: SimResult) -> str:
    s = result.schedule
    chunks = f" x {s.seq_chunks} chunks" if s.seq_chunks > 1 else ""
    return (f"{ScheduleRef.of(s)}  p={s.devices} m={s.data_microbatches}{chunks}  "
            f"makespan {result.makespan:.4g}  bubble {result.bubble_ratio:.1%}")


# --------------------------------------------------------------------------- ASCII timeline


@dataclass(frozen=True)
class _Scale:
    columns: int
    """Columns the makespan spans."""
    per_col: float
    """Time units per column."""
    aligned: bool
    """Every action boundary falls on a column boundary."""


def _quantum(result: SimResult) -> Fraction | None:
    """Largest time step that every start and end is a multiple of, or None if there is no small one."""
    q = Fraction(0)
    for row in result.timeline:
        for iv in row:
            for t in (iv.start, iv.end):
                f = Fraction(t).limit_denominator(1000)
                if abs(float(f) - t) > _EPS:
                    return None
                q = Fraction(math.gcd(q.numerator * f.denominator, f.numerator * q.denominator),
                             q.denominator * f.denominator)
    return q or None


def _scale(result: SimResult, available: int) -> _Scale:
    """Columns for the makespan: an integer number per time quantum if that fits, else downsampled."""
    span = result.makespan
    if span <= 0 or available <= 0:
        return _Scale(0, 1.0, True)
    q = _quantum(result)
    if q is not None:
        quanta = round(Fraction(span).limit_denominator(1000) / q)
        per_quantum = available // quanta if quanta else 0
        if per_quantum >= 1:
            return _Scale(quanta * per_quantum, float(q) / per_quantum, True)
    return _Scale(available, span / available, False)


def _owners(row: Sequence[Interval], scale: _Scale) -> list[int | None]:
    """Per column, the index of the action covering most of its time slice, or None where idle wins."""
    dt, n = scale.per_col, scale.columns
    best = [0.0] * n
    busy = [0.0] * n
    owner: list[int | None] = [None] * n
    for i, iv in enumerate(row):
        lo = max(0, math.floor(iv.start / dt + _EPS))
        hi = min(n, math.ceil(iv.end / dt - _EPS))
        for c in range(lo, hi):
            overlap = min(iv.end, (c + 1) * dt) - max(iv.start, c * dt)
            busy[c] += overlap
            if overlap > best[c]:
                best[c], owner[c] = overlap, i
    return [o if o is not None and best[c] + _EPS >= dt - busy[c] else None for c, o in enumerate(owner)]


def _runs(owners: list[int | None]) -> Iterator[tuple[int | None, int]]:
    """Consecutive equal owners as (owner, length)."""
    start = 0
    for c in range(1, len(owners) + 1):
        if c == len(owners) or owners[c] != owners[start]:
            yield owners[start], c - start
            start = c


def _fit(label: str, cells: int) -> str:
    """A box's label (a microbatch number) centred in ``cells``; its last characters if it does not fit."""
    digits = label
    return digits.center(cells) if len(digits) <= cells else digits[-cells:]


def _style(kind: str, chunk: int, chunks: int) -> Style:
    bg = _box_color(kind, chunk, chunks)
    return Style(color=_ink(bg), bgcolor=bg)


def _device_row(result: SimResult, device: int, scale: _Scale, chunk_of: list[int], color: bool) -> Text:
    row = result.timeline[device]
    chunks = _chunk_count(result.schedule)
    text = Text()
    for owner, length in _runs(_owners(row, scale)):
        if owner is None:
            text.append(_IDLE * length, style="dim" if color else "")
            continue
        a = row[owner].action
        text.append(_fit(_box_label(a), length), style=_style(a.kind, _chunk_of(a, chunk_of), chunks) if color else "")
    return text


def _scale_note(scale: _Scale) -> str:
    if scale.columns == 0:
        return "empty timeline"
    eq = "=" if scale.aligned else "≈"
    return f"1 col {eq} {scale.per_col:.3g} time units"


def _legend(schedule: Schedule, scale: _Scale, width: int, color: bool) -> Text:
    """One line: a swatch per kind, the chunk shades, the time scale; shortened until it fits ``width``."""
    kinds = _kinds_present(schedule)
    chunks = _chunk_count(schedule)
    for verbose in (True, False):
        text = Text()
        for kind in kinds:
            text.append(f" {kind} ", style=_style(kind, 0, 1) if color else "")
            text.append(f" {KINDS[kind].label}   " if verbose else " ")
        if chunks > 1:
            text.append("chunks " if verbose else "ch ")
            for c in range(chunks):
                text.append(f" {c} ", style=_style(kinds[0], c, chunks) if color else "")
            text.append(" (later = lighter)   " if verbose else "  ")
        text.append(_scale_note(scale))
        if len(text) <= width:
            return text
    text.truncate(width)
    return text


def ascii_timeline(result: SimResult, width: int = 100, color: bool = True) -> Text:
    """A terminal timeline of ``result`` at most ``width`` columns wide: one row per device, then a legend.

    Each action's cells show its microbatch number on the kind's colour; idle
    time is a dim ``·``. When every action boundary lies on a multiple of a
    time step that fits, each step gets the same whole number of columns so
    boxes line up; otherwise each column shows the action that fills most of
    its time slice. ``color=False`` gives the same characters without styles.
    """
    schedule = result.schedule
    label_w = len(f"dev {schedule.devices - 1} ")
    if width < label_w + 1:
        raise ConfigError(f"width must leave room for the device labels: at least {label_w + 1} (got {width})")
    scale = _scale(result, width - label_w)
    chunk_of = _chunk_table(schedule)
    lines = []
    for d in range(schedule.devices):
        line = Text()
        line.append(f"dev {d}".ljust(label_w), style="bold" if color else "")
        line.append_text(_device_row(result, d, scale, chunk_of, color))
        lines.append(line)
    lines.append(_legend(schedule, scale, width, color))
    return Text("\n").join(lines)


# --------------------------------------------------------------------------- matplotlib figure

_ROW_HEIGHT = 0.82  # of one device row in the Gantt; the rest is the gap between rows
_IDLE_FILL = "#eeeeee"


def _box_verts(iv: Interval, y: float) -> list[tuple[float, float]]:
    lo, hi = y - _ROW_HEIGHT / 2, y + _ROW_HEIGHT / 2
    return [(iv.start, lo), (iv.start, hi), (iv.end, hi), (iv.end, lo)]


def _axes_points(ax: Axes) -> tuple[float, float]:
    """Width and height of ``ax`` in points, as laid out now (a later layout pass may shrink it a little)."""
    box = ax.get_window_extent()  # display pixels
    fig = ax.get_figure(root=True)
    dpi = fig.dpi if fig is not None else 72.0
    return box.width * 72 / dpi, box.height * 72 / dpi


def _label_boxes(ax: Axes, result: SimResult, chunk_of: list[int], chunks: int) -> None:
    """Write microbatch numbers into the boxes wide enough to hold them."""
    span = result.makespan
    w_pt, h_pt = _axes_points(ax)
    row_pt = h_pt / result.schedule.devices * _ROW_HEIGHT
    size = min(8.0, row_pt * 0.55)
    if size < 4.5 or span <= 0:
        return
    pt_per_unit = 0.85 * w_pt / span  # 0.85: room for the layout pass that adds legends and labels
    for d, row in enumerate(result.timeline):
        for iv in row:
            if not KINDS[iv.action.kind].computes:
                continue  # drawn as a thin bar beside the compute: no room for a label
            label = _box_label(iv.action, result.schedule.seq_chunks)
            if (iv.end - iv.start) * pt_per_unit < len(label) * size * 0.62 + 2:
                continue
            ink = _ink(_box_color(iv.action.kind, _chunk_of(iv.action, chunk_of), chunks))
            ax.text((iv.start + iv.end) / 2, d, label, ha="center", va="center", fontsize=size, color=ink,
                    clip_on=True)


def draw_gantt(ax: Axes, result: SimResult, *, label_devices: bool = True) -> None:
    """Draw ``result`` as a Gantt chart on ``ax``: one row per device (device 0 on top), one box per action."""
    from matplotlib.collections import PolyCollection

    schedule = result.schedule
    span = max(result.makespan, _EPS)
    chunk_of = _chunk_table(schedule)
    chunks = _chunk_count(schedule)
    verts, colors = [], []
    for d, row in enumerate(result.timeline):
        for iv in row:
            if not KINDS[iv.action.kind].computes:
                # Communication beside the compute (an all-reduce): a thin bar in the lower third of the row,
                # at least a sliver wide, so that a free or quick one still shows where it starts.
                lo = d + _ROW_HEIGHT / 2
                end = max(iv.end, iv.start + span * 0.004)
                verts.append([(iv.start, lo - _ROW_HEIGHT / 3), (iv.start, lo), (end, lo), (end, lo - _ROW_HEIGHT / 3)])
            else:
                verts.append(_box_verts(iv, d))
            colors.append(_box_color(iv.action.kind, _chunk_of(iv.action, chunk_of), chunks))
    background = [[(0, d - _ROW_HEIGHT / 2), (0, d + _ROW_HEIGHT / 2), (span, d + _ROW_HEIGHT / 2),
                   (span, d - _ROW_HEIGHT / 2)] for d in range(schedule.devices)]
    ax.add_collection(PolyCollection(background, facecolors=_IDLE_FILL, edgecolors="none", zorder=1))
    # White edges separate neighbouring boxes; thinner when boxes are narrow so colour still shows.
    w_pt, _ = _axes_points(ax)
    shortest = min((iv.end - iv.start for row in result.timeline for iv in row if iv.end > iv.start), default=span)
    edge = min(0.8, max(0.15, 0.12 * shortest * w_pt / span))
    ax.add_collection(PolyCollection(verts, facecolors=colors, edgecolors="white", linewidths=edge, zorder=2))
    _label_boxes(ax, result, chunk_of, chunks)
    ax.set_xlim(0, span)
    ax.set_ylim(schedule.devices - 0.5, -0.5)
    ax.set_yticks(range(schedule.devices))
    ax.set_yticklabels([f"dev {d}" for d in range(schedule.devices)] if label_devices else [])
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("time")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def draw_memory(ax: Axes, result: SimResult) -> None:
    """Draw each device's activation memory over time on ``ax`` as a step curve labelled ``dev <d>``."""
    from matplotlib import colormaps

    devices = result.schedule.devices
    span = result.makespan
    cmap = colormaps["viridis"]
    for d, curve in enumerate(result.memory_curve):
        times = [t for t, _ in curve] + [span]
        levels = [m for _, m in curve] + [curve[-1][1]]
        frac = d / (devices - 1) if devices > 1 else 0.0
        # Devices often share a level for long stretches; later lines are thinner and drawn on top,
        # so a shared stretch shows every device's colour as a band.
        ax.step(times, levels, where="post", color=cmap(0.85 * frac), linewidth=2.4 - 1.2 * frac,
                label=f"dev {d}  (peak {result.peak_memory[d]:.3g})")
    ax.set_xlim(0, max(span, _EPS))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time")
    ax.set_ylabel("activation memory (M)")
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _gantt_legend(ax: Axes, schedule: Schedule, *others: Schedule) -> None:
    """The legend of ``schedule``'s kinds (and those of ``others`` drawn beside it) above ``ax``."""
    from matplotlib.patches import Patch

    chunks = _chunk_count(schedule)
    kinds = _kinds_present(schedule, *others)
    handles = []
    for c in range(chunks):
        for kind in kinds:
            label = f"{kind} {KINDS[kind].label}" + (f", chunk {c}" if chunks > 1 else "")
            handles.append(Patch(facecolor=_box_color(kind, c, chunks), edgecolor="none", label=label))
    per_row = len(handles) if len(handles) <= 6 else len(kinds)
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=per_row, frameon=False,
              fontsize=8, handlelength=1.4, columnspacing=1.4, borderaxespad=0.3)


def plot_timeline(result: SimResult, path: str, *, title: str | None = None) -> None:
    """Save a Gantt chart of ``result`` above its per-device memory curves as a ``.png`` or ``.svg`` file."""
    from matplotlib.figure import Figure  # a bare Figure needs no GUI backend and leaves pyplot's state alone

    check_figure_path(path, "a timeline")
    devices = result.schedule.devices
    gantt_h = 0.6 + 0.34 * devices
    memory_h = 2.4 + (0.08 * devices if devices > 8 else 0.0)
    fig = Figure(figsize=(12, gantt_h + memory_h + 0.9), layout="constrained")
    gantt, memory = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [gantt_h, memory_h]})
    draw_gantt(gantt, result)
    draw_memory(memory, result)
    gantt.set_xlabel("")
    gantt.tick_params(axis="x", bottom=False, labelbottom=False)
    gantt.spines["bottom"].set_visible(False)
    _gantt_legend(gantt, result.schedule)
    memory.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=7.5,
                  ncol=1 if devices <= 10 else 2, borderaxespad=0.0)
    fig.suptitle(_title(result) if title is None else title, fontsize=11, x=0.01, ha="left")
    save_figure(fig, path)
    fig.clear()  # drop the artists now; a bare Figure is not in pyplot's registry, so there is nothing to close


# --------------------------------------------------------------------------- Chrome trace


def chrome_trace(result: SimResult, *, us_per_unit: float = 1000.0) -> dict[str, Any]:
    """``result`` as Chrome trace-event JSON (for Perfetto or chrome://tracing): one thread per device.

    Each action is a complete event named by its text form (``0F3``) with its
    category the kind; each device's activation memory is a counter track.
    Times are the simulator's units times ``us_per_unit`` microseconds.
    """
    if not (math.isfinite(us_per_unit) and us_per_unit > 0):
        raise ConfigError(f"us_per_unit must be a positive number of microseconds (got {us_per_unit!r})")
    schedule = result.schedule
    chunk_of = _chunk_table(schedule)
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": f"pipefold simulate {schedule.name}"}},
    ]
    for d in range(schedule.devices):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": d, "args": {"name": f"device {d}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": d, "args": {"sort_index": d}})
    for d, row in enumerate(result.timeline):
        for iv in row:
            a = iv.action
            events.append({
                "name": str(a), "cat": a.kind, "ph": "X", "pid": 0, "tid": d,
                "ts": iv.start * us_per_unit, "dur": (iv.end - iv.start) * us_per_unit,
                "args": {"stage": a.stage, "microbatch": a.microbatch, "chunk": _chunk_of(a, chunk_of)},
            })
    for d, curve in enumerate(result.memory_curve):
        for t, level in curve:
            events.append({"name": f"memory dev {d}", "ph": "C", "pid": 0, "ts": t * us_per_unit,
                           "args": {"M": level}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimResult, path: str, *, us_per_unit: float = 1000.0) -> None:
    """Write :func:`chrome_trace` of ``result`` to ``path`` as JSON."""
    write_json(path, chrome_trace(result, us_per_unit=us_per_unit))


def plot_run(measured: SimResult, predicted: SimResult, path: str, *, titles: tuple[str, str]) -> None:
    """Save a measured run above the simulator's prediction of it, and both memory curves on one axis.

    ``measured`` and ``predicted`` are in the same units (seconds and bytes): the prediction comes from
    the run's own measured costs (:func:`pipefold.runtime.measure.timeline.measured_costs`). The memory panel
    draws each device's measured curve solid and its predicted one dashed, in the same colour.
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    check_figure_path(path, "a timeline")
    devices = measured.schedule.devices
    h = 0.9 + 0.34 * devices
    fig = Figure(figsize=(12, 2 * h + 3.4), layout="constrained")
    axes = fig.subplots(3, 1, height_ratios=[h, h, 2.8])
    for ax, result, title, pad in zip(axes[:2], (measured, predicted), titles, (30, 6), strict=True):
        draw_gantt(ax, result)
        ax.set_title(title, fontsize=10, loc="left", pad=pad)
        ax.set_xlabel("seconds")
    _gantt_legend(axes[0], measured.schedule)
    ax = axes[2]
    cmap = colormaps["viridis"]
    for d in range(devices):
        color = cmap(0.85 * d / (devices - 1) if devices > 1 else 0.0)
        for result, style, what in ((measured, "-", "measured"), (predicted, "--", "predicted")):
            curve = result.memory_curve[d]
            times = [t for t, _ in curve] + [result.makespan]
            levels = [m / 2**20 for _, m in curve] + [curve[-1][1] / 2**20]
            ax.step(times, levels, where="post", color=color, linestyle=style, linewidth=1.6,
                    label=f"dev {d} {what} (peak {result.peak_memory[d] / 2**20:.1f} MiB)")
    ax.set_xlim(0, max(measured.makespan, predicted.makespan, _EPS))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds")
    ax.set_ylabel("held (MiB)")
    ax.set_title("memory each device holds: measured (solid) and predicted (dashed), each on its own run's clock",
                 fontsize=10, loc="left")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    save_figure(fig, path)
    fig.clear()


def plot_cycle(base: SimResult, steps: Sequence[SimResult], path: str, *, title: str | None = None) -> None:
    """Save the plain step above each step of a cycle that runs more work in its bubbles (K-FAC's,
    :func:`pipefold.plan.pipefisher.fill`), on one time axis, each titled with its step time and utilization."""
    from matplotlib.figure import Figure

    check_figure_path(path, "a cycle of timelines")
    devices = base.schedule.devices
    results = [base, *steps]
    h = 0.9 + 0.34 * devices
    fig = Figure(figsize=(12, h * len(results) + 0.8), layout="constrained")
    axes = fig.subplots(len(results), 1, squeeze=False)[:, 0]
    span = max(r.makespan for r in results)
    for i, (ax, result) in enumerate(zip(axes, results, strict=True)):
        draw_gantt(ax, result)
        ax.set_xlim(0, span)
        what = "plain step" if i == 0 else f"step {i} of the cycle"
        ax.set_title(f"{what}: {result.makespan:.4g} long, utilization {1 - result.bubble_ratio:.1%}", fontsize=10,
                     loc="left", pad=30 if i == 0 else 6)
    _gantt_legend(axes[0], base.schedule, *(r.schedule for r in steps))
    if title:
        fig.suptitle(title, fontsize=11)
    save_figure(fig, path)
    fig.clear()


def plot_adaptive(per_step: Sequence[Mapping[str, Any]], decisions: Sequence[Mapping[str, Any]],
                  network: Network | None, path: str, *, offset: float = 0.0, title: str | None = None) -> None:
    """Save a run on a changing network as a ``.png`` or ``.svg`` file: three panels over the run's time.

    Top: the slowest link's bandwidth, as the network profile sets it (``network``, whose timeline starts
    ``offset`` seconds before the first step) and as the ranks observed it at each choice of k (plotted
    over the steps it was measured on). Middle: the k each step ran. Bottom: each step's measured time
    (bars, over the time it ran) and what the policy predicted for it (dots).
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    check_figure_path(path, "a run plot")
    fig = Figure(figsize=(10, 7), layout="constrained")
    ax_bw, ax_k, ax_t = fig.subplots(3, 1, sharex=True, height_ratios=(1.2, 0.7, 1.2))
    starts = [row["started_s"] for row in per_step]
    ends = [row["started_s"] + row["measured_s"] for row in per_step]
    span = max(ends, default=1.0)
    if network is not None:
        links = sorted({link for link in network.links} | {(0, 1)})
        grid = [span * i / 2000 for i in range(2001)]
        slowest = [min(network.at(a, b, t + offset).bandwidth for a, b in links) for t in grid]
        ax_bw.step(grid, [b / 1e6 for b in slowest], where="post", color="#4477aa", linewidth=1.4,
                   label="profile (slowest link)")
    by_step = {row["step"]: row for row in per_step}
    window_start = per_step[0]["step"] if per_step else 1  # steps numbered from 1
    for d in decisions:
        # Observed over the steps since the choice before: drawn over them.
        first, last = by_step.get(window_start), by_step.get(int(d["from_step"]) - 1)
        window_start = int(d["from_step"])
        if not d["bandwidth"] or first is None or last is None:
            continue
        ax_bw.hlines(min(d["bandwidth"].values()) / 1e6, first["started_s"], last["started_s"] + last["measured_s"],
                     color="#ee6677", linewidth=2.5)
    ax_bw.plot([], [], color="#ee6677", linewidth=2.5, label="observed by the ranks (slowest link)")
    ax_bw.set_yscale("log")
    lo, hi = ax_bw.get_ylim()
    ax_bw.set_yticks([v for e in range(-3, 7) for v in (10.0 ** e, 2 * 10.0 ** e, 4 * 10.0 ** e, 6 * 10.0 ** e)
                      if lo <= v <= hi])
    ax_bw.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_bw.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax_bw.set_ylabel("bandwidth (MB/s)")
    ax_bw.legend(loc="lower right", frameon=False, fontsize=8)
    ks = [int(ScheduleRef.parse(row["schedule"]).option("k", 1)) for row in per_step]
    ax_k.step(starts + ends[-1:], ks + ks[-1:], where="post", color="#228833", linewidth=1.6)
    ax_k.set_ylabel("k")
    ax_k.set_yticks(sorted(set(ks)))
    # Each bar spans its step, up to the next step's start: the time between steps (choosing k) shows as gaps.
    widths = [min(e, n) - s for s, e, n in zip(starts, ends, [*starts[1:], float("inf")], strict=True)]
    ax_t.bar(starts, [row["measured_s"] for row in per_step], width=widths, align="edge", color="#bbbbbb",
             edgecolor="white", linewidth=0.5)
    pred = [(s + (e - s) / 2, row["predicted_s"]) for s, e, row in zip(starts, ends, per_step, strict=True)
            if row["predicted_s"] is not None]
    if pred:
        ax_t.scatter(*zip(*pred, strict=True), s=18, color="#aa3377", zorder=3, label="predicted")
    ax_t.set_ylabel("step time (s)")
    ax_t.set_xlabel("seconds from the first step")
    handles, labels = ax_t.get_legend_handles_labels()
    ax_t.legend([Patch(color="#bbbbbb"), *handles], ["measured (slowest rank)", *labels], loc="lower left",
                frameon=True, framealpha=0.9, edgecolor="none", fontsize=8)
    for ax in (ax_bw, ax_k, ax_t):
        ax.grid(color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    save_figure(fig, path)

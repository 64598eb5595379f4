"""Terminal timeline, Gantt/memory figure and Chrome trace of simulated schedules."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import matplotlib
import pytest
from matplotlib.figure import Figure
from rich.console import Console

from pipefold import ConfigError, CostModel, SimResult, build, simulate
from pipefold.sim.render import (
    ascii_timeline,
    chrome_trace,
    draw_gantt,
    draw_memory,
    plot_timeline,
    write_chrome_trace,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CASES = [("1f1b", 4, 8, {}), ("zb-h1", 4, 8, {}), ("interleaved-1f1b", 4, 8, {"v": 2}), ("gpipe", 3, 5, {}),
         ("zb-h2", 6, 12, {}), ("interleaved-1f1b", 16, 64, {"v": 2})]


def _sim(name: str, p: int, m: int, cost: CostModel | None = None, **options: int) -> SimResult:
    return simulate(build(name, p, m, **options), cost)


def _rows(result: SimResult, width: int = 100) -> tuple[list[str], str]:
    """Device rows without their labels, and the legend line, of the plain timeline."""
    lines = ascii_timeline(result, width=width, color=False).plain.split("\n")
    label_w = len(f"dev {result.schedule.devices - 1} ")
    return [line[label_w:] for line in lines[:-1]], lines[-1]


def _render(text: object) -> str:
    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system="truecolor", width=400).print(text)
    return out.getvalue()


# --------------------------------------------------------------------------- ASCII timeline


@pytest.mark.parametrize("width", [30, 60, 100, 160])
@pytest.mark.parametrize(("name", "p", "m", "options"), CASES)
def test_ascii_has_one_row_per_device_within_width(name: str, p: int, m: int, options: dict[str, int],
                                                   width: int) -> None:
    result = _sim(name, p, m, **options)
    lines = ascii_timeline(result, width=width, color=False).plain.split("\n")
    assert len(lines) == p + 1  # one row per device, then the legend
    for d in range(p):
        assert lines[d].startswith(f"dev {d} ")
    assert all(len(line) <= width for line in lines), [len(line) for line in lines]


def test_ascii_rows_show_every_microbatch() -> None:
    rows, _ = _rows(_sim("zb-h1", 4, 8))
    for row in rows:
        assert set("01234567") <= set(row)


def test_plain_timeline_has_no_ansi_and_the_same_characters() -> None:
    result = _sim("zb-h1", 4, 8)
    plain, coloured = ascii_timeline(result, color=False), ascii_timeline(result)
    assert plain.plain == coloured.plain
    assert "\x1b[" not in _render(plain)
    assert "\x1b[" in _render(coloured)


def test_busy_cells_are_busy_time_times_columns_per_unit() -> None:
    result = _sim("1f1b", 4, 8)  # makespan 33 in 94 columns: 2 per time unit
    rows, legend = _rows(result)
    assert "1 col = 0.5 time units" in legend
    cols_per_unit = 2
    for row, busy in zip(rows, result.busy, strict=True):
        assert len(row) == result.makespan * cols_per_unit
        assert len(row) - row.count("·") == busy * cols_per_unit


def test_boxes_start_where_their_actions_start() -> None:
    result = _sim("zb-h1", 4, 8)  # makespan 27 in 94 columns: 3 per time unit
    rows, _ = _rows(result)
    for row, timeline in zip(rows, result.timeline, strict=True):
        for iv in timeline:
            cells = row[int(iv.start * 3):int(iv.end * 3)]
            assert cells.strip() == str(iv.action.microbatch)


def test_downsampled_timeline_fills_the_width_and_keeps_busy_time() -> None:
    # A latency of 0.37 puts starts on a 0.01 grid: too fine for 94 columns, so columns are downsampled.
    result = _sim("1f1b", 4, 8, CostModel(latency=0.37))
    rows, legend = _rows(result)
    assert "1 col ≈" in legend
    per_col = result.makespan / 94
    for row, busy in zip(rows, result.busy, strict=True):
        assert len(row) == 94
        busy_cells = len(row) - row.count("·")
        assert abs(busy_cells - busy / per_col) <= 8  # each idle gap can move its edges by a column


def test_kinds_and_chunks_get_distinct_background_colours() -> None:
    def backgrounds(result: SimResult) -> set[str]:
        text = ascii_timeline(result)
        return {str(span.style.bgcolor.triplet) for span in text.spans
                if not isinstance(span.style, str) and span.style.bgcolor is not None}

    assert len(backgrounds(_sim("zb-h1", 4, 8))) == 3  # F, B, W
    assert len(backgrounds(_sim("1f1b", 4, 8))) == 2  # F, BW
    assert len(backgrounds(_sim("interleaved-1f1b", 4, 8, v=2))) == 4  # F, BW in two chunk shades each


def test_too_narrow_width_is_refused() -> None:
    with pytest.raises(ConfigError, match="width"):
        ascii_timeline(_sim("1f1b", 4, 8), width=5)


# --------------------------------------------------------------------------- figure


def test_plot_timeline_writes_png(tmp_path: Path) -> None:
    path = tmp_path / "zb.png"
    plot_timeline(_sim("zb-h1", 4, 8), str(path))
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plot_timeline_writes_svg_with_default_title(tmp_path: Path) -> None:
    path = tmp_path / "il.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # keep text as text so the title can be read back
        plot_timeline(_sim("interleaved-1f1b", 4, 8, v=2), str(path))
    svg = path.read_text()
    assert "<svg" in svg
    assert "interleaved-1f1b:v=2  p=4 m=8  makespan 28.5  bubble 15.8%" in svg
    assert "activation memory (M)" in svg


def test_plot_timeline_uses_a_given_title(tmp_path: Path) -> None:
    path = tmp_path / "t.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        plot_timeline(_sim("1f1b", 2, 2), str(path), title="my run")
    assert "my run" in path.read_text()


@pytest.mark.parametrize("name", ["timeline.pdf", "timeline", "timeline.png.txt"])
def test_plot_timeline_refuses_other_suffixes(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    with pytest.raises(ConfigError, match=r"\.png or \.svg"):
        plot_timeline(_sim("1f1b", 2, 2), str(path))
    assert not path.exists()


def test_building_blocks_draw_one_box_per_action_and_one_curve_per_device() -> None:
    result = _sim("zb-h1", 4, 8)
    fig = Figure()
    gantt, memory = fig.subplots(2, 1, sharex=True)
    draw_gantt(gantt, result, label_devices=False)
    draw_memory(memory, result)
    box_counts = [len(c.get_paths()) for c in gantt.collections]
    assert result.schedule.num_actions in box_counts
    assert [t.get_text() for t in gantt.get_yticklabels()] == ["", "", "", ""]
    assert gantt.get_ylim()[0] > gantt.get_ylim()[1]  # device 0 on top
    labels = [line.get_label() for line in memory.get_lines()]
    assert [label.split("  ")[0] for label in labels] == ["dev 0", "dev 1", "dev 2", "dev 3"]
    assert memory.get_ylabel() == "activation memory (M)"


def test_large_schedule_plots(tmp_path: Path) -> None:
    result = _sim("interleaved-1f1b", 16, 64, v=2)
    path = tmp_path / "big.png"
    plot_timeline(result, str(path))
    assert path.read_bytes().startswith(PNG_MAGIC)


# --------------------------------------------------------------------------- Chrome trace


@pytest.mark.parametrize("us_per_unit", [1000.0, 2.5])
def test_chrome_trace_has_one_complete_event_per_action(us_per_unit: float) -> None:
    result = _sim("interleaved-1f1b", 4, 8, v=2)
    events = chrome_trace(result, us_per_unit=us_per_unit)["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == result.schedule.num_actions
    by_key = {(e["tid"], e["name"]): e for e in complete}
    for d, row in enumerate(result.timeline):
        for iv in row:
            e = by_key[(d, str(iv.action))]
            assert e["ts"] == pytest.approx(iv.start * us_per_unit)
            assert e["dur"] == pytest.approx((iv.end - iv.start) * us_per_unit)
            assert e["cat"] == iv.action.kind and e["pid"] == 0
            assert e["args"] == {"stage": iv.action.stage, "microbatch": iv.action.microbatch,
                                 "chunk": result.schedule.chunk_of(iv.action.stage)}


def test_chrome_trace_names_process_and_threads_and_counts_memory() -> None:
    result = _sim("zb-h1", 4, 8)
    trace = chrome_trace(result)
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    process = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert process == [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "pipefold simulate zb-h1"}}]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {d: f"device {d}" for d in range(4)}
    for d, curve in enumerate(result.memory_curve):
        counter = [e for e in events if e["ph"] == "C" and e["name"] == f"memory dev {d}"]
        assert [(e["ts"], e["args"]["M"]) for e in counter] == [(t * 1000.0, m) for t, m in curve]
    assert json.loads(json.dumps(trace)) == trace


def test_write_chrome_trace_round_trips(tmp_path: Path) -> None:
    result = _sim("1f1b", 3, 4)
    path = tmp_path / "trace.json"
    write_chrome_trace(result, str(path), us_per_unit=10.0)
    assert json.loads(path.read_text()) == chrome_trace(result, us_per_unit=10.0)


def test_chrome_trace_refuses_non_positive_scale() -> None:
    with pytest.raises(ConfigError, match="us_per_unit"):
        chrome_trace(_sim("1f1b", 2, 2), us_per_unit=0)


def test_render_does_not_import_the_cli() -> None:
    source = Path(__file__).parents[1].joinpath("src", "pipefold", "sim", "render.py").read_text()
    assert not re.search(r"^\s*(from|import)\s+pipefold\.cli", source, re.MULTILINE)

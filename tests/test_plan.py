"""The memory-budget planner, checked against a brute force over every registered schedule."""

from __future__ import annotations

import functools
import itertools
import json
import random

import pytest

from pipefold import ConfigError, CostModel, Schedule, ScheduleError, SimResult, build, schedules, simulate
from pipefold.cli.main import main
from pipefold.plan.budget import (
    Point,
    candidates,
    choose,
    evaluate,
    frontier,
    one_f_one_b_peak,
    parse_budget,
    plan,
)
from pipefold.schedules import Option, ScheduleSpec
from pipefold.schedules.kfkb import kfkb

SHAPES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
COSTS = {"unit": CostModel(), "skewed": CostModel(f=1, b=2, w=0.5, latency=0.5, memory_w=0.5)}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BUILTIN = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "kfkb", "zb-h1", "zb-h2")


@pytest.fixture
def builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first seven families: the literal answers below were worked out for them, not for later ones."""
    monkeypatch.setattr(schedules, "REGISTRY", {name: schedules.REGISTRY[name] for name in BUILTIN})


# --------------------------------------------------------------------------- the brute-force reference


@functools.cache
def _reference(p: int, m: int, cost_name: str) -> tuple[tuple[str, SimResult], ...]:
    """Every registered family times its search space, built and simulated directly; those that fail left out."""
    cost = COSTS[cost_name]
    out = []
    for spec in schedules.REGISTRY.values():
        if m < spec.min_microbatches(p):
            continue
        names = [o.name for o in spec.options]
        for values in itertools.product(*[tuple(o.search(p, m)) or (o.default,) for o in spec.options]):
            try:
                out.append((spec.name, simulate(build(spec.name, p, m, **dict(zip(names, values, strict=True))), cost)))
            except (ConfigError, ScheduleError):
                continue
    return tuple(out)


def _reference_best(p: int, m: int, cost_name: str, budget: float) -> float | None:
    """The smallest makespan of any schedule within ``budget``, or None if none fits."""
    fits = [r.makespan for _, r in _reference(p, m, cost_name) if max(r.peak_memory) <= budget + 1e-9]
    return min(fits, default=None)


@functools.cache
def _points(p: int, m: int, cost_name: str) -> tuple[Point, ...]:
    return tuple(evaluate(p, m, COSTS[cost_name]))


def _budgets(p: int, m: int, cost_name: str) -> list[float]:
    """1..p, every half M up to the largest peak, and every peak exactly: all the places the answer can change."""
    peaks = {max(r.peak_memory) for _, r in _reference(p, m, cost_name)}
    return sorted({*range(1, p + 1), *(k / 2 for k in range(1, int(2 * max(peaks)) + 3)), *peaks})


# --------------------------------------------------------------------------- candidates


def test_candidates_are_every_family_times_its_search_space() -> None:
    got = [(name, tuple(opts.items())) for name, opts in candidates(4, 8)]
    assert len(got) == len(set(got))
    builtin = {("gpipe", ()), ("1f1b", ()), ("zb-h1", ()), ("zb-h2", ()),
               *((f, (("v", v),)) for f in ("interleaved-1f1b", "looped-bfs") for v in (2, 3, 4)),
               *(("kfkb", (("k", k),)) for k in range(1, 9))}
    assert builtin <= set(got)
    assert {name for name, _ in got} == {s.name for s in schedules.REGISTRY.values() if s.min_microbatches(4) <= 8}


def test_a_newly_registered_family_joins_without_changes(monkeypatch) -> None:
    def toy(devices: int, microbatches: int, a: int = 1, b: int = 3, c: int = 7) -> Schedule:
        if b == 5:
            raise ConfigError("toy cannot take b=5")
        return kfkb(devices, microbatches, k=a)

    options = (Option(name="a", default=1, help="", search=lambda p, m: (1, 2)),
               Option(name="b", default=3, help="", search=lambda p, m: (3, 4, 5)),
               Option(name="c", default=7, help=""))  # no search space: its default
    monkeypatch.setitem(schedules.REGISTRY, "toy", ScheduleSpec(name="toy", build=toy, description="", options=options))
    monkeypatch.setitem(schedules.REGISTRY, "greedy", ScheduleSpec(name="greedy", build=toy, description="",
                                                                   min_microbatches=lambda p: 3 * p))
    toys = [opts for name, opts in candidates(2, 4) if name == "toy"]
    assert toys == [{"a": a, "b": b, "c": 7} for a in (1, 2) for b in (3, 4, 5)]
    assert "greedy" not in {name for name, _ in candidates(2, 4)}  # needs 6 microbatches on 2 devices
    assert "greedy" in {name for name, _ in candidates(2, 6)}
    answer = plan(2, 4, 100.0)
    assert sum(pt.name == "toy" for pt in answer.points) == 4
    assert {s for s in answer.skipped if s.startswith("toy:")} == {"toy:a=1,b=5,c=7", "toy:a=2,b=5,c=7"}


# --------------------------------------------------------------------------- the answer


@pytest.mark.parametrize("cost_name", list(COSTS))
@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_plan_agrees_with_brute_force(p: int, m: int, cost_name: str) -> None:
    cost = COSTS[cost_name]
    points = _points(p, m, cost_name)
    for budget in _budgets(p, m, cost_name):
        want = _reference_best(p, m, cost_name, budget)
        if want is None:
            with pytest.raises(ConfigError, match="no schedule fits"):
                choose(points, budget)
            continue
        best = choose(points, budget)
        assert best.makespan == pytest.approx(want, abs=1e-9)
        # The chosen spec, rebuilt and re-simulated here, is what the point claims and fits the budget.
        again = simulate(build(best.name, p, m, **best.options), cost)
        assert again.makespan == pytest.approx(best.makespan, abs=1e-9)
        assert max(again.peak_memory) <= budget + 1e-9
        # Ties go to less memory: no schedule as fast holds less.
        assert best.memory == pytest.approx(min(max(r.peak_memory) for _, r in _reference(p, m, cost_name)
                                                if abs(r.makespan - want) < 1e-9), abs=1e-9)


@pytest.mark.usefixtures("builtin")
def test_plan_returns_the_simulation_and_frontier_of_the_answer() -> None:
    answer = plan(4, 8, 5, COSTS["unit"])
    assert answer.spec == "interleaved-1f1b:v=4" and answer.options == {"v": 4}
    assert answer.result.makespan == 26.25 and answer.result.schedule.name == "interleaved-1f1b"
    assert answer.budget == 5 and answer.best in answer.frontier
    assert [(pt.memory, pt.makespan, pt.spec) for pt in answer.frontier] == [
        (4, 27, "zb-h1"), (4.75, 26.25, "interleaved-1f1b:v=4")]
    assert len(answer.points) == len(candidates(4, 8)) and answer.skipped == ()


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_a_larger_budget_never_gives_a_larger_makespan(p: int, m: int) -> None:
    points = _points(p, m, "skewed")
    last: float | None = None
    for budget in _budgets(p, m, "skewed"):
        try:
            best = choose(points, budget)
        except ConfigError:
            assert last is None, f"budget {budget} fails after a smaller one fit"
            continue
        assert best.memory <= budget + 1e-9
        assert last is None or best.makespan <= last
        last = best.makespan
    assert last is not None


def test_ties_go_to_less_memory_then_name_whatever_the_order() -> None:
    pts = [Point("zb", {}, 10.0, 0.1, (5.0, 5.0)), Point("b", {"k": 2}, 10.0, 0.1, (5.0, 4.0)),
           Point("b", {"k": 1}, 10.0, 0.1, (3.0, 5.0)), Point("a", {}, 10.0, 0.1, (5.0, 1.0)),
           Point("fast", {}, 9.0, 0.1, (7.0, 7.0))]
    for seed in range(5):
        random.Random(seed).shuffle(pts)
        assert choose(pts, 6).spec == "a"
        assert choose(pts, 7).spec == "fast"
    pts.append(Point("a", {}, 10.0, 0.1, (4.0, 4.0)))
    assert choose(pts, 6).peak_memory == (4.0, 4.0)


def test_too_small_a_budget_names_the_smallest_reachable_peak() -> None:  # over every registered family
    smallest = min(max(r.peak_memory) for _, r in _reference(4, 8, "unit"))
    with pytest.raises(ConfigError) as info:
        plan(4, 8, smallest - 0.5)
    message = str(info.value)
    assert message.startswith(f"no schedule fits {smallest - 0.5:g} M on 4 stages; "
                              f"the smallest reachable peak is {smallest:g} M (")
    assert "\n" not in message
    named = message[message.rindex("(") + 1:-1]
    name, _, opts = named.partition(":")
    options = {k: int(v) for k, v in (kv.split("=") for kv in filter(None, opts.split(",")))}
    assert max(simulate(build(name, 4, 8, **options)).peak_memory) == smallest


# --------------------------------------------------------------------------- frontier, budgets, progress


@pytest.mark.parametrize("cost_name", list(COSTS))
@pytest.mark.parametrize(("p", "m"), [(4, 16), (8, 16)])
def test_frontier_is_sorted_non_dominated_and_covers_every_point(p: int, m: int, cost_name: str) -> None:
    points = _points(p, m, cost_name)
    front = frontier(points)
    assert [pt.memory for pt in front] == sorted({pt.memory for pt in front})  # strictly increasing
    assert all(a.makespan > b.makespan for a, b in itertools.pairwise(front))
    for f in front:
        assert not any(q.memory <= f.memory and q.makespan <= f.makespan and (q.memory, q.makespan) !=
                       (f.memory, f.makespan) for q in points), f"{f.spec} is dominated"
    for q in points:
        assert any(f.memory <= q.memory and f.makespan <= q.makespan for f in front), f"{q.spec} is not covered"


@pytest.mark.usefixtures("builtin")
def test_frontier_under_a_slow_network() -> None:
    # Under a slow network, big groups pay off: the frontier runs from zb-h1 to GPipe through kFkB.
    front = frontier(evaluate(4, 16, CostModel(w=0.2, latency=4)))
    assert [pt.spec for pt in front] == ["zb-h1", "zb-h2", "kfkb:k=2", "kfkb:k=3", "gpipe"]


@pytest.mark.parametrize(("text", "want"), [("3", 3.0), ("3M", 3.0), (" 2.5 ", 2.5), ("0.5x", 4.0), ("1X", 8.0),
                                            ("1.25x", 10.0), (".5", 0.5)])
def test_parse_budget(text: str, want: float) -> None:
    assert parse_budget(text, 8.0) == want


@pytest.mark.parametrize("text", ["", "x", "abc", "-1", "0", "0x", "3y", "3 GB", "1e999", "nan"])
def test_parse_budget_rejects_with_one_line_saying_what_works(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_budget(text, 8.0)
    assert "\n" not in str(info.value) and "0.5x" in str(info.value)


def test_one_f_one_b_peak_is_the_unit_of_x_budgets() -> None:
    assert one_f_one_b_peak(8, 32) == 8
    assert one_f_one_b_peak(8, 3) == 3  # fewer microbatches than stages: all of them
    assert one_f_one_b_peak(4, 8, CostModel(memory=2.5)) == 10


def test_progress_counts_every_candidate() -> None:
    calls: list[tuple[int, int]] = []
    points = evaluate(2, 4, progress=lambda done, total: calls.append((done, total)))
    specs = candidates(2, 4)
    n = len(specs)
    assert calls == [(i, n) for i in range(n + 1)]
    # Candidates this shape cannot take (colliding V blocks) are skipped, the rest all evaluated.
    assert 0 < len(points) <= n and all((pt.name, pt.options) in specs for pt in points)


def test_bad_shapes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="devices must be a positive integer"):
        evaluate(0, 4)
    with pytest.raises(ConfigError, match="microbatches must be a positive integer"):
        plan(4, -1, 4)


# --------------------------------------------------------------------------- command line


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("argv", "spec"), [
    (["-p", "4", "-m", "8", "--memory", "5"], "interleaved-1f1b:v=4"),
    (["-p", "4", "-m", "16", "--memory", "3x", "--w", "0.2", "--latency", "4"], "kfkb:k=3"),
    (["-p", "4", "-m", "8", "--memory", "1x"], "zb-h1"),
    (["-p", "8", "-m", "16", "--memory", "1.5x", "--b", "2", "--latency", "0.5"], None),  # every family
])
def test_plan_json_spec_simulates_to_the_same_makespan(request, capsys, argv: list[str], spec: str | None) -> None:
    if spec is not None:
        request.getfixturevalue("builtin")
    code, out, _ = run(capsys, "plan", *argv, "--json")
    assert code == 0
    data = json.loads(out)  # exactly one object
    assert {"schedule", "options", "makespan", "bubble_ratio", "peak_memory", "budget", "frontier"} <= set(data)
    assert data["schedule"] == (spec or data["schedule"])
    chosen = [row for row in data["frontier"] if row["chosen"]]
    assert len(chosen) == 1 and chosen[0]["schedule"] == data["schedule"] and chosen[0]["makespan"] == data["makespan"]
    assert max(data["peak_memory"]) <= data["budget"]
    shape_and_costs = [a for a in argv if a not in ("--memory", argv[argv.index("--memory") + 1])]
    code, out, _ = run(capsys, "simulate", data["schedule"], *shape_and_costs, "--json")
    assert code == 0
    simulated = json.loads(out)
    assert simulated["makespan"] == data["makespan"] and simulated["peak_memory"] == data["peak_memory"]


@pytest.mark.usefixtures("builtin")
def test_plan_prints_the_answer_then_the_frontier(capsys) -> None:
    code, out, _ = run(capsys, "plan", "-p", "4", "-m", "8", "--memory", "5")
    assert code == 0
    first, *rest = out.splitlines()
    assert first.split()[0] == "interleaved-1f1b:v=4"
    peaks = " ".join(f"{x:g}" for x in simulate(build("interleaved-1f1b", 4, 8, v=4)).peak_memory)
    assert "makespan 26.25" in first and f"peak memory {peaks} M" in first and "budget 5 M" in first
    rows = {line.split("│")[-2].strip(): line for line in rest if line.startswith("│")}
    assert set(rows) == {"zb-h1", "interleaved-1f1b:v=4"}
    assert "▶" in rows["interleaved-1f1b:v=4"] and "▶" not in rows["zb-h1"]


def test_plan_plots_png_and_svg(capsys, tmp_path) -> None:
    png, svg = tmp_path / "f.png", tmp_path / "f.svg"
    code, out, _ = run(capsys, "plan", "-p", "4", "-m", "8", "--memory", "1x", "--plot", str(png))
    assert code == 0 and f"wrote plot: {png}" in out
    assert png.read_bytes()[:8] == PNG_MAGIC
    code, out, _ = run(capsys, "plan", "-p", "4", "-m", "8", "--memory", "6", "--plot", str(svg), "--json")
    assert code == 0 and json.loads(out)["plot"] == str(svg)
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and "budget 6 M" in text


@pytest.mark.parametrize(("argv", "expected"), [
    (["--memory", "lots"], "cannot read memory budget 'lots': use a number of M such as 3"),
    (["--memory", "0"], "memory budget must be a positive amount of M"),
    (["--memory", "0.5x"], "no schedule fits 2 M on 4 stages; the smallest reachable peak is 4 M (zb-h1)"),
    (["--memory", "3", "--f", "-1"], "argument --f: -1 is out of range: give a number >= 0"),
    (["--memory", "4", "--plot", "out.pdf"], "use a file name ending in .png or .svg"),
    (["--memory", "4", "-p", "0"], "--devices/-p: 0 is out of range: give a whole number >= 1 and <= 512"),
    ([], "plan needs --memory BUDGET"),
])
@pytest.mark.usefixtures("builtin")
def test_plan_user_errors_are_one_line(capsys, argv: list[str], expected: str) -> None:
    code, out, err = run_exit(capsys, "plan", "-p", "4", "-m", "8", *argv)
    assert code == 2 and out == ""
    assert expected in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def run_exit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Like :func:`run`, but also for argparse's own exits."""
    try:
        return run(capsys, *argv)
    except SystemExit as exc:
        out, err = capsys.readouterr()
        return int(exc.code or 0), out, err

"""K-FAC's work in the bubbles: the filler against the simulator, closed forms, and the command line."""

from __future__ import annotations

import json

import pytest

from pipefold.errors import ConfigError
from pipefold.ir import KA, KG, KI, KP, Kind, Schedule, validate
from pipefold.plan.pipefisher import KFAC_KINDS, Refill, fill, fit_latency, inline, measured_cost, utilization
from pipefold.schedules import build
from pipefold.sim.simulate import CostModel, StageOverride, simulate

WORK = {"KA": 0.3, "KG": 0.5, "KI": 2.0, "KP": 0.3}
FAMILIES = ["1f1b", "gpipe", "kfkb", "zb-h1", "zb-v", "v-half", "v-min", "interleaved-1f1b", "looped-bfs",
            "dualpipev"]


def _plain(s: Schedule) -> list[list[object]]:
    return [[a for a in row if a.kind not in KFAC_KINDS] for row in s.actions]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("costs", [dict(f=1, b=1, w=1), dict(f=1, b=2, w=0.5), dict(f=0.7, b=1.3, w=1.1)])
def test_filled_steps_leave_every_pass_where_it_was(name: str, costs: dict[str, float]) -> None:
    """Work put in gaps starts when its device would idle and ends before its next pass would start: re-simulated,
    every pass of every step of the cycle keeps its start and end exactly, but in a step that finishes a late
    refresh, which is no longer than with that refresh's inversion and preconditioning last; every stage
    refreshes; the work added is what the busy time grew by."""
    s = build(name, 4, 8)
    cost = CostModel(**costs, work=WORK)
    filled = fill(s, cost)
    base = {iv.action: (iv.start, iv.end) for row in filled.base.timeline for iv in row}
    for r, late in zip(filled.steps, filled.late, strict=True):
        validate(r.schedule)
        assert _plain(r.schedule) == [list(row) for row in s.actions]
        if late:
            last = [[a for a in row if not (a.stage in late and a.kind in (Kind.KI, Kind.KP))]
                    + [a for st in late for a in (KI(st), KP(st)) if s.device_of(st) == d]
                    for d, row in enumerate(r.schedule.actions)]
            assert r.makespan <= simulate(s.with_actions(last), cost).makespan + 1e-9
            continue
        for row in r.timeline:
            for iv in row:
                if iv.action.kind not in KFAC_KINDS:
                    assert (iv.start, iv.end) == pytest.approx(base[iv.action], abs=1e-9), (name, iv)
        stage_cost = [cost.stage_cost(st, s.stages, s.devices) for st in range(s.stages)]
        added = sum(stage_cost[a.stage].work[a.kind] for row in r.schedule.actions for a in row
                    if a.kind in KFAC_KINDS)
        assert sum(r.busy) == pytest.approx(sum(filled.base.busy) + added)
        # Every step preconditions every stage once, after its last weight gradient.
        assert sorted(a.stage for row in r.schedule.actions for a in row if a.kind == Kind.KP) == list(range(s.stages))
    assert all(n >= 1 for n in filled.refreshes)
    # A refresh is M microbatches' curvature of each factor before its inversion, in the order of the cycle, or,
    # for a stage that finished late, what its bubbles held (one microbatch's at least).
    for stage in range(s.stages):
        device = s.device_of(stage)
        seq = [a.kind for r in filled.steps for a in r.schedule.actions[device] if a.stage == stage]
        first = seq.index(Kind.KI)
        late = any(stage in x for x in filled.late)
        least = 1 if late else s.microbatches
        assert seq[:first].count(Kind.KA) >= least and seq[:first].count(Kind.KG) >= least


def test_1f1b_utilization_closed_form() -> None:
    """1F1B, p=4, m=8, F=B=W=1: the plain step is (m+p-1)(f+b+w) = 33 with m(f+b+w) = 24 busy per device
    (72.7%); work that takes no time costs nothing; with work, each step's busy time
    is the plain 96 plus what it placed, over 4 x its step."""
    s = build("1f1b", 4, 8)
    free = fill(s, CostModel(work={}))
    assert utilization(free.base) == pytest.approx(24 / 33)
    assert all(r.makespan == pytest.approx(33) for r in free.steps)
    assert free.utilization == pytest.approx(24 / 33)
    filled = fill(s, CostModel(work=WORK))
    for r in filled.steps:
        placed = sum(WORK[a.kind] for row in r.schedule.actions for a in row if a.kind in KFAC_KINDS)
        assert utilization(r) == pytest.approx((96 + placed) / (4 * r.makespan))
    assert filled.utilization > utilization(filled.base) + 0.08


def test_preconditioning_on_the_critical_device_lengthens_the_step_by_itself() -> None:
    """1F1B's device 0 ends the step with its last backward: no gap follows, so its KP goes last and the step
    grows by exactly KP's time; a slack that makes room keeps it within the slack."""
    s = build("1f1b", 4, 8)
    filled = fill(s, CostModel(work=WORK))
    assert all(r.makespan == pytest.approx(33 + WORK["KP"]) for r in filled.steps)
    roomy = fill(s, CostModel(work=WORK), slack=0.05)
    assert all(r.makespan <= 33 * 1.05 + 1e-9 for r in roomy.steps)
    assert roomy.utilization >= filled.utilization - 1e-9


def test_work_that_no_bubble_holds_finishes_at_the_end() -> None:
    """GPipe's device 0 runs all its backwards last: its G curvature has no gap after its pass, so the stage
    ends its refresh at the end of a step with one microbatch's G curvature, inverts and preconditions there,
    and that step grows by that."""
    s = build("gpipe", 4, 8)
    filled = fill(s, CostModel(f=1, b=1, w=1, work=WORK))
    grown = [(r, late) for r, late in zip(filled.steps, filled.late, strict=True) if 0 in late]
    assert grown, "some step finishes stage 0's refresh at its end"
    r, _ = grown[0]
    assert r.makespan > filled.base.makespan + WORK["KP"] + 1e-9
    row = r.schedule.actions[0]
    tail = [a for a in row[row.index(s.actions[0][-1]) + 1:]]
    # One microbatch's G curvature after its last backward; the inversion where it delays least (here last:
    # GPipe's device 0 has no gap after its first backward), then the preconditioning.
    assert tail == [KG(0, 0), KI(0), KP(0)]


def test_inline_runs_the_work_after_its_passes() -> None:
    s = build("1f1b", 2, 2)
    r = inline(s, CostModel(work=WORK))
    assert len(r.steps) == 1
    row = list(r.steps[0].schedule.actions[1])
    assert row == [s.actions[1][0], KA(1, 0), s.actions[1][1], KG(1, 0), s.actions[1][2], KA(1, 1),
                   s.actions[1][3], KG(1, 1), KI(1), KP(1)]
    # Nothing overlaps a bubble: the step grows by the work of its busiest path, at least device 1's whole share.
    assert r.steps[0].makespan >= r.base.makespan + 2 * (WORK["KA"] + WORK["KG"]) + WORK["KI"] + WORK["KP"]


def test_curvature_kept_past_the_weight_gradient_costs_its_stash() -> None:
    """One device, F0 BW0 F1 BW1 KA0: microbatch 0's layer inputs outlive its BW until KA0 ends. Levels (M=1,
    stash 0.5): 1 from F0, then at t=3 BW0 ends (-1, +0.5 stash) as F1 starts (+1): 1.5 until BW1 ends, 0.5,
    then 0 when KA0 ends: peak 1.5. KA0 before BW0 keeps nothing extra: peak 1."""
    cost = CostModel(work={"KA": 0.25}, stash={"KA": 0.5})
    late = Schedule("late", 1, 1, 2, (0,), [[*build("1f1b", 1, 2).actions[0], KA(0, 0)]])
    result = simulate(late, cost)
    assert result.peak_memory == [pytest.approx(1.5)]
    assert [m for _, m in result.memory_curve[0]] == pytest.approx([1, 1.5, 0.5, 0])
    f0, bw0, f1, bw1 = build("1f1b", 1, 2).actions[0]
    early = Schedule("early", 1, 1, 2, (0,), [[f0, KA(0, 0), bw0, f1, bw1]])
    assert simulate(early, cost).peak_memory == [pytest.approx(1.0)]
    # The same for the output gradients: KG after BW holds them from BW's end.
    g_late = Schedule("g", 1, 1, 2, (0,), [[f0, bw0, f1, bw1, KG(0, 0)]])
    assert simulate(g_late, CostModel(stash={"KG": 0.25})).peak_memory == [pytest.approx(1.25)]


def test_the_ir_orders_kfac_work() -> None:
    s = build("1f1b", 2, 2)
    with pytest.raises(Exception, match="0KA0 comes before 0F0"):
        validate(s.with_actions([[KA(0, 0), *s.actions[0]], s.actions[1]]))
    with pytest.raises(Exception, match="0KI comes before 0KA1"):
        validate(s.with_actions([[*s.actions[0], KA(0, 0), KI(0), KA(0, 1)], s.actions[1]]))
    with pytest.raises(Exception, match="0KP comes before 0KI"):
        validate(s.with_actions([[*s.actions[0], KP(0), KI(0)], s.actions[1]]))
    # Curvature from an earlier step is no action of this one: an inversion alone is valid.
    validate(s.with_actions([[KI(0), *s.actions[0], KP(0)], s.actions[1]]))


def test_bad_input_is_one_line() -> None:
    with pytest.raises(ConfigError, match="replicas"):
        fill(build("chimera", 4, 8), CostModel(work=WORK))
    with pytest.raises(ConfigError, match="already has K-FAC"):
        fill(fill(build("1f1b", 2, 2)).steps[0].schedule)
    with pytest.raises(ConfigError, match="slack"):
        fill(build("1f1b", 2, 2), slack=-1)
    with pytest.raises(ConfigError, match="not registered"):
        CostModel(work={"KZ": 1.0})


def test_cli(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from pipefold.cli.main import main

    plot = Path(str(tmp_path)) / "cycle.png"
    assert main(["pipefisher", "1f1b", "-p", "4", "-m", "8", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert plot.stat().st_size > 10_000
    want = fill(build("1f1b", 4, 8), CostModel(work={"KA": 0.5, "KG": 0.5, "KI": 2, "KP": 0.25}))
    assert out["filled"]["utilization"] == pytest.approx(want.utilization)
    assert out["base"]["utilization"] == pytest.approx(24 / 33)
    assert main(["pipefisher", "1f1b", "--work", "KA=x"]) == 2
    assert "cannot read --work" in capsys.readouterr().err
    # simulate prices K-FAC's work where its schedule runs it (a file with K-FAC's actions), and refuses it elsewhere.
    from pipefold.ir.formats import save
    from pipefold.plan.pipefisher import inline

    filled_file = Path(str(tmp_path)) / "filled.json"
    save(inline(build("1f1b", 2, 2)).cycle[0], filled_file)
    assert main(["simulate", str(filled_file), "--work", "KA=1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost"]["work"] == {"KA": 1.0}
    assert main(["simulate", "1f1b", "-p", "2", "-m", "2", "--work", "KA=1", "--json"]) == 2
    assert "no schedule here runs them" in capsys.readouterr().err


def test_kg_waits_for_the_backward() -> None:
    s = build("1f1b", 2, 2)
    assert [str(a) for a in s.actions[1]][:2] == ["1F0", "1BW0"]
    with pytest.raises(Exception, match="1KG0 comes before 1BW0"):
        validate(s.with_actions([s.actions[0], [s.actions[1][0], KG(1, 0), *s.actions[1][1:]]]))


def test_fit_latency_recovers_the_latency_that_made_the_steps() -> None:
    """Steps "measured" as the simulator times them with a latency of 0.35 per message: the fit finds 0.35 back;
    steps no longer than the latency-free simulation give 0."""
    cost = CostModel(work=WORK)
    filled = fill(build("1f1b", 4, 8), cost)
    ran = [(r.schedule, simulate(r.schedule, CostModel(work=WORK, latency=0.35)).makespan) for r in filled.steps]
    assert fit_latency(cost, ran) == pytest.approx(0.35, rel=1e-4)
    assert fit_latency(cost, [(s, r.makespan * 0.9) for s, r in zip(filled.cycle, filled.steps, strict=True)]) == 0
    assert fit_latency(cost, []) == 0


def test_refill_places_from_the_ranks_times() -> None:
    """Measured times replace the ones the first placement used (stage memory and stash stay); a KP that found no
    inverse yet, timed near 0, counts at least its first timing."""
    s = build("1f1b", 2, 4)
    first = CostModel(stage_overrides={st: StageOverride(f=1, b=1, w=1, memory=2.0, work=WORK, stash={"KA": 0.5})
                                       for st in range(2)})
    refill = Refill(after=3, schedule=s, cost=first)
    times = {0: {"F": 2.0, "BW": 4.0, "KA": 0.1, "KP": 0.0}, 1: {"F": 2.0, "BW": 4.0}}
    cost = measured_cost(first, times)
    assert cost.stage_overrides[0] == StageOverride(f=2.0, b=2.0, w=2.0, bw=4.0, memory=2.0, work={**WORK, "KA": 0.1},
                                                    stash={"KA": 0.5})
    filled = refill.plan(times)
    assert filled.base.makespan == pytest.approx(simulate(s, cost).makespan)
    with pytest.raises(ConfigError, match="refill after 2 steps or more"):
        Refill(after=1, schedule=s, cost=first)


def test_a_one_step_cycle_refreshes_every_stage_in_that_step() -> None:
    """max_steps=1: whatever the bubbles cannot hold, every stage still inverts in the one step (late), after
    at least one microbatch's curvature of each factor, and preconditions after that."""
    s = build("gpipe", 4, 8)
    filled = fill(s, CostModel(work=WORK), max_steps=1)
    assert len(filled.steps) == 1 and filled.refreshes == (1, 1, 1, 1) and filled.late == ((0, 1, 2, 3),)
    for stage in range(4):
        row = [a for a in filled.steps[0].schedule.actions[stage] if a.stage == stage and a.kind in KFAC_KINDS]
        kinds = [a.kind for a in row]
        assert Kind.KA in kinds[:kinds.index(Kind.KI)] and Kind.KG in kinds[:kinds.index(Kind.KI)]
        assert kinds.index(Kind.KI) < kinds.index(Kind.KP)

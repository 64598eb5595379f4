"""Schedules to and from torch.distributed.pipelining: its schedule classes, its CSV, its runtime's loader."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from pipefold import ConfigError, Schedule, ScheduleError, build, names, schedules, simulate, validate
from pipefold.cli.main import main
from pipefold.ir import BW, OPT, B, F, R, W, overlap
from pipefold.ir.interop import from_torch_csv, from_torch_order, to_torch_actions, to_torch_csv
from pipefold.plan.budget import choose, one_f_one_b_peak, parse_budget, plan

torch = pytest.importorskip("torch")
pipelining = pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining.schedules import (  # noqa: E402
    _Action,
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
    _validate_schedule,
)

SHAPES = [(2, 4), (3, 6), (4, 8), (4, 12)]
"""(ranks, microbatches) each torch class is imported at."""


# --------------------------------------------------------------------------- torch's own schedules


def _mock_stage(index: int, num_stages: int, ranks: int) -> SimpleNamespace:
    """What a torch schedule reads of a stage while it builds its pipeline_order (rank 0's view)."""
    return SimpleNamespace(stage_index=index, num_stages=num_stages, group_size=ranks, group_rank=0, submod=None,
                           stage_index_to_group_rank={}, is_first=index == 0, is_last=index == num_stages - 1)


def _torch_order(cls_name: str, p: int, m: int) -> dict[int, list[Any]]:
    """The pipeline_order of one torch schedule class, built over mocked stages of rank 0."""
    cls = getattr(pipelining, cls_name)
    if cls_name in ("Schedule1F1B", "ScheduleGPipe"):  # one stage per rank
        return cls(_mock_stage(0, p, p), n_microbatches=m).pipeline_order
    v_shape = cls_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    second = 2 * p - 1 if v_shape else p  # rank 0's other stage: the bottom of the V, or the next loop
    return cls([_mock_stage(0, 2 * p, p), _mock_stage(second, 2 * p, p)], n_microbatches=m).pipeline_order


MULTI = ["ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
         "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
PLACEMENT = {"ScheduleGPipe": "linear", "ScheduleInterleaved1F1B": "looped", "ScheduleLoopedBFS": "looped",
             "ScheduleInterleavedZeroBubble": "looped", "ScheduleZBVZeroBubble": "v", "ScheduleDualPipeV": "v"}


@pytest.mark.parametrize("p,m", SHAPES)
@pytest.mark.parametrize("cls_name", MULTI)
def test_torch_schedule_classes_import_validate_and_simulate(cls_name: str, p: int, m: int) -> None:
    order = _torch_order(cls_name, p, m)
    schedule = validate(from_torch_order(order, name=cls_name))
    assert (schedule.devices, schedule.microbatches, schedule.placement_name) == (p, m, PLACEMENT[cls_name])
    assert schedule.stages == (p if cls_name == "ScheduleGPipe" else 2 * p)
    assert simulate(schedule).makespan > 0
    # Back to torch: the same compute actions, REDUCE_GRAD and idle steps aside.
    compute = {r: [a for a in row if a is not None and a.is_compute_op] for r, row in order.items()}
    assert to_torch_actions(schedule) == compute


def test_dualpipev_overlaps_become_pipefold_pairs() -> None:
    schedule = from_torch_order(_torch_order("ScheduleDualPipeV", 3, 6))
    pairs = [a for row in schedule.actions for a in row if a.parts]
    assert pairs and all(a.parts[0].kind == "F" and a.parts[1].kind == "BW" for a in pairs)


@pytest.mark.parametrize("p,m", SHAPES)
def test_torch_1f1b_numbers_its_last_rank_from_1(p: int, m: int) -> None:
    order = _torch_order("Schedule1F1B", p, m)
    # The claim, checked on torch itself: the last rank's forwards are 1..m, and torch's validator rejects it.
    last = [a.microbatch_index for a in order[p - 1] if a is not None and a.computation_type.value == "F"]
    assert last == list(range(1, m + 1))
    with pytest.raises(AssertionError, match="without first running Forward"):
        _validate_schedule(order, p, p, m)
    with pytest.raises(ScheduleError) as info:
        from_torch_order(order)
    message = info.value.message
    assert "\n" not in message and f"rank {p - 1}" in message and f"1..{m}" in message
    assert "Schedule1F1B" in message and "renumber=True" in message
    fixed = validate(from_torch_order(order, renumber=True))
    assert fixed.actions == build("1f1b", p, m).actions  # after the shift: pipefold's own 1F1B, action for action


@pytest.mark.parametrize("cls_name,ours,options", [
    ("ScheduleGPipe", "gpipe", {}),
    ("ScheduleInterleaved1F1B", "interleaved-1f1b", {"v": 2}),
    ("ScheduleZBVZeroBubble", "zb-v", {}),
])
def test_torch_classes_equal_pipefold_families(cls_name: str, ours: str, options: dict[str, int]) -> None:
    p, m = 4, 8
    assert from_torch_order(_torch_order(cls_name, p, m)).actions == build(ours, p, m, **options).actions


def test_renumber_leaves_a_well_numbered_order_alone() -> None:
    order = _torch_order("ScheduleZBVZeroBubble", 3, 6)
    assert from_torch_order(order, renumber=True) == from_torch_order(order)


# --------------------------------------------------------------------------- torch's runtime loads ours


@pytest.fixture
def fake_group() -> Iterator[Any]:
    """A one-process 'fake' process group: enough for real PipelineStage objects, and no communication."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    yield fake_pg.FakeStore()
    if dist.is_initialized():
        dist.destroy_process_group()


def _planned(p: int, m: int, budget: float) -> Schedule:
    """What ``pipefold plan`` picks; should it pick replicas, which torch cannot hold, the best without."""
    answer = plan(p, m, budget)
    schedule = build(answer.name, p, m, **answer.options)
    if schedule.replicas == 1:
        return schedule
    with pytest.raises(ConfigError, match="replicas"):
        to_torch_csv(schedule)
    single = [pt for pt in answer.points if build(pt.name, p, m, **pt.options).replicas == 1]
    best = choose(single, budget)
    return build(best.name, p, m, **best.options)


@pytest.mark.parametrize("budget", ["0.5x", "0.75x", "1x"])
def test_torch_runtime_accepts_a_planned_schedule(fake_group: Any, tmp_path: Any, budget: str) -> None:
    p, m = 4, 8
    schedule = validate(_planned(p, m, parse_budget(budget, one_f_one_b_peak(p, m))))
    path = tmp_path / "planned.csv"
    path.write_text(to_torch_csv(schedule))
    torch.distributed.init_process_group("fake", store=fake_group, rank=0, world_size=p)
    stages = [pipelining.PipelineStage(torch.nn.Linear(4, 4), s, schedule.stages, torch.device("cpu"))
              for s in schedule.stages_of(0)]
    runtime = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=lambda out, target: out.sum())
    runtime._load_csv(str(path))  # torch's validation, then its lowering: FSDP, REDUCE_GRAD, sends and receives
    ours = to_torch_actions(schedule)
    assert runtime.pipeline_order == ours
    assert runtime.stage_index_to_group_rank == dict(enumerate(schedule.placement[0]))
    lowered = runtime.pipeline_order_with_comms
    assert {r: [a for a in row if a.is_compute_op] for r, row in lowered.items()} == ours
    assert any(a.computation_type.value == "SEND_F" for row in lowered.values() for a in row)
    # torch's dry run of the lowered schedule finds no deadlock (it knows no FSDP or REDUCE_GRAD actions).
    comms = {r: [a for a in row if a.computation_type.value not in ("UNSHARD", "RESHARD", "REDUCE_GRAD")]
             for r, row in lowered.items()}
    _simulate_comms_compute(comms, lambda s: runtime.stage_index_to_group_rank[s], schedule.stages)
    # And what torch holds reads back as the schedule we wrote.
    assert from_torch_order(runtime.pipeline_order).actions == schedule.actions


def test_torch_runtime_accepts_an_overlapped_pair_schedule(fake_group: Any, tmp_path: Any) -> None:
    schedule = _overlapped()
    path = tmp_path / "pairs.csv"
    path.write_text(to_torch_csv(schedule))
    torch.distributed.init_process_group("fake", store=fake_group, rank=0, world_size=2)
    stages = [pipelining.PipelineStage(torch.nn.Linear(4, 4), 0, 2, torch.device("cpu"))]
    runtime = _PipelineScheduleRuntime(stages, n_microbatches=schedule.microbatches, loss_fn=lambda o, t: o.sum())
    runtime._load_csv(str(path))
    assert runtime.pipeline_order == to_torch_actions(schedule)
    assert str(runtime.pipeline_order[1][1]) == "(1F1;1B0)OVERLAP_F_B"


# --------------------------------------------------------------------------- round trips through torch's CSV


def _overlapped() -> Schedule:
    """Two stages on two devices; device 1 overlaps each forward with the backward of the microbatch before."""
    actions = (
        (F(0, 0), F(0, 1), F(0, 2), BW(0, 0), BW(0, 1), BW(0, 2)),
        (F(1, 0), overlap(F(1, 1), BW(1, 0)), overlap(F(1, 2), B(1, 1)), W(1, 1), BW(1, 2)),
    )
    return validate(Schedule("pairs", 2, 2, 3, (0, 1), actions))


@pytest.mark.parametrize("name,options", [
    ("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("zb-v", {}), ("interleaved-1f1b", {"v": 2}),
])
def test_round_trip_through_torch_csv(name: str, options: dict[str, int]) -> None:
    original = build(name, 4, 8, **options)
    text = to_torch_csv(original)
    back = from_torch_csv(text, name=name)
    assert back.actions == original.actions
    assert (back.stages, back.microbatches, back.placement) == (original.stages, original.microbatches,
                                                                  original.placement)
    assert text.splitlines()[0].startswith("0F0,0F1,")
    if name == "zb-h1":
        assert "0I0" in text and "0W0" in text  # B and W are torch's I and W
    if name == "1f1b":
        assert "0B0" in text  # a fused backward is torch's full backward B


@pytest.mark.parametrize("name", names())
def test_every_registered_schedule_round_trips_or_says_why_not(name: str) -> None:
    original = build(name, 4, max(8, schedules.get(name).min_microbatches(4)))
    if original.replicas > 1:
        with pytest.raises(ConfigError, match="replicas"):
            to_torch_csv(original)
        return
    back = from_torch_csv(to_torch_csv(original))
    assert (back.actions, back.placement) == (original.actions, original.placement)


def test_round_trip_of_overlapped_pairs() -> None:
    original = _overlapped()
    text = to_torch_csv(original)
    assert text.splitlines()[1] == "1F0,(1F1;1B0)OVERLAP_F_B,(1F2;1I1)OVERLAP_F_B,1W1,1B2"
    assert from_torch_csv(text).actions == original.actions
    # torch's own parser reads every cell we write as the action we mean.
    torch_cells = [[_Action.from_str(c) for c in line.split(",")] for line in text.splitlines()]
    assert dict(enumerate(torch_cells)) == to_torch_actions(original)


def test_reading_skips_communication_fsdp_reduce_grad_and_idle_cells() -> None:
    text = "0UNSHARD,0F0,0SEND_F0,,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\n1RECV_F0,1F0,1B0,1SEND_B0\n"
    schedule = validate(from_torch_csv(text))
    assert schedule.actions == ((F(0, 0), BW(0, 0)), (F(1, 0), BW(1, 0)))


def test_whole_stage_actions_are_left_out_on_write() -> None:
    base = build("1f1b", 2, 2)
    with_opt = validate(base.with_actions(row + (OPT(d),) for d, row in enumerate(base.actions)))
    assert "OPT" not in to_torch_csv(with_opt)
    assert from_torch_csv(to_torch_csv(with_opt)).actions == base.actions


def test_a_replicated_placement_cannot_be_written() -> None:
    # Chimera in miniature: microbatch 0 runs down devices 0 -> 1, microbatch 1 up 1 -> 0.
    actions = ((F(0, 0), F(1, 1), BW(1, 1), BW(0, 0), R(0), R(1)),
               (F(0, 1), F(1, 0), BW(1, 0), BW(0, 1), R(0), R(1)))
    schedule = validate(Schedule("mini-chimera", 2, 2, 2, ((0, 1), (1, 0)), actions, routes=(0, 1)))
    for write in (to_torch_csv, to_torch_actions):
        with pytest.raises(ConfigError, match="2 replicas") as info:
            write(schedule)
        assert "\n" not in str(info.value) and "one rank" in str(info.value)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("cell,says", [
    ("1X0", "cannot read it as a torch action"),
    ("F0", "cannot read it as a torch action"),
    ("1F", "names its microbatch"),
    ("1BW0", "cannot read it as a torch action"),  # pipefold's spelling, not torch's
    ("(1F1)OVERLAP_F_B", "one forward and one backward"),
    ("(1F1;1W0)OVERLAP_F_B", "one forward and one backward"),
    ("(1F0;1B0)OVERLAP_F_B", "its own forward"),
    ("(1F1;1B0)SOMETHING", "only OVERLAP_F_B"),
])
def test_bad_cells_name_their_row_and_cell(cell: str, says: str) -> None:
    text = f"0F0,0B0\n1F0,1B0,{cell}\n"
    with pytest.raises(ScheduleError) as info:
        from_torch_csv(text)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"rank 1 (line 2), cell 3 {cell!r}: "), message
    assert says in message


def test_a_stage_on_two_ranks_and_a_missing_stage_are_named() -> None:
    with pytest.raises(ScheduleError, match=r"^rank 1 \(line 2\), cell 2 '0B0': runs stage 0, which rank 0 also"):
        from_torch_csv("0F0\n1F0,0B0\n")
    with pytest.raises(ScheduleError, match="no rank runs stage 1"):
        from_torch_csv("0F0,0B0\n2F0,2B0\n")
    with pytest.raises(ScheduleError, match="empty"):
        from_torch_csv("\n\n")


def test_bad_pipeline_order_entries_are_named() -> None:
    good = _Action.from_str("0F0")
    with pytest.raises(ScheduleError, match=r"^rank 0, step 1 \('oops'\): expected a torch _Action or None"):
        from_torch_order({0: [good, "oops"]})
    with pytest.raises(ScheduleError, match="ranks \\[0, 2\\]"):
        from_torch_order({0: [good], 2: []})


# --------------------------------------------------------------------------- the command line and layering


def test_cli_writes_reads_and_simulates_torch_csv(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    path = tmp_path / "zb.csv"
    assert main(["generate", "zb-v", "-p", "4", "-m", "8", "--format", "torch-csv", "-o", str(path)]) == 0
    assert path.read_text() == to_torch_csv(build("zb-v", 4, 8))
    capsys.readouterr()
    assert main(["validate", str(path), "--format", "torch-csv"]) == 0
    assert "ok (4 devices, 8 stages, 8 microbatches" in capsys.readouterr().out
    assert main(["simulate", str(path), "--format", "torch-csv", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == simulate(build("zb-v", 4, 8)).makespan
    assert main(["compare", str(path), "zb-v", "-p", "4", "-m", "8", "--format", "torch-csv", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert results[0]["makespan"] == results[1]["makespan"]
    # Without --format, torch's dialect is told by its content (its I cells), never misread as pipefold's CSV.
    assert main(["validate", str(path)]) == 0
    assert "ok (4 devices, 8 stages, 8 microbatches" in capsys.readouterr().out


def test_cli_reports_a_bad_torch_cell_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Q0\n")
    assert main(["validate", str(path), "--format", "torch-csv"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"pipefold validate: error: {path}: rank 1 (line 2), cell 2 '1Q0': "
                                        "cannot read it as a torch action: expected <stage><type><microbatch> "
                                        "with type F, I, W or B (e.g. 2F0, 1I3), or (0F1;3B0)OVERLAP_F_B"]


def test_interop_loads_without_torch() -> None:
    code = "import sys, pipefold.ir.interop, pipefold.cli.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(("text", "torch"), [
    ("0F0,0I0,0W0\n1F0,1I0,1W0\n", True),  # torch's input-gradient backward
    ("0F0,(0F1;1B0)OVERLAP_F_B\n", True),
    ("0F0,0SEND_F0\n1RECV_F0,1F0\n", True),
    ("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n", True),  # full backwards only: torch's B
    ("0F0,0F1,0BW0,0BW1\n1F0,1BW0,1F1,1BW1\n", False),  # pipefold's fused backward
    ("0F0,0B0,0W0\n1F0,1B0,1W0\n", False),  # pipefold's B, with its W
])
def test_the_torch_dialect_is_told_by_its_content(tmp_path, text: str, torch: bool) -> None:
    from pipefold.ir.formats import torch_dialect

    assert torch_dialect(text) is torch


def test_validate_and_simulate_read_torch_csv_without_the_flag(tmp_path) -> None:
    from pipefold.cli.main import main

    path = tmp_path / "zbv.csv"
    assert main(["generate", "zb-v", "-p", "2", "-m", "4", "--format", "torch-csv", "-o", str(path)]) == 0
    assert main(["validate", str(path)]) == 0
    assert main(["simulate", str(path), "--json"]) == 0


ONE_BASED = "0F0,0F1,0I0,0W0,0I1,0W1\n1F1,1B1,1F2,1B2\n"
"""A torch CSV as torch 2.13's Schedule1F1B writes one: its last rank numbers its microbatches 1..m."""


def test_renumber_on_the_command_line(tmp_path, capsys) -> None:
    from pipefold.cli.main import main

    path = tmp_path / "torch-1f1b.csv"
    path.write_text(ONE_BASED)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "numbered 1..2" in err and "give --renumber" in err
    assert main(["validate", str(path), "--renumber"]) == 0
    assert main(["simulate", str(path), "--renumber", "--json"]) == 0
    capsys.readouterr()
    code = main(["train", "--schedule", str(path), "--renumber", "--model", "mlp", "--layers", "4", "--hidden", "16",
                 "--batch", "4", "--steps", "1", "--check", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["max_grad_rel_diff"] < 1e-5 and out["microbatches"] == 2

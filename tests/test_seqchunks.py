"""Sequence chunks (Seq1F1B): schedules over (microbatch, chunk) units with the causal dependency between a
microbatch's chunks, their simulated time and memory against closed forms, and the runtime's gradients against one
process."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import run_ranks
from pipefold.errors import ConfigError, ScheduleError
from pipefold.ir import Kind, Schedule, validate
from pipefold.ir.ref import ScheduleRef
from pipefold.schedules import build
from pipefold.sim.simulate import CostModel, StageOverride, of_microbatch, per_chunk, simulate

FAMILIES = ("gpipe", "1f1b", "kfkb", "zb-h1", "zb-h2", "zb-h", "zb-v", "1f1b-v")


def _units_in_causal_order(schedule: Schedule) -> None:
    """Brute force over every device row: a stage's forwards take each microbatch's chunks first to last, its
    backwards (B or BW) last to first."""
    c = schedule.seq_chunks
    for row in schedule.actions:
        seen: dict[tuple[int, str, int], list[int]] = {}
        for act in row:
            for a in act.passes:
                if a.kind in (Kind.F, Kind.B, Kind.BW):
                    kind = Kind.F if a.kind == Kind.F else Kind.B
                    seen.setdefault((a.stage, kind, a.microbatch // c), []).append(a.microbatch % c)
        for (_, kind, _), chunks in seen.items():
            assert chunks == (list(range(c)) if kind == Kind.F else list(range(c - 1, -1, -1))), (kind, chunks)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_its_chunks_in_causal_order(family: str) -> None:
    for p, m, c in itertools.product(range(1, 5), range(1, 6), range(1, 4)):
        options = {"seq_chunks": c, **({"k": 3} if family == "kfkb" else {}), **({"extra": p // 2} if family == "zb-h"
                                                                                   else {})}
        schedule = build(family, p, m, **options)
        assert (schedule.seq_chunks, schedule.data_microbatches, schedule.microbatches) == (c, m, m * c)
        validate(schedule)
        _units_in_causal_order(schedule)


@pytest.mark.parametrize(("p", "m", "c"), [(4, 8, 1), (4, 8, 2), (4, 8, 4), (3, 5, 3), (6, 12, 2)])
def test_seq1f1b_time_and_memory_are_the_closed_forms(p: int, m: int, c: int) -> None:
    """1F1B over chunks: the step is (m + (p-1)/c)(F + B + W), the start-up and drain shrinking to chunks; device i
    holds p-i+c-1 chunks, (p-i+c-1)/c microbatches. ZB-H1 and ZB-V over chunks hold (p+c-1)/c on every device."""
    f, b, w = 1.0, 1.5, 0.5
    one = simulate(build("1f1b", p, m, seq_chunks=c), CostModel(f=f, b=b, w=w))
    assert one.makespan == pytest.approx((m + (p - 1) / c) * (f + b + w))
    assert one.peak_memory == pytest.approx([(p - i + c - 1) / c for i in range(p)])
    for family in ("zb-h1", "zb-v"):
        peaks = simulate(build(family, p, max(m, 2 * p), seq_chunks=c), CostModel(f=f, b=b, w=w)).peak_memory
        assert max(peaks) == pytest.approx((p + c - 1) / c), family


def test_chunks_shorten_the_step_of_every_family() -> None:
    for family in FAMILIES:
        whole = simulate(build(family, 4, 8)).makespan
        assert simulate(build(family, 4, 8, seq_chunks=2)).makespan < whole, family


def test_a_chunk_out_of_its_causal_order_is_named() -> None:
    text = build("1f1b", 2, 2, seq_chunks=2).to_text()
    assert "device 0: 0F0 0F1 " in text
    with pytest.raises(ScheduleError, match=r"0F1 comes before 0F0"):
        validate(Schedule.from_text(text.replace("device 0: 0F0 0F1 ", "device 0: 0F1 0F0 ")))
    backward = text.replace("1BW1 1F2 1BW0", "1BW0 1F2 1BW1")
    assert backward != text
    with pytest.raises(ScheduleError, match=r"1BW0 comes before 1BW1"):
        validate(Schedule.from_text(backward))


def test_the_chunks_survive_every_file_form() -> None:
    schedule = build("zb-v", 2, 3, seq_chunks=2)
    for again in (Schedule.from_text(schedule.to_text()), Schedule.from_json(schedule.to_json())):
        assert again.seq_chunks == 2 and again.actions == schedule.actions
        assert simulate(again).makespan == simulate(schedule).makespan


@pytest.mark.parametrize(("fmt", "expected"), [
    ("csv", "which a CSV file holds no option to say: write it as text or JSON"),
    ("torch-csv", "which torch.distributed.pipelining does not run: write it as text or JSON"),
])
def test_a_csv_cannot_say_the_chunks(capsys: pytest.CaptureFixture[str], tmp_path: Any, fmt: str,
                                     expected: str) -> None:
    from pipefold.cli.main import main

    target = tmp_path / "s.csv"
    assert main(["generate", "1f1b:seq_chunks=2", "--devices", "2", "--microbatches", "2", "--format", fmt,
                 "--output", str(target)]) != 0
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and not target.exists(), err


def test_a_chunk_costs_a_cth_of_its_microbatch() -> None:
    cost = CostModel(f=2.0, b=4.0, w=1.0, memory=3.0, activation_bytes=8.0, latency=0.5, grad_bytes=16.0,
                     work={"KA": 1.0, "KI": 2.0}, stage_overrides={1: StageOverride(f=1.0, b=2.0, w=3.0, memory=4.0)})
    chunk = per_chunk(cost, 4)
    assert (chunk.f, chunk.b, chunk.w, chunk.memory, chunk.activation_bytes) == (0.5, 1.0, 0.25, 0.75, 2.0)
    assert (chunk.latency, chunk.grad_bytes, chunk.work["KI"], chunk.work["KA"]) == (0.5, 16.0, 2.0, 0.25)
    assert chunk.stage_overrides[1].memory == 1.0
    assert of_microbatch(chunk, 4) == cost


def test_what_cannot_take_chunks_is_one_line() -> None:
    with pytest.raises(ConfigError, match="schedule chimera cannot cut microbatches into sequence chunks; schedules "
                                          "that can: gpipe, 1f1b, kfkb"):
        build("chimera", 4, 4, seq_chunks=2)
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        build("1f1b", 4, 4, seq_chunks=0)
    whole = build("1f1b", 2, 3)
    with pytest.raises(ScheduleError, match="3 microbatch units do not split into microbatches of 2 sequence chunks"):
        Schedule(whole.name, 2, 2, 3, whole.placement, whole.actions, {"seq_chunks": 2})


# --------------------------------------------------------------------------- the runtime, exact

_SIZE = {"n_layer": 4, "n_embd": 32, "n_head": 4, "block_size": 32, "vocab_size": 64, "dropout": 0.0}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (4, 32), generator=g)
    return x, torch.roll(x, -1, 1)


def _stages(n_stages: int) -> list[nn.Module]:
    """The GPT in float64, cut into ``n_stages`` stages of whole layers (the head with the last)."""
    from pipefold.models.gpt import GPTConfig, build_gpt

    layers = [layer.double() for layer in build_gpt(GPTConfig(**_SIZE), seed=0)]
    per = len(layers) // n_stages
    return [nn.Sequential(*layers[s * per:(s + 1) * per if s < n_stages - 1 else len(layers)])
            for s in range(n_stages)]


def _reference(steps: int) -> tuple[list[float], list[dict[str, np.ndarray]], torch.Tensor]:
    from pipefold.models.gpt import gpt_loss

    stages = _stages(1)
    model = stages[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(_batch(99)[0])
    return losses, [{k: v.detach().numpy().copy() for k, v in layer.state_dict().items()} for layer in model], logits


def _built(schedule: str, devices: int) -> Schedule:
    """``schedule`` (a name with options) on ``devices`` devices with 2 microbatches."""
    ref = ScheduleRef.parse(schedule)
    return build(ref.name, devices, 2, **ref.kwargs)


def _train(rank: int, init: str, world: int, schedule: str, steps: int, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.models.gpt import gpt_loss
    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        built = _built(schedule, world)
        stages = _stages(built.stages)
        mine = built.stages_of(rank)
        pipe = Pipeline({s: stages[s] for s in mine}, built, loss_fn=gpt_loss)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            x, y = _batch(step)
            opt.zero_grad()
            losses.append(pipe.step(x, target=y, all_ranks=True))
            opt.step()
        logits, _ = pipe.forward(_batch(99)[0])
        layers = {f"{s}.{i}": {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
                  for s in mine for i, layer in enumerate(stages[s])}
        out.put((rank, losses, layers, None if logits is None else logits.numpy()))
        pipe.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["1f1b:seq_chunks=2", "zb-h1:seq_chunks=4", "zb-v:seq_chunks=2",
                                      "kfkb:k=3,seq_chunks=2", "gpipe:seq_chunks=2"])
def test_a_pipeline_over_chunks_trains_as_one_process(schedule: str) -> None:
    """The GPT stepped through ``Pipeline`` in a user's loop, each microbatch cut into sequence chunks: losses,
    weights after three SGD steps and the evaluation's logits equal one process over whole sequences (float64)."""
    losses, weights, logits = _reference(3)
    got = run_ranks(_train, 2, 2, schedule, 3)
    built = _built(schedule, 2)
    per = (_SIZE["n_layer"] + 2) // built.stages
    for _rank, got_losses, layers, got_logits in got:
        assert np.allclose(got_losses, losses, rtol=0, atol=1e-10), (got_losses, losses)
        for key, state in layers.items():
            s, i = map(int, key.split("."))
            for k, v in state.items():
                assert np.abs(v - weights[s * per + i][k]).max() < 1e-10, (key, k)
        if got_logits is not None:
            assert np.abs(got_logits - logits.numpy()).max() < 1e-10
    assert any(r[3] is not None for r in got)


@pytest.mark.parametrize("argv", [
    ["--schedule", "zb-v:seq_chunks=2"],
    ["--schedule", "1f1b:seq_chunks=2", "--dp", "2", "--fsdp", "--batch", "8"],  # FSDP's gather and reduce-scatter
    ["--schedule", "kfkb:k=3,seq_chunks=2", "--dp", "2", "--zero1", "--batch", "8"],
])
def test_train_over_chunks_checks_against_one_process(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    from pipefold.cli.main import main

    assert main(["train", "--model", "gpt", *argv, "--devices", "2", "--microbatches", "2", "--steps", "2",
                 "--check"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("check against one process"))
    loss, grad = (float(x.split()[-1]) for x in line.split(":", 1)[1].split(","))
    assert loss < 1e-5 and grad < 1e-5, line


@pytest.mark.parametrize(("argv", "expected"), [
    (["--model", "mlp"], "the mlp model does not declare its attention and positions for sequence chunks"),
    (["--model", "gpt", "--seq", "64", "--schedule", "1f1b:seq_chunks=3"],
     "seq_chunks 3 cuts each sequence into 3 equal chunks, and --seq 64 does not: give --seq a multiple of 3"),
    (["--model", "gpt", "--cp", "2"], "sequence chunks (seq_chunks 2) do not run with --cp 2 yet"),
    (["--model", "gpt", "--recompute", "full"], "sequence chunks (seq_chunks 2) do not run with --recompute full yet"),
    (["--model", "gpt", "--schedule", "dualpipev:seq_chunks=2"], "schedule dualpipev cannot cut microbatches into "
                                                                 "sequence chunks"),
])
def test_what_train_cannot_cut_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                           expected: str) -> None:
    from pipefold.cli.main import main

    schedule = [] if "--schedule" in argv else ["--schedule", "1f1b:seq_chunks=2"]
    assert main(["train", *schedule, *argv, "--devices", "2", "--steps", "1"]) != 0
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err


def _refused(rank: int, init: str, world: int, case: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.models.gpt import gpt_loss
    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        plain = case == "plain"
        stages = [nn.Sequential(nn.Linear(4, 4)) for _ in range(2)] if plain else _stages(2)
        more: dict[str, Any] = {"recompute": {rank: 1}} if case == "recompute" else {}
        try:
            Pipeline({rank: stages[rank]}, "1f1b:seq_chunks=2", microbatches=2, loss_fn=gpt_loss, **more)
            out.put((rank, None))
        except ConfigError as exc:
            out.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("case", "expected"), [
    ("plain", "a schedule over sequence chunks (seq_chunks 2) fills the model's attention and positions, and these "
              "stage modules declare no attend(q, k, v)"),
    ("recompute", "a schedule over sequence chunks (seq_chunks 2) does not run with recompute= yet"),
])
def test_what_a_pipeline_cannot_cut_is_one_line_on_every_rank(case: str, expected: str) -> None:
    got = run_ranks(_refused, 2, 2, case)
    assert len(got) == 2 and all(msg is not None and expected in msg and "\n" not in msg for _, msg in got), got


def test_the_figures_name_microbatches_and_chunks(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    from pipefold.cli.main import main
    from pipefold.sim.render import _box_label, _title

    figure = tmp_path / "seq.png"
    assert main(["simulate", "1f1b", "--seq-chunks", "2", "--devices", "4", "--microbatches", "8", "--plot",
                 str(figure)]) == 0
    assert "microbatches=8 x 2 sequence chunks" in capsys.readouterr().out and figure.stat().st_size > 0
    result = simulate(build("1f1b", 4, 8, seq_chunks=2))
    assert _title(result).startswith("1f1b:seq_chunks=2  p=4 m=8 x 2 chunks")
    assert [_box_label(a, 2) for a in result.schedule.actions[3][:4]] == ["0.0", "0.1", "0.1", "1.0"]

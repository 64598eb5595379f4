"""Structured partial backpropagation (Jigsaw's SPB) on real gloo ranks: each data-parallel copy backpropagates
through its last layers only, and each layer's gradient is the mean over the copies that computed it: the
gradients of one process doing the same (:func:`pipefold.train.reference.reference_step`), which differ from full
backpropagation's, on every copy; the reduction sends a layer's gradient from the copies that computed it only,
the bytes of the closed form (:func:`pipefold.plan.spb.dp_bytes`); refusals in one line."""

from __future__ import annotations

import contextlib
import dataclasses
from fractions import Fraction
from typing import Any

import pytest

from pipefold.errors import ConfigError
from pipefold.plan.spb import dp_bytes, groups
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.launch.settings import Parallel
from pipefold.train.prepare import make_job
from pipefold.train.reference import compare
from pipefold.train.spec import RunSpec


@pytest.mark.parametrize(("settings", "spb"), [
    (dict(model="mlp", layers=4, devices=1, dp=2, batch=16, schedule="1f1b"), (4, 1)),  # one layer on copy 1
    (dict(model="mlp", layers=4, devices=1, dp=2, batch=16, schedule="1f1b"), (2, 4)),  # two on copy 1 alone
    # layers 0 and 1 on copy 0 alone, layer 2 on copies 0 and 2 (their all-reduce, then copy 0 to copy 1)
    (dict(model="mlp", layers=4, devices=1, dp=3, batch=24, schedule="1f1b"), (4, 1, 2)),
    (dict(model="mlp", layers=4, devices=2, dp=3, batch=24, schedule="zb-h1", partition="even"), (2, 4, 3)),
    (dict(model="mlp", layers=4, devices=2, dp=2, batch=16, schedule="v-half", partition="even"), (4, 3)),
    (dict(model="gpt", layers=4, hidden=32, heads=2, seq=16, devices=2, dp=2, batch=8, schedule="1f1b",
          partition="even"), (6, 5)),  # the embedding and the first block on copy 0 alone
])
def test_each_layers_gradient_is_the_mean_over_the_copies_that_computed_it(settings: dict[str, object],
                                                                          spb: tuple[int, ...]) -> None:
    config = RunSpec.flat(microbatches=2, steps=1, spb=spb, **settings)  # type: ignore[arg-type]
    job = make_job(config.replace(check=True))
    reports = run_local(job)
    diffs = compare(job, reports)
    assert diffs["loss_rel_diff"] < 1e-6 and diffs["max_grad_rel_diff"] < 1e-5, diffs
    # ... and not full backpropagation's (the check above could not fail otherwise).
    full = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, spb=None))
    assert compare(full, reports)["max_grad_rel_diff"] > 1e-3


def test_a_copy_that_stops_early_holds_less_and_computes_less() -> None:
    """Copy 1 of an MLP of 4 layers on one device backpropagates through its last layer only: its forward saves
    nothing for the 3 layers before (the runtime's meter), and its backward is shorter than copy 0's."""
    config = RunSpec.flat(model="mlp", layers=4, hidden=128, devices=1, dp=2, batch=64, microbatches=2, steps=3,
                          schedule="1f1b", spb=(4, 1))
    reports = run_local(make_job(config))
    by_copy = {r.pipeline: r for r in reports}
    full, partial = (by_copy[c].steps[-1] for c in (0, 1))
    assert partial.peak_activation_bytes < 0.5 * full.peak_activation_bytes, (partial.peak_activation_bytes,
                                                                               full.peak_activation_bytes)


@pytest.mark.parametrize(("settings", "says"), [
    (dict(dp=1, spb=(4,)), "--spb splits backpropagation over data-parallel copies, and --dp 1 has one"),
    (dict(dp=2, spb=(4,)), "--spb 4 gives 1 copies their layers, and --dp 2 has 2: give one number per copy"),
    (dict(dp=2, spb=(0, 4)), "--spb gives each data-parallel copy the number of last layers it backpropagates"),
    (dict(dp=2, spb=(3, 2), devices=1), "--spb 3,2 leaves layers 0 to 0 of 4 with no copy computing them: give one "
                                        "copy all 4 layers (--spb 4,2)"),
    (dict(dp=2, spb=(5, 2), devices=1), "--spb 5,2 backpropagates through 5 layers, and the model has 4"),
    (dict(dp=2, spb=(4, 1), devices=2, partition="even"),
     "--spb 4,1 cuts a copy's backward past the first stage (layers 0 to 1 of 4): give every copy at least its "
     "last 2 layers, or the first stage more layers (fewer stages: fewer --devices, or one stage per device as "
     "--schedule 1f1b has)"),
    (dict(dp=2, spb=(4, 3), devices=1, optimizer="kfac"),
     "structured partial backpropagation (--spb 4,3) does not run with --optimizer kfac yet"),
    (dict(dp=2, spb=(4, 3), devices=1, fsdp=True), "(--spb 4,3) does not run with --fsdp yet"),
])
def test_what_spb_cannot_run_is_one_line(settings: dict[str, object], says: str) -> None:
    base = dict(model="mlp", layers=4, batch=16, microbatches=2, steps=1, schedule="1f1b")
    with pytest.raises(ConfigError) as info:
        make_job(RunSpec.flat(**{**base, **settings}))  # type: ignore[arg-type]
    assert says in str(info.value)
    assert "\n" not in str(info.value)


def test_the_copies_computing_a_layer() -> None:
    parallel = Parallel(dp=3, spb=(6, 2, 4))
    assert [parallel.computing(layer, 6) for layer in range(6)] == [1, 1, 2, 2, 3, 3]
    assert Parallel(dp=3).computing(0, 6) == 3


def test_the_reductions_groups_and_bytes_in_closed_form() -> None:
    """(2, 4, 3) over 4 layers of 12 bytes each: layer 0 on copy 1 alone (sent to copies 0 and 2: the dp group),
    layer 1 on copies 1 and 2 (their all-reduce, then copy 1 to copy 0), layers 2 and 3 on all three (a ring sends
    2 x 2/3 x 12 from each); the all-reduce of every layer over every copy, 4 x 16 from each."""
    assert groups((2, 4, 3), range(4), 4) == [(1, 2), (0, 1)]
    assert groups((2, 4, 3), [2, 3], 4) == []
    assert groups((4, 1, 2), range(4), 4) == [(0, 2), (0, 1)]
    sizes = dict.fromkeys(range(4), 12)
    assert dp_bytes((2, 4, 3), sizes, 4) == [32, 24 + 24 + 32, 12 + 32]
    assert dp_bytes((2, 4, 3), sizes, 4, split=False) == [64, 64, 64]
    assert dp_bytes((2, 1), {0: 10, 1: 10}, 2) == [Fraction(20), Fraction(10)]  # copy 1 computes layer 1 only


def test_the_reduction_sends_each_layer_from_the_copies_that_computed_it(capsys: pytest.CaptureFixture[str]) -> None:
    """``pipefold train --json`` over 3 copies and 2 devices: the bytes each copy's ranks sent in the data-parallel
    reduction, as the runtime counted them, are the closed form's for the layers' sizes (an MLP block of width H:
    8 H^2 + 5 H float32 numbers), less in all than the all-reduce of every layer over every copy, and none for a
    layer a copy did not compute."""
    import json

    from pipefold.cli.main import main

    assert main(["train", "--model", "mlp", "--layers", "4", "--hidden", "16", "--batch", "24", "--devices", "2",
                 "--dp", "3", "--spb", "2,4,3", "--schedule", "zb-h1", "--partition", "even", "--steps", "2",
                 "--json"]) == 0
    copies = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["spb"]["per_copy"]
    sizes = dict.fromkeys(range(4), (8 * 16 * 16 + 5 * 16) * 4)
    want, full = dp_bytes((2, 4, 3), sizes, 4), dp_bytes((2, 4, 3), sizes, 4, split=False)
    assert [c["dp_sent_bytes"] for c in copies] == [float(w) for w in want]
    assert [c["predicted_dp_bytes"] for c in copies] == [float(w) for w in want]
    assert [c["full_dp_bytes"] for c in copies] == [float(f) for f in full]
    assert sum(want) < sum(full)
    # Copy 0 computes layers 2 and 3 only: it sends their all-reduce's share, nothing of layers 0 and 1.
    assert copies[0]["dp_sent_bytes"] == float(2 * Fraction(2 * 2 * sizes[2], 3)) < copies[0]["full_dp_bytes"]


def test_the_run_reports_each_copy_beside_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    """``pipefold train --json`` gives each copy's layers, busy time and activation peak, and the simulator's: the
    copy that stops early holds less by both, and the simulator's peak is the meter's within a quarter."""
    import json

    from pipefold.cli.main import main

    assert main(["train", "--model", "mlp", "--layers", "8", "--hidden", "64", "--batch", "32", "--devices", "2",
                 "--dp", "2", "--spb", "8,5", "--schedule", "1f1b", "--partition", "even", "--steps", "3",
                 "--json"]) == 0
    copies = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["spb"]["per_copy"]
    assert [c["layers"] for c in copies] == [8, 5]
    assert copies[1]["peak_activation_bytes"] < copies[0]["peak_activation_bytes"]
    assert copies[1]["predicted_peak_bytes"] < copies[0]["predicted_peak_bytes"]
    assert copies[1]["predicted_busy_s"] < copies[0]["predicted_busy_s"]
    for c in copies:
        assert abs(c["predicted_peak_bytes"] - c["peak_activation_bytes"]) <= 0.25 * c["peak_activation_bytes"], c


def _library_spb(rank: int, init: str, spb: tuple[int, ...], out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    copy, device = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    stage = nn.Sequential(*layers[2 * device:2 * device + 2])  # two layers a stage
    pipe = Pipeline(stage, "1f1b", microbatches=2, loss_fn=nn.functional.mse_loss, mesh=mesh, spb=spb)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    pipe.step(x.chunk(2)[copy], target=y.chunk(2)[copy])
    out.put((copy, device, {f"{2 * device + i}.{k}": p.grad.numpy().copy() for i, layer in enumerate(stage.children())
                            for k, p in layer.named_parameters() if p.grad is not None},
             (pipe.last.dp_sent, pipe.last.dp_layer_bytes)))
    dist.destroy_process_group()


@pytest.mark.parametrize("spb", [(4, 3), (2, 4)])
def test_a_users_pipeline_takes_spb_and_makes_the_mean_over_the_computing_copies(spb: tuple[int, ...]) -> None:
    """``Pipeline(..., spb=)`` on a (dp, pp) mesh of 2 x 2, two Linear layers a stage: every copy's gradients are
    one process's, each layer's the mean over the copies that backpropagate through it (computed here layer by
    layer, each copy on its half of the batch); each copy's ranks sent the closed form's bytes (a layer: a Linear
    of 8 x 8 and its bias, 288 bytes)."""
    import torch
    from torch import nn

    from conftest import run_ranks
    from pipefold.plan.spb import computing

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    want: dict[str, torch.Tensor] = {}
    for copy, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
        for mx, my in zip(xs.chunk(2), ys.chunk(2), strict=True):  # its 2 microbatches, each loss / 2
            h = mx
            for i, layer in enumerate(layers):
                with torch.no_grad() if i < 4 - spb[copy] else contextlib.nullcontext():
                    h = layer(h)
            (nn.functional.mse_loss(h, my) / 2).backward()
        for i, layer in enumerate(layers):
            for k, p in layer.named_parameters():
                if p.grad is not None:
                    name = f"{i}.{k}"
                    want[name] = want.get(name, 0) + p.grad / computing(spb, i, 4)
                    p.grad = None
    got = run_ranks(_library_spb, 4, spb)
    assert len(got) == 4
    for _, _, grads, _ in got:
        for name, grad in grads.items():
            torch.testing.assert_close(torch.from_numpy(grad), want[name], atol=1e-6, rtol=1e-5)
    assert {name for _, _, grads, _ in got for name in grads} == set(want)
    sizes = dict.fromkeys(range(4), (8 * 8 + 8) * 4)
    for _, device, _, (_, layer_bytes) in got:
        assert layer_bytes == {2 * device + i: sizes[2 * device + i] for i in range(2)}
    sent = [sum((dp for c, _, _, (dp, _) in got if c == copy), Fraction(0)) for copy in range(2)]
    assert sent == dp_bytes(spb, sizes, 4)
    assert sum(sent) < sum(dp_bytes(spb, sizes, 4, split=False))


def _library_refusals(rank: int, init: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    device = mesh["pp"].get_local_rank()
    said = {}
    cases = {"no dp": dict(group=mesh["pp"].get_group(), spb=(2, 2)), "count": dict(mesh=mesh, spb=(4,)),
             "uncovered": dict(mesh=mesh, spb=(3, 3)), "past the first stage": dict(mesh=mesh, spb=(4, 1)),
             "recompute": dict(mesh=mesh, spb=(4, 3), recompute={device: 1})}
    for name, kwargs in cases.items():
        stage = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        try:
            Pipeline(stage, "1f1b", microbatches=2, loss_fn=nn.functional.mse_loss, **kwargs)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001  # the refusal, as the user sees it
            said[name] = f"{type(exc).__name__}: {exc}"
    out.put((rank, said))
    dist.destroy_process_group()


def test_a_users_pipeline_refuses_what_spb_cannot_run_in_one_line() -> None:
    from conftest import run_ranks

    got = run_ranks(_library_refusals, 4)
    for _, said in got:
        assert said["no dp"].startswith("ConfigError: spb= splits backpropagation over data-parallel copies")
        assert "gives 1 copies their layers, and the mesh's 'dp' dimension has 2" in said["count"]
        assert "leaves layers 0 to 0 of 4 with no copy computing them" in said["uncovered"]
        assert "cuts a copy's backward past the first stage (layers 0 to 1 of 4)" in said["past the first stage"]
        assert said["recompute"] == "ConfigError: spb= does not run with recompute= yet: drop one of them"
        assert all("\n" not in line for line in said.values())

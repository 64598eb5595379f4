"""Structured partial backpropagation (Jigsaw's SPB) on real gloo ranks: each data-parallel copy backpropagates
through its last layers only, and each layer's gradient is the mean over the copies that computed it: the
gradients of one process doing the same (:func:`pipefold.train.reference.reference_step`), which differ from full
backpropagation's; refusals in one line."""

from __future__ import annotations

import dataclasses

import pytest

from pipefold.errors import ConfigError
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.launch.settings import Parallel
from pipefold.train.prepare import make_job
from pipefold.train.reference import compare
from pipefold.train.spec import RunSpec


@pytest.mark.parametrize(("settings", "spb"), [
    (dict(model="mlp", layers=4, devices=1, dp=2, batch=16, schedule="1f1b"), (4, 1)),  # one layer on copy 1
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

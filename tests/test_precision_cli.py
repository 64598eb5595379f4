"""``pipefold train --dtype / --master-weights / --loss-scale / --compile`` and ``pipefold profile --dtype``: each
run checked against one process running the same recipe (``--check``), and what no run can use refused in one
line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipefold.cli.main import main
from test_cli_hostile import one_line_error

SMALL = ["--devices", "2", "--steps", "2", "--layers", "4", "--hidden", "32", "--seq", "16", "--batch", "8", "-m",
         "4"]


def _train(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict, str]:
    small = SMALL if "mlp" not in argv else [a for a in SMALL if a not in ("--seq", "16")]  # the mlp has no sequence
    code = main(["train", *small, "--check", "--json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err


@pytest.mark.parametrize("argv", [
    ["--dtype", "bf16", "--schedule", "v-half"],
    ["--dtype", "fp16", "--schedule", "zb-h1"],
    ["--dtype", "bf16", "--master-weights", "--schedule", "1f1b"],
    ["--dtype", "fp16", "--master-weights", "--schedule", "dualpipev", "--recompute", "full"],
    ["--compile", "--compile-backend", "aot_eager", "--schedule", "zb-v"],
    ["--compile", "whole", "--compile-backend", "aot_eager", "--dtype", "bf16", "--schedule", "dualpipev"],
    ["--dtype", "bf16", "--master-weights", "--dp", "2", "--zero1", "--devices", "2"],
    ["--dtype", "bf16", "--dp", "2", "--fsdp"],
    ["--offload", "1,1", "--dtype", "bf16", "--compile", "--compile-backend", "aot_eager"],
    ["--model", "mlp", "--dtype", "bf16", "--master-weights", "--schedule", "zb-h1"],
    ["--optimizer", "kfac", "--dtype", "bf16"],  # v-half's first stage holds only the embedding: no K-FAC layer
    ["--optimizer", "kfac", "--fill-bubbles", "--schedule", "1f1b", "--partition", "even"],
])
def test_each_recipe_equals_one_process_running_it(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """The first step's gradients against one process running the same dtype, master weights, loss scale and
    compiled layers, over the same microbatches (data-parallel copies' included): equal to 1e-6, where the recipe
    differs from float32 by far more (bf16 keeps 8 bits of mantissa)."""
    out, _ = _train(capsys, argv)
    assert out["max_grad_rel_diff"] <= 1e-6
    assert out["loss_rel_diff"] <= 1e-6
    if "--dtype" in argv:
        assert out["precision"].startswith(argv[argv.index("--dtype") + 1])
    if "--compile" in argv:
        assert out["compile"].endswith("(aot_eager)")


def test_fp16_without_a_loss_scale_warns_of_the_gradients_it_loses(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = _train(capsys, ["--dtype", "fp16", "--loss-scale", "none"])
    assert "warning: fp16 without a loss scale" in err and "--loss-scale dynamic" in err
    out, err = _train(capsys, ["--dtype", "fp16"])  # the dynamic scale: no warning
    assert "without a loss scale" not in err and "dynamic loss scale" in out["precision"]


def test_a_fixed_loss_scale_that_overflows_stops_the_run_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", *SMALL, "--steps", "4", "--dtype", "fp16", "--loss-scale", "1e15"])
    _, err = capsys.readouterr()
    assert code != 0
    assert "a lower --loss-scale" in err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "words"), [
    (["--master-weights"], "master weights are float32 copies"),
    (["--loss-scale", "128"], "give it with --dtype fp16"),
    (["--dtype", "fp16", "--loss-scale", "lots"], "give 'dynamic', 'none' or a number"),
    (["--dtype", "fp16", "--loss-scale", "0.5"], "from 1 to 2^64"),
    (["--dtype", "bf16", "--master-weights", "--dp", "2", "--fsdp"], "does not run with --fsdp"),
    (["--dtype", "bf16", "--master-weights", "--offload", "1,1"], "does not run with --offload"),
    (["--dtype", "bf16", "--master-weights", "--tp", "2"], "does not run with --tp 2"),
    (["--dtype", "fp16", "--optimizer", "kfac"], "which a loss scale multiplies"),
    (["--compile", "fast"], "invalid choice"),
    (["--compile-backend", "tvm"], "invalid choice"),
])
def test_a_recipe_no_run_can_use_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                             words: str) -> None:
    assert words in one_line_error(capsys, ["train", *SMALL, *argv])


def test_a_profile_in_bf16_plans_a_bf16_run_and_refuses_another_dtype(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """The profile measures the passes under autocast (the blocks' saved activations shrink, what they hand on
    keeps the residual stream's float32), the plan from it runs in bf16, and a run in another dtype is refused."""
    held = {}
    for dtype in ("fp32", "bf16"):
        path = tmp_path / f"{dtype}.json"
        assert main(["profile", "--layers", "4", "--hidden", "32", "--seq", "16", "--repeats", "1", "--no-link",
                     "--no-sharing", "--no-overhead", "--dtype", dtype, "-o", str(path), "--json"]) == 0
        prof = json.loads(path.read_text())
        held[dtype] = [layer["held"] for layer in prof["layers"]]
        assert prof["train"].get("dtype", "fp32") == dtype
    blocks = range(1, len(held["fp32"]) - 1)
    assert all(held["bf16"][i] < held["fp32"][i] for i in blocks)
    plan = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(tmp_path / "bf16.json"), "--memory-budget", "64MB", "-o", str(plan),
                 "--json"]) == 0
    capsys.readouterr()
    assert main(["train", "--plan", str(plan), "--steps", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"].startswith("bf16")
    assert "profile again with pipefold profile --dtype fp16" in one_line_error(
        capsys, ["train", "--plan", str(plan), "--steps", "1", "--dtype", "fp16"])

"""``pipefold offload``: JSON report, residency of the 24-block GPT, exactness, --budget and one-line errors."""

from __future__ import annotations

import json

import pytest

from pipefold.cli.main import main

SMALL = ["--batch", "2", "--seq", "16"]  # the 24-block, width-64 default model on a tiny batch: fast


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["offload", *SMALL, *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    result = json.loads(out)
    assert isinstance(result, dict)
    return result


def test_json_keys_and_24_block_gpt_residency(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(capsys, "--k", "2", "--kprime", "1")
    for key in ("k", "kprime", "peak_resident_bytes", "full_model_bytes", "max_abs_diff", "step_time_s"):
        assert key in out
    assert set(out["step_time_s"]) == {"offloaded", "plain"}
    assert all(t > 0 for t in out["step_time_s"].values())
    assert (out["model"], out["layers"], out["seq"], out["k"], out["kprime"]) == ("gpt", 24, 16, 2, 1)
    assert out["peak_resident_layers"] == 2
    # Embedding and head count as resident: the peak is them plus two blocks.
    assert out["peak_resident_bytes"] == out["resident_static_bytes"] + 2 * out["largest_layer_bytes"]
    assert out["peak_resident_bytes"] <= 0.15 * out["full_model_bytes"]
    assert out["max_abs_diff"] == 0


def test_train_gradients_and_weights_exact(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(capsys, "--train", "--steps", "2", "--k", "3", "--kprime", "2")
    assert out["train"] and out["steps"] == 2
    assert out["max_abs_diff"] == 0 and out["max_grad_diff"] == 0 and out["max_weight_diff"] == 0
    assert out["peak_resident_layers"] <= 3


def test_mlp_train(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(capsys, "--model", "mlp", "--layers", "6", "--hidden", "16", "--train", "--steps", "2", "--k", "1")
    assert out["resident_static_bytes"] == 0
    assert out["peak_resident_bytes"] == out["largest_layer_bytes"]
    assert out["max_grad_diff"] == 0 and out["max_weight_diff"] == 0


@pytest.mark.parametrize("blocks", [1, 3, 6])
def test_budget_picks_k_that_fits(capsys: pytest.CaptureFixture[str], blocks: int) -> None:
    probe = _run_json(capsys, "--k", "1", "--steps", "1")
    budget = probe["resident_static_bytes"] + blocks * probe["largest_layer_bytes"] + 1000
    out = _run_json(capsys, "--budget", str(budget), "--steps", "1")
    assert out["k"] == blocks and out["kprime"] == 1 and out["budget"] == budget
    assert out["peak_resident_bytes"] <= budget
    assert out["max_abs_diff"] == 0


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["offload", *SMALL, "--layers", "4", "--train", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "k=2, k'=1" in out and "of the full model" in out and "bit for bit" in out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--k", "0"], "--k: 0 is out of range: give a whole number >= 1"),
    (["--k", "2", "--kprime", "3"], "--kprime must be from 1 to --k=2"),
    (["--kprime", "0"], "--kprime: 0 is out of range: give a whole number >= 1"),
    (["--budget", "1000"], "largest layer, layer 1 (block 0) of 199936 bytes"),
    (["--budget", "1000", "--model", "mlp", "--hidden", "8"], "largest layer, layer 0 of"),
    (["--budget", "100000000", "--k", "2"], "--k is picked by --budget: give either --budget or --k/--kprime"),
    (["--budget", "lots"], "cannot read --budget 'lots': give bytes such as 2000000, 2e6, 1.5MB or 64MiB"),
    (["--budget", "1kB"], "a budget of 1000 bytes cannot hold"),
    (["--steps", "0"], "--steps: 0 is out of range: give a whole number >= 1"),
    (["--hidden", "30", "--heads", "4"], "multiple of --heads"),
    (["--k", "x"], "--k: 'x' is not a whole number >= 1 and <= 4,096"),
])
def test_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    try:
        code = main(["offload", *argv])
    except SystemExit as exc:  # argparse's own errors exit from inside main
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and needle in captured.err

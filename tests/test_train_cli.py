"""pipefold train end to end: local spawn, torchrun, outputs, and user errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipefold.cli.main import main
from pipefold.runtime.launch.processes import free_port

SMALL = ["--model", "mlp", "--layers", "4", "--hidden", "16", "--batch", "8", "--devices", "2", "--microbatches", "4"]


def test_train_json_check_trace_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace, plot = tmp_path / "t.json", tmp_path / "t.png"
    code = main(["train", "--schedule", "zb-v", "--steps", "3", *SMALL, "--check", "--json",
                 "--trace", str(trace), "--plot", str(plot)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {"schedule", "stages", "microbatches", "loss", "step_time_s", "peak_activation_bytes",
            "max_grad_rel_diff"} <= set(out)
    assert out["schedule"] == "zb-v" and len(out["loss"]) == 3 and len(out["step_time_s"]) == 3
    assert out["partition"] == "time" and out["boundaries"][0] == 0 and len(out["boundaries"]) == 4
    assert out["max_grad_rel_diff"] < 1e-5 and len(out["peak_activation_bytes"]) == 2
    events = json.loads(trace.read_text())["traceEvents"]
    computed = [e for e in events if e.get("cat") in ("F", "B", "W", "BW")]
    assert len(computed) == 3 * 4 * 4 * 3  # steps x stages x microbatches x (F, B, W)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_either_transport_trains_the_same_weights(capsys: pytest.CaptureFixture[str]) -> None:
    """The ranks' messages over this machine's sockets (the default here) and over gloo: the same losses bit for
    bit (a transport only moves bytes) and one process's gradients, on a schedule whose ranks exchange messages
    both ways for two stages each."""
    runs = {}
    for p2p in ("auto", "sockets", "gloo"):
        code = main(["train", "--schedule", "interleaved-1f1b", "--steps", "2", *SMALL, "--layers", "8", "--p2p",
                     p2p, "--check", "--json"])
        assert code == 0
        runs[p2p] = json.loads(capsys.readouterr().out)
    assert [runs[p]["p2p"] for p in runs] == ["sockets", "sockets", "gloo"]
    assert runs["sockets"]["loss"] == runs["gloo"]["loss"] == runs["auto"]["loss"]
    assert all(out["max_grad_rel_diff"] < 1e-5 for out in runs.values()), runs


def test_train_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--schedule", "1f1b", "--steps", "2", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "1f1b on 2 ranks" in out and "peak held" in out and "predicted" in out and "median step" in out
    assert "stages start at layers 0 " in out and "(split balanced by time)" in out
    assert "simulated from the measured costs" in out  # no plan: the run's own costs, replayed


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--schedule", "nope"], "unknown schedule 'nope'"),
        (["--schedule", "v-half", "--layers", "3"], "v-half on 2 devices has 4 stages but the model has 3 layers"),
        (["--batch", "6"], "a batch of 6 does not split into 4 microbatches"),
        (["--plot", "x.pdf"], "use a file name ending in .png or .svg"),
        (["--steps", "0"], "--steps: 0 is out of range: give a whole number >= 1"),
        (["--lr", "-1"], "--lr: -1 is out of range: give a number >= 0 and <= 1000"),
        (["--lr", "nan"], "--lr: nan is out of range: give a number >= 0 and <= 1000"),
        (["--clip", "0"], "--clip: 0 is out of range: give a number > 0"),
        (["--action-timeout", "0"], "--action-timeout: 0 is out of range: give a number > 0 and <= 86400"),
        (["--action-timeout", "nan"], "--action-timeout: nan is out of range: give a number > 0 and <= 86400"),
        (["--action-timeout", "1e9"], "--action-timeout: 1e9 is out of range: give a number > 0 and <= 86400"),
        (["--p2p", "sockets", "--network", "constant:bandwidth=1GB,latency=0"],
         "--p2p sockets moves messages through this machine's sockets, and --network emulates or measures links of "
         "the process group: use --p2p auto or gloo"),
        (["--p2p", "sockets", "--schedule", "adaptive-kfkb", "--memory-budget", "1GB"],
         "and --schedule adaptive-kfkb emulates or measures"),
    ],
)
def test_train_user_errors(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    base = ["--model", "mlp", "--layers", "4", "--hidden", "16", "--batch", "8", "--devices", "2",
            "--microbatches", "4"]
    code = main(["train", *base, *argv])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1


TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="no torchrun")


def _torchrun_train(tmp_path: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``pipefold train ARGV`` on 2 processes started by torchrun."""
    assert TORCHRUN is not None
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A port of its own: two tests of this file at once under pytest-xdist must not meet on one store.
    launcher = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port())]
    return subprocess.run([*launcher, "-m", "pipefold", "train", *argv], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=timeout, check=False)


@needs_torchrun
def test_same_command_under_torchrun(tmp_path: Path) -> None:
    proc = _torchrun_train(tmp_path, ["--schedule", "v-half", "--steps", "2", *SMALL, "--layers", "8",
                                      "--hidden", "256", "--batch", "512",  # activations of 64 kB
                                      "--check", "--json", "--recompute", "full"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["schedule"] == "v-half" and out["max_grad_rel_diff"] < 1e-5 and len(out["loss"]) == 2
    assert out["p2p"] == "sockets"  # both ranks on this machine: torchrun's too
    # Progress under torchrun: rank 0's lines, once per step, with the loss the run reports.
    progress = [line for line in proc.stderr.splitlines() if " loss " in line and line.lstrip().startswith("step ")]
    assert [line.split()[1] for line in progress] == ["1/2", "2/2"], proc.stderr[-2000:]
    assert [line.split()[3] for line in progress] == [f"{v:.4f}" for v in out["loss"]]
    # Rank 0 measured the split (by time, the default) and the recomputation; every rank ran them.
    assert out["recompute"]["layers"] == out["recompute"]["stage_layers"] and sum(out["recompute"]["layers"]) == 8
    # The simulator fed with the run's own per-stage figures predicts each rank's peak, and the plan made before
    # the run (from figures measured on the launcher) did not promise less than the ranks held.
    measured, plan = out["peak_activation_bytes"], out["recompute"]["activation_peak_bytes"]
    assert all(abs(m - p) <= 0.05 * p for m, p in zip(measured, out["predicted_peak_bytes"], strict=True)), out
    assert all(m <= 1.05 * p for m, p in zip(measured, plan, strict=True)), out


@pytest.mark.parametrize(("value", "expected"), [("2", "use K,K2 such as 2,1"), ("1,2", "so 1 <= K2 <= K")])
def test_train_offload_errors(capsys: pytest.CaptureFixture[str], value: str, expected: str) -> None:
    code = main(["train", *SMALL, "--offload", value])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1


@needs_torchrun
def test_a_user_error_on_rank_0_stops_every_rank_under_torchrun(tmp_path: Path) -> None:
    # Rank 0 finds the budget unreachable while measuring; the other rank must not wait for it.
    proc = _torchrun_train(tmp_path, ["--schedule", "1f1b", "--steps", "1", *SMALL, "--recompute", "auto",
                                      "--memory-budget", "1000"], timeout=120)
    assert proc.returncode != 0
    # One worker says it, and torchrun's summary repeats it from the error file (its root cause, and the other
    # worker's failure where the watch did not stop it first): pipefold's own part is one line.
    assert proc.stderr.count("pipefold train: error: no recomputation fits 1000 bytes per device") in (1, 2, 3)
    assert sum(line.startswith("pipefold train: error:") for line in proc.stderr.splitlines()) == 1


def test_train_recompute_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--schedule", "1f1b", "--steps", "1", "--model", "mlp", "--layers", "6", "--hidden", "256",
            "--batch", "1024", "--devices", "2", "--microbatches", "8", "--partition", "even", "--recompute"]
    # An even split: the default split by measured time may differ between the two runs.
    assert main([*argv, "full", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["recompute"]["mode"] == "full" and full["recompute"]["layers"] == [3, 3]
    measured, plan = full["peak_activation_bytes"], full["recompute"]["activation_peak_bytes"]
    assert all(abs(m - p) <= 0.05 * p for m, p in zip(measured, full["predicted_peak_bytes"], strict=True)), full
    assert all(m <= 1.05 * p for m, p in zip(measured, plan, strict=True)), full
    budget = max(full["recompute"]["peak_bytes"]) * 1.02  # roomier than everything recomputed
    assert main([*argv, "auto", "--memory-budget", f"{budget:.0f}"]) == 0
    out = capsys.readouterr().out
    assert "recompute auto: layers recomputed stage 0:" in out and "saved, predicted" in out and "budget" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--recompute", "auto"], "--recompute auto needs --memory-budget BYTES"),
        (["--memory-budget", "1MB"], "with --recompute none drop it"),
        (["--recompute", "auto", "--memory-budget", "lots"], "cannot read the memory budget 'lots'"),
        (["--recompute", "full", "--offload", "2,1"], "--recompute and --offload do not combine yet"),
        (["--recompute", "auto", "--memory-budget", "1000"], "the smallest reachable budget is"),
    ],
)
def test_train_recompute_errors(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    code = main(["train", *SMALL, *argv])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1


@needs_torchrun
def test_kfac_in_the_bubbles_under_torchrun(tmp_path: Path) -> None:
    """Rank 0 times the stages and places K-FAC's work; the other rank runs that placement, not its own."""
    proc = _torchrun_train(tmp_path, ["--schedule", "1f1b", "--steps", "6", *SMALL,
                                      "--optimizer", "kfac", "--fill-bubbles", "--lr", "0.05", "--check",
                                      "--json"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["max_grad_rel_diff"] < 1e-5 and len(out["loss"]) == 6
    k = out["kfac"]
    assert k["cycle_steps"] >= 1 and len(k["per_step"]) == 6 and k["measured"]["utilization"] > 0


def test_train_kfac_report(capsys: pytest.CaptureFixture[str]) -> None:
    """The local run reports K-FAC's placement: predicted and measured step and utilization, per step."""
    code = main(["train", "--schedule", "1f1b", "--steps", "3", *SMALL, "--optimizer", "kfac", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    k = out["kfac"]
    assert not k["fill_bubbles"] and k["cycle_steps"] == 1 and [r["cycle_step"] for r in k["per_step"]] == [0, 0, 0]
    # Inline, the work waits for nobody's bubbles: the predicted step is longer than the plain one.
    assert k["predicted"]["step_s"] > k["predicted"]["plain_step_s"]
    assert main(["train", *SMALL, "--fill-bubbles"]) == 2
    assert "add --optimizer kfac" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expected"), [
    (["train", "--damping", "0.2"], "--damping tunes K-FAC: add --optimizer kfac"),
    (["train", "--ema", "0.5"], "--ema tunes K-FAC"),
    (["train", "--fill-bubbles"], "--fill-bubbles tunes K-FAC"),
    (["train", "--adapt-every", "3"], "--adapt-every spaces adaptive-kfkb's choices of k"),
    (["train", "--heads", "2"], "--heads sizes a language model, and the mlp has no attention"),
    (["train", "--seq", "32"], "--seq sizes a language model"),
    (["train", "--data", "x.txt"], "--data sizes a language model"),
    (["train", "--plan", "p.json", "--dp", "2"], "--dp lays out data- or tensor-parallel copies"),
    (["train", "--plan", "p.json", "--tp", "2"], "--tp lays out data- or tensor-parallel copies"),
    (["train", "--schedule", "auto", "--memory-budget", "1GB", "--fsdp"], "--fsdp lays out data- or tensor-"),
    (["train", "--keep-last", "2"], "--keep-last saves into --checkpoint-dir D"),
    (["train", "--checkpoint-every", "2"], "--checkpoint-every saves into --checkpoint-dir D"),
    (["train", "--layers", "0"], "--layers: 0 is out of range: give a whole number >= 1"),
    (["plan", "--profile", "p.json", "--memory-budget", "1GB", "--f", "2"], "--f sets the cost model"),
    (["plan", "--profile", "p.json", "--memory-budget", "1GB", "--latency", "1"], "--latency sets the cost model"),
    (["plan", "--profile", "p.json", "--memory-budget", "1GB", "--overlap"], "--overlap sets the cost model"),
])
def test_an_option_outside_its_mode_is_refused(capsys: pytest.CaptureFixture[str], argv: list[str],
                                               expected: str) -> None:
    mlp = ["--model", "mlp", "--layers", "4", "--hidden", "16", "--batch", "8", "--devices", "2",
           "--microbatches", "4"] if argv[0] == "train" and "--layers" not in argv else []
    code = main([*argv[:1], *mlp, *argv[1:]])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err


def test_the_table_names_only_real_options() -> None:
    """Every option of the table is one of its command's options (a renamed flag cannot hide there)."""
    import argparse

    from pipefold.cli.args import APPLIES, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for rule in APPLIES:
        dests = {a.dest for a in sub.choices[rule.command]._actions}
        assert set(rule.options) <= dests, (rule.command, set(rule.options) - dests)


HAND_WRITTEN = """# pipefold schedule
name: by-hand
devices: 2
stages: 2
microbatches: 2
placement: linear
device 0: 0F0 0F1 0B0 0W0 0B1 0W1
device 1: 1F0 1B0 1F1 1B1 1W0 1W1
"""


@pytest.mark.parametrize("how", ["text", "json", "csv", "torch-csv", "by-hand"])
def test_train_runs_a_schedule_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, how: str) -> None:
    """Any valid schedule file trains, with the gradients of one process: pipefold's three formats, torch's CSV
    told apart by its content (no --format), and one written by hand; its devices and microbatches are the run's."""
    if how == "by-hand":
        path = tmp_path / "mine.txt"
        path.write_text(HAND_WRITTEN)
    else:
        path = tmp_path / f"s.{ {'text': 'txt', 'json': 'json'}.get(how, 'csv') }"
        fmt = ["--format", "torch-csv"] if how == "torch-csv" else []
        assert main(["generate", "zb-v", "-p", "2", "-m", "4", "-o", str(path), *fmt]) == 0
    capsys.readouterr()
    code = main(["train", "--schedule", str(path), "--model", "mlp", "--layers", "4", "--hidden", "16", "--batch", "8",
                 "--steps", "1", "--check", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["max_grad_rel_diff"] < 1e-5
    assert (out["devices"], out["microbatches"]) == ((2, 2) if how == "by-hand" else (2, 4))


def test_a_schedule_file_keeps_its_shape(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    assert main(["generate", "1f1b", "-p", "2", "-m", "4", "-o", str(path)]) == 0
    capsys.readouterr()
    for flag, value in (("--devices", "3"), ("--microbatches", "6")):
        code = main(["train", "--schedule", str(path), flag, value, "--model", "mlp", "--layers", "4"])
        err = capsys.readouterr().err
        assert code == 2 and f"drop {flag} {value}, or give the file's" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("nodes", [2, 4])
def test_sockets_across_machines_under_torchrun_are_refused_before_joining(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, nodes: int) -> None:
    """torchrun's workers on several machines: each refuses --p2p sockets alike, before any rendezvous (no master
    runs here: a worker that tried to join would wait for one)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(2 * nodes))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    code = main(["train", "--p2p", "sockets", "--model", "mlp", "--layers", "8", "--hidden", "16", "--batch", "8",
                 "--devices", str(2 * nodes), "--microbatches", "4", "--schedule", "1f1b", "--partition", "even"])
    err = capsys.readouterr().err
    assert code != 0 and "--p2p sockets joins ranks on one machine, and torchrun started these on several" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_schedule_auto_under_torchrun_is_refused_at_once(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker would profile on its own while the others time out waiting: refused before any work."""
    from conftest import no_work

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with no_work():
        code = main(["train", "--schedule", "auto", "--memory-budget", "1GB", "--model", "mlp", "--layers", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "then give torchrun the plan's schedule and flags" in err
    assert len(err.strip().splitlines()) == 1

"""NaN and inf on real ranks: a bad step is skipped (against one process that skips it), the run stops after K in a
row, and Zero Bubble's optimizer post-validation gives the weights of the synchronous check."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pipefold.cli.main import main
from pipefold.runtime.numerics import Snapshot, clip_factor, local_check, verdict

MLP = ["--model", "mlp", "--layers", "4", "--hidden", "16", "--batch", "8", "--devices", "2", "--microbatches", "4",
       "--partition", "even"]


def _cli(cwd: Path, *argv: str, nan: str | None = None) -> subprocess.CompletedProcess[str]:
    """``pipefold train ARGV`` in a process of its own; ``nan``: the steps whose first microbatch gets a NaN."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    faulty = str(Path(__file__).with_name("faulty.py"))  # injects the faults into the command's job
    command = [faulty, "--nan-at", nan, "--"] if nan is not None else ["-m", "pipefold"]
    return subprocess.run([sys.executable, *command, "train", *argv], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=240, check=False)


def _one_process(steps: int, skip: set[int]) -> dict[str, torch.Tensor]:
    """The MLP of ``MLP`` trained in one process with AdamW, the steps in ``skip`` left out (their data unused)."""
    from pipefold.models import make_model
    from pipefold.models.mlp import MLPConfig, mlp_input, mlp_target

    plain = make_model("mlp", layers=4, hidden=16)
    model = torch.nn.Sequential(*plain.build())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = MLPConfig(layers=4, hidden=16)
    for step in range(steps):
        if step in skip:
            continue
        x, y = mlp_input(cfg, 8, step), mlp_target(cfg, 8, 0)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            (plain.loss(model(xs), ys) / 4).backward()
        opt.step()
    return model.state_dict()


def test_a_nan_step_is_skipped_with_one_warning(tmp_path: Path) -> None:
    proc = _cli(tmp_path, *MLP, "--schedule", "1f1b", "--steps", "5", "--json", "--save-model", "m.pt", nan="3")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # Step 3 (numbered from 1, as everywhere the user sees steps): the third entry of the per-step lists.
    assert out["skipped_steps"] == [3] and out["loss"][2] is None and out["grad_norm"][2] is None
    assert all(isinstance(x, float) and math.isfinite(x) for i, x in enumerate(out["loss"]) if i != 2)
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert warnings == ["pipefold: warning: step 3: the loss or a gradient is NaN or inf; step skipped, weights and "
                        "optimizer state unchanged (1 in a row; the run stops at 3)"]
    progress = [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("step ")]
    assert progress == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    # Weights and optimizer state untouched by step 3: the same as one process that never ran it.
    saved = torch.load(tmp_path / "m.pt")
    reference = _one_process(5, skip={2})
    assert saved.keys() == reference.keys()
    for name, w in reference.items():
        torch.testing.assert_close(saved[name], w, rtol=1e-5, atol=1e-6)


def test_a_diverging_run_stops_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SGD at --lr 1000: the first step's update overflows the next forward; three bad steps later (steps 2 to 4,
    numbered from 1 as the progress lines number them) the run stops."""
    proc = _cli(tmp_path, *MLP, "--schedule", "1f1b", "--steps", "8", "--optimizer", "sgd", "--lr", "1000",
                "--json")
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == ("pipefold train: error: the loss or the gradients were NaN or inf in 3 steps in a row "
                         "(steps 2 to 4); the weights are those before step 2: lower --lr, add --clip, or check the "
                         "data")
    assert [line for line in lines if "warning" in line] == [
        f"pipefold: warning: step {s}: the loss or a gradient is NaN or inf; step skipped, weights and optimizer "
        f"state unchanged ({s - 1} in a row; the run stops at 3)" for s in (2, 3)]
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/8", "2/8", "3/8", "4/8"]
    assert main(["train", *MLP, "--schedule", "1f1b", "--steps", "3", "--optimizer", "sgd", "--lr", "1000",
                 "--max-bad-steps", "1"]) == 1
    # Captured stderr is no terminal: a progress line per step precedes the error, which is the one other line.
    assert [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("step ")] == [
        "pipefold train: error: the loss or the gradients were NaN or inf in step 2; the weights are those before "
        "step 2: lower --lr, add --clip, or check the data"]
    assert main(["train", *MLP, "--max-bad-steps", "0"]) == 2
    assert "--max-bad-steps: 0 is out of range: give a whole number >= 1" in capsys.readouterr().err


_COMPARE = textwrap.dedent("""
    import dataclasses, sys, torch
    from pipefold.ir import OPT
    from pipefold.runtime.launch.faults import Faults
    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.launch.settings import Reliability
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec
    cfg = RunSpec.flat(schedule="zb-h1", devices=2, microbatches=4, steps=6, model="mlp", layers=4, hidden=16,
                      batch=8, partition="even", clip=3.0)
    job = dataclasses.replace(make_job(cfg), save_weights=True, faults=Faults(nan=frozenset({3})))
    inside = job.schedule.with_actions([[*row, OPT(s)] for s, row in enumerate(job.schedule.actions)])
    out = {}
    for name, j in (("sync", job), ("post", dataclasses.replace(job, reliability=Reliability(post_validate=True))),
                    ("opt", dataclasses.replace(job, schedule=inside))):
        reports = run_local(j)
        out[name] = ({k: v for r in reports for k, v in (r.weights or {}).items()},
                     [(s.skipped, s.clipped, s.rolled_back, s.grad_norm) for s in reports[0].steps])
    torch.save(out, sys.argv[1])
""")


def test_post_validation_gives_the_weights_of_the_synchronous_check(tmp_path: Path) -> None:
    """Steps that need clipping, a step with a NaN (step 3: index 2) and plain steps: with post-validation the optimizer
    steps first and is rolled back where the check says so, and a schedule whose OPT actions step each stage
    inside the step is validated after the fact; both give the weights of checking first, bit for bit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _COMPARE, str(tmp_path / "w.pt")], capture_output=True, text=True,
                          env=env, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    out = torch.load(tmp_path / "w.pt")
    sync, steps = out["sync"]
    assert steps[2][:3] == (True, False, False) and math.isnan(steps[2][3])  # the NaN step: skipped
    clipped = [i for i, (_, c, _, _) in enumerate(steps) if c]
    assert clipped and len(clipped) < 5 and all(steps[i][3] > 3 for i in clipped)  # clipped steps and plain ones
    assert all(not r for _, _, r, _ in steps)  # checked first: nothing to undo
    for name in ("post", "opt"):
        weights, kinds = out[name]
        assert [k[:2] for k in kinds] == [k[:2] for k in steps], name
        assert [r for _, _, r, _ in kinds] == [s or c for s, c, _, _ in steps], name  # every bad or clipped undone
        assert weights.keys() == sync.keys() and sync
        for key, w in sync.items():
            assert torch.equal(w, weights[key]), (name, key)


def test_the_check_and_the_snapshot() -> None:
    """The pieces on their own: the check's sum against torch's own norm; a snapshot restores an AdamW step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model(torch.randn(5, 4)).sum().backward()
    params = list(model.parameters())
    norm, bad, mean = verdict(local_check(params, [1.0, 2.0], torch.device("cpu")))
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    assert not bad and norm == pytest.approx(expected, rel=1e-6) and mean == 1.5
    assert verdict(local_check(params, [1.0, math.inf], torch.device("cpu")))[1]
    assert clip_factor(norm, norm * 2) is None and clip_factor(norm, norm / 2) == pytest.approx(0.5, rel=1e-5)
    opt = torch.optim.AdamW(params, lr=0.1)
    opt.step()  # some state to keep
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.state[params[0]].items()}
    snap = Snapshot(params, [opt])
    opt.step()
    assert not torch.equal(params[0], before[0])
    snap.restore()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in state.items())
    params[0].grad[0, 0] = math.nan
    assert verdict(local_check(params, [], torch.device("cpu")))[1]


@pytest.mark.parametrize(("schedule", "dp"), [("chimera", 1), ("1f1b", 2), ("dualpipev", 1), ("zb-v", 2)])
def test_the_live_loss_is_the_global_loss(schedule: str, dp: int) -> None:
    """What the progress line shows each step is the mean over every microbatch of every pipeline and replica,
    the loss the run reports, not the loss of the one rank that calls back (Chimera's other direction, another
    data-parallel pipeline)."""
    from pipefold.train.run import train
    from pipefold.train.spec import RunSpec

    live: dict[int, float] = {}
    config = RunSpec.flat(schedule=schedule, devices=2, dp=dp, microbatches=4, batch=8 * dp, steps=2, model="mlp",
                         layers=4, hidden=16, partition="even")
    _, reports = train(config, on_step=lambda step, loss, _s: live.__setitem__(step, loss))
    assert sorted(live) == [1, 2]  # steps numbered from 1, as the progress line shows them
    for step in range(2):
        every = [v for r in reports for v in r.steps[step].losses.values()]
        assert len(every) == 4 * dp
        assert live[step + 1] == pytest.approx(sum(every) / len(every), rel=1e-12)
        assert all(r.steps[step].loss == live[step + 1] for r in reports)  # every rank knows it

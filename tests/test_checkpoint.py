"""Checkpoints on real ranks and real files: resume bit for bit, crashes mid-save, corrupt files, torchrun restarts,
and the saved model loaded into the plain one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipefold.cli.main import main
from pipefold.models import make_model
from pipefold.models.data import Batches, load_corpus

GPT = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "8",
       "--devices", "2", "--microbatches", "4", "--partition", "even"]
MLP = ["--model", "mlp", "--layers", "4", "--hidden", "16", "--batch", "8", "--devices", "2", "--microbatches", "4",
       "--partition", "even", "--schedule", "1f1b"]


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    code = main(["train", *argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


FAULTY = str(Path(__file__).with_name("faulty.py"))
"""Runs the command with faults injected into its job (see tests/faulty.py)."""


def _cli(cwd: Path, *argv: str, faults: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``pipefold train ARGV`` in a process of its own; ``faults``: tests/faulty.py's options."""
    command = [FAULTY, *faults, "--"] if faults else ["-m", "pipefold"]
    return subprocess.run([sys.executable, *command, "train", *argv], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240, check=False)


def _plain_gpt(seed: int = 0) -> nn.Sequential:
    return nn.Sequential(*make_model("gpt", layers=2, hidden=32, heads=2, seq=16, seed=seed).build())


def _one_process(steps: int) -> nn.Sequential:
    """The GPT of ``GPT`` trained ``steps`` steps in one process: AdamW (lr 1e-3) on the whole batch."""
    model = _plain_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = Batches(load_corpus().train, 8, 16, seed=0)
    loss_fn = make_model("gpt", layers=2, hidden=32, heads=2, seq=16).loss
    for step in range(steps):
        x, y = batches.batch_at(step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):  # the mean over the microbatches, as the ranks
            (loss_fn(model(xs), ys) / 4).backward()
        opt.step()
    return model


@pytest.mark.parametrize(("schedule", "recipe"), [("1f1b", ()), ("zb-h1", ()),
                                                  ("zb-h1", ("--dtype", "fp16", "--master-weights"))])
def test_resume_continues_bit_for_bit(capsys: pytest.CaptureFixture[str], tmp_path: Path, schedule: str,
                                      recipe: tuple[str, ...]) -> None:
    """6 steps in one run equal 3 steps then a resumed run of 3 more: every loss and every weight, bit for bit
    (fp16 with master weights too: the checkpoint keeps the float32 masters and the loss scale)."""
    whole, resumed, ckpt = tmp_path / "whole.pt", tmp_path / "resumed.pt", tmp_path / "ckpt"
    args = [*GPT, "--schedule", schedule, *recipe]
    straight = _train(capsys, *args, "--steps", "6", "--save-model", str(whole))
    first = _train(capsys, *args, "--steps", "3", "--checkpoint-dir", str(ckpt))
    assert first["checkpoints"] == [str(ckpt / "step-00000003")]
    assert (ckpt / "latest").read_text().strip() == "step-00000003"
    code = main(["train", *args, "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume", "--save-model",
                 str(resumed), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    second = json.loads(captured.out)
    assert f"resuming from {ckpt / 'step-00000003'} (3 steps done)" in captured.err
    assert second["first_step"] == 4 and second["resumed_from"] == str(ckpt / "step-00000003")
    assert first["loss"] + second["loss"] == straight["loss"]  # exactly equal floats
    a, b = torch.load(whole), torch.load(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if recipe:  # the saved model is the float32 masters; the run in fp16 is not the float32 one below
        assert all(v.dtype == torch.float32 for k, v in b.items() if "weight" in k)
        return
    # The file is the plain model's state_dict: it loads (strictly) into the one-device model, and equals that
    # model trained in one process, up to the order of float sums.
    plain = _plain_gpt()
    plain.load_state_dict(b)
    reference = _one_process(6).state_dict()
    assert plain.state_dict().keys() == reference.keys()
    for name, w in plain.state_dict().items():
        torch.testing.assert_close(w, reference[name], rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(w, _plain_gpt().state_dict()[k]) for k, w in b.items())  # it did train


def test_a_rank_that_fails_after_a_save_cannot_lose_it(tmp_path: Path) -> None:
    """The last rank dies as step 3 starts, while rank 0 commits the checkpoint of step 2 slowly (2 s): the local
    launcher stops every rank once one fails, so the ranks wait for the commit before going on (without that, the
    checkpoint stayed a .tmp folder and latest pointed at nothing)."""
    ckpt = tmp_path / "ckpt"
    crashed = _cli(tmp_path, *MLP, "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                   faults=("--die-at", "3", "--slow-commit", "2"))
    assert crashed.returncode == 1 and "pipefold train: error: rank" in crashed.stderr, crashed.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000002"]
    assert (ckpt / "latest").read_text().strip() == "step-00000002"


def test_crash_mid_save_and_corrupt_checkpoints(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    straight = _train(capsys, *MLP, "--steps", "8")["loss"]
    # The last rank dies while the checkpoint of step 4 is being saved, after writing its own files.
    crashed = _cli(tmp_path, *MLP, "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                   faults=("--die-at", "4:save"))
    assert crashed.returncode == 1 and "pipefold train: error: rank" in crashed.stderr, crashed.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000002", "step-00000004.tmp"]
    assert (ckpt / "latest").read_text().strip() == "step-00000002"
    assert not (ckpt / "step-00000004.tmp" / "manifest.json").exists()
    # Resuming takes the last good one; the interrupted save is cleaned up by the next one.
    out = _train(capsys, *MLP, "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--resume")
    assert out["first_step"] == 3 and out["loss"] == straight[2:6]  # steps 3..6 (numbered from 1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000002", "step-00000004", "step-00000006"]
    # One byte changed in a rank's file of the newest checkpoint: skipped with a warning naming it.
    data = ckpt / "step-00000006" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    # Resumed on 4 ranks with another schedule: a checkpoint names every tensor by the plain model's names, so it
    # does not depend on the split (the losses are the same up to the order of float sums).
    code = main(["train", *MLP, "--steps", "8", "--checkpoint-dir", str(tmp_path / "next"), "--resume",
                 str(ckpt), "--devices", "4", "--schedule", "zb-h1", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (f"pipefold: warning: checkpoint {ckpt / 'step-00000006'} is incomplete or corrupt (__1_0.distcp does "
            "not match its SHA-256 in the manifest): skipped") in captured.err
    out = json.loads(captured.out)
    assert out["resumed_from"] == str(ckpt / "step-00000004") and out["devices"] == 4
    assert out["loss"] == pytest.approx(straight[4:8], rel=1e-6)
    # Naming a corrupt checkpoint when no older one is good: one line, exit 2, nothing run.
    (ckpt / "step-00000004" / ".metadata").write_bytes(b"")
    shutil.rmtree(ckpt / "step-00000002")
    code = main(["train", *MLP, "--steps", "8", "--resume", str(ckpt / "step-00000006")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (f"cannot resume: checkpoint {ckpt / 'step-00000006'} is incomplete or corrupt (__1_0.distcp does not "
            "match its SHA-256 in the manifest) and no older one is good") in err


def test_checkpoint_user_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(capsys, *MLP, "--steps", "2", "--checkpoint-dir", str(ckpt))
    (tmp_path / "file").write_text("x")
    cases = [
        (["--checkpoint-every", "2"], "--checkpoint-every saves into --checkpoint-dir D"),
        (["--checkpoint-dir", str(ckpt), "--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
        (["--resume"], "--resume needs --checkpoint-dir D, or the checkpoint to start from"),
        (["--resume", str(tmp_path / "empty")], f"no checkpoint folder {tmp_path / 'empty'}"),
        (["--resume", str(tmp_path)], f"no checkpoint to resume from in {tmp_path}"),
        (["--resume", str(ckpt / "step-00000009")], f"no checkpoint {ckpt / 'step-00000009'}"),
        (["--checkpoint-dir", str(tmp_path / "file")], "is a file; give a folder"),
        (["--checkpoint-dir", str(ckpt), "--resume", "--steps", "2"], "has done 2 steps and the run has 2: nothing "
                                                                      "left to train; give --steps above 2"),
        (["--resume", str(ckpt), "--hidden", "32"], "was saved with hidden 16, this run has 32"),
        (["--resume", str(ckpt), "--optimizer", "sgd"], "was saved with optimizer adamw, this run has sgd"),
        (["--resume", str(ckpt), "--check"], "--check compares the first step"),
        (["--checkpoint-dir", str(ckpt), "--optimizer", "kfac"], "checkpoints do not save K-FAC's curvature"),
        (["--save-model", str(tmp_path / "no" / "m.pt")], "folder"),
    ]
    for argv, expected in cases:
        code = main(["train", *MLP, "--steps", "4", *argv])
        err = capsys.readouterr().err
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (argv, err)


TORCHRUN_MODULE = [sys.executable, "-m", "torch.distributed.run"]


def test_torchrun_restart_resumes_from_the_last_checkpoint(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    """torchrun --max-restarts 1: a worker dies at step 3; the restarted workers resume from the checkpoint of
    step 2 by themselves, and the run ends with the losses and weights of an uninterrupted one. Rank 0 commits
    that checkpoint slowly (2 s): the worker that dies must not get to step 3 before the commit is done (it did,
    once on a loaded machine, and torchrun stopped rank 0 mid-commit: the restart found no checkpoint of step 2)."""
    straight = _train(capsys, *MLP, "--steps", "5", "--save-model", str(tmp_path / "straight.pt"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*TORCHRUN_MODULE, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                             FAULTY, "--die-at", "3", "--slow-commit", "2", "--", "train", *MLP, "--steps", "5",
                             "--checkpoint-dir", "ckpt",
                             "--checkpoint-every", "2", "--save-model", "restarted.pt", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: nothing left behind
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    # The first attempt died after saving step 2; the restarted workers found that checkpoint by themselves.
    # torchrun names the first worker it saw fail: the one that died (exit 13), or its peer, which lost its link to
    # it and stopped (exit 1) before torchrun's next look (4 of 20 runs of this test here).
    died = "failed (exitcode: 13) local_rank: 1" in stderr
    peer = "failed (exitcode: 1) local_rank: 0" in stderr and "the link to rank 1 closed" in stderr
    assert died or peer, stderr[-3000:]
    assert f"resuming from {tmp_path / 'ckpt' / 'step-00000002'} (2 steps done)" in stderr
    assert out["first_step"] == 3 and out["loss"] == straight["loss"][2:]
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "restarted.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_keep_last_keeps_the_newest_and_resumes_from_them(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    out = _train(capsys, *MLP, "--steps", "5", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                 "--keep-last", "2")
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step-00000004", "step-00000005"]
    assert (ckpt / "latest").read_text().strip() == "step-00000005" and len(out["loss"]) == 5
    again = _train(capsys, *MLP, "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume", "--keep-last", "1")
    assert len(again["loss"]) == 1
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step-00000006"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--keep-last", "0", "--checkpoint-dir", "{tmp}/c"], "--keep-last N keeps the N newest checkpoints: N >= 1"),
    (["--keep-last", "2"], "--keep-last saves into --checkpoint-dir D"),
    (["--checkpoint-dir", "{tmp}/missing/c"], "folder {tmp}/missing does not exist"),
    (["--checkpoint-dir", "{tmp}/file"], "is a file; give a folder"),
])
def test_checkpoint_folder_rules_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str],
                                              message: str) -> None:
    (tmp_path / "file").write_text("mine")
    code = main(["train", *MLP, "--steps", "1", *(a.format(tmp=tmp_path) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2 and message.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "missing").exists() and (tmp_path / "file").read_text() == "mine"


def test_the_save_model_snippet_of_the_docs_runs_as_written(tmp_path: Path) -> None:
    """docs/runtime.md's --save-model command and its loading snippet, as written (the run shortened to one step)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "runtime.md").read_text(encoding="utf-8")
    section = text[text.index("`--save-model FILE` writes"):]
    command = section[section.index("```sh\n") + 6:].split("```")[0].strip()
    snippet = section[section.index("```python\n") + 10:].split("```")[0]
    argv = command.split()[1:]
    assert argv[0] == "train" and "--save-model" in argv
    got = _cli(tmp_path, *argv[1:], "--steps", "1")
    assert got.returncode == 0, got.stderr
    check = "\nprint(repr(sum(float(v.double().sum()) for v in model.state_dict().values())))"
    run = subprocess.run([sys.executable, "-c", snippet + check], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr  # load_state_dict is strict: every name matched, none left over
    saved = torch.load(tmp_path / "model.pt")
    assert float(run.stdout.strip()) == sum(float(v.double().sum()) for v in saved.values())

"""Checkpoints on real ranks and real files: resume bit for bit, crashes mid-save, corrupt files, torchrun restarts,
and the saved model loaded into the plain one."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import Servers
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
    assert crashed.returncode == 1, crashed.stderr
    assert ("pipefold train: error: rank 1 died (signal 9, SIGKILL) during the save of checkpoint step-00000004 "
            "(step 4)") in crashed.stderr, crashed.stderr
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
    # No good checkpoint left in the folder: one line, exit 2, nothing run.
    (ckpt / "step-00000004" / ".metadata").write_bytes(b"")
    shutil.rmtree(ckpt / "step-00000002")
    code = main(["train", *MLP, "--steps", "8", "--resume", str(ckpt)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (f"cannot resume: checkpoint {ckpt / 'step-00000006'} is incomplete or corrupt (__1_0.distcp does not "
            "match its SHA-256 in the manifest) and no older one is good") in err


def _rehash(folder: Path) -> None:
    """Rewrite the manifest's list of files from the folder's files, as someone who edits a checkpoint by hand
    and makes its sizes and SHA-256s match again would."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = {f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                         for f in sorted(folder.iterdir()) if f.name != "manifest.json"}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _edit_manifest(folder: Path, **changes: object) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    for key, value in changes.items():
        if key in manifest["identity"]:
            manifest["identity"][key] = value
        else:
            manifest[key] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _edit_state(folder: Path, **objects: object) -> None:
    """Save the checkpoint's state again, in one file, with some of its objects changed (``progress_step=3``:
    progress.step), then make the manifest's files match: a forged checkpoint whose files are as listed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state: dict[str, object] = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                                if isinstance(meta, TensorStorageMetadata) else None for key, meta in saved.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it works in one process
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
        for key, value in objects.items():
            state[key.replace("_", ".", 1)] = value
        for f in folder.iterdir():
            if f.name != "manifest.json":
                f.unlink()
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    _rehash(folder)


def _damaged(ckpt: Path, damage: str) -> None:
    """Damage the checkpoint of step 4 in ``ckpt`` (a copy of a run's folder, with step 2 and step 4) one way."""
    four, two = ckpt / "step-00000004", ckpt / "step-00000002"
    if damage == "step":
        _edit_manifest(four, step=3)
    elif damage == "data position":
        _edit_state(four, progress_step=3)
    elif damage == "world":
        _edit_manifest(four, world_size=4)
    elif damage == "model":
        _edit_manifest(four, hidden=32)
    elif damage.startswith("part of step 2"):
        shutil.copy(two / "__0_0.distcp", four / "__0_0.distcp")
        if damage.endswith("rehashed"):
            _rehash(four)
    elif damage.startswith("truncated part"):
        part = four / "__0_0.distcp"
        part.write_bytes(part.read_bytes()[:1000])
        if damage.endswith("rehashed"):
            _rehash(four)
    elif damage == "flipped byte":
        part = four / "__1_0.distcp"
        raw = bytearray(part.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        part.write_bytes(bytes(raw))
    elif damage.startswith("missing part"):
        (four / "__1_0.distcp").unlink()
        if damage.endswith("rehashed"):
            _rehash(four)
    elif damage == "renamed":
        four.rename(ckpt / "step-00000008")
    else:
        raise AssertionError(damage)


DAMAGES = {
    "step": "the manifest says step 3, the saved state step 4",
    "data position": "the manifest says step 4, the saved state step 3",
    "world": "the manifest says 4 ranks saved it, the saved state has the parts of ranks 0, 1",
    "model": "the manifest says hidden 32, the saved state 16",
    "part of step 2": "__0_0.distcp does not match its SHA-256 in the manifest",
    "part of step 2, rehashed": r"(__0_0.distcp is a part of step 2|the saved state step 2), ",
    "truncated part": r"__0_0.distcp has 1000 bytes, the manifest says \d+",
    "truncated part, rehashed": r"DCP's index reads __0_0.distcp up to byte \d+, it has 1000",
    "flipped byte": "__1_0.distcp does not match its SHA-256 in the manifest",
    "missing part": "__1_0.distcp is missing",
    "missing part, rehashed": "DCP's index reads __1_0.distcp, which the manifest does not list",
    "renamed": "the folder is named for step 8, its manifest and saved state say step 4",
}
"""Each way of damaging a checkpoint, and the reason a resume gives (a pattern)."""


def test_a_checkpoint_whose_manifest_and_state_disagree_is_skipped_or_refused(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Every fact the manifest states that the saved state holds too must agree with it, and the files must be
    those it lists: a checkpoint that fails is skipped with one warning naming it and why (the newest good one
    before it is used), refused in one line when named, and left as it was. One saved run, copied for each damage;
    the first one is resumed for real (the report's case: an edited step no longer runs from the wrong step)."""
    from pipefold.errors import ConfigError
    from pipefold.runtime.launch import checkpoint

    base = tmp_path / "base"
    straight = _train(capsys, *MLP, "--steps", "4", "--checkpoint-dir", str(base), "--checkpoint-every", "2")["loss"]
    assert sorted(p.name for p in base.iterdir()) == ["latest", "step-00000002", "step-00000004"]
    assert checkpoint.problem(base / "step-00000002") is None and checkpoint.problem(base / "step-00000004") is None
    for damage, reason in DAMAGES.items():
        ckpt = tmp_path / damage.replace(" ", "-").replace(",", "")
        shutil.copytree(base, ckpt)
        _damaged(ckpt, damage)
        before = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
        warned: list[str] = []
        found = checkpoint.find(str(ckpt), warn_skipped=warned.append)
        bad = ckpt / ("step-00000008" if damage == "renamed" else "step-00000004")
        assert found is not None and found.path == str(ckpt / "step-00000002") and found.step == 2, damage
        assert len(warned) == 1 and re.fullmatch(
            rf"checkpoint {re.escape(str(bad))} is incomplete or corrupt \({reason}.*\): skipped", warned[0]), \
            (damage, warned)
        with pytest.raises(ConfigError, match=rf"^cannot resume from checkpoint {re.escape(str(bad))}: it is "
                                               rf"incomplete or corrupt \({reason}"):
            checkpoint.find(str(bad))
        assert {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before, damage
    # The report's case through the command: the edited checkpoint of step 4 is skipped, the run goes on from step
    # 2 (step 3 next, the same losses as a run never stopped); saving step 4 again sets the damaged one aside.
    ckpt = tmp_path / "step"
    code = main(["train", *MLP, "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--resume",
                 "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    skipped = [line for line in captured.err.splitlines() if line.endswith("skipped")]
    assert skipped == [f"pipefold: warning: checkpoint {ckpt / 'step-00000004'} is incomplete or corrupt (the "
                       "manifest says step 3, the saved state step 4): skipped"], captured.err
    assert f"resuming from {ckpt / 'step-00000002'} (2 steps done)" in captured.err
    out = json.loads(captured.out)
    assert out["first_step"] == 3 and out["loss"] == straight[2:4]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000002", "step-00000004",
                                                       "step-00000004.damaged"]
    assert json.loads((ckpt / "step-00000004.damaged" / "manifest.json").read_text())["step"] == 3
    assert checkpoint.problem(ckpt / "step-00000004") is None
    # Named, a damaged checkpoint is refused in one line before any rank starts.
    named = tmp_path / "world" / "step-00000004"
    code = main(["train", *MLP, "--steps", "6", "--resume", str(named)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        f"pipefold train: error: cannot resume from checkpoint {named}: it is incomplete or corrupt (the manifest "
        f"says 4 ranks saved it, the saved state has the parts of ranks 0, 1); give another checkpoint, or its "
        f"folder {named.parent} for the newest good one"], err


def test_checkpoint_user_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(capsys, *MLP, "--steps", "2", "--checkpoint-dir", str(ckpt))
    (tmp_path / "file").write_text("x")
    cases = [
        (["--checkpoint-every", "2"], "--checkpoint-every saves into --checkpoint-dir D"),
        (["--checkpoint-dir", str(ckpt), "--checkpoint-every", "0"], "--checkpoint-every: 0 is out of range"),
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
    (["--keep-last", "0", "--checkpoint-dir", "{tmp}/c"], "--keep-last: 0 is out of range: give a whole number >= 1"),
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


def test_the_save_model_snippet_of_the_docs_runs_as_written(tmp_path: Path, servers: Servers) -> None:
    """docs/checkpoints.md's --save-model command and its loading snippet, as written (the run shortened to one
    step). The command runs as the pages' commands do, in the worker's command server (conftest.Server); the snippet
    in a fresh interpreter, as a program of its own."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "checkpoints.md").read_text(encoding="utf-8")
    section = text[text.index("`--save-model FILE` writes"):]
    command = section[section.index("```sh\n") + 6:].split("```")[0].strip()
    snippet = section[section.index("```python\n") + 10:].split("```")[0]
    argv = command.split()[1:]
    assert argv[0] == "train" and "--save-model" in argv
    got = servers.get().run([*argv, "--steps", "1"], tmp_path)
    assert got.returncode == 0, got.stderr
    check = "\nprint(repr(sum(float(v.double().sum()) for v in model.state_dict().values())))"
    run = subprocess.run([sys.executable, "-c", snippet + check], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr  # load_state_dict is strict: every name matched, none left over
    saved = torch.load(tmp_path / "model.pt")
    assert float(run.stdout.strip()) == sum(float(v.double().sum()) for v in saved.values())

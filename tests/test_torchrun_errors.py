"""Under a real torchrun, an error that ends the job is said once: pipefold's part of the output is one line (the
rank to blame says it, or the first worker where every worker meets the error), and torchrun's summary shows
that line as the root cause, from the worker's error file, instead of a link to torch's documentation."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))
TINY = ["train", "--layers", "2", "--hidden", "16", "--batch", "4", "-m", "2", "--devices", "2", "--schedule", "1f1b",
        "--steps", "4"]
RAISING = """\
import os, sys
from pipefold.runtime import stage
from pipefold.runtime.launch.torchrun import torchrun_activity

forward = stage.StageRunner.forward

def raising(self, *args, **kwargs):  # rank 1's forwards of step 2 (not those that prepare the job)
    if os.environ["RANK"] == "1" and torchrun_activity().step == 2:
        raise ValueError("boom in a stage")
    return forward(self, *args, **kwargs)

stage.StageRunner.forward = raising
sys.argv = ["pipefold", *sys.argv[1:]]
from pipefold.cli.main import entry
entry()
"""


@pytest.mark.skipif(TORCHRUN is None, reason="torch.distributed.run (torchrun) is not installed")
def test_one_line_says_why_a_torchrun_job_failed(tmp_path: Path) -> None:
    assert TORCHRUN is not None
    (tmp_path / "raising.py").write_text(RAISING, encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cases = {  # (torchrun's script and arguments, the line pipefold says)
        "a rank raises": ([str(tmp_path / "raising.py"), *TINY],
                          r"pipefold train: error: rank 1 failed in 1F0 of step 2: ValueError: boom in a stage"),
        "every worker": (["-m", "pipefold", *TINY, "--data", str(tmp_path / "missing.txt")],
                         r"pipefold train: error: cannot read --data file '.*missing.txt': No such file or directory"),
    }
    runs = {name: subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node", "2", *argv], env=env,
                                   cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
            for name, (argv, _) in cases.items()}  # at once: each waits mostly for its imports
    for name, proc in runs.items():
        err = proc.communicate(timeout=240)[1]
        assert proc.returncode == 1, (name, err)
        ours = [line for line in err.splitlines() if re.match(r"pipefold( \w+)?: ", line)]  # not "pipefold FAILED"
        assert len(ours) == 1 and re.fullmatch(cases[name][1], ours[0]), (name, err)
        # torchrun's summary (after its own traceback): the root cause is the worker that said it, with its line
        root = err[err.index("Root Cause (first observed failure):"):]
        assert f"traceback : {ours[0]}" in root, (name, err)

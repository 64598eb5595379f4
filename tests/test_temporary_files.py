"""A run of ``pipefold train`` leaves nothing in the temporary folder, however it ends: done, Ctrl-C, a rank that
fails, or its launcher killed (``kill -9``, where the fork server and the ranks clean up after it). Nothing: not
the ranks' folder, not multiprocessing's ``pymp-*`` folder with the fork server's socket, not torch's
``torchinductor_<user>``; and no warning of leaked semaphores, nor any traceback, on stderr.

Each case runs the command in a session of its own with a private ``TMPDIR``; its stderr closes only once every
process that holds it (the launcher, the fork server, the ranks, multiprocessing's resource tracker) has ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux signals; the server finds its "
                                                                              "children in /proc")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--hidden", "16", "--batch", "4", "-m", "2", "--devices", "2", "--schedule", "1f1b"]


def _start(tmp: Path, argv: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp, start_new_session=True)


def _after_first_step(proc: subprocess.Popen[str], then: object) -> str:
    """Read stderr until the first step is done, then send ``then`` (a signal to the launcher, or to its process
    group where it is negative); the rest of stderr, up to its end."""
    assert proc.stderr is not None
    seen = []
    deadline = time.time() + 120
    while not (line := proc.stderr.readline()).startswith("step "):
        assert line and time.time() < deadline, "".join(seen)
        seen.append(line)
    assert isinstance(then, int)
    if then < 0:
        os.killpg(proc.pid, -then)
    else:
        os.kill(proc.pid, then)
    return "".join(seen) + line + proc.stderr.read()


def test_nothing_is_left_in_the_temporary_folder(tmp_path: Path) -> None:
    # A socket's path has at most 107 bytes, and the fork server's and the ranks' sockets are made in the command's
    # folder: in a temporary folder with a long path ("long", over 100 bytes here) the command makes it in /tmp.
    cases = {
        "long" + "x" * 60: ["-m", "pipefold", "train", *TINY, "--steps", "2", "--p2p", "sockets"],
        "done": ["-m", "pipefold", "train", *TINY, "--steps", "2"],
        "ctrlc": ["-m", "pipefold", "train", *TINY, "--steps", "1000000"],
        "fails": [str(ROOT / "tests" / "faulty.py"), "--die-at", "2", "--", "train", *TINY, "--steps", "4"],
        "kill9": ["-m", "pipefold", "train", *TINY, "--steps", "1000000"],
    }
    ends = {"long" + "x" * 60: (0, None), "done": (0, None),
            "ctrlc": (130, "pipefold train: interrupted (SIGINT); stopped 2 ranks"),
            "fails": (1, "pipefold train: error: rank 1 died (exit code 13)"), "kill9": (-9, None)}
    started = {}
    for name, argv in cases.items():  # at once: each waits mostly for its imports
        tmp = tmp_path / name
        tmp.mkdir()
        started[name] = (tmp, _start(tmp, argv))
    for name, (tmp, proc) in started.items():
        if name == "ctrlc":
            err = _after_first_step(proc, -signal.SIGINT)  # as a terminal sends it: to every process of the group
        elif name == "kill9":
            err = _after_first_step(proc, signal.SIGKILL)  # to the launcher alone
        else:
            err = proc.communicate(timeout=180)[1]
        code, says = ends[name]
        assert proc.wait(60) == code, (name, err)
        lines = [line for line in err.splitlines() if not line.startswith("step ")]  # no traceback, no warning:
        assert (lines == [] if says is None else len(lines) == 1 and lines[0].startswith(says)), (name, err)
        assert sorted(p.name for p in tmp.iterdir()) == [], name

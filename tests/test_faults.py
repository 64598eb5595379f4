"""Faults on real processes: a rank killed, stopped, raising or computing forever; SIGINT and SIGTERM to the
launcher; under torchrun a stopped worker and a killed agent.

``pipefold train`` runs as a subprocess in a session of its own, its stderr on a pseudo-terminal (so that its
progress bar shows when the steps have started, as a user would see it), its temporary files under the test's
own directory (TMPDIR). The ranks are found by the names they give themselves (``pipefold-rank1`` in
``/proc/PID/comm``), and the verdicts are checked against what the test itself did: which rank it killed or
stopped, which signal it sent, and the processes that are left.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipefold import build
from pipefold.runtime.launch.job import Job, RankError
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.launch.processes import free_port
from pipefold.runtime.launch.settings import Optimizer, Reliability
from pipefold.runtime.watch import PERIOD

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses Linux signals")

SMALL = ["--schedule", "1f1b", "--model", "mlp", "--layers", "6", "--hidden", "32", "--batch", "8", "-m", "2",
         "--partition", "even", "--steps", "1000000"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the name (state, ppid, pgrp, session, ...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except OSError:
        return None


def _running_in_session(sid: int) -> dict[int, str]:
    """Every process of the session that still runs (a zombie has ended), by pid, with its name."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None and int(fields[3]) == sid \
                and fields[0] != "Z":
            with contextlib.suppress(OSError):
                out[int(entry)] = Path(f"/proc/{entry}/comm").read_text().strip()
    return out


class _Train:
    """``python -m pipefold ARGV`` in a session of its own, stderr on a pseudo-terminal that a thread reads."""

    def __init__(self, tmp_path: Path, argv: list[str], launcher: list[str] | None = None) -> None:
        master, slave = pty.openpty()
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), COLUMNS="200",
                   PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        self.tmp = tmp_path
        cmd = (launcher or [sys.executable]) + ["-m", "pipefold", "train", *argv]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                                     env=env, cwd=tmp_path, start_new_session=True)
        os.close(slave)
        self._master = master
        self._text: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # the other end closed
                return
            if not data:
                return
            self._text.append(data.decode(errors="replace"))

    @property
    def stderr(self) -> str:
        return ANSI.sub("\n", "".join(self._text))

    def wait_for(self, pattern: str, timeout: float = 150.0) -> None:
        deadline = time.time() + timeout
        while not re.search(pattern, self.stderr):
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                pytest.fail(f"never saw {pattern!r}; stderr: {self.stderr[-2000:]}")
            time.sleep(0.1)

    def ranks(self, count: int, timeout: float = 60.0) -> dict[int, int]:
        """Rank -> pid of the processes named ``pipefold-rank<N>`` in the session."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            named = {int(name[len("pipefold-rank"):]): pid for pid, name in _running_in_session(self.proc.pid).items()
                     if name.startswith("pipefold-rank") and name[len("pipefold-rank"):].isdigit()}
            if len(named) == count:
                return named
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"expected {count} ranks in the session, found {_running_in_session(self.proc.pid)}")

    def finish(self, timeout: float = 60.0) -> tuple[int, float]:
        """(exit code, seconds it took from now)."""
        start = time.time()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running after {timeout} s; stderr: {self.stderr[-2000:]}")
        took = time.time() - start
        self._reader.join(5)
        os.close(self._master)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code, took

    def messages(self) -> list[str]:
        """The lines of stderr that say something (not the progress bar's pieces)."""
        return [line.strip() for line in self.stderr.splitlines()
                if re.search(r"^\s*pipefold|Traceback|Error|Warning|warn", line)]

    def leftovers(self, timeout: float = 10.0) -> dict[int, str]:
        """Processes of the session still running ``timeout`` s after the launcher ended (none expected)."""
        deadline = time.time() + timeout
        while (left := _running_in_session(self.proc.pid)) and time.time() < deadline:
            time.sleep(0.1)
        return left

    def kill(self) -> None:
        for pid in _running_in_session(self.proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _one_error(run: _Train) -> str:
    lines = run.messages()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    return lines[0]


def test_a_rank_killed_mid_step_is_named(tmp_path: Path) -> None:
    """kill -9 of the middle rank of three (both neighbours wait for it): it is the one named, with the signal."""
    run = _Train(tmp_path, [*SMALL, "--devices", "3"])
    run.wait_for("samples/s")
    ranks = run.ranks(3)
    os.kill(ranks[1], signal.SIGKILL)
    code, took = run.finish()
    line = _one_error(run)
    assert code == 1 and took < 30, (code, took)
    assert re.fullmatch(r"pipefold train: error: rank 1 died \(signal 9, SIGKILL\) during \S+.*", line), line
    assert not run.leftovers()
    assert not list(tmp_path.glob("pipefold-*"))


def test_a_stopped_rank_is_named_not_its_peers(tmp_path: Path) -> None:
    """SIGSTOP of the middle rank: its neighbours wait for it, the launcher sees that its heartbeat stopped and
    names it, within the action timeout (3 s here) and far within 30 s."""
    run = _Train(tmp_path, [*SMALL, "--devices", "3", "--action-timeout", "3"])
    run.wait_for("samples/s")
    ranks = run.ranks(3)
    os.kill(ranks[1], signal.SIGSTOP)
    stopped = time.time()
    code, _ = run.finish()
    took = time.time() - stopped
    line = _one_error(run)
    # Silence is counted from the rank's last heartbeat, a few periods (PERIOD, 0.1 s) before the SIGSTOP at most:
    # not blamed early, and blamed well within 30 s.
    assert code == 1 and 3 - 5 * PERIOD <= took < 30, (code, took)
    assert re.match(r"pipefold train: error: rank 1 hung in \S+.*: its process is stopped", line), line
    assert "ranks 0, 2 wait for it" in line or "rank 0 waits for it" in line or "rank 2 waits for it" in line, line
    assert not run.leftovers()  # the stopped rank too: it gets SIGKILL
    assert not list(tmp_path.glob("pipefold-*"))


@pytest.mark.parametrize(("sig", "whole_group", "code"), [(signal.SIGINT, False, 130), (signal.SIGTERM, False, 143),
                                                          (signal.SIGINT, True, 130)],
                         ids=["sigint", "sigterm", "ctrl-c"])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path: Path, sig: signal.Signals, whole_group: bool,
                                                   code: int) -> None:
    """SIGINT or SIGTERM to the launcher alone, or SIGINT to the whole process group (Ctrl-C in a terminal): one
    line, the shell's exit code, no process left, no temporary directory left."""
    run = _Train(tmp_path, [*SMALL, "--devices", "2"])
    run.wait_for("samples/s")
    run.ranks(2)
    (os.killpg if whole_group else os.kill)(run.proc.pid, sig)
    got, took = run.finish()
    line = _one_error(run)
    assert got == code and took < 30, (got, took)
    assert line == f"pipefold train: interrupted ({sig.name}); stopped 2 ranks", line
    assert not run.leftovers()
    assert not list(tmp_path.glob("pipefold-*"))


class _Sleeps(torch.nn.Linear):
    """Computes forever from the second step on (a layer stuck in a loop, not a stopped process)."""

    calls = 0

    def __init__(self) -> None:
        super().__init__(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Sleeps.calls += 1
        if _Sleeps.calls > 2:  # two microbatches a step
            while True:
                time.sleep(0.05)
        return super().forward(x)


def _layers_with_a_sleeper(indices: list[int]) -> dict[int, torch.nn.Module]:
    return {i: (_Sleeps() if i == 1 else torch.nn.Linear(4, 4)) for i in indices}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)


def test_a_rank_computing_forever_is_named() -> None:
    """A rank alive (its heartbeat goes on) but stuck in its forward: the per-action timeout names it and the
    action, not the ranks that wait for it."""
    job = Job(schedule=build("1f1b", 3, 2), layer_stages=((0,), (1,), (2,)), build_layers=_layers_with_a_sleeper,
              loss_fn=torch.nn.functional.mse_loss, batch_at=_batch, steps=3, optimizer=Optimizer(name="sgd"),
              reliability=Reliability(action_timeout=2.0))
    with pytest.raises(RankError, match=r"^rank 1 hung in 1F0 of step 2: running for \d+ s, longer than the action "
                                        r"timeout of 2 s \(--action-timeout\)$") as err:
        run_local(job)
    assert err.value.rank == 1


TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


def _torchrun(tmp_path: Path, argv: list[str]) -> _Train:
    assert TORCHRUN is not None
    return _Train(tmp_path, argv, launcher=[TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port())])


def _workers(agent: _Train, timeout: float = 150.0) -> dict[int, int]:
    """Rank -> pid of torchrun's workers (each in a session of its own), once both have joined the group."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (fields := _stat(int(entry))) is not None and int(fields[1]) == agent.proc.pid:
                try:
                    name = Path(f"/proc/{entry}/comm").read_text().strip()
                except OSError:
                    continue
                if name.startswith("pipefold-rank") and name[len("pipefold-rank"):].isdigit():
                    found[int(name[len("pipefold-rank"):])] = int(entry)
        if len(found) == 2:
            return found
        time.sleep(0.1)
    agent.kill()
    pytest.fail(f"torchrun's workers never joined; stderr: {agent.stderr[-2000:]}")


def _gone(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still running after up to ``timeout`` s (killed then, so that none outlives the test)."""
    deadline = time.time() + timeout
    while (alive := [p for p in pids if (f := _stat(p)) is not None and f[0] != "Z"]) and time.time() < deadline:
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


@pytest.mark.skipif(TORCHRUN is None, reason="torch.distributed.run (torchrun) is not installed")
def test_torchrun_a_stopped_worker_is_named(tmp_path: Path) -> None:
    """Under torchrun the waiting worker's watch reads the store, sees the stopped worker's heartbeat stand
    still, prints the one line naming it, kills it and exits; torchrun's agent then ends the job."""
    run = _torchrun(tmp_path, [*SMALL, "--devices", "2", "--action-timeout", "3"])
    workers = _workers(run)
    time.sleep(4)  # most likely in the steps by now (a stop before them is found the same way)
    os.kill(workers[1], signal.SIGSTOP)
    stopped = time.time()
    code, _ = run.finish(timeout=90)
    took = time.time() - stopped
    ours = [line for line in run.stderr.splitlines() if line.startswith("pipefold:")]
    assert code != 0 and took < 30, (code, took, run.stderr[-2000:])
    assert len(ours) == 1 and re.match(r"pipefold: error: rank 1 hung in .+: its process is stopped", ours[0]), ours
    assert not _gone(list(workers.values()), 10)


@pytest.mark.skipif(TORCHRUN is None, reason="torch.distributed.run (torchrun) is not installed")
def test_torchrun_workers_end_with_their_agent(tmp_path: Path) -> None:
    """kill -9 of torchrun's agent: its workers (in sessions of their own) do not train on."""
    run = _torchrun(tmp_path, [*SMALL, "--devices", "2"])
    workers = _workers(run)
    time.sleep(2)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.finish(timeout=10)
    assert not _gone(list(workers.values()), 5)


def test_compiling_in_the_first_step_is_not_a_hang(capsys: pytest.CaptureFixture[str]) -> None:
    """torch.compile compiles each layer inside its first passes, for longer than a 0.3 s action timeout: the
    first step gets the compile grace (runtime.watch.COMPILE_GRACE), and the run ends well."""
    from pipefold.cli.main import main

    code = main(["train", "--model", "mlp", "--layers", "4", "--hidden", "32", "--batch", "8", "-m", "2",
                 "--devices", "2", "--schedule", "zb-v", "--steps", "2", "--compile", "--compile-backend",
                 "aot_eager", "--action-timeout", "0.3", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "hung" not in captured.err

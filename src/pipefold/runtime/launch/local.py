"""Ranks on this machine: one process per device from the fork server, and the parent that supervises them.

Any rank that raises, dies or hangs ends the job (:class:`~pipefold.runtime.launch.job.RankError`, one line naming the
rank and what it was doing): each rank publishes what it is doing (:mod:`pipefold.runtime.watch`), the parent
watches them all and decides which rank is to blame, then stops the others. SIGINT and SIGTERM to the parent stop
every rank (:class:`~pipefold.errors.Interrupted`).
"""


from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipefold.errors import Interrupted
from pipefold.runtime import sockets
from pipefold.runtime.launch.job import Job, RankError, RankReport, placement, raise_if_stopped
from pipefold.runtime.launch.processes import process_context, starting, store_in
from pipefold.runtime.launch.rank import run_rank
from pipefold.runtime.launch.torchrun import leave_group
from pipefold.runtime.watch import (
    PERIOD,
    Activity,
    Heartbeat,
    SharedBoard,
    Snapshot,
    exit_when_closed,
    find_hang,
    frozen_local,
    name_process,
    pg_timeout,
    process_state,
)


def _spawned(rank: int, job: Job, world: int, out_dir: str, progress: Any, board: SharedBoard,
             launcher: Any) -> None:
    """One local rank. The steps it completes go to ``progress`` (its own pipe to the launcher), what it is doing
    to ``board``; an exception that ends it, to ``error-RANK.json`` in ``out_dir`` (then it exits at once, with
    code 1: the launcher decides what to say). ``launcher`` is the end of a pipe that closes when the launcher
    dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the terminal: the launcher stops us
    exit_when_closed(launcher)
    name_process(f"pipefold-rank{rank}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    activity = Activity(rank)
    heartbeat = Heartbeat(activity, board).start()
    others = tuple(r for r in range(world) if r != rank)
    try:
        if job.netns is not None:
            from pipefold.runtime.launch.netns import enter

            enter(job.netns, rank)  # before any socket: the group's connections then cross the namespaces' links
        torch.set_num_threads(1)
        activity.wait("start-up", "the process group", others, action=False)
        where = placement(job)
        if where.device == "cuda":
            torch.cuda.set_device(where.device_of(rank))
        dist.init_process_group(where.backend, init_method=store_in(out_dir), rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout(job.reliability.action_timeout,
                                                                     compiling=job.devices.compiling)))
        if job.sockets:
            activity.wait("start-up", "its links to the other ranks", others, action=False)
        with sockets.linked(out_dir) if job.sockets else contextlib.nullcontext():
            run_rank(job, rank, world, out_dir, on_step=lambda *a: progress.send(a), activity=activity)
            activity.wait("the end of the job", "every rank to finish", others, action=False)
            dist.barrier()
        activity.finish()
        heartbeat.beat()
        leave_group()
    except BaseException as exc:  # noqa: BLE001 (reported to the launcher, which names the rank to blame)
        if (peer := sockets.lost_peer(exc)) is not None:  # a send or receive found the peer gone: its failure
            activity.ended_by(peer, "its link")
        with contextlib.suppress(Exception):  # unwritable: the launcher reports an exit with code 1 instead
            _write_failure(Path(out_dir) / f"error-{rank}.json", exc, activity)
        os._exit(1)
    heartbeat.stop()


def _write_failure(path: Path, exc: BaseException, activity: Activity) -> None:
    details = "".join(traceback.format_exception(exc))
    line = f"{type(exc).__name__}: {exc}".strip().splitlines()
    record = {"line": line[0] if line else type(exc).__name__, "details": details, "time": time.time(),
              "snapshot": activity.snapshot(0).to_json().decode()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)  # the launcher reads a whole file or none


def run_local(job: Job, on_step: Callable[[int, float, float], None] | None = None) -> list[RankReport]:
    """Spawn one process per device on this machine, run the job, and collect every rank's report.

    ``on_step(number, loss, seconds)`` is called in this process as the steps complete (:func:`run_rank`). A
    rank that raises, dies or hangs (an action longer than ``job.reliability.action_timeout``) stops the others:
    :class:`RankError` names it and what it was doing. SIGINT or SIGTERM (from the main thread's point of view)
    stops every rank and raises :class:`Interrupted`; the ranks' temporary files are removed either way.
    """
    world = job.world
    with _Signals():
        return _run_spawned(job, world, on_step)


class _Signals:
    """While entered (in the main thread): SIGINT and SIGTERM raise :class:`Interrupted`, once. While the ranks
    start (:func:`~pipefold.runtime.launch.processes.starting`) a signal waits until they are all known and can be
    stopped."""

    def __init__(self) -> None:
        self.raised = False
        self._before: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            self._before = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._before.items():
            signal.signal(sig, old)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.raised:
            return  # a second signal while the ranks are being stopped changes nothing
        self.raised = True
        raise Interrupted(signum)


def _run_spawned(job: Job, world: int, on_step: Callable[[int, float, float], None] | None) -> list[RankReport]:
    ctx = process_context(job.preload)
    # Pipes, not a queue: a queue's locks are named semaphores, which a launcher killed (kill -9) would leave to
    # multiprocessing's resource tracker to remove, with a warning.
    steps = [ctx.Pipe(duplex=False) for _ in range(world)]  # a rank's steps, to this process
    board = SharedBoard(ctx, world)
    lifeline, mine = ctx.Pipe(duplex=False)  # the ranks get the reading end; only this process holds the other
    with tempfile.TemporaryDirectory(prefix="ranks-") as out_dir, mine:
        ranks: list[Any] = []
        try:
            with starting():  # a signal now would leave a rank half started, unknown to us
                for rank in range(world):
                    proc = ctx.Process(target=_spawned, args=(rank, job, world, out_dir, steps[rank][1], board,
                                                              lifeline), name=f"pipefold-rank-{rank}")
                    proc.start()
                    ranks.append(proc)
                lifeline.close()
                for _, sending in steps:
                    sending.close()  # the rank's alone: its pipe ends with it
            _supervise(job, ranks, [reading for reading, _ in steps], board, Path(out_dir), on_step)
        except Interrupted as exc:
            raise Interrupted(exc.signum, _stop(ranks)) from None
        finally:
            _stop(ranks)
        reports = []
        for rank in range(world):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as fh:
                reports.append(pickle.load(fh))
    raise_if_stopped(reports)
    return reports


def _supervise(job: Job, ranks: list[Any], steps: list[Any], board: SharedBoard, out_dir: Path,
               on_step: Callable[[int, float, float], None] | None) -> None:
    """Wait for every rank to finish, passing on the steps they report (``steps``: each rank's pipe); raise
    :class:`RankError` as soon as one fails or the job hangs."""
    from multiprocessing.connection import wait

    started = time.time()
    exited: dict[int, float] = {}  # rank -> when it was seen gone
    open_steps = list(steps)

    def drain() -> None:
        for conn in list(open_steps):
            try:
                while conn.poll():
                    step = conn.recv()
                    if on_step is not None:
                        on_step(*step)
            except (EOFError, OSError):  # the rank has ended, and all it sent is read
                open_steps.remove(conn)

    while True:
        alive = [p.sentinel for p in ranks if p.exitcode is None]
        if alive:
            wait(alive + open_steps, timeout=PERIOD)
        drain()
        now = time.time()
        for rank, p in enumerate(ranks):
            if p.exitcode is not None:
                exited.setdefault(rank, now)
        if all(p.exitcode == 0 for p in ranks):
            drain()
            return
        if any(p.exitcode not in (None, 0) for p in ranks):
            raise _failure(ranks, board, out_dir, exited)
        hang = _hang(ranks, board, started, job.reliability.action_timeout)
        if hang is not None:
            raise hang


def _hang(ranks: list[Any], board: SharedBoard, started: float, timeout: float) -> RankError | None:
    """The job's hang, if it is hung (see :func:`pipefold.runtime.watch.find_hang`)."""
    now = time.time()
    snaps = {r: board.read(r) for r in range(len(ranks))}
    ages = {r: now - (s.since if s is not None else started) for r, s in snaps.items()}
    frozen = {}
    for r, s in snaps.items():
        silent = now - (s.beat if s is not None else started)
        if ranks[r].exitcode is None and (why := frozen_local(ranks[r].pid, s, silent, ages[r], timeout)):
            frozen[r] = why
    hang = find_hang(snaps, ages, frozen, timeout)
    return None if hang is None else RankError(hang.rank, hang.line)


def _failure(ranks: list[Any], board: SharedBoard, out_dir: Path, exited: dict[int, float]) -> RankError:
    """The rank to blame once one has ended badly: one that died or raised while computing before one that raised
    while waiting for a peer (its peer's failure reached it), the earliest first."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + 1.0  # the others' own failures, if they come at once, tell who came first
    while (alive := [p.sentinel for p in ranks if p.exitcode is None]) and time.monotonic() < deadline:
        wait(alive, timeout=deadline - time.monotonic())
    now = time.time()
    causes: list[tuple[int, float, int, str, str]] = []  # (waiting, when, rank, line, details)
    for rank, p in enumerate(ranks):
        if p.exitcode in (None, 0):
            continue
        path = out_dir / f"error-{rank}.json"
        if path.exists():
            record = json.loads(path.read_text(encoding="utf-8"))
            snap = Snapshot.from_json(record["snapshot"].encode())
            peers = [r for r in snap.waits if r != rank]
            waiting = f" (waiting for {snap.what} from rank {peers[0]})" if len(peers) == 1 else ""
            causes.append((int(bool(snap.waits)), record["time"], rank,
                           f"rank {rank} failed in {snap.at()}{waiting}: {record['line']}", record["details"]))
        else:
            code = p.exitcode
            how = f"signal {-code}, {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            last = board.read(rank)
            at = last.at() if last is not None else "start-up"
            causes.append((0, exited.get(rank, now), rank, f"rank {rank} died ({how}) during {at}", ""))
    _, _, rank, line, details = min(causes)
    return RankError(rank, line, details)


def _stop(ranks: list[Any]) -> int:
    """Stop every rank still running (SIGTERM, SIGKILL to a stopped one or one that lingers); how many there were."""
    running = [p for p in ranks if p.exitcode is None]
    for p in running:
        if process_state(p.pid) in ("T", "t"):
            p.kill()  # a stopped process takes no SIGTERM until it runs again
        else:
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in running:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
    return len(running)

"""A rank started by torchrun: join the process group torchrun describes (a restarted attempt under a prefix of
its own in the agent's store), watch it with a heartbeat in the job's store, run the rank, gather the reports on
rank 0, leave."""


from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipefold._gc import freeze
from pipefold.errors import ConfigError, Interrupted, say
from pipefold.runtime import sockets
from pipefold.runtime.launch.elastic import settle, write_error_file
from pipefold.runtime.launch.job import Diverged, Job, RankError, RankReport, local_placement, raise_if_stopped
from pipefold.runtime.launch.processes import torchrun_on_one_machine
from pipefold.runtime.launch.rank import run_rank
from pipefold.runtime.watch import (
    DEFAULT_ACTION_TIMEOUT,
    Activity,
    Heartbeat,
    StoreBoard,
    die_with_parent,
    find_hang,
    limit,
    name_process,
    pg_timeout,
    why_silent,
)


class _TorchrunWatch:
    """A torchrun rank's watch: its heartbeat thread publishes what the rank does to the job's store and checks
    the rank's own progress. When the rank has waited longer than the action timeout, it reads every rank's
    publications twice, :data:`LOOK` seconds apart (a count that did not move is a rank that stopped), and if
    the job is hung, the first rank to see it prints the line; every rank that sees it exits (torchrun's agent
    then stops the rest), and a stopped rank to blame on this machine is killed."""

    LOOK = 3.0

    def __init__(self, rank: int, world: int, timeout: float) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.activity = Activity(rank)
        self.board = StoreBoard(dist.distributed_c10d._get_default_store())
        self._not_before = 0.0
        self.heartbeat = Heartbeat(self.activity, self.board, period=0.25, check=self.check).start()

    def check(self) -> None:
        mine = self.activity.snapshot(self.heartbeat.seq)
        if mine.done or mine.age <= limit(mine, self.timeout) or time.monotonic() < self._not_before:
            return
        if not mine.waits:
            hang = find_hang({self.rank: mine}, {self.rank: mine.age}, {}, self.timeout)
        else:
            first = {r: self.board.read(r) for r in range(self.world)}
            time.sleep(self.LOOK)
            snaps = {r: self.board.read(r) for r in range(self.world)}
            snaps[self.rank] = self.activity.snapshot(self.heartbeat.seq)
            frozen = {}
            for r, s in snaps.items():
                before = first[r]
                if r != self.rank and (s is None or (not s.done and before is not None and before.seq == s.seq)):
                    local = s is not None and s.host == socket.gethostname()
                    frozen[r] = (why_silent(s.pid, time.time() - s.beat) if local and s is not None
                                 else f"no heartbeat for over {self.LOOK:g} s")
            ages = {r: s.age if s is not None else self.timeout for r, s in snaps.items()}
            hang = find_hang(snaps, ages, frozen, self.timeout)
            if hang is not None and hang.rank in frozen:
                s = snaps[hang.rank]
                if s is not None and s.host == socket.gethostname():
                    with contextlib.suppress(OSError):
                        os.kill(s.pid, signal.SIGKILL)  # stopped: torchrun's SIGTERM would wait for it 30 s
        if hang is None:
            self._not_before = time.monotonic() + 2.0  # a deadline: the host's clock, never stepped
            return
        says = True
        with contextlib.suppress(Exception):
            says = self.board.first_to_abort()
        write_error_file(f"pipefold: error: {hang.line}", later=not says)
        if says:
            say(f"pipefold: error: {hang.line}")
        os._exit(1)


_WATCH: _TorchrunWatch | None = None


def join_torchrun_group(action_timeout_s: float = DEFAULT_ACTION_TIMEOUT, device: str = "auto",
                        backend: str = "auto", *, compiling: bool = False) -> tuple[int, int]:
    """Join the process group torchrun set up for this process (once), with the timeout that goes with the action
    timeout (:func:`pipefold.runtime.watch.pg_timeout`) and the backend that ``device`` and ``backend`` give on
    this node (:func:`pipefold.runtime.launch.devices.place`), and start the rank's watch; return (rank, world size).

    The process also ends if torchrun's agent dies (the kernel's parent-death signal, on Linux)."""
    global _WATCH
    if not dist.is_initialized():
        # What the process has imported and built by now lives as long as it does: frozen, the cyclic collector
        # leaves it alone (as in the fork server the local ranks come from), so the full collection before the
        # group is destroyed walks what the run made, not torch's modules.
        freeze()
        where = local_placement(device, backend, 1)
        if where.device == "cuda":
            torch.cuda.set_device(where.device_of(int(os.environ.get("LOCAL_RANK", "0"))))
        die_with_parent()
        timeout = timedelta(seconds=pg_timeout(action_timeout_s, compiling=compiling))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt not in ("", "0") and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Restarted workers meet in the agent's store, the same one as the failed attempt's: under a prefix of
            # their own, or a rank could read a dead peer's address left there (gloo: "connection refused").
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                                  timeout=timeout)
            dist.init_process_group(where.backend, store=dist.PrefixStore(f"pipefold/attempt-{attempt}", store),
                                    rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(where.backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if _WATCH is None or _WATCH.world != world or _WATCH.rank != rank:
        _WATCH = _TorchrunWatch(rank, world, action_timeout_s)
        name_process(f"pipefold-rank{rank}")
    _WATCH.timeout = action_timeout_s
    return rank, world


def torchrun_activity() -> Activity:
    """What this torchrun rank is doing, as its watch publishes it (after :func:`join_torchrun_group`)."""
    assert _WATCH is not None, "join_torchrun_group() first"
    return _WATCH.activity


def run_torchrun(job: Job, on_step: Callable[[int, float, float], None] | None = None) -> list[RankReport] | None:
    """Run this process's rank of ``job`` as torchrun started it; rank 0 gets every rank's report, others None.

    torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the world must
    have one process per device of the schedule, tensor-parallel rank and data-parallel pipeline, on one machine or
    several.
    An exception ends the rank with :class:`RankError` (one line: the rank, what it was doing, the error), told at
    once by the rank that the job's store chooses (:func:`_says`), as an interrupt is; a loss that diverged, with
    :class:`Diverged`, as every rank sees it.
    """
    rank, world = join_torchrun_group(job.reliability.action_timeout, job.devices.device, job.devices.backend,
                                      compiling=job.devices.compiling)
    activity = torchrun_activity()
    try:
        if world != job.world:
            need = job.world
            what = (f" with {job.parallel.tp_text} tensor-parallel ranks each" if isinstance(job.parallel.tp, tuple)
                    else f" x {job.parallel.tp} tensor-parallel ranks" if job.parallel.tp > 1 else "")
            what += f" x {job.parallel.dp} data-parallel pipelines" if job.parallel.dp > 1 else ""
            raise ConfigError(f"torchrun started {world} processes but {job.schedule.name} runs on "
                              f"{job.schedule.devices} devices{what}; set --nproc-per-node and --nnodes for {need} "
                              "in all")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        try:
            with sockets.linked() if job.sockets and torchrun_on_one_machine() else contextlib.nullcontext():
                try:
                    report = run_rank(job, rank, world, None, on_step, activity=activity)
                except (ConfigError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # told before the links close: the peers' failures come from this one
                    raise _failed(rank, activity, exc) from None
            activity.wait("the end of the job", "every rank's report", [r for r in range(world) if r != rank],
                          action=False)
            gathered: list[Any] = [None] * world if rank == 0 else []
            dist.gather_object(report, gathered if rank == 0 else None, dst=0)
            activity.finish()
            raise_if_stopped(gathered if rank == 0 else [report])  # every rank stopped at the same step
        except KeyboardInterrupt as exc:
            if isinstance(exc, Interrupted):  # Ctrl-C, or torchrun's agent stopping this worker
                settle(str(exc), speaks=_says(own=False), own=False)
            raise
        except (ConfigError, Diverged, RankError):
            raise
        except Exception as exc:
            raise _failed(rank, activity, exc) from None
        return gathered if rank == 0 else None
    finally:
        leave_group()


def _failed(rank: int, activity: Activity, exc: Exception) -> RankError:
    """The :class:`RankError` of ``exc``, which ended this rank, told now (said where :func:`_says` chooses this
    rank): its line names what the rank was doing."""
    if (peer := sockets.lost_peer(exc)) is not None:  # the peer's failure reached this rank
        activity.ended_by(peer, "its link")
    snap = activity.snapshot(0)
    peers = [r for r in snap.waits if r != rank]
    waiting = f" (waiting for {snap.what} from rank {peers[0]})" if len(peers) == 1 else ""
    line = f"{type(exc).__name__}: {exc}".strip().splitlines()
    error = RankError(rank, f"rank {rank} failed in {snap.at()}{waiting}: {line[0]}",
                      "".join(traceback.format_exception(exc)))
    own = not snap.waits  # it raised while computing; a rank that waited, or lost its link, met a peer's failure
    settle(f"error: {error}", speaks=_says(own), own=own)
    return error


def _says(own: bool) -> bool:
    """Whether this rank says its failure, through counters in the job's store: the first rank whose failure is
    its own (it raised while computing, waiting for nobody) says it; a rank whose failure came from a peer (it
    waited for one, or lost its link) says it only where no rank has claimed a failure of its own yet and it is
    the first to ask (the rank to blame may have died without a word). Every rank says it where the store cannot
    be reached."""
    if _WATCH is None:
        return True
    try:
        if own:
            return int(_WATCH.board.store.add(_OWN, 1)) == 1
        return int(_WATCH.board.store.add(_OWN, 0)) == 0 and _WATCH.board.first_to_abort()
    except Exception:  # noqa: BLE001 (the store's server gone with the job: say it rather than say nothing)
        return True


_OWN = "pipefold/failed-own"
"""The key of the store that counts the ranks that failed of their own."""


def leave_group() -> None:
    """Destroy the process group, if any, once nothing holds its work handles any more (spawned or torchrun);
    under torchrun the watch's heartbeat thread, which talks to the job's store, is stopped first."""
    global _WATCH
    if _WATCH is not None:
        _WATCH.heartbeat.stop()
        _WATCH = None
    if dist.is_initialized():
        gc.collect()  # drop work handles still held in a cycle, or the group's threads abort the exit
        dist.destroy_process_group()

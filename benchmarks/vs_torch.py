"""Time pipefold's runtime against torch.distributed.pipelining on the same MLP, schedule by schedule.

Both sides train the ``mlp`` model (H=512, 8 layers, batch 64 in 8 microbatches)
on 2 local gloo processes with one thread each, from the same weights and data,
with SGD. pipefold runs twice: its ranks' messages over this machine's sockets
(``--p2p auto``, what ``pipefold train`` does here) and over gloo (``--p2p gloo``,
the transport torch's side uses). A step's time is the longest of the ranks' times for that step: for
pipefold the executor's ``wall`` (the schedule's actions, from the first to the
last send waited on), for torch one ``schedule.step(...)`` call. Neither
includes the optimizer step. The first step (torch infers shapes in it) is
reported apart and left out of the median. With ``--runs N`` the three run one
after another for each schedule, N times over, and each ratio is given per run. Run:

    python benchmarks/vs_torch.py            # 10 steps per run, about a minute on 2 cores
    python benchmarks/vs_torch.py --quick    # 4 steps per run
    python benchmarks/vs_torch.py --json     # one JSON object
    python benchmarks/vs_torch.py --runs 4   # four interleaved runs: the spread of each ratio
    python benchmarks/vs_torch.py --device cuda --hidden 4096   # on a GPU the ranks share (gloo on both sides)

On a GPU, both runtimes' ranks share it over gloo (NCCL refuses two ranks on one device, gloo moves only CPU
tensors): pipefold stages its messages through pinned host memory (:mod:`pipefold.runtime.launch.devices`), and
torch's side is given the same through host copies around its point-to-point calls (``_through_host``). A run
that fails is reported with its one-line reason.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from pipefold.errors import run_script
from pipefold.ir.ref import ScheduleRef
from pipefold.models import split_layers
from pipefold.models.mlp import MLPConfig, build_mlp_layers, mlp_input, mlp_loss, mlp_target
from pipefold.runtime.launch.job import RankError
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.launch.processes import process_context, rendezvous
from pipefold.train.prepare import make_job
from pipefold.train.spec import RunSpec

WORLD, HIDDEN, LAYERS, BATCH, MICROBATCHES, SEED = 2, 512, 8, 64, 8, 0
DEVICE = "cpu"  # --device; set in main() before any rank starts (spawned ranks get it as an argument)
RUN_TIMEOUT_S = 120.0  # one torch run; a hung schedule is reported as failed, not waited on forever


@dataclass(frozen=True)
class _Pair:
    """One schedule under both runtimes: pipefold's name and options, torch's class and stage placement."""

    label: str
    pipefold: str
    options: tuple[tuple[str, int], ...]
    torch_class: str
    placement: str
    """'single' (stage r on rank r), 'loop' (r, r+p) or 'v' (r, 2p-1-r)."""


PAIRS = [
    _Pair("gpipe", "gpipe", (), "ScheduleGPipe", "single"),
    _Pair("1f1b", "1f1b", (), "Schedule1F1B", "single"),
    _Pair("interleaved-1f1b v=2", "interleaved-1f1b", (("v", 2),), "ScheduleInterleaved1F1B", "loop"),
    _Pair("zb-v", "zb-v", (), "ScheduleZBVZeroBubble", "v"),
]


@dataclass
class _Run:
    """One runtime's times for one schedule, or why it failed."""

    steps_s: list[float] = field(default_factory=list)
    """Per step, the longest rank's time."""
    first_loss: float | None = None
    error: str | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.steps_s[1:]) if len(self.steps_s) > 1 else None

    def to_json(self) -> dict[str, Any]:
        ms = [round(1e3 * t, 3) for t in self.steps_s]
        median = None if self.median_s is None else round(1e3 * self.median_s, 3)
        return {"median_ms": median, "first_ms": ms[0] if ms else None, "steps_ms": ms,
                "first_loss": self.first_loss, "error": self.error}


# -- pipefold


def _run_pipefold(pair: _Pair, steps: int, p2p: str, profile: str | None = None) -> _Run:
    """pipefold's run of ``pair``; ``profile`` (a folder): each rank's steps after the first under cProfile
    (``Job.extra["host_profile"]``)."""
    config = RunSpec.flat(p2p=p2p, schedule=str(ScheduleRef(pair.pipefold, pair.options)), devices=WORLD,
                          microbatches=MICROBATCHES,
                         steps=steps, model="mlp", layers=LAYERS, hidden=HIDDEN, batch=BATCH, optimizer="sgd",
                         seed=SEED, partition="even",  # the same equal stages torch.distributed.pipelining gets
                         device=DEVICE, backend="gloo")
    try:
        job = make_job(config, local=config.local)
        if profile is not None:
            job = dataclasses.replace(job, extra={**job.extra, "host_profile": profile})
        reports = run_local(job)
    except (RankError, RuntimeError, ValueError) as exc:
        return _Run(error=_one_line(exc))
    walls = [max(r.steps.wall[i] for r in reports) for i in range(steps)]
    first_loss = sum(sum(r.steps[0].losses.values()) for r in reports) / MICROBATCHES
    return _Run(walls, first_loss)


# -- torch.distributed.pipelining


def _stage_indices(placement: str, rank: int) -> list[int]:
    if placement == "single":
        return [rank]
    if placement == "loop":
        return [rank, rank + WORLD]
    return [rank, 2 * WORLD - 1 - rank]  # 'v': down the devices, then back up


def _torch_schedule(pair: _Pair, rank: int, sizes: tuple[int, int, int, int],
                    device: torch.device) -> tuple[Any, list[int], list[torch.nn.Module]]:
    """Build this rank's stages (same layers, same weights as pipefold's) and the schedule over them."""
    from torch.distributed import pipelining

    HIDDEN, LAYERS, _, MICROBATCHES = sizes  # noqa: N806 (the spawned rank's copy of the module's sizes)
    cfg = MLPConfig(hidden=HIDDEN, layers=LAYERS)
    indices = _stage_indices(pair.placement, rank)
    num_stages = WORLD * (1 if pair.placement == "single" else 2)
    split = split_layers(cfg.num_layers, num_stages)
    modules: list[torch.nn.Module] = []
    stages = []
    for s in indices:
        layers = build_mlp_layers(cfg, split[s], seed=SEED)
        module = torch.nn.Sequential(*(layers[i] for i in split[s])).to(device)
        modules.append(module)
        stages.append(pipelining.PipelineStage(module, s, num_stages, device))
    cls = getattr(pipelining, pair.torch_class)
    if pair.placement == "single":
        return cls(stages[0], n_microbatches=MICROBATCHES, loss_fn=mlp_loss), indices, modules
    return cls(stages, n_microbatches=MICROBATCHES, loss_fn=mlp_loss), indices, modules


def _torch_rank(rank: int, pair: _Pair, steps: int, init: str, results: Any, sizes: tuple[int, int, int, int],
                where: str, profile: str | None) -> None:
    """One spawned rank: train ``steps`` steps, put (rank, per-step seconds, losses of step 0) on ``results``.
    With ``profile`` (a folder) the ``schedule.step`` calls after the first run under cProfile, written to
    ``rankN.prof`` there."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    HIDDEN, LAYERS, BATCH, MICROBATCHES = sizes  # noqa: N806
    device = torch.device(where)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        _through_host()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        schedule, indices, modules = _torch_schedule(pair, rank, sizes, device)
        params = [p for m in modules for p in m.parameters()]
        opt = torch.optim.SGD(params, lr=RunSpec().optimizer.lr)
        cfg = MLPConfig(hidden=HIDDEN, layers=LAYERS)
        target = mlp_target(cfg, BATCH, SEED).to(device)
        first, last = 0 in indices, WORLD * len(indices) - 1 in indices
        walls, first_losses = [], []
        profiler = cProfile.Profile() if profile else None
        for step in range(steps):
            x = mlp_input(cfg, BATCH, SEED + step).to(device)  # the batch pipefold's mlp job gives this step
            losses: list[torch.Tensor] = []
            sync()
            if profiler is not None and step > 0:
                profiler.enable()
            t0 = time.perf_counter()
            schedule.step(*((x,) if first else ()), target=target if last else None,
                          losses=losses if last else None)
            sync()
            if profiler is not None:
                profiler.disable()
            walls.append(time.perf_counter() - t0)
            if step == 0:
                first_losses = [float(v.detach()) for v in losses]
            opt.step()
            opt.zero_grad(set_to_none=True)
        if profiler is not None:
            profiler.dump_stats(os.path.join(str(profile), f"rank{rank}.prof"))
        results.put((rank, walls, first_losses))
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _Landing:
    """A receive into pinned host memory: waiting for it copies the message into the GPU tensor."""

    def __init__(self, work: Any, host: torch.Tensor, tensor: torch.Tensor) -> None:
        self.work, self.host, self.tensor = work, host, tensor

    def wait(self, *args: Any) -> bool:
        done = self.work.wait(*args)
        with torch.no_grad():  # a stage's input buffer is a leaf that requires grad; irecv would fill it too
            self.tensor.copy_(self.host, non_blocking=True)  # ordered on the stream that reads it next
        return done

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def _through_host() -> None:
    """gloo sends and receives only CPU tensors (a GPU tensor's address handed to it fails with "Bad address"),
    and NCCL refuses two ranks on one GPU. So on a GPU the ranks share, torch's side gets what pipefold's does
    (:mod:`pipefold.runtime.launch.devices`): its point-to-point operations on GPU tensors go through pinned host
    copies, a send's made when its schedule posts it, a receive's copied in when its schedule waits for it."""
    from torch.distributed import distributed_c10d as c10d

    isend, irecv = c10d.isend, c10d.irecv

    def staged_isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not tensor.is_cuda:
            return isend(tensor, *args, **kwargs)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)  # synchronous: the message is whole before gloo reads it
        return isend(host, *args, **kwargs)

    def staged_irecv(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not tensor.is_cuda:
            return irecv(tensor, *args, **kwargs)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return _Landing(irecv(host, *args, **kwargs), host, tensor)

    # batch_isend_irecv tells sends from receives by ``op is isend`` against its module's own names.
    c10d.isend, c10d.irecv = staged_isend, staged_irecv
    dist.isend, dist.irecv = staged_isend, staged_irecv


def _run_torch(pair: _Pair, steps: int, profile: str | None = None) -> _Run:
    """Start the ranks (from pipefold's fork server, which has imported torch: the same start-up pipefold's ranks
    get; neither is timed); any rank's exception or a hang becomes a failed run with a one-line reason. ``profile``:
    see :func:`_torch_rank`."""
    with rendezvous() as init:
        return _torch_ranks(pair, steps, profile, init)


def _torch_ranks(pair: _Pair, steps: int, profile: str | None, init: str) -> _Run:
    ctx = process_context()
    results = ctx.SimpleQueue()
    sizes = (HIDDEN, LAYERS, BATCH, MICROBATCHES)
    where = "cuda:0" if DEVICE == "cuda" else "cpu"
    context = mp.start_processes(_torch_rank, args=(pair, steps, init, results, sizes, where, profile),
                                 nprocs=WORLD, join=False, start_method=ctx.get_start_method())
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not context.join(timeout=0.2):
            if time.monotonic() > deadline:
                _terminate(context)
                return _Run(error=f"timed out after {RUN_TIMEOUT_S:.0f} s")
    except mp.ProcessRaisedException as exc:
        return _Run(error=_last_line(exc.msg))
    except mp.ProcessExitedException as exc:
        return _Run(error=f"rank {exc.error_index} exited with code {exc.exit_code}")
    per_rank = {}
    while not results.empty():
        rank, walls, losses = results.get()
        per_rank[rank] = (walls, losses)
    walls = [max(per_rank[r][0][i] for r in range(WORLD)) for i in range(steps)]
    losses = [v for r in range(WORLD) for v in per_rank[r][1]]
    return _Run(walls, sum(losses) / MICROBATCHES if losses else None)


def _terminate(context: Any) -> None:
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join(5)



def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def _one_line(exc: BaseException) -> str:
    return _last_line(str(exc)) or type(exc).__name__


# -- report


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _ratio(ours: _Run, theirs: _Run) -> float | None:
    if ours.median_s is None or theirs.median_s is None:
        return None
    return ours.median_s / theirs.median_s


def _notes(pair: _Pair, sides: dict[str, _Run]) -> list[str]:
    """Failures, and a check that every side computed the same first-step loss as torch."""
    notes = [f"{pair.label}: {side} failed: {run.error}" for side, run in sides.items() if run.error]
    b = sides["torch"].first_loss
    for side, run in sides.items():
        a = run.first_loss
        if a is not None and b is not None and abs(a - b) > 1e-4 * abs(b):
            notes.append(f"{pair.label}: step-1 losses differ: {side} {a:.6f} vs torch {b:.6f}")
    return notes


_SIDES = ("pipefold", "pipefold on gloo", "torch")
_Row = tuple[_Pair, list[dict[str, _Run]]]
"""A schedule and, per run, each side's run."""


def _median_ms(runs: list[dict[str, _Run]], side: str) -> str:
    medians = [m for run in runs if (m := run[side].median_s) is not None]
    return "failed" if not medians else f"{1e3 * statistics.median(medians):.1f}"


def _ratios(runs: list[dict[str, _Run]], side: str) -> str:
    values = [r for run in runs if (r := _ratio(run[side], run["torch"])) is not None]
    return " ".join(f"{v:.2f}" for v in values) or "-"


def _table(rows: list[_Row], steps: int) -> Table:
    table = Table(title=f"step time (ms), median over steps 2..{steps} (over runs: the median); ratio > 1: pipefold "
                        "slower, one per run", title_justify="left")
    for name in ["schedule", *_SIDES, "pipefold/torch", "on gloo/torch", "1st pipefold", "1st torch"]:
        table.add_column(name, justify="left" if name == "schedule" else "right")
    for pair, runs in rows:
        first = runs[0]
        table.add_row(pair.label, *(_median_ms(runs, side) for side in _SIDES), _ratios(runs, "pipefold"),
                      _ratios(runs, "pipefold on gloo"),
                      *(_ms(first[side].steps_s[0] if first[side].steps_s else None) for side in ("pipefold", "torch")))
    return table


def _json(rows: list[_Row], steps: int, seconds: float, load: tuple[float, float, float]) -> dict[str, Any]:
    def ratio(run: dict[str, _Run], side: str) -> float | None:
        return None if (r := _ratio(run[side], run["torch"])) is None else round(r, 3)

    return {
        "torch_version": torch.__version__, "cpus": os.cpu_count(), "backend": "gloo", "device": DEVICE,
        "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else None, "world": WORLD, "steps": steps,
        "model": {"name": "mlp", "hidden": HIDDEN, "layers": LAYERS, "batch": BATCH, "microbatches": MICROBATCHES},
        "seconds": round(seconds, 1), "load_average": [round(v, 2) for v in load],
        "schedules": [{"schedule": pair.pipefold, "options": dict(pair.options), "torch_class": pair.torch_class,
                       "runs": [{"pipefold": run["pipefold"].to_json(),
                                 "pipefold_gloo": run["pipefold on gloo"].to_json(), "torch": run["torch"].to_json(),
                                 "notes": _notes(pair, run), "ratio": ratio(run, "pipefold"),
                                 "ratio_gloo": ratio(run, "pipefold on gloo")} for run in runs]}
                      for pair, runs in rows],
    }


def main() -> None:
    global DEVICE, HIDDEN, LAYERS, BATCH, MICROBATCHES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per run, the first one excluded (default 10)")
    parser.add_argument("--quick", action="store_true", help="4 steps per run")
    parser.add_argument("--runs", type=int, default=1, help="runs of every side and schedule, interleaved (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both runtimes' ranks compute")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    parser.add_argument("--schedules", nargs="+", default=[p.label for p in PAIRS], metavar="LABEL",
                        help="which pairs to run (default all)")
    args = parser.parse_args()
    DEVICE, HIDDEN, LAYERS, BATCH, MICROBATCHES = args.device, args.hidden, args.layers, args.batch, args.microbatches
    unknown = sorted(set(args.schedules) - {p.label for p in PAIRS})
    if unknown:
        parser.error(f"unknown schedule {unknown[0]!r}: choose from {', '.join(p.label for p in PAIRS)}")
    steps = 4 if args.quick else args.steps
    if steps < 2:
        parser.error(f"--steps must be at least 2 so a step is left after the first ({steps} < 2)")
    if args.runs < 1:
        parser.error(f"--runs must be at least 1 (got {args.runs})")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every spawned rank
    torch.set_num_threads(1)
    console = Console(stderr=args.json)
    if not console.is_terminal:
        console.width = 140  # piped into a file or a doc: do not wrap the table at 80 columns
    started = time.perf_counter()
    pairs = [p for p in PAIRS if p.label in args.schedules]
    rows: list[_Row] = [(pair, []) for pair in pairs]
    for number in range(args.runs):
        for pair, runs in rows:  # the three back to back: drift hits them all
            console.print(f"[dim]run {number + 1}/{args.runs}, {pair.label}: pipefold, on gloo, torch ...[/dim]")
            runs.append({"pipefold": _run_pipefold(pair, steps, "auto"),
                         "pipefold on gloo": _run_pipefold(pair, steps, "gloo"), "torch": _run_torch(pair, steps)})
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps(_json(rows, steps, seconds, os.getloadavg())))
        return
    report(console, rows, steps, seconds)


def report(console: Console, rows: list[_Row], steps: int, seconds: float) -> None:
    """The table, each failure's or mismatch's note, the machine's line."""
    console.print(_table(rows, steps))
    for note in (n for pair, runs in rows for run in runs for n in _notes(pair, run)):
        console.print(note, markup=False)  # a failure's text (gloo's "[enforce fail at /pytorch/...]") is not markup
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    console.print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load}, {seconds:.0f} s in all")


if __name__ == "__main__":
    run_script(main)

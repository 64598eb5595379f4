"""Start the ranks of a pipeline: locally by spawning one process per device, or under torchrun.

A job is described by a :class:`Job`: the schedule, a model given as a flat
list of layers that each rank builds only in part, the data, and the
optimizer. :func:`run_local` spawns ``schedule.devices`` processes on this
machine (gloo on CPU, NCCL with CUDA); :func:`run_rank` is what each process
runs, and is also the entry point under torchrun, which sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

An exception on any rank ends the job: the spawning parent terminates the
other ranks and re-raises the original error with the rank that raised it.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule
from pipefold.runtime.executor import RankExecutor, StepStats
from pipefold.runtime.numerics import Snapshot, clip_factor, local_check, scale_grads, verdict
from pipefold.runtime.stage import Chain

if TYPE_CHECKING:
    from pipefold.kfac import KFACConfig
    from pipefold.network import Network
    from pipefold.offload import Offloaded
    from pipefold.pipefisher import Filled, Refill
    from pipefold.runtime.checkpoint import Checkpointing
    from pipefold.runtime.netns import Topology


class RankError(RuntimeError):
    """A rank raised: ``str()`` is one line naming the rank and the original error; ``details`` its traceback."""

    def __init__(self, rank: int, details: str) -> None:
        lines = [line for line in details.strip().splitlines() if line.strip()]
        super().__init__(f"rank {rank} failed: {lines[-1].strip() if lines else 'unknown error'}")
        self.rank = rank
        self.details = details


class Diverged(RuntimeError):
    """The run stopped early: its loss or gradients were NaN or inf in ``Job.max_bad_steps`` steps in a row.
    ``str()`` is one line; ``reports`` holds what the ranks reported (``RankReport.stopped`` says the same)."""

    def __init__(self, message: str, reports: list[RankReport]) -> None:
        super().__init__(message)
        self.reports = reports


def _momentum_sgd(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW,
                                                               "kfac": _momentum_sgd}
"""The optimizers a Job names as text, each made with the Job's learning rate. ``kfac`` is SGD with momentum 0.9
on the gradient that the schedule's K-FAC actions precondition (``Job.kfac``)."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything a rank needs to build its part of the model and train it."""

    schedule: Schedule
    layer_stages: tuple[tuple[int, ...], ...]
    """For each stage, the indices of the model's layers it runs (contiguous)."""
    build_layers: Callable[[list[int]], dict[int, nn.Module]]
    """Builds only the given layers, with the same weights whichever rank builds them."""
    loss_fn: Callable[..., torch.Tensor]
    batch_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    """The whole batch (inputs, targets) of a step; every rank gets the same one."""
    steps: int = 1
    lr: float = 1e-3
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] = "adamw"
    """"adamw", "sgd", or any function that makes a torch.optim optimizer from a rank's parameters."""
    clip: float | None = None
    save_grads_of_step: int | None = None
    """Save each rank's parameter gradients after this step (for --check), before the optimizer runs."""
    save_weights: bool = False
    """Send back every parameter after the last step (``RankReport.weights``)."""
    offload: tuple[int, int] | None = None
    """(k, k'): every stage keeps at most k of its layers on the device (see pipefold.offload)."""
    recompute: tuple[int, ...] | None = None
    """For each stage, how many of its first layers recompute their activations in backward."""
    timeout_s: float = 30.0
    log_messages: bool = False
    verify_memory_step: int | None = None
    """Measure this step's memory a second way too, with torch's own tracker (see ``_tracked_step``)."""
    """Record every send and receive in each step's stats, in the order posted (to check the wire order)."""
    network: Network | None = None
    """Emulated link conditions every send crosses (see :mod:`pipefold.runtime.comm`)."""
    origin: float | None = None
    """Wall-clock time (``time.time()``) at which the network's timeline starts; None: when the ranks start."""
    adaptive: Adaptive | None = None
    """Switch schedules between steps (``schedule`` must be ``adaptive.schedules[0]``)."""
    netns: Topology | None = None
    """Run each rank in its own network namespace of this topology (see :mod:`pipefold.runtime.netns`)."""
    cycle: tuple[Schedule, ...] = ()
    """Step t runs ``cycle[t % len(cycle)]`` (K-FAC's work spread over steps, :mod:`pipefold.pipefisher`);
    ``schedule`` must be ``cycle[0]``."""
    zero1: bool = False
    """With ``dp`` > 1: shard the optimizer state across the copies of each stage (ZeRO-1, torch's
    ``ZeroRedundancyOptimizer``)."""
    dp: int = 1
    """Data-parallel copies of the whole pipeline: ranks dp x devices, rank r is device r % devices of pipeline
    r // devices; each pipeline runs its shard of every step's batch, and its ``DP`` actions average each
    stage's gradients across the pipelines (the schedule must have them: :mod:`pipefold.dataparallel`)."""
    kfac: KFACConfig | None = None
    """Keep K-FAC's state per stage and run the schedule's KA, KG, KI and KP actions (``optimizer="kfac"``)."""
    refill: Refill | None = None
    """After ``refill.after`` steps, rank 0 places K-FAC's work again from the times the ranks measured (steps
    after the first) and every rank runs the new cycle from the next step on (recorded in rank 0's
    ``RankReport.decisions`` as (first step, its :class:`~pipefold.pipefisher.Filled`))."""
    checkpoint: Checkpointing | None = None
    """Save checkpoints as the run goes, and/or start from one (see :mod:`pipefold.runtime.checkpoint`)."""
    save_model: str | None = None
    """After the last step, rank 0 writes the whole model's ``state_dict`` here (``torch.save``, named as the plain
    model ``nn.Sequential(*layers)`` names it; an absolute path: the ranks may run elsewhere)."""
    post_validate: bool = False
    """Step the optimizer before the global NaN/inf and norm check completes, rolling the step back when it
    fails (Zero Bubble's post-validation, :mod:`pipefold.runtime.numerics`)."""
    max_bad_steps: int = 3
    """Stop the run after this many steps in a row whose loss or gradients were NaN or inf (each skipped)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Checked here, in the launcher, so that a bad value is one line before any rank starts.
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1 (got {self.steps})")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ConfigError(f"the learning rate must be a finite number >= 0 (got {self.lr})")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"clip is the largest global gradient norm (--clip): a number > 0 (got {self.clip})")
        if not (isinstance(self.max_bad_steps, int) and self.max_bad_steps >= 1):
            raise ConfigError(f"the run stops after K bad steps in a row (--max-bad-steps K): K must be an integer "
                              f">= 1 (got {self.max_bad_steps!r})")
        if self.checkpoint is not None:
            if self.kfac is not None:
                raise ConfigError("checkpoints do not save K-FAC's curvature and its placement yet: train "
                                  "--optimizer kfac without --checkpoint-dir and --resume")
            resume = self.checkpoint.resume
            if resume is not None and resume.step >= self.steps:
                raise ConfigError(f"checkpoint {resume.path} has done {resume.step} steps and the run has "
                                  f"{self.steps}: nothing left to train; give --steps above {resume.step}")
        if not callable(self.optimizer) and self.optimizer not in OPTIMIZERS:
            names = list(OPTIMIZERS)
            raise ConfigError(f"unknown optimizer {self.optimizer!r}: use {', '.join(names[:-1])} or {names[-1]}, "
                              "or pass a function that makes one from a list of parameters")
        if self.adaptive is not None and self.adaptive.schedules[0] != self.schedule:
            raise ConfigError("an adaptive job starts with its first schedule: give schedule=adaptive.schedules[0]")
        if self.cycle and (self.cycle[0] != self.schedule or self.adaptive is not None):
            raise ConfigError("a job with a cycle of schedules starts with its first (schedule=cycle[0]) and does not "
                              "adapt")
        if not (isinstance(self.dp, int) and self.dp >= 1):
            raise ConfigError(f"dp is the number of data-parallel pipelines: an integer >= 1 (got {self.dp!r})")
        if self.dp > 1:
            if (missing := _without(self.schedule, Kind.DP)) is not None:
                d, st = missing
                raise ConfigError(f"with {self.dp} data-parallel pipelines every stage all-reduces its gradients, "
                                  f"but {self.schedule.name} has no {st}DP on device {d}: add them with "
                                  "pipefold.dataparallel.with_data_parallel")
            unsupported = [what for what, on in (("adaptive schedules", self.adaptive is not None),
                                                 ("K-FAC", self.kfac is not None),
                                                 ("replicated stages (Chimera, DualPipe)", self.schedule.replicas > 1),
                                                 ("emulated networks", self.network is not None),
                                                 ("network namespaces", self.netns is not None),
                                                 ("offloading", self.offload is not None)) if on]
            if unsupported:
                raise ConfigError(f"data-parallel pipelines (dp={self.dp}) do not run with {unsupported[0]} yet: "
                                  "use dp=1 for them")
        elif any(a.kind == Kind.DP for row in self.schedule.actions for a in row):
            raise ConfigError(f"{self.schedule.name} all-reduces across data-parallel pipelines (DP actions) but the "
                              "job has one pipeline: give dp > 1 or a schedule without DP")
        in_schedule = any(a.kind == Kind.OPT for row in self.schedule.actions for a in row)
        if self.zero1 and (self.dp < 2 or callable(self.optimizer) or self.optimizer == "kfac" or in_schedule):
            raise ConfigError("ZeRO-1 shards the optimizer state across data-parallel pipelines: it needs dp >= 2, "
                              "the adamw or sgd optimizer and a schedule without OPT actions")
        if self.refill is not None and not (self.cycle and self.kfac is not None):
            raise ConfigError("refilling places K-FAC's work again: it needs a K-FAC job with a cycle")
        if (self.kfac is not None) != (self.optimizer == "kfac"):
            raise ConfigError("K-FAC needs both its state (kfac=KFACConfig()) and its optimizer (optimizer='kfac'): "
                              "give both or neither")
        if self.kfac is not None:
            for each in self.cycle or (self.schedule,):
                if (missing := _without(each, Kind.KP)) is not None:
                    d, st = missing
                    raise ConfigError(f"K-FAC preconditions every stage every step, but {each.name} has no {st}KP "
                                      f"on device {d}: fill the schedule with pipefold.pipefisher (fill or inline)")
            if self.offload is not None or self.recompute is not None:
                raise ConfigError("K-FAC does not combine with offloading or recomputation yet: it keeps layer inputs "
                                  "that those would drop; use one or the other")
        if in_schedule:
            if (missing := _without(self.schedule, Kind.OPT)) is not None:
                d, s = missing
                raise ConfigError(f"the schedule steps some stages' optimizers itself (OPT actions) but not stage "
                                  f"{s} on device {d}: give every stage its {s}OPT, or none")
            if self.offload is not None:
                raise ConfigError("offloading steps the optimizer after the whole step: use a schedule without OPT "
                                  "actions with --offload")


def _without(schedule: Schedule, kind: str) -> tuple[int, int] | None:
    """The first (device, stage it holds) with no action of ``kind`` for that stage, or None."""
    have = {(d, a.stage) for d, row in enumerate(schedule.actions) for a in row if a.kind == kind}
    held = {(d, s) for d in range(schedule.devices) for s in schedule.stages_of(d)}
    return min(held - have) if held - have else None


@dataclass
class RankReport:
    """What one rank sends back to the launcher."""

    rank: int
    steps: list[StepStats]
    grads: dict[str, torch.Tensor] | None
    peak_process_bytes: int
    resident_param_bytes: int = 0
    """With offloading: the sum over this rank's stages of their peak resident parameter bytes."""
    weights: dict[str, torch.Tensor] | None = None
    """With ``Job.save_weights``: this rank's parameters after the last step, named as ``grads``."""
    static_bytes: int = 0
    """Bytes of this rank's parameters, their gradients and its optimizers' state after the last step, each
    storage counted once (offloaded layers' homes included): what it holds besides the step's activations."""
    decisions: list[tuple[int, Any]] = field(default_factory=list)
    """On rank 0 of an adaptive job: (the first step it applies to, what ``Adaptive.decide`` recorded)."""
    pipeline: int = 0
    """Which data-parallel pipeline the rank belongs to (``rank`` is its process-group rank)."""
    first_step: int = 0
    """The step the run started at: ``steps[i]`` is step ``first_step + i`` (> 0 when resumed)."""
    resumed_from: str | None = None
    """The checkpoint the run started from."""
    skipped: list[int] = field(default_factory=list)
    """Steps skipped because their loss or gradients were NaN or inf (weights and optimizer state untouched)."""
    stopped: str | None = None
    """Why the run stopped early (too many bad steps in a row), or None when it ran every step."""
    checkpoints: list[str] = field(default_factory=list)
    """The checkpoints saved, in order (on every rank)."""

    @property
    def device(self) -> int:
        """The rank's device in its pipeline."""
        return self.steps[0].rank if self.steps else self.rank


def _spec(schedule: Schedule) -> str:
    """'kfkb:k=2', '1f1b': the schedule's name and options, as the command line writes them."""
    opts = ",".join(f"{k}={v}" for k, v in sorted(schedule.options.items()))
    return f"{schedule.name}:{opts}" if opts else schedule.name


@dataclass(frozen=True)
class Adaptive:
    r"""Switch between schedules of the same stages at step boundaries, as a policy chooses.

    Every ``every`` steps each rank ``summarize``\ s its last steps (its ``StepStats`` and the bytes of its
    parameters, gradients and optimizer state) into something small and picklable; rank 0 gets them all
    and ``decide(current index, summaries)`` returns (next index, its predicted step seconds or None, a
    record for the report); every rank then runs ``schedules[index]`` from the next step on.
    """

    schedules: tuple[Schedule, ...]
    every: int
    summarize: Callable[[list[StepStats], int], Any]
    decide: Callable[[int, list[Any]], tuple[int, float | None, Any]]

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"adapt every N steps with N >= 1 (got {self.every})")
        first = self.schedules[0]
        for s in self.schedules:
            if (s.devices, s.stages, s.microbatches, s.placement) != (first.devices, first.stages,
                                                                       first.microbatches, first.placement):
                raise ConfigError(f"adaptive schedules must share devices, stages, microbatches and placement: "
                                  f"{s.name} differs from {first.name}")


def stage_modules(job: Job, rank: int) -> dict[int, nn.Module]:
    """The stage modules of ``rank``: only its own layers are ever built."""
    stages = job.schedule.stages_of(rank)
    wanted = sorted(i for s in stages for i in job.layer_stages[s])
    layers = job.build_layers(wanted)
    return {s: Chain(*(layers[i] for i in job.layer_stages[s])) for s in stages}


def microbatches(x: torch.Tensor, m: int) -> list[torch.Tensor]:
    if x.shape[0] % m:
        raise ValueError(f"a batch of {x.shape[0]} does not split into {m} equal microbatches")
    return list(x.chunk(m))


def _device(rank: int) -> torch.device:
    """This rank's compute device: a GPU of its own when there are any (NCCL), else the CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def run_rank(job: Job, rank: int, world: int, out_dir: str | None,
             on_step: Callable[[int, float, float], None] | None = None) -> RankReport:
    """The body of one rank: build, train for ``job.steps`` steps, report.

    The rank that computes the loss calls ``on_step(step, loss, seconds)`` after every step (of the first
    pipeline, with data parallelism: the loss of its shard).
    """
    pipeline, rank = divmod(rank, job.schedule.devices)  # from here on ``rank`` is the device in the pipeline
    global_rank = pipeline * job.schedule.devices + rank
    device = _device(global_rank)
    pipelines, dp_group = _mesh(job) if job.dp > 1 else (None, None)
    chains = stage_modules(job, rank)
    offloaded: list[Offloaded] = []
    if job.offload is None:
        modules: dict[int, nn.Module] = {s: m.to(device) for s, m in chains.items()}
    else:
        from pipefold.offload import Offloaded

        k, kprime = job.offload
        # Each stage offloads its own layers: parameters live on the CPU, at most k of them on the device.
        offloaded = [Offloaded(m, device, k=k, kprime=kprime) for m in chains.values()]
        modules = dict(zip(chains, offloaded, strict=True))
    recompute = {s: job.recompute[s] for s in modules} if job.recompute else None
    # A schedule with OPT actions steps each stage's optimizer where it says; otherwise one optimizer steps
    # all of this rank's parameters after the step.
    in_schedule = any(a.kind == Kind.OPT for row in job.schedule.actions for a in row)
    stage_opts = {s: _optimizer(job, list(m.parameters())) for s, m in modules.items()} if in_schedule else {}
    stage_snaps: dict[int, Snapshot] = {}  # each stage's state before its OPT stepped, until the step is validated
    origin = job.origin
    if job.network is not None and origin is None:
        origin = float(agree(time.time()))  # the network's timeline starts now on every rank
    choices = job.adaptive.schedules if job.adaptive is not None else job.cycle or (job.schedule,)
    cycle_from = 0  # the step the cycle in ``choices`` started at
    work = None
    if job.kfac is not None:
        from pipefold.runtime.curvature import RankCurvature, StageCurvature

        m = job.schedule.microbatches
        work = RankCurvature({s: StageCurvature(mod, job.kfac, m) for s, mod in modules.items()})
    executors: dict[int, RankExecutor] = {}

    def executor_for(index: int) -> RankExecutor:
        """The executor of schedule ``index``, made the first time it runs (same modules, same parameters)."""
        if index not in executors:
            executors[index] = RankExecutor(
                choices[index], rank, modules, job.loss_fn, device, recompute=recompute,
                log_messages=job.log_messages, timeout=job.timeout_s, network=job.network, origin=origin or 0.0,
                optimizers={s: _speculative(s, o, modules[s], stage_snaps) for s, o in stage_opts.items()}, work=work,
                pipelines=pipelines, pipeline=pipeline, dp_group=dp_group)
        return executors[index]

    current, predicted = 0, None
    decisions: list[tuple[int, Any]] = []
    executor = executor_for(current)
    params = executor.parameters()
    opt = None if in_schedule else _optimizer(job, params, dp_group)
    reports: list[StepStats] = []
    grads = None
    m = job.schedule.microbatches
    loss_rank = job.schedule.holders(job.schedule.stages - 1)[0]
    # A stage held by several replicas counts once in a global norm: by its first holder, in the first pipeline.
    counted = [p for s, r in executor.runners.items() if job.schedule.holders(s)[0] == rank and pipeline == 0
               for p in r.params]
    optimizers = [o for o in (opt, *stage_opts.values()) if o is not None]
    names = {id(p): name for name, p in _named(job, chains)}
    state = _state_named(job, chains)
    checkpointing, start, resumed_from = job.checkpoint, 0, None
    if checkpointing is not None and checkpointing.resume is not None:
        from pipefold.runtime import checkpoint

        progress = checkpoint.load(checkpointing.resume, model=state, optimizers=optimizers, names=names,
                                   rank=global_rank, device=device)
        start, resumed_from = int(progress["step"]), checkpointing.resume.path
        current = int(progress.get("schedule_index") or 0)
    hooks = _TestHooks.read()
    bad_run, skipped, saved = 0, [], []
    stopped = None
    for step in range(start, job.steps):
        if hooks.die == (step, "step") and global_rank == world - 1:
            os._exit(13)
        if job.cycle:
            current = (step - cycle_from) % len(choices)
        executor = executor_for(current)
        started = time.perf_counter()
        x, y = job.batch_at(step)
        if job.dp > 1:  # this pipeline's shard of the global batch
            x, y = x.chunk(job.dp)[pipeline], y.chunk(job.dp)[pipeline]
        xs, ys = microbatches(x.to(device), m), microbatches(y.to(device), m)
        if step in hooks.nan and xs[0].is_floating_point():
            xs[0] = xs[0].clone()
            xs[0].view(-1)[0] = math.nan
        for p in params:
            p.grad = None
        if work is not None:
            work.record(job.save_grads_of_step == step)
        before = work.snapshot() if work is not None else None  # K-FAC's state, in case the step is skipped
        if job.verify_memory_step == step:
            stats = _tracked_step(executor, params, xs, ys, tuple(x.shape))
        else:
            stats = executor.run_step([(t,) for t in xs], ys, tuple(x.shape))
        for wrapper in offloaded:
            wrapper.evict_all()  # every layer home, with its gradient, before the optimizer reads it
        _update(job, params, counted, opt, stage_opts, stage_snaps, stats, device)
        if stats.skipped and work is not None and before is not None:
            work.restore(before)
        if job.save_grads_of_step == step:
            # With K-FAC, the gradients as the backward left them, before the schedule's KP preconditioned them.
            raw = work.raw_grads() if work is not None else {}
            grads = {name: raw.get(id(p), p.grad).detach().clone() for name, p in _named(job, chains)
                     if p.grad is not None}
        stats.schedule, stats.predicted = _spec(choices[current]), predicted
        reports.append(stats)
        if on_step is not None and rank == loss_rank and pipeline == 0:
            on_step(step, sum(stats.losses.values()) / len(stats.losses), time.perf_counter() - started)
        if stats.skipped:
            skipped.append(step)
            bad_run += 1
            if bad_run >= job.max_bad_steps:
                first = step - bad_run + 1
                where = f"{bad_run} steps in a row (steps {first} to {step})" if bad_run > 1 else f"step {step}"
                stopped = (f"the loss or the gradients were NaN or inf in {where}; the weights are those before "
                           f"step {first}: lower --lr, add --clip, or check the data")
                break
            if global_rank == 0:
                from pipefold.runtime.checkpoint import warn

                warn(f"step {step}: the loss or a gradient is NaN or inf; step skipped, weights and optimizer "
                     f"state unchanged ({bad_run} in a row; the run stops at {job.max_bad_steps})")
        else:
            bad_run = 0
        if job.refill is not None and step + 1 == job.refill.after and step + 1 < job.steps:
            ran = [choices[(i - cycle_from) % len(choices)] for i in range(1, step + 1)]
            filled = _refill(job.refill, reports[1:], ran, rank, world)
            choices, cycle_from = filled.cycle, step + 1
            for each in executors.values():
                each.close()
            executors.clear()
            if rank == 0:
                decisions.append((step + 1, filled))
        adaptive = job.adaptive
        if adaptive is not None and (step + 1) % adaptive.every == 0 and step + 1 < job.steps:
            summary = adaptive.summarize(reports[-adaptive.every:], _static_bytes(params, optimizers))
            gathered: list[Any] = [None] * world if rank == 0 else []
            dist.gather_object(summary, gathered if rank == 0 else None, dst=0)
            choice = adaptive.decide(current, gathered) if rank == 0 else None
            current, predicted, record = agree(choice)  # every rank switches at the same step boundary
            if rank == 0:
                decisions.append((step + 1, record))
        if checkpointing is not None and checkpointing.due(step + 1, job.steps):
            from pipefold.runtime import checkpoint

            die = hooks.die == (step + 1, "save") and global_rank == world - 1
            saved.append(checkpoint.save(checkpointing, step + 1, model=state, optimizers=optimizers, names=names,
                                         progress={"step": step + 1, "schedule_index": current}, rank=global_rank,
                                         device=device, written=(lambda: os._exit(13)) if die else None))
    for each in executors.values():
        each.close()
    if job.save_model is not None and stopped is None:
        _save_model(job, chains, job.save_model, global_rank, pipeline, world)
    resident = sum(w.tracker.peak_resident_bytes for w in offloaded)
    weights = {name: p.detach().clone() for name, p in _named(job, chains)} if job.save_weights else None
    static = _static_bytes(params, optimizers) + (work.state_bytes() if work is not None else 0)
    report = RankReport(global_rank, reports, grads, _peak_rss(), resident, weights, static,
                        decisions, pipeline, first_step=start, resumed_from=resumed_from, skipped=skipped,
                        stopped=stopped, checkpoints=saved)
    if out_dir is not None:
        with open(Path(out_dir) / f"rank{global_rank}.pkl", "wb") as fh:
            pickle.dump(report, fh)
    return report


def _mesh(job: Job) -> tuple[list[list[int]], Any]:
    """The dp x devices mesh of the job's ranks (torch's DeviceMesh): every pipeline's ranks, and the group of
    this rank's copies across the pipelines."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (job.dp, job.schedule.devices),
                            mesh_dim_names=("dp", "pp"))
    return mesh.mesh.tolist(), mesh.get_group("dp")


def _refill(refill: Refill, steps: list[StepStats], ran: list[Schedule], rank: int, world: int) -> Filled:
    """Every rank's measured times to rank 0, which places K-FAC's work again; the new placement to every rank.

    ``steps`` are this rank's steps to learn from and ``ran`` the schedule each of them ran.
    """
    from pipefold.runtime.executor import kind_times

    mine = (kind_times(steps), [(st.started_at, st.wall) for st in steps])  # each rank times its own stages
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    filled = None
    if rank == 0:
        times = {s: t for each, _ in gathered for s, t in each.items()}
        # A step lasts from the first rank's start to the last rank's end.
        walls = [max(a + w for a, w in spans) - min(a for a, _ in spans)
                 for spans in zip(*(spans for _, spans in gathered), strict=True)]
        filled = refill.plan(times, list(zip(ran, walls, strict=True)))
    return agree(filled)


def _tracked_step(executor: RankExecutor, params: list[nn.Parameter], xs: list[torch.Tensor],
                  ys: list[torch.Tensor], shape: tuple[int, ...]) -> StepStats:
    """One step under torch's MemTracker too, which sees every tensor an operation returns and follows its
    storage until it dies, whatever the runtime meant to keep; ``stats.memory_check`` gets its figures.

    After every action both are read: what the meter says the rank holds, and what the tracker has
    seen created during the step and still alive (between actions, an operation's temporaries are
    gone). Within an action the tracker also sees those temporaries, so its peak over the whole step
    (``tracker_peak``) is the meter's plus the largest temporaries at that moment. The parameters,
    their gradients (made as zeros before the step: adding into a zero gradient gives the same values
    bit for bit) and the batch are registered with it first, so that only what the step itself holds
    counts. On CUDA the allocator's own peak over the step is recorded as well (``allocator_peak``).
    """
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    except ImportError as exc:  # torch < 2.5
        raise ConfigError(f"checking memory needs torch.distributed._tools.mem_tracker (torch >= 2.5): {exc}") from exc

    class NoModules:
        """Stands in for MemTracker's module tracker: its per-module statistics allow a module one forward per
        step (a stage runs one per microbatch) and its backward hooks do not work under ``autograd.grad``,
        which B uses. The device totals need none of it."""

        is_bw = False
        parents = {"Global"}

        def register_user_hooks(self, *args: Any) -> None:
            pass

        def clear_user_hooks(self) -> None:
            pass

        def __enter__(self) -> NoModules:
            return self

        def __exit__(self, *args: Any) -> None:
            pass

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    cuda = executor.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(executor.device)
        torch.cuda.reset_peak_memory_stats(executor.device)
        before = torch.cuda.memory_allocated(executor.device)
    tracker = MemTracker()
    tracker._mod_tracker = NoModules()  # type: ignore[assignment]
    outside = {_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.OPT, _MemRefType.OTH}

    def step_bytes(snapshot: dict[torch.device, dict[Any, int]]) -> int:
        return sum(snap["Total"] - sum(v for k, v in snap.items() if k in outside) for snap in snapshot.values())

    pairs: list[tuple[int, int]] = []  # (meter, tracker) after each action

    def probe() -> None:
        # A link's thread may drop a delivered send between two reads: read again until the tracker holds still.
        for _ in range(10):
            first = step_bytes(tracker.get_tracker_snapshot())
            held = executor.meter.current
            after = step_bytes(tracker.get_tracker_snapshot())
            if first == after:
                break
        pairs.append((held, after))

    with tracker:
        # What lives from step to step (parameters, gradients, K-FAC's state) is not the step's memory.
        state = executor.work.state() if executor.work is not None else []
        tracker.track_external(*executor.modules(), *xs, *ys, *(p.grad for p in params if p.grad is not None),
                               *state)
        stats = executor.run_step([(t,) for t in xs], ys, shape, probe=probe)
    stats.memory_check = {
        "meter_between_actions": max(m for m, _ in pairs),
        "tracker_between_actions": max(t for _, t in pairs),
        "largest_gap": max(abs(m - t) for m, t in pairs),
        "tracker_peak": step_bytes(tracker.get_tracker_snapshot("peak")),
    }
    if cuda:
        torch.cuda.synchronize(executor.device)
        stats.memory_check["allocator_peak"] = torch.cuda.max_memory_allocated(executor.device) - before
    return stats


def _state_named(job: Job, modules: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """Parameters and buffers named by model layer index, as the plain model ``nn.Sequential(*layers)`` names them."""
    out = {}
    for s, module in modules.items():
        for pos, layer in enumerate(module.children()):
            index = job.layer_stages[s][pos]
            out.update({f"{index}.{name}": t for name, t in layer.state_dict(keep_vars=True).items()})
    return out


def _save_model(job: Job, modules: dict[int, nn.Module], path: str, global_rank: int, pipeline: int,
                world: int) -> None:
    """Gather the first pipeline's layers on rank 0, which writes the whole model's state_dict to ``path``
    (a temporary file beside it, then a rename)."""
    mine: dict[int, dict[str, torch.Tensor]] = {}
    if pipeline == 0:
        for s, module in modules.items():
            for pos, layer in enumerate(module.children()):
                mine[job.layer_stages[s][pos]] = {k: v.detach().cpu() for k, v in layer.state_dict().items()}
    gathered: list[Any] = [None] * world if global_rank == 0 else []
    dist.gather_object(mine, gathered if global_rank == 0 else None, dst=0)
    if global_rank != 0:
        return
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for part in gathered:
        layers.update(part)  # a stage held by several ranks (replicas) holds the same weights
    full = {f"{i}.{k}": v for i in sorted(layers) for k, v in layers[i].items()}
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".pipefold-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(full, fh)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@dataclass(frozen=True)
class _TestHooks:
    """Faults the tests inject into real runs, read from the environment (never set in normal use):

    ``PIPEFOLD_TEST_DIE_AT_STEP=N`` makes the last rank exit (code 13) as step N starts, and ``N:save`` while it
    saves the checkpoint of step N (its files written, the checkpoint not yet committed); only in a first
    attempt, not in a restart by torchrun (``TORCHELASTIC_RESTART_COUNT`` > 0).
    ``PIPEFOLD_TEST_NAN_AT_STEP=N[,N...]`` puts a NaN in the first input of microbatch 0 at those steps
    (a model with float inputs)."""

    die: tuple[int, str] | None = None
    nan: frozenset[int] = frozenset()

    @staticmethod
    def read() -> _TestHooks:
        die = None
        text = os.environ.get("PIPEFOLD_TEST_DIE_AT_STEP")
        if text and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
            step, _, where = text.partition(":")
            die = (int(step), where or "step")
        nan = os.environ.get("PIPEFOLD_TEST_NAN_AT_STEP", "")
        return _TestHooks(die, frozenset(int(x) for x in nan.split(",") if x.strip()))


def _named(job: Job, modules: dict[int, nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters named by model layer index, so the launcher can match them with a reference model."""
    out = []
    for s, module in modules.items():
        for pos, layer in enumerate(module.children()):
            index = job.layer_stages[s][pos]
            out += [(f"{index}.{name}", p) for name, p in layer.named_parameters()]
    return out


def _optimizer(job: Job, params: list[nn.Parameter], dp_group: Any = None) -> torch.optim.Optimizer | None:
    if not params:
        return None  # a rank whose stages have no weights has nothing to step
    if callable(job.optimizer):
        return job.optimizer(params)
    if job.zero1 and dp_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # ZeRO-1: each copy of a stage keeps the optimizer state of its share of the parameters, steps them,
        # and sends them to the other copies.
        return ZeroRedundancyOptimizer(params, optimizer_class=OPTIMIZERS[job.optimizer],  # type: ignore[arg-type]
                                       process_group=dp_group, lr=job.lr)
    return OPTIMIZERS[job.optimizer](params, lr=job.lr)


def _nothing() -> None:
    """The optimizer step of a stage without weights."""


def _speculative(stage: int, opt: torch.optim.Optimizer | None, module: nn.Module,
                 snapshots: dict[int, Snapshot]) -> Callable[[], None]:
    """The step a schedule's OPT action of ``stage`` runs: a copy of the stage's state first, then the step, which
    the global check after the step validates (and rolls back with the copy when it fails)."""
    if opt is None:
        return _nothing

    def step() -> None:
        snapshots[stage] = Snapshot(list(module.parameters()), [opt])
        opt.step()
    return step


def _update(job: Job, params: list[nn.Parameter], counted: list[nn.Parameter], opt: torch.optim.Optimizer | None,
            stage_opts: dict[int, torch.optim.Optimizer | None], stage_snaps: dict[int, Snapshot], stats: StepStats,
            device: torch.device) -> None:
    """After the step's passes: the global NaN/inf and norm check (one all-reduce), then the optimizer step,
    clipped, or skipped when the step is bad (see :mod:`pipefold.runtime.numerics`).

    Without post-validation the optimizer waits for the check. With it (``job.post_validate``), and always
    when the schedule's OPT actions have stepped already, the step is taken first and rolled back when the
    check says it was bad or needed clipping. ``stats`` gets the norm and what happened.
    """
    check = local_check(counted, stats.losses.values(), device)
    speculative = None
    if opt is not None and job.post_validate:
        pending = dist.all_reduce(check, async_op=True)
        speculative = Snapshot(params, [opt])
        opt.step()  # while the check is in flight
        pending.wait()
    else:
        dist.all_reduce(check)
    stepped = speculative is not None or bool(stage_snaps)
    norm, bad = verdict(check)
    factor = None if bad else clip_factor(norm, job.clip)
    stats.grad_norm, stats.skipped, stats.clipped = norm, bad, factor is not None
    if stepped and (bad or factor is not None):
        for snap in (speculative, *stage_snaps.values()):
            if snap is not None:
                snap.restore()
        stats.rolled_back = True
    stage_snaps.clear()
    if bad or (stepped and factor is None):
        return
    if factor is not None:
        scale_grads(params, factor)
    for each in (opt, *stage_opts.values()):
        if each is not None:
            each.step()


def _static_bytes(params: list[nn.Parameter], optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of the distinct storages of the parameters, their gradients and every tensor in the optimizers' state."""
    tensors = [t for p in params for t in (p, p.grad) if t is not None]
    # ZeRO-1 keeps its share of the state in the optimizer it wraps (``optim``).
    tensors += [v for o in optimizers for state in getattr(o, "optim", o).state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def _peak_rss() -> int:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(rank: int, job: Job, world: int, port: int, out_dir: str, progress: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    host = "127.0.0.1"
    if job.netns is not None:
        from pipefold.runtime.netns import enter

        enter(job.netns, rank)  # before any socket: the group's connections then cross the namespaces' links
        host = job.netns.addresses[0]
    torch.set_num_threads(1)
    dist.init_process_group(_backend(), init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=job.timeout_s))
    try:
        run_rank(job, rank, world, out_dir, on_step=lambda *a: progress.put(a))
        dist.barrier()
    finally:
        leave_group()


def process_context() -> Any:
    """How local ranks start: from a fork server that has imported torch and the runtime once (a rank then starts
    in a fraction of a second instead of importing torch again), where the platform has one; else spawned.

    The server is started by this process's first job and serves every later one; it runs no torch code, so
    no thread pool or CUDA context is copied into the ranks.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "pipefold.runtime.launch", "pipefold.train",
                                "pipefold.profile"])
    return ctx


def run_local(job: Job, on_step: Callable[[int, float, float], None] | None = None) -> list[RankReport]:
    """Spawn one process per device on this machine, run the job, and collect every rank's report.

    ``on_step(step, loss, seconds)`` is called in this process as the steps complete. An exception
    on any rank terminates the others and is raised here, naming the rank.
    """

    world = job.dp * job.schedule.devices
    queue = process_context().SimpleQueue()
    # When a rank fails, torch logs a warning for each rank it then terminates; the RankError
    # raised below already says what happened, in one line.
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        return _run_spawned(job, world, queue, on_step)
    finally:
        spawn_log.setLevel(level)


def _run_spawned(job: Job, world: int, queue: Any, on_step: Callable[[int, float, float], None] | None
                 ) -> list[RankReport]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="pipefold-") as out_dir:
        context = mp.start_processes(_spawned, args=(job, world, free_port(), out_dir, queue), nprocs=world,
                                     join=False, start_method=process_context().get_start_method())
        done = False
        while not done:
            try:
                done = context.join(timeout=0.1)  # on a failure it terminates the other ranks, then raises
            except mp.ProcessRaisedException as exc:
                raise RankError(exc.error_index, exc.msg) from None
            except mp.ProcessExitedException as exc:
                raise RankError(exc.error_index, f"exited with code {exc.exit_code}") from None
            while not queue.empty():
                step = queue.get()
                if on_step is not None:
                    on_step(*step)
        reports = []
        for rank in range(world):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as fh:
                reports.append(pickle.load(fh))
    _raise_if_stopped(reports)
    return reports


def _raise_if_stopped(reports: list[RankReport]) -> None:
    for r in reports:
        if r.stopped is not None:
            raise Diverged(r.stopped, reports)


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) has set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def join_torchrun_group(timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join the process group torchrun set up for this process (once); return (rank, world size)."""
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt not in ("", "0") and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Restarted workers meet in the agent's store, the same one as the failed attempt's: under a prefix of
            # their own, or a rank could read a dead peer's address left there (gloo: "connection refused").
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                                  timeout=timeout)
            dist.init_process_group(_backend(), store=dist.PrefixStore(f"pipefold/attempt-{attempt}", store),
                                    rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(_backend(), timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def agree(value: Any, src: int = 0) -> Any:
    """Every rank gets rank ``src``'s ``value`` (any picklable object)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def run_torchrun(job: Job, on_step: Callable[[int, float, float], None] | None = None) -> list[RankReport] | None:
    """Run this process's rank of ``job`` as torchrun started it; rank 0 gets every rank's report, others None.

    torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the world must
    have one process per device of the schedule and data-parallel pipeline, on one machine or several.
    """
    rank, world = join_torchrun_group(max(job.timeout_s, 60.0))
    try:
        if world != job.dp * job.schedule.devices:
            need = job.dp * job.schedule.devices
            what = f" x {job.dp} data-parallel pipelines" if job.dp > 1 else ""
            raise ConfigError(f"torchrun started {world} processes but {job.schedule.name} runs on "
                              f"{job.schedule.devices} devices{what}; set --nproc-per-node and --nnodes for {need} "
                              "in all")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        report = run_rank(job, rank, world, None, on_step)
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(report, gathered if rank == 0 else None, dst=0)
        _raise_if_stopped(gathered if rank == 0 else [report])  # every rank stopped at the same step
        return gathered if rank == 0 else None
    finally:
        leave_group()


def leave_group() -> None:
    """Destroy the process group, if any, once nothing holds its work handles any more (spawned or torchrun)."""
    if dist.is_initialized():
        gc.collect()  # drop work handles still held in a cycle, or the group's threads abort the exit
        dist.destroy_process_group()

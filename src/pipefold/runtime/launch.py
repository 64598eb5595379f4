"""Start the ranks of a pipeline: locally by spawning one process per device, or under torchrun.

A job is described by a :class:`Job`: the schedule, a model given as a flat
list of layers that each rank builds only in part, the data, and the
optimizer. :func:`run_local` spawns ``schedule.devices`` processes on this
machine (gloo on CPU, NCCL with CUDA); :func:`run_rank` is what each process
runs, and is also the entry point under torchrun, which sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

Any rank that raises, dies or hangs ends the job (:class:`RankError`, one line naming the rank and what it
was doing): each rank publishes what it is doing (:mod:`pipefold.runtime.watch`), the spawning parent
watches them all and decides which rank is to blame, then stops the others. Under torchrun each rank's
heartbeat thread watches its own progress and, when it has waited too long, the others' in the job's store.
SIGINT and SIGTERM to the spawning parent stop every rank (:class:`Interrupted`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import math
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError, Interrupted
from pipefold.ir import Kind, Schedule
from pipefold.ir.ref import ScheduleRef
from pipefold.runtime import numerics, sharding
from pipefold.runtime.devices import Placement, place
from pipefold.runtime.executor import RankExecutor, StepStats
from pipefold.runtime.faults import Faults
from pipefold.runtime.history import KEEP_FIRST, StepHistory, step_number
from pipefold.runtime.numerics import clip_factor, local_check, scale_grads, verdict
from pipefold.runtime.processes import free_port, process_context
from pipefold.runtime.stage import Chain, Tensors, as_tuple, split_batch
from pipefold.runtime.tied import TiedGrads, spans_stages, untie
from pipefold.runtime.watch import (
    DEFAULT_ACTION_TIMEOUT,
    PERIOD,
    Activity,
    Heartbeat,
    SharedBoard,
    Snapshot,
    StoreBoard,
    die_with_parent,
    exit_when_closed,
    find_hang,
    limit,
    name_process,
    pg_timeout,
    process_state,
    why_silent,
)

if TYPE_CHECKING:
    from pipefold.plan.pipefisher import Filled, Refill
    from pipefold.runtime.checkpoint import Checkpointing
    from pipefold.runtime.kfac import KFACConfig
    from pipefold.runtime.netns import Topology
    from pipefold.runtime.offload import Offloaded
    from pipefold.sim.network import Network


class RankError(RuntimeError):
    """A rank raised, died or hung: ``str()`` is one line naming the rank and what it was doing; ``details`` the
    rank's traceback, where it raised."""

    def __init__(self, rank: int, message: str, details: str = "") -> None:
        super().__init__(message)
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
    batch_at: Callable[[int], tuple[Any, torch.Tensor]]
    """The whole batch (inputs, targets) of a step; every rank gets the same one. The inputs are a tensor or a
    tuple of tensors (token ids and an attention mask), split into microbatches along dimension 0."""
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
    """(k, k'): every stage keeps at most k of its layers on the device (see pipefold.runtime.offload)."""
    recompute: tuple[int, ...] | None = None
    """For each stage, how many of its first layers recompute their activations in backward."""
    action_timeout_s: float = DEFAULT_ACTION_TIMEOUT
    """Seconds an action (or a phase between actions) may run before the job is taken as hung and stopped, naming
    the rank (see :mod:`pipefold.runtime.watch`); the process group's timeout is this plus a margin."""
    keep_steps: int = KEEP_FIRST
    """Each rank keeps the full record of its first ``keep_steps`` steps (their timelines: ``--trace``), of the
    last one and of those it is asked to check; of every other step a few numbers (:mod:`pipefold.runtime.history`),
    so that its memory stays flat over a long run."""
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
    """Step t runs ``cycle[t % len(cycle)]`` (K-FAC's work spread over steps, :mod:`pipefold.plan.pipefisher`);
    ``schedule`` must be ``cycle[0]``."""
    zero1: bool = False
    """With ``dp`` > 1: shard the optimizer state across the copies of each stage (ZeRO-1, torch's
    ``ZeroRedundancyOptimizer``)."""
    fsdp: bool = False
    """With ``dp`` > 1: shard every stage across its copies with torch's ``fully_shard`` (1/dp of its parameters,
    gradients and optimizer state each), gathered and reduce-scattered by the schedule's ``AG`` and ``RS``
    actions (:func:`pipefold.schedules.dataparallel.with_data_parallel` with ``shard=True``) instead of all-reduced."""
    dp: int = 1
    """Data-parallel copies of the whole pipeline: ranks dp x devices, rank r is device r % devices of pipeline
    r // devices; each pipeline runs its shard of every step's batch, and its ``DP`` actions average each
    stage's gradients across the pipelines (the schedule must have them: :mod:`pipefold.schedules.dataparallel`)."""
    kfac: KFACConfig | None = None
    """Keep K-FAC's state per stage and run the schedule's KA, KG, KI and KP actions (``optimizer="kfac"``)."""
    refill: Refill | None = None
    """After ``refill.after`` steps, rank 0 places K-FAC's work again from the times the ranks measured (steps
    after the first) and every rank runs the new cycle from the next step on (recorded in rank 0's
    ``RankReport.decisions`` as (first step, its :class:`~pipefold.plan.pipefisher.Filled`))."""
    tied: tuple[tuple[tuple[int, str], ...], ...] = ()
    """Weights several layers share, each as its (layer index, parameter name) pairs (``Model.tied``): where they
    fall in different stages each stage holds a copy and their gradients are summed after the step
    (:mod:`pipefold.runtime.tied`)."""
    preload: tuple[str, ...] = ()
    """Modules the local ranks' processes import before they start (``Model.preload``)."""
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
    device: str = "auto"
    """Where the ranks compute: "cpu", "cuda", or "auto" (a GPU when torch sees one); see
    :mod:`pipefold.runtime.devices`."""
    backend: str = "auto"
    """How their tensors cross: "nccl" (a GPU per rank), "gloo" (the CPU, or GPUs that ranks share, through host
    memory) or "auto"."""
    overlap: bool = True
    """On a GPU, run an overlapped pair's (``FB``) forward and backward at once on two streams; False: one after
    the other, as on the CPU."""
    faults: Faults | None = None
    """Faults a test injects (:mod:`pipefold.runtime.faults`); None in normal use."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What the launcher passes through (the model's layer count, the recomputation plan...). For the tests of
    machines without a GPU, ``extra["stage_through_host"]`` makes CPU ranks send the way ranks sharing a GPU do
    (a copy made to send, off the meter once made; a copy made on arrival; :mod:`pipefold.runtime.comm`)."""

    def __post_init__(self) -> None:
        # Checked here, in the launcher, so that a bad value is one line before any rank starts.
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1 (got {self.steps})")
        placement(self)  # a device or backend this machine cannot give: one line, before any rank starts
        if self.keep_steps < 1:
            raise ConfigError(f"keep_steps is how many first steps each rank keeps in full: at least 1 (got "
                              f"{self.keep_steps})")
        if not (math.isfinite(self.action_timeout_s) and 0 < self.action_timeout_s <= 86400):
            raise ConfigError(f"the action timeout is in seconds: a number > 0 and at most a day (got "
                              f"{self.action_timeout_s})")
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
        reducing = {a.kind for row in self.schedule.actions for a in row} & {Kind.DP, Kind.AG, Kind.RS}
        if self.dp > 1:
            kinds, how = (((Kind.AG, Kind.RS), "with_data_parallel(schedule, shard=True)") if self.fsdp
                          else ((Kind.DP,), "with_data_parallel(schedule)"))
            for kind in kinds:
                if (missing := _without(self.schedule, kind)) is not None:
                    d, st = missing
                    raise ConfigError(f"with {self.dp} data-parallel pipelines{' sharded' if self.fsdp else ''} "
                                      f"every stage needs its {kind}, but {self.schedule.name} has no {st}{kind} on "
                                      f"device {d}: add them with pipefold.schedules.dataparallel.{how}")
            if wrong := sorted(reducing - set(kinds)):
                raise ConfigError(f"{self.schedule.name} has {wrong[0]} actions, which "
                                  f"{'do not shard' if self.fsdp else 'shard the stages (FSDP)'}: build it with "
                                  f"pipefold.schedules.dataparallel.{how}")
            unsupported = [what for what, on in (("adaptive schedules", self.adaptive is not None),
                                                 ("K-FAC", self.kfac is not None),
                                                 ("emulated networks", self.network is not None),
                                                 ("network namespaces", self.netns is not None),
                                                 ("offloading", self.offload is not None)) if on]
            if unsupported:
                raise ConfigError(f"data-parallel pipelines (dp={self.dp}) do not run with {unsupported[0]} yet: "
                                  "use dp=1 for them")
        elif reducing:
            kinds_text = ", ".join(sorted(reducing))
            raise ConfigError(f"{self.schedule.name} reduces across data-parallel pipelines ({kinds_text} actions) "
                              "but the job has one pipeline: give dp > 1 or a schedule without them")
        if self.fsdp and self.checkpoint is not None:
            raise ConfigError("checkpoints of stages sharded with FSDP are not written yet: use --dp without --fsdp "
                              "with --checkpoint-dir, or no checkpoints with --fsdp")
        if self.fsdp and (self.dp < 2 or self.zero1 or self.verify_memory_step is not None):
            raise ConfigError("FSDP shards each stage across data-parallel pipelines: it needs dp >= 2, and takes "
                              "neither ZeRO-1 (it shards the optimizer state already) nor a memory check")
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
                    raise ConfigError(f"K-FAC preconditions every stage every step, but {each.name} has "
                                      f"no {st}KP on device {d}: fill the schedule with pipefold.plan.pipefisher "
                                      "(fill or inline)")
            if self.offload is not None or self.recompute is not None:
                raise ConfigError("K-FAC does not combine with offloading or recomputation yet: it keeps layer inputs "
                                  "that those would drop; use one or the other")
        split = [tie for tie in self.tied if spans_stages(tie, self.layer_stages)]
        if split:
            (i, a), (j, b) = split[0][:2]
            what = (f"tied weights (layer {i}'s {a} is layer {j}'s {b}) on different stages have their gradients "
                    "summed after the step")
            if in_schedule:
                raise ConfigError(f"{what}, but the schedule steps optimizers itself (OPT actions): use a schedule "
                                  "without OPT actions, or untie them in the model's config")
            if self.kfac is not None:
                raise ConfigError(f"{what}, but K-FAC preconditions them during the step: use another optimizer, "
                                  "or untie them in the model's config")
            if self.fsdp:
                raise ConfigError(f"{what}, but FSDP shards each copy on its own: use --dp without --fsdp, or untie "
                                  "them in the model's config")
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
    steps: StepHistory
    """Every step's numbers (losses, times, peak bytes: its columns) and the full records of some steps (the
    first ``Job.keep_steps``, the last, and those ``--check`` or a memory check need), by step number."""
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
    """The numbers (:func:`~pipefold.runtime.history.step_number`) of the steps skipped because their loss or
    gradients were NaN or inf (weights and optimizer state untouched)."""
    stopped: str | None = None
    """Why the run stopped early (too many bad steps in a row), or None when it ran every step."""
    checkpoints: list[str] = field(default_factory=list)
    """The checkpoints saved, in order (on every rank)."""

    @property
    def device(self) -> int:
        """The rank's device in its pipeline."""
        return self.steps[0].rank if self.steps else self.rank


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
    """The stage modules of ``rank``: only its own layers are ever built; a weight that several of its stages
    share is copied into each (see :mod:`pipefold.runtime.tied`)."""
    stages = job.schedule.stages_of(rank)
    wanted = sorted(i for s in stages for i in job.layer_stages[s])
    layers = job.build_layers(wanted)
    chains: dict[int, nn.Module] = {s: Chain(*(layers[i] for i in job.layer_stages[s])) for s in stages}
    untie(chains)
    return chains


def microbatches(x: torch.Tensor, m: int) -> list[torch.Tensor]:
    if x.shape[0] % m:
        raise ValueError(f"a batch of {x.shape[0]} does not split into {m} equal microbatches")
    return list(x.chunk(m))


def _shapes(x: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of a batch's input tensors: the ranks agree on new receive buffers when they change."""
    return tuple(tuple(t.shape) for t in as_tuple(x))


def local_placement(device: str, backend: str, world: int) -> Placement:
    """Where the ranks on this machine compute and how they talk (:func:`pipefold.runtime.devices.place`): all
    ``world`` ranks of a local job, this node's (LOCAL_WORLD_SIZE) under torchrun."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) if under_torchrun() else 0
    return place(device, backend, ranks=ranks or world)


def placement(job: Job) -> Placement:
    """:func:`local_placement` of the job's ranks."""
    return local_placement(job.device, job.backend, job.dp * job.schedule.devices)


def local_rank(rank: int) -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK; the rank itself when spawned here)."""
    return int(os.environ.get("LOCAL_RANK", rank)) if under_torchrun() else rank


def run_rank(job: Job, rank: int, world: int, out_dir: str | None,
             on_step: Callable[[int, float, float], None] | None = None,
             activity: Activity | None = None) -> RankReport:
    """The body of one rank: build, train for ``job.steps`` steps, report.

    Rank 0 calls ``on_step(number, loss, seconds)`` after every step (its number: from 1, resumed steps
    counted, :func:`~pipefold.runtime.history.step_number`), with the step's global loss (every microbatch
    of every pipeline and replica: :attr:`StepStats.loss`). ``activity`` is told what the rank is doing, for the
    job's watch.
    """
    pipeline, rank = divmod(rank, job.schedule.devices)  # from here on ``rank`` is the device in the pipeline
    global_rank = pipeline * job.schedule.devices + rank
    activity = activity if activity is not None else Activity(global_rank)
    everyone = tuple(r for r in range(world) if r != global_rank)
    placed = placement(job)
    device = placed.device_of(local_rank(global_rank))  # current already: set before the process group was made
    if job.dp > 1:
        activity.wait("start-up", "the device mesh", everyone, action=False)
    pipelines, dp_mesh = _mesh(job, placed.device) if job.dp > 1 else (None, None)
    dp_group = dp_mesh.get_group() if dp_mesh is not None else None
    activity.run("start-up (building its layers)", action=False)
    chains = stage_modules(job, rank)
    tied = TiedGrads(job.tied, job.schedule, job.layer_stages, rank, chains, device, pipelines, pipeline)
    offloaded: list[Offloaded] = []
    if job.offload is None:
        modules: dict[int, nn.Module] = {s: m.to(device) for s, m in chains.items()}
    else:
        from pipefold.runtime.offload import Offloaded

        k, kprime = job.offload
        # Each stage offloads its own layers: parameters live on the CPU, at most k of them on the device.
        offloaded = [Offloaded(m, device, k=k, kprime=kprime) for m in chains.values()]
        modules = dict(zip(chains, offloaded, strict=True))
    recompute = {s: job.recompute[s] for s in modules} if job.recompute else None
    # What the optimizers step: the parameters, or with FSDP their shards (the runners work on the gathered ones).
    trained = {s: sharding.sharded_parameters(sharding.shard(m, dp_mesh)) if job.fsdp else list(m.parameters())
               for s, m in modules.items()}
    # A schedule with OPT actions steps each stage's optimizer where it says; otherwise one optimizer steps
    # all of this rank's parameters after the step.
    in_schedule = any(a.kind == Kind.OPT for row in job.schedule.actions for a in row)
    stage_opts = {s: _optimizer(job, trained[s]) for s in modules} if in_schedule else {}
    # Each stage's state before its OPT stepped, until the step is validated.
    stage_snaps: dict[int, numerics.Snapshot] = {}
    origin = job.origin
    if job.network is not None and origin is None:
        activity.wait("start-up", "the network's start time", everyone, action=False)
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
            activity.wait("start-up" if activity.step < 0 else "a new schedule", "its process groups", everyone,
                          action=False)
            executors[index] = RankExecutor(
                choices[index], rank, modules, job.loss_fn, device, recompute=recompute,
                log_messages=job.log_messages, timeout=pg_timeout(job.action_timeout_s), network=job.network,
                origin=origin or 0.0,
                optimizers={s: _speculative(s, o, modules[s], stage_snaps) for s, o in stage_opts.items()}, work=work,
                pipelines=pipelines, pipeline=pipeline, dp_group=dp_group, sharded=job.fsdp, activity=activity,
                staged=placed.staged or bool(job.extra.get("stage_through_host")), overlap=job.overlap)
        return executors[index]

    current, predicted = 0, None
    decisions: list[tuple[int, Any]] = []
    executor = executor_for(current)
    if not job.fsdp:
        trained = {s: r.params for s, r in executor.runners.items()}
    params = [p for ps in trained.values() for p in ps]
    opt = None if in_schedule else _optimizer(job, params, dp_group)
    keep = {s for s in (job.save_grads_of_step, job.verify_memory_step) if s is not None}
    history = StepHistory(job.keep_steps, keep)  # every step's numbers; in full only the steps that need it
    # What refilling K-FAC's placement and adapting the schedule learn from: their own windows of full records.
    learning: list[StepStats] = []
    recent: collections.deque[StepStats] = collections.deque(maxlen=job.adaptive.every if job.adaptive else 1)
    grads = None
    m = job.schedule.microbatches
    # A stage held by several replicas counts once in a global norm: by its first holder, in the first pipeline
    # (with FSDP, by every pipeline: each holds its own shard); a tied weight's copies count once.
    counted = [p for s, ps in trained.items() if job.schedule.holders(s)[0] == rank and (pipeline == 0 or job.fsdp)
               for p in ps if id(p) not in tied.copies]
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
    faults = job.faults or Faults()
    bad_run, skipped, saved = 0, [], []
    stopped = None
    for step in range(start, job.steps):
        if faults.die == (step_number(step), "step") and global_rank == world - 1:
            os._exit(13)
        if job.cycle:
            current = (step - cycle_from) % len(choices)
        executor = executor_for(current)
        activity.step = step_number(step)
        activity.run("the batch", action=False)
        started = time.perf_counter()
        x, y = job.batch_at(step)
        if job.dp > 1:  # this pipeline's shard of the global batch
            x, y = split_batch(x, job.dp)[pipeline], y.chunk(job.dp)[pipeline]
        xs = split_batch(tuple(t.to(device) for t in as_tuple(x)), m)
        ys = microbatches(y.to(device), m)
        if step_number(step) in faults.nan and xs[0][0].is_floating_point():
            poisoned = xs[0][0].clone()
            poisoned.view(-1)[0] = math.nan
            xs[0] = (poisoned, *xs[0][1:])
        for p in params:
            p.grad = None
        if work is not None:
            work.record(job.save_grads_of_step == step)
        before = work.snapshot() if work is not None else None  # K-FAC's state, in case the step is skipped
        if job.verify_memory_step == step:
            stats = _tracked_step(executor, params, xs, ys, _shapes(x))
        else:
            stats = executor.run_step(xs, ys, _shapes(x))
        for wrapper in offloaded:
            wrapper.evict_all()  # every layer home, with its gradient, before the optimizer reads it
        tied.reduce()  # copies of a shared weight on several stages: each gets the sum of their gradients
        activity.wait("the step's check", "the all-reduce of the gradient norm", everyone, action=False)
        _update(job, params, counted, opt, stage_opts, stage_snaps, stats, device)
        if stats.skipped and work is not None and before is not None:
            work.restore(before)
        if job.save_grads_of_step == step:
            # With K-FAC, the gradients as the backward left them, before the schedule's KP preconditioned them.
            raw = work.raw_grads() if work is not None else {}
            grads = {name: sharding.full(raw.get(id(p), p.grad)).detach().to("cpu", copy=True)
                     for name, p in _named(job, chains) if p.grad is not None}
        activity.run("the step's report", action=False)
        stats.schedule, stats.predicted = str(ScheduleRef.of(choices[current])), predicted
        history.add(stats)
        if job.refill is not None and 1 <= step < job.refill.after:
            learning.append(stats)
        if job.adaptive is not None:
            recent.append(stats)
        if on_step is not None and global_rank == 0:  # the global loss (every pipeline, replica): rank 0 knows it
            on_step(step_number(step), stats.loss, time.perf_counter() - started)
        if stats.skipped:
            skipped.append(step_number(step))
            bad_run += 1
            if bad_run >= job.max_bad_steps:
                first, last = step_number(step - bad_run + 1), step_number(step)
                where = f"{bad_run} steps in a row (steps {first} to {last})" if bad_run > 1 else f"step {last}"
                stopped = (f"the loss or the gradients were NaN or inf in {where}; the weights are those before "
                           f"step {first}: lower --lr, add --clip, or check the data")
                break
            if global_rank == 0:
                from pipefold.runtime.checkpoint import warn

                warn(f"step {step_number(step)}: the loss or a gradient is NaN or inf; step skipped, weights and "
                     f"optimizer state unchanged ({bad_run} in a row; the run stops at {job.max_bad_steps})")
        else:
            bad_run = 0
        if job.refill is not None and step + 1 == job.refill.after and step + 1 < job.steps:
            ran = [choices[(i - cycle_from) % len(choices)] for i in range(1, step + 1)]
            activity.wait("placing K-FAC's work again", "every rank's times", everyone, action=False)
            filled = _refill(job.refill, learning, ran, rank, world)
            learning.clear()
            choices, cycle_from = filled.cycle, step + 1
            for each in executors.values():
                each.close()
            executors.clear()
            if rank == 0:
                decisions.append((step + 1, filled))
        adaptive = job.adaptive
        if adaptive is not None and (step + 1) % adaptive.every == 0 and step + 1 < job.steps:
            optimizers = [o for o in (opt, *stage_opts.values()) if o is not None]
            summary = adaptive.summarize(list(recent), _static_bytes(params, optimizers))
            activity.wait("choosing the next schedule", "every rank's summary", everyone, action=False)
            gathered: list[Any] = [None] * world if rank == 0 else []
            dist.gather_object(summary, gathered if rank == 0 else None, dst=0)
            choice = adaptive.decide(current, gathered) if rank == 0 else None
            current, predicted, record = agree(choice)  # every rank switches at the same step boundary
            if rank == 0:
                decisions.append((step + 1, record))
        if checkpointing is not None and checkpointing.due(step + 1, job.steps):
            from pipefold.runtime import checkpoint

            die = faults.die == (step + 1, "save") and global_rank == world - 1
            saved.append(checkpoint.save(checkpointing, step + 1, model=state, optimizers=optimizers, names=names,
                                         progress={"step": step + 1, "schedule_index": current}, rank=global_rank,
                                         device=device, written=(lambda: os._exit(13)) if die else None))
    activity.run("its report", action=False)
    for each in executors.values():
        each.close()
    if job.save_model is not None and stopped is None:
        _save_model(job, chains, job.save_model, global_rank, pipeline, world)
    resident = sum(w.tracker.peak_resident_bytes for w in offloaded)
    weights = ({name: sharding.full(p.detach()).to("cpu", copy=True) for name, p in _named(job, chains)}
               if job.save_weights else None)
    static = _static_bytes(params, optimizers) + (work.state_bytes() if work is not None else 0)
    report = RankReport(global_rank, history, grads, _peak_rss(), resident, weights, static,
                        decisions, pipeline, first_step=start, resumed_from=resumed_from, skipped=skipped,
                        stopped=stopped, checkpoints=saved)
    if out_dir is not None:
        with open(Path(out_dir) / f"rank{global_rank}.pkl", "wb") as fh:
            pickle.dump(report, fh)
    return report


def _mesh(job: Job, device_type: str) -> tuple[list[list[int]], Any]:
    """The dp x devices mesh of the job's ranks (torch's DeviceMesh): every pipeline's ranks, and the 1-D mesh
    of this rank's copies across the pipelines."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (job.dp, job.schedule.devices), mesh_dim_names=("dp", "pp"))
    return mesh.mesh.tolist(), mesh["dp"]


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


def _tracked_step(executor: RankExecutor, params: list[nn.Parameter], xs: list[Tensors],
                  ys: list[torch.Tensor], shape: Any) -> StepStats:
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
    allocated: list[int] = []  # on CUDA, the allocator's bytes beyond those before the step, after each action

    def probe() -> None:
        # A link's thread may drop a delivered send between two reads: read again until the tracker holds still.
        for _ in range(10):
            first = step_bytes(tracker.get_tracker_snapshot())
            held = executor.meter.current
            after = step_bytes(tracker.get_tracker_snapshot())
            if first == after:
                break
        pairs.append((held, after))
        if cuda:
            allocated.append(torch.cuda.memory_allocated(executor.device) - before)

    with tracker:
        # What lives from step to step (parameters, gradients, K-FAC's state) is not the step's memory.
        state = executor.work.state() if executor.work is not None else []
        tracker.track_external(*executor.modules(), *(t for mb in xs for t in mb), *ys,
                               *(p.grad for p in params if p.grad is not None), *state)
        stats = executor.run_step(xs, ys, shape, probe=probe)
    stats.memory_check = {
        "meter_between_actions": max(m for m, _ in pairs),
        "tracker_between_actions": max(t for _, t in pairs),
        "largest_gap": max(abs(m - t) for m, t in pairs),
        "tracker_peak": step_bytes(tracker.get_tracker_snapshot("peak")),
    }
    if cuda:
        torch.cuda.synchronize(executor.device)
        stats.memory_check["allocator_peak"] = torch.cuda.max_memory_allocated(executor.device) - before
        stats.memory_check["allocator_between_actions"] = max(allocated)
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
    for s, module in modules.items():
        for pos, layer in enumerate(module.children()):
            # With FSDP each copy gathers its shards (a collective of every pipeline); the first one keeps them.
            whole = {k: sharding.full(v.detach()).cpu() for k, v in layer.state_dict().items()}
            if pipeline == 0:
                mine[job.layer_stages[s][pos]] = whole
    gathered: list[Any] = [None] * world if global_rank == 0 else []
    dist.gather_object(mine, gathered if global_rank == 0 else None, dst=0)
    if global_rank != 0:
        return
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for part in gathered:
        layers.update(part)  # a stage held by several ranks (replicas) holds the same weights
    full = {f"{i}.{k}": v for i in sorted(layers) for k, v in layers[i].items()}
    from pipefold.files import atomic

    with atomic(path, binary=True) as fh:
        torch.save(full, fh)


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
                 snapshots: dict[int, numerics.Snapshot]) -> Callable[[], None]:
    """The step a schedule's OPT action of ``stage`` runs: a copy of the stage's state first, then the step, which
    the global check after the step validates (and rolls back with the copy when it fails)."""
    if opt is None:
        return _nothing

    def step() -> None:
        snapshots[stage] = numerics.Snapshot(list(module.parameters()), [opt])
        opt.step()
    return step


def _update(job: Job, params: list[nn.Parameter], counted: list[nn.Parameter], opt: torch.optim.Optimizer | None,
            stage_opts: dict[int, torch.optim.Optimizer | None], stage_snaps: dict[int, numerics.Snapshot],
            stats: StepStats, device: torch.device) -> None:
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
        speculative = numerics.Snapshot(params, [opt])
        opt.step()  # while the check is in flight
        pending.wait()
    else:
        dist.all_reduce(check)
    stepped = speculative is not None or bool(stage_snaps)
    norm, bad, stats.loss = verdict(check)
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
    tensors = [sharding.local(t) for p in params for t in (p, p.grad) if t is not None]
    # ZeRO-1 keeps its share of the state in the optimizer it wraps (``optim``); FSDP's state is sharded.
    tensors += [sharding.local(v) for o in optimizers for state in getattr(o, "optim", o).state.values()
                for v in state.values() if isinstance(v, torch.Tensor)]
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


def _spawned(rank: int, job: Job, world: int, port: int, out_dir: str, progress: Any, board: SharedBoard,
             launcher: Any) -> None:
    """One local rank. What it is doing goes to ``board`` for the launcher; an exception that ends it, to
    ``error-RANK.json`` in ``out_dir`` (then it exits at once, with code 1: the launcher decides what to say).
    ``launcher`` is the end of a pipe that closes when the launcher dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the terminal: the launcher stops us
    exit_when_closed(launcher)
    name_process(f"pipefold-rank{rank}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    activity = Activity(rank)
    heartbeat = Heartbeat(activity, board).start()
    others = tuple(r for r in range(world) if r != rank)
    try:
        host = "127.0.0.1"
        if job.netns is not None:
            from pipefold.runtime.netns import enter

            enter(job.netns, rank)  # before any socket: the group's connections then cross the namespaces' links
            host = job.netns.addresses[0]
        torch.set_num_threads(1)
        activity.wait("start-up", "the process group", others, action=False)
        where = placement(job)
        if where.device == "cuda":
            torch.cuda.set_device(where.device_of(rank))
        dist.init_process_group(where.backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout(job.action_timeout_s)))
        run_rank(job, rank, world, out_dir, on_step=lambda *a: progress.put(a), activity=activity)
        activity.wait("the end of the job", "every rank to finish", others, action=False)
        dist.barrier()
        activity.finish()
        heartbeat.beat()
        leave_group()
    except BaseException as exc:  # noqa: BLE001 (reported to the launcher, which names the rank to blame)
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
    rank that raises, dies or hangs (an action longer than ``job.action_timeout_s``) stops the others:
    :class:`RankError` names it and what it was doing. SIGINT or SIGTERM (from the main thread's point of view)
    stops every rank and raises :class:`Interrupted`; the ranks' temporary files are removed either way.
    """
    world = job.dp * job.schedule.devices
    with _Signals() as signals:
        return _run_spawned(job, world, on_step, signals)


class _Signals:
    """While entered (in the main thread): SIGINT and SIGTERM raise :class:`Interrupted`, once; inside
    :meth:`held` they wait until it ends, so that the ranks being started are all known and can be stopped.

    Inside :meth:`held` SIGINT is also blocked, not only deferred: the fork server (started by the first job)
    and the ranks inherit the blocked signal, so that Ctrl-C in a terminal, which reaches every process of the
    group, cannot end them while they import torch or unpickle the job, with a traceback each; the launcher
    alone acts on it.
    """

    def __init__(self) -> None:
        self.pending: int | None = None
        self.holding = self.raised = False
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
        if self.holding:
            self.pending = signum
            return
        self.raised = True
        raise Interrupted(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        block = bool(self._before) and hasattr(signal, "pthread_sigmask")
        if block:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        self.holding = True
        try:
            yield
        finally:
            if block:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # one that came is handled now
            self.holding = False
        if self.pending is not None and not self.raised:
            self.raised = True
            raise Interrupted(self.pending)


def _run_spawned(job: Job, world: int, on_step: Callable[[int, float, float], None] | None,
                 signals: _Signals) -> list[RankReport]:
    ctx = process_context(job.preload)
    queue = ctx.SimpleQueue()
    board = SharedBoard(ctx, world)
    lifeline, mine = ctx.Pipe(duplex=False)  # the ranks get the reading end; only this process holds the other
    with tempfile.TemporaryDirectory(prefix="pipefold-") as out_dir, mine:
        ranks: list[Any] = []
        try:
            port = free_port()
            with signals.held():  # a signal now would leave a rank half started, unknown to us
                for rank in range(world):
                    proc = ctx.Process(target=_spawned, args=(rank, job, world, port, out_dir, queue, board,
                                                              lifeline), name=f"pipefold-rank-{rank}")
                    proc.start()
                    ranks.append(proc)
                lifeline.close()
            _supervise(job, ranks, queue, board, Path(out_dir), on_step)
        except Interrupted as exc:
            raise Interrupted(exc.signum, _stop(ranks)) from None
        finally:
            _stop(ranks)
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


def _supervise(job: Job, ranks: list[Any], queue: Any, board: SharedBoard, out_dir: Path,
               on_step: Callable[[int, float, float], None] | None) -> None:
    """Wait for every rank to finish, passing on the steps they report; raise :class:`RankError` as soon as one
    fails or the job hangs."""
    from multiprocessing.connection import wait

    started = time.time()
    exited: dict[int, float] = {}  # rank -> when it was seen gone

    def drain() -> None:
        while not queue.empty():
            step = queue.get()
            if on_step is not None:
                on_step(*step)

    while True:
        alive = [p.sentinel for p in ranks if p.exitcode is None]
        if alive:
            wait(alive, timeout=PERIOD)
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
        hang = _hang(ranks, board, started, job.action_timeout_s)
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
        if ranks[r].exitcode is None and silent > timeout:
            frozen[r] = why_silent(ranks[r].pid, silent)
    hang = find_hang(snaps, ages, frozen, timeout)
    return None if hang is None else RankError(hang.rank, hang.line)


def _failure(ranks: list[Any], board: SharedBoard, out_dir: Path, exited: dict[int, float]) -> RankError:
    """The rank to blame once one has ended badly: one that died or raised while computing before one that raised
    while waiting for a peer (its peer's failure reached it), the earliest first."""
    from multiprocessing.connection import wait

    deadline = time.time() + 1.0  # the others' own failures, if they come at once, tell who came first
    while (alive := [p.sentinel for p in ranks if p.exitcode is None]) and time.time() < deadline:
        wait(alive, timeout=deadline - time.time())
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
    deadline = time.time() + 3.0
    for p in running:
        p.join(max(0.0, deadline - time.time()))
        if p.exitcode is None:
            p.kill()
            p.join()
    return len(running)


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) has set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


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
        if mine.done or mine.age <= limit(mine, self.timeout) or time.time() < self._not_before:
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
            self._not_before = time.time() + 2.0
            return
        with contextlib.suppress(Exception):
            if self.board.first_to_abort():
                print(f"pipefold: error: {hang.line}", file=sys.stderr, flush=True)
        os._exit(1)


_WATCH: _TorchrunWatch | None = None


def join_torchrun_group(action_timeout_s: float = DEFAULT_ACTION_TIMEOUT, device: str = "auto",
                        backend: str = "auto") -> tuple[int, int]:
    """Join the process group torchrun set up for this process (once), with the timeout that goes with the action
    timeout (:func:`pipefold.runtime.watch.pg_timeout`) and the backend that ``device`` and ``backend`` give on
    this node (:func:`pipefold.runtime.devices.place`), and start the rank's watch; return (rank, world size).

    The process also ends if torchrun's agent dies (the kernel's parent-death signal, on Linux)."""
    global _WATCH
    if not dist.is_initialized():
        where = local_placement(device, backend, 1)
        if where.device == "cuda":
            torch.cuda.set_device(where.device_of(int(os.environ.get("LOCAL_RANK", "0"))))
        die_with_parent()
        timeout = timedelta(seconds=pg_timeout(action_timeout_s))
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


def agree(value: Any, src: int = 0) -> Any:
    """Every rank gets rank ``src``'s ``value`` (any picklable object)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def run_torchrun(job: Job, on_step: Callable[[int, float, float], None] | None = None) -> list[RankReport] | None:
    """Run this process's rank of ``job`` as torchrun started it; rank 0 gets every rank's report, others None.

    torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the world must
    have one process per device of the schedule and data-parallel pipeline, on one machine or several.
    An exception ends the rank with :class:`RankError` (one line: the rank, what it was doing, the error).
    """
    rank, world = join_torchrun_group(job.action_timeout_s, job.device, job.backend)
    activity = torchrun_activity()
    try:
        if world != job.dp * job.schedule.devices:
            need = job.dp * job.schedule.devices
            what = f" x {job.dp} data-parallel pipelines" if job.dp > 1 else ""
            raise ConfigError(f"torchrun started {world} processes but {job.schedule.name} runs on "
                              f"{job.schedule.devices} devices{what}; set --nproc-per-node and --nnodes for {need} "
                              "in all")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        try:
            report = run_rank(job, rank, world, None, on_step, activity=activity)
            activity.wait("the end of the job", "every rank's report", [r for r in range(world) if r != rank],
                          action=False)
            gathered: list[Any] = [None] * world if rank == 0 else []
            dist.gather_object(report, gathered if rank == 0 else None, dst=0)
            activity.finish()
            _raise_if_stopped(gathered if rank == 0 else [report])  # every rank stopped at the same step
        except (ConfigError, KeyboardInterrupt):
            raise
        except Exception as exc:
            snap = activity.snapshot(0)
            peers = [r for r in snap.waits if r != rank]
            waiting = f" (waiting for {snap.what} from rank {peers[0]})" if len(peers) == 1 else ""
            line = f"{type(exc).__name__}: {exc}".strip().splitlines()
            raise RankError(rank, f"rank {rank} failed in {snap.at()}{waiting}: {line[0]}",
                            "".join(traceback.format_exception(exc))) from None
        return gathered if rank == 0 else None
    finally:
        leave_group()


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

"""A job, the one value every rank of a run receives: the schedule, the model as layers each rank builds in part,
the data, the optimizer and every cross-feature rule, checked once when it is made (:class:`Job`); what a rank
reports (:class:`RankReport`); the errors that end a job; and where ranks compute (:func:`placement`)."""


from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule
from pipefold.runtime.executor import StepStats
from pipefold.runtime.history import KEEP_FIRST, StepHistory
from pipefold.runtime.launch.devices import Placement, check_sharding, place
from pipefold.runtime.launch.faults import Faults
from pipefold.runtime.launch.processes import under_torchrun
from pipefold.runtime.launch.settings import (
    Devices,
    Optimizer,
    Parallel,
    Reliability,
    StateChunks,
    check_precision,
    check_together,
)
from pipefold.runtime.tied import spans_stages

if TYPE_CHECKING:
    from pipefold.plan.pipefisher import Refill
    from pipefold.runtime.launch.checkpoint import Checkpointing
    from pipefold.runtime.launch.netns import Topology
    from pipefold.sim.network import Network


class RankError(RuntimeError):
    """A rank raised, died or hung: ``str()`` is one line naming the rank and what it was doing; ``details`` the
    rank's traceback, where it raised."""

    def __init__(self, rank: int, message: str, details: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.details = details


class Diverged(RuntimeError):
    """The run stopped early: its loss or gradients were NaN or inf in ``Reliability.max_bad_steps`` steps in a row.
    ``str()`` is one line; ``reports`` holds what the ranks reported (``RankReport.stopped`` says the same)."""

    def __init__(self, message: str, reports: list[RankReport]) -> None:
        super().__init__(message)
        self.reports = reports


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
    optimizer: Optimizer = field(default_factory=Optimizer)
    """How the weights are stepped (the run spec's section, unchanged); with 'kfac' every stage keeps K-FAC's state
    and runs the schedule's KA, KG, KI and KP actions."""
    parallel: Parallel = field(default_factory=Parallel)
    """Data-parallel copies of the whole pipeline and tensor-parallel ranks per device: ranks dp x devices x tp,
    numbered as :meth:`coords` says; each copy runs its shard of every step's batch, and its ``DP`` actions average
    each stage's gradients across the copies (the schedule must have them: :mod:`pipefold.schedules.dataparallel`);
    with ``fsdp`` its ``AG`` and ``RS`` actions gather and reduce-scatter the sharded stages instead."""
    tp_plan: dict[int, dict[str, str]] = field(default_factory=dict)
    """With ``parallel.tp`` > 1: each layer's tensor-parallel plan, submodule -> "colwise" or "rowwise"
    (:meth:`pipefold.models.base.Model.tp_plan`); a layer not here is replicated on its tp ranks."""
    split_output: Callable[[nn.Module], tuple[str, torch.Tensor]] | None = None
    """With the output layer split by vocabulary (:attr:`Schedule.vocab`): the model's
    :meth:`~pipefold.models.base.Model.split_output`, which takes the projection out of its last layer."""
    split_input: Callable[[nn.Module], tuple[str, torch.Tensor, int | None] | None] | None = None
    """With the output layer split by vocabulary: the model's :meth:`~pipefold.models.base.Model.split_input`, which
    takes the token embedding out of its first layer, split the same way (None where it returns None)."""
    reliability: Reliability = field(default_factory=Reliability)
    """Bad steps, hangs (the action timeout), the model written at the end."""
    devices: Devices = field(default_factory=Devices)
    """Where the ranks compute and how their tensors cross."""
    save_grads_of_step: int | None = None
    """Save each rank's parameter gradients after this step (for --check), before the optimizer runs."""
    save_weights: bool = False
    """Send back every parameter after the last step (``RankReport.weights``)."""
    offload: tuple[int, int] | None = None
    """(k, k'): every stage keeps at most k of its layers on the device (see pipefold.runtime.offload)."""
    recompute: tuple[int, ...] | None = None
    """For each stage, how many of its first layers recompute their activations in backward."""
    chunks: StateChunks | None = None
    """The optimizer state in chunks, placed on the device or in host memory (see pipefold.runtime.chunks)."""
    keep_steps: int = KEEP_FIRST
    """Each rank keeps the full record of its first ``keep_steps`` steps (their timelines: ``--trace``), of the
    last one and of those it is asked to check; of every other step a few numbers (:mod:`pipefold.runtime.history`),
    so that its memory stays flat over a long run."""
    log_messages: bool = False
    """Record every send and receive in each step's stats, in the order posted (to check the wire order)."""
    verify_memory_step: int | None = None
    """Measure this step's memory a second way too, with torch's own tracker (see ``_tracked_step``)."""
    network: Network | None = None
    """Emulated link conditions every send crosses (see :mod:`pipefold.runtime.comm`)."""
    origin: float | None = None
    """Wall-clock time (``time.time()``) at which the network's timeline starts; None: when the ranks start."""
    adaptive: Adaptive | None = None
    """Switch schedules between steps (``schedule`` must be ``adaptive.schedules[0]``)."""
    netns: Topology | None = None
    """Run each rank in its own network namespace of this topology (see :mod:`pipefold.runtime.launch.netns`)."""
    cycle: tuple[Schedule, ...] = ()
    """Step t runs ``cycle[t % len(cycle)]`` (K-FAC's work spread over steps, :mod:`pipefold.plan.pipefisher`);
    ``schedule`` must be ``cycle[0]``."""
    refill: Refill | None = None
    """After ``refill.after`` steps, rank 0 places K-FAC's work again from the times the ranks measured (steps
    after the first) and every rank runs the new cycle from the next step on (recorded in rank 0's
    ``RankReport.decisions`` as (first step, its :class:`~pipefold.plan.pipefisher.Filled`))."""
    tied: tuple[tuple[tuple[int, str], ...], ...] = ()
    """Weights several layers share, each as its (layer index, parameter name) pairs (``Model.tied``): where they
    fall in different stages each stage holds a copy and their gradients are summed after the step
    (:mod:`pipefold.runtime.tied`)."""
    preload: tuple[str, ...] = ()
    """Modules the local ranks' processes import before they start (``Model.preload``; torch's compiler too,
    :data:`~pipefold.runtime.launch.processes.COMPILER`, where the run compiles)."""
    checkpoint: Checkpointing | None = None
    """Save checkpoints as the run goes, and/or start from one (see :mod:`pipefold.runtime.launch.checkpoint`)."""
    faults: Faults | None = None
    """Faults a test injects (:mod:`pipefold.runtime.launch.faults`); None in normal use."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What the launcher passes through (the model's layer count, the recomputation plan...). For the tests of
    machines without a GPU, ``extra["stage_through_host"]`` makes CPU ranks send the way ranks sharing a GPU do
    (a copy made to send, off the meter once made; a copy made on arrival; :mod:`pipefold.runtime.comm`).
    ``extra["host_profile"]``, a folder, has each rank run its steps after the first under cProfile and write
    ``rankN.prof`` there (``benchmarks/host_profile.py``)."""

    def __post_init__(self) -> None:
        # What the sections are together, and what the schedule, the split and the resolved pieces must agree
        # with: checked here, so that a job made by hand is one line before any rank starts too.
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1 (got {self.steps})")
        # A device or backend this machine cannot give, or FSDP over ranks sharing a GPU: one line, before any rank
        # starts.
        check_sharding(placement(self), fsdp=self.parallel.fsdp)
        if self.keep_steps < 1:
            raise ConfigError(f"keep_steps is how many first steps each rank keeps in full: at least 1 (got "
                              f"{self.keep_steps})")
        check_together(self.parallel, self.optimizer, adaptive=self.adaptive is not None,
                       network=self.network is not None, netns=self.netns is not None,
                       offload=self.offload is not None, recompute=self.recompute is not None,
                       checkpoints=self.checkpoint is not None)
        check_precision(self.devices, self.parallel, self.optimizer, offload=self.offload is not None,
                        steps_inside=any(a.kind == Kind.OPT for row in self.schedule.actions for a in row))
        if self.devices.p2p == "sockets":
            measured = [flag for flag, on in (("--network", self.network), ("--netns", self.netns),
                                              ("--schedule adaptive-kfkb", self.adaptive)) if on is not None]
            if measured:
                raise ConfigError(f"--p2p sockets moves messages through this machine's sockets, and {measured[0]} "
                                  "emulates or measures links of the process group: use --p2p auto or gloo")
            if placement(self).backend == "nccl":
                raise ConfigError("--p2p sockets moves host memory between ranks, and NCCL moves each rank's GPU "
                                  "tensors itself: use --p2p auto, or --backend gloo")
        if self.checkpoint is not None:
            resume = self.checkpoint.resume
            if resume is not None and resume.step >= self.steps:
                raise ConfigError(f"checkpoint {resume.path} has done {resume.step} steps and the run has "
                                  f"{self.steps}: nothing left to train; give --steps above {resume.step}")
        if self.adaptive is not None and self.adaptive.schedules[0] != self.schedule:
            raise ConfigError("an adaptive job starts with its first schedule: give schedule=adaptive.schedules[0]")
        if self.cycle and (self.cycle[0] != self.schedule or self.adaptive is not None):
            raise ConfigError("a job with a cycle of schedules starts with its first (schedule=cycle[0]) and does not "
                              "adapt")
        dp, fsdp = self.parallel.copies, self.parallel.fsdp
        reducing = {a.kind for row in self.schedule.actions for a in row} & {Kind.DP, Kind.AG, Kind.RS}
        if dp > 1:
            kinds, how = (((Kind.AG, Kind.RS), "with_data_parallel(schedule, shard=True)") if fsdp
                          else ((Kind.DP,), "with_data_parallel(schedule)"))
            for kind in kinds:
                if (missing := _without(self.schedule, kind)) is not None:
                    d, st = missing
                    raise ConfigError(f"with {dp} data-parallel pipelines{' sharded' if fsdp else ''} "
                                      f"every stage needs its {kind}, but {self.schedule.name} has no {st}{kind} on "
                                      f"device {d}: add them with pipefold.schedules.dataparallel.{how}")
            if wrong := sorted(reducing - set(kinds)):
                raise ConfigError(f"{self.schedule.name} has {wrong[0]} actions, which "
                                  f"{'do not shard' if fsdp else 'shard the stages (FSDP)'}: build it with "
                                  f"pipefold.schedules.dataparallel.{how}")
        elif reducing:
            kinds_text = ", ".join(sorted(reducing))
            raise ConfigError(f"{self.schedule.name} reduces across data-parallel pipelines ({kinds_text} actions) "
                              "but the job has one pipeline: give dp > 1 or a schedule without them")
        if fsdp and self.verify_memory_step is not None:
            raise ConfigError("FSDP shards each stage across data-parallel pipelines: it takes no memory check")
        in_schedule = any(a.kind == Kind.OPT for row in self.schedule.actions for a in row)
        if self.parallel.zero1 and in_schedule:
            raise ConfigError(f"{self.schedule.name} steps each stage's optimizer inside the step (OPT actions), "
                              "where ZeRO-1 steps after it: use a schedule without OPT actions, or drop --zero1")
        kfac = self.optimizer.name == "kfac"
        if self.refill is not None and not (self.cycle and kfac):
            raise ConfigError("refilling places K-FAC's work again: it needs a K-FAC job with a cycle")
        has_kfac = {a.kind for each in self.cycle or (self.schedule,) for row in each.actions for a in row} & {
            Kind.KA, Kind.KG, Kind.KI, Kind.KP}
        if has_kfac and not kfac:
            raise ConfigError("K-FAC needs both its actions in the schedule and its optimizer (optimizer='kfac'): "
                              "give both or neither")
        if kfac:
            for each in self.cycle or (self.schedule,):
                if (missing := _without(each, Kind.KP)) is not None:
                    d, st = missing
                    raise ConfigError(f"K-FAC preconditions every stage every step, but {each.name} has "
                                      f"no {st}KP on device {d}: fill the schedule with pipefold.plan.pipefisher "
                                      "(fill or inline)")
        split = [tie for tie in self.tied if spans_stages(tie, self.layer_stages)]
        if split:
            (i, a), (j, b) = split[0][:2]
            what = (f"tied weights (layer {i}'s {a} is layer {j}'s {b}) on different stages have their gradients "
                    "summed after the step")
            if in_schedule:
                raise ConfigError(f"{what}, but the schedule steps optimizers itself (OPT actions): use a schedule "
                                  "without OPT actions, or untie them in the model's config")
            if kfac:
                raise ConfigError(f"{what}, but K-FAC preconditions them during the step: use another optimizer, "
                                  "or untie them in the model's config")
            if fsdp:
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
            if self.chunks is not None:
                raise ConfigError("model-state chunks step the optimizer after the whole step: use a schedule without "
                                  "OPT actions with --state-chunks")
        degrees = self.degrees  # one per device, or one line
        stage_of = {i: st for st, part in enumerate(self.layer_stages) for i in part}
        # Devices that sum gradients rank by rank (a stage's replicas, a tied weight's copies) hold equal shards.
        for what, devices in [*((f"stage {st}'s replicas", self.schedule.holders(st))
                                for st in range(self.schedule.stages)),
                              *((f"the copies of tied weight {tie[0][1]} of layer {tie[0][0]}",
                                 sorted({d for i, _ in tie for d in self.schedule.holders(stage_of[i])}))
                                for tie in split)]:
            if len({degrees[d] for d in devices}) > 1:
                shown = ", ".join(f"device {d}: {degrees[d]}" for d in devices)
                raise ConfigError(f"{what} sum their gradients rank by rank, so their devices need one tensor-parallel "
                                  f"degree, but --tp {self.parallel.tp_text} gives {shown}: give them equal degrees")

    @property
    def degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degree of each pipeline device: the ranks of its mesh."""
        return self.parallel.degrees(self.schedule.devices)

    @property
    def sockets(self) -> bool:
        """Whether the ranks' messages go over this machine's sockets (:mod:`pipefold.runtime.sockets`) when the
        ranks share it: ``--p2p sockets``, or ``auto`` on gloo with links neither emulated nor measured."""
        if self.devices.p2p != "auto":
            return self.devices.p2p == "sockets"
        return (self.network is None and self.netns is None and self.adaptive is None
                and placement(self).backend == "gloo")

    @property
    def world(self) -> int:
        """Ranks of the job: the pipeline's copies (dp x cp) times the ranks of one pipeline (its devices'
        degrees)."""
        return self.parallel.copies * sum(self.degrees)

    def meshes(self) -> list[list[list[int]]]:
        """The global ranks of each copy's pipeline devices: ``meshes()[c][p]`` are device p's tensor-parallel ranks
        in copy c (copy ``d * cp + j``: data-parallel copy d's context-parallel rank j). Copies are outermost, then
        devices, a device's ranks innermost (on neighbouring ranks, which a machine's GPUs are); with one degree for
        every device this is how torch's DeviceMesh of shape (dp x cp, devices, tp) numbers them."""
        degrees, out, rank = self.degrees, [], 0
        for _ in range(self.parallel.copies):
            copy = []
            for t in degrees:
                copy.append(list(range(rank, rank + t)))
                rank += t
            out.append(copy)
        return out

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(copy, pipeline device, tensor-parallel rank on that device) of global ``rank``."""
        for d, copy in enumerate(self.meshes()):
            for p, ranks in enumerate(copy):
                if rank in ranks:
                    return d, p, ranks.index(rank)
        raise ValueError(f"rank {rank} is not in a job of {self.world} ranks")

    def pipeline_ranks(self) -> list[list[int | None]]:
        """Every pipeline's global ranks by device: pipeline ``d * T + t`` (T: the largest degree) is copy d's
        tensor-parallel rank t of each device, None on a device with fewer ranks. Groups across devices (a stage's
        replicas, a tied weight's copies) are made in a pipeline over devices of one degree."""
        top = max(self.degrees)
        return [[ranks[t] if t < len(ranks) else None for ranks in copy] for copy in self.meshes() for t in range(top)]

    def pipeline_of(self, rank: int) -> int:
        """The index in :meth:`pipeline_ranks` of global ``rank``'s pipeline."""
        copy, _, t = self.coords(rank)
        return copy * max(self.degrees) + t


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
    gathered_bytes: int = 0
    """With FSDP: the bytes of this rank's stages' parameters gathered whole and their gradients, at their last
    ``RS``: what it holds beside ``static_bytes`` (its shards) and the activations for most of a step."""
    p2p: str = "gloo"
    """What carried its activations and gradients: 'sockets' (:mod:`pipefold.runtime.sockets`), or the process
    group's backend ('gloo', 'nccl')."""
    kfac: dict[str, Any] | None = None
    """With K-FAC: what its state held and, per step, what it sent and how long it ran
    (:meth:`~pipefold.runtime.curvature.RankCurvature.report`)."""
    small_grads: tuple[int, int] = (0, 0)
    """In fp16 without a loss scale: over every step, the gradient entries (of the parameters this rank counts)
    below fp16's smallest normal number, 2^-14, where they lose precision or flush to zero, and the nonzero
    entries."""

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


def local_placement(device: str, backend: str, world: int) -> Placement:
    """Where the ranks on this machine compute and how they talk (:func:`pipefold.runtime.launch.devices.place`): all
    ``world`` ranks of a local job, this node's (LOCAL_WORLD_SIZE) under torchrun."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) if under_torchrun() else 0
    return place(device, backend, ranks=ranks or world)


def placement(job: Job) -> Placement:
    """:func:`local_placement` of the job's ranks."""
    return local_placement(job.devices.device, job.devices.backend, job.world)


def local_rank(rank: int) -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK; the rank itself when spawned here)."""
    return int(os.environ.get("LOCAL_RANK", rank)) if under_torchrun() else rank


def raise_if_stopped(reports: list[RankReport]) -> None:
    for r in reports:
        if r.stopped is not None:
            raise Diverged(r.stopped, reports)

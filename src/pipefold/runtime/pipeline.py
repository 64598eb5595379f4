"""The public pipeline object: any schedule, run inside the user's own training script.

Every rank builds one :class:`Pipeline` from the stage modules it holds, a schedule, the number of
microbatches and (on the rank with the last stage) a loss function, then calls :meth:`Pipeline.step` once per
batch inside its own loop::

    pipe = Pipeline(stage, "zb-v", microbatches=8, loss_fn=loss_fn)      # the process group: the default one
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
    for x, y in loader:
        loss = pipe.step(x, target=y)            # the batch's mean loss on the rank(s) with the last stage
        pipe.clip_grad_norm_(1.0)                # the global norm over every stage
        opt.step(); sched.step(); opt.zero_grad()

The step splits the batch into microbatches, runs this rank's actions of the schedule (forwards, backwards
split into B and W, all-reduces between replicas, data-parallel reductions) and leaves in every parameter's
``.grad`` the gradient of the batch's mean loss, as one process running the whole model would: the loss is
scaled by 1/microbatches, so a loss function that means over its microbatch gives the mean over the batch.
The optimizer, the LR schedule, clipping, ``zero_grad``, logging and checkpoints stay the user's.

The object never creates or destroys the user's process group; it makes the small groups a schedule needs
(replicas' all-reduces, tied weights) among their members only. Shapes may change between steps: every step
sends each boundary's shapes and structure first (:mod:`pipefold.runtime.structure`), so nothing hangs.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import math
import os
import statistics
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError, PipefoldError
from pipefold.ir import Action, Kind, Schedule
from pipefold.models.moe import MoE
from pipefold.plan.choose import candidates_for, probe, resolve_schedule, with_data_parallel
from pipefold.runtime import sharding
from pipefold.runtime.compiled import MODES, check_compile, compile_stage
from pipefold.runtime.curvature import RankCurvature
from pipefold.runtime.executor import COMPUTE_KINDS, RankExecutor, StepStats, exchange_times, kind_times
from pipefold.runtime.experts import (
    EXPERT,
    ExpertShard,
    balanced_stages,
    begin_balance_step,
    biased_stages,
    check_balance_order,
    check_overlap,
    expert_groups,
    shard_experts,
    step_router_biases,
    sum_balance_over,
)
from pipefold.runtime.kfac import KFACConfig
from pipefold.runtime.numerics import clip_factor, local_check, scale_grads, verdict
from pipefold.runtime.offload import Offloaded
from pipefold.runtime.partial import Reduction
from pipefold.runtime.precision import Masters, Precision, PrecisionOptimizer, unscale
from pipefold.runtime.seqchunks import split_units
from pipefold.runtime.stage import Boundaries, Tensors
from pipefold.runtime.structure import flatten, split_call, unflatten
from pipefold.runtime.tied import TiedGrads, untie
from pipefold.runtime.vocab import VocabShard
from pipefold.runtime.watch import COMPILE_GRACE, DEFAULT_ACTION_TIMEOUT, pg_timeout

__all__ = ["Check", "PeerLost", "Pipeline", "Planned", "RankPipeline", "StepReport", "step_costs", "step_result"]

StageModules = nn.Module | Sequence[nn.Module] | Mapping[int, nn.Module]


@dataclass(frozen=True)
class Check:
    """A step's global verdict, the same on every rank (one all-reduce): the gradient norm over every stage
    (each stage once, replicas and tied copies counted once), whether any loss or gradient was NaN or inf, and the
    batch's mean loss."""

    norm: float
    finite: bool
    loss: float


@dataclass
class StepReport:
    """What the last step did on every rank of the pipeline (:meth:`Pipeline.report`): measured, and predicted
    by the simulator from the same step's pass times."""

    schedule: Schedule
    steps: list[StepStats]
    """Each device's stats, in pipeline order."""
    measured_makespan: float
    """Seconds from the earliest device's start to the latest device's end of its actions."""
    predicted_makespan: float
    """What the simulator predicts for the schedule from this step's measured pass times (seconds)."""
    predicted: Any = field(repr=False, default=None)
    """The simulator's :class:`~pipefold.sim.simulate.SimResult` for it."""
    measured: Any = field(repr=False, default=None)
    """The measured step as a :class:`~pipefold.sim.simulate.SimResult` (its compute intervals and memory)."""

    @property
    def peak_bytes(self) -> list[int]:
        """Per device, the most activation bytes it held at once in the step (the runtime's meter)."""
        return [st.peak_activation_bytes for st in self.steps]

    @property
    def stage_bytes(self) -> dict[int, tuple[int, int, int]]:
        """Per stage, the most bytes one microbatch held after its F, during its B, between its B and its W."""
        return {s: m for st in self.steps for s, m in st.stage_memory.items()}

    @property
    def bubble(self) -> float:
        """The measured step's idle fraction: 1 - busy time over devices x makespan."""
        busy = sum(st.busy for st in self.steps)
        return 1.0 - busy / (len(self.steps) * self.measured_makespan) if self.measured_makespan > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Numbers to log (JSON-friendly)."""
        return {"schedule": self.schedule.name, "measured_s": self.measured_makespan,
                "predicted_s": self.predicted_makespan, "bubble": self.bubble, "peak_bytes": self.peak_bytes}

    def trace(self) -> dict[str, Any]:
        """The step as Chrome trace-event JSON (Perfetto, chrome://tracing): a row per device."""
        t0 = min(st.started_at for st in self.steps)
        events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0,
                                         "args": {"name": f"pipefold {self.schedule.name}"}}]
        for d, st in enumerate(self.steps):
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": d, "args": {"name": f"device {d}"}})
            base = (st.started_at - t0) * 1e6
            events += [{"ph": "X", "name": e.name, "cat": e.kind, "pid": 0, "tid": d, "ts": base + e.start * 1e6,
                        "dur": (e.end - e.start) * 1e6} for e in st.events]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_trace(self, path: str) -> None:
        from pipefold.files import write_json

        write_json(path, self.trace())

    def plot(self, path: str) -> None:
        """The measured step above the simulator's prediction, as a figure."""
        from pipefold.sim.render import plot_run

        plot_run(self.measured, self.predicted, path, titles=(
            f"measured: {self.schedule.name}, {self.measured_makespan * 1e3:.1f} ms",
            f"predicted from its pass times: {self.predicted_makespan * 1e3:.1f} ms"))


def _import_before_init() -> None:
    """torch imports FSDP the first time a script makes an optimizer (through torch._dynamo), and FSDP keeps the
    default process group of that moment until the interpreter shuts down, past ``destroy_process_group()`` (see
    :func:`_close_at_exit`). Imported while there is none, as a script imports pipefold before
    ``init_process_group``, it keeps nothing."""
    if not dist.is_initialized():
        import torch._dynamo  # noqa: F401


_import_before_init()
_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}
_LIVE: weakref.WeakSet[RankPipeline] = weakref.WeakSet()
"""Every pipeline of this process not yet freed: :func:`_close_at_exit` closes them."""


def _close_at_exit() -> None:
    """Before the interpreter shuts down: close every pipeline (their threads joined) and let go of every process
    group pipefold made, so that torch destroys them while Python still runs. A process group destroyed during the
    interpreter's shutdown joins gloo's worker threads then, and one that needs Python (to free a tensor it
    held) ends the process with SIGABRT ("terminate called without an active exception"): a script's clean exit
    reported as a crash, now and then."""
    for pipe in list(_LIVE):
        pipe.close()
    _GROUPS.clear()
    gc.collect()  # pipelines in reference cycles, and the process groups they hold


atexit.register(_close_at_exit)


def _kfac_config(kfac: KFACConfig | bool | None) -> KFACConfig | None:
    if kfac is None or kfac is False:
        return None
    if kfac is True:
        return KFACConfig()
    if not isinstance(kfac, KFACConfig):
        raise ConfigError(f"kfac= takes True or a KFACConfig(damping=..., ema=..., distribution=...) (got {kfac!r})")
    return kfac


def _with_kfac(schedule: Schedule) -> Schedule:
    """``schedule`` with K-FAC's actions inline (:func:`pipefold.plan.pipefisher.inline`). With W split from B,
    the first stage's curvature reads the output gradients after its W: its input needs no gradient, so its B may
    stop before its first layers, and after W every layer's output gradient has been computed."""
    from pipefold.plan import pipefisher

    splits = any(a.kind == Kind.W and a.stage == 0 for row in schedule.actions for a in row)
    return pipefisher.inline(schedule, g_from_w=frozenset({0}) if splits else frozenset()).cycle[0]


def _subgroup(ranks: list[int]) -> Any:
    """A process group of ``ranks``, made by its members only (other pipelines may make theirs meanwhile), once
    per set of ranks and default group (a script that makes its process group again gets new ones)."""
    world = id(dist.group.WORLD)
    for stale in [k for k in _GROUPS if k[0] != world]:  # of a default group since destroyed
        del _GROUPS[stale]
    key = (world, tuple(sorted(ranks)))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key[1]), use_local_synchronization=True)
    return _GROUPS[key]


class RankPipeline:
    """One rank's stage modules and the schedules it may run over them: the one way pipefold runs a schedule on
    real tensors. A user's script reaches it through :class:`Pipeline`; ``pipefold train``'s rank loop
    (:mod:`pipefold.runtime.launch.rank`) builds one from its job and steps it the same way.

    An executor (:class:`~pipefold.runtime.executor.RankExecutor`) per schedule is made when that schedule first
    runs: making one makes the process groups of its replicas, so every rank of the pipeline runs a schedule for
    the first time at the same step. ``options`` are the executors' keyword arguments (timeouts, process groups,
    what only the command line runs: K-FAC's work, OPT actions, an emulated network, tensor-parallel meshes).
    """

    def __init__(self, schedules: Sequence[Schedule], rank: int, modules: Mapping[int, nn.Module],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, device: torch.device, **options: Any) -> None:
        self.schedules = list(schedules)
        self.rank, self.modules, self.loss_fn, self.device = rank, dict(modules), loss_fn, device
        self.options = options
        self.boundaries = Boundaries()
        """The structure of each stage's input (:mod:`pipefold.runtime.structure`), shared by every executor."""
        self._executors: dict[tuple[int, bool], RankExecutor] = {}
        self.steps = 0
        self.last: StepStats | None = None
        """This rank's stats of the last step: events, peak bytes (the meter), per-stage memory."""
        self.last_schedule: Schedule | None = None
        _LIVE.add(self)

    def executor(self, index: int = 0, *, train: bool = True) -> RankExecutor:
        """The executor of schedule ``index`` (its forwards only, without ``train``), made the first time."""
        key = (index, train)
        if key not in self._executors:
            schedule = self.schedules[index]
            options = dict(self.options)
            if not train:  # evaluation: the forwards only, nothing the backward or the optimizer uses
                schedule = schedule.forward_only()
                for name in ("recompute", "optimizers", "work", "dp_group", "sharded", "spb"):
                    options.pop(name, None)
            self._executors[key] = RankExecutor(schedule, self.rank, self.modules, self._loss, self.device,
                                                boundaries=self.boundaries, **options)
        return self._executors[key]

    def made(self, index: int = 0) -> bool:
        """Whether schedule ``index``'s executor exists (it is made, with its process groups, on first use)."""
        return (index, True) in self._executors

    @property
    def executors(self) -> list[RankExecutor]:
        """The executors made so far."""
        return list(self._executors.values())

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self.loss_fn is not None
        return self.loss_fn(output, target)

    def run(self, inputs: list[Tensors], targets: list[Any], shape_key: Any = None, *, index: int = 0,
            train: bool = True, probe: Callable[[], None] | None = None) -> StepStats:
        """One step of schedule ``index`` over microbatches already cut (``inputs`` on the rank with the first
        stage, ``targets`` on the one with the last). ``shape_key``: the same on every rank, and changing when the
        batch's shapes do (None: the shapes are sent every step, so no rank needs to know)."""
        executor = self.executor(index, train=train)
        self.steps += 1
        stats = executor.run_step(inputs, targets, object() if shape_key is None else shape_key, probe=probe)
        self.last, self.last_schedule = stats, executor.schedule
        return stats

    def switch(self, schedules: Sequence[Schedule]) -> None:
        """Run these schedules from now on (over the same modules): the executors of the old ones are closed."""
        self.close()
        self.schedules = list(schedules)

    def close(self) -> None:
        """Stop the links' threads (the process group stays its owner's)."""
        for executor in self._executors.values():
            executor.close()
        self._executors.clear()


class Pipeline(RankPipeline):
    """This rank's part of a pipeline: its stage modules, run by ``schedule`` (see the module's docstring).

    ``stages``: this rank's stage modules, in increasing stage order (a module, a list, or ``{stage: module}``);
    the schedule's placement says which stages a rank holds (:meth:`stages_of`, e.g. stages 0 and 7 of 8 for a
    V shape on device 0; with Chimera or DualPipe a rank holds a stage of each replica, and the copies of a stage
    on two ranks must start from the same weights: build the model from one seed on every rank; their gradients are
    summed by the schedule's all-reduces, so they stay equal).

    ``schedule``: a name with options (``"1f1b"``, ``"kfkb:k=2"``, ``"v-half"``), a :class:`Schedule` or a
    schedule file. ``group``: the process group of the pipeline's ranks, in pipeline order (default: every rank);
    or ``mesh``: a DeviceMesh with a ``"pp"`` dimension (and ``"dp"``, ``"tp"`` as the stage modules use them, and
    ``"cp"``: each sequence split over that many copies of the pipeline, :meth:`step` giving each its share and the
    stages' attention run as a ring, :mod:`pipefold.runtime.context`).
    ``loss_fn(output, target)`` on the rank(s) holding the last stage returns the microbatch's mean loss.
    ``recompute``: per stage of this rank, how many of its first layers (an ``nn.Sequential``) recompute their
    activations in backward. ``tied``: shared weights across stages, each ``{stage: "parameter.name", ...}``
    (names within the stage modules): every copy's gradient becomes their sum at the end of each step.
    ``offload=(k, k')``: each stage's layers (an ``nn.Sequential``) keep their parameters in host memory, at most
    ``k`` on the device at once, evicted ``k'`` at a time (Superpipeline's layer offloading).
    ``offload_activations``: the share (0..1, ``"all"``) of the (stage, microbatch)s whose saved activations go to
    host memory after their forward and come back before their backward, the longest-lived first (PipeOffload);
    a schedule that has OF and RL actions already runs them without it.
    ``precision``: ``"bf16"`` or ``"fp16"`` (autocast, float32 parameters), ``"bf16-master"`` (parameters in bf16,
    float32 gradients and master weights), or a :class:`~pipefold.runtime.precision.Precision` (fp16 runs with a
    dynamic loss scale); step the optimizer through :meth:`optimizer` then. ``compile``: ``True``/``"split"`` or
    ``"whole"`` compiles each stage's layers with torch.compile (``compile_backend``), the backward still split
    into B and W (:mod:`pipefold.runtime.compiled`).
    ``action_timeout``: seconds an action may wait for another rank before the step fails.
    ``spb``: structured partial backpropagation, one number per data-parallel copy (a mesh's ``"dp"``): copy i
    backpropagates through the last ``spb[i]`` layers of the model (the stage modules' children, counted over every
    stage), its first layers running without autograd, and each layer's gradient is the mean over the copies that
    computed it, reduced among them and sent from the first of them to the others (docs/spb.md); the step's
    :class:`StepStats` (``pipe.last``) counts the bytes this rank sent (``dp_sent``).
    ``expert_parallel``: on a mesh with ``"dp"``, every mixture-of-experts layer's experts spread over the copies,
    reached by all-to-all (:mod:`pipefold.runtime.experts`): ``True`` over all of them, a number ``ep`` (2 or more,
    dividing the copies) over groups of ``ep`` consecutive copies, each group holding every expert once and each
    expert's gradient summed over the groups' copies of it. ``ep_overlap``: the schedule's overlapped pairs (dualpipe,
    dualpipev, ``1f1b:combined=1``) run one part's all-to-alls while the other part computes (on a GPU their two
    streams do this already); each step's :class:`StepStats` has the seconds of exchange per pass (``exchanges``)
    and those nothing computed under (``exchange_exposed``).
    ``kfac``: ``True`` or a :class:`~pipefold.runtime.kfac.KFACConfig`: every step builds each stage's K-FAC
    curvature right after the passes it reads, inverts the factors after the stage's last pass and preconditions its
    gradients before :meth:`step` returns (PipeFisher's actions, placed inline); the user's optimizer then steps the
    preconditioned gradients (SGD with momentum is what K-FAC is tuned for). On a mesh with ``"dp"``, the factors
    are built from every copy's microbatches: DP-KFAC (each layer's inversion and preconditioning on one copy, the
    result broadcast) or D-KFAC (every copy does all of it), as ``KFACConfig.distribution`` says
    (docs/dpkfac.md); :meth:`kfac_report` says what this rank held, sent and spent.
    """

    def __init__(self, stages: StageModules, schedule: str | Schedule | os.PathLike[str], *,
                 microbatches: int | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 group: Any = None, mesh: Any = None, device: torch.device | str | None = None,
                 recompute: Mapping[int, int] | None = None, tied: Sequence[Mapping[int, str]] = (),
                 memory_budget: float | None = None, offload: tuple[int, int] | None = None,
                 precision: Precision | str | torch.dtype | None = None, compile: bool | str = False,
                 compile_backend: str = "inductor", action_timeout: float = DEFAULT_ACTION_TIMEOUT,
                 offload_activations: float | str | None = None, vocab: VocabShard | None = None,
                 embedding: VocabShard | None = None, spb: Sequence[int] | None = None,
                 kfac: KFACConfig | bool | None = None, expert_parallel: bool | int = False,
                 ep_overlap: bool = False) -> None:
        if not dist.is_initialized():
            raise ConfigError("Pipeline needs torch.distributed's process group: call "
                              "torch.distributed.init_process_group() first (torchrun sets its environment)")
        if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                         or microbatches < 1):
            raise ConfigError(f"microbatches must be a positive integer (got {microbatches!r})")
        self.mesh = mesh
        pp_group, dp_group, tp_group, cp_group = self._groups(group, mesh)
        self.group = pp_group
        """The pipeline's process group (None: the default group, every rank)."""
        self.ranks = list(dist.get_process_group_ranks(pp_group)) if pp_group is not None else \
            list(range(dist.get_world_size()))
        me = dist.get_rank()
        if me not in self.ranks:
            raise ConfigError(f"rank {me} is not in the pipeline's process group (ranks {self.ranks})")
        self.rank = self.ranks.index(me)
        """This rank's device in the pipeline."""
        self.plan: list[Planned] = []
        """With ``schedule="auto"``: every candidate the first step's measurements predicted, fastest first."""
        self.chosen: str | None = None
        """With ``schedule="auto"``: the schedule it runs from the second step on, once the first has run."""
        self._candidates: list[Schedule] = []
        if isinstance(schedule, str) and schedule == "auto":
            if microbatches is None:
                raise ConfigError("schedule='auto' needs the number of microbatches: Pipeline(..., microbatches=N)")
            self._candidates = candidates_for(_placement_of(stages, len(self.ranks), self.rank), len(self.ranks),
                                              microbatches)
            self.schedule = probe(self._candidates)
        else:
            if memory_budget is not None:
                raise ConfigError("memory_budget= is what schedule='auto' plans for; with a named schedule leave it "
                                  "out")
            self.schedule = resolve_schedule(schedule, len(self.ranks), microbatches)
        if memory_budget is not None and (isinstance(memory_budget, bool) or not memory_budget > 0):
            raise ConfigError(f"memory_budget is a positive number of bytes (got {memory_budget!r})")
        self.memory_budget = memory_budget
        if self.schedule.seq_chunks > 1:
            _check_chunks(self.schedule.seq_chunks, recompute=bool(recompute), offload=offload is not None,
                          activations=offload_activations is not None, mesh=mesh)
        if self.schedule.is_forward_only:
            raise ConfigError(f"{self.schedule.name} runs forwards only; a Pipeline trains with a schedule that has "
                              "backwards and evaluates with the same schedule's forwards (Pipeline.forward)")
        modules = self._stage_map(stages)
        self.device = torch.device(device) if device is not None else _device_of(modules)
        last = self.schedule.stages - 1
        self.vocab = vocab
        """This rank's shard of the output projection, with a schedule that splits it by vocabulary."""
        self.embedding = embedding
        """This rank's shard of the input embedding, split by vocabulary with the output layer (None: the
        embedding, if any, is the first stage's)."""
        if self.schedule.vocab or vocab is not None or embedding is not None:
            _check_vocab(self.schedule, vocab, embedding, mesh=mesh, precision=precision,
                         activations=offload_activations is not None)
        if last in modules and loss_fn is None and not self.schedule.vocab:
            raise ConfigError(f"this rank (device {self.rank}) holds the last stage ({last}): give it the loss "
                              "function, Pipeline(..., loss_fn=fn), fn(output, target) -> the microbatch's mean loss")
        if self.schedule.seq_chunks > 1:
            c = self.schedule.seq_chunks
            self._check_declared(modules, f"a schedule over sequence chunks (seq_chunks {c})", "attention over "
                                 "sequence chunks", "use a schedule without seq_chunks", "for seq_chunks")
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        """The context-parallel ring: the copies that hold the other shares of this rank's sequences (None: the
        sequences are whole on every rank)."""
        self.cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        self.cp_rank = dist.get_rank(self.cp_group) if self.cp_group is not None else 0
        """Which share of each sequence this rank's copy holds (:func:`~pipefold.runtime.context.shard_sequence`)."""
        if self.cp_group is not None:
            self._context_parallel(modules, tp_group)
            # The copies that split a sequence hold the same weights: their gradients are averaged with the data-
            # parallel copies', dp x cp of them, by the same DP actions (and ZeRO-1 shards over them all).
            dp_group = _subgroup(_copies(mesh))
        self.dp_group, self.tp_group = dp_group, tp_group
        self.sharded = any(_is_fsdp(m) for m in modules.values())
        if self.sharded and self.cp_group is not None:
            raise ConfigError("FSDP stages do not run with a 'cp' mesh dimension in a Pipeline yet: give plain stage "
                              "modules (pipe.zero1 shards the optimizer state over the dp x cp copies)")
        if self.sharded and (dp_group is None or not all(_is_fsdp(m) for m in modules.values())):
            raise ConfigError("FSDP stages need a DeviceMesh with a 'dp' dimension (Pipeline(..., mesh=mesh)) and "
                              "every stage module of the rank sharded with fully_shard on it")
        self._dp = dp_group is not None and dist.get_world_size(dp_group) > 1
        if offload_activations is not None:
            self.schedule = self._offload_activations(offload_activations, offload)
        self._base = self.schedule
        if self._dp:
            self.schedule = with_data_parallel(self.schedule, shard=self.sharded)
        self.kfac = _kfac_config(kfac)
        """K-FAC's settings (None: the gradients go to the optimizer as the backward left them)."""
        if self.kfac is not None:
            precise = Precision.of(precision)
            needs: tuple[tuple[str, bool], ...] = (
                ("offload=", offload is not None), ("offload_activations=", offload_activations is not None),
                ("recompute=", bool(recompute)), ("compile=", compile is not False),
                ("FSDP stages", self.sharded), ("a 'tp' mesh dimension", tp_group is not None),
                ("a 'cp' mesh dimension", self.cp_group is not None), ("spb=", spb is not None),
                ("vocab= or embedding=", self.schedule.vocab or vocab is not None or embedding is not None),
                (f"seq_chunks {self.schedule.seq_chunks}", self.schedule.seq_chunks > 1),
                ("schedule='auto'", bool(self._candidates)),
                (f"precision={precision!r}", precise.dtype == "fp16" or precise.master_weights))
            if (what := _first_given(needs)) is not None:
                raise ConfigError(f"kfac= does not run with {what} yet: K-FAC keeps the layer inputs and output "
                                  "gradients those change; drop one of them")
            self.schedule = _with_kfac(self.schedule)
        self.experts: list[ExpertShard] = []
        """With ``expert_parallel``: this rank's share of every MoE layer's experts."""
        self.ep = 1
        """With ``expert_parallel``: the copies each MoE layer's experts are spread over (1: every copy holds all)."""
        if expert_parallel is not False:
            self.ep, self.experts = self._expert_parallel(modules, dp_group, expert_parallel, (
                ("spb=", spb is not None), ("kfac=", self.kfac is not None), ("offload=", offload is not None),
                ("FSDP stages", self.sharded), ("a 'tp' mesh dimension", tp_group is not None),
                ("a 'cp' mesh dimension", self.cp_group is not None), ("compile=", compile is not False)))
        if ep_overlap:
            if not self.experts:
                raise ConfigError("ep_overlap=True hides the all-to-alls of expert parallelism under other compute: "
                                  "give expert_parallel=True too, or drop ep_overlap")
            check_overlap(self.schedule, "ep_overlap=True", recompute=bool(recompute))
            self.experts[0].link.overlap = True
        self._biased = bool(biased_stages(modules))
        """Whether a MoE layer here balances by router bias, moved after every training step."""
        balanced = balanced_stages(modules)
        self._balanced = bool(balanced)
        if balanced:  # mixture-of-experts stages: their load-balancing loss over the whole batch
            check_balance_order(self.schedule, balanced)
            if self._dp:
                sum_balance_over(modules.values(), dp_group)
        self._check_weights(modules)
        untie_map = {s: nn.Sequential(m) for s, m in modules.items()}
        untie(untie_map)  # a weight two stages of this rank share: a copy each, summed as a tied weight
        self.tied = TiedGrads(_ties(tied, self.schedule.stages), self.schedule,
                              [[s] for s in range(self.schedule.stages)], self.rank, untie_map, self.device,
                              [self.ranks], 0, new_group=_subgroup) if tied else None
        if self.sharded:
            for m in modules.values():
                _prepare_fsdp(m)
        self.recompute = dict(recompute or {})
        bad = sorted(set(self.recompute) - set(modules))
        if bad:
            raise ConfigError(f"recompute names stages {bad}, but this rank holds stages {sorted(modules)}")
        self.precision = Precision.of(precision)
        """How the passes compute (:mod:`pipefold.runtime.precision`)."""
        self.precision.check_device(self.device)
        if self.precision.master_weights and (self.sharded or offload is not None or tp_group is not None):
            raise ConfigError("master weights run with plain stage modules: FSDP stages take "
                              "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)); "
                              "offloaded and tensor-parallel ones precision='bf16' (autocast)")
        self.scaler = self.precision.scaler()
        """The pipeline's loss scale (fp16), the same on every rank; None without one."""
        self.overflowed = False
        """Whether the last step's gradients had an inf or NaN (checked on every rank alike where a loss scale or
        fp16 runs): :meth:`optimizer`'s step skips it."""
        self.compiled = _compile_mode(compile)
        if self.compiled is not None:
            check_compile(compile_backend, self.device)
            modules = {s: compile_stage(m, self.compiled, compile_backend) for s, m in modules.items()}
        split = None
        if spb is not None:
            given = (("offload=", offload is not None), ("compile=", self.compiled is not None),
                     ("FSDP stages", self.sharded), ("a 'cp' mesh dimension", self.cp_group is not None),
                     ("a 'tp' mesh dimension", tp_group is not None), ("recompute=", bool(self.recompute)),
                     ("vocab= or embedding=", vocab is not None or embedding is not None),
                     ("offload_activations=", offload_activations is not None),
                     (f"seq_chunks {self.schedule.seq_chunks}", self.schedule.seq_chunks > 1))
            split = self._partial_backward(modules, spb, dp_group, _first_given(given))
        self._offloaded: list[Offloaded] = self._offload(modules, offload) if offload is not None else []
        if self._offloaded:
            modules = dict(zip(modules, self._offloaded, strict=True))
        self.timeout = action_timeout
        self.curvature = self._curvature(modules, dp_group) if self.kfac is not None else None
        """With ``kfac``: this rank's K-FAC (:class:`~pipefold.runtime.curvature.RankCurvature`)."""
        super().__init__([self.schedule], self.rank, modules, loss_fn, self.device, recompute=self.recompute,
                         timeout=pg_timeout(action_timeout, compiling=self.compiled is not None),
                         pipelines=[self.ranks], pipeline=0,
                         meshes=[[r] for r in self.ranks], dp_group=dp_group if self._dp else None,
                         sharded=self.sharded, new_group=_subgroup, autocast=self.precision.autocast, vocab=vocab,
                         embedding=embedding, spb=split, work=self.curvature)
        self.executor()  # its process groups now, on every rank at once
        if self.sharded:
            for m in modules.values():
                m.reshard()  # type: ignore[operator]  # the shards are the parameters between steps
        self._last_stage_ranks = sorted({self.ranks[d] for d in self.schedule.holders(last)})
        self._loss_group = _subgroup(self._last_stage_ranks) if len(self._last_stage_ranks) > 1 and \
            me in self._last_stage_ranks else None
        self._broadcast_replicas()
        self.masters = Masters(self.parameters(), self.precision.torch_dtype) if self.precision.master_weights \
            else None
        """The float32 master weights (``precision`` with master weights), which :meth:`optimizer` steps."""
        self._counted = self._norm_parameters()

    # -- construction

    def _expert_parallel(self, modules: Mapping[int, nn.Module], dp_group: Any, ep: bool | int,
                         given: Sequence[tuple[str, bool]]) -> tuple[int, list[ExpertShard]]:
        """Spread every MoE layer's experts over groups of ``ep`` data-parallel copies (``True``: all of them;
        :func:`~pipefold.runtime.experts.expert_groups`, :func:`~pipefold.runtime.experts.shard_experts`), refused
        in one line where there are no copies, where ``ep`` does not divide them or the experts, where the stages
        hold no MoE layer, or with what it does not run with yet. Returns ep and this rank's shards."""
        said = f"expert_parallel={ep!r}"
        if not isinstance(ep, (bool, int)) or (not isinstance(ep, bool) and ep < 2):
            raise ConfigError(f"{said} is not a number of expert-parallel ranks: give True (all the data-parallel "
                              "copies) or a number of copies of 2 or more that divides them, or leave it out")
        if not self._dp:
            raise ConfigError(f"{said} spreads each MoE layer's experts over the data-parallel copies: give a "
                              "DeviceMesh with a 'dp' dimension of 2 or more (Pipeline(..., mesh=mesh))")
        copies = dist.get_world_size(dp_group)
        size = copies if ep is True else int(ep)
        if copies % size:
            fits = [str(d) for d in range(2, copies + 1) if copies % d == 0]
            raise ConfigError(f"{said} cannot cut the {copies} data-parallel copies into groups of {size}: give a "
                              f"number that divides {copies} ({', '.join(fits)}), or True for all of them")
        if (what := _first_given(given)) is not None:
            raise ConfigError(f"{said} does not run with {what} yet: drop one of them")
        experts = sorted({m.cfg.experts for module in modules.values() for m in module.modules()
                          if isinstance(m, MoE)})
        if bad := [e for e in experts if e % size]:
            fits = [str(d) for d in range(2, copies + 1) if copies % d == 0 and all(e % d == 0 for e in experts)]
            raise ConfigError(f"{said} cannot share {bad[0]} experts equally over {size} copies: give a number of "
                              f"copies that divides both {bad[0]} and the {copies} data-parallel copies "
                              f"({', '.join(fits) or 'none above 1'}), or other experts")
        shards = shard_experts(modules.values(), *expert_groups(dp_group, size, _subgroup))
        if not shards:
            raise ConfigError(f"{said} found no MoE layer in this rank's stages "
                              "(pipefold.models.moe.MoE): drop it, or give stages with mixture-of-experts blocks")
        return size, shards

    def _curvature(self, modules: Mapping[int, nn.Module], dp_group: Any) -> RankCurvature:
        """K-FAC of this rank's stages; on a mesh with ``"dp"``, spread over the copies by ``self.kfac``'s
        distribution, through a process group of their own (its collectives never queue behind the gradients'
        all-reduce). DP-KFAC gives each layer to a copy by its inversion and preconditioning work in closed form
        (:func:`pipefold.plan.dpkfac.layer_cost`), which every copy computes alike from the layers' shapes."""
        from pipefold.plan.dpkfac import Layer, assign, layer_cost
        from pipefold.runtime.curvature import Copies, RankCurvature, StageCurvature

        assert self.kfac is not None
        stages = {s: StageCurvature(m, self.kfac, self.schedule.microbatches) for s, m in modules.items()}
        if not self._dp:
            return RankCurvature(stages)
        ranks = tuple(dist.get_process_group_ranks(dp_group))
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        owners: dict[int, tuple[int, ...]] = {s: () for s in stages}
        if self.kfac.distribution == "dp-kfac":
            layers = [(s, f.layer) for s, c in stages.items() for f in c.kfac.layers]
            costs = [layer_cost(Layer(layer.in_features + (layer.bias is not None), layer.out_features, 0))
                     for _, layer in layers]
            flat = assign(costs, len(ranks)) if layers else ()
            for s in stages:
                owners[s] = tuple(o for (t, _), o in zip(layers, flat, strict=True) if t == s)
        me = dist.get_rank(dp_group)
        for s, c in stages.items():
            c.copies = Copies(group=group, ranks=ranks, me=me, distribution=self.kfac.distribution, owners=owners[s])
        return RankCurvature(stages)

    def _partial_backward(self, modules: Mapping[int, nn.Module], spb: Sequence[int], dp_group: Any,
                          unsupported: str | None) -> Reduction:
        """Structured partial backpropagation (:mod:`pipefold.runtime.partial`): this copy's first layers (the stage
        modules' children, counted over the whole pipeline) run without autograd; returns how the data-parallel
        reduction moves each gradient among the copies that computed its layer, with the process groups that takes
        (made by their members, as the copies of this rank's device hold the same layers). Refuses in one line what
        it cannot run."""
        from pipefold.plan.spb import check, groups
        from pipefold.runtime import partial

        spb = tuple(spb)
        if any(isinstance(k, bool) or not (isinstance(k, int) and k >= 1) for k in spb) or not spb:
            raise ConfigError(f"spb= gives each data-parallel copy the number of last layers it backpropagates "
                              f"through: whole numbers >= 1, such as (4, 2) (got {spb!r})")
        if not self._dp:
            raise ConfigError("spb= splits backpropagation over data-parallel copies: give a DeviceMesh with a 'dp' "
                              "dimension of 2 or more (Pipeline(..., mesh=mesh))")
        copies = dist.get_world_size(dp_group)
        if len(spb) != copies:
            raise ConfigError(f"spb={spb} gives {len(spb)} copies their layers, and the mesh's 'dp' dimension has "
                              f"{copies}: give one number per copy")
        if unsupported is not None:
            raise ConfigError(f"spb= does not run with {unsupported} yet: drop one of them")
        empty = sorted(s for s, m in modules.items() if not list(m.children()))
        if empty:
            raise ConfigError(f"spb= counts the layers as the stage modules' children, and stage {empty[0]}'s module "
                              "has none: give each stage an nn.Sequential of its layers")
        counts: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(counts, {s: len(list(m.children())) for s, m in modules.items()}, group=self.group)
        per_stage = {s: n for each in counts for s, n in each.items()}
        layers = sum(per_stage.values())
        first = {s: sum(per_stage[t] for t in range(s)) for s in modules}
        check(spb, layers, per_stage[0], flag="spb=")
        copy, ranks = dist.get_rank(dp_group), tuple(dist.get_process_group_ranks(dp_group))
        if 0 in modules:
            partial.cut(modules[0], layers - spb[copy])
        held = [first[s] + i for s in sorted(modules) for i in range(per_stage[s])]
        made = {members: _subgroup([ranks[i] for i in members]) for members in groups(spb, held, layers)
                if copy in members}
        return partial.Reduction(spb, layers, partial.layers_of(modules, first), ranks, copy, made)

    @staticmethod
    def _groups(group: Any, mesh: Any) -> tuple[Any, Any, Any, Any]:
        if mesh is None:
            return group, None, None, None
        if group is not None:
            raise ConfigError("give the pipeline's ranks once: group= or mesh=, not both")
        names = tuple(mesh.mesh_dim_names or ())
        if "pp" not in names:
            raise ConfigError(f"the DeviceMesh has dimensions {names or '(unnamed)'}; name the pipeline's 'pp', e.g. "
                              "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'pp'))")
        unknown = sorted(set(names) - {"pp", "dp", "tp", "cp"})
        if unknown:
            raise ConfigError(f"the DeviceMesh has dimensions {unknown} that a Pipeline does not know: it reads "
                              "'pp', 'dp', 'tp' and 'cp'")
        pick = {n: mesh[n].get_group() if n in names else None for n in ("pp", "dp", "tp", "cp")}
        return pick["pp"], pick["dp"], pick["tp"], pick["cp"]

    def _context_parallel(self, modules: Mapping[int, nn.Module], tp_group: Any) -> None:
        """The stage modules made to run on this copy's share of each sequence
        (:func:`~pipefold.runtime.context.context_parallel`), after the checks that they can, the same verdict on
        every rank of the pipeline (one all-reduce): the model declares its attention and its positions somewhere
        in the pipeline, and has no attention dropout, which the ring does not run."""
        from pipefold.runtime.context import context_parallel

        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            raise ConfigError(f"context parallelism (cp {self.cp}) does not run with tensor parallelism "
                              f"(tp {dist.get_world_size(tp_group)}) yet: give the DeviceMesh one of 'cp' and 'tp'")
        self._check_declared(modules, f"context parallelism (cp {self.cp})", "context parallelism's ring attention",
                             "drop the mesh's 'cp' dimension", "for a 'cp' mesh dimension")
        for m in modules.values():
            context_parallel(m, self.cp_group, self.cp, self.cp_rank)

    def _check_declared(self, modules: Mapping[int, nn.Module], what: str, attention: str, drop: str,
                        wanted: str) -> None:
        """Refuse, with the same verdict on every rank of the pipeline (one all-reduce), a model whose stages
        declare no attention and positions for ``what`` to fill (``attend(q, k, v)`` and ``positions(t, device)``
        somewhere in the pipeline), or whose attention has dropout, which ``attention`` does not run."""
        subs = [sub for m in modules.values() for sub in m.modules()]
        attend = [sub for sub in subs if callable(getattr(sub, "attend", None))]
        dropout = [sub for sub in attend if isinstance(getattr(sub, "dropout", 0), (int, float))
                   and getattr(sub, "dropout", 0) > 0]
        counts = torch.tensor([len(attend), sum(callable(getattr(sub, "positions", None)) for sub in subs),
                               len(dropout)])
        dist.all_reduce(counts, group=self.group)
        if not counts[0] or not counts[1]:
            raise ConfigError(f"{what} fills the model's attention and positions, and these stage modules declare "
                              "no attend(q, k, v) and positions(t, device) methods (the GPT of pipefold.models has "
                              f"both): {drop} for this model")
        if counts[2]:
            raise ConfigError(f"{attention} has no attention dropout: build the model with attention dropout 0 "
                              f"(GPTConfig(dropout=0.0)) {wanted}")

    def _stage_map(self, stages: StageModules) -> dict[int, nn.Module]:
        mine = self.schedule.stages_of(self.rank)
        if isinstance(stages, nn.Module):
            given: dict[int, nn.Module] = dict(zip(mine, [stages], strict=False)) if len(mine) == 1 else {}
            count = 1
        elif isinstance(stages, Mapping):
            given, count = dict(stages), len(stages)
        else:
            listed = list(stages)
            given, count = (dict(zip(mine, listed, strict=True)) if len(listed) == len(mine) else {}), len(listed)
        if sorted(given) != mine:
            have = sorted(given) if isinstance(stages, Mapping) else f"{count} module{'s' * (count != 1)}"
            raise ConfigError(f"{self.schedule.name} puts stages {mine} on this rank (device {self.rank} of "
                              f"{self.schedule.devices}); it was given {have}: give one module per stage, in stage "
                              "order (Pipeline.stages_of tells which)")
        for s, m in given.items():
            if not isinstance(m, nn.Module):
                raise ConfigError(f"stage {s} is a {type(m).__name__}, not an nn.Module")
        return {s: given[s] for s in mine}

    def _offload_activations(self, share: float | str, offload: tuple[int, int] | None) -> Schedule:
        """The schedule with ``share`` of its (stage, microbatch)s' activations offloaded, the longest-lived first
        (:mod:`pipefold.plan.activation_offload`), alike on every rank."""
        from pipefold.plan.activation_offload import COPY_LIKE_A_FORWARD, offload_fraction, parse_share

        fraction = parse_share(share, "offload_activations=")
        if self._candidates:
            raise ConfigError("offload_activations= offloads in a schedule you name; schedule='auto' chooses among "
                              "schedules without it: name one")
        if offload is not None:
            raise ConfigError("offload_activations= moves what a stage's forward saves, and offload='s layers keep "
                              "their saves themselves: choose one of them")
        if not fraction:
            return self.schedule
        return offload_fraction(self.schedule, fraction, COPY_LIKE_A_FORWARD).schedule

    def _offload(self, modules: Mapping[int, nn.Module], offload: tuple[int, int]) -> list[Offloaded]:
        """Each stage's layers offloaded (:class:`~pipefold.runtime.offload.Offloaded`): their parameters at home
        in host memory, at most ``k`` layers of a stage on the device at once, evicted ``k'`` at a time."""
        if self.recompute or self.sharded:
            raise ConfigError("offload= runs with neither recompute= nor FSDP stages: choose one way to save memory")
        try:
            k, kprime = offload
        except (TypeError, ValueError):
            raise ConfigError(f"offload is (k, k'): at most k layers of a stage on the device, evicted k' at a time "
                              f"(got {offload!r})") from None
        out: list[Offloaded] = []
        for s, m in modules.items():
            if not isinstance(m, (nn.Sequential, nn.ModuleList)):
                raise ConfigError(f"offload= moves a stage's layers one by one: stage {s} must be an nn.Sequential "
                                  f"of layers, not a {type(m).__name__}")
            out.append(Offloaded(m, self.device, k=k, kprime=kprime))
        return out

    def _check_weights(self, modules: Mapping[int, nn.Module]) -> None:
        """A stage with W actions needs parameters to compute their gradients."""
        w = {a.stage for act in self.schedule.actions[self.rank] for a in act.passes if a.kind == Kind.W}
        for s in sorted(w):
            if not any(p.requires_grad for p in modules[s].parameters()):
                raise ConfigError(f"stage {s} has no parameter that takes a gradient, but {self.schedule.name} "
                                  f"gives it W actions (weight gradients): give the stage some of the model's "
                                  "layers, or use a schedule without the B/W split (1f1b, interleaved-1f1b, gpipe)")

    def _broadcast_replicas(self) -> None:
        """A stage two ranks hold (Chimera, DualPipe) starts from its first holder's weights on both."""
        for s, group in self.executor()._groups.items():
            src = self.ranks[self.schedule.holders(s)[0]]
            with torch.no_grad():
                for t in [*self.modules[s].parameters(), *self.modules[s].buffers()]:
                    dist.broadcast(sharding.local(t), src=src, group=group)

    def _norm_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank counts in the global norm: each stage by its first holder, each tied weight
        once, a tensor-parallel parameter by each rank for its part (replicated ones by the first), FSDP's
        shards by every copy, plain data-parallel copies by the first."""
        tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        dp_rank = dist.get_rank(self.dp_group) if self.dp_group is not None else 0
        copies = self.tied.copies if self.tied is not None else set()
        out = []
        for s, m in self.modules.items():
            if self.schedule.holders(s)[0] != self.rank or (dp_rank and not self.sharded):
                continue
            for p in m.parameters():
                if p.requires_grad and id(p) not in copies and (tp_rank == 0 or sharding.split_over(p, "tp")):
                    out.append(p)
        # An expert spread over the copies: by the copy of the first expert-parallel group that holds it (its
        # replicas in the other groups hold the same expert).
        for s, m in self.modules.items():
            if 0 < dp_rank < self.ep and self.schedule.holders(s)[0] == self.rank:
                out += [p for p in m.parameters() if p.requires_grad and getattr(p, EXPERT, False)]
        for shard in self._shards:  # each rank's own rows of the output layer and the embedding
            out += [p for p in shard.parameters() if p.requires_grad]
        return out

    @property
    def _shards(self) -> list[VocabShard]:
        """This rank's rows of the output layer and of the input embedding, where they are split by vocabulary."""
        return [s for s in (self.vocab, self.embedding) if s is not None]

    # -- what a user's loop calls

    def stages_of(self, device: int | None = None) -> list[int]:
        """The stages the schedule puts on ``device`` (this rank's, by default), in increasing order."""
        return self.schedule.stages_of(self.rank if device is None else device)

    def parameters(self) -> list[nn.Parameter]:
        """What this rank's optimizer steps: its stages' parameters (with FSDP, their shards), each once."""
        seen: dict[int, nn.Parameter] = {}
        for m in [*self.modules.values(), *self._shards]:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def zero1(self, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> Any:
        """ZeRO-1 over the mesh's ``"dp"`` (and ``"cp"``) copies: an optimizer of which this copy steps its share of
        :meth:`parameters` (``make(share)``, e.g. ``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``), keeping only its
        state, and receives the other shares from their owners after each step
        (:class:`~pipefold.runtime.zero.ShardedOptimizer`, inside :meth:`optimizer`'s wrapper). The schedule's DP
        actions average the gradients first, so the weights after each step are those of the plain optimizer."""
        from pipefold.runtime.zero import ShardedOptimizer

        if self.dp_group is None or self.sharded:
            raise ConfigError("zero1 shards the optimizer over a DeviceMesh's 'dp' copies of plain stage modules: "
                              "give Pipeline(..., mesh=mesh) with a 'dp' dimension (FSDP stages shard it already)")
        self._refuse_sharing_with_experts("zero1")
        return self.optimizer(lambda params: ShardedOptimizer(params, make, self.dp_group))

    def _refuse_sharing_with_experts(self, what: str) -> None:
        """ZeRO-1 shares the same parameters among the copies, and with expert parallelism each holds other
        experts: refused in one line."""
        if self.experts:
            raise ConfigError(f"{what} does not run with expert_parallel yet (each copy holds other experts): drop "
                              "one of them")

    def chunked(self, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                device_memory: float | str | None = None, chunk_size: float | str | None = None,
                zero1: bool = False, host_memory: float | str | None = None) -> PrecisionOptimizer:
        """Model-state chunks (PatrickStar, AxoNN): an optimizer (``make(params)``, e.g.
        ``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``, inside :meth:`optimizer`'s wrapper) whose state lives in
        chunks of ``chunk_size`` bytes of float32 (chosen from the parameters' sizes when None), each on the device
        or in host memory, host chunks stepped by the CPU (:mod:`pipefold.runtime.chunks`). They are placed at the
        first step: on the device as many as fit in what ``device_memory`` (bytes, or text such as ``"40GB"``)
        leaves after the parameters, their gradients and the first step's activation peak; the rest in host
        memory. Without ``device_memory`` every chunk stays on the device. ``zero1``: each of the mesh's ``"dp"``
        copies holds and steps its share of the chunks. With master weights (``precision="bf16-master"``) the
        chunks hold the float32 masters and their gradients too, and the device only the 16-bit parameters. A run
        whose host chunks cannot fit in host memory (``host_memory``, the system's available memory when None) is
        refused here. The weights after every step are those of ``make``'s optimizer without chunks."""
        from pipefold.runtime.chunks import ChunkedOptimizer, left_free
        from pipefold.units import parse_bytes

        if zero1:
            self._refuse_sharing_with_experts("chunked(..., zero1=True)")
        if zero1 and (self.dp_group is None or self.sharded):
            raise ConfigError("chunked(..., zero1=True) shares the chunks among a DeviceMesh's 'dp' copies of plain "
                              "stage modules: give Pipeline(..., mesh=mesh) with a 'dp' dimension")
        if self.sharded or self._offloaded or self.tp_group is not None:
            raise ConfigError("model-state chunks step the parameters of plain stage modules: FSDP stages shard their "
                              "state already, and tensor-parallel and offload= stages run without chunks")
        budget, size, host = (parse_bytes(v) if isinstance(v, str) else v
                              for v in (device_memory, chunk_size, host_memory))
        for name, value in (("device_memory", budget), ("chunk_size", size), ("host_memory", host)):
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ConfigError(f"{name} is a positive number of bytes or text such as '4MB' (got {value!r})")
        if size is not None and size < 4:
            raise ConfigError(f"chunk_size is the bytes of float32 a chunk holds, at least 4 (got {size!r})")
        if size is not None and budget is not None and size > budget:
            raise ConfigError(f"chunk_size {size:,.0f} is more than device_memory {budget:,.0f}: no chunk could ever "
                              "be on the device; give a chunk size well below it (a few MB)")
        group = self.dp_group if zero1 else None
        held = self.parameters()  # in bf16 or fp16 with master weights: the chunks hold their float32 masters

        def build(params: list[nn.Parameter]) -> ChunkedOptimizer:
            return ChunkedOptimizer(params, make, capacity=None if size is None else int(size) // 4,
                                    free=None if budget is None else lambda: left_free(budget, held, self.last),
                                    device_room=None if budget is None else left_free(budget, held, None),
                                    host_memory=host, group=group, masters=self.masters)

        return self.optimizer(build)

    def optimizer(self, make: Callable[[list[Any]], Any]) -> PrecisionOptimizer:
        """The optimizer for this rank's parameters under the pipeline's precision: ``make(params)`` (e.g.
        ``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``, or :meth:`zero1`'s kind) gets the float32 master weights
        where the parameters are held in bf16 or fp16, and its ``step()`` writes them back; a step whose gradients
        overflowed (an inf or NaN, found on every rank alike) is skipped. Any precision, float32 included."""
        return PrecisionOptimizer(make, self.parameters(), self.masters, lambda: self.overflowed)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (computes losses)."""
        return self.schedule.stages - 1 in self.modules

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (reads the batch's inputs)."""
        return 0 in self.modules

    def step(self, *inputs: Any, target: Any = None, all_ranks: bool = False, **kwinputs: Any) -> float | None:
        """Run one batch through the schedule, forwards and backwards; the gradients of the batch's mean loss are
        added into this rank's parameters' ``.grad`` (zero them before, as in any loop).

        ``inputs`` and ``kwinputs``: the first stage's arguments for the whole batch (each tensor cut into the
        microbatches along dimension 0), needed on the rank(s) holding stage 0, ignored elsewhere. ``target``: the
        batch's targets, needed where the last stage is (cut the same way). Returns the batch's mean loss on the
        ranks holding the last stage and None elsewhere; with ``all_ranks``, on every rank of the pipeline.

        With a mesh's ``"cp"`` dimension every copy of the ring is given the same whole sequences: each tensor of
        two dimensions or more (batch, tokens, ...), inputs and target, is cut along dimension 1 into 2 x cp equal
        chunks, of which this copy runs two (:func:`~pipefold.runtime.context.shard_sequence`), and the loss
        returned is the whole sequences' mean, on every copy alike.
        """
        if not torch.is_grad_enabled():
            raise ConfigError("Pipeline.step was called under torch.no_grad() (or inference_mode): it trains; "
                              "for evaluation call Pipeline.forward")
        return self._run(True, inputs, kwinputs, target, all_ranks)

    def forward(self, *inputs: Any, target: Any = None, all_ranks: bool = False,
                **kwinputs: Any) -> tuple[Any, float | None]:
        """Evaluation and inference: the schedule's forwards only, nothing kept for a backward.

        Returns ``(output, loss)``: on the rank(s) holding the last stage, its output for the whole batch (the
        microbatches' outputs joined along dimension 0) and, when ``target`` is given, the batch's mean loss; None
        elsewhere (the loss on every rank with ``all_ranks``)."""
        loss = self._run(False, inputs, kwinputs, target, all_ranks)
        executor = self.executor(train=False)
        output = None
        if executor.outputs:
            parts = [executor.outputs[mb] for mb in sorted(executor.outputs)]
            c = self.schedule.seq_chunks
            if c > 1 and len(parts) == self.schedule.microbatches:  # each microbatch's chunks side by side
                parts = [_join(parts[i:i + c], dim=1) for i in range(0, len(parts), c)]
            output = _join(parts) if len(parts) == self.schedule.data_microbatches else None
            executor.outputs = {}
            if output is not None:
                output = self._whole(output)  # every copy of the ring holds the last stage: gathered alike
        return output, loss

    def _run(self, train: bool, inputs: tuple[Any, ...], kwinputs: dict[str, Any], target: Any,
             all_ranks: bool) -> float | None:
        m, c = self.schedule.data_microbatches, self.schedule.seq_chunks
        executor = self.executor(train=train)
        # With the embedding split by vocabulary every rank looks up its rows of the tokens.
        holds = 0 in executor.runners or self.embedding is not None
        xs: list[Tensors] = [()] * (m * c)
        if holds:
            # With the parameters in bf16 or fp16, so is every floating input (autocast casts its own).
            dtype = self.precision.torch_dtype if self.precision.master_weights else None
            moved = [self._share(_to(v, self.device, dtype)) for v in inputs]
            xs, spec = split_call(tuple(moved), {k: self._share(_to(v, self.device, dtype))
                                                 for k, v in kwinputs.items()}, m)
            if c > 1:  # and each microbatch into its sequence chunks
                xs = split_units(xs, c)
            self.boundaries.specs[0] = spec
        last = self.schedule.stages - 1
        ys: list[Any] = [None] * (m * c)
        if self.schedule.vocab and not train:  # every rank computes its shard's part of the loss, or none does
            given = torch.tensor([target is not None], dtype=torch.int32, device=self.device)
            dist.all_reduce(given, group=self.group)
            if 0 < int(given) < len(self.ranks):
                raise ConfigError(f"with the output layer split by vocabulary, give Pipeline.forward the targets on "
                                  f"every rank or on none ({int(given)} of {len(self.ranks)} ranks gave them)")
        if last in executor.runners or self.schedule.vocab:
            if target is None and train:
                where = "holds a shard of the output layer" if self.schedule.vocab else \
                    f"holds the last stage ({last})"
                raise ConfigError(f"this rank {where}: give the batch's targets, Pipeline.step(..., target=y)")
            if target is not None:
                ys = _split_target(self._share(_to(target, self.device)), m)
                if c > 1:
                    ys = split_units(ys, c)
        gathered = not train and self.sharded
        if gathered:  # FSDP's shards gathered for the forwards, as the training schedule's AG does
            for module in self.modules.values():
                sharding.gather(module).wait()
        if train and self._balanced:
            begin_balance_step(self.modules.values())
        executor.activity.step = self.steps + 1  # what a peer's failure names
        executor.activity.grace = COMPILE_GRACE if self.compiled is not None and self.steps == 0 else 0.0
        executor.loss_scale = self.scaler.scale if self.scaler is not None and train else 1.0
        try:
            stats = self.run(xs, ys, train=train)  # every step sends its shapes: they may change
        except RuntimeError as exc:
            if not _lost_peer(exc):
                raise
            snap = executor.activity.snapshot(0)
            peers = [r for r in snap.waits if r != dist.get_rank()]
            whom = f"rank {peers[0]}" if len(peers) == 1 else "a rank of the pipeline"
            raise PeerLost(f"rank {dist.get_rank()}: {whom} stopped while this rank was in {snap.at()} "
                           f"({'waiting for ' + snap.what if snap.what else 'running'}): its own error says why") \
                from exc
        finally:
            if gathered:
                for module in self.modules.values():
                    module.reshard()  # type: ignore[operator]
        for wrapper in self._offloaded:
            wrapper.evict_all()  # every layer home, with its gradient, before the user's optimizer reads it
        if train and self.tied is not None:
            self.tied.reduce()
        if train:
            self._after_backward()
        if train and self._biased:
            step_router_biases(self.modules.values(), self.dp_group if self._dp else None)
        if train and self._candidates and not self.plan:
            self._choose()
        losses = list(stats.losses.values())
        loss = math.fsum(losses) / len(losses) if losses else None
        if len(self._last_stage_ranks) > 1 or all_ranks or self.cp_group is not None:
            loss = self._gather_loss(losses, all_ranks)
        return loss

    def _share(self, value: Any) -> Any:
        """With context parallelism, this copy's share of each sequence in ``value``: every tensor of two dimensions
        or more cut along dimension 1 (batch, tokens, ...) into 2 x cp chunks, of which it keeps two
        (:func:`~pipefold.runtime.context.shard_sequence`); other values whole."""
        if self.cp_group is None:
            return value
        from torch.utils import _pytree as pytree

        from pipefold.runtime.context import shard_sequence

        def cut(v: Any) -> Any:
            if not isinstance(v, torch.Tensor) or v.dim() < 2:
                return v
            if v.size(1) % (2 * self.cp):
                raise ConfigError(f"context parallelism (cp {self.cp}) splits each sequence into {2 * self.cp} "
                                  f"equal chunks along dimension 1, and a tensor of shape {tuple(v.shape)} has "
                                  f"{v.size(1)} tokens: give sequences of a multiple of {2 * self.cp} tokens")
            return shard_sequence(v, self.cp, self.cp_rank, dim=1)
        return pytree.tree_map(cut, value)

    def _whole(self, value: Any) -> Any:
        """With context parallelism, the whole sequences of ``value`` (an output), every copy's shares gathered
        along dimension 1 and put back in order."""
        if self.cp_group is None:
            return value
        from torch.utils import _pytree as pytree

        from pipefold.runtime.context import unshard_sequence

        def join(v: Any) -> Any:
            if not isinstance(v, torch.Tensor) or v.dim() < 2:
                return v
            pieces = [torch.empty_like(v) for _ in range(self.cp)]
            dist.all_gather(pieces, v.contiguous(), group=self.cp_group)
            return unshard_sequence(pieces, dim=1)
        return pytree.tree_map(join, value)

    def _after_backward(self) -> None:
        """With a loss scale: the gradients divided by it, the overflow verdict taken on every rank alike and the
        scale updated. In fp16 without one: the verdict alone (a step with an inf is skipped)."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is None and self.precision.dtype != "fp16":
            return
        unscale(self.parameters(), scale)
        self.overflowed = not self.check().finite
        if self.scaler is not None:
            self.scaler.update(self.overflowed)

    def _choose(self) -> None:
        """``auto``: after the first step (run with a schedule that splits B and W), predict every candidate from
        that step's pass times and bytes, on every rank alike, and run the fastest that fits the budget from now
        on. Data-parallel copies and tensor-parallel ranks take their first member's choice."""
        from pipefold.sim.simulate import simulate

        steps = self._gather_steps()
        costs = step_costs(steps, self.schedule)
        plan = []
        for candidate in self._candidates:
            result = simulate(candidate, costs)
            plan.append(Planned(str(_ref(candidate)), result.makespan, max(result.peak_memory)))
        fits = [i for i, pt in enumerate(plan) if self.memory_budget is None or pt.peak <= self.memory_budget]
        if not fits:
            least = min(plan, key=lambda pt: pt.peak)
            raise ConfigError(f"no schedule for these stages fits a memory budget of {self.memory_budget:.0f} bytes "
                              f"of activations a device; the least is {least.schedule}'s {least.peak:.0f}")
        index = torch.tensor([min(fits, key=lambda i: (plan[i].makespan, plan[i].peak, i))])
        for group in (self.dp_group, self.tp_group):
            if group is not None:
                dist.broadcast(index, src=dist.get_process_group_ranks(group)[0], group=group)
        chosen = self._candidates[int(index)]
        self.plan = sorted(plan, key=lambda pt: (pt.makespan, pt.peak))
        self.chosen = str(_ref(chosen))
        if chosen is not self._base:
            self._base = chosen
            if self._dp:
                chosen = with_data_parallel(chosen, shard=self.sharded)
            self.schedule = chosen
            self.switch([chosen])
            self.executor()  # its process groups, on every rank at this same step

    def _gather_steps(self) -> list[StepStats]:
        assert self.last is not None
        gathered: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(gathered, self.last, group=self.group)
        return gathered

    def _gather_loss(self, losses: list[float], all_ranks: bool) -> float | None:
        """The batch's mean loss from the ranks that computed some of it (two with Chimera or DualPipe)."""
        mine = dist.get_rank() in self._last_stage_ranks
        t = torch.tensor([math.fsum(losses), float(len(losses))], dtype=torch.float64)
        if all_ranks:
            dist.all_reduce(t, group=self.group)
        elif mine and self._loss_group is not None:
            dist.all_reduce(t, group=self._loss_group)
        if self.cp_group is not None and (all_ranks or mine):
            dist.all_reduce(t, group=self.cp_group)  # the ring's copies computed the other shares of the sequences
        if not all_ranks and not mine:
            return None
        return float(t[0] / t[1]) if t[1] > 0 else None

    # -- the gradients after a step

    def check(self) -> Check:
        """The step's global gradient norm, NaN/inf verdict and mean loss, on every rank alike: one all-reduce per
        dimension of the layout (pipeline, data-parallel copies, tensor-parallel ranks)."""
        losses = list(self.last.losses.values()) if self.last is not None else []
        summed = local_check(self._counted, losses, self.device)
        for group in self._check_groups():
            dist.all_reduce(summed, group=group)
        norm, bad, loss = verdict(summed)
        return Check(norm, not bad, loss)

    def _check_groups(self) -> list[Any]:
        groups = [self.group]
        if self.dp_group is not None:
            groups.append(self.dp_group)
        if self.tp_group is not None:
            groups.append(self.tp_group)
        return groups

    def grad_norm(self) -> float:
        """The global gradient norm (L2 over every stage's parameters, each counted once), on every rank alike."""
        return self.check().norm

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient so the global norm is at most ``max_norm``; returns the norm before (NaN or inf:
        nothing is scaled, as the step should be skipped: :meth:`check`)."""
        norm = self.grad_norm()
        factor = clip_factor(norm, max_norm) if math.isfinite(norm) else None
        if factor is not None:
            scale_grads(self.parameters(), factor)
        return norm

    # -- seeing what it did

    def kfac_report(self) -> dict[str, Any]:
        """With ``kfac``: what this rank's K-FAC holds (``state_bytes``), sends per step (``sent``, bytes by what
        they carried: 'factors', 'rows', 'preconditioned', the names of :class:`pipefold.plan.dpkfac.PerCopy`) and
        spends per step (``seconds``), over the steps run so far, and its ``distribution`` (None on one copy)."""
        if self.curvature is None:
            raise ConfigError("this Pipeline runs without K-FAC: make it with Pipeline(..., kfac=True)")
        return self.curvature.report(self.steps)

    def report(self) -> StepReport:
        """The last step on every device of the pipeline (collective: every rank of it calls it): the meter's
        memory, the timeline and the simulator's prediction from the step's own pass times."""
        from pipefold.sim.simulate import simulate

        if self.last is None:
            raise ConfigError("Pipeline.report() reads the last step: call Pipeline.step first")
        steps = self._gather_steps()
        schedule = self.last_schedule
        assert schedule is not None
        measured = step_result(steps, schedule)
        compute_only = schedule.with_actions([[a for a in row if all(p.kind in (Kind.F, Kind.B, Kind.W, Kind.BW)
                                                                     for p in a.passes)] for row in schedule.actions])
        predicted = simulate(compute_only, step_costs(steps, schedule))
        t0 = min(st.started_at for st in steps)
        makespan = max(st.started_at - t0 + max((e.end for e in st.events if e.kind in COMPUTE_KINDS), default=0.0)
                       for st in steps)
        return StepReport(schedule, steps, makespan, predicted.makespan, predicted, measured)


@dataclass(frozen=True)
class Planned:
    """One candidate of ``schedule="auto"``, predicted from the first step's pass times and bytes."""

    schedule: str
    makespan: float
    """Predicted seconds of a step's passes."""
    peak: float
    """Predicted most activation bytes a device holds at once."""


def _ref(schedule: Schedule) -> Any:
    from pipefold.ir.ref import ScheduleRef

    return ScheduleRef.of(schedule)


_DERIVED = ("F", "B", "W", "BW", "OPT")
"""Kinds whose time the cost model derives from f, b, w and opt."""


def step_costs(steps: Sequence[StepStats], schedule: Schedule) -> Any:
    """The cost model of one measured step (each device's stats): per stage, the median seconds of its F, B and W
    (a fused BW counts as B + W, split evenly) and of any other work it ran (K-FAC's), and the bytes one
    microbatch held after F, while B ran and between B and W (with sequence chunks, c times a chunk's); with the
    output layer split by vocabulary, its S and T times (not the logits they keep); with expert parallelism, the
    seconds of a forward's and a backward's exchanges apart from their compute (from steps whose overlapped pairs
    ran one part after the other: where they overlap, a part's interval holds the other part's compute too)."""
    from pipefold.sim.simulate import CostModel, of_microbatch, split_backward

    times = kind_times(steps)
    memory = {s: mem for st in steps for s, mem in st.stage_memory.items()}
    moved = {s: b for st in steps for s, b in st.offloaded.items()}
    copies = _copy_times(steps)
    exchanges = exchange_times(steps)
    over = {}
    for s in range(schedule.stages):
        held, during_b, held_w = memory.get(s, (0, 0, 0))
        # Other work the stage ran (K-FAC's), for the kinds whose time the cost model takes as given.
        work = {k: v for k, v in times.get(s, {}).items() if k not in _DERIVED and k not in (Kind.S, Kind.T)}
        over[s] = dataclasses.replace(split_backward(times.get(s, {})), memory=float(max(held, during_b)),
                                      kept=float(held), memory_w=float(held_w or held), work=work or None,
                                      offloaded=float(moved[s]) if s in moved else None, offload=copies.get(s))
        if s in exchanges:  # a pass's expert exchanges apart from its compute (measured one after the other)
            xf, xb = exchanges[s]
            o = over[s]
            over[s] = dataclasses.replace(o, f=max(0.0, o.f - xf), b=max(0.0, o.b - xb), exchange_f=xf,
                                          exchange_b=xb, bw=None if o.bw is None else max(0.0, o.bw - xb))
    # With the output layer split by vocabulary, each device's S and T took a devices-th of the whole layer's
    # forward and backward (the cost model's vocab_*, as the simulator divides them): their medians over every
    # device, the backward's split evenly between B and W.
    whole_s = whole_t = 0.0
    each = {k: [t[k] for t in times.values() if k in t] for k in (Kind.S, Kind.T)}
    if schedule.vocab and all(each.values()):
        whole_s = schedule.devices * statistics.median(each[Kind.S])
        whole_t = schedule.devices * statistics.median(each[Kind.T])
    # With sequence chunks a pass was a chunk's: the cost model is of whole microbatches (the simulator cuts them).
    return of_microbatch(CostModel(stage_overrides=over, vocab_f=whole_s, vocab_b=whole_t / 2, vocab_w=whole_t / 2),
                         schedule.seq_chunks)


def _copy_times(steps: Sequence[StepStats]) -> dict[int, float]:
    """Per stage that offloaded activations, the median seconds of its offloads and reloads (as the rank's events
    saw them: on a GPU the time to start the copies, on a CPU the copies themselves)."""
    spans: dict[int, list[float]] = {}
    for st in steps:
        for e in st.events:
            if e.kind in (Kind.OF, Kind.RL):
                spans.setdefault(Action.parse(e.name).stage, []).append(e.end - e.start)
    return {s: statistics.median(v) for s, v in spans.items()}


def step_result(steps: Sequence[StepStats], schedule: Schedule) -> Any:
    """One measured step (each device's stats, in device order) as a :class:`~pipefold.sim.simulate.SimResult`: its
    compute intervals and memory curves, in seconds from the earliest device's start, and bytes."""
    from pipefold.sim.simulate import CostModel, Interval, MemoryCurves, SimResult, Timeline

    t0 = min(st.started_at for st in steps)
    rows, curves = [], []
    for st in steps:
        shift = st.started_at - t0
        rows.append(tuple(Interval(Action.parse(e.name), shift + e.start, shift + e.end)
                          for e in st.events if e.kind in COMPUTE_KINDS))
        curves.append(((0.0, 0.0), *((shift + t, float(b)) for t, b in st.memory_curve)))
    return SimResult(schedule, CostModel(), Timeline.of(rows), MemoryCurves.of(curves))


def _first_given(options: Sequence[tuple[str, bool]]) -> str | None:
    """The first of ``options`` (what it is called, whether it was given) that was given: what a feature that does
    not run with it yet names in its one-line refusal."""
    return next((what for what, on in options if on), None)


def _placement_of(stages: StageModules, devices: int, rank: int) -> tuple[int, ...]:
    """The placement the stage modules given to ``schedule="auto"`` have: one stage a device, two in a V (stages
    d and 2P-1-d), or ``v`` looped (d, d+P, ...)."""
    from pipefold.ir import v_placement
    from pipefold.ir.schedule import linear_placement, looped_placement

    if isinstance(stages, nn.Module):
        count, keys = 1, None
    elif isinstance(stages, Mapping):
        count, keys = len(stages), sorted(stages)
    else:
        count, keys = len(list(stages)), None
    if count == 1:
        return linear_placement(devices)
    if count == 2 and (keys is None or keys == [rank, 2 * devices - 1 - rank]):
        return v_placement(devices)
    if keys is not None and keys == [rank + i * devices for i in range(count)]:
        return looped_placement(devices, count)
    raise ConfigError(f"schedule='auto' plans for one stage a rank, two in a V ({{d: ..., 2P-1-d: ...}}), or "
                      f"looped ones ({{d: ..., d+P: ...}}); this rank was given {keys or count}")


class PeerLost(PipefoldError):
    """Another rank of the pipeline stopped during a step (its own error says why): this rank cannot go on."""


def _lost_peer(exc: BaseException) -> bool:
    """Whether an error of the links is a peer's process gone (gloo's words for a closed connection)."""
    text = f"{exc} {exc.__cause__ or ''}"
    return any(w in text for w in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


# -- helpers

def _copies(mesh: Any) -> list[int]:
    """The global ranks of this rank's copies in ``mesh``: those at its place in every dimension but 'dp' and 'cp'
    (the same stages, the same tensor-parallel share), which hold the same weights."""
    names = list(mesh.mesh_dim_names)
    here = mesh.get_coordinate()
    assert here is not None
    index = tuple(slice(None) if n in ("dp", "cp") else here[i] for i, n in enumerate(names))
    return [int(r) for r in mesh.mesh[index].flatten().tolist()]


def _device_of(modules: Mapping[int, nn.Module]) -> torch.device:
    for m in modules.values():
        for t in [*m.parameters(), *m.buffers()]:
            return sharding.local(t).device if not t.is_meta else torch.device("cpu")
    return torch.device("cpu")


def _is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is sharded with FSDP, without importing FSDP: a module cannot be FSDP's unless the script
    imported it, and importing it after ``init_process_group`` makes torch hold the default process group until the
    interpreter shuts down (see :func:`_close_at_exit`)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    return kind is not None and isinstance(module, kind)


def _prepare_fsdp(module: nn.Module) -> None:
    """A stage the user sharded with ``fully_shard``: made FSDP's root, accumulating, gathered, as
    :func:`pipefold.runtime.sharding.shard` leaves its own."""
    from torch.distributed.fsdp import fully_shard

    fully_shard.state(module)._lazy_init()  # type: ignore[attr-defined]
    sharding._accumulate(module)
    sharding.gather(module).wait()


def _ties(tied: Sequence[Mapping[int, str]], stages: int) -> list[tuple[tuple[int, str], ...]]:
    out = []
    for tie in tied:
        if not isinstance(tie, Mapping) or len(tie) < 2:
            raise ConfigError(f"a tied weight is {{stage: 'parameter.name', ...}} over two stages or more "
                              f"(got {tie!r})")
        for s in tie:
            if not isinstance(s, int) or not 0 <= s < stages:
                raise ConfigError(f"a tied weight names stage {s!r}, but the schedule has stages 0..{stages - 1}")
        # The runtime's TiedGrads names a weight by (layer, name): here each stage is its one layer.
        out.append(tuple((s, name) for s, name in sorted(tie.items())))
    return out


def _to(value: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``value``'s tensors on ``device`` (its floating ones in ``dtype`` where given)."""
    from torch.utils import _pytree as pytree

    def move(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        return v.to(device, dtype) if dtype is not None and v.is_floating_point() else v.to(device)
    return pytree.tree_map(move, value)


def _compile_mode(value: bool | str | None) -> str | None:
    if value is None or value is False:
        return None
    if value is True:
        return "split"
    if isinstance(value, str) and value in MODES:
        return value
    raise ConfigError(f"compile is True, 'split' or 'whole' (got {value!r})")


def _split_target(target: Any, parts: int) -> list[Any]:
    tensors, spec = flatten(target, call=True)
    for t in tensors:
        if t.dim() == 0 or t.shape[0] % parts:
            raise ConfigError(f"a target of shape {tuple(t.shape)} does not split into {parts} equal microbatches "
                              "along dimension 0")
    cut = [t.chunk(parts) for t in tensors]
    return [unflatten(spec, [c[j] for c in cut]) for j in range(parts)]


def _check_vocab(schedule: Schedule, vocab: VocabShard | None, embedding: VocabShard | None, *, mesh: Any,
                 precision: Any, activations: bool) -> None:
    """The output layer split by vocabulary takes a shard on every rank, with a schedule that splits it, over a
    mesh of one pipeline, in float32 (one line each otherwise); so does the input embedding, with it."""
    if vocab is not None and not schedule.vocab:
        raise ConfigError(f"vocab= gives this rank a shard of the output layer, and {schedule.name} keeps it on the "
                          "last stage: name a schedule with vocab=1 (e.g. 'v-half:vocab=1'), or leave vocab= out")
    if embedding is not None and not schedule.vocab:
        raise ConfigError(f"embedding= splits the input embedding by vocabulary with the output layer, and "
                          f"{schedule.name} keeps the output layer on the last stage: name a schedule with vocab=1 "
                          "(e.g. 'v-half:vocab=1'), or leave embedding= out")
    for name, shard, of in (("vocab", vocab, "weight"), ("embedding", embedding, "embedding.weight")):
        if shard is not None and not isinstance(shard, VocabShard):
            raise ConfigError(f"{name}= is this rank's VocabShard (VocabShard.of({of}, rank, devices)), got "
                              f"{type(shard).__name__}")
    if mesh is not None and any(n in (mesh.mesh_dim_names or ()) and mesh[n].size() > 1 for n in ("dp", "tp", "cp")):
        raise ConfigError("the output layer split by vocabulary runs in a pipeline without dp, tp or cp copies yet: "
                          "give a mesh of 'pp' alone, or a schedule without vocab=1")
    if precision is not None and Precision.of(precision).dtype not in ("fp32", "float32"):
        raise ConfigError("the output layer split by vocabulary computes in float32 (or the parameters' own dtype) "
                          "yet: leave precision= out")
    if activations:
        raise ConfigError("offload_activations= does not run with the output layer split by vocabulary yet: leave "
                          "one of them out")


def _check_chunks(chunks: int, *, recompute: bool, offload: bool, activations: bool, mesh: Any) -> None:
    """Refuse in one line what a schedule over sequence chunks does not run with yet."""
    dims = set(mesh.mesh_dim_names or ()) if mesh is not None else set()
    other = [what for what, on in (("recompute=", recompute), ("offload=", offload),
                                   ("offload_activations=", activations), ("a mesh's 'cp'", "cp" in dims),
                                   ("a mesh's 'tp'", "tp" in dims)) if on]
    if other:
        raise ConfigError(f"a schedule over sequence chunks (seq_chunks {chunks}) does not run with {other[0]} yet: "
                          "leave it out, or use a schedule without seq_chunks")


def _join(parts: list[Any], dim: int = 0) -> Any:
    from torch.utils import _pytree as pytree

    leaves = [pytree.tree_flatten(p) for p in parts]
    tree = leaves[0][1]
    joined = [torch.cat(vs, dim) if isinstance(vs[0], torch.Tensor) and vs[0].dim() > dim else vs[0]
              for vs in zip(*(ls for ls, _ in leaves), strict=True)]
    return pytree.tree_unflatten(joined, tree)

"""The parts of a run's description that the ranks read, each a small value checked when it is made: how the
weights are stepped (:class:`Optimizer`), the data-parallel layout (:class:`Parallel`), what keeps a long run
safe (:class:`Reliability`) and where the ranks compute (:class:`Devices`).

They are sections of the run spec (:class:`pipefold.train.spec.RunSpec`), which the command line and plan files
build, and a :class:`~pipefold.runtime.launch.job.Job` carries the same values to every rank unchanged. Each checks its
own fields; the rules that join two sections are :func:`check_together`, the one place they are written, which
both the run spec and a job made by hand go through.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipefold.errors import ConfigError
from pipefold.runtime.watch import DEFAULT_ACTION_TIMEOUT

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pipefold.runtime.kfac import KFACConfig


def _sgd(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(params, **kwargs)


def _adamw(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    import torch

    return torch.optim.AdamW(params, **kwargs)


def _momentum_sgd(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(params, momentum=0.9, **kwargs)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"sgd": _sgd, "adamw": _adamw, "kfac": _momentum_sgd}
"""The optimizers named as text, each made with the run's learning rate (torch imported when one is made: the
settings load without it). ``kfac`` is SGD with momentum 0.9 on the
gradient that the schedule's K-FAC actions precondition."""


def flag(name: str, option: str | None = None) -> dict[str, Any]:
    """A field's metadata: the name it has in flat settings (the command line's destination), where that is not the
    field's own (``--optimizer`` sets ``Optimizer.name``), and the option as the command line writes it, where that
    is not ``--`` and the name with dashes."""
    return {"flag": name} if option is None else {"flag": name, "option": option}


@dataclass(frozen=True)
class StateChunks:
    """Model-state chunks (:mod:`pipefold.runtime.chunks`): the optimizer state in chunks of ``capacity`` float32
    elements (chosen from the parameters' sizes when None), on the device where the warm-up step leaves room in
    ``device_memory`` bytes (every chunk there when None) and in host memory otherwise."""

    capacity: int | None = None
    device_memory: float | None = None


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    """How the weights are stepped."""

    name: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] = field(default="adamw",
                                                                              metadata=flag("optimizer"))
    """'adamw', 'sgd', 'kfac' (K-FAC-preconditioned SGD with momentum 0.9, its work placed in the schedule as
    actions), or a function that makes a torch.optim optimizer from a rank's parameters."""
    lr: float = 1e-3
    """Learning rate."""
    clip: float | None = None
    """Clip the gradients to this global norm (all ranks' together); None: no clipping."""
    damping: float = 0.1
    """K-FAC's damping (see docs/pipefisher.md for the values tried on the GPT)."""
    ema: float = 0.9
    """K-FAC's running-average decay of the factors, 0 <= ema < 1 (0: the newest only)."""
    fill_bubbles: bool = False
    """With K-FAC: put its work in the schedule's bubbles, spread over steps (PipeFisher); without, it runs right
    after the passes it reads, every step."""
    kfac_distribution: str = "dp-kfac"
    """With K-FAC over data-parallel copies: 'dp-kfac' (each layer's factors built, inverted and applied by one
    copy) or 'd-kfac' (every copy builds every factor; the copies all-reduce them); see docs/dpkfac.md."""

    def __post_init__(self) -> None:
        if not callable(self.name) and self.name not in OPTIMIZERS:
            names = list(OPTIMIZERS)
            raise ConfigError(f"unknown optimizer {self.name!r}: use {', '.join(names[:-1])} or {names[-1]}, "
                              "or pass a function that makes one from a list of parameters")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ConfigError(f"the learning rate must be a finite number >= 0 (got {self.lr})")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"clip is the largest global gradient norm (--clip): a number > 0 (got {self.clip})")
        _ = self.kfac  # K-FAC's own one line for its damping and decay

    @property
    def kfac(self) -> KFACConfig | None:
        """K-FAC's settings, with optimizer 'kfac'; None otherwise."""
        if self.name != "kfac":
            return None
        from pipefold.runtime.kfac import KFACConfig

        return KFACConfig(damping=self.damping, ema=self.ema, distribution=self.kfac_distribution)

    @property
    def state_factor(self) -> float:
        """The optimizer state per parameter, in parameter sizes, that memory estimates count
        (:data:`pipefold.plan.recompute.OPTIMIZER_STATE`; 2, as AdamW's, where it has no entry: K-FAC, a function)."""
        from pipefold.plan.recompute import OPTIMIZER_STATE

        return OPTIMIZER_STATE.get(self.name, 2.0) if isinstance(self.name, str) else 2.0

    def make(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params``.

        A rank's parameters under tensor parallelism mix DTensors (the sharded layers) and plain tensors (the
        layers kept whole). torch's list kernels (``foreach``, its default on CUDA) refuse such a list, so the
        named optimizers step those one tensor at a time; a function given as ``name`` must do the same."""
        if callable(self.name):
            return self.name(params)
        if _mixes_dtensors(params):
            return OPTIMIZERS[self.name](params, lr=self.lr, foreach=False)
        return OPTIMIZERS[self.name](params, lr=self.lr)


def _mixes_dtensors(params: list[nn.Parameter]) -> bool:
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for p in params}
    return len(kinds) > 1


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """Data-parallel copies of the pipeline, and tensor-parallel ranks per device."""

    dp: int = 1
    """Copies of the pipeline (devices ranks each): dp x devices processes, each pipeline on its shard of the batch,
    each stage's gradients averaged across the copies (``DP`` actions)."""
    zero1: bool = False
    """With dp > 1: shard the optimizer state across the copies of each stage (ZeRO-1,
    :class:`~pipefold.runtime.zero.ShardedOptimizer`)."""
    fsdp: bool = False
    """With dp > 1: shard each stage's parameters, gradients and optimizer state across its copies (torch's
    ``fully_shard``), gathered by the schedule's ``AG`` actions and reduce-scattered by its ``RS``."""
    tp: int | tuple[int, ...] = 1
    """Tensor-parallel ranks per pipeline device: each stage's layers split over its device's ranks by the model's
    tensor-parallel plan (torch's ``parallelize_module``). One degree for every device, or one per device (a mesh per
    stage: activations and gradients between devices of different degrees are resharded, :mod:`pipefold.runtime.comm`);
    dp x (the devices' degrees summed) processes in all. Equal degrees are kept as one number."""
    sequence_parallel: bool = False
    """With tp > 1: each block's norms, dropouts and residual stream on each tensor-parallel rank's share of the
    tokens (Korthikanti et al.'s sequence parallelism; torch's SequenceParallel), the split Linears gathering the
    tokens before them and reduce-scattering over them after (:func:`pipefold.runtime.sharding.tensor_parallel`)."""
    cp: int = 1
    """Context-parallel ranks: each data-parallel copy's sequences split over cp copies of the pipeline, two of each
    sequence's 2 cp chunks on each, attention a ring among them (:mod:`pipefold.runtime.context`); the gradients
    are averaged, and ZeRO-1 and FSDP shard, over all dp x cp copies."""
    spb: tuple[int, ...] | None = None
    """Structured partial backpropagation (Jigsaw): per data-parallel copy, how many of the model's last layers it
    backpropagates through (the layers before run without autograd); each layer's gradient is the mean over the
    copies that computed it. None: every copy backpropagates through every layer."""
    ep: int = 1
    """Expert-parallel ranks: each mixture-of-experts layer's experts spread over groups of ep consecutive
    data-parallel copies (copy i in group i // ep), reached by all-to-all, each group holding every expert once and
    each expert's gradient summed over its copies in the groups (:mod:`pipefold.runtime.experts`). 1: every copy
    holds every expert; dp: each expert on one copy."""
    ep_overlap: bool = False
    """With ep > 1: the schedule's overlapped pairs (F+B) run one part's all-to-alls while the other computes."""

    def __post_init__(self) -> None:
        if isinstance(self.dp, bool) or not (isinstance(self.dp, int) and self.dp >= 1):
            raise ConfigError(f"--dp is the number of data-parallel pipelines: an integer >= 1 (got {self.dp!r})")
        if isinstance(self.cp, bool) or not (isinstance(self.cp, int) and self.cp >= 1):
            raise ConfigError(f"--cp is the number of context-parallel ranks: an integer >= 1 (got {self.cp!r})")
        tp = self.tp if isinstance(self.tp, tuple) else (self.tp,)
        if not tp or any(isinstance(t, bool) or not (isinstance(t, int) and t >= 1) for t in tp):
            raise ConfigError(f"--tp is the number of tensor-parallel ranks per pipeline device: an integer >= 1, or "
                              f"one per device such as 2,1 (got {self.tp!r})")
        if len(set(tp)) == 1:
            object.__setattr__(self, "tp", tp[0])
        if self.spb is not None:
            spb = tuple(self.spb) if isinstance(self.spb, (tuple, list)) else (self.spb,)
            if any(isinstance(k, bool) or not (isinstance(k, int) and k >= 1) for k in spb):
                raise ConfigError(f"--spb gives each data-parallel copy the number of last layers it backpropagates "
                                  f"through: whole numbers >= 1 such as 6,3 (got {self.spb!r})")
            if self.dp < 2:
                raise ConfigError("--spb splits backpropagation over data-parallel copies, and --dp 1 has one: give "
                                  "--dp 2 or more, or drop it")
            if len(spb) != self.dp:
                raise ConfigError(f"--spb {','.join(map(str, spb))} gives {len(spb)} copies their layers, and --dp "
                                  f"{self.dp} has {self.dp}: give one number per copy")
            object.__setattr__(self, "spb", spb)
        if isinstance(self.ep, bool) or not (isinstance(self.ep, int) and self.ep >= 1):
            raise ConfigError(f"--ep is the number of expert-parallel ranks: 1 (off) or an integer >= 2 that divides "
                              f"--dp (got {self.ep!r})")
        if self.ep > 1:
            if self.dp < 2:
                raise ConfigError("--ep spreads the experts over data-parallel copies, and --dp 1 has one: give --dp "
                                  "2 or more, or drop it")
            if self.dp % self.ep:
                fits = [str(d) for d in range(2, self.dp + 1) if self.dp % d == 0]
                raise ConfigError(f"--ep {self.ep} cannot cut --dp {self.dp} into groups of {self.ep} copies: give "
                                  f"an --ep that divides {self.dp} ({', '.join(fits)})")
            other = [what for what, on in (("--spb", self.spb is not None), ("--fsdp", self.fsdp),
                                           ("--zero1", self.zero1),
                                           (f"--tp {self.tp_text}", self.tensor_parallel),
                                           (f"--cp {self.cp}", self.cp > 1)) if on]
            if other:
                raise ConfigError(f"--ep does not run with {other[0]} yet: drop one of them")

    def computing(self, layer: int, layers: int) -> int:
        """How many copies backpropagate through ``layer`` of ``layers`` (all of them without SPB)."""
        if self.spb is None:
            return self.copies
        from pipefold.plan.spb import computing

        return computing(self.spb, layer, layers)

    def degrees(self, devices: int) -> tuple[int, ...]:
        """The tensor-parallel degree of each of ``devices`` pipeline devices."""
        if isinstance(self.tp, int):
            return (self.tp,) * devices
        if len(self.tp) != devices:
            raise ConfigError(f"--tp {self.tp_text} gives {len(self.tp)} degrees for {devices} pipeline devices: give "
                              f"one degree for every device, or one per device ({devices} of them)")
        return self.tp

    @property
    def copies(self) -> int:
        """Copies of the pipeline: dp x cp (each on its rows of the batch and its chunks of their sequences)."""
        return self.dp * self.cp

    @property
    def tensor_parallel(self) -> bool:
        """Some device's layers are split over several ranks."""
        return max(self.tp if isinstance(self.tp, tuple) else (self.tp,)) > 1

    @property
    def tp_text(self) -> str:
        """The degrees as the command line writes them: ``2``, ``2,1``."""
        return ",".join(map(str, self.tp)) if isinstance(self.tp, tuple) else str(self.tp)


@dataclass(frozen=True, kw_only=True)
class Reliability:
    """What keeps a long run safe: bad steps, hangs, and the model written at the end."""

    max_bad_steps: int = 3
    """A step whose loss or gradients are NaN or inf is skipped; the run stops after this many in a row."""
    post_validate: bool = False
    """Step the optimizer before the global NaN/inf and norm check completes; roll the step back when it fails or
    needs clipping (Zero Bubble's post-validation, :mod:`pipefold.runtime.numerics`)."""
    action_timeout: float = DEFAULT_ACTION_TIMEOUT
    """Seconds an action may run (or a rank wait for one that makes no progress) before the job is taken as hung and
    stopped, naming the rank (:mod:`pipefold.runtime.watch`); the process group's timeout is this plus a margin."""
    save_model: str | None = None
    """After the last step, rank 0 writes the whole model's ``state_dict`` here (``torch.save``, named as the plain
    model ``nn.Sequential(*layers)`` names it); made absolute when given, as the ranks may start elsewhere."""

    def __post_init__(self) -> None:
        if not (isinstance(self.max_bad_steps, int) and self.max_bad_steps >= 1):
            raise ConfigError(f"--max-bad-steps must be at least 1 (got {self.max_bad_steps!r}): the run stops after "
                              "that many bad steps in a row")
        if not (math.isfinite(self.action_timeout) and 0 < self.action_timeout <= 86400):
            raise ConfigError(f"--action-timeout is in seconds: a number > 0 and at most a day, such as 20 or 120 "
                              f"(got {self.action_timeout:g})")
        if self.save_model is not None:
            object.__setattr__(self, "save_model", os.path.abspath(self.save_model))


P2P = ("auto", "sockets", "gloo")


@dataclass(frozen=True, kw_only=True)
class Devices:
    """Where the ranks compute and how their tensors cross (:mod:`pipefold.runtime.launch.devices`)."""

    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (a GPU when torch sees one)."""
    backend: str = "auto"
    """'nccl' (a GPU per rank), 'gloo' (the CPU, or GPUs the ranks share, through pinned host memory) or 'auto'."""
    overlap: bool = field(default=True, metadata=flag("overlap", "--no-overlap"))
    """On a GPU, run an overlapped pair's (``FB``) forward and backward at once on two streams; False: one after the
    other, as on the CPU."""
    p2p: str = "auto"
    """How activations and gradients cross between ranks: 'sockets' (this machine's Unix-domain sockets,
    :mod:`pipefold.runtime.sockets`), 'gloo' (the process group's transport) or 'auto' (sockets when every rank
    is on this machine and gloo is the backend, except over emulated or measured links)."""

    dtype: str = "fp32"
    """What the passes compute in: 'fp32', 'bf16' or 'fp16' (autocast over float32 parameters, or the parameters
    themselves with ``master_weights``; :mod:`pipefold.runtime.precision`)."""
    master_weights: bool = False
    """The parameters held in ``dtype``, with float32 gradients and master weights in the optimizer."""
    loss_scale: str | None = None
    """'dynamic' (fp16's default), 'none', or a fixed number."""
    compile: str | None = None
    """torch.compile each stage's layers: 'split' (Linears outside the compiled regions) or 'whole'
    (:mod:`pipefold.runtime.compiled`); None: eager."""
    compile_backend: str = "inductor"
    """torch.compile's backend: 'inductor', 'aot_eager' or 'eager'."""

    @property
    def compiling(self) -> bool:
        """Whether the layers are compiled (their first passes then compile them)."""
        return self.compile is not None

    def __post_init__(self) -> None:
        if self.p2p not in P2P:
            raise ConfigError(f"unknown --p2p {self.p2p!r}: use {', '.join(P2P)}")
        self.precision  # noqa: B018  # checked now: one line for a dtype or loss scale no run can use
        if self.loss_scale is not None and self.dtype == "fp32":
            raise ConfigError("--loss-scale keeps fp16 gradients from flushing to zero: give it with --dtype fp16 (or "
                              "bf16), or drop it")
        if self.compile is not None and self.compile not in ("split", "whole"):
            raise ConfigError(f"unknown --compile {self.compile!r}: use split (the backward split for real) or whole "
                              "(each layer one compiled region)")
        if self.compile_backend not in ("inductor", "aot_eager", "eager"):
            raise ConfigError(f"unknown --compile-backend {self.compile_backend!r}: use inductor, aot_eager or eager")

    @property
    def precision(self) -> Any:
        """The run's :class:`~pipefold.runtime.precision.Precision`."""
        from pipefold.runtime.precision import Precision

        return Precision(self.dtype, master_weights=self.master_weights, loss_scale=self.loss_scale)


def check_precision(devices: Devices, parallel: Parallel, optimizer: Optimizer, *, offload: bool,
                    steps_inside: bool) -> None:
    """What mixed precision does not run with (yet), one line each. ``steps_inside``: the schedule steps the
    optimizers itself (OPT actions), before the step's gradients could be unscaled and checked."""
    precision = devices.precision
    if precision.master_weights:
        other = [what for what, on in (("--fsdp", parallel.fsdp), ("--offload", offload),
                                       (f"--tp {parallel.tp_text}", parallel.tensor_parallel),
                                       ("--optimizer kfac", optimizer.name == "kfac"),
                                       ("a schedule with OPT actions", steps_inside)) if on]
        if other:
            raise ConfigError(f"--master-weights does not run with {other[0]} yet: use --dtype {precision.dtype} "
                              "without --master-weights (autocast over float32 parameters)")
    if precision.loss_scale is not None and optimizer.name == "kfac":
        raise ConfigError("K-FAC's factors are built from the backward's gradients, which a loss scale multiplies: use "
                          "--dtype bf16 with K-FAC (no loss scale), or --loss-scale none")
    if precision.loss_scale is not None and steps_inside:
        raise ConfigError("a loss scale is checked after the step, and this schedule steps the optimizers inside it "
                          "(OPT actions): use a schedule without them, or --loss-scale none")


def check_together(parallel: Parallel, optimizer: Optimizer, *, adaptive: bool, network: bool, netns: bool,
                   offload: bool, recompute: bool, checkpoints: bool) -> None:
    """The rules that join sections: what the data-parallel layout, the optimizer, adaptive schedules, emulated
    networks, offloading, recomputation and checkpoints do not run together (yet). One line each, naming the flags
    and what would work."""
    if parallel.fsdp and parallel.copies < 2:
        raise ConfigError("--fsdp shards each stage across data-parallel pipelines: give --dp 2 or more")
    if parallel.fsdp and parallel.zero1:
        raise ConfigError("--fsdp shards the optimizer state already: drop --zero1")
    if parallel.zero1 and parallel.copies < 2:
        raise ConfigError("ZeRO-1 shards the optimizer state across data-parallel pipelines: it needs --dp 2 or more")
    # What neither layout of several copies runs with yet, tensor parallelism named first (data-parallel copies run
    # K-FAC: DP-KFAC or D-KFAC).
    kfac = optimizer.name == "kfac"
    for on, layout, flag in ((parallel.tensor_parallel, f"tensor parallelism (--tp {parallel.tp_text}) does", "--tp"),
                             (parallel.dp > 1, f"data-parallel pipelines (--dp {parallel.dp}) do", "--dp"),
                             (parallel.cp > 1, f"context parallelism (--cp {parallel.cp}) does", "--cp")):
        unsupported = [what for what, on in (("--optimizer kfac", kfac and flag != "--dp"),
                                             ("--schedule adaptive-kfkb", adaptive),
                                             ("--network", network and (flag != "--dp" or parallel.ep < 2)),
                                             ("--netns", netns), ("--offload", offload)) if on]
        if on and unsupported:
            raise ConfigError(f"{layout} not run with {unsupported[0]} yet: use {flag} 1 with it")
    if kfac and (parallel.fsdp or parallel.zero1):
        flag = "--fsdp" if parallel.fsdp else "--zero1"
        raise ConfigError(f"K-FAC over data-parallel copies preconditions whole gradients and steps a whole optimizer, "
                          f"and {flag} shards them: drop {flag} with --optimizer kfac")
    if parallel.ep > 1 and (kfac or checkpoints or offload):
        flag = "--optimizer kfac" if kfac else "--checkpoint-dir" if checkpoints else "--offload"
        raise ConfigError(f"--ep does not run with {flag} yet (each copy holds other experts): drop one of them")
    if parallel.cp > 1 and parallel.tensor_parallel:
        raise ConfigError(f"context parallelism (--cp {parallel.cp}) does not run with tensor parallelism (--tp "
                          f"{parallel.tp_text}) yet: use --cp 1 or --tp 1")
    if parallel.cp > 1 and checkpoints:
        raise ConfigError(f"checkpoints of context-parallel runs (--cp {parallel.cp}) are not written yet: use --cp 1 "
                          "with --checkpoint-dir")
    if parallel.fsdp and checkpoints:
        raise ConfigError("checkpoints of stages sharded with FSDP are not written yet: use --dp without --fsdp "
                          "with --checkpoint-dir, or no checkpoints with --fsdp")
    if optimizer.name == "kfac":
        if checkpoints:
            raise ConfigError("checkpoints do not save K-FAC's curvature and its placement yet: train --optimizer "
                              "kfac without --checkpoint-dir and --resume")
        if adaptive:
            raise ConfigError("--optimizer kfac runs a cycle of schedules of its own: use a schedule other than "
                              "adaptive-kfkb")
        if offload or recompute:
            raise ConfigError("K-FAC does not combine with offloading or recomputation yet: it keeps layer inputs "
                              "that those would drop; use one or the other")
    if offload and recompute:
        raise ConfigError("--recompute and --offload do not combine yet: an offloaded stage keeps its activations; "
                          "use one or the other")

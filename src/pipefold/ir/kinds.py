"""Kinds and actions: what each kind of action waits for, completes, costs and does to memory, written once in
:data:`KINDS` (validation, the simulator, the runtime and the block expansion read it there); the action itself
(``0F3``, ``2B3``, ``1BW0``, ``0F3+5B1``, ``3R``, ...); and the size limits of a schedule."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pipefold.errors import ConfigError

MAX_STAGE_MICROBATCHES = 250_000
"""The most (stage, microbatch) pairs a schedule may have: stages x microbatches, each pair two or three passes.
At the limit a schedule has up to 750,000 actions, which take 3 to 8 s and at most 360 MB to generate and simulate
(zb-h1 on 4 devices with 62,500 microbatches, 1f1b on 500 devices with 500, zb-v on 512 with 244: docs/simulator.md);
beyond it a command would seem to hang. Generating (:func:`pipefold.schedules.build`) and reading a file refuse more
with one line."""

MAX_DEVICES = 512
"""The most devices a schedule may have: the dependency graph keeps a table per (stage, device), so time and
memory grow with the square of the devices (zb-v on 512 devices takes seconds even with one microbatch)."""


def check_size(stages: int, microbatches: int, what: str, *, devices: int = 0) -> None:
    """Refuse ``what`` (a schedule to generate or read) with more than :data:`MAX_DEVICES` devices or
    :data:`MAX_STAGE_MICROBATCHES` (stage, microbatch) pairs, with one line naming the limit."""
    if devices > MAX_DEVICES:
        raise ConfigError(f"{what}: {devices:,} devices is over pipefold's limit of {MAX_DEVICES} (the schedule's "
                          f"tables grow with the square of the devices): use --devices {MAX_DEVICES} or fewer")
    stages = max(stages, devices)
    pairs = stages * microbatches
    if pairs > MAX_STAGE_MICROBATCHES:
        fix = (f"use at most {MAX_STAGE_MICROBATCHES // stages:,} microbatches with {stages:,} stages"
               if stages <= MAX_STAGE_MICROBATCHES else f"use at most {MAX_STAGE_MICROBATCHES:,} stages")
        raise ConfigError(f"{what}: {stages:,} stages x {microbatches:,} microbatches is {pairs:,} "
                          f"stage-microbatch pairs, over pipefold's limit of {MAX_STAGE_MICROBATCHES:,} (seconds to "
                          f"generate and simulate): {fix}")


NO_MICROBATCH = -1
"""The microbatch of an action that runs for a whole stage (an all-reduce, an optimizer step)."""

PASSES = ("F", "B", "W")
"""What every microbatch must have done through every stage: its forward, input gradient and weight gradient."""


class Kind:
    """The codes of the built-in action kinds (plain strings: ``Kind.F == "F"``)."""

    F = "F"  # forward
    B = "B"  # backward for the stage input only
    W = "W"  # backward for the weights only
    BW = "BW"  # fused backward: B and W together
    FB = "FB"  # an overlapped pair: a forward and a backward of other (stage, microbatch)s, run together
    R = "R"  # all-reduce of a replicated stage's gradients
    OPT = "OPT"  # optimizer step of one stage
    DP = "DP"  # all-reduce of a stage's gradients across data-parallel pipelines
    AG = "AG"  # all-gather of a stage's sharded parameters across data-parallel pipelines (FSDP)
    RS = "RS"  # reduce-scatter of a stage's gradients across data-parallel pipelines (FSDP)
    KA = "KA"  # K-FAC: curvature from a microbatch's layer inputs (A = E[a a^T])
    KG = "KG"  # K-FAC: curvature from a microbatch's output gradients (G = E[g g^T])
    KI = "KI"  # K-FAC: inversion of a stage's damped factors
    KP = "KP"  # K-FAC: preconditioning of a stage's gradient
    OF = "OF"  # offload: a microbatch's activations of a stage copied to host memory, their device copy freed
    RL = "RL"  # reload: the offloaded activations copied back to the device before the microbatch's backward
    S = "S"  # vocabulary parallelism: one device's shard of the output layer for a microbatch, forward
    T = "T"  # vocabulary parallelism: one device's shard of the output layer for a microbatch, backward


def _no_memory(c: Any) -> tuple[float, float]:
    return 0.0, 0.0


@dataclass(frozen=True, kw_only=True)
class KindSpec:
    """Everything pipefold knows about one kind of action.

    ``needs`` are passes of the same microbatch, each with a stage offset: ``("F", -1)``
    is the forward of the previous stage (an activation that crosses stages), ``("B", 1)``
    the input gradient of the next. An offset that leaves the model (before stage 0,
    after the last) needs nothing: the batch and the loss are there. ``gives`` are the
    passes it completes. A kind without a microbatch runs for a whole stage: ``gathers``
    are passes it waits for from every microbatch that its replica of the stage runs.
    """

    code: str
    doc: str
    needs: tuple[tuple[str, int], ...] = ()
    gives: tuple[str, ...] = ()
    microbatch: bool = True
    gathers: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    """Stage-wide passes of its stage on its device that it waits for where the step has them (the optimizer
    step waits for the all-reduce of a replicated stage, and for K-FAC's preconditioning where it runs)."""
    collective: bool = False
    """Runs together on every device holding a replica of its stage."""
    computes: bool = True
    """Occupies its device; False for communication that runs beside the device's compute."""
    composite: bool = False
    """Made of parts run together (an overlapped F and B); written as the parts joined by ``+``."""
    requires: tuple[str, ...] = ()
    """Passes of the same (stage, microbatch) that a schedule giving this one must give too (an offload needs its
    reload, a reload its offload)."""
    lane: bool = False
    """Communication (``computes`` False) that queues on a lane of its own per device and kind: one copy of its
    kind at a time, beside the device's compute (the host link's copy engine, one per direction)."""
    time: Callable[[Any], float] = lambda c: 0.0
    """Its duration, from the stage's costs (a ``simulate.StageCost``)."""
    exchange: Callable[[Any], float] = lambda c: 0.0
    """The part of ``time`` it spends in collectives inside the pass (a mixture of experts' all-to-alls), which the
    other part of an overlapped pair can compute under."""
    memory: Callable[[Any], tuple[float, float]] = _no_memory
    """How it changes its device's activation memory: (when it starts, when it ends)."""
    stash: Callable[[Any], float] = lambda c: 0.0
    """What a per-microbatch kind keeps of its microbatch until it runs: held beyond the activations when it
    ends after its microbatch's weight gradient (W or BW) at its stage freed them (K-FAC's curvature)."""
    shard: bool = False
    """Runs on every device, once per microbatch: its stage field names the device's shard of the vocabulary
    layer (0..devices-1, on device of that number), not a stage of the model (Vocabulary Parallelism). What it
    waits for is written in :mod:`pipefold.ir.graph` (``_vocab_inputs``), not in ``needs``."""
    color: str = "#999999"
    label: str = ""


def _f_memory(c: Any) -> tuple[float, float]:
    return c.held, 0.0  # F takes what the stage keeps until its backward


def _b_memory(c: Any) -> tuple[float, float]:
    return c.memory - c.held, c.held_w - c.memory  # rebuild what was recomputed; B's end: memory -> memory_w


def _w_memory(c: Any) -> tuple[float, float]:
    return 0.0, -c.held_w


def _bw_memory(c: Any) -> tuple[float, float]:
    return c.memory - c.held, -c.memory


def _of_memory(c: Any) -> tuple[float, float]:
    return 0.0, -c.offloaded  # the device copy is freed once the host has it


def _rl_memory(c: Any) -> tuple[float, float]:
    return c.offloaded, 0.0  # the device copy is allocated when the copy back starts


KINDS: dict[str, KindSpec] = {}
"""The one table of action kinds, by code."""


def register_kind(spec: KindSpec) -> KindSpec:
    """Add a kind to :data:`KINDS` (custom work). Its code must be new and in capitals, e.g. ``"KA"``."""
    if not re.fullmatch(r"[A-Z]+", spec.code):
        raise ValueError(f"a kind's code is capital letters, e.g. KA (got {spec.code!r})")
    if spec.code in KINDS and KINDS[spec.code] != spec:
        raise ValueError(f"kind {spec.code} is already registered: {KINDS[spec.code].doc}")
    for name, _ in spec.needs:
        if name not in PASSES and name not in _gives_anywhere() | set(spec.gives):
            raise ValueError(f"kind {spec.code} needs pass {name!r}, which no kind gives")
    KINDS[sys.intern(spec.code)] = spec
    return spec


def _gives_anywhere() -> set[str]:
    return {g for k in KINDS.values() for g in k.gives}


for _spec in (
    KindSpec(code=Kind.F, doc="forward", needs=(("F", -1),), gives=("F",), after=("AG",),
             time=lambda c: c.f + c.exchange_f, exchange=lambda c: c.exchange_f,
             memory=_f_memory, color="#0072B2", label="forward"),
    # PipeOffload: what a microbatch keeps from its F to its backward, moved to host memory and back. Copies on the
    # host link, beside the compute, one at a time per direction; a backward waits for its reload where there is one.
    KindSpec(code=Kind.OF, doc="offload of a microbatch's activations to host memory", needs=(("F", 0),),
             gives=("OF",), requires=("RL",), computes=False, lane=True, time=lambda c: c.offload,
             memory=_of_memory, color="#7F7F7F", label="offload"),
    KindSpec(code=Kind.RL, doc="reload of a microbatch's offloaded activations", needs=(("OF", 0),),
             gives=("RL",), requires=("OF",), computes=False, lane=True, time=lambda c: c.offload,
             memory=_rl_memory, color="#BBBBBB", label="reload"),
    KindSpec(code=Kind.B, doc="backward for the stage input only", needs=(("F", 0), ("B", 1), ("RL", 0)),
             gives=("B",),
             time=lambda c: c.b + c.exchange_b, exchange=lambda c: c.exchange_b, memory=_b_memory,
             color="#E69F00", label="input grad"),
    KindSpec(code=Kind.W, doc="backward for the weights only", needs=(("B", 0),), gives=("W",),
             time=lambda c: c.w, memory=_w_memory, color="#009E73", label="weight grad"),
    KindSpec(code=Kind.BW, doc="fused backward: B and W together", needs=(("F", 0), ("B", 1), ("RL", 0)),
             gives=("B", "W"),
             time=lambda c: c.bw + c.exchange_b, exchange=lambda c: c.exchange_b, memory=_bw_memory,
             color="#CC79A7", label="full backward"),
    KindSpec(code=Kind.FB, doc="an overlapped forward and backward, run together", composite=True,
             color="#56B4E9", label="overlapped F+B"),
    KindSpec(code=Kind.R, doc="all-reduce of a replicated stage's gradients", microbatch=False, gathers=("W",),
             gives=("R",), collective=True, computes=False, time=lambda c: c.allreduce,
             color="#D55E00", label="grad all-reduce"),
    KindSpec(code=Kind.OPT, doc="optimizer step of one stage", microbatch=False, gathers=("W",),
             after=("R", "DP", "RS", "KP"), gives=("OPT",), time=lambda c: c.opt, color="#666666",
             label="optimizer step"),
    KindSpec(code=Kind.DP, doc="all-reduce of a stage's gradients across the data-parallel pipelines",
             microbatch=False, gathers=("W",), after=("R",), gives=("DP",), computes=False,
             time=lambda c: c.dp_reduce, color="#CC6677", label="data-parallel all-reduce"),
    # FSDP: each data-parallel copy of a stage keeps a 1/dp shard of its parameters, gradients and optimizer
    # state; AG gathers the parameters before the stage's forwards, RS reduce-scatters the gradients once its
    # last weight gradient is done and frees what AG gathered.
    KindSpec(code=Kind.AG, doc="all-gather of a stage's sharded parameters across the data-parallel pipelines",
             microbatch=False, gives=("AG",), computes=False, time=lambda c: c.dp_gather,
             memory=lambda c: (c.gathered, 0.0), color="#88CCEE", label="FSDP all-gather"),
    KindSpec(code=Kind.RS, doc="reduce-scatter of a stage's gradients across the data-parallel pipelines",
             microbatch=False, gathers=("W",), after=("R", "AG"), gives=("RS",), computes=False,
             time=lambda c: c.dp_scatter, memory=lambda c: (0.0, -c.gathered), color="#AA4499",
             label="FSDP reduce-scatter"),
    # K-FAC (PipeFisher): work the cost model does not derive, so its times come from ``StageCost.work``.
    KindSpec(code=Kind.KA, doc="K-FAC curvature from a microbatch's layer inputs", needs=(("F", 0),),
             gives=("KA",), time=lambda c: c.work.get("KA", 0.0), stash=lambda c: c.stash.get("KA", 0.0),
             color="#F0E442", label="K-FAC A"),
    KindSpec(code=Kind.KG, doc="K-FAC curvature from a microbatch's output gradients", needs=(("B", 0),),
             gives=("KG",), time=lambda c: c.work.get("KG", 0.0), stash=lambda c: c.stash.get("KG", 0.0),
             color="#B8860B", label="K-FAC G"),
    KindSpec(code=Kind.KI, doc="K-FAC inversion of a stage's factors", microbatch=False, gathers=("KA", "KG"),
             gives=("KI",), time=lambda c: c.work.get("KI", 0.0), color="#8B4513", label="K-FAC inverse"),
    KindSpec(code=Kind.KP, doc="K-FAC preconditioning of a stage's gradient", microbatch=False, gathers=("W",),
             after=("R", "KI"), gives=("KP",), time=lambda c: c.work.get("KP", 0.0), color="#4B0082",
             label="K-FAC precondition"),
    # Vocabulary Parallelism: the output layer split by vocabulary over every device. S computes a shard's logits
    # and their per-token max and sum of exponentials; T, once every shard's statistics are shared, the shard's
    # softmax, its part of the gradient of the last stage's output and its weight gradient. What S keeps of its
    # logits for T is ``vocab_held``.
    KindSpec(code=Kind.S, doc="vocabulary forward of one device's shard of the output layer", gives=("S",),
             shard=True, time=lambda c: c.vocab_s, memory=lambda c: (c.vocab_held, 0.0), color="#44AA99",
             label="vocab forward"),
    KindSpec(code=Kind.T, doc="vocabulary backward of one device's shard of the output layer", gives=("T",),
             shard=True, time=lambda c: c.vocab_t, memory=lambda c: (0.0, -c.vocab_held), color="#117733",
             label="vocab backward"),
):
    register_kind(_spec)


_ACTION_RE = re.compile(r"^(\d+)([A-Z]+)(\d*)$")


class Action(NamedTuple):
    """One action: pass ``kind`` of ``microbatch`` through ``stage``.

    An action without a microbatch (:data:`NO_MICROBATCH`) runs for its whole stage; a
    composite (``FB``) has stage and microbatch -1 and its ``parts`` run together. A named
    tuple: immutable, hashable, ordered, and cheap to make by the hundred thousand.
    """

    stage: int
    kind: str
    microbatch: int
    parts: tuple[Action, ...] = ()

    def __str__(self) -> str:
        if self.parts:
            return "+".join(map(str, self.parts))
        if self.microbatch < 0:
            return f"{self.stage}{self.kind}"
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def spec(self) -> KindSpec:
        return KINDS[self.kind]

    @property
    def passes(self) -> tuple[Action, ...]:
        """The simple actions it runs: its parts, or itself."""
        return self.parts or (self,)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form, e.g. ``"2BW5"``, ``"3R"``, ``"0F3+5B1"``."""
        text = text.strip()
        if "+" in text:
            parts = tuple(cls.parse(t) for t in text.split("+"))
            if len(parts) != 2:
                raise ValueError(f"cannot read action {text!r}: an overlapped pair is two actions joined by +, "
                                 "e.g. 0F3+5B1")
            return overlap(*parts)
        match = _ACTION_RE.match(text)
        spec = KINDS.get(match[2]) if match else None
        if match is None or spec is None or spec.composite:
            known = ", ".join(k for k, s in KINDS.items() if not s.composite)
            raise ValueError(f"cannot read action {text!r}: expected <stage><kind><microbatch> with kind one of "
                             f"{known} (e.g. 0F3, 1BW0, 3R), or two actions joined by + (0F3+5B1)")
        if spec.microbatch != bool(match[3]):
            example = f"{match[1]}{spec.code}" + ("0" if spec.microbatch else "")
            raise ValueError(f"cannot read action {text!r}: a {spec.code} action "
                             f"{'names' if spec.microbatch else 'names no'} microbatch, e.g. {example}")
        return cls(int(match[1]), spec.code, int(match[3]) if match[3] else NO_MICROBATCH)


_new = tuple.__new__
"""The builders make hundreds of thousands of actions: the tuple is made directly, without the named tuple's own
``__new__`` (a Python call with a default each time); the same four fields in the same order."""


def F(stage: int, microbatch: int) -> Action:
    """Forward of ``stage`` for ``microbatch``."""
    return _new(Action, (stage, "F", microbatch, ()))


def B(stage: int, microbatch: int) -> Action:
    """Input-gradient backward of ``stage`` for ``microbatch``."""
    return _new(Action, (stage, "B", microbatch, ()))


def W(stage: int, microbatch: int) -> Action:
    """Weight-gradient backward of ``stage`` for ``microbatch``."""
    return _new(Action, (stage, "W", microbatch, ()))


def BW(stage: int, microbatch: int) -> Action:
    """Fused backward of ``stage`` for ``microbatch``."""
    return _new(Action, (stage, "BW", microbatch, ()))


def R(stage: int) -> Action:
    """All-reduce of ``stage``'s gradients between its replicas."""
    return Action(stage, Kind.R, NO_MICROBATCH)


def OPT(stage: int) -> Action:
    """Optimizer step of ``stage``."""
    return Action(stage, Kind.OPT, NO_MICROBATCH)


def DP(stage: int) -> Action:
    """All-reduce of ``stage``'s gradients across the data-parallel pipelines."""
    return Action(stage, Kind.DP, NO_MICROBATCH)


def AG(stage: int) -> Action:
    """All-gather of ``stage``'s parameters from its sharded data-parallel copies (FSDP)."""
    return Action(stage, Kind.AG, NO_MICROBATCH)


def RS(stage: int) -> Action:
    """Reduce-scatter of ``stage``'s gradients to its sharded data-parallel copies (FSDP)."""
    return Action(stage, Kind.RS, NO_MICROBATCH)


def KA(stage: int, microbatch: int) -> Action:
    """K-FAC curvature of ``stage`` from ``microbatch``'s layer inputs."""
    return Action(stage, Kind.KA, microbatch)


def KG(stage: int, microbatch: int) -> Action:
    """K-FAC curvature of ``stage`` from ``microbatch``'s output gradients."""
    return Action(stage, Kind.KG, microbatch)


def KI(stage: int) -> Action:
    """K-FAC inversion of ``stage``'s factors."""
    return Action(stage, Kind.KI, NO_MICROBATCH)


def KP(stage: int) -> Action:
    """K-FAC preconditioning of ``stage``'s gradient."""
    return Action(stage, Kind.KP, NO_MICROBATCH)


def OF(stage: int, microbatch: int) -> Action:
    """Offload of ``microbatch``'s activations of ``stage`` to host memory."""
    return Action(stage, Kind.OF, microbatch)


def RL(stage: int, microbatch: int) -> Action:
    """Reload of ``microbatch``'s offloaded activations of ``stage``."""
    return Action(stage, Kind.RL, microbatch)


def S(shard: int, microbatch: int) -> Action:
    """Vocabulary forward of device ``shard``'s share of the output layer for ``microbatch``."""
    return Action(shard, Kind.S, microbatch)


def T(shard: int, microbatch: int) -> Action:
    """Vocabulary backward of device ``shard``'s share of the output layer for ``microbatch``."""
    return Action(shard, Kind.T, microbatch)


def overlap(forward: Action, backward: Action) -> Action:
    """A forward and a backward run together (DualPipe's overlapped F&B, torch's OVERLAP_F_B)."""
    if forward.kind != Kind.F or backward.kind not in (Kind.B, Kind.BW):
        raise ValueError(f"an overlapped pair is a forward then a backward (B or BW), e.g. 0F3+5B1 "
                         f"(got {forward}+{backward})")
    if (forward.stage, forward.microbatch) == (backward.stage, backward.microbatch):
        raise ValueError(f"{forward}+{backward} overlaps a backward with its own forward, which it needs first")
    return Action(-1, Kind.FB, NO_MICROBATCH, (forward, backward))

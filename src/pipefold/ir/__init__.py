"""The schedule IR: actions, kinds, placements, per-device action lists, their text/JSON/CSV forms, validation.

An action is one pass of one microbatch through one stage, or work of a whole stage::

    0F3      forward of stage 0, microbatch 3
    2B3      backward of stage 2 for its input only (the input gradient)
    2W3      backward of stage 2 for its weights only
    1BW0     fused full backward (B and W at once)
    0F3+5B1  an overlapped pair: 0F3 and 5B1 run together (DualPipe's F&B overlap)
    3R       all-reduce of stage 3's gradients between the devices holding a replica of it
    3OPT     optimizer step of stage 3
    3DP      all-reduce of stage 3's gradients across the data-parallel copies of the whole pipeline
    3AG      all-gather of stage 3's parameters from its sharded data-parallel copies (FSDP), before its forwards
    3RS      reduce-scatter of stage 3's gradients to its sharded copies (FSDP); frees the gathered parameters
    1KA2     K-FAC curvature of stage 1 from microbatch 2's layer inputs (the A factors)
    1KG2     K-FAC curvature of stage 1 from microbatch 2's output gradients (the G factors)
    1KI      K-FAC inversion of stage 1's factors
    1KP      K-FAC preconditioning of stage 1's gradient, before its optimizer step

What each kind waits for, what it completes, what it costs and how it changes
memory is written once, in :data:`KINDS`; validation, the simulator, the
runtime and the block expansion all read it there. :func:`register_kind` adds
a kind (custom work such as K-FAC's curvature) without touching any of them.

A schedule lists, for each **device**, the actions it runs in order. The
model is cut into **stages** 0 -> 1 -> ... -> S-1. The placement says which
device holds which stage; with several **replicas** (Chimera, DualPipe) a stage
lives on several devices, each replica with its own copy of the parameters,
and each microbatch is routed through one replica.
"""

from __future__ import annotations

import bisect
import csv
import functools
import io
import itertools
import json
import re
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pipefold.errors import ConfigError, ScheduleError

__all__ = [
    "KINDS",
    "Action",
    "Graph",
    "MAX_DEVICES",
    "MAX_STAGE_MICROBATCHES",
    "Transfer",
    "Kind",
    "KindSpec",
    "Schedule",
    "dependency_graph",
    "describe_placement",
    "format_of",
    "check_size",
    "linear_placement",
    "looped_placement",
    "parse_placement",
    "read_schedule_text",
    "register_kind",
    "reversed_placement",
    "render_grid",
    "v_placement",
    "validate",
]

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


class _Costs(NamedTuple):
    """What a kind's time and memory are computed from (the simulator passes its StageCost)."""

    f: float
    b: float
    w: float
    memory: float
    held: float
    held_w: float


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
    time: Callable[[Any], float] = lambda c: 0.0
    """Its duration, from the stage's costs (a ``simulate.StageCost``)."""
    memory: Callable[[Any], tuple[float, float]] = _no_memory
    """How it changes its device's activation memory: (when it starts, when it ends)."""
    stash: Callable[[Any], float] = lambda c: 0.0
    """What a per-microbatch kind keeps of its microbatch until it runs: held beyond the activations when it
    ends after its microbatch's weight gradient (W or BW) at its stage freed them (K-FAC's curvature)."""
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
    KindSpec(code=Kind.F, doc="forward", needs=(("F", -1),), gives=("F",), after=("AG",), time=lambda c: c.f,
             memory=_f_memory, color="#0072B2", label="forward"),
    KindSpec(code=Kind.B, doc="backward for the stage input only", needs=(("F", 0), ("B", 1)), gives=("B",),
             time=lambda c: c.b, memory=_b_memory, color="#E69F00", label="input grad"),
    KindSpec(code=Kind.W, doc="backward for the weights only", needs=(("B", 0),), gives=("W",),
             time=lambda c: c.w, memory=_w_memory, color="#009E73", label="weight grad"),
    KindSpec(code=Kind.BW, doc="fused backward: B and W together", needs=(("F", 0), ("B", 1)), gives=("B", "W"),
             time=lambda c: c.b + c.w, memory=_bw_memory, color="#CC79A7", label="full backward"),
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


def F(stage: int, microbatch: int) -> Action:
    """Forward of ``stage`` for ``microbatch``."""
    return Action(stage, Kind.F, microbatch)


def B(stage: int, microbatch: int) -> Action:
    """Input-gradient backward of ``stage`` for ``microbatch``."""
    return Action(stage, Kind.B, microbatch)


def W(stage: int, microbatch: int) -> Action:
    """Weight-gradient backward of ``stage`` for ``microbatch``."""
    return Action(stage, Kind.W, microbatch)


def BW(stage: int, microbatch: int) -> Action:
    """Fused backward of ``stage`` for ``microbatch``."""
    return Action(stage, Kind.BW, microbatch)


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


def overlap(forward: Action, backward: Action) -> Action:
    """A forward and a backward run together (DualPipe's overlapped F&B, torch's OVERLAP_F_B)."""
    if forward.kind != Kind.F or backward.kind not in (Kind.B, Kind.BW):
        raise ValueError(f"an overlapped pair is a forward then a backward (B or BW), e.g. 0F3+5B1 "
                         f"(got {forward}+{backward})")
    if (forward.stage, forward.microbatch) == (backward.stage, backward.microbatch):
        raise ValueError(f"{forward}+{backward} overlaps a backward with its own forward, which it needs first")
    return Action(-1, Kind.FB, NO_MICROBATCH, (forward, backward))


# --------------------------------------------------------------------------- placements
#
# A placement is, per replica, the device of every stage. One replica is the usual case.


def linear_placement(devices: int) -> tuple[int, ...]:
    """Stage d on device d."""
    return tuple(range(devices))


def reversed_placement(devices: int) -> tuple[int, ...]:
    """Stage d on device p-1-d: the pipeline that runs up the devices (Chimera's and DualPipe's second replica)."""
    return tuple(reversed(range(devices)))


def looped_placement(devices: int, v: int) -> tuple[int, ...]:
    """Stage s on device s mod p: each device holds v stages, p apart (Megatron's interleaving)."""
    return tuple(s % devices for s in range(devices * v))


def v_placement(devices: int) -> tuple[int, ...]:
    """Device d holds stages d and 2p-1-d: down the devices and back up."""
    return tuple(range(devices)) + tuple(reversed(range(devices)))


def describe_placement(stage_to_device: Sequence[int], devices: int) -> str:
    """Name one replica's placement: ``linear``, ``reversed``, ``looped``, ``v`` or the explicit list of devices."""
    mapping = tuple(stage_to_device)
    stages = len(mapping)
    if mapping == linear_placement(devices):
        return "linear"
    if mapping == reversed_placement(devices):
        return "reversed"
    if stages > devices and stages % devices == 0 and mapping == looped_placement(devices, stages // devices):
        return "looped"
    if stages == 2 * devices and mapping == v_placement(devices):
        return "v"
    return " ".join(str(d) for d in mapping)


def parse_placement(text: str, devices: int, stages: int) -> tuple[int, ...]:
    """Inverse of :func:`describe_placement`."""
    text = text.strip()
    if text == "linear":
        return linear_placement(devices)
    if text == "reversed":
        return reversed_placement(devices)
    if text == "looped":
        if stages % devices:
            raise ValueError(f"looped placement needs stages to be a multiple of devices ({stages} % {devices} != 0)")
        return looped_placement(devices, stages // devices)
    if text == "v":
        return v_placement(devices)
    try:
        return tuple(int(tok) for tok in text.replace(",", " ").split())
    except ValueError:
        raise ValueError(
            f"cannot read placement {text!r}: use linear, reversed, looped, v, or one device number per stage"
        ) from None


# --------------------------------------------------------------------------- schedule


@dataclass(frozen=True, eq=True)
class Schedule:
    """Per-device ordered action lists plus the shape of the pipeline they run on.

    ``placement`` gives, per replica, the device of every stage (a flat sequence is one
    replica); ``routes`` the replica each microbatch goes through (all 0 by default).
    """

    name: str
    devices: int
    stages: int
    microbatches: int
    placement: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[Action, ...], ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    routes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", _as_replicas(self.placement))
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        object.__setattr__(self, "options", dict(self.options))
        for label, value in (("devices", self.devices), ("stages", self.stages),
                             ("microbatches", self.microbatches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{label} must be a positive integer (got {value!r})")
        check_size(self.stages, self.microbatches, f"schedule {self.name}", devices=self.devices)
        if not self.placement:
            raise ScheduleError("the placement is empty: give the device of every stage")
        for replica, mapping in enumerate(self.placement):
            of = f" of replica {replica}" if self.replicas > 1 else ""
            if len(mapping) != self.stages:
                raise ScheduleError(f"placement{of} lists {len(mapping)} devices but the schedule has "
                                    f"{self.stages} stages")
            for stage, device in enumerate(mapping):
                if not isinstance(device, int) or not 0 <= device < self.devices:
                    raise ScheduleError(f"placement{of} puts stage {stage} on device {device}, "
                                        f"but devices are 0..{self.devices - 1}")
        for stage in range(self.stages):
            holders = [r[stage] for r in self.placement]
            if len(set(holders)) != len(holders):
                raise ScheduleError(f"two replicas of stage {stage} are on one device ({holders}): a device "
                                    "holds at most one copy of a stage")
        routes = tuple(self.routes) or (0,) * self.microbatches
        object.__setattr__(self, "routes", routes)
        if len(routes) != self.microbatches:
            raise ScheduleError(f"routes name a replica for {len(routes)} microbatches, but the schedule has "
                                f"{self.microbatches}")
        bad = next((r for r in routes if not (isinstance(r, int) and 0 <= r < self.replicas)), None)
        if bad is not None:
            raise ScheduleError(f"a route names replica {bad!r}, but replicas are 0..{self.replicas - 1}")
        if len(self.actions) != self.devices:
            raise ScheduleError(f"schedule has {self.devices} devices but {len(self.actions)} action lists")

    # -- derived views

    @property
    def replicas(self) -> int:
        """How many copies of the model the placement holds (2 for Chimera and DualPipe)."""
        return len(self.placement)

    @property
    def placement_name(self) -> str:
        """Human name of the placement, replicas separated by `` | `` (see :func:`describe_placement`)."""
        return " | ".join(describe_placement(r, self.devices) for r in self.placement)

    def device_of(self, stage: int, microbatch: int = NO_MICROBATCH) -> int:
        """The device that runs ``stage`` for ``microbatch`` (any microbatch when there is one replica)."""
        if microbatch >= 0:
            return self.placement[self.routes[microbatch]][stage]
        if self.replicas > 1:
            raise ValueError(f"stage {stage} is on devices {self.holders(stage)}: name a microbatch to pick one")
        return self.placement[0][stage]

    def holders(self, stage: int) -> tuple[int, ...]:
        """The devices holding a replica of ``stage``, by replica."""
        return tuple(r[stage] for r in self.placement)

    def replica_on(self, stage: int, device: int) -> int:
        """Which replica of ``stage`` ``device`` holds."""
        return self.holders(stage).index(device)

    def stages_of(self, device: int) -> list[int]:
        """Stages held by ``device`` (of any replica), in increasing order."""
        return sorted({s for r in self.placement for s, d in enumerate(r) if d == device})

    def chunk_of(self, stage: int, device: int | None = None) -> int:
        """Index of ``stage`` among the stages of its device (0 for the first); ``device``: which holder."""
        device = self.placement[0][stage] if device is None else device
        return self.stages_of(device).index(stage)

    @property
    def num_actions(self) -> int:
        return sum(len(row) for row in self.actions)

    def with_actions(self, actions: Iterable[Iterable[Action]]) -> Schedule:
        """A copy with other action lists (same shape, name and options)."""
        return Schedule(self.name, self.devices, self.stages, self.microbatches,
                        self.placement, tuple(tuple(r) for r in actions), self.options, self.routes)

    # -- text form

    def to_text(self) -> str:
        """Compact, line-based text form; :meth:`from_text` reads it back exactly."""
        lines = [
            "# pipefold schedule",
            f"name: {self.name}",
            f"options: {json.dumps(dict(self.options), sort_keys=True)}",
            f"devices: {self.devices}",
            f"stages: {self.stages}",
            f"microbatches: {self.microbatches}",
            f"placement: {self.placement_name}",
        ]
        if self.replicas > 1:
            lines.append(f"routes: {' '.join(map(str, self.routes))}")
        for device, row in enumerate(self.actions):
            lines.append(f"device {device}: " + " ".join(str(a) for a in row))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Parse :meth:`to_text` output. Errors name the offending line."""
        header: dict[str, tuple[int, str]] = {}
        rows: dict[int, tuple[int, str]] = {}
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition(":")
            if not sep:
                raise ScheduleError(f"line {lineno}: expected 'key: value' or 'device N: actions', got {raw!r}")
            key = key.strip()
            if key.startswith("device "):
                try:
                    device = int(key.split()[1])
                except (IndexError, ValueError):
                    raise ScheduleError(f"line {lineno}: cannot read device number in {key!r}") from None
                if device in rows:
                    raise ScheduleError(f"line {lineno}: device {device} is listed twice")
                rows[device] = (lineno, value)
            elif key in ("name", "options", "devices", "stages", "microbatches", "placement", "routes"):
                header[key] = (lineno, value.strip())
            else:
                raise ScheduleError(f"line {lineno}: unknown key {key!r}")
        for key in ("devices", "stages", "microbatches"):
            if key not in header:
                raise ScheduleError(f"schedule text has no '{key}:' line")
        counts = {}
        for key in ("devices", "stages", "microbatches"):
            lineno, value = header[key]
            try:
                counts[key] = int(value)
            except ValueError:
                raise ScheduleError(f"line {lineno}: {key} must be an integer, got {value!r}") from None
        devices, stages = counts["devices"], counts["stages"]
        check_size(stages, counts["microbatches"], "the schedule", devices=devices)
        lineno, placement_text = header.get("placement", (0, "linear"))
        try:
            placement = tuple(parse_placement(part, devices, stages) for part in placement_text.split("|"))
        except ValueError as exc:
            raise ScheduleError(f"line {lineno}: {exc}") from None
        routes: tuple[int, ...] = ()
        if "routes" in header:
            lineno, value = header["routes"]
            try:
                routes = tuple(int(tok) for tok in value.split())
            except ValueError:
                raise ScheduleError(f"line {lineno}: routes are one replica number per microbatch, "
                                    f"got {value!r}") from None
        options: dict[str, Any] = {}
        if "options" in header:
            lineno, value = header["options"]
            try:
                options = json.loads(value)
            except json.JSONDecodeError:
                raise ScheduleError(f"line {lineno}: options must be a JSON object, got {value!r}") from None
            if not isinstance(options, dict):
                raise ScheduleError(f"line {lineno}: options must be a JSON object, got {value!r}")
        if set(rows) - set(range(devices)):
            bad = min(set(rows) - set(range(devices)))
            raise ScheduleError(f"line {rows[bad][0]}: device {bad} is out of range 0..{devices - 1}")
        actions = []
        for device in range(devices):
            lineno, value = rows.get(device, (0, ""))
            actions.append(_parse_actions(value.split(), f"line {lineno}"))
        name = header.get("name", (0, "custom"))[1]
        return cls(name, devices, stages, counts["microbatches"], placement, tuple(actions), options, routes)

    # -- JSON form

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_json` reads it back exactly."""
        out: dict[str, Any] = {
            "format": "pipefold-schedule",
            "version": 2,
            "name": self.name,
            "options": dict(self.options),
            "devices": self.devices,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "placement": list(self.placement[0]) if self.replicas == 1 else [list(r) for r in self.placement],
            "actions": [[str(a) for a in row] for row in self.actions],
        }
        if self.replicas > 1:
            out["routes"] = list(self.routes)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> Schedule:
        """Read :meth:`to_json`'s dict (version 1 or 2) or its text."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise ScheduleError(f"line {exc.lineno}: not valid JSON ({exc.msg})") from None
            except RecursionError:
                raise ScheduleError("the JSON nests too deeply to be a schedule") from None
        if not isinstance(data, Mapping):
            raise ScheduleError("schedule JSON must be an object")
        missing = [k for k in ("devices", "stages", "microbatches", "placement", "actions") if k not in data]
        if missing:
            raise ScheduleError(f"schedule JSON lacks the key(s) {', '.join(missing)}")
        rows = data["actions"]
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise ScheduleError("schedule JSON 'actions' must be a list of lists of strings, one per device")
        actions = tuple(_parse_actions(row, f"device {d}") for d, row in enumerate(rows))
        placement = data["placement"]
        sizes = [data[key] for key in ("devices", "stages", "microbatches")]
        if all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
            check_size(sizes[1], sizes[2], "the schedule", devices=sizes[0])
        if isinstance(placement, str):
            try:
                placement = tuple(parse_placement(p, int(data["devices"]), int(data["stages"]))
                                  for p in placement.split("|"))
            except ValueError as exc:
                raise ScheduleError(str(exc)) from None
        if not isinstance(placement, (list, tuple)):
            raise ScheduleError("schedule JSON 'placement' must be a list of devices, one per stage "
                                "(or a list of such lists, one per replica)")
        options = data.get("options", {})
        if not isinstance(options, Mapping):
            raise ScheduleError(f"schedule JSON 'options' must be an object, got {options!r}")
        routes = data.get("routes", ())
        if not isinstance(routes, (list, tuple)):
            raise ScheduleError("schedule JSON 'routes' must be a list of replica numbers, one per microbatch")
        return cls(str(data.get("name", "custom")), data["devices"], data["stages"], data["microbatches"],
                   tuple(placement), actions, options, tuple(routes))

    # -- CSV form (one row per device, one action per cell, as torch.distributed.pipelining)

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for row in self.actions:
            writer.writerow([str(a) for a in row])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str, *, name: str = "custom", options: Mapping[str, Any] | None = None,
                 placement: Sequence[int] | Sequence[Sequence[int]] | None = None) -> Schedule:
        """Read one row of actions per device.

        The CSV holds only actions: stages and microbatches are counted from them
        and, unless ``placement`` is given, each stage is placed on the device whose
        row runs it. Microbatches whose forwards run on different devices go through
        different replicas (one per distinct path, in order of first microbatch).
        """
        rows = [
            _parse_actions([cell for cell in row if cell.strip()], f"line {lineno}")
            for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1)
        ]
        while rows and not rows[-1]:
            rows.pop()  # trailing blank lines
        if not rows:
            raise ScheduleError("CSV schedule is empty: expected one row of actions per device")
        simple = [(d, a) for d, row in enumerate(rows) for act in row for a in act.passes]
        stages = 1 + max((a.stage for _, a in simple), default=0)
        microbatches = 1 + max((a.microbatch for _, a in simple), default=0)
        check_size(stages, microbatches, f"the CSV schedule (largest stage index {stages - 1:,}, largest "
                                         f"microbatch {microbatches - 1:,})")
        routes: tuple[int, ...] = ()
        if placement is None:
            placement, routes = _infer_placement(rows, stages, microbatches)
        return cls(name, len(rows), stages, microbatches, _as_replicas(placement), tuple(rows), options or {}, routes)

    # -- files

    def save(self, path: str) -> None:
        """Write the schedule atomically, in the format named by the file's suffix (.json, .csv, else text; any
        case)."""
        from pipefold.files import write_text

        write_text(path, self.dumps(format_of(path)))

    def dumps(self, fmt: str = "text") -> str:
        if fmt == "json":
            from pipefold.jsonout import dumps

            return dumps(self.to_json(), indent=1) + "\n"
        if fmt == "csv":
            return self.to_csv()
        if fmt == "text":
            return self.to_text()
        raise ValueError(f"unknown schedule format {fmt!r}: use text, json or csv")

    @classmethod
    def load(cls, path: str, fmt: str | None = None) -> Schedule:
        """Read a schedule file written by :meth:`save` (or by hand), in ``fmt`` or as its suffix says."""
        text = read_schedule_text(path)
        fmt = format_of(path) if fmt is None else fmt
        try:
            if fmt == "json":
                return cls.from_json(text)
            if fmt == "csv":
                return cls.from_csv(text)
            return cls.from_text(text)
        except ScheduleError as exc:
            raise ScheduleError(f"{path}: {exc.message}", exc.report) from None


def _as_replicas(placement: Sequence[int] | Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """A placement as one tuple per replica; a flat sequence of devices is one replica."""
    items = tuple(placement)
    if items and not isinstance(items[0], (tuple, list)):
        return (tuple(items),)  # type: ignore[arg-type]
    return tuple(tuple(r) for r in items)  # type: ignore[arg-type]


def _infer_placement(rows: Sequence[Sequence[Action]], stages: int,
                     microbatches: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Replicas and routes from where each microbatch's forwards run."""
    path: dict[int, dict[int, int]] = {}  # microbatch -> stage -> device of its forward
    first: dict[int, tuple[int, int]] = {}  # stage -> (device, position) that first runs it
    for device, row in enumerate(rows):
        for position, act in enumerate(row):
            for a in act.passes:
                first.setdefault(a.stage, (device, position))
                if a.kind == Kind.F:
                    path.setdefault(a.microbatch, {})[a.stage] = device
    absent = [s for s in range(stages) if s not in first]
    if absent:
        raise ScheduleError(f"CSV schedule never runs stage {absent[0]}: cannot tell its device")
    replicas: list[tuple[int, ...]] = []
    routes = []
    for mb in range(microbatches):
        known = path.get(mb, {})
        # A microbatch whose forward of some stage is missing takes the device that first runs that stage:
        # validation then names what is missing.
        devices = tuple(known.get(s, first[s][0]) for s in range(stages))
        if devices not in replicas:
            replicas.append(devices)
        routes.append(replicas.index(devices))
    if len(replicas) > 1:
        # Actions that are not forwards must sit with their microbatch's replica; report the first that does not.
        for device, row in enumerate(rows):
            for position, act in enumerate(row):
                for a in act.passes:
                    if a.microbatch >= 0 and replicas[routes[a.microbatch]][a.stage] != device:
                        raise ScheduleError(
                            f"line {device + 1}: action {a} at position {position} is for stage {a.stage}, "
                            f"whose forward for microbatch {a.microbatch} runs on line "
                            f"{replicas[routes[a.microbatch]][a.stage] + 1}")
    else:
        for device, row in enumerate(rows):
            for position, act in enumerate(row):
                for a in act.passes:
                    home = replicas[0][a.stage]
                    if home != device:
                        raise ScheduleError(f"line {device + 1}: action {a} at position {position} is for stage "
                                            f"{a.stage}, which line {home + 1} also runs")
    return tuple(replicas), tuple(routes) if len(replicas) > 1 else ()


def read_schedule_text(path: str) -> str:
    """The text of a schedule file; one ConfigError if it is not UTF-8 text (a binary file, an image)."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a schedule file: byte {data[exc.start]:#04x} at offset {exc.start} is "
                            "not UTF-8 text; schedule files are text, JSON or CSV (pipefold generate -o FILE "
                            "writes one)") from None


def format_of(path: str) -> str:
    """The schedule format a file's suffix names: json (.json), csv (.csv) or text, in any case."""
    lower = path.lower()
    if lower.endswith(".json"):
        return "json"
    if lower.endswith(".csv"):
        return "csv"
    return "text"


def _parse_actions(tokens: Iterable[Any], where: str) -> tuple[Action, ...]:
    out = []
    for token in tokens:
        try:
            out.append(Action.parse(str(token)))
        except ValueError as exc:
            raise ScheduleError(f"{where}: {exc}") from None
    return tuple(out)


# --------------------------------------------------------------------------- the dependency graph
#
# Every microbatch goes through the stage chain (S stages) by the rules of KINDS:
#
#     F(0) -> F(1) -> ... -> F(S-1) -> B(S-1) -> B(S-2) -> ... -> B(0)
#                                        |          |               |
#                                        W          W               W
#
# (BW gives B and W at once; an overlapped pair gives what its parts give.) A device
# runs its list strictly in order, so a schedule can run iff a traversal that always
# takes each device's next action, when what it waits for is done, reaches the end
# of every list. One graph, built here, is what validation, the simulator and the
# runtime all read.


@dataclass(frozen=True)
class Graph:
    """A validated schedule's dependencies, a runnable order of its actions and, given durations, their times.

    Actions are numbered globally, device after device (:meth:`gid`); ``inputs[g]`` are the
    actions that action g waits for besides the one before it on its device.
    """

    schedule: Schedule
    offsets: tuple[int, ...]
    """Global number of each device's first action."""
    inputs: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    """Every action in an order that respects all dependencies; the members of a collective come together."""
    peers: Mapping[int, tuple[int, ...]]
    """For each collective action, every member of its collective (itself included)."""
    starts: list[float]
    ends: list[float]
    """With durations: when each action starts and ends (see :func:`dependency_graph`)."""

    def gid(self, device: int, position: int) -> int:
        return self.offsets[device] + position

    def where(self, gid: int) -> tuple[int, int]:
        """(device, position) of action ``gid``."""
        device = bisect.bisect_right(self.offsets, gid) - 1
        return device, gid - self.offsets[device]

    def action(self, gid: int) -> Action:
        d, i = self.where(gid)
        return self.schedule.actions[d][i]

    def transfers(self) -> list[Transfer]:
        """Every input that crosses devices: the messages of a step, in the order their senders run.

        Each names the pass it carries (``F``: an activation, ``B``: a gradient), the stage that
        gives it and the stage that takes it. A composite sends its parts' outputs in part order.
        Worked out once per graph: the runtime asks for it once per peer and kind of step.
        """
        return list(self._transfers)

    @functools.cached_property
    def _transfers(self) -> tuple[Transfer, ...]:
        S = self.schedule.stages
        out = []
        for d, row in enumerate(self.schedule.actions):
            for i, act in enumerate(row):
                gid = self.gid(d, i)
                for a in act.passes:
                    spec = KINDS[a.kind]
                    if not spec.microbatch:
                        continue
                    for name, offset in spec.needs:
                        t = a.stage + offset
                        if not 0 <= t < S:
                            continue
                        src = self.schedule.device_of(t, a.microbatch)
                        if src == d:
                            continue
                        g, part = next((g, k) for g in self.inputs[gid]
                                       for k, p in enumerate(self.action(g).passes)
                                       if (p.stage, p.microbatch) == (t, a.microbatch) and name in KINDS[p.kind].gives)
                        out.append(Transfer(*self.where(g), d, i, name, t, a.stage, a.microbatch, part))
        out.sort(key=lambda x: (x.src, x.src_position, x.part))
        return tuple(out)


class Transfer(NamedTuple):
    """One message of a step: pass ``pass_`` of (``stage``, ``microbatch``), from one action to another device's."""

    src: int
    src_position: int
    dst: int
    dst_position: int
    pass_: str
    stage: int
    """The stage that gives it."""
    to_stage: int
    """The stage that takes it."""
    microbatch: int
    part: int
    """Which part of the sending action gives it (0 unless that action is a composite)."""


def dependency_graph(schedule: Schedule, durations: Sequence[float] | None = None, transfer: float = 0.0,
                     idle: frozenset[str] = frozenset()) -> Graph:
    """Check ``schedule`` and return its :class:`Graph`; raise :class:`ScheduleError` for the first violation.

    Checked, in this order: every action's kind, stage and microbatch are known and in range,
    and it runs on the device its (replica of the) stage is placed on; each pass of each
    (stage, microbatch) is given exactly once; a replicated stage has one all-reduce on each
    holder; then that all per-device orders run together without deadlock.

    With ``durations`` (per action, by global number) the traversal also times the actions:
    each starts when its device is free and its inputs are done, ``transfer`` later for an
    input from another device; a collective's members start together; an action whose kind is
    in ``idle`` (communication) leaves its device free at once.
    """
    rows = schedule.actions
    offsets = tuple(itertools.accumulate((len(r) for r in rows[:-1]), initial=0))
    givers, names = _givers(schedule, offsets)
    inputs = _inputs(schedule, givers, names, offsets)
    return _traverse(schedule, offsets, inputs, durations, transfer, idle)


def _pass_names() -> dict[str, int]:
    names = {name: k for k, name in enumerate(PASSES)}
    for spec in KINDS.values():
        for name in (*spec.gives, *(n for n, _ in spec.needs)):
            names.setdefault(name, len(names))
    return names


def _givers(schedule: Schedule, offsets: Sequence[int]) -> tuple[list[int], dict[str, int]]:
    """Who gives each pass: a flat list over (pass * S + stage) * M + microbatch of global action numbers
    (-1: nobody), stage-wide passes after them at (pass * S + stage) * D + device."""
    S, M, D = schedule.stages, schedule.microbatches, schedule.devices
    placement, routes = schedule.placement, schedule.routes
    names = _pass_names()
    P = len(names)
    wide0 = P * S * M
    giver = [-1] * (wide0 + P * S * D)
    info = {code: (spec.microbatch, tuple((names[g] * S) * M for g in spec.gives),
                   tuple(wide0 + names[g] * S * D for g in spec.gives)) for code, spec in KINDS.items()}
    # The common case first: a one-replica schedule's simple action of a known per-microbatch kind that gives
    # one pass; anything else goes through the general loop below.
    one = {code: gives[0] for code, (per_mb, gives, _) in info.items() if per_mb and len(gives) == 1}
    home = placement[0] if len(placement) == 1 else None
    gid = 0
    for device, row in enumerate(schedule.actions):
        for position, act in enumerate(row):
            s, kind, m, parts = act
            base = one.get(kind, -1)
            if base >= 0 and home is not None and not parts and 0 <= s < S and 0 <= m < M and home[s] == device:
                at = base + s * M + m
                if giver[at] >= 0:
                    _duplicate(schedule, device, position, act, giver[at], offsets)
                giver[at] = gid
                gid += 1
                continue
            for a in (parts or (act,)):
                s, kind, m = a[0], a[1], a[2]
                got = info.get(kind)
                if got is None:
                    _fail(schedule, f"device {device}, position {position}: action {act} is of kind {kind}, "
                          f"which is not registered (kinds: {', '.join(KINDS)})", device=device, position=position)
                per_mb, gives, wide = got  # type: ignore[misc]
                if per_mb:
                    if not (0 <= s < S and 0 <= m < M and placement[routes[m]][s] == device):
                        _check_action_place(schedule, device, position, a)
                    at = s * M + m
                    for base in gives:
                        if giver[base + at] >= 0:
                            _duplicate(schedule, device, position, a, giver[base + at], offsets)
                        giver[base + at] = gid
                else:
                    if not (0 <= s < S and m == NO_MICROBATCH and device in schedule.holders(s)):
                        _check_action_place(schedule, device, position, a)
                    if KINDS[kind].collective and len(schedule.holders(s)) < 2:
                        _fail(schedule, f"device {device}, position {position}: {a} runs between the replicas of "
                              f"stage {s}, but the placement holds it once (device {device}): remove it",
                              device=device, position=position)
                    for base in wide:
                        if giver[base + s * D + device] >= 0:
                            _duplicate(schedule, device, position, a, giver[base + s * D + device], offsets)
                        giver[base + s * D + device] = gid
            gid += 1
    _check_complete(schedule, giver, offsets)
    r_base = wide0 + names[Kind.R] * S * D
    for s in range(S):
        holders = schedule.holders(s)
        if len(holders) > 1:
            for d in holders:
                if giver[r_base + s * D + d] < 0:
                    _fail(schedule, f"device {d}: stage {s} has replicas on devices "
                          f"{', '.join(map(str, holders))}, so each needs an all-reduce of its gradients "
                          f"({s}{Kind.R}) after its last backward", device=d, position=len(schedule.actions[d]))
    return giver, names


def _where(offsets: Sequence[int], gid: int) -> tuple[int, int]:
    device = bisect.bisect_right(offsets, gid) - 1
    return device, gid - offsets[device]


def _duplicate(schedule: Schedule, device: int, position: int, a: Action, first_gid: int,
               offsets: Sequence[int]) -> None:
    d0, at = _where(offsets, first_gid)
    first = schedule.actions[d0][at]
    firsts = first.passes
    if a in firsts:
        _fail(schedule, f"device {device}, position {position}: {a} appears twice (first at position {at})",
              device=device, position=position)
    fused = next((x for x in (a, *firsts) if x.kind == Kind.BW), None)
    label = f"stage {a.stage} microbatch {a.microbatch}"
    if fused is not None:
        other = first if fused == a else a
        _fail(schedule, f"device {device}, position {position}: {label} has both a fused backward {fused} and "
              f"{other}", device=device, position=position)
    _fail(schedule, f"device {device}, position {position}: {label}: {a} and {first} (device {d0}, position {at}) "
          "both compute the same pass", device=device, position=position)


def _check_complete(schedule: Schedule, giver: list[int], offsets: Sequence[int]) -> None:
    """Every (stage, microbatch) has its forward, its input gradient and its weight gradient."""
    SM = schedule.stages * schedule.microbatches
    f, b, w = giver[:SM], giver[SM:2 * SM], giver[2 * SM:3 * SM]
    if min(f) >= 0 and min(b) >= 0 and min(w) >= 0:
        return
    M = schedule.microbatches
    for idx in range(SM):
        s, m = divmod(idx, M)
        device = schedule.device_of(s, m)
        end = dict(device=device, position=len(schedule.actions[device]))
        label = f"stage {s} microbatch {m}"
        if f[idx] < 0:
            _fail(schedule, f"device {device}: {label} has no forward ({F(s, m)})", **end)
        if b[idx] < 0 and w[idx] < 0:
            _fail(schedule, f"device {device}: {label} has no backward ({B(s, m)} or {BW(s, m)})", **end)
        if w[idx] < 0:
            _fail(schedule, f"device {device}: {label} has {B(s, m)} but no {W(s, m)}", **end)
        if b[idx] < 0:
            pos = _where(offsets, w[idx])[1]
            _fail(schedule, f"device {device}, position {pos}: {W(s, m)} has no {B(s, m)} before it",
                  device=device, position=pos)


def _inputs(schedule: Schedule, giver: list[int], names: Mapping[str, int],
            offsets: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    S, M, D = schedule.stages, schedule.microbatches, schedule.devices
    wide0 = len(names) * S * M
    by_replica: dict[int, list[int]] = {}
    for m, r in enumerate(schedule.routes):
        by_replica.setdefault(r, []).append(m)
    # Per kind: (stage offset, index of that pass at stage offset 0) for each need.
    needs = {code: tuple((off, names[n] * S * M + off * M) for n, off in spec.needs) for code, spec in KINDS.items()}
    # Per-microbatch kinds that also wait for stage-wide passes (a forward for its stage's FSDP all-gather), where
    # the schedule has any of those passes at all.
    wide_afters = {code: tuple(wide0 + names[n] * S * D for n in spec.after) for code, spec in KINDS.items()
                   if spec.microbatch and spec.after}
    wide_afters = {code: bases for code, bases in wide_afters.items()
                   if any(g >= 0 for base in bases for g in giver[base:base + S * D])}
    out: list[tuple[int, ...]] = []
    append = out.append
    for device, row in enumerate(schedule.actions):
        for act in row:
            if not act[3] and act[2] >= 0 and act[1] not in wide_afters:  # the common case: one pass of one
                # microbatch, one or two needs
                s, kind, m = act[0], act[1], act[2]
                at = s * M + m
                nd = needs[kind]
                off, base = nd[0] if nd else (-S, 0)
                g = giver[base + at] if 0 <= s + off < S else -1
                if len(nd) == 2:
                    off, base = nd[1]
                    g2 = giver[base + at] if 0 <= s + off < S else -1
                    append((g, g2) if g >= 0 and g2 >= 0 else (g,) if g >= 0 else (g2,) if g2 >= 0 else ())
                elif len(nd) < 2:
                    append((g,) if g >= 0 else ())
                else:
                    append(tuple(g for off, base in nd if 0 <= s + off < S and (g := giver[base + at]) >= 0))
                continue
            got: list[int] = []
            for a in act.passes:
                s, kind, m = a[0], a[1], a[2]
                if m >= 0:
                    at = s * M + m
                    got += [g for off, base in needs[kind] if 0 <= s + off < S and (g := giver[base + at]) >= 0]
                    got += [g for base in wide_afters.get(kind, ()) if (g := giver[base + s * D + device]) >= 0]
                    continue
                spec = KINDS[kind]
                replica = schedule.replica_on(s, device)
                for n in spec.gathers:
                    got += [g for mb in by_replica.get(replica, ()) if (g := giver[names[n] * S * M + s * M + mb]) >= 0]
                for n in spec.after:
                    if (g := giver[wide0 + names[n] * S * D + s * D + device]) >= 0:
                        got.append(g)
            append(tuple(got))
    return tuple(out)


def _traverse(schedule: Schedule, offsets: tuple[int, ...], inputs: tuple[tuple[int, ...], ...],
              durations: Sequence[float] | None, transfer: float, idle: frozenset[str]) -> Graph:
    """A runnable order: each device runs on until an action waits for one not yet run, and is woken then.

    The members of a collective start together, once every member is at the head of its device.
    """
    rows = schedule.actions
    D = schedule.devices
    N = schedule.num_actions
    peers: dict[int, tuple[int, ...]] = {}
    members: dict[tuple[str, int], list[int]] = {}
    quiet: set[int] = set()  # actions that leave their device free (communication)
    for d, row in enumerate(rows):
        for i, a in enumerate(row):
            if not a.parts and a.microbatch < 0:
                if KINDS[a.kind].collective:
                    members.setdefault((a.kind, a.stage), []).append(offsets[d] + i)
                if a.kind in idle:
                    quiet.add(offsets[d] + i)
    for together in members.values():
        for member in together:
            peers[member] = tuple(together)
    dev_of = [d for d, row in enumerate(rows) for _ in row]
    dur = durations if durations is not None else [0.0] * N
    done = bytearray(N)
    starts = [0.0] * N
    ends = [0.0] * N
    free = [0.0] * D
    heads = [0] * D
    lengths = [len(r) for r in rows]
    waiting: dict[int, list[int]] = {}
    order: list[int] = []
    queue = deque(range(D))
    while queue:
        device = queue.popleft()
        pos, n = heads[device], lengths[device]
        gid = offsets[device] + pos
        ready0 = free[device]
        while pos < n:
            ready = ready0
            blocker = -1
            for g in inputs[gid]:
                if not done[g]:
                    blocker = g
                    break
                t = ends[g] + transfer if dev_of[g] != device else ends[g]
                if t > ready:
                    ready = t
            if blocker >= 0:
                waiting.setdefault(blocker, []).append(device)
                break
            if peers and gid in peers:
                group = peers[gid]
                late = next((m for m in group if m != gid and heads[dev_of[m]] + offsets[dev_of[m]] != m), -1)
                if late >= 0:
                    break  # the last member to arrive runs them all
                for m in group:
                    md = dev_of[m]
                    t = max([free[md]] + [ends[g] + (transfer if dev_of[g] != md else 0.0) for g in inputs[m]])
                    ready = max(ready, t)
                for m in group:
                    md = dev_of[m]
                    starts[m], ends[m] = ready, ready + dur[m]
                    done[m] = 1
                    order.append(m)
                    free[md] = ready if m in quiet else ready + dur[m]
                    if md != device:
                        heads[md] += 1
                        queue.append(md)
                    queue.extend(waiting.pop(m, ()))
                ready0 = free[device]
                pos += 1
                gid += 1
                continue
            end = ready + dur[gid]
            starts[gid] = ready
            ends[gid] = end
            done[gid] = 1
            order.append(gid)
            ready0 = ready if quiet and gid in quiet else end
            woken = waiting.pop(gid, None)
            if woken:
                queue.extend(woken)
            pos += 1
            gid += 1
        free[device] = ready0
        heads[device] = pos
    if len(order) != N:
        _report_stuck(schedule, offsets, heads, inputs, peers)
    return Graph(schedule, offsets, inputs, tuple(order), peers, starts, ends)


def _report_stuck(schedule: Schedule, offsets: Sequence[int], heads: list[int],
                  inputs: tuple[tuple[int, ...], ...], peers: Mapping[int, tuple[int, ...]]) -> None:
    """Explain why the traversal stopped: a local order violation, or a cross-device deadlock."""
    rows = schedule.actions

    def done(g: int) -> bool:
        d, i = _where(offsets, g)
        return heads[d] > i

    blocked: dict[int, tuple[int, int]] = {}
    for device, row in enumerate(rows):
        pos = heads[device]
        if pos < len(row):
            gid = offsets[device] + pos
            waits = [g for g in inputs[gid] if not done(g)]
            waits += [m for m in peers.get(gid, ()) if m != gid and heads[_where(offsets, m)[0]] + offsets[
                _where(offsets, m)[0]] != m]
            blocked[device] = _where(offsets, waits[0])
    # A dependency that sits later on the same device is an ordering mistake of that device alone.
    for device, (dep_device, dep_pos) in blocked.items():
        pos = heads[device]
        if dep_device == device:
            _fail(schedule, f"device {device}, position {pos}: {rows[device][pos]} comes before "
                  f"{rows[dep_device][dep_pos]} (position {dep_pos}), which it depends on", device=device, position=pos)
    # Otherwise follow who-waits-for-whom until a device repeats: that is the cycle.
    device = min(blocked)
    chain: list[int] = []
    while device not in chain:
        chain.append(device)
        device = blocked[device][0]
    cycle = chain[chain.index(device):]
    parts = [
        f"device {d} at position {heads[d]} ({rows[d][heads[d]]}) waits for {rows[blocked[d][0]][blocked[d][1]]} "
        f"on device {blocked[d][0]} (position {blocked[d][1]})"
        for d in cycle
    ]
    first = cycle[0]
    _fail(schedule, "deadlock: " + "; ".join(parts), device=first, position=heads[first])


def _check_action_place(schedule: Schedule, device: int, position: int, a: Action) -> None:
    where = dict(device=device, position=position)
    S, M = schedule.stages, schedule.microbatches
    if not 0 <= a.stage < S:
        _fail(schedule, f"device {device}, position {position}: action {a} names stage {a.stage}, "
              f"but stages are 0..{S - 1}", **where)
    if KINDS[a.kind].microbatch and not 0 <= a.microbatch < M:
        _fail(schedule, f"device {device}, position {position}: action {a} names microbatch "
              f"{a.microbatch}, but microbatches are 0..{M - 1}", **where)
    if not KINDS[a.kind].microbatch:
        _fail(schedule, f"device {device}, position {position}: action {a} runs for stage {a.stage}, "
              f"which the placement puts on device(s) {', '.join(map(str, schedule.holders(a.stage)))}", **where)
    home = schedule.device_of(a.stage, a.microbatch)
    route = f" for microbatch {a.microbatch}" if schedule.replicas > 1 else ""
    _fail(schedule, f"device {device}, position {position}: action {a} runs stage {a.stage}, "
          f"which the placement puts on device {home}{route}", **where)


def validate(schedule: Schedule) -> Schedule:
    """Check ``schedule``; return it unchanged or raise :class:`ScheduleError` for the first violation.

    Checked: kinds, ranges and placement; each (stage, microbatch) has exactly one F and
    exactly one backward (B then W, or BW); a replicated stage has an all-reduce on each
    holder; every action after what it waits for (:data:`KINDS`); and all per-device orders
    run together without deadlock.
    """
    dependency_graph(schedule)
    return schedule


def _fail(schedule: Schedule, message: str, *, device: int, position: int) -> None:
    raise ScheduleError(message, render_grid(schedule, device, position), device=device, position=position)


def render_grid(schedule: Schedule, device: int | None = None, position: int | None = None,
                width: int = 12) -> str:
    """A device-by-step grid of the schedule; the cell at (device, position) is marked ``>..<``.

    Long schedules show a window of ``width`` steps around the marked position.
    """
    longest = max((len(r) for r in schedule.actions), default=0)
    centre = position if position is not None else 0
    lo = max(0, min(centre - width // 2, longest - width))
    hi = min(max(longest, (position or 0) + 1), lo + width)
    cells = [[str(a) for a in row[lo:hi]] for row in schedule.actions]
    if device is not None and position is not None:
        row = cells[device]
        while len(row) <= position - lo:
            row.append("")
        row[position - lo] = f">{row[position - lo] or '(end)'}<"
    col_w = max([len("step " + str(hi - 1))] + [len(c) for row in cells for c in row]) + 1
    header = "        " + ("... " if lo > 0 else "") + "".join(f"{lo + i:<{col_w}}" for i in range(hi - lo))
    lines = [header.rstrip()]
    for d, row in enumerate(cells):
        prefix = f"dev {d:<3} " + ("... " if lo > 0 else "")
        suffix = " ..." if hi < len(schedule.actions[d]) else ""
        lines.append((prefix + "".join(f"{c:<{col_w}}" for c in row)).rstrip() + suffix)
    return "\n".join(lines)

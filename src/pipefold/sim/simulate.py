"""Simulator: a cost model and a schedule give a timeline, bubbles and memory.

Every device runs its action list in order; an action starts as soon as its
device is free and what it waits for is done, by the IR's kind table
(:data:`pipefold.ir.KINDS`, which also gives each kind's time and memory effect).
An activation from the previous stage (for F) or a gradient from the next (for
B/BW) costs a point-to-point transfer when the two stages live on different
devices. An all-reduce between replicas starts on all holders together and runs
beside the compute; an overlapped pair lasts max(F, B) or F + B (``overlap``).

Units. By default a cost is for one microbatch through one device's share of
the model (1/p of it): F = B = W = 1 and memory M = 1. A schedule with v stages
per device runs stages that are 1/v of a share, so each stage's times and
memory are divided by v. Activation memory of a (stage, microbatch) is taken
when its F starts and given back when its W ends (all of it when a fused BW
ends). Between its B and its W a stage holds ``M_w``, which may be less than M
(B freed what only it needed) or more (B captured gradients for W and still
keeps W's inputs); B's end steps from M to ``M_w``.

Recomputation (activation checkpointing) trades time for memory: a stage that
recomputes the fraction r of its forward keeps only ``kept = (1 - r) M``
between its F and its backward, rebuilds the rest when its B (or BW) starts,
and that B takes ``r F`` longer::

    F start         B start           B end               W end
    | + kept        | + (M - kept)    | + (M_w - M)       | - M_w
    |---- kept -----|------- M -------|------- M_w -------| 0

    a fused BW:  + (M - kept) when it starts, - M when it ends
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from pipefold._gc import paused_gc
from pipefold.errors import ConfigError
from pipefold.ir import KINDS, Action, Graph, Kind, Schedule, dependency_graph
from pipefold.ir.graph import ActionTable, action_table
from pipefold.ir.schedule import row_lengths
from pipefold.sim.network import Network, Wire

__all__ = ["CostModel", "Interval", "SimResult", "StageCost", "StageOverride", "Timeline", "fits_hold",
           "memory_deltas", "ring_allreduce", "ring_fit", "ring_gather",
           "peak_by_order", "simulate", "slowdown", "split_backward"]


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """Times and activation memory of one stage for one microbatch, in absolute units."""

    f: float
    b: float
    """Input-gradient time, recomputation included."""
    w: float
    memory: float
    """Activation memory while the backward runs: everything the stage saved, recomputed or not."""
    kept: float | None = None
    """Activation memory held from F until the backward starts; None means all of ``memory``."""
    memory_w: float | None = None
    """Activation memory held from the end of B to the end of W; None means ``memory``. May exceed it."""
    allreduce: float = 0.0
    """Time of the all-reduce of this stage's gradients between its replicas (0 with one replica)."""
    opt: float = 0.0
    """Time of this stage's optimizer step."""
    dp_reduce: float = 0.0
    """Time of the all-reduce of this stage's gradients across the data-parallel pipelines (``DP`` actions)."""
    dp_gather: float = 0.0
    """Time of the all-gather of this stage's sharded parameters across the data-parallel pipelines (``AG``)."""
    dp_scatter: float = 0.0
    """Time of the reduce-scatter of this stage's gradients across the data-parallel pipelines (``RS``)."""
    gathered: float = 0.0
    """Memory of this stage's whole parameters and their gradients, held from its ``AG`` to the end of its ``RS``."""
    work: Mapping[str, float] = field(default_factory=dict)
    """Times of the kinds whose cost the model does not derive (K-FAC's KA, KG, KI, KP), by kind code."""
    stash: Mapping[str, float] = field(default_factory=dict)
    """Activation memory a per-microbatch kind keeps of its microbatch until it runs (K-FAC's layer inputs and
    output gradients), by kind code: held beyond the activations once the microbatch's W freed them."""
    fused: float | None = None
    """Time of a fused backward (BW), recomputation included; None: B + W. A runtime that splits the backward
    does work a fused one does not (it finds where W starts, reruns the engine there), so the two differ."""
    offloaded: float = 0.0
    """Activation memory an offload (``OF``) moves to host memory, of what F keeps until the backward."""
    offload: float = 0.0
    """Time of one copy of ``offloaded`` over the host link, either way (``OF`` and ``RL`` each)."""
    vocab_s: float = 0.0
    """With the output layer split by vocabulary: time of one device's shard's forward (``S``) for a microbatch."""
    vocab_t: float = 0.0
    """... of its backward (``T``): its part of the input gradient and its weight gradient."""
    vocab_held: float = 0.0
    """... and the activation memory one shard keeps of a microbatch from its ``S`` to the end of its ``T``."""
    exchange_f: float = 0.0
    """Time of the expert all-to-alls (dispatch and combine) in the stage's forward of a microbatch: beside ``f``,
    which is its compute alone."""
    exchange_b: float = 0.0
    """... and in its input-gradient backward (B, or a fused BW): the same two exchanges reversed."""

    @property
    def bw(self) -> float:
        """Time of a fused backward: ``fused`` where given, else B + W."""
        return self.b + self.w if self.fused is None else self.fused

    @property
    def held(self) -> float:
        """Activation memory held from F until the backward starts."""
        return self.memory if self.kept is None else self.kept

    @property
    def held_w(self) -> float:
        """Activation memory held from the end of B to the end of W."""
        return self.memory if self.memory_w is None else self.memory_w


@dataclass(frozen=True, kw_only=True)
class StageOverride:
    """Absolute times of one stage that replace the derived ones; memory too, unless left None.

    ``recompute`` is the forward time this stage spends again in each backward; ``kept`` the
    activation memory it holds between F and the backward (None: all of ``memory``);
    ``memory_w`` what it holds between its B and its W (None: derived like ``memory``).
    """

    f: float
    b: float
    w: float
    memory: float | None = None
    recompute: float = 0.0
    kept: float | None = None
    memory_w: float | None = None
    work: Mapping[str, float] | None = None
    """Times of K-FAC's (and other registered) kinds on this stage; None: derived from the model's ``work``."""
    stash: Mapping[str, float] | None = None
    """What those kinds keep until they run; None: derived from the model's ``stash``."""
    bw: float | None = None
    """Time of a fused backward (BW) without recomputation; None: ``b + w``."""
    offloaded: float | None = None
    """Activation memory an offload of one microbatch moves to host memory; None: ``offloadable`` of what it keeps."""
    offload: float | None = None
    """Time of that copy, either way; None: derived like the model's ``offload``."""
    exchange_f: float | None = None
    """Time of the stage's expert all-to-alls in a forward; None: derived like the model's ``exchange_f``."""
    exchange_b: float | None = None
    """... in its input-gradient backward; None: derived like the model's ``exchange_b``."""
    collectives: int = 1
    """Collectives each of this stage's ``AG`` and ``RS`` runs when sharded across the data-parallel pipelines:
    FSDP gathers and reduce-scatters each layer with parameters on its own (one FSDP unit per layer), so each
    pays its latency once per unit; the bytes are the stage's whatever their split."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """How long each pass takes, what crossing devices costs, and how much memory activations use."""

    f: float = 1.0
    """Forward time of one microbatch through one device's share of the model."""
    b: float = 1.0
    """Input-gradient backward time (B) for one device's share."""
    w: float = 1.0
    """Weight-gradient backward time (W) for one device's share."""
    memory: float = 1.0
    """Activation memory of one microbatch on one device's share (the unit M)."""
    memory_w: float | None = None
    """Activation memory held between a stage's B and its W, per device share; None: ``memory``. May exceed it."""
    latency: float = 0.0
    """Fixed time of a point-to-point transfer between two devices."""
    bandwidth: float = math.inf
    """Bytes per time unit of a point-to-point link."""
    activation_bytes: float = 0.0
    """Bytes sent between stages per microbatch (activation forward, its gradient backward)."""
    recompute: float = 0.0
    """Fraction of every stage's forward recomputed in its backward (activation checkpointing): 0..1."""
    stage_overrides: Mapping[int, StageOverride] = field(default_factory=dict)
    """Absolute per-stage costs that replace the derived ones for the given stages."""
    grad_bytes: float = 0.0
    """Bytes of the gradients of one device's share of the model: what replicas of a stage all-reduce."""
    opt: float = 0.0
    """Optimizer step time of one device's share."""
    weights: float = 0.0
    """Memory of one device's share of the parameters, gradients and optimizer state, in units of M: held all
    step, once per stage a device holds, so a replicated schedule (Chimera, DualPipe) pays it twice."""
    dp: int = 1
    """Data-parallel copies of the whole pipeline: a ``DP`` action all-reduces its stage's share of
    ``grad_bytes`` among them, as a ring over ``latency`` and ``bandwidth``; sharded (FSDP), ``AG`` all-gathers
    the parameters (as many bytes as the gradients) and ``RS`` reduce-scatters the gradients, each half a ring."""
    gathered: float = 0.0
    """Memory, in units of M, of one device's share of the whole parameters and their gradients: what a stage
    sharded across the data-parallel pipelines holds from its ``AG`` to the end of its ``RS``."""
    overlap: bool = False
    """Whether a device runs the two parts of an overlapped pair (F+B) at once: it then costs max(F, B), else F + B."""
    contention: tuple[float, ...] = ()
    """Devices that share one machine's cores: ``contention[k-1]`` is how many times longer a pass takes while k
    devices compute at once (beyond the table, in proportion to k). Empty: every device computes on its own."""
    work: Mapping[str, float] = field(default_factory=dict)
    """Times of kinds the model does not derive, per device share, by code: K-FAC's ``KA`` and ``KG`` per
    microbatch, ``KI`` and ``KP`` per step (``--work KA=0.5,KI=2``)."""
    stash: Mapping[str, float] = field(default_factory=dict)
    """Memory, in units of M per device share, that ``KA`` or ``KG`` keeps of its microbatch until it runs."""
    message_overhead: float = 0.0
    """Time a device's runtime spends on each message it sends or receives, beside the passes (posting it,
    waiting on it, its bookkeeping): added to the action that sends it and to the one that receives it."""
    allreduce_fits: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    """Measured all-reduces by group size: (latency, bandwidth), an all-reduce of n bytes among that many taking
    latency + n / bandwidth; a size not here is a ring over ``latency`` and ``bandwidth``."""
    sharded_fits: Mapping[int, tuple[tuple[float, float], tuple[float, float]]] = field(default_factory=dict)
    """Measured FSDP collectives by group size: ((latency, bandwidth) of the gather, (latency, bandwidth) of the
    reduce-scatter), each of n bytes of whole parameters in one unit taking latency + n / bandwidth; a size not here
    is half an all-reduce each (:meth:`gather_time`)."""
    mesh: int | tuple[int, ...] = 1
    """Ranks of each device (its tensor-parallel degree), or of device d (``mesh[d]``) where they differ: a message
    between devices crosses in as many pieces at once as the larger mesh has ranks, which the receiving ranks
    then all-gather (:func:`pipefold.runtime.comm.routes`)."""
    offload: float = 0.0
    """Time to copy what one device's share offloads of a microbatch (``offloadable`` of what F keeps until the
    backward) to host memory, and the same back: each ``OF`` and ``RL`` action, on a lane per direction beside the
    compute."""
    offloadable: float = 1.0
    """Fraction of what a stage keeps from F until its backward that an ``OF`` moves to host memory: 0..1 (the rest,
    such as the stage's input and output, which the pipeline still reads, stays)."""
    after_step: float = 0.0
    """Time after every device's last action before the step is over, on no device's timeline: what the runtime
    does once the schedule has run (ZeRO-1's broadcast of the stepped shares). Added to the makespan."""
    vocab_f: float = 0.0
    """Forward time of the output layer (logits, softmax and loss) for one microbatch, the whole layer: part of the
    last stage's forward, or, where the schedule splits it by vocabulary (:attr:`pipefold.ir.Schedule.vocab`), a
    devices-th of it in each device's ``S``. 0: the stages' costs hold it already (or it is negligible)."""
    vocab_b: float = 0.0
    """... its input-gradient time (part of the last stage's B, or a devices-th in each ``T``)..."""
    vocab_w: float = 0.0
    """... its weight-gradient time (part of the last stage's W, or a devices-th in each ``T``)..."""
    vocab_memory: float = 0.0
    """... and the activation memory it keeps of a microbatch (its logits), in units of M: on the last stage until
    its backward, or a devices-th from each device's ``S`` to its ``T``."""
    exchange_f: float = 0.0
    """Time of the expert all-to-alls (mixture of experts: dispatch and combine) in one device share's forward of a
    microbatch, beside the compute ``f``: the pass lasts both."""
    exchange_b: float = 0.0
    """... in its input-gradient backward (B or BW): the outputs' gradients to the experts and the inputs' back."""
    exchange_overlap: bool = False
    """Whether an overlapped pair (F+B) runs one part's expert exchanges while the other part computes (DualPipe's
    overlap): it then lasts the longer of its compute and its exchanges, else the two added."""

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "memory", "memory_w", "latency", "activation_bytes", "grad_bytes", "opt",
                     "weights", "gathered", "message_overhead", "after_step", "offload", "vocab_f", "vocab_b",
                     "vocab_w", "vocab_memory", "exchange_f", "exchange_b"):
            value = getattr(self, name)
            if value is None and name == "memory_w":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"cost {name} must be a finite number >= 0 (got {value!r})")
        for label, table in (("work", self.work), ("stash", self.stash)):
            for code, value in table.items():
                if code not in KINDS:
                    raise ConfigError(f"{label} names kind {code!r}, which is not registered: use one of "
                                      f"{', '.join(KINDS)}")
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise ConfigError(f"{label} of {code} must be a finite number >= 0 (got {value!r})")
        if not (isinstance(self.dp, int) and not isinstance(self.dp, bool) and self.dp >= 1):
            raise ConfigError(f"dp is the number of data-parallel pipelines: an integer >= 1 (got {self.dp!r})")
        if not all(isinstance(c, (int, float)) and math.isfinite(c) and c > 0 for c in self.contention):
            raise ConfigError(f"contention factors must be finite numbers > 0 (got {self.contention!r})")
        if not 0 <= self.recompute <= 1:
            raise ConfigError(f"recompute is a fraction of the forward: 0..1 (got {self.recompute!r})")
        if not 0 <= self.offloadable <= 1:
            raise ConfigError(f"offloadable is a fraction of what a stage keeps: 0..1 (got {self.offloadable!r})")
        if not self.bandwidth > 0:
            raise ConfigError(f"bandwidth must be > 0 bytes per time unit (got {self.bandwidth!r})")
        if any(isinstance(m, bool) or not (isinstance(m, int) and m >= 1)
               for m in (self.mesh if isinstance(self.mesh, tuple) else (self.mesh,))) or self.mesh == ():
            raise ConfigError(f"cost mesh is the ranks of each device: an integer >= 1, or one per device "
                              f"(got {self.mesh!r})")
        for k, fit in self.allreduce_fits.items():
            if not fits_hold(k, (fit,)):
                raise ConfigError(f"an all-reduce fit is a group of >= 2 devices, latency >= 0 and bandwidth > 0 "
                                  f"(got {k}: {fit})")
        for k, fits in self.sharded_fits.items():
            if not fits_hold(k, fits):
                raise ConfigError(f"an FSDP fit is a group of >= 2 devices, each of its gather and reduce-scatter with "
                                  f"latency >= 0 and bandwidth > 0 (got {k}: {fits})")
        for stage, cost in self.stage_overrides.items():
            for name in ("f", "b", "w", "memory", "recompute", "kept", "memory_w", "bw", "offloaded", "offload"):
                value = getattr(cost, name)
                if value is None and name in ("memory", "kept", "memory_w", "bw", "offloaded", "offload"):
                    continue
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise ConfigError(f"stage {stage} cost {name} must be a finite number >= 0 (got {value!r})")
            if isinstance(cost.collectives, bool) or not (isinstance(cost.collectives, int) and cost.collectives >= 1):
                raise ConfigError(f"stage {stage} runs its AG and RS as collectives: a whole number >= 1 "
                                  f"(got {cost.collectives!r})")
            if cost.kept is not None and cost.memory is not None and cost.kept > cost.memory:
                raise ConfigError(f"stage {stage} keeps {cost.kept:g} between F and B, more than its memory "
                                  f"{cost.memory:g}: kept is the part of memory not recomputed")

    @property
    def transfer_time(self) -> float:
        """Time to move one activation (or its gradient) between two devices of the same mesh
        (:meth:`crossing_time`); where the devices' meshes differ, each pair has its own (:meth:`link_times`)."""
        if not isinstance(self.mesh, int) and len(set(self.mesh)) > 1:
            raise ConfigError(f"devices of {self.mesh} ranks cross at different times: read link_times(devices)")
        ranks = self.mesh if isinstance(self.mesh, int) else self.mesh[0]
        return self.crossing_time(ranks, ranks)

    def link_times(self, devices: int) -> float | tuple[tuple[float, ...], ...]:
        """The time an activation takes from each device to each other one: one number where every device has the
        same mesh, else ``[a][b]``, the crossing from device a's mesh to device b's."""
        if isinstance(self.mesh, int) or len(set(self.mesh)) == 1:
            return self.transfer_time
        if len(self.mesh) != devices:
            raise ConfigError(f"the cost model has a mesh for {len(self.mesh)} devices, the schedule {devices}")
        return tuple(tuple(0.0 if a == b else self.crossing_time(self.mesh[a], self.mesh[b]) for b in range(devices))
                     for a in range(devices))

    def crossing_time(self, senders: int, receivers: int) -> float:
        """One activation from a device of ``senders`` ranks to one of ``receivers``: in as many pieces as the larger
        has ranks, each over a link of its own at once, then all-gathered among the receiving ranks."""
        piece = self.activation_bytes / max(senders, receivers)
        return (self.latency + (piece / self.bandwidth if piece else 0.0)
                + self.gather_time(self.activation_bytes, receivers))

    def allreduce_time(self, nbytes: float, replicas: int) -> float:
        """An all-reduce of ``nbytes`` among ``replicas`` devices: the measured fit for that many where there is one
        (``allreduce_fits``), else a ring, 2(n-1) steps of latency and n-th shares."""
        if replicas < 2:
            return 0.0
        if replicas in self.allreduce_fits:
            latency, bandwidth = self.allreduce_fits[replicas]
            return latency + nbytes / bandwidth
        return ring_allreduce(nbytes, replicas, self.latency, self.bandwidth)

    def gather_time(self, nbytes: float, replicas: int) -> float:
        """An all-gather (or reduce-scatter) of ``nbytes`` among ``replicas`` devices: half an all-reduce (a ring's
        n-1 steps of latency and n-th shares against an all-reduce's 2(n-1)), of the measured fit for that many
        where there is one, else of a ring over ``latency`` and ``bandwidth``."""
        if replicas < 2:
            return 0.0
        if replicas in self.allreduce_fits:
            return self.allreduce_time(nbytes, replicas) / 2
        return ring_gather(nbytes, replicas, self.latency, self.bandwidth)

    def stage_cost(self, stage: int, stages: int, devices: int, *, replicas: int = 1,
                   vocab: bool = False) -> StageCost:
        """Cost of ``stage`` in a pipeline of ``stages`` stages over ``devices`` devices, held ``replicas`` times.

        A stage is 1/stages of the model whatever its replicas; the unit costs are for 1/devices of it.
        Its all-reduce moves its share of ``grad_bytes`` between its replicas. The output layer's costs
        (``vocab_*``) go to the last stage, or, with ``vocab`` (split by vocabulary), a devices-th to each shard's
        ``S`` and ``T``.
        """
        cost = self._stage_cost(stage, stages, devices, replicas)
        if vocab:
            return replace(cost, vocab_s=self.vocab_f / devices,
                                       vocab_t=(self.vocab_b + self.vocab_w) / devices,
                                       vocab_held=self.vocab_memory / devices)
        if stage != stages - 1 or not (self.vocab_f or self.vocab_b or self.vocab_w or self.vocab_memory):
            return cost
        more = self.vocab_memory
        return replace(
            cost, f=cost.f + self.vocab_f, b=cost.b + self.vocab_b, w=cost.w + self.vocab_w,
            fused=None if cost.fused is None else cost.fused + self.vocab_b + self.vocab_w,
            memory=cost.memory + more, kept=None if cost.kept is None else cost.kept + more,
            memory_w=None if cost.memory_w is None else cost.memory_w + more,
            offloaded=cost.offloaded + more * self.offloadable)

    def _stage_cost(self, stage: int, stages: int, devices: int, replicas: int) -> StageCost:
        share = devices / stages  # a stage is this fraction of one device's share of the model
        over = self.stage_overrides.get(stage)
        memory_w = None if self.memory_w is None else self.memory_w * share
        allreduce = self.allreduce_time(self.grad_bytes * share, replicas)
        dp_reduce = self.allreduce_time(self.grad_bytes * share, self.dp)
        # k collectives of a stage's bytes: a gather's time is latency plus bytes over bandwidth, so k of a k-th each
        # cost k latencies and the bytes once, however the bytes split among the layers.
        calls = 1 if over is None else over.collectives
        unit = self.grad_bytes * share / calls
        if self.dp in self.sharded_fits:
            (g_lat, g_bw), (s_lat, s_bw) = self.sharded_fits[self.dp]
            gather, scatter = calls * (g_lat + unit / g_bw), calls * (s_lat + unit / s_bw)
        else:
            gather = scatter = calls * self.gather_time(unit, self.dp)
        sharded = {"dp_reduce": dp_reduce, "dp_gather": gather, "dp_scatter": scatter,
                   "gathered": self.gathered * share}
        opt = self.opt * share
        work = {k: v * share for k, v in self.work.items()} if over is None or over.work is None else over.work
        stash = {k: v * share for k, v in self.stash.items()} if over is None or over.stash is None else over.stash
        exchange = {"exchange_f": self.exchange_f * share, "exchange_b": self.exchange_b * share}
        if over is not None:
            exchange = {k: v if getattr(over, k) is None else getattr(over, k) for k, v in exchange.items()}
        if over is None:
            f, memory = self.f * share, self.memory * share
            kept = None if self.recompute == 0 else memory * (1.0 - self.recompute)
            held = memory if kept is None else kept
            return StageCost(f=f, b=self.b * share + self.recompute * f, w=self.w * share, memory=memory, kept=kept,
                             memory_w=memory_w, allreduce=allreduce, opt=opt, work=work, stash=stash,
                             offloaded=held * self.offloadable, offload=self.offload * share, **sharded, **exchange)
        memory = self.memory * share if over.memory is None else over.memory
        kept = None if over.kept is None else min(over.kept, memory)
        held = memory if kept is None else kept
        return StageCost(f=over.f, b=over.b + over.recompute, w=over.w, memory=memory,
                         fused=None if over.bw is None else over.bw + over.recompute, kept=kept,
                         memory_w=memory_w if over.memory_w is None else over.memory_w, allreduce=allreduce, opt=opt,
                         work=work, stash=stash,
                         offloaded=held * self.offloadable if over.offloaded is None else min(over.offloaded, held),
                         offload=self.offload * share if over.offload is None else over.offload, **sharded,
                         **exchange)

    def to_dict(self) -> dict[str, Any]:
        return {
            "f": self.f, "b": self.b, "w": self.w, "memory": self.memory, "memory_w": self.memory_w,
            "latency": self.latency,
            "bandwidth": None if math.isinf(self.bandwidth) else self.bandwidth,
            "activation_bytes": self.activation_bytes, "recompute": self.recompute,
            "grad_bytes": self.grad_bytes, "opt": self.opt, "overlap": self.overlap, "weights": self.weights,
            "contention": list(self.contention), "work": dict(self.work), "stash": dict(self.stash), "dp": self.dp,
            "gathered": self.gathered, "message_overhead": self.message_overhead,
            "allreduce_fits": {str(k): list(fit) for k, fit in self.allreduce_fits.items()},
            "sharded_fits": {str(k): [list(g), list(r)] for k, (g, r) in self.sharded_fits.items()}, "mesh": self.mesh,
            "after_step": self.after_step, "offload": self.offload, "offloadable": self.offloadable,
            "vocab_f": self.vocab_f, "vocab_b": self.vocab_b, "vocab_w": self.vocab_w,
            "vocab_memory": self.vocab_memory, "exchange_f": self.exchange_f, "exchange_b": self.exchange_b,
            "exchange_overlap": self.exchange_overlap,
            "stage_overrides": {str(s): {"f": c.f, "b": c.b, "w": c.w, "memory": c.memory,
                                         "recompute": c.recompute, "kept": c.kept, "memory_w": c.memory_w,
                                         "bw": c.bw, "collectives": c.collectives, "offloaded": c.offloaded,
                                         "offload": c.offload, "exchange_f": c.exchange_f,
                                         "exchange_b": c.exchange_b,
                                         "work": None if c.work is None else dict(c.work),
                                         "stash": None if c.stash is None else dict(c.stash)}
                                for s, c in self.stage_overrides.items()},
        }


def fits_hold(group: object, fits: Iterable[tuple[float, float]]) -> bool:
    """Whether measured fits of a collective among ``group`` ranks are usable: a group of 2 or more, each fit a
    finite latency >= 0 and a bandwidth > 0 (what :class:`CostModel` and a profile file accept)."""
    return (isinstance(group, int) and not isinstance(group, bool) and group >= 2
            and all(math.isfinite(lat) and lat >= 0 and bw > 0 for lat, bw in fits))


def ring_allreduce(nbytes: float, k: int, latency: float, bandwidth: float) -> float:
    """A ring all-reduce of ``nbytes`` among ``k`` devices: 2(k-1) steps of ``latency``, each device moving
    2(k-1)/k of the bytes at ``bandwidth``."""
    if k < 2:
        return 0.0
    steps = 2 * (k - 1)
    return steps * latency + (steps / k * nbytes / bandwidth if nbytes else 0.0)


def ring_gather(nbytes: float, k: int, latency: float, bandwidth: float) -> float:
    """A ring all-gather (or reduce-scatter) of ``nbytes`` among ``k`` devices: half a ring all-reduce, k-1 steps
    and (k-1)/k of the bytes."""
    if k < 2:
        return 0.0
    steps = k - 1
    return steps * latency + (steps / k * nbytes / bandwidth if nbytes else 0.0)


def ring_fit(k: int, latency: float, bandwidth: float) -> tuple[float, float]:
    """:func:`ring_allreduce` among ``k`` devices as an all-reduce fit (``CostModel.allreduce_fits``): the
    (latency, bandwidth) for which latency + n / bandwidth is the ring's time for every n."""
    return 2 * (k - 1) * latency, bandwidth * k / (2 * (k - 1))


def split_backward(times: Mapping[str, float]) -> StageOverride:
    """A stage's times from measured medians by kind: F, B and W, and a fused BW where one ran (where only BW ran,
    B and W are its halves, for the kinds that read them)."""
    f, bw = times.get("F", 0.0), times.get("BW")
    if "B" in times:
        return StageOverride(f=f, b=times["B"], w=times.get("W", 0.0), bw=bw)
    half = (bw or 0.0) / 2
    return StageOverride(f=f, b=half, w=half, bw=bw)


_LEVEL = operator.itemgetter(1)
"""The level of a memory curve's (time, level) point."""


class _Rows(Sequence[Any]):
    """Per device a row made the first time it is read (:meth:`_make`) and kept: reads, compares and hashes as
    the tuple of its rows."""

    __slots__ = ("_made",)
    _made: list[Any]

    def _make(self, device: int) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, device: Any) -> Any:
        if isinstance(device, slice):
            return tuple(self[d] for d in range(*device.indices(len(self))))
        d = range(len(self))[device]  # negative indices, and IndexError past the end
        row = self._made[d]
        if row is None:
            row = self._made[d] = self._make(d)
        return row

    def __iter__(self) -> Any:
        return (self[d] for d in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({tuple(self)!r})"


class MemoryCurves(_Rows):
    """Per device, (time, activation memory from then on) steps starting at (0, 0), and the highest level of each
    (:attr:`peaks`): kept as flat arrays, a device's steps made the first time its row is read, as
    :class:`Timeline` keeps its intervals. A search that reads only the peaks makes none of them. Reads as a tuple
    of tuples of (time, level) pairs."""

    __slots__ = ("_lead", "_levels", "_offsets", "_times", "peaks")

    def __init__(self, times: npt.ArrayLike, levels: npt.ArrayLike, offsets: Sequence[int],
                 lead: Sequence[bool], peaks: Sequence[float]) -> None:
        """Device d's steps are ``times`` and ``levels`` from ``offsets[d]`` to ``offsets[d + 1]``, after a (0, 0)
        where ``lead[d]``; its highest level is ``peaks[d]`` (nan where a level is past the largest float)."""
        self._times, self._levels = np.asarray(times, dtype=np.float64), np.asarray(levels, dtype=np.float64)
        self._offsets, self._lead = list(offsets), list(lead)
        self.peaks = list(peaks)
        self._made: list[tuple[tuple[float, float], ...] | None] = [None] * len(self._lead)

    @classmethod
    def of(cls, rows: Sequence[Sequence[tuple[float, float]]]) -> MemoryCurves:
        """The curves of steps made elsewhere (a run's measured ones), per device, each with a step at least."""
        return cls([t for row in rows for t, _ in row], [v for row in rows for _, v in row],
                   list(itertools.accumulate(map(len, rows), initial=0)), [False] * len(rows),
                   [max(map(_LEVEL, row)) for row in rows])

    def _make(self, device: int) -> tuple[tuple[float, float], ...]:
        a, b = self._offsets[device], self._offsets[device + 1]
        steps = tuple(zip(self._times[a:b].tolist(), self._levels[a:b].tolist(), strict=True))
        return ((0.0, 0.0), *steps) if self._lead[device] else steps


class Interval(NamedTuple):
    """When one action ran on its device."""

    action: Action
    start: float
    end: float


class Timeline(_Rows):
    """Per device, its actions in run order with start and end times, as the simulator computed them: kept as
    flat lists, a device's intervals made the first time its row is read. A search that reads only the makespan,
    the busy times and the peaks makes none of the hundreds of thousands of intervals a large schedule has (nor
    leaves them for the garbage collector to walk). Reads as a tuple of tuples of :class:`Interval`."""

    __slots__ = ("_actions", "_computes", "_ends", "_offsets", "_starts")

    def __init__(self, actions: Sequence[Sequence[Action]], starts: Sequence[float], ends: Sequence[float],
                 computes: npt.NDArray[np.bool_]) -> None:
        self._actions, self._starts, self._ends, self._computes = actions, starts, ends, computes
        self._offsets = list(itertools.accumulate(row_lengths(actions), initial=0))
        self._made: list[tuple[Interval, ...] | None] = [None] * len(actions)

    @classmethod
    def of(cls, rows: Sequence[Sequence[Interval]]) -> Timeline:
        """The timeline of intervals made elsewhere (a run's measured ones), per device in run order."""
        flat = [iv for row in rows for iv in row]
        computes = np.array([KINDS[iv.action.kind].computes for iv in flat], dtype=bool)
        return cls([[iv.action for iv in row] for row in rows], [iv.start for iv in flat], [iv.end for iv in flat],
                   computes)

    def _make(self, device: int) -> tuple[Interval, ...]:
        a, b = self._offsets[device], self._offsets[device + 1]
        # tuple.__new__ on zipped triples: the Intervals without a Python call each.
        return tuple(map(tuple.__new__, itertools.repeat(Interval),
                         zip(self._actions[device], self._starts[a:b], self._ends[a:b], strict=True)))

    def makespan(self) -> float:
        """The latest end of any device's last action."""
        return max((self._ends[b - 1] for a, b in itertools.pairwise(self._offsets) if b > a), default=0.0)

    def company(self, ranks: Sequence[float] | None = None) -> list[float]:
        """Per device, how many other devices compute beside its computing actions, on average over their time
        (0 for a device that computes nothing). Where devices share cores it says how much they share: the
        simulator's processor sharing (``CostModel.contention``) slows each action by the devices computing with it,
        and a measured timeline (:func:`pipefold.runtime.measure.timeline.measured_result`) shows the same count for
        a run.
        With ``ranks``, device d stands for ``ranks[d]`` ranks that compute in step (its tensor-parallel ranks in
        each data-parallel copy), and the count is of the ranks computing beside one of its own."""
        weight = list(ranks) if ranks is not None else [1.0] * len(self._actions)
        marks: list[tuple[float, int, int]] = []  # (time, +1 start / -1 end, device); ends sort before starts
        for d, (a, b) in enumerate(itertools.pairwise(self._offsets)):
            for i in range(a, b):
                if self._computes[i] and self._ends[i] > self._starts[i]:
                    marks += [(self._starts[i], 1, d), (self._ends[i], -1, d)]
        marks.sort(key=lambda m: (m[0], m[1]))
        inside = [0] * len(self._actions)  # computing actions of each device open now (more than 1 where they overlap)
        beside, spent = [0.0] * len(self._actions), [0.0] * len(self._actions)
        computing, last = 0.0, 0.0  # the ranks of the devices with an action open
        for t, step, d in marks:
            span = t - last
            if span > 0 and computing:
                for e, n in enumerate(inside):
                    if n:
                        beside[e] += (computing - 1) * span
                        spent[e] += span
            last = t
            before = inside[d]
            inside[d] += step
            computing += weight[d] * ((inside[d] > 0) - (before > 0))
        return [b / t if t else 0.0 for b, t in zip(beside, spent, strict=True)]

    def busy(self) -> list[float]:
        """Per device, the summed durations of its computing actions, added in run order (as a loop over the
        intervals would: the same float)."""
        out = []
        for a, b in itertools.pairwise(self._offsets):
            spans = np.subtract(self._ends[a:b], self._starts[a:b])[self._computes[a:b]]
            out.append(float(np.cumsum(spans)[-1]) if len(spans) else 0)
        return out


@dataclass(frozen=True)
class SimResult:
    """What the simulator predicts for one schedule under one cost model."""

    schedule: Schedule
    cost: CostModel
    timeline: Timeline
    """Per device, its actions in run order with start and end times."""
    memory_curve: MemoryCurves
    """Per device, (time, activation memory from then on) steps, starting at (0, 0)."""
    exchange_exposed: tuple[float, ...] = ()
    """Per device, the time its passes spend in expert exchanges (``exchange_f``, ``exchange_b``) with nothing
    computing under them: all of it outside overlapped pairs; in a pair that overlaps them, what its exchanges
    last beyond its compute. Empty or zeros without exchanges."""

    @property
    def makespan(self) -> float:
        """From the first action's start to the step's end: the last action's end and the cost model's
        ``after_step``."""
        return self.timeline.makespan() + self.cost.after_step

    @property
    def busy(self) -> list[float]:
        """Per device, the time spent computing (communication actions such as an all-reduce run beside)."""
        return self.timeline.busy()

    @property
    def idle(self) -> list[float]:
        """Per device, makespan minus busy time."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_ratio(self) -> float:
        """1 - busy time / (devices x the schedule's makespan): what follows the schedule (``after_step``) is no
        bubble of it, as the run's measured bubbles leave it out too."""
        span = self.timeline.makespan()
        # The mean busy time over the makespan: the same ratio, without overflowing near the largest float.
        return 1.0 - sum(b / self.schedule.devices for b in self.busy) / span if span else 0.0

    @property
    def peak_memory(self) -> list[float]:
        """Per device, the most memory held at any time, in units of M: the activations' peak plus
        :attr:`static_memory` (0 unless the cost model gives ``weights``)."""
        return [peak + static for peak, static in zip(self.memory_curve.peaks, self.static_memory, strict=True)]

    @property
    def static_memory(self) -> list[float]:
        """Per device, what its stages' parameters, gradients and optimizer state take: ``weights`` per device
        share, for every stage it holds (of any replica); a stage sharded across the data-parallel pipelines
        (it has an ``RS`` there) keeps 1/dp of it."""
        s, w, dp = self.schedule, self.cost.weights, self.cost.dp
        sharded = set()
        if w:  # read off the schedule's table: no Action is made
            table = action_table(s)
            rs = table.kind == table.kinds.index(Kind.RS)
            sharded = set(zip(table.device[rs].tolist(), table.stage[rs].tolist(), strict=True))
        return [w * s.devices / s.stages * sum(1 / dp if (d, st) in sharded else 1 for st in s.stages_of(d))
                for d in range(s.devices)]

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """JSON-ready summary; with ``timeline`` also every action's start and end."""
        s = self.schedule
        out: dict[str, Any] = {
            "schedule": s.name,
            "options": dict(s.options),
            "devices": s.devices,
            "stages": s.stages,
            "microbatches": s.microbatches,
            "placement": s.placement_name,
            "makespan": _round(self.makespan),
            "bubble_ratio": _round(self.bubble_ratio),
            "busy": [_round(x) for x in self.busy],
            "idle": [_round(x) for x in self.idle],
            "peak_memory": [_round(x) for x in self.peak_memory],
            "cost": self.cost.to_dict(),
        }
        if any(self.exchange_exposed):
            out["exchange_exposed"] = [_round(x) for x in self.exchange_exposed]
        if timeline:
            out["timeline"] = [
                [{"action": str(iv.action), "start": _round(iv.start), "end": _round(iv.end)} for iv in row]
                for row in self.timeline
            ]
            out["memory_curve"] = [[[_round(t), _round(m)] for t, m in c] for c in self.memory_curve]
        return out


def _round(x: float) -> float:
    # Sums of halves and thirds pick up float noise; 9 digits keep JSON readable and exact enough.
    return round(x, 9)


@paused_gc()
def simulate(schedule: Schedule, cost: CostModel | None = None, *, network: Network | None = None,
             at: float = 0.0) -> SimResult:
    """Predict the timeline of ``schedule`` under ``cost`` (unit costs by default).

    With ``network`` (times in seconds, so the cost model's times must be seconds too) a transfer
    between devices is not ``cost.transfer_time`` but a message of ``cost.activation_bytes`` on its
    link's :class:`~pipefold.sim.network.Wire`: it leaves after the messages sent before it on that
    link, at the bandwidth of each moment, and arrives a latency later; the step starts ``at``
    seconds into the network's timeline. Raises :class:`~pipefold.errors.ScheduleError` if the
    schedule is invalid.
    """
    cost = cost or CostModel()
    if schedule.seq_chunks > 1:
        cost = per_chunk(cost, schedule.seq_chunks)
    S, D = schedule.stages, schedule.devices
    outside = sorted(s for s in cost.stage_overrides if not 0 <= s < S)
    if outside:
        raise ConfigError(f"a stage cost override names stage {outside[0]}, but {schedule.name} has stages 0..{S - 1}")
    costs = [cost.stage_cost(s, S, D, replicas=len(schedule.holders(s)), vocab=schedule.vocab) for s in range(S)]
    table = action_table(schedule)
    # Each kind's time and memory effect on each stage, from KINDS, then per action (an overlapped pair's from its
    # parts): looked up on arrays rather than action by action.
    simple = [(k, spec) for k, spec in enumerate(KINDS[code] for code in table.kinds) if not spec.composite]
    times = np.zeros((S, len(table.kinds)))
    at_start, at_end, exchanges = np.zeros_like(times), np.zeros_like(times), np.zeros_like(times)
    for st, c in enumerate(costs):
        for k, spec in simple:
            times[st, k] = spec.time(c)
            exchanges[st, k] = spec.exchange(c)
            at_start[st, k], at_end[st, k] = spec.memory(c)
    durations, exposed = _durations(table, times, exchanges, cost)
    idle = frozenset(k for k, spec in KINDS.items() if not spec.computes)
    shared = any(c != 1.0 for c in cost.contention[:D]) or (len(cost.contention) < D and cost.contention)
    event_driven = bool(shared) or network is not None
    links = cost.link_times(D)
    graph = dependency_graph(schedule, None if event_driven else durations, links, idle, table=table,
                             message_cost=cost.message_overhead)
    if cost.message_overhead:  # what the traversal added to each action, or what the timing by events will
        durations = durations + cost.message_overhead * graph.message_ends()
    if network is None:
        transfer: float | tuple[tuple[float, ...], ...] | _Links = links
    else:
        transfer = _Links(network, at, cost.activation_bytes)
    if event_driven:
        all_starts, all_ends = _shared_times(graph, durations.tolist(), transfer, idle, cost.contention)
        starts_at, ends_at = np.array(all_starts), np.array(all_ends)
    else:
        all_starts, all_ends = graph.starts, graph.ends
        starts_at = np.fromiter(all_starts, np.float64, len(all_starts))
        with np.errstate(over="ignore", invalid="ignore"):  # beyond the largest float: reported just below
            ends_at = starts_at + durations  # what the traversal added, action by action
    if not math.isfinite(ends_at.max(initial=0.0)):
        raise ConfigError(f"the costs overflow: {schedule.name}'s step would last longer than the largest float "
                          "(about 1.8e308 time units); give smaller times (--f, --b, --w, --latency, ...), e.g. in "
                          "seconds or milliseconds instead")
    computing = np.array([KINDS[code].computes if code in KINDS else False for code in table.kinds] + [False])
    timeline = Timeline(schedule.actions, all_starts, all_ends, computing[table.kind])
    bounds = [*graph.offsets, schedule.num_actions]
    stashes = _stash_events(graph, costs, all_ends)
    with np.errstate(all="ignore"):  # levels beyond the largest float are reported below
        curves = _memory_curves(bounds, starts_at, ends_at, _by_action(table, at_start, np.add),
                                _by_action(table, at_end, np.add), stashes)
    peaks = curves.peaks
    exposed_by_device = np.bincount(table.device, weights=exposed, minlength=D) if exposed.any() else np.zeros(D)
    result = SimResult(schedule, cost, timeline, curves, tuple(exposed_by_device.tolist()))
    if not all(map(math.isfinite, peaks)) or not all(map(math.isfinite, map(operator.add, peaks,
                                                                             result.static_memory))):
        raise ConfigError(f"the memory costs overflow: {schedule.name}'s memory would add up beyond the largest "
                          "float; give a smaller --mem or --weights (e.g. in MB or GB instead of bytes)")
    return result


def per_chunk(cost: CostModel, chunks: int) -> CostModel:
    """The costs of one of ``chunks`` equal sequence chunks of a microbatch (Seq1F1B): what a pass does for its
    microbatch (times, activation memory, the bytes it sends, K-FAC's per-microbatch work and what it keeps) a
    ``chunks``-th each; what a stage does once a step (all-reduces, the optimizer, K-FAC's inversion) and each
    message's latency unchanged. Equal chunks are equal work: the runtime cuts the sequence into equal lengths, so
    there its later chunks' attention, which reads more keys, takes longer than the earlier ones'."""
    return _scaled(cost, 1.0 / chunks)


def of_microbatch(cost: CostModel, chunks: int) -> CostModel:
    """The costs of a whole microbatch from those of one of its ``chunks`` sequence chunks (a measured step's):
    the inverse of :func:`per_chunk`."""
    return _scaled(cost, float(chunks))


def _scaled(cost: CostModel, k: float) -> CostModel:
    """What a pass does for its microbatch times ``k``; what a stage does once a step as it is."""

    def each(table: Mapping[str, float]) -> dict[str, float]:
        return {code: v * k if KINDS[code].microbatch else v for code, v in table.items()}

    def scaled(value: float | None) -> float | None:
        return None if value is None else value * k

    overrides = {stage: replace(o, f=o.f * k, b=o.b * k, w=o.w * k, memory=scaled(o.memory),
                                recompute=o.recompute * k, kept=scaled(o.kept), memory_w=scaled(o.memory_w),
                                bw=scaled(o.bw), offloaded=scaled(o.offloaded), offload=scaled(o.offload),
                                work=None if o.work is None else each(o.work),
                                stash=None if o.stash is None else {c: v * k for c, v in o.stash.items()})
                 for stage, o in cost.stage_overrides.items()}
    return replace(cost, f=cost.f * k, b=cost.b * k, w=cost.w * k, memory=cost.memory * k,
                   memory_w=scaled(cost.memory_w), activation_bytes=cost.activation_bytes * k,
                   offload=cost.offload * k, work=each(cost.work),
                   stash={c: v * k for c, v in cost.stash.items()}, stage_overrides=overrides)


def _durations(table: ActionTable, times: npt.NDArray[np.float64], exchanges: npt.NDArray[np.float64],
               cost: CostModel) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Every action's duration from ``times[stage, kind]``, and how much of it is an expert exchange that nothing
    computes under. An overlapped pair's parts run one after the other (or at once, ``cost.overlap``); with
    ``cost.exchange_overlap`` one part's exchanges run while the other computes: the pair lasts as long as the
    longest of its compute (one part at a time, or at once), its exchanges (one link), and each part's own compute
    and exchanges (which follow one another: a part's exchange hides under the other part's compute, never its
    own)."""
    parts = np.maximum if cost.overlap else np.add
    durations = _by_action(table, times, parts)
    if not exchanges.any():
        return durations, np.zeros_like(durations)
    communicating = _by_action(table, exchanges, np.add)
    exposed = communicating.copy()
    sizes = np.bincount(table.owner, minlength=len(table.kind)) if len(table.composite) else None
    if cost.exchange_overlap and sizes is not None and (sizes == 2).any():
        pair = np.flatnonzero(sizes == 2)
        first = (np.cumsum(sizes) - sizes)[pair]
        x = _pass_values(table, exchanges)
        c = _pass_values(table, times) - x
        computing = parts(c[first], c[first + 1])
        durations[pair] = np.maximum.reduce([computing, x[first] + x[first + 1], c[first] + x[first],
                                             c[first + 1] + x[first + 1]])
        exposed[pair] = durations[pair] - computing
    return durations, exposed


def _pass_values(table: ActionTable, values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``values[stage, kind]`` of every pass (each part of an action with parts), 0 where not valid."""
    kind, stage = table.pass_kind, table.pass_stage
    ok = (kind >= 0) & (stage.view(np.uint64) < values.shape[0])
    return np.where(ok, values[np.where(ok, stage, 0), np.where(ok, kind, 0)], 0.0)


def _by_action(table: ActionTable, values: npt.NDArray[np.float64],
               combine: Callable[[npt.NDArray[np.float64], npt.NDArray[np.float64]], npt.NDArray[np.float64]]
               ) -> npt.NDArray[np.float64]:
    """``values[stage, kind]`` of every action; of an action with parts, ``combine`` of its parts' in order (what
    ``sum`` or ``max`` gives over them). 0 where the kind or the stage is not valid: the graph reports those."""
    got = _pass_values(table, values)
    if not len(table.composite):
        return got
    sizes = np.bincount(table.owner, minlength=len(table.kind))
    first = np.cumsum(sizes) - sizes
    out = got[first]
    for j in range(1, int(sizes.max())):
        more = sizes > j
        out[more] = combine(out[more], got[first[more] + j])
    return out


def _stash_events(graph: Graph, costs: Sequence[StageCost],
                  ends: Sequence[float]) -> dict[int, list[tuple[float, float]]]:
    """Per device, the memory that actions with a ``stash`` (K-FAC's curvature) hold beyond the activations:
    from the end of their microbatch's weight gradient at their stage, when they end after it, until they end."""
    schedule = graph.schedule
    wanted = {k for k, spec in KINDS.items() if spec.microbatch and not spec.composite
              and any(spec.stash(c) for c in costs)}
    if not wanted:
        return {}
    w_end: dict[tuple[int, int], float] = {}
    pending = []
    for d, row in enumerate(schedule.actions):
        for i, act in enumerate(row):
            g = graph.gid(d, i)
            for a in act.passes:
                if a.kind in (Kind.W, Kind.BW):
                    w_end[a.stage, a.microbatch] = ends[g]
                elif a.kind in wanted:
                    pending.append((d, a, ends[g]))
    out: dict[int, list[tuple[float, float]]] = {}
    for d, a, end in pending:
        freed = w_end.get((a.stage, a.microbatch), math.inf)
        held = KINDS[a.kind].stash(costs[a.stage])
        if end > freed and held:
            out.setdefault(d, []).extend(((freed, held), (end, -held)))
    return out


class _Links:
    """The simulator's side of a :class:`~pipefold.sim.network.Network`: one wire per directed link, the step
    starting ``at`` seconds into the network's timeline."""

    def __init__(self, network: Network, at: float, nbytes: float) -> None:
        self.network, self.at, self.nbytes = network, at, nbytes
        self.wires: dict[tuple[int, int], Wire] = {}

    def send(self, src: int, dst: int, t: float) -> float:
        """A message sent at step time ``t``: when it arrives, in step time."""
        wire = self.wires.get((src, dst))
        if wire is None:
            wire = self.wires[(src, dst)] = Wire(self.network.conditions(src, dst))
        return wire.send(self.at + t, self.nbytes) - self.at


def slowdown(contention: Sequence[float], k: int) -> float:
    """How many times longer a pass takes while k devices compute at once."""
    if not contention:
        return 1.0
    if k <= len(contention):
        return contention[k - 1]
    return contention[-1] * k / len(contention)


def _shared_times(graph: Graph, durations: Sequence[float], transfer: float | tuple[tuple[float, ...], ...] | _Links,
                  idle: frozenset[str],
                  contention: Sequence[float]) -> tuple[list[float], list[float]]:
    """Start and end of every action, event by event in time order: when the devices share cores
    (processor sharing) or their links are :class:`_Links` with queues and time-varying conditions.

    The same rules as :func:`pipefold.ir.dependency_graph`'s timing (an action starts when its device is
    free and its inputs are done, ``transfer`` later from another device; a collective's members start
    together; communication leaves its device free), but a computing action advances at 1 / slowdown(k)
    of its duration per second while k devices compute, so its end depends on what runs beside it. With
    :class:`_Links`, each action's output goes to each other device that needs it as one message, sent
    when the action ends (actions end in time order, so each link's messages queue in the order sent).
    """
    schedule = graph.schedule
    D, N = schedule.devices, schedule.num_actions
    offsets, inputs, peers = graph.offsets, graph.inputs, graph.peers
    lengths = [len(r) for r in schedule.actions]
    dev_of = [d for d in range(D) for _ in range(lengths[d])]
    quiet = {g for d, row in enumerate(schedule.actions) for i, a in enumerate(row)
             if not a.parts and a.kind in idle for g in (offsets[d] + i,)}
    # Communication on a lane (a host link's copies): one at a time per device and kind.
    lane_of = {g: (d, a.kind) for d, row in enumerate(schedule.actions) for i, a in enumerate(row)
               if not a.parts and KINDS[a.kind].lane for g in (offsets[d] + i,) if g in quiet}
    lane_free: dict[tuple[int, str], float] = {}
    starts, ends = [0.0] * N, [0.0] * N
    done = bytearray(N)
    heads = [0] * D
    free = [0.0] * D  # when each idle device became free
    running: dict[int, list[float]] = {}  # device -> [gid, work left in solo seconds]
    t = 0.0
    finished = 0

    links = transfer if isinstance(transfer, _Links) else None
    if isinstance(transfer, _Links):
        delay = [[0.0] * D] * D
    elif isinstance(transfer, (int, float)):
        delay = [[float(transfer)] * D] * D
    else:
        delay = [list(row) for row in transfer]
    arrive: dict[tuple[int, int], float] = {}  # (action, device) -> when its output is there (with links)
    remote: list[list[int]] = [[] for _ in range(N)]  # with links: the other devices that take each output
    if links is not None:
        for g in range(N):
            for i in inputs[g]:
                if dev_of[i] != dev_of[g] and dev_of[g] not in remote[i]:
                    remote[i].append(dev_of[g])

    def ready(g: int) -> float | None:
        d = dev_of[g]
        at = free[d]
        for i in inputs[g]:
            if not done[i]:
                return None
            here = ends[i] if dev_of[i] == d else arrive[(i, d)] if links is not None else ends[i] + delay[dev_of[i]][d]
            at = max(at, here)
        return at

    def sent(g: int) -> None:
        if links is not None:
            for d in remote[g]:
                arrive[(g, d)] = links.send(dev_of[g], d, ends[g])

    while finished < N:
        # Devices whose next action can start, and when.
        soonest, starters = math.inf, []
        for d in range(D):
            if d in running or heads[d] >= lengths[d]:
                continue
            g = offsets[d] + heads[d]
            while g in lane_of:  # a copy on a lane: issued when the device gets to it, which goes on at once
                lane = lane_of[g]
                start = max([free[d], lane_free.get(lane, 0.0), *(ends[i] for i in inputs[g])])
                starts[g], ends[g] = start, start + durations[g]
                lane_free[lane] = ends[g]
                sent(g)
                done[g] = 1
                finished += 1
                heads[d] += 1
                g += 1
            if heads[d] >= lengths[d]:
                continue
            if g in peers:
                members = peers[g]
                if any(heads[dev_of[m]] + offsets[dev_of[m]] != m or dev_of[m] in running for m in members):
                    continue
                times = [ready(m) for m in members]
                if any(x is None for x in times):
                    continue
                at = max(x for x in times if x is not None)
            else:
                got = ready(g)
                if got is None:
                    continue
                at = got
            at = max(at, t)
            if at < soonest - 1e-15:
                soonest, starters = at, [g]
            elif abs(at - soonest) <= 1e-15:
                starters.append(g)
        if finished >= N:  # the last actions were copies on lanes, done as their devices got to them
            break
        factor = slowdown(contention, len(running)) if running else 1.0
        finish = t + min(left for _, left in running.values()) * factor if running else math.inf
        if not running and not starters:
            raise RuntimeError("shared-core timing found no action to run: the schedule graph is inconsistent")
        if soonest <= finish:
            for state in running.values():
                state[1] -= (soonest - t) / factor
            t = soonest
            for g in starters:
                group = peers.get(g, (g,))
                for m in group:
                    if done[m]:
                        continue
                    d = dev_of[m]
                    starts[m] = t
                    if m in quiet:
                        ends[m] = t + durations[m]
                        sent(m)
                        done[m] = 1
                        finished += 1
                        heads[d] += 1
                        free[d] = t
                    else:
                        running[d] = [m, durations[m]]
        else:
            # By the work left, not by (finish - t) / factor: at t of 1e4 s and more that difference rounds, and an
            # action left with a crumb of work would never end. The actions that end now end exactly.
            least = min(left for _, left in running.values())
            for state in running.values():
                state[1] = 0.0 if state[1] - least <= 1e-12 * max(1.0, least) else state[1] - least
            t = finish
        for d in [d for d, (g, left) in running.items() if left <= 1e-12 * max(1.0, durations[int(g)])]:
            g = int(running.pop(d)[0])
            ends[g] = t
            sent(g)
            done[g] = 1
            finished += 1
            heads[d] += 1
            free[d] = t
    return starts, ends


def _memory_curves(bounds: Sequence[int], starts: npt.NDArray[np.float64], ends: npt.NDArray[np.float64],
                   at_start: npt.NDArray[np.float64], at_end: npt.NDArray[np.float64],
                   stashes: Mapping[int, Sequence[tuple[float, float]]]) -> MemoryCurves:
    """Activation memory of each device over time, as (time, level) steps, and the highest level of each (nan where
    a level is not finite). Device d runs actions ``bounds[d]`` to ``bounds[d + 1]``, which change its memory by
    ``at_start`` when they start and by ``at_end`` when they end; ``stashes`` are further (time, change) events by
    device (see :func:`_stash_events`).

    A device runs its passes one after another, so at equal times its own events keep their run order
    (a pass's start before its end, one pass's end before the next one's start); a stash is given back
    before them and taken after them. Several levels at one time keep the highest, then the last: a pass
    that takes no time still holds its memory for that instant, so the peak does not depend on the times
    (it is :func:`peak_by_order`'s), and the curve goes back down at the same time.
    """
    D = len(bounds) - 1
    # Every device's events in run order, a start then an end per action, without those that change nothing.
    device = np.repeat(np.arange(D), np.diff(bounds) * 2)
    times = np.column_stack((starts, ends)).ravel()
    deltas = np.column_stack((at_start, at_end)).ravel()
    keep = deltas != 0
    device, times, deltas = device[keep], times[keep], deltas[keep]
    by = None
    if stashes:  # before the devices' own events in the order to sort: a stash given back first, taken last
        extra = [(d, t, delta) for d, events in stashes.items() for t, delta in events]
        device = np.concatenate(([d for d, _, _ in extra], device))
        times = np.concatenate(([t for _, t, _ in extra], times))
        deltas = np.concatenate(([delta for _, _, delta in extra], deltas))
        rank = [0 if delta < 0 else 2 for _, _, delta in extra]
        by = np.argsort(np.concatenate((rank, np.ones(len(times) - len(rank)))), kind="stable")
    elif np.any((times[1:] < times[:-1]) & (device[1:] == device[:-1])):  # communication frees its device early
        by = np.arange(len(times))
    if by is not None:  # by device, then time, the order above breaking ties
        by = by[np.argsort(times[by], kind="stable")]
        by = by[np.argsort(device[by], kind="stable")]
        device, times, deltas = device[by], times[by], deltas[by]
    # The level after each event, device by device from 0.
    cut = np.searchsorted(device, np.arange(D + 1)).tolist()
    levels = np.empty_like(deltas)
    for d in range(D):
        levels[cut[d]:cut[d + 1]] = np.add.accumulate(deltas[cut[d]:cut[d + 1]])
    for d in sorted(set(device[(np.abs(levels) < 1e-12) & (levels != 0)].tolist())):
        levels[cut[d]:cut[d + 1]] = _levels(deltas[cut[d]:cut[d + 1]])
    # Per device and time (a run of equal times): the highest level there and the last; both points where the last
    # event at the high is not the last there (the level went down after it), else the one.
    n = len(times)
    first = np.flatnonzero(np.concatenate(([True], (times[1:] != times[:-1]) | (device[1:] != device[:-1]))))[:n]
    size = np.diff(np.append(first, n))
    last = first + size - 1
    high = np.maximum.reduceat(levels, first) if n else levels
    top = np.maximum.reduceat(np.where(levels == np.repeat(high, size), np.arange(n), -1), first) if n else first
    both = top != last
    points = 1 + both
    at = np.cumsum(points) - points
    level = np.empty(int(points.sum()))
    level[at] = np.where(both, high, levels[last])
    level[at[both] + 1] = levels[last[both]]
    time = np.repeat(times[first], points)
    # Each device's points, its highest level (nan where a level is past the largest float: every later one is then
    # not finite either, the last included), and the (0, 0) that starts the curve unless an event at 0 took its place.
    groups = np.searchsorted(device[first], np.arange(D + 1)).tolist()
    point = np.append(at, len(level))[groups].tolist()  # each device's first point
    busy = [d for d in range(D) if groups[d] < groups[d + 1]]  # the devices with events
    tops = dict(zip(busy, np.maximum.reduceat(high, [groups[d] for d in busy]).tolist() if busy else (), strict=True))
    lead, peaks = [], []
    for d in range(D):
        lo, hi = point[d], point[d + 1]
        if lo == hi:
            lead.append(True)
            peaks.append(0.0)
            continue
        peak = tops[d] if math.isfinite(levels[cut[d + 1] - 1]) else math.nan
        lead.append(bool(time[lo] != 0.0))
        peaks.append(max(peak, 0.0) if lead[-1] else peak)
    return MemoryCurves(time, level, point, lead, peaks)


def _levels(deltas: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """The running sum of ``deltas`` from 0, one by one in order, where a level within 1e-12 of 0 is float noise
    and counts as 0 from there on."""
    levels = np.add.accumulate(deltas)  # sequential: the same sums as a loop
    start = 0
    for _ in range(8):
        noise = np.flatnonzero((np.abs(levels[start:]) < 1e-12) & (levels[start:] != 0))
        if not len(noise):
            return levels
        start += int(noise[0])
        levels[start] = 0.0
        start += 1
        levels[start:] = np.add.accumulate(deltas[start:])
    # Noise again and again (memory that keeps coming back to nothing): the rest one by one.
    out = levels.tolist()
    level = out[start - 1]
    for k in range(start, len(out)):
        level += float(deltas[k])
        if abs(level) < 1e-12:
            level = 0.0
        out[k] = level
    return np.array(out)


def memory_deltas(kind: str, cost: StageCost) -> tuple[float, float]:
    """How one pass changes its device's activation memory: (when it starts, when it ends), from :data:`KINDS`.

    F takes what the stage keeps; a backward first rebuilds what was recomputed; B's end goes
    from ``memory`` to ``memory_w`` (a step up or down); W gives back ``memory_w``, a fused BW
    all of ``memory``.
    """
    return KINDS[kind].memory(cost)


def _delta_table(costs: Mapping[int, StageCost]) -> dict[tuple[int, str], tuple[float, float]]:
    """:func:`memory_deltas` of every (stage, kind), worked out once for a pass over many actions."""
    return {(s, kind): spec.memory(c) for s, c in costs.items() for kind, spec in KINDS.items() if not spec.composite}


def _deltas_of(a: Action, deltas: Mapping[tuple[int, str], tuple[float, float]]) -> tuple[float, float]:
    if not a.parts:
        return deltas[a.stage, a.kind]
    starts, ends = zip(*(deltas[p.stage, p.kind] for p in a.parts), strict=True)
    return sum(starts), sum(ends)


def peak_by_order(actions: Sequence[Action], costs: Mapping[int, StageCost]) -> float:
    """The peak activation memory of one device running ``actions`` in order, without timing them.

    A device runs one pass at a time, so its memory depends on the order of its own passes
    only; this is :func:`simulate`'s peak for that device, at a fraction of the cost, for
    searches that try many memory costs on one schedule.
    """
    deltas = _delta_table(costs)
    level = peak = 0.0
    for a in actions:
        at_start, at_end = _deltas_of(a, deltas)
        level += at_start
        peak = max(peak, level)
        level += at_end
    # A B may end higher than it ran (memory_w > memory); the next pass's start counts that level,
    # but ``actions`` may stop at a B.
    return max(peak, level)

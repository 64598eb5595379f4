"""Measuring on this machine: what a layer or a stage costs, what the link costs, how ranks share the cores.

Everything :mod:`pipefold.plan` decides from is measured here, on the runtime's own parts, and handed to it as
numbers (a :class:`~pipefold.plan.profile.Profile`, per-layer costs, per-stage
:class:`~pipefold.plan.recompute.StageProfile`), so the planner never runs a model. One pass timer
(:func:`run_passes`: F, B and W of one microbatch on a :class:`~pipefold.runtime.stage.StageRunner`, each timed,
synchronized with the device where it computes) serves the profile, the split by time, recomputation's stage
figures and K-FAC's work (:func:`pipefold.runtime.curvature.measure`); each walks its layers or stages in order,
feeding each the previous one's output.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models import Model, make_model
from pipefold.models.size import check_model
from pipefold.plan.partition import COST_KINDS, LayerFigures
from pipefold.plan.profile import LayerProfile, Profile, Progress, fit_link, pass_fixed_of
from pipefold.plan.recompute import OPTIMIZER_STATE, StageProfile
from pipefold.runtime import sockets
from pipefold.runtime.comm import FlatAllReduce, post_message
from pipefold.runtime.host_memory import keep_freed_pages
from pipefold.runtime.launch.processes import process_context, rendezvous, starting, stopped_on_error
from pipefold.runtime.stage import (
    Chain,
    StageRunner,
    as_leaves,
    as_tuple,
    autocast_now,
    computing_in,
    grad_node,
    graph_below,
    ones_for,
    split_batch,
)
from pipefold.runtime.timed import no_wait, run_passes, timed_backward, timed_forward

__all__ = ["FULL", "MATMUL_DTYPES", "QUICK", "Effort", "layer_costs", "layer_memory", "layer_static_bytes",
           "measure_allreduce", "Measured",
           "measure_contention", "measure_fsdp", "measure_fsdp_hooks", "measure_layers", "measure_link",
           "measure_matmuls", "measure_sharded", "measure_stages", "measure_zero1", "profile_model", "run_passes",
           "split_figures", "TimedLayer", "TimedStage", "layers_per_rank", "time_in_stages"]

Values = tuple[torch.Tensor, ...]
@dataclasses.dataclass(frozen=True)
class Effort:
    """How long a profile's measurements between processes run: rounds of each, and the windows in which ranks share
    the cores. The layers' own timings are ``repeats`` (:func:`profile_model`)."""

    link_rounds: int = 20
    """Round trips of each message size (:func:`measure_link`)."""
    reduce_rounds: int = 5
    """All-reduces, and FSDP's gathers and scatters, of each size (:func:`measure_allreduce`, :func:`measure_fsdp`)."""
    zero1_rounds: int = 10
    """ZeRO-1 shares of each size (:func:`measure_zero1`)."""
    hook_rounds: int = 5
    """Timings of FSDP's hooks (:func:`measure_fsdp_hooks`)."""
    sharing_rounds: int = 3
    """Rounds of k = 1..devices processes computing at once (:func:`measure_contention`)."""
    sharing_seconds: float = 1.0
    """The longest window of one such measurement."""


FULL = Effort()
QUICK = Effort(link_rounds=8, reduce_rounds=2, zero1_rounds=3, hook_rounds=2, sharing_rounds=1, sharing_seconds=0.3)
"""``pipefold profile --quick``: a profile in about two thirds of the time, for a first look at a flow; the figures
spread more from run to run."""

_LINK_SIZES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)
_REDUCE_SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)


def layers_per_rank(layers: int, devices: int) -> int:
    """How many of ``layers`` a rank holds at most when ``devices`` share them evenly: the ``stage_layers`` that
    :func:`time_in_stages` times together."""
    return -(-layers // max(1, devices))


@dataclasses.dataclass
class TimedStage:
    """A stage's worth of layers timed as one stage by :func:`time_in_stages`: which layers, and its medians."""

    layers: range
    f: float
    b: float
    w: float
    bw: float


@dataclasses.dataclass
class TimedLayer:
    """What :func:`time_in_stages` found for one layer: its medians, and its input and output of the last run."""

    f: float
    b: float
    w: float
    bw: float
    x: Values
    out: Values
    update: float = 0.0
    """With an optimizer: the update after the schedule of its parameters (0: none, or not timed)."""


def time_in_stages(layers: Sequence[nn.Module], sample: Any, target: Any = None,
                   loss_fn: Callable[..., torch.Tensor] | None = None, *, stage_layers: int = 1, repeats: int = 7,
                   microbatches: int = 1, fused: bool = True, whole: bool = True, optimizer: str | None = None,
                   progress: Progress | None = None) -> tuple[list[TimedLayer], list[TimedStage]]:
    """Every layer's F, B, W and (with ``fused``) fused BW, each the median of ``repeats`` runs after a warm-up,
    timed among the layers of its stage; with ``whole``, every stage of two layers or more timed as one as well.

    The layers are taken ``stage_layers`` at a time, in order, as a rank of the run holds them: a run sends one
    microbatch forward through all of them, then backward through each in reverse, each layer on the runtime's
    stage runner and fed the previous one's output (the first, ``sample``; the last computes ``loss_fn`` against
    ``target`` if given, any other backward starts from gradients of ones), a split backward and a fused one in
    turn. So between two passes of one layer the rest of its stage's weights go through the caches, as in the
    run: a layer timed alone, over and over, keeps its weights in the caches and came out 1.3 times faster
    (1.16 to 1.33 over 5 rounds) than among 8 like it (the MLP at width 512 on a 2-core machine with 2 MiB of L2
    per core: ``benchmarks/layer_company.py``). In the same runs (one after the other, so the machine's drift
    touches both alike) the stage's layers go through F, B and W and through F and BW on one stage runner, as
    the run's rank holds them: what its passes pay once that each layer timed alone paid again
    (:func:`pipefold.plan.profile.pass_fixed_of`). With ``optimizer`` (a name ``pipefold train --optimizer``
    takes), each run ends as a step does, with the update of the stage's layers one after the other
    (:class:`_Update`), timed per layer: after the passes, as in the run, not over and over on warm parameters
    (the layouts' GPT's AdamW: 8.6 to 9.4 ms over and over, 10.4 to 11.1 ms after a forward and backward,
    benchmarks/results/profile.md). The layers' weights are put back afterwards.
    """
    _check_repeats(repeats)
    if isinstance(stage_layers, bool) or not isinstance(stage_layers, int) or stage_layers < 1:
        raise ConfigError(f"stage_layers must be a positive integer (got {stage_layers!r})")
    last = len(layers) - 1
    x: Values = as_tuple(sample)
    found: list[TimedLayer] = []
    stages: list[TimedStage] = []
    for start in range(0, len(layers), stage_layers):
        if progress is not None:
            progress("layers", start, len(layers))
        group = range(start, min(len(layers), start + stage_layers))
        runners = [StageRunner(Chain(layers[i]), loss_fn=loss_fn if i == last else None, input_grads=i > 0)
                   for i in group]
        stage = (StageRunner(Chain(*(layers[i] for i in group)), loss_fn=loss_fn if last in group else None,
                             input_grads=start > 0) if whole and len(group) > 1 else None)
        runs: list[list[tuple[float, ...]]] = [[] for _ in group]
        stage_runs: list[tuple[float, ...]] = []
        trained = [[p for p in layers[i].parameters() if p.requires_grad] for i in group]
        kept = [[p.detach().clone() for p in ps] for ps in trained] if optimizer is not None else []
        updates = [_Update(ps, optimizer) if ps and optimizer is not None else None for ps in trained]
        updated: list[list[float]] = [[] for _ in group]
        ins: list[Values] = []
        outs: list[Values] = []
        for k in range(repeats + 1):
            split: list[tuple[float, ...]] = []
            for together in (False, True) if fused else (False,):
                h, ins, outs, forwards = x, [], [], []
                for runner in runners:
                    f, out = timed_forward(runner, 2 * k + together, h, target, scale=1.0 / microbatches)
                    ins.append(h)
                    outs.append(out)
                    forwards.append(f)
                    h = tuple(t.detach() for t in out)
                backwards = [timed_backward(runner, 2 * k + together, out, fused=together)
                             for runner, out in reversed(list(zip(runners, outs, strict=True)))][::-1]
                if not together:
                    split = [(f, b, w) for f, (b, w) in zip(forwards, backwards, strict=True)]
                else:
                    split = [(*row, bw) for row, (bw, _) in zip(split, backwards, strict=True)]
            for j, row in enumerate(split):
                runs[j].append(row if fused else (*row, 0.0))
            if stage is not None:
                stage_runs.append(_timed_stage(stage, k, x, target, microbatches, fused))
            for j, update in enumerate(updates):
                updated[j].append(0.0 if update is None else update())
        with torch.no_grad():
            for ps, saved in zip(trained, kept, strict=False):
                for p, weight in zip(ps, saved, strict=True):
                    p.copy_(weight)
        for i, j in zip(group, range(len(group)), strict=True):
            layers[i].zero_grad(set_to_none=True)
            f, b, w, bw = medians(runs[j][1:])
            found.append(TimedLayer(f, b, w, bw, x=ins[j], out=outs[j], update=statistics.median(updated[j][1:])))
        if stage_runs:
            f, b, w, bw = medians(stage_runs[1:])
            stages.append(TimedStage(group, f, b, w, bw))
        x = tuple(t.detach() for t in outs[-1])
    if progress is not None:
        progress("layers", len(layers), len(layers))
    return found, stages


def _timed_stage(stage: StageRunner, k: int, x: Values, target: Any, microbatches: int,
                 fused: bool) -> tuple[float, float, float, float]:
    """One microbatch through a whole stage: F, B and W, then (with ``fused``) F and BW; (f, b, w, bw) seconds."""
    f, out = timed_forward(stage, 2 * k, x, target, scale=1.0 / microbatches)
    b, w = timed_backward(stage, 2 * k, out)
    bw = 0.0
    if fused:
        _, out = timed_forward(stage, 2 * k + 1, x, target, scale=1.0 / microbatches)
        bw = timed_backward(stage, 2 * k + 1, out, fused=True)[0]
    return f, b, w, bw


def medians(runs: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
    """The median of each position over ``runs``."""
    return tuple(statistics.median(v) for v in zip(*runs, strict=True))


def _check_repeats(repeats: object) -> None:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer (got {repeats!r})")


def _output_bytes(out: Values) -> int:
    """Bytes a stage boundary after these outputs sends: their floating storages."""
    return sum(t.untyped_storage().nbytes() for t in out if t.is_floating_point())


def _tensor_bytes(layer: nn.Module) -> tuple[int, ...]:
    """Bytes of each of this rank's parameters: a tensor-parallel weight's own shard, not the whole."""
    from pipefold.runtime.sharding import local

    return tuple(local(p).numel() * p.element_size() for p in layer.parameters())


def _param_bytes(layer: nn.Module) -> int:
    """Bytes of this rank's parameters: a tensor-parallel weight's own shard, not the whole."""
    return sum(_tensor_bytes(layer))


def _kind(layer: nn.Module, x: Values, *more: object) -> tuple[Any, ...]:
    """What makes two layers the same computation: type, parameter shapes and dtypes, input shapes and dtypes."""
    return (type(layer).__qualname__, tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()),
            tuple((tuple(t.shape), t.dtype) for t in x), *more)


def _shared_means(values: list[tuple[float, ...]], kinds: dict[tuple[Any, ...], list[int]]) -> None:
    """Layers of one kind take the mean of their measured figures (in place): they cost the same, and timing
    noise must not tell them apart (it would choose the split)."""
    for group in kinds.values():
        mean = tuple(statistics.fmean(values[i][j] for i in group) for j in range(len(values[group[0]])))
        for i in group:
            values[i] = mean


# --------------------------------------------------------------------------- layers


class Measured(NamedTuple):
    """What :func:`measure_layers` found: each layer's figures, and what a stage's passes pay once that each of its
    layers timed alone paid again (F, B, W, BW: ``Profile.pass_fixed``)."""

    layers: list[LayerProfile]
    fixed: tuple[float, float, float, float]


def measure_layers(layers: Sequence[nn.Module], sample: Any, target: Any, loss_fn: Callable[..., torch.Tensor], *,
                   microbatches: int = 1, repeats: int = 7, stage_layers: int = 1, optimizer: str | None = None,
                   fixed: bool = True, progress: Progress | None = None) -> Measured:
    """Each layer's figures: its passes' times from :func:`time_in_stages` (``stage_layers`` at a time, as a rank
    holds them: the caches see what the run's do), a split backward's B and W and a fused one's BW (a fused
    backward does less than B and W: it need not find and restart where W starts); layers that are the same
    computation (type, parameter shapes, input shapes) share their mean. Bytes come from :func:`layer_memory`
    (the runtime's meter). With ``optimizer`` (a name ``pipefold train --optimizer`` takes), what the step after
    the schedule spends on each layer's parameters (timed after the passes, as a step does). And from the same runs,
    each stage of two layers or more timed whole against its layers' figures: what a stage pays once
    (:func:`pipefold.plan.profile.pass_fixed_of`); without ``fixed`` no stage is timed whole and that is 0.
    """
    _check_repeats(repeats)
    held = layer_memory(layers, sample, loss_fn=loss_fn, target=target)
    timed, stages = time_in_stages(layers, sample, target, loss_fn, stage_layers=stage_layers, repeats=repeats,
                                   microbatches=microbatches, whole=fixed, optimizer=optimizer, progress=progress)
    last = len(layers) - 1
    times: list[tuple[float, ...]] = [(t.f, t.b, t.w, t.bw, t.update) for t in timed]
    kinds: dict[tuple[Any, ...], list[int]] = {}
    depth: dict[tuple[Any, ...], float] = {}
    for i, (layer, t) in enumerate(zip(layers, timed, strict=True)):
        kind = _kind(layer, t.x, i == last, i == 0)
        kinds.setdefault(kind, []).append(i)
        if i > 0 and kind not in depth:  # a first layer is never below another in its stage
            depth[kind] = _w_per_node_below(layer, loss_fn if i == last else None, t.x, target, microbatches,
                                            repeats)
            layer.zero_grad(set_to_none=True)
    _shared_means(times, kinds)
    w_depth = [next((d for kind, d in depth.items() if i in kinds[kind]), 0.0) for i in range(len(layers))]
    found = [LayerProfile(f=f, b=b, w=w, bw=bw, held=int(h), held_w=int(hw), params=_param_bytes(layer),
                          out=0 if i == last else _output_bytes(t.out), nodes=_graph_nodes(layer, t.x), w_depth=d,
                          tensors=_tensor_bytes(layer), update=u)
             for i, ((f, b, w, bw, u), (h, hw), layer, t, d) in enumerate(zip(times, held, layers, timed, w_depth,
                                                                               strict=True))]
    return Measured(found, pass_fixed_of(found, [(st.layers, (st.f, st.b, st.w, st.bw)) for st in stages]))


class _Update:
    """The update after the schedule of ``params`` as a run makes it: the gradients' check (its sum of squares,
    :func:`pipefold.runtime.numerics.local_check`) and a step of ``optimizer``
    (:class:`pipefold.runtime.launch.settings.Optimizer`). Each call runs one on the gradients there are and returns its
    seconds (to its end on a GPU); the parameters change."""

    def __init__(self, params: Sequence[nn.Parameter], optimizer: str) -> None:
        from pipefold.runtime.launch.settings import Optimizer
        from pipefold.runtime.sharding import local

        self.params = list(params)
        self.device = local(self.params[0]).device
        self.opt = Optimizer(name=optimizer).make(self.params)
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else no_wait

    def __call__(self) -> float:
        from pipefold.runtime.numerics import local_check

        self.sync()
        t0 = time.perf_counter()
        local_check(self.params, (), self.device)
        self.opt.step()
        self.sync()
        return time.perf_counter() - t0


def _timed_update(params: Sequence[nn.Parameter], optimizer: str, repeats: int) -> float:
    """The median seconds of ``repeats`` updates (:class:`_Update`) of ``params`` in a row after a warm-up, on
    gradients of ones."""
    for p in params:
        p.grad = torch.ones_like(p)
    update = _Update(params, optimizer)
    return statistics.median([update() for _ in range(repeats + 1)][1:])


class _Below(nn.Module):
    """``n`` autograd nodes that compute nothing (views of the first floating input): the graph that the layers
    below a layer in its stage put under it, for its W's restarts of the engine to walk."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, *xs: torch.Tensor) -> Any:
        out = list(xs)
        at = next(i for i, t in enumerate(out) if t.is_floating_point())
        for _ in range(self.n):
            out[at] = out[at].view_as(out[at])
        return tuple(out) if len(out) > 1 else out[0]


_BELOW = 2048
"""Nodes put under a layer to time what they add to its W: enough that the difference is milliseconds."""


def _w_per_node_below(layer: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, x: Values, target: Any,
                      microbatches: int, repeats: int) -> float:
    """Seconds ``layer``'s W takes longer per autograd node below it: its W with :data:`_BELOW` view nodes under
    it in the stage and without, timed in turn; the median difference per node (0 when not longer: noise)."""
    below = _Below(_BELOW)
    alone = StageRunner(Chain(layer), loss_fn=loss_fn, input_grads=True)
    deep = StageRunner(Chain(below, layer), loss_fn=loss_fn, input_grads=True)
    extra = []
    for k in range(repeats + 1):
        w = run_passes(alone, k, x, target, scale=1.0 / microbatches)[0][2]
        extra.append(run_passes(deep, k, x, target, scale=1.0 / microbatches)[0][2] - w)
    added = _graph_nodes(Chain(below, layer), x) - _graph_nodes(layer, x)
    return max(0.0, statistics.median(extra[1:]) / max(1, added))


def _graph_nodes(layer: nn.Module, x: Values) -> int:
    """Autograd nodes one forward of ``layer`` adds to the graph of its inputs (its weights' accumulators counted)."""
    leaves = as_leaves(x) if any(t.is_floating_point() for t in x) else x
    with torch.enable_grad():
        roots = [n for o in as_tuple(layer(*leaves)) if (n := o.grad_fn) is not None]
    inputs = [n for t in leaves if (n := grad_node(t)) is not None]
    return len(graph_below(roots) - graph_below(inputs))


def layer_costs(layers: Sequence[nn.Module], sample: torch.Tensor | tuple[torch.Tensor, ...], *, by: str,
                repeats: int = 5, optimizer_factor: float = 2.0, stage_layers: int = 1) -> list[float]:
    """Cost of each layer: ``params`` (parameter count), ``time`` (F + B + W seconds) or ``memory`` (bytes).

    ``time`` and ``memory`` run the layers in order on ``sample`` (one microbatch: a tensor, or a tuple for a
    first layer with several inputs), each fed the previous layer's output (spread when it is a tuple, as from
    the segments of :func:`pipefold.models.cut.cut_model`). ``time`` is the median over ``repeats`` runs after a
    warm-up of the layer's passes on the runtime's stage runner, ``stage_layers`` at a time
    (:func:`time_in_stages`); layers that are the same computation (as a transformer's blocks) take the mean of
    their times. ``memory`` is the activation bytes saved for backward
    (the layer's own weights excluded) plus the parameter bytes times 1 + ``optimizer_factor`` (weights,
    gradients and optimizer state; AdamW's two moments make 2 the default).
    """
    if by not in COST_KINDS:
        raise ConfigError(f"unknown cost {by!r}: choose one of {', '.join(COST_KINDS)}")
    if by == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    _check_repeats(repeats)
    costs: list[tuple[float, ...]] = []
    kinds: dict[tuple[Any, ...], list[int]] = {}
    if by == "time":
        timed, _ = time_in_stages(layers, sample, stage_layers=stage_layers, repeats=repeats, fused=False,
                                  whole=False)
        for i, (layer, t) in enumerate(zip(layers, timed, strict=True)):
            kinds.setdefault(_kind(layer, t.x), []).append(i)
            costs.append((t.f + t.b + t.w,))
    else:
        x: Values = as_tuple(sample)
        for layer in layers:
            saved, out = _saved_bytes(layer, x)
            costs.append((float(saved + _param_bytes(layer) * (1 + optimizer_factor)),))
            x = tuple(t.detach() for t in out)
    _shared_means(costs, kinds)
    return [c[0] for c in costs]


def _saved_bytes(layer: nn.Module, x: Values) -> tuple[int, Values]:
    """Bytes of the tensors one forward of ``layer`` saves for its backward, its own weights excluded (on fresh
    leaf copies of ``x``: floating inputs get a gradient, so the backward includes it)."""
    own = {p.data_ptr() for p in layer.parameters()}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        key = (t.data_ptr(), tuple(t.shape))
        if t.data_ptr() not in own and key not in seen:
            seen.add(key)
            saved += t.numel() * t.element_size()
        return t.detach()  # the graph is dropped unused: it must not hold itself through a saved output

    device = next((t.device for t in x if isinstance(t, torch.Tensor)), torch.device("cpu"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_now(device):
        out = as_tuple(layer(*as_leaves(x)))
    return saved, out


def split_figures(layers: Sequence[nn.Module], sample: torch.Tensor | tuple[torch.Tensor, ...], *, by: str,
                  loss_fn: Callable[..., torch.Tensor], target: Any, optimizer_factor: float = 2.0,
                  stage_layers: int = 1) -> LayerFigures:
    """What splitting the layers ``by`` 'params', 'time', 'memory' (or 'all' of them) weighs, measured on one
    microbatch (``sample`` and its ``target``) where ``layers`` are: parameter counts; F + B + W times; the bytes
    each holds from F to B and from B to W, the last layer computing the loss as the last stage does; and the
    static bytes with ``optimizer_factor`` parameter sizes of optimizer state (:func:`layer_static_bytes`). The
    times are taken ``stage_layers`` at a time (:func:`time_in_stages`: the layers a rank will hold). The one
    measurement behind ``pipefold partition`` and the split of ``pipefold train``."""
    times, memory = LayerFigures.needs(by)
    params = layer_costs(layers, sample, by="params")
    if not times:
        return LayerFigures(params)
    measured = layer_costs(layers, sample, by="time", stage_layers=stage_layers)
    if not memory:
        return LayerFigures(params, measured)
    held = layer_memory(layers, sample, loss_fn=loss_fn, target=target)
    static = layer_static_bytes(layers, optimizer_factor=optimizer_factor)
    return LayerFigures(params, measured, [float(h) for h, _ in held], [float(w) for _, w in held], static)


def layer_static_bytes(layers: Sequence[nn.Module], *, optimizer_factor: float = 2.0) -> list[float]:
    """Bytes each layer holds whatever the schedule: parameter bytes x (2 + ``optimizer_factor``).

    Weights, their gradients and the optimizer state (``optimizer_factor`` parameter sizes: AdamW's
    two moments make 2, plain SGD 0; see :data:`pipefold.plan.recompute.OPTIMIZER_STATE`).
    """
    if not (isinstance(optimizer_factor, (int, float)) and math.isfinite(optimizer_factor) and optimizer_factor >= 0):
        raise ConfigError(f"optimizer_factor counts parameter sizes of optimizer state: a number >= 0 "
                          f"(got {optimizer_factor!r})")
    return [float(_param_bytes(layer) * (2 + optimizer_factor)) for layer in layers]


def layer_memory(layers: Sequence[nn.Module], sample: torch.Tensor | tuple[torch.Tensor, ...], *,
                 loss_fn: Callable[..., torch.Tensor] | None = None, target: Any = None) -> list[tuple[int, int]]:
    """Per layer, the bytes one microbatch holds after its F and between its B and its W, measured.

    Each layer runs as a stage of its own on the runtime's stage runner and meter, fed the previous
    layer's output (``sample`` for the first, whose input is the batch and not counted), so the
    figures are what the runtime holds: after F the layer's input and what it saved (its output
    only where it saved it too: the next layer holds it); between B and W what W reads, the
    gradients it captured included. With ``loss_fn`` the last layer computes the loss against
    ``target``, as the last stage does. A stage's figures are the sums over its layers.
    """
    out: list[tuple[int, int]] = []
    x: Values = as_tuple(sample)
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        loss = loss_fn if i == last else None
        runner = StageRunner(Chain(layer), loss_fn=loss, input_grads=i > 0)
        runner.meter.start(outside=[*(x if i == 0 else ()), *([target] if loss is not None else [])])
        runner.meter.hold(x, "recv")  # a stage's input is a receive buffer (the batch's is outside: not counted)
        y = runner.forward(0, x, target if loss is not None else None)
        held = runner.held_bytes(0, outputs=loss is not None)
        grads = None if loss is not None else ones_for(y)
        runner.meter.hold(grads or (), "recv")
        runner.backward_input(0, grads)
        # What W reads; the outputs W starts from only where the layer saved them too (a first layer's backward
        # runs entirely in W, from its outputs' nodes: in a stage the runtime keeps those, not the outputs).
        out.append((held, runner.held_bytes(0, outputs=False)))
        runner.backward_weight(0)
        layer.zero_grad(set_to_none=True)
        x = tuple(t.detach() for t in y)
    return out


# --------------------------------------------------------------------------- stages


def measure_stages(stages: Sequence[nn.Sequential], sample: torch.Tensor | Sequence[torch.Tensor], target: Any,
                   loss_fn: Callable[..., torch.Tensor], *, microbatches: int = 1,
                   optimizer_factor: float = 2.0, repeats: int = 5) -> list[StageProfile]:
    """Run each stage on one sample microbatch with r = 0..layers recomputed layers, as the runtime would.

    ``stages`` are the model's stages in pipeline order (the last computes ``loss_fn`` against
    ``target``); each stage is fed the previous stage's output, the first ``sample`` (a tensor or
    a tuple of them). Kept and total bytes are read
    from the stage runner's own meter; times are medians of ``repeats`` runs after a warm-up (and, without
    recomputation, as many with a fused backward), and a count's rerun time is its backward's time beyond the
    backward without recomputation.
    """
    _check_repeats(repeats)
    profiles: list[StageProfile] = []
    x: Values = as_tuple(sample)
    last = len(stages) - 1
    for s, stage in enumerate(stages):
        n = len(stage)
        kept: list[int] = []
        total, held_w, fused, backward = [], [], [], []
        times, h, bw = (0.0, 0.0, 0.0), x, 0.0
        for r in range(n + 1):
            runner = StageRunner(stage, loss_fn=loss_fn if s == last else None, recompute=r, input_grads=s > 0)
            batch = [*(x if s == 0 else ()), *([target] if s == last and isinstance(target, torch.Tensor) else [])]
            runner.meter.start(outside=batch)  # the batch's inputs and targets: the runtime does not count them
            runner.meter.hold(x, "recv")  # a later stage's input is a receive buffer, as in the runtime
            runs = []
            for k in range(repeats + 1):  # the first run is a warm-up, and the one whose bytes count
                count = functools.partial(_count_after_forward, runner, batch, kept) if k == 0 else None
                passes, out = run_passes(runner, k, x, target, scale=1.0 / microbatches, before_backward=count)
                runs.append(passes)
                if k == 0:
                    total.append(runner.meter.peak)
                    held_w.append(runner.memory_w)
            # Once more with a fused backward, whose peak a BW schedule meets instead.
            out = runner.forward(repeats + 1, x, target if s == last else None, scale=1.0 / microbatches)
            grads = None if s == last else ones_for(out)
            runner.meter.start(outside=batch)
            runner.meter.hold(grads or (), "recv")
            runner.backward(repeats + 1, grads)
            fused.append(runner.meter.peak)
            f, b, w = medians(runs[1:])
            backward.append(b + w)
            if r == 0:
                times, h = (f, b, w), out
                bw = medians([run_passes(runner, repeats + 2 + k, x, target, scale=1.0 / microbatches, fused=True)[0]
                              for k in range(repeats + 1)][1:])[1]
        stage.zero_grad(set_to_none=True)
        # What the backward spends on rebuilding: its time beyond the backward that keeps everything.
        # More recomputed layers never cost less, so noise is evened out upwards.
        rerun = tuple(itertools.accumulate((max(0.0, t - backward[0]) for t in backward), max))
        static = int(_param_bytes(stage) * (2 + optimizer_factor))  # weights, gradients, optimizer state
        message = 0 if s == last else _output_bytes(h)
        profiles.append(StageProfile(n, tuple(kept), tuple(total), tuple(held_w), rerun, times, static, message,
                                     tuple(fused), fused_time=bw))
        x = h
    return profiles


def _count_after_forward(runner: StageRunner, batch: list[Any], kept: list[int], grads: Values | None) -> None:
    """Between the first F and B of a stage: what F kept, and the meter counting again from the gradients that
    arrive (a receive buffer in the runtime)."""
    kept.append(runner.memory_f)
    runner.meter.start(outside=batch)
    runner.meter.hold(grads or (), "recv")


# --------------------------------------------------------------------------- the link


@contextlib.contextmanager
def _measuring_rank(rank: int, init: str, ranks: int, timeout_s: float = 120.0) -> Iterator[None]:
    """One of a measurement's ``ranks`` local processes, set up as a run's rank is (one thread, freed host memory
    kept) in a gloo group on this machine, left when the block ends."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    keep_freed_pages()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ping(rank: int, init: str, ranks: int, sizes: Sequence[int], rounds: int, p2p: str, out: Any,
          work: tuple[dict[str, Any], tuple[int, int]] | None = None) -> None:
    """One end of the ping-pong (``ranks`` is 2), over ``p2p`` ('sockets' or 'gloo'); with ``work``, this process
    also computes that layer in another thread meanwhile, as a rank computes while its messages travel."""
    import threading

    import torch.distributed as dist

    with _measuring_rank(rank, init, 2, timeout_s=60.0):
        stop = threading.Event()
        busy = None
        if work is not None:
            once = _layer_loop(*work)

            def compute() -> None:
                k = 0
                while not stop.is_set():
                    once(k)
                    k += 1

            busy = threading.Thread(target=compute, daemon=True)
            busy.start()
        try:
            # The runtime's own choice of transport (comm.post_message): the sockets while they are linked.
            with sockets.linked() if p2p == "sockets" else contextlib.nullcontext():
                result = {}
                for size in sizes:
                    buf = torch.zeros(size // 4, dtype=torch.float32)
                    trips = []
                    for k in range(rounds + 2):
                        t0 = time.perf_counter()
                        for sender in (0, 1):
                            post_message("send" if rank == sender else "recv", buf, 1 - rank, 0).wait()
                        if k >= 2:  # two warm-ups: connection setup and first allocations
                            trips.append(time.perf_counter() - t0)
                    result[size] = statistics.fmean(trips) / 2  # the mean: a transfer that waits for a core counts
                stop.set()
                if busy is not None:
                    busy.join()
                if rank == 0:
                    out.send(result)
                dist.barrier()
        finally:
            stop.set()


def measure_link(rounds: int = 20, sizes: Sequence[int] = _LINK_SIZES,
                 load: tuple[dict[str, Any], tuple[int, int], int] | None = None,
                 p2p: str = "sockets") -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) of a link between two local processes, over ``p2p``: 'sockets' (what
    a run on this machine sends over, :mod:`pipefold.runtime.sockets`) or 'gloo'. Half the mean round trip of
    each size, fitted by least squares to latency + bytes / bandwidth.

    With ``load = (train, (first, end), n)`` the two ends compute those layers of the model in another thread meanwhile,
    and n more processes run it too, as the ranks of a run do: where ranks share cores, a message then waits
    for a core (for gloo's threads at both ends, for the receiver to wake up), and that wait is part of what a
    transfer costs.
    """
    work = None if load is None else (load[0], load[1])
    one_way = _measured_under(load, _ping, (tuple(sizes), rounds, p2p), work, 2)
    return fit_link(one_way)


_REDUCE_PIECES = 4
"""How many tensors each size is split into: a stage's gradients are several, copied into one buffer."""


def _mean_seconds(call: Callable[[], object], rounds: int) -> float:
    """The mean seconds of ``rounds`` calls of ``call`` in a row, after two warm-ups (connections and first
    allocations): a collective's cost as a run pays it, every call counted."""
    for _ in range(2):
        call()
    t0 = time.perf_counter()
    for _ in range(rounds):
        call()
    return (time.perf_counter() - t0) / rounds


def _all_reduced(grads: list[torch.Tensor], group: Any, scale: float) -> None:
    FlatAllReduce(grads, group, scale=scale).wait()


def _reduce(rank: int, init: str, ranks: int, sizes: Sequence[int], rounds: int, out: Any, work: Any) -> None:
    """One of ``ranks`` processes all-reducing gradients of each size ``rounds`` times in a row, as the runtime's
    DP action does (:class:`~pipefold.runtime.comm.FlatAllReduce`: scaled to the mean on their way into one
    buffer, then reduced; its host memory kept, as a rank's is); rank 0 sends the mean seconds of one all-reduce
    per size on ``out``. (``work`` is unused: the ranks of a run wait in a gradients' all-reduce at the end of
    their step rather than compute.)"""
    import torch.distributed as dist

    with _measuring_rank(rank, init, ranks):
        world = dist.group.WORLD
        assert world is not None  # made just above
        result = {}
        for size in sizes:
            # Each piece a tensor of its own, as parameters' gradients are.
            grads = [piece.clone() for piece in torch.zeros(size // 4, dtype=torch.float32).chunk(_REDUCE_PIECES)]
            result[size] = _mean_seconds(functools.partial(_all_reduced, grads, world, 1.0 / ranks), rounds)
        if rank == 0:
            out.send(result)
        dist.barrier()


MATMUL_DTYPES = ("bf16", "fp16", "tf32", "fp32")
"""The dtypes :func:`measure_matmuls` times (tf32: float32 tensors, the tensor cores' TF32 allowed)."""


def measure_matmuls(dtype: str, device: torch.device, *, smallest: float = 1e8, largest: float = 1e12,
                    budget: float = 1.0, repeats: int = 5,
                    progress: Progress | None = None) -> list[tuple[float, float]]:
    """(operations, seconds) of one square matrix product of ``dtype`` on ``device`` at sizes from ``smallest`` to
    ``largest`` operations, two sizes a decade: each the median of ``repeats`` timings of a loop of products long
    enough to hide a launch (20 ms), after a warm-up. A size whose product the last rate says would take more
    than ``budget`` seconds is not measured (a CPU does not reach the largest in useful time)."""
    if dtype not in MATMUL_DTYPES:
        raise ConfigError(f"calibration times {', '.join(MATMUL_DTYPES)} products (got {dtype!r})")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    steps = max(0, round(2 * math.log10(largest / smallest)))
    targets = [smallest * (largest / smallest) ** (i / steps) for i in range(steps + 1)] if steps else [smallest]
    # Each size a square of side a multiple of 64 (what the libraries' kernels tile), every side once.
    sides = list(dict.fromkeys(max(64, round((t / 2) ** (1 / 3) / 64) * 64) for t in targets))
    cuda = device.type == "cuda"
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"

    def synced() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    out: list[tuple[float, float]] = []
    try:
        for i, n in enumerate(sides):
            flops = 2.0 * n ** 3
            if out and flops / (out[-1][0] / out[-1][1]) > budget:
                break
            a = torch.randn(n, n, device=device).to(torch_dtype)
            b = torch.randn(n, n, device=device).to(torch_dtype)
            c = a @ b  # the warm-up: the library picks its kernel
            start = synced()
            c = a @ b
            once = max(synced() - start, 1e-7)
            loop = max(1, math.ceil(0.02 / once))
            times = []
            for _ in range(repeats):
                start = synced()
                for _ in range(loop):
                    torch.mm(a, b, out=c)
                times.append((synced() - start) / loop)
            out.append((flops, statistics.median(times)))
            del a, b, c
            if progress is not None:
                progress("products", i + 1, len(sides))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    return out


def measure_allreduce(ranks: int, rounds: int = 5, sizes: Sequence[int] = _REDUCE_SIZES,
                      load: tuple[dict[str, Any], tuple[int, int], int] | None = None) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) of gloo's all-reduce among ``ranks`` local processes, what the
    gradients' all-reduce among data-parallel copies costs, copying them into its buffer included (the runtime's
    own :class:`~pipefold.runtime.comm.FlatAllReduce`): the mean time of one all-reduce of each size, fitted
    by least squares to latency + bytes / bandwidth (bandwidth in bytes of the buffer, not of the wire: the
    algorithm's own steps are inside it). With ``load``, n more processes compute meanwhile, as in
    :func:`measure_link`."""
    return fit_link(_measured_under(load, _reduce, (tuple(sizes), rounds), None, ranks))


_ZERO1_TENSORS = 32
"""How many tensors :func:`_zero1` shares at each size: as many as a stage has (a GPT block has 12), each copied
into and out of the broadcast's buffer as the runtime copies them."""


def _zero1(rank: int, init: str, ranks: int, sizes: Sequence[int], rounds: int, out: Any, work: Any) -> None:
    """One of ``ranks`` processes sharing stepped parameters as ZeRO-1 does after each step
    (:meth:`pipefold.runtime.zero.ShardedOptimizer.share`: each copy's stepped parameters broadcast from it in one
    flat buffer), for parameters of :data:`_ZERO1_TENSORS` tensors of each size in all, ``rounds`` times after two
    warm-ups (and the largest size's sharing once before any: a group's first collectives are slow to start);
    rank 0 sends the mean seconds of one sharing per size on ``out``."""
    import torch.distributed as dist

    from pipefold.runtime.zero import ShardedOptimizer

    with _measuring_rank(rank, init, ranks):
        result = {}
        for size in (max(sizes), *sizes):
            params = [nn.Parameter(piece.clone()) for piece in torch.zeros(size // 4).chunk(_ZERO1_TENSORS)]
            sharing = ShardedOptimizer(params, lambda mine: torch.optim.SGD(mine, lr=0.0), dist.group.WORLD)
            result[size] = _mean_seconds(sharing.share, rounds)
        if rank == 0:
            out.send(result)
        dist.barrier()


def measure_zero1(ranks: int, rounds: int = 10, sizes: Sequence[int] = _REDUCE_SIZES,
                  load: tuple[dict[str, Any], tuple[int, int], int] | None = None) -> tuple[float, float]:
    """ZeRO-1's sharing of the stepped parameters among ``ranks`` local processes as the runtime runs it
    (:func:`_zero1`): (latency seconds, bandwidth in bytes of the device's parameters per second), fitted over the
    sizes to latency + bytes / bandwidth. What a step with ZeRO-1 pays after its schedule: a broadcast from
    each copy of its share, copied into and out of a buffer, which half a measured all-reduce leaves out. With
    ``load``, n more processes compute meanwhile, as in :func:`measure_link`."""
    return fit_link(_measured_under(load, _zero1, (tuple(sizes), rounds), None, ranks))


def _fsdp(rank: int, init: str, ranks: int, sizes: Sequence[int], rounds: int, out: Any, work: Any) -> None:
    """One of ``ranks`` processes running FSDP's gather and reduce-scatter of a stage as the runtime's ``AG`` and
    ``RS`` do (:mod:`pipefold.runtime.sharding`: torch's ``fully_shard``, one unit per layer), on stages of
    :data:`_REDUCE_PIECES` bias-free Linears whose whole parameters are each size, ``rounds`` times after two
    warm-ups; before each ``RS`` a one-row forward and backward leaves gradients on the gathered parameters, as a
    stage's backward does (untimed). Rank 0 sends the mean seconds of one ``AG`` and one ``RS`` per size on
    ``out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold.runtime import sharding

    with _measuring_rank(rank, init, ranks):
        mesh = init_device_mesh("cpu", (ranks,))
        result = {}
        for size in sizes:
            width = max(ranks, round(math.sqrt(size / 4 / _REDUCE_PIECES)))
            linears = sharding.shard(Chain(*(nn.Linear(width, width, bias=False) for _ in range(_REDUCE_PIECES))),
                                     mesh)
            x = torch.ones(1, width)
            gathers, scatters = [], []
            for r in range(rounds + 2):
                linears(x).sum().backward()
                t0 = time.perf_counter()
                sharding.reduce_scatter(linears)
                t1 = time.perf_counter()
                sharding.gather(linears).wait()
                t2 = time.perf_counter()
                if r >= 2:
                    scatters.append(t1 - t0)
                    gathers.append(t2 - t1)
            result[_REDUCE_PIECES * width * width * 4] = (statistics.mean(gathers), statistics.mean(scatters))
        if rank == 0:
            out.send(result)
        dist.barrier()


def _fsdp_hooks(rank: int, init: str, ranks: int, train: dict[str, Any], one: tuple[int, int],
                more: tuple[int, int], rounds: int, optimizer: str, out: Any, work: Any) -> None:
    """The one process of :func:`measure_fsdp_hooks`: FSDP over a group of one, alone on the machine."""
    from torch.distributed.device_mesh import init_device_mesh

    with _measuring_rank(rank, init, ranks):
        mesh = init_device_mesh("cpu", (ranks,))
        stages = {layers: _stage_of(train, layers) for layers in dict.fromkeys((one, more))}  # each built once
        passes = _fsdp_passes(mesh, rounds, stages, one, more)
        out.send((passes, _fsdp_update(mesh, rounds, optimizer, stages[more][0])))


def _fsdp_update(mesh: Any, rounds: int, optimizer: str, stage: nn.Module) -> float:
    """Seconds more per tensor that the update after the schedule (:func:`_timed_update`, ``optimizer``'s) takes
    on FSDP's shards (DTensors: each operation goes through DTensor's dispatch) than on plain tensors of the same
    local size: the model's layers ``stage`` sharded (in place) as the runtime shards them, their shards against
    plain copies of their local parts, ``2 * rounds`` updates of each. Floored at 0."""
    from pipefold.runtime import sharding

    stage = sharding.shard(stage, mesh)
    shards = sharding.sharded_parameters(stage)
    plain = [nn.Parameter(sharding.local(p.detach()).clone()) for p in shards]
    extra = _timed_update(shards, optimizer, 2 * rounds) - _timed_update(plain, optimizer, 2 * rounds)
    return max(0.0, extra / len(shards))


def _fsdp_passes(mesh: Any, rounds: int, built: dict[tuple[int, int], tuple[Chain, Values]], one: tuple[int, int],
                 more: tuple[int, int]) -> tuple[tuple[float, float], ...]:
    """What FSDP's hooks add to a sharded stage's passes: for F, B, W and fused BW, (seconds once per pass, seconds
    per FSDP unit). The model's own layers ``one`` and ``more`` (two stages of a unit per layer with parameters,
    as :func:`pipefold.runtime.sharding.shard` makes them; ``more`` of more units; ``built``: each stage and its
    input, :func:`_stage_of`, left unsharded) each run on the runtime's runner, a copy sharded and gathered, and
    unsharded beside it; each pass's difference of medians over
    ``6 * rounds`` runs at the two stages is fitted to a line. The hooks' Python work grows with what a unit
    holds (a GPT block's hooks take about twice a tiny Linear's), so the model's layers, not stand-ins, are
    timed. Where ``more`` holds no more units than ``one``, it alone is timed and all of it counts per unit.
    Floored at 0."""
    from pipefold.runtime import sharding

    def units(stage: Chain) -> int:
        return sum(1 for layer in stage.children() if any(p.requires_grad for p in layer.parameters()))

    timed = [more] if units(built[more][0]) <= units(built[one][0]) else [one, more]
    stages = {layers: built[layers] for layers in timed}
    points = []
    for layers, (plain, xs) in stages.items():
        runners = (StageRunner(plain, input_grads=layers[0] > 0),
                   StageRunner(sharding.shard(copy.deepcopy(plain), mesh), input_grads=layers[0] > 0))
        runs: tuple[list[tuple[float, ...]], list[tuple[float, ...]]] = ([], [])
        for k in range(6 * rounds + 1):
            for runner, times in zip(runners, runs, strict=True):  # side by side: the machine's drift is shared
                split = run_passes(runner, 2 * k, xs)[0]
                times.append((*split, run_passes(runner, 2 * k + 1, xs, fused=True)[0][1]))
        points.append((max(1, units(plain)), [s - p for p, s in zip(medians(runs[0][1:]), medians(runs[1][1:]),
                                                              strict=True)]))
    if len(points) == 1:
        count, over = points[0]
        return tuple((0.0, max(0.0, d) / count) for d in over)
    (u0, at0), (u1, at1) = points
    out = []
    for a, b in zip(at0, at1, strict=True):
        per_unit = max(0.0, (b - a) / (u1 - u0))
        out.append((max(0.0, a - per_unit * u0), per_unit))
    return tuple(out)


def measure_fsdp(ranks: int, rounds: int = 5, sizes: Sequence[int] = _REDUCE_SIZES,
                 load: tuple[dict[str, Any], tuple[int, int], int] | None = None,
                 ) -> tuple[tuple[float, float], tuple[float, float]]:
    """FSDP among ``ranks`` local processes as the runtime runs it (:func:`_fsdp`): its gather and its
    reduce-scatter, each as (latency seconds per FSDP unit, bandwidth in bytes of the whole parameters per
    second), fitted over the sizes to units x latency + bytes / bandwidth. What a stage sharded over
    data-parallel copies pays in its ``AG`` and ``RS`` (torch's ``fully_shard`` copies the parameters out of the
    gathered buffer and the gradients into the reduce-scatter's, which half a measured all-reduce leaves out).
    With ``load``, n more processes compute meanwhile, as in :func:`measure_link`."""
    timed = _measured_under(load, _fsdp, (tuple(sizes), rounds), None, ranks)
    fits = []
    for which in (0, 1):
        latency, bandwidth = fit_link({size: times[which] for size, times in timed.items()})
        fits.append((latency / _REDUCE_PIECES, bandwidth))
    return fits[0], fits[1]


def measure_fsdp_hooks(train: dict[str, Any], one: tuple[int, int], more: tuple[int, int], rounds: int = 5,
                       optimizer: str = "adamw") -> tuple[tuple[tuple[float, float], ...], float]:
    """What FSDP adds to a sharded stage's F, B, W and BW (:func:`_fsdp_passes`: (seconds once per pass, seconds
    per FSDP unit) each) and to its update with ``optimizer``, per tensor (:func:`_fsdp_update`), on the
    model of a profile's ``train`` section: its layers ``one`` and ``more`` (``more`` of more units). Timed in
    one process alone, over a group of one: like the layers' own times, the ranks' sharing of the cores
    (``Profile.contention``) comes on top in the plan, not in the figures (timed beside other processes, the
    difference of two timings grows with their sharing, counted twice)."""
    return _measured_under(None, _fsdp_hooks, (train, one, more, rounds, optimizer), None, 1)


def _measured_under(load: tuple[dict[str, Any], tuple[int, int], int] | None, target: Callable[..., None],
                    args: tuple[Any, ...], work: Any, nprocs: int) -> Any:
    """Start ``nprocs`` processes running ``target(rank, init, nprocs, *args, out, work)`` (with ``load``'s
    helpers computing meanwhile) and return what rank 0 sends on ``out``.

    Pipes connect them, not queues, events or barriers: those hold named semaphores, which a command killed with
    ``kill -9`` would leave to multiprocessing's resource tracker to remove, with a warning. The helpers compute
    until their ``stop`` pipe closes: when this process closes it, or when it is gone."""
    import torch.multiprocessing as mp

    ctx = process_context()
    results, out = ctx.Pipe(duplex=False)
    stopping, stop = ctx.Pipe(duplex=False)
    helpers: list[Any] = []
    workers: list[Any] = []
    with rendezvous() as init, stopped_on_error(helpers), stopped_on_error(workers):
        try:
            if load is not None and load[2] > 0:
                train, layer, n = load
                ready = [ctx.Pipe(duplex=False) for _ in range(n)]
                helpers += [ctx.Process(target=_load, args=(train, layer, said, stopping)) for _, said in ready]
                with starting():
                    for h in helpers:
                        h.start()
                for (hear, said), h in zip(ready, helpers, strict=True):
                    said.close()
                    try:
                        hear.recv()  # built its layers and computing: the load is on
                    except EOFError:
                        h.join()
                        raise RuntimeError(f"a process loading the machine ended (exit code {h.exitcode})") from None
            with starting():
                procs = mp.start_processes(target, args=(init, nprocs, *args, out, work),
                                           nprocs=nprocs, start_method=ctx.get_start_method(), join=False)
                workers += procs.processes
            out.close()  # the workers': rank 0's result, or the end of the pipe when none sent one
            while not procs.join():
                pass
            result = results.recv()
        finally:
            stop.close()
            for h in helpers:
                h.join()
    return result


# --------------------------------------------------------------------------- sharing the machine


def _model(train: dict[str, Any]) -> Model:
    """The model a profile's ``train`` section names, at its size."""
    return make_model(train["model"], layers=train.get("layers"), hidden=train.get("hidden"),
                      heads=train.get("heads"), seq=train["seq"], batch=train["batch"], seed=train["seed"],
                      config=train.get("model_config"))


def _stage_of(train: dict[str, Any], layers: tuple[int, int]) -> tuple[Chain, Values]:
    """Layers ``layers[0]..layers[1]-1`` of the model (a stage's worth) and their input, one microbatch: the
    layers before them run once on the first."""
    model = _model(train)
    first, end = layers
    built = model.build_layers(range(end))
    with torch.no_grad():
        xs = split_batch(model.batch_at(0)[0], train["microbatches"])[0]
        for i in range(first):
            y = Chain(built[i])(*xs)
            xs = y if isinstance(y, tuple) else (y,)
    return Chain(*(built[i] for i in range(first, end))), xs


def _layer_loop(train: dict[str, Any], layers: tuple[int, int]) -> Callable[[int], None]:
    """A function running layers ``layers[0]..layers[1]-1`` of the model (a stage's worth) forward and backward on
    one microbatch (one thread)."""

    torch.set_num_threads(1)
    stage, xs = _stage_of(train, layers)
    runner = StageRunner(stage, input_grads=layers[0] > 0)

    def once(k: int) -> None:
        outs = runner.forward(k, xs)
        runner.backward(k, ones_for(outs))

    for k in range(2):  # warm-up
        once(k)
    return once


def _sharer(train: dict[str, Any], layers: tuple[int, int], conn: Any) -> None:
    """One of the processes sharing the machine: build the layers once, then for each window it is sent (a start on
    the monotonic clock every process reads, and a length), run them from that start for that long and send back
    the time per pass over the window. None ends it, and so does the end of the pipe (the command is gone)."""
    once = _layer_loop(train, layers)
    with contextlib.suppress(EOFError, ConnectionError):  # the command is gone: nothing to measure for
        conn.send("ready")
        while (window := conn.recv()) is not None:
            start, seconds = window
            time.sleep(max(0.0, start - time.monotonic()))
            t0 = time.monotonic()
            laps = 0
            while time.monotonic() - t0 < seconds:  # every process runs the same window, all of it shared
                once(laps)
                laps += 1
            conn.send((time.monotonic() - t0) / laps)


def _load(train: dict[str, Any], layers: tuple[int, int], ready: Any, stop: Any) -> None:
    """Background work while the link is measured: the layers, again and again, once it has said so on ``ready``,
    until ``stop`` closes (the command closes it, or is gone)."""
    once = _layer_loop(train, layers)
    with contextlib.suppress(ConnectionError):  # the command is gone: stop has closed too
        ready.send(True)
    k = 0
    while not stop.poll():
        once(k)
        k += 1


def measure_contention(devices: int, train: dict[str, Any], layers: tuple[int, int], seconds: float = 1.0,
                       rounds: int = 3, laps: int = 40) -> tuple[float, ...]:
    """For k = 1..devices: the time of a stage's worth of layers (forward and backward) while k processes run it at
    once, over the time with one (one thread each, as the runtime's ranks); the median over ``rounds`` rounds of
    k = 1..devices.

    Each process runs the same window and its throughput over the window counts, not single passes: the
    operating system shares cores in slices of milliseconds, so a single pass often runs alone and only the
    throughput shows the sharing. A window is ``laps`` passes of one process alone (at least 0.2 s, at most
    ``seconds``): hundreds of the scheduler's slices. The ``devices`` processes are started once and build the
    layers once; those not in a window wait without computing.
    """
    from multiprocessing.connection import Connection, wait


    ctx = process_context()  # as the runtime starts its ranks: from a fork server that has imported torch
    pipes = [ctx.Pipe() for _ in range(devices)]
    procs = [ctx.Process(target=_sharer, args=(train, layers, child)) for _, child in pipes]
    conns = [parent for parent, _ in pipes]

    def answers(ask: list[Connection]) -> list[Any]:
        """One answer from each of ``ask``; a process that ended instead is an error, not a wait forever."""
        got: dict[Connection, Any] = {}
        sentinels = {p.sentinel: p for p in procs}
        while len(got) < len(ask):
            for ready in wait([c for c in ask if c not in got] + list(sentinels)):
                if ready in sentinels:
                    raise RuntimeError(f"a process measuring how ranks share the cores ended "
                                       f"(exit code {sentinels[ready].exitcode})")
                conn = next(c for c in ask if c is ready)
                got[conn] = conn.recv()
        return [got[c] for c in ask]

    def window(k: int, length: float) -> float:
        start = time.monotonic() + 0.02
        for c in conns[:k]:
            c.send((start, length))
        return statistics.fmean(answers(conns[:k]))

    with stopped_on_error(procs):
        with starting():
            for p in procs:
                p.start()
        answers(conns)
        alone = window(1, 0.2)
        length = min(seconds, max(0.2, laps * alone))
        ratios: list[list[float]] = [[] for _ in range(devices)]
        for _ in range(rounds):
            means = [window(k, length) for k in range(1, devices + 1)]
            for k in range(devices):
                ratios[k].append(means[k] / means[0])
        for c in conns:
            c.send(None)
        for p in procs:
            p.join()
    return tuple(max(1.0, statistics.median(r)) for r in ratios)


# --------------------------------------------------------------------------- layers split over tensor-parallel ranks


def _sharded(rank: int, init: str, ranks: int, tp: int, train: dict[str, Any], repeats: int, stage_layers: int,
             out: Any, work: Any = None) -> None:
    """One of ``ranks``: ``ranks / tp`` groups of ``tp`` measure the model's layers at once, each group
    splitting them as ``pipefold train --tp`` does (each layer through torch's ``parallelize_module`` by the
    model's plan); the layers' collectives keep a group's ranks in step. Rank 0 sends its figures on ``out``."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold.runtime.sharding import tensor_parallel

    with _measuring_rank(rank, init, ranks):
        mesh = init_device_mesh("cpu", (ranks // tp, tp), mesh_dim_names=("copy", "tp"))
        model = _model(train)
        layers = model.build()
        tensor_parallel(dict(enumerate(layers)), model.tp_plans(tp, bool(train.get("sequence_parallel"))),
                        mesh["tp"])
        m = int(train["microbatches"])
        x, y = model.batch_at(0)
        sample, target = split_batch(x, m)[0], y.chunk(m)[0]
        # The plan takes the fixed work per pass from the whole layers' profile: no stage is timed whole here.
        measured = measure_layers(layers, sample, target, model.loss, microbatches=m, repeats=repeats,
                                  stage_layers=stage_layers, optimizer=train.get("optimizer"), fixed=False).layers
        counts = _collectives(layers, sample, target, model.loss)
        if rank == 0:
            out.send([dataclasses.replace(row, collectives=n) for row, n in zip(measured, counts, strict=True)])


def _collectives(layers: Sequence[nn.Module], sample: Values, target: Any,
                 loss_fn: Callable[..., torch.Tensor]) -> list[int]:
    """The collectives each layer calls in one microbatch's forward and backward, counted by torch's own
    ``CommDebugMode`` as they are dispatched."""
    from torch.distributed.tensor.debug import CommDebugMode

    xs, out = as_tuple(sample), []
    for i, layer in enumerate(layers):
        leaves = as_leaves(xs)
        # Its module tracker hooks the layer's backward, which warns where no input needs a gradient (the tokens).
        with warnings.catch_warnings(), CommDebugMode() as comm:
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            y = Chain(layer)(*leaves)
            ys = as_tuple(y)
            if i == len(layers) - 1:
                loss_fn(ys[0], target).backward()
            else:
                torch.autograd.backward(list(ys), list(ones_for(ys)))
        out.append(comm.get_total_counts())
        layer.zero_grad(set_to_none=True)
        xs = tuple(t.detach() for t in ys)
    return out


def measure_sharded(train: dict[str, Any], tp: int, repeats: int = 7, copies: int = 1,
                    stage_layers: int = 1) -> list[LayerProfile]:
    """Each layer's figures (:func:`measure_layers`, ``stage_layers`` at a time) on one of ``tp`` local ranks that
    split it, as a stage of a ``--tp`` run holds it: its times with the collectives inside them, this rank's bytes
    held and parameters, and the collectives it calls (``LayerProfile.collectives``). ``copies`` groups of ``tp``
    ranks measure at once, as the ranks of a run share the machine (the group of rank 0 reports)."""
    _model(train).tp_plans(tp)  # --tp that does not fit the model: one line here, before any process starts
    result: list[LayerProfile] = _measured_under(None, _sharded, (tp, train, repeats, stage_layers), None,
                                                 copies * tp)
    return result


# --------------------------------------------------------------------------- the whole profile


def _stored(fit: tuple[float, float]) -> tuple[float, float]:
    """A (latency, bandwidth) fit as a profile file keeps it: an infinite bandwidth (the times did not grow with
    the bytes) as 1e30, which JSON can hold."""
    latency, bandwidth = fit
    return latency, bandwidth if math.isfinite(bandwidth) else 1e30


def profile_model(*, model: str = "gpt", layers: int | None = None, hidden: int | None = None,
                  heads: int | None = None, model_config: str | None = None, seq: int = 64,
                  batch: int = 16, microbatches: int = 8, optimizer: str = "adamw", seed: int = 0,
                  devices: int = 4, repeats: int = 7, link: bool = True, contention: bool = True,
                  tp: Sequence[int] = (1,), sharding: bool = True, dtype: str = "fp32", quick: bool = False,
                  sequence_parallel: bool = False, progress: Progress | None = None) -> Profile:
    """Measure ``model`` at this size on this machine (see the module's docstring).

    Without ``link`` the link is free (latency 0, infinite bandwidth); without ``contention``
    every rank has a device of its own (factor 1 for any k). ``layers``, ``hidden`` and ``heads`` None: the model's
    defaults; ``model_config``: a Hugging Face model's config. Each ``tp`` degree above 1 measures the layers
    again, split over that many local ranks (:func:`measure_sharded`). Without ``sharding`` the copies' sharing
    of their state (ZeRO-1's, FSDP's collectives and hooks) is not measured, only their all-reduce: a plan of one
    pipeline (``pipefold train --schedule auto``) has no copies to shard, and the profile takes about half the time.
    ``dtype`` ('bf16', 'fp16'): the layers' passes are measured under autocast to it, as ``pipefold train --dtype``
    runs them, so their activations, messages and times are that dtype's (recorded in the profile's ``train``, and
    so given to the runs planned from it). ``quick``: the measurements between processes run :data:`QUICK`'s rounds
    and windows instead of :data:`FULL`'s (recorded in the profile's ``machine``). ``sequence_parallel``: the
    layers split over tp ranks run sequence-parallel, as ``train --sequence-parallel`` runs them (recorded in
    ``train``, and so given to the runs planned from it).
    """
    from pipefold.runtime.precision import Precision

    effort = QUICK if quick else FULL
    precision = Precision(dtype)
    if batch % microbatches:
        raise ConfigError(f"a batch of {batch} does not split into {microbatches} microbatches; "
                          f"use a --batch that is a multiple of {microbatches}")
    if optimizer not in OPTIMIZER_STATE:
        raise ConfigError(f"unknown optimizer {optimizer!r}: use {' or '.join(OPTIMIZER_STATE)}")
    train = {"model": model, "layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "batch": batch,
             "microbatches": microbatches, "optimizer": optimizer, "seed": seed}
    if model_config is not None:
        train["model_config"] = model_config
    if precision.is_mixed:
        train["dtype"] = precision.dtype
    built = _model(train)
    sharded = sorted({int(t) for t in tp} - {1})
    if sequence_parallel:
        if not sharded:
            raise ConfigError("--sequence-parallel splits the tokens over tensor-parallel ranks: give --tp with a "
                              "degree above 1 (--tp 1,2), or drop it")
        train["sequence_parallel"] = True
    for t in sharded:
        built.tp_plans(t, sequence_parallel)  # a degree that does not fit the model: one line before measuring
    # The whole model here and, to measure how ranks share the cores, a stage's worth on each of the devices.
    check_model(built, microbatches=microbatches, ranks=devices if contention else 0, copies=2,
                what=f"profiling {model}")
    x, y = built.batch_at(0)
    every = built.build()
    # Timed as many at a time as a rank will hold (an even split over ``devices``): what the caches see in the run.
    with computing_in(precision.autocast):
        measured, fixed = measure_layers(every, split_batch(x, microbatches)[0], y.chunk(microbatches)[0],
                                         built.loss, microbatches=microbatches, repeats=repeats,
                                         stage_layers=layers_per_rank(len(every), devices), optimizer=optimizer,
                                         progress=progress)
    # A stage's worth of layers from the heaviest one (a transformer block, not the embedding) stands for a rank's
    # work: its weights and activations, not one layer's, are what the ranks' caches and memory bus share.
    heaviest = max(range(len(measured) - 1), key=lambda i: measured[i].f + measured[i].b + measured[i].w)
    chunk = (heaviest, min(len(measured) - 1, heaviest + max(1, len(measured) // devices)))
    # FSDP's hooks are timed on one layer from the heaviest and on the stage's worth (two at least, where the
    # model has them): a unit and more of the model's own.
    hooked = ((heaviest, heaviest + 1), (heaviest, max(chunk[1], min(len(measured) - 1, heaviest + 2))))
    factors: tuple[float, ...] = (1.0,) * devices
    if contention:
        if progress is not None:
            progress("sharing", 0, 1)
        factors = measure_contention(devices, train, chunk, seconds=effort.sharing_seconds,
                                     rounds=effort.sharing_rounds)
        if progress is not None:
            progress("sharing", 1, 1)
    tp_layers, tp_ranks = {}, {}
    for t in sharded:
        if progress is not None:
            progress(f"tp {t}", 0, 1)
        # As many ranks computing as the run will have (``devices`` of them, where contention is measured).
        copies = max(1, devices // t) if contention else 1
        tp_ranks[t] = copies * t
        tp_layers[t] = tuple(measure_sharded(train, t, repeats, copies,
                                             stage_layers=layers_per_rank(len(every), devices // t)))
        if progress is not None:
            progress(f"tp {t}", 1, 1)
    latency, bandwidth = 0.0, math.inf
    allreduce: dict[int, tuple[float, float]] = {}
    fsdp: dict[int, tuple[tuple[float, float], tuple[float, float]]] = {}
    fsdp_passes: tuple[tuple[float, float], ...] = ()
    fsdp_update = 0.0
    zero1: dict[int, tuple[float, float]] = {}  # ZeRO-1's sharing after the step, by group size
    if link:
        if progress is not None:
            progress("link", 0, 1)
        # Where ranks share cores, the other ranks compute while two of them talk.
        latency, bandwidth = measure_link(effort.link_rounds,
                                          load=(train, chunk, max(0, devices - 2)) if contention else None)
        if progress is not None:
            progress("link", 1, 1)
        # Every group size data-parallel copies may make, the rest of the ranks computing: their all-reduce, and
        # FSDP's gather and reduce-scatter.
        groups = [k for k in range(2, devices + 1) if devices % k == 0]
        for i, k in enumerate(groups):
            if progress is not None:
                progress("all-reduce", i, len(groups))
            load = (train, chunk, devices - k) if contention else None
            allreduce[k] = measure_allreduce(k, effort.reduce_rounds, load=load)
            if sharding:
                zero1[k] = measure_zero1(k, effort.zero1_rounds, load=load)
                fsdp[k] = measure_fsdp(k, effort.reduce_rounds, load=load)
        if progress is not None:
            progress("all-reduce", len(groups), len(groups))
        if groups and sharding:  # what FSDP's hooks and shards add to a sharded stage: each rank's own work
            if progress is not None:
                progress("FSDP hooks", 0, 1)
            fsdp_passes, fsdp_update = measure_fsdp_hooks(train, *hooked, effort.hook_rounds, optimizer=optimizer)
            if progress is not None:
                progress("FSDP hooks", 1, 1)
    machine = {"host": platform.node(), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
               "device": "cpu", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": repeats,
               **({"link": "sockets"} if link else {}),  # what the link was measured over: what runs here send over
               **({"quick": True} if quick else {})}
    return Profile(train=train, layers=tuple(measured), latency=latency,
                   bandwidth=_stored((latency, bandwidth))[1], contention=factors,
                   optimizer_factor=OPTIMIZER_STATE[optimizer], machine=machine, pass_fixed=fixed,
                   tp_layers=tp_layers, tp_ranks=tp_ranks,
                   allreduce={k: _stored(fit) for k, fit in allreduce.items()},
                   fsdp={k: (_stored(gather), _stored(scatter)) for k, (gather, scatter) in fsdp.items()},
                   fsdp_passes=fsdp_passes, fsdp_update=fsdp_update,
                   zero1={k: _stored(fit) for k, fit in zero1.items()},
                   tied=tuple(tuple(sorted({i for i, _ in tie})) for tie in built.tied))

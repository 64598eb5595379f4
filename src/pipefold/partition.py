"""Automatic partitioning: measure what each layer costs, then split the layers into balanced contiguous stages.

The split is optimal, not a heuristic: it minimises the largest part cost (or, given a placement of
stages on devices, the largest device load, the sum of that device's chunks)::

    costs  3 1 1 2 2 1 4            parts [0..1] [2..4] [5..6]
    split  [3 1] [1 2 2] [1 4]      cost  4      5      5       bottleneck 5
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipefold.errors import ConfigError
from pipefold.ir import v_placement
from pipefold.runtime.stage import as_leaves, as_tuple

__all__ = ["COST_KINDS", "Partition", "layer_costs", "model_sample", "partition"]

COST_KINDS = ("params", "time", "memory")
"""What a layer's cost can measure."""

_EPS = 1e-12


@dataclass(frozen=True)
class Partition:
    """A contiguous split of layers into parts (stages or chunks) and what each part and device costs."""

    boundaries: list[int]
    """First layer index of each part; starts at 0."""
    parts: list[list[int]]
    """Layer indices of each part: contiguous, covering every layer once."""
    cost: list[float]
    """Summed layer cost of each part."""
    device_cost: list[float]
    """Summed cost of each device's parts under the placement; equal to ``cost`` without one."""
    bottleneck: float
    """The largest device cost: what the split minimises."""
    placement: tuple[int, ...] | None = None
    """Device of each part, when one was given."""


# --------------------------------------------------------------------------- measuring


def layer_costs(layers: Sequence[nn.Module], sample: torch.Tensor | tuple[torch.Tensor, ...], *, by: str,
                repeats: int = 5, optimizer_factor: float = 2.0) -> list[float]:
    """Cost of each layer: ``params`` (parameter count), ``time`` (forward+backward seconds) or ``memory`` (bytes).

    ``time`` and ``memory`` run the layers in order on ``sample`` (one microbatch: a tensor, or a
    tuple for a first layer with several inputs), each fed the previous layer's output (spread
    when it is a tuple, as from the segments of :func:`pipefold.cut.cut_model`). ``memory`` is
    the activation bytes saved for backward (the layer's own weights excluded) plus the parameter
    bytes times 1 + ``optimizer_factor`` (weights, gradients and optimizer state; AdamW's two
    moments make 2 the default).
    """
    if by not in COST_KINDS:
        raise ConfigError(f"unknown cost {by!r}: choose one of {', '.join(COST_KINDS)}")
    if by == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer (got {repeats!r})")
    measure = _time_layer if by == "time" else _memory_layer
    costs: list[float] = []
    x: Values = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
    for layer in layers:
        cost, out = measure(layer, x, repeats, optimizer_factor)
        costs.append(cost)
        x = tuple(t.detach() for t in out)
    return costs


Values = tuple[torch.Tensor, ...]
"""What flows between layers: one tensor, or several (a layer may return a tuple, spread into the next)."""


def _call(layer: nn.Module, x: Values) -> Values:
    """Run ``layer`` on fresh leaf copies of ``x``; floating inputs get a gradient so the backward includes it."""
    return as_tuple(layer(*as_leaves(x)))


def _forward_backward(layer: nn.Module, x: Values) -> Values:
    out = _call(layer, x)
    grads = [o for o in out if o.requires_grad]
    torch.autograd.backward(grads, [torch.ones_like(o) for o in grads])
    return out


def _time_layer(layer: nn.Module, x: Values, repeats: int, _: float) -> tuple[float, Values]:
    """Median forward+backward seconds over ``repeats`` runs after one warm-up."""
    out = _forward_backward(layer, x)  # warm-up: allocator and kernel caches
    times = []
    for _run in range(repeats):
        start = time.perf_counter()
        _forward_backward(layer, x)
        times.append(time.perf_counter() - start)
    layer.zero_grad(set_to_none=True)
    return statistics.median(times), out


def _memory_layer(layer: nn.Module, x: Values, _: int, optimizer_factor: float) -> tuple[float, Values]:
    """Bytes saved for backward (not the layer's weights) plus parameter bytes x (1 + optimizer_factor)."""
    params = list(layer.parameters())
    own = {p.data_ptr() for p in params}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        key = (t.data_ptr(), tuple(t.shape))
        if t.data_ptr() not in own and key not in seen:
            seen.add(key)
            saved += t.numel() * t.element_size()
        return t.detach()  # the graph is dropped unused: it must not hold itself through a saved output

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _call(layer, x)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return float(saved + param_bytes * (1 + optimizer_factor)), out


def model_sample(model: str, *, layers: int, hidden: int, heads: int, batch: int,
                 seq: int, seed: int = 0) -> tuple[list[nn.Module], torch.Tensor]:
    """The registered model as a flat layer list and one sample microbatch for it."""
    from pipefold.models import build_model, get_model, mlp_input

    spec = get_model(model)
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {value!r})")
    if spec.name == "gpt":
        flat = build_model("gpt", seed=seed, n_layer=layers, n_embd=hidden, n_head=heads, block_size=max(128, seq))
        gen = torch.Generator().manual_seed(seed)
        return flat, torch.randint(0, 256, (batch, seq), generator=gen)  # (B, T) token ids
    cfg = spec.make_config(hidden=hidden, layers=layers)
    return build_model("mlp", seed=seed, hidden=hidden, layers=layers), mlp_input(cfg, batch, seed)  # (B, H)


# --------------------------------------------------------------------------- splitting


def partition(costs: Sequence[float], parts: int, *, placement: Sequence[int] | None = None) -> Partition:
    """The contiguous split of ``costs`` into ``parts`` that minimises the largest part (or device) cost.

    With ``placement`` (the device of each part, ``len(placement) == parts``) the objective is the
    largest device load: e.g. under ``v_placement(p)`` device d holds parts d and 2p-1-d.
    """
    values = [float(c) for c in costs]
    n = len(values)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ConfigError(f"number of stages must be a positive integer (got {parts!r})")
    if parts > n:
        raise ConfigError(f"cannot split {n} layers into {parts} stages: at most {n}")
    if any(c < 0 or c != c for c in values):
        raise ConfigError("layer costs must be non-negative numbers")
    mapping = _check_placement(placement, parts)
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)
    if mapping is None or len(set(mapping)) == len(mapping):
        bounds = _minmax_dp(prefix, parts)  # one part per device: device loads are the part costs
    elif mapping == v_placement(parts // 2):
        bounds = _v_dp(prefix, parts // 2)
    else:
        bounds = _branch_and_bound(prefix, mapping)
    return _result(values, prefix, bounds, mapping)


def _check_placement(placement: Sequence[int] | None, parts: int) -> tuple[int, ...] | None:
    if placement is None:
        return None
    mapping = tuple(placement)
    if len(mapping) != parts:
        raise ConfigError(f"the placement lists {len(mapping)} devices but there are {parts} stages: "
                          "give one device per stage")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in mapping):
        raise ConfigError(f"placement devices must be non-negative integers (got {list(mapping)})")
    return mapping


def _result(values: list[float], prefix: list[float], bounds: list[int], mapping: tuple[int, ...] | None) -> Partition:
    ends = bounds[1:] + [len(values)]
    cost = [prefix[hi] - prefix[lo] for lo, hi in zip(bounds, ends, strict=True)]
    if mapping is None:
        device_cost = list(cost)
    else:
        device_cost = [0.0] * (max(mapping) + 1)
        for part, device in enumerate(mapping):
            device_cost[device] += cost[part]
    return Partition(boundaries=bounds, parts=[list(range(lo, hi)) for lo, hi in zip(bounds, ends, strict=True)],
                     cost=cost, device_cost=device_cost, bottleneck=max(device_cost), placement=mapping)


def _minmax_dp(prefix: list[float], parts: int) -> list[int]:
    """Boundaries minimising the largest part: best[k][j] = min over i of max(best[k-1][i], sum(i..j))."""
    n = len(prefix) - 1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j] - _EPS:
                    best[k][j], back[k][j] = value, i
    bounds, j = [], n
    for k in range(parts, 0, -1):
        j = back[k][j]
        bounds.append(j)
    return bounds[::-1]


def _v_dp(prefix: list[float], p: int) -> list[int]:
    """Exact split for the V placement, from the outside in.

    Device d holds chunks d and 2p-1-d, so choosing device 0's chunks, then device 1's, ... narrows
    a window (L, R) of layers still to place; the state after device d is that window::

        layers  |--chunk 0--|--chunk 1--| ...middle... |--chunk 2p-2--|--chunk 2p-1--|
                0           L                          R                              n
    """
    n = len(prefix) - 1
    pre = np.asarray(prefix)
    inf = np.inf
    # value[L, R]: the least largest load of devices 0..d that leaves layers L..R-1 for the rest.
    value = np.full((n + 1, n + 1), inf)
    value[0, n] = 0.0
    backs: list[np.ndarray] = []
    idx = np.arange(n + 1)
    for d in range(p):
        rest = 2 * p - 2 - 2 * d  # chunks left inside the window afterwards
        new = np.full((n + 1, n + 1), inf)
        back = np.zeros((n + 1, n + 1, 2), dtype=np.int64)
        for lo, hi in zip(*np.nonzero(np.isfinite(value)), strict=True):
            # new window (l2, r2): lo < l2, r2 < hi, r2 - l2 >= rest; the last device's two chunks meet (l2 == r2)
            load = (pre[:, None] - pre[lo]) + (pre[hi] - pre[None, :])  # [l2, r2]
            ok = (idx[:, None] > lo) & (idx[None, :] < hi)
            ok &= (idx[None, :] - idx[:, None] >= rest) if rest else (idx[None, :] == idx[:, None])
            cand = np.where(ok, np.maximum(value[lo, hi], load), inf)
            better = cand < new - _EPS
            new = np.where(better, cand, new)
            back[better] = (lo, hi)
        value = new
        backs.append(back)
    mid = int(np.argmin(np.diagonal(value)))
    windows = [(mid, mid)]  # windows[k]: the window left after device p-1-k
    for back in reversed(backs[1:]):
        lo, hi = windows[-1]
        windows.append((int(back[lo, hi, 0]), int(back[lo, hi, 1])))
    windows.reverse()  # windows[d] = (first layer of chunk d+1, first layer of chunk 2p-1-d)
    return [0] + [lo for lo, _ in windows] + [hi for _, hi in windows[-2::-1]]


def _branch_and_bound(prefix: list[float], mapping: tuple[int, ...]) -> list[int]:
    """Exact split for any placement: depth-first over boundaries, pruned by the best load found so far.

    Exponential in the worst case; quick for near-uniform costs (it stops once a split reaches the even
    share) and for a few chunks per device. The V placement has its own polynomial search.
    """
    n, parts = len(prefix) - 1, len(mapping)
    devices = max(mapping) + 1
    start = _minmax_dp(prefix, parts)  # a good first answer: the balanced split ignoring placement
    best_bounds = start
    best = max(_loads(prefix, start, mapping, devices))
    floor = prefix[n] / len(set(mapping))  # no split beats the even share of the busiest device
    loads = [0.0] * devices
    bounds = [0]

    def search(s: int, i: int) -> bool:
        nonlocal best, best_bounds
        if s == parts - 1:
            d = mapping[s]
            top = max(max(loads), loads[d] + prefix[n] - prefix[i])
            if top < best - _EPS:
                best, best_bounds = top, list(bounds)
            return best <= floor + _EPS
        d = mapping[s]
        for j in range(i + 1, n - (parts - s - 1) + 1):
            seg = prefix[j] - prefix[i]
            if loads[d] + seg >= best - _EPS:
                break
            later = set(mapping[s + 1:])  # devices that can still take layers
            room = sum(best - loads[e] - (seg if e == d else 0.0) for e in later)
            if room < prefix[n] - prefix[j] - _EPS:
                continue  # what is left cannot fit under the best load
            loads[d] += seg
            bounds.append(j)
            done = search(s + 1, j)
            bounds.pop()
            loads[d] -= seg
            if done:
                return True
        return False

    search(0, 0)
    return best_bounds


def _loads(prefix: list[float], bounds: list[int], mapping: tuple[int, ...], devices: int) -> list[float]:
    ends = bounds[1:] + [len(prefix) - 1]
    loads = [0.0] * devices
    for part, (lo, hi) in enumerate(zip(bounds, ends, strict=True)):
        loads[mapping[part]] += prefix[hi] - prefix[lo]
    return loads


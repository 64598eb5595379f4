"""How big a model is before it is built, and the limits that refuse a run this machine cannot finish.

A run is refused, with one line saying what it would need and which setting would fit, when

- its memory, counted before anything is allocated, is more than this machine has available: the
  processes' own memory (:data:`RANK_BYTES` each), the parameters as often as the run holds them
  (weights, gradients, optimizer state, the copy the launcher measures) and one microbatch's
  activations through the whole model (every schedule holds at least that);
- or one optimizer step would take more than :data:`MAX_STEP_FLOPS` floating-point operations
  (forward and backward of every layer, attention's T^2 included), which on a CPU is minutes per step:
  the run would look hung.

The parameter count is exact (it is checked against the model built on torch's meta device); the
activation bytes and the operation count are estimates (see :func:`activation_bytes` and
:func:`step_flops`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pipefold.errors import ConfigError
from pipefold.units import format_bytes

__all__ = ["CONTEXT_BYTES", "GPU_STEP_FLOPS", "MAX_STEP_FLOPS", "RANK_BYTES", "Shape", "activation_bytes",
           "available_memory", "boundary_bytes", "check_fits", "check_fits_gpu", "check_model", "parameters",
           "step_flops"]

MAX_STEP_FLOPS = 1e13
"""The most floating-point operations one step may take: about two minutes on one CPU core doing 85 GFLOP/s
(measured with a 1024 x 1024 matmul on the CI machine). pipefold's default GPT takes 1.7e9 per step."""

GPU_STEP_FLOPS = 1e16
"""The same limit for ranks on GPUs: about three minutes at 50 TFLOP/s (an H100's float32 without tensor cores)."""

CONTEXT_BYTES = 600 * 2**20
"""GPU memory a rank's process takes before its model: its CUDA context and the libraries' workspaces (about
500 MiB on an H100 with torch 2.11)."""

RANK_BYTES = 300 * 2**20
"""Memory of one rank's process before its model: the interpreter, torch and gloo (270 to 290 MiB measured)."""

VOCAB = 256
"""The GPT's vocabulary: byte-level."""

FLOAT_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A model's size as ``pipefold train`` takes it: ``batch`` rows (sequences for the GPT) per step."""

    model: str
    layers: int
    hidden: int
    heads: int = 4
    batch: int = 16
    seq: int = 64
    vocab: int = 256
    """The vocabulary (a transformer's logits per token)."""
    params: int | None = None
    """The exact parameter count where the model gives it (a Hugging Face model, counted on the meta device);
    None: from the GPT's or the MLP's formula."""


def parameters(shape: Shape) -> int:
    """The model's parameters, exactly: GPT (embedding with ``seq`` positions, blocks, head; biases on), or the
    MLP's blocks of H -> 4H -> H; a model that counted its own, that count."""
    if shape.params is not None:
        return shape.params
    c, n = shape.hidden, shape.layers
    if shape.model == "gpt":
        return n * (12 * c * c + 13 * c) + (VOCAB + shape.seq) * c + 2 * c + c * VOCAB
    return n * (8 * c * c + 5 * c)


def activation_bytes(shape: Shape, rows: int) -> float:
    """Bytes that ``rows`` rows keep between their forward and backward through the whole model (an estimate).

    Per token a GPT block saves about 18 C floats (its two LayerNorms' inputs and outputs, q, k, v, the
    attention's output, the MLP's 4C input and GELU output, the residuals) and the attention's per-head
    statistics (torch's fused attention keeps no T x T matrix); the head keeps the logits and their
    softmax. An MLP block keeps its input, the 4H pre-activation and the 4H GELU output.
    """
    c = shape.hidden
    if shape.model == "gpt":
        tokens = rows * shape.seq
        per_token = shape.layers * (18 * c + 2 * shape.heads) + c + 2 * c + 2 * shape.vocab
        return float(tokens) * per_token * FLOAT_BYTES
    return float(rows) * shape.layers * 9 * c * FLOAT_BYTES


def boundary_bytes(shape: Shape, rows: int, element_bytes: int = FLOAT_BYTES) -> int:
    """Bytes of the hidden state that ``rows`` rows pass from one stage to the next, ``element_bytes`` to a value:
    (rows, seq, hidden) for a language model, (rows, hidden) for the MLP. Every message between two stages carries
    at least this (a Hugging Face model's attention mask travels beside it), and its gradient as much back."""
    return rows * (shape.seq if shape.model == "gpt" else 1) * shape.hidden * element_bytes


def step_flops(shape: Shape, rows: int | None = None) -> float:
    """Floating-point operations of a forward and backward of ``rows`` rows (default: the batch): 6 per
    multiply-accumulate weight per token, and the GPT's attention, 12 T^2 C per sequence and block."""
    rows = shape.batch if rows is None else rows
    c = shape.hidden
    if shape.model == "gpt":
        tokens = float(rows) * shape.seq
        dense = shape.layers * 12 * c * c + c * shape.vocab
        return 6.0 * dense * tokens + 12.0 * shape.layers * rows * float(shape.seq) ** 2 * c
    return 6.0 * shape.layers * 8 * c * c * rows


def available_memory() -> int | None:
    """Bytes this process could still allocate: the kernel's MemAvailable, capped by the cgroup's limit; None
    where neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for path, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(path, encoding="ascii") as fh:
                limit = fh.read().strip()
            with open(used, encoding="ascii") as fh:
                current = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            found.append(max(0, int(limit) - current))
    return min(found) if found else None


@dataclass(frozen=True)
class _Need:
    ranks: int
    copies: float
    microbatches: int

    def memory(self, shape: Shape) -> float:
        rows = max(1, shape.batch // self.microbatches)
        return (self.ranks * RANK_BYTES + self.copies * parameters(shape) * FLOAT_BYTES
                + activation_bytes(shape, rows))


def check_fits(shape: Shape, *, microbatches: int = 1, ranks: int = 0, copies: float = 1.0,
               available: int | None = None, computed_on: str = "cpu", what: str = "the run") -> None:
    """Refuse, with one ConfigError, a run this machine cannot hold or would take minutes per step on.

    One step computes ``shape.batch`` rows; one microbatch of ``batch / microbatches`` rows is in flight;
    ``ranks`` processes of :data:`RANK_BYTES` start; the parameters are held ``copies`` times (weights,
    gradients and optimizer state across the ranks, plus a launcher's copy). ``available`` defaults to
    :func:`available_memory` (no memory check where it is unknown). ``computed_on``: where the step's products run
    with everything held in host memory (``"cuda"`` for layers offloaded to the host and run on a GPU), which sets
    the operation limit: :data:`MAX_STEP_FLOPS` on a CPU, :data:`GPU_STEP_FLOPS` on a GPU.
    """
    need = _Need(ranks, copies, microbatches)
    if available is None:
        available = available_memory()
    total = need.memory(shape)
    if available is not None and total > available:
        params = parameters(shape)
        parts = f"{params:,} parameters held {copies:g} times: {format_bytes(copies * params * FLOAT_BYTES)}"
        if ranks:
            parts += f"; {ranks} processes of about {format_bytes(RANK_BYTES)}"
        room = available
        fix = _fix(shape, lambda s: need.memory(s) <= room)
        if ranks and ranks * RANK_BYTES > available:
            fix = f": use at most {max(1, available // RANK_BYTES)} ranks"
        raise ConfigError(f"{what} would need at least {format_bytes(total)} of memory ({_describe(shape)}; {parts}; "
                          f"one microbatch's activations) but this machine has {format_bytes(available)} "
                          f"available{fix}")
    if computed_on.partition(":")[0] == "cuda":
        _check_flops(shape, GPU_STEP_FLOPS, "minutes per step on a GPU", what)
    else:
        _check_flops(shape, MAX_STEP_FLOPS, "minutes per step on a CPU core", what)


def _check_flops(shape: Shape, limit: float, why: str, what: str) -> None:
    """Refuse a step of more than ``limit`` floating-point operations, naming the setting that would fit."""
    flops = step_flops(shape)
    if flops > limit:
        fix = _fix(shape, lambda s: step_flops(s) <= limit)
        raise ConfigError(f"{what} would take about {flops:.1e} floating-point operations per step "
                          f"({_describe(shape)}), over pipefold's limit of {limit:.0e} ({why}){fix}")


def check_fits_gpu(shape: Shape, *, microbatches: int = 1, ranks: int = 1, gpus: int = 1, copies: float = 1.0,
                   gpu_bytes: int, what: str = "the run") -> None:
    """Refuse a run whose ranks cannot hold their part of the model on ``gpus`` GPUs of ``gpu_bytes`` each: per
    GPU, the CUDA contexts of the ranks that share it (:data:`CONTEXT_BYTES`), its share of the parameters held
    ``copies`` times and one microbatch's activations; or whose step is over :data:`GPU_STEP_FLOPS`."""
    gpus = max(1, gpus)
    per_gpu = -(-ranks // gpus)

    def need(s: Shape) -> float:
        rows = max(1, s.batch // microbatches)
        return per_gpu * CONTEXT_BYTES + copies * parameters(s) * FLOAT_BYTES / gpus + activation_bytes(s, rows)

    total = need(shape)
    if total > gpu_bytes:
        fix = _fix(shape, lambda s: need(s) <= gpu_bytes)
        if per_gpu * CONTEXT_BYTES > gpu_bytes:
            fix = f": use at most {max(1, gpus * (gpu_bytes // CONTEXT_BYTES))} ranks"
        raise ConfigError(f"{what} would need at least {format_bytes(total)} on each GPU ({_describe(shape)}; "
                          f"{ranks} ranks on {gpus} GPU{'s' if gpus > 1 else ''}; parameters held {copies:g} times; "
                          f"one microbatch's activations) but a GPU here has {format_bytes(gpu_bytes)}{fix}")
    _check_flops(shape, GPU_STEP_FLOPS, "minutes per step on a GPU", what)


def _describe(shape: Shape) -> str:
    if shape.model == "gpt":
        return (f"gpt with {shape.layers} blocks of width {shape.hidden}, batch {shape.batch} x sequence "
                f"{shape.seq}")
    return f"mlp with {shape.layers} blocks of width {shape.hidden}, batch {shape.batch}"


_DEFAULTS = {"hidden": 64, "layers": 4, "batch": 16, "seq": 64}
"""pipefold train's sizes: the setting furthest above its default is the one to shrink."""


def _fix(shape: Shape, fits: Callable[[Shape], bool]) -> str:
    """': use --seq 7430 or less': the setting furthest above its default, shrunk until the run fits."""
    best: tuple[float, str, int] | None = None
    knobs = ("hidden", "layers", "batch", "seq") if shape.model == "gpt" else ("hidden", "layers", "batch")
    for knob in knobs:
        value = getattr(shape, knob)
        most = largest(lambda v, k=knob: fits(replace(shape, **{k: v})), value)  # type: ignore[misc]
        if most is None or most >= value:
            continue
        if knob == "hidden" and shape.model == "gpt":
            most -= most % shape.heads  # the width must stay a multiple of the heads
            if most < shape.heads:
                continue
        above = value / _DEFAULTS[knob]
        if best is None or above > best[0]:
            best = (above, knob, most)
    return "" if best is None else f": use --{best[1]} {best[2]} or less"


def largest(fits: Callable[[int], bool], high: int) -> int | None:
    """The largest n in 1..``high`` for which ``fits(n)``, where ``fits`` holds up to some n and not beyond (a
    model's memory, a search's work, grows with each of its sizes); None where it holds for none. The planner's
    search limits (:mod:`pipefold.plan.limits`) use it too."""
    if high < 1 or not fits(1):
        return None
    low = 1  # fits(low); the answer is in low..high
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def check_model(model: Any, *, gpu: tuple[int, int] | None = None, measures: float = 0.0, **kwargs: Any) -> None:
    """:func:`check_fits` for a :class:`~pipefold.models.base.Model` that gives its size (``Model.size``); one that
    does not is not checked. ``measures``: copies of the model the launcher builds on the host to measure it, on
    top of ``copies``. With ``gpu`` (GPUs, bytes of each) the ranks run there: :func:`check_fits_gpu`, and the
    host holds only the processes and those copies."""
    shape = model.size()
    if shape is None:
        return
    if gpu is None:
        check_fits(shape, **{**kwargs, "copies": kwargs.get("copies", 1.0) + measures})
        return
    gpus, gpu_bytes = gpu
    check_fits_gpu(shape, gpus=gpus, gpu_bytes=gpu_bytes, **kwargs)
    available = available_memory()
    host = kwargs.get("ranks", 0) * RANK_BYTES + measures * parameters(shape) * FLOAT_BYTES
    if available is not None and host > available:
        raise ConfigError(f"{kwargs.get('what', 'the run')} would need at least {format_bytes(host)} of host memory "
                          f"(its processes, and the model built once to measure it) but this machine has "
                          f"{format_bytes(available)} available: use --partition even or fewer ranks")

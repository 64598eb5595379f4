"""The pass timer: one microbatch through F, B and W of a stage runner, each pass timed (on a GPU, to its end).

What the profile measures layers and stages with (:mod:`pipefold.runtime.measure.profiling`) and what K-FAC's
placement times its work beside (:mod:`pipefold.runtime.curvature`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from pipefold.runtime.stage import StageRunner, ones_for

__all__ = ["no_wait", "run_passes", "timed_backward", "timed_forward"]

Values = tuple[torch.Tensor, ...]


def run_passes(runner: StageRunner, k: int, x: Values, target: Any = None, *, scale: float = 1.0,
               forward: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
               before_backward: Callable[[Values | None], None] | None = None, fused: bool = False,
               ) -> tuple[tuple[float, float, float], Values]:
    """Microbatch ``k`` through F, B and W of ``runner``, each pass timed: ((f, b, w) seconds, F's outputs).
    ``fused``: the backward runs as one BW pass instead, timed in the place of B, and W is 0.

    A stage with a loss computes it against ``target`` and B starts from it; any other stage's B starts from
    gradients of ones. ``forward()`` is a context around F (K-FAC records its inputs there);
    ``before_backward(grads)`` runs untimed between F and B. Where the stage computes on a GPU, each pass is
    timed to its end (the device is synchronized), not to the moment it was queued.
    """
    f, out = timed_forward(runner, k, x, target, scale=scale, forward=forward)
    return (f, *timed_backward(runner, k, out, fused=fused, before_backward=before_backward)), out


def _synced(runner: StageRunner) -> Callable[[], None]:
    """What waits for the device ``runner`` computes on: nothing on the CPU."""
    return torch.cuda.synchronize if any(p.is_cuda for p in runner.params) else no_wait


def timed_forward(runner: StageRunner, k: int, x: Values, target: Any, *, scale: float,
                   forward: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                   ) -> tuple[float, Values]:
    sync = torch.cuda.synchronize if any(t.is_cuda for t in x) else _synced(runner)
    sync()
    t0 = time.perf_counter()
    with forward():
        out = runner.forward(k, x, target if runner.loss_fn is not None else None, scale=scale)
    sync()
    return time.perf_counter() - t0, out


def timed_backward(runner: StageRunner, k: int, out: Values, *, fused: bool = False,
                    before_backward: Callable[[Values | None], None] | None = None) -> tuple[float, float]:
    """(b, w) seconds of microbatch ``k``'s backward after :func:`timed_forward` gave ``out``; fused: (bw, 0)."""
    sync = torch.cuda.synchronize if any(t.is_cuda for t in out) else _synced(runner)
    grads = None if runner.loss_fn is not None else ones_for(out)
    if before_backward is not None:
        before_backward(grads)
    t0 = time.perf_counter()
    if fused:
        runner.backward(k, grads)
        sync()
        return time.perf_counter() - t0, 0.0
    runner.backward_input(k, grads)
    sync()
    b = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner.backward_weight(k)  # a first stage (integer input) runs its whole backward here: B has nothing to do
    sync()
    return b, time.perf_counter() - t0


def no_wait() -> None:
    pass

"""Non-finite losses and gradients: one global check per step, and Zero Bubble's optimizer post-validation.

After a step's passes each rank sums the squares of the gradients it counts in the global norm (a stage
held by several ranks counted once) and counts its NaN or inf losses; one all-reduce of those two numbers
gives every rank the global gradient norm and the number of bad losses, so that every rank decides alike.
A NaN or inf in any gradient makes the sum NaN or inf. A step whose sum or losses are not finite is *bad*:
it is skipped, the weights and the optimizer state left as they were before it.

**Post-validation** (Qi et al., *Zero Bubble Pipeline Parallelism*, section 4: bypassing optimizer
synchronizations): the optimizer does not wait for the all-reduce. It steps at once, speculatively, while
the check is in flight; when the check arrives and says the step was bad, or that the gradients needed
clipping, the step is rolled back (parameters and optimizer state restored from a copy made before it)
and then skipped, or redone with the clipped gradients. The result is the same, bit for bit, as checking
first. A schedule with ``OPT`` actions always works this way: its stages step inside the schedule, before
any global check could run.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from pipefold.runtime.precision import grad_holder
from pipefold.runtime.sharding import local
from pipefold.runtime.zero import AnyOptimizer, holding

__all__ = ["Snapshot", "clip_factor", "local_check", "scale_grads", "verdict"]


def local_check(counted: Iterable[nn.Parameter], losses: Iterable[float], device: torch.device) -> torch.Tensor:
    """This rank's [sum of squared gradients, number of non-finite losses, sum and number of the finite losses], to
    be summed over the ranks (every microbatch's loss is computed on exactly one rank)."""
    sq = torch.zeros(1, device=device, dtype=torch.float64)  # the losses summed exactly enough to report
    for p in counted:
        g = grad_holder(p).grad
        if g is not None:
            sq += local(g.detach()).pow(2).sum()  # a shard's part of the norm (FSDP)
    values = list(losses)
    finite = [v for v in values if math.isfinite(v)]
    rest = [float(len(values) - len(finite)), math.fsum(finite), float(len(finite))]
    return torch.cat([sq, torch.tensor(rest, device=device, dtype=sq.dtype)])


def verdict(summed: torch.Tensor) -> tuple[float, bool, float]:
    """(global gradient norm, whether the step is bad, the mean loss over every microbatch of every pipeline) from
    the all-reduced :func:`local_check` (the mean NaN when no loss was finite)."""
    sq, bad_losses, loss_sum, loss_count = (float(v) for v in summed.tolist())
    mean = loss_sum / loss_count if loss_count and not bad_losses else math.nan
    return math.sqrt(sq) if sq >= 0 else math.nan, not math.isfinite(sq) or bad_losses > 0, mean


def clip_factor(norm: float, clip: float | None) -> float | None:
    """The factor that scales the gradients to the norm ``clip``, or None when they need no clipping."""
    if clip is None or norm <= clip:
        return None
    return clip / (norm + 1e-6)


def scale_grads(params: Iterable[nn.Parameter], factor: float) -> None:
    for p in params:
        g = grad_holder(p).grad
        if g is not None:
            local(g).mul_(factor)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class Snapshot:
    """Copies of parameters, of optimizers' state and of other per-step state (K-FAC's), to roll a step back.

    ``work`` is anything with ``snapshot()`` and ``restore(copy)`` (:class:`~pipefold.runtime.curvature.
    RankCurvature`).
    """

    def __init__(self, params: Sequence[nn.Parameter], optimizers: Sequence[AnyOptimizer] = (),
                 work: Any = None) -> None:
        self.params = [(p, p.detach().clone()) for p in params]
        self.states = [(o, {p: {k: _clone(v) for k, v in st.items()} for p, st in o.state.items()})
                       for o in holding(optimizers)]
        self.work = work
        self.work_state = work.snapshot() if work is not None else None

    def restore(self) -> None:
        """Put everything back as it was when the snapshot was made (the parameters in place)."""
        with torch.no_grad():
            for param, saved in self.params:
                param.copy_(saved)
        for o, states in self.states:
            o.state.clear()
            for key, st in states.items():
                o.state[key] = st
        if self.work is not None:
            self.work.restore(self.work_state)

"""Mixture-of-experts stages in a pipeline: the load-balancing loss over the whole batch across data-parallel copies,
and the schedules it runs with (:mod:`pipefold.models.moe` says how the loss is computed microbatch by microbatch)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule
from pipefold.models.moe import MoE

__all__ = ["balanced_stages", "begin_balance_step", "check_balance_order", "sum_balance_over"]

_BACKWARDS = (Kind.B, Kind.BW)


def balanced_stages(modules: Mapping[int, nn.Module]) -> list[int]:
    """The stages among ``modules`` with a MoE whose load-balancing loss is on (a weight above 0)."""
    return sorted(s for s, m in modules.items()
                  if any(isinstance(x, MoE) and x.cfg.aux_loss > 0 for x in m.modules()))


def check_balance_order(schedule: Schedule, stages: Iterable[int]) -> None:
    """Refuse in one line a schedule that runs a backward of one of ``stages`` before that stage's last forward of
    the step: the load-balancing loss over the whole batch needs every microbatch's choices first."""
    for s in stages:
        if len(schedule.holders(s)) > 1:
            raise ConfigError(f"{schedule.name} holds stage {s} on {len(schedule.holders(s))} devices, each running "
                              "part of the batch, and the load-balancing loss over the whole batch needs every "
                              "microbatch's choices in one place: use a schedule without replicas, or a MoE with "
                              "aux_loss 0")
        row = schedule.actions[schedule.device_of(s)]
        passes = [a for act in row for a in act.passes if a.stage == s]
        last_f = max((i for i, a in enumerate(passes) if a.kind == Kind.F), default=-1)
        first_b = min((i for i, a in enumerate(passes) if a.kind in _BACKWARDS), default=len(passes))
        if first_b < last_f:
            raise ConfigError(f"{schedule.name} runs a backward of stage {s} before its last forward, and the "
                              "load-balancing loss over the whole batch needs every microbatch's choices first: use "
                              "gpipe or looped-bfs (a stage's forwards first), or a MoE with aux_loss 0")


def sum_balance_over(modules: Iterable[nn.Module], group: Any) -> int:
    """Have every MoE in ``modules`` sum its batch's expert counts over ``group`` (the data-parallel copies), so that
    each copy's load-balancing loss is the whole batch's; returns how many MoE layers it reached."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    found = 0
    for module in modules:
        for m in module.modules():
            if isinstance(m, MoE):
                m.balance.reduce = reduce
                found += 1
    return found


def begin_balance_step(modules: Iterable[nn.Module]) -> None:
    """A step starts: every MoE in ``modules`` counts its choices afresh, and refuses a forward after a backward."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, MoE):
                m.balance.begin_step()

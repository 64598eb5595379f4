"""Mixture-of-experts stages in a pipeline: the load-balancing loss over the whole batch across data-parallel copies,
the schedules it runs with (:mod:`pipefold.models.moe` says how the loss is computed microbatch by microbatch), and
expert parallelism.

**Expert parallelism.** :func:`shard_experts` spreads each MoE layer's experts over the ranks of a group (``ep`` of
them): rank ``i`` keeps experts ``i * E/ep`` to ``(i + 1) * E/ep - 1`` and the layer's dispatch becomes two
all-to-alls. Each rank routes its own tokens, sends every (token, choice) to the rank that holds the chosen expert
(the token's row, its expert's id), runs its experts on what it received and sends the outputs back, where they are
weighted and summed per token as before. Both exchanges are differentiable
(``torch.distributed.nn.functional.all_to_all_single``): the backward sends the outputs' gradients to the experts
and the inputs' gradients back. An expert's gradient is then the sum over its group's tokens.

The group is a stage's ``dp`` data-parallel copies cut into ``dp/ep`` groups of ``ep`` consecutive ones
(:func:`expert_groups`: copy ``i`` in group ``i // ep``, at rank ``i % ep`` within it, as Megatron-LM and DeepSeek
put ep inside dp). With ``ep = dp`` an expert is on one copy; with fewer, the copies at the same rank of every
group hold the same experts (replicas, the expert data-parallel group). The data-parallel reduction does not
average an expert's gradient with the other copies' (they hold other experts): it sums it over its replicas (an
all-reduce, :attr:`REPLICAS`; nothing to do with ``ep = dp``) and scales it by 1/dp, which is what the mean over
the copies of each copy's loss gives it (:attr:`EXPERT`). The load-balancing loss still counts the choices of all
``dp`` copies (:func:`sum_balance_over`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule
from pipefold.models.moe import MoE

__all__ = ["EXPERT", "REPLICAS", "ExpertShard", "balanced_stages", "begin_balance_step", "check_balance_order",
           "expert_groups", "shard_experts", "sum_balance_over"]

EXPERT = "pipefold_expert_parallel"
"""The attribute an expert's parameter carries once :func:`shard_experts` spread its layer's experts over the copies:
the data-parallel reduction leaves such a gradient on its rank (scaled by 1/copies), summed over its replicas
first where it has some (:attr:`REPLICAS`)."""

REPLICAS = "pipefold_expert_replicas"
"""The attribute an expert's parameter carries where other copies hold the same expert (expert parallelism over
fewer ranks than the copies): the process group of those replicas (this rank's among them), over which the
data-parallel reduction sums its gradient."""

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


class ExpertShard:
    """One MoE layer's experts on one rank of an expert-parallel group, and the dispatch that reaches the others."""

    def __init__(self, moe: MoE, group: Any, index: int, size: int) -> None:
        experts = moe.cfg.experts
        if experts % size:
            fits = [str(d) for d in range(1, experts + 1) if experts % d == 0]
            raise ConfigError(f"{size} expert-parallel ranks cannot share {experts} experts equally: give a number of "
                              f"copies that divides {experts} ({', '.join(fits)})")
        self.moe, self.group, self.index, self.size = moe, group, index, size
        self.per = experts // size
        self.first = index * self.per
        for e in range(experts):  # another rank's expert leaves a placeholder: the kept ones keep their names
            if not self.first <= e < self.first + self.per:
                moe.experts[e] = nn.Identity()
        for e in range(self.first, self.first + self.per):
            for p in moe.experts[e].parameters():
                setattr(p, EXPERT, True)
        self.sent_tokens = 0
        """(token, choice) pairs this rank has sent to other ranks' experts so far."""
        moe.dispatch = self.dispatch

    def dispatch(self, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        k = chosen.shape[-1]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, so by the rank that holds it
        expert = flat[order]
        token = torch.arange(h.shape[0], device=h.device).repeat_interleave(k)[order]
        weight = weights.reshape(-1)[order]
        send = torch.bincount(expert // self.per, minlength=self.size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        out_splits, in_splits = recv.tolist(), send.tolist()
        ids = torch.empty(sum(out_splits), dtype=expert.dtype, device=h.device)
        dist.all_to_all_single(ids, expert.contiguous(), out_splits, in_splits, group=self.group)
        rows = h[token]
        got = all_to_all_single(h.new_empty(sum(out_splits), h.shape[1]), rows, out_splits, in_splits,
                                group=self.group)
        done = torch.zeros_like(got)
        for e in range(self.first, self.first + self.per):
            mine = (ids == e).nonzero().squeeze(-1)
            if mine.numel():
                done = done.index_add(0, mine, self.moe.experts[e](got[mine]))
        back = all_to_all_single(torch.empty_like(rows), done, in_splits, out_splits, group=self.group)
        self.sent_tokens += int(send.sum() - send[self.index])
        return torch.zeros_like(h).index_add(0, token, back * weight.unsqueeze(-1).to(h.dtype))


def expert_groups(dp_group: Any, ep: int,
                  new_group: Callable[[list[int]], Any] | None = None) -> tuple[Any, Any]:
    """This rank's expert-parallel group and its replica group (None with ``ep`` equal to the copies) among the
    data-parallel copies ``dp_group``: copy ``i`` (its rank in ``dp_group``) is rank ``i % ep`` of group ``i // ep``,
    and its replicas are the copies with the same ``i % ep``. ``new_group(ranks)`` makes a group of global ranks
    (by default torch's, made by its members only), called by every rank of ``dp_group`` for its own two groups,
    the expert-parallel one first."""
    if new_group is None:
        def new_group(ranks: list[int]) -> Any:
            return dist.new_group(ranks, use_local_synchronization=True)
    copies = dist.get_world_size(dp_group)
    if ep == copies:
        return dp_group, None
    ranks, i = dist.get_process_group_ranks(dp_group), dist.get_rank(dp_group)
    first = i // ep * ep
    return new_group(list(ranks[first:first + ep])), new_group(list(ranks[i % ep::ep]))


def shard_experts(modules: Iterable[nn.Module], group: Any, replicas: Any = None) -> list[ExpertShard]:
    """Spread the experts of every MoE layer in ``modules`` over the ranks of ``group`` (this rank keeps its share;
    every rank of the group must hold the same layers). Refused in one line where the ranks do not divide the
    experts. ``replicas``: the process group of the ranks that hold the same experts in other groups
    (:func:`expert_groups`), which their parameters carry (:attr:`REPLICAS`)."""
    index, size = dist.get_rank(group), dist.get_world_size(group)
    layers = [m for module in modules for m in module.modules() if isinstance(m, MoE)]
    shards = [ExpertShard(m, group, index, size) for m in layers]
    if replicas is not None:
        for shard in shards:
            for e in range(shard.first, shard.first + shard.per):
                for p in shard.moe.experts[e].parameters():
                    setattr(p, REPLICAS, replicas)
    return shards

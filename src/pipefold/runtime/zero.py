"""ZeRO-1: the optimizer state of a stage sharded across its data-parallel copies.

Every copy holds the whole stage and its whole (all-reduced) gradients; each steps only its share of the
parameters, so keeps only their optimizer state, then sends them to the other copies (Rajbhandari et al. 2020,
stage 1). The shares are whole parameters balanced by bytes (:mod:`pipefold.plan.shares`), the same on every
copy.

A parameter may be a tensor-parallel DTensor: its copies across dp are the same shard on each, so the share is
the DTensor (the inner optimizer steps it as any optimizer steps a DTensor, and its state is DTensors, which
checkpoints split and join again on another tp degree) and what is sent is the local shard, a plain tensor. That
is why this is not torch's ``ZeroRedundancyOptimizer``: it broadcasts the parameters themselves, which a DTensor
cannot be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.plan.shares import shares
from pipefold.runtime.chunks import ChunkedOptimizer
from pipefold.runtime.comm import FlatBroadcast
from pipefold.runtime.sharding import local

__all__ = ["AnyOptimizer", "ShardedOptimizer", "holding"]


class ShardedOptimizer:
    """An optimizer over ``params`` of which this copy steps its share (``optim``, None where it has none) and
    receives the rest from their owners in ``group`` after each step."""

    def __init__(self, params: Sequence[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 group: Any) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.me = dist.get_rank(group)
        # Balanced by the bytes this rank holds (a DTensor's local shard): the copies in a group hold the same
        # shards, so they agree, and the planner predicts the heaviest share from the same bytes.
        sizes = [local(p).numel() * p.element_size() for p in params]
        self.shares = [[params[i] for i in share] for share in shares(sizes, len(self.ranks))]
        mine = self.shares[self.me]
        self.optim: torch.optim.Optimizer | None = make(mine) if mine else None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups of this copy's share's optimizer (none where it has no share): what an LR schedule
        sets (``for g in opt.param_groups: g["lr"] = ...``)."""
        return self.optim.param_groups if self.optim is not None else []

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradients of every parameter, the shares of the other copies included."""
        for share in self.shares:
            for p in share:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        if self.optim is not None:
            self.optim.step()
        self.share()

    @torch.no_grad()
    def share(self) -> None:
        """Each copy's stepped parameters to the others, from their owner into their own storage: one flat
        broadcast per owner (:class:`~pipefold.runtime.comm.FlatBroadcast`), all in flight at once. What every
        copy does after its step, and what the profile times
        (:func:`pipefold.runtime.measure.profiling.measure_zero1`)."""
        pending = [FlatBroadcast([local(p.detach()) for p in share], self.ranks[owner], self.group)
                   for owner, share in enumerate(self.shares) if share]
        for each in pending:
            each.wait()


AnyOptimizer = torch.optim.Optimizer | ShardedOptimizer | ChunkedOptimizer
"""What steps a rank's parameters: a torch optimizer, ZeRO-1's, or model-state chunks'."""


def holding(optimizers: Sequence[AnyOptimizer]) -> list[torch.optim.Optimizer]:
    """The torch optimizers that hold the state of ``optimizers`` (what checkpoints and snapshots copy): ZeRO-1's
    share's, none where this copy has no share; model-state chunks' one per chunk."""
    out = []
    for o in optimizers:
        if isinstance(o, ChunkedOptimizer):  # model-state chunks: an optimizer per chunk
            out.extend(o.optimizers())
            continue
        inner = o.optim if isinstance(o, ShardedOptimizer) else o
        if inner is not None:
            out.append(inner)
    return out

"""Weights that several stages hold (tied input and output embeddings): a copy per stage, gradients summed.

A model names its shared weights as (layer, parameter name) pairs (``Job.tied``). Where they fall in one
stage they are one parameter and nothing is done. Where they fall in several stages, each stage holds a copy
(:func:`untie`: the runtime assumes a stage owns its parameters, which its replicas all-reduce, data parallelism
averages and an optimizer steps once), and after the step's last backward, before the optimizer,
:class:`TiedGrads` makes every copy's gradient the sum of all of them: one all-reduce among the ranks holding a
copy, or a local sum where one rank holds them all (a V-shape puts the first and the last stage on device 0)::

    stage 0 (rank 0)  wte     grad g_in  \\
                                          all-reduce over {0, P-1}: both get g_in + g_out
    stage S-1 (rank P-1)  lm_head  grad g_out /

The copies start equal (the model builds them from the same initial weights), get the same gradient and the
same optimizer step, so they stay equal, as one tied weight trained in one process would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.ir import Schedule
from pipefold.runtime.precision import grad_holder

Tie = tuple[tuple[int, str], ...]


def untie(chains: Mapping[int, nn.Module]) -> None:
    """Give each stage (in stage order) its own copy of any parameter an earlier stage of this rank holds too."""
    first: dict[int, int] = {}  # parameter -> the stage that keeps it
    module_stage: dict[int, int] = {}
    for s in sorted(chains):
        copies: dict[int, nn.Parameter] = {}
        for module in chains[s].modules():
            if module._parameters and module_stage.setdefault(id(module), s) != s:
                raise ValueError(f"stages {module_stage[id(module)]} and {s} share a module with parameters: "
                                 "build each layer's modules once")
            for key, p in list(module._parameters.items()):
                if p is None or first.setdefault(id(p), s) == s:
                    continue
                if id(p) not in copies:
                    copies[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                module._parameters[key] = copies[id(p)]


def spans_stages(tie: Tie, layer_stages: Sequence[Sequence[int]]) -> bool:
    """Whether a shared weight's layers fall in more than one stage."""
    stage_of = {i: s for s, part in enumerate(layer_stages) for i in part}
    return len({stage_of[i] for i, _ in tie}) > 1


@dataclass
class _Group:
    group: object | None
    """The process group of the ranks holding a copy (None: this rank holds them all)."""
    held: list[nn.Parameter]
    """This rank's copies."""
    counted: list[nn.Parameter]
    """The copies whose gradient this rank adds in: of the stages it is the first holder of."""


class TiedGrads:
    """Sums the gradients of each shared weight's copies on this rank's stages (see the module's docstring).

    Made on every rank in the same order (it makes process groups); ``chains`` are this rank's stage modules,
    after :func:`untie`; ``pipelines`` the process-group ranks of every data-parallel pipeline.
    """

    def __init__(self, ties: Sequence[Tie], schedule: Schedule, layer_stages: Sequence[Sequence[int]], rank: int,
                 chains: Mapping[int, nn.Module], device: torch.device,
                 pipelines: Sequence[Sequence[int | None]] | None = None, pipeline: int = 0,
                 new_group: Callable[[list[int]], Any] | None = None) -> None:
        self.device = device
        self.groups: list[_Group] = []
        self.copies: set[int] = set()
        """This rank's copies other than the first stage's: a global norm counts each shared weight once."""
        stage_of = {i: s for s, part in enumerate(layer_stages) for i in part}
        pipelines = pipelines or [list(range(schedule.devices))]
        for tie in ties:
            stages = sorted({stage_of[i] for i, _ in tie})
            if len(stages) < 2:
                continue  # one stage: one parameter
            devices = sorted({d for s in stages for d in schedule.holders(s)})
            group = None
            for q, ranks in enumerate(pipelines):  # every rank makes every group, in the same order
                members = [r for d in devices if (r := ranks[d]) is not None]  # the devices share a degree
                made = (new_group or dist.new_group)(sorted(members)) if len(members) > 1 else None
                if q == pipeline:
                    group = made
            if rank not in devices:
                continue
            held: dict[int, nn.Parameter] = {}
            counted: dict[int, nn.Parameter] = {}
            for i, name in tie:
                s = stage_of[i]
                if s not in chains:
                    continue
                p = list(chains[s].children())[list(layer_stages[s]).index(i)].get_parameter(name)
                held[id(p)] = p
                if schedule.holders(s)[0] == rank:
                    counted[id(p)] = p
                if s != stages[0]:
                    self.copies.add(id(p))
            self.groups.append(_Group(group, list(held.values()), list(counted.values())))

    def reduce(self) -> None:
        """Every copy's gradient becomes the sum over all copies (of the step just run)."""
        for g in self.groups:
            total = torch.zeros_like(g.held[0], device=self.device)
            total = total.to(grad_holder(g.held[0]).dtype)
            for p in g.counted:
                grad = grad_holder(p).grad
                if grad is not None:
                    total += grad.to(self.device)
            if g.group is not None:
                dist.all_reduce(total, group=g.group)
            for p in g.held:
                grad_holder(p).grad = total.to(p.device, copy=True)

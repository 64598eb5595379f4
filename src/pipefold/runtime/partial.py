"""Structured partial backpropagation on a rank (:mod:`pipefold.plan.spb`): a copy's first layers run without
autograd, and each parameter's gradient gets its share of the sum over the copies (1 over the copies that compute
its layer), which the data-parallel all-reduce then sums."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipefold.plan.spb import computing

__all__ = ["cut", "shares"]


def cut(first_stage: nn.Module, layers: int) -> None:
    """Run the first ``layers`` children of ``first_stage`` without autograd: the backward stops after them. The
    stage's runner reads ``frozen_prefix`` (its backward has no first layer of its own to stop at)."""
    if layers <= 0:
        return
    for layer in list(first_stage.children())[:layers]:
        layer.forward = functools.partial(_without_autograd, layer.forward)
    first_stage.frozen_prefix = layers  # type: ignore[assignment]


def shares(stages: Mapping[int, nn.Module], first_layer: Mapping[int, int], spb: Sequence[int],
           layers: int) -> dict[int, list[float]]:
    """Per stage, each trained parameter's share of its gradient's sum over the copies, in the order of the stage's
    parameters: 1 over the copies that compute its layer (the stage's children are layers ``first_layer[s]`` on)."""
    out: dict[int, list[float]] = {}
    for s, stage in stages.items():
        seen: set[int] = set()
        row = []
        for i, layer in enumerate(stage.children()):
            for p in layer.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    row.append(1.0 / computing(spb, first_layer[s] + i, layers))
        out[s] = row
    return out


def _without_autograd(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with torch.no_grad():
        return forward(*args, **kwargs)

"""Structured partial backpropagation on a rank (:mod:`pipefold.plan.spb`): a copy's first layers run without
autograd, and the data-parallel reduction moves each parameter's gradient among the copies that compute its layer
(:class:`Reduction`): the mean over them, which the copies that did not compute it receive."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipefold.plan.spb import copies

__all__ = ["Reduction", "cut", "layers_of"]


def cut(first_stage: nn.Module, layers: int) -> None:
    """Run the first ``layers`` children of ``first_stage`` without autograd: the backward stops after them. The
    stage's runner reads ``frozen_prefix`` (its backward has no first layer of its own to stop at)."""
    if layers <= 0:
        return
    for layer in list(first_stage.children())[:layers]:
        layer.forward = functools.partial(_without_autograd, layer.forward)
    first_stage.frozen_prefix = layers  # type: ignore[assignment]


def layers_of(stages: Mapping[int, nn.Module], first_layer: Mapping[int, int]) -> dict[int, list[int]]:
    """Per stage, the layer of each trained parameter, in the order of the stage's parameters (the stage's children
    are layers ``first_layer[s]`` on)."""
    out: dict[int, list[int]] = {}
    for s, stage in stages.items():
        seen: set[int] = set()
        row = []
        for i, layer in enumerate(stage.children()):
            for p in layer.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    row.append(first_layer[s] + i)
        out[s] = row
    return out


@dataclass(frozen=True)
class Reduction:
    """The data-parallel reduction of a rank's gradients with structured partial backpropagation: which copies
    compute each trained parameter's layer, where every copy of the rank's device is, and the process groups of the
    copies that reduce or receive a gradient that some copies did not compute (:func:`pipefold.plan.spb.groups`,
    made alike on every rank by the caller)."""

    spb: tuple[int, ...]
    layers: int
    """The model's layers."""
    param_layers: dict[int, list[int]]
    """Per stage, the layer of each trained parameter, in the order of the stage's parameters (:func:`layers_of`)."""
    ranks: tuple[int, ...]
    """Each copy's global rank: this rank's device in every copy, in the copies' order."""
    copy: int
    """This rank's copy."""
    groups: Mapping[tuple[int, ...], Any]
    """The process group of each set of copies (:func:`pipefold.plan.spb.groups`) this rank is in."""

    def parts(self, stage: int, grads: Sequence[torch.Tensor]
              ) -> list[tuple[tuple[int, ...], list[torch.Tensor], dict[int, int]]]:
        """The stage's gradients (in the order of its parameters) by the copies that compute their layers, in order
        of first parameter: each set of copies, its gradients and their bytes per layer."""
        out: dict[tuple[int, ...], tuple[list[torch.Tensor], dict[int, int]]] = {}
        for g, layer in zip(grads, self.param_layers[stage], strict=True):
            part, sizes = out.setdefault(copies(self.spb, layer, self.layers), ([], {}))
            part.append(g)
            sizes[layer] = sizes.get(layer, 0) + g.numel() * g.element_size()
        return [(c, part, sizes) for c, (part, sizes) in out.items()]


def _without_autograd(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with torch.no_grad():
        return forward(*args, **kwargs)

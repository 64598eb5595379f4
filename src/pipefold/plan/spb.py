"""Structured partial backpropagation (Jigsaw's SPB): which data-parallel copies compute each layer, and which
splits a pipeline can run.

Copy ``i`` of ``len(spb)`` backpropagates through the model's last ``spb[i]`` of ``layers`` layers; the layers
before run without autograd. Layer ``l``'s gradient is the mean over the copies that computed it,
:func:`computing` of them. The runtime cuts a copy's backward inside the first pipeline stage (whose input needs
no gradient), so :func:`check` refuses a split whose cut falls beyond it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipefold.errors import ConfigError

__all__ = ["check", "computing"]


def computing(spb: Sequence[int], layer: int, layers: int) -> int:
    """How many copies backpropagate through ``layer`` of ``layers``."""
    return sum(1 for k in spb if layer >= layers - k)


def check(spb: Sequence[int], layers: int, first_stage: int, *, flag: str = "--spb") -> None:
    """Refuse in one line a split that leaves a layer with no copy computing it, counts more layers than the model
    has, or cuts a copy's backward past the first stage's ``first_stage`` layers."""
    text = ",".join(map(str, spb))
    if max(spb) > layers:
        raise ConfigError(f"{flag} {text} backpropagates through {max(spb)} layers, and the model has {layers}: give "
                          f"numbers from 1 to {layers}")
    if max(spb) < layers:
        whole = ",".join([str(layers), *map(str, spb[1:])])
        raise ConfigError(f"{flag} {text} leaves layers 0 to {layers - max(spb) - 1} of {layers} with no copy "
                          f"computing them: give one copy all {layers} layers ({flag} {whole})")
    if min(spb) < layers - first_stage:
        raise ConfigError(f"{flag} {text} cuts a copy's backward past the first stage (layers 0 to {first_stage - 1} "
                          f"of {layers}): give every copy at least its last {layers - first_stage} layers, or the "
                          "first stage more layers (fewer stages: fewer --devices, or one stage per device as "
                          "--schedule 1f1b has)")

"""Structured partial backpropagation (Jigsaw's SPB): which data-parallel copies compute each layer, and which
splits a pipeline can run.

Copy ``i`` of ``len(spb)`` backpropagates through the model's last ``spb[i]`` of ``layers`` layers; the layers
before run without autograd. Layer ``l``'s gradient is the mean over the copies that computed it,
:func:`computing` of them (:func:`copies` says which). The runtime cuts a copy's backward inside the first pipeline
stage (whose input needs no gradient), so :func:`check` refuses a split whose cut falls beyond it.

The data-parallel reduction moves a layer's gradient among the copies that computed it only: every copy when all
of them did (one all-reduce over the copies), otherwise an all-reduce among those copies (none when one copy
computed it) and a broadcast of the mean from the first of them to the copies that did not, which send nothing of
it. :func:`groups` lists the process groups that takes, :func:`dp_bytes` what each copy sends, in closed form:
a ring all-reduce of ``S`` bytes among ``c`` copies sends ``2 (c - 1) / c * S`` from each, a broadcast sends ``S``
from its source to each receiver (gloo's broadcast, one to all).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction

from pipefold.errors import ConfigError

__all__ = ["check", "computing", "copies", "dp_bytes", "groups", "receivers", "ring_bytes"]


def copies(spb: Sequence[int], layer: int, layers: int) -> tuple[int, ...]:
    """The copies that backpropagate through ``layer`` of ``layers``, in order."""
    return tuple(i for i, k in enumerate(spb) if layer >= layers - k)


def computing(spb: Sequence[int], layer: int, layers: int) -> int:
    """How many copies backpropagate through ``layer`` of ``layers``."""
    return len(copies(spb, layer, layers))


def receivers(computed: Sequence[int], n: int) -> tuple[int, ...]:
    """The broadcast of a gradient that ``computed`` of ``n`` copies computed: its source (the first of them)
    and the copies that did not compute it, in order (empty when every copy computed it: the all-reduce is all)."""
    if len(computed) == n:
        return ()
    return tuple(sorted({computed[0], *(i for i in range(n) if i not in computed)}))


def groups(spb: Sequence[int], held: Iterable[int], layers: int) -> list[tuple[int, ...]]:
    """The sets of copies that need a process group of their own to reduce the gradients of the layers ``held``
    on one device, in order of first need: for each layer some copies do not compute, the copies that do (2 or
    more) and its broadcast's (:func:`receivers`; not when that is every copy: the data-parallel group serves)."""
    n, out = len(spb), []
    for layer in held:
        computed = copies(spb, layer, layers)
        for members in (computed, receivers(computed, n)):
            if 1 < len(members) < n and members not in out:
                out.append(members)
    return out


def ring_bytes(size: int, c: int) -> Fraction:
    """The bytes each of ``c`` ranks sends in a ring all-reduce of ``size`` bytes: its reduce-scatter and its
    all-gather each pass ``c - 1`` of ``c`` chunks on (a fraction of a byte where ``c`` does not divide ``size``:
    the closed form is exact, the ring's chunks are whole elements)."""
    return Fraction(2 * (c - 1) * size, c)


def dp_bytes(spb: Sequence[int], layer_bytes: Mapping[int, int], layers: int, *,
             split: bool = True) -> list[Fraction]:
    """Per copy, the bytes it sends in one step's data-parallel reduction of the layers' gradients
    (``layer_bytes``: layer -> the bytes of its gradients on one rank): a layer every copy computed (without
    ``split``, every layer: the all-reduce of full backpropagation) in a ring all-reduce over every copy; any other
    among the copies that computed it, whose first then sends it to each copy that did not."""
    n = len(spb)
    out = [Fraction(0)] * n
    for layer, size in layer_bytes.items():
        computed = copies(spb, layer, layers) if split else tuple(range(n))
        for i in computed:
            out[i] += ring_bytes(size, len(computed))
        if len(computed) < n:
            out[computed[0]] += (n - len(computed)) * size
    return out


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

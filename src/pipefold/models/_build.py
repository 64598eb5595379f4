"""Per-layer materialization: build any subset of a model's layers, each seeded from (model, seed, layer index)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pipefold.errors import ConfigError


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts``: different parts give independent random streams."""
    # Hashing (rather than e.g. seed * K + index) keeps streams of different tags, seeds and
    # layers from ever colliding, and does not depend on Python's per-process hash salt.
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded from ``parts``."""
    return torch.Generator().manual_seed(derive_seed(*parts))


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill ``param`` from N(0, std^2), drawn on the CPU so weights do not depend on the device."""
    param.copy_(torch.empty(param.shape, dtype=param.dtype).normal_(0.0, std, generator=gen))


def check_indices(indices: Iterable[int], total: int, layout: str) -> list[int]:
    """The requested layer indices as a list, each in 0..total-1; ``layout`` names the layers in errors."""
    chosen = list(indices)
    for i in chosen:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < total:
            raise ConfigError(f"layer index {i!r} is out of range: this model has layers 0..{total - 1} ({layout})")
    return chosen


def materialize(
    indices: Iterable[int],
    total: int,
    layout: str,
    make: Callable[[int], nn.Module],
    init: Callable[[nn.Module, int, torch.Generator], None],
    *,
    tag: str,
    seed: int,
    device: str | torch.device,
) -> dict[int, nn.Module]:
    """Build only the layers in ``indices``: construct on the meta device, allocate on ``device``, then init.

    Each layer draws its initial weights from its own generator, seeded from (tag, seed, index), so a
    layer's weights are the same whichever other layers are built with it: a pipeline rank builds only
    its own stages and still matches the single-process model exactly.
    """
    layers: dict[int, nn.Module] = {}
    for i in check_indices(indices, total, layout):
        with torch.device("meta"):
            layer = make(i)  # no memory yet: shapes only
        _allocate(layer, torch.device(device))
        init(layer, i, generator(tag, seed, i))
        layers[i] = layer
    return layers


def _allocate(module: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of ``module`` uninitialized memory on ``device`` (as ``Module.to_empty``,
    whose path through meta tensors imports sympy: a third of a second in every process). A tensor shared by
    several modules stays shared."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(fresh, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fresh
        return made[id(t)]

    for each in module.modules():
        for name, param in each._parameters.items():
            if param is not None:
                each._parameters[name] = empty(param)  # type: ignore[assignment]
        for name, buffer in each._buffers.items():
            if buffer is not None:
                each._buffers[name] = empty(buffer)


def check_positive_int(config: str, name: str, value: object) -> None:
    """Raise a one-line ConfigError unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{config}.{name} must be a positive integer (got {value!r}): pass {name}=1 or more")

"""Models as flat lists of layers (one tensor in, one tensor out), a registry by name, and layer-to-stage splits.

Nothing here knows about pipelining: a stage is just a contiguous run of layers, applied in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models.data import Batches, Corpus, load_corpus
from pipefold.models.gpt import GPTConfig, build_gpt, build_gpt_layers, gpt_loss
from pipefold.models.mlp import MLPConfig, build_mlp, build_mlp_layers, mlp_input, mlp_loss, mlp_target

__all__ = [
    "MODELS",
    "Batches",
    "Corpus",
    "GPTConfig",
    "MLPConfig",
    "ModelSpec",
    "build_gpt",
    "build_gpt_layers",
    "build_mlp",
    "build_mlp_layers",
    "build_model",
    "get_model",
    "gpt_loss",
    "load_corpus",
    "mlp_input",
    "mlp_loss",
    "mlp_target",
    "split_layers",
]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A registered model: its config class, how to build some of its layers, and its loss."""

    name: str
    config: type[GPTConfig] | type[MLPConfig]
    build_layers: Callable[..., dict[int, nn.Module]]
    """``build_layers(cfg, indices, *, seed=0, device='cpu')``: only the layers at ``indices``."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    description: str

    def make_config(self, **kwargs: Any) -> Any:
        """The config from keyword arguments, with a one-line error naming the fields on an unknown one."""
        fields = [f.name for f in dataclasses.fields(self.config)]
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise ConfigError(f"model {self.name} has no setting {unknown[0]!r}; its settings: {', '.join(fields)}")
        return self.config(**kwargs)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(name="gpt", config=GPTConfig, build_layers=build_gpt_layers, loss=gpt_loss,
                  description="nanoGPT-like byte-level decoder: embedding, n_layer blocks, head"),
        ModelSpec(name="mlp", config=MLPConfig, build_layers=build_mlp_layers, loss=mlp_loss,
                  description="benchmark stack of identical MLP blocks with a fixed random regression target"),
    ]
}


def get_model(name: str) -> ModelSpec:
    """The registered model called ``name``."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


def build_model(name: str, *, seed: int = 0, **config: Any) -> list[nn.Module]:
    """The whole model ``name`` as a flat list of layers, configured by keywords: ``build_model('gpt', n_layer=2)``."""
    spec = get_model(name)
    cfg = spec.make_config(**config)
    layers = spec.build_layers(cfg, range(cfg.num_layers), seed=seed)
    return [layers[i] for i in range(cfg.num_layers)]


def split_layers(layers: int | Sequence[object], num_stages: int) -> list[list[int]]:
    """Layer indices of each stage: contiguous runs covering every layer once, sizes differing by at most 1.

    ``layers`` is the layer list or just its length (a pipeline rank knows the count without building
    the model). The first ``n % num_stages`` stages take one layer more::

        split_layers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    """
    n = layers if isinstance(layers, int) else len(layers)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"number of stages must be a positive integer (got {num_stages!r})")
    if num_stages > n:
        raise ConfigError(f"cannot split {n} layers into {num_stages} stages: at most {n} stages")
    size, extra = divmod(n, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + size + (s < extra))
    return [list(range(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]



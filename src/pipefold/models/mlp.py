"""The benchmark model: a stack of identical MLP blocks, one layer each, with fixed random inputs and targets."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models._build import check_positive_int, generator, materialize, normal_
from pipefold.models.base import Model, ModelArgs
from pipefold.models.size import Shape

__all__ = ["MLP", "MLPBlock", "MLPConfig", "build_mlp", "build_mlp_layers", "mlp_input", "mlp_loss", "mlp_target"]


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Shape of the benchmark MLP: every layer costs the same, so stage times are easy to predict."""

    hidden: int = 512
    """Width H of each layer's input and output (its inner width is 4H)."""
    layers: int = 8
    """Number of layers (blocks)."""

    def __post_init__(self) -> None:
        check_positive_int("MLPConfig", "hidden", self.hidden)
        check_positive_int("MLPConfig", "layers", self.layers)

    @property
    def num_layers(self) -> int:
        """Layers in the flat list."""
        return self.layers


class MLPBlock(nn.Module):
    """One layer: Linear(H, 4H) -> GELU -> Linear(4H, H)."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.gelu(self.fc(x)))  # (B, H) -> (B, 4H) -> (B, H)


@torch.no_grad()
def _init_layer(cfg: MLPConfig, layer: nn.Module, gen: torch.Generator) -> None:
    """He init into the GELU, LeCun init out of it, zero biases."""
    # No residual connection: these scales keep the activation variance roughly constant through the
    # stack, so neither outputs nor gradients vanish or blow up whatever the number of layers.
    assert isinstance(layer, MLPBlock)
    normal_(layer.fc.weight, math.sqrt(2.0 / cfg.hidden), gen)
    normal_(layer.proj.weight, math.sqrt(1.0 / (4 * cfg.hidden)), gen)
    layer.fc.bias.zero_()
    layer.proj.bias.zero_()


def build_mlp_layers(cfg: MLPConfig, indices: Iterable[int], *, seed: int = 0,
                     device: str | torch.device = "cpu") -> dict[int, nn.Module]:
    """Build only the layers at ``indices`` on ``device``, each with the weights ``build_mlp`` gives it."""
    return materialize(indices, cfg.num_layers, f"{cfg.layers} MLP blocks", lambda i: MLPBlock(cfg),
                       lambda layer, i, gen: _init_layer(cfg, layer, gen), tag="mlp", seed=seed, device=device)


def build_mlp(cfg: MLPConfig, *, seed: int = 0) -> list[nn.Module]:
    """The whole MLP as a flat list of layers on the CPU; apply them in order to map (B, H) to (B, H)."""
    layers = build_mlp_layers(cfg, range(cfg.num_layers), seed=seed)
    return [layers[i] for i in range(cfg.num_layers)]


def mlp_input(cfg: MLPConfig, batch: int, seed: int = 0) -> torch.Tensor:
    """A fixed random input (B, H), the same in every process for the same seed."""
    check_positive_int("mlp_input", "batch", batch)
    return torch.randn(batch, cfg.hidden, generator=generator("mlp-input", seed))  # (B, H)


def mlp_target(cfg: MLPConfig, batch: int, seed: int = 0) -> torch.Tensor:
    """A fixed random regression target (B, H), independent of :func:`mlp_input` for the same seed."""
    check_positive_int("mlp_target", "batch", batch)
    return torch.randn(batch, cfg.hidden, generator=generator("mlp-target", seed))  # (B, H)


def mlp_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error; a target of another shape than the output is an error, not a broadcast."""
    if out.shape != target.shape:
        raise ConfigError(f"the target has shape {tuple(target.shape)} but the model's output has "
                          f"{tuple(out.shape)}; give a target of the output's shape")
    return F.mse_loss(out, target)


class MLP(Model):
    """The benchmark MLP as a :class:`~pipefold.models.base.Model`: step t's input is ``mlp_input`` of seed + t, its
    target the fixed ``mlp_target``."""

    name = "mlp"

    def __init__(self, cfg: MLPConfig, batch: int, *, seed: int = 0) -> None:
        check_positive_int("MLP", "batch", batch)
        self.cfg, self.batch, self.seed = cfg, batch, seed
        self.num_layers = cfg.num_layers

    def build_layers(self, indices: Iterable[int], *, device: str | torch.device = "cpu") -> dict[int, nn.Module]:
        return build_mlp_layers(self.cfg, indices, seed=self.seed, device=device)

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return mlp_loss(out, target)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return mlp_input(self.cfg, self.batch, self.seed + step), mlp_target(self.cfg, self.batch, self.seed)

    def tp_plan(self, index: int) -> dict[str, str]:
        return {"fc": "colwise", "proj": "rowwise"}  # each rank its share of the inner width; one all-reduce

    def tp_widths(self) -> dict[str, int]:
        return {"--hidden (its inner width, 4 x hidden)": 4 * self.cfg.hidden}

    def size(self) -> Shape:
        return Shape(model="mlp", layers=self.cfg.layers, hidden=self.cfg.hidden, batch=self.batch)


def make(args: ModelArgs) -> MLP:
    if args.config is not None:
        raise ConfigError("the mlp is sized by --layers and --hidden: --hf-config configures a Hugging Face model "
                          "(--hf NAME)")
    return MLP(MLPConfig(layers=args.layers or 4, hidden=args.hidden or 64), args.batch, seed=args.seed)


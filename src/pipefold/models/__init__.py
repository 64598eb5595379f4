"""Models as flat lists of layers (embedding layers, repeated blocks, head layers), a registry by name, and
layer-to-stage splits.

Nothing here knows about pipelining: a stage is just a contiguous run of layers, applied in order. The interface
every model gives the pipeline is :class:`~pipefold.models.base.Model`; :data:`REGISTRY` holds the models by name:
``gpt`` and ``mlp`` built in, and the Hugging Face causal LMs ``gpt2`` and ``llama`` of :mod:`pipefold.models.hf`
(``pip install 'pipefold[hf]'``). Importing this package imports no torch: the modules that build models load
when a model is made or one of their names is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pipefold.errors import ConfigError
from pipefold.models.base import REGISTRY, Family, Model, ModelArgs, Tie, make_model, register

if TYPE_CHECKING:
    from pipefold.models.data import Batches, Corpus, load_corpus
    from pipefold.models.gpt import GPT, GPTConfig, build_gpt, build_gpt_layers, gpt_loss
    from pipefold.models.mlp import MLP, MLPConfig, build_mlp, build_mlp_layers, mlp_input, mlp_loss, mlp_target

__all__ = [
    "GPT",
    "MLP",
    "REGISTRY",
    "Batches",
    "Corpus",
    "Family",
    "GPTConfig",
    "MLPConfig",
    "Model",
    "ModelArgs",
    "Tie",
    "build_gpt",
    "build_gpt_layers",
    "build_mlp",
    "build_mlp_layers",
    "gpt_loss",
    "load_corpus",
    "make_model",
    "mlp_input",
    "mlp_loss",
    "mlp_target",
    "register",
    "split_layers",
]

_LAZY = {
    **dict.fromkeys(("Batches", "Corpus", "load_corpus"), "data"),
    **dict.fromkeys(("GPT", "GPTConfig", "build_gpt", "build_gpt_layers", "gpt_loss"), "gpt"),
    **dict.fromkeys(("MLP", "MLPConfig", "build_mlp", "build_mlp_layers", "mlp_input", "mlp_loss", "mlp_target"),
                    "mlp"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipefold.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipefold.models.{module}"), name)


def _maker(module: str, *args: Any) -> Callable[[ModelArgs], Model]:
    """``pipefold.models.<module>.make(*args, model_args)``, imported when first called."""
    def make(model_args: ModelArgs) -> Model:
        made: Model = importlib.import_module(f"pipefold.models.{module}").make(*args, model_args)
        return made
    return make


register(Family(name="gpt", make=_maker("gpt"), blocks_for=lambda stages: max(1, 2 * stages - 2),
                description="nanoGPT-like byte-level decoder: embedding, blocks, head (4 blocks, width 64, 4 heads "
                            "by default)"))
register(Family(name="mlp", make=_maker("mlp"), blocks_for=lambda stages: 2 * stages, sequences=False,
                description="benchmark stack of identical MLP blocks with a fixed random regression target (4 "
                            "blocks, width 64 by default)"))
register(Family(name="moe", make=_maker("moe"), blocks_for=lambda stages: max(1, 2 * stages - 2),
                description="mixture-of-experts byte-level decoder: each block's MLP 8 routed SwiGLU experts, top 2, "
                            "a load-balancing loss over the whole batch (Mixtral's routing; gpipe or looped-bfs)"))
for _arch, _tiny in (("gpt2", "gpt2-tiny"), ("llama", "llama-tiny"), ("mixtral", "mixtral-tiny")):
    register(Family(name=_arch, make=_maker("hf", _arch), blocks_for=lambda stages: None, hf=True,
                    description=f"Hugging Face transformers {_arch} causal LM built from a config (--hf-config: a "
                                f"config.json or a shipped name; default {_tiny})"))


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

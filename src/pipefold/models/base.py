"""The model interface: what the pipeline needs of a model, and the registry of models by name.

A :class:`Model` is a flat list of layers, ``embedding_layers`` of them first, then the repeated
blocks, then ``head_layers`` (the head computes what :meth:`Model.loss` takes). Each layer takes the
previous layer's output (one tensor, or a tuple of tensors spread as arguments) and returns its own,
so any contiguous run of layers is a pipeline stage. Besides its layers a model gives its loss, its
data (the whole batch of any step, a pure function of its seed and the step) and the weights its
layers share (tied embeddings). Train, partition, profile, offload and the CLI use only this.

A family in :data:`REGISTRY` makes a model from :class:`ModelArgs`, the settings a user gives on the
command line. This module imports no torch (the command line reads the registry to list its choices); a
family's ``make`` imports what its model needs.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipefold.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pipefold.models.size import Shape

    Inputs = torch.Tensor | tuple[torch.Tensor, ...]
    """A batch's inputs: one tensor, or several (token ids and an attention mask); dimension 0 is the rows."""
    Batch = tuple[Inputs, torch.Tensor]
    """(inputs, targets) of one step, split into microbatches along dimension 0."""

__all__ = ["REGISTRY", "Family", "Model", "ModelArgs", "Tie", "check_sequence_split", "make_model", "register"]

Tie = tuple[tuple[int, str], ...]
"""One weight that several layers share, as (layer index, parameter name in that layer) of each."""


def check_sequence_split(what: str, how: str, parts: int, seq: int) -> None:
    """Refuse in one line a sequence of ``seq`` tokens that ``what`` (``--cp 2``, ``seq_chunks 4``) cannot cut into
    ``parts`` equal pieces as it says (``how``)."""
    if seq % parts:
        raise ConfigError(f"{what} {how}, and --seq {seq} does not: give --seq a multiple of {parts}")


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """What a user says about a model (``pipefold train --layers ... --hf-config ...``); None: the model's default."""

    layers: int | None = None
    """Repeated blocks (transformer blocks, MLP blocks)."""
    hidden: int | None = None
    """Width."""
    heads: int | None = None
    """Attention heads."""
    vocab_size: int | None = None
    """Entries of a language model's vocabulary (its embedding and its output projection)."""
    seq: int = 64
    """Tokens per row, for language models."""
    batch: int = 16
    """Rows per step (all microbatches)."""
    seed: int = 0
    """Initial weights and data."""
    data: str | None = None
    """A text file to train a language model on instead of the built-in corpus."""
    config: str | None = field(default=None, metadata={"flag": "model_config", "option": "--hf-config"})
    """The model's own configuration: a config name the model ships or a JSON file (Hugging Face models)."""
    moe: str | None = None
    """The mixture of experts' shape, ``key=value,...`` of :class:`pipefold.models.moe.MoEConfig` (the moe model)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got {value!r})")
        for name in ("seq", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name} must be at least 1 (got {value!r})")


class Model(abc.ABC):
    """A model the pipeline runs: layers ``0..num_layers-1``, built any subset at a time, its loss and its data.

    Layer ``i`` gets the same initial weights whichever other layers are built with it, so a pipeline rank
    builds only its own stages and still matches the whole model built in one process.
    """

    name: str
    """The registry name."""
    num_layers: int
    """Layers in the flat list: embedding layers, blocks, head layers."""
    embedding_layers: int = 0
    """Layers before the blocks."""
    head_layers: int = 0
    """Layers after the blocks."""
    seq: int | None = None
    """Tokens per row of the data (language models), None where a row is one sample."""
    tied: tuple[Tie, ...] = ()
    """Weights shared by several layers (a language model's input and output embeddings). Where they land on
    different stages each stage holds a copy, and the runtime sums their gradients after the step."""
    preload: tuple[str, ...] = ()
    """Modules the ranks import to build the layers (loaded once into the processes that start them)."""
    splits_embedding: bool = False
    """Whether :meth:`split_input` takes a token embedding out of the first layer (vocabulary parallelism splits
    it with the output layer)."""

    @abc.abstractmethod
    def build_layers(self, indices: Iterable[int], *, device: str | torch.device = "cpu") -> dict[int, nn.Module]:
        """Only the layers at ``indices``, on ``device``."""

    @abc.abstractmethod
    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of one microbatch: the last layer's output against its targets (a mean over the microbatch)."""

    @abc.abstractmethod
    def batch_at(self, step: int) -> Batch:
        """The whole batch of training step ``step``: the same in every process for the same seed and step."""

    def size(self) -> Shape | None:
        """The model's size for :mod:`pipefold.models.size`, which refuses before any layer is built a run this
        machine cannot hold or would take minutes per step on; None (the default): the model is not checked."""
        return None

    def build(self) -> list[nn.Module]:
        """Every layer, in order, on the CPU."""
        layers = self.build_layers(range(self.num_layers))
        return [layers[i] for i in range(self.num_layers)]

    def tp_plan(self, index: int) -> dict[str, str]:
        """How layer ``index`` splits over tensor-parallel ranks: submodule name -> "colwise" (a Linear's output
        features split, its input whole) or "rowwise" (its input features split, the partial outputs summed), as
        torch's ColwiseParallel and RowwiseParallel do; what is not named is replicated on every rank (embeddings,
        norms, a head). The default, for a model that declares none, refuses in one line."""
        raise ConfigError(f"the {self.name} model declares no tensor-parallel plan: use --tp 1 with it (the gpt and "
                          "mlp models and --hf llama have one)")

    def tp_widths(self) -> dict[str, int]:
        """The widths the tensor-parallel degree must divide (a count of heads, a Linear's split features), by the
        setting that makes them: {"--heads": 4, "--hidden": 64}."""
        return {}

    def sequence_plan(self, index: int) -> dict[str, str]:
        """Layer ``index``'s modules that run on each tensor-parallel rank's share of the tokens with sequence
        parallelism (norms, torch's SequenceParallel): submodule name -> "sequence"; empty for a layer that keeps
        its tokens whole (an embedding, a head). The default, for a model that declares none, refuses in one
        line."""
        raise ConfigError(f"the {self.name} model declares no sequence-parallel plan: drop --sequence-parallel (the "
                          "gpt model has one)")

    def balanced_layers(self) -> tuple[int, ...]:
        """The layers with a loss term over the whole batch (a mixture of experts' load-balancing loss,
        :mod:`pipefold.models.moe`): every microbatch's forward at their stage must come before its first backward.
        None by default."""
        return ()

    def check_expert_parallel(self, ranks: int, copies: int = 0) -> None:
        """Refuse in one line experts this model cannot spread over ``ranks`` (``--ep``) of ``copies`` data-parallel
        copies: by default every model, as only a mixture of experts has them."""
        raise ConfigError(f"the {self.name} model has no experts to spread: use --model moe with --ep")

    def check_sequence_chunks(self, chunks: int) -> None:
        """Refuse, in one line, sequence chunks (Seq1F1B) this model cannot run: by default every model, as only
        a model whose layers declare where attention and positions are (``attend`` and ``positions``, which the
        runtime fills, :mod:`pipefold.runtime.seqchunks`) can."""
        raise ConfigError(f"the {self.name} model does not declare its attention and positions for sequence "
                          f"chunks (seq_chunks {chunks}): use --model gpt, or a schedule without seq_chunks")

    def split_output(self, layer: nn.Module) -> tuple[str, torch.Tensor]:
        """Vocabulary parallelism: take the projection onto the vocabulary out of ``layer`` (the model's last), which
        from then on returns the hidden states it projected, and return the projection's parameter name within the
        layer and its weight (vocabulary x hidden). The model's loss must be the mean cross entropy of that
        projection's output against the targets (positions whose target is -100 left out). The default, for a
        model that declares no such projection, refuses (:meth:`check_split_output`)."""
        self.check_split_output()
        raise AssertionError("a model that declares an output projection overrides split_output")

    def split_input(self, layer: nn.Module) -> tuple[str, torch.Tensor, int | None] | None:
        """Vocabulary parallelism's input side: take the token embedding out of ``layer`` (the model's first),
        which from then on takes the embeddings of its tokens where it took the token ids, and return the
        embedding's parameter name within the layer, its weight (vocabulary x hidden) and its padding entry (whose
        row takes no gradient; None for none). None by default: a model that declares no token embedding
        (:attr:`splits_embedding` False) keeps its first layer whole (its output layer may still split)."""
        return None

    def check_split_output(self) -> None:
        """Refuse in one line a model whose output projection vocabulary parallelism cannot split: by default every
        model; one that overrides :meth:`split_output` says what it cannot split (a projection tied to the
        embedding)."""
        raise ConfigError(f"the {self.name} model declares no output projection to split by vocabulary: use --model "
                          "gpt (or a Hugging Face LLaMA), or a schedule without vocab=1")

    def check_context_parallel(self, cp: int) -> None:
        """Refuse in one line a split of each sequence over ``cp`` context-parallel ranks that the model cannot run:
        its layers declare where attention and positions are (``attend`` and ``positions``, which the runtime fills,
        :func:`pipefold.runtime.context.context_parallel`). The default, for a model that declares none, refuses."""
        raise ConfigError(f"the {self.name} model does not declare its attention and positions for context "
                          "parallelism: use --cp 1 with it (the gpt model does)")

    def sequence_length(self) -> int | None:
        """The tokens of a sequence, which sequence parallelism splits over the tensor-parallel ranks."""
        return None

    def tp_plans(self, tp: int, sequence_parallel: bool = False) -> dict[int, dict[str, str]]:
        """Every layer's plan (:meth:`tp_plan`) for ``tp`` tensor-parallel ranks, after the checks that ``tp`` fits
        the model: it divides every width the plans split, and the model declares a plan at all (one line each).
        With ``sequence_parallel`` a layer with a :meth:`sequence_plan` runs its norms on each rank's share of the
        tokens and its Linears as ``colwise-sp`` and ``rowwise-sp`` (:func:`pipefold.runtime.sharding.
        tensor_parallel`); ``tp`` must divide the sequence too."""
        widths = dict(self.tp_widths())
        if sequence_parallel and (seq := self.sequence_length()) is not None:
            widths["--seq (split by --sequence-parallel)"] = seq
        for what, width in widths.items():
            if width % tp:
                fits = [str(d) for d in range(2, width + 1) if width % d == 0]
                shown = ", ".join(fits[:6]) + (", ..." if len(fits) > 6 else "")
                raise ConfigError(f"--tp {tp} splits {what} = {width} unevenly: use a --tp that divides it ({shown}) "
                                  f"or change {what.split()[0]}")
        plans = {i: plan for i in range(self.num_layers) if (plan := self.tp_plan(i))}
        if not sequence_parallel:
            return plans
        for i in range(self.num_layers):
            norms = self.sequence_plan(i)
            if norms:
                plans[i] = {**{name: f"{style}-sp" for name, style in plans.get(i, {}).items()}, **norms}
        return plans

    @property
    def blocks(self) -> range:
        """Indices of the repeated blocks."""
        return range(self.embedding_layers, self.num_layers - self.head_layers)

    def layer_name(self, index: int) -> str:
        """Layer ``index`` for messages: 'layer 3 (block 2)', 'layer 0 (embedding)'."""
        if index < self.embedding_layers:
            return f"layer {index} (embedding)"
        if index >= self.num_layers - self.head_layers:
            return f"layer {index} (head)"
        return f"layer {index} (block {index - self.embedding_layers})" if self.embedding_layers else f"layer {index}"


@dataclass(frozen=True, kw_only=True)
class Family:
    """A registered model: how to make it from the user's settings."""

    name: str
    description: str
    make: Callable[[ModelArgs], Model]
    blocks_for: Callable[[int], int | None]
    """The default number of blocks for a pipeline of this many stages (two layers per stage); None: the model's
    own configuration decides."""
    sequences: bool = True
    """Its rows are sequences of ``seq`` tokens (a language model), not single samples."""
    hf: bool = False
    """A Hugging Face model (``--hf NAME``), its shape from its config (``--hf-config``)."""


REGISTRY: dict[str, Family] = {}
"""Every model by name; ``pipefold.models`` registers the built-in ones and the Hugging Face ones."""


def register(family: Family) -> Family:
    """Add ``family`` to :data:`REGISTRY` (a name is registered once)."""
    if family.name in REGISTRY:
        raise ValueError(f"a model called {family.name!r} is registered already")
    REGISTRY[family.name] = family
    return family


def make_model(name: str, **args: object) -> Model:
    """The registered model ``name`` made from :class:`ModelArgs` keywords: ``make_model('gpt', layers=2)``."""
    family = REGISTRY.get(name)
    if family is None:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(REGISTRY)}")
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(args) - fields)
    if unknown:
        raise ConfigError(f"models take no setting {unknown[0]!r}; their settings: {', '.join(sorted(fields))}")
    return family.make(ModelArgs(**args))  # type: ignore[arg-type]

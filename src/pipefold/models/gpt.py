"""A nanoGPT-like decoder-only GPT as a flat list of layers: embedding, N blocks, head.

Each layer takes one tensor and returns one tensor, so any contiguous run of layers
is a pipeline stage and nothing here knows about pipelining::

    idx (B, T) int64 -> [0 Embedding] -> (B, T, C) -> [1..N Block] -> (B, T, C) -> [N+1 Head] -> logits (B, T, V)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models._build import check_positive_int, materialize, normal_
from pipefold.models.base import Model, ModelArgs, check_sequence_split
from pipefold.models.data import Batches, load_corpus
from pipefold.models.size import Shape

__all__ = ["GPT", "Block", "CorpusDecoder", "Embedding", "GPTConfig", "Head", "build_gpt", "build_gpt_layers",
           "corpus_sizes", "gpt_loss"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the GPT; the defaults are a tiny byte-level model that trains in seconds on a CPU."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level corpus."""
    block_size: int = 128
    """Longest sequence the model accepts (the number of learned positions)."""
    n_layer: int = 4
    """Number of transformer blocks (the model has n_layer + 2 layers with the embedding and head)."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 64
    """Width of the residual stream (C)."""
    dropout: float = 0.0
    """Dropout probability in attention and after each residual branch; 0 keeps runs deterministic."""
    bias: bool = True
    """Whether Linear and LayerNorm layers have biases (the output projection to the vocabulary never does)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_positive_int("GPTConfig", name, getattr(self, name))
        if self.n_embd % self.n_head:
            divisors = [h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0 and h <= 16]
            raise ConfigError(f"GPTConfig.n_embd must be a multiple of n_head (n_embd={self.n_embd}, "
                              f"n_head={self.n_head}): pick n_head from {divisors} or change n_embd")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ConfigError(f"GPTConfig.dropout must be a probability in [0, 1) (got {self.dropout!r})")

    @property
    def num_layers(self) -> int:
        """Layers in the flat list: embedding, n_layer blocks, head."""
        return self.n_layer + 2


class Embedding(nn.Module):
    """Layer 0: token embedding plus learned position embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        # Weights left empty: _init_layer draws every one. (torch's own draw on the meta device, where materialize
        # builds layers, would import torch._dynamo: a second of every launch.)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, _weight=torch.empty(cfg.vocab_size, cfg.n_embd))
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, _weight=torch.empty(cfg.block_size, cfg.n_embd))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)  # idx: (B, T) int64
        if t > self.block_size:
            raise ConfigError(f"sequence length {t} is longer than block_size {self.block_size}: use sequences "
                              f"of at most {self.block_size} tokens or a GPTConfig with block_size >= {t}")
        return self.drop(self.wte(idx) + self.wpe(self.positions(t, idx.device)))  # (B, T, C)

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """The positions of the ``t`` tokens this layer embeds: 0 to t - 1 (a runtime that splits the sequence
        gives a rank's share its positions in the whole)."""
        return torch.arange(t, device=device)  # (T,)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions.

    ``c_attn`` computes q, k and v of every head at once, head by head: its output features are ordered (head,
    q/k/v, feature). So a contiguous share of them (a column-parallel split over tensor-parallel ranks) holds
    whole heads, each with its q, k and v, and the forward reads the number of heads from the width it gets.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_size = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # (head, q/k/v, feature) for all heads
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of (B, heads, T, hs) queries, keys and values (a runtime that splits the sequence
        attends over the whole of it instead)."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.c_attn(x)  # (B, T, 3 * nh * hs): nh = every head, or this rank's share of them
        nh = qkv.size(-1) // (3 * self.head_size)
        qkv = qkv.view(B, T, nh, 3, self.head_size).permute(3, 0, 2, 1, 4)  # (3, B, nh, T, hs)
        q, k, v = qkv[0], qkv[1], qkv[2]
        y = self.attend(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, nh * self.head_size)  # (B, T, nh * hs): heads side by side again
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> GELU -> C."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Layers 1..N: a pre-LayerNorm transformer block, attention then MLP, each added to the residual stream."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class Head(nn.Module):
    """Layer N+1: final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        # Not tied to the token embedding (unlike nanoGPT): the two usually sit on different pipeline
        # stages, and tying them would need a gradient all-reduce between those stages.
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def _make_layer(cfg: GPTConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(cfg)
    if index == cfg.num_layers - 1:
        return Head(cfg)
    return Block(cfg)


@torch.no_grad()
def _init_layer(cfg: GPTConfig, layer: nn.Module, gen: torch.Generator) -> None:
    """nanoGPT's init: N(0, 0.02) weights, zero biases, unit LayerNorms, residual projections scaled down."""
    # Each block adds two projections into the residual stream; 1/sqrt(2 * n_layer) keeps the stream's
    # variance from growing with depth (GPT-2 paper, section 2.3).
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, module in layer.named_modules():  # a fixed order, so the draws are reproducible
        if isinstance(module, nn.Linear):
            normal_(module.weight, residual_std if name.endswith("c_proj") else 0.02, gen)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            normal_(module.weight, 0.02, gen)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            if module.bias is not None:
                module.bias.zero_()


def build_gpt_layers(cfg: GPTConfig, indices: Iterable[int], *, seed: int = 0,
                     device: str | torch.device = "cpu") -> dict[int, nn.Module]:
    """Build only the layers at ``indices`` (0 = embedding, 1..N = blocks, N+1 = head), on ``device``.

    Layer i gets the same initial weights as ``build_gpt(cfg, seed=seed)[i]``, so a pipeline rank
    can build just its own stages.
    """
    layout = f"0 = embedding, 1..{cfg.n_layer} = blocks, {cfg.n_layer + 1} = head"
    return materialize(indices, cfg.num_layers, layout, lambda i: _make_layer(cfg, i),
                       lambda layer, i, gen: _init_layer(cfg, layer, gen), tag="gpt", seed=seed, device=device)


def build_gpt(cfg: GPTConfig, *, seed: int = 0) -> list[nn.Module]:
    """The whole GPT as a flat list of layers on the CPU; apply them in order to map (B, T) ids to (B, T, V) logits."""
    layers = build_gpt_layers(cfg, range(cfg.num_layers), seed=seed)
    return [layers[i] for i in range(cfg.num_layers)]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of (B, T, V) logits against (B, T) next-token targets."""
    if targets.shape != logits.shape[:-1]:
        want = tuple(logits.shape[:-1])
        raise ConfigError(f"the targets have shape {tuple(targets.shape)} but the logits are {tuple(logits.shape)}; "
                          f"give one target token per position, shape {want}")
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))  # over B*T positions


class CorpusDecoder(Model):
    """A decoder of the byte-level corpus as a :class:`~pipefold.models.base.Model`: an embedding, blocks and a head
    (``cfg.num_layers`` of them), next-byte cross entropy and the corpus's batches. The gpt and moe models."""

    embedding_layers = 1
    head_layers = 1

    def __init__(self, cfg: Any, batches: Batches, *, seed: int = 0) -> None:
        self.cfg, self.batches, self.seed = cfg, batches, seed
        self.num_layers = cfg.num_layers
        self.seq = batches.seq

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return gpt_loss(out, target)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches.batch_at(step)


def corpus_sizes(args: ModelArgs, name: str, sized_by: str) -> tuple[int, int, int, Batches]:
    """A corpus decoder's width, heads and vocabulary from the user's settings, and its batches; refused in one line
    where they do not fit (``sized_by``: the options that size the model ``name``)."""
    if args.config is not None:
        raise ConfigError(f"the {name} is sized by {sized_by}: --hf-config configures a Hugging Face model (--hf NAME)")
    hidden, heads = args.hidden or 64, args.heads or 4
    if hidden % heads:
        raise ConfigError(f"--hidden {hidden} must be a multiple of --heads {heads}: each head gets an equal share")
    if args.vocab_size is not None and args.vocab_size < 256:
        raise ConfigError(f"the {name} reads its corpus as bytes (ids 0..255), which --vocab-size {args.vocab_size} "
                          "cannot hold: give --vocab-size 256 or more")
    batches = Batches(load_corpus(args.data).train, args.batch, args.seq, seed=args.seed)
    return hidden, heads, args.vocab_size or 256, batches


class GPT(CorpusDecoder):
    """The GPT as a :class:`~pipefold.models.base.Model`: its layers, its loss, and byte-level batches of a corpus."""

    name = "gpt"
    splits_embedding = True
    cfg: GPTConfig

    def build_layers(self, indices: Iterable[int], *, device: str | torch.device = "cpu") -> dict[int, nn.Module]:
        return build_gpt_layers(self.cfg, indices, seed=self.seed, device=device)

    def tp_plan(self, index: int) -> dict[str, str]:
        # Megatron's split of a block: each rank whole heads (q, k and v of each) and its share of the MLP's
        # inner width; one all-reduce after each half. The embedding and the head stay whole on every rank.
        if index in self.blocks:
            return {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
        return {}

    def tp_widths(self) -> dict[str, int]:
        return {"--heads": self.cfg.n_head}

    def sequence_plan(self, index: int) -> dict[str, str]:
        # A block's two LayerNorms, and with them its residual stream and dropouts, on each rank's tokens.
        return {"ln_1": "sequence", "ln_2": "sequence"} if index in self.blocks else {}

    def sequence_length(self) -> int | None:
        return self.batches.seq

    def check_split_output(self) -> None:
        """The head's projection is its own (not tied to the embedding): it splits."""

    def split_output(self, layer: nn.Module) -> tuple[str, torch.Tensor]:
        if not isinstance(layer, Head):
            raise ConfigError(f"the GPT's output projection is in its last layer, the head (got "
                              f"{type(layer).__name__})")
        weight = layer.lm_head.weight
        layer.lm_head = nn.Identity()  # type: ignore[assignment]
        return "lm_head.weight", weight

    def split_input(self, layer: nn.Module) -> tuple[str, torch.Tensor, int | None]:
        if not isinstance(layer, Embedding):
            raise ConfigError(f"the GPT's token embedding is in its first layer, the embedding (got "
                              f"{type(layer).__name__})")
        weight = layer.wte.weight
        layer.wte = nn.Identity()  # type: ignore[assignment]  # the layer adds the positions to what it is given
        return "wte.weight", weight, None

    def check_sequence_chunks(self, chunks: int) -> None:
        check_sequence_split(f"seq_chunks {chunks}", f"cuts each sequence into {chunks} equal chunks", chunks,
                             self.batches.seq)
        if self.cfg.dropout:
            raise ConfigError("sequence chunks attend block by block, without attention dropout: use a GPTConfig "
                              "with dropout 0 with seq_chunks")

    def check_context_parallel(self, cp: int) -> None:
        check_sequence_split(f"--cp {cp}", f"splits each sequence into {2 * cp} equal chunks (two a rank, for the "
                             "causal balance)", 2 * cp, self.batches.seq)
        if self.cfg.dropout:
            raise ConfigError("context parallelism's ring attention has no attention dropout: use a GPTConfig with "
                              "dropout 0 with --cp")

    def size(self) -> Shape:
        return Shape(model="gpt", layers=self.cfg.n_layer, hidden=self.cfg.n_embd, heads=self.cfg.n_head,
                     batch=self.batches.batch, seq=self.batches.seq, vocab=self.cfg.vocab_size)


def make(args: ModelArgs) -> GPT:
    hidden, heads, vocab, batches = corpus_sizes(args, "gpt", "--layers, --hidden, --heads and --seq")
    cfg = GPTConfig(n_layer=args.layers or 4, n_embd=hidden, n_head=heads, block_size=args.seq, vocab_size=vocab)
    return GPT(cfg, batches, seed=args.seed)


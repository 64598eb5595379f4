"""A decoder-only transformer's arithmetic from its config, before anything is built: parameters, floating-point
operations and activation bytes, layer by layer. This is what the cluster planner (:mod:`pipefold.plan.cluster`)
knows of a model it will never build here.

A :class:`Transformer` comes from a Hugging Face ``config.json`` (LLaMA and the families laid out like it:
Mistral, Qwen2, and Mixtral's experts; GPT-2, whose config gives GPT sizes). Its layers are pipefold's: an
embedding, the blocks, a head (final norm and the vocabulary projection).

**Parameters.** A block has attention's q and o projections (h x h), k and v (h x kv heads x head width), the
MLP's two matrices of h x f (GPT-2) or three (gated: gate, up, down), each of E experts' and a router of h x E
(MoE), and two norms (LayerNorm: weight and bias; RMSNorm: weight). GPT-2 has biases on every projection and
learned positions; its head is tied to the embedding.

**Operations** (per token; the convention of Megatron-LM's and torchtitan's MFU, and what torch's
``FlopCounterMode`` counts): 2 per weight of a matrix in the forward (F), as many for the gradient of its input
(B) and as many for its own gradient (W); attention's scores and weighted sums 4 x s x h in F over the whole
s x s square (causal or not), 8 x s x h in B, none in W. An MoE block runs the router and top-k experts per
token. Norms, activations and the softmax count nothing.

**Activation bytes** (per token and block, in the activations' dtype, ``a`` bytes a value): what the backward
reads, tensor by tensor, for a block without dropout (LLaMA) and with it (GPT-2), split into what every
tensor-parallel rank keeps whole and what the split divides (:class:`Saved`). Attention kept as
``flash`` (q, k, v, its output and the softmax's log-sum-exp per head: no s x s term) or ``eager`` (the s x s
probabilities and, with dropout, their mask). Recomputation: ``selective`` drops attention's s x s part
(recomputed from q, k and v, which stay: Korthikanti et al. 2022; with flash attention there is nothing more to
drop), ``full`` keeps the block's input only. Checked against the tensors a ``transformers`` LLaMA block saves
(``tests/test_cluster.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pipefold.errors import ConfigError
from pipefold.files import read_shipped_or_file, shipped_names

__all__ = ["RECOMPUTE", "Saved", "Transformer", "from_hf_config", "shipped_configs", "shipped_folder"]

RECOMPUTE = ("none", "selective", "full")
"""What a block recomputes in its backward: nothing, attention's core, everything but its input."""

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "mixtral")


@dataclass(frozen=True)
class Saved:
    """Bytes per token a block keeps for its backward: ``whole`` on every tensor-parallel rank, ``split`` divided
    among them (and, with sequence parallelism, ``whole`` too)."""

    whole: float
    split: float

    def per_rank(self, tp: int, *, sequence_parallel: bool = False) -> float:
        return (self.whole / tp if sequence_parallel else self.whole) + self.split / tp


@dataclass(frozen=True, kw_only=True)
class Transformer:
    """A decoder-only transformer's sizes (see the module's docstring for what each counts)."""

    name: str
    family: str
    """``llama`` (gated MLP, RMSNorm, rotary positions, no biases) or ``gpt2`` (GeLU MLP, LayerNorm, learned
    positions, biases, tied head)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    positions: int = 0
    """Learned position embeddings (GPT-2); 0 for rotary ones."""
    experts: int = 1
    top_k: int = 1
    tied: bool = False
    dropout: bool = False
    value_bytes: int = 2
    """Bytes of an activation value: 2 for bf16/fp16 training."""
    source: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k", "value_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{self.name}: {name} must be a whole number >= 1 (got {value!r})")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(f"{self.name}: {self.heads} heads do not split width {self.hidden} (or "
                              f"{self.kv_heads} key-value heads the heads) evenly")
        if self.top_k > self.experts:
            raise ConfigError(f"{self.name}: {self.top_k} experts per token of {self.experts}")

    # -- sizes

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def gated(self) -> bool:
        return self.family == "llama"

    @property
    def _attention_weights(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv

    @property
    def _expert_weights(self) -> int:
        return (3 if self.gated else 2) * self.hidden * self.ffn

    def block_parameters(self) -> int:
        """Parameters of one block."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        router = self.hidden * self.experts if self.experts > 1 else 0
        params = self._attention_weights + self.experts * self._expert_weights + router
        if self.family == "gpt2":
            params += 2 * h + 2 * kv + self.ffn + h  # biases: q, o; k, v; fc; proj
            params += 4 * h  # two LayerNorms, weight and bias
        else:
            params += 2 * h  # two RMSNorms
        return params

    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    def head_parameters(self) -> int:
        """The final norm, and the vocabulary projection unless it is the embedding's (tied)."""
        norm = 2 * self.hidden if self.family == "gpt2" else self.hidden
        return norm + (0 if self.tied else self.vocab * self.hidden)

    def parameters(self) -> int:
        """Every parameter, each shared one once."""
        return self.embedding_parameters() + self.layers * self.block_parameters() + self.head_parameters()

    def active_parameters(self) -> int:
        """Parameters a token computes with (MoE: top-k experts of each block)."""
        idle = (self.experts - self.top_k) * self._expert_weights * self.layers
        return self.parameters() - idle

    # -- operations per token

    def block_flops(self, seq: int) -> tuple[float, float, float]:
        """(F, B, W) floating-point operations of one block per token, at sequence length ``seq``."""
        router = self.hidden * self.experts if self.experts > 1 else 0
        matmul = 2.0 * (self._attention_weights + self.top_k * self._expert_weights + router)
        scores = 4.0 * seq * self.hidden
        return matmul + scores, matmul + 2 * scores, matmul

    def head_flops(self) -> tuple[float, float, float]:
        """(F, B, W) of the head per token: the vocabulary projection."""
        proj = 2.0 * self.hidden * self.vocab
        return proj, proj, proj

    def model_flops(self, seq: int) -> float:
        """F + B + W of the whole model per token: what MFU counts (no recomputation)."""
        return self.layers * sum(self.block_flops(seq)) + sum(self.head_flops())

    # -- activations

    def saved(self, seq: int, *, attention: str = "flash", recompute: str = "none") -> Saved:
        """Bytes per token one block keeps for its backward (see the module's docstring)."""
        if recompute not in RECOMPUTE:
            raise ConfigError(f"recompute is one of {', '.join(RECOMPUTE)} (got {recompute!r})")
        a, h, f = self.value_bytes, self.hidden, self.ffn
        kv = self.kv_heads * self.head_dim
        if recompute == "full":
            return Saved(whole=a * h, split=0.0)  # the block's input
        # Each norm keeps its input, the input normalised (its weight's gradient reads it), its output (the next
        # matrices' input) and one float32 per token (1 / rms, or LayerNorm's statistics).
        whole = 2 * (3 * a * h + 4)
        if self.dropout:
            whole += 2 * (1 + a) * h  # attention's and the MLP's output dropout: mask and output
        core = 0.0
        if recompute == "none":
            if attention == "flash":
                # q, k, v as the kernel reads them (rotated), its output (the o projection's input) and the
                # softmax's float32 log-sum-exp per head.
                core = a * (2 * h + 2 * kv) + 4 * self.heads
            elif attention == "eager":
                # q, k and v with the key-value heads repeated for every head, the s x s probabilities (a row
                # per head per token), the output.
                core = 4 * a * h + a * self.heads * seq
                if self.dropout:
                    core += self.heads * seq * (1 + a)  # the probabilities' dropout: mask and output
            else:
                raise ConfigError(f"attention is 'flash' or 'eager' (got {attention!r})")
        else:  # selective: the core's s x s part is recomputed from q, k, v, which stay (Korthikanti et al.)
            core = a * (2 * h + 2 * kv)
        mlp = 4 * a * f if self.gated else 2 * a * f  # gate, SiLU, up, their product / GeLU's input and output
        return Saved(whole=whole, split=core + self.top_k * mlp)

    def message_bytes(self, tokens: int) -> float:
        """Bytes between two stages for ``tokens`` tokens: the residual stream."""
        return float(self.value_bytes * self.hidden * tokens)

    def head_saved(self) -> float:
        """Bytes per token the head keeps: its input, the logits and their float32 copy for the loss."""
        return self.value_bytes * self.hidden + (self.value_bytes + 4) * self.vocab

    def head_peak(self) -> float:
        """Bytes per token the head holds at its peak, as the loss is computed in float32: its input, the logits,
        their float32 copy and the float32 log-softmax the loss keeps, all at once (torch's profiler measures it:
        ``tests/test_cluster.py``)."""
        return self.value_bytes * self.hidden + (self.value_bytes + 8) * self.vocab

    def describe(self) -> str:
        moe = f", {self.experts} experts (top {self.top_k})" if self.experts > 1 else ""
        return (f"{self.name}: {self.parameters() / 1e9:.2f}B parameters, {self.layers} blocks of width "
                f"{self.hidden}, {self.heads} heads ({self.kv_heads} key-value), MLP {self.ffn}{moe}, vocabulary "
                f"{self.vocab}")


def shipped_folder() -> Any:
    """The folder of configs this package ships."""
    return resources.files("pipefold.models").joinpath("hf_configs")


def shipped_configs() -> list[str]:
    """The configs this package ships (``--hf-config NAME``)."""
    return shipped_names(shipped_folder())


def from_hf_config(given: str) -> Transformer:
    """The transformer a Hugging Face config describes: a shipped config's name or a ``config.json`` path."""
    config, where = read_shipped_or_file(given, shipped_folder(), flag="--hf-config", what="config",
                                         hint="give a transformers config.json")
    if not isinstance(config, dict):
        raise ConfigError(f"{where} is not a JSON object: give a transformers config.json")
    name = given if given in shipped_configs() else Path(given).stem
    kind = config.get("model_type")

    def size(*keys: str, default: Any = None) -> Any:
        for key in keys:
            if config.get(key) is not None:
                return config[key]
        if default is None:
            raise ConfigError(f"{where} has no {keys[0]}: a {kind} config.json has it")
        return default

    if kind in _LLAMA_LIKE:
        heads = size("num_attention_heads")
        out = dict(family="llama", layers=size("num_hidden_layers"), hidden=size("hidden_size"), heads=heads,
                   kv_heads=size("num_key_value_heads", default=heads), ffn=size("intermediate_size"),
                   vocab=size("vocab_size"), tied=bool(config.get("tie_word_embeddings", False)),
                   experts=size("num_local_experts", default=1), top_k=size("num_experts_per_tok", default=1))
    elif kind == "gpt2":
        hidden = size("n_embd", "hidden_size")
        out = dict(family="gpt2", layers=size("n_layer", "num_hidden_layers"), hidden=hidden,
                   heads=size("n_head", "num_attention_heads"), kv_heads=size("n_head", "num_attention_heads"),
                   ffn=size("n_inner", default=4 * hidden), vocab=size("vocab_size"),
                   positions=size("n_positions", default=1024), tied=True, dropout=True)
    else:
        raise ConfigError(f"{where} is a {kind!r} model; the planner reads {', '.join((*_LLAMA_LIKE, 'gpt2'))} "
                          "configs")
    try:
        return Transformer(name=name, source=config, **out)
    except TypeError as err:  # a size of the wrong type
        raise ConfigError(f"{where}: {err}") from None

"""A decoder-only transformer's arithmetic from its config, before anything is built: parameters, floating-point
operations and activation bytes, layer by layer. This is what the cluster planner (:mod:`pipefold.plan.cluster`)
knows of a model it will never build here.

A :class:`Transformer` comes from a Hugging Face ``config.json`` (LLaMA and the families laid out like it:
Mistral, Qwen2, and Mixtral's experts; DeepSeek-V3; GPT-2, whose config gives GPT sizes). Its layers are
pipefold's: an embedding, the blocks, a head (final norm and the vocabulary projection).

**Parameters.** A block has attention's q and o projections (h x h), k and v (h x kv heads x head width), the
MLP's two matrices of h x f (GPT-2) or three (gated: gate, up, down), and two norms (LayerNorm: weight and bias;
RMSNorm: weight). GPT-2 has biases on every projection and learned positions; its head is tied to the embedding.
A mixture-of-experts block (MoE) has, in place of the MLP, E routed experts of inner width f_e (each three
matrices of h x f_e), a router of h x E, and shared experts every token runs (DeepSeek's: three matrices of
h x f_e each); its first ``dense_layers`` blocks keep a dense MLP of width f (DeepSeek's
``first_k_dense_replace``). Multi-head latent attention (MLA, DeepSeek-V2 and V3) replaces q, k, v and o by
its down- and up-projections: queries h x r_q then r_q x (heads x (d_nope + d_rope)) (or h x that directly
without ``q_lora_rank``), keys and values h x (r_kv + d_rope) then r_kv x (heads x (d_nope + d_v)), the output
(heads x d_v) x h, and an RMSNorm on each latent.

**Operations** (per token; the convention of Megatron-LM's and torchtitan's MFU, and what torch's
``FlopCounterMode`` counts): 2 per weight of a matrix in the forward (F), as many for the gradient of its input
(B) and as many for its own gradient (W); attention's scores and weighted sums 2 x s x heads x (d_qk + d_v) in F
(4 x s x h where both are the head width) over the whole s x s square (causal or not), twice that in B, none in
W. An MoE block runs the router, the shared experts and the top-k routed experts per token. MLA's projections are
matrix products of the shapes above, costed as such (training runs the up-projections per token; nothing is
absorbed). Norms, activations, the softmax and the router's top-k count nothing.

**Activation bytes** (per token and block, in the activations' dtype, ``a`` bytes a value): what the backward
reads, tensor by tensor, for a block without dropout (LLaMA) and with it (GPT-2), split into what every
tensor-parallel rank keeps whole and what the split divides (:class:`Saved`). Attention kept as
``flash`` (q, k, v, its output and the softmax's log-sum-exp per head: no s x s term) or ``eager`` (the s x s
probabilities and, with dropout, their mask). Recomputation: ``selective`` drops attention's s x s part
(recomputed from q, k and v, which stay: Korthikanti et al. 2022; with flash attention there is nothing more to
drop), ``full`` keeps the block's input only. Checked against the tensors a ``transformers`` LLaMA block saves
(``tests/test_cluster.py``). An MoE block keeps, for each of a token's top-k copies, the copy dispatched to its
expert and the expert's output (weighted by the router), its expert's four tensors of f_e, the shared experts'
four each, and the router's float32 probabilities; MLA keeps each latent's norm as a norm's three tensors and q,
k, v and the output at their per-head widths. These are estimates, not checked against ``transformers``'
implementations, which differ in what their routing saves.
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
_DEEPSEEK = ("deepseek_v3", "deepseek_v2")


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
    """Routed experts of each MoE block; 1: a dense model."""
    top_k: int = 1
    """Routed experts each token goes to."""
    expert_ffn: int = 0
    """Inner width of each routed (and shared) expert; 0: ``ffn`` (Mixtral's experts are its MLP's width)."""
    shared_experts: int = 0
    """Experts every token runs beside its top-k (DeepSeek's shared experts), each of ``expert_ffn``."""
    dense_layers: int = 0
    """The first blocks of an MoE model whose MLP is dense, of width ``ffn`` (DeepSeek's first_k_dense_replace)."""
    q_lora_rank: int = 0
    """MLA: the queries' latent width (0: queries projected directly)."""
    kv_lora_rank: int = 0
    """MLA where > 0: the keys' and values' latent width."""
    qk_rope_dim: int = 0
    """MLA: the rotary part of each head's query and key."""
    qk_nope_dim: int = 0
    """MLA: the part of each head's query and key without rotary positions."""
    v_head_dim: int = 0
    """MLA: each head's value width."""
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
        for name in ("expert_ffn", "shared_experts", "dense_layers", "q_lora_rank", "kv_lora_rank", "qk_rope_dim",
                     "qk_nope_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{self.name}: {name} must be a whole number >= 0 (got {value!r})")
        if self.experts == 1 and (self.shared_experts or self.dense_layers or self.expert_ffn):
            raise ConfigError(f"{self.name}: shared experts, dense layers and an expert width describe a model with "
                              "routed experts: give experts > 1")
        if self.dense_layers > self.layers:
            raise ConfigError(f"{self.name}: {self.dense_layers} dense layers of {self.layers}")
        if self.kv_lora_rank and (self.qk_nope_dim < 1 or self.v_head_dim < 1):
            raise ConfigError(f"{self.name}: latent attention (kv_lora_rank {self.kv_lora_rank}) needs "
                              "qk_nope_head_dim and v_head_dim >= 1")
        if not self.kv_lora_rank and (self.q_lora_rank or self.qk_rope_dim or self.qk_nope_dim or self.v_head_dim):
            raise ConfigError(f"{self.name}: q_lora_rank and the head widths describe latent attention: give "
                              "kv_lora_rank > 0")

    # -- sizes

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def gated(self) -> bool:
        return self.family == "llama"

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek's MLA)."""
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        """Whether some blocks route tokens to experts."""
        return self.experts > 1

    @property
    def moe_blocks(self) -> int:
        """Blocks with experts: all but the first ``dense_layers`` of an MoE model, none of a dense one."""
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def dense_blocks(self) -> int:
        return self.layers - self.moe_blocks

    @property
    def moe_ffn(self) -> int:
        """Inner width of one expert."""
        return self.expert_ffn or self.ffn

    @property
    def qk_dim(self) -> int:
        """Width of one head's query and key."""
        return self.qk_nope_dim + self.qk_rope_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of one head's value."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def k_width(self) -> int:
        """Keys per token as attention reads them: every head's with MLA, the key-value heads' otherwise."""
        return self.heads * self.qk_dim if self.mla else self.kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        return self.heads * self.v_dim if self.mla else self.kv_heads * self.head_dim

    @property
    def _attention_weights(self) -> int:
        """Weights of attention's matrices (q, k, v, o; MLA's down- and up-projections)."""
        h = self.hidden
        if self.mla:
            q_out = self.heads * self.qk_dim
            q = h * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else h * q_out
            kv = (h * (self.kv_lora_rank + self.qk_rope_dim)
                  + self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim))
            return q + kv + self.heads * self.v_head_dim * h
        kv = self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv

    @property
    def _mlp_weights(self) -> int:
        """Weights of a dense block's MLP."""
        return (3 if self.gated else 2) * self.hidden * self.ffn

    @property
    def _expert_weights(self) -> int:
        """Weights of one expert (routed or shared)."""
        return (3 if self.gated else 2) * self.hidden * self.moe_ffn

    @property
    def _router_weights(self) -> int:
        return self.hidden * self.experts if self.moe else 0

    def expert_parameters(self) -> int:
        """Parameters of one MoE block's routed experts (what expert parallelism spreads); 0 for a dense model."""
        return self.experts * self._expert_weights if self.moe else 0

    def largest_matrix(self) -> int:
        """Weights of the largest matrix of an MoE block besides its routed experts: attention's projections, the
        shared experts', the router (what the planner takes the matrix-product efficiency of that work from)."""
        h = self.hidden
        if self.mla:
            attention = [h * (self.q_lora_rank or self.heads * self.qk_dim), h * (self.kv_lora_rank + self.qk_rope_dim),
                         self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim),
                         self.heads * self.v_head_dim * h]
            if self.q_lora_rank:
                attention.append(self.q_lora_rank * self.heads * self.qk_dim)
        else:
            attention = [h * h, h * self.kv_heads * self.head_dim]
        shared = [h * self.moe_ffn] if self.shared_experts else []
        return max(*attention, *shared, self._router_weights)

    def block_parameters(self, dense: bool = False) -> int:
        """Parameters of one block: an MoE block where the model has experts, unless ``dense`` (its first
        ``dense_layers``)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        if self.moe and not dense:
            mlp = self.expert_parameters() + self.shared_experts * self._expert_weights + self._router_weights
        else:
            mlp = self._mlp_weights
        params = self._attention_weights + mlp
        if self.family == "gpt2":
            params += 2 * h + 2 * kv + self.ffn + h  # biases: q, o; k, v; fc; proj
            params += 4 * h  # two LayerNorms, weight and bias
        else:
            params += 2 * h + self.q_lora_rank + self.kv_lora_rank  # two RMSNorms (and MLA's two latents')
        return params

    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    def head_parameters(self) -> int:
        """The final norm, and the vocabulary projection unless it is the embedding's (tied)."""
        norm = 2 * self.hidden if self.family == "gpt2" else self.hidden
        return norm + (0 if self.tied else self.vocab * self.hidden)

    def parameters(self) -> int:
        """Every parameter, each shared one once."""
        return (self.embedding_parameters() + self.dense_blocks * self.block_parameters(dense=True)
                + self.moe_blocks * self.block_parameters() + self.head_parameters())

    def active_parameters(self) -> int:
        """Parameters a token computes with (MoE: top-k experts of each block)."""
        idle = (self.experts - self.top_k) * self._expert_weights * self.moe_blocks
        return self.parameters() - idle

    # -- operations per token

    def block_flops(self, seq: int, dense: bool = False) -> tuple[float, float, float]:
        """(F, B, W) floating-point operations of one block per token, at sequence length ``seq`` (an MoE block
        where the model has experts, unless ``dense``)."""
        if self.moe and not dense:
            mlp = self._router_weights + (self.top_k + self.shared_experts) * self._expert_weights
        else:
            mlp = self._mlp_weights
        matmul = 2.0 * (self._attention_weights + mlp)
        scores = 2.0 * seq * self.heads * (self.qk_dim + self.v_dim)
        return matmul + scores, matmul + 2 * scores, matmul

    def routed_flops(self) -> float:
        """Operations per token of an MoE block's routed experts in each of F, B and W (part of
        :meth:`block_flops`): its top-k experts' matrices; 0 for a dense model."""
        return 2.0 * self.top_k * self._expert_weights if self.moe else 0.0

    def head_flops(self) -> tuple[float, float, float]:
        """(F, B, W) of the head per token: the vocabulary projection."""
        proj = 2.0 * self.hidden * self.vocab
        return proj, proj, proj

    def model_flops(self, seq: int) -> float:
        """F + B + W of the whole model per token: what MFU counts (no recomputation)."""
        return (self.dense_blocks * sum(self.block_flops(seq, dense=True))
                + self.moe_blocks * sum(self.block_flops(seq)) + sum(self.head_flops()))

    # -- activations

    def saved(self, seq: int, *, attention: str = "flash", recompute: str = "none", dense: bool = False) -> Saved:
        """Bytes per token one block keeps for its backward (see the module's docstring): an MoE block where the
        model has experts, unless ``dense``."""
        if recompute not in RECOMPUTE:
            raise ConfigError(f"recompute is one of {', '.join(RECOMPUTE)} (got {recompute!r})")
        a, h = self.value_bytes, self.hidden
        if recompute == "full":
            return Saved(whole=a * h, split=0.0)  # the block's input
        # Each norm keeps its input, the input normalised (its weight's gradient reads it), its output (the next
        # matrices' input) and one float32 per token (1 / rms, or LayerNorm's statistics).
        whole: float = 2 * (3 * a * h + 4)
        if self.dropout:
            whole += 2 * (1 + a) * h  # attention's and the MLP's output dropout: mask and output
        if self.mla:  # each latent's norm, like the block's (the down-projections are whole on every tp rank)
            whole += sum(3 * a * r + 4 for r in (self.q_lora_rank, self.kv_lora_rank) if r)
        q, out = self.heads * self.qk_dim, self.heads * self.v_dim  # both h without MLA
        core = 0.0
        if recompute == "none":
            if attention == "flash":
                # q, k, v as the kernel reads them (rotated), its output (the o projection's input) and the
                # softmax's float32 log-sum-exp per head.
                core = a * (q + self.k_width + self.v_width + out) + 4 * self.heads
            elif attention == "eager":
                # q, k and v with the key-value heads repeated for every head, the s x s probabilities (a row
                # per head per token), the output.
                core = a * (2 * q + 2 * out) + a * self.heads * seq
                if self.dropout:
                    core += self.heads * seq * (1 + a)  # the probabilities' dropout: mask and output
            else:
                raise ConfigError(f"attention is 'flash' or 'eager' (got {attention!r})")
        else:  # selective: the core's s x s part is recomputed from q, k, v, which stay (Korthikanti et al.)
            core = a * (q + self.k_width + self.v_width + out)

        def mlp(f: int) -> int:
            return 4 * a * f if self.gated else 2 * a * f  # gate, SiLU, up, their product / GeLU's input and output

        if self.moe and not dense:
            # The routed copies (routed_saved); the shared experts' tensors; the router's float32 probabilities.
            routed = self.routed_saved()
            whole += routed.whole + 4 * self.experts
            split = routed.split + self.shared_experts * mlp(self.moe_ffn)
        else:
            split = mlp(self.ffn)
        return Saved(whole=whole, split=core + split)

    def routed_saved(self) -> Saved:
        """Of an MoE block's :meth:`saved` bytes per token, what its top-k routed copies keep: each copy as
        dispatched to its expert and the expert's output (which the router's weight multiplies), whole on every
        tensor-parallel rank; the expert's four tensors of f_e (gated; GeLU's two), split. None without experts."""
        if not self.moe:
            return Saved(whole=0.0, split=0.0)
        a, f = self.value_bytes, self.moe_ffn
        return Saved(whole=2 * a * self.hidden * self.top_k, split=self.top_k * (4 if self.gated else 2) * a * f)

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
        moe = ""
        if self.moe:
            shared = f" and {self.shared_experts} shared" if self.shared_experts else ""
            dense = f" after {self.dense_layers} dense" if self.dense_layers else ""
            moe = (f", {self.experts} experts of {self.moe_ffn}{shared} (top {self.top_k}) in {self.moe_blocks} "
                   f"blocks{dense}, {self.active_parameters() / 1e9:.2f}B active")
        attention = (f"{self.heads} heads, latent attention ({self.kv_lora_rank} key-value, {self.q_lora_rank} query)"
                     if self.mla else f"{self.heads} heads ({self.kv_heads} key-value)")
        return (f"{self.name}: {self.parameters() / 1e9:.2f}B parameters, {self.layers} blocks of width "
                f"{self.hidden}, {attention}, MLP {self.ffn}{moe}, vocabulary {self.vocab}")


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
    elif kind in _DEEPSEEK:
        heads = size("num_attention_heads")
        if config.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"{where}: moe_layer_freq {config['moe_layer_freq']}: the planner costs an expert "
                              "layer after every dense one (moe_layer_freq 1)")
        experts = size("n_routed_experts", default=1)
        out = dict(family="llama", layers=size("num_hidden_layers"), hidden=size("hidden_size"), heads=heads,
                   kv_heads=size("num_key_value_heads", default=heads), ffn=size("intermediate_size"),
                   vocab=size("vocab_size"), tied=bool(config.get("tie_word_embeddings", False)),
                   experts=experts, top_k=size("num_experts_per_tok", default=1) if experts > 1 else 1,
                   expert_ffn=size("moe_intermediate_size") if experts > 1 else 0,
                   shared_experts=size("n_shared_experts", default=0) if experts > 1 else 0,
                   dense_layers=size("first_k_dense_replace", default=0) if experts > 1 else 0,
                   q_lora_rank=size("q_lora_rank", default=0), kv_lora_rank=size("kv_lora_rank"),
                   qk_rope_dim=size("qk_rope_head_dim"), qk_nope_dim=size("qk_nope_head_dim"),
                   v_head_dim=size("v_head_dim"))
    elif kind == "gpt2":
        hidden = size("n_embd", "hidden_size")
        out = dict(family="gpt2", layers=size("n_layer", "num_hidden_layers"), hidden=hidden,
                   heads=size("n_head", "num_attention_heads"), kv_heads=size("n_head", "num_attention_heads"),
                   ffn=size("n_inner", default=4 * hidden), vocab=size("vocab_size"),
                   positions=size("n_positions", default=1024), tied=True, dropout=True)
    else:
        raise ConfigError(f"{where} is a {kind!r} model; the planner reads "
                          f"{', '.join((*_LLAMA_LIKE, *_DEEPSEEK, 'gpt2'))} configs")
    try:
        return Transformer(name=name, source=config, **out)
    except TypeError as err:  # a size of the wrong type
        raise ConfigError(f"{where}: {err}") from None

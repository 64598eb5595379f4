"""Hugging Face ``transformers`` causal LMs, unchanged, as pipeline layers: GPT-2 and LLaMA built from a config.

The model is the ``transformers`` object as its own class builds it (``AutoModelForCausalLM.from_config``, no
download). Its parts are found on it and wrapped, without touching its code::

    layer 0          HFEmbedding   the token embedding (GPT-2: + learned positions, dropout)
    layers 1..N      HFBlock       one block of ``transformer.h`` / ``model.layers`` each, called as the model
                                   calls it: the causal (and padding) mask from the model's own mask function,
                                   LLaMA's rotary position embeddings from the model's own ``rotary_emb``
    layer N+1        HFHead        the final norm and ``lm_head``

A batch's inputs are the token ids, or (token ids, attention mask) with 1 for real tokens and 0 for padding;
the mask travels with the activations from stage to stage. Sequence lengths may change from step to step.

Every part is built on its own: the model is made on the meta device and only the wanted parts get memory, each
module's initial weights drawn by the model's own ``_init_weights`` from a stream seeded by (seed, module name).
A pipeline rank so builds only its own layers and matches the whole model built in one process. A weight two
parts share (GPT-2's ``lm_head`` is its ``wte``; LLaMA's with ``tie_word_embeddings``) stays one parameter in a
whole model and is listed in :attr:`HFCausalLM.tied`; split across stages, each stage holds a copy and the
runtime sums their gradients (:mod:`pipefold.runtime.tied`).

Needs ``pip install 'pipefold[hf]'``; ``pipefold.models`` registers the names without it, and making one
without it says so.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipefold.errors import ConfigError
from pipefold.files import read_shipped_or_file
from pipefold.models._build import check_indices, derive_seed
from pipefold.models.base import Model, ModelArgs, Tie, check_sequence_split
from pipefold.models.data import Batches, load_corpus
from pipefold.models.size import Shape
from pipefold.models.transformer import shipped_configs as config_names
from pipefold.models.transformer import shipped_folder

__all__ = ["ARCHS", "HFBlock", "HFCausalLM", "HFEmbedding", "HFHead", "available", "config_names", "hf_layers",
           "hf_loss", "read_config"]

IGNORE = -100
"""A target that counts for nothing in the loss (padding), as in ``transformers``."""


@dataclass(frozen=True)
class Arch:
    """Where a family's parts sit on its ``transformers`` model (attributes of ``model.base_model``)."""

    name: str
    """The config's ``model_type``."""
    default_config: str
    """The config this package ships for it, used when none is given."""
    embedding: tuple[str, ...]
    """Modules the embedding layer runs, in order: token embedding first."""
    blocks: str
    """The nn.ModuleList of blocks."""
    norm: str
    """The final norm, which the head layer runs before ``lm_head``."""
    rotary: str | None = None
    """The rotary position embedding that every block is given (LLaMA)."""


ARCHS: dict[str, Arch] = {
    "gpt2": Arch("gpt2", "gpt2-tiny", embedding=("wte", "wpe", "drop"), blocks="h", norm="ln_f"),
    "llama": Arch("llama", "llama-tiny", embedding=("embed_tokens",), blocks="layers", norm="norm",
                  rotary="rotary_emb"),
    "mixtral": Arch("mixtral", "mixtral-tiny", embedding=("embed_tokens",), blocks="layers", norm="norm",
                    rotary="rotary_emb"),
}


def available() -> bool:
    """Whether ``transformers`` can be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _require() -> None:
    if not available():
        raise ConfigError("Hugging Face models need the transformers package: pip install 'pipefold[hf]'")


# --------------------------------------------------------------------------- configs


def read_config(arch: str, given: str | None) -> dict[str, Any]:
    """The config of ``arch`` as a dict: a shipped config's name, a JSON file, or by default the arch's tiny one."""
    if arch not in ARCHS:
        raise ConfigError(f"unknown Hugging Face model {arch!r}: use one of {', '.join(ARCHS)}")
    name = given or ARCHS[arch].default_config
    config, where = read_shipped_or_file(name, shipped_folder(), flag="--hf-config", what="config",
                                         hint="give a transformers config.json")
    if not isinstance(config, dict):
        raise ConfigError(f"{where} is not a JSON object of config settings: give a transformers config.json")
    kind = config.setdefault("model_type", arch)
    if kind != arch:
        raise ConfigError(f"{where} configures a {kind!r} model, not {arch!r}: use --hf {kind} or another config")
    check_sizes(config, where)
    return config


SIZES = {"hidden": ("hidden_size", "n_embd"), "heads": ("num_attention_heads", "n_head"),
         "layers": ("num_hidden_layers", "n_layer"), "vocab": ("vocab_size",),
         "inner": ("intermediate_size", "n_inner"), "kv_heads": ("num_key_value_heads",),
         "positions": ("max_position_embeddings", "n_positions")}
"""The size settings of the configs pipefold reads (LLaMA's names, then GPT-2's)."""


def _size(config: dict[str, Any], what: str) -> tuple[str, Any] | None:
    for key in SIZES[what]:
        if key in config and config[key] is not None:
            return key, config[key]
    return None


def check_sizes(config: dict[str, Any], where: str) -> None:
    """Refuse, in one line and before ``transformers`` sees it, a config whose sizes are not whole numbers >= 1 or
    whose attention heads do not divide the width (or key-value heads the heads)."""
    found = {}
    for what in SIZES:
        got = _size(config, what)
        if got is None:
            continue
        key, value = got
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {key} must be a whole number >= 1 (got {value!r})")
        found[what] = (key, value)
    if "hidden" in found and "heads" in found and found["hidden"][1] % found["heads"][1]:
        (hk, h), (nk, n) = found["hidden"], found["heads"]
        raise ConfigError(f"{where}: {hk} {h} is not a multiple of {nk} {n}: each head gets an equal share of the "
                          f"width; use {nk} {max(d for d in range(1, n + 1) if h % d == 0)} or {hk} "
                          f"{(h // n + 1) * n}")
    if "heads" in found and "kv_heads" in found and found["heads"][1] % found["kv_heads"][1]:
        (nk, n), (kk, k) = found["heads"], found["kv_heads"]
        raise ConfigError(f"{where}: {nk} {n} is not a multiple of {kk} {k}: each key-value head serves an equal "
                          f"group of heads")


# --------------------------------------------------------------------------- the layers


def _mask_function() -> Any:
    """``transformers``' causal mask maker, and the name of its (no-)cache argument in this version."""
    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    return create_causal_mask, "cache" if "cache" in params else "past_key_values"


class HFEmbedding(nn.Module):
    """Layer 0: the token embedding, plus (GPT-2) the learned positions and the embedding dropout."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self.order = list(modules)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        tokens, *rest = (getattr(self, n) for n in self.order)
        h = tokens(ids)  # (B, T, C)
        for module in rest:
            if isinstance(module, nn.Embedding):  # learned positions 0..T-1, as the model numbers them
                h = h + module(torch.arange(ids.shape[1], device=ids.device)[None])
            else:
                h = module(h)
        return h if mask is None else (h, mask)


class HFBlock(nn.Module):
    """One of the model's blocks, called with the mask and positions the model itself would give it."""

    def __init__(self, block: nn.Module, config: Any, rotary: nn.Module | None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config = config  # the model's config: its attention implementation decides the mask's form

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of (B, heads, T, hs) queries and (B, key-value heads, T, hs) keys and values: the point a
        runtime that splits the sequence fills (context parallelism's ring, sequence chunks). Until it does, the
        block runs the model's own attention implementation, and this is not called."""
        if k.size(1) != q.size(1):
            k, v = (x.repeat_interleave(q.size(1) // x.size(1), dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """The positions of the block's ``t`` tokens, which its rotary embedding turns: 0 to t - 1 (a runtime that
        splits the sequence gives a share its positions in the whole)."""
        return torch.arange(t, device=device)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        positions = self.positions(h.shape[1], h.device)[None]  # (1, T)
        filled = "attend" in self.__dict__  # a runtime's attention instead of the class's
        if filled:
            if mask is not None:
                raise ConfigError("a padding mask does not run with a split sequence (context parallelism, sequence "
                                  "chunks): give batches without one")
            _runtime_attention(self.block)
            causal, more = None, {RUNTIME_ATTEND: self.attend}
        else:
            make_mask, cache = _mask_function()
            causal = make_mask(config=self.config, inputs_embeds=h, attention_mask=mask, position_ids=positions,
                               **{cache: None})
            more = {}
        extra = {} if self.rotary is None else {"position_embeddings": self.rotary(h, position_ids=positions)}
        out = self.block(h, attention_mask=causal, position_ids=positions, **extra, **more)
        out = out[0] if isinstance(out, tuple) else out
        return out if mask is None else (out, mask)


RUNTIME_ATTEND = "pipefold_attend"
"""The keyword under which a block hands its runtime-filled ``attend`` down to the attention function."""
_IMPLEMENTATION = "pipefold"
"""The attention implementation, in transformers' registry, that calls it."""


def _runtime_attention(block: nn.Module) -> None:
    """Make ``block``'s attention modules call the ``attend`` their block hands down (:data:`RUNTIME_ATTEND`): each
    gets a copy of the config naming pipefold's implementation, registered in transformers' registry once; the
    model's shared config is left as it is."""
    import copy

    from transformers import AttentionInterface

    if _IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(_IMPLEMENTATION, _attention)
    for sub in block.modules():
        config = getattr(sub, "config", None)
        if sub is not block and config is not None and getattr(config, "_attn_implementation", None) not in (
                None, _IMPLEMENTATION):
            mine = copy.copy(config)
            mine._attn_implementation = _IMPLEMENTATION
            sub.config = mine


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function for a block whose ``attend`` the runtime filled: its output as the
    registry's functions give it, (B, T, heads, hs)."""
    attend = kwargs.get(RUNTIME_ATTEND)
    if attend is None:
        raise RuntimeError("pipefold's attention ran without the block's attend: only HFBlock calls it")
    return attend(query, key, value).transpose(1, 2).contiguous(), None


class HFHead(nn.Module):
    """The last layer: the final norm and ``lm_head``, giving logits (B, T, V)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def hf_layers(model: Any) -> list[nn.Module]:
    """A ``transformers`` causal LM of a family pipefold knows (GPT-2, LLaMA) as a list of layers that run its own
    modules (not copies): the embedding, one per block (given the causal mask and positions the model would give
    it), and the final norm with ``lm_head``. Fed token ids (B, T), the layers in turn give the model's logits."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in ARCHS:
        raise ConfigError(f"pipefold cuts Hugging Face models of the families {', '.join(sorted(ARCHS))}, not "
                          f"{kind or type(model).__name__}: cut it by hand into stage modules")
    arch = ARCHS[kind]
    base = model.base_model
    for name in (*arch.embedding, arch.blocks, arch.norm, *filter(None, [arch.rotary])):
        if not hasattr(base, name):
            raise ConfigError(f"{type(model).__name__} has no {type(base).__name__}.{name}: this transformers "
                              f"version lays out {arch.name} differently from what pipefold knows")
    rotary = getattr(base, arch.rotary) if arch.rotary else None
    return [HFEmbedding({n: getattr(base, n) for n in arch.embedding}),
            *(HFBlock(block, model.config, rotary) for block in getattr(base, arch.blocks)),
            HFHead(getattr(base, arch.norm), model.get_output_embeddings())]


def hf_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of (B, T, V) logits against (B, T) next tokens, over the targets that are not IGNORE."""
    if targets.shape != logits.shape[:-1]:
        raise ConfigError(f"the targets have shape {tuple(targets.shape)} but the logits are {tuple(logits.shape)}; "
                          f"give one target token per position, shape {tuple(logits.shape[:-1])}")
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE)


# --------------------------------------------------------------------------- the model


class HFCausalLM(Model):
    """A ``transformers`` causal LM of ``arch`` with ``config``, as embedding, blocks and head layers.

    :meth:`build_hf` gives the ``transformers`` model object itself (the wanted parts built), :meth:`wrap` its
    parts as layers that use its own modules; :meth:`build_layers` is the two together.
    """

    embedding_layers = 1
    head_layers = 1
    splits_embedding = True
    _tp_blocks: dict[str, str] | None = None

    def __init__(self, arch: str, config: dict[str, Any], batches: Batches, *, seed: int = 0) -> None:
        _require()
        self.arch, self.config, self.batches, self.seed = ARCHS[arch], dict(config), batches, seed
        self.name = arch
        check_sizes(self.config, f"the {arch} config")
        meta = self._meta()
        self.preload = ("pipefold.models.hf", type(meta).__module__)
        hf: Any = meta.config
        self._sizes = (int(hf.hidden_size), int(hf.num_attention_heads), int(hf.vocab_size),
                       sum(p.numel() for p in meta.parameters()))  # parameters() gives a tied weight once
        self.num_layers = len(self._blocks(meta)) + 2
        self.seq = batches.seq
        if hf.vocab_size < 256:
            raise ConfigError(f"the corpus is bytes (ids 0..255) but the config's vocab_size is {hf.vocab_size}: "
                              "give a config with vocab_size >= 256")
        most = getattr(hf, "max_position_embeddings", None)
        if most is not None and batches.seq > most:
            raise ConfigError(f"--seq {batches.seq} is longer than the config's max_position_embeddings {most}: use "
                              f"--seq {most} or less, or a config with more positions")
        # Weights that several layers hold (tied embeddings): the same parameter object on the meta model.
        holders: dict[int, list[tuple[int, str]]] = {}
        for i, layer in enumerate(self.wrap(meta)):
            for name, p in layer.named_parameters():
                holders.setdefault(id(p), []).append((i, name))
        self.tied: tuple[Tie, ...] = tuple(tuple(h) for h in holders.values() if len({i for i, _ in h}) > 1)

    # -- tensor parallelism: the plan transformers ships with the family

    def _shipped_plan(self) -> dict[str, str]:
        """The block's part of transformers' own plan (``config.base_model_tp_plan``): "layers.*.mlp.up_proj" ->
        "block.mlp.up_proj", the path inside :class:`HFBlock`. One line where there is none, or a style other than
        a plain column- or row-wise split."""
        if self._tp_blocks is not None:
            return self._tp_blocks
        plan = getattr(self.hf_config(), "base_model_tp_plan", None)
        if not plan:
            raise ConfigError(f"transformers ships no tensor-parallel plan for {self.arch.name}: use --tp 1 with it "
                              "(the llama family has one)")
        prefix = f"{self.arch.blocks}.*."
        out = {}
        for pattern, style in plan.items():
            if not pattern.startswith(prefix) or style not in ("colwise", "rowwise"):
                raise ConfigError(f"transformers' tensor-parallel plan for {self.arch.name} splits {pattern} as "
                                  f"{style!r}, which pipefold does not run yet (it runs colwise and rowwise splits "
                                  "of the blocks): use --tp 1 with it")
            out["block." + pattern[len(prefix):]] = style
        self._tp_blocks = out  # asked for every block: the config is read once
        return out

    def tp_plan(self, index: int) -> dict[str, str]:
        return self._shipped_plan() if index in self.blocks else {}

    def check_context_parallel(self, cp: int) -> None:
        self._check_split(f"--cp {cp}", 2 * cp, "each sequence into 2 x cp equal chunks (two a rank)")

    def check_split_output(self) -> None:
        if any(i == self.num_layers - 1 for tie in self.tied for i, _ in tie):
            raise ConfigError(f"the {self.name} model's lm_head is tied to its embedding, which vocabulary parallelism "
                              "does not split: give a config with tie_word_embeddings false, or a schedule without "
                              "vocab=1")

    def split_output(self, layer: nn.Module) -> tuple[str, torch.Tensor]:
        self.check_split_output()
        if not isinstance(layer, HFHead):
            raise ConfigError(f"the output projection is in the model's last layer, the head (got "
                              f"{type(layer).__name__})")
        weight = layer.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        layer.lm_head = nn.Identity()
        return "lm_head.weight", weight

    def split_input(self, layer: nn.Module) -> tuple[str, torch.Tensor, int | None]:
        if not isinstance(layer, HFEmbedding):
            raise ConfigError(f"the token embedding is in the model's first layer, the embedding (got "
                              f"{type(layer).__name__})")
        name = layer.order[0]
        tokens = getattr(layer, name)
        if not isinstance(tokens, nn.Embedding) or tokens.max_norm is not None:
            raise ConfigError(f"the {self.name} model's token embedding is not a plain nn.Embedding, which "
                              "vocabulary parallelism splits: use a schedule without vocab=1")
        setattr(layer, name, nn.Identity())  # the layer goes on from the embeddings it is given
        return f"{name}.weight", tokens.weight, tokens.padding_idx

    def check_sequence_chunks(self, chunks: int) -> None:
        self._check_split(f"seq_chunks {chunks}", chunks, "each sequence into equal chunks")

    def _check_split(self, what: str, parts: int, how: str) -> None:
        """Refuse in one line a split of the sequence the model cannot run: its blocks declare their attention and
        positions (``HFBlock.attend``, ``HFBlock.positions``), which give LLaMA's rotary positions; GPT-2's
        learned positions are in its embedding, which does not."""
        if self.arch.rotary is None:
            raise ConfigError(f"{what} splits the sequence, and the {self.name} model's positions are learned in its "
                              "embedding, which pipefold does not split: use --hf llama, or --model gpt")
        check_sequence_split(what, f"cuts {how}", parts, self.batches.seq)
        if float(getattr(self.hf_config(), "attention_dropout", 0.0) or 0.0):
            raise ConfigError(f"{what}: the runtime's attention has no dropout: give a config with attention_dropout 0")

    def tp_widths(self) -> dict[str, int]:
        hf = self.hf_config()
        self._shipped_plan()  # no plan: refused before the widths are looked at
        names = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
        return {name: int(value) for name in names if (value := getattr(hf, name, None)) is not None}

    # -- building

    def size(self) -> Shape:
        """Sized from the config, with the parameter count of the model on the meta device (exact)."""
        hidden, heads, vocab, params = self._sizes
        return Shape(model="gpt", layers=self.num_layers - 2, hidden=hidden, heads=heads, batch=self.batches.batch,
                     seq=self.batches.seq, vocab=vocab, params=params)

    def hf_config(self) -> Any:
        """A fresh ``transformers`` config object (caches off: training runs whole sequences)."""
        from transformers import AutoConfig

        settings = {k: v for k, v in self.config.items() if k != "model_type"}
        try:
            config = AutoConfig.for_model(self.arch.name, **settings)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"transformers rejects the {self.arch.name} config: {err}") from None
        config.use_cache = False
        return config

    def _meta(self) -> Any:
        """The whole model on the meta device: shapes only, no memory."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config())

    def _blocks(self, model: Any) -> nn.ModuleList:
        base = model.base_model
        for name in (*self.arch.embedding, self.arch.blocks, self.arch.norm, *filter(None, [self.arch.rotary])):
            if not hasattr(base, name):
                raise ConfigError(f"{type(model).__name__} has no {type(base).__name__}.{name}: this transformers "
                                  f"version lays out {self.arch.name} differently from what pipefold knows")
        blocks = getattr(base, self.arch.blocks)
        assert isinstance(blocks, nn.ModuleList)
        return blocks

    def _units(self, model: Any) -> list[list[str]]:
        """For each layer, the qualified names of the model's modules it runs."""
        prefix = model.base_model_prefix
        head = [n for n, m in model.named_modules() if m is model.get_output_embeddings()][0]
        rotary = [f"{prefix}.{self.arch.rotary}"] if self.arch.rotary else []
        return [[f"{prefix}.{n}" for n in self.arch.embedding],
                *([f"{prefix}.{self.arch.blocks}.{i}", *rotary] for i in range(len(self._blocks(model)))),
                [f"{prefix}.{self.arch.norm}", head]]

    def build_hf(self, indices: Iterable[int] | None = None) -> Any:
        """The ``transformers`` model object with the modules of layers ``indices`` (all by default) built on the
        CPU and initialised, the rest left on the meta device."""
        model = self._meta()
        units = self._units(model)
        wanted = range(len(units)) if indices is None else check_indices(
            indices, len(units), f"0 = embedding, 1..{len(units) - 2} = blocks, {len(units) - 1} = head")
        modules = dict(model.named_modules())
        chosen = {id(sub): sub for i in wanted for name in units[i] for sub in modules[name].modules()}
        # A parameter shared with a module outside (a tied lm_head) is built with, and initialised by, its holders.
        while True:
            params = {id(p) for m in chosen.values() for p in m.parameters(recurse=False)}
            more = {id(m): m for m in modules.values() if id(m) not in chosen
                    and any(id(p) in params for p in m.parameters(recurse=False))}
            if not more:
                break
            chosen.update(more)
        made: dict[int, nn.Parameter] = {}
        for m in chosen.values():
            for key, p in m._parameters.items():
                if p is not None:
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                    m._parameters[key] = made[id(p)]
            for key, b in m._buffers.items():
                if b is not None:
                    m._buffers[key] = torch.empty_like(b, device="cpu")
        self._initialise(model, chosen)
        names = {id(m): n for n, m in modules.items()}
        for m in chosen.values():
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                if t.is_meta:
                    raise ConfigError(f"{names[id(m)]} of {type(model).__name__} kept a tensor without values "
                                      "after initialisation: pipefold cannot build this model part by part")
        return model

    def _initialise(self, model: Any, chosen: dict[int, nn.Module]) -> None:
        """Each chosen module's weights from the model's own ``_init_weights``, children before parents as
        ``transformers`` runs it, each from a random stream seeded by (seed, the module's name)."""
        from transformers import PreTrainedModel
        from transformers import initialization as init

        def post_order(module: nn.Module, name: str, owner: Any) -> Iterator[tuple[nn.Module, str, Any]]:
            for child_name, child in module.named_children():
                sub = child if isinstance(child, PreTrainedModel) else owner
                yield from post_order(child, f"{name}.{child_name}" if name else child_name, sub)
            yield module, name, owner

        with torch.no_grad(), init.guard_torch_init_functions():
            for module, name, owner in post_order(model, "", model):
                if id(module) in chosen:
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(derive_seed("hf", self.arch.name, self.seed, name))
                        owner._init_weights(module)

    def wrap(self, model: Any) -> list[nn.Module]:
        """The layers of ``model`` (a model :meth:`build_hf` made): they run its own modules, shared, not copied."""
        return hf_layers(model)

    def build_layers(self, indices: Iterable[int], *, device: str | torch.device = "cpu") -> dict[int, nn.Module]:
        chosen = list(indices)
        layers = self.wrap(self.build_hf(chosen))
        return {i: layers[i].to(device) for i in chosen}

    # -- loss and data

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return hf_loss(out, target)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches.batch_at(step)


def make(arch: str, args: ModelArgs) -> HFCausalLM:
    _require()
    given = [f"--{n.replace('_', '-')}" for n in ("hidden", "heads", "vocab_size") if getattr(args, n) is not None]
    if given:
        raise ConfigError(f"a Hugging Face model's shape comes from its config: drop {given[0]} and set it in the "
                          "--hf-config file (--layers may override the number of blocks)")
    config = read_config(arch, args.config)
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    batches = Batches(load_corpus(args.data).train, args.batch, args.seq, seed=args.seed)
    return HFCausalLM(arch, config, batches, seed=args.seed)


"""A mixture-of-experts decoder as a flat list of layers: embedding, N blocks whose MLP is a routed set of experts,
head. Nothing here knows about pipelining or expert parallelism.

Each block is pre-LayerNorm attention (the GPT's) and then an :class:`MoE` in place of the MLP: a router scores every
token against ``experts`` experts, the token goes to its ``top_k`` best, and its output is the experts' outputs
weighted by their scores (Mixtral: the top-k softmax scores renormalized). DeepSeek's layout adds ``shared_experts``
that every token goes through, and makes experts fine-grained (many, each narrow: ``expert_hidden``).

**Capacity.** With a ``capacity_factor`` an expert takes at most ``ceil(capacity_factor * T * top_k / experts)``
tokens of each sequence of ``T`` tokens, in position order; a token over it skips that expert (its weight is lost).
Counting per sequence keeps the same tokens dropped whether a batch runs whole or in microbatches of whole
sequences. Without one (dropless) every token reaches its experts.

**The load-balancing loss over the whole batch.** Switch and Mixtral add ``aux_loss * E * sum_e f_e * P_e`` to the
loss: ``f_e`` the share of the batch's routed slots (token x top-k) that chose expert ``e`` and ``P_e`` the mean of
its router probability over the batch's tokens. Its gradient reaches only ``P`` (``f`` counts choices), and is
``aux_loss * E * f_e / N`` on every token's probability of expert ``e`` (``N`` tokens in the batch): the same for
every token, given the whole batch's ``f``. A pipeline runs a batch as microbatches, so each layer's
:class:`Balance` counts the choices of every microbatch's forward and adds that gradient in each microbatch's
backward once the batch's counts are known: exactly the gradient of one process computing the loss over the whole
batch, where every forward of the batch at the layer's stage comes before its first backward (GPipe, breadth-first
schedules); a pipeline opens each step (:meth:`Balance.begin_step`), and a stage that runs a backward before
the step's last forward is refused in one line at that forward (and before the run by the runtime's check of the
schedule). Data-parallel copies sum their counts through :attr:`Balance.reduce`, which the runtime sets (this module
makes no collective). ``explicit_aux`` instead keeps the loss term itself (:attr:`MoE.aux`) for a caller that adds
it to its loss (one process, the whole batch: the tests' reference).

**Balancing by router bias** (DeepSeek-V3's, without a loss; ``bias_update``): the router chooses each token's top
k by its scores plus a bias per expert, the scores alone weighting the outputs; every forward counts the choices
(:attr:`MoE.load`), and after the step :func:`update_router_bias` moves each bias toward the mean of the step's
counts. It needs no order of forwards and backwards, so any schedule runs it. A forward that recomputation runs
again inside a backward counts nothing a second time, for either way (:func:`recomputing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models._build import check_positive_int, materialize, normal_
from pipefold.models.base import ModelArgs
from pipefold.models.gpt import CausalSelfAttention, CorpusDecoder, Embedding, GPTConfig, Head, corpus_sizes

__all__ = ["MoE", "MoEBlock", "MoEConfig", "MoEModel", "Balance", "build_moe_layers", "moe_aux_losses",
           "update_router_bias"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape of the MoE decoder; the defaults are a tiny byte-level model (Mixtral's routing, 8 experts, top 2)."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    experts: int = 8
    """Routed experts per block."""
    top_k: int = 2
    """Experts each token goes to."""
    expert_hidden: int | None = None
    """Inner width of each expert (None: 2 x n_embd; fine-grained experts are narrower and more)."""
    shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek)."""
    capacity_factor: float | None = None
    """Tokens an expert takes per sequence, as a multiple of the even share (None: dropless)."""
    dropless: bool = False
    """Ask for dropless routing (every token reaches its experts); with a capacity factor below 1 it is refused."""
    aux_loss: float = 0.01
    """Weight of the load-balancing loss over the whole batch (0: none)."""
    normalize: bool = True
    """Renormalize the top-k scores to sum to 1 (Mixtral)."""
    bias_update: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: each layer's router adds a bias per expert to its scores to
    choose the top k (not to weight them), and after every step the bias of an expert that got more than the
    mean of the batch's routed slots falls by this much, of one that got fewer rises by it (0: no bias)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "experts", "top_k"):
            check_positive_int("MoEConfig", name, getattr(self, name))
        if self.expert_hidden is not None:
            check_positive_int("MoEConfig", "expert_hidden", self.expert_hidden)
        if isinstance(self.shared_experts, bool) or not isinstance(self.shared_experts, int) or \
                self.shared_experts < 0:
            raise ConfigError(f"shared experts are 0 or more (got {self.shared_experts!r})")
        if self.top_k > self.experts:
            raise ConfigError(f"top_k {self.top_k} is more than the {self.experts} experts a token can go to: give "
                              f"top_k {self.experts} or less, or more experts")
        if self.n_embd % self.n_head:
            raise ConfigError(f"--hidden {self.n_embd} must be a multiple of --heads {self.n_head}")
        if self.capacity_factor is not None:
            if not (isinstance(self.capacity_factor, int | float) and math.isfinite(self.capacity_factor)
                    and self.capacity_factor > 0):
                raise ConfigError(f"a capacity factor is a number above 0, such as 1.25 (got {self.capacity_factor!r})")
            if self.dropless and self.capacity_factor < 1:
                raise ConfigError(f"a capacity factor of {self.capacity_factor:g} drops tokens, and dropless routing "
                                  "keeps every one: drop capacity_factor, or dropless")
        if not (isinstance(self.aux_loss, int | float) and math.isfinite(self.aux_loss) and self.aux_loss >= 0):
            raise ConfigError(f"the load-balancing loss's weight is 0 or more (got {self.aux_loss!r})")
        if not (isinstance(self.bias_update, int | float) and math.isfinite(self.bias_update)
                and self.bias_update >= 0):
            raise ConfigError(f"the router bias's step is 0 or more, such as 0.001 (got {self.bias_update!r})")

    @property
    def num_layers(self) -> int:
        return self.n_layer + 2

    @property
    def inner(self) -> int:
        return self.expert_hidden if self.expert_hidden is not None else 2 * self.n_embd

    @property
    def capacity(self) -> float | None:
        """The capacity factor in force (None: dropless)."""
        return None if self.dropless else self.capacity_factor

    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, bias=False)


class Expert(nn.Module):
    """One expert: a SwiGLU MLP, C -> H (gate and up) -> C, as Mixtral's."""

    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, inner, bias=False)
        self.w3 = nn.Linear(width, inner, bias=False)
        self.w2 = nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Balance:
    """The load-balancing loss of one MoE layer over a whole batch, run microbatch by microbatch (the module's
    description): the counts of each forward, the gradient in each backward."""

    def __init__(self, experts: int, weight: float) -> None:
        self.experts, self.weight = experts, weight
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Sums a tensor over the data-parallel copies (in place, returns it); None: one copy. The runtime sets it."""
        self.loss: float | None = None
        """The last batch's loss term (its weight included), once its first backward ran."""
        self._counts: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []
        self._tokens = 0
        self._done: set[int] = set()
        self._frequencies: torch.Tensor | None = None
        self._total = 0.0
        self._step = False

    def begin_step(self) -> None:
        """A step of a pipeline starts: its forwards and backwards are one batch until the next call, and a forward
        after one of its backwards is refused. Without it (one process running a batch's forwards, then its
        backward) a forward after every backward of the batch starts the next batch."""
        self.reset()
        self._step = True

    def record(self, chosen: torch.Tensor, probs: torch.Tensor) -> int:
        """A forward's choices (token x top-k expert ids) and router probabilities; returns its index in the batch.
        A forward after every backward of the batch starts the next batch; one between two of them is refused."""
        if self._done and (self._step or len(self._done) < len(self._counts)):
            raise ConfigError("the load-balancing loss over the whole batch needs every microbatch's forward at a "
                              "stage before its first backward, and this schedule runs a backward first: use gpipe "
                              "or looped-bfs, or a MoE with aux_loss 0")
        if self._done:
            self.reset()
        self._counts.append(torch.bincount(chosen.reshape(-1), minlength=self.experts).to(torch.float64))
        self._probs.append(probs.detach().sum(0).to(torch.float64))
        self._tokens += probs.shape[0]
        return len(self._counts) - 1

    def reset(self) -> None:
        self._counts, self._probs, self._tokens, self._done, self._frequencies = [], [], 0, set(), None
        self._step = False

    def frequencies(self) -> tuple[torch.Tensor, float]:
        """The batch's share of routed slots per expert, and its tokens over the copies divided by their number
        (a copy's gradient is averaged with the others' after the step), computed once."""
        if self._frequencies is None:
            counts = torch.stack(self._counts).sum(0)
            probs = torch.stack(self._probs).sum(0)
            tokens = torch.tensor([float(self._tokens), 1.0], dtype=torch.float64)
            if self.reduce is not None:
                whole = self.reduce(torch.cat([counts, probs, tokens]))
                counts, probs, tokens = whole[:self.experts], whole[self.experts:-2], whole[-2:]
            total, copies = float(tokens[0]), float(tokens[1])
            self._frequencies = counts / counts.sum()
            # The copies' gradients are averaged after the step: each copy adds its tokens' share of the whole
            # batch's gradient times the copies, so that the mean is the whole batch's.
            self._total = total / copies
            self.loss = float(self.weight * self.experts * (self._frequencies * probs / total).sum())
        return self._frequencies, self._total

    def gradient(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """The loss's gradient on the router probabilities of forward ``index`` (shape and dtype of ``like``)."""
        freq, total = self.frequencies()
        self._done.add(index)
        row = (self.weight * self.experts / total) * freq
        return row.to(like.dtype).expand_as(like).contiguous()


class _Inject(torch.autograd.Function):
    """A zero that, in backward, puts the load-balancing loss's gradient on the router probabilities."""

    @staticmethod
    def forward(ctx: Any, probs: torch.Tensor, balance: Balance, index: int) -> torch.Tensor:
        ctx.balance, ctx.index = balance, index
        ctx.save_for_backward(probs)
        return probs.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (probs,) = ctx.saved_tensors
        return ctx.balance.gradient(ctx.index, probs), None, None


class MoE(nn.Module):
    """The routed experts of a block (the module's description)."""

    router_bias: torch.Tensor | None
    """With ``bias_update``: the bias added to each expert's score to choose the top k (a buffer; None without)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.n_embd, cfg.experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.n_embd, cfg.inner) for _ in range(cfg.experts))
        self.shared = nn.ModuleList(Expert(cfg.n_embd, cfg.inner) for _ in range(cfg.shared_experts))
        self.balance = Balance(cfg.experts, cfg.aux_loss)
        self.explicit_aux = False
        """Keep the load-balancing loss term in :attr:`aux` instead of adding its gradient in backward."""
        self.aux: torch.Tensor | None = None
        self.register_buffer("router_bias", torch.zeros(cfg.experts) if cfg.bias_update else None)
        self.load: torch.Tensor | None = None
        """With ``bias_update``: the routed slots each expert got in this step's forwards so far (float64, on the
        host; made by the first forward that counts: a layer is made on the meta device)."""
        self.dispatch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        """Runs the routed experts on the chosen tokens (tokens, expert ids, weights) -> output; None: here, every
        expert local. Expert parallelism replaces it (:mod:`pipefold.runtime.experts`)."""

    def route(self, h: torch.Tensor, sequences: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities (float32), each token's top-k expert ids and their weights (0 where capacity
        dropped the token)."""
        probs = F.softmax(self.router(h).float(), dim=-1)
        if self.router_bias is None:
            weights, chosen = probs.topk(self.cfg.top_k, dim=-1)
        else:  # the bias chooses, the scores weight
            chosen = (probs.detach() + self.router_bias).topk(self.cfg.top_k, dim=-1).indices
            weights = probs.gather(-1, chosen)
        if self.cfg.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.cfg.capacity is not None:
            per = h.shape[0] // sequences
            cap = math.ceil(self.cfg.capacity * per * self.cfg.top_k / self.cfg.experts)
            onehot = F.one_hot(chosen, self.cfg.experts).reshape(sequences, per * self.cfg.top_k, self.cfg.experts)
            rank = (onehot.cumsum(1) * onehot).sum(-1).reshape(chosen.shape)  # the slot's place in its expert's queue
            weights = weights * (rank <= cap)
        return probs, chosen, weights

    def local(self, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every routed expert here: each gets its tokens, their outputs weighted and summed per token."""
        out = torch.zeros_like(h)
        flat, w = chosen.reshape(-1), weights.reshape(-1)
        token = torch.arange(h.shape[0], device=h.device).repeat_interleave(self.cfg.top_k)
        for e, expert in enumerate(self.experts):
            mine = (flat == e).nonzero().squeeze(-1)
            if mine.numel():
                rows = token[mine]
                out.index_add_(0, rows, expert(h[rows]) * w[mine].unsqueeze(-1).to(h.dtype))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = x.reshape(b * t, c)
        probs, chosen, weights = self.route(h, b)
        out = (self.dispatch or self.local)(h, chosen, weights)
        for expert in self.shared:
            out = out + expert(h)
        out = out.reshape(b, t, c)
        training = torch.is_grad_enabled() and self.training
        again = training and recomputing()  # the same operations, none of the forward's counting
        if self.router_bias is not None and training and not again:
            counts = torch.bincount(chosen.reshape(-1), minlength=self.cfg.experts).to("cpu", torch.float64)
            self.load = counts if self.load is None else self.load + counts
        if self.cfg.aux_loss and training:
            if self.explicit_aux:
                freq = torch.bincount(chosen.reshape(-1), minlength=self.cfg.experts).to(probs.dtype)
                self.aux = self.cfg.aux_loss * self.cfg.experts * (freq / freq.sum() * probs.mean(0)).sum()
            else:
                index = -1 if again else self.balance.record(chosen, probs)  # a rerun's graph runs no backward
                out = out + _Inject.apply(probs, self.balance, index).to(out.dtype)
        return out


def recomputing() -> bool:
    """Whether this forward runs inside a backward: activation recomputation running it again, whose choices the
    forward counted already."""
    return torch._C._current_graph_task_id() != -1


def update_router_bias(modules: Iterable[nn.Module], reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       *, apply: bool = True) -> int:
    """After a step: every MoE layer in ``modules`` with ``bias_update`` moves its router bias toward balance,
    down by ``bias_update`` for an expert that got more than the mean of the step's routed slots, up for one that
    got fewer (DeepSeek-V3); ``reduce`` sums the counts over data-parallel copies (in place, returns them), so that
    they are the whole batch's and every copy moves alike. ``apply=False`` (a skipped step) only forgets the
    counts. Returns how many layers it moved."""
    moved = 0
    for m in moe_layers(modules):
        if m.router_bias is None:
            continue
        counts = m.load if m.load is not None else torch.zeros(m.cfg.experts, dtype=torch.float64)
        counts, m.load = counts.to(m.router_bias.device), None  # where the copies' collective runs (NCCL: a GPU)
        if reduce is not None:
            counts = reduce(counts)
        if apply:
            with torch.no_grad():
                m.router_bias += m.cfg.bias_update * torch.sign(counts.mean() - counts).to(m.router_bias)
            moved += 1
    return moved


class MoEBlock(nn.Module):
    """Layers 1..N: pre-LayerNorm attention, then the routed experts, each added to the residual stream."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = CausalSelfAttention(cfg.gpt())
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


def _make_layer(cfg: MoEConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(cfg.gpt())
    if index == cfg.num_layers - 1:
        return Head(cfg.gpt())
    return MoEBlock(cfg)


@torch.no_grad()
def _init_layer(cfg: MoEConfig, layer: nn.Module, gen: torch.Generator) -> None:
    """N(0, 0.02) weights, the projections into the residual stream scaled down with depth, unit LayerNorms."""
    residual = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            normal_(module.weight, residual if name.endswith(("c_proj", "w2")) else 0.02, gen)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            normal_(module.weight, 0.02, gen)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, MoE) and module.router_bias is not None:
            module.router_bias.zero_()


def build_moe_layers(cfg: MoEConfig, indices: Iterable[int], *, seed: int = 0,
                     device: str | torch.device = "cpu") -> dict[int, nn.Module]:
    """Only the layers at ``indices`` (0 = embedding, 1..N = MoE blocks, N+1 = head), each with the weights of the
    whole model built at once."""
    layout = f"0 = embedding, 1..{cfg.n_layer} = MoE blocks, {cfg.n_layer + 1} = head"
    return materialize(indices, cfg.num_layers, layout, lambda i: _make_layer(cfg, i),
                       lambda layer, i, gen: _init_layer(cfg, layer, gen), tag="moe", seed=seed, device=device)


def moe_layers(modules: Iterable[nn.Module]) -> list[MoE]:
    """Every MoE in ``modules`` (and their children)."""
    return [m for module in modules for m in module.modules() if isinstance(m, MoE)]


def moe_aux_losses(modules: Iterable[nn.Module]) -> list[float]:
    """The last batch's load-balancing loss of every MoE in ``modules`` (weights included), where it is known."""
    return [m.balance.loss for m in moe_layers(modules) if m.balance.loss is not None]


class MoEModel(CorpusDecoder):
    """The MoE decoder as a :class:`~pipefold.models.base.Model`, on the byte-level corpus."""

    name = "moe"
    cfg: MoEConfig

    def build_layers(self, indices: Iterable[int], *, device: str | torch.device = "cpu") -> dict[int, nn.Module]:
        return build_moe_layers(self.cfg, indices, seed=self.seed, device=device)

    def balanced_layers(self) -> tuple[int, ...]:
        return tuple(self.blocks) if self.cfg.aux_loss > 0 else ()

    def check_expert_parallel(self, ranks: int, copies: int = 0) -> None:
        experts = self.cfg.experts
        if experts % ranks == 0:
            return
        said = f"--ep {ranks} cannot share {experts} experts equally"
        fits = [d for d in range(2, experts + 1) if experts % d == 0]
        both = [str(d) for d in fits if not copies or copies % d == 0]
        if both:
            raise ConfigError(f"{said}: give an --ep that divides {experts}{f' and --dp {copies}' if copies else ''} "
                              f"({', '.join(both)}), or other experts")
        if fits:
            raise ConfigError(f"{said}: give an --ep that divides {experts} ({', '.join(map(str, fits))}) with a --dp "
                              "it divides, or other experts")
        raise ConfigError(f"{said}: give 2 or more experts")


_OPTIONS: dict[str, Callable[[str], Any]] = {
    "experts": int, "top_k": int, "expert_hidden": int, "shared_experts": int, "capacity_factor": float,
    "dropless": lambda v: v.lower() in ("1", "true", "yes", ""), "aux_loss": float, "normalize": lambda v: v != "0",
    "bias_update": float}
"""What ``--moe`` sets, and how each value reads."""


def parse_moe(text: str | None) -> dict[str, Any]:
    """``--moe experts=8,top_k=2,shared_experts=1,dropless``: :class:`MoEConfig`'s settings; a key it does not know
    or a value that does not read is refused in one line."""
    out: dict[str, Any] = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key not in _OPTIONS:
            raise ConfigError(f"--moe has no setting {key!r}: give any of {', '.join(_OPTIONS)} as key=value")
        try:
            out[key] = _OPTIONS[key](value.strip())
        except ValueError:
            raise ConfigError(f"--moe {key}={value} does not read: give a number, such as {key}=2") from None
    return out


def make(args: ModelArgs, **moe: Any) -> MoEModel:
    hidden, heads, vocab, batches = corpus_sizes(args, "moe model", "--layers, --hidden, --heads, --seq and --moe")
    cfg = MoEConfig(n_layer=args.layers or 2, n_embd=hidden, n_head=heads, block_size=args.seq, vocab_size=vocab,
                    **{**parse_moe(args.moe), **moe})
    return MoEModel(cfg, batches, seed=args.seed)

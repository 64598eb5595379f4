"""Planning a cluster one does not have: every (dp, cp, tp, pp) of its devices (and, for a model with experts, the
expert-parallel degree ep), schedule, microbatch size, recomputation and sharding of the optimizer state, costed
from the hardware file and the model's config, the exact schedule simulated.

**Placement.** Ranks are laid out tp innermost, then cp, then dp, then pp (Megatron-LM's order): a
tensor-parallel group is tp neighbouring devices, inside a node when tp <= devices per node; a context-parallel
ring strides tp and spans tp x cp ranks; a data-parallel group strides tp x cp and spans nodes once tp x cp x dp
passes a node; pipeline neighbours are tp x cp x dp ranks apart, and once the whole pipeline (tp x cp x dp x pp
ranks) passes a node some hop is on the network between nodes, which every hop is costed at. Where
tp and dp are the same size, the receivers' all-gather of a message's pieces is costed on the dp link (the cost
model keys its collectives by group size). Each collective is costed on the link its group spans
(:meth:`Cluster.link`).

**A block's passes** on a microbatch of ``b`` sequences of ``s`` tokens (``n = b s``), split over tp ranks:
its F, B and W operations (:meth:`Transformer.block_flops`) over tp, at the accelerator's peak times the matmul
efficiency of its largest product (the MLP's n x h x f / tp); plus the elementwise work, memory-bound: twice
the bytes the block saves (written in F, read in B) over the memory bandwidth in F, twice that in B; plus,
with tp > 1, Megatron-LM's two all-reduces of the n x h output in F and two of its gradient in B, on the tp
link, not overlapped. The head is the vocabulary projection split over tp, the embedding free.

**Memory per device**: its stages' parameters over tp; bf16 weights (2 bytes), fp32 gradients (4), fp32 master
weights and AdamW's two moments (12): 18 bytes a parameter unsharded; ZeRO-1 shards the 12 over dp; FSDP shards
fp32 weights, gradients and moments (16) over dp and holds two blocks gathered in bf16 with one microbatch; with
several, the stage's whole weights in bf16 (gathered once a step) and their gradients unsharded in float32 until
the step's one reduce-scatter (FSDP2 accumulates them so without a sync). Activations: the simulated peak of the
schedule with each stage's bytes per microbatch (:meth:`Transformer.saved`, flash attention; the head's logits and
their float32 copy kept, and its float32 log-softmax beside them at its peak, :meth:`Transformer.head_peak`; full
recomputation keeps each block's input and one block whole while it reruns). With sequence parallelism
(:attr:`Training.sequence_parallel`, where tp > 1) the norms', dropouts' and residual stream's bytes and a block's
input are split over tp too, a stage's message is each rank's share of the tokens (nothing gathered), and the
elementwise work is on that share. It fits when both are within the accelerator's usable memory.

**Context parallelism** (cp > 1): each sequence of a microbatch is split over cp ranks, two of its 2 cp equal
chunks on each (chunk i and 2 cp - 1 - i, so that every rank has the same causal work), and attention runs as a
ring: each rank's keys and values pass round the cp ranks, cp - 1 steps in the forward and twice the bytes in the
backward (keys, values and their gradients), each step overlapped with the attention core of the chunk at hand.
Everything per token (the blocks' passes, their activations, the messages between stages, the head's logits) is
a rank's ``b s / cp`` tokens; the ring adds what it takes beyond the attention core's time. Weights are whole on
every cp rank: their gradients are averaged over dp x cp ranks, and ZeRO-1 and FSDP shard over dp x cp
(torchtitan's and Megatron-LM's practice). By default the search tries the cp degrees that leave each rank at
least :data:`CP_TOKENS` tokens of a sequence (so none for sequences shorter than twice that).

**Experts** (a model with experts, :attr:`Transformer.moe`): ep consecutive data-parallel copies (tp x cp ranks
apart, so spanning tp x cp x ep ranks) each hold E / ep of every MoE block's routed experts, replicated across the
dp / ep groups; their parameters, gradients and optimizer state on a rank are those experts' (over tp), ZeRO-1 and
FSDP shard them among the dp / ep copies x cp that hold them, and their gradients are averaged among those (priced
in the DP actions as the bytes that take as long in the dp x cp ring). An MoE block's routed experts compute a
rank's tokens x top-k x one expert's operations (the busiest rank's ``moe_imbalance`` times that, with ep > 1) at the
efficiency of one expert's product on the tokens it gets, the rest of the block at that of its largest other
product. Its dispatch and combine (:func:`all_to_all`), twice in F and twice in B, are the stage's ``exchange_f``
and ``exchange_b`` beside its compute; a recomputed block's forward exchanges again in its backward; the schedules
whose overlapped pairs hide one part's exchanges under the other's compute (DualPipe, DualPipeV, ``1f1b:combined=1``)
are searched for such a model, with ``exchange_overlap``.

**Step time**: the schedule simulated (:func:`pipefold.sim.simulate`) with those times, messages between
stages crossing in tp pieces then all-gathered (``CostModel.mesh``), and, without FSDP, each stage's gradient
all-reduce among its dp copies as the schedule's ``DP`` actions (a ring on the dp link, overlapping other
stages' work as the simulator places it). With FSDP the weights' all-gathers (forward and backward with one
microbatch, once with several) and the gradients' reduce-scatter overlap the computation: the step is the longer
of the two, the collectives' latency paid once per block each (a ring of dp - 1 steps). The optimizer's step
is memory-bound: its bytes over the memory bandwidth.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.ir import SEQ_CHUNKS, VOCAB
from pipefold.ir.ref import ScheduleRef
from pipefold.models.transformer import Saved, Transformer
from pipefold.plan.cluster import Cluster
from pipefold.plan.limits import MAX_SEARCH_WORK, check_search, schedule_work, stages_of
from pipefold.sim.simulate import CostModel, StageOverride, ring_allreduce, ring_fit, ring_gather, simulate

__all__ = ["CLUSTER_PLAN_VERSION", "CP_TOKENS", "FAMILIES", "RECOMPUTE", "SHARDING", "ClusterPlan", "ClusterPoint",
           "Training", "check_cp", "evaluate", "layouts", "plan_cluster", "point", "ring_attention", "run_section"]

FAMILIES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half", "v-min", "gpipe")
"""The schedule families searched (each at its default options; interleaved-1f1b at v = 2)."""
MOE_FAMILIES = ("dualpipe", "dualpipev")
"""Searched besides :data:`FAMILIES` for a model with experts, with ``1f1b:combined=1``: the schedules whose
overlapped pairs (F+B) hide one part's expert all-to-alls under the other's compute."""
RECOMPUTE = ("none", "half", "full")
"""How many of a stage's blocks keep only their input and rerun in the backward: none (flash attention's selective
recomputation has nothing more to drop), every other one (torchtitan's "selective layer"), all."""
SHARDING = ("none", "zero1", "fsdp")
MICROBATCH_SIZES = (1, 2, 4, 8, 16)
COMBINED = "combined"
"""The schedule option that pairs each steady-state forward with a backward (``1f1b:combined=1``)."""
CP_TOKENS = 8192
"""The fewest tokens of a sequence a context-parallel rank keeps where the search picks the cp degrees itself."""


@dataclass(frozen=True, kw_only=True)
class Training:
    """What is trained: the model, the tokens a sequence has, the sequences a step takes, the compute dtype, and
    whether tensor-parallel ranks split the tokens of what they would otherwise each hold whole (sequence
    parallelism, Korthikanti et al.: the large runs' practice, so the default), and the context-parallel degrees
    the search tries (None: those of :meth:`cp_degrees`)."""

    model: Transformer
    seq: int
    global_batch: int
    dtype: str = "bf16"
    sequence_parallel: bool = True
    context_parallel: tuple[int, ...] | None = None
    seq_chunks: tuple[int, ...] = (1,)
    """The sequence chunks a microbatch is cut into that the search tries (Seq1F1B), with the families that take
    them; 1: whole microbatches."""
    split_vocab: bool = False
    """The search also tries each family that can split the output layer and the token embedding by vocabulary
    over every pipeline device (``vocab=1``, Yeung et al.): each device's S and T passes a pp-th of the head's work
    and logits, each device a pp-th of the two matrices."""
    expert_parallel: tuple[int, ...] | None = None
    """The expert-parallel degrees the search tries (a model with experts only; None: those of
    :meth:`ep_degrees`)."""
    moe_imbalance: float = 1.0
    """Tokens the busiest expert rank gets, over the mean: its routed experts' work, what they keep and its
    all-to-alls scale by it (every rank of the group waits for it), where ep > 1."""
    node_limit: int = 0
    """Node-limited routing (DeepSeek-V3): each token's experts on at most this many nodes, its copy crossing to
    each once and forwarded inside it (0: no limit, every copy sent on its own)."""

    def __post_init__(self) -> None:
        for name in ("seq", "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a whole number >= 1 (got {value!r})")
        model = self.model
        if not model.moe:
            for flag, given in (("--ep", self.expert_parallel is not None),
                                ("--moe-imbalance", self.moe_imbalance != 1), ("--node-limit", self.node_limit != 0)):
                if given:
                    raise ConfigError(f"{flag} prices the experts of a mixture-of-experts model, and {model.name} has "
                                      f"none: drop {flag}")
        for ep in self.expert_parallel or ():
            check_ep(ep, model)
        x = self.moe_imbalance
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 1:
            raise ConfigError(f"--moe-imbalance is the busiest expert rank's tokens over the mean: a number >= 1 "
                              f"(got {x!r})")
        if isinstance(self.node_limit, bool) or not isinstance(self.node_limit, int) or self.node_limit < 0:
            raise ConfigError(f"--node-limit is the nodes a token's experts may be on: a whole number >= 1 (got "
                              f"{self.node_limit!r})")
        for cp in self.context_parallel or ():
            check_cp(cp, self.seq)
        for c in self.seq_chunks:
            if self.seq % c:
                fits = [k for k in range(2, c + 1) if self.seq % k == 0]
                raise ConfigError(f"--seq-chunks {c} cuts each sequence into {c} equal chunks, and {self.seq} tokens "
                                  f"do not: give --seq a multiple of {c}"
                                  + (f", or --seq-chunks {fits[-1]}" if fits else ""))

    def ep_degrees(self) -> tuple[int, ...]:
        """The expert-parallel degrees searched: those given, or for a model with experts 1, the powers of 8 (a
        node's devices, and groups of nodes) that divide the experts, and the experts themselves; 1 without
        experts."""
        if self.expert_parallel is not None:
            return self.expert_parallel
        experts = self.model.experts
        if experts == 1:
            return (1,)
        out, ep = [1], 8
        while ep < experts:
            if experts % ep == 0:
                out.append(ep)
            ep *= 8
        return (*out, experts)

    def cp_degrees(self) -> tuple[int, ...]:
        """The context-parallel degrees searched: those given, or 1 and every power of two that leaves each rank
        at least :data:`CP_TOKENS` tokens of a sequence in 2 cp equal chunks."""
        if self.context_parallel is not None:
            return self.context_parallel
        out, cp = [1], 2
        while self.seq // cp >= CP_TOKENS and self.seq % (2 * cp) == 0:
            out.append(cp)
            cp *= 2
        return tuple(out)


def check_ep(ep: int, model: Transformer) -> None:
    """One line where an expert-parallel degree cannot spread ``model``'s experts evenly."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"an expert-parallel degree is a whole number >= 1 (got {ep!r})")
    if ep > 1 and not model.moe:
        raise ConfigError(f"ep {ep} spreads experts over ranks, and {model.name} has none: give ep 1")
    if model.experts % ep:
        fits = [d for d in range(1, model.experts + 1) if model.experts % d == 0]
        raise ConfigError(f"ep {ep} does not split {model.name}'s {model.experts} experts evenly: give ep one of "
                          f"{', '.join(map(str, fits))}")


def check_cp(cp: int, seq: int) -> None:
    """One line where a context-parallel degree cannot split a sequence of ``seq`` tokens (2 cp equal chunks)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"a context-parallel degree is a whole number >= 1 (got {cp!r})")
    if cp > 1 and seq % (2 * cp):
        fits = [c for c in range(2, cp + 1) if seq % (2 * c) == 0]
        raise ConfigError(f"cp {cp} splits each sequence into {2 * cp} equal chunks (two a rank, for the causal "
                          f"balance), and {seq} tokens do not: give --seq a multiple of {2 * cp}"
                          + (f", or cp {max(fits)}" if fits else ""))


@dataclass(frozen=True, kw_only=True)
class ClusterPoint:
    """One configuration, costed."""

    dp: int
    tp: int
    pp: int
    schedule: str
    microbatch: int
    """Sequences per microbatch (each split over the cp ranks)."""
    microbatches: int
    recompute: str
    sharding: str
    step_time: float
    memory: float
    """The most bytes one device holds (static and activations)."""
    static: float
    fits: bool
    tokens_per_second: float
    """Of the whole cluster."""
    mfu: float
    bubble: float
    sequence_parallel: bool = False
    """Whether its tensor-parallel ranks split the tokens (tp > 1 with :attr:`Training.sequence_parallel`)."""
    cp: int = 1
    """Context-parallel ranks each sequence is split over."""
    ep: int = 1
    """Expert-parallel ranks: consecutive data-parallel copies that each hold a ep-th of every MoE block's experts."""
    exchange_exposed: float = 0.0
    """Seconds of the step the busiest device spends in expert all-to-alls with nothing computing under them."""

    @property
    def layout(self) -> str:
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return f"dp{self.dp}{cp}{ep} tp{self.tp} pp{self.pp}" + (" sp" if self.sequence_parallel else "")

    def to_dict(self) -> dict[str, Any]:
        return {"dp": self.dp, "cp": self.cp, "ep": self.ep, "tp": self.tp, "pp": self.pp, "schedule": self.schedule,
                "microbatch": self.microbatch,
                "microbatches": self.microbatches, "recompute": self.recompute, "sharding": self.sharding,
                "sequence_parallel": self.sequence_parallel,
                "step_time": self.step_time, "memory_bytes": self.memory, "static_bytes": self.static,
                "fits": self.fits, "tokens_per_second": self.tokens_per_second, "mfu": self.mfu,
                "bubble": self.bubble, "exchange_exposed": self.exchange_exposed}


@dataclass(frozen=True)
class ClusterPlan:
    best: ClusterPoint | None
    points: tuple[ClusterPoint, ...]
    frontier: tuple[ClusterPoint, ...]
    """The fitting points no other fitting point beats on both step time and memory, fastest first."""
    evaluated: int
    """Configurations costed: those in ``points`` and those refused on their weights alone."""
    refused: int
    """Configurations whose weights, gradients and optimizer state alone exceed a device (not simulated)."""
    seconds: float
    skipped: tuple[str, ...] = field(default=())


def layouts(cluster: Cluster, training: Training) -> list[tuple[int, int, int, int]]:
    """Every (dp, cp, tp, pp) with dp x cp x tp x pp = the cluster's devices that the model and the batch allow: tp
    divides the heads and the key-value heads and stays in a node, cp is one of the degrees searched
    (:meth:`Training.cp_degrees`), pp is at most the blocks, dp divides the global batch. One line naming what
    would work when none does."""
    n, model = cluster.devices, training.model
    out = []
    for tp in _divisors(n):
        if tp > cluster.devices_per_node or model.heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
            continue
        for cp in training.cp_degrees():
            if (n // tp) % cp:
                continue
            for pp in _divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                if pp <= model.layers and training.global_batch % dp == 0:
                    out.append((dp, cp, tp, pp))
    if not out:
        fits = [d for d in _divisors(n) if d <= training.global_batch]
        raise ConfigError(f"no (dp, tp, pp) of {n} devices runs {model.name} on a batch of {training.global_batch}: "
                          f"dp must divide the batch (dp of {n} devices: {', '.join(map(str, _divisors(n)))}), tp the "
                          f"{model.heads} heads and a node's {cluster.devices_per_node} devices, pp the blocks; give "
                          f"--global-batch a multiple of {max(fits) if fits else n}, or another --nodes")
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Stage:
    blocks: int
    embedding: bool
    head: bool
    dense: int = 0
    """Of its blocks, those without experts (the model's first ``dense_blocks``; all of a dense model's)."""

    @property
    def moe(self) -> int:
        return self.blocks - self.dense


def _stages(model: Transformer, stages: int) -> list[_Stage]:
    """The blocks split as evenly as they go over ``stages``, the embedding on the first, the head on the last."""
    base, extra = divmod(model.layers, stages)
    out, first = [], 0
    for s in range(stages):
        blocks = base + (1 if s < extra else 0)
        dense = min(blocks, max(0, model.dense_blocks - first))
        out.append(_Stage(blocks, s == 0, s == stages - 1, dense))
        first += blocks
    return out


@dataclass(frozen=True)
class _Config:
    dp: int
    tp: int
    pp: int
    microbatch: int
    recompute: str
    cp: int = 1
    ep: int = 1

    @property
    def shards(self) -> int:
        """The ranks that hold the same weights: dp x cp (the gradients' average, ZeRO-1's and FSDP's group)."""
        return self.dp * self.cp

    @property
    def expert_shards(self) -> int:
        """The ranks that hold the same experts: the dp / ep groups' copies x cp."""
        return self.dp // self.ep * self.cp


@dataclass(frozen=True)
class _Block:
    """One block's costs on a rank for a microbatch: its passes' compute (seconds), what it keeps (bytes), its
    expert all-to-alls in F and in B (seconds)."""

    f: float
    b: float
    w: float
    kept: float
    exchange_f: float = 0.0
    exchange_b: float = 0.0


def _costs(cluster: Cluster, training: Training, c: _Config, stages: int,
           sharded: bool, split: bool = False) -> tuple[CostModel, list[float]]:
    """The cost model of one configuration (seconds and bytes) and each stage's parameters on one of its
    devices (over tp; a ep-th of its experts). ``split``: the head and the embedding split by vocabulary over the
    pipeline's devices (the head's work and logits the simulator's vocabulary passes, each stage an equal share of
    the two matrices)."""
    model, acc = training.model, cluster.accelerator
    peak = acc.peak(training.dtype)
    n = c.microbatch * training.seq // c.cp  # a rank's tokens of a microbatch
    h, a, tp = model.hidden, model.value_bytes, c.tp
    tp_link, cp_link, dp_link = cluster.link(tp), cluster.link(tp * c.cp), cluster.link(tp * c.shards)
    # Pipeline neighbours are tp x cp x dp ranks apart: once the pipeline outgrows a node some hop crosses nodes,
    # and the simulator gives every hop the one transfer time, the slowest's.
    pp_link = cluster.link(tp * c.shards * c.pp)

    def compute(flops: float, biggest: float) -> float:
        return flops / (peak * acc.efficiency(biggest))

    # With sequence parallelism the norms, dropouts and residual stream (and so a block's input, and the stage's
    # output each rank sends) are each rank's share of the tokens; the all-reduces become a reduce-scatter and an
    # all-gather, the same bytes on a ring.
    sp = training.sequence_parallel and tp > 1
    message = model.message_bytes(n)  # a block's output, as one stage sends it to the next
    block_input = a * h * n / (tp if sp else 1)
    tp_comm = 2 * ring_allreduce(message, tp, tp_link.latency, tp_link.achieved)
    x = training.moe_imbalance if c.ep > 1 else 1.0  # a rank with every expert computes its own tokens' copies
    exchange = all_to_all(model, cluster, tokens=n, tp=tp, cp=c.cp, ep=c.ep, imbalance=x,
                          node_limit=training.node_limit)[0]

    def block(dense: bool) -> _Block:
        f_ops, b_ops, w_ops = (y * n / tp for y in model.block_flops(training.seq, dense=dense))
        saved = model.saved(training.seq, attention="flash", dense=dense)
        moe = model.moe and not dense
        if moe:  # the busiest rank's routed copies: x times the mean's
            routed = model.routed_saved()
            saved = Saved(whole=saved.whole + (x - 1) * routed.whole, split=saved.split + (x - 1) * routed.split)
        kept = saved.per_rank(tp, sequence_parallel=sp) * n
        elementwise = 2 * kept / acc.memory_bandwidth
        if moe:
            # The routed experts' work on the busiest rank (x times the mean's), at the efficiency of one expert's
            # product on its tokens (a rank's n k tokens' copies spread over its E / ep experts); the rest at the
            # efficiency of the block's largest other product.
            routed_ops = model.routed_flops() * n / tp
            per_expert = n * model.top_k * x / (model.experts // c.ep)
            expert = compute(routed_ops * x, 2 * per_expert * h * model.moe_ffn / tp)
            biggest = 2 * n * model.largest_matrix() / tp
            f = compute(f_ops - routed_ops, biggest) + expert
            b = compute(b_ops - routed_ops, biggest) + expert
            w = compute(w_ops - routed_ops, biggest) + expert
        else:
            biggest = 2 * n * h * model.ffn / tp
            f, b, w = compute(f_ops, biggest), compute(b_ops, biggest), compute(w_ops, biggest)
        f += elementwise + tp_comm
        b += 2 * elementwise + tp_comm
        if c.cp > 1:  # the ring's steps beyond the attention core they overlap (keys and values; their gradients)
            ring_f, ring_b = ring_attention(model, tp, c.cp, n, cp_link.latency, cp_link.achieved)
            # the attention core's F operations; B does twice them
            scores = 2.0 * training.seq * model.heads * (model.qk_dim + model.v_dim) * n / tp
            f += max(0.0, ring_f - compute(scores, biggest))
            b += max(0.0, ring_b - compute(2 * scores, biggest))
        # Dispatch and combine in F; in B the same two, reversed (the outputs' gradients out, the inputs' back).
        return _Block(f, b, w, kept, 2 * exchange if moe else 0.0, 2 * exchange if moe else 0.0)

    kinds = {True: block(True), False: block(False)}
    hf, hb, hw = (y * n / tp for y in model.head_flops())
    head_biggest = 2 * n * h * model.vocab / tp
    logits = model.head_saved() * n / tp
    head_peak = model.head_peak() * n / tp
    head_f = compute(hf, head_biggest) + 2 * logits / acc.memory_bandwidth
    head_b = compute(hb, head_biggest) + 2 * logits / acc.memory_bandwidth
    head_w = compute(hw, head_biggest)
    overrides: dict[int, StageOverride] = {}
    params: list[float] = []
    experts: list[float] = []
    shared = (model.embedding_parameters() + model.head_parameters()) / stages if split else 0.0
    for s, st in enumerate(_stages(model, stages)):
        rerun = {"none": 0, "half": st.blocks // 2, "full": st.blocks}[c.recompute]
        # A stage's first blocks rerun (train --plan's counts), the dense ones first in the model.
        counts = {True: st.dense, False: st.moe}
        reruns = {True: min(rerun, st.dense), False: rerun - min(rerun, st.dense)}
        kept = rerun * block_input + sum((counts[d] - reruns[d]) * kinds[d].kept for d in kinds)
        memory = kept + (max(kinds[d].kept for d in kinds if reruns[d]) if rerun else 0.0)  # whole while it reruns
        head = st.head and not split
        if head:
            kept += logits
            memory += head_peak

        def total(part: str, counts: dict[bool, int] = counts) -> float:
            return sum(counts[d] * getattr(kinds[d], part) for d in kinds)

        rerun_f = sum(reruns[d] * kinds[d].f for d in kinds)
        rerun_x = sum(reruns[d] * kinds[d].exchange_f for d in kinds)  # a rerun forward exchanges again
        overrides[s] = StageOverride(f=total("f") + (head_f if head else 0.0),
                                     b=total("b") + (head_b if head else 0.0),
                                     w=total("w") + (head_w if head else 0.0),
                                     memory=memory, kept=kept, recompute=rerun_f,
                                     exchange_f=total("exchange_f"), exchange_b=total("exchange_b") + rerun_x)
        expert = st.moe * model.expert_parameters() / c.ep / tp
        experts.append(expert)
        params.append((st.dense * model.block_parameters(dense=True)
                       + st.moe * (model.block_parameters() - model.expert_parameters()) + shared
                       + (model.embedding_parameters() if st.embedding and not split else 0)
                       + (model.head_parameters() if head else 0)) / tp + expert)
    fits = {}
    if c.shards > 1 and not sharded:  # the DP actions' all-reduce among dp x cp, a ring on their link
        fits[c.shards] = ring_fit(c.shards, dp_link.latency, dp_link.achieved)
    if tp > 1 and tp not in fits:  # the receivers' all-gather of a message's pieces, on the tp link
        fits[tp] = ring_fit(tp, tp_link.latency, tp_link.achieved)
    # The experts' gradients are averaged among the dp / ep groups' copies (x cp) only, on the same link (their
    # replicas are ep copies apart): as many bytes as take that long in the DP actions' ring of dp x cp.
    grads = sum(params) - sum(experts)
    if c.shards > 1:
        grads += sum(experts) * _ring_share(c.expert_shards) / _ring_share(c.shards)
    # Split over the tokens, each tp rank sends its share to its counterpart and nothing is gathered; otherwise
    # the message crosses in tp pieces that the receivers all-gather (CostModel.mesh).
    # Split by vocabulary, the head's passes are the schedule's S and T (a pp-th each of the whole layer's costs
    # the simulator is given), its logits held between. Each device's S also waits for the last stage's output,
    # broadcast to the pipeline's devices, and the statistics' all-gather; its T for the reduce of the output's
    # gradient (each about a ring all-reduce of the bytes, on the pipeline's link): every device pays them, so the
    # whole layer's costs carry pp times them.
    cast = stats = 0.0
    if split:
        hidden = message / tp if sp else message
        cast = ring_allreduce(hidden, c.pp, pp_link.latency, pp_link.achieved)
        stats = ring_gather(3 * 4 * n * c.pp, c.pp, pp_link.latency, pp_link.achieved)
    cost = CostModel(stage_overrides=overrides, latency=pp_link.latency, bandwidth=pp_link.achieved,
                     activation_bytes=message / tp if sp else message, mesh=1 if sp else tp,
                     dp=1 if sharded else c.shards,
                     grad_bytes=4.0 * grads / c.pp, allreduce_fits=fits,
                     vocab_f=head_f + c.pp * (cast + stats) if split else 0.0,
                     vocab_b=head_b + c.pp * cast if split else 0.0, vocab_w=head_w if split else 0.0,
                     vocab_memory=head_peak if split else 0.0, exchange_overlap=model.moe)
    return cost, params


def _ring_share(ranks: int) -> float:
    """The fraction of its bytes a ring all-reduce among ``ranks`` sends from each (2 (r - 1) / r)."""
    return 2 * (ranks - 1) / ranks


def _expert_params(model: Transformer, stages: int, c: _Config) -> list[float]:
    """Each stage's routed experts' parameters on one of its devices: a ep-th of each MoE block's, over tp."""
    return [st.moe * model.expert_parameters() / c.ep / c.tp for st in _stages(model, stages)]


def all_to_all(model: Transformer, cluster: Cluster, *, tokens: int, tp: int = 1, cp: int = 1, ep: int = 1,
               imbalance: float = 1.0, node_limit: int = 0) -> tuple[float, float, float]:
    """One all-to-all of an MoE block on one rank for ``tokens`` tokens (the dispatch of their copies to their
    experts' ranks, or the combine's return): (seconds, bytes it sends over the network between nodes, bytes over
    its node's links). Each tp rank sends its share of the tokens, ``top_k`` copies of each token's hidden state
    (``imbalance`` times that on the busiest rank), those to the other ranks of its ep group only.

    An ep group is ep data-parallel copies tp x cp ranks apart: in a node while tp x cp x ep ranks fit one, every
    copy to another rank on the node's links ((ep - 1) / ep of them); past it, g nodes with ep / g of the group's
    ranks each, the copies to the other nodes' ranks ((ep - ep / g) / ep) on the network and those to the node's
    other ranks on its links, at once. With ``node_limit`` N (DeepSeek-V3's node-limited routing, uniform routing
    assumed): a token's experts are on N of the g nodes, its own among them one time in g / N, and its hidden state
    crosses to each of the others once (N (g - 1) / g crossings a token; with N >= g, the other nodes its k experts
    reach, (g - 1) (1 - (1 - 1 / g)^k); never more than its copies), the receiving rank forwarding it to its
    experts' ranks on the node's links (a token's copies that land on another rank than their arrival's:
    (ep / g - 1) / (ep / g) of them). The seconds: a latency of the link the group
    spans, then the longer of the two links' bytes over their achieved bandwidths."""
    if ep == 1 or not model.moe:
        return 0.0, 0.0, 0.0
    k, copy = model.top_k, float(model.value_bytes * model.hidden)
    sent = tokens / tp * imbalance  # tokens whose copies this rank sends
    per_node = cluster.devices_per_node
    if tp * cp * ep <= per_node:
        node = sent * k * (ep - 1) / ep * copy
        link = cluster.intra_node
        return link.latency + node / link.achieved, 0.0, node
    local = min(ep, max(1, per_node // (tp * cp)))  # the group's ranks in a node
    nodes = math.ceil(ep / local)
    remote = k * (ep - local) / ep  # copies a token sends to other nodes
    inside = k * (local - 1) / ep
    if node_limit:  # a crossing per other node reached, then forwarded inside it
        reach = (node_limit * (nodes - 1) / nodes if node_limit < nodes
                 else (nodes - 1) * (1 - (1 - 1 / nodes) ** k))
        remote, inside = min(remote, reach), k * (local - 1) / local
    network, node = sent * remote * copy, sent * inside * copy
    seconds = cluster.inter_node.latency + max(network / cluster.inter_node.achieved,
                                               node / cluster.intra_node.achieved)
    return seconds, network, node


def ring_attention(model: Transformer, tp: int, cp: int, tokens: int, latency: float,
                   bandwidth: float) -> tuple[float, float]:
    """Seconds of a block's context-parallel ring on one rank, forward and backward, for ``tokens`` tokens a rank:
    cp - 1 steps, each passing a rank's keys and values (its tp share of the key-value heads: one head where tp
    exceeds them; every head's with latent attention) to the next; the backward's steps carry their gradients
    too."""
    share = min(tp, model.heads if model.mla else model.kv_heads)
    step = latency + model.value_bytes * (model.k_width + model.v_width) / share * tokens / bandwidth
    return (cp - 1) * step, (cp - 1) * (2 * step - latency)


STATE_BYTES = {"none": (18.0, 0.0), "zero1": (6.0, 12.0), "fsdp": (0.0, 16.0)}
"""Bytes per parameter a device holds whole, and sharded over dp: bf16 weights 2, fp32 gradients 4, fp32 master
weights and AdamW's moments 12."""


STEADY = 8
"""Microbatches per pipeline device beyond which a schedule is in its steady state: every further microbatch adds
the same time and the same memory (none, for 1F1B-like ones). Beyond it the makespan, each device's busy time and
peak are extrapolated linearly from simulations at ``STEADY`` and ``STEADY + 1`` microbatches per device
(``tests/test_cluster.py`` checks them against simulating every microbatch)."""


class _Search:
    """The schedules built and the simulations run so far, shared by the configurations that can share them: the
    schedules of one pipeline length at a time (:meth:`length`; kept all, a large cluster's held hundreds of MB)."""

    def __init__(self) -> None:
        self.built: dict[tuple[str, int, int, bool, tuple[tuple[str, int], ...]], Any] = {}
        self.pp = 0
        self.skipped: list[str] = []
        # The last configuration's simulation: ZeRO-1 shards the optimizer state alone, and costs as unsharded.
        self.last: tuple[Any, tuple[float, list[float], list[float], list[float]] | None] | None = None

    def length(self, pp: int) -> None:
        """Costing pipelines of ``pp`` devices from here on: another length's schedules are let go."""
        if pp != self.pp:
            self.built = {key: None for key, run in self.built.items() if run is None}  # why they cannot: once
            self.pp = pp

    def schedule(self, family: str, pp: int, m: int, reduced: bool, **options: int) -> Any:
        key = (family, pp, m, reduced, tuple(sorted(options.items())))
        if key not in self.built:
            self.built[key] = _build(family, pp, m, reduced, self.skipped, **options)
        return self.built[key]

    def simulate(self, family: str, pp: int, m: int, reduced: bool, cost: CostModel,
                 **options: int) -> tuple[float, list[float], list[float], list[float]] | None:
        """(makespan, busy time of each device, peak activation bytes of each device, time each device spends in
        expert exchanges nothing computes under), or None where the schedule cannot run."""
        if m <= (STEADY + 1) * pp:
            run = self.schedule(family, pp, m, reduced, **options)
            if run is None:
                return None
            result = simulate(run, cost)
            exposed = list(result.exchange_exposed) or [0.0] * len(result.busy)
            return result.makespan, list(result.busy), list(result.peak_memory), exposed
        low, high = (self.simulate(family, pp, k * pp, reduced, cost, **options) for k in (STEADY, STEADY + 1))
        if low is None or high is None:
            return None
        t = (m - STEADY * pp) / pp

        def line(a: float, b: float) -> float:
            return a + t * (b - a)

        return (line(low[0], high[0]), [line(a, b) for a, b in zip(low[1], high[1], strict=True)],
                [line(a, b) for a, b in zip(low[2], high[2], strict=True)],
                [line(a, b) for a, b in zip(low[3], high[3], strict=True)])


def evaluate(cluster: Cluster, training: Training, *, families: Sequence[str] | None = None,
             recompute: Sequence[str] = RECOMPUTE, sharding: Sequence[str] = SHARDING,
             microbatch_sizes: Sequence[int] = MICROBATCH_SIZES,
             progress: Callable[[int, int], None] | None = None) -> tuple[list[ClusterPoint], int, list[str]]:
    """Every configuration, costed (see the module's docstring); how many were refused on their weights alone
    (more than the device holds before any activation: not simulated); why some shapes were left out. The
    families: ``families``, or :data:`FAMILIES` (and :data:`MOE_FAMILIES` for a model with experts)."""
    if families is None:
        families = FAMILIES + MOE_FAMILIES if training.model.moe else FAMILIES
    todo = _configs(cluster, training, families, recompute, microbatch_sizes)
    count, total = _search_work(todo, sharding, training)
    if total > MAX_SEARCH_WORK:  # its pipelines' lengths (divisors of the devices, up to the blocks) make it grow
        one = _search_work(_configs(cluster, training, families[:1], recompute, microbatch_sizes), sharding,
                           training)[1]
        fix = (f"search fewer --families ({families[0]} alone is {one:,})" if len(families) > 1 and
               one <= MAX_SEARCH_WORK else "plan a cluster of fewer devices")
        check_search(total, count, f"planning {training.model.name} on {cluster.devices:,} devices", fix)
    found: list[tuple[int, ClusterPoint]] = []
    search, refused = _Search(), 0
    # Pipeline length by length, the schedules of one kept at a time; the points in the configurations' order.
    for done, i in enumerate(sorted(range(len(todo)), key=lambda i: todo[i][0].pp)):
        c, family, m = todo[i]
        if progress is not None:
            progress(done, len(todo))
        search.length(c.pp)
        for shard in sharding:
            if shard != "none" and c.shards == 1:
                continue
            got = _point(cluster, training, c, family, shard, m, search)
            if got is None:
                refused += 1
            elif got is not _CANNOT:
                found.append((i, got))
    if progress is not None:
        progress(len(todo), len(todo))
    return [pt for _, pt in sorted(found, key=lambda x: x[0])], refused, search.skipped


def _configs(cluster: Cluster, training: Training, families: Sequence[str], recompute: Sequence[str],
             microbatch_sizes: Sequence[int]) -> list[tuple[_Config, str, int]]:
    """What :func:`evaluate` costs, before the sharding: each configuration, family and microbatches per copy. One
    line where no data-parallel degree of the cluster's layouts takes an expert-parallel degree searched."""
    todo = []
    found = layouts(cluster, training)
    eps = training.ep_degrees()
    if not any(dp % ep == 0 for dp, _, _, _ in found for ep in eps):
        dps = sorted({dp for dp, _, _, _ in found})
        raise ConfigError(f"no data-parallel degree of {cluster.devices} devices ({', '.join(map(str, dps))}) is a "
                          f"multiple of ep {', '.join(map(str, eps))}: ep groups are data-parallel copies; give --ep "
                          "a divisor of one, or another --nodes or --global-batch")
    combined = training.model.moe
    for (dp, cp, tp, pp), ep in itertools.product(found, eps):
        if dp % ep:
            continue
        per_copy = training.global_batch // dp
        for b in microbatch_sizes:
            if per_copy % b:
                continue
            # One device runs every family alike (its microbatches one after another): 1F1B stands for them.
            for family, rc in itertools.product(families if pp > 1 else ("1f1b",), recompute):
                for ref in _variants(family, training.seq_chunks if pp > 1 else (1,), training.split_vocab and pp > 1,
                                     combined and pp > 1):
                    todo.append((_Config(dp, tp, pp, b, rc, cp, ep), ref, per_copy // b))
    return todo


def _variants(family: str, chunks: Sequence[int], vocab: bool, combined: bool = False) -> list[str]:
    """``family`` for each of ``chunks`` sequence chunks it can take: its name alone for 1, ``name:seq_chunks=c``
    for more (a family that cannot cut microbatches is tried whole only); with ``vocab``, also ``name:vocab=1``
    where the family can split the output layer (whole microbatches: the two do not run together); with
    ``combined``, also ``name:combined=1`` where the family can pair each forward with a backward (combined 1F1B)."""
    spec = schedules.get(family)
    out = [family if c == 1 else f"{family}:{SEQ_CHUNKS}={c}" for c in chunks
           if c == 1 or spec.option(SEQ_CHUNKS) is not None]
    if vocab and spec.option(VOCAB) is not None:
        out.append(f"{family}:{VOCAB}=1")
    if combined and spec.option(COMBINED) is not None:
        out.append(f"{family}:{COMBINED}=1")
    return out


def _parsed(family: str) -> tuple[str, dict[str, int]]:
    """A family with its options (``1f1b:seq_chunks=2``): the name and the options."""
    ref = ScheduleRef.parse(family)
    return ref.name, dict(ref.kwargs)


def _search_work(todo: Sequence[tuple[_Config, str, int]], sharding: Sequence[str],
                 training: Training) -> tuple[int, int]:
    """(configurations, work) of costing ``todo`` under each of ``sharding``: the schedules simulated
    (:func:`pipefold.plan.limits.work`), one at the microbatches asked for, or two, at :data:`STEADY` and
    ``STEADY + 1`` per device, where they are extrapolated; ZeRO-1 reuses the unsharded simulation, and a
    schedule of more stages than blocks is not simulated."""
    count = total = 0
    for c, family, m in todo:
        hows = [how for how in sharding if how == "none" or c.shards > 1]
        count += len(hows)
        name, options = _parsed(family)
        if stages_of(name, c.pp, options) > training.model.layers:
            continue
        runs = [m] if m <= (STEADY + 1) * c.pp else [STEADY * c.pp, (STEADY + 1) * c.pp]
        units = options.get(SEQ_CHUNKS, 1)  # a schedule over chunks has as many units to build and simulate
        simulated = sum(schedule_work(name, c.pp, k * units, options) for k in runs)
        total += simulated * len({how == "fsdp" for how in hows})
    return count, total


def point(cluster: Cluster, training: Training, *, dp: int, tp: int, pp: int, schedule: str, microbatch: int,
          recompute: str = "none", sharding: str = "none", cp: int = 1, ep: int = 1, **options: int) -> ClusterPoint:
    """One configuration, costed as the search costs it (a published run's, to compare with its figures)."""
    check_cp(cp, training.seq)
    check_ep(ep, training.model)
    if dp * cp * tp * pp != cluster.devices:
        raise ConfigError(f"dp {dp} x cp {cp} x tp {tp} x pp {pp} is not the cluster's {cluster.devices} devices")
    if dp % ep:
        fits = [d for d in range(1, dp + 1) if dp % d == 0 and training.model.experts % d == 0]
        raise ConfigError(f"ep {ep} does not divide dp {dp}: an ep group is ep of the data-parallel copies; give ep "
                          f"one of {', '.join(map(str, fits))}")
    per_copy, rest = divmod(training.global_batch, dp * microbatch)
    if rest or not per_copy:
        raise ConfigError(f"a batch of {training.global_batch} does not split into dp {dp} x microbatches of "
                          f"{microbatch}")
    search = _Search()
    family = str(ScheduleRef.named(schedule, options)) if options else schedule  # its label names its options
    got = _point(cluster, training, _Config(dp, tp, pp, microbatch, recompute, cp, ep), family, sharding, per_copy,
                 search, refuse=False)
    if got is None or got is _CANNOT:
        raise ConfigError(search.skipped[0] if search.skipped else f"{schedule} cannot run {training.model.name} "
                          f"on {pp} devices")
    return got


def _build(family: str, pp: int, m: int, reduced: bool, skipped: list[str], **options: int) -> Any:
    """The schedule, with DP actions where ``reduced``; None (and why, in ``skipped``) where it cannot run."""
    from pipefold.schedules.dataparallel import with_data_parallel

    name, given = _parsed(family)
    try:
        schedule = schedules.build(name, pp, m, **given, **options)
    except ConfigError as err:
        skipped.append(f"{family} on {pp} devices, {m} microbatches: {err}")
        return None
    return with_data_parallel(schedule) if reduced else schedule


_CANNOT: Any = object()
"""A configuration whose schedule cannot run (its shape, or more stages than blocks)."""


def _point(cluster: Cluster, training: Training, c: _Config, family: str, shard: str, m: int, search: _Search, *,
           refuse: bool = True, **options: int) -> ClusterPoint | None:
    """One configuration costed; None where its weights alone do not fit (not simulated, with ``refuse``)."""
    model, acc = training.model, cluster.accelerator
    peak, usable = acc.peak(training.dtype), acc.memory_bytes * acc.usable_memory
    sharded = shard == "fsdp"
    plain = search.schedule(family, c.pp, min(m, (STEADY + 1) * c.pp), False, **options)  # stages, placement
    if plain is None or plain.stages > model.layers:
        return _CANNOT
    cost, params = _costs(cluster, training, c, plain.stages, sharded, split=bool(_parsed(family)[1].get(VOCAB)))
    whole, split = STATE_BYTES[shard]
    held = [sum(params[s] for s in plain.stages_of(d)) for d in range(c.pp)]
    most = max(held)
    # FSDP with one microbatch gathers a block's weights for its forward and again for its backward and frees them
    # after each (two blocks in flight, bf16); with several it gathers once and keeps the stage's weights for the
    # step (as torchtitan does with pipelines), their gradients accumulating unsharded in float32 over the
    # microbatches (FSDP2's accumulation without a sync upcasts them to its reduce dtype), reduce-scattered once at
    # the end.
    once = m > 1
    # The experts' state is sharded among the copies that hold the same experts (dp / ep of them, x cp) only.
    experts = _expert_params(model, plain.stages, c)
    held_experts = [sum(experts[s] for s in plain.stages_of(d)) for d in range(c.pp)]
    # The largest block on a rank (FSDP gathers two at a time): an MoE block with a ep-th of its experts, or dense.
    block = max(model.block_parameters() - model.expert_parameters() * (1 - 1 / c.ep),
                model.block_parameters(dense=True) if model.dense_blocks else 0) / c.tp
    statics = [(x - e) * (whole + split / c.shards) + e * (whole + split / c.expert_shards)
               + ((6 * x if once else 4 * block) if sharded else 0.0) for x, e in zip(held, held_experts, strict=True)]
    if refuse and max(statics) > usable:
        return None
    key = (c, family, m, sharded, tuple(options.items()))
    if search.last is None or search.last[0] != key:  # ZeRO-1's is the unsharded one's, costed just before
        search.last = (key, search.simulate(family, c.pp, m, c.shards > 1 and not sharded, cost, **options))
    simulated = search.last[1]
    if simulated is None:
        return _CANNOT
    makespan, busy, activations, exposed = simulated
    peaks = [st + act for st, act in zip(statics, activations, strict=True)]
    step = makespan
    busiest = max(range(c.pp), key=lambda d: held[d])
    most_experts = held_experts[busiest]
    if sharded:  # the weights gathered (bf16) and the gradients reduce-scattered (fp32), overlapped with the work
        link = cluster.link(c.tp * c.shards)
        gathers = 1 if once else 2
        comm = 0.0
        # The experts' among their dp / ep copies (x cp), on the same link (their replicas are ep copies apart).
        for part, ranks in ((most - most_experts, c.shards), (most_experts, c.expert_shards)):
            if not part:
                continue
            comm += (gathers * ring_gather(2 * part, ranks, link.latency, link.achieved)
                     + ring_gather(4 * part, ranks, link.latency, link.achieved))
        # One collective per block each time, each a ring of dp - 1 steps: their latency is paid block by block.
        parts = _stages(model, plain.stages)
        blocks = max(sum(parts[s].blocks for s in plain.stages_of(d)) for d in range(c.pp))
        comm += (gathers + 1) * max(blocks - 1, 0) * (c.shards - 1) * link.latency
        step = max(step, comm)
    # AdamW: 16 bytes in and out of each parameter a device steps (its shard of the state where it is sharded).
    stepped = (most - most_experts) / (c.shards if shard != "none" else 1)
    stepped += most_experts / (c.expert_shards if shard != "none" else 1)
    step += 32 * stepped / acc.memory_bandwidth
    tokens = training.global_batch * training.seq / step
    return ClusterPoint(dp=c.dp, tp=c.tp, pp=c.pp, schedule=family, microbatch=c.microbatch, microbatches=m,
                        recompute=c.recompute, sharding=shard, step_time=step, memory=max(peaks), static=max(statics),
                        fits=max(peaks) <= usable, tokens_per_second=tokens,
                        mfu=model.model_flops(training.seq) * tokens / (peak * cluster.devices),
                        bubble=1 - sum(busy) / len(busy) / makespan if makespan > 0 else 0.0,
                        sequence_parallel=training.sequence_parallel and c.tp > 1, cp=c.cp, ep=c.ep,
                        exchange_exposed=max(exposed))


TIE = 1e-3
"""Step times within this fraction of each other count as equal: the one with less memory is preferred."""


CLUSTER_PLAN_VERSION = 1


def run_section(point: ClusterPoint, training: Training, model_config: str) -> dict[str, Any]:
    """What ``pipefold train --plan`` runs of ``point`` (on the cluster, under torchrun): the model by its config,
    the shape, the layout, pipefold's layers per stage (the embedding first, each stage's blocks, the head last)
    and how many of each stage's first layers recompute."""
    model = training.model
    if model.family not in ("llama", "gpt2") or model.moe or model.mla:
        raise ConfigError(f"{model.name} is planned, not run: pipefold's runtime builds LLaMA and GPT-2 configs "
                          "without experts")
    if point.cp > 1:
        raise ConfigError(f"each sequence is split over cp {point.cp} ranks (context parallelism), which pipefold's "
                          f"runtime does not run for {model.family} configs: plan with --cp 1 to run it")
    if SEQ_CHUNKS in point.schedule:
        raise ConfigError(f"its microbatches are cut into sequence chunks ({point.schedule}), which pipefold's "
                          f"runtime runs for its own gpt model, not {model.family} configs: plan without --seq-chunks "
                          "to run it")
    if VOCAB in point.schedule and (point.dp > 1 or point.tp > 1):
        raise ConfigError(f"its output layer is split by vocabulary ({point.schedule}) over pipelines with dp "
                          f"{point.dp} x tp {point.tp} copies, which pipefold's runtime does not run yet: plan "
                          "without --split-vocab to run it")
    if point.sequence_parallel:
        raise ConfigError(f"its tp {point.tp} ranks split the tokens (sequence parallelism), which pipefold's runtime "
                          f"runs for its own gpt model, not {model.family} configs: plan with --no-sequence-parallel "
                          "to run it")
    name, options = _parsed(point.schedule)
    stages = schedules.build(name, point.pp, point.microbatches, **options).stages
    layer_stages, counts, at = [], [], 0
    for st in _stages(model, stages):
        size = st.blocks + st.embedding + st.head
        layer_stages.append(list(range(at, at + size)))
        at += size
        rerun = {"none": 0, "half": st.blocks // 2, "full": st.blocks}[point.recompute]
        counts.append(rerun + (1 if st.embedding and rerun else 0))  # the first layers: the embedding's first
    return {"model": model.family, "model_config": model_config, "seq": training.seq, "batch": training.global_batch,
            "schedule": point.schedule, "devices": point.pp, "microbatches": point.microbatches, "dp": point.dp,
            "tp": point.tp, "sharding": point.sharding, "layer_stages": layer_stages, "recompute": counts,
            "predicted": {"step_time_s": point.step_time, "tokens_per_second": point.tokens_per_second,
                          "memory_bytes": point.memory, "mfu": point.mfu}}


def _frontier(points: Iterable[ClusterPoint]) -> list[ClusterPoint]:
    """The points no other is faster than (by more than :data:`TIE`) with no more memory, fastest first."""
    out: list[ClusterPoint] = []
    for pt in sorted(points, key=lambda p: (p.memory, p.step_time)):
        if not out or pt.step_time < out[-1].step_time * (1 - TIE):
            out.append(pt)
    return out[::-1]


def plan_cluster(cluster: Cluster, training: Training, *,
                 progress: Callable[[int, int], None] | None = None, **search: Any) -> ClusterPlan:
    """The fastest configuration that fits, every point evaluated and the frontier of the fitting ones."""
    started = time.perf_counter()
    points, refused, skipped = evaluate(cluster, training, progress=progress, **search)
    fitting = [p for p in points if p.fits]
    fastest = min((p.step_time for p in fitting), default=math.inf)
    best = min((p for p in fitting if p.step_time <= fastest * (1 + TIE)), key=lambda p: (p.memory, p.step_time),
               default=None)
    return ClusterPlan(best=best, points=tuple(points), frontier=tuple(_frontier(fitting)),
                       evaluated=len(points) + refused, refused=refused, seconds=time.perf_counter() - started,
                       skipped=tuple(skipped))

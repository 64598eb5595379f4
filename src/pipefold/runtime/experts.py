"""Mixture-of-experts stages in a pipeline: the load-balancing loss over the whole batch across data-parallel copies,
the schedules it runs with (:mod:`pipefold.models.moe` says how the loss is computed microbatch by microbatch), and
expert parallelism.

**Expert parallelism.** :func:`shard_experts` spreads each MoE layer's experts over the ranks of a group (``ep`` of
them): rank ``i`` keeps experts ``i * E/ep`` to ``(i + 1) * E/ep - 1`` and the layer's dispatch becomes two
all-to-alls. Each rank routes its own tokens, sends every (token, choice) to the rank that holds the chosen expert
(the token's row, its expert's id), runs its experts on what it received and sends the outputs back, where they are
weighted and summed per token as before. Both exchanges are differentiable (:class:`_AllToAll`): the backward
sends the outputs' gradients to the experts and the inputs' gradients back. An expert's gradient is then the sum
over its group's tokens. A rank's exchanges all go through one :class:`ExpertLink`, the forwards' on one process
group and the backwards' on another, which records them by pass and, with ``overlap``, lets an overlapped pair's
two parts take turns computing on a :class:`Baton` so that one's exchanges run under the other's compute (the
executor runs the pair so). The experts' output starts from zeros that depend on what arrived, so that a rank
whose experts get no token still reaches both exchanges in its backward, as every rank of the group must.

The group is a stage's ``dp`` data-parallel copies cut into ``dp/ep`` groups of ``ep`` consecutive ones
(:func:`expert_groups`: copy ``i`` in group ``i // ep``, at rank ``i % ep`` within it, as Megatron-LM and DeepSeek
put ep inside dp). With ``ep = dp`` an expert is on one copy; with fewer, the copies at the same rank of every
group hold the same experts (replicas, the expert data-parallel group). The data-parallel reduction does not
average an expert's gradient with the other copies' (they hold other experts): it sums it over its replicas (an
all-reduce, :attr:`REPLICAS`; nothing to do with ``ep = dp``) and scales it by 1/dp, which is what the mean over
the copies of each copy's loss gives it (:attr:`EXPERT`). The load-balancing loss still counts the choices of all
``dp`` copies (:func:`sum_balance_over`), and so do the router biases' steps (:func:`step_router_biases`)."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule
from pipefold.models.moe import MoE, recomputing, update_router_bias

if TYPE_CHECKING:
    from pipefold.sim.network import Network

__all__ = ["EXPERT", "REPLICAS", "Baton", "ExpertLink", "ExpertShard", "balanced_stages", "begin_balance_step",
           "biased_stages", "check_balance_order", "check_overlap", "expert_groups", "expert_link", "exposed",
           "shard_experts", "step_router_biases", "sum_balance_over"]

EXPERT = "pipefold_expert_parallel"
"""The attribute an expert's parameter carries once :func:`shard_experts` spread its layer's experts over the copies:
the data-parallel reduction leaves such a gradient on its rank (scaled by 1/copies), summed over its replicas
first where it has some (:attr:`REPLICAS`)."""

REPLICAS = "pipefold_expert_replicas"
"""The attribute an expert's parameter carries where other copies hold the same expert (expert parallelism over
fewer ranks than the copies): the process group of those replicas (this rank's among them), over which the
data-parallel reduction sums its gradient."""

_BACKWARDS = (Kind.B, Kind.BW)


def balanced_stages(modules: Mapping[int, nn.Module]) -> list[int]:
    """The stages among ``modules`` with a MoE whose load-balancing loss is on (a weight above 0)."""
    return sorted(s for s, m in modules.items()
                  if any(isinstance(x, MoE) and x.cfg.aux_loss > 0 for x in m.modules()))


def check_balance_order(schedule: Schedule, stages: Iterable[int]) -> None:
    """Refuse in one line a schedule that runs a backward of one of ``stages`` before that stage's last forward of
    the step: the load-balancing loss over the whole batch needs every microbatch's choices first."""
    for s in stages:
        if len(schedule.holders(s)) > 1:
            raise ConfigError(f"{schedule.name} holds stage {s} on {len(schedule.holders(s))} devices, each running "
                              "part of the batch, and the load-balancing loss over the whole batch needs every "
                              "microbatch's choices in one place: use a schedule without replicas, or a MoE with "
                              "aux_loss 0")
        row = schedule.actions[schedule.device_of(s)]
        passes = [a for act in row for a in act.passes if a.stage == s]
        last_f = max((i for i, a in enumerate(passes) if a.kind == Kind.F), default=-1)
        first_b = min((i for i, a in enumerate(passes) if a.kind in _BACKWARDS), default=len(passes))
        if first_b < last_f:
            raise ConfigError(f"{schedule.name} runs a backward of stage {s} before its last forward, and the "
                              "load-balancing loss over the whole batch needs every microbatch's choices first: use "
                              "gpipe or looped-bfs (a stage's forwards first), or a MoE with aux_loss 0")


def check_overlap(schedule: Schedule, flag: str, *, recompute: bool = False) -> None:
    """Refuse in one line the overlap of expert exchanges (``flag``) where ``schedule`` has no overlapped pair to
    run it in, or with recomputation (a backward that runs its forward again would exchange on the forwards'
    group while another forward does)."""
    if not any(len(a.passes) > 1 for row in schedule.actions for a in row):
        raise ConfigError(f"{flag} runs one microbatch's expert all-to-alls under another's compute in overlapped "
                          f"pairs (F+B), and {schedule.name} has none: use dualpipe, dualpipev or 1f1b:combined=1")
    if recompute:
        raise ConfigError(f"{flag} does not run with recomputation yet (a recomputed forward would exchange beside "
                          "another forward): drop one of them")


def sum_balance_over(modules: Iterable[nn.Module], group: Any) -> int:
    """Have every MoE in ``modules`` sum its batch's expert counts over ``group`` (the data-parallel copies), so that
    each copy's load-balancing loss is the whole batch's; returns how many MoE layers it reached."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    found = 0
    for module in modules:
        for m in module.modules():
            if isinstance(m, MoE):
                m.balance.reduce = reduce
                found += 1
    return found


def step_router_biases(modules: Iterable[nn.Module], group: Any, *, apply: bool = True) -> int:
    """After a step: move the router biases of the MoE layers in ``modules`` that balance by bias
    (:func:`pipefold.models.moe.update_router_bias`), their counts summed over ``group`` (the data-parallel copies;
    None: one copy), so that every copy moves alike on the whole batch's counts. ``apply=False``: a skipped step,
    whose counts are forgotten (the collective runs all the same, as on the copies that step)."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    return update_router_bias(modules, reduce if group is not None else None, apply=apply)


def biased_stages(modules: Mapping[int, nn.Module]) -> list[int]:
    """The stages among ``modules`` with a MoE that balances by router bias (``bias_update`` above 0)."""
    return sorted(s for s, m in modules.items()
                  if any(isinstance(x, MoE) and x.router_bias is not None for x in m.modules()))


def begin_balance_step(modules: Iterable[nn.Module]) -> None:
    """A step starts: every MoE in ``modules`` counts its choices afresh, and refuses a forward after a backward."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, MoE):
                m.balance.begin_step()


class Baton:
    """Who computes, where an overlapped pair runs its two parts on two threads (:class:`ExpertLink`): a part
    computes only while it holds the baton, and lets go of it for the length of each expert exchange, so that the
    other part computes meanwhile. The two never compute at once; one's communication runs under the other's
    compute. Records when it was held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._since = 0.0
        self.held: list[tuple[float, float]] = []
        """(start, end) of every time a part held it, by ``time.perf_counter``."""

    def __enter__(self) -> Baton:
        self._lock.acquire()
        self._owner, self._since = threading.get_ident(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.held.append((self._since, time.perf_counter()))
        self._owner = None
        self._lock.release()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Let go of it for the length of the block, where this thread holds it (else nothing)."""
        if self._owner != threading.get_ident():
            yield
            return
        self.__exit__()
        try:
            yield
        finally:
            self.__enter__()


class ExpertLink:
    """The all-to-alls of one rank's MoE layers with the other ranks of its expert-parallel group.

    The exchanges of forwards run on one process group and those of backwards on another: collectives pair up by
    order on a group, and where a forward and a backward run at once (an overlapped pair) each side's order is the
    same on every rank of the group, while the two interleave differently. While a :class:`Baton` is set, an
    exchange lets go of it for its length. With a ``network`` (``train --network``), every exchange also lasts as
    long as its bytes take on links of the network's default conditions, to and from each other rank of the group
    (one :class:`~pipefold.sim.network.Wire` per direction and peer, on the timeline from ``origin``).

    Every exchange is recorded: (the pass it ran in, start, end), by ``time.perf_counter``."""

    def __init__(self, group: Any, index: int, size: int, *, network: Network | None = None,
                 origin: float = 0.0) -> None:
        self.index, self.size = index, size
        ranks = dist.get_process_group_ranks(group)
        self.groups = (group, dist.new_group(ranks, use_local_synchronization=True))
        self.baton: Baton | None = None
        self.overlap = False
        """Whether overlapped pairs run their parts on two threads, each's exchanges under the other's compute (the
        runtime's executor reads it); otherwise a pair runs its forward, then its backward."""
        self.network, self.origin = network, origin
        self._wires: dict[tuple[str, int], Any] = {}
        self.records: list[tuple[str | None, float, float]] = []
        self._where = threading.local()

    @contextlib.contextmanager
    def in_pass(self, label: str) -> Iterator[None]:
        """Record the exchanges of the block as those of pass ``label`` (this thread's)."""
        self._where.label = label
        try:
            yield
        finally:
            self._where.label = None

    def exchange(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], *,
                 backward: bool = False) -> torch.Tensor:
        """All-to-all ``inp`` (rows ``in_splits[j]`` to rank j of the group) into ``out`` (``out_splits[j]`` rows
        from rank j), on the backward's group where ``backward``; returns ``out``."""
        start, wall = time.perf_counter(), time.time()
        with self.baton.released() if self.baton is not None else contextlib.nullcontext():
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.groups[backward])
            if self.network is not None:
                row = math.prod(inp.shape[1:]) * inp.element_size()  # bytes of one row, even of none
                done = self.origin + self._emulated(wall - self.origin, [n * row for n in in_splits],
                                                    [n * row for n in out_splits])
                time.sleep(max(0.0, done - time.time()))
            end = time.perf_counter()  # before the baton is taken back: the other part may still compute
        self.records.append((getattr(self._where, "label", None), start, end))
        return out

    def _emulated(self, at: float, sent: list[int], received: list[int]) -> float:
        """When, on the network's timeline, an exchange that started ``at`` is over on the emulated links: the last
        of its messages to arrive, each on its own wire per direction and peer."""
        from pipefold.sim.network import Wire

        assert self.network is not None
        latest = at
        for peer in range(self.size):
            if peer == self.index:
                continue
            for way, nbytes in (("out", sent[peer]), ("in", received[peer])):
                wire = self._wires.get((way, peer))
                if wire is None:
                    wire = self._wires[way, peer] = Wire(self.network.default)
                latest = max(latest, wire.send(at, float(nbytes)))
        return latest

    def take(self) -> list[tuple[str | None, float, float]]:
        """The exchanges recorded since the last call."""
        out, self.records = self.records, []
        return out


def exposed(exchanges: Iterable[tuple[float, float]], computing: Iterable[tuple[float, float]]) -> float:
    """Seconds of the union of ``exchanges`` that no interval of ``computing`` covers: communication nothing
    computed under."""
    total = 0.0
    spans = sorted(computing)
    for a, b in _union(exchanges):
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in _union(spans))
        total += (b - a) - covered
    return total


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class _AllToAll(torch.autograd.Function):
    """A differentiable all-to-all on an :class:`ExpertLink`: the backward sends the gradients back the other way,
    on the link's backward group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link: ExpertLink, out_splits: list[int],
                in_splits: list[int]) -> torch.Tensor:
        ctx.link, ctx.splits = link, (out_splits, in_splits)
        return link.exchange(x.new_empty(sum(out_splits), *x.shape[1:]), x.contiguous(), out_splits, in_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        return ctx.link.exchange(back, grad.contiguous(), in_splits, out_splits, backward=True), None, None, None


class ExpertShard:
    """One MoE layer's experts on one rank of an expert-parallel group, and the dispatch that reaches the others."""

    def __init__(self, moe: MoE, link: ExpertLink) -> None:
        experts, size = moe.cfg.experts, link.size
        if experts % size:
            fits = [str(d) for d in range(1, experts + 1) if experts % d == 0]
            raise ConfigError(f"{size} expert-parallel ranks cannot share {experts} experts equally: give a number of "
                              f"copies that divides {experts} ({', '.join(fits)})")
        self.moe, self.link = moe, link
        self.per = experts // size
        self.first = link.index * self.per
        for e in range(experts):  # another rank's expert leaves a placeholder: the kept ones keep their names
            if not self.first <= e < self.first + self.per:
                moe.experts[e] = nn.Identity()
        for e in range(self.first, self.first + self.per):
            for p in moe.experts[e].parameters():
                setattr(p, EXPERT, True)
        self.sent_tokens = 0
        """(token, choice) pairs this rank has sent to other ranks' experts so far."""
        moe.dispatch = self.dispatch

    def dispatch(self, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k, link = chosen.shape[-1], self.link
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, so by the rank that holds it
        expert = flat[order]
        token = torch.arange(h.shape[0], device=h.device).repeat_interleave(k)[order]
        weight = weights.reshape(-1)[order]
        send = torch.bincount(expert // self.per, minlength=link.size)
        recv = torch.empty_like(send)
        ones = [1] * link.size
        link.exchange(recv, send, ones, ones)
        out_splits, in_splits = recv.tolist(), send.tolist()
        ids = link.exchange(torch.empty(sum(out_splits), dtype=expert.dtype, device=h.device), expert.contiguous(),
                            out_splits, in_splits)
        got = _AllToAll.apply(h[token], link, out_splits, in_splits)
        # Zeros that depend on what arrived: where this rank's experts got no token in this microbatch the graph
        # still runs through both exchanges, so the backward exchanges them as every other rank of the group does
        # (a collective inside the backward must be reached on every rank, whatever the routing).
        done = got * 0
        for e in range(self.first, self.first + self.per):
            mine = (ids == e).nonzero().squeeze(-1)
            if mine.numel():
                done = done.index_add(0, mine, self.moe.experts[e](got[mine]))
        back = _AllToAll.apply(done, link, in_splits, out_splits)
        if not recomputing():  # a rerun's exchanges send the same tokens again: counted once
            self.sent_tokens += int(send.sum() - send[link.index])
        return torch.zeros_like(h).index_add(0, token, back * weight.unsqueeze(-1).to(h.dtype))


def expert_link(modules: Iterable[nn.Module]) -> ExpertLink | None:
    """The :class:`ExpertLink` of the MoE layers in ``modules`` whose experts :func:`shard_experts` spread; None
    where there are none."""
    for module in modules:
        for m in module.modules():
            shard = getattr(m.dispatch, "__self__", None) if isinstance(m, MoE) else None
            if isinstance(shard, ExpertShard):
                return shard.link
    return None


def expert_groups(dp_group: Any, ep: int,
                  new_group: Callable[[list[int]], Any] | None = None) -> tuple[Any, Any]:
    """This rank's expert-parallel group and its replica group (None with ``ep`` equal to the copies) among the
    data-parallel copies ``dp_group``: copy ``i`` (its rank in ``dp_group``) is rank ``i % ep`` of group ``i // ep``,
    and its replicas are the copies with the same ``i % ep``. ``new_group(ranks)`` makes a group of global ranks
    (by default torch's, made by its members only), called by every rank of ``dp_group`` for its own two groups,
    the expert-parallel one first."""
    if new_group is None:
        def new_group(ranks: list[int]) -> Any:
            return dist.new_group(ranks, use_local_synchronization=True)
    copies = dist.get_world_size(dp_group)
    if ep == copies:
        return dp_group, None
    ranks, i = dist.get_process_group_ranks(dp_group), dist.get_rank(dp_group)
    first = i // ep * ep
    return new_group(list(ranks[first:first + ep])), new_group(list(ranks[i % ep::ep]))


def shard_experts(modules: Iterable[nn.Module], group: Any, replicas: Any = None, *, network: Network | None = None,
                  origin: float = 0.0) -> list[ExpertShard]:
    """Spread the experts of every MoE layer in ``modules`` over the ranks of ``group`` (this rank keeps its share;
    every rank of the group must hold the same layers), their exchanges on one :class:`ExpertLink` (with
    ``network``, on emulated links). Refused in one line where the ranks do not divide the experts.
    ``replicas``: the process group of the ranks that hold the same experts in other groups
    (:func:`expert_groups`), which their parameters carry (:attr:`REPLICAS`)."""
    layers = [m for module in modules for m in module.modules() if isinstance(m, MoE)]
    if not layers:
        return []
    link = ExpertLink(group, dist.get_rank(group), dist.get_world_size(group), network=network, origin=origin)
    shards = [ExpertShard(m, link) for m in layers]
    if replicas is not None:
        for shard in shards:
            for e in range(shard.first, shard.first + shard.per):
                for p in shard.moe.experts[e].parameters():
                    setattr(p, REPLICAS, replicas)
    return shards

"""Vocabulary Parallelism on one rank: its shard of the output layer, and the passes ``S`` and ``T`` that run it.

The output projection (vocabulary x hidden) is cut by rows into one shard per device of the pipeline, padded with
zero rows to a multiple of the devices; a padding row's logit is left out of the softmax, so it takes no part in the
loss and gets no gradient. The last stage ends before the projection: its output (the hidden states) is the
shards' input, and the loss is the mean cross entropy over every position, as one process computes it.

For each microbatch (Algorithm 1 of Yeung et al., with the statistics shared once):

    F of the last stage   its output posted to every rank of the pipeline (an asynchronous broadcast)
    S on every rank       logits of the shard; per position their max, their sum of exponentials against it and the
                          target's logit where the target is in the shard; those statistics posted to every rank
                          (an asynchronous all-gather)
    T on every rank       the statistics of all shards joined into each position's log-sum-exp, so the loss and the
                          shard's softmax; its weight gradient, and its part of the hidden states' gradient posted to
                          the last stage's rank (an asynchronous reduce, summed over the shards)
    B of the last stage   starts from that sum

Every collective of one kind pairs up by order, so every rank runs its S and its T in the same microbatch order
(the schedule's validation says so) and the last stage its forwards in that order too (checked where the passes
are made). The collectives run on three process groups of their own, beside the pipeline's messages.

The input embedding (a matrix of the same vocabulary's rows, its own weights) splits the same way, outside the
schedule's passes (:class:`EmbeddingPasses`): at the step's start every rank looks up the tokens of every microbatch
that fall in its rows (zero for the others) and the parts are summed on the first stage's rank, whose first stage
takes the embeddings as its input; at the step's end that rank sends every microbatch's gradient of them to every
rank, which adds its rows' part into its shard's gradient. A lookup is cheap, and the two collectives run once per
microbatch each way.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError
from pipefold.runtime.meter import MemoryMeter

__all__ = ["IGNORE", "EmbeddingPasses", "VocabPasses", "VocabShard", "padded_vocab"]

IGNORE = -100
"""A target that takes no part in the loss, as torch's cross entropy ignores it (its default ``ignore_index``)."""


def padded_vocab(vocab: int, devices: int) -> int:
    """The vocabulary padded to a multiple of ``devices``: what the shards hold together."""
    return -(-vocab // devices) * devices


class VocabShard(nn.Module):
    """Device ``index``'s rows of an output projection (or an input embedding) of ``vocab`` entries split over
    ``devices``: rows ``index * size`` to ``(index + 1) * size`` of the matrix padded to :func:`padded_vocab` rows
    (``weight``: size x hidden). A row past ``vocab`` is padding: its logit is left out, no token looks it up.
    ``padding_idx``: an embedding's entry whose row takes no gradient (``nn.Embedding``'s own)."""

    def __init__(self, weight: torch.Tensor, *, index: int, devices: int, vocab: int,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ConfigError(f"a vocabulary shard is a matrix of rows x hidden (got shape {tuple(weight.shape)})")
        size = weight.shape[0]
        if size * devices != padded_vocab(vocab, devices) or not 0 <= index < devices:
            raise ConfigError(f"shard {index} of a vocabulary of {vocab:,} over {devices} devices holds "
                              f"{padded_vocab(vocab, devices) // devices:,} rows (got {size:,})")
        self.weight = nn.Parameter(weight)
        self.index, self.devices, self.vocab = index, devices, vocab
        self.start = index * size
        self.real = max(0, min(size, vocab - self.start))
        """How many of its rows are entries of the vocabulary (the rest padding)."""
        self.padding_idx = None if padding_idx is None else padding_idx % vocab

    @classmethod
    def of(cls, weight: torch.Tensor, index: int, devices: int, *, padding_idx: int | None = None) -> VocabShard:
        """Device ``index``'s shard of the whole matrix ``weight`` (vocabulary x hidden: an output projection's, or
        an input embedding's, with its ``padding_idx``), a copy."""
        vocab, hidden = weight.shape
        size = padded_vocab(vocab, devices) // devices
        if size * devices != vocab and index == 0:
            warnings.warn(f"a vocabulary of {vocab:,} does not divide over {devices} devices: padded with "
                          f"{size * devices - vocab} zero rows to {size * devices:,}, which take no part in the loss",
                          stacklevel=2)
        rows = weight.detach()[index * size:(index + 1) * size]
        if rows.shape[0] < size:
            rows = torch.cat([rows, rows.new_zeros(size - rows.shape[0], hidden)])
        return cls(rows.clone(), index=index, devices=devices, vocab=vocab, padding_idx=padding_idx)

    def extra_repr(self) -> str:
        return f"shard {self.index} of {self.devices}: rows {self.start}..{self.start + self.real - 1} of {self.vocab}"


class VocabPasses:
    """One rank's ``S`` and ``T``: ``rank`` is its device in the pipeline of process-group ranks ``ranks``,
    ``last`` the device of the last stage; ``groups``: three process groups of ``ranks`` (the hidden states, the
    statistics, the gradients)."""

    def __init__(self, shard: VocabShard, *, rank: int, ranks: Sequence[int], last: int, groups: Sequence[Any],
                 meter: MemoryMeter) -> None:
        _check_shard(shard, rank, len(ranks), "vocabulary", "weight")
        self.shard, self.rank, self.ranks, self.last = shard, rank, list(ranks), last
        self.hidden_group, self.stats_group, self.grad_group = groups
        self.meter = meter
        self._sent: dict[int, tuple[Any, torch.Tensor, torch.Size]] = {}  # mb -> broadcast, hidden, output shape
        self._stats: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        self._kept: dict[int, tuple[torch.Tensor, ...]] = {}
        self._grads: dict[int, tuple[Any, torch.Tensor]] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []  # collectives this rank only contributes to

    @property
    def many(self) -> bool:
        return len(self.ranks) > 1

    def send_hidden(self, mb: int, out: torch.Tensor) -> None:
        """After the last stage's forward of ``mb`` (on its rank): its output to every rank."""
        hidden = out.detach().to(self.shard.weight.dtype).reshape(-1, out.shape[-1]).contiguous()
        work = dist.broadcast(hidden, self.ranks[self.last], group=self.hidden_group, async_op=True) \
            if self.many else None
        self._sent[mb] = (work, hidden, out.shape)

    def forward(self, mb: int, target: Any, *, infer: bool = False) -> torch.Tensor | None:
        """``S`` of ``mb``: the shard's logits and their statistics, shared. In a forward-only step the statistics
        are joined at once and the microbatch's loss returned (None without a target)."""
        if infer and target is None:
            return None
        if not isinstance(target, torch.Tensor):
            raise ConfigError(f"with the output layer split by vocabulary every rank computes its shard's part of the "
                              f"loss: give every rank the batch's targets (Pipeline.step(..., target=y) on each), "
                              f"got {type(target).__name__}")
        weight = self.shard.weight
        t = target.reshape(-1)
        if self.rank == self.last:
            work, x, _ = self._sent.pop(mb) if infer else self._sent[mb]
            if work is not None:
                self._pending.append((work, x))
        else:
            x = torch.empty(t.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device)
            dist.broadcast(x, self.ranks[self.last], group=self.hidden_group)
        if x.shape[0] != t.numel():
            raise ConfigError(f"the last stage's output has {x.shape[0]:,} positions and the target "
                              f"{t.numel():,}: give one target per position of the output")
        with torch.no_grad():
            logits = x @ weight.t()
            real, size = self.shard.real, weight.shape[0]
            if real < size:
                logits[:, real:] = -math.inf
            valid = t != IGNORE
            local = t - self.shard.start
            inside = (local >= 0) & (local < real) & valid
            local = local.clamp(0, max(size - 1, 0))
            if real:
                most = logits.max(dim=-1).values
                total = torch.exp(logits - most[:, None]).sum(dim=-1)
                picked = torch.where(inside, logits.gather(1, local[:, None]).squeeze(1), 0.0)
            else:
                most = torch.full_like(logits[:, 0], -math.inf)
                total = picked = torch.zeros_like(most)
            stats = torch.stack([most, total, picked])
        gathered = [torch.empty_like(stats) for _ in self.ranks]
        if infer:
            if self.many:
                dist.all_gather(gathered, stats, group=self.stats_group)
            else:
                gathered = [stats]
            return _loss(torch.stack(gathered), valid)[0]
        self.meter.hold((logits, x), "vocab")
        work = dist.all_gather(gathered, stats, group=self.stats_group, async_op=True) if self.many else None
        if work is None:
            gathered = [stats]
        self._stats[mb] = (work, gathered)
        self._kept[mb] = (x, logits, inside, local, valid)
        return None

    def backward(self, mb: int, scale: float) -> torch.Tensor:
        """``T`` of ``mb``: the loss, the shard's weight gradient (of the loss times ``scale``) and its part of the
        hidden states' gradient, posted to the last stage's rank. Returns the microbatch's loss."""
        work, gathered = self._stats.pop(mb)
        if work is not None:
            work.wait()
        x, logits, inside, local, valid = self._kept.pop(mb)
        loss, top, total = _loss(torch.stack(gathered), valid)
        weight = self.shard.weight
        with torch.no_grad():
            grad = torch.exp(logits - top[:, None]).div_(total[:, None])  # the shard's softmax; padding: 0
            rows = torch.nonzero(inside).squeeze(1)
            grad[rows, local[rows]] -= 1.0
            grad.mul_(valid[:, None])  # an ignored position: no gradient
            grad.mul_(scale / max(int(valid.sum()), 1))
            dx = grad @ weight
            dw = grad.t() @ x
            if weight.grad is None:
                weight.grad = dw
            else:
                weight.grad += dw
        del logits, grad
        if self.many:
            reduced = dist.reduce(dx, self.ranks[self.last], group=self.grad_group, async_op=True)
            if self.rank == self.last:
                self._grads[mb] = (reduced, dx)
            else:
                self._pending.append((reduced, dx))
        else:
            self._grads[mb] = (None, dx)
        return loss

    def grad(self, mb: int) -> torch.Tensor:
        """The gradient of the last stage's output of ``mb``, summed over every shard (on its rank)."""
        work, dx = self._grads.pop(mb)
        _, hidden, shape = self._sent.pop(mb)
        if work is not None:
            work.wait()
        return dx.reshape(shape)

    def end_step(self) -> None:
        """Wait for what this rank contributed to (its broadcasts, its gradients' reduces): their tensors are
        free then."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        left = [(name, mb) for name, table in (("sent", self._sent), ("stats", self._stats), ("kept", self._kept),
                                              ("grads", self._grads)) for mb in table]
        if left:
            raise RuntimeError(f"rank {self.rank} ended a step with vocabulary passes of microbatches {left[:3]} not "
                               "finished")


class EmbeddingPasses:
    """One rank's part of the input embedding split by vocabulary: ``rank`` is its device in the pipeline of
    process-group ranks ``ranks``, ``first`` the device of the first stage, ``group`` a process group of
    ``ranks`` of its own."""

    def __init__(self, shard: VocabShard, *, rank: int, ranks: Sequence[int], first: int, group: Any,
                 meter: MemoryMeter) -> None:
        _check_shard(shard, rank, len(ranks), "embedding", "embedding.weight")
        self.shard, self.rank, self.ranks, self.first, self.group = shard, rank, list(ranks), first, group
        self.others = [r for d, r in enumerate(ranks) if d != rank]
        """The pipeline's other ranks: what its two collectives wait for."""
        self.meter = meter
        # Per microbatch of a training step: its positions, those whose rows are here and which rows they are.
        self._looked: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._grads: dict[int, torch.Tensor] = {}

    def forward(self, tokens: Sequence[Any], *, keep: bool) -> list[torch.Tensor] | None:
        """Every rank, at the step's start: the embeddings of every microbatch's ``tokens``, each rank's rows
        summed on the first stage's rank, which gets them (None on the others). ``keep``: a training step, whose
        :meth:`end_step` computes the shard's gradient."""
        weight = self.shard.weight
        parts, works = [], []
        self._looked = []
        for mb, t in enumerate(tokens):
            if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex():
                what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a tensor of {t.dtype}"
                raise ConfigError(f"with the input embedding split by vocabulary every rank looks up its rows of the "
                                  f"batch's tokens: give every rank the batch's token ids (integers) as the first "
                                  f"input of Pipeline.step, got {what} for microbatch {mb}")
            local = t.reshape(-1) - self.shard.start
            inside = (local >= 0) & (local < self.shard.real)
            padding = self.shard.padding_idx  # nn.Embedding's padding entry: its row takes no gradient
            inside_grad = inside if padding is None else inside & (local != padding - self.shard.start)
            with torch.no_grad():
                part = weight.new_zeros(local.numel(), weight.shape[1])
                part[inside] = weight[local[inside]]
            if keep:
                rows = torch.nonzero(inside_grad).squeeze(1)
                self._looked.append((local.numel(), rows, local[rows]))
            work = dist.reduce(part, self.ranks[self.first], group=self.group, async_op=True) \
                if len(self.ranks) > 1 else None
            parts.append(part.view(*t.shape, weight.shape[1]))
            works.append(work)
        for work in works:
            if work is not None:
                work.wait()
        if self.rank != self.first:
            return None
        self.meter.hold(parts, "vocab")
        return parts

    def keep_grad(self, mb: int, grad: torch.Tensor) -> None:
        """On the first stage's rank: the gradient of microbatch ``mb``'s embeddings, which its B made."""
        self._grads[mb] = grad
        self.meter.hold((grad,), "vocab")

    def end_step(self) -> None:
        """Every rank, at a training step's end: every microbatch's gradient of its embeddings from the first
        stage's rank, its rows' part added into the shard's gradient."""
        weight = self.shard.weight
        if self.rank == self.first and len(self._grads) != len(self._looked):
            raise RuntimeError(f"the first stage ended a step with the gradients of {len(self._grads)} of "
                               f"{len(self._looked)} microbatches' embeddings")
        dw = torch.zeros_like(weight) if self._looked else None
        received = []
        for mb, (positions, rows, local) in enumerate(self._looked):
            if self.rank == self.first:
                grad = self._grads.pop(mb).detach().reshape(-1, weight.shape[1]).to(weight.dtype).contiguous()
            else:
                grad = weight.new_empty(positions, weight.shape[1])
            work = dist.broadcast(grad, self.ranks[self.first], group=self.group, async_op=True) \
                if len(self.ranks) > 1 else None
            received.append((work, grad, rows, local))
        for work, grad, rows, local in received:
            if work is not None:
                work.wait()
            assert dw is not None
            dw.index_add_(0, local, grad[rows])
        self._looked, self._grads = [], {}
        if dw is not None:
            weight.grad = dw if weight.grad is None else weight.grad.add_(dw)


def _check_shard(shard: VocabShard, rank: int, devices: int, what: str, of: str) -> None:
    """One line where ``shard`` is not device ``rank``'s of a pipeline of ``devices``."""
    if shard.devices != devices or shard.index != rank:
        raise ConfigError(f"device {rank} of a pipeline of {devices} holds {what} shard {rank} of {devices} (got "
                          f"shard {shard.index} of {shard.devices}): build it with VocabShard.of({of}, {rank}, "
                          f"{devices})")


def _loss(stats: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From every shard's (max, sum of exponentials, target logit) per position: the mean cross entropy over the
    ``valid`` positions (those not :data:`IGNORE`), each position's max over the shards and its sum of exponentials
    against that max."""
    most, total, picked = stats[:, 0], stats[:, 1], stats[:, 2]
    top = most.max(dim=0).values
    scaled = torch.where(total > 0, total * torch.exp(most - top), 0.0)
    total = scaled.sum(dim=0)
    each = torch.log(total) + top - picked.sum(dim=0)
    return each[valid].sum() / valid.sum(), top, total

"""Context parallelism: each sequence split over ``cp`` ranks, and causal attention over the whole sequence computed
as a ring.

**The split.** A sequence of ``T`` tokens is cut into ``2 cp`` equal chunks; rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r``, side by side (:func:`shard_sequence`). Under a causal mask a late chunk attends to more keys than
an early one; pairing the ``r``-th earliest with the ``r``-th latest gives every rank the same work (the split
Megatron-LM and torch's context parallelism use). :func:`positions` gives the global positions of a rank's tokens,
which a learned or rotary position embedding needs; :func:`unshard_sequence` puts the ranks' pieces back in order.

**The ring** (:func:`ring_attention`). Each rank starts with its own keys and values; at each of ``cp`` steps it
attends its queries to the block it holds, masked by the tokens' global positions, and passes the block to the
next rank while it receives the previous rank's (``cp - 1`` passes). The steps' results are merged with their
log-sum-exp, as flash attention merges its tiles, so the output equals softmax attention over the whole sequence.
The pass is differentiable (:class:`_Pass`): its backward sends the gradient of what was received back to where it
came from, so autograd carries the keys' and values' gradients round the ring in the other direction, and the
queries', keys' and values' gradients are exactly those of one process attending over the whole sequence (to
float rounding: the sums run in another order). Each step's scores are recomputed in the backward, as flash
attention recomputes its tiles; what each step keeps is its block of keys and values, its mask and its output:
``cp`` blocks a layer, where a ring that passes them again in the backward would keep one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

__all__ = ["context_parallel", "positions", "ring_attention", "shard_sequence", "unshard_sequence"]


def _chunks(length: int, cp: int) -> int:
    if cp < 1 or length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x cp = {2 * cp} equal chunks")
    return length // (2 * cp)


def positions(length: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens of a sequence of ``length``: chunks ``rank`` and
    ``2 cp - 1 - rank``."""
    c = _chunks(length, cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([first, torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s share of ``x`` along ``dim`` (the sequence): its two chunks, side by side."""
    return x.index_select(dim, positions(x.size(dim), cp, rank, x.device))


def unshard_sequence(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's share (``pieces[r]`` from rank ``r``)."""
    cp = len(pieces)
    c = pieces[0].size(dim) // 2
    order: list[torch.Tensor] = [torch.empty(0)] * (2 * cp)
    for r, piece in enumerate(pieces):
        order[r], order[2 * cp - 1 - r] = piece.narrow(dim, 0, c), piece.narrow(dim, c, c)
    return torch.cat(order, dim=dim)


def _exchange(tensor: torch.Tensor, to: int, frm: int, group: Any) -> torch.Tensor:
    """Send ``tensor`` to global rank ``to`` while receiving a tensor of its shape from ``frm``."""
    got = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), to, group), dist.P2POp(dist.irecv, got, frm, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got


class _Pass(torch.autograd.Function):
    """Pass a block to the next rank of the ring and take the previous rank's; the gradient goes the other way."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, nxt: int, prev: int, group: Any) -> torch.Tensor:
        ctx.nxt, ctx.prev, ctx.group = nxt, prev, group
        return _exchange(block, nxt, prev, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.prev, ctx.nxt, ctx.group), None, None, None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one block: its output and its log-sum-exp per query. A masked score is the
    dtype's lowest rather than -inf, so that a query that sees none of the block's keys gets a log-sum-exp that
    weighs nothing in the merge and gradients without NaN."""
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, ``q``, ``k`` and ``v`` being this rank's
    shares (:func:`shard_sequence`) of shape (batch, heads, tokens, head width); key-value heads fewer than the
    query heads are repeated. ``group``: the context-parallel ranks (None: every rank)."""
    cp = dist.get_world_size(group)
    me = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(cp))
    nxt, prev = ranks[(me + 1) % cp], ranks[(me - 1) % cp]
    if k.size(1) != q.size(1):
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    length = q.size(-2) * cp
    mine = positions(length, cp, me, q.device)
    scale = 1.0 / math.sqrt(q.size(-1))
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    block = torch.stack([k, v])
    for step in range(cp):
        if step:
            block = _Pass.apply(block, nxt, prev, group)
        theirs = positions(length, cp, (me - step) % cp, q.device)
        # Recomputed in the backward, as flash attention recomputes its tiles: what stays is the block, the mask
        # and the step's output and log-sum-exp, not its scores.
        part, part_lse = checkpoint(_attend, q, block[0], block[1], mine[:, None] >= theirs[None, :], scale,
                                    use_reentrant=False)
        if out is None or lse is None:
            out, lse = part, part_lse
            continue
        total = torch.logaddexp(lse, part_lse)
        out = out * torch.exp(lse - total) + part * torch.exp(part_lse - total)
        lse = total
    assert out is not None
    return out


def context_parallel(module: torch.nn.Module, group: Any, cp: int, rank: int) -> None:
    """Make ``module``'s layers run on rank ``rank``'s share of each sequence: a submodule's ``attend(q, k, v)``
    (causal attention; the GPT's) becomes :func:`ring_attention` over ``group``, and its ``positions(t, device)``
    (the positions a layer embeds) the share's positions in the whole sequence of ``t x cp`` tokens. The model's
    own code is unchanged: its layers declare these two points, the runtime fills them."""
    for sub in module.modules():
        if callable(getattr(sub, "attend", None)):
            sub.attend = lambda q, k, v: ring_attention(q, k, v, group)  # type: ignore[assignment]
        if callable(getattr(sub, "positions", None)):
            sub.positions = lambda t, device: positions(t * cp, cp, rank, device)  # type: ignore[assignment]

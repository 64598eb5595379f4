"""Sequence chunks (Seq1F1B): each microbatch cut along the sequence into ``c`` equal chunks that go through the
pipeline one after another, as units of their own (:attr:`pipefold.ir.Schedule.seq_chunks`).

**Forward.** Under a causal mask, chunk ``j`` attends to its own tokens and to every token of chunks ``0..j-1``.
Each stage keeps, per microbatch and attention layer, the keys and values its earlier chunks made; chunk ``j``'s
attention reads them as leaves of its own graph (detached, so that its backward does not run into the earlier
chunks' graphs), and its own keys and values stay in its graph as extra outputs. The attention runs over the
blocks side by side (the earlier chunks' keys whole, its own under the causal mask) and is recomputed in the
backward, so what a chunk keeps of it is the blocks themselves, not their concatenation nor the scores.

**Backward.** The chunks of a microbatch go back last first (the schedule's dependency). Chunk ``j``'s backward
gives, beside its input's gradient, the gradients of the earlier chunks' keys and values it read; they are added up
per chunk, and chunk ``i``'s backward starts from its output's gradient *and* its keys' and values' gradients from
every later chunk. So each chunk's gradients, and the weights' sum over chunks, are those of one pass over the
whole sequence (to float rounding).

The model declares where attention and positions are, as for context parallelism: a submodule's ``attend(q, k, v)``
(causal attention of (batch, heads, tokens, width) tensors) and ``positions(t, device)`` (the positions a layer
embeds); :func:`sequence_chunks` fills them. Dropout inside attention is refused by the model's check.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipefold.errors import ConfigError

__all__ = ["SequenceChunks", "sequence_chunks", "split_units"]

_INSTALLED: weakref.WeakKeyDictionary[nn.Module, SequenceChunks] = weakref.WeakKeyDictionary()


class SequenceChunks:
    """The keys and values one stage's chunks share, and the gradients the later chunks give the earlier ones."""

    def __init__(self, module: nn.Module, chunks: int) -> None:
        self.chunks = chunks
        layers = [sub for sub in module.modules() if callable(getattr(sub, "attend", None))]
        self.layers = len(layers)
        for index, sub in enumerate(layers):
            sub.attend = self._attender(index)
        for sub in module.modules():
            if callable(getattr(sub, "positions", None)):
                sub.positions = self._positions  # type: ignore[assignment]
        self.unit = 0
        self._keys: dict[int, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        """Per microbatch, per layer: each earlier chunk's keys and values (detached), until its last chunk's F."""
        self._made: dict[int, list[torch.Tensor | None]] = {}
        """Per unit: its own keys and values, layer by layer (k, v, k, v, ...), in its graph."""
        self._read: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        """Per unit, from its forward to its backward: the leaves it read, each with the unit and slot of the keys
        or values it stands for."""
        self._grads: dict[int, list[torch.Tensor | None]] = {}
        """Per unit: the gradients of its keys and values from the later chunks, added up."""

    # -- the model's points

    def _positions(self, t: int, device: Any) -> torch.Tensor:
        j = self.unit % self.chunks
        return torch.arange(j * t, (j + 1) * t, device=device)

    def _attender(self, layer: int) -> Any:
        return lambda q, k, v: self._attend(layer, q, k, v)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        unit = self.unit
        m, j = divmod(unit, self.chunks)
        earlier = self._keys.setdefault(m, [[] for _ in range(self.layers)])[layer]
        if len(earlier) != j:
            raise RuntimeError(f"chunk {j} of microbatch {m} runs its forward after {len(earlier)} of its earlier "
                               "chunks: the chunks of a microbatch go forward in order")
        training = torch.is_grad_enabled()
        blocks = []
        for i, (ki, vi) in enumerate(earlier):
            if training:
                ki, vi = ki.detach().requires_grad_(), vi.detach().requires_grad_()
                self._read.setdefault(unit, []).extend(((ki, m * self.chunks + i, 2 * layer),
                                                        (vi, m * self.chunks + i, 2 * layer + 1)))
            blocks.append((ki, vi))
        earlier.append((k.detach(), v.detach()))
        if training:
            made = self._made.setdefault(unit, [None] * (2 * self.layers))
            made[2 * layer], made[2 * layer + 1] = k, v
        blocks.append((k, v))
        return _over_chunks(q, blocks)

    # -- what the stage runner asks

    def begin(self, unit: int) -> None:
        """The next forward is of ``unit``."""
        self.unit = unit

    def taken(self, unit: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """After ``unit``'s forward: the leaves it read (extra inputs of its graph) and its own keys and values
        (extra outputs). After a microbatch's last chunk no forward reads its keys any more: they are let go."""
        m, j = divmod(unit, self.chunks)
        if j == self.chunks - 1:
            self._keys.pop(m, None)
        read = self._read.get(unit, [])  # kept until its backward gives their gradients back
        made = self._made.pop(unit, [])
        own = tuple(t for t in made if t is not None)
        if len(own) != len(made):  # the slots of the later chunks' gradients are every layer's, in order
            raise RuntimeError(f"unit {unit}: {len(made) - len(own)} of the stage's keys and values were not made in "
                               "its forward: every attention layer of a stage runs for every chunk")
        return tuple(leaf for leaf, _, _ in read), own

    def roots(self, unit: int, made: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Before ``unit``'s backward: which of its keys and values the later chunks gave gradients to, and those
        gradients."""
        grads = self._grads.pop(unit, None)
        if grads is None:
            return [], []
        pairs = [(t, g) for t, g in zip(made, grads, strict=False) if g is not None and t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def give(self, unit: int, grads: Sequence[torch.Tensor | None]) -> None:
        """After ``unit``'s backward: the gradients of the leaves it read, added to the chunks they stand for."""
        for (_, u, slot), g in zip(self._read.pop(unit, []), grads, strict=True):
            if g is None:
                continue
            into = self._grads.setdefault(u, [None] * (2 * self.layers))
            held = into[slot]
            into[slot] = g if held is None else held + g



def _joined(q: torch.Tensor, mask: torch.Tensor, *blocks: torch.Tensor) -> torch.Tensor:
    """Attention of ``q`` over the blocks' keys and values (k, v, k, v, ...) side by side, under ``mask``;
    key-value heads fewer than the query heads are repeated."""
    k, v = torch.cat(blocks[0::2], dim=-2), torch.cat(blocks[1::2], dim=-2)
    if k.size(1) != q.size(1):
        k, v = (x.repeat_interleave(q.size(1) // x.size(1), dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _over_chunks(q: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Causal attention of the last block's queries ``q`` over every block (the earlier chunks' keys whole, its
    own under the causal mask), recomputed in the backward: what it keeps is the blocks themselves, not their
    concatenation nor the scores."""
    t = q.size(-2)
    before = t * (len(blocks) - 1)
    mine = torch.arange(t, device=q.device)
    mask = (mine[:, None] + before) >= torch.arange(before + t, device=q.device)[None, :]
    flat = [x for kv in blocks for x in kv]
    if not torch.is_grad_enabled():
        return _joined(q, mask, *flat)
    out: torch.Tensor = checkpoint(_joined, q, mask, *flat, use_reentrant=False)
    return out


def sequence_chunks(module: nn.Module, chunks: int) -> SequenceChunks:
    """Make ``module`` (a stage) run on sequence chunks: its ``attend`` points read the earlier chunks' keys and
    values, its ``positions`` points give a chunk's positions in the whole sequence. Once per module: a second
    call gives the same state (a training and an evaluation executor share it)."""
    made = _INSTALLED.get(module)
    if made is not None:
        if made.chunks != chunks:
            raise ConfigError(f"a stage runs on {made.chunks} sequence chunks already; it cannot also run on {chunks}")
        return made
    made = SequenceChunks(module, chunks)
    _INSTALLED[module] = made
    return made


def split_units(parts: Sequence[Any], chunks: int, dim: int = 1) -> list[Any]:
    """Each microbatch's tensors (a tuple of them, or one) cut along ``dim`` (the sequence) into ``chunks`` equal
    pieces: the units of a schedule with sequence chunks, chunk after chunk of each microbatch in turn. A tensor of
    fewer dimensions (a per-sequence value) goes whole with every chunk."""
    out = []
    for part in parts:
        single = isinstance(part, torch.Tensor)
        tensors = (part,) if single else tuple(part)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() > dim and t.size(dim) % chunks:
                raise ConfigError(f"a sequence of {t.size(dim)} tokens does not cut into {chunks} equal chunks: give "
                                  f"a length that is a multiple of {chunks}, or another --seq-chunks")
        cut = [t.chunk(chunks, dim) if isinstance(t, torch.Tensor) and t.dim() > dim else (t,) * chunks
               for t in tensors]
        for j in range(chunks):
            pieces = tuple(c[j] for c in cut)
            out.append(pieces[0] if single else pieces)
    return out

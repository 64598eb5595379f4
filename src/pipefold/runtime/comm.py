"""Point-to-point transfers between pipeline ranks: non-blocking, with metadata only when shapes change.

Every message is one tensor of one stage boundary for one microbatch, with a
unique tag::

    tag = ((direction * S + stage) * M + microbatch) * MAX_TENSORS + index

gloo matches a receive to a send by tag, but NCCL ignores tags and matches the
messages between two ranks by their order alone. So the executor posts each
neighbour's receives in the order that neighbour sends (see
``pipefold.runtime.executor``), and the tags only double-check it on gloo.

A forward link (stage s -> s+1 on another rank) carries the activations; the
receiver must know their shapes to allocate buffers. All microbatches of a step
share them, so the sender sends a small header with the metas (count, dtype,
shape of each tensor) only in the first step and in a step whose input shape
differs from the last one, which every rank knows because every rank reads the
same batch. Gradients flow back along the same link with the shapes of the
activations the receiver itself sent, so they never need a header.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

MAX_TENSORS = 8
MAX_DIMS = 8
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8]
_HEADER = 1 + MAX_TENSORS * (2 + MAX_DIMS)

FORWARD, BACKWARD, HEADER = 0, 1, 2


@dataclass(frozen=True)
class Meta:
    """What a receiver needs to allocate one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def metas_of(tensors: tuple[torch.Tensor, ...]) -> tuple[Meta, ...]:
    return tuple(Meta(tuple(t.shape), t.dtype) for t in tensors)


def encode_header(metas: tuple[Meta, ...]) -> torch.Tensor:
    if len(metas) > MAX_TENSORS:
        raise ValueError(f"a stage may pass at most {MAX_TENSORS} tensors to the next (got {len(metas)})")
    out = torch.zeros(_HEADER, dtype=torch.int64)
    out[0] = len(metas)
    for i, m in enumerate(metas):
        if len(m.shape) > MAX_DIMS:
            raise ValueError(f"tensors passed between stages may have at most {MAX_DIMS} dimensions")
        base = 1 + i * (2 + MAX_DIMS)
        out[base] = _DTYPES.index(m.dtype)
        out[base + 1] = len(m.shape)
        out[base + 2: base + 2 + len(m.shape)] = torch.tensor(m.shape, dtype=torch.int64)
    return out


def decode_header(h: torch.Tensor) -> tuple[Meta, ...]:
    values = h.tolist()  # one copy to the host when the header came over a GPU link
    metas = []
    for i in range(values[0]):
        base = 1 + i * (2 + MAX_DIMS)
        ndim = values[base + 1]
        metas.append(Meta(tuple(values[base + 2: base + 2 + ndim]), _DTYPES[values[base]]))
    return tuple(metas)


class Links:
    """The sends and receives of one rank, with every work handle kept until waited on.

    With ``log`` set, every send and receive is recorded as ("send" or "recv", peer, tag) when posted.
    """

    def __init__(self, stages: int, microbatches: int, device: torch.device, *, log: bool = False) -> None:
        self.S, self.M = stages, microbatches
        self.device = device
        self._pending_sends: list[tuple[dist.Work, torch.Tensor, int]] = []  # (work, tensor, direction)
        self.log: list[tuple[str, int, int]] | None = [] if log else None

    def _post(self, op: str, t: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """Post one "send" or "recv" of ``t`` with ``peer``."""
        if self.log is not None:
            self.log.append((op, peer, tag))
        work = (dist.isend if op == "send" else dist.irecv)(t, peer, tag=tag)
        assert work is not None
        return work

    def tag(self, direction: int, stage: int, microbatch: int, index: int) -> int:
        return ((direction * self.S + stage) * self.M + microbatch) * MAX_TENSORS + index

    def send(self, direction: int, stage: int, microbatch: int, tensors: tuple[torch.Tensor, ...],
             peer: int) -> None:
        """Post the sends; the tensors stay referenced until :meth:`wait_sends` sees them through."""
        for i, t in enumerate(tensors):
            t = t.contiguous()
            work = self._post("send", t, peer, self.tag(direction, stage, microbatch, i))
            self._pending_sends.append((work, t, direction))

    def recv(self, direction: int, stage: int, microbatch: int, metas: tuple[Meta, ...],
             peer: int) -> tuple[list[dist.Work], tuple[torch.Tensor, ...]]:
        """Post the receives into fresh buffers; the caller waits on the handles before use."""
        bufs = tuple(m.empty(self.device) for m in metas)
        works = []
        for i, b in enumerate(bufs):
            works.append(self._post("recv", b, peer, self.tag(direction, stage, microbatch, i)))
        return works, bufs

    def send_header(self, stage: int, metas: tuple[Meta, ...], peer: int) -> None:
        h = encode_header(metas).to(self.device)  # NCCL sends only tensors on the GPU
        work = self._post("send", h, peer, self.tag(HEADER, stage, 0, 0))
        self._pending_sends.append((work, h, HEADER))

    def post_header_recv(self, stage: int, peer: int) -> tuple[dist.Work, torch.Tensor]:
        """Post the receive of a header; :func:`decode_header` reads it once the work is done."""
        h = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        return self._post("recv", h, peer, self.tag(HEADER, stage, 0, 0)), h

    def reap_sends(self) -> None:
        """Drop the sends that have completed, releasing their tensors."""
        self._pending_sends = [(w, t, d) for w, t, d in self._pending_sends if not w.is_completed()]

    def wait_sends(self) -> None:
        for work, _, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()

    def bytes_in_flight(self, direction: int) -> int:
        """Bytes of the tensors still being sent in ``direction``."""
        return sum(t.untyped_storage().nbytes() for _, t, d in self._pending_sends if d == direction)

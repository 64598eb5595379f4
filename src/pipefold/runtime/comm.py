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

A send keeps its tensors alive until it is delivered, and no longer. NCCL's
work handles say when (``is_completed``); gloo's do not until ``wait()`` is
called, and ``wait()`` blocks until the receiver has posted its receive. So on
gloo each link (one peer) has a thread that waits on its sends in the order
they were posted, which is the order the peer receives them, and drops each
one's tensors as soon as it returns. The executor may also ask for the first n
sends of a link to be released (:meth:`Links.settle`) when the schedule tells
it they have been received, which bounds the bytes in flight per link.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipefold.runtime.meter import MemoryMeter

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


_Send = tuple[dist.Work, tuple[torch.Tensor, ...], int]
"""A posted send: its work handle, the tensors it reads, their bytes."""


class _Outbox:
    """The sends to one peer, in the order posted; each one's tensors dropped as soon as it is delivered."""

    def __init__(self, peer: int, *, threaded: bool) -> None:
        self.peer = peer
        self.posted = 0
        self.released = 0
        self.bytes = 0
        self.max_bytes = 0
        """The most bytes in flight at once on this link since :meth:`reset_max`."""
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._pending: deque[_Send] = deque()  # without a thread: posted, not yet seen delivered
        self._queue: queue.SimpleQueue[_Send | None] | None = None
        if threaded:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._deliver, name=f"pipefold-send-{peer}", daemon=True).start()

    def post(self, send: _Send) -> None:
        with self._cond:
            self._raise()
            self.posted += 1
            self.bytes += send[2]
            self.max_bytes = max(self.max_bytes, self.bytes)
        if self._queue is not None:
            self._queue.put(send)
        else:
            self._pending.append(send)

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self.released += 1
            self.bytes -= nbytes
            self._cond.notify_all()

    def _deliver(self) -> None:
        """The link's thread: wait on each send in order, then let go of its tensors."""
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            work, nbytes = item[0], item[2]  # not the tensors: a name bound to them would outlive the send
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 (reported on the rank's own thread by the next call)
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                return
            del item, work  # the tensors die here unless someone else holds them
            self._release(nbytes)

    def poll(self) -> None:
        """Without a thread (NCCL): release the sends, in order, that report themselves completed."""
        while self._pending and self._pending[0][0].is_completed():
            self._release(self._pending.popleft()[2])

    def settle(self, count: int, timeout: float | None = None) -> None:
        """Return once the first ``count`` sends are released (delivered, their tensors dropped)."""
        if self._queue is None:
            while self.released < count:
                work, _, nbytes = self._pending.popleft()
                work.wait()
                self._release(nbytes)
            return
        with self._cond:
            if not self._cond.wait_for(lambda: self.released >= count or self.error is not None, timeout):
                raise TimeoutError(f"sends to rank {self.peer} not delivered after {timeout} s")
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a send to rank {self.peer} failed: {self.error}") from self.error

    def reset_max(self) -> None:
        with self._cond:
            self.max_bytes = self.bytes

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)


class Links:
    """The sends and receives of one rank: receive buffers and sends on the meter, each send freed on delivery.

    With ``log`` set, every send and receive is recorded as ("send" or "recv", peer, tag) when posted.
    """

    def __init__(self, stages: int, microbatches: int, device: torch.device, meter: MemoryMeter, *,
                 log: bool = False, timeout: float | None = None) -> None:
        self.S, self.M = stages, microbatches
        self.device = device
        self.meter = meter
        self.timeout = timeout
        self.outboxes: dict[int, _Outbox] = {}
        self.log: list[tuple[str, int, int]] | None = [] if log else None

    def _outbox(self, peer: int) -> _Outbox:
        if peer not in self.outboxes:
            # gloo's handles report completion only through wait(): a thread per link waits on them.
            self.outboxes[peer] = _Outbox(peer, threaded=self.device.type != "cuda")
        return self.outboxes[peer]

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
        """Post the sends; the link keeps the tensors until they are delivered."""
        outbox = self._outbox(peer)
        for i, t in enumerate(tensors):
            t = t.contiguous()
            self.meter.hold((t,), "send")  # a copy when ``t`` was not contiguous; already counted otherwise
            work = self._post("send", t, peer, self.tag(direction, stage, microbatch, i))
            outbox.post((work, (t,), t.untyped_storage().nbytes()))

    def recv(self, direction: int, stage: int, microbatch: int, metas: tuple[Meta, ...],
             peer: int) -> tuple[list[dist.Work], tuple[torch.Tensor, ...]]:
        """Post the receives into fresh buffers; the caller waits on the handles before use."""
        bufs = tuple(m.empty(self.device) for m in metas)
        self.meter.hold(bufs, "recv")
        works = []
        for i, b in enumerate(bufs):
            works.append(self._post("recv", b, peer, self.tag(direction, stage, microbatch, i)))
        return works, bufs

    def send_header(self, stage: int, metas: tuple[Meta, ...], peer: int) -> None:
        h = encode_header(metas).to(self.device)  # NCCL sends only tensors on the GPU
        work = self._post("send", h, peer, self.tag(HEADER, stage, 0, 0))
        self._outbox(peer).post((work, (h,), 0))  # a few bytes of metadata: not activation memory

    def post_header_recv(self, stage: int, peer: int) -> tuple[dist.Work, torch.Tensor]:
        """Post the receive of a header; :func:`decode_header` reads it once the work is done."""
        h = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        return self._post("recv", h, peer, self.tag(HEADER, stage, 0, 0)), h

    def reap_sends(self) -> None:
        """Release the sends seen completed (on links without a thread; the threads release their own)."""
        for outbox in self.outboxes.values():
            outbox.poll()

    def settle(self, peer: int, count: int) -> None:
        """Return once the first ``count`` sends to ``peer`` this step are released (the schedule says delivered)."""
        self._outbox(peer).settle(count, self.timeout)

    def wait_sends(self) -> None:
        """Return once every send is delivered and released."""
        for outbox in self.outboxes.values():
            outbox.settle(outbox.posted, self.timeout)

    def new_step(self) -> None:
        """Count sends and in-flight maxima from zero (every send of the last step has been released)."""
        for outbox in self.outboxes.values():
            outbox.posted = outbox.released = 0
            outbox.reset_max()

    def close(self) -> None:
        for outbox in self.outboxes.values():
            outbox.close()

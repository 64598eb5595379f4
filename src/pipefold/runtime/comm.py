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

With a :class:`~pipefold.sim.network.Network` (``Links(network=...)``), each link also behaves like one with
that latency and bandwidth: a send is handed to gloo only once the emulated link would have carried it
(its :class:`~pipefold.sim.network.Wire`, on the wall clock from the job's agreed start), by the link's
thread, in the order posted. The real transfer's own time comes on top.

Each link also records, per message, when it was posted and delivered, and each receiver when it
posted the receive (wall-clock): gloo moves a message only once both ends have posted, so a message's
service time runs from the latest of the three (posted, receive posted, the message before it
delivered) until it was delivered. Bytes over service time is the link's observed bandwidth, what
``adaptive-kfkb`` decides with (:mod:`pipefold.plan.adapt`).

On GPUs that ranks share (gloo, which moves host memory only: ``Links(staged=True)``), a send is copied
into pinned host memory on the rank's communication stream, after the compute stream's work so far; the
link's thread waits for that copy, lets go of the GPU tensor and hands the host copy to gloo. A receive
lands in pinned host memory and is copied onto the GPU on the communication stream when it is taken, the
compute stream waiting for the copy only. So on the GPU a message holds device memory from its
production until its copy out, and from its copy in until its consumer is done; the bytes in flight
sit in host memory, which the meter does not count (it counts the device's).

A send keeps its tensors alive until it is delivered, and no longer. NCCL's
work handles say when (``is_completed``); gloo's do not until ``wait()`` is
called, and ``wait()`` blocks until the receiver has posted its receive. So on
gloo each link (one peer) has a thread that waits on its sends in the order
they were posted, which is the order the peer receives them, and drops each
one's tensors as soon as it returns. The executor may also ask for the first n
sends of a link to be released (:meth:`Links.settle`) when the schedule tells
it they have been received, which bounds the bytes in flight per link. Between
ranks of one machine the messages go over :mod:`pipefold.runtime.sockets`
instead (:func:`post_message` picks): a send the socket takes whole as it is posted is
released at once, without waking the link's thread, when nothing before it is
still in the thread's hands; the rest of a larger one is written by the thread.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipefold.errors import ConfigError
from pipefold.runtime import sockets
from pipefold.runtime.clock import wall
from pipefold.runtime.meter import MemoryMeter
from pipefold.runtime.structure import SPEC_BYTES

if TYPE_CHECKING:
    from pipefold.runtime.slowlinks import Carried
    from pipefold.sim.network import Network, Wire

MAX_TENSORS = 16
MAX_DIMS = 8
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int16, torch.int8]
_SPEC = 1 + MAX_TENSORS * (2 + MAX_DIMS)  # where the structure's bytes start: their count, then 8 to a word
_HEADER = _SPEC + 1 + SPEC_BYTES // 8

FORWARD, BACKWARD, HEADER = 0, 1, 2
_WHAT = {FORWARD: "an activation", BACKWARD: "a gradient", HEADER: "the shapes of an activation"}
"""What a message of each direction is, as a hang report names it."""
_NAP = 3600.0
"""The longest single sleep of a link's thread: a due time far away is waited for in naps, as one sleep of more
than about 1e10 s overflows the platform's time_t."""


@dataclass(frozen=True)
class Meta:
    """What a receiver needs to allocate one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def metas_of(tensors: tuple[torch.Tensor, ...]) -> tuple[Meta, ...]:
    return tuple(Meta(tuple(t.shape), t.dtype) for t in tensors)


def encode_header(metas: tuple[Meta, ...], spec: bytes = b"") -> torch.Tensor:
    """The shapes and dtypes of a boundary's tensors and its structure's bytes
    (:func:`pipefold.runtime.structure.encode_spec`), as one int64 tensor."""
    if len(metas) > MAX_TENSORS:
        raise ConfigError(f"a stage may pass at most {MAX_TENSORS} tensors to the next (got {len(metas)}): "
                          "concatenate some")
    if any(m.dtype not in _DTYPES for m in metas):
        bad = next(m.dtype for m in metas if m.dtype not in _DTYPES)
        raise ConfigError(f"a stage passes a {bad} tensor to the next; the runtime sends "
                          f"{', '.join(str(d).replace('torch.', '') for d in _DTYPES)}")
    out = torch.zeros(_HEADER, dtype=torch.int64)
    out[0] = len(metas)
    for i, m in enumerate(metas):
        if len(m.shape) > MAX_DIMS:
            raise ValueError(f"tensors passed between stages may have at most {MAX_DIMS} dimensions")
        base = 1 + i * (2 + MAX_DIMS)
        out[base] = _DTYPES.index(m.dtype)
        out[base + 1] = len(m.shape)
        out[base + 2: base + 2 + len(m.shape)] = torch.tensor(m.shape, dtype=torch.int64)
    out[_SPEC] = len(spec)
    if spec:
        padded = spec + bytes(-len(spec) % 8)
        out[_SPEC + 1: _SPEC + 1 + len(padded) // 8] = torch.frombuffer(bytearray(padded), dtype=torch.int64)
    return out


def decode_header(h: torch.Tensor) -> tuple[tuple[Meta, ...], bytes]:
    """The metas and the structure's bytes :func:`encode_header` wrote."""
    h = h.cpu()  # one copy to the host when the header came over a GPU link
    values = h[:_SPEC + 1].tolist()
    metas = []
    for i in range(values[0]):
        base = 1 + i * (2 + MAX_DIMS)
        ndim = values[base + 1]
        metas.append(Meta(tuple(values[base + 2: base + 2 + ndim]), _DTYPES[values[base]]))
    n = values[_SPEC]
    spec = h[_SPEC + 1: _SPEC + 1 + (n + 7) // 8].numpy().tobytes()[:n] if n else b""
    return tuple(metas), spec


def post_message(op: str, t: torch.Tensor, to: int, tag: int) -> dist.Work:
    """Post one non-blocking "send" or "recv" of ``t`` with process-group rank ``to``: over this machine's sockets
    where the job connected them (:mod:`pipefold.runtime.sockets`), else over the process group."""
    if (local := sockets.current()) is not None and t.device.type == "cpu":
        return local.isend(t, to, tag) if op == "send" else local.irecv(t, to, tag)  # type: ignore[return-value]
    work = (dist.isend if op == "send" else dist.irecv)(t, to, tag=tag)
    assert work is not None
    return work


@dataclass(frozen=True)
class _Deferred:
    """A send the link's thread hands to gloo at wall-clock time ``due`` (an emulated slow link); ``carried`` is what
    the rank's watch is told of it meanwhile."""

    tensor: torch.Tensor
    peer: int
    tag: int
    due: float
    carried: Carried | None = None

    def post(self) -> dist.Work:
        while (delay := self.due - wall()) > 0:
            time.sleep(min(delay, _NAP))
        return post_message("send", self.tensor, self.peer, self.tag)


class _Staged:
    """A send of a GPU tensor over gloo: copied into pinned host memory on the communication stream now; the
    link's thread waits for the copy, drops the GPU tensor and sends the host copy. (Without a stream, on the
    CPU, the copy is made at once: the same path, for the tests of machines without a GPU.)"""

    def __init__(self, tensor: torch.Tensor, peer: int, tag: int, stream: torch.cuda.Stream | None) -> None:
        self.peer, self.tag = peer, tag
        self.copied: torch.cuda.Event | None = None
        if stream is None:
            self.host = tensor.clone()
        else:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # after what produced the tensor
            with torch.cuda.stream(stream):
                self.host.copy_(tensor, non_blocking=True)
                self.copied = torch.cuda.Event()
                self.copied.record(stream)
        self.tensor: torch.Tensor | None = tensor  # alive until copied out

    def post(self) -> dist.Work:
        if self.copied is not None:
            self.copied.synchronize()
        self.tensor = None  # the device's bytes are free from here on; the host copy travels
        return post_message("send", self.host, self.peer, self.tag)


def routes(a: int, b: int) -> list[tuple[int, int]]:
    """How a tensor crosses from a mesh of ``a`` ranks to one of ``b`` that each need all of it (Alpa's cross-mesh
    resharding, Megatron's scatter-gather): cut into L = lcm(a, b) equal pieces, piece k goes from sender k mod a
    to receiver k // (L / b), (sender, receiver) of each piece in order. Receiver j so holds the j-th of b equal
    chunks, and the receivers all-gather their chunks over their own links. Each byte crosses once; the senders
    share the work evenly; a sender sends a receiver at most one piece (L / b <= a)."""
    pieces = math.lcm(a, b)
    return [(k % a, k // (pieces // b)) for k in range(pieces)]


def _padded(numel: int, pieces: int) -> int:
    """Elements of a tensor of ``numel`` elements flattened and padded to cut into ``pieces`` equal pieces."""
    return -(-numel // pieces) * pieces


class Incoming:
    """A posted receive: :meth:`wait` returns its tensors, on the rank's device. From a mesh of several ranks or
    into one (``gather``: this rank's chunk of each, the all-gather of its own mesh's group, its position and the
    tensors' shapes), each tensor arrives in pieces into one flat buffer, whose chunks the receiving mesh's ranks
    then all-gather."""

    def __init__(self, works: list[dist.Work], buffers: tuple[torch.Tensor, ...], links: Links,
                 gather: tuple[Any, int, int, tuple[Meta, ...]] | None = None) -> None:
        self.works, self.buffers, self._links, self._gather = works, buffers, links, gather

    def wait(self) -> tuple[torch.Tensor, ...]:
        for w in self.works:
            w.wait()
        if self._gather is not None and (size := self._gather[1]) > 1:
            group, index = self._gather[0], self._gather[2]
            for flat in self.buffers:  # in host memory on a staged link: gloo moves no GPU memory
                chunks = list(flat.chunk(size))
                dist.all_gather(chunks, chunks[index].clone(), group=group)
                self._links.gathered += flat.numel() * flat.element_size() * (size - 1) // size
        buffers = self._links.land(self.buffers) if self._links.staged else self.buffers
        if self._gather is None:
            return buffers
        return tuple(flat[:math.prod(m.shape)].view(m.shape) for flat, m in zip(buffers, self._gather[3], strict=True))


_Send = tuple["dist.Work | _Deferred | _Staged", tuple[torch.Tensor, ...], int, float, int]
"""A send: its work handle (or the send to post later), the tensors it reads, their bytes, when it was posted
(wall-clock seconds, :func:`pipefold.runtime.clock.wall`), its tag."""


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
        self.samples: list[tuple[int, int, float, float]] = []
        """(tag, bytes, posted, delivered) of each message delivered since :meth:`take_samples`, wall-clock."""
        self._cond = threading.Condition()
        self._pending: deque[_Send] = deque()  # without a thread: posted, not yet seen delivered
        self._queue: queue.SimpleQueue[_Send | None] | None = None
        self._queued = 0  # handed to the thread and not yet released
        self._held: deque[Carried] = deque()  # emulated sends not yet handed to gloo, in order
        self._thread: threading.Thread | None = None
        if threaded:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._deliver, name=f"pipefold-send-{peer}", daemon=True)
            self._thread.start()

    def post(self, send: _Send) -> None:
        work = send[0]
        with self._cond:
            self._raise()
            self.posted += 1
            self.bytes += send[2]
            self.max_bytes = max(self.max_bytes, self.bytes)
            # Delivered as it was posted (a socket took it whole) with nothing before it still in the thread's hands:
            # released here, without waking the thread.
            now = (self._queue is not None and self._queued == 0 and not isinstance(work, (_Deferred, _Staged))
                   and work.is_completed())
            if self._queue is not None and not now:
                self._queued += 1
            if isinstance(work, _Deferred) and work.carried is not None:
                self._held.append(work.carried)
        if now:
            self._release(send[2], send[3], send[4])
        elif self._queue is not None:
            self._queue.put(send)
        else:
            self._pending.append(send)

    def _release(self, nbytes: int, posted_at: float, tag: int) -> None:
        done = wall()
        with self._cond:
            self.released += 1
            self.bytes -= nbytes
            if nbytes:
                self.samples.append((tag, nbytes, posted_at, done))
            self._cond.notify_all()

    def take_samples(self) -> list[tuple[int, int, float, float]]:
        with self._cond:
            out, self.samples = self.samples, []
        return out

    def holding(self) -> Carried | None:
        """The first send the emulated link still holds back (it goes to gloo when the link has carried it)."""
        with self._cond:
            return self._held[0] if self._held else None

    def _deliver(self) -> None:
        """The link's thread: post each deferred send when due, wait on each send in order, let go of its tensors."""
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            # Not the tensors: a name bound to them would outlive the send.
            work, nbytes, posted_at, tag = item[0], item[2], item[3], item[4]
            try:
                if isinstance(work, (_Deferred, _Staged)):
                    deferred = isinstance(work, _Deferred) and work.carried is not None
                    work = work.post()
                    if deferred:
                        with self._cond:
                            self._held.popleft()
                work.wait()
            except BaseException as exc:  # noqa: BLE001 (reported on the rank's own thread by the next call)
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                return
            del item, work  # the tensors die here unless someone else holds them
            self._release(nbytes, posted_at, tag)
            with self._cond:
                self._queued -= 1

    def poll(self) -> None:
        """Without a thread (NCCL): release the sends, in order, that report themselves completed."""
        while self._pending and _work(self._pending[0]).is_completed():
            send = self._pending.popleft()
            self._release(send[2], send[3], send[4])

    def settle(self, count: int, timeout: float | None = None) -> None:
        """Return once the first ``count`` sends are released (delivered, their tensors dropped)."""
        if self._queue is None:
            while self.released < count:
                send = self._pending.popleft()
                _work(send).wait()
                self._release(send[2], send[3], send[4])
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
        """Stop the link's thread and wait for it (a few seconds at most: a send still under way keeps it in
        torch, and a thread left in torch when the interpreter shuts down aborts the process)."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=5.0)
            self._thread = None


class FlatAllReduce:
    """One all-reduce of many tensors, in place: copied into one buffer per dtype and reduced in one call, so a
    stage's gradients pay one collective's latency, not one per tensor (DDP's buckets do the same; gloo's latency
    on a shared machine is milliseconds). Each tensor then lives in the buffer (its storage swapped for its part of
    it, its old one freed at once), so the gradients are held once, not twice, while they travel; ``moved`` counts
    their bytes. ``scale`` multiplies each tensor on its way into the buffer (the mean over data-parallel copies:
    one pass over the bytes, where scaling in place and then copying took two). A tensor that is not contiguous
    cannot live in a flat buffer: it is scaled and reduced by itself, in place. :meth:`wait` waits for them all.
    The profile times this same class (:func:`pipefold.runtime.measure.profiling.measure_allreduce`)."""

    def __init__(self, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, *, scale: float = 1.0) -> None:
        kinds, alone = _flat_kinds(tensors)
        self._works: list[dist.Work] = []
        self.moved = 0
        with torch.no_grad():
            for t in alone:
                if scale != 1.0:
                    t.mul_(scale)
                self._works.append(dist.all_reduce(t, group=group, async_op=True))
            for (dtype, device), same in kinds.items():
                flat = torch.empty(sum(t.numel() for t in same), dtype=dtype, device=device)
                for at, t, part in _parts(flat, same):
                    if scale != 1.0:
                        torch.mul(t.reshape(-1), scale, out=part)
                    else:
                        part.copy_(t.reshape(-1))
                    t.set_(flat.untyped_storage(), at, t.shape, t.stride())  # it now lives in its part of flat
                self.moved += flat.untyped_storage().nbytes()
                self._works.append(dist.all_reduce(flat, group=group, async_op=True))

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


class FlatBroadcast:
    """One broadcast of many tensors from ``src``, in place: per dtype, the source copies them into one buffer and
    every rank receives that buffer in one call, then (:meth:`wait`) copies its parts into the tensors. One
    collective's latency rather than one per tensor: on gloo, 53 tensors broadcast one by one, all in flight at
    once, took 1 to 25 ms from run to run where their bytes alone take 3 (ZeRO-1's sharing of a GPT's stepped
    parameters). A tensor that is not contiguous is broadcast by itself. The buffers live only until :meth:`wait`."""

    def __init__(self, tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
        mine = dist.get_rank() == src
        kinds, alone = _flat_kinds(tensors)
        self._works: list[tuple[dist.Work, torch.Tensor | None, list[torch.Tensor]]] = []
        with torch.no_grad():
            for t in alone:
                self._works.append((dist.broadcast(t, src=src, group=group, async_op=True), None, []))
            for (dtype, device), same in kinds.items():
                if mine:
                    flat = torch.cat([t.reshape(-1) for t in same])
                else:
                    flat = torch.empty(sum(t.numel() for t in same), dtype=dtype, device=device)
                work = dist.broadcast(flat, src=src, group=group, async_op=True)
                self._works.append((work, None if mine else flat, same))

    def wait(self) -> None:
        with torch.no_grad():
            for work, flat, same in self._works:
                work.wait()
                if flat is not None:
                    for _, t, part in _parts(flat, same):
                        t.copy_(part.view(t.shape))
        self._works = []


class ThenBroadcast:
    """A gradient that only some data-parallel copies computed, on a copy that computed it first or receives it:
    ``reduction``, the all-reduce among the copies that computed it (None where one copy did, or on a copy that
    did not), then a broadcast of the result from ``src`` over ``group`` (``src`` and the copies that did not
    compute it). The broadcast needs the reduced values, so it starts in :meth:`wait`, which waits for both: every
    rank of ``group`` waits for these in the same order as it runs its other collectives on it."""

    def __init__(self, tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup,
                 reduction: FlatAllReduce | None = None) -> None:
        self._tensors, self._src, self._group, self._reduction = list(tensors), src, group, reduction
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._reduction is not None:
            self._reduction.wait()
        FlatBroadcast(self._tensors, self._src, self._group).wait()
        self._done = True


def _flat_kinds(tensors: Sequence[torch.Tensor]) -> tuple[dict[tuple[torch.dtype, torch.device], list[torch.Tensor]],
                                                          list[torch.Tensor]]:
    """What a flat collective moves in one buffer per dtype and device (the contiguous tensors, by kind), and what it
    moves one by one (the others, which no flat buffer can hold as they are laid out)."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    alone = []
    for t in tensors:
        if t.is_contiguous():
            kinds.setdefault((t.dtype, t.device), []).append(t)
        else:
            alone.append(t)
    return kinds, alone


def _parts(flat: torch.Tensor, same: Sequence[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(offset, tensor, its part of ``flat``) for each of ``same``, laid end to end in ``flat``."""
    at = 0
    for t in same:
        yield at, t, flat[at:at + t.numel()]
        at += t.numel()


def _work(send: _Send) -> dist.Work:
    assert not isinstance(send[0], (_Deferred, _Staged)), "emulated and staged links are threaded"
    return send[0]


class Links:
    """The sends and receives of one rank: receive buffers and sends on the meter, each send freed on delivery.

    Peers are pipeline devices. Each device is a mesh of ranks (``meshes[d]``: its process-group ranks, one per
    tensor-parallel rank; this rank is ``meshes[rank][index]``, and ``group`` is its mesh's process group). A
    message between devices of one rank each is one send; between meshes it is resharded (:func:`routes`): this
    rank sends its pieces, receives its own, and its mesh all-gathers them. ``sent`` counts the bytes sent to each
    process-group rank, ``gathered`` the bytes this rank received in those all-gathers, since :meth:`new_step`.

    With ``log`` set, every send and receive is recorded as ("send" or "recv", peer device, tag) when posted.
    With ``network``, sends from ``rank`` cross emulated links whose timeline starts at wall-clock ``origin``.
    """

    def __init__(self, stages: int, microbatches: int, device: torch.device, meter: MemoryMeter, *,
                 log: bool = False, timeout: float | None = None, network: Network | None = None,
                 rank: int = 0, origin: float = 0.0, meshes: Sequence[Sequence[int]] | None = None, index: int = 0,
                 group: Any = None, staged: bool = False) -> None:
        self.S, self.M = stages, microbatches
        self.staged = staged
        """GPU tensors over gloo: through pinned host memory, copied on :attr:`stream`."""
        self.stream = torch.cuda.Stream(device) if staged and device.type == "cuda" else None
        """The communication stream: copies to and from host memory (staged links on a GPU)."""
        self.meshes = [list(m) for m in meshes] if meshes is not None else None
        """The process-group ranks of each pipeline device (None: device d is rank d alone)."""
        self.index, self.group = index, group
        self.device = device
        self.meter = meter
        self.timeout = timeout
        self.outboxes: dict[int, _Outbox] = {}
        """By process-group rank."""
        self._device_of: dict[int, int] = {}
        self.log: list[tuple[str, int, int]] | None = [] if log else None
        if network is not None and device.type == "cuda":
            raise ValueError("emulated network links run on gloo (CPU) only; on GPUs use real links or --netns")
        if network is not None and meshes is not None and any(len(m) > 1 for m in meshes):
            raise ValueError("emulated network links join devices of one rank each")
        self.network, self.rank, self.origin = network, rank, origin
        self._wires: dict[int, Wire] = {}
        self.recv_posted: dict[int, dict[int, float]] = {}
        """Per peer device, when the receive of each message (by its first tensor's tag) was posted."""
        self.sent: dict[int, int] = {}
        self.gathered = 0
        self._route_cache: dict[tuple[int, int], list[tuple[int, int, int]]] = {}

    def mesh(self, device: int) -> list[int]:
        """The process-group ranks of a pipeline device."""
        return [device] if self.meshes is None else self.meshes[device]

    def _routes(self, src: int, dst: int) -> list[tuple[int, int, int]]:
        """The pieces from device ``src`` to device ``dst`` that this rank sends (on ``src``) or receives (on
        ``dst``): (piece, of how many, the other end's process-group rank). Worked out once per pair: every
        message asks."""
        key = (src, dst)
        if key not in self._route_cache:
            self._route_cache[key] = self._work_out_routes(src, dst)
        return self._route_cache[key]

    def _work_out_routes(self, src: int, dst: int) -> list[tuple[int, int, int]]:
        a, b = self.mesh(src), self.mesh(dst)
        out = []
        for k, (i, j) in enumerate(pieces := routes(len(a), len(b))):
            if src == self.rank and i == self.index:
                out.append((k, len(pieces), b[j]))
            elif dst == self.rank and j == self.index:
                out.append((k, len(pieces), a[i]))
        return out

    def peers(self, device: int) -> tuple[int, ...]:
        """The process-group ranks this rank exchanges messages with on ``device`` (either way)."""
        return tuple(sorted({r for k, n, r in (*self._routes(self.rank, device), *self._routes(device, self.rank))}))

    def _due(self, peer: int, to: int, tag: int, nbytes: int, posted: float) -> tuple[float, Carried]:
        """Wall-clock time at which a message of ``nbytes`` posted at ``posted`` to device ``peer`` (process-group
        rank ``to``) arrives over the emulated link, and what the watch is told of it until then."""
        from pipefold.runtime.slowlinks import Carried
        from pipefold.sim.network import Wire

        assert self.network is not None
        wire = self._wires.get(peer)
        if wire is None:
            wire = self._wires[peer] = Wire(self.network.conditions(self.rank, peer))
        t = posted - self.origin
        start = max(t, wire.free)
        state = wire.conditions.at(start)
        due = self.origin + wire.send(t, nbytes)
        direction = tag // (MAX_TENSORS * self.M * self.S)
        return due, Carried(src=self.rank, dst=to, what=_WHAT[direction], nbytes=nbytes, posted=posted,
                            sent=self.origin + start, arrives=due, latency=state.latency, bandwidth=state.bandwidth)

    def carrying(self) -> list[Carried]:
        """Per peer, the first message its emulated link still holds back (none without a network)."""
        return [c for box in list(self.outboxes.values()) if (c := box.holding()) is not None]

    def _post_send(self, t: torch.Tensor, device: int, to: int, tag: int, nbytes: int) -> None:
        """Post a send of ``t`` to process-group rank ``to`` on pipeline ``device`` now, or, over an emulated
        link, have the link's thread post it when it is due."""
        outbox = self._outbox(device, to)
        posted_at = wall()
        self.sent[to] = self.sent.get(to, 0) + nbytes
        if self.staged:
            outbox.post((_Staged(t, to, tag, self.stream), (), nbytes, posted_at, tag))
        elif self.network is None:
            outbox.post((post_message("send", t, to, tag), (t,), nbytes, posted_at, tag))
        else:
            due, carried = self._due(device, to, tag, nbytes, posted_at)
            outbox.post((_Deferred(t, to, tag, due, carried), (t,), nbytes, posted_at, tag))

    def _outbox(self, device: int, to: int) -> _Outbox:
        if to not in self.outboxes:
            # gloo's handles report completion only through wait(): a thread per link waits on them.
            self.outboxes[to] = _Outbox(to, threaded=self.device.type != "cuda" or self.staged)
            self._device_of[to] = device
        return self.outboxes[to]

    def tag(self, direction: int, stage: int, microbatch: int, index: int) -> int:
        return ((direction * self.S + stage) * self.M + microbatch) * MAX_TENSORS + index

    def send(self, direction: int, stage: int, microbatch: int, tensors: tuple[torch.Tensor, ...],
             peer: int) -> None:
        """Post the sends to device ``peer`` (this rank's pieces of each tensor, resharded between meshes); the
        link keeps the tensors until they are delivered."""
        routes = self._routes(self.rank, peer)
        for i, t in enumerate(tensors):
            t = t.contiguous()
            tag = self.tag(direction, stage, microbatch, i)
            if self.log is not None:
                self.log.append(("send", peer, tag))
            if len(routes) == 1 and routes[0][1] == 1:  # one rank to one rank: the tensor as it is
                self.meter.hold((t,), "send")  # a copy when ``t`` was not contiguous; already counted otherwise
                self._post_send(t, peer, routes[0][2], tag, t.untyped_storage().nbytes())
                continue
            flat = t.reshape(-1)
            pieces = routes[0][1]
            if (n := _padded(flat.numel(), pieces)) != flat.numel():
                flat = torch.cat([flat, flat.new_zeros(n - flat.numel())])
            self.meter.hold((flat,), "send")
            size = n // pieces
            for k, _, to in routes:
                piece = flat[k * size:(k + 1) * size]
                self._post_send(piece, peer, to, tag, piece.numel() * piece.element_size())

    def recv(self, direction: int, stage: int, microbatch: int, metas: tuple[Meta, ...], peer: int) -> Incoming:
        """Post the receives from device ``peer`` into fresh buffers (pinned host memory on a staged link); the
        caller takes the tensors with :meth:`Incoming.wait`."""
        routes = self._routes(peer, self.rank)
        whole = len(routes) == 1 and routes[0][1] == 1
        pieces = routes[0][1]
        shapes = [m.shape if whole else (_padded(math.prod(m.shape), pieces),) for m in metas]
        if self.staged:
            bufs = tuple(torch.empty(shape, dtype=m.dtype, pin_memory=self.stream is not None)
                         for shape, m in zip(shapes, metas, strict=True))
        else:
            bufs = tuple(torch.empty(shape, dtype=m.dtype, device=self.device)
                         for shape, m in zip(shapes, metas, strict=True))
            self.meter.hold(bufs, "recv")
        self.recv_posted.setdefault(peer, {})[self.tag(direction, stage, microbatch, 0)] = wall()
        works = []
        for i, b in enumerate(bufs):
            tag = self.tag(direction, stage, microbatch, i)
            if self.log is not None:
                self.log.append(("recv", peer, tag))
            size = b.numel() // pieces
            for k, _, src in routes:
                works.append(post_message("recv", b if whole else b[k * size:(k + 1) * size], src, tag))
        if whole:
            return Incoming(works, bufs, self)
        return Incoming(works, bufs, self, (self.group, len(self.mesh(self.rank)), self.index, metas))

    def land(self, host: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Received host buffers onto the device, copied on the communication stream; the current (compute)
        stream waits for the copies, and the copies' memory for the compute stream's use of them."""
        if self.stream is None:  # staged on the CPU (tests): the copy the GPU would make
            out = tuple(b.clone() for b in host)
        else:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.stream):
                out = tuple(b.to(self.device, non_blocking=True) for b in host)
            compute.wait_stream(self.stream)
            for t in out:
                t.record_stream(compute)  # allocated on the copy stream, read and freed on the compute stream
        self.meter.hold(out, "recv")
        return out

    @property
    def _header_device(self) -> torch.device:
        """NCCL sends only tensors on the GPU; gloo only host memory."""
        return torch.device("cpu") if self.staged else self.device

    def send_header(self, stage: int, metas: tuple[Meta, ...], peer: int, spec: bytes = b"") -> None:
        """The shapes (and the structure, :mod:`pipefold.runtime.structure`) of what stage ``stage`` will receive,
        to each rank of device ``peer`` this rank sends pieces."""
        tag = self.tag(HEADER, stage, 0, 0)
        if self.log is not None:
            self.log.append(("send", peer, tag))
        h = encode_header(metas, spec).to(self._header_device)  # one tensor, read by every send of it
        for _, _, to in self._routes(self.rank, peer):
            if self.staged:  # a host tensor already: straight to gloo, no copy
                self._outbox(peer, to).post((post_message("send", h, to, tag), (h,), 0, wall(), tag))
            else:
                self._post_send(h, peer, to, tag, 0)  # a few bytes of metadata: not activations

    def post_header_recv(self, stage: int, peer: int) -> tuple[Any, torch.Tensor]:
        """Post the receive of a header from device ``peer`` (from each rank that sends this rank pieces, the same
        header); :func:`decode_header` reads it once the work is done."""
        tag = self.tag(HEADER, stage, 0, 0)
        if self.log is not None:
            self.log.append(("recv", peer, tag))
        works, headers = [], []
        for _, _, src in self._routes(peer, self.rank):
            h = torch.zeros(_HEADER, dtype=torch.int64, device=self._header_device)
            works.append(post_message("recv", h, src, tag))
            headers.append(h)
        return (works[0] if len(works) == 1 else _AllWorks(works)), headers[0]

    def reap_sends(self) -> None:
        """Release the sends seen completed (on links without a thread; the threads release their own)."""
        for outbox in self.outboxes.values():
            outbox.poll()

    def settle(self, peer: int, count: int) -> None:
        """Return once the first ``count`` sends to device ``peer`` this step are released (the schedule says
        delivered): on each of its ranks this rank sends pieces to."""
        for _, _, to in self._routes(self.rank, peer):
            self._outbox(peer, to).settle(count, self.timeout)

    def wait_sends(self) -> None:
        """Return once every send is delivered and released."""
        for outbox in self.outboxes.values():
            outbox.settle(outbox.posted, self.timeout)

    def sending_to(self) -> tuple[int, ...]:
        """The process-group ranks this rank has sent to."""
        return tuple(self.outboxes)

    def link_bytes(self) -> dict[int, int]:
        """Per peer device, the most bytes in flight at once to it since :meth:`new_step` (its ranks' added)."""
        out: dict[int, int] = {}
        for to, box in self.outboxes.items():
            out[self._device_of[to]] = out.get(self._device_of[to], 0) + box.max_bytes
        return out

    def take_samples(self) -> tuple[dict[int, list[tuple[int, int, float, float]]], dict[int, dict[int, float]]]:
        """Since the last call: per peer device sent to, (tag, bytes, posted, delivered) of each message (each
        piece, between meshes); per peer device received from, when the receive of each message (by tag) was
        posted. Wall-clock seconds."""
        out: dict[int, list[tuple[int, int, float, float]]] = {}
        for to, box in self.outboxes.items():
            out.setdefault(self._device_of[to], []).extend(box.take_samples())
        posted, self.recv_posted = self.recv_posted, {}
        return out, posted

    def new_step(self) -> None:
        """Count sends, bytes and in-flight maxima from zero (every send of the last step has been released)."""
        for outbox in self.outboxes.values():
            outbox.posted = outbox.released = 0
            outbox.reset_max()
        self.sent, self.gathered = {}, 0

    def close(self) -> None:
        for outbox in self.outboxes.values():
            outbox.close()


class _AllWorks:
    """Several works as one: completed when all are, waited for together."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()

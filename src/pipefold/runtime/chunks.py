"""Model-state chunks: a rank's optimizer state in fixed-size chunks, each on the device or in host memory, the
host's chunks stepped by the CPU (PatrickStar's chunks; AxoNN's and ZeRO-Offload's host-memory optimizer).

The parameters are packed in order into chunks (:func:`pipefold.plan.chunks.pack`); each chunk gets one flat
buffer per optimizer state (Adam's two moments), and the optimizer's state tensors of its parameters become views
of those buffers. Where a chunk lives is decided at the first optimizer step, from the warm-up step's memory
statistics: the device bytes that the parameters, their gradients and the step's activation peak (the memory
meter's) leave free of the device's memory are filled with chunks in order (:func:`pipefold.plan.chunks.place`);
the rest live in host memory, pinned on a GPU::

    device    parameters, gradients   activations (the meter's peak)   state of c0 c1   | device memory
    host                                                               value, gradient and state of c2 c3

A device chunk is stepped where it is, by the user's optimizer over its parameters. A host chunk holds a float32
copy of its parameters too: its step copies the chunk's gradients into host memory in one piece, steps the copy
there, and copies the stepped values back into the parameters. On a GPU both copies run on copy streams, the
next chunk's gradients arriving while the CPU steps this one and this one's values leaving while it steps the
next. Every chunk has its own optimizer (``make`` of its parameters), so the updates are the plain optimizer's,
element for element, wherever they run: the same weights after every step.

With ZeRO-1 (a data-parallel ``group``) each copy holds and steps only its share of the chunks (shared by bytes,
:func:`pipefold.plan.shares.shares`), then sends its chunks' stepped parameters to the other copies.

With master weights (:class:`~pipefold.runtime.precision.Masters`: parameters in bf16 or fp16, float32 masters)
the chunks hold the masters and their float32 gradients themselves. Every chunk starts in host memory: the
parameters' gradients are added into its gradient buffer as autograd makes them (the masters' hook, one copy per
parameter and microbatch), and the device keeps only the 16-bit parameters and, while a backward makes them, their
gradients (AxoNN's and ZeRO-Offload's split). At the first step the chunks that fit move to the device, masters,
gradients and state together; the others stay in host memory and are stepped there, and the masters' write-back
rounds the stepped values into the parameters wherever the masters are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError
from pipefold.plan.chunks import ChunkPlacement, choose_capacity, pack, place, state_bytes
from pipefold.plan.shares import shares
from pipefold.units import format_bytes

if TYPE_CHECKING:
    from pipefold.runtime.precision import Masters

__all__ = ["ChunkMemory", "ChunkedOptimizer", "count_states", "left_free", "static_bytes"]


def static_bytes(params: Sequence[torch.Tensor]) -> int:
    """The device bytes of ``params`` and of a gradient of each that needs one: what the device holds of the model
    besides the optimizer state, for the whole step (the gradients from their first W on)."""
    return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in params)


def left_free(budget: float, params: Sequence[torch.Tensor], warm_up: Any) -> float:
    """The device bytes of ``budget`` that a step leaves to the optimizer state: less the parameters and their
    gradients, and the warm-up step's (a :class:`~pipefold.runtime.executor.StepStats`) activation peak and
    batch, as the memory meter counted them."""
    activations = 0 if warm_up is None else warm_up.peak_activation_bytes + warm_up.batch_bytes
    return budget - static_bytes(params) - activations


def count_states(make: Callable[[list[Any]], torch.optim.Optimizer]) -> int:
    """How many tensors of a parameter's shape ``make``'s optimizer keeps per parameter (Adam: 2, SGD with
    momentum: 1), found by stepping it once on a parameter of its own; an optimizer that keeps state of other
    shapes (Adafactor's row and column factors) is refused: its state does not split into chunks."""
    probe = nn.Parameter(torch.zeros(3, 5))
    probe.grad = torch.ones_like(probe)
    opt = make([probe])
    opt.step()
    tensors = [(k, v) for k, v in opt.state[probe].items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    other = [k for k, v in tensors if v.shape != probe.shape]
    if other:
        raise ConfigError(f"{type(opt).__name__} keeps state of other shapes than its parameters' ({', '.join(other)}"
                          "): model-state chunks step optimizers whose state is elementwise, such as SGD, Adam and "
                          "AdamW")
    return len(tensors)


@dataclass(frozen=True)
class ChunkMemory:
    """The bytes a rank's chunks hold, by where: the state on the device, and in host memory the state with its
    float32 parameters and gradients; ``unused``: the room at the chunks' ends, allocated all the same."""

    device: int
    host: int
    unused: int
    chunks: int
    on_device: int


class _Chunk:
    """One chunk: its parameters, its optimizer, and (once placed) its flat state buffers."""

    def __init__(self, index: int, params: list[torch.Tensor], capacity: int) -> None:
        self.index = index
        self.params: list[torch.Tensor] = params
        self.capacity = capacity
        self.offsets = []
        at = 0
        for p in params:
            self.offsets.append(at)
            at += p.numel()
        self.used = at
        self.optim: torch.optim.Optimizer | None = None
        self.on_device = True
        self.stepped: list[torch.Tensor] = []
        """What the optimizer steps: the parameters themselves on the device, views of ``value`` on the host."""
        self.value: torch.Tensor | None = None
        """The float32 values the host steps (a host chunk's, or every chunk's master weights)."""
        self.grad: torch.Tensor | None = None
        self.states: dict[str, torch.Tensor] = {}
        """One flat buffer per optimizer state (Adam's ``exp_avg``, ``exp_avg_sq``)."""
        self.low: list[nn.Parameter] = []
        """With master weights: the 16-bit parameters whose masters the chunk holds."""
        self.waiting = set(range(len(params)))
        """The parameters whose state is not in the chunk's buffers yet (none was made: no gradient so far)."""

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params, strict=True)]

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.value, self.grad, *self.states.values()) if t is not None]


class ChunkedOptimizer:
    """``make``'s optimizer over ``params``, its state in chunks of ``capacity`` elements (chosen when None) on the
    device or in host memory (see the module's docstring).

    ``free``: called at the first step, the device bytes that the chunks' state may use (what the warm-up step
    left free); None or a call returning None keeps every chunk's state on the device. ``host_memory``: the bytes
    host memory has for this copy's chunks (the system's available memory when None); a run whose host chunks cannot fit
    even with the device as full as ``device_room`` allows is refused here, before its first step. ``group``:
    ZeRO-1 over the data-parallel copies in it. ``masters``: the float32 master weights that ``params`` are (see the
    module's docstring), which the chunks then hold."""

    def __init__(self, params: Sequence[nn.Parameter], make: Callable[[list[Any]], torch.optim.Optimizer], *,
                 capacity: int | None = None, free: Callable[[], float | None] | None = None,
                 device_room: float | None = None, host_memory: float | None = None, group: Any = None,
                 masters: Masters | None = None) -> None:
        params = list(params)
        if masters is not None and group is not None:
            raise ConfigError("model-state chunks with master weights run without ZeRO-1: give the copies plain "
                              "chunks (precision bf16, autocast) to share them, or chunk each copy's own masters")
        if masters is not None and [id(m) for m in params] != [id(m) for m in masters.masters]:
            raise ConfigError("model-state chunks with master weights step exactly the masters' float32 copies")
        for p in params:
            if type(p) not in (torch.Tensor, nn.Parameter) or p.dtype != torch.float32:
                raise ConfigError("model-state chunks step float32 parameters of plain stage modules (autocast "
                                  "precision bf16/fp16 keeps them so); master weights, FSDP and tensor-parallel "
                                  f"parameters run without chunks (got a {type(p).__name__} of {p.dtype})")
        sizes = [p.numel() for p in params]
        self.capacity = choose_capacity(sizes) if capacity is None else int(capacity)
        self.chunks = [_Chunk(i, [params[j] for j in idx], self.capacity)
                       for i, idx in enumerate(pack(sizes, self.capacity))]
        self.group = group
        self.ranks = dist.get_process_group_ranks(group) if group is not None else [None]
        me = dist.get_rank(group) if group is not None else 0
        self.owners = [0] * len(self.chunks)
        for owner, share in enumerate(shares([c.used for c in self.chunks], len(self.ranks))):
            for i in share:
                self.owners[i] = owner
        self.mine = [c for c in self.chunks if self.owners[c.index] == me]
        """The chunks this copy holds and steps (all of them without ZeRO-1)."""
        self.masters = masters
        self.device = (masters.pairs[0][0] if masters is not None and masters.pairs else
                       params[0] if params else torch.empty(0)).device
        """Where the parameters are (their masters start in host memory)."""
        self.states = count_states(make)
        """Optimizer tensors per parameter element (Adam: 2)."""
        for c in self.mine:
            c.optim = make(list(c.params))
        if masters is not None:
            for c in self.mine:
                self._masters_home(c)
        self._free = free
        self.placement: ChunkPlacement | None = None
        """Where each of :attr:`mine` keeps its state: decided at the first step."""
        self._check_host(device_room, host_memory)

    # -- before the first step

    def _check_host(self, device_room: float | None, host_memory: float | None) -> None:
        """Refuse a run whose host chunks cannot fit in host memory even with as much state on the device as
        ``device_room`` (bytes) allows."""
        if host_memory is None:
            from pipefold.models.size import available_memory

            host_memory = available_memory()
        if host_memory is None:
            return
        least = place([c.capacity for c in self.mine], self.states, device_room if device_room is not None
                      else float("inf"), masters=self.masters is not None)
        if least.host_bytes > host_memory:
            raise ConfigError(f"host memory too small for the model-state chunks: they need at least "
                              f"{format_bytes(least.host_bytes)} of it ({len(self.mine) - sum(least.on_device)} "
                              f"chunks of {self.capacity:,} elements with their state, parameters and gradients), "
                              f"{format_bytes(host_memory)} is free for them: give the device more memory, or train "
                              "a smaller model or with data-parallel copies and ZeRO-1 to share the chunks")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every chunk's param groups: what an LR schedule sets (``for g in opt.param_groups: g["lr"] = ...``)."""
        return [g for c in self.mine if c.optim is not None for g in c.optim.param_groups]

    # -- the first step: placement

    def _masters_home(self, c: _Chunk) -> None:
        """Master weights: the chunk's masters moved into float32 buffers in host memory, its parameters' gradients
        added there from now on, the device's float32 copies let go (:meth:`Masters.rehome`)."""
        assert self.masters is not None and c.optim is not None
        pin = self.device.type == "cuda"
        c.value = torch.empty(c.capacity, dtype=torch.float32, pin_memory=pin)
        c.grad = torch.zeros(c.capacity, dtype=torch.float32, pin_memory=pin)
        low = {id(m): p for p, m in self.masters.pairs}
        self._rehome(c, [low[id(m)] for m in c.params], c.views(c.value), c.views(c.grad))
        c.on_device = False

    def _rehome(self, c: _Chunk, low: list[nn.Parameter], values: list[torch.Tensor],
                grads: list[torch.Tensor]) -> None:
        """The chunk's masters become ``values`` (views of its value buffer), with their gradients so far and
        from now on in ``grads``; its optimizer (with no state yet) steps them."""
        assert self.masters is not None and c.optim is not None
        swap = {}
        with torch.no_grad():
            for p, old, new, g in zip(low, c.params, values, grads, strict=True):
                new.copy_(old.detach())
                if old.grad is not None:
                    g.copy_(old.grad)
                    new.grad = g
                new._pf_slot = g  # type: ignore[attr-defined]
                self.masters.rehome(p, new)
                swap[id(old)] = new
        for group in c.optim.param_groups:
            group["params"] = [swap[id(q)] for q in group["params"]]
        c.params = c.stepped = list(values)
        c.low = list(low)

    def _place(self) -> None:
        free = self._free() if self._free is not None else None
        masters = self.masters is not None
        self.placement = place([c.capacity for c in self.mine], self.states,
                               float("inf") if free is None else free, masters=masters)
        for c, on_device in zip(self.mine, self.placement.on_device, strict=True):
            c.on_device = on_device
            if masters:
                if on_device and self.device.type != "cpu":  # to the device: masters, gradients, (later) state
                    assert c.value is not None and c.grad is not None
                    c.value, c.grad = c.value.to(self.device), c.grad.to(self.device)
                    self._rehome(c, c.low, c.views(c.value), c.views(c.grad))
                continue
            if on_device:
                c.stepped = list(c.params)
                continue
            # A host copy of the chunk's parameters, stepped in their place (pinned on a GPU for its copies).
            pin = self.device.type == "cuda"
            c.value = torch.empty(c.capacity, dtype=torch.float32, pin_memory=pin)
            c.grad = torch.zeros(c.capacity, dtype=torch.float32, pin_memory=pin)
            c.stepped = c.views(c.value)
            with torch.no_grad():
                for s, p in zip(c.stepped, c.params, strict=True):
                    s.copy_(p.detach())
            assert c.optim is not None
            swap = {id(p): s for p, s in zip(c.params, c.stepped, strict=True)}
            for group in c.optim.param_groups:  # the optimizer has no state yet: it steps the host copies
                group["params"] = [swap[id(p)] for p in group["params"]]

    def _adopt(self, c: _Chunk) -> None:
        """After a step: the state tensors the chunk's optimizer made for its parameters (at each one's first
        step with a gradient) moved into one flat buffer per state, where the chunk lives, each parameter's state
        a view of it."""
        assert c.optim is not None
        pin = not c.on_device and self.device.type == "cuda"
        for i in sorted(c.waiting):
            s = c.stepped[i]
            state = c.optim.state.get(s)
            if not state:
                continue  # no gradient yet: no state yet
            names = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
            if len(names) != self.states or any(state[k].shape != s.shape for k in names):
                raise ConfigError(f"{type(c.optim).__name__} keeps {len(names)} state tensors for a parameter of "
                                  f"shape {tuple(s.shape)} where its probe kept {self.states} of its parameter's "
                                  "shape: model-state chunks step optimizers whose state is elementwise (SGD, Adam, "
                                  "AdamW)")
            o = c.offsets[i]
            for name in names:
                if name not in c.states:
                    c.states[name] = torch.zeros(c.capacity, dtype=torch.float32, device=s.device, pin_memory=pin)
                view = c.states[name][o:o + s.numel()].view(s.shape)
                view.copy_(state[name])
                state[name] = view
            c.waiting.discard(i)

    # -- every step

    @torch.no_grad()
    def step(self) -> None:
        if self.placement is None:
            self._place()
        cuda = self.device.type == "cuda"
        host = [c for c in self.mine if not c.on_device]
        for c in self.mine:
            if c.on_device or self.masters is not None:  # masters: the gradients are where the chunk is
                self._step(c)
        if host and self.masters is None:
            self._step_host(host, cuda)
        if self.group is not None:
            self._share()

    def _step(self, c: _Chunk) -> None:
        assert c.optim is not None
        c.optim.step()
        if c.waiting:
            self._adopt(c)

    def _step_host(self, host: list[_Chunk], cuda: bool) -> None:
        """Each host chunk: its gradients in, a CPU step, its values out; on a GPU the copies of the next and the
        last chunk run on copy streams while the CPU steps this one."""
        if not cuda:
            for c in host:
                self._grads_in(c)
                self._step(c)
                self._values_out(c)
            return
        d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()
        arrived = []
        compute = torch.cuda.current_stream()
        for c in host:  # every chunk's gradients queued at once: they wait for the backward's last kernel
            d2h.wait_stream(compute)
            with torch.cuda.stream(d2h):
                self._grads_in(c)
                event = torch.cuda.Event()
                event.record(d2h)
            arrived.append(event)
        for c, event in zip(host, arrived, strict=True):
            event.synchronize()
            self._step(c)
            with torch.cuda.stream(h2d):
                self._values_out(c)
        compute.wait_stream(h2d)

    @staticmethod
    def _grads_in(c: _Chunk) -> None:
        """The chunk's gradients into its host buffer; a parameter without one has none there either (the
        optimizer leaves it alone, as it leaves the parameter)."""
        assert c.grad is not None
        for p, s, g in zip(c.params, c.stepped, c.views(c.grad), strict=True):
            if p.grad is None:
                s.grad = None
            else:
                g.copy_(p.grad, non_blocking=True)
                s.grad = g

    @staticmethod
    def _values_out(c: _Chunk) -> None:
        for p, s in zip(c.params, c.stepped, strict=True):
            p.copy_(s, non_blocking=True)

    def _share(self) -> None:
        """ZeRO-1: each copy's stepped chunks to the others, one flat broadcast per owner."""
        from pipefold.runtime.comm import FlatBroadcast

        pending = []
        for owner in range(len(self.ranks)):
            tensors = [p.detach() for c in self.chunks if self.owners[c.index] == owner for p in c.params]
            src = self.ranks[owner]
            if tensors and src is not None:
                pending.append(FlatBroadcast(tensors, src, self.group))
        for each in pending:
            each.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradients of every parameter, the chunks of the other copies included."""
        for c in self.chunks:
            for p in (*c.params, *(s for s in c.stepped if c.value is not None)):
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    # -- what it holds

    def memory(self) -> ChunkMemory:
        """The bytes of this copy's chunks now, counted from their buffers (before the first step: none)."""
        device = host = unused = 0
        for c in self.mine:
            held = sum(t.numel() * t.element_size() for t in c.buffers())
            if c.on_device:
                device += held
            else:
                host += held
            unused += (c.capacity - c.used) * 4 * len(c.buffers())
        return ChunkMemory(device, host, unused, len(self.mine), sum(c.on_device for c in self.mine))

    def predicted(self) -> ChunkMemory:
        """:meth:`memory` as :func:`pipefold.plan.chunks.state_bytes` predicts it from the placement."""
        if self.placement is None:
            return ChunkMemory(0, 0, 0, len(self.mine), len(self.mine))
        device = sum(state_bytes(c.capacity, self.states, host=self.masters is not None)
                     for c in self.mine if c.on_device)
        host = sum(state_bytes(c.capacity, self.states, host=True) for c in self.mine if not c.on_device)
        unused = sum((c.capacity - c.used) * 4 * (self.states + (0 if c.on_device and self.masters is None else 2))
                     for c in self.mine)
        return ChunkMemory(device, host, unused, len(self.mine), sum(self.placement.on_device))

    def device_buffers(self) -> list[torch.Tensor]:
        """The state buffers of this copy's chunks on the device."""
        return [t for c in self.mine if c.on_device for t in c.buffers()]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers that hold this copy's state, one per chunk."""
        return [c.optim for c in self.mine if c.optim is not None]

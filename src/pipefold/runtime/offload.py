"""Superpipeline-style layer offloading: at most k layers' parameters on the device, the rest at home on the CPU.

Each offloaded layer's parameters live in a CPU *home* tensor. Before layer i runs its parameters
are copied to the device (*fetched*) and swapped in as the parameters' ``.data``, so the layer's own
code and math are untouched and results equal the unwrapped model's bit for bit. Layers i+1..i+k-1
are prefetched while i computes (on CUDA on a copy stream, on the CPU synchronously: same code path).
Once k' layers have run they are *evicted* together: ``.data`` points home again and the device copy
is freed. Forward with k=3, k'=1 (F = fetch, C = compute, E = evict)::

    time ->      t0          t1          t2          t3
    copy         F0 F1 F2    F3          F4          F5         F(i+3) overlaps C(i+1)
    compute         C0          C1          C2          C3
    evict              E0          E1          E2          E3   E(i) right after C(i): k' = 1
    resident     {0,1,2}     {1,2,3}     {2,3,4}     {3,4,5}    never more than k = 3 layers

Backward runs the same window in reverse: a hook on layer i's output fires when its gradient
arrives, before any of layer i's backward runs, and fetches i (prefetching i-1..i-k+1); once every
weight gradient of layer i has been accumulated the layer counts as done and is evicted, its
gradients going home into the home parameters' ``.grad`` (or staying on the device with
``grads_stay=True``). Tensors a layer saves for backward that are views of its device parameters are
saved as references (saved-tensor hooks), not as tensors: otherwise autograd would keep every
evicted device copy alive until backward, and nothing would really be offloaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pipefold.errors import ConfigError

__all__ = ["Offloaded", "Residency", "ResidencyTracker", "choose_k"]


class Residency(NamedTuple):
    """One fetch or evict: the layers whose parameters are on the compute device right after it, and their bytes."""

    event: str
    """``"fetch"`` or ``"evict"``."""
    layer: int
    """Index of the fetched or evicted layer among the offloaded layers."""
    resident: frozenset[int]
    resident_bytes: int
    """Bytes of parameters on the device: the resident offloaded layers' device copies plus the static part."""


class ResidencyTracker:
    """Every fetch and evict with the resident set after it; the peak of resident parameter bytes comes from here."""

    def __init__(self, k: int, *, static_bytes: int = 0) -> None:
        self.k = k
        self.static_bytes = static_bytes
        """Bytes of parameters that never leave the device (layers before and after the offloaded ones)."""
        self.events: list[Residency] = []
        self.peak_resident_bytes = static_bytes

    def record(self, event: str, layer: int, resident: Mapping[int, int]) -> None:
        """Log ``event`` of ``layer``; ``resident`` maps each resident layer to the bytes of its device copies."""
        if len(resident) > self.k:  # raised, not asserted: the invariant must hold under python -O too
            raise AssertionError(f"{len(resident)} layers resident after {event} of layer {layer}, "
                                 f"more than k={self.k}: {sorted(resident)}")
        nbytes = self.static_bytes + sum(resident.values())
        self.events.append(Residency(event, layer, frozenset(resident), nbytes))
        self.peak_resident_bytes = max(self.peak_resident_bytes, nbytes)

    @property
    def peak_resident_layers(self) -> int:
        """The most offloaded layers that were on the device at once."""
        return max((len(e.resident) for e in self.events), default=0)


def choose_k(layer_bytes: Sequence[int], budget: int) -> tuple[int, int]:
    """The largest k whose every window of k consecutive layers fits in ``budget`` bytes, and a k' for it.

    k' is 1 (evict each layer as soon as it is done, leaving the most room to prefetch) unless the
    whole model fits, when there is nothing to gain from evicting early and k' = k.
    """
    if not layer_bytes:
        raise ConfigError("choose_k needs the parameter bytes of at least one layer (got an empty list)")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"the memory budget must be a positive number of bytes (got {budget!r})")
    largest = max(range(len(layer_bytes)), key=lambda i: layer_bytes[i])
    if budget < layer_bytes[largest]:
        raise ConfigError(f"a budget of {budget} bytes cannot hold layer {largest} alone ({layer_bytes[largest]} "
                          f"bytes): give a budget of at least {layer_bytes[largest]} bytes")
    k = 1
    # Window sums only grow with k (bytes are never negative), so the first k that fails ends the search.
    while k < len(layer_bytes) and _worst_window(layer_bytes, k + 1) <= budget:
        k += 1
    return k, k if k == len(layer_bytes) else 1


def _worst_window(layer_bytes: Sequence[int], k: int) -> int:
    """The most bytes any k consecutive layers hold."""
    return max(sum(layer_bytes[i:i + k]) for i in range(len(layer_bytes) - k + 1))


def _check_k(k: object, kprime: object) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"Offloaded k must be a positive integer (got {k!r}): pass k=1 or more layers on the device")
    if isinstance(kprime, bool) or not isinstance(kprime, int) or not 1 <= kprime <= k:
        raise ConfigError(f"Offloaded kprime must be an integer from 1 to k={k} (got {kprime!r}): "
                          f"pass kprime between 1 and {k}")


def _find_layers(layers: nn.Module | Sequence[nn.Module]) -> tuple[nn.Module, list[nn.Module]]:
    """The module to run and the layers to offload: all of a sequence, or the blocks of a model's one ModuleList."""
    if isinstance(layers, nn.Sequential):
        blocks = list(layers)
        model: nn.Module = layers
    elif isinstance(layers, (nn.ModuleList, list, tuple)):
        blocks = list(layers)
        if not all(isinstance(m, nn.Module) for m in blocks):
            raise ConfigError("Offloaded takes a list of nn.Module layers: found "
                              f"{type(next(m for m in blocks if not isinstance(m, nn.Module))).__name__}")
        model = nn.Sequential(*blocks)
    elif isinstance(layers, nn.Module):
        lists = [name for name, m in layers.named_children() if isinstance(m, nn.ModuleList)]
        if len(lists) != 1:
            found = f"several nn.ModuleList attributes ({', '.join(lists)})" if lists else "no nn.ModuleList attribute"
            raise ConfigError(f"model has no layer sequence to offload: {type(layers).__name__} has {found}; "
                              "pass an nn.Sequential, a list of layers, or a model with one nn.ModuleList of blocks")
        blocks = list(getattr(layers, lists[0]))
        model = layers
    else:
        raise ConfigError(f"model has no layer sequence to offload: got {type(layers).__name__}")
    if not blocks:
        raise ConfigError("model has no layer sequence to offload: the layer sequence is empty")
    return model, blocks


class _ParamRef(NamedTuple):
    """What a layer saves for backward in place of a view of one of its device parameters."""

    layer: int
    param: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _OnHost(NamedTuple):
    """An activation saved for backward, kept in (pinned) CPU memory until backward needs it back."""

    tensor: torch.Tensor
    device: torch.device


class _Slot:
    """One offloaded layer: its parameters, their home tensors, and their device copies while resident."""

    def __init__(self, module: nn.Module, pin: bool) -> None:
        self.module = module
        self.params = list(module.parameters())
        self.home: list[torch.Tensor] = []
        for p in self.params:
            home = p.data.cpu()
            # Pinned pages let the host-to-device copy run asynchronously on the copy stream.
            self.home.append(home.pin_memory() if pin else home)
            p.data = self.home[-1]
        self.trainable = [p for p in self.params if p.requires_grad]
        self.copies: list[torch.Tensor] | None = None
        self.ready: torch.cuda.Event | None = None
        self.accumulated: set[nn.Parameter] = set()
        """Trainable parameters whose gradient of the running backward has been accumulated."""

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.home)


class Offloaded(nn.Module):
    """Runs ``layers`` on ``device`` with at most ``k`` offloaded layers' parameters there at any moment.

    ``layers`` is an nn.Sequential, a list of layers, or a model with exactly one nn.ModuleList
    attribute: then only that list's blocks are offloaded (they must be called in list order), and
    everything else moves to ``device`` and stays there. Buffers always stay on the device.
    ``parameters()`` yields the home parameters, so an optimizer built on it steps the CPU copies.

    Zero gradients before the forward or after the step, not between forward and backward: with
    k' > 1 the last layers stay on the device for backward, their earlier gradients set aside. After a
    forward that records a graph but is never backpropagated, call :meth:`evict_all`.
    """

    def __init__(self, layers: nn.Module | Sequence[nn.Module], device: str | torch.device, *, k: int, kprime: int,
                 grads_stay: bool = False, activations_to_cpu: bool = False) -> None:
        super().__init__()
        self.activations_to_cpu = activations_to_cpu
        """Keep what offloaded layers save for backward in CPU memory (pinned with CUDA) until backward."""
        self.on_saved: Callable[[torch.Tensor], None] | None = None
        """Called with each activation an offloaded layer saves for backward. The layers' own saved-tensor
        hooks hide them from any outer hook, so a caller that counts saved bytes listens here."""
        _check_k(k, kprime)
        self.model, blocks = _find_layers(layers)
        self.device = torch.device(device)
        self.k = k
        self.kprime = kprime
        self.grads_stay = grads_stay
        self._check_not_shared(blocks)
        self._slots = [_Slot(m, pin=torch.cuda.is_available()) for m in blocks]
        offloaded = {p for s in self._slots for p in s.params}
        static = 0
        for p in self.model.parameters():
            if p not in offloaded:
                p.data = p.data.to(self.device)
                static += p.nbytes
        for b in self.model.buffers():
            b.data = b.data.to(self.device)
        self.tracker = ResidencyTracker(k, static_bytes=static)
        self.device_grads: dict[nn.Parameter, torch.Tensor] = {}
        """With ``grads_stay=True``: each offloaded parameter's gradient, summed on the device."""
        self._home_grads: dict[nn.Parameter, torch.Tensor] = {}  # home .grad set aside while a layer is resident
        self._done: list[int] = []  # layers that have run, waiting until k' of them can be evicted together
        self._started: set[int] = set()
        self._backward = False
        self._saved_hooks: list[torch.autograd.graph.saved_tensors_hooks] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._handles: list[RemovableHandle] = []
        self._removed = False
        for i, slot in enumerate(self._slots):
            self._handles.append(slot.module.register_forward_pre_hook(self._pre_forward(i)))
            self._handles.append(slot.module.register_forward_hook(self._post_forward(i), always_call=True))
            self._handles += [p.register_post_accumulate_grad_hook(self._on_grad(i)) for p in slot.trainable]

    @staticmethod
    def _check_not_shared(blocks: list[nn.Module]) -> None:
        owner: dict[nn.Parameter, int] = {}
        for i, m in enumerate(blocks):
            for p in m.parameters():
                if owner.setdefault(p, i) != i:
                    raise ConfigError(f"layers {owner[p]} and {i} share a parameter: tied weights cannot be "
                                      "offloaded layer by layer; untie them or keep one of the layers resident")

    @property
    def layer_bytes(self) -> list[int]:
        """Parameter bytes of each offloaded layer, e.g. for :func:`choose_k`."""
        return [s.nbytes for s in self._slots]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._removed:
            raise RuntimeError("this Offloaded was removed: run the model it returned instead")
        out = self.model(*args, **kwargs)
        if not _needs_backward(out):
            self.evict_all()  # no backward will come to do it, and the optimizer must see the home copies
        return out

    def remove(self) -> nn.Module:
        """Undo the wrapping and return the model, a plain module again.

        Every layer goes home with its gradient and every hook is removed. The offloaded
        layers' parameters stay in CPU memory, the rest on the device; ``model.to(...)``
        puts them anywhere. Also what leaving a ``with Offloaded(...) as m:`` block does.
        """
        if not self._removed:
            self.evict_all()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._removed = True
        return self.model

    def __enter__(self) -> Offloaded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def evict_all(self) -> None:
        """Evict every resident layer and give each parameter back its home gradient."""
        for i, slot in enumerate(self._slots):
            if slot.copies is not None:
                self._evict(i)
        for p, g in self._home_grads.items():
            p.grad = g
        self._home_grads.clear()
        self._done.clear()
        self._started.clear()
        for slot in self._slots:
            slot.accumulated.clear()
        self._backward = False

    def gather_grads(self) -> None:
        """With ``grads_stay=True``: add the gradients kept on the device into the home parameters' ``.grad``."""
        for p, g in self.device_grads.items():
            home = g.to(p.device)
            p.grad = home if p.grad is None else p.grad + home
        self.device_grads.clear()

    # -- schedule: which layers to fetch and evict

    def _start(self, i: int, step: int) -> None:
        """Layer i is about to run (step +1 forward, -1 backward): make it resident, prefetch the window."""
        self._ensure(i, step)
        self._started.add(i)
        for j in _window(i, step, self.k, len(self._slots))[1:]:
            if self._slots[j].copies is None:
                if len(self._resident()) >= self.k:
                    break  # prefetching never evicts: only layers that are done make room
                self._fetch(j)

    def _ensure(self, i: int, step: int) -> None:
        if self._slots[i].copies is None:
            while len(self._resident()) >= self.k:
                self._evict(self._victim(i, step))
            self._fetch(i)
        self._wait(i)

    def _victim(self, i: int, step: int) -> int:
        """The layer to evict to make room for layer i: a done one, else the least useful soon."""
        if self._done:
            return self._done[0]
        window = set(_window(i, step, self.k, len(self._slots)))
        others = [j for j in self._resident() if j != i]
        # Evicting a started layer would send its late weight gradients to an evicted layer: last resort.
        return min(others, key=lambda j: (j in self._started, j in window, -abs(j - i)))

    def _finish(self, i: int) -> None:
        """Layer i has run (forward) or has all its weight gradients (backward): evict once k' are done."""
        self._started.discard(i)
        if i not in self._done:
            self._done.append(i)
        if len(self._done) >= self.kprime:
            for j in list(self._done):
                self._evict(j)

    def _resident(self) -> dict[int, int]:
        """Resident layer -> bytes of its device copies, measured from the tensors themselves."""
        return {i: sum(c.nbytes for c in s.copies) for i, s in enumerate(self._slots) if s.copies is not None}

    # -- moving parameters

    def _fetch(self, i: int) -> None:
        slot = self._slots[i]
        for p in slot.params:
            if p.grad is not None:
                # A home gradient from an earlier backward: autograd cannot add a device gradient into it.
                self._home_grads[p] = p.grad
                p.grad = None
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            # A real copy even on the CPU, so the CPU path runs the same code as the CUDA one.
            slot.copies = [torch.empty_like(h, device=self.device).copy_(h, non_blocking=True) for h in slot.home]
            if self._stream is not None:
                slot.ready = torch.cuda.Event()
                slot.ready.record(self._stream)
        for p, c in zip(slot.params, slot.copies, strict=True):
            p.data = c
        self.tracker.record("fetch", i, self._resident())

    def _wait(self, i: int) -> None:
        """Make the current stream wait for layer i's copy (a no-op on the CPU, where the copy is done)."""
        slot = self._slots[i]
        if slot.ready is not None and slot.copies is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(slot.ready)
            for c in slot.copies:
                c.record_stream(compute)  # allocated on the copy stream: do not reuse it before compute is done
            slot.ready = None

    def _evict(self, i: int) -> None:
        slot = self._slots[i]
        for p, h in zip(slot.params, slot.home, strict=True):
            g = p.grad
            p.grad = None  # before the swap: a device gradient may not hang on a home parameter
            p.data = h
            if g is not None:
                self._absorb(p, g)
            if not self._backward and p in self._home_grads:
                # In a backward a late gradient could still arrive on the device; give .grad back only at the end.
                p.grad = self._home_grads.pop(p)
        slot.copies = None
        slot.ready = None
        if i in self._done:
            self._done.remove(i)
        self._started.discard(i)
        self.tracker.record("evict", i, self._resident())

    def _absorb(self, p: nn.Parameter, g: torch.Tensor) -> None:
        """Add a gradient computed on the device into the home gradient, or into the one kept on the device."""
        if self.grads_stay:
            self.device_grads[p] = self.device_grads[p] + g if p in self.device_grads else g
            return
        g = g.to(p.device)  # synchronous: the optimizer may read it as soon as backward returns
        self._home_grads[p] = self._home_grads[p] + g if p in self._home_grads else g

    # -- hooks

    def _pre_forward(self, i: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._start(i, +1)
            saved = torch.autograd.graph.saved_tensors_hooks(self._pack(i), self._unpack)
            saved.__enter__()
            self._saved_hooks.append(saved)
        return hook

    def _post_forward(self, i: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            self._saved_hooks.pop().__exit__(None, None, None)
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._backward_start(i))
            self._finish(i)
        return hook

    def _backward_start(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            # Layer i's output gradient is here, so none of layer i's backward has run yet.
            if not self._backward:
                self._backward = True
                self._done.clear()  # layers left from the forward are the first ones backward needs
                self._started.clear()
                torch.autograd.Variable._execution_engine.queue_callback(self.evict_all)
            if i not in self._started:
                self._start(i, -1)
        return hook

    def _on_grad(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            slot = self._slots[i]
            assert isinstance(p, nn.Parameter)
            if slot.copies is None:  # arrived after its layer was evicted: take it home now
                g, p.grad = p.grad, None
                if g is not None:
                    self._absorb(p, g)
                return
            slot.accumulated.add(p)
            if len(slot.accumulated) == len(slot.trainable) and i in self._started:
                slot.accumulated.clear()
                self._finish(i)
        return hook

    def _pack(self, i: int) -> Callable[[torch.Tensor], Any]:
        slot = self._slots[i]

        def pack(t: torch.Tensor) -> Any:
            # Never ``t`` itself (see StageRunner.forward): a node saving its own output would hold itself.
            if slot.copies is None or t.layout != torch.strided or t.numel() == 0:
                return t.detach()
            ptr = t.untyped_storage().data_ptr()
            for j, c in enumerate(slot.copies):
                if c.dtype == t.dtype and c.untyped_storage().data_ptr() == ptr:
                    return _ParamRef(i, j, t.size(), t.stride(), int(t.storage_offset()))
            if self.on_saved is not None:
                self.on_saved(t)
            if self.activations_to_cpu:
                # A real copy even when the compute device is the CPU, so this path runs in CI too.
                host = torch.empty_like(t, device="cpu", pin_memory=torch.cuda.is_available())
                host.copy_(t, non_blocking=True)
                return _OnHost(host, t.device)
            return t.detach()
        return pack

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _OnHost):
            return saved.tensor.to(saved.device, non_blocking=True)
        if not isinstance(saved, _ParamRef):
            return saved
        # Normally the output hook has fetched the layer already; this also covers graphs it did not see.
        self._ensure(saved.layer, -1)
        copies = self._slots[saved.layer].copies
        assert copies is not None
        return copies[saved.param].as_strided(saved.size, saved.stride, saved.offset)


def _window(i: int, step: int, k: int, n: int) -> list[int]:
    """Layer i and the next k-1 layers in the direction of travel that exist."""
    return [j for j in range(i, i + step * k, step) if 0 <= j < n]


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in a layer's output: a tensor, or a (nested) tuple, list or dict of them."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _needs_backward(out: Any) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(out))

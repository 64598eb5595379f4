"""The memory a rank holds during a step: every storage counted once, from when the runtime takes it until it dies.

The runtime tells the meter about each tensor it keeps (what a forward saves
for backward, stage outputs, gradients captured for W, receive buffers,
tensors being sent); the meter keys them by storage, so a view shares its
base's bytes and a tensor held in three places counts once. It does not take
the runtime's word for when a tensor is released: it watches the storage
itself (a weak reference whose callback runs when the last reference dies),
so a tensor the runtime forgot to drop stays on the meter, as it stays in
memory. Storages that exist before the step (the batch) are reported apart::

    level  ^        saved + outputs + captured + receive buffers + sends in flight
           |     __/\\__
           |  __/       \\____
           +--------------------> time in the step

Callbacks may run on another thread (a send is dropped by the thread that
saw it delivered), so every change takes a lock.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

from pipefold.runtime.sharding import local

__all__ = ["KINDS", "MemoryMeter", "storage_of"]

KINDS = ("saved", "output", "captured", "recv", "send", "kfac")
"""What the runtime holds: saved for backward, stage outputs and input gradients, gradients kept for W,
receive buffers, copies made for sending, layer inputs and output gradients kept for K-FAC's curvature."""


@dataclass
class _Entry:
    nbytes: int
    kind: str
    watch: weakref.ref[torch.UntypedStorage]
    """Calls the meter back when the storage dies (a plain weak reference: a ``weakref.finalize`` per tensor
    cost a third of what the runner adds to a small layer's forward)."""


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``t`` (a DTensor's: its local shard's), or None for tensors that hold no memory of their
    own (meta, empty, sparse)."""
    t = local(t)
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    st = t.untyped_storage()
    return st if st.nbytes() else None


class MemoryMeter:
    """Live bytes of the storages the runtime holds, with their peak and their curve over the step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.RLock()
        self._live: dict[int, _Entry] = {}  # id of a live storage -> its bytes and what it is
        self._outside: dict[int, torch.UntypedStorage] = {}  # storages from before the step, kept alive by it
        self.t0 = clock()
        """The clock's reading at the step's start: the curve's times count from it."""
        self.current = 0
        self.peak = 0
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.peak_by_kind = dict(self.by_kind)
        self.outside_bytes = 0
        """Bytes of the storages that existed before the step (the batch), not counted in ``current``."""
        self.curve: list[tuple[float, int]] = [(0.0, 0)]
        """(seconds since :meth:`start`, bytes held from then on)."""
        self.window_peak = 0
        """The highest level since :meth:`open_window`."""

    # -- the step

    def start(self, outside: Iterable[torch.Tensor] = ()) -> None:
        """Begin a step: time from now, peak from the current level; ``outside`` tensors exist already."""
        with self._lock:
            self._outside.clear()
            self.outside_bytes = 0
            for t in outside:
                st = storage_of(t)
                if st is not None and id(st) not in self._outside and id(st) not in self._live:
                    self._outside[id(st)] = st
                    self.outside_bytes += st.nbytes()
            self.t0 = self._clock()
            self.peak = self.current
            self.peak_by_kind = dict(self.by_kind)
            self.curve = [(0.0, self.current)]

    def open_window(self) -> int:
        """Start watching the highest level from now (``window_peak``); return the current level."""
        with self._lock:
            self.window_peak = self.current
            return self.current

    # -- holding

    def hold(self, tensors: Iterable[torch.Tensor | None], kind: str) -> None:
        """Count the storages of ``tensors`` (as ``kind`` if new to the meter) until each one dies."""
        self.hold_storages([st for t in tensors if t is not None and (st := storage_of(t)) is not None], kind)

    def hold_storages(self, storages: Iterable[torch.UntypedStorage], kind: str) -> None:
        """:meth:`hold` for storages already looked up (from :func:`storage_of`)."""
        with self._lock:
            for st in storages:
                key = id(st)
                if key in self._live or key in self._outside:
                    continue
                nbytes = st.nbytes()
                self._live[key] = _Entry(nbytes, kind, weakref.ref(st, partial(self._died, key)))
                self._change(nbytes, kind)

    def bytes_of(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Bytes of the distinct storages behind ``tensors`` that the meter counts (not the batch's)."""
        with self._lock:
            keys = {id(st) for t in tensors if t is not None and (st := storage_of(t)) is not None}
            return sum(self._live[k].nbytes for k in keys if k in self._live)

    def _died(self, key: int, _watch: object = None) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._change(-entry.nbytes, entry.kind)

    def _change(self, delta: int, kind: str) -> None:
        self.current += delta
        self.by_kind[kind] += delta
        t = self._clock() - self.t0
        if self.curve[-1][0] == t:
            self.curve[-1] = (t, self.current)
        else:
            self.curve.append((t, self.current))
        self.window_peak = max(self.window_peak, self.current)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_kind = dict(self.by_kind)

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

import torch

from pipefold.runtime.sharding import local

__all__ = ["KINDS", "MemoryMeter", "storage_of"]

KINDS = ("saved", "output", "captured", "recv", "send", "kfac", "vocab")
"""What the runtime holds: saved for backward, stage outputs and input gradients, gradients kept for W,
receive buffers, copies made for sending, layer inputs and output gradients kept for K-FAC's curvature."""


@dataclass
class _Entry:
    nbytes: int
    kind: str
    watch: _Watch
    """Calls the meter back when the storage dies."""


class _Watch(weakref.ref[torch.UntypedStorage]):
    """A weak reference to a storage that knows the storage's key in the meter: its callback needs no closure (a
    ``weakref.finalize`` per tensor cost a third of what the runner adds to a small layer's forward, a
    ``functools.partial`` per storage a tenth of the meter's work)."""

    __slots__ = ("key",)
    key: int


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``t`` (a DTensor's: its local shard's), or None for tensors that hold no memory of their
    own (meta, empty, sparse)."""
    t = local(t)
    if t.is_meta or t.layout != torch.strided:  # ``is_meta``: ``t.device`` makes a device object each call
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
        self._peak_by_kind = dict(self.by_kind)
        self._rising = False  # the level is at its peak, whose split by kind is not copied yet
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
            self._peak_by_kind = dict(self.by_kind)
            self._rising = False
            self.curve = [(0.0, self.current)]

    @property
    def peak_by_kind(self) -> dict[str, int]:
        """The level by kind (:data:`KINDS`) when it was at its peak."""
        with self._lock:
            if self._rising:
                self._peak_by_kind, self._rising = dict(self.by_kind), False
            return self._peak_by_kind

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
            added = 0
            for st in storages:
                key = id(st)
                if key in self._live or key in self._outside:
                    continue
                nbytes = st.nbytes()
                watch = _Watch(st, self._died)
                watch.key = key
                self._live[key] = _Entry(nbytes, kind, watch)
                added += nbytes
            if added:  # one change for the lot: under the lock no storage can die between them
                self._change(added, kind)

    def bytes_of(self, tensors: Iterable[torch.Tensor | None], keys: Iterable[int] = ()) -> int:
        """Bytes of the distinct storages behind ``tensors``, and of those the meter knows by ``keys`` (``id`` of a
        storage it was given), that the meter counts (not the batch's)."""
        with self._lock:
            seen = {id(st) for t in tensors if t is not None and (st := storage_of(t)) is not None}
            seen.update(keys)
            live = self._live
            return sum(live[k].nbytes for k in seen if k in live)

    def _died(self, watch: _Watch) -> None:
        with self._lock:
            entry = self._live.pop(watch.key, None)
            if entry is not None:
                self._change(-entry.nbytes, entry.kind)

    def _change(self, delta: int, kind: str) -> None:
        # Called twice for every storage the runtime keeps (when held, when it dies): kept lean. The split by kind
        # at the peak is copied when the level first falls from it (or when read), not at every new high.
        if delta < 0 and self._rising:
            self._peak_by_kind, self._rising = dict(self.by_kind), False
        current = self.current = self.current + delta
        self.by_kind[kind] += delta
        t = self._clock() - self.t0
        curve = self.curve
        if curve[-1][0] == t:
            curve[-1] = (t, current)
        else:
            curve.append((t, current))
        if current > self.window_peak:
            self.window_peak = current
        if current > self.peak:
            self.peak = current
            self._rising = True

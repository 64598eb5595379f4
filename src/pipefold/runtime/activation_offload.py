"""Activation offloading (PipeOffload): a microbatch's saved activations copied to host memory after its forward
(``OF``) and back before its backward (``RL``), each storage once, its views rebuilt on the copy.

What a stage's forward saves for backward sits in boxes (:class:`pipefold.runtime.stage._Box`) that the autograd
graph holds; an offload copies each box's storage to host memory and empties the box, so the device copy dies
with its last reference (the memory meter sees it go); a reload copies it back into a new device storage and
fills the box again with the same views (dtype, offset, size, stride). The backward then reads the same values:
gradients are exactly those of a run without offloading.

On a GPU the host copies are pinned, and both directions run on a copy stream of their own, beside the compute:
the offload waits for the forward that made its tensors, the device storage is released to the allocator only
once its copy is done (``record_stream``), and the backward waits for its reload's event. On a CPU the copies are
plain memcpys, one after the other; the "device" is then the memory meter's account of what the stage holds, and
the host copies are kept apart from it.

Storages the microbatch holds anyway (the stage's inputs and outputs, which the pipeline still reads, and what a
recomputation keeps) stay: moving them would free nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch

__all__ = ["HostCopies", "Offloaded"]


class Offloaded:
    """One storage in host memory, with the views of it that boxes held (each box: dtype, offset, size, stride)."""

    __slots__ = ("boxes", "host", "nbytes")

    def __init__(self, host: torch.UntypedStorage, boxes: list[tuple[Any, torch.dtype, int, tuple[int, ...],
                                                                     tuple[int, ...]]]) -> None:
        self.host, self.boxes, self.nbytes = host, boxes, host.nbytes()


class HostCopies:
    """The offloads and reloads of one rank's stages on ``device``: the copy streams on a GPU, host bytes held."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self._out = torch.cuda.Stream(device) if cuda else None
        self._in = torch.cuda.Stream(device) if cuda else None
        self.host_bytes = 0
        """Bytes of activations in host memory now."""
        self.peak_host_bytes = 0

    def offload(self, boxes: Iterable[Any], keep: set[int]) -> tuple[list[Offloaded], Any]:
        """Copy the storages behind ``boxes`` (those with a tensor, not in ``keep``, by ``id`` of their storage) to
        host memory and empty the boxes; return the copies and the event that says they are done (None on a CPU)."""
        by_storage: dict[int, tuple[torch.UntypedStorage, list[Any]]] = {}
        for box in boxes:
            t = box.tensor
            if t is None or type(t) is not torch.Tensor or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            if id(st) in keep or st.nbytes() == 0:
                continue
            by_storage.setdefault(id(st), (st, []))[1].append(box)
        copies: list[Offloaded] = []
        if self._out is not None:
            self._out.wait_stream(torch.cuda.current_stream(self.device))  # the forward that made them has run
        with torch.cuda.stream(self._out) if self._out is not None else nullcontext():
            for st, held in by_storage.values():
                host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=self._out is not None).untyped_storage()
                host.copy_(st, non_blocking=self._out is not None)
                if self._out is not None:  # the allocator may reuse the device memory once the copy is done
                    torch.empty(0, dtype=torch.uint8, device=self.device).set_(st).record_stream(self._out)
                views = [(box, box.tensor.dtype, box.tensor.storage_offset(), tuple(box.tensor.shape),
                          tuple(box.tensor.stride())) for box in held]
                for box in held:
                    box.tensor = None
                copies.append(Offloaded(host, views))
        done = None
        if self._out is not None:
            done = torch.cuda.Event()
            done.record(self._out)
        nbytes = sum(c.nbytes for c in copies)
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return copies, done

    def reload(self, copies: list[Offloaded], offloaded: Any) -> tuple[list[torch.UntypedStorage], Any]:
        """Copy ``copies`` back to new device storages and fill their boxes again; return the storages and the event
        the backward waits for (None on a CPU). ``offloaded`` is the offload's event."""
        storages = []
        if self._in is not None and offloaded is not None:
            self._in.wait_event(offloaded)
        with torch.cuda.stream(self._in) if self._in is not None else nullcontext():
            for c in copies:
                st = torch.empty(c.nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
                st.copy_(c.host, non_blocking=self._in is not None)
                for box, dtype, offset, size, stride in c.boxes:
                    box.tensor = torch.empty(0, dtype=dtype, device=self.device).set_(st, offset, size, stride)
                    box.key = id(st)  # the meter's key of the new storage
                storages.append(st)
        done = None
        if self._in is not None:
            done = torch.cuda.Event()
            done.record(self._in)
            compute = torch.cuda.current_stream(self.device)
            for st in storages:  # read by the backward on the compute stream
                torch.empty(0, dtype=torch.uint8, device=self.device).set_(st).record_stream(compute)
        self.host_bytes -= sum(c.nbytes for c in copies)
        return storages, done


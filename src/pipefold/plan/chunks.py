"""Model-state chunks: how a device's parameters are packed into fixed-size chunks, how big a chunk is, and which
chunks keep their optimizer state on the device (PatrickStar's chunks, AxoNN's and ZeRO-Offload's host-memory
optimizer). The rules the runtime steps by (:mod:`pipefold.runtime.chunks`) and the planner predicts from.

A chunk is a run of consecutive parameters (in the order the stage uses them) whose elements fit in its capacity;
a parameter is never split, so the capacity is at least the largest parameter. Each chunk's optimizer state (and,
where it lives in host memory, the float32 copy of its parameters the host steps) is either on the device or in
host memory, whole::

    parameters   | w0 w1 | w2 | w3 w4 w5 | w6 |       packed in order, each chunk at most `capacity` elements
    chunks         c0      c1   c2         c3
    state on       device  device host     host      the first chunks that fit what the activations leave free

The parameters themselves and their gradients stay on the device: every pass of every microbatch reads them. What
moves is the state only the optimizer step reads: for a host chunk, the step copies its gradients to host memory,
steps there, and copies the stepped parameters back.

With master weights (parameters held in bf16 or fp16) the chunks hold the float32 masters and their float32
gradients as well as the optimizer state, wherever they are: the device keeps 2 bytes of each parameter plus its
gradient while a backward makes it, and a host chunk's gradients are added into host memory as they are made
(AxoNN's and ZeRO-Offload's split: 16-bit weights on the device, everything float32 in host memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipefold.errors import ConfigError

__all__ = ["CHUNK_SIZES", "ChunkPlacement", "choose_capacity", "pack", "place", "state_bytes"]

CHUNK_SIZES = tuple(1 << k for k in range(16, 25))
"""The capacities :func:`choose_capacity` considers, in elements: 64 Ki to 16 Mi (256 KiB to 64 MiB of float32).
A host-device copy reaches most of the link's bandwidth from about a megabyte up, and a chunk much larger than
that gains nothing but coarser placement."""


def pack(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """The indices of ``sizes`` (elements of each parameter, in order of use) in each chunk of at most
    ``capacity`` elements: consecutive, each chunk filled until the next parameter does not fit."""
    if capacity < 1:
        raise ConfigError(f"a chunk holds at least one element (got capacity {capacity})")
    largest = max(sizes, default=0)
    if largest > capacity:
        at = list(sizes).index(largest)
        raise ConfigError(f"a chunk of {capacity:,} elements cannot hold parameter {at} ({largest:,} elements): "
                          f"give a chunk size of at least {largest:,} elements ({largest * 4:,} bytes in float32)")
    chunks: list[list[int]] = []
    used = capacity
    for i, n in enumerate(sizes):
        if used + n > capacity:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += n
    return chunks


def choose_capacity(sizes: Sequence[int], candidates: Sequence[int] = CHUNK_SIZES) -> int:
    """The chunk capacity for parameters of ``sizes`` elements: among ``candidates`` at least the largest
    parameter (the largest parameter itself where none is), the one whose chunks leave the fewest elements unused
    (the room at each chunk's end, which the runtime allocates all the same); of equals, the smaller one, which
    places the state more finely."""
    largest = max(sizes, default=1)
    options = sorted({c for c in candidates if c >= largest} or {largest})

    def unused(capacity: int) -> int:
        return sum(capacity - sum(sizes[i] for i in chunk) for chunk in pack(sizes, capacity))

    return min(options, key=lambda c: (unused(c), c))


def state_bytes(elements: int, states: int, *, host: bool, value_bytes: int = 4) -> int:
    """The bytes of one chunk's state of ``elements`` (``capacity``, what the runtime allocates): ``states`` optimizer
    tensors per parameter (Adam: 2, SGD with momentum: 1), float32; a host chunk also holds the float32 parameters
    the host steps and their gradients (``value_bytes`` each)."""
    return elements * (4 * states + (2 * value_bytes if host else 0))


@dataclass(frozen=True)
class ChunkPlacement:
    """Where each chunk's optimizer state lives: ``on_device[i]`` for chunk i."""

    on_device: tuple[bool, ...]
    device_bytes: int
    """Bytes of the chunks' state on the device."""
    host_bytes: int
    """Bytes of the chunks' state in host memory (with their float32 parameters and gradients)."""


def place(capacities: Sequence[int], states: int, free: float, *, masters: bool = False) -> ChunkPlacement:
    """The chunks (of ``capacities`` elements each) whose state the device keeps, given ``free`` bytes of it that
    nothing else needs at the step's peak: each chunk in order, on the device where it still fits in what the
    chunks before it left. No host chunk fits in what the device chunks leave (a chunk skipped for size is
    followed by smaller ones that may fit). With ``masters`` (parameters held in 16 bits, float32 master weights
    in the chunks) a device chunk holds its float32 masters and their gradients too, as a host chunk does."""
    left = max(0.0, free)
    on_device = []
    device = host = 0
    for n in capacities:
        here = state_bytes(n, states, host=masters)
        if here <= left:
            left -= here
            device += here
            on_device.append(True)
        else:
            host += state_bytes(n, states, host=True)
            on_device.append(False)
    return ChunkPlacement(tuple(on_device), device, host)

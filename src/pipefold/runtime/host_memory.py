"""Host memory a process frees stays in it for the next pass, instead of going back to the operating system.

glibc's malloc gives a freed block of a few megabytes back to the system: a large one was mapped on its own,
and the top of the heap is trimmed once it has more free than a threshold. The next tensor of that size then
starts on fresh pages, each of which faults once and is zeroed by the kernel before the pass can write it.
A training step allocates the same sizes over and over (each Linear's weight gradient at the step's first
backward, after the gradients were set to None; autograd's temporaries), so on a CPU that work recurs every
step. With the MLP of ``benchmarks/vs_torch.py`` the step's first BW took about 14 ms where the others took 5.5
(``docs/performance.md``), and since 1F1B's first BWs are on its critical path, they alone lengthened the step by
more than a pass.

:func:`keep_freed_pages` fixes glibc's thresholds (the largest block mapped on its own: 32 MiB, glibc's
ceiling; trimming: at 2 GiB free) so that freed blocks are reused. The process's resident memory then stays
at its peak instead of falling between steps; the peak itself is unchanged. It is left alone where the
environment sets malloc's tunables itself (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or malloc
entries of ``GLIBC_TUNABLES``), which is how a user or a benchmark measuring resident memory asks for
glibc's own behaviour; and it does nothing on a C library without ``mallopt`` (not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_pages", "set_by_environment"]

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter numbers (glibc's ``malloc.h``)."""

MMAP_THRESHOLD = 32 << 20
"""Blocks from this size up are mapped on their own (and unmapped when freed): glibc's largest allowed value on
a 64-bit system. Setting it also stops glibc from moving the threshold (and the trim threshold with it)."""

TRIM_THRESHOLD = (1 << 31) - 1
"""The free bytes at the heap's top that make glibc give them back: ``mallopt`` takes a C int, this is its
largest."""

_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_applied = False


def set_by_environment(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (the process's by default) sets malloc's thresholds itself."""
    env = os.environ if env is None else env
    return any(name in env for name in _ENVIRONMENT) or "glibc.malloc." in env.get("GLIBC_TUNABLES", "")


def keep_freed_pages() -> bool:
    """Keep freed host memory in this process for reuse (see the module's docstring). Returns whether glibc took
    the setting (now or on an earlier call); False where the environment sets it or the C library has no
    ``mallopt``."""
    global _applied
    if _applied:
        return True
    if set_by_environment():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied

"""Pausing Python's cyclic garbage collector while large acyclic structures are built."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["freeze", "paused_gc", "unfreeze"]

_FROZEN: bool | None = None
"""Whether this process has objects frozen out of the collector: asked of the collector once (its count walks every
frozen object, a million once torch is imported, and :func:`paused_gc` runs once per schedule built), then kept by
:func:`freeze` and :func:`unfreeze`. A program that freezes objects itself after pipefold first asked, with
``gc.freeze``, should call :func:`freeze` instead, or :func:`paused_gc` moves them back into the collector's
oldest generation (where they are walked again, but nothing is lost)."""


def freeze() -> None:
    """Freeze every object the process holds now out of the cyclic collector (``gc.freeze``): what lives as long as
    the process (its imports) is never walked again, by its collections or its forked children's."""
    global _FROZEN
    gc.freeze()
    _FROZEN = True


def unfreeze() -> None:
    """Undo :func:`freeze` (``gc.unfreeze``): the frozen objects go back to the oldest generation."""
    global _FROZEN
    gc.unfreeze()
    _FROZEN = False


def _frozen() -> bool:
    global _FROZEN
    if _FROZEN is None:
        _FROZEN = gc.get_freeze_count() > 0
    return _FROZEN


@contextmanager
def paused_gc() -> Iterator[None]:
    """Run the body with the cyclic collector off; its previous state is restored after.

    A schedule or a timeline at p=64, m=1024 is hundreds of thousands of tuples
    without a single reference cycle. While they are made, CPython's collector
    would walk every tracked object again each time their number grows by a
    quarter, which costs a third of the whole generation and simulation.
    Reference counting still frees everything as usual. Also a decorator.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            # What the body made would otherwise be walked at once by the young collections that its count of
            # new objects sets off (a tenth of a second for a schedule at p=64, m=1024): it goes straight to the
            # oldest generation instead (freeze moves every tracked object out of the collector's generations and
            # resets the count, unfreeze moves them all back into the oldest), to be seen at its next collection.
            if not _frozen():  # a program that froze objects keeps them frozen (freezing later: call freeze())
                gc.freeze()
                gc.unfreeze()
            gc.enable()

"""Pausing Python's cyclic garbage collector while large acyclic structures are built."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_gc"]


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
            if not gc.get_freeze_count():  # a program that froze objects itself keeps them frozen
                gc.freeze()
                gc.unfreeze()
            gc.enable()

"""One clock for a rank's timestamps: the host's monotonic clock, anchored once to the wall clock.

A rank times its steps, its updates and its messages' posting and delivery. Intervals need one clock that only
moves forward (the wall clock may be stepped between two readings); ranks on other machines line up only on the
wall clock. So every timestamp a rank records is the host clock (``time.perf_counter``) plus :data:`ANCHOR`,
the wall clock at its zero, read once per process: differences are the host clock's, and ranks, each anchored
once, line up as their wall clocks do. (A step's start used to be read from the wall clock a little after the
moment its ``wall`` counts from: once a next step seemed to start 72 us before the previous one's update ended.)
"""

from __future__ import annotations

import time

__all__ = ["ANCHOR", "wall"]

ANCHOR = time.time() - time.perf_counter()
"""The wall clock (``time.time``) at the host clock's zero, read once when this module is first imported."""


def wall() -> float:
    """Now, in wall-clock seconds, on the host clock."""
    return ANCHOR + time.perf_counter()

"""V-shape schedules with controllable memory, built from repeated building blocks (Qi et al., 2024).

Each schedule is one V-shape building block (see :mod:`pipefold.schedules.blocks`)
repeated for every microbatch. The gaps between consecutive passes of one
microbatch set each stage's lifespan, and so the memory:

    gaps (F chunk 0, F chunk 1, B chunk 0, B chunk 1, B turn)   peak memory (M)
    V-Min   1 1 1 1 1      shortest lifespans                     about p/3
    V-Half  2 1 1 2 2      F down and B back up one slot slower   about p/2
    V-ZB    3 3 3 3 1      every chain three slots per hop        p, as 1F1B

Wider gaps keep more microbatches in flight, which fills more of the
warm-up and cool-down: the run time falls as the memory grows. ``v-block``
exposes the gaps as knobs, so the planner can trade one for the other in
half-M steps.
"""

from __future__ import annotations

from pipefold.ir import Schedule
from pipefold.schedules.blocks import v_block

V_MIN = (1, 1, 1, 1, 1)
V_HALF = (2, 1, 1, 2, 2)
V_ZB = (3, 3, 3, 3, 1)


def _from_gaps(devices: int, microbatches: int, gaps: tuple[int, int, int, int, int], name: str,
               options: dict[str, int] | None = None) -> Schedule:
    f0, f1, b0, b1, turn = gaps
    block = v_block(devices, f_gaps=(f0, f1), b_gaps=(b0, b1), b_turn=turn)
    return block.to_schedule(microbatches, name, options)


def v_min(devices: int, microbatches: int) -> Schedule:
    """V-Min: the shortest V block, about a third of 1F1B's activation memory."""
    return _from_gaps(devices, microbatches, V_MIN, "v-min")


def v_half(devices: int, microbatches: int) -> Schedule:
    """V-Half: about half of 1F1B's activation memory, with less bubble than V-Min."""
    return _from_gaps(devices, microbatches, V_HALF, "v-half")


def v_zb(devices: int, microbatches: int) -> Schedule:
    """V-ZB: 1F1B's activation memory and almost no bubble."""
    return _from_gaps(devices, microbatches, V_ZB, "v-zb")


def v_block_schedule(devices: int, microbatches: int, f0: int = 1, f1: int = 1, b0: int = 1, b1: int = 1,
                     turn: int = 1) -> Schedule:
    """Any V block, from the slots between consecutive passes of one microbatch."""
    options = {"f0": f0, "f1": f1, "b0": b0, "b1": b1, "turn": turn}
    return _from_gaps(devices, microbatches, (f0, f1, b0, b1, turn), "v-block", options)

"""Building blocks: lifespans, the memory they predict, and the schedules they expand to."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipefold import ConfigError, build, simulate, validate
from pipefold.ir import Action, linear_placement, v_placement
from pipefold.schedules import get
from pipefold.schedules.blocks import BuildingBlock, v_block


def _block(p: int, gaps: tuple[int, ...]) -> BuildingBlock:
    f0, f1, b0, b1, turn = gaps
    return v_block(p, f_gaps=(f0, f1), b_gaps=(b0, b1), b_turn=turn)


def _has_block(p: int, gaps: tuple[int, ...]) -> bool:
    try:
        _block(p, gaps)
    except ConfigError:
        return False
    return True


# Four in five gap choices admit no collision-free block; drawing only from those that do
# keeps hypothesis from discarding most of what it generates.
BLOCKS = [(p, gaps) for p in range(1, 13) for gaps in itertools.product((1, 2, 3), repeat=5) if _has_block(p, gaps)]


def _alive_by_brute_force(block: BuildingBlock, repeats: int) -> list[int]:
    """Per device, the most stage activations alive at once in the plain repeat (no squeezing), counted slot by slot."""
    T = block.interval
    horizon = T * repeats + max(block.w) + 1
    peaks = []
    for d in range(block.devices):
        stages = [s for s, dev in enumerate(block.placement) if dev == d]
        peaks.append(max(
            sum(1 for s in stages for j in range(repeats) if block.f[s] + j * T <= t < block.w[s] + 1 + j * T)
            for t in range(horizon)
        ))
    return peaks


def test_v_min_block_matches_the_paper() -> None:
    b = v_block(4)
    # One microbatch straight down the V and back: every hop one slot.
    assert b.f == tuple(range(8))
    assert b.b == tuple(range(15, 7, -1))
    assert b.interval == 6
    # Each device's six passes sit on distinct slots modulo T.
    for d in range(4):
        slots = [t % 6 for s in (d, 7 - d) for t in (b.f[s], b.b[s], b.w[s])]
        assert sorted(slots) == list(range(6))
    assert b.lifespan(0) == b.w[0] + 1 - b.f[0] == 18


@given(case=st.sampled_from([(p, gaps) for p, gaps in BLOCKS if p <= 10]))
def test_predicted_peak_is_the_repeats_true_peak(case: tuple[int, tuple[int, ...]]) -> None:
    block = _block(*case)
    repeats = math.ceil(max(block.w) / block.interval) + 3
    mem = block.stage_memory()
    assert block.predicted_peak() == [x * mem for x in _alive_by_brute_force(block, repeats)]
    # The paper's lifespan bound, sum of ceil(l/T), is never below it.
    assert all(a <= b + 1e-9 for a, b in zip(block.predicted_peak(), block.lifespan_bound(), strict=True))


@given(case=st.sampled_from(BLOCKS), data=st.data())
def test_block_prediction_equals_simulated_peak(case: tuple[int, tuple[int, ...]], data: st.DataObject) -> None:
    p, gaps = case
    block = _block(p, gaps)
    m = data.draw(st.integers(1, 40), label="m")
    s = block.to_schedule(m, "v-block")
    validate(s)
    r = simulate(s)
    predicted = max(block.predicted_peak())
    # Moving passes earlier never raises the peak above the block's ...
    assert max(r.peak_memory) <= predicted + 1e-9
    # ... and once the steady state is reached the block's peak is what the schedule holds.
    if m >= 2 * p + 2:
        assert max(r.peak_memory) == pytest.approx(predicted)


def test_lifespan_bound_and_exact_prediction_can_differ() -> None:
    # V-Min on 4 devices: the chunk-1 stage on device 2 lives 7 slots, two periods' worth by the ceil
    # bound, but its two alive moments never meet the chunk-0 stage's busiest one.
    b = v_block(4)
    assert b.lifespan_bound() == [2.0, 2.0, 2.5, 2.0]
    assert b.predicted_peak() == [2.0, 2.0, 2.0, 2.0]
    assert max(simulate(b.to_schedule(16, "v-min")).peak_memory) == 2.0


def test_blocks_reject_broken_offsets() -> None:
    place = linear_placement(2)
    with pytest.raises(ConfigError, match="F of stage 1 starts at 0, before F of stage 0 ends"):
        BuildingBlock(devices=2, placement=place, f=(0, 0), b=(3, 2), w=(4, 3), interval=3)
    with pytest.raises(ConfigError, match="W of stage 0 starts at 3, before its B ends"):
        BuildingBlock(devices=2, placement=place, f=(0, 1), b=(3, 2), w=(3, 3), interval=3)
    with pytest.raises(ConfigError, match="share a slot modulo T=3"):
        BuildingBlock(devices=2, placement=place, f=(0, 1), b=(3, 2), w=(6, 3), interval=3)
    with pytest.raises(ConfigError, match="one F, B and W slot per stage"):
        BuildingBlock(devices=2, placement=v_placement(2), f=(0, 1), b=(3, 2), w=(4, 3), interval=6)


def test_a_linear_block_expands_like_1f1b_with_split_backward() -> None:
    # Two devices, one stage each: the gradient of stage 1 goes upstream a slot after it is made.
    #   device 0: F@0 B@4 W@5   device 1: F@1 B@2 W@3   (residues mod 3 all distinct)
    block = BuildingBlock(devices=2, placement=linear_placement(2), f=(0, 1), b=(4, 2), w=(5, 3), interval=3)
    assert block.predicted_peak() == [2.0, 1.0]
    s = block.to_schedule(9, "linear-block")
    validate(s)
    r = simulate(s)
    # The schedule's peak stays the block's; the lighter device 1 may use its slack to start early.
    assert max(r.peak_memory) == 2.0
    assert r.makespan == 3 * 9 + 1  # zb-h1's closed form m(F+B+W) + (p-1)(F+B-W) at p=2


def test_gap_search_reaches_every_half_step_between_v_min_and_v_zb() -> None:
    p, m = 8, 32
    best: dict[float, float] = {}
    for gaps in itertools.product(*(get("v-block").option(o).search(p, m) for o in ("f0", "f1", "b0", "b1", "turn"))):
        try:
            r = simulate(build("v-block", p, m, **dict(zip(("f0", "f1", "b0", "b1", "turn"), gaps, strict=True))))
        except ConfigError:
            continue
        peak = max(r.peak_memory)
        best[peak] = min(best.get(peak, math.inf), r.makespan)
    # Memory as a knob: from V-Min's (p+4)//3 to 1F1B's p in half-M steps (one chunk activation) ...
    assert {x / 2 for x in range(2 * ((p + 4) // 3), 2 * p + 1)} <= set(best)
    # ... and more memory buys a shorter step.
    frontier = [min(v for k, v in best.items() if k <= budget) for budget in sorted(best)]
    assert frontier == sorted(frontier, reverse=True) and frontier[0] > frontier[-1]


@pytest.mark.parametrize("name", ["v-min", "v-half", "v-zb", "v-block"])
def test_the_columns_a_builder_hands_over_read_as_its_actions(name: str) -> None:
    """The V builders hand over the flat columns they built from (``ir.ActionRows``): at every size the simulator
    reads the same table from them, array for array and dtype for dtype, as from the Action tuples, without making
    any Action; and the rows read, compare, copy and pickle as the tuples they stand for."""
    import dataclasses
    import pickle

    import numpy as np

    from pipefold.ir import ActionRows
    from pipefold.ir.graph import action_table

    ran = 0
    for p, m in ((1, 1), (2, 3), (4, 8), (8, 20)):
        try:
            s = build(name, p, m)
        except ConfigError:
            continue
        ran += 1
        rows = s.actions
        assert isinstance(rows, ActionRows)
        result = simulate(s)
        given = action_table(s)
        assert not rows.made and s.num_actions == sum(rows.lengths)  # the search path makes no Action
        tuples = s.with_actions(s.actions)  # plain tuples, read back one by one
        assert rows.made and not isinstance(tuples.actions, ActionRows)
        read = action_table(tuples)
        for field in given._fields:
            a, b = getattr(given, field), getattr(read, field)
            if isinstance(a, tuple):
                assert a == b, (name, p, m, field)
            else:
                assert a.dtype == b.dtype and np.array_equal(a, b), (name, p, m, field)
        assert result.to_dict() == simulate(tuples).to_dict()
        assert s == tuples and tuples == s and hash(s.actions) == hash(tuples.actions)
        assert dataclasses.replace(s).actions is rows
        again = pickle.loads(pickle.dumps(s))
        assert again == s and again.actions == tuples.actions
    assert ran >= 3


def test_action_rows_refuse_columns_that_do_not_fit() -> None:
    """Columns of another length than the rows', or a kind number outside the codes, are refused at once."""
    from pipefold.ir import ActionRows

    with pytest.raises(ValueError, match="columns"):
        ActionRows([2, 1], ("F", "B"), [0, 1], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="kind number"):
        ActionRows([1], ("F",), [1], [0], [0])
    rows = ActionRows([1, 0], ("F",), [0], [3], [2])
    one = (Action(3, "F", 2),)
    assert rows == (one, ()) and len(rows) == 2 and rows[1] == () and rows[:1] == (one,)

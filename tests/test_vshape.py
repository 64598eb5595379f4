"""The V-shape schedules: valid for any shape, within 1F1B's memory, and ZB-V without a bubble to speak of."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipefold import Schedule, SimResult, build, simulate, validate
from pipefold.ir import Kind, dumps, v_placement
from pipefold.schedules import get

STAGES = st.integers(1, 16)
MICROBATCHES = st.integers(1, 64)
V_NAMES = ["zb-v", "1f1b-v"]


def _peak_formula(p: int, m: int) -> list[float]:
    """Chunk 0 holds up to 2p-1-i microbatches, chunk 1 up to i+1, each chunk activation M/2."""
    return [(min(m, 2 * p - 1 - i) + min(m, i + 1)) / 2 for i in range(p)]


def _inner_idle(result: SimResult, device: int) -> float:
    """Idle time of ``device`` between the start of its first pass and the end of its last."""
    row = result.timeline[device]
    return row[-1].end - row[0].start - result.busy[device]


@pytest.mark.parametrize("name", V_NAMES)
@given(p=STAGES, m=MICROBATCHES)
def test_valid_and_within_1f1b_memory(name: str, p: int, m: int) -> None:
    s = validate(build(name, p, m))
    assert (s.stages, s.placement[0]) == (2 * p, v_placement(p))
    backward = {a.kind for row in s.actions for a in row} - {Kind.F}
    assert backward == ({Kind.B, Kind.W} if name == "zb-v" else {Kind.BW})
    r = simulate(s)
    assert max(r.peak_memory) <= p
    assert r.peak_memory == _peak_formula(p, m)


@pytest.mark.parametrize("name", V_NAMES)
@given(p=STAGES, m=MICROBATCHES)
def test_round_trips_through_text_and_json(name: str, p: int, m: int) -> None:
    s = build(name, p, m)
    assert Schedule.from_text(s.to_text()) == s
    assert Schedule.from_json(dumps(s, "json")) == s


def test_zb_v_targets_p4_m8() -> None:
    r = simulate(build("zb-v", 4, 8))
    assert r.makespan <= 25.5
    assert max(r.peak_memory) <= 4
    busiest = max(range(4), key=lambda d: r.busy[d])
    assert _inner_idle(r, busiest) == 0


def test_reference_cases_p4_m8() -> None:
    r = simulate(build("zb-v", 4, 8))
    assert (r.makespan, r.peak_memory) == (25.5, [4, 4, 4, 4])
    assert all(_inner_idle(r, d) == 0 for d in range(4))  # every device, not only the busiest
    r = simulate(build("1f1b-v", 4, 8))
    assert (r.makespan, r.peak_memory) == (30, [4, 4, 4, 4])


@given(p=st.integers(2, 16), data=st.data())
def test_zb_v_beats_zb_h1_and_1f1b(p: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(2 * p, 64), label="m")
    zb_v = simulate(build("zb-v", p, m)).makespan
    assert zb_v < simulate(build("zb-h1", p, m)).makespan
    assert zb_v < simulate(build("1f1b", p, m)).makespan


@given(p=STAGES, data=st.data())
def test_closed_forms_with_the_v_full(p: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(2 * p - 1, 64), label="m")
    # ZB-V: only the stagger of the first passes, half a slot per device, is lost.
    assert simulate(build("zb-v", p, m)).makespan == 3 * m + (p - 1) / 2
    # 1F1B-V: BW takes two slots, so a gradient crosses the V at half the speed of a forward.
    assert simulate(build("1f1b-v", p, m)).makespan == 3 * m + 2 * (p - 1)


def test_one_device_is_the_whole_model_in_order() -> None:
    # With p = 1 there is nothing to overlap: two chunks on one device, run back to back.
    r = simulate(build("zb-v", 1, 3))
    assert r.makespan == 9 and _inner_idle(r, 0) == 0
    assert [str(a) for a in build("1f1b-v", 1, 2).actions[0]] == ["0F0", "1F0", "1BW0", "0F1", "0BW0",
                                                                 "1F1", "1BW1", "0BW1"]


def test_memory_formula_is_registered() -> None:
    for name in V_NAMES:
        assert get(name).memory.startswith("(min(m,2p-1-i)+min(m,i+1))/2")
        assert get(name).min_microbatches(16) == 1

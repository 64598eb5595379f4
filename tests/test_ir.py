"""The IR: action text, placements, file forms, and validation of broken schedules."""

from __future__ import annotations

import json

import pytest

from pipefold import Action, Schedule, ScheduleError, build, simulate, validate
from pipefold.ir import (
    BW,
    B,
    F,
    W,
    describe_placement,
    linear_placement,
    load,
    looped_placement,
    render_grid,
    save,
    v_placement,
)


def test_action_text_round_trips() -> None:
    for a in [F(0, 3), B(12, 0), W(2, 31), BW(1, 0)]:
        assert Action.parse(str(a)) == a
    assert str(BW(1, 0)) == "1BW0" and str(F(0, 3)) == "0F3"
    with pytest.raises(ValueError, match="expected <stage><F|B|W|BW><microbatch>"):
        Action.parse("F03")


def test_placements() -> None:
    assert linear_placement(3) == (0, 1, 2)
    assert looped_placement(2, 3) == (0, 1, 0, 1, 0, 1)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    assert describe_placement(v_placement(3), 3) == "v"
    assert describe_placement(looped_placement(4, 2), 4) == "looped"
    assert describe_placement((1, 0), 2) == "reversed"
    assert describe_placement((1, 1), 2) == "1 1"


def _two_stage(rows: list[list[Action]], m: int = 1) -> Schedule:
    return Schedule("hand", 2, 2, m, (0, 1), tuple(tuple(r) for r in rows))


def test_valid_hand_written_schedule() -> None:
    s = _two_stage([[F(0, 0), B(0, 0), W(0, 0)], [F(1, 0), BW(1, 0)]])
    assert validate(s) is s


def test_backward_before_its_own_forward_is_a_local_order_violation() -> None:
    rows = [[F(0, 0), BW(0, 1), F(0, 1), BW(0, 0)], [F(1, 0), F(1, 1), BW(1, 0), BW(1, 1)]]
    with pytest.raises(ScheduleError) as err:
        validate(_two_stage(rows, m=2))
    e = err.value
    assert e.message == "device 0, position 1: 0BW1 comes before 0F1 (position 2), which it depends on"
    assert (e.device, e.position) == (0, 1)
    assert ">0BW1<" in e.report and "dev 1" in e.report


def test_cross_device_deadlock_names_the_cycle() -> None:
    # Device 1 waits for microbatch 1, device 0 for the gradient of microbatch 0 first.
    rows = [[F(0, 0), BW(0, 0), F(0, 1), BW(0, 1)], [F(1, 1), F(1, 0), BW(1, 0), BW(1, 1)]]
    with pytest.raises(ScheduleError) as err:
        validate(_two_stage(rows, m=2))
    msg = err.value.message
    assert msg.startswith("deadlock: device 0 at position 1 (0BW0) waits for 1BW0 on device 1 (position 2)")
    assert "device 1 at position 0 (1F1) waits for 0F1 on device 0 (position 2)" in msg
    assert ">0BW0<" in err.value.report


def test_missing_w_is_rejected() -> None:
    with pytest.raises(ScheduleError, match=r"device 0: stage 0 microbatch 0 has 0B0 but no 0W0"):
        validate(_two_stage([[F(0, 0), B(0, 0)], [F(1, 0), BW(1, 0)]]))


def test_w_before_its_b_is_an_order_violation() -> None:
    with pytest.raises(ScheduleError, match=r"device 0, position 1: 0W0 comes before 0B0 \(position 2\)"):
        validate(_two_stage([[F(0, 0), W(0, 0), B(0, 0)], [F(1, 0), BW(1, 0)]]))


def test_duplicates_wrong_device_and_ranges() -> None:
    with pytest.raises(ScheduleError, match="0F0 appears twice"):
        validate(_two_stage([[F(0, 0), F(0, 0), BW(0, 0)], [F(1, 0), BW(1, 0)]]))
    with pytest.raises(ScheduleError, match="runs stage 1, which the placement puts on device 1"):
        validate(_two_stage([[F(0, 0), F(1, 0), BW(0, 0)], [BW(1, 0)]]))
    with pytest.raises(ScheduleError, match="names microbatch 1, but microbatches are 0..0"):
        validate(_two_stage([[F(0, 1)], [F(1, 0), BW(1, 0)]]))
    with pytest.raises(ScheduleError, match="both a fused backward 0BW0 and 0W0"):
        validate(_two_stage([[F(0, 0), BW(0, 0), W(0, 0)], [F(1, 0), BW(1, 0)]]))
    with pytest.raises(ScheduleError, match="has no backward"):
        validate(_two_stage([[F(0, 0)], [F(1, 0), BW(1, 0)]]))


def test_moving_a_backward_early_in_a_real_schedule_deadlocks() -> None:
    s = build("1f1b", 4, 8)
    row = list(s.actions[1])  # 1F0 1F1 1F2 1BW0 1F3 1BW1 1F4 1BW2 ...
    row.insert(3, row.pop(row.index(Action.parse("1BW2"))))  # it waits on device 2, which waits on 1F3
    bad = s.with_actions([s.actions[0], row, *s.actions[2:]])
    with pytest.raises(ScheduleError) as err:
        validate(bad)
    e = err.value
    assert e.message == ("deadlock: device 1 at position 3 (1BW2) waits for 2BW2 on device 2 (position 6); "
                         "device 2 at position 5 (2F3) waits for 1F3 on device 1 (position 5)")
    assert (e.device, e.position) == (1, 3)
    assert ">1BW2<" in e.report


def test_shape_errors() -> None:
    with pytest.raises(ScheduleError, match="placement lists 1 devices but the schedule has 2 stages"):
        Schedule("x", 2, 2, 1, (0,), ((), ()))
    with pytest.raises(ScheduleError, match="placement puts stage 1 on device 5"):
        Schedule("x", 2, 2, 1, (0, 5), ((), ()))


def test_text_form_is_readable_and_errors_name_the_line() -> None:
    s = build("interleaved-1f1b", 2, 4, v=2)
    text = s.to_text()
    assert "placement: looped" in text and 'options: {"v": 2}' in text
    assert text.splitlines()[-2].startswith("device 0: 0F0 0F1 2F0")
    broken = text.replace("0F1", "0X1", 1)
    bad_line = next(i for i, line in enumerate(broken.splitlines(), 1) if "0X1" in line)
    with pytest.raises(ScheduleError, match=rf"line {bad_line}: cannot read action '0X1'"):
        Schedule.from_text(broken)
    with pytest.raises(ScheduleError, match="line 2: unknown key 'nme'"):
        Schedule.from_text("devices: 1\nnme: x\n")
    with pytest.raises(ScheduleError, match="no 'stages:' line"):
        Schedule.from_text("devices: 1\nmicrobatches: 1\n")


def test_files_in_every_format(tmp_path) -> None:
    s = build("zb-h1", 3, 5)
    for suffix in (".txt", ".json", ".csv"):
        path = str(tmp_path / f"s{suffix}")
        save(s, path)
        back = load(path)
        assert back.actions == s.actions and back.placement[0] == s.placement[0]
        if suffix != ".csv":
            assert back == s
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["actions"][0][0] == "0F0" and data["placement"] == [0, 1, 2]


def test_csv_infers_placement_and_rejects_bad_cells() -> None:
    s = Schedule.from_csv("0F0,0F1,0BW0,0BW1\n1F0,1BW0,1F1,1BW1\n")
    assert s.placement[0] == (0, 1) and s.microbatches == 2
    validate(s)
    with pytest.raises(ScheduleError, match="line 2: cannot read action 'oops'"):
        Schedule.from_csv("0F0,0BW0\n1F0,oops\n")
    with pytest.raises(ScheduleError, match="line 2: action 0BW0 at position 1 is for stage 0"):
        Schedule.from_csv("0F0\n1F0,0BW0,1BW0\n")


def test_grid_shows_a_window_of_long_schedules() -> None:
    s = build("1f1b", 2, 40)
    grid = render_grid(s, 0, 50, width=8)
    lines = grid.splitlines()
    assert len(lines) == 3
    assert "..." in lines[1] and f">{s.actions[0][50]}<" in lines[1]


BROKEN = [
    [[F(0, 0), BW(0, 1), F(0, 1), BW(0, 0)], [F(1, 0), F(1, 1), BW(1, 0), BW(1, 1)]],  # order on one device
    [[F(0, 0), BW(0, 0), F(0, 1), BW(0, 1)], [F(1, 1), F(1, 0), BW(1, 0), BW(1, 1)]],  # cross-device deadlock
    [[F(0, 0), W(0, 0), B(0, 0), F(0, 1), BW(0, 1)], [F(1, 0), BW(1, 0), F(1, 1), BW(1, 1)]],  # W before B
    [[F(0, 0), BW(0, 0), F(0, 1)], [F(1, 0), BW(1, 0), F(1, 1), BW(1, 1)]],  # a backward missing
]


@pytest.mark.parametrize("rows", BROKEN)
def test_simulate_rejects_what_validate_rejects_with_the_same_message(rows: list[list[Action]]) -> None:
    # The simulator times passes in its own traversal; a schedule it cannot finish is reported by validate's.
    bad = _two_stage(rows, m=2)
    with pytest.raises(ScheduleError) as expected:
        validate(bad)
    with pytest.raises(ScheduleError) as got:
        simulate(bad)
    assert got.value.message == expected.value.message and got.value.report == expected.value.report

"""IR v2: replicas and routes, overlapped pairs, whole-stage actions, the kind table, against hand-worked schedules."""

from __future__ import annotations

import json

import pytest

from pipefold import CostModel, Schedule, ScheduleError, build, simulate, validate
from pipefold.ir import (
    BW,
    KINDS,
    OPT,
    Action,
    B,
    F,
    KindSpec,
    R,
    W,
    dependency_graph,
    linear_placement,
    overlap,
    register_kind,
    reversed_placement,
)


def _two_way() -> Schedule:
    """p=2, m=2: microbatch 0 down (stage s on device s), microbatch 1 up (stage s on device 1-s)."""
    rows = [
        [F(0, 0), F(1, 1), BW(1, 1), BW(0, 0), R(0), R(1)],
        [F(0, 1), F(1, 0), BW(1, 0), BW(0, 1), R(0), R(1)],
    ]
    return Schedule("two-way", 2, 2, 2, (linear_placement(2), reversed_placement(2)), rows, routes=(0, 1))


def test_replicas_validate_and_round_trip_in_every_form(tmp_path) -> None:
    s = validate(_two_way())
    assert s.replicas == 2 and s.holders(0) == (0, 1) and s.device_of(0, 1) == 1
    assert s.stages_of(0) == [0, 1] and s.replica_on(1, 0) == 1
    text = s.to_text()
    assert "placement: linear | reversed" in text and "routes: 0 1" in text
    assert Schedule.from_text(text) == s
    assert Schedule.from_json(json.loads(json.dumps(s.to_json()))) == s
    # CSV holds only actions: the replicas are inferred from where each microbatch's forwards run.
    back = Schedule.from_csv(s.to_csv(), name="two-way")
    assert back.placement == s.placement and back.routes == s.routes and back.actions == s.actions


def test_a_replicated_stage_needs_its_all_reduce_on_every_holder() -> None:
    s = _two_way()
    rows = [list(s.actions[0]), list(s.actions[1][:-1])]  # device 1 lost its 1R
    with pytest.raises(ScheduleError, match=r"stage 1 has replicas on devices 1, 0, so each needs an all-reduce"):
        validate(s.with_actions(rows))


def test_an_all_reduce_of_a_stage_without_replicas_is_refused() -> None:
    s = build("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="1R runs between the replicas of stage 1, but the placement holds it once"):
        validate(s.with_actions([s.actions[0], [*s.actions[1], R(1)]]))


def test_an_action_on_the_wrong_replica_names_its_microbatch() -> None:
    s = _two_way()
    rows = [list(s.actions[0]), list(s.actions[1])]
    rows[0][0], rows[1][0] = F(0, 1), F(0, 0)
    with pytest.raises(ScheduleError, match="which the placement puts on device 1 for microbatch 1"):
        validate(s.with_actions(rows))


def test_collectives_run_together_or_deadlock_is_named() -> None:
    s = _two_way()
    # Device 1 reduces stage 1 first, device 0 stage 0 first: each waits for the other.
    rows = [list(s.actions[0]), [*s.actions[1][:4], R(1), R(0)]]
    with pytest.raises(ScheduleError, match="deadlock: device 0 at position 4 \\(0R\\) waits for 0R on device 1"):
        validate(s.with_actions(rows))


def test_all_reduce_is_costed_as_a_ring_and_runs_beside_compute() -> None:
    s = _two_way()
    base = simulate(s, CostModel())
    # Unit F=1, BW=2: device 0 runs 0F0 [0,1], 1F1 waits for 0F1 on device 1 [1,2], 1BW1 [2,4],
    # 0BW0 waits for 1BW0 on device 1 ([2,4]) -> [4,6]; likewise device 1. Then the all-reduces start at 6.
    assert base.makespan == pytest.approx(6.0)
    nbytes, bandwidth, latency = 4e6, 1e6, 0.25
    cost = CostModel(grad_bytes=nbytes, bandwidth=bandwidth, latency=latency)
    # grad_bytes is per device share; a stage here is one share (2 stages on 2 devices). A ring
    # all-reduce between n = 2 replicas is 2(n-1) = 2 steps of latency and 2(n-1)/n = 1 times the bytes.
    expected = 2 * latency + 1.0 * nbytes / bandwidth
    assert cost.stage_cost(0, 2, 2, replicas=2).allreduce == pytest.approx(expected)
    result = simulate(s, cost)
    r0 = next(iv for iv in result.timeline[0] if iv.action == R(0))
    r1 = next(iv for iv in result.timeline[0] if iv.action == R(1))
    # Both holders' last backwards of stage 0 end, then the collective starts on both at once.
    last = max(iv.end for row in result.timeline for iv in row if iv.action.kind == "BW")
    assert (r0.start, r0.end) == pytest.approx((last, last + expected))
    # An all-reduce does not occupy the device: the next one starts at once, beside it.
    assert r1.start == pytest.approx(last)
    assert result.makespan == pytest.approx(last + expected)
    assert result.busy == pytest.approx([6.0, 6.0])


def _pair_schedule() -> Schedule:
    """p=2 on a linear placement, device 1 overlaps the forward of microbatch 1 with the backward of 0."""
    rows = [
        [F(0, 0), F(0, 1), B(0, 0), W(0, 0), B(0, 1), W(0, 1)],
        [F(1, 0), overlap(F(1, 1), B(1, 0)), W(1, 0), B(1, 1), W(1, 1)],
    ]
    return Schedule("pair", 2, 2, 2, linear_placement(2), rows)


def test_an_overlapped_pair_costs_max_or_sum() -> None:
    s = validate(_pair_schedule())
    pair = s.actions[1][1]
    assert str(pair) == "1F1+1B0" and Action.parse("1F1+1B0") == pair
    assert Schedule.from_text(s.to_text()) == s
    costs = dict(f=1.0, b=2.0, w=1.0)
    apart = simulate(s, CostModel(**costs))
    together = simulate(s, CostModel(**costs, overlap=True))

    def span(result):
        iv = result.timeline[1][1]
        return iv.end - iv.start

    assert span(apart) == pytest.approx(1.0 + 2.0)
    assert span(together) == pytest.approx(max(1.0, 2.0))
    assert together.makespan == pytest.approx(apart.makespan - 1.0)
    # Memory: the pair takes the forward's activation and rebuilds nothing; its end is B's end.
    assert max(together.peak_memory) == pytest.approx(max(apart.peak_memory))


def test_pairs_that_cannot_overlap_are_refused() -> None:
    with pytest.raises(ValueError, match="overlaps a backward with its own forward"):
        overlap(F(1, 0), B(1, 0))
    with pytest.raises(ValueError, match="a forward then a backward"):
        Action.parse("1B0+1F1")
    with pytest.raises(ValueError, match="a R action names no microbatch"):
        Action.parse("0R3")
    with pytest.raises(ValueError, match="a F action names microbatch"):
        Action.parse("0F")
    with pytest.raises(ValueError, match="an overlapped pair is two actions joined by"):
        Action.parse("0F1+1B0+2F3")


def test_optimizer_steps_wait_for_every_weight_gradient() -> None:
    s = build("1f1b", 2, 2)
    rows = [[*s.actions[0], OPT(0)], [OPT(1), *s.actions[1]]]
    with pytest.raises(ScheduleError, match="1OPT comes before 1BW0"):
        validate(s.with_actions(rows))
    ok = s.with_actions([[*s.actions[0], OPT(0)], [*s.actions[1], OPT(1)]])
    graph = dependency_graph(ok)
    opt0 = graph.gid(0, len(ok.actions[0]) - 1)
    assert {graph.action(g) for g in graph.inputs[opt0]} == {BW(0, 0), BW(0, 1)}


def test_a_registered_kind_is_validated_costed_and_drawn_from_its_entry() -> None:
    spec = KindSpec(code="KX", doc="curvature of a forward's input (test kind)", needs=(("F", 0),), gives=("KX",),
                    time=lambda c: 0.5 * c.f, memory=lambda c: (0.25, -0.25), color="#123456", label="curvature")
    register_kind(spec)
    try:
        s = build("gpipe", 2, 2)
        rows = [[*s.actions[0][:2], Action(0, "KX", 0), Action(0, "KX", 1), *s.actions[0][2:]], s.actions[1]]
        custom = validate(s.with_actions(rows))
        result = simulate(custom)
        kx = [iv for iv in result.timeline[0] if iv.action.kind == "KX"]
        # GPipe p=2, m=2: device 0 idles from 2 (its forwards done) to 5 (device 1's first backward):
        # the custom work after the forwards fills that bubble and the step is no longer.
        assert [(iv.start, iv.end) for iv in kx] == [(2.0, 2.5), (2.5, 3.0)]
        assert result.makespan == pytest.approx(simulate(s).makespan) == pytest.approx(9.0)
        assert max(result.peak_memory) == pytest.approx(2.25)
        early = s.with_actions([[Action(0, "KX", 0), *s.actions[0]], s.actions[1]])
        with pytest.raises(ScheduleError, match="0KX0 comes before 0F0"):
            validate(early)
    finally:
        del KINDS["KX"]
    with pytest.raises(ScheduleError, match="cannot read action '0KX0'"):
        Schedule.from_text("devices: 1\nstages: 1\nmicrobatches: 1\ndevice 0: 0F0 0KX0 0BW0\n")


def test_a_schedule_keeps_its_action_table_until_the_kinds_change() -> None:
    """The table is made once per schedule (a copy makes its own), and again once a kind is registered: a schedule
    whose table was read while its custom kind was unknown validates and simulates after the kind is registered."""
    import dataclasses

    from pipefold.ir.graph import action_table

    s = build("gpipe", 2, 2)
    first = action_table(s)
    assert action_table(s) is first and action_table(dataclasses.replace(s)) is not first
    rows = [[*s.actions[0][:2], Action(0, "KY", 0), *s.actions[0][2:]], s.actions[1]]
    custom = s.with_actions(rows)
    assert -1 in action_table(custom).kind.tolist()  # unknown yet
    register_kind(KindSpec(code="KY", doc="test kind", needs=(("F", 0),), gives=("KY",), time=lambda c: 0.5 * c.f,
                           memory=lambda c: (0.0, 0.0), color="#654321", label="ky"))
    try:
        table = action_table(custom)
        assert table.kinds[table.kind[2]] == "KY" and -1 not in table.kind.tolist()
        result = simulate(validate(custom))  # device 0 idles from 2 to 5 (the test above): KY fills it
        assert [(iv.start, iv.end) for iv in result.timeline[0] if iv.action.kind == "KY"] == [(2.0, 2.5)]
        assert result.makespan == pytest.approx(simulate(s).makespan)
        assert action_table(s) is not first and action_table(s).kinds == tuple(KINDS)
    finally:
        del KINDS["KY"]
    assert action_table(s).kinds == tuple(KINDS)


def test_replicas_pay_for_their_weights_twice() -> None:
    """Chimera holds two stages (one per replica) per device, 1F1B one: with weights w per device share,
    Chimera's peaks rise by 2w, 1F1B's by w."""
    w = 1.5
    for name, copies in (("chimera", 2), ("1f1b", 1), ("zb-v", 1)):
        s = build(name, 4, 8)
        bare, heavy = simulate(s), simulate(s, CostModel(weights=w))
        assert heavy.peak_memory == pytest.approx([x + copies * w for x in bare.peak_memory])


def test_files_written_before_replicas_still_load() -> None:
    """A version-1 JSON file and a text file as pipefold wrote them before IR v2, byte for byte."""
    v1 = ('{"format": "pipefold-schedule", "version": 1, "name": "1f1b", "options": {}, "devices": 2, "stages": 2, '
          '"microbatches": 2, "placement": [0, 1], "actions": [["0F0", "0F1", "0BW0", "0BW1"], '
          '["1F0", "1BW0", "1F1", "1BW1"]]}')
    text = ("# pipefold schedule\nname: 1f1b\noptions: {}\ndevices: 2\nstages: 2\nmicrobatches: 2\n"
            "placement: linear\ndevice 0: 0F0 0F1 0BW0 0BW1\ndevice 1: 1F0 1BW0 1F1 1BW1\n")
    want = build("1f1b", 2, 2)
    assert Schedule.from_json(v1) == want
    assert Schedule.from_text(text) == want and want.to_text() == text


@pytest.mark.parametrize(("make", "code"), [(F, "F"), (B, "B"), (W, "W"), (BW, "BW")])
def test_the_pass_helpers_make_the_same_actions_as_the_named_tuple(make, code) -> None:
    # The helpers build the tuple directly (tuple.__new__, for speed): every field, the type, equality, hashing,
    # the text form and parsing must be what Action(...) gives.
    a = make(3, 5)
    assert type(a) is Action and a == Action(3, code, 5) and hash(a) == hash(Action(3, code, 5))
    assert (a.stage, a.kind, a.microbatch, a.parts) == (3, code, 5, ()) and a.passes == (a,)
    assert str(a) == f"3{code}5" and Action.parse(str(a)) == a


def test_a_paused_collector_leaves_no_young_collection_due_and_keeps_a_programs_frozen_objects() -> None:
    import gc

    from pipefold._gc import freeze, paused_gc, unfreeze

    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        made = [(i, str(i), []) for i in range(100_000)]
    assert gc.isenabled() and gc.get_count()[0] < 1000  # what the body made is not walked at once
    kept = [[] for _ in range(10)]
    freeze()
    try:
        frozen = gc.get_freeze_count()
        with paused_gc():
            made += [(i, []) for i in range(10)]
        assert gc.get_freeze_count() == frozen  # a program's own frozen objects stay frozen
    finally:
        unfreeze()
    assert len(made) == 100_010 and len(kept) == 10


def test_a_paused_collector_asks_for_the_frozen_count_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector's count of frozen objects walks them all (a million in a rank forked from the fork server, which
    froze torch): asked at each schedule built, it made Pipeline(schedule="auto"), which builds every candidate,
    25 times slower there. It is asked once per process, then kept as freeze() and unfreeze() change it."""
    import gc

    from pipefold import _gc

    asked = []
    monkeypatch.setattr(_gc, "_FROZEN", None)
    monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or 0)
    for _ in range(5):
        with _gc.paused_gc():
            pass
    assert len(asked) == 1
    _gc.freeze()
    try:
        with _gc.paused_gc():
            pass
        assert _gc._frozen() and len(asked) == 1
    finally:
        _gc.unfreeze()
    assert not _gc._frozen() and len(asked) == 1

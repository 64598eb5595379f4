"""The simulator against closed forms and an independent check of its timelines."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import build_or_refused
from pipefold import ConfigError, CostModel, Kind, build, names, simulate
from pipefold.ir import KINDS, Action
from pipefold.sim.simulate import Interval, SimResult, StageOverride, Timeline, peak_by_order, split_backward


def _check_timeline(r: SimResult) -> None:
    """Independent reference: the timeline is feasible and every action starts as early as it can.

    Feasible: a device runs one action at a time in list order, each lasting its
    cost, and no action starts before its inputs arrive. Earliest: each action
    starts when its device frees up or when its last input arrives. Those two
    properties fix every time uniquely, so this re-derives the simulator's rule,
    written out here for each kind: F after the previous stage's F; B and BW after their
    own F and the next stage's backward; W after its B; an overlapped pair after what
    both parts wait for, lasting the longer part (or both, without overlap); an all-reduce
    after every W of its replica of the stage, at the same moment on every holder, beside
    the device's compute.
    """
    s, cost = r.schedule, r.cost
    costs = [cost.stage_cost(st, s.stages, s.devices, replicas=len(s.holders(st))) for st in range(s.stages)]
    f_end, b_end, w_end = {}, {}, {}
    for row in r.timeline:
        for iv in row:
            for a in iv.action.passes:
                key = (a.stage, a.microbatch)
                if a.kind == Kind.F:
                    f_end[key] = iv.end
                if a.kind in (Kind.B, Kind.BW):
                    b_end[key] = iv.end
                if a.kind in (Kind.W, Kind.BW):
                    w_end[key] = iv.end

    links = cost.link_times(s.devices)

    def hop(src: int, d: int) -> float:
        if src == d:
            return 0.0
        return links if isinstance(links, float) else links[src][d]

    def duration(a: Action) -> float:
        c = costs[a.stage]
        return {Kind.F: c.f, Kind.B: c.b, Kind.W: c.w, Kind.BW: c.b + c.w, Kind.R: c.allreduce}[a.kind]

    reduce_ready: dict[int, list[float]] = {}
    reduce_start: dict[int, list[float]] = {}
    for d, row in enumerate(r.timeline):
        free = 0.0
        for iv in row:
            act = iv.action
            arrivals = [free]
            if act.kind == Kind.R:
                replica = s.replica_on(act.stage, d)
                arrivals += [w_end[act.stage, j] for j in range(s.microbatches) if s.routes[j] == replica]
                reduce_ready.setdefault(act.stage, []).append(max(arrivals))
                reduce_start.setdefault(act.stage, []).append(iv.start)
                assert iv.end - iv.start == pytest.approx(duration(act))
                free = iv.start  # the device goes on at once
                continue
            for a in act.passes:
                j = a.microbatch
                if a.kind == Kind.F and a.stage > 0:
                    arrivals.append(f_end[a.stage - 1, j] + hop(s.device_of(a.stage - 1, j), d))
                if a.kind in (Kind.B, Kind.BW):
                    arrivals.append(f_end[a.stage, j])
                    if a.stage + 1 < s.stages:
                        arrivals.append(b_end[a.stage + 1, j] + hop(s.device_of(a.stage + 1, j), d))
                if a.kind == Kind.W:
                    arrivals.append(b_end[a.stage, j])
            parts = [duration(a) for a in act.passes]
            assert iv.end - iv.start == pytest.approx(max(parts) if cost.overlap else sum(parts))
            assert iv.start == pytest.approx(max(arrivals))
            free = iv.end
    for stage, starts in reduce_start.items():  # a collective starts when its last member is ready
        assert starts == pytest.approx([max(reduce_ready[stage])] * len(starts))


COSTS = st.builds(CostModel, f=st.sampled_from([0.5, 1.0, 2.0]), b=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
                  w=st.sampled_from([0.0, 0.5, 1.0, 2.0]), latency=st.sampled_from([0.0, 0.25, 1.0]),
                  memory_w=st.sampled_from([None, 0.0, 0.5, 1.0, 2.0]),
                  recompute=st.sampled_from([0.0, 0.0, 0.5, 1.0]))


@pytest.mark.parametrize("name", names())
@given(p=st.integers(1, 8), m=st.integers(1, 24), cost=COSTS)
def test_timeline_is_feasible_and_tight(name: str, p: int, m: int, cost: CostModel) -> None:
    sched = build_or_refused(name, p, m)
    if sched is None:
        return
    r = simulate(sched, cost)
    _check_timeline(r)
    assert r.makespan == pytest.approx(max(iv.end for row in r.timeline for iv in row))
    assert all(b + i == pytest.approx(r.makespan) for b, i in zip(r.busy, r.idle, strict=True))
    assert r.bubble_ratio == pytest.approx(1 - sum(r.busy) / (p * r.makespan))
    # Every allocation is given back by the end of the step.
    assert all(curve[-1][1] == pytest.approx(0.0) for curve in r.memory_curve)


@given(p=st.integers(1, 10), latency=st.sampled_from([0.0, 0.5, 2.0]), nbytes=st.sampled_from([0.0, 100.0]))
def test_one_microbatch_pays_each_hop_twice(p: int, latency: float, nbytes: float) -> None:
    cost = CostModel(latency=latency, bandwidth=50.0, activation_bytes=nbytes)
    for name in ("gpipe", "1f1b", "zb-h1"):
        r = simulate(build(name, p, 1), cost)
        # Forward chain, backward chain, and each of the p-1 links crossed twice. A fused BW
        # sits on the chain; split, only B does, and the W of stage 0 comes after.
        chain = 3 * p if name != "zb-h1" else 2 * p + 1
        hop = latency + nbytes / 50.0
        assert r.makespan == pytest.approx(chain + 2 * (p - 1) * hop)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "v-half", "chimera",
                                  "dualpipev"])
@given(p=st.integers(2, 6), m=st.integers(1, 10), data=st.data())
def test_each_pair_of_meshes_prices_its_own_crossings(name: str, p: int, m: int, data: st.DataObject) -> None:
    """Devices of different tensor-parallel degrees: every message pays the crossing between its own two meshes,
    checked by the feasible-and-tight rule re-derived with a time per pair of devices."""
    sched = build_or_refused(name, p, m)
    if sched is None:
        return
    mesh = tuple(data.draw(st.lists(st.sampled_from([1, 2, 4]), min_size=p, max_size=p)))
    cost = CostModel(f=1.0, b=1.5, w=0.5, latency=0.25, bandwidth=4.0, activation_bytes=8.0, mesh=mesh)
    _check_timeline(simulate(sched, cost))


def test_one_microbatch_crosses_each_pair_of_meshes_at_its_own_time() -> None:
    # Closed form: gpipe over meshes of 2, 1 and 1 ranks, one microbatch: the forward and backward chains, and each
    # link crossed once each way at the time of its own two meshes (a single price for every message, the slowest
    # crossing, would charge the 1 -> 1 link as the 1 -> 2).
    cost = CostModel(latency=0.25, bandwidth=4.0, activation_bytes=8.0, mesh=(2, 1, 1))
    hops = cost.crossing_time(2, 1) + 2 * cost.crossing_time(1, 1) + cost.crossing_time(1, 2)
    assert simulate(build("gpipe", 3, 1), cost).makespan == pytest.approx(3 * 3 + hops)
    assert len({cost.crossing_time(2, 1), cost.crossing_time(1, 1), cost.crossing_time(1, 2)}) == 3
    with pytest.raises(ConfigError, match="cross at different times"):
        _ = cost.transfer_time
    with pytest.raises(ConfigError, match="a mesh for 3 devices, the schedule 4"):
        simulate(build("gpipe", 4, 1), cost)


def test_no_transfer_cost_between_stages_on_one_device() -> None:
    slow = CostModel(latency=5.0)
    r = simulate(build("interleaved-1f1b", 1, 4, v=3), slow)
    assert r.makespan == simulate(build("interleaved-1f1b", 1, 4, v=3)).makespan == pytest.approx(12)


def test_chunk_costs_and_memory_are_divided_by_v() -> None:
    r = simulate(build("looped-bfs", 2, 4, v=4))
    assert r.busy == pytest.approx([12.0, 12.0])  # 4 microbatches x 3 units, whatever v
    assert r.peak_memory == pytest.approx([4.0, 4.0])


def test_memory_held_between_b_and_w() -> None:
    zb = build("zb-h1", 4, 8)
    # Deferred Ws hold memory: device i keeps i extra microbatches until their W.
    assert simulate(zb).peak_memory == simulate(zb, CostModel(memory_w=1.0)).peak_memory == [4, 4, 4, 4]
    # Nothing held after B: ZB-H1 needs exactly 1F1B's memory; half of it, half the deferral's cost.
    assert simulate(zb, CostModel(memory_w=0.0)).peak_memory == [4, 3, 2, 1]
    assert simulate(zb, CostModel(memory_w=0.5)).peak_memory == [4, 3.5, 3, 2.5]
    # A fused backward never holds memory_w.
    fused = build("1f1b", 4, 8)
    assert simulate(fused, CostModel(memory_w=1.7)).peak_memory == simulate(fused).peak_memory


def test_memory_w_above_memory_by_hand() -> None:
    # zb-h1, p=2, m=2; every pass takes 1. F takes 1, B's end adds 0.5 (1 -> 1.5), W's end gives 1.5 back.
    #   device 0: 0F0 0F1 0B0 0W0 0B1 0W1    1, 2, 2 then 2.5, 1, 1 then 1.5, 0    peak 2.5
    #   device 1: 1F0 1B0 1F1 1B1 1W0 1W1    1, 1 then 1.5, 2.5, 2.5 then 3, 1.5, 0    peak 3
    # The last device, which defers both Ws, now holds the most.
    sched = build("zb-h1", 2, 2)
    assert sched.to_text().splitlines()[-2:] == ["device 0: 0F0 0F1 0B0 0W0 0B1 0W1",
                                                 "device 1: 1F0 1B0 1F1 1B1 1W0 1W1"]
    over = {s: StageOverride(f=1, b=1, w=1, memory=1, memory_w=1.5) for s in range(2)}
    r = simulate(sched, CostModel(stage_overrides=over))
    assert r.peak_memory == [2.5, 3.0]
    assert r.memory_curve[1] == ((0.0, 0.0), (1.0, 1.0), (3.0, 2.5), (5.0, 3.0), (6.0, 1.5), (7.0, 0.0))
    assert simulate(sched, CostModel(memory_w=1.5)).peak_memory == [2.5, 3.0]


def test_memory_w_scales_with_the_stage_share_and_overrides_replace_it() -> None:
    cost = CostModel(memory=2, memory_w=3, stage_overrides={1: StageOverride(f=1, b=1, w=1),
                                                            2: StageOverride(f=1, b=1, w=1, memory=5, memory_w=7)})
    # Two stages per device: each is half a share.
    assert [cost.stage_cost(s, 8, 4).held_w for s in range(3)] == [1.5, 1.5, 7]
    assert CostModel(memory=2).stage_cost(0, 8, 4).held_w == 1.0  # unset: the stage's memory
    d = cost.to_dict()
    assert d["memory_w"] == 3 and d["stage_overrides"]["2"]["memory_w"] == 7
    assert d["stage_overrides"]["1"]["memory_w"] is None and CostModel().to_dict()["memory_w"] is None


def _replay_peak(actions: tuple[Action, ...], cost: CostModel, stages: int, devices: int) -> float:
    """One device's peak, walking its passes in order with the five memory steps written out
    (an overlapped pair takes both parts' starts, then both ends; an all-reduce holds nothing)."""
    level = peak = 0.0
    for act in actions:
        starts, ends = 0.0, 0.0
        for a in act.passes:
            if a.kind == Kind.R:
                continue
            c = cost.stage_cost(a.stage, stages, devices)
            memory = c.memory
            kept = memory if c.kept is None else c.kept
            memory_w = memory if c.memory_w is None else c.memory_w
            starts += {Kind.F: kept, Kind.B: memory - kept, Kind.BW: memory - kept, Kind.W: 0.0}[a.kind]
            ends += {Kind.F: 0.0, Kind.B: memory_w - memory, Kind.BW: -memory, Kind.W: -memory_w}[a.kind]
        level += starts
        peak = max(peak, level)
        level += ends
        peak = max(peak, level)
    assert level == pytest.approx(0.0)
    return peak


@pytest.mark.parametrize("name", names())
@given(p=st.integers(1, 6), m=st.integers(1, 12), memory_w=st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0]),
       recompute=st.sampled_from([0.0, 0.5]), f=st.sampled_from([1.0, 2.0]), w=st.sampled_from([0.5, 1.0]))
def test_peak_equals_a_replay_of_each_device_order(name: str, p: int, m: int, memory_w: float, recompute: float,
                                                   f: float, w: float) -> None:
    sched = build_or_refused(name, p, m)
    if sched is None:
        return
    cost = CostModel(f=f, w=w, memory_w=memory_w, recompute=recompute)
    want = [_replay_peak(row, cost, sched.stages, sched.devices) for row in sched.actions]
    assert simulate(sched, cost).peak_memory == pytest.approx(want)


def test_memory_unit_scales_peaks() -> None:
    r = simulate(build("1f1b", 4, 8), CostModel(memory=2.5))
    assert r.peak_memory == [10.0, 7.5, 5.0, 2.5]


def test_stage_overrides_replace_derived_costs() -> None:
    cost = CostModel(stage_overrides={0: StageOverride(f=2, b=3, w=4)})
    r = simulate(build("1f1b", 1, 5), cost)
    assert r.makespan == 5 * (2 + 3 + 4)
    assert r.peak_memory == [1.0]
    r = simulate(build("1f1b", 1, 5), CostModel(stage_overrides={0: StageOverride(f=1, b=1, w=1, memory=3)}))
    assert r.peak_memory == [3.0]


@given(p=st.integers(1, 8), m=st.integers(1, 16), r=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
       f=st.sampled_from([1.0, 2.0]))
def test_recomputation_closed_forms(p: int, m: int, r: float, f: float) -> None:
    """1F1B recomputing r of each forward: every backward takes r F longer; device i, with
    k = min(m, p - i) microbatches in flight, keeps k (1 - r) M and rebuilds r M for the oldest."""
    cost = CostModel(f=f, recompute=r)
    res = simulate(build("1f1b", p, m), cost)
    assert res.makespan == pytest.approx((m + p - 1) * (f + 1 + 1 + r * f))
    expected = [min(m, p - i) * (1 - r) + r for i in range(p)]
    assert res.peak_memory == pytest.approx(expected)
    # Split backward that holds nothing after B: the same peaks, since B rebuilds and frees together.
    zb = simulate(build("zb-h1", p, m), CostModel(f=f, recompute=r, memory_w=0.0))
    assert zb.peak_memory == pytest.approx(expected)


def test_recomputation_per_stage_overrides() -> None:
    # One stage, 3 microbatches in flight under GPipe: keeps 3 x 2, rebuilds 5 - 2 for the one in backward.
    cost = CostModel(stage_overrides={0: StageOverride(f=1, b=1, w=1, memory=5, recompute=0.5, kept=2)})
    r = simulate(build("gpipe", 1, 3), cost)
    assert r.peak_memory == [3 * 2 + 3]
    assert r.makespan == 3 * (1 + 1.5 + 1)
    with pytest.raises(ConfigError, match="keeps 6 between F and B, more than its memory 5"):
        CostModel(stage_overrides={0: StageOverride(f=1, b=1, w=1, memory=5, kept=6)})
    with pytest.raises(ConfigError, match=r"recompute is a fraction of the forward: 0..1 \(got 2\)"):
        CostModel(recompute=2)


def test_bad_costs_are_rejected_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"cost f must be a finite number >= 0 \(got -1\)"):
        CostModel(f=-1)
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ConfigError, match=r"cost memory_w must be a finite number >= 0 \(got "):
            CostModel(memory_w=bad)
        with pytest.raises(ConfigError, match=r"stage 0 cost memory_w must be a finite number >= 0 \(got "):
            CostModel(stage_overrides={0: StageOverride(f=1, b=1, w=1, memory_w=bad)})
    with pytest.raises(ConfigError, match="bandwidth must be > 0"):
        CostModel(bandwidth=0)
    with pytest.raises(ConfigError, match="names stage 7, but 1f1b has stages 0..3"):
        simulate(build("1f1b", 4, 4), CostModel(stage_overrides={7: StageOverride(f=1, b=1, w=1)}))


def test_to_dict_is_json_ready() -> None:
    import json

    r = simulate(build("interleaved-1f1b", 4, 8, v=2))
    d = json.loads(json.dumps(r.to_dict(timeline=True)))
    assert d["makespan"] == 28.5 and d["peak_memory"][0] == 5.5
    assert d["devices"] == 4 and d["stages"] == 8 and d["microbatches"] == 8
    assert sum(len(row) for row in d["timeline"]) == r.schedule.num_actions
    assert d["cost"]["bandwidth"] is None and not math.isnan(d["bubble_ratio"])


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "v-min", "interleaved-1f1b", "gpipe"])
@given(p=st.integers(1, 6), m=st.integers(1, 12), kept=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=12,
                                                                   max_size=12),
       memory_w=st.sampled_from([0.0, 0.5, 1.0, 1.5]))
def test_peak_by_order_equals_the_simulated_peak(name: str, p: int, m: int, kept: list[float],
                                                  memory_w: float) -> None:
    sched = build(name, p, m)
    over = {s: StageOverride(f=1 + s % 3, b=1, w=0.5, memory=2.0 + s, kept=kept[s % 12] * (2.0 + s),
                             memory_w=memory_w * (2.0 + s), recompute=0.5) for s in range(sched.stages)}
    cost = CostModel(stage_overrides=over)
    r = simulate(sched, cost)
    costs = {s: cost.stage_cost(s, sched.stages, sched.devices) for s in range(sched.stages)}
    assert [peak_by_order(row, costs) for row in sched.actions] == pytest.approx(r.peak_memory)


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "dualpipev", "chimera", "v-half"])
def test_the_timeline_reads_as_its_intervals_made_at_once(name: str) -> None:
    # The simulator keeps the times flat and makes a device's intervals when its row is read; the reference is the
    # same rows as plain tuples, whose makespan and busy times are computed here by loops over the intervals.
    import pickle
    from types import SimpleNamespace

    from pipefold.sim.simulate import Timeline

    r = simulate(build(name, 4, 8), CostModel(f=1.0, b=1.37, w=0.61, latency=0.05))
    assert isinstance(r.timeline, Timeline)
    rows = tuple(tuple(row) for row in r.timeline)
    computes = {k for k, spec in KINDS.items() if spec.computes}
    busy = [sum(iv.end - iv.start for iv in row if iv.action.kind in computes) for row in rows]
    makespan = max((row[-1].end for row in rows if row), default=0.0)
    plain = SimpleNamespace(timeline=rows, makespan=makespan, busy=busy,
                            bubble_ratio=1.0 - sum(b / 4 for b in busy) / makespan)
    assert r.makespan == plain.makespan and r.busy == plain.busy and r.bubble_ratio == plain.bubble_ratio
    again = Timeline.of(rows)  # the timeline of intervals made elsewhere (a run's measured ones)
    assert again == rows and again.makespan() == makespan and again.busy() == busy
    assert r.timeline == plain.timeline and len(r.timeline) == 4 and r.timeline[-1] == plain.timeline[3]
    assert r.timeline[1:3] == plain.timeline[1:3] and r.timeline[0] is r.timeline[0]  # a row is made once
    assert all(type(iv) is Interval and iv.action == a for row, acts in zip(r.timeline, r.schedule.actions,
                                                                             strict=True)
               for iv, a in zip(row, acts, strict=True))
    with pytest.raises(IndexError):
        r.timeline[4]
    assert pickle.loads(pickle.dumps(r)).timeline == plain.timeline


def test_a_stage_fused_backward_lasts_its_own_time() -> None:
    # A measured BW replaces B + W for BW actions only: 1f1b on 2 devices, 3 microbatches, one stage each, a free
    # link: (m + p - 1) (F + BW) whatever B and W are; a split schedule keeps B and W.
    over = {s: StageOverride(f=1.0, b=2.0, w=2.0, bw=2.5) for s in range(2)}
    fused = simulate(build("1f1b", 2, 3), CostModel(stage_overrides=over))
    assert fused.makespan == pytest.approx(4 * 3.5)
    assert all(i.end - i.start == pytest.approx(2.5) for row in fused.timeline for i in row if i.action.kind == "BW")
    plain = {s: dataclasses.replace(o, bw=None) for s, o in over.items()}
    zb = build("zb-h1", 2, 3)
    assert simulate(zb, CostModel(stage_overrides=over)).makespan == simulate(
        zb, CostModel(stage_overrides=plain)).makespan
    assert CostModel(stage_overrides=over).to_dict()["stage_overrides"]["0"]["bw"] == 2.5
    with pytest.raises(ConfigError, match="stage 1 cost bw must be a finite number"):
        CostModel(stage_overrides={1: StageOverride(f=1.0, b=1.0, w=1.0, bw=-1.0)})
    # What the ranks measured: a BW where one ran, else None (B and W are kept as measured).
    assert split_backward({"F": 1.0, "BW": 3.0}) == StageOverride(f=1.0, b=1.5, w=1.5, bw=3.0)
    assert split_backward({"F": 1.0, "B": 2.0, "W": 0.5}) == StageOverride(f=1.0, b=2.0, w=0.5, bw=None)


def test_the_runtime_overhead_is_paid_by_each_end_of_each_message() -> None:
    # 1f1b, 2 devices, 3 microbatches, a free link: device 0's F and device 1's BW each send one message, device 1's
    # F and device 0's BW each receive one, so every action is longer by the overhead: (m + p - 1) (F + BW + 2 o).
    cost = CostModel(f=1.0, b=1.0, w=1.0, message_overhead=0.25)
    assert simulate(build("1f1b", 2, 3), cost).makespan == pytest.approx(4 * (1.0 + 2.0 + 0.5))
    # zb-v on 2 devices (stages 0 and 3 on device 0): every F and B sends or receives one message (the V's turn,
    # stage 1 to 2, sends nothing, and F1 and B2 receive theirs from device 0); W neither sends nor receives.
    zb = build("zb-v", 2, 4)
    assert {a.stage for a in zb.actions[0]} == {0, 3}
    got = simulate(zb, CostModel(message_overhead=0.25))
    plain = simulate(zb, CostModel())
    for row, base in zip(got.timeline, plain.timeline, strict=True):
        for i, j in zip(row, base, strict=True):
            want = 0.0 if i.action.kind == "W" else 0.25
            assert (i.end - i.start) - (j.end - j.start) == pytest.approx(want), i.action
    assert got.makespan > plain.makespan
    with pytest.raises(ConfigError, match="cost message_overhead must be a finite number >= 0"):
        CostModel(message_overhead=-1.0)
    assert CostModel(message_overhead=0.5).to_dict()["message_overhead"] == 0.5


def _brute_company(rows: list[list[tuple[float, float]]], ranks: list[int]) -> list[float]:
    """How many other ranks compute beside one of each device's ranks (device d stands for ranks[d]), time-averaged,
    by cutting time at every interval's ends and counting at each piece's middle."""
    cuts = sorted({x for row in rows for iv in row for x in iv})
    out = []
    for d, row in enumerate(rows):
        beside = spent = 0.0
        for a, b in zip(cuts, cuts[1:], strict=False):
            mid = (a + b) / 2
            if any(s <= mid < e for s, e in row):
                beside += (b - a) * (ranks[d] - 1 + sum(ranks[o] for o, other in enumerate(rows) if o != d
                                                        and any(s <= mid < e for s, e in other)))
                spent += b - a
        out.append(beside / spent if spent else 0.0)
    return out


@given(st.lists(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 8)), max_size=6), min_size=1, max_size=4),
       st.lists(st.integers(1, 4), min_size=4, max_size=4))
def test_company_is_the_time_averaged_count_of_others_computing(spans: list[list[tuple[int, int]]],
                                                                 ranks: list[int]) -> None:
    # Each device's intervals in run order, none overlapping on its device (a start after the last end).
    rows: list[list[tuple[float, float]]] = []
    for row in spans:
        t, made = 0.0, []
        for gap, length in row:
            t += gap
            made.append((t, t + length))
            t += length
        rows.append(made)
    timeline = Timeline.of([[Interval(Action(0, Kind.F, i), s, e) for i, (s, e) in enumerate(row)] for row in rows])
    assert timeline.company() == pytest.approx(_brute_company(rows, [1] * len(rows)))
    assert timeline.company(ranks[:len(rows)]) == pytest.approx(_brute_company(rows, ranks[:len(rows)]))


def test_company_by_hand() -> None:
    together = Timeline.of([[Interval(Action(0, Kind.F, 0), 0.0, 2.0)], [Interval(Action(1, Kind.F, 0), 1.0, 3.0)],
                            [Interval(Action(2, Kind.F, 0), 5.0, 6.0)], []])
    assert together.company() == [0.5, 0.5, 0.0, 0.0]  # half of 0's and 1's time together; 2 alone; 3 idle
    # Device 1 stands for 3 ranks computing in step: a rank of device 0 has them beside it half its time, a rank of
    # device 1 its 2 fellows all the time and device 0 half of it.
    assert together.company([1, 3, 2, 1]) == [1.5, 2.5, 1.0, 0.0]
    # One microbatch through four devices: they take turns, none computes beside another.
    assert simulate(build("gpipe", 4, 1), CostModel(f=1.0, b=1.0, w=1.0)).timeline.company() == [0.0] * 4
    # GPipe's steady state at m >> p: nearly every device computes beside every other one.
    many = simulate(build("gpipe", 2, 64), CostModel(f=1.0, b=1.0, w=1.0)).timeline.company()
    assert all(0.95 < c < 1.0 for c in many)

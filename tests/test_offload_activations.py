"""Activation offloading (PipeOffload): OF and RL actions in the IR, their times and memory in the simulator
against rules written out here, the selective planner against a brute force, and the runtime's exact gradients."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import build_or_refused

from pipefold import names
from pipefold.errors import ConfigError, ScheduleError
from pipefold.ir import Action, Kind, Schedule, validate
from pipefold.ir.kinds import OF, RL
from pipefold.plan.activation_offload import choose_offload, lifetimes, offload_fraction, parse_share, plan_offload
from pipefold.schedules import build
from pipefold.schedules.offload import offloadable_pairs, offloaded_pairs, with_offload
from pipefold.sim.network import Network
from pipefold.sim.simulate import CostModel, SimResult, simulate

# -------------------------------------------------------------------------------- the IR


def test_actions_read_and_print() -> None:
    assert str(OF(0, 3)) == "0OF3" and str(RL(2, 1)) == "2RL1"
    assert Action.parse("0OF3") == OF(0, 3) and Action.parse("2RL1") == RL(2, 1)
    with pytest.raises(ValueError, match="names microbatch"):
        Action.parse("0OF")


@pytest.mark.parametrize("name", names())
def test_every_family_offloads_validly_and_round_trips(name: str) -> None:
    sched = build_or_refused(name, 4, 8)
    if sched is None:
        return
    every = with_offload(sched)
    validate(every)
    assert sorted(offloaded_pairs(every)) == sorted(offloadable_pairs(sched))
    assert Schedule.from_text(every.to_text()) == every
    assert Schedule.from_json(every.to_json()) == every
    # Evaluation runs the forwards only: nothing to offload.
    assert every.forward_only() == sched.forward_only()
    # Each device keeps its order of everything else.
    for old, new in zip(sched.actions, every.actions, strict=True):
        assert [a for a in new if a.kind not in (Kind.OF, Kind.RL)] == list(old)


def _one_device(rows: list[str]) -> Schedule:
    return Schedule.from_text("\n".join(["# pipefold schedule", "name: custom", "options: {}", "devices: 1",
                                         "stages: 1", "microbatches: 1", "placement: 0",
                                         "device 0: " + " ".join(rows)]))


@pytest.mark.parametrize(("row", "message"), [
    (["0F0", "0OF0", "0B0", "0W0"], "needs a RL of stage 0 microbatch 0"),
    (["0F0", "0RL0", "0B0", "0W0"], "needs a OF of stage 0 microbatch 0"),
    (["0F0", "0OF0", "0B0", "0RL0", "0W0"], "0B0 comes before 0RL0 .position 3., which it depends on"),
    (["0OF0", "0F0", "0RL0", "0B0", "0W0"], "0OF0 comes before 0F0 .position 1., which it depends on"),
])
def test_an_offload_without_its_reload_or_out_of_order_is_refused(row: list[str], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(_one_device(row))


def test_a_pair_that_is_not_offloadable_is_refused() -> None:
    sched = build("1f1b", 2, 2)
    with pytest.raises(ConfigError, match="cannot offload stage 5 microbatch 0"):
        with_offload(sched, [(5, 0)])
    with pytest.raises(ConfigError, match="cannot offload stage 0 microbatch 0"):
        with_offload(with_offload(sched, [(0, 0)]), [(0, 0)])


@pytest.mark.parametrize(("text", "share"), [("all", 1.0), ("none", 0.0), ("0.25", 0.25), (" ALL ", 1.0), (1, 1.0)])
def test_shares_read(text: str | float, share: float) -> None:
    assert parse_share(text) == share


@pytest.mark.parametrize("text", ["2", "-0.1", "half", "", True])
def test_shares_outside_0_to_1_are_refused_in_one_line(text: str | bool) -> None:
    with pytest.raises(ConfigError, match="--offload-activations"):
        parse_share(text)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------- the simulator


def _check(r: SimResult) -> None:
    """Independent reference: every action's start and end, re-derived device by device in run order.

    A computing action starts when its device is free and its inputs are there (F: the previous stage's F; B, BW:
    its own F, the next stage's backward and its reload where it has one; W: its B), and holds the device until it
    ends. An offload starts once its forward ended, a reload once its offload ended, each also once the copy before
    it of its own kind on the device ended (one copy at a time each way), and neither holds the device."""
    s, cost = r.schedule, r.cost
    costs = [cost.stage_cost(st, s.stages, s.devices) for st in range(s.stages)]
    ends: dict[tuple[str, int, int], float] = {}
    for row in r.timeline:
        for iv in row:
            for a in iv.action.passes:
                ends[a.kind, a.stage, a.microbatch] = iv.end
    hop = cost.transfer_time
    for d, row in enumerate(r.timeline):
        free, lane = 0.0, {Kind.OF: 0.0, Kind.RL: 0.0}
        for iv in row:
            a = iv.action
            c = costs[a.stage]
            key = (a.stage, a.microbatch)
            if a.kind in lane:
                before = ends[(Kind.F, *key)] if a.kind == Kind.OF else ends[(Kind.OF, *key)]
                assert iv.start == pytest.approx(max(free, before, lane[a.kind]))
                assert iv.end - iv.start == pytest.approx(c.offload)
                lane[a.kind] = iv.end
                continue
            arrivals = [free]
            if a.kind == Kind.F and a.stage > 0:
                arrivals.append(ends[Kind.F, a.stage - 1, a.microbatch] + hop * (s.device_of(a.stage - 1) != d))
            if a.kind in (Kind.B, Kind.BW):
                arrivals.append(ends[(Kind.F, *key)])
                if a.stage + 1 < s.stages:
                    nxt = ends.get((Kind.B, a.stage + 1, a.microbatch), ends.get((Kind.BW, a.stage + 1, a.microbatch)))
                    arrivals.append(nxt + hop * (s.device_of(a.stage + 1) != d))
                if (Kind.RL, *key) in ends:
                    arrivals.append(ends[(Kind.RL, *key)])
            if a.kind == Kind.W:
                arrivals.append(ends[(Kind.B, *key)])
            assert iv.start == pytest.approx(max(arrivals))
            assert iv.end - iv.start == pytest.approx({Kind.F: c.f, Kind.B: c.b, Kind.W: c.w, Kind.BW: c.bw}[a.kind])
            free = iv.end


def _replay_peak(r: SimResult, device: int) -> float:
    """One device's peak from its timeline: every memory change at its time (ties in run order, a start before its
    end), written out per kind: F keeps its activations, OF gives back what it moved when its copy is done, RL takes
    it back when its copy starts, B and BW and W as without offloading."""
    s, cost = r.schedule, r.cost
    events = []
    for k, iv in enumerate(r.timeline[device]):
        a = iv.action
        c = cost.stage_cost(a.stage, s.stages, s.devices)
        start, end = {Kind.F: (c.held, 0.0), Kind.OF: (0.0, -c.offloaded), Kind.RL: (c.offloaded, 0.0),
                      Kind.B: (c.memory - c.held, c.held_w - c.memory), Kind.W: (0.0, -c.held_w),
                      Kind.BW: (c.memory - c.held, -c.memory)}[a.kind]
        events += [(iv.start, k, 0, start), (iv.end, k, 1, end)]
    level = peak = 0.0
    for *_, delta in sorted(events):
        level += delta
        peak = max(peak, level)
    assert level == pytest.approx(0.0)
    return peak


OFFLOAD_COSTS = st.builds(CostModel, f=st.sampled_from([0.5, 1.0, 2.0]), b=st.sampled_from([0.5, 1.0, 2.0]),
                          w=st.sampled_from([0.25, 1.0]), latency=st.sampled_from([0.0, 0.25]),
                          offload=st.sampled_from([0.0, 0.3, 1.0, 2.5]), offloadable=st.sampled_from([1.0, 0.6]),
                          recompute=st.sampled_from([0.0, 0.5]), memory_w=st.sampled_from([None, 0.5]))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "v-half", "kfkb"])
@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 10), share=st.sampled_from([0.3, 0.5, 1.0]), cost=OFFLOAD_COSTS)
def test_offloaded_timelines_and_peaks_follow_the_rules(name: str, p: int, m: int, share: float,
                                                       cost: CostModel) -> None:
    sched = build_or_refused(name, p, m)
    if sched is None:
        return
    r = offload_fraction(sched, share, cost).result
    _check(r)
    assert r.peak_memory == pytest.approx([_replay_peak(r, d) for d in range(p)])
    # The same rules timed event by event (the path that links over time and shared cores take).
    linked = simulate(r.schedule, dataclasses.replace(cost, latency=0.0, activation_bytes=1e6),
                      network=Network.constant(cost.latency))
    assert [t for row in linked.timeline for iv in row for t in (iv.start, iv.end)] == pytest.approx(
        [t for row in r.timeline for iv in row for t in (iv.start, iv.end)])


@given(p=st.integers(1, 6), m=st.integers(1, 12))
def test_free_copies_leave_each_device_one_microbatch_in_gpipe(p: int, m: int) -> None:
    """Closed form: GPipe with every activation offloaded by copies that take no time holds one microbatch's
    activations at a time (the one computing), against m without, and takes as long."""
    sched = build("gpipe", p, m)
    choice = offload_fraction(sched, 1.0, CostModel())
    assert choice.plain.peak_memory == pytest.approx([m] * p)
    assert choice.result.peak_memory == pytest.approx([1.0] * p)
    assert choice.result.makespan == pytest.approx(choice.plain.makespan)


@given(m=st.integers(1, 10), copy=st.sampled_from([0.5, 1.0, 1.5, 3.0]))
def test_copies_queue_on_their_lane(m: int, copy: float) -> None:
    """Closed form on one device: m forwards of 1 back to back; offload i starts at max(i + 1, the end of offload
    i - 1), so the last ends at 1 + m * copy when copies are slower than forwards, at m + copy otherwise."""
    r = simulate(with_offload(build("gpipe", 1, m)), CostModel(offload=copy))
    last = max(iv.end for iv in r.timeline[0] if iv.action.kind == Kind.OF)
    assert last == pytest.approx(1 + m * copy if copy >= 1 else m + copy)


def test_lifetimes_are_the_gaps_between_forward_and_backward() -> None:
    # 1F1B on 2 devices, 2 microbatches, unit passes (a fused backward takes 2). Device 1 runs F0 [1, 2], BW0 [2, 4],
    # F1 [4, 5], BW1 [5, 7]; device 0 F0 [0, 1], F1 [1, 2], then BW0 [4, 6] and BW1 [7, 9] as the gradients come.
    life = lifetimes(simulate(build("1f1b", 2, 2), CostModel()))
    assert life == {(1, 0): 0.0, (1, 1): 0.0, (0, 0): pytest.approx(3.0), (0, 1): pytest.approx(5.0)}


def _brute_force_fewest(sched: Schedule, budget: float, cost: CostModel) -> int:
    """The fewest offloaded (stage, microbatch)s, over every subset, that fit ``budget`` (reloads just before the
    backward, the transform's own placement)."""
    pairs = offloadable_pairs(sched)
    for k in range(len(pairs) + 1):
        for chosen in itertools.combinations(pairs, k):
            if max(simulate(with_offload(sched, chosen, ahead=0), cost).peak_memory) <= budget + 1e-9:
                return k
    return -1


@pytest.mark.parametrize(("name", "p", "m", "budget"), [("1f1b", 3, 4, 2.0), ("gpipe", 2, 4, 2.0), ("gpipe", 3, 3, 1.0),
                                                      ("zb-v", 2, 3, 1.5), ("1f1b", 2, 5, 1.0)])
def test_the_selective_choice_offloads_as_few_as_a_brute_force(name: str, p: int, m: int, budget: float) -> None:
    sched = build(name, p, m)
    cost = CostModel()  # copies that take no time: only which and how many decide the peak
    fewest = _brute_force_fewest(sched, budget, cost)
    assert fewest > 0  # the case needs offloading, and some choice fits
    got = choose_offload(sched, budget, cost)
    assert max(got.peaks()) <= budget + 1e-9
    assert len(got.pairs) == fewest


def test_half_offloaded_costs_nothing_where_copies_hide_in_the_lifetimes() -> None:
    # 1F1B, copies half a forward: the longer-lived half of the activations go at no cost and halve device 0's peak;
    # all of them cost time, as the last stage's backward follows its forward at once.
    sched, cost = build("1f1b", 4, 8), CostModel(offload=0.5)
    half, every = offload_fraction(sched, 0.5, cost), offload_fraction(sched, 1.0, cost)
    assert half.slowdown == pytest.approx(1.0) and half.peaks()[0] == pytest.approx(half.plain.peak_memory[0] / 2)
    assert every.slowdown > 1.1


def test_a_budget_nothing_meets_says_the_least_that_works() -> None:
    sched = build("zb-v", 4, 8)
    with pytest.raises(ConfigError, match=r"give a budget of at least ([0-9.]+)") as info:
        choose_offload(sched, 0.1, CostModel(offload=0.5))
    least = float(info.value.args[0].split("at least ")[1].split(",")[0])
    assert max(choose_offload(sched, least, CostModel(offload=0.5)).peaks()) <= least + 1e-9


def test_the_plan_with_offloading_is_the_fastest_family_that_fits() -> None:
    cost = CostModel(offload=0.5)
    points = plan_offload(4, 8, 2.0, cost)
    fitting = [pt for pt in points if pt.fits]
    assert fitting and all(max((pt.choice.result if pt.choice else pt.plain).peak_memory) <= 2.0 + 1e-9
                           for pt in fitting)
    assert fitting[0].makespan == min(pt.makespan for pt in fitting)
    assert all(not pt.fits for pt in points[len(fitting):])


# -------------------------------------------------------------------------------- the runtime, in one process


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Independent count: the distinct storages autograd saves running ``module`` on ``x`` (its own hooks, no
    pipefold), without the parameters', the input's and the output's; and the output's bytes."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    leaf = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(leaf)
    for t in (leaf, out):
        seen.pop(t.untyped_storage().data_ptr(), None)
    return sum(seen.values()), out.untyped_storage().nbytes()


@pytest.mark.parametrize("split", [True, False])
def test_an_offload_moves_what_autograd_saved_and_the_backward_is_unchanged(split: bool) -> None:
    from pipefold.runtime.activation_offload import HostCopies
    from pipefold.runtime.stage import StageRunner

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 16), torch.nn.Tanh())
    x, dy = torch.randn(8, 16), torch.randn(8, 16)
    want_bytes, _ = _saved_bytes(block, x)
    # The reference: plain autograd.
    leaf = x.clone().requires_grad_()
    block(leaf).backward(dy)
    want = [p.grad.clone() for p in block.parameters()] + [leaf.grad.clone()]
    block.zero_grad(set_to_none=True)

    runner = StageRunner(block, stage=1, split=split)
    copies = HostCopies(torch.device("cpu"))
    runner.forward(0, (x,))
    held = runner.meter.current
    moved = runner.offload(0, copies)
    assert moved == want_bytes and copies.host_bytes == moved
    assert runner.meter.current == held - moved  # the device copies died with their boxes
    runner.reload(0, copies)
    assert runner.meter.current == held
    if split:
        (dx,) = runner.backward_input(0, (dy,))
        runner.backward_weight(0)
    else:
        (dx,) = runner.backward(0, (dy,))
    got = [p.grad for p in block.parameters()] + [dx]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert copies.host_bytes == 0 and copies.peak_host_bytes == moved

"""Planning a measured model: shared-core timing, per-stage figures from per-layer ones, the search, the files,
and the whole path profile -> plan -> train --plan on real ranks."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import TIMING_TRIES, Servers
from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.ir import dependency_graph
from pipefold.plan.budget import (
    Layout,
    ModelPlan,
    ModelPoint,
    model_costs,
    plan_model,
    predict,
    read_plan,
    stage_profiles,
)
from pipefold.plan.profile import LayerProfile, Profile, fit_link, pass_fixed_of, stage_passes
from pipefold.plan.recompute import plan_recompute
from pipefold.sim.simulate import KINDS, CostModel, _shared_times, simulate
from pipefold.train.spec import RunSpec


def _profile(n: int = 8, *, contention: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0), microbatches: int = 8) -> Profile:
    """A made-up model: an embedding, n-2 equal blocks and a head, with figures of the size a small GPT has."""
    layers = [LayerProfile(f=1e-4, b=1e-5, w=2e-4, held=1000, held_w=500, params=40_000, out=8192)]
    layers += [LayerProfile(f=2e-3, b=3e-3, w=2e-3, held=200_000, held_w=150_000, params=100_000, out=8192)
               for _ in range(n - 2)]
    layers += [LayerProfile(f=1e-3, b=1e-3, w=5e-4, held=50_000, held_w=40_000, params=60_000, out=0)]
    return Profile(train={"model": "gpt", "layers": n - 2, "hidden": 32, "heads": 2, "seq": 16, "batch": 16,
                          "microbatches": microbatches, "optimizer": "adamw", "seed": 0},
                   layers=tuple(layers), latency=5e-5, bandwidth=2e9, contention=contention, optimizer_factor=2.0)


@functools.cache
def _free_plan() -> ModelPlan:
    """The plan of ``_profile(8)`` on 2 devices under a budget that every point fits: the search's answer that many
    tests read (a frozen object; each test makes its own files and dicts from it). Made once for the module: the
    search takes seconds of CPU, the same every time."""
    return plan_model(_profile(8), 2, 1e12)


# --------------------------------------------------------------------------- shared cores


@pytest.mark.parametrize("mesh", [1, (2, 1, 1, 4)])
@pytest.mark.parametrize("overhead", [0.0, 0.2])
@pytest.mark.parametrize("name", ["1f1b", "zb-v", "chimera", "dualpipe", "interleaved-1f1b", "v-half"])
def test_shared_timing_without_sharing_is_the_plain_timing(name: str, overhead: float,
                                                           mesh: int | tuple[int, ...]) -> None:
    # With a cost per message too: the plain traversal adds it as it times, the timing by events after the graph;
    # and with a mesh per device, each pair of devices its own crossing time.
    s = schedules.build(name, 4, 8)
    cost = CostModel(f=1.0, b=1.3, w=0.7, latency=0.1, grad_bytes=10, bandwidth=100, message_overhead=overhead,
                     activation_bytes=30, mesh=mesh)
    plain = simulate(s, cost)
    graph = dependency_graph(s)
    durations = [iv.end - iv.start for row in plain.timeline for iv in row]
    idle = frozenset(k for k, spec in KINDS.items() if not spec.computes)
    starts, ends = _shared_times(graph, durations, cost.link_times(4), idle, (1.0,) * 4)
    assert starts == pytest.approx([iv.start for row in plain.timeline for iv in row], abs=1e-9)
    assert ends == pytest.approx([iv.end for row in plain.timeline for iv in row], abs=1e-9)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1", "v-min"])
@pytest.mark.parametrize("p", [2, 4])
def test_one_shared_core_is_busy_until_all_work_is_done(name: str, p: int) -> None:
    # Closed form: with k devices at 1/k speed each, the one core does one unit of work per second whenever any
    # device computes; without transfer delays some device can always compute, so the step takes the total work.
    s = schedules.build(name, p, 2 * p)
    solo = simulate(s, CostModel(f=1.0, b=1.5, w=0.5))
    shared = simulate(s, CostModel(f=1.0, b=1.5, w=0.5, contention=tuple(float(k) for k in range(1, p + 1))))
    assert shared.makespan == pytest.approx(sum(solo.busy), rel=1e-9)
    # The runtime's work per message is work on the core too: the total grows by it once per message end.
    busy = simulate(s, CostModel(f=1.0, b=1.5, w=0.5, message_overhead=0.25, contention=shared.cost.contention))
    ends = int(dependency_graph(s).message_ends().sum())
    assert busy.makespan == pytest.approx(sum(solo.busy) + 0.25 * ends, rel=1e-9)


@pytest.mark.parametrize("scale", [1e4, 1e6, 1e9, 3.7e12])
@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_shared_timing_of_huge_times_ends_and_scales(name: str, scale: float) -> None:
    """Layers of hours or years: the event loop still ends (it spun forever from 1e4 s on: a rounding crumb of
    work never finished), and the step scales with the times, as a closed form says it must."""
    s = schedules.build(name, 4, 8)
    contention = (1.0, 1.7, 2.2, 2.9)
    unit = simulate(s, CostModel(f=1.0, b=1.5, w=0.5, contention=contention))
    huge = simulate(s, CostModel(f=scale, b=1.5 * scale, w=0.5 * scale, contention=contention))
    assert huge.makespan == pytest.approx(scale * unit.makespan, rel=1e-9)


def test_two_cores_for_four_devices_never_beat_half_the_work_nor_the_solo_timing() -> None:
    s = schedules.build("1f1b", 4, 8)
    solo = simulate(s, CostModel())
    shared = simulate(s, CostModel(contention=(1.0, 1.0, 1.5, 2.0)))
    assert shared.makespan >= max(solo.makespan, sum(solo.busy) / 2) - 1e-9
    assert shared.makespan <= sum(solo.busy)


def test_bad_contention_is_one_line() -> None:
    with pytest.raises(ConfigError, match="contention factors"):
        CostModel(contention=(1.0, -2.0))


# --------------------------------------------------------------------------- stage figures from layer figures


def test_stage_figures_are_sums_of_their_layers() -> None:
    prof = _profile(8)
    parts = [(0, 1, 2), (3, 4), (5, 6, 7)]
    rows = stage_profiles(prof, parts)
    for s, (part, row) in enumerate(zip(parts, rows, strict=True)):
        mine = [prof.layers[i] for i in part]
        sent = mine[-1].out if s < 2 else 0  # a stage that sends on keeps its output until its backward
        assert row.times == pytest.approx((sum(x.f for x in mine), sum(x.b for x in mine), sum(x.w for x in mine)))
        assert row.kept[0] == sum(x.held for x in mine) + sent
        assert row.static == sum(int(x.params * 4) for x in mine)  # weights, gradients, AdamW's two moments
        into = prof.layers[part[0] - 1].out if part[0] else 0
        for r in range(1, len(part) + 1):  # recomputing r layers keeps the stage's input and the later layers
            assert row.kept[r] == into + sum(x.held for x in mine[r:]) + sent
            assert row.rerun[r] == pytest.approx(sum(x.f for x in mine[:r]))
    assert [r.message for r in rows] == [8192, 8192, 0]


def test_a_fused_backward_costs_what_was_measured_for_it_not_b_plus_w() -> None:
    # Measured layers carry their own fused backward (a runtime's BW does less than its B and W); a stage's is the
    # sum of its layers', and a schedule that fuses its backward is simulated with it. Closed form: 1f1b with
    # equal stages and a free link lasts (m + p - 1) (F + BW); zb-h1, which splits it, keeps using B and W.
    layer = LayerProfile(f=2e-3, b=3e-3, w=2e-3, bw=3.5e-3, held=1000, held_w=800, params=1000, out=0)
    prof = dataclasses.replace(_profile(8), layers=(layer,) * 8, latency=0.0, bandwidth=1e30)
    parts = [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [r.fused_time for r in stage_profiles(prof, parts)] == pytest.approx([4 * 3.5e-3] * 2)
    m = prof.train["microbatches"]
    fused = simulate(schedules.build("1f1b", 2, m), model_costs(prof, schedules.build("1f1b", 2, m), parts))
    assert fused.makespan == pytest.approx((m + 1) * 4 * (2e-3 + 3.5e-3))
    split = schedules.build("zb-h1", 2, m)
    unfused = dataclasses.replace(prof, layers=(dataclasses.replace(layer, bw=None),) * 8)
    assert simulate(split, model_costs(prof, split, parts)).makespan == pytest.approx(
        simulate(split, model_costs(unfused, split, parts)).makespan)
    # A profile written before BW was measured reads as B + W.
    old = prof.to_dict()
    for row in old["layers"]:
        del row["bw"]
    assert [x.fused for x in Profile.from_dict(old).layers] == pytest.approx([5e-3] * 8)
    bad = prof.to_dict()
    bad["layers"][2]["bw"] = -1.0
    with pytest.raises(ConfigError, match=r"layer 2 \(tp 1\) has a negative"):
        Profile.from_dict(bad)


def test_a_stage_w_walks_the_graph_below_each_layer() -> None:
    # W restarts the autograd engine at each weight gradient, and the engine walks the whole graph below: a layer's
    # W in a stage is its own plus w_depth per node of the layers before it. Closed form for three layers.
    rows = [LayerProfile(f=1.0, b=1.0, w=w, held=0, held_w=0, params=0, out=0, nodes=n, w_depth=d)
            for w, n, d in ((0.5, 10, 0.0), (2.0, 40, 1e-3), (3.0, 7, 2e-3))]
    prof = dataclasses.replace(_profile(3), layers=tuple(rows))
    [stage] = stage_profiles(prof, [(0, 1, 2)])
    assert stage.times[2] == pytest.approx(0.5 + (2.0 + 1e-3 * 10) + (3.0 + 2e-3 * 50))
    assert [s.times[2] for s in stage_profiles(prof, [(0,), (1,), (2,)])] == pytest.approx([0.5, 2.0, 3.0])


def test_a_stage_pays_the_runners_fixed_work_once_per_pass() -> None:
    # Each layer's own timing includes the runner's fixed work per pass once; a stage of k layers pays it once, so
    # its F, B, W and BW are the sums less k - 1 of it, and never less than its slowest layer's.
    rows = [LayerProfile(f=f, b=2 * f, w=0.5 * f, bw=3 * f, held=0, held_w=0, params=0, out=0) for f in (1.0, 2.0, 3.0)]
    prof = dataclasses.replace(_profile(3), layers=tuple(rows), pass_fixed=(0.1, 0.2, 0.05, 0.3))
    [stage] = stage_profiles(prof, [(0, 1, 2)])
    assert stage.times == pytest.approx((6.0 - 2 * 0.1, 12.0 - 2 * 0.2, 3.0 - 2 * 0.05))
    assert stage.fused_time == pytest.approx(18.0 - 2 * 0.3)
    huge = dataclasses.replace(prof, pass_fixed=(5.0, 0.0, 9.0, 0.0))
    assert stage_profiles(huge, [(0, 1, 2)])[0].times[0::2] == (3.0, 1.5)
    assert stage_profiles(prof, [(1,)])[0].times == (2.0, 4.0, 1.0)  # one layer: nothing to take off


def test_the_fixed_work_is_what_stages_timed_whole_pay_less_than_their_layers() -> None:
    # The inverse of the stage's sum: stages whose layers' figures add to more than the stage took whole by
    # (n - 1) x fixed give back that fixed, W's depth term included; the median over stages, never below 0.
    rows = [LayerProfile(f=1.0, b=2.0, w=0.5, bw=3.0, held=0, held_w=0, params=0, out=0, nodes=10, w_depth=1e-3)
            for _ in range(5)]
    fixed = (0.1, 0.2, 0.05, 0.3)

    def whole(part: tuple[int, ...], fix: tuple[float, ...]) -> tuple[float, ...]:
        n = len(part)
        w = n * 0.5 + 1e-3 * 10 * sum(range(n))  # each W walks the nodes of the layers before it
        return tuple(a - (n - 1) * x for a, x in zip((n * 1.0, n * 2.0, w, n * 3.0), fix, strict=True))

    stages = [((0, 1, 2), whole((0, 1, 2), fixed)), ((3, 4), whole((3, 4), fixed))]
    assert pass_fixed_of(rows, stages) == pytest.approx(fixed)
    assert stage_passes([rows[i] for i in (0, 1, 2)], fixed) == pytest.approx(stages[0][1])
    # One stage paying more than its layers (noise): the median of three, and 0 where all of them do.
    odd = [*stages, ((0, 1), whole((0, 1), (-0.5,) * 4))]
    assert pass_fixed_of(rows, odd) == pytest.approx(fixed)
    assert pass_fixed_of(rows, [((0, 1), whole((0, 1), (-0.5,) * 4))]) == (0.0,) * 4
    assert pass_fixed_of(rows, [((2,), (1.0, 2.0, 0.5, 3.0))]) == (0.0,) * 4  # no stage of two layers


def test_the_fixed_work_is_measured_on_the_models_own_stages() -> None:
    """The MLP's 8 layers timed 4 at a time: one figure of fixed work per pass kind, none negative, kept by the
    profile's file. Whether it brings a stage's prediction nearer its timing is a measurement:
    ``benchmarks/fixed_work.py`` (benchmarks/results/fixed_work.md)."""
    from pipefold.models import make_model
    from pipefold.runtime.measure.profiling import measure_layers

    model = make_model("mlp", layers=8, hidden=128, batch=64)
    layers = model.build()
    x, y = model.batch_at(0)
    measured = measure_layers(layers, x, y, model.loss, repeats=3, stage_layers=4)
    assert len(measured.fixed) == 4 and all(math.isfinite(v) and v >= 0 for v in measured.fixed), measured.fixed
    assert len(measured.layers) == 8
    prof = dataclasses.replace(_profile(10), layers=tuple(measured.layers), pass_fixed=measured.fixed)
    assert Profile.from_dict(prof.to_dict()).pass_fixed == measured.fixed


def test_a_profiles_fixed_work_is_checked_and_an_older_files_read() -> None:
    data = dataclasses.replace(_profile(4), pass_fixed=(1e-5, 2e-5, 3e-5, 4e-5)).to_dict()
    assert Profile.from_dict(data).pass_fixed == (1e-5, 2e-5, 3e-5, 4e-5)
    data["pass_fixed"] = [1e-5, 2e-5, 4e-5]  # F, B and BW: a file from before W's was measured
    assert Profile.from_dict(data).pass_fixed == (1e-5, 2e-5, 0.0, 4e-5)
    data["pass_fixed"] = [0.1, -1.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="pass_fixed is F, B, W and BW seconds >= 0"):
        Profile.from_dict(data)
    data["pass_fixed"] = [0.1, 0.2]
    with pytest.raises(ConfigError, match="not a valid pipefold profile"):
        Profile.from_dict(data)


def test_layers_count_their_graph_and_time_what_the_graph_below_adds() -> None:
    import torch

    from pipefold.runtime.measure.profiling import _Below, _graph_nodes, measure_layers
    from pipefold.runtime.stage import Chain

    x = (torch.randn(4, 8),)
    # A Linear: its addmm, the weight's transpose and the two accumulators; views add one node each.
    assert _graph_nodes(torch.nn.Linear(8, 8), x) == 4
    assert _graph_nodes(Chain(_Below(100), torch.nn.Linear(8, 8)), x) == 104
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    prof = measure_layers(layers, x[0], torch.randn(4, 8), torch.nn.functional.mse_loss, repeats=2).layers
    assert [p.nodes for p in prof] == [4, 4, 4, 4]
    # A first layer is never below another; equal layers share one figure (the last, with the loss, is its own).
    assert prof[0].w_depth == 0 and prof[1].w_depth == prof[2].w_depth >= 0 and prof[3].w_depth >= 0


@pytest.mark.parametrize("stage_layers", [1, 2, 3, 5])
def test_layers_timed_among_their_stage_see_the_inputs_of_the_whole_model(stage_layers: int) -> None:
    # Every layer, in a stage of any size (one that does not divide the layers too), is fed what it is fed in the
    # whole model: its input and output against the model run as one chain by plain torch.
    import torch

    from pipefold.models import make_model
    from pipefold.runtime.measure.profiling import time_in_stages
    from pipefold.runtime.stage import Chain

    model = make_model("gpt", layers=3, hidden=32, heads=2, seq=8, batch=4)
    layers = model.build()
    x, y = model.batch_at(0)
    timed, stages = time_in_stages(layers, x, y, model.loss, stage_layers=stage_layers, repeats=2)
    assert len(timed) == len(layers)
    # Every stage of two layers or more timed whole too, in order.
    parts = [range(i, min(len(layers), i + stage_layers)) for i in range(0, len(layers), stage_layers)]
    assert [st.layers for st in stages] == [p for p in parts if len(p) > 1]
    assert all(st.f > 0 and st.b >= 0 and st.w > 0 and st.bw > 0 for st in stages)
    h = x
    with torch.no_grad():
        for i, (layer, t) in enumerate(zip(layers, timed, strict=True)):
            assert torch.equal(t.x[0], h), i
            if i < len(layers) - 1:
                h = Chain(layer)(h)
                assert torch.allclose(t.out[0], h, atol=1e-6), i
    assert all(t.f > 0 and t.b >= 0 and t.w > 0 and t.bw > 0 for t in timed)
    assert all(p.grad is None for layer in layers for p in layer.parameters())  # nothing left accumulated


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_stage_of_no_layers_is_refused(bad: object) -> None:
    import torch

    from pipefold.runtime.measure.profiling import time_in_stages

    with pytest.raises(ConfigError, match="stage_layers must be a positive integer"):
        time_in_stages([torch.nn.Linear(2, 2)], torch.randn(1, 2), stage_layers=bad)  # type: ignore[arg-type]


def test_stage_figures_from_layers_match_stages_measured_whole() -> None:
    # Independent of the composition: the recomputation planner's own measurement runs each whole stage with
    # r = 0..n recomputed layers on the runtime's stage runner and reads the meter.
    import torch

    from pipefold.models import make_model
    from pipefold.runtime.measure.profiling import measure_layers, measure_stages
    from pipefold.runtime.stage import Chain

    torch.manual_seed(0)
    model = make_model("gpt", layers=4, hidden=32, heads=2, seq=16, batch=8)
    layers = model.build()
    x, y = model.batch_at(0)
    sample, target = x.chunk(4)[0], y.chunk(4)[0]
    prof = dataclasses.replace(_profile(6), layers=tuple(measure_layers(layers, sample, target, model.loss,
                                                                        microbatches=4, repeats=1).layers))
    parts = [(0, 1, 2), (3, 4, 5)]
    whole = measure_stages([Chain(*(layers[i] for i in p)) for p in parts], sample, target, model.loss,
                           microbatches=4, repeats=1)
    composed = stage_profiles(prof, parts)
    assert composed[0].kept == whole[0].kept  # every r, to the byte
    assert composed[1].kept[:-1] == whole[1].kept[:-1]  # the last stage recomputing everything keeps a bit more
    assert composed[0].held_w[0] == whole[0].held_w[0] and composed[1].held_w[0] == whole[1].held_w[0]
    # While a fused backward runs, a stage holds what F kept and, unless it is the last, the gradient of its output
    # that the next stage sent back: to the byte, for a split with a middle stage too. (Once left out: at world 8
    # a stage holding only the embedding measured 8 to 12% above its predicted peak.)
    for split in (parts, [(0, 1), (2, 3, 4), (5,)]):
        whole = measure_stages([Chain(*(layers[i] for i in p)) for p in split], sample, target, model.loss,
                               microbatches=4, repeats=1)
        composed = stage_profiles(prof, split)
        assert [c.total[0] for c in composed] == [w.total_fused[0] for w in whole]
        assert [c.total[0] - c.kept[0] for c in composed] == [c.message for c in composed]
    # Both measured a fused backward apart from B and W, each stage and each layer.
    assert all(x.bw is not None and x.bw > 0 for x in prof.layers)
    assert all(w.fused_time is not None and w.fused_time > 0 for w in whole)


def test_a_device_holds_a_message_ahead_and_a_gradient_on_its_way_back() -> None:
    # Closed form over pp 3 and a V-shape: beside its stages, a device holds the largest message it receives
    # (posted one action ahead) and the largest gradient it sends back (kept until delivered); the first device
    # sends no gradient back, a stage beside its neighbour on the same device sends nothing.
    from pipefold.plan.recompute import StageProfile, _message_margin

    def stage(message: int) -> StageProfile:
        return StageProfile(1, (0, 0), (0, 0), (0, 0), (0.0, 0.0), (1.0, 1.0, 1.0), 0, message)

    m = [300, 500, 0]
    flat = schedules.build("1f1b", 3, 4)
    assert [_message_margin(flat, [stage(x) for x in m], d) for d in range(3)] == [300, 500 + 300, 500 + 500]
    v = schedules.build("zb-v", 2, 4)  # device 0 holds stages 0 and 3, device 1 stages 1 and 2
    sizes = [100, 200, 400, 0]
    assert [_message_margin(v, [stage(x) for x in sizes], d) for d in range(2)] == [400 + 400, 400 + 100]


def test_a_plans_activation_peak_is_what_each_rank_held() -> None:
    # End to end against the runtime's meter (every storage a rank keeps, by its own weak references): a plan's
    # predicted activation peak per device, over 4 steps of 1f1b on 3 ranks, is the most any step held, or one
    # message more where the gradient sent back was delivered before the next pass (it may not be: a step of 6
    # held it once on the last and a middle rank); the first rank, which sends no gradient back, to the byte.
    from pipefold.plan.budget import RunPlan
    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.measure.profiling import profile_model
    from pipefold.train.planned import from_plan
    from pipefold.train.prepare import make_job

    prof = profile_model(model="gpt", layers=4, hidden=32, heads=2, seq=16, batch=8, microbatches=4, devices=3,
                         repeats=1, link=False, contention=False)
    plan = RunPlan.from_dict(plan_model(prof, 3, 1e12, families=["1f1b"]).to_dict())
    planned = from_plan(plan, RunSpec.flat(steps=4))
    job = make_job(planned.spec, decided=planned.decided)
    reports = sorted(run_local(job), key=lambda r: r.rank)
    _, peaks, static = predict(prof, plan.layout, job.schedule, job.layer_stages, job.recompute)
    message = [prof.layers[part[-1]].out for part in job.layer_stages]
    for r in reports:
        predicted, held = peaks[r.device] - static[r.device], r.steps.peak_activation_bytes
        back = message[r.device - 1] if r.device > 0 else 0
        assert held <= predicted <= held + back, (r.rank, held, predicted, back)
        if r.device == 0:
            assert predicted == held


@pytest.mark.parametrize(("ranks", "layers", "runs_on"), [(4, 8, 4), (8, 6, 6), (1, 8, 2), (2, 4, 2)])
def test_the_runtime_overhead_is_measured_on_the_profiles_ranks(ranks: int, layers: int, runs_on: int) -> None:
    # As many ranks as the profile measured sharing the cores, as many as a run of the world will have: on 4 ranks
    # of 2 cores a message cost 5 times what it cost on 2 (benchmarks/results/profile.md). No more than the model's
    # layers.
    from pipefold.train.overhead import overhead_ranks

    assert overhead_ranks(_profile(layers, contention=(1.0,) * ranks)) == runs_on


def test_the_overhead_is_brought_back_to_one_ranks_load() -> None:
    """A real run on 3 ranks of this 2-core machine: each rank's work between passes per message, divided by the
    stretch of its passes (wall over CPU time, the operating system's count), which is at least 1."""
    import statistics

    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.measure.timeline import step_parts
    from pipefold.train.overhead import OVERHEAD_RUN, overhead_of
    from pipefold.train.prepare import make_job

    job = make_job(RunSpec.flat(model="mlp", layers=4, hidden=64, batch=16, microbatches=4, optimizer="sgd",
                                **{**OVERHEAD_RUN, "devices": 3}), local=True)
    reports = run_local(job)
    parts = step_parts(sorted(reports, key=lambda r: r.rank))
    # 1f1b's messages a step: the first and last ranks send or receive 2 a microbatch, the middle one 4.
    raw = statistics.fmean(max(0.0, p["runtime"]) / n for p, n in zip(parts, (2 * 4, 4 * 4, 2 * 4), strict=True))
    brought = overhead_of(job, reports)
    stretch = [max(1.0, p["compute"] / p["compute cpu"]) for p in parts]
    assert 0 < brought <= raw + 1e-12
    assert brought >= raw / max(stretch) - 1e-12


def test_the_runtime_overhead_is_measured_and_reaches_the_cost_model() -> None:
    # A real run of two ranks: the executor's own work between passes, per message, from its step parts; the
    # OS's CPU time of each rank covers its passes.
    from pipefold.runtime.executor import COMPUTE_KINDS
    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.measure.timeline import replayed_busy, replayed_step, step_parts
    from pipefold.train.overhead import OVERHEAD_RUN, overhead_of
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import profiled_settings

    sizes = {"model": "mlp", "layers": 4, "hidden": 32, "heads": None, "seq": 64, "batch": 8, "microbatches": 4,
             "optimizer": "sgd", "seed": 0}  # as a profile records them: every size, taken or not
    job = make_job(RunSpec.flat(**profiled_settings(sizes), **OVERHEAD_RUN), local=True)  # measure_overhead's run
    # The passes' wall time also holds the moments the rank waited for a core: alone it was within 10% of the CPU
    # time; beside the suite's other ranks on 2 cores it once came to 0.68 of it, and to 0.44 beside a benchmark's
    # 8 ranks. A run whose ranks waited that long is run again (TIMING_TRIES runs in all) rather than taken.
    for _ in range(TIMING_TRIES):
        reports = run_local(job)
        parts = step_parts(reports)
        if all(part["cpu"] >= 0.5 * part["compute"] for part in parts):
            break
    overhead = overhead_of(job, reports)
    assert 0 < overhead < 0.05
    for part in parts:  # medians of each part over the steps: they need not add up to the median step
        assert 0 < part["compute"] < part["step"] and part["runtime"] < part["step"]
        assert part["cpu"] >= 0.5 * part["compute"]
    # The same steps replayed with no runtime: every compute event lands on its action, no rank's passes outlast
    # the replayed step, and the replayed step is no longer than the real one (nothing in it waits but the
    # dependencies, on the same pass times).
    for i in reports[0].steps.kept():
        makespan, busy = replayed_step(job.schedule, reports, i)
        for r, b in zip(sorted(reports, key=lambda r: r.rank), busy, strict=True):
            assert b == pytest.approx(sum(e.end - e.start for e in r.steps[i].events if e.kind in COMPUTE_KINDS))
            assert 0 < b <= makespan
        assert makespan <= max(r.steps.wall[i] for r in reports)
    assert all(0 < x <= 1 for x in replayed_busy(job.schedule, reports))
    # 1f1b on 2 ranks: each rank's F and BW of every microbatch carry one message each; each rank's work is brought
    # back to one rank's load by its passes' stretch.
    assert overhead == pytest.approx(sum(max(0.0, p["runtime"]) / (2 * 4) / max(1.0, p["compute"] / p["compute cpu"])
                                         for p in parts) / 2)
    prof = dataclasses.replace(_profile(8), message_overhead=overhead)
    s = schedules.build("1f1b", 2, 8)
    assert model_costs(prof, s, [(0, 1, 2, 3), (4, 5, 6, 7)]).message_overhead == overhead
    assert Profile.from_dict(prof.to_dict()) == prof
    bad = prof.to_dict()
    bad["message_overhead"] = -1.0
    with pytest.raises(ConfigError, match="overhead per message must be seconds >= 0"):
        Profile.from_dict(bad)


def test_transfers_cost_the_measured_link() -> None:
    prof = _profile(8)
    s = schedules.build("1f1b", 2, 8)
    cost = model_costs(prof, s, [(0, 1, 2, 3), (4, 5, 6, 7)])
    assert cost.transfer_time == pytest.approx(5e-5 + 8192 / 2e9)


def test_link_fit_recovers_a_line() -> None:
    lat, bw = fit_link({n: 1e-4 + n / 3e9 for n in (4096, 65536, 1 << 20, 4 << 20)})
    assert lat == pytest.approx(1e-4)
    assert bw == pytest.approx(3e9)


@pytest.mark.parametrize(("size", "noise"), [(1 << 20, +1.0), (1 << 20, +0.3), (1 << 20, -0.3), (1 << 16, -0.3),
                                              (1 << 16, +1.0)])
def test_link_fit_keeps_the_latency_when_one_size_is_noisy(size: int, noise: float) -> None:
    """Noise on a large message is more time than the smallest's whole latency: a fit of absolute errors put the
    latency at 0 for the first case (what CI met over gloo: ``(0.0, 5e8)``) and at less than half the truth for
    the fourth. Each size's relative error counts alike, so the latency stays within 20% of the truth."""
    times = {n: 5e-5 + n / 5e8 for n in (4096, 1 << 16, 1 << 20)}
    times[size] *= 1 + noise
    lat, bw = fit_link(times)
    assert lat == pytest.approx(5e-5, rel=0.2)
    assert bw == pytest.approx(5e8, rel=0.4)  # the bandwidth follows the noisy size; the latency must not


def test_link_fit_of_a_time_that_does_not_grow_is_all_latency() -> None:
    assert fit_link({4096: 2e-4, 1 << 20: 1.9e-4}) == (pytest.approx(1.95e-4, rel=0.01), math.inf)


# --------------------------------------------------------------------------- the search


def test_plan_is_the_fastest_fitting_point_of_a_brute_force() -> None:
    prof = _profile(8)
    everything = _free_plan()
    budget = sorted(pt.memory for pt in everything.points)[len(everything.points) // 3]
    answer = plan_model(prof, 2, budget)
    # Brute force over the families, every contiguous split, and no recomputation.
    best = math.inf
    for name in {pt.name for pt in answer.points}:
        for options in {tuple(pt.options.items()) for pt in answer.points if pt.name == name}:
            s = schedules.build(name, 2, 8, **dict(options))
            for cuts in itertools.combinations(range(1, 8), s.stages - 1):
                bounds = [0, *cuts, 8]
                parts = [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
                result, peaks, _ = predict(prof, Layout(1, 1, 2), s, parts)
                if max(peaks) <= budget:
                    best = min(best, result.makespan)
    assert answer.best.memory <= budget
    # The planner tries two splits per schedule (time-balanced, memory-aware) and recomputation: never worse than
    # 10% off the best contiguous split without recomputation, and usually equal.
    assert answer.best.makespan <= best * 1.10 + 1e-12


def test_plan_prediction_matches_predict() -> None:
    prof = _profile(8)
    answer = _free_plan()
    s = schedules.build(answer.best.name, 2, 8, **answer.best.options)
    result, peaks, static = predict(prof, Layout(1, 1, 2), s, answer.best.layer_stages, answer.best.recompute)
    assert result.makespan == pytest.approx(answer.best.makespan)
    assert peaks == [int(x) for x in answer.best.peak_memory]
    assert static == list(answer.best.static_bytes)


def test_a_tight_budget_recomputes_and_fits() -> None:
    prof = _profile(10)
    free = plan_model(prof, 2, 1e12, families=["1f1b"])
    rows = stage_profiles(prof, free.best.layer_stages)
    s = schedules.build("1f1b", 2, 8)
    least = max(plan_recompute(s, rows, "full").peak)
    budget = (least + max(free.best.peak_memory)) / 2
    tight = plan_model(prof, 2, budget, families=["1f1b"])
    assert tight.best.memory <= budget < free.best.memory
    assert sum(tight.best.recompute) > 0
    assert tight.best.makespan >= free.best.makespan


def test_a_budget_nothing_fits_is_one_line() -> None:
    with pytest.raises(ConfigError, match="no plan fits .* the smallest predicted peak is"):
        plan_model(_profile(8), 2, 1000.0)


def test_other_microbatches_than_profiled_are_refused() -> None:
    with pytest.raises(ConfigError, match="profile again with --microbatches 4"):
        plan_model(_profile(8), 2, 1e12, microbatches=4)


def test_frontier_is_monotone_and_holds_the_best() -> None:
    answer = _free_plan()
    mems = [pt.memory for pt in answer.frontier]
    times = [pt.makespan for pt in answer.frontier]
    assert mems == sorted(mems) and times == sorted(times, reverse=True)
    assert answer.best in answer.frontier
    assert all(isinstance(pt, ModelPoint) for pt in answer.points)


# --------------------------------------------------------------------------- files


def test_profile_round_trip(tmp_path) -> None:
    prof = _profile(6)
    path = tmp_path / "p.json"
    prof.save(str(path))
    assert Profile.load(str(path)) == prof
    # With FSDP's measured gather and reduce-scatter (a profile from before has none: half an all-reduce each).
    fitted = dataclasses.replace(prof, fsdp={2: ((2e-4, 4e8), (5e-4, 2e8)), 4: ((3e-4, 3e8), (7e-4, 1e30))})
    fitted.save(str(path))
    assert Profile.load(str(path)) == fitted
    for bad in ({"1": [[0.0, 1e8], [0.0, 1e8]]}, {"2": [[-1.0, 1e8], [0.0, 1e8]]}, {"2": [[0.0, 1e8], [0.0, 0.0]]}):
        with pytest.raises(ConfigError, match="an FSDP fit is a group of >= 2 ranks"):
            Profile.from_dict({**fitted.to_dict(), "fsdp": bad})


@pytest.mark.parametrize("text,match", [("{", "is not JSON"), ('{"version": 9}', "not a pipefold profile"),
                                        ('{"version": 1, "layers": 3}', "not a valid pipefold profile")])
def test_bad_profiles_are_one_line(tmp_path, text: str, match: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        Profile.load(str(path))


def test_negative_figures_are_refused() -> None:
    data = _profile(4).to_dict()
    data["layers"][1]["f"] = -1.0
    with pytest.raises(ConfigError, match=r"layer 1 \(tp 1\) has a negative"):
        Profile.from_dict(data)


def test_plan_file_round_trip_and_checks(tmp_path) -> None:
    answer = _free_plan()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(answer.to_dict()))
    data = read_plan(str(path))
    assert data["schedule"] == answer.best.spec
    data["layer_stages"] = [[0, 2], [1, 3, 4, 5, 6, 7]]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="contiguous"):
        read_plan(str(path))
    path.write_text('{"kind": "something else"}')
    with pytest.raises(ConfigError, match="not a pipefold plan"):
        read_plan(str(path))


@pytest.mark.parametrize(("change", "message"), [
    ({"heads": None}, None),  # an MLP's plan: sizes the model takes as its defaults are null
    ({"heads": None, "hidden": None, "layers": None}, None),
    ({"model": "resnet"}, "names the model 'resnet', which this pipefold does not know"),
    ({"batch": None}, "not a valid pipefold plan (TypeError"),
    ({"seq": "long"}, "not a valid pipefold plan (ValueError"),
    ({"layers": [4]}, "not a valid pipefold plan (TypeError"),
])
def test_plan_file_train_section_checked_whole(tmp_path, change: dict[str, object], message: str | None) -> None:
    data = _free_plan().to_dict()
    data["train"] = {**data["train"], **change}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    if message is None:
        assert read_plan(str(path))["train"] == data["train"]
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
        read_plan(str(path))
    assert "\n" not in str(info.value)


def test_plan_file_stages_checked_against_its_schedule(tmp_path) -> None:
    data = _free_plan().to_dict()
    data["schedule"], data["devices"] = "zb-v", 2  # 4 stages, and the plan splits the layers into 2
    data["layer_stages"], data["recompute"] = [[0, 1, 2, 3], [4, 5, 6, 7]], [0, 0]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="zb-v on 2 devices has 4 stages but the plan splits the layers into 2"):
        read_plan(str(path))


def test_profile_dataclass_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _profile(4).latency = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------- the whole path, on real ranks


@pytest.fixture
def cli(servers: Servers) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli(*ARGS, cwd=...)``: ``pipefold ARGS`` in ``cwd``, its exit code, output and the files it writes, as a shell
    would give them, from the worker's command server (conftest.Server: the entry point's own function, with torch
    imported and the ranks' fork server started once for the session rather than again for each command of a flow)."""
    return lambda *args, cwd: servers.get().run(list(args), cwd)


def test_profile_plan_train_runs_the_plan_with_exact_gradients_and_its_predicted_memory(tmp_path, cli) -> None:
    got = cli("profile", "--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32",
              "--batch", "8", "-m", "4", "-p", "2", "--repeats", "2", "--no-sharing", "-o", "prof.json",
              cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    prof = Profile.load(str(tmp_path / "prof.json"))
    assert len(prof.layers) == 4 and prof.bandwidth > 0 and prof.latency >= 0
    got = cli("plan", "--profile", "prof.json", "-p", "2", "--memory-budget", "1GB", "--families", "1f1b,zb-h1",
              "-o", "plan.json", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    got = cli("train", "--plan", "plan.json", "--steps", "2", "--check", "--json", "--plot", "run.png", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    assert out["plot"] == "run.png" and (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["max_grad_rel_diff"] < 1e-5
    pred, meas = out["plan"]["predicted"], out["plan"]["measured"]
    for p, m in zip(pred["peak_bytes"], meas["peak_bytes"], strict=True):
        assert m == pytest.approx(p, rel=0.10)
    # The step next to the measured one is the profile's prediction, said as such (it was labelled as the run's own
    # costs replayed); those are given apart.
    assert out["predicted_from"] == "predicted from the profile"
    assert out["predicted_step_s"] == pred["step_time_s"] and out["plan"]["replayed_step_time_s"] > 0
    # The step measured is the schedule and the update after it (check, AdamW's step), as the prediction has it.
    assert all((x.update > 0) == (x.params > 0) for x in prof.layers)
    assert meas["step_time_s"] > meas["schedule_time_s"] > 0
    # The passes' CPU time lies within their wall time; the plan's passes, each rank on its own cores, are the
    # profile's stage sums (no --no-sharing figure: two ranks, each with a core, share nothing).
    passes = out["plan"]["passes_s"]
    assert 0 < passes["cpu"] <= passes["wall"] + 1e-6
    assert passes["alone"] > 0 and passes["alone"] == pytest.approx(passes["shared"])
    got = cli("train", "--plan", "plan.json", "--hidden", "48", cwd=tmp_path)
    assert got.returncode == 2 and "--plan fixes" in got.stderr and "Traceback" not in got.stderr
    # With model-state chunks: a budget between the least the plain plans reach and the least with the whole state
    # in host memory. The plan has chunks, and its run the same gradients and the predicted peaks.
    from pipefold.plan.budget import predict

    wide = plan_model(prof, 2, 1e12, families=["1f1b", "zb-h1"], chunks=True)
    plain = min(p.memory for p in wide.points if not p.layout.chunks)
    least = min(max(predict(prof, p.layout, p.spec, p.layer_stages, p.recompute, room=0)[1])
                for p in wide.points if p.layout.chunks)
    budget = int(1.05 * (plain + least) / 2)
    got = cli("plan", "--profile", "prof.json", "-p", "2", "--memory-budget", str(budget), "--families", "1f1b,zb-h1",
              "--state-chunks", "-o", "chunks.json", cwd=tmp_path)
    assert got.returncode == 0 and "the optimizer state in chunks" in got.stdout, got.stderr
    assert json.loads((tmp_path / "chunks.json").read_text())["state_chunks"] is True
    got = cli("train", "--plan", "chunks.json", "--steps", "2", "--check", "--json", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    assert out["max_grad_rel_diff"] < 1e-5 and "state_chunks" in out
    pred, meas = out["plan"]["predicted"], out["plan"]["measured"]
    for p, m in zip(pred["peak_bytes"], meas["peak_bytes"], strict=True):
        assert m == pytest.approx(p, rel=0.10) and p <= budget / 1.05


def test_a_layers_update_is_timed_on_the_runs_optimizer_and_leaves_it_as_it_was() -> None:
    """What the step after the schedule spends on a layer, timed after its passes: AdamW's step reads and writes
    four tensors per parameter where SGD's reads two, so it takes longer (an ordering no timing noise of this size
    reverses); the weights are left as they were, a layer without parameters costs nothing, and no optimizer
    times nothing."""
    import torch
    from torch import nn

    from pipefold.runtime.measure.profiling import time_in_stages

    torch.manual_seed(0)
    layers = [nn.Linear(512, 512), nn.ReLU()]
    weights = [p.detach().clone() for p in layers[0].parameters()]
    x = torch.randn(8, 512)

    def update(optimizer: str | None) -> list[float]:
        runs = [time_in_stages(layers, x, stage_layers=2, repeats=5, optimizer=optimizer)[0] for _ in range(3)]
        return [min(run[i].update for run in runs) for i in range(2)]

    (adamw, none_a), (sgd, none_s) = update("adamw"), update("sgd")
    assert 0 < sgd < adamw, (sgd, adamw)
    assert none_a == none_s == 0.0 and update(None) == [0.0, 0.0]
    assert all(torch.equal(p, w) for p, w in zip(layers[0].parameters(), weights, strict=True))
    assert all(p.grad is None for p in layers[0].parameters())


def test_the_readme_flow_with_an_mlp_profiled_without_heads(tmp_path, cli) -> None:
    """The MLP has no heads: its profile's and plan's ``heads`` are null, and the plan still trains. Profiled with
    core sharing on 3 devices, so the link is measured with a third process computing beside it (its helper); quick,
    which says so in the profile and still measures every figure a plan reads."""
    got = cli("profile", "--model", "mlp", "--layers", "4", "--hidden", "32", "--batch", "16", "-m", "4", "-p", "3",
              "--repeats", "2", "--quick", "-o", "prof.json", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    prof = Profile.load(str(tmp_path / "prof.json"))
    assert len(prof.contention) == 3 and prof.machine["quick"] is True
    assert prof.latency >= 0 and 0 < prof.bandwidth < math.inf and prof.message_overhead > 0  # latency: floored
    assert min(prof.contention) >= 1 and set(prof.allreduce) == {3} and set(prof.zero1) == {3}
    got = cli("plan", "--profile", "prof.json", "-p", "3", "--memory-budget", "50MiB", "-o", "plan.json",
              cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["train"]["heads"] is None
    got = cli("train", "--plan", "plan.json", "--steps", "2", "--check", "--json", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["max_grad_rel_diff"] < 1e-5


@pytest.mark.parametrize(("args", "message"), [
    (["train", "--schedule", "auto"], "--schedule auto plans for --memory-budget"),
    (["train", "--schedule", "auto", "--memory-budget", "1GB", "--recompute", "full"], "drop --recompute"),
    (["plan", "-p", "2"], "plan needs --memory BUDGET"),
    (["plan", "-p", "2", "--memory", "3", "--memory-budget", "1GB"], "--memory-budget belongs to plan --profile"),
    (["plan", "--profile", "missing.json", "--memory-budget", "1GB"], "cannot read profile missing.json"),
    (["train", "--plan", "missing.json"], "cannot read plan missing.json"),
    (["profile", "--layers", "0"], "--layers: 0 is out of range: give a whole number >= 1"),
])
def test_planning_mistakes_are_one_line(tmp_path, cli, args: list[str], message: str) -> None:
    got = cli(*args, cwd=tmp_path)
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_ctrl_c_anywhere_in_profile_is_one_line(tmp_path) -> None:
    """SIGINT at moments spread over a profile (measuring layers, starting the link's and the sharing's helper
    processes, waiting on them) stops it with one line and code 130, or it had finished: never a traceback, from
    it or from a helper process left behind. The moments count from when pipefold's code holds the signals (not
    from the launch: however long the interpreter's start-up takes), and the profiles run side by side."""
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    argv = ["profile", "--model", "gpt", "--layers", "4", "--hidden", "64", "--seq", "64", "--batch", "16",
            "-m", "4", "-p", "2", "-o", "p.json"]

    def interrupted(delay: float) -> tuple[float, int, str]:
        folder = tmp_path / str(delay)
        folder.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "pipefold", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=folder, start_new_session=True)
        _wait_until_it_catches_sigterm(proc)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)  # to every process of the group, as a terminal sends it
        _, err = proc.communicate(timeout=120)
        time.sleep(0.5)  # a helper left behind would print after its parent exited
        return delay, proc.returncode, err

    delays = (0.5, 1.5, 3.0, 5.0, 8.0)
    with ThreadPoolExecutor(len(delays)) as pool:
        runs = list(pool.map(interrupted, delays))
    for delay, code, err in runs:
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, (delay, err)
        # 130, or ended by the SIGINT itself as the interpreter exits (-2 here; 130 to a shell, all the same to it).
        assert code in (0, 130, -signal.SIGINT), (delay, code, err)
        if code != 0:
            assert err.strip() == "pipefold profile: interrupted (SIGINT)"
    assert any(code != 0 for _, code, _ in runs)


@pytest.mark.parametrize(("predicted", "measured", "replayed", "says"), [
    (0.0806, 0.1337, 0.0850, "so the rest is time between passes, 2.03 ms per action"),  # the runtime's own work
    (0.3267, 0.6777, 0.6500, "so the passes themselves took longer"),  # slower passes, replayed they match
    (0.100, 0.200, 0.400, "so the passes themselves took longer"),  # the replay slower still: no overlap it saw
    (0.100, 0.200, 0.0, "so the rest is time between passes, 8.33 ms per action"),  # nothing measured to replay
    (0.100, 0.126, 0.126, "1.26x"),
    (0.100, 0.060, 0.060, "0.60x"),
    (0.100, 0.124, 0.300, None),
    (0.100, 0.080, 0.300, None),
])
def test_a_far_prediction_is_pointed_out_with_its_likely_cause(predicted: float, measured: float, replayed: float,
                                                               says: str | None) -> None:
    # Which cause is named depends on the run's own pass times replayed by the simulator: close to the measured
    # step, the passes were slow; far below it, the time went between the passes.
    from pipefold.train.summary import prediction_note

    note = prediction_note(predicted, measured, 24, replayed=replayed)
    if says is None:
        assert note is None
        return
    assert note is not None and says in note and "\n" not in note
    assert f"{measured / predicted:.2f}x the plan's prediction" in note
    if measured > predicted:
        assert f"replay to {replayed * 1e3:.1f} ms" in note
        between = replayed < 0.75 * measured
        assert ("time between passes" in note) == between and ("passes themselves" in note) == (not between)


@pytest.mark.parametrize(("cpu", "wall", "shared", "says"), [
    (0.50, 0.55, 0.30, "the passes used 1.67x the CPU time the profile gives them (the machine is slower"),
    (0.30, 0.66, 0.36, "the passes used 1.00x the CPU time the profile gives them, and took 2.20x their CPU time, "
                       "waiting for a core, where the plan expected 1.20x"),
])
def test_a_far_prediction_says_whether_the_passes_did_more_work_or_waited_for_cores(
        cpu: float, wall: float, shared: float, says: str) -> None:
    from pipefold.train.summary import Passes, prediction_note

    note = prediction_note(0.3267, 0.6777, 24, replayed=0.65, passes=Passes(cpu, wall, alone=0.30, shared=shared))
    assert note is not None and says in note and "\n" not in note
    faster = prediction_note(0.2, 0.1, 24, replayed=0.1, passes=Passes(0.15, 0.15, alone=0.30, shared=0.30))
    assert faster is not None and "the passes used 0.50x the CPU time the profile gives them" in faster


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "gpipe"])
def test_the_plans_passes_are_the_stage_sums_alone_and_longer_where_ranks_share_cores(name: str) -> None:
    """Each rank on its own cores, a device's passes are its stages' F, B and W (or fused BW) times the microbatches,
    from the profile's stage sums; the runtime's work per message is left out; with the cores shared (two ranks
    computing at once run twice as long) they take longer, never more than twice as long."""
    import dataclasses

    from pipefold.plan.budget import Layout, predicted_passes, stage_profiles

    profile = dataclasses.replace(_profile(8, contention=(1.0, 2.0)), message_overhead=3e-4)
    split = [[0, 1, 2, 3], [4, 5, 6, 7]]
    schedule = schedules.build(name, 2, 8)
    alone, shared = predicted_passes(profile, Layout(1, 1, 2), schedule, split)
    for d, row in enumerate(stage_profiles(profile, split)):
        kinds = {a.kind for a in schedule.actions[d]}
        f, b, w = row.times
        fused = "BW" in kinds and row.fused_time is not None
        per = f + (row.fused_time if fused else b + w)
        assert alone[d] == pytest.approx(8 * per)
        assert alone[d] < shared[d] <= 2 * alone[d] + 1e-12


@pytest.mark.parametrize("layers", [3, 9])
def test_a_plan_whose_layers_are_not_its_models_is_refused(tmp_path, layers: int) -> None:
    """The profile says 8 layers (a GPT of 6 blocks); a plan edited to say other blocks is refused before any rank
    starts, naming both counts."""
    from pipefold.plan.budget import RunPlan
    from pipefold.train.planned import from_plan

    data = _free_plan().to_dict()
    data["train"] = {**data["train"], "layers": layers}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=f"the plan splits 8 layers but its model .* has {layers + 2}"):
        from_plan(RunPlan.from_dict(read_plan(str(path))))


def test_an_mlp_plan_with_the_sizes_it_does_not_take_resolves() -> None:
    """A profile records every size it was given: an MLP's, heads and a sequence length it does not take. The
    plan's run leaves them out rather than refusing them (as train refuses them given by hand)."""
    from pipefold.plan.budget import RunPlan
    from pipefold.train.planned import from_plan

    data = _free_plan().to_dict()
    data["train"] = {**data["train"], "model": "mlp", "layers": 8, "hidden": 16, "heads": 4, "seq": 32}
    planned = from_plan(RunPlan.from_dict(data))
    model = planned.spec.model
    assert (model.name, model.layers, model.hidden, model.heads, model.seq) == ("mlp", 8, 16, None, 64)
    assert planned.decided[0] == tuple(map(tuple, data["layer_stages"]))


def _wait_until_it_catches_sigterm(proc: subprocess.Popen[str]) -> None:
    """Until the process catches SIGTERM, which the interpreter leaves to the system: from then on, pipefold's own
    code holds the signals (Linux's /proc tells which signals a process catches)."""
    import signal
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{proc.pid}/status").read_text()
            caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
            if caught >> (signal.SIGTERM - 1) & 1:
                return
        time.sleep(0.002)
    raise AssertionError(f"pipefold never came to catch SIGTERM (exit code {proc.poll()})")


@pytest.mark.parametrize("command", [["profile", "--model", "gpt", "--layers", "4", "--hidden", "64", "--seq", "64",
                                      "--batch", "16", "-m", "4", "-p", "2", "-o", "p.json"],
                                     ["train", "--model", "mlp", "--steps", "2"], ["simulate", "zb-v"],
                                     ["bagpipe", "--steps", "3000", "--rows", "2000"]])
def test_ctrl_c_during_the_commands_start_up_is_one_line(command: list[str], tmp_path) -> None:
    """SIGINT while the command still imports (the package, the command's modules, torch for the commands that use
    it): held until the imports are done, then one line and code 130, never an import's traceback or an abort from
    inside torch's own import (which a signal raised there causes). Counted from the moment pipefold's first module
    holds the signals: before it, in the interpreter's own start-up (however long a slow machine takes over it), a
    signal is Python's to report."""
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    def interrupted(delay: float) -> tuple[float, int, str]:
        folder = tmp_path / str(delay)
        folder.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "pipefold", *command], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=folder, start_new_session=True)
        _wait_until_it_catches_sigterm(proc)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)  # to every process of the group, as a terminal sends it
        _, err = proc.communicate(timeout=120)
        return delay, proc.returncode, err

    # Later too, for the commands that start ranks or helpers: while their fork server imports torch. The
    # commands run side by side, each interrupted at its own moment after its own start-up.
    delays = (0.0, 0.1, 0.3, 0.8, *((1.8, 2.8) if command[0] != "simulate" else ()))
    with ThreadPoolExecutor(len(delays)) as pool:
        runs = list(pool.map(interrupted, delays))
    for delay, code, err in runs:
        lines = [line for line in err.strip().splitlines() if not line.startswith("step ")]  # a step's progress
        assert code in (0, 130) and len(lines) <= 1 and "Traceback" not in err, (delay, err)
        if code == 130:
            assert re.fullmatch(rf"pipefold {command[0]}: interrupted \(SIGINT\)(; stopped \d ranks)?", lines[0]), err
    assert any(code == 130 for _, code, _ in runs)  # the early ones, at least, were interrupted


def test_a_quick_profile_runs_fewer_rounds_of_every_measurement_between_processes() -> None:
    from pipefold.runtime.measure.profiling import FULL, QUICK
    from pipefold.train.overhead import OVERHEAD_RUN, QUICK_STEPS

    for field in dataclasses.fields(QUICK):
        assert 0 < getattr(QUICK, field.name) < getattr(FULL, field.name), field.name
    assert 1 < QUICK_STEPS < OVERHEAD_RUN["steps"]  # the first step is left out: two at least

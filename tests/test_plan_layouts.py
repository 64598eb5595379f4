"""Planning a world of ranks: every dp x tp x pp layout, the profile at each tensor-parallel degree, the plan run."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Any

import pytest

from conftest import TIMING_TRIES
from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.plan.budget import (
    Layout,
    RunPlan,
    every_layout,
    layout_profile,
    plan_model,
    predict,
    read_plan,
)
from pipefold.plan.profile import TIMES, LayerProfile, Profile
from pipefold.plan.shares import shares


def _profile(n: int = 6, microbatches: int = 8, contention: tuple[float, ...] = (1.0,) * 8) -> Profile:
    """A made-up model at tp 1 and tp 2: an embedding, n-2 blocks and a head. At tp 2 a block computes a little more
    than half (its all-reduces), holds a little more than half and keeps 55% of its weights; the embedding and head
    stay whole."""
    def block(t: int) -> LayerProfile:
        share = 1 / t + (0.1 if t > 1 else 0.0)
        return LayerProfile(f=2e-3 * share, b=3e-3 * share, w=2e-3 / t, held=int(200_000 * share),
                            held_w=int(150_000 * share), params=int(400_000 * (0.55 if t > 1 else 1)), out=8192)

    def layers(t: int) -> tuple[LayerProfile, ...]:
        return (LayerProfile(f=1e-4, b=1e-5, w=2e-4, held=1000, held_w=500, params=40_000, out=8192),
                *(block(t) for _ in range(n - 2)),
                LayerProfile(f=1e-3, b=1e-3, w=5e-4, held=50_000, held_w=40_000, params=60_000, out=0))

    return Profile(train={"model": "gpt", "layers": n - 2, "hidden": 32, "heads": 2, "seq": 16, "batch": 16,
                          "microbatches": microbatches, "optimizer": "adamw", "seed": 0},
                   layers=layers(1), latency=5e-5, bandwidth=2e9, contention=contention, optimizer_factor=2.0,
                   tp_layers={2: layers(2)})


def test_every_layout_is_every_factorisation_the_profile_can_predict() -> None:
    # Brute force: every (dp, tp, pp) with dp * tp * pp = world, tp a measured degree, dp sharing the microbatches,
    # pp at most the 6 layers (a stage a device at least); each with copies also with FSDP, and with ZeRO-1 where
    # the optimizer has a state to shard (AdamW, not SGD).
    for world, m, factor in itertools.product((1, 2, 4, 6, 8), (2, 4, 8), (2.0, 0.0)):
        prof = dataclasses.replace(_profile(microbatches=m), optimizer_factor=factor)
        hows = [how for how in ("none", "zero1", "fsdp") if how != "zero1" or factor > 0]
        want = {Layout(dp, tp, pp, how) for dp, tp, pp in itertools.product(range(1, 9), repeat=3)
                for how in hows if dp * tp * pp == world and tp in (1, 2) and m % dp == 0 and pp <= 6
                and (how == "none" or dp > 1)}
        # And a mesh per device: c devices of tp 2 and pp - c of tp 1, in every order, dp (pp + c) ranks in all.
        want |= {Layout(dp, order, pp, how) for dp, pp in itertools.product(range(1, 7), repeat=2)
                 for c in range(1, pp) for order in set(itertools.permutations((2,) * c + (1,) * (pp - c)))
                 for how in hows if dp * (pp + c) == world and m % dp == 0 and (how == "none" or dp > 1)}
        got = every_layout(prof, world)
        assert set(got) == want and len(got) == len(want)
    with pytest.raises(ConfigError, match="among dp >= 2 copies"):
        Layout(1, 1, 2, "zero1")
    only_tp2 = dataclasses.replace(_profile().at_tp(2), tp_layers={})
    with pytest.raises(ConfigError, match="no layout of 3 ranks"):
        every_layout(only_tp2, 3)


def test_a_layouts_devices_share_the_machine_as_all_its_ranks_do() -> None:
    # k devices of a pipeline computing at once are k * dp * tp ranks; the tp profile's times already had tp of them.
    c = (1.0, 1.2, 1.9, 2.6, 3.3, 4.0, 4.7, 5.4)
    prof = _profile(contention=c)
    assert layout_profile(prof, Layout(1, 1, 4)).contention == pytest.approx(c[:4])
    assert layout_profile(prof, Layout(2, 1, 2)).contention == pytest.approx([c[1], c[3]])
    assert layout_profile(prof, Layout(1, 2, 2)).contention == pytest.approx([c[1] / c[1], c[3] / c[1]])
    assert layout_profile(prof, Layout(2, 2, 2)).contention == pytest.approx([c[3] / c[1], c[7] / c[1]])
    # Beyond the measured table: in proportion to the ranks, as the simulator extends it.
    assert layout_profile(prof, Layout(4, 2, 2)).contention == pytest.approx([c[7] / c[1], c[7] * 2 / c[1]])
    assert layout_profile(prof, Layout(1, 2, 2)).layers == prof.tp_layers[2]
    # tp layers timed with 8 ranks computing at once (4 groups of 2 side by side): fewer computing run faster.
    crowded = dataclasses.replace(prof, tp_ranks={2: 8})
    assert layout_profile(crowded, Layout(1, 2, 2)).contention == pytest.approx([c[1] / c[7], c[3] / c[7]])
    assert layout_profile(crowded, Layout(2, 2, 2)).contention == pytest.approx([c[3] / c[7], 1.0])
    assert layout_profile(crowded, Layout(2, 1, 2)).contention == pytest.approx([c[1], c[3]])  # tp 1: alone
    with pytest.raises(ConfigError, match="profile again with --tp 1,2,4"):
        layout_profile(prof, Layout(1, 4, 1))
    # A mesh per device: 4 ranks over 3 devices, 4/3 a device, so k devices computing are ceil(4k/3) ranks; each
    # layer has its device's degree's figures, a tp-1 layer's times taken to the tp-2 layers' 2 ranks measuring.
    mixed = Layout(1, (2, 1, 1), 3)
    parts = [(0, 1), (2, 3), (4, 5)]
    seen = layout_profile(prof, mixed, parts, (0, 1, 2))
    assert seen.contention == pytest.approx([c[1] / c[1], c[2] / c[1], c[3] / c[1]])
    for i, x in enumerate(seen.layers):
        want = prof.tp_layers[2][i] if i < 2 else prof.layers[i]
        scale = 1.0 if i < 2 else c[1] / c[0]
        assert (x.f, x.b, x.w, x.params, x.held) == pytest.approx(
            (want.f * scale, want.b * scale, want.w * scale, want.params, want.held)), i
    with pytest.raises(ConfigError, match="say which layers each holds"):
        layout_profile(prof, mixed)
    for bad in ((2, 1), (2, 0, 1), (2, True, 1)):
        with pytest.raises(ConfigError, match="one tensor-parallel degree >= 1 per pipeline device"):
            Layout(1, bad, 3)  # type: ignore[arg-type]
    assert Layout(1, (2, 2, 2), 3) == Layout(1, 2, 3) and str(Layout(2, (1, 2), 2, "fsdp")) == "dp2 tp1,2 pp2 fsdp"


def test_a_layer_taken_to_another_sharing_keeps_every_time_in_step() -> None:
    """Every field of a layer that is seconds scales together (its update too), every other one (bytes, counts)
    stays: a mesh per device once rescaled a layer's passes and not its update, so at world 8 a tp-2 device's
    update, timed under 8 ranks' load, was priced for the sharing again (59.7 ms predicted after the schedule,
    13 to 23 ms measured)."""
    x = LayerProfile(f=1.0, b=2.0, w=3.0, held=4, held_w=5, params=6, out=7, bw=8.0, nodes=9, w_depth=10.0,
                     collectives=11, update=12.0, tensors=(6,))
    y = x.timed_by(0.25)
    floats = {f.name for f in dataclasses.fields(LayerProfile) if isinstance(getattr(x, f.name), float)}
    assert set(TIMES) == floats
    for f in dataclasses.fields(LayerProfile):
        before, after = getattr(x, f.name), getattr(y, f.name)
        assert after == (before * 0.25 if f.name in TIMES else before), f.name
    assert LayerProfile(f=1.0, b=1.0, w=1.0, held=0, held_w=0, params=0, out=0).timed_by(2.0).bw is None


def test_a_mesh_per_devices_update_is_its_own_degrees_at_the_worlds_sharing() -> None:
    """Closed form of the step after the schedule with a mesh per device: each device's layers' updates at its
    own degree, taken to the ranks the first degree's layers were timed with, then to the world's ranks all
    updating at once: a tp-1 device's update alone times the sharing of the world's 4 ranks, a tp-2 device's
    (timed with 8 ranks computing) times the 4 ranks' sharing over the 8's; and the check's all-reduce."""
    c = (1.0, 1.2, 1.9, 2.6, 3.3, 4.0, 4.7, 5.4)
    base = _profile(contention=c)
    updated = tuple(dataclasses.replace(x, update=1e-3 * (i + 1)) for i, x in enumerate(base.layers))
    wide = tuple(dataclasses.replace(x, update=3e-3 * (i + 1)) for i, x in enumerate(base.tp_layers[2]))
    prof = dataclasses.replace(base, layers=updated, tp_layers={2: wide}, tp_ranks={2: 8},
                               allreduce={4: (2e-3, 1e8)})
    parts = [(0, 1), (2, 3), (4, 5)]
    for layout, degree in ((Layout(1, (2, 1, 1), 3), (2, 1, 1)), (Layout(1, (1, 1, 2), 3), (1, 1, 2))):
        got, _, _ = predict(prof, layout, "1f1b", parts)
        alone = [sum((wide if d == 2 else updated)[i].update for i in part) for part, d in zip(parts, degree,
                                                                                                strict=True)]
        # Timed with 8 ranks (tp 2) or 1 (tp 1) computing; in the run all 4 update at once.
        each = [u * c[3] / (c[7] if d == 2 else c[0]) for u, d in zip(alone, degree, strict=True)]
        assert got.makespan == pytest.approx(got.timeline.makespan() + 2e-3 + 32 / 1e8 + max(each), rel=1e-9)


def test_a_mesh_per_device_is_predicted_from_each_devices_own_degree() -> None:
    # Closed forms for a pipeline whose device 0 splits its layers over 2 ranks and device 1 keeps them whole:
    # each device's static bytes are its own layers' at its degree, each stage's passes their sum; a message crosses
    # in 2 pieces and the receiving device of 2 all-gathers it: each direction at its own price.
    prof = dataclasses.replace(_profile(), contention=(1.0,) * 8)
    parts = [(0, 1, 2), (3, 4, 5)]
    wide, narrow = prof.at_tp(2), prof
    result, peaks, static = predict(prof, Layout(1, (2, 1), 2), "gpipe", parts)
    assert static == [int(sum(wide.static(i) for i in parts[0])), int(sum(narrow.static(i) for i in parts[1]))]
    from pipefold.ir import Kind

    busy = [sum(iv.end - iv.start for iv in row if iv.action.kind == Kind.F) for row in result.timeline]
    per_microbatch = [sum(wide.layers[i].f for i in parts[0]), sum(narrow.layers[i].f for i in parts[1])]
    assert busy == pytest.approx([8 * f for f in per_microbatch])
    from pipefold.sim.simulate import CostModel, ring_gather

    cost = CostModel(latency=prof.latency, bandwidth=prof.bandwidth, activation_bytes=8192, mesh=(2, 1))
    crossing_in = prof.latency + 4096 / prof.bandwidth + ring_gather(8192, 2, prof.latency, prof.bandwidth)
    assert cost.crossing_time(1, 2) == pytest.approx(crossing_in)
    assert cost.crossing_time(2, 1) == pytest.approx(prof.latency + 4096 / prof.bandwidth)
    assert cost.link_times(2) == ((0.0, pytest.approx(prof.latency + 4096 / prof.bandwidth)),
                                  (pytest.approx(crossing_in), 0.0))
    for bad in ((), (2, 0), 0):
        with pytest.raises(ConfigError, match="cost mesh is the ranks of each device"):
            CostModel(mesh=bad)  # type: ignore[arg-type]


def test_a_mesh_per_device_is_split_by_memory_at_each_devices_degree() -> None:
    """The planner's memory split on a mesh per device: each device's layers with its own degree's figures. For
    every schedule and option it tried, the split it keeps has the least peak of every split within 2% of the
    fastest, as predict says of each (a brute force over the splits, each device's time at its degree), and predict
    says of the plan what the planner does."""
    prof = dataclasses.replace(_profile(n=8), contention=(1.0,) * 8)
    n, differs = len(prof.layers), 0
    for layout in (Layout(1, (2, 1), 2), Layout(1, (1, 2), 2)):
        points = plan_model(prof, 3, 1e12, layouts=[layout], families=["1f1b", "zb-v", "interleaved-1f1b"]).points
        groups: dict[tuple[str, tuple[tuple[str, int], ...]], dict[str, Any]] = {}
        for pt in points:
            if not any(pt.recompute):
                groups.setdefault((pt.name, tuple(sorted(pt.options.items()))), {})[pt.split] = pt
        for (name, options), by in groups.items():
            chosen = by.get("memory", by["time"])
            differs += "memory" in by
            s = schedules.build(name, layout.pp, 8, **dict(options))
            judged = []
            for cuts in itertools.combinations(range(1, n), s.stages - 1):
                parts = [tuple(range(a, b)) for a, b in itertools.pairwise([0, *cuts, n])]
                busy = [0.0] * s.devices
                for stage, part in enumerate(parts):
                    d = s.placement[0][stage]
                    busy[d] += sum(x.f + x.b + x.w for x in (prof.at_tp(layout.degrees[d]).layers[i] for i in part))
                judged.append((max(predict(prof, layout, s, parts)[1]), max(busy)))
            fastest = min(t for _, t in judged)
            least = min(peak for peak, t in judged if t <= fastest * 1.02 * (1 + 1e-9))
            assert max(chosen.peak_memory) == least, (layout, name, options)
            result, peaks, _ = predict(prof, layout, chosen.spec, chosen.layer_stages, chosen.recompute)
            assert peaks == [int(x) for x in chosen.peak_memory] and result.makespan == pytest.approx(chosen.makespan)
    assert differs >= 2  # the memory split is not the time split everywhere (it was never searched before)


def test_the_world_plan_is_the_best_over_a_brute_force_of_layouts_schedules_and_splits() -> None:
    prof = _profile(contention=(1.0, 1.1, 1.6, 2.2, 2.8, 3.4, 4.0, 4.6))
    layouts = every_layout(prof, 4)
    # A family of each shape (v-block's hundreds of block choices would make the brute force minutes long).
    families = ["gpipe", "1f1b", "zb-h1", "kfkb", "interleaved-1f1b", "zb-v", "v-half", "chimera"]
    everything = plan_model(prof, 4, 1e12, layouts=layouts, families=families)
    budget = sorted(pt.memory for pt in everything.points)[len(everything.points) // 3]
    answer = plan_model(prof, 4, budget, layouts=layouts, families=families)
    assert {pt.layout for pt in answer.points} == set(layouts)
    # Brute force: every layout, family and option the planner tried, every contiguous split, no recomputation.
    best, where = math.inf, None
    n = len(prof.layers)
    for pt in {(q.layout, q.name, tuple(q.options.items())) for q in answer.points}:
        layout, name, options = pt
        s = schedules.build(name, layout.pp, 8 // layout.dp, **dict(options))
        for cuts in itertools.combinations(range(1, n), s.stages - 1):
            bounds = [0, *cuts, n]
            parts = [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
            result, peaks, _ = predict(prof, layout, s, parts)
            if max(peaks) <= budget / 1.05 and result.makespan < best:
                best, where = result.makespan, (layout, name)
    assert where is not None
    assert answer.best.memory <= budget / 1.05
    # The planner's two splits per schedule and its recomputation: never more than 10% off the best split.
    assert answer.best.makespan <= best * 1.10 + 1e-12
    # Its answer is what predict says of it (the same layout, schedule, split and recomputation).
    result, peaks, _ = predict(prof, answer.best.layout, answer.best.spec, answer.best.layer_stages,
                               answer.best.recompute)
    assert result.makespan == pytest.approx(answer.best.makespan)
    assert peaks == [int(x) for x in answer.best.peak_memory]
    # A world plan is never slower than the best single pipeline of the same ranks (it searched that layout too).
    alone = plan_model(prof, 4, budget, families=families)
    assert answer.best.makespan <= alone.best.makespan + 1e-12


def test_data_parallel_copies_pay_their_all_reduce_over_the_link() -> None:
    # Two copies of a one-device pipeline: the step is the pipeline's plus the ring all-reduce of its gradients,
    # 2 (dp-1)/dp of the bytes over the bandwidth and 2 (dp-1) latencies (closed form), when nothing overlaps it.
    prof = dataclasses.replace(_profile(), contention=(1.0,) * 8)
    s = schedules.build("gpipe", 1, 4)
    parts = [tuple(range(len(prof.layers)))]
    one, _, _ = predict(prof, Layout(1, 1, 1), schedules.build("gpipe", 1, 8), parts)
    two, _, _ = predict(prof, Layout(2, 1, 1), s, parts)
    grads = sum(x.params for x in prof.layers)
    ring = 2 * (2 - 1) / 2 * grads / prof.bandwidth + 2 * (2 - 1) * prof.latency
    assert two.makespan == pytest.approx(one.makespan / 2 + ring, rel=1e-6)
    # Where the profile measured an all-reduce among 2 ranks, that fit prices it instead: latency + bytes / bandwidth.
    fitted = dataclasses.replace(prof, allreduce={2: (1e-3, 1e8)})
    two, _, _ = predict(fitted, Layout(2, 1, 1), s, parts)
    assert two.makespan == pytest.approx(one.makespan / 2 + 1e-3 + grads / 1e8, rel=1e-6)
    from pipefold.sim.simulate import CostModel

    for bad in ({1: (0.0, 1e9)}, {2: (-1.0, 1e9)}, {2: (0.0, 0.0)}):
        with pytest.raises(ConfigError, match="an all-reduce fit is a group of >= 2"):
            CostModel(allreduce_fits=bad)


def test_zero1_copies_hold_their_share_of_the_state_and_pay_a_gather_after_the_step() -> None:
    """ZeRO-1 over dp copies, in closed form: a device holds its parameters and gradients and 1/dp of AdamW's two
    moments, (2 + 2/dp) parameter sizes instead of 4; the step is longer by an all-gather of the device's parameters
    among the copies, half the measured all-reduce of their bytes, after the schedule; nothing else moves. FSDP:
    (2 + 4/dp) sizes (the shards of all four, the weights and gradients gathered whole), and on one device, where
    nothing overlaps them, its gather before the first forward and reduce-scatter after the last backward take what
    the plain copies' all-reduce takes, and a latency more for each layer with parameters past the first: FSDP
    gathers and reduce-scatters each such layer on its own (each half an all-reduce's latency, twice)."""
    prof = dataclasses.replace(_profile(), contention=(1.0,) * 8, allreduce={2: (1e-3, 1e8), 4: (2e-3, 5e7)})
    parts = [tuple(range(0, 3)), tuple(range(3, 6))]
    for dp in (2, 4):
        plain, plain_peaks, plain_static = predict(prof, Layout(dp, 1, 2), "1f1b", parts)
        zero, zero_peaks, zero_static = predict(prof, Layout(dp, 1, 2, "zero1"), "1f1b", parts)
        params = [sum(prof.layers[i].params for i in part) for part in parts]
        assert plain_static == [4 * x for x in params]
        assert zero_static == [int(x * (2 + 2 / dp)) for x in params]
        assert [z - s for z, s in zip(zero_peaks, zero_static, strict=True)] == \
            [p - s for p, s in zip(plain_peaks, plain_static, strict=True)]  # the activations: unchanged
        latency, bandwidth = prof.allreduce[dp]
        assert zero.makespan == pytest.approx(plain.makespan + (latency + max(params) / bandwidth) / 2, rel=1e-9)
        assert zero.timeline.makespan() == pytest.approx(plain.timeline.makespan(), rel=1e-12)
        _, _, fsdp_static = predict(prof, Layout(dp, 1, 2, "fsdp"), "1f1b", parts)
        assert fsdp_static == [int(x * (2 + 4 / dp)) for x in params]
        whole = [tuple(range(len(prof.layers)))]
        one, _, _ = predict(prof, Layout(dp, 1, 1), "gpipe", whole)
        sharded, _, _ = predict(prof, Layout(dp, 1, 1, "fsdp"), "gpipe", whole)
        kinds = {str(a.kind) for row in sharded.schedule.actions for act in row for a in act.passes}
        assert {"AG", "RS"} <= kinds and "DP" not in kinds
        units = sum(1 for x in prof.layers if x.params > 0)
        assert units > 1
        assert sharded.makespan == pytest.approx(one.makespan + (units - 1) * latency, rel=1e-9)


def test_zero1_sharing_is_priced_at_the_profiles_fit() -> None:
    """A profile's ZeRO-1 fit (its copies' flat broadcasts as the runtime runs them) prices the sharing after the
    step: the step is the plain copies' step plus, for the device that takes longest, latency + its parameter
    bytes / bandwidth (closed form); a fit for another group size leaves it at half the all-reduce (the test
    above)."""
    prof = dataclasses.replace(_profile(), contention=(1.0,) * 8, allreduce={2: (1e-3, 1e8)})
    parts = [tuple(range(0, 3)), tuple(range(3, 6))]
    plain, _, _ = predict(prof, Layout(2, 1, 2), "1f1b", parts)
    fit = (3e-4, 4e8)
    fitted = dataclasses.replace(prof, zero1={2: fit})
    zero, _, _ = predict(fitted, Layout(2, 1, 2, "zero1"), "1f1b", parts)
    nbytes = [sum(prof.layers[i].params for i in part) for part in parts]
    assert zero.makespan == pytest.approx(plain.makespan + fit[0] + max(nbytes) / fit[1], rel=1e-9)
    other, _, _ = predict(dataclasses.replace(prof, zero1={4: fit}), Layout(2, 1, 2, "zero1"), "1f1b", parts)
    unfitted, _, _ = predict(prof, Layout(2, 1, 2, "zero1"), "1f1b", parts)
    assert other.makespan == pytest.approx(unfitted.makespan, rel=1e-12)
    assert Profile.from_dict(fitted.to_dict()) == fitted
    for bad in ({1: fit}, {2: (-1.0, 1e8)}, {2: (0.0, 0.0)}):
        data = fitted.to_dict()
        data["zero1"] = {str(k): list(v) for k, v in bad.items()}
        with pytest.raises(ConfigError, match="a ZeRO-1 fit is a group of >= 2"):
            Profile.from_dict(data)


@pytest.mark.parametrize("rising", [False, True])
@pytest.mark.parametrize("how", ["none", "zero1", "fsdp"])
def test_the_step_after_the_schedule_is_the_slowest_devices_update_and_the_check(how: str, rising: bool) -> None:
    """Where the profile measured each layer's update (check and optimizer step), the step is its schedule plus,
    after it, the check's all-reduce over every rank and the slowest device's update (closed form): every layer
    of its own whole, with FSDP 1/dp of it (its shards) and the profile's ``fsdp_update`` per tensor, with ZeRO-1
    the heaviest copy's share in bytes plus the sharing of the stepped parameters. A profile without the figures
    adds nothing but ZeRO-1's sharing (as before they were measured). Where ranks share cores, every rank updates
    at once: the updates take as much longer as a pass with all 4 ranks computing (``rising``: 2.5 times)."""
    def layer(update: float, *tensors: int) -> LayerProfile:
        return LayerProfile(f=1e-3, b=1e-3, w=1e-3, held=1000, held_w=500, params=sum(tensors), out=64,
                            tensors=tensors, update=update)

    layers = (layer(1e-4, 40_000), layer(2e-3, 300, 90_000, 90_000, 300), layer(2e-3, 300, 90_000, 90_000, 300),
              layer(0.0), layer(5e-4, 600, 20_000))
    contention = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5) if rising else (1.0,) * 8
    factor = 2.5 if rising else 1.0  # 2 devices computing, each standing for its 2 copies' ranks: 4 at once
    prof = dataclasses.replace(_profile(), layers=layers, tp_layers={}, contention=contention,
                               allreduce={2: (1e-3, 1e8), 4: (2e-3, 1e8)}, zero1={2: (3e-4, 4e8)}, fsdp_update=1e-4)
    parts = [(0, 1), (2, 3, 4)]
    layout = Layout(2, 1, 2, how)
    got, _, _ = predict(prof, layout, "1f1b", parts)
    check = 2e-3 + 32 / 1e8  # the fit for the world's 4 ranks
    updates = []
    for part in parts:
        mine = [layers[i] for i in part]
        seconds = sum(x.update for x in mine)
        if how == "fsdp":
            seconds = seconds / 2 + 1e-4 * sum(len(x.tensors) for x in mine)
        if how == "zero1":
            sizes = [t for x in mine for t in x.tensors]
            seconds *= max(sum(sizes[i] for i in share) for share in shares(sizes, 2)) / sum(sizes)
        seconds *= factor
        if how == "zero1":
            seconds += 3e-4 + sum(x.params for x in mine) / 4e8
        updates.append(seconds)
    assert got.makespan == pytest.approx(got.timeline.makespan() + check + max(updates), rel=1e-9)
    unmeasured = dataclasses.replace(prof, layers=tuple(dataclasses.replace(x, update=0.0) for x in layers))
    bare, _, _ = predict(unmeasured, layout, "1f1b", parts)
    assert bare.timeline.makespan() == pytest.approx(got.timeline.makespan(), rel=1e-12)
    zero1_only = 0.0 if how != "zero1" else max(
        3e-4 + sum(layers[i].params for i in part) / 4e8 for part in parts)
    assert bare.makespan == pytest.approx(bare.timeline.makespan() + zero1_only, rel=1e-9)


def test_zero1s_sharing_among_local_ranks_costs_more_for_more_bytes() -> None:
    """Measured on 2 ranks as the runtime shares: a flat broadcast of each copy's stepped tensors."""
    from pipefold.runtime.measure.profiling import measure_zero1

    latency, bandwidth = measure_zero1(2, sizes=(64 << 10, 1 << 20, 16 << 20))
    assert latency >= 0 and 1e6 < bandwidth < 1e12  # some MB/s to some hundred GB/s: copies over a socket


def test_fsdp_collectives_are_priced_at_the_profiles_fits_where_it_has_them() -> None:
    """A profile's FSDP fits (gather and reduce-scatter as the runtime runs them, per unit) price AG and RS. On one
    device, where nothing overlaps them, the sharded step is the plain copies' step less their all-reduce, plus
    units x latency + bytes / bandwidth for each of the two (closed form); without fits each is half the
    all-reduce (the test above)."""
    from pipefold.sim.simulate import CostModel

    prof = dataclasses.replace(_profile(), contention=(1.0,) * 8, allreduce={2: (1e-3, 1e8)})
    whole = [tuple(range(len(prof.layers)))]
    plain, _, _ = predict(prof, Layout(2, 1, 1), "gpipe", whole)
    grads = sum(x.params for x in prof.layers)
    units = sum(1 for x in prof.layers if x.params > 0)
    fits = ((2e-4, 4e8), (5e-4, 2e8))
    sharded, _, _ = predict(dataclasses.replace(prof, fsdp={2: fits}), Layout(2, 1, 1, "fsdp"), "gpipe", whole)
    expected = plain.makespan - (1e-3 + grads / 1e8) + sum(units * lat + grads / bw for lat, bw in fits)
    assert sharded.makespan == pytest.approx(expected, rel=1e-9)
    # A fit for another group size leaves this one at half the all-reduce.
    other, _, _ = predict(dataclasses.replace(prof, fsdp={4: fits}), Layout(2, 1, 1, "fsdp"), "gpipe", whole)
    unfitted, _, _ = predict(prof, Layout(2, 1, 1, "fsdp"), "gpipe", whole)
    assert other.makespan == pytest.approx(unfitted.makespan, rel=1e-12)
    for bad in ({1: fits}, {2: ((-1.0, 1e8), (0.0, 1e8))}, {2: ((0.0, 1e8), (0.0, 0.0))}):
        with pytest.raises(ConfigError, match="an FSDP fit is a group of >= 2"):
            CostModel(sharded_fits=bad)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_fsdps_hooks_lengthen_each_pass_once_and_per_unit(name: str) -> None:
    """A profile's ``fsdp_passes`` lengthen each pass of a sharded stage by its once-per-pass part plus units x its
    per-unit part, and nothing else: on one device, where every action runs in turn, the step grows by the count
    of each pass kind times that kind's extra (closed form), fused BW included where the schedule fuses; a layout
    without FSDP is left as it was."""
    from pipefold.ir import Kind

    prof = dataclasses.replace(_profile(), contention=(1.0,) * 8, allreduce={2: (1e-3, 1e8)})
    whole = [tuple(range(len(prof.layers)))]
    units = sum(1 for x in prof.layers if x.params > 0)
    hooks = ((1e-5, 1e-4), (2e-5, 7e-5), (3e-6, 5e-6), (2.5e-5, 8e-5))  # F, B, W, BW
    hooked = dataclasses.replace(prof, fsdp_passes=hooks)
    before, _, _ = predict(prof, Layout(2, 1, 1, "fsdp"), name, whole)
    after, _, _ = predict(hooked, Layout(2, 1, 1, "fsdp"), name, whole)
    extra = {kind: once + units * unit for kind, (once, unit) in zip((Kind.F, Kind.B, Kind.W, Kind.BW), hooks,
                                                                      strict=True)}
    counts = {kind: sum(1 for row in after.schedule.actions for act in row for a in act.passes if a.kind == kind)
              for kind in extra}
    assert counts[Kind.F] > 0 and counts[Kind.B] + counts[Kind.BW] > 0
    assert after.makespan == pytest.approx(before.makespan + sum(counts[k] * extra[k] for k in extra), rel=1e-9)
    plain, _, _ = predict(prof, Layout(2, 1, 1), name, whole)
    assert predict(hooked, Layout(2, 1, 1), name, whole)[0].makespan == pytest.approx(plain.makespan, rel=1e-12)
    assert Profile.from_dict(hooked.to_dict()) == hooked
    bad = hooked.to_dict()
    bad["fsdp_passes"] = [[0.0, -1.0]] * 4
    with pytest.raises(ConfigError, match="fsdp_passes is F, B, W and BW"):
        Profile.from_dict(bad)


def test_fsdps_gather_and_reduce_scatter_among_local_ranks_cost_more_for_more_bytes() -> None:
    from pipefold.runtime.measure.profiling import measure_fsdp

    for latency, bandwidth in measure_fsdp(2, rounds=5, sizes=(64 << 10, 1 << 20, 16 << 20)):
        assert latency >= 0 and 1e6 < bandwidth < 1e12  # some MB/s to some hundred GB/s: copies over a socket


def test_fsdps_hooks_are_timed_on_the_models_own_layers() -> None:
    """FSDP's hooks on a small GPT's own blocks (one, then two) cost something per unit in F and in a backward
    (torch's ``fully_shard`` runs Python hooks around every unit's forward and backward: 100 to 400 us a unit
    on this 2-core machine) and far less in a W, which calls none of them; AdamW's step on DTensor shards costs
    more per tensor than on plain ones."""
    from pipefold.runtime.measure.profiling import measure_fsdp_hooks

    train = {"model": "gpt", "layers": 2, "hidden": 32, "heads": 2, "seq": 16, "batch": 8, "microbatches": 4,
             "seed": 0}
    # The cost per unit is the difference of two stages' timings (one unit, two): under a load that comes and goes
    # (a benchmark's 8 ranks beside it, the suite's other worker) it came out 0. Measured again, up to TIMING_TRIES
    # times in all, when it does.
    for _ in range(TIMING_TRIES):
        passes, update = measure_fsdp_hooks(train, (1, 2), (1, 3))
        (_, f), (_, b), (_, w), (_, bw) = passes
        if min(f, b, bw) > 1e-6 and w < min(f, b, bw):
            break
    assert update > 1e-6, update  # DTensor's dispatch on every operation of AdamW's step, per tensor
    assert min(f, b, bw) > 1e-6, passes
    assert w < min(f, b, bw), passes
    # One stage (no second of more units): all of its extra counts per unit, nothing once.
    alone = measure_fsdp_hooks(train, (2, 3), (2, 3), rounds=2)[0]
    assert [once for once, _ in alone] == [0.0] * 4 and alone[0][1] > 0, alone


def test_an_all_reduce_among_local_ranks_costs_more_for_more_bytes() -> None:
    from pipefold.runtime.measure.profiling import measure_allreduce

    # A 16 MiB top size and 5 rounds: the bytes' time then outweighs a preemption of one round on a loaded machine
    # (with 3 rounds up to 4 MiB the fit once found no slope at all beside the suite's other ranks).
    latency, bandwidth = measure_allreduce(2, rounds=5, sizes=(4 << 10, 1 << 20, 16 << 20))
    assert latency >= 0 and 1e6 < bandwidth < 1e12  # some MB/s to some hundred GB/s: a real copy over a socket


def test_a_world_plan_file_round_trips_its_layout(tmp_path) -> None:
    prof = _profile()
    answer = plan_model(prof, 4, 1e12, layouts=[Layout(1, 2, 2), Layout(2, 2, 1)])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(answer.to_dict()))
    back = RunPlan.from_dict(read_plan(str(path)))
    assert (back.dp, back.tp, back.devices) == (answer.best.layout.dp, answer.best.layout.tp, answer.best.layout.pp)
    assert back.microbatches * back.dp == 8
    assert all({"dp", "tp", "sharding", "devices"} <= set(row) for row in answer.to_dict()["frontier"])
    for how in ("zero1", "fsdp"):
        sharded = plan_model(prof, 4, 1e12, layouts=[Layout(2, 1, 2, how)])
        path.write_text(json.dumps(sharded.to_dict()))
        assert RunPlan.from_dict(read_plan(str(path))).layout == Layout(2, 1, 2, how)
    for bad in ({"sharding": "zero1", "dp": 1}, {"sharding": "zero3"}):
        path.write_text(json.dumps({**answer.to_dict(), **bad}))
        with pytest.raises(ConfigError, match="sharding is none, zero1, fsdp"):
            read_plan(str(path))
    # A mesh per device: its degrees as a list, one per device.
    mixed = plan_model(prof, 3, 1e12, layouts=[Layout(1, (2, 1), 2)], families=["1f1b", "gpipe"])
    path.write_text(json.dumps(mixed.to_dict()))
    back = RunPlan.from_dict(read_plan(str(path)))
    assert back.tp == (2, 1) and back.layout == Layout(1, (2, 1), 2) and mixed.to_dict()["tp"] == [2, 1]
    assert all(row["tp"] == [2, 1] for row in mixed.to_dict()["frontier"])
    # A layout its profile cannot run: one line, naming the degrees it measured.
    for bad in ({"tp": 4}, {"dp": 0}, {"tp": [2, 4]}, {"tp": [2, 1, 1]}):
        path.write_text(json.dumps({**answer.to_dict(), **bad}))
        with pytest.raises(ConfigError, match="a degree its profile measured \\(1, 2\\)"):
            read_plan(str(path))


def test_layouts_must_make_the_world() -> None:
    with pytest.raises(ConfigError, match="runs 2 ranks"):
        plan_model(_profile(), 4, 1e12, layouts=[Layout(1, 1, 2)])
    with pytest.raises(ConfigError, match="whose dp divides 8"):
        plan_model(_profile(), 3, 1e12, layouts=[Layout(3, 1, 1)])


def test_a_profile_at_tp_2_measures_each_ranks_share_and_its_plan_runs_exactly(tmp_path) -> None:
    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.measure.profiling import profile_model
    from pipefold.train.planned import from_plan
    from pipefold.train.prepare import make_job
    from pipefold.train.reference import compare
    from pipefold.train.spec import RunSpec

    h = 32
    prof = profile_model(model="gpt", layers=2, hidden=h, heads=2, seq=16, batch=8, microbatches=4, devices=4,
                         repeats=1, link=False, contention=False, tp=(1, 2))
    assert prof.tp_degrees == (1, 2) and prof.ranks_measuring(2) == 2
    # Closed form of a GPT block's parameters on one of t ranks (biases on): q, k, v and the MLP's first Linear
    # split whole, the two output projections' weights split and their biases whole, both norms whole.
    for t in (1, 2):
        floats = (12 * h * h + 7 * h) // t + 6 * h
        assert prof.at_tp(t).layers[1].params == 4 * floats
    # torch's CommDebugMode counted each block's collectives as they ran: Megatron's two all-reduces in the forward
    # (after attention, after the MLP) and two in the backward (the gradients of their inputs); none elsewhere.
    assert [x.collectives for x in prof.at_tp(2).layers] == [0, 4, 4, 0]
    whole = prof.at_tp(1).layers
    assert prof.at_tp(2).layers[0].params == whole[0].params  # the embedding and the head stay whole
    assert prof.at_tp(2).layers[-1].params == whole[-1].params
    answer = plan_model(prof, 4, 1e12, layouts=[Layout(1, 2, 2)], families=["1f1b"])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(answer.to_dict()))
    planned = from_plan(RunPlan.from_dict(read_plan(str(path))), RunSpec.flat(steps=2, check=True))
    assert (planned.spec.parallel.tp, planned.spec.parallel.dp, planned.spec.schedule.devices) == (2, 1, 2)
    job = make_job(planned.spec, decided=planned.decided)
    assert compare(job, run_local(job))["max_grad_rel_diff"] < 1e-5
    # A mesh per device: the embedding's device on 2 ranks, the other on 1 (3 ranks), planned and run as planned:
    # one stage per device, a V (device 0 holds the first and the last stage) and interleaved stages; and Chimera's
    # two replicas on 4 devices, each stage's two devices of one degree (2, 1, 1, 2: 6 ranks).
    for family, degrees, stages in (("1f1b", (2, 1), 2), ("zb-v", (2, 1), 4), ("interleaved-1f1b", (2, 1), 4),
                                    ("chimera", (2, 1, 1, 2), 4)):
        answer = plan_model(prof, sum(degrees), 1e12, layouts=[Layout(1, degrees, len(degrees))], families=[family])
        path.write_text(json.dumps(answer.to_dict()))
        planned = from_plan(RunPlan.from_dict(read_plan(str(path))), RunSpec.flat(steps=2, check=True))
        assert planned.spec.parallel.tp == degrees and planned.spec.schedule.devices == len(degrees)
        job = make_job(planned.spec, decided=planned.decided)
        assert job.layer_stages == answer.best.layer_stages and len(job.layer_stages) == stages
        assert job.world == sum(degrees)
        assert compare(job, run_local(job))["max_grad_rel_diff"] < 1e-5, family


def test_a_sequence_parallel_profile_holds_less_and_its_plan_runs_so(tmp_path) -> None:
    """profile --tp 1,2 --sequence-parallel: each block at tp 2 holds less than without it (at least its norms'
    statistics, 8 bytes a token each, on half the tokens), the parameters the same; the plan made from it runs
    sequence-parallel, exactly as one process."""
    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.measure.profiling import profile_model
    from pipefold.train.planned import from_plan
    from pipefold.train.prepare import make_job
    from pipefold.train.reference import compare
    from pipefold.train.spec import RunSpec

    h, tokens = 32, 2 * 16
    profs = {sp: profile_model(model="gpt", layers=2, hidden=h, heads=2, seq=16, batch=8, microbatches=4, devices=4,
                               repeats=1, link=False, contention=False, tp=(1, 2), sequence_parallel=sp)
             for sp in (False, True)}
    assert profs[True].train["sequence_parallel"] is True and "sequence_parallel" not in profs[False].train
    for plain, split in zip(profs[False].at_tp(2).layers[1:3], profs[True].at_tp(2).layers[1:3], strict=True):
        assert plain.held - split.held >= 2 * (1 - 1 / 2) * 8 * tokens
        assert plain.params == split.params
    answer = plan_model(profs[True], 4, 1e12, layouts=[Layout(1, 2, 2)], families=["1f1b"])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(answer.to_dict()))
    planned = from_plan(RunPlan.from_dict(read_plan(str(path))), RunSpec.flat(steps=2, check=True))
    assert planned.spec.parallel.sequence_parallel and planned.spec.parallel.tp == 2
    job = make_job(planned.spec, decided=planned.decided)
    assert compare(job, run_local(job))["max_grad_rel_diff"] < 1e-5
    with pytest.raises(ConfigError, match="--sequence-parallel splits the tokens over tensor-parallel ranks"):
        profile_model(model="gpt", layers=2, hidden=h, heads=2, seq=16, batch=8, microbatches=4, tp=(1,),
                      sequence_parallel=True)


def test_a_mesh_per_device_is_planned_where_the_runtime_runs_it(tmp_path) -> None:
    """What the runtime refuses, the planner does not plan. Devices that sum gradients rank by rank (a stage's
    replicas, a tied weight's copies) need one degree, and FSDP shards each copy of a tied weight on its own. The
    planner's rule (refused_layout) against the runtime's own refusal, for every layout of 2 and 4 devices of
    degree 1 or 2, one copy or two under FSDP, and schedules that place the first and last stage apart or together,
    with and without replicas, on a LLaMA whose embedding and head are tied; and the planner searches exactly the
    layouts the rule lets through."""
    pytest.importorskip("transformers", reason="the tied model is a Hugging Face LLaMA")
    from pipefold.models.hf import read_config
    from pipefold.plan.budget import refused_layout
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    config = tmp_path / "llama-tied.json"
    config.write_text(json.dumps({**read_config("llama", None), "tie_word_embeddings": True}))
    seen = {"ok": 0, "replicas": 0, "tied": 0, "fsdp": 0}
    for (pp, family), fsdp in itertools.product(((2, "1f1b"), (2, "zb-v"), (4, "1f1b"), (4, "chimera"), (4, "zb-v")),
                                                (False, True)):
        dp = 2 if fsdp else 1
        for degrees in itertools.product((1, 2), repeat=pp):
            schedule = schedules.build(family, pp, 4)
            blocks = schedule.stages * 2
            spec = RunSpec.flat(schedule=family, devices=pp, microbatches=4, batch=8 * dp, model="llama",
                                model_config=str(config), layers=blocks, partition="even", tp=degrees, dp=dp,
                                fsdp=fsdp, steps=1)
            try:
                job = make_job(spec)
                refused = ""
            except ConfigError as exc:
                refused = str(exc)
                assert "sum their gradients rank by rank" in refused or "FSDP shards each copy" in refused, refused
            n = blocks + 2  # the embedding, the blocks and the head
            cuts = [round(i * n / schedule.stages) for i in range(schedule.stages + 1)]
            split = job.layer_stages if not refused else [tuple(range(a, b)) for a, b in itertools.pairwise(cuts)]
            layout = Layout(dp, degrees, pp, "fsdp" if fsdp else "none")
            why = refused_layout(schedule, layout, split, [(0, n - 1)])
            assert bool(why) == bool(refused), (family, layout, why, refused)
            seen["ok" if not why else "fsdp" if "FSDP" in why else "replicas" if "replicas" in why else "tied"] += 1
    assert min(seen.values()) >= 4, seen
    # The planner: chimera only where each stage's devices match; 1f1b with the tie apart only on one degree.
    prof = dataclasses.replace(_profile(), contention=(1.0,) * 8)
    tied = dataclasses.replace(prof, tied=((0, len(prof.layers) - 1),))
    for profile, layout, family, searched in (
            (prof, Layout(1, (2, 1, 1, 2), 4), "chimera", True), (prof, Layout(1, (2, 2, 1, 1), 4), "chimera", False),
            (tied, Layout(1, (2, 1, 1, 2), 4), "chimera", True), (tied, Layout(1, (2, 1), 2), "1f1b", False),
            (prof, Layout(1, (2, 1), 2), "1f1b", True), (tied, Layout(1, (2, 1), 2), "zb-v", True),
            (tied, Layout(2, 1, 2, "fsdp"), "1f1b", False), (prof, Layout(2, 1, 2, "fsdp"), "1f1b", True),
            (tied, Layout(2, 1, 2), "1f1b", True), (tied, Layout(2, 1, 1, "fsdp"), "gpipe", True)):
        if searched:
            answer = plan_model(profile, layout.world, 1e12, layouts=[layout], families=[family])
            assert {pt.layout for pt in answer.points} == {layout}
            for pt in answer.points:
                result, peaks, _ = predict(profile, layout, pt.spec, pt.layer_stages, pt.recompute)
                assert result.makespan == pytest.approx(pt.makespan)
        else:
            with pytest.raises(ConfigError, match="no registered schedule runs"):
                plan_model(profile, layout.world, 1e12, layouts=[layout], families=[family])
    # Chimera's split on a mesh per device (by time, each stage at its devices' degree) against every split, as the
    # world plan is: never more than 10% slower than the best (6 layers: the best; 10: 4.8% off when written).
    layout = Layout(1, (2, 1, 1, 2), 4)
    for n in (6, 10):
        profile = dataclasses.replace(_profile(n=n), contention=(1.0,) * 8)
        answer = plan_model(profile, 6, 1e12, layouts=[layout], families=["chimera"])
        s = schedules.build("chimera", 4, 8)
        best = min(predict(profile, layout, s, [tuple(range(a, b)) for a, b in itertools.pairwise([0, *cuts, n])])[0]
                   .makespan for cuts in itertools.combinations(range(1, n), 3))
        assert best <= answer.best.makespan <= best * 1.10 + 1e-12, n


@pytest.mark.parametrize(("argv", "expected"), [
    (["profile", "--tp", "3", "--heads", "4", "-o", "{tmp}/p.json"], "--tp 3 splits --heads = 4 unevenly"),
    (["profile", "--tp", "two", "-o", "{tmp}/p.json"], "--tp takes tensor-parallel degrees"),
    (["profile", "--tp", "0", "-o", "{tmp}/p.json"], "--tp takes tensor-parallel degrees"),
    (["plan", "--profile", "{tmp}/world.json", "--world", "4", "-p", "2", "--memory-budget", "1GB"],
      "--devices is one pipeline's length"),
    (["plan", "--world", "4", "--memory", "3"], "--world belongs to plan --profile FILE"),
    (["plan", "--profile", "{tmp}/world.json", "--world", "0", "--memory-budget", "1GB"], "a whole number >= 1"),
])
def test_bad_world_input_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path, argv: list[str],
                                     expected: str) -> None:
    from pipefold.cli.main import main

    _profile().save(str(tmp_path / "world.json"))
    try:
        code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and err.startswith("pipefold ") and expected in err, err
    assert not (tmp_path / "p.json").exists()  # refused before anything was measured or written


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("dp", [2, 3])
def test_zero1_predicts_each_devices_heaviest_copy_of_whole_tensors(name: str, dp: int) -> None:
    """Each device's static bytes under ZeRO-1: weights and gradients whole, and the optimizer state (AdamW: 2
    parameter sizes) of the heaviest copy's share, worked out here by a brute force over every assignment of the
    device's tensors that the greedy rule could make: the least heaviest copy it can reach is at most the prediction,
    and the prediction is at most that plus the largest tensor (the rule's bound). With an embedding of one tensor
    alone on a stage, one copy holds all of its state. A profile without tensors is priced as an even share."""
    from pipefold.plan.budget import device_static

    def layer(*tensors: int) -> LayerProfile:
        return LayerProfile(f=1e-3, b=1e-3, w=1e-3, held=1000, held_w=500, params=sum(tensors), out=64,
                            tensors=tensors)

    layers = (layer(40_000), layer(300, 9_000, 9_000, 300), layer(300, 9_000, 9_000, 300), layer(600, 20_000))
    prof = dataclasses.replace(_profile(4), layers=layers, tp_layers={})
    layout = Layout(dp, 1, 2, "zero1")
    schedule = schedules.build(name, 2, 8)
    split = [(0,), (1,), (2,), (3,)][:schedule.stages] if schedule.stages == 4 else [(0,), (1, 2, 3)]
    seen = layout_profile(prof, layout)
    got = device_static(seen, layout, schedule, split)
    for d in range(2):
        sizes = [t for s in schedule.stages_of(d) for i in split[s] for t in layers[i].tensors]
        least = min(max(sum(x for x, c in zip(sizes, who, strict=True) if c == k) for k in range(dp))
                    for who in itertools.product(range(dp), repeat=len(sizes)))
        weights = 2 * sum(sizes)
        assert weights + 2 * least <= got[d] <= weights + 2 * (least + max(sizes)), (d, got[d])
        if split[schedule.stages_of(d)[0]] == (0,) and len(schedule.stages_of(d)) == 1:
            assert got[d] == 2 * 40_000 + 2 * 40_000  # the embedding's one tensor: its whole state on one copy
    unrecorded = dataclasses.replace(seen, layers=tuple(dataclasses.replace(x, tensors=()) for x in seen.layers))
    assert device_static(unrecorded, layout, schedule, split) == [
        sum(seen.static(i) for s in schedule.stages_of(d) for i in split[s]) for d in range(2)]


def test_a_profiles_tensors_must_sum_to_its_parameters() -> None:
    data = _profile(4).to_dict()
    data["layers"][0]["tensors"] = [10, 20]
    with pytest.raises(ConfigError, match=r"layer 0 \(tp 1\)'s tensors are bytes >= 0 that sum to its 40000"):
        Profile.from_dict(data)


@pytest.mark.parametrize(("how", "split"), [("zero1", None), ("zero1", ((0,), (1, 2, 3))),
                                            ("zero1", ((0, 1, 2), (3,))), ("fsdp", None)],
                         ids=["zero1", "zero1-embedding-alone", "zero1-head-alone", "fsdp"])
def test_a_sharded_world_plan_runs_as_planned_and_holds_what_it_predicted(
        how: str, split: tuple[tuple[int, ...], ...] | None, capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """A plan on dp 2 x pp 2 with ZeRO-1 or FSDP (AdamW), as planned or with its split replaced: train --plan runs
    it so, its gradients equal one process's, and each rank's weights, gradients and optimizer state, counted from
    the tensors' storages (with FSDP its shards, and the weights and gradients it gathered whole, counted from
    FSDP's own), are what the plan predicted for its device. ZeRO-1 shares whole tensors, so a stage of an
    embedding or a head alone leaves one copy nearly all the state (CI once met a plan that split so and a
    prediction of an even share, 30% under): the device's prediction is its heaviest copy's, to the byte but for
    AdamW's step counters; FSDP's within its shards' padding (10%)."""
    from pipefold.plan.budget import copy_peaks, copy_static, predict
    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.measure.profiling import profile_model
    from pipefold.train.planned import from_plan
    from pipefold.train.prepare import make_job
    from pipefold.train.reference import compare
    from pipefold.train.spec import RunSpec

    prof = profile_model(model="gpt", layers=2, hidden=32, heads=2, seq=16, batch=8, microbatches=4, devices=4,
                         repeats=1, link=False, contention=False)
    answer = plan_model(prof, 4, 1e12, layouts=[Layout(2, 1, 2, how)], families=["1f1b"])
    data = answer.to_dict()
    if split is not None:
        result, peaks, static = predict(prof, Layout(2, 1, 2, how), "1f1b", split)
        data["layer_stages"] = [list(part) for part in split]
        data["predicted"].update(step_time_s=result.makespan, peak_bytes=peaks, static_bytes=static)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    plan = RunPlan.from_dict(read_plan(str(path)))
    planned = from_plan(plan, RunSpec.flat(steps=2, check=True))
    assert getattr(planned.spec.parallel, how) and planned.spec.parallel.dp == 2
    job = make_job(planned.spec, decided=planned.decided)
    # A step is its schedule and the update after it (ZeRO-1's sharing in it): by each rank's own wall clock the
    # next step starts after both, and soon after (its batch read between). "Soon" in proportion as well: on cores
    # shared with other tests' ranks the batch's read took 0.39 s of a 1.54 s gap, whose update alone was 0.89 s
    # (an update left out of the step would leave more than 40% of the gap unexplained). That part is a timing, and
    # a busy machine stretched one gap's slack to 0.26 s of 0.55 in CI: it is measured up to TIMING_TRIES times in
    # all, as the suite's other timings are; the rest holds on every run.
    for _ in range(TIMING_TRIES):
        reports = run_local(job)
        assert compare(job, reports)["max_grad_rel_diff"] < 1e-5
        late = []
        for r in reports:
            for i in range(len(r.steps) - 1):
                gap = r.steps.started_at[i + 1] - r.steps.started_at[i]
                slack = gap - (r.steps.wall[i] + r.steps.update[i])
                assert r.steps.update[i] > 0 and slack >= 0, (r.rank, i, gap, slack)
                if slack >= max(0.25, 0.4 * gap):
                    late.append((r.rank, i, gap, slack))
        if not late:
            break
    assert not late, late
    held: dict[int, list[int]] = {}
    for r in reports:
        copy, device, _ = job.coords(r.rank)
        held.setdefault(device, [0, 0])[copy] = r.static_bytes + r.gathered_bytes
        # What FSDP gathers: the stage's weights whole and their gradients, twice its parameters' bytes exactly.
        whole = sum(prof.layers[i].params for i in plan.layer_stages[device])
        assert r.gathered_bytes == (2 * whole if how == "fsdp" else 0), (r.rank, r.gathered_bytes, whole)
    # Each copy's own: under ZeRO-1 the copies keep the state of different shares (copy_static), the heaviest of
    # which is the device's prediction.
    each = copy_static(layout_profile(prof, plan.layout, plan.layer_stages), plan.layout, job.schedule,
                       plan.layer_stages)
    assert [max(column) for column in zip(*each, strict=True)] == list(plan.static_bytes)
    for device, copies in held.items():
        predicted = plan.static_bytes[device]
        if how == "zero1":
            steps = sum(len(prof.layers[i].tensors) for i in plan.layer_stages[device]) * 4  # float32 counters
            assert predicted <= max(copies) <= predicted + steps, (device, copies, predicted)
            for c, got in enumerate(copies):
                assert each[c][device] <= got <= each[c][device] + steps, (c, device, got, each[c][device])
        else:
            assert max(copies) == pytest.approx(predicted, rel=0.10), (device, copies, predicted)
            assert each[0] == each[1]
    if split == ((0,), (1, 2, 3)):  # the embedding's two tensors, one a copy: AdamW's two sizes of each apart
        big, small = prof.layers[0].tensors
        assert each[0][0] - each[1][0] == 2 * (big - small) > 0
    # train --plan prints the plan's own prediction (ZeRO-1's shares and broadcast in it) beside the measurement.
    from pipefold.cli.main import main

    assert main(["train", "--plan", str(path), "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sharding"] == how
    # Each beside the first pipeline's ranks: its copy's own (ZeRO-1's copies differ; the heaviest is the plan's).
    first = copy_peaks(prof, plan.layout, job.schedule, plan.layer_stages, plan.recompute)
    assert out["plan"]["predicted"]["peak_bytes"] == first[0]
    assert [max(column) for column in zip(*first, strict=True)] == list(plan.peak_bytes)
    assert out["plan"]["predicted"]["step_time_s"] == pytest.approx(plan.step_time)


@pytest.mark.parametrize("layout", [Layout(2, 1, 2, "zero1"), Layout(4, 1, 2, "fsdp"), Layout(1, (2, 1), 2),
                                    Layout(1, 2, 2)], ids=str)
def test_a_plans_recomputation_reports_the_bytes_its_layout_holds(layout: Layout) -> None:
    # What train --plan reports of a plan that recomputes: the same static bytes per device as the plan's own
    # prediction (the copies' sharding of the state, each device's layers at its degree), not the layers' whole.
    from pipefold.train.planned import from_plan
    from pipefold.train.spec import RunSpec

    prof = _profile()
    plan = plan_model(prof, layout.world, 1e12, layouts=[layout], families=["1f1b"]).run_plan
    plan = dataclasses.replace(plan, recompute=(1, 0))
    recompute = from_plan(plan, RunSpec.flat(steps=1)).decided[1]
    assert recompute is not None and recompute.layers == (1, 0)
    _, peaks, static = predict(prof, layout, "1f1b", plan.layer_stages, plan.recompute)
    assert recompute.static == static
    assert [s + a for s, a in zip(recompute.static, recompute.activation_peak, strict=True)] == peaks


def test_a_profile_records_its_models_tied_layers(tmp_path) -> None:
    """``pipefold profile`` of a model with a tied embedding and head records the pair by layer index; the file
    keeps it; a group naming a layer the profile does not have, or one layer alone, is one line."""
    pytest.importorskip("transformers", reason="the tied model is a Hugging Face LLaMA")
    from pipefold.models.hf import read_config
    from pipefold.runtime.measure.profiling import profile_model

    config = tmp_path / "llama-tied.json"
    config.write_text(json.dumps({**read_config("llama", None), "tie_word_embeddings": True}))
    prof = profile_model(model="llama", model_config=str(config), layers=2, seq=16, batch=4, microbatches=2,
                         devices=2, repeats=1, link=False, contention=False)
    assert prof.tied == ((0, 3),)
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))).tied == ((0, 3),)
    untied = profile_model(model="llama", layers=2, seq=16, batch=4, microbatches=2, devices=2, repeats=1,
                           link=False, contention=False)
    assert untied.tied == ()
    for bad in ([[0, 4]], [[1]]):
        with pytest.raises(ConfigError, match="each group of tied layers names two or more of its 4 layers") as info:
            Profile.from_dict({**prof.to_dict(), "tied": bad})
        assert "\n" not in str(info.value)


def test_a_profile_for_one_pipeline_measures_the_all_reduce_and_no_sharding(monkeypatch: pytest.MonkeyPatch) -> None:
    """``train --schedule auto`` plans one pipeline, which has no copies to shard: its profile measures the
    all-reduce (the gradients' check runs one over every rank) but not ZeRO-1's or FSDP's costs, and loses nothing
    by it: with any sharding fits added, the plans of one pipeline are the same, point for point."""
    from pipefold.runtime.measure.profiling import profile_model
    from pipefold.train import planned
    from pipefold.train.spec import RunSpec

    prof = profile_model(model="gpt", layers=2, hidden=32, heads=2, seq=16, batch=8, microbatches=4, devices=2,
                         repeats=1, contention=False, sharding=False)
    assert set(prof.allreduce) == {2} and not prof.zero1 and not prof.fsdp and not prof.fsdp_passes
    padded = dataclasses.replace(prof, zero1={2: (1e-3, 1e6)}, fsdp={2: ((1e-3, 1e6), (2e-3, 5e5))},
                                 fsdp_passes=((1e-4, 1e-5),) * 4, fsdp_update=1e-5)

    def points(p: Profile) -> list[tuple[Any, ...]]:
        answer = plan_model(p, 2, 1e12)
        return [(x.spec, x.layer_stages, x.recompute, x.makespan, tuple(x.peak_memory)) for x in answer.points]

    assert points(prof) and points(prof) == points(padded)
    fsdp = [Layout(2, 1, 1, "fsdp")]  # where the fits do count: two copies, sharded
    sharded = [plan_model(p, 2, 1e12, layouts=fsdp).best.makespan for p in (prof, padded)]
    assert sharded[0] != sharded[1]
    seen: dict[str, Any] = {}

    class Asked(Exception):
        """Stops plan_here once it has asked for its profile: what it asked is all this test reads."""

    def stop(**sizes: Any) -> Profile:
        seen.update(sizes)
        raise Asked

    monkeypatch.setattr(planned, "profile_here", stop)
    spec = RunSpec.flat(schedule="auto", memory_budget="1GB", model="gpt", layers=2, hidden=32, heads=2, seq=16,
                        batch=8, microbatches=4, devices=2)
    with pytest.raises(Asked):
        planned.plan_here(spec)
    assert seen["sharding"] is False and seen["devices"] == 2

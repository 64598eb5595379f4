"""Automatic partitioning: optimality against brute force, layer costs, one-line errors, the CLI's JSON.

The memory-aware split is checked against every contiguous split, with each device's peak worked out
here by replaying its action order, independently of the simulator.
"""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipefold import schedules
from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule, looped_placement, v_placement
from pipefold.models import split_layers
from pipefold.plan.partition import (
    memory_of_split,
    partition,
    partition_memory,
    partition_on_devices,
)
from pipefold.runtime.measure.profiling import layer_costs, layer_memory, layer_static_bytes
from pipefold.train.prepare import make_job
from pipefold.train.spec import RunSpec


def _brute(costs: list[float], parts: int, placement: tuple[int, ...] | None) -> float:
    """The least largest part (or device) cost over every contiguous split."""
    n, best = len(costs), float("inf")
    for cut in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cut, n]
        part = [sum(costs[bounds[i]:bounds[i + 1]]) for i in range(parts)]
        if placement is None:
            best = min(best, max(part))
            continue
        loads = [0.0] * (max(placement) + 1)
        for i, device in enumerate(placement):
            loads[device] += part[i]
        best = min(best, max(loads))
    return best


def _check_cover(split_parts: list[list[int]], boundaries: list[int], n: int) -> None:
    assert [i for part in split_parts for i in part] == list(range(n))
    assert all(part and part == list(range(part[0], part[-1] + 1)) for part in split_parts)
    assert boundaries == [part[0] for part in split_parts] and boundaries[0] == 0


@pytest.mark.parametrize("seed", range(60))
def test_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    costs = [rng.choice([rng.random(), float(rng.randint(0, 4))]) for _ in range(n)]
    parts = rng.randint(1, n)
    split = partition(costs, parts)
    assert split.bottleneck == pytest.approx(_brute(costs, parts, None), abs=1e-9)
    assert split.device_cost == split.cost and len(split.parts) == parts
    _check_cover(split.parts, split.boundaries, n)


def _brute_on_devices(costs: list[list[float]], placement: tuple[int, ...]) -> float:
    """The least largest device load over every contiguous split, part k costed on its device ``placement[k]``."""
    n, best = len(costs[0]), math.inf
    for cuts in itertools.combinations(range(1, n), len(placement) - 1):
        bounds = [0, *cuts, n]
        loads = [0.0] * len(costs)
        for part, d in enumerate(placement):
            loads[d] += sum(costs[d][bounds[part]:bounds[part + 1]])
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("placement", [None, (0,), (0, 1, 2), (2, 0, 1), v_placement(1), v_placement(2), v_placement(3),
                                       looped_placement(2, 2), looped_placement(2, 3), (1, 0, 1, 0), (0, 1, 1, 0, 0)],
                         ids=str)
def test_a_split_over_devices_of_their_own_costs_is_optimal_against_brute_force(
        seed: int, placement: tuple[int, ...] | None) -> None:
    # Each device makes its own cost of a layer (a device that splits its layers over more ranks runs them faster):
    # one part per device (None: a random number of devices in order), the V (polynomial) and interleaved and
    # other placements (branch and bound), each part costed on its device, against every contiguous split.
    rng = random.Random(seed)
    if placement is None:
        placement = tuple(range(rng.randint(1, 5)))
    p, parts = max(placement) + 1, len(placement)
    n = rng.randint(parts, 9)
    base = [rng.choice([rng.random(), float(rng.randint(0, 4))]) for _ in range(n)]
    costs = [[c * rng.choice([1.0, 0.55, 0.3]) for c in base] for _ in range(p)]
    split = partition_on_devices(costs, placement)
    assert split.bottleneck == pytest.approx(_brute_on_devices(costs, placement), abs=1e-9)
    assert len(split.parts) == parts and split.placement == placement
    assert split.cost == pytest.approx([sum(costs[d][i] for i in part)
                                        for d, part in zip(placement, split.parts, strict=True)])
    assert max(split.device_cost) == pytest.approx(split.bottleneck)
    _check_cover(split.parts, split.boundaries, n)
    # The same costs on every device: the plain split's answer.
    assert partition_on_devices([base] * p, placement).bottleneck == pytest.approx(
        partition(base, parts, placement=placement).bottleneck)


def test_a_split_over_devices_refuses_what_it_cannot_split() -> None:
    for costs, placement, words in (
            ([], None, "one row per device"), ([[1.0], [1.0, 2.0]], None, "one row per device"),
            ([[1.0]] * 2, None, "cannot split 1 layers into 2"), ([[1.0, -1.0]], None, "non-negative"),
            ([[1.0] * 8] * 2, (0, 2), "names device 2, but costs are given for 2 devices")):
        with pytest.raises(ConfigError, match=words):
            partition_on_devices(costs, placement)


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("kind", ["v", "looped"])
def test_placement_optimal_against_brute_force(seed: int, kind: str) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 10)
    if kind == "v":
        p = rng.randint(1, n // 2)
        placement = v_placement(p)
    else:
        p = rng.randint(1, n // 2)
        placement = looped_placement(p, rng.randint(1, n // p))
    costs = [rng.choice([rng.random(), float(rng.randint(0, 4))]) for _ in range(n)]
    split = partition(costs, len(placement), placement=placement)
    assert split.bottleneck == pytest.approx(_brute(costs, len(placement), placement), abs=1e-9)
    assert max(split.device_cost) == split.bottleneck
    _check_cover(split.parts, split.boundaries, n)


def test_v_placement_splits_64_layers() -> None:
    """64 layers into 16 stages on 8 devices (its speed: benchmarks/results/partition_speed.md)."""
    rng = random.Random(0)
    costs = [rng.uniform(0.5, 2.0) for _ in range(64)]
    split = partition(costs, 16, placement=v_placement(8))
    assert split.bottleneck >= sum(costs) / 8 - 1e-9
    assert max(split.device_cost) == split.bottleneck
    _check_cover(split.parts, split.boundaries, 64)


def test_time_costs_balance_unequal_layers() -> None:
    torch.manual_seed(0)
    widths = [2048, 2048, 32, 32, 32, 32, 32, 32]  # the even split puts both heavy layers on stage 0
    layers = [nn.Sequential(nn.Linear(64, w), nn.Linear(w, 64)) for w in widths]
    sample = torch.randn(512, 64)
    costs = layer_costs(layers, sample, by="time", repeats=5)
    assert len(costs) == len(layers) and all(c > 0 for c in costs)
    split = partition(costs, 4)
    even = split_layers(len(layers), 4)
    # Re-measure, so the comparison is not judged by the numbers the split was made from.
    again = layer_costs(layers, sample, by="time", repeats=5)

    def worst(parts: list[list[int]]) -> float:
        return max(sum(again[i] for i in part) for part in parts)

    assert split.parts[0] == [0]  # the heavy layers land on different stages
    assert worst(split.parts) < 0.8 * worst(even)


def test_params_and_memory_costs() -> None:
    layers = [nn.Linear(4, 8), nn.Linear(8, 2)]
    assert layer_costs(layers, torch.randn(3, 4), by="params") == [40.0, 18.0]
    memory = layer_costs(layers, torch.randn(3, 4), by="memory", optimizer_factor=0.0)
    # Linear saves its input for the weight gradient: 3x4 then 3x8 floats; plus its parameters once.
    assert memory == [(12 + 40) * 4.0, (24 + 18) * 4.0]


def test_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"cannot split 6 layers into 8 stages: at most 6") as err:
        partition([1.0] * 6, 8)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="params, time, memory") as err:
        layer_costs([nn.Linear(2, 2)], torch.randn(1, 2), by="flops")
    assert "\n" not in str(err.value)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["partition", "--model", "mlp", "--layers", "6", "--hidden", "32", "--batch", "4", "--devices", "2",
            "--chunks", "2", "--by", "params", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    result = json.loads(out)
    assert result["boundaries"][0] == 0 and len(result["boundaries"]) == 4
    assert len(result["cost"]) == 4 and result["placement"] == [0, 1, 0, 1]
    assert result["schedule"] == "interleaved-1f1b:v=2" and len(result["device_peak_bytes"]) == 2
    assert result["device_peak_bytes"] == pytest.approx(
        [s + a for s, a in zip(result["device_static_bytes"], result["device_activation_bytes"], strict=True)])


def test_cli_memory_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["partition", "--model", "mlp", "--layers", "8", "--hidden", "32", "--batch", "4", "--devices", "2",
            "--schedule", "zb-v", "--by", "memory", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["by"] == "memory" and result["placement"] == [0, 1, 1, 0]
    assert result["bottleneck"] == max(result["device_peak_bytes"]) and len(result["device_peak_bytes"]) == 2
    # A stage's cost is its share of its device's peak, so a device's stages add up to its peak.
    for d, peak in enumerate(result["device_peak_bytes"]):
        assert sum(c for c, dev in zip(result["cost"], result["placement"], strict=True) if dev == d) == (
            pytest.approx(peak))
    assert max(result["device_time_s"]) <= 1.02 * result["time_optimal_s"] * (1 + 1e-9)


def test_cli_error_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["partition", "--model", "mlp", "--layers", "4", "--hidden", "16", "--devices", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pipefold partition: error: cannot split 4 layers into 8 stages: at most 4"


# --------------------------------------------------------------------------- memory-aware split


def _replay_peak(schedule: Schedule, device: int, held: list[float], held_w: list[float]) -> float:
    """Activation peak of one device's action order: F start +held, B end +(held_w - held), W end -held_w,
    fused BW end -held (per stage and microbatch)."""
    level = peak = 0.0
    for a in schedule.actions[device]:
        if a.kind == Kind.F:
            level += held[a.stage]
        peak = max(peak, level)
        if a.kind == Kind.B:
            level += held_w[a.stage] - held[a.stage]
        elif a.kind == Kind.W:
            level -= held_w[a.stage]
        elif a.kind == Kind.BW:
            level -= held[a.stage]
        peak = max(peak, level)
    return peak


def _judge(schedule: Schedule, bounds: list[int], by_device: list[list[list[int]]]) -> tuple[float, float]:
    """(largest device peak, largest device time) of one split, worked out from the action orders; each stage's
    figures are those of its device (``by_device[d]``: times, held, held_w and static of every layer there)."""
    ends = [*bounds[1:], len(by_device[0][0])]
    times, held, held_w, static = ([sum(by_device[d][k][lo:hi]) for d, lo, hi in
                                    zip(schedule.placement[0], bounds, ends, strict=True)] for k in range(4))
    peaks, loads = [], []
    for d in range(schedule.devices):
        mine = [s for s, dev in enumerate(schedule.placement[0]) if dev == d]
        loads.append(sum(times[s] for s in mine))
        peaks.append(sum(static[s] for s in mine) + _replay_peak(schedule, d, held, held_w))
    return max(peaks), max(loads)


def _brute_memory(schedule: Schedule, by_device: list[list[list[int]]], slack: float) -> tuple[float, float]:
    """The least (peak, time) over every contiguous split within (1 + slack) of the least time."""
    n, stages = len(by_device[0][0]), schedule.stages
    judged = [_judge(schedule, [0, *cut], by_device) for cut in itertools.combinations(range(1, n), stages - 1)]
    fastest = min(time for _, time in judged)
    return min((peak, time) for peak, time in judged if time <= fastest * (1 + slack))


MEMORY_SCHEDULES = [("1f1b", 2), ("1f1b", 3), ("zb-h1", 2), ("zb-h1", 3), ("gpipe", 2), ("zb-v", 2),
                    ("v-half", 2), ("v-min", 2), ("interleaved-1f1b:v=2", 2), ("interleaved-1f1b:v=3", 2)]


@pytest.mark.parametrize(("spec", "p"), MEMORY_SCHEDULES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_memory_split_against_brute_force(spec: str, p: int, data: st.DataObject) -> None:
    name, _, option = spec.partition(":v=")
    m = data.draw(st.integers(1, 3 * p), label="microbatches")
    schedule = schedules.build(name, p, m, **({"v": int(option)} if option else {}))
    n = data.draw(st.integers(max(6, schedule.stages), 9), label="layers")
    figures = [data.draw(st.lists(st.integers(low, 9), min_size=n, max_size=n), label=label)
               for label, low in (("times", 1), ("held", 0), ("held_w", 0), ("static", 0))]
    slack = data.draw(st.sampled_from([0.0, 0.02, 0.25, 1.0]), label="slack")
    split = partition_memory(*figures, schedule, slack=slack)
    _check_cover(split.parts, split.boundaries, n)
    assert (split.peak_bytes, split.bottleneck_time) == _brute_memory(schedule, [figures] * schedule.devices, slack)
    assert split.time_optimal == _brute(figures[0], schedule.stages, schedule.placement[0])
    assert split.bottleneck_time <= split.time_optimal * (1 + slack) + 1e-9
    # What it reports is its own split's, device by device; the weights rebuild each activation peak.
    held, held_w = ([sum(f[i] for i in part) for part in split.parts] for f in figures[1:3])
    for d in range(schedule.devices):
        mine = schedule.stages_of(d)
        assert split.device_activation_bytes[d] == _replay_peak(schedule, d, held, held_w)
        assert split.device_activation_bytes[d] == sum(split.weights[s] * held[s] + split.weights_w[s] * held_w[s]
                                                        for s in mine)


@pytest.mark.parametrize(("spec", "p"), MEMORY_SCHEDULES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_memory_split_over_devices_of_their_own_figures_against_brute_force(spec: str, p: int,
                                                                            data: st.DataObject) -> None:
    """Devices of different tensor-parallel degrees run and hold a layer differently: each device has its own
    figures. The split with the least largest peak within the slack of the fastest split over those devices,
    against every split judged by the action orders; and alike figures give :func:`partition_memory`'s answer."""
    from pipefold.plan.partition import memory_of_split_on_devices, partition_memory_on_devices, partition_on_devices

    name, _, option = spec.partition(":v=")
    m = data.draw(st.integers(1, 3 * p), label="microbatches")
    schedule = schedules.build(name, p, m, **({"v": int(option)} if option else {}))
    n = data.draw(st.integers(max(6, schedule.stages), 8), label="layers")
    by_device = [[data.draw(st.lists(st.integers(low, 9), min_size=n, max_size=n), label=f"{label} on {d}")
                  for label, low in (("times", 1), ("held", 0), ("held_w", 0), ("static", 0))]
                 for d in range(schedule.devices)]
    slack = data.draw(st.sampled_from([0.0, 0.02, 0.25, 1.0]), label="slack")
    split = partition_memory_on_devices([tuple(f) for f in by_device], schedule, slack=slack)  # type: ignore[misc]
    _check_cover(split.parts, split.boundaries, n)
    assert (split.peak_bytes, split.bottleneck_time) == _brute_memory(schedule, by_device, slack)
    assert split.time_optimal == partition_on_devices([f[0] for f in by_device], schedule.placement[0]).bottleneck
    again = memory_of_split_on_devices(split.boundaries, [tuple(f) for f in by_device], schedule)  # type: ignore[misc]
    assert again.device_peak_bytes == split.device_peak_bytes and again.device_time == split.device_time
    alike = partition_memory_on_devices([tuple(by_device[0])] * schedule.devices, schedule, slack=slack)  # type: ignore[misc]
    assert alike == partition_memory(*by_device[0], schedule, slack=slack)


def test_memory_split_unloads_the_long_lived_device() -> None:
    """1F1B holds p-i microbatches on device i: with equal layers the time split gives device 0 the most."""
    schedule = schedules.build("1f1b", 4, 8)
    n = 16
    times, held, held_w, static = [1.0] * n, [10.0] * n, [10.0] * n, [1.0] * n
    by_time = memory_of_split(partition(times, 4).boundaries, times, held, held_w, static, schedule)
    # One layer more on a device is 25% more time: allow that, or nothing can move.
    split = partition_memory(times, held, held_w, static, schedule, slack=0.25)
    assert [len(part) for part in by_time.parts] == [4, 4, 4, 4]
    assert len(split.parts[0]) < 4 and split.peak_bytes < by_time.peak_bytes
    assert by_time.device_peak_bytes[0] == 4 * (4 * 10.0) + 4 * 1.0  # 4 microbatches of 4 layers, and the weights
    assert split.weights == [4, 3, 2, 1] and split.bottleneck_time <= 5.0
    # Within 2% of the best time nothing can move here.
    assert partition_memory(times, held, held_w, static, schedule).boundaries == [0, 4, 8, 12]


def test_memory_split_v_first_chunk_lives_longer() -> None:
    """Under zb-v a device's first chunk holds more microbatches at its peak than its second."""
    schedule = schedules.build("zb-v", 4, 8)
    split = partition_memory([1.0] * 32, [1.0] * 32, [1.0] * 32, [0.0] * 32, schedule, slack=0.5)
    first, second = (sum(len(split.parts[s]) for s in range(lo, hi)) for lo, hi in ((0, 4), (4, 8)))
    assert first < second
    assert all(split.weights[d] > split.weights[7 - d] for d in range(3))


def test_memory_split_bad_input() -> None:
    schedule = schedules.build("1f1b", 2, 2)
    good = [1.0, 2.0, 3.0]
    cases = [
        (([1.0, 2.0], good, good, good), "times 2, held 3, held_w 3, static 3"),
        ((good, [1.0, -1.0, 2.0], good, good), r"held\[1\] must be a finite number >= 0 \(got -1.0\)"),
        ((good, good, [1.0, float("nan"), 2.0], good), r"held_w\[1\] must be a finite number >= 0 \(got nan\)"),
        ((good, good, good, [float("inf"), 1.0, 1.0]), r"static\[0\] must be a finite number >= 0"),
    ]
    for figures, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            partition_memory(*figures, schedule)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"cannot split 3 layers into 4 stages: at most 3"):
        partition_memory(good, good, good, good, schedules.build("zb-v", 2, 2))
    with pytest.raises(ConfigError, match=r"slack .* >= 0 \(got -0.1\)"):
        partition_memory(good, good, good, good, schedule, slack=-0.1)
    with pytest.raises(ConfigError, match=r"boundaries \[0, 3\] do not split 3 layers into 2 non-empty stages"):
        memory_of_split([0, 3], good, good, good, good, schedule)


def test_layer_memory_and_static_bytes() -> None:
    layers = [nn.Linear(4, 8), nn.Linear(8, 2)]
    # After F a Linear holds its input (3x8 floats for the second; the first's is the batch, not counted).
    # Between B and W: the first layer keeps the gradient of its output (3x8) for W, which runs its whole backward
    # (its input is the batch); the second keeps its input and the gradient entering it (3x2).
    assert layer_memory(layers, torch.randn(3, 4)) == [(0, 24 * 4), (24 * 4, 24 * 4 + 6 * 4)]
    assert layer_static_bytes(layers) == [40 * 4 * 4.0, 18 * 4 * 4.0]  # weights, gradients, two AdamW moments
    assert layer_static_bytes(layers, optimizer_factor=0.0) == [40 * 4 * 2.0, 18 * 4 * 2.0]


def test_train_partition_memory_splits_by_the_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipefold.plan.partition

    seen: list[tuple[Schedule, list[float]]] = []

    def recording(times: list[float], held: list[float], held_w: list[float], static: list[float],
                  schedule: Schedule, **kw: float) -> pipefold.plan.partition.MemoryPartition:
        seen.append((schedule, static))
        return partition_memory(times, held, held_w, static, schedule, **kw)

    monkeypatch.setattr(pipefold.plan.partition, "partition_memory", recording)
    config = RunSpec.flat(model="mlp", layers=6, hidden=16, devices=2, schedule="zb-v", microbatches=4, batch=8,
                         partition="memory", optimizer="sgd")
    job = make_job(config)
    (schedule, static), = seen
    assert schedule.actions == job.schedule.actions  # the job's own schedule decides the in-flight counts
    assert static[1] == 2128 * 4 * 2.0  # one block: 2,128 float parameters, their gradients, no SGD state
    assert len(job.layer_stages) == 4 and [i for part in job.layer_stages for i in part] == list(range(6))

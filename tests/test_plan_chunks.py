"""The budget planner with model-state chunks (``plan --profile ... --state-chunks``): which layouts it searches,
the state it predicts on each device against a replay of the placement rule, and when it picks chunks."""

from __future__ import annotations

import json

import pytest

from pipefold.errors import ConfigError
from pipefold.plan.budget import Layout, chunk_state, plan_model, predict, read_plan
from pipefold.plan.profile import LayerProfile, Profile

TENSOR = 300_000
"""Bytes of each of a block's two tensors (75,000 float32 values)."""


def _profile(n: int = 6, optimizer_factor: float = 2.0) -> Profile:
    """An embedding, n - 2 blocks of two tensors each, a head; AdamW's state (2 parameter sizes)."""
    block = LayerProfile(f=2e-3, b=3e-3, w=2e-3, held=200_000, held_w=150_000, params=2 * TENSOR, out=8192,
                         tensors=(TENSOR, TENSOR), update=1e-4)
    layers = (LayerProfile(f=1e-4, b=1e-5, w=2e-4, held=1000, held_w=500, params=40_000, out=8192,
                           tensors=(40_000,), update=1e-5),
              *(block for _ in range(n - 2)),
              LayerProfile(f=1e-3, b=1e-3, w=5e-4, held=50_000, held_w=40_000, params=60_000, out=0,
                           tensors=(60_000,), update=1e-5))
    return Profile(train={"model": "gpt", "layers": n - 2, "hidden": 32, "heads": 2, "seq": 16, "batch": 16,
                          "microbatches": 8, "optimizer": "adamw", "seed": 0},
                   layers=layers, latency=5e-5, bandwidth=2e9, contention=(1.0,) * 8,
                   optimizer_factor=optimizer_factor)


def _replay(values: list[int], states: int, free: float) -> int:
    """The placement written out: the chunk capacity is the smallest power of two from 64 Ki values that holds the
    largest tensor and wastes the least; chunks filled in order, a tensor never split; each chunk's state on the
    device while the free bytes still hold it."""
    best = None
    for k in range(16, 25):
        cap = 1 << k
        if cap < max(values):
            continue
        chunks, used = 1, 0
        for v in values:
            if used + v > cap:
                chunks, used = chunks + 1, 0
            used += v
        waste = chunks * cap - sum(values)
        if best is None or waste < best[0]:
            best = (waste, cap, chunks)
    assert best is not None
    _, cap, chunks = best
    placed = 0
    for _ in range(chunks):
        if 4 * states * cap <= free:
            free -= 4 * states * cap
            placed += 4 * states * cap
    return placed


@pytest.mark.parametrize("room", [0, 2e6, 3e6, 5e6, 8e6, 1e9])
def test_the_state_on_each_device_is_the_placement_rule_replayed(room: float) -> None:
    prof = _profile(8)
    layout = Layout(1, 1, 2, chunks=True)
    stages = ((0, 1, 2, 3), (4, 5, 6, 7))
    _, peaks, static = predict(prof, layout, "1f1b", stages, room=room)
    plain_result, _, plain_static = predict(prof, Layout(1, 1, 2), "1f1b", stages)
    for d, part in enumerate(stages):
        params = sum(prof.layers[i].params for i in part)
        values = [t // 4 for i in part for t in prof.layers[i].tensors]
        activations = peaks[d] - static[d]
        want = _replay(values, 2, room - 2 * params - activations)
        assert static[d] == 2 * params + want  # the weights and gradients, and the state placed on the device
        assert plain_static[d] == 4 * params  # and without chunks, AdamW's whole state
        assert want == chunk_state(prof, plain_result.schedule, stages, [2 * params] * 2, [activations] * 2,
                                   room)[d]


def _least(prof: Profile, plan_points: list, chunks: bool) -> float:
    """The least peak of the points, each with chunks holding none of its state on the device (what it needs of
    the budget at the least)."""
    return min(max(predict(prof, p.layout, p.spec, p.layer_stages, p.recompute, room=0)[1]) if chunks else p.memory
               for p in plan_points if p.layout.chunks == chunks)


def test_the_planner_takes_chunks_where_the_whole_state_does_not_fit() -> None:
    """Searched with chunks, every plain layout is searched again with them. The answer has chunks only where they
    make the step faster than the plain plan (less recomputation, a schedule that holds more), and none where
    everything fits (as fast, they only hold host memory); between the least peak chunks reach and the plain one's,
    chunks; below both, one line naming the smallest peak, a chunks one."""
    prof, families = _profile(8), ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"]
    wide = plan_model(prof, 2, 1e12, chunks=True, families=families)
    assert {p.layout for p in wide.points} == {Layout(1, 1, 2), Layout(1, 1, 2, chunks=True)}
    plain_least, chunks_least = _least(prof, wide.points, False), _least(prof, wide.points, True)
    assert chunks_least < plain_least
    for budget in (1e12, *(plain_least * f for f in (1.06, 1.1, 1.2, 1.4, 1.7, 2.0))):
        with_chunks = plan_model(prof, 2, budget, chunks=True, families=families)
        without = plan_model(prof, 2, budget, families=families)
        if with_chunks.best.layout.chunks:  # only where they make it faster
            assert with_chunks.best.makespan < without.best.makespan
        else:
            assert with_chunks.best == without.best
    assert not plan_model(prof, 2, 1e12, chunks=True, families=families).best.layout.chunks
    between = plan_model(prof, 2, 1.06 * (chunks_least + plain_least) / 2, chunks=True, families=families)
    assert between.best.layout.chunks and between.run_plan.chunks
    assert max(between.best.peak_memory) <= between.room
    with pytest.raises(ConfigError, match=r"no plan fits 1.9 MiB .*smallest predicted peak is .* chunks "):
        plan_model(prof, 2, 2e6, chunks=True, families=families)


def test_a_chunks_plan_file_round_trips_and_is_checked(tmp_path) -> None:
    prof = _profile(8)
    plain_least = _least(prof, plan_model(prof, 2, 1e12, families=["1f1b", "zb-h1"]).points, False)
    answer = plan_model(prof, 2, 0.95 * plain_least, chunks=True, families=["1f1b", "zb-h1"])
    path = tmp_path / "plan.json"
    data = answer.to_dict()
    assert data["state_chunks"] is True and data["frontier"][0]["state_chunks"] in (True, False)
    path.write_text(json.dumps(data))
    again = read_plan(str(path))
    assert again["state_chunks"] is True and again["room_bytes"] == pytest.approx(answer.room)
    for bad in ("yes", None):
        path.write_text(json.dumps({**data, "state_chunks": bad}))
        with pytest.raises(ConfigError, match="state_chunks is true or false"):
            read_plan(str(path))
    path.write_text(json.dumps({**data, "room_bytes": None}))
    with pytest.raises(ConfigError, match="with room_bytes"):
        read_plan(str(path))


def test_chunks_that_cannot_run_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="model-state chunks run with plain copies of plain stages"):
        Layout(2, 1, 2, "zero1", chunks=True)
    with pytest.raises(ConfigError, match="model-state chunks run with plain copies of plain stages"):
        Layout(1, 2, 2, chunks=True)
    with pytest.raises(ConfigError, match=r"optimizer \(adamw\) keeps no state to put in chunks"):
        plan_model(_profile(8, optimizer_factor=0.0), 2, 1e12, chunks=True)
    with pytest.raises(ConfigError, match="give a world with such a layout"):
        plan_model(_profile(8), 4, 1e12, chunks=True, layouts=[Layout(2, 1, 2, "zero1")])

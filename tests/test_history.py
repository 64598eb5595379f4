"""What a rank keeps of its steps: every step's numbers, full records only where needed, memory flat in the steps."""

from __future__ import annotations

import json
import math
import pickle
import random
import tracemalloc
from pathlib import Path

import pytest

from pipefold.runtime.executor import Event, StepStats
from pipefold.runtime.history import StepHistory, StepNotKept


def _stats(step: int, rng: random.Random) -> StepStats:
    """A step's record as heavy as a real one of a small schedule: 40 events, a memory curve, link samples."""
    t = 0.0
    events = []
    for k in range(40):
        d = rng.random() * 1e-3
        events.append(Event(f"{k % 4}{'FB'[k % 2]}{k // 4}", "recv" if k % 5 == 0 else "F", t, t + d))
        t += d
    return StepStats(rank=1, losses={0: rng.random(), 1: rng.random()}, events=events, busy=rng.random(),
                     wall=t, cpu=rng.random(), peak_activation_bytes=rng.randrange(10**6), started_at=1e9 + step,
                     memory_curve=[(i * 1e-4, rng.randrange(10**6)) for i in range(60)],
                     link_samples={0: [(i, 4096, 1e9 + i, 1e9 + i + 1e-3) for i in range(16)]},
                     recv_posted={0: {i: 1e9 + i for i in range(16)}}, schedule=f"kfkb:k={1 + step % 2}",
                     predicted=None if step % 3 else 0.5)


def test_columns_hold_every_step_and_records_only_the_kept() -> None:
    rng = random.Random(0)
    steps = [_stats(i, rng) for i in range(100)]
    h = StepHistory(keep_first=5, keep=[50])
    for st in steps:
        h.add(st)
    assert len(h) == 100 and h.kept() == [0, 1, 2, 3, 4, 50, 99]
    assert h.settled(1) == [1, 2, 3, 4, 50, 99] and h.settled(60) == [99] and h.settled(100) == [99]
    assert h[0] is steps[0] and h[50] is steps[50] and h[-1] is steps[99]
    # The columns against the records themselves, step by step.
    assert list(h.loss_sum) == [math.fsum(st.losses.values()) for st in steps]
    assert list(h.loss_count) == [2] * 100
    assert list(h.wall) == [st.wall for st in steps] and list(h.busy) == [st.busy for st in steps]
    assert list(h.cpu) == [st.cpu for st in steps] and list(h.started_at) == [st.started_at for st in steps]
    assert list(h.wait) == [math.fsum(e.end - e.start for e in st.events if e.kind == "recv") for st in steps]
    assert h.peak_activation_bytes == max(st.peak_activation_bytes for st in steps)
    assert [h.schedule(i) for i in range(100)] == [st.schedule for st in steps]
    assert [h.prediction(i) for i in range(100)] == [st.predicted for st in steps]
    with pytest.raises(StepNotKept, match="step 7 was not kept"):
        h[7]
    with pytest.raises(IndexError):
        h[100]
    # Iterating over all steps cannot end early in silence at a dropped record.
    with pytest.raises(StepNotKept):
        list(h)
    assert h[0:3] == steps[0:3]
    # It travels (the launcher gets it by pickle) whole.
    back = pickle.loads(pickle.dumps(h))
    assert back.kept() == h.kept() and list(back.wall) == list(h.wall)


def test_memory_is_flat_in_the_number_of_steps() -> None:
    """Python's own allocation tracker: keeping 1,800 more steps costs the history tens of bytes a step, and a
    plain list of the same records (what a rank kept before) kilobytes a step."""
    rng = random.Random(1)

    def growth(keep_all: bool) -> float:
        kept: list[StepStats] = []
        h = StepHistory(keep_first=20)
        tracemalloc.start()
        try:
            for i in range(2000):
                st = _stats(i, rng)
                if keep_all:
                    kept.append(st)
                else:
                    h.add(st)
                if i == 199:
                    at_200 = tracemalloc.get_traced_memory()[0]
            return (tracemalloc.get_traced_memory()[0] - at_200) / 1800
        finally:
            tracemalloc.stop()

    per_step = growth(False)
    before = growth(True)
    assert per_step < 200, per_step  # arrays of 9 numbers a step, with their growth slack
    assert before > 5000, before  # the tracker does see a growing list of records


def test_a_long_run_keeps_the_first_and_last_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run of 25 steps (more than the 20 kept in full): the summary has every step's loss and time, the loss of
    the first step is the one-process reference's, and the trace has the steps kept in full."""
    from pipefold.cli.main import main

    trace = tmp_path / "run.json"
    code = main(["train", "--schedule", "1f1b", "--devices", "2", "--model", "mlp", "--layers", "4", "--hidden",
                 "16", "--batch", "8", "-m", "2", "--steps", "25", "--partition", "even", "--check", "--json",
                 "--trace", str(trace)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["loss"]) == 25 and len(out["step_time_s"]) == 25 and min(out["step_time_s"]) > 0
    assert out["loss"][0] == pytest.approx(out["reference_loss"], rel=1e-6) and out["max_grad_rel_diff"] < 1e-5
    assert out["loss"][-1] < out["loss"][0]
    steps = {e["args"]["step"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert steps == set(range(1, 21)) | {25}  # numbered from 1

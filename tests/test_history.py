"""What a rank keeps of its steps: every step's numbers, full records only where needed, memory flat in the steps."""

from __future__ import annotations

import json
import math
import pickle
import random
import statistics
import tracemalloc
from pathlib import Path

import pytest

from pipefold.runtime.executor import Event, StepStats
from pipefold.runtime.history import StepHistory, StepNotKept, unchecked


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


def test_a_checked_step_is_left_out_of_timings() -> None:
    """Steps checked as well (torch's MemTracker, --check's gradients) are slower: timings read the others, and
    all of them where every one was checked."""
    rng = random.Random(2)
    h = StepHistory(keep_first=3, keep=[6])
    for i in range(8):
        st = _stats(i, rng)
        st.checked = i in (2, 6)
        h.add(st)
    assert list(h.checked) == [0, 0, 1, 0, 0, 0, 1, 0]
    assert h.timed(1) == [1, 3, 4, 5, 7] and h.settled(1) == [1, 7]  # kept in full: 0, 1, 2, 6 and the last
    assert h.timed(7) == [7] and h.timed(8) == [7] and h.timed(0) == [0, 1, 3, 4, 5, 7]
    only = StepHistory(keep_first=3, keep=[1])
    for i in range(2):
        st = _stats(i, rng)
        st.checked = i == 1
        only.add(st)
    assert only.timed(1) == [1] and only.settled(1) == [1]  # nothing plain after the warm-up: the checked one
    assert unchecked("abc", [False, True, False]) == ["a", "c"] and unchecked("ab", [True, True]) == ["a", "b"]
    with pytest.raises(ValueError):
        unchecked("ab", [True])


@pytest.mark.parametrize("checks", [{"verify_memory_step": 2}, {"save_grads_of_step": 1},
                                    {"verify_memory_step": 3, "save_grads_of_step": 2}])
def test_a_run_times_the_steps_it_did_not_check(checks: dict[str, int]) -> None:
    """A real run of 5 steps on 2 ranks with a step measured by torch's MemTracker, one that saved its gradients
    for --check, or both: every rank marks those steps, and the run's measurement (step time, its spread, busy
    time, the parts of a step) reads the other steps after the first, recomputed here from the ranks' columns."""
    import dataclasses

    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.measure.timeline import measured_summary, step_parts
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    job = make_job(RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, steps=5, model="mlp", layers=4,
                                hidden=32, batch=16, partition="even"))
    reports = run_local(dataclasses.replace(job, **checks))
    checked = sorted(checks.values())
    plain = [i for i in range(1, 5) if i not in checked]
    for r in reports:
        assert [i for i in range(5) if r.steps.checked[i]] == checked
        assert r.steps.timed(1) == plain == r.steps.settled(1)
    got = measured_summary(reports)
    assert got["steps"] == plain
    walls = [max(r.steps.started_at[i] + r.steps.wall[i] + r.steps.update[i] for r in reports)
             - min(r.steps.started_at[i] for r in reports) for i in plain]
    assert got["step_time_s"] == pytest.approx(statistics.median(walls))
    assert got["step_time_spread_s"] == pytest.approx([min(walls), max(walls)])
    schedule = statistics.median(max(r.steps.started_at[i] + r.steps.wall[i] for r in reports)
                                 - min(r.steps.started_at[i] for r in reports) for i in plain)
    busy = sum(statistics.median(r.steps.busy[i] for i in plain) for r in reports)
    assert got["bubble_ratio"] == pytest.approx(1 - busy / (2 * schedule))
    for r, part in zip(reports, step_parts(reports), strict=True):
        assert part["step"] == pytest.approx(statistics.median(r.steps.wall[i] for i in plain))


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
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in events} == set(range(1, 21)) | {25}  # numbered from 1
    # Every pass carries its CPU time, within its interval; waits for a message carry none.
    passes = [e for e in events if e["cat"] in ("F", "BW")]
    assert passes and all(0 < e["args"]["cpu_us"] <= e["dur"] + 1 for e in passes)
    assert all("cpu_us" not in e["args"] for e in events if e["cat"] == "recv")


def test_a_ranks_timestamps_are_the_host_clock_anchored_once_to_the_wall_clock() -> None:
    """Differences of :func:`pipefold.runtime.clock.wall` are the host clock's (never negative), and it reads the
    wall clock as it stood when the process anchored it."""
    import itertools
    import time

    from pipefold.runtime.clock import ANCHOR, wall

    readings = [(wall(), time.perf_counter()) for _ in range(1000)]
    assert all(b[0] >= a[0] for a, b in itertools.pairwise(readings))
    assert all(0 <= ANCHOR + p - w < 0.5 for w, p in readings)  # each read just before its host clock
    assert abs(wall() - time.time()) < 1.0  # unless the wall clock was set since: then by that much

"""A pass's CPU seconds beside its wall seconds: what the operating system counts for the executor's thread, so that
a pass stretched by ranks sharing the cores shows apart from a pass that did more work."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from pipefold.runtime.executor import Event, _Clock


def _interval(clock: _Clock, work: object) -> Event:
    events: list[Event] = []
    start = clock.mark()
    work()  # type: ignore[operator]
    clock.interval(events, "0F0", "F", start)
    return events[0]


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_sleep_costs_no_cpu_and_a_spin_costs_its_wall_time() -> None:
    clock = _Clock(torch.device("cpu"), time.perf_counter())
    slept = _interval(clock, lambda: time.sleep(0.05))
    assert slept.end - slept.start >= 0.05
    assert slept.cpu is not None and slept.cpu < 0.01
    spun = _interval(clock, lambda: _spin(0.05))
    assert spun.cpu is not None and 0.05 <= spun.cpu <= spun.end - spun.start + 1e-6


def _busy(core: int, stop: float, spinning: object) -> None:
    os.sched_setaffinity(0, {core})
    spinning.set()  # type: ignore[attr-defined]
    while time.time() < stop:
        pass


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux's CPU affinity")
def test_a_pass_sharing_its_core_takes_about_twice_its_cpu_time() -> None:
    """The reference is the scheduler's fair share: one process spinning on the same core as the pass, so the
    pass gets about half the core (more where something else also runs there, never much less)."""
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    ctx = multiprocessing.get_context("spawn")
    spinning = ctx.Event()
    other = ctx.Process(target=_busy, args=(core, time.time() + 60.0, spinning), daemon=True)
    other.start()
    try:
        os.sched_setaffinity(0, {core})
        assert spinning.wait(50.0), "the spinning process did not start"
        clock = _Clock(torch.device("cpu"), time.perf_counter())
        shared = _interval(clock, lambda: _spin(0.3))
    finally:
        os.sched_setaffinity(0, before)
        other.kill()
        other.join()
    assert shared.cpu is not None and shared.cpu >= 0.3
    assert (shared.end - shared.start) / shared.cpu > 1.6


def test_a_runs_passes_carry_their_cpu_time_within_their_wall_time_and_the_process() -> None:
    """A real 2-rank run: every pass's CPU time lies within its interval, and a step's passes use no more CPU than
    the rank's whole process (``time.process_time``, another clock of the operating system's)."""
    from pipefold.runtime.executor import COMPUTE_KINDS
    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.measure.timeline import step_parts
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    job = make_job(RunSpec.flat(schedule="zb-h1", devices=2, microbatches=4, steps=3, model="mlp", layers=4,
                                hidden=64, batch=16, partition="even"))
    reports = run_local(job)
    for r in reports:
        for i in r.steps.settled(0):
            passes = [e for e in r.steps[i].events if e.kind in COMPUTE_KINDS]
            assert {e.kind for e in passes} == {"F", "B", "W"}
            for e in passes:
                assert e.cpu is not None and 0.0 <= e.cpu <= e.end - e.start + 1e-6, e
            assert all(e.cpu is None for e in r.steps[i].events if e.kind == "recv")
    for part in step_parts(reports):
        assert 0.0 < part["compute cpu"] <= part["compute"] + 1e-6
        assert part["compute cpu"] <= part["cpu"] + 1e-6

"""Stages held by two replicas (Chimera, DualPipe): real gloo ranks against one process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipefold import Schedule
from pipefold.ir import BW, OPT, F, R, linear_placement, reversed_placement
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.launch.settings import OPTIMIZERS
from pipefold.runtime.stage import Chain
from pipefold.train.prepare import make_job
from pipefold.train.spec import RunSpec


def _two_way(m: int) -> Schedule:
    """p=2: even microbatches down (stage s on device s), odd ones up (stage s on device 1-s), GPipe-like."""
    down, up = range(0, m, 2), range(1, m, 2)
    rows = [
        [*(F(0, j) for j in down), *(F(1, j) for j in up), *(BW(1, j) for j in up), *(BW(0, j) for j in down)],
        [*(F(0, j) for j in up), *(F(1, j) for j in down), *(BW(1, j) for j in down), *(BW(0, j) for j in up)],
    ]
    rows = [[*row, R(0), R(1)] for row in rows]
    return Schedule("two-way", 2, 2, m, (linear_placement(2), reversed_placement(2)), rows,
                    routes=tuple(j % 2 for j in range(m)))


def _job(steps: int, **more):
    cfg = RunSpec.flat(schedule="gpipe", devices=2, microbatches=4, steps=steps, model="mlp", layers=4, hidden=16,
                      batch=8, partition="even", lr=1e-2)
    return replace(make_job(cfg), **{"schedule": _two_way(4), **more})


def _one_process_weights(job, steps: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The weights after ``steps`` steps of one process with the job's optimizer on the whole batch."""
    n = job.extra["num_layers"]
    layers = job.build_layers(list(range(n)))
    model = Chain(*(layers[i] for i in range(n)))
    opt = OPTIMIZERS[str(job.optimizer.name)](list(model.parameters()), lr=job.optimizer.lr)
    m = job.schedule.microbatches
    for step in range(steps):
        x, y = job.batch_at(step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            (job.loss_fn(model(xs), ys) / m).backward()
        opt.step()
    return {f"{i}.{name}": p.detach() for i in range(n) for name, p in layers[i].named_parameters()}


def test_replicas_stay_identical_over_several_steps_and_train_as_one_process() -> None:
    steps = 4
    job = _job(steps, save_weights=True)
    reports = run_local(job)
    a, b = (r.weights or {} for r in reports)
    assert set(a) == set(b) and a
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bit for bit: the same sum, the same update
    # One process with the same optimizer, the whole batch per step: the same weights.
    for name, w in _one_process_weights(job, steps).items():
        torch.testing.assert_close(a[name], w, rtol=1e-5, atol=1e-6)  # summation order only
    m = job.schedule.microbatches
    first = sum(sum(r.steps[0].losses.values()) for r in reports) / m
    last = sum(sum(r.steps[-1].losses.values()) for r in reports) / m
    assert last < first


def test_optimizer_steps_in_the_schedule_train_as_after_it() -> None:
    """OPT actions step each stage's optimizer as soon as its gradients are reduced: the same weights."""
    s = _two_way(4)
    with_opt = s.with_actions([[*row, OPT(0), OPT(1)] for row in s.actions])
    after = run_local(_job(3, save_weights=True))
    inside = run_local(_job(3, save_weights=True, schedule=with_opt))
    for a, b in zip(after, inside, strict=True):
        for name, w in (a.weights or {}).items():
            assert torch.equal(w, (b.weights or {})[name]), name


def test_the_runtime_refuses_kinds_it_cannot_run() -> None:
    from pipefold.errors import ConfigError
    from pipefold.runtime.executor import RankExecutor

    s = _two_way(2)
    bad = s.with_actions([[*row, OPT(0), OPT(1)] for row in s.actions])
    with pytest.raises(ConfigError, match="the runtime cannot run OPT actions"):
        RankExecutor(bad, 0, {}, lambda *a: torch.zeros(()), torch.device("cpu"))
    with pytest.raises(ConfigError, match="steps some stages' optimizers itself .* not stage 1 on device 0"):
        _job(1, schedule=s.with_actions([[*s.actions[0], OPT(0)], [*s.actions[1], OPT(0), OPT(1)]]))


@pytest.mark.parametrize(("name", "p"), [("chimera", 2), ("dualpipe", 4)])
def test_generated_replicated_schedules_keep_replicas_identical(name: str, p: int) -> None:
    """After several optimizer steps each stage's two copies (on devices s and p-1-s) are equal bit for bit,
    and equal to one process trained on the whole batch."""
    m, steps = 2 * p, 3
    cfg = RunSpec.flat(schedule=name, devices=p, microbatches=m, steps=steps, model="mlp", layers=2 * p, hidden=16,
                      batch=2 * m, partition="even", lr=1e-2)
    job = replace(make_job(cfg), save_weights=True)
    reports = run_local(job)
    copies: dict[str, list[torch.Tensor]] = {}
    for r in reports:
        for key, w in (r.weights or {}).items():
            copies.setdefault(key, []).append(w)
    assert copies and all(len(ws) == 2 for ws in copies.values())  # every stage on two devices
    for key, (a, b) in copies.items():
        assert torch.equal(a, b), key
    for key, w in _one_process_weights(job, steps).items():
        torch.testing.assert_close(copies[key][0], w, rtol=1e-5, atol=1e-6)


def test_splitting_by_memory_refuses_replicas_in_one_line() -> None:
    from pipefold.errors import ConfigError

    cfg = RunSpec.flat(schedule="chimera", devices=2, microbatches=4, model="mlp", layers=4, batch=8,
                       partition="memory")
    with pytest.raises(ConfigError, match="chimera has 2 replicas: split chimera by time, params or even"):
        make_job(cfg)

"""K-FAC over data-parallel copies on real gloo ranks: DP-KFAC (each layer's factors on one copy) and D-KFAC (every
factor on every copy) make the updates of one process running K-FAC over the whole batch, and the same as each
other; the bytes and state each copy counts as it runs are those of the closed forms in :mod:`pipefold.plan.dpkfac`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipefold.errors import ConfigError
from pipefold.ir import Kind
from pipefold.plan.dpkfac import Layer, assign, layer_cost, predict
from pipefold.runtime.launch.job import Job, RankReport
from pipefold.runtime.launch.local import run_local
from pipefold.train.prepare import make_job
from pipefold.train.reference import compare, reference_kfac
from pipefold.train.spec import RunSpec


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - v).abs().max() / (v.abs().max() + 1e-12)) for k, v in want.items())


def _copies(reports: list[RankReport], job: Job) -> list[dict[str, torch.Tensor]]:
    """Each data-parallel copy's weights, named as the reference names them."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(job.parallel.copies)]
    for r in reports:
        out[job.coords(r.rank)[0]].update(r.weights or {})
    return out


def _without_inversions(job: Job) -> Job:
    cycle = tuple(s.with_actions([[a for a in row if a.kind != Kind.KI] for row in s.actions]) for s in job.cycle)
    return dataclasses.replace(job, schedule=cycle[0], cycle=cycle, refill=None)


def _job(distribution: str, model: dict[str, object], schedule: str, dp: int, fill: bool) -> Job:
    config = RunSpec.flat(schedule=schedule, devices=2, microbatches=2, steps=1, optimizer="kfac", dp=dp,
                          kfac_distribution=distribution, fill_bubbles=fill, lr=0.02, damping=0.05,
                          partition="even", **model)  # type: ignore[arg-type]
    job = make_job(config.replace(check=True))
    return dataclasses.replace(job, steps=2 * len(job.cycle) + 2, save_weights=True)


@pytest.mark.parametrize(("model", "schedule", "dp", "fill"), [
    (dict(model="mlp", layers=4, hidden=32, batch=16), "1f1b", 2, False),  # more features than rows: rows travel
    (dict(model="gpt", layers=4, hidden=16, heads=2, seq=16, batch=8), "zb-h1", 2, True),  # more rows: factors do
    (dict(model="mlp", layers=4, hidden=16, batch=24), "v-half", 3, False),
])
def test_dp_kfac_and_d_kfac_make_the_updates_of_one_process(model: dict[str, object], schedule: str, dp: int,
                                                             fill: bool) -> None:
    runs = {}
    for distribution in ("dp-kfac", "d-kfac"):
        job = _job(distribution, model, schedule, dp, fill)
        reports = run_local(job)
        diffs = compare(job, reports)  # the gradients before preconditioning: one process's
        assert diffs["max_grad_rel_diff"] < 1e-5, diffs
        copies = _copies(reports, job)
        want = reference_kfac(job, job.steps, reports)
        for got in copies:  # every copy holds the same weights: those of one process running K-FAC
            assert _worst(got, want) < 1e-4, distribution
        # ... and not those of the same optimizer without K-FAC (the check above could not fail otherwise).
        assert _worst(copies[0], reference_kfac(_without_inversions(job), job.steps)) > 1e-3
        runs[distribution] = copies[0]
    if not fill:  # a fill places the work again from each run's own times: two runs refresh at other steps
        assert _worst(runs["dp-kfac"], runs["d-kfac"]) < 1e-4


def test_assign_balances_within_one_layer_of_the_mean() -> None:
    costs = [layer_cost(Layer(inputs=a, outputs=g, rows=64)) for a, g in [(65, 64), (65, 256), (257, 64)] * 4]
    for copies in (2, 3, 4, 5):
        owners = assign(costs, copies)
        loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == k) for k in range(copies)]
        assert max(loads) <= sum(costs) / copies + max(costs)
        assert set(owners) == set(range(copies))


def test_dp_kfac_sends_fewer_bytes_than_d_kfac_in_the_closed_form() -> None:
    """For a transformer block's layers the factors dominate: DP-KFAC's bytes and state per copy are a fraction of
    D-KFAC's, and its work per copy shrinks with the copies."""
    d = 256
    layers = [Layer(inputs=d + 1, outputs=3 * d, rows=128), Layer(inputs=d + 1, outputs=d, rows=128),
              Layer(inputs=d + 1, outputs=4 * d, rows=128), Layer(inputs=4 * d + 1, outputs=d, rows=128)] * 4
    for p in (2, 4, 8):
        ours, theirs = predict(layers, p, "dp-kfac"), predict(layers, p, "d-kfac")
        assert max(c.total_sent for c in ours) < min(c.total_sent for c in theirs)
        assert max(c.state for c in ours) < min(c.state for c in theirs)
        assert max(c.flops for c in ours) < theirs[0].flops
    with pytest.raises(ConfigError, match="give --dp 2 or more"):
        assign([1.0], 1)


@pytest.mark.parametrize("distribution", ["dp-kfac", "d-kfac"])
def test_what_each_copy_sends_and_holds_is_the_closed_form(distribution: str) -> None:
    """MLP blocks of width 64 with 64 rows per microbatch and 2 microbatches: a refresh's 128 rows are fewer than
    G's 256 columns of the wide Linear (its rows travel with DP-KFAC) and more than the others' (their sums do).
    The bytes each copy's ranks count as they run, and the K-FAC state they hold, are those of
    :func:`pipefold.plan.dpkfac.predict` from the layers' shapes and the owners the job chose."""
    config = RunSpec.flat(schedule="1f1b", devices=2, microbatches=2, steps=2, optimizer="kfac", dp=2,
                          kfac_distribution=distribution, model="mlp", layers=2, hidden=64, batch=256,
                          partition="even")
    job = make_job(config)
    reports = run_local(job)
    layers = job.build_layers(list(range(job.extra["num_layers"])))
    owners = job.extra.get("kfac_owners", {})
    for r in reports:
        copy, device, _ = job.coords(r.rank)
        shapes, mine = [], []
        for s in job.schedule.stages_of(device):
            linears = [m for i in job.layer_stages[s] for m in layers[i].modules() if isinstance(m, torch.nn.Linear)]
            shapes += [Layer(inputs=m.in_features + 1, outputs=m.out_features, rows=64) for m in linears]
            mine += list(owners.get(s, ()))
        want = predict(shapes, 2, distribution, updates=2, owners=mine or None)[copy]
        assert r.kfac is not None
        got = r.kfac["sent"]
        for what, nbytes in want.sent.items():
            assert got.get(what, 0.0) == pytest.approx(nbytes, rel=1e-9), (r.rank, what, got, want.sent)
        assert r.kfac["state_bytes"] == want.state, (r.rank, r.kfac, want)


@pytest.mark.parametrize(("argv", "says"), [
    (["--optimizer", "kfac", "--kfac-distribution", "d-kfac"],
     "--kfac-distribution spreads K-FAC's work over data-parallel copies, and --dp 1 has one: give --dp 2 or more, "
     "or drop it"),
    (["--dp", "2", "--kfac-distribution", "d-kfac"],
     "--kfac-distribution tunes K-FAC: add --optimizer kfac, or drop it"),
    (["--dp", "2", "--optimizer", "kfac", "--zero1"],
     "K-FAC over data-parallel copies preconditions whole gradients and steps a whole optimizer, and --zero1 shards "
     "them: drop --zero1 with --optimizer kfac"),
    (["--dp", "2", "--optimizer", "kfac", "--fsdp"],
     "K-FAC over data-parallel copies preconditions whole gradients and steps a whole optimizer, and --fsdp shards "
     "them: drop --fsdp with --optimizer kfac"),
    (["--tp", "2", "--optimizer", "kfac"],
     "tensor parallelism (--tp 2) does not run with --optimizer kfac yet: use --tp 1 with it"),
    (["--dp", "2", "--optimizer", "kfac", "--kfac-distribution", "k-fac"], None),
])
def test_what_k_fac_over_copies_does_not_run_with_is_one_line(argv: list[str], says: str | None,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from pipefold.cli.main import main

    assert main(["train", "--model", "mlp", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    if says is not None:
        assert err[0] == f"pipefold train: error: {says}"
    else:  # argparse names the choices
        assert "invalid choice: 'k-fac'" in err[0] and "dp-kfac" in err[0]


def test_stage_work_splits_one_process_work_by_what_each_copy_does() -> None:
    """A stage's K-FAC seconds timed in one process, split per copy: with DP-KFAC every inversion and preconditioning
    runs once over the copies (their seconds sum to the one process's), every factor is built once per copy's rows
    (p times the one process's, all on the owner where the rows travel), and a copy that owns nothing inverts
    nothing; with D-KFAC every copy does all of it."""
    from pipefold.plan.dpkfac import stage_work

    work = {"KA": 0.4, "KG": 0.6, "KI": 3.0, "KP": 0.2}
    # 16 rows a microbatch, 2 of them a refresh: 32 rows, fewer than the wide layer's 65 columns (its rows travel)
    # and more than the narrow one's 9 (its sums do).
    layers = [Layer(inputs=9, outputs=8, rows=16), Layer(inputs=65, outputs=64, rows=16),
              Layer(inputs=9, outputs=8, rows=16)]
    for p in (2, 3):
        owners = assign([layer_cost(Layer(x.inputs, x.outputs, 0)) for x in layers], p)
        split = stage_work(work, layers, p, "dp-kfac", updates=2, owners=owners)
        for kind, times in (("KI", 1), ("KP", 1), ("KA", p), ("KG", p)):
            assert sum(c[kind] for c in split) == pytest.approx(times * work[kind]), (p, kind, split)
        idle = [c for c in range(p) if c not in owners]
        for c in idle:
            assert split[c]["KI"] == split[c]["KP"] == 0.0
        wide = owners[1]
        assert split[wide]["KA"] > max(split[c]["KA"] for c in range(p) if c != wide)
        assert stage_work(work, layers, p, "d-kfac", updates=2) == [work] * p


def test_the_simulator_lays_out_each_copys_work() -> None:
    """The run's summary simulates each copy's pipeline with its own share of K-FAC's work: the K-FAC time on each
    copy's simulated timeline is the closed sum of its actions (every microbatch's KA and KG, each stage's KI and
    KP), DP-KFAC's copies share the one process's inversions, and the ranks time their collectives apart from
    their computation."""
    from pipefold.plan.dpkfac import stage_work
    from pipefold.train.summary import _kfac_simulated

    config = RunSpec.flat(schedule="1f1b", devices=2, microbatches=2, steps=2, optimizer="kfac", dp=2,
                          model="mlp", layers=2, hidden=64, batch=256, partition="even")
    job = make_job(config)
    simulated = _kfac_simulated(job, 2)
    assert simulated is not None and len(simulated) == 2
    cost = job.extra["pipefisher"].steps[0].cost
    owners, shapes, m = job.extra["kfac_owners"], job.extra["kfac_shapes"], job.schedule.microbatches
    for c, copy in enumerate(simulated):
        want = 0.0
        for s, o in cost.stage_overrides.items():
            mine = stage_work(o.work, [Layer(*x) for x in shapes[s]], 2, "dp-kfac", updates=m,
                              owners=owners[s])[c]
            want += m * (mine["KA"] + mine["KG"]) + mine["KI"] + mine["KP"]
        assert copy["kfac_compute_s"] == pytest.approx(want, rel=1e-9)
        assert copy["step_s"] >= copy["kfac_compute_s"] / job.schedule.devices
    whole = sum(o.work["KI"] for o in cost.stage_overrides.values())
    shares = [sum(stage_work(o.work, [Layer(*x) for x in shapes[s]], 2, "dp-kfac", updates=m,
                             owners=owners[s])[c]["KI"] for s, o in cost.stage_overrides.items()) for c in range(2)]
    assert sum(shares) == pytest.approx(whole)
    for r in run_local(job):
        assert r.kfac is not None and 0.0 < r.kfac["comm_seconds"] < r.kfac["seconds"]

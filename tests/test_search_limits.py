"""The planner's searches stay bounded: one limit on a search's work (:mod:`pipefold.plan.limits`), checked before
any of it, in one line for every way a search grows; and what the searches leave out before building (a schedule
of more stages than layers, a pipeline longer than the model) or share (a schedule built once for every layout
that runs it, ZeRO-1's simulation the unsharded one's) changes no answer."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from conftest import no_work
from pipefold import schedules
from pipefold.cli.main import main
from pipefold.errors import ConfigError, ScheduleError
from pipefold.models.transformer import from_hf_config
from pipefold.plan import budget, partition
from pipefold.plan.cluster import load_cluster
from pipefold.plan.cluster_plan import Training, plan_cluster, point
from pipefold.plan.limits import MAX_SEARCH_WORK
from pipefold.plan.profile import LayerProfile, Profile


def _profile(layers: int, microbatches: int = 8, degrees: tuple[int, ...] = (1, 2)) -> Profile:
    """A made-up model of ``layers`` alike layers, measured at each of ``degrees`` (a layer split over t ranks
    computing a little more than 1/t of it)."""
    def at(t: int) -> tuple[LayerProfile, ...]:
        share = 1 / t + (0.1 if t > 1 else 0.0)
        return tuple(LayerProfile(f=2e-3 * share, b=3e-3 * share, w=2e-3 / t, held=int(2e5 * share),
                                  held_w=int(1.5e5 * share), params=int(4e5 * (0.55 if t > 1 else 1)), out=8192)
                     for _ in range(layers))

    return Profile(train={"model": "gpt", "layers": layers, "hidden": 32, "heads": 2, "seq": 16, "batch": 16,
                          "microbatches": microbatches, "optimizer": "adamw", "seed": 0},
                   layers=at(degrees[0]), latency=5e-5, bandwidth=2e9, contention=(1.0,) * 8, optimizer_factor=2.0,
                   tp=degrees[0], tp_layers={t: at(t) for t in degrees[1:]})


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the command line in this process: exit 2 and one stderr line, at once (before the search)."""
    with no_work():
        code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"pipefold {argv[0]}: error: "), err
    return err


def test_every_way_a_search_grows_is_refused_in_one_line_before_it_starts(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    limit = f"over the planner's limit of {MAX_SEARCH_WORK:,}"
    # Microbatches: kFkB's k runs to m, every schedule's passes grow with it.
    err = _refused(capsys, ["plan", "-p", "64", "-m", "1000", "--memory", "3"])
    assert "planning 64 devices with 1,000 microbatches is a search of 1,409 candidates" in err and limit in err
    fewer = int(err.rsplit("use at most ", 1)[1].split()[0].replace(",", ""))
    budget.check_evaluate(64, fewer)  # what it names fits, one more does not
    with pytest.raises(ConfigError, match="over the planner's limit"):
        budget.check_evaluate(64, fewer + 1)
    with pytest.raises(ConfigError, match="over the planner's limit"):  # the library refuses it alike
        budget.evaluate(64, 1000)
    # A world: a mesh per device makes every order of the degrees a layout (10 million for 256 ranks here).
    _profile(32).save(str(tmp_path / "deep.json"))
    err = _refused(capsys, ["plan", "--profile", str(tmp_path / "deep.json"), "--memory-budget", "1GiB",
                            "--world", "256"])
    assert "planning a world of 256 ranks (10,573,737 layouts)" in err and limit in err
    assert "search fewer --families, or fewer ranks (a world of" in err
    fits = int(err.rsplit("a world of ", 1)[1].split()[0].replace(",", ""))
    budget.every_layout(_profile(32), fits)  # the world it names fits
    # A world that no pipeline of the model makes: a device per layer at most, dp dividing the microbatches.
    _profile(6, degrees=(1,)).save(str(tmp_path / "six.json"))
    err = _refused(capsys, ["plan", "--profile", str(tmp_path / "six.json"), "--memory-budget", "1GiB",
                            "--world", "1000"])
    assert "no layout of 1,000 ranks fits this profile: a pipeline has at most 6 devices" in err
    assert "the nearest world that has a layout is 48 ranks" in err
    # One long pipeline of a deep model.
    _profile(512, microbatches=128, degrees=(1,)).save(str(tmp_path / "long.json"))
    err = _refused(capsys, ["plan", "--profile", str(tmp_path / "long.json"), "--memory-budget", "1GiB",
                            "-p", "512"])
    assert "planning 512 devices with 128 microbatches" in err and limit in err and "plan at most" in err
    # A cluster: every (dp, tp, pp) of its devices, the pipelines as long as the model has blocks.
    err = _refused(capsys, ["plan", "--cluster", "h100-sxm", "--nodes", "65536", "--hf-config", "llama3-70b",
                            "--global-batch", "16777216", "--seq", "8192"])
    assert "planning llama3-70b on 524,288 devices" in err and limit in err and "search fewer --families" in err


def _unpruned(profile: Profile, world: int, room: float, families: list[str]) -> list[budget.ModelPoint]:
    """plan_model's points the long way: every layout of ``world`` ranks (pipelines longer than the model too),
    every candidate built, one layout and one schedule at a time."""
    m, n = int(profile.train["microbatches"]), len(profile.layers)
    out = []
    for dp, pp in itertools.product(range(1, world + 1), repeat=2):
        if m % dp:
            continue
        for degrees in itertools.product(profile.tp_degrees, repeat=pp):
            if dp * sum(degrees) != world:
                continue
            for how in ("none", "zero1", "fsdp"):
                if how != "none" and dp == 1:
                    continue
                layout = budget.Layout(dp, degrees, pp, how)
                views = budget._device_views(profile, layout)
                for name, options in budget.candidates(pp, m // dp):
                    if name not in families:
                        continue
                    try:
                        schedule = schedules.build(name, pp, m // dp, **options)
                        if schedule.stages > n:
                            continue
                        out.extend(budget._model_points(profile, views, schedule, room, layout))
                    except (ConfigError, ScheduleError):
                        continue
    return out


def test_a_world_plan_is_the_unpruned_searchs() -> None:
    profile = _profile(4, microbatches=4)
    families = ["1f1b", "zb-v", "interleaved-1f1b", "kfkb"]
    every = budget.plan_model(profile, 6, 1e12, layouts=budget.every_layout(profile, 6, families), families=families)
    room = sorted(pt.memory for pt in every.points)[len(every.points) // 3]
    answer = budget.plan_model(profile, 6, room * 1.05, layouts=budget.every_layout(profile, 6, families),
                               families=families)
    reference = _unpruned(profile, 6, answer.room, families)

    def key(pt: budget.ModelPoint) -> tuple[object, ...]:
        return (str(pt.layout), pt.spec, pt.split, pt.layer_stages, pt.recompute, pt.makespan, pt.peak_memory)

    assert sorted(map(key, answer.points)) == sorted(map(key, reference)) and answer.unrunnable > 0
    fits = [pt for pt in reference if pt.memory <= answer.room]
    assert key(answer.best) == key(min(fits, key=budget._model_order))
    assert list(map(key, answer.frontier)) == list(map(key, budget.frontier(reference, budget._model_order)))


def test_a_cluster_search_costs_each_configuration_as_alone() -> None:
    """The search shares schedules and ZeRO-1's simulation among configurations and goes pipeline length by
    length; each point is what costing its configuration alone gives, in the configurations' order."""
    cluster = load_cluster("h100-sxm").with_nodes(2)
    training = Training(model=from_hf_config("llama3-8b"), seq=1024, global_batch=16)
    answer = plan_cluster(cluster, training, families=("1f1b", "zb-v"), microbatch_sizes=(1, 2))
    assert len({p.pp for p in answer.points}) >= 3 and {p.sharding for p in answer.points} == {"none", "zero1",
                                                                                                 "fsdp"}
    for got in answer.points:
        alone = point(cluster, training, dp=got.dp, tp=got.tp, pp=got.pp, schedule=got.schedule,
                      microbatch=got.microbatch, recompute=got.recompute, sharding=got.sharding)
        assert alone == got
    order = [(p.tp, p.pp, p.microbatch, p.schedule) for p in answer.points]
    assert order == sorted(order, key=lambda x: (x[0], x[1], x[2], ("1f1b", "zb-v").index(x[3])))


def _scan(each: list[list[float]], parts: int) -> list[int]:
    """The split's dynamic programme as a scan of every i upwards (what :func:`partition._minmax_dp` weighs row by
    row), the reference for its choices among ties and near ties."""
    n = len(each[0]) - 1
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        pre = each[k - 1]
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], pre[j] - pre[i])
                if value < best[k][j] - 1e-12:
                    best[k][j], back[k][j] = value, i
    bounds, j = [], n
    for k in range(parts, 0, -1):
        j = back[k][j]
        bounds.append(j)
    return bounds[::-1]


def test_the_balanced_split_weighs_rows_at_once_and_chooses_as_the_scan() -> None:
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 24)
        parts = rng.randint(1, n)
        kind = rng.choice(["random", "ties", "near ties", "zeros", "bytes"])
        pick = {"random": lambda: rng.random(), "ties": lambda: rng.choice([0.5, 1.0, 2.0]),
                "near ties": lambda: 1.0 + rng.choice([0.0, 1e-13, 3e-13, 7e-13]),
                "zeros": lambda: rng.choice([0.0, 0.0, 1.0]), "bytes": lambda: rng.choice([1e9, 1e9 + 1, 3e9])}[kind]
        costs = [pick() for _ in range(n)]
        if rng.random() < 0.5:
            each = [[0.0, *itertools.accumulate(costs)]] * parts
        else:  # each part's own figures (a device of another degree)
            each = [[0.0, *itertools.accumulate(c * rng.choice([0.5, 1.0, 2.0]) for c in costs)]
                    for _ in range(parts)]
        assert partition._minmax_dp(each, parts) == _scan(each, parts), (kind, costs, parts)


def test_the_refusals_watch_sees_the_work_begin() -> None:
    """:func:`conftest.no_work`, which the refusals above run under, fails a command that begins its work."""
    from conftest import WorkStarted

    with pytest.raises(WorkStarted, match="simulate began before the refusal"), no_work():
        main(["simulate", "1f1b", "--json"])
    with pytest.raises(WorkStarted, match="run_local began before the refusal"), no_work(simulating=False):
        main(["train", "--model", "mlp", "--layers", "2", "--hidden", "8", "--batch", "4", "-m", "2", "--devices", "2",
              "--schedule", "1f1b", "--steps", "1"])

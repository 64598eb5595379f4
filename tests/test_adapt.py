"""Adaptive kFkB: the policy against closed forms and the simulator; the runtime on real ranks and links."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from pipefold import schedules
from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.plan import adapt
from pipefold.runtime.launch.job import Adaptive
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.stage import Chain
from pipefold.sim.network import Network
from pipefold.sim.simulate import CostModel, StageOverride, simulate
from pipefold.train.prepare import make_job
from pipefold.train.spec import RunSpec

P, M = 4, 8
NBYTES = 524288


def test_candidates_are_the_divisors_of_m() -> None:
    assert adapt.candidates(8) == [1, 2, 4, 8]
    assert adapt.candidates(12, 4) == [1, 2, 3, 4]


def _summaries(c: float, *, peak: int = 1000, static: int = 100, wall: float = 2.0, late: float = 0.0
               ) -> list[dict]:
    """Four ranks of a linear pipeline whose every message took ``c`` seconds on the wire, sent back to back
    (each posted at once and delivered ``c`` after the one before), with receives posted ``late`` after."""
    out = []
    for r in range(P):
        sends, posted = {}, {}
        for peer in (r - 1, r + 1):
            if 0 <= peer < P:
                sends[peer] = [(tag, NBYTES, 10.0, 10.0 + late + (tag + 1) * c) for tag in range(M)]
                posted[peer] = {tag: 10.0 + late for tag in range(M)}
        out.append({"rank": r, "compute": {f"F {r}": 0.04, f"BW {r}": 0.08}, "sends": [sends],
                    "recv_posted": [posted], "wait": 0.1, "busy": 1.0, "wall": wall, "peak": peak,
                    "static": static})
    return out


def test_link_times_join_both_ends() -> None:
    # Messages queued on the wire: each served c after the one before, whatever the posting times said.
    times = adapt.link_times(_summaries(0.05))
    assert times[(0, 1)] == (NBYTES, pytest.approx(0.05))
    # A receiver that posts late: the first message's service starts at its receive, not at its send.
    times = adapt.link_times(_summaries(0.05, late=3.0))
    assert times[(2, 1)][1] == pytest.approx(0.05)


def _one_link(c: float, late: dict[int, float], *, waits_for_receive: bool) -> list[dict]:
    """Rank 0 sends M messages to rank 1, one every 0.2 s (its compute between them), over a wire that serves
    one in ``c`` seconds; message i's receive is posted late.get(i, 0) after its send. A real link (gloo) starts
    a message once its receive is posted; an emulated one starts it at its posting and delivers it at the
    later of its due time and its receive. Either way the link's thread waits on its sends in order, so a
    delivery is recorded no earlier than the one before."""
    samples, posted, free, done = [], {}, 0.0, 0.0
    for tag in range(M):
        sent = 10.0 + 0.2 * tag
        recv = posted[tag] = sent + late.get(tag, 0.0)
        if waits_for_receive:
            free = done = max(free, sent, recv) + c
        else:
            free = max(free, sent) + c
            done = max(free, recv + 1e-4, done)
        samples.append((tag, NBYTES, sent, done))
    return [{"rank": 0, "sends": [{1: samples}], "recv_posted": [{}]},
            {"rank": 1, "sends": [{}], "recv_posted": [{0: posted}]}]


@pytest.mark.parametrize("late", [
    {1: 0.5, 3: 0.1, 5: 0.3, 6: 0.3, 7: 0.3},  # most receives posted after the wire delivered
    {0: 0.3, 4: 1.0},  # late enough to hold up the messages queued behind
    {tag: 0.1 * tag for tag in range(M)},  # each later than the one before
])
@pytest.mark.parametrize("waits_for_receive", [True, False])
def test_a_busy_receiver_does_not_make_the_link_look_faster(late: dict[int, float], waits_for_receive: bool) -> None:
    # A receive posted late: gloo's link starts the message then, an emulated link's wire had already
    # carried it. Messages whose receive was waiting measure the link the same way on both.
    nbytes, seconds = adapt.link_times(_one_link(0.05, late, waits_for_receive=waits_for_receive))[(0, 1)]
    assert nbytes == NBYTES and seconds == pytest.approx(0.05)


def _predicted(k: int, c: float) -> float:
    cost = CostModel(stage_overrides={s: StageOverride(f=0.04, b=0.08, w=0.0) for s in range(P)},
                     activation_bytes=NBYTES)
    return simulate(schedules.build("kfkb", P, M, k=k), cost, network=Network.constant(0.0, NBYTES / c)).makespan


def test_a_slow_link_moves_to_larger_groups_with_the_simulators_prediction() -> None:
    policy = adapt.Policy(P, M, (1, 2, 4, 8))
    c = 0.08
    d = policy.decide(1, _summaries(c, wall=3.0))
    offset = 3.0 - _predicted(1, c)  # what the simulation leaves out, from the measured step at k = 1
    for k in (1, 2, 4, 8):
        assert d.predicted[k] == pytest.approx(_predicted(k, c) + offset)
    assert d.k == min((1, 2, 4, 8), key=lambda k: d.predicted[k]) and d.k > 1
    assert d.bandwidth["0-1"] == pytest.approx(NBYTES / c)


def test_an_idle_link_stays_at_1f1b() -> None:
    d = adapt.Policy(P, M, (1, 2, 4, 8)).decide(1, _summaries(1e-4))
    assert d.k == 1


def test_memory_scales_with_the_microbatches_each_rank_holds() -> None:
    # kFkB: rank i holds min(m, k(p - i)) microbatches at once; 1F1B p - i.
    d = adapt.Policy(P, M, (1, 2, 4, 8)).decide(1, _summaries(0.08, peak=1000, static=100))
    for k in (1, 2, 4, 8):
        for r in range(P):
            assert d.peaks[k][r] == pytest.approx(100 + 1000 * min(M, k * (P - r)) / (P - r))


def test_the_budget_caps_k() -> None:
    # k = 2 needs 100 + 2000 on rank 0; k = 1 needs 1100.
    d = adapt.Policy(P, M, (1, 2, 4, 8), budget=1500).decide(1, _summaries(0.08))
    assert d.k == 1 and d.fits == {1: True, 2: False, 4: False, 8: False}
    d = adapt.Policy(P, M, (1, 2, 4, 8), budget=500).decide(1, _summaries(0.08))
    assert d.k == 1 and "no k fits" in d.reason


def test_hysteresis_keeps_the_current_k_for_a_small_gain() -> None:
    policy = adapt.Policy(P, M, (1, 2, 4, 8), hysteresis=0.5)
    d = policy.decide(2, _summaries(1e-4))
    assert d.k == 2 and "hysteresis" in d.reason


# -- real ranks


def _mlp(**kw) -> RunSpec:
    base = dict(schedule="1f1b", devices=2, microbatches=4, steps=4, model="mlp", layers=4, hidden=256, batch=256,
                partition="even", optimizer="sgd", lr=0.05)
    base.update(kw)
    return RunSpec.flat(**base)


def test_emulated_link_has_the_bandwidth_it_was_given() -> None:
    # A microbatch of 64 rows x 256 floats: 64 KiB a message, at 2 MB/s 33 ms on the wire. The link never carries
    # more than its rate; how near the rate it comes is a timing, which a loaded machine stretches (once 1.69 MB/s):
    # benchmarks/adaptive_kfkb.py measures it.
    job = make_job(_mlp(network="constant:bandwidth=2MB", steps=2))
    job = dataclasses.replace(job, origin=time.time())
    reports = run_local(job)
    times = adapt.link_times([adapt.summarize(r.steps, 0) for r in reports])
    assert times and all(nbytes == 64 * 256 * 4 for nbytes, _ in times.values())
    faster = {link: nbytes / seconds for link, (nbytes, seconds) in times.items() if nbytes / seconds > 2e6 * 1.02}
    assert not faster, faster
    nbytes = 64 * 256 * 4
    # Every message of a step crosses a link one after the other: 4 forwards then 4 gradients on 0 <-> 1.
    assert max(r.steps[-1].wall for r in reports) > 4 * nbytes / 2e6


def _reference_weights(job, steps: int, lr: float) -> dict[str, torch.Tensor]:
    """Plain single-process SGD on the whole model, the same batches and the same mean loss."""
    n = job.extra["num_layers"]
    layers = job.build_layers(list(range(n)))
    model = Chain(*(layers[i] for i in range(n)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    m = job.schedule.microbatches
    for step in range(steps):
        opt.zero_grad()
        x, y = job.batch_at(step)
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            (job.loss_fn(model(xs), ys) / m).backward()
        opt.step()
    return {f"{i}.{name}": p.detach() for i in range(n) for name, p in layers[i].named_parameters()}


def _next_k(index: int, summaries: list) -> tuple[int, float | None, str]:
    """A policy that moves to the next candidate each time: every switch the runtime can make, made."""
    assert sorted(s["rank"] for s in summaries) == [0, 1]
    return min(index + 1, 2), 0.5 + index, f"from {index}"


def test_the_runtime_switches_schedules_between_steps_with_exact_training() -> None:
    config = _mlp(network="constant:latency=0.002,bandwidth=20MB", steps=5, schedule="kfkb:k=1")
    choices = adapt.build(2, 4, (1, 2, 4))
    job = make_job(config)
    job = dataclasses.replace(job, origin=time.time(), save_weights=True, schedule=choices[0],
                              adaptive=Adaptive(choices, 2, adapt.summarize, _next_k))
    reports = run_local(job)
    assert [st.schedule for st in reports[0].steps] == ["kfkb:k=1"] * 2 + ["kfkb:k=2"] * 2 + ["kfkb:k=4"]
    assert [st.predicted for st in reports[1].steps] == [None, None, 0.5, 0.5, 1.5]
    assert reports[0].decisions == [(2, "from 0"), (4, "from 1")] and reports[1].decisions == []
    want = _reference_weights(job, 5, 0.05)
    got = {name: w for r in reports for name, w in (r.weights or {}).items()}
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.allclose(got[name], w, rtol=1e-5, atol=1e-6), name


def test_adaptive_follows_its_prediction_on_a_slow_link() -> None:
    # A slow link from the start (16 MB/s: a 256 KiB microbatch takes about as long as its forward).
    # The estimate of the link's rate is a timing, as in the test above: never above the rate (how near it comes, a
    # loaded machine decides); the decision's own relations below hold on every run.
    config = _mlp(schedule="adaptive-kfkb", network="constant:bandwidth=16MB", hidden=512, batch=512, steps=3)
    job = dataclasses.replace(make_job(config), origin=time.time())
    reports = run_local(job)
    (first, d), = reports[0].decisions
    assert first == 2
    assert 0 < d.bandwidth["0-1"] <= 16e6 * 1.02, d.bandwidth
    fastest = min(d.predicted.values())
    assert d.predicted[d.k] <= fastest * (1 + adapt.TIE) or "hysteresis" in d.reason
    assert reports[0].steps[2].schedule == f"kfkb:k={d.k}"


def test_cli_reports_each_step_and_draws_the_run(tmp_path, capsys) -> None:
    plot = tmp_path / "run.png"
    code = main(["train", "--schedule", "adaptive-kfkb", "--devices", "2", "-m", "4", "--model", "mlp",
                 "--layers", "4", "--hidden", "256", "--batch", "256", "--steps", "3", "--adapt-every", "2",
                 "--network", "preempt:seed=1,idle=1GB,busy=2MB,on=5,off=5", "--memory-budget", "1GB",
                 "--plot", str(plot), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [row["step"] for row in out["per_step"]] == [1, 2, 3]  # numbered from 1, as the progress lines
    assert out["decisions"][0]["from_step"] == 3  # chosen after 2 steps (--adapt-every 2): the third runs it
    assert out["per_step"][2]["predicted_s"] == pytest.approx(
        out["decisions"][0]["predicted_s"][str(out["decisions"][0]["k"])])
    assert all(row["wait_s"] >= 0 and row["measured_s"] > 0 for row in out["per_step"])
    assert plot.stat().st_size > 10_000


@pytest.mark.parametrize("argv, words", [
    (["--schedule", "adaptive-kfkb:k=2"], "takes the option max_k"),
    (["--schedule", "adaptive-kfkb", "--adapt-every", "0"], "--adapt-every: 0 is out of range"),
    (["--netns"], "--netns needs --network"),
    (["--network", "constant:bandwidth=slow"], "bandwidth"),
])
def test_cli_bad_input_is_one_line(argv: list[str], words: str, capsys) -> None:
    code = main(["train", "--devices", "2", "--model", "mlp", "--steps", "1", "-m", "2", *argv])
    err = capsys.readouterr().err
    assert code != 0 and words in err and "Traceback" not in err


def test_the_policy_refuses_candidates_without_1f1b() -> None:
    with pytest.raises(ConfigError, match="k = 1"):
        adapt.Policy(P, M, (2, 4))

"""Expert parallelism's all-to-alls run under other compute: overlapped pairs (dualpipev, combined 1F1B) on two
threads that take turns computing, exact against one process with and without the overlap; the exposed exchange a
step reports against its intervals; the emulated network's price of an exchange; the refusals, one line each."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from pipefold.runtime.experts import Baton, exposed
from test_moe import MIXTRAL, _data, _model

SHAPE = {**MIXTRAL, "aux_loss": 0.0, "n_layer": 6}
"""No load-balancing loss: a schedule that runs a backward before its last forward needs none over the batch."""


def reference(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process, the whole batch at once."""
    from pipefold.models.gpt import gpt_loss

    model = _model(**SHAPE)
    gpt_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _overlapped(rank: int, init: str, schedule: str, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold import Pipeline
    from pipefold.errors import ConfigError
    from pipefold.models.gpt import gpt_loss
    from pipefold.plan.choose import resolve_schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    copy, device = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    x, y = _data(16)
    said: dict[str, Any] = {}
    for overlap in (False, True):
        model = _model(**SHAPE)
        plan = resolve_schedule(schedule, 2, 4)
        per = len(model) // plan.stages
        stages = {s: nn.Sequential(*model[s * per:(s + 1) * per]) for s in plan.stages_of(device)}
        pipe = Pipeline(stages, schedule, microbatches=4, loss_fn=gpt_loss, mesh=mesh, expert_parallel=True,
                        ep_overlap=overlap)
        pipe.step(x.chunk(2)[copy], target=y.chunk(2)[copy])
        stats = pipe.last
        said[str(overlap)] = {
            "grads": {f"{s * per + i}.{n}": p.grad.numpy().copy() for s, stage in stages.items()
                      for i, layer in enumerate(stage) for n, p in layer.named_parameters() if p.grad is not None},
            "exchanges": dict(stats.exchanges), "exposed": stats.exchange_exposed}
        pipe.close()
    for kwargs in ({"schedule": "gpipe", "expert_parallel": True, "ep_overlap": True},
                   {"schedule": "dualpipev", "ep_overlap": True}):
        model = _model(**SHAPE)
        plan = resolve_schedule(str(kwargs["schedule"]), 2, 4)
        per = len(model) // plan.stages
        stages = {s: nn.Sequential(*model[s * per:(s + 1) * per]) for s in plan.stages_of(device)}
        try:
            Pipeline(**{"stages": stages, "microbatches": 4, "loss_fn": gpt_loss, "mesh": mesh, **kwargs})
            said[kwargs["schedule"]] = "accepted"
        except ConfigError as exc:
            said[kwargs["schedule"]] = str(exc)
    out.put((rank, said))
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["dualpipev", "1f1b:combined=1"])
def test_overlapped_pairs_make_one_process_gradients_with_and_without_the_overlap(schedule: str) -> None:
    """A 2 x 2 (ep = dp x pp) mesh: every gradient each rank holds is one process's whether the pairs run one part
    after the other or on two threads taking turns; each pass's exchanges are counted, and with the overlap some
    of them ran while the other part computed."""
    from conftest import run_ranks

    got = run_ranks(_overlapped, 4, schedule)
    x, y = _data(16)
    want = reference(x, y)
    hidden = 0.0
    for _, said in got:
        assert isinstance(said, dict), said
        for overlap in ("False", "True"):
            grads = said[overlap]["grads"]
            diffs = {n: float((torch.from_numpy(g) - want[n]).abs().max()) for n, g in grads.items()}
            assert max(diffs.values()) < 1e-5, (overlap, sorted(diffs.items(), key=lambda kv: -kv[1])[:4])
            exchanges = said[overlap]["exchanges"]
            # Each stage's F and backward of each of the 4 microbatches exchanged (stages with MoE blocks).
            assert {k[-1] for k in exchanges} <= {"0", "1", "2", "3"} and len(exchanges) >= 8, exchanges
            assert 0 < said[overlap]["exposed"] <= sum(exchanges.values()) + 1e-6
        # Without the overlap nothing computes during an exchange: all of it is exposed (up to the overlap of
        # records), with it some of it hid under the other part's compute.
        plain = said["False"]
        assert plain["exposed"] == pytest.approx(sum(plain["exchanges"].values()), rel=1e-3)
        hidden += sum(said["True"]["exchanges"].values()) - said["True"]["exposed"]
        assert "gpipe has none: use dualpipe, dualpipev or 1f1b:combined=1" in said["gpipe"]
        assert "give expert_parallel=True too" in said["dualpipev"]
    assert hidden > 0


def test_exposed_is_the_exchanges_nothing_computed_under() -> None:
    assert exposed([(0, 2), (1, 3)], []) == 3  # the union, once
    assert exposed([(0, 2), (5, 6)], [(1, 5.5)]) == pytest.approx(1 + 0.5)
    assert exposed([(0, 4)], [(1, 2), (1.5, 3)]) == pytest.approx(2)  # computing spans counted once
    assert exposed([], [(0, 1)]) == 0


def test_the_baton_lets_one_part_compute_at_a_time_and_the_other_during_an_exchange() -> None:
    """Two threads, each computing, then 'exchanging' (a sleep with the baton let go of), then computing: the
    times they held it never overlap, and each one's exchange is covered by the other's compute."""
    baton = Baton()
    spans: dict[str, tuple[float, float]] = {}

    def part(name: str) -> None:
        with baton:
            _spin(0.05)
            start = time.perf_counter()
            with baton.released():
                time.sleep(0.1)
            spans[name] = (start, time.perf_counter())
            _spin(0.05)

    other = threading.Thread(target=part, args=("forward",))
    other.start()
    time.sleep(0.01)
    part("backward")
    other.join()
    held = sorted(baton.held)
    assert len(held) == 4 and all(a[1] <= b[0] for a, b in zip(held, held[1:], strict=False))
    assert exposed(spans.values(), held) < sum(b - a for a, b in spans.values())


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _exchange(rank: int, init: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.experts import ExpertLink
    from pipefold.sim.network import Network

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    link = ExpertLink(dist.group.WORLD, rank, 2, network=Network.constant(0.01, 2e6), origin=time.time())
    rows = torch.ones(1000 * (rank + 1), 50)  # rows of 200 B: half of each rank's to each rank
    sent = [rows.shape[0] // 2] * 2
    received = [500, 1000]  # from rank 0, from rank 1
    start = time.perf_counter()
    link.exchange(torch.empty(sum(received), 50), rows, received, sent)
    out.put((rank, time.perf_counter() - start))
    dist.destroy_process_group()


def test_an_exchange_lasts_at_least_what_its_bytes_take_on_the_emulated_links() -> None:
    """Rank 1 sends 1,000 rows of 200 B (200 KB) to rank 0 over 2 MB/s links of 10 ms latency: both ranks' exchange
    takes at least 0.11 s, the later of their sending and receiving."""
    from conftest import run_ranks

    for _, seconds in run_ranks(_exchange, 2):
        assert seconds >= 0.01 + 200_000 / 2e6


def _idle_experts(rank: int, init: str, schedule: str, overlap: bool, out: Any) -> None:
    """Every router zeroed: each token's top 2 of 4 equal scores are experts 2 and 3, both on copy 1, so copy 0's
    experts get no token in any microbatch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold import Pipeline
    from pipefold.models.gpt import gpt_loss
    from pipefold.models.moe import moe_layers
    from pipefold.plan.choose import resolve_schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    copy, device = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    model = _model(**SHAPE)
    for m in moe_layers(model):
        m.router.weight.data.zero_()
    plan = resolve_schedule(schedule, 2, 4)
    per = len(model) // plan.stages
    stages = {s: nn.Sequential(*model[s * per:(s + 1) * per]) for s in plan.stages_of(device)}
    pipe = Pipeline(stages, schedule, microbatches=4, loss_fn=gpt_loss, mesh=mesh, expert_parallel=True,
                    ep_overlap=overlap)
    x, y = _data(16)
    pipe.step(x.chunk(2)[copy], target=y.chunk(2)[copy])
    out.put((rank, {f"{s * per + i}.{n}": p.grad.numpy().copy() for s, stage in stages.items()
                    for i, layer in enumerate(stage) for n, p in layer.named_parameters() if p.grad is not None}))
    pipe.close()
    dist.destroy_process_group()


@pytest.mark.parametrize(("schedule", "overlap"), [("gpipe", False), ("dualpipev", True)])
def test_a_copy_whose_experts_get_no_token_still_exchanges_in_the_backward(schedule: str, overlap: bool) -> None:
    """The backward's exchanges are collectives inside autograd: a rank whose experts got nothing must reach them
    as the others do (else the group's collectives mismatch and gloo aborts), and its experts' gradients are 0."""
    from conftest import run_ranks
    from pipefold.models.gpt import gpt_loss
    from pipefold.models.moe import moe_layers

    model = _model(**SHAPE)
    for m in moe_layers(model):
        m.router.weight.data.zero_()
    x, y = _data(16)
    gpt_loss(model(x), y).backward()
    want = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
    for _, grads in run_ranks(_idle_experts, 4, schedule, overlap):
        assert isinstance(grads, dict), grads
        diffs = {n: float((torch.from_numpy(g) - want[n]).abs().max()) for n, g in grads.items()}
        assert max(diffs.values()) < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:4]
        idle = [g for n, g in grads.items() if ".moe.experts.0." in n or ".moe.experts.1." in n]
        assert all(not g.any() for g in idle)


def test_train_overlaps_the_exchanges_exactly_and_refuses_what_cannot_overlap() -> None:
    """``pipefold train --ep 2 --ep-overlap`` with DualPipeV and combined 1F1B: one process's gradients
    (``--check``), with the exchanges counted; gpipe (no pair) and --ep-overlap without --ep refused in one line."""
    from pipefold.cli.main import main, report

    base = ["train", "--model", "moe", "--moe", "aux_loss=0", "--layers", "6", "--devices", "2", "--dp", "2",
            "--steps", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "16", "--microbatches", "4"]
    for schedule in ("dualpipev", "1f1b:combined=1"):
        out = report([*base, "--schedule", schedule, "--ep", "2", "--ep-overlap", "--check"])
        assert out["max_grad_rel_diff"] < 1e-5 and out["loss_rel_diff"] < 1e-6, out
        experts = out["experts"]
        assert experts["ep"] == 2 and experts["overlap"]
        assert all(0 <= bare <= spent + 1e-6 and spent > 0
                   for spent, bare in zip(experts["exchange_seconds"], experts["exposed_seconds"], strict=True))
        sim = experts["simulated"]
        assert sim["with_overlap"]["step"] < sim["without_overlap"]["step"]
        assert sum(sim["with_overlap"]["exposed"]) < sum(sim["without_overlap"]["exposed"])
    assert main([*base, "--schedule", "gpipe", "--ep", "2", "--ep-overlap"]) == 2
    assert main([*base, "--schedule", "dualpipev", "--ep-overlap"]) == 2


BIASED = {**SHAPE, "bias_update": 0.05}
"""DeepSeek-V3's balancing by router bias instead of a loss, with a step large enough to change choices."""


def test_the_router_bias_moves_toward_balance_by_the_batchs_counts() -> None:
    """Closed form: after a step each bias moves by bias_update toward the mean of the step's routed slots (down
    for an expert above it, up below, not at it), the counts summed by ``reduce``; the bias chooses the top k and
    the scores weight them."""
    from pipefold.models.moe import MoEConfig, build_moe_layers, update_router_bias

    cfg = MoEConfig(**{**BIASED, "experts": 4})
    layer = build_moe_layers(cfg, [1])[1]
    moe = layer.moe
    assert moe.router_bias is not None and not moe.router_bias.any()
    moe.load = torch.tensor([3.0, 1.0, 2.0, 2.0], dtype=torch.float64)
    doubled = update_router_bias([layer], lambda t: t * 2)
    assert doubled == 1 and moe.router_bias.tolist() == pytest.approx([-0.05, 0.05, 0.0, 0.0])
    moe.load = torch.tensor([3.0, 1.0, 2.0, 2.0], dtype=torch.float64)
    assert update_router_bias([layer], apply=False) == 0 and moe.load is None  # a skipped step: forgotten
    assert moe.router_bias.tolist() == pytest.approx([-0.05, 0.05, 0.0, 0.0])
    with torch.no_grad():  # a bias that outweighs every score: experts 0 and 1 for every token
        moe.router_bias.copy_(torch.tensor([10.0, 9.0, 0.0, 0.0]))
        h = torch.randn(6, cfg.n_embd)
        probs, chosen, weights = moe.route(h, 1)
    assert (chosen == torch.tensor([0, 1])).all()
    assert torch.allclose(weights, probs[:, :2] / probs[:, :2].sum(-1, keepdim=True))


def _biased(rank: int, init: str, out: Any) -> None:
    """Three SGD steps of DualPipeV with the experts over 2 copies and the overlap, balancing by router bias."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold import Pipeline
    from pipefold.models.gpt import gpt_loss
    from pipefold.plan.choose import resolve_schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    copy, device = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    model = _model(**BIASED)
    plan = resolve_schedule("dualpipev", 2, 4)
    per = len(model) // plan.stages
    stages = {s: nn.Sequential(*model[s * per:(s + 1) * per]) for s in plan.stages_of(device)}
    pipe = Pipeline(stages, "dualpipev", microbatches=4, loss_fn=gpt_loss, mesh=mesh, expert_parallel=True,
                    ep_overlap=True)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    for step in range(3):
        x, y = _data(16 + step)
        pipe.step(x[:16].chunk(2)[copy], target=y[:16].chunk(2)[copy])
        opt.step()
        opt.zero_grad()
    out.put((rank, {f"{s * per + i}.{n}": t.detach().numpy().copy() for s, stage in stages.items()
                    for i, layer in enumerate(stage) for n, t in [*layer.named_parameters(), *layer.named_buffers()]
                    if ".moe.experts." not in n or int(n.split(".moe.experts.")[1].split(".")[0]) // 2 == copy}))
    pipe.close()
    dist.destroy_process_group()


def test_balancing_by_router_bias_runs_in_overlapped_pairs_as_one_process_does() -> None:
    """The whole batch's counts move the bias after each step, summed over the copies: three steps of DualPipeV
    with the overlap end with one process's weights and biases (its choices differ from an unbiased run's)."""
    from conftest import run_ranks
    from pipefold.models.gpt import gpt_loss
    from pipefold.models.moe import moe_layers, update_router_bias

    model = _model(**BIASED)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        x, y = _data(16 + step)
        gpt_loss(model(x[:16]), y[:16]).backward()
        opt.step()
        opt.zero_grad()
        update_router_bias(model)
    want = {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert any(m.router_bias is not None and m.router_bias.abs().sum() > 0 for m in moe_layers(model))
    seen: set[str] = set()
    for _, got in run_ranks(_biased, 4):
        assert isinstance(got, dict), got
        diffs = {n: float((torch.from_numpy(v) - want[n]).abs().max()) for n, v in got.items()}
        assert max(diffs.values()) < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:4]
        seen |= {n for n in got if n.endswith("router_bias")}
    assert seen == {n for n in want if n.endswith("router_bias")}


def test_recomputation_reruns_a_moe_layer_without_counting_its_choices_again() -> None:
    """A recomputed MoE block runs its forward again inside the backward: the load-balancing loss's counts and the
    router's load are the forward's alone (before, the rerun's count was taken for a forward after a backward and
    refused), and the gradients are one process's."""
    from pipefold.cli.main import report

    base = ["train", "--model", "moe", "--schedule", "gpipe", "--devices", "2", "--steps", "2", "--layers", "2",
            "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "16", "--microbatches", "4",
            "--recompute", "full", "--check"]
    for extra in ([], ["--dp", "2", "--ep", "2"], ["--moe", "aux_loss=0,bias_update=0.01", "--dp", "2"]):
        out = report([*base, *extra])
        assert out["max_grad_rel_diff"] < 1e-5 and out["loss_rel_diff"] < 1e-6, (extra, out)


def test_the_moe_options_help_names_every_setting() -> None:
    from pipefold.cli.args import build_parser
    from pipefold.models.moe import _OPTIONS

    train = next(a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions  # type: ignore
                 if a.dest == "moe")
    assert all(key in str(train.help) for key in _OPTIONS), train.help

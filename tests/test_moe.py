"""The mixture-of-experts model: its load-balancing loss over the whole batch, run microbatch by microbatch and in a
pipeline (with data-parallel copies), against one process that adds the loss term itself on the whole batch;
capacity per sequence; the schedules and settings it refuses, one line each."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models.gpt import gpt_loss
from pipefold.models.moe import MoEConfig, build_moe_layers, moe_layers

MIXTRAL = dict(experts=4, top_k=2)
DEEPSEEK = dict(experts=8, top_k=2, expert_hidden=16, shared_experts=1)
SMALL = dict(n_layer=2, n_embd=32, n_head=2, aux_loss=0.1)


def _model(**shape: Any) -> nn.Sequential:
    cfg = MoEConfig(**{**SMALL, **shape})
    layers = build_moe_layers(cfg, range(cfg.num_layers))
    return nn.Sequential(*(layers[i] for i in range(cfg.num_layers)))


def _data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (rows, 16), generator=g), torch.randint(0, 256, (rows, 16), generator=g)


def reference(shape: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process, the whole batch at once: the cross entropy plus every layer's loss term, written out
    (``aux_loss * E * sum_e f_e P_e`` from the batch's choices and mean probabilities)."""
    model = _model(**shape)
    for m in moe_layers(model):
        m.explicit_aux = True
    loss = gpt_loss(model(x), y) + sum(m.aux for m in moe_layers(model))  # type: ignore[misc]
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) <= set(want) and got
    return max(float((got[n] - want[n]).abs().max()) for n in got)


@pytest.mark.parametrize("shape", [MIXTRAL, DEEPSEEK, {**MIXTRAL, "capacity_factor": 1.0},
                                   {**DEEPSEEK, "capacity_factor": 0.5, "normalize": False}])
def test_microbatches_make_the_whole_batchs_gradient(shape: dict[str, Any]) -> None:
    x, y = _data(8)
    want = reference(shape, x, y)
    model = _model(**shape)
    outs = [model(xm) for xm in x.chunk(4)]  # every forward of the batch, then the backwards
    sum(gpt_loss(o, ym) / 4 for o, ym in zip(outs, y.chunk(4), strict=True)).backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert _worst(got, want) < 1e-6
    # The check can fail: the same microbatches with no loss term, or with each microbatch's own, end elsewhere.
    plain = _model(**{**shape, "aux_loss": 0.0})
    sum(gpt_loss(plain(xm), ym) / 4 for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True)).backward()
    router = "1.moe.router.weight"
    assert (dict(plain.named_parameters())[router].grad - want[router]).abs().max() > 1e-4
    each = _model(**shape)
    for m in moe_layers(each):
        m.explicit_aux = True
    for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
        ((gpt_loss(each(xm), ym) + sum(m.aux for m in moe_layers(each))) / 4).backward()  # type: ignore[misc]
    assert (dict(each.named_parameters())[router].grad - want[router]).abs().max() > 1e-7
    losses = [m.balance.loss for m in moe_layers(model)]
    assert all(loss is not None and loss > 0 for loss in losses)


def test_capacity_counts_each_sequence_so_microbatches_drop_the_same_tokens() -> None:
    cfg = MoEConfig(**{**SMALL, "experts": 4, "top_k": 1, "capacity_factor": 0.5})
    moe = build_moe_layers(cfg, [1])[1].moe
    h = torch.randn(4 * 16, 32)
    _, chosen, weights = moe.route(h, 4)
    kept = (weights > 0).reshape(4, 16)
    cap = 2  # ceil(0.5 * 16 tokens * top-1 / 4 experts)
    for b in range(4):
        for e in range(4):
            mine = chosen.reshape(4, 16)[b] == e
            assert int((kept[b] & mine).sum()) == min(cap, int(mine.sum()))  # the first ones in position order
    _, c2, w2 = moe.route(h[:32], 2)
    assert torch.equal(w2, weights[:32]) and torch.equal(c2, chosen[:32])


def test_a_backward_before_the_steps_last_forward_is_refused_in_one_line() -> None:
    """Once a pipeline opened the step; one process that runs one batch after another starts the next batch at a
    forward after every backward."""
    model = _model(**MIXTRAL)
    x, y = _data(4)
    gpt_loss(model(x[:2]), y[:2]).backward()
    gpt_loss(model(x[2:]), y[2:]).backward()  # the next batch, in one process
    for m in moe_layers(model):
        m.balance.begin_step()
    gpt_loss(model(x[:2]), y[:2]).backward()
    with pytest.raises(ConfigError) as err:
        model(x[2:])
    assert str(err.value).startswith("the load-balancing loss over the whole batch needs every microbatch's forward")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("shape", "says"), [
    (dict(experts=4, top_k=5), "top_k 5 is more than the 4 experts a token can go to: give top_k 4 or less"),
    (dict(capacity_factor=0.5, dropless=True), "a capacity factor of 0.5 drops tokens, and dropless routing keeps "
                                               "every one"),
    (dict(capacity_factor=0.0), "a capacity factor is a number above 0"),
    (dict(aux_loss=-1.0), "the load-balancing loss's weight is 0 or more"),
])
def test_bad_settings_are_one_line(shape: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        MoEConfig(n_layer=1, **shape)
    assert says in str(err.value) and "\n" not in str(err.value)


def _pipeline(rank: int, init: str, world: int, dp: int, schedule: str, shape: dict[str, Any], out: Any,
              *, expert_parallel: bool | int = False) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    pp = world // dp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp")) if dp > 1 else None
    copy, device = (mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()) if mesh is not None else (0, rank)
    from pipefold.plan.choose import resolve_schedule

    model = _model(**shape)
    plan = resolve_schedule(schedule, pp, 4)
    per = len(model) // plan.stages
    stages = {s: nn.Sequential(*model[s * per:(s + 1) * per]) for s in plan.stages_of(device)}
    x, y = _data(8 * dp)
    try:
        pipe = Pipeline(stages, schedule, microbatches=4, loss_fn=gpt_loss, mesh=mesh, expert_parallel=expert_parallel)
    except ConfigError as exc:
        out.put((rank, str(exc)))
        dist.destroy_process_group()
        return
    pipe.step(x.chunk(dp)[copy], target=y.chunk(dp)[copy])
    grads = {f"{s * per + i}.{n}": p.grad.numpy().copy() for s, stage in stages.items()
             for i, layer in enumerate(stage) for n, p in layer.named_parameters() if p.grad is not None}
    out.put((rank, grads))
    pipe.close()
    dist.destroy_process_group()


@pytest.mark.parametrize(("world", "dp", "schedule", "shape"), [
    (2, 1, "gpipe", MIXTRAL), (2, 1, "looped-bfs", {**MIXTRAL, "capacity_factor": 1.0}), (4, 2, "gpipe", DEEPSEEK)])
def test_a_pipeline_with_copies_makes_one_process_gradients(world: int, dp: int, schedule: str,
                                                           shape: dict[str, Any]) -> None:
    from conftest import run_ranks

    got = run_ranks(_pipeline, world, world, dp, schedule, shape)
    x, y = _data(8 * dp)
    want = reference(shape, x, y)
    seen: set[str] = set()
    for _, grads in got:
        assert isinstance(grads, dict)
        diffs = {n: float((torch.from_numpy(g) - want[n]).abs().max()) for n, g in grads.items()}
        assert max(diffs.values()) < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:6]
        seen |= set(grads)
    assert seen == set(want)


def test_a_pipeline_refuses_schedules_that_backpropagate_before_the_last_forward() -> None:
    from conftest import run_ranks

    for schedule in ("1f1b", "chimera"):
        for _, said in run_ranks(_pipeline, 2, 2, 1, schedule, MIXTRAL):
            assert isinstance(said, str) and "\n" not in said
            assert ("before its last forward" in said) or ("holds stage" in said), said


def test_train_runs_the_moe_model_exactly_on_copies_and_refuses_1f1b() -> None:
    """``pipefold train --model moe``: with 2 data-parallel copies of a GPipe pipeline every gradient is one
    process's (``--check``), and that one process's step is the whole batch's loss term written out."""
    from pipefold.cli.main import main, report
    from pipefold.train.prepare import make_job
    from pipefold.train.reference import reference_step
    from pipefold.train.spec import RunSpec

    argv = ["train", "--model", "moe", "--schedule", "gpipe", "--devices", "2", "--dp", "2", "--steps", "2",
            "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "16", "--microbatches", "4",
            "--check"]
    out = report(argv)
    assert out["max_grad_rel_diff"] < 1e-5 and out["loss_rel_diff"] < 1e-6
    # The one process of --check against the loss term written out on the whole batch.
    job = make_job(RunSpec.flat(model="moe", schedule="gpipe", devices=2, dp=2, steps=1, layers=2, hidden=32,
                                heads=2, seq=16, batch=16, microbatches=4))
    _, grads = reference_step(job)
    layers = job.build_layers(list(range(job.extra["num_layers"])))
    model = nn.Sequential(*(layers[i] for i in range(len(layers))))
    for m in moe_layers(model):
        m.explicit_aux = True
    x, y = job.batch_at(0)
    (gpt_loss(model(x), y) + sum(m.aux for m in moe_layers(model))).backward()  # type: ignore[misc]
    want = {f"{i}.{n}": p.grad for i, layer in enumerate(model) for n, p in layer.named_parameters()
            if p.grad is not None}
    assert set(grads) == set(want)
    assert max(float((grads[n] - want[n]).abs().max()) for n in want) < 1e-6
    assert main(["train", "--model", "moe", "--schedule", "1f1b", "--devices", "2", "--steps", "1"]) == 2


def _expert_parallel(rank: int, init: str, shape: dict[str, Any], out: Any) -> None:
    _pipeline(rank, init, 4, 2, "gpipe", shape, out, expert_parallel=True)


@pytest.mark.parametrize("shape", [MIXTRAL, {**DEEPSEEK, "capacity_factor": 1.0}])
def test_experts_spread_over_the_copies_make_one_process_gradients(shape: dict[str, Any]) -> None:
    """Expert parallelism on a 2 x 2 (dp x pp) mesh: each copy holds half of every layer's experts and reaches the
    others by all-to-all; every gradient a rank holds (its experts' and the rest) is one process's, and the copies'
    experts together are all of them."""
    from conftest import run_ranks

    got = run_ranks(_expert_parallel, 4, shape)
    x, y = _data(16)
    want = reference(shape, x, y)
    experts = shape["experts"]
    held: dict[str, set[int]] = {}
    for _, grads in got:
        assert isinstance(grads, dict), grads
        diffs = {n: float((torch.from_numpy(g) - want[n]).abs().max()) for n, g in grads.items()}
        assert max(diffs.values()) < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:6]
        for n in grads:
            if ".moe.experts." in n:
                layer, e = n.split(".moe.experts.")[0], int(n.split(".moe.experts.")[1].split(".")[0])
                held.setdefault(layer, set()).add(e)
        mine = {int(n.split(".moe.experts.")[1].split(".")[0]) for n in grads if ".moe.experts." in n}
        assert len(mine) <= experts // 2  # a copy's half per layer
    assert held and all(es == set(range(experts)) for es in held.values())


def test_experts_the_copies_cannot_share_equally_are_refused_in_one_line() -> None:
    from conftest import run_ranks

    for _, said in run_ranks(_expert_parallel, 4, {"experts": 3, "top_k": 2}):
        assert said == ("expert_parallel=True cannot share 3 experts equally over 2 copies: give a number of copies "
                        "that divides both 3 and the 2 data-parallel copies (none above 1), or other experts"), said


def test_train_spreads_the_experts_over_the_copies_exactly() -> None:
    """``pipefold train --model moe --moe ... --ep 2 --dp 2``: every rank's gradients, its half of the
    experts included, are one process's (``--check``, which holds every expert)."""
    from pipefold.cli.main import report

    out = report(["train", "--model", "moe", "--moe", "experts=4,shared_experts=1,capacity_factor=1.5",
                  "--ep", "2", "--schedule", "gpipe", "--devices", "2", "--dp", "2", "--steps", "2",
                  "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "16",
                  "--microbatches", "4", "--check"])
    assert out["max_grad_rel_diff"] < 1e-5 and out["loss_rel_diff"] < 1e-6


@pytest.mark.parametrize(("argv", "says"), [
    (["--moe", "experts=4"], "--moe shapes a mixture of experts: add --model moe, or drop it"),
    (["--model", "moe", "--moe", "expertz=4"], "--moe has no setting 'expertz': give any of experts, top_k"),
    (["--model", "moe", "--moe", "experts=x"], "--moe experts=x does not read: give a number, such as experts=2"),
    (["--model", "moe", "--moe", "top_k=9"], "top_k 9 is more than the 8 experts a token can go to"),
    (["--model", "moe", "--moe", "capacity_factor=0.5,dropless"], "a capacity factor of 0.5 drops tokens"),
    (["--model", "moe", "--ep", "2"], "--ep spreads the experts over data-parallel copies, and --dp 1 has one: give "
                                      "--dp 2 or more, or drop it"),
    (["--model", "moe", "--ep", "3", "--dp", "4", "--batch", "32"],
     "--ep 3 cannot cut --dp 4 into groups of 3 copies: give an --ep that divides 4 (2, 4)"),
    (["--model", "moe", "--ep", "-2", "--dp", "4"], "argument --ep: -2 is out of range: give a whole number >= 1"),
    (["--model", "moe", "--moe", "experts=3", "--ep", "2", "--dp", "2", "--batch", "32"],
     "--ep 2 cannot share 3 experts equally: give an --ep that divides 3 (3) with a --dp it divides, or other "
     "experts"),
    (["--model", "moe", "--moe", "experts=6", "--ep", "4", "--dp", "8", "--batch", "64"],
     "--ep 4 cannot share 6 experts equally: give an --ep that divides 6 and --dp 8 (2), or other experts"),
    (["--model", "mlp", "--ep", "2", "--dp", "2"], "--ep shapes a mixture of experts: add --model moe, or drop it"),
    (["--model", "moe", "--ep", "2", "--dp", "2", "--spb", "4,3"],
     "--ep does not run with --spb yet: drop one of them"),
    (["--model", "moe", "--schedule", "1f1b"], "1f1b runs a backward of stage 0 before its last forward"),
    (["--model", "moe", "--vocab-size", "100"], "the moe model reads its corpus as bytes (ids 0..255), which "
                                                "--vocab-size 100 cannot hold"),
    (["--model", "moe", "--ep", "2", "--dp", "4", "--zero1"], "--ep does not run with --zero1 yet: drop one of them"),
    (["--model", "moe", "--ep", "2", "--dp", "2", "--optimizer", "kfac"],
     "--ep does not run with --optimizer kfac yet (each copy holds other experts)"),
    (["--model", "moe", "--ep", "2", "--dp", "2", "--checkpoint-dir", "ck"],
     "--ep does not run with --checkpoint-dir yet"),
])
def test_what_the_moe_model_and_its_experts_refuse_is_one_line(argv: list[str], says: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from pipefold.cli.main import main

    full = ["train", "--devices", "2", "--steps", "1", *argv]
    if "--schedule" not in argv:
        full += ["--schedule", "gpipe"]
    assert main(full) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err

"""Expert parallelism over fewer ranks than the data-parallel copies (ep < dp): the copies cut into dp/ep groups of
ep consecutive ones, each group holding every expert once, the copies at the same rank of every group holding the
same experts (replicas). Against one process that writes the load-balancing loss out on the whole batch: every
gradient each rank holds (the experts' summed over their replicas), and the global gradient norm (each expert
counted once), in a user's loop (``Pipeline(..., expert_parallel=2)``) and in ``pipefold train --ep 2``; the
check fails without the replicas' all-reduce. What does not divide is refused in one line."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models.gpt import gpt_loss
from test_moe import DEEPSEEK, MIXTRAL, _data, _model, reference


def _expert_of(name: str) -> int | None:
    return int(name.split(".moe.experts.")[1].split(".")[0]) if ".moe.experts." in name else None


def _groups(rank: int, init: str, world: int, dp: int, ep: int, shape: dict[str, Any], drop_replicas: bool,
            out: Any) -> None:
    """One rank of a (dp, pp) mesh running gpipe with ``expert_parallel=ep``; puts (rank, copy, its gradients by
    the one-process model's names, the global gradient norm). ``drop_replicas``: the experts' parameters lose their
    replica group, so the data-parallel reduction does not sum them over the groups (the mutation the check
    catches)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold import Pipeline
    from pipefold.plan.choose import resolve_schedule
    from pipefold.runtime.experts import REPLICAS

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    pp = world // dp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    copy, device = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    model = _model(**shape)
    plan = resolve_schedule("gpipe", pp, 4)
    per = len(model) // plan.stages
    stages = {s: nn.Sequential(*model[s * per:(s + 1) * per]) for s in plan.stages_of(device)}
    x, y = _data(8 * dp)
    pipe = Pipeline(stages, "gpipe", microbatches=4, loss_fn=gpt_loss, mesh=mesh, expert_parallel=ep)
    if drop_replicas:
        for p in pipe.parameters():
            if hasattr(p, REPLICAS):
                delattr(p, REPLICAS)
    pipe.step(x.chunk(dp)[copy], target=y.chunk(dp)[copy])
    grads = {f"{s * per + i}.{n}": p.grad.numpy().copy() for s, stage in stages.items()
             for i, layer in enumerate(stage) for n, p in layer.named_parameters() if p.grad is not None}
    out.put((rank, copy, grads, pipe.grad_norm(), pipe.ep))
    pipe.close()
    dist.destroy_process_group()


def _diffs(grads: dict[str, np.ndarray], want: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((torch.from_numpy(g) - want[n]).abs().max()) for n, g in grads.items()}


@pytest.mark.parametrize(("world", "dp", "shape"), [
    (4, 4, MIXTRAL), (4, 4, {**DEEPSEEK, "capacity_factor": 1.0}), (8, 4, {**DEEPSEEK, "capacity_factor": 1.0})])
def test_groups_of_copies_with_replicated_experts_make_one_process_gradients(world: int, dp: int,
                                                                            shape: dict[str, Any]) -> None:
    """ep 2 x dp 4 (x pp 1 or 2): copies 0 and 1 hold one half each of every layer's experts, and copies 2 and 3
    the same halves; every gradient each rank holds is one process's, and the global norm too."""
    from conftest import run_ranks

    got = run_ranks(_groups, world, world, dp, 2, shape, False)
    x, y = _data(8 * dp)
    want = reference(shape, x, y)
    assert len(got) == world
    held: dict[int, set[tuple[str, int]]] = {}
    seen: set[str] = set()
    for _, copy, grads, norm, ep in got:
        assert ep == 2
        diffs = _diffs(grads, want)
        assert max(diffs.values()) < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:6]
        held.setdefault(copy, set()).update((n.split(".moe.experts.")[0], e) for n in grads
                                            if (e := _expert_of(n)) is not None)
        seen |= set(grads)
        want_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in want.values()))
        assert abs(norm - want_norm) < 1e-5 * want_norm, (norm, want_norm)
    assert seen == set(want)
    experts = shape["experts"]
    assert held[0] == held[2] and held[1] == held[3]  # replicas: the same rank of each group holds the same experts
    assert not held[0] & held[1]
    layers = {layer for layer, _ in held[0] | held[1]}
    assert held[0] | held[1] == {(layer, e) for layer in layers for e in range(experts)}  # a group holds them all
    assert {e for _, e in held[0]} == set(range(experts // 2))  # rank i % ep of its group: the i-th share


def test_without_the_replicas_all_reduce_the_experts_gradients_are_wrong() -> None:
    """The check above can fail: with the experts' replica group dropped, each expert's gradient is its own group's
    tokens' only (scaled by 1/dp), far from one process's (by half of it, about), while every other gradient is
    still exact."""
    from conftest import run_ranks

    got = run_ranks(_groups, 4, 4, 4, 2, MIXTRAL, True)
    x, y = _data(32)
    want = reference(MIXTRAL, x, y)
    for _, _, grads, _, _ in got:
        diffs = _diffs(grads, want)
        assert max(d for n, d in diffs.items() if _expert_of(n) is None) < 1e-5
        # Every expert's gradient is off by far more than the check's 1e-5: a third of its largest entry or more.
        assert all(d > 1e-5 and d > 0.3 * float(want[n].abs().max()) for n, d in diffs.items()
                   if _expert_of(n) is not None)


def _refusals(rank: int, init: str, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "pp"))
    said = []
    for ep, shape in ((3, MIXTRAL), (1, MIXTRAL), ("2", MIXTRAL), (4, {**MIXTRAL, "experts": 6})):
        try:
            Pipeline({0: _model(**shape)}, "gpipe", microbatches=4, loss_fn=gpt_loss, mesh=mesh, expert_parallel=ep)
        except ConfigError as exc:
            said.append(str(exc))
    pipe = Pipeline({0: _model(**MIXTRAL)}, "gpipe", microbatches=4, loss_fn=gpt_loss, mesh=mesh, expert_parallel=2)
    for share in (lambda: pipe.zero1(torch.optim.SGD), lambda: pipe.chunked(torch.optim.SGD, zero1=True)):
        try:
            share()
        except ConfigError as exc:
            said.append(str(exc))
    pipe.close()
    out.put((rank, said))
    dist.destroy_process_group()


def test_what_does_not_divide_is_refused_in_one_line() -> None:
    from conftest import run_ranks

    for _, said in run_ranks(_refusals, 4):
        assert said == [
            "expert_parallel=3 cannot cut the 4 data-parallel copies into groups of 3: give a number that divides 4 "
            "(2, 4), or True for all of them",
            "expert_parallel=1 is not a number of expert-parallel ranks: give True (all the data-parallel copies) or "
            "a number of copies of 2 or more that divides them, or leave it out",
            "expert_parallel='2' is not a number of expert-parallel ranks: give True (all the data-parallel copies) "
            "or a number of copies of 2 or more that divides them, or leave it out",
            "expert_parallel=4 cannot share 6 experts equally over 4 copies: give a number of copies that divides "
            "both 6 and the 4 data-parallel copies (2), or other experts",
            "zero1 does not run with expert_parallel yet (each copy holds other experts): drop one of them",
            "chunked(..., zero1=True) does not run with expert_parallel yet (each copy holds other experts): drop one "
            "of them"], said


def test_train_with_groups_of_copies_is_exact() -> None:
    """``pipefold train --model moe --ep 2 --dp 4`` (4 ranks, gpipe on one device): every rank's gradients are one
    process's (``--check``), and the step's global gradient norm is that one process's."""
    from pipefold.cli.main import report
    from pipefold.train.prepare import make_job
    from pipefold.train.reference import reference_step
    from pipefold.train.spec import RunSpec

    settings: dict[str, Any] = dict(model="moe", moe="experts=4,shared_experts=1,capacity_factor=1.5", ep=2,
                                    schedule="gpipe", devices=1, dp=4, layers=2, hidden=32, heads=2, seq=16,
                                    batch=16, microbatches=2)
    argv = ["train", "--steps", "2", "--check"]
    for name, value in settings.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    out = report(argv)
    assert out["max_grad_rel_diff"] < 1e-5 and out["loss_rel_diff"] < 1e-6
    _, grads = reference_step(make_job(RunSpec.flat(**settings, steps=1)))
    want = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    assert abs(out["grad_norm"][0] - want) < 1e-5 * want, (out["grad_norm"], want)

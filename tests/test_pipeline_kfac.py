"""K-FAC in a user's own script: ``Pipeline(..., kfac=)`` over real process groups makes the updates of one process
that builds every layer's factors from the whole batch, inverts them and preconditions the gradients (computed here
with :class:`pipefold.runtime.kfac.KFAC` on the whole model, microbatch by microbatch); on a (dp, pp) mesh with
DP-KFAC and D-KFAC alike, and the bytes each copy sends are those of :func:`pipefold.plan.dpkfac.predict`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from conftest import run_ranks

WIDTH, LAYERS, BATCH, MICRO, STEPS, LR, DAMPING = 8, 4, 16, 2, 3, 0.1, 0.05


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]


def _batches(copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH * copies, WIDTH, generator=g), torch.randn(BATCH * copies, WIDTH, generator=g))
            for _ in range(STEPS)]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _rank(rank: int, init: str, world: int, schedule: str, dp: int, distribution: str, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold import Pipeline
    from pipefold.plan.choose import resolve_schedule
    from pipefold.runtime.kfac import KFACConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    pp = world // dp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp")) if dp > 1 else None
    copy, device = (mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()) if mesh is not None else (0, rank)
    layers = _layers()
    config = KFACConfig(damping=DAMPING, distribution=distribution)
    plan = resolve_schedule(schedule, pp, MICRO)
    per = LAYERS // plan.stages
    stages = {s: nn.Sequential(*layers[s * per:(s + 1) * per]) for s in plan.stages_of(device)}
    pipe = Pipeline(stages, schedule, microbatches=MICRO, loss_fn=nn.functional.mse_loss,
                    mesh=mesh, kfac=config)
    opt = _sgd(pipe.parameters())
    for x, y in _batches(dp):
        opt.zero_grad()
        pipe.step(x.chunk(dp)[copy], target=y.chunk(dp)[copy])
        opt.step()
    weights = {f"{s * per + i}.{k}": p.detach().numpy().copy() for s, m in stages.items()
               for i, layer in enumerate(m.children()) for k, p in layer.named_parameters()}
    out.put((copy, device, weights, pipe.kfac_report()))
    pipe.close()
    dist.destroy_process_group()


def _reference(copies: int, kfac: bool) -> dict[str, torch.Tensor]:
    """One process: the whole model, every copy's microbatches in turn (each loss over all of them), K-FAC's
    factors from all of them, then the same optimizer."""
    from pipefold.ir.kinds import KA, KG, KI, KP
    from pipefold.runtime.curvature import StageCurvature
    from pipefold.runtime.kfac import KFACConfig
    from pipefold.runtime.meter import MemoryMeter

    whole = nn.Sequential(*_layers())
    total = MICRO * copies
    curv = StageCurvature(whole, KFACConfig(damping=DAMPING), total)
    opt = _sgd(whole.parameters())
    for x, y in _batches(copies):
        opt.zero_grad()
        curv.begin([KA(0, j) for j in range(total)] + [KG(0, j) for j in range(total)], 0, MemoryMeter())
        for j, (mx, my) in enumerate(zip(x.chunk(total), y.chunk(total), strict=True)):
            with curv.recording(j):
                output = whole(mx)
            (nn.functional.mse_loss(output, my) / total).backward()
            curv.run(KA(0, j))
            curv.run(KG(0, j))
        if kfac:
            curv.run(KI(0))
            curv.run(KP(0))
        opt.step()
    return {f"{i}.{k}": p.detach().clone() for i, layer in enumerate(whole.children())
            for k, p in layer.named_parameters()}


def _worst(got: dict[str, Any], want: dict[str, torch.Tensor]) -> float:
    return max(float((torch.from_numpy(got[n]) - want[n]).abs().max()) for n in got)


@pytest.mark.parametrize(("world", "schedule", "dp", "distribution"), [
    (2, "1f1b", 1, "dp-kfac"),
    (2, "zb-h1", 1, "dp-kfac"),      # W split from B: the first stage's curvature after its W
    (2, "v-half", 1, "dp-kfac"),     # two stages a rank
    (4, "1f1b", 2, "dp-kfac"),
    (4, "zb-h1", 2, "d-kfac"),
])
def test_a_users_pipeline_with_kfac_makes_the_updates_of_one_process(world: int, schedule: str, dp: int,
                                                                       distribution: str) -> None:
    got = run_ranks(_rank, world, world, schedule, dp, distribution)
    want = _reference(dp, kfac=True)
    assert {n for _, _, w, _ in got for n in w} == set(want)
    for _, _, weights, _ in got:
        assert _worst(weights, want) < 1e-5
    # The check can fail: the same optimizer without the preconditioning ends elsewhere.
    assert _worst(got[0][2], _reference(dp, kfac=False)) > 1e-3


def test_what_each_copy_sends_is_the_closed_form() -> None:
    """DP-KFAC on 2 copies x 2 devices: each rank's bytes per step, by what they carried, are those of
    :func:`pipefold.plan.dpkfac.predict` for its layers (8 wide, with a bias: 9 columns of A, 8 of G; 8 rows a
    microbatch, 16 a refresh: more than the columns, so each copy's factor sums travel, not its rows)."""
    from pipefold.plan.dpkfac import Layer, assign, layer_cost, predict

    got = run_ranks(_rank, 4, 4, "1f1b", 2, "dp-kfac")
    shapes = [Layer(inputs=WIDTH + 1, outputs=WIDTH, rows=BATCH // MICRO) for _ in range(LAYERS // 2)]
    owners = assign([layer_cost(Layer(x.inputs, x.outputs, 0)) for x in shapes], 2)
    for copy, _, _, report in got:
        want = predict(shapes, 2, "dp-kfac", updates=MICRO, owners=owners)[copy]
        assert report["distribution"] == "dp-kfac"
        for what, nbytes in want.sent.items():
            assert report["sent"].get(what, 0.0) == pytest.approx(nbytes, rel=1e-9), (copy, what, report)
        assert report["state_bytes"] == want.state


def _refusals(rank: int, init: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold import Pipeline
    from pipefold.plan.choose import resolve_schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    said = {}
    cases = {"recompute": dict(kfac=True, recompute={rank: 1}), "offload": dict(kfac=True, offload=(1, 1)),
             "type": dict(kfac="yes"), "replicated": dict(kfac=True, schedule="chimera")}
    for name, kwargs in cases.items():
        schedule = kwargs.pop("schedule", "1f1b")
        stage = {s: nn.Sequential(nn.Linear(8, 8), nn.Tanh())
                 for s in resolve_schedule(schedule, 2, 2).stages_of(rank)}
        try:
            Pipeline(stage, schedule, microbatches=2, loss_fn=nn.functional.mse_loss, **kwargs)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001  # the refusal, as the user sees it
            said[name] = f"{type(exc).__name__}: {exc}"
    out.put((rank, said))
    dist.destroy_process_group()


def test_what_kfac_in_a_pipeline_does_not_run_with_is_one_line() -> None:
    for _, said in run_ranks(_refusals, 2):
        assert said["recompute"] == ("ConfigError: kfac= does not run with recompute= yet: K-FAC keeps the layer "
                                     "inputs and output gradients those change; drop one of them")
        assert said["offload"].startswith("ConfigError: kfac= does not run with offload= yet")
        assert said["type"] == ("ConfigError: kfac= takes True or a KFACConfig(damping=..., ema=..., "
                                "distribution=...) (got 'yes')")
        assert said["replicated"].startswith("ConfigError: "), said
        assert all("\n" not in line for line in said.values())

"""The public Pipeline object inside a user's own loop: exact against one process, on every schedule family."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from conftest import run_ranks
from pipefold.errors import ConfigError

TOL = 1e-5


def _model(n: int, width: int = 8, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]


def _batch(step: int, width: int = 8, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def _reference(n: int, steps: int, lr: float = 0.1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: the whole model, the same loop (SGD, mean loss)."""
    layers = _model(n)
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, init: str, world: int, schedule: str, steps: int, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.pipeline import Pipeline
    from pipefold.schedules import build

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        name, _, opts = schedule.partition(":")
        built = build(name, world, 4, **{k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)})
        layers = _model(built.stages)
        mine = built.stages_of(rank)
        pipe = Pipeline([layers[s] for s in mine], schedule, microbatches=4, loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            x, y = _batch(step)
            opt.zero_grad()
            losses.append(pipe.step(x, target=y, all_ranks=True))
            opt.step()
        _, loss = pipe.forward(*_batch(99)[:1], target=_batch(99)[1])
        state = {f"{s}.{k}": v.detach().numpy().copy() for s in mine for k, v in layers[s].state_dict().items()}
        out.put((rank, losses, state, loss))
        pipe.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b:v=2", "chimera", "dualpipev",
                                      "v-half", "kfkb:k=2", "gpipe"])
def test_a_users_loop_trains_exactly_as_one_process(schedule: str) -> None:
    from pipefold.schedules import build

    world, steps = 2, 3
    name, _, opts = schedule.partition(":")
    stages = build(name, world, 4, **{k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)}).stages
    want_losses, want_state = _reference(stages, steps)
    got = run_ranks(_train, world, world, schedule, steps)
    assert len(got) == world
    state: dict[str, torch.Tensor] = {}
    for _, losses, part, _ in got:
        assert losses == pytest.approx(want_losses, abs=TOL)
        state.update(part)
    assert sorted(state) == sorted(want_state)
    for k, v in want_state.items():
        torch.testing.assert_close(torch.from_numpy(state[k]), v, atol=TOL, rtol=0)

"""Cutting a traced model into a layer sequence: the segments compute exactly what the model does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models.cut import cut_model, cut_points
from pipefold.plan.partition import partition
from pipefold.runtime.measure.profiling import layer_costs
from pipefold.runtime.stage import Chain, StageRunner, run_layers


class SkipNet(nn.Module):
    """Not a layer list: a loop over blocks, a skip connection across them, and a second input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)
        h = e
        for block in self.blocks:
            h = block(h) + h
        return self.head(h + e) + bias


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 6, generator=g), torch.randn(3, generator=g)


def test_segments_compute_exactly_the_model() -> None:
    model = SkipNet()
    segments = cut_model(model, ["blocks.0", "blocks.2"])
    assert len(segments) == 3
    x, bias = _inputs()
    want = model(x, bias)
    got = run_layers(segments, (x, bias))
    assert torch.equal(got, want)
    # The skip (e) and the second input (bias) cross both cuts: segment 0 hands on a tuple.
    mid = segments[0](x, bias)
    assert isinstance(mid, tuple) and len(mid) == 3
    # Same parameters, same gradients.
    want.sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    run_layers(segments, (x, bias)).sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n


@pytest.mark.parametrize("first_input_grads", [True, False])
def test_segments_run_as_pipeline_stages_with_the_split_backward(first_input_grads: bool) -> None:
    # Without input gradients on the first stage (as the runtime runs it) the second input passes the cut as a
    # floating tensor that needs no gradient: the next stage still sends one for it, which the first drops.
    model = SkipNet()
    x, bias = _inputs()
    target = torch.randn(5, 3)
    nn.functional.mse_loss(model(x, bias), target).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    seg = cut_model(model, ["add_1"])  # after the first residual add
    first = StageRunner(Chain(seg[0]), input_grads=first_input_grads)
    last = StageRunner(Chain(seg[1]), loss_fn=nn.functional.mse_loss)
    last.forward(0, first.forward(0, (x, bias)), target)
    grads = last.backward_input(0, None)
    first.backward_input(0, grads)
    last.backward_weight(0)
    first.backward_weight(0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7, msg=n)


def test_partition_of_segments_by_measured_costs() -> None:
    model = SkipNet()
    names = [f"blocks.{i}" for i in range(4)]
    segments = cut_model(model, names)  # embed+block0 | block1 | block2 | block3 | head
    for by in ("params", "time", "memory"):
        costs = layer_costs(segments, _inputs(), by=by, repeats=2)
        assert len(costs) == 5 and all(c > 0 for c in costs)
    split = partition(layer_costs(segments, _inputs(), by="params"), 2)
    assert split.parts[0][0] == 0 and split.parts[-1][-1] == 4


def test_cut_points_list_nodes_in_order() -> None:
    points = cut_points(SkipNet())
    assert points[:5] == ["embed", "blocks_0_0", "blocks_0_1", "blocks_0_2", "add"] and points[-1] == "add_5"


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x))


@pytest.mark.parametrize(
    ("model", "after", "expected"),
    [
        (SkipNet(), ["nope"], "no node or submodule named 'nope' to cut after; nodes start embed,"),
        (SkipNet(), ["add_5"], "cannot cut after add_5, the model's last node"),
        (SkipNet(), ["blocks.1", "blocks_0_0"], None),  # fine: two different nodes
        (Twice(), ["lin"], "submodule lin is called 2 times, so 'after lin' is ambiguous"),
        (Branchy(), [], "cannot trace Branchy with torch.fx"),
    ],
)
def test_bad_cuts_are_one_clear_line(model: nn.Module, after: list[str], expected: str | None) -> None:
    if expected is None:
        assert len(cut_model(model, after)) == 3
        return
    with pytest.raises(ConfigError) as info:
        cut_model(model, after)
    assert expected in str(info.value) and "\n" not in str(info.value)

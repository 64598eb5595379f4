"""Linear weight gradients added in place (runtime.wgrad), against plain autograd, in BW and in W."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pipefold.models import GPTConfig, build_gpt_layers
from pipefold.models.mlp import MLPConfig, build_mlp_layers
from pipefold.runtime import wgrad
from pipefold.runtime.stage import Chain, StageRunner

BIG = 512  # a 512 x 512 float32 weight is wgrad.MIN_BYTES: BW takes it


class Tied(nn.Module):
    """One weight in two products: its accumulator is reached twice, so autograd keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(BIG, BIG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class SharedWithOther(nn.Module):
    """A Linear's weight also read by another operation (a head tied to an embedding, in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(BIG, BIG, bias=False)
        self.after = nn.Linear(BIG, BIG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(self.lin(x) + self.lin.weight.sum(0))


class Frozen(nn.Module):
    """A frozen weight, a frozen bias and a weight with a gradient hook: each left to autograd."""

    def __init__(self, hooked: list[int]) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(BIG, BIG) for _ in range(4))
        self.a.weight.requires_grad_(False)
        self.b.bias.requires_grad_(False)
        self.c.weight.register_hook(lambda g: hooked.append(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def _mlp() -> nn.Module:
    return Chain(*build_mlp_layers(MLPConfig(hidden=BIG, layers=2), range(2)).values())


def _gpt() -> nn.Module:
    cfg = GPTConfig(vocab_size=64, block_size=8, n_embd=BIG, n_head=4, n_layer=1)
    return Chain(*build_gpt_layers(cfg, range(1, 2)).values())  # one block: 3-D inputs


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (_mlp, (4, BIG)),
    "no bias": (lambda: nn.Sequential(nn.Linear(BIG, BIG, bias=False), nn.GELU(), nn.Linear(BIG, BIG, bias=False)),
                (4, BIG)),
    "gpt block, 3-d": (_gpt, (2, 8, BIG)),
    "tied": (Tied, (4, BIG)),
    "shared with another op": (SharedWithOther, (4, BIG)),
}


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = wgrad.LinearNode.accumulate

    def counted(self: wgrad.LinearNode, g: torch.Tensor) -> None:
        calls.append(1)
        original(self, g)

    monkeypatch.setattr(wgrad.LinearNode, "accumulate", counted)
    return calls


def _grads(module: nn.Module, x: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [p.grad for p in module.parameters()] + ([x.grad] if x is not None else [])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("input_grad", [True, False])
def test_bw_equals_autograd(name: str, input_grad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two microbatches (the second adds to .grad), with and without the input's gradient (a first stage)."""
    build, shape = CASES[name]
    torch.manual_seed(0)
    module = build()
    ref = copy.deepcopy(module)
    xs, gs = [torch.randn(*shape) for _ in range(2)], [torch.randn(*shape) for _ in range(2)]
    calls = _counting(monkeypatch)
    leaves, ref_leaves = [], []
    for x, g in zip(xs, gs, strict=True):
        a, b = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
        wgrad.backward([module(a)], [g])
        torch.autograd.backward([ref(b)], [g])
        leaves.append(a if input_grad else None)
        ref_leaves.append(b if input_grad else None)
    for mine, want in zip(_grads(module, leaves[0]), _grads(ref, ref_leaves[0]), strict=True):
        assert (mine is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5)
    taken = {"mlp": 4, "no bias": 2, "gpt block, 3-d": 4, "tied": 0, "shared with another op": 1}[name]
    if not input_grad and name in ("mlp", "no bias"):
        taken -= 1  # the lowest product runs for nothing below it: autograd keeps it
    assert len(calls) == 2 * taken


def test_frozen_and_hooked_left_to_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    hooked: list[int] = []
    torch.manual_seed(0)
    module = Frozen(hooked)
    ref_hooked: list[int] = []
    ref = Frozen(ref_hooked)
    ref.load_state_dict(module.state_dict())
    calls = _counting(monkeypatch)
    x, g = torch.randn(4, BIG, requires_grad=True), torch.randn(4, BIG)
    x2 = x.detach().clone().requires_grad_()
    wgrad.backward([module(x)], [g])
    torch.autograd.backward([ref(x2)], [g])
    for mine, want in zip(_grads(module, x), _grads(ref, x2), strict=True):
        assert (mine is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(mine, want)
    assert hooked == [1]  # the hook ran: c went through autograd
    assert len(calls) == 1  # d alone (a's weight is frozen, b's bias, c hooked)


def test_small_weights_keep_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below MIN_BYTES, finding and hooking the products costs more than it saves: BW does not take them."""
    module = Chain(*build_mlp_layers(MLPConfig(hidden=64, layers=2), range(2)).values())
    assert not wgrad.worth_fusing(module) and wgrad.worth_fusing(_mlp())
    calls = _counting(monkeypatch)
    wgrad.backward([module(torch.randn(4, 64, requires_grad=True))], [torch.randn(4, 64)])
    assert calls == []


@pytest.mark.parametrize("width", [64, BIG, 2048, 2896, 2897, 4096])
def test_bw_takes_a_weight_by_its_size_where_it_lives(width: int) -> None:
    """In host memory BW takes weights of MIN_BYTES and up; on any other device, only those of GPU_MIN_BYTES and
    up (the H200's crossover, benchmarks/results/gpu_check.md). The meta device stands in for a GPU (this machine
    has none), and holds widths no CPU test could."""
    layer = nn.Linear(width, width, bias=False, device="meta")
    size = width * width * 4
    assert wgrad.worth_fusing(layer) == (size >= wgrad.GPU_MIN_BYTES)
    assert wgrad.min_bytes(layer.weight.device) == wgrad.GPU_MIN_BYTES
    host = nn.Linear(width, width, bias=False) if size < wgrad.GPU_MIN_BYTES else None
    if host is not None:
        assert wgrad.worth_fusing(host) == (size >= wgrad.MIN_BYTES)
        x = torch.randn(3, width, requires_grad=True)
        node = host(x).grad_fn
        assert (wgrad.linear_of(node, None) is not None) == (size >= wgrad.MIN_BYTES)
        assert wgrad.linear_of(node) is not None  # an explicit floor of 0 takes any plain Linear


@pytest.mark.parametrize("split", [False, True])
def test_runner_takes_the_in_place_path(split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage runner's BW and W both add a Linear's weight gradient in place, and agree with autograd."""
    torch.manual_seed(1)
    module = _mlp()
    ref = copy.deepcopy(module)
    calls = _counting(monkeypatch)
    runner = StageRunner(module)
    xs, gs = [torch.randn(4, BIG) for _ in range(3)], [torch.randn(4, BIG) for _ in range(3)]
    for mb, (x, g) in enumerate(zip(xs, gs, strict=True)):
        runner.forward(mb, (x,))
        if split:
            runner.backward_input(mb, (g,))
            runner.backward_weight(mb)
        else:
            runner.backward(mb, (g,))
        torch.autograd.backward([ref(x.clone().requires_grad_())], [g])
    for mine, want in zip(module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, want.grad, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3 * 4


@pytest.mark.parametrize(("schedule", "extra"), [
    ("1f1b", {}), ("gpipe", {}), ("zb-v", {}),
    ("1f1b", {"dp": 2, "fsdp": True}),  # FSDP's unsharded weights are plain tensors while they compute
    ("1f1b", {"recompute": "full"}),
], ids=["1f1b", "gpipe", "zb-v", "fsdp", "recompute"])
def test_pipelines_with_large_linears_match_one_process(schedule: str, extra: dict[str, object]) -> None:
    """Weights of 4 MiB, so that BW takes the in-place path on every rank; gradients as one process's."""
    from pipefold.train.reference import compare
    from pipefold.train.run import train
    from pipefold.train.spec import RunSpec

    cfg = RunSpec.flat(schedule=schedule, devices=2, microbatches=4, steps=1, model="mlp", layers=4, hidden=BIG,
                       batch=8, partition="even", check=True, **extra)  # type: ignore[arg-type]
    job, reports = train(cfg)
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < 1e-5 and diff["loss_rel_diff"] < 1e-5, diff

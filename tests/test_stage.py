"""The B/W split of a stage's backward, in one process, against plain autograd."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from pipefold.models import GPTConfig, build_gpt_layers
from pipefold.runtime import stage as stage_module
from pipefold.runtime.offload import Offloaded
from pipefold.runtime.stage import Chain, StageRunner


class OffPath(nn.Module):
    """Parameters reached in every awkward way: behind an exp, used twice, and outside the input's path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))
        self.norm = nn.LayerNorm(8)
        self.free = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.lin(x)) * self.scale.exp()) + x
        return h * self.scale + self.free.sum() * 0.1


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.GELU()), OffPath(), nn.Sequential(nn.Linear(8, 4))]


def _reference(stages: list[nn.Module], xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[torch.Tensor]:
    for x, y in zip(xs, ys, strict=True):
        h = x
        for m in stages:
            h = m(h)
        (nn.functional.mse_loss(h, y) / len(xs)).backward()
    return [p.grad for m in stages for p in m.parameters()]


@pytest.mark.parametrize("fused", [False, True])
def test_split_backward_equals_autograd(fused: bool) -> None:
    stages = _stages()
    ref = copy.deepcopy(stages)
    xs = [torch.randn(5, 8) for _ in range(3)]
    ys = [torch.randn(5, 4) for _ in range(3)]
    want = _reference(ref, xs, ys)
    runners = [StageRunner(m) for m in stages[:-1]] + [StageRunner(stages[-1], loss_fn=nn.functional.mse_loss)]
    for r in runners:
        r.meter.start(outside=[*xs, *ys])  # the batch exists before the step: not the runners' memory
    for mb, (x, y) in enumerate(zip(xs, ys, strict=True)):
        h: tuple[torch.Tensor, ...] = (x,)
        for r in runners[:-1]:
            h = r.forward(mb, h)
        runners[-1].forward(mb, h, y, scale=1 / 3)
    for mb in range(3):  # all Bs first, then all Ws: W runs long after its B, as in zero-bubble schedules
        g = None
        for r in reversed(runners):
            g = r.backward(mb, g) if fused else r.backward_input(mb, g)
    if not fused:
        for mb in reversed(range(3)):
            for r in runners:
                r.backward_weight(mb)
    got = [p.grad for m in stages for p in m.parameters()]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # Everything held for backward is released once the Ws have run, and the last hand-overs are dropped
    # (the meter follows each storage until it dies, whoever holds it).
    del h, g
    assert all(r.meter.current == 0 and r.meter.peak > 0 and r.in_flight == 0 for r in runners)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("input_grads", [True, False])
def test_gpt_stages_split_exactly(fused: bool, input_grads: bool) -> None:
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)
    layers = build_gpt_layers(cfg, range(4), seed=1)
    ref = build_gpt_layers(cfg, range(4), seed=1)
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    loss = nn.functional.cross_entropy(nn.Sequential(*ref.values())(x).flatten(0, 1), y.flatten())
    loss.backward()
    # Int tokens in. As the runtime builds the first stage (input_grads=False), B runs back to the embedding's
    # output and W ends with the embedding; otherwise B has nothing to do and W runs everything.
    first = StageRunner(nn.Sequential(layers[0], layers[1]), input_grads=input_grads)
    assert bool(first._lead) is not input_grads
    last = StageRunner(nn.Sequential(layers[2], layers[3]),
                       loss_fn=lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten()))
    h = first.forward(0, (x,))
    last.forward(0, h, y)
    if fused:
        assert first.backward(0, last.backward(0, None)) is None
    else:
        dh = last.backward_input(0, None)
        assert first.backward_input(0, dh) is None
        last.backward_weight(0)
        first.backward_weight(0)
    for i in range(4):
        for (name, p), q in zip(layers[i].named_parameters(), ref[i].parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"layer {i} {name}")


def test_memory_held_after_f_and_between_b_and_w() -> None:
    # Linear -> GELU -> Linear on a 32 x 64 float32 input: every activation is one 8 KiB block.
    block = 32 * 64 * 4
    r = StageRunner(Chain(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)))
    x, g = torch.randn(32, 64), torch.ones(32, 64)
    r.meter.hold([x, g], "recv")  # as if received from the neighbours
    out = r.forward(0, (x,))
    del out  # handed on; the stage still keeps its output for B
    # After F: the input (kept for the first weight gradient), the GELU input, the second Linear's input, the output.
    assert r.memory_f == 4 * block and r.meter.current == 5 * block  # + g
    dx = r.backward_input(0, (g,))
    # B freed the GELU input and the output; W reads both Linear inputs and the gradients entering both Linears
    # (g itself, and the one B computed at the first Linear).
    assert r.memory_w == 4 * block
    assert r.meter.current == 5 * block  # + dx
    del dx, x, g
    assert r.meter.current == 4 * block  # the pass holds x and g itself now
    r.backward_weight(0)
    assert r.meter.current == 0


def _dropout_stage() -> Chain:
    torch.manual_seed(0)
    return Chain(*[nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 8)), OffPath(),
                   nn.Sequential(nn.LayerNorm(8), nn.Dropout(0.2)), nn.Linear(8, 8)])


def _run_with_recompute(r: int, fused: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    stage = _dropout_stage()
    runner = StageRunner(stage, recompute=r)
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    torch.manual_seed(7)  # dropout masks drawn in F; recomputation must draw the same ones
    runner.meter.start(outside=xs)
    held = []
    for mb, x in enumerate(xs):
        runner.forward(mb, (x,))
        held.append(runner.meter.current)
    dxs = []
    for mb in range(3):
        g = (torch.full((5, 8), 0.1 * (mb + 1)),)
        got = runner.backward(mb, g) if fused else runner.backward_input(mb, g)
        assert got is not None
        dxs.append(got[0].clone())  # a copy: the meter follows what the runner handed out
    del g, got
    if not fused:
        for mb in range(3):
            runner.backward_weight(mb)
    assert runner.meter.current == 0 and runner.in_flight == 0
    return dxs, [p.grad for p in stage.parameters()], held


@pytest.mark.parametrize("fused", [False, True])
def test_recomputed_layers_give_identical_gradients(fused: bool) -> None:
    # Reference: the same stage keeping every activation. Recomputing any prefix changes no bit.
    want_dx, want_dw, want_held = _run_with_recompute(0, fused)
    previous = want_held
    for r in range(1, 5):
        dx, dw, held = _run_with_recompute(r, fused)
        assert all(torch.equal(a, b) for a, b in zip(dx, want_dx, strict=True)), f"recompute {r}: input grads"
        assert all(torch.equal(a, b) for a, b in zip(dw, want_dw, strict=True)), f"recompute {r}: weight grads"
        # Each further recomputed layer keeps less between F and B.
        assert all(h < p for h, p in zip(held, previous, strict=True)), (r, held, previous)
        previous = held


def test_recomputation_keeps_the_input_and_b_frees_what_it_rebuilt() -> None:
    block = 32 * 64 * 4
    lin = Chain(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    runner = StageRunner(lin, recompute=2)
    x, g = torch.randn(32, 64), torch.ones(32, 64)
    runner.forward(0, (x,))
    # Only the input, what the last Linear keeps (its input) and the output remain; the GELU input is dropped.
    assert runner.memory_f == 3 * block
    runner.backward_input(0, (g,))
    # B rebuilt the GELU input and freed it once read; W reads both Linears' inputs and the gradients into them,
    # exactly as without recomputation.
    assert runner.memory_w == 4 * block
    runner.backward_weight(0)
    del x, g
    assert runner.meter.current == 0


def test_recomputation_needs_a_layer_sequence() -> None:
    with pytest.raises(ValueError, match="cannot recompute 3 layers of a stage that has 2"):
        StageRunner(Chain(nn.Linear(2, 2), nn.Linear(2, 2)), recompute=3)
    with pytest.raises(ValueError, match="plain layer sequence"):
        StageRunner(nn.Linear(2, 2), recompute=1)


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("recompute", [0, 1, 3, "offloaded", "first stage"])
def test_a_released_microbatch_leaves_nothing_behind(fused: bool, recompute: int | str) -> None:
    # GPT blocks save their own outputs (layer norm, softmax, GELU). A saved-tensor hook that hands
    # the tensor itself back makes such a node hold itself, a cycle inside autograd that no collector
    # sees: each W that runs only part of the graph, and each recomputation's dropped rerun, leaked
    # its microbatch's activations (65 MB per microbatch in one measured case) until this was fixed.
    layers = build_gpt_layers(GPTConfig(n_layer=3, n_embd=32, n_head=4, block_size=16), [1, 2, 3])
    if recompute == "offloaded":  # its own saved-tensor hooks, the same care
        runner = StageRunner(Offloaded(Chain(*layers.values()), torch.device("cpu"), k=2, kprime=1))
    elif recompute == "first stage":  # B runs back to the first layer's output, W ends with that layer
        runner = StageRunner(Chain(*layers.values()), input_grads=False)
    else:
        runner = StageRunner(Chain(*layers.values()), recompute=int(recompute))
    x, g = torch.randn(2, 16, 32), torch.randn(2, 16, 32)

    def step(first: int) -> None:
        for mb in range(first, first + 3):
            runner.forward(mb, (x,))
        for mb in range(first, first + 3):
            if fused:
                runner.backward(mb, (g,))
            else:
                runner.backward_input(mb, (g,))
                runner.backward_weight(mb)

    if recompute == "first stage":
        assert runner._lead  # the path under test
    step(0)  # the first step creates what stays: gradients, caches
    before = _live_tensors()
    for i in range(1, 4):
        step(3 * i)
    assert runner.in_flight == 0
    assert _live_tensors() == before


class _Tied(nn.Module):
    """One weight used by two layers of the stage (as tied embeddings are), and a bias added twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.shift = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x) + self.shift)
        return self.b(h) + self.shift


def _graphs() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    gpt = build_gpt_layers(GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16), range(1, 5))
    return {"offpath": (Chain(OffPath(), OffPath()), torch.randn(5, 8)),
            "tied": (Chain(_Tied(), nn.GELU(), _Tied()), torch.randn(5, 8)),
            "dropout": (_dropout_stage(), torch.randn(5, 8)),
            "gpt": (Chain(*gpt.values()), torch.randn(2, 16, 32))}


@pytest.mark.parametrize("name", ["offpath", "tied", "dropout", "gpt"])
def test_ownership_in_one_walk_is_the_exact_one(name: str) -> None:
    # Which crossing nodes own their parameters was found by a walk below each of them (quadratic in a stage's
    # depth: a 16-block GPT stage's B took twice plain autograd's time); one walk over all regions must find
    # exactly the same, including where regions meet (a weight or a bias used twice).
    module, x = _graphs()[name]
    leaf = x.requires_grad_()
    out = module(leaf)
    params = [p for p in module.parameters() if p.requires_grad]
    cut = stage_module.Cuts(params).of([out], [leaf])
    nodes = stage_module.graph_below([out.grad_fn])
    accs = {n for p in params if (n := stage_module.grad_node(p)) in nodes}
    exact = {node: stage_module._owned_params(node, edges, accs) for node, edges in cut.edges.items()}
    want = {node: set(found) for node, found in exact.items() if found is not None}
    assert {node: set(found) for node, found in cut.owned.items()} == want
    if name in ("tied", "offpath"):  # the cases the fast walk hands to the exact one
        assert len(want) < len(cut.edges)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ["offpath", "tied", "dropout", "gpt"])
def test_weight_gradients_reach_parameters_whose_data_moved_after_the_forward(name: str, fused: bool) -> None:
    # A parameter whose data moves to another device or dtype gets a new AccumulateGrad node (offloading
    # evicts a layer to the CPU between its F and its B on a GPU). Naming the parameters in ``inputs=`` named
    # those new nodes, not the graph's, so B, W and BW left every .grad empty (seen on an H200). Here the move
    # is a dtype round trip, which resets the node the same way on the CPU.
    module, x = _graphs()[name]
    ref = copy.deepcopy(module)
    torch.manual_seed(1)
    ref(x.clone()).sum().backward()
    want = [p.grad for p in ref.parameters()]
    runner = StageRunner(module)
    torch.manual_seed(1)
    (out,) = runner.forward(0, (x,))
    before = [stage_module.grad_node(p) for p in module.parameters()]
    for p in module.parameters():
        p.data = p.data.double()
        p.data = p.data.float()
    assert all(stage_module.grad_node(p) is not b for p, b in zip(module.parameters(), before, strict=True))
    if fused:
        runner.backward(0, (torch.ones_like(out),))
    else:
        runner.backward_input(0, (torch.ones_like(out),))
        runner.backward_weight(0)
    for p, w in zip(module.parameters(), want, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-6)


def _same_cut(a: stage_module._Cut, b: stage_module._Cut) -> bool:
    def sets(d: dict) -> dict:  # (the order within a node's list is a set's)
        return {node: set(v) for node, v in d.items()}
    return ((sets(a.edges), sets(a.owned), a.outputs, a._param_of.keys())
            == (sets(b.edges), sets(b.owned), b.outputs, b._param_of.keys()))


@pytest.mark.parametrize("name", ["offpath", "tied", "dropout", "gpt"])
def test_a_cut_found_once_is_the_one_found_afresh_on_the_next_graph(name: str) -> None:
    # B finds the cut of a stage's graph once per shape of graph and maps it onto the next microbatch's nodes by
    # their positions in one walk: that must be the cut a fresh search finds on the new graph, node for node.
    module, x = _graphs()[name]
    params = [p for p in module.parameters() if p.requires_grad]
    cuts = stage_module.Cuts(params)
    first = x.clone().requires_grad_()
    cuts.of([module(first)], [first])
    second = (x + 1).requires_grad_()
    out = module(second)
    cached = cuts.of([out], [second])
    assert len(cuts._shapes) == 1  # found once
    assert _same_cut(cached, stage_module.Cuts(params).of([out], [second]))
    assert cached.edges  # something to compare


class _Branching(nn.Module):
    """A stage whose graph depends on its input: two Linears of the same shape take turns (one graph's nodes
    and edges, another parameter), and a third way adds a bias twice (another graph)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.shift = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        way = int(x[0, 0].item() * 10) % 3
        if way == 0:
            return torch.tanh(self.a(x)) + self.shift
        if way == 1:
            return torch.tanh(self.b(x)) + self.shift
        return torch.tanh(self.a(x) + self.shift) + self.shift


@pytest.mark.parametrize("fused", [False, True])
def test_a_stage_whose_graph_changes_with_its_input_gets_each_graphs_gradients(fused: bool) -> None:
    module = _Branching()
    ref = copy.deepcopy(module)
    xs = [torch.randn(4, 8) for _ in range(6)]
    for k, x in enumerate(xs):
        x[0, 0] = (k % 3) / 10 + 0.01  # each way twice, interleaved
    gs = [torch.randn(4, 8) for _ in xs]
    for x, g in zip(xs, gs, strict=True):
        ref(x).backward(g)
    runner = StageRunner(module)
    outs = [runner.forward(mb, (x,)) for mb, x in enumerate(xs)]
    for mb, g in enumerate(gs):
        if fused:
            runner.backward(mb, (g,))
        else:
            runner.backward_input(mb, (g,))
    if not fused:
        for mb in range(len(xs)):
            runner.backward_weight(mb)
        assert len(runner._cuts._shapes) == 3  # a and b: the same nodes and edges, other parameters
    assert len(outs) == len(xs)
    for p, q in zip(module.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)

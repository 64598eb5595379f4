"""K-FAC factors, inverses and preconditioning against explicit sums, the dense Fisher and dense solves."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from pipefold.errors import ConfigError
from pipefold.runtime.kfac import KFAC, KFACConfig, LinearFactors, dense_fisher_block

F64 = torch.float64


def _layer(d_in: int, d_out: int, *, bias: bool = True, dtype: torch.dtype = F64, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(d_in, d_out, bias=bias).to(dtype)


def _outer_mean(rows: list[Tensor]) -> Tensor:
    """Mean of r r^T, one explicit outer product per row (the reference for the factors)."""
    total = torch.zeros(len(rows[0]), len(rows[0]), dtype=F64)
    for r in rows:
        r = r.to(F64)
        total += torch.outer(r, r)
    return total / len(rows)


def _with_one(a: Tensor) -> list[Tensor]:
    return [torch.cat([row, row.new_ones(1)]) for row in a.reshape(-1, a.shape[-1])]


def _vec(x: Tensor) -> Tensor:
    """Column-major vec: stack the columns, entry (i, j) at j * rows + i."""
    return torch.cat([x[:, j] for j in range(x.shape[1])])


def _pi(A: Tensor, G: Tensor) -> float:
    return math.sqrt((A.diagonal().sum().item() / A.shape[0]) / (G.diagonal().sum().item() / G.shape[0]))


def test_factors_equal_explicit_sums() -> None:
    lf = LinearFactors(_layer(5, 3))
    torch.manual_seed(1)
    a, g, scale = torch.randn(2, 4, 5, dtype=F64), torch.randn(2, 4, 3, dtype=F64), 2.5
    lf.add_a(a[0])  # two calls, as two microbatches would
    lf.add_a(a[1])
    lf.add_g(g, scale)
    lf.invert(KFACConfig(ema=0.0))
    assert lf.A is not None and lf.G is not None
    torch.testing.assert_close(lf.A, _outer_mean(_with_one(a)))
    torch.testing.assert_close(lf.G, _outer_mean([scale * row for row in g.reshape(-1, 3)]))

    # Without a bias there is no column of ones; float32 layers keep float32 factors.
    lf = LinearFactors(_layer(5, 3, bias=False, dtype=torch.float32))
    lf.add_a(a.float())
    lf.add_g(g.float(), 1.0)
    lf.invert(KFACConfig())
    assert lf.A is not None and lf.A.dtype == torch.float32 and lf.A.shape == (5, 5)
    torch.testing.assert_close(lf.A.double(), _outer_mean(list(a.reshape(-1, 5))), rtol=1e-5, atol=1e-5)


def test_dense_fisher_block_is_column_major_second_moment() -> None:
    torch.manual_seed(2)
    grads = torch.randn(7, 2, 3, dtype=F64)
    dense = dense_fisher_block(grads)
    assert dense.shape == (6, 6)
    for i, j, k, m in [(0, 0, 0, 0), (1, 0, 0, 2), (1, 2, 0, 1), (0, 1, 1, 2)]:
        expected = (grads[:, i, j] * grads[:, k, m]).mean()
        torch.testing.assert_close(dense[j * 2 + i, m * 2 + k], expected)


def _per_example(layer: nn.Linear, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-example gradients of [W | b] (torch.func) and output gradients (a tensor hook) of 0.5*||Wx+b-y||^2."""
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return 0.5 * ((functional_call(layer, p, (xi,)) - yi) ** 2).sum()

    gp = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    per_example = torch.cat([gp["weight"], gp["bias"][:, :, None]], dim=2)
    captured: list[Tensor] = []
    out = layer(x)
    out.register_hook(lambda t: captured.append(t.detach()))
    (0.5 * ((out - y) ** 2).sum()).backward()  # a sum of per-example losses: row i of the output grad is example i's
    return per_example, captured[0]


def test_one_example_kfac_is_exact_and_many_are_not() -> None:
    layer = _layer(3, 2, seed=3)
    torch.manual_seed(4)
    x, y = torch.randn(1, 3, dtype=F64), torch.randn(1, 2, dtype=F64)
    per_example, g = _per_example(layer, x, y)
    lf = LinearFactors(layer)
    lf.add_a(x[0])
    lf.add_g(g[0], 1.0)
    lf.invert(KFACConfig())
    assert lf.A is not None and lf.G is not None
    torch.testing.assert_close(torch.kron(lf.A, lf.G), dense_fisher_block(per_example), rtol=0, atol=1e-6)

    x, y = torch.randn(6, 3, dtype=F64), torch.randn(6, 2, dtype=F64)
    per_example, g = _per_example(layer, x, y)
    # The hook's rows are the per-example output gradients: each example's gradient is g_i [x_i, 1]^T.
    torch.testing.assert_close(per_example, torch.stack([torch.outer(g[i], r) for i, r in enumerate(_with_one(x))]))
    lf = LinearFactors(layer)
    lf.add_a(x)
    lf.add_g(g, 1.0)
    lf.invert(KFACConfig())
    assert lf.A is not None and lf.G is not None
    kfac = torch.kron(lf.A, lf.G)
    torch.testing.assert_close(kfac, torch.kron(_outer_mean(_with_one(x)), _outer_mean(list(g))))
    assert (kfac - dense_fisher_block(per_example)).abs().max() > 1e-3


@pytest.mark.parametrize("damping", [1e-3, 0.3])
def test_preconditioning_equals_dense_solve(damping: float) -> None:
    layer = _layer(4, 3, seed=5)
    torch.manual_seed(6)
    a, g = torch.randn(10, 4, dtype=F64), torch.randn(10, 3, dtype=F64) * 0.1
    gw, gb = torch.randn(3, 4, dtype=F64), torch.randn(3, dtype=F64)
    lf = LinearFactors(layer)
    lf.add_a(a)
    lf.add_g(g, 3.0)
    lf.invert(KFACConfig(damping=damping))
    layer.weight.grad, layer.bias.grad = gw.clone(), gb.clone()
    lf.precondition()

    A, G = _outer_mean(_with_one(a)), _outer_mean([3.0 * r for r in g])
    pi, root = _pi(A, G), math.sqrt(damping)
    damped = torch.kron(A + pi * root * torch.eye(5, dtype=F64), G + root / pi * torch.eye(3, dtype=F64))
    expected = torch.linalg.solve(damped, _vec(torch.cat([gw, gb[:, None]], dim=1)))
    got = _vec(torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1))
    torch.testing.assert_close(got, expected)

    # A float32 layer gets the same answer in float32, written into float32 gradients.
    layer32 = _layer(4, 3, dtype=torch.float32, seed=5)
    lf32 = LinearFactors(layer32)
    lf32.add_a(a.float())
    lf32.add_g(g.float(), 3.0)
    lf32.invert(KFACConfig(damping=damping))
    layer32.weight.grad, layer32.bias.grad = gw.float(), gb.float()
    lf32.precondition()
    assert layer32.weight.grad.dtype == torch.float32
    got32 = _vec(torch.cat([layer32.weight.grad, layer32.bias.grad[:, None]], dim=1))
    torch.testing.assert_close(got32.double(), expected, rtol=1e-3, atol=1e-3)


def test_running_average() -> None:
    lf = LinearFactors(_layer(3, 2))
    config = KFACConfig(ema=0.5)
    torch.manual_seed(7)
    a1, g1 = torch.randn(5, 3, dtype=F64), torch.randn(5, 2, dtype=F64)
    a2, g2 = torch.randn(4, 3, dtype=F64) + 1, torch.randn(4, 2, dtype=F64) * 3
    lf.add_a(a1)
    lf.add_g(g1, 1.0)
    lf.invert(config)
    lf.add_a(a2)
    lf.add_g(g2, 2.0)
    lf.invert(config)
    assert lf.A is not None and lf.G is not None
    torch.testing.assert_close(lf.A, 0.5 * _outer_mean(_with_one(a1)) + 0.5 * _outer_mean(_with_one(a2)))
    torch.testing.assert_close(lf.G, 0.5 * _outer_mean(list(g1)) + 0.5 * _outer_mean([2.0 * r for r in g2]))


def test_partial_updates_and_untouched_gradients() -> None:
    layer = _layer(3, 2)
    lf = LinearFactors(layer)
    config = KFACConfig(damping=0.01)
    assert lf.state_bytes() == 0
    lf.invert(config)  # nothing ever added: nothing happens
    assert lf.A is None and lf.G is None and lf.A_inv is None and lf.G_inv is None

    gw, gb = torch.randn(2, 3, dtype=F64), torch.randn(2, dtype=F64)
    layer.weight.grad, layer.bias.grad = gw.clone(), gb.clone()
    lf.precondition()  # never inverted: gradients stay
    assert torch.equal(layer.weight.grad, gw) and torch.equal(layer.bias.grad, gb)

    torch.manual_seed(8)
    a1 = torch.randn(6, 3, dtype=F64)
    lf.add_a(a1)
    assert lf.state_bytes() == 4 * 4 * 8  # the A sum only
    lf.invert(config)  # A only: no inverses yet
    assert lf.A is not None and lf.G is None and lf.A_inv is None
    lf.precondition()
    assert torch.equal(layer.weight.grad, gw) and torch.equal(layer.bias.grad, gb)

    g1 = torch.randn(6, 2, dtype=F64)
    lf.add_g(g1, 1.0)
    lf.invert(config)  # G arrives: A is kept, inverses now exist
    A1 = _outer_mean(_with_one(a1))
    torch.testing.assert_close(lf.A, A1)
    assert lf.A_inv is not None and lf.G_inv is not None
    assert lf.state_bytes() == 3 * (16 + 4) * 8  # factors, inverses and the sums, kept zeroed for the next refresh

    a2 = torch.randn(6, 3, dtype=F64) * 2
    lf.add_a(a2)
    G_before = lf.G.clone()
    lf.invert(config)  # A only: G unchanged, inverses follow the new A
    A2, root = _outer_mean(_with_one(a2)), math.sqrt(0.01)
    torch.testing.assert_close(lf.A, A2)
    assert torch.equal(lf.G, G_before)
    pi = _pi(A2, G_before)
    torch.testing.assert_close(lf.A_inv, torch.linalg.inv(A2 + pi * root * torch.eye(4, dtype=F64)))
    torch.testing.assert_close(lf.G_inv, torch.linalg.inv(G_before + root / pi * torch.eye(2, dtype=F64)))

    layer.weight.grad = None
    layer.bias.grad = gb.clone()
    lf.precondition()  # no weight gradient: nothing is touched
    assert layer.weight.grad is None and torch.equal(layer.bias.grad, gb)


@pytest.mark.parametrize(
    ("options", "shown"),
    [({"damping": 0.0}, "0.0"), ({"damping": float("nan")}, "nan"), ({"ema": 1.0}, "1.0"), ({"ema": -0.1}, "-0.1")],
)
def test_config_rejects(options: dict[str, float], shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        KFACConfig(**options)
    text = str(info.value)
    assert f"(got {shown})" in text and "\n" not in text
    assert next(iter(options)) in text


def test_kfac_over_sequential_with_microbatches() -> None:
    torch.manual_seed(9)
    first_layer, second_layer = nn.Linear(4, 5).to(F64), nn.Linear(5, 2).to(F64)
    model = nn.Sequential(first_layer, nn.ReLU(), second_layer)
    kfac = KFAC(model, KFACConfig(damping=0.1))
    assert kfac.names == ["0", "2"]
    assert [lf.layer for lf in kfac.layers] == [first_layer, second_layer]
    last = kfac.layers[1]

    x, y = torch.randn(8, 4, dtype=F64), torch.randn(8, 2, dtype=F64)
    microbatches, n = 2, 4

    def on_grad(_m: nn.Module, _gi: object, go: tuple[Tensor, ...]) -> None:
        last.add_g(go[0], microbatches * n)

    hooks = [
        second_layer.register_forward_hook(lambda _m, inp, _out: last.add_a(inp[0])),
        second_layer.register_full_backward_hook(on_grad),
    ]
    for xm, ym in zip(x.split(n), y.split(n), strict=True):  # each microbatch's loss: a mean, divided by M
        (((model(xm) - ym) ** 2).sum(dim=1).mean() / microbatches).backward()
    for h in hooks:
        h.remove()
    kfac.invert()
    assert kfac.layers[0].A is None and last.A is not None and last.G is not None

    # The reference: each row's own loss, its own backward, its own output gradient.
    inputs, grads = [], []
    for i in range(8):
        hidden = torch.relu(first_layer(x[i])).detach()
        out = second_layer(hidden)
        out.retain_grad()
        ((out - y[i]) ** 2).sum().backward()
        inputs.append(torch.cat([hidden, hidden.new_ones(1)]))
        assert out.grad is not None
        grads.append(out.grad)
    torch.testing.assert_close(last.A, _outer_mean(inputs))
    torch.testing.assert_close(last.G, _outer_mean(grads))
    assert kfac.state_bytes() == last.state_bytes() == 3 * (36 + 4) * 8  # factors, inverses, zeroed sums

    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    assert first_layer.weight.grad is not None and second_layer.weight.grad is not None
    first, second = first_layer.weight.grad.clone(), second_layer.weight.grad.clone()
    kfac.precondition()  # layer 0 was never inverted and keeps its gradient; layer 2's is preconditioned
    assert torch.equal(first_layer.weight.grad, first) and not torch.allclose(second_layer.weight.grad, second)

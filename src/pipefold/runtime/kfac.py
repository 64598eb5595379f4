"""K-FAC (Martens & Grosse 2015) for ``nn.Linear`` layers, with curvature added per microbatch at separate times.

A Linear layer's Fisher block over its ``[W | b]`` matrix is approximated by ``kron(A, G)``, where
``A = E[a a^T]`` over its inputs (with a trailing 1 when it has a bias) and ``G = E[g g^T]`` over the
per-row gradients of the loss w.r.t. its output. The pipeline runtime calls :meth:`LinearFactors.add_a`
after a microbatch's forward (``KA``), :meth:`LinearFactors.add_g` after its backward (``KG``),
:meth:`LinearFactors.invert` when a refresh is complete (``KI``) and :meth:`LinearFactors.precondition`
before each optimizer step (``KP``); see :mod:`pipefold.plan.pipefisher` for where that work is placed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipefold.errors import ConfigError

__all__ = ["KFAC", "KFACConfig", "LinearFactors", "dense_fisher_block", "gram"]


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """How factors are averaged and damped."""

    damping: float = 1e-3
    """Tikhonov damping lambda of the Fisher block, split between the two factors (pi-corrected, see below)."""
    ema: float = 0.0
    """Running-average decay of the factors: at each inversion, factor <- ema*old + (1-ema)*new (0: the newest only)."""
    distribution: str = "dp-kfac"
    """Over data-parallel copies: 'dp-kfac' (each layer's factors built, inverted and applied by one copy) or
    'd-kfac' (every copy builds every factor, all-reduced); see :mod:`pipefold.plan.dpkfac`."""

    def __post_init__(self) -> None:
        if not (isinstance(self.damping, int | float) and math.isfinite(self.damping) and self.damping > 0):
            raise ConfigError(f"damping must be a finite number > 0, e.g. 1e-3 (got {self.damping!r})")
        if not (isinstance(self.ema, int | float) and 0 <= self.ema < 1):
            raise ConfigError(f"ema must be a number with 0 <= ema < 1, e.g. 0.95 (got {self.ema!r})")
        from pipefold.plan.dpkfac import DISTRIBUTIONS

        if self.distribution not in DISTRIBUTIONS:
            raise ConfigError(f"unknown K-FAC distribution {self.distribution!r}: use {' or '.join(DISTRIBUTIONS)}")


def gram(x: Tensor) -> Tensor:
    """``x^T x`` in float32 at least, so that low-precision inputs do not lose the sum."""
    x = x.detach().to(torch.promote_types(x.dtype, torch.float32))
    return x.T @ x


def _sym(x: Tensor) -> Tensor:
    return (x + x.T) / 2


def _spd_inverse(x: Tensor, shift: float) -> Tensor:
    """``inv(x + shift I)`` for a symmetric positive semi-definite ``x`` and ``shift > 0``: by its Cholesky
    factor, about twice as fast as a general inverse (the inversion is K-FAC's largest single piece of work)."""
    eye = torch.eye(x.shape[0], dtype=x.dtype, device=x.device)
    return torch.cholesky_inverse(torch.linalg.cholesky(x + shift * eye))


def _fold(old: Tensor | None, new: Tensor, ema: float) -> Tensor:
    """The running factor ``ema * old + (1 - ema) * new``, in ``old``'s storage (``new`` the first time)."""
    if old is None:
        return new
    return old.mul_(ema).add_(new, alpha=1 - ema)


def _put(old: Tensor | None, new: Tensor) -> Tensor:
    """``new``, written into ``old``'s storage where there is one."""
    return new if old is None else old.copy_(new)


class LinearFactors:
    """One nn.Linear's K-FAC state: curvature sums since the last inversion, running factors, damped inverses."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer
        self.A: Tensor | None = None
        self.G: Tensor | None = None
        self.A_inv: Tensor | None = None
        self.G_inv: Tensor | None = None
        self._a_sum: Tensor | None = None
        self._g_sum: Tensor | None = None
        self._a_rows = 0
        self._g_rows = 0

    def a_rows(self, a: Tensor) -> Tensor:
        """The rows of the layer's input ``a`` of shape ``(..., d_in)`` that ``A`` sums: one per leading index, with
        a trailing 1 where the layer has a bias."""
        if a.shape[-1] != self.layer.in_features:
            raise ValueError(f"input has {a.shape[-1]} features, layer takes {self.layer.in_features}")
        rows = a.detach().reshape(-1, a.shape[-1])
        if self.layer.bias is not None:
            rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
        return rows

    def g_rows(self, g: Tensor, scale: float) -> Tensor:
        """The rows ``scale * g`` that ``G`` sums (``g``: the loss gradient w.r.t. the output, ``(..., d_out)``).

        ``scale`` makes ``scale * g`` the per-row gradient: for a loss that is a mean over n rows and then
        divided by M microbatches, ``scale = M * n``.
        """
        if g.shape[-1] != self.layer.out_features:
            raise ValueError(f"output gradient has {g.shape[-1]} features, layer gives {self.layer.out_features}")
        rows = g.detach().reshape(-1, g.shape[-1])
        return rows.to(torch.promote_types(rows.dtype, torch.float32)) * scale

    def add_a(self, a: Tensor) -> None:
        """Add the layer's input ``a`` of shape ``(..., d_in)`` to the A sum, one row per leading index."""
        rows = self.a_rows(a)
        self.add_a_gram(gram(rows), rows.shape[0])

    def add_g(self, g: Tensor, scale: float) -> None:
        """Add ``scale * g`` (see :meth:`g_rows`) to the G sum."""
        rows = self.g_rows(g, scale)
        self.add_g_gram(gram(rows), rows.shape[0])

    def add_a_gram(self, product: Tensor, rows: int) -> None:
        """Add ``rows`` rows' ``x^T x`` (:func:`gram`) to the A sum."""
        self._a_sum = product if self._a_sum is None else self._a_sum.add_(product)
        self._a_rows += rows

    def add_g_gram(self, product: Tensor, rows: int) -> None:
        """Add ``rows`` rows' ``x^T x`` (:func:`gram`) to the G sum."""
        self._g_sum = product if self._g_sum is None else self._g_sum.add_(product)
        self._g_rows += rows

    def invert(self, config: KFACConfig) -> None:
        """Fold the sums into the running factors, then recompute the damped inverses when both factors exist.

        Every tensor of the state is made once and updated in place from then on: the state is allocated in
        the first steps and stays (:meth:`state_bytes`), like an optimizer's, not a step's memory.
        """
        if self._a_sum is not None and self._a_rows > 0:
            self.A = _fold(self.A, self._a_sum / self._a_rows, config.ema)
            self._a_sum.zero_()
            self._a_rows = 0
        if self._g_sum is not None and self._g_rows > 0:
            self.G = _fold(self.G, self._g_sum / self._g_rows, config.ema)
            self._g_sum.zero_()
            self._g_rows = 0
        if self.A is None or self.G is None:
            return
        A, G = _sym(self.A), _sym(self.G)
        tr_a, tr_g = float(torch.trace(A)) / A.shape[0], float(torch.trace(G)) / G.shape[0]
        # pi balances the damping between the factors by their average eigenvalue (Martens & Grosse, sec. 6.3).
        pi = math.sqrt(tr_a / tr_g) if tr_a > 0 and tr_g > 0 else 1.0
        root = math.sqrt(config.damping)
        self.A_inv = _put(self.A_inv, _spd_inverse(A, pi * root))
        self.G_inv = _put(self.G_inv, _spd_inverse(G, root / pi))

    def precondition(self) -> None:
        """Replace the gradient of ``[W | b]`` by ``G_inv @ grad @ A_inv``, in place.

        Left alone before the first inversion or when the weight has no gradient. A bias without a
        gradient counts as a zero column and is not written.
        """
        w, b = self.layer.weight, self.layer.bias
        if self.A_inv is None or self.G_inv is None or w.grad is None:
            return
        dtype = self.A_inv.dtype
        grad = w.grad.to(dtype)
        if b is not None:
            col = b.grad.to(dtype) if b.grad is not None else grad.new_zeros(grad.shape[0])
            grad = torch.cat([grad, col[:, None]], dim=1)
        out = self.G_inv @ grad @ self.A_inv
        w.grad.copy_(out[:, : w.shape[1]])
        if b is not None and b.grad is not None:
            b.grad.copy_(out[:, -1])

    def state_bytes(self) -> int:
        """Bytes of A, G, A_inv, G_inv and the sums, as allocated so far."""
        held = (self.A, self.G, self.A_inv, self.G_inv, self._a_sum, self._g_sum)
        return sum(t.numel() * t.element_size() for t in held if t is not None)


class KFAC:
    """K-FAC state of every nn.Linear inside a module, in the order of module.named_modules()."""

    def __init__(self, module: nn.Module, config: KFACConfig | None = None) -> None:
        self.config = config if config is not None else KFACConfig()
        found = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
        self.names: list[str] = [name for name, _ in found]
        self.layers: list[LinearFactors] = [LinearFactors(m) for _, m in found]

    def invert(self) -> None:
        for layer in self.layers:
            layer.invert(self.config)

    def precondition(self) -> None:
        for layer in self.layers:
            layer.precondition()

    def state_bytes(self) -> int:
        return sum(layer.state_bytes() for layer in self.layers)


def dense_fisher_block(per_example_grads: Tensor) -> Tensor:
    """Dense empirical Fisher ``E_i[vec(g_i) vec(g_i)^T]`` of one Linear's ``[W | b]`` matrix.

    ``per_example_grads`` has shape ``(n, d_out, d_in(+1))``. ``vec`` is column-major: it stacks the
    columns of a ``(d_out, d_in)`` matrix, so index ``j * d_out + i`` holds entry ``(i, j)``. With that
    convention ``kron(A, G) @ vec(X) == vec(G @ X @ A)`` for symmetric ``A``, and ``kron(A, G)`` is the
    K-FAC approximation of the returned ``(d_out*d_in, d_out*d_in)`` matrix (exact for one example).
    """
    if per_example_grads.dim() != 3:
        shape = tuple(per_example_grads.shape)
        raise ValueError(f"per-example gradients must have shape (n, d_out, d_in) (got {shape})")
    n = per_example_grads.shape[0]
    vecs = per_example_grads.transpose(1, 2).reshape(n, -1)
    return vecs.T @ vecs / n

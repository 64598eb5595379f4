"""A DLRM-style recommendation model and its skewed data: embedding rows come in as inputs, so the tables can live
anywhere (another process: :mod:`pipefold.runtime.bagpipe`).

One sample is a vector of dense features, one row id per table and a click label. The model::

    dense (B, F) ── bottom MLP ──> x (B, D) ─┐
    rows  (T, B, D) ─────────────────────────┴─> pairwise dots of [x, row_1..row_T] ── [x, dots] ── top MLP ──> logit

The tables are not part of the module: :func:`init_tables` makes their initial values, and whoever holds them
gathers the batch's rows and hands them to :meth:`DLRM.forward`. The data (:func:`dlrm_batch`) draws each table's ids
from a Zipf law whose exponent puts ``skew`` of the accesses on the ``hot`` share of the rows (by default 1% of the
rows take 92% of the accesses), a pure function of the seed and the step. The model is not a
:class:`~pipefold.models.base.Model` (a flat list of layers fed a batch): its inputs are rows gathered from tables
held elsewhere, so it stands as a family of its own that the Bagpipe runtime and benchmark use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models._build import check_positive_int, generator, normal_

__all__ = ["DLRM", "DLRMBatch", "DLRMConfig", "dlrm_batch", "dlrm_loss", "init_tables", "zipf_exponent"]


@dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """The model's shape and its data's."""

    tables: int = 4
    """Embedding tables (sparse features), one id per sample from each."""
    rows: int = 1000
    """Rows per table."""
    dim: int = 16
    """Width D of an embedding row (and of the bottom MLP's output)."""
    dense: int = 8
    """Dense features per sample."""
    hidden: int = 32
    """Width of the bottom and top MLPs' hidden layer."""
    batch: int = 32
    """Samples per step."""
    hot: float = 0.01
    """Share of each table's rows that take ``skew`` of its accesses."""
    skew: float = 0.92
    """Share of the accesses that go to the ``hot`` rows."""
    seed: int = 0
    """Initial weights, tables and data."""

    def __post_init__(self) -> None:
        for name in ("tables", "rows", "dim", "dense", "hidden", "batch"):
            check_positive_int("DLRMConfig", name, getattr(self, name))
        if not 0 < self.hot < 1 or self.hot * self.rows < 1:
            raise ConfigError(f"the hot share of the rows is above 0, below 1 and at least one row of {self.rows} "
                              f"(got {self.hot!r})")
        if not self.hot <= self.skew < 1:
            raise ConfigError(f"the skew (share of accesses on the hot rows) is from the hot share {self.hot:g} "
                              f"(uniform) to below 1 (got {self.skew!r})")

    @property
    def keys(self) -> int:
        """Rows of all tables: a row's key is ``table * rows + row``."""
        return self.tables * self.rows


@dataclass(frozen=True)
class DLRMBatch:
    """One step's samples."""

    dense: torch.Tensor
    """(B, F) float32 dense features."""
    ids: torch.Tensor
    """(T, B) int64 row ids, one per table per sample."""
    labels: torch.Tensor
    """(B,) float32 clicks, 0 or 1."""

    def keys(self, rows: int) -> torch.Tensor:
        """(T, B) keys of all tables' rows: ``table * rows + id``."""
        return self.ids + rows * torch.arange(self.ids.shape[0]).unsqueeze(1)

    def part(self, index: int, parts: int) -> DLRMBatch:
        """The ``index``-th of ``parts`` equal slices of the samples (a data-parallel trainer's share)."""
        size = self.dense.shape[0] // parts
        cut = slice(index * size, (index + 1) * size)
        return DLRMBatch(self.dense[cut], self.ids[:, cut], self.labels[cut])


def _mlp(sizes: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no ReLU after the last


class DLRM(nn.Module):
    """The dense part of the model: bottom MLP, dot-product interaction, top MLP (no tables)."""

    _pairs: torch.Tensor

    def __init__(self, cfg: DLRMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        features = cfg.tables + 1
        self.bottom = _mlp((cfg.dense, cfg.hidden, cfg.dim))
        self.top = _mlp((cfg.dim + features * (features - 1) // 2, cfg.hidden, 1))
        gen = generator("dlrm", cfg.seed, "mlp")
        with torch.no_grad():
            for layer in (*self.bottom, *self.top):
                if isinstance(layer, nn.Linear):
                    normal_(layer.weight, math.sqrt(2.0 / layer.in_features), gen)
                    layer.bias.zero_()
        i, j = torch.triu_indices(features, features, offset=1)
        self.register_buffer("_pairs", torch.stack([i, j]), persistent=False)

    def forward(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Click logits (B,) of the samples' dense features (B, F) and their rows of every table (T, B, D)."""
        x = self.bottom(dense)  # (B, D)
        feats = torch.cat([x.unsqueeze(1), rows.transpose(0, 1)], dim=1)  # (B, T+1, D)
        dots = feats @ feats.transpose(1, 2)  # (B, T+1, T+1)
        inter = dots[:, self._pairs[0], self._pairs[1]]  # (B, T(T+1)/2)
        out: torch.Tensor = self.top(torch.cat([x, inter], dim=1)).squeeze(1)
        return out


def dlrm_loss(logits: torch.Tensor, labels: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Binary cross-entropy of the logits, summed and divided by ``total`` samples (default: these), so that shares of
    a batch add up to the whole batch's mean."""
    summed = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return summed / (total if total is not None else logits.shape[0])


def init_tables(cfg: DLRMConfig) -> torch.Tensor:
    """The tables' initial values, (T * rows, D) float32: table t's rows are ``t * rows`` onwards."""
    out = torch.empty(cfg.keys, cfg.dim)
    normal_(out, 1.0 / math.sqrt(cfg.dim), generator("dlrm", cfg.seed, "tables"))
    return out


def zipf_exponent(rows: int, hot: float, skew: float) -> float:
    """The exponent s of a Zipf law over ``rows`` ranks (weight of rank r: 1 / r**s) whose first ``hot`` share of the
    ranks take ``skew`` of the mass (bisection: the share grows with s)."""
    k = max(1, round(hot * rows))
    if k >= rows:
        return 0.0

    ranks = torch.arange(1, rows + 1, dtype=torch.float64)

    def share(s: float) -> float:
        weights = ranks ** -s
        return float(weights[:k].sum() / weights.sum())

    lo, hi = 0.0, 1.0
    while share(hi) < skew and hi < 64:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) < skew else (lo, mid)
    return (lo + hi) / 2


_LAWS: dict[tuple[int, int, int, float, float, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _law(cfg: DLRMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, rows) probabilities of each table's rows (a Zipf law over ranks, the ranks scattered over the rows by a
    seeded permutation per table) and (dense + 1,) weights of the click rule; made once per shape."""
    key = (cfg.tables, cfg.rows, cfg.dense, cfg.hot, cfg.skew, cfg.seed)
    if key not in _LAWS:
        s = zipf_exponent(cfg.rows, cfg.hot, cfg.skew)
        ranks = torch.arange(1, cfg.rows + 1, dtype=torch.float64) ** -s
        probs = []
        for t in range(cfg.tables):
            order = torch.randperm(cfg.rows, generator=generator("dlrm", cfg.seed, "rows", t))
            probs.append(torch.empty_like(ranks).index_copy_(0, order, ranks / ranks.sum()))
        rule = torch.randn(cfg.dense + 1, generator=generator("dlrm", cfg.seed, "rule"))
        _LAWS[key] = (torch.stack(probs), rule)
    return _LAWS[key]


def dlrm_batch(cfg: DLRMConfig, step: int) -> DLRMBatch:
    """The samples of step ``step``: the same in every process for the same config and step."""
    probs, rule = _law(cfg)
    gen = generator("dlrm", cfg.seed, "batch", step)
    dense = torch.randn(cfg.batch, cfg.dense, generator=gen)
    ids = torch.multinomial(probs, cfg.batch, replacement=True, generator=gen)  # (T, B)
    # A click depends on the dense features and on whether the first table's row is among its popular ones.
    popular = probs[0, ids[0]] > 1.0 / cfg.rows
    score = dense @ rule[:-1] + rule[-1] * popular.float() + 0.5 * torch.randn(cfg.batch, generator=gen)
    return DLRMBatch(dense, ids, (score > 0).float())

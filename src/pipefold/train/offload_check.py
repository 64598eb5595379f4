"""Run a model with and without :class:`~pipefold.runtime.offload.Offloaded` and compare: residency, time, exactness.

Used by ``pipefold offload`` and ``benchmarks/bench_offload.py``. The model is built twice from the
same seed as a :class:`Stacked` module (its embedding layers, one nn.ModuleList of its blocks,
its head layers), so only the blocks are offloaded and the embedding and head stay resident.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models import Model, make_model
from pipefold.runtime.offload import Offloaded, choose_k
from pipefold.runtime.stage import as_tuple, run_layers

__all__ = ["Case", "Stacked", "default_device", "make_case", "pick_k", "run_check", "step_times"]


class Stacked(nn.Module):
    """``pre`` layers, then ``blocks`` (one nn.ModuleList: what Offloaded offloads), then ``post`` layers.

    A layer may take and return a tuple of tensors (token ids and an attention mask), as in a pipeline stage.
    """

    def __init__(self, pre: list[nn.Module], blocks: list[nn.Module], post: list[nn.Module]) -> None:
        super().__init__()
        self.pre = nn.Sequential(*pre)
        self.blocks = nn.ModuleList(blocks)
        self.post = nn.Sequential(*post)

    def forward(self, *xs: torch.Tensor) -> Any:
        out: Any = xs
        for part in (self.pre, self.blocks, self.post):
            out = run_layers(part, as_tuple(out))
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out

    @property
    def static_bytes(self) -> int:
        """Parameter bytes outside the blocks: always resident."""
        return sum(p.nbytes for m in (self.pre, self.post) for p in m.parameters())

    @property
    def block_bytes(self) -> list[int]:
        return [sum(p.nbytes for p in b.parameters()) for b in self.blocks]

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.parameters())


@dataclass(frozen=True)
class Case:
    """How to build one model, and its input, target and loss: a registered model's first batch."""

    model: Model

    def build(self) -> Stacked:
        """A fresh model on the CPU: the same weights every call."""
        flat, m = self.model.build(), self.model
        return Stacked(flat[:m.embedding_layers], flat[m.embedding_layers:m.num_layers - m.head_layers],
                       flat[m.num_layers - m.head_layers:])

    @functools.cached_property
    def batch(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        x, y = self.model.batch_at(0)
        return as_tuple(x), y

    def data(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Inputs (a tuple) and target of one batch (the same every step)."""
        return self.batch

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model.loss(out, target)

    def layer_name(self, block: int) -> str:
        """A block's name for messages, with its index in the flat model."""
        return self.model.layer_name(self.model.embedding_layers + block)


def make_case(model: str, *, seed: int = 0, device: str | None = None, **args: Any) -> Case:
    """The Case of registered model ``model`` made from :class:`~pipefold.models.ModelArgs` keywords (one-line
    ConfigError on a bad one, on a model this machine cannot hold twice with its gradients, or on a step that
    would take minutes on ``device``, :func:`default_device` when None)."""
    from pipefold.models.size import check_model

    case = Case(make_model(model, seed=seed, **args))
    # Two models, plain and offloaded, and their gradients, all kept in host memory; the products run on the device.
    check_model(case.model, copies=4, computed_on=device or default_device(), what=f"offloading {model}")
    return case


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_k(case: Case, budget: int) -> tuple[int, int]:
    """k and k' for a budget of parameter bytes on the device, resident parts (embedding, head) included."""
    model = case.build()
    static, sizes = model.static_bytes, model.block_bytes
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    need = static + sizes[largest]
    if budget < need:
        resident = f"the resident embedding and head ({static} bytes) plus " if static else ""
        raise ConfigError(f"a budget of {budget} bytes cannot hold {resident}the largest layer, "
                          f"{case.layer_name(largest)} of {sizes[largest]} bytes: give --budget {need} or more")
    return choose_k(sizes, budget - static)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().cpu() - b.detach().cpu()).abs().max()) if a.numel() else 0.0


def step_times(model: nn.Module, case: Case, device: str, steps: int, *, train: bool, lr: float = 0.1,
               on_step: Callable[[int, torch.Tensor], None] | None = None) -> list[float]:
    """Seconds of each of ``steps`` steps: forward only, or forward, backward and an SGD step with ``train``."""
    xs, y = case.data()
    x, y = tuple(t.to(device) for t in xs), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr) if train else None
    times = []
    for i in range(steps):
        _sync(device)
        start = time.perf_counter()
        if opt is None:
            with torch.no_grad():
                out = model(*x)
        else:
            opt.zero_grad(set_to_none=True)
            out = model(*x)
            case.loss(out, y).backward()
            opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step(i, out)
    return times


def run_check(case: Case, k: int, kprime: int, *, device: str | None = None, train: bool = False,
              steps: int = 3, lr: float = 0.1) -> dict[str, Any]:
    """Run the plain and the offloaded model on the same input (and with ``train`` the same SGD steps).

    Returns a JSON-ready dict: k, kprime, peak resident and full parameter bytes, median step times and
    the largest absolute differences of outputs (and with ``train`` of every gradient and updated weight).
    """
    device = device or default_device()
    plain = case.build().to(device)
    stacked = case.build()
    full = stacked.total_bytes
    wrapped = Offloaded(stacked, device, k=k, kprime=kprime)
    plain_params = list(plain.parameters())
    wrapped_params = list(wrapped.parameters())
    xs, y = case.data()
    x, y = tuple(t.to(device) for t in xs), y.to(device)
    out_diff = grad_diff = weight_diff = 0.0
    times: dict[str, list[float]] = {"plain": [], "offloaded": []}
    opts = {"plain": torch.optim.SGD(plain_params, lr=lr), "offloaded": torch.optim.SGD(wrapped_params, lr=lr)}
    models: dict[str, nn.Module] = {"plain": plain, "offloaded": wrapped}
    for _ in range(steps):
        outs: dict[str, torch.Tensor] = {}
        for name, model in models.items():
            _sync(device)
            start = time.perf_counter()
            if train:
                opts[name].zero_grad(set_to_none=True)
                outs[name] = model(*x)
                case.loss(outs[name], y).backward()
            else:
                with torch.no_grad():
                    outs[name] = model(*x)
            _sync(device)
            times[name].append(time.perf_counter() - start)
        out_diff = max(out_diff, _max_diff(outs["plain"], outs["offloaded"]))
        if not train:
            continue
        for p_ref, p in zip(plain_params, wrapped_params, strict=True):
            if p_ref.grad is None or p.grad is None:
                if (p_ref.grad is None) != (p.grad is None):
                    grad_diff = float("inf")
                continue
            grad_diff = max(grad_diff, _max_diff(p_ref.grad, p.grad))
        for name in models:  # the optimizer step is part of a training step's time
            start = time.perf_counter()
            opts[name].step()
            _sync(device)
            times[name][-1] += time.perf_counter() - start
        for p_ref, p in zip(plain_params, wrapped_params, strict=True):
            weight_diff = max(weight_diff, _max_diff(p_ref, p))
    tracker = wrapped.tracker
    out: dict[str, Any] = {
        "model": case.model.name, "layers": len(case.model.blocks), "batch": int(y.shape[0]),
        "seq": case.model.seq, "device": str(torch.device(device)),
        "k": k, "kprime": kprime, "train": train, "steps": steps,
        "peak_resident_bytes": tracker.peak_resident_bytes, "peak_resident_layers": tracker.peak_resident_layers,
        "resident_static_bytes": tracker.static_bytes, "largest_layer_bytes": max(wrapped.layer_bytes),
        "full_model_bytes": full, "resident_ratio": tracker.peak_resident_bytes / full,
        "step_time_s": {name: statistics.median(t) for name, t in times.items()},
        "max_abs_diff": out_diff,
    }
    if train:
        out["max_grad_diff"] = grad_diff
        out["max_weight_diff"] = weight_diff
    return out

"""Run a model with and without :class:`~pipefold.offload.Offloaded` and compare: residency, time, exactness.

Used by ``pipefold offload`` and ``benchmarks/bench_offload.py``. The model is built twice from the
same seed as a :class:`Stacked` module (the layers before the blocks, one nn.ModuleList of blocks,
the layers after), so only the blocks are offloaded and the embedding and head stay resident.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models import GPTConfig, build_model, get_model, mlp_input, mlp_target
from pipefold.models._build import generator
from pipefold.offload import Offloaded, choose_k

__all__ = ["Case", "Stacked", "default_device", "make_case", "pick_k", "run_check", "step_times"]


class Stacked(nn.Module):
    """``pre`` layers, then ``blocks`` (one nn.ModuleList: what Offloaded offloads), then ``post`` layers."""

    def __init__(self, pre: list[nn.Module], blocks: list[nn.Module], post: list[nn.Module]) -> None:
        super().__init__()
        self.pre = nn.Sequential(*pre)
        self.blocks = nn.ModuleList(blocks)
        self.post = nn.Sequential(*post)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for block in self.blocks:
            x = block(x)
        return self.post(x)

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
    """How to build one model, and its input, target and loss."""

    model: str
    layers: int
    hidden: int
    heads: int
    batch: int
    seq: int
    seed: int = 0

    def build(self) -> Stacked:
        """A fresh model on the CPU: the same weights every call."""
        if self.model == "gpt":
            flat = build_model("gpt", seed=self.seed, n_layer=self.layers, n_embd=self.hidden, n_head=self.heads,
                               block_size=max(128, self.seq))
            return Stacked(flat[:1], flat[1:-1], flat[-1:])
        flat = build_model("mlp", seed=self.seed, hidden=self.hidden, layers=self.layers)
        return Stacked([], flat, [])

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Input and target of one batch (the same every step)."""
        if self.model == "gpt":
            gen = generator("offload-data", self.seed)
            idx = torch.randint(0, GPTConfig().vocab_size, (self.batch, self.seq + 1), generator=gen)
            return idx[:, :-1], idx[:, 1:]
        cfg = get_model("mlp").make_config(hidden=self.hidden, layers=self.layers)
        return mlp_input(cfg, self.batch, self.seed), mlp_target(cfg, self.batch, self.seed)

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return get_model(self.model).loss(out, target)

    def layer_name(self, block: int) -> str:
        """A block's name for messages, with its index in the flat model."""
        return f"layer {block + 1} (block {block})" if self.model == "gpt" else f"layer {block}"


def make_case(model: str, layers: int, hidden: int, heads: int, batch: int, seq: int, seed: int = 0) -> Case:
    """A Case, checking the numbers (one-line ConfigError on a bad one)."""
    if model not in ("gpt", "mlp"):
        raise ConfigError(f"unknown model {model!r}: use gpt or mlp")
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("batch", batch), ("seq", seq)):
        if value < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {value})")
    if model == "gpt" and hidden % heads:
        raise ConfigError(f"--hidden {hidden} must be a multiple of --heads {heads}")
    from pipefold.models.size import Shape, check_fits

    # Two models (plain and offloaded), each with its gradients.
    check_fits(Shape(model=model, layers=layers, hidden=hidden, heads=heads, batch=batch, seq=seq), copies=4,
               what=f"offloading {model}")
    return Case(model, layers, hidden, heads, batch, seq, seed)


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
    x, y = (t.to(device) for t in case.data())
    opt = torch.optim.SGD(model.parameters(), lr=lr) if train else None
    times = []
    for i in range(steps):
        _sync(device)
        start = time.perf_counter()
        if opt is None:
            with torch.no_grad():
                out = model(x)
        else:
            opt.zero_grad(set_to_none=True)
            out = model(x)
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
    x, y = (t.to(device) for t in case.data())
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
                outs[name] = model(x)
                case.loss(outs[name], y).backward()
            else:
                with torch.no_grad():
                    outs[name] = model(x)
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
        "model": case.model, "layers": case.layers, "hidden": case.hidden, "batch": case.batch,
        "seq": case.seq if case.model == "gpt" else None, "device": str(torch.device(device)),
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

"""Mixed precision, the ways users train with it: one :class:`Precision` value says which.

- ``bf16`` / ``fp16``: the forwards run under ``torch.autocast`` in that dtype; the parameters, their gradients
  and the optimizer stay float32 (torch's AMP recipe). What travels between stages is what autocast made (bf16
  activations, and their gradients in bf16).
- ``master_weights``: the parameters themselves are held in the compute dtype (no autocast: the passes compute in
  it), each microbatch's gradient is added into a float32 gradient the moment it is made, and the optimizer steps
  float32 master copies, written back into the parameters after each step (Megatron-LM's way).
- ``loss_scale`` (fp16): the loss is multiplied by a scale before the backwards, so small gradients do not flush
  to zero in fp16; after the step the gradients are divided by it again, the NaN/inf verdict is taken over every
  rank of the job (one all-reduce, as :meth:`pipefold.Pipeline.check`), and a step with an inf or NaN is skipped
  by :class:`PrecisionOptimizer` on every rank alike. ``"dynamic"``: the scale halves on such a step and doubles
  after :attr:`LossScaler.interval` good ones, the same on every rank because the verdict is.

FSDP2 stages keep their own policy (``fully_shard(..., mp_policy=MixedPrecisionPolicy(...))``): the pipeline drives
their gathers and reductions as it does in float32.

Where a parameter's gradient lives: :func:`grad_holder` (the master copy with ``master_weights``, the parameter
otherwise); everything that reads or reduces gradients (data-parallel all-reduces, replicas, tied weights, the
norm, clipping) goes through it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipefold.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a tensor is touched: a run's spec checks its precision without it
    import torch
    from torch import nn

__all__ = ["DTYPES", "LossScaler", "Masters", "Precision", "PrecisionOptimizer", "grad_holder", "unscale"]

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The compute dtypes by name: torch's name of each."""

_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


@dataclass(frozen=True)
class Precision:
    """How a run computes: its dtype (``"fp32"``, ``"bf16"``, ``"fp16"``), whether the parameters are held in it
    with float32 masters (``master_weights``), and the loss scale (None, ``"dynamic"`` or a number; fp16 gets
    ``"dynamic"`` unless told otherwise, and ``"none"`` turns it off)."""

    dtype: str = "fp32"
    master_weights: bool = False
    loss_scale: str | float | None = None

    def __post_init__(self) -> None:
        name = _ALIASES.get(self.dtype, self.dtype)
        if name not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        object.__setattr__(self, "dtype", name)
        scale = self.loss_scale
        if scale is None and name == "fp16":
            scale = "dynamic"
        if scale == "none":
            scale = None
        if isinstance(scale, str) and scale != "dynamic":
            try:
                scale = float(scale)
            except ValueError:
                raise ConfigError(f"loss scale {self.loss_scale!r}: give 'dynamic', 'none' or a number") from None
        if isinstance(scale, bool) or (isinstance(scale, (int, float)) and not (1 <= scale <= 2.0 ** 64)):
            raise ConfigError(f"loss scale {self.loss_scale!r}: a fixed scale is a number from 1 to 2^64")
        if scale is not None and not isinstance(scale, str):
            scale = float(scale)
        object.__setattr__(self, "loss_scale", scale)
        if self.master_weights and name == "fp32":
            raise ConfigError("master weights are float32 copies of parameters held in a lower precision: give "
                              "dtype bf16 or fp16 with them")

    @classmethod
    def of(cls, value: Precision | str | torch.dtype | None) -> Precision:
        """A precision from its name (``"bf16"``, ``"fp16"``, ``"bf16-master"``: master weights), a torch dtype,
        or itself."""
        if value is None:
            return cls()
        if isinstance(value, Precision):
            return value
        torch = sys.modules.get("torch")  # a torch dtype comes from an imported torch
        if torch is not None and isinstance(value, torch.dtype):
            names = {getattr(torch, v): k for k, v in DTYPES.items()}
            if value not in names:
                raise ConfigError(f"dtype {value} is not one pipefold trains in; use torch.float32, torch.bfloat16 "
                                  "or torch.float16")
            return cls(names[value])
        if not isinstance(value, str):
            raise ConfigError(f"precision must be a dtype name such as 'bf16', a torch dtype or a Precision "
                              f"(got {type(value).__name__})")
        name, _, rest = value.partition("-")
        if rest not in ("", "master"):
            raise ConfigError(f"unknown precision {value!r}; use fp32, bf16, fp16, or bf16-master / fp16-master "
                              "(parameters in that dtype with float32 master weights)")
        return cls(name, master_weights=rest == "master")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, DTYPES[self.dtype])
        return dtype

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype the forwards autocast to (None: they compute in the parameters' dtype)."""
        return None if self.dtype == "fp32" or self.master_weights else self.torch_dtype

    @property
    def is_mixed(self) -> bool:
        return self.dtype != "fp32"

    def describe(self) -> str:
        if not self.is_mixed:
            return "fp32"
        how = "parameters in it, float32 master weights" if self.master_weights else "autocast, float32 parameters"
        scale = "" if self.loss_scale is None else ", dynamic loss scale" if self.loss_scale == "dynamic" else \
            f", loss scale {self.loss_scale:g}"
        return f"{self.dtype} ({how}{scale})"

    def check_device(self, device: torch.device) -> None:
        """One line where ``device`` cannot compute in the dtype."""
        import torch

        if self.dtype == "fp32":
            return
        if device.type == "cuda" and self.dtype == "bf16" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"{device} cannot compute in bf16 (it needs an Ampere or newer GPU); use --dtype fp16 "
                              "with a loss scale")
        if self.autocast is None:
            return
        # torch refuses an autocast dtype a device type has none of by a warning, and runs in float32 after it.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autocast(device.type, dtype=self.torch_dtype):
                    pass
            except (RuntimeError, ValueError) as exc:
                raise ConfigError(f"{device.type} has no autocast to {self.dtype} in torch {torch.__version__}: "
                                  f"{exc}") from exc
        refused = [w for w in caught if "autocast" in str(w.message).lower()]
        if refused:
            first = str(refused[0].message).strip().splitlines()[0]
            raise ConfigError(f"{device.type} has no autocast to {self.dtype} in torch {torch.__version__} ({first}); "
                              "use bf16")

    def scaler(self) -> LossScaler | None:
        """The loss scaler this precision runs with (None without a loss scale)."""
        if self.loss_scale is None:
            return None
        if self.loss_scale == "dynamic":
            return LossScaler()
        return LossScaler(float(self.loss_scale), dynamic=False)


class LossScaler:
    """One loss scale for the whole pipeline: the same on every rank, because every rank updates it from the same
    global verdict (:meth:`update`)."""

    def __init__(self, scale: float = 2.0 ** 16, *, dynamic: bool = True, growth: float = 2.0,
                 backoff: float = 0.5, interval: int = 2000) -> None:
        self.scale = float(scale)
        self.dynamic = dynamic
        self.growth, self.backoff, self.interval = growth, backoff, interval
        self.good = 0
        """Good steps in a row since the scale last changed."""
        self.skipped = 0
        """Steps skipped so far for an inf or NaN in the scaled gradients."""

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow, grow after :attr:`interval` good steps in a row (dynamic)."""
        if overflow:
            self.skipped += 1
            self.good = 0
            if self.dynamic:
                self.scale = max(self.scale * self.backoff, 1.0)
            return
        self.good += 1
        if self.dynamic and self.good >= self.interval:
            self.scale = min(self.scale * self.growth, 2.0 ** 64)
            self.good = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good": self.good, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good, self.skipped = float(state["scale"]), int(state["good"]), int(state["skipped"])


def grad_holder(p: torch.Tensor) -> torch.Tensor:
    """The tensor whose ``.grad`` is ``p``'s gradient: its float32 master with master weights, ``p`` otherwise."""
    master = getattr(p, "_pf_master", None)
    return master if master is not None else p


class Masters:
    """Float32 master copies of parameters held in a lower precision, and their float32 gradients.

    Each parameter's gradient is added into its master's ``.grad`` (float32) as soon as autograd accumulates it
    (a post-accumulate hook), and the parameter's own low-precision ``.grad`` is dropped: a batch's gradient is
    the float32 sum of its microbatches', as Megatron-LM's ``main_grad``."""

    def __init__(self, params: Iterable[nn.Parameter], dtype: torch.dtype) -> None:
        import torch

        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._handles = []
        for p in params:
            master = p.detach().to(torch.float32, copy=True).requires_grad_(p.requires_grad)
            with torch.no_grad():
                p.data = p.data.to(dtype)
            p._pf_master = master  # type: ignore[attr-defined]
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(_into_master))
            self.pairs.append((p, master))

    @property
    def masters(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]

    def rehome(self, p: nn.Parameter, master: torch.Tensor) -> None:
        """``p``'s master from here on is ``master`` (float32, of ``p``'s shape, anywhere: a view of a model-state
        chunk's buffer, in host memory or on the device); its gradient is added into ``master``'s
        ``_pf_slot`` where it has one (a view of the chunk's gradient buffer), on ``master``'s device."""
        for i, (q, _) in enumerate(self.pairs):
            if q is p:
                self.pairs[i] = (p, master)
                p._pf_master = master  # type: ignore[attr-defined]
                return
        raise KeyError("not a parameter of these master weights")

    def write_back(self) -> None:
        """The stepped masters into the parameters (rounded to their dtype)."""
        import torch

        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _into_master(p: torch.Tensor) -> None:
    import torch

    assert p.grad is not None
    master = p._pf_master  # type: ignore[attr-defined]
    grad = p.grad if master.device == p.grad.device else p.grad.to(master.device)
    with torch.no_grad():
        if master.grad is None:
            slot = getattr(master, "_pf_slot", None)  # a chunk's gradient buffer (runtime.chunks)
            if slot is None:
                master.grad = grad.to(torch.float32)
            else:
                slot.copy_(grad)
                master.grad = slot
        else:
            master.grad.add_(grad)
    p.grad = None


class PrecisionOptimizer:
    """The user's optimizer, wrapped for a precision: it steps the float32 masters (master weights) and writes them
    back, and it skips a step whose scaled gradients had an inf or NaN (``overflowed()`` says, the same on every
    rank). Anything else it passes to the optimizer (``param_groups``, ``state_dict``)."""

    def __init__(self, make: Callable[[list[Any]], Any], params: Sequence[nn.Parameter], masters: Masters | None,
                 overflowed: Callable[[], bool]) -> None:
        self.masters = masters
        self.optimizer = make(masters.masters if masters is not None else list(params))
        self._overflowed = overflowed
        self.skipped = 0

    def step(self) -> bool:
        """Step (and write the masters back); False where the step was skipped for an overflow."""
        if self._overflowed():
            self.skipped += 1
            return False
        self.optimizer.step()
        if self.masters is not None:
            self.masters.write_back()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)


def unscale(params: Iterable[torch.Tensor], scale: float) -> None:
    """Divide every gradient by the loss scale (in float32 where it is kept so)."""
    if scale == 1.0:
        return
    from pipefold.runtime.sharding import local

    inv = 1.0 / scale
    for p in params:
        g = grad_holder(p).grad
        if g is not None:
            local(g).mul_(inv)

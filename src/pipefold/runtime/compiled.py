"""torch.compile for a stage's layers, with the backward still split into B (input gradient) and W (weights).

A region torch.compile makes has one backward node (AOTAutograd's), a single function that computes the
gradients of the region's input and of its weights together: autograd cannot run it for one side alone, so a
split backward (torch's zero-bubble schedules too) would run it twice. pipefold compiles a stage one layer at a
time (each element of an ``nn.Sequential`` stage, or the whole module otherwise) in one of two ways:

- ``"split"`` (the default): every ``nn.Linear`` runs outside the compiled graph (``torch.compiler.disable``), so
  the compiled regions are what lies between the products: norms, activations, residuals, attention's softmax and
  dropout, fused by the compiler. The products keep their own backward nodes, which B and W split as in eager mode
  (a Linear's weight gradient is W's work, added in place). A norm's weights are inside a region: their gradients
  are made in B, as the eager runtime takes them in B too.
- ``"whole"``: each layer is one compiled region. B runs the region's backward once, which makes the weights'
  gradients too; they are kept (:attr:`pipefold.runtime.stage._Cut.made`) and W only adds them, so nothing runs
  twice, but W's work moves into B and a zero-bubble schedule has less to fill its bubbles with.

Either way the gradients are exactly those of one process running the same compiled model.
"""

from __future__ import annotations

import shutil
import sys

import torch
from torch import nn

from pipefold.errors import ConfigError

__all__ = ["BACKENDS", "MODES", "check_compile", "compile_stage"]

MODES = ("split", "whole")
BACKENDS = ("inductor", "aot_eager", "eager")
"""torch.compile backends pipefold offers: ``inductor`` generates fused kernels (C++ on a CPU, Triton on a GPU);
``aot_eager`` traces through AOTAutograd as inductor does but runs torch's own kernels (no compiler needed: the
same graphs, for checking); ``eager`` only traces."""


def check_compile(backend: str, device: torch.device) -> None:
    """One line where torch.compile cannot run here: Python too new for this torch's dynamo, no C++ compiler for
    inductor on a CPU, no Triton for it on a GPU."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown compile backend {backend!r}; use one of {', '.join(BACKENDS)}")
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(f"torch {torch.__version__} cannot compile on Python {sys.version.split()[0]}; run "
                          "without compile, or install a torch that supports this Python")
    if backend == "inductor" and device.type == "cpu" and shutil.which("g++") is None and \
            shutil.which("clang++") is None:
        raise ConfigError("inductor needs a C++ compiler (g++ or clang++) to compile on a CPU; install one, or use "
                          "the aot_eager backend")
    if backend == "inductor" and device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ConfigError("inductor needs triton to compile for a GPU; pip install triton, or use the "
                              "aot_eager backend") from None


_OUTSIDE: dict[type, type] = {}


def _outside(cls: type) -> type:
    """A subclass of ``cls`` (``nn.Linear``: :class:`OutsideLinear`, or one of its own) whose forward runs outside any
    compiled region.

    A class of its own, not the instance's ``forward`` disabled: torch.compile keeps one translation of a layer's
    code for every module of the same types, and would hand a layer compiled ``whole`` the translation made for a
    ``split`` one (its products left out), or the other way round; a Linear of another type is another guard.

    Made on first use: ``torch.compiler.disable`` imports torch's compiler (a second of CPU), which a process that
    compiles nothing never needs."""
    if cls not in _OUTSIDE:
        name = "OutsideLinear" if cls is nn.Linear else f"Outside{cls.__name__}_{len(_OUTSIDE)}"
        made = type(name, (cls,), {"forward": torch.compiler.disable(cls.forward),  # type: ignore[attr-defined]
                                   "_pf_outside": True, "__module__": __name__, "__qualname__": name,
                                   "__doc__": f"A ``{cls.__name__}`` whose forward runs outside any compiled region "
                                              '(``compile_stage(..., "split")``).'})
        globals()[name] = made  # where pickle looks a class up (torch.save of a whole module)
        _OUTSIDE[cls] = made
    return _OUTSIDE[cls]


def __getattr__(name: str) -> type:
    """``OutsideLinear`` (an ``nn.Linear`` whose forward runs outside any compiled region), made when first named,
    as by pickle loading a module saved with it."""
    if name == "OutsideLinear":
        return _outside(nn.Linear)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compile_stage(module: nn.Module, mode: str = "split", backend: str = "inductor") -> nn.Module:
    """The module to run: ``module``'s layers compiled (an ``nn.Sequential``: each layer, in a new sequence;
    anything else: the module), over the same parameters. ``module`` itself keeps its layers and their names (a
    checkpoint's); with ``split`` its Linears become a subclass of their own class that runs outside compiled
    regions (:class:`OutsideLinear` for ``nn.Linear``: still Linears, with the same state)."""
    if mode not in MODES:
        raise ConfigError(f"unknown compile mode {mode!r}; use 'split' (Linears outside the compiled regions, the "
                          "backward split for real) or 'whole' (each layer one region)")
    # A compiled backward that may donate its buffers refuses a second run over the same graph (retain_graph): B
    # runs it with retain_graph so that W can restart parts of it. Read when a region compiles, at its first call.
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
    for m in module.modules():
        if not isinstance(m, nn.Linear):
            continue
        outside = getattr(type(m), "_pf_outside", False)
        if mode == "split" and not outside:
            m.__class__ = _outside(type(m))
        elif mode == "whole" and outside:  # marked by an earlier split compile: back to its own class
            m.__class__ = type(m).__bases__[0]
    if isinstance(module, nn.Sequential):
        from pipefold.runtime.stage import Chain, is_compiled

        layers: list[nn.Module] = [layer if is_compiled(layer) else torch.compile(layer, backend=backend)  # type: ignore[misc]
                                   for layer in module]
        return Chain(*layers)
    return torch.compile(module, backend=backend)  # type: ignore[return-value]

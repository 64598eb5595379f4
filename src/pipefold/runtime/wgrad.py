"""A Linear's weight gradient added into ``.grad`` in place, without the autograd engine.

Autograd makes a Linear's weight gradient as a new tensor (``g^T x``) and then adds it to ``.grad``: a tensor
the size of the weight is allocated, written, read back and freed. ``weight.grad.addmm_(g.t(), x)`` writes the
sum once (Megatron-LM's gradient-accumulation fusion does the same on GPUs). Where a weight is megabytes and a
microbatch a few rows, that is most of the weight gradient's time: the traffic, and the page faults where the
allocator hands out fresh pages for the new tensor (``benchmarks/wgrad.py`` counts both; a stage runner keeps
freed pages, :mod:`pipefold.runtime.host_memory`, so on a CPU it is the traffic). The MLP of
``benchmarks/vs_torch.py`` (width 512, 8 rows) spends about half as long in its W, and 0.7 as long in its BW,
this way. W is also spared an engine run per Linear, tens of microseconds each.

Two users:

- W (:meth:`pipefold.runtime.stage.StageRunner.backward_weight`) restarts autograd at each node that owns its
  parameters; for a Linear's product it calls :meth:`LinearNode.accumulate` instead.
- BW (:func:`backward`) runs the engine once, asking it for every gradient but those of the Linears' own
  weights and biases, which a pre-hook on each product adds in place just before the product runs (from the
  gradient entering it and the input it saved), so nothing more is held than autograd would hold. Finding
  the products and hooking them costs about 20 us a Linear, more than the traffic saved on a small weight:
  BW takes only weights of at least :func:`min_bytes` (:data:`MIN_BYTES` in host memory, the crossover measured
  on a CPU; :data:`GPU_MIN_BYTES` elsewhere: on a GPU the host's work per Linear is what a step waits for,
  ``benchmarks/results/gpu_check.md``).

Only what is safe is taken: a product ``x @ W^T (+ b)`` of a plain 2-D input and a plain parameter (not a
DTensor or other subclass) with no hooks of its own, whose accumulators nothing else in the graph reaches.
Anything else is left to autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from pipefold.runtime.sharding import plain

__all__ = ["GPU_MIN_BYTES", "MIN_BYTES", "LinearNode", "backward", "linear_of", "min_bytes", "worth_fusing"]

MIN_BYTES = 1 << 20
"""The smallest weight BW adds in place (1 MiB: 2^18 float32 elements). With the MLP's blocks on this project's
2-core machine, the in-place BW took 0.84 and 0.99 of autograd's time (two runs) at 1 MiB a weight, 0.76 to 0.79
at 4 MiB, and 1.08 to 1.11 at 0.56 MiB."""

GPU_MIN_BYTES = 32 << 20
"""The smallest weight BW adds in place off the host (32 MiB: a float32 weight between 2048^2 and 4096^2). On an
H200 (two ranks sharing it, the MLP of ``benchmarks/vs_torch.py``) the in-place BW took 1.13 to 1.32 of
autograd's backward from width 64 to 512 and 0.93 to 1.14 at 2048 (``benchmarks/wgrad.py --device cuda``); at
4096 (64 MiB a weight) the whole step took 74.0 to 75.6 ms with it against 85.8 to 87.3 ms without, gpipe and
1F1B, two alternating runs each (``benchmarks/vs_torch.py --device cuda --hidden 4096``)."""


def min_bytes(device: torch.device) -> int:
    """The smallest weight BW adds in place on ``device``: :data:`MIN_BYTES` in host memory, :data:`GPU_MIN_BYTES`
    on any other device."""
    return MIN_BYTES if device.type == "cpu" else GPU_MIN_BYTES

_PRODUCTS = {"AddmmBackward0": 1, "MmBackward0": 0}
"""The backward node of a Linear's product, with a bias and without, and which of its inputs is the layer's
input; the next one is the weight, transposed."""


def _plain(acc: Node | None) -> torch.Tensor | None:
    """The parameter an accumulator adds into, where nothing else runs when it does: a plain tensor (not a DTensor
    or another subclass) with no gradient hooks of its own."""
    var = getattr(acc, "variable", None)
    if var is None or not plain(var):
        return None
    return None if var._backward_hooks or var._post_accumulate_grad_hooks else var


@dataclass(frozen=True, eq=False)
class LinearNode:
    """The backward node of one Linear's product, with its weight (and bias) and their accumulators."""

    node: Node
    x_at: int
    """Which of the node's inputs is the layer's input."""
    weight: torch.Tensor
    bias: torch.Tensor | None
    transpose: Node
    """The node between the product and the weight's accumulator (the weight enters transposed)."""
    accs: frozenset[Node]
    """The weight's accumulator, and the bias's."""

    def accumulate(self, g: torch.Tensor) -> None:
        """Add this microbatch's gradients, from ``g`` (the gradient of the product's output), as AccumulateGrad
        would: into ``.grad``, made on the first."""
        x = self.node._saved_mat1 if self.x_at == 1 else self.node._saved_self  # type: ignore[attr-defined]
        with torch.no_grad():
            if self.weight.grad is None:
                self.weight.grad = g.t().mm(x)
            else:
                self.weight.grad.addmm_(g.t(), x)
            if self.bias is not None:
                b = g.sum(0)
                if self.bias.grad is None:
                    self.bias.grad = b
                else:
                    self.bias.grad.add_(b)


def worth_fusing(module: nn.Module) -> bool:
    """Whether ``module`` has a Linear whose weight BW would add in place: plain, and at least :func:`min_bytes`
    of its device."""
    return any(isinstance(m, nn.Linear) and plain(m.weight)
               and m.weight.numel() * m.weight.element_size() >= min_bytes(m.weight.device) for m in module.modules())


def linear_of(node: Node, least: int | None = 0) -> LinearNode | None:
    """``node`` as a Linear's product with a weight of at least ``least`` bytes (None: :func:`min_bytes` where
    the weight lives), or None where it is something else (or something this module leaves to autograd: a
    subclass parameter, hooks, a scaled product, a bias of another shape)."""
    x_at = _PRODUCTS.get(type(node).__name__)
    if x_at is None:
        return None
    nexts = node.next_functions
    t_node = nexts[x_at + 1][0]
    if t_node is None or type(t_node).__name__ != "TBackward0":
        return None
    w_acc = t_node.next_functions[0][0]
    weight = _plain(w_acc)
    if w_acc is None or weight is None or weight.dim() != 2:
        return None
    if weight.numel() * weight.element_size() < (min_bytes(weight.device) if least is None else least):
        return None
    bias, accs = None, {w_acc}
    if x_at == 1:
        b_acc: Node | None = nexts[0][0]
        if b_acc is None or getattr(node, "_saved_alpha", None) != 1 or getattr(node, "_saved_beta", None) != 1:
            return None
        bias = _plain(b_acc)
        if bias is None or bias.shape != (weight.shape[0],):
            return None
        accs.add(b_acc)
    return LinearNode(node, x_at, weight, bias, t_node, frozenset(accs))


def backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward(outputs, grads)``, with the Linears' weight gradients added in place.

    The engine is asked for every accumulator in the graph (the stage's input leaves and parameters, as a plain
    ``backward`` would fill) but those of Linears taken here, whose products it still runs for their inputs'
    gradients: just before each one runs, its pre-hook adds the weight's and bias's gradients. A product the
    engine would not run (the first layer of the first stage, whose input needs no gradient) keeps autograd's
    way, and so does everything when no Linear qualifies.
    """
    order, parents = _postorder([o.grad_fn for o in outputs if o.grad_fn is not None])
    taken: dict[Node, LinearNode] = {}
    for node in order:
        lin = linear_of(node, None)
        # Its accumulators reached only through it: a tied weight's other uses would be counted by the engine.
        if lin is not None and parents.get(lin.transpose) == [node] and all(
                parents.get(a) == ([lin.transpose] if a is lin.transpose.next_functions[0][0] else [node])
                for a in lin.accs):
            taken[node] = lin
    if not taken:
        torch.autograd.backward(list(outputs), list(grads))
        return
    owned = {a for lin in taken.values() for a in lin.accs}
    # Which nodes lead to an accumulator the engine is asked for (children first). A taken product that leads to
    # none would not run, so it gives its accumulators back to the engine.
    leads: dict[Node, bool] = {}
    for node in order:
        if hasattr(node, "variable"):
            leads[node] = node not in owned
            continue
        lin = taken.get(node)
        own = (lin.transpose, *lin.accs) if lin is not None else ()
        leads[node] = any(leads.get(c, False) for c, _ in node.next_functions if c is not None and c not in own)
        if lin is not None and not leads[node]:
            del taken[node]
            owned -= lin.accs
            leads[node] = True
    if not taken:
        torch.autograd.backward(list(outputs), list(grads))
        return
    targets = [GradientEdge(n, 0) for n in order if hasattr(n, "variable") and n not in owned]
    handles = [lin.node.register_prehook(_adder(lin)) for lin in taken.values()]
    try:
        torch.autograd.backward(list(outputs), list(grads), inputs=targets)
    finally:
        for h in handles:
            h.remove()


def _adder(lin: LinearNode) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        if grad_outputs[0] is not None:
            lin.accumulate(grad_outputs[0])
    return hook


def _postorder(roots: list[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node below ``roots``, each after all of its children; and each node's parents (one entry per edge)."""
    order: list[Node] = []
    parents: dict[Node, list[Node]] = {}
    done: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in done:
            continue
        done.add(node)
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, []).append(node)
                if child not in done:
                    stack.append((child, False))
    return order, parents

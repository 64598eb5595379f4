"""One pipeline stage's passes on real tensors: F, B (input gradient), W (weight gradient) and fused BW.

The backward is split with autograd itself, so it is correct for any module::

    F   out = module(x)                     x is a leaf, so its gradient can be asked for alone
    B   dx = grad(out, x, dout)             runs the graph from out back to x, and on the way
                                            records the gradient flowing into every node from
                                            which a path leads to a parameter ("intermediates")
    W   dW = grad(intermediates, params)    restarts the graph at those nodes: only the branches
                                            towards the parameters run, nothing is computed twice

            out
             |
          node N  <- on the path to x; its gradient is captured in B
           /    \\
    path to x   AccumulateGrad(weight)      W starts at N and runs only this branch

A stage whose input needs no gradient (the first stage) has nothing for B to
do; W then runs the whole backward. Saved activations are released when W
(or BW) ends, and the bytes held for backward are counted with saved-tensor
hooks, so the runtime reports measured, not estimated, activation memory.

Recomputation (activation checkpointing) of the first r layers of a stage
stays inside this one graph: during F those layers' saved tensors are replaced
by numbered placeholders and only the stage input is kept; the first backward
that needs one reruns the r layers from the input (same random state) and
keeps what they save until W. B and W then run exactly as without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

Tensors = tuple[torch.Tensor, ...]


def as_tuple(x: torch.Tensor | Sequence[torch.Tensor]) -> Tensors:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def as_leaves(xs: Sequence[torch.Tensor]) -> Tensors:
    """Fresh leaf copies of ``xs``; the floating ones take a gradient, so a backward can ask for theirs alone."""
    return tuple(x.detach().requires_grad_(x.is_floating_point()) for x in xs)


def run_layers(layers: Iterable[nn.Module], xs: tuple[Any, ...]) -> Any:
    """Apply layers in turn; a layer may take and return a tuple of tensors (spread as arguments)."""
    out: Any = xs
    for layer in layers:
        out = layer(*out) if isinstance(out, tuple) else layer(out)
    return out


class Chain(nn.Sequential):
    """A stage: layers applied in turn, where a layer may take and return a tuple of tensors."""

    def forward(self, *xs: Any) -> Any:
        return run_layers(self, xs)


class MemoryMeter:
    """Bytes of tensors held for backward (via saved-tensor hooks) plus outputs kept for sending; and the peak."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def remove(self, nbytes: int) -> None:
        self.current -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.current


@dataclass
class _Pass:
    """What one microbatch keeps between its F and its W."""

    inputs: Tensors
    outputs: Tensors
    saved_bytes: int
    kept_bytes: int = 0
    cut: _Cut | None = None
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    grads_out: list[torch.Tensor] = field(default_factory=list)
    rebuild: _Rebuild | None = None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Rebuild:
    """The first layers of one microbatch's stage forward, whose saved tensors are recomputed on first use.

    ``pack`` keeps weights and the stage inputs as they are and turns every other
    saved tensor into its number; ``unpack`` of a number reruns the layers once from
    the inputs with the forward's random state, recording their saves in the same
    order, and hands out the one with that number. The rebuilt tensors stay until
    :meth:`release` (W or BW), so B and W may both read them.
    """

    def __init__(self, layers: Sequence[nn.Module], inputs: Tensors, weights: set[int], meter: MemoryMeter) -> None:
        self.layers, self.inputs, self.meter = layers, inputs, meter
        self.keep = weights | {_storage(x) for x in inputs}
        self.rng = _rng_state(inputs)
        self.count = 0
        self.rebuilt: list[torch.Tensor] | None = None
        self.rebuilt_bytes = 0

    def _kept(self, t: torch.Tensor) -> bool:
        return t.device.type == "meta" or _storage(t) in self.keep

    def pack(self, t: torch.Tensor) -> torch.Tensor | int:
        if self._kept(t):
            return t.detach()
        self.count += 1
        return self.count - 1

    def unpack(self, handle: torch.Tensor | int) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        if self.rebuilt is None:
            self._rebuild()
        assert self.rebuilt is not None
        return self.rebuilt[handle]

    def _rebuild(self) -> None:
        saves: list[torch.Tensor] = []

        def record(t: torch.Tensor) -> torch.Tensor:
            if not self._kept(t):
                saves.append(t.detach())  # the data only: the rerun's own graph is dropped
            # The rerun's graph never runs backward, so what it stores is never unpacked. It must not be
            # ``t`` itself: a node that saves its own output would then hold itself through the output's
            # grad_fn, a cycle inside autograd that no collector frees, leaking every rerun.
            return t.detach()

        xs = as_leaves(self.inputs)  # fresh leaves: the rerun must not reach the forward's graph
        with torch.enable_grad(), _restored_rng(self.rng), torch.autograd.graph.saved_tensors_hooks(record, _same):
            run_layers(self.layers, xs)
        if len(saves) != self.count:
            raise RuntimeError(f"recomputing {len(self.layers)} layers saved {len(saves)} tensors where the forward "
                               f"saved {self.count}: the layers must run the same operations every time")
        self.rebuilt = saves
        self.rebuilt_bytes = sum(t.untyped_storage().nbytes() for t in saves)
        self.meter.add(self.rebuilt_bytes)

    def release(self) -> None:
        self.meter.remove(self.rebuilt_bytes)
        self.rebuilt, self.rebuilt_bytes = None, 0


def _same(t: Any) -> Any:
    return t


_RngState = tuple[torch.Tensor, torch.device | None, torch.Tensor | None]


def _rng_state(inputs: Tensors) -> _RngState:
    """The random state a forward starts from (the CPU's, and its CUDA device's when it runs on one)."""
    device = next((x.device for x in inputs if x.device.type == "cuda"), None)
    cuda = torch.cuda.get_rng_state(device) if device is not None else None
    return torch.get_rng_state(), device, cuda


@contextmanager
def _restored_rng(state: _RngState) -> Iterator[None]:
    """Run with the random state of a past forward (dropout draws the same mask), then put the current one back."""
    cpu, device, cuda = state
    with torch.random.fork_rng(devices=[device] if device is not None else []):
        torch.set_rng_state(cpu)
        if device is not None and cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def _grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node that receives ``t``'s gradient (AccumulateGrad for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        view_fn = t.view_as(t).grad_fn
        assert view_fn is not None
        return view_fn.next_functions[0][0]
    return None


class _Cut:
    """Where the backward towards the parameters leaves the path to the stage inputs.

    A node is *on the path* if a stage input's gradient node is reachable from
    it: B runs exactly those. Every edge from an on-path node to a node off the
    path that leads to a parameter is a *crossing*; so is every output that is
    off the path. W computes the gradient entering each crossing (rerunning
    just the on-path node, from the gradient B saw flow into it), then runs the
    off-path region from all crossings at once. The region holds no on-path
    node, so nothing is computed twice and nothing is counted twice.
    """

    def __init__(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], params: list[nn.Parameter]) -> None:
        parents: dict[Node, list[Node]] = {}
        nodes: list[Node] = []
        seen: set[Node] = set()
        stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            nodes.append(node)
            for child, _ in node.next_functions:
                if child is not None:
                    parents.setdefault(child, []).append(node)
                    stack.append(child)
        on_path = _ancestors([n for n in map(_grad_node, inputs) if n is not None], parents)
        to_params = _ancestors([n for n in map(_grad_node, params) if n is not None and n in seen], parents)
        self.params = params
        self.outputs = [i for i, o in enumerate(outputs) if o.grad_fn not in on_path]
        self.output_tensors = outputs
        # On-path node -> its edges into the off-path part that leads to parameters.
        self.edges: dict[Node, list[GradientEdge]] = {}
        for node in nodes:
            if node in on_path:
                out = [GradientEdge(c, nr) for c, nr in node.next_functions
                       if c is not None and c not in on_path and c in to_params]
                if out:
                    self.edges[node] = out
        # A crossing node "owns" the parameters below its crossings when nothing below its other inputs
        # reaches them: then autograd can restart at the node and run just that side, adding straight
        # into .grad. Other crossing nodes go through the general two-phase path of weight_grads.
        param_of = {n: p for p in params if (n := _grad_node(p)) is not None and n in seen}
        self.owned: dict[Node, list[nn.Parameter]] = {}
        for node, edges in self.edges.items():
            owned = _owned_params(node, edges, param_of)
            if owned is not None:
                self.owned[node] = owned

    @property
    def crossings(self) -> list[Node]:
        return list(self.edges)

    def weight_grads(self, captured: dict[Node, tuple[torch.Tensor | None, ...]],
                     grads_out: list[torch.Tensor]) -> None:
        """Add this microbatch's weight gradients into the parameters' ``.grad``."""
        roots: list[torch.Tensor | GradientEdge] = [self.output_tensors[i] for i in self.outputs]
        root_grads = [grads_out[i] for i in self.outputs]
        entering: dict[tuple[Node, int], torch.Tensor] = {}
        for node, edges in self.edges.items():
            seen_grads = captured.get(node)
            if seen_grads is None or all(g is None for g in seen_grads):
                continue
            if node in self.owned:
                ks = [k for k, g in enumerate(seen_grads) if g is not None]
                torch.autograd.backward([GradientEdge(node, k) for k in ks], [seen_grads[k] for k in ks],
                                        inputs=self.owned[node])
                continue
            else:
                # A crossing target is also reachable another way from this node (say, through the input
                # path): autograd would sum that path too and count it twice, so run the node's own backward.
                local = node(*seen_grads)  # type: ignore[operator]
                local = local if isinstance(local, tuple) else (local,)
                wanted = {(e.node, e.output_nr) for e in edges}
                pairs = [((child, nr), _reduce_broadcast(g, child, nr))
                         for (child, nr), g in zip(node.next_functions, local, strict=True)
                         if g is not None and child is not None and (child, nr) in wanted]
            for key, g in pairs:
                if g is not None:
                    entering[key] = entering[key] + g if key in entering else g
        roots += [GradientEdge(n, nr) for n, nr in entering]
        root_grads += list(entering.values())
        if roots:
            # Accumulates straight into each parameter's .grad.
            torch.autograd.backward(roots, root_grads, inputs=self.params)  # type: ignore[arg-type]


def _reach(start: list[Node]) -> set[Node]:
    """``start`` and every node reachable from them."""
    out: set[Node] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node not in out:
            out.add(node)
            stack += [c for c, _ in node.next_functions if c is not None]
    return out


def _owned_params(node: Node, edges: list[GradientEdge],
                  param_of: dict[Node, nn.Parameter]) -> list[nn.Parameter] | None:
    """The parameters below ``node``'s crossings, if no other input of ``node`` leads to anything there."""
    crossing = {(e.node, e.output_nr) for e in edges}
    below = _reach([e.node for e in edges])
    others = _reach([c for c, nr in node.next_functions if c is not None and (c, nr) not in crossing])
    if below & others:
        return None
    return [param_of[n] for n in below if n in param_of]


def _reduce_broadcast(g: torch.Tensor, child: Node, nr: int) -> torch.Tensor:
    """Sum a gradient over broadcast dimensions, as the autograd engine does between two nodes.

    A node called directly returns gradients in its inputs' broadcast shapes;
    the engine would reduce them to what the next node expects, which only
    its input metadata records (a private attribute, also used by
    torch.distributed.pipelining).
    """
    shape = tuple(child._input_metadata[nr].shape)
    return g if tuple(g.shape) == shape else g.sum_to_size(shape)


def _ancestors(start: list[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``start`` and every node from which one of them is reachable."""
    out = set(start)
    stack = list(start)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in out:
                out.add(parent)
                stack.append(parent)
    return out


def _capture(node: Node, store: dict[Node, tuple[torch.Tensor | None, ...]]) -> Callable[..., None]:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        store[node] = tuple(g.detach() if g is not None else None for g in grad_outputs)
    return hook


def _input_grads(inputs: Tensors, grads: Sequence[torch.Tensor | None]) -> Tensors:
    """One gradient per input that takes one (floating point), zeros where autograd found it unused."""
    it = iter(grads)
    out = []
    for x in inputs:
        if x.requires_grad:
            g = next(it)
            out.append(torch.zeros_like(x) if g is None else g)
    return tuple(out)


class StageRunner:
    """Runs F, B, W and BW of one stage module for any number of microbatches in flight."""

    def __init__(self, module: nn.Module, *, loss_fn: Callable[..., torch.Tensor] | None = None,
                 meter: MemoryMeter | None = None, recompute: int = 0) -> None:
        self.module = module
        self.loss_fn = loss_fn  # set on the last stage: F then returns the loss
        self.meter = meter or MemoryMeter()
        layers = list(module) if isinstance(module, nn.Sequential) else None
        if recompute and (layers is None or hasattr(module, "on_saved")):
            raise ValueError("recomputation needs a stage made of a plain layer sequence (a Chain), "
                             "not an offloaded one")
        if layers is not None and not 0 <= recompute <= len(layers):
            raise ValueError(f"cannot recompute {recompute} layers of a stage that has {len(layers)}")
        self.recompute = recompute
        """How many of the stage's first layers rebuild their activations in backward instead of keeping them."""
        self._head = layers[:recompute] if layers is not None else []
        self._tail = layers[recompute:] if layers is not None else []
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._passes: dict[int, _Pass] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.bytes_per_microbatch = 0
        """The most bytes one microbatch's forward saved for backward: this stage's activation size."""

    # -- forward

    def forward(self, mb: int, inputs: Tensors, target: Any = None, *, scale: float = 1.0) -> Tensors:
        """F: run the stage; keep what backward needs. On the last stage return (loss,) scaled by ``scale``."""
        leaves = as_leaves(inputs)  # leaves, so B can ask for their gradient alone
        saved = 0
        # Weights saved for backward (a Linear keeps its weight) are not activation memory: skip them.
        weights = {_storage(p) for p in self.module.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            if t.device.type != "meta" and _storage(t) not in weights:
                saved += t.untyped_storage().nbytes()
            # Not ``t`` itself: a node that saves its own output would hold itself through the output's grad_fn.
            # Backward frees that cycle as it runs a node, but B and W each run only part of the graph.
            return t.detach()

        # An Offloaded stage's layers install saved-tensor hooks of their own, which hide their saves from
        # ours: such a module reports each save to ``on_saved`` instead.
        listener = self.module if hasattr(self.module, "on_saved") else None
        if listener is not None:
            setattr(listener, "on_saved", pack)  # noqa: B010 (a plain attribute mypy does not see on nn.Module)
        rebuild = None
        try:
            if self.recompute:
                rebuild = _Rebuild(self._head, leaves, weights, self.meter)
                with torch.autograd.graph.saved_tensors_hooks(rebuild.pack, rebuild.unpack):
                    mid = run_layers(self._head, leaves)
                # The stage inputs are all the recomputed layers keep (once, however often they are saved).
                saved += sum({_storage(x): x.untyped_storage().nbytes() for x in leaves}.values())
            with torch.autograd.graph.saved_tensors_hooks(pack, _same):
                if rebuild is not None:
                    out = as_tuple(run_layers(self._tail, mid if isinstance(mid, tuple) else (mid,)))
                else:
                    out = as_tuple(self.module(*leaves))
                if self.loss_fn is not None:
                    loss = self.loss_fn(*out, target)
                    self.losses[mb] = loss.detach()
                    out = (loss * scale,)
        finally:
            if listener is not None:
                setattr(listener, "on_saved", None)  # noqa: B010
        # The outputs stay alive until backward too (they are the roots B starts from).
        saved += sum(o.untyped_storage().nbytes() for o in out if _storage(o) not in weights)
        self.meter.add(saved)
        self.bytes_per_microbatch = max(self.bytes_per_microbatch, saved)
        self._passes[mb] = _Pass(leaves, out, saved, rebuild=rebuild)
        return tuple(o.detach() for o in out)

    # -- backward

    def backward_input(self, mb: int, out_grads: Tensors | None) -> Tensors | None:
        """B: gradient of the stage input only; record where W must start. None if no input takes one."""
        p = self._passes[mb]
        grads_out = self._grads_for(p, out_grads)
        outs = self._differentiable(p)
        wanted = [x for x in p.inputs if x.requires_grad]
        cut = _Cut(outs, wanted, self.params)
        captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        handles = [node.register_prehook(_capture(node, captured)) for node in cut.crossings]
        try:
            dx = torch.autograd.grad(outs, wanted, grads_out, retain_graph=True, allow_unused=True) if wanted else ()
        finally:
            for h in handles:
                h.remove()
        p.cut, p.captured, p.grads_out = cut, captured, grads_out
        return _input_grads(p.inputs, dx) if wanted else None

    def backward_weight(self, mb: int) -> None:
        """W: weight gradients from what B recorded; accumulate into ``.grad``; release the microbatch."""
        p = self._passes.pop(mb)
        if self.params and p.cut is not None:
            p.cut.weight_grads(p.captured, p.grads_out)
        self._release(p)

    def backward(self, mb: int, out_grads: Tensors | None) -> Tensors | None:
        """BW: input and weight gradients in one pass; release the microbatch."""
        p = self._passes.pop(mb)
        grads_out = self._grads_for(p, out_grads)
        wanted = [x for x in p.inputs if x.requires_grad]
        # backward() adds straight into each parameter's .grad (and the input leaves' .grad): no copies.
        torch.autograd.backward(self._differentiable(p), grads_out, inputs=[*wanted, *self.params])
        self._release(p)
        return _input_grads(p.inputs, [x.grad for x in wanted]) if wanted else None

    # -- helpers

    @staticmethod
    def _differentiable(p: _Pass) -> list[torch.Tensor]:
        return [o for o in p.outputs if o.requires_grad]

    def _grads_for(self, p: _Pass, out_grads: Tensors | None) -> list[torch.Tensor]:
        """The gradient for each differentiable output: given by the next stage, or 1 for the loss."""
        outs = self._differentiable(p)
        if self.loss_fn is not None:
            return [torch.ones_like(outs[0])]
        if out_grads is None or len(out_grads) != len(outs):
            n = 0 if out_grads is None else len(out_grads)
            raise RuntimeError(f"stage backward got {n} output gradients for {len(outs)} differentiable outputs")
        return list(out_grads)

    def _release(self, p: _Pass) -> None:
        self.meter.remove(p.saved_bytes + p.kept_bytes)
        if p.rebuild is not None:
            p.rebuild.release()

    @property
    def in_flight(self) -> int:
        """Microbatches whose W (or BW) has not run yet."""
        return len(self._passes)

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
do; W then runs the whole backward.

Memory. Every tensor a forward saves is kept in a box. B frees the boxes of
the nodes it runs that W will not run again (an activation function's input,
attention scores, dropout masks), so between B and W a microbatch holds only
what W reads: the saves of the crossing nodes and of the branches towards the
parameters (a Linear's input), and the gradients B captured there. B also
takes at once the weight gradients of vector parameters (a norm's scale and
shift), cheap sums over the batch, and frees what they read. W (or BW) frees
the rest. On the first stage, whose input is the batch, B runs back to the
first layer's output and W ends with that layer. Each kept tensor is shown to the rank's
:class:`~pipefold.runtime.meter.MemoryMeter`, which counts its storage until
it really dies, so the runtime reports what it holds, not what it meant to.

Recomputation (activation checkpointing) of the first r layers of a stage
stays inside this one graph: during F those layers' saved tensors are replaced
by numbered placeholders and only the stage input is kept; the first backward
that needs one reruns the r layers from the input (same random state) and
keeps what they save until W. B and W then run exactly as without it.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from pipefold.errors import ConfigError
from pipefold.runtime import wgrad
from pipefold.runtime.activation_offload import HostCopies, Offloaded
from pipefold.runtime.host_memory import keep_freed_pages
from pipefold.runtime.meter import MemoryMeter, storage_of
from pipefold.runtime.seqchunks import SequenceChunks
from pipefold.runtime.sharding import local, waited
from pipefold.runtime.structure import Call, Spec, as_call, describe, flatten, unflatten

Tensors = tuple[torch.Tensor, ...]


def as_tuple(x: torch.Tensor | Sequence[torch.Tensor]) -> Tensors:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def split_batch(x: torch.Tensor | Sequence[torch.Tensor], parts: int) -> list[Tensors]:
    """A batch's inputs (a tensor, or several such as token ids and an attention mask) as ``parts`` equal
    microbatches along dimension 0, each a tuple of tensors: what a first stage takes."""
    xs = as_tuple(x)
    rows = {t.shape[0] for t in xs}
    if len(rows) != 1:
        raise ValueError(f"a batch's input tensors must have the same rows (dimension 0), got {sorted(rows)}")
    n = rows.pop()
    if n % parts:
        raise ValueError(f"a batch of {n} does not split into {parts} equal microbatches")
    return list(zip(*(t.chunk(parts) for t in xs), strict=True))


def as_leaves(xs: Sequence[torch.Tensor]) -> Tensors:
    """Fresh leaf copies of ``xs``; the floating ones take a gradient, so a backward can ask for theirs alone."""
    return tuple(x.detach().requires_grad_(x.is_floating_point()) for x in xs)


def run_layers(layers: Iterable[nn.Module], xs: tuple[Any, ...] | Call) -> Any:
    """Apply layers in turn; a layer may take and return a tuple of tensors (spread as arguments); ``xs`` may be
    the first layer's arguments as a :class:`~pipefold.runtime.structure.Call`."""
    out: Any = xs
    for layer in layers:
        out = out(layer) if isinstance(out, Call) else layer(*out) if isinstance(out, tuple) else layer(out)
    return out


class Boundaries:
    """The structure of each stage's input on one rank (:mod:`pipefold.runtime.structure`): set by the stage before
    it when that stage is on this rank, from its header when it is on another, and by the step for the first stage
    (its batch's arguments). The rank's runners and its executor share one."""

    def __init__(self) -> None:
        self.specs: dict[int, Spec | None] = {}
        self.fitted: set[int] = set()
        """Stages whose first forward with the current shapes has run: an error before then is named a mismatch."""

    def new_shapes(self) -> None:
        self.fitted.clear()

    def call(self, stage: int, tensors: Sequence[torch.Tensor]) -> Call:
        """How ``stage`` is called with the tensors it received."""
        spec = self.specs.get(stage)
        return as_call(unflatten(spec, tensors), spec)


class Chain(nn.Sequential):
    """A stage: layers applied in turn, where a layer may take and return a tuple of tensors."""

    def forward(self, *xs: Any) -> Any:
        return run_layers(self, xs)


class _Backward:
    """What the autograd engine is running, as far as B's freeing needs to know.

    During B (``in_b``) a node that W will not rerun may give up its saved tensors as it
    reads them; the crossing nodes, which W reruns, are marked by hooks around their run.
    """

    __slots__ = ("at_crossing", "in_b")

    def __init__(self) -> None:
        self.in_b = False
        self.at_crossing = False

    @property
    def frees(self) -> bool:
        return self.in_b and not self.at_crossing


class _Box:
    """One tensor saved for backward, which B empties once read when W will not read it again; ``key`` is its
    storage's key in the meter (its ``id``), so that counting what a microbatch holds need not look it up again."""

    __slots__ = ("__weakref__", "key", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.key = key


_FREED = ("a tensor saved for backward was freed by B and then needed again: the stage's backward ran a node "
          "twice; please report this with the model")


class _Unpack:
    """The unpack hook of a stage's saved tensors: a box's tensor, the box emptied if B will not need it again.

    It refers to nothing but the engine state: autograd keeps it in every saved tensor, so a
    reference to the runner or a pass would hold them alive through the graph.
    """

    __slots__ = ("state",)

    def __init__(self, state: _Backward) -> None:
        self.state = state

    def __call__(self, saved: Any) -> Any:
        if not isinstance(saved, _Box):
            return saved
        t = saved.tensor
        if t is None:
            raise RuntimeError(_FREED)
        if self.state.frees:
            saved.tensor = None
        return t


@dataclass
class _Pass:
    """What one microbatch keeps between its F and its W."""

    inputs: Tensors
    """The stage inputs as leaves; dropped after B."""
    outputs: Tensors
    """The outputs B starts from; after B, only those W starts from."""
    boxes: list[weakref.ref[_Box]]
    """What F saved, as autograd keeps it: a box dies with the node that saved it."""
    cut: _Cut | None = None
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    grads_out: list[torch.Tensor] = field(default_factory=list)
    """The gradient of each output in ``outputs``."""
    rebuild: _Rebuild | None = None
    lead: tuple[GradientEdge, ...] = ()
    """On the first stage, its first layer's outputs as graph edges: where W ends (see ``StageRunner._lead``)."""
    lead_grads: Tensors = ()
    """Their gradients, from B."""
    read: Tensors = ()
    """With sequence chunks: the earlier chunks' keys and values its attention read, as leaves (extra inputs)."""
    made: Tensors = ()
    """With sequence chunks: its own keys and values, which the later chunks read (extra outputs)."""
    host: list[Offloaded] | None = None
    """What an offload (``OF``) moved to host memory, until the backward (a reload copies from it)."""
    offloaded: Any = None
    """The offload's event (a GPU's; None on a CPU)."""
    reloaded: Any = None
    """The reload's event, which the backward waits for (a GPU's), True once reloaded on a CPU, None before."""

    def held_bytes(self, meter: MemoryMeter, *, outputs: bool = True) -> int:
        """Bytes of the distinct storages this microbatch holds now, as ``meter`` counts them."""
        held: list[torch.Tensor | None] = [*self.inputs, *(self.outputs if outputs else ()), *self.grads_out,
                                           *self.lead_grads]
        held += [g for grads in self.captured.values() for g in grads]
        if self.cut is not None:
            held += [g for made in self.cut.made.values() for _, g in made]
        if self.rebuild is not None:
            held += [*self.rebuild.inputs, *(self.rebuild.rebuilt or ())]
        return meter.bytes_of(held, [b.key for ref in self.boxes if (b := ref()) is not None and b.tensor is not None])


def _storage(t: torch.Tensor) -> int:
    return local(t).untyped_storage().data_ptr()


class _Rebuild:
    """The first layers of one microbatch's stage forward, whose saved tensors are recomputed on first use.

    ``pack`` keeps weights and the stage inputs as they are and turns every other
    saved tensor into its number; ``unpack`` of a number reruns the layers once from
    the inputs with the forward's random state, recording their saves in the same
    order, and hands out the one with that number. The rebuilt tensors stay until
    W (or BW) drops the pass, so B and W may both read them; B drops those that W
    will not read, as for tensors kept in F.
    """

    def __init__(self, layers: Sequence[nn.Module], inputs: Tensors, weights: set[int], meter: MemoryMeter,
                 state: _Backward, call: Callable[[Tensors], Call],
                 casting: Callable[[], AbstractContextManager[Any]] = nullcontext, *, compiled: bool = False) -> None:
        self.layers, self.inputs, self.meter, self.state, self.call = layers, inputs, meter, state, call
        self.casting = casting
        """The forward's autocast, which the rerun (in a backward, outside it) enters again."""
        self.compiled = compiled
        if compiled:
            self.pack, self.unpack = eager(self.pack), eager(self.unpack)  # type: ignore[method-assign]
        self.keep = weights | {_storage(x) for x in inputs}
        self.rng = _rng_state(inputs)
        self.count = 0
        self.rebuilt: list[torch.Tensor | None] | None = None

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
        t = self.rebuilt[handle]
        if t is None:
            raise RuntimeError(_FREED)
        if self.state.frees:
            self.rebuilt[handle] = None
        return t

    def _rebuild(self) -> None:
        saves: list[torch.Tensor | None] = []

        def record(t: torch.Tensor) -> torch.Tensor:
            if not self._kept(t):
                saves.append(t.detach())  # the data only: the rerun's own graph is dropped
            # The rerun's graph never runs backward, so what it stores is never unpacked. It must not be
            # ``t`` itself: a node that saves its own output would then hold itself through the output's
            # grad_fn, a cycle inside autograd that no collector frees, leaking every rerun.
            return t.detach()

        xs = as_leaves(self.inputs)  # fresh leaves: the rerun must not reach the forward's graph
        hooks = (eager(record), eager(_same)) if self.compiled else (record, _same)
        with torch.enable_grad(), _restored_rng(self.rng), self.casting(), \
                torch.autograd.graph.saved_tensors_hooks(*hooks):
            run_layers(self.layers, self.call(xs))
        if len(saves) != self.count:
            raise RuntimeError(f"recomputing {len(self.layers)} layers saved {len(saves)} tensors where the forward "
                               f"saved {self.count}: the layers must run the same operations every time")
        self.meter.hold(saves, "saved")
        self.rebuilt = saves


def _same(t: Any) -> Any:
    return t


_MEASURED_IN: ContextVar[torch.dtype | None] = ContextVar("measured_in", default=None)


@contextmanager
def computing_in(dtype: torch.dtype | None) -> Iterator[None]:
    """Every stage runner made inside computes its forwards under autocast to ``dtype`` (None: as the module is):
    what a profile measures for a run in that dtype (:mod:`pipefold.runtime.measure.profiling`)."""
    token = _MEASURED_IN.set(dtype)
    try:
        yield
    finally:
        _MEASURED_IN.reset(token)


def autocast_now(device: torch.device) -> AbstractContextManager[Any]:
    """The autocast :func:`computing_in` set, for a forward on ``device`` outside a stage runner (a no-op without
    one)."""
    dtype = _MEASURED_IN.get()
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is a torch.compile'd module (an ``OptimizedModule``)."""
    return type(module).__name__ == "OptimizedModule"


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run as it is, never traced by torch.compile: a saved-tensor hook called from inside a compiled
    region's frame would otherwise be compiled itself, and compiled again for every new stride it meets."""
    return torch.compiler.disable(fn)


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


def grad_node(t: torch.Tensor) -> Node | None:
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

    Made from a graph's nodes and its :class:`_CutShape` (see :class:`Cuts`, which finds the shape once per
    shape of graph).
    """

    def __init__(self, nodes: list[Node], shape: _CutShape) -> None:
        self._param_of = {nodes[i]: p for i, p in zip(shape.params, shape.param_tensors, strict=True)}
        """The graph's own accumulators of the stage's parameters (where W's weight gradients land), with them."""
        self.outputs = list(shape.outputs)
        """The outputs off the path to the inputs: W starts from them too (B never runs their graph)."""
        self.edges: dict[Node, list[tuple[Node, int]]] = {
            nodes[i]: [(nodes[c], nr) for c, nr in out] for i, out in shape.edges}
        """On-path node -> its edges (child, output_nr) into the off-path part that leads to parameters."""
        self.owned: dict[Node, list[Node]] = {nodes[i]: [nodes[a] for a in accs] for i, accs in shape.owned}
        """The crossing nodes that own their parameters (see :func:`_ownership`), with the parameters'
        accumulators."""
        self.made: dict[Node, list[tuple[tuple[Node, int], torch.Tensor]]] = {}
        """What B's engine already made on the crossings of a compiled region (:func:`compiled_node`): its
        backward is one function computing the input's and the weights' gradients together, so W takes these
        instead of running it again."""

    @property
    def crossings(self) -> list[Node]:
        return list(self.edges)

    def vector_crossings(self) -> list[Node]:
        """Crossing nodes that own their parameters, all of them vectors (a norm's scale and shift, a bias alone).

        Their weight gradients are sums over the batch, cheap next to a matrix's: B computes them at
        once (:meth:`take_now`), and what they read (the norm's input, the gradient entering it) need
        not wait for W.
        """
        return [node for node, accs in self.owned.items() if accs and all(self._param_of[a].dim() <= 1 for a in accs)]

    def take_now(self, node: Node, captured: dict[Node, tuple[torch.Tensor | None, ...]]) -> None:
        """Run ``node``'s weight gradient now, from the gradient B captured there; W will not run it again."""
        seen_grads = captured.pop(node, None)
        del self.edges[node]
        accs = self.owned.pop(node)
        made = self.made.pop(node, None)
        if made is not None:
            _from_edges(made, accs)
        elif seen_grads is not None:
            _owned_backward(node, seen_grads, accs)

    def weight_grads(self, captured: dict[Node, tuple[torch.Tensor | None, ...]],
                     outputs: Sequence[torch.Tensor], grads_out: Sequence[torch.Tensor]) -> None:
        """Add this microbatch's weight gradients into the parameters' ``.grad``.

        ``outputs`` and ``grads_out`` are the outputs off the path (:attr:`outputs`) and their gradients.
        """
        roots: list[torch.Tensor | GradientEdge] = list(outputs)
        root_grads = list(grads_out)
        entering: dict[tuple[Node, int], torch.Tensor] = {}
        for node, edges in self.edges.items():
            made = self.made.get(node)
            seen_grads = captured.get(node)
            if made is not None:
                pairs = list(made)
            elif seen_grads is None or all(g is None for g in seen_grads):
                continue
            elif node in self.owned:
                _owned_backward(node, seen_grads, self.owned[node])
                continue
            else:
                # A crossing target is also reachable another way from this node (say, through the input
                # path): autograd would sum that path too and count it twice, so run the node's own backward.
                local = node(*seen_grads)  # type: ignore[operator]
                local = local if isinstance(local, tuple) else (local,)
                wanted = set(edges)
                pairs = [((child, nr), _reduce_broadcast(g, child, nr))
                         for (child, nr), g in zip(node.next_functions, local, strict=True)
                         if g is not None and child is not None and (child, nr) in wanted]
            for key, g in pairs:
                if g is not None:
                    entering[key] = entering[key] + g if key in entering else g
        roots += [GradientEdge(n, nr) for n, nr in entering]
        root_grads += list(entering.values())
        if roots and self._param_of:  # (no accumulator in the graph: no weight gradient to make)
            # Accumulates straight into each parameter's .grad.
            torch.autograd.backward(roots, root_grads,  # type: ignore[arg-type]
                                    inputs=[GradientEdge(n, 0) for n in self._param_of])


@dataclass(frozen=True)
class _CutShape:
    """A :class:`_Cut` by the positions of its nodes in :func:`_walk`'s order: the same for every graph of the
    same shape, so found once (:meth:`find`) and reused for the next microbatch's graph."""

    params: tuple[int, ...]
    param_tensors: tuple[torch.Tensor, ...]
    outputs: tuple[int, ...]
    edges: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    owned: tuple[tuple[int, tuple[int, ...]], ...]

    @classmethod
    def find(cls, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
             index: dict[Node, int]) -> _CutShape:
        """The cut of the graph below ``outputs`` (whose nodes :func:`_walk` numbered in ``index``)."""
        nodes = list(index)
        parents: dict[Node, list[Node]] = {}
        for node in nodes:
            for child, _ in node.next_functions:
                if child is not None:
                    parents.setdefault(child, []).append(node)
        on_path = _ancestors([n for n in map(grad_node, inputs) if n is not None], parents)
        # Each parameter's AccumulateGrad node in this graph, found in the graph itself: a parameter's current
        # accumulator (what autograd resolves a tensor in ``inputs=`` to) is another node once its data moved
        # to another device or dtype after the forward (an offloaded layer evicted to the CPU, say).
        param_of = graph_params(nodes, params)
        to_params = _ancestors(list(param_of), parents)
        edges: dict[Node, list[tuple[Node, int]]] = {}
        for node in nodes:
            if node in on_path:
                out = [(c, nr) for c, nr in node.next_functions
                       if c is not None and c not in on_path and c in to_params]
                if out:
                    edges[node] = out
        # A crossing node "owns" the parameters below its crossings when nothing below its other inputs
        # reaches them: then autograd can restart at the node and run just that side, adding straight
        # into .grad. Other crossing nodes go through the general two-phase path of weight_grads.
        owned = _ownership(nodes, on_path, edges, set(param_of))
        return cls(params=tuple(index[n] for n in param_of), param_tensors=tuple(param_of.values()),
                   outputs=tuple(i for i, o in enumerate(outputs) if o.grad_fn not in on_path),
                   edges=tuple((index[n], tuple((index[c], nr) for c, nr in out))
                               for n, out in edges.items()),
                   owned=tuple((index[n], tuple(index[a] for a in accs)) for n, accs in owned.items()))


class Cuts:
    """The cuts of one stage's graphs (B's path to the inputs, W's crossings, who owns which parameter).

    Finding a cut walks the graph several times over (the ancestors of the inputs, of the parameters, the regions
    below each crossing): 90 us for a stage of 4 small MLP blocks, a third of what the runner's B adds to
    autograd's. A stage's graph has the same shape microbatch after microbatch, so the cut is found once per
    shape, by the positions of its nodes in one walk, and the next graph of that shape only walks itself
    (:func:`_walk`: its nodes' types, edges, and which leaves are which parameter or input).
    """

    _KEEP = 16
    """Shapes kept (a stage that branches on its input has a few)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._param_at = {id(p): k for k, p in enumerate(self.params)}
        self._shapes: dict[tuple[Any, ...], _CutShape] = {}

    def of(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> _Cut:
        """The cut of the graph from ``outputs`` back to ``inputs`` and the parameters."""
        nodes, index, key = _walk(outputs, inputs, self._param_at)
        shape = self._shapes.get(key)
        if shape is None:
            shape = _CutShape.find(outputs, inputs, self.params, index)
            if len(self._shapes) >= self._KEEP:
                del self._shapes[next(iter(self._shapes))]
            self._shapes[key] = shape
        return _Cut(nodes, shape)


_ACCUMULATE = type(grad_node(torch.zeros(1, requires_grad=True)))
"""autograd's AccumulateGrad node type (a leaf's gradient node)."""


def _walk(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
          param_at: dict[int, int]) -> tuple[list[Node], dict[Node, int], tuple[Any, ...]]:
    """Number the nodes of the graph below ``outputs`` in the order one walk finds them; return them, the numbering
    and the graph's shape: each node's type and its edges by number, each leaf as the parameter (by its position in
    ``param_at``) or the input it is, and where the outputs and the inputs are. Two graphs of one shape have the
    same cut, node for node."""
    index: dict[Node, int] = {}
    nodes: list[Node] = []
    for o in outputs:
        g = o.grad_fn
        if g is not None and g not in index:
            index[g] = len(nodes)
            nodes.append(g)
    input_at = {id(x): k for k, x in enumerate(inputs)}
    key: list[Any] = [len(outputs), len(inputs)]
    key += [index.get(o.grad_fn, -1) for o in outputs]  # type: ignore[arg-type]
    key += [index.get(x.grad_fn, -1) for x in inputs if x.grad_fn is not None]
    append = key.append
    i = 0
    while i < len(nodes):
        node = nodes[i]
        i += 1
        kind = type(node)
        append(kind)
        if kind is _ACCUMULATE:
            v = id(node.variable)  # type: ignore[attr-defined]
            p = param_at.get(v)
            append(p if p is not None else -2 - input_at.get(v, -1))  # a parameter, an input, or another leaf
        nexts = node.next_functions
        append(len(nexts))
        for child, nr in nexts:
            if child is None:
                append(-1)
                continue
            j = index.get(child)
            if j is None:
                j = index[child] = len(nodes)
                nodes.append(child)
            append(j)
            append(nr)
    return nodes, index, tuple(key)


def graph_params(nodes: Iterable[Node], params: Sequence[torch.Tensor]) -> dict[Node, torch.Tensor]:
    """The AccumulateGrad nodes among ``nodes`` that accumulate into one of ``params``, with it."""
    wanted = {id(p): p for p in params}
    return {n: wanted[id(v)] for n in nodes if (v := getattr(n, "variable", None)) is not None and id(v) in wanted}


def _owned_backward(node: Node, seen_grads: tuple[torch.Tensor | None, ...], accs: list[Node]) -> None:
    """Restart autograd at ``node`` from the gradients B saw enter it; only the branches to the parameters'
    accumulators ``accs`` run. A Linear's product that owns just its weight and bias adds them in place instead
    (:mod:`pipefold.runtime.wgrad`)."""
    ks = [k for k, g in enumerate(seen_grads) if g is not None]
    if not ks:
        return
    if ks == [0] and len(seen_grads) == 1 and (lin := wgrad.linear_of(node)) is not None and lin.accs == {*accs}:
        lin.accumulate(seen_grads[0])  # type: ignore[arg-type]
        return
    torch.autograd.backward([GradientEdge(node, k) for k in ks], [seen_grads[k] for k in ks],
                            inputs=[GradientEdge(a, 0) for a in accs])


def _from_edges(made: list[tuple[tuple[Node, int], torch.Tensor]], accs: list[Node]) -> None:
    """Add gradients already made on a node's edges into the parameters' accumulators ``accs`` below them."""
    torch.autograd.backward([GradientEdge(c, nr) for (c, nr), _ in made], [g for _, g in made],
                            inputs=[GradientEdge(a, 0) for a in accs])


_COMPILED = "CompiledFunctionBackward"
"""The backward node of a region torch.compile made (AOTAutograd's): one function for every gradient of the
region, its input's and its weights' alike."""


def compiled_node(node: Node) -> bool:
    """Whether ``node`` is the backward of a compiled region (torch.compile), which cannot run for its weights
    alone."""
    return type(node).__name__ == _COMPILED


def graph_below(start: list[Node]) -> set[Node]:
    """``start`` and every node reachable from them."""
    out: set[Node] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node not in out:
            out.add(node)
            stack += [c for c, _ in node.next_functions if c is not None]
    return out


def _ownership(nodes: list[Node], on_path: set[Node], crossings: dict[Node, list[tuple[Node, int]]],
               accs: set[Node]) -> dict[Node, list[Node]]:
    """The crossing nodes that own the parameters below their crossings (:func:`_owned_params`), with their
    accumulators (``accs``: the parameters' AccumulateGrad nodes).

    One walk over the regions below every way off the path (a crossing node's crossings together, each other
    edge from an on-path node to an off-path one alone) marks each node with the region that reached it
    first. A path from a crossing node's other inputs into its own region must come in through another way
    off the path, so a region no other one meets is owned; only regions that meet another are checked by
    :func:`_owned_params`'s own walk, which is exact (and, run for every node, quadratic in a stage's depth).
    """
    first: dict[Node, int] = {}
    regions: list[list[Node]] = []
    meets: set[int] = set()

    def walk(start: list[Node]) -> int:
        tag = len(regions)
        region: list[Node] = []
        regions.append(region)
        stack = list(start)
        while stack:
            node = stack.pop()
            other = first.get(node)
            if other is None:
                first[node] = tag
                region.append(node)
                stack += [c for c, _ in node.next_functions if c is not None]
            elif other != tag:
                meets.update((tag, other))
        return tag

    tags: dict[Node, int] = {}
    for node in nodes:
        if node not in on_path:
            continue
        edges = crossings.get(node, [])
        crossing = set(edges)
        if edges:
            tags[node] = walk([c for c, _ in edges])
        for child, nr in node.next_functions:
            if child is not None and child not in on_path and (child, nr) not in crossing:
                walk([child])
    owned: dict[Node, list[Node]] = {}
    for node, tag in tags.items():
        if tag in meets:
            found = _owned_params(node, crossings[node], accs)
            if found is not None:
                owned[node] = found
        else:
            owned[node] = [n for n in regions[tag] if n in accs]
    return owned


def _owned_params(node: Node, edges: list[tuple[Node, int]], accs: set[Node]) -> list[Node] | None:
    """The parameters' accumulators below ``node``'s crossings, if no other input of ``node`` leads to anything
    there."""
    crossing = set(edges)
    below = graph_below([c for c, _ in edges])
    others = graph_below([c for c, nr in node.next_functions if c is not None and (c, nr) not in crossing])
    if below & others:
        return None
    return [n for n in below if n in accs]


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


def _capture(node: Node, store: dict[Node, tuple[torch.Tensor | None, ...]],
             state: _Backward) -> Callable[..., None]:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        store[node] = tuple(g.detach() if g is not None else None for g in grad_outputs)
        state.at_crossing = True  # W reruns this node: it keeps what it saved
    return hook


def _keep_made(node: Node, edges: list[tuple[Node, int]], cut: _Cut) -> Callable[..., None]:
    """A post-hook on a compiled region's node: keep the gradients it made for its edges off the path (W's)."""
    wanted = set(edges)

    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        cut.made[node] = [((c, nr), _reduce_broadcast(g.detach(), c, nr))
                          for (c, nr), g in zip(node.next_functions, grad_inputs, strict=True)
                          if g is not None and c is not None and (c, nr) in wanted]
    return hook


def _left(state: _Backward) -> Callable[..., None]:
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        state.at_crossing = False
    return hook


def ones_for(outputs: Tensors) -> Tensors:
    """A gradient of ones for each floating output: what a measurement gives a stage in place of the next one's."""
    return tuple(torch.ones_like(o) for o in outputs if o.is_floating_point())


def _input_grads(inputs: Tensors, grads: Sequence[torch.Tensor | None]) -> Tensors:
    """One gradient per input that takes one (floating point), zeros where autograd found it unused."""
    it = iter(grads)
    out = []
    for x in inputs:
        if x.requires_grad:
            g = next(it)
            out.append(torch.zeros_like(x) if g is None else waited(g))
    return tuple(out)


_MISMATCH = re.compile(r"shape|size|dimension|mat1 and mat2|argument|must match|expected .* got|too many|"
                       r"not enough|unpack|out of range|broadcast", re.IGNORECASE)


def _mismatch(exc: BaseException) -> bool:
    """Whether an error in a stage's first forward reads as what it was given not fitting it: a call with the wrong
    arguments, or tensors of the wrong shapes (torch's and Python's words for those)."""
    return bool(_MISMATCH.search(str(exc)))


class StageRunner:
    """Runs F, B, W and BW of one stage module for any number of microbatches in flight.

    Making one keeps the process's freed host memory for reuse (:func:`~pipefold.runtime.host_memory.keep_freed_pages`):
    every process that runs passes, the ranks and the profile's alike, then allocates the same way."""

    def __init__(self, module: nn.Module, *, loss_fn: Callable[..., torch.Tensor] | None = None,
                 meter: MemoryMeter | None = None, recompute: int = 0, input_grads: bool = True,
                 split: bool = True, stage: int = 0, boundaries: Boundaries | None = None,
                 autocast: torch.dtype | None = None) -> None:
        keep_freed_pages()
        self.module = module
        self.autocast = autocast if autocast is not None else _MEASURED_IN.get()
        """The dtype the forwards compute in under ``torch.autocast`` (and a recomputation's rerun with them); None:
        the module's own (:mod:`pipefold.runtime.precision`)."""
        self._compiled = any(is_compiled(m) for m in module.modules())
        """Whether some layer is torch.compile'd: the saved-tensor hooks then run outside its tracing."""
        self.loss_fn = loss_fn
        """Set on the last stage: ``loss_fn(output, target)``, the mean over the microbatch; F then returns it."""
        self.stage = stage
        self.boundaries = boundaries if boundaries is not None else Boundaries()
        """How this stage is called with what it receives, and where its output's structure goes."""
        self.outputs: dict[int, Any] = {}
        """The last stage's outputs of a forward-only step (:meth:`infer`), by microbatch."""
        self.input_grads = input_grads
        """False on the first stage: its inputs are the batch, whose gradient nobody needs."""
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
        # The first stage's input is the batch, so its B would have nothing to do and W would run, and keep
        # everything for, the whole backward. Its first layer (the embedding) is set apart instead: B runs the
        # rest of the stage back to that layer's output, like any other stage, and W ends with that layer. A stage
        # whose backward is never split (``split`` False: BW only) has no use for this, and one engine run is cheaper.
        # A stage whose first layers run without autograd (structured partial backpropagation) has no such layer
        # to stop at: its backward ends where autograd's does.
        self._lead = (layers[:1] if split and layers is not None and len(layers) > 1 and not input_grads
                      and not recompute and not hasattr(module, "on_saved")
                      and not getattr(module, "frozen_prefix", 0) else [])
        if self._lead:
            self._tail = self._tail[1:]
        self._listener = module if hasattr(module, "on_saved") else None
        """An offloaded stage, which reports each tensor its layers save (its ``on_saved``); None for any other."""
        self._weights = list(module.parameters())
        """Every parameter, trained or not: a tensor F saves that is one of them (by storage) is not activation memory.
        The list is fixed from here on; the storages are read on each F (offloading and FSDP refill them)."""
        self.params = [p for p in self._weights if p.requires_grad]
        self._cuts = Cuts(self.params)
        self._fuse = not hasattr(module, "on_saved") and wgrad.worth_fusing(module)
        """BW adds large Linears' weight gradients in place (:mod:`pipefold.runtime.wgrad`); an offloaded stage
        moves its parameters itself, and keeps autograd's way."""
        self._passes: dict[int, _Pass] = {}
        self._state = _Backward()
        self._unpack = _Unpack(self._state)
        self.losses: dict[int, torch.Tensor] = {}
        self.memory_f = 0
        """The most bytes one microbatch held after its F: saved tensors, outputs, inputs (its activation size)."""
        self.memory_b = 0
        """The most bytes one microbatch held while its B (or fused BW) ran: what F kept, what recomputation
        rebuilt, the gradient it got, what it captured and the input gradient it made (0 until one has run)."""
        self.memory_w = 0
        """The most bytes one microbatch held between its B and its W (0 until a B has run)."""
        self.memory_offloaded = 0
        """The most bytes one microbatch's offload (``OF``) moved to host memory."""
        self.chunks: SequenceChunks | None = None
        """With sequence chunks (Seq1F1B): the keys and values the stage's chunks share
        (:mod:`pipefold.runtime.seqchunks`); each microbatch number is then a unit, one chunk of a microbatch."""

    # -- forward

    def forward(self, mb: int, inputs: Tensors, target: Any = None, *, scale: float = 1.0) -> Tensors:
        """F: run the stage; keep what backward needs. On the last stage return (loss,) scaled by ``scale``."""
        # Leaves, so B can ask for their gradient alone; the batch's is never asked for.
        leaves = as_leaves(inputs) if self.input_grads else tuple(x.detach() for x in inputs)
        boxes: list[weakref.ref[_Box]] = []
        # Weights saved for backward (a Linear keeps its weight) are not activation memory: kept as they are.
        weights = {_storage(p) for p in self._weights}
        meter = self.meter

        def pack(t: torch.Tensor) -> Any:
            st = storage_of(t)
            if st is None or st.data_ptr() in weights:
                return t.detach()
            meter.hold_storages((st,), "saved")
            # Not ``t`` itself: a node that saves its own output would hold itself through the output's grad_fn.
            box = _Box(t.detach(), id(st))
            boxes.append(weakref.ref(box))
            return box

        # An Offloaded stage's layers install saved-tensor hooks of their own, which hide their saves from
        # ours: such a module reports each save to ``on_saved`` instead (and keeps it itself, until W).
        listener = self._listener
        if listener is not None:
            setattr(listener, "on_saved", lambda t: meter.hold((t,), "saved"))  # noqa: B010
        rebuild = None
        call = self.boundaries.call
        if self.chunks is not None:
            self.chunks.begin(mb)
        unpack: Callable[[Any], Any] = self._unpack
        if self._compiled:
            pack, unpack = eager(pack), eager(unpack)
        try:
            with self._fitting(inputs), self.casting(inputs):
                lead: tuple[Any, ...] = ()
                mid: Any = None
                if self._lead:
                    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                        lead_out, lead_spec = flatten(run_layers(self._lead, call(self.stage, leaves)))
                    leaves = as_leaves(lead_out)  # the inputs B differentiates towards
                    mid = as_call(unflatten(lead_spec, leaves), lead_spec)
                    # Where W ends: the first layer's output nodes, without the outputs themselves (the rest of the
                    # stage holds them only as long as it reads them).
                    lead = tuple(GradientEdge(t.grad_fn, t.output_nr) for t in lead_out
                                 if t.grad_fn is not None)
                if self.recompute:
                    rebuild = _Rebuild(self._head, leaves, weights, meter, self._state,
                                       lambda xs: call(self.stage, xs), lambda: self.casting(inputs),
                                       compiled=self._compiled)
                    meter.hold(leaves, "saved")  # what the recomputed layers keep: their input, once
                    with torch.autograd.graph.saved_tensors_hooks(rebuild.pack, rebuild.unpack):
                        mid = run_layers(self._head, call(self.stage, leaves))
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    if rebuild is not None or self._lead:
                        raw = run_layers(self._tail, mid) if self._tail else mid  # all recomputed: the head's
                    else:
                        raw = call(self.stage, leaves)(self.module)
                    if self.loss_fn is not None:
                        loss = self._loss(raw, target)
                        self.losses[mb] = loss.detach()
                        out: Tensors = (loss * scale,)
                    else:
                        out = self._hand_over(raw)
        finally:
            if listener is not None:
                setattr(listener, "on_saved", None)  # noqa: B010
        # The outputs stay alive until B: they are the roots it starts from.
        meter.hold(out, "output")
        p = _Pass(leaves, out, boxes, rebuild=rebuild, lead=lead)
        if self.chunks is not None:
            p.read, p.made = self.chunks.taken(mb)
        self._passes[mb] = p
        self.memory_f = max(self.memory_f, p.held_bytes(self.meter))
        # A tensor-parallel stage's last all-reduce may still be in flight (torch's AsyncCollectiveTensor): what
        # is handed on is its result.
        return tuple(waited(o.detach()) for o in out)

    def infer(self, mb: int, inputs: Tensors, target: Any = None) -> Tensors:
        """F of a forward-only step (evaluation, inference), under ``torch.no_grad``: nothing is kept for a backward.
        The last stage keeps its output in :attr:`outputs` (and its loss in :attr:`losses` when given a
        ``target``) and returns nothing; any other its output's tensors for the next stage."""
        if self.chunks is not None:
            self.chunks.begin(mb)
        with torch.no_grad(), self._fitting(inputs), self.casting(inputs):
            raw = self.boundaries.call(self.stage, inputs)(self.module)
            if self.chunks is not None:
                self.chunks.taken(mb)
            if self.loss_fn is None:
                return self._hand_over(raw)
            self.outputs[mb] = raw
            if target is not None:
                self.losses[mb] = self._loss(raw, target).detach()
            return ()

    def casting(self, like: Sequence[torch.Tensor] = ()) -> AbstractContextManager[Any]:
        """The forward's autocast (a no-op without :attr:`autocast`), on the device of the tensors ``like`` (the
        stage's inputs: an offloaded stage's parameters live in host memory while it computes on the device)."""
        if self.autocast is None:
            return nullcontext()
        where = next((t for t in like if isinstance(t, torch.Tensor)), None)
        if where is None:
            where = next(iter(self._weights), None)
        return torch.autocast(where.device.type if where is not None else "cpu", dtype=self.autocast)

    def _loss(self, raw: Any, target: Any) -> torch.Tensor:
        assert self.loss_fn is not None
        try:
            loss = self.loss_fn(raw, target)
        except (TypeError, ValueError, RuntimeError, IndexError) as exc:
            if self.stage in self.boundaries.fitted or isinstance(exc, ConfigError) or not _mismatch(exc):
                raise
            out, spec = flatten(raw)
            wanted = describe(flatten(target)[0], flatten(target)[1]) if target is not None else "None"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"the loss function does not take the last stage's output, {describe(out, spec)}, "
                              f"and the target, {wanted}: {type(exc).__name__}: {first}") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigError(f"the loss function returned {what}; it must return one number (a tensor of one "
                              "element), the mean over the microbatch")
        return loss.reshape(())

    def _hand_over(self, raw: Any) -> Tensors:
        """The output's tensors for the next stage; its structure goes to the next stage's boundary."""
        out, spec = flatten(raw)
        self.boundaries.specs[self.stage + 1] = spec
        return out

    @contextmanager
    def _fitting(self, inputs: Tensors) -> Iterator[None]:
        """Name a stage's first forward with new shapes that fails as a mismatch with what it was given (a call with
        the wrong arguments, shapes that do not fit: :func:`_mismatch`) in one line, with the stage before's output
        (or the batch) and its shapes; other failures, and later ones, pass as they are."""
        if self.stage in self.boundaries.fitted:
            yield
            return
        try:
            yield
        except (TypeError, ValueError, RuntimeError, IndexError) as exc:
            if isinstance(exc, ConfigError) or not _mismatch(exc):
                raise
            given = describe(inputs, self.boundaries.specs.get(self.stage))
            source = f"stage {self.stage - 1}'s output" if self.stage else "the batch"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"stage {self.stage} does not take {source}, {given}: {type(exc).__name__}: "
                              f"{first}") from exc
        self.boundaries.fitted.add(self.stage)

    # -- activation offloading

    def offload(self, mb: int, copies: HostCopies) -> int:
        """OF: copy what microbatch ``mb``'s forward saved to host memory and let the device copy go (what the
        microbatch holds anyway, its inputs and outputs, stays); return the bytes moved."""
        p = self._passes[mb]
        if p.host is not None:
            raise RuntimeError(f"stage {self.stage} microbatch {mb} is offloaded already")
        kept = [*p.inputs, *p.outputs, *(p.rebuild.inputs if p.rebuild is not None else ())]
        keep = {id(st) for t in kept if (st := storage_of(t)) is not None}
        boxes = [b for ref in p.boxes if (b := ref()) is not None]
        p.host, p.offloaded = copies.offload(boxes, keep)
        moved = sum(c.nbytes for c in p.host)
        self.memory_offloaded = max(self.memory_offloaded, moved)
        return moved

    def reload(self, mb: int, copies: HostCopies) -> None:
        """RL: copy microbatch ``mb``'s offloaded activations back to the device, for its backward."""
        p = self._passes[mb]
        if p.host is None:
            raise RuntimeError(f"stage {self.stage} microbatch {mb} has nothing offloaded to reload")
        storages, done = copies.reload(p.host, p.offloaded)
        p.reloaded = True if done is None else done
        self.meter.hold_storages(storages, "saved")

    def _reloaded(self, p: _Pass) -> None:
        """Before a backward: wait for its reload (a GPU's copy stream), and let the host copies go."""
        if p.host is None:
            return
        if p.reloaded is None:
            raise RuntimeError(f"stage {self.stage}: a backward ran on offloaded activations that were never "
                               "reloaded (the schedule needs an RL before it)")
        if p.reloaded is not True:
            p.reloaded.wait()  # the compute stream waits for the copy stream's reload
        p.host = p.offloaded = p.reloaded = None

    # -- backward

    def backward_input(self, mb: int, out_grads: Tensors | None) -> Tensors | None:
        """B: gradient of the stage input only; record where W must start. None if no input takes one.

        What B read and W will not read again is freed as B runs; the gradients entering W's
        starting points are kept until W.
        """
        p = self._passes[mb]
        self._reloaded(p)
        grads_out = self._grads_for(p, out_grads)
        outs = self._differentiable(p)
        wanted = [x for x in p.inputs if x.requires_grad]
        given = len(wanted)  # the stage's own inputs; after them the earlier chunks' keys and values
        if self.chunks is not None:
            roots, root_grads = self.chunks.roots(mb, p.made)
            outs, grads_out, wanted = outs + roots, grads_out + root_grads, wanted + list(p.read)
        cut = self._cuts.of(outs, wanted)
        captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        state = self._state
        handles = []
        for node in cut.crossings:
            if compiled_node(node):  # B's engine makes W's gradients too: kept, and the node's saves freed
                handles.append(node.register_hook(_keep_made(node, cut.edges[node], cut)))
                continue
            handles.append(node.register_prehook(_capture(node, captured, state)))
            handles.append(node.register_hook(_left(state)))
        before = self._rest_of_rank(p, out_grads)
        state.in_b = True
        try:
            dx = torch.autograd.grad(outs, wanted, grads_out, retain_graph=True, allow_unused=True) if wanted else ()
        finally:
            state.in_b = state.at_crossing = False
            for h in handles:
                h.remove()
        for node in cut.vector_crossings():  # cheap weight gradients: now, so B frees what they read
            cut.take_now(node, captured)
        self.meter.hold((g for grads in captured.values() for g in grads), "captured")
        self.meter.hold((g for made in cut.made.values() for _, g in made), "captured")
        p.cut, p.captured = cut, captured
        # W starts from the crossings and from the outputs off the path: only those outputs stay.
        p.outputs = tuple(outs[i] for i in cut.outputs)
        p.grads_out = [grads_out[i] for i in cut.outputs]
        self.meter.hold(p.grads_out, "captured")
        inputs, p.inputs = p.inputs, ()
        if self.chunks is not None:
            self.chunks.give(mb, dx[given:])
            dx, p.read, p.made = dx[:given], (), ()
        grads = _input_grads(inputs, dx) if given else None
        if p.lead:
            p.lead_grads, grads = grads or (), None  # for W to finish with the first layer
        self.meter.hold(grads or p.lead_grads, "output" if grads else "captured")
        self.memory_w = max(self.memory_w, p.held_bytes(self.meter))
        self.memory_b = max(self.memory_b, self.meter.window_peak - before)
        return grads

    def backward_weight(self, mb: int) -> None:
        """W: weight gradients from what B recorded; accumulate into ``.grad``; release the microbatch."""
        p = self._passes.pop(mb)
        if self.params and p.cut is not None:
            p.cut.weight_grads(p.captured, p.outputs, p.grads_out)
        self._finish_lead(p, p.lead_grads)

    def backward(self, mb: int, out_grads: Tensors | None) -> Tensors | None:
        """BW: input and weight gradients in one pass; release the microbatch."""
        p = self._passes.pop(mb)
        self._reloaded(p)
        grads_out = self._grads_for(p, out_grads)
        outs = self._differentiable(p)
        wanted = [x for x in p.inputs if x.requires_grad]
        if self.chunks is not None:
            roots, root_grads = self.chunks.roots(mb, p.made)
            outs, grads_out = outs + roots, grads_out + root_grads
        before = self._rest_of_rank(p, out_grads)
        # backward() adds straight into each parameter's .grad (and the input leaves' .grad): no copies; a
        # Linear's weight gradient in place (wgrad). Into every leaf the stage's graph reaches, through the
        # graph's own accumulators: naming the parameters would name their current accumulators, not the
        # graph's, where a parameter's data moved since the forward.
        if self._fuse:
            wgrad.backward(outs, grads_out)
        else:
            torch.autograd.backward(outs, grads_out)
        if self.chunks is not None:
            self.chunks.give(mb, [x.grad for x in p.read])
        grads = _input_grads(p.inputs, [x.grad for x in wanted]) if wanted else None
        if p.lead:
            self._finish_lead(p, grads or ())
            grads = None
        self.meter.hold(grads or (), "output")
        self.memory_b = max(self.memory_b, self.meter.window_peak - before)
        return grads

    # -- helpers

    def _rest_of_rank(self, p: _Pass, out_grads: Tensors | None) -> int:
        """Open the meter's window for a backward of ``p``; return what the rest of the rank holds, so that the
        window's peak less it is what the microbatch held during the backward (its gradient included)."""
        return self.meter.open_window() - p.held_bytes(self.meter) - self.meter.bytes_of(out_grads or ())

    @staticmethod
    def _finish_lead(p: _Pass, grads: Tensors) -> None:
        """The first stage's first layer: its backward, from the gradient of its output."""
        if p.lead:
            torch.autograd.backward(list(p.lead), list(grads))

    @staticmethod
    def _differentiable(p: _Pass) -> list[torch.Tensor]:
        return [o for o in p.outputs if o.requires_grad]

    def _grads_for(self, p: _Pass, out_grads: Tensors | None) -> list[torch.Tensor]:
        """The gradient for each differentiable output: given by the next stage, or 1 for the loss.

        The next stage gives one for every floating output (its inputs, made leaves, all take one); those of
        outputs that need none (a floating input passed on untouched by a stage whose input takes no gradient)
        are dropped here."""
        if self.loss_fn is not None:
            return [torch.ones_like(self._differentiable(p)[0])]
        floating = [o for o in p.outputs if o.is_floating_point()]
        if out_grads is None or len(out_grads) != len(floating):
            n = 0 if out_grads is None else len(out_grads)
            raise RuntimeError(f"stage backward got {n} output gradients for {len(floating)} floating outputs")
        return [g for o, g in zip(floating, out_grads, strict=True) if o.requires_grad]

    def held_bytes(self, mb: int, *, outputs: bool = True) -> int:
        """Bytes microbatch ``mb`` holds now (between its F and its W); without ``outputs``, its outputs only
        count where it also saved them for backward."""
        return self._passes[mb].held_bytes(self.meter, outputs=outputs)

    @property
    def in_flight(self) -> int:
        """Microbatches whose W (or BW) has not run yet."""
        return len(self._passes)

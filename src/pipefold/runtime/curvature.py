"""K-FAC's actions on one rank: capture what curvature reads, then KA, KG, KI and KP where the schedule puts them.

A stage's ``nn.Linear`` layers get a forward hook. In a step whose list has ``sKAj`` (``sKGj``),
the forward of (s, j) keeps each layer's input (and hooks its output for the gradient that the
backward will pass through it); the curvature action folds what was kept into the factor sums and
lets it go. Until then the rank's :class:`~pipefold.runtime.meter.MemoryMeter` counts it: a layer
input is the very storage the backward saved, so it costs nothing extra until the microbatch's W
frees the rest; an output gradient is kept where a fused backward would have dropped it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipefold.ir import Action, Kind
from pipefold.plan.dpkfac import sends_rows
from pipefold.runtime.kfac import KFAC, KFACConfig, LinearFactors, gram
from pipefold.runtime.meter import MemoryMeter

KINDS = frozenset({Kind.KA, Kind.KG, Kind.KI, Kind.KP})
"""The action kinds this module runs."""


@dataclass(frozen=True)
class Copies:
    """The data-parallel copies a stage's K-FAC is spread over (:mod:`pipefold.plan.dpkfac`)."""

    group: Any
    """The process group of the copies of this stage (every copy runs the same actions in the same order)."""
    ranks: tuple[int, ...]
    """Its members' global ranks, copy 0 first."""
    me: int
    """This rank's copy."""
    distribution: str
    """'dp-kfac' or 'd-kfac'."""
    owners: tuple[int, ...]
    """With DP-KFAC, the copy that owns each of the stage's K-FAC layers."""

    @property
    def size(self) -> int:
        return len(self.ranks)


class StageCurvature:
    """K-FAC of one stage module, fed per microbatch."""

    def __init__(self, module: nn.Module, config: KFACConfig, microbatches: int, copies: Copies | None = None) -> None:
        self.kfac = KFAC(module, config)
        self.microbatches = microbatches
        self.copies = copies
        if copies is not None and copies.distribution == "dp-kfac" and len(copies.owners) != len(self.kfac.layers):
            raise ValueError(f"{len(copies.owners)} owners for {len(self.kfac.layers)} K-FAC layers")
        self._gathered: set[tuple[int, str]] = set()
        """DP-KFAC: the (layer, factor) pairs whose rows travel to their owner (the others' sums are reduced)."""
        self.sent: dict[str, float] = {}
        """Bytes this rank put into K-FAC's collectives, by what they carried (the names of
        :attr:`pipefold.plan.dpkfac.PerCopy.sent`)."""
        self.comm_seconds = 0.0
        """Seconds this rank spent in K-FAC's collectives (waiting for the other copies included)."""
        self.meter = MemoryMeter()
        self.want_a: set[int] = set()
        self.want_g: set[int] = set()
        self.current: int | None = None
        """The microbatch whose forward runs now (None outside a forward)."""
        self.record = False
        """Keep a copy of the gradients as KP finds them (before preconditioning), in ``raw``."""
        self.raw: dict[int, torch.Tensor] = {}
        """With ``record``: each parameter's gradient before preconditioning, by ``id(parameter)``."""
        self._a: dict[int, list[torch.Tensor | None]] = {}
        self._g: dict[int, list[torch.Tensor | None]] = {}
        self._handles = [f.layer.register_forward_hook(self._hook(i)) for i, f in enumerate(self.kfac.layers)]

    @contextlib.contextmanager
    def recording(self, mb: int) -> Iterator[None]:
        """Around the forward of microbatch ``mb``: the layers' inputs and output gradients it wants are kept."""
        self.current = mb
        try:
            yield
        finally:
            self.current = None

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            mb = self.current
            if mb is None:
                return
            if mb in self.want_a:
                a = args[0].detach()
                self._a.setdefault(mb, [None] * len(self.kfac.layers))[index] = a
                self.meter.hold((a,), "kfac")
            if mb in self.want_g and output.requires_grad:
                output.register_hook(self._keep_g(mb, index))
        return hook

    def _keep_g(self, mb: int, index: int) -> Any:
        def keep(g: torch.Tensor) -> None:
            if mb not in self.want_g:
                return  # its KG has run (a weight gradient that restarts at this layer passes here again)
            g = g.detach()
            self._g.setdefault(mb, [None] * len(self.kfac.layers))[index] = g
            self.meter.hold((g,), "kfac")
        return keep

    def kept_bytes(self, mb: int) -> tuple[int, int]:
        """Bytes of the layer inputs and of the output gradients kept for microbatch ``mb``'s curvature."""
        a, g = (sum(t.untyped_storage().nbytes() for t in kept.get(mb, ()) if t is not None)
                for kept in (self._a, self._g))
        return a, g

    def close(self) -> None:
        """Take the hooks off the layers."""
        for handle in self._handles:
            handle.remove()

    def begin(self, actions: Sequence[Action], stage: int, meter: MemoryMeter) -> None:
        """A step starts: capture for the microbatches whose curvature this rank's list has."""
        self.meter = meter
        self.want_a = {a.microbatch for a in actions if a.stage == stage and a.kind == Kind.KA}
        self.want_g = {a.microbatch for a in actions if a.stage == stage and a.kind == Kind.KG}
        self._a.clear()
        self._g.clear()

    def run(self, action: Action) -> None:
        mb = action.microbatch
        spread = self.copies is not None and self.copies.distribution == "dp-kfac"
        if action.kind == Kind.KA:
            self.want_a.discard(mb)
            # A stage may have no layer K-FAC takes (an embedding alone): nothing was kept for it.
            none: list[torch.Tensor | None] = [None] * len(self.kfac.layers)
            for i, (factors, a) in enumerate(zip(self.kfac.layers, self._a.pop(mb, none), strict=True)):
                if a is None:
                    continue
                if spread:
                    self._to_owner(i, factors.a_rows(a), "A")
                else:
                    factors.add_a(a)
        elif action.kind == Kind.KG:
            self.want_g.discard(mb)
            none = [None] * len(self.kfac.layers)
            for i, (factors, g) in enumerate(zip(self.kfac.layers, self._g.pop(mb, none), strict=True)):
                if g is None:
                    continue
                # The backward's gradient is that of (mean over the g's rows) / microbatches: scaled back to each
                # row's own loss gradient.
                scale = float(self.microbatches * (g.numel() // g.shape[-1]))
                if spread:
                    self._to_owner(i, factors.g_rows(g, scale), "G")
                else:
                    factors.add_g(g, scale=scale)
        elif action.kind == Kind.KI:
            if spread:
                self._reduce_sums()
            elif self.copies is not None:
                self._all_reduce_sums()
            self.kfac.invert()  # with DP-KFAC, a layer another copy owns has no rows here: nothing to fold
        else:
            if self.record:
                self.raw = {id(f.layer.weight): f.layer.weight.grad.clone() for f in self.kfac.layers
                            if f.layer.weight.grad is not None}
                self.raw.update({id(f.layer.bias): f.layer.bias.grad.clone() for f in self.kfac.layers
                                 if f.layer.bias is not None and f.layer.bias.grad is not None})
            self.kfac.precondition()  # with DP-KFAC, the layers this copy owns (the others have no inverses here)
            if spread:
                self._broadcast_preconditioned()

    def _to_owner(self, index: int, rows: torch.Tensor, which: str) -> None:
        """DP-KFAC: one microbatch's ``rows`` of factor ``which`` of layer ``index``. Where a refresh's rows (this
        microbatch's times the microbatches) are fewer bytes than the factor, every copy sends them to the layer's
        owner now, which builds the factor from all of them; elsewhere each copy adds them to its own sum, which the
        inversion reduces to the owner (:meth:`_reduce_sums`)."""
        import torch.distributed as dist

        copies = self.copies
        assert copies is not None
        factors = self.kfac.layers[index]
        add = factors.add_a_gram if which == "A" else factors.add_g_gram
        if not sends_rows(rows.shape[0] * self.microbatches, rows.shape[1]):
            add(gram(rows), rows.shape[0])
            return
        self._gathered.add((index, which))
        owner = copies.owners[index]
        rows = rows.contiguous()
        parts = [torch.empty_like(rows) for _ in range(copies.size)] if owner == copies.me else None
        with self._collective():
            dist.gather(rows, parts, dst=copies.ranks[owner], group=copies.group)
        if parts is not None:
            every = torch.cat(parts)
            add(gram(every), every.shape[0])
        else:
            self._count("rows", rows)

    def _reduce_sums(self) -> None:
        """DP-KFAC, before an inversion: each layer's factor sums that every copy built from its own rows, summed
        into the layer's owner (a reduce); the other copies' sums start again from zero."""
        import torch.distributed as dist

        copies = self.copies
        assert copies is not None
        for i, (f, owner) in enumerate(zip(self.kfac.layers, copies.owners, strict=True)):
            for which, total_name, rows_name in (("A", "_a_sum", "_a_rows"), ("G", "_g_sum", "_g_rows")):
                total = getattr(f, total_name)
                if total is None or (i, which) in self._gathered:  # none built, or built from every copy's rows
                    continue
                with self._collective():
                    dist.reduce(total, dst=copies.ranks[owner], group=copies.group)
                if owner == copies.me:
                    setattr(f, rows_name, getattr(f, rows_name) * copies.size)
                else:
                    self._count("factors", total)
                    total.zero_()
                    setattr(f, rows_name, 0)

    def _all_reduce_sums(self) -> None:
        """D-KFAC: every layer's factor sums since the last inversion, summed over the copies (and their rows)."""
        import torch.distributed as dist

        copies = self.copies
        assert copies is not None
        ring = 2.0 * (copies.size - 1) / copies.size
        for f in self.kfac.layers:
            for name in ("_a_sum", "_g_sum"):
                total = getattr(f, name)
                if total is not None:
                    with self._collective():
                        dist.all_reduce(total, group=copies.group)
                    self._count("factors", total, ring)
            f._a_rows *= copies.size
            f._g_rows *= copies.size

    def _broadcast_preconditioned(self) -> None:
        """DP-KFAC: each layer's preconditioned gradient, from its owner to the other copies."""
        import torch.distributed as dist

        copies = self.copies
        assert copies is not None
        share = (copies.size - 1) / copies.size
        for f, owner in zip(self.kfac.layers, copies.owners, strict=True):
            for p in (f.layer.weight, f.layer.bias):
                if p is None or p.grad is None:
                    continue
                with self._collective():
                    dist.broadcast(p.grad, src=copies.ranks[owner], group=copies.group)
                self._count("preconditioned", p.grad, share)

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        import time

        start = time.perf_counter()
        try:
            yield
        finally:
            self.comm_seconds += time.perf_counter() - start

    def _count(self, what: str, tensor: torch.Tensor, share: float = 1.0) -> None:
        self.sent[what] = self.sent.get(what, 0.0) + share * tensor.numel() * tensor.element_size()


class RankCurvature:
    """The :class:`~pipefold.runtime.executor.RankExecutor`'s work for K-FAC's kinds, one stage curvature each."""

    kinds = KINDS

    def __init__(self, stages: Mapping[int, StageCurvature]) -> None:
        self.stages = dict(stages)
        self.seconds = 0.0
        """Seconds of K-FAC's work this rank has run (its collectives included)."""

    def begin(self, actions: Sequence[Action], meter: MemoryMeter) -> None:
        flat = [a for act in actions for a in act.passes]
        for s, c in self.stages.items():
            c.begin(flat, s, meter)

    @contextlib.contextmanager
    def forward(self, action: Action) -> Iterator[None]:
        with self.stages[action.stage].recording(action.microbatch):
            yield

    def run(self, action: Action) -> None:
        import time

        start = time.perf_counter()
        self.stages[action.stage].run(action)
        self.seconds += time.perf_counter() - start

    def report(self, steps: int) -> dict[str, Any]:
        """What this rank's K-FAC held, sent and spent over ``steps`` steps: ``state_bytes``, ``sent`` (bytes by what
        they carried, per step), ``seconds`` (per step) and of them ``comm_seconds`` in its collectives."""
        per = max(steps, 1)
        distribution = next((c.copies.distribution for c in self.stages.values() if c.copies is not None), None)
        comm = sum(c.comm_seconds for c in self.stages.values())
        return {"state_bytes": self.state_bytes(), "sent": {k: v / per for k, v in self.sent().items()},
                "seconds": self.seconds / per, "comm_seconds": comm / per, "distribution": distribution}

    def state_bytes(self) -> int:
        return sum(c.kfac.state_bytes() for c in self.stages.values())

    def sent(self) -> dict[str, float]:
        """Bytes this rank put into K-FAC's collectives so far, by what they carried (:attr:`StageCurvature.sent`)."""
        out: dict[str, float] = {}
        for c in self.stages.values():
            for k, v in c.sent.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def state(self) -> list[torch.Tensor]:
        """Every stage's factors, inverses and sums: K-FAC's state, kept from step to step."""
        return [t for c in self.stages.values() for f in c.kfac.layers
                for t in (f.A, f.G, f.A_inv, f.G_inv, f._a_sum, f._g_sum) if t is not None]

    _STATE = ("A", "G", "A_inv", "G_inv", "_a_sum", "_g_sum", "_a_rows", "_g_rows")

    def snapshot(self) -> list[dict[str, Any]]:
        """A copy of every layer's factors, inverses and sums, to roll a skipped step back (:meth:`restore`)."""
        out = []
        for c in self.stages.values():
            for f in c.kfac.layers:
                values = {k: getattr(f, k) for k in self._STATE}
                out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()})
        return out

    def restore(self, saved: list[dict[str, Any]]) -> None:
        """Put back what :meth:`snapshot` copied."""
        layers = [f for c in self.stages.values() for f in c.kfac.layers]
        for f, state in zip(layers, saved, strict=True):
            for k, v in state.items():
                setattr(f, k, v)

    def record(self, on: bool) -> None:
        """Keep (or stop keeping) the gradients before preconditioning, for a check against one process."""
        for c in self.stages.values():
            c.record, c.raw = on, {}

    def raw_grads(self) -> dict[int, torch.Tensor]:
        """The gradients before preconditioning of the last step recorded, by ``id(parameter)``."""
        return {k: v for c in self.stages.values() for k, v in c.raw.items()}


def measure(stages: Sequence[nn.Module], sample: torch.Tensor | Sequence[torch.Tensor], target: Any, loss_fn: Any, *,
            microbatches: int,
            config: KFACConfig, repeats: int = 3, layers: bool = False) -> list[dict[str, Any]]:
    """Time each stage's passes and K-FAC work on one sample microbatch, on one thread as a rank runs.

    Per stage: ``f``, ``b``, ``w``, a fused backward's ``bw`` and the ``work`` of KA, KG, KI and KP in seconds
    (medians of ``repeats`` runs after a warm-up), ``memory`` (bytes one microbatch holds after its F), the
    ``stash`` of KA and KG (bytes of its layer inputs and output gradients), its ``shapes``: (columns of A, columns
    of G, rows of one microbatch) of each K-FAC layer, and with ``layers`` each such layer's own seconds of one
    microbatch's factors, an inversion and a preconditioning (:func:`layer_seconds`; else an empty list).
    """
    import statistics
    import time

    from pipefold.runtime.stage import StageRunner, as_tuple
    from pipefold.runtime.timed import run_passes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out: list[dict[str, Any]] = []
        x: tuple[torch.Tensor, ...] = as_tuple(sample)
        last = len(stages) - 1
        for s, stage in enumerate(stages):
            runner = StageRunner(stage, loss_fn=loss_fn if s == last else None, input_grads=s > 0)
            curv = StageCurvature(stage, config, microbatches)
            runs: list[dict[str, float]] = []
            memory = stash_a = stash_g = 0
            h = x
            for k in range(repeats + 1):
                row = [Action(s, Kind.KA, k), Action(s, Kind.KG, k)]
                curv.begin(row, s, runner.meter)
                (f, b, w), h = run_passes(runner, k, x, target, scale=1.0 / microbatches,
                                          forward=functools.partial(curv.recording, k))
                t: dict[str, float] = {"F": f, "B": b, "W": w}
                memory = max(memory, runner.memory_f)
                stash_a, stash_g = curv.kept_bytes(k)
                kept = curv._a.get(k) or [None] * len(curv.kfac.layers)
                rows = [0 if a is None else a.numel() // a.shape[-1] for a in kept]
                for kind in (Kind.KA, Kind.KG, Kind.KI, Kind.KP):
                    t0 = time.perf_counter()
                    curv.run(Action(s, kind, k if kind in (Kind.KA, Kind.KG) else -1))
                    t[kind] = time.perf_counter() - t0
                if k:
                    runs.append(t)
                for p in runner.params:
                    p.grad = None
            seconds = [layer_seconds(f.layer, n, config, repeats) for f, n in zip(curv.kfac.layers, rows, strict=True)
                       ] if layers else []
            shapes = [(f.layer.in_features + (f.layer.bias is not None), f.layer.out_features, n)
                      for f, n in zip(curv.kfac.layers, rows, strict=True)]
            curv.close()
            # The fused backward a BW schedule runs instead of B and W (K-FAC's work is timed on its own).
            fused = [run_passes(runner, repeats + 1 + k, x, target, scale=1.0 / microbatches, fused=True)[0][1]
                     for k in range(repeats + 1)]
            for p in runner.params:
                p.grad = None
            med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            out.append({"f": med["F"], "b": med["B"], "w": med["W"], "bw": statistics.median(fused[1:]),
                        "memory": memory,
                        "work": {k: med[k] for k in (Kind.KA, Kind.KG, Kind.KI, Kind.KP)},
                        "stash": {Kind.KA: stash_a, Kind.KG: stash_g}, "layers": seconds, "shapes": shapes})
            x = tuple(t.detach() for t in h) if s < last else x
        return out
    finally:
        torch.set_num_threads(threads)


def layer_seconds(layer: nn.Linear, rows: int, config: KFACConfig, repeats: int = 3) -> float:
    """Seconds of one layer's K-FAC with ``rows`` rows per microbatch: both factors of one microbatch, the two
    inversions and one preconditioning (the median of ``repeats`` after a warm-up), on the layer's device, with
    data of the shapes it will have (the work depends on the shapes alone)."""
    import statistics
    import time

    weight = layer.weight
    factors = LinearFactors(layer)
    a = torch.randn(max(rows, 1), layer.in_features, device=weight.device)
    g = torch.randn(max(rows, 1), layer.out_features, device=weight.device)
    grad = torch.randn(layer.out_features, layer.in_features + (layer.bias is not None), device=weight.device)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        factors.add_a(a)
        factors.add_g(g, 1.0)
        factors.invert(config)
        assert factors.G_inv is not None and factors.A_inv is not None
        _ = factors.G_inv @ grad @ factors.A_inv
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])

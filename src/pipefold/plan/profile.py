"""A model's profile on the machine it will train on: what each layer costs, what the link costs, how devices share.

``pipefold profile`` measures (:mod:`pipefold.runtime.measure.profiling`), and :mod:`pipefold.plan.budget` reads, three
things::

    layers      per layer, one microbatch: F, B, W seconds and a fused backward's BW (medians of repeats on
                the runtime's own stage runner), how much longer its W takes per autograd node below it in a
                stage, bytes held after F and between B and W (the runtime's meter),
                parameter bytes, bytes of its output (what a stage boundary after it sends)
    link        one-way time of a message between two gloo ranks: latency + bytes / bandwidth,
                fitted to ping-pongs of 4 KiB .. 4 MiB
    allreduce   per group size k dividing the devices: an all-reduce among k ranks as the runtime makes
                it (copied into one buffer, scaled to the mean), latency + bytes / bandwidth, fitted to
                64 KiB .. 16 MiB (the data-parallel copies' gradients)
    fsdp        per group size k: FSDP's gather and reduce-scatter of a stage among k ranks as the runtime
                runs them (torch's fully_shard, a unit per layer), each latency per unit + bytes of the
                whole parameters / bandwidth
    sharing     how much slower a pass runs when k ranks compute at once (k = 1..devices): 1.0
                each on separate accelerators, about k / cores when k processes share fewer cores
    fixed       the part of a stage's F, B, W and BW that does not grow with its layers (the runner's
                own work once per pass): each stage's worth of layers timed as one stage beside its layers
                timed one by one (:func:`pass_fixed_of`)
    overhead    the runtime's own work per message a rank sends or receives, beside its passes (posting
                it, bookkeeping), from a short run of the model on 2 ranks (:mod:`pipefold.train.overhead`)
    tp_layers   with ``pipefold profile --tp 1,2``: the layers again, split over t tensor-parallel ranks as
                ``train --tp t`` splits them, measured on one of t local ranks while devices / t such groups
                measure side by side (times with the layers' all-reduces inside, this rank's bytes, the
                collectives each layer calls); :meth:`Profile.at_tp` is the profile of one degree

The file is JSON (``Profile.save`` / ``Profile.load``) and says which model, at which size, it is.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pipefold.errors import ConfigError
from pipefold.sim.simulate import fits_hold

__all__ = ["PASSES", "LayerProfile", "Profile", "fit_link", "pass_fixed_of", "stage_passes"]

PASSES = ("f", "b", "w", "fused")
"""A stage's passes as :class:`LayerProfile` names them, in the order of :attr:`Profile.pass_fixed`: F, B, W and
the fused BW."""

VERSION = 1

Progress = Callable[[str, int, int], None]
"""Called as ``progress(what, done, total)`` while measuring."""


@dataclass(frozen=True)
class LayerProfile:
    """One layer's costs for one microbatch."""

    f: float
    """Forward seconds."""
    b: float
    """Input-gradient seconds."""
    w: float
    """Weight-gradient seconds."""
    held: int
    """Bytes held from the end of F until the backward: its input and what it saved."""
    held_w: int
    """Bytes held from the end of B until W: what W reads."""
    params: int
    """Parameter bytes."""
    out: int
    """Bytes of its output: what a stage ending with this layer sends (and gets back as a gradient)."""
    bw: float | None = None
    """Fused backward (BW) seconds; None (a profile from before it was measured): B + W."""
    nodes: int = 0
    """Autograd nodes its forward adds to a microbatch's graph."""
    w_depth: float = 0.0
    """Seconds its W takes longer per autograd node below it in its stage: W restarts the autograd engine where
    each weight gradient starts, and the engine walks the whole graph below that point each time."""
    collectives: int = 0
    """Split over tensor-parallel ranks: the collectives its forward and backward call per microbatch (torch's
    ``CommDebugMode`` counted them as they ran); 0 for a whole layer."""
    update: float = 0.0
    """Seconds the step after the schedule spends on its parameters: the gradients' check and the optimizer's step
    (0: not measured)."""
    tensors: tuple[int, ...] = ()
    """Bytes of each of its parameter tensors as a rank holds them (a tensor-parallel shard's own), in order; they
    sum to ``params``. ZeRO-1 shares whole tensors among copies (:mod:`pipefold.plan.shares`). Empty in a profile
    from before they were recorded: the state is then taken as shared evenly."""

    @property
    def fused(self) -> float:
        """Seconds of a fused backward: ``bw`` where measured, else B + W."""
        return self.b + self.w if self.bw is None else self.bw

    def timed_by(self, factor: float) -> LayerProfile:
        """This layer with every one of its times (:data:`TIMES`) ``factor`` times as long, its bytes and counts as
        they are: the layer as it would have measured with a different number of ranks sharing the machine."""
        return dataclasses.replace(self, **{name: value * factor for name in TIMES
                                            if (value := getattr(self, name)) is not None})


TIMES = ("f", "b", "w", "bw", "w_depth", "update")
"""The fields of :class:`LayerProfile` that are seconds (every other field is bytes or a count)."""


@dataclass(frozen=True)
class Profile:
    """A model measured on one machine at one microbatch size; the planner's input."""

    train: dict[str, Any]
    """The model and its size as ``pipefold train`` takes them: model, layers, hidden, heads, seq, batch,
    microbatches, optimizer, seed."""
    layers: tuple[LayerProfile, ...]
    latency: float
    """Seconds of a message of no bytes between two ranks."""
    bandwidth: float
    """Bytes per second between two ranks."""
    contention: tuple[float, ...]
    """``contention[k-1]``: how many times longer a pass takes while k ranks compute at once."""
    optimizer_factor: float
    """Optimizer state per parameter, in parameter sizes (AdamW 2, SGD 0)."""
    machine: dict[str, Any] = field(default_factory=dict)
    """Where and when it was measured: host, cores, torch version, device, date, repeats."""
    message_overhead: float = 0.0
    """Seconds of the runtime's own work per message a rank sends or receives, beside its passes (0: not
    measured)."""
    pass_fixed: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """Seconds of a stage's F, B, W and fused BW (:data:`PASSES`) that do not grow with its layers: every layer's
    own timing includes them once, a stage pays them once (:func:`pass_fixed_of`; 0: not measured)."""
    tp: int = 1
    """The tensor-parallel degree ``layers`` were measured at (1: whole layers)."""
    tp_layers: dict[int, tuple[LayerProfile, ...]] = field(default_factory=dict)
    """The layers measured at other tensor-parallel degrees, by degree (``pipefold profile --tp``)."""
    tp_ranks: dict[int, int] = field(default_factory=dict)
    """By degree: how many ranks computed at once while its layers were measured (groups of that degree side by
    side, as a run's ranks share the machine); a degree not here, and ``layers``, were measured alone."""
    allreduce: dict[int, tuple[float, float]] = field(default_factory=dict)
    """By group size k: (latency seconds, bandwidth bytes/s) of an all-reduce among k ranks, the others computing:
    seconds = latency + buffer bytes / bandwidth (measured where the link is)."""
    fsdp: dict[int, tuple[tuple[float, float], tuple[float, float]]] = field(default_factory=dict)
    """By group size k: ((latency, bandwidth) of FSDP's gather, (latency, bandwidth) of its reduce-scatter) among
    k ranks, the others computing (:func:`pipefold.runtime.measure.profiling.measure_fsdp`): latency per FSDP unit (a
    layer), bandwidth in bytes of the whole parameters. Empty in a profile from before it was measured: half an
    all-reduce each."""
    fsdp_update: float = 0.0
    """Seconds more per tensor that the update after the schedule takes on FSDP's shards (DTensors) than on plain
    tensors (:func:`pipefold.runtime.measure.profiling.measure_fsdp`; 0: not measured)."""
    zero1: dict[int, tuple[float, float]] = field(default_factory=dict)
    """By group size k: (latency seconds, bandwidth in bytes of the parameters per second) of ZeRO-1's sharing of
    the stepped parameters among k copies after the step, a flat broadcast from each copy of what it stepped, as
    the runtime runs it (:func:`pipefold.runtime.measure.profiling.measure_zero1`). Empty in a profile from before it
    was measured: half an all-reduce."""
    fsdp_passes: tuple[tuple[float, float], ...] = ()
    """What FSDP's hooks add to each pass of a sharded stage: for F, B, W and fused BW, (seconds once per pass,
    seconds per FSDP unit) (:func:`pipefold.runtime.measure.profiling.measure_fsdp`). Empty in a profile from before it
    was measured: nothing."""
    tied: tuple[tuple[int, ...], ...] = ()
    """Layers that share a weight (the model's ``Model.tied``, by layer index): the devices holding them sum its
    gradient rank by rank, so a plan gives them one tensor-parallel degree, and under FSDP one stage
    (:func:`pipefold.plan.budget.refused_layout`)."""

    def ranks_measuring(self, tp: int | None = None) -> int:
        """How many ranks computed at once while the layers of degree ``tp`` (default: ``layers``'s) were timed."""
        t = self.tp if tp is None else tp
        return self.tp_ranks.get(t, t)

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """Every tensor-parallel degree this profile measured, in order."""
        return tuple(sorted({self.tp, *self.tp_layers}))

    def at_tp(self, tp: int) -> Profile:
        """This profile with the layers measured at ``tp`` tensor-parallel ranks; one line where it has none."""
        if tp == self.tp:
            return self
        if tp not in self.tp_layers:
            have = ", ".join(map(str, self.tp_degrees))
            raise ConfigError(f"the profile measured the layers at tensor-parallel degrees {have}, not {tp}: "
                              f"profile again with --tp {','.join(map(str, sorted({*self.tp_degrees, tp})))}")
        others = {t: layers for t, layers in {self.tp: self.layers, **self.tp_layers}.items() if t != tp}
        ranks = {t: n for t, n in {self.tp: self.ranks_measuring(), **self.tp_ranks}.items() if t != tp}
        return dataclasses.replace(self, layers=self.tp_layers[tp], tp=tp, tp_layers=others,
                                   tp_ranks={**ranks, tp: self.ranks_measuring(tp)})

    @property
    def microbatch_rows(self) -> int:
        return int(self.train["batch"]) // int(self.train["microbatches"])

    def static(self, layer: int) -> int:
        """Bytes a layer holds whatever the schedule: weights, gradients, optimizer state."""
        return int(self.layers[layer].params * (2 + self.optimizer_factor))

    def to_dict(self) -> dict[str, Any]:
        return {"version": VERSION, "train": dict(self.train), "layers": [asdict(x) for x in self.layers],
                "link": {"latency": self.latency, "bandwidth": self.bandwidth},
                "contention": list(self.contention), "optimizer_factor": self.optimizer_factor,
                "message_overhead": self.message_overhead, "pass_fixed": list(self.pass_fixed),
                "machine": dict(self.machine), "tp": self.tp,
                "tp_layers": {str(t): [asdict(x) for x in layers] for t, layers in sorted(self.tp_layers.items())},
                "tp_ranks": {str(t): n for t, n in sorted(self.tp_ranks.items())},
                "allreduce": {str(k): list(fit) for k, fit in sorted(self.allreduce.items())},
                "fsdp": {str(k): [list(gather), list(scatter)] for k, (gather, scatter) in sorted(self.fsdp.items())},
                "fsdp_passes": [list(fit) for fit in self.fsdp_passes], "fsdp_update": self.fsdp_update,
                "zero1": {str(k): list(fit) for k, fit in sorted(self.zero1.items())},
                "tied": [list(group) for group in self.tied]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "the profile") -> Profile:
        """Read :meth:`to_dict`'s form; anything else is one ConfigError naming what is wrong."""
        try:
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ConfigError(f"{where} is not a pipefold profile (version {VERSION}): "
                                  f"make one with pipefold profile -o FILE")
            layers = _layers(data["layers"])
            tp_layers = {int(t): _layers(rows) for t, rows in data.get("tp_layers", {}).items()}
            link = data["link"]
            out = cls(train=dict(data["train"]), layers=layers, latency=float(link["latency"]),
                      bandwidth=float(link["bandwidth"]), contention=tuple(float(x) for x in data["contention"]),
                      optimizer_factor=float(data["optimizer_factor"]), machine=dict(data.get("machine", {})),
                      message_overhead=float(data.get("message_overhead", 0.0)),
                      pass_fixed=_fixed(data.get("pass_fixed", (0.0,) * 4)), tp=int(data.get("tp", 1)),
                      tp_layers=tp_layers,
                      tp_ranks={int(t): int(n) for t, n in data.get("tp_ranks", {}).items()},
                      allreduce={int(k): (float(lat), float(bw))
                                 for k, (lat, bw) in data.get("allreduce", {}).items()},
                      fsdp={int(k): ((float(g[0]), float(g[1])), (float(r[0]), float(r[1])))
                            for k, (g, r) in data.get("fsdp", {}).items()},
                      fsdp_passes=tuple((float(once), float(unit)) for once, unit in data.get("fsdp_passes", ())),
                      fsdp_update=float(data.get("fsdp_update", 0.0)),
                      zero1={int(k): (float(lat), float(bw)) for k, (lat, bw) in data.get("zero1", {}).items()},
                      tied=tuple(tuple(int(i) for i in group) for group in data.get("tied", ())))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{where} is not a valid pipefold profile ({type(exc).__name__}: {exc}); "
                              f"make one with pipefold profile -o FILE") from None
        out.check(where)
        return out

    def check(self, where: str = "the profile") -> None:
        if not self.layers:
            raise ConfigError(f"{where} has no layers")
        if self.tp < 1 or any(t < 1 or len(layers) != len(self.layers) for t, layers in self.tp_layers.items()):
            raise ConfigError(f"{where}: each tensor-parallel degree is >= 1 and measures every layer "
                              f"({len(self.layers)})")
        if not all(fits_hold(k, (fit,)) for k, fit in self.allreduce.items()):
            raise ConfigError(f"{where}: an all-reduce fit is a group of >= 2 ranks, latency >= 0 and bandwidth > 0 "
                              f"(got {self.allreduce})")
        if not (math.isfinite(self.fsdp_update) and self.fsdp_update >= 0):
            raise ConfigError(f"{where}: fsdp_update is seconds per tensor >= 0 (got {self.fsdp_update})")
        if not all(fits_hold(k, (fit,)) for k, fit in self.zero1.items()):
            raise ConfigError(f"{where}: a ZeRO-1 fit is a group of >= 2 ranks, latency >= 0 and bandwidth > 0 "
                              f"(got {self.zero1})")
        if not all(fits_hold(k, fits) for k, fits in self.fsdp.items()):
            raise ConfigError(f"{where}: an FSDP fit is a group of >= 2 ranks, each of its gather and reduce-scatter "
                              f"with latency >= 0 and bandwidth > 0 (got {self.fsdp})")
        if self.fsdp_passes and (len(self.fsdp_passes) != 4 or not all(
                math.isfinite(x) and x >= 0 for fit in self.fsdp_passes for x in fit)):
            raise ConfigError(f"{where}: fsdp_passes is F, B, W and BW, each (seconds once, seconds per unit) >= 0 "
                              f"(got {[list(fit) for fit in self.fsdp_passes]})")
        if any(len(group) < 2 or not all(0 <= i < len(self.layers) for i in group) for group in self.tied):
            raise ConfigError(f"{where}: each group of tied layers names two or more of its {len(self.layers)} "
                              f"layers (got {[list(g) for g in self.tied]})")
        if any(n < t for t, n in self.tp_ranks.items()):
            raise ConfigError(f"{where}: a degree's layers were measured by at least that many ranks "
                              f"(tp_ranks {self.tp_ranks})")
        for t, layers in {self.tp: self.layers, **self.tp_layers}.items():
            for i, x in enumerate(layers):
                values = (x.f, x.b, x.w, x.fused, x.held, x.held_w, x.params, x.out, x.nodes, x.w_depth, x.update)
                if not all(math.isfinite(v) and v >= 0 for v in values):
                    raise ConfigError(f"{where}: layer {i} (tp {t}) has a negative or non-finite figure: {x}")
                if x.tensors and (sum(x.tensors) != x.params or min(x.tensors) < 0):
                    raise ConfigError(f"{where}: layer {i} (tp {t})'s tensors are bytes >= 0 that sum to its "
                                      f"{x.params} parameter bytes (got {list(x.tensors)})")
        if not (math.isfinite(self.latency) and self.latency >= 0 and self.bandwidth > 0):
            raise ConfigError(f"{where}: the link needs latency >= 0 and bandwidth > 0 "
                              f"(got {self.latency}, {self.bandwidth})")
        if len(self.pass_fixed) != 4 or not all(math.isfinite(x) and x >= 0 for x in self.pass_fixed):
            raise ConfigError(f"{where}: pass_fixed is F, B, W and BW seconds >= 0 (got {self.pass_fixed})")
        if not (math.isfinite(self.message_overhead) and self.message_overhead >= 0):
            raise ConfigError(f"{where}: the runtime's overhead per message must be seconds >= 0 "
                              f"(got {self.message_overhead})")
        if not self.contention or not all(math.isfinite(c) and c > 0 for c in self.contention):
            raise ConfigError(f"{where}: contention factors must be positive numbers (got {self.contention})")
        for key in ("model", "batch", "microbatches"):
            if key not in self.train:
                raise ConfigError(f"{where} does not say its model's {key}")

    def save(self, path: str) -> None:
        from pipefold.files import write_json

        write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str) -> Profile:
        from pipefold.files import read_json

        return cls.from_dict(read_json(path, "profile", "give a file written by pipefold profile -o"), path)


def _layers(rows: Any) -> tuple[LayerProfile, ...]:
    return tuple(LayerProfile(f=float(row["f"]), b=float(row["b"]), w=float(row["w"]), held=int(row["held"]),
                              held_w=int(row["held_w"]), params=int(row["params"]), out=int(row["out"]),
                              bw=None if row.get("bw") is None else float(row["bw"]),
                              nodes=int(row.get("nodes", 0)), w_depth=float(row.get("w_depth", 0.0)),
                              collectives=int(row.get("collectives", 0)),
                              tensors=tuple(int(x) for x in row.get("tensors", ())),
                              update=float(row.get("update", 0.0)))
                 for row in rows)


def _fixed(values: Any) -> tuple[float, float, float, float]:
    """``pass_fixed`` as a file holds it: F, B, W and BW; a file from before W's was measured holds F, B and BW."""
    row = [float(x) for x in values]
    if len(row) == 3:
        row.insert(2, 0.0)
    f, b, w, bw = row  # a ValueError where there are not four: the profile is not valid
    return f, b, w, bw


def stage_passes(layers: Sequence[LayerProfile], fixed: Sequence[float] = (0.0,) * 4,
                 ) -> tuple[float, float, float, float]:
    """A stage's F, B, W and fused BW seconds (:data:`PASSES`) from its layers': their sums, each W longer by its
    ``w_depth`` for every autograd node of the layers before it in the stage (the graph its weight gradients'
    restarts of the engine walk), less ``len(layers) - 1`` times ``fixed`` (what each layer timed alone paid
    that the stage pays once: :attr:`Profile.pass_fixed`); never less than its slowest layer's."""
    below = list(itertools.accumulate((x.nodes for x in layers), initial=0))
    out = []
    for kind, fix in zip(PASSES, fixed, strict=True):
        each = [getattr(x, kind) + (x.w_depth * n if kind == "w" else 0.0) for x, n in zip(layers, below, strict=False)]
        out.append(max(sum(each) - (len(each) - 1) * fix, max(each)))
    f, b, w, bw = out
    return f, b, w, bw


def pass_fixed_of(layers: Sequence[LayerProfile], stages: Sequence[tuple[Sequence[int], Sequence[float]]],
                  ) -> tuple[float, float, float, float]:
    """What a stage pays once of each pass that each of its layers, timed alone, paid again (the runner's own work
    per pass: the engine's start, the cut, the hooks, the bookkeeping), from stages timed whole: ``stages`` are
    (the layers' indices, the stage's own F, B, W and BW seconds). For each stage of two layers or more, its
    layers' sums (:func:`stage_passes` with nothing fixed) less its own time, over ``n - 1``; the median over
    those stages, at least 0; 0 where no stage has two layers."""
    each = []
    for part, timed in stages:
        if len(part) > 1:
            summed = stage_passes([layers[i] for i in part])
            each.append([(a - t) / (len(part) - 1) for a, t in zip(summed, timed, strict=True)])
    if not each:
        return 0.0, 0.0, 0.0, 0.0
    f, b, w, bw = (max(0.0, statistics.median(col)) for col in zip(*each, strict=True))
    return f, b, w, bw


def fit_link(one_way: dict[int, float]) -> tuple[float, float]:
    """Fit of seconds = latency + bytes / bandwidth by least squares of the relative error, so that each size
    counts alike: with plain least squares the largest size's noise (a few percent of milliseconds) outweighs
    the smallest size's whole time (tens of microseconds), and the latency came out 0 or below. Latency
    floored at 0; a time that does not grow with size is all latency."""
    sizes = [s for s in one_way if one_way[s] > 0]
    if not sizes:
        return 0.0, math.inf
    xs, ys = [float(s) for s in sizes], [one_way[s] for s in sizes]
    ws = [1.0 / (y * y) for y in ys]
    total = math.fsum(ws)
    mx = math.fsum(w * x for w, x in zip(ws, xs, strict=True)) / total
    my = math.fsum(w * y for w, y in zip(ws, ys, strict=True)) / total
    var = math.fsum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    cov = math.fsum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True))
    slope = cov / var if var else 0.0
    if slope <= 0:
        return my, math.inf
    return max(my - slope * mx, 0.0), 1.0 / slope



"""The memory-budget planner: the fastest registered schedule whose peak activation memory fits a budget."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipefold import schedules
from pipefold.errors import ConfigError, ScheduleError
from pipefold.ir import MAX_DEVICES, VOCAB, Schedule
from pipefold.ir.ref import ScheduleRef
from pipefold.plan.cluster_plan import SHARDING
from pipefold.plan.limits import MAX_SEARCH_WORK, check_search, largest, schedule_work, stages_of
from pipefold.plan.profile import LayerProfile, Profile, stage_passes
from pipefold.plan.recompute import StageProfile, choose_recompute, device_peaks
from pipefold.plan.shares import heaviest_share, shares
from pipefold.sim.simulate import CostModel, SimResult, StageOverride, simulate, slowdown
from pipefold.units import format_bytes

__all__ = ["Layout", "ModelPlan", "ModelPoint", "PlanResult", "Point", "RunPlan", "candidates", "check_evaluate",
           "check_plan", "choose", "copy_peaks", "copy_static", "device_static", "evaluate", "every_layout",
           "frontier", "layout_profile", "model_costs", "one_f_one_b_peak", "parse_budget", "plan", "plan_model",
           "predict", "predicted_passes", "read_plan", "refused_layout", "stage_profiles"]

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` before the first candidate and after each one."""

_TOLERANCE = 1e-9  # a peak this far above the budget still fits: sums of fractions of M pick up float noise
_BUDGET_TEXT = re.compile(r"(?P<number>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>[xXmM]?)")


@dataclass(frozen=True)
class Point:
    """One evaluated candidate: a schedule family, its options, and what the simulator predicts for it."""

    name: str
    options: dict[str, int] = field(hash=False)
    makespan: float
    bubble_ratio: float
    peak_memory: tuple[float, ...]
    """Per device, in units of M."""

    @property
    def memory(self) -> float:
        """The highest peak over devices: what the budget bounds."""
        return max(self.peak_memory)

    @property
    def spec(self) -> str:
        """The ``name:key=value,...`` text that ``pipefold simulate`` accepts."""
        return str(ScheduleRef.named(self.name, self.options))


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer for one budget, with everything it evaluated on the way."""

    best: Point
    """The fastest candidate within the budget."""
    result: SimResult
    """The simulation of ``best``, with its timeline and memory curves."""
    budget: float
    """In units of M."""
    points: tuple[Point, ...]
    """Every candidate that ran, in candidate order."""
    frontier: tuple[Point, ...]
    """The points not dominated in (peak memory, makespan), by increasing memory; ``best`` is one of them."""
    skipped: tuple[str, ...] = ()
    """Specs of candidates that cannot run this shape (ConfigError or ScheduleError)."""

    @property
    def name(self) -> str:
        return self.best.name

    @property
    def options(self) -> dict[str, int]:
        return self.best.options

    @property
    def spec(self) -> str:
        return self.best.spec


def parse_budget(text: str, one_f_one_b_peak: float) -> float:
    """A memory budget in units of M: ``'3'`` (or ``'3M'``) is 3 M, ``'0.5x'`` is half of 1F1B's peak.

    ``one_f_one_b_peak`` is that peak for the shape and cost model at hand
    (p M on device 0 with unit memory; see :func:`one_f_one_b_peak`).
    """
    match = _BUDGET_TEXT.fullmatch(text.strip())
    if match is None:
        raise ConfigError(f"cannot read memory budget {text!r}: use a number of M such as 3, "
                          f"or a multiple of 1F1B's peak such as 0.5x")
    number = float(match["number"])
    budget = number * one_f_one_b_peak if match["unit"] in ("x", "X") else number
    if not (math.isfinite(budget) and budget > 0):
        raise ConfigError(f"memory budget must be a positive amount of M (got {text!r}); e.g. 3 or 0.5x")
    return budget


def one_f_one_b_peak(p: int, m: int, cost: CostModel | None = None) -> float:
    """1F1B's highest peak activation memory over devices: the unit of ``'0.5x'`` budgets."""
    return max(simulate(schedules.build("1f1b", p, m), cost).peak_memory)


def candidates(p: int, m: int, *, vocab: bool = False) -> list[tuple[str, dict[str, int]]]:
    """Every registered family that can run m microbatches on p devices, times its options' search spaces.

    An option whose search space is empty takes its default; one the planner leaves alone (``planned`` False:
    ``seq_chunks``) is not named. With ``vocab`` (the cost model prices the output layer), each family that can
    split the output layer by vocabulary is tried with it too (``vocab=1``). Families are read from the registry on
    every call, so new ones join without changes here.
    """
    out: list[tuple[str, dict[str, int]]] = []
    for spec in schedules.REGISTRY.values():
        if spec.min_microbatches(p) > m:
            continue
        named = [o for o in spec.options if o.planned]
        spaces = [list(o.search(p, m)) or [o.default] for o in named]
        splits = (0, 1) if vocab and spec.option(VOCAB) is not None else (0,)
        for values in itertools.product(*spaces):
            for split in splits:
                options = {o.name: int(v) for o, v in zip(named, values, strict=True)}
                out.append((spec.name, {**options, VOCAB: 1} if split else options))
    return out


def prices_vocab(cost: CostModel | None) -> bool:
    """Whether ``cost`` prices the output layer apart (``--vocab-cost``): then the planner tries it split."""
    return cost is not None and bool(cost.vocab_f or cost.vocab_b or cost.vocab_w or cost.vocab_memory)


def evaluate(p: int, m: int, cost: CostModel | None = None, *, progress: Progress | None = None) -> list[Point]:
    """Build and simulate every candidate; those that cannot run this shape are left out."""
    return _evaluate(p, m, cost, progress)[0]


def choose(points: Sequence[Point], budget: float) -> Point:
    """The point with the smallest makespan whose peak memory fits ``budget``.

    Ties go to lower memory, then to fewer options, the name and the options, so the answer is
    deterministic; a larger budget only adds points, so it never gives a
    larger makespan. A budget below every point raises ConfigError naming the
    smallest reachable peak.
    """
    fits = [pt for pt in points if pt.memory <= budget + _TOLERANCE]
    if not fits:
        raise _too_small(points, budget)
    return min(fits, key=_order)


def frontier(points: Iterable[Point], order: Callable[[Any], tuple[Any, ...]] | None = None) -> list[Any]:
    """Points not dominated in (peak memory, makespan), by increasing memory (and so decreasing makespan).

    Of points with equal memory and makespan only one is kept, the one
    :func:`choose` would pick, so a chosen point is always on the frontier.
    """
    rank = order or _order
    out: list[Point] = []
    for pt in sorted(points, key=lambda q: (q.memory, *rank(q))):
        if not out or pt.makespan < out[-1].makespan:
            out.append(pt)
    return out


def plan(p: int, m: int, budget: float, cost: CostModel | None = None, *,
         progress: Progress | None = None) -> PlanResult:
    """The fastest registered schedule for p devices and m microbatches whose peak memory fits ``budget`` M.

    To try many budgets on one shape, call :func:`evaluate` once and :func:`choose` per budget.
    """
    points, skipped = _evaluate(p, m, cost, progress)
    best = choose(points, budget)
    result = simulate(schedules.build(best.name, p, m, **best.options), cost)
    return PlanResult(best=best, result=result, budget=budget, points=tuple(points),
                      frontier=tuple(frontier(points)), skipped=tuple(skipped))


# --------------------------------------------------------------------------- helpers


def _evaluate(p: int, m: int, cost: CostModel | None, progress: Progress | None) -> tuple[list[Point], list[str]]:
    for label, value in (("devices", p), ("microbatches", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{label} must be a positive integer (got {value!r})")
    vocab = prices_vocab(cost)
    check_evaluate(p, m, vocab=vocab)
    todo = candidates(p, m, vocab=vocab)
    points: list[Point] = []
    skipped: list[str] = []
    if progress is not None:
        progress(0, len(todo))
    for done, (name, options) in enumerate(todo, 1):
        try:
            points.append(_point(name, options, simulate(schedules.build(name, p, m, **options), cost)))
        except (ConfigError, ScheduleError):
            skipped.append(str(ScheduleRef.named(name, options)))
        if progress is not None:
            progress(done, len(todo))
    if not points:
        raise ConfigError(f"no registered schedule runs {m} microbatches on {p} stages "
                          f"({len(skipped)} candidates tried); try more microbatches")
    return points, skipped


def check_evaluate(p: int, m: int, *, vocab: bool = False) -> None:
    """Refuse, before any work, to :func:`evaluate` p devices and m microbatches where the search's work is over
    :data:`pipefold.plan.limits.MAX_SEARCH_WORK`, in one line naming fewer microbatches (else fewer devices)
    that fit."""
    todo = candidates(p, m, vocab=vocab)
    total = sum(schedule_work(name, p, m, options) for name, options in todo)
    if total <= MAX_SEARCH_WORK:
        return

    def fits(devices: int, microbatches: int) -> bool:
        return sum(schedule_work(name, devices, microbatches, options)
                   for name, options in candidates(devices, microbatches, vocab=vocab)) <= MAX_SEARCH_WORK

    fewer = largest(lambda k: fits(p, k), m - 1)
    devices = None if fewer is not None else largest(lambda k: fits(k, m), p - 1)
    fix = (f"use at most {fewer:,} microbatches on {p:,} devices" if fewer is not None else
           f"use at most {devices:,} devices with {m:,} microbatches" if devices is not None else
           "use fewer devices and fewer microbatches")
    check_search(total, len(todo), f"planning {p:,} devices with {m:,} microbatches", fix)


def _point(name: str, options: dict[str, int], result: SimResult) -> Point:
    # Rounded like SimResult.to_dict: float noise must not split ties or order the frontier.
    return Point(name=name, options=options, makespan=round(result.makespan, 9),
                 bubble_ratio=round(result.bubble_ratio, 9),
                 peak_memory=tuple(round(x, 9) for x in result.peak_memory))


def _order(pt: Point) -> tuple[float, float, int, str, tuple[tuple[str, int], ...]]:
    # Among equals, a named schedule (v-min) reads better than the knobs that rebuild it (v-block:...).
    return pt.makespan, pt.memory, len(pt.options), pt.name, tuple(pt.options.items())


def _too_small(points: Sequence[Point], budget: float) -> ConfigError:
    if not points:
        return ConfigError("no schedules to choose from: evaluate found none that runs this shape")
    least = min(points, key=lambda q: (q.memory, *_order(q)))
    return ConfigError(f"no schedule fits {budget:.6g} M on {len(least.peak_memory)} stages; "
                       f"the smallest reachable peak is {least.memory:.6g} M ({least.spec})")


# --------------------------------------------------------------------------- a measured model


@dataclass(frozen=True)
class Layout:
    """How the ranks run one model: ``dp`` copies of a pipeline of ``pp`` devices, each device's layers split over
    ``tp`` ranks (``pipefold train --dp --tp --devices``), or over ``tp[d]`` ranks on device d where the devices
    differ (``--tp 2,1``: a mesh per stage), and what the copies shard among them: nothing, the optimizer state
    (``zero1``, ``--zero1``) or the stages (``fsdp``, ``--fsdp``). Degrees that are all equal are one ``tp``.
    ``chunks``: the optimizer state in model-state chunks (``--state-chunks``), on the device where the step leaves
    room and in host memory otherwise (:mod:`pipefold.plan.chunks`); with plain copies and one degree only."""

    dp: int
    tp: int | tuple[int, ...]
    pp: int
    sharding: str = "none"
    chunks: bool = False

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING or (self.sharding != "none" and self.dp < 2):
            raise ConfigError(f"a layout shards {' or '.join(SHARDING)} among dp >= 2 copies (got "
                              f"{self.sharding!r} with dp {self.dp})")
        if self.chunks and (self.sharding != "none" or isinstance(self.tp, tuple) or self.tp != 1):
            raise ConfigError(f"model-state chunks run with plain copies of plain stages (got {self.sharding} "
                              f"sharding, tp {self.tp})")
        if isinstance(self.tp, tuple):
            if len(self.tp) != self.pp or any(isinstance(t, bool) or not isinstance(t, int) or t < 1
                                              for t in self.tp):
                raise ConfigError(f"a layout gives one tensor-parallel degree >= 1 per pipeline device: {self.pp} "
                                  f"of them (got {self.tp})")
            if len(set(self.tp)) == 1:
                object.__setattr__(self, "tp", self.tp[0])

    @property
    def degrees(self) -> tuple[int, ...]:
        """Each pipeline device's tensor-parallel degree."""
        return self.tp if isinstance(self.tp, tuple) else (self.tp,) * self.pp

    @property
    def mixed(self) -> bool:
        """Whether the devices' degrees differ (a mesh per stage)."""
        return isinstance(self.tp, tuple)

    @property
    def world(self) -> int:
        return self.dp * sum(self.degrees)

    @property
    def tp_text(self) -> str:
        """The degrees as ``--tp`` takes them: ``2``, or ``2,1,1``."""
        return ",".join(map(str, self.tp)) if isinstance(self.tp, tuple) else str(self.tp)

    @property
    def tp_json(self) -> int | list[int]:
        """The degrees as a plan file records them: one number, or a list of one per device."""
        return list(self.tp) if isinstance(self.tp, tuple) else self.tp

    def sort_key(self) -> tuple[Any, ...]:
        return self.pp, max(self.degrees), self.degrees, self.dp, SHARDING.index(self.sharding), self.chunks

    def __str__(self) -> str:
        return (f"dp{self.dp} tp{self.tp_text} pp{self.pp}" + (f" {self.sharding}" if self.sharding != "none" else "")
                + (" chunks" if self.chunks else ""))


def every_layout(profile: Profile, world: int, families: Sequence[str] | None = None) -> list[Layout]:
    """Every layout of ``world`` ranks the profile can predict: tensor-parallel degrees it measured, the same on
    every device or each device its own (a mesh per device, see :func:`_model_points`), and data-parallel
    copies that share its microbatches evenly (each pipeline runs ``microbatches / dp`` of them, of the size the
    profile measured); where there are copies, each way of sharding among them (ZeRO-1 only where the optimizer
    has a state to shard). A pipeline has at most a device per layer (each device holds a stage at least) and
    :data:`pipefold.ir.MAX_DEVICES`.

    The layouts are counted before any is listed (a mesh per device makes every order of the degrees one: they
    run to astronomical numbers), and a world whose search over them (with ``families``, default every one) would
    be over :data:`pipefold.plan.limits.MAX_SEARCH_WORK` is refused in one line naming a world that fits."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"the world is a number of ranks, a whole number >= 1 (got {world!r})")
    groups = _layout_counts(profile, world)
    if not groups:
        raise ConfigError(_no_layout(profile, world))
    pipelines = _Pipelines(len(profile.layers), families)
    layouts, count, total = _world_search(profile, world, pipelines)
    if total > MAX_SEARCH_WORK:
        fits = largest(lambda w: _world_search(profile, w, pipelines)[2] <= MAX_SEARCH_WORK, world - 1)
        fix = (f"search fewer --families, or fewer ranks (a world of {fits:,} fits)" if fits is not None
               else "search fewer --families")
        check_search(total, count, f"planning a world of {world:,} ranks ({layouts:,} layouts)", fix)
    out: list[Layout] = []
    for dp, pp, _ in groups:
        hows = [how for how in _shardings(profile) if how == "none" or dp > 1]
        for degrees in _meshes(profile.tp_degrees, pp, world // dp):
            out.extend(Layout(dp, degrees, pp, how) for how in hows)
    return sorted(out, key=Layout.sort_key)


def _shardings(profile: Profile) -> list[str]:
    """What a world's copies may shard among them: ZeRO-1 only where the optimizer has a state to shard."""
    return [how for how in SHARDING if how != "zero1" or profile.optimizer_factor > 0]


def _most_devices(profile: Profile) -> int:
    """The most devices a pipeline of the profiled model may have: a stage a device at least, a layer a stage."""
    return min(len(profile.layers), MAX_DEVICES)


def _layout_counts(profile: Profile, world: int) -> list[tuple[int, int, float]]:
    """(dp, pp, how many meshes) for every pipeline length ``pp`` and copies ``dp`` that lay out ``world`` ranks:
    ``dp`` divides the world and the microbatches, and that many orders of the measured degrees, one per device,
    make the pipeline's ``world / dp`` ranks (a float: they run past any integer a search could take)."""
    out = []
    for dp in _divisors(math.gcd(world, int(profile.train["microbatches"]))):
        for pp, count in enumerate(_mesh_counts(profile.tp_degrees, world // dp, _most_devices(profile))):
            if count > 0:
                out.append((dp, pp, count))
    return out


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _mesh_counts(degrees: Sequence[int], ranks: int, most: int) -> list[float]:
    """``out[pp]``: how many sequences of ``pp`` of ``degrees`` (repeats allowed) sum to ``ranks``, for pp up to
    ``most``; as floats, capped far above any count a search could take."""
    top = max(degrees) * most
    if ranks > top:
        return []
    ways = np.zeros(ranks + 1)
    ways[0] = 1.0
    out = [0.0]
    for _ in range(min(most, ranks // min(degrees))):
        longer = np.zeros(ranks + 1)
        for t in degrees:
            if t <= ranks:
                longer[t:] += ways[:ranks + 1 - t]
        ways = np.minimum(longer, 1e100)
        out.append(float(ways[ranks]))
    return out


def _meshes(degrees: Sequence[int], pp: int, ranks: int) -> Iterable[tuple[int, ...]]:
    """Every sequence of ``pp`` of ``degrees`` that sums to ``ranks``: only those, each once (depth first, a
    degree tried where the devices left can still make the ranks left)."""
    reach = [{0}]  # reach[k]: the sums k degrees make
    for _ in range(pp):
        reach.append({r + t for r in reach[-1] for t in degrees if r + t <= ranks})

    def walk(left: int, rest: int) -> Iterable[tuple[int, ...]]:
        if left == 0:
            yield ()
            return
        for t in degrees:
            if rest - t in reach[left - 1]:
                for tail in walk(left - 1, rest - t):
                    yield (t, *tail)

    yield from walk(pp, ranks)


def _world_search(profile: Profile, world: int, pipelines: _Pipelines) -> tuple[int, int, int]:
    """(layouts, candidates, work) of :func:`plan_model` over every layout of ``world`` ranks
    (:func:`every_layout`), counted without listing them: a layout's are its pipeline's (:meth:`_Pipelines.search`)."""
    m = int(profile.train["microbatches"])
    layouts = count = total = 0.0
    for dp, pp, meshes in _layout_counts(profile, world):
        copies = meshes * sum(1 for how in _shardings(profile) if how == "none" or dp > 1)
        layouts += copies
        count += copies * pipelines.search(pp, m // dp)[0]
        total += copies * pipelines.search(pp, m // dp)[1]
    return int(min(layouts, 1e18)), int(min(count, 1e18)), int(min(total, 1e18))


class _Pipelines:
    """The candidates of the pipelines one search tries (of ``families``, default every one, on a model of
    ``layers`` layers), and what searching each costs, worked out once a shape: a world's layouts share a few."""

    def __init__(self, layers: int, families: Sequence[str] | None) -> None:
        self.layers, self.families = layers, None if families is None else frozenset(families)
        self._candidates: dict[tuple[int, int], tuple[tuple[str, dict[str, int]], ...]] = {}
        self._searches: dict[tuple[int, int], tuple[int, int]] = {}

    def candidates(self, pp: int, m: int) -> tuple[tuple[str, dict[str, int]], ...]:
        """:func:`candidates` of ``families`` for pp devices and m microbatches (their options not to be changed)."""
        if (pp, m) not in self._candidates:
            self._candidates[pp, m] = tuple((name, options) for name, options in candidates(pp, m)
                                            if self.families is None or name in self.families)
        return self._candidates[pp, m]

    def search(self, pp: int, m: int) -> tuple[int, int]:
        """(candidates, work) of searching one pipeline of ``pp`` devices and ``m`` microbatches: the candidates
        that can run it (:meth:`runs`) and their work (:func:`pipefold.plan.limits.schedule_work`)."""
        if (pp, m) not in self._searches:
            works = [schedule_work(name, pp, m, options) for name, options in self.candidates(pp, m)
                     if self.runs(name, pp, m, options)]
            self._searches[pp, m] = (len(works), sum(works))
        return self._searches[pp, m]

    def runs(self, name: str, pp: int, m: int, options: dict[str, int]) -> bool:
        """Whether ``name`` with ``options`` may run m microbatches on pp devices, as far as is known before
        building it: within the IR's limits, and a layer a stage at least."""
        return stages_of(name, pp, options) <= self.layers and schedule_work(name, pp, m, options) > 0


def _no_layout(profile: Profile, world: int) -> str:
    """Why no layout of ``world`` ranks fits the profile, and the nearest smaller world that has one."""
    m, most, degrees = int(profile.train["microbatches"]), _most_devices(profile), profile.tp_degrees
    sums = np.zeros(max(degrees) * most + 1, dtype=bool)  # the ranks k devices make, k = 1, 2, ...
    sums[0] = True
    ranks = np.zeros_like(sums)  # ... and 1..most devices
    for _ in range(most):
        longer = np.zeros_like(sums)
        for t in degrees:
            longer[t:] |= sums[:len(sums) - t]
        sums = longer
        ranks |= sums
    nearest = max((dp * int(r) for dp in _divisors(m) for r in np.flatnonzero(ranks) if dp * r < world), default=0)
    limit = f", pipefold's limit {MAX_DEVICES}" if most == MAX_DEVICES else ""
    return (f"no layout of {world:,} ranks fits this profile: a pipeline has at most {most:,} devices (a layer a "
            f"stage at least{limit}) of tensor-parallel degree {', '.join(map(str, degrees))}, and each of dp copies "
            f"runs {m} / dp of the profile's microbatches: "
            + (f"the nearest world that has a layout is {nearest:,} ranks" if nearest else "give fewer ranks")
            + " (profile with --tp or more --microbatches for others)")


def layout_profile(profile: Profile, layout: Layout, layer_stages: Sequence[Sequence[int]] | None = None,
                   placement: Sequence[int] | None = None) -> Profile:
    """What one pipeline of ``layout`` sees of the profile: the layers at its tensor-parallel degree, and how its
    devices share the machine. Each device stands for ``dp * tp`` ranks that compute in step (the tp ranks wait for
    each other in every layer, the copies run the same schedule), and the layers were timed with
    ``profile.ranks_measuring(tp)`` ranks computing at once; so k devices computing run
    ``slowdown(k * dp * tp) / slowdown(ranks measuring)`` times longer (less than 1 where fewer compute).

    Where the devices' degrees differ, each layer has the figures of its device's degree (``layer_stages`` split
    among the devices by ``placement``, a device per stage), its times taken back to the ranks measuring at the
    first device's degree; k devices computing stand for k times the pipeline's mean ranks per device.

    What a rank holds of each parameter, in parameter sizes ``2 + optimizer_factor``: its weight and gradient
    and the optimizer state (f); with ZeRO-1, f / dp of the state; with FSDP, (2 + f) / dp of the shards and the
    weight and gradient gathered whole (2), which a stage holds from its ``AG`` to its ``RS``: the whole step but
    its ends, counted throughout. With model-state chunks none of the state: it goes where the step leaves room
    (:func:`chunk_state`)."""
    first = layout.degrees[0]
    at = profile.at_tp(first)
    f = at.optimizer_factor
    factor = 0.0 if layout.chunks else {"none": f, "zero1": f / layout.dp, "fsdp": (2 + f) / layout.dp}[
        layout.sharding]
    at = dataclasses.replace(at, optimizer_factor=factor)
    c, base = profile.contention, slowdown(profile.contention, profile.ranks_measuring(first))
    if layout.mixed:
        if layer_stages is None or placement is None:
            raise ConfigError(f"the layout {layout} gives its devices different degrees: say which layers each holds")
        layers = list(at.layers)
        at_degree = {t: profile.at_tp(t).layers for t in set(layout.degrees)}
        for stage, part in enumerate(layer_stages):
            t = layout.degrees[placement[stage]]
            rescale = _measured_alike(profile, first, t)
            for i in part:
                layers[i] = at_degree[t][i].timed_by(rescale)  # every time, its update's too
        at = dataclasses.replace(at, layers=tuple(layers))
    mean = layout.dp * sum(layout.degrees) / layout.pp
    sharing = tuple(slowdown(c, math.ceil(k * mean - 1e-9)) / base for k in range(1, layout.pp + 1))
    return dataclasses.replace(at, contention=sharing)


def _measured_alike(profile: Profile, first: int, t: int) -> float:
    """What takes a layer's times at degree ``t`` to those it would have had with as many ranks computing as the
    layers of degree ``first`` were timed with."""
    c = profile.contention
    return slowdown(c, profile.ranks_measuring(first)) / slowdown(c, profile.ranks_measuring(t))


@dataclass(frozen=True)
class ModelPoint(Point):
    """A candidate for a measured model: schedule and options, how its layers split into stages, how many of each
    stage's first layers recompute; ``makespan`` in seconds per step, ``peak_memory`` in bytes per device."""

    split: str = "time"
    """How the layers were split: ``time`` (balanced busiest device) or ``memory`` (least peak, time within 2%)."""
    layer_stages: tuple[tuple[int, ...], ...] = field(default=(), hash=False)
    recompute: tuple[int, ...] = field(default=(), hash=False)
    static_bytes: tuple[int, ...] = field(default=(), hash=False)
    """Per device: weights, gradients and optimizer state (part of ``peak_memory``)."""
    layout: Layout = field(default_factory=lambda: Layout(1, 1, 1))
    """How the ranks are laid out: data-parallel pipelines, tensor-parallel ranks per stage, stages' devices."""

    @property
    def where(self) -> str:
        """The layout and the schedule, as a table shows them: 'dp2 tp1 pp2 1f1b'."""
        return f"{self.layout} {self.spec}"


@dataclass(frozen=True)
class ModelPlan:
    """The planner's answer for a measured model and a budget in bytes per device."""

    best: ModelPoint
    result: SimResult
    """The simulation of ``best`` in seconds and bytes (activations; ``best.peak_memory`` adds the rest)."""
    budget: float
    points: tuple[ModelPoint, ...]
    frontier: tuple[ModelPoint, ...]
    skipped: tuple[str, ...]
    profile: Profile
    room: float = math.inf
    """The most a plan's predicted peak may be: the budget less the headroom."""
    unrunnable: int = 0
    """Candidates left out unbuilt, besides ``skipped``: more stages than the model has layers, or over the IR's
    limits (counted, not listed: a world has thousands)."""

    @property
    def run_plan(self) -> RunPlan:
        """What ``pipefold train`` runs of this answer: the best point and its prediction."""
        b = self.best
        s = self.result.schedule
        return RunPlan(schedule=b.spec, devices=s.devices, microbatches=s.microbatches, dp=b.layout.dp,
                       tp=b.layout.tp, sharding=b.layout.sharding, chunks=b.layout.chunks, split=b.split,
                       layer_stages=b.layer_stages, recompute=b.recompute, budget=self.budget, room=self.room,
                       train=dict(self.profile.train), step_time=b.makespan, bubble_ratio=b.bubble_ratio,
                       peak_bytes=tuple(int(x) for x in b.peak_memory), static_bytes=tuple(b.static_bytes),
                       profile=self.profile)

    def to_dict(self) -> dict[str, Any]:
        """The plan file ``pipefold train --plan`` runs: what to run, and what it is predicted to do; with the
        frontier and the count of candidates, for people."""
        return {**self.run_plan.to_dict(),
                "frontier": [{"schedule": q.spec, "dp": q.layout.dp, "tp": q.layout.tp_json,
                              "sharding": q.layout.sharding, "state_chunks": q.layout.chunks, "devices": q.layout.pp,
                              "split": q.split, "recompute": list(q.recompute),
                              "step_time_s": q.makespan, "peak_bytes": int(q.memory)} for q in self.frontier],
                "candidates": len(self.points), "skipped": len(self.skipped) + self.unrunnable}


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """A plan to run: the schedule, the split of the layers and the recomputation chosen for a profiled model, and
    what they are predicted to do. In memory from the planner (:attr:`ModelPlan.run_plan`), or read from a plan
    file (:meth:`from_dict` of :func:`read_plan`'s checked contents)."""

    schedule: str
    """The schedule with its options (``name:k=v``)."""
    devices: int
    """Devices of one pipeline."""
    microbatches: int
    """Microbatches of one pipeline per step."""
    dp: int = 1
    """Data-parallel copies of the pipeline."""
    tp: int | tuple[int, ...] = 1
    """Tensor-parallel ranks each device's layers are split over, or device d's (``tp[d]``) where they differ."""
    sharding: str = "none"
    """What the copies shard among them: ``none``, ``zero1`` (``--zero1``) or ``fsdp`` (``--fsdp``)."""
    chunks: bool = False
    """The optimizer state in model-state chunks (``--state-chunks``), filling ``room`` on each device."""
    split: str
    """How the layers were split: ``time`` or ``memory``."""
    layer_stages: tuple[tuple[int, ...], ...]
    recompute: tuple[int, ...]
    """Per stage, how many of its first layers recompute."""
    budget: float | None
    room: float | None
    train: dict[str, Any]
    """The model and its size, as ``pipefold train`` takes them (the profile's)."""
    step_time: float
    """Predicted seconds per step."""
    bubble_ratio: float
    peak_bytes: tuple[int, ...]
    """Predicted peak per device: weights, gradients, optimizer state, activations and buffers."""
    static_bytes: tuple[int, ...]
    profile: Profile

    @property
    def layout(self) -> Layout:
        """How the plan lays its ranks out: what :func:`predict` takes."""
        return Layout(self.dp, self.tp, self.devices, self.sharding, self.chunks)

    def to_dict(self) -> dict[str, Any]:
        return {"version": PLAN_VERSION, "kind": "pipefold-plan", "schedule": self.schedule, "devices": self.devices,
                "microbatches": self.microbatches, "dp": self.dp, "tp": self.layout.tp_json,
                "sharding": self.sharding, "state_chunks": self.chunks,
                "split": self.split,
                "layer_stages": [list(x) for x in self.layer_stages], "recompute": list(self.recompute),
                "budget_bytes": self.budget, "room_bytes": self.room, "train": dict(self.train),
                "predicted": {"step_time_s": self.step_time, "bubble_ratio": self.bubble_ratio,
                              "peak_bytes": list(self.peak_bytes), "static_bytes": list(self.static_bytes)},
                "profile": self.profile.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunPlan:
        """The plan in ``data``, as :func:`read_plan` returns a file's checked contents."""
        predicted = data["predicted"]
        return cls(schedule=str(data["schedule"]), devices=int(data["devices"]),
                   microbatches=int(data["microbatches"]), dp=int(data.get("dp", 1)), tp=_degrees(data.get("tp", 1)),
                   sharding=str(data.get("sharding", "none")), chunks=bool(data.get("state_chunks", False)),
                   split=str(data.get("split", "time")),
                   layer_stages=tuple(tuple(int(i) for i in part) for part in data["layer_stages"]),
                   recompute=tuple(int(r) for r in data["recompute"]), budget=data.get("budget_bytes"),
                   room=data.get("room_bytes"), train=dict(data["train"]),
                   step_time=float(predicted["step_time_s"]), bubble_ratio=float(predicted.get("bubble_ratio", 0.0)),
                   peak_bytes=tuple(int(x) for x in predicted.get("peak_bytes", ())),
                   static_bytes=tuple(int(x) for x in predicted.get("static_bytes", ())),
                   profile=Profile.from_dict(data["profile"]))


PLAN_VERSION = 1
HEADROOM = 0.05
"""The fraction of a budget a plan leaves free by default: the memory prediction's measured error."""


def model_costs(profile: Profile, schedule: Schedule, layer_stages: Sequence[Sequence[int]],
                recompute: Sequence[int] | None = None, layout: Layout | None = None) -> CostModel:
    """The cost model of ``schedule`` running ``layer_stages`` of the profiled model: per stage the sums of its
    layers' measured seconds and bytes, the measured link, how the ranks share the machine and the runtime's own
    work per message. With the ``layout``'s dp copies of the pipeline, each stage's gradients all-reduced among
    them over the link (its ``DP`` actions, :func:`pipefold.schedules.dataparallel.with_data_parallel`), with
    ZeRO-1 each device's parameters sent among them after the step (as an all-gather: each copy receives the
    others' shares), with FSDP each stage's parameters all-gathered (``AG``) and gradients reduce-scattered
    (``RS``) instead, one collective per layer with parameters; with its tp ranks per device, each message
    crosses in tp pieces that the receiving ranks all-gather."""
    layout = layout or Layout(1, 1, schedule.devices)
    rows = stage_profiles(profile, layer_stages)
    counts = recompute or (0,) * len(rows)
    # FSDP makes each layer with parameters a unit of its own: one gather and one reduce-scatter each, and its
    # hooks in each pass (once per pass, and per unit).
    units = [max(1, sum(1 for i in part if profile.layers[i].params > 0)) for part in layer_stages]
    hooks = profile.fsdp_passes if layout.sharding == "fsdp" else ()
    over = {}
    for s, (p, r) in enumerate(zip(rows, counts, strict=True)):
        extra = [once + units[s] * unit for once, unit in hooks] or [0.0] * 4  # F, B, W, BW
        rerun = p.rerun[r]
        if hooks and r:  # the recomputed forwards call the first r layers' hooks again
            rerun += hooks[0][0] + hooks[0][1] * sum(1 for i in layer_stages[s][:r] if profile.layers[i].params > 0)
        over[s] = StageOverride(f=p.times[0] + extra[0], b=p.times[1] + extra[1], w=p.times[2] + extra[2],
                                bw=None if p.fused_time is None else p.fused_time + extra[3],
                                memory=float(p.total[r]), kept=float(p.kept[r]), memory_w=float(p.held_w[r]),
                                recompute=rerun, collectives=units[s])
    message = max((p.message for p in rows[:-1]), default=0)
    params = sum(x.params for x in profile.layers)
    cost = CostModel(stage_overrides=over, latency=profile.latency, bandwidth=profile.bandwidth,
                     activation_bytes=float(message), grad_bytes=params / schedule.devices,
                     contention=profile.contention[:schedule.devices], message_overhead=profile.message_overhead,
                     dp=layout.dp, allreduce_fits=profile.allreduce, sharded_fits=profile.fsdp,
                     mesh=layout.tp)  # a mesh per device if mixed
    held = [[profile.layers[i] for s in schedule.stages_of(d) for i in layer_stages[s]]
            for d in range(schedule.devices)]
    return dataclasses.replace(cost, after_step=after_schedule(profile, layout, cost, held))


_CHECK_BYTES = 32
"""The gradients' check all-reduces four float64s over every rank (:func:`pipefold.runtime.numerics.local_check`)."""


def after_schedule(profile: Profile, layout: Layout, cost: CostModel, held: Sequence[Sequence[LayerProfile]]) -> float:
    """Seconds a step takes after its schedule, the devices holding ``held``. Where the profile measured the
    layers' update (``LayerProfile.update``): the gradients' check (an all-reduce over every rank) and the
    slowest device's update of its layers: all of them, with ZeRO-1 its heaviest copy's share (in bytes), with
    FSDP its shards (1/dp, and what DTensors add per tensor: ``Profile.fsdp_update``). Every rank updates at
    once, so where they share cores each update is as much longer as a pass with every device computing
    (``profile.contention``, the layout's). With ZeRO-1, the copies' sharing of what each stepped
    (:func:`zero1_sharing`) comes on top."""
    measured = any(x.update for x in profile.layers)
    sharing = slowdown(profile.contention, len(held))
    updates = []
    for layers in held:
        seconds = sum(x.update for x in layers) if measured else 0.0
        if measured and layout.sharding == "fsdp":  # its shards, each tensor a DTensor
            tensors = sum(len(x.tensors) or int(x.params > 0) for x in layers)
            seconds = seconds / layout.dp + profile.fsdp_update * tensors
        elif layout.sharding == "zero1" and seconds:
            sizes = [t for x in layers for t in (x.tensors or (x.params,))]
            seconds *= heaviest_share(sizes, layout.dp) / max(1, sum(sizes))
        seconds *= sharing
        if layout.sharding == "zero1":
            seconds += zero1_sharing(profile, layout, cost, layers)
        updates.append(seconds)
    check = cost.allreduce_time(_CHECK_BYTES, layout.dp * sum(layout.degrees)) if measured else 0.0
    return check + max(updates, default=0.0)


def zero1_sharing(profile: Profile, layout: Layout, cost: CostModel, layers: Sequence[LayerProfile]) -> float:
    """Seconds ZeRO-1's copies of a device holding ``layers`` take after the step to share the parameters each
    stepped: the profile's fit of it as the runtime runs it (a latency and the bytes over a bandwidth) where it
    has one for ``layout.dp`` copies, else an all-gather of the bytes (half the all-reduce)."""
    nbytes = sum(x.params for x in layers)
    if layout.dp not in profile.zero1:
        return cost.gather_time(nbytes, layout.dp)
    latency, bandwidth = profile.zero1[layout.dp]
    return latency + nbytes / bandwidth


def stage_profiles(profile: Profile, layer_stages: Sequence[Sequence[int]]) -> list[StageProfile]:
    """Each stage's figures from its layers': times and bytes add up; recomputing the first r layers keeps the
    stage's input and the other layers' activations, and reruns the first r forwards in the backward.

    A stage that sends on also keeps its output from F until its backward starts from it (a layer's own
    figures leave it out: inside a stage the next layer holds it), and while its backward runs it holds the
    gradient of that output too, which the next stage sent back; measured stages agree to the byte with these
    sums for every r, and with a fused backward's peak (tests/test_plan_model.py)."""
    out = []
    L = profile.layers
    last = len(layer_stages) - 1
    for s, part in enumerate(layer_stages):
        mine = [L[i] for i in part]
        into = L[part[0] - 1].out if part[0] > 0 else 0  # the first stage's input is the batch: not counted
        sent = mine[-1].out if s < last else 0
        held = sum(x.held for x in mine) + sent
        kept = tuple(sum(x.held for x in mine[r:]) + sent + (into if r else 0) for r in range(len(mine) + 1))
        rerun = tuple(itertools.accumulate((x.f for x in mine), initial=0.0))
        f, b, w, bw = stage_passes(mine, profile.pass_fixed)
        out.append(StageProfile(layers=len(mine), kept=kept, total=(held + sent,) * (len(mine) + 1),
                                held_w=(sum(x.held_w for x in mine),) * (len(mine) + 1), rerun=rerun,
                                times=(f, b, w), static=sum(profile.static(i) for i in part),
                                message=0 if s == last else mine[-1].out, fused_time=bw))
    return out


def plan_model(profile: Profile, p: int, budget: float, *, microbatches: int | None = None,
               families: Sequence[str] | None = None, headroom: float = HEADROOM,
               layouts: Sequence[Layout] | None = None, progress: Progress | None = None,
               chunks: bool = False) -> ModelPlan:
    """The fastest plan for the profiled model on p devices whose predicted per-device peak fits ``budget`` bytes.

    Searched together: every layout (``layouts``, each of p ranks: :func:`every_layout`; default one pipeline of
    p devices), every registered schedule family and option (or ``families``), the split of layers into its
    stages (balanced by time, and the least-memory split whose time is within 2%), and per-stage recomputation
    (none, or the cheapest per-stage counts that fit the budget).
    A plan fits when its predicted peak times 1 + ``headroom`` does: the prediction's own error
    (measured within 5% on real runs: docs/plan.md, "How accurate it is") must not push a run over the budget.
    With ``chunks`` each layout of plain copies and plain stages is searched with model-state chunks too
    (:attr:`Layout.chunks`): the optimizer state where the step leaves room, the rest in host memory, which the
    profile's CPU steps as it measured the update.
    """
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ConfigError(f"headroom is a fraction of the budget kept free: 0 <= headroom < 1 (got {headroom!r})")
    m = int(profile.train["microbatches"]) if microbatches is None else microbatches
    if m != int(profile.train["microbatches"]):
        raise ConfigError(f"the profile was measured with {profile.train['microbatches']} microbatches of "
                          f"{profile.microbatch_rows} rows; profile again with --microbatches {m} "
                          f"(or plan with -m {profile.train['microbatches']})")
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ConfigError(f"the memory budget must be a positive number of bytes (got {budget!r})")
    for label, value in (("devices", p), ("microbatches", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{label} must be a positive integer (got {value!r})")
    shapes = list(layouts) if layouts is not None else [Layout(1, 1, p)]
    for shape in shapes:
        if shape.world != p or m % shape.dp:
            raise ConfigError(f"the layout {shape} runs {shape.world} ranks and shares {m} microbatches among "
                              f"{shape.dp} copies: give layouts of {p} ranks whose dp divides {m}")
    if chunks:
        if profile.optimizer_factor <= 0:
            raise ConfigError(f"the profile's optimizer ({profile.train.get('optimizer')}) keeps no state to put in "
                              "chunks: profile with --optimizer adamw, or plan without --state-chunks")
        plain = [shape for shape in shapes if shape.sharding == "none" and shape.degrees == (1,) * shape.pp]
        if not plain:
            raise ConfigError("model-state chunks run with plain copies of plain stages (no ZeRO-1, FSDP or tensor "
                              "parallelism): give a world with such a layout, or plan without --state-chunks")
        shapes = sorted([*shapes, *(dataclasses.replace(shape, chunks=True) for shape in plain)],
                        key=Layout.sort_key)
    n = len(profile.layers)
    pipelines = _Pipelines(n, families)
    if families is not None:
        known = {name for pp, k in {(shape.pp, m // shape.dp) for shape in shapes}
                 for name, _ in pipelines.candidates(pp, k)}
        unknown = sorted(set(families) - known)
        if unknown:
            raise ConfigError(f"no schedule family {unknown[0]!r} runs {m} microbatches on {p} devices; "
                              f"see pipefold schedules")
    count = sum(pipelines.search(shape.pp, m // shape.dp)[0] for shape in shapes)
    total = sum(pipelines.search(shape.pp, m // shape.dp)[1] for shape in shapes)
    if total > MAX_SEARCH_WORK:
        fewer = largest(lambda k: pipelines.search(k, m)[1] <= MAX_SEARCH_WORK, p - 1)
        fix = ("search fewer layouts or --families" if layouts is not None else
               f"plan at most {fewer:,} devices (or fewer --families)" if fewer is not None else
               "search fewer --families")
        check_search(total, count, f"planning {p:,} devices with {m:,} microbatches", fix)
    room = budget / (1 + headroom)
    points: list[ModelPoint] = []
    skipped: list[str] = []
    unrunnable = done = 0
    built: dict[tuple[str, int, int, tuple[tuple[str, int], ...]], Schedule | None] = {}
    if progress is not None:
        progress(0, count)
    for shape in shapes:
        views = None  # made for the layout's first candidate that runs
        for name, options in pipelines.candidates(shape.pp, m // shape.dp):
            if not pipelines.runs(name, shape.pp, m // shape.dp, options):  # what building it would find: unbuilt
                unrunnable += 1
                continue
            views = views or _device_views(profile, shape)
            key = (name, shape.pp, m // shape.dp, tuple(options.items()))
            if key not in built:  # the copies' shardings and the meshes of one length run the same schedules
                if built and next(iter(built))[1] != shape.pp:
                    built.clear()  # keep one pipeline length's (every_layout lists the layouts by length)
                try:
                    built[key] = schedules.build(name, shape.pp, m // shape.dp, **options)
                except (ConfigError, ScheduleError):
                    built[key] = None
            schedule = built[key]
            try:
                if schedule is None:
                    raise ConfigError(f"{name} cannot run {m // shape.dp} microbatches on {shape.pp} devices")
                points.extend(_model_points(profile, views, schedule, room, shape))
            except (ConfigError, ScheduleError):
                skipped.append(f"{shape} {ScheduleRef.named(name, options)}")
            done += 1
            if progress is not None:
                progress(done, count)
    if not points:
        raise ConfigError(f"no registered schedule runs {m} microbatches of this {n}-layer model on {p} devices "
                          f"({len(skipped) + unrunnable} candidates tried)")
    fits = [pt for pt in points if pt.memory <= room]
    if not fits:
        least = min(points, key=lambda q: (q.memory, q.makespan))
        raise ConfigError(f"no plan fits {format_bytes(budget)} per device on {p} devices with {headroom:.0%} "
                          f"headroom; the smallest predicted peak is {format_bytes(least.memory)} ({least.where}, "
                          f"recomputing {sum(least.recompute)} layers): raise --memory-budget or add devices")
    best = min(fits, key=_model_order)
    result, _, _ = predict(profile, best.layout, best.spec, best.layer_stages, best.recompute, room)
    return ModelPlan(best=best, result=result, budget=float(budget), points=tuple(points),
                     frontier=tuple(frontier(points, _model_order)),
                     skipped=tuple(skipped), profile=profile, room=room, unrunnable=unrunnable)


def predict(profile: Profile, layout: Layout, schedule: str | Schedule, layer_stages: Sequence[Sequence[int]],
            recompute: Sequence[int] | None = None, room: float = math.inf) -> tuple[SimResult, list[int], list[int]]:
    """What the profile predicts for one plan: ``schedule`` (a built pipeline of ``layout.pp`` devices, or its
    ``name:k=v`` with the profile's microbatches shared among ``layout.dp`` copies) with ``layer_stages`` and
    ``recompute``, each device's layers split over ``layout.tp`` ranks. Returns the simulation of one pipeline
    (seconds, activation bytes), each device's peak bytes in all (weights, gradients, optimizer state, activations,
    the messages it holds) and its static part. With model-state chunks, the state they keep on the device of
    ``room`` bytes (:func:`chunk_state`)."""
    schedule = _built(profile, layout, schedule)
    counts = tuple(recompute or (0,) * len(layer_stages))
    seen, activations, copies = _memory(profile, layout, schedule, layer_stages, counts, room)
    static = [max(column) for column in zip(*copies, strict=True)]
    result = _simulated(seen, layout, schedule, layer_stages, counts)
    return result, [int(st + a) for st, a in zip(static, activations, strict=True)], static


def copy_peaks(profile: Profile, layout: Layout, schedule: str | Schedule, layer_stages: Sequence[Sequence[int]],
               recompute: Sequence[int] | None = None, room: float = math.inf) -> list[list[int]]:
    """Each data-parallel copy's peak bytes on each device of its pipeline (:func:`predict`'s arguments), in all:
    what a rank of that copy and device holds at its peak. :func:`predict`'s peaks are each device's heaviest
    copy's; the copies differ under ZeRO-1 alone, each keeping the optimizer state of its own share of a device's
    tensors (:func:`copy_static`)."""
    schedule = _built(profile, layout, schedule)
    counts = tuple(recompute or (0,) * len(layer_stages))
    _, activations, copies = _memory(profile, layout, schedule, layer_stages, counts, room)
    return [[int(st + a) for st, a in zip(static, activations, strict=True)] for static in copies]


def _memory(profile: Profile, layout: Layout, schedule: Schedule, layer_stages: Sequence[Sequence[int]],
            counts: Sequence[int], room: float = math.inf) -> tuple[Profile, list[float], list[list[int]]]:
    """The layout's view of the profile, each device's activation peak, and each copy's static bytes per device
    (with model-state chunks, the state they keep on a device of ``room`` bytes: :func:`chunk_state`)."""
    seen = layout_profile(profile, layout, layer_stages, schedule.placement[0])
    activations = device_peaks(schedule, stage_profiles(seen, layer_stages), counts)[1]
    copies = [_with_chunks(profile, layout, schedule, layer_stages, static, activations, room)
              for static in copy_static(seen, layout, schedule, layer_stages)]
    return seen, activations, copies


def _built(profile: Profile, layout: Layout, schedule: str | Schedule) -> Schedule:
    """``schedule`` built for one pipeline of ``layout`` (the profile's microbatches shared among its copies)."""
    if isinstance(schedule, Schedule):
        return schedule
    ref = ScheduleRef.parse(schedule)
    return schedules.build(ref.name, layout.pp, int(profile.train["microbatches"]) // layout.dp, **ref.kwargs)


def _simulated(seen: Profile, layout: Layout, schedule: Schedule, layer_stages: Sequence[Sequence[int]],
               counts: Sequence[int]) -> SimResult:
    """The simulation of one pipeline of ``layout`` as ``seen`` (the layout's view of the profile) costs it."""
    return simulate(_replicated(schedule, layout), model_costs(seen, schedule, layer_stages, counts, layout))


def predicted_passes(profile: Profile, layout: Layout, schedule: str | Schedule,
                     layer_stages: Sequence[Sequence[int]],
                     recompute: Sequence[int] | None = None) -> tuple[list[float], list[float]]:
    """Each device's passes in one step of a plan (:func:`predict`'s arguments), as the profile times them and
    without the runtime's work per message: (every rank on cores of its own, the ranks sharing the cores as the
    plan expects them to). What a run's passes took, their CPU time and their wall time, compares with these: the
    first says whether the passes did the work the profile measured, the ratio of the two how much longer the plan
    expects them to take for sharing the cores."""
    schedule = _built(profile, layout, schedule)
    counts = tuple(recompute or (0,) * len(layer_stages))
    bare = dataclasses.replace(profile, message_overhead=0.0)
    own = dataclasses.replace(bare, contention=tuple(1.0 for _ in profile.contention))

    def busy(p: Profile) -> list[float]:
        seen = layout_profile(p, layout, layer_stages, schedule.placement[0])
        return [float(b) for b in _simulated(seen, layout, schedule, layer_stages, counts).busy]

    return busy(own), busy(bare)


def device_static(seen: Profile, layout: Layout, schedule: Schedule,
                  layer_stages: Sequence[Sequence[int]]) -> list[int]:
    """Each device's static bytes (weights, gradients, optimizer state) as ``seen``, the layout's view of the profile
    (:func:`layout_profile`), holds its layers: its heaviest copy's (:func:`copy_static`)."""
    return [max(column) for column in zip(*copy_static(seen, layout, schedule, layer_stages), strict=True)]


def copy_static(seen: Profile, layout: Layout, schedule: Schedule,
                layer_stages: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per data-parallel copy, each device's static bytes (weights, gradients, optimizer state) as ``seen`` holds its
    layers. The copies hold the same but under ZeRO-1, where copy c keeps the state of the whole tensors it steps,
    its share ``shares(sizes, dp)[c]`` (:mod:`pipefold.plan.shares`, the rule the runtime steps by; where the
    profile did not record the tensors, the even share that ``seen`` gives every layer, the same for all)."""
    out: list[list[int]] = [[] for _ in range(layout.dp)]
    for d in range(schedule.devices):
        indices = [i for s in schedule.stages_of(d) for i in layer_stages[s]]
        layers = [seen.layers[i] for i in indices]
        if layout.sharding == "zero1" and all(x.tensors or not x.params for x in layers):
            sizes = [t for x in layers for t in x.tensors]
            state = seen.optimizer_factor * layout.dp  # layout_profile gave each copy 1 / dp of it
            for copy, share in zip(out, shares(sizes, layout.dp), strict=True):
                copy.append(2 * sum(sizes) + round(state * sum(sizes[i] for i in share)))
        else:
            same = sum(seen.static(i) for i in indices)
            for copy in out:
                copy.append(same)
    return out


def _replicated(schedule: Schedule, layout: Layout) -> Schedule:
    """``schedule`` as each of ``layout.dp`` copies runs it: with its gradients' all-reduces among them, or with
    FSDP its gathers and reduce-scatters (as it is where it has them already: a job's own schedule)."""
    from pipefold.ir import Kind

    if layout.dp == 1 or any(a.kind in (Kind.DP, Kind.AG, Kind.RS) for row in schedule.actions for act in row
                             for a in act.passes):
        return schedule
    from pipefold.schedules.dataparallel import with_data_parallel

    return with_data_parallel(schedule, shard=layout.sharding == "fsdp")


def _device_views(measured: Profile, layout: Layout) -> list[Profile]:
    """Per pipeline device, every layer as that device would hold it (:func:`layout_profile` with all the layers on
    it): the same view for every device where their degrees are alike."""
    if not layout.mixed:
        return [layout_profile(measured, layout)] * layout.pp
    n = len(measured.layers)
    return [layout_profile(measured, layout, [range(n)], [d]) for d in range(layout.pp)]


def _model_points(measured: Profile, on_device: list[Profile], schedule: Schedule, budget: float,
                  layout: Layout) -> list[ModelPoint]:
    """The candidate plans of one schedule on one layout of the ``measured`` profile (``on_device``: its
    :func:`_device_views`): each split, without recomputation and (where that does not fit) with the cheapest
    recomputation that does.

    Where the layout's devices differ in degree, each device's layers have the figures of its own degree, in both
    splits (:func:`pipefold.plan.partition.partition_on_devices` and ``partition_memory_on_devices``, exact for
    any placement of one replica; a schedule that holds each stage twice, as Chimera does, is split by time, its
    stages' devices alike in degree). What the runtime would refuse (:func:`refused_layout`: devices that sum
    gradients rank by rank of different degrees, a tied weight across stages under FSDP) is not kept."""
    from pipefold.plan.partition import partition, partition_memory_on_devices, partition_on_devices

    placement = schedule.placement[0]
    n = len(measured.layers)
    if why := refused_layout(schedule, layout):
        raise ConfigError(why)
    figures = [([x.f + x.b + x.w for x in prof.layers], [x.held for x in prof.layers],
                [x.held_w for x in prof.layers], [prof.static(i) for i in range(n)]) for prof in on_device]
    if layout.mixed:
        by_time = partition_on_devices([f[0] for f in figures], placement)
    else:
        by_time = partition(figures[0][0], schedule.stages, placement=placement)
    splits = {"time": tuple(tuple(part) for part in by_time.parts)}
    if schedule.replicas == 1:
        split = tuple(tuple(part) for part in partition_memory_on_devices(figures, schedule, fastest=by_time).parts)
        if split != splits["time"]:
            splits["memory"] = split

    def profile_of(layer_stages: tuple[tuple[int, ...], ...]) -> Profile:
        return layout_profile(measured, layout, layer_stages, placement) if layout.mixed else on_device[0]

    if measured.tied:
        splits = {how: split for how, split in splits.items()
                  if not refused_layout(schedule, layout, split, measured.tied)}
        if not splits:
            raise ConfigError(refused_layout(schedule, layout, by_time.parts, measured.tied))
    run = _replicated(schedule, layout)
    out = []
    for how, layer_stages in splits.items():
        profile = profile_of(layer_stages)
        rows = stage_profiles(profile, layer_stages)
        none = (0,) * schedule.stages
        activations = device_peaks(schedule, rows, none)[1]
        static = device_static(profile, layout, schedule, layer_stages)
        tries = [(none, activations)]
        if max(st + int(a) for st, a in zip(static, activations, strict=True)) > budget:
            try:
                counts = choose_recompute(schedule, rows, "auto", budget)
            except ConfigError:  # nothing fits: recomputing everything is this split's least memory, for the frontier
                counts = choose_recompute(schedule, rows, "full")
            tries.append((counts, device_peaks(schedule, rows, counts)[1]))
        for counts, activations in tries:
            result = simulate(run, model_costs(profile, schedule, layer_stages, counts, layout))
            held = _with_chunks(measured, layout, schedule, layer_stages, static, activations, budget)
            out.append(ModelPoint(name=schedule.name, options=dict(schedule.options),
                                  makespan=round(result.makespan, 9), bubble_ratio=round(result.bubble_ratio, 9),
                                  peak_memory=tuple(float(st + int(a)) for st, a in zip(held, activations,
                                                                                          strict=True)),
                                  split=how, layer_stages=layer_stages, recompute=counts,
                                  static_bytes=tuple(held), layout=layout))
    return out


def _with_chunks(profile: Profile, layout: Layout, schedule: Schedule, layer_stages: Sequence[Sequence[int]],
                 static: Sequence[int], activations: Sequence[float], room: float) -> list[int]:
    """Each device's ``static`` bytes, with model-state chunks (``layout.chunks``) and the state they keep on it."""
    if not layout.chunks:
        return list(static)
    placed = chunk_state(profile, schedule, layer_stages, static, activations, room)
    return [st + extra for st, extra in zip(static, placed, strict=True)]


def chunk_state(profile: Profile, schedule: Schedule, layer_stages: Sequence[Sequence[int]],
                static: Sequence[float], activations: Sequence[float], room: float) -> list[int]:
    """Each device's bytes of optimizer state that model-state chunks keep on it: its parameters (float32, in the
    order its stages hold them, each tensor the profile recorded) packed into chunks of the capacity the runtime
    chooses, placed in order where ``room`` less the device's ``static`` bytes (parameters and gradients) and its
    activation peak leaves space (:func:`pipefold.plan.chunks.place`, the rule the runtime places by); the rest
    is in host memory."""
    from pipefold.plan.chunks import choose_capacity, pack, place

    states = round(profile.optimizer_factor)
    out = []
    for d in range(schedule.devices):
        sizes = [t // 4 for s in schedule.stages_of(d) for i in layer_stages[s]
                 for t in (profile.layers[i].tensors or ((profile.layers[i].params,) if profile.layers[i].params
                                                         else ()))]
        if not sizes:
            out.append(0)
            continue
        capacity = choose_capacity(sizes)
        chunks = [capacity] * len(pack(sizes, capacity))
        out.append(place(chunks, states, room - static[d] - activations[d]).device_bytes)
    return out


def refused_layout(schedule: Schedule, layout: Layout, layer_stages: Sequence[Sequence[int]] = (),
                   tied: Sequence[Sequence[int]] = ()) -> str:
    """Why the runtime would refuse ``layout`` running ``schedule`` split as ``layer_stages`` with these ``tied``
    layer groups (as :class:`pipefold.runtime.launch.job.Job` checks them); empty where it runs. Devices that sum
    gradients rank by rank (each stage's replicas; the holders of a tied weight) need one tensor-parallel degree,
    and FSDP shards each copy on its own, so a tied weight may not span stages under it. Without ``layer_stages``
    only what holds for every split is judged."""
    degrees = layout.degrees
    stage_of = {i: st for st, part in enumerate(layer_stages) for i in part}
    spanning = [group for group in tied if layer_stages and len({stage_of[i] for i in group}) > 1]
    if spanning and layout.sharding == "fsdp":
        return (f"{schedule.name} on {layout}: tied layers {', '.join(map(str, spanning[0]))} fall on different "
                "stages, whose gradients are summed after the step, but FSDP shards each copy on its own")
    groups: list[tuple[str, Sequence[int]]] = [(f"stage {st}'s replicas", schedule.holders(st))
                                                for st in range(schedule.stages)]
    groups += [(f"tied layers {', '.join(map(str, group))}",
                sorted({d for i in group for d in schedule.holders(stage_of[i])})) for group in tied if layer_stages]
    for what, devices in groups:
        if len({degrees[d] for d in devices}) > 1:
            shown = ", ".join(f"device {d} tp {degrees[d]}" for d in devices)
            return (f"{schedule.name} on {layout}: {what} sum their gradients rank by rank, so their devices need "
                    f"one tensor-parallel degree ({shown})")
    return ""


def _model_order(pt: ModelPoint) -> tuple[Any, ...]:
    # As fast, the state on the device before chunks of it in host memory (they hold less of the device only for
    # holding host memory). Among equals: fewer tensor-parallel ranks (less to go wrong), then fewer copies.
    return (pt.makespan, pt.layout.chunks, *_order(pt)[1:], sum(pt.recompute), pt.split, sum(pt.layout.degrees),
            pt.layout.degrees, pt.layout.dp)


def _degrees(value: Any) -> int | tuple[int, ...]:
    """A plan file's ``tp``: one degree, or a list of one per device (equal ones are one degree)."""
    if isinstance(value, list):
        if not value:
            raise ValueError("tp lists no degrees")
        degrees = tuple(int(t) for t in value)
        return degrees[0] if len(set(degrees)) == 1 else degrees
    return int(value)


def read_plan(path: str) -> dict[str, Any]:
    """A plan file written by ``pipefold plan --profile ... -o``, checked: one ConfigError if it is not one."""
    from pipefold.files import read_json

    return check_plan(read_json(path, "plan", "give a file written by pipefold plan --profile -o"), path)


def check_plan(data: Any, path: str) -> dict[str, Any]:
    """The contents of plan file ``path``, already read, checked as :func:`read_plan` checks them."""
    if not isinstance(data, dict) or data.get("kind") != "pipefold-plan" or data.get("version") != PLAN_VERSION:
        raise ConfigError(f"{path} is not a pipefold plan (version {PLAN_VERSION}); write one with "
                          f"pipefold plan --profile PROFILE --memory-budget BYTES -o {path}")
    try:
        inside = Profile.from_dict(data["profile"], f"the profile inside {path}")
        dp, tp = int(data.get("dp", 1)), _degrees(data.get("tp", 1))
        degrees = tp if isinstance(tp, tuple) else (tp,)
        if dp < 1 or any(t not in inside.tp_degrees for t in degrees) or (
                isinstance(tp, tuple) and len(tp) != int(data["devices"])):
            raise ConfigError(f"{path}: dp is a count of copies >= 1 and tp a degree its profile measured "
                              f"({', '.join(map(str, inside.tp_degrees))}), or one per device; got dp {dp}, "
                              f"tp {data.get('tp', 1)}")
        how = data.get("sharding", "none")
        if how not in SHARDING or (how != "none" and dp < 2):
            raise ConfigError(f"{path}: sharding is {', '.join(SHARDING)}, and other than none only with dp >= 2 "
                              f"copies to shard among (got {how!r}, dp {dp})")
        chunked = data.get("state_chunks", False)
        if not isinstance(chunked, bool) or (chunked and (how != "none" or degrees != (1,) or
                                                          data.get("room_bytes") is None)):
            raise ConfigError(f"{path}: state_chunks is true or false, true only without sharding or tensor "
                              f"parallelism and with room_bytes (got {chunked!r}, sharding {how!r}, tp "
                              f"{data.get('tp', 1)})")
        stages = [tuple(int(i) for i in part) for part in data["layer_stages"]]
        flat = [i for part in stages for i in part]
        if flat != list(range(len(data["profile"]["layers"]))):
            raise ConfigError(f"{path}: layer_stages must split layers 0..n-1 in order into contiguous stages")
        if len(data["recompute"]) != len(stages) or any(not 0 <= int(r) <= len(part)
                                                        for r, part in zip(data["recompute"], stages, strict=False)):
            raise ConfigError(f"{path}: recompute needs one count per stage, at most that stage's layers")
        devices, microbatches = int(data["devices"]), int(data["microbatches"])
        float(data["predicted"]["step_time_s"])
        ref = ScheduleRef.parse(str(data["schedule"]))
        schedules.get(ref.name)
        train = data["train"]  # the model and its size, as train takes them
        if not isinstance(train, dict):
            raise TypeError(f"'train' must be an object, got {train!r}")
        for key in ("batch", "seq", "seed"):
            int(train[key])
        for key in ("layers", "hidden", "heads"):  # null: the model's own default (an MLP has no heads)
            if train.get(key) is not None:
                int(train[key])
        if not isinstance(train["model"], str) or not isinstance(train["optimizer"], str):
            raise TypeError("'train' must name its model and optimizer")
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a valid pipefold plan ({type(exc).__name__}: {exc})") from None
    from pipefold.models import REGISTRY

    if train["model"] not in REGISTRY:
        raise ConfigError(f"{path} names the model {train['model']!r}, which this pipefold does not know: it knows "
                          f"{', '.join(sorted(REGISTRY))}")
    built = schedules.build(ref.name, devices, microbatches, **ref.kwargs)  # a bad shape: the schedule's own one line
    if built.stages != len(stages):
        raise ConfigError(f"{path}: {data['schedule']} on {devices} devices has {built.stages} stages but the plan "
                          f"splits the layers into {len(stages)}; write the plan again with pipefold plan --profile")
    return data

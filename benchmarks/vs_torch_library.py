"""pipefold's Pipeline against torch.distributed.pipelining, as libraries: the same model, the same user loop.

Both sides train the same MLP (``--layers`` blocks Linear(H, 4H) -> GELU -> Linear(4H, H), H = ``--hidden``), cut
into the same equal stages with the same weights, on 2 gloo ranks (one thread each) that this script starts
itself, with AdamW, on the same batches. The user's loop of each library is a function below
(:func:`pipefold_loop`, :func:`torch_loop`): it builds the library's pipeline object and the optimizer and runs the
steps; the harness around it gives both the same stage modules and times each step (a barrier before it; a
step's time: the longest rank's time from the barrier to asking for the next batch, so the optimizer step and
``zero_grad`` are in it; the first step, where torch infers shapes, is left out of the median).

For every schedule both libraries have, the two run in rounds, A B A B ...: per round each runs ``--steps`` steps
from fresh weights, and the round's ratio is pipefold's median step over torch's. Reported per schedule: the
median ratio over rounds and its spread (min..max), each side's median step, the losses' agreement (the same
seed gives the same losses to ~1e-5: the check that both computed the same thing), the peak memory per rank in a
separate, untimed run (the peak of tensor storages alive, counted by a dispatch mode, :class:`LiveTensors`, and the
peak rise of the process's resident set, sampled every millisecond: the second counts the allocator's caching and
is noisy), and the lines of each loop function (from ``inspect.getsource``). Then the schedules only pipefold has
run in the same rounds, each against pipefold's 1f1b of that round. Run:

    python benchmarks/vs_torch_library.py                      # every schedule, 3 rounds (< 3 minutes on 2 cores)
    python benchmarks/vs_torch_library.py --schedules 1f1b zb-v --rounds 1 --steps 2 --json out.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pipefold.errors import ConfigError, run_script

WORLD, SEED, LR = 2, 0, 1e-3
LOSS_TOLERANCE = 1e-5  # relative, per step


@dataclass(frozen=True)
class Pair:
    """A schedule both libraries have: pipefold's name (with options) and torch's class."""

    label: str
    pipefold: str
    torch_class: str


PAIRS = [
    Pair("gpipe", "gpipe", "ScheduleGPipe"),
    Pair("1f1b", "1f1b", "Schedule1F1B"),
    Pair("interleaved-1f1b", "interleaved-1f1b:v=2", "ScheduleInterleaved1F1B"),
    Pair("interleaved-zb", "interleaved-zb", "ScheduleInterleavedZeroBubble"),
    Pair("zb-v", "zb-v", "ScheduleZBVZeroBubble"),
    Pair("dualpipev", "dualpipev", "ScheduleDualPipeV"),
]
ONLY_PIPEFOLD = ["v-half", "v-min", "kfkb:k=2", "chimera", "zb-h1"]
"""Schedules torch.distributed.pipelining does not have, each timed against pipefold's 1f1b."""


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    batch: int
    microbatches: int
    steps: int
    rounds: int


# -- the model and the data, the same for both


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.nn.functional.gelu(self.fc(x)))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def build_stages(sizes: Sizes, stages: list[int], num_stages: int) -> dict[int, nn.Module]:
    """This rank's stage modules: the whole model built from one seed (so every rank and library gets the same
    weights), cut into ``num_stages`` equal runs of blocks."""
    torch.manual_seed(SEED)
    blocks = [Block(sizes.hidden) for _ in range(sizes.layers)]
    bounds = [round(i * sizes.layers / num_stages) for i in range(num_stages + 1)]
    return {s: nn.Sequential(*blocks[bounds[s]:bounds[s + 1]]) for s in stages}


def batches(sizes: Sizes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED + 1)
    return [(torch.randn(sizes.batch, sizes.hidden, generator=gen), torch.randn(sizes.batch, sizes.hidden,
                                                                                 generator=gen))
            for _ in range(sizes.steps)]


# -- the two user loops (their lines are counted: keep them what a user writes)


def pipefold_loop(stages: dict[int, nn.Module], schedule: str, microbatches: int,
                  data: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[float | None]:
    from pipefold.runtime.pipeline import Pipeline  # = from pipefold import Pipeline, which mypy reads as object

    pipe = Pipeline(stages, schedule, microbatches=microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses = []
    for x, y in data:
        losses.append(pipe.step(x, target=y))
        opt.step()
        opt.zero_grad()
    pipe.close()
    return losses


def torch_loop(stages: dict[int, nn.Module], schedule: str, microbatches: int,
               data: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[float | None]:
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    num_stages = WORLD * len(stages)
    pp = [pipelining.PipelineStage(m, s, num_stages, torch.device("cpu")) for s, m in stages.items()]
    cls = getattr(pipelining, schedule)
    sched = cls(pp[0] if issubclass(cls, PipelineScheduleSingle) else pp, n_microbatches=microbatches,
                loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for m in stages.values() for p in m.parameters()], lr=LR)
    first, last = 0 in stages, num_stages - 1 in stages
    losses: list[float | None] = []
    for x, y in data:
        mb_losses: list[torch.Tensor] = []
        sched.step(*((x,) if first else ()), target=y if last else None, losses=mb_losses if last else None)
        losses.append(float(torch.stack(mb_losses).mean().detach()) if last else None)
        opt.step()
        opt.zero_grad()
    return losses


def loop_lines(fn: Callable[..., Any]) -> int:
    """The lines of a loop function's body as written in this file: no signature, docstring, blank line or
    comment."""
    lines = inspect.getsource(fn).splitlines()
    body_start = next(i for i, line in enumerate(lines) if line.rstrip().endswith(":") and ")" in line) + 1
    return sum(1 for line in lines[body_start:] if line.strip() and not line.strip().startswith("#"))


# -- the harness on each rank


@dataclass
class Run:
    """One library's run of one schedule in one round, seen from both ranks."""

    steps_s: list[float] = field(default_factory=list)
    losses: list[float | None] = field(default_factory=list)
    error: str | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.steps_s[1:]) if len(self.steps_s) > 1 else None


class _Timed:
    """The batches, each handed out after a barrier; records each rank's seconds per step."""

    def __init__(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.data, self.times = data, []

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for item in self.data:
            dist.barrier()
            t0 = time.perf_counter()
            yield item
            self.times.append(time.perf_counter() - t0)

    times: list[float]


def _stages_of(schedule: str, microbatches: int, rank: int) -> tuple[list[int], int]:
    from pipefold.runtime.pipeline import resolve_schedule

    built = resolve_schedule(schedule, WORLD, microbatches)
    return built.stages_of(rank), built.stages


def _run(loop: Callable[..., list[float | None]], schedule: str, stage_schedule: str, sizes: Sizes,
         data: list[tuple[torch.Tensor, torch.Tensor]]) -> Run:
    """One run on this rank (collective): per step the longest rank's time, the losses from the last stage."""
    rank = dist.get_rank()
    stages, num_stages = _stages_of(stage_schedule, sizes.microbatches, rank)
    modules = build_stages(sizes, stages, num_stages)
    timed = _Timed(data)
    error = None
    losses: list[float | None] = []
    try:
        losses = loop(modules, schedule, sizes.microbatches, timed)
    except Exception as exc:  # a library's failure is a result to report, not the benchmark's end
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, (timed.times, losses, error))
    errors = [e for _, _, e in gathered if e]
    if errors:
        return Run(error=errors[0])
    steps = [max(g[0][i] for g in gathered) for i in range(len(data))]
    merged = [next((g[1][i] for g in gathered if g[1][i] is not None), None) for i in range(len(data))]
    return Run(steps, merged)


class _RssPeak:
    """The process's resident set sampled every millisecond in a thread: the peak rise over its start."""

    def __init__(self) -> None:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> _RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *args: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class LiveTensors(TorchDispatchMode):
    """The bytes of tensor storages alive, and their peak: every storage an operator returns (and the modules'
    parameters and buffers given to :meth:`track`) is counted from when it is first seen until it is freed (a
    weak reference's callback, whatever thread drops it). torch's own MemTracker raises on a module called more
    than once in one tracked run, as every pipeline's microbatches call it, so this is the same counting without
    its per-module bookkeeping. A dispatch mode sees the operators of the thread that enters it: both libraries
    compute (forward and, on CPU, backward) and allocate their receive buffers in the loop's thread."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, Any] = {}

    def track(self, *modules: nn.Module) -> None:
        for m in modules:
            for t in [*m.parameters(), *m.buffers()]:
                self._add(t)

    def _add(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse:
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        if key == 0 or key in self._refs:
            return
        size = st.nbytes()
        def freed(_: object) -> None:
            self._drop(key, size)

        self._refs[key] = weakref.ref(st, freed)
        self.live += size
        self.peak = max(self.peak, self.live)

    def _drop(self, key: int, size: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            self._add(t)
        return out


def _memory(loop: Callable[..., list[float | None]], schedule: str, stage_schedule: str, sizes: Sizes,
            data: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """One untimed run of 2 steps on this rank: the peak bytes of tensors alive (:class:`LiveTensors`, the stage
    modules' parameters included) and the peak rise of the resident set; per rank (collective)."""
    rank = dist.get_rank()
    stages, num_stages = _stages_of(stage_schedule, sizes.microbatches, rank)
    modules = build_stages(sizes, stages, num_stages)
    tracker = LiveTensors()
    tracker.track(*modules.values())
    out: dict[str, Any] = {"tensors_bytes": None, "rss_bytes": None, "error": None}
    try:
        with _RssPeak() as rss, tracker:
            loop(modules, schedule, sizes.microbatches, data[:2])
        out["tensors_bytes"] = tracker.peak
        out["rss_bytes"] = rss.peak - rss.start
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, out)
    return {"per_rank": gathered}


def _rank(rank: int, init: str, sizes: Sizes, pairs: list[Pair], only: list[str], out_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        data = batches(sizes)
        paired: dict[str, list[dict[str, Run]]] = {p.label: [] for p in pairs}
        alone: dict[str, list[Run]] = {s: [] for s in ["1f1b", *only]} if only else {}
        for r in range(sizes.rounds):
            for p in pairs:  # A B, the two libraries back to back: the machine's drift hits both
                _say(rank, f"round {r + 1}/{sizes.rounds}: {p.label}")
                paired[p.label].append({"pipefold": _run(pipefold_loop, p.pipefold, p.pipefold, sizes, data),
                                        "torch": _run(torch_loop, p.torch_class, p.pipefold, sizes, data)})
            for s in alone:
                _say(rank, f"round {r + 1}/{sizes.rounds}: pipefold {s}")
                alone[s].append(_run(pipefold_loop, s, s, sizes, data))
        memory = {}
        for p in pairs:
            _say(rank, f"memory: {p.label}")
            memory[p.label] = {"pipefold": _memory(pipefold_loop, p.pipefold, p.pipefold, sizes, data),
                               "torch": _memory(torch_loop, p.torch_class, p.pipefold, sizes, data)}
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"paired": {k: [{side: asdict(run) for side, run in rnd.items()} for rnd in v]
                                      for k, v in paired.items()},
                           "alone": {k: [asdict(run) for run in v] for k, v in alone.items()},
                           "memory": memory}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"  {text}", file=sys.stderr, flush=True)


# -- the report


def _loss_diff(a: list[float | None], b: list[float | None]) -> float | None:
    """The largest relative difference of two runs' per-step losses."""
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    if not pairs or len(pairs) != len(a):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(raw: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    def run(d: dict[str, Any]) -> Run:
        return Run(d["steps_s"], d["losses"], d["error"])

    lines = {"pipefold": loop_lines(pipefold_loop), "torch": loop_lines(torch_loop)}
    rows = []
    for label, rounds in raw["paired"].items():
        runs = [{k: run(v) for k, v in rnd.items()} for rnd in rounds]
        errors = {side: r[side].error for r in runs for side in r if r[side].error}
        ratios = [pf / th for r in runs if (pf := r["pipefold"].median_s) and (th := r["torch"].median_s)]
        diffs = [d for r in runs if (d := _loss_diff(r["pipefold"].losses, r["torch"].losses)) is not None]
        mem = raw["memory"][label]
        rows.append({
            "schedule": label,
            "pipefold_schedule": next(p.pipefold for p in PAIRS if p.label == label),
            "torch_class": next(p.torch_class for p in PAIRS if p.label == label),
            "ratio": _spread(ratios),
            "pipefold_ms": _spread([1e3 * m for r in runs if (m := r["pipefold"].median_s)]),
            "torch_ms": _spread([1e3 * m for r in runs if (m := r["torch"].median_s)]),
            "loss_max_rel_diff": max(diffs) if diffs else None,
            "losses_agree": bool(diffs) and max(diffs) <= LOSS_TOLERANCE,
            "losses": {"pipefold": runs[0]["pipefold"].losses, "torch": runs[0]["torch"].losses},
            "memory": {side: {
                "tensors_mib": [None if m["tensors_bytes"] is None else m["tensors_bytes"] / 2**20
                                for m in mem[side]["per_rank"]],
                "rss_rise_mib": [None if m["rss_bytes"] is None else m["rss_bytes"] / 2**20
                                 for m in mem[side]["per_rank"]],
                "errors": [m["error"] for m in mem[side]["per_rank"] if m["error"]]} for side in mem},
            "loop_lines": lines,
            "errors": errors,
        })
    alone = []
    base = [run(d) for d in raw["alone"].get("1f1b", [])]
    reference = base[0].losses if base else []
    for name, rounds in raw["alone"].items():
        if name == "1f1b":
            continue
        mine = [run(d) for d in rounds]
        ratios = [m / b for r, b0 in zip(mine, base, strict=True) if (m := r.median_s) and (b := b0.median_s)]
        diff = _loss_diff(mine[0].losses, reference) if mine[0].error is None else None
        alone.append({"schedule": name, "runs": all(r.error is None for r in mine),
                      "errors": sorted({r.error for r in mine if r.error}),
                      "ratio_to_1f1b": _spread(ratios), "ms": _spread([1e3 * m for r in mine if (m := r.median_s)]),
                      "loss_max_rel_diff_to_1f1b": diff})
    return {"sizes": asdict(sizes), "world": WORLD, "backend": "gloo", "optimizer": "AdamW", "lr": LR,
            "torch_version": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "memory_method": "peak bytes of tensor storages alive in a 2-step run (LiveTensors, a TorchDispatchMode: "
                             "stage parameters, gradients, optimizer state, activations, buffers); and the peak rise "
                             "of the resident set "
                             "(/proc/self/statm, sampled every 1 ms)",
            "loop_lines": lines, "schedules": rows, "only_pipefold": alone}


def _fmt(s: dict[str, float] | None, digits: int = 2) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}..{s['max']:.{digits}f})"


def _mib(values: list[float | None]) -> str:
    return "/".join("-" if v is None else f"{v:.1f}" for v in values)


def table(summary: dict[str, Any]) -> str:
    sz = summary["sizes"]
    out = [f"pipefold Pipeline vs torch.distributed.pipelining: MLP H={sz['hidden']} x {sz['layers']} layers, batch "
           f"{sz['batch']} in {sz['microbatches']} microbatches, {summary['world']} gloo ranks, AdamW, "
           f"{sz['rounds']} rounds x {sz['steps']} steps (median over steps 2..{sz['steps']}; spread: min..max over "
           "rounds)", "",
           "| schedule | pipefold/torch step time | pipefold ms | torch ms | losses agree (max rel diff) | "
           "tensors peak MiB r0/r1 pipefold | tensors peak MiB r0/r1 torch | RSS rise MiB pipefold | "
           "RSS rise MiB torch | loop lines pipefold | loop lines torch |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["schedules"]:
        diff = r["loss_max_rel_diff"]
        agree = "-" if diff is None else f"{'yes' if r['losses_agree'] else 'NO'} ({diff:.1e})"
        m = r["memory"]
        out.append(f"| {r['schedule']} | {_fmt(r['ratio'])} | {_fmt(r['pipefold_ms'], 1)} | {_fmt(r['torch_ms'], 1)} "
                   f"| {agree} | {_mib(m['pipefold']['tensors_mib'])} | {_mib(m['torch']['tensors_mib'])} | "
                   f"{_mib(m['pipefold']['rss_rise_mib'])} | {_mib(m['torch']['rss_rise_mib'])} | "
                   f"{r['loop_lines']['pipefold']} | {r['loop_lines']['torch']} |")
    notes = [f"{r['schedule']}: {side} failed: {e}" for r in summary["schedules"] for side, e in r["errors"].items()]
    notes += [f"{r['schedule']}: {side} memory run: {e}" for r in summary["schedules"] for side in r["memory"]
              for e in r["memory"][side]["errors"]]
    if summary["only_pipefold"]:
        out += ["", "Schedules only pipefold has (same rounds, each against pipefold's 1f1b of the round):", "",
                "| schedule | runs | step time / pipefold 1f1b | ms | loss max rel diff to 1f1b |",
                "|---|---|---|---|---|"]
        for a in summary["only_pipefold"]:
            diff = a["loss_max_rel_diff_to_1f1b"]
            out.append(f"| {a['schedule']} | {'yes' if a['runs'] else 'NO'} | {_fmt(a['ratio_to_1f1b'])} | "
                       f"{_fmt(a['ms'], 1)} | {'-' if diff is None else f'{diff:.1e}'} |")
            notes += [f"{a['schedule']}: failed: {e}" for e in a["errors"]]
    return "\n".join(out + ([""] + notes if notes else []))


# -- main


def run(sizes: Sizes, labels: list[str], only: list[str]) -> dict[str, Any]:
    """Start the 2 ranks, run everything, return the summary."""
    pairs = [p for p in PAIRS if p.label in labels]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "raw.json")
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.start_processes(_rank, args=(init, sizes, pairs, only, out_path), nprocs=WORLD, join=True,
                           start_method="spawn")
        with open(out_path) as f:
            raw = json.load(f)
    return summarize(raw, sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=[p.label for p in PAIRS] + ["only"], metavar="NAME",
                        help=f"of {', '.join(p.label for p in PAIRS)}; 'only': also the schedules only pipefold has "
                             f"({', '.join(ONLY_PIPEFOLD)}) (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of A B runs (default 3)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run, the first not in the median (default 6)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    args = parser.parse_args()
    known = [p.label for p in PAIRS]
    unknown = [s for s in args.schedules if s not in [*known, "only"]]
    if unknown:
        raise ConfigError(f"unknown schedule {unknown[0]!r}: choose from {', '.join(known)} or 'only'")
    for name, low in (("rounds", 1), ("steps", 2), ("hidden", 1), ("microbatches", WORLD)):
        if getattr(args, name) < low:
            raise ConfigError(f"--{name} must be at least {low} (got {getattr(args, name)})")
    if args.layers < 2 * WORLD:
        raise ConfigError(f"--layers must be at least {2 * WORLD}: the two-stages-a-rank schedules need a layer per "
                          f"stage (got {args.layers})")
    if args.batch < 1 or args.batch % args.microbatches:
        raise ConfigError(f"--batch {args.batch} does not split into {args.microbatches} equal microbatches")
    if args.microbatches % WORLD:
        raise ConfigError(f"--microbatches must be a multiple of {WORLD} (interleaved schedules; got "
                          f"{args.microbatches})")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every spawned rank
    sizes = Sizes(args.hidden, args.layers, args.batch, args.microbatches, args.steps, args.rounds)
    only = ONLY_PIPEFOLD if "only" in args.schedules else []
    started = time.perf_counter()
    summary = run(sizes, [s for s in args.schedules if s != "only"], only)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(table(summary))
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs, {summary['seconds']:.0f} s in all; loop lines: "
          f"pipefold {summary['loop_lines']['pipefold']}, torch {summary['loop_lines']['torch']}; memory: "
          f"{summary['memory_method']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)


if __name__ == "__main__":
    run_script(main)

"""Step time of torch.compile'd stages against eager ones, per schedule, with pipefold's Pipeline and with
torch.distributed.pipelining.

The model: ``--layers`` residual blocks ``x + Linear(4H, H)(GELU(Linear(H, 4H)(LayerNorm(x))))`` (H = ``--hidden``),
cut into equal stages of whole blocks (an ``nn.Sequential`` a stage, so pipefold compiles each block), on 2 gloo
ranks (one thread each) that this script starts itself, AdamW through ``pipe.optimizer(...)``, the same seed and
batches for every run. Each run builds its stage modules afresh from the seed and runs ``--steps`` steps; a step's
time is the longest rank's time from a barrier to asking for the next batch (the optimizer step and ``zero_grad``
are in it); the first ``--warmup`` steps (where torch.compile traces and inductor generates and compiles C++) are
left out of the run's median.

Part 1, pipefold: per round, for each schedule (1f1b, zb-h1, zb-v, dualpipev), eager, ``compile="split"`` and
``compile="whole"`` (inductor) back to back (the order turning each round: eager split whole, split whole eager,
...). Reported per schedule and mode: the median over rounds of the run's
median step over eager's of the same round, its spread (min..max over rounds), the milliseconds, and the losses'
agreement with eager's of the same round (max relative difference over the steps: the independent check that the
compiled stages compute the same training). Compilation, per run: the warm-up steps' seconds beyond ``warmup`` x
the run's median step. Every compiled run starts with ``torch._dynamo.reset()``, so it traces its own graphs:
dynamo keeps a code object's graphs for every module of that class, and a ``compile="whole"`` Pipeline built after
a ``compile="split"`` one in the same process otherwise runs split's graphs (its Linears outside the regions; the
backward-call count below shows it). Inductor's cache is in a fresh folder for each invocation of this script, so
the first compile is a cold one; later ones find its kernels there. Also in the first round: one more, untimed
step under torch's profiler counts the compiled regions' backward calls (``CompiledFunctionBackward``): once per
region and microbatch where no backward runs twice (with "whole", B computes the weights' gradients too).

Part 2, torch.distributed.pipelining with the same blocks, each wrapped in ``torch.compile`` (inductor): in the
same rounds Schedule1F1B and ScheduleGPipe eager and compiled (their ratio, losses against eager; these runs
follow pipefold's in the same processes, so they run with ``donated_buffer = False``, which pipefold's compile sets
process-wide, and reuse the block graphs dynamo already made). Then ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble and ScheduleDualPipeV with the compiled blocks: the error where they refuse (one line). Where
they refuse an ``OptimizedModule``, also with each block compiled in place (``block.compile()``, which torch's check
does not look for), as it is and with ``torch._functorch.config.donated_buffer = False``, each in processes of its
own after an eager run of the same schedule (a crash or a hang stays there; a 30 s timeout): whether it runs, its
step time over that eager run's (one run each: no spread), and its losses against eager's.

    python benchmarks/compile_speed.py                    # 4 schedules x 3 modes, 4 rounds (~7 minutes on 2 cores)
    python benchmarks/compile_speed.py --quick            # small and short: checks the script works
    python benchmarks/compile_speed.py --schedules 1f1b zb-v --rounds 2 --no-torch --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pipefold.errors import ConfigError, run_script

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The harness vs_torch_library.py times both libraries with: the same data, loss, stages and timing.
from vs_torch_library import (  # noqa: E402
    LR,
    SEED,
    WORLD,
    _fmt,
    _spread,
    _stages_of,
    _Timed,
    batches,
    loss_fn,
)
from vs_torch_library import Sizes as _Sizes  # noqa: E402

BACKEND = "inductor"
SCHEDULES = ["1f1b", "zb-h1", "zb-v", "dualpipev"]
MODES = ["eager", "split", "whole"]
TORCH_TIMED = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
"""torch schedules timed eager and compiled, each with pipefold's schedule of the same placement."""
TORCH_ZB = {"interleaved-zb": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
            "dualpipev": "ScheduleDualPipeV"}
"""torch's schedules that split the backward, by pipefold's schedule of the same placement."""
INPLACE = ("inplace", "inplace-nodonate")
"""Blocks compiled in place (``block.compile()``), as compiled (``inplace``), and with
``torch._functorch.config.donated_buffer = False`` (``inplace-nodonate``, as pipefold's compile_stage sets it)."""


@dataclass(frozen=True)
class Sizes(_Sizes):
    warmup: int


# -- the model and the data


class Block(nn.Module):
    """``x + proj(gelu(fc(norm(x))))``: a LayerNorm and a GELU for the compiler to fuse around two products."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(nn.functional.gelu(self.fc(self.norm(x))))


def build_stages(sizes: Sizes, stages: list[int], num_stages: int) -> dict[int, nn.Sequential]:
    """This rank's stages: the whole model from one seed, cut into ``num_stages`` equal runs of blocks."""
    torch.manual_seed(SEED)
    blocks = [Block(sizes.hidden) for _ in range(sizes.layers)]
    bounds = [round(i * sizes.layers / num_stages) for i in range(num_stages + 1)]
    return {s: nn.Sequential(*blocks[bounds[s]:bounds[s + 1]]) for s in stages}


# -- the user loops

_PROFILE: dict[str, Any] = {"on": False, "count": None}
"""When on, each loop runs one more, untimed step after its batches under torch's profiler and counts the compiled
regions' backward calls (``CompiledFunctionBackward``) in it: one per region and microbatch where nothing runs
twice."""


def _count_backward_calls(step: Any) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name == "CompiledFunctionBackward")



def pipefold_loop(stages: dict[int, nn.Module], schedule: str, mode: str, microbatches: int,
                  data: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[float | None]:
    from pipefold.runtime.pipeline import Pipeline

    pipe = Pipeline(stages, schedule, microbatches=microbatches, loss_fn=loss_fn,
                    compile=False if mode == "eager" else mode, compile_backend=BACKEND)
    opt = pipe.optimizer(lambda ps: torch.optim.AdamW(ps, lr=LR))
    losses = []
    for x, y in data:
        losses.append(pipe.step(x, target=y))
        opt.step()
        opt.zero_grad()
    if _PROFILE["on"]:  # the harness's count, not part of the user's loop
        x, y = next(iter(data.data))  # type: ignore[attr-defined]
        _PROFILE["count"] = _count_backward_calls(lambda: pipe.step(x, target=y))
        opt.zero_grad()
    pipe.close()
    return losses


def torch_loop(stages: dict[int, nn.Module], schedule: str, mode: str, microbatches: int,
               data: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[float | None]:
    """torch.distributed.pipelining's loop; ``mode``: eager, ``compiled`` (each block wrapped in torch.compile),
    ``inplace`` (each block's ``compile()``: the module stays a Block, which torch's zero-bubble schedules' check
    for compiled stages does not see), or ``inplace-nodonate`` (the same with AOTAutograd's donated buffers off)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if mode == "compiled":
        stages = {s: nn.Sequential(*[torch.compile(b, backend=BACKEND)  # type: ignore[call-overload]
                                     for b in m.children()])
                  for s, m in stages.items()}
    elif mode in ("inplace", "inplace-nodonate"):
        if mode == "inplace-nodonate":  # what pipefold's compile_stage sets: a compiled backward may run twice
            import torch._functorch.config as functorch_config

            functorch_config.donated_buffer = False
        for m in stages.values():
            for b in m.children():
                b.compile(backend=BACKEND)
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
    if _PROFILE["on"]:  # the harness's count, not part of the user's loop
        x, y = next(iter(data.data))  # type: ignore[attr-defined]
        _PROFILE["count"] = _count_backward_calls(lambda: sched.step(*((x,) if first else ()),
                                                                      target=y if last else None,
                                                                      losses=[] if last else None))
        opt.zero_grad()
    return losses


# -- the harness on each rank


@dataclass
class Run:
    steps_s: list[float] = field(default_factory=list)
    losses: list[float | None] = field(default_factory=list)
    error: str | None = None
    backward_calls: int | None = None
    """Compiled regions' backward calls in one step, summed over the ranks (where counted: :data:`_PROFILE`)."""


def _one_line(exc: BaseException) -> str:
    """The exception's type and first line; for a rank's error re-raised by torch.multiprocessing (a traceback in
    its message), the last line of that traceback."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if type(exc).__name__ == "ProcessRaisedException" and lines:
        return f"{lines[0].strip('- ')}: {lines[-1]}"
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _run(loop: Any, schedule: str, placement: str, mode: str, sizes: Sizes,
         data: list[tuple[torch.Tensor, torch.Tensor]], count: bool = False, sidecar: str | None = None) -> Run:
    """One run on this rank (collective): per step the longest rank's time, the losses from the last stage; with
    ``count``, the compiled backward calls of one more step. ``sidecar``: where this rank writes its error the
    moment it has one (a peer left waiting may end the processes before the results are gathered)."""
    rank = dist.get_rank()
    _PROFILE["on"], _PROFILE["count"] = count, None
    if mode != "eager":
        # Each compiled run traces its own graphs: dynamo shares a code object's graphs among modules, and a
        # "whole" run after a "split" one would otherwise take split's graphs (Linears outside; see the docstring).
        torch._dynamo.reset()
        if loop is torch_loop:  # torch's default, which pipefold's compile_stage turns off process-wide
            import torch._functorch.config as functorch_config

            functorch_config.donated_buffer = True
    stages, num_stages = _stages_of(placement, sizes.microbatches, rank)
    modules = build_stages(sizes, stages, num_stages)
    timed = _Timed(data)
    error, losses = None, []
    try:
        losses = loop(modules, schedule, mode, sizes.microbatches, timed)
    except Exception as exc:  # a library's failure is a result to report
        error = _one_line(exc)
        if exc.__cause__ is not None:  # torch's pipelining wraps the backward's own error: name it too
            error += f" (caused by {_one_line(exc.__cause__)})"
        if sidecar is not None:
            with open(f"{sidecar}.rank{rank}", "w") as f:
                f.write(error)
        if os.environ.get("COMPILE_SPEED_TRACEBACK"):
            traceback.print_exc()
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, (timed.times, losses, error, _PROFILE["count"]))
    _PROFILE["on"] = False
    errors = _rank_errors([g[2] for g in gathered])
    if errors:
        return Run(error=errors)
    steps = [max(g[0][i] for g in gathered) for i in range(len(data))]
    merged = [next((g[1][i] for g in gathered if g[1][i] is not None), None) for i in range(len(data))]
    counts = [g[3] for g in gathered]
    return Run(steps, merged, backward_calls=sum(counts) if None not in counts else None)


def _rank_errors(errors: list[str | None]) -> str | None:
    """The ranks' errors, each text once with the ranks that had it."""
    by: dict[str, list[int]] = {}
    for i, e in enumerate(errors):
        if e:
            by.setdefault(e, []).append(i)
    if not by:
        return None
    return "; ".join(f"rank{'s' * (len(r) > 1)} {','.join(map(str, r))}: {e}" for e, r in by.items())


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, file=sys.stderr, flush=True)


def _init(rank: int, init: str, timeout_s: float = 120) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=timeout_s))


def _main_rank(rank: int, init: str, sizes: Sizes, schedules: list[str], with_torch: bool, out_path: str) -> None:
    """The timed rounds (pipefold's modes; torch's 1F1B and GPipe eager and compiled), then torch's zero-bubble
    schedules with torch.compile'd blocks."""
    _init(rank, init)
    try:
        data = batches(sizes)
        pf: dict[str, dict[str, list[dict[str, Any]]]] = {s: {m: [] for m in MODES} for s in schedules}
        th: dict[str, dict[str, list[dict[str, Any]]]] = {s: {"eager": [], "compiled": []} for s in TORCH_TIMED} \
            if with_torch else {}
        for r in range(sizes.rounds):
            for s in schedules:
                for m in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:  # the order turns each round
                    _say(rank, f"round {r + 1}/{sizes.rounds}: pipefold {s} {m}")
                    pf[s][m].append(asdict(_run(pipefold_loop, s, s, m, sizes, data, count=r == 0)))
            for s, cls in TORCH_TIMED.items() if with_torch else ():
                for m in ("eager", "compiled"):
                    _say(rank, f"round {r + 1}/{sizes.rounds}: torch {cls} {m}")
                    th[s][m].append(asdict(_run(torch_loop, cls, s, m, sizes, data, count=r == 0)))
        zb: dict[str, Any] = {}
        for s, cls in TORCH_ZB.items() if with_torch else ():
            _say(rank, f"torch {cls} with torch.compile'd blocks")
            zb[s] = asdict(_run(torch_loop, cls, s, "compiled", sizes, data))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"pipefold": pf, "torch": th, "torch_zb": zb}, f)
    finally:
        dist.destroy_process_group()


def _inplace_rank(rank: int, init: str, sizes: Sizes, placement: str, cls: str, modes: tuple[str, ...],
                  out_path: str) -> None:
    """torch's zero-bubble schedule ``cls`` in ``modes`` (eager, then blocks compiled in place), in processes of
    their own; a short timeout, as a rank whose backward fails leaves its peer waiting for a message."""
    _init(rank, init, timeout_s=30)
    try:
        data = batches(sizes)
        sidecar = out_path[:-len(".json")]
        out = {m: asdict(_run(torch_loop, cls, placement, m, sizes, data, count=m != "eager",
                              sidecar=f"{sidecar}.{m}")) for m in modes}
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _spawn(fn: Any, args: tuple[Any, ...], tmp: str, name: str) -> tuple[Any, str | None]:
    """Start the 2 ranks of ``fn`` and read what rank 0 wrote; or None and how the processes ended."""
    out_path = os.path.join(tmp, f"{name}.json")
    init = f"file://{os.path.join(tmp, name + '.rendezvous')}"
    try:
        mp.start_processes(fn, args=(init, *args, out_path), nprocs=WORLD, join=True, start_method="spawn")
    except Exception as exc:  # a rank that crashed (a signal) or raised: the result is how it ended
        import glob

        first = []
        for path in sorted(glob.glob(os.path.join(tmp, f"{name}.*.rank*"))):
            with open(path) as f:
                first.append(f.read())
        ended = _one_line(exc)
        return None, (f"{'; '.join(first)}; then the processes ended: {ended}" if first else ended)
    with open(out_path) as f:
        return json.load(f), None


# -- the summary


def _median_s(run: dict[str, Any], warmup: int) -> float | None:
    steps = run["steps_s"][warmup:]
    return statistics.median(steps) if run["error"] is None and steps else None


def _loss_diff(a: list[float | None], b: list[float | None]) -> float | None:
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    if not pairs:
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)


def _compile_s(run: dict[str, Any], warmup: int) -> float | None:
    """Seconds the warm-up steps took beyond ``warmup`` ordinary steps: the compile's cost."""
    med = _median_s(run, warmup)
    return None if med is None else sum(run["steps_s"][:warmup]) - warmup * med


def summarize(raw: dict[str, Any], inplace: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    w = sizes.warmup
    rows = []
    for s, modes in raw["pipefold"].items():
        eager = modes["eager"]
        for m in MODES:
            runs = modes[m]
            ratios = [a / b for run, base in zip(runs, eager, strict=True)
                      if (a := _median_s(run, w)) and (b := _median_s(base, w))]
            diffs = [d for run, base in zip(runs, eager, strict=True)
                     if run["error"] is None and (d := _loss_diff(run["losses"], base["losses"])) is not None]
            rows.append({"schedule": s, "mode": m, "ratio_to_eager": _spread(ratios),
                         "ms": _spread([1e3 * v for r in runs if (v := _median_s(r, w))]),
                         "loss_max_rel_diff_to_eager": max(diffs) if diffs else None,
                         "first_round_compile_s": _compile_s(runs[0], w) if runs else None,
                         "compile_s_per_round": [_compile_s(r, w) for r in runs],
                         "backward_calls": runs[0]["backward_calls"] if runs else None,
                         "first_round_warmup_s": runs[0]["steps_s"][:w] if runs and runs[0]["error"] is None else None,
                         "errors": sorted({r["error"] for r in runs if r["error"]})})
    torch_rows = []
    for s, modes in raw["torch"].items():
        eager, comp = modes["eager"], modes["compiled"]
        ratios = [a / b for run, base in zip(comp, eager, strict=True)
                  if (a := _median_s(run, w)) and (b := _median_s(base, w))]
        diffs = [d for run, base in zip(comp, eager, strict=True)
                 if run["error"] is None and (d := _loss_diff(run["losses"], base["losses"])) is not None]
        pf_eager = raw["pipefold"].get(s, {}).get("eager", [])
        vs_pf = [d for run, base in zip(eager, pf_eager, strict=False)
                 if run["error"] is None and base["error"] is None and
                 (d := _loss_diff(run["losses"], base["losses"])) is not None]
        torch_rows.append({"schedule": TORCH_TIMED[s], "compiled_over_eager": _spread(ratios),
                           "eager_ms": _spread([1e3 * v for r in eager if (v := _median_s(r, w))]),
                           "compiled_ms": _spread([1e3 * v for r in comp if (v := _median_s(r, w))]),
                           "loss_max_rel_diff_to_eager": max(diffs) if diffs else None,
                           "eager_loss_max_rel_diff_to_pipefold_eager": max(vs_pf) if vs_pf else None,
                           "first_round_compile_s": _compile_s(comp[0], w) if comp else None,
                           "compile_s_per_round": [_compile_s(r, w) for r in comp],
                           "backward_calls": comp[0]["backward_calls"] if comp else None,
                           "errors": sorted({r["error"] for r in eager + comp if r["error"]})})
    zb_rows = []
    for s, run in raw["torch_zb"].items():
        row: dict[str, Any] = {"schedule": TORCH_ZB[s], "compiled_error": run["error"],
                               "compiled_ms": _median_s(run, w)}
        row["inplace"] = {}
        for m, (got, how) in inplace.get(s, {}).items():
            if got is None:
                row["inplace"][m] = {"ended": how}
                continue
            e, i = got["eager"], got[m]
            em, im = _median_s(e, w), _median_s(i, w)
            row["inplace"][m] = {"eager_error": e["error"], "error": i["error"],
                                 "eager_ms": None if em is None else 1e3 * em,
                                 "ms": None if im is None else 1e3 * im,
                                 "over_eager": im / em if em and im else None,
                                 "loss_max_rel_diff_to_eager": _loss_diff(i["losses"], e["losses"])
                                 if i["error"] is None and e["error"] is None else None,
                                 "compile_s": _compile_s(i, w), "backward_calls": i["backward_calls"]}
        zb_rows.append(row)
    return {"sizes": asdict(sizes), "world": WORLD, "backend": "gloo", "compile_backend": BACKEND,
            "block_microbatches": sizes.layers * sizes.microbatches,
            "optimizer": "AdamW via Pipeline.optimizer", "lr": LR, "torch_version": torch.__version__,
            "python": sys.version.split()[0], "cpus": os.cpu_count(), "pipefold": rows, "torch": torch_rows,
            "torch_zero_bubble": zb_rows}


def _secs(xs: list[float | None]) -> str:
    return " / ".join("-" if x is None else f"{x:.1f}" for x in xs) or "-"


def _n(x: int | None) -> str:
    return "-" if x is None else str(x)


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def table(summary: dict[str, Any]) -> str:
    sz = summary["sizes"]
    out = [f"Compiled ({summary['compile_backend']}) stages against eager: {sz['layers']} blocks "
           f"x + Linear(GELU(Linear(LayerNorm(x)))), H={sz['hidden']}, batch {sz['batch']} in {sz['microbatches']} "
           f"microbatches, {summary['world']} gloo ranks, AdamW; {sz['rounds']} rounds x {sz['steps']} steps, the "
           f"first {sz['warmup']} left out (median over the rest; spread: min..max over rounds)", "",
           "pipefold Pipeline:", "",
           "| schedule | mode | step time / eager (same round) | ms | losses vs eager (max rel diff) | "
           "compile s per round (warm-up steps beyond ordinary ones) | compiled backward calls a step |",
           "|---|---|---|---|---|---|---|"]
    for r in summary["pipefold"]:
        out.append(f"| {r['schedule']} | {r['mode']} | {_fmt(r['ratio_to_eager'])} | {_fmt(r['ms'], 1)} | "
                   f"{'-' if r['mode'] == 'eager' else _e(r['loss_max_rel_diff_to_eager'])} | "
                   f"{'-' if r['mode'] == 'eager' else _secs(r['compile_s_per_round'])} | {_n(r['backward_calls'])} |")
    notes = [f"pipefold {r['schedule']} {r['mode']}: failed: {e}" for r in summary["pipefold"] for e in r["errors"]]
    if summary["torch"]:
        out += ["", "torch.distributed.pipelining, each block torch.compile'd (same rounds):", "",
                "| schedule | compiled / eager | eager ms | compiled ms | losses compiled vs eager | "
                "torch eager vs pipefold eager losses | compile s per round | compiled backward calls a step |",
                "|---|---|---|---|---|---|---|---|"]
        for r in summary["torch"]:
            out.append(f"| {r['schedule']} | {_fmt(r['compiled_over_eager'])} | {_fmt(r['eager_ms'], 1)} | "
                       f"{_fmt(r['compiled_ms'], 1)} | {_e(r['loss_max_rel_diff_to_eager'])} | "
                       f"{_e(r['eager_loss_max_rel_diff_to_pipefold_eager'])} | {_secs(r['compile_s_per_round'])} | "
                       f"{_n(r['backward_calls'])} |")
            notes += [f"torch {r['schedule']}: failed: {e}" for e in r["errors"]]
    if summary["torch_zero_bubble"]:
        out += ["", "torch's zero-bubble schedules with compiled blocks (in place: each block's compile(), in "
                "processes of their own, each against an eager run of the same process):", "",
                "| schedule | torch.compile(block) | in place | in place, donated_buffer=False |", "|---|---|---|---|"]
        for r in summary["torch_zero_bubble"]:
            first = r["compiled_error"] or f"runs, {1e3 * r['compiled_ms']:.1f} ms"
            cells = []
            for m in INPLACE:
                ip = r["inplace"].get(m)
                if ip is None:
                    cells.append("not tried")
                elif "ended" in ip:
                    cells.append(f"fails: {ip['ended']}")
                elif ip["error"]:
                    cells.append(f"fails: {ip['error']}")
                else:
                    ratio = "-" if ip["over_eager"] is None else f"{ip['over_eager']:.2f}"
                    em = "-" if ip["eager_ms"] is None else f"{ip['eager_ms']:.1f}"
                    im = "-" if ip["ms"] is None else f"{ip['ms']:.1f}"
                    cells.append(f"runs: {im} ms vs eager {em} ms ({ratio}), losses vs eager "
                                 f"{_e(ip['loss_max_rel_diff_to_eager'])}, compiled backward calls a step "
                                 f"{_n(ip['backward_calls'])}")
                if ip is not None and ip.get("eager_error"):
                    notes.append(f"torch {r['schedule']} eager ({m} process): failed: {ip['eager_error']}")
            out.append(f"| {r['schedule']} | {first} | " + " | ".join(cells) + " |")
    out += ["", f"Compiled backward calls a step: CompiledFunctionBackward events in one more, untimed step under "
            f"torch's profiler (first round), summed over the ranks; each block one region ('whole', torch's "
            f"compiled blocks): {summary['block_microbatches']} = {sz['layers']} blocks x {sz['microbatches']} "
            "microbatches where each region's backward runs once."]
    return "\n".join(out + ([""] + notes if notes else []))


# -- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, metavar="NAME",
                        help=f"pipefold schedules to time (default: {' '.join(SCHEDULES)})")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of eager, split and whole runs back to back, "
                        "their order turning each round (default 4)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of each run's median (default 3)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--no-torch", dest="torch", action="store_false",
                        help="time pipefold only (no torch.distributed.pipelining runs)")
    parser.add_argument("--no-inplace", dest="inplace", action="store_false",
                        help="do not try torch's zero-bubble schedules with blocks compiled in place")
    parser.add_argument("--quick", action="store_true",
                        help="H=64, 1 round of 5 steps, 2 warm-up: checks the script works, its figures mean little")
    parser.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.rounds, args.steps, args.warmup = 64, 1, 5, 2
    for name, low in (("rounds", 1), ("hidden", 1), ("microbatches", 2 * WORLD), ("warmup", 1)):
        if getattr(args, name) < low:
            raise ConfigError(f"--{name} must be at least {low} (got {getattr(args, name)})")
    if args.steps <= args.warmup:
        raise ConfigError(f"--steps must be more than --warmup ({args.warmup}) (got {args.steps})")
    if args.layers < 2 * WORLD or args.layers % (2 * WORLD):
        raise ConfigError(f"--layers must be a multiple of {2 * WORLD}: the V schedules' 4 stages take equal blocks "
                          f"(got {args.layers})")
    if args.batch % args.microbatches:
        raise ConfigError(f"--batch {args.batch} does not split into {args.microbatches} equal microbatches")
    sizes = Sizes(args.hidden, args.layers, args.batch, args.microbatches, args.steps, args.rounds, args.warmup)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every spawned rank
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")  # the first compile is a cold one
        raw, how = _spawn(_main_rank, (sizes, args.schedules, args.torch), tmp, "main")
        if raw is None:
            raise SystemExit(f"compile_speed.py: the timed rounds ended: {how}")
        inplace: dict[str, Any] = {}
        if args.torch and args.inplace:
            for s, run in raw["torch_zb"].items():
                if run["error"] and "OptimizedModule" in run["error"]:
                    print(f"torch {TORCH_ZB[s]} with blocks compiled in place (own processes)", file=sys.stderr,
                          flush=True)
                    inplace[s] = {m: _spawn(_inplace_rank, (sizes, s, TORCH_ZB[s], ("eager", m)), tmp, f"{m}-{s}")
                                  for m in INPLACE}
    summary = summarize(raw, inplace, sizes)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(table(summary))
    print(f"\npython {summary['python']}, torch {summary['torch_version']}, {summary['cpus']} CPUs, "
          f"{summary['seconds']:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1,
                      default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)


if __name__ == "__main__":
    run_script(main)

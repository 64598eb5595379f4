"""Layer offloading on a GPU: peak device memory from the CUDA allocator and time per training step of the plain
model, :class:`~pipefold.runtime.offload.Offloaded` at several k, and ``accelerate.cpu_offload``; gradients and weights
compared with the plain model's.

What runs: one GPT (default 16 blocks of width 2048, 16 heads, batch 4 x 1024 tokens, float32, so that each
block's forward and backward take milliseconds on an H100), built once with ``case.build()`` and deep-copied
into every configuration, so all start from the same weights and see the same batch:

- ``plain``: the whole model on the device;
- ``Offloaded k=K, k'=1`` for each K of ``--ks`` (default 1, 2, 4) and the "half" k, the largest k whose every
  window of k blocks holds at most half the blocks' parameter bytes (:func:`pipefold.runtime.offload.choose_k`);
  the embedding and the head stay on the device, the blocks live in pinned CPU memory;
- ``accelerate.cpu_offload`` (when ``accelerate`` is installed): its hooks copy each module's weights to the
  device for its forward and drop the copy after. It has no training path of its own: the gradients land on
  those throw-away copies, never on a parameter an optimizer holds. So the script keeps the copies each
  forward makes, and after backward brings their gradients into the CPU state dict accelerate keeps and
  steps SGD there (as Offloaded's optimizer steps its CPU home copies). Its time includes that.

Each training step is ``zero_grad``, forward, loss, backward and ``torch.optim.SGD.step`` (no momentum). Three
phases:

1. Memory, each configuration alone: build it, take one warm-up step, zero the gradients, then read
   ``torch.cuda.memory_allocated`` ("before"), ``reset_peak_memory_stats``, one step, and
   ``torch.cuda.max_memory_allocated`` ("peak", absolute: includes the batch and what the model keeps on the
   device) and peak - before ("step rise": what one step adds on top). Then the configuration is deleted,
   ``gc.collect()`` and ``torch.cuda.empty_cache()`` run before the next. Beside it, Offloaded's own
   ``tracker.peak_resident_bytes``: the most parameter bytes it counted on the device at once (embedding
   and head plus the device copies of at most k blocks), an independent cross-check of the allocator's
   figure. A configuration that runs out of device memory says OOM in its row and the others go on.
2. Time: two warm-up steps, then the median of ``--steps`` steps, ``torch.cuda.synchronize()`` before and
   after each. When phase 1 shows every configuration fits on the device at once, they are all built and
   their steps taken round-robin (one step of each in turn), so other load on a shared machine hits all
   alike; otherwise (or on an OOM doing so) each is timed alone, one after the other, and the output says
   so. The optimizer step of the offloaded configurations runs on the CPU: its time depends on the CPU
   threads (``--threads``; the run reports torch's count).
3. Exactness, on the models of phase 2 after their last step: every parameter's gradient (of the last step)
   and weight against the plain model's, largest absolute difference. Offloaded's math is the plain
   model's, so its gradients should differ by exactly 0; its SGD step runs on the CPU, the plain one's on
   the GPU, which may round differently.

Finally, for the half k, the issue's two targets: peak device memory against the plain model's (the
Superpipeline paper claims up to 60% less) and step time (target: at most 1.10x the plain model's).

On a machine without CUDA it runs the same code on the CPU with the memory columns '-': a check that the
script works (use ``--quick``), not a measurement.

    python benchmarks/offload_gpu.py --json offload.json          # on a GPU, the default sizes
    python benchmarks/offload_gpu.py --layers 8 --hidden 1024 --ks 1 2 --steps 20
    OMP_NUM_THREADS=1 python benchmarks/offload_gpu.py --quick    # tiny sizes: anywhere, in seconds
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import importlib.util
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import nn

from pipefold.errors import run_script
from pipefold.runtime.offload import Offloaded, choose_k
from pipefold.train.offload_check import Case, Stacked, make_case

WARMUPS = 2
FULL = {"layers": 16, "hidden": 2048, "heads": 16, "batch": 4, "seq": 1024, "steps": 10}
QUICK = {"layers": 6, "hidden": 64, "heads": 4, "batch": 2, "seq": 32, "steps": 3}
PAPER_REDUCTION = 0.60  # Superpipeline: up to 60% less peak device memory
TIME_TARGET = 1.10  # the target: at most 1.10x the plain model's step time
MIB = 2**20


@dataclass(frozen=True)
class Config:
    name: str
    kind: str
    """``plain``, ``offloaded`` or ``accelerate``."""
    k: int | None = None


class Runner:
    """One configuration, built and ready to train: its model, the tensors its optimizer steps (in the plain
    model's parameter order) and the optimizer."""

    def __init__(self, model: nn.Module, params: list[torch.Tensor], case: Case, lr: float) -> None:
        self.model, self.params, self.case = model, params, case
        self.opt = torch.optim.SGD(params, lr=lr)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def step(self, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
        self.zero_grad()
        self.backward(x, y)
        self.opt.step()

    def backward(self, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
        self.case.loss(self.model(*x), y).backward()

    def grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.params]

    def resident(self) -> tuple[int, int] | None:
        """Peak parameter bytes and blocks on the device by pipefold's tracker (Offloaded only)."""
        tracker = getattr(self.model, "tracker", None)
        return None if tracker is None else (tracker.peak_resident_bytes, tracker.peak_resident_layers)


class AccelerateRunner(Runner):
    """``accelerate.cpu_offload``, with the gradients of the device copies its hooks make carried to the CPU
    state dict it keeps, where SGD steps them (accelerate alone would drop them with the copies)."""

    def __init__(self, model: Stacked, device: torch.device, case: Case, lr: float) -> None:
        from accelerate import cpu_offload
        from accelerate.hooks import SequentialHook

        names = [n for n, _ in model.named_parameters()]
        # What cpu_offload builds itself when given no state dict; passed so that the script holds it.
        state = {n: t.to("cpu") for n, t in model.state_dict().items()}
        prefixes = {m: f"{n}." if n else "" for n, m in model.named_modules()}
        cpu_offload(model, execution_device=device, state_dict=state)
        self.live: list[tuple[str, torch.Tensor]] = []
        for module in model.modules():
            hook = getattr(module, "_hf_hook", None)
            if hook is None:
                continue
            for h in hook.hooks if isinstance(hook, SequentialHook) else [hook]:
                if getattr(h, "offload", False):
                    h.pre_forward = self._keeping(h.pre_forward, prefixes[module],
                                                  recurse=getattr(h, "place_submodules", False))
        super().__init__(model, [state[n] for n in names], case, lr)
        self.state = state

    def _keeping(self, pre_forward: Callable[..., Any], prefix: str, *, recurse: bool) -> Callable[..., Any]:
        def wrapped(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = pre_forward(module, *args, **kwargs)
            self.live += [(prefix + n, p) for n, p in module.named_parameters(recurse=recurse) if p.requires_grad]
            return out
        return wrapped

    def backward(self, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
        self.live.clear()
        self.case.loss(self.model(*x), y).backward()
        for name, p in self.live:
            if p.grad is not None:
                g, home = p.grad.to("cpu"), self.state[name]
                home.grad = g if home.grad is None else home.grad + g
        self.live.clear()


def build(cfg: Config, template: Stacked, case: Case, device: torch.device, lr: float) -> Runner:
    model = copy.deepcopy(template)  # the same weights as case.build(), without initializing them again
    if cfg.kind == "plain":
        model.to(device)
        return Runner(model, list(model.parameters()), case, lr)
    if cfg.kind == "offloaded":
        assert cfg.k is not None
        wrapped = Offloaded(model, device, k=cfg.k, kprime=1)
        return Runner(wrapped, list(wrapped.parameters()), case, lr)
    return AccelerateRunner(model, device, case, lr)


def _attempt(what: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """``fn(*args)`` and no error, or None and ``"OOM"`` (out of device memory) or the error's first line (and its
    traceback on stderr)."""
    try:
        return fn(*args), None
    except torch.cuda.OutOfMemoryError:
        return None, "OOM"
    except Exception as exc:  # one failing configuration must not lose the others' figures
        if isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc):  # re-raised by autograd as such
            return None, "OOM"
        print(f"{what} failed:", file=sys.stderr)
        traceback.print_exc()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _cleanup(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure_memory(cfg: Config, template: Stacked, case: Case, device: torch.device, lr: float,
                   x: tuple[torch.Tensor, ...], y: torch.Tensor) -> dict[str, Any]:
    """Phase 1: the allocator's figures for one training step of ``cfg``, built alone on the device."""
    base = torch.cuda.memory_allocated(device)
    runner = build(cfg, template, case, device, lr)
    runner.step(x, y)  # warm-up: cuBLAS workspaces and the like are allocated here, not in the measured step
    runner.zero_grad()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.step(x, y)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device)
    out = {"peak_bytes": peak, "before_bytes": before, "rise_bytes": peak - before,
           "held_bytes": torch.cuda.memory_allocated(device) - base, "empty_bytes": base}
    resident = runner.resident()
    if resident is not None:
        out["resident_bytes"], out["resident_layers"] = resident
    return out


def _snapshot(runner: Runner) -> dict[str, list[torch.Tensor | None]]:
    return {"grads": [None if g is None else g.detach().to("cpu", copy=True) for g in runner.grads()],
            "weights": [p.detach().to("cpu", copy=True) for p in runner.params]}


def _compare(runner: Runner, ref: dict[str, list[torch.Tensor | None]] | None) -> dict[str, Any]:
    """Largest absolute difference of the gradients and of the weights from the plain model's."""
    if ref is None:
        return {"grad_diff": None, "weight_diff": None, "grads_missing": None}
    grad_diff = weight_diff = 0.0
    missing = 0
    for g, g_ref in zip(runner.grads(), ref["grads"], strict=True):
        if g is None or g_ref is None:
            missing += (g is None) != (g_ref is None)
            continue
        grad_diff = max(grad_diff, float((g.detach().cpu() - g_ref).abs().max()))
    for p, p_ref in zip(runner.params, ref["weights"], strict=True):
        assert p_ref is not None and p.shape == p_ref.shape
        weight_diff = max(weight_diff, float((p.detach().cpu() - p_ref).abs().max()))
    return {"grad_diff": grad_diff, "weight_diff": weight_diff, "grads_missing": missing}


def _timed(runner: Runner, x: tuple[torch.Tensor, ...], y: torch.Tensor, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    runner.step(x, y)
    sync()
    return time.perf_counter() - start


class _OutOfMemory(Exception):
    """An OOM with every configuration on the device at once: time them one after the other instead."""


def time_round_robin(configs: list[Config], make: Callable[[Config], Runner], steps: int,
                     x: tuple[torch.Tensor, ...], y: torch.Tensor, sync: Callable[[], None]) -> dict[str, dict]:
    """Phase 2 (and 3) with every configuration built at once and one step of each taken in turn."""
    results: dict[str, dict[str, Any]] = {}
    runners: dict[str, Runner] = {}
    try:
        for cfg in configs:
            runner, error = _attempt(f"building {cfg.name}", make, cfg)
            if error == "OOM":
                raise _OutOfMemory
            if error is not None:
                results[cfg.name] = {"time_error": error}
            else:
                runners[cfg.name] = runner
                results[cfg.name] = {"step_seconds": []}
        for i in range(WARMUPS + steps):
            for name, runner in list(runners.items()):
                seconds, error = _attempt(f"a step of {name}", _timed, runner, x, y, sync)
                if error == "OOM":
                    raise _OutOfMemory
                if error is not None:
                    results[name] = {"time_error": error}
                    del runners[name]
                elif i >= WARMUPS:
                    results[name]["step_seconds"].append(seconds)
        ref = _snapshot(runners["plain"]) if "plain" in runners else None
        for name, runner in runners.items():
            results[name].update(_compare(runner, ref))
            resident = runner.resident()
            if resident is not None:
                results[name]["resident_bytes"], results[name]["resident_layers"] = resident
        return results
    finally:
        runners.clear()


def time_one_by_one(configs: list[Config], make: Callable[[Config], Runner], steps: int,
                    x: tuple[torch.Tensor, ...], y: torch.Tensor, sync: Callable[[], None],
                    cleanup: Callable[[], None]) -> dict[str, dict]:
    """Phase 2 (and 3) with each configuration built, timed and compared alone, the plain model first."""
    results: dict[str, dict[str, Any]] = {}
    ref = None

    def run(cfg: Config) -> dict[str, Any]:
        nonlocal ref
        runner = make(cfg)
        seconds = [_timed(runner, x, y, sync) for _ in range(WARMUPS + steps)][WARMUPS:]
        if cfg.kind == "plain":
            ref = _snapshot(runner)
        out: dict[str, Any] = {"step_seconds": seconds, **_compare(runner, ref)}
        resident = runner.resident()
        if resident is not None:
            out["resident_bytes"], out["resident_layers"] = resident
        return out

    for cfg in configs:
        got, error = _attempt(f"timing {cfg.name}", run, cfg)
        results[cfg.name] = got if error is None else {"time_error": error}
        cleanup()
    return results


def _fits_at_once(memory: dict[str, dict[str, Any]], device: torch.device) -> tuple[bool, str]:
    """Whether every configuration can sit on the device at once, each stepping in turn (phase 1's figures)."""
    held = {n: m["held_bytes"] for n, m in memory.items()}
    need = max(sum(held.values()) - held[n] + m["peak_bytes"] - m["empty_bytes"] for n, m in memory.items())
    free = torch.cuda.mem_get_info(device)[0]
    fits = need <= 0.9 * free  # room for the allocator's fragmentation
    return fits, f"need about {need / MIB:,.0f} MiB at once, {free / MIB:,.0f} MiB free"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.1f}"


def _diff(d: float | None, missing: int | None) -> str:
    if d is None:
        return "-"
    text = "0" if d == 0 else f"{d:.1e}"
    return f"{text} ({missing} missing)" if missing else text


def _finite(obj: Any) -> Any:
    """JSON without NaN or Infinity."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def collect_rows(configs: list[Config], memory: dict[str, dict[str, Any]], memory_errors: dict[str, str],
                 results: dict[str, dict[str, Any]], total_bytes: int) -> list[dict[str, Any]]:
    """One JSON-ready row per configuration (the plain model first): phase 1's and phase 2's figures, the
    median step time, and the ratios of time and peak memory to the plain model's."""
    rows: list[dict[str, Any]] = []
    for cfg in configs:
        row: dict[str, Any] = {"name": cfg.name, "kind": cfg.kind, "k": cfg.k, "kprime": 1 if cfg.k else None}
        row.update(memory.get(cfg.name, {}))
        if cfg.name in memory_errors:
            row["memory_error"] = memory_errors[cfg.name]
        timing = results.get(cfg.name, {"time_error": memory_errors.get(cfg.name, "not run")})
        for key, value in timing.items():
            if key in ("resident_bytes", "resident_layers"):  # the same tracker figures in both phases
                row[key] = max(row.get(key, 0), value)
            else:
                row[key] = value
        if row.get("step_seconds"):
            row["seconds"] = statistics.median(row["step_seconds"])
        rows.append(row)
    plain = rows[0]
    for row in rows:
        if "seconds" in row and "seconds" in plain:
            row["time_ratio"] = row["seconds"] / plain["seconds"]
        if "peak_bytes" in row and "peak_bytes" in plain:
            row["peak_ratio"] = row["peak_bytes"] / plain["peak_bytes"]
    if "time_error" not in plain:
        plain["resident_bytes"] = total_bytes  # all of it, by construction: no tracker
    return rows


def report(console: Console, rows: list[dict[str, Any]], title: str, template: Stacked, half: int, *,
           measured: bool) -> dict[str, Any]:
    """Print the table and the half-memory k's two targets; return the targets' figures."""
    table = Table(title=title, title_justify="left")
    for col in ("", "peak MiB", "step rise MiB", "peak vs plain", "params on device MiB", "s/step", "vs plain",
                "grad diff", "weight diff"):
        table.add_column(col, justify="right" if col else "left")
    for row in rows:
        if "memory_error" in row:
            mem = [row["memory_error"]] * 3
        else:
            mem = [_mib(row.get("peak_bytes")), _mib(row.get("rise_bytes")),
                   f"{row['peak_ratio']:.2f}" if "peak_ratio" in row else "-"]
        resident = _mib(row.get("resident_bytes"))
        if row["kind"] == "offloaded" and "resident_layers" in row:
            resident += f" ({row['resident_layers']} blocks)"
        elif row["kind"] == "plain" and resident != "-":
            resident += " (all)"
        if "time_error" in row:
            when = [row["time_error"], "-", "-", "-"]
        else:
            exact = row["kind"] == "plain"
            when = [f"{row['seconds']:.4f}", f"{row['time_ratio']:.2f}x" if "time_ratio" in row else "-",
                    "ref" if exact else _diff(row.get("grad_diff"), row.get("grads_missing")),
                    "ref" if exact else _diff(row.get("weight_diff"), None)]
        table.add_row(row["name"], *mem, resident, *when)
    console.print(table)
    console.print(f"params: {template.total_bytes / MIB:,.1f} MiB in all, {template.block_bytes[0] / MIB:,.1f} MiB "
                  f"a block, {template.static_bytes / MIB:,.1f} MiB embedding and head (always on the device). "
                  "peak: torch.cuda.max_memory_allocated over one step; step rise: peak minus memory_allocated "
                  "before it; params on device: pipefold's tracker (plain: all of them); diffs: largest |a - b| "
                  "against the plain model after the last step.")

    plain = rows[0]
    half_row = next(r for r in rows if r["kind"] == "offloaded" and r["k"] == half)
    targets: dict[str, Any] = {"k": half, "paper_reduction": PAPER_REDUCTION, "time_target": TIME_TARGET,
                               "reduction": None, "time_ratio": half_row.get("time_ratio")}
    if "peak_ratio" in half_row:
        targets["reduction"] = 1 - half_row["peak_ratio"]
        memory_text = (f"{_mib(half_row['peak_bytes'])} MiB against {_mib(plain['peak_bytes'])} MiB: "
                       f"{targets['reduction']:.1%} less (the Superpipeline paper claims up to {PAPER_REDUCTION:.0%})")
    else:
        why = (half_row.get("memory_error") or plain.get("memory_error", "-")) if measured else "no CUDA device"
        memory_text = f"not measured ({why})"
    if targets["time_ratio"] is not None:
        met = "met" if targets["time_ratio"] <= TIME_TARGET else "not met"
        time_text = f"{targets['time_ratio']:.2f}x the plain model's (target at most {TIME_TARGET:.2f}x: {met})"
    else:
        time_text = "not measured"
    console.print(f"Half-memory k={half}: peak device memory {memory_text}; step time {time_text}"
                  + ("" if measured else "; on the CPU neither figure means anything"))
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help=f"transformer blocks (default {FULL['layers']})")
    parser.add_argument("--hidden", type=int, help=f"width (default {FULL['hidden']})")
    parser.add_argument("--heads", type=int, help=f"attention heads (default {FULL['heads']})")
    parser.add_argument("--batch", type=int, help=f"sequences per batch (default {FULL['batch']})")
    parser.add_argument("--seq", type=int, help=f"tokens per sequence (default {FULL['seq']})")
    parser.add_argument("--steps", type=int, help=f"timed training steps after {WARMUPS} warm-ups "
                                                  f"(default {FULL['steps']})")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4],
                        help="k values for Offloaded (k'=1); the half-memory k is added")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (the CPU side: offloaded SGD steps)")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny sizes ({', '.join(f'--{k} {v}' for k, v in QUICK.items())}) unless given")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    console = Console(width=170, markup=False)  # error messages and names in the table are not markup
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "batch", "seq")}

    started = time.perf_counter()

    def phase(text: str) -> None:  # one line a step of the way: a run cut short shows where it was
        console.print(f"[dim]{time.perf_counter() - started:6.1f} s  {escape(text)}[/dim]", markup=True)

    case = make_case("gpt", device=device.type, **sizes)
    phase(f"building the template model on the CPU ({torch.get_num_threads()} threads)")
    template = case.build()
    blocks = template.block_bytes
    half = choose_k(blocks, sum(blocks) // 2)[0]
    ks = sorted({k for k in args.ks if 1 <= k <= args.layers} | {half})
    if dropped := sorted(set(args.ks) - set(ks)):
        console.print(f"k = {', '.join(map(str, dropped))} skipped: k must be 1 to {args.layers} (the blocks)")
    configs = [Config("plain", "plain")]
    configs += [Config(f"Offloaded k={k}, k'=1" + (" (half)" if k == half else ""), "offloaded", k) for k in ks]
    if importlib.util.find_spec("accelerate") is None:
        accelerate = "not installed: skipped"
        console.print("accelerate is not installed here: accelerate.cpu_offload skipped")
    else:
        accelerate = importlib.metadata.version("accelerate")
        configs.append(Config("accelerate.cpu_offload", "accelerate"))
    xs, target = case.data()
    x, y = tuple(t.to(device) for t in xs), target.to(device)

    def make(cfg: Config) -> Runner:
        return build(cfg, template, case, device, args.lr)

    def cleanup() -> None:
        _cleanup(cuda)

    # Phase 1: memory, each configuration alone.
    memory: dict[str, dict[str, Any]] = {}
    memory_errors: dict[str, str] = {}
    if cuda:
        for cfg in configs:
            phase(f"memory: {cfg.name}")
            cleanup()
            got, error = _attempt(f"measuring the memory of {cfg.name}", measure_memory, cfg, template, case,
                                  device, args.lr, x, y)
            if error is None:
                memory[cfg.name] = got
            else:
                memory_errors[cfg.name] = error
            cleanup()

    # Phases 2 and 3: time, then gradients and weights against the plain model's.
    timed = [c for c in configs if memory_errors.get(c.name) != "OOM"]
    if not cuda:
        fits, why = True, "the CPU"
    elif memory:
        fits, why = _fits_at_once(memory, device)
    else:
        fits, why = False, "no memory figures"
    results = None
    if fits:
        mode = "round-robin"
        phase(f"time: {len(timed)} configurations, {args.steps} steps each, round-robin")
        try:
            results = time_round_robin(timed, make, args.steps, x, y, sync)
        except _OutOfMemory:
            why = "out of device memory with all of them at once"
        cleanup()
    if results is None:
        mode = "one after the other"
        console.print(f"[bold]Timing each configuration alone, one after the other[/bold] ({escape(why)}): load "
                      "from other processes may hit them unevenly", markup=True)
        results = time_one_by_one(timed, make, args.steps, x, y, sync, cleanup)
    phase("done")

    rows = collect_rows(configs, memory, memory_errors, results, template.total_bytes)
    gpu = torch.cuda.get_device_name(device) if cuda else None
    title = (f"gpt: {args.layers} blocks, width {args.hidden}, {args.heads} heads, batch {args.batch} x {args.seq} "
             f"tokens, float32, {gpu or 'CPU (not a measurement)'}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} CPU threads; median of {args.steps} SGD steps, {mode}")
    targets = report(console, rows, title, template, half, measured=cuda)

    if args.json:
        info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device), "gpu": gpu,
                "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "cpu_threads": torch.get_num_threads(),
                "accelerate": accelerate, "model": "gpt", "dtype": "float32", **sizes, "steps": args.steps,
                "warmups": WARMUPS, "lr": args.lr, "timing": mode, "timing_why": why, "half_k": half,
                "param_bytes": {"total": template.total_bytes, "static": template.static_bytes, "blocks": blocks},
                "targets": targets, "rows": rows}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(_finite(info), fh, indent=1)
            fh.write("\n")
    if any(e != "OOM" for r in rows for e in (r.get("memory_error"), r.get("time_error")) if e):
        sys.exit(1)  # a configuration failed for another reason than device memory: its traceback is above


if __name__ == "__main__":
    run_script(main)

"""The runner's own host work per pass: one stage's F and backward on pipefold's stage runner against plain torch.

At a tiny width the arithmetic of a pass is a few microseconds, so what a pass costs is the host's work: torch's
(launching each operation, autograd's graph and engine) and, on pipefold's runner, its own (the saved-tensor
hooks, the memory meter's count of every storage it keeps, the bookkeeping of a microbatch between its F, B and
W). On a GPU at small widths the host is the bottleneck and this work is the step
(benchmarks/results/host_profile.md); on the CPU it is what a pass of a small layer pays beyond its arithmetic.

Timed side by side, in rounds that alternate the ways (so the machine's drift hits each alike), one thread:

- ``torch F+BW``: the stage's forward and ``backward()``, plain autograd (the reference);
- ``torch hooks F+BW``: the same under ``saved_tensors_hooks`` that only detach: what hooking every saved tensor
  costs by itself;
- ``runner F+BW``: :class:`pipefold.runtime.stage.StageRunner`'s F then BW;
- ``torch F+B+W``: the forward, then ``autograd.grad`` towards the input (keeping the graph), then towards the
  weights: the split as plain autograd makes it;
- ``runner F+B+W``: the runner's F, B and W.

Each figure is the median of a round's mean over ``--reps`` iterations, microseconds a stage pass; the runner's
overhead is its time less torch's, per way.

    OMP_NUM_THREADS=1 python benchmarks/pass_overhead.py [--hidden 16] [--layers 4] [--rows 8] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pipefold.errors import run_script
from pipefold.models.mlp import MLPConfig, build_mlp_layers
from pipefold.runtime.stage import Chain, StageRunner


def ways(hidden: int, layers: int, rows: int) -> dict[str, Callable[[], None]]:
    """Each way of running one microbatch through a middle stage of ``layers`` MLP blocks, as a function."""
    built = build_mlp_layers(MLPConfig(hidden=hidden, layers=layers + 2), range(1, layers + 1))
    stage = Chain(*(built[i] for i in range(1, layers + 1)))
    params = [p for p in stage.parameters() if p.requires_grad]
    x, g = torch.randn(rows, hidden), torch.randn(rows, hidden)
    runner = StageRunner(stage)

    def torch_bw() -> None:
        stage(x.detach().requires_grad_()).backward(g)

    def hooks_bw() -> None:
        with torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, _same):
            y = stage(x.detach().requires_grad_())
        y.backward(g)

    def torch_split() -> None:
        xi = x.detach().requires_grad_()
        y = stage(xi)
        torch.autograd.grad(y, xi, g, retain_graph=True)
        torch.autograd.grad(y, params, g)

    def runner_bw() -> None:
        runner.forward(0, (x,))
        runner.backward(0, (g,))

    def runner_split() -> None:
        runner.forward(0, (x,))
        runner.backward_input(0, (g,))
        runner.backward_weight(0)

    return {"torch F+BW": torch_bw, "torch hooks F+BW": hooks_bw, "runner F+BW": runner_bw,
            "torch F+B+W": torch_split, "runner F+B+W": runner_split}


def _same(t: Any) -> Any:
    return t


def measure(hidden: int, layers: int, rows: int, rounds: int, reps: int) -> dict[str, Any]:
    """Per way, the median over ``rounds`` of a round's mean seconds over ``reps`` calls, and its range; and the
    executing thread's CPU seconds over the same calls against their wall time (one thread: about 1)."""
    torch.set_num_threads(1)
    funcs = ways(hidden, layers, rows)
    for f in funcs.values():  # warm-up: the allocator, autograd's first graph
        for _ in range(max(5, reps // 5)):
            f()
    means: dict[str, list[float]] = {name: [] for name in funcs}
    cpu: dict[str, list[float]] = {name: [] for name in funcs}
    for _ in range(rounds):
        for name, f in funcs.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(reps):
                f()
            wall = time.perf_counter() - t0
            means[name].append(wall / reps)
            cpu[name].append((time.thread_time() - c0) / wall)
    out: dict[str, Any] = {"hidden": hidden, "layers": layers, "rows": rows, "rounds": rounds, "reps": reps,
                           "torch": torch.__version__, "ways": {}}
    for name, values in means.items():
        out["ways"][name] = {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values),
                             "cpu_over_wall": statistics.median(cpu[name])}
    w = out["ways"]
    out["runner_over_torch_s"] = {"F+BW": w["runner F+BW"]["median_s"] - w["torch F+BW"]["median_s"],
                                  "F+B+W": w["runner F+B+W"]["median_s"] - w["torch F+B+W"]["median_s"],
                                  "hooks alone": w["torch hooks F+BW"]["median_s"] - w["torch F+BW"]["median_s"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4, help="MLP blocks in the stage")
    ap.add_argument("--rows", type=int, default=8, help="rows of a microbatch")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=200, help="calls timed together in a round")
    ap.add_argument("--json", action="store_true", help="print every figure as JSON")
    args = ap.parse_args()
    for name in ("hidden", "layers", "rows", "rounds", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    got = measure(args.hidden, args.layers, args.rows, args.rounds, args.reps)
    if args.json:
        print(json.dumps(got, indent=1))
        return
    print(f"one stage of {args.layers} MLP blocks, width {args.hidden}, {args.rows} rows; us a microbatch, median of "
          f"{args.rounds} rounds of {args.reps} (min..max); CPU / wall of the thread")
    for name, w in got["ways"].items():
        print(f"  {name:18} {w['median_s'] * 1e6:8.1f}  ({w['min_s'] * 1e6:.1f}..{w['max_s'] * 1e6:.1f})  "
              f"{w['cpu_over_wall']:.2f}")
    over = got["runner_over_torch_s"]
    print(f"the runner's own work: F+BW {over['F+BW'] * 1e6:.1f} us, F+B+W {over['F+B+W'] * 1e6:.1f} us "
          f"(the hooks alone {over['hooks alone'] * 1e6:.1f} us)")


if __name__ == "__main__":
    run_script(main)

"""Data-parallel pipelines: per-rank memory with and without FSDP, and step time against one pipeline.

A GPT (8 blocks, width 512, 8 heads, 16 tokens: 25 M parameters with the embedding and head) on pp=2
pipelines of 1F1B, 4 microbatches of 2 sequences per pipeline and step (weak scaling: every pipeline gets
the batch that one pipeline gets alone), AdamW. For dp = 2 and 4, three ways of reducing the gradients:

    all-reduce   every copy keeps the whole stage: parameters, gradients, AdamW's two moments (4 P bytes x 4)
    zero1        the moments sharded (ZeRO-1: pipefold.runtime.zero.ShardedOptimizer)
    fsdp         everything sharded (torch's fully_shard per stage), the stage gathered from AG to RS

Memory, per rank of the first pipeline: what it keeps between steps (``static``: parameters, gradients and
optimizer state, measured from the tensors' storages), against the closed form from the parameter count P
of its layers (counted here, from the model itself), and the process's peak resident memory from the OS
(``ru_maxrss``, glibc's mmap threshold fixed so that freed tensors leave it), less that of a bare rank (a
2-layer MLP of width 8: torch, gloo and the runtime). FSDP also holds the gathered parameters and their
gradients (2 x 4 P bytes) from a stage's AG to its RS: what it holds at its peak is 16 P / dp + 8 P, not
16 P, so it pays off in peak memory beyond dp = 2; activations and the optimizer's temporaries come on top.

Step time: the median step (steps after the first) of the dp x pp job, against dp independent one-pipeline
jobs run at the same time on the same machine. Both have dp x pp processes sharing the same cores, so their
ratio is what reducing across the pipelines costs, not what sharing cores costs.

    python benchmarks/dataparallel.py [--runs 3] [--dp 2 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from rich.console import Console
from rich.table import Table

from pipefold.errors import run_script
from pipefold.units import format_bytes

MODEL = ["--model", "gpt", "--layers", "8", "--hidden", "512", "--heads", "8", "--seq", "16"]
PP, MICROBATCHES, PER_PIPELINE = 2, 4, 8


BARE = ["--model", "mlp", "--layers", "2", "--hidden", "8"]


def _train(dp: int, way: str, steps: int, model: list[str] = MODEL) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "pipefold", "train", "--schedule", "1f1b", "--pp", str(PP), "--dp", str(dp),
            "-m", str(MICROBATCHES), "--batch", str(PER_PIPELINE * dp), "--steps", str(steps), "--partition",
            "even", *model, "--json"]
    if way == "fsdp":
        argv.append("--fsdp")
    elif way == "zero1":
        argv.append("--zero1")
    # A fixed mmap threshold: glibc then maps every allocation over 64 kB on its own and unmaps it when freed,
    # so the resident memory follows the live tensors instead of keeping what a heap once held.
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tempfile.gettempdir())


def _result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=900)
    if proc.returncode:
        raise SystemExit(f"a run failed: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}")
    result: dict[str, object] = json.loads(out)
    return result


def _median_step(result: dict[str, object]) -> float:
    times = result["step_time_s"]
    assert isinstance(times, list)
    return statistics.median(times[1:])


def parameters_per_rank() -> list[int]:
    """P of each device's layers under the even split, counted on the model itself."""
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    config = RunSpec.flat(schedule="1f1b", devices=PP, microbatches=MICROBATCHES, steps=1, model="gpt", layers=8,
                         hidden=512, heads=8, seq=16, batch=PER_PIPELINE, partition="even")
    job = make_job(config)
    layers = job.build_layers(list(range(job.extra["num_layers"])))
    return [sum(p.numel() for i in job.layer_stages[d] for p in layers[i].parameters()) for d in range(PP)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    console = Console(width=200, markup=False)  # the whole table, spreads included
    params = parameters_per_rank()
    console.print(f"parameters per rank (P): {params}; 16 P bytes = {[format_bytes(16 * p) for p in params]}")
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    alone: dict[int, list[float]] = {}
    bare: list[int] = []  # a rank's peak resident memory with next to no model: torch, gloo, the runtime
    for run in range(args.runs):
        bare += _result(_train(1, "all-reduce", args.steps, BARE))["peak_process_bytes"]  # type: ignore[arg-type]
        for dp in args.dp:
            for way in ("all-reduce", "zero1", "fsdp"):
                rows.setdefault((dp, way), []).append(_result(_train(dp, way, args.steps)))
            # dp independent pipelines at once: as many processes on the same cores, nothing reduced between them.
            procs = [_train(1, "all-reduce", args.steps) for _ in range(dp)]
            alone.setdefault(dp, []).append(statistics.median(_median_step(_result(p)) for p in procs))
        console.print(f"run {run + 1}/{args.runs} done")
    table = Table(title="per rank of the first pipeline (median over runs; min..max)")
    base = statistics.median(bare)
    console.print(f"a bare rank's peak resident memory: {format_bytes(base)} (median of {len(bare)})")
    for col in ("dp", "reduce", "static (rank 0, 1)", "closed form", "peak RSS - bare (rank 0, 1)",
                "held at peak, closed form", "step (s)", "step / dp independent pipelines"):
        table.add_column(col, justify="right")
    for (dp, way), results in rows.items():
        static = [statistics.median(int(r["static_bytes"][d]) for r in results) for d in range(PP)]
        rss = [statistics.median(int(r["peak_process_bytes"][d]) for r in results) for d in range(PP)]
        closed: list[float] = {"all-reduce": [16.0 * p for p in params], "zero1": [8 * p + 8 * p / dp for p in params],
                  "fsdp": [16 * p / dp for p in params]}[way]
        # At the peak FSDP also holds the gathered parameters and their gradients (8 P bytes).
        at_peak = [c + (8 * p if way == "fsdp" else 0) for c, p in zip(closed, params, strict=True)]
        steps = [_median_step(r) for r in results]
        ratios = [s / a for s, a in zip(steps, alone[dp], strict=True)]
        table.add_row(str(dp), way, ", ".join(format_bytes(x) for x in static),
                      ", ".join(format_bytes(x) for x in closed), ", ".join(format_bytes(x - base) for x in rss),
                      ", ".join(format_bytes(x) for x in at_peak),
                      f"{statistics.median(steps):.3f} ({min(steps):.3f}..{max(steps):.3f})",
                      f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})")
    console.print(table)
    console.print("dp independent pipelines, median step (s): "
                  + ", ".join(f"dp={dp}: {statistics.median(v):.3f}" for dp, v in alone.items()))


if __name__ == "__main__":
    run_script(main)

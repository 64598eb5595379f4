"""Recomputation on real runs: memory saved and time paid by none, auto and full, side by side.

    python benchmarks/bench_recompute.py [--schedule 1f1b] [--devices 4] [--steps 6] [--hidden 128] [--seq 128]

Trains the same GPT three times on local ranks (gloo on CPU): keeping every
activation, recomputing per stage to a budget halfway between the two
extremes, and recomputing every layer. Reports each rank's measured peak of
bytes held for backward plus weights, gradients and AdamW state, against the
budget, and the median step time as a ratio to no recomputation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from pipefold.errors import run_script
from pipefold.plan.recompute import plan_recompute, smallest_budget
from pipefold.train.prepare import make_job
from pipefold.train.run import train
from pipefold.train.spec import RunSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128, help="the GPT's width (smaller: a quicker check)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base: dict[str, Any] = dict(schedule=args.schedule, devices=args.devices, microbatches=8, steps=args.steps,
                                model="gpt", layers=10, hidden=args.hidden, heads=4, batch=32, seq=args.seq,
                                partition="params")
    full_plan = make_job(RunSpec.flat(**base, recompute="full")).extra["recompute"]
    schedule = RunSpec.flat(**base).schedule.built
    none_plan = plan_recompute(schedule, full_plan.profiles, "none")
    budget = (smallest_budget(schedule, full_plan.profiles) + max(none_plan.peak)) / 2
    rows: dict[str, dict[str, Any]] = {}
    for mode in ("none", "auto", "full"):
        extra = {"memory_budget": budget} if mode == "auto" else {}
        job, reports = train(RunSpec.flat(**base, recompute=mode, **extra))
        plan = job.extra.get("recompute") or none_plan
        saved = [r.steps.peak_activation_bytes for r in reports]
        steps = [max(r.steps[i].wall for r in reports) for i in range(1, args.steps)]
        rows[mode] = {"layers": list(plan.layers), "peak_bytes": [st + sv for st, sv in zip(plan.static, saved,
                                                                                              strict=True)],
                      "median_step_s": statistics.median(steps)}
    for row in rows.values():
        row["step_ratio"] = row["median_step_s"] / rows["none"]["median_step_s"]
        row["peak_ratio"] = max(row["peak_bytes"]) / max(rows["none"]["peak_bytes"])
    if args.json:
        print(json.dumps({"budget": budget, **rows}))
        return
    print(f"{args.schedule} on {args.devices} ranks, GPT 10 blocks of width {args.hidden}, "
          f"budget {budget / 2**20:.1f} MiB per device")
    print(f"{'mode':6} {'layers':14} {'peak per rank (MiB)':28} {'max/none':>9} {'step (s)':>9} {'vs none':>8}")
    for mode, row in rows.items():
        peaks = " ".join(f"{x / 2**20:5.1f}" for x in row["peak_bytes"])
        print(f"{mode:6} {str(row['layers']):14} {peaks:28} {row['peak_ratio']:9.2f} "
              f"{row['median_step_s']:9.3f} {row['step_ratio']:8.2f}")


if __name__ == "__main__":
    run_script(main)

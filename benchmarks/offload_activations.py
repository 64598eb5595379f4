"""Activation offloading (PipeOffload) on real runs: the share of activations offloaded against each rank's peak
and the step time, beside the simulator's prediction.

    python benchmarks/offload_activations.py [--schedules 1f1b interleaved-1f1b] [--shares 0 0.5 1]
                                             [--devices 4] [--steps 4] [--hidden 256] [--seq 128]
                                             [--device cpu] [--json]

A GPT (8 blocks, 4 heads, batch 16 of --seq tokens, 8 microbatches) trains on local ranks (gloo on the CPU), once
per schedule and share: ``train --offload-activations SHARE``, the longest-lived (stage, microbatch)s first. Each
rank reports the peak of bytes it held for the step (the runtime's meter, which ``tests/test_memory.py`` checks
against torch's MemTracker: on a CPU the "device" is this account, and host copies are kept out of it), the bytes
its offloads moved, and its step time. The prediction feeds the simulator what the plain run measured per stage
(pass times, the bytes one microbatch holds) and what this run's offloads moved per microbatch, and simulates the
offloaded schedule: each rank's peak, and the step time with the copies beside the compute (on a GPU's copy
engine). On a CPU the copies are memcpys on the rank's own thread, so the measured time pays them in full: the
step time here is an upper bound of what a GPU pays, and the memory is what it saves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from typing import Any

from pipefold.errors import run_script
from pipefold.runtime.measure.timeline import measured_costs
from pipefold.schedules.offload import offloaded_pairs
from pipefold.sim.simulate import simulate
from pipefold.train.run import train
from pipefold.train.spec import RunSpec


def run(schedule: str, share: float, args: argparse.Namespace) -> tuple[Any, list[Any]]:
    cfg = RunSpec.flat(schedule=schedule, devices=args.devices, microbatches=8, steps=args.steps, model="gpt",
                       layers=8, hidden=args.hidden, heads=4, seq=args.seq, batch=16, partition="params",
                       offload_activations=share or None, device=args.device)
    return train(cfg)


def median_step(reports: list[Any]) -> float:
    """The median over the steps after the first of the slowest rank's schedule time."""
    return statistics.median(max(r.steps[i].wall for r in reports) for i in range(1, len(reports[0].steps)))


def predicted(plain_cost: Any, job: Any, reports: list[Any]) -> tuple[list[float], float]:
    """Each rank's peak and the step time the simulator predicts for this run's schedule, from the plain run's
    measured costs and this run's bytes moved per microbatch and copy times."""
    moved = {s: b for r in reports for s, b in r.steps[-1].offloaded.items()}
    copies = measured_costs(job.schedule, reports, len(reports[0].steps) - 1).stage_overrides
    over = {s: dataclasses.replace(o, offloaded=float(moved[s]) if s in moved else 0.0,
                                   offload=copies[s].offload if s in copies else None)
            for s, o in plain_cost.stage_overrides.items()}
    result = simulate(job.schedule, dataclasses.replace(plain_cost, stage_overrides=over))
    return result.peak_memory, result.makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved-1f1b"])
    parser.add_argument("--shares", nargs="+", type=float, default=[0.0, 0.5, 1.0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the ranks compute (cuda: a GPU per rank, or the ranks sharing one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for schedule in args.schedules:
        plain_job, plain = run(schedule, 0.0, args)
        plain_cost = measured_costs(plain_job.schedule, plain, len(plain[0].steps) - 1)
        base_peaks = [r.steps[-1].peak_activation_bytes for r in plain]
        base_time = median_step(plain)
        for share in args.shares:
            job, reports = (plain_job, plain) if share == 0 else run(schedule, share, args)
            peaks = [r.steps[-1].peak_activation_bytes for r in reports]
            want_peaks, want_time = predicted(plain_cost, job, reports)
            want_base = simulate(plain_job.schedule, plain_cost)
            rows.append({
                "schedule": schedule, "share": share,
                "offloaded": len(offloaded_pairs(job.schedule)),
                "peak_bytes": peaks, "predicted_peak_bytes": [round(x) for x in want_peaks],
                "peak_ratio": max(peaks) / max(base_peaks),
                "predicted_peak_ratio": max(want_peaks) / max(want_base.peak_memory),
                "host_peak_bytes": [r.steps[-1].host_peak_bytes for r in reports],
                "step_s": median_step(reports), "step_ratio": median_step(reports) / base_time,
                "predicted_step_ratio": want_time / want_base.makespan,
            })
    if args.json:
        print(json.dumps(rows))
        return
    print(f"GPT 8 blocks, hidden {args.hidden}, {args.seq} tokens, batch 16, 8 microbatches, {args.devices} ranks")
    print(f"{'schedule':18} {'share':>5} {'OF':>4} {'peak per rank (MiB)':28} {'predicted (MiB)':28} "
          f"{'max/plain':>9} {'pred':>6} {'step/plain':>10} {'pred':>6}")
    for r in rows:
        mib = " ".join(f"{x / 2**20:5.1f}" for x in r["peak_bytes"])
        want = " ".join(f"{x / 2**20:5.1f}" for x in r["predicted_peak_bytes"])
        print(f"{r['schedule']:18} {r['share']:5.2f} {r['offloaded']:4d} {mib:28} {want:28} {r['peak_ratio']:9.2f} "
              f"{r['predicted_peak_ratio']:6.2f} {r['step_ratio']:10.2f} {r['predicted_step_ratio']:6.2f}")


if __name__ == "__main__":
    run_script(main)

"""Where a pipefold step's time goes, rank by rank: compute, waiting for a message, waiting for a send's delivery,
and the runtime's own work between passes; against the simulated ideal of the same measured passes.

The run is vs_torch.py's: the ``mlp`` model (H=512, 8 layers, batch 64 in 8 microbatches, SGD, an even split) on
2 local gloo processes, one thread each. For each schedule and rank, medians over the steps after the first:

- ``step``: the executor's wall time of the step;
- ``compute``: the passes (F, B, W, BW), from the executor's own events;
- ``recv wait`` and ``send wait``: time spent blocked on a receive, or on the delivery of the sends the schedule
  says were received by then (and at the step's end);
- ``runtime``: the rest, the executor's work between passes (posting receives and sends, bookkeeping, the meter,
  the watch's activity), step - compute - waits;
- ``cpu``: the operating system's CPU seconds of the rank's process during the step (every thread: the link
  threads and gloo's included), an account independent of the executor's events; ``pass cpu``: the passes' own
  CPU seconds on the executor's thread (on the CPU), which ``compute`` exceeds by the time they waited for a core;
- ``util``: compute / the slowest rank's step (the job's step time), against ``ideal``: the same ratio in the
  simulation of the schedule fed with the passes' measured median times
  (:func:`pipefold.runtime.measure.timeline.measured_costs`), which has no runtime work and no waits but those the
  schedule's dependencies make; and ``replay``: the same ratio with each step's own pass times, each action
  starting as soon as its rank and inputs allow (:func:`pipefold.runtime.measure.timeline.replayed_busy`), the median
  over
  steps: no runtime work and no message time either, but the passes' variation from step to step kept.
- ``slowest``: how far the passes spread, from the ranks' own events: for each kind of pass on the rank (F, B, W,
  BW), its slowest over its median, over the steps after the first; the largest of these. A pass that is slow in
  every step (a step's first BW, when its gradients' pages are fresh: ``pipefold.runtime.host_memory``) shows
  here and in ``replay``, not in ``ideal``.

    OMP_NUM_THREADS=1 python benchmarks/runtime_breakdown.py [--steps 10] [--json] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from pipefold.errors import run_script
from pipefold.runtime.executor import COMPUTE_KINDS
from pipefold.runtime.measure.timeline import measured_costs, replayed_busy, step_parts
from pipefold.sim.simulate import simulate
from pipefold.train.run import train
from pipefold.train.spec import RunSpec
from vs_torch import BATCH, HIDDEN, LAYERS, MICROBATCHES, SEED, WORLD

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b:v=2", "zb-v")
SETTINGS: dict[str, Any] = {"devices": WORLD, "microbatches": MICROBATCHES, "model": "mlp", "layers": LAYERS,
                            "hidden": HIDDEN, "batch": BATCH, "optimizer": "sgd", "seed": SEED, "partition": "even",
                            "device": "cpu", "backend": "gloo"}
"""vs_torch.py's run (its sizes, the same model and split); --hidden overrides the width."""


def breakdown(schedule: str, steps: int, hidden: int, device: str = "cpu") -> dict[str, Any]:
    """Per rank, the medians of the step's parts over the steps after the first; and the simulated ideal."""
    job, reports = train(RunSpec.flat(**{**SETTINGS, "hidden": hidden, "schedule": schedule, "steps": steps,
                                         "device": device}))
    by_rank = sorted(reports, key=lambda r: r.rank)
    ranks = step_parts(by_rank)
    ideal = simulate(job.schedule, measured_costs(job.schedule, reports, len(reports[0].steps) - 1))
    busy = [sum(iv.end - iv.start for iv in row) for row in ideal.timeline]
    actions = [len(job.schedule.actions[d]) for d in range(job.schedule.devices)]
    step = max(row["step"] for row in ranks)  # the job's step: its slowest rank's
    replay = replayed_busy(job.schedule, reports)
    for d, row in enumerate(ranks):
        row["util"] = row["compute"] / step
        row["ideal"] = busy[d] / ideal.makespan
        row["replay"] = replay[d]
        row["runtime per action"] = row["runtime"] / actions[d]
        row["slowest"] = _slowest(by_rank[d])
    return {"schedule": schedule, "ranks": ranks, "ideal_step": ideal.makespan}


def _slowest(report: Any) -> float:
    """The largest, over the kinds of pass, of the slowest pass of that kind over its median (steps after the
    first)."""
    by_kind: dict[str, list[float]] = {}
    for i in report.steps.settled(1):
        for e in report.steps[i].events:
            if e.kind in COMPUTE_KINDS:
                by_kind.setdefault(e.kind, []).append(e.end - e.start)
    return max(max(times) / statistics.median(times) for times in by_kind.values())


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per schedule, the first one left out (default 10)")
    ap.add_argument("--hidden", type=int, default=SETTINGS["hidden"], help="the MLP's width (default 512)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: vs_torch's four)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the ranks compute (cuda: both on one GPU, the passes timed by CUDA events)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error(f"--steps must be at least 2 so a step is left after the first (got {args.steps})")
    os.environ["OMP_NUM_THREADS"] = "1"
    out = [breakdown(s, args.steps, args.hidden, args.device) for s in args.schedules.split(",")]
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{'schedule':22} rank  step ms  compute  recv wait  send wait  runtime (per action)  cpu ms  pass cpu  "
          "util  ideal  replay  slowest")
    for got in out:
        for d, r in enumerate(got["ranks"]):
            print(f"{got['schedule']:22} {d:4} {r['step'] * 1e3:8.1f} {r['compute'] * 1e3:8.1f} "
                  f"{r['recv wait'] * 1e3:10.1f} {r['send wait'] * 1e3:10.1f} {r['runtime'] * 1e3:8.1f} "
                  f"({r['runtime per action'] * 1e6:4.0f} us) {r['cpu'] * 1e3:10.1f} {_ms(r.get('compute cpu')):>9} "
                  f"{r['util']:5.0%} "
                  f"{r['ideal']:6.0%} {r['replay']:7.0%} {r['slowest']:7.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    run_script(main)

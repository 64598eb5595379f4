"""Expert parallelism's all-to-alls with and without DualPipe's overlap, on the same runs: the step time, the
exposed exchange per step, and the simulator's prediction of both.

For each schedule of overlapped pairs, ``pipefold train --json --model moe --ep 2 --dp 2`` runs with and without
``--ep-overlap``, round after round (the cores' speed drifts within minutes), on CPU ranks over gloo, the exchanges
crossing emulated links (``--network``) so that communication is large enough to matter. Per run it reads the
median step and, per device of the first pipeline, the seconds of its exchanges a step and those nothing computed
under (``exposed``: the exchanges' intervals less the intervals in which a part of an overlapped pair computed).
The simulator's predictions of both modes come from the costs measured in the runs without the overlap (in those
every exchange is exposed, so a pass's compute is its time less its exchanges).

Independent check: the step time saved by the overlap, measured on the wall clock, against the exposed exchange
the overlap removed by the ranks' interval bookkeeping; and the simulator's step against the measured one.

    python benchmarks/ep_overlap.py --hidden 128 --seq 64 --steps 4 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # this checkout's pipefold, here and in the ranks the runs start
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def run(schedule: str, overlap: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One ``pipefold train --json`` run in this process (its ranks are processes of their own): its report."""
    from pipefold.cli.main import report

    return report(["train", "--model", "moe", "--moe", f"experts={args.experts},top_k=2,aux_loss=0",
                   "--schedule", schedule, "--devices", str(args.devices), "--dp", "2", "--ep", "2",
                   "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", "4", "--seq", str(args.seq),
                   "--batch", str(args.batch), "--microbatches", str(args.microbatches), "--steps", str(args.steps),
                   "--network", args.network, "--partition", "even", "--action-timeout", "600",
                   *(["--ep-overlap"] if overlap else [])])


def step_time(rep: dict[str, Any]) -> float:
    """The median step after the first (which warms up)."""
    return statistics.median(rep["step_time_s"][1:] or rep["step_time_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["dualpipev", "1f1b:combined=1"])
    parser.add_argument("--devices", type=int, default=1,
                        help="pipeline devices of each copy (ranks: 2 x devices; more ranks than cores share them)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="sequences per step, over both copies")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--network", default="constant:latency=0.001,bandwidth=40MB",
                        help="the emulated links the exchanges cross")
    args = parser.parse_args()
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for schedule in args.schedules:
            for overlap in (False, True):
                runs.setdefault((schedule, overlap), []).append(run(schedule, overlap, args))
                print(f"round {r + 1}/{args.rounds}: {schedule}, overlap {overlap}", file=sys.stderr, flush=True)
    print("| schedule | overlap | step (s, each run) | simulated | exchanges (s/step, per device) "
          "| exposed, measured | simulated |")
    print("|---|---|---|---|---|---|---|")
    for schedule in args.schedules:
        for overlap in (False, True):
            reports = runs[schedule, overlap]
            # The simulator's figures from the run without the overlap (its costs are a pass's compute and its
            # exchanges apart), for this mode.
            plain = runs[schedule, False]
            mode = "with_overlap" if overlap else "without_overlap"
            sim_step = statistics.median(p["experts"]["simulated"][mode]["step"] for p in plain)
            sim_exposed = [statistics.median(p["experts"]["simulated"][mode]["exposed"][d] for p in plain)
                           for d in range(args.devices)]
            steps = [step_time(rep) for rep in reports]
            spent = [statistics.median(rep["experts"]["exchange_seconds"][d] for rep in reports)
                     for d in range(args.devices)]
            bare = [statistics.median(rep["experts"]["exposed_seconds"][d] for rep in reports)
                    for d in range(args.devices)]
            print(f"| {schedule} | {'yes' if overlap else 'no'} | {', '.join(f'{s:.3f}' for s in steps)} | "
                  f"{sim_step:.3f} | {', '.join(f'{s:.3f}' for s in spent)} | "
                  f"{', '.join(f'{s:.3f}' for s in bare)} | {', '.join(f'{s:.3f}' for s in sim_exposed)} |")
    print()
    print("| schedule | step saved (s, wall clock, median of rounds) | exposed removed (s, largest device) "
          "| simulated step saved | speed-up measured | simulated |")
    print("|---|---|---|---|---|---|")
    for schedule in args.schedules:
        off, on = runs[schedule, False], runs[schedule, True]
        saved = statistics.median(step_time(a) - step_time(b) for a, b in zip(off, on, strict=True))
        removed = statistics.median(max(a["experts"]["exposed_seconds"]) - max(b["experts"]["exposed_seconds"])
                                    for a, b in zip(off, on, strict=True))
        sim = [p["experts"]["simulated"] for p in off]
        sim_saved = statistics.median(s["without_overlap"]["step"] - s["with_overlap"]["step"] for s in sim)
        speed = statistics.median(step_time(a) / step_time(b) for a, b in zip(off, on, strict=True))
        sim_speed = statistics.median(s["without_overlap"]["step"] / s["with_overlap"]["step"] for s in sim)
        print(f"| {schedule} | {saved:.3f} | {removed:.3f} | {sim_saved:.3f} | {speed:.2f}x | {sim_speed:.2f}x |")


if __name__ == "__main__":
    main()

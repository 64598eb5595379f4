"""How long a whole plan takes: a 32-layer GPT (30 blocks, embedding, head) on 8 devices, from its profile.

The profile is measured once (layers only: the link and core sharing are measured for 8 ranks too unless
``--quick``), then ``plan_model`` runs every registered family and option with both splits and recomputation
under three budgets; the time of each whole plan is printed (median of ``--repeats`` runs, with min..max).

    OMP_NUM_THREADS=1 python benchmarks/plan_speed.py [--microbatches 16] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pipefold.errors import run_script
from pipefold.plan.budget import plan_model
from pipefold.plan.profile import Profile
from pipefold.runtime.measure.profiling import profile_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--microbatches", "-m", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="measure the layers only (free link, a device per rank)")
    ap.add_argument("--profile", help="read this profile instead of measuring one")
    args = ap.parse_args()
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        t0 = time.perf_counter()
        profile = profile_model(model="gpt", layers=30, hidden=128, heads=4, seq=128, batch=2 * args.microbatches,
                                microbatches=args.microbatches, devices=8, repeats=3, link=not args.quick,
                                contention=not args.quick)
        print(f"profile: {len(profile.layers)} layers in {time.perf_counter() - t0:.1f} s; "
              f"sharing {tuple(round(c, 2) for c in profile.contention)}")
    total = sum(x.params for x in profile.layers) * (2 + profile.optimizer_factor)
    for share in (0.5, 0.3, 0.2):
        budget = total / 8 / share * 0.6 + 0  # from generous to tight, per device
        laps: list[float] = []
        answer: Any = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            try:
                answer = plan_model(profile, 8, budget)
            except Exception as exc:  # a budget nothing fits still searched everything
                answer = exc
            laps.append(time.perf_counter() - t0)
        what = (f"{answer.best.spec}, split by {answer.best.split}, recompute {sum(answer.best.recompute)} layers, "
                f"{len(answer.points)} plans" if not isinstance(answer, Exception) else f"none fits ({answer})")
        print(f"budget {budget / 2**20:7.1f} MiB: {statistics.median(laps):.2f} s "
              f"({min(laps):.2f}..{max(laps):.2f}) -> {what}")


if __name__ == "__main__":
    run_script(main)

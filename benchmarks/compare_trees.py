"""Generation plus simulation time of two checkouts of pipefold, side by side in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/compare_trees.py /tmp/before/src src

Each measurement runs in a fresh process (no warm caches shared between the two trees), the
trees alternate run by run, and the table gives the median and the spread over the runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CODE = """
import sys, time
from pipefold import build, simulate
name, p, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
build(name, p, m)  # imports and first-call costs out of the way
t = time.perf_counter()
simulate(build(name, p, m))
print(time.perf_counter() - t)
"""


def _time(src: str, name: str, p: int, m: int) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", CODE, name, str(p), str(m)], env=env, capture_output=True,
                         text=True, check=True)
    return float(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the src/ directory of the first checkout")
    parser.add_argument("after", help="the src/ directory of the second checkout")
    parser.add_argument("--schedules", default="1f1b,zb-v,v-half,interleaved-1f1b")
    parser.add_argument("-p", type=int, default=64)
    parser.add_argument("-m", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"generate + simulate at p={args.p} m={args.m}, median [min-max] of {args.runs} fresh processes")
    for name in args.schedules.split(","):
        got: dict[str, list[float]] = {args.before: [], args.after: []}
        for _ in range(args.runs):
            for src in (args.before, args.after):
                got[src].append(_time(src, name, args.p, args.m))
        b, a = got[args.before], got[args.after]
        print(f"{name:18s} before {statistics.median(b):.2f} s [{min(b):.2f}-{max(b):.2f}]  "
              f"after {statistics.median(a):.2f} s [{min(a):.2f}-{max(a):.2f}]  "
              f"ratio {statistics.median(a) / statistics.median(b):.2f}")


if __name__ == "__main__":
    main()

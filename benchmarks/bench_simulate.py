"""Generation plus simulation time of every registered schedule, side by side with an earlier version of pipefold.

Target: at p=64, m=1024 every family builds and simulates in under 0.5 s, and the time per action stays flat as
the schedule grows (linear cost). Each measurement runs in a fresh process (no caches shared), the two versions
alternate run by run, and the table gives the median and the spread [min-max] over the runs. The earlier version is
a commit of this repository (``--baseline``, default :data:`BASELINE`), extracted with ``git archive``; without git
history the column is left out. Run:

    python benchmarks/bench_simulate.py                      # every family, p=64 m=1024, against BASELINE
    python benchmarks/bench_simulate.py --baseline none      # this tree only
    python benchmarks/bench_simulate.py --schedules v-half --growth   # and the time per action from 1e3 actions up
    python benchmarks/bench_simulate.py -p 4 -m 8 --repeat 200  # small schedules, as a planner meets them
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pipefold.errors import run_script

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "0c1c7f1"
"""The last commit before the simulator and the V builders were made faster (issue 27)."""
TARGET_S = 0.5

CODE = """
import statistics, sys, time
from pipefold import build, names, simulate
wanted, p, m, repeat = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for name in wanted:
    simulate(build(name, 4, 8))  # imports and first-call costs out of the way
    builds, sims = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        s = build(name, p, m)
        t1 = time.perf_counter()
        simulate(s)
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        sims.append(t2 - t1)
    print(name, statistics.median(builds), statistics.median(sims), s.num_actions)
"""


class Refused(Exception):
    """A process that could not build or simulate what it was given, with the last line it printed."""


def _run(src: Path, names: list[str], p: int, m: int, repeat: int = 1) -> dict[str, tuple[float, float, int]]:
    """(build s, simulate s, actions) of each schedule, in one fresh process on the tree ``src``: the medians of
    ``repeat`` builds and simulations (1: the process's first, as a search of large schedules meets it)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", CODE, ",".join(names), str(p), str(m), str(repeat)], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:  # a family or size the tree refuses: its own last line
        lines = out.stderr.strip().splitlines() or [f"exit {out.returncode}"]
        raise Refused(f"{src}: {lines[-1]}")
    rows = {}
    for line in out.stdout.splitlines():
        name, build, sim, actions = line.split()
        rows[name] = (float(build), float(sim), int(actions))
    return rows


def _baseline_tree(rev: str, into: Path) -> Path | None:
    """The ``src`` folder of commit ``rev``, extracted under ``into``; None without git history."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True)
    if archive.returncode != 0:
        print(f"no baseline: git cannot read {rev} here ({archive.stderr.decode().strip()})", file=sys.stderr)
        return None
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def _spread(values: list[float], scale: float = 1.0) -> str:
    values = [v * scale for v in values]
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help=f"commit to compare with, or none (default {BASELINE})")
    parser.add_argument("--schedules", default=None, help="comma-separated families (default: every one)")
    parser.add_argument("-p", type=int, default=64)
    parser.add_argument("-m", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per version (default 3)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="builds and simulations per process, their median taken (default 1; for small schedules, "
                             "whose single times are noise)")
    parser.add_argument("--growth", action="store_true",
                        help="also the time per action of each family from about 1e3 actions to the size limit")
    args = parser.parse_args()
    for flag, value in (("-p", args.p), ("-m", args.m), ("--runs", args.runs), ("--repeat", args.repeat)):
        if value < 1:
            parser.error(f"{flag} must be at least 1 (got {value})")
    sys.path.insert(0, str(ROOT / "src"))
    from pipefold import names as registered

    names = args.schedules.split(",") if args.schedules else registered()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"now": ROOT / "src"}
        if args.baseline != "none" and (old := _baseline_tree(args.baseline, Path(tmp))) is not None:
            trees = {args.baseline: old, **trees}
        got: dict[str, list[dict[str, tuple[float, float, int]]]] = {label: [] for label in trees}
        try:
            for _ in range(args.runs):
                for label, src in trees.items():
                    got[label].append(_run(src, names, args.p, args.m, args.repeat))
        except Refused as e:
            raise SystemExit(f"bench_simulate.py: {e}") from None
    longest = max(r[name][0] + r[name][1] for runs in got.values() for r in runs for name in names)
    unit, scale = ("ms", 1e3) if longest < 0.1 else ("seconds", 1.0)
    each = f", each the median of {args.repeat} in the process" if args.repeat > 1 else ""
    print(f"build + simulate at p={args.p} m={args.m}, {unit}: median [min-max] of {args.runs} fresh processes "
          f"per version{each}")
    header = f"{'schedule':18s} {'actions':>8s}"
    for label in trees:
        header += f"  {label + ' build+sim':>24s}"
    header += f"  {'now: build':>22s}  {'now: simulate':>22s}  us/action"
    print(header)
    worst = 0.0
    for name in names:
        now = got["now"]
        actions = now[0][name][2]
        line = f"{name:18s} {actions:8d}"
        for label in trees:
            line += f"  {_spread([r[name][0] + r[name][1] for r in got[label]], scale):>24s}"
        total = statistics.median(r[name][0] + r[name][1] for r in now)
        worst = max(worst, total)
        line += (f"  {_spread([r[name][0] for r in now], scale):>22s}  {_spread([r[name][1] for r in now], scale):>22s}"
                 f"  {1e6 * total / actions:.2f}")
        print(line)
    target = f" (target < {TARGET_S} s)" if (args.p, args.m) == (64, 1024) else ""
    print(f"slowest now: {worst:.4f} s{target}")
    if args.growth:
        _growth(names)


def _growth(names: list[str]) -> None:
    """Time per action from about 1e3 actions up to the size limit, each size in a fresh process."""
    from pipefold import build
    from pipefold.ir import MAX_STAGE_MICROBATCHES

    print("time per action (build + simulate) as the schedule grows, one fresh process per size")
    for name in names:
        points = []
        for p, m in ((8, 64), (16, 256), (32, 512), (64, 1024), (64, 4096)):
            try:
                stages = build(name, p, max(4, 2 * p)).stages
                m = min(m, MAX_STAGE_MICROBATCHES // stages)
                row = _run(ROOT / "src", [name], p, m)[name]
            except Refused:
                continue  # a size the family refuses
            points.append(f"{row[2]:.1e}: {1e6 * (row[0] + row[1]) / row[2]:.2f}")
        print(f"{name:18s} " + "  ".join(points) + "  (actions: us/action)")


if __name__ == "__main__":
    run_script(main)

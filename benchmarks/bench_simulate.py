"""Time schedule generation plus simulation for every registered schedule.

Target: at p=64, m=1024 every schedule finishes in under 2 seconds, and the
time per action stays flat as the schedule grows (linear cost). Run:

    python benchmarks/bench_simulate.py            # the full table
    python benchmarks/bench_simulate.py --quick    # smaller sizes only
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from pipefold import build, names, simulate

SIZES = [(8, 64), (16, 256), (32, 512), (64, 1024)]


def _time_one(name: str, p: int, m: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    schedule = build(name, p, m)
    t1 = time.perf_counter()
    simulate(schedule)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, schedule.num_actions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip p=64, m=1024")
    args = parser.parse_args()
    sizes = SIZES[:2] if args.quick else SIZES
    table = Table(title="generate + simulate (seconds)", title_justify="left")
    table.add_column("schedule")
    for p, m in sizes:
        table.add_column(f"p={p} m={m}", justify="right")
    table.add_column("us/action (smallest -> largest)", justify="right")
    worst = 0.0
    for name in names():
        cells, per_action = [], []
        for p, m in sizes:
            gen, sim, n = _time_one(name, p, m)
            total = gen + sim
            worst = max(worst, total) if (p, m) == (64, 1024) else worst
            cells.append(f"{total:.3f}")
            per_action.append(1e6 * total / n)
        table.add_row(name, *cells, f"{per_action[0]:.1f} -> {per_action[-1]:.1f}")
    Console().print(table)
    if not args.quick:
        print(f"slowest at p=64 m=1024: {worst:.3f} s (target < 2 s)")


if __name__ == "__main__":
    main()

"""Per-rank memory over a long run: each rank's RSS after 200 and after 2,000 steps of a tiny model on 2 ranks.

Each rank reads its own resident set size from /proc/self/statm when it asks for the batch of step 200 and of
step 2,000 (so after that many steps), and its peak from getrusage; with ``--tracemalloc`` it also traces
Python's allocations from step 150 on (which slows the run and adds the tracer's own tables to the RSS: a
separate run) and reports the traced heap at the same two steps, a cross-check that does not depend on how
the C allocator returns pages. The growth per step is (at 2,000 - at 200) / 1,800.

    PYTHONPATH=src python benchmarks/memory_flat.py [--steps 2000] [--tracemalloc] [--json]

It only uses what every version of the runtime has (``make_job``, ``run_local`` and the job's ``batch_at``),
so the same file measures an older checkout: ``PYTHONPATH=/path/to/old/src python benchmarks/memory_flat.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipefold.errors import run_script


@dataclasses.dataclass(frozen=True)
class Probe:
    """The job's batch function, measuring the rank's memory on the way at the steps in ``at``."""

    inner: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    at: tuple[int, ...]
    out: str
    trace_from: int | None

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.trace_from is not None and step == self.trace_from:
            tracemalloc.start()
        if step in self.at:
            import torch.distributed as dist

            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            record = {"rank": dist.get_rank(), "step": step, "rss": rss,
                      "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "traced": tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None}
            Path(self.out, f"rank{record['rank']}-step{step}.json").write_text(json.dumps(record))
        return self.inner(step)


def run(steps: int, trace: bool) -> dict[str, Any]:
    from pipefold.runtime.launch.local import run_local
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    first = steps // 10
    config = RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, model="mlp", layers=4, hidden=32, batch=8,
                         steps=steps + 1, partition="even", optimizer="sgd", lr=1e-3)
    job = make_job(config)
    with tempfile.TemporaryDirectory() as out:
        job = dataclasses.replace(job, batch_at=Probe(job.batch_at, (first, steps), out,
                                                      first * 3 // 4 if trace else None))
        started = time.perf_counter()
        run_local(job)
        took = time.perf_counter() - started
        records = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]
    ranks = []
    for rank in sorted({r["rank"] for r in records}):
        a, b = (next(r for r in records if r["rank"] == rank and r["step"] == s) for s in (first, steps))
        row = {"rank": rank, f"rss_at_{first}": a["rss"], f"rss_at_{steps}": b["rss"],
               "rss_growth_per_step": (b["rss"] - a["rss"]) / (steps - first), "peak_rss": b["maxrss"]}
        if trace:
            row.update({f"python_heap_at_{first}": a["traced"], f"python_heap_at_{steps}": b["traced"],
                        "python_heap_growth_per_step": (b["traced"] - a["traced"]) / (steps - first)})
        ranks.append(row)
    return {"steps": steps, "tracemalloc": trace, "seconds": took, "ranks": ranks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tracemalloc", action="store_true", help="trace Python's allocations (a separate run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = run(args.steps, args.tracemalloc)
    if args.json:
        print(json.dumps(out))
        return 0
    first = args.steps // 10
    print(f"{args.steps} steps of an MLP on 2 ranks in {out['seconds']:.1f} s")
    for row in out["ranks"]:
        line = (f"rank {row['rank']}: RSS {row[f'rss_at_{first}'] / 2**20:.1f} MiB at step {first}, "
                f"{row[f'rss_at_{args.steps}'] / 2**20:.1f} MiB at step {args.steps} "
                f"({row['rss_growth_per_step']:+.0f} B/step), peak {row['peak_rss'] / 2**20:.1f} MiB")
        if args.tracemalloc:
            line += (f"; Python heap {row[f'python_heap_at_{first}'] / 2**20:.2f} -> "
                     f"{row[f'python_heap_at_{args.steps}'] / 2**20:.2f} MiB "
                     f"({row['python_heap_growth_per_step']:+.0f} B/step)")
        print(line)
    return 0


if __name__ == "__main__":
    run_script(main)

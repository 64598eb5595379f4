"""Where the host's time goes in a step, pipefold's ranks beside torch.distributed.pipelining's, from cProfile.

vs_torch.py's run (the ``mlp`` model, 2 local gloo ranks, the same weights, data and split) under both runtimes,
each rank's steps after the first profiled on the thread that runs them (pipefold: ``Job.extra["host_profile"]``
around ``RankExecutor.run_step``; torch: around ``schedule.step``). On a GPU the host launches the kernels and the
passes' arithmetic is microseconds at the default width, so the host's time is the step: this says which calls
take it. Per side and rank, milliseconds per step by group (the autograd engine's backward, the modules' forwards,
the point-to-point calls and waits, CUDA's streams and events, the runtime's own Python) and the functions with the
most time of their own. cProfile's own cost per call inflates the Python parts (both sides alike): read the shares
and the calls per step, and the plain step times from vs_torch.py.

Which threads it sees depends on Python: up to 3.11 cProfile follows the thread that enabled it alone; from 3.12 on
(it runs on ``sys.monitoring``) it follows every Python thread of the process. pipefold's send threads are Python
(each waits for its copy to host memory, ``Event.synchronize``, and for the delivery), torch's side has none, so
from 3.12 on pipefold's columns include those waits, which do not hold up the rank's own thread, and its groups can
add up to more than the step. A receive is read from its socket by the thread that waits for it (``recv_into``):
that is the rank's own wait for a message.

    python benchmarks/host_profile.py --device cuda                # 1f1b, H=512, 8 steps
    python benchmarks/host_profile.py --schedule zb-v --steps 4 --json
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import vs_torch
from pipefold.errors import run_script

GROUPS = (  # (group, test on (file, function name)): the first that matches takes a function's own time
    ("backward (autograd engine)", lambda f, n: "run_backward" in n),
    ("messages (p2p calls, waits)", lambda f, n: "distributed" in f or "c10d" in n or "_socket" in n
     or "_thread.lock" in n or "select" in n or "/sockets.py" in f or "/comm.py" in f),
    ("CUDA (streams, events)", lambda f, n: "torch/cuda" in f or "Event" in n or "Stream" in n
     or "synchronize" in n),
    ("tensor operations", lambda f, n: n.startswith("<built-in method torch")
     or (n.startswith("<method '") and "torch._C" in n)),
    ("pipefold runtime (Python)", lambda f, n: "pipefold/runtime" in f),
    ("torch pipelining (Python)", lambda f, n: "pipelining" in f),
    ("models and torch (Python)", lambda f, n: "torch/" in f or "pipefold/models" in f),
    ("other", lambda f, n: True),
)


def _name(key: tuple[str, int, str]) -> tuple[str, str]:
    file, line, func = key
    short = file.split("site-packages/")[-1].split("src/")[-1]
    return file, (func if file == "~" else f"{short}:{line}({func})")


def summarize(path: Path, steps: int, top: int) -> dict[str, Any]:
    """One rank's profile: total, groups and the top functions by own time, per step."""
    stats = pstats.Stats(str(path))
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    groups = {g: 0.0 for g, _ in GROUPS}
    rows = []
    for key, (_, calls, own, cumulative, _) in raw.items():
        file, name = _name(key)
        group = next(g for g, test in GROUPS if test(file, name))
        groups[group] += own
        rows.append({"function": name, "group": group, "calls": calls / steps, "own_ms": 1e3 * own / steps,
                     "cumulative_ms": 1e3 * cumulative / steps})
    total = sum(groups.values())
    rows.sort(key=lambda r: -r["own_ms"])
    return {"total_ms": 1e3 * total / steps, "calls": sum(r["calls"] for r in rows),
            "groups_ms": {g: 1e3 * t / steps for g, t in groups.items()}, "top": rows[:top]}


def profile(schedule: str, steps: int, top: int) -> dict[str, Any]:
    """Both sides of ``schedule``: the plain step times of the run and each rank's profile."""
    pair = next(p for p in vs_torch.PAIRS if p.label == schedule)
    out: dict[str, Any] = {}
    for side in ("pipefold", "torch"):
        with tempfile.TemporaryDirectory(prefix="pipefold-profile-") as folder:
            run = (vs_torch._run_pipefold(pair, steps, "auto", folder) if side == "pipefold"
                   else vs_torch._run_torch(pair, steps, folder))
            if run.error is not None:
                out[side] = {"error": run.error}
                continue
            ranks = sorted(Path(folder).glob("rank*.prof"))
            if len(ranks) != vs_torch.WORLD:
                raise RuntimeError(f"{side}: {len(ranks)} profiles written, expected {vs_torch.WORLD}")
            out[side] = {"median_ms_profiled": 1e3 * (run.median_s or 0.0),
                         "ranks": [summarize(p, steps - 1, top) for p in ranks]}
    return out


THREADS = ("every Python thread of the process (pipefold's link threads too)" if sys.version_info >= (3, 12)
           else "the thread that runs the steps")
"""What cProfile follows on this Python (see the module's docstring)."""


def _print(schedule: str, result: dict[str, Any], top: int) -> None:
    print(f"\n== {schedule}: ms per step under cProfile, of {THREADS}")
    sides = [s for s in ("pipefold", "torch") if "ranks" in result[s]]
    for side in ("pipefold", "torch"):
        if "error" in result[side]:
            print(f"{side}: failed: {result[side]['error']}")
    header = [f"{side} r{r}" for side in sides for r in range(vs_torch.WORLD)]
    print(f"{'group':34s}" + "".join(f"{h:>14s}" for h in header))
    cells = [rank for side in sides for rank in result[side]["ranks"]]
    for group, _ in GROUPS:
        print(f"{group:34s}" + "".join(f"{c['groups_ms'][group]:14.2f}" for c in cells))
    print(f"{'total':34s}" + "".join(f"{c['total_ms']:14.2f}" for c in cells))
    print(f"{'calls per step':34s}" + "".join(f"{c['calls']:14.0f}" for c in cells))
    print(f"{'step wall (profiled, median)':34s}"
          + "".join(f"{result[side]['median_ms_profiled']:14.2f}" for side in sides for _ in range(vs_torch.WORLD)))
    for side in sides:
        print(f"\n{side}, rank 0: the {top} functions with the most time of their own (ms per step, calls per step)")
        for row in result[side]["ranks"][0]["top"]:
            print(f"  {row['own_ms']:8.3f} {row['calls']:8.1f}  {row['function'][:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", nargs="+", default=["1f1b"], choices=[p.label for p in vs_torch.PAIRS],
                        help="vs_torch.py's schedules to profile (default 1f1b)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--hidden", type=int, default=vs_torch.HIDDEN)
    parser.add_argument("--steps", type=int, default=8, help="steps per run; the first is not profiled (default 8)")
    parser.add_argument("--top", type=int, default=20, help="functions listed per side (default 20)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2: the first step is not profiled (got {args.steps})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    vs_torch.DEVICE, vs_torch.HIDDEN = args.device, args.hidden
    results = {}
    for schedule in args.schedule:
        print(f"profiling {schedule} ({args.steps} steps per side) ...", file=sys.stderr, flush=True)
        results[schedule] = profile(schedule, args.steps, args.top)
    if args.json:
        print(json.dumps({"device": args.device, "hidden": args.hidden, "steps": args.steps,
                          "torch_version": torch.__version__, "threads": THREADS, "schedules": results}))
        return
    for schedule, result in results.items():
        _print(schedule, result, args.top)


if __name__ == "__main__":
    run_script(main)

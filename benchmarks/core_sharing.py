"""What sharing one core costs a pass beyond the turns: its CPU seconds with k processes on one core against one alone.

Each process pins itself to the same core and runs the layouts benchmark's GPT (4 blocks of width 256, seq 64, 4
rows) as one stage, F then BW through pipefold's stage runner, ``--steps`` times after two warm-ups, all of them
starting together; it reports the median pass's CPU
seconds (the operating system's count for its thread, ``time.thread_time``, what the executor records for each
action: ``Event.cpu``) and wall seconds. Sharing a core by turns doubles the wall time at 2; the CPU time grows
only by what the other process's turns cost this one (its caches refilled). ``--pause`` sleeps that long between
passes, as a rank blocks on its messages.

    OMP_NUM_THREADS=1 python benchmarks/core_sharing.py [--processes 1,2] [--steps 200] [--pause 0,0.002]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from pipefold.errors import run_script
from pipefold.runtime.launch.processes import process_context


def _worker(core: int, steps: int, pause: float, start: Any, out: Any) -> None:
    import torch

    from pipefold.models.gpt import GPTConfig, build_gpt_layers, gpt_loss
    from pipefold.runtime.stage import Chain, StageRunner

    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=64)
    layers = build_gpt_layers(cfg, range(cfg.num_layers))
    runner = StageRunner(Chain(*(layers[i] for i in range(cfg.num_layers))), loss_fn=gpt_loss, input_grads=False,
                         split=False)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (4, 64), generator=gen) for _ in range(2))
    cpu, wall = [], []
    os.sched_setaffinity(0, {core})  # built on any core; the passes on the one they share
    start.wait()  # every process built: they share the core from the first pass on
    for _ in range(steps + 2):
        t, c = time.perf_counter(), time.thread_time()
        runner.forward(0, (x,), y)
        runner.backward(0, None)
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
        if pause:
            time.sleep(pause)
    out.put((statistics.median(cpu[2:]), statistics.median(wall[2:])))  # two warm-ups


def measure(k: int, steps: int, pause: float) -> list[tuple[float, float]]:
    """(CPU seconds, wall seconds) of the median pass in each of ``k`` processes sharing one core."""
    ctx = process_context()  # as the runtime starts its ranks: from a fork server that has imported torch
    out = ctx.Queue()
    core = min(os.sched_getaffinity(0))
    start = ctx.Barrier(k)
    procs = [ctx.Process(target=_worker, args=(core, steps, pause, start, out)) for _ in range(k)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120 + steps * k) for _ in procs]
    for p in procs:
        p.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", default="1,2", help="how many processes share the core, comma-separated")
    ap.add_argument("--steps", type=int, default=200, help="passes each process times (default 200)")
    ap.add_argument("--pause", default="0,0.002", help="seconds each process sleeps between passes, comma-separated")
    args = ap.parse_args()
    if not hasattr(os, "sched_setaffinity"):
        ap.error("this benchmark pins processes to a core, which needs Linux's sched_setaffinity")
    try:
        counts = [int(k) for k in args.processes.split(",")]
        pauses = [float(p) for p in args.pause.split(",")]
    except ValueError:
        ap.error(f"--processes takes whole numbers and --pause seconds, comma-separated "
                 f"(got {args.processes!r} and {args.pause!r})")
    if min(counts) < 1 or min(pauses) < 0 or args.steps < 1:
        ap.error("--processes and --steps must be 1 or more, --pause 0 or more")
    print("pause ms  processes  pass CPU ms (each)        CPU / alone  pass wall ms  wall / CPU", flush=True)
    for pause in pauses:
        alone = None
        for k in counts:
            got = measure(k, args.steps, pause)
            cpu = statistics.fmean(c for c, _ in got)
            wall = statistics.fmean(w for _, w in got)
            alone = cpu if k == 1 else alone
            ratio = f"{cpu / alone:11.3f}" if alone else f"{'-':>11}"
            each = " ".join(f"{c * 1e3:.2f}" for c, _ in got)
            print(f"{pause * 1e3:8.1f}  {k:9d}  {each:24s} {ratio}  {wall * 1e3:12.2f}  {wall / cpu:10.2f}", flush=True)


if __name__ == "__main__":
    run_script(main)

"""Does a pass cost the same however many microbatches its stage holds in flight? The cost model says so: it prices
every F, B, W and BW of a stage alike, from a profile that runs one microbatch at a time (forward, then backward
at once), while a run's stage holds several between their forward and their backward (GPipe all of them, 1F1B as
many as there are stages after it), each keeping its activations.

    OMP_NUM_THREADS=1 python benchmarks/in_flight.py                # a stage of 8 blocks of gpt-small, 10 rounds
    OMP_NUM_THREADS=1 python benchmarks/in_flight.py --model mlp    # of plan_accuracy.py's mlp

The stage is blocks 1 to 8 of the model (after its first layer), at plan_accuracy.py's sizes, on the stage runner
the ranks use, one thread. Each round runs, for each depth (1, 2, 4 and 8 microbatches in flight by default),
that many forwards, then their backwards split (B, then W), then the same again with fused backwards (BW). Every
pass is timed by its thread's CPU time. The depths take turns within a round, so each depth's sum over depth 1's
in the same round is free of the machine's drift from one round to the next
(benchmarks/results/machine_speed.md). Printed per depth: the median F, B, W and BW of a microbatch, and the ratio
of its split and fused sums to depth 1's, median (min..max) over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipefold.errors import run_script
from pipefold.files import write_json
from pipefold.models import make_model
from pipefold.runtime.host_memory import keep_freed_pages
from pipefold.runtime.stage import Chain, StageRunner, ones_for, split_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import MODELS as ACCURACY  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {"gpt": ACCURACY["gpt-small"], "mlp": ACCURACY["mlp"]}
"""The models at plan_accuracy.py's sizes (its gpt-small and mlp)."""
BLOCKS = 8


def stage_of(model: str) -> tuple[StageRunner, tuple[torch.Tensor, ...]]:
    """Blocks 1..BLOCKS of ``model`` on a stage runner, and their input for one microbatch."""
    size = MODELS[model]
    built = make_model(model, layers=size["layers"], hidden=size["hidden"], heads=size["heads"], seq=size["seq"],
                       batch=size["batch"], seed=0)
    layers = built.build_layers(range(BLOCKS + 1))
    with torch.no_grad():
        x = split_batch(built.batch_at(0)[0], size["microbatches"])[0]
        y = Chain(layers[0])(*x)
    xs = y if isinstance(y, tuple) else (y,)
    stage = Chain(*(layers[i] for i in range(1, BLOCKS + 1)))
    return StageRunner(stage, input_grads=True), tuple(t.detach() for t in xs)


class Depths:
    """Runs ``depth`` microbatches through the stage, all forwards before any backward; per-microbatch CPU times."""

    def __init__(self, runner: StageRunner, xs: tuple[torch.Tensor, ...]) -> None:
        self.runner, self.xs, self.k = runner, xs, 0

    def _forwards(self, depth: int) -> tuple[float, list[Any]]:
        spent, outs = 0.0, []
        for _ in range(depth):
            t0 = time.thread_time()
            outs.append((self.k, self.runner.forward(self.k, self.xs)))
            spent += time.thread_time() - t0
            self.k += 1
        return spent, outs

    def split(self, depth: int) -> tuple[float, float, float]:
        """(F, B, W) seconds a microbatch."""
        f, outs = self._forwards(depth)
        b = w = 0.0
        for k, out in outs:
            t0 = time.thread_time()
            self.runner.backward_input(k, ones_for(out))
            t1 = time.thread_time()
            self.runner.backward_weight(k)
            b, w = b + t1 - t0, w + time.thread_time() - t1
        return f / depth, b / depth, w / depth

    def fused(self, depth: int) -> float:
        """BW seconds a microbatch (its forwards are timed by :meth:`split`)."""
        _, outs = self._forwards(depth)
        bw = 0.0
        for k, out in outs:
            t0 = time.thread_time()
            self.runner.backward(k, ones_for(out))
            bw += time.thread_time() - t0
        return bw / depth


def _depths(text: str) -> list[int]:
    try:
        got = [int(d) for d in text.split(",")]
    except ValueError:
        got = []
    if not got or min(got) < 1 or got[0] != 1:
        raise argparse.ArgumentTypeError(f"--depths takes counts of 1 or more, the first 1 (got {text!r}); "
                                         "e.g. 1,2,4,8")
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of every depth in turn (default 10)")
    ap.add_argument("--depths", type=_depths, default=[1, 2, 4, 8],
                    help="microbatches in flight, the first 1 (default 1,2,4,8)")
    ap.add_argument("--json", metavar="FILE", help="write the figures here too")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1 (got {args.rounds})")
    torch.set_num_threads(1)
    keep_freed_pages()  # as every process that runs passes does
    runner, xs = stage_of(args.model)
    run = Depths(runner, xs)
    run.split(2)  # warm-up
    run.fused(2)
    split: dict[int, list[tuple[float, float, float]]] = {d: [] for d in args.depths}
    fused: dict[int, list[float]] = {d: [] for d in args.depths}
    for r in range(args.rounds):
        for d in args.depths:
            split[d].append(run.split(d))
            fused[d].append(run.fused(d))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    rows = []
    print(f"{args.model}: blocks 1..{BLOCKS}, one microbatch's passes (CPU ms, medians of {args.rounds} rounds); "
          "sums over depth 1's in the same round, median (min..max)")
    for d in args.depths:
        f, b, w = (statistics.median(col) for col in zip(*split[d], strict=True))
        bw = statistics.median(fused[d])
        over_split = [sum(s) / sum(one) for s, one in zip(split[d], split[1], strict=True)]
        over_fused = [(s[0] + x) / (one[0] + y)
                      for s, x, one, y in zip(split[d], fused[d], split[1], fused[1], strict=True)]
        rows.append({"depth": d, "f_ms": f * 1e3, "b_ms": b * 1e3, "w_ms": w * 1e3, "bw_ms": bw * 1e3,
                     "split_over_depth_1": over_split, "fused_over_depth_1": over_fused})
        print(f"  {d} in flight: F {f * 1e3:6.2f}  B {b * 1e3:6.2f}  W {w * 1e3:6.2f}  BW {bw * 1e3:6.2f}   "
              f"F+B+W x{statistics.median(over_split):.3f} ({min(over_split):.3f}..{max(over_split):.3f})  "
              f"F+BW x{statistics.median(over_fused):.3f} ({min(over_fused):.3f}..{max(over_fused):.3f})")
    if args.json:
        write_json(args.json, {"model": args.model, "size": MODELS[args.model], "blocks": BLOCKS, "rows": rows})
    return 0


if __name__ == "__main__":
    run_script(main)

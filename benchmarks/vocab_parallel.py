"""Vocabulary Parallelism measured: the GPT with a large vocabulary trained with its output layer on the last stage
and split over every device, side by side, interleaved; each device's memory and the step time.

For each vocabulary size and each schedule, ``pipefold train --json`` runs the schedule plain and with ``vocab=1``,
round after round (the cores' speed drifts within minutes). Per device it reads the runtime's figures: the
parameters, gradients and optimizer state it holds (``static_bytes``) and the most activation bytes it held
during a step (the meter's ``peak_activation_bytes``); and the median step time after the first.

Independent check of the weights: the token embedding and the output projection are each vocabulary x hidden
floats, and with AdamW a device holds 4 floats for each of its parameters (the parameter, its gradient, two
moments). Split over p devices (both, as ``pipefold train`` splits them), every device holds 16 V h / p bytes of
each, the first stage's device 16 V h bytes of the embedding less and the last stage's 16 V h of the projection
less: the closed form the script sets beside the difference the runtime measured.

    python benchmarks/vocab_parallel.py --vocab-sizes 65536 131072 262144 --schedules 1f1b v-half --hidden 512
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


def run(schedule: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """One ``pipefold train --json`` run, in this process (its ranks are processes of their own, started by the
    fork server the first run starts): its JSON report."""
    from pipefold.cli.main import report

    return report(["train", "--model", "gpt", "--schedule", schedule,
                   "--devices", str(args.devices), "--layers", str(args.layers), "--hidden", str(args.hidden),
                   "--heads", str(args.heads), "--seq", str(args.seq), "--batch", str(args.batch),
                   "--microbatches", str(args.microbatches), "--vocab-size", str(vocab), "--steps", str(args.steps),
                   "--partition", "even", "--action-timeout", "600"])


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-sizes", nargs="+", type=int, default=[65536, 131072, 262144])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "v-half"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2, help="rounds, each running every configuration once")
    args = parser.parse_args()
    p = args.devices
    names = [(base, f"{base}:vocab=1") for base in args.schedules]
    got: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for _ in range(args.runs):
        for vocab in args.vocab_sizes:
            for pair in names:
                for schedule in pair:
                    got.setdefault((vocab, schedule), []).append(run(schedule, args, vocab))
    print(f"GPT hidden {args.hidden}, {args.layers} blocks, {args.seq} tokens x batch {args.batch} in "
          f"{args.microbatches} microbatches, {p} devices, AdamW; {args.runs} interleaved runs of {args.steps} steps")
    print()
    print("| vocabulary | schedule | weights+grads+Adam per device (MiB) | activation peak per device (MiB) "
          "| step (s, median of each run) | plain step / this step |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab_sizes:
        for plain, split in names:
            medians = {}
            for schedule in (plain, split):
                runs = got[(vocab, schedule)]
                static = [max(int(r["static_bytes"][d]) for r in runs) for d in range(p)]
                peak = [max(int(r["peak_activation_bytes"][d]) for r in runs) for d in range(p)]
                steps = [statistics.median(r["step_time_s"][1:] or r["step_time_s"])
                         for r in runs]
                medians[schedule] = statistics.median(steps)
                ratio = "" if schedule == plain else f"{medians[plain] / medians[schedule]:.2f}"
                print(f"| {vocab // 1024}k | {schedule} | {' / '.join(map(mib, static))} | "
                      f"{' / '.join(map(mib, peak))} | {', '.join(f'{s:.2f}' for s in steps)} | {ratio} |")
    print()
    print("Check of the weights against the closed form (16 V h bytes a matrix, the embedding on the first stage's "
          "device and the projection on the last stage's, a p-th of each on every device split; 4 bytes of Adam's "
          "step count a tensor):")
    from pipefold import schedules

    for vocab in args.vocab_sizes:
        whole = 16 * vocab * args.hidden
        for plain, split in names:
            built = schedules.build(plain, p, args.microbatches)
            ends = (built.device_of(0), built.device_of(built.stages - 1))
            a = [int(got[(vocab, plain)][0]["static_bytes"][d]) for d in range(p)]
            b = [int(got[(vocab, split)][0]["static_bytes"][d]) for d in range(p)]
            closed = [2 * (whole // p + 4) - sum(whole + 4 for end in ends if end == d) for d in range(p)]
            measured = [b[d] - a[d] for d in range(p)]
            print(f"- {vocab // 1024}k, {plain}: split minus plain per device {' / '.join(map(mib, measured))} MiB, "
                  f"the closed form {' / '.join(map(mib, closed))} MiB: "
                  f"{'equal to the byte' if measured == closed else 'DIFFERENT: ' + str((measured, closed))}")

if __name__ == "__main__":
    main()

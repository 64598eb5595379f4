"""Structured partial backpropagation (Jigsaw's SPB) measured: what a copy that backpropagates through fewer layers
saves (busy time, activation memory and the bytes it sends in the gradients' data-parallel reduction, per copy), and
what the model's quality pays (the loss after N steps on the embedded corpus against full backpropagation, several
seeds).

Cost: the MLP (blocks of equal size) on one device and 2 data-parallel copies, copy 0 backpropagating through every
layer and copy 1 through its last K, for several K, round after round (the cores' speed drifts within minutes).
Independent check, a closed form from the blocks being equal: a block's backward does twice its forward's work
(the input gradient and the weight gradient, each a product as large as the forward's), so copy 1's busy time is
(1 + 2 K / L) / 3 of copy 0's; its forward saves activations for its last K blocks only, so its peak is K / L of
copy 0's plus what does not scale with the blocks (the step's input and output). The reduction's bytes, as the
runtime counts them: with 2 copies a block's all-reduce sends its S bytes from each copy, and a block copy 1 did not
compute goes from copy 0 to copy 1 (S from copy 0, nothing from copy 1), so copy 1 sends K / L of what every block's
all-reduce sends and copy 0 all of it.

Quality: the GPT on the embedded corpus, full backpropagation against SPB on 2 copies, for several seeds, the mean
loss of the last 5 steps.

    python benchmarks/spb.py --layers 8 --ks 6 4 2 --steps 6 --rounds 2 --quality-steps 40 --seeds 0 1 2
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


def train(argv: list[str]) -> dict[str, Any]:
    """One ``pipefold train --json`` run in this process (its ranks are processes of their own): its report."""
    from pipefold.cli.main import report

    return report(["train", *argv, "--action-timeout", "600"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="MLP blocks of the cost part")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ks", nargs="+", type=int, default=[6, 4, 2], help="copy 1's layers backpropagated")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quality-steps", type=int, default=40)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args()
    L = args.layers
    base = ["--model", "mlp", "--layers", str(L), "--hidden", str(args.hidden), "--batch", "64", "--devices", "1",
            "--dp", "2", "--microbatches", "2", "--schedule", "1f1b", "--steps", str(args.steps)]
    cost: dict[int, list[tuple[float, float, int, int]]] = {}
    sent: dict[int, tuple[float, float, float]] = {}  # copy 0's and copy 1's bytes, every block's all-reduce's
    for r in range(args.rounds):
        for k in args.ks:
            rows = train([*base, "--spb", f"{L},{k}"])["spb"]["per_copy"]
            cost.setdefault(k, []).append((rows[0]["busy_s"], rows[1]["busy_s"], rows[0]["peak_activation_bytes"],
                                           rows[1]["peak_activation_bytes"]))
            sent[k] = (rows[0]["dp_sent_bytes"], rows[1]["dp_sent_bytes"], rows[1]["full_dp_bytes"])
            print(f"cost round {r + 1}/{args.rounds}: K={k}", file=sys.stderr, flush=True)
    print(f"Cost: MLP of {L} blocks of width {args.hidden}, 1 device, 2 copies; copy 1 backpropagates through its "
          "last K blocks.\n")
    print("| K | copy 0 busy (ms/step, each run) | copy 1 busy | copy 1 / copy 0 | closed form | copy 0 peak (KiB) "
          "| copy 1 peak | copy 1 / copy 0 | closed form K/L |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in args.ks:
        runs = cost[k]
        ratio = statistics.median(b / a for a, b, _, _ in runs)
        peak0, peak1 = runs[0][2], runs[0][3]
        print(f"| {k} | {', '.join(f'{a * 1e3:.1f}' for a, _, _, _ in runs)} | "
              f"{', '.join(f'{b * 1e3:.1f}' for _, b, _, _ in runs)} | {ratio:.2f} | {(1 + 2 * k / L) / 3:.2f} | "
              f"{peak0 / 1024:,.1f} | {peak1 / 1024:,.1f} | {peak1 / peak0:.2f} | {k / L:.2f} |")
    print("\nThe gradients' data-parallel reduction per step, as the runtime counts what each copy sends (a ring's "
          "share of an all-reduce, a broadcast's source to its receiver).\n")
    print("| K | copy 0 sent (KiB/step) | copy 1 sent | every block's all-reduce, each copy | copy 1 / that | "
          "closed form K/L |")
    print("|---|---|---|---|---|---|")
    for k in args.ks:
        sent0, sent1, full = sent[k]
        print(f"| {k} | {sent0 / 1024:,.1f} | {sent1 / 1024:,.1f} | {full / 1024:,.1f} | {sent1 / full:.2f} | "
              f"{k / L:.2f} |")
    gpt = ["--model", "gpt", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "64", "--batch", "16",
           "--devices", "1", "--dp", "2", "--microbatches", "2", "--schedule", "1f1b", "--lr", "3e-3",
           "--steps", str(args.quality_steps)]
    quality: dict[str, list[float]] = {}
    ways = {"full": [], "spb 6,3": ["--spb", "6,3"], "spb 6,1": ["--spb", "6,1"]}
    for seed in args.seeds:
        for name, extra in ways.items():
            losses = train([*gpt, *extra, "--seed", str(seed)])["loss"]
            quality.setdefault(name, []).append(statistics.fmean(losses[-5:]))
            print(f"quality: seed {seed}, {name}", file=sys.stderr, flush=True)
    print(f"\nQuality: the GPT (4 blocks of width 64, the embedding and the head: 6 layers) on the embedded corpus, 2 "
          f"copies, {args.quality_steps} steps; the mean loss of the last 5 steps.\n")
    print("| backpropagation | loss per seed | mean | against full |")
    print("|---|---|---|---|")
    full = statistics.fmean(quality["full"])
    for name, values in quality.items():
        mean = statistics.fmean(values)
        print(f"| {name} | {', '.join(f'{v:.4f}' for v in values)} | {mean:.4f} | {mean - full:+.4f} |")


if __name__ == "__main__":
    main()

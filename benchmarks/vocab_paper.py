"""The simulator's prediction of Vocabulary Parallelism against the paper's published runs (Yeung et al., 2025,
tables 5 and 6): the step-time ratio without and with the output layer split, beside the paper's MFU ratio.

Costs in units of one transformer layer's forward for one microbatch, from the paper's table 4: a layer's forward
is bsh(24h + 4s) FLOPs and its input and weight gradients as much each; the output layer's forward 2bshV and its
input and weight gradients as much each, so the output layer is 2V / (24h + 4s) layers in each pass. The input
layer (3bsh) is left out. Communication is not priced: the prediction is the balance of the computation alone.

    python benchmarks/vocab_paper.py
"""

from __future__ import annotations

import argparse

from pipefold import schedules
from pipefold.sim.simulate import CostModel, simulate

# (schedule, devices, layers, hidden, seq, microbatches, {vocab: (baseline MFU, Vocab-1 MFU)}) from the paper.
RUNS = [
    ("1f1b", 8, 32, 3072, 2048, 128, {32: (46.16, 50.42), 64: (40.48, 50.28), 128: (33.11, 49.93),
                                      256: (25.23, 50.12)}),
    ("v-half", 16, 32, 4096, 2048, 128, {32: (46.41, 52.82), 64: (38.52, 53.11), 128: (28.75, 53.41),
                                         256: (19.99, 52.89)}),
]


def predicted(name: str, p: int, layers: int, h: int, s: int, m: int, vocab_k: int) -> float:
    """Step time without the split over step time with it."""
    per_device = layers / p
    head = 2 * vocab_k * 1024 / (24 * h + 4 * s)
    cost = CostModel(f=per_device, b=per_device, w=per_device, vocab_f=head, vocab_b=head, vocab_w=head)
    plain = simulate(schedules.build(name, p, m), cost).makespan
    split = simulate(schedules.build(name, p, m, vocab=1), cost).makespan
    return plain / split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per step instead of the paper's 128 (a quicker check)")
    args = parser.parse_args()
    print("| schedule | GPUs | vocabulary | predicted speed-up | paper's MFU ratio | paper: baseline -> Vocab-1 MFU |")
    print("|---|---|---|---|---|---|")
    for name, p, layers, h, s, m, table in RUNS:
        for vocab_k, (base, split) in table.items():
            got = predicted(name, p, layers, h, s, args.microbatches or m, vocab_k)
            print(f"| {name} | {p} | {vocab_k}k | {got:.2f}x | {split / base:.2f}x | {base} -> {split} |")


if __name__ == "__main__":
    main()

"""Measured peak activation memory of V-shape schedules over 1F1B, against the simulator's prediction.

Runs the GPT (default 14 blocks, width 64, batch 16 of 64 tokens, 8
microbatches) on 4 local processes with 1f1b and with each V-shape schedule,
and compares the ratio of the highest measured peak activation bytes (saved
tensors plus held stage outputs) with the ratio the simulator predicts when
each stage's memory is the bytes its forward saves for one microbatch (which
the ranks measure in the same run). Target: within 5%.

    python benchmarks/memory_ratio.py [--model gpt|mlp] [--schedules v-half v-min zb-v]
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from pipefold import build, simulate
from pipefold.simulate import CostModel, StageOverride
from pipefold.train import TrainConfig, train


def _run(name: str, model: str) -> tuple[int, float]:
    """(measured peak bytes, simulated peak bytes) of one schedule."""
    layers = 14 if model == "gpt" else 16
    cfg = TrainConfig(schedule=name, stages=4, microbatches=8, steps=2, model=model, layers=layers, hidden=64,
                      batch=16, partition="even")  # the same layers per stage for every schedule compared
    job, reports = train(cfg)
    measured = max(max(s.peak_activation_bytes for s in r.steps) for r in reports)
    stage_bytes = {s: b for r in reports for s, b in r.steps[-1].stage_bytes.items()}
    cost = CostModel(stage_overrides={s: StageOverride(f=1, b=1, w=1, memory=b) for s, b in stage_bytes.items()})
    predicted = max(simulate(job.schedule, cost).peak_memory)
    return measured, predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    parser.add_argument("--schedules", nargs="+", default=["v-half", "v-min", "zb-v"])
    args = parser.parse_args()
    base_measured, base_predicted = _run("1f1b", args.model)
    table = Table(title=f"peak activation over 1f1b, {args.model}, 4 processes, 8 microbatches", title_justify="left")
    for col in ("schedule", "measured peak", "measured ratio", "simulated ratio", "unit-cost ratio", "gap"):
        table.add_column(col, justify="right")
    unit_base = max(simulate(build("1f1b", 4, 8)).peak_memory)
    for name in args.schedules:
        measured, predicted = _run(name, args.model)
        m_ratio, s_ratio = measured / base_measured, predicted / base_predicted
        unit = max(simulate(build(name, 4, 8)).peak_memory) / unit_base
        table.add_row(name, f"{measured / 2**20:.2f} MiB", f"{m_ratio:.3f}", f"{s_ratio:.3f}", f"{unit:.3f}",
                      f"{m_ratio / s_ratio - 1:+.1%}")
    Console().print(table)


if __name__ == "__main__":
    main()

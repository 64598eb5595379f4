"""Measured peak memory of the V-shape schedules over 1F1B, next to the simulator's prediction and the papers'.

Four local ranks, 16 microbatches, two models (the issue's configurations):

    gpt   hidden 256, 16 blocks, 4 heads, 256 tokens, batch 32   (one activation: 512 KiB)
    mlp   width 512, 16 blocks, batch 256                        (one activation: 32 KiB)

For each schedule the ranks measure, with the honest meter (every storage they hold counted once,
the batch apart: pipefold.runtime.meter), their peak over a step and, per stage, the bytes one
microbatch holds after its F and between its B and its W. The simulator is then fed those two
figures per stage and predicts each rank's peak; the papers' ratios are the simulator's at unit
memory. The meter itself is checked against torch's MemTracker in tests/test_memory.py.

    python benchmarks/memory_ratio.py [--model gpt mlp] [--partition memory] [--runs 2] [--hidden 64]

``--hidden`` sets both models' width (and the GPT's sequence with it) below the issue's, to check the benchmark
runs; its figures are then no longer the issue's.

Targets (GPT, memory-aware split): v-half/1f1b <= 0.80, v-min/1f1b <= 0.55, zb-v/1f1b <= 1.05, and
every rank's measured peak within 5% of the prediction.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from pipefold import build, simulate
from pipefold.errors import run_script
from pipefold.runtime.measure.timeline import measured_costs
from pipefold.train.run import train
from pipefold.train.spec import RunSpec
from pipefold.units import format_bytes

MODELS: dict[str, dict[str, Any]] = {
    "gpt": dict(model="gpt", layers=16, hidden=256, heads=4, seq=256, batch=32),
    "mlp": dict(model="mlp", layers=16, hidden=512, batch=256),
}
TARGETS = {"v-half": 0.80, "v-min": 0.55, "zb-v": 1.05}


def measure(model: str, name: str, partition: str, runs: int, hidden: int | None = None) -> dict[str, Any]:
    """Per-rank measured peaks (one list per run), the prediction, and the split; ``hidden``: the model at that
    width (the GPT at that sequence too)."""
    size = dict(MODELS[model])
    if hidden is not None:
        size["hidden"] = hidden
        if "seq" in size:
            size["seq"] = hidden
    measured: list[list[int]] = []
    predicted: list[list[float]] = []  # per run: the split is measured afresh, so it may differ between runs
    splits = []
    for _ in range(runs):
        cfg = RunSpec.flat(schedule=name, devices=4, microbatches=16, steps=2, partition=partition, **size)
        job, reports = train(cfg)
        measured.append([r.steps[-1].peak_activation_bytes for r in reports])
        # The simulator fed with the run's own figures (peaks depend on each device's order, not on times).
        predicted.append(simulate(job.schedule, measured_costs(job.schedule, reports, -1)).peak_memory)
        splits.append(" ".join(str(len(part)) for part in job.layer_stages))
    return {"measured": measured, "predicted": predicted, "split": splits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["gpt", "mlp"])
    parser.add_argument("--schedules", nargs="+", default=["v-half", "v-min", "zb-v"])
    parser.add_argument("--partition", default="memory", choices=["memory", "time", "even"])
    parser.add_argument("--runs", type=int, default=2, help="runs per schedule, for the spread")
    parser.add_argument("--hidden", type=int, default=None,
                        help="both models' width (the GPT's sequence too), smaller than the issue's to check a run")
    args = parser.parse_args()
    if args.hidden is not None and args.hidden < 8:
        parser.error(f"--hidden must be at least 8 (got {args.hidden})")
    console = Console(width=170, markup=False)  # names from the command line
    unit_base = max(simulate(build("1f1b", 4, 16)).peak_memory)
    for model in args.model:
        results = {name: measure(model, name, args.partition, args.runs, args.hidden)
                   for name in ["1f1b", *args.schedules]}
        base = statistics.median(max(run) for run in results["1f1b"]["measured"])
        base_pred = statistics.median(max(run) for run in results["1f1b"]["predicted"])
        width = "" if args.hidden is None else f", width {args.hidden}"
        table = Table(title=f"{model}{width}: peak memory over 1f1b, 4 ranks, 16 microbatches, {args.partition} split",
                      title_justify="left")
        for col in ("schedule", "layers per stage", "peak (highest rank)", "measured ratio", "simulated ratio",
                    "paper ratio", "target", "worst rank vs prediction"):
            table.add_column(col, justify="right")
        for name, res in results.items():
            runs: list[list[int]] = res["measured"]
            preds: list[list[float]] = res["predicted"]
            peaks = [max(run) for run in runs]
            ratios = [p / base for p in peaks]
            gaps = [m / p - 1 for run, pred in zip(runs, preds, strict=True) for m, p in zip(run, pred, strict=True)]
            worst = max(gaps, key=abs)
            unit = max(simulate(build(name, 4, 16)).peak_memory) / unit_base
            spread = f" ({min(ratios):.3f}-{max(ratios):.3f})" if len(ratios) > 1 else ""
            simulated = statistics.median(max(pred) for pred in preds) / base_pred
            table.add_row(name, " / ".join(sorted(set(res["split"]))),
                          format_bytes(statistics.median(peaks)),
                          f"{statistics.median(ratios):.3f}{spread}", f"{simulated:.3f}",
                          f"{unit:.3f}", f"<= {TARGETS[name]:.2f}" if name in TARGETS else "",
                          f"{worst:+.1%}")
        console.print(table)


if __name__ == "__main__":
    run_script(main)

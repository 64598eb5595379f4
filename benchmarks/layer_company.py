"""A layer timed alone against the same layer timed among the layers of its stage.

A profile that runs one layer over and over keeps that layer's weights in the caches; in the run a rank sends each
microbatch through its whole stage, so between two passes of a layer the rest of the stage's weights go through
the caches. This benchmark times the MLP's block (forward then backward of one microbatch) both ways with nothing
but torch (the independent check), interleaved round by round so the machine's drift hits both, and beside them
what pipefold's profile timer (:func:`pipefold.runtime.measure.profiling.time_in_stages`) reports with one layer at a
time
and with a stage's worth:

And what a stage's passes pay once that each of its layers timed alone paid again (the runner's own work per pass,
``Profile.pass_fixed``), measured as the profile measures it on stages of several sizes: the cost model takes it
as the same whatever the stage holds, so a stage of n layers saves n - 1 of it.

    python benchmarks/layer_company.py                       # width 512, a stage of 8, 5 rounds
    python benchmarks/layer_company.py --hidden 128 --stage 8 --json
    python benchmarks/layer_company.py --hidden 128 --rows 8 --fixed 2,4,8,16   # the fixed work per stage size
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from pipefold.errors import run_script
from pipefold.models import make_model
from pipefold.runtime.measure.profiling import measure_layers, time_in_stages


def _pass(layer: torch.nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    layer(x).sum().backward()
    return time.perf_counter() - t0


def _plain(layers: list[torch.nn.Module], x: torch.Tensor, laps: int) -> float:
    """Median seconds of one layer's forward and backward, the layers taken in turn (one of them: alone)."""
    times = [_pass(layers[i % len(layers)], x) for i in range(laps + len(layers))]
    return statistics.median(times[len(layers):])


def measure(hidden: int, stage: int, rows: int, rounds: int, laps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = make_model("mlp", layers=stage, hidden=hidden, batch=rows)
    layers = model.build()
    x = torch.randn(rows, hidden, requires_grad=True)
    out: dict[str, list[float]] = {"alone": [], "among": [], "timer 1": [], "timer stage": []}
    for _ in range(rounds):
        out["alone"].append(_plain(layers[:1], x, laps))
        out["among"].append(_plain(layers, x, laps))
        for key, k in (("timer 1", 1), ("timer stage", stage)):
            timed, _ = time_in_stages(layers, x.detach(), stage_layers=k, repeats=3, fused=False, whole=False)
            out[key].append(statistics.median(t.f + t.b + t.w for t in timed))
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    ratios = [b / a for a, b in zip(out["alone"], out["among"], strict=True)]
    return {"hidden": hidden, "stage": stage, "rows": rows,
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in out.items()},
            "among_over_alone": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "timer_ratio": statistics.median(out["timer stage"]) / statistics.median(out["timer 1"])}


def fixed_by_stage(hidden: int, rows: int, sizes: list[int], rounds: int) -> dict[int, list[list[float]]]:
    """For each stage size, round by round: the fixed work per pass (F, B, W, BW seconds) the profile measures
    (:func:`measure_layers` with that many layers a stage) on an MLP of ``max(sizes)`` layers."""
    torch.set_num_threads(1)
    model = make_model("mlp", layers=max(sizes), hidden=hidden, batch=rows)
    layers = model.build()
    x, y = model.batch_at(0)
    out: dict[int, list[list[float]]] = {k: [] for k in sizes}
    for _ in range(rounds):
        for k in sizes:
            out[k].append(list(measure_layers(layers, x, y, model.loss, repeats=9, stage_layers=k).fixed))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512, help="the MLP's width (default 512)")
    ap.add_argument("--stage", type=int, default=8, help="layers in the stage (default 8)")
    ap.add_argument("--rows", type=int, default=16, help="rows of one microbatch (default 16)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--laps", type=int, default=40, help="passes timed per way and round (default 40)")
    ap.add_argument("--fixed", metavar="SIZES", help="instead: the fixed work per pass on stages of these sizes "
                                                      "(comma-separated, each at least 2), --rounds rounds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if min(args.hidden, args.stage, args.rows, args.rounds, args.laps) < 1:
        ap.error("--hidden, --stage, --rows, --rounds and --laps must be at least 1")
    if args.fixed is not None:
        try:
            sizes = [int(k) for k in args.fixed.split(",")]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 2:
            ap.error(f"--fixed takes stage sizes of 2 layers or more, comma-separated (got {args.fixed!r})")
        fixed = fixed_by_stage(args.hidden, args.rows, sizes, args.rounds)
        if args.json:
            print(json.dumps({"hidden": args.hidden, "rows": args.rows, "fixed_s": fixed}))
            return
        table = Table(title=f"MLP of width {args.hidden}, {args.rows} rows: fixed work per pass (us), each round")
        for col in ("layers a stage", "F", "B", "W", "BW"):
            table.add_column(col, justify="right")
        for k, runs in fixed.items():
            table.add_row(str(k), *(" ".join(f"{r[i] * 1e6:.0f}" for r in runs) for i in range(4)))
        Console(markup=False).print(table)
        return
    result = measure(args.hidden, args.stage, args.rows, args.rounds, args.laps)
    if args.json:
        print(json.dumps(result))
        return
    table = Table(title=f"MLP block, width {args.hidden}, {args.rows} rows: forward + backward, medians of "
                        f"{args.rounds} rounds")
    for col in ("plain torch alone", f"among {args.stage}", "ratio (min..max)", "profile timer 1 / stage"):
        table.add_column(col, justify="right")
    ms, r = result["median_ms"], result["among_over_alone"]
    table.add_row(f"{ms['alone']:.3f} ms", f"{ms['among']:.3f} ms",
                  f"{r['median']:.2f} ({r['min']:.2f}..{r['max']:.2f})",
                  f"{ms['timer 1']:.3f} / {ms['timer stage']:.3f} ms ({result['timer_ratio']:.2f})")
    Console(markup=False).print(table)


if __name__ == "__main__":
    run_script(main)

"""Model-state chunks (PatrickStar, AxoNN) on real runs: the largest GPT that trains within a fixed device budget
with and without them, the model state each rank's device holds, and the step time, beside the prediction.

    python benchmarks/state_chunks.py [--budget 40MB] [--other-budgets 20MB ...] [--layers 1 2 ... 14]
                                      [--hidden 256] [--seq 32] [--chunk-size auto] [--devices 2] [--steps 4]
                                      [--repeats 2] [--device cpu] [--precision fp32] [--json]

A GPT (4 heads, batch 4 of --seq tokens, 4 microbatches, 1F1B on --devices local ranks, AdamW) trains once per
layer count plainly and once with ``--state-chunks --memory-budget BUDGET``. A rank's device holds, by the
runtime's own account (on a CPU the "device" is that account): the parameters, their gradients and the optimizer
state it keeps there (``RankReport.static_bytes``: the tensors' storages after the run, host chunks left out), plus
the step's activation peak and batch (the memory meter's). A run fits when every rank's total is within the
budget. The prediction counts each rank's parameters from its layers (built with fake tensors), AdamW's two
moments, the chunks the placement rule (:func:`pipefold.plan.chunks.place`) puts on the device, and the activation
peak the simulator predicts from the plain run's measured per-microbatch bytes.

With ``--precision bf16-master`` both runs hold bf16 parameters with float32 master weights (``--dtype bf16
--master-weights``); the chunks then hold the masters and their gradients too, and the device only the bf16
parameters (AxoNN's split).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from pipefold.errors import run_script
from pipefold.plan.chunks import choose_capacity, pack, place
from pipefold.runtime.measure.timeline import measured_costs
from pipefold.sim.simulate import simulate
from pipefold.train.prepare import model_of
from pipefold.train.run import train
from pipefold.train.spec import RunSpec
from pipefold.units import parse_bytes

STATES = 2
"""AdamW's moments per parameter."""


def spec(layers: int, chunks: bool, args: argparse.Namespace) -> RunSpec:
    extra: dict[str, Any] = {"state_chunks": True, "memory_budget": args.budget} if chunks else {}
    if chunks and args.chunk_size != "auto":
        extra["chunk_size"] = args.chunk_size
    if args.precision == "bf16-master":
        extra.update(dtype="bf16", master_weights=True)
    return RunSpec.flat(schedule="1f1b", devices=args.devices, microbatches=4, steps=args.steps, model="gpt",
                        layers=layers, hidden=args.hidden, heads=4, seq=args.seq, batch=4, partition="params",
                        optimizer="adamw", device=args.device, **extra)


def rank_sizes(run: RunSpec, job: Any) -> list[list[int]]:
    """Each rank's parameters' elements, in order, from its layers built with fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        layers = model_of(run, job.schedule.stages).build()
        sizes = [[p.numel() for p in layer.parameters()] for layer in layers]
    return [[n for s in job.schedule.stages_of(d) for i in job.layer_stages[s] for n in sizes[i]]
            for d in range(job.schedule.devices)]


def step_time(reports: list[Any], update_only: bool = False) -> float:
    """The median over the steps after the first of the slowest rank's step (the optimizer's included), or of its
    update alone (the optimizer step, where the chunks' copies and host steps are)."""
    return statistics.median(max(r.steps[i].update + (0 if update_only else r.steps[i].wall) for r in reports)
                             for i in range(1, len(reports[0].steps)))


def measure(layers: int, args: argparse.Namespace, budget: float) -> dict[str, Any]:
    row: dict[str, Any] = {"layers": layers}
    plain_cost = None
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    runs = {}
    for _ in range(args.repeats):  # plain and chunked in turn, so that the machine's drift falls on both
        for chunks in (False, True):
            runs[chunks] = train(spec(layers, chunks, args))
            times[chunks].append((step_time(runs[chunks][1]), step_time(runs[chunks][1], update_only=True)))
    for chunks in (False, True):
        run = spec(layers, chunks, args)
        job, reports = runs[chunks]
        if plain_cost is None:
            plain_cost = measured_costs(job.schedule, reports, len(reports[0].steps) - 1)
        activations = [r.steps[-1].peak_activation_bytes + r.steps[-1].batch_bytes for r in reports]
        device = [r.static_bytes + a for r, a in zip(reports, activations, strict=True)]
        # The prediction: the parameters and gradients, the state the rule places, the simulated activations.
        sizes = rank_sizes(run, job)
        act = simulate(job.schedule, plain_cost).peak_memory
        batch = [r.steps[-1].batch_bytes for r in reports]
        want, place_device = [], []
        masters = args.precision == "bf16-master"
        for d, ps in enumerate(sizes):
            # float32 parameters and gradients; with master weights, bf16 parameters and float32 masters and
            # gradients (in the chunks with them: the bf16 parameters alone, and their gradients while a backward
            # makes them, which the placement leaves room for)
            weights = (10 if masters else 8) * sum(ps) if not chunks else (2 if masters else 8) * sum(ps)
            if chunks:
                capacity = choose_capacity(ps) if args.chunk_size == "auto" else int(parse_bytes(args.chunk_size)) // 4
                caps = [capacity] * len(pack(ps, capacity))
                room = budget - (4 if masters else 8) * sum(ps) - act[d] - batch[d]
                state = place(caps, STATES, room, masters=masters).device_bytes
                place_device.append(state)
            else:
                state = 4 * STATES * sum(ps)
            want.append(weights + state + act[d] + batch[d])
        held = [r.steps[-1].state_bytes or (0, 0) for r in reports] if chunks else [(0, 0)] * len(reports)
        # The least the device holds: with chunks, less the state they placed on it (what a smaller budget
        # would have left in host memory); the prediction's likewise.
        least = [d - h for d, (h, _) in zip(device, held, strict=True)]
        least_want = [w - (place_device[i] if chunks else 0) for i, w in enumerate(want)]
        row["chunks" if chunks else "plain"] = {
            "device_bytes": device, "predicted_bytes": [round(w) for w in want],
            "least_bytes": least, "predicted_least_bytes": [round(w) for w in least_want],
            "state_bytes": [r.static_bytes for r in reports], "host_bytes": [h for _, h in held],
            "fits": max(device) <= budget, "predicted_fits": max(want) <= budget,
            "step_s": statistics.median(t for t, _ in times[chunks]),
            "update_s": statistics.median(u for _, u in times[chunks]),
            "update_spread_s": [min(u for _, u in times[chunks]), max(u for _, u in times[chunks])],
            "parameters": sum(sum(ps) for ps in sizes),
            # The model state a rank's device holds at the least: without chunks all of it, with them the
            # parameters and gradients (what it holds less the chunks it keeps on the device).
            "least_state_bytes": [r.static_bytes - d for r, (d, _) in zip(reports, held, strict=True)],
        }
    return row


def largest(rows: list[dict[str, Any]], how: str, key: str, budget: float | None = None) -> dict[str, Any] | None:
    """The row of the most parameters that fits ``how`` (plain or chunks), as measured or predicted (``key``); at
    another ``budget``, from the least bytes the device held (the chunks' state in host memory)."""
    if budget is None:
        fitting = [r for r in rows if r[how][key]]
    else:
        least = "least_bytes" if key == "fits" else "predicted_least_bytes"
        fitting = [r for r in rows if max(r[how][least]) <= budget]
    return max(fitting, key=lambda r: r[how]["parameters"]) if fitting else None


def at_budgets(rows: list[dict[str, Any]], budgets: list[float]) -> list[dict[str, Any]]:
    """At each budget, the largest model each way (measured and predicted) and the ratio of their parameters."""
    out = []
    for b in budgets:
        entry: dict[str, Any] = {"budget": b}
        for key, name in (("fits", "measured"), ("predicted_fits", "predicted")):
            plain, chunked = largest(rows, "plain", key, b), largest(rows, "chunks", key, b)
            entry[name] = {"plain_layers": plain and plain["layers"], "chunks_layers": chunked and chunked["layers"],
                           "ratio": chunked["chunks"]["parameters"] / plain["plain"]["parameters"]
                           if plain and chunked and chunked["layers"] != rows[-1]["layers"] else None}
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="40MB", help="each device's memory")
    parser.add_argument("--layers", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    parser.add_argument("--other-budgets", nargs="*", default=["20MB", "30MB", "50MB", "60MB"],
                        help="budgets to find the largest model at from the same runs")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--chunk-size", default="auto", help="bytes of float32 per chunk (auto: chosen from the "
                                                                 "parameters' sizes)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, plain and chunked in turn")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the ranks compute (cuda: a GPU per rank, or the ranks sharing one)")
    parser.add_argument("--precision", choices=["fp32", "bf16-master"], default="fp32",
                        help="bf16-master: bf16 parameters with float32 master weights, which the chunks hold")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    budget = parse_bytes(args.budget)
    rows = [measure(layers, args, budget) for layers in args.layers]
    summary: dict[str, Any] = {}
    for key, name in (("fits", "measured"), ("predicted_fits", "predicted")):
        plain, chunked = largest(rows, "plain", key), largest(rows, "chunks", key)
        summary[name] = {"plain_layers": plain and plain["layers"], "chunks_layers": chunked and chunked["layers"],
                         "ratio": chunked["chunks"]["parameters"] / plain["plain"]["parameters"]
                         if plain and chunked else None}
    others = at_budgets(rows, [parse_bytes(b) for b in args.other_budgets])
    if args.json:
        print(json.dumps({"rows": rows, "largest": summary, "budgets": others}))
        return
    print(f"GPT hidden {args.hidden}, {args.seq} tokens, batch 4, 4 microbatches, 1F1B on {args.devices} ranks, "
          f"AdamW, {args.precision}; device budget {args.budget}, chunks: {args.chunk_size}")
    print(f"{'layers':>6} {'params':>10} | {'plain: device MiB (pred)':27} | {'chunks: device MiB (pred)':27} "
          f"{'host MiB':>8} | {'state/least':>11} | {'update plain':>12} {'chunks':>7} | {'step':>5}")
    for r in rows:
        p, c = r["plain"], r["chunks"]

        def cell(x: dict[str, Any]) -> str:
            got, want = max(x["device_bytes"]) / 2**20, max(x["predicted_bytes"]) / 2**20
            agree = "" if x["fits"] == x["predicted_fits"] else "*"
            return f"{got:7.1f} ({want:7.1f}) {'fits' if x['fits'] else 'over':>4}{agree}"

        least = max(p["least_state_bytes"]) / max(c["least_state_bytes"])
        print(f"{r['layers']:6d} {p['parameters']:10,d} | {cell(p):27} | {cell(c):27} "
              f"{max(c['host_bytes']) / 2**20:8.1f} | {least:10.2f}x | {p['update_s'] * 1e3:10.1f}ms "
              f"{c['update_s'] / p['update_s']:6.2f}x | {c['step_s'] / p['step_s']:4.2f}x")
    for name, s in summary.items():
        ratio = f"{s['ratio']:.2f}x the parameters" if s["ratio"] else "-"
        print(f"largest that fits ({name}): plain {s['plain_layers']} layers, with chunks {s['chunks_layers']}: "
              f"{ratio}")
    print("at other budgets, from the same runs (the least each way held; - where the largest run still fits):")
    for e in others:
        m, w = e["measured"], e["predicted"]
        ratio = "-" if m["ratio"] is None else f"{m['ratio']:.2f}x"
        want = "-" if w["ratio"] is None else f"{w['ratio']:.2f}x"
        print(f"  {e['budget'] / 1e6:5.0f} MB: plain {m['plain_layers']} layers, chunks {m['chunks_layers']}: "
              f"{ratio} the parameters (predicted {want})")
    print("state/least: the model state a rank's device holds without chunks over the least it holds with them "
          "(parameters and gradients); * where the prediction says otherwise")


if __name__ == "__main__":
    run_script(main)

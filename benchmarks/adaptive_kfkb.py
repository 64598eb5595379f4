"""Adaptive kFkB against 1F1B and every static k, on a network that alternates idle and preempted periods.

4 local gloo ranks train the GPT (hidden 256, 8 blocks, seq 128, batch 32, 8 microbatches: a microbatch's
activation is 512 KiB) for ``--steps`` steps under each network, in two modes:

* ``emulated``: the runtime's links delay each send as the profile says (``--network``);
* ``netns``: each rank in its own network namespace, veth links capped by tc's tbf at the idle bandwidth,
  the preempted periods made by flooding the links between neighbouring ranks with TCP (``--netns``);
  skipped with the reason where namespaces cannot be made.

Networks (times in seconds from the launch of each run, the same for every run):

* ``alternating``: idle (40 MB/s) for 10 s, then preempted (6 MB/s emulated; whatever the flood leaves on
  a real link) for 20 s, repeating;
* ``idle``: 40 MB/s all along; and, emulated only, ``fast``: 1 GB/s all along (the policy's own overhead).

Each run's figure is its mean step time: from the first step's start to the last step's end, over the
steps. Targets: under ``alternating`` adaptive is at least 10% faster than 1F1B and within 5% of the best
static k chosen in hindsight; on an idle network at most 2% slower than 1F1B.

    OMP_NUM_THREADS=1 python benchmarks/adaptive_kfkb.py [--modes emulated,netns] [--steps 40] [--repeats 2]
        [--json out.json] [--figure docs/figures/adaptive-kfkb.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipefold.errors import run_script
from pipefold.files import save_figure, write_json
from pipefold.runtime.measure.timeline import per_step
from pipefold.sim.network import Conditions, LinkState, Network
from pipefold.train.run import train
from pipefold.train.spec import RunSpec

MODEL = dict(devices=4, microbatches=8, model="gpt", layers=8, hidden=256, heads=4, batch=32, seq=128,
             partition="even", optimizer="adamw")
IDLE, BUSY = 40e6, 6e6
LATENCY = 1e-4
STATIC = ("kfkb:k=1", "kfkb:k=2", "kfkb:k=4", "kfkb:k=8")


def alternating(idle_s: float = 10.0, busy_s: float = 20.0) -> Network:
    return Network(Conditions((0.0, idle_s), (LinkState(LATENCY, IDLE), LinkState(LATENCY, BUSY)),
                              period=idle_s + busy_s), name=f"alternating {idle_s:g} s idle / {busy_s:g} s busy")


def run(schedule: str, network: str, mode: str, steps: int) -> dict[str, Any]:
    config = RunSpec.flat(schedule=schedule, steps=steps, network=network, netns=mode == "netns",
                         adapt_every=2, **MODEL)
    started = time.time()
    job, reports = train(config)
    first = min(r.steps[0].started_at for r in reports)
    last = max(r.steps[-1].started_at + r.steps[-1].wall for r in reports)
    ran = [reports[0].steps.schedule(i) for i in range(len(reports[0].steps))]
    out = {"schedule": schedule, "mean_step_s": (last - first) / steps, "wall_s": time.time() - started,
           "ks": ran, "step_s": [max(r.steps.wall[i] for r in reports) for i in range(steps)]}
    if job.adaptive is not None:
        out["decisions"] = [{"from_step": f, "k": d.k, "reason": d.reason,
                             "slowest_link_Bps": min(d.bandwidth.values(), default=None),
                             "predicted_s": {str(k): v for k, v in d.predicted.items()}}
                            for f, d in reports[0].decisions]
        out["per_step"] = per_step(reports)
        out["origin_offset_s"] = first - (job.origin or first)
    return out


def bench(mode: str, steps: int, repeats: int, workdir: Path) -> dict[str, Any]:
    profile = workdir / "alternating.json"
    alternating().save(profile)
    networks = {"alternating": str(profile), "idle": f"constant:latency={LATENCY},bandwidth={IDLE:.0f}"}
    if mode == "emulated":
        networks["fast"] = f"constant:latency={LATENCY},bandwidth=1e9"
    out: dict[str, Any] = {"mode": mode, "networks": networks, "runs": {}}
    for net, spec in networks.items():
        schedules = (*STATIC, "adaptive-kfkb") if net == "alternating" else ("kfkb:k=1", "adaptive-kfkb")
        for rep in range(repeats):
            for schedule in schedules:
                row = run(schedule, spec, mode, steps)
                out["runs"].setdefault(net, {}).setdefault(schedule, []).append(row)
                print(f"{mode:8s} {net:11s} #{rep} {schedule:14s} {row['mean_step_s']:.3f} s/step "
                      f"(ks {_ks(row['ks'])})", file=sys.stderr, flush=True)
    return out


def _ks(ran: list[str]) -> str:
    return "".join(spec.rpartition("=")[2] for spec in ran)


def summarize(result: dict[str, Any]) -> list[str]:
    lines = []
    for net, runs in result["runs"].items():
        means = {s: [r["mean_step_s"] for r in rows] for s, rows in runs.items()}
        med = {s: statistics.median(v) for s, v in means.items()}
        lines.append(f"{result['mode']} / {net}:")
        for s, v in means.items():
            lines.append(f"  {s:14s} {med[s]:.3f} s/step  (runs {', '.join(f'{x:.3f}' for x in v)})")
        ada, one = med["adaptive-kfkb"], med["kfkb:k=1"]
        lines.append(f"  adaptive vs 1F1B: {ada / one - 1:+.1%}")
        static = {s: m for s, m in med.items() if s != "adaptive-kfkb"}
        best = min(static, key=lambda s: static[s])
        lines.append(f"  adaptive vs the best static ({best}): {ada / static[best] - 1:+.1%}")
    return lines


def figure(results: list[dict[str, Any]], path: str) -> None:
    """Mean step time of every schedule, per network and mode (bars: median; dots: each run)."""
    from matplotlib.figure import Figure

    panels = [(r["mode"], net, runs) for r in results for net, runs in r["runs"].items()]
    fig = Figure(figsize=(4.2 * len(panels), 4), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (mode, net, runs) in zip(axes, panels, strict=True):
        names = list(runs)
        meds = [statistics.median(r["mean_step_s"] for r in runs[s]) for s in names]
        colors = ["#ee6677" if s == "adaptive-kfkb" else "#4477aa" for s in names]
        ax.bar(range(len(names)), meds, color=colors)
        for i, s in enumerate(names):
            ax.scatter([i] * len(runs[s]), [r["mean_step_s"] for r in runs[s]], color="black", s=8, zorder=3)
        ax.set_xticks(range(len(names)), [s.replace("kfkb:", "").replace("adaptive-kfkb", "adaptive")
                                          for s in names], fontsize=8)
        ax.set_title(f"{mode}: {net}", fontsize=9)
        ax.set_ylabel("mean step time (s)")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle("GPT on 4 gloo ranks, 8 microbatches: 1F1B (k=1), static kFkB and adaptive kFkB", fontsize=10)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="emulated,netns")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--figure", default=None, help="bar chart of every run (.png)")
    parser.add_argument("--run-figure", default=None, help="k, bandwidth and step time over the first adaptive run "
                                                           "under the alternating network, emulated (.png)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            if mode == "netns":
                from pipefold.runtime.launch.netns import unavailable

                reason = unavailable()
                if reason is not None:
                    print(f"netns mode skipped: {reason}", file=sys.stderr)
                    continue
            results.append(bench(mode, args.steps, args.repeats, Path(tmp)))
            print("\n".join(summarize(results[-1])), flush=True)
    if args.json:
        write_json(args.json, results, indent=1)
    if args.figure:
        figure(results, args.figure)
    if args.run_figure and results and results[0]["mode"] == "emulated":
        from pipefold.sim.render import plot_adaptive

        row = results[0]["runs"]["alternating"]["adaptive-kfkb"][0]
        plot_adaptive(row["per_step"], [dict(d, bandwidth={"slowest": d["slowest_link_Bps"]})
                                        for d in row["decisions"]],
                      alternating(), args.run_figure, offset=row["origin_offset_s"],
                      title="adaptive kFkB, 4 gloo ranks, emulated links: 10 s at 40 MB/s, 20 s at 6 MB/s")


if __name__ == "__main__":
    run_script(main)

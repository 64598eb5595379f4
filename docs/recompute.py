"""Regenerate the figure and table of docs/recompute.md from the library.

    python docs/recompute.py

Measures a GPT split into 4 stages under 1F1B on this machine's CPU (one
microbatch per stage and recomputed-layer count, as ``pipefold train`` does),
plans none / full / auto at a budget halfway between, and draws each device's
predicted memory. Nothing is run across processes: tests/test_recompute.py
checks on real runs that the runtime holds exactly what is predicted here.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipefold.files import save_figure  # noqa: E402
from pipefold.plan.recompute import RecomputePlan, plan_recompute, smallest_budget  # noqa: E402
from pipefold.train.prepare import make_job  # noqa: E402
from pipefold.train.spec import RunSpec  # noqa: E402

FIGURE = Path(__file__).resolve().parent / "figures" / "recompute.png"
CONFIG = RunSpec.flat(schedule="1f1b", devices=4, microbatches=8, model="gpt", layers=10, hidden=128, heads=4,
                     batch=32, seq=128, partition="params", recompute="full")


def plans() -> tuple[dict[str, RecomputePlan], float]:
    full = make_job(CONFIG).extra["recompute"]
    schedule = CONFIG.schedule.built
    none = plan_recompute(schedule, full.profiles, "none")
    budget = (smallest_budget(schedule, full.profiles) + max(none.peak)) / 2
    auto = plan_recompute(schedule, full.profiles, "auto", budget)
    return {"none": none, "auto": auto, "full": full}, budget


def draw(found: dict[str, RecomputePlan], budget: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.26
    colours = {"none": "#c44e52", "auto": "#4c72b0", "full": "#55a868"}
    devices = range(len(found["none"].peak))
    for k, (mode, plan) in enumerate(found.items()):
        xs = [d + (k - 1) * width for d in devices]
        static = [s / 2**20 for s in plan.static]
        saved = [a / 2**20 for a in plan.activation_peak]
        ax.bar(xs, static, width, color="#bbbbbb", edgecolor="white")
        label = f"{mode}: layers {list(plan.layers)}, step {plan.step_time / plan.step_time_without - 1:+.0%}"
        ax.bar(xs, saved, width, bottom=static, color=colours[mode], edgecolor="white", label=label)
    ax.axhline(budget / 2**20, color="black", lw=1, ls="--", label=f"budget {budget / 2**20:.1f} MiB")
    ax.set_ylim(0, max(max(p.peak) for p in found.values()) / 2**20 * 1.45)  # room for the legend
    ax.set_xticks(list(devices), [f"device {d}" for d in devices])
    ax.set_ylabel("MiB (grey: weights, grads, AdamW state)")
    ax.set_title("GPT, 1F1B on 4 devices: per-stage recomputation to a budget", fontsize=10)
    ax.legend(fontsize=8, loc="upper right", frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    save_figure(fig, path, dpi=130)
    plt.close(fig)


def main() -> None:
    found, budget = plans()
    draw(found, budget, FIGURE)
    print(f"budget {budget:.0f} bytes; wrote {FIGURE}")
    print("| mode | layers recomputed per stage | peak per device (MiB) | simulated step |")
    print("|---|---|---|---|")
    for mode, plan in found.items():
        peaks = " ".join(f"{x / 2**20:.2f}" for x in plan.peak)
        print(f"| {mode} | {list(plan.layers)} of {list(plan.stage_layers)} | {peaks} | "
              f"{plan.step_time / plan.step_time_without - 1:+.1%} |")


if __name__ == "__main__":
    main()

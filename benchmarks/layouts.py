"""Every dp x tp x pp layout of a world, predicted and measured: the planner's step time and per-rank peak against a
real run of each.

For each world (4 and 8 local gloo ranks by default) the GPT is profiled once at every tensor-parallel degree that
divides its heads and the world (``pipefold profile --tp``, ``--devices`` the world: how that many ranks share
the cores). Then for every layout of the world (:func:`pipefold.plan.budget.every_layout`) the planner's best 1f1b
plan on that layout alone runs for a few steps, and its prediction is put beside the measurement:

- step time: the profile's prediction against the median measured step (with min..max), the schedule and the
  update after it (the gradients' check, the optimizer step, ZeRO-1's sharing), and where a rank's step goes: its
  passes and its waits on messages and collectives (the median rank, :func:`pipefold.runtime.measure.timeline.
  step_parts`), and the slowest rank's update against the profile's;
- peak per rank: the prediction against the runtime's meter plus the weights, gradients and optimizer state
  counted from the tensors, and against torch's MemTracker (an independent tracker of every tensor) in one step;
- collective bytes per rank and step, in closed form: each block's two tensor-parallel all-reduces in F and two
  in B on ``rows x seq x hidden`` floats, and among the dp copies (:func:`_sharded_bytes`) the ring all-reduce of
  the stage's gradients, with ZeRO-1 also the others' shares of the parameters, with FSDP the parameters'
  all-gather and the gradients' reduce-scatter instead.

Every layout with data-parallel copies runs three ways: without sharding, with ZeRO-1 and with FSDP. FSDP takes no
memory check, so its MemTracker column is empty; its peak adds the weights and gradients it gathers whole, counted
from FSDP's own parameters (``RankReport.gathered_bytes``).

    OMP_NUM_THREADS=1 python benchmarks/layouts.py [--worlds 4,8] [--steps 5] [--json out.json]

A setting ``PIPEFOLD_BENCH_SMALL=1`` shrinks the model and the steps (what the test suite runs).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipefold.errors import run_script  # noqa: E402
from pipefold.files import write_json  # noqa: E402
from pipefold.plan.budget import Layout, copy_peaks, every_layout, plan_model  # noqa: E402
from pipefold.plan.profile import Profile  # noqa: E402
from pipefold.train.overhead import profile_here  # noqa: E402
from plan_accuracy import run_plan  # noqa: E402

SMALL = os.environ.get("PIPEFOLD_BENCH_SMALL") == "1"
MODEL: dict[str, Any] = ({"model": "gpt", "layers": 2, "hidden": 32, "heads": 2, "seq": 16, "batch": 8,
                          "microbatches": 4} if SMALL else
                         {"model": "gpt", "layers": 4, "hidden": 256, "heads": 4, "seq": 64, "batch": 32,
                          "microbatches": 8})


def collective_bytes(profile: Profile, layout: Layout, layer_stages: tuple[tuple[int, ...], ...],
                     microbatches: int) -> tuple[list[int], list[int], list[int]]:
    """Per pipeline device, in a step: the bytes one of its ranks hands to collectives (closed form: per block and
    microbatch four tensor-parallel all-reduces of the block's output, two in F and two in B, the ring all-reduce
    of its gradients' bytes among the copies, ZeRO-1's shares), the tensor-parallel all-reduces that closed form counts,
    and those torch's CommDebugMode counted while the profile ran each layer (``LayerProfile.collectives``)."""
    train = profile.train
    rows = int(train["batch"]) // int(train["microbatches"])
    activation = rows * int(train["seq"]) * int(train["hidden"] or 0) * 4
    sent, formula, counted = [], [], []
    for device, part in enumerate(layer_stages):  # 1f1b: stage d on device d, at that device's degree
        seen = profile.at_tp(layout.degrees[device]).layers
        blocks = sum(1 for i in part if 0 < i < len(seen) - 1)
        calls = 4 * blocks * microbatches if layout.degrees[device] > 1 else 0
        params = sum(seen[i].params for i in part)
        sent.append(int(calls * activation + _sharded_bytes(layout, params)))
        formula.append(calls)
        counted.append(sum(seen[i].collectives for i in part) * microbatches)
    return sent, formula, counted


def _sharded_bytes(layout: Layout, params: int) -> float:
    """Bytes one rank hands to the copies' collectives in a step, closed form: without sharding the ring all-reduce
    of the gradients, 2 (dp - 1) / dp of them; with ZeRO-1 that and the others' shares of the parameters received
    after the step, (dp - 1) / dp; with FSDP the parameters' all-gather and the gradients' reduce-scatter,
    (dp - 1) / dp each."""
    share = (layout.dp - 1) / layout.dp * params
    return {"none": 2 * share, "zero1": 3 * share, "fsdp": 2 * share}[layout.sharding]


def bench_world(world: int, steps: int) -> list[dict[str, Any]]:
    tp = [t for t in (1, 2, 4) if world % t == 0 and int(MODEL["heads"]) % t == 0]
    profile = profile_here(**MODEL, optimizer="adamw", seed=0, devices=world, tp=tp, repeats=3 if SMALL else 7,
                           overhead=not SMALL)
    rows = []
    for layout in every_layout(profile, world):
        try:
            answer = plan_model(profile, world, 1e15, layouts=[layout], families=["1f1b"])
        except Exception as exc:  # a layout 1f1b cannot run (more stages than layers): shown, not measured
            rows.append({"world": world, "layout": str(layout), "skipped": str(exc)})
            continue
        plan = answer.to_dict()
        got = run_plan(plan, steps)
        b = answer.best
        pipelines = layout.dp * max(layout.degrees)
        # Ranks in the job's order (runtime.job.Job.meshes): copies outermost, then devices, a device's ranks.
        coords = [(c, d) for c in range(layout.dp) for d, t in enumerate(layout.degrees) for _ in range(t)]
        device_of = [d for _, d in coords]
        peaks = got["measured"]["peak_bytes"]
        # Each rank its own copy's prediction: under ZeRO-1 the copies keep the state of different shares, and the
        # plan's figure for a device (b.peak_memory) is its heaviest copy's.
        each = copy_peaks(profile, layout, b.spec, b.layer_stages, b.recompute)
        assert [max(column) for column in zip(*each, strict=True)] == [int(x) for x in b.peak_memory]
        predicted_peak = [each[c][d] for c, d in coords]
        row = {"world": world, "layout": str(layout), "dp": layout.dp, "tp": layout.tp_text, "pp": layout.pp,
               "schedule": b.spec, "layer_stages": [list(p) for p in b.layer_stages],
               "predicted_step_s": b.makespan, "measured_step_s": got["measured"]["step_time_s"],
               "measured_step_spread_s": got["measured"]["step_time_spread_s"],
               "step_ratio": got["measured"]["step_time_s"] / b.makespan,
               "predicted_peak_bytes": predicted_peak, "measured_peak_bytes": peaks,
               "peak_ratio_worst": max(abs(m / p - 1) for m, p in zip(peaks, predicted_peak, strict=True)) + 1,
               "memtracker_activation_bytes": got["memtracker_activation_bytes"],
               "meter_activation_bytes": got["meter_activation_bytes_same_step"],
               "pipelines": pipelines,
               # Each rank's step taken apart (runtime.measure.step_parts), the median rank: its passes, and its
               # waits on messages and collectives (gradients' all-reduce, FSDP's gather and reduce-scatter).
               "compute_s": statistics.median(p["compute"] for p in got["step_parts"]),
               # The plan's for them, each rank its device's, the median rank: its passes, sharing the cores, without
               # the runtime's work per message (which the simulated busy time holds and the ranks' passes leave
               # out). By rank, as measured: with a mesh per device a device of 4 ranks is 4 of the median's
               # candidates, and the mean device put its passes beside the median rank's (25% apart at world 8).
               "predicted_compute_s": statistics.median(
                   got["predicted"]["passes_shared_by_device_s"][device_of[r]] for r in range(world)),
               # Their CPU seconds (the operating system's count, on the CPU) against the profile's passes with every
               # rank on cores of its own: whether they did the work the profile measured; compute over it: how much
               # the sharing of cores stretched them, against the plan's (predicted compute over alone).
               "compute_cpu_s": statistics.median(p.get("compute cpu", math.nan) for p in got["step_parts"]),
               "predicted_alone_s": statistics.median(
                   got["predicted"]["passes_alone_by_device_s"][device_of[r]] for r in range(world)),
               # How many ranks compute beside a rank's passes, on average: what the sharing of cores depends on.
               "company": got["company"], "predicted_company": got["predicted"]["company"],
               "waits_s": statistics.median(p["recv wait"] + p["send wait"] + p["collectives"]
                                            for p in got["step_parts"]),
               "collectives_s": statistics.median(p["collectives"] for p in got["step_parts"]),
               # After the schedule: the check and the optimizer step, from the last rank's end of its schedule
               # (the runtime's own clocks) against the profile's layers' updates and the collectives after the step.
               "update_s": got["measured"]["after_schedule_s"],
               "predicted_update_s": got["predicted"]["update_s"]}
        sent, formula, counted = collective_bytes(profile, layout, b.layer_stages,
                                                  int(MODEL["microbatches"]) // layout.dp)
        row.update(collective_bytes_per_rank=sent, tp_all_reduces_closed_form=formula,
                   tp_collectives_counted=counted)
        rows.append(row)
        print(f"world {world} {layout}: step predicted {b.makespan * 1e3:.1f} ms, measured "
              f"{row['measured_step_s'] * 1e3:.1f} ms (x{row['step_ratio']:.2f}); peak per rank predicted "
              f"{max(predicted_peak) / 2**20:.2f} MiB, measured {max(peaks) / 2**20:.2f} MiB "
              f"(worst rank off by {row['peak_ratio_worst'] - 1:.1%}); a rank's passes {row['compute_s'] * 1e3:.0f} "
              f"ms (predicted {row['predicted_compute_s'] * 1e3:.0f}), their CPU {row['compute_cpu_s'] * 1e3:.0f} ms "
              f"(the profile's, each rank on its own cores, {row['predicted_alone_s'] * 1e3:.0f}), "
              f"with {row['company']:.2f} ranks computing beside them (predicted {row['predicted_company']:.2f}); "
              f"its waits {row['waits_s'] * 1e3:.0f} ms ({row['collectives_s'] * 1e3:.0f} in collectives), "
              f"the update after the schedule {row['update_s'] * 1e3:.1f} ms (predicted "
              f"{row['predicted_update_s'] * 1e3:.1f})",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2" if SMALL else "4,8", help="worlds to lay out (default 4,8)")
    ap.add_argument("--steps", type=int, default=3 if SMALL else 5)
    ap.add_argument("--json", default=None, help="write every row to this file")
    args = ap.parse_args()
    rows = [row for world in args.worlds.split(",") for row in bench_world(int(world), args.steps)]
    ran = [r for r in rows if "skipped" not in r]
    if ran:
        ratios = [r["step_ratio"] for r in ran]
        print(f"{len(ran)} layouts: measured / predicted step {min(ratios):.2f}..{max(ratios):.2f} "
              f"(median {statistics.median(ratios):.2f}); worst peak off by "
              f"{max(r['peak_ratio_worst'] for r in ran) - 1:.1%}")
    if args.json:
        write_json(args.json, rows, indent=1)


if __name__ == "__main__":
    run_script(main)

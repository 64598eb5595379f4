"""Does the planner's prediction hold on a real run? Profile a model, plan, run, compare.

For each model (the issue's GPT: hidden 256, 16 blocks, seq 256, batch 32, 16 microbatches; an MLP of
width 512, 16 blocks, batch 256; and, for layers of a millisecond or two, ``gpt-small``, the same GPT at width 64,
and ``mlp-small``, the MLP at width 128 and batch 128) on 4 local gloo ranks:

1. profile it as ``pipefold profile`` does (``pipefold.train.overhead.profile_here``), or read
   ``--profile-NAME``;
2. for 1f1b, zb-h1, zb-v, v-half and v-min: plan that family alone with no memory limit (its best split),
   run it, and put the profile's prediction next to the measurement: step time (median of the steps after
   the first, with min..max), bubble ratio, every rank's peak bytes; the activation part of the peak is
   also read by torch's MemTracker in one step (an independent tracker of every tensor);
3. set a budget at 60% of 1F1B's measured peak, plan over every family, run the chosen plan, and run each
   of the five families' own best plan under that budget (recomputing where it must): the chosen plan
   must fit and be the fastest measured among those that fit.

    OMP_NUM_THREADS=1 python benchmarks/plan_accuracy.py [--models gpt,mlp] [--steps 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

from pipefold.errors import ConfigError, run_script
from pipefold.files import write_json
from pipefold.plan.budget import RunPlan, plan_model, predict, predicted_passes
from pipefold.plan.profile import Profile
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.measure.timeline import measured_result, measured_summary, step_parts
from pipefold.train.overhead import profile_here
from pipefold.train.planned import from_plan
from pipefold.train.prepare import make_job
from pipefold.train.spec import RunSpec

FAMILIES = ("1f1b", "zb-h1", "zb-v", "v-half", "v-min")
MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"model": "gpt", "layers": 16, "hidden": 256, "heads": 4, "seq": 256, "batch": 32, "microbatches": 16},
    "mlp": {"model": "mlp", "layers": 16, "hidden": 512, "heads": 4, "seq": 1, "batch": 256, "microbatches": 16},
    "gpt-small": {"model": "gpt", "layers": 16, "hidden": 64, "heads": 4, "seq": 256, "batch": 32, "microbatches": 16},
    "mlp-small": {"model": "mlp", "layers": 16, "hidden": 128, "heads": 4, "seq": 1, "batch": 128,
                  "microbatches": 16},
}
SETTINGS: dict[str, Any] = {"devices": 4, "families": FAMILIES}
"""What main's flags set: the ranks and the schedules compared."""


def run_plan(plan: dict[str, Any], steps: int) -> dict[str, Any]:
    """Run a plan file's dict; return the prediction, the measurement and MemTracker's reading."""
    ran = RunPlan.from_dict(plan)
    planned = from_plan(ran, RunSpec.flat(steps=steps))
    job = make_job(planned.spec, decided=planned.decided)
    if not job.parallel.fsdp:  # FSDP takes no memory check: MemTracker's column stays empty for it
        job = type(job)(**{**job.__dict__, "verify_memory_step": steps - 1})
    reports = run_local(job)
    profile = Profile.from_dict(plan["profile"])
    result, peaks, static = predict(profile, ran.layout, job.schedule, job.layer_stages,
                                    job.recompute)
    alone, shared = predicted_passes(profile, ran.layout, job.schedule, job.layer_stages, job.recompute)
    got = measured_summary(reports)
    # How many ranks compute beside a rank's passes, on average over the ranks: in the run (every rank, each step
    # after the first) and in the plan (a device stands for its dp x tp ranks, which compute in step).
    ranks = [ran.layout.dp * t for t in ran.layout.degrees]  # each device's ranks, which compute in step
    company = sum(n * c for n, c in zip(ranks, result.timeline.company(ranks), strict=True)) / sum(ranks)
    beside = statistics.median(statistics.fmean(measured_result(job.schedule, reports, i).timeline.company())
                               for i in reports[0].steps.settled(1))
    checks = [r.steps[steps - 1].memory_check or {} for r in reports]
    return {"schedule": plan["schedule"], "layers_per_stage": [len(p) for p in job.layer_stages],
            "recompute": list(job.recompute or ()),
            "predicted": {"step_time_s": result.makespan, "bubble_ratio": result.bubble_ratio, "peak_bytes": peaks,
                          # Each device's passes without the runtime's work between them, which the simulated
                          # busy time holds and the ranks' passes leave out: alone, and sharing cores.
                          "passes_alone_by_device_s": alone, "passes_shared_by_device_s": shared,
                          "update_s": result.makespan - result.timeline.makespan(), "company": company},
            "measured": got, "step_parts": step_parts(reports), "company": beside,
            "memtracker_activation_bytes": [c.get("tracker_between_actions", 0) for c in checks],
            "meter_activation_bytes_same_step": [c.get("meter_between_actions", 0) for c in checks]}


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def bench_model(name: str, profile: Profile, steps: int, budgeted: bool = True) -> dict[str, Any]:
    rows = []
    for family in SETTINGS["families"]:
        plan = plan_model(profile, SETTINGS['devices'], 1e15, families=[family]).to_dict()
        rows.append(run_plan(plan, steps))
        _report(name, rows[-1])
    if not budgeted:
        return {"model": name, "profile": profile.train, "machine": profile.machine, "schedules": rows,
                "chosen": None}
    one_f_one_b = max(rows[0]["measured"]["peak_bytes"])
    budget = 0.6 * one_f_one_b
    try:
        chosen_plan = plan_model(profile, SETTINGS['devices'], budget).to_dict()
    except ConfigError as exc:  # weights and optimizer state alone may exceed 60% of 1F1B's peak
        print(f"{name}: {exc}", flush=True)
        return {"model": name, "profile": profile.train, "machine": profile.machine, "schedules": rows,
                "budget_bytes": budget, "one_f_one_b_peak_bytes": one_f_one_b, "chosen": None,
                "no_plan_fits": str(exc)}
    chosen = run_plan(chosen_plan, steps)
    _report(name, chosen, "chosen")
    under = []
    for family in SETTINGS["families"]:
        try:
            plan = plan_model(profile, SETTINGS['devices'], budget, families=[family]).to_dict()
        except ConfigError as exc:  # the family cannot fit the budget at all
            under.append({"schedule": family, "fits": False, "why": str(exc)})
            continue
        if plan["schedule"] == chosen["schedule"] and plan["layer_stages"] == chosen_plan["layer_stages"] \
                and plan["recompute"] == chosen["recompute"]:
            row = chosen
        else:
            row = run_plan(plan, steps)
            _report(name, row, "under budget")
        under.append({**row, "fits": max(row["measured"]["peak_bytes"]) <= budget})
    fitting = [r for r in under if r.get("fits")] + [chosen]
    fastest = min(fitting, key=lambda r: r["measured"]["step_time_s"])
    return {"model": name, "profile": profile.train, "machine": profile.machine, "schedules": rows,
            "budget_bytes": budget, "one_f_one_b_peak_bytes": one_f_one_b, "chosen": chosen,
            "chosen_fits": max(chosen["measured"]["peak_bytes"]) <= budget, "under_budget": under,
            "fastest_measured_under_budget": fastest["schedule"],
            "chosen_is_fastest": fastest is chosen or fastest["measured"]["step_time_s"]
            >= chosen["measured"]["step_time_s"]}


def _report(model: str, row: dict[str, Any], tag: str = "") -> None:
    p, m = row["predicted"], row["measured"]
    worst = max(abs(_ratio(a, b) - 1) for a, b in zip(m["peak_bytes"], p["peak_bytes"], strict=True))
    lo, hi = m["step_time_spread_s"]
    print(f"{model} {row['schedule']:<24} {tag:<12} step {m['step_time_s'] * 1e3:7.1f} ms "
          f"({lo * 1e3:.0f}..{hi * 1e3:.0f}) vs {p['step_time_s'] * 1e3:7.1f} predicted "
          f"({_ratio(m['step_time_s'], p['step_time_s']) - 1:+.1%}); bubble {m['bubble_ratio']:.1%} vs "
          f"{p['bubble_ratio']:.1%}; worst rank peak {worst:+.1%} off; recompute {row['recompute']}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--steps", type=int, default=4)
    for name in MODELS:
        ap.add_argument(f"--profile-{name}", metavar="FILE", help=f"read {name}'s profile instead of measuring it")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--devices", type=int, default=4, help="ranks (default 4; 2 gives each rank a core here)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="schedules to compare (default: the issue's five)")
    ap.add_argument("--no-budget", action="store_true", help="skip the 60%% budget part")
    args = ap.parse_args()
    SETTINGS.update(devices=args.devices, families=tuple(args.families.split(",")))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = []
    for name in args.models.split(","):
        given = getattr(args, f"profile_{name.replace('-', '_')}")
        t0 = time.perf_counter()
        profile = Profile.load(given) if given else profile_here(devices=SETTINGS['devices'], **MODELS[name])
        if given is None:
            profile.save(f"/tmp/pipefold-bench-{name}-p{SETTINGS['devices']}.json")
        print(f"{name}: profile in {time.perf_counter() - t0:.1f} s; contention {profile.contention}", flush=True)
        out.append(bench_model(name, profile, args.steps, not args.no_budget))
    for r in out:
        runs = [*r["schedules"], *([r["chosen"]] if r["chosen"] else [])]
        times = [abs(_ratio(x["measured"]["step_time_s"], x["predicted"]["step_time_s"]) - 1) for x in runs]
        peaks = [abs(_ratio(a, b) - 1) for x in runs
                 for a, b in zip(x["measured"]["peak_bytes"], x["predicted"]["peak_bytes"], strict=True)]
        print(f"{r['model']} on {SETTINGS['devices']} ranks: step time off by at most {max(times):.1%} (median "
              f"{statistics.median(times):.1%}); peaks off by at most {max(peaks):.1%}")
        if r["chosen"]:
            print(f"  budget {r['budget_bytes'] / 2**20:.1f} MiB: chosen {r['chosen']['schedule']} fits "
                  f"{r['chosen_fits']}, fastest measured that fits: {r['fastest_measured_under_budget']} "
                  f"(chosen is fastest: {r['chosen_is_fastest']})")
    if args.json:
        write_json(args.json, out, indent=1)


if __name__ == "__main__":
    run_script(main)

"""The stage runner's work per pass (``Profile.pass_fixed``), measured by the profile, against a stage timed afresh.

The profile times the model's layers alone and on stages of several layers (:func:`pipefold.runtime.measure.
profiling.measure_layers`); what a stage's pass costs beyond its layers' sum is the runner's fixed work, which the
cost model counts once per stage. Here the MLP of width 128 (passes of 0.1 to 0.2 ms, where that work weighs most)
has 8 layers timed 4 at a time. Each round then times a fresh stage runner over the first 4 layers (torch's own
passes, the independent check) and compares its B + W with the cost model's stage, once with the fixed work and
once without: the fixed work should bring the prediction nearer.

    python benchmarks/fixed_work.py                 # 5 rounds
    python benchmarks/fixed_work.py --rounds 9 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from pipefold.errors import run_script
from pipefold.models import make_model
from pipefold.plan.budget import stage_profiles
from pipefold.plan.profile import LayerProfile, Profile
from pipefold.runtime.measure.profiling import measure_layers, run_passes
from pipefold.runtime.stage import Chain, StageRunner


def _profile(layers: tuple[LayerProfile, ...], fixed: tuple[float, float, float, float]) -> Profile:
    return Profile(train={"model": "mlp", "layers": len(layers), "hidden": 128, "batch": 64, "microbatches": 8,
                          "optimizer": "adamw", "seed": 0},
                   layers=layers, latency=0.0, bandwidth=1e30, contention=(1.0,), optimizer_factor=2.0,
                   pass_fixed=fixed)


def one_round(passes: int) -> dict[str, float]:
    model = make_model("mlp", layers=8, hidden=128, batch=64)
    layers = model.build()
    x, y = model.batch_at(0)
    assert isinstance(x, torch.Tensor)
    measured = measure_layers(layers, x, y, model.loss, repeats=9, stage_layers=4)
    runner = StageRunner(Chain(*layers[:4]), input_grads=False)
    timed = [run_passes(runner, k, (x,))[0] for k in range(passes)]
    b, w = (statistics.median(r[i] for r in timed[1:]) for i in (1, 2))
    prof = _profile(tuple(measured.layers), measured.fixed)
    with_fixed = stage_profiles(prof, [(0, 1, 2, 3)])[0].times
    without = stage_profiles(dataclasses.replace(prof, pass_fixed=(0.0,) * 4), [(0, 1, 2, 3)])[0].times
    return {"fixed_b_ms": measured.fixed[1] * 1e3, "timed_bw_ms": (b + w) * 1e3,
            "error_with_ms": abs(with_fixed[1] + with_fixed[2] - b - w) * 1e3,
            "error_without_ms": abs(without[1] + without[2] - b - w) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each a fresh model (default 5)")
    parser.add_argument("--passes", type=int, default=10,
                        help="timed passes of the fresh stage per round (at least 2: the first warms up)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [one_round(max(2, args.passes)) for _ in range(args.rounds)]
    nearer = sum(r["error_with_ms"] < r["error_without_ms"] for r in rows)
    if args.json:
        print(json.dumps({"rounds": rows, "nearer_with_fixed": nearer}, indent=2))
        return
    print("round  fixed B (ms)  stage B+W timed (ms)  |error| with fixed (ms)  without (ms)")
    for i, r in enumerate(rows, 1):
        print(f"{i:>5}  {r['fixed_b_ms']:>12.3f}  {r['timed_bw_ms']:>20.3f}  {r['error_with_ms']:>23.3f}  "
              f"{r['error_without_ms']:>12.3f}")
    print(f"the fixed work brought the stage's prediction nearer in {nearer} of {len(rows)} rounds")


if __name__ == "__main__":
    run_script(main)

"""How exact a mixed-precision pipeline is: against one process running the same recipe, and against the recipe
itself.

For each recipe (bf16 and fp16 autocast, bf16 and fp16 with master weights) and schedule, the first step's gradients
of ``pipefold train --check`` (the pipeline against one process running the same recipe over the same microbatches)
beside two independent figures computed here in one process on the same GPT, batch and weights:

- the recipe against itself: the same microbatches, their gradients summed in the reverse order (what a schedule
  may change, the order of the float32 sums);
- the recipe against float32: how far the low precision itself moves the gradients.

    OMP_NUM_THREADS=1 python benchmarks/precision_exactness.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from typing import Any

import torch

SIZE = ["--model", "gpt", "--layers", "6", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "8",
        "--microbatches", "4", "--devices", "2", "--steps", "1"]
RECIPES = {"bf16": ["--dtype", "bf16"], "fp16": ["--dtype", "fp16"],
           "bf16 master": ["--dtype", "bf16", "--master-weights"],
           "fp16 master": ["--dtype", "fp16", "--master-weights"]}
SCHEDULES = ("1f1b", "zb-h1", "zb-v", "dualpipev")


def _checked(argv: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "pipefold", "train", *SIZE, *argv, "--check", "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _one_process(recipe: str, order: list[int]) -> list[torch.Tensor]:
    """The first step's gradients of the GPT of SIZE in one process, summed over the microbatches in ``order``."""
    from pipefold.models import make_model
    from pipefold.runtime.precision import LossScaler, Precision

    prec = Precision.of("fp32" if recipe == "fp32" else recipe.replace(" master", "-master"))
    built = make_model("gpt", layers=6, hidden=64, heads=4, seq=32, batch=8, seed=0)
    model = torch.nn.Sequential(*built.build())
    if prec.master_weights:
        model.to(prec.torch_dtype)
    scale = LossScaler().scale if prec.loss_scale is not None else 1.0
    x, y = built.batch_at(0)
    assert isinstance(x, torch.Tensor)  # the GPT's batch: token ids
    sums = [torch.zeros(p.shape) for p in model.parameters()]
    for mb in order:
        ctx = torch.autocast("cpu", dtype=prec.autocast) if prec.autocast else contextlib.nullcontext()
        with ctx:
            loss = built.loss(model(x.chunk(4)[mb]), y.chunk(4)[mb])
        (loss * scale / 4).backward()
        for s, p in zip(sums, model.parameters(), strict=True):
            if p.grad is not None:
                s += p.grad.float()
                p.grad = None
    return [s / scale for s in sums]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / (y.abs().max() + 1e-30)) for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one schedule, two recipes")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    recipes = dict(list(RECIPES.items())[:2]) if args.quick else RECIPES
    schedules = SCHEDULES[:1] if args.quick else SCHEDULES
    fp32 = _one_process("fp32", [0, 1, 2, 3])
    rows: list[dict[str, Any]] = []
    for name, argv in recipes.items():
        forward = _one_process(name, [0, 1, 2, 3])
        itself = _rel(_one_process(name, [3, 2, 1, 0]), forward)
        against_fp32 = _rel(forward, fp32)
        pipeline = {s: _checked([*argv, "--schedule", s])["max_grad_rel_diff"] for s in schedules}
        rows.append({"recipe": name, "pipeline_vs_one_process": pipeline, "recipe_vs_itself": itself,
                     "recipe_vs_fp32": against_fp32})
    print("| recipe | " + " | ".join(f"pipeline vs one process, {s}" for s in schedules)
          + " | recipe vs itself (sums reversed) | recipe vs float32 |")
    print("|---" * (len(schedules) + 3) + "|")
    for r in rows:
        print(f"| {r['recipe']} | " + " | ".join(f"{r['pipeline_vs_one_process'][s]:.1e}" for s in schedules)
              + f" | {r['recipe_vs_itself']:.1e} | {r['recipe_vs_fp32']:.1e} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()

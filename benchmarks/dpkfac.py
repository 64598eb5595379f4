"""DP-KFAC against D-KFAC on the same runs: per data-parallel copy, K-FAC's work, the bytes of its collectives and
the K-FAC state it holds, measured by the ranks and predicted by the closed form, beside the paper's ratios.

For each number of copies, ``pipefold train --json --optimizer kfac --dp N`` runs the GPT with
``--kfac-distribution d-kfac`` and ``dp-kfac``, round after round (the cores' speed drifts within minutes). Per copy
it reads what the ranks counted: the seconds of K-FAC's actions per step (their collectives included), the bytes
they put into K-FAC's collectives per step and the state bytes they hold; beside them, the closed form of
:mod:`pipefold.plan.dpkfac` from the layers' shapes and the owners the run chose (bytes and state exactly, work as
floating-point operations). The gradients' own all-reduce is the same both ways and is left out.

Independent check: the bytes and the state each rank counts are set against the closed form computed from the
layers' shapes alone (they must agree to the byte), and the weights of both runs against one process running K-FAC
on the whole batch (``tests/test_dpkfac.py``). Each copy's computation (its K-FAC seconds less those in its
collectives) is set beside the simulator's timeline of the copy, which lays out each stage's K-FAC seconds timed in
one process before the run, split per copy by :func:`pipefold.plan.dpkfac.stage_work`.

    python benchmarks/dpkfac.py --copies 2 4 --hidden 256 --steps 4 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # this checkout's pipefold, here and in the ranks the runs start
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

PAPER = {"computation": (1.55, 1.65), "communication": (2.79, 3.15), "memory": (1.14, 1.47)}
"""DP-KFAC's reductions against D-KFAC per second-order update on 64 GPUs, as published (less is the ratio)."""


def run(distribution: str, copies: int, args: argparse.Namespace) -> dict[str, Any]:
    """One ``pipefold train --json`` run in this process (its ranks are processes of their own): its report."""
    from pipefold.cli.main import report

    return report(["train", "--model", "gpt", "--schedule", "1f1b", "--devices", str(args.devices), "--dp",
                   str(copies), "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads",
                   str(args.heads), "--seq", str(args.seq), "--batch", str(args.batch * copies), "--microbatches",
                   str(args.microbatches), "--optimizer", "kfac", "--kfac-distribution", distribution, "--steps",
                   str(args.steps), "--partition", "even", "--action-timeout", "600"])


def largest(rows: list[dict[str, Any]], key: str) -> float:
    """The largest copy's figure: the copy the update waits for (for 'sent', all its collectives together)."""
    return max(sum(r[key].values()) if isinstance(r[key], dict) else r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--devices", type=int, default=1, help="pipeline devices of each copy")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per copy")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for copies in args.copies:
            for distribution in ("d-kfac", "dp-kfac"):
                report = run(distribution, copies, args)["kfac"]["copies"]
                runs.setdefault((copies, distribution), []).append(report)
                print(f"round {r + 1}/{args.rounds}: {copies} copies, {distribution}", file=sys.stderr, flush=True)
    print("| copies | distribution | K-FAC work, largest copy (ms/step, each run) | predicted (MFLOP) "
          "| sent, largest copy (KiB/step) | predicted | state, largest copy (MiB) | predicted |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for copies in args.copies:
        got = {}
        for distribution in ("d-kfac", "dp-kfac"):
            reports = runs[copies, distribution]
            each = [largest(rep["per_copy"], "seconds") * 1e3 for rep in reports]
            pred = reports[0]["predicted"]
            sent, state = largest(reports[0]["per_copy"], "sent"), largest(reports[0]["per_copy"], "state_bytes")
            p_sent, p_state = largest(pred, "sent"), largest(pred, "state_bytes")
            # The ranks' counts against the closed form: to the byte, or the figures below mean nothing.
            assert abs(sent - p_sent) <= 1e-6 * max(p_sent, 1) and state == p_state, (copies, distribution, sent,
                                                                                       p_sent, state, p_state)
            flops = largest(pred, "flops")
            got[distribution] = (statistics.median(each), flops, sent, state)
            print(f"| {copies} | {distribution} | {', '.join(f'{t:.1f}' for t in each)} | {flops / 1e6:,.1f} | "
                  f"{sent / 1024:,.1f} | {p_sent / 1024:,.1f} | {state / 2**20:,.2f} | {p_state / 2**20:,.2f} |")
        d, dp = got["d-kfac"], got["dp-kfac"]
        ratios.append((copies, d[0] / dp[0], d[1] / dp[1], d[2] / max(dp[2], 1e-9), d[3] / dp[3]))
    print()
    print("K-FAC's computation per copy (its collectives apart), ms/step: measured by the ranks (each run) against "
          "the simulator's timeline of the copy, from the costs timed in one process before the run (each run)")
    print("| copies | distribution | copy | computing, measured | simulated | measured / simulated |")
    print("|---|---|---|---|---|---|")
    for copies in args.copies:
        for distribution in ("d-kfac", "dp-kfac"):
            reports = runs[copies, distribution]
            for c in range(copies):
                meas = [(rep["per_copy"][c]["seconds"] - rep["per_copy"][c]["comm_seconds"]) * 1e3 for rep in reports]
                sim = [rep["simulated"][c]["kfac_compute_s"] * 1e3 for rep in reports]
                ratio = statistics.median(m / x for m, x in zip(meas, sim, strict=True))
                print(f"| {copies} | {distribution} | {c} | {', '.join(f'{t:.1f}' for t in meas)} | "
                      f"{', '.join(f'{t:.1f}' for t in sim)} | {ratio:.2f} |")
    print()
    print("| copies | work D/DP (measured) | work D/DP (predicted, FLOP) | sent D/DP | state D/DP |")
    print("|---|---|---|---|---|")
    for copies, t, f, b, m in ratios:
        print(f"| {copies} | {t:.2f} | {f:.2f} | {b:.2f} | {m:.2f} |")
    lo_hi = ", ".join(f"{k} {a}-{b}x" for k, (a, b) in PAPER.items())
    print(f"\nthe paper (64 GPUs, DP-KFAC's reductions against D-KFAC): {lo_hi}")


if __name__ == "__main__":
    main()

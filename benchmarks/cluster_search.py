"""How long the cluster planner takes to search every (dp, tp, pp) of a large cluster, every schedule family,
microbatch size, recomputation and sharding: the configurations evaluated, the seconds, and the best.

    python benchmarks/cluster_search.py                       # 128 nodes of 8 H100 (1024 GPUs), Llama 3 70B
    python benchmarks/cluster_search.py --nodes 2 --families 1f1b,zb-v   # small

The target (issue 29): under a minute for 1024 GPUs.
"""

from __future__ import annotations

import argparse
import time

from pipefold.errors import run_script
from pipefold.models.transformer import from_hf_config
from pipefold.plan.cluster import load_cluster
from pipefold.plan.cluster_plan import FAMILIES, Training, plan_cluster


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="h100-sxm")
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args(argv)
    cluster = load_cluster(args.cluster).with_nodes(args.nodes)
    training = Training(model=from_hf_config(args.model), seq=args.seq, global_batch=args.global_batch)
    started = time.perf_counter()
    answer = plan_cluster(cluster, training, families=tuple(args.families.split(",")))
    seconds = time.perf_counter() - started
    fits = sum(p.fits for p in answer.points)
    print(f"{cluster.devices} GPUs, {training.model.name}, batch {args.global_batch} x {args.seq}: "
          f"{answer.evaluated} configurations ({fits} fit) in {seconds:.1f} s")
    if answer.best is not None:
        b = answer.best
        print(f"best: {b.layout} {b.schedule} microbatch {b.microbatch} x {b.microbatches}, {b.recompute} "
              f"recompute, {b.sharding}: {b.step_time:.2f} s a step, MFU {b.mfu:.1%}, {b.memory / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    run_script(main)

"""Published training runs, predicted from their description alone: the cluster planner's tokens per second per GPU
and memory per GPU against the figures their authors published (``benchmarks/published_runs.json``: each run's
model, sequence, batch, layout, recomputation, sharding and published figures, with the source; the clusters they
ran on).

What the publications do not give is calibrated, and said so in the file: for each cluster the scale of its
accelerator's matmul efficiency curve and, where the network is not published, its bandwidth between nodes, fitted
(least squares of the log of predicted over published throughput, on a grid) to the runs marked ``calibrates``
only. Every other run is a prediction. A cluster given as ``{"shipped": name}`` is the file pipefold ships, as it
is: nothing is fitted on its runs.

A run published as teraFLOP/s per GPU (Megatron-LM's papers) is turned into tokens per second with the paper's own
count of operations per token, its Eq. 3: 96 l h^2 (1 + s / 6h + V / 16 l h), which includes the forward that full
recomputation runs again; one published as GPU hours a trillion tokens (DeepSeek-V3's report) is 1e12 tokens over
that many hours' seconds.

A prediction more than ``MISS`` off the published throughput carries a ``miss`` in the file saying why, one more
than ``MEMORY_MISS`` off the published memory a ``memory_miss``; the table lists them under it. A run that used
what pipefold does not cost (Float8 matrix products, compiled graphs: its ``uncosted``) is shown in a table of its
own, outside the targets.

    python benchmarks/published.py               # the table (markdown), predictions recomputed
    python benchmarks/published.py --calibrate   # fit the calibrated figures again and store them with the table
    python benchmarks/published.py --check       # exit 1 if the stored predictions drifted from the code's

Memory is never calibrated.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

from pipefold.errors import ConfigError, run_script
from pipefold.models.transformer import Transformer, from_hf_config
from pipefold.plan.cluster import Cluster, cluster_from_dict, load_cluster
from pipefold.plan.cluster_plan import Training, point

DATA = Path(__file__).resolve().parent / "published_runs.json"
MISS = 0.15
"""How far off the published throughput a prediction may be before the file must say why."""
MEMORY_MISS = 0.10
"""How far off the published memory a prediction may be before the file must say why."""


def cluster_of(data: dict[str, Any], run: dict[str, Any]) -> Cluster:
    entry = data["clusters"][run["source"]]
    cluster = load_cluster(entry["shipped"]) if "shipped" in entry else cluster_from_dict(entry, run["source"])
    return cluster.with_nodes(run["nodes"]) if "nodes" in run else cluster


def megatron_flops_per_token(model: Transformer, seq: int) -> float:
    """Narayanan et al. (2021), Eq. 3 over the tokens of a batch: the operations Megatron-LM's papers count per token,
    with full recomputation."""
    layers, h = model.layers, model.hidden
    return 96.0 * layers * h * h * (1 + seq / (6 * h) + model.vocab / (16 * layers * h))


def published_tokens(run: dict[str, Any]) -> float:
    """The published tokens per second per GPU, or the published teraFLOP/s per GPU turned into them, or the GPU hours
    a trillion tokens took (DeepSeek-V3's report)."""
    pub = run["published"]
    if "tokens_per_second_per_gpu" in pub:
        return float(pub["tokens_per_second_per_gpu"])
    if "gpu_hours_per_trillion_tokens" in pub:
        return 1e12 / (pub["gpu_hours_per_trillion_tokens"] * 3600)
    return pub["tflops_per_gpu"] * 1e12 / megatron_flops_per_token(from_hf_config(run["model"]), run["seq"])


def training_of(run: dict[str, Any]) -> Training:
    """What a run trains: the model, its sequence, batch and dtype, and (a model with experts) how its tokens are
    routed (``node_limit``, ``moe_imbalance``)."""
    return Training(model=from_hf_config(run["model"]), seq=run["seq"], global_batch=run["global_batch"],
                    dtype=run.get("dtype", "bf16"), sequence_parallel=run.get("sequence_parallel", True),
                    node_limit=run.get("node_limit", 0), moe_imbalance=run.get("moe_imbalance", 1.0))


def predict(data: dict[str, Any], run: dict[str, Any]) -> dict[str, float]:
    """What the planner predicts for one published run."""
    cluster = cluster_of(data, run)
    got = point(cluster, training_of(run), dp=run["dp"], tp=run["tp"], pp=run["pp"], schedule=run["schedule"],
                microbatch=run["microbatch"], recompute=run["recompute"], sharding=run["sharding"],
                cp=run.get("cp", 1), ep=run.get("ep", 1))
    return {"tokens_per_second_per_gpu": round(got.tokens_per_second / cluster.devices, 1), "mfu": round(got.mfu, 4),
            "memory_gib": round(got.memory / 2**30, 2)}


def workloads(data: dict[str, Any]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """The published runs grouped by what they train on what: cluster and nodes, model, sequence, batch, dtype,
    whether tensor-parallel ranks could split the tokens (Megatron-LM's 2021 runs could not) and how tokens are
    routed to experts."""
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in data["runs"]:
        key = (run["source"], run.get("nodes"), run["model"], run["seq"], run["global_batch"],
               run.get("dtype", "bf16"), run.get("sequence_parallel", True), run.get("node_limit", 0),
               run.get("moe_imbalance", 1.0))
        out.setdefault(key, []).append(run)
    return out


def search(data: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the planner picks for the runs' workload when free to choose its layout, schedule, microbatch size,
    recomputation and sharding: its best, beside the authors' fastest published run."""
    from pipefold.plan.cluster_plan import plan_cluster

    run = runs[0]
    cluster = cluster_of(data, run)
    training = training_of(run)
    authors = max(runs, key=published_tokens)
    out: dict[str, Any] = {"workload": f"{run['model']}, {cluster.devices} GPUs ({run['source']}), "
                                       f"{run['global_batch']} x {run['seq']} tokens",
                           "authors": authors["what"]}
    try:
        plan = plan_cluster(cluster, training)
    except ConfigError as why:
        return out | {"best": None, "why": str(why)}
    best = plan.best
    if best is None:
        return out | {"best": None, "why": "nothing fits"}
    return out | {"best": {"layout": best.layout, "schedule": best.schedule,
                           "microbatches": f"{best.microbatch} x {best.microbatches}", "recompute": best.recompute,
                           "sharding": best.sharding,
                           "tokens_per_second_per_gpu": round(best.tokens_per_second / cluster.devices, 1),
                           "memory_gib": round(best.memory / 2**30, 2)},
                  "evaluated": plan.evaluated}


def searches_table(data: dict[str, Any]) -> str:
    """The search's picks beside the authors' fastest runs (stored by ``--search``)."""
    runs = {run["what"]: run for run in data["runs"]}
    lines = ["| workload | the authors' fastest | published | predicted | the search's pick | predicted |",
             "|---|---|---:|---:|---|---:|"]
    for got in data.get("searches", []):
        run = runs[got["authors"]]
        best = got["best"]
        pick = (f"{best['layout']}, {best['schedule']}, {best['microbatches']}, {best['recompute']} recompute, "
                f"{best['sharding']}, {best['memory_gib']:.1f} GiB" if best else got["why"])
        mine = _tokens(best["tokens_per_second_per_gpu"]) if best else "-"
        lines.append(f"| {got['workload']} | {got['authors']} | {_tokens(published_tokens(run))} | "
                     f"{_tokens(run['predicted']['tokens_per_second_per_gpu'])} | {pick} | {mine} |")
    return "\n".join(lines)


def _scaled(cluster: dict[str, Any], scale: float, bandwidth: float | None) -> dict[str, Any]:
    out = copy.deepcopy(cluster)
    curve = out["accelerator"]["matmul_efficiency"]
    out["accelerator"]["matmul_efficiency"] = [[x, min(1.0, round(y * scale, 4))] for x, y in curve]
    if bandwidth is not None:
        out["inter_node"]["bandwidth"] = bandwidth
    return out


def calibrate(data: dict[str, Any]) -> None:
    """Fit each cluster's calibrated figures to its runs marked ``calibrates`` (in place)."""
    for name, cluster in data["clusters"].items():
        runs = [r for r in data["runs"] if r["source"] == name and r["calibrates"]]
        if not runs:  # a shipped file as it is, or figures all published
            continue
        network = "calibrated" in cluster["sources"].get("inter_node", "")
        bandwidths: list[float | None] = [b * 1e9 for b in range(10, 101, 5)] if network else [None]
        best: tuple[float, float, float | None] | None = None
        for scale in [s / 100 for s in range(50, 121)]:
            for bw in bandwidths:
                trial = {**data, "clusters": {**data["clusters"], name: _scaled(cluster, scale, bw)}}
                err = sum(math.log(predict(trial, r)["tokens_per_second_per_gpu"] / published_tokens(r)) ** 2
                          for r in runs)
                if best is None or err < best[0]:
                    best = (err, scale, bw)
        assert best is not None
        data["clusters"][name] = _scaled(cluster, best[1], best[2])
        shown = f", inter-node {best[2] / 1e9:.0f} GB/s" if best[2] is not None else ""
        print(f"{name}: efficiency x{best[1]:.2f}{shown} (from {len(runs)} runs)", file=sys.stderr)


def _tokens(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def table(data: dict[str, Any]) -> str:
    """The markdown tables of the runs, under each why each miss is one: first the runs that used only what
    pipefold costs, then those that used more (``uncosted``), which the targets do not cover."""
    costed = [run for run in data["runs"] if "uncosted" not in run]
    more = [run for run in data["runs"] if "uncosted" in run]
    out = _rows(costed)
    if more:
        used = list(dict.fromkeys(part for r in more for part in r["uncosted"].split(", ")))
        out += "\n\nRuns with what pipefold does not cost (" + ", ".join(used) + "):\n\n" + _rows(more)
    return out


def _rows(runs: list[dict[str, Any]]) -> str:
    lines = ["| run | source | tokens/s/GPU published | predicted | ratio | memory published | predicted | ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    misses = []
    for run in runs:
        pub, got = run["published"], run["predicted"]
        published = published_tokens(run)
        tps = got["tokens_per_second_per_gpu"] / published
        ratio = None
        if "memory_gib" in pub:
            ratio = got["memory_gib"] / pub["memory_gib"]
            mem = f"{pub['memory_gib']:.1f} GiB | {got['memory_gib']:.1f} GiB | {ratio:.2f}"
        else:
            mem = f"- | {got['memory_gib']:.1f} GiB | -"
        mark = " (calibrates)" if run["calibrates"] else ""
        shown = _tokens(published) + (f" ({pub['tflops_per_gpu']} TFLOP/s)" if "tflops_per_gpu" in pub else "")
        if "gpu_hours_per_trillion_tokens" in pub:
            shown += f" ({pub['gpu_hours_per_trillion_tokens'] / 1e3:,.0f}K GPU hours a trillion tokens)"
        lines.append(f"| {run['what']}{mark} | {run['source']} | {shown} | "
                     f"{_tokens(got['tokens_per_second_per_gpu'])} | {tps:.2f} | {mem} |")
        if "miss" in run:
            misses.append(f"- {run['what']} ({tps:.2f}): {run['miss']}")
        if "memory_miss" in run:
            misses.append(f"- {run['what']}, memory ({ratio:.2f}): {run['memory_miss']}")
    return "\n".join(lines + ([""] + misses if misses else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrate", action="store_true", help="fit the calibrated figures again and store them")
    ap.add_argument("--check", action="store_true", help="exit 1 if the stored predictions drifted")
    ap.add_argument("--search", action="store_true",
                    help="search each workload free to choose (minutes), store the picks and print them")
    args = ap.parse_args(argv)
    data = json.loads(DATA.read_text())
    if args.search:
        data["searches"] = []
        for runs in workloads(data).values():
            data["searches"].append(search(data, runs))
            print(f"searched {data['searches'][-1]['workload']}", file=sys.stderr, flush=True)
        DATA.write_text(json.dumps(data, indent=1) + "\n")
        print(searches_table(data))
        return 0
    if args.calibrate:
        calibrate(data)
    drift = []
    for run in data["runs"]:
        got = predict(data, run)
        if run.get("predicted") != got:
            drift.append(f"{run['what']}: stored {run.get('predicted')}, now {got}")
        run["predicted"] = got
    if args.check:
        for line in drift:
            print(f"drifted: {line}", file=sys.stderr)
        if not drift:
            print(f"{len(data['runs'])} published runs: the stored predictions are the code's")
        return 1 if drift else 0
    if args.calibrate or drift:
        DATA.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    return 0


if __name__ == "__main__":
    run_script(main)

"""``pipefold plan --cluster``: the best configurations of a model on a cluster described in a file."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from pipefold import jsonout
from pipefold.cli.common import check_outputs, progress_bar, styled
from pipefold.errors import ConfigError
from pipefold.units import format_bytes


def plan_cluster_command(args: argparse.Namespace, console: Console) -> None:
    from pipefold.models.transformer import from_hf_config
    from pipefold.plan.cluster import load_cluster
    from pipefold.plan.cluster_plan import FAMILIES, MOE_FAMILIES, Training, plan_cluster

    missing = [flag for flag, value in (("--hf-config", args.cluster_model), ("--global-batch", args.global_batch),
                                        ("--seq", args.seq)) if value is None]
    if missing:
        raise ConfigError(f"plan --cluster needs {', '.join(missing)}: the model, the sequences per step and the "
                          "tokens per sequence, e.g. --hf-config llama3-8b --global-batch 512 --seq 8192")
    cluster = load_cluster(args.cluster)
    if args.nodes is not None:
        cluster = cluster.with_nodes(args.nodes)
    training = Training(model=from_hf_config(args.cluster_model), seq=args.seq, global_batch=args.global_batch,
                        sequence_parallel=not args.no_sequence_parallel, context_parallel=args.cp,
                        seq_chunks=args.seq_chunks or (1,), split_vocab=args.split_vocab, expert_parallel=args.ep,
                        moe_imbalance=args.moe_imbalance, node_limit=args.node_limit)
    families = tuple(args.families.split(",")) if args.families else None
    from pipefold import schedules

    unknown = [f for f in families or () if f not in schedules.REGISTRY]
    if unknown:
        raise ConfigError(f"unknown schedule family {unknown[0]!r}: use some of {', '.join(FAMILIES + MOE_FAMILIES)}")
    with progress_bar(f"planning {cluster.devices} devices") as progress:
        answer = plan_cluster(cluster, training, families=families, progress=progress)
    if answer.best is None:
        usable = cluster.accelerator.memory_bytes * cluster.accelerator.usable_memory
        if not answer.points:
            raise ConfigError(f"no configuration of {training.model.name} fits {cluster.name}'s {format_bytes(usable)} "
                              f"per device: its weights and optimizer state alone do not, in any layout; add --nodes")
        least = min(answer.points, key=lambda p: p.memory)
        raise ConfigError(f"no configuration of {training.model.name} fits {cluster.name}'s {format_bytes(usable)} "
                          f"per device: the least memory is {format_bytes(least.memory)} ({least.layout} "
                          f"{least.schedule}, microbatch {least.microbatch}, {least.recompute} recompute, "
                          f"{least.sharding}); add --nodes, or a smaller --global-batch or --seq")
    best = answer.best
    fastest = sorted((p for p in answer.points if p.fits), key=lambda p: p.step_time)[:args.top]
    out = {"cluster": cluster.name, "devices": cluster.devices, "model": training.model.name,
           "parameters": training.model.parameters(), "global_batch": training.global_batch, "seq": training.seq,
           "evaluated": answer.evaluated, "seconds": round(answer.seconds, 3),
           "best": best.to_dict(),
           "frontier": [p.to_dict() for p in answer.frontier],
           "top": [p.to_dict() for p in fastest]}
    if args.output:
        from pipefold.files import write_json
        from pipefold.plan.cluster_plan import CLUSTER_PLAN_VERSION, run_section

        try:
            run: dict[str, Any] | None = run_section(best, training, args.cluster_model)
        except ConfigError as why:
            run, out["not_runnable"] = None, str(why)
        write_json(args.output, {"kind": "pipefold-cluster-plan", "version": CLUSTER_PLAN_VERSION, **out, "run": run},
                   indent=1)
    if args.plot:
        from pipefold.plan.figures import plot_cluster

        plot_cluster(answer, cluster, training, args.plot)
    if args.json:
        print(jsonout.dumps(out | {"output": args.output, "plot": args.plot}))
        return
    console.print(cluster.describe())
    console.print(training.model.describe())
    table = Table(title=f"the {len(fastest)} fastest of {answer.evaluated} configurations "
                        f"({sum(p.fits for p in answer.points)} fit), evaluated in {answer.seconds:.1f} s")
    for col in ("layout", "schedule", "mb x m", "recompute", "shard", "step", "tok/s/GPU", "MFU", "GiB/GPU"):
        table.add_column(col, justify="left" if col in ("layout", "schedule", "recompute", "shard") else "right",
                         no_wrap=True)
    for p in fastest:
        table.add_row(*_row(p, cluster.devices))
    console.print(table)
    b = best
    exposed = (f", expert all-to-alls exposed {_seconds(b.exchange_exposed)} of it" if training.model.moe else "")
    console.print(styled(("best:", "bold"), f" {b.layout} {b.schedule}, microbatches of {b.microbatch} x "
                         f"{b.microbatches}, {b.recompute} recompute, {b.sharding} sharding: {_seconds(b.step_time)} "
                         f"a step{exposed}, {b.tokens_per_second:,.0f} tokens/s "
                         f"({b.tokens_per_second / cluster.devices:,.0f} per GPU), MFU {b.mfu:.1%}, "
                         f"{format_bytes(b.memory)} per GPU"))
    console.print("frontier (fastest for its memory): " + "; ".join(
        f"{p.layout} {p.schedule} {p.microbatch}x{p.microbatches} {p.recompute}/{p.sharding} {_seconds(p.step_time)} "
        f"{format_bytes(p.memory)}" for p in answer.frontier))
    if args.output:
        console.print(f"wrote {args.output}")
    if args.plot:
        console.print(f"wrote plot: {args.plot}")


def _seconds(t: float) -> str:
    """A step time: seconds, or milliseconds and microseconds for the small models one tries the flow with."""
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} us"


def _row(p: Any, devices: int) -> list[str]:
    return [p.layout, p.schedule, f"{p.microbatch}x{p.microbatches}", p.recompute, p.sharding, _seconds(p.step_time),
            f"{p.tokens_per_second / devices:,.0f}", f"{p.mfu:.1%}", f"{p.memory / 2**30:.1f}"]


def calibrate_command(args: argparse.Namespace, console: Console) -> None:
    """``pipefold calibrate``: this device's matrix products timed, the cluster file with what they achieved."""
    import platform
    import time

    from pipefold.files import write_json
    from pipefold.plan.cluster import cluster_to_dict, load_cluster, measured_efficiency

    check_outputs(("cluster", args.output, False))
    cluster = load_cluster(args.cluster)
    import torch

    from pipefold.runtime.measure.profiling import measure_matmuls

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = args.dtype
    cluster.accelerator.peak(dtype)  # one line now, not after the timing, where the file has no such peak
    with progress_bar("timing matrix products") as bar:
        measured = measure_matmuls(dtype, device, smallest=min(1e8, args.largest), largest=args.largest,
                                   progress=(lambda _part, done, total: bar(done, total)) if bar else None)
    what = (torch.cuda.get_device_name(device) if cuda else
            f"the CPU of {platform.node()} ({torch.get_num_threads()} threads)") + f", torch {torch.__version__}"
    calibrated = measured_efficiency(cluster, measured, dtype, f"{what}, {time.strftime('%Y-%m-%d')}")
    if args.output:
        write_json(args.output, cluster_to_dict(calibrated), indent=2)
    old = cluster.accelerator
    rows = [{"flops": flops, "seconds": seconds, "tflops_per_s": flops / seconds / 1e12,
             "fraction": frac, "file_fraction": old.efficiency(flops)}
            for (flops, seconds), (_, frac) in zip(sorted(measured), calibrated.accelerator.matmul_efficiency,
                                                   strict=True)]
    if args.json:
        print(jsonout.dumps({"device": what, "dtype": dtype, "peak_flops": old.peak(dtype), "products": rows,
                             "output": args.output}))
        return
    table = Table(title=f"{what}, {dtype} products against {old.name}'s peak of {old.peak(dtype) / 1e12:.4g} "
                        "TFLOP/s", title_justify="left")
    for col in ("operations", "time", "TFLOP/s", "fraction measured", "fraction in the file"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['flops']:.3g}", _seconds(r["seconds"]), f"{r['tflops_per_s']:.4g}",
                      f"{r['fraction']:.4g}", f"{r['file_fraction']:.4g}")
    console.print(table)
    if args.output:
        console.print(f"wrote {args.output}: {cluster.name} with this device's matmul efficiency "
                      f"(plan with it: pipefold plan --cluster {args.output} ...)")

"""Commands that measure and plan: profile a model, plan under a memory budget, partition a model's layers."""


from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from pipefold import jsonout, schedules
from pipefold.cli.args import degrees
from pipefold.cli.common import check_outputs, cost_model, num, progress_bar, stage_bar, styled
from pipefold.errors import ConfigError
from pipefold.ir.ref import ScheduleRef
from pipefold.plan.budget import PlanResult, check_evaluate, one_f_one_b_peak, parse_budget, plan
from pipefold.runtime.launch.processes import start_server
from pipefold.sim.simulate import CostModel
from pipefold.units import format_bytes, parse_bytes


def cmd_calibrate(args: argparse.Namespace, console: Console) -> None:
    from pipefold.cli.cluster_cmds import calibrate_command

    calibrate_command(args, console)


def cmd_profile(args: argparse.Namespace, console: Console) -> None:
    check_outputs(("profile", args.output, False))
    tp = _degrees(args.tp)
    if not (args.no_link and args.no_sharing and args.no_overhead):
        start_server()  # for the link's and the sharing's processes: it imports torch while this process does
    from pipefold.train.overhead import profile_here  # torch: once the server is on its way

    with stage_bar("profile") as progress:
        prof = profile_here(model=args.model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                            model_config=args.model_config, seq=args.seq,
                            batch=args.batch, microbatches=args.microbatches, optimizer=args.optimizer,
                            seed=args.seed, devices=args.devices, repeats=args.repeats, link=not args.no_link,
                            contention=not args.no_sharing, overhead=not args.no_overhead, tp=tp,
                            dtype=args.dtype, quick=args.quick, sequence_parallel=args.sequence_parallel,
                            progress=progress)
    if not args.output:
        print(jsonout.dumps(prof.to_dict(), indent=1))
        return
    prof.save(args.output)
    if args.json:
        print(jsonout.dumps({"profile": args.output, "layers": len(prof.layers), "latency_s": prof.latency,
                             "bandwidth_bytes_per_s": prof.bandwidth, "contention": list(prof.contention)}))
        return
    f, b, w, bw = (sum(getattr(x, k) for x in prof.layers) for k in ("f", "b", "w", "fused"))
    console.print(styled((args.output, "bold"), f": {len(prof.layers)} layers of {args.model}, one microbatch of "
                         f"{prof.microbatch_rows}: F {f * 1e3:.2f} ms, B {b * 1e3:.2f} ms, W {w * 1e3:.2f} ms "
                         f"(fused BW {bw * 1e3:.2f} ms) in all; "
                         f"{format_bytes(sum(x.params for x in prof.layers))} of parameters"))
    console.print(f"link: {prof.latency * 1e6:.0f} us + bytes at {prof.bandwidth / 2**30:.2f} GiB/s; ranks computing "
                  f"at once 1..{len(prof.contention)} run each pass x{' x'.join(f'{c:.2f}' for c in prof.contention)}; "
                  f"the runtime's own work {prof.message_overhead * 1e6:.0f} us per message")
    for t, layers in sorted(prof.tp_layers.items()):
        f, b, w = (sum(getattr(x, k) for x in layers) for k in ("f", "b", "w"))
        console.print(f"split over {t} tensor-parallel ranks, on each: F {f * 1e3:.2f} ms, B {b * 1e3:.2f} ms, "
                      f"W {w * 1e3:.2f} ms, {format_bytes(sum(x.params for x in layers))} of parameters")


def _degrees(text: str) -> tuple[int, ...]:
    """``profile --tp 1,2,4``: the tensor-parallel degrees to measure."""
    out = degrees(text)
    if out is None:
        raise ConfigError(f"--tp takes tensor-parallel degrees, whole numbers >= 1 separated by commas, such as 1,2 "
                          f"(got {text!r})")
    return out


def cmd_plan(args: argparse.Namespace, console: Console) -> None:
    check_outputs(("plot", args.plot, True), ("plan", args.output, False))
    if args.cluster is not None:
        from pipefold.cli.cluster_cmds import plan_cluster_command

        plan_cluster_command(args, console)
        return
    if args.profile is not None:
        _plan_profiled(args, console)
        return
    if args.memory is None:
        raise ConfigError("plan needs --memory BUDGET (in M, or 0.5x of 1F1B's peak), or --profile FILE with "
                          "--memory-budget BYTES for a measured model")
    cost = cost_model(args)
    check_evaluate(args.devices, args.microbatches)  # before 1F1B's peak, the budget's unit: one line, no work
    budget = parse_budget(args.memory, one_f_one_b_peak(args.devices, args.microbatches, cost))
    if args.allow_offload:
        _plan_offloading(args, budget, cost, console)
        return
    with progress_bar(f"planning p={args.devices} m={args.microbatches}") as progress:
        answer = plan(args.devices, args.microbatches, budget, cost, progress=progress)
    title = (f"p={args.devices} m={args.microbatches}, budget {num(budget)} M: {answer.spec}, "
             f"makespan {num(answer.best.makespan)}, peak {num(answer.best.memory)} M")
    if args.plot:
        from pipefold.plan.figures import plot_frontier

        plot_frontier(answer.points, answer.frontier, budget, answer.best, args.plot, title=title)
    if args.json:
        out = _plan_dict(answer, args, cost)
        if args.plot:
            out["plot"] = args.plot
        print(jsonout.dumps(out))
        return
    _print_plan(answer, args, console)
    if args.plot:
        console.print(f"wrote plot: {args.plot}")


def _plan_offloading(args: argparse.Namespace, budget: float, cost: CostModel, console: Console) -> None:
    """plan --memory B --allow-offload: every family made to fit with as few offloads as it needs, fastest first."""
    from pipefold.plan.activation_offload import plan_offload

    if args.plot:
        raise ConfigError("--plot draws the frontier of the plain plan: drop it with --allow-offload")
    with progress_bar(f"planning p={args.devices} m={args.microbatches} with offloading") as progress:
        points = plan_offload(args.devices, args.microbatches, budget, cost, progress=progress)
    if not points or not points[0].fits:
        raise ConfigError(f"no schedule fits {num(budget)} M on p={args.devices} m={args.microbatches} even with "
                          "every activation offloaded" + (f": {_least(points)}" if points else ""))

    def row(pt: Any) -> dict[str, Any]:
        got = pt.choice.result if pt.choice is not None else pt.plain
        return {"schedule": pt.spec, "fits": pt.fits, "makespan": round(got.makespan, 9),
                "plain_makespan": round(pt.plain.makespan, 9), "peak_memory": [round(x, 9) for x in got.peak_memory],
                "plain_peak_memory": [round(x, 9) for x in pt.plain.peak_memory],
                "offloaded": len(pt.choice.pairs) if pt.choice is not None else 0,
                "offloadable": pt.choice.offloadable if pt.choice is not None else None,
                **({"refused": pt.refused} if pt.refused else {})}

    if args.json:
        print(jsonout.dumps({"devices": args.devices, "microbatches": args.microbatches, "budget": budget,
                             "cost": cost.to_dict(), "best": row(points[0]), "schedules": [row(pt) for pt in points]}))
        return
    best = points[0]
    got = best.choice.result if best.choice is not None else best.plain
    moved = f"offloading {len(best.choice.pairs)} of {best.choice.offloadable}" if best.choice else "no offloading"
    console.print(styled((best.spec, "bold"), f"  with {moved}: makespan ", (num(got.makespan), "bold"),
                         f"  peak memory {' '.join(num(x) for x in got.peak_memory)} M  (budget {num(budget)} M)"))
    table = Table(title=f"p={args.devices} m={args.microbatches}, budget {num(budget)} M, copies of "
                        f"{num(cost.offload)} each way", title_justify="left")
    table.add_column("", no_wrap=True)
    for col in ("makespan", "plain makespan", "offloaded", "max peak (M)", "plain max peak (M)"):
        table.add_column(col, justify="right")
    table.add_column("schedule", no_wrap=True)
    fitting = [pt for pt in points if pt.fits]
    for pt in fitting[:_SHOWN]:
        r = row(pt)
        table.add_row("▶" if pt is best else "", num(r["makespan"]), num(r["plain_makespan"]),
                      f"{r['offloaded']}/{r['offloadable']}" if r["offloadable"] else "0",
                      num(max(r["peak_memory"])), num(max(r["plain_peak_memory"])), pt.spec,
                      style="bold" if pt is best else "")
    console.print(table)
    more = f"; {len(fitting) - _SHOWN} slower ones fit too" if len(fitting) > _SHOWN else ""
    console.print(f"▶ chosen{more}; {len(points) - len(fitting)} of {len(points)} schedules cannot fit even with "
                  "every activation offloaded (--json lists them all)")


_SHOWN = 12
"""Rows of the offloading plan's table: the fastest schedules that fit."""


def _least(points: list[Any]) -> str:
    """The smallest peak any family reaches with every activation offloaded."""
    reach = [(pt.least, pt.spec) for pt in points if pt.least is not None]
    if not reach:
        return ""
    peak, spec = min(reach)
    return f"the smallest peak is {num(peak)} M ({spec})"


def _plan_profiled(args: argparse.Namespace, console: Console) -> None:
    from pipefold.files import write_json
    from pipefold.plan.budget import HEADROOM, every_layout, plan_model
    from pipefold.plan.profile import Profile

    if args.memory_budget is None:
        raise ConfigError("plan --profile needs --memory-budget BYTES: what each device may hold, e.g. 2GiB")
    profile = Profile.load(args.profile)
    budget = parse_bytes(args.memory_budget)
    layouts = None
    ranks = args.devices
    if args.world is not None:
        families = args.families.split(",") if args.families else None
        layouts, ranks = every_layout(profile, args.world, families), args.world
    with progress_bar(f"planning {'world' if layouts else 'p'}={ranks}") as progress:
        # -m, given, must be the profile's own (plan_model says so in one line otherwise).
        m = args.microbatches if "microbatches" in args.given else None
        answer = plan_model(profile, ranks, budget, microbatches=m, progress=progress, layouts=layouts,
                            families=args.families.split(",") if args.families else None,
                            headroom=HEADROOM if args.headroom is None else args.headroom,
                            chunks=args.state_chunks)
    out = answer.to_dict()
    if args.output:
        write_json(args.output, out, indent=1)
    if args.plot:
        from pipefold.plan.figures import plot_frontier

        plot_frontier(answer.points, answer.frontier, budget, answer.best, args.plot, unit="bytes",
                      title=f"{answer.best.spec}: {answer.best.makespan * 1e3:.1f} ms per step, peak "
                            f"{format_bytes(answer.best.memory)} (budget {format_bytes(budget)})")
    if args.json:
        shown = {k: v for k, v in out.items() if k != "profile"}
        print(jsonout.dumps(shown | {"output": args.output, "plot": args.plot}))
        return
    b = answer.best
    where = f"{b.layout}  " if layouts else ""
    console.print(styled((f"{where}{b.spec}", "bold"), "  step ", (f"{b.makespan * 1e3:.1f} ms", "bold"),
                         f" predicted  bubble ratio {b.bubble_ratio:.1%}  (budget {format_bytes(budget)} per device)"))
    console.print(f"stages' layers: {' | '.join(f'{p[0]}-{p[-1]}' for p in b.layer_stages)} (split by {b.split}); "
                  f"recomputed layers per stage: {' '.join(map(str, b.recompute))}")
    console.print("peak per device: " + "  ".join(f"{format_bytes(x)}" for x in b.peak_memory)
                  + "  (of which weights, gradients, optimizer state: "
                  + " ".join(format_bytes(x) for x in b.static_bytes) + ")")
    if b.layout.chunks:
        console.print("the optimizer state in chunks: on the device what the step leaves room for in the budget less "
                      f"its headroom ({format_bytes(answer.room)}), the rest in host memory (train --plan runs them)")
    table = Table(title=f"memory/time frontier ({len(answer.points)} plans evaluated)", title_justify="left")
    table.add_column("", no_wrap=True)
    columns = ("peak per device", "step (ms)", "bubble", *(("layout",) if layouts else ()), "schedule", "split",
               "recomputed")
    for col in columns:
        table.add_column(col, justify="right" if col in ("peak per device", "step (ms)", "bubble") else "left",
                         no_wrap=col == "layout")
    for pt in answer.frontier:
        chosen = pt == b
        style = "bold" if chosen else "dim" if pt.memory > answer.room else ""
        table.add_row("▶" if chosen else "", format_bytes(pt.memory), f"{pt.makespan * 1e3:.1f}",
                      f"{pt.bubble_ratio:.1%}", *((str(pt.layout),) if layouts else ()), pt.spec, pt.split,
                      str(sum(pt.recompute)), style=style)
    console.print(table)
    if args.output:
        console.print(f"wrote plan: {args.output}  (run it: pipefold train --plan {args.output})")
    if args.plot:
        console.print(f"wrote plot: {args.plot}")


def _plan_dict(answer: PlanResult, args: argparse.Namespace, cost: CostModel) -> dict[str, object]:
    r = answer.result
    return {
        "schedule": answer.spec, "name": answer.name, "options": answer.options,
        "devices": args.devices, "microbatches": args.microbatches,
        "makespan": round(r.makespan, 9), "bubble_ratio": round(r.bubble_ratio, 9),
        "peak_memory": [round(x, 9) for x in r.peak_memory], "budget": round(answer.budget, 9),
        "evaluated": len(answer.points), "skipped": list(answer.skipped),
        "frontier": [{"schedule": pt.spec, "name": pt.name, "options": pt.options, "memory": pt.memory,
                      "makespan": pt.makespan, "bubble_ratio": pt.bubble_ratio, "peak_memory": list(pt.peak_memory),
                      "chosen": pt == answer.best} for pt in answer.frontier],
        "cost": cost.to_dict(),
    }


def _print_plan(answer: PlanResult, args: argparse.Namespace, console: Console) -> None:
    r = answer.result
    console.print(styled((answer.spec, "bold"), "  makespan ", (num(r.makespan), "bold"),
                         f"  bubble ratio {r.bubble_ratio:.1%}  peak memory {' '.join(num(x) for x in r.peak_memory)} "
                         f"M  (budget {num(answer.budget)} M)"))
    skipped = f", {len(answer.skipped)} could not run this shape" if answer.skipped else ""
    table = Table(title=f"memory/makespan frontier, p={args.devices} m={args.microbatches} "
                        f"({len(answer.points)} schedules evaluated{skipped})", title_justify="left")
    table.add_column("", no_wrap=True)
    for col in ("peak memory (M)", "makespan", "bubble"):
        table.add_column(col, justify="right")
    table.add_column("schedule", no_wrap=True)
    for pt in answer.frontier:
        chosen = pt == answer.best
        style = "bold" if chosen else "dim" if pt.memory > answer.budget + 1e-9 else ""
        table.add_row("▶" if chosen else "", num(pt.memory), num(pt.makespan), f"{pt.bubble_ratio:.1%}", pt.spec,
                      style=style)
    console.print(table)
    console.print("▶ chosen; dim rows exceed the budget")


def cmd_partition(args: argparse.Namespace, console: Console) -> None:
    from pipefold.models import make_model
    from pipefold.models.size import check_model
    from pipefold.plan.partition import MemoryPartition, memory_of_split, partition, split_by
    from pipefold.plan.recompute import OPTIMIZER_STATE
    from pipefold.runtime.measure.profiling import layers_per_rank, split_figures

    if args.schedule is not None:
        ref = ScheduleRef.parse(args.schedule)
        name, options = ref.name, ref.kwargs
    elif args.chunks is not None and args.chunks > 1:
        name, options = "interleaved-1f1b", {"v": args.chunks}
    else:
        name, options = "1f1b", {}
    least = schedules.get(name).min_microbatches(args.devices)
    m = args.microbatches if args.microbatches is not None else max(least, 2 * args.devices)
    schedule = schedules.build(name, args.devices, m, **options)
    model = make_model(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch,
                       seq=args.seq, config=args.model_config)
    check_model(model, what=f"measuring {args.model}'s layers")
    layers, (sample, target) = model.build(), model.batch_at(0)  # one microbatch of --batch rows
    figures = split_figures(layers, sample, by="all", loss_fn=model.loss, target=target,
                            optimizer_factor=OPTIMIZER_STATE[args.optimizer],
                            stage_layers=layers_per_rank(len(layers), args.devices))
    params, times, held, held_w, static = (figures.params, figures.times, figures.held, figures.held_w,
                                           figures.static)
    assert times is not None and held is not None and held_w is not None and static is not None
    split = split_by(figures, schedule, args.by, slack=args.slack)
    assert isinstance(split, MemoryPartition)
    compared = {}
    if args.by == "memory":
        by_time = memory_of_split(partition(times, schedule.stages, placement=schedule.placement[0]).boundaries,
                                  times, held, held_w, static, schedule, time_optimal=split.time_optimal)
        compared = {"time_split": {"boundaries": by_time.boundaries, "device_peak_bytes": by_time.device_peak_bytes}}
    sums = {key: [sum(values[i] for i in part) for part in split.parts] for key, values in
            (("params", params), ("time_s", times), ("held_bytes", held), ("held_w_bytes", held_w),
             ("static_bytes", static))}
    if args.by == "memory":  # a stage's share of its device's peak: its static bytes and what it holds then
        cost = [sums["static_bytes"][s] + split.weights[s] * sums["held_bytes"][s]
                + split.weights_w[s] * sums["held_w_bytes"][s] for s in range(schedule.stages)]
        device_cost = split.device_peak_bytes
    else:  # the balanced figure, summed per stage and per device
        cost = sums["params" if args.by == "params" else "time_s"]
        device_cost = [sum(c for c, d in zip(cost, schedule.placement[0], strict=True) if d == device)
                       for device in range(schedule.devices)]
    devices = list(schedule.placement[0])
    if args.json:
        print(jsonout.dumps({"model": args.model, "layers": len(layers), "by": args.by,
                             "schedule": str(ScheduleRef.of(schedule)), "microbatches": m, "stages": schedule.stages,
                             "placement": devices,
                             "boundaries": split.boundaries, "parts": split.parts, "cost": cost,
                             "device_cost": device_cost, "bottleneck": max(device_cost), **sums,
                             "device_time_s": split.device_time, "device_static_bytes": split.device_static_bytes,
                             "device_activation_bytes": split.device_activation_bytes,
                             "device_peak_bytes": split.device_peak_bytes, "time_optimal_s": split.time_optimal,
                             "weights": split.weights, "weights_w": split.weights_w, **compared}))
        return

    def span(part: list[int]) -> str:
        return f"{part[0]}-{part[-1]}" if len(part) > 1 else str(part[0])

    title = (f"{args.model} ({len(layers)} layers) split by {args.by}, under {ScheduleRef.of(schedule)} "
             f"with {m} microbatches")
    table = Table(title=title, title_justify="left")
    for col in ("stage", "device", "layers", "params", "est. time", "act. / mb", "static"):
        table.add_column(col, justify="right")
    for s, part in enumerate(split.parts):
        table.add_row(str(s), str(devices[s]), span(part), f"{int(sums['params'][s]):,}",
                      f"{sums['time_s'][s] * 1e3:.2f} ms", format_bytes(sums["held_bytes"][s]),
                      format_bytes(sums["static_bytes"][s]))
    console.print(table)
    table = Table(title="predicted per device", title_justify="left")
    for col in ("device", "layers", "est. time", "static", "peak act.", "peak total"):
        table.add_column(col, justify="right")
    for d in range(schedule.devices):
        table.add_row(str(d), ", ".join(span(split.parts[s]) for s in schedule.stages_of(d)),
                      f"{split.device_time[d] * 1e3:.2f} ms", format_bytes(split.device_static_bytes[d]),
                      format_bytes(split.device_activation_bytes[d]), format_bytes(split.device_peak_bytes[d]))
    console.print(table)
    if args.by == "memory":
        over = split.bottleneck_time / split.time_optimal - 1 if split.time_optimal else 0.0
        console.print(f"largest predicted peak: {format_bytes(split.peak_bytes)}; busiest device time "
                      f"{num(split.bottleneck_time)} s, {over:+.1%} on the time-optimal split's; "
                      f"boundaries {split.boundaries}")
        console.print(f"the time-balanced split {by_time.boundaries} would peak at {format_bytes(by_time.peak_bytes)}")
        return
    unit = {"params": "params", "time": "s"}[args.by]
    console.print(f"bottleneck (largest device {args.by}): {num(max(device_cost))} {unit}; largest predicted "
                  f"peak {format_bytes(split.peak_bytes)}; boundaries {split.boundaries}")

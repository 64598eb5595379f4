"""Commands on schedules as data: list, simulate, compare, generate, validate, and K-FAC's work in the bubbles."""


from __future__ import annotations

import argparse
import dataclasses
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pipefold import jsonout, schedules
from pipefold.cli.common import (
    check_costs_used,
    check_outputs,
    cost_model,
    load_schedule,
    make_console,
    num,
    offloading,
    styled,
)
from pipefold.ir import formats
from pipefold.ir.ref import ScheduleRef
from pipefold.schedules.offload import offloaded_pairs
from pipefold.sim.simulate import SimResult, simulate


def cmd_schedules(args: argparse.Namespace, console: Console) -> None:
    if args.json:
        rows = [{"name": s.name, "description": s.description, "peak_memory": s.memory,
                 "options": [{"name": o.name, "default": o.default, "help": o.help} for o in s.options]}
                for s in schedules.REGISTRY.values()]
        print(jsonout.dumps(rows))
        return
    table = Table(title="pipefold schedules", title_justify="left", show_lines=True)
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("what it is; options; peak activation memory per device (M)")
    for s in schedules.REGISTRY.values():
        opts = " ".join(f"--{o.name} {o.default}" for o in s.options) or "none"
        table.add_row(s.name, Text.assemble(f"{s.description}\n", ("options:", "dim"), f" {opts}   ", ("peak:", "dim"),
                                            f" {s.memory}"))
    console.print(table)
    for name in sorted({o.name for s in schedules.REGISTRY.values() for o in s.options}):
        spec = next(o for s in schedules.REGISTRY.values() for o in s.options if o.name == name)
        console.print(f"  --{name}: {spec.help}")
    console.print("p: devices, m: microbatches, i: device index. Costs: see 'pipefold simulate --help'.")


def cmd_simulate(args: argparse.Namespace, console: Console) -> None:
    if args.width:
        console = make_console(width=args.width, soft_wrap=True)
    check_outputs(("plot", args.plot, True), ("trace", args.trace, False))
    cost = cost_model(args)
    schedule = load_schedule(args.schedule, args, strict_flags=True)
    check_costs_used(args, [schedule])
    schedule, offloaded = offloading(args, schedule, cost)
    network = None
    if args.network is not None:
        from pipefold.sim.network import parse_network

        network = parse_network(args.network)
        network.check_devices(schedule.devices)
    if args.dp != 1:
        from pipefold.schedules.dataparallel import with_data_parallel

        cost = dataclasses.replace(cost, dp=args.dp, gathered=args.gathered)
        schedule = with_data_parallel(schedule, shard=args.fsdp)
    result = simulate(schedule, cost, network=network, at=args.at)
    written = []
    if args.plot:
        from pipefold.sim.render import plot_timeline

        plot_timeline(result, args.plot)
        written.append(("plot", args.plot))
    if args.trace:
        from pipefold.sim.render import write_chrome_trace

        write_chrome_trace(result, args.trace)
        written.append(("trace", args.trace))
    if args.json:
        out = result.to_dict()
        out.update({k: v for k, v in written})
        print(jsonout.dumps(out))
        return
    _print_result(result, console)
    if offloaded:
        console.print(offloaded)
    for kind, path in written:
        console.print(f"wrote {kind}: {path}")


def _print_result(result: SimResult, console: Console) -> None:
    from pipefold.sim.render import ascii_timeline

    s = result.schedule
    console.print(styled((str(ScheduleRef.of(s)), "bold"), f"  devices={s.devices} stages={s.stages} "
                         f"microbatches={s.data_microbatches}"
                         f"{f' x {s.seq_chunks} sequence chunks' if s.seq_chunks > 1 else ''} "
                         f"placement={s.placement_name}"))
    table = Table(show_edge=False)
    exchanges = any(result.exchange_exposed)
    for col in ("device", "stages", "busy", "idle", "peak memory (M)", *(["exposed exchange"] if exchanges else [])):
        table.add_column(col, justify="right")
    for d in range(s.devices):
        table.add_row(str(d), " ".join(map(str, s.stages_of(d))), num(result.busy[d]), num(result.idle[d]),
                      num(result.peak_memory[d]), *([num(result.exchange_exposed[d])] if exchanges else []))
    console.print(table)
    console.print(styled("makespan ", (num(result.makespan), "bold"), "   bubble ratio ",
                         (f"{result.bubble_ratio:.1%}", "bold"), "   max peak memory ",
                         (num(max(result.peak_memory)), "bold"), " M"))
    console.print(ascii_timeline(result, width=console.width, color=console.is_terminal))


def cmd_pipefisher(args: argparse.Namespace, console: Console) -> None:
    from pipefold.plan import pipefisher

    if args.width:
        console = make_console(width=args.width, soft_wrap=True)
    check_outputs(("plot", args.plot, True))
    cost = cost_model(args)
    schedule = load_schedule(args.schedule, args, strict_flags=True)
    check_costs_used(args, [schedule])
    filled = (pipefisher.inline(schedule, cost) if args.inline
              else pipefisher.fill(schedule, cost, slack=args.slack, max_steps=args.max_steps))
    if args.plot:
        from pipefold.sim.render import plot_cycle

        plot_cycle(filled.base, filled.steps, args.plot,
                   title=f"{ScheduleRef.of(schedule)}: K-FAC's work {'inline' if args.inline else 'in the bubbles'}")
    if args.json:
        print(jsonout.dumps({**filled.to_dict(), **({"plot": args.plot} if args.plot else {})}))
        return
    from pipefold.sim.render import ascii_timeline

    base = filled.base
    console.print(styled((str(ScheduleRef.of(schedule)), "bold"),
                         f" with K-FAC {'inline' if args.inline else 'in the bubbles'}: a cycle of "
                         f"{len(filled.steps)} step(s); factors inverted {'/'.join(map(str, filled.refreshes))} "
                         "time(s) per cycle, by stage"))
    table = Table(show_edge=False)
    for col in ("", "step time", "utilization", "max peak memory (M)"):
        table.add_column(col, justify="right")
    table.add_row("plain", num(base.makespan), f"{pipefisher.utilization(base):.1%}", num(max(base.peak_memory)))
    for i, r in enumerate(filled.steps):
        table.add_row(f"step {i + 1}", num(r.makespan), f"{pipefisher.utilization(r):.1%}", num(max(r.peak_memory)))
    table.add_row("cycle", num(filled.step_time), f"{filled.utilization:.1%}", "")
    console.print(table)
    for i, r in enumerate(filled.steps):
        console.print(f"step {i + 1} of the cycle:")
        console.print(ascii_timeline(r, width=console.width, color=console.is_terminal))
    if args.plot:
        console.print(f"wrote plot: {args.plot}")


def cmd_compare(args: argparse.Namespace, console: Console) -> None:
    cost = cost_model(args)
    loaded = [load_schedule(text, args, strict_flags=False) for text in args.schedule]
    check_costs_used(args, loaded)
    loaded = [offloading(args, s, cost)[0] for s in loaded]
    results = [simulate(s, cost) for s in loaded]
    if args.json:
        print(jsonout.dumps({"devices": args.devices, "microbatches": args.microbatches, "cost": cost.to_dict(),
                             "results": [r.to_dict() for r in results]}))
        return
    best = min(r.makespan for r in results)
    table = Table(title=f"p={args.devices} m={args.microbatches}", title_justify="left")
    table.add_column("schedule", no_wrap=True)
    offloads = any(offloaded_pairs(s) for s in loaded)
    for col in ("makespan", "vs best", "bubble", "max peak (M)", "peak per device (M)", *(("offloaded",) * offloads)):
        table.add_column(col, justify="right")
    for r in results:
        moved = len(offloaded_pairs(r.schedule))
        table.add_row(str(ScheduleRef.of(r.schedule)), num(r.makespan), f"{r.makespan / best:.3f}x" if best else "-",
                      f"{r.bubble_ratio:.1%}", num(max(r.peak_memory)), " ".join(num(x) for x in r.peak_memory),
                      *((str(moved),) * offloads))
    console.print(table)


def cmd_generate(args: argparse.Namespace, console: Console) -> None:
    from pipefold.files import check_writable, write_text
    from pipefold.ir import format_of

    if args.output:
        check_writable(args.output, "schedule")
    schedule = load_schedule(args.schedule, args, strict_flags=True)
    fmt = args.format or (format_of(args.output) if args.output else "text")
    text = formats.dumps(schedule, fmt)
    if args.output:
        write_text(args.output, text)
        console.print(f"wrote {fmt} schedule: {args.output}")
    else:
        sys.stdout.write(text)


def cmd_validate(args: argparse.Namespace, console: Console) -> None:
    from pipefold.ir import validate

    for text in args.schedule:
        schedule = load_schedule(text, args, strict_flags=False)
        validate(schedule)
        console.print(f"{text}: ok ({schedule.devices} devices, {schedule.stages} stages, "
                      f"{schedule.microbatches} microbatches, {schedule.num_actions} actions)")

"""Commands that train: train (a schedule, a plan file or --schedule auto) and offload, with their summaries."""


from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from pipefold import jsonout, schedules
from pipefold.cli.args import build_parser
from pipefold.cli.common import check_outputs, load_schedule, looks_like_file, progress_bar, stage_bar
from pipefold.errors import ConfigError
from pipefold.ir import Schedule
from pipefold.ir.ref import ScheduleRef
from pipefold.sim.simulate import CostModel, simulate
from pipefold.units import format_bytes, parse_bytes

_PLAN_FIXES = ("schedule", "devices", "microbatches", "model", "hf_config", "layers", "hidden", "heads", "batch",
               "seq", "optimizer", "partition", "recompute", "memory_budget", "offload")
"""Train flags a plan decides: given with --plan (or --schedule auto, for the schedule's own), they are refused."""


def _planned_run(args: argparse.Namespace, console: Console) -> tuple[Any, Any, dict[str, Any]]:
    """(config, decisions, plan) for --plan FILE, or for --schedule auto: profile here, plan, run the plan."""
    from pipefold.plan.budget import read_plan
    from pipefold.train.run import from_plan

    defaults = build_parser().parse_args(["train"])
    run = {"steps": args.steps, "lr": args.lr, "clip": args.clip, "data": args.data, **_reliability(args),
           "action_timeout": args.action_timeout}
    if args.plan is not None:
        given = [k for k in _PLAN_FIXES if getattr(args, k) != getattr(defaults, k)]
        if given:
            raise ConfigError(f"--plan fixes the model, schedule, split and memory; drop --{given[0].replace('_', '-')}"
                              f" (or plan again with pipefold plan --profile)")
        plan = read_plan(args.plan)
        if args.seed != defaults.seed:
            run["seed"] = args.seed
        config, decided = from_plan(plan, **run)
        return config, decided, plan
    from pipefold.plan.budget import plan_model
    from pipefold.runtime.profiling import profile_model

    if args.memory_budget is None:
        raise ConfigError("--schedule auto plans for --memory-budget BYTES per device (e.g. 64MB); give one")
    for key in ("partition", "recompute", "offload"):
        if getattr(args, key) != getattr(defaults, key):
            raise ConfigError(f"--schedule auto chooses the split and recomputation itself; drop --{key}")
    from pipefold.models import REGISTRY

    budget = parse_bytes(args.memory_budget)
    layers = args.layers or REGISTRY[args.model].blocks_for(args.devices)
    with stage_bar("profiling the model") as progress:
        profile = profile_model(model=args.model, layers=layers, hidden=args.hidden, heads=args.heads,
                                model_config=args.hf_config, seq=args.seq,
                                batch=args.batch, microbatches=args.microbatches, optimizer=args.optimizer,
                                seed=args.seed, devices=args.devices, progress=progress)
    with progress_bar(f"planning p={args.devices}") as bar:
        answer = plan_model(profile, args.devices, budget, progress=bar)
    plan = answer.to_dict()
    config, decided = from_plan(plan, **run)
    err = Console(stderr=True)
    err.print(f"auto: {answer.best.spec}, layers per stage {' '.join(str(len(x)) for x in answer.best.layer_stages)},"
              f" recomputed {' '.join(map(str, answer.best.recompute))}: predicted "
              f"{answer.best.makespan * 1e3:.1f} ms per step, peak {format_bytes(answer.best.memory)} "
              f"(budget {format_bytes(budget)})")
    return config, decided, plan


def _reliability(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields of checkpoints, numerics and the devices, from the flags."""
    return {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every,
            "keep_last": args.keep_last,
            "resume": args.resume is not None, "resume_from": args.resume or None, "save_model": args.save_model,
            "post_validate": args.post_validate, "max_bad_steps": args.max_bad_steps, "device": args.device,
            "backend": args.backend, "overlap": not args.no_overlap, "renumber": args.renumber}


def cmd_train(args: argparse.Namespace, console: Console) -> None:
    from pipefold.models import REGISTRY
    from pipefold.runtime.job import under_torchrun
    from pipefold.train.run import TrainConfig, compare, train, train_torchrun

    check_outputs(("plot", args.plot, True), ("trace", args.trace, False))
    for label in ("steps", "batch", "seq", "hidden", "heads", "layers", "max_bad_steps"):
        if getattr(args, label) is not None and getattr(args, label) < 1:
            raise ConfigError(f"--{label.replace('_', '-')} must be at least 1 (got {getattr(args, label)})")
    if args.check and args.resume is not None:
        raise ConfigError("--check compares the first step, from the initial weights, with one process: drop it "
                          "with --resume")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every must be at least 1 (got {args.checkpoint_every})")
    if not (math.isfinite(args.action_timeout) and 0 < args.action_timeout <= 86400):
        raise ConfigError(f"--action-timeout is in seconds: a number > 0 and at most a day, such as 20 or 120 (got "
                          f"{args.action_timeout:g})")
    plan: dict[str, Any] | None = None
    decided = None
    if under_torchrun() and (args.plan is not None or args.schedule == "auto"):
        # Before planning: each worker would profile on its own, for minutes, while the others wait in the store.
        raise ConfigError("--plan and --schedule auto run locally for now: plan with pipefold profile and pipefold "
                          "plan --profile PROFILE --memory-budget BYTES, then give torchrun the plan's schedule and "
                          "flags")
    if args.plan is not None or args.schedule == "auto":
        config, decided, plan = _planned_run(args, console)
    else:
        from pipefold.train.run import ADAPTIVE

        if looks_like_file(args.schedule):  # pipefold's text, JSON or CSV, or torch's CSV: its devices, microbatches
            from pipefold.ir import validate

            probe = load_schedule(args.schedule, args, strict_flags=False)
            validate(probe)
            for dest, theirs in (("devices", probe.devices), ("microbatches", probe.microbatches)):
                if dest in args.given and getattr(args, dest) != theirs:
                    raise ConfigError(f"{args.schedule} runs on {probe.devices} devices with {probe.microbatches} "
                                      f"microbatches: drop --{dest} {getattr(args, dest)}, or give the file's")
            args.devices, args.microbatches = probe.devices, probe.microbatches
            name, options = os.path.abspath(args.schedule), dict[str, int]()
        else:
            ref = ScheduleRef.parse(args.schedule)
            name, options = ref.name, ref.kwargs
            if name == ADAPTIVE:
                if args.microbatches < 1:
                    raise ConfigError(f"--microbatches must be at least 1 (got {args.microbatches})")
                probe = schedules.build("kfkb", args.devices, args.microbatches, k=1)
            else:
                schedules.get(name)
                probe = schedules.build(name, args.devices, args.microbatches, **options)
        offload = _parse_offload(args.offload) if args.offload else None
        layers = args.layers or REGISTRY[args.model].blocks_for(probe.stages)
        config = TrainConfig(schedule=name, options=tuple(options.items()), devices=args.devices,
                             microbatches=args.microbatches, steps=args.steps, model=args.model, layers=layers,
                             hidden=args.hidden, heads=args.heads, model_config=args.hf_config, batch=args.batch,
                             seq=args.seq, lr=args.lr,
                             optimizer=args.optimizer, clip=args.clip, data=args.data, seed=args.seed, offload=offload,
                             partition=args.partition, recompute=args.recompute,
                             memory_budget=None if args.memory_budget is None else parse_bytes(args.memory_budget),
                             network=args.network, netns=args.netns, adapt_every=args.adapt_every,
                             fill_bubbles=args.fill_bubbles, damping=args.damping, ema=args.ema, dp=args.dp,
                             zero1=args.zero1, fsdp=args.fsdp, action_timeout=args.action_timeout,
                             **_reliability(args))
    if args.adapt_every < 1:
        raise ConfigError(f"--adapt-every must be at least 1 (got {args.adapt_every})")
    if (args.network or args.netns) and (args.plan is not None or args.schedule == "auto"):
        raise ConfigError("--network and --netns run a schedule you name: use them without --plan or --schedule "
                          "auto")
    tokens = config.batch * (config.seq if REGISTRY[config.model].sequences else 1)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    with Progress(TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=err, disable=args.json or not err.is_terminal) as bar:
        task = bar.add_task("train", total=config.steps, info="starting ranks")

        def on_step(number: int, loss: float, seconds: float) -> None:
            seconds = max(seconds, 1e-9)
            if err.is_terminal:
                bar.update(task, advance=1, info=f"loss {loss:.4f}  {tokens / seconds:,.0f} tok/s")
            else:  # redirected: one plain line per step, so a log shows the run as it goes
                print(f"step {number}/{config.steps} loss {loss:.4f} ({seconds:.3f} s, "
                      f"{tokens / seconds:,.0f} tok/s)", file=sys.stderr, flush=True)

        if under_torchrun():
            if config.netns:
                raise ConfigError("--netns starts local ranks in namespaces it makes; under torchrun make them with "
                                  "`python -m pipefold.runtime.netns up` and start each rank with `ip netns exec`")
            job, gathered = train_torchrun(config, check=args.check, on_step=on_step)  # rank 0 shows progress
            if gathered is None:
                return  # rank 0 reports for everyone
            reports = gathered
        else:
            job, reports = train(config, check=args.check, on_step=on_step, decided=decided)
    from pipefold.runtime.history import step_number
    from pipefold.runtime.measure import measured_costs, measured_result, measured_summary, per_step

    everyone = reports
    # Per-device figures (tables, predictions, plots) are those of the first pipeline; with data parallelism the
    # others run the same schedule on their shards, and the loss is the mean over every pipeline's microbatches.
    reports = [r for r in reports if r.pipeline == 0]
    step = len(reports[0].steps) - 1  # the last step: warmed up
    last = _ran(job, reports[0].steps[step].schedule, step)
    if plan is not None:
        from pipefold.plan.budget import predict
        from pipefold.plan.profile import Profile

        # The profile's prediction, made before the run, next to what the run measured.
        predicted, peaks, _ = predict(Profile.from_dict(plan["profile"]), job.schedule, job.layer_stages,
                                      job.recompute)
        label = "predicted from the profile"
    else:
        # The simulator fed with this run's own measured costs: what it predicts, next to what was measured.
        costs = measured_costs(last, reports, step)
        if "pipefisher" in job.extra:  # what K-FAC's curvature keeps until it runs: measured before the run
            costs = _with_stash(costs, job.extra["pipefisher"].base.cost)
        at = 0.0
        if job.network is not None and job.origin is not None:
            # The step's own moment of the network, and its messages' size.
            costs = dataclasses.replace(costs, activation_bytes=max(
                (b for r in reports for b in r.steps[step].link_message_bytes.values()), default=0))
            at = min(r.steps[step].started_at for r in reports) - job.origin
        predicted = simulate(last, costs, network=job.network, at=at)
        peaks = None
        label = "simulated from the measured costs"
    cycle_peaks = None
    if job.cycle and plan is None:  # the steps of a cycle differ: each rank's peak is the most over those that ran
        each = [simulate(sched, costs).peak_memory for sched in job.cycle[:len(reports[0].steps)]]
        cycle_peaks = [max(col) for col in zip(*each, strict=True)]
    out = _train_summary(job, reports, config, predicted, cycle_peaks)
    if job.dp > 1:
        out["dp"] = job.dp
        out["sharding"] = "fsdp" if job.fsdp else "zero1" if job.zero1 else "none"
        out["loss"] = [_finite(sum(r.steps.loss_sum[i] for r in everyone)
                               / sum(r.steps.loss_count[i] for r in everyone)) for i in range(len(reports[0].steps))]
    if job.adaptive is not None or config.network is not None:
        out["per_step"] = per_step(reports)
        out["network"] = config.network
        out["netns"] = config.netns
    if job.adaptive is not None:
        first_step = reports[0].first_step
        out["decisions"] = [_decision(step_number(first_step + first), d) for first, d in reports[0].decisions]
    if "pipefisher" in job.extra:
        out["kfac"] = _kfac_summary(job.extra["pipefisher"], reports, config)
    if plan is not None:
        out["plan"] = {"schedule": plan["schedule"], "predicted": {"step_time_s": predicted.makespan,
                                                                   "bubble_ratio": predicted.bubble_ratio,
                                                                   "peak_bytes": peaks},
                       "measured": measured_summary(reports)}
        actions = max(len(row) for row in job.schedule.actions)
        note = prediction_note(predicted.makespan, out["plan"]["measured"]["step_time_s"], actions)
        if note is not None:
            out["plan"]["note"] = note
    if args.check:
        out.update(compare(job, everyone))
    if args.trace:
        from pipefold.runtime.measure import write_measured_trace

        write_measured_trace(reports, args.trace)
        out["trace"] = args.trace
    if args.plot and "per_step" in out:
        from pipefold.sim.network import parse_network
        from pipefold.sim.render import plot_adaptive

        network = parse_network(config.network) if config.network else None
        offset = min(r.steps[0].started_at for r in reports) - job.origin if job.origin is not None else 0.0
        plot_adaptive(out["per_step"], out.get("decisions", []), network, args.plot, offset=offset,
                      title=f"{config.schedule} on {job.schedule.devices} ranks, "
                            f"{'network namespaces' if config.netns else 'emulated links'}: {config.network}")
        out["plot"] = args.plot
    elif args.plot:
        from pipefold.sim.render import plot_run

        measured = measured_result(last, reports, step)
        number = step_number(reports[0].first_step + step)
        plot_run(measured, predicted, args.plot,
                 titles=(f"measured, step {number} ({measured.makespan * 1e3:.1f} ms)",
                         f"{label} ({predicted.makespan * 1e3:.1f} ms)"))
        out["plot"] = args.plot
    if args.json:
        print(jsonout.dumps(out))
        return
    _print_train(out, console)
    if "plan" in out:
        _print_prediction(out["plan"], console)
    if "per_step" in out:
        _print_per_step(out, console)
    if "kfac" in out:
        _print_kfac(out["kfac"], console)


def _with_stash(costs: CostModel, measured: CostModel) -> CostModel:
    """``costs`` with each stage's K-FAC stash as ``measured`` has it."""
    over = {s: dataclasses.replace(o, stash=measured.stage_overrides[s].stash)
            for s, o in costs.stage_overrides.items()}
    return dataclasses.replace(costs, stage_overrides=over)


def _kfac_summary(filled: Any, reports: list[Any], config: Any) -> dict[str, Any]:
    """K-FAC's placement as planned (simulated from the costs measured before the run) next to the run."""
    from pipefold.plan.pipefisher import utilization
    from pipefold.runtime.history import step_number
    from pipefold.runtime.measure import measured_summary

    meas = measured_summary(reports)
    walls = [max(r.steps.wall[i] for r in reports) for i in range(len(reports[0].steps))]
    placed = [(0, filled), *(d for r in reports if r.rank == 0 for d in r.decisions)]
    per_step = []
    for i, w in enumerate(walls):
        first, now = max((p for p in placed if p[0] <= i), key=lambda p: p[0])
        k = (i - first) % len(now.steps)
        per_step.append({"step": step_number(reports[0].first_step + i), "placement": placed.index((first, now)),
                         "cycle_step": k, "predicted_s": now.steps[k].makespan, "measured_s": w})
    last = placed[-1][1]
    return {"fill_bubbles": config.fill_bubbles, "cycle_steps": len(last.steps), "per_step": per_step,
            "placed_again_at": [step_number(reports[0].first_step + p[0]) for p in placed[1:]],
            "refreshes_per_cycle": list(last.refreshes),
            "predicted": {"plain_step_s": last.base.makespan, "plain_utilization": utilization(last.base),
                          "step_s": last.step_time, "utilization": last.utilization},
            "measured": {"step_s": meas["step_time_s"], "step_spread_s": meas["step_time_spread_s"],
                         "utilization": 1.0 - meas["bubble_ratio"]}}


def _print_kfac(k: dict[str, Any], console: Console) -> None:
    pred, meas = k["predicted"], k["measured"]
    how = "in the bubbles" if k["fill_bubbles"] else "after the passes it reads"
    again = (f" (placed again from the ranks' own times at step {k['placed_again_at'][0]})"
             if k["placed_again_at"] else "")
    console.print(f"K-FAC {how}: a cycle of {k['cycle_steps']} step(s){again}; factors inverted "
                  f"{'/'.join(map(str, k['refreshes_per_cycle']))} time(s) per cycle, by stage")
    table = Table(show_edge=False)
    for col in ("", "plain schedule (predicted)", "with K-FAC (predicted)", "with K-FAC (measured)"):
        table.add_column(col, justify="right")
    lo, hi = meas["step_spread_s"]
    table.add_row("step time", f"{pred['plain_step_s'] * 1e3:.1f} ms", f"{pred['step_s'] * 1e3:.1f} ms",
                  f"{meas['step_s'] * 1e3:.1f} ms ({lo * 1e3:.1f}..{hi * 1e3:.1f})")
    table.add_row("utilization", f"{pred['plain_utilization']:.1%}", f"{pred['utilization']:.1%}",
                  f"{meas['utilization']:.1%}")
    console.print(table)
    console.print("utilization: busy time (passes and K-FAC's work) over ranks x step time; predicted from the "
                  "costs of the last placement (timed on one microbatch before the run, or on the ranks)")


def _ran(job: Any, spec: str, step: int) -> Schedule:
    """The schedule a step ran (an adaptive job switches between several, a K-FAC job runs a cycle)."""
    if job.cycle:
        return job.cycle[step % len(job.cycle)]
    for each in (job.adaptive.schedules if job.adaptive is not None else (job.schedule,)):
        if str(ScheduleRef.of(each)) == spec:
            return each
    return job.schedule


def _decision(first: int, d: Any) -> dict[str, Any]:
    return {"from_step": first, "k": d.k, "reason": d.reason, "bandwidth": d.bandwidth,
            "predicted_s": {str(k): v for k, v in d.predicted.items()},
            "peak_bytes": {str(k): [round(x) for x in v] for k, v in d.peaks.items()},
            "fits": {str(k): v for k, v in d.fits.items()}, "wait_s": d.wait}


def _print_per_step(out: dict[str, Any], console: Console) -> None:
    """Per step: k, the wait on receives, predicted vs measured step time; then each choice and its reasons."""
    table = Table(title="per step", title_justify="left", show_edge=False)
    for col in ("step", "schedule", "wait (s, mean/rank)", "predicted (s)", "measured (s)"):
        table.add_column(col, justify="right")
    for row in out["per_step"]:
        pred = "-" if row["predicted_s"] is None else f"{row['predicted_s']:.3f}"
        table.add_row(str(row["step"]), row["schedule"], f"{row['wait_s']:.3f}", pred, f"{row['measured_s']:.3f}")
    console.print(table)
    for d in out.get("decisions", []):
        bw = min(d["bandwidth"].values(), default=float("inf"))
        options = "  ".join(f"k={k}: {t:.3f} s{'' if d['fits'][k] else ' (over budget)'}"
                            for k, t in d["predicted_s"].items())
        console.print(f"from step {d['from_step']}: k={d['k']} ({d['reason']}); slowest link "
                      f"{format_bytes(bw)}/s; predicted {options}")


FAR_OFF = 0.25
"""A measured step further than this from the plan's prediction (as a fraction) is pointed out after the run."""


def prediction_note(predicted: float, measured: float, actions: int) -> str | None:
    """One line when the run's step time is more than :data:`FAR_OFF` from the prediction, with the likely cause;
    None when it is close. ``actions``: the most actions a rank runs in a step."""
    if not (predicted > 0 and measured > 0) or abs(measured / predicted - 1) <= FAR_OFF:
        return None
    gap = measured - predicted
    per = gap / max(1, actions)
    if gap > 0:
        return (f"the step took {measured / predicted:.2f}x the plan's prediction ({measured * 1e3:.1f} ms against "
                f"{predicted * 1e3:.1f} ms): {per * 1e3:.2f} ms more per action of the busiest rank ({actions}), most "
                "likely the runtime's own work per action (receives, sends, bookkeeping), which the profile's layer "
                "times leave out and which matters on layers of a millisecond or so (docs/plan.md)")
    return (f"the step took {measured / predicted:.2f}x the plan's prediction ({measured * 1e3:.1f} ms against "
            f"{predicted * 1e3:.1f} ms): the profile was taken under other load, or the ranks share fewer cores "
            "than it measured; profile again on an idle machine")


def _print_prediction(plan: dict[str, Any], console: Console) -> None:
    """The plan's prediction next to the run's measurement: step time, bubble ratio, each rank's peak."""
    pred, meas = plan["predicted"], plan["measured"]
    table = Table(title=f"{plan['schedule']}: predicted from the profile vs measured", title_justify="left",
                  show_edge=False)
    for col in ("", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="right")
    lo, hi = meas["step_time_spread_s"]
    table.add_row("step time", f"{pred['step_time_s'] * 1e3:.1f} ms",
                  f"{meas['step_time_s'] * 1e3:.1f} ms ({lo * 1e3:.1f}..{hi * 1e3:.1f})",
                  f"{meas['step_time_s'] / pred['step_time_s']:.3f}")
    table.add_row("bubble ratio", f"{pred['bubble_ratio']:.1%}", f"{meas['bubble_ratio']:.1%}", "")
    for rank, (p, m) in enumerate(zip(pred["peak_bytes"], meas["peak_bytes"], strict=True)):
        table.add_row(f"rank {rank} peak", format_bytes(p), format_bytes(m), f"{m / p:.3f}" if p else "")
    console.print(table)
    console.print("peak: weights, gradients and optimizer state (measured from the tensors after the run) plus the "
                  "step's activations and buffers (the runtime's meter)")
    if "note" in plan:
        console.print(f"[yellow]note:[/yellow] {plan['note']}")


def _parse_offload(text: str) -> tuple[int, int]:
    """'2,1' -> (2, 1)."""
    try:
        k, kprime = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"cannot read --offload {text!r}: use K,K2 such as 2,1 (K layers resident, K2 evicted)") from None
    if not 1 <= kprime <= k:
        raise ConfigError(f"--offload {text}: need 1 <= K2 <= K (got K={k}, K2={kprime})")
    return k, kprime


def _finite(x: float) -> float | None:
    """``x``, or None (JSON null) where it is NaN or inf."""
    return x if math.isfinite(x) else None


def _train_summary(job: Any, reports: list[Any], config: Any, predicted: Any,
                   peaks: list[float] | None = None) -> dict[str, Any]:
    from pipefold.runtime.history import step_number

    steps = len(reports[0].steps)
    # A NaN or inf loss is null: its step is in skipped_steps.
    losses = [_finite(sum(r.steps.loss_sum[i] for r in reports) / job.schedule.microbatches) for i in range(steps)]
    first = reports[0].first_step
    numbered = [step_number(i) for i in range(first, first + steps)]
    step_time = [max(r.steps.wall[i] for r in reports) for i in range(steps)]
    return {
        "schedule": job.schedule.name, "options": dict(job.schedule.options), "devices": job.schedule.devices,
        "stages": job.schedule.stages, "microbatches": job.schedule.microbatches, "model": config.model,
        "layers": job.extra["num_layers"], "partition": config.partition,
        "boundaries": [stage[0] for stage in job.layer_stages], "loss": losses, "step_time_s": step_time,
        "busy_s": [statistics.fmean(r.steps.busy[1:] or r.steps.busy) for r in reports],
        "peak_activation_bytes": [r.steps.peak_activation_bytes for r in reports],
        "predicted_peak_bytes": [round(x) for x in (predicted.peak_memory if peaks is None else peaks)],
        "predicted_step_s": predicted.makespan,
        "batch_bytes": [r.steps[-1].batch_bytes for r in reports],
        "peak_process_bytes": [r.peak_process_bytes for r in reports],
        "static_bytes": [r.static_bytes for r in reports],
        **({"peak_resident_param_bytes": [r.resident_param_bytes for r in reports]} if job.offload else {}),
        **({"recompute": job.extra["recompute"].to_dict()} if "recompute" in job.extra else {}),
        "first_step": numbered[0],
        "grad_norm": [_finite(x) for x in reports[0].steps.grad_norm],
        "skipped_steps": list(reports[0].skipped),
        "clipped_steps": [i for i, c in zip(numbered, reports[0].steps.clipped, strict=True) if c],
        "rolled_back_steps": [i for i, c in zip(numbered, reports[0].steps.rolled_back, strict=True) if c],
        "post_validate": job.post_validate,
        "resumed_from": reports[0].resumed_from,
        "checkpoints": list(reports[0].checkpoints),
        "saved_model": job.save_model,
    }


def _print_train(out: dict[str, Any], console: Console) -> None:
    dp = out.get("dp", 1)
    sharded = {"fsdp": ", stages sharded (FSDP)", "zero1": ", optimizer state sharded (ZeRO-1)"}.get(
        out.get("sharding", "none"), "")
    pipelines = f" x {dp} data-parallel pipelines{sharded} (the table: the first; the loss: all)" if dp > 1 else ""
    first, last = (f"{x:.4f}" if x is not None else "NaN/inf" for x in (out["loss"][0], out["loss"][-1]))
    steps = (f" (steps {out['first_step']} to {out['first_step'] + len(out['loss']) - 1})" if out["first_step"] > 1
             else "")
    console.print(f"[bold]{out['schedule']}[/] on {out['devices']} ranks{pipelines}, {out['microbatches']} "
                  f"microbatches, {out['model']} with {out['layers']} layers: loss {first} -> {last}{steps}")
    if out["resumed_from"]:
        console.print(f"resumed from {out['resumed_from']}")
    if out["skipped_steps"]:
        console.print(f"skipped (loss or gradients NaN or inf): steps {' '.join(map(str, out['skipped_steps']))}")
    if out["checkpoints"]:
        console.print(f"checkpoints: {', '.join(out['checkpoints'])}")
    if out["saved_model"]:
        console.print(f"model saved to {out['saved_model']}")
    split = "evenly" if out["partition"] == "even" else f"balanced by {out['partition']}"
    console.print(f"stages start at layers {' '.join(map(str, out['boundaries']))} (split {split})")
    table = Table(show_edge=False)
    for col in ("rank", "busy (s/step)", "idle (s/step)", "peak held", "predicted", "weights, grads, opt",
                "peak process memory"):
        table.add_column(col, justify="right")
    typical = sorted(out["step_time_s"][1:] or out["step_time_s"])[len(out["step_time_s"][1:] or [0]) // 2]
    for rank, busy in enumerate(out["busy_s"]):
        table.add_row(str(rank), f"{busy:.3f}", f"{max(0.0, typical - busy):.3f}",
                      format_bytes(out["peak_activation_bytes"][rank]), format_bytes(out["predicted_peak_bytes"][rank]),
                      format_bytes(out["static_bytes"][rank]), format_bytes(out["peak_process_bytes"][rank]))
    console.print(table)
    if "recompute" in out:
        _print_recompute(out["recompute"], out["peak_activation_bytes"], console)
    console.print(f"median step {typical:.3f} s (first step {out['step_time_s'][0]:.3f} s; simulated from the "
                  f"measured costs {out['predicted_step_s']:.3f} s)")
    console.print("peak held: every tensor a rank keeps during the step, counted once (saved for backward, outputs, "
                  "gradients kept for W, receive buffers, sends in flight); the batch is apart")
    if "max_grad_rel_diff" in out:
        console.print(f"check against one process: loss rel diff {out['loss_rel_diff']:.2e}, "
                      f"max gradient rel diff {out['max_grad_rel_diff']:.2e}")


def _print_recompute(plan: dict[str, Any], measured: list[int], console: Console) -> None:
    """Recomputed layers per stage, then per device the predicted and measured memory against the budget."""
    budget = plan["budget"]
    layers = ", ".join(f"stage {s}: {r}/{n}" for s, (r, n) in enumerate(zip(plan["layers"], plan["stage_layers"],
                                                                              strict=True)))
    slower = plan["step_time"] / plan["step_time_without"] - 1 if plan["step_time_without"] else 0.0
    console.print(f"recompute {plan['mode']}: layers recomputed {layers}  (simulated step {slower:+.1%})")
    table = Table(show_edge=False, caption="static: weights, gradients and optimizer state; saved: activations "
                                           "held for backward (tensors in transit between ranks come on top)")
    for col in ("rank", "static", "saved, predicted", "measured", "total" if budget is None
                else f"total (budget {format_bytes(budget)})"):
        table.add_column(col, justify="right")
    for d, (static, act) in enumerate(zip(plan["static_bytes"], plan["activation_peak_bytes"], strict=True)):
        row = (static, act, measured[d], static + measured[d])
        table.add_row(str(d), *map(format_bytes, row))
    console.print(table)


def cmd_offload(args: argparse.Namespace, console: Console) -> None:
    from pipefold.train.offload_check import make_case, pick_k, run_check

    case = make_case(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch,
                     seq=args.seq, config=args.hf_config, seed=args.seed)
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1 (got {args.steps})")
    budget = None if args.budget is None else int(parse_bytes(args.budget, "--budget"))
    if budget is not None:
        if args.k is not None or args.kprime is not None:
            raise ConfigError("give either --budget or --k/--kprime, not both: --budget picks k and k'")
        k, kprime = pick_k(case, budget)
    else:
        k = 2 if args.k is None else args.k
        kprime = 1 if args.kprime is None else args.kprime
        if k < 1:
            raise ConfigError(f"--k must be at least 1 (got {k}): the layer that runs must be on the device")
        if not 1 <= kprime <= k:
            raise ConfigError(f"--kprime must be from 1 to --k={k} (got {kprime})")
    out = run_check(case, k, kprime, train=args.train, steps=args.steps)
    if budget is not None:
        out["budget"] = budget
    if args.json:
        print(jsonout.dumps(out))
        return
    t = out["step_time_s"]
    rows = f"batch {out['batch']} x {out['seq']} tokens" if out["seq"] else f"batch {out['batch']}"
    console.print(f"[bold]{out['model']}[/] with {out['layers']} blocks, {rows}, on {out['device']}: "
                  f"k={k}, k'={kprime}" + (f" (picked for a budget of {format_bytes(budget)})" if budget else ""))
    table = Table(show_edge=False)
    table.add_column("")
    table.add_column("offloaded", justify="right")
    table.add_column("plain", justify="right")
    table.add_row("parameter bytes on the device (peak)", format_bytes(out["peak_resident_bytes"]),
                  format_bytes(out["full_model_bytes"]))
    table.add_row("  of the full model", f"{out['resident_ratio']:.1%}", "100.0%")
    table.add_row(f"time per {'training ' if args.train else 'forward '}step (median of {args.steps})",
                  f"{t['offloaded'] * 1e3:.2f} ms", f"{t['plain'] * 1e3:.2f} ms")
    console.print(table)
    diffs = f"max |output diff| {out['max_abs_diff']:.3g}"
    if args.train:
        diffs += f", max |gradient diff| {out['max_grad_diff']:.3g}, max |weight diff| {out['max_weight_diff']:.3g}"
    console.print(diffs + (" (bit for bit)" if all(
        out.get(key, 0.0) == 0 for key in ("max_abs_diff", "max_grad_diff", "max_weight_diff")) else ""))

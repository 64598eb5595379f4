"""Commands that train: train (a schedule, a plan file or --schedule auto) and offload, with their summaries."""


from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from pipefold import jsonout
from pipefold.cli.common import check_outputs, make_console, stage_bar, styled
from pipefold.errors import ConfigError, say
from pipefold.models import REGISTRY
from pipefold.runtime.launch.processes import start_server
from pipefold.units import format_bytes, parse_bytes


def vocab_line(vocab: int | None, devices: int, *, embedding: bool = False) -> str:
    """What the shards of the output layer (and of the token embedding, split alike) hold, padding said where the
    vocabulary does not divide."""
    from pipefold.runtime.vocab import padded_vocab

    what = "output layer and token embedding" if embedding else "output layer"
    if vocab is None:
        return f"{what} split by vocabulary over {devices} devices"
    rows = padded_vocab(vocab, devices) // devices
    pad = rows * devices - vocab
    padded = (f" (padded with {pad} row{'s' if pad > 1 else ''} to {rows * devices:,}: {vocab:,} does not divide "
              f"over {devices}; padding is left out of the loss)") if pad else ""
    return f"{what} split by vocabulary: {rows:,} of {'their' if embedding else 'its'} {vocab:,} rows a device{padded}"


def cmd_train(args: argparse.Namespace, console: Console) -> None:
    from pipefold.train.spec import SETTINGS, RunSpec

    check_outputs(("plot", args.plot, True), ("trace", args.trace, False))
    settings = {name: getattr(args, name) for name in args.given if name in SETTINGS}
    if "hf" in args.given:
        settings["model"] = args.hf
    spec = RunSpec.flat(**settings)
    if spec.local and spec.plan is None and not REGISTRY[spec.model.name].hf:
        # The ranks' fork server imports torch on the other core while this process does. Not where the model has
        # modules of its own for it to preload (a Hugging Face model, or the model a plan file names): the job
        # starts it with them.
        start_server()
    from pipefold.train.planned import resolve  # torch: once the server is on its way
    from pipefold.train.run import run
    from pipefold.train.summary import summarize

    err = make_console(stderr=True)
    planned = None
    if spec.planned:
        with stage_bar("profiling and planning") as progress:
            planned = resolve(spec, profiling=progress,
                              planning=None if progress is None else lambda done, total: progress("plan", done, total))
        if planned is not None and spec.schedule.auto and planned.plan is not None:
            plan = planned.plan
            err.print(
                f"auto: {plan.schedule}, layers per stage {' '.join(str(len(x)) for x in plan.layer_stages)}, "
                f"recomputed {' '.join(map(str, plan.recompute))}: predicted {plan.step_time * 1e3:.1f} ms per step, "
                f"peak {format_bytes(max(plan.peak_bytes))} (budget {format_bytes(spec.memory.budget or 0)})")
    ran = planned.spec if planned is not None else spec
    # A language model's rows are sequences of tokens; the MLP's are samples.
    rows, unit = (ran.model.batch * ran.model.seq, "tok/s") if ran.model.sequences else (ran.model.batch, "samples/s")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}", markup=False), TimeElapsedColumn(), console=err,
                  disable=args.json or not err.is_terminal) as bar:
        task = bar.add_task("train", total=ran.steps, info="starting ranks")

        def on_step(number: int, loss: float, seconds: float) -> None:
            seconds = max(seconds, 1e-9)
            if err.is_terminal:
                bar.update(task, advance=1, info=f"loss {loss:.4f}  {rows / seconds:,.0f} {unit}")
            else:  # redirected: one plain line per step, so a log shows the run as it goes
                say(f"step {number}/{ran.steps} loss {loss:.4f} ({seconds:.3f} s, {rows / seconds:,.0f} {unit})")

        outcome = run(spec, on_step=on_step, planned=planned)
    if outcome is None:
        return  # a torchrun rank other than 0: rank 0 reports for everyone
    out = summarize(outcome, trace=args.trace, plot=args.plot)
    _warn_fp16(out)
    written = {what: path for what, path in (("trace", args.trace), ("plot", args.plot)) if path}
    if args.json:
        print(jsonout.dumps(out | written))
        return
    _print_train(out, console)
    if "plan" in out:
        _print_prediction(out["plan"], console)
    if "per_step" in out:
        _print_per_step(out, console)
    if "kfac" in out:
        _print_kfac(out["kfac"], console)
    if "spb" in out:
        _print_spb(out["spb"], console)
    if "experts" in out:
        _print_experts(out["experts"], console)
    for what, path in written.items():
        console.print(f"wrote {what}: {path}")


def _print_experts(x: dict[str, Any], console: Console) -> None:
    """Per device of the first pipeline: the step's expert exchanges, what of them nothing computed under, and the
    simulator's exposed exchange and step, with and without the overlap."""
    sim = x["simulated"]
    table = Table(title=f"expert all-to-alls over groups of {x['ep']} copies, "
                        f"{'overlapped in the pairs' if x['overlap'] else 'not overlapped'}",
                  title_justify="left", show_edge=False)
    for col in ("device", "exchanges (s/step)", "exposed", "simulated exposed", "with overlap", "without"):
        table.add_column(col, justify="right")
    mine = "with_overlap" if x["overlap"] else "without_overlap"
    for d, (spent, bare) in enumerate(zip(x["exchange_seconds"], x["exposed_seconds"], strict=True)):
        table.add_row(str(d), f"{spent:.3f}", f"{bare:.3f}", f"{sim[mine]['exposed'][d]:.3f}",
                      f"{sim['with_overlap']['exposed'][d]:.3f}", f"{sim['without_overlap']['exposed'][d]:.3f}")
    console.print(table)
    console.print(f"simulated step: {sim['with_overlap']['step']:.3f} s with the overlap, "
                  f"{sim['without_overlap']['step']:.3f} s without (from this run's measured costs); exposed: "
                  "exchange time nothing computed under")


def _print_spb(spb: dict[str, Any], console: Console) -> None:
    """Per data-parallel copy: the layers it backpropagates through, its busy time, activation peak and the bytes it
    sent in the gradients' data-parallel reduction."""
    table = Table(title=f"structured partial backpropagation over {len(spb['per_copy'])} copies of a model of "
                        f"{spb['of_layers']} layers", title_justify="left", show_edge=False)
    for col in ("copy", "backward through", "busy (s/step)", "predicted", "activation peak", "predicted",
                "DP sent (KiB/step)", "closed form", "every layer"):
        table.add_column(col, justify="right")
    for c, row in enumerate(spb["per_copy"]):
        table.add_row(str(c), f"last {row['layers']} layers", f"{row['busy_s']:.3f}",
                      f"{row['predicted_busy_s']:.3f}", format_bytes(row["peak_activation_bytes"]),
                      format_bytes(row["predicted_peak_bytes"]), f"{row['dp_sent_bytes'] / 1024:.1f}",
                      f"{row['predicted_dp_bytes'] / 1024:.1f}", f"{row['full_dp_bytes'] / 1024:.1f}")
    console.print(table)
    console.print("predicted: the simulator, from the first copy's measured costs with the first stage's backward "
                  "and kept activations scaled to the share of its layers each copy backpropagates through; DP sent: "
                  "the bytes the copy's ranks put into the reduction of the gradients, each layer's among the copies "
                  "that computed it (a ring's share of an all-reduce, a broadcast's source to each receiver); every "
                  "layer: the all-reduce of every gradient over every copy")


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
    if "copies" in k:
        _print_kfac_copies(k["copies"], console)


def _print_kfac_copies(copies: dict[str, Any], console: Console) -> None:
    """Per data-parallel copy: K-FAC's work, the bytes of its collectives and its state."""
    how = ("each layer's factors on one copy (DP-KFAC)" if copies["distribution"] == "dp-kfac"
           else "every factor on every copy (D-KFAC)")
    table = Table(title=f"K-FAC over {len(copies['per_copy'])} data-parallel copies: {how}", title_justify="left",
                  show_edge=False)
    simulated = copies.get("simulated") or []
    for col in ("copy", "K-FAC work (ms/step)", "of it computing", "simulated", "sent (KiB/step)", "of which",
                "K-FAC state"):
        table.add_column(col, justify="right")
    for c, row in enumerate(copies["per_copy"]):
        sent = row["sent"]
        parts = ", ".join(f"{k} {v / 1024:.1f}" for k, v in sorted(sent.items())) or "-"
        sim = f"{simulated[c]['kfac_compute_s'] * 1e3:.1f}" if c < len(simulated) else "-"
        table.add_row(str(c), f"{row['seconds'] * 1e3:.1f}", f"{(row['seconds'] - row['comm_seconds']) * 1e3:.1f}",
                      sim, f"{sum(sent.values()) / 1024:.1f}", parts, format_bytes(row["state_bytes"]))
    console.print(table)
    console.print("K-FAC work: the seconds of its actions on the copy's ranks, their collectives included; "
                  "simulated: the computation the simulator lays out on the copy's timeline from the costs timed in "
                  "one process before the run. sent: the bytes each copy put into K-FAC's collectives (the "
                  "gradients' own all-reduce apart), a ring's share for an all-reduce or a broadcast")


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
        console.print(styled(("note:", "yellow"), f" {plan['note']}"))


def _warn_fp16(out: dict[str, Any]) -> None:
    """fp16 without a loss scale: a warning (on stderr, with --json too) where the gradients lost entries to it."""
    share = out.get("fp16_small_grad_share", 0.0)
    if share > 0.01 or (out["skipped_steps"] and "fp16_small_grad_share" in out):
        say(f"warning: fp16 without a loss scale: {share:.1%} of the gradients' nonzero entries were below 2^-14, "
            f"where fp16 loses them to zero, and {len(out['skipped_steps'])} steps were skipped for inf or NaN; use "
            "--loss-scale dynamic")


def _print_train(out: dict[str, Any], console: Console) -> None:
    dp = out.get("dp", 1)
    sharded = {"fsdp": ", stages sharded (FSDP)", "zero1": ", optimizer state sharded (ZeRO-1)"}.get(
        out.get("sharding", "none"), "")
    tp = out.get("tp", 1)  # one degree, or one per device (a list)
    split = tp != 1
    pipelines = ("" if not split else f" x {tp} tensor-parallel ranks each" if isinstance(tp, int)
                 else f" with {','.join(map(str, tp))} tensor-parallel ranks")
    pipelines += f" x {dp} data-parallel pipelines{sharded}" if dp > 1 else ""
    if dp > 1 or split:
        pipelines += f" (the table: {'tensor-parallel rank 0 of ' if split else ''}the first pipeline; the loss: all)"
    first, last = (f"{x:.4f}" if x is not None else "NaN/inf" for x in (out["loss"][0], out["loss"][-1]))
    steps = (f" (steps {out['first_step']} to {out['first_step'] + len(out['loss']) - 1})" if out["first_step"] > 1
             else "")
    console.print(styled((str(out["schedule"]), "bold"), f" on {out['devices']} ranks{pipelines}, "
                         f"{out['microbatches']} microbatches, {out['model']} with {out['layers']} layers: loss "
                         f"{first} -> {last}{steps}"))
    if out["resumed_from"]:
        console.print(f"resumed from {out['resumed_from']}")
    if out.get("precision", "fp32") != "fp32" or out.get("compile"):
        compiled = f"; layers compiled: {out['compile']}" if out.get("compile") else ""
        console.print(f"computes in {out['precision']}{compiled}")
    if out["skipped_steps"]:
        console.print(f"skipped (loss or gradients NaN or inf): steps {' '.join(map(str, out['skipped_steps']))}")

    if out["checkpoints"]:
        console.print(f"checkpoints: {', '.join(out['checkpoints'])}")
    if out["saved_model"]:
        console.print(f"model saved to {out['saved_model']}")
    split = "evenly" if out["partition"] == "even" else f"balanced by {out['partition']}"
    console.print(f"stages start at layers {' '.join(map(str, out['boundaries']))} (split {split})")
    if out.get("options", {}).get("vocab"):
        console.print(vocab_line(out.get("vocab_size"), out["devices"], embedding=bool(out.get("vocab_embedding"))))
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
    if "state_chunks" in out:
        chunks = out["state_chunks"]
        where = " ".join(f"{format_bytes(d)}/{format_bytes(h)}"
                         for d, h in zip(chunks["device_bytes"], chunks["host_bytes"], strict=True))
        room = f" (device memory {format_bytes(chunks['device_memory'])})" if chunks["device_memory"] else ""
        what = "masters, gradients and optimizer state" if chunks.get("masters") else "optimizer state"
        console.print(f"{what} in chunks, on the device / in host memory by rank{room}: {where}")
    if "recompute" in out:
        _print_recompute(out["recompute"], out["peak_activation_bytes"], console)
    if "cluster_plan" in out:
        got, measured = out["cluster_plan"]["predicted"], out["cluster_plan"]["measured"]
        console.print(f"the cluster plan predicted {got['step_time_s']:.3g} s a step, {got['tokens_per_second']:,.0f} "
                      f"tokens/s and {format_bytes(got['memory_bytes'])} per GPU on its cluster; here a step took "
                      f"{measured['step_time_s']:.3g} s")
    console.print(f"median step {typical:.3f} s (first step {out['step_time_s'][0]:.3f} s; {out['predicted_from']} "
                  f"{out['predicted_step_s']:.3f} s)")
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
    if plan["mode"] == "cluster":  # a cluster plan's: its memory is the cluster's, not this run's
        console.print(f"recompute (the cluster plan's): layers recomputed {layers}")
        return
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
                     seq=args.seq, config=args.model_config, seed=args.seed)
    budget = None if args.budget is None else int(parse_bytes(args.budget, "--budget"))
    if budget is not None:
        k, kprime = pick_k(case, budget)
    else:
        k = 2 if args.k is None else args.k
        kprime = 1 if args.kprime is None else args.kprime
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
    console.print(styled((str(out["model"]), "bold"), f" with {out['layers']} blocks, {rows}, on {out['device']}: "
                         f"k={k}, k'={kprime}" + (f" (picked for a budget of {format_bytes(budget)})" if budget
                                                  else "")))
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

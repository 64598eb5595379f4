"""What a finished run did, measured, next to what was predicted: the summary ``pipefold train`` prints (and writes
with ``--json``), its trace and its figure.

The prediction is the plan's (made from the profile before the run) for a planned run; otherwise the simulator fed
with the run's own measured costs. Per-device figures are those of the first data-parallel pipeline (the others run
the same schedule on their shards); the loss is the mean over every pipeline's microbatches.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from fractions import Fraction
from typing import TYPE_CHECKING, Any, NamedTuple

from pipefold.ir import Schedule
from pipefold.ir.ref import ScheduleRef
from pipefold.runtime.history import step_number
from pipefold.runtime.launch.job import Job, RankReport
from pipefold.runtime.measure.timeline import (
    measured_costs,
    measured_result,
    measured_summary,
    per_step,
    step_parts,
    tail,
)
from pipefold.sim.simulate import CostModel, SimResult, simulate
from pipefold.train.reference import compare
from pipefold.train.run import Outcome
from pipefold.train.spec import RunSpec

if TYPE_CHECKING:
    from pipefold.plan.budget import RunPlan

__all__ = ["FAR_OFF", "Passes", "prediction_note", "summarize"]

FAR_OFF = 0.25
"""A measured step further than this from the plan's prediction (as a fraction) is pointed out after the run."""


class Passes(NamedTuple):
    """A device's passes in a step (the mean device of the first pipeline), measured and as the plan predicted them
    (:func:`pipefold.plan.budget.predicted_passes`), in seconds."""

    cpu: float
    """Their CPU time on the rank's executor thread (the operating system's count)."""
    wall: float
    """Their wall time."""
    alone: float
    """The profile's, with every rank on cores of its own."""
    shared: float
    """The profile's, with the ranks sharing the cores as the plan expects."""


def _experts_summary(job: Job, reports: list[RankReport], step: int, replayed: SimResult, costs: CostModel,
                     at: float) -> dict[str, Any]:
    """Expert parallelism's exchanges in the settled step, per device of the first pipeline: their seconds and the
    seconds of them nothing computed under, measured; and the simulator's step and exposed exchange from the
    run's measured costs with and without the overlap (``replayed``, the run's own mode, and the other simulated
    from ``costs``; the costs are right from a run without the overlap: with it, a pair's forward interval holds
    its backward's compute too)."""
    measured = [r.steps[step] for r in reports]
    other = simulate(replayed.schedule, dataclasses.replace(costs, exchange_overlap=not costs.exchange_overlap),
                     network=job.network, at=at)
    by_mode = {costs.exchange_overlap: replayed, not costs.exchange_overlap: other}
    simulated = {name: {"step": by_mode[overlap].makespan, "exposed": list(by_mode[overlap].exchange_exposed)}
                 for name, overlap in (("without_overlap", False), ("with_overlap", True))}
    return {"ep": job.parallel.ep, "overlap": job.parallel.ep_overlap,
            "exchange_seconds": [sum(st.exchanges.values()) for st in measured],
            "exposed_seconds": [st.exchange_exposed for st in measured], "simulated": simulated}


def summarize(outcome: Outcome, *, trace: str | None = None, plot: str | None = None) -> dict[str, Any]:
    """The run's summary as plain data; with ``trace`` the measured timeline written there (Chrome trace JSON), with
    ``plot`` the measured step drawn above the predicted one (or, on a changing network, every step's time)."""
    spec, job, everyone, planned = outcome.spec, outcome.job, outcome.reports, outcome.planned
    reports = [r for r in everyone if r.pipeline == 0]
    step = reports[0].steps.settled(1)[-1]  # the last step a timing reads: warmed up, and not checked as well
    last = _ran(job, reports[0].steps[step].schedule, step)
    peaks: list[int] | None = None
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
    # And after the schedule, its update (check, optimizer step) as the step paid it, as the measured step has it.
    costs = dataclasses.replace(costs, after_step=tail(reports, step))
    costs = dataclasses.replace(costs, exchange_overlap=job.parallel.ep_overlap)
    replayed = simulate(last, costs, network=job.network, at=at)
    predicted, label = replayed, "simulated from the measured costs"
    if planned is not None and planned.plan is not None:
        from pipefold.plan.budget import copy_peaks, predict

        # The profile's prediction, made before the run, next to what the run measured. The peaks beside the first
        # pipeline's ranks are its copy's own: under ZeRO-1 the copies keep different shares of the state, and the
        # plan's figure for a device is its heaviest copy's.
        plan = planned.plan
        room = plan.room if plan.room is not None else math.inf  # what a plan's chunks fill
        predicted = predict(plan.profile, plan.layout, job.schedule, job.layer_stages, job.recompute, room)[0]
        peaks = copy_peaks(plan.profile, plan.layout, job.schedule, job.layer_stages, job.recompute, room)[0]
        label = "predicted from the profile"
    cycle_peaks = None
    if job.cycle and planned is None:  # the steps of a cycle differ: each rank's peak is the most over those that ran
        each = [simulate(sched, costs).peak_memory for sched in job.cycle[:len(reports[0].steps)]]
        cycle_peaks = [max(col) for col in zip(*each, strict=True)]
    out = _train_summary(spec, job, reports, predicted, cycle_peaks)
    out["predicted_from"] = label
    parallel = job.parallel
    if parallel.tensor_parallel:
        out["tp"] = parallel.tp if isinstance(parallel.tp, int) else list(parallel.tp)
    if parallel.cp > 1:
        out["cp"] = parallel.cp
    if parallel.copies > 1:
        out["dp"] = parallel.dp
        out["sharding"] = "fsdp" if parallel.fsdp else "zero1" if parallel.zero1 else "none"
    if parallel.ep > 1:
        out["experts"] = _experts_summary(job, reports, step, replayed, costs, at)
    if parallel.spb is not None:
        out["spb"] = _spb_summary(job, everyone, last, costs)
        out["loss"] = [_finite(sum(r.steps.loss_sum[i] for r in everyone)
                               / sum(r.steps.loss_count[i] for r in everyone)) for i in range(len(reports[0].steps))]
    if job.adaptive is not None or spec.links.network is not None:
        out["per_step"] = per_step(reports)
        out["network"] = spec.links.network
        out["netns"] = spec.links.netns
    if job.adaptive is not None:
        first_step = reports[0].first_step
        out["decisions"] = [_decision(step_number(first_step + first), d) for first, d in reports[0].decisions]
    if "pipefisher" in job.extra:
        out["kfac"] = _kfac_summary(job.extra["pipefisher"], reports, spec.optimizer.fill_bubbles)
        if job.parallel.copies > 1:
            out["kfac"]["copies"] = _kfac_copies(job, everyone, spec.optimizer.fill_bubbles)
    if planned is not None and planned.cluster is not None:  # a cluster plan's prediction beside the measurement
        out["cluster_plan"] = {"predicted": planned.cluster, "measured": measured_summary(reports)}
    if planned is not None and planned.plan is not None:
        out["plan"] = {"schedule": planned.plan.schedule,
                       "predicted": {"step_time_s": predicted.makespan, "bubble_ratio": predicted.bubble_ratio,
                                     "peak_bytes": peaks},
                       "measured": measured_summary(reports)}
        out["plan"]["replayed_step_time_s"] = replayed.makespan
        actions = max(len(row) for row in job.schedule.actions)
        passes = _passes(plan, job, reports)
        if passes is not None:
            out["plan"]["passes_s"] = passes._asdict()
        note = prediction_note(predicted.makespan, out["plan"]["measured"]["step_time_s"], actions,
                               replayed=replayed.makespan, passes=passes)
        if note is not None:
            out["plan"]["note"] = note
    if spec.check:
        out.update(compare(job, everyone))
    if trace:
        from pipefold.runtime.measure.timeline import write_measured_trace

        write_measured_trace(reports, trace)
        out["trace"] = trace
    if plot and "per_step" in out:
        from pipefold.sim.render import plot_adaptive

        offset = min(r.steps[0].started_at for r in reports) - job.origin if job.origin is not None else 0.0
        plot_adaptive(out["per_step"], out.get("decisions", []), spec.links.parsed, plot, offset=offset,
                      title=f"{spec.schedule.name} on {job.schedule.devices} ranks, "
                            f"{'network namespaces' if spec.links.netns else 'emulated links'}: "
                            f"{spec.links.network}")
        out["plot"] = plot
    elif plot:
        from pipefold.sim.render import plot_run

        measured = measured_result(last, reports, step)
        number = step_number(reports[0].first_step + step)
        plot_run(measured, predicted, plot,
                 titles=(f"measured, step {number} ({measured.makespan * 1e3:.1f} ms)",
                         f"{label} ({predicted.makespan * 1e3:.1f} ms)"))
        out["plot"] = plot
    return out


def _passes(plan: RunPlan, job: Job, reports: list[RankReport]) -> Passes | None:
    """The mean device's passes in a step, measured against the plan's :func:`~pipefold.plan.budget.predicted_passes`;
    None where the run has no CPU time of its passes (on a GPU)."""
    from pipefold.plan.budget import predicted_passes

    parts = step_parts(reports)
    if not all("compute cpu" in p for p in parts):
        return None
    alone, shared = predicted_passes(plan.profile, plan.layout, job.schedule, job.layer_stages, job.recompute)
    return Passes(cpu=statistics.fmean(p["compute cpu"] for p in parts),
                  wall=statistics.fmean(p["compute"] for p in parts),
                  alone=statistics.fmean(alone), shared=statistics.fmean(shared))


def prediction_note(predicted: float, measured: float, actions: int, *, replayed: float,
                    passes: Passes | None = None) -> str | None:
    """One line when the run's step time is more than :data:`FAR_OFF` from the prediction, with the likely cause;
    None when it is close. ``actions``: the most actions a rank runs in a step; ``replayed``: the step the
    simulator gives from the run's own measured pass times, which tells the two causes of a slower run apart;
    ``passes``, where the run measured their CPU time: whether slower passes did more work than the profile
    measured or waited for the cores longer than the plan expected."""
    if not (predicted > 0 and measured > 0) or abs(measured / predicted - 1) <= FAR_OFF:
        return None
    head = (f"the step took {measured / predicted:.2f}x the plan's prediction ({measured * 1e3:.1f} ms against "
            f"{predicted * 1e3:.1f} ms)")
    work = (f"the passes used {passes.cpu / passes.alone:.2f}x the CPU time the profile gives them"
            if passes is not None and passes.cpu > 0 and passes.alone > 0 else None)
    if measured < predicted:
        return (f"{head}{'; ' + work if work else ''}: the profile was taken under other load, or the ranks share "
                "fewer cores than it measured; profile again on an idle machine")
    if replayed >= (1 - FAR_OFF) * measured:  # the passes alone, replayed, make (nearly all of) the step
        head = (f"{head}; the run's own pass times replay to {replayed * 1e3:.1f} ms, so the passes themselves took "
                "longer")
        if work is not None and passes is not None and passes.shared > 0:
            why = (" (the machine is slower than when it was profiled, or a stage costs more than its layers timed "
                   "one by one)" if passes.cpu > 1.1 * passes.alone else "")
            return (f"{head}: {work}{why}, and took {passes.wall / passes.cpu:.2f}x their CPU time, waiting for a "
                    f"core, where the plan expected {passes.shared / passes.alone:.2f}x (docs/plan.md)")
        return (f"{head} than the profile's layers add up to: a stage's passes can cost more than the sum of its "
                "layers timed one by one (small layers), and ranks that share cores run slower than the profile "
                "measured (docs/world.md#limits)")
    per = (measured - replayed) / max(1, actions)
    return (f"{head}; the run's own pass times replay to {replayed * 1e3:.1f} ms, so the rest is time between "
            f"passes, {per * 1e3:.2f} ms per action of the busiest rank ({actions}): the runtime's own work per "
            "action (receives, sends, bookkeeping), or ranks waiting for a core they share (docs/plan.md)")


def _ran(job: Job, spec: str, step: int) -> Schedule:
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


def _with_stash(costs: CostModel, measured: CostModel) -> CostModel:
    """``costs`` with each stage's K-FAC stash as ``measured`` has it."""
    over = {s: dataclasses.replace(o, stash=measured.stage_overrides[s].stash)
            for s, o in costs.stage_overrides.items()}
    return dataclasses.replace(costs, stage_overrides=over)


def _kfac_summary(filled: Any, reports: list[RankReport], fill_bubbles: bool) -> dict[str, Any]:
    """K-FAC's placement as planned (simulated from the costs measured before the run) next to the run."""
    from pipefold.plan.pipefisher import utilization

    meas = measured_summary(reports)
    walls = [max(r.steps.wall[i] for r in reports) for i in range(len(reports[0].steps))]
    placed = [(0, filled), *(d for r in reports if r.rank == 0 for d in r.decisions)]
    rows = []
    for i, w in enumerate(walls):
        first, now = max((p for p in placed if p[0] <= i), key=lambda p: p[0])
        k = (i - first) % len(now.steps)
        rows.append({"step": step_number(reports[0].first_step + i), "placement": placed.index((first, now)),
                     "cycle_step": k, "predicted_s": now.steps[k].makespan, "measured_s": w})
    last = placed[-1][1]
    return {"fill_bubbles": fill_bubbles, "cycle_steps": len(last.steps), "per_step": rows,
            "placed_again_at": [step_number(reports[0].first_step + p[0]) for p in placed[1:]],
            "refreshes_per_cycle": list(last.refreshes),
            "predicted": {"plain_step_s": last.base.makespan, "plain_utilization": utilization(last.base),
                          "step_s": last.step_time, "utilization": last.utilization},
            "measured": {"step_s": meas["schedule_time_s"], "step_spread_s": meas["schedule_time_spread_s"],
                         "utilization": 1.0 - meas["bubble_ratio"]}}


def _kfac_copies(job: Job, reports: list[RankReport], fill_bubbles: bool) -> dict[str, Any]:
    """K-FAC over data-parallel copies: per copy (its ranks together), the bytes of K-FAC state it holds, the bytes
    it put into K-FAC's collectives per step by what they carried, and its seconds of K-FAC work per step; the
    owners of the layers; and, where every step refreshes every stage, the closed form of each copy's bytes, state
    and work per step (:func:`pipefold.plan.dpkfac.predict`)."""
    copies: list[dict[str, Any]] = [{"state_bytes": 0, "sent": {}, "seconds": 0.0, "comm_seconds": 0.0}
                                    for _ in range(job.parallel.copies)]
    for r in reports:
        if r.kfac is None:
            continue
        mine = copies[job.coords(r.rank)[0]]
        mine["state_bytes"] += r.kfac["state_bytes"]
        mine["seconds"] += r.kfac["seconds"]
        mine["comm_seconds"] += r.kfac.get("comm_seconds", 0.0)
        for k, v in r.kfac["sent"].items():
            mine["sent"][k] = mine["sent"].get(k, 0.0) + v
    assert job.optimizer.kfac is not None
    distribution = job.optimizer.kfac.distribution
    out: dict[str, Any] = {"distribution": distribution, "per_copy": copies, "predicted": None,
           "owners": {str(s): list(o) for s, o in job.extra.get("kfac_owners", {}).items()},
           "simulated": _kfac_simulated(job, len(copies))}
    if not fill_bubbles:  # one refresh of every stage per step, from every microbatch: the closed form per step
        from pipefold.plan.dpkfac import Layer, predict

        predicted: list[dict[str, Any]] = [{"state_bytes": 0.0, "sent": {}, "flops": 0.0} for _ in copies]
        owners = job.extra.get("kfac_owners", {})
        for device in range(job.schedule.devices):
            stages = job.schedule.stages_of(device)
            layers = [Layer(*shape) for s in stages for shape in job.extra["kfac_shapes"][s]]
            owned: list[int] | None = [o for s in stages for o in owners.get(s, ())] or None
            for c, each in enumerate(predict(layers, len(copies), distribution, updates=job.schedule.microbatches,
                                             owners=owned)):
                predicted[c]["state_bytes"] += each.state
                predicted[c]["flops"] += each.flops
                for k, v in each.sent.items():
                    predicted[c]["sent"][k] = predicted[c]["sent"].get(k, 0.0) + v
        out["predicted"] = predicted
    return out


def _kfac_simulated(job: Job, copies: int) -> list[dict[str, float]] | None:
    """Per data-parallel copy, the simulator's step and K-FAC computation per step (the mean over the cycle of
    schedules): the costs measured before the run in one process, each stage's K-FAC seconds turned into the copy's
    by :func:`pipefold.plan.dpkfac.stage_work`, every device of the copy's pipeline laid out on the timeline."""
    from pipefold.ir import Kind
    from pipefold.plan.dpkfac import Layer, stage_work

    filled, shapes = job.extra.get("pipefisher"), job.extra.get("kfac_shapes")
    if filled is None or shapes is None or job.optimizer.kfac is None:
        return None
    cost = filled.steps[0].cost
    owners = job.extra.get("kfac_owners", {})
    kinds = {Kind.KA, Kind.KG, Kind.KI, Kind.KP}
    out = []
    for c in range(copies):
        over = {}
        for s, o in cost.stage_overrides.items():
            if o.work is None:
                over[s] = o
                continue
            layers = [Layer(*shape) for shape in shapes.get(s, ())]
            work = stage_work(o.work, layers, copies, job.optimizer.kfac.distribution,
                              updates=job.schedule.microbatches, owners=owners.get(s, ()))[c]
            over[s] = dataclasses.replace(o, work=work)
        mine = dataclasses.replace(cost, stage_overrides=over)
        runs = [simulate(schedule, mine) for schedule in filled.cycle]
        kfac = [sum(i.end - i.start for row in r.timeline for i in row if i.action.kind in kinds) for r in runs]
        out.append({"step_s": sum(r.makespan for r in runs) / len(runs), "kfac_compute_s": sum(kfac) / len(kfac)})
    return out


def _spb_summary(job: Job, reports: list[RankReport], schedule: Schedule, costs: CostModel) -> dict[str, Any]:
    """Structured partial backpropagation: per data-parallel copy, the last layers it backpropagates through, its
    ranks' busy seconds per step (the mean over the steps after the first, summed over its ranks) and their largest
    activation peak; beside them, the simulator's: the first pipeline's measured costs (``costs``, a copy that
    backpropagates through every layer, which one copy does) with the first stage's backward and the activations it
    keeps scaled to the share of its layers the copy backpropagates through. And the bytes its ranks sent in the
    last step's data-parallel reduction, as the runtime counted them, beside the closed form's
    (:func:`pipefold.plan.spb.dp_bytes`, from the bytes of each layer's gradients) and what the all-reduce of every
    layer over every copy would send."""
    from pipefold.plan.spb import dp_bytes

    spb = job.parallel.spb
    assert spb is not None
    layers, first = job.extra["num_layers"], len(job.layer_stages[0])
    # Every copy's ranks hold the same layers: copy 0's give each device's layers once (a replicated stage's
    # on each of its ranks, each of which reduces them).
    held = [r.steps[-1].dp_layer_bytes for r in reports if job.coords(r.rank)[0] == 0]
    split, full = ([sum(each, Fraction(0)) for each in zip(*(dp_bytes(spb, b, layers, split=cut) for b in held),
                                                          strict=True)] for cut in (True, False))
    copies = []
    for c, k in enumerate(spb):
        mine = [r for r in reports if job.coords(r.rank)[0] == c]
        share = (k - (layers - first)) / first  # of the first stage's layers
        stage0 = costs.stage_overrides.get(0)
        scaled = costs
        if stage0 is not None and share < 1:
            bw = stage0.bw if stage0.bw is not None else stage0.b + stage0.w
            memory = stage0.memory * share if stage0.memory is not None else None
            scaled = dataclasses.replace(costs, stage_overrides={**costs.stage_overrides, 0: dataclasses.replace(
                stage0, b=stage0.b * share, w=stage0.w * share, bw=bw * share, memory=memory, kept=None,
                memory_w=None)})
        predicted = simulate(schedule, scaled)
        copies.append({"layers": k, "busy_s": sum(statistics.fmean(r.steps.busy[i] for i in r.steps.timed(1))
                                                  for r in mine),
                       "peak_activation_bytes": max(r.steps.peak_activation_bytes for r in mine),
                       "predicted_busy_s": sum(predicted.busy), "predicted_peak_bytes": max(predicted.peak_memory),
                       "dp_sent_bytes": float(sum((r.steps[-1].dp_sent for r in mine), Fraction(0))),
                       "predicted_dp_bytes": float(split[c]), "full_dp_bytes": float(full[c])})
    return {"of_layers": layers, "per_copy": copies}


def _small_grads(job: Job, reports: list[RankReport]) -> dict[str, Any]:
    """In fp16 without a loss scale: the share of the gradients' nonzero entries that fp16 cannot hold at full
    precision (below 2^-14: they lose digits or flush to zero)."""
    precision = job.devices.precision
    if precision.dtype != "fp16" or precision.loss_scale is not None:
        return {}
    small, nonzero = (sum(r.small_grads[i] for r in reports) for i in (0, 1))
    return {"fp16_small_grad_share": small / nonzero if nonzero else 0.0}


def _chunks(job: Job, reports: list[RankReport]) -> dict[str, Any]:
    """Per rank, the bytes of optimizer state its chunks held on the device and in host memory after the last
    step (the host's with their float32 parameters and gradients; with master weights every chunk's masters and
    gradients), and the device memory they filled."""
    held = [r.steps[-1].state_bytes or (0, 0) for r in reports]
    assert job.chunks is not None
    return {"device_bytes": [d for d, _ in held], "host_bytes": [h for _, h in held],
            "device_memory": job.chunks.device_memory, "chunk_elements": job.chunks.capacity,
            "masters": job.devices.precision.master_weights}


def _finite(x: float) -> float | None:
    """``x``, or None (JSON null) where it is NaN or inf."""
    return x if math.isfinite(x) else None


def _train_summary(spec: RunSpec, job: Job, reports: list[RankReport], predicted: SimResult,
                   peaks: list[float] | None = None) -> dict[str, Any]:
    steps = len(reports[0].steps)
    # A NaN or inf loss is null: its step is in skipped_steps.
    losses = [_finite(sum(r.steps.loss_sum[i] for r in reports) / job.schedule.microbatches) for i in range(steps)]
    first = reports[0].first_step
    numbered = [step_number(i) for i in range(first, first + steps)]
    step_time = [max(r.steps.wall[i] + r.steps.update[i] for r in reports) for i in range(steps)]
    return {
        "schedule": job.schedule.name, "options": dict(job.schedule.options), "devices": job.schedule.devices,
        "stages": job.schedule.stages, "microbatches": job.schedule.microbatches, "model": spec.model.name,
        "layers": job.extra["num_layers"], "partition": spec.memory.partition, "p2p": reports[0].p2p,
        "boundaries": [stage[0] for stage in job.layer_stages], "loss": losses, "step_time_s": step_time,
        "busy_s": [statistics.fmean(r.steps.busy[i] for i in r.steps.timed(1)) for r in reports],
        "peak_activation_bytes": [r.steps.peak_activation_bytes for r in reports],
        "predicted_peak_bytes": [round(x) for x in (predicted.peak_memory if peaks is None else peaks)],
        "predicted_step_s": predicted.makespan,
        "batch_bytes": [r.steps[-1].batch_bytes for r in reports],
        "peak_process_bytes": [r.peak_process_bytes for r in reports],
        "static_bytes": [r.static_bytes for r in reports],
        **({"peak_resident_param_bytes": [r.resident_param_bytes for r in reports]} if job.offload else {}),
        **({"state_chunks": _chunks(job, reports)} if job.chunks is not None else {}),
        **({"recompute": job.extra["recompute"].to_dict()} if "recompute" in job.extra else {}),
        **({"vocab_size": job.extra["vocab_size"]} if job.extra.get("vocab_size") else {}),
        **({"vocab_embedding": True} if job.extra.get("vocab_embedding") else {}),
        "first_step": numbered[0],
        "grad_norm": [_finite(x) for x in reports[0].steps.grad_norm],
        "skipped_steps": list(reports[0].skipped),
        "precision": job.devices.precision.describe(),
        "compile": (f"{job.devices.compile} ({job.devices.compile_backend})" if job.devices.compile is not None
                    else None),
        **_small_grads(job, reports),
        "clipped_steps": [i for i, c in zip(numbered, reports[0].steps.clipped, strict=True) if c],
        "rolled_back_steps": [i for i, c in zip(numbered, reports[0].steps.rolled_back, strict=True) if c],
        "post_validate": job.reliability.post_validate,
        "resumed_from": reports[0].resumed_from,
        "checkpoints": list(reports[0].checkpoints),
        "saved_model": job.reliability.save_model,
    }

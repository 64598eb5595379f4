"""The body of one rank, spawned or under torchrun: build its stages, train for the job's steps (schedules
switched as the job says, gradients checked for NaN and clipped, optimizer steps, checkpoints), report."""


from __future__ import annotations

import collections
import cProfile
import math
import os
import pickle
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule
from pipefold.ir.ref import ScheduleRef
from pipefold.runtime import numerics, sharding, sockets
from pipefold.runtime.chunks import ChunkedOptimizer
from pipefold.runtime.executor import RankExecutor, StepStats
from pipefold.runtime.experts import (
    EXPERT,
    balanced_stages,
    begin_balance_step,
    biased_stages,
    expert_groups,
    expert_link,
    shard_experts,
    step_router_biases,
    sum_balance_over,
)
from pipefold.runtime.history import StepHistory, step_number, unchecked
from pipefold.runtime.launch.faults import Faults
from pipefold.runtime.numerics import clip_factor, local_check, scale_grads, verdict
from pipefold.runtime.pipeline import RankPipeline
from pipefold.runtime.precision import LossScaler, Masters, grad_holder, unscale
from pipefold.runtime.seqchunks import split_units
from pipefold.runtime.stage import Chain, Tensors, as_tuple, split_batch
from pipefold.runtime.tied import TiedGrads, untie
from pipefold.runtime.vocab import VocabShard
from pipefold.runtime.watch import (
    COMPILE_GRACE,
    Activity,
    pg_timeout,
)
from pipefold.runtime.zero import AnyOptimizer, ShardedOptimizer, holding

if TYPE_CHECKING:
    from pipefold.plan.pipefisher import Filled, Refill
    from pipefold.runtime.offload import Offloaded
    from pipefold.runtime.partial import Reduction
from pipefold.runtime.launch.job import Job, RankReport, local_rank, placement


def stage_modules(job: Job, rank: int) -> dict[int, nn.Module]:
    """The stage modules of ``rank``: only its own layers are ever built; a weight that several of its stages
    share is copied into each (see :mod:`pipefold.runtime.tied`)."""
    stages = job.schedule.stages_of(rank)
    wanted = sorted(i for s in stages for i in job.layer_stages[s])
    layers = job.build_layers(wanted)
    chains: dict[int, nn.Module] = {s: Chain(*(layers[i] for i in job.layer_stages[s])) for s in stages}
    untie(chains)
    return chains


def _vocab_shard(job: Job, rank: int, chains: dict[int, nn.Module]) -> tuple[VocabShard, str]:
    """This rank's shard of the output projection, the model's last layer left without it where this rank holds
    it (every other rank builds that layer for its weights, the same whichever rank builds it, and keeps its rows)."""
    assert job.split_output is not None
    last = job.schedule.stages - 1
    n = job.extra["num_layers"]
    layer = list(chains[last].children())[-1] if last in chains else job.build_layers([n - 1])[n - 1]
    name, weight = job.split_output(layer)
    return _rows(job, rank, weight), name


def _embedding_shard(job: Job, rank: int, chains: dict[int, nn.Module]) -> tuple[VocabShard, str] | None:
    """This rank's shard of the token embedding, the model's first layer left without it where this rank holds it
    (every other rank builds that layer for its weights and keeps its rows); None for a model that keeps it whole."""
    assert job.split_input is not None
    layer = list(chains[0].children())[0] if 0 in chains else job.build_layers([0])[0]
    taken = job.split_input(layer)
    if taken is None:
        return None
    name, weight, padding = taken
    return _rows(job, rank, weight, padding), name


def _rows(job: Job, rank: int, weight: torch.Tensor, padding: int | None = None) -> VocabShard:
    """This rank's rows of a matrix of the vocabulary (:meth:`VocabShard.of`)."""
    with warnings.catch_warnings():  # the padding of a vocabulary the devices do not divide: the command says so
        warnings.simplefilter("ignore")
        return VocabShard.of(weight, rank, job.schedule.devices, padding_idx=padding)


def microbatches(x: torch.Tensor, m: int) -> list[torch.Tensor]:
    if x.shape[0] % m:
        raise ValueError(f"a batch of {x.shape[0]} does not split into {m} equal microbatches")
    return list(x.chunk(m))


def _shapes(x: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of a batch's input tensors: the ranks agree on new receive buffers when they change."""
    return tuple(tuple(t.shape) for t in as_tuple(x))


def run_rank(job: Job, rank: int, world: int, out_dir: str | None,
             on_step: Callable[[int, float, float], None] | None = None,
             activity: Activity | None = None) -> RankReport:
    """The body of one rank: build, train for ``job.steps`` steps, report.

    Rank 0 calls ``on_step(number, loss, seconds)`` after every step (its number: from 1, resumed steps
    counted, :func:`~pipefold.runtime.history.step_number`), with the step's global loss (every microbatch
    of every pipeline and replica: :attr:`StepStats.loss`). ``activity`` is told what the rank is doing, for the
    job's watch.
    """
    global_rank = rank
    copy, rank, tp_rank = job.coords(global_rank)  # from here on ``rank`` is the device in the pipeline
    pipeline = job.pipeline_of(global_rank)  # this rank's pipeline: data-parallel copy, tensor-parallel rank
    activity = activity if activity is not None else Activity(global_rank)
    everyone = tuple(r for r in range(world) if r != global_rank)
    placed = placement(job)
    device = placed.device_of(local_rank(global_rank))  # current already: set before the process group was made
    meshed = job.parallel.copies > 1 or job.parallel.tensor_parallel
    if meshed:
        activity.wait("start-up", "the device mesh", everyone, action=False)
    dp_mesh, tp_mesh = _mesh(job, placed.device, global_rank) if meshed else (None, None)
    pipelines = job.pipeline_ranks() if meshed else None
    dp_group = dp_mesh.get_group() if dp_mesh is not None else None
    cp_group = _cp_group(job, global_rank) if job.parallel.cp > 1 else None
    cp_rank = copy % job.parallel.cp  # which chunks of each sequence this copy holds
    if cp_group is not None:
        from pipefold.runtime.context import context_parallel, shard_sequence
    activity.run("start-up (building its layers)", action=False)
    chains = stage_modules(job, rank)
    spb = _partial_backward(job, global_rank, chains) if job.parallel.spb is not None else None
    shard, shard_name = _vocab_shard(job, rank, chains) if job.schedule.vocab else (None, "")
    if shard is not None:
        shard = shard.to(device)
    embedded = _embedding_shard(job, rank, chains) if job.split_input is not None else None
    embedding, embedding_name = (embedded[0].to(device), embedded[1]) if embedded is not None else (None, "")
    shards = [s for s in (shard, embedding) if s is not None]
    precision = job.devices.precision
    # What the passes run: the stages' layers, compiled where asked (after tensor parallelism has split them);
    # ``chains`` keeps the layers' own names, a checkpoint's.
    compiling = job.devices.compiling
    if compiling:
        from pipefold.runtime.compiled import check_compile, compile_stage
        from pipefold.runtime.launch.tempfolder import keep_compile_cache

        check_compile(job.devices.compile_backend, device)
        keep_compile_cache()

    def runnable(stages: dict[int, nn.Module]) -> dict[int, nn.Module]:
        if not compiling:
            return stages
        return {s: compile_stage(m, job.devices.compile, job.devices.compile_backend)  # type: ignore[arg-type]
                for s, m in stages.items()}
    tied = TiedGrads(job.tied, job.schedule, job.layer_stages, rank, chains, device, pipelines, pipeline)
    offloaded: list[Offloaded] = []
    if job.offload is None:
        modules: dict[int, nn.Module] = {s: m.to(device) for s, m in chains.items()}
        if cp_group is not None:  # attention as a ring over the copies that hold the other chunks
            for stage in modules.values():
                context_parallel(stage, cp_group, job.parallel.cp, cp_rank)
        if tp_mesh is not None:
            for s, stage in modules.items():
                sharding.tensor_parallel(dict(zip(job.layer_stages[s], stage.children(), strict=True)), job.tp_plan,
                                         tp_mesh)
        if job.parallel.ep > 1:  # each MoE layer's experts over groups of copies, before anything lists them
            for expert in shard_experts(modules.values(), *expert_groups(dp_group, job.parallel.ep),
                                        network=job.network):
                expert.link.overlap = job.parallel.ep_overlap
        modules = runnable(modules)
    else:
        from pipefold.runtime.offload import Offloaded

        k, kprime = job.offload
        # Each stage offloads its own layers: parameters live on the CPU, at most k of them on the device.
        offloaded = [Offloaded(m, device, k=k, kprime=kprime) for m in runnable(chains).values()]
        modules = dict(zip(chains, offloaded, strict=True))
    recompute = {s: job.recompute[s] for s in modules} if job.recompute else None
    # What the optimizers step: the parameters, or with FSDP their shards (the runners work on the gathered ones).
    trained = {s: sharding.sharded_parameters(sharding.shard(m, dp_mesh)) if job.parallel.fsdp else list(m.parameters())
               for s, m in modules.items()}
    # A schedule with OPT actions steps each stage's optimizer where it says; otherwise one optimizer steps
    # all of this rank's parameters after the step.
    in_schedule = any(a.kind == Kind.OPT for row in job.schedule.actions for a in row)
    stage_opts = {s: _optimizer(job, trained[s]) for s in modules} if in_schedule else {}
    # Each stage's state before its OPT stepped, until the step is validated.
    stage_snaps: dict[int, numerics.Snapshot] = {}
    origin = job.origin
    if job.network is not None and origin is None:
        activity.wait("start-up", "the network's start time", everyone, action=False)
        origin = float(agree(time.time()))  # the network's timeline starts now on every rank
    if (link := expert_link(modules.values())) is not None:
        link.origin = origin or 0.0  # the expert exchanges' emulated links too
    choices = job.adaptive.schedules if job.adaptive is not None else job.cycle or (job.schedule,)
    cycle_from = 0  # the step the cycle in ``choices`` started at
    work = None
    if job.optimizer.kfac is not None:
        from pipefold.runtime.curvature import RankCurvature, StageCurvature

        m = job.schedule.microbatches
        spread = _kfac_copies(job, global_rank) if job.parallel.copies > 1 else {}
        work = RankCurvature({s: StageCurvature(mod, job.optimizer.kfac, m, spread.get(s))
                              for s, mod in modules.items()})
    # The one way a schedule runs (the same object a user's script steps through pipefold.Pipeline): an executor
    # per schedule of ``choices``, made the first time it runs, over the same modules and parameters.
    pipe = RankPipeline(
        choices, rank, modules, job.loss_fn, device, recompute=recompute, log_messages=job.log_messages,
        timeout=pg_timeout(job.reliability.action_timeout, compiling=compiling), network=job.network,
        origin=origin or 0.0,
        optimizers={s: _speculative(s, o, modules[s], stage_snaps) for s, o in stage_opts.items()}, work=work,
        pipelines=pipelines, pipeline=pipeline, meshes=job.meshes()[copy] if meshed else None, tp_index=tp_rank,
        tp_group=tp_mesh.get_group() if tp_mesh is not None else None, dp_group=dp_group,
        sharded=job.parallel.fsdp, activity=activity,
        staged=placed.staged or bool(job.extra.get("stage_through_host")), overlap=job.devices.overlap,
        autocast=precision.autocast, vocab=shard, embedding=embedding, spb=spb)

    # Mixture-of-experts stages: their load-balancing loss counts the whole batch's choices, over the copies too.
    balanced = bool(balanced_stages(modules))
    if balanced and dp_group is not None:
        sum_balance_over(modules.values(), dp_group)
    biased = bool(biased_stages(modules))

    def executor_for(index: int) -> RankExecutor:
        """The executor of schedule ``index``, made the first time it runs (same modules, same parameters)."""
        if not pipe.made(index):
            activity.wait("start-up" if activity.step < 1 else "a new schedule", "its process groups", everyone,
                          action=False)
        return pipe.executor(index)

    current, predicted = 0, None
    decisions: list[tuple[int, Any]] = []
    executor = executor_for(current)
    if not job.parallel.fsdp:
        trained = {s: r.params for s, r in executor.runners.items()}
    params = [p for ps in trained.values() for p in ps]
    params += [s.weight for s in shards]  # this rank's rows of the output projection and the embedding
    # Master weights: the parameters in the low dtype from here on, float32 copies for the optimizer to step.
    masters = Masters(params, precision.torch_dtype) if precision.master_weights else None
    opt = None if in_schedule else _optimizer(job, masters.masters if masters is not None else params, dp_group,
                                              pipe, masters)
    scaler = precision.scaler()
    keep = {s for s in (job.save_grads_of_step, job.verify_memory_step) if s is not None}
    history = StepHistory(job.keep_steps, keep)  # every step's numbers; in full only the steps that need it
    # What refilling K-FAC's placement and adapting the schedule learn from: their own windows of full records.
    learning: list[tuple[StepStats, Schedule]] = []  # each step to learn from, with the schedule it ran
    recent: collections.deque[StepStats] = collections.deque(maxlen=job.adaptive.every if job.adaptive else 1)
    grads = None
    m, chunks = job.schedule.data_microbatches, job.schedule.seq_chunks
    # A stage held by several replicas counts once in a global norm: by its first holder, in the first copy
    # (with FSDP, by every copy: each holds its own shard); a tied weight's copies count once; a parameter split
    # over the tensor-parallel ranks by each of them (its part), one they replicate by the first.
    counted = [p for s, ps in trained.items()
               if job.schedule.holders(s)[0] == rank and (copy == 0 or job.parallel.fsdp)
               for p in ps if id(p) not in tied.copies and (tp_rank == 0 or sharding.split_over(p, "tp"))]
    counted += [s.weight for s in shards]
    if 0 < copy < job.parallel.ep:  # an expert spread over the copies: by the first group's copy that holds it
        counted += [p for s, ps in trained.items() if job.schedule.holders(s)[0] == rank for p in ps
                    if getattr(p, EXPERT, False)]
    optimizers = [o for o in (opt, *stage_opts.values()) if o is not None]
    # What a checkpoint holds: with master weights, the float32 masters (the optimizer's parameters), not their
    # rounded copies.
    names = {id(grad_holder(p)): name for name, p in _named(job, chains)}
    state = {name: grad_holder(t) for name, t in _state_named(job, chains).items()}
    checkpointing, start, resumed_from = job.checkpoint, 0, None
    if checkpointing is not None and checkpointing.resume is not None:
        from pipefold.runtime.launch import checkpoint

        progress = checkpoint.load(checkpointing.resume, model=state, optimizers=optimizers, names=names,
                                   rank=global_rank, device=device, activity=activity)
        start, resumed_from = int(progress["step"]), checkpointing.resume.path
        current = int(progress.get("schedule_index") or 0)
        if masters is not None:
            masters.write_back()
        if scaler is not None and progress.get("loss_scale") is not None:
            scaler.load_state_dict({k: progress[f"loss_scale_{k}" if k != "scale" else "loss_scale"]
                                    for k in ("scale", "good", "skipped")})
    faults = job.faults or Faults()
    # extra["host_profile"], a folder: the steps after the first under cProfile, which follows the rank's own thread
    # (from Python 3.12 on, its other Python threads too); benchmarks/host_profile.py reads it
    profiler = cProfile.Profile() if job.extra.get("host_profile") else None
    bad_run, skipped, saved = 0, [], []
    small_grads = (0, 0)
    stopped = None
    for step in range(start, job.steps):
        activity.step = step_number(step)
        activity.grace = COMPILE_GRACE if compiling and step == start else 0.0  # compiled in its first passes
        activity.run("the batch", action=False)
        if faults.die == (step_number(step), "step") and global_rank == world - 1:
            os._exit(13)
        if job.cycle:
            current = (step - cycle_from) % len(choices)
        executor = executor_for(current)
        activity.run("the batch", action=False)
        started = time.perf_counter()
        x, y = job.batch_at(step)
        if job.parallel.dp > 1:  # this pipeline's shard of the global batch
            rows = copy // job.parallel.cp
            x, y = split_batch(x, job.parallel.dp)[rows], y.chunk(job.parallel.dp)[rows]
        if cp_group is not None:  # and its chunks of those sequences
            x = tuple(shard_sequence(t, job.parallel.cp, cp_rank) for t in as_tuple(x))
            y = shard_sequence(y, job.parallel.cp, cp_rank)
        low = precision.torch_dtype if masters is not None else None  # parameters in bf16: so are float inputs
        xs = split_batch(tuple(t.to(device, low) if low is not None and t.is_floating_point() else t.to(device)
                               for t in as_tuple(x)), m)
        ys = microbatches(y.to(device), m)
        if chunks > 1:  # each microbatch in its sequence chunks, the schedule's units
            xs, ys = split_units(xs, chunks), split_units(ys, chunks)
        if step_number(step) in faults.nan and xs[0][0].is_floating_point():
            poisoned = xs[0][0].clone()
            poisoned.view(-1)[0] = math.nan
            xs[0] = (poisoned, *xs[0][1:])
        for p in params:
            grad_holder(p).grad = None
        executor.loss_scale = scaler.scale if scaler is not None else 1.0
        if work is not None:
            work.record(job.save_grads_of_step == step)
        before = work.snapshot() if work is not None else None  # K-FAC's state, in case the step is skipped
        if balanced:
            begin_balance_step(modules.values())
        if job.verify_memory_step == step:
            stats = _tracked_step(pipe, current, params, xs, ys, _shapes(x))
        else:
            if profiler is not None and step > start:
                profiler.enable()
            stats = pipe.run(xs, ys, _shapes(x), index=current)
            if profiler is not None:
                profiler.disable()
        scheduled = time.perf_counter()
        for wrapper in offloaded:
            wrapper.evict_all()  # every layer home, with its gradient, before the optimizer reads it
        tied.reduce()  # copies of a shared weight on several stages: each gets the sum of their gradients
        if scaler is not None:
            unscale(params, scaler.scale)
        elif precision.dtype == "fp16":
            small = _small_grads(counted)
            small_grads = (small_grads[0] + small[0], small_grads[1] + small[1])
        _update(job, masters.masters if masters is not None else params, counted, opt, stage_opts, stage_snaps,
                stats, device, activity, everyone)
        if masters is not None and not stats.skipped:
            masters.write_back()
        if biased:  # the router biases move with the step, on the whole batch's counts
            step_router_biases(modules.values(), dp_group, apply=not stats.skipped)
        if isinstance(opt, ChunkedOptimizer):
            chunked = opt.memory()
            stats.state_bytes = (chunked.device, chunked.host)
        overflowed = False
        if scaler is not None:
            stats.loss_scale = scaler.scale
            # An inf in the scaled gradients of finite losses is the scale's overflow: the scale backs off, and it
            # is no sign of a bad run (while the scale can still back off).
            overflowed = stats.skipped and math.isfinite(stats.loss) and scaler.dynamic and scaler.scale > 1.0
            scaler.update(stats.skipped)
        stats.update = time.perf_counter() - scheduled
        if stats.skipped and work is not None and before is not None:
            work.restore(before)
        if job.save_grads_of_step == step:
            # With K-FAC, the gradients as the backward left them, before the schedule's KP preconditioned them.
            raw = work.raw_grads() if work is not None else {}
            held = {name: raw.get(id(p), grad_holder(p).grad) for name, p in _named(job, chains)}
            grads = {name: sharding.full(g).detach().to("cpu", torch.float32, copy=True)
                     for name, g in held.items() if g is not None}
            held_rows = [(job.extra["num_layers"] - 1, shard, shard_name)] if shard is not None else []
            held_rows += [(0, embedding, embedding_name)] if embedding is not None else []
            for layer, split, name in held_rows:
                if split.weight.grad is not None and split.real:
                    # The rows of the matrix this rank holds, named with them (the padding left out).
                    span = f"{layer}.{name}[{split.start}:{split.start + split.real}]"
                    grads[span] = split.weight.grad[:split.real].detach().to("cpu", torch.float32, copy=True)
        activity.run("the step's report", action=False)
        stats.schedule, stats.predicted = str(ScheduleRef.of(choices[current])), predicted
        stats.checked = step in keep  # the memory check's or --check's step: slower, and left out of timings
        history.add(stats)
        if job.refill is not None and 1 <= step < job.refill.after:
            learning.append((stats, choices[current]))
        if job.adaptive is not None:
            recent.append(stats)
        if on_step is not None and global_rank == 0:  # the global loss (every pipeline, replica): rank 0 knows it
            on_step(step_number(step), stats.loss, time.perf_counter() - started)
        if overflowed:
            skipped.append(step_number(step))
            if global_rank == 0:
                from pipefold.runtime.launch.checkpoint import warn

                warn(f"step {step_number(step)}: the fp16 gradients overflowed at loss scale {stats.loss_scale:g}; "
                     f"step skipped, the scale is now {stats.loss_scale * scaler.backoff:g}")
        elif stats.skipped:
            skipped.append(step_number(step))
            bad_run += 1
            if bad_run >= job.reliability.max_bad_steps:
                first, last = step_number(step - bad_run + 1), step_number(step)
                where = f"{bad_run} steps in a row (steps {first} to {last})" if bad_run > 1 else f"step {last}"
                scale = ", a lower --loss-scale" if scaler is not None else ""
                stopped = (f"the loss or the gradients were NaN or inf in {where}; the weights are those before "
                           f"step {first}: lower --lr, add --clip{scale}, or check the data")
                break
            if global_rank == 0:
                from pipefold.runtime.launch.checkpoint import warn

                scaled = f" (at the fixed loss scale {scaler.scale:g}: a lower one, or dynamic, may fit)" \
                    if scaler is not None and math.isfinite(stats.loss) else ""
                warn(f"step {step_number(step)}: the loss or a gradient is NaN or inf{scaled}; step skipped, weights "
                     "and "
                     f"optimizer state unchanged ({bad_run} in a row; the run stops at "
                     f"{job.reliability.max_bad_steps})")
        else:
            bad_run = 0
        if job.refill is not None and step + 1 == job.refill.after and step + 1 < job.steps:
            timed = unchecked(learning, [st.checked for st, _ in learning])
            activity.wait("placing K-FAC's work again", "every rank's times", everyone, action=False)
            filled = _refill(job.refill, [st for st, _ in timed], [ran for _, ran in timed], global_rank, world)
            learning.clear()
            choices, cycle_from = filled.cycle, step + 1
            pipe.switch(choices)
            if global_rank == 0:
                decisions.append((step + 1, filled))
        adaptive = job.adaptive
        if adaptive is not None and (step + 1) % adaptive.every == 0 and step + 1 < job.steps:
            optimizers = [o for o in (opt, *stage_opts.values()) if o is not None]
            plain = unchecked(list(recent), [st.checked for st in recent])
            summary = adaptive.summarize(plain, _static_bytes(params, optimizers))
            activity.wait("choosing the next schedule", "every rank's summary", everyone, action=False)
            gathered: list[Any] = [None] * world if global_rank == 0 else []
            dist.gather_object(summary, gathered if global_rank == 0 else None, dst=0)
            choice = adaptive.decide(current, gathered) if global_rank == 0 else None
            current, predicted, record = agree(choice)  # every rank switches at the same step boundary
            if global_rank == 0:
                decisions.append((step + 1, record))
        if checkpointing is not None and checkpointing.due(step + 1, job.steps):
            from pipefold.runtime.launch import checkpoint

            die = faults.die == (step + 1, "save") and global_rank == world - 1
            saved.append(checkpoint.save(checkpointing, step + 1, model=state, optimizers=optimizers, names=names,
                                         progress={"step": step + 1, "schedule_index": current,
                                                   **(_scaler_progress(scaler) if scaler else {})},
                                         rank=global_rank, device=device, activity=activity,
                                         written=(lambda: os.kill(os.getpid(), signal.SIGKILL)) if die else None,
                                         committing=(lambda: time.sleep(faults.slow_commit))
                                         if faults.slow_commit else None))
    activity.run("its report", action=False)
    if profiler is not None:
        profiler.dump_stats(Path(job.extra["host_profile"]) / f"rank{global_rank}.prof")
    gathered_bytes = sum(n for e in pipe.executors for n in e.gathered.values())
    pipe.close()
    if job.reliability.save_model is not None and stopped is None:
        activity.wait("the save of the model", "the gathering of its layers", everyone if global_rank == 0 else (0,),
                      action=False)
        activity.publish()
        _save_model(job, chains, job.reliability.save_model, global_rank, pipeline, world)
        activity.run("its report", action=False)
    resident = sum(w.tracker.peak_resident_bytes for w in offloaded)
    weights = ({name: sharding.full(p.detach()).to("cpu", copy=True) for name, p in _named(job, chains)}
               if job.save_weights else None)
    static = _static_bytes(params, optimizers) + (work.state_bytes() if work is not None else 0)
    report = RankReport(global_rank, history, grads, _peak_rss(), resident, weights, static,
                        decisions, pipeline, first_step=start, resumed_from=resumed_from, skipped=skipped,
                        stopped=stopped, checkpoints=saved,
                        gathered_bytes=gathered_bytes, small_grads=small_grads,
                        kfac=work.report(len(history)) if work is not None else None,
                        p2p="sockets" if sockets.current() is not None else str(dist.get_backend()))
    if out_dir is not None:
        with open(Path(out_dir) / f"rank{global_rank}.pkl", "wb") as fh:
            pickle.dump(report, fh)
    return report


def _mesh(job: Job, device_type: str, rank: int) -> tuple[Any, Any]:
    """The meshes (torch's DeviceMesh) of global ``rank``'s data-parallel copies and of its device's
    tensor-parallel ranks (None where that degree is 1), numbered as :meth:`Job.meshes` says. Each device has a
    (dp, tp) mesh of its own, as its degree may differ from the others'; every rank makes every process group, in
    the same order, as torch.distributed requires."""
    from torch.distributed.device_mesh import DeviceMesh

    meshes, dp = job.meshes(), job.parallel.copies
    copy, device, index = job.coords(rank)
    dp_group = tp_group = None
    for p, degree in enumerate(job.degrees):
        for t in range(degree if dp > 1 else 0):
            group = dist.new_group([meshes[d][p][t] for d in range(dp)])
            if (p, t) == (device, index):
                dp_group = group
        for d in range(dp if degree > 1 else 0):
            group = dist.new_group(meshes[d][p])
            if (d, p) == (copy, device):
                tp_group = group
    if dp_group is not None and tp_group is not None:
        grid = torch.tensor([meshes[d][device] for d in range(dp)])
        both = DeviceMesh.from_group([dp_group, tp_group], device_type, grid, mesh_dim_names=("dp", "tp"))
        return both["dp"], both["tp"]
    return (None if dp_group is None else DeviceMesh.from_group(dp_group, device_type, mesh_dim_names=("dp",)),
            None if tp_group is None else DeviceMesh.from_group(tp_group, device_type, mesh_dim_names=("tp",)))


def _partial_backward(job: Job, rank: int, chains: dict[int, nn.Module]) -> Reduction:
    """Structured partial backpropagation: global ``rank``'s copy's first layers (all but its last ``spb[copy]`` of
    the model, inside the first stage) run without autograd; returns how its data-parallel reduction moves each
    gradient among the copies that computed its layer (:class:`pipefold.runtime.partial.Reduction`), with the
    process groups that takes, which every rank makes for every device, in the same order, as torch.distributed
    requires."""
    from pipefold.plan.spb import groups
    from pipefold.runtime import partial

    spb = job.parallel.spb
    assert spb is not None and job.parallel.copies == len(spb)  # no context-parallel copies with SPB
    layers, meshes = job.extra["num_layers"], job.meshes()
    copy, device, _ = job.coords(rank)
    if 0 in chains:
        partial.cut(chains[0], layers - spb[copy])
    mine: dict[tuple[int, ...], Any] = {}
    for p in range(len(job.degrees)):
        ranks = [meshes[d][p][0] for d in range(len(spb))]
        held = [layer for s in job.schedule.stages_of(p) for layer in job.layer_stages[s]]
        for members in groups(spb, held, layers):
            group = dist.new_group([ranks[i] for i in members])
            if p == device:
                mine[members] = group
    return partial.Reduction(spb, layers, partial.layers_of(chains, {s: job.layer_stages[s][0] for s in chains}),
                             tuple(meshes[d][device][0] for d in range(len(spb))), copy, mine)


def _kfac_copies(job: Job, rank: int) -> dict[int, Any]:
    """K-FAC's data-parallel copies of each stage of global ``rank``'s device (:class:`~pipefold.runtime.curvature.
    Copies`): a process group of their own per device (its collectives never queue behind the gradients'
    all-reduce), which every rank makes, in the same order, as torch.distributed requires; with DP-KFAC, the
    owner of each layer (``job.extra["kfac_owners"]``, decided where the job was made)."""
    from pipefold.runtime.curvature import Copies

    assert job.optimizer.kfac is not None
    meshes, dp = job.meshes(), job.parallel.copies
    copy, device, _ = job.coords(rank)
    mine: Any = None
    ranks: tuple[int, ...] = ()
    for p in range(len(job.degrees)):
        members = [meshes[d][p][0] for d in range(dp)]
        group = dist.new_group(members)
        if p == device:
            mine, ranks = group, tuple(members)
    distribution = job.optimizer.kfac.distribution
    owners = job.extra.get("kfac_owners", {})
    return {s: Copies(group=mine, ranks=ranks, me=copy, distribution=distribution, owners=tuple(owners.get(s, ())))
            for s in job.schedule.stages_of(device)}


def _cp_group(job: Job, rank: int) -> Any:
    """The process group of global ``rank``'s context-parallel ring: the copies of its data-parallel copy, on its
    device and tensor-parallel rank. Every rank makes every ring, in the same order, as torch.distributed
    requires."""
    meshes, cp = job.meshes(), job.parallel.cp
    copy, device, index = job.coords(rank)
    mine = None
    for d in range(job.parallel.dp):
        for p, degree in enumerate(job.degrees):
            for t in range(degree):
                group = dist.new_group([meshes[d * cp + j][p][t] for j in range(cp)])
                if (d, p, t) == (copy // cp, device, index):
                    mine = group
    return mine


def _refill(refill: Refill, steps: list[StepStats], ran: list[Schedule], rank: int, world: int) -> Filled:
    """Every rank's measured times to rank 0, which places K-FAC's work again; the new placement to every rank.

    ``steps`` are this rank's steps to learn from and ``ran`` the schedule each of them ran.
    """
    from pipefold.runtime.executor import kind_times

    mine = (kind_times(steps), [(st.started_at, st.wall) for st in steps])  # each rank times its own stages
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    filled = None
    if rank == 0:
        times = {s: t for each, _ in gathered for s, t in each.items()}
        # A step lasts from the first rank's start to the last rank's end.
        walls = [max(a + w for a, w in spans) - min(a for a, _ in spans)
                 for spans in zip(*(spans for _, spans in gathered), strict=True)]
        filled = refill.plan(times, list(zip(ran, walls, strict=True)))
    return agree(filled)


def _tracked_step(pipe: RankPipeline, index: int, params: list[nn.Parameter], xs: list[Tensors],
                  ys: list[torch.Tensor], shape: Any) -> StepStats:
    """One step under torch's MemTracker too, which sees every tensor an operation returns and follows its
    storage until it dies, whatever the runtime meant to keep; ``stats.memory_check`` gets its figures.

    After every action both are read: what the meter says the rank holds, and what the tracker has
    seen created during the step and still alive (between actions, an operation's temporaries are
    gone). Within an action the tracker also sees those temporaries, so its peak over the whole step
    (``tracker_peak``) is the meter's plus the largest temporaries at that moment. The parameters,
    their gradients (made as zeros before the step: adding into a zero gradient gives the same values
    bit for bit) and the batch are registered with it first, so that only what the step itself holds
    counts. On CUDA the allocator's own peak over the step is recorded as well (``allocator_peak``).
    """
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    except ImportError as exc:  # torch < 2.5
        raise ConfigError(f"checking memory needs torch.distributed._tools.mem_tracker (torch >= 2.5): {exc}") from exc

    class NoModules:
        """Stands in for MemTracker's module tracker: its per-module statistics allow a module one forward per
        step (a stage runs one per microbatch) and its backward hooks do not work under ``autograd.grad``,
        which B uses. The device totals need none of it."""

        is_bw = False
        parents = {"Global"}

        def register_user_hooks(self, *args: Any) -> None:
            pass

        def clear_user_hooks(self) -> None:
            pass

        def __enter__(self) -> NoModules:
            return self

        def __exit__(self, *args: Any) -> None:
            pass

    executor = pipe.executor(index)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    cuda = executor.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(executor.device)
        torch.cuda.reset_peak_memory_stats(executor.device)
        before = torch.cuda.memory_allocated(executor.device)
    tracker = MemTracker()
    tracker._mod_tracker = NoModules()  # type: ignore[assignment]
    outside = {_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.OPT, _MemRefType.OTH}

    here = executor.device

    def mine(d: torch.device) -> bool:
        return d.type == here.type and (here.index is None or d.index in (None, here.index))

    def step_bytes(snapshot: dict[torch.device, dict[Any, int]], moved: int = 0, *, elsewhere: bool = False) -> int:
        # The meter counts the device's memory: on a GPU, what the step holds in host memory (a message staged
        # through pinned memory, on its way out or in) is another device's, counted apart.
        total = sum(snap["Total"] - sum(v for k, v in snap.items() if k in outside)
                    for d, snap in snapshot.items() if mine(d) != elsewhere)
        return total - (0 if elsewhere else moved)

    pairs: list[tuple[int, int]] = []  # (meter, tracker) after each action
    away: list[int] = []  # the tracker's bytes on other devices (host memory, for a GPU's ranks), after each action
    allocated: list[int] = []  # on CUDA, the allocator's bytes beyond those before the step, after each action

    def probe() -> None:
        # A link's thread may drop a delivered send between two reads: read again until the tracker holds still.
        for _ in range(10):
            # Gradients moved into an all-reduce's one buffer (comm.FlatAllReduce) freed the storages registered as
            # theirs: the buffer, new in the step, is still theirs, not the step's.
            first = step_bytes(tracker.get_tracker_snapshot(), executor.grads_moved)
            held = executor.meter.current
            snapshot = tracker.get_tracker_snapshot()
            after = step_bytes(snapshot, executor.grads_moved)
            if first == after:
                break
        pairs.append((held, after))
        away.append(step_bytes(snapshot, elsewhere=True))
        if cuda:
            allocated.append(torch.cuda.memory_allocated(executor.device) - before)

    with tracker:
        # What lives from step to step (parameters, gradients, K-FAC's state) is not the step's memory.
        state = executor.work.state() if executor.work is not None else []
        tracker.track_external(*executor.modules(), *(t for mb in xs for t in mb), *ys,
                               *(p.grad for p in params if p.grad is not None), *state)
        stats = pipe.run(xs, ys, shape, index=index, probe=probe)
    stats.memory_check = {
        "meter_between_actions": max(m for m, _ in pairs),
        "tracker_between_actions": max(t for _, t in pairs),
        "largest_gap": max(abs(m - t) for m, t in pairs),
        "tracker_peak": step_bytes(tracker.get_tracker_snapshot("peak")),
        "tracker_elsewhere_between_actions": max(away),
    }
    if cuda:
        torch.cuda.synchronize(executor.device)
        stats.memory_check["allocator_peak"] = torch.cuda.max_memory_allocated(executor.device) - before
        stats.memory_check["allocator_between_actions"] = max(allocated)
    return stats


def _state_named(job: Job, modules: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """Parameters and buffers named by model layer index, as the plain model ``nn.Sequential(*layers)`` names them."""
    out = {}
    for s, module in modules.items():
        for pos, layer in enumerate(module.children()):
            index = job.layer_stages[s][pos]
            out.update({f"{index}.{name}": t for name, t in layer.state_dict(keep_vars=True).items()})
    return out


def _save_model(job: Job, modules: dict[int, nn.Module], path: str, global_rank: int, pipeline: int,
                world: int) -> None:
    """Gather the first pipeline's layers on rank 0, which writes the whole model's state_dict to ``path``
    (a temporary file beside it, then a rename)."""
    mine: dict[int, dict[str, torch.Tensor]] = {}
    for s, module in modules.items():
        for pos, layer in enumerate(module.children()):
            # With FSDP each copy gathers its shards (a collective of every pipeline); the first one keeps them.
            whole = {k: sharding.full(grad_holder(v).detach()).cpu()  # float32 masters, where there are
                     for k, v in layer.state_dict(keep_vars=True).items()}
            if pipeline == 0:
                mine[job.layer_stages[s][pos]] = whole
    gathered: list[Any] = [None] * world if global_rank == 0 else []
    dist.gather_object(mine, gathered if global_rank == 0 else None, dst=0)
    if global_rank != 0:
        return
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for part in gathered:
        layers.update(part)  # a stage held by several ranks (replicas) holds the same weights
    full = {f"{i}.{k}": v for i in sorted(layers) for k, v in layers[i].items()}
    from pipefold.files import atomic

    with atomic(path, binary=True) as fh:
        torch.save(full, fh)


def _named(job: Job, modules: dict[int, nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters named by model layer index, so the launcher can match them with a reference model."""
    out = []
    for s, module in modules.items():
        for pos, layer in enumerate(module.children()):
            index = job.layer_stages[s][pos]
            out += [(f"{index}.{name}", p) for name, p in layer.named_parameters()]
    return out


def _optimizer(job: Job, params: list[Any], dp_group: Any = None, pipe: RankPipeline | None = None,
               masters: Masters | None = None) -> AnyOptimizer | None:
    """``make``'s optimizer over ``params`` (with ``masters``, their float32 masters): model-state chunks, ZeRO-1's
    share or the plain one."""
    if not params:
        return None  # a rank whose stages have no weights has nothing to step
    if job.chunks is not None and pipe is not None:
        held = [p for p, _ in masters.pairs] if masters is not None else params  # what the device holds
        from pipefold.models.size import available_memory
        from pipefold.runtime.chunks import left_free

        budget = job.chunks.device_memory
        # The ranks of this machine share its host memory.
        free_host = available_memory()
        here = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        return ChunkedOptimizer(params, job.optimizer.make, capacity=job.chunks.capacity,
                                free=None if budget is None else lambda: left_free(budget, held, pipe.last),
                                device_room=None if budget is None else left_free(budget, held, None),
                                host_memory=None if free_host is None else free_host / here,
                                group=dp_group if job.parallel.zero1 else None, masters=masters)
    if job.parallel.zero1 and dp_group is not None:
        # ZeRO-1: each copy of a stage keeps the optimizer state of its share of the parameters, steps them,
        # and sends them to the other copies.
        return ShardedOptimizer(params, job.optimizer.make, dp_group)
    return job.optimizer.make(params)


def _scaler_progress(scaler: LossScaler) -> dict[str, Any]:
    """The loss scale's state as a checkpoint's progress keeps it (flat numbers)."""
    state = scaler.state_dict()
    return {"loss_scale": state["scale"], "loss_scale_good": state["good"], "loss_scale_skipped": state["skipped"]}


def _small_grads(params: list[nn.Parameter]) -> tuple[int, int]:
    """(entries below fp16's smallest normal number, nonzero entries) of these parameters' gradients."""
    small = nonzero = 0
    for p in params:
        g = grad_holder(p).grad
        if g is not None:
            g = sharding.local(g).detach().abs()
            nz = g > 0
            nonzero += int(nz.sum())
            small += int((nz & (g < 2.0 ** -14)).sum())
    return small, nonzero


def _nothing() -> None:
    """The optimizer step of a stage without weights."""


def _speculative(stage: int, opt: AnyOptimizer | None, module: nn.Module,
                 snapshots: dict[int, numerics.Snapshot]) -> Callable[[], None]:
    """The step a schedule's OPT action of ``stage`` runs: a copy of the stage's state first, then the step, which
    the global check after the step validates (and rolls back with the copy when it fails)."""
    if opt is None:
        return _nothing

    def step() -> None:
        snapshots[stage] = numerics.Snapshot(list(module.parameters()), [opt])
        opt.step()
    return step


def _update(job: Job, params: list[Any], counted: list[nn.Parameter], opt: AnyOptimizer | None,
            stage_opts: dict[int, AnyOptimizer | None], stage_snaps: dict[int, numerics.Snapshot],
            stats: StepStats, device: torch.device, activity: Activity, everyone: tuple[int, ...]) -> None:
    """After the step's passes: the global NaN/inf and norm check (one all-reduce), then the optimizer step,
    clipped, or skipped when the step is bad (see :mod:`pipefold.runtime.numerics`).

    Without post-validation the optimizer waits for the check. With it (``job.reliability.post_validate``), and always
    when the schedule's OPT actions have stepped already, the step is taken first and rolled back when the
    check says it was bad or needed clipping. ``stats`` gets the norm and what happened; ``activity`` the phase
    (``the step's check`` while it waits for the all-reduce, then ``the optimizer step``).
    """
    check = local_check(counted, stats.losses.values(), device)
    speculative = None
    waiting = ("the step's check", "the all-reduce of the gradient norm", everyone)
    if opt is not None and job.reliability.post_validate:
        pending = dist.all_reduce(check, async_op=True)
        activity.run("the optimizer step", action=False)
        speculative = numerics.Snapshot(params, [opt])
        opt.step()  # while the check is in flight
        activity.wait(*waiting, action=False)
        pending.wait()
    else:
        activity.wait(*waiting, action=False)
        dist.all_reduce(check)
    activity.run("the optimizer step", action=False)
    stepped = speculative is not None or bool(stage_snaps)
    norm, bad, stats.loss = verdict(check)
    factor = None if bad else clip_factor(norm, job.optimizer.clip)
    stats.grad_norm, stats.skipped, stats.clipped = norm, bad, factor is not None
    if stepped and (bad or factor is not None):
        for snap in (speculative, *stage_snaps.values()):
            if snap is not None:
                snap.restore()
        stats.rolled_back = True
    stage_snaps.clear()
    if bad or (stepped and factor is None):
        return
    if factor is not None:
        scale_grads(params, factor)
    for each in (opt, *stage_opts.values()):
        if each is not None:
            each.step()


def _static_bytes(params: list[nn.Parameter], optimizers: list[AnyOptimizer]) -> int:
    """Bytes of the distinct storages of the parameters, their gradients (with master weights, the float32 masters
    and theirs) and every tensor in the optimizers' state (ZeRO-1's share's; FSDP's state is sharded)."""
    chunked = [o for o in optimizers if isinstance(o, ChunkedOptimizer)]
    # Masters in model-state chunks are the chunks' buffers: counted with them where they are on the device.
    masters = [] if any(o.masters is not None for o in chunked) else [
        m for p in params if (m := grad_holder(p)) is not p]
    tensors = [sharding.local(t) for p in (*params, *masters) for t in (p, p.grad) if t is not None]
    # Model-state chunks: the state of those on the device (the host's are in host memory).
    tensors += [t for o in optimizers if isinstance(o, ChunkedOptimizer) for t in o.device_buffers()]
    plain = [o for o in optimizers if not isinstance(o, ChunkedOptimizer)]
    tensors += [sharding.local(v) for o in holding(plain) for state in o.state.values()
                for v in state.values() if isinstance(v, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def _peak_rss() -> int:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


def agree(value: Any, src: int = 0) -> Any:
    """Every rank gets rank ``src``'s ``value`` (any picklable object)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]

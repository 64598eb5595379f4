"""From a run spec to the job every rank runs: the model, the split of its layers into stages, the recomputation
plan, K-FAC's placement, the checkpoint to start from (:func:`make_job`).

Splitting by time or memory, planning recomputation and placing K-FAC's work measure the model here, once; a
process that did not measure takes another's decisions (``decided``, ``placed``), so that every rank of one job
runs the same split.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule
from pipefold.models import REGISTRY, Model, split_layers
from pipefold.plan.recompute import RecomputePlan, plan_recompute
from pipefold.runtime.launch.checkpoint import Checkpointing
from pipefold.runtime.launch.job import Adaptive, Job, local_placement
from pipefold.runtime.launch.processes import COMPILER, start_server, under_torchrun
from pipefold.runtime.launch.settings import StateChunks
from pipefold.runtime.stage import Chain, split_batch
from pipefold.train.spec import RunSpec

__all__ = ["JOB_HOOKS", "Decisions", "check_links", "check_size", "make_job", "model_of", "restarted"]

Decisions = tuple[tuple[tuple[int, ...], ...], RecomputePlan | None]
"""What make_job measures and decides: the layers of each stage and the recomputation plan."""


JOB_HOOKS: list[Callable[[Job], Job]] = []
"""Functions every job made by :func:`make_job` passes through, in order: the way in for what the command line
does not set (the tests' injected faults, :mod:`pipefold.runtime.launch.faults`). Empty in normal use."""


def model_of(spec: RunSpec, stages: int) -> Model:
    """The registered model the run trains on ``stages`` stages, with its data (:mod:`pipefold.models.base`)."""
    m = spec.model
    return REGISTRY[m.name].make(dataclasses.replace(m.args, layers=m.layers_for(stages)))


def make_job(spec: RunSpec, *, decided: Decisions | None = None, placed: Any = None,
             checkpointing: Checkpointing | None = None, local: bool = False) -> Job:
    """The job every rank of ``spec`` runs.

    ``decided`` passes in the split and recomputation that another process measured; ``placed``, with K-FAC, the
    placement of its work (a :class:`~pipefold.plan.pipefisher.Filled`) that another process made;
    ``checkpointing`` the checkpoint folder and the checkpoint to resume that another process found (else they
    come from ``spec``, and finding the checkpoint reads the folder). ``local``: the ranks will be started here,
    from a fork server that this starts as soon as the model is known, so that its imports run on another core
    while this process measures the model.
    """
    if spec.planned:
        raise ConfigError("a planned run is resolved first: pipefold.train.planned.resolve(spec)")
    schedule = spec.schedule.built
    where = local_placement(spec.devices.device, spec.devices.backend,
                            spec.parallel.copies * sum(spec.parallel.degrees(schedule.devices)))
    spec.devices.precision.check_device(torch.device(where.device))  # a dtype the device cannot compute in
    if where.device == "cuda" and (spec.links.network is not None or spec.links.netns):
        raise ConfigError("--network and --netns emulate links between CPU ranks over gloo: use --device cpu with "
                          "them")
    model = model_of(spec, schedule.stages)
    check_links(spec, model, schedule)
    preload = (*model.preload, *(COMPILER if spec.devices.compile is not None else ()))
    if local:
        start_server(preload)
    kfac = spec.optimizer.kfac
    check_size(spec, model, schedule, builds_model=decided is None or placed is None and kfac is not None,
               gpus=where.gpus)
    _check_chunk_size(spec, model)
    if checkpointing is None:
        checkpointing = _checkpointing(spec, schedule)
    if schedule.stages > model.num_layers:
        per_device = schedule.stages // schedule.devices
        raise ConfigError(f"{spec.schedule.name} on {schedule.devices} devices has {schedule.stages} stages but the "
                          f"model has {model.num_layers} layers, so at most {model.num_layers} stages: use --devices "
                          f"{max(1, model.num_layers // per_device)} or fewer, or more --layers")
    extra: dict[str, Any] = {"num_layers": model.num_layers}
    adaptive = _adaptive(spec) if spec.schedule.adaptive else None
    plan = None
    if decided is not None:
        layer_stages, plan = decided
    else:
        layer_stages = _layer_stages(spec, model, schedule, where.device_of(0))
        # With state chunks the budget is the device memory they fill (after the activations), not a target to fit
        # the activations to.
        if spec.memory.recompute != "none" or (spec.memory.budget is not None and adaptive is None
                                               and not spec.memory.state_chunks):
            plan = _plan_recompute(spec, schedule, layer_stages, model)
    if spec.parallel.spb is not None:
        _check_spb(spec, model, schedule, layer_stages)
    if spec.parallel.ep > 1:
        model.check_expert_parallel(spec.parallel.ep, spec.parallel.dp)
    if spec.parallel.ep_overlap:
        from pipefold.runtime.experts import check_overlap

        check_overlap(schedule, "--ep-overlap", recompute=plan is not None and any(plan.layers))
    if balanced := set(model.balanced_layers()):  # a loss over the whole batch: every forward first
        from pipefold.runtime.experts import check_balance_order

        check_balance_order(schedule, [s for s, part in enumerate(layer_stages) if balanced & set(part)])
    recompute = None
    if plan is not None:
        recompute, extra["recompute"] = plan.layers, plan
    cycle: tuple[Schedule, ...] = ()
    refill = None
    if kfac is not None:
        filled = placed or _kfac_cycle(spec, schedule, layer_stages, model, kfac, extra)
        cycle = filled.cycle
        schedule, extra["pipefisher"] = cycle[0], filled
        if spec.optimizer.fill_bubbles:
            # The gaps of the step the ranks really run: placed again from their own times after the first cycle.
            from pipefold.plan.pipefisher import Refill

            refill = Refill(after=len(cycle) + 1, schedule=filled.base.schedule, cost=filled.base.cost,
                            g_from_w=extra.get("kfac_g_from_w", frozenset()), data_parallel=spec.parallel.copies > 1)
    if spec.memory.activation_share:
        schedule, extra["offload_activations"] = _offload_activations(schedule, spec.memory.activation_share)
    if spec.parallel.cp > 1:
        model.check_context_parallel(spec.parallel.cp)
    if schedule.seq_chunks > 1:
        _check_sequence_chunks(spec, model, schedule.seq_chunks)
    if schedule.vocab:
        _check_vocab(spec, model)
        shape = model.size()
        if shape is not None:  # the output's vocabulary, which the shards pad to a multiple of the devices
            extra["vocab_size"] = shape.vocab
        extra["vocab_embedding"] = model.splits_embedding
    if spec.parallel.copies > 1:
        from pipefold.schedules.dataparallel import with_data_parallel

        # Each stage's gradients averaged across the pipelines; with FSDP, each stage sharded across them; K-FAC's
        # every schedule of its cycle.
        schedule = with_data_parallel(schedule, shard=spec.parallel.fsdp)
        cycle = tuple(with_data_parallel(each, shard=spec.parallel.fsdp) for each in cycle)
    tp_plan: dict[int, dict[str, str]] = {}
    for degree in sorted(set(spec.parallel.degrees(schedule.devices)) - {1}):  # each degree checked against the model
        tp_plan = model.tp_plans(degree, spec.parallel.sequence_parallel)
    job = Job(schedule=schedule, layer_stages=layer_stages, build_layers=model.build_layers, loss_fn=model.loss,
              batch_at=model.batch_at, steps=spec.steps, optimizer=spec.optimizer, parallel=spec.parallel,
              reliability=spec.reliability, devices=spec.devices, save_grads_of_step=0 if spec.check else None,
              offload=spec.memory.offloaded, recompute=recompute, chunks=_chunks(spec), extra=extra,
              network=spec.links.parsed,
              adaptive=adaptive, cycle=cycle, refill=refill, tied=model.tied, preload=preload,
              checkpoint=checkpointing, tp_plan=tp_plan,
              split_output=model.split_output if schedule.vocab else None,
              split_input=model.split_input if schedule.vocab else None)
    for hook in JOB_HOOKS:
        job = hook(job)
    return job


def _check_chunk_size(spec: RunSpec, model: Model) -> None:
    """Refuse, before any rank starts, a ``--chunk-size`` smaller than the model's largest parameter (its layers
    built with fake tensors: shapes, no memory, no values). A model that cannot be built so is left to the ranks'
    own refusal."""
    capacity = spec.memory.chunk_elements
    if not spec.memory.state_chunks or capacity is None:
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipefold.plan.chunks import pack

    try:
        with FakeTensorMode():
            sizes = [p.numel() for layer in model.build() for p in layer.parameters()]
    except Exception:  # noqa: BLE001  # a model's own construction under fake tensors: the ranks check it
        return
    try:
        pack(sizes, capacity)
    except ConfigError:
        largest = max(sizes)
        raise ConfigError(f"--chunk-size {spec.memory.chunk_size:,.0f} holds {capacity:,} float32 values and the "
                          f"model's largest parameter has {largest:,}: give --chunk-size {4 * largest} or more") \
            from None


def _chunks(spec: RunSpec) -> StateChunks | None:
    """The model-state chunks a run asks for (``--state-chunks``), filling ``--memory-budget``."""
    if not spec.memory.state_chunks:
        return None
    return StateChunks(capacity=spec.memory.chunk_elements, device_memory=spec.memory.budget)


def _offload_activations(schedule: Schedule, share: float) -> tuple[Schedule, dict[str, int]]:
    """The schedule with ``share`` of its (stage, microbatch)s offloaded, the longest-lived first, and how many of
    how many: each reload timed for a copy as long as a forward (:data:`COPY_LIKE_A_FORWARD`)."""
    from pipefold.plan.activation_offload import COPY_LIKE_A_FORWARD, offload_fraction

    choice = offload_fraction(schedule, share, COPY_LIKE_A_FORWARD)
    return choice.schedule, {"pairs": len(choice.pairs), "of": choice.offloadable}


def _adaptive(spec: RunSpec) -> Adaptive:
    """kFkB for every k that divides the microbatches (``max_k`` caps it), rank 0 choosing every few steps."""
    from pipefold.plan import adapt

    s = spec.schedule
    ks = s.candidates
    policy = adapt.Policy(s.devices, s.microbatches, ks, spec.memory.budget)
    return Adaptive((s.built, *adapt.build(s.devices, s.microbatches, ks[1:])), s.adapt_every, adapt.summarize,
                    policy.runtime_decide)


def check_size(spec: RunSpec, model: Model, schedule: Schedule, *, builds_model: bool = True,
               gpus: int = 0) -> None:
    """Refuse, before any layer is built, a run this machine cannot hold or would take minutes per step on
    (see :mod:`pipefold.models.size`): the processes that start here, the parameters as often as they are held
    (weights, gradients, optimizer state on every copy of a stage; the whole model once more in this process when
    it measures the layers, ``builds_model``) and one microbatch's activations. A model that gives no size
    (:meth:`~pipefold.models.base.Model.size`) is not checked."""
    from pipefold.models.size import check_model

    dp = spec.parallel.copies
    held = (2 + spec.optimizer.state_factor) * schedule.replicas * dp
    ranks = schedule.devices * dp
    if under_torchrun():  # only this machine's ranks, and their share of the model
        here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        held, ranks = held * here / max(1, int(os.environ.get("WORLD_SIZE", "1"))), here
    memory = spec.memory
    measures = builds_model and (memory.partition != "even" or memory.recompute != "none"
                                 or spec.optimizer.name == "kfac"
                                 or (memory.budget is not None and not memory.state_chunks))
    gpu = (min(gpus, ranks), torch.cuda.get_device_properties(0).total_memory) if gpus else None
    check_model(model, gpu=gpu, microbatches=schedule.data_microbatches * dp, ranks=ranks, copies=held,
                measures=measures, what=f"training {spec.model.name}")


def _check_sequence_chunks(spec: RunSpec, model: Model, chunks: int) -> None:
    """Refuse in one line what sequence chunks do not run with yet, then what the model cannot cut."""
    _not_yet(f"sequence chunks (seq_chunks {chunks}) do not run", "use a schedule without seq_chunks", (
        (f"--cp {spec.parallel.cp}", spec.parallel.cp > 1),
        (f"--tp {spec.parallel.tp_text}", spec.parallel.tensor_parallel),
        ("--optimizer kfac", spec.optimizer.name == "kfac"), (f"--recompute {spec.memory.recompute}",
                                                              spec.memory.recompute != "none"),
        ("--offload", spec.memory.offloaded is not None),
        ("--offload-activations", bool(spec.memory.activation_share))))
    model.check_sequence_chunks(chunks)


def _check_vocab(spec: RunSpec, model: Model) -> None:
    """Refuse in one line what the output layer split by vocabulary does not run with yet, then a model that
    declares no output projection to split."""
    _not_yet("the output layer split by vocabulary (vocab=1) does not run", "use a schedule without vocab=1", (
        (f"--dp {spec.parallel.dp}", spec.parallel.dp > 1), (f"--cp {spec.parallel.cp}", spec.parallel.cp > 1),
        (f"--tp {spec.parallel.tp_text}", spec.parallel.tensor_parallel),
        ("--optimizer kfac", spec.optimizer.name == "kfac"), ("--offload", spec.memory.offloaded is not None),
        ("--offload-activations", bool(spec.memory.activation_share)),
        ("--state-chunks", spec.memory.state_chunks),
        (f"--precision {spec.devices.precision.dtype}", spec.devices.precision.dtype != "fp32"),
        ("--checkpoint-dir", spec.checkpoints.any), ("--save-model", spec.reliability.save_model is not None)))
    model.check_split_output()


def _check_spb(spec: RunSpec, model: Model, schedule: Schedule, layer_stages: tuple[tuple[int, ...], ...]) -> None:
    """Refuse in one line what structured partial backpropagation does not run with yet, a split that leaves a layer
    with no copy computing it, and a copy's cut past the first stage (whose input needs no gradient: a cut inside it
    leaves every other stage's backward as it is)."""
    spb = spec.parallel.spb
    assert spb is not None
    text = ",".join(map(str, spb))
    _not_yet(f"structured partial backpropagation (--spb {text}) does not run", "use every layer's backward", (
        (f"--tp {spec.parallel.tp_text}", spec.parallel.tensor_parallel), (f"--cp {spec.parallel.cp}",
                                                                           spec.parallel.cp > 1),
        ("--fsdp", spec.parallel.fsdp), ("--optimizer kfac", spec.optimizer.name == "kfac"),
        (f"--recompute {spec.memory.recompute}", spec.memory.recompute != "none"),
        ("--offload", spec.memory.offloaded is not None),
        ("--offload-activations", bool(spec.memory.activation_share)), ("--state-chunks", spec.memory.state_chunks),
        ("--compile", spec.devices.compile is not None), ("a schedule with vocab=1", schedule.vocab),
        (f"seq_chunks {schedule.seq_chunks}", schedule.seq_chunks > 1),
        ("a schedule with OPT actions", any(a.kind == Kind.OPT for row in schedule.actions for a in row))))
    from pipefold.plan.spb import check

    check(spb, model.num_layers, len(layer_stages[0]))


def _not_yet(what: str, instead: str, given: Iterable[tuple[str, bool]]) -> None:
    """Refuse in one line the first setting of ``given`` (its flag, whether it is on) that is on: ``what`` with it
    yet; drop it, or ``instead``."""
    flag = next((flag for flag, on in given if on), None)
    if flag is not None:
        raise ConfigError(f"{what} with {flag} yet: drop it, or {instead}")


def check_links(spec: RunSpec, model: Model, schedule: Schedule) -> None:
    """Refuse, before any process starts, a ``--network`` on which a message between two stages takes longer than
    ``--action-timeout`` at every moment (:func:`pipefold.runtime.slowlinks.check_network`): its receiver would
    be taken as hung. A message's bytes are the model's hidden state for one microbatch
    (:func:`pipefold.models.size.boundary_bytes`); in a lower precision than float32 two bytes a value, the least
    it has (a layer under autocast may still pass float32); a model that gives no size is checked on the latency
    alone."""
    network = spec.links.parsed
    if network is None:
        return
    from pipefold.models.size import boundary_bytes
    from pipefold.runtime.slowlinks import check_network, stage_messages

    shape = model.size()
    nbytes = 0
    exact = spec.devices.precision.dtype == "fp32"
    if shape is not None:
        rows = shape.batch // (spec.parallel.dp * schedule.data_microbatches)
        nbytes = boundary_bytes(shape, rows, 4 if exact else 2)
    flag = f"--network {spec.links.network}" + (" with --netns" if spec.links.netns else "")
    check_network(network, spec.reliability.action_timeout, stage_messages(schedule, nbytes), flag=flag,
                  latency=not spec.links.netns, exact=exact)


def restarted() -> bool:
    """Whether torchrun restarted this process's workers after a failure (``--max-restarts``)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    except ValueError:
        return False


def _checkpointing(spec: RunSpec, schedule: Schedule) -> Checkpointing | None:
    """The checkpoint folder (made if needed) and the checkpoint to start from: the one ``--resume`` names, or
    the newest good one; after torchrun restarted the workers, the newest good one if there is any."""
    from pipefold.runtime.launch import checkpoint

    c = spec.checkpoints
    if not c.any:
        return None
    directory = checkpoint.prepare(c.checkpoint_dir) if c.checkpoint_dir is not None else None
    m = spec.model
    identity: dict[str, Any] = {"model": m.name, "layers": m.layers_for(schedule.stages), "hidden": m.hidden,
                                "heads": m.heads, "seq": m.seq, "model_config": m.config,
                                "optimizer": spec.optimizer.name}
    resume = None
    if c.resume is not None:
        where = c.resume or directory
        if where is None:
            raise ConfigError("--resume needs --checkpoint-dir D, or the checkpoint to start from: "
                              "--resume D/step-00000004")
        resume = checkpoint.find(where)
    elif directory is not None and restarted():
        resume = checkpoint.find(directory, required=False)
        if resume is None:
            checkpoint.note(f"restarted by torchrun with no good checkpoint in {directory} yet: starting over")
    if resume is not None:
        checkpoint.check_identity(resume, identity, spec.steps)
        checkpoint.note(f"resuming from {resume.path} ({resume.step} steps done)")
    return checkpoint.Checkpointing(directory=directory, every=c.checkpoint_every, resume=resume,
                                    keep_last=c.keep_last, identity=identity)


def _first_microbatch(spec: RunSpec, model: Model) -> tuple[Any, torch.Tensor]:
    """A microbatch of a pipeline's shard of the first step: what the measurements run on."""
    x, y = model.batch_at(0)
    n = spec.parallel.dp * spec.schedule.microbatches
    return split_batch(x, n)[0], y.chunk(n)[0]


def _stages(layer_stages: tuple[tuple[int, ...], ...], model: Model) -> list[Chain]:
    layers = model.build_layers([i for part in layer_stages for i in part])
    return [Chain(*(layers[i] for i in part)) for part in layer_stages]


def _kfac_cycle(spec: RunSpec, schedule: Schedule, layer_stages: tuple[tuple[int, ...], ...], model: Model,
                kfac: Any, extra: dict[str, Any]) -> Any:
    """Measure every stage's passes and K-FAC work on the first microbatch, then place the work: in the bubbles of
    the simulated step (``fill_bubbles``), or right after the passes it reads. With DP-KFAC over data-parallel
    copies, each device's layers go to the copies by their measured seconds (``extra["kfac_owners"]``, per stage
    the copy of each of its K-FAC layers)."""
    from pipefold.plan import pipefisher
    from pipefold.runtime.curvature import measure
    from pipefold.sim.simulate import CostModel, StageOverride

    x, y = _first_microbatch(spec, model)
    stages = _stages(layer_stages, model)
    owned = spec.parallel.copies > 1 and kfac.distribution == "dp-kfac"
    rows = measure(stages, x, y, model.loss, microbatches=spec.schedule.microbatches, config=kfac, layers=owned)
    if owned:
        extra["kfac_owners"] = _kfac_owners(schedule, [r["layers"] for r in rows], spec.parallel.copies)
    extra["kfac_shapes"] = {s: r["shapes"] for s, r in enumerate(rows)}
    cost = CostModel(stage_overrides={s: StageOverride(f=r["f"], b=r["b"], w=r["w"], bw=r["bw"],
                                                       memory=float(r["memory"]),
                                                       work=r["work"], stash={k: float(v) for k, v in
                                                                              r["stash"].items()})
                                      for s, r in enumerate(rows)})
    # The first stage's first layer reads the batch: with a split backward its output gradients come from W.
    first = next(iter(stages[0].children()))
    splits = any(a.kind == Kind.W and a.stage == 0 for row in schedule.actions for a in row)
    late = frozenset({0}) if splits and any(isinstance(m, torch.nn.Linear) for m in first.modules()) else frozenset()
    extra["kfac_g_from_w"] = late
    if spec.optimizer.fill_bubbles:
        return pipefisher.fill(schedule, cost, g_from_w=late)
    return pipefisher.inline(schedule, cost, g_from_w=late)


def _kfac_owners(schedule: Schedule, seconds: list[list[float]], copies: int) -> dict[int, tuple[int, ...]]:
    """Per stage, the copy that owns each of its K-FAC layers: each device's layers (of all its stages) balanced
    over the copies by their measured ``seconds`` (:func:`pipefold.plan.dpkfac.assign`)."""
    from pipefold.plan.dpkfac import assign

    owners: dict[int, tuple[int, ...]] = {}
    for device in range(schedule.devices):
        stages = schedule.stages_of(device)
        flat = assign([t for s in stages for t in seconds[s]], copies)
        at = 0
        for s in stages:
            owners[s], at = flat[at:at + len(seconds[s])], at + len(seconds[s])
    return owners


def _plan_recompute(spec: RunSpec, schedule: Schedule, layer_stages: tuple[tuple[int, ...], ...],
                    model: Model) -> RecomputePlan:
    """Measure every stage on the first microbatch and choose its recomputed layers (see pipefold.plan.recompute)."""
    from pipefold.runtime.measure.profiling import measure_stages

    x, y = _first_microbatch(spec, model)
    profiles = measure_stages(_stages(layer_stages, model), x, y, model.loss,
                              microbatches=spec.schedule.microbatches, optimizer_factor=spec.optimizer.state_factor)
    return plan_recompute(schedule, profiles, spec.memory.recompute, spec.memory.budget)


def _hidden_loss(out: torch.Tensor, target: Any) -> torch.Tensor:
    """What the layers are timed against where the output projection is split by vocabulary: a loss of the last
    stage's hidden states (the projection and the cross entropy are the shards' work, the same on every device)."""
    return out.float().square().mean()


def _layer_stages(spec: RunSpec, model: Model, schedule: Schedule,
                  device: torch.device) -> tuple[tuple[int, ...], ...]:
    """Layers of each stage: even by count, balanced by the chosen cost, or ("memory") least peak under ``schedule``."""
    by = spec.memory.partition
    if by == "even":
        return tuple(tuple(s) for s in split_layers(model.num_layers, schedule.stages))
    from pipefold.plan.partition import split_by
    from pipefold.runtime.measure.profiling import layers_per_rank, split_figures

    layers = model.build()
    loss_fn = model.loss
    sample, target = _first_microbatch(spec, model)
    if schedule.vocab:  # the projection and its loss run on every device's shard, not on the last stage
        model.split_output(layers[-1])
        loss_fn = _hidden_loss
        taken = model.split_input(layers[0])  # and the token embedding's lookups: the first layer gets embeddings
        if taken is not None:
            sample = (torch.nn.functional.embedding(sample[0], taken[1]).detach(), *sample[1:])
    if by == "time":  # timed where the ranks will run (``device``): on their GPU, if they have one
        layers = [layer.to(device) for layer in layers]
        sample, target = tuple(t.to(device) for t in sample), target.to(device)
    figures = split_figures(layers, sample, by=by, loss_fn=loss_fn, target=target,
                            optimizer_factor=spec.optimizer.state_factor,
                            stage_layers=layers_per_rank(len(layers), schedule.devices))
    if device.type == "cuda" and by == "time":
        del layers, sample, target
        torch.cuda.empty_cache()  # the ranks have the GPU from here on
    return tuple(tuple(part) for part in split_by(figures, schedule, by).parts)

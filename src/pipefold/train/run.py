"""Train a model with a pipeline schedule: build the job, run the ranks, compare with one process.

:func:`make_job` turns a model name, its size, a schedule and the data into a
:class:`~pipefold.runtime.job.Job`; :func:`train` runs it locally on one
process per device; :func:`reference_step` computes the same first step in a
single process, from the same initial weights and data, which is what
``pipefold train --check`` compares against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.ir import Schedule
from pipefold.models import Model, make_model, split_layers
from pipefold.plan.recompute import MODES, OPTIMIZER_STATE, RecomputePlan, plan_recompute
from pipefold.runtime.checkpoint import Checkpointing
from pipefold.runtime.job import Adaptive, Job, RankReport
from pipefold.runtime.local import run_local
from pipefold.runtime.rank import agree
from pipefold.runtime.stage import Chain, as_tuple, split_batch
from pipefold.runtime.torchrun import join_torchrun_group, leave_group, run_torchrun, torchrun_activity
from pipefold.runtime.watch import DEFAULT_ACTION_TIMEOUT


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A training run, as ``pipefold train`` takes it."""

    schedule: str = "v-half"
    """Schedule name (see ``pipefold schedules``)."""
    options: tuple[tuple[str, int], ...] = ()
    """Schedule options, as (name, value) pairs."""
    renumber: bool = False
    """With a schedule file in torch's CSV whose last rank numbers its microbatches 1..m: shift them to 0..m-1."""
    devices: int = 4
    """Pipeline devices, one process each."""
    microbatches: int = 8
    """Microbatches per step."""
    steps: int = 20
    """Optimizer steps."""
    model: str = "gpt"
    """A registered model (:data:`pipefold.models.REGISTRY`): 'gpt' (on the embedded corpus or --data), 'mlp'
    (random regression), or a Hugging Face causal LM such as 'gpt2' or 'llama' (see ``model_config``)."""
    layers: int | None = None
    """Blocks: transformer blocks or MLP blocks (None: the model's default, 4; a Hugging Face model's config)."""
    hidden: int | None = None
    """Width (None: 64; a Hugging Face model's from its config)."""
    heads: int | None = None
    """Attention heads (None: 4; a Hugging Face model's from its config)."""
    model_config: str | None = None
    """A Hugging Face model's config: a name pipefold ships (gpt2-tiny, llama-tiny) or a config.json file."""
    batch: int = 16
    """Sequences (language models) or rows (mlp) per step, split into the microbatches."""
    seq: int = 64
    """Sequence length (language models)."""
    lr: float = 1e-3
    optimizer: str = "adamw"
    clip: float | None = None
    data: str | None = None
    """A text file to train the GPT on instead of the embedded corpus."""
    seed: int = 0
    offload: tuple[int, int] | None = None
    """(k, k'): each stage keeps at most k of its layers' parameters on the device, evicting k' at once."""
    partition: str = "time"
    """How layers are split into stages: balanced by measured 'time' (the default) or 'params', 'even' by count,
    or 'memory': the least per-device peak under the schedule, time within 2% of the time-balanced split."""
    recompute: str = "none"
    """Activation recomputation: 'none', 'full' (every layer) or 'auto' (per stage, to fit ``memory_budget``)."""
    memory_budget: float | None = None
    """Bytes each device may use for weights, gradients, optimizer state and activations (with 'auto', and the
    cap on k with 'adaptive-kfkb')."""
    network: str | None = None
    """Link conditions (see :func:`pipefold.sim.network.parse_network`): emulated in the runtime's links, or with
    ``netns`` made real by tc on veth links and a traffic generator."""
    netns: bool = False
    """Run each rank in its own network namespace (needs root; see :mod:`pipefold.runtime.netns`)."""
    adapt_every: int = 2
    """With 'adaptive-kfkb': steps between two choices of k."""
    dp: int = 1
    """Data-parallel copies of the pipeline (``devices`` ranks each): dp x devices processes, each pipeline on its
    shard of the batch, gradients averaged across them per stage (``DP`` actions)."""
    zero1: bool = False
    """With dp > 1: shard the optimizer state across the copies of each stage (ZeRO-1)."""
    fsdp: bool = False
    """With dp > 1: shard each stage's parameters, gradients and optimizer state across its copies (FSDP)."""
    fill_bubbles: bool = False
    """With optimizer 'kfac': put K-FAC's work in the schedule's bubbles, spread over steps (PipeFisher); without,
    it runs right after the passes it reads, every step."""
    damping: float = 0.1
    """K-FAC's damping (optimizer 'kfac'); see docs/pipefisher.md for the values tried on the GPT."""
    ema: float = 0.9
    """K-FAC's running-average decay of the factors (optimizer 'kfac')."""
    checkpoint_dir: str | None = None
    """Save checkpoints into this folder (the last step's always; see :mod:`pipefold.runtime.checkpoint`)."""
    checkpoint_every: int | None = None
    """Also save one after every N steps."""
    keep_last: int | None = None
    """Keep only the N newest checkpoints of ``checkpoint_dir`` (None: all)."""
    resume: bool = False
    """Start from the newest good checkpoint in ``checkpoint_dir``, or from ``resume_from``."""
    resume_from: str | None = None
    """With ``resume``: a checkpoint (``D/step-00000004``) or a folder of them to start from."""
    save_model: str | None = None
    """After the last step, write the whole model's state_dict here (``torch.save``; load it into
    ``nn.Sequential(*pipefold.models.make_model(...).build())``)."""
    post_validate: bool = False
    """Step the optimizer before the global NaN/inf and norm check completes; roll back when it fails."""
    max_bad_steps: int = 3
    """Stop after this many steps in a row with a NaN or inf loss or gradient (each one skipped)."""
    action_timeout: float = DEFAULT_ACTION_TIMEOUT
    """Seconds an action may run (or a rank wait for one that makes no progress) before the job is taken as hung
    and stopped, naming the rank (see :mod:`pipefold.runtime.watch`)."""
    device: str = "auto"
    """Where the ranks compute: 'cpu', 'cuda' or 'auto' (a GPU when torch sees one; :mod:`pipefold.runtime.devices`)."""
    backend: str = "auto"
    """'nccl' (a GPU per rank), 'gloo' (the CPU, or GPUs the ranks share, through pinned host memory) or 'auto'."""
    overlap: bool = True
    """On a GPU, run each overlapped pair's (FB) forward and backward at once, on two streams."""


ADAPTIVE = "adaptive-kfkb"
"""The schedule name that runs kFkB with k re-chosen as the run goes (see :mod:`pipefold.plan.adapt`)."""


def model_of(config: TrainConfig) -> Model:
    """The registered model the run trains, with its data (see :mod:`pipefold.models.base`)."""
    return make_model(config.model, layers=config.layers, hidden=config.hidden, heads=config.heads, seq=config.seq,
                      batch=config.batch, seed=config.seed, data=config.data, config=config.model_config)


def build_schedule(config: TrainConfig) -> Schedule:
    """The run's schedule: registered by name, or read from a file (pipefold's formats or torch's CSV), whose
    devices and microbatches must be the run's."""
    if config.schedule == ADAPTIVE:
        return _adaptive(config).schedules[0]
    if config.schedule not in schedules.REGISTRY and os.path.isfile(config.schedule):
        from pipefold.ir import load, validate

        schedule = load(config.schedule, renumber=config.renumber)
        validate(schedule)
        if (schedule.devices, schedule.microbatches) != (config.devices, config.microbatches):
            raise ConfigError(f"{config.schedule} runs on {schedule.devices} devices with {schedule.microbatches} "
                              f"microbatches, not {config.devices} and {config.microbatches}")
        return schedule
    return schedules.build(config.schedule, config.devices, config.microbatches, **dict(config.options))


def _adaptive(config: TrainConfig) -> Adaptive:
    """kFkB for every k that divides the microbatches (``max_k`` caps it), rank 0 choosing every few steps."""
    from pipefold.plan import adapt

    opts = dict(config.options)
    unknown = sorted(set(opts) - {"max_k"})
    if unknown:
        raise ConfigError(f"{ADAPTIVE} takes the option max_k (the largest k to try), not {unknown[0]!r}")
    ks = tuple(adapt.candidates(config.microbatches, opts.get("max_k")))
    policy = adapt.Policy(config.devices, config.microbatches, ks, config.memory_budget)
    return Adaptive(adapt.build(config.devices, config.microbatches, ks), config.adapt_every,
                    adapt.summarize, policy.runtime_decide)


Decisions = tuple[tuple[tuple[int, ...], ...], RecomputePlan | None]
"""What make_job measures and decides: the layers of each stage and the recomputation plan."""


JOB_HOOKS: list[Callable[[Job], Job]] = []
"""Functions every job made by :func:`make_job` passes through, in order: the way in for what the command line
does not set (the tests' injected faults, :mod:`pipefold.runtime.faults`). Empty in normal use."""


def make_job(config: TrainConfig, *, save_grads_of_step: int | None = None,
             decided: Decisions | None = None, placed: Any = None, checkpointing: Checkpointing | None = None,
             local: bool = False) -> Job:
    """Check the configuration and describe the job every rank will run.

    Splitting by time and planning recomputation measure the model; ``decided`` passes in
    what another process measured, so that every rank of one job runs the same split; ``placed``, with
    K-FAC, the placement of its work (a :class:`~pipefold.plan.pipefisher.Filled`) that another process made;
    ``checkpointing`` the checkpoint folder and the checkpoint to resume that another process found (else
    they come from ``config``, and finding the checkpoint reads the folder). ``local``: the ranks will be
    started here, from a fork server that this starts as soon as the model is known, so that its imports run
    on another core while this process measures the model.
    """
    schedule = build_schedule(config)
    from pipefold.runtime.job import local_placement

    # One line for a device this machine lacks.
    where = local_placement(config.device, config.backend, schedule.devices * config.dp)
    if where.device == "cuda" and (config.network is not None or config.netns):
        raise ConfigError("--network and --netns emulate links between CPU ranks over gloo: use --device cpu with "
                          "them")
    if config.dp < 1:
        raise ConfigError(f"--dp is the number of data-parallel pipelines: at least 1 (got {config.dp})")
    if config.fsdp and config.dp < 2:
        raise ConfigError("--fsdp shards each stage across data-parallel pipelines: give --dp 2 or more")
    if config.fsdp and config.zero1:
        raise ConfigError("--fsdp shards the optimizer state already: drop --zero1")
    if config.dp > 1:
        unsupported = [flag for flag, on in (("--optimizer kfac", config.optimizer == "kfac"),
                                             (f"--schedule {ADAPTIVE}", config.schedule == ADAPTIVE),
                                             ("--network", config.network is not None), ("--netns", config.netns),
                                             ("--offload", config.offload is not None)) if on]
        if unsupported:
            raise ConfigError(f"data-parallel pipelines (--dp {config.dp}) do not run with {unsupported[0]} yet: "
                              "use --dp 1 with it")
    shards = config.dp * config.microbatches
    if config.batch % shards:
        per = f"{config.dp} pipelines x {config.microbatches} microbatches" if config.dp > 1 else \
            f"{config.microbatches} microbatches"
        raise ConfigError(f"a batch of {config.batch} does not split into {per}; use a --batch that is a multiple "
                          f"of {shards}")
    model = model_of(config)
    if local:
        from pipefold.runtime.processes import start_server

        start_server(model.preload)
    check_size(config, model, schedule,
               builds_model=decided is None or placed is None and config.optimizer == "kfac", gpus=where.gpus)
    if checkpointing is None:
        checkpointing = _checkpointing(config)
    save_model = None
    if config.save_model is not None:
        from pipefold.files import check_writable

        check_writable(config.save_model, "model")
        save_model = os.path.abspath(config.save_model)  # the ranks may start in another folder
    if schedule.stages > model.num_layers:
        per_device = schedule.stages // schedule.devices
        raise ConfigError(f"{config.schedule} on {config.devices} devices has {schedule.stages} stages but the model "
                          f"has {model.num_layers} layers, so at most {model.num_layers} stages: use --devices "
                          f"{max(1, model.num_layers // per_device)} or fewer, or more --layers")
    build, loss_fn, batch_at = model.build_layers, model.loss, model.batch_at
    extra: dict[str, Any] = {"num_layers": model.num_layers}
    adaptive = _adaptive(config) if config.schedule == ADAPTIVE else None
    plan = None
    if decided is not None:
        layer_stages, plan = decided
    else:
        layer_stages = _layer_stages(config, model, schedule, where.device_of(0))
        if config.recompute != "none" or (config.memory_budget is not None and adaptive is None):
            plan = _plan_recompute(config, schedule, layer_stages, build, loss_fn, batch_at)
    recompute = None
    if plan is not None:
        recompute, extra["recompute"] = plan.layers, plan
    cycle: tuple[Schedule, ...] = ()
    kfac = refill = None
    if config.optimizer == "kfac":
        from pipefold.runtime.kfac import KFACConfig

        kfac = KFACConfig(damping=config.damping, ema=config.ema)
        if adaptive is not None:
            raise ConfigError(f"--optimizer kfac runs a cycle of schedules of its own: use a schedule other than "
                              f"{ADAPTIVE}")
        filled = placed or _kfac_cycle(config, schedule, layer_stages, build, loss_fn, batch_at, kfac)
        cycle = filled.cycle
        schedule, extra["pipefisher"] = cycle[0], filled
        if config.fill_bubbles:
            # The gaps of the step the ranks really run: placed again from their own times after the first cycle.
            from pipefold.plan.pipefisher import Refill

            refill = Refill(after=len(cycle) + 1, schedule=filled.base.schedule, cost=filled.base.cost)
    elif config.fill_bubbles:
        raise ConfigError("--fill-bubbles fills bubbles with K-FAC's work: add --optimizer kfac")
    network = None
    if config.network is not None:
        from pipefold.sim.network import parse_network

        network = parse_network(config.network)
        network.check_devices(schedule.devices)
    elif config.netns:
        raise ConfigError("--netns needs --network: the conditions the namespaces' links emulate, such as "
                          "constant:bandwidth=50MB or preempt:seed=1,idle=50MB,busy=5MB,on=4,off=4")
    if config.dp > 1:
        from pipefold.schedules.dataparallel import with_data_parallel

        # Each stage's gradients averaged across the pipelines; with FSDP, each stage sharded across them.
        schedule = with_data_parallel(schedule, shard=config.fsdp)
    job = Job(schedule=schedule, layer_stages=layer_stages, build_layers=build, loss_fn=loss_fn,
               batch_at=batch_at, steps=config.steps, lr=config.lr, optimizer=config.optimizer, clip=config.clip,
               save_grads_of_step=save_grads_of_step, offload=config.offload, recompute=recompute, extra=extra,
               network=network, adaptive=adaptive, cycle=cycle, kfac=kfac, refill=refill, dp=config.dp,
               zero1=config.zero1, fsdp=config.fsdp, tied=model.tied, preload=model.preload,
               checkpoint=checkpointing, save_model=save_model, post_validate=config.post_validate,
               max_bad_steps=config.max_bad_steps, action_timeout_s=config.action_timeout, device=config.device,
               backend=config.backend, overlap=config.overlap)
    for hook in JOB_HOOKS:
        job = hook(job)
    return job


def check_size(config: TrainConfig, model: Model, schedule: Schedule, *, builds_model: bool = True,
               gpus: int = 0) -> None:
    """Refuse, before any layer is built, a run this machine cannot hold or would take minutes per step on
    (see :mod:`pipefold.models.size`): the processes that start here, the parameters as often as they are held
    (weights, gradients, optimizer state on every copy of a stage; the whole model once more in this process when
    it measures the layers, ``builds_model``) and one microbatch's activations. A model that gives no size
    (:meth:`~pipefold.models.base.Model.size`) is not checked."""
    import os

    from pipefold.models.size import check_model
    from pipefold.runtime.job import under_torchrun

    held = (2 + OPTIMIZER_STATE.get(config.optimizer, 2.0)) * schedule.replicas * config.dp
    ranks = schedule.devices * config.dp
    if under_torchrun():  # only this machine's ranks, and their share of the model
        here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        held, ranks = held * here / max(1, int(os.environ.get("WORLD_SIZE", "1"))), here
    measures = builds_model and (config.partition != "even" or config.recompute != "none"
                                 or config.optimizer == "kfac" or config.memory_budget is not None)
    gpu = (min(gpus, ranks), torch.cuda.get_device_properties(0).total_memory) if gpus else None
    check_model(model, gpu=gpu, microbatches=config.microbatches * config.dp, ranks=ranks, copies=held,
                measures=measures, what=f"training {config.model}")


def restarted() -> bool:
    """Whether torchrun restarted this process's workers after a failure (``--max-restarts``)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    except ValueError:
        return False


def _checkpointing(config: TrainConfig) -> Checkpointing | None:
    """The checkpoint folder (made if needed) and the checkpoint to start from: the one ``--resume`` names, or
    the newest good one; after torchrun restarted the workers, the newest good one if there is any."""
    from pipefold.runtime import checkpoint

    if (config.checkpoint_dir is None and not config.resume and config.checkpoint_every is None
            and config.keep_last is None):
        return None
    if config.optimizer == "kfac":
        raise ConfigError("checkpoints do not save K-FAC's curvature and its placement yet: train --optimizer kfac "
                          "without --checkpoint-dir and --resume")
    if config.checkpoint_every is not None and config.checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every N saves every N steps: N >= 1 (got {config.checkpoint_every})")
    directory = checkpoint.prepare(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    identity: dict[str, Any] = {"model": config.model, "layers": config.layers, "hidden": config.hidden,
                                "heads": config.heads, "seq": config.seq, "model_config": config.model_config,
                                "optimizer": config.optimizer}
    resume = None
    if config.resume:
        where = config.resume_from or directory
        if where is None:
            raise ConfigError("--resume needs --checkpoint-dir D, or the checkpoint to start from: "
                              "--resume D/step-00000004")
        resume = checkpoint.find(where)
    elif directory is not None and restarted():
        resume = checkpoint.find(directory, required=False)
        if resume is None:
            checkpoint.note(f"restarted by torchrun with no good checkpoint in {directory} yet: starting over")
    if resume is not None:
        checkpoint.check_identity(resume, identity, config.steps)
        checkpoint.note(f"resuming from {resume.path} ({resume.step} steps done)")
    return checkpoint.Checkpointing(directory=directory, every=config.checkpoint_every, resume=resume,
                                    keep_last=config.keep_last,
                                    identity=identity)


def _kfac_cycle(config: TrainConfig, schedule: Schedule, layer_stages: tuple[tuple[int, ...], ...],
                build: Callable[[list[int]], dict[int, Any]], loss_fn: Callable[..., torch.Tensor],
                batch_at: Callable[[int], tuple[Any, torch.Tensor]], kfac: Any) -> Any:
    """Measure every stage's passes and K-FAC work on the first microbatch, then place the work: in the bubbles of
    the simulated step (``fill_bubbles``), or right after the passes it reads."""
    from pipefold.plan import pipefisher
    from pipefold.runtime.curvature import measure
    from pipefold.sim.simulate import CostModel, StageOverride

    layers = build([i for part in layer_stages for i in part])
    stages = [Chain(*(layers[i] for i in part)) for part in layer_stages]
    x, y = batch_at(0)
    m = config.microbatches
    n = m * config.dp  # a microbatch of a pipeline's shard
    rows = measure(stages, split_batch(x, n)[0], y.chunk(n)[0], loss_fn, microbatches=m, config=kfac)
    cost = CostModel(stage_overrides={s: StageOverride(f=r["f"], b=r["b"], w=r["w"], memory=float(r["memory"]),
                                                       work=r["work"], stash={k: float(v) for k, v in
                                                                              r["stash"].items()})
                                      for s, r in enumerate(rows)})
    return pipefisher.fill(schedule, cost) if config.fill_bubbles else pipefisher.inline(schedule, cost)


def _plan_recompute(config: TrainConfig, schedule: Schedule, layer_stages: tuple[tuple[int, ...], ...],
                    build: Callable[[list[int]], dict[int, Any]], loss_fn: Callable[..., torch.Tensor],
                    batch_at: Callable[[int], tuple[Any, torch.Tensor]]) -> RecomputePlan:
    """Measure every stage on the first microbatch and choose its recomputed layers (see pipefold.plan.recompute)."""
    from pipefold.runtime.profiling import measure_stages

    if config.offload is not None:
        raise ConfigError("--recompute and --offload do not combine yet: an offloaded stage keeps its activations; "
                          "use one or the other")
    if config.recompute not in MODES:
        raise ConfigError(f"unknown recomputation {config.recompute!r}: choose one of {', '.join(MODES)}")
    layers = build([i for part in layer_stages for i in part])
    stages = [Chain(*(layers[i] for i in part)) for part in layer_stages]
    x, y = batch_at(0)
    m = config.microbatches
    n = m * config.dp  # a microbatch of a pipeline's shard
    profiles = measure_stages(stages, split_batch(x, n)[0], y.chunk(n)[0], loss_fn, microbatches=m,
                              optimizer_factor=OPTIMIZER_STATE.get(config.optimizer, 2.0))
    return plan_recompute(schedule, profiles, config.recompute, config.memory_budget)


def _layer_stages(config: TrainConfig, model: Model, schedule: Schedule,
                  device: torch.device) -> tuple[tuple[int, ...], ...]:
    """Layers of each stage: even by count, balanced by the chosen cost, or ("memory") least peak under ``schedule``."""
    if config.partition == "even":
        return tuple(tuple(s) for s in split_layers(model.num_layers, schedule.stages))
    from pipefold.plan.partition import partition, partition_memory
    from pipefold.runtime.profiling import layer_costs, layer_memory, layer_static_bytes

    layers = model.build()
    x, y = model.batch_at(0)
    n = config.dp * config.microbatches
    sample = split_batch(x, n)[0]  # a microbatch of a pipeline's shard
    if config.partition == "time":  # timed where the ranks will run (``device``): on their GPU, if they have one
        layers = [layer.to(device) for layer in layers]
        sample = tuple(t.to(device) for t in sample)
    if config.partition == "memory":
        times = layer_costs(layers, sample, by="time")
        target = y.chunk(n)[0]  # the last layer holds what the loss saves
        held = layer_memory(layers, sample, loss_fn=model.loss, target=target)
        static = layer_static_bytes(layers, optimizer_factor=OPTIMIZER_STATE.get(config.optimizer, 2.0))
        split_memory = partition_memory(times, [h for h, _ in held], [w for _, w in held], static, schedule)
        return tuple(tuple(part) for part in split_memory.parts)
    costs = layer_costs(layers, sample, by=config.partition)
    if device.type == "cuda" and config.partition == "time":
        del layers, sample
        torch.cuda.empty_cache()  # the ranks have the GPU from here on
    # The objective is the busiest device's load, so a device holding two chunks (V) counts both.
    split = partition(costs, schedule.stages, placement=schedule.placement[0])
    return tuple(tuple(part) for part in split.parts)


def train(config: TrainConfig, *, check: bool = False, on_step: Callable[[int, float, float], None] | None = None,
          decided: Decisions | None = None) -> tuple[Job, list[RankReport]]:
    """Run the job on one local process per device; with ``check`` keep the first step's gradients; ``decided``
    gives the split and recomputation (from a plan) instead of measuring."""
    job = make_job(config, save_grads_of_step=0 if check else None, decided=decided, local=not config.netns)
    if config.netns:
        return _run_netns(job, on_step)
    if job.network is not None:
        job = dataclasses.replace(job, origin=time.time())
    return job, run_local(job, on_step)


def _run_netns(job: Job, on_step: Callable[[int, float, float], None] | None) -> tuple[Job, list[RankReport]]:
    """Run ``job`` with each rank in a network namespace: the links capped by tc at the network's fastest
    bandwidth, and its preempted periods made real by flooding the preempted links (both ways).

    What the flood leaves the job is the real, shared bandwidth: the network's busy bandwidth is not used, nor
    its latency (tbf has none to add).
    """
    from pipefold.runtime import netns

    assert job.network is not None
    network = job.network
    reason = netns.unavailable()
    if reason is not None:
        raise ConfigError(f"--netns cannot run here: {reason}; use --network alone to emulate the links in-process")
    p = job.schedule.devices
    rate = max(state.bandwidth for c in (network.default, *network.links.values()) for state in c.states)
    if math.isinf(rate):
        raise ConfigError("--netns needs a network with a finite bandwidth for tc to cap the links at")
    horizon = 24 * 3600.0
    pairs = sorted(network.links) if network.links else [(i, i + 1) for i in range(p - 1)]
    pairs = [(a, b) for a, b in pairs if a < b and max(a, b) < p]
    with netns.namespaces(p, rate) as topology, contextlib.ExitStack() as floods:
        origin = time.time()
        for a, b in pairs:
            periods = network.preempted_periods(a, b, horizon)
            if periods:
                floods.enter_context(netns.Flood(topology, a, b, periods, origin, bidirectional=True))
        job = dataclasses.replace(job, netns=topology, network=None, origin=origin)
        return job, run_local(job, on_step)


def from_plan(plan: dict[str, Any], **run: Any) -> tuple[TrainConfig, Decisions]:
    """The run a plan file describes (:func:`pipefold.plan.budget.read_plan`): its model and schedule, with its split
    and recomputation decided; ``run`` sets what a plan leaves open (steps, lr, seed, clip, data)."""
    from pipefold.ir.ref import ScheduleRef
    from pipefold.plan.budget import stage_profiles
    from pipefold.plan.profile import Profile
    from pipefold.plan.recompute import device_peaks

    ref = ScheduleRef.parse(str(plan["schedule"]))
    t = plan["train"]
    layers, hidden, heads = (None if t.get(k) is None else int(t[k]) for k in ("layers", "hidden", "heads"))
    config = TrainConfig(schedule=ref.name, options=ref.options, devices=int(plan["devices"]),
                         microbatches=int(plan["microbatches"]), model=t["model"], layers=layers, hidden=hidden,
                         heads=heads, model_config=t.get("model_config"), batch=int(t["batch"]), seq=int(t["seq"]),
                         optimizer=t["optimizer"], **{"seed": int(t["seed"]), **run})
    layer_stages = tuple(tuple(int(i) for i in part) for part in plan["layer_stages"])
    have = model_of(config).num_layers  # built on no device: the layer count only
    if have != sum(len(part) for part in layer_stages):
        raise ConfigError(f"the plan splits {sum(len(part) for part in layer_stages)} layers but its model "
                          f"({config.model}, its sizes as the plan gives them) has {have}: write the plan again with "
                          "pipefold plan --profile")
    counts = tuple(int(r) for r in plan["recompute"])
    recompute = None
    if any(counts):
        profile = Profile.from_dict(plan["profile"])
        schedule = build_schedule(config)
        rows = stage_profiles(profile, layer_stages)
        static, activations = device_peaks(schedule, rows, counts)
        step = float(plan["predicted"]["step_time_s"])
        recompute = RecomputePlan("plan", counts, tuple(len(p) for p in layer_stages), static,
                                  [int(a) for a in activations], plan.get("budget_bytes"), step, step)
    return config, (layer_stages, recompute)


def train_torchrun(config: TrainConfig, *, check: bool = False,
                   on_step: Callable[[int, float, float], None] | None = None) -> tuple[Job, list[RankReport] | None]:
    """This process's rank of the job, as torchrun started it; rank 0 gets every rank's report.

    Rank 0 measures and decides the split, the recomputation and K-FAC's placement; the others take its
    decisions (measured times differ from process to process, and every rank must run the same steps).
    """
    if not (math.isfinite(config.action_timeout) and 0 < config.action_timeout <= 86400):
        raise ConfigError(f"--action-timeout is in seconds: a number > 0 and at most a day (got "
                          f"{config.action_timeout})")
    rank, _ = join_torchrun_group(config.action_timeout, config.device, config.backend)
    activity = torchrun_activity()
    grads_step = 0 if check else None
    job = None
    failure: Exception | None = None
    if rank == 0:
        activity.run("preparing the job (measuring the model)", action=False)
        try:
            job = make_job(config, save_grads_of_step=grads_step)
            message: tuple[str, Any] = ("ok", ((job.layer_stages, job.extra.get("recompute")),
                                               job.extra.get("pipefisher"), job.checkpoint))
        except ConfigError as exc:
            message = ("error", str(exc))  # the other ranks stop with the same line instead of waiting
        except Exception as exc:  # anything else stops the other ranks too, then surfaces here unchanged
            failure, message = exc, ("crash", f"{type(exc).__name__}: {exc}")
        message = agree(message)
    else:
        activity.wait("preparing the job", "rank 0's split of the model", (0,), action=False)
        message = agree(None)
    status, payload = message
    if status != "ok":
        leave_group()
        if failure is not None:
            raise failure
        if status == "error":
            raise ConfigError(payload)
        raise RuntimeError(f"rank 0 failed while preparing the job: {payload}")
    if job is None:
        job = make_job(config, save_grads_of_step=grads_step, decided=payload[0], placed=payload[1],
                       checkpointing=payload[2])
    return job, run_torchrun(job, on_step)


def reference_step(job: Job, step: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    """One step in one process, from the initial weights, on the device the job's first rank computes on (the
    same GPU): mean loss over the microbatches and every gradient (on the CPU)."""
    from pipefold.runtime.job import placement

    device = placement(job).device_of(0)
    n = job.extra["num_layers"]
    layers = job.build_layers(list(range(n)))
    model = Chain(*(layers[i] for i in range(n))).to(device)
    m = job.schedule.microbatches
    x, y = job.batch_at(step)
    xs_all = tuple(t.to(device) for t in as_tuple(x))
    total = 0.0
    for xs, ys in zip(split_batch(xs_all, m), y.to(device).chunk(m), strict=True):
        loss = job.loss_fn(model(*xs), ys)
        (loss / m).backward()
        total += float(loss.detach()) / m
    grads = {f"{i}.{name}": p.grad.detach().to("cpu", copy=True) for i in range(n)
             for name, p in layers[i].named_parameters() if p.grad is not None}
    return total, grads


def reference_kfac(job: Job, steps: int, reports: list[RankReport] | None = None) -> dict[str, torch.Tensor]:
    """``steps`` steps of the job's K-FAC in one process, from the initial weights: every stage's curvature,
    inversions and preconditioning where the job's cycle of schedules puts them (and, with the run's
    ``reports``, the cycles its rank 0 placed again as it ran), then the same optimizer. Returns the weights,
    named as ``RankReport.weights``."""
    from pipefold.ir import Kind
    from pipefold.runtime.curvature import StageCurvature
    from pipefold.runtime.job import OPTIMIZERS
    from pipefold.runtime.meter import MemoryMeter

    assert job.kfac is not None, "reference_kfac needs a K-FAC job"
    n = job.extra["num_layers"]
    layers = job.build_layers(list(range(n)))
    stages = [Chain(*(layers[i] for i in part)) for part in job.layer_stages]
    m = job.schedule.microbatches
    curv = [StageCurvature(stage, job.kfac, m) for stage in stages]
    params = [p for i in range(n) for p in layers[i].parameters()]
    opt = OPTIMIZERS["kfac"](params, lr=job.lr)
    cycles: list[tuple[int, tuple[Schedule, ...]]] = [(0, job.cycle or (job.schedule,))]
    if reports is not None and job.refill is not None:
        cycles += [(first, filled.cycle) for r in reports if r.rank == 0 for first, filled in r.decisions]
    kinds = (Kind.KA, Kind.KG, Kind.KI, Kind.KP)
    for step in range(steps):
        first, cycle = max((c for c in cycles if c[0] <= step), key=lambda c: c[0])
        schedule = cycle[(step - first) % len(cycle)]
        # Each stage's K-FAC actions in its device's order (the schedule orders them the same way on every run).
        work = [[a for a in schedule.actions[schedule.device_of(s)] if a.stage == s and a.kind in kinds]
                for s in range(len(stages))]
        for s, c in enumerate(curv):
            c.begin(work[s], s, MemoryMeter())
        x, y = job.batch_at(step)
        for j, (xs, ys) in enumerate(zip(split_batch(x, m), y.chunk(m), strict=True)):
            h: tuple[Any, ...] = xs
            for c, stage in zip(curv, stages, strict=True):
                c.current = j
                h = as_tuple(stage(*h))
                c.current = None
            (job.loss_fn(*h, ys) / m).backward()
        for s, c in enumerate(curv):
            for a in work[s]:
                c.run(a)
        if job.clip is not None:  # as the ranks clip: by the global norm, all-reduced there
            norm = float(sum(p.grad.detach().pow(2).sum() for p in params if p.grad is not None) ** 0.5)
            if norm > job.clip:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(job.clip / (norm + 1e-6))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {f"{i}.{name}": p.detach().clone() for i in range(n) for name, p in layers[i].named_parameters()}


def compare(job: Job, reports: list[RankReport]) -> dict[str, float]:
    """Largest relative differences between the pipeline's first step and the single-process reference.

    A stage held by several replicas is compared on every rank that holds it (after their all-reduce).
    """
    ref_loss, ref_grads = reference_step(job)
    losses = [loss for r in reports for loss in r.steps[0].losses.values()]  # every pipeline's microbatches
    pipe_loss = sum(losses) / len(losses)
    got: dict[str, list[torch.Tensor]] = {}
    for r in reports:
        for name, g in (r.grads or {}).items():
            got.setdefault(name, []).append(g)
    if set(got) != set(ref_grads):
        missing = sorted(set(ref_grads) - set(got))[:3]
        raise RuntimeError(f"the pipeline produced no gradient for {missing}")
    worst = 0.0
    for name, g in ref_grads.items():
        denom = float(g.abs().max()) or 1.0
        worst = max([worst] + [float((mine - g).abs().max()) / denom for mine in got[name]])
    return {"loss_rel_diff": abs(pipe_loss - ref_loss) / max(abs(ref_loss), 1e-12), "max_grad_rel_diff": worst,
            "reference_loss": ref_loss}

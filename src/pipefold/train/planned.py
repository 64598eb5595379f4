"""Planned runs: a plan file (``train --plan``) or a plan made here (``train --schedule auto``) turned into the run it
describes, in memory (a dict only where the file is read).

:func:`resolve` takes a run spec whose schedule a plan decides and returns the spec of the run the plan made (its
model, schedule, shape and optimizer; steps, learning rate, checkpoints and the rest as the user gave them), the
decisions (split and recomputation) that make_job takes instead of measuring, and the plan with its prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipefold.errors import ConfigError
from pipefold.plan.budget import RunPlan
from pipefold.plan.recompute import RecomputePlan
from pipefold.train.overhead import profile_here
from pipefold.train.prepare import Decisions, model_of
from pipefold.train.spec import RunSpec, profiled_settings

__all__ = ["Planned", "from_cluster_plan", "from_plan", "plan_here", "resolve"]


@dataclass(frozen=True)
class Planned:
    """A run a plan decided."""

    spec: RunSpec
    """The run: the plan's model, schedule and shape, the rest as given."""
    decided: Decisions
    """The plan's split of the layers and its recomputation."""
    plan: RunPlan | None
    """The plan, with its prediction (None: a cluster plan, whose prediction is ``cluster``)."""
    cluster: dict[str, Any] | None = None
    """A cluster plan's prediction for the run (``pipefold plan --cluster``): step time, tokens/s, memory, MFU."""


def resolve(spec: RunSpec, *, profiling: Callable[[str, int, int], None] | None = None,
            planning: Callable[[int, int], None] | None = None) -> Planned | None:
    """The planned run of ``spec`` (``plan``: read the file; schedule 'auto': profile the model here and plan for
    its memory budget, reporting to ``profiling`` and ``planning``), or None when ``spec`` names its schedule."""
    if spec.plan is not None:
        from pipefold.files import read_json
        from pipefold.plan.budget import check_plan

        # Read once: a cluster plan (plan --cluster -o) or a profiled one (plan --profile -o).
        data = read_json(spec.plan, "plan", "give a file written by pipefold plan --profile or --cluster, -o")
        if isinstance(data, dict) and data.get("kind") == "pipefold-cluster-plan":
            return from_cluster_plan(data, spec.plan, spec)
        return from_plan(RunPlan.from_dict(check_plan(data, spec.plan)), spec)
    if spec.schedule.auto:
        return from_plan(plan_here(spec, profiling=profiling, planning=planning), spec)
    return None


def plan_here(spec: RunSpec, *, profiling: Callable[[str, int, int], None] | None = None,
              planning: Callable[[int, int], None] | None = None) -> RunPlan:
    """Profile ``spec``'s model on this machine and plan it for the memory budget: the fastest schedule, split and
    recomputation that fit (:func:`pipefold.plan.budget.plan_model`)."""
    from pipefold.plan.budget import plan_model
    m, s = spec.model, spec.schedule
    assert spec.memory.budget is not None  # the spec refuses 'auto' without one
    name = spec.optimizer.name
    if not isinstance(name, str):
        raise ConfigError("--schedule auto profiles the optimizer's state by name: give adamw or sgd")
    # The schedule is not chosen yet: sized for at least one stage per device. One pipeline is planned: no copies
    # whose sharding the profile would have to measure.
    profile = profile_here(model=m.name, layers=m.layers_for(s.devices), hidden=m.hidden, heads=m.heads,
                           model_config=m.config, seq=m.seq, batch=m.batch, microbatches=s.microbatches,
                           optimizer=name, seed=m.seed, devices=s.devices, sharding=False,
                           dtype=spec.devices.dtype, progress=profiling)
    return plan_model(profile, s.devices, spec.memory.budget, progress=planning).run_plan


def from_plan(plan: RunPlan, spec: RunSpec | None = None) -> Planned:
    """The run ``plan`` describes, its split and recomputation decided; ``spec`` gives what a plan leaves open
    (steps, learning rate, clipping, data, reliability, devices; the seed where given)."""
    from pipefold.plan.budget import device_static, layout_profile, stage_profiles
    from pipefold.plan.recompute import device_peaks

    spec = spec or RunSpec()
    fixed = {**profiled_settings(plan.train), "plan": None, "schedule": plan.schedule, "devices": plan.devices,
             "microbatches": plan.microbatches, "dp": plan.dp, "tp": plan.tp, "zero1": plan.sharding == "zero1",
             "fsdp": plan.sharding == "fsdp", "state_chunks": plan.chunks,
             # Split layers as the profile measured them: sequence-parallel where it did.
             "sequence_parallel": bool(plan.train.get("sequence_parallel")) and max(plan.layout.degrees) > 1}
    if plan.chunks:  # the chunks fill what the plan left of the budget: its room
        fixed["memory_budget"] = plan.room
    if "seed" in spec.given():
        fixed.pop("seed", None)
    measured_in = plan.train.get("dtype", "fp32")
    if spec.devices.dtype != measured_in and "dtype" in spec.given():
        raise ConfigError(f"the plan was made from a profile measured in {measured_in}, and this run computes in "
                          f"{spec.devices.dtype}: profile again with pipefold profile --dtype {spec.devices.dtype}, "
                          "or drop --dtype (the plan's dtype runs)")
    fixed["dtype"] = measured_in
    resolved = spec.replace(**fixed)
    schedule = resolved.schedule.built
    layer_stages = plan.layer_stages
    have = model_of(resolved, schedule.stages).num_layers  # built on no device: the layer count only
    if have != sum(len(part) for part in layer_stages):
        raise ConfigError(f"the plan splits {sum(len(part) for part in layer_stages)} layers but its model "
                          f"({resolved.model.name}, its sizes as the plan gives them) has {have}: write the plan "
                          "again with pipefold plan --profile")
    recompute = None
    if any(plan.recompute):
        # The plan's own view of its layers: each at its device's degree, the copies' sharding in the static bytes.
        seen = layout_profile(plan.profile, plan.layout, layer_stages, schedule.placement[0])
        activations = device_peaks(schedule, stage_profiles(seen, layer_stages), plan.recompute)[1]
        static = device_static(seen, plan.layout, schedule, layer_stages)
        recompute = RecomputePlan("plan", plan.recompute, tuple(len(p) for p in layer_stages), static,
                                  [int(a) for a in activations], plan.budget, plan.step_time, plan.step_time)
    return Planned(resolved, (layer_stages, recompute), plan)


def from_cluster_plan(data: dict[str, Any], path: str, spec: RunSpec | None = None) -> Planned:
    """The run a cluster plan's best configuration describes (``pipefold plan --cluster -o``): its model by its
    config, shape, layout, layers per stage and recomputation; ``spec`` gives what the plan leaves open, as
    :func:`from_plan` does. One line where the file is not such a plan or its model is planned only."""
    from pipefold.plan.cluster_plan import CLUSTER_PLAN_VERSION

    spec = spec or RunSpec()
    if data.get("version") != CLUSTER_PLAN_VERSION:
        raise ConfigError(f"{path} is a cluster plan of version {data.get('version')!r}; this pipefold reads version "
                          f"{CLUSTER_PLAN_VERSION}: write it again with pipefold plan --cluster -o")
    run = data.get("run")
    if run is None:
        why = data.get("not_runnable", "it names no run")
        raise ConfigError(f"{path} plans a model pipefold does not run ({why})")
    try:
        layer_stages = tuple(tuple(int(i) for i in part) for part in run["layer_stages"])
        counts = tuple(int(r) for r in run["recompute"])
        fixed = {"plan": None, "model": str(run["model"]), "model_config": str(run["model_config"]),
                 "seq": int(run["seq"]), "batch": int(run["batch"]), "schedule": str(run["schedule"]),
                 "devices": int(run["devices"]), "microbatches": int(run["microbatches"]), "dp": int(run["dp"]),
                 "tp": int(run["tp"]), "fsdp": run["sharding"] == "fsdp", "zero1": run["sharding"] == "zero1",
                 "layers": None, "hidden": None, "heads": None}
        predicted = {k: float(v) for k, v in run["predicted"].items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a valid cluster plan ({type(exc).__name__}: {exc})") from None
    resolved = spec.replace(**fixed)
    schedule = resolved.schedule.built
    have = model_of(resolved, schedule.stages).num_layers
    flat = [i for part in layer_stages for i in part]
    if flat != list(range(have)) or len(layer_stages) != schedule.stages or len(counts) != len(layer_stages):
        raise ConfigError(f"{path} splits {len(flat)} layers into {len(layer_stages)} stages, but its model has {have} "
                          f"layers and {resolved.schedule.name} {schedule.stages} stages: write it again with "
                          "pipefold plan --cluster -o")
    recompute = None
    if any(counts):
        sizes = tuple(len(p) for p in layer_stages)
        if any(not 0 <= r <= n for r, n in zip(counts, sizes, strict=True)):
            raise ConfigError(f"{path}: recompute needs one count per stage, at most that stage's layers")
        zeros = [0] * schedule.devices
        # The cluster's figures are the cluster's: no prediction of this machine's bytes (mode "cluster").
        recompute = RecomputePlan("cluster", counts, sizes, zeros, zeros, None, predicted["step_time_s"],
                                  predicted["step_time_s"])
    return Planned(resolved, (layer_stages, recompute), None, cluster=predicted)

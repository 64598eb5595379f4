"""One value describes a training run: :class:`RunSpec`, made of small sections.

The command line builds it once from the options the user gave (:meth:`RunSpec.flat`, each option's name is
its setting's), a plan file or the planner resolves it into the run it planned (:mod:`pipefold.train.planned`),
and it is checked once, when it is made: each section checks its own fields, :meth:`RunSpec.check` every rule that
joins them, including which options go with which modes (:data:`RULES`: given where it does not apply, an option
is refused in one line, never ignored). The sections the ranks read
(:class:`~pipefold.runtime.launch.settings.Optimizer`,
:class:`~pipefold.runtime.launch.settings.Parallel`, :class:`~pipefold.runtime.launch.settings.Reliability`,
:class:`~pipefold.runtime.launch.settings.Devices`) reach them unchanged inside the job.

A new option of ``pipefold train`` is a field here (or in a runtime section), its parser entry, and the code that
uses it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.ir import Schedule
from pipefold.ir.ref import ScheduleRef
from pipefold.models.base import ModelArgs
from pipefold.runtime.launch.processes import torchrun_on_one_machine, under_torchrun
from pipefold.runtime.launch.settings import Devices, Optimizer, Parallel, Reliability, check_together, flag

if TYPE_CHECKING:
    from pipefold.sim.network import Network

ADAPTIVE = "adaptive-kfkb"
"""The schedule name that runs kFkB with k re-chosen as the run goes (see :mod:`pipefold.plan.adapt`)."""
AUTO = "auto"
"""The schedule name that profiles the model here and runs the plan made for ``memory_budget``."""
PARTITIONS = ("time", "params", "memory", "even")


def _at_least_one(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")


@dataclass(frozen=True, kw_only=True)
class ModelSpec(ModelArgs):
    """The model, its size and its data: a registered model's name and what the models take
    (:class:`~pipefold.models.base.ModelArgs`, which checks the sizes). None: the model's default; ``layers``
    None: enough blocks for two per stage (a Hugging Face model: its config's)."""

    name: str = field(default="gpt", metadata=flag("model"))
    """A registered model (:data:`pipefold.models.REGISTRY`): 'gpt' (on the embedded corpus or ``data``), 'mlp'
    (random regression), or a Hugging Face causal LM such as 'gpt2' or 'llama' (sized by ``config``)."""

    def __post_init__(self) -> None:
        from pipefold.models import REGISTRY

        super().__post_init__()
        if self.name not in REGISTRY:
            raise ConfigError(f"unknown model {self.name!r}; known models: {', '.join(REGISTRY)}")

    @property
    def args(self) -> ModelArgs:
        """What the model's family takes, with ``layers`` as given."""
        return ModelArgs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelArgs)})

    @property
    def sequences(self) -> bool:
        """Whether its rows are sequences of tokens (a language model)."""
        from pipefold.models import REGISTRY

        return REGISTRY[self.name].sequences

    def layers_for(self, stages: int) -> int | None:
        """The blocks to build for ``stages`` stages: the given count, else the family's default for that many
        (None: the model's own, a Hugging Face config's)."""
        from pipefold.models import REGISTRY

        return self.layers or REGISTRY[self.name].blocks_for(stages)


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """Which schedule runs, on how many devices, with how many microbatches."""

    name: str = field(default="v-half", metadata=flag("schedule"))
    """A registered schedule, optionally with options (``kfkb:k=2``); a schedule file (pipefold's text, JSON or
    CSV, or torch's CSV: its devices and microbatches are the run's); 'adaptive-kfkb' (kFkB, k re-chosen as the
    run goes, option max_k); or 'auto' (plan here for the memory budget)."""
    devices: int = 4
    """Pipeline devices, one process each (times the data-parallel copies)."""
    microbatches: int = 8
    """Microbatches per step."""
    renumber: bool = False
    """With a schedule file in torch's CSV whose last rank numbers its microbatches 1..m: shift them to 0..m-1."""
    adapt_every: int = 2
    """With 'adaptive-kfkb': steps between two choices of k."""

    def __post_init__(self) -> None:
        _at_least_one(self, "devices", "microbatches", "adapt_every")
        if self.is_file:
            loaded = self.loaded
            for name, theirs in (("devices", loaded.devices), ("microbatches", loaded.microbatches)):
                mine = getattr(self, name)
                if mine != _DEFAULTS_OF[ScheduleSpec][name] and mine != theirs:
                    raise ConfigError(f"{self.name} runs on {loaded.devices} devices with {loaded.microbatches} "
                                      f"microbatches: drop --{name} {mine}, or give the file's")
            object.__setattr__(self, "devices", loaded.devices)
            object.__setattr__(self, "microbatches", loaded.microbatches)
            object.__setattr__(self, "name", os.path.abspath(self.name))  # the ranks may start elsewhere
        elif not self.auto:
            _ = self.built  # an unknown name or option, or a shape the family cannot make: one line now

    @property
    def auto(self) -> bool:
        return self.name == AUTO

    @property
    def adaptive(self) -> bool:
        return self.ref.name == ADAPTIVE

    @cached_property
    def is_file(self) -> bool:
        return not self.auto and schedules.looks_like_file(self.name)

    @cached_property
    def ref(self) -> ScheduleRef:
        """The name and options (a file: its path, no options)."""
        return ScheduleRef(self.name) if self.is_file else ScheduleRef.parse(self.name)

    @cached_property
    def loaded(self) -> Schedule:
        """The schedule file's schedule, validated."""
        from pipefold.ir import formats, validate

        if not os.path.isfile(self.name):
            raise ConfigError(f"no such schedule file: {self.name}")
        schedule = formats.load(self.name, renumber=self.renumber)
        validate(schedule)
        return schedule

    @cached_property
    def candidates(self) -> tuple[int, ...]:
        """With 'adaptive-kfkb': the ks it chooses from (divisors of the microbatches, up to its max_k)."""
        from pipefold.plan import adapt

        unknown = sorted(set(self.ref.kwargs) - {"max_k"})
        if unknown:
            raise ConfigError(f"{ADAPTIVE} takes the option max_k (the largest k to try), not {unknown[0]!r}")
        return tuple(adapt.candidates(self.microbatches, self.ref.option("max_k", None)))

    @cached_property
    def built(self) -> Schedule:
        """The schedule the run starts with, built once (with 'adaptive-kfkb': kFkB with its first k)."""
        if self.auto:
            raise ConfigError("--schedule auto is planned first: run it through pipefold.train.planned")
        if self.is_file:
            return self.loaded
        if self.adaptive:
            return schedules.build("kfkb", self.devices, self.microbatches, k=self.candidates[0])
        return schedules.build(self.ref.name, self.devices, self.microbatches, **self.ref.kwargs)


@dataclass(frozen=True, kw_only=True)
class MemorySpec:
    """How the layers are split into stages and what memory each device may use."""

    partition: str = "time"
    """Balanced by measured 'time' (the default) or 'params', 'even' by count, or 'memory': the least per-device
    peak under the schedule, time within 2% of the time-balanced split."""
    recompute: str = "none"
    """Activation recomputation: 'none', 'full' (every layer) or 'auto' (per stage, to fit ``memory_budget``)."""
    memory_budget: float | str | None = None
    """Bytes each device may use for weights, gradients, optimizer state and activations, as a number or text
    (``64MB``): the target of 'auto' recomputation and of ``--schedule auto``, and the cap on k with
    'adaptive-kfkb'."""
    offload: tuple[int, int] | str | None = None
    """(k, k') or 'k,k2': each stage keeps at most k of its layers' parameters on the device, evicting k' at once."""
    offload_activations: float | str | None = None
    """The share of (stage, microbatch)s whose activations go to host memory after their forward and come back
    before their backward, the longest-lived first: 0..1, 'all' or 'none' (PipeOffload)."""
    state_chunks: bool = False
    """Keep the optimizer state (with master weights, the masters and their gradients too) in chunks, on the device
    where the warm-up step left room under ``memory_budget`` and in host memory otherwise, host chunks stepped by
    the CPU (PatrickStar, AxoNN)."""
    chunk_size: float | str | None = None
    """Bytes of float32 one chunk holds (``4MB``); chosen from the parameters' sizes when None."""

    def __post_init__(self) -> None:
        from pipefold.plan.recompute import MODES
        from pipefold.units import parse_bytes

        if self.partition not in PARTITIONS:
            raise ConfigError(f"unknown partition {self.partition!r}: choose one of {', '.join(PARTITIONS)}")
        if self.recompute not in MODES:
            raise ConfigError(f"unknown recomputation {self.recompute!r}: choose one of {', '.join(MODES)}")
        if isinstance(self.memory_budget, str):
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if isinstance(self.offload, str):
            object.__setattr__(self, "offload", _parse_offload(self.offload))
        if isinstance(self.chunk_size, str):
            object.__setattr__(self, "chunk_size", parse_bytes(self.chunk_size))
        size, budget = self.chunk_size, self.memory_budget
        assert not isinstance(size, str) and not isinstance(budget, str)  # read above
        if size is not None and size < 4:
            raise ConfigError(f"--chunk-size is the bytes of float32 a chunk holds, at least 4 (got {size:g})")
        if size is not None and budget is not None and size > budget:
            raise ConfigError(f"--chunk-size {size:,.0f} is more than the device's --memory-budget {budget:,.0f}: no "
                              "chunk could ever be on the device; give a chunk size well below the budget (a few MB)")
        if self.offload_activations is not None:
            from pipefold.plan.activation_offload import parse_share

            share = parse_share(self.offload_activations)
            object.__setattr__(self, "offload_activations", share or None)

    @property
    def budget(self) -> float | None:
        """The memory budget in bytes."""
        assert not isinstance(self.memory_budget, str)
        return self.memory_budget

    @property
    def offloaded(self) -> tuple[int, int] | None:
        """(k, k') of offloading."""
        assert not isinstance(self.offload, str)
        return self.offload

    @property
    def chunk_elements(self) -> int | None:
        """The elements of float32 one chunk holds (None: chosen by the runtime)."""
        assert not isinstance(self.chunk_size, str)
        return None if self.chunk_size is None else int(self.chunk_size) // 4

    @property
    def activation_share(self) -> float:
        """The share of activations offloaded (0: none)."""
        assert not isinstance(self.offload_activations, str)
        return self.offload_activations or 0.0


def _parse_offload(text: str) -> tuple[int, int]:
    """'2,1' -> (2, 1)."""
    try:
        k, kprime = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"cannot read --offload {text!r}: use K,K2 such as 2,1 (K layers resident, K2 evicted)") from None
    if not 1 <= kprime <= k:
        raise ConfigError(f"--offload {text}: K layers stay on the device and K2 of them are evicted at once, so "
                          f"1 <= K2 <= K (got K={k}, K2={kprime}); e.g. --offload 2,1")
    return k, kprime


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    """Checkpoints saved as the run goes, and the one it starts from (:mod:`pipefold.runtime.launch.checkpoint`)."""

    checkpoint_dir: str | None = None
    """Save checkpoints into this folder (the last step's always)."""
    checkpoint_every: int | None = None
    """Also save one after every N steps."""
    keep_last: int | None = None
    """Keep only the N newest checkpoints of the folder (None: all)."""
    resume: str | None = None
    """Start from a checkpoint: '' the newest good one in ``checkpoint_dir``; else a checkpoint
    (``D/step-00000004``) or a folder of them. None: start from the initial weights."""

    def __post_init__(self) -> None:
        _at_least_one(self, "checkpoint_every")
        if self.keep_last is not None and not (isinstance(self.keep_last, int) and self.keep_last >= 1):
            raise ConfigError(f"--keep-last N keeps the N newest checkpoints: N >= 1 (got {self.keep_last!r})")

    @property
    def any(self) -> bool:
        return self.checkpoint_dir is not None or self.resume is not None


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """The links between ranks, made to behave like a network."""

    network: str | None = None
    """Link conditions (:func:`pipefold.sim.network.parse_network`): emulated in the runtime's links, or with
    ``netns`` made real by tc on veth links and a traffic generator."""
    netns: bool = False
    """Run each rank in its own network namespace (needs root; :mod:`pipefold.runtime.launch.netns`)."""

    @cached_property
    def parsed(self) -> Network | None:
        """The network, read once."""
        from pipefold.sim.network import parse_network

        return None if self.network is None else parse_network(self.network)


@dataclass(frozen=True)
class Applies:
    """Options that mean something in one mode only: given in another, they are refused in one line."""

    options: tuple[str, ...]
    """Settings (their flat names, the command line's option names)."""
    when: Callable[[RunSpec], bool]
    """The mode in which they apply."""
    message: str
    """The refusal, with ``{option}`` for the option as the command line writes it."""


_PLANNED = ("schedule", "devices", "microbatches", "model", "model_config", "layers", "hidden", "heads", "vocab_size",
            "batch",
            "seq", "optimizer", "partition", "recompute", "memory_budget", "offload", "offload_activations")
"""What a plan decides: given with ``plan``, refused."""


RULES: tuple[Applies, ...] = (
    Applies(("damping", "ema", "fill_bubbles", "kfac_distribution"), lambda s: s.optimizer.name == "kfac",
            "{option} tunes K-FAC: add --optimizer kfac, or drop it"),
    Applies(("kfac_distribution",), lambda s: s.parallel.dp > 1,
            "{option} spreads K-FAC's work over data-parallel copies, and --dp 1 has one: give --dp 2 or more, or drop "
            "it"),
    Applies(("adapt_every",), lambda s: s.schedule.adaptive,
            "{option} spaces adaptive-kfkb's choices of k: use --schedule adaptive-kfkb, or drop it"),
    Applies(("moe", "ep"), lambda s: s.model.name == "moe",
            "{option} shapes a mixture of experts: add --model moe, or drop it"),
    Applies(("heads", "seq", "data", "vocab_size"), lambda s: s.model.sequences,
            "{option} sizes a language model, and the mlp has no attention, sequences or text: use --model gpt, or "
            "drop it"),
    Applies(("dp", "fsdp", "zero1", "tp", "sequence_parallel", "cp"), lambda s: not s.planned,
            "{option} lays out data- or tensor-parallel copies, and a plan (--plan, --schedule auto) runs the one "
            "pipeline it "
            "planned: name a schedule with --schedule, or drop it"),
    Applies(("sequence_parallel",), lambda s: s.parallel.tensor_parallel,
            "{option} splits each block's tokens over the tensor-parallel ranks: give --tp 2 or more, or drop it"),
    Applies(("keep_last", "checkpoint_every"), lambda s: s.checkpoints.checkpoint_dir is not None,
            "{option} saves into --checkpoint-dir D: give one, or drop it"),
    Applies(_PLANNED, lambda s: s.plan is None,
            "--plan fixes the model, schedule, split and memory; drop {option} (or plan again with pipefold plan "
            "--profile)"),
    Applies(("partition", "recompute", "offload", "offload_activations"), lambda s: not s.schedule.auto,
            "--schedule auto chooses the split and recomputation itself; drop {option}"),
    Applies(("offload_activations",), lambda s: not s.schedule.adaptive and s.optimizer.name != "kfac",
            "{option} offloads in the one schedule a run names, and adaptive-kfkb and K-FAC's cycle run several: "
            "drop it, or name a schedule and another optimizer"),
    Applies(("offload_activations",), lambda s: s.memory.offload is None,
            "{option} moves what a stage's forward saves, and --offload's layers keep their saves themselves: "
            "choose one of them"),
    Applies(("chunk_size",), lambda s: s.memory.state_chunks,
            "{option} sizes the model-state chunks: add --state-chunks, or drop it"),
    Applies(("state_chunks",), lambda s: not s.planned,
            "{option} places the optimizer state of a schedule you name: use it without --plan or --schedule auto"),
    Applies(("state_chunks",), lambda s: not (s.parallel.fsdp or s.parallel.tp != 1 or s.memory.offload is not None),
            "{option} chunks the optimizer state of plain stages' parameters: "
            "FSDP shards the state already, and tensor-parallel and --offload's layers run without chunks"),
    Applies(("state_chunks",), lambda s: s.optimizer.name != "kfac",
            "{option} chunks the state of an elementwise optimizer: use adamw or sgd"),
    Applies(("state_chunks",), lambda s: not (s.devices.precision.master_weights and s.parallel.zero1),
            "{option} with master weights keeps each copy's own masters in its chunks: drop --zero1, or keep "
            "float32 parameters (--dtype bf16 without --master-weights) to share the chunks with ZeRO-1"),
    Applies(("state_chunks",), lambda s: s.memory.recompute != "auto",
            "{option} fills what --memory-budget leaves after the activations with optimizer state, and --recompute "
            "auto fits the activations to it with the whole state on the device: choose one"),
    Applies(("state_chunks",), lambda s: s.checkpoints.checkpoint_dir is None and s.checkpoints.resume is None
            and not s.reliability.post_validate,
            "{option} keeps host chunks' parameters apart from the device's, which checkpoints and --post-validate's "
            "rollback do not read yet: drop one of them"),
    Applies(("network", "netns"), lambda s: not s.planned,
            "--network and --netns run a schedule you name: use them without --plan or --schedule auto"),
    Applies(("ep_overlap",), lambda s: s.parallel.ep > 1,
            "{option} hides the all-to-alls of expert parallelism under other compute: give --ep 2 or more (and a "
            "--dp it divides), or drop it"),
)
"""Which options go with which modes, checked by :meth:`RunSpec.check`: a new option that belongs to one mode is
refused in the others by adding it here."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """A training run, as ``pipefold train`` takes it: checked once, when made."""

    steps: int = 20
    """Optimizer steps."""
    check: bool = False
    """Keep the first step's gradients and compare them with one process's (``--check``)."""
    plan: str | None = None
    """Run the plan in this file (``pipefold plan --profile ... -o FILE``): its model, schedule, split and
    recomputation (resolved by :mod:`pipefold.train.planned`)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    parallel: Parallel = field(default_factory=Parallel)
    memory: MemorySpec = field(default_factory=MemorySpec)
    optimizer: Optimizer = field(default_factory=Optimizer)
    reliability: Reliability = field(default_factory=Reliability)
    checkpoints: CheckpointSpec = field(default_factory=CheckpointSpec)
    devices: Devices = field(default_factory=Devices)
    links: LinkSpec = field(default_factory=LinkSpec)

    SECTIONS: ClassVar[tuple[str, ...]] = ("model", "schedule", "parallel", "memory", "optimizer", "reliability",
                                           "checkpoints", "devices", "links")

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def flat(cls, **settings: Any) -> RunSpec:
        """The run with these settings, by their flat names (the command line's: ``schedule``, ``devices``,
        ``optimizer``, ``lr``, ``dp``...); the rest at their defaults."""
        top, sections = _route(settings)
        return cls(**top, **{name: _SECTION_TYPES[name](**values) for name, values in sections.items()})

    def replace(self, **settings: Any) -> RunSpec:
        """This run with some settings changed (flat names, as :meth:`flat`), checked again."""
        top, sections = _route(settings)
        return dataclasses.replace(self, **top, **{name: dataclasses.replace(getattr(self, name), **values)
                                                   for name, values in sections.items()})

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.SECTIONS}
        for name in self.SECTIONS:
            section = getattr(self, name)
            out.update({_flat_name(f): getattr(section, f.name) for f in dataclasses.fields(section)})
        return out

    def given(self) -> set[str]:
        """The settings (flat names) that differ from their defaults."""
        return {name for name, value in self.settings().items() if value != _DEFAULTS[name]}

    @property
    def planned(self) -> bool:
        """Whether a plan decides the run (``plan``, or the schedule 'auto')."""
        return self.plan is not None or self.schedule.auto

    @property
    def local(self) -> bool:
        """Whether this process starts the ranks' fork server as soon as it can
        (:func:`pipefold.runtime.launch.processes.start_server`): not under torchrun (each worker is a rank and
        starts none),
        nor with ``--netns`` (the server starts with the ranks, once the namespaces are up)."""
        return not under_torchrun() and not self.links.netns

    def _check(self) -> None:
        """Every rule that joins settings, in one place (each section has checked its own)."""
        given = self.given()
        for rule in RULES:
            named = [name for name in rule.options if name in given]
            if named and not rule.when(self):  # a rule is asked only where one of its options is given
                raise ConfigError(rule.message.format(option=_OPTIONS[named[0]]))
        if self.steps < 1:
            raise ConfigError(f"--steps must be at least 1 (got {self.steps})")
        if self.check and self.checkpoints.resume is not None:
            raise ConfigError("--check compares the first step, from the initial weights, with one process: drop it "
                              "with --resume")
        if self.schedule.auto and self.memory.budget is None:
            raise ConfigError("--schedule auto plans for --memory-budget BYTES per device (e.g. 64MB); give one")
        if under_torchrun() and self.planned:
            # Before planning: each worker would profile on its own, for minutes, while the others wait in the store.
            raise ConfigError("--plan and --schedule auto run locally for now: plan with pipefold profile and pipefold "
                              "plan --profile PROFILE --memory-budget BYTES, then give torchrun the plan's schedule "
                              "and flags")
        if self.devices.p2p == "sockets" and under_torchrun() and not torchrun_on_one_machine():
            raise ConfigError("--p2p sockets joins ranks on one machine, and torchrun started these on several: use "
                              "--p2p auto or gloo")
        if self.links.netns:
            if under_torchrun():
                raise ConfigError("--netns starts local ranks in namespaces it makes; under torchrun make them with "
                                  "`python -m pipefold.runtime.launch.netns up` and start each rank with "
                                  "`ip netns exec`")
            if self.links.network is None:
                raise ConfigError("--netns needs --network: the conditions the namespaces' links emulate, such as "
                                  "constant:bandwidth=50MB or preempt:seed=1,idle=50MB,busy=5MB,on=4,off=4")
        if self.links.parsed is not None:
            self.links.parsed.check_devices(self.schedule.devices)
        check_together(self.parallel, self.optimizer, adaptive=self.schedule.adaptive,
                       network=self.links.network is not None, netns=self.links.netns,
                       offload=self.memory.offload is not None, recompute=self.memory.recompute != "none",
                       checkpoints=self.checkpoints.any)
        if self.plan is None:  # a plan's batch and microbatches are the plan's
            shards = self.parallel.dp * self.schedule.microbatches
            if self.model.batch % shards:
                per = (f"{self.parallel.dp} pipelines x {self.schedule.microbatches} microbatches"
                       if self.parallel.dp > 1 else f"{self.schedule.microbatches} microbatches")
                raise ConfigError(f"a batch of {self.model.batch} does not split into {per}; use a --batch that is a "
                                  f"multiple of {shards}")
        if self.reliability.save_model is not None:
            from pipefold.files import check_writable

            check_writable(self.reliability.save_model, "model")


_SECTION_TYPES: dict[str, type] = {"model": ModelSpec, "schedule": ScheduleSpec, "parallel": Parallel,
                                   "memory": MemorySpec, "optimizer": Optimizer, "reliability": Reliability,
                                   "checkpoints": CheckpointSpec, "devices": Devices, "links": LinkSpec}


def profiled_settings(train: dict[str, Any]) -> dict[str, Any]:
    """The run settings (flat names, as :meth:`RunSpec.flat` takes them) of the model and size a profile recorded
    (:attr:`pipefold.plan.profile.Profile.train`): a profile records every size it was given, and a model without
    sequences takes no heads or sequence length."""
    from pipefold.models import REGISTRY

    out = {"model": train["model"], "model_config": train.get("model_config"), "batch": int(train["batch"]),
           "seq": int(train["seq"]), "optimizer": train["optimizer"], "microbatches": int(train["microbatches"]),
           **{k: None if train.get(k) is None else int(train[k]) for k in ("layers", "hidden", "heads")}}
    if "seed" in train:
        out["seed"] = int(train["seed"])
    if "dtype" in train:
        out["dtype"] = str(train["dtype"])
    if train["model"] in REGISTRY and not REGISTRY[train["model"]].sequences:
        del out["heads"], out["seq"]
    return out


def _flat_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag", f.name)


def _fields() -> Iterator[tuple[str | None, dataclasses.Field[Any]]]:
    for f in dataclasses.fields(RunSpec):
        if f.name not in RunSpec.SECTIONS:
            yield None, f
    for name in RunSpec.SECTIONS:
        for f in dataclasses.fields(_SECTION_TYPES[name]):
            yield name, f


_WHERE: dict[str, tuple[str | None, str]] = {}
"""Flat name -> (section, field name); None: a field of the run spec itself."""
_DEFAULTS: dict[str, Any] = {}
_OPTIONS: dict[str, str] = {}
"""Flat name -> the option as the command line writes it."""
_DEFAULTS_OF: dict[type, dict[str, Any]] = {}
for _section, _f in _fields():
    _name = _flat_name(_f)
    assert _name not in _WHERE, f"two settings are called {_name}"
    _WHERE[_name] = (_section, _f.name)
    _OPTIONS[_name] = _f.metadata.get("option", "--" + _name.replace("_", "-"))
    if _section is not None:
        _DEFAULTS[_name] = _f.default
        _DEFAULTS_OF.setdefault(_SECTION_TYPES[_section], {})[_f.name] = _f.default
    elif _f.default is not dataclasses.MISSING:
        _DEFAULTS[_name] = _f.default

SETTINGS: tuple[str, ...] = tuple(_WHERE)
"""Every setting's flat name: the options of ``pipefold train`` that describe the run."""


def _route(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        if name not in _WHERE:
            raise TypeError(f"a run has no setting {name!r}; its settings: {', '.join(SETTINGS)}")
        section, attr = _WHERE[name]
        if section is None:
            top[attr] = value
        else:
            sections.setdefault(section, {})[attr] = value
    return top, sections

"""The registry of schedule families by name.

Every entry is a pure function of (devices, microbatches, options) that
returns a :class:`~pipefold.ir.Schedule`: no processes, no torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipefold._gc import paused_gc
from pipefold.errors import ConfigError
from pipefold.ir import SEQ_CHUNKS, VOCAB, Schedule, check_size
from pipefold.schedules.bidirectional import chimera, dualpipe
from pipefold.schedules.controllable import v_block_schedule, v_half, v_min, v_zb
from pipefold.schedules.dualpipe_v import dualpipev
from pipefold.schedules.interleaved import interleaved_1f1b, interleaved_zb, looped_bfs
from pipefold.schedules.kfkb import gpipe, kfkb, one_f_one_b
from pipefold.schedules.vocab import with_vocab
from pipefold.schedules.vshape import one_f_one_b_v, zb_v
from pipefold.schedules.zero_bubble import zb_h, zb_h1, zb_h2

__all__ = ["REGISTRY", "Option", "ScheduleSpec", "build", "get", "looks_like_file", "names"]


def _no_search(p: int, m: int) -> Sequence[int]:
    return ()


@dataclass(frozen=True, kw_only=True)
class Option:
    """One knob of a schedule family."""

    name: str
    default: int
    help: str
    minimum: int = 1
    most: int | None = None
    """The largest value it takes (None: no limit)."""
    search: Callable[[int, int], Sequence[int]] = _no_search
    """Values worth trying for p devices and m microbatches (the planner's search space); empty: the default."""
    planned: bool = True
    """Whether the budget planner's candidates name it; False for a knob it leaves at its default unnamed (sequence
    chunks, whose per-pass overheads a cost model of whole microbatches does not see)."""


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """A registered schedule family."""

    name: str
    build: Callable[..., Schedule]
    description: str
    options: tuple[Option, ...] = ()
    memory: str = ""
    """Peak activation memory per device in units of M, as a formula for the docs and listings."""
    min_microbatches: Callable[[int], int] = lambda p: 1
    """The fewest microbatches the family can schedule on p devices."""
    stages_per_device: Callable[[Mapping[str, Any]], int] = lambda options: 1
    """Stages each device holds, from the resolved options (v for looped chunks, 2 for the V shape): what
    :func:`build` checks against :data:`pipefold.ir.MAX_STAGE_MICROBATCHES` before generating."""
    vocab_warmup: int = 0
    """Forwards the family's build adds to every device's warm-up (its ``warmup_extra``) where the output layer is
    split by vocabulary: with a fused backward the last stage's backward of a microbatch waits for every device's
    ``T`` of it, and one more forward in flight keeps the devices busy meanwhile, for one more microbatch's
    activations (Yeung et al.'s 1F1B arrangement holds more too)."""

    def option(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)


def _gap(name: str, help: str, most: int = 3) -> Option:
    return Option(name=name, default=1, help=help, search=lambda p, m: tuple(range(1, most + 1)))


_V = Option(name="v", default=2, help="stages (model chunks) per device", search=lambda p, m: (2, 3, 4))
_SEQ = Option(name=SEQ_CHUNKS, default=1, help="sequence chunks per microbatch, pipelined with their causal "
                                                 "dependency (Seq1F1B; 1: whole sequences)", planned=False)
_VOCAB = Option(name=VOCAB, default=0, minimum=0, most=1, planned=False,
                help="1: the output layer split by vocabulary over every device, its passes S and T placed into the "
                     "schedule (Vocabulary Parallelism); 0: on the last stage")

_COMBINED = Option(name="combined", default=0, minimum=0, most=1, planned=False,
                   help="1: each steady-state forward runs together with the next backward as an overlapped pair "
                        "(combined 1F1B: one microbatch's expert all-to-alls under the other's compute), at twice "
                        "1F1B's memory")


def _chunks(options: Mapping[str, Any]) -> int:
    return int(options["v"])


def _two(options: Mapping[str, Any]) -> int:
    return 2

REGISTRY: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in [
        ScheduleSpec(name="gpipe", options=(_SEQ, _VOCAB), build=gpipe, memory="m",
                     description="GPipe: all forwards, then all backwards (Huang et al. 2019)"),
        ScheduleSpec(name="1f1b", options=(_SEQ, _VOCAB, _COMBINED), build=one_f_one_b,
                     memory="p-i (p-i+1 with vocab=1, 2(p-i) with combined=1)",
                     vocab_warmup=1,
                     description="1F1B / PipeDream-Flush: warm-up, then one forward one backward"),
        ScheduleSpec(name="interleaved-1f1b", stages_per_device=_chunks, build=interleaved_1f1b, options=(_V, _VOCAB),
                     memory="~p+(p-1)/v",
                     description="Interleaved 1F1B (Megatron-LM): v looped chunks per device, bubble / v"),
        ScheduleSpec(name="interleaved-zb", stages_per_device=_chunks, build=interleaved_zb, options=(_V,),
                     memory="min(m,p+(v-1)(g-p)/v), g: microbatches per round, p when p divides m",
                     description="Interleaved zero bubble (torch's ScheduleInterleavedZeroBubble): v looped "
                                 "chunks, B/W split, 1F1B's memory"),
        ScheduleSpec(name="looped-bfs", stages_per_device=_chunks, build=looped_bfs, options=(_V,), memory="m",
                     description="Breadth-first looped (Lamy-Poirier 2022): all microbatches chunk by chunk"),
        ScheduleSpec(name="kfkb", build=kfkb, memory="min(m, k(p-i))",
                     options=(Option(name="k", default=2, help="microbatches per group",
                                     search=lambda p, m: range(1, m + 1)), _SEQ, _VOCAB),
                     description="kFkB (Ada-Grouper): k forwards then k backwards; k=1 is 1F1B, k=m GPipe"),
        ScheduleSpec(name="zb-h1", options=(_SEQ, _VOCAB), build=zb_h1, memory="p",
                     description="Zero Bubble H1: B/W split, W deferred into bubbles, 1F1B's memory"),
        ScheduleSpec(name="zb-h2", options=(_SEQ, _VOCAB), build=zb_h2, memory="2p-1",
                     description="Zero Bubble H2: extra warm-up fills the start, about twice 1F1B's memory"),
        ScheduleSpec(name="zb-h", build=zb_h, memory="p+extra",
                     options=(Option(name="extra", default=0, minimum=0, search=lambda p, m: range(p),
                                     help="extra warm-up forwards and deferred Ws (0: zb-h1, p-1: zb-h2)"),
                              _SEQ, _VOCAB),
                     description="Zero Bubble between H1 and H2: memory p+extra buys a shorter start-up"),
        ScheduleSpec(name="zb-v", options=(_SEQ, _VOCAB), stages_per_device=_two, build=zb_v,
                     memory="(min(m,2p-1-i)+min(m,i+1))/2, p for m>=2p-1",
                     description="Zero Bubble V: V placement, B/W split, W fills the gaps; 1F1B's memory, ~no bubble"),
        ScheduleSpec(name="1f1b-v", options=(_SEQ, _VOCAB), stages_per_device=_two, build=one_f_one_b_v,
                     memory="(min(m,2p-1-i)+min(m,i+1))/2, p for m>=2p-1",
                     description="1F1B on the V placement: fused backward, warm-up of 2p-1 forwards, then 1F1B"),
        ScheduleSpec(name="dualpipev", stages_per_device=_two, build=dualpipev, memory="p+1/2 (2p+1 chunks)",
                     min_microbatches=lambda p: 2 * p,
                     description="DualPipeV (DeepSeek): DualPipe cut in half, V placement, F&B overlap, B/W split"),
        ScheduleSpec(name="chimera", build=chimera, memory="p/2+1+min(i,p-1-i)", min_microbatches=lambda p: p,
                     description="Chimera (Li & Hoefler): down and up 1F1B pipelines merged, two replicas, "
                                 "m a multiple of p"),
        ScheduleSpec(name="dualpipe", build=dualpipe, memory="p+1", min_microbatches=lambda p: 2 * p,
                     description="DualPipe (DeepSeek): two opposite pipelines, F of one overlapped with B of the "
                                 "other, B/W split at the ends"),
        ScheduleSpec(name="v-zb", stages_per_device=_two, options=(_VOCAB,), build=v_zb, memory="p",
                     description="V-ZB (controllable memory): V building block at 1F1B's memory, ~no bubble"),
        ScheduleSpec(name="v-half", stages_per_device=_two, options=(_VOCAB,), build=v_half, memory="(p+2)//2",
                     description="V-Half (controllable memory): V building block at half of 1F1B's memory"),
        ScheduleSpec(name="v-min", stages_per_device=_two, options=(_VOCAB,), build=v_min, memory="(p+4)//3",
                     description="V-Min (controllable memory): V building block at a third of 1F1B's memory"),
        ScheduleSpec(name="v-block", stages_per_device=_two, build=v_block_schedule, memory="sum of ceil(lifespan/T)",
                     options=(_gap("f0", "slots per hop of the chunk-0 forward chain"),
                              _gap("f1", "slots per hop of the chunk-1 forward chain"),
                              _gap("b0", "slots per hop of the chunk-0 backward chain", most=4),
                              _gap("b1", "slots per hop of the chunk-1 backward chain"),
                              _gap("turn", "slots between the two backward chains on the last device")),
                     description="Any V building block: the gaps between passes set memory (v-min is all 1s)"),
    ]
}


def names() -> list[str]:
    """Registered schedule names, in listing order."""
    return list(REGISTRY)


def looks_like_file(text: str) -> bool:
    """Whether ``text`` names a schedule file rather than a registered schedule.

    A path (with a folder separator) or a name ending in a schedule suffix (any case) is a file; a
    registered name (``1f1b``, ``kfkb:k=3``) is the registered schedule even when a file of that name is
    in the current folder (give the file as ``./1f1b``); anything else is a file if one exists.
    """
    if os.path.sep in text or "/" in text or text.lower().endswith((".txt", ".json", ".csv")):
        return True
    if text.partition(":")[0] in REGISTRY:
        return False
    return os.path.isfile(text)


def get(name: str) -> ScheduleSpec:
    """The spec registered as ``name``; an unknown name lists the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown schedule {name!r}; known schedules: {', '.join(REGISTRY)}") from None


def build(name: str, devices: int, microbatches: int, **options: Any) -> Schedule:
    """Generate schedule ``name`` for ``devices`` pipeline devices and ``microbatches`` microbatches.

    ``options`` are the family's knobs (see :func:`get` and ``pipefold schedules``);
    omitted ones take their defaults.
    """
    spec = get(name)
    _check_positive("devices", devices)
    _check_positive("microbatches", microbatches)
    least = spec.min_microbatches(devices)
    if microbatches < least:
        raise ConfigError(f"{name} needs at least {least} microbatches on {devices} devices (got {microbatches}); "
                          f"use --microbatches {least} or more")
    resolved = _resolve_options(spec, options)
    check_size(devices * spec.stages_per_device(resolved), microbatches * resolved.get(SEQ_CHUNKS, 1),
               f"{name} on {devices:,} devices with {microbatches:,} microbatches", devices=devices)
    vocab = resolved.pop(VOCAB, 0)
    extra = {"warmup_extra": spec.vocab_warmup} if vocab and spec.vocab_warmup else {}
    with paused_gc():
        schedule = spec.build(devices, microbatches, **resolved, **extra)
        return with_vocab(schedule) if vocab else schedule


def _check_positive(label: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{label} must be a positive integer (got {value!r})")


def _resolve_options(spec: ScheduleSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    resolved: dict[str, Any] = {}
    for key, value in options.items():
        opt = spec.option(key)
        if opt is None and key == VOCAB:
            able = ", ".join(n for n, other in REGISTRY.items() if other.option(VOCAB))
            raise ConfigError(f"schedule {spec.name} cannot split its output layer by vocabulary; schedules that "
                              f"can: {able}")
        if opt is None and key == SEQ_CHUNKS:
            able = ", ".join(n for n, other in REGISTRY.items() if other.option(SEQ_CHUNKS))
            raise ConfigError(f"schedule {spec.name} cannot cut microbatches into sequence chunks; schedules that "
                              f"can: {able}")
        if opt is None:
            takes = ", ".join(o.name for o in spec.options) or "none"
            raise ConfigError(f"schedule {spec.name} takes no option {key!r}; its options: {takes}")
        if not isinstance(value, int) or isinstance(value, bool) or value < opt.minimum or \
                (opt.most is not None and value > opt.most):
            bound = f">= {opt.minimum}" if opt.most is None else f"from {opt.minimum} to {opt.most}"
            raise ConfigError(f"option {key} of {spec.name} must be an integer {bound} (got {value!r})")
        resolved[key] = value
    for opt in spec.options:
        resolved.setdefault(opt.name, opt.default)
    return resolved

"""The command line's arguments: shared argument groups, the parser, and the table of which options go with
which modes (read by the parser, so that a new option cannot forget it)."""


from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from pipefold import schedules
from pipefold.cli import ranges
from pipefold.errors import ConfigError
from pipefold.ir import MAX_DEVICES, formats

DEFAULT_SCHEDULE = "zb-h1"


DEFAULT_KFAC_WORK = "KA=0.5,KG=0.5,KI=2,KP=0.25"
"""K-FAC's work per device share for `pipefold pipefisher`, against F = B = W = 1."""


DEFAULT_DEVICES = 4


DEFAULT_MICROBATCHES = 8


def degrees(text: str) -> tuple[int, ...] | None:
    """Tensor-parallel degrees written ``2`` or ``2,1``: whole numbers >= 1 separated by commas; None if not."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        return None
    return out if out and all(1 <= t <= MAX_DEVICES for t in out) else None


def _tp_degrees(text: str) -> int | tuple[int, ...]:
    """``train --tp 2`` (every device) or ``--tp 2,1`` (one degree per device)."""
    out = degrees(text)
    if out is None:
        raise argparse.ArgumentTypeError(f"a degree from 1 to {MAX_DEVICES} for every device (2), or one per device "
                                         f"(2,1); got {text!r}")
    return out[0] if len(out) == 1 else out


def _spb_layers(text: str) -> tuple[int, ...]:
    """``train --spb 6,3``: per data-parallel copy, the last layers it backpropagates through."""
    try:
        out = tuple(int(part) for part in text.split(","))
    except ValueError:
        out = ()
    if not out or any(k < 1 or k > 100_000 for k in out):
        raise argparse.ArgumentTypeError(f"one whole number from 1 to 100000 per data-parallel copy, such as 6,3; got "
                                         f"{text!r}")
    return out


def _degree_list(what: str, example: str) -> Callable[[str], tuple[int, ...]]:
    """A parser of ``plan --cluster``'s lists of degrees searched (``--cp 1,2,4``): 1 to MAX_DEVICES each, sorted,
    once each; anything else one line naming ``what`` and the ``example``."""

    def parse(text: str) -> tuple[int, ...]:
        out = degrees(text)
        if out is None:
            raise argparse.ArgumentTypeError(f"{what} degrees from 1 to {MAX_DEVICES} separated by commas, such as "
                                             f"{example}; got {text!r}")
        return tuple(sorted(set(out)))

    return parse


_cp_degrees = _degree_list("context-parallel", "1,2,4")
_ep_degrees = _degree_list("expert-parallel", "1,8,64")


def _seq_chunks(text: str) -> tuple[int, ...]:
    """``plan --cluster --seq-chunks 1,2,4``: the sequence chunks per microbatch searched."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or not all(1 <= c <= MAX_SEQ_CHUNKS for c in out):
        raise argparse.ArgumentTypeError(f"sequence chunks from 1 to {MAX_SEQ_CHUNKS} separated by commas, such as "
                                         f"1,2,4; got {text!r}")
    return tuple(sorted(set(out)))


MAX_SEQ_CHUNKS = 64
"""The most sequence chunks per microbatch ``plan --cluster`` searches (each multiplies the units to simulate)."""


class _Once(argparse._StoreAction):
    """An option that takes a value: given under two of its names with two values (``--devices 8 --pp 2``) it is
    refused, where argparse would keep the last one silently. One name given again still overrides, as on most
    command lines (``alias pt='pipefold train --steps 5'; pt --steps 2``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        seen: dict[str, tuple[str | None, Any]] = parser.__dict__.setdefault("_given_once", {})
        if self.dest in seen and seen[self.dest][0] != option_string and seen[self.dest][1] != values:
            first, before = seen[self.dest]
            parser.error(f"{first} {_shown(before)} and {option_string} {_shown(values)} are two names of one "
                         f"option ({', '.join(self.option_strings)}); give one")
        seen[self.dest] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line, not a usage dump, refuses an option given under two
    names with two values (:class:`_Once`), and reads every argument that starts with a minus and a digit as a
    value (``--offload -1,1``, ``--lr -1e-3``: refused by the option's own check, which says what works)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)
        self._negative_number_matcher = ranges.NEGATIVE

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.__dict__["_given_once"] = {}  # what this parse was given (each subcommand's parser keeps its own)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def option_flag(name: str) -> str:
    """A schedule option's flag, without its dashes: ``seq_chunks`` is ``seq-chunks``."""
    return name.replace("_", "-")


def _add_shape(p: argparse.ArgumentParser, *, options: bool = True) -> None:
    _devices_flag(p, DEFAULT_DEVICES)
    p.add_argument("--microbatches", "-m", type=int, default=DEFAULT_MICROBATCHES, metavar="M",
                   help=f"microbatches per step (default {DEFAULT_MICROBATCHES})")
    if not options:
        return
    names = sorted({o.name for spec in schedules.REGISTRY.values() for o in spec.options})
    for name in names:
        takers: dict[tuple[str, int], list[str]] = {}  # each (help, default) with the families that have it
        for s in schedules.REGISTRY.values():
            for o in s.options:
                if o.name == name:
                    takers.setdefault((o.help, o.default), []).append(s.name)
        helps = [f"{text} ({', '.join(families)}, default {default})" for (text, default), families in takers.items()]
        flags = ["--v", "--chunks"] if name == "v" else [f"--{option_flag(name)}"]
        p.add_argument(*flags, dest=f"opt_{name}", type=int, default=None, metavar=name.upper(),
                       help="; ".join(sorted(helps)))


def _add_costs(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cost model (per microbatch, per device's share of the model)")
    g.add_argument("--f", type=float, default=1.0, help="forward time (default 1)")
    g.add_argument("--b", type=float, default=1.0, help="input-gradient backward time B (default 1)")
    g.add_argument("--w", type=float, default=1.0, help="weight-gradient backward time W (default 1)")
    g.add_argument("--mem", type=float, default=1.0, help="activation memory M of one microbatch (default 1)")
    g.add_argument("--mem-w", type=float, default=None, metavar="MEM",
                   help="activation memory held between a stage's B and its W, per device share; "
                        "default: the same as --mem; may exceed it")
    g.add_argument("--latency", type=float, default=0.0, help="point-to-point latency between devices (default 0)")
    g.add_argument("--bandwidth", type=float, default=math.inf,
                   help="point-to-point bytes per time unit (default unlimited)")
    g.add_argument("--activation-bytes", type=float, default=0.0,
                   help="bytes sent between stages per microbatch (default 0)")
    g.add_argument("--grad-bytes", type=float, default=0.0, metavar="BYTES",
                   help="gradient bytes of one device's share: what the replicas of a stage all-reduce, as a ring "
                        "over --latency and --bandwidth (default 0)")
    g.add_argument("--opt", type=float, default=0.0, help="optimizer step time of a device's share (default 0)")
    g.add_argument("--weights", type=float, default=0.0, metavar="MEM",
                   help="memory of a device's share of parameters, gradients and optimizer state, in M: added to "
                        "the peaks once per stage held, so replicas pay it twice (default 0)")
    g.add_argument("--overlap", action="store_true",
                   help="a device runs an overlapped pair (F+B) at once: it costs max(F, B), not F + B")
    g.add_argument("--exchange", default=None, metavar="XF,XB",
                   help="time of a device share's expert all-to-alls (mixture of experts: dispatch and combine) in "
                        "a microbatch's forward and in its backward, beside --f and --b (default 0,0)")
    g.add_argument("--exchange-overlap", action="store_true",
                   help="an overlapped pair (F+B: dualpipe, dualpipev, 1f1b --combined 1) runs one part's "
                        "exchanges under the other's compute: it lasts the longer of the two, not their sum")
    g.add_argument("--recompute", type=float, default=0.0, metavar="FRACTION",
                   help="fraction of each forward recomputed in its backward: keeps (1-r) M, B takes r F longer "
                        "(default 0)")
    g.add_argument("--stage-cost", action="append", default=[], metavar="S:F,B,W[,MEM]",
                   help="absolute costs of stage S, overriding the derived ones (repeatable)")
    g.add_argument("--work", default="", metavar="KIND=T,...",
                   help="times of K-FAC's actions per device share: KA and KG per microbatch, KI and KP per step, "
                        "e.g. KA=0.5,KG=0.5,KI=2,KP=0.25 (default 0)")
    g.add_argument("--stash", default="", metavar="KIND=MEM,...",
                   help="memory (M) that KA or KG keeps of its microbatch until it runs, held beyond the "
                        "activations once the microbatch's W freed them (default 0)")
    g.add_argument("--vocab-cost", default=None, metavar="F,B,W[,MEM]",
                   help="the whole output layer's costs per microbatch (forward, input gradient, weight gradient, "
                        "memory of its logits): added to the last stage, or a devices-th in each device's S and T "
                        "where the schedule splits it by vocabulary (--vocab 1); default: in the stages' costs")
    g.add_argument("--offload-time", type=float, default=0.0, metavar="T",
                   help="time to copy what a device's share offloads of one microbatch to host memory, and the "
                        "same back: each OF and RL action, beside the compute, one at a time each way (default 0)")
    g.add_argument("--offloadable", type=float, default=1.0, metavar="FRACTION",
                   help="fraction of what a stage keeps from its forward to its backward that an offload moves "
                        "(default 1)")


def _add_offloading(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activation offloading (PipeOffload; costs: --offload-time, --offloadable)")
    g.add_argument("--offload-activations", metavar="SHARE", default=None,
                   help="offload this share of the (stage, microbatch)s' activations to host memory after their "
                        "forward, back before their backward, the longest-lived first: all, or 0 to 1")
    g.add_argument("--offload-fit", type=float, default=None, metavar="MEM",
                   help="offload the fewest, longest-lived first, that bring every device's peak (activations and "
                        "--weights) to at most MEM")


def _add_model(p: argparse.ArgumentParser, *, layers: int | None, layers_help: str, batch: int,
               batch_help: str) -> None:
    """The model and its size, as train, profile, offload and partition take them (choices from the registry)."""
    from pipefold.models import REGISTRY

    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", choices=[n for n, f in REGISTRY.items() if not f.hf], default="gpt",
                   help="model (default gpt)")
    g.add_argument("--hf", choices=[n for n, f in REGISTRY.items() if f.hf], default=None, metavar="NAME",
                   help=f"a Hugging Face transformers causal LM instead, built from --hf-config (needs pip install "
                        f"'pipefold[hf]'): {', '.join(n for n, f in REGISTRY.items() if f.hf)}")
    p.add_argument("--hf-config", dest="model_config", default=None, metavar="CONFIG",
                   help="with --hf: a transformers config.json, or a config pipefold ships (gpt2-tiny, llama-tiny; "
                        "default: NAME-tiny)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"transformer blocks or MLP blocks ({layers_help}; with --hf: the config's)")
    p.set_defaults(default_layers=layers)
    p.add_argument("--hidden", type=int, default=None, help="width (default 64; with --hf: set in the config)")
    p.add_argument("--heads", type=int, default=None, help="attention heads of the gpt (default 4)")
    p.add_argument("--batch", type=int, default=batch, help=f"{batch_help} (default {batch})")
    p.add_argument("--seq", type=int, default=64, help="sequence length of a language model (default 64)")


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


class _Renamed(argparse.Action):
    """A flag that was renamed: one line saying what to use instead."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} was renamed --devices (-p): it counts devices, and a device may hold "
                     "several stages")


def _devices_flag(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--devices", "-p", type=int, default=default, metavar="P",
                   help=f"pipeline devices (default {default}); a schedule may put several stages on each")
    p.add_argument("--stages", action=_Renamed, help=argparse.SUPPRESS)


def _add_format(p: argparse.ArgumentParser) -> None:
    """--format of the schedule files a command reads (generate's --format is its output's)."""
    p.add_argument("--format", dest="input_format", choices=list(formats.FORMATS), default=None,
                   help="format of schedule files: text, json, csv (pipefold's) or torch-csv "
                        "(torch.distributed.pipelining's); default: from each file's suffix, and torch's CSV "
                        "told by its content")
    _add_renumber(p)


def _add_renumber(p: argparse.ArgumentParser) -> None:
    p.add_argument("--renumber", action="store_true",
                   help="a torch CSV whose last rank numbers its microbatches 1..m (torch's Schedule1F1B writes "
                        "so): shift them to 0..m-1")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipefold", description="Pipeline-parallel schedules: generate, validate, simulate, draw.")
    parser.add_argument("--version", action="version", version=f"pipefold {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("schedules", help="list the schedule families and their options")
    _add_output(p)

    p = sub.add_parser("simulate", help="simulate one schedule: timeline, bubbles, memory")
    p.add_argument("schedule", nargs="?", default=DEFAULT_SCHEDULE,
                   help=f"a registered name (optionally name:key=value,...) or a schedule file "
                        f"(.txt, .json, .csv); default {DEFAULT_SCHEDULE}")
    _add_shape(p)
    _add_costs(p)
    _add_offloading(p)
    _add_output(p)
    _add_format(p)
    p.add_argument("--plot", metavar="FILE", help="write a Gantt chart with memory curves (.png or .svg)")
    p.add_argument("--trace", metavar="FILE", help="write Chrome trace-event JSON (open in Perfetto)")
    p.add_argument("--width", type=int, default=None, help="columns of the ASCII timeline (default: terminal)")
    p.add_argument("--network", metavar="SPEC", default=None,
                   help="links whose latency and bandwidth change over time (times in seconds, so costs are "
                        "seconds): a JSON/CSV profile, constant:latency=S,bandwidth=B or "
                        "preempt:seed=N,idle=B,busy=B,on=S,off=S[,links=1-2]; messages are --activation-bytes")
    p.add_argument("--at", type=float, default=0.0, metavar="SECONDS",
                   help="with --network: start the step this many seconds into the network's timeline")
    g = p.add_argument_group("data-parallel pipelines")
    g.add_argument("--dp", type=int, default=1, metavar="D",
                   help="data-parallel copies of the pipeline (default 1): each stage all-reduces its --grad-bytes "
                        "share among them right after its last weight gradient")
    g.add_argument("--fsdp", action="store_true",
                   help="with --dp: shard the stages instead (AG before a stage's first forward, RS after its last "
                        "weight gradient): --weights is held 1/D, --gathered from AG to RS")
    g.add_argument("--gathered", type=float, default=0.0, metavar="MEM",
                   help="with --fsdp: memory (M) of a device's share of whole parameters and their gradients, held "
                        "from a stage's AG to the end of its RS (default 0)")

    p = sub.add_parser("pipefisher", help="K-FAC's work in a schedule's bubbles (PipeFisher): the cycle of steps, "
                                          "utilization and step time before and after")
    p.add_argument("schedule", nargs="?", default="1f1b",
                   help="a registered name (optionally name:key=value,...) or a schedule file; default 1f1b")
    _add_shape(p)
    _add_costs(p)
    p.set_defaults(work=DEFAULT_KFAC_WORK)
    p.add_argument("--slack", type=float, default=0.0,
                   help="let each step grow by this fraction of the plain step to hold more work (default 0)")
    p.add_argument("--max-steps", type=int, default=16, help="most steps a cycle may take (default 16)")
    p.add_argument("--inline", action="store_true",
                   help="no filling: curvature right after its pass, inversion and preconditioning every step")
    p.add_argument("--plot", metavar="FILE", help="draw the plain step above each step of the cycle (.png or .svg)")
    p.add_argument("--width", type=int, default=None, help="columns of the ASCII timelines (default: terminal)")
    _add_output(p)

    p = sub.add_parser("compare", help="simulate several schedules side by side")
    p.add_argument("schedule", nargs="+", help="registered names, name:key=value,..., or schedule files")
    _add_shape(p)
    _add_costs(p)
    _add_offloading(p)
    _add_output(p)
    _add_format(p)

    p = sub.add_parser("generate", help="write a schedule as text, JSON or CSV")
    p.add_argument("schedule", help="a registered name, optionally name:key=value,...")
    _add_shape(p)
    p.add_argument("--format", choices=list(formats.FORMATS), default=None,
                   help="output format; torch-csv: torch.distributed.pipelining's CSV (default: from the output "
                        "file's suffix, else text)")
    p.add_argument("--output", "-o", metavar="FILE", help="write to FILE instead of standard output")

    p = sub.add_parser("plan", help="the fastest schedule whose peak memory fits a budget: in units of M, or for a "
                                    "profiled model in bytes, with its split and recomputation")
    _add_shape(p, options=False)
    p.add_argument("--memory", metavar="BUDGET",
                   help="peak activation memory per device: in M (3) or as a multiple of 1F1B's peak (0.5x)")
    p.add_argument("--profile", metavar="FILE",
                   help="plan for the model measured in FILE (pipefold profile): seconds and bytes, with the split "
                        "of layers into stages and per-stage recomputation; needs --memory-budget")
    p.add_argument("--memory-budget", metavar="BYTES",
                   help="with --profile: bytes per device for weights, gradients, optimizer state, activations and "
                        "buffers, e.g. 2GiB or 60MB")
    p.add_argument("--output", "-o", metavar="FILE", help="with --profile: write the plan that train --plan runs")
    p.add_argument("--headroom", type=float, default=None, metavar="FRACTION",
                   help="with --profile: the part of the budget a plan leaves free for the prediction's error "
                        "(default 0.05)")
    p.add_argument("--families", metavar="A,B", default=None,
                   help="with --profile: search only these schedule families (default: every registered one)")
    p.add_argument("--world", type=int, default=None, metavar="N",
                   help="with --profile: plan N ranks, searching every dp x tp x pp that makes N (tp: the degrees "
                        "the profile measured, profile --tp), each way of sharding among the dp copies (none, "
                        "ZeRO-1, FSDP), instead of one pipeline of --devices")
    p.add_argument("--state-chunks", action="store_true",
                   help="with --profile: search each layout also with the optimizer state in chunks (train "
                        "--state-chunks): on the device where the step leaves room in the budget, the rest in host "
                        "memory")
    g = p.add_argument_group("a cluster you do not have (instead of --memory or --profile)")
    g.add_argument("--cluster", metavar="NAME|FILE",
                   help="plan a model on this cluster's description: a100-80gb, h100-sxm, h200, or a JSON file "
                        "(docs/cluster.md); needs --hf-config, --global-batch and --seq")
    g.add_argument("--nodes", type=int, default=None, metavar="N", help="with --cluster: its node count")
    g.add_argument("--hf-config", metavar="NAME|FILE", dest="cluster_model",
                   help="with --cluster: the model, a Hugging Face config.json (llama, mistral, qwen2, mixtral, "
                        "deepseek_v3, gpt2) or one pipefold ships (llama3-8b, llama3-70b, llama3.1-405b, llama2-13b, "
                        "llama2-70b, mixtral-8x7b, deepseek-v3, gpt3-175b, megatron-530b)")
    g.add_argument("--global-batch", type=int, default=None, metavar="G", help="with --cluster: sequences per step")
    g.add_argument("--seq", type=int, default=None, metavar="S", help="with --cluster: tokens per sequence")
    g.add_argument("--top", type=int, default=10, metavar="K", help="with --cluster: configurations shown (default 10)")
    g.add_argument("--no-sequence-parallel", action="store_true",
                   help="with --cluster: tensor-parallel ranks each hold the norms', dropouts' and residual stream's "
                        "activations whole (by default they split the tokens: sequence parallelism)")
    g.add_argument("--cp", type=_cp_degrees, default=None, metavar="C[,C...]",
                   help="with --cluster: the context-parallel degrees to search, each sequence split over C ranks "
                        "(ring attention; default: 1 and every power of two that leaves a rank at least "
                        "8192 tokens of a sequence)")
    g.add_argument("--ep", type=_ep_degrees, default=None, metavar="E[,E...]",
                   help="with --cluster and a model with experts: the expert-parallel degrees to search, each MoE "
                        "block's experts spread over groups of E data-parallel copies, tokens dispatched and combined "
                        "by all-to-all (E divides dp and the experts; default: 1, the powers of 8 that divide the "
                        "experts, and the experts)")
    g.add_argument("--moe-imbalance", type=float, default=1.0, metavar="X",
                   help="with --cluster and a model with experts: the busiest expert rank gets X times the mean "
                        "tokens, its experts' work and its all-to-alls X times as long (default 1: balanced)")
    g.add_argument("--node-limit", type=int, default=0, metavar="N",
                   help="with --cluster and a model with experts: each token's experts on at most N nodes "
                        "(DeepSeek-V3's node-limited routing), its hidden state crossing to each once and forwarded "
                        "inside it (default: no limit, every copy sent on its own)")
    g.add_argument("--seq-chunks", type=_seq_chunks, default=None, metavar="C[,C...]",
                   help="with --cluster: also search each microbatch cut along the sequence into C chunks (Seq1F1B), "
                        "with the families that take them (default: whole microbatches only)")
    g.add_argument("--split-vocab", action="store_true",
                   help="with --cluster: also search each family that can split the output layer and the token "
                        "embedding by vocabulary over the pipeline's devices (vocab=1)")
    p.add_argument("--allow-offload", action="store_true",
                   help="with --memory: each schedule may offload activations (those held across its peak, the "
                        "longest-lived first) to fit; the copies take --offload-time each way")
    _add_costs(p)
    _add_output(p)
    p.add_argument("--plot", metavar="FILE", help="draw the memory/makespan frontier (.png or .svg)")

    p = sub.add_parser("profile", help="measure a model on this machine: per-layer times and bytes, the link between "
                                       "two ranks, how ranks share the cores; the input of plan --profile")
    _add_model(p, layers=4, layers_help="default 4", batch=16, batch_help="batch per step")
    p.add_argument("--microbatches", "-m", type=int, default=8, metavar="M", help="microbatches per step (default 8)")
    _devices_flag(p, 4)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each layer, after a warm-up (default 7)")
    p.add_argument("--quick", action="store_true",
                   help="fewer rounds and shorter windows for the link, the collectives, the sharing of the cores and "
                        "the runtime's work per message: a profile in about two thirds of the time, whose figures "
                        "spread more (a first look; plan from a full profile)")
    p.add_argument("--no-link", action="store_true", help="do not measure the link (free transfers)")
    p.add_argument("--no-sharing", action="store_true",
                   help="do not measure how ranks share this machine (each rank has a device of its own)")
    p.add_argument("--no-overhead", action="store_true",
                   help="do not time the runtime's own work per message on a short run of 2 ranks (taken as 0)")
    p.add_argument("--tp", default="1", metavar="T[,T...]",
                   help="also measure the layers split over T tensor-parallel ranks, as train --tp T splits them, "
                        "for plan --world (default 1: whole layers only)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: measure the split layers sequence-parallel, as train --sequence-parallel runs "
                        "them (the gpt model); the plans made from the profile run so")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="measure the passes under autocast to this dtype, as train --dtype runs them: their "
                        "activations, messages and times (a plan from the profile runs in it)")
    p.add_argument("--output", "-o", metavar="FILE", help="write the profile to FILE (default: print it)")
    _add_output(p)

    p = sub.add_parser("calibrate", help="time this device's matrix products and write its cluster file with the "
                                         "matmul efficiency they achieved (for plan --cluster)")
    p.add_argument("--cluster", required=True, metavar="NAME|FILE",
                   help="the cluster file this device belongs to (a100-80gb, h100-sxm, h200 or a JSON file): the "
                        "fractions are of its peak")
    p.add_argument("--dtype", default="bf16", metavar="DTYPE",
                   help="the products' dtype: bf16 (the default: what plan --cluster costs), fp16, tf32 or fp32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to time them (default auto: the GPU if torch sees one)")
    p.add_argument("--largest", type=float, default=1e12, metavar="FLOPS",
                   help="the largest product timed, in operations (default 1e12; sizes from 1e8, two a decade; one "
                        "the device would take over a second on is skipped)")
    p.add_argument("--output", "-o", metavar="FILE", help="write the calibrated cluster file to FILE")
    _add_output(p)

    p = sub.add_parser("offload", help="run a model with at most k layers on the device; compare with the plain model")
    _add_model(p, layers=24, layers_help="default 24", batch=8, batch_help="batch")
    p.add_argument("--k", type=int, default=None, help="most offloaded layers on the device at once (default 2)")
    p.add_argument("--kprime", type=int, default=None, help="layers evicted together, 1..k (default 1)")
    p.add_argument("--budget", default=None, metavar="BYTES",
                   help="parameter bytes allowed on the device, embedding and head included (2e6, 1.5MB, 64MiB): "
                        "picks k and k'")
    p.add_argument("--train", action="store_true", help="also run SGD steps and compare gradients and weights")
    p.add_argument("--steps", type=int, default=3, help="steps to run and time (default 3)")
    p.add_argument("--seed", type=int, default=0)
    _add_output(p)

    p = sub.add_parser("partition", help="split a model's layers into stages: balanced measured cost, or least "
                                         "predicted peak memory; show each device's predicted peak")
    _add_model(p, layers=8, layers_help="default 8", batch=8, batch_help="microbatch of the measurements")
    _devices_flag(p, 4)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--chunks", type=int, default=None, metavar="V",
                   help="V looped chunks per device, run as interleaved-1f1b (default: 1f1b)")
    g.add_argument("--schedule", default=None, help="split into this schedule's stages, with its placement")
    p.add_argument("--microbatches", "-m", type=int, default=None, metavar="M",
                   help="microbatches per step, for the predicted peaks (default 2P)")
    p.add_argument("--by", choices=["params", "time", "memory"], default="time",
                   help="balance parameters or time, or (memory) least predicted device peak within --slack of "
                        "the best time (default time)")
    p.add_argument("--slack", type=float, default=0.02,
                   help="time the memory split may add to the busiest device, as a fraction (default 0.02)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                   help="optimizer whose state the static bytes count (default adamw)")
    _add_output(p)

    p = sub.add_parser("train", help="train a model with a pipeline schedule, one local process per device")
    p.add_argument("--schedule", default="v-half", help="schedule name, optionally name:key=value,... (default v-half)")
    p.add_argument("--devices", "--pp", "-p", type=int, default=4, metavar="P",
                   help="pipeline devices (default 4); a schedule may put several stages on each")
    p.add_argument("--stages", action=_Renamed, help=argparse.SUPPRESS)
    p.add_argument("--dp", type=int, default=1, metavar="D",
                   help="data-parallel copies of the pipeline (default 1): D x P processes, each pipeline on its "
                        "shard of the batch, each stage's gradients averaged across them as soon as its last "
                        "weight gradient is done")
    p.add_argument("--cp", type=int, default=1, metavar="C",
                   help="context-parallel ranks (default 1): each sequence split over C copies of the pipeline, two "
                        "of its 2C chunks on each, attention a ring among them; D x C x P processes (the gpt model)")
    p.add_argument("--zero1", action="store_true",
                   help="with --dp: shard the optimizer state across the copies of each stage (ZeRO-1)")
    p.add_argument("--fsdp", action="store_true",
                   help="with --dp: shard each stage's parameters, gradients and optimizer state across its copies "
                        "(torch's fully_shard): gathered before the stage's first forward, reduce-scattered and freed "
                        "after its last weight gradient")
    p.add_argument("--tp", type=_tp_degrees, default=1, metavar="T[,T...]",
                   help="tensor-parallel ranks per pipeline device (default 1): D x P x T processes, each stage's "
                        "layers split over T ranks by the model's plan (torch's parallelize_module; the gpt and mlp "
                        "models, and --hf llama by transformers' own plan); one T per device gives each device a "
                        "mesh of its own (2,1: device 0 on 2 ranks, device 1 on one), activations resharded between "
                        "them")
    p.add_argument("--spb", type=_spb_layers, default=None, metavar="K[,K...]",
                   help="structured partial backpropagation (Jigsaw), one K per data-parallel copy: copy i "
                        "backpropagates through the model's last K_i layers only, each layer's gradient the mean over "
                        "the copies that computed it; one copy backpropagates through all (see docs/spb.md)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: each block's norms, dropouts and residual stream on each tensor-parallel rank's "
                        "share of the tokens (sequence parallelism; the gpt model)")
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert-parallel ranks (default 1, off), with --model moe and a --dp that N divides: each "
                        "layer's experts spread over groups of N consecutive data-parallel copies, tokens dispatched "
                        "and combined by all-to-all within a group, each expert's gradient summed over the groups "
                        "(--ep D: each expert on one copy; see docs/experts.md)")
    p.add_argument("--ep-overlap", action="store_true",
                   help="with --ep and a schedule of overlapped pairs (dualpipe, dualpipev, 1f1b:combined=1): each "
                        "pair runs one microbatch's all-to-alls while the other microbatch computes")
    p.add_argument("--moe", default=None, metavar="KEY=VALUE[,...]",
                   help="the moe model's experts: experts, top_k, expert_hidden, shared_experts, capacity_factor, "
                        "dropless, aux_loss, normalize, bias_update (default experts=8,top_k=2,aux_loss=0.01, "
                        "dropless, no router bias)")
    p.add_argument("--microbatches", "-m", type=int, default=8, metavar="M", help="microbatches per step (default 8)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    _add_model(p, layers=None, layers_help="default: enough for 2 layers per stage", batch=16,
               batch_help="batch per step")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="vocabulary of the gpt: its embedding's and output projection's entries (default 256, the "
                        "bytes its corpus is read as; more only widens both)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "kfac"], default="adamw",
                   help="adamw (default), sgd, or kfac: K-FAC-preconditioned SGD with momentum 0.9, its work placed "
                        "in the schedule as actions (see --fill-bubbles)")
    p.add_argument("--fill-bubbles", action="store_true",
                   help="with --optimizer kfac: put K-FAC's curvature, inversion and preconditioning in the "
                        "schedule's bubbles, spread over steps (PipeFisher); without it they run right after the "
                        "passes they read, every step")
    p.add_argument("--kfac-distribution", choices=["dp-kfac", "d-kfac"], default="dp-kfac",
                   help="with --optimizer kfac and --dp 2 or more: dp-kfac (default) builds, inverts and applies each "
                        "layer's factors on one copy, which shares the preconditioned gradient; d-kfac builds every "
                        "factor on every copy and all-reduces them (see docs/dpkfac.md)")
    p.add_argument("--damping", type=float, default=0.1, help="K-FAC's damping (default 0.1)")
    p.add_argument("--ema", type=float, default=0.9,
                   help="K-FAC's running-average decay of the factors, 0..1 (default 0.9; 0: the newest only)")
    p.add_argument("--clip", type=float, default=None, help="clip gradients to this global norm")
    p.add_argument("--data", default=None, help="train the gpt on this text file instead of the built-in corpus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true",
                   help="also run one process with the same model and data; print the largest differences")
    p.add_argument("--trace", metavar="FILE", help="write the measured per-rank timeline as Chrome trace JSON (the "
                                                   "first 20 steps and the last)")
    p.add_argument("--plot", metavar="FILE", help="draw the measured Gantt chart above the one simulated from the "
                                                  "run's own costs, and both memory curves")
    p.add_argument("--partition", choices=["time", "params", "memory", "even"], default="time",
                   help="split layers into stages balanced by measured forward+backward time (default), by "
                        "parameters, evenly by count, or (memory) for the least per-device peak under the "
                        "schedule with time within 2%% of the time-balanced split")
    p.add_argument("--recompute", choices=["none", "full", "auto"], default="none",
                   help="activation recomputation: none, full (every layer), or auto: per stage just enough layers "
                        "that each device fits --memory-budget (default none)")
    p.add_argument("--memory-budget", metavar="BYTES", default=None,
                   help="bytes per device for weights, gradients, optimizer state and activations, e.g. 64MB "
                        "(with --recompute auto; with --state-chunks, the device memory the chunks fill)")
    p.add_argument("--offload", metavar="K,K2", default=None,
                   help="each stage keeps at most K of its layers on the device, evicting K2 at once")
    p.add_argument("--offload-activations", metavar="SHARE", default=None,
                   help="move this share of the (stage, microbatch)s' activations to host memory after their "
                        "forward and back before their backward, the longest-lived first: all, or 0 to 1")
    p.add_argument("--state-chunks", action="store_true",
                   help="keep the optimizer state (with --master-weights, the float32 masters and their gradients "
                        "too) in chunks: on the device where the first step leaves room in --memory-budget (all of "
                        "them without one), the rest in host memory, stepped by the CPU")
    p.add_argument("--chunk-size", metavar="BYTES", default=None,
                   help="with --state-chunks: the float32 bytes one chunk holds, e.g. 4MB (default: chosen from "
                        "the parameters' sizes, 256KB to 64MB)")
    p.add_argument("--plan", metavar="FILE", default=None,
                   help="run the plan in FILE (pipefold plan --profile ... -o FILE) as is: its model, schedule, "
                        "split and recomputation; prints the prediction next to what was measured")
    p.add_argument("--network", metavar="SPEC", default=None,
                   help="make the links between ranks behave like this network: a JSON/CSV profile (time -> "
                        "latency, bandwidth), constant:latency=S,bandwidth=B, or "
                        "preempt:seed=N,idle=B,busy=B,on=S,off=S[,links=1-2] (seeded on/off preemption); "
                        "emulated in the runtime's links, or with --netns on real ones")
    p.add_argument("--netns", action="store_true",
                   help="run each rank in its own network namespace on veth links capped by tc at the "
                        "network's idle bandwidth, its preempted periods made by flooding the links (needs root)")
    p.add_argument("--adapt-every", type=int, default=2, metavar="N",
                   help="with --schedule adaptive-kfkb: choose k again every N steps (default 2)")
    p.add_argument("--checkpoint-dir", metavar="D", default=None,
                   help="save checkpoints into folder D (torch.distributed.checkpoint, each rank its own part): "
                        "after the last step, and every N steps with --checkpoint-every; a save is atomic")
    p.add_argument("--checkpoint-every", type=int, metavar="N", default=None,
                   help="with --checkpoint-dir: also save after every N steps")
    p.add_argument("--keep-last", type=int, metavar="N", default=None,
                   help="with --checkpoint-dir: keep only the N newest checkpoints (default: all)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="CKPT",
                   help="start from the newest good checkpoint in --checkpoint-dir, or from CKPT (a D/step-N folder, "
                        "or a folder of them): weights, optimizer state, data position and random state as saved; "
                        "--steps counts from the first run's start. Under torchrun, restarted workers "
                        "(--max-restarts) resume by themselves")
    p.add_argument("--save-model", metavar="FILE", default=None,
                   help="after the last step write the whole model's state_dict to FILE (torch.save), named as the "
                        "plain model nn.Sequential(*pipefold.models.make_model(...).build()) names it")
    p.add_argument("--post-validate", action="store_true",
                   help="step the optimizer before the global NaN/inf and gradient-norm check completes, and roll "
                        "the step back when it fails or needs clipping (Zero Bubble's post-validation)")
    p.add_argument("--max-bad-steps", type=int, default=3, metavar="K",
                   help="a step whose loss or gradients are NaN or inf is skipped with a warning; stop after K "
                        "such steps in a row (default 3)")
    p.add_argument("--action-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="stop the job, naming the rank, when an action runs this long or a rank waits this long "
                        "for one that makes no progress, or stops responding (default 20)")
    _add_renumber(p)
    g = p.add_argument_group("devices")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the ranks compute: a GPU when torch sees one (auto, the default), or the CPU")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="nccl: a GPU per rank; gloo: the CPU, or GPUs the ranks share (tensors staged through "
                        "pinned host memory); auto: nccl when every rank has a GPU of its own")
    g.add_argument("--p2p", choices=["auto", "sockets", "gloo"], default="auto",
                   help="how activations and gradients cross between ranks: sockets (this machine's, the fastest "
                        "there), gloo (the process group's), or auto: sockets when every rank is on this machine "
                        "and gloo is the backend, except with --network, --netns or adaptive-kfkb")
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="on a GPU, run an overlapped pair's (dualpipe's F+B) forward and then its backward, "
                        "instead of both at once on two streams")
    g = p.add_argument_group("precision and compilation")
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="what the passes compute in: bf16 or fp16 under autocast over float32 parameters (messages "
                        "between stages in that dtype); fp32 by default")
    g.add_argument("--master-weights", action="store_true",
                   help="hold the parameters in --dtype, with float32 gradients and float32 master weights in the "
                        "optimizer (Megatron's way) instead of autocast")
    g.add_argument("--loss-scale", default=None, metavar="dynamic|none|N",
                   help="multiply the loss before the backwards so fp16 gradients do not flush to zero: dynamic "
                        "(fp16's default: halves on an overflow, which skips the step on every rank), none, or a "
                        "fixed number")
    g.add_argument("--compile", nargs="?", const="split", default=None, choices=["split", "whole"],
                   help="torch.compile each stage's layers, the backward still split into B and W: split (the "
                        "default: Linears outside the compiled regions) or whole (each layer one region; its W "
                        "is made in B)")
    g.add_argument("--compile-backend", choices=["inductor", "aot_eager", "eager"], default="inductor",
                   help="torch.compile's backend: inductor (fused kernels; needs a C++ compiler on a CPU), "
                        "aot_eager (the same graphs, torch's kernels)")
    _add_output(p)

    p = sub.add_parser("bagpipe", help="train a DLRM whose embedding tables a server process holds, its rows cached "
                                       "ahead of the steps (Bagpipe)")
    p.add_argument("--policy", choices=["oracle", "lru", "none"], default="oracle",
                   help="the cache: the lookahead oracle, LRU, or none (every step fetches its rows and writes them "
                        "back); default oracle")
    p.add_argument("--lookahead", type=int, default=8, help="batches the oracle reads ahead (default 8)")
    p.add_argument("--cache", type=float, default=0.05,
                   help="share of all the tables' rows a trainer caches (default 0.05)")
    p.add_argument("--ahead", type=int, default=1,
                   help="steps ahead of its step a round of fetches runs (default 1; 0 with --policy none)")
    p.add_argument("--skew", type=float, default=0.92,
                   help="share of the accesses on the hottest 1%% of each table's rows (default 0.92)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--tables", type=int, default=4, help="embedding tables (default 4)")
    p.add_argument("--rows", type=int, default=1000, help="rows per table (default 1000)")
    p.add_argument("--dim", type=int, default=16, help="width of a row (default 16)")
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--trainers", type=int, default=1,
                   help="data-parallel trainers, each caching the same rows (default 1)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD's learning rate (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="weights, tables and data (default 0)")
    p.add_argument("--server-memory", default=None, metavar="BYTES",
                   help="memory the server holds the tables in, such as 1GB (default: no limit)")
    p.add_argument("--network", default=None, metavar="SPEC",
                   help="the emulated link between a trainer and the server: constant:latency=2e-3,bandwidth=10MB, "
                        "preempt:..., or a profile file (default: this machine's own)")
    p.add_argument("--netns", action="store_true",
                   help="run the server and each trainer in a network namespace of its own, what each sends capped "
                        "by tc at --network's bandwidth: real links instead of the emulated one (needs root)")
    _add_output(p)

    p = sub.add_parser("validate", help="check schedule files (or generated schedules) and report the first problem")
    p.add_argument("schedule", nargs="+", help="schedule files or registered names")
    _add_shape(p)
    _add_format(p)
    for command in sub.choices.values():
        ranges.attach(command)
    return parser


def _version() -> str:
    from pipefold import __version__

    return __version__


@dataclass(frozen=True)
class Applies:
    """Options of a command that mean something in one of its modes only: given in another, they are refused in one
    line (never silently ignored). ``options`` are argparse destinations; given means not the parser's default."""

    command: str
    options: tuple[str, ...]
    when: Callable[[argparse.Namespace], bool]
    """The mode in which they apply."""
    otherwise: str
    """What to do instead, after "--option ...": why it does not apply and what would."""


_COSTS = ("f", "b", "w", "mem", "mem_w", "latency", "bandwidth", "activation_bytes", "grad_bytes", "opt", "weights",
          "overlap", "recompute", "stage_cost", "work", "stash", "offload_time", "offloadable", "vocab_cost",
          "exchange", "exchange_overlap")


_PLAN_UNITS = "sets the cost model of plan --memory (in units of M)"

APPLIES: tuple[Applies, ...] = (
    # plan has three modes: --memory (units of M, the cost flags), --profile (a measured model), --cluster.
    Applies("plan", ("memory", *_COSTS), lambda a: a.profile is None and a.cluster is None,
            f"{_PLAN_UNITS}; a plan from --profile or --cluster costs the measured model or the hardware file: drop "
            "it"),
    Applies("plan", ("opt", "work", "stash"), lambda a: False,
            "prices actions the planner's generated schedules do not run (an optimizer step or K-FAC's work as "
            "actions: schedule files and pipefold pipefisher have them): drop it"),
    Applies("plan", ("profile",), lambda a: a.cluster is None,
            "plans a model measured here, and --cluster one on a cluster's hardware file: give one of them"),
    Applies("plan", ("memory_budget", "headroom", "world", "state_chunks"), lambda a: a.profile is not None,
            "belongs to plan --profile FILE (a measured model; --cluster takes its budget from the hardware file, "
            "its layouts from --nodes): give --profile, or drop it"),
    Applies("plan", ("devices", "microbatches"), lambda a: a.cluster is None,
            "is chosen by plan --cluster, which searches every layout and microbatch count of the cluster's "
            "devices (--nodes sets how many): drop it"),
    Applies("plan", ("devices",), lambda a: a.world is None,
            "is one pipeline's length, and --world N searches every dp x tp x pp of N ranks, pipelines of every "
            "length: drop one of them"),
    Applies("plan", ("nodes", "cluster_model", "global_batch", "seq", "top", "no_sequence_parallel", "cp",
                     "seq_chunks", "split_vocab", "ep", "moe_imbalance", "node_limit"),
            lambda a: a.cluster is not None,
            "describes a cluster plan: give --cluster NAME|FILE too"),
    Applies("plan", ("output", "families"), lambda a: a.profile is not None or a.cluster is not None,
            "belongs to plan --profile or --cluster (plan --memory searches every family and writes no plan): "
            "give one of them"),
    Applies("plan", ("allow_offload",), lambda a: a.profile is None and a.cluster is None,
            "lets plan --memory offload activations; --profile and --cluster plan without offloading: drop it"),
    Applies("plan", ("offload_time", "offloadable"), lambda a: a.allow_offload,
            "prices the copies of offloaded activations, and this plan offloads none: give --allow-offload too, or "
            "drop it"),
    Applies("pipefisher", ("offload_time", "offloadable"), lambda a: False,
            "prices the copies of offloaded activations, and pipefisher places K-FAC's work in a schedule without "
            "them: drop it"),
    Applies("simulate", ("at",), lambda a: a.network is not None,
            "is a time in a --network's timeline: give --network too"),
    Applies("simulate", ("latency", "bandwidth"), lambda a: a.network is None or a.grad_bytes > 0,
            "prices the links between stages, and --network sets them (over time): drop it"),
    Applies("simulate", ("gathered",), lambda a: a.fsdp, "is held by FSDP's stages: give --fsdp too"),
    Applies("simulate", ("fsdp",), lambda a: a.dp >= 2,
            "shards stages across data-parallel pipelines: give --dp 2 or more"),
    Applies("simulate", ("dp",), lambda a: a.grad_bytes > 0 or a.fsdp,
            "adds each stage's all-reduce of its --grad-bytes among the copies, and they are 0: give --grad-bytes "
            "(and --bandwidth or --latency), or --fsdp"),
    Applies("simulate", ("fsdp",), lambda a: a.grad_bytes > 0 or a.weights > 0 or a.gathered > 0,
            "gathers and reduce-scatters --grad-bytes and holds --weights and --gathered, and they are 0: give "
            "some of them"),
    *(Applies(c, ("width",), lambda a: not a.json,
              "sets the columns of the ASCII timeline, which --json does not print: drop one of them")
      for c in ("simulate", "pipefisher")),
    Applies("pipefisher", ("slack", "max_steps"), lambda a: not a.inline,
            "shapes the cycle of filled steps, and --inline fills none: drop one of them"),
    Applies("partition", ("slack",), lambda a: a.by == "memory",
            "is the time a --by memory split may add: give --by memory too"),
    Applies("offload", ("k", "kprime"), lambda a: a.budget is None,
            "is picked by --budget: give either --budget or --k/--kprime"),
    Applies("bagpipe", ("lookahead",), lambda a: a.policy == "oracle",
            "is how many batches the oracle reads ahead, and --policy lru and none read none: drop it, or give "
            "--policy oracle"),
    Applies("bagpipe", ("cache", "ahead"), lambda a: a.policy != "none",
            "shapes a cache, and with --policy none each step fetches all its rows when it starts and keeps none: "
            "drop it, or give --policy oracle or lru"),
)
"""Which options go with which modes, read by :func:`main` for every command: a new option that belongs to one
mode is refused in the others by adding it here. ``pipefold train``'s are its run spec's
(:data:`pipefold.train.spec.RULES`), checked where the spec is made."""


def given(args: argparse.Namespace, parser: argparse.ArgumentParser) -> frozenset[str]:
    """The options of ``args`` (destinations) that were given a value other than their command's default."""
    sub = next((a.choices[args.command] for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        return frozenset()
    return frozenset(dest for dest, value in vars(args).items() if value != sub.get_default(dest))


def check_applies(args: argparse.Namespace) -> None:
    """Refuse, in one line, an option given where it does not apply (:data:`APPLIES`)."""
    for rule in APPLIES:
        if rule.command != args.command or rule.when(args):
            continue
        for dest in rule.options:
            if dest in args.given:
                raise ConfigError(f"--{dest.replace('_', '-')} {rule.otherwise}")

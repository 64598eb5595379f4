"""The ``pipefold`` command line: parses arguments, calls the library, prints."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import statistics
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

from pipefold import jsonout, schedules
from pipefold.errors import ConfigError, Interrupted, PipefoldError, ScheduleError
from pipefold.ir import Schedule, formats
from pipefold.ir.ref import ScheduleRef
from pipefold.plan.budget import PlanResult, one_f_one_b_peak, parse_budget, plan
from pipefold.sim.simulate import CostModel, SimResult, StageOverride, simulate
from pipefold.units import format_bytes, parse_bytes

DEFAULT_SCHEDULE = "zb-h1"
DEFAULT_KFAC_WORK = "KA=0.5,KG=0.5,KI=2,KP=0.25"
"""K-FAC's work per device share for `pipefold pipefisher`, against F = B = W = 1."""
DEFAULT_DEVICES = 4
DEFAULT_MICROBATCHES = 8


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# --------------------------------------------------------------------------- arguments


def _add_shape(p: argparse.ArgumentParser, *, options: bool = True) -> None:
    _devices_flag(p, DEFAULT_DEVICES)
    p.add_argument("--microbatches", "-m", type=int, default=DEFAULT_MICROBATCHES, metavar="M",
                   help=f"microbatches per step (default {DEFAULT_MICROBATCHES})")
    if not options:
        return
    names = sorted({o.name for spec in schedules.REGISTRY.values() for o in spec.options})
    for name in names:
        helps = {f"{o.help} ({s.name}, default {o.default})"
                 for s in schedules.REGISTRY.values() for o in s.options if o.name == name}
        flags = ["--v", "--chunks"] if name == "v" else [f"--{name}"]
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
    p.add_argument("--hf-config", default=None, metavar="CONFIG",
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
    p.add_argument("--no-link", action="store_true", help="do not measure the link (free transfers)")
    p.add_argument("--no-sharing", action="store_true",
                   help="do not measure how ranks share this machine (each rank has a device of its own)")
    p.add_argument("--output", "-o", metavar="FILE", help="write the profile to FILE (default: print it)")
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
    p.add_argument("--zero1", action="store_true",
                   help="with --dp: shard the optimizer state across the copies of each stage (ZeRO-1)")
    p.add_argument("--fsdp", action="store_true",
                   help="with --dp: shard each stage's parameters, gradients and optimizer state across its copies "
                        "(torch's fully_shard): gathered before the stage's first forward, reduce-scattered and freed "
                        "after its last weight gradient")
    p.add_argument("--microbatches", "-m", type=int, default=8, metavar="M", help="microbatches per step (default 8)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    _add_model(p, layers=None, layers_help="default: enough for 2 layers per stage", batch=16,
               batch_help="batch per step")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "kfac"], default="adamw",
                   help="adamw (default), sgd, or kfac: K-FAC-preconditioned SGD with momentum 0.9, its work placed "
                        "in the schedule as actions (see --fill-bubbles)")
    p.add_argument("--fill-bubbles", action="store_true",
                   help="with --optimizer kfac: put K-FAC's curvature, inversion and preconditioning in the "
                        "schedule's bubbles, spread over steps (PipeFisher); without it they run right after the "
                        "passes they read, every step")
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
                        "(with --recompute auto)")
    p.add_argument("--offload", metavar="K,K2", default=None,
                   help="each stage keeps at most K of its layers on the device, evicting K2 at once")
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
    g.add_argument("--no-overlap", action="store_true",
                   help="on a GPU, run an overlapped pair's (dualpipe's F+B) forward and then its backward, "
                        "instead of both at once on two streams")
    _add_output(p)

    p = sub.add_parser("validate", help="check schedule files (or generated schedules) and report the first problem")
    p.add_argument("schedule", nargs="+", help="schedule files or registered names")
    _add_shape(p)
    _add_format(p)
    return parser


def _version() -> str:
    from pipefold import __version__

    return __version__


# --------------------------------------------------------------------------- helpers


def _flag_options(args: argparse.Namespace) -> dict[str, int]:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def _looks_like_file(text: str) -> bool:
    """Whether ``text`` names a schedule file rather than a registered schedule.

    A path (with a folder separator) or a name ending in a schedule suffix (any case) is a file; a
    registered name (``1f1b``, ``kfkb:k=3``) is the registered schedule even when a file of that name is
    in the current folder (give the file as ``./1f1b``); anything else is a file if one exists.
    """
    if os.path.sep in text or "/" in text or text.lower().endswith((".txt", ".json", ".csv")):
        return True
    if text.partition(":")[0] in schedules.REGISTRY:
        return False
    return os.path.isfile(text)


def _load_schedule(text: str, args: argparse.Namespace, *, strict_flags: bool) -> Schedule:
    """A schedule from a file, or generated from a registered name and the shape flags."""
    if _looks_like_file(text):
        if not os.path.isfile(text):
            raise ConfigError(f"no such schedule file: {text}")
        return formats.load(text, getattr(args, "input_format", None), renumber=getattr(args, "renumber", False))
    ref = ScheduleRef.parse(text)
    name, options = ref.name, ref.kwargs
    spec = schedules.get(name)
    for key, value in _flag_options(args).items():
        if spec.option(key) is not None:
            if key in options and options[key] != value:
                raise ConfigError(f"{text} sets {key}={options[key]} but --{key} {value} says otherwise: give "
                                  f"{key} once")
            options.setdefault(key, value)
        elif strict_flags:
            takes = ", ".join(f"--{o.name}" for o in spec.options) or "none"
            raise ConfigError(f"schedule {name} takes no option --{key}; its options: {takes}")
    return schedules.build(name, args.devices, args.microbatches, **options)


def _cost_model(args: argparse.Namespace) -> CostModel:
    overrides = {}
    for item in args.stage_cost:
        stage_text, _, values = item.partition(":")
        try:
            stage = int(stage_text)
            numbers = [float(x) for x in values.split(",")]
        except ValueError:
            numbers = []
        if len(numbers) not in (3, 4):
            raise ConfigError(f"cannot read --stage-cost {item!r}: use S:F,B,W or S:F,B,W,MEM, e.g. 3:2,4,2")
        memory = numbers[3] if len(numbers) == 4 else None
        overrides[stage] = StageOverride(f=numbers[0], b=numbers[1], w=numbers[2], memory=memory)
    return CostModel(f=args.f, b=args.b, w=args.w, memory=args.mem, memory_w=args.mem_w,
                     latency=args.latency, bandwidth=args.bandwidth, activation_bytes=args.activation_bytes,
                     recompute=args.recompute, stage_overrides=overrides, grad_bytes=args.grad_bytes, opt=args.opt,
                     overlap=args.overlap, weights=args.weights, work=_kind_table(args.work, "--work"),
                     stash=_kind_table(args.stash, "--stash"))


def _kind_table(text: str, flag: str) -> dict[str, float]:
    """``KA=0.5,KI=2`` as {kind: number}."""
    out: dict[str, float] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        code, sep, value = item.partition("=")
        try:
            out[code.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(f"cannot read {flag} {item!r}: use KIND=NUMBER,..., e.g. KA=0.5,KG=0.5,KI=2,KP=0.25")
    return out


def _fmt(x: float) -> str:
    return f"{x:.6g}"


# --------------------------------------------------------------------------- commands


def cmd_schedules(args: argparse.Namespace, console: Console) -> None:
    if args.json:
        rows = [{"name": s.name, "description": s.description, "peak_memory": s.memory,
                 "options": [{"name": o.name, "default": o.default, "help": o.help} for o in s.options]}
                for s in schedules.REGISTRY.values()]
        print(jsonout.dumps(rows))
        return
    table = Table(title="pipefold schedules", title_justify="left", show_lines=True)
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("what it is; options; peak activation memory per device (M)")
    for s in schedules.REGISTRY.values():
        opts = " ".join(f"--{o.name} {o.default}" for o in s.options) or "none"
        table.add_row(s.name, f"{s.description}\n[dim]options:[/] {opts}   [dim]peak:[/] {s.memory}")
    console.print(table)
    for name in sorted({o.name for s in schedules.REGISTRY.values() for o in s.options}):
        spec = next(o for s in schedules.REGISTRY.values() for o in s.options if o.name == name)
        console.print(f"  --{name}: {spec.help}")
    console.print("p: devices, m: microbatches, i: device index. Costs: see 'pipefold simulate --help'.")


def _check_outputs(*outputs: tuple[str, str | None, bool]) -> None:
    """Refuse, before any work, each (what, path, is a figure) that cannot be written."""
    from pipefold.files import check_writable

    for what, path, figure in outputs:
        if path is not None:
            check_writable(path, what, figure=figure)


def cmd_simulate(args: argparse.Namespace, console: Console) -> None:
    if args.width:
        console = Console(width=args.width, soft_wrap=True)
    _check_outputs(("plot", args.plot, True), ("trace", args.trace, False))
    cost = _cost_model(args)
    schedule = _load_schedule(args.schedule, args, strict_flags=True)
    network = None
    if args.network is not None:
        from pipefold.sim.network import parse_network

        network = parse_network(args.network)
        network.check_devices(schedule.devices)
    elif args.at:
        raise ConfigError("--at is a time in a --network's timeline: give --network too")
    if not (math.isfinite(args.at) and args.at >= 0):
        raise ConfigError(f"--at is seconds >= 0 (got {args.at})")
    if args.fsdp and args.dp < 2 or args.gathered and not args.fsdp:
        raise ConfigError("--fsdp shards stages across data-parallel pipelines: give --dp 2 or more, and --gathered "
                          "only with --fsdp")
    if args.dp != 1:
        from pipefold.schedules.dataparallel import with_data_parallel

        cost = dataclasses.replace(cost, dp=args.dp, gathered=args.gathered)
        schedule = with_data_parallel(schedule, shard=args.fsdp)
    result = simulate(schedule, cost, network=network, at=args.at)
    written = []
    if args.plot:
        from pipefold.sim.render import plot_timeline

        plot_timeline(result, args.plot)
        written.append(("plot", args.plot))
    if args.trace:
        from pipefold.sim.render import write_chrome_trace

        write_chrome_trace(result, args.trace)
        written.append(("trace", args.trace))
    if args.json:
        out = result.to_dict()
        out.update({k: v for k, v in written})
        print(jsonout.dumps(out))
        return
    _print_result(result, console)
    for kind, path in written:
        console.print(f"wrote {kind}: {path}")


def _print_result(result: SimResult, console: Console) -> None:
    from pipefold.sim.render import ascii_timeline

    s = result.schedule
    console.print(f"[bold]{ScheduleRef.of(s)}[/]  devices={s.devices} stages={s.stages} microbatches={s.microbatches} "
                  f"placement={s.placement_name}")
    table = Table(show_edge=False)
    for col in ("device", "stages", "busy", "idle", "peak memory (M)"):
        table.add_column(col, justify="right")
    for d in range(s.devices):
        table.add_row(str(d), " ".join(map(str, s.stages_of(d))), _fmt(result.busy[d]), _fmt(result.idle[d]),
                      _fmt(result.peak_memory[d]))
    console.print(table)
    console.print(f"makespan [bold]{_fmt(result.makespan)}[/]   bubble ratio [bold]{result.bubble_ratio:.1%}[/]   "
                  f"max peak memory [bold]{_fmt(max(result.peak_memory))}[/] M")
    console.print(ascii_timeline(result, width=console.width, color=console.is_terminal))


def cmd_pipefisher(args: argparse.Namespace, console: Console) -> None:
    from pipefold.plan import pipefisher

    if args.width:
        console = Console(width=args.width, soft_wrap=True)
    _check_outputs(("plot", args.plot, True))
    cost = _cost_model(args)
    schedule = _load_schedule(args.schedule, args, strict_flags=True)
    filled = (pipefisher.inline(schedule, cost) if args.inline
              else pipefisher.fill(schedule, cost, slack=args.slack, max_steps=args.max_steps))
    if args.plot:
        from pipefold.sim.render import plot_cycle

        plot_cycle(filled.base, filled.steps, args.plot,
                   title=f"{ScheduleRef.of(schedule)}: K-FAC's work {'inline' if args.inline else 'in the bubbles'}")
    if args.json:
        print(jsonout.dumps({**filled.to_dict(), **({"plot": args.plot} if args.plot else {})}))
        return
    from pipefold.sim.render import ascii_timeline

    base = filled.base
    console.print(f"[bold]{ScheduleRef.of(schedule)}[/] with K-FAC {'inline' if args.inline else 'in the bubbles'}: "
                  f"a cycle of {len(filled.steps)} step(s); factors inverted "
                  f"{'/'.join(map(str, filled.refreshes))} time(s) per cycle, by stage")
    table = Table(show_edge=False)
    for col in ("", "step time", "utilization", "max peak memory (M)"):
        table.add_column(col, justify="right")
    table.add_row("plain", _fmt(base.makespan), f"{pipefisher.utilization(base):.1%}", _fmt(max(base.peak_memory)))
    for i, r in enumerate(filled.steps):
        table.add_row(f"step {i + 1}", _fmt(r.makespan), f"{pipefisher.utilization(r):.1%}", _fmt(max(r.peak_memory)))
    table.add_row("cycle", _fmt(filled.step_time), f"{filled.utilization:.1%}", "")
    console.print(table)
    for i, r in enumerate(filled.steps):
        console.print(f"step {i + 1} of the cycle:")
        console.print(ascii_timeline(r, width=console.width, color=console.is_terminal))
    if args.plot:
        console.print(f"wrote plot: {args.plot}")


def cmd_compare(args: argparse.Namespace, console: Console) -> None:
    cost = _cost_model(args)
    results = [simulate(_load_schedule(text, args, strict_flags=False), cost) for text in args.schedule]
    if args.json:
        print(jsonout.dumps({"devices": args.devices, "microbatches": args.microbatches, "cost": cost.to_dict(),
                             "results": [r.to_dict() for r in results]}))
        return
    best = min(r.makespan for r in results)
    table = Table(title=f"p={args.devices} m={args.microbatches}", title_justify="left")
    table.add_column("schedule", no_wrap=True)
    for col in ("makespan", "vs best", "bubble", "max peak (M)", "peak per device (M)"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(ScheduleRef.of(r.schedule)), _fmt(r.makespan), f"{r.makespan / best:.3f}x" if best else "-",
                      f"{r.bubble_ratio:.1%}", _fmt(max(r.peak_memory)), " ".join(_fmt(x) for x in r.peak_memory))
    console.print(table)


def cmd_generate(args: argparse.Namespace, console: Console) -> None:
    from pipefold.files import check_writable, write_text
    from pipefold.ir import format_of

    if args.output:
        check_writable(args.output, "schedule")
    schedule = _load_schedule(args.schedule, args, strict_flags=True)
    fmt = args.format or (format_of(args.output) if args.output else "text")
    text = formats.dumps(schedule, fmt)
    if args.output:
        write_text(args.output, text)
        console.print(f"wrote {fmt} schedule: {args.output}")
    else:
        sys.stdout.write(text)


def cmd_validate(args: argparse.Namespace, console: Console) -> None:
    from pipefold.ir import validate

    for text in args.schedule:
        schedule = _load_schedule(text, args, strict_flags=False)
        validate(schedule)
        console.print(f"{text}: ok ({schedule.devices} devices, {schedule.stages} stages, "
                      f"{schedule.microbatches} microbatches, {schedule.num_actions} actions)")


def cmd_profile(args: argparse.Namespace, console: Console) -> None:
    from pipefold.runtime.profiling import profile_model

    for label in ("layers", "hidden", "heads", "batch", "seq", "microbatches", "devices", "repeats"):
        if getattr(args, label) is not None and getattr(args, label) < 1:
            raise ConfigError(f"--{label} must be at least 1 (got {getattr(args, label)})")
    _check_outputs(("profile", args.output, False))
    with _stage_bar("profile") as progress:
        prof = profile_model(model=args.model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                             model_config=args.hf_config, seq=args.seq,
                             batch=args.batch, microbatches=args.microbatches, optimizer=args.optimizer,
                             seed=args.seed, devices=args.devices, repeats=args.repeats, link=not args.no_link,
                             contention=not args.no_sharing, progress=progress)
    if not args.output:
        print(jsonout.dumps(prof.to_dict(), indent=1))
        return
    prof.save(args.output)
    if args.json:
        print(jsonout.dumps({"profile": args.output, "layers": len(prof.layers), "latency_s": prof.latency,
                             "bandwidth_bytes_per_s": prof.bandwidth, "contention": list(prof.contention)}))
        return
    f, b, w = (sum(getattr(x, k) for x in prof.layers) for k in "fbw")
    console.print(f"[bold]{args.output}[/]: {len(prof.layers)} layers of {args.model}, one microbatch of "
                  f"{prof.microbatch_rows}: F {f * 1e3:.2f} ms, B {b * 1e3:.2f} ms, W {w * 1e3:.2f} ms in all; "
                  f"{format_bytes(sum(x.params for x in prof.layers))} of parameters")
    console.print(f"link: {prof.latency * 1e6:.0f} us + bytes at {prof.bandwidth / 2**30:.2f} GiB/s; ranks computing "
                  f"at once 1..{len(prof.contention)} run each pass x{' x'.join(f'{c:.2f}' for c in prof.contention)}")


@contextlib.contextmanager
def _stage_bar(label: str) -> Iterator[Callable[[str, int, int], None] | None]:
    """A progress bar on stderr (when it is a terminal) for work in named parts: progress(part, done, total)."""
    with _progress_bar(label) as bar:
        if bar is None:
            yield None
            return
        yield lambda part, done, total: bar(done, total)


def cmd_plan(args: argparse.Namespace, console: Console) -> None:
    _check_outputs(("plot", args.plot, True), ("plan", args.output, False))
    if args.profile is not None:
        _plan_profiled(args, console)
        return
    if args.memory is None:
        raise ConfigError("plan needs --memory BUDGET (in M, or 0.5x of 1F1B's peak), or --profile FILE with "
                          "--memory-budget BYTES for a measured model")
    if any(x is not None for x in (args.memory_budget, args.output, args.families, args.headroom)):
        raise ConfigError("--memory-budget, --output, --families and --headroom plan a measured model: give --profile "
                          "FILE too "
                          "(or --memory in M without them)")
    cost = _cost_model(args)
    budget = parse_budget(args.memory, one_f_one_b_peak(args.devices, args.microbatches, cost))
    with _progress_bar(f"planning p={args.devices} m={args.microbatches}") as progress:
        answer = plan(args.devices, args.microbatches, budget, cost, progress=progress)
    title = (f"p={args.devices} m={args.microbatches}, budget {_fmt(budget)} M: {answer.spec}, "
             f"makespan {_fmt(answer.best.makespan)}, peak {_fmt(answer.best.memory)} M")
    if args.plot:
        from pipefold.plan.figures import plot_frontier

        plot_frontier(answer.points, answer.frontier, budget, answer.best, args.plot, title=title)
    if args.json:
        out = _plan_dict(answer, args, cost)
        if args.plot:
            out["plot"] = args.plot
        print(jsonout.dumps(out))
        return
    _print_plan(answer, args, console)
    if args.plot:
        console.print(f"wrote plot: {args.plot}")


def _plan_profiled(args: argparse.Namespace, console: Console) -> None:
    from pipefold.files import write_json
    from pipefold.plan.budget import HEADROOM, plan_model
    from pipefold.plan.profile import Profile

    if args.memory is not None:
        raise ConfigError("--memory is in units of M; with --profile give --memory-budget in bytes (e.g. 2GiB)")
    if args.memory_budget is None:
        raise ConfigError("plan --profile needs --memory-budget BYTES: what each device may hold, e.g. 2GiB")
    profile = Profile.load(args.profile)
    budget = parse_bytes(args.memory_budget)
    m = args.microbatches if args.microbatches != DEFAULT_MICROBATCHES else None
    with _progress_bar(f"planning p={args.devices}") as progress:
        answer = plan_model(profile, args.devices, budget, microbatches=m, progress=progress,
                            families=args.families.split(",") if args.families else None,
                            headroom=HEADROOM if args.headroom is None else args.headroom)
    out = answer.to_dict()
    if args.output:
        write_json(args.output, out, indent=1)
    if args.plot:
        from pipefold.plan.figures import plot_frontier

        plot_frontier(answer.points, answer.frontier, budget, answer.best, args.plot, unit="bytes",
                      title=f"{answer.best.spec}: {answer.best.makespan * 1e3:.1f} ms per step, peak "
                            f"{format_bytes(answer.best.memory)} (budget {format_bytes(budget)})")
    if args.json:
        print(jsonout.dumps({k: v for k, v in out.items() if k != "profile"} | {"output": args.output}))
        return
    b = answer.best
    console.print(f"[bold]{b.spec}[/]  step [bold]{b.makespan * 1e3:.1f} ms[/] predicted  bubble ratio "
                  f"{b.bubble_ratio:.1%}  (budget {format_bytes(budget)} per device)")
    console.print(f"stages' layers: {' | '.join(f'{p[0]}-{p[-1]}' for p in b.layer_stages)} (split by {b.split}); "
                  f"recomputed layers per stage: {' '.join(map(str, b.recompute))}")
    console.print("peak per device: " + "  ".join(f"{format_bytes(x)}" for x in b.peak_memory)
                  + "  (of which weights, gradients, optimizer state: "
                  + " ".join(format_bytes(x) for x in b.static_bytes) + ")")
    table = Table(title=f"memory/time frontier ({len(answer.points)} plans evaluated)", title_justify="left")
    table.add_column("", no_wrap=True)
    for col in ("peak per device", "step (ms)", "bubble", "schedule", "split", "recomputed"):
        table.add_column(col, justify="right" if col in ("peak per device", "step (ms)", "bubble") else "left")
    for pt in answer.frontier:
        chosen = pt == b
        style = "bold" if chosen else "dim" if pt.memory > answer.room else ""
        table.add_row("▶" if chosen else "", format_bytes(pt.memory), f"{pt.makespan * 1e3:.1f}",
                      f"{pt.bubble_ratio:.1%}", pt.spec, pt.split, str(sum(pt.recompute)), style=style)
    console.print(table)
    if args.output:
        console.print(f"wrote plan: {args.output}  (run it: pipefold train --plan {args.output})")


@contextlib.contextmanager
def _progress_bar(label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar on stderr when it is a terminal; otherwise no callback at all."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    if not err.is_terminal:
        yield None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _plan_dict(answer: PlanResult, args: argparse.Namespace, cost: CostModel) -> dict[str, object]:
    r = answer.result
    return {
        "schedule": answer.spec, "name": answer.name, "options": answer.options,
        "devices": args.devices, "microbatches": args.microbatches,
        "makespan": round(r.makespan, 9), "bubble_ratio": round(r.bubble_ratio, 9),
        "peak_memory": [round(x, 9) for x in r.peak_memory], "budget": round(answer.budget, 9),
        "evaluated": len(answer.points), "skipped": list(answer.skipped),
        "frontier": [{"schedule": pt.spec, "name": pt.name, "options": pt.options, "memory": pt.memory,
                      "makespan": pt.makespan, "bubble_ratio": pt.bubble_ratio, "peak_memory": list(pt.peak_memory),
                      "chosen": pt == answer.best} for pt in answer.frontier],
        "cost": cost.to_dict(),
    }


def _print_plan(answer: PlanResult, args: argparse.Namespace, console: Console) -> None:
    r = answer.result
    console.print(f"[bold]{answer.spec}[/]  makespan [bold]{_fmt(r.makespan)}[/]  bubble ratio {r.bubble_ratio:.1%}  "
                  f"peak memory {' '.join(_fmt(x) for x in r.peak_memory)} M  (budget {_fmt(answer.budget)} M)")
    skipped = f", {len(answer.skipped)} could not run this shape" if answer.skipped else ""
    table = Table(title=f"memory/makespan frontier, p={args.devices} m={args.microbatches} "
                        f"({len(answer.points)} schedules evaluated{skipped})", title_justify="left")
    table.add_column("", no_wrap=True)
    for col in ("peak memory (M)", "makespan", "bubble"):
        table.add_column(col, justify="right")
    table.add_column("schedule", no_wrap=True)
    for pt in answer.frontier:
        chosen = pt == answer.best
        style = "bold" if chosen else "dim" if pt.memory > answer.budget + 1e-9 else ""
        table.add_row("▶" if chosen else "", _fmt(pt.memory), _fmt(pt.makespan), f"{pt.bubble_ratio:.1%}", pt.spec,
                      style=style)
    console.print(table)
    console.print("▶ chosen; dim rows exceed the budget")


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
    with _stage_bar("profiling the model") as progress:
        profile = profile_model(model=args.model, layers=layers, hidden=args.hidden, heads=args.heads,
                                model_config=args.hf_config, seq=args.seq,
                                batch=args.batch, microbatches=args.microbatches, optimizer=args.optimizer,
                                seed=args.seed, devices=args.devices, progress=progress)
    with _progress_bar(f"planning p={args.devices}") as bar:
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

    _check_outputs(("plot", args.plot, True), ("trace", args.trace, False))
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

        if _looks_like_file(args.schedule):  # pipefold's text, JSON or CSV, or torch's CSV: its devices, microbatches
            from pipefold.ir import validate

            probe = _load_schedule(args.schedule, args, strict_flags=False)
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


def cmd_partition(args: argparse.Namespace, console: Console) -> None:
    from pipefold.models import make_model
    from pipefold.models.size import check_model
    from pipefold.plan.partition import (
        memory_of_split,
        partition,
        partition_memory,
    )
    from pipefold.plan.recompute import OPTIMIZER_STATE
    from pipefold.runtime.profiling import layer_costs, layer_memory, layer_static_bytes

    for flag, value in (("--devices", args.devices), ("--chunks", args.chunks), ("--microbatches", args.microbatches)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if args.schedule is not None:
        ref = ScheduleRef.parse(args.schedule)
        name, options = ref.name, ref.kwargs
    elif args.chunks is not None and args.chunks > 1:
        name, options = "interleaved-1f1b", {"v": args.chunks}
    else:
        name, options = "1f1b", {}
    least = schedules.get(name).min_microbatches(args.devices)
    m = args.microbatches if args.microbatches is not None else max(least, 2 * args.devices)
    schedule = schedules.build(name, args.devices, m, **options)
    model = make_model(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch,
                       seq=args.seq, config=args.hf_config)
    check_model(model, what=f"measuring {args.model}'s layers")
    layers, sample = model.build(), model.batch_at(0)[0]  # one microbatch of --batch rows
    params, times = (layer_costs(layers, sample, by=by) for by in ("params", "time"))
    held, held_w = (list(column) for column in zip(*layer_memory(layers, sample), strict=True))
    static = layer_static_bytes(layers, optimizer_factor=OPTIMIZER_STATE[args.optimizer])
    if args.by == "memory":
        split = partition_memory(times, held, held_w, static, schedule, slack=args.slack)
        by_time = memory_of_split(partition(times, schedule.stages, placement=schedule.placement[0]).boundaries,
                                  times, held, held_w, static, schedule, time_optimal=split.time_optimal)
        compared = {"time_split": {"boundaries": by_time.boundaries, "device_peak_bytes": by_time.device_peak_bytes}}
    else:
        balanced = partition(params if args.by == "params" else times, schedule.stages,
                             placement=schedule.placement[0])
        split = memory_of_split(balanced.boundaries, times, held, held_w, static, schedule)
    sums = {key: [sum(values[i] for i in part) for part in split.parts] for key, values in
            (("params", params), ("time_s", times), ("held_bytes", held), ("held_w_bytes", held_w),
             ("static_bytes", static))}
    if args.by == "memory":  # a stage's share of its device's peak: its static bytes and what it holds then
        cost = [sums["static_bytes"][s] + split.weights[s] * sums["held_bytes"][s]
                + split.weights_w[s] * sums["held_w_bytes"][s] for s in range(schedule.stages)]
        device_cost = split.device_peak_bytes
    else:
        cost, device_cost, compared = balanced.cost, balanced.device_cost, {}
    devices = list(schedule.placement[0])
    if args.json:
        print(jsonout.dumps({"model": args.model, "layers": len(layers), "by": args.by,
                             "schedule": str(ScheduleRef.of(schedule)), "microbatches": m, "stages": schedule.stages,
                             "placement": devices,
                             "boundaries": split.boundaries, "parts": split.parts, "cost": cost,
                             "device_cost": device_cost, "bottleneck": max(device_cost), **sums,
                             "device_time_s": split.device_time, "device_static_bytes": split.device_static_bytes,
                             "device_activation_bytes": split.device_activation_bytes,
                             "device_peak_bytes": split.device_peak_bytes, "time_optimal_s": split.time_optimal,
                             "weights": split.weights, "weights_w": split.weights_w, **compared}))
        return

    def span(part: list[int]) -> str:
        return f"{part[0]}-{part[-1]}" if len(part) > 1 else str(part[0])

    title = (f"{args.model} ({len(layers)} layers) split by {args.by}, under {ScheduleRef.of(schedule)} "
             f"with {m} microbatches")
    table = Table(title=title, title_justify="left")
    for col in ("stage", "device", "layers", "params", "est. time", "act. / mb", "static"):
        table.add_column(col, justify="right")
    for s, part in enumerate(split.parts):
        table.add_row(str(s), str(devices[s]), span(part), f"{int(sums['params'][s]):,}",
                      f"{sums['time_s'][s] * 1e3:.2f} ms", format_bytes(sums["held_bytes"][s]),
                      format_bytes(sums["static_bytes"][s]))
    console.print(table)
    table = Table(title="predicted per device", title_justify="left")
    for col in ("device", "layers", "est. time", "static", "peak act.", "peak total"):
        table.add_column(col, justify="right")
    for d in range(schedule.devices):
        table.add_row(str(d), ", ".join(span(split.parts[s]) for s in schedule.stages_of(d)),
                      f"{split.device_time[d] * 1e3:.2f} ms", format_bytes(split.device_static_bytes[d]),
                      format_bytes(split.device_activation_bytes[d]), format_bytes(split.device_peak_bytes[d]))
    console.print(table)
    if args.by == "memory":
        over = split.bottleneck_time / split.time_optimal - 1 if split.time_optimal else 0.0
        console.print(f"largest predicted peak: {format_bytes(split.peak_bytes)}; busiest device time "
                      f"{_fmt(split.bottleneck_time)} s, {over:+.1%} on the time-optimal split's; "
                      f"boundaries {split.boundaries}")
        console.print(f"the time-balanced split {by_time.boundaries} would peak at {format_bytes(by_time.peak_bytes)}")
        return
    unit = {"params": "params", "time": "s"}[args.by]
    console.print(f"bottleneck (largest device {args.by}): {_fmt(max(device_cost))} {unit}; largest predicted "
                  f"peak {format_bytes(split.peak_bytes)}; boundaries {split.boundaries}")


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM ends a command as SIGINT does (an exception, so that what it started is cleaned up), where this is
    the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


COMMANDS = {"schedules": cmd_schedules, "simulate": cmd_simulate, "compare": cmd_compare,
            "generate": cmd_generate, "plan": cmd_plan, "profile": cmd_profile, "validate": cmd_validate,
            "train": cmd_train, "pipefisher": cmd_pipefisher,
            "offload": cmd_offload, "partition": cmd_partition}


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


def _sequences(args: argparse.Namespace) -> bool:
    from pipefold.models import REGISTRY

    return REGISTRY[args.model].sequences


_COSTS = ("f", "b", "w", "mem", "mem_w", "latency", "bandwidth", "activation_bytes", "grad_bytes", "opt", "weights",
          "overlap", "recompute", "stage_cost", "work", "stash")

APPLIES: tuple[Applies, ...] = (
    Applies("train", ("damping", "ema", "fill_bubbles"), lambda a: a.optimizer == "kfac",
            "tunes K-FAC: add --optimizer kfac, or drop it"),
    Applies("train", ("adapt_every",), lambda a: a.schedule.partition(":")[0] == "adaptive-kfkb",
            "spaces adaptive-kfkb's choices of k: use --schedule adaptive-kfkb, or drop it"),
    Applies("train", ("heads", "seq", "data"), _sequences,
            "sizes a language model, and the mlp has no attention, sequences or text: use --model gpt, or drop it"),
    Applies("train", ("dp", "fsdp", "zero1"), lambda a: a.plan is None and a.schedule != "auto",
            "lays out data-parallel copies, and a plan (--plan, --schedule auto) runs the one pipeline it planned: "
            "name a schedule with --schedule, or drop it"),
    Applies("train", ("keep_last", "checkpoint_every"), lambda a: a.checkpoint_dir is not None,
            "saves into --checkpoint-dir D: give one, or drop it"),
    Applies("plan", _COSTS, lambda a: a.profile is None,
            "sets the cost model, and a plan from --profile uses the measured costs: drop it, or plan without "
            "--profile"),
)
"""Which options go with which modes, read by :func:`main` for every command: a new option that belongs to one
mode is refused in the others by adding it here."""


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


def entry() -> NoReturn:
    """The ``pipefold`` command: :func:`main`, then out at once. Threads still running are waited for, output is
    flushed and exit handlers run (what multiprocessing and the library registered), as Python's own exit does;
    its teardown of the modules, most of a second with torch loaded, is skipped: nothing is left to clean up."""
    import atexit
    import threading

    code = main()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.given = given(args, parser)  # before any option is filled in from another
    if getattr(args, "hf", None):
        args.model = args.hf  # one name for the model from here on; its config sizes it
    elif getattr(args, "layers", 0) is None:
        args.layers = args.default_layers
    console = Console(soft_wrap=True)
    try:
        check_applies(args)
        with _sigterm_interrupts():
            COMMANDS[args.command](args, console)
    except KeyboardInterrupt as exc:
        # SIGINT or SIGTERM: the launcher has stopped its ranks (and says how many); one line, the shell's code.
        what = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        print(f"pipefold {args.command}: {what}", file=sys.stderr)
        return what.exit_code
    except ScheduleError as exc:
        print(f"pipefold {args.command}: error: {exc.message}", file=sys.stderr)
        if exc.report:
            print(exc.report, file=sys.stderr)
        return 1
    except PipefoldError as exc:
        print(f"pipefold {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from pipefold.runtime.job import Diverged, RankError

        if not isinstance(exc, (RankError, Diverged)):
            raise
        print(f"pipefold {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pipefold {args.command}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
              file=sys.stderr)
        return 2
    return 0



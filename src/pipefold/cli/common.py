"""What several commands share: reading a schedule from a name or a file, a cost model from the flags, number
formats, output checks before any work, progress bars, and the consoles the commands print on."""


from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.highlighter import ReprHighlighter
from rich.text import Text

from pipefold import schedules
from pipefold.cli import ranges
from pipefold.cli.args import option_flag
from pipefold.errors import ConfigError
from pipefold.ir import SEQ_CHUNKS, Schedule, formats
from pipefold.ir.ref import ScheduleRef
from pipefold.sim.simulate import CostModel, StageOverride


class _Console(Console):
    """A console whose tables are never cut or wrapped where the output is not a terminal (a pipe, a file): there
    nobody's window sets the width, and rich's default of 80 columns would wrap a wide table's headers and values
    onto second lines. Such a table is printed at its natural width; on a terminal, at the terminal's."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        from rich.measure import Measurement
        from rich.table import Table

        if self.is_terminal or "COLUMNS" in os.environ or not any(isinstance(o, Table) for o in objects):
            super().print(*objects, **kwargs)
            return
        natural = max(Measurement.get(self, self.options.update(width=MAX_TABLE_WIDTH), o).maximum
                      for o in objects if isinstance(o, Table))
        narrow = self.width
        self.width = max(narrow, min(natural, MAX_TABLE_WIDTH))
        try:
            super().print(*objects, **kwargs)
        finally:
            self.width = narrow


MAX_TABLE_WIDTH = 400
"""The widest a table is printed where the output is not a terminal (:class:`_Console`)."""


def make_console(**kwargs: Any) -> Console:
    """A console for the command line's output, with rich's markup and emoji codes off: what it prints comes in
    part from outside (a user's path such as ``plan[a].json``, an exception's message such as gloo's
    ``[enforce fail at /pytorch/.../pair.cc:789]``, a model's or a schedule file's name), and markup would eat
    its bracketed parts or fail on them. Text meant to be styled is built as :class:`rich.text.Text`
    (:func:`styled`). Tables are printed whole into a pipe or a file (:class:`_Console`)."""
    return _Console(markup=False, emoji=False, **kwargs)


def styled(*parts: str | tuple[str, str]) -> Text:
    """One line of text with styled parts, e.g. ``styled((name, "bold"), " on 4 ranks")``: nothing in it is read
    as markup. Numbers and the like are highlighted under the parts' styles, as the console does a plain string."""
    text = Text.assemble(*parts)
    line = ReprHighlighter()(text.plain)
    line.copy_styles(text)
    return line


def flag_options(args: argparse.Namespace) -> dict[str, int]:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def load_schedule(text: str, args: argparse.Namespace, *, strict_flags: bool) -> Schedule:
    """A schedule from a file, or generated from a registered name and the shape flags."""
    if schedules.looks_like_file(text):
        if not os.path.isfile(text):
            raise ConfigError(f"no such schedule file: {text}")
        return formats.load(text, getattr(args, "input_format", None), renumber=getattr(args, "renumber", False))
    ref = ScheduleRef.parse(text)
    name, options = ref.name, ref.kwargs
    spec = schedules.get(name)
    for key, value in flag_options(args).items():
        if spec.option(key) is not None:
            if key in options and options[key] != value:
                raise ConfigError(f"{text} sets {key}={options[key]} but --{option_flag(key)} {value} says "
                                  f"otherwise: give {key} once")
            options.setdefault(key, value)
        elif key == SEQ_CHUNKS:  # build() names the families that can cut microbatches
            options[key] = value
        elif strict_flags:
            takes = ", ".join(f"--{option_flag(o.name)}" for o in spec.options) or "none"
            raise ConfigError(f"schedule {name} takes no option --{option_flag(key)}; its options: {takes}")
    return schedules.build(name, args.devices, args.microbatches, **options)


def offloading(args: argparse.Namespace, schedule: Schedule, cost: CostModel) -> tuple[Schedule, str]:
    """``schedule`` with the activations ``--offload-activations`` or ``--offload-fit`` names offloaded, and a line
    that says how many and what it changed (the schedule as it was and "" without either)."""
    share, fit = getattr(args, "offload_activations", None), getattr(args, "offload_fit", None)
    if share is None and fit is None:
        return schedule, ""
    if share is not None and fit is not None:
        raise ConfigError("--offload-activations names how many activations to offload and --offload-fit finds "
                          "them for a peak: give one of them")
    from pipefold.plan.activation_offload import TooSmall, choose_offload, offload_fraction, parse_share
    from pipefold.schedules.offload import offloaded_pairs

    if offloaded_pairs(schedule):
        raise ConfigError(f"{ScheduleRef.of(schedule)} offloads activations already (its file has OF actions): "
                          "drop --offload-activations and --offload-fit")
    try:
        if share is not None:
            choice = offload_fraction(schedule, parse_share(share), cost)
        else:
            assert fit is not None
            choice = choose_offload(schedule, fit, cost)
    except TooSmall as exc:
        raise ConfigError(f"--offload-fit {num(fit or 0.0)}: {exc}") from None
    plain, got = choice.plain, choice.result
    return choice.schedule, (f"offloaded {len(choice.pairs)} of {choice.offloadable} (stage, microbatch)s' "
                             f"activations, the longest-lived first: step {num(got.makespan)} (without: "
                             f"{num(plain.makespan)}, {choice.slowdown:.3f}x), max peak {num(max(choice.peaks()))} "
                             f"(without: {num(max(plain.peak_memory))})")


def cost_model(args: argparse.Namespace) -> CostModel:
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
        for name, x in zip(("f", "b", "w", "mem"), numbers, strict=False):
            in_range(f"--stage-cost {item}", "f" if name != "mem" else "mem", x)
        memory = numbers[3] if len(numbers) == 4 else None
        overrides[stage] = StageOverride(f=numbers[0], b=numbers[1], w=numbers[2], memory=memory)
    vocab = _vocab_cost(args.vocab_cost) if getattr(args, "vocab_cost", None) is not None else (0.0,) * 4
    exchange = _numbers("--exchange", getattr(args, "exchange", None), ("f", "b"), "0.5,0.5")
    if args.f + args.b + args.w == 0 and not overrides:
        raise ConfigError("--f, --b and --w are all 0: a step would take no time; give one of them a time > 0")
    return CostModel(f=args.f, b=args.b, w=args.w, memory=args.mem, memory_w=args.mem_w,
                     latency=args.latency, bandwidth=args.bandwidth, activation_bytes=args.activation_bytes,
                     recompute=args.recompute, stage_overrides=overrides, grad_bytes=args.grad_bytes, opt=args.opt,
                     overlap=args.overlap, weights=args.weights, work=kind_table(args.work, "--work"),
                     stash=kind_table(args.stash, "--stash"), offload=args.offload_time,
                     offloadable=args.offloadable, vocab_f=vocab[0], vocab_b=vocab[1], vocab_w=vocab[2],
                     vocab_memory=vocab[3], exchange_f=exchange[0], exchange_b=exchange[1],
                     exchange_overlap=getattr(args, "exchange_overlap", False))


def _numbers(flag: str, text: str | None, names: tuple[str, ...], example: str) -> tuple[float, ...]:
    """``flag``'s comma-separated numbers, one per name, each >= 0 (0s where it is not given)."""
    if text is None:
        return (0.0,) * len(names)
    try:
        numbers = [float(x) for x in text.split(",")]
    except ValueError:
        numbers = []
    if len(numbers) != len(names):
        raise ConfigError(f"cannot read {flag} {text!r}: give {len(names)} numbers, e.g. {example}")
    for name, x in zip(names, numbers, strict=True):
        in_range(f"{flag} {text}", name, x)
    return tuple(numbers)


def _vocab_cost(text: str) -> tuple[float, float, float, float]:
    """``--vocab-cost F,B,W[,MEM]`` read: four numbers >= 0, the memory 0 where not given."""
    try:
        numbers = [float(x) for x in text.split(",")]
    except ValueError:
        numbers = []
    if len(numbers) not in (3, 4):
        raise ConfigError(f"cannot read --vocab-cost {text!r}: use F,B,W or F,B,W,MEM, e.g. 0.6,0.6,0.6,0.5")
    for name, x in zip(("f", "b", "w", "mem"), numbers, strict=False):
        in_range(f"--vocab-cost {text}", name, x)
    f, b, w, *mem = numbers
    return f, b, w, (mem[0] if mem else 0.0)


def check_costs_used(args: argparse.Namespace, simulated: list[Schedule]) -> None:
    """Refuse, in one line, a cost option that none of the ``simulated`` schedules would feel: memory between a B and
    its W where no schedule splits them, an overlapped pair's cost where none runs one, a stash without the work
    that keeps it, a link's bandwidth with no bytes to carry, or bytes with no bandwidth to take time."""
    kinds = {a.kind for s in simulated for row in s.actions for a in row}
    replicas = getattr(args, "dp", 1) > 1 or any(len(s.holders(i)) > 1 for s in simulated for i in range(s.stages))
    kfac = args.command == "pipefisher" or bool(kinds & {"KA", "KG", "KI", "KP"})  # pipefisher adds K-FAC's work
    offloads = bool(getattr(args, "offload_activations", None) or getattr(args, "offload_fit", None)
                    or getattr(args, "allow_offload", False))
    rules = (
        ("mem_w", "W" in kinds, "is the memory a stage holds between its B and its W, and no schedule here runs a "
                                "separate W (zb-h1, zb-v and the V family do)"),
        ("overlap", "FB" in kinds, "prices an overlapped pair F+B, and no schedule here runs one (dualpipe and "
                                   "dualpipev do)"),
        ("exchange_overlap", "FB" in kinds, "hides one part's expert all-to-alls under the other's compute in an "
                                            "overlapped pair F+B, and no schedule here runs one: use dualpipe, "
                                            "dualpipev or 1f1b --combined 1"),
        ("opt", "OPT" in kinds, "is the time of an optimizer step the schedule runs as an action (OPT), and no "
                                "schedule here does"),
        ("work", kfac, "prices K-FAC's actions, and no schedule here runs them: pipefold pipefisher places them, or "
                       "give a schedule file that has them"),
        ("stash", kfac, "is what K-FAC's work keeps of a microbatch, and no schedule here runs it: pipefold pipefisher "
                        "places it, or give a schedule file that has it"),
        ("bandwidth", args.activation_bytes > 0 or args.grad_bytes > 0,
         "prices the bytes a link carries: give --activation-bytes or --grad-bytes too"),
        ("activation_bytes", args.bandwidth < math.inf or getattr(args, "network", None) is not None,
         "takes time only over a link of some --bandwidth: give it too"),
        ("grad_bytes", replicas, "is what the copies of a stage all-reduce, and no stage here has copies: give --dp "
                                 "2 or more, or a schedule with replicas (chimera, dualpipe)"),
        ("offload_time", "OF" in kinds or offloads, "is the time of the copies an activation offload makes, and no "
                                                    "schedule here offloads: give --offload-activations, "
                                                    "--offload-fit or --allow-offload too"),
        ("offloadable", "OF" in kinds or offloads, "is the share of activations an offload moves, and no schedule "
                                                   "here offloads: give --offload-activations, --offload-fit or "
                                                   "--allow-offload too"),
    )
    for dest, used, why in rules:
        if dest in args.given and not used:
            raise ConfigError(f"--{dest.replace('_', '-')} {why}: drop it")


def kind_table(text: str, flag: str) -> dict[str, float]:
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
        in_range(f"{flag} {item}", "f" if flag == "--work" else "mem", out[code.strip()])
    return out


def in_range(what: str, dest: str, value: float) -> None:
    """Refuse a number read from inside an option's text (``--work KA=0.5``) outside the range of the option
    ``dest`` (:data:`pipefold.cli.ranges.RANGES`), as the parser refuses an option's own number."""
    rng = ranges.range_of(dest)
    assert rng is not None
    try:
        rng.parse(repr(value))
    except argparse.ArgumentTypeError as why:
        raise ConfigError(f"{what}: {why}") from None


def num(x: float) -> str:
    return f"{x:.6g}"


def check_outputs(*outputs: tuple[str, str | None, bool]) -> None:
    """Refuse, before any work, each (what, path, is a figure) that cannot be written."""
    from pipefold.files import check_writable

    for what, path, figure in outputs:
        if path is not None:
            check_writable(path, what, figure=figure)


@contextlib.contextmanager
def stage_bar(label: str) -> Iterator[Callable[[str, int, int], None] | None]:
    """A progress bar on stderr (when it is a terminal) for work in named parts: progress(part, done, total)."""
    with progress_bar(label) as bar:
        if bar is None:
            yield None
            return
        yield lambda part, done, total: bar(done, total)


@contextlib.contextmanager
def progress_bar(label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar on stderr when it is a terminal, otherwise no callback at all: the parts done of
    the total (a search's candidates, counted before it starts), the time it has taken and an estimate of the time
    left."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    err = make_console(stderr=True)
    if not err.is_terminal:
        yield None
        return
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)

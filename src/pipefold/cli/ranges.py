"""The range of every number the command line takes, in one table (:data:`RANGES`): a value outside it is refused
when the arguments are parsed, before any work, in one line that names the range. The parser attaches a range to
every option that takes a number (:func:`attach`), and refuses to build with one that has none, so that a new
numeric option cannot be forgotten here.

The ranges are what a real run can meet: counts that fit the schedule tables' limits
(:data:`pipefold.ir.MAX_DEVICES`, :data:`pipefold.ir.MAX_STAGE_MICROBATCHES`), times and sizes that a clock and a
float print as numbers (a cost of 1e301 would print a makespan of 300 digits; a latency of 1e12 s is past the
platform's clock), fractions within 0..1."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from pipefold.ir import MAX_DEVICES, MAX_STAGE_MICROBATCHES
from pipefold.units import MAX_BYTES

MAX_STEPS = 10_000_000
"""The most optimizer steps a run may take (weeks of a fast step)."""
MAX_SECONDS = 7 * 86400.0
"""The longest time in seconds an option may give (a week)."""
MAX_COST = 1e9
"""The largest cost of the simulator's model, in its time or memory units."""
MAX_SEED = 2**63 - 1
"""The largest seed: what torch's generators take."""


@dataclass(frozen=True)
class Range:
    """Numbers from ``low`` to ``high`` (each end included unless ``open_low``), whole ones where ``whole``;
    ``unlimited`` also takes ``inf`` (an option whose default is no limit)."""

    low: float
    high: float
    whole: bool = True
    open_low: bool = False
    unlimited: bool = False

    def describe(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        low = f"> {self.low:g}" if self.open_low else f">= {self.low:g}"
        high = f"<= {self.high:,}" if self.whole else f"<= {self.high:g}"
        return f"{kind} {low} and {high}" + (" (or inf: no limit)" if self.unlimited else "")

    def parse(self, text: str) -> int | float:
        """``text`` as a number in the range; :class:`argparse.ArgumentTypeError` saying what works if not."""
        value: int | float
        try:
            value = int(text) if self.whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}") from None
        if self.unlimited and value == math.inf:
            return value
        below = value <= self.low if self.open_low else value < self.low
        if math.isnan(value) or below or value > self.high:
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {self.describe()}")
        return value


def count(low: int, high: int) -> Range:
    return Range(low, high)


def real(low: float, high: float, *, open_low: bool = False, unlimited: bool = False) -> Range:
    return Range(low, high, whole=False, open_low=open_low, unlimited=unlimited)


_COST = real(0, MAX_COST)
_BYTES = real(0, MAX_BYTES)

RANGES: dict[str, Range] = {
    # shapes
    "devices": count(1, MAX_DEVICES),
    "microbatches": count(1, MAX_STAGE_MICROBATCHES),
    "dp": count(1, MAX_DEVICES),
    "cp": count(1, MAX_DEVICES),
    "ep": count(1, MAX_DEVICES),
    "world": count(1, MAX_DEVICES * 64),
    "chunks": count(1, MAX_DEVICES),
    "nodes": count(1, 65_536),
    "global_batch": count(1, 1 << 24),
    "opt_*": count(0, MAX_STAGE_MICROBATCHES),
    "opt_vocab": count(0, 1),
    # models
    "layers": count(1, 4096),
    "hidden": count(1, 1 << 17),
    "heads": count(1, 4096),
    "vocab_size": count(2, 1 << 22),
    "batch": count(1, 1 << 24),
    "seq": count(1, 1 << 24),
    # runs
    "steps": count(1, MAX_STEPS),
    "adapt_every": count(1, MAX_STEPS),
    "checkpoint_every": count(1, MAX_STEPS),
    "keep_last": count(1, MAX_STEPS),
    "max_bad_steps": count(1, MAX_STEPS),
    "seed": count(0, MAX_SEED),
    "repeats": count(1, 10_000),
    "k": count(1, 4096),
    "kprime": count(1, 4096),
    "action_timeout": real(0, 86400, open_low=True),
    "lr": real(0, 1e3),
    "clip": real(0, 1e9, open_low=True),
    "damping": real(0, 1e6),
    "ema": real(0, 1),
    # bagpipe
    "lookahead": count(0, 100_000),
    "ahead": count(0, 1000),
    "cache": real(0, 1, open_low=True),
    "skew": real(0, 1, open_low=True),
    "tables": count(1, 4096),
    "rows": count(1, 1 << 30),
    "dim": count(1, 1 << 16),
    "trainers": count(1, 64),
    # the simulator's cost model
    "f": _COST, "b": _COST, "w": _COST, "mem": _COST, "mem_w": _COST, "opt": _COST, "weights": _COST,
    "gathered": _COST, "latency": _COST,
    "bandwidth": real(0, MAX_BYTES, open_low=True, unlimited=True),
    "activation_bytes": _BYTES, "grad_bytes": _BYTES,
    "recompute": real(0, 1),
    "offload_time": _COST, "offload_fit": _COST,
    "offloadable": real(0, 1),
    "at": real(0, MAX_SECONDS),
    # searches and drawings
    "max_steps": count(1, 1024),
    "slack": real(0, 100),
    "headroom": real(0, 1, open_low=False),
    "top": count(1, 100_000),
    "moe_imbalance": real(1, 1e3),
    "node_limit": count(1, 65_536),
    "width": count(20, 100_000),
    "largest": real(1e6, 1e18),
}
"""Each numeric option's range, by its destination (``opt_*``: every schedule family's option). One destination
has one range in every command that takes it."""


def range_of(dest: str) -> Range | None:
    return RANGES.get(dest) or (RANGES["opt_*"] if dest.startswith("opt_") else None)


def attach(parser: argparse.ArgumentParser) -> None:
    """Give every option of ``parser`` that takes a number (``type`` int or float) its :data:`RANGES` entry, so that
    argparse refuses a value outside it in one line. An option with none stops the parser's build."""
    for action in parser._actions:
        if action.type in (int, float):
            found = range_of(action.dest)
            assert found is not None, f"option --{action.dest} takes a number but has no range in RANGES"
            assert found.whole == (action.type is int), f"--{action.dest}: its range and its type disagree"
            action.type = _typed(found, action.type)


def _typed(rng: Range, kind: type) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        return rng.parse(text)

    parse.__name__ = kind.__name__
    parse.range = rng  # type: ignore[attr-defined]
    return parse


NEGATIVE = re.compile(r"^-(\.?\d|inf|nan)", re.IGNORECASE)
"""What a value that starts with a minus looks like (-1, -1,1, -.5, -1e3, -inf): argparse reads it as a value, not
an option, since no option's name looks so. Its own pattern takes only -1 and -1.5, so that ``--offload -1,1``
would say "expected one argument" where the range's own line says what works."""

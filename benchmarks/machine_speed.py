"""How fast this machine is right now: a fixed piece of work, timed, to put a profile and a run minutes apart on
one scale.

A plan's prediction is made from a profile; the run it predicts comes minutes later. On a shared machine its
speed moves between the two (this one's plain matmuls moved by up to 20% from one half-second to the next, and a
model's profile by up to 1.8 times within minutes: docs/plan.md). The accuracy benchmarks time this probe, which
owes nothing to pipefold (two Linear layers and a GELU, forward and backward, in plain torch on one thread),
right before and right after the profile and each run, and report the measured step over the prediction twice:
as it is, and over the probe's own ratio (the run's time over the profile's), which says how much of a miss the
machine's speed explains.

    python benchmarks/machine_speed.py            # the probe's time, five times, with its spread
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

WIDTH, ROWS, PASSES, WINDOWS = 256, 64, 25, 5


def probe() -> float:
    """Seconds of one forward and backward of the fixed work: the median of WINDOWS windows of PASSES passes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(WIDTH, WIDTH, generator=gen, requires_grad=True)
        b = torch.randn(WIDTH, WIDTH, generator=gen, requires_grad=True)
        x = torch.randn(ROWS, WIDTH, generator=gen)

        def one() -> None:
            (torch.nn.functional.gelu(x @ a) @ b).sum().backward()

        for _ in range(3):  # warm
            one()
        windows = []
        for _ in range(WINDOWS):
            t0 = time.perf_counter()
            for _ in range(PASSES):
                one()
            windows.append((time.perf_counter() - t0) / PASSES)
        return statistics.median(windows)
    finally:
        torch.set_num_threads(threads)


@dataclass
class Bracket:
    """The probe right before and right after some work: ``seconds`` is their mean."""

    before: float = float("nan")
    after: float = float("nan")

    @property
    def seconds(self) -> float:
        return (self.before + self.after) / 2

    def to_dict(self) -> dict[str, float]:
        return {"probe_before_s": self.before, "probe_after_s": self.after, "probe_s": self.seconds}


@contextmanager
def bracket() -> Iterator[Bracket]:
    """``with bracket() as b: work()``: the probe before and after the work."""
    b = Bracket(before=probe())
    yield b
    b.after = probe()


def at_profile_speed(ratio: float, run: Bracket | dict[str, float], profile: Bracket | dict[str, float]) -> float:
    """A measured-over-predicted ``ratio`` with the machine's drift taken out: over the probe's time at the run
    against at the profile (above 1 when the machine was slower at the run)."""
    seconds = [x.seconds if isinstance(x, Bracket) else x["probe_s"] for x in (run, profile)]
    return ratio / (seconds[0] / seconds[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--times", type=int, default=5, help="probes to take (default 5)")
    args = ap.parse_args()
    if args.times < 1:
        ap.error(f"--times must be at least 1, got {args.times}")
    got = [probe() for _ in range(args.times)]
    print(f"probe: {statistics.median(got) * 1e6:.0f} us a pass (median of {args.times}; "
          f"{min(got) * 1e6:.0f}..{max(got) * 1e6:.0f})")


if __name__ == "__main__":
    main()

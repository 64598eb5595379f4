"""How steady this machine is: a fixed piece of work that owes nothing to pipefold (two Linear layers and a GELU,
forward and backward, in plain torch on one thread), timed again and again.

A plan's prediction comes from a profile and is checked against a run minutes later; on a shared machine the
speed moves in between. The spread of this probe over a minute is the noise floor under any such check
(benchmarks/results/machine_speed.md).

    python benchmarks/machine_speed.py                # 20 probes, a few seconds
    python benchmarks/machine_speed.py --block        # and, after each, a block of plan_accuracy's gpt-small
    python benchmarks/machine_speed.py --beside 10    # that block alone, then beside a second process, 10 rounds

With ``--block`` each probe is followed by 20 forwards and backwards of one transformer block of the GPT at width
64 and sequence 256 (what ``plan_accuracy.py``'s gpt-small is made of), and the two series' spreads and
correlation are printed: whether a probe timed between the runs could stand for the model's own speed.

With ``--beside N`` the block is timed for a second alone, then for a second while another process runs the same
block on the other core, N rounds: whether the machine's speed moves with a second busy core (as the plan's
sharing of the cores has it) or on its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
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


def gpt_block() -> Callable[[], float]:
    """A function timing one forward and backward of a GPT block at width 64, sequence 256, batch 2 (median of
    20), on one thread."""
    from pipefold.models import make_model

    block = make_model("gpt", layers=3, hidden=64, heads=4, seq=256, batch=2).build()[1]
    x = torch.randn(2, 256, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def timed() -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                block(x).sum().backward()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            torch.set_num_threads(threads)

    timed()  # warm
    return timed


def beside(rounds: int) -> None:
    """The GPT block for a second alone, then for a second beside another process running it, ``rounds`` times."""
    block = gpt_block()

    def window() -> float:
        t0, got = time.perf_counter(), []
        while time.perf_counter() - t0 < 1.0:
            got.append(block())
        return statistics.median(got)

    alone, shared = [], []
    for r in range(rounds):
        alone.append(window())
        other = subprocess.Popen([sys.executable, __file__, "--burn", str(os.getpid())])
        try:
            time.sleep(1.0)  # (its model built, it computes)
            shared.append(window())
        finally:
            other.kill()
            other.wait()
        print(f"round {r + 1}: alone {alone[-1] * 1e6:.0f} us, beside another {shared[-1] * 1e6:.0f} us "
              f"(x{shared[-1] / alone[-1]:.2f})", flush=True)
    print(_spread("GPT block alone", alone))
    print(_spread("GPT block beside another", shared))
    ratios = [b / a for a, b in zip(alone, shared, strict=True)]
    print(f"beside over alone, median of the rounds: x{statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}..{max(ratios):.2f})")


def _spread(name: str, got: list[float]) -> str:
    return (f"{name}: {statistics.median(got) * 1e6:.0f} us a pass (median of {len(got)}); "
            f"{min(got) * 1e6:.0f}..{max(got) * 1e6:.0f} us, the slowest {max(got) / min(got):.2f} times the fastest")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--times", type=int, default=20, help="probes to take (default 20)")
    ap.add_argument("--block", action="store_true", help="time a GPT block after each probe, and correlate")
    ap.add_argument("--beside", type=int, metavar="N", help="time a GPT block alone and beside another process, "
                    "N rounds")
    ap.add_argument("--burn", type=int, help=argparse.SUPPRESS)  # the other process of --beside: its parent's pid
    args = ap.parse_args()
    if args.burn is not None:  # until killed, or until its parent is gone (killed itself, it cannot kill this one)
        burn = gpt_block()
        while os.getppid() == args.burn:
            burn()
        return
    if args.beside is not None:
        if args.beside < 1:
            ap.error(f"--beside must be at least 1 round, got {args.beside}")
        beside(args.beside)
        return
    if args.times < 1:
        ap.error(f"--times must be at least 1, got {args.times}")
    if args.times < 2 and args.block:
        ap.error("--block needs --times of at least 2 (a correlation)")
    block = gpt_block() if args.block else None
    got, blocks = [], []
    for _ in range(args.times):
        got.append(probe())
        if block is not None:
            blocks.append(block())
    print(_spread(f"probe ({WINDOWS} windows of {PASSES} passes)", got))
    if blocks:
        print(_spread("GPT block", blocks))
        print(f"correlation of the two over {args.times} rounds: {np.corrcoef(got, blocks)[0, 1]:.2f}")


if __name__ == "__main__":
    main()

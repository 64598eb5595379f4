"""Time per training step of the GPT with layer offloading (k = 1, 2, 4, 8; k' = 1) against the plain model.

Each configuration runs ``--steps`` training steps (forward, backward, SGD) after one warm-up step
and reports the median, as a ratio to the plain model, with the peak parameter bytes on the device
(embedding and head included). If ``accelerate`` is importable, ``accelerate.cpu_offload`` on the
same model is timed too. On a CPU-only machine every fetch is a memcpy, so this measures the
wrapper's overhead, not transfer time over PCIe.

Steps are taken round-robin over the configurations, so load from other processes hits all alike.

    python benchmarks/bench_offload.py [--layers 24 --hidden 256 --heads 8 --batch 8 --seq 128 --steps 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from pipefold.errors import run_script
from pipefold.runtime.offload import Offloaded
from pipefold.train.offload_check import Case, default_device, make_case


def _median_steps(models: list[nn.Module], case: Case, device: str, steps: int) -> list[float]:
    """Median seconds per training step of each model, steps taken round-robin so that load on a shared
    machine hits every model alike; the first step of each is a warm-up and not counted."""
    times: list[list[float]] = [[] for _ in models]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    xs, y = case.data()
    x, y = tuple(t.to(device) for t in xs), y.to(device)
    for _ in range(steps + 1):
        for model, opt, seconds in zip(models, opts, times, strict=True):
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            case.loss(model(*x), y).backward()
            opt.step()
            if device != "cpu":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    return [statistics.median(t[1:]) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    case = make_case("gpt", layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch, seq=args.seq)
    device = default_device()
    console = Console(markup=False)

    plain = case.build()
    full = plain.total_bytes
    models: list[nn.Module] = [plain.to(device)]
    names = ["plain"]
    wrapped = [Offloaded(case.build(), device, k=k, kprime=1) for k in args.ks]
    models += wrapped
    names += [f"Offloaded k={k}, k'=1" for k in args.ks]
    if importlib.util.find_spec("accelerate") is None:
        console.print("accelerate not installed: skipped")
    else:  # written for machines that have it; not run on the CPU-only machine of docs/offload.md
        from accelerate import cpu_offload

        model = case.build()
        cpu_offload(model, execution_device=device)
        models.append(model)
        names.append("accelerate.cpu_offload")
    seconds = _median_steps(models, case, device, args.steps)
    base = seconds[0]
    peaks = [float(full)] + [float(w.tracker.peak_resident_bytes) for w in wrapped] + [float("nan")]
    rows = list(zip(names, seconds, peaks, strict=False))

    table = Table(title=f"gpt, {args.layers} blocks, width {args.hidden}, batch {args.batch} x {args.seq} tokens, "
                        f"{device}, median of {args.steps} training steps", title_justify="left")
    for col in ("", "s/step", "vs plain", "peak param bytes on device", "of full model"):
        table.add_column(col, justify="right" if col else "left")
    for name, secs, peak in rows:
        known = peak == peak  # NaN: not measured
        table.add_row(name, f"{secs:.3f}", f"{secs / base:.2f}x",
                      f"{peak / 2**20:.1f} MiB" if known else "-", f"{peak / full:.1%}" if known else "-")
    console.print(table)


if __name__ == "__main__":
    run_script(main)

"""A Linear's weight gradient added in place (pipefold.runtime.wgrad) against autograd's way, by layer width.

One stage of 4 MLP blocks (Linear(H, 4H) -> GELU -> Linear(4H, H)), 8 microbatches of 8 rows, one thread: the
stage of ``benchmarks/vs_torch.py`` at H=512. For each width, interleaved, medians over the repeats:

- ``BW``: the stage runner's fused backward per microbatch, with the in-place weight gradients and with autograd's
  (``StageRunner._fuse`` off: ``torch.autograd.backward``);
- ``W``: the split W per microbatch, with the in-place product and with autograd restarted at the product;
- ``faults``: the operating system's minor page faults per microbatch in each BW (``getrusage``), an account
  independent of the timed code: autograd makes each weight's gradient as a new tensor, and where the allocator
  hands a tensor of that size fresh pages from the OS, each page faults once, to be zeroed;
- ``traffic``: what the in-place way would save per microbatch from memory traffic alone (autograd writes each
  weight's gradient to a new tensor and reads it back to add it: 2 x the weight's bytes more than ``addmm_``),
  at the bandwidth of a copy measured here on tensors of the same size.

Below ``wgrad.MIN_BYTES`` on the CPU (``wgrad.GPU_MIN_BYTES`` on a GPU) BW keeps autograd's way by default (rows
marked *); the in-place columns there are measured with both floors set to 0, to show the crossover.

    OMP_NUM_THREADS=1 python benchmarks/wgrad.py [--hidden 512] [--steps 40] [--json] [--device cuda]

``--hidden`` is the largest width measured (of 64, 128, 192, 256, 384, 512 and itself); ``--steps`` the repeats.
``--device cuda`` times the same passes on a GPU (a synchronize closes each timing); there the caching allocator
reuses memory, so the page faults count only the host's side.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from pipefold.errors import run_script
from pipefold.models.mlp import MLPConfig, build_mlp_layers
from pipefold.runtime import wgrad
from pipefold.runtime.stage import Chain, StageRunner

BLOCKS, MICROBATCHES, ROWS = 4, 8, 8
WIDTHS = (64, 128, 192, 256, 384, 512)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_bandwidth(nbytes: int, repeats: int, device: torch.device) -> float:
    """Bytes per second of ``a.copy_(b)`` on float32 tensors of ``nbytes`` each (read b, write a)."""
    a, b = torch.empty(nbytes // 4, device=device), torch.randn(nbytes // 4, device=device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a.copy_(b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def measure(width: int, repeats: int, device: torch.device, rows: int = ROWS) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Chain(*build_mlp_layers(MLPConfig(hidden=width, layers=BLOCKS), range(BLOCKS)).values()).to(device)
    runner = StageRunner(module)
    xs = [torch.randn(rows, width, device=device) for _ in range(MICROBATCHES)]
    gs = [torch.randn(rows, width, device=device) for _ in range(MICROBATCHES)]
    original = wgrad.linear_of

    faults: dict[bool, list[float]] = {True: [], False: []}

    def bw(in_place: bool) -> float:
        runner._fuse = in_place
        for i, x in enumerate(xs):
            runner.forward(i, (x,))
        _sync(device)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for i, g in enumerate(gs):
            runner.backward(i, (g,))
        _sync(device)
        took = (time.perf_counter() - t0) / MICROBATCHES
        faults[in_place].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / MICROBATCHES)
        return took

    def w(in_place: bool) -> float:
        wgrad.linear_of = original if in_place else (lambda node, least=0: None)
        try:
            for i, (x, g) in enumerate(zip(xs, gs, strict=True)):
                runner.forward(i, (x,))
                runner.backward_input(i, (g,))
            _sync(device)
            t0 = time.perf_counter()
            for i in range(MICROBATCHES):
                runner.backward_weight(i)
            _sync(device)
            return (time.perf_counter() - t0) / MICROBATCHES
        finally:
            wgrad.linear_of = original

    runs: dict[str, list[float]] = {}
    variants: dict[str, Callable[[], float]] = {
        "bw_in_place": lambda: bw(True), "bw_autograd": lambda: bw(False),
        "w_in_place": lambda: w(True), "w_autograd": lambda: w(False)}
    # The in-place way at every width, for the crossover: both floors (host and device) at 0 while measuring.
    floors = wgrad.MIN_BYTES, wgrad.GPU_MIN_BYTES
    wgrad.MIN_BYTES = wgrad.GPU_MIN_BYTES = 0
    try:
        for f in variants.values():
            f()  # warm up
        faults[True].clear()
        faults[False].clear()
        for _ in range(repeats):
            for name, f in variants.items():
                runs.setdefault(name, []).append(f())
    finally:
        wgrad.MIN_BYTES, wgrad.GPU_MIN_BYTES = floors
    med = {k: statistics.median(v) for k, v in runs.items()}
    weight_bytes = 4 * width * 4 * width  # each Linear's weight: H x 4H float32
    bandwidth = _copy_bandwidth(weight_bytes, max(repeats, 20), device)
    predicted = 2 * BLOCKS * weight_bytes * 2 / bandwidth  # 2 Linears a block, 2 x its bytes each
    return {"width": width, "weight_bytes": weight_bytes, "fused_by_default": weight_bytes >= wgrad.min_bytes(device),
            "faults_in_place": statistics.median(faults[True]), "faults_autograd": statistics.median(faults[False]),
            **{f"{k}_ms": 1e3 * v for k, v in med.items()},
            "bw_ratio": med["bw_in_place"] / med["bw_autograd"], "w_ratio": med["w_in_place"] / med["w_autograd"],
            "bw_saved_ms": 1e3 * (med["bw_autograd"] - med["bw_in_place"]), "traffic_saved_ms": 1e3 * predicted,
            "copy_gb_s": bandwidth / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512, help="the largest MLP width H measured")
    parser.add_argument("--steps", type=int, default=40, help="repeats of each measurement")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the passes run")
    parser.add_argument("--rows", type=int, default=ROWS, help=f"rows of a microbatch (default {ROWS})")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.hidden < 1 or args.steps < 1 or args.rows < 1:
        parser.error("--hidden, --steps and --rows must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here; leave --device out to measure on the CPU")
    device = torch.device(args.device)
    widths = sorted({w for w in WIDTHS if w <= args.hidden} | {args.hidden})
    rows = [measure(h, args.steps, device, args.rows) for h in widths]
    if args.json:
        print(json.dumps({"torch": torch.__version__, "device": args.device, "microbatch_rows": args.rows,
                          "rows": rows}, indent=1))
        return
    table = Table(title=f"per microbatch ({BLOCKS} MLP blocks, {args.rows} rows), medians of {args.steps}")
    for col in ("H", "weight MiB", "BW in place", "BW autograd", "ratio", "saved", "faults (in place/autograd)",
                "traffic", "W in place", "W autograd", "W ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["width"]) + ("" if r["fused_by_default"] else " *"), f"{r['weight_bytes'] / 2**20:.2f}",
                      f"{r['bw_in_place_ms']:.3f}", f"{r['bw_autograd_ms']:.3f}", f"{r['bw_ratio']:.2f}",
                      f"{r['bw_saved_ms']:.3f}", f"{r['faults_in_place']:.0f} / {r['faults_autograd']:.0f}",
                      f"{r['traffic_saved_ms']:.3f}", f"{r['w_in_place_ms']:.3f}", f"{r['w_autograd_ms']:.3f}",
                      f"{r['w_ratio']:.2f}")
    Console(width=160, markup=False).print(table)
    bandwidths = ", ".join(f"{r['copy_gb_s']:.1f}" for r in rows)
    floor = wgrad.min_bytes(torch.device(args.device))
    print(f"times in ms; * below BW's floor on {args.device} ({floor / 2**20:.0f} MiB), "
          "where BW keeps autograd's way "
          f"by default; copy bandwidth {bandwidths} GB/s; torch {torch.__version__} on {args.device}")


if __name__ == "__main__":
    run_script(main)

"""Layer offloading on a GPU: peak device memory from the CUDA allocator and step time, against the plain model and
``accelerate.cpu_offload``, with the gradients and weights compared.

For one GPT (default: 16 blocks of width 2048, 16 heads, batch 4 x 1024 tokens, float32: blocks of
milliseconds on an H100) each configuration (the plain model; ``Offloaded`` at each k with k' = 1, the
last k the one that keeps about half the blocks' bytes resident; accelerate's ``cpu_offload``) is built
alone and measured:

- peak device memory of one training step (forward, backward, SGD): ``torch.cuda.max_memory_allocated``
  after ``reset_peak_memory_stats``, the absolute figure and the rise over what was allocated before
  the step; beside it pipefold's own resident-bytes tracker (an independent count of the parameter
  bytes on the device);
- step time: median of ``--steps`` steps after two warm-ups, synchronized around each;
- exactness: every gradient and updated weight against the plain model's (max absolute difference).

On the CPU (``--quick`` sizes) it runs the same code with the memory columns '-': a check that the
script works, not a measurement.

    python benchmarks/offload_gpu.py                 # on a GPU
    python benchmarks/offload_gpu.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from pipefold.offload import Offloaded, choose_k
from pipefold.offload_check import make_case


def _measure(model: nn.Module, case: Any, device: torch.device, steps: int, lr: float = 1e-3) -> dict[str, Any]:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    xs, y = case.data()
    x, y = tuple(t.to(device) for t in xs), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    times, out = [], {}
    for i in range(steps + 2):
        if cuda and i == 2:
            sync()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        case.loss(model(*x), y).backward()
        if i == 2:  # the gradients of the same step as every other configuration's
            out["grads"] = [p.grad.detach().to("cpu", copy=True) for p in model.parameters()]
        opt.step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
        if cuda and i == 2:
            out["peak"] = torch.cuda.max_memory_allocated(device)
            out["rise"] = out["peak"] - before
    out["seconds"] = statistics.median(times)
    out["weights"] = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    return out


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 steps (a check that it runs)")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.heads, args.batch, args.seq, args.steps = 6, 64, 4, 2, 32, 3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = make_case("gpt", layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch, seq=args.seq)
    blocks = case.build().block_bytes
    half = choose_k(blocks, sum(blocks) // 2)[0]
    configs: list[tuple[str, Any]] = [("plain", lambda: case.build().to(device))]
    configs += [(f"Offloaded k={k}, k'=1", lambda k=k: Offloaded(case.build(), device, k=k, kprime=1))
                for k in sorted({*args.ks, half})]
    if importlib.util.find_spec("accelerate") is not None:
        def accelerated() -> nn.Module:
            from accelerate import cpu_offload

            model = case.build()
            cpu_offload(model, execution_device=device)
            return model
        configs.append(("accelerate.cpu_offload", accelerated))
    results: dict[str, dict[str, Any]] = {}
    for name, make in configs:
        try:
            model = make()
            got = _measure(model, case, device, args.steps)
            tracker = getattr(model, "tracker", None)
            got["resident"] = tracker.peak_resident_bytes if tracker is not None else None
        except torch.cuda.OutOfMemoryError:
            got = {"error": "OOM"}
        results[name] = got
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results["plain"]
    table = Table(title=f"gpt {args.layers} blocks, width {args.hidden}, batch {args.batch} x {args.seq}, {device}, "
                        f"median of {args.steps} SGD steps (half the blocks' bytes: k={half})", title_justify="left")
    for col in ("", "s/step", "vs plain", "allocator peak MiB", "peak vs plain", "tracker resident MiB",
                "max grad diff", "max weight diff"):
        table.add_column(col, justify="right" if col else "left")
    rows = []
    for name, r in results.items():
        if "error" in r:
            table.add_row(name, r["error"], *["-"] * 6)
            continue
        peak = r.get("peak")
        row = {"name": name, "seconds": r["seconds"], "ratio": r["seconds"] / base["seconds"], "peak_bytes": peak,
               "rise_bytes": r.get("rise"), "resident_bytes": r["resident"],
               "peak_ratio": None if peak is None else peak / base["peak"],
               "grad_diff": _diff(r["grads"], base["grads"]), "weight_diff": _diff(r["weights"], base["weights"])}
        rows.append(row)
        table.add_row(name, f"{row['seconds']:.4f}", f"{row['ratio']:.2f}x",
                      "-" if peak is None else f"{peak / 2**20:,.0f}",
                      "-" if row["peak_ratio"] is None else f"{row['peak_ratio']:.2f}",
                      "-" if row["resident_bytes"] is None else f"{row['resident_bytes'] / 2**20:,.1f}",
                      f"{row['grad_diff']:.1e}", f"{row['weight_diff']:.1e}")
    Console(width=150).print(table)
    if args.json:
        info = {"torch": torch.__version__, "device": str(device),
                "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
                "sizes": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "batch", "seq", "steps")},
                "half_k": half, "rows": rows}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=1)


if __name__ == "__main__":
    main()

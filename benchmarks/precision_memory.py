"""Peak activation memory of the V schedules and ZB-H1 over 1F1B, in float32 and in bf16 (autocast), side by side.

Each run is the command line, ``pipefold train ... --json`` (a subprocess, 4 local ranks on the CPU), on the GPT
model: by default 15 blocks (17 layers with the embedding and the head), hidden 128, 128 tokens, batch 16 in 8
microbatches, 2 steps, ``--partition even`` (the default split balances measured time, which changes from run to
run and from float32 to bf16; an even split keeps the stages the same for every run, so only the schedule and the
dtype differ). With 15 blocks the even split gives 1F1B's rank 0 (the one with the most microbatches in flight)
the embedding and 4 blocks, and the V schedules' ranks 1 and 2 two stages of 2 blocks: the ranks that peak hold 4
blocks in both layouts, as the papers' counts assume (the embedding holds almost nothing for a backward). Read
from each run's JSON:

- ``peak_activation_bytes``: per rank, the runtime meter's peak of the tensors it held (saved for backward, stage
  outputs, gradients kept for W, receive buffers, sends in flight; every storage counted once; the batch and the
  parameters apart), over both steps. The table takes the max over ranks.
- ``predicted_peak_bytes``: per rank, the simulator's peak for the same schedule fed with the per-stage bytes the
  run measured (one microbatch after F, during B, between B and W): independent check (b).

Reported: the max-over-ranks peak per schedule and dtype (median over runs, spread min..max: memory is
deterministic, so the spread should be 0), its ratio to 1F1B's in the same dtype and run, the simulator's ratio,
the schedule's ratio at unit memory (the simulator with every stage's microbatch = 1, for these p and m), the
published ratio (controllable-memory paper: V-Min ~1/3, V-Half ~1/2, ZB-V = 1F1B; zero-bubble paper: ZB-H1 =
1F1B) as independent check (a), and bf16/fp32 per schedule (check (c): 0.5 where autocast keeps a tensor in bf16,
more where norms, softmax and the residual stream stay float32). For (c) the script also counts, outside pipefold,
what one GPT block saves for its backward per microbatch (``torch.autograd.graph.saved_tensors_hooks``, each
storage once, the parameters' own storages left out as the meter leaves them out) in float32 and under autocast,
split into bf16 tensors, float32 tensors and autocast's bf16 copies of the weights (each microbatch's forward
makes its own). Run:

    python benchmarks/precision_memory.py                   # 5 schedules x 2 dtypes x 2 runs (~3 minutes on 2 cores)
    python benchmarks/precision_memory.py --quick           # tiny model, 1 run: checks the script works (~1 minute)
    python benchmarks/precision_memory.py --schedules 1f1b v-min --runs 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from pipefold.errors import ConfigError, run_script

SCHEDULES = ["1f1b", "zb-h1", "v-min", "v-half", "zb-v"]
DTYPES = ["fp32", "bf16"]
BASE = "1f1b"
PUBLISHED = {"1f1b": 1.0, "zb-h1": 1.0, "v-min": 1 / 3, "v-half": 1 / 2, "zb-v": 1.0}
"""Published peak activation memory over 1F1B's: Qi et al., Pipeline Parallelism with Controllable Memory (V-Min
about 1/3, V-Half about 1/2, ZB-V the same as 1F1B), and Qi et al., Zero Bubble Pipeline Parallelism (ZB-H1 the
same as 1F1B). Both are stated for large p; at small p the schedules' own counts differ (the unit-memory column)."""


@dataclass(frozen=True)
class Sizes:
    devices: int
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    microbatches: int
    steps: int
    runs: int
    partition: str


QUICK = dict(layers=7, hidden=32, heads=2, seq=32, batch=8, steps=1, runs=1)


def command(schedule: str, dtype: str, sizes: Sizes) -> list[str]:
    """The ``pipefold train`` command of one run."""
    return [sys.executable, "-m", "pipefold", "train", "--model", "gpt", "--schedule", schedule,
            "--devices", str(sizes.devices), "--layers", str(sizes.layers), "--hidden", str(sizes.hidden),
            "--heads", str(sizes.heads), "--seq", str(sizes.seq), "--batch", str(sizes.batch),
            "--microbatches", str(sizes.microbatches), "--steps", str(sizes.steps), "--partition", sizes.partition,
            "--device", "cpu", "--dtype", dtype, "--json"]


def run_one(schedule: str, dtype: str, sizes: Sizes) -> dict[str, Any]:
    """One ``pipefold train --json`` run: its per-rank peaks, the prediction, the split; or its error (the last
    line of what it wrote to stderr)."""
    cmd = command(schedule, dtype, sizes)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
        return {"error": f"exit {proc.returncode}: {lines[-1] if lines else ''}", "seconds": seconds}
    out = json.loads(proc.stdout)
    return {"peak": out["peak_activation_bytes"], "predicted": out["predicted_peak_bytes"],
            "boundaries": out["boundaries"], "stages": out["stages"], "precision": out["precision"],
            "step_time_s": out["step_time_s"], "loss": out["loss"], "seconds": seconds, "error": None}


_VIEWS = {"TBackward0", "TransposeBackward0", "ViewBackward0", "PermuteBackward0", "ExpandBackward0",
          "UnsafeViewBackward0", "AliasBackward0"}


def _is_weight_cast(t: Any, params: set[int]) -> bool:
    """Whether ``t`` is (a view of) autocast's copy of a parameter: its autograd history is a cast of that leaf."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEWS:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    src = fn.next_functions[0][0]
    return src is not None and id(getattr(src, "variable", None)) in params


def block_saved_bytes(sizes: Sizes) -> dict[str, Any]:
    """What one GPT block saves for its backward for one microbatch, counted by torch itself
    (``saved_tensors_hooks``), each storage once, the parameters' own storages left out: in float32, and under
    bf16 autocast split into bf16 activations, float32 activations and autocast's bf16 copies of the weights."""
    import torch

    from pipefold.models.gpt import Block, GPTConfig

    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=sizes.hidden, n_head=sizes.heads, n_layer=1, block_size=sizes.seq))
    rows = sizes.batch // sizes.microbatches
    x = torch.randn(rows, sizes.seq, sizes.hidden, requires_grad=True)  # a stage's input: the received activation
    params = {id(p) for p in block.parameters()}
    param_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
    out: dict[str, Any] = {"tokens_per_microbatch": rows * sizes.seq}
    for name, enabled in (("fp32", False), ("bf16", True)):
        seen: dict[int, tuple[int, str]] = {}

        def pack(t: Any, seen: dict[int, tuple[int, str]] = seen) -> Any:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in param_storages and key not in seen:
                kind = "weight_cast" if _is_weight_cast(t, params) else f"act_{str(t.dtype).split('.')[-1]}"
                seen[key] = (st.nbytes(), kind)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            block(x)
        kinds: dict[str, int] = {}
        for nbytes, kind in seen.values():
            kinds[kind] = kinds.get(kind, 0) + nbytes
        out[name] = {"total": sum(kinds.values()), **kinds}
    fp32 = out["fp32"]["total"]
    bf16 = out["bf16"]
    out["bf16_over_fp32"] = bf16["total"] / fp32
    out["bf16_over_fp32_without_weight_casts"] = (bf16["total"] - bf16.get("weight_cast", 0)) / fp32
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def unit_ratios(schedules: list[str], devices: int, microbatches: int) -> dict[str, float]:
    """Each schedule's max-over-devices peak at unit memory (the simulator, every stage's microbatch = 1 unit of a
    device's share of the model) over 1F1B's: what the schedule's order alone gives at these p and m."""
    from pipefold import build, simulate

    peaks = {s: max(simulate(build(s, devices, microbatches)).peak_memory) for s in {*schedules, BASE}}
    return {s: peaks[s] / peaks[BASE] for s in schedules}


def summarize(raw: dict[str, dict[str, list[dict[str, Any]]]], sizes: Sizes, schedules: list[str],
              dtypes: list[str]) -> dict[str, Any]:
    unit = unit_ratios(schedules, sizes.devices, sizes.microbatches)
    rows = []
    for dtype in dtypes:
        base = raw[dtype][BASE]
        for s in schedules:
            runs = raw[dtype][s]
            ok = [r for r in runs if r["error"] is None]
            peaks = [max(r["peak"]) for r in ok]
            pred = [max(r["predicted"]) for r in ok]
            ratio = [max(r["peak"]) / max(b["peak"]) for r, b in zip(runs, base, strict=True)
                     if r["error"] is None and b["error"] is None]
            pratio = [max(r["predicted"]) / max(b["predicted"]) for r, b in zip(runs, base, strict=True)
                      if r["error"] is None and b["error"] is None]
            rows.append({"dtype": dtype, "schedule": s, "max_peak_bytes": _spread(peaks),
                         "per_rank_peak_bytes": ok[0]["peak"] if ok else None,
                         "per_rank_predicted_bytes": ok[0]["predicted"] if ok else None,
                         "identical_over_runs": len({tuple(r["peak"]) for r in ok}) <= 1,
                         "ratio_to_1f1b": _spread(ratio), "predicted_max_bytes": _spread(pred),
                         "predicted_ratio_to_1f1b": _spread(pratio),
                         "measured_over_predicted": _spread([m / p for m, p in zip(peaks, pred, strict=True)]),
                         "unit_memory_ratio": unit[s], "published_ratio": PUBLISHED.get(s),
                         "boundaries": ok[0]["boundaries"] if ok else None,
                         "run_seconds": _spread([r["seconds"] for r in runs]),
                         "errors": sorted({r["error"] for r in runs if r["error"]})})
    halves = []
    if "fp32" in dtypes and "bf16" in dtypes:
        for s in schedules:
            pairs = [(a, b) for a, b in zip(raw["fp32"][s], raw["bf16"][s], strict=True)
                     if a["error"] is None and b["error"] is None]
            per_rank = [[y / x for x, y in zip(a["peak"], b["peak"], strict=True)] for a, b in pairs]
            halves.append({"schedule": s, "bf16_over_fp32_max": _spread([max(b["peak"]) / max(a["peak"])
                                                                          for a, b in pairs]),
                           "bf16_over_fp32_per_rank": per_rank[0] if per_rank else None,
                           "predicted_bf16_over_fp32_max": _spread([max(b["predicted"]) / max(a["predicted"])
                                                                    for a, b in pairs])})
    return {"sizes": asdict(sizes), "schedules": schedules, "dtypes": dtypes, "rows": rows, "bf16_over_fp32": halves,
            "block_saved": block_saved_bytes(sizes),
            "command": " ".join(["python", *command("SCHEDULE", "DTYPE", sizes)[1:]]),
            "python": sys.version.split()[0], "torch": _torch_version(), "cpus": os.cpu_count()}


def _torch_version() -> str:
    import torch

    return torch.__version__


def _fmt(s: dict[str, float] | None, digits: int = 3) -> str:
    if s is None:
        return "-"
    if s["min"] == s["max"]:
        return f"{s['median']:.{digits}f} (spread 0)"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}..{s['max']:.{digits}f})"


def _mib(s: dict[str, float] | None) -> str:
    if s is None:
        return "-"
    m = {k: v / 2**20 for k, v in s.items()}
    return f"{m['median']:.2f}" + (" (spread 0)" if s["min"] == s["max"] else f" ({m['min']:.2f}..{m['max']:.2f})")


def table(summary: dict[str, Any]) -> str:
    sz = summary["sizes"]
    out = [f"Peak activation bytes per rank (max over {sz['devices']} ranks), GPT {sz['layers']} blocks, hidden "
           f"{sz['hidden']}, seq {sz['seq']}, batch {sz['batch']} in {sz['microbatches']} microbatches, "
           f"--partition {sz['partition']}, {sz['steps']} steps; median over {sz['runs']} runs (spread min..max)", "",
           "| dtype | schedule | peak MiB (max over ranks) | / 1f1b measured | / 1f1b simulator (fed measured bytes) | "
           "/ 1f1b at unit memory (p, m here) | / 1f1b published | measured / simulator | per-rank peak MiB | "
           "same every run |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        pub = r["published_ratio"]
        per_rank = "/".join(f"{b / 2**20:.2f}" for b in r["per_rank_peak_bytes"]) if r["per_rank_peak_bytes"] else "-"
        out.append(f"| {r['dtype']} | {r['schedule']} | {_mib(r['max_peak_bytes'])} | {_fmt(r['ratio_to_1f1b'])} | "
                   f"{_fmt(r['predicted_ratio_to_1f1b'])} | {r['unit_memory_ratio']:.3f} | "
                   f"{'-' if pub is None else f'{pub:.3f}'} | {_fmt(r['measured_over_predicted'])} | {per_rank} | "
                   f"{'yes' if r['identical_over_runs'] else 'NO'} |")
    if summary["bf16_over_fp32"]:
        out += ["", "bf16 (autocast) over fp32, the same schedule and run:", "",
                "| schedule | bf16/fp32 max-over-ranks peak | per rank (run 1) | simulator's bf16/fp32 |",
                "|---|---|---|---|"]
        for h in summary["bf16_over_fp32"]:
            per_rank = "/".join(f"{x:.3f}" for x in h["bf16_over_fp32_per_rank"]) \
                if h["bf16_over_fp32_per_rank"] else "-"
            out.append(f"| {h['schedule']} | {_fmt(h['bf16_over_fp32_max'])} | {per_rank} | "
                       f"{_fmt(h['predicted_bf16_over_fp32_max'])} |")
    b = summary["block_saved"]
    kib = 1024

    def parts(d: dict[str, int]) -> str:
        return ", ".join(f"{k} {v / kib:.0f}" for k, v in sorted(d.items()) if k != "total")

    out += ["", f"One GPT block's tensors saved for backward per microbatch ({b['tokens_per_microbatch']} tokens), "
            "counted by torch's saved_tensors_hooks (parameters' own storages left out): "
            f"fp32 {b['fp32']['total'] / kib:.0f} KiB ({parts(b['fp32'])}); "
            f"bf16 autocast {b['bf16']['total'] / kib:.0f} KiB ({parts(b['bf16'])}); "
            f"bf16/fp32 {b['bf16_over_fp32']:.3f}, without the weight casts "
            f"{b['bf16_over_fp32_without_weight_casts']:.3f}"]
    splits = sorted({(r["schedule"], tuple(r["boundaries"] or ())) for r in summary["rows"]})
    out += ["", "Stage boundaries (first layer of each stage; layer 0 is the embedding, the last the head): " +
            "; ".join(f"{s} {list(b)}" for s, b in splits)]
    errors = [f"{r['dtype']} {r['schedule']}: {e}" for r in summary["rows"] for e in r["errors"]]
    return "\n".join(out + ([""] + errors if errors else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, metavar="NAME",
                        help=f"schedules to measure; {BASE} is always run (default: {' '.join(SCHEDULES)})")
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    parser.add_argument("--runs", type=int, default=2, help="runs of each schedule and dtype (default 2)")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--layers", type=int, default=15, help="GPT blocks (default 15: 17 layers in all)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--partition", default="even", choices=["even", "params", "time", "memory"])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, one run, one step: checks the script works, its figures mean little")
    parser.add_argument("--json", metavar="OUT", help="also write the summary and every run as JSON to OUT")
    args = parser.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.runs < 1 or args.steps < 1:
        raise ConfigError("--runs and --steps must be at least 1")
    schedules = [BASE] + [s for s in args.schedules if s != BASE]
    sizes = Sizes(args.devices, args.layers, args.hidden, args.heads, args.seq, args.batch, args.microbatches,
                  args.steps, args.runs, args.partition)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {d: {s: [] for s in schedules} for d in args.dtypes}
    started = time.perf_counter()
    for r in range(sizes.runs):  # rounds: every schedule and dtype once per round
        for s in schedules:
            for d in args.dtypes:
                res = run_one(s, d, sizes)
                raw[d][s].append(res)
                what = res["error"] or f"max peak {max(res['peak']) / 2**20:.2f} MiB"
                print(f"run {r + 1}/{sizes.runs} {s} {d}: {what} ({res['seconds']:.1f} s)", file=sys.stderr,
                      flush=True)
    summary = summarize(raw, sizes, schedules, args.dtypes)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(table(summary))
    print(f"\npython {summary['python']}, torch {summary['torch']}, {summary['cpus']} CPUs, "
          f"{summary['seconds']:.0f} s in all; each run: {summary['command']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "raw": raw}, f, indent=1)


if __name__ == "__main__":
    run_script(main)

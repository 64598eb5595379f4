"""Everything pipefold claims on a CUDA GPU, checked and measured in one call: ``make gpu-check``.

Sections (``--only`` picks some; each runs on its own, so one failing does not hide the others):

    tests     pytest tests/test_cuda.py (with test_offload.py and test_stage.py, which have CUDA cases and the
              runner's backward): every schedule's gradients against one process on the same GPU, overlapped
              pairs on two streams, recomputation, offloading, replicas, K-FAC, dp, ZeRO-1, tensor
              parallelism, the meter against the caching allocator
    memory    the GPT where activations dominate (16 blocks, hidden 1024, sequence 1024, 16 microbatches,
              4 ranks, time-balanced split): per rank the meter's peak, the allocator's level between
              actions and its peak (``torch.cuda.max_memory_allocated``), the simulator's prediction; the
              V-shape schedules' peaks over 1F1B's against the papers' 0.75 / 0.5 / 1.0
    precision the memory section's GPT in bf16 (autocast): the V schedules' peaks over 1F1B's beside float32's, on
              the meter and the allocator; step time in bf16 against float32, and of inductor-compiled stages
              (split and whole) against eager, on 1f1b and zb-v, runs interleaved
    layouts   a world of 4 laid out as pp 4, tp 2 x pp 2, dp 2 x pp 2 and dp 2 x pp 2 with ZeRO-1 (the GPT, 1f1b, ranks
              sharing the GPU): per rank the meter's peak between actions against the CUDA allocator's and torch's
              MemTracker's, the independent checks of the peaks issue 28's layout tables compare with the plan
    overlap   dualpipev and dualpipe with their F+B pairs on two streams and one after the other
    speed     step time against torch.distributed.pipelining on the same GPU (benchmarks/vs_torch.py
              --device cuda, at its own hidden 512 and at 4096) and against one process training the same
              model on the GPU
    wgrad     benchmarks/wgrad.py --device cuda: a stage's backward with the weight gradients added in place
              against autograd's, widths 64 to 2048
    offload   benchmarks/offload_gpu.py: peak device memory and step time with layers offloaded,
              beside accelerate's cpu_offload
    chunks    benchmarks/state_chunks.py --device cuda: the largest GPT within a device budget with and without
              model-state chunks, host chunks pinned and copied on streams, step and update times in GPU time
    calibrate ``pipefold calibrate``: this GPU's bf16 matrix products from 1e8 to 1e12 operations against the
              shipped file of its kind (H100 or H200 by name, else A100): the measured matmul efficiency beside
              the shipped curve, which was fitted to published runs (docs/cluster.md), and the calibrated file

It writes ``OUT/report.md`` (one markdown table per section), ``OUT/report.json`` and figures beside
them. On one GPU the ranks share it, and gloo moves their tensors through pinned host memory
(:mod:`pipefold.runtime.launch.devices`); every figure says so.

    python benchmarks/gpu_check.py --out gpu-report            # everything
    python benchmarks/gpu_check.py --only memory --quick       # smaller sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTIONS = ("tests", "memory", "precision", "layouts", "overlap", "speed", "wgrad", "offload", "activations",
            "chunks", "calibrate")
PAPER = {"1f1b": 1.0, "v-half": 0.75, "v-min": 0.5, "zb-v": 1.0}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


# -- sections


def tests(out: Path, quick: bool) -> dict[str, Any]:
    """The CUDA tests, as a subprocess: its summary line and the failures. With pytest-xdist (a GPU machine's image
    usually has it) they run eight at a time: each starts its ranks' CUDA contexts, and the GPU has room."""
    # One -q: the project's addopts give the other (two would drop pytest's summary line, which this reads).
    args = ["-rfE", "-p", "no:cacheprovider", *(f"tests/{name}" for name in ("test_cuda.py", "test_offload.py",
                                                                             "test_stage.py"))]
    if importlib.util.find_spec("xdist") is not None:
        args += ["-n", str(min(8, os.cpu_count() or 1))]
    if quick:
        args += ["-k", "not 4]"]
    cmd = [sys.executable, "-m", "pytest", *args]
    started = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    (out / "tests.log").write_text(run.stdout + run.stderr, encoding="utf-8")
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else run.stderr.strip().splitlines()[-1:]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    md = f"`pytest {' '.join(args)}`: **{summary}** ({time.perf_counter() - started:.0f} s)\n"
    if failed:
        md += "\n" + "\n".join(f"- {line[:300]}" for line in failed) + "\n"
    return {"summary": summary, "failed": failed, "returncode": run.returncode, "md": md}


def memory(out: Path, quick: bool, dtype: str = "fp32") -> dict[str, Any]:
    """Per rank: the meter, the allocator between actions and at its peak, the simulator; ratios over 1F1B (the
    passes computing in ``dtype``)."""
    from pipefold import simulate
    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.measure.timeline import measured_costs
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    size = (dict(layers=8, hidden=512, heads=8, seq=512) if quick
            else dict(layers=16, hidden=1024, heads=16, seq=1024))
    rows: dict[str, Any] = {}
    for name in ("1f1b", "v-half", "v-min", "zb-v"):
        config = RunSpec.flat(schedule=name, devices=4, microbatches=16, batch=16, steps=2, model="gpt",
                             partition="time", optimizer="sgd", device="cuda", action_timeout=300.0, dtype=dtype,
                             **size)
        job = dataclasses.replace(make_job(config), verify_memory_step=1)
        reports = sorted(run_local(job), key=lambda r: r.rank)
        predicted = simulate(job.schedule, measured_costs(job.schedule, reports, 1)).peak_memory
        ranks = []
        for r, pred in zip(reports, predicted, strict=True):
            step = r.steps[1]
            check = step.memory_check
            ranks.append({"meter": step.peak_activation_bytes, "allocator_between": check["allocator_between_actions"],
                          "allocator_peak": check["allocator_peak"], "tracker_peak": check["tracker_peak"],
                          "predicted": pred})
        rows[name] = {"ranks": ranks, "split": [len(p) for p in job.layer_stages]}
    base = {k: max(r[k] for r in rows["1f1b"]["ranks"]) for k in ("meter", "allocator_between", "predicted")}
    table = []
    for name, res in rows.items():
        for i, r in enumerate(res["ranks"]):
            gap = r["allocator_between"] / r["meter"] - 1
            table.append([name if i == 0 else "", i, _mib(r["meter"]), _mib(r["allocator_between"]), f"{gap:+.1%}",
                          _mib(r["allocator_peak"]), _mib(r["predicted"]), f"{r['meter'] / r['predicted'] - 1:+.1%}"])
        res["ratio"] = {k: max(r[k] for r in res["ranks"]) / base[k] for k in base}
    ratios = [[name, " ".join(map(str, res["split"])), f"{res['ratio']['meter']:.3f}",
               f"{res['ratio']['allocator_between']:.3f}", f"{res['ratio']['predicted']:.3f}", f"{PAPER[name]:.2f}"]
              for name, res in rows.items()]
    md = (f"GPT {size['layers']} blocks, hidden {size['hidden']}, {size['heads']} heads, sequence {size['seq']}, "
          f"16 microbatches of 1 sequence, 4 ranks sharing the GPU, time-balanced split, {dtype}. MiB of the step's "
          "own memory (activations, buffers, sends; parameters, gradients and optimizer state excluded).\n\n"
          + _table(["schedule", "rank", "meter peak", "allocator between actions", "allocator vs meter",
                    "allocator peak (temporaries too)", "simulated", "meter vs simulated"], table)
          + "\n\nHighest rank's peak over 1F1B's:\n\n"
          + _table(["schedule", "layers per stage", "meter", "allocator", "simulated", "paper"], ratios) + "\n")
    _memory_figure(rows, out / f"memory-{dtype}.png")
    return {"rows": rows, "md": md + f"\n![memory](memory-{dtype}.png)\n"}


def precision(out: Path, quick: bool) -> dict[str, Any]:
    """bf16's memory (the memory section again, autocast to bf16) and step times: bf16 against float32, compiled
    stages against eager."""
    from pipefold.train.run import train
    from pipefold.train.spec import RunSpec

    held = memory(out, quick, "bf16")
    size = dict(layers=6, hidden=512, heads=8, seq=256) if quick else dict(layers=12, hidden=1024, heads=16, seq=512)
    recipes = {"fp32": {}, "bf16": {"dtype": "bf16"}, "bf16 + compile split": {"dtype": "bf16", "compile": "split"},
               "bf16 + compile whole": {"dtype": "bf16", "compile": "whole"}}
    results: dict[str, list[float]] = {}
    for _ in range(1 if quick else 2):
        for schedule in ("1f1b", "zb-v"):
            for label, recipe in recipes.items():
                config = RunSpec.flat(schedule=schedule, devices=2, microbatches=8, batch=8, steps=6, model="gpt",
                                      partition="even", optimizer="sgd", device="cuda", **recipe, **size)
                _, reports = train(config)
                results.setdefault(f"{schedule} {label}", []).append(_median_wall(reports)[0])
    rows = []
    for schedule in ("1f1b", "zb-v"):
        base = statistics.median(results[f"{schedule} fp32"])
        for label in recipes:
            runs = results[f"{schedule} {label}"]
            rows.append([schedule, label, f"{1e3 * statistics.median(runs):.1f}",
                         f"{statistics.median(runs) / base:.3f}", " ".join(f"{1e3 * v:.1f}" for v in runs)])
    md = (held["md"] + f"\nStep time: GPT {size['layers']} blocks, hidden {size['hidden']}, sequence {size['seq']}, "
          "8 microbatches, 2 ranks sharing the GPU; median step (ms) of steps 2..6 (compiled: after compiling), "
          "runs interleaved.\n\n"
          + _table(["schedule", "recipe", "ms", "over fp32", "every run (ms)"], rows) + "\n")
    return {"memory": held["rows"], "times": results, "md": md}


LAYOUTS = ((1, 1, 4, False), (2, 1, 2, False), (1, 2, 2, False), (1, 2, 2, True))
"""(tp, dp, pp, ZeRO-1) of the layouts section: a world of 4."""


def layout_rows(quick: bool, device: str = "cuda") -> list[dict[str, Any]]:
    """Each layout's ranks: the meter's peak between actions, torch's MemTracker's and (on CUDA) the allocator's, in
    the step checked (the second)."""
    from pipefold.runtime.launch.local import run_local
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    size = (dict(layers=4, hidden=256, heads=4, seq=128) if quick
            else dict(layers=8, hidden=1024, heads=16, seq=512))
    rows = []
    for tp, dp, pp, zero1 in LAYOUTS:
        config = RunSpec.flat(schedule="1f1b", devices=pp, dp=dp, tp=tp, zero1=zero1, microbatches=8, batch=16,
                              steps=2, model="gpt", partition="even", optimizer="adamw", device=device,
                              action_timeout=300.0, **size)
        job = dataclasses.replace(make_job(config), verify_memory_step=1)
        for r in sorted(run_local(job), key=lambda r: r.rank):
            check = r.steps[1].memory_check
            rows.append({"layout": f"tp {tp} x dp {dp} x pp {pp}" + (" ZeRO-1" if zero1 else ""), "rank": r.rank,
                         "meter": check["meter_between_actions"], "tracker": check["tracker_between_actions"],
                         "tracker_host": check["tracker_elsewhere_between_actions"],
                         "allocator": check.get("allocator_between_actions")})
    return rows


def layouts(out: Path, quick: bool) -> dict[str, Any]:
    """Issue 28's layouts on the GPU: the meter against the allocator and MemTracker, rank by rank."""
    rows = layout_rows(quick)
    table = [[r["layout"], r["rank"], _mib(r["meter"]), _mib(r["tracker"]), _mib(r["allocator"]),
              f"{r['allocator'] / r['meter'] - 1:+.1%}", _mib(r["tracker_host"])] for r in rows]
    md = ("GPT, 1f1b, 8 microbatches, AdamW, a world of 4 ranks sharing the GPU; the step's own memory (MiB) at its "
          "highest between two actions of the checked step\n\n"
          + _table(["layout", "rank", "meter", "MemTracker", "CUDA allocator", "allocator vs meter",
                    "MemTracker, host memory (messages staged)"], table) + "\n")
    return {"rows": rows, "md": md}


def _memory_figure(rows: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(rows)
    width = 0.2
    for k, (key, label) in enumerate((("meter", "pipefold's meter"), ("allocator_between", "CUDA allocator"),
                                      ("allocator_peak", "allocator peak (temporaries)"),
                                      ("predicted", "simulator"))):
        for i, name in enumerate(names):
            values = [r[key] / 2**30 for r in rows[name]["ranks"]]
            xs = [i * 5 + j + (k - 1.5) * width for j in range(len(values))]
            ax.bar(xs, values, width, color=f"C{k}", label=label if i == 0 else None)
    ax.set_xticks([i * 5 + 1.5 for i in range(len(names))], names)
    ax.set_ylabel("GiB per rank (ranks 0..3)")
    ax.set_title("A step's memory per rank: meter, allocator and simulator")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _median_wall(reports: list[Any]) -> tuple[float, float]:
    """Median over the steps after the first that ran plain (``StepHistory.timed``) of the slowest rank's step time,
    and the spread (max - min)."""
    walls = [max(r.steps.wall[i] for r in reports) for i in reports[0].steps.timed(1)]
    return statistics.median(walls), max(walls) - min(walls)


def overlap(out: Path, quick: bool) -> dict[str, Any]:
    """dualpipev and dualpipe, pairs on two streams and one after the other, runs interleaved: on 4 ranks sharing
    the GPU, and dualpipev on one rank that has the GPU to itself (its two stages hold the whole model)."""
    from pipefold.train.run import train
    from pipefold.train.spec import RunSpec

    size = dict(layers=6, hidden=512, heads=8, seq=256) if quick else dict(layers=14, hidden=1024, heads=16, seq=512)
    cases = (("dualpipev", 4), ("dualpipe", 4), ("dualpipev", 1))
    rows = []
    results: dict[str, list[float]] = {}
    for _ in range(1 if quick else 2):
        for name, ranks in cases:
            for on in (True, False):
                config = RunSpec.flat(schedule=name, devices=ranks, microbatches=16, batch=16, steps=6, model="gpt",
                                      partition="even", optimizer="sgd", device="cuda", overlap=on, **size)
                _, reports = train(config)
                key = f"{name} {ranks} {'overlap' if on else 'serial'}"
                results.setdefault(key, []).append(_median_wall(reports)[0])
    for name, ranks in cases:
        a, b = results[f"{name} {ranks} overlap"], results[f"{name} {ranks} serial"]
        rows.append([name, str(ranks), f"{1e3 * statistics.median(a):.1f}", f"{1e3 * statistics.median(b):.1f}",
                     f"{statistics.median(a) / statistics.median(b):.3f}", " ".join(f"{1e3 * v:.1f}" for v in a + b)])
    md = (f"GPT {size['layers']} blocks, hidden {size['hidden']}, sequence {size['seq']}, 16 microbatches; 4 ranks "
          "share the GPU, 1 rank has it to itself; median step (ms) of steps 2..6, runs interleaved.\n\n"
          + _table(["schedule", "ranks", "F+B on two streams", "one after the other", "ratio", "every run (ms)"], rows)
          + "\n")
    return {"results": results, "md": md}


def speed(out: Path, quick: bool) -> dict[str, Any]:
    """benchmarks/vs_torch.py on the GPU at its own size (issue 27's) and a wide one, each beside one process
    training the same model there."""
    small = speed_at(out, 512, quick)
    wide = speed_at(out, 1024 if quick else 4096, quick)
    return {"small": small, **wide, "md": small["md"] + "\n" + wide["md"]}


def speed_at(out: Path, hidden: int, quick: bool) -> dict[str, Any]:
    """vs_torch.py with the MLP of width ``hidden``, and one process training the same model on the GPU."""
    runs = "1" if quick or hidden > 512 else "3"
    args = ["--device", "cuda", "--json", "--hidden", str(hidden), "--layers", "8",
            "--batch", "64", "--microbatches", "8", "--steps", "4" if quick else "8", "--runs", runs]
    run = subprocess.run([sys.executable, str(HERE / "vs_torch.py"), *args], cwd=ROOT, capture_output=True, text=True,
                         check=False, timeout=600)
    (out / f"vs_torch_{hidden}.log").write_text(run.stdout + run.stderr, encoding="utf-8")
    try:
        result = json.loads(run.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"md": f"vs_torch.py failed ({run.returncode}): {run.stderr.strip()[-500:]}\n"}
    single = _single_process(result["model"], quick)
    md = (f"`python benchmarks/vs_torch.py {' '.join(args)}`: " + speed_table(result)
          + f"\n\nOne process training the same model on the GPU (no pipeline, same microbatches): "
            f"{single:.1f} ms per step.\n")
    return {"vs_torch": result, "single_process_ms": single, "md": md}


def speed_table(result: dict[str, Any]) -> str:
    """vs_torch.py's JSON as markdown: per schedule each side's median step over its runs, the ratios of every run
    (pipefold over torch, in the same interleaved run) and what failed."""

    def median_ms(runs: list[dict[str, Any]], side: str) -> str:
        values = [r[side]["median_ms"] for r in runs if r[side]["median_ms"] is not None]
        return f"{statistics.median(values):.1f}" if values else "failed"

    rows = []
    for s in result["schedules"]:
        ratios = [r["ratio"] for r in s["runs"] if r["ratio"] is not None]
        notes = sorted({n for r in s["runs"] for n in r["notes"]})
        rows.append([s["schedule"] + "".join(f" {k}={v}" for k, v in s["options"].items()),
                     median_ms(s["runs"], "pipefold"), median_ms(s["runs"], "pipefold_gloo"),
                     median_ms(s["runs"], "torch"),
                     f"{statistics.median(ratios):.2f}" if ratios else "-",
                     " ".join(f"{r:.2f}" for r in ratios) or "-", "; ".join(notes)])
    model = result["model"]
    return (f"MLP hidden {model['hidden']}, {model['layers']} layers, batch {model['batch']} in "
            f"{model['microbatches']} microbatches, {result['world']} ranks sharing the GPU, SGD; median step (ms) "
            f"over {len(result['schedules'][0]['runs']) if result['schedules'] else 0} interleaved run(s) of "
            f"{result['steps']} steps, the first left out.\n\n"
            + _table(["schedule", "pipefold (ms)", "pipefold, gloo p2p (ms)", "torch.distributed.pipelining (ms)",
                      "pipefold/torch", "every run's ratio", "notes"], rows))


def _single_process(model: dict[str, int], quick: bool) -> float:
    """Median ms of one process's step (forward and backward of every microbatch, no optimizer) on the GPU."""
    from pipefold.models.mlp import MLPConfig, build_mlp_layers, mlp_input, mlp_loss, mlp_target

    cfg = MLPConfig(hidden=model["hidden"], layers=model["layers"])
    layers = build_mlp_layers(cfg, list(range(cfg.num_layers)), seed=0)
    net = torch.nn.Sequential(*(layers[i] for i in range(cfg.num_layers))).cuda()
    x, y = mlp_input(cfg, model["batch"], 0).cuda(), mlp_target(cfg, model["batch"], 0).cuda()
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for xs, ys in zip(x.chunk(model["microbatches"]), y.chunk(model["microbatches"]), strict=True):
            (mlp_loss(net(xs), ys) / model["microbatches"]).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])


def wgrad(out: Path, quick: bool) -> dict[str, Any]:
    """benchmarks/wgrad.py on the GPU: the in-place weight gradients against autograd's, by width."""
    args = ["--device", "cuda", "--json", "--hidden", "1024" if quick else "2048", "--steps", "10" if quick else "30"]
    run = subprocess.run([sys.executable, str(HERE / "wgrad.py"), *args], cwd=ROOT, capture_output=True, text=True,
                         check=False, timeout=600)
    (out / "wgrad.log").write_text(run.stdout + run.stderr, encoding="utf-8")
    if run.returncode != 0:
        raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}")
    got = json.loads(run.stdout)
    rows = [[r["width"], f"{r['weight_bytes'] / 2**20:.2f}", f"{r['bw_in_place_ms']:.3f}", f"{r['bw_autograd_ms']:.3f}",
             f"{r['bw_ratio']:.2f}", f"{r['traffic_saved_ms']:.3f}", f"{r['w_in_place_ms']:.3f}",
             f"{r['w_autograd_ms']:.3f}", f"{r['w_ratio']:.2f}", f"{r['copy_gb_s']:.0f}"] for r in got["rows"]]
    md = (f"`python benchmarks/wgrad.py {' '.join(args)}`: one stage of 4 MLP blocks, 8 microbatches of 8 rows, ms per "
          "microbatch, medians (the in-place columns with the size threshold at 0)\n\n"
          + _table(["H", "weight MiB", "BW in place", "BW autograd", "ratio", "traffic saved", "W in place",
                    "W autograd", "W ratio", "copy GB/s"], rows) + "\n")
    return {"rows": got["rows"], "md": md}


def offload(out: Path, quick: bool) -> dict[str, Any]:
    """benchmarks/offload_gpu.py, its JSON into the report."""
    path = out / "offload.json"
    # The offloaded optimizer steps run on the host: give them the cores a GPU machine has (OMP_NUM_THREADS=1 here).
    threads = str(max(1, min(8, (os.cpu_count() or 2) // 2)))
    args = ["--json", str(path), "--threads", threads] + (["--quick"] if quick else [])
    run = subprocess.run([sys.executable, str(HERE / "offload_gpu.py"), *args], cwd=ROOT, capture_output=True,
                         text=True, check=False, timeout=600)
    (out / "offload.log").write_text(run.stdout + run.stderr, encoding="utf-8")
    body = run.stdout.strip()
    return {"returncode": run.returncode, "md": f"`python benchmarks/offload_gpu.py {' '.join(args)}`:\n\n```\n"
                                                 f"{body[-6000:]}\n```\n"}


def activations(out: Path, quick: bool) -> dict[str, Any]:
    """benchmarks/offload_activations.py on the GPU: the copies on their own streams, step times in GPU time."""
    args = ["--device", "cuda", "--devices", "2"]
    if quick:
        args += ["--hidden", "128", "--seq", "64", "--steps", "3"]
    run = subprocess.run([sys.executable, str(HERE / "offload_activations.py"), *args], cwd=ROOT,
                         capture_output=True, text=True, check=False, timeout=600)
    (out / "activations.log").write_text(run.stdout + run.stderr, encoding="utf-8")
    body = run.stdout.strip()
    return {"returncode": run.returncode, "md": f"`python benchmarks/offload_activations.py {' '.join(args)}`:\n\n"
                                                 f"```\n{body[-6000:]}\n```\n"}


def chunks(out: Path, quick: bool) -> dict[str, Any]:
    """benchmarks/state_chunks.py on the GPU, in float32 and with bf16 master weights: host chunks pinned, their
    copies on streams, step times in GPU time."""
    md, code = [], 0
    for precision in ("fp32", "bf16-master"):
        args = ["--device", "cuda", "--precision", precision]
        if quick:
            args += ["--layers", "2", "4", "6", "--repeats", "1"]
        run = subprocess.run([sys.executable, str(HERE / "state_chunks.py"), *args], cwd=ROOT,
                             capture_output=True, text=True, check=False, timeout=600)
        (out / f"chunks-{precision}.log").write_text(run.stdout + run.stderr, encoding="utf-8")
        code = code or run.returncode
        md.append(f"`python benchmarks/state_chunks.py {' '.join(args)}`:\n\n```\n{run.stdout.strip()[-6000:]}\n```\n")
    return {"returncode": code, "md": "\n".join(md)}


# -- the report


def calibrate(out: Path, quick: bool) -> dict[str, Any]:
    """``pipefold calibrate`` on this GPU against the shipped cluster file of its kind."""
    from pipefold.plan.cluster import shipped_for

    shipped = shipped_for(torch.cuda.get_device_name(0))
    written = out / f"{shipped}-calibrated.json"
    args = [sys.executable, "-m", "pipefold", "calibrate", "--cluster", shipped, "--device", "cuda",
            "--largest", "1e11" if quick else "1e12", "-o", str(written), "--json"]
    run = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}")
    got = json.loads(run.stdout)
    rows = [[f"{p['flops']:.3g}", f"{p['seconds'] * 1e3:.3f}", f"{p['tflops_per_s']:.1f}", f"{p['fraction']:.3f}",
             f"{p['file_fraction']:.3f}"] for p in got["products"]]
    md = (f"bf16 products on {got['device']} against `{shipped}`'s peak of {got['peak_flops'] / 1e12:.0f} TFLOP/s; "
          f"written to `{written.name}`\n\n"
          + _table(["operations", "ms", "TFLOP/s", "fraction measured", "shipped curve"], rows))
    return {"shipped": shipped, "products": got["products"], "md": md}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-report", help="folder for report.md, report.json and the figures")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA GPU here; run it on a machine with one (the CUDA tests are skipped "
              "in `make test`)", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    head = (f"# pipefold on a GPU\n\n{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}\n")
    report: dict[str, Any] = {"gpu": props.name, "torch": torch.__version__}
    parts = [head]
    for name in args.only:
        started = time.perf_counter()
        print(f"gpu-check: {name} ...", flush=True)
        try:
            result = globals()[name](out, args.quick)
        except Exception as exc:  # noqa: BLE001 (a section's failure is reported, the others still run)
            result = {"error": f"{type(exc).__name__}: {exc}", "md": f"**failed**: `{type(exc).__name__}: {exc}`\n"}
            (out / f"{name}.error.log").write_text(traceback.format_exc(), encoding="utf-8")
        seconds = time.perf_counter() - started
        result["seconds"] = round(seconds, 1)
        report[name] = {k: v for k, v in result.items() if k != "md"}
        parts.append(f"\n## {name} ({seconds:.0f} s)\n\n{result['md']}")
        print(result["md"], flush=True)
        (out / "report.md").write_text("\n".join(parts), encoding="utf-8")
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    print(f"gpu-check: wrote {out / 'report.md'}")


if __name__ == "__main__":
    main()

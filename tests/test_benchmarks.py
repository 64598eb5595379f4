"""The benchmarks run, in small modes of their own options, so that a change of the library cannot leave one broken
unnoticed (the pages' tests run those the docs show as commands; these run the others that are quick enough).

A benchmark's figures are measurements for the docs, not assertions: here each one must exit 0, print no
traceback and print something, on the sizes its options shrink it to. mypy checks every benchmark's calls into the
library (pyproject.toml's ``files``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Servers, load_benchmark

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

SMALL: dict[str, list[str] | None] = {
    "bench_simulate.py": ["--baseline", "none", "--schedules", "1f1b,zb-v,v-half", "-p", "4", "-m", "8", "--runs", "1",
                          "--repeat", "3"],
    "published.py": ["--check"],  # the stored predictions are the code's (no drift)
    "cluster_search.py": ["--nodes", "2", "--families", "1f1b,zb-v"],
    "offload_gpu.py": ["--quick"],  # its CPU path (figures marked as no measurement): what a GPU run goes through
    "bench_bagpipe.py": ["--skews", "0.92", "--lookaheads", "2", "--steps", "4", "--repeats", "1", "--rows", "2000",
                         "--batch", "64"],
    # Too slow for the suite even in their smallest modes (measured here: 62, 32, 22, 19 and 16 s); mypy checks their
    # calls into the library; run them by hand before quoting their figures:
    "adaptive_kfkb.py": None,  # --modes emulated --steps 4 --repeats 1
    "dataparallel.py": None,  # --runs 1 --dp 2 --steps 2
    "pipefisher.py": None,  # --steps 2 --repeats 1 --lrs-adamw 1e-3 --lrs-kfac 0.05 --util-steps 2
    "plan_speed.py": None,  # --quick --repeats 1
    "plan_accuracy.py": None,  # --models mlp --families 1f1b --no-budget --steps 2 --devices 2
    "layouts.py": None,  # PIPEFOLD_BENCH_SMALL=1 --worlds 4 --steps 3 (27 s, with the layouts of a mesh per device)
    "precision_exactness.py": None,  # --quick (30 s); tests/test_precision.py asserts what it measures
    "precision_memory.py": None,  # --quick (76 s)
    "compile_speed.py": None,  # --quick (1 to 5 min: inductor compiles every mode on every schedule)
    # Run by the pages' tests, as the docs and the results files show them (tests/test_docs.py):
    "memory_flat.py": None,
    "fixed_work.py": None,
    "memory_ratio.py": None,
    "wgrad.py": None,
    "p2p.py": None,
    "layer_company.py": None,
    "core_sharing.py": None,
    "machine_speed.py": None,
    "bench_offload.py": None,
    "bench_recompute.py": None,
    "vs_torch.py": None,
    "vs_torch_library.py": None,  # tests/test_vs_torch_library.py runs it, small
    "runtime_breakdown.py": None,
    "pass_overhead.py": None,
    "host_profile.py": None,
    "in_flight.py": None,
    "offload_activations.py": None,
    "state_chunks.py": None,
    "vocab_paper.py": None,
    "vocab_parallel.py": None,
    "dpkfac.py": None,
    "spb.py": None,
    "ep_overlap.py": None,
    # On a GPU only (make gpu-check):
    "gpu_check.py": None,
}
"""Each benchmark's small mode; None: not run here, for the reason given beside it."""


def test_every_benchmark_has_a_small_mode_or_a_reason() -> None:
    assert sorted(SMALL) == sorted(p.name for p in BENCHMARKS.glob("*.py"))
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(BENCHMARKS / "results").glob("*.md")]
    docs = "\n".join(p.read_text(encoding="utf-8") for p in pages)
    for name in ("bench_offload.py", "bench_recompute.py", "vs_torch.py", "runtime_breakdown.py", "pass_overhead.py",
                 "host_profile.py", "in_flight.py", "memory_flat.py", "fixed_work.py", "memory_ratio.py", "wgrad.py",
                 "p2p.py", "layer_company.py", "core_sharing.py", "machine_speed.py", "offload_activations.py",
                 "state_chunks.py", "vocab_paper.py", "vocab_parallel.py", "dpkfac.py",
                 "spb.py", "ep_overlap.py"):
        assert f"python benchmarks/{name}" in docs, f"{name} is said to run through the docs, which do not show it"


@pytest.mark.parametrize("name", sorted(k for k, v in SMALL.items() if v is not None))
def test_the_benchmark_runs_in_its_small_mode(name: str, tmp_path: Path, servers: Servers) -> None:
    args = SMALL[name]
    assert args is not None
    # As ``python`` runs it (with OMP_NUM_THREADS=1), in the worker's command server: torch is imported once.
    got = servers.get().run([str(BENCHMARKS / name), *args], tmp_path, script=True)
    assert "Traceback" not in got.stderr, got.stderr[-3000:]
    assert got.returncode == 0, f"exit {got.returncode}\n{got.stdout[-2000:]}\n{got.stderr[-2000:]}"
    assert got.stdout.strip(), got.stderr[-2000:]


def test_bench_simulate_times_small_schedules_in_milliseconds_as_medians() -> None:
    """``--repeat``: each process takes the median of that many builds and simulations, and times under a tenth of a
    second are shown in ms; the actions are those of the closed form (1F1B: an F and a BW per stage and
    microbatch)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    got = subprocess.run([sys.executable, str(BENCHMARKS / "bench_simulate.py"), "--baseline", "none", "--schedules",
                          "1f1b,gpipe", "-p", "3", "-m", "5", "--runs", "2", "--repeat", "5"], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    lines = got.stdout.splitlines()
    assert "at p=3 m=5, ms: median [min-max] of 2 fresh processes per version, each the median of 5" in lines[0]
    for name in ("1f1b", "gpipe"):
        row = next(line.split() for line in lines if line.startswith(name + " "))
        assert int(row[1]) == 2 * 3 * 5
        assert float(row[2]) > 0  # build plus simulate, in ms
    assert lines[-1].startswith("slowest now:") and "target" not in lines[-1]


@pytest.mark.parametrize(("args", "says"), [(["--repeat", "0"], "--repeat must be at least 1 (got 0)"),
                                            (["--runs", "0"], "--runs must be at least 1 (got 0)"),
                                            (["--schedules", "nope"], "unknown schedule 'nope'")])
def test_bench_simulate_refuses_bad_input_in_one_line(args: list[str], says: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    got = subprocess.run([sys.executable, str(BENCHMARKS / "bench_simulate.py"), "--baseline", "none", "-p", "2",
                          "-m", "4", *args], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert got.returncode != 0 and "Traceback" not in got.stderr, got.stderr
    assert says in got.stderr.strip().splitlines()[-1]


def test_the_gpu_check_reads_what_vs_torch_writes() -> None:
    """gpu_check.py runs only on a GPU, so its reading of vs_torch.py's JSON is checked here: vs_torch's own
    JSON writer over runs of known times, read back by the GPU report's table, against vs_torch's own table's
    medians. (The JSON once grew a list of runs per schedule and the GPU report still read the old shape.)"""
    vs, check = load_benchmark("vs_torch.py"), load_benchmark("gpu_check.py")
    steps = [[0.5, 0.020, 0.022, 0.021], [0.4, 0.030, 0.028, 0.029], [0.6, 0.010, 0.010, 0.012]]
    runs = [{"pipefold": vs._Run(steps[k]), "pipefold on gloo": vs._Run(steps[(k + 1) % 3]),  # type: ignore[attr-defined]
             "torch": vs._Run(steps[(k + 2) % 3], first_loss=1.0)} for k in range(3)]  # type: ignore[attr-defined]
    failed = [{side: vs._Run(error="boom") if side == "torch" else vs._Run(steps[0])  # type: ignore[attr-defined]
               for side in ("pipefold", "pipefold on gloo", "torch")}]
    rows = [(vs.PAIRS[1], runs), (vs.PAIRS[3], failed)]  # type: ignore[attr-defined]
    result = vs._json(rows, 4, 1.0, (0.0, 0.0, 0.0))  # type: ignore[attr-defined]
    table = check.speed_table(result)  # type: ignore[attr-defined]
    line = next(row for row in table.splitlines() if row.startswith("| 1f1b |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:4] == [vs._median_ms(runs, side) for side in ("pipefold", "pipefold on gloo", "torch")]  # type: ignore[attr-defined]
    # Per run, pipefold's median step over torch's in that run: 21/10, 29/21, 10/29 ms.
    assert cells[5] == "2.10 1.38 0.34" and cells[4] == "1.38"
    zbv = next(row for row in table.splitlines() if row.startswith("| zb-v |"))
    assert "failed" in zbv and "torch failed: boom" in zbv


def test_a_failed_runs_text_is_printed_as_it_is() -> None:
    """A failure's one line goes into vs_torch.py's report verbatim. On a GPU, torch's zb-v failed with gloo's
    "[enforce fail at /pytorch/...]": printed as rich markup, its "[/pytorch/...]" read as a closing tag, and the
    report ended in a MarkupError after every run had finished; a "[b]" in it would have vanished instead."""
    import io

    from rich.console import Console

    vs = load_benchmark("vs_torch.py")
    errors = ["RuntimeError: [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:789] state_ >= "
              "CONNECTED. 1 vs 4", "RuntimeError: [/pytorch/third_party/gloo/pair.cc:547] Read error [b]"]
    rows = [(vs.PAIRS[3], [{"pipefold": vs._Run([0.02, 0.01]), "pipefold on gloo": vs._Run([0.02, 0.01]),  # type: ignore[attr-defined]
                             "torch": vs._Run(error=e)} for e in errors])]  # type: ignore[attr-defined]
    out = io.StringIO()
    vs.report(Console(file=out, width=200), rows, 2, 1.0)  # type: ignore[attr-defined]
    for e in errors:
        assert f"zb-v: torch failed: {e}" in out.getvalue()


def test_the_host_profile_counts_each_group_per_step(tmp_path: Path) -> None:
    """host_profile.py's reading of a cProfile file, against a profile of known calls: 6 products and 4 sleeps of
    a known length over 2 steps, and a Python function of its own (a file under pipefold/runtime by name)."""
    import cProfile
    import time

    import torch

    load_benchmark("vs_torch.py")  # host_profile.py imports it by name, as a script beside it
    hp = load_benchmark("host_profile.py")
    code = compile("def helper(x):\n    return x + 1\n", "/x/src/pipefold/runtime/fake.py", "exec")
    scope: dict[str, object] = {}
    exec(code, scope)  # noqa: S102 (a function whose file names the runtime, as the grouping reads it)
    a = torch.ones(4, 4)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(6):
        torch.mm(a, a)
    for _ in range(4):
        time.sleep(0.01)
    for _ in range(10):
        scope["helper"](1)  # type: ignore[operator]
    prof.disable()
    path = tmp_path / "rank0.prof"
    prof.dump_stats(str(path))
    got = hp.summarize(path, 2, 50)  # type: ignore[attr-defined]
    rows = {r["function"]: r for r in got["top"]}
    assert rows["<built-in method torch.mm>"]["calls"] == 3 and rows["<built-in method torch.mm>"]["group"] == \
        "tensor operations"
    assert rows["<built-in method time.sleep>"]["calls"] == 2
    assert rows["<built-in method time.sleep>"]["own_ms"] >= 20 - 1  # two sleeps of 10 ms a step
    helper = next(r for name, r in rows.items() if name.endswith("(helper)"))
    assert helper["calls"] == 5 and helper["group"] == "pipefold runtime (Python)"
    assert abs(sum(got["groups_ms"].values()) - got["total_ms"]) < 1e-9


def test_the_gpu_checks_layouts_table_reads_the_memory_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """gpu_check.py's layouts section runs only on a GPU: its table is checked here on rows of known bytes, in the
    shape ``layout_rows`` reads from each rank's memory check (the keys ``rank._tracked_step`` writes)."""
    check = load_benchmark("gpu_check.py")
    mib = 2**20
    rows = [{"layout": "tp 2 x dp 1 x pp 2", "rank": r, "meter": 100 * mib, "tracker": 100 * mib,
             "tracker_host": 4 * mib, "allocator": 99 * mib} for r in range(4)]
    monkeypatch.setattr(check, "layout_rows", lambda quick: rows)
    got = check.layouts(tmp_path, True)  # type: ignore[attr-defined]
    lines = [line for line in got["md"].splitlines() if line.startswith("| tp 2")]
    assert len(lines) == 4
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells == ["tp 2 x dp 1 x pp 2", "0", "100.0", "100.0", "99.0", "-1.0%", "4.0"]


def test_the_machine_probe_times_its_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """machine_speed.py's probe times real work: at four times the width its matmuls do 16 times the work (11.5 to
    14.9 times the time, 4 pairs alone), and it takes over twice as long. The margin is wider than the machine's
    own drift between two timings (up to 1.8 times, benchmarks/results/machine_speed.md): at twice the width (2.6
    to 4.3 times alone) a margin of 2 failed once, 1.8 times beside the suite's other worker."""
    speed = load_benchmark("machine_speed.py")
    narrow = speed.probe()
    monkeypatch.setattr(speed, "WIDTH", 4 * speed.WIDTH)
    assert narrow > 0 and speed.probe() > 2 * narrow


@pytest.mark.parametrize(("name", "args", "says"), [
    ("vs_torch.py", ["--hidden", "0", "--steps", "2", "--runs", "1"], "--hidden must be at least 1 (got 0)"),
    ("bench_offload.py", ["--hidden", "10"], "--hidden 10 must be a multiple of --heads 8"),
    ("memory_ratio.py", ["--model", "gpt", "--hidden", "10", "--schedules", "zb-v", "--runs", "1"],
     "--hidden 10 must be a multiple of --heads 4"),
])
def test_a_size_the_model_cannot_take_is_one_line(name: str, args: list[str], says: str, tmp_path: Path,
                                                  servers: Servers) -> None:
    """A benchmark given a size the library refuses (its ConfigError, found past the benchmark's own checks) ends
    as a bad option does: one line naming the script, exit 2, no traceback (pipefold.errors.run_script). Run as
    ``python`` runs it, in the worker's command server (conftest.Server)."""
    got = servers.get().run([str(BENCHMARKS / name), *args], tmp_path, script=True)
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 2 and len(lines) == 1, got.stderr[-3000:]
    assert lines[0].startswith(f"{name}: error: ") and says in lines[0], lines[0]


def test_run_script_ends_a_users_mistake_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from pipefold.errors import ConfigError, ScheduleError, run_script

    monkeypatch.setattr(sys, "argv", ["/some/where/bench.py", "--x"])

    def raising(exc: Exception):  # type: ignore[no-untyped-def]
        def main() -> int:
            raise exc
        return main

    for exc, line in ((ConfigError("--x must be at least 1"), "bench.py: error: --x must be at least 1"),
                      (ScheduleError("stage 3 has no F", "a grid\nof lines"), "bench.py: error: stage 3 has no F")):
        with pytest.raises(SystemExit) as ended:
            run_script(raising(exc))
        assert ended.value.code == 2 and capsys.readouterr().err == line + "\n"
    for returned, code in ((None, 0), (0, 0), (3, 3)):
        with pytest.raises(SystemExit) as ended:
            run_script(lambda r=returned: r)
        assert ended.value.code == code
    with pytest.raises(RuntimeError):  # not the user's mistake: a traceback, as before
        run_script(raising(RuntimeError("a bug")))

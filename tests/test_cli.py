"""The command line, run in-process and as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipefold import Schedule, build, simulate
from pipefold.cli.main import main
from pipefold.ir import load


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_bare_simulate_runs_the_default(capsys) -> None:
    code, out, _ = run(capsys, "simulate")
    assert code == 0
    assert "zb-h1" in out and "makespan 27" in out and "bubble ratio 11.1%" in out
    assert out.count("dev ") >= 4  # the ASCII timeline, one row per device


def test_simulate_json_is_one_object_with_the_keys(capsys) -> None:
    code, out, _ = run(capsys, "simulate", "interleaved-1f1b", "-p", "4", "-m", "8", "--v", "2", "--json")
    assert code == 0
    data = json.loads(out)  # exactly one object: json.loads rejects trailing data
    assert {"schedule", "devices", "stages", "microbatches", "makespan", "bubble_ratio", "peak_memory"} <= set(data)
    assert (data["schedule"], data["devices"], data["stages"], data["makespan"]) == ("interleaved-1f1b", 4, 8, 28.5)
    assert data["peak_memory"] == [5.5, 4.5, 3.5, 2.5]


def test_simulate_costs_and_spec_options(capsys) -> None:
    code, out, _ = run(capsys, "simulate", "kfkb:k=3", "-p", "3", "-m", "9", "--f", "2", "--b", "1", "--w", "0.5",
                       "--latency", "0.25", "--json")
    assert code == 0
    from pipefold.sim.simulate import CostModel

    want = simulate(build("kfkb", 3, 9, k=3), CostModel(f=2, b=1, w=0.5, latency=0.25))
    assert json.loads(out)["makespan"] == pytest.approx(want.makespan)
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--stage-cost", "1:2,2,2,3", "--json")
    assert code == 0 and json.loads(out)["peak_memory"] == [2, 3]


def test_plot_and_trace_files(capsys, tmp_path) -> None:
    png, svg, trace = tmp_path / "t.png", tmp_path / "t.svg", tmp_path / "t.json"
    code, out, _ = run(capsys, "simulate", "zb-h2", "--plot", str(png), "--trace", str(trace))
    assert code == 0 and f"wrote plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X") == build("zb-h2", 4, 8).num_actions
    assert run(capsys, "simulate", "--plot", str(svg))[0] == 0
    assert "<svg" in svg.read_text()


def test_compare_side_by_side(capsys) -> None:
    code, out, _ = run(capsys, "compare", "1f1b", "zb-h1", "interleaved-1f1b", "-p", "4", "-m", "8")
    assert code == 0
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert "33" in lines["1f1b"] and "27" in lines["zb-h1"] and "28.5" in lines["interleaved-1f1b:v=2"]
    code, out, _ = run(capsys, "compare", "1f1b", "kfkb", "--k", "4", "--json")
    rows = json.loads(out)["results"]
    assert [r["schedule"] for r in rows] == ["1f1b", "kfkb"] and rows[1]["options"] == {"k": 4}


def test_schedules_lists_every_name(capsys) -> None:
    code, out, _ = run(capsys, "schedules", "--json")
    assert code == 0
    listed = json.loads(out)
    from pipefold import names

    assert [s["name"] for s in listed] == names()
    assert all(s["description"] for s in listed)
    code, out, _ = run(capsys, "schedules")
    assert all(n in out for n in names()) and "--v 2" in out and "--k 2" in out


@pytest.mark.parametrize("suffix", [".txt", ".json", ".csv"])
def test_generate_then_simulate_and_validate_a_file(capsys, tmp_path, suffix: str) -> None:
    path = tmp_path / f"s{suffix}"
    assert run(capsys, "generate", "zb-h1", "-p", "3", "-m", "6", "-o", str(path))[0] == 0
    assert load(str(path)).actions == build("zb-h1", 3, 6).actions
    code, out, _ = run(capsys, "simulate", str(path), "--json")
    assert code == 0 and json.loads(out)["makespan"] == simulate(build("zb-h1", 3, 6)).makespan
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0 and ": ok (3 devices" in out


def test_generate_to_stdout(capsys) -> None:
    code, out, _ = run(capsys, "generate", "1f1b", "-p", "2", "-m", "2")
    assert code == 0 and Schedule.from_text(out) == build("1f1b", 2, 2)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["simulate", "nope"], "unknown schedule 'nope'; known schedules: gpipe, 1f1b, interleaved-1f1b"),
        (["simulate", "1f1b", "-m", "0"], "-m: 0 is out of range: give a whole number >= 1 and <= 250,000"),
        (["simulate", "--f", "-1"], "argument --f: -1 is out of range: give a number >= 0 and <= 1e+09"),
        (["simulate", "1f1b", "--k", "2"], "schedule 1f1b takes no option --k; its options: --seq-chunks"),
        (["simulate", "chimera", "--seq-chunks", "2"], "schedule chimera cannot cut microbatches into sequence chunks; "
                                                     "schedules that can: gpipe, 1f1b"),
        (["simulate", "interleaved-1f1b", "--v", "0"], "option v of interleaved-1f1b must be an integer >= 1"),
        (["simulate", "missing.json"], "no such schedule file: missing.json"),
        (["simulate", "--stage-cost", "x"], "cannot read --stage-cost 'x': use S:F,B,W or S:F,B,W,MEM"),
        (["simulate", "--plot", "out.pdf"], ".png or .svg"),
        (["simulate", "kfkb:k"], "cannot read option 'k' in 'kfkb:k'"),
    ],
)
def test_user_errors_are_one_line(capsys, argv: list[str], expected: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_malformed_file_names_the_line(capsys, tmp_path) -> None:
    path = tmp_path / "bad.txt"
    text = build("1f1b", 2, 2).to_text().replace("1BW1", "1QQ1")
    path.write_text(text)
    code, _, err = run(capsys, "simulate", str(path))
    lineno = next(i for i, line in enumerate(text.splitlines(), 1) if "1QQ1" in line)
    assert code == 1
    assert f"{path}: line {lineno}: cannot read action '1QQ1'" in err
    assert len(err.strip().splitlines()) == 1


def test_deadlocked_file_shows_the_grid(capsys, tmp_path) -> None:
    path = tmp_path / "dead.csv"
    path.write_text("0F0,0BW0,0F1,0BW1\n1F1,1F0,1BW0,1BW1\n")
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1
    first, *grid = err.strip().splitlines()
    assert first.startswith("pipefold validate: error: deadlock: device 0 at position 1 (0BW0)")
    assert any(">0BW0<" in line for line in grid)


def test_usage_mistake_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "pipefold", "simulate", "--devices", "four"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert "argument --devices/-p: 'four' is not a whole number >= 1 and <= 512" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_old_stages_flag_says_what_it_became() -> None:
    proc = subprocess.run([sys.executable, "-m", "pipefold", "simulate", "1f1b", "--stages", "4"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "--stages was renamed --devices (-p): it counts devices" in proc.stderr


def test_module_entry_point_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "pipefold", "simulate", "1f1b", "--json"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["makespan"] == 33

"""Text from outside (a user's path, an exception's message, a note) printed by the command line as it is: never read
as rich's markup, which would drop its bracketed parts (``plan[a].json`` printed as ``plan.json``) or fail on them
(``[/pytorch/a.cc:1]``, a closing tag with nothing open, a traceback instead of the output)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pipefold.cli.common import make_console, styled
from pipefold.cli.main import main

GLOO = "[enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:789] read: Connection reset by peer"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.splitlines()


def closing_tag_path(tmp_path: Path, suffix: str) -> Path:
    """A path with ``[/a.cc:1]`` in it, which rich's markup refuses: a folder ``d[`` holding ``a.cc:1]<suffix>``."""
    folder = tmp_path / "d["
    folder.mkdir(exist_ok=True)
    return folder / f"a.cc:1]{suffix}"


def test_simulate_generate_validate_print_the_paths_as_given(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    for trace in (tmp_path / "plan[a].json", closing_tag_path(tmp_path, ".json")):
        lines = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--trace", str(trace))
        assert f"wrote trace: {trace}" in lines
        assert json.loads(trace.read_text())
    for schedule in (tmp_path / "s[dim]x.csv", closing_tag_path(tmp_path, ".csv")):
        lines = run(capsys, "generate", "zb-h1", "-p", "2", "-m", "4", "-o", str(schedule))
        assert lines == [f"wrote csv schedule: {schedule}"]
        assert schedule.is_file()
        lines = run(capsys, "validate", str(schedule))
        assert lines == [f"{schedule}: ok (2 devices, 2 stages, 4 microbatches, 24 actions)"]


def test_profile_and_plan_print_the_paths_as_given(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    profile = tmp_path / "p[bold].json"
    lines = run(capsys, "profile", "--model", "mlp", "--layers", "2", "--hidden", "8", "--batch", "4", "-m", "4",
                "--devices", "2", "--repeats", "1", "--no-link", "--no-sharing", "--no-overhead", "-o", str(profile))
    assert lines[0].startswith(f"{profile}: 2 layers of mlp, one microbatch of 1: F ")  # the bold part
    assert profile.is_file()
    for plan in (tmp_path / "out[bold].json", closing_tag_path(tmp_path, ".json")):
        lines = run(capsys, "plan", "--profile", str(profile), "--memory-budget", "1GiB", "--devices", "2", "-m", "4",
                    "-o", str(plan))
        assert lines[-1] == f"wrote plan: {plan}  (run it: pipefold train --plan {plan})"
        assert json.loads(plan.read_text())["profile"]
    cluster_plan = tmp_path / "c[a].json"
    lines = run(capsys, "plan", "--cluster", "h100-sxm", "--hf-config", "llama3-8b", "--global-batch", "8", "--seq",
                "512", "--nodes", "1", "--top", "1", "-o", str(cluster_plan))
    assert lines[-1] == f"wrote {cluster_plan}"
    assert lines[-3].startswith("best: ")  # the styled part kept its text
    assert json.loads(cluster_plan.read_text())["kind"] == "pipefold-cluster-plan"


def test_the_clis_console_prints_markup_verbatim() -> None:
    out = io.StringIO()
    console = make_console(file=out, width=200)
    console.print("x [/a.cc:1] y")
    console.print(f"pipefold train: error: {GLOO} :smile:")
    assert out.getvalue() == f"x [/a.cc:1] y\npipefold train: error: {GLOO} :smile:\n"


def test_styled_parts_keep_their_text_and_style() -> None:
    line = styled(("plan[a].json", "bold"), ": 2 layers of ", ("[dim]gpt[/]", "dim"), " [/a.cc:1]")
    assert line.plain == "plan[a].json: 2 layers of [dim]gpt[/] [/a.cc:1]"
    assert [(line.plain[s.start:s.end], s.style) for s in line.spans if s.style in ("bold", "dim")] == [
        ("plan[a].json", "bold"), ("[dim]gpt[/]", "dim")]


def test_a_note_from_the_run_is_printed_as_it_is() -> None:
    from pipefold.cli.train_cmds import _print_prediction

    plan = {"schedule": "1f1b[x]", "note": GLOO,
            "predicted": {"step_time_s": 1.0, "bubble_ratio": 0.1, "peak_bytes": [10]},
            "measured": {"step_time_s": 1.1, "step_time_spread_s": [1.0, 2.0], "bubble_ratio": 0.2,
                         "peak_bytes": [12]}}
    out = io.StringIO()
    _print_prediction(plan, make_console(file=out, width=200, soft_wrap=True))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("1f1b[x]: predicted from the profile vs measured")  # the table's title
    assert lines[-1] == f"note: {GLOO}"

"""Issue 15's hostile inputs, each through the real command line: one line and exit 2 (or the right answer),
never a traceback, a hang or a silently wrong result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import no_work
from pipefold import build, simulate
from pipefold.cli.main import _interrupts, main
from pipefold.errors import ConfigError, Interrupted
from pipefold.ir import MAX_DEVICES, MAX_STAGE_MICROBATCHES, check_size, load, save
from pipefold.sim.simulate import CostModel, peak_by_order

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = ["--model", "mlp", "--schedule", "1f1b", "--devices", "2", "-m", "2", "--batch", "4", "--hidden", "8",
        "--layers", "2", "--partition", "even"]


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2) -> str:
    """Run the CLI; expect exit ``code`` and a single stderr line ``pipefold <command>: error: ...``."""
    with no_work(simulating=argv[0] != "train"):  # refused up front, before the work
        try:
            got = main(argv)
        except SystemExit as exc:  # argparse's own refusals
            got = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert got == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pipefold {argv[0]}: error: "), err
    return lines[0]


def test_binary_schedule_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "zb.txt"
    path.write_bytes(bytes(range(256)) * 4)
    for command in ("simulate", "validate", "compare"):
        line = one_line_error(capsys, [command, str(path)])
        assert "is not a schedule file: byte 0x80 at offset 128 is not UTF-8 text" in line
    assert "not UTF-8" in one_line_error(capsys, ["simulate", str(path), "--format", "torch-csv"])


def test_options_that_are_not_an_object(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = build("1f1b", 2, 2).to_json()
    data["options"] = "notadict"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    for command in ("simulate", "validate", "compare"):  # a malformed schedule: exit 1, as validate reports one
        line = one_line_error(capsys, [command, str(path)], code=1)
        assert "'options' must be an object, got 'notadict'" in line


@pytest.mark.filterwarnings("error")  # a numpy warning would be a second line on the user's screen
def test_costs_that_overflow(capsys: pytest.CaptureFixture[str]) -> None:
    # The command line refuses costs no run has before any work; the library's cost model, which takes any finite
    # number, says where a sum overflows.
    for argv in (["--f", "1e308", "--b", "1e308"], ["--latency", "1e308"], ["--f", "1e301"]):
        assert "is out of range: give a number >= 0 and <= 1e+09" in one_line_error(capsys, ["simulate", *argv])
    for cost in (CostModel(f=1e308, b=1e308), CostModel(f=1e308, b=1e308, w=1e308), CostModel(latency=1e308)):
        with pytest.raises(ConfigError, match="the costs overflow"):
            simulate(build("zb-h1", 4, 8), cost)


@pytest.mark.filterwarnings("error")
def test_memory_that_overflows(capsys: pytest.CaptureFixture[str]) -> None:
    for name, cost in (("gpipe", CostModel(memory=1e308)), ("zb-v", CostModel(memory=1e308, memory_w=1e308)),
                       ("1f1b", CostModel(weights=1e308, memory=1e308))):
        with pytest.raises(ConfigError, match="the memory costs overflow"):
            simulate(build(name, 4, 8), cost)
    assert "--mem: 1e308 is out of range" in one_line_error(capsys, ["simulate", "--mem", "1e308"])


def test_offload_budget_beyond_a_float(capsys: pytest.CaptureFixture[str]) -> None:
    assert "more than any machine has" in one_line_error(capsys, ["offload", "--budget", "1e999"])


def test_train_too_wide_is_refused_before_allocating(capsys: pytest.CaptureFixture[str]) -> None:
    # 4 blocks of width 100,000: 4.8e11 parameters, 1.9 TB as float32 before gradients and AdamW.
    line = one_line_error(capsys, ["train", "--model", "gpt", "--layers", "4", "--hidden", "100000"])
    assert "would need at least" in line and "480,063,000,000 parameters" in line and "use --hidden" in line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "--seq", "100000"], "use --seq"),
        (["train", "--devices", "100000", "--layers", "8"], "100000 is out of range: give a whole number >= 1 and <= "
                                                            "512"),
        (["train", "--stages", "100000", "--layers", "8"], "--stages was renamed --devices"),
        (["simulate", "-m", "10000000"], f"whole number >= 1 and <= {MAX_STAGE_MICROBATCHES:,}"),
        (["simulate", "interleaved-1f1b", "--v", "100000"], "use at most 250,000 stages"),
        (["simulate", "interleaved-1f1b", "--v", "1000000"], "1000000 is out of range"),
        (["simulate", "-p", "100000", "-m", "1"], "whole number >= 1 and <= 512"),
        (["partition", "--hidden", "100000"], "use --hidden"),
    ],
)
def test_sizes_that_would_hang_or_exhaust_memory(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 expected: str) -> None:
    assert expected in one_line_error(capsys, argv)


def test_the_limit_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    m = MAX_STAGE_MICROBATCHES // 4
    check_size(4, m, "at the limit")  # allowed (generating and simulating it takes seconds: docs/simulator.md)
    check_size(1, 1, "small", devices=MAX_DEVICES)
    line = one_line_error(capsys, ["simulate", "1f1b", "-p", "4", "-m", str(m + 1)])
    assert f"use at most {m:,} microbatches with 4 stages" in line


def test_csv_cell_with_a_huge_index(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "big.csv"
    path.write_text(build("1f1b", 2, 2).to_csv().replace("0F0,", "0F99999999999,", 1))
    line = one_line_error(capsys, ["simulate", str(path)])
    assert "largest microbatch 99,999,999,999" in line and "over pipefold's limit" in line
    path.write_text("0F0,99999999999F0\n")  # torch's CSV: a stage index as large
    line = one_line_error(capsys, ["simulate", str(path), "--format", "torch-csv"])
    assert "largest stage index 99,999,999,999" in line and "use at most 250,000 stages" in line


def test_generate_with_an_upper_case_suffix_reads_back(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for name, head in (("out.JSON", "{"), ("out.Csv", "0F0")):
        path = tmp_path / name
        assert main(["generate", "zb-h1", "-p", "3", "-m", "6", "-o", str(path)]) == 0
        assert path.read_text().startswith(head)
        assert load(str(path)).actions == build("zb-h1", 3, 6).actions
        capsys.readouterr()
        assert main(["simulate", str(path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["makespan"] == simulate(build("zb-h1", 3, 6)).makespan


def test_a_file_named_like_a_schedule_does_not_take_its_place(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    save(build("gpipe", 2, 2), "1f1b")  # text, in the current folder
    assert main(["compare", "1f1b", "-p", "3", "-m", "6", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert (result["schedule"], result["devices"], result["microbatches"]) == ("1f1b", 3, 6)
    assert main(["compare", "./1f1b", "--json"]) == 0  # the file, named as a path
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert (result["schedule"], result["devices"], result["microbatches"]) == ("gpipe", 2, 2)


def test_zero_times_keep_the_peak_memory(capsys: pytest.CaptureFixture[str]) -> None:
    result = simulate(build("1f1b", 4, 8), CostModel(f=0, b=0, w=0))
    assert list(result.peak_memory) == [4, 3, 2, 1] and result.makespan == 0  # 1F1B's p - i, whatever the times
    # The command line's step must take some time.
    line = one_line_error(capsys, ["simulate", "1f1b", "--f", "0", "--b", "0", "--w", "0"])
    assert "--f, --b and --w are all 0" in line


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "dualpipev",
                                  "chimera", "dualpipe", "v-min", "looped-bfs"])
def test_peak_does_not_depend_on_the_times(name: str) -> None:
    schedule = build(name, 4, 8)
    for cost in (CostModel(f=0, b=0, w=0), CostModel(f=0, b=0, w=0, memory_w=2.5), CostModel(w=0, memory_w=0.5)):
        costs = {s: cost.stage_cost(s, schedule.stages, schedule.devices, replicas=len(schedule.holders(s)))
                 for s in range(schedule.stages)}
        by_order = [peak_by_order(schedule.actions[d], costs) for d in range(schedule.devices)]
        assert simulate(schedule, cost).peak_memory == pytest.approx(by_order)
    unit = simulate(schedule).peak_memory
    assert simulate(schedule, CostModel(f=0, b=0, w=0)).peak_memory == pytest.approx(unit)


def test_an_option_given_twice_must_agree(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(capsys, ["simulate", "kfkb:k=2", "--k", "3"])
    assert "kfkb:k=2 sets k=2 but --k 3 says otherwise" in line
    assert "k=2" in one_line_error(capsys, ["compare", "kfkb:k=2", "zb-h1", "--k", "3"])
    assert main(["simulate", "kfkb:k=2", "--k", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["options"] == {"k": 2}


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--trace", "{tmp}/missing/run.json", "folder {tmp}/missing does not exist"),
        ("--plot", "{tmp}", "is a directory"),
        ("--trace", "/proc/run.json", "cannot write the trace file /proc/run.json"),
        ("--plot", "{tmp}/run.PDF", "ending in .png or .svg"),
    ],
)
def test_train_outputs_are_checked_before_training(capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str,
                                                   value: str, expected: str) -> None:
    # A million steps would run for hours: the answer within one_line_error's 30 s says nothing was trained.
    line = one_line_error(capsys, ["train", *TINY, "--steps", "1000000", flag, value.format(tmp=tmp_path)])
    assert expected.format(tmp=tmp_path) in line


@pytest.mark.parametrize("argv", [["simulate", "--trace", "{tmp}/no/t.json"], ["simulate", "--plot", "{tmp}/t.txt"],
                                  ["generate", "1f1b", "-o", "{tmp}"], ["plan", "--memory", "4", "--plot", "{tmp}"],
                                  ["pipefisher", "--plot", "{tmp}/no/p.png"], ["profile", "-o", "{tmp}/no/p.json"]])
def test_every_command_checks_its_outputs(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]) -> None:
    one_line_error(capsys, [a.format(tmp=tmp_path) for a in argv])
    assert list(tmp_path.iterdir()) == []


def test_redirected_train_prints_a_line_per_step(tmp_path: Path) -> None:
    steps = 20
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipefold", "train", *TINY, "--steps", str(steps), "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None and proc.stdout is not None
    first = proc.stderr.readline()
    still_running = proc.poll() is None  # the line came as the step ended, not with the summary at the end
    rest = proc.stderr.read()  # to the end (the JSON on stdout is far smaller than a pipe's buffer)
    out = proc.stdout.read()
    assert proc.wait(timeout=240) == 0, first + rest
    lines = [first, *rest.splitlines()]
    assert still_running and first.startswith(f"step 1/{steps} loss ")
    losses = json.loads(out)["loss"]  # the run's own summary is the reference
    assert len(lines) == steps and "\r" not in first + rest and "━" not in first + rest
    for i, line in enumerate(lines):
        words = line.split()
        assert words[:2] == ["step", f"{i + 1}/{steps}"] and words[2] == "loss"
        assert words[-1] == "samples/s)", line  # the MLP's rows are samples, not tokens
        assert float(words[3]) == pytest.approx(losses[i], abs=6e-5)


@pytest.mark.parametrize(("train", "expected"), [("notadict", "'train' must be an object, got 'notadict'"),
                                                 ({"model": "mlp"}, "KeyError: 'batch'")])
def test_a_plan_whose_train_is_not_an_object(capsys: pytest.CaptureFixture[str], tmp_path: Path, train: object,
                                             expected: str) -> None:
    from pipefold.plan.budget import plan_model
    from pipefold.plan.profile import LayerProfile, Profile

    layer = LayerProfile(f=1e-3, b=1e-3, w=1e-3, held=1000, held_w=800, params=100, out=100)
    profile = Profile(train={"model": "mlp", "layers": 6, "hidden": 16, "heads": 4, "seq": 8, "batch": 8,
                             "microbatches": 4, "optimizer": "sgd", "seed": 0}, layers=(layer,) * 6, latency=1e-5,
                      bandwidth=1e9, contention=(1.0, 1.0), optimizer_factor=0.0)
    plan = {**plan_model(profile, 2, 1e9).to_dict(), "train": train}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert expected in one_line_error(capsys, ["train", "--plan", str(path), "--steps", "1000000"])


@pytest.mark.parametrize("delay", [None, 0.0])
@pytest.mark.parametrize("raised", [KeyboardInterrupt(), Interrupted(signal.SIGTERM)])
def test_an_interrupt_landing_in_a_callback_is_raised_after_it(capfd, monkeypatch: pytest.MonkeyPatch,
                                                               raised: KeyboardInterrupt, delay: float | None) -> None:
    # A Ctrl-C raised inside a weakref's callback (the meter's, when a tensor dies) was printed as "Exception
    # ignored in: <finalize object ...>" and dropped: `pipefold profile` went on. It is raised again after it.
    # With no delay the delivery lands while the hook is still starting its thread, as it did once under CI's
    # load ("Exception ignored in sys.unraisablehook", the interrupt lost): it must be sent again, not lost.
    import weakref

    from pipefold.cli import main as cli_main

    if delay is not None:
        monkeypatch.setattr(cli_main, "REDELIVERY_S", delay)

    class Dying:
        pass

    def callback() -> None:
        raise raised

    with pytest.raises(KeyboardInterrupt) as got, _interrupts():
        dying = Dying()
        weakref.finalize(dying, callback)
        del dying
        for _ in range(1000):
            time.sleep(0.001)
    assert type(got.value) is type(raised) and getattr(got.value, "signum", None) == getattr(raised, "signum", None)
    assert "Exception ignored" not in capfd.readouterr().err


@pytest.mark.parametrize("argv, first, second", [
    (["train", "--devices", "4", "--pp", "2"], "--devices 4", "--pp 2"),
    (["train", *TINY, "--pp", "4"], "--devices 2", "--pp 4"),
    (["simulate", "1f1b", "-p", "4", "--devices", "8"], "-p 4", "--devices 8"),
    (["plan", "--devices", "8", "-p", "2", "--memory", "1x"], "--devices 8", "-p 2"),
])
def test_an_option_given_under_two_names_with_two_values(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                         first: str, second: str) -> None:
    """argparse keeps the last value silently (--devices 8 --pp 2: the pipeline is 2 devices); the command refuses
    both, naming them."""
    line = one_line_error(capsys, argv)
    assert f"{first} and {second} are two names of one option (--devices, " in line and "give one" in line


@pytest.mark.parametrize("argv", [
    ["simulate", "1f1b", "-p", "2", "--devices", "2", "-m", "4", "--json"],  # two names, one value
    ["simulate", "1f1b", "-p", "8", "-m", "4", "-p", "2", "--json"],  # one name again: it overrides
    ["simulate", "1f1b", "--devices", "8", "-m", "4", "--devices", "2", "--json"],
])
def test_an_option_given_again_under_its_name_or_with_its_value_runs(capsys: pytest.CaptureFixture[str],
                                                                     argv: list[str]) -> None:
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["devices"] == 2


def _wrapped_by_set_name() -> None:
    """A Ctrl-C landing while a class is made whose attribute's ``__set_name__`` runs (a dataclass's field, as a
    lazy import of torch's compiler makes them): Python 3.11 reports it as a RuntimeError raised from it."""

    class Landing:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt

    type("Made", (), {"field": Landing()})


def _raised_from() -> None:
    try:
        raise Interrupted(signal.SIGTERM)
    except KeyboardInterrupt as exc:
        raise ImportError("a module half imported") from exc


def _raised_while_handling() -> None:
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise OSError("a cleanup that failed on its way out") from None  # suppressed context: still the signal


@pytest.mark.parametrize(("raising", "code", "line"), [
    (_wrapped_by_set_name, 130, "pipefold simulate: interrupted (SIGINT)"),
    (_raised_from, 143, "pipefold simulate: interrupted (SIGTERM)"),
    (_raised_while_handling, 130, "pipefold simulate: interrupted (SIGINT)"),
])
def test_an_interrupt_another_exception_wraps_is_the_interrupt(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch, raising, code: int,
                                                               line: str) -> None:
    from pipefold.cli import schedule_cmds

    monkeypatch.setattr(schedule_cmds, "cmd_simulate", lambda args, console: raising())
    assert main(["simulate", "1f1b"]) == code
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_an_error_with_no_interrupt_inside_is_not_taken_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipefold.cli import schedule_cmds

    def fails(args: object, console: object) -> None:
        try:
            raise ValueError("the cause")
        except ValueError as exc:
            raise RuntimeError("a bug") from exc

    monkeypatch.setattr(schedule_cmds, "cmd_simulate", fails)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["simulate", "1f1b"])


_ENTRY = """
import signal, sys
import pipefold.cli.main as m
from pipefold.errors import Interrupted
def before_its_handling():  # while main reads the options or makes its console
    raise KeyboardInterrupt
def after_its_handling():  # main said the line, and the signal lands again as it returns
    m._interrupt_told = True
    print("pipefold simulate: interrupted (SIGTERM)", file=sys.stderr)
    raise Interrupted(signal.SIGTERM)
def as_it_returns():  # a command that ended well, the signal landing before its code is kept
    raise Interrupted(signal.SIGTERM)
m.main = {which}
sys.argv = ["pipefold", "simulate", "--devices", "2"]
m.entry()
"""


@pytest.mark.parametrize(("which", "code", "line"), [
    ("before_its_handling", 130, "pipefold simulate: interrupted (SIGINT)"),
    ("after_its_handling", 130, "pipefold simulate: interrupted (SIGTERM)"),
    ("as_it_returns", 143, "pipefold simulate: interrupted (SIGTERM)"),
])
def test_an_interrupt_outside_the_commands_handling_is_said_once(which: str, code: int, line: str) -> None:
    """The class of an interrupt that escapes main: each lands where main's own handler is not, and the command
    still ends in one line (never silently, never twice)."""
    done = subprocess.run([sys.executable, "-c", _ENTRY.format(which=which)], capture_output=True, text=True,
                          timeout=60)
    assert done.stderr.strip().splitlines() == [line], done.stderr
    assert done.returncode == code


_SIGNALLED = """
import os, signal, sys
import pipefold.runtime.launch.tempfolder as tempfolder
import pipefold.cli.main as m
from pipefold.cli import schedule_cmds

def signalled(module, name):
    real = getattr(module, name)
    def with_a_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.{signal})  # a real signal, delivered as this start-up step runs
        return real(*args, **kwargs)
    setattr(module, name, with_a_signal)

signalled(*{{"temporary folder": (tempfolder, "make"), "options": (m, "build_parser"),
             "console": (m, "make_console"), "command": (schedule_cmds, "cmd_simulate"),
             "exit": (m, "join_threads")}}["{where}"])
sys.argv = ["pipefold", "simulate", "1f1b", "--devices", "2", "-m", "2"]
from pipefold._entry import main
main()
"""


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("where", ["temporary folder", "options", "console", "command", "exit"])
def test_a_signal_at_any_step_of_the_start_up_is_one_line(where: str, signal_name: str, tmp_path: Path) -> None:
    """The class of a signal that lands between two handlers: while the start-up holds signals (the temporary
    folder is made then), as they are given back, as main reads the options and makes its console, in the command,
    and as the command exits. Each ends the command in one line and the shell's code, and leaves no temporary
    folder; one that lands as the command exits, after its work, changes nothing."""
    import signal

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _SIGNALLED.format(where=where, signal=signal_name)],
                          capture_output=True, text=True, timeout=60, env=env)
    if where == "exit":
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert "1f1b" in done.stdout
    else:
        assert done.stderr.strip().splitlines() == [f"pipefold simulate: interrupted ({signal_name})"], done.stderr
        assert done.returncode == 128 + getattr(signal, signal_name)
    assert list(tmp_path.iterdir()) == []

"""Outputs never destroy what they point at: every writer (schedules, plots, traces, profiles, plans, saved
models) replaces only regular files; a device or a read FIFO is written into, anything else refused in one line."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.files import check_writable, write_text

WRITERS = [
    ["generate", "1f1b", "-p", "2", "-m", "4", "-o", "{out}"],
    ["simulate", "1f1b", "-p", "2", "-m", "4", "--trace", "{out}"],
    ["generate", "zb-v", "-p", "2", "-m", "4", "--format", "torch-csv", "-o", "{out}"],
]


def _char_device(path: str) -> bool:
    return os.path.exists(path) and stat.S_ISCHR(os.stat(path).st_mode)


@pytest.mark.skipif(not _char_device("/dev/null"), reason="no /dev/null")
@pytest.mark.parametrize("argv", WRITERS, ids=lambda a: a[-3])
def test_dev_null_is_written_into_not_replaced(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    before = os.stat("/dev/null")
    assert main([a.format(out="/dev/null") for a in argv]) == 0, capsys.readouterr().err
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


@pytest.mark.skipif(not _char_device("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("argv", WRITERS, ids=lambda a: a[-3])
def test_a_full_device_is_one_line_and_stays(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    before = os.stat("/dev/full")
    assert main([a.format(out="/dev/full") for a in argv]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert (os.stat("/dev/full").st_ino, os.stat("/dev/full").st_rdev) == (before.st_ino, before.st_rdev)


def test_a_fifo_nobody_reads_is_refused_at_once_and_one_read_is_written(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="no process reads it"):
        check_writable(fifo, "schedule")  # before any work: never a hang
    got: list[bytes] = []
    opened = threading.Event()

    def read() -> None:
        with open(fifo, "rb") as fh:
            opened.set()
            got.append(fh.read())

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(200):  # the reader's open returns only once a writer opens too: wait until it is waiting
        try:
            write_text(fifo, "through the pipe\n")
            break
        except ConfigError:
            threading.Event().wait(0.01)
    reader.join(5)
    assert got == [b"through the pipe\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_fifo_checked_first_keeps_its_one_shot_reader(tmp_path: Path) -> None:
    """Checking a FIFO before the work must not end its reader's stream: the reader reads to its end once and
    gets the whole file, written after the check."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as fh:
            got.append(fh.read())

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(500):  # until the reader's open is waiting for a writer
        try:
            check_writable(fifo, "schedule")
            break
        except ConfigError:
            threading.Event().wait(0.01)
    threading.Event().wait(0.3)  # the work between the check and the write: the reader is reading meanwhile
    write_text(fifo, "after the check\n")
    reader.join(5)
    assert got == [b"after the check\n"]


def test_a_socket_or_a_folder_is_refused(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(ConfigError, match="is a socket, which pipefold does not write into"):
            check_writable(path, "plan")
        with pytest.raises(ConfigError, match="is a socket"):
            write_text(path, "x")
    with pytest.raises(ConfigError, match="is a directory"):
        check_writable(tmp_path, "plan")


def test_stdout_through_a_pipe() -> None:
    got = subprocess.run([sys.executable, "-m", "pipefold", "generate", "1f1b", "-p", "2", "-m", "4", "-o",
                          "/dev/stdout"], capture_output=True, text=True, timeout=60, check=False)
    assert got.returncode == 0 and "# pipefold schedule" in got.stdout, got.stderr


@pytest.mark.parametrize("argv", [
    ["simulate", "1f1b", "-p", "2", "-m", "4", "--plot", "{tmp}/a.png", "--trace", "{tmp}/b.json"],
    ["pipefisher", "-p", "2", "-m", "4", "--plot", "{tmp}/a.png"],
    ["plan", "--memory", "4", "--plot", "{tmp}/a.png"],
    ["plan", "--cluster", "h100-sxm", "--nodes", "1", "--hf-config", "llama-tiny", "--global-batch", "8", "--seq", "16",
     "--families", "1f1b", "--plot", "{tmp}/a.png", "-o", "{tmp}/b.json"],
    ["generate", "1f1b", "-o", "{tmp}/a.txt"],
    ["train", "--model", "mlp", "--schedule", "1f1b", "--devices", "2", "-m", "2", "--batch", "4", "--hidden", "8",
     "--layers", "2", "--steps", "1", "--trace", "{tmp}/a.json", "--plot", "{tmp}/b.png", "--save-model",
     "{tmp}/c.pt"],
], ids=lambda a: a[0] + ("-cluster" if "--cluster" in a else ""))
def test_every_file_a_command_writes_is_named_in_its_output(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           argv: list[str]) -> None:
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    written = sorted(tmp_path.iterdir())
    assert written == sorted(Path(a) for a in argv if a.startswith(str(tmp_path))), written
    for path in written:
        assert path.stat().st_size > 0 and str(path) in out, (path, out)


def test_a_table_into_a_pipe_is_never_cut(tmp_path: Path) -> None:
    # Where no terminal sets the width, a table is printed at its natural width: every header and value on one line.
    names = ["1f1b", "zb-h1", "zb-v", "v-half", "dualpipev", "interleaved-1f1b"]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(Path(__file__).parents[1] / "src")
    got = subprocess.run([sys.executable, "-m", "pipefold", "compare", *names], capture_output=True, text=True,
                         env=env, check=True).stdout
    rows = [line for line in got.splitlines() if line.startswith("│")]
    assert len(rows) == len(names), got  # no row wrapped onto a second line
    assert all(f"│ {name}" in got for name in names)
    header = next(line for line in got.splitlines() if line.startswith("┃"))
    assert "max peak (M)" in header and "peak per device (M)" in header, got
    # A reader that leaves early: no error, no traceback, the shell's code for a closed pipe.
    proc = subprocess.Popen([sys.executable, "-m", "pipefold", "compare", *names, "-p", "64", "-m", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()
    assert proc.wait(timeout=120) in (0, 141) and proc.stderr.read() == b""

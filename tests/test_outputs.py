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

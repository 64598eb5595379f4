"""Lines on stderr arrive whole: a job's ranks and its launcher share the stream.

``print`` writes a line's text and its newline apart; where stderr is unbuffered (``PYTHONUNBUFFERED``, as on
this project's machines) those are two writes, and a rank's warning once landed between a progress line and its
newline. Every line pipefold writes to stderr goes through :func:`pipefold.errors.say`, one write a line.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest

from pipefold.errors import say
from pipefold.runtime.launch.checkpoint import note, warn


class _Recorded(io.RawIOBase):
    """A raw stream that keeps each write it gets, as the file descriptor would get them."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        data = bytes(b)  # type: ignore[call-overload]
        self.writes.append(data)
        return len(data)


def _writes(monkeypatch: pytest.MonkeyPatch, what: Callable[[], None]) -> list[bytes]:
    """The writes ``what`` makes on sys.stderr as Python makes it under PYTHONUNBUFFERED: text written through to
    the raw stream. (Set inside the test: pytest's own capture replaces sys.stderr after fixtures.)"""
    raw = _Recorded()
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8",  # type: ignore[type-var]
                                                      line_buffering=True, write_through=True))
        what()
    return raw.writes


def test_print_writes_a_line_in_two_parts_where_say_writes_it_in_one(monkeypatch: pytest.MonkeyPatch) -> None:
    printed = _writes(monkeypatch, lambda: print("step 1/5 loss 1.0", file=sys.stderr, flush=True))
    assert printed == [b"step 1/5 loss 1.0", b"\n"]  # the gap another process's line can fall into
    assert _writes(monkeypatch, lambda: say("step 1/5 loss 1.0")) == [b"step 1/5 loss 1.0\n"]


@pytest.mark.parametrize(("write", "line"), [(warn, "pipefold: warning: step 3 skipped"),
                                             (note, "pipefold: step 3 skipped")])
def test_the_ranks_warnings_and_notes_are_one_write_each(monkeypatch: pytest.MonkeyPatch,
                                                          write: Callable[[str], None], line: str) -> None:
    assert _writes(monkeypatch, lambda: write("step 3 skipped")) == [line.encode() + b"\n"]


SCRIPT = """
import os, sys
from pipefold.errors import say
children = []
for who in range(3):
    pid = os.fork()
    if pid == 0:
        for i in range(400):
            say(f"process {who} line {i} " + "x" * 60)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_three_processes_writing_at_once_leave_every_line_whole() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    err = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60,
                         check=True).stderr
    lines = err.splitlines()
    assert len(lines) == 1200
    assert all(re.fullmatch(r"process [012] line \d+ x{60}", line) for line in lines)
    for who in range(3):
        assert [int(line.split()[3]) for line in lines if line.startswith(f"process {who} ")] == list(range(400))

"""What a worker that torchrun started says when an error ends it.

torchrun runs the same command in each of its workers. An error that every worker meets alike (an option, a data
file, a world that does not fit the schedule, a loss that diverged) would be said once per worker, and a rank's
failure reaches the other ranks as failures of their own (a link lost, a peer gone). pipefold says each error
once:

- one that every worker meets, from the first worker of each machine (``LOCAL_RANK`` 0: :func:`tell`); the
  others wait until it has (a few seconds at most), so that torchrun's agent, seeing one of them end, does not
  stop the first before it speaks;
- a rank's failure, from the rank to blame, or from the first rank it took down where the rank to blame died
  without a word; an interrupt while the ranks run (Ctrl-C, or torchrun's agent stopping the others once one has
  ended), from the first rank, where no rank has said anything. The job's store settles which
  (:func:`pipefold.runtime.launch.torchrun.run_torchrun`), and the rank tells it at once (:func:`settle`), before
  its links close and before torchrun's agent, seeing another worker end, stops it.

Every worker also writes its line to its error file, where torchrun asks for one (``TORCHELASTIC_ERROR_FILE``):
the summary torchrun prints after a failed job shows it as the worker's ``traceback``, and as the root cause,
instead of a link to torch's documentation. The rest of that output (torchrun's log lines, the traceback of its
``ChildFailedError``, the summary's frame) is printed by torchrun's agent, which pipefold does not run: see
"Under torchrun" in docs/failures.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Iterator

from pipefold.errors import say
from pipefold.runtime.launch.processes import under_torchrun

__all__ = ["running", "settle", "tell", "told_once", "write_error_file"]

_command = "pipefold"
"""``pipefold`` and the command this process runs: what each line begins with (:func:`running`)."""
_settled = False
"""This worker has told its error (:func:`settle`): it tells no other."""


def running(command: str) -> None:
    """Name the command this process runs (``train``), for the lines told before it returns (:func:`settle`)."""
    global _command
    _command = f"pipefold {command}"


def tell(line: str) -> bool:
    """Say ``line``, the one line of the error that ends this command; under torchrun, only from the first worker
    of each machine (the others meet the same error), into the worker's error file too, and nothing where the
    worker has told its error already (:func:`settle`: an interrupt as it leaves, say). Whether it was said."""
    if not under_torchrun():
        say(line)
        return True
    if _settled:
        return False
    speaks = os.environ.get("LOCAL_RANK", "0") == "0"
    if speaks:
        say(line)
    write_error_file(line, later=not speaks)
    if not speaks:
        _wait_for_first_worker()
    return speaks


FIRST_WORKER_WAIT_S = 10.0
"""How long a worker that stays quiet about an error every worker meets waits for the first worker to say it."""


def _wait_for_first_worker() -> None:
    """Wait until the first worker of this machine has told its error (its error file is there), at most
    :data:`FIRST_WORKER_WAIT_S`: a worker that ended first would have torchrun's agent stop the first one
    (SIGTERM) before it said the line, which would then be no line but an interrupt. torchrun keeps each worker's
    files in a folder named by its local rank, beside this one's."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.abspath(path) == os.path.abspath(os.devnull):
        return
    first = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "0", os.path.basename(path))
    deadline = time.monotonic() + FIRST_WORKER_WAIT_S
    while not os.path.exists(first) and time.monotonic() < deadline:
        time.sleep(0.05)


def settle(text: str, *, speaks: bool, own: bool) -> None:
    """Tell, now, a worker's failure or interrupt as the job's store settled it: its line (``text`` after the
    command's name) into the worker's error file, and said where ``speaks``. ``own``: the failure is the worker's
    own, not one that another's caused. The worker tells nothing more."""
    global _settled
    line = f"{_command}: {text}"
    write_error_file(line, later=not own)
    if speaks:
        say(line)
    _settled = True


@contextlib.contextmanager
def told_once() -> Iterator[None]:
    """Around the parsing of the command line: under torchrun, a usage mistake that argparse prints (one line,
    then ``SystemExit``) is told as the command's other errors are (:func:`tell`), not by every worker."""
    if not under_torchrun():
        yield
        return
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except SystemExit as done:
        text = printed.getvalue().strip()
        if done.code not in (None, 0) and text:
            tell(text.splitlines()[-1])
        elif text:
            say(text)
        raise
    if printed.getvalue():
        say(printed.getvalue().rstrip("\n"))


def write_error_file(line: str, *, later: bool = False) -> None:
    """Write ``line`` to this worker's error file (``TORCHELASTIC_ERROR_FILE``), in the form torchrun's summary
    shows, where torchrun asked for one. Nothing if it cannot be written: the line is then in the output alone.

    torchrun takes for the job's root cause the failure with the earliest time, in whole seconds (a worker without
    an error file, one that died, at the time torchrun saw it gone), the first it saw among equals. ``later`` (a
    failure that came from another worker's, or one that another worker says) dates the line a second late, so
    that the root cause is the worker that failed first: the one that says its own failure, or one that died
    without a word, not a worker it took down."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.abspath(path) == os.path.abspath(os.devnull):
        return
    when = str(int(time.time()) + int(later))
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": when}}}
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as fh:
        json.dump(record, fh)

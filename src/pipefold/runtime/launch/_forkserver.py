"""Imported by the ranks' fork server alone, as the last of its preloaded modules (see
:func:`pipefold.runtime.launch.processes.process_context`); nothing else imports it.

When the process that started the server ends, the server ends too, and Python would then tear down the torch it
imported: most of a second in which the server still holds that process's standard output and error open, so that
whoever reads them (a shell's pipe, a test) waits. The server runs no one's exit handlers but this one (it is the
last module it imports), so it leaves at once.

It also cleans up after that process where it cannot (``kill -9``): a thread watches it, and once it is gone the
server gives the processes it forked a moment to end by themselves (a rank ends as soon as it finds its launcher
gone), kills those that linger, removes the command's temporary folder
(:mod:`pipefold.runtime.launch.tempfolder`) and leaves. The server's own exit, which comes once that process and
every process the server forked have closed their end of its pipe, does the same where that process is gone.
"""

import atexit
import contextlib
import os
import signal
import sys
import threading
import time

from pipefold._gc import freeze
from pipefold.runtime.launch import tempfolder
from pipefold.runtime.launch.processes import SERVER_PARENT

GRACE = 1.0
"""Seconds the processes the server forked get to end by themselves once the process that started it is gone."""

_PARENT = int(os.environ.get(SERVER_PARENT) or os.getppid())  # the variable: it may have gone during the imports
_FOLDER = tempfolder.owned_by(_PARENT)
_ending = threading.Lock()


def _children() -> list[int]:
    """The processes this one forked that still run (a zombie has ended); none found where there is no /proc."""
    me, found = os.getpid(), []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()  # after the name, which may hold anything
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != b"Z":
                found.append(int(entry))
    return found


def _end_children() -> None:
    deadline = time.monotonic() + GRACE
    while _children() and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while _children() and time.monotonic() < deadline:
        time.sleep(0.05)


def _gone(within: float) -> bool:
    """Whether the process that started the server is gone, or goes within ``within`` seconds. The server's own
    exit comes as that process closes its files, which its death does a moment before the server is given
    another parent."""
    deadline = time.monotonic() + within
    while os.getppid() == _PARENT:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _leave() -> None:
    with _ending:  # the watch and the exit handler: one cleans up, the other waits for it and exits with it
        if _gone(within=0.5):  # killed (kill -9), or done (it has removed its folder itself)
            _end_children()
            if _FOLDER is not None:
                tempfolder.remove(_FOLDER)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _watch() -> None:
    while os.getppid() == _PARENT:
        time.sleep(0.1)
    _leave()


atexit.register(_leave)
threading.Thread(target=_watch, name="pipefold-janitor", daemon=True).start()
# What the server imported (torch, its compiler, the runtime: over a million objects) lives as long as any rank:
# frozen, the cyclic collector of the server and of every rank forked from it leaves it alone. A rank's full
# collection (one as it leaves its process group) then walks what the rank made, not torch's modules again, which
# took most of a short run's time.
freeze()

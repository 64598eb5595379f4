"""The ``pipefold`` command's first module: its start-up (the imports, torch's included where the command uses it,
and the command's temporary folder) runs with SIGINT and SIGTERM held, so that a Ctrl-C then ends it in one line and
the shell's code, where it would otherwise be raised inside an import: a Python traceback, or, inside torch's own
import, an abort from C++. The signals stay held until the command's handling of them has begun: a signal that
arrives in between is held too, not lost, and said by it."""

from __future__ import annotations

import signal
import sys
from typing import Any, NoReturn

TORCH_COMMANDS = frozenset({"train", "profile", "partition"})
"""The commands that load torch: imported during start-up, while a signal is held."""


def main() -> NoReturn:
    held: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        held.append(signum)

    wanted = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, hold) for s in wanted if signal.getsignal(s) is not signal.SIG_IGN}

    def release() -> None:
        """The signals back to their handlers, SIGTERM's system default replaced by an exception as SIGINT's is
        (the command says it in one line and cleans up, where the system would end it silently), and the first one
        held raised now, as one that arrives now would be. Called by :func:`~pipefold.cli.main.entry` inside the
        ``try`` that says it in one line."""
        for s, handler in before.items():
            signal.signal(s, interrupt if handler is signal.SIG_DFL else handler)
        if held:
            interrupt(held[0], None)

    try:
        from pipefold.cli.main import entry

        if TORCH_COMMANDS & set(sys.argv[1:2]):
            import torch  # noqa: F401
        from pipefold.runtime.launch import tempfolder

        tempfolder.make_if_possible()  # it imports multiprocessing; removed as the process exits however it ends
    except BaseException:
        release()
        raise
    entry(release)


def interrupt(signum: int, frame: Any) -> None:
    """A signal's handler: the signal raised as :class:`~pipefold.errors.Interrupted`, a KeyboardInterrupt."""
    from pipefold.errors import Interrupted

    raise Interrupted(signum)

"""The ``pipefold`` command's first module: its start-up (the imports, torch's included where the command uses it)
runs with SIGINT and SIGTERM held, so that a Ctrl-C then ends it in one line and the shell's code, where it would
otherwise be raised inside an import: a Python traceback, or, inside torch's own import, an abort from C++."""

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
    try:
        from pipefold.cli.main import entry

        if TORCH_COMMANDS & set(sys.argv[1:2]):
            import torch  # noqa: F401
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    if held:
        from pipefold.errors import Interrupted
        from pipefold.runtime.launch.elastic import tell

        what = Interrupted(held[0])
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
        tell(f"pipefold {command}: {what}" if command else f"pipefold: {what}")  # under torchrun, by one worker
        sys.stdout.flush()
        raise SystemExit(what.exit_code)
    entry()

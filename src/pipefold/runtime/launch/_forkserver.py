"""Imported by the ranks' fork server alone, as the last of its preloaded modules (see
:func:`pipefold.runtime.launch.processes.process_context`); nothing else imports it.

When the process that started the server ends, the server ends too, and Python would then tear down the torch it
imported: most of a second in which the server still holds that process's standard output and error open, so that
whoever reads them (a shell's pipe, a test) waits. The server has nothing to clean up (its children exit on their
own, and it runs no one's exit handlers but this one: it is the last module it imports), so it leaves at once.
"""

import atexit
import os
import sys


def _leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


atexit.register(_leave)

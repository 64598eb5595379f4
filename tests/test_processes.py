"""Starting local processes: signals held while they start, whatever unblocks them meanwhile."""

from __future__ import annotations

import os
import signal

import pytest

from pipefold.runtime.launch.processes import starting


@pytest.mark.parametrize("unblock", [False, True])
def test_a_sigint_inside_the_start_is_raised_after_it(unblock: bool) -> None:
    reached_end = False
    with pytest.raises(KeyboardInterrupt), starting():
        os.kill(os.getpid(), signal.SIGINT)
        if unblock:  # as multiprocessing's resource tracker does when it starts
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        for _ in range(1000):  # bytecode boundaries, where Python runs a handler
            pass
        reached_end = True
    assert reached_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigterm_goes_to_the_handler_that_was_there_once() -> None:
    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with starting():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            os.kill(os.getpid(), signal.SIGTERM)
            assert got == []
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_no_signal_no_change() -> None:
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with starting():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == mask


def test_a_child_started_inside_inherits_a_blocked_sigint_but_not_sigterm() -> None:
    """Ctrl-C in a terminal must not end a half-started child; SIGTERM is how the parent stops it."""
    import subprocess
    import sys

    with starting():
        out = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"],
                             capture_output=True, text=True, check=True).stdout
    blocked = int(next(line.split()[1] for line in out.splitlines() if line.startswith("SigBlk:")), 16)
    assert blocked & (1 << (signal.SIGINT - 1))
    assert not blocked & (1 << (signal.SIGTERM - 1))

"""The ``pipefold`` command: parse the arguments (:mod:`.args`), check which options apply, run the command
(:mod:`.schedule_cmds`, :mod:`.plan_cmds`, :mod:`.train_cmds`, :mod:`.bagpipe_cmds`), and turn a user's mistake or
an interrupt into one line and an exit code."""

from __future__ import annotations

import _thread
import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from rich.console import Console

from pipefold.cli import bagpipe_cmds, plan_cmds, schedule_cmds, train_cmds
from pipefold.cli.args import build_parser, check_applies, given
from pipefold.cli.common import make_console
from pipefold.errors import Interrupted, PipefoldError, ScheduleError, say
from pipefold.runtime.launch.elastic import running, tell, told_once

REDELIVERY_S = 0.005
"""How long after a callback swallowed an interrupt it is delivered again (:func:`_deliver_later`)."""


def _deliver_later(exc: KeyboardInterrupt) -> None:
    """Deliver ``exc``'s signal to the main thread again, from another thread, :data:`REDELIVERY_S` from now:
    delivered at once, it would be raised inside the hook that calls this. On a busy machine the delivery can
    still land before the hook has returned (inside starting the thread, the main thread descheduled for longer
    than the delay): it is caught here and sent once more, each time twice as late (from at least 1 ms), so it
    is never lost and the hook soon returns."""
    delay = REDELIVERY_S
    while True:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        try:
            timer = threading.Timer(delay, _thread.interrupt_main, args=(signum,))
            timer.daemon = True
            timer.start()
            return
        except KeyboardInterrupt as again:
            exc, delay = again, max(2 * delay, 0.001)


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """SIGTERM ends a command as SIGINT does (an exception, so that what it started is cleaned up), where this is
    the main thread; and neither is lost where Python cannot raise it.

    A signal's exception is raised wherever the main thread is, and in a callback Python calls for itself (a
    weakref's, as the memory meter's are when a tensor dies; a finalizer) it would be printed as "Exception
    ignored" and dropped, the command going on. There it is delivered again a moment later, to be raised once
    the callback has returned."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    def unraisable(info: Any) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt):
            _deliver_later(info.exc_value)
        else:
            hook(info)

    before, hook = signal.signal(signal.SIGTERM, handler), sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        sys.unraisablehook = hook


def interrupt_within(exc: BaseException) -> KeyboardInterrupt | None:
    """The interrupt (SIGINT or SIGTERM) that ``exc`` was raised while handling or from, where there is one: a signal
    that lands inside code that turns what it meets into another exception (an import making a dataclass, whose
    field's ``__set_name__`` fails with the interrupt as a RuntimeError; a library's callback) is still the
    signal, and ends the command as one does."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, KeyboardInterrupt):
            return at
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return None


FAMILIES = (schedule_cmds, plan_cmds, train_cmds, bagpipe_cmds)
"""The modules of commands, one per family: command ``name`` runs the function ``cmd_<name>`` of one of them."""


def command(name: str) -> Callable[[argparse.Namespace, Console], None]:
    """The function that runs the command ``name`` (its parser entry is in :mod:`.args`)."""
    found = [f for module in FAMILIES if (f := getattr(module, f"cmd_{name.replace('-', '_')}", None)) is not None]
    assert len(found) == 1, f"command {name!r} needs one cmd_{name} in the command modules, found {len(found)}"
    return found[0]


def join_threads() -> None:
    """Wait for every thread a command left running that is not a daemon, as Python's own exit does."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def entry(release: Callable[[], None] | None = None) -> NoReturn:
    """The ``pipefold`` command: :func:`main`, then out at once. Threads still running are waited for, output is
    flushed and exit handlers run (what multiprocessing and the library registered), as Python's own exit does;
    its teardown of the modules, most of a second with torch loaded, is skipped: nothing is left to clean up.

    Once the command is done, SIGINT and SIGTERM are held off: a Ctrl-C as it exits changes nothing, and must not
    break into an exit handler with a traceback.

    ``release`` gives the signals back to their handlers, raising one that arrived while they were held: the start-up
    before (the imports and the command's temporary folder, :mod:`pipefold._entry`) runs with them held, until this
    ``try``, which says a signal in one line. Without it (a script of its own calling this), the temporary folder is
    made here."""
    code = 130  # a signal that lands as main returns, after its own handling: it was interrupted
    try:
        if release is not None:
            release()
        else:  # called by a script of its own, which made no folder
            from pipefold.runtime.launch import tempfolder

            tempfolder.make_if_possible()
        code = main()
    except KeyboardInterrupt as exc:
        # Outside main's own handling (while it reads the options or makes its console, or as it returns): said
        # here, once, unless main said it already.
        if not _interrupt_told:
            what = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
            name = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
            tell(f"pipefold {name}: {what}" if name else f"pipefold: {what}")
            code = what.exit_code
    finally:
        # Ignored, not only blocked: a signal sent to the process goes to any thread that does not block it, and
        # Python runs its handler in the main thread all the same (a library's thread still alive would let a
        # Ctrl-C through as KeyboardInterrupt in an exit handler).
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    join_threads()
    sys.stdout.flush()
    sys.stderr.flush()
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_interrupt_told = False
"""Whether :func:`main` has said the line of an interrupt (so that :func:`entry` does not say it again)."""


def report(argv: Sequence[str]) -> dict[str, Any]:
    """``pipefold ARGV --json`` run in this process (the ranks it starts are processes of their own): the JSON
    report it prints last. A command that fails (its one line on standard error) ends the caller's program."""
    import io
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--json"])
    if code != 0:
        raise SystemExit(f"pipefold {' '.join(argv)} --json failed (its error is above)")
    return dict(json.loads(out.getvalue().strip().splitlines()[-1]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        with told_once():  # under torchrun, by one worker
            args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a usage mistake argparse has printed in one line
        return done.code if isinstance(done.code, int) else 2
    args.given = given(args, parser)  # before any option is filled in from another
    running(args.command)
    if getattr(args, "hf", None):
        args.model = args.hf  # one name for the model from here on; its config sizes it
    elif getattr(args, "layers", 0) is None:
        args.layers = args.default_layers
    console = make_console(soft_wrap=True)
    try:  # each error that ends the command in one line, which under torchrun one worker says (tell)
        try:
            check_applies(args)
            with _interrupts():
                command(args.command)(args, console)
        except Exception as exc:
            if (interrupt := interrupt_within(exc)) is not None:
                raise interrupt from None
            raise
    except KeyboardInterrupt as exc:
        # SIGINT or SIGTERM: the launcher has stopped its ranks (and says how many); one line, the shell's code.
        global _interrupt_told
        what = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        _interrupt_told = True
        tell(f"pipefold {args.command}: {what}")
        return what.exit_code
    except ScheduleError as exc:
        if tell(f"pipefold {args.command}: error: {exc.message}") and exc.report:
            say(exc.report)
        return 1
    except PipefoldError as exc:
        tell(f"pipefold {args.command}: error: {exc}")
        return 2
    except RuntimeError as exc:
        from pipefold.runtime.launch.job import Diverged, RankError

        if not isinstance(exc, (RankError, Diverged)):
            raise
        tell(f"pipefold {args.command}: error: {exc}")
        return 1
    except BrokenPipeError:
        # The reader of the output left (``pipefold compare ... | head``): what it did not read is nobody's, and
        # the shell's code for a pipe that closed is 141. Standard output goes nowhere from here, so that the
        # exit's own flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as exc:
        tell(f"pipefold {args.command}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        return 2
    return 0

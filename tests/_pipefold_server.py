"""Runs ``pipefold`` commands one after another in one process, for the pages' test (tests/test_docs.py).

A page shows tens of ``pipefold`` commands; started each as a process of its own, each would import torch again,
and each that starts ranks would start their fork server again (seconds of CPU per command, most of the page's
time). This process imports them once, and its fork server serves every command of the page, as it serves every
``train`` call of one Python program.

It runs the pages' benchmark scripts too (``python benchmarks/X.py ...``), each as ``python`` would run it, so that
they share the imports and the fork server as well.

Each request is one JSON line on stdin: ``{"argv": [...], "cwd": ..., "out": ..., "err": ...}`` (or ``"script":
[path, *args]`` instead of ``argv``). The command runs
as the ``pipefold`` entry point runs it (:func:`pipefold.cli.main.main`, its exit code; a usage error's code; a
traceback on stderr for anything else), in ``cwd``, with file descriptors 1 and 2 on the files ``out`` and
``err`` (what its ranks and helpers print lands there too); threads it leaves running are waited for, as the
entry point waits for them. The reply is one JSON line ``{"code": n}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable


def _exit_code(run: Callable[[], int | None]) -> int:
    """The exit code ``run`` ends with, as a program's: what it returns (0 for None), a ``SystemExit``'s code
    (argparse's usage errors, a script's ``sys.exit``), or 1 with the traceback printed for anything else; the
    threads it leaves running are waited for, as the ``pipefold`` entry point and Python's exit wait for them."""
    from pipefold.cli.main import join_threads

    try:
        return run() or 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (what the program would print as it dies)
        traceback.print_exc()
        return 1
    finally:
        join_threads()


def _run(argv: list[str]) -> int:
    from pipefold.cli.main import main

    return _exit_code(lambda: main(argv))


def _script(argv: list[str]) -> int:
    """A Python script (a benchmark) run as ``python SCRIPT ARGS`` runs it: as ``__main__`` (whose file the ranks it
    starts from the fork server import again, as they do a script's), with its ``sys.argv`` and its folder first on
    ``sys.path``; its exit code."""
    import runpy

    argv_before, path_before = sys.argv[:], sys.path[:]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    def as_main() -> None:
        runpy.run_path(argv[0], run_name="__main__")

    try:
        return _exit_code(as_main)
    finally:
        sys.argv, sys.path[:] = argv_before, path_before


def serve() -> None:
    from pipefold.runtime.launch.processes import COMPILER, process_context

    process_context(COMPILER)  # the ranks' fork server, now, with torch's compiler: the pages' --compile commands
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    saved = os.dup(1), os.dup(2)
    for line in sys.stdin:
        request = json.loads(line)
        with open(request["out"], "w") as out, open(request["err"], "w") as err:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.chdir(request["cwd"])
            try:
                code = _script(request["script"]) if "script" in request else _run(request["argv"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        reply.write(json.dumps({"code": code}) + "\n")


if __name__ == "__main__":
    serve()

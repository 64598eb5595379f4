"""Runs ``pipefold`` commands one after another in one process, for the pages' test (tests/test_docs.py).

A page shows tens of ``pipefold`` commands; started each as a process of its own, each would import torch again,
and each that starts ranks would start their fork server again (seconds of CPU per command, most of the page's
time). This process imports them once, and its fork server serves every command of the page, as it serves every
``train`` call of one Python program.

Each request is one JSON line on stdin: ``{"argv": [...], "cwd": ..., "out": ..., "err": ...}``. The command runs
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


def _run(argv: list[str]) -> int:
    from pipefold.cli.main import join_threads, main

    try:
        return main(argv)
    except SystemExit as exc:  # argparse's usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (what the command would print as it dies)
        traceback.print_exc()
        return 1
    finally:
        join_threads()


def serve() -> None:
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
                code = _run(request["argv"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        reply.write(json.dumps({"code": code}) + "\n")


if __name__ == "__main__":
    serve()

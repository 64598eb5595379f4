"""The ``pipefold`` command with faults injected into the job it runs (for the tests; not a test module).

    python tests/faulty.py [--die-at N | --die-at N:save] [--nan-at N[,N...]] [--slow-commit S] -- train ARGS...
    torchrun ... tests/faulty.py --die-at 3 -- train ARGS...

``--die-at``: the last rank exits as step N starts (``N:save``: is killed, SIGKILL, while it saves the checkpoint
of step N), in a first attempt only (not in a restart by torchrun); ``--nan-at``: a NaN in microbatch 0's input at
those steps; ``--slow-commit``: rank 0 waits S seconds before it commits each checkpoint.
The faults reach the job through :data:`pipefold.train.prepare.JOB_HOOKS` (:mod:`pipefold.runtime.launch.faults`).
"""

from __future__ import annotations

import dataclasses
import os
import sys


def main() -> None:
    split = sys.argv.index("--")
    ours, command = sys.argv[1:split], sys.argv[split + 1:]
    die, nan, slow = None, frozenset(), 0.0
    for name, value in zip(ours[::2], ours[1::2], strict=True):
        if name == "--die-at":
            step, _, where = value.partition(":")
            die = (int(step), where or "step")
        elif name == "--nan-at":
            nan = frozenset(int(x) for x in value.split(","))
        elif name == "--slow-commit":
            slow = float(value)
        else:
            raise SystemExit(f"faulty.py: unknown option {name}")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        die = None  # a restarted attempt runs clean

    from pipefold.runtime.launch.faults import Faults
    from pipefold.train import prepare

    faults = Faults(die=die, nan=nan, slow_commit=slow)
    prepare.JOB_HOOKS.append(lambda job: dataclasses.replace(job, faults=faults))
    sys.argv = ["pipefold", *command]
    from pipefold.cli.main import entry

    entry()


if __name__ == "__main__":
    main()

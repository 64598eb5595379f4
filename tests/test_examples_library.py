"""The library examples (examples/nanogpt.py, hf_llama.py, fsdp_pp.py, tp_pp.py, context_parallel.py,
vocab_parallel.py) as the pages
show them: each command as written (under torchrun), and the same loop in one process without pipefold
(``--reference``); their per-step losses agree step by step. The pages' own test (tests/test_docs.py) leaves these
commands to this one, which checks more than their exit: :data:`COMMANDS` must hold every command of the pages that
runs an example."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Servers

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
LINE = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)

CASES = [
    ("torchrun --standalone --nproc-per-node 2 examples/nanogpt.py", "python examples/nanogpt.py --reference"),
    ("torchrun --standalone --nproc-per-node 2 examples/nanogpt.py --schedule zb-v",
     "python examples/nanogpt.py --reference"),
    ("torchrun --standalone --nproc-per-node 2 examples/nanogpt.py --schedule zb-v --dtype bf16 --compile",
     "python examples/nanogpt.py --reference --dtype bf16 --compile"),
    ("torchrun --standalone --nproc-per-node 2 examples/hf_llama.py", "python examples/hf_llama.py --reference"),
    ("torchrun --standalone --nproc-per-node 4 examples/fsdp_pp.py", "python examples/fsdp_pp.py --reference"),
    ("torchrun --standalone --nproc-per-node 4 examples/tp_pp.py", "python examples/tp_pp.py --reference"),
    ("torchrun --standalone --nproc-per-node 4 examples/tp_pp.py --sequence-parallel",
     "python examples/tp_pp.py --reference"),
    ("torchrun --standalone --nproc-per-node 4 examples/context_parallel.py",
     "python examples/context_parallel.py --reference"),
    ("torchrun --standalone --nproc-per-node 2 examples/vocab_parallel.py",
     "python examples/vocab_parallel.py --reference"),
]
"""Each command a page shows, with the one-process run of the same loop it is compared with."""
COMMANDS = frozenset(c for pair in CASES for c in pair)


@functools.cache
def _losses(command: str, servers: Servers) -> tuple[tuple[int, float], ...]:
    """The ``step N loss X`` lines of a command as written (``torchrun`` and ``python`` as this interpreter). A
    one-process reference runs as ``python`` runs the script, in the worker's command server (conftest.Server:
    torch imported once), unless it compiles (inductor's caches and dynamo's recompile limits would carry over from
    one compiled run to the next in that process): in a fresh interpreter, as every torchrun command."""
    argv = shlex.split(command)
    if argv[0] == "python" and "--compile" not in argv:
        done = servers.get().run(argv[1:], ROOT, script=True)
    else:
        head = [sys.executable, "-m", "torch.distributed.run"] if argv[0] == "torchrun" else [sys.executable]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run([*head, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, f"{command}\n{done.stderr}"
    return tuple((int(n), float(x)) for n, x in LINE.findall(done.stdout))


@pytest.mark.parametrize(("command", "reference"), CASES, ids=["nanogpt", "nanogpt-zb-v", "nanogpt-bf16-compiled",
                                                               "hf_llama", "fsdp_pp",
                                                               "tp_pp", "tp_pp-sequence-parallel",
                                                               "context_parallel", "vocab_parallel"])
def test_example_trains_as_its_one_process_reference(command: str, reference: str, servers: Servers) -> None:
    if "hf_llama" in command:
        pytest.importorskip("transformers")
    piped, alone = _losses(command, servers), _losses(reference, servers)
    assert len(alone) >= 3 and [n for n, _ in alone] == list(range(len(alone)))
    assert [n for n, _ in piped] == [n for n, _ in alone], piped  # printed once per step, by one rank
    for (n, got), (_, want) in zip(piped, alone, strict=True):
        assert abs(got - want) <= TOL, f"{command} step {n}: pipelined loss {got}, one process {want}"


def runs_an_example(argv: list[str]) -> bool:
    """Whether a page's command runs one of the example scripts (and so belongs in :data:`COMMANDS`)."""
    return any(re.fullmatch(r"examples/\w+\.py", a) for a in argv)


def test_every_page_command_that_runs_an_example_is_one_of_these() -> None:
    from test_docs import PAGES, blocks, commands

    shown = {shlex.join(argv) for page in PAGES for block in blocks(page) if block.info == "sh"
             for argv in commands(block.body) if runs_an_example(argv)}
    assert shown and shown <= COMMANDS, sorted(shown - COMMANDS)

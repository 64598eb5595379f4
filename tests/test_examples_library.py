"""The library examples (examples/nanogpt.py, hf_llama.py, fsdp_pp.py, tp_pp.py) as a user runs them: under torchrun,
and with --reference in one process without pipefold; their per-step losses agree step by step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
LINE = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)


def _losses(command: list[str]) -> list[tuple[int, float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return [(int(n), float(x)) for n, x in LINE.findall(done.stdout)]


@pytest.mark.parametrize(("script", "nprocs", "options"), [
    ("nanogpt.py", 2, []),
    ("nanogpt.py", 2, ["--schedule", "zb-v"]),
    ("hf_llama.py", 2, []),
    ("fsdp_pp.py", 4, []),
    ("tp_pp.py", 4, []),
], ids=["nanogpt", "nanogpt-zb-v", "hf_llama", "fsdp_pp", "tp_pp"])
def test_example_trains_as_its_one_process_reference(script: str, nprocs: int, options: list[str]) -> None:
    if script == "hf_llama.py":
        pytest.importorskip("transformers")
    path = str(ROOT / "examples" / script)
    steps = ["--steps", "4"]
    piped = _losses([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
                     path, *steps, *options])
    alone = _losses([sys.executable, path, "--reference", *steps, *options])
    assert [n for n, _ in alone] == [0, 1, 2, 3]
    assert [n for n, _ in piped] == [0, 1, 2, 3], piped  # printed once per step, by one rank
    for (n, got), (_, want) in zip(piped, alone, strict=True):
        assert abs(got - want) <= TOL, f"{script} step {n}: pipelined loss {got}, one process {want}"

"""Freed host memory kept for reuse (pipefold.runtime.host_memory), counted by the operating system's page faults.

Each case runs in a fresh interpreter (the setting is process-wide): eight tensors of 4 MiB are written and freed,
round after round, as a step's weight gradients are; ``getrusage`` counts the minor page faults of the later
rounds. Kept, the rounds reuse their pages. The reference that gives them back is glibc with its starting
thresholds held (``MALLOC_MMAP_THRESHOLD_=131072``: each such tensor mapped on its own, unmapped when freed), so
each round faults on its 8192 pages again. glibc left to itself moves its thresholds with the heap's history,
and what it gives back depends on that: 911 to 8146 faults a round in this script, from one checkout to
another.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipefold.runtime.host_memory import set_by_environment

PAGES = 8 * (4 << 20) // 4096  # one round's pages

SCRIPT = """
import resource, sys
import torch
import pipefold.runtime.stage  # the same imports in every case: the heap starts alike
mode = sys.argv[1]
applied = None
if mode == "kept":
    from pipefold.runtime.host_memory import keep_freed_pages
    applied = keep_freed_pages()
elif mode == "runner":
    from pipefold.runtime import host_memory
    pipefold.runtime.stage.StageRunner(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    applied = host_memory.keep_freed_pages()
def once():
    ts = [torch.empty(1 << 20).fill_(1.0) for _ in range(8)]
    del ts
once()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    once()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")


def _faults(mode: str, **env: str) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0], float(out[1])


def test_kept_pages_fault_no_more_while_glibcs_starting_thresholds_fault_every_round() -> None:
    _, held = _faults("plain", MALLOC_MMAP_THRESHOLD_="131072")
    assert held > PAGES / 2, f"the reference should fault on the freed pages again: {held:.0f} a round"
    applied, kept = _faults("kept")
    assert applied == "True"
    assert kept < PAGES / 8, f"{kept:.0f} faults a round with the pages kept, against {held:.0f} given back"


def test_a_stage_runner_keeps_them_for_every_process_that_runs_passes() -> None:
    applied, faults = _faults("runner")
    assert applied == "True"  # already applied by the runner: the second call says so
    assert faults < PAGES / 8


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"}, {"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_malloc_settings_from_the_environment_are_left_as_they_are(env: dict[str, str]) -> None:
    assert set_by_environment(env)
    applied, faults = _faults("kept", **env)
    assert applied == "False"
    assert faults > PAGES / 4, f"the environment's own thresholds should give the pages back: {faults:.0f} a round"


def test_other_glibc_tunables_do_not_count_as_malloc_settings() -> None:
    assert not set_by_environment({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "OMP_NUM_THREADS": "1"})

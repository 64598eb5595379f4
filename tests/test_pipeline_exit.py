"""A script's clean exit stays clean: once a user's script has closed its pipeline and destroyed its process group,
no process group is left for the interpreter's shutdown to destroy, and no thread of pipefold's is left running.

A process group that lives into the shutdown is destroyed there, joining gloo's worker threads while Python is half
gone; one that needs Python then (to free a tensor it held) aborts the process with "terminate called without an
active exception", which torchrun reports as the rank's crash. Each layout below is a member of that class: what the
pipeline made (its subgroups, K-FAC's group, the links' threads) and what it made torch keep (importing FSDP after
``init_process_group`` pins the default group)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import run_ranks


def _rank(rank: int, init: str, layout: str, out: Any) -> None:
    import gc
    import threading
    import weakref

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold import Pipeline
    from pipefold.runtime import pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")) if layout != "pp" else None
    device = mesh["pp"].get_local_rank() if mesh is not None else rank
    copy = mesh["dp"].get_local_rank() if mesh is not None else 0
    kwargs: dict[str, Any] = {"kfac": True} if layout == "kfac" else {}
    if layout == "tied":
        kwargs["tied"] = [{0: "0.weight", 1: "0.weight"}]
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    pipe = Pipeline(stage, "1f1b", microbatches=2, loss_fn=nn.functional.mse_loss, mesh=mesh, **kwargs)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x.chunk(2)[copy], target=y.chunk(2)[copy], all_ranks=True)
    pipe.close()
    groups = [weakref.ref(g) for g in c10d._world.pg_map]
    threads = [t.name for t in threading.enumerate() if t.name.startswith("pipefold")]
    dist.destroy_process_group()
    del pipe, stage, mesh
    pipeline._close_at_exit()  # what the interpreter runs before it shuts down
    gc.collect()
    out.put((rank, device, len(groups), sum(g() is not None for g in groups), threads))


@pytest.mark.parametrize("layout", ["pp", "dp-pp", "kfac", "tied"])
def test_no_process_group_or_thread_outlives_a_closed_pipeline(layout: str) -> None:
    got = run_ranks(_rank, 4, layout)
    assert len(got) == 4
    for rank, _, made, alive, threads in got:
        assert made >= 1
        assert alive == 0, f"rank {rank}: {alive} of {made} process groups alive after destroy_process_group"
        assert threads == [], f"rank {rank}: threads {threads} after close()"


FRESH = """
import gc, sys, weakref
import torch, torch.distributed as dist
from torch import nn
first = sys.argv[2] == "pipefold first"
if first:
    from pipefold import Pipeline
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
from pipefold import Pipeline
from pipefold.runtime import pipeline
world = weakref.ref(dist.group.WORLD)
pipe = Pipeline(nn.Sequential(nn.Linear(8, 8)), "1f1b", microbatches=2, loss_fn=nn.functional.mse_loss)
if sys.argv[2] != "no optimizer":
    opt = torch.optim.AdamW(pipe.parameters())
pipe.step(torch.randn(4, 8), target=torch.randn(4, 8))
pipe.close()
dist.destroy_process_group()
del pipe
pipeline._close_at_exit()
gc.collect()
print("world alive:", world() is not None)
"""


@pytest.mark.parametrize(("order", "alive"), [("no optimizer", False), ("pipefold first", False),
                                              ("optimizer after init", True)])
def test_the_default_group_dies_with_destroy_when_pipefold_is_imported_first(order: str, alive: bool,
                                                                            tmp_path: Any) -> None:
    """In a fresh interpreter: nothing the pipeline did keeps the default group past ``destroy_process_group``
    (pipefold imported after ``init_process_group``, no optimizer: FSDP is never imported). torch's optimizers
    import FSDP, which keeps the default group of that moment until the interpreter's shutdown: with pipefold
    imported before ``init_process_group`` (it imports them while there is no group) the group dies with
    ``destroy_process_group``, and without (the last case, torch's own behaviour) it stays alive, so the check can
    fail."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src}
    done = subprocess.run([sys.executable, "-c", FRESH, f"file://{tmp_path}/rendezvous", order], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"world alive: {alive}" in done.stdout, (done.stdout, done.stderr)

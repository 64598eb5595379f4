"""Shared test settings."""

import contextlib
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


TIMING_TRIES = 5
"""How many times a test measures a timing in all before its bounds fail: a timing taken while the suite's other
worker runs ranks (torchrun examples of 4 ranks, benchmarks) on the same 2 cores can come out far off, once in a
few runs, and comes right when measured again. The structural checks of such a test hold on every run."""


def build_or_refused(name: str, p: int, m: int, **options: int):  # type: ignore[no-untyped-def]
    """Schedule ``name`` for this shape, or None where its family refuses the shape in one line naming what works
    (Chimera wants even p and a multiple of p microbatches, DualPipe m >= 2p, a V block must not collide...)."""
    from pipefold import ConfigError, build

    try:
        return build(name, p, m, **options)
    except ConfigError as exc:
        text = str(exc)
        assert "\n" not in text, text
        assert any(k in text for k in ("nearest valid", "collision-free", "use --microbatches")), text
        return None


def load_benchmark(name: str):  # type: ignore[no-untyped-def]
    """``benchmarks/<name>`` as a module (the benchmarks are scripts, not a package), registered under its name so
    that its dataclasses find their module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_LONGEST_FIRST = ("docs/parallelism.md", "benchmarks/results/memory_ratio.md", "README.md", "docs/checkpoints.md",
                  "benchmarks/results/vs_torch.md", "docs/runtime.md", "docs/world.md", "docs/plan.md",
                  "benchmarks/results/runtime_breakdown.md", "docs/models.md")
"""The pages whose commands take longest (half a minute to a minute and a half each on two loaded cores), longest
first: started first, so that with ``make test``'s two workers (pytest-xdist, which hands out tests in the collected
order) they run beside the rest, not after it."""


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    def rank(item):  # type: ignore[no-untyped-def]
        if item.module.__name__.endswith("test_docs") and "runs_as_written" in item.name:
            page = item.name.split("[", 1)[1].rstrip("]")
            return (0, _LONGEST_FIRST.index(page) if page in _LONGEST_FIRST else len(_LONGEST_FIRST))
        return (1, 0)

    items.sort(key=rank)  # stable: the rest keep their order


def run_ranks(target, nprocs, *args, timeout=300.0):  # type: ignore[no-untyped-def]
    """Start ``nprocs`` processes running ``target(rank, init, *args, out)`` (``init``: where their process group
    meets, :func:`pipefold.runtime.launch.processes.rendezvous`), as the runtime starts its ranks: from
    its fork server, which has imported torch (a spawned process imports it again: seconds each, on two cores);
    return everything they put on the queue ``out``, in the order it came. The queue is read while they run, so a
    large result cannot fill its pipe and hold a process up; one that fails raises here; past ``timeout`` seconds
    every one is killed and the test fails."""
    import time

    import torch.multiprocessing as mp

    from pipefold.runtime.launch.processes import process_context, rendezvous

    ctx = process_context()
    out = ctx.SimpleQueue()
    got = []
    with rendezvous() as init:
        procs = mp.start_processes(target, args=(init, *args, out), nprocs=nprocs,
                                   start_method=ctx.get_start_method(), join=False)
        deadline = time.monotonic() + timeout
        try:
            while True:
                while not out.empty():
                    got.append(out.get())
                if procs.join(timeout=0.1):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{nprocs} ranks of {target.__name__} still running after {timeout} s")
        finally:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
    while not out.empty():
        got.append(out.get())
    return got


class WorkStarted(AssertionError):
    """The work began where a refusal was to come first (:func:`no_work`)."""


@contextlib.contextmanager
def no_work(*, simulating=True):  # type: ignore[no-untyped-def]
    """While entered, the work a refusal must come before fails the test if it begins: starting ranks (locally or
    under torchrun), profiling a model, and, where ``simulating`` (a search's, a simulation's work), simulating a
    schedule (preparing a run simulates its schedule to place K-FAC's work, which is not the run's work). A profile
    hook watches this thread's calls for those functions' code, so every module that imported them is watched. It
    asserts the order, which a bound on the refusal's duration could only guess at (a busy machine stretches any
    duration)."""
    import inspect
    import sys

    from pipefold.runtime.launch.local import run_local
    from pipefold.runtime.launch.torchrun import run_torchrun
    from pipefold.runtime.measure.profiling import profile_model
    from pipefold.sim.simulate import simulate

    # Their own code, not a decorator's wrapper (which every function so decorated shares).
    work = {inspect.unwrap(f).__code__: f.__qualname__ for f in (run_local, run_torchrun, profile_model, simulate)
            if simulating or f is not simulate}

    def hook(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and frame.f_code in work:
            raise WorkStarted(f"{work[frame.f_code]} began before the refusal")

    before = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(before)

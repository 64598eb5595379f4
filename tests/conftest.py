"""Shared test settings."""

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
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


_LONGEST_FIRST = ("docs/parallelism.md", "docs/cluster.md", "benchmarks/results/memory_ratio.md", "README.md",
                  "docs/checkpoints.md", "benchmarks/results/vs_torch.md", "docs/runtime.md", "docs/world.md",
                  "docs/plan.md", "docs/precision.md", "benchmarks/results/partition_speed.md",
                  "benchmarks/results/runtime_breakdown.md", "docs/models.md")
"""The pages whose commands take longest (half a minute to a minute and a half each on two loaded cores), longest
first: started first, so that with ``make test``'s two workers (pytest-xdist, which hands out tests in the collected
order) they run beside the rest, not after it."""


_LONG_NEXT = ("test_release.py::test_the_wheel_installs_outside_the_repository_and_runs_with_its_own_data",
              "test_examples_library.py::test_example_trains_as_its_one_process_reference",
              "test_checkpoint.py::test_torchrun_restart_resumes_from_the_last_checkpoint",
              "test_cli_options.py::test_every_number_outside_its_range_is_refused_when_parsed",
              "test_temporary_files.py::test_nothing_is_left_in_the_temporary_folder",
              "test_train_cli.py::test_same_command_under_torchrun",
              "test_precision.py::test_inductor_compiled_stages_in_bf16_equal_one_process_running_them",
              "test_plan_model.py::test_profile_plan_train_runs_the_plan_with_exact_gradients_and_its_predicted_memory",
              "test_precision_cli.py::test_each_recipe_equals_one_process_running_it",
              "test_dataparallel.py::test_two_torchrun_agents_as_two_nodes",
              "test_plan_model.py::test_plan_is_the_fastest_fitting_point_of_a_brute_force",
              "test_hf.py::test_v_shape_sums_the_tied_copies_on_one_rank",
              "test_faults.py::test_torchrun_a_stopped_worker_is_named",
              "test_torchrun_errors.py::test_one_line_says_why_a_torchrun_job_failed",
              "test_train_cli.py::test_kfac_in_the_bubbles_under_torchrun",
              "test_vs_torch_library.py::test_the_two_libraries_agree_on_1f1b_and_zb_v",
              "test_checkpoint.py::test_the_save_model_snippet_of_the_docs_runs_as_written",
              "test_precision.py::test_compiled_layers_keep_the_split_backward_exact",
              "test_faults.py::test_a_rank_killed_mid_step_is_named",
              "test_checkpoint.py::test_crash_mid_save_and_corrupt_checkpoints",
              "test_hf.py::test_pipeline_matches_the_unwrapped_model")
"""The other tests that take longest (a quarter of a minute to a minute each, or each of their parameters, on two
loaded cores), longest first: started right after the pages, so that none of them comes last and leaves one worker
running it alone at the end of the suite while the other has nothing left to do."""


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    def rank(item):  # type: ignore[no-untyped-def]
        if item.module.__name__.endswith("test_docs") and "runs_as_written" in item.name:
            page = item.name.split("[", 1)[1].rstrip("]")
            return (0, _LONGEST_FIRST.index(page) if page in _LONGEST_FIRST else len(_LONGEST_FIRST))
        name = f"{item.path.name}::{item.originalname}"
        if name in _LONG_NEXT:
            return (1, _LONG_NEXT.index(name))
        return (2, 0)

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


@pytest.fixture(scope="session", autouse=True)
def _ranks_fork_server() -> Iterator[None]:
    """Under pytest-xdist (``make test``) each worker starts the fork server its ranks come from (:func:`run_ranks`,
    and the commands run in the worker) at once, with torch's compiler among its imports
    (:data:`pipefold.runtime.launch.processes.COMPILER`): a rank's first compiled layer then takes a fraction of a
    second instead of seconds of imports, in every test that compiles (whichever test starts the first ranks
    starts the server otherwise, with what it needs). Its imports run beside the first tests."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from pipefold.runtime.launch.processes import COMPILER, process_context

        process_context(COMPILER)
    yield


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

ROOT = Path(__file__).resolve().parent.parent


def server_env() -> dict[str, str]:
    """The environment of the commands a :class:`Server` runs: the suite's, one thread each, this checkout's source."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


class Server:
    """One process that runs ``pipefold`` commands one after another (tests/_pipefold_server.py): torch imported
    once, one fork server for every command's ranks, instead of both again for each command. The pages' test
    (tests/test_docs.py) runs their commands in it, and so does a test that runs a flow of ``pipefold`` commands
    and looks only at what each prints, exits with and writes (not at how a process of its own starts or ends)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_pipefold_server.py")], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.count = 0
        self.dir = Path(tempfile.mkdtemp(prefix="pipefold-docs-"))  # the commands' output, outside their folder

    def run(self, argv: list[str], cwd: Path, script: bool = False) -> subprocess.CompletedProcess[str]:
        """``pipefold ARGV``, or with ``script`` ``python ARGV`` (a benchmark), run in ``cwd``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.count += 1
        out, err = self.dir / f"{self.count}.out", self.dir / f"{self.count}.err"
        request = {"script" if script else "argv": argv, "cwd": str(cwd), "out": str(out), "err": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(300, self.proc.kill)
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        shown = ["python" if script else "pipefold", *argv]
        assert line, (f"{shlex.join(shown)} ran for over 300 s, or ended the process that ran it\n"
                      f"{err.read_text()[-3000:]}")
        return subprocess.CompletedProcess(shown, json.loads(line)["code"], out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class Servers:
    """The worker's one :class:`Server`, started when a test first needs it and started again after a command
    that ended it (the next test's commands then meet a fresh process, not the failure of another test)."""

    def __init__(self) -> None:
        self.server: Server | None = None

    def get(self) -> Server:
        if self.server is None or self.server.proc.poll() is not None:
            if self.server is not None:
                self.server.close()
            self.server = Server(server_env())
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    made = Servers()
    try:
        yield made
    finally:
        made.close()

"""Every command block of the README and docs/, run as written, in the order the page shows it.

The text is never edited for the test. One setting, :data:`SHRINK`, scales what would take minutes on a laptop
down to seconds: widths and sequence lengths above a cap come down to it, so do a cluster plan's node count,
the largest matrix product a calibration times, a benchmark's repeated runs and rounds and a profile's rounds
between processes (``--quick``), and step counts (with
the checkpoint intervals and checkpoint names that count steps) are divided by one factor per page, so that a flow
that trains 100 steps, checkpoints every 10 and resumes to 200 still checkpoints and resumes. A training command with no
``--steps`` runs 2 steps. Nothing else is changed: schedules, devices, microbatches, layers, budgets, files and
every other option run as the page gives them.

Each page runs in a folder of its own (with ``examples/`` and ``benchmarks/`` beside it), block after block, so a
command finds the files an earlier one wrote (a schedule file, a profile, a plan, a checkpoint, a saved model).
Every command must exit 0 (or, where the page says it fails, exit non-zero with the one line the page promises),
print no traceback, write the files it names, and, with ``--check``, match the one-process reference. A page's
first ``pipefold`` command of the README runs as a process of its own, as a shell runs it; every other, and every
benchmark script run with the suite's own variables, runs in one process per xdist worker
(``tests/_pipefold_server.py``: the entry point's own function, or the script as ``python`` runs it; output and exit
code), which imports torch and starts the ranks' fork server once for the session instead of once per command.

A command that two pages show alike, after SHRINK, and that reads the same files on both, runs once for the suite: the
first page to reach it runs it, the other waits for that run's verdict and gets a copy of every file the run wrote in
its folder (``_Once``). Alike means the same command and the same bytes in each file it names that its page's folder
already holds (a profile an earlier command wrote, an example's config); a command that names a folder, or a file
that is neither there nor one it writes, sets variables, or is not ``pipefold``, runs on its own page.

Blocks fenced as ```python run as programs in the same folder; ```python fragment marks a few lines completed by
a later block of the same page. What cannot run here is skipped with the reason: CUDA without a GPU, network
namespaces where they cannot be made, ``make test`` (this suite), ``pip install`` (tests/test_release.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Server as _Server
from conftest import Servers as _Servers
from conftest import server_env as _env
from pipefold.runtime.launch.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
"""The pages whose commands run: the README, the docs, and the results of the benchmarks (each shows the command
that measured it)."""


@dataclass(frozen=True)
class Shrink:
    """How the pages' sizes are scaled down for the test (the one setting)."""

    width: int = 64
    """``--hidden`` and ``--seq`` above this come down to it (a Hugging Face config keeps its own sizes)."""
    steps: int = 4
    """The most steps a page's longest training command runs; every step count of the page is divided by one
    factor so that it does (and intervals and checkpoint names with it)."""
    default_steps: int = 2
    """Steps for a training command that gives none."""
    benchmark_steps: int = 2
    """``--steps`` of a benchmark (``python benchmarks/...``) come down to this: a benchmark's steps are repeats of
    one measurement, not a flow whose later commands count on them."""
    benchmark_runs: int = 1
    """``--runs`` of a benchmark come down to this: its runs are repeats of the whole measurement."""
    benchmark_rounds: int = 2
    """``--rounds`` of a benchmark come down to this: its rounds alternate the ways it compares, repeats too; so do
    its ``--times`` and ``--beside`` (``machine_speed.py``'s probes and rounds)."""
    benchmark_reps: int = 20
    """``--reps`` of a benchmark (calls timed together in a round) come down to this."""
    benchmark_points: int = 2
    """A benchmark's list of sizes (``--layers 2 4 6 ...``), given or its default, comes down to its first this
    many: every size runs the same measurement."""
    nodes: int = 4
    """``--nodes`` of a cluster plan (``pipefold plan --cluster``) above this come down to it."""
    benchmark_nodes: int = 2
    """``--nodes`` of a benchmark above this come down to it: a benchmark's search only has to run."""
    largest_product: float = 1e9
    """``pipefold calibrate``'s ``--largest`` (given, or its 1e12 by default) comes down to this many operations."""
    quick_profile: bool = True
    """``pipefold profile`` measures with ``--quick`` (fewer rounds between its processes): the repeats of its
    measurements, as ``--steps`` are a run's."""


SHRINK = Shrink()
TRAINS = {"train"}
SIZED = {"train", "profile", "partition", "offload"}
OUTPUTS = ("-o", "--output", "--plot", "--trace", "--save-model")
FAILS = {"--memory-budget 1MB": "the smallest reachable budget is"}
"""Commands a page shows failing (by a part of the command), with a part of the one line they must print."""


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    info: str
    body: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, those inside a list item too (fence and body indented alike: the body is read
    without that indent)."""
    out, lines, i = [], page.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
            info, start = lines[i].lstrip()[3:].strip(), i
            i += 1
            body = []
            while not lines[i].lstrip().startswith("```"):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
                i += 1
            name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
            out.append(Block(name, start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return out


def commands(body: str) -> list[list[str]]:
    """The block's commands as argument lists: a backslash or an open quote continues a line; comments dropped."""
    out, pending = [], ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quotation open over several lines (a `python -c '...'` program)
            continue
        if words:
            out.append(words)
        pending = ""
    assert not pending.strip(), f"unfinished command: {pending!r}"
    return out


def _value(argv: list[str], *names: str) -> str | None:
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def step_factor(page_commands: list[list[str]]) -> float:
    """One factor for the page: its largest --steps comes down to SHRINK.steps."""
    most = max((int(v) for argv in page_commands if (v := _value(argv, "--steps")) is not None
                and _pipefold_argv(argv) and _pipefold_argv(argv)[0] in TRAINS), default=0)
    return max(1.0, most / SHRINK.steps)


def shrink(argv: list[str], factor: float) -> list[str]:
    """A pipefold command's arguments (after ``pipefold``) with SHRINK applied."""
    out = list(argv)
    command = out[0] if out else ""
    hf = "--hf" in out
    for i in range(1, len(out) - 1):
        name, value = out[i], out[i + 1]
        if command in SIZED and not hf and name in ("--hidden", "--seq") and int(value) > SHRINK.width:
            out[i + 1] = str(SHRINK.width)
        elif command == "plan" and name == "--nodes" and int(value) > SHRINK.nodes:
            out[i + 1] = str(SHRINK.nodes)
        elif command in TRAINS and name == "--steps":
            out[i + 1] = str(max(1, math.ceil(int(value) / factor)))
        elif command in TRAINS and name == "--checkpoint-every":
            out[i + 1] = str(max(1, int(int(value) / factor)))
        elif command in TRAINS and name == "--resume":
            out[i + 1] = re.sub(r"step-(\d+)", lambda mt: f"step-{max(1, int(int(mt[1]) / factor)):08d}", value)
        elif command == "calibrate" and name == "--largest" and float(value) > SHRINK.largest_product:
            out[i + 1] = f"{SHRINK.largest_product:g}"
    if command in TRAINS and _value(out, "--steps") is None:
        out += ["--steps", str(SHRINK.default_steps)]
    if command == "profile" and SHRINK.quick_profile and "--quick" not in out:
        out.append("--quick")
    if command == "calibrate" and _value(out, "--largest") is None:
        out += ["--largest", f"{SHRINK.largest_product:g}"]
    return out


def shrink_benchmark(argv: list[str], options: str | None = None) -> list[str]:
    """A ``python`` command's arguments, with SHRINK applied where it runs a benchmark: its ``--steps`` capped at
    SHRINK.benchmark_steps and its ``--hidden`` and ``--seq`` at SHRINK.width, given or not (a benchmark run on
    its defaults gets these options where it declares them; ``options`` is its source, read by default)."""
    out = list(argv)
    if not out or not out[0].startswith("benchmarks/"):
        return out
    source = options if options is not None else (ROOT / out[0]).read_text(encoding="utf-8")
    caps = {"--steps": SHRINK.benchmark_steps, "--hidden": SHRINK.width, "--seq": SHRINK.width,
            "--nodes": SHRINK.benchmark_nodes, "--runs": SHRINK.benchmark_runs,
            "--rounds": SHRINK.benchmark_rounds, "--times": SHRINK.benchmark_rounds,
            "--beside": SHRINK.benchmark_rounds, "--reps": SHRINK.benchmark_reps,
            "--repeats": SHRINK.benchmark_runs}
    for name, cap in caps.items():
        if name in out[1:-1]:
            i = out.index(name)
            out[i + 1] = str(min(int(out[i + 1]), cap))
        elif ((m := re.search(rf'add_argument\("{name}"[^)]*?default=(\w+)', source)) is not None
              and (not m[1].isdigit() or int(m[1]) > cap)):
            out += [name, str(cap)]
    for name in ("--layers", "--vocab-sizes"):  # lists of sizes: the first few
        if name in out[1:-1]:
            i = out.index(name)
            j = next((k for k in range(i + 1, len(out)) if out[k].startswith("-")), len(out))
            out[i + 1:j] = out[i + 1:j][:SHRINK.benchmark_points]
        elif (m := re.search(rf'add_argument\("{name}", nargs="\+"[^)]*?default=\[([\d, ]+)\]', source)) is not None:
            out += [name, *m[1].replace(",", " ").split()[:SHRINK.benchmark_points]]
    return out


def _pipefold_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``pipefold`` (or ``-m pipefold`` under torchrun), or None."""
    if argv[0] == "pipefold":
        return argv[1:]
    if argv[0] == "torchrun" and "pipefold" in argv:
        return argv[argv.index("pipefold") + 1:]
    return None


def _skip_reason(argv: list[str]) -> str | None:
    import torch

    text = " ".join(argv)
    if ("--device cuda" in text or argv[:2] == ["make", "gpu-check"]) and not torch.cuda.is_available():
        return "needs a GPU (make gpu-check runs it on one)"
    if argv[:2] == ["make", "test"]:
        return "this suite"
    if argv[:2] == ["pip", "install"]:
        return ("installs the project: tests/test_release.py builds its wheel, as pip does, and installs it into a "
                "fresh environment")
    from test_examples_library import COMMANDS, runs_an_example

    if runs_an_example(argv) and shlex.join(argv) in COMMANDS:
        return "run as written by tests/test_examples_library.py, which compares its losses with one process's"
    if "--netns" in argv:
        from pipefold.runtime.launch import netns

        if (why := netns.unavailable()) is not None:
            return f"network namespaces cannot be made here: {why}"
    if argv[:2] == ["make", "demo"] and subprocess.run(["make", "-q", "setup"], cwd=ROOT).returncode != 0:
        return "make demo would build a new .venv (the suite runs outside the project's own)"
    return None


def _run(argv: list[str], cwd: Path, factor: float, server: _Server | None = None,
         scripts: _Servers | None = None) -> list[subprocess.CompletedProcess[str]]:
    """Run one command as written (with SHRINK); several processes for a multi-node torchrun. A ``pipefold``
    command without variables set before it runs in ``server`` where one is given; a benchmark script in
    ``scripts``, where the variables set before it (if any) are the suite's own (``OMP_NUM_THREADS=1``)."""
    env = _env()
    if server is not None and argv[0] == "pipefold":
        return [server.run(shrink(argv[1:], factor), cwd)]
    own = [a for a in argv if re.fullmatch(r"[A-Z_]+=\S*", a)]
    python = argv[len(own):]
    if (scripts is not None and all(env.get(k) == v for k, v in (a.split("=", 1) for a in own))
            and python[0] in ("python", ".venv/bin/python") and python[1:2]
            and python[1].startswith("benchmarks/")):
        return [scripts.get().run(shrink_benchmark(python[1:]), cwd, script=True)]
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    py = [sys.executable]
    if argv[0] == "pipefold":
        runs = [[*py, "-m", "pipefold", *shrink(argv[1:], factor)]]
    elif argv[0] == "torchrun" and "pipefold" not in argv:  # a user's own script, as the library's pages show
        at = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        launcher = [a.replace("HOST:29500", f"127.0.0.1:{free_port()}") for a in argv[1:at]]
        port = [] if "--standalone" in launcher else ["--master-port", str(free_port())]  # beside other pages' runs
        runs = [[*py, "-m", "torch.distributed.run", *port, *launcher, *argv[at:]]]
    elif argv[0] == "torchrun":
        at = argv.index("pipefold")
        launcher = [a.replace("HOST:29500", f"127.0.0.1:{free_port()}") for a in argv[1:at - 1]]
        nodes = int(_value(launcher, "--nnodes") or 1)
        command = [*py, "-m", "torch.distributed.run", *launcher, "-m", "pipefold", *shrink(argv[at + 1:], factor)]
        runs = [command] * nodes
    elif argv[0] in ("python", ".venv/bin/python"):
        runs = [[*py, *shrink_benchmark(argv[1:])]]
    elif argv[0] == "make":
        runs = [["make", "-C", str(ROOT), *argv[1:]]]
    else:
        raise AssertionError(f"a command the test cannot run: {shlex.join(argv)}")
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in runs]
    done = []
    for cmd, proc in zip(runs, procs, strict=True):
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for each in procs:
                each.kill()
            raise AssertionError(f"{shlex.join(cmd)} ran for over 300 s") from None
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return done


def _check(argv: list[str], got: subprocess.CompletedProcess[str], cwd: Path, started: float) -> None:
    text = " ".join(argv)
    shown = shlex.join(got.args)
    assert "Traceback" not in got.stderr, f"{shown}\n{got.stderr}"
    failing = next((why for part, why in FAILS.items() if part in text), None)
    if failing is not None:
        lines = got.stderr.strip().splitlines()
        assert got.returncode != 0 and len(lines) == 1 and failing in lines[0], f"{shown}\n{got.stderr}"
        return
    assert got.returncode == 0, f"{shown}\nexit {got.returncode}\n{got.stdout[-3000:]}\n{got.stderr[-3000:]}"
    _check_written(argv, cwd, started, shown)
    if "--json" in argv and _pipefold_argv(argv) is not None:
        out = json.loads(got.stdout)
        if "--check" in argv:
            assert out["max_grad_rel_diff"] < 1e-4, f"{shown}: {out['max_grad_rel_diff']}"
    elif "--check" in argv:
        diff = re.search(r"max gradient rel diff (\S+)", got.stdout)
        assert diff is not None and float(diff[1]) < 1e-4, f"{shown}\n{got.stdout[-2000:]}"


def _check_written(argv: list[str], cwd: Path, started: float, shown: str | None = None) -> None:
    """Every file the command names as an output is there, not empty, and written since it ``started``."""
    for name in OUTPUTS:
        path = _value(argv, name)
        if path is not None and not path.startswith("/dev/"):
            written = cwd / path
            assert written.is_file() and written.stat().st_size > 0, f"{shown or shlex.join(argv)}: {path} not written"
            assert written.stat().st_mtime >= started - 1, f"{shown or shlex.join(argv)}: {path} not written by it"


FILE_LIKE = re.compile(r"[/\\]|\.[A-Za-z]+$")
"""An argument naming a file or a folder: a path, or a name with an extension (``zb.csv``, ``run.json``)."""
FOLDER_OPTIONS = {"--checkpoint-dir", "--resume"}


def once_key(argv: list[str], factor: float, cwd: Path) -> str | None:
    """The key under which a command runs once for every page that shows it (the command as run, with SHRINK, and
    the bytes of each file it names that ``cwd`` holds, less those it writes), or None where it must run on its
    own page: it names a folder, or a file that ``cwd`` does not hold and it does not write, or sets variables."""
    if argv[0] not in ("pipefold", "torchrun") or "pipefold" not in argv or FOLDER_OPTIONS & set(argv):
        return None
    import hashlib

    at = argv.index("pipefold") + 1
    written = {_value(argv, name) for name in OUTPUTS}
    read = []
    for i, word in enumerate(argv[at:], at):
        if not FILE_LIKE.search(word) or (word in written and argv[i - 1] in OUTPUTS):
            continue
        path = cwd / word
        if not path.is_file():
            return None
        read.append(f"{word}:{hashlib.sha256(path.read_bytes()).hexdigest()}")
    return " ".join([shlex.join([*argv[:at], *shrink(argv[at:], factor)]), *read])


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` (not through links: a page's ``examples/`` and ``benchmarks/``), by its path
    there: (size, modification time)."""
    out = {}
    for top, _, names in os.walk(folder):
        for name in names:
            path = Path(top) / name
            if not path.is_symlink():
                st = path.stat()
                out[str(path.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


class _Once:
    """Commands that several pages show alike, run by the first page that reaches one: it claims the command (a file
    made with O_EXCL in a folder every xdist worker of the session shares), runs it, keeps a copy of every file it
    wrote in its page's folder and writes the verdict; a page that finds it claimed waits for the verdict and copies
    those files into its own folder. A page only waits on a command that another is running now, so two pages
    cannot wait on each other."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str, suffix: str) -> Path:
        import hashlib

        return self.root / (hashlib.sha256(key.encode()).hexdigest()[:20] + suffix)

    def claim(self, key: str, page: str) -> str | None:
        """None: this page runs the command; else the page that claimed it."""
        path = self._path(key, ".claim")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return path.read_text(encoding="utf-8") or "another page"
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        return None

    def verdict(self, key: str, failure: str | None, cwd: Path | None = None,
                before: dict[str, tuple[int, int]] | None = None) -> None:
        """The run's verdict, and with ``cwd`` a copy of every file there that is new or changed since ``before``."""
        if failure is None and cwd is not None:
            kept = self._path(key, ".files")
            for name, seen in _files(cwd).items():
                if (before or {}).get(name) != seen:
                    (kept / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(cwd / name, kept / name)
        self._path(key, ".tmp").write_text("ok" if failure is None else "failed\n" + failure, encoding="utf-8")
        self._path(key, ".tmp").replace(self._path(key, ".done"))

    def wait(self, key: str, page: str, cwd: Path | None = None) -> None:
        """Wait for the verdict of the run ``page`` claimed; then copy what it wrote into ``cwd``, as if run there."""
        done, deadline = self._path(key, ".done"), time.monotonic() + 900
        while not done.exists():
            assert time.monotonic() < deadline, f"{key}: {page} claimed it and gave no verdict in 900 s"
            time.sleep(0.2)
        text = done.read_text(encoding="utf-8")
        if text != "ok":
            raise AssertionError(f"{key} (run for this page by {page}): {text}")
        kept = self._path(key, ".files")
        if cwd is not None and kept.is_dir():
            for name in _files(kept):
                (cwd / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(kept / name, cwd / name)  # not copy2: the file is new here, as a run makes it


@pytest.fixture(scope="session")
def once(tmp_path_factory: pytest.TempPathFactory) -> _Once:
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker has a folder of its own inside the session's: the commands are shared there.
    return _Once((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "docs-commands-once")


def _runnable(block: Block) -> bool:
    return block.info == "sh" or block.info == "python"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_command_of_the_page_runs_as_written(page: Path, tmp_path: Path, once: _Once,
                                                  servers: _Servers) -> None:
    found = [b for b in blocks(page) if _runnable(b)]
    if not found:
        pytest.skip("no command blocks")
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "docs" / "figures").mkdir(parents=True)
    factor = step_factor([argv for b in found if b.info == "sh" for argv in commands(b.body)])
    skipped: list[str] = []
    elsewhere: list[str] = []
    took: list[tuple[float, str]] = []
    name = str(page.relative_to(ROOT))
    # The README's first pipefold command runs as a process of its own (the entry point as a shell starts it);
    # every other in the worker's server process (see _Server).
    server: _Server | None = None
    own_process = page.name == "README.md"
    for block in found:
        if block.info == "python":
            got = subprocess.run([sys.executable, "-c", block.body], cwd=tmp_path, env=_env(),
                                 capture_output=True, text=True, timeout=300, check=False)
            assert got.returncode == 0, f"{block.id}\n{got.stderr}"
            continue
        for argv in commands(block.body):
            if (why := _skip_reason(argv)) is not None:
                skipped.append(f"{block.id} {shlex.join(argv)}: {why}")
                continue
            key = once_key(argv, factor, tmp_path)
            started = time.time()
            if key is not None and (by := once.claim(key, name)) is not None:
                once.wait(key, by, tmp_path)
                _check_written(argv, tmp_path, started)
                elsewhere.append(f"{block.id} {shlex.join(argv)}: run by {by}")
                continue
            before = _files(tmp_path)
            if argv[0] == "pipefold" and not own_process:
                server = servers.get()
            own_process = own_process and argv[0] != "pipefold"
            try:
                for got in _run(list(argv), tmp_path, factor, server, servers):
                    _check(argv, got, tmp_path, started)
            except BaseException as exc:
                if key is not None:
                    once.verdict(key, f"{type(exc).__name__}: {exc}"[:3000])
                raise
            if key is not None:
                once.verdict(key, None, tmp_path, before)
            took.append((time.time() - started, f"{block.id} {shlex.join(argv)}"))
    print("slowest:\n" + "\n".join(f"{s:6.1f} s  {what[:150]}" for s, what in sorted(took, reverse=True)[:8]))
    if elsewhere:
        print("run once for the suite, by another page:\n" + "\n".join(elsewhere))
    if skipped:
        print("skipped:\n" + "\n".join(skipped))


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
"""A Markdown link or image: its target."""


def anchors(page: Path) -> set[str]:
    """The anchors a renderer (GitHub's) makes for the page's headings: lower case, punctuation dropped, spaces
    as hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", line.lstrip("#").strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


LINKED = [*PAGES, ROOT / "CHANGELOG.md"]


@pytest.mark.parametrize("page", LINKED, ids=[str(p.relative_to(ROOT)) for p in LINKED])
def test_every_link_resolves(page: Path) -> None:
    """Every link of a page to a file of the repository names a file that is there, and an anchor its headings
    make; links out of the repository (http, mailto) are not followed."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_anchors_are_made_as_a_renderer_makes_them(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# The runtime\n## On GPUs: `--device` and **NCCL**\n```sh\n# not a heading\n```\n"
                    "## Limits\n## Limits\n### [A link](x.md) here, 2.5x\n", encoding="utf-8")
    assert anchors(page) == {"the-runtime", "on-gpus---device-and-nccl", "limits", "limits-1", "a-link-here-25x"}


def test_the_pages_show_no_placeholder_commands() -> None:
    """A command a page shows is whole: no '...' standing for options, every fence marked with what it holds."""
    for page in PAGES:
        for block in blocks(page):
            assert block.info in ("sh", "python", "python fragment", "", "text"), f"{block.id}: ```{block.info}"
            if block.info == "sh":
                for argv in commands(block.body):
                    assert "..." not in argv, f"{block.id}: {shlex.join(argv)}"


@pytest.mark.parametrize(("argv", "factor", "expected"), [
    (["train", "--hidden", "256", "--seq", "128", "--steps", "100", "--checkpoint-every", "10"], 50,
     ["train", "--hidden", "64", "--seq", "64", "--steps", "2", "--checkpoint-every", "1"]),
    (["train", "--steps", "2000", "--resume", "ckpt/step-00000500"], 500,
     ["train", "--steps", "4", "--resume", "ckpt/step-00000001"]),
    (["train", "--hf", "gpt2", "--hidden", "768"], 1, ["train", "--hf", "gpt2", "--hidden", "768", "--steps", "2"]),
    (["train", "--hidden", "64", "--heads", "4"], 1, ["train", "--hidden", "64", "--heads", "4", "--steps", "2"]),
    (["simulate", "1f1b", "--steps", "9"], 3, ["simulate", "1f1b", "--steps", "9"]),
    (["profile", "--hidden", "256", "--seq", "256"], 1, ["profile", "--hidden", "64", "--seq", "64", "--quick"]),
    (["profile", "--quick"], 1, ["profile", "--quick"]),
])
def test_the_setting_scales_only_sizes_and_steps(argv: list[str], factor: float, expected: list[str]) -> None:
    assert shrink(argv, factor) == expected


@pytest.mark.parametrize(("argv", "options", "expected"), [
    (["benchmarks/b.py", "--steps", "20"], 'add_argument("--steps", type=int, default=3)\n',
     ["benchmarks/b.py", "--steps", "2"]),
    (["benchmarks/b.py", "--steps", "1", "--runs", "5"], "", ["benchmarks/b.py", "--steps", "1", "--runs", "1"]),
    (["benchmarks/b.py"], 'add_argument("--hidden", type=int, default=HIDDEN)\nadd_argument("--steps", default=3)\n'
     'add_argument("--seq", type=int, default=32)\n', ["benchmarks/b.py", "--steps", "2", "--hidden", "64"]),
    (["-c", "--steps", "20"], "", ["-c", "--steps", "20"]),
    (["benchmarks/b.py", "--block", "--times", "60"], "", ["benchmarks/b.py", "--block", "--times", "2"]),
    (["benchmarks/b.py", "--beside", "12"], "", ["benchmarks/b.py", "--beside", "2"]),
    (["benchmarks/b.py"], 'add_argument("--times", type=int, default=20)\n', ["benchmarks/b.py", "--times", "2"]),
])
def test_the_setting_shrinks_a_benchmark(argv: list[str], options: str, expected: list[str]) -> None:
    assert shrink_benchmark(argv, options) == expected


def test_the_benchmarks_the_pages_run_take_the_options_the_setting_gives() -> None:
    for argv in (["benchmarks/vs_torch.py", "--steps", "20"], ["benchmarks/bench_offload.py"]):
        shrunk = shrink_benchmark(argv)
        assert "--hidden" in shrunk and "--steps" in shrunk, shrunk
    shrunk = shrink_benchmark(["benchmarks/pass_overhead.py"])  # 15 rounds of 200 calls of 5 ways: 19 s as written
    assert shrunk[shrunk.index("--rounds") + 1] == "2" and shrunk[shrunk.index("--reps") + 1] == "20", shrunk


def test_a_block_inside_a_list_item_is_found_and_read_without_its_indent(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("- a point:\n\n  ```sh\n  pipefold a --x 1\n    --y\n  ```\n\n"
                    "```python\nif True:\n    print(1)\n```\n", encoding="utf-8")
    found = blocks(page)
    assert [(b.info, b.body) for b in found] == [("sh", "pipefold a --x 1\n  --y\n"),
                                                 ("python", "if True:\n    print(1)\n")]


def test_commands_are_read_as_a_shell_reads_them() -> None:
    body = ("pipefold a --x 1   # a comment\n"
            "pipefold b \\\n    --y 2\n"
            "# only a comment\n"
            "python -c '\nimport sys  # kept: inside the quotes\nprint(1)\n'\n")
    assert commands(body) == [["pipefold", "a", "--x", "1"], ["pipefold", "b", "--y", "2"],
                              ["python", "-c", "\nimport sys  # kept: inside the quotes\nprint(1)\n"]]


def test_every_runnable_block_is_found() -> None:
    """The reader sees the blocks a page has (counted here by a second, plain reading of the fences)."""
    for page in PAGES:
        fences = [line for line in page.read_text(encoding="utf-8").splitlines() if re.match(r"\s*```", line)]
        assert len(fences) == 2 * len(blocks(page)), page
    assert sum(len(commands(b.body)) for p in PAGES for b in blocks(p) if b.info == "sh") > 60
    assert shutil.which("make") is not None


@pytest.mark.parametrize(("command", "key"), [
    ("pipefold train --schedule zb-v --devices 2 --model mlp --check", "pipefold train --schedule zb-v --devices 2 "
     "--model mlp --check --steps 2"),
    ("torchrun --nproc-per-node 4 -m pipefold train --hidden 512", "torchrun --nproc-per-node 4 -m pipefold train "
     "--hidden 64 --steps 2"),
    ("pipefold train --trace run.json", "pipefold train --trace run.json --steps 2"),  # writes it: copied
    ("pipefold plan --profile prof.json -p 4 -o plan.json", "pipefold plan --profile prof.json -p 4 -o plan.json "
     "prof.json:{prof.json}"),  # reads the bytes it holds here
    ("pipefold train --hf llama --hf-config examples/my-llama.json", "pipefold train --hf llama --hf-config "
     "examples/my-llama.json --steps 2 examples/my-llama.json:{examples/my-llama.json}"),
    ("pipefold plan --profile missing.json -p 4", None),  # neither here nor written by it
    ("pipefold train --steps 200 --checkpoint-dir ckpt --resume", None),  # a folder
    ("OMP_NUM_THREADS=1 pipefold train", None),
    ("python benchmarks/p2p.py", None),
])
def test_a_command_runs_once_for_the_suite_when_it_reads_the_same_files(command: str, key: str | None,
                                                                          tmp_path: Path) -> None:
    import hashlib

    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "prof.json").write_text('{"layers": []}', encoding="utf-8")
    sums = {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
            for name in ("prof.json", "examples/my-llama.json")}
    if key is not None:
        for name, digest in sums.items():
            key = key.replace("{" + name + "}", digest)
    assert once_key(shlex.split(command), 1.0, tmp_path) == key
    if key is not None and "prof.json:" in key:  # other bytes in the file it reads: another command
        (tmp_path / "prof.json").write_text('{"layers": [1]}', encoding="utf-8")
        assert once_key(shlex.split(command), 1.0, tmp_path) not in (key, None)


def test_a_page_that_waits_gets_the_files_the_run_wrote(tmp_path: Path) -> None:
    runner, waiter = tmp_path / "README", tmp_path / "plan"
    for folder in (runner, waiter):
        (folder / "docs" / "figures").mkdir(parents=True)
        (folder / "examples").symlink_to(ROOT / "examples")
    (runner / "old.json").write_text("earlier", encoding="utf-8")
    first, second = _Once(tmp_path / "once"), _Once(tmp_path / "once")
    assert first.claim("pipefold profile -o prof.json", "README.md") is None
    before = _files(runner)
    (runner / "prof.json").write_text("profile", encoding="utf-8")  # what the command wrote
    (runner / "docs" / "figures" / "f.png").write_bytes(b"png")
    first.verdict("pipefold profile -o prof.json", None, runner, before)
    started = time.time()
    second.wait("pipefold profile -o prof.json", "README.md", waiter)
    assert (waiter / "prof.json").read_text(encoding="utf-8") == "profile"
    assert (waiter / "docs" / "figures" / "f.png").read_bytes() == b"png"
    assert not (waiter / "old.json").exists()  # there before the run: not the run's
    _check_written(["pipefold", "profile", "-o", "prof.json"], waiter, started)


def test_a_command_run_for_another_page_passes_on_its_verdict(tmp_path: Path) -> None:
    first, second = _Once(tmp_path), _Once(tmp_path)  # two pages, as two xdist workers see the folder
    assert first.claim("pipefold train", "README.md") is None
    assert second.claim("pipefold train", "docs/runtime.md") == "README.md"
    first.verdict("pipefold train", None)
    second.wait("pipefold train", "README.md")
    assert first.claim("pipefold schedules", "README.md") is None
    first.verdict("pipefold schedules", "AssertionError: exit 1")
    with pytest.raises(AssertionError, match="(?s)run for this page by README.md.*exit 1"):
        second.wait("pipefold schedules", "README.md")


def test_the_cli_reference_is_generated_from_the_parser() -> None:
    """docs/cli.md is the parser's own account of every command and option: written once, in the parser."""
    from pipefold.cli.reference import markdown

    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert page == markdown(), "docs/cli.md is stale: python -m pipefold.cli.reference > docs/cli.md"

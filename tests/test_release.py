"""The release installs: ``python -m build`` makes an sdist and a wheel, and the wheel, installed into a fresh
virtual environment outside the repository, runs the README's commands with the package data it ships.

How, and why so:

* The build runs on a copy of the project in a temporary folder (the checkout is never written to: other tests
  and people use it), with ``--no-isolation``: the ``build`` and ``setuptools`` of the ``test`` extra, so it needs
  no network and takes seconds. ``python -m build`` makes the sdist first and the wheel from the unpacked sdist,
  so a file the sdist leaves out is missing from the wheel too, and no stale ``build/`` folder can add one.
* The new environment is ``python -m venv --without-pip`` plus one ``.pth`` file naming this environment's
  site-packages, then ``pip install --no-deps`` of the wheel. Installing the dependencies for real would fetch or
  unpack torch (gigabytes, minutes); borrowing them keeps the test at tens of seconds and still tests what matters
  here: the ``pipefold`` that runs is the wheel's, in the new environment. A ``.pth`` line only adds a folder to
  ``sys.path``; the ``.pth`` files inside that folder (the editable install's, naming ``src/``) are not read, so
  the checkout's ``src`` is never importable there, and the new environment's own site-packages comes first.
* Every command runs from a folder outside the repository, with ``PYTHONPATH`` unset and the checkout's folders
  off ``PATH``, so that nothing can be read from the checkout by a relative path either.

One test does it all, in order: under pytest-xdist a module fixture would build once per worker.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

NOT_COPIED = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".*_cache", ".hypothesis",
              "gpu-report", "pipefold-timeline.png")
"""What the project's copy leaves out: environments, caches and the outputs of earlier builds and runs."""

SHIPPED_DATA = ("plan/clusters/h100-sxm.json", "models/hf_configs/llama3-8b.json")
"""Package data the commands below read (``--cluster h100-sxm --hf-config llama3-8b``)."""

COMMANDS = [
    ["plan", "--cluster", "h100-sxm", "--hf-config", "llama3-8b", "--global-batch", "64", "--seq", "2048",
     "--top", "1"],
    ["train", "--steps", "1", "--devices", "2", "--schedule", "1f1b", "--layers", "2", "--hidden", "16", "-m", "2",
     "--batch", "4"],
]
"""Commands that read what the package ships (a cluster file, a model config) or finds at run time (the gpt's
corpus: the standard library's source), beside the README's demo."""


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    got = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert got.returncode == 0, f"{argv} exited {got.returncode}\n{got.stdout[-4000:]}\n{got.stderr[-4000:]}"
    return got


def _outside_env(venv: Path) -> dict[str, str]:
    """The environment a user's shell gives the installed command: the new venv first on PATH, nothing of the
    checkout on it, no PYTHONPATH, no other virtual environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not Path(p).resolve().is_relative_to(ROOT)]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _package_files(src: Path) -> set[str]:
    """Every file of the package folder ``src/pipefold``, relative to ``src`` (caches and hidden files aside)."""
    return {p.relative_to(src).as_posix() for p in (src / "pipefold").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".") and p.suffix != ".pyc"}


def _demo_command() -> list[str]:
    """The README's demo: the command of the Makefile's ``demo`` target (what ``make demo`` runs)."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    m = re.search(r"^demo:.*\n\t\$\(BIN\)/(pipefold [^\n]*)$", makefile, re.MULTILINE)
    assert m is not None, "the Makefile's demo target no longer runs $(BIN)/pipefold"
    return m[1].split()


def test_the_wheel_installs_outside_the_repository_and_runs_with_its_own_data(tmp_path: Path) -> None:
    import pipefold

    assert not tmp_path.resolve().is_relative_to(ROOT), "the temporary folder must be outside the repository"
    took: dict[str, float] = {}
    started = time.monotonic()

    # Build the sdist and, from it, the wheel.
    project, dist = tmp_path / "project", tmp_path / "dist"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(project)], cwd=tmp_path,
         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    took["build"] = time.monotonic() - started
    version = pipefold.__version__
    wheel, sdist = dist / f"pipefold-{version}-py3-none-any.whl", dist / f"pipefold-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist.iterdir())

    # Both hold every file of the package: its modules and the data it reads at run time.
    package = _package_files(project / "src")
    assert {f"pipefold/{name}" for name in SHIPPED_DATA} <= package
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = {n for n in whl.namelist() if n.startswith("pipefold/")}
        entry_points = whl.read(f"pipefold-{version}.dist-info/entry_points.txt").decode()
    assert in_wheel == package, f"missing from the wheel: {sorted(package - in_wheel)}; " \
                                f"not in the package: {sorted(in_wheel - package)}"
    assert "pipefold = pipefold._entry:main" in entry_points
    top = f"pipefold-{version}/"
    with tarfile.open(sdist) as tar:
        in_sdist = {m.name.removeprefix(top) for m in tar.getmembers() if m.isfile()}
    missing = {f"src/{name}" for name in package} - in_sdist
    assert not missing, f"missing from the sdist: {sorted(missing)}"
    # ... and the rest of the project, so that its tests run from it.
    project_files = {"README.md", "CHANGELOG.md", "pyproject.toml", "MANIFEST.in", "Makefile",
                     "tests/conftest.py", "tests/test_release.py", "examples/profile.json", "docs/runtime.md"}
    assert project_files <= in_sdist, f"missing from the sdist: {sorted(project_files - in_sdist)}"

    # A fresh environment outside the repository, the dependencies borrowed from this one (see the docstring).
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=dict(os.environ))
    env = _outside_env(venv)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path, env=env).stdout.strip())
    assert site.is_relative_to(venv), site
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "_pipefold_test_dependencies.pth").write_text("".join(f"{p}\n" for p in ours), encoding="utf-8")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
          "--disable-pip-version-check", "--quiet", str(wheel)], cwd=tmp_path, env=env)
    took["install"] = time.monotonic() - started - sum(took.values())

    # The package imported there is the wheel's, with its data beside it.
    probe = ("import json, importlib.metadata as md, pipefold\n"
             "from pipefold.plan.cluster import shipped_clusters\n"
             "from pipefold.models.transformer import shipped_configs\n"
             "print(json.dumps({'file': pipefold.__file__, 'version': pipefold.__version__,\n"
             "    'dist': str(md.distribution('pipefold').locate_file('')), 'clusters': shipped_clusters(),\n"
             "    'configs': shipped_configs()}))\n")
    where = json.loads(_run([str(python), "-c", probe], cwd=tmp_path, env=env).stdout)
    assert Path(where["file"]).is_relative_to(site), where["file"]
    assert not Path(where["file"]).resolve().is_relative_to(ROOT), where["file"]
    assert Path(where["dist"]).resolve() == site.resolve(), where["dist"]
    assert where["version"] == version
    assert where["clusters"] == sorted(p.stem for p in (project / "src/pipefold/plan/clusters").glob("*.json"))
    assert where["configs"] == sorted(p.stem for p in (project / "src/pipefold/models/hf_configs").glob("*.json"))
    assert (venv / "bin" / "pipefold").read_text(encoding="utf-8").startswith(f"#!{python}")

    # The installed command, from a folder outside the repository.
    here = tmp_path / "elsewhere"
    here.mkdir()
    pipefold_bin = str(venv / "bin" / "pipefold")
    assert _run([pipefold_bin, "--version"], cwd=here, env=env).stdout.strip() == f"pipefold {version}"
    demo = _demo_command()
    _run([pipefold_bin, *demo[1:]], cwd=here, env=env)
    plot = here / demo[demo.index("--plot") + 1]
    assert plot.read_bytes().startswith(b"\x89PNG"), plot
    plan = _run([pipefold_bin, *COMMANDS[0]], cwd=here, env=env)
    assert plan.stdout.count("best: ") == 1, plan.stdout[-2000:]
    train = _run([pipefold_bin, *COMMANDS[1]], cwd=here, env=env)
    assert re.search(r"1f1b on 2 ranks, 2 microbatches, gpt with \d+ layers: loss [\d.]+ -> [\d.]+", train.stdout), \
        train.stdout[-2000:]
    took["commands"] = time.monotonic() - started - sum(took.values())
    print("took: " + ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))

"""The layering the project promises, checked on the import graph itself.

Every import statement of every module counts, the lazy ones inside functions and the type-only ones under
``TYPE_CHECKING`` included: a module may import from its own layer or from a layer below, never from one above,
and no modules import each other round in a circle. The layers, bottom up:

    base (errors, units, files, jsonout, _gc) < ir < schedules < sim < models < plan < runtime < train < cli

Besides the order: the models stand on the base alone (free of any parallelism), the runtime reads schedules only
through the IR, and the schedules, the simulator, the planner's pure parts and the figures load without torch.
"""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "pipefold"
LAYERS = ("base", "ir", "schedules", "sim", "models", "plan", "runtime", "train", "cli")
BASE = {"errors", "units", "files", "jsonout", "_gc"}


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text (``from a import b`` counts as ``a.b``
    where that is a module, else as ``a``; relative imports resolved). The root package is left out as a
    target: Python imports it first whatever is imported."""
    modules = {module_name(p, src): p for p in src.rglob("*.py")}
    root = src.name
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {m for m in found if m in modules and m not in (name, root)}
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "sim"  # the root package: what it re-exports (ir, schedules, the simulator)
    if parts[1] in BASE:
        return "base"
    if parts[1] in ("__main__", "_entry"):
        return "cli"  # ``python -m pipefold`` and the command's start-up
    return parts[1]


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets
            if LAYERS.index(layer(b)) > LAYERS.index(layer(a))}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


GRAPH = import_graph(SRC)


def test_every_module_sits_in_a_known_layer() -> None:
    assert {layer(m) for m in GRAPH} <= set(LAYERS)
    assert len(GRAPH) > 50


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    assert upward(GRAPH) == set()


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circles(GRAPH) == []


def _edges(source: str, *targets: str) -> set[tuple[str, str]]:
    return {(a, b) for a, bs in GRAPH.items() for b in bs if layer(a) == source and layer(b) in targets}


def test_the_models_stand_on_the_base_alone() -> None:
    assert _edges("models", *(set(LAYERS) - {"base", "models"})) == set()


def _runtime_folder(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "runtime":
        return None
    return parts[2] if parts[2] in ("launch", "measure") and len(parts) > 3 else "core"


def test_what_a_users_script_runs_stands_on_neither_launching_nor_measuring() -> None:
    """runtime/ (the public pipeline object and what it stands on) < runtime/launch/ < runtime/measure/: the
    public object's folder never imports launching or measuring, and launching never imports measuring."""
    order = ("core", "launch", "measure")
    edges = {(a, b) for a, targets in GRAPH.items() for b in targets
             if (fa := _runtime_folder(a)) and (fb := _runtime_folder(b)) and order.index(fb) > order.index(fa)}
    assert edges == set()


def test_the_runtime_reads_schedules_only_through_the_ir() -> None:
    assert _edges("runtime", "schedules") == set()


def test_the_architecture_drawing_shows_every_module_in_its_layer() -> None:
    """docs/architecture.md draws the layers top down, each folder with its modules in the second column: the
    same order as LAYERS, and every module of the package named in its own folder's rows."""
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    drawing = text.split("```text\n", 1)[1].split("```", 1)[0]
    named: dict[str, set[str]] = {}
    folder = ""
    for line in drawing.splitlines():
        if re.fullmatch(r"\w+/?", line[2:14].strip()):
            folder = line[2:14].strip().rstrip("/")
            named[folder] = set()
        named[folder] |= set(re.findall(r"\w+", line[14:40]))
    assert list(named) == list(reversed(LAYERS))
    for module in GRAPH:
        parts = module.split(".")[1:]
        if parts in ([], ["__main__"]) or SRC.joinpath(*parts).is_dir():
            continue  # the root package, ``python -m``, a folder's own package (runtime/launch/ too)
        assert parts[-1] in named[layer(module)], module


def test_schedules_simulator_planner_figures_and_the_command_line_load_without_torch() -> None:
    # The command line and a run's spec too: `pipefold train` starts the ranks' fork server (which imports torch) before
    # it imports torch itself, so that the two imports run on two cores.
    code = ("import sys, pipefold, pipefold.ir, pipefold.schedules, pipefold.sim.simulate, pipefold.schedules.blocks, "
            "pipefold.plan.budget, pipefold.sim.render, pipefold.cli.main, pipefold.train.spec, "
            "pipefold.runtime.launch.processes; pipefold.train.spec.RunSpec.flat(steps=2, optimizer='sgd'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------- the checker itself, on a made-up package


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    """pipefold-shaped: an upward lazy import, an upward type-only one, a relative one, a circle."""
    return _package(tmp_path / "pipefold", {
        "__init__.py": "from pipefold.sim.simulate import run\n",
        "errors.py": "",
        "ir/__init__.py": "from ..errors import E\n",
        "sim/__init__.py": "",
        "sim/simulate.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from pipefold.plan.budget import P\nfrom pipefold import ir\n"),
        "plan/__init__.py": "",
        "plan/budget.py": "def f():\n    from pipefold.train import run\n",
        "train/__init__.py": "",
        "train/run.py": "import pipefold.plan.budget\nfrom . import helper\n",
        "train/helper.py": "from .run import x\n",
    })


def test_the_checker_finds_lazy_type_only_and_relative_imports(toy: Path) -> None:
    graph = import_graph(toy)
    assert graph["pipefold.ir"] == {"pipefold.errors"}
    assert graph["pipefold.sim.simulate"] == {"pipefold.plan.budget", "pipefold.ir"}
    assert graph["pipefold.plan.budget"] == {"pipefold.train.run"}
    assert graph["pipefold.train.run"] == {"pipefold.plan.budget", "pipefold.train.helper"}
    assert upward(graph) == {("pipefold.sim.simulate", "pipefold.plan.budget"),
                             ("pipefold.plan.budget", "pipefold.train.run")}
    assert circles(graph) == [["pipefold.plan.budget", "pipefold.train.helper", "pipefold.train.run"]]


def test_a_layered_package_passes(toy: Path) -> None:
    _package(toy, {"sim/simulate.py": "from pipefold import ir\n",
                   "plan/budget.py": "from pipefold.sim import simulate\n", "train/helper.py": ""})
    graph = import_graph(toy)
    assert upward(graph) == set() and circles(graph) == []



def test_every_command_is_its_parser_entry_and_one_function() -> None:
    """A command takes two places: its parser entry and its ``cmd_<name>`` in one family's module; a function
    without a parser entry, or an entry without its function, is a mistake found here."""
    import argparse as ap
    import inspect

    from pipefold.cli.args import build_parser
    from pipefold.cli.main import FAMILIES, command

    sub = next(a for a in build_parser()._actions if isinstance(a, ap._SubParsersAction))
    names = set(sub.choices)
    functions = {name[4:] for module in FAMILIES for name, f in inspect.getmembers(module, inspect.isfunction)
                 if name.startswith("cmd_") and f.__module__ == module.__name__}
    assert functions == {n.replace("-", "_") for n in names}
    for name in names:
        assert command(name).__name__ == f"cmd_{name.replace('-', '_')}"

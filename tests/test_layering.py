"""The layering the project promises: schedules and the simulator never need torch; the library never needs the CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pipefold"


def test_schedules_simulator_planner_and_figures_load_without_torch() -> None:
    code = ("import sys, pipefold, pipefold.ir, pipefold.schedules, pipefold.simulate, pipefold.blocks, "
            "pipefold.plan, pipefold.render; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_library_never_imports_the_cli() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name in ("cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("pipefold.cli")]
    assert offenders == []


def test_the_runtime_reads_schedules_only_through_the_ir() -> None:
    for path in (SRC / "runtime").glob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m.startswith("pipefold.schedules") for m in modules), path.name

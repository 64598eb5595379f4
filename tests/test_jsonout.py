"""Strict JSON: no NaN or Infinity anywhere pipefold prints or writes JSON; null and a "nonfinite" list instead."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipefold import build, ir
from pipefold.cli.main import main
from pipefold.jsonout import NONFINITE, dumps


def strict(text: str) -> Any:
    """json.loads that refuses NaN, Infinity and -Infinity, as RFC 8259 (and jq, JSON.parse) do."""
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_strict_parser_refuses_what_json_dumps_writes() -> None:
    with pytest.raises(ValueError, match="NaN"):
        strict(json.dumps({"loss": math.nan}))


def test_non_finite_numbers_become_null_with_their_paths() -> None:
    summary = {"loss": [2.5, math.nan, math.inf], "cost": {"f": -math.inf, "b": 1.0}, "steps": 3, "ok": True,
               "name": "nan", "none": None, "nested": [[1.0, math.nan]]}
    out = strict(dumps(summary))
    assert out["loss"] == [2.5, None, None] and out["cost"] == {"f": None, "b": 1.0}
    assert out["nested"] == [[1.0, None]] and out["name"] == "nan" and out["none"] is None and out["ok"] is True
    assert out[NONFINITE] == ["loss[1]", "loss[2]", "cost.f", "nested[0][1]"]
    finite = {"loss": [1.0, 2.0]}
    assert strict(dumps(finite)) == finite  # no flag when every number is finite
    rows = [{"a": math.nan}, {"a": 1.0}, 3.0]
    assert strict(dumps(rows)) == [{"a": None, NONFINITE: ["a"]}, {"a": 1.0}, 3.0]


def test_cli_json_of_a_schedule_with_an_infinite_option(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # 1e999 is a valid JSON number that Python reads as infinity; it used to come back out as bare Infinity.
    text = ir.dumps(build("1f1b", 2, 4), "json").replace('"options": {}', '"options": {"weight": 1e999}')
    path = tmp_path / "inf.json"
    path.write_text(text)
    assert main(["simulate", str(path), "--json"]) == 0
    out = strict(capsys.readouterr().out)
    assert out["options"] == {"weight": None} and out[NONFINITE] == ["options.weight"]
    assert out["makespan"] == (4 + 2 - 1) * 3  # the rest as usual: 1F1B's (m + p - 1)(F + B + W)
    copy = tmp_path / "copy.json"  # a schedule file written from it: strict too, and it reads back
    assert main(["generate", str(path), "-o", str(copy)]) == 0
    written = strict(copy.read_text())
    assert written["options"] == {"weight": None} and written[NONFINITE] == ["options.weight"]
    capsys.readouterr()
    assert main(["simulate", str(copy), "--json"]) == 0
    assert strict(capsys.readouterr().out)["makespan"] == 15


def test_written_json_files_are_strict(tmp_path: Path) -> None:
    from pipefold.files import write_json

    path = tmp_path / "x.json"
    write_json(path, {"t": [math.inf]}, indent=1)
    assert strict(path.read_text()) == {"t": [None], NONFINITE: ["t[0]"]}

"""benchmarks/vs_torch_library.py in its smallest mode: pipefold's Pipeline and torch.distributed.pipelining run the
same loop on the same weights and data, so their losses must agree; the report must have its fields."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import Servers

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "vs_torch_library.py"


def test_the_two_libraries_agree_on_1f1b_and_zb_v(tmp_path: Path, servers: Servers) -> None:
    out = tmp_path / "report.json"
    # As ``python`` runs the script, in the worker's command server (conftest.Server): torch imported once.
    got = servers.get().run([str(SCRIPT), "--schedules", "1f1b", "zb-v", "--rounds", "1", "--steps", "2", "--hidden",
                             "32", "--layers", "4", "--batch", "8", "--microbatches", "4", "--json", str(out)],
                            tmp_path, script=True)
    assert "Traceback" not in got.stderr, got.stderr[-3000:]
    assert got.returncode == 0, f"exit {got.returncode}\n{got.stdout[-2000:]}\n{got.stderr[-2000:]}"
    assert "| 1f1b |" in got.stdout and "| zb-v |" in got.stdout
    report = json.loads(out.read_text())
    assert report["loop_lines"]["pipefold"] > 0 and report["loop_lines"]["torch"] > 0
    assert report["only_pipefold"] == []
    rows = {r["schedule"]: r for r in report["schedules"]}
    assert sorted(rows) == ["1f1b", "zb-v"]
    for name, row in rows.items():
        assert row["errors"] == {}, (name, row["errors"])
        assert row["losses_agree"], (name, row["losses"])
        assert row["loss_max_rel_diff"] is not None and row["loss_max_rel_diff"] <= 1e-5
        assert len(row["losses"]["pipefold"]) == 2 and None not in row["losses"]["pipefold"]
        for key in ("ratio", "pipefold_ms", "torch_ms"):
            assert set(row[key]) == {"median", "min", "max"} and row[key]["median"] > 0, (name, key, row[key])
        for side in ("pipefold", "torch"):
            mem = row["memory"][side]
            assert mem["errors"] == [], (name, side, mem["errors"])
            assert len(mem["tensors_mib"]) == 2 and all(v > 0 for v in mem["tensors_mib"])
            assert len(mem["rss_rise_mib"]) == 2


def test_a_bad_option_is_one_line_and_exit_2(tmp_path: Path, servers: Servers) -> None:
    for args in (["--schedules", "nope"], ["--steps", "1"], ["--batch", "7"], ["--layers", "3"]):
        # As ``python`` runs the script, in the worker's command server (conftest.Server): torch imported once.
        got = servers.get().run([str(SCRIPT), *args], tmp_path, script=True)
        assert got.returncode == 2, (args, got.stderr)
        assert len(got.stderr.strip().splitlines()) == 1 and "error:" in got.stderr, (args, got.stderr)

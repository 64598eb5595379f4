"""The example files the README and docs name are shipped, and their commands take them as written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _documented(name: str) -> list[str]:
    """Every command of a ```sh block in the README and docs/ that names ``name`` (a command continued over
    lines with a backslash as one line)."""
    lines = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        block, command = False, ""
        for line in doc.read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                block, command = line.strip() == "```sh", ""
            elif block:
                command += line.strip()
                if command.endswith("\\"):
                    command = command[:-1] + " "
                    continue
                if name in command:
                    lines.append(command)
                command = ""
    return lines


@pytest.mark.parametrize("name", ["examples/my-llama.json", "examples/profile.json"])
def test_every_example_file_the_docs_name_is_shipped(name: str) -> None:
    assert _documented(name), f"no command names {name}"
    assert (ROOT / name).is_file()


def test_the_network_profile_loads_and_simulates_as_written() -> None:
    from pipefold.sim.network import parse_network

    net = parse_network(str(ROOT / "examples/profile.json"))
    assert net.conditions(0, 1).states  # a profile, not a constant
    line = next(line for line in _documented("examples/profile.json") if line.startswith("pipefold simulate"))
    argv = line.split("#")[0].split()[1:]
    got = subprocess.run([sys.executable, "-m", "pipefold", *argv, "--json"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=False)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["makespan"] > 0


def test_the_llama_config_is_read_with_its_own_sizes() -> None:
    pytest.importorskip("transformers", reason="Hugging Face models need transformers: pip install 'pipefold[hf]'")
    from pipefold.models import make_model

    model = make_model("llama", layers=None, hidden=None, heads=None, seq=32, batch=4, seed=0,
                       config=str(ROOT / "examples/my-llama.json"))
    shape = model.size()
    assert (model.num_layers, shape.hidden, shape.heads) == (4 + 2, 128, 8)
    assert shape.params == sum(p.numel() for layer in model.build() for p in layer.parameters())


def test_the_torch_csv_is_the_one_torch_computes() -> None:
    """examples/torch-1f1b.csv is Schedule1F1B's own order (4 ranks, 8 microbatches), made again here from torch."""
    import csv
    import io
    import logging
    import types

    torch = pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules

    stage = types.SimpleNamespace(group_size=4, group_rank=0, num_stages=4, submod=torch.nn.Identity(),
                                  stage_index=0)
    logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.ERROR)
    order = schedules.Schedule1F1B(stage, n_microbatches=8, loss_fn=lambda out, target: out).pipeline_order
    text = io.StringIO()
    writer = csv.writer(text)  # as torch's own _dump_csv writes pipeline_order
    for rank in order:
        writer.writerow(order[rank])
    assert (ROOT / "examples/torch-1f1b.csv").read_text(encoding="utf-8") == text.getvalue().replace("\r\n", "\n")

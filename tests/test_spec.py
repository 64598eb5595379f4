"""The run spec: one value per run, built from what was given, checked once.

Checked against independent sources: the command line's own parser (every option of ``pipefold train`` is a setting
or an output, with the same default), every rule of the honoured-or-refused table tried with each of its options
(the library and the command line refuse in the same words), and the job the spec becomes (the sections the ranks
read are the spec's own objects).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pipefold.cli.args import build_parser
from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.runtime.launch.settings import Optimizer
from pipefold.train.spec import _OPTIONS, RULES, SETTINGS, RunSpec

OUTPUTS = {"json", "plot", "trace", "hf", "help"}
"""Options of ``pipefold train`` that say what to show, not what to run (``--hf`` names the model as ``--model``)."""


def _train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _options() -> dict[str, argparse.Action]:
    return {a.dest: a for a in _train_parser()._actions if a.option_strings and a.help != argparse.SUPPRESS}


def test_every_option_of_train_is_a_setting_with_the_same_default() -> None:
    options = _options()
    assert set(options) - OUTPUTS == set(SETTINGS), "an option the run spec lacks, or a setting no option sets"
    spec = RunSpec().settings()
    for name in SETTINGS:
        assert options[name].default == spec[name], name  # what --help says is what the spec takes
        assert _OPTIONS[name] in options[name].option_strings, name  # the spec names the option as it is typed


def _offending(name: str) -> object:
    """A value other than the default of setting ``name``, valid on its own."""
    values = {"damping": 0.2, "ema": 0.5, "fill_bubbles": True, "adapt_every": 3, "heads": 2, "seq": 32,
              "data": "corpus.txt", "dp": 2, "tp": 2, "fsdp": True, "zero1": True, "keep_last": 2,
              "checkpoint_every": 2,
              "schedule": "1f1b", "devices": 2, "microbatches": 4, "model": "mlp", "model_config": "gpt2-tiny",
              "layers": 6, "hidden": 32, "batch": 32, "optimizer": "sgd", "partition": "even", "recompute": "full",
              "memory_budget": "1GB", "offload": "2,1", "network": "constant:bandwidth=50MB", "netns": True,
              "offload_activations": 0.5, "state_chunks": True, "chunk_size": "4MB", "sequence_parallel": True,
              "cp": 2, "vocab_size": 1024, "kfac_distribution": "d-kfac", "moe": "experts=4", "ep": 2,
              "ep_overlap": True}
    return values[name]


def _where_it_does_not_apply(rule_index: int) -> dict[str, object]:
    """Settings that put the run in a mode where rule ``rule_index``'s options do not apply."""
    return [{"optimizer": "adamw"}, {"optimizer": "kfac"}, {"schedule": "1f1b"}, {"dp": 2},
            {"model": "mlp", "layers": 4, "batch": 8}, {"plan": "p.json"}, {}, {}, {"plan": "p.json"},
            {"schedule": "auto"}, {"optimizer": "kfac"}, {"offload": "2,1"},
            {}, {"plan": "p.json"}, {"tp": (2, 1), "devices": 2}, {"optimizer": "kfac"},
            {"dtype": "bf16", "master_weights": True, "dp": 2, "zero1": True},
            {"recompute": "auto", "memory_budget": "1GB"}, {"checkpoint_dir": "ck"},
            {"plan": "p.json"}, {}][rule_index]


@pytest.mark.parametrize(("index", "name"), [(i, name) for i, rule in enumerate(RULES) for name in rule.options])
def test_every_rule_refuses_each_of_its_options_in_one_line(index: int, name: str) -> None:
    """Each option of each rule, given where it does not apply, is refused in the rule's words, naming the option
    as it is typed; the same settings where it applies are not refused by that rule."""
    settings = {**_where_it_does_not_apply(index), name: _offending(name)}
    with pytest.raises(ConfigError) as info:
        RunSpec.flat(**settings)
    assert str(info.value) == RULES[index].message.format(option=_OPTIONS[name])


def test_the_command_line_and_the_library_refuse_alike(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as info:
        RunSpec.flat(model="mlp", seq=32)
    assert main(["train", "--model", "mlp", "--seq", "32"]) == 2
    assert capsys.readouterr().err == f"pipefold train: error: {info.value}\n"


def test_given_is_what_differs_from_the_defaults_and_flat_round_trips() -> None:
    spec = RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, model="mlp", layers=4, batch=8, lr=0.5)
    assert spec.given() == {"schedule", "devices", "microbatches", "model", "layers", "batch", "lr"}
    assert RunSpec.flat(**spec.settings()) == spec
    assert spec.replace(lr=1e-3) == RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, model="mlp", layers=4,
                                                 batch=8)
    with pytest.raises(TypeError, match="a run has no setting 'learning_rate'"):
        RunSpec.flat(learning_rate=0.1)


def test_text_forms_are_read_once_when_the_spec_is_made(tmp_path) -> None:
    from pipefold import schedules
    from pipefold.ir import load, save

    spec = RunSpec.flat(memory_budget="64MB", offload="2,1", schedule="kfkb:k=2", devices=2, microbatches=4, batch=8)
    assert spec.memory.budget == 64e6 and spec.memory.offloaded == (2, 1)
    assert spec.schedule.built == schedules.build("kfkb", 2, 4, k=2)
    path = tmp_path / "mine.json"
    for suffix in (".json", ".CSV", ".txt"):  # a pathlib.Path, as a library user passes one, in every format
        save(schedules.build("1f1b", 2, 4), path.with_suffix(suffix))
        assert load(path.with_suffix(suffix)).actions == schedules.build("1f1b", 2, 4).actions
    from_file = RunSpec.flat(schedule=str(path), batch=8)
    assert (from_file.schedule.devices, from_file.schedule.microbatches) == (2, 4)  # the file's shape
    with pytest.raises(ConfigError, match=r"runs on 2 devices with 4 microbatches: drop --devices 3"):
        RunSpec.flat(schedule=str(path), devices=3, batch=8)


def test_the_job_carries_the_specs_sections_unchanged() -> None:
    from pipefold.train.prepare import make_job

    spec = RunSpec.flat(schedule="1f1b", devices=2, microbatches=2, model="mlp", layers=2, hidden=8, batch=4,
                        partition="even", optimizer="sgd", lr=0.05, clip=2.0, max_bad_steps=5, device="cpu")
    job = make_job(spec)
    assert job.optimizer is spec.optimizer and job.parallel is spec.parallel
    assert job.reliability is spec.reliability and job.devices is spec.devices
    assert job.optimizer == Optimizer(name="sgd", lr=0.05, clip=2.0)
    assert dataclasses.replace(spec.optimizer) == job.optimizer

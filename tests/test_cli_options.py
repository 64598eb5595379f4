"""Every option of every command, against the table of which options go with which modes and the table of numeric
ranges: an option either changes what a command does in a mode or is refused there in one line (never accepted and
ignored), and a number outside its range is refused when parsed, in one line that says what works, negative numbers
included. One process runs each command in-process, many times."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipefold.cli import ranges
from pipefold.cli.args import APPLIES, build_parser, check_applies, given
from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.plan.profile import LayerProfile, Profile

CLUSTER = ["--cluster", "h100-sxm", "--nodes", "1", "--hf-config", "llama-tiny", "--global-batch", "8", "--seq", "16",
           "--families", "1f1b,zb-h1"]
CLUSTER_MOE = [*CLUSTER[:5], "mixtral-tiny", *CLUSTER[6:]]
"""A cluster plan of a model with experts: the options that price them change it."""

MODES: dict[str, dict[str, list[str]]] = {
    "plan": {"memory": ["--memory", "3"], "profile": ["--profile", "{profile}", "--memory-budget", "4MB"],
             "cluster": CLUSTER, "cluster-moe": CLUSTER_MOE},
    "calibrate": {"cpu": ["--cluster", "h100-sxm", "--device", "cpu", "--largest", "1e6"]},
    "simulate": {"plain": [], "network": ["--network", "preempt:seed=1,idle=1e6,busy=1e3,on=0.5,off=0.5",
                                          "--activation-bytes", "1000"],
                 "fsdp": ["--dp", "2", "--fsdp", "--grad-bytes", "100", "--bandwidth", "10"]},
    "pipefisher": {"fill": [], "inline": ["--inline"]},
    "bagpipe": {"small": ["--steps", "4", "--rows", "300", "--tables", "2", "--batch", "16", "--cache", "0.2",
                          "--lookahead", "2"]},
}
"""Each command's modes, as the options that select them."""

SAMPLES: dict[str, list[str]] = {
    "devices": ["-p", "2"], "microbatches": ["-m", "4"], "memory": ["--memory", "2.5"],
    "f": ["--f", "2"], "b": ["--b", "2"], "w": ["--w", "0.5"], "mem": ["--mem", "0.8"], "mem_w": ["--mem-w", "0.5"],
    "latency": ["--latency", "0.5"], "bandwidth": ["--bandwidth", "10", "--activation-bytes", "100"],
    "activation_bytes": ["--activation-bytes", "100", "--bandwidth", "10"],
    "grad_bytes": ["--grad-bytes", "100", "--bandwidth", "10"], "opt": ["--opt", "1"], "weights": ["--weights", "1"],
    "overlap": ["--overlap"], "recompute": ["--recompute", "0.5"], "stage_cost": ["--stage-cost", "0:2,2,2"],
    "vocab_cost": ["--vocab-cost", "0.6,0.6,0.6,0.5"], "opt_vocab": ["--vocab", "1"],
    "exchange": ["--exchange", "0.5,0.5"], "exchange_overlap": ["--exchange-overlap", "--exchange", "0.5,0.5"],
    "opt_combined": ["--combined", "1"],
    "work": ["--work", "KA=0.5,KG=0.5,KI=2,KP=1"], "stash": ["--stash", "KA=1", "--work", "KA=0.5"],
    "profile": ["--profile", "{profile}"], "memory_budget": ["--memory-budget", "3MB"],
    "output": ["-o", "{tmp}/out.json"], "headroom": ["--headroom", "0.5"], "families": ["--families", "1f1b,gpipe"],
    "world": ["--world", "4"], "cluster": ["--cluster", "a100-80gb"], "nodes": ["--nodes", "2"],
    "cluster_model": ["--hf-config", "gpt2-tiny"], "global_batch": ["--global-batch", "16"], "seq": ["--seq", "32"],
    "top": ["--top", "1"], "plot": ["--plot", "{tmp}/figure.png"], "trace": ["--trace", "{tmp}/trace.json"],
    "dtype": ["--dtype", "fp32"], "device": ["--device", "cpu"], "largest": ["--largest", "1e7"],
    "at": ["--at", "0.5"], "network": ["--network", "constant:latency=0.5,bandwidth=1e6"],
    "dp": ["--dp", "2", "--grad-bytes", "100", "--bandwidth", "10"],
    "fsdp": ["--fsdp", "--dp", "2", "--weights", "1"], "gathered": ["--gathered", "1"], "width": ["--width", "24"],
    "slack": ["--slack", "0.5"], "max_steps": ["--max-steps", "1"], "inline": ["--inline"],
    "offload_time": ["--offload-time", "0.5"], "offloadable": ["--offloadable", "0.5"],
    "offload_activations": ["--offload-activations", "0.5"], "offload_fit": ["--offload-fit", "2"],
    "allow_offload": ["--allow-offload"], "state_chunks": ["--state-chunks"],
    "no_sequence_parallel": ["--no-sequence-parallel"], "cp": ["--cp", "1,2"], "seq_chunks": ["--seq-chunks", "1,2"],
    "split_vocab": ["--split-vocab"], "ep": ["--ep", "1,2"], "moe_imbalance": ["--moe-imbalance", "2"],
    "node_limit": ["--node-limit", "1", "--nodes", "2"],
    "policy": ["--policy", "lru"], "lookahead": ["--lookahead", "3"], "cache": ["--cache", "0.3"],
    "ahead": ["--ahead", "2"], "skew": ["--skew", "0.5"], "steps": ["--steps", "3"], "tables": ["--tables", "3"],
    "rows": ["--rows", "400"], "dim": ["--dim", "8"], "batch": ["--batch", "8"], "trainers": ["--trainers", "2"],
    "lr": ["--lr", "0.5"], "seed": ["--seed", "1"], "server_memory": ["--server-memory", "1GB"],
    "netns": ["--netns", "--network", "constant:latency=0,bandwidth=2MB"],
}
"""A value of each option other than its default (with what it needs to show: a bandwidth needs bytes to carry)."""

NO_EFFECT_IN_JSON = {"json", "input_format", "renumber", "stages"}
"""Options with no sample: how the output is printed, or how a schedule file is read (none is read here)."""

def _replicas_pay_their_all_reduce() -> bool:
    """plan --memory --grad-bytes: only the schedules that hold a stage twice (chimera, dualpipe) all-reduce, and at
    the default shape none of them is on the frontier the output shows; they are evaluated with it all the same."""
    from pipefold.plan.budget import plan
    from pipefold.sim.simulate import CostModel

    plain = {(p.spec, p.makespan) for p in plan(4, 8, 3, CostModel(bandwidth=10)).points}
    paid = {(p.spec, p.makespan) for p in plan(4, 8, 3, CostModel(bandwidth=10, grad_bytes=100)).points}
    return any(spec.startswith(("chimera", "dualpipe")) for spec, _ in paid - plain)


UNSEEN = {("plan", "memory", "grad_bytes"): _replicas_pay_their_all_reduce}
"""Options that change what a mode computes but not what it prints at the test's shape: each with its own check."""

TEXT_ONLY = {"width"}
"""Options of the printed text alone (refused with --json)."""

WRITES = {"output", "plot", "trace"}
"""Options whose effect is a file."""


def _profile(path: Path) -> str:
    layers = [LayerProfile(f=1e-4, b=1e-5, w=2e-4, held=1000, held_w=500, params=40_000, out=8192)]
    layers += [LayerProfile(f=2e-3, b=3e-3, w=2e-3, held=200_000, held_w=150_000, params=100_000, out=8192)
               for _ in range(6)]
    layers += [LayerProfile(f=1e-3, b=1e-3, w=5e-4, held=50_000, held_w=40_000, params=60_000, out=0)]
    prof = Profile(train={"model": "gpt", "layers": 6, "hidden": 32, "heads": 2, "seq": 16, "batch": 16,
                          "microbatches": 8, "optimizer": "adamw", "seed": 0},
                   layers=tuple(layers), latency=5e-5, bandwidth=2e9, contention=(1.0,) * 4, optimizer_factor=2.0)
    prof.save(str(path))
    return str(path)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _parsed(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.given = given(args, parser)
    return args


def _names_one_of(message: str, dests: frozenset[str]) -> bool:
    """Whether a refusal names one of the options given (``--mem-w ...``, ``schedule zb-h1 takes no
    option --k``)."""
    words = [w.strip(",:;") for w in message.split()]
    return any(w.startswith("--") and w[2:].replace("-", "_") in dests | {d[4:] for d in dests} for w in words)


def _stable(out: dict[str, Any]) -> dict[str, Any]:
    """A command's JSON without what differs from run to run (times measured, seconds taken, paths of files)."""
    drop = {"seconds", "tflops_per_s", "fraction", "output", "plot", "trace", "cost"}  # "cost": the options echoed
    return {k: _stable(v) if isinstance(v, dict) else v for k, v in out.items() if k not in drop}


@pytest.mark.parametrize(("command", "mode"), [(c, m) for c, modes in MODES.items() for m in modes])
def test_every_option_changes_what_its_mode_does_or_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                               command: str, mode: str) -> None:
    fill = {"profile": _profile(tmp_path / "profile.json"), "tmp": str(tmp_path)}
    commands = _subparsers(build_parser())
    checked = refused = 0
    selects = MODES[command][mode]
    options = [a for a in commands[command]._actions if a.option_strings and a.dest not in ("help",)]
    base = [command, *(x.format(**fill) for x in selects)]
    assert main([*base, "--json"]) == 0, (command, mode, capsys.readouterr().err)
    baseline = _stable(json.loads(capsys.readouterr().out))
    for action in options:
        if action.dest in NO_EFFECT_IN_JSON or any(s in selects for s in action.option_strings):
            continue
        # A schedule family's option (--k, --v, ...): given to the default schedule, which takes none.
        family = [action.option_strings[0], "2"] if action.dest[:4] == "opt_" else None
        sample = SAMPLES.get(action.dest, family)
        assert sample is not None, f"{command} --{action.dest}: give it a sample value in SAMPLES"
        argv = [*base, *(x.format(**fill) for x in sample)]
        given_here = _parsed(argv).given
        try:
            check_applies(_parsed(argv))
        except ConfigError as why:  # the table of modes refuses it before any work
            assert _names_one_of(str(why), given_here), (argv, why)
            _one_line(capsys, argv)
            refused += 1
            continue
        for target in ("out.json", "figure.png", "trace.json"):
            (tmp_path / target).unlink(missing_ok=True)
        text_only = action.dest in TEXT_ONLY  # what --json does not print: the text must change
        code = main(argv if text_only else [*argv, "--json"])
        captured = capsys.readouterr()
        if code == 2:  # refused by the command, once it knows the schedule: one line naming an option
            err = captured.err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"pipefold {command}: error: "), (argv, err)
            assert _names_one_of(err[0].split("error: ", 1)[1], given_here), (argv, err)
            refused += 1
            continue
        assert code == 0, (argv, captured.err)
        if text_only:
            assert main(base) == 0
            assert captured.out != capsys.readouterr().out, f"{argv}: accepted, and changes nothing"
        elif action.dest in WRITES:
            target = {"output": "out.json", "plot": "figure.png", "trace": "trace.json"}[action.dest]
            assert (tmp_path / target).stat().st_size > 0, argv
        elif (command, mode, action.dest) in UNSEEN:
            assert UNSEEN[command, mode, action.dest](), argv
        else:
            assert _stable(json.loads(captured.out)) != baseline, f"{argv}: accepted, and changes nothing"
        checked += 1
    assert checked >= 1 and checked + refused >= len(options) - len(selects) - 6, (checked, refused)


def test_the_modes_table_names_options_the_commands_have() -> None:
    commands = _subparsers(build_parser())
    for rule in APPLIES:
        dests = {a.dest for a in commands[rule.command]._actions}
        assert set(rule.options) <= dests, (rule.command, set(rule.options) - dests)


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pipefold {argv[0]}: error: "), (argv, err)
    return err[0]


POSITIONAL = {"compare": ["1f1b"], "validate": ["1f1b"], "generate": ["1f1b"], "calibrate": ["--cluster", "h100-sxm"]}
"""What a command needs besides its options."""


def test_every_number_outside_its_range_is_refused_when_parsed(capsys: pytest.CaptureFixture[str]) -> None:
    commands = _subparsers(build_parser())
    seen = 0
    for command, parser in commands.items():
        for action in parser._actions:
            rng = getattr(action.type, "range", None)
            if action.type in (int, float):
                pytest.fail(f"{command} --{action.dest} takes a number without a range")
            if rng is None:
                continue
            flag = max(action.option_strings, key=len)
            whole = rng.whole
            # Inside: both ends parse (the command's own checks may refuse a combination later).
            for inside in (rng.low if not rng.open_low else None, rng.high):
                if inside is not None:
                    text = str(int(inside)) if whole else repr(float(inside))
                    parsed = parser.parse_args([*POSITIONAL.get(command, []), flag, text])
                    assert getattr(parsed, action.dest) == (int(inside) if whole else float(inside))
            # Outside, and values that are no number a run can use: one line naming the range.
            outside = [str(int(rng.high) + 1) if whole else repr(rng.high * 10), "nan", "x", "1e400"]
            outside.append(str(int(rng.low) - 1) if whole else repr(rng.low - 1) if not rng.open_low else "0")
            for text in outside:
                if text == "1e400" and rng.unlimited:
                    continue  # inf: no limit
                line = _one_line(capsys, [command, *POSITIONAL.get(command, []), flag, text])
                assert f"argument {'/'.join(action.option_strings)}" in line or f"argument {flag}" in line, line
                assert rng.describe() in line, line
                seen += 1
    assert seen > 150


@pytest.mark.parametrize("argv", [
    ["train", "--offload", "-1,1"], ["train", "--tp", "-2"], ["train", "--lr", "-1e-3"], ["train", "--seed", "-1"],
    ["train", "--loss-scale", "-8", "--dtype", "fp16"], ["train", "--memory-budget", "-64MB"],
    ["simulate", "--stage-cost", "-1:1,1,1"], ["simulate", "--work", "KA=-1"], ["simulate", "--f", "-.5"],
    ["simulate", "--latency", "-inf"], ["plan", "--memory", "-3"], ["offload", "--budget", "-1e6"],
    ["profile", "--tp", "-1,2"], ["simulate", "--width", "-80"],
])
def test_a_negative_number_is_a_value_its_option_refuses(capsys: pytest.CaptureFixture[str],
                                                          argv: list[str]) -> None:
    line = _one_line(capsys, argv)
    assert "expected one argument" not in line and "unrecognized arguments" not in line, line


def test_ranges_describe_what_works() -> None:
    steps = ranges.RANGES["steps"]
    assert steps.describe() == "a whole number >= 1 and <= 10,000,000"
    assert ranges.RANGES["bandwidth"].parse("inf") == math.inf
    with pytest.raises(argparse.ArgumentTypeError, match="out of range"):
        ranges.RANGES["action_timeout"].parse("0")

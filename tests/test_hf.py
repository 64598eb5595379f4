"""Hugging Face causal LMs (GPT-2, LLaMA) as pipeline layers, against the unwrapped ``transformers`` model.

The reference is the model object ``transformers`` builds, called as a user calls it
(``model(input_ids=..., attention_mask=...).logits``), trained in one process on the whole batch with the loss
averaged over the microbatches as the runtime averages it. Batches carry padding masks (left- and right-padded
rows) and change their sequence length from step to step.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="Hugging Face models need transformers: pip install 'pipefold[hf]'")

from pipefold import schedules  # noqa: E402
from pipefold.errors import ConfigError  # noqa: E402
from pipefold.models import Batches, make_model, split_layers  # noqa: E402
from pipefold.models.hf import HFCausalLM, config_names, read_config  # noqa: E402
from pipefold.runtime.launch.job import Job
from pipefold.runtime.launch.local import run_local  # noqa: E402
from pipefold.runtime.launch.settings import Optimizer, Parallel  # noqa: E402

TOLERANCE = 1e-5
SEQS = (16, 24, 12)
"""Each step's sequence length: the ranks agree on new buffer shapes at steps 1 and 2."""


def _model(arch: str, *, blocks: int = 2, tie: bool | None = None, batch: int = 8, **extra: object) -> HFCausalLM:
    """A tiny model of the shipped config (width 64, vocab 256), dropout off."""
    config = {**read_config(arch, None), "num_hidden_layers": blocks, **extra}
    if tie is not None:
        config["tie_word_embeddings"] = tie
    tokens = torch.arange(1024, dtype=torch.uint8)  # unused: the jobs here read padded_batch
    return HFCausalLM(arch, config, Batches(tokens, batch, max(SEQS), seed=0), seed=3)


def padded_batch(step: int, rows: int = 8) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((ids, attention mask), targets) of step ``step``: even rows padded on the left, odd ones on the right,
    each with 1..T real tokens; padded positions have target -100 (not counted)."""
    g = torch.Generator().manual_seed(100 + step)
    t = SEQS[step % len(SEQS)]
    ids = torch.randint(0, 256, (rows, t), generator=g)
    targets = torch.randint(0, 256, (rows, t), generator=g)
    mask = torch.zeros(rows, t, dtype=torch.long)
    for r in range(rows):
        real = int(torch.randint(t // 2, t + 1, (1,), generator=g))
        if r % 2:
            mask[r, :real] = 1
        else:
            mask[r, t - real:] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return (ids, mask), targets.masked_fill(mask == 0, -100)


def _chain(layers: list[torch.nn.Module], xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    h: tuple[torch.Tensor, ...] = xs
    for layer in layers:
        out = layer(*h)
        h = out if isinstance(out, tuple) else (out,)
    return h[0]


def _hf_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def _reference(model: HFCausalLM, microbatches: int, steps: int, lr: float, grads_of_step: int):
    """The unwrapped transformers model trained with SGD in one process: per step the mean loss over the
    microbatches, the gradients of step ``grads_of_step`` and the final weights, each keyed by every name the
    pipeline gives it ("layer.parameter")."""
    hf = model.build_hf()
    names: dict[int, list[str]] = {}
    for i, layer in enumerate(model.wrap(hf)):
        for name, p in layer.named_parameters():
            names.setdefault(id(p), []).append(f"{i}.{name}")
    params = list(hf.parameters())
    assert {id(p) for p in params} == set(names)  # the layers run exactly the model's own parameters
    opt = torch.optim.SGD(params, lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        (ids, mask), y = padded_batch(step)
        total = 0.0
        for i, m, t in zip(ids.chunk(microbatches), mask.chunk(microbatches), y.chunk(microbatches), strict=True):
            loss = _hf_loss(hf(input_ids=i, attention_mask=m).logits, t)
            (loss / microbatches).backward()
            total += float(loss.detach()) / microbatches
        losses.append(total)
        if step == grads_of_step:
            grads = {n: p.grad.clone() for p in params for n in names[id(p)]}
        opt.step()
    weights = {n: p.detach().clone() for p in params for n in names[id(p)]}
    return losses, grads, weights


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max(float((got[n] - w).abs().max()) / (float(w.abs().max()) or 1.0) for n, w in want.items())


def _run(model: HFCausalLM, schedule: str, devices: int, *, steps: int = 3, lr: float = 0.1, optimizer: str = "sgd",
         **job: object):
    sched = schedules.build(schedule, devices, 2 * devices)
    return run_local(Job(schedule=sched, layer_stages=tuple(map(tuple, split_layers(model.num_layers, sched.stages))),
                         build_layers=model.build_layers, loss_fn=model.loss,
                         batch_at=functools.partial(padded_batch, rows=8), steps=steps,
                         optimizer=Optimizer(name=optimizer, lr=lr),
                         save_grads_of_step=1, save_weights=True, tied=model.tied, preload=model.preload,
                         **job))  # type: ignore[arg-type]


def _check_against_reference(model: HFCausalLM, reports, microbatches: int, *, lr: float = 0.1) -> None:
    losses, grads, weights = _reference(model, microbatches, len(SEQS), lr, grads_of_step=1)
    got_grads = {n: g for r in reports for n, g in (r.grads or {}).items()}
    got_weights = {n: w for r in reports for n, w in (r.weights or {}).items()}
    assert _rel(got_grads, grads) < TOLERANCE
    assert _rel(got_weights, weights) < TOLERANCE
    for step, want in enumerate(losses):
        mine = [v for r in reports for v in r.steps[step].losses.values()]
        assert len(mine) == microbatches and abs(sum(mine) / len(mine) - want) < TOLERANCE * abs(want)
    for tie in model.tied:  # every copy of a tied weight ends identical, bit for bit
        copies = [got_weights[f"{i}.{n}"] for i, n in tie]
        assert all(torch.equal(copies[0], c) for c in copies[1:])


# --------------------------------------------------------------------------- the model object, unchanged


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_layers_run_the_models_own_modules_and_match_its_forward(arch: str) -> None:
    model = _model(arch)
    hf = model.build_hf()
    assert type(hf).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                                 "mixtral": "MixtralForCausalLM"}[arch]
    layers = model.wrap(hf)
    assert len(layers) == model.num_layers == 4 and list(model.blocks) == [1, 2]
    own = {id(p) for p in hf.parameters()}
    assert {id(p) for layer in layers for p in layer.parameters()} == own
    (ids, mask), _ = padded_batch(0)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(_chain(layers, (ids, mask)), want)
        assert torch.equal(_chain(layers, (ids,)), hf(input_ids=ids).logits)
        # The mask is used: the left-padded rows' real tokens would otherwise attend to the padding.
        assert not torch.allclose(_chain(layers, (ids,)), want)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_a_layer_built_alone_has_the_weights_of_the_whole_model(arch: str) -> None:
    model = _model(arch, tie=True)
    whole = model.build()
    for i in range(model.num_layers):
        alone = model.build_layers([i])[i]
        assert [n for n, _ in alone.named_parameters()] == [n for n, _ in whole[i].named_parameters()]
        for (_, a), (_, b) in zip(alone.named_parameters(), whole[i].named_parameters(), strict=True):
            assert torch.equal(a, b)
    # The head built alone still starts from the embedding's weights (a tied weight is initialised by its holders).
    assert torch.equal(model.build_layers([3])[3].get_parameter("lm_head.weight"),
                       whole[0].get_parameter("wte.weight" if arch == "gpt2" else "embed_tokens.weight"))
    # GPT-2's own initialisation ran: residual projections scaled by 1/sqrt(2 * blocks).
    if arch == "gpt2":
        std = float(whole[1].get_parameter("block.attn.c_proj.weight").detach().std())
        assert abs(std - 0.02 / 2) < 0.002


def test_tied_weights_are_found_on_the_model() -> None:
    assert _model("gpt2").tied == (((0, "wte.weight"), (3, "lm_head.weight")),)
    assert _model("llama").tied == ()  # LLaMA's configs leave them untied by default
    assert _model("llama", tie=True).tied == (((0, "embed_tokens.weight"), (3, "lm_head.weight")),)
    hf = _model("gpt2").build_hf()
    assert hf.lm_head.weight is hf.transformer.wte.weight  # one parameter in the whole model


# --------------------------------------------------------------------------- pipelines against the unwrapped model


@pytest.mark.parametrize(("arch", "schedule", "devices", "tie"), [
    ("gpt2", "1f1b", 2, True),
    ("gpt2", "zb-h1", 4, True),
    ("llama", "zb-h1", 2, False),
    ("llama", "1f1b", 4, True),
    ("mixtral", "1f1b", 2, False),
    ("mixtral", "zb-h1", 4, True),
])
def test_pipeline_matches_the_unwrapped_model(arch: str, schedule: str, devices: int, tie: bool) -> None:
    model = _model(arch, blocks=2 * devices - 2, tie=tie)
    assert bool(model.tied) == tie
    _check_against_reference(model, _run(model, schedule, devices), 2 * devices)


@pytest.mark.parametrize(("arch", "schedule", "devices"), [("gpt2", "zb-v", 4), ("llama", "v-half", 2)])
def test_v_shape_sums_the_tied_copies_on_one_rank(arch: str, schedule: str, devices: int) -> None:
    # A V puts the first and the last stage on device 0: its two copies are summed there, no message.
    model = _model(arch, blocks=4 * devices - 2, tie=True)
    _check_against_reference(model, _run(model, schedule, devices), 2 * devices)


def test_replicated_stages_with_tied_weights() -> None:
    # Chimera: each of the 2 ranks holds both stages (one per replica); the replicas all-reduce first, then the
    # first holder of each stage adds its copy in.
    model = _model("gpt2", blocks=2)
    _check_against_reference(model, _run(model, "chimera", 2), 4)


def test_data_parallel_pipelines_with_tied_weights() -> None:
    # 2 pipelines x 2 devices: each pipeline sums its copies among its own ranks, after averaging across pipelines.
    from pipefold.schedules.dataparallel import with_data_parallel

    model = _model("gpt2", blocks=2)
    sched = with_data_parallel(schedules.build("1f1b", 2, 2))
    reports = run_local(Job(schedule=sched, layer_stages=((0, 1), (2, 3)), build_layers=model.build_layers,
                            loss_fn=model.loss, batch_at=padded_batch, steps=3, optimizer=Optimizer(name="sgd", lr=0.1),
                            parallel=Parallel(dp=2),
                            save_grads_of_step=1, save_weights=True, tied=model.tied, preload=model.preload))
    _check_against_reference(model, reports, 4)


@pytest.mark.parametrize("job", [{"offload": (1, 1)}, {"recompute": (2, 1)}], ids=["offload", "recompute"])
def test_offloaded_and_recomputed_stages(job: dict[str, object]) -> None:
    model = _model("gpt2", blocks=2)
    _check_against_reference(model, _run(model, "1f1b", 2, **job), 4)


def test_tied_copies_stay_identical_under_adamw() -> None:
    model = _model("llama", blocks=2, tie=True)
    reports = _run(model, "zb-h1", 2, optimizer="adamw", lr=1e-2)
    (i, a), (j, b) = model.tied[0]
    first, last = (next(r.weights[f"{k}.{n}"] for r in reports if f"{k}.{n}" in (r.weights or {}))
                   for k, n in ((i, a), (j, b)))
    assert torch.equal(first, last)
    assert not torch.equal(first, model.build()[0].get_parameter(a))  # they did move


# --------------------------------------------------------------------------- the command line


def test_train_command_with_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipefold.cli.main import main

    config = tmp_path / "small.json"
    config.write_text(json.dumps({**read_config("gpt2", None), "n_layer": 3, "n_embd": 32}))
    code = main(["train", "--hf", "gpt2", "--hf-config", str(config), "--devices", "2", "--schedule", "zb-h1",
                 "--microbatches", "2", "--batch", "4", "--seq", "16", "--steps", "2", "--check", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["model"] == "gpt2" and out["layers"] == 5
    assert out["max_grad_rel_diff"] < TOLERANCE and out["loss_rel_diff"] < TOLERANCE


def test_offload_command_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    from pipefold.cli.main import main

    assert main(["offload", "--hf", "llama", "--hf-config", "llama-tiny", "--batch", "2", "--seq", "16", "--train",
                 "--steps", "2", "--k", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["model"], out["layers"], out["peak_resident_layers"]) == ("llama", 6, 1)  # llama-tiny's blocks
    assert out["max_abs_diff"] == out["max_grad_diff"] == out["max_weight_diff"] == 0


@pytest.mark.parametrize(("argv", "expected"), [
    (["--hf-config", "nope"], "--hf-config 'nope' is neither a config pipefold ships (deepseek-v3, gpt2-tiny, "
                              "gpt3-175b, llama-tiny, "),
    (["--hf-config", "llama-tiny"], "config llama-tiny configures a 'llama' model, not 'gpt2': use --hf llama"),
    (["--hidden", "32"], "a Hugging Face model's shape comes from its config: drop --hidden"),
    (["--seq", "500"], "--seq 500 is longer than the config's max_position_embeddings 128"),
])
def test_command_line_errors_are_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    from pipefold.cli.main import main

    assert main(["partition", "--hf", "gpt2", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


def test_config_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="is not JSON"):
        read_config("gpt2", str(bad))
    bad.write_text("[1]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        read_config("gpt2", str(bad))
    bad.write_text(json.dumps({**read_config("gpt2", None), "vocab_size": 100}))
    with pytest.raises(ConfigError, match="vocab_size is 100"):
        make_model("gpt2", config=str(bad))
    with pytest.raises(ConfigError, match="--hf-config configures a Hugging Face model"):
        make_model("gpt", config="gpt2-tiny")
    assert config_names() == ["deepseek-v3", "gpt2-tiny", "gpt3-175b", "llama-tiny", "llama2-13b", "llama2-70b",
                              "llama3-70b", "llama3-8b", "llama3.1-405b", "megatron-530b",
                              "mixtral-8x7b", "mixtral-tiny"]  # the tiny ones train here; the rest plan clusters


def test_registry_names_the_command_line_choices() -> None:
    from pipefold.cli.args import build_parser
    from pipefold.models import REGISTRY

    choices = {a.dest: a.choices for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    assert choices["model"] == [n for n, f in REGISTRY.items() if not f.hf] == ["gpt", "mlp", "moe"]
    assert choices["hf"] == [n for n, f in REGISTRY.items() if f.hf] == ["gpt2", "llama", "mixtral"]


@pytest.mark.parametrize(("arch", "change", "message"), [
    ("gpt2", {"n_embd": 60, "n_head": 7}, "n_embd 60 is not a multiple of n_head 7"),
    ("gpt2", {"n_layer": -2}, "n_layer must be a whole number >= 1 (got -2)"),
    ("gpt2", {"n_head": 0}, "n_head must be a whole number >= 1"),
    ("llama", {"vocab_size": 2.5}, "vocab_size must be a whole number >= 1 (got 2.5)"),
    ("llama", {"num_attention_heads": 4, "num_key_value_heads": 3}, "is not a multiple of num_key_value_heads 3"),
    ("llama", {"intermediate_size": True}, "intermediate_size must be a whole number"),
])
def test_bad_config_sizes_are_one_line_before_transformers(tmp_path: Path, arch: str, change: dict[str, object],
                                                           message: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**read_config(arch, None), **change}))
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        read_config(arch, str(path))
    assert "\n" not in str(info.value)


def test_a_model_too_big_for_the_machine_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """The size check covers Hugging Face models through the model interface: their exact parameter count from
    the meta device (tied weights once), checked before any layer is built."""
    from pipefold.models.size import check_model, parameters

    small = make_model("gpt2", layers=None, hidden=None, heads=None, seq=16, batch=4, seed=0, config="gpt2-tiny")
    assert parameters(small.size()) == sum(p.numel() for p in {id(p): p for layer in small.build()
                                                                 for p in layer.parameters()}.values())
    path = tmp_path / "big.json"
    path.write_text(json.dumps({**read_config("gpt2", None), "n_embd": 8192, "n_layer": 48, "n_head": 64}))
    big = make_model("gpt2", layers=None, hidden=None, heads=None, seq=16, batch=4, seed=0, config=str(path))
    assert parameters(big.size()) > 3.8e10
    with pytest.raises(ConfigError, match="would need at least") as info:
        check_model(big, ranks=2, copies=5, available=16 * 2**30, what="training gpt2")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("argv", [["--cp", "2"], ["--schedule", "1f1b:seq_chunks=2"],
                                  ["--schedule", "zb-v:seq_chunks=2"]])
def test_a_llama_split_along_the_sequence_trains_as_one_process(capsys: pytest.CaptureFixture[str],
                                                                argv: list[str]) -> None:
    """LLaMA's blocks declare their attention and rotary positions (``HFBlock.attend``, ``HFBlock.positions``):
    each sequence split over cp copies (the ring), or cut into chunks (Seq1F1B), it has one process's loss and
    gradients; without the runtime's attention in the blocks the same runs are off by 1e-3 and more."""
    from pipefold.cli.main import main

    assert main(["train", "--hf", "llama", "--hf-config", "llama-tiny", "--devices", "2", "--microbatches", "2",
                 "--batch", "4", "--seq", "32", "--steps", "2", "--check", *argv]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("check against one process"))
    loss, grad = (float(x.split()[-1]) for x in line.split(":", 1)[1].split(","))
    assert loss < 1e-5 and grad < 1e-5, line


@pytest.mark.parametrize(("argv", "expected"), [
    (["--hf", "gpt2", "--cp", "2"], "--cp 2 splits the sequence, and the gpt2 model's positions are learned in its "
                                    "embedding"),
    (["--hf", "llama", "--seq", "30", "--schedule", "1f1b:seq_chunks=4"],
     "seq_chunks 4 cuts each sequence into equal chunks, and --seq 30 does not: give --seq a multiple of 4"),
    (["--hf", "llama", "--seq", "30", "--cp", "2"], "--cp 2 cuts each sequence into 2 x cp equal chunks"),
])
def test_a_split_a_hugging_face_model_cannot_run_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                             expected: str) -> None:
    from pipefold.cli.main import main

    config = "llama-tiny" if "llama" in argv else "gpt2-tiny"
    assert main(["train", *argv, "--hf-config", config, "--devices", "2", "--steps", "1"]) != 0
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err

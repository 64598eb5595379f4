"""Tests for the models: per-layer builds, forward passes against references, splits, corpus and batches."""

import math
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pipefold.errors import ConfigError
from pipefold.models import (
    Batches,
    GPTConfig,
    MLPConfig,
    build_gpt,
    build_gpt_layers,
    build_mlp,
    build_mlp_layers,
    gpt_loss,
    load_corpus,
    make_model,
    mlp_input,
    mlp_loss,
    mlp_target,
    split_layers,
)
from pipefold.models.data import _sources, stdlib_source

TINY = GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=16)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def _run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and text
    return text


# --------------------------------------------------------------------------- per-layer builds


@pytest.mark.parametrize("seed", [0, 1, 12345])
@pytest.mark.parametrize("indices", [[0], [2, 3], [TINY.num_layers - 1], [4, 0, 1]])
def test_gpt_subset_of_layers_has_the_full_models_weights(seed, indices):
    full = build_gpt(TINY, seed=seed)
    some = build_gpt_layers(TINY, indices, seed=seed)
    assert sorted(some) == sorted(indices)
    for i in indices:
        assert type(some[i]) is type(full[i])
        _assert_same_weights(some[i], full[i])


@pytest.mark.parametrize("seed", [0, 3, 99])
@pytest.mark.parametrize("indices", [[0], [5, 6, 7], [7, 2]])
def test_mlp_subset_of_layers_has_the_full_models_weights(seed, indices):
    cfg = MLPConfig(hidden=16, layers=8)
    full = build_mlp(cfg, seed=seed)
    some = build_mlp_layers(cfg, indices, seed=seed)
    for i in indices:
        _assert_same_weights(some[i], full[i])


def test_seeds_and_layers_draw_different_weights():
    a, b = build_gpt(TINY, seed=0), build_gpt(TINY, seed=1)
    assert not torch.equal(a[1].attn.c_attn.weight, b[1].attn.c_attn.weight)
    # Two identical blocks of one model must not be initialized to the same weights either.
    assert not torch.equal(a[1].attn.c_attn.weight, a[2].attn.c_attn.weight)
    m = build_mlp(MLPConfig(hidden=16, layers=2))
    assert not torch.equal(m[0].fc.weight, m[1].fc.weight)


def test_building_a_few_layers_never_allocates_the_whole_model():
    # 100k blocks of width 64 would be 20 GB of weights; building two layers must take neither the memory nor the time.
    cfg = GPTConfig(n_layer=100_000)
    layers = build_gpt_layers(cfg, [0, cfg.num_layers - 1])
    assert sorted(layers) == [0, cfg.num_layers - 1]
    assert all(p.device.type == "cpu" for layer in layers.values() for p in layer.parameters())


def test_gpt_init_is_nanogpts():
    cfg = GPTConfig(n_layer=8, n_embd=128, n_head=4)
    block = build_gpt_layers(cfg, [1], seed=0)[1]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)
    assert torch.equal(block.ln_1.weight, torch.ones(cfg.n_embd))
    assert torch.equal(block.attn.c_attn.bias, torch.zeros(3 * cfg.n_embd))


# --------------------------------------------------------------------------- forward passes


def _reference_gpt(layers, cfg: GPTConfig, idx: torch.Tensor) -> torch.Tensor:
    """The GPT written out by hand: explicit mask, softmax and per-head loop."""
    emb, *blocks, head = layers
    B, T = idx.shape
    C, hs = cfg.n_embd, cfg.n_embd // cfg.n_head
    x = emb.wte.weight[idx] + emb.wpe.weight[:T]  # (B, T, C)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for blk in blocks:
        h = F.layer_norm(x, (C,), blk.ln_1.weight, blk.ln_1.bias)
        qkv = h @ blk.attn.c_attn.weight.T + blk.attn.c_attn.bias  # features ordered (head, q/k/v, feature)
        heads = []
        for i in range(cfg.n_head):
            q, k, v = (qkv[..., (3 * i + j) * hs:(3 * i + j + 1) * hs] for j in range(3))
            att = q @ k.transpose(1, 2) / math.sqrt(hs)  # (B, T, T)
            heads.append(att.masked_fill(future, float("-inf")).softmax(-1) @ v)
        x = x + torch.cat(heads, dim=2) @ blk.attn.c_proj.weight.T + blk.attn.c_proj.bias
        h = F.layer_norm(x, (C,), blk.ln_2.weight, blk.ln_2.bias)
        h = F.gelu(h @ blk.mlp.c_fc.weight.T + blk.mlp.c_fc.bias)
        x = x + h @ blk.mlp.c_proj.weight.T + blk.mlp.c_proj.bias
    x = F.layer_norm(x, (C,), head.ln_f.weight, head.ln_f.bias)
    return x @ head.lm_head.weight.T


def _scramble(layers, seed: int) -> None:
    """Larger random weights than the init, so attention is far from uniform and mistakes show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_gpt_layers_in_sequence_match_a_reference():
    layers = build_gpt(TINY, seed=0)
    _scramble(layers, 0)
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.block_size), generator=torch.Generator().manual_seed(1))
    logits = _run(layers, idx)
    assert logits.shape == (3, TINY.block_size, TINY.vocab_size)
    torch.testing.assert_close(logits, _reference_gpt(layers, TINY, idx), rtol=1e-4, atol=1e-4)


def test_gpt_is_causal():
    layers = build_gpt(TINY, seed=0)
    _scramble(layers, 2)
    idx = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % TINY.vocab_size
    a, b = _run(layers, idx), _run(layers, changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_gpt_sequence_length_may_change_up_to_block_size():
    layers = build_gpt(TINY, seed=0)
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
    full = _run(layers, idx)
    for t in (1, 5, TINY.block_size):
        out = _run(layers, idx[:, :t])
        assert out.shape == (2, t, TINY.vocab_size)
        # Causality again: a prefix gives the same logits as the prefix of the full sequence.
        torch.testing.assert_close(out, full[:, :t], rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="sequence length 17 is longer than block_size 16") as err:
        _run(layers, torch.zeros(1, TINY.block_size + 1, dtype=torch.long))
    _one_line(err)


def test_gpt_loss_is_mean_cross_entropy():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[0, 1, 2], [3, 4, 0]])
    by_hand = -logits.log_softmax(-1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(gpt_loss(logits, targets), by_hand)


def test_mlp_layers_in_sequence_match_a_reference():
    cfg = MLPConfig(hidden=16, layers=3)
    layers = build_mlp(cfg, seed=5)
    x = mlp_input(cfg, 4, seed=0)
    expected = x
    for layer in layers:
        expected = F.gelu(expected @ layer.fc.weight.T + layer.fc.bias) @ layer.proj.weight.T + layer.proj.bias
    out = _run(layers, x)
    assert out.shape == (4, 16)
    torch.testing.assert_close(out, expected)
    # The init keeps the signal alive through the stack (no residual to carry it).
    deep = build_mlp(MLPConfig(hidden=64, layers=8))
    assert 0.1 < _run(deep, mlp_input(MLPConfig(hidden=64), 32)).std().item() < 10


def test_mlp_inputs_and_targets_are_fixed():
    cfg = MLPConfig(hidden=8)
    assert torch.equal(mlp_input(cfg, 4, seed=1), mlp_input(cfg, 4, seed=1))
    assert torch.equal(mlp_target(cfg, 4, seed=1), mlp_target(cfg, 4, seed=1))
    assert mlp_input(cfg, 4, seed=1).shape == mlp_target(cfg, 4, seed=1).shape == (4, 8)
    assert not torch.equal(mlp_input(cfg, 4, seed=1), mlp_target(cfg, 4, seed=1))
    assert not torch.equal(mlp_input(cfg, 4, seed=1), mlp_input(cfg, 4, seed=2))
    out, target = torch.zeros(2, 3), torch.ones(2, 3) * 2
    assert mlp_loss(out, target).item() == 4.0


# --------------------------------------------------------------------------- registry


def test_registry_builds_by_name():
    gpt = make_model("gpt", seed=4, layers=2, hidden=32, heads=2, seq=16, batch=3)
    reference = build_gpt(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16), seed=4)
    layers = gpt.build()
    assert len(layers) == gpt.num_layers == 4 and (gpt.embedding_layers, gpt.head_layers) == (1, 1)
    for a, b in zip(layers, reference, strict=True):
        _assert_same_weights(a, b)
    x, y = gpt.batch_at(5)
    assert x.shape == y.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])  # next-token targets
    assert torch.equal(gpt.batch_at(5)[0], x) and not torch.equal(gpt.batch_at(6)[0], x)  # a function of the step
    mlp = make_model("mlp", hidden=8, layers=3, batch=4, seed=2)
    assert len(mlp.build()) == mlp.num_layers == 3 and list(mlp.blocks) == [0, 1, 2]
    x, y = mlp.batch_at(1)
    assert torch.equal(x, mlp_input(MLPConfig(hidden=8, layers=3), 4, seed=3))  # step t draws seed + t
    assert torch.equal(y, mlp_target(MLPConfig(hidden=8, layers=3), 4, seed=2))
    assert mlp.loss(y, y).item() == 0.0 and mlp_loss(x, y).item() == mlp.loss(x, y).item()
    assert gpt.layer_name(0) == "layer 0 (embedding)" and gpt.layer_name(2) == "layer 2 (block 1)"
    assert mlp.layer_name(2) == "layer 2"


# --------------------------------------------------------------------------- split_layers


@given(n=st.integers(1, 80), data=st.data())
def test_split_layers_is_contiguous_and_even(n, data):
    stages = data.draw(st.integers(1, n))
    split = split_layers(n, stages)
    assert len(split) == stages
    assert [i for part in split for i in part] == list(range(n))  # every layer once, in order
    assert all(part == list(range(part[0], part[-1] + 1)) for part in split)
    sizes = [len(part) for part in split]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_split_layers_examples_and_errors():
    assert split_layers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_layers(build_gpt(TINY), 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ConfigError) as err:
        split_layers(6, 8)
    assert _one_line(err) == "cannot split 6 layers into 8 stages: at most 6 stages"
    with pytest.raises(ConfigError, match="positive integer"):
        split_layers(6, 0)


# --------------------------------------------------------------------------- corpus and batches


def test_default_corpus_is_the_stdlib_source_and_deterministic(corpus):
    again = load_corpus()
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)
    assert corpus.train.dtype == torch.uint8 and corpus.vocab_size == 256
    whole = torch.cat([corpus.train, corpus.val])
    assert int(whole.max()) < 256
    assert len(whole) == 8 << 20
    # A contiguous 90/10 split: disjoint by position, together the whole corpus.
    assert len(corpus.val) == pytest.approx(0.1 * len(whole), abs=1)
    raw = stdlib_source()
    assert bytes(whole.tolist()[:1000]) == raw[:1000] and bytes(corpus.val.tolist()[-1000:]) == raw[-1000:]
    root = Path(sysconfig.get_paths()["stdlib"])
    first = min((p for p in root.rglob("*.py") if "site-packages" not in p.parts),
                key=lambda p: p.relative_to(root).as_posix())
    assert raw.startswith(first.read_bytes())


def test_sources_walk_lazily_in_the_order_of_whole_paths(tmp_path):
    # Names that order differently as names and as paths: "a-b.py" < "a/..." < "a.py"? ("-" < "." < "/").
    for name in ["a/x.py", "a-b.py", "a.py", "a/b/c.py", "a.b/z.py", "ab.py", "a/site-packages/no.py",
                 "dist-packages/no.py", "b/.hidden.py", "b/readme.txt", "A.py", "a0/y.py", "a/ä.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    brute = sorted((p for p in tmp_path.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts)),
                   key=lambda p: p.relative_to(tmp_path).as_posix())
    assert list(_sources(tmp_path)) == brute
    root = Path(sysconfig.get_paths()["stdlib"])  # and on the standard library itself, as far as the corpus reads
    walked = [p for _, p in zip(range(200), _sources(root), strict=False)]
    everything = sorted((p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts)),
                        key=lambda p: p.relative_to(root).as_posix())
    assert walked == everything[:200]


def test_corpus_cap():
    small = load_corpus(cap=1000)
    assert len(small.train) + len(small.val) == 1000


def test_corpus_from_a_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(256)) * 4)
    c = load_corpus(str(path))
    assert bytes(torch.cat([c.train, c.val]).tolist()) == bytes(range(256)) * 4
    assert len(c.train) == 921 and c.source == str(path)


def test_corpus_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="cannot read --data file") as err:
        load_corpus(str(tmp_path / "missing.txt"))
    _one_line(err)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match="is empty") as err:
        load_corpus(str(tmp_path / "empty.txt"))
    _one_line(err)


def test_batches_are_reproducible_windows_with_shifted_targets():
    tokens = (torch.arange(5000) % 256).to(torch.uint8)  # each next token is the previous + 1 (mod 256)
    a, b = Batches(tokens, 4, 32, seed=7), Batches(tokens, 4, 32, seed=7)
    for step in (0, 1, 50):
        x, y = a.batch_at(step)
        assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
        bx, by = b.batch_at(step)
        assert torch.equal(x, bx) and torch.equal(y, by)
        assert torch.equal(y, (x + 1) % 256)  # targets are the inputs shifted by one
    assert not torch.equal(a.batch_at(0)[0], a.batch_at(1)[0])
    assert not torch.equal(a.batch_at(0)[0], Batches(tokens, 4, 32, seed=8).batch_at(0)[0])
    steps = iter(a)
    assert torch.equal(next(steps)[0], a.batch_at(0)[0]) and torch.equal(next(steps)[0], a.batch_at(1)[0])


def test_batches_fit_the_only_window_of_a_short_corpus():
    tokens = torch.arange(6, dtype=torch.uint8)
    starts = {int(Batches(tokens, 8, 5, seed=s).batch_at(0)[0][0, 0]) for s in range(20)}
    assert starts == {0}  # only one window fits: tokens 0..4 -> targets 1..5
    x, y = Batches(tokens, 1, 5).batch_at(0)
    assert x.tolist() == [[0, 1, 2, 3, 4]] and y.tolist() == [[1, 2, 3, 4, 5]]
    with pytest.raises(ConfigError, match="at least seq \\+ 1 = 7 tokens") as err:
        Batches(tokens, 1, 6)
    _one_line(err)


# --------------------------------------------------------------------------- training


def test_gpt_learns_the_corpus(corpus):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
    model = nn.Sequential(*build_gpt(cfg, seed=0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train = Batches(corpus.train, 16, 32, seed=0)
    val_x, val_y = Batches(corpus.val, 32, 32, seed=1).batch_at(0)
    with torch.no_grad():
        val_before = gpt_loss(model(val_x), val_y).item()
    losses = []
    for step in range(30):
        x, y = train.batch_at(step)
        loss = gpt_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.1)  # an untrained model guesses uniformly
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    with torch.no_grad():
        assert gpt_loss(model(val_x), val_y).item() < val_before - 1.0


# --------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(("make", "expected"), [
    (lambda: GPTConfig(n_embd=65, n_head=4), "n_embd must be a multiple of n_head (n_embd=65, n_head=4)"),
    (lambda: GPTConfig(n_layer=0), "GPTConfig.n_layer must be a positive integer (got 0)"),
    (lambda: GPTConfig(block_size=2.5),  # type: ignore[arg-type]
     "GPTConfig.block_size must be a positive integer (got 2.5)"),
    (lambda: GPTConfig(dropout=1.0), "dropout must be a probability in [0, 1) (got 1.0)"),
    (lambda: MLPConfig(hidden=0), "MLPConfig.hidden must be a positive integer (got 0)"),
    (lambda: make_model("resnet"), "unknown model 'resnet'; known models: gpt, mlp, moe, gpt2, llama"),
    (lambda: make_model("gpt", n_layers=2), "models take no setting 'n_layers'"),
    (lambda: make_model("gpt", layers=0), "--layers must be at least 1 (got 0)"),
    (lambda: make_model("mlp", config="gpt2-tiny"), "--hf-config configures a Hugging Face model"),
    (lambda: build_gpt_layers(TINY, [5]), "layer index 5 is out of range: this model has layers 0..4"),
    (lambda: build_mlp_layers(MLPConfig(layers=2), [-1]), "layer index -1 is out of range"),
])
def test_config_errors_are_one_line_with_the_value(make, expected):
    with pytest.raises(ConfigError) as err:
        make()
    assert expected in _one_line(err)


def test_hf_models_without_transformers_say_how_to_install(monkeypatch, capsys):
    from pipefold.cli.main import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: importing it fails
    with pytest.raises(ConfigError, match=r"need the transformers package: pip install 'pipefold\[hf\]'"):
        make_model("gpt2")
    assert main(["partition", "--hf", "llama"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'pipefold[hf]'" in err and len(err.strip().splitlines()) == 1

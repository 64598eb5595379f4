"""Planning a cluster one does not have: the model arithmetic against torch (the meta-device model's parameters,
FlopCounterMode's operations, the tensors a block saves), the shipped configs against their published sizes, the
layouts against a brute force, one configuration against its closed form, and the one-line refusals."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import load_benchmark
from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.models.transformer import Transformer, from_hf_config
from pipefold.plan.cluster import cluster_from_dict, load_cluster, shipped_clusters
from pipefold.plan.cluster_plan import Training, evaluate, layouts, plan_cluster, point, run_section

transformers = pytest.importorskip("transformers")

H100_FILE = Path(__file__).parents[1] / "src/pipefold/plan/clusters/h100-sxm.json"
TINY_LLAMA = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def _llama(**more: Any) -> tuple[Any, Transformer]:
    config = transformers.LlamaConfig(**TINY_LLAMA, **more)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    arith = Transformer(name="tiny", family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256,
                        value_bytes=4)
    return model, arith


def test_parameters_equal_the_meta_device_models() -> None:
    """Exact, for a LLaMA with grouped-query attention, GPT-2 (biases, learned positions, tied head) and Mixtral
    (experts and a router); and the active parameters of Mixtral are its top-2 experts'."""
    model, arith = _llama()
    assert sum(p.numel() for p in model.parameters()) == arith.parameters()
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=300, n_positions=96)
    with torch.device("meta"):
        built = transformers.GPT2LMHeadModel(gpt2)
    mine = Transformer(name="g", family="gpt2", layers=3, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=300,
                       positions=96, tied=True, dropout=True)
    assert sum(p.numel() for p in built.parameters()) == mine.parameters()
    mix = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        built = transformers.MixtralForCausalLM(mix)
    moe = Transformer(name="m", family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=256,
                      experts=4, top_k=2)
    assert sum(p.numel() for p in built.parameters()) == moe.parameters()
    assert moe.parameters() - moe.active_parameters() == 2 * 2 * 3 * 64 * 96  # 2 idle experts in each of 2 blocks


@pytest.mark.parametrize("name,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3.1-405b", 405.85),
                                           ("llama2-13b", 13.02), ("llama2-70b", 68.98), ("mixtral-8x7b", 46.70),
                                           ("gpt3-175b", 174.6), ("megatron-530b", 529.6)])
def test_shipped_configs_have_their_published_sizes(name: str, billions: float) -> None:
    """Meta's and Mistral's model cards: 8.03B, 70.6B, 405B; Llama 2 13B and 70B as Hugging Face counts them
    (13.0B, 69.0B); Mixtral 8x7B 46.7B with 12.9B active; Megatron-LM's GPT 174.6B and 529.6B (Narayanan et al.
    2021, Tables 1 and 2, to the tenth they print)."""
    model = from_hf_config(name)
    assert model.parameters() / 1e9 == pytest.approx(billions, abs=0.05 if name.startswith(("gpt3", "megatron"))
                                                     else 0.01)
    if name == "mixtral-8x7b":
        assert model.active_parameters() / 1e9 == pytest.approx(12.88, abs=0.01)


def test_operations_equal_torchs_flop_counter() -> None:
    """F of the whole model and B + W, counted by FlopCounterMode while a LLaMA runs (eager attention: the
    whole s x s square) and while GPT-2 runs: equal to the formulas."""
    from torch.utils.flop_counter import FlopCounterMode

    config = transformers.LlamaConfig(**TINY_LLAMA, attn_implementation="eager")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config)
    _, arith = _llama()
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300,
                                                               n_positions=96, attn_implementation="eager"))
    mine = Transformer(name="g", family="gpt2", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=300,
                       positions=96, tied=True, dropout=True)
    for model, shape, vocab in ((llama, arith, 256), (gpt2, mine, 300)):
        b, s = 2, 32
        x = torch.randint(0, vocab, (b, s))
        with FlopCounterMode(display=False) as fwd:
            out = model(x).logits
        with FlopCounterMode(display=False) as bwd:
            out.float().sum().backward()
        f, bb, w = shape.block_flops(s)
        hf, hb, hw = shape.head_flops()
        assert fwd.get_total_flops() == b * s * (shape.layers * f + hf)
        assert bwd.get_total_flops() == b * s * (shape.layers * (bb + w) + hb + hw)
        assert shape.model_flops(s) == shape.layers * (f + bb + w) + hf + hb + hw


@pytest.mark.parametrize(("implementation", "attention"), [("eager", "eager"), ("sdpa", "flash")])
def test_saved_bytes_equal_what_a_block_saves(implementation: str, attention: str) -> None:
    """Every tensor a LLaMA block saves for its backward (saved-tensor hooks; parameters and the rotary
    tables, which are per sequence, left out): the formula's bytes, with torch's memory-efficient attention (q,
    k, v, output, log-sum-exp) and with eager attention (the s x s probabilities, the key-value heads repeated)."""
    config = transformers.LlamaConfig(**TINY_LLAMA, attn_implementation=implementation)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    _, arith = _llama()
    b, s = 2, 32
    h = torch.randn(b, s, 64, requires_grad=True)
    positions = torch.arange(s).unsqueeze(0)
    rotary = model.model.rotary_emb(h, positions)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *rotary)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (ptr := t.untyped_storage().data_ptr()) not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    saved = arith.saved(s, attention=attention)
    assert sum(seen.values()) == (saved.whole + saved.split) * b * s
    assert arith.saved(s, recompute="full").whole == 4 * 64  # the block's input alone


def test_shipped_clusters_read_and_bad_files_are_one_line(tmp_path: Path) -> None:
    assert {"a100-80gb", "h100-sxm", "h200"} <= set(shipped_clusters())
    h100 = load_cluster("h100-sxm")
    assert h100.accelerator.peak("bf16") == 989e12 and h100.devices == 8 and h100.with_nodes(64).devices == 512
    assert h100.link(8) is h100.intra_node and h100.link(9) is h100.inter_node
    eff = h100.accelerator.efficiency
    curve = h100.accelerator.matmul_efficiency
    assert eff(1) == curve[0][1] and eff(1e15) == curve[-1][1] and eff(1e9) == pytest.approx(dict(curve)[1e9])
    # Halfway in log between two points: halfway between their fractions.
    assert eff(10**9.5) == pytest.approx((dict(curve)[1e9] + dict(curve)[1e10]) / 2)
    good = json.loads(H100_FILE.read_text())
    for change, expected in [
        (lambda d: d.pop("inter_node"), "has no inter_node"),
        (lambda d: d["accelerator"].update(matmul_efficiency=[[1e9, 0.5], [1e8, 0.6]]), "flops rising"),
        (lambda d: d["accelerator"].update(peak_flops={"bf16": -1}), "peak_flops must map dtypes"),
        (lambda d: d["intra_node"].update(efficiency=1.5), "efficiency must be a number > 0 at most 1"),
        (lambda d: d.update(devices_per_node=2.5), "devices_per_node must be a whole number"),
    ]:
        data = json.loads(json.dumps(good))
        change(data)
        with pytest.raises(ConfigError, match=re.escape(expected)) as info:
            cluster_from_dict(data, "x.json")
        assert "\n" not in str(info.value)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_cluster(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="neither a cluster pipefold ships"):
        load_cluster("h300")
    with pytest.raises(ConfigError, match="--nodes is the cluster's node count"):
        h100.with_nodes(0)


def test_layouts_are_every_factorisation_the_model_and_batch_allow() -> None:
    cluster = load_cluster("a100-80gb").with_nodes(4)
    model = from_hf_config("llama2-13b")  # 40 heads, 40 key-value heads, 40 blocks
    training = Training(model=model, seq=4096, global_batch=64)
    brute = {(d, 1, t, p) for d in range(1, 33) for t in range(1, 33) for p in range(1, 33)
             if d * t * p == 32 and t <= 8 and 40 % t == 0 and p <= 40 and 64 % d == 0}
    assert set(layouts(cluster, training)) == brute  # 4096 tokens: too short to split over context-parallel ranks
    # 32768 tokens: cp 1, 2 and 4 leave a rank 8192 tokens at least; cp 8 would leave 4096.
    long = Training(model=model, seq=32768, global_batch=64)
    assert long.cp_degrees() == (1, 2, 4)
    brute = {(d, c, t, p) for d in range(1, 33) for c in (1, 2, 4) for t in range(1, 33) for p in range(1, 33)
             if d * c * t * p == 32 and t <= 8 and 40 % t == 0 and p <= 40 and 64 % d == 0}
    assert set(layouts(cluster, long)) == brute
    given = Training(model=model, seq=4096, global_batch=64, context_parallel=(1, 8))
    assert {c for _, c, _, _ in layouts(cluster, given)} == {1, 8}
    with pytest.raises(ConfigError, match="give --global-batch a multiple of") as info:
        # 64 devices, a batch of 7 (dp 1): tp at most the 4 heads leaves pp >= 16 for the tiny LLaMA's 6 blocks.
        layouts(load_cluster("a100-80gb").with_nodes(8), Training(model=from_hf_config("llama-tiny"), seq=64,
                                                                   global_batch=7))
    assert "\n" not in str(info.value)


def test_the_heads_peak_is_what_torchs_profiler_measures() -> None:
    """The head of bf16 logits with the loss in float32, as the large runs compute it (torchtitan): torch's profiler
    counts the bytes its operations allocate and free, and their running sum peaks at what
    ``Transformer.head_peak`` says, the logits, their float32 copy and the log-softmax at once, above what it keeps
    (``head_saved``) for the backward."""
    from torch.profiler import ProfilerActivity, profile

    n, h, vocab = 256, 32, 4096
    model = Transformer(name="head", family="llama", layers=1, hidden=h, heads=1, kv_heads=1, ffn=h, vocab=vocab)
    x = torch.randn(n, h, dtype=torch.bfloat16)  # the head's input, allocated before the count starts
    w = torch.randn(vocab, h, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = x @ w.t()
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        del logits
        loss.backward()
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    assert peak == pytest.approx((model.head_peak() - model.value_bytes * h) * n, rel=0.01)
    assert model.head_peak() - model.head_saved() == 4 * vocab


def test_one_device_is_its_closed_form() -> None:
    """One GPU, one microbatch after another (1F1B on one device): the step is m x (F + B + W) of every block
    and the head, each from its operations at the peak times the efficiency of its largest product plus the
    elementwise bytes, and the optimizer's bytes; the memory is 18 bytes a parameter and one microbatch's
    activations."""
    cluster = cluster_from_dict({**json.loads(H100_FILE.read_text()), "devices_per_node": 1}, "one")
    model = from_hf_config("llama3-8b")
    training = Training(model=model, seq=2048, global_batch=4)
    got = point(cluster, training, dp=1, tp=1, pp=1, schedule="1f1b", microbatch=2)
    acc, n = cluster.accelerator, 2 * 2048
    peak = acc.peak("bf16")
    kept = model.saved(2048).per_rank(1) * n
    block = (sum(model.block_flops(2048)) * n / (peak * acc.efficiency(2 * n * 4096 * 14336))
             + 6 * kept / acc.memory_bandwidth)
    logits = model.head_saved() * n
    head = (sum(model.head_flops()) * n / (peak * acc.efficiency(2 * n * 4096 * 128256))
            + 4 * logits / acc.memory_bandwidth)
    step = 2 * (32 * block + head) + 32 * model.parameters() / acc.memory_bandwidth
    assert got.step_time == pytest.approx(step, rel=1e-9)
    assert got.memory == pytest.approx(18 * model.parameters() + 32 * kept + model.head_peak() * n, rel=1e-9)
    assert got.mfu == pytest.approx(model.model_flops(2048) * 4 * 2048 / step / peak, rel=1e-9)


def test_the_search_plans_a_cluster_and_the_command_prints_it(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    cluster = load_cluster("h100-sxm").with_nodes(2)
    training = Training(model=from_hf_config("llama3-8b"), seq=4096, global_batch=32)
    answer = plan_cluster(cluster, training)
    assert answer.best is not None and answer.best.fits
    assert answer.evaluated == len(answer.points) + answer.refused  # refused: weights alone over a device
    fitting = [p for p in answer.points if p.fits]
    fastest = min(p.step_time for p in fitting)
    assert answer.best.step_time <= fastest * 1.001  # the lightest of those as fast within 0.1%
    assert answer.best.memory == min(p.memory for p in fitting if p.step_time <= fastest * 1.001)
    # The frontier, against a brute force: no fitting point is faster (beyond 0.1%) with no more memory than a
    # point of it, and every fitting point is matched by one of it.
    for f in answer.frontier:
        assert not any(p.step_time < f.step_time * 0.999 and p.memory <= f.memory for p in fitting)
    for p in fitting:
        assert any(f.step_time <= p.step_time and f.memory <= p.memory for f in answer.frontier)
    code = main(["plan", "--cluster", "h100-sxm", "--nodes", "2", "--hf-config", "llama3-8b", "--global-batch", "32",
                 "--seq", "4096", "--json", "-o", str(tmp_path / "plan.json")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["best"]["step_time"] == pytest.approx(answer.best.step_time)
    assert json.loads((tmp_path / "plan.json").read_text())["kind"] == "pipefold-cluster-plan"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--hf-config", "llama9"], "neither a config pipefold ships"),
    (["--global-batch", "0"], "--global-batch: 0 is out of range: give a whole number >= 1"),
    (["--hf-config", "llama-tiny", "--nodes", "8", "--global-batch", "7"], "give --global-batch a multiple of"),
    (["--hf-config", "gpt2-tiny", "--memory", "3"], "--memory sets the cost model of plan --memory"),
    (["--hf-config", "gpt2-tiny", "--memory-budget", "3GB"], "--memory-budget belongs to plan --profile FILE"),
    (["--hf-config", "gpt2-tiny", "-m", "4"], "--microbatches is chosen by plan --cluster"),
    (["--families", "1f1b,zb-x"], "unknown schedule family 'zb-x'"),
    (["--nodes", "0"], "--nodes: 0 is out of range: give a whole number >= 1"),
    (["--seq", "0"], "--seq: 0 is out of range: give a whole number >= 1"),
    (["--top", "0"], "--top: 0 is out of range: give a whole number >= 1"),
    (["--hf-config", "llama3.1-405b", "--nodes", "1"], "weights and optimizer state alone do not, in any layout"),
    (["--hf-config", "llama3-70b", "--nodes", "1", "--seq", "131072"], "no configuration of llama3-70b fits"),
])
def test_bad_cluster_plans_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    base = {"--hf-config": "llama3-8b", "--global-batch": "64", "--seq": "2048"}
    given = dict(zip(argv[::2], argv[1::2], strict=True))
    args = [x for k, v in {**base, **given}.items() for x in (k, v)]
    code = main(["plan", "--cluster", "a100-80gb", *args])
    err = capsys.readouterr().err
    assert code != 0 and expected in err and err.count("\n") == 1, err
    assert math.isfinite(code)


@pytest.mark.parametrize("family", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half", "gpipe"])
def test_the_steady_state_extrapolation_equals_simulating_every_microbatch(family: str) -> None:
    """Beyond STEADY microbatches per device the search extrapolates makespan, busy time and peaks linearly from two
    simulations; against simulating all of them (pp 4, 48 and 64 microbatches; first and last stages heavier, a
    data-parallel all-reduce, tp pieces): equal within 1e-9 relative."""
    from pipefold.plan import cluster_plan as cp
    from pipefold.sim.simulate import simulate

    cluster = load_cluster("h100-sxm").with_nodes(4)
    training = Training(model=from_hf_config("llama3-8b"), seq=2048, global_batch=128)
    config = cp._Config(dp=2, tp=4, pp=4, microbatch=1, recompute="half")
    for m in (48, 64):
        search = cp._Search()
        plain = search.schedule(family, 4, m, False)
        cost, _ = cp._costs(cluster, training, config, plain.stages, False)
        got = search.simulate(family, 4, m, True, cost)
        whole = simulate(cp._build(family, 4, m, True, []), cost)
        assert got is not None and m > (cp.STEADY + 1) * 4
        assert got[0] == pytest.approx(whole.makespan, rel=1e-9)
        assert got[1] == pytest.approx(list(whole.busy), rel=1e-9)
        assert got[2] == pytest.approx(list(whole.peak_memory), rel=1e-9)


def _published() -> Any:
    return load_benchmark("published.py")


@pytest.mark.parametrize("name", ["gpt3-175b", "megatron-530b"])
def test_megatrons_count_of_operations_is_pipefolds_with_one_more_forward(name: str) -> None:
    """The teraFLOP/s Megatron-LM's paper publishes become tokens per second through its Eq. 3; that count is, term
    by term, pipefold's F + B + W of the model (its MFU count) plus the blocks' forward once more (full
    recomputation), so the published figure and the prediction count the same work."""
    model = from_hf_config(name)
    eq3 = _published().megatron_flops_per_token(model, 2048)
    assert eq3 == pytest.approx(model.model_flops(2048) + model.layers * model.block_flops(2048)[0], rel=1e-12)


def test_the_published_table_is_the_datas_and_the_results_show_it() -> None:
    """benchmarks/results/published.md shows the tables benchmarks/published.py prints from
    benchmarks/published_runs.json, and the stored predictions are what the code predicts now (no drift); a
    published throughput more than 15% off, or a memory more than 10% off, is explained in the file (and only those
    are). Of the runs that used only what
    pipefold costs, most are within 15% and every published memory within 10%; a tensor-parallel layout at long
    sequences (torchtitan's 4D run of 405B at 32k tokens) is predicted within 10% of its published memory."""
    published = _published()
    root = Path(__file__).resolve().parents[1]
    data = json.loads((root / "benchmarks" / "published_runs.json").read_text())
    within = costed = 0
    for run in data["runs"]:
        assert published.predict(data, run) == run["predicted"], run["what"]
        got, pub = run["predicted"], run["published"]
        off = abs(got["tokens_per_second_per_gpu"] / published.published_tokens(run) - 1)
        assert (off > published.MISS) == ("miss" in run), run["what"]
        memory_off = abs(got["memory_gib"] / pub["memory_gib"] - 1) if "memory_gib" in pub else 0.0
        assert (memory_off > published.MEMORY_MISS) == ("memory_miss" in run), run["what"]
        if "uncosted" not in run:
            costed += 1
            within += off <= published.MISS
            assert "memory_miss" not in run, run["what"]
    assert within >= 0.75 * costed
    assert len(data["runs"]) >= 8 and all(run["source"] in data["sources"] for run in data["runs"])
    assert any(run["pp"] > 1 for run in data["runs"] if "miss" not in run)  # the pipeline's part is checked
    assert any(run["tp"] > 1 and run["seq"] >= 32768 and "memory_gib" in run["published"] and "memory_miss" not in run
               for run in data["runs"])
    assert published.table(data) in (root / "benchmarks" / "results" / "published.md").read_text()


def test_the_searchs_picks_for_the_published_workloads_are_stored_and_shown() -> None:
    """``published.py --search`` stores, for every published workload, what the search picks when free to
    choose; the stored picks are one per workload, the cheapest (8 GPUs) is what the search picks now, and the
    results file shows them. The others take minutes: their arithmetic is the same search's."""
    published = _published()
    root = Path(__file__).resolve().parents[1]
    data = json.loads((root / "benchmarks" / "published_runs.json").read_text())
    groups = published.workloads(data)
    assert len(data["searches"]) == len(groups)
    stored = {got["workload"]: got for got in data["searches"]}
    cheapest = min(groups.values(), key=lambda runs: published.cluster_of(data, runs[0]).devices)
    now = published.search(data, cheapest)
    assert now == stored[now["workload"]]
    assert published.searches_table(data) in (root / "benchmarks" / "results" / "published.md").read_text()


def test_a_cluster_plan_trains_as_planned(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """plan --cluster -o, then train --plan: the run has the plan's layout, split and recomputation, and its
    gradients equal one process's; a plan of a model pipefold only plans (Mixtral's experts) is refused in one
    line by train."""
    cluster = str(Path(__file__).resolve().parents[1] / "examples" / "four-devices.json")
    plan = tmp_path / "plan.json"
    assert main(["plan", "--cluster", cluster, "--hf-config", "llama-tiny", "--global-batch", "8", "--seq", "16",
                 "-o", str(plan), "--json"]) == 0
    capsys.readouterr()
    run = json.loads(plan.read_text())["run"]
    assert run["dp"] * run["tp"] * run["devices"] == 4
    assert main(["train", "--plan", str(plan), "--steps", "2", "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_grad_rel_diff"] < 1e-5 and out["loss_rel_diff"] < 1e-5
    assert out["devices"] == run["devices"] and out.get("dp", 1) == run["dp"] and out.get("tp", 1) == run["tp"]
    assert out["boundaries"] == [part[0] for part in run["layer_stages"]]
    if any(run["recompute"]):
        assert out["recompute"]["layers"] == run["recompute"]
        assert out["recompute"]["stage_layers"] == [len(x) for x in run["layer_stages"]]
    assert out["cluster_plan"]["predicted"]["step_time_s"] == pytest.approx(run["predicted"]["step_time_s"])
    moe = tmp_path / "moe.json"
    assert main(["plan", "--cluster", "h100-sxm", "--nodes", "2", "--hf-config", "mixtral-8x7b", "--global-batch",
                 "16", "--seq", "4096", "--families", "1f1b", "-o", str(moe), "--json"]) == 0
    capsys.readouterr()
    assert main(["train", "--plan", str(moe), "--steps", "1"]) != 0
    err = capsys.readouterr().err
    assert "plans a model pipefold does not run" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("tp", "pp"), [(2, 4), (4, 2), (8, 2), (2, 2)])
def test_sequence_parallelism_saves_its_closed_form(tp: int, pp: int) -> None:
    """Llama 3 8B on 4 H100 nodes, 1F1B without recomputation: the first device holds pp microbatches of its
    blocks at its peak, and sequence parallelism splits each block's whole part (its norms' bytes) over tp, so the
    peak falls by pp x blocks x whole x (1 - 1/tp) x tokens; the weights are the same, and what splits over tp
    anyway (attention, MLP) as well."""
    from pipefold.plan.cluster_plan import _stages

    cluster, model, seq = load_cluster("h100-sxm").with_nodes(4), from_hf_config("llama3-8b"), 4096
    got = {}
    for sp in (False, True):
        training = Training(model=model, seq=seq, global_batch=64, sequence_parallel=sp)
        got[sp] = point(cluster, training, dp=32 // (tp * pp), tp=tp, pp=pp, schedule="1f1b", microbatch=1)
    whole = model.saved(seq, attention="flash").whole
    blocks = _stages(model, pp)[0].blocks
    assert got[False].memory - got[True].memory == pytest.approx(pp * blocks * whole * (1 - 1 / tp) * seq, rel=1e-9)
    assert got[False].static == got[True].static
    assert (got[False].sequence_parallel, got[True].sequence_parallel) == (False, True)
    assert got[True].layout.endswith(" sp") and got[True].to_dict()["sequence_parallel"]
    one = point(cluster, Training(model=model, seq=seq, global_batch=64), dp=8, tp=1, pp=4, schedule="1f1b",
                microbatch=1)
    assert not one.sequence_parallel  # nothing to split over one rank


def test_sequence_parallelism_is_the_searchs_default_and_turns_off(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    """The search splits the tokens over tp by default: Llama 3.1 405B at tp 8 x pp 16 on 2,048 H100 nodes
    (Meta's layout), with full recomputation, fits 80 GB with it and not without. --no-sequence-parallel turns it
    off; a plan whose best splits the tokens writes why train cannot run it (HF configs have no plan for it)."""
    cluster, model = load_cluster("h100-sxm").with_nodes(2048), from_hf_config("llama3.1-405b")
    fits = {sp: point(cluster, Training(model=model, seq=8192, global_batch=2048, sequence_parallel=sp), dp=128,
                      tp=8, pp=16, schedule="interleaved-1f1b", microbatch=1, recompute="full").fits
            for sp in (False, True)}
    assert fits == {False: False, True: True}
    argv = ["plan", "--cluster", "h100-sxm", "--nodes", "1", "--hf-config", "llama3-8b", "--global-batch", "32",
            "--seq", "8192", "--families", "1f1b", "--json"]
    assert main([*argv, "-o", str(tmp_path / "sp.json")]) == 0
    with_sp = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-sequence-parallel"]) == 0
    without = json.loads(capsys.readouterr().out)
    split = [p for p in with_sp["top"] if p["tp"] > 1]
    assert split and all(p["sequence_parallel"] for p in split)
    assert not any(p["sequence_parallel"] for p in without["top"])
    written = json.loads((tmp_path / "sp.json").read_text())
    assert (written["run"] is None) == written["best"]["sequence_parallel"]
    from pipefold.plan.cluster_plan import run_section

    training = Training(model=from_hf_config("llama3-8b"), seq=8192, global_batch=32)
    split_point = point(load_cluster("h100-sxm").with_nodes(1), training, dp=2, tp=2, pp=2, schedule="1f1b",
                        microbatch=1)
    with pytest.raises(ConfigError, match="runs for its own gpt model, not llama configs: plan with "
                                          "--no-sequence-parallel to run it"):
        run_section(split_point, training, "llama3-8b")
    assert main(["plan", "--memory", "3", "--no-sequence-parallel"]) != 0
    err = capsys.readouterr().err
    assert "--no-sequence-parallel describes a cluster plan" in err and err.count("\n") == 1, err


def test_a_cluster_plan_without_its_model_or_shape_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--cluster", "h100-sxm", "--seq", "2048"]) != 0
    err = capsys.readouterr().err
    assert "plan --cluster needs --hf-config, --global-batch" in err and err.count("\n") == 1, err
    assert main(["plan", "--nodes", "4", "--memory", "3"]) != 0
    err = capsys.readouterr().err
    assert "--nodes describes a cluster plan: give --cluster NAME|FILE too" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("microbatches", [1, 4])
def test_fsdp_over_a_slow_network_is_its_closed_form(microbatches: int) -> None:
    """FSDP over 2 nodes of one device joined by a slow link, so the collectives bound the step: with one microbatch
    the weights are gathered for forward and again for backward (bf16) and the gradients reduce-scattered (fp32),
    each a ring of dp - 1 steps, the latency paid per block; with several, gathered once and kept. The step is that
    plus the optimizer's sharded bytes; the memory the 16 sharded bytes a parameter, the gathered bf16 weights (two
    blocks, or all with their unsharded float32 gradients) and the activations."""
    data = {**json.loads(H100_FILE.read_text()), "devices_per_node": 1, "nodes": 2}
    data["inter_node"] = {"name": "slow", "bandwidth": 1e9, "latency": 1e-4, "efficiency": 0.5}
    cluster = cluster_from_dict(data, "slow")
    model = from_hf_config("llama3-8b")
    training = Training(model=model, seq=1024, global_batch=2 * microbatches)
    got = point(cluster, training, dp=2, tp=1, pp=1, schedule="1f1b", microbatch=1, sharding="fsdp")
    params, bw, lat = model.parameters(), 1e9 * 0.5, 1e-4
    gathers = 2 if microbatches == 1 else 1
    ring = lat + 0.5 * params * 2 / bw  # one ring all-gather of the bf16 weights among 2
    comm = gathers * ring + (lat + 0.5 * params * 4 / bw) + (gathers + 1) * 31 * 1 * lat
    assert got.step_time == pytest.approx(comm + 32 * params / 2 / cluster.accelerator.memory_bandwidth, rel=1e-9)
    # Gathered bf16 weights: two blocks, or, with several microbatches, all of them and their unsharded float32
    # gradients accumulating until the one reduce-scatter.
    held = 2 * 2 * model.block_parameters() if microbatches == 1 else (2 + 4) * params
    n = 1024
    activations = 32 * model.saved(1024).per_rank(1) * n + model.head_peak() * n
    assert got.memory == pytest.approx(16 * params / 2 + held + activations, rel=1e-9)


def test_context_parallelism_is_its_closed_form() -> None:
    """Two devices in one node each holding half of every sequence (dp 1, cp 2): a rank keeps the activations of
    its half, as one device training half-length sequences does (flash attention's bytes a token do not depend on
    the length), and holds the same weights. Its passes are the whole sequence's per-token operations on half the
    tokens, plus the ring's time beyond the attention core it overlaps (a slow link, so that it shows): one step of
    the rank's keys and values forward, their gradients with them backward. The gradients are all-reduced over the
    two ranks after the backward."""
    from pipefold.sim.simulate import ring_allreduce

    data = {**json.loads(H100_FILE.read_text()), "devices_per_node": 2, "nodes": 1}
    data["intra_node"] = {"name": "slow", "bandwidth": 2e9, "latency": 1e-4, "efficiency": 0.5}
    cluster = cluster_from_dict(data, "slow")
    model, seq = from_hf_config("llama3-8b"), 32768
    got = point(cluster, Training(model=model, seq=seq, global_batch=1), dp=1, cp=2, tp=1, pp=1, schedule="1f1b",
                microbatch=1)
    one = cluster_from_dict({**data, "devices_per_node": 1}, "one")
    half = point(one, Training(model=model, seq=seq // 2, global_batch=1), dp=1, tp=1, pp=1, schedule="1f1b",
                 microbatch=1)
    assert got.memory == pytest.approx(half.memory, rel=1e-12) and got.static == half.static
    acc, n, bw, lat = cluster.accelerator, seq // 2, 2e9 * 0.5, 1e-4
    peak, biggest = acc.peak("bf16"), 2 * n * 4096 * 14336
    kept = model.saved(seq).per_rank(1) * n
    kv = 2 * 2 * 8 * 128 * n  # keys and values of the rank's tokens: 8 key-value heads of 128, bf16
    core = 4.0 * seq * 4096 * n / (peak * acc.efficiency(biggest))
    ring = max(0.0, lat + kv / bw - core) + max(0.0, lat + 2 * kv / bw - 2 * core)
    assert ring > 0.0  # the link is slow enough to show
    block = (sum(model.block_flops(seq)) * n / (peak * acc.efficiency(biggest)) + 6 * kept / acc.memory_bandwidth
             + ring)
    logits = model.head_saved() * n
    head = (sum(model.head_flops()) * n / (peak * acc.efficiency(2 * n * 4096 * 128256))
            + 4 * logits / acc.memory_bandwidth)
    grads = ring_allreduce(4 * model.parameters(), 2, lat, bw)
    step = 32 * block + head + grads + 32 * model.parameters() / acc.memory_bandwidth
    assert got.step_time == pytest.approx(step, rel=1e-9)
    assert (got.cp, got.layout, got.to_dict()["cp"]) == (2, "dp1 cp2 tp1 pp1", 2)
    # ZeRO-1 shards the 12 bytes of master weights and moments over dp x cp: 6 + 12 / 2 bytes a parameter.
    zero1 = point(cluster, Training(model=model, seq=seq, global_batch=1), dp=1, cp=2, tp=1, pp=1,
                  schedule="1f1b", microbatch=1, sharding="zero1")
    assert zero1.static == pytest.approx(12 * model.parameters(), rel=1e-12)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--seq", "1020", "--cp", "4"], "cp 4 splits each sequence into 8 equal chunks (two a rank, for the causal "
                                     "balance), and 1020 tokens do not: give --seq a multiple of 8, or cp 3"),
    (["--seq", "4096", "--cp", "0"], "context-parallel degrees from 1 to"),
    (["--seq", "4096", "--cp", "2,x"], "context-parallel degrees from 1 to"),
])
def test_bad_context_parallel_degrees_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                   expected: str) -> None:
    assert main(["plan", "--cluster", "h100-sxm", "--nodes", "1", "--hf-config", "llama3-8b", "--global-batch",
                 "8", *argv]) != 0
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err


def test_the_search_splits_long_sequences_over_context_parallel_ranks(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """Llama 3 8B at 131,072 tokens a sequence on one H100 node: by default the search tries cp 2 to 16 and its
    best splits the sequences, faster than the best of tp alone (whose all-reduces the ring's steps, hidden
    behind the attention core, do not pay); --cp 1 searches without. The plan file says why train cannot run it."""
    argv = ["plan", "--cluster", "h100-sxm", "--nodes", "1", "--hf-config", "llama3-8b", "--global-batch", "8",
            "--seq", "131072", "--families", "1f1b", "--json"]
    assert main([*argv, "--cp", "1"]) == 0
    without = json.loads(capsys.readouterr().out)["best"]
    assert main([*argv, "-o", str(tmp_path / "cp.json")]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert without["cp"] == 1 and best["cp"] > 1 and best["fits"]
    assert best["step_time"] < without["step_time"]
    written = json.loads((tmp_path / "cp.json").read_text())
    assert written["run"] is None and "context parallelism" in written["not_runnable"]


def test_a_measured_efficiency_is_each_products_rate_over_the_peak() -> None:
    """Each (operations, seconds) becomes the fraction of the dtype's peak it achieved, sorted by size (4 significant
    digits); the planner's time for a product of a measured size is then the measured time; a product faster than
    the peak is refused in one line; the written file reads back to the same cluster (every shipped one too)."""
    from pipefold.plan.cluster import cluster_to_dict, measured_efficiency

    h100 = load_cluster("h100-sxm")
    peak = h100.accelerator.peak("bf16")
    measured = [(1e10, 1e10 / (0.5 * peak)), (1e8, 1e8 / (0.125 * peak)), (1e12, 1e12 / (0.75 * peak))]
    got = measured_efficiency(h100, measured, "bf16", "a test")
    assert got.accelerator.matmul_efficiency == ((1e8, 0.125), (1e10, 0.5), (1e12, 0.75))
    for flops, seconds in measured:
        assert flops / (peak * got.accelerator.efficiency(flops)) == pytest.approx(seconds, rel=1e-4)
    assert "a test" in got.sources["matmul_efficiency"]
    assert got.accelerator.memory_bytes == h100.accelerator.memory_bytes
    with pytest.raises(ConfigError, match="above the bf16 peak of NVIDIA H100") as info:
        measured_efficiency(h100, [(1e12, 1e12 / (1.5 * peak))], "bf16", "a test")
    assert "\n" not in str(info.value)
    for name in shipped_clusters():
        cluster = load_cluster(name)
        assert cluster_from_dict(json.loads(json.dumps(cluster_to_dict(cluster))), name) == cluster
    assert cluster_from_dict(cluster_to_dict(got), "back") == got


def test_calibrate_times_this_devices_products_and_writes_a_cluster_file_plan_reads(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """pipefold calibrate on this machine's CPU: products from 1e8 operations to --largest, two a decade, each at a
    rate above 0 and under the file's peak; the file it writes is the cluster with that curve, and plan --cluster
    plans with it. Bad input is one line, before anything is timed."""
    out = tmp_path / "here.json"
    four = str(Path(__file__).resolve().parents[1] / "examples" / "four-devices.json")
    assert main(["calibrate", "--cluster", four, "--largest", "1e9", "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    flops = [p["flops"] for p in report["products"]]
    assert len(flops) == 3 and flops == sorted(flops) and flops[0] >= 1e8 and flops[-1] <= 1.2e9
    assert report["dtype"] == "bf16" and all(0 < p["fraction"] < 1 for p in report["products"])
    written = load_cluster(str(out))
    assert [x for x, _ in written.accelerator.matmul_efficiency] == flops
    assert written.nodes == load_cluster(four).nodes and written.intra_node == load_cluster(four).intra_node
    assert main(["plan", "--cluster", str(out), "--hf-config", "llama-tiny", "--global-batch", "8", "--seq", "16",
                 "--json"]) == 0
    capsys.readouterr()
    # Below 1e8 operations the range is --largest alone, and sizes that round to the same square are timed once:
    # the file's curve must rise, or it would not read back.
    for largest, points in (("1e6", 1), ("1e7", 1), ("2e8", 2)):
        assert main(["calibrate", "--cluster", four, "--largest", largest, "-o", str(out)]) == 0
        curve = load_cluster(str(out)).accelerator.matmul_efficiency
        assert len(curve) == points and all(a[0] < b[0] for a, b in zip(curve, curve[1:], strict=False))
    capsys.readouterr()
    for argv, expected in ((["--dtype", "fp8"], "calibration times bf16, fp16, tf32, fp32 products"),
                           (["--largest", "5"], "--largest: 5 is out of range: give a number >= 1e+06"),
                           (["-o", str(tmp_path / "no" / "x.json")], "folder"),
                           (["--cluster", "nope"], "--cluster 'nope' is neither")):
        args = ["calibrate", "--cluster", four, *argv] if "--cluster" not in argv else ["calibrate", *argv]
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err


@pytest.mark.parametrize("c", [2, 4])
def test_sequence_chunks_cut_the_first_device_activations_to_the_closed_form(c: int) -> None:
    """1F1B over c sequence chunks (Seq1F1B): the first of p devices holds p+c-1 chunks where it held p whole
    microbatches, (p+c-1)/(cp) of the activations (to a part in a million: kilobytes of 48 GB are not a
    microbatch's); the weights are the same, the step shorter."""
    cluster = load_cluster("h100-sxm").with_nodes(1)
    training = Training(model=from_hf_config("llama3-8b"), seq=16384, global_batch=16)
    whole, chunked = (point(cluster, training, dp=1, tp=2, pp=4, schedule="1f1b", microbatch=1, **options)
                      for options in ({}, {"seq_chunks": c}))
    assert chunked.schedule == f"1f1b:seq_chunks={c}" and chunked.static == whole.static
    assert (chunked.memory - chunked.static) / (whole.memory - whole.static) == pytest.approx((4 + c - 1) / (4 * c),
                                                                                               rel=1e-6)
    assert chunked.step_time < whole.step_time


def test_the_search_tries_sequence_chunks_where_asked() -> None:
    cluster = load_cluster("h100-sxm").with_nodes(1)
    model = from_hf_config("llama3-8b")
    plain = evaluate(cluster, Training(model=model, seq=32768, global_batch=8), families=("1f1b", "chimera"))[0]
    chunked = evaluate(cluster, Training(model=model, seq=32768, global_batch=8, seq_chunks=(1, 2)),
                       families=("1f1b", "chimera"))[0]
    assert {p.schedule for p in plain} == {"1f1b", "chimera"}
    assert {p.schedule for p in chunked} == {"1f1b", "chimera", "1f1b:seq_chunks=2"}  # chimera cannot cut
    assert len(chunked) > len(plain)
    best = min((p for p in chunked if p.fits), key=lambda p: p.step_time)
    with pytest.raises(ConfigError, match="cut into sequence chunks"):
        run_section(replace(best, schedule="1f1b:seq_chunks=2", cp=1), Training(model=model, seq=32768, global_batch=8),
                    "llama3-8b")


def test_chunks_that_do_not_cut_the_sequence_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"--seq-chunks 3 cuts each sequence into 3 equal chunks, and 8192 tokens do "
                                          r"not: give --seq a multiple of 3, or --seq-chunks 2"):
        Training(model=from_hf_config("llama3-8b"), seq=8192, global_batch=8, seq_chunks=(1, 3))


@pytest.mark.parametrize(("family", "pp"), [("zb-v", 2), ("v-half", 4), ("1f1b", 4)])
def test_the_output_layer_split_by_vocabulary_moves_its_work_and_weights_onto_every_device(family: str,
                                                                                          pp: int) -> None:
    """--split-vocab's points (``vocab=1``): the head's passes leave the last stage and the two matrices the end
    stages; every stage holds a pp-th of both instead (the parameters summed over the stages are the same), and
    the simulated work summed over the devices is the plain one's with the head's work moved into the vocabulary
    passes, each device paying its collectives (two simulations against each other)."""
    from pipefold import schedules
    from pipefold.plan.cluster_plan import _Config, _costs, _stages
    from pipefold.sim.simulate import simulate

    cluster, model = load_cluster("h100-sxm").with_nodes(1), from_hf_config("llama3-8b")
    training = Training(model=model, seq=4096, global_batch=8 * 8 // pp)
    c, m = _Config(dp=8 // pp, tp=1, pp=pp, microbatch=1, recompute="none"), 2 * pp
    plain_schedule, split_schedule = schedules.build(family, pp, m), schedules.build(family, pp, m, vocab=1)
    stages = plain_schedule.stages
    plain, plain_params = _costs(cluster, training, c, stages, False)
    split, split_params = _costs(cluster, training, c, stages, False, split=True)
    assert sum(split_params) == pytest.approx(sum(plain_params), rel=1e-12)
    matrices = model.embedding_parameters() + model.head_parameters()
    for s, st in enumerate(_stages(model, stages)):
        assert split_params[s] == pytest.approx(st.blocks * model.block_parameters() + matrices / stages, rel=1e-12)
    last = stages - 1
    head = tuple(getattr(plain.stage_overrides[last], k) - getattr(split.stage_overrides[last], k) for k in "fbw")
    assert all(x > 0 for x in head) and split.vocab_w == pytest.approx(head[2])
    assert split.vocab_f > head[0] and split.vocab_b > head[1]  # each carries the collectives its passes wait for
    a, b = simulate(plain_schedule, plain), simulate(split_schedule, split)
    moved = m * (split.vocab_f + split.vocab_b + split.vocab_w - sum(head))
    assert sum(b.busy) == pytest.approx(sum(a.busy) + moved, rel=1e-9)
    point_split = point(cluster, training, dp=c.dp, tp=1, pp=pp, schedule=family, microbatch=1, vocab=1)
    assert point_split.schedule == f"{family}:vocab=1"
    with pytest.raises(ConfigError, match=f"over pipelines with dp {c.dp} x tp 1 copies, which pipefold's runtime "
                                          "does not run yet: plan without --split-vocab to run it"):
        run_section(point_split, replace(training, sequence_parallel=False), "llama3-8b")


def test_a_cluster_plan_with_the_output_layer_split_trains_as_planned(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """A cluster point with ``vocab=1`` on one pipeline (LLaMA, ZB-H1 on 4 devices) written as a plan's run:
    train --plan runs it with the output layer and the embedding split, and its gradients equal one process's."""
    from pipefold.plan.cluster_plan import CLUSTER_PLAN_VERSION

    cluster = load_cluster(str(Path(__file__).resolve().parents[1] / "examples" / "four-devices.json"))
    training = Training(model=from_hf_config("llama-tiny"), seq=16, global_batch=8, sequence_parallel=False)
    got = point(cluster, training, dp=1, tp=1, pp=4, schedule="zb-h1", microbatch=1, vocab=1)
    run = run_section(got, training, "llama-tiny")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kind": "pipefold-cluster-plan", "version": CLUSTER_PLAN_VERSION,
                                "best": got.to_dict(), "run": run}))
    assert main(["train", "--plan", str(plan), "--steps", "2", "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_grad_rel_diff"] < 1e-5 and out["loss_rel_diff"] < 1e-5
    assert out["options"] == {"vocab": 1} and out["vocab_embedding"]
    assert out["boundaries"] == [part[0] for part in run["layer_stages"]]


def test_plan_cluster_searches_the_split_where_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --split-vocab no point splits the output layer; with it the families that can are tried both ways
    on pipelines of two devices or more, and the others once."""
    argv = ["plan", "--cluster", "h100-sxm", "--nodes", "1", "--hf-config", "llama3-8b", "--global-batch", "16",
            "--seq", "4096", "--families", "zb-v,dualpipev", "--json", "--top", "500"]
    assert main(argv) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*argv, "--split-vocab"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert not any("vocab" in p["schedule"] for p in whole["top"])
    assert {p["schedule"] for p in split["top"]} >= {"zb-v", "zb-v:vocab=1"}
    assert not any(p["schedule"] == "dualpipev:vocab=1" for p in split["top"])
    assert split["evaluated"] > whole["evaluated"]
    assert not any(p["schedule"] == "zb-v:vocab=1" and p["pp"] == 1 for p in split["top"])  # one device: whole

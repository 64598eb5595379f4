"""The cluster planner's mixture-of-experts models: DeepSeek-V3's arithmetic (latent attention, shared experts, dense
first layers) against ``transformers``' own model, the expert-parallel dimension against closed forms computed here
(the all-to-alls' bytes, each rank's experts and their state), the refusals, and the search choosing ep > 1 where
the experts' state leaves it nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.models.transformer import Transformer, from_hf_config
from pipefold.plan.cluster import load_cluster

transformers = pytest.importorskip("transformers")

TINY_DEEPSEEK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=4, vocab_size=256, n_routed_experts=8,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
                     kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, n_group=1, topk_group=1,
                     max_position_embeddings=128)


def _tiny_deepseek(tmp_path: Path) -> tuple[Any, Transformer]:
    config = transformers.DeepseekV3Config(**TINY_DEEPSEEK, attn_implementation="eager",
                                           experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "deepseek_v3", **TINY_DEEPSEEK}))
    return model, from_hf_config(str(path))


def test_deepseek_v3_parameters_and_operations_are_transformers(tmp_path: Path) -> None:
    """A DeepSeek-V3 of 3 blocks (latent attention with both latents, the first block dense, two MoE blocks of 8
    routed experts, top 2, and a shared one), read from its config.json: its parameters are those of
    ``transformers``' DeepseekV3ForCausalLM, and F, and B + W, are what FlopCounterMode counts while it runs forward
    and backward (eager attention and experts: every expert's products as matrix products)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, mine = _tiny_deepseek(tmp_path)
    assert (mine.experts, mine.top_k, mine.expert_ffn, mine.shared_experts, mine.dense_layers) == (8, 2, 32, 1, 1)
    assert (mine.q_lora_rank, mine.kv_lora_rank, mine.qk_rope_dim, mine.qk_nope_dim, mine.v_head_dim) == (24, 16, 8,
                                                                                                          12, 10)
    assert sum(p.numel() for p in model.parameters()) == mine.parameters()
    b, s = 2, 32
    x = torch.randint(0, 256, (b, s))
    with FlopCounterMode(display=False) as fwd:
        out = model(x).logits
    with FlopCounterMode(display=False) as bwd:
        out.float().sum().backward()
    dense, moe, head = mine.block_flops(s, dense=True), mine.block_flops(s), mine.head_flops()
    assert fwd.get_total_flops() == b * s * (dense[0] + 2 * moe[0] + head[0])
    assert bwd.get_total_flops() == b * s * (dense[1] + dense[2] + 2 * (moe[1] + moe[2]) + head[1] + head[2])
    assert mine.model_flops(s) == sum(dense) + 2 * sum(moe) + sum(head)
    # A token's routed experts are 2 of the 8: the 6 others of each MoE block are idle.
    assert mine.parameters() - mine.active_parameters() == 2 * 6 * 3 * 64 * 32


def test_the_shipped_deepseek_v3_has_its_published_sizes() -> None:
    """The report's Table 1 and its Hugging Face card: 671B parameters, 37B of them a token's (the multi-token
    prediction module's 14B apart, which the config does not describe)."""
    model = from_hf_config("deepseek-v3")
    assert model.parameters() / 1e9 == pytest.approx(671.03, abs=0.01)
    assert model.active_parameters() / 1e9 == pytest.approx(37.55, abs=0.01)
    assert (model.layers, model.dense_layers, model.moe_blocks, model.experts, model.top_k) == (61, 3, 58, 256, 8)
    # The per-head widths as MLA's training runs them: queries and keys 128 + 64, values 128.
    assert (model.qk_dim, model.v_dim, model.k_width) == (192, 128, 128 * 192)
    assert "37.55B active" in model.describe() and "latent attention" in model.describe()


# An MoE model small enough to write out by hand: 4 blocks of width 1024, 16 experts of inner width 512 (gated:
# three matrices each), top 2, 8 heads (no grouped keys), a vocabulary of 32,000, no dense blocks, no shared experts.
SMALL = Transformer(name="small-moe", family="llama", layers=4, hidden=1024, heads=8, kv_heads=8, ffn=4096,
                    vocab=32000, experts=16, top_k=2, expert_ffn=512)
NVLINK, NDR = 450e9 * 0.8, 50e9 * 0.9  # h100-sxm.json's links, at their efficiencies


@pytest.mark.parametrize(("ep", "imbalance", "node_limit", "network", "node"), [
    # ep 8 in a node of 8: every copy to another rank of the node, 7 of a token's 8 ways.
    (8, 1.0, 0, 0, 2048 * 2 * 7 / 8 * 2048),
    (8, 1.5, 0, 0, 1.5 * 2048 * 2 * 7 / 8 * 2048),  # the busiest rank: 1.5 times the copies
    # ep 16 over 2 nodes of 8: half a token's copies cross to the other node, 7 in 16 stay on the node's links.
    (16, 1.0, 0, 2048 * 2 * 8 / 16 * 2048, 2048 * 2 * 7 / 16 * 2048),
    # Routed to 1 node of 2: the other one time in 2, crossing once (half a crossing a token, not one copy), then
    # forwarded on the node's links to the expert's rank unless it is the receiver's (7 in 8 of both copies).
    (16, 1.0, 1, 2048 * 0.5 * 2048, 2048 * 2 * 7 / 8 * 2048),
])
def test_the_all_to_alls_bytes_are_their_closed_form(ep: int, imbalance: float, node_limit: int, network: float,
                                                    node: float) -> None:
    """One dispatch (or combine) of a microbatch of one 2,048-token sequence from one rank: the copies its tokens
    send to their top-2 experts' ranks (2 bytes x 1,024 each), those that leave the rank only, on the link they
    cross; its time a latency and the slower link's bytes over its achieved bandwidth. An MoE block's forward has
    two (dispatch, combine) and its input-gradient backward two, in the stage's costs beside its compute."""
    from pipefold.plan.cluster_plan import Training, _Config, _costs, all_to_all

    cluster = load_cluster("h100-sxm").with_nodes(4)
    seconds, got_network, got_node = all_to_all(SMALL, cluster, tokens=2048, ep=ep, imbalance=imbalance,
                                                node_limit=node_limit)
    assert (got_network, got_node) == (pytest.approx(network, rel=1e-12), pytest.approx(node, rel=1e-12))
    latency = 1e-5 if ep > 8 else 5e-6
    assert seconds == pytest.approx(latency + max(network / NDR, node / NVLINK), rel=1e-12)
    training = Training(model=SMALL, seq=2048, global_batch=32, moe_imbalance=imbalance, node_limit=node_limit)
    cost, _ = _costs(cluster, training, _Config(dp=16, tp=1, pp=2, microbatch=1, recompute="none", ep=ep), 2,
                     False)
    for stage in cost.stage_overrides.values():  # 2 MoE blocks a stage, each two all-to-alls a pass
        assert stage.exchange_f == pytest.approx(2 * 2 * seconds, rel=1e-12)
        assert stage.exchange_b == pytest.approx(2 * 2 * seconds, rel=1e-12)
    assert cost.exchange_overlap


def test_each_rank_holds_its_experts_and_their_state_is_sharded_among_their_copies() -> None:
    """dp 16 x pp 2 with ep 8: each rank holds 2 of each MoE block's 16 experts (3 x 1,024 x 512 weights each),
    and ZeRO-1 shards their 12 bytes of optimizer state among the 2 copies that hold the same experts, the other
    parameters' among all 16; with ep 1 every rank holds all 16 experts, sharded among the 16. Computed here from
    the sizes: attention 4 x 1024^2, the router 16 x 1024, two norms, the embedding and the head 32,000 x 1,024."""
    from pipefold.plan.cluster_plan import Training, point

    cluster = load_cluster("h100-sxm").with_nodes(4)
    training = Training(model=SMALL, seq=2048, global_batch=32)
    block = 4 * 1024**2 + 16 * 1024 + 2 * 1024
    expert = 3 * 1024 * 512
    last = 2 * block + 1024 + 32000 * 1024  # the heavier stage: two blocks, the final norm and the head
    for ep, state in ((8, (6 + 12 / 2) * 2 * 2 * expert), (1, (6 + 12 / 16) * 2 * 16 * expert)):
        got = point(cluster, training, dp=16, ep=ep, tp=1, pp=2, schedule="1f1b", microbatch=1, sharding="zero1")
        assert got.static == pytest.approx((6 + 12 / 16) * last + state, rel=1e-12)
        assert got.ep == ep and got.layout == ("dp16 ep8 tp1 pp2" if ep == 8 else "dp16 tp1 pp2")
    # Unsharded: 18 bytes a parameter, the experts a rank holds only.
    plain = point(cluster, training, dp=16, ep=8, tp=1, pp=2, schedule="1f1b", microbatch=1)
    assert plain.static == pytest.approx(18 * (last + 2 * 2 * expert), rel=1e-12)


def test_the_routed_experts_compute_at_one_experts_product_and_1f1b_exposes_every_exchange() -> None:
    """A stage's forward: its blocks' other work at the efficiency of their largest other product (attention's
    1,024 x 1,024), the routed experts' tokens x top-k x their operations at the efficiency of one expert's product
    on the tokens a rank's experts get (2,048 x 2 copies over its 2 experts; 1.5 times both on the busiest rank),
    and the elementwise bytes. Plain 1F1B pairs nothing: the busiest device's exposed exchange is every microbatch's
    all-to-alls; DualPipe's overlapped pairs hide part of them."""
    from pipefold.plan.cluster_plan import Training, _Config, _costs, all_to_all, point

    cluster = load_cluster("h100-sxm").with_nodes(4)
    acc = cluster.accelerator
    peak, n, h, f = acc.peak("bf16"), 2048, 1024, 512
    training = Training(model=SMALL, seq=n, global_batch=32, moe_imbalance=1.5)
    cost, _ = _costs(cluster, training, _Config(dp=16, tp=1, pp=2, microbatch=1, recompute="none", ep=8), 2, False)
    matrices = 4 * h * h + 16 * h  # attention's four, the router
    scores = 4.0 * n * h
    routed = 2 * 2 * 3 * h * f * 1.5  # F of the busiest rank's copies, per token
    per_expert = n * 2 * 1.5 / 2
    kept = SMALL.saved(n).per_rank(1) + 0.5 * (SMALL.routed_saved().whole + SMALL.routed_saved().split)
    block_f = ((2 * matrices + scores) * n / (peak * acc.efficiency(2 * n * h * h))
               + routed * n / (peak * acc.efficiency(2 * per_expert * h * f)) + 2 * kept * n / acc.memory_bandwidth)
    assert cost.stage_overrides[0].f == pytest.approx(2 * block_f, rel=1e-12)
    plain = Training(model=SMALL, seq=n, global_batch=32)
    one = point(cluster, plain, dp=16, ep=8, tp=1, pp=2, schedule="1f1b", microbatch=1)
    exchange = all_to_all(SMALL, cluster, tokens=n, ep=8)[0]
    assert one.exchange_exposed == pytest.approx(one.microbatches * 2 * 4 * exchange, rel=1e-9)
    dual = point(cluster, Training(model=SMALL, seq=n, global_batch=64), dp=16, ep=8, tp=1, pp=2,
                 schedule="dualpipe", microbatch=1)
    assert dual.exchange_exposed < dual.microbatches * 2 * 4 * exchange
    assert dual.to_dict()["ep"] == 8 and dual.to_dict()["exchange_exposed"] == dual.exchange_exposed


def test_the_search_spreads_experts_where_their_state_leaves_it_nothing_faster(tmp_path: Path) -> None:
    """40B parameters, 38.7B of them in 64 experts a block (a Mixtral layout of fine-grained experts), on 4 nodes of
    8 H100s: with every expert on every rank (--ep 1), nothing fits unsharded on one device's share of dp x 1 x 1, and
    the best splits the model over tp and pp with FSDP; spreading the experts, the search's best is ep > 1 and
    faster."""
    from pipefold.plan.cluster_plan import Training, plan_cluster

    path = tmp_path / "wide.json"
    path.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 2048,
                                "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 8,
                                "vocab_size": 32000, "num_local_experts": 64, "num_experts_per_tok": 4}))
    model, cluster = from_hf_config(str(path)), load_cluster("h100-sxm").with_nodes(4)
    assert model.moe_blocks * model.expert_parameters() / 1e9 == pytest.approx(38.65, abs=0.01)
    one = plan_cluster(cluster, Training(model=model, seq=4096, global_batch=64, expert_parallel=(1,)),
                       families=("1f1b",))
    spread = plan_cluster(cluster, Training(model=model, seq=4096, global_batch=64), families=("1f1b",))
    assert one.best is not None and spread.best is not None
    assert not any(p.fits for p in one.points if p.tp == p.pp == 1 and p.sharding != "fsdp")
    assert one.best.ep == 1 and (one.best.tp > 1 or one.best.pp > 1)
    assert spread.best.ep > 1 and spread.best.step_time < 0.9 * one.best.step_time
    assert {p.ep for p in spread.points} == {1, 8}  # 64 divides no dp of 32 devices
    assert "1f1b:combined=1" in {p.schedule for p in spread.points}


@pytest.mark.parametrize(("argv", "expected"), [
    (["--hf-config", "llama3-8b", "--ep", "1,8"], "--ep prices the experts of a mixture-of-experts model, and "
                                                  "llama3-8b has none: drop --ep"),
    (["--hf-config", "llama3-8b", "--node-limit", "2"], "--node-limit prices the experts"),
    (["--ep", "3"], "ep 3 does not split mixtral-8x7b's 8 experts evenly: give ep one of 1, 2, 4, 8"),
    (["--hf-config", "deepseek-v3", "--ep", "64"], "no data-parallel degree of 8 devices (1, 2, 4, 8) is a multiple "
                                                   "of ep 64"),
    (["--ep", "0"], "expert-parallel degrees from 1 to"),
    (["--moe-imbalance", "0.5"], "--moe-imbalance: 0.5 is out of range: give a number >= 1"),
])
def test_bad_expert_parallel_plans_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                expected: str) -> None:
    base = {"--hf-config": "mixtral-8x7b", "--global-batch": "64", "--seq": "4096"}
    given = dict(zip(argv[::2], argv[1::2], strict=True))
    args = [x for k, v in {**base, **given}.items() for x in (k, v)]
    assert main(["plan", "--cluster", "h100-sxm", "--nodes", "1", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err


def test_an_ep_that_does_not_divide_dp_is_one_line() -> None:
    from pipefold.plan.cluster_plan import Training, point

    training = Training(model=from_hf_config("mixtral-8x7b"), seq=4096, global_batch=64)
    with pytest.raises(ConfigError, match=r"ep 8 does not divide dp 4: an ep group is ep of the data-parallel "
                                          r"copies; give ep one of 1, 2, 4") as info:
        point(load_cluster("h100-sxm").with_nodes(2), training, dp=4, ep=8, tp=1, pp=4, schedule="1f1b",
              microbatch=1)
    assert "\n" not in str(info.value)


def test_deepseek_v3s_published_run_is_predicted_from_its_description() -> None:
    """The published table's DeepSeek-V3 row (benchmarks/published_runs.json): the stored prediction is the code's
    (what ``published.py --check`` checks), from PP16 DualPipe x EP64 x ZeRO-1 over dp 128 on 256 nodes of the
    shipped h800 file, tokens routed to at most 4 nodes; the all-to-alls are what separate it from the same layout
    with every copy crossing on its own, and from 1F1B, which overlaps none of them (the page's figures)."""
    from conftest import load_benchmark

    published = load_benchmark("published.py")
    data = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "published_runs.json").read_text())
    run = next(r for r in data["runs"] if r["model"] == "deepseek-v3")
    assert (run["dp"], run["ep"], run["tp"], run["pp"], run["schedule"], run["node_limit"], run["sharding"]) == (
        128, 64, 1, 16, "dualpipe", 4, "zero1")
    assert published.published_tokens(run) == pytest.approx(1543.2, abs=0.05)
    assert published.predict(data, run) == run["predicted"]
    assert "uncosted" in run and "FP8" in run["uncosted"]
    spread = published.predict(data, {**run, "node_limit": 0})["tokens_per_second_per_gpu"]
    plain = published.predict(data, {**run, "schedule": "1f1b"})["tokens_per_second_per_gpu"]
    assert (spread, plain) == (pytest.approx(1317.0, abs=0.1), pytest.approx(1095.8, abs=0.1))
    assert plain < spread < run["predicted"]["tokens_per_second_per_gpu"]

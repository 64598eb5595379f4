"""The cluster planner's mixture-of-experts models: DeepSeek-V3's arithmetic (latent attention, shared experts, dense
first layers) against ``transformers``' own model, the expert-parallel dimension against closed forms computed here
(the all-to-alls' bytes, each rank's experts and their state), the refusals, and the search choosing ep > 1 where
the experts' state leaves it nothing else."""

from __future__ import annotations

import json
import math
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

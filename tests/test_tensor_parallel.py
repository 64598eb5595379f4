"""Tensor parallelism inside pipeline stages (``--tp``): each stage's layers split over tp ranks by the model's plan
with torch's ``parallelize_module``, on real gloo process groups; gradients against one process, weights after
several steps against the same pipeline without tensor parallelism, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_ranks
from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.models import make_model
from pipefold.models.base import Model
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.launch.settings import Parallel
from pipefold.train.prepare import make_job
from pipefold.train.reference import compare, reference_step
from pipefold.train.spec import RunSpec

TOLERANCE = 1e-5


def _spec(schedule: str, model: str, *, tp: int = 2, dp: int = 1, steps: int = 1, batch: int | None = None,
          optimizer: str = "sgd", **more: object) -> RunSpec:
    sizes = dict(heads=4, seq=16) if model == "gpt" else {}
    return RunSpec.flat(schedule=schedule, devices=2, microbatches=4, batch=batch or 4 * dp, steps=steps, model=model,
                        layers=4, hidden=32, partition="even", optimizer=optimizer, tp=tp, dp=dp, **sizes, **more)


@pytest.mark.parametrize(("schedule", "model", "dp", "more"), [
    ("zb-v", "gpt", 1, {}),                      # tp2 x pp2; B and W apart: W of a split Linear deferred
    ("interleaved-1f1b", "mlp", 1, {}),          # two stages per rank
    ("1f1b", "gpt", 2, {}),                      # dp2 x tp2 x pp2: 8 processes
    ("zb-v", "gpt", 2, {"fsdp": True}),          # FSDP over the dp copies of tensor-parallel shards (2-D DTensors)
    ("1f1b", "mlp", 1, {"recompute": "full"}),   # the recomputed forward all-reduces again, on every tp rank
    # Sequence parallelism: norms on each rank's tokens, gathered before the split Linears, reduce-scattered after
    ("zb-v", "gpt", 1, {"sequence_parallel": True}),                        # B and W apart
    ("interleaved-1f1b", "gpt", 1, {"sequence_parallel": True}),            # two stages per rank: a run each
    ("1f1b", "gpt", 2, {"sequence_parallel": True}),                        # dp2 x tp2 x pp2
    ("zb-h1", "gpt", 1, {"sequence_parallel": True, "recompute": "full"}),  # the rerun gathers and scatters again
])
def test_tensor_parallel_pipelines_match_one_process(schedule: str, model: str, dp: int,
                                                      more: dict[str, object]) -> None:
    job = make_job(_spec(schedule, model, dp=dp, check=True, **more))
    sizes = dict(heads=4, seq=16) if model == "gpt" else {}
    blocks = make_model(model, layers=4, hidden=32, **sizes).blocks  # type: ignore[arg-type]
    assert job.world == 4 * dp and set(job.tp_plan) == set(blocks)  # the gpt's embedding and head stay whole
    reports = run_local(job)
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff
    # The global gradient norm (what --clip scales by) counts each weight once: a part split over the tp ranks on
    # each of them, one they replicate on the first only, with FSDP's dp shards too (a norm's weight, sharded
    # over dp alone, was counted on every tp rank: 6.18 for 4.49 at dp 2 x tp 2).
    want = math.sqrt(sum(float(g.double().pow(2).sum()) for g in reference_step(job)[1].values()))
    assert all(r.steps.grad_norm[0] == pytest.approx(want, rel=1e-5) for r in reports), want


def test_sequence_parallelism_holds_less_and_trains_as_without_it() -> None:
    """tp 2 with and without sequence parallelism, three AdamW steps: the same weights to float32 rounding (only
    the order of sums differs), and every rank's activation peak lower with it (the norms' and the residual
    stream's bytes split over the tokens). A device of its own degree (tp 2,1) runs it on its two ranks."""
    runs = {}
    for sp in (False, True):
        spec = RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, batch=8, steps=3, model="gpt", layers=4,
                            hidden=64, heads=4, seq=32, partition="even", optimizer="adamw", tp=2,
                            sequence_parallel=sp)
        job = dataclasses.replace(make_job(spec), save_weights=True)
        runs[sp] = sorted(run_local(job), key=lambda r: r.rank)
    for plain, split in zip(runs[False], runs[True], strict=True):
        for name, w in plain.weights.items():
            torch.testing.assert_close(split.weights[name], w, rtol=1e-5, atol=1e-6)
        assert split.steps[-1].peak_activation_bytes < plain.steps[-1].peak_activation_bytes
    # The closed form on the first device (ranks 0 and 1), whose peak holds two microbatches of its two blocks in
    # 1F1B: each block's two LayerNorms keep their input (hidden float32s a token) and its mean and 1/std (two)
    # for 1/tp of the tokens; the Linears after them keep the gathered input whole, as without it.
    h, tp, tokens = 64, 2, 2 * 32
    per_token = 2 * (1 - 1 / tp) * (4 * h + 8)
    for plain, split in zip(runs[False][:2], runs[True][:2], strict=True):
        saved = plain.steps[-1].peak_activation_bytes - split.steps[-1].peak_activation_bytes
        assert saved == 2 * 2 * tokens * per_token, (saved, plain.rank)
    job = make_job(RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, batch=4, steps=1, model="gpt", layers=4,
                                hidden=32, heads=4, seq=16, partition="even", optimizer="sgd", tp=(2, 1),
                                sequence_parallel=True, check=True))
    diff = compare(job, run_local(job))
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff


def test_weights_after_several_steps_equal_the_pipeline_without_tensor_parallelism() -> None:
    weights = []
    for tp in (1, 2):
        job = dataclasses.replace(make_job(_spec("1f1b", "gpt", tp=tp, steps=3)), save_weights=True)
        reports = run_local(job)
        weights.append({k: w for r in reports for k, w in (r.weights or {}).items()})
        assert len(reports) == 2 * tp
    assert weights[0].keys() == weights[1].keys()
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_ranks_are_numbered_as_torchs_device_mesh() -> None:
    job = make_job(_spec("1f1b", "mlp", dp=2))
    mesh = torch.arange(job.world).reshape(2, 2, 2)  # (dp, pp, tp): how init_device_mesh numbers the ranks
    for rank in range(job.world):
        d, p, t = job.coords(rank)
        assert int(mesh[d, p, t]) == rank
    pipelines = job.pipeline_ranks()
    assert pipelines == [mesh[d, :, t].tolist() for d in range(2) for t in range(2)]
    assert sorted(r for ranks in pipelines for r in ranks) == list(range(job.world))


def test_zero1_over_tensor_parallel_shards_steps_as_one_process() -> None:
    """ZeRO-1 at dp2 x tp2 x pp2 (8 processes, AdamW): each pair of copies of a tensor-parallel shard splits its
    optimizer state and sends the stepped shards to the other. After three steps the weights are bit for bit those
    of the same layout without ZeRO-1, and equal one process's (to AdamW's rounding); the two copies of a shard
    hold 3/4 of the bytes they hold without it."""
    weights, static = [], []
    for tp, dp, zero1 in ((1, 1, False), (2, 2, False), (2, 2, True)):
        job = dataclasses.replace(make_job(_spec("1f1b", "gpt", tp=tp, dp=dp, steps=3, batch=8, zero1=zero1,
                                                 optimizer="adamw")), save_weights=True)
        reports = run_local(job)
        weights.append({k: w for r in reports for k, w in (r.weights or {}).items()})
        static.append({job.coords(r.rank): r.static_bytes for r in reports})  # by (copy, device, tp rank)
    assert weights[0].keys() == weights[1].keys() == weights[2].keys()
    for name, w in weights[0].items():
        assert torch.equal(weights[2][name], weights[1][name]), name
        torch.testing.assert_close(weights[2][name], w, rtol=1e-4, atol=1e-5, msg=name)
    # Without ZeRO-1 a rank holds its parameters P, their gradients P and AdamW's two moments 2P; with it the
    # moments of its share: the two copies of a shard hold 2 x 2P + 2P together, 3/4 of 2 x 4P.
    plain, sharded = static[1], static[2]
    for d, p, t in plain:
        assert sharded[d, p, t] < plain[d, p, t]
        if d == 0:
            together = sharded[0, p, t] + sharded[1, p, t]
            assert together == pytest.approx(0.75 * (plain[0, p, t] + plain[1, p, t]), rel=0.02), (p, t)


@pytest.mark.parametrize(("settings", "expected"), [
    ({"model": "mlp", "sequence_parallel": True, "tp": 2}, "the mlp model declares no sequence-parallel plan"),
    ({"model": "gpt", "sequence_parallel": True, "seq": 18, "tp": 4},
     "--tp 4 splits --seq (split by --sequence-parallel) = 18 unevenly"),
    (dict(model="gpt", heads=4, seq=16, tp=3), "--tp 3 splits --heads = 4 unevenly"),
    (dict(model="mlp", hidden=6, tp=5), "--tp 5 splits --hidden (its inner width, 4 x hidden) = 24 unevenly"),
    (dict(model="mlp", tp=2, offload="1,1"), "does not run with --offload yet"),
    (dict(model="mlp", tp=0), "--tp is the number of tensor-parallel ranks"),
])
def test_bad_tensor_parallel_settings_are_one_line(settings: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)) as info:
        make_job(RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, batch=8, partition="even",
                              **settings))  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_a_model_without_a_plan_is_refused_in_one_line() -> None:
    class Plain(Model):  # a model that declares no tensor-parallel plan
        name, num_layers = "plain", 2

        def build_layers(self, indices, *, device="cpu"):  # type: ignore[no-untyped-def]
            return {}

        def loss(self, out, target):  # type: ignore[no-untyped-def]
            return out

        def batch_at(self, step):  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(ConfigError, match="declares no tensor-parallel plan: use --tp 1"):
        Plain().tp_plan(0)
    assert Parallel(tp=4).tp == 4


GPT = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "8",
       "--devices", "2", "--microbatches", "4", "--partition", "even", "--schedule", "1f1b"]


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["train", *GPT, *argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)  # type: ignore[no-any-return]


def test_checkpoints_resume_on_another_tensor_parallel_degree(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    """DCP reads each rank's part whatever split wrote it: saved at tp 2 and resumed at tp 1, the model equals six
    steps at tp 1 in one run; saved at tp 1 and resumed at tp 2 (AdamW's state comes back as shards of the new
    split), so do the losses and the model it writes."""
    straight = _train(capsys, "--steps", "6", "--save-model", str(tmp_path / "whole.pt"))
    first = _train(capsys, "--tp", "2", "--steps", "3", "--checkpoint-dir", str(tmp_path / "a"))
    then = _train(capsys, "--steps", "6", "--checkpoint-dir", str(tmp_path / "a"), "--resume",
                  "--save-model", str(tmp_path / "resumed.pt"))
    assert then["first_step"] == 4
    torch.testing.assert_close(first["loss"] + then["loss"], straight["loss"], rtol=1e-6, atol=0)
    whole, resumed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert whole.keys() == resumed.keys()
    for name, w in whole.items():
        torch.testing.assert_close(resumed[name], w, rtol=1e-4, atol=1e-5, msg=name)
    first = _train(capsys, "--steps", "3", "--checkpoint-dir", str(tmp_path / "b"))
    then = _train(capsys, "--tp", "2", "--steps", "6", "--checkpoint-dir", str(tmp_path / "b"), "--resume",
                  "--save-model", str(tmp_path / "split.pt"))
    assert then["first_step"] == 4 and then["tp"] == 2
    torch.testing.assert_close(first["loss"] + then["loss"], straight["loss"], rtol=1e-6, atol=0)
    # --save-model gathers each split weight whole (a collective of its tensor-parallel ranks): the plain model's.
    split = torch.load(tmp_path / "split.pt")
    assert split.keys() == whole.keys()
    for name, w in whole.items():
        assert type(split[name]) is torch.Tensor
        torch.testing.assert_close(split[name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_a_hugging_face_llama_splits_by_transformers_own_plan() -> None:
    """LLaMA's blocks split as transformers' ``base_model_tp_plan`` says (q, k, v, gate and up column-wise, o and
    down row-wise), with B and W apart; attention reads the number of heads from the width it gets."""
    pytest.importorskip("transformers")
    spec = RunSpec.flat(schedule="zb-v", devices=2, microbatches=4, batch=4, steps=1, model="llama", seq=16,
                        partition="even", optimizer="sgd", tp=2, check=True)
    job = make_job(spec)
    assert job.tp_plan[1]["block.self_attn.q_proj"] == "colwise" and job.tp_plan[1]["block.mlp.down_proj"] == "rowwise"
    diff = compare(job, run_local(job))
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff


@pytest.mark.parametrize(("model", "tp", "expected"), [
    ("gpt2", 2, "transformers ships no tensor-parallel plan for gpt2: use --tp 1"),
    ("llama", 3, "--tp 3 splits num_attention_heads = 4 unevenly"),
    ("llama", 4, "--tp 4 splits num_key_value_heads = 2 unevenly"),  # grouped-query attention: 2 kv heads
])
def test_hugging_face_models_refuse_what_their_plan_cannot_split(model: str, tp: int, expected: str) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match=re.escape(expected)) as info:
        make_job(RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, batch=4, model=model, seq=16,
                              partition="even", tp=tp))
    assert "\n" not in str(info.value)


def test_zero1_checkpoints_of_tensor_parallel_shards_resume_anywhere(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    """Each copy saves the state of its share only, as tensor-parallel shards: saved at dp2 x tp2 with ZeRO-1,
    resumed at dp2 x tp1 without it (every rank reads the whole state back, joined from both copies' shares and
    both tp ranks' shards), and saved at tp 1 resumed at tp 2 with ZeRO-1: the losses are six straight steps'."""
    straight = _train(capsys, "--dp", "2", "--optimizer", "adamw", "--steps", "6")
    first = _train(capsys, "--dp", "2", "--tp", "2", "--zero1", "--optimizer", "adamw", "--steps", "3",
                   "--checkpoint-dir", str(tmp_path / "a"))
    then = _train(capsys, "--dp", "2", "--optimizer", "adamw", "--steps", "6", "--checkpoint-dir", str(tmp_path / "a"),
                  "--resume")
    assert first["sharding"] == "zero1" and then["first_step"] == 4
    torch.testing.assert_close(first["loss"] + then["loss"], straight["loss"], rtol=1e-5, atol=0)
    first = _train(capsys, "--dp", "2", "--optimizer", "adamw", "--steps", "3", "--checkpoint-dir", str(tmp_path / "b"))
    then = _train(capsys, "--dp", "2", "--tp", "2", "--zero1", "--optimizer", "adamw", "--steps", "6",
                  "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    assert then["first_step"] == 4 and then["tp"] == 2
    torch.testing.assert_close(first["loss"] + then["loss"], straight["loss"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["sgd", "adamw", "kfac"])
def test_the_optimizers_step_a_rank_that_mixes_sharded_and_whole_layers(name: str, tmp_path: Path) -> None:
    """A tp rank holds DTensors (sharded layers) and plain tensors (whole ones). torch's list kernels refuse such a
    list, and they are its default on CUDA (on the CPU it is off), where a first GPU run of ``--tp 2`` failed at the
    first step. Forced here on the CPU, torch's own optimizer shows the failure; pipefold's turns them off for such
    a list only, and steps every tensor as an optimizer given each tensor alone would."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipefold.runtime.launch.settings import OPTIMIZERS, Optimizer

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        whole = [torch.randn(4, 3), torch.randn(3)]
        grads = [torch.randn_like(t) for t in whole]

        def params() -> list[torch.nn.Parameter]:
            ps = [torch.nn.Parameter(distribute_tensor(whole[0].clone(), mesh, [Shard(0)])),
                  torch.nn.Parameter(whole[1].clone())]
            for p, g in zip(ps, grads, strict=True):
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)]) if p is ps[0] else g.clone()
            return ps

        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            OPTIMIZERS[name](params(), lr=0.1, foreach=True).step()
        mixed = params()
        made = Optimizer(name=name, lr=0.1).make(mixed)
        assert made.defaults["foreach"] is False
        assert Optimizer(name=name, lr=0.1).make(mixed[1:]).defaults["foreach"] is None  # torch's own default
        made.step()
        made.step()
        for i, p in enumerate(mixed):
            alone = torch.nn.Parameter(whole[i].clone())
            alone.grad = grads[i].clone()
            reference = OPTIMIZERS[name]([alone], lr=0.1)
            reference.step()
            reference.step()
            got = p.full_tensor() if i == 0 else p
            assert torch.equal(got.detach(), alone.detach()), name
    finally:
        dist.destroy_process_group()


def _gathers(rank: int, init: str, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from pipefold.runtime.sharding import gather_on_host

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        whole = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7)  # 5 and 7 split unevenly in two
        cases = {f"{[str(p) for p in ps]}": distribute_tensor(whole, mesh, ps)
                 for ps in ([Shard(0), Shard(1)], [Shard(1), Shard(0)], [Replicate(), Shard(1)],
                            [Shard(0), Replicate()], [Replicate(), Replicate()], [Shard(1), Shard(1)])}
        cases["tp only, Shard(0)"] = distribute_tensor(whole, mesh["tp"], [Shard(0)])
        mine = torch.full((5, 7), float(rank))  # each rank's part of a sum
        cases["Partial, Shard(1)"] = DTensor.from_local(mine.chunk(2, dim=1)[rank % 2], mesh, [Partial(), Shard(1)],
                                                        shape=(5, 7), stride=(7, 1), run_check=False)
        got = {name: bool(torch.equal(gather_on_host(d), d.full_tensor())) for name, d in cases.items()}
        out.put((rank, got, float(cases["Partial, Shard(1)"].full_tensor()[0, 0])))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_shards_gathered_on_the_host_equal_dtensors_own_gather() -> None:
    """``sharding.gather_on_host`` (what ``--check`` and checkpoints use where gloo cannot gather GPU tensors) against
    DTensor's ``full_tensor`` on a 2 x 2 mesh: uneven shards of either dimension, replicas, a sum, a 1-D mesh,
    and two mesh dimensions sharding one tensor dimension (left to DTensor)."""
    results = run_ranks(_gathers, 4)
    assert len(results) == 4
    for rank, got, partial in results:
        assert all(got.values()), (rank, got)
        assert len(got) == 8 and partial == 0 + 2  # ranks 0 and 2 (one tp column's dp pair) summed

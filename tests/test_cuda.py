"""Ranks on a CUDA GPU: every schedule's gradients equal one process's on the same GPU, the B/W split,
recomputation, offloading, replicas, overlapped pairs on two streams, K-FAC and data parallelism included;
the memory meter against the caching allocator.

Tests marked ``cuda`` are skipped where torch sees no GPU (CI); ``make gpu-check`` runs them on a machine with
one. On one GPU the ranks share it: gloo moves their tensors through pinned host memory
(:mod:`pipefold.runtime.launch.devices`). The device and backend refusals run everywhere.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pipefold import names
from pipefold.errors import ConfigError
from pipefold.ir import Kind
from pipefold.ir.ref import ScheduleRef
from pipefold.runtime.launch.devices import check_sharding, place
from pipefold.runtime.launch.job import Job, RankReport
from pipefold.runtime.launch.local import run_local
from pipefold.schedules import build
from pipefold.train.prepare import make_job
from pipefold.train.reference import compare, reference_kfac
from pipefold.train.run import train
from pipefold.train.spec import RunSpec

GPU = torch.cuda.is_available()
cuda = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU: run `make gpu-check` on a machine with one")
TOLERANCE = 1e-5
# Sizes stay small: every run starts its ranks' CUDA contexts. PIPEFOLD_GPU_TEST_SCALE=2 doubles the widths.
SCALE = int(os.environ.get("PIPEFOLD_GPU_TEST_SCALE", "1"))


def _gpt(name: str, ranks: int, **options: int) -> RunSpec:
    stages = build(name, ranks, 2 * ranks, **options).stages
    return RunSpec.flat(schedule=str(ScheduleRef.named(name, options)), devices=ranks, microbatches=2 * ranks,
                       steps=1, model="gpt", layers=2 * stages - 2, hidden=32 * SCALE, heads=2, seq=32,
                       batch=2 * ranks, partition="even", device="cuda")


# -- refusals: one line each, on any machine

def test_cuda_without_a_gpu_is_one_line() -> None:
    with pytest.raises(ConfigError, match="torch sees no CUDA GPU") as info:
        place("cuda", ranks=2, gpus=0)
    assert "\n" not in str(info.value) and "--device cpu" in str(info.value)


def test_nccl_wants_a_gpu_per_rank_and_the_gpu() -> None:
    with pytest.raises(ConfigError, match="4 ranks on 1 GPU") as info:
        place("cuda", "nccl", ranks=4, gpus=1)
    assert "--backend gloo" in str(info.value)
    with pytest.raises(ConfigError, match="NCCL moves GPU tensors only"):
        place("cpu", "nccl", ranks=2)
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        place("tpu")


def test_auto_picks_by_what_is_there() -> None:
    assert place("auto", ranks=4, gpus=0) == place("cpu")
    assert (place("auto", ranks=4, gpus=1).backend, place("auto", ranks=4, gpus=1).staged) == ("gloo", True)
    assert (place("auto", ranks=4, gpus=8).backend, place("auto", ranks=4, gpus=8).staged) == ("nccl", False)
    assert [place("cuda", ranks=4, gpus=2).device_of(r).index for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.skipif(GPU, reason="checks the refusal on a machine without a GPU")
def test_train_device_cuda_refused_without_a_gpu() -> None:
    with pytest.raises(ConfigError, match="torch sees no CUDA GPU"):
        make_job(_gpt("1f1b", 2).replace(device="cuda"))


@pytest.mark.skipif(GPU, reason="checks the refusals of a machine without a GPU")
@pytest.mark.parametrize(("argv", "expected"), [
    (["--device", "cuda"], "torch sees no CUDA GPU"),
    (["--backend", "nccl"], "NCCL moves GPU tensors only"),
    (["--device", "cpu", "--backend", "nccl"], "NCCL moves GPU tensors only"),
    (["--device", "cuda", "--backend", "nccl", "--no-overlap"], "torch sees no CUDA GPU"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_cli_device_refusals_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                          expected: str) -> None:
    from pipefold.cli.main import main

    try:
        code = main(["train", "--model", "mlp", "--layers", "4", "--hidden", "16", "--batch", "8", "--devices", "2",
                     "--microbatches", "4", *argv])
    except SystemExit as exc:  # argparse's own refusal of a choice
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err


def test_a_model_too_big_for_the_gpu_is_one_line() -> None:
    from pipefold.models import make_model
    from pipefold.models.size import check_model

    model = make_model("gpt", layers=64, hidden=8192, heads=64, seq=2048, batch=8, seed=0)
    with pytest.raises(ConfigError, match="on each GPU") as info:
        check_model(model, gpu=(1, 80 * 2**30), microbatches=8, ranks=4, copies=4, what="training gpt")
    assert "\n" not in str(info.value) and "or less" in str(info.value)


# -- the shared-GPU transport's path, on the CPU: a copy to send, a copy on arrival


def _staged(job: Job) -> Job:
    return dataclasses.replace(job, extra={**job.extra, "stage_through_host": True})


@pytest.mark.parametrize(("name", "ranks"), [("1f1b", 2), ("zb-v", 2), ("dualpipev", 4), ("chimera", 4),
                                             ("interleaved-1f1b", 2)])
def test_sends_staged_through_host_copies_keep_the_gradients(name: str, ranks: int) -> None:
    config = _gpt(name, ranks).replace(device="cpu", steps=2)
    job = _staged(make_job(config.replace(check=True)))
    reports = run_local(job)
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff


def test_staged_receives_hold_device_memory_only_once_landed() -> None:
    """Through host memory, a message takes the receiver's device memory only when it is taken (copied in), not
    while it is posted ahead and in flight: rank 0's receive buffers at its peak are fewer than with direct
    receives, whose buffers are on the device from their posting. The gradients are the same either way."""
    config = _gpt("gpipe", 2).replace(device="cpu", microbatches=8, batch=8, hidden=64, seq=64)
    job = make_job(config.replace(check=True))
    direct, staged = run_local(job), run_local(_staged(job))
    recv = [next(r for r in reports if r.rank == 0).steps[0].peak_by_kind["recv"] for reports in (direct, staged)]
    message = 8 // 8 * 64 * 64 * 4  # one microbatch's activation gradient: 1 x 64 x 64 float32
    assert recv == [2 * message, message]  # posted one action ahead, against only the one being used
    assert compare(job, staged)["max_grad_rel_diff"] < TOLERANCE


# -- on the GPU

_ON_4 = ("1f1b", "zb-v", "v-half", "dualpipev", "chimera")


@cuda
@pytest.mark.parametrize(("name", "ranks"), [(n, 2) for n in names()] + [(n, 4) for n in _ON_4])
def test_every_schedule_matches_one_process_on_the_gpu(name: str, ranks: int) -> None:
    job, reports = train(_gpt(name, ranks).replace(check=True))
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff


@cuda
@pytest.mark.parametrize("name", ["dualpipev", "dualpipe"])
@pytest.mark.parametrize("overlap", [True, False])
def test_overlapped_pairs_on_two_streams_match(name: str, overlap: bool) -> None:
    job, reports = train(_gpt(name, 4).replace(overlap=overlap, steps=2, check=True))
    assert any(len(a.passes) == 2 for row in job.schedule.actions for a in row)
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff


@cuda
@pytest.mark.parametrize(("name", "share"), [("gpipe", "all"), ("zb-v", "all"), ("interleaved-1f1b", 0.5)])
def test_offloaded_activations_on_copy_streams_keep_the_gradients(name: str, share: str | float) -> None:
    job, reports = train(_gpt(name, 2).replace(offload_activations=share, check=True))
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff
    assert any(r.steps[-1].offloaded for r in reports)


@cuda
@pytest.mark.parametrize("memory", ["recompute", "offload"])
@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_recomputed_and_offloaded_stages_on_the_gpu(name: str, memory: str) -> None:
    extra = {"recompute": "full"} if memory == "recompute" else {"offload": (1, 1)}
    job, reports = train(_gpt(name, 2).replace(**extra, check=True))  # type: ignore[arg-type]
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff


@cuda
@pytest.mark.parametrize(("name", "recipe"), [
    ("1f1b", {"dtype": "bf16"}), ("zb-v", {"dtype": "bf16"}), ("zb-h1", {"dtype": "fp16"}),
    ("dualpipev", {"dtype": "bf16", "master_weights": True}), ("zb-v", {"compile": "split"}),
    ("dualpipev", {"compile": "whole", "dtype": "bf16"}), ("zb-h1", {"compile": "split", "dtype": "bf16"}),
    ("zb-v", {"dtype": "bf16", "offload": (1, 1)}), ("1f1b", {"dtype": "bf16", "recompute": "full"})])
def test_mixed_precision_and_compiled_stages_on_the_gpu(name: str, recipe: dict[str, object]) -> None:
    """bf16 and fp16 (autocast, master weights) and inductor-compiled stages (Triton on the GPU; dualpipev's pairs on
    two streams), offloaded (autocast on the device the layers compute on, their parameters at home in host memory)
    and recomputed, against one process running the same recipe on the same GPU."""
    job, reports = train(_gpt(name, 2 if name != "dualpipev" else 4).replace(**recipe, check=True))
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff


def test_fsdp_on_a_shared_gpu_is_one_line() -> None:
    # Ranks sharing a GPU talk gloo, which cannot all-gather or reduce-scatter GPU tensors: a rank running FSDP
    # there died of SIGSEGV (H200, torch 2.11). NCCL with a GPU per rank may, and all-reduce (dp, ZeRO-1) works.
    for shared in (place("cuda", ranks=4, gpus=1), place("cuda", "gloo", ranks=4, gpus=4)):
        with pytest.raises(ConfigError, match="needs NCCL and a GPU per rank") as info:
            check_sharding(shared, fsdp=True)
        assert "\n" not in str(info.value)
        check_sharding(shared, fsdp=False)
    check_sharding(place("cuda", ranks=4, gpus=4), fsdp=True)
    check_sharding(place("cpu", ranks=4), fsdp=True)


@cuda
def test_fsdp_refused_before_any_rank_starts_on_one_gpu() -> None:
    config = _gpt("1f1b", 2).replace(dp=2, batch=8, fsdp=True)
    with pytest.raises(ConfigError, match="needs NCCL"):
        make_job(config)


@cuda
@pytest.mark.parametrize(("schedule", "how"), [("1f1b", "all-reduce"), ("zb-v", "zero1")])
def test_data_parallel_pipelines_on_the_gpu(schedule: str, how: str) -> None:
    config = _gpt(schedule, 2).replace(dp=2, batch=8, zero1=how == "zero1", steps=2)
    job = dataclasses.replace(make_job(config.replace(check=True)), save_weights=True)
    reports = run_local(job)
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff
    weights: dict[str, list[torch.Tensor]] = {}
    for r in reports:
        for k, w in (r.weights or {}).items():
            weights.setdefault(k, []).append(w)
    assert all(torch.equal(ws[0], w) for ws in weights.values() for w in ws)  # the copies stay identical


def _weights(reports: list[RankReport]) -> dict[str, torch.Tensor]:
    return {k: v for r in reports for k, v in (r.weights or {}).items()}


@cuda
@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_tensor_parallel_stages_on_the_gpu(name: str) -> None:
    """tp 2 x pp 2 on one GPU: the tensor-parallel all-reduces of GPU tensors go over gloo (which has them)."""
    job, reports = train(_gpt(name, 2).replace(tp=2, heads=2, check=True))
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff


@cuda
def test_kfac_in_the_bubbles_on_the_gpu() -> None:
    config = _gpt("1f1b", 2).replace(optimizer="kfac", fill_bubbles=True, lr=0.02, damping=0.05)
    job = make_job(config.replace(check=True))
    steps = 2 * len(job.cycle) + 2
    job = dataclasses.replace(job, steps=steps, save_weights=True)
    assert any(a.kind == Kind.KI for s in job.cycle for row in s.actions for a in row)
    reports = run_local(job)
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff
    got, want = _weights(reports), reference_kfac(job, steps, reports)  # the reference on the CPU
    worst = max(float((got[k] - w).abs().max() / (w.abs().max() + 1e-12)) for k, w in want.items())
    assert worst < 1e-3, worst


@cuda
@pytest.mark.parametrize("name", ["1f1b", "v-half", "zb-v"])
def test_meter_and_allocator_agree_between_actions(name: str) -> None:
    """Between two actions the caching allocator holds what the meter says the step holds (no temporaries are
    alive then), within 5%; its peak over the step, temporaries included, is at least the meter's. MemTracker on
    the GPU agrees with the meter too, and counts the messages staged through host memory apart (they once made
    it 4 to 8 MiB higher than the meter and the allocator at gpu-check's size)."""
    config = _gpt(name, 2).replace(hidden=256, seq=128, batch=8, microbatches=4, steps=2)
    job: Job = dataclasses.replace(make_job(config), verify_memory_step=1)
    for r in run_local(job):
        check = r.steps[1].memory_check
        meter, allocator = check["meter_between_actions"], check["allocator_between_actions"]
        assert abs(allocator - meter) <= 0.05 * meter, check
        assert check["allocator_peak"] >= meter, check
        assert abs(check["tracker_between_actions"] - meter) <= 0.03 * meter, check
        assert check["tracker_elsewhere_between_actions"] > 0, check  # a message in pinned host memory


@cuda
def test_calibrate_times_the_gpus_bf16_products_under_its_peak(tmp_path) -> None:
    """pipefold calibrate on the GPU: bf16 products from 1e8 to 1e11 operations, each under the shipped file's
    peak, the largest at a rate a tensor core reaches (over a fifth of the peak), and the file written."""
    import contextlib
    import io
    import json

    from pipefold.cli.main import main
    from pipefold.plan.cluster import load_cluster, shipped_for

    shipped = shipped_for(torch.cuda.get_device_name(0))
    out = tmp_path / "here.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["calibrate", "--cluster", shipped, "--device", "cuda", "--largest", "1e11", "-o", str(out),
                     "--json"]) == 0
    products = json.loads(buf.getvalue())["products"]
    assert all(0 < p["fraction"] <= 1 for p in products)
    assert products[-1]["fraction"] > 0.2, products[-1]
    assert len(load_cluster(str(out)).accelerator.matmul_efficiency) == len(products)


@cuda
def test_host_chunks_leave_the_allocator_their_state_and_step_as_the_gpu_does() -> None:
    """One GPU, AdamW over a stack of Linears: with every chunk in (pinned) host memory the CUDA allocator holds the
    parameters and gradients alone after the steps, AdamW's two moments less than the plain optimizer's; the
    weights equal the GPU-stepped ones to float32 rounding (the host's steps are the CPU's arithmetic)."""
    import copy

    from torch import nn

    from pipefold.runtime.chunks import ChunkedOptimizer

    torch.manual_seed(0)
    width = 512 * SCALE
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4))).cuda()
    twin = copy.deepcopy(model)
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    levels = {}
    for name, m, opt in (("plain", twin, make(list(twin.parameters()))),
                         ("chunks", model, ChunkedOptimizer(list(model.parameters()), make, free=lambda: 0.0))):
        for step in range(3):
            x = torch.randn(64, width, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            opt.zero_grad(set_to_none=False)
            m(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
        levels[name] = torch.cuda.memory_allocated()
    params = sum(p.numel() for p in model.parameters())
    assert levels["plain"] - levels["chunks"] >= 0.95 * 8 * params, levels
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@cuda
def test_master_chunks_in_host_memory_leave_the_allocator_the_bf16_parameters() -> None:
    """bf16 parameters with float32 master weights on one GPU, AdamW: with every chunk (masters, their gradients,
    the moments) in pinned host memory the allocator holds at least 16 bytes a parameter less than plain master
    weights after the steps (4 + 4 + 8), and the masters equal the GPU-stepped ones to float32 rounding."""
    import copy

    from torch import nn

    from pipefold.runtime.chunks import ChunkedOptimizer
    from pipefold.runtime.precision import Masters, PrecisionOptimizer

    torch.manual_seed(0)
    width = 512 * SCALE
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4))).cuda()
    twin = copy.deepcopy(model)
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    levels, masters = {}, {}
    for name, m in (("plain", twin), ("chunks", model)):
        held = Masters(list(m.parameters()), torch.bfloat16)
        inner = make if name == "plain" else (lambda ms, held=held: ChunkedOptimizer(ms, make, masters=held,
                                                                                      free=lambda: 0.0))
        opt = PrecisionOptimizer(inner, list(m.parameters()), held, lambda: False)
        for step in range(3):
            x = torch.randn(64, width, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            opt.zero_grad()
            m(x.bfloat16()).float().square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
        levels[name] = torch.cuda.memory_allocated()
        masters[name] = [t.detach().cpu() for t in held.masters]
    params = sum(p.numel() for p in model.parameters())
    assert levels["plain"] - levels["chunks"] >= 0.95 * 16 * params, levels
    for a, b in zip(masters["chunks"], masters["plain"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

"""What a rank holds during a step: the meter against torch's MemTracker, sends released on delivery, B's release.

Real runs on gloo ranks, with tensors of hundreds of kB (a GPT of width 128 over 128 tokens, an MLP of
width 512 over 128 rows per microbatch): the effects measured here would vanish in rounding at toy sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipefold.runtime.executor import in_flight_bound
from pipefold.runtime.launch.job import RankReport
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.stage import Chain, StageRunner
from pipefold.schedules import build
from pipefold.train.prepare import make_job
from pipefold.train.spec import RunSpec

GPT = dict(model="gpt", layers=6, hidden=128, heads=4, seq=128, batch=16)
MLP = dict(model="mlp", layers=8, hidden=512, batch=1024)


def _run(model: dict[str, object], schedule: str, ranks: int, *, verify: bool = False, steps: int = 2,
         **options: object) -> tuple[object, list[RankReport]]:
    config = RunSpec.flat(schedule=schedule, devices=ranks, microbatches=8, steps=steps, partition="even",
                         **model, **options)  # type: ignore[arg-type]
    job = make_job(config)
    if verify:
        job = dataclasses.replace(job, verify_memory_step=steps - 1)
    return job, run_local(job)


@pytest.mark.parametrize(("model", "schedule", "ranks"), [(GPT, "zb-v", 2), (GPT, "1f1b", 2), (MLP, "v-half", 2),
                                                          (MLP, "zb-h1", 4), (GPT, "chimera", 2),
                                                          (MLP, "dualpipev", 2)])
def test_meter_agrees_with_torch_memtracker(model: dict[str, object], schedule: str, ranks: int) -> None:
    _, reports = _run(model, schedule, ranks, verify=True)
    for r in reports:
        stats = r.steps[-1]
        check = stats.memory_check
        held = check["meter_between_actions"]
        assert held > 500_000  # sizes where a missed or doubled tensor shows
        # After every action, what the meter counts is what torch saw created during the step and still alive.
        assert abs(check["tracker_between_actions"] - held) <= 0.03 * held, (r.rank, check)
        assert check["largest_gap"] <= 0.03 * held, (r.rank, check)
        assert check["tracker_elsewhere_between_actions"] == 0, check  # the CPU: one device
        # Within an action the tracker also sees the operations' temporaries, never less than the meter.
        assert check["tracker_peak"] >= stats.peak_activation_bytes >= held
        # The batch is reported apart, as it was before the step: a microbatch view is never charged the batch.
        if r.rank == 0:
            assert stats.batch_bytes > 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_meter_against_the_cuda_allocator() -> None:
    _, reports = _run(GPT, "zb-v", 2, verify=True)
    for r in reports:
        check = r.steps[-1].memory_check
        # The allocator counts what the tracker counts (in blocks of 512 bytes) and never less than the meter.
        assert check["meter_between_actions"] <= check["allocator_peak"]
        assert abs(check["allocator_peak"] - check["tracker_peak"]) <= 0.05 * check["tracker_peak"], check


@pytest.mark.parametrize(("schedule", "ranks"), [("gpipe", 2), ("1f1b", 4), ("zb-v", 2), ("v-half", 4),
                                                 ("interleaved-1f1b", 2)])
def test_sends_are_released_on_delivery(schedule: str, ranks: int) -> None:
    job, reports = _run(MLP, schedule, ranks)
    for r in reports:
        for step, stats in enumerate(r.steps):
            # The first step sends a shape header before each stage's first message.
            bound = in_flight_bound(job.schedule, r.rank, headers=step == 0)  # type: ignore[attr-defined]
            assert stats.link_bytes, "a rank of a pipeline sends something"
            for peer, most in stats.link_bytes.items():
                assert 0 < most <= bound[peer] * stats.link_message_bytes[peer], (r.rank, peer, most, bound)
            # Every send was delivered and let go, every W ran: the step ends holding nothing.
            assert stats.memory_curve[-1][1] == 0


def test_in_flight_bound_closed_forms() -> None:
    p, m = 4, 16
    one = build("1f1b", p, m)
    for i in range(p):
        bound = in_flight_bound(one, i)
        # Forward link: the warm-up sends p - i activations before the first gradient comes back.
        if i + 1 < p:
            assert bound[i + 1] == p - i
        # Backward link: a gradient is known received only once the next forward's activation arrives.
        if i > 0:
            assert bound[i - 1] == p - i + 1
    gpipe = build("gpipe", p, m)
    assert all(set(in_flight_bound(gpipe, i).values()) == {m} for i in range(p))  # nothing confirms before the end


def test_b_keeps_only_what_w_reads_in_a_gpt_block() -> None:
    from pipefold.models import GPTConfig, build_gpt_layers

    batch, seq, width = 2, 64, 64
    cfg = GPTConfig(n_layer=1, n_embd=width, n_head=4, block_size=seq)
    block = build_gpt_layers(cfg, [1], seed=0)[1]  # layer 1: the transformer block
    runner = StageRunner(Chain(block))
    x = torch.randn(batch, seq, width)
    g = torch.randn(batch, seq, width)
    runner.meter.hold([x, g], "recv")
    runner.forward(0, (x,))
    runner.backward_input(0, (g,))
    h = batch * seq * width * 4  # one activation of the block's width
    # W reads each Linear's input (qkv: ln1's output, the projection: attention's output, fc: ln2's output, the
    # second projection: the GELU's, 4 wide) and the gradient entering each: 1+1+1+4 inputs, 3+1+4+1 gradients.
    # The layer norms' weight gradients, sums over the batch, were taken in B: their inputs are gone.
    assert runner.memory_w == 16 * h
    runner.backward_weight(0)

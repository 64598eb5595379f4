"""Context parallelism's ring attention against one process attending over the whole sequence: outputs and the
gradients of queries, keys and values, several ring sizes, grouped key-value heads, and a ring that is a subgroup
of the world."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from conftest import run_ranks
from pipefold.runtime.context import positions, ring_attention, shard_sequence, unshard_sequence


def _whole(seed: int, heads: int, kv_heads: int, length: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, length, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, length, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    up = torch.randn(2, heads, length, 8, generator=gen, dtype=torch.float64)  # the gradient of the output
    return q, k, v, up


def _ring(rank: int, init: str, world: int, cp: int, heads: int, kv_heads: int, length: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        # The rings are consecutive ranks: world // cp of them, each its own subgroup when there are several.
        groups = [dist.new_group(list(range(g * cp, (g + 1) * cp))) for g in range(world // cp)]
        group = groups[rank // cp] if world > cp else None
        me = rank % cp
        q, k, v, up = _whole(rank // cp, heads, kv_heads, length)
        mine = [shard_sequence(t, cp, me, dim=2).clone().requires_grad_(True) for t in (q, k, v)]
        got = ring_attention(*mine, group=group)
        got.backward(shard_sequence(up, cp, me, dim=2))
        out.put((rank, *(t.numpy() for t in (got.detach(), *(m.grad for m in mine)))))  # by value
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("world", "cp", "heads", "kv_heads"), [(2, 2, 2, 2), (4, 4, 4, 2), (4, 2, 2, 1)])
def test_ring_attention_is_one_process_attending_over_the_whole_sequence(world: int, cp: int, heads: int,
                                                                         kv_heads: int) -> None:
    length = 4 * cp
    results = {r: rest for r, *rest in run_ranks(_ring, world, world, cp, heads, kv_heads, length)}
    for ring in range(world // cp):
        q, k, v, up = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_whole(ring, heads, kv_heads, length)))
        repeat = heads // kv_heads
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                              is_causal=True)
        want.backward(up)
        pieces = [results[ring * cp + me] for me in range(cp)]
        for i, expected in enumerate((want, q.grad, k.grad, v.grad)):
            got = unshard_sequence([torch.from_numpy(piece[i]) for piece in pieces], dim=2)
            torch.testing.assert_close(got, expected.detach(), rtol=1e-10, atol=1e-10)


def test_each_rank_holds_an_early_and_a_late_chunk() -> None:
    """cp 2 over 8 tokens: chunks of 2, rank 0 the first and the last, rank 1 the two middle ones; the pieces put
    back give the sequence; a length that does not split into 2 cp chunks is refused."""
    assert positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(24).reshape(1, 8, 3)
    assert torch.equal(unshard_sequence([shard_sequence(x, 2, r) for r in range(2)]), x)
    with pytest.raises(ValueError, match="does not split into 2 x cp = 4 equal chunks"):
        positions(6, 2, 0)


TOLERANCE = 1e-5


@pytest.mark.parametrize(("schedule", "devices", "dp", "cp", "more"), [
    ("1f1b", 2, 1, 2, {}),
    ("1f1b", 2, 1, 2, {"fsdp": True}),  # the stages sharded over the two copies that split the sequences
    ("zb-v", 2, 1, 2, {}),  # B and W apart: the ring's backward runs in the input gradients' pass
    ("interleaved-1f1b", 2, 2, 2, {}),  # 8 ranks: two data-parallel copies of two context-parallel copies
    ("gpipe", 1, 1, 4, {"zero1": True}),  # one stage, a ring of 4, the optimizer state sharded over the 4
])
def test_a_context_parallel_run_has_the_gradients_of_one_process(schedule: str, devices: int, dp: int, cp: int,
                                                                  more: dict[str, Any]) -> None:
    """The GPT trained with each sequence split over cp copies of the pipeline (ring attention, global positions,
    the gradients averaged over dp x cp copies): its first step's loss and every copy's gradients equal one
    process training the whole sequences."""
    from pipefold.runtime.launch.local import run_local
    from pipefold.train.prepare import make_job
    from pipefold.train.reference import compare
    from pipefold.train.spec import RunSpec

    job = make_job(RunSpec.flat(schedule=schedule, devices=devices, microbatches=4, batch=4 * dp, steps=1,
                                model="gpt", layers=4, hidden=32, heads=4, seq=32, partition="even",
                                optimizer="sgd", dp=dp, cp=cp, check=True, **more))
    assert job.world == dp * cp * devices
    diff = compare(job, run_local(job))
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff


@pytest.mark.parametrize(("argv", "expected"), [
    (["--model", "mlp", "--cp", "2"], "the mlp model does not declare its attention and positions for context "
                                      "parallelism: use --cp 1 with it"),
    (["--model", "gpt", "--cp", "3", "--seq", "64"], "--cp 3 splits each sequence into 6 equal chunks (two a rank, "
                                                     "for the causal balance), and --seq 64 does not: give --seq a "
                                                     "multiple of 6"),
    (["--model", "gpt", "--cp", "2", "--tp", "2"], "context parallelism (--cp 2) does not run with tensor "
                                                   "parallelism (--tp 2) yet"),
    (["--model", "gpt", "--cp", "2", "--checkpoint-dir", "{tmp}/ck"], "checkpoints of context-parallel runs"),
    (["--model", "gpt", "--cp", "0"], "--cp: 0 is out of range"),
])
def test_a_split_the_runtime_cannot_run_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Any,
                                                    argv: list[str], expected: str) -> None:
    from pipefold.cli.main import main

    assert main(["train", *(a.replace("{tmp}", str(tmp_path)) for a in argv), "--steps", "1"]) != 0
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err

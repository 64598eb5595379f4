"""Context parallelism's ring attention against one process attending over the whole sequence: outputs and the
gradients of queries, keys and values, several ring sizes, grouped key-value heads, and a ring that is a subgroup
of the world; ``train --cp`` runs and a library Pipeline on a mesh with a "cp" dimension against one process."""

from __future__ import annotations

import math
from pathlib import Path
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


# -- the library: a Pipeline in a user's own loop, as examples/context_parallel.py runs it

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "context_parallel.py"


def _example() -> Any:
    """examples/context_parallel.py as a module (the examples are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("context_parallel_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _library_step(rank: int, init: str, world: int, names: tuple[str, ...], shape: tuple[int, ...], schedule: str,
                  out: Any) -> None:
    """One step of the example's Pipeline on a mesh of ``names`` and ``shape``: this rank's rows of the batch (its
    data-parallel copy's), its loss, the global check, every gradient it holds, by layer and name, and the output
    of a forward over the same rows where the last stage is."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        example = _example()
        args = example.parser().parse_args(["--schedule", schedule])
        layers = example.model(args)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        pipe = example.pipelined(layers, args, mesh)
        x, y = next(example.batches(64, args.batch, args.length, seed=1))
        dp, copy = (mesh["dp"].size(), mesh["dp"].get_local_rank()) if "dp" in names else (1, 0)
        rows = slice(copy * len(x) // dp, (copy + 1) * len(x) // dp)
        loss = pipe.step(x[rows], target=y[rows], all_ranks=True)
        check = pipe.check()
        grads = {f"{i}.{name}": p.grad.numpy() for i, layer in enumerate(layers)
                 for name, p in layer.named_parameters() if p.grad is not None}
        with torch.no_grad():
            output, _ = pipe.forward(x[rows])  # the last stage's output, gathered over the ring
        out.put((rank, (rows.start, rows.stop), loss, check.loss, check.norm, grads,
                 None if output is None else output.numpy()))
        pipe.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("names", "shape", "schedule"), [
    (("cp", "pp"), (2, 2), "zb-v"),  # two stages a rank, B and W apart: the ring's backward in the B pass
    (("dp", "cp", "pp"), (2, 2, 1), "1f1b"),  # the gradients averaged over 2 x 2 copies of a one-stage pipeline
])
def test_a_pipeline_in_a_users_loop_has_the_loss_and_gradients_of_one_process(names: tuple[str, ...],
                                                                              shape: tuple[int, ...],
                                                                              schedule: str) -> None:
    """examples/context_parallel.py's Pipeline on a DeviceMesh with a "cp" dimension, in real processes over gloo:
    its step's loss, the global check's loss and norm, every rank's gradients and the forward's output (gathered
    over the ring) equal one process training the whole model on the whole sequences, within 1e-5 in float32."""
    example = _example()
    args = example.parser().parse_args([])
    world = math.prod(shape)
    results = run_ranks(_library_step, world, world, names, shape, schedule)
    assert sorted(r for r, *_ in results) == list(range(world))
    layers = example.model(args)
    x, y = next(example.batches(64, args.batch, args.length, seed=1))
    whole = torch.nn.Sequential(*layers)
    example.gpt_loss(whole(x), y).backward()
    want = {f"{i}.{name}": p.grad for i, layer in enumerate(layers) for name, p in layer.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()])).item()
    with torch.no_grad():
        whole_loss = example.gpt_loss(whole(x), y).item()
    held: set[str] = set()
    outputs = 0
    for rank, (start, stop), loss, check_loss, check_norm, grads, output in results:
        with torch.no_grad():
            logits = whole(x[start:stop])
            rows_loss = example.gpt_loss(logits, y[start:stop]).item()
        if output is not None:  # on the ranks with the last stage: the whole sequences' logits
            torch.testing.assert_close(torch.from_numpy(output), logits, rtol=TOLERANCE, atol=TOLERANCE)
            outputs += 1
        assert abs(loss - rows_loss) <= TOLERANCE, (rank, loss, rows_loss)
        assert abs(check_loss - whole_loss) <= TOLERANCE, (rank, check_loss, whole_loss)
        assert abs(check_norm - norm) <= TOLERANCE * norm, (rank, check_norm, norm)
        for name, got in grads.items():
            torch.testing.assert_close(torch.from_numpy(got), want[name], rtol=TOLERANCE, atol=TOLERANCE,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank}, {name}: {m}")
        held |= set(grads)
    assert held == set(want)  # every parameter of the model was checked on some rank
    assert outputs == world // shape[-1]  # every copy's last stage


def _refusals(rank: int, init: str, world: int, out: Any) -> None:
    """What the Pipeline refuses with a "cp" mesh dimension, each on every rank: its one line."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold.errors import ConfigError

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        example = _example()
        args = example.parser().parse_args([])
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "pp"))
        got = {}

        def refused(case: str, make: Any) -> None:
            try:
                make()
            except ConfigError as exc:
                got[case] = str(exc)

        refused("no hook points", lambda: example.pipelined([nn.Linear(8, 8) for _ in range(4)], args, mesh))
        layers = example.model(args)
        for layer in layers:
            for sub in layer.modules():
                if hasattr(sub, "attend"):
                    sub.dropout = 0.1
        refused("attention dropout", lambda: example.pipelined(layers, args, mesh))
        with_tp = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("cp", "tp", "pp"))
        refused("cp with tp", lambda: example.pipelined(example.model(args), args, with_tp))
        pipe = example.pipelined(example.model(args), args, mesh)
        x, y = next(example.batches(64, args.batch, 6, seed=1))
        refused("a sequence of 6", lambda: pipe.step(x, target=y))
        pipe.close()
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


def test_a_pipeline_refuses_what_context_parallelism_cannot_run_in_one_line() -> None:
    """A model that declares no attention and positions, attention dropout, "cp" with "tp" in the mesh and a
    sequence that does not split into 2 x cp chunks: each refused on every rank with one line."""
    expected = {
        "no hook points": "declare no attend(q, k, v) and positions(t, device) methods",
        "attention dropout": "ring attention has no attention dropout",
        "cp with tp": "context parallelism (cp 2) does not run with tensor parallelism (tp 2) yet",
        "a sequence of 6": "a tensor of shape (8, 6) has 6 tokens: give sequences of a multiple of 4 tokens",
    }
    results = dict(run_ranks(_refusals, 4, 4))
    assert sorted(results) == [0, 1, 2, 3]
    for rank, got in results.items():
        assert sorted(got) == sorted(expected), (rank, got)
        for case, text in expected.items():
            assert text in got[case] and "\n" not in got[case], (rank, case, got[case])

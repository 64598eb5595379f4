"""Data-parallel pipelines: the DP actions in the schedule, their cost, and exact training across dp x pp ranks.

The references are independent of the code under test: closed forms for the all-reduce's time, and one
process over the whole global batch (:func:`pipefold.train.reference.reference_step`) for the gradients.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_ranks
from pipefold.errors import ConfigError
from pipefold.ir import AG, DP, RS, Kind, validate
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.launch.processes import free_port
from pipefold.runtime.launch.settings import Parallel
from pipefold.runtime.measure.timeline import step_parts
from pipefold.schedules import build
from pipefold.schedules.dataparallel import with_data_parallel
from pipefold.sim.simulate import CostModel, StageOverride, simulate
from pipefold.train.prepare import make_job
from pipefold.train.reference import compare
from pipefold.train.spec import RunSpec

FAMILIES = ["1f1b", "gpipe", "zb-h1", "zb-v", "v-half", "v-min", "interleaved-1f1b", "looped-bfs", "dualpipev",
            "chimera", "dualpipe"]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_stage_all_reduces_right_after_its_gradients_are_done(name: str) -> None:
    s = build(name, 4, 8)
    d = validate(with_data_parallel(s))
    for device, row in enumerate(d.actions):
        assert [a for a in row if a.kind != Kind.DP] == list(s.actions[device])
        for stage in s.stages_of(device):
            i = row.index(DP(stage))
            done = [j for j, act in enumerate(row) for a in act.passes
                    if a.stage == stage and a.kind in (Kind.W, Kind.BW, Kind.R)]
            assert i == max(done) + 1 or row[max(done) + 1].kind == Kind.DP, (name, device, row[i - 2: i + 1])
    with pytest.raises(ConfigError, match="already reduces"):
        with_data_parallel(d)


def test_the_all_reduce_runs_beside_the_tail_and_costs_a_ring() -> None:
    """1F1B, p=2, m=2, F=B=W=1, fused backwards: device 1 ends its last backward at 7, device 0 at 9. A stage is
    one device's share here, G=8 bytes; a ring among n=2 pipelines moves 2(n-1)/n x 8 = 8 bytes at bandwidth 2: 4
    time units. Stage 1's all-reduce (7..11) starts under device 0's last backward; stage 0's (9..13) sets the
    step: 13 against 9. With a latency L per message, a ring adds 2(n-1) L."""
    s = with_data_parallel(build("1f1b", 2, 2))
    r = simulate(s, CostModel(grad_bytes=8, bandwidth=2, dp=2))
    times = {iv.action: (iv.start, iv.end) for row in r.timeline for iv in row}
    plain = simulate(build("1f1b", 2, 2), CostModel())
    assert plain.makespan == pytest.approx(9)
    assert times[DP(1)] == pytest.approx((7, 11)) and times[DP(0)] == pytest.approx((9, 13))
    assert r.makespan == pytest.approx(13)
    assert r.busy == pytest.approx(plain.busy)  # it runs beside the compute
    latent = CostModel(grad_bytes=8, bandwidth=2, dp=3, latency=0.5)
    assert latent.stage_cost(0, 2, 2).dp_reduce == pytest.approx(2 * 2 * 0.5 + 2 * 2 / 3 * 8 / 2)
    # One pipeline: nothing to reduce.
    assert simulate(s, CostModel(grad_bytes=8, bandwidth=2)).makespan == pytest.approx(9)


@pytest.mark.parametrize("name", FAMILIES[:8])
def test_sharded_stages_gather_before_their_first_forward_and_reduce_scatter_after_their_gradients(name: str) -> None:
    s = build(name, 4, 8)
    d = validate(with_data_parallel(s, shard=True))
    for device, row in enumerate(d.actions):
        assert [a for a in row if a.kind not in (Kind.AG, Kind.RS)] == list(s.actions[device])
        assert not any(a.kind == Kind.DP for a in row)
        for stage in s.stages_of(device):
            first_f = next(i for i, a in enumerate(row) if a.stage == stage and a.kind == Kind.F)
            gather = row.index(AG(stage))
            between = [a for a in row[gather + 1:first_f] if a.kind != Kind.AG]
            assert gather < first_f and len(between) <= 1, (name, device, row[gather:first_f + 1])
            done = max(j for j, act in enumerate(row) for a in act.passes
                       if a.stage == stage and a.kind in (Kind.W, Kind.BW))
            assert all(a.kind == Kind.RS for a in row[done + 1:row.index(RS(stage)) + 1])
    with pytest.raises(ConfigError, match="already reduces"):
        with_data_parallel(d)


def test_sharded_costs_half_rings_and_holds_a_shard_of_the_weights() -> None:
    """1F1B, p=2, m=2, F=B=W=1, fused backwards, G=8 gradient bytes per stage, bandwidth 2, dp=2. An all-gather
    or a reduce-scatter is half a ring: (n-1)/n x 8 / 2 = 2 time units. Both devices gather from 0 to 2, so the
    plain timeline (device 0's last backward ending at 9) moves by 2: stage 1's RS runs 9..11, stage 0's 11..13.
    Memory: the gathered parameters and gradients (gathered=3 M per device share) are held from AG to the end of
    RS, on top of the activations' peak (2 M on device 0, 1 on device 1); the static weights (weights=4) are
    halved."""
    s = with_data_parallel(build("1f1b", 2, 2), shard=True)
    r = simulate(s, CostModel(grad_bytes=8, bandwidth=2, dp=2, gathered=3, weights=4))
    times = {iv.action: (iv.start, iv.end) for row in r.timeline for iv in row}
    assert times[AG(0)] == pytest.approx((0, 2)) and times[AG(1)] == pytest.approx((0, 2))
    assert times[RS(1)] == pytest.approx((9, 11)) and times[RS(0)] == pytest.approx((11, 13))
    assert r.makespan == pytest.approx(13)
    assert r.static_memory == pytest.approx([2, 2])
    assert r.peak_memory == pytest.approx([2 + 3 + 2, 1 + 3 + 2])
    assert r.memory_curve[0][-1][1] == pytest.approx(0)  # all of it given back by the end of the step
    latent = CostModel(grad_bytes=8, bandwidth=2, dp=4, latency=0.5)
    cost = latent.stage_cost(0, 2, 2)
    assert cost.dp_gather == cost.dp_scatter == pytest.approx(3 * 0.5 + 3 / 4 * 8 / 2)
    assert cost.dp_gather + cost.dp_scatter == pytest.approx(cost.dp_reduce)  # a ring all-reduce is both
    # A stage of k FSDP units runs k gathers of a k-th of its bytes each: k times a ring's 3 latencies, the bytes once.
    for k in (1, 2, 5):
        units = dataclasses.replace(latent, stage_overrides={0: StageOverride(f=1, b=1, w=1, collectives=k)})
        cost = units.stage_cost(0, 2, 2)
        assert cost.dp_gather == cost.dp_scatter == pytest.approx(k * 3 * 0.5 + 3 / 4 * 8 / 2)
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="stage 0 runs its AG and RS as collectives: a whole number >= 1"):
            CostModel(stage_overrides={0: StageOverride(f=1, b=1, w=1, collectives=bad)})  # type: ignore[arg-type]


@pytest.mark.parametrize(("schedule", "fsdp"), [
    *((name, fsdp) for name in ("1f1b", "zb-v", "v-half", "looped-bfs") for fsdp in (False, True)),
    ("chimera", True),  # each stage's two replicas all-reduce (R), then reduce-scatter across the pipelines
], ids=lambda v: {False: "all-reduce", True: "fsdp"}.get(v, v) if isinstance(v, bool) else v)
def test_dp2_pp2_matches_one_process_and_keeps_the_copies_identical(schedule: str, fsdp: bool) -> None:
    config = RunSpec.flat(schedule=schedule, devices=2, dp=2, microbatches=4, steps=3, model="gpt", layers=4,
                         hidden=32, heads=2, seq=32, batch=16, partition="even", optimizer="adamw", fsdp=fsdp)
    job = dataclasses.replace(make_job(config.replace(check=True)), save_weights=True)
    assert any(a.kind == (Kind.RS if fsdp else Kind.DP) for row in job.schedule.actions for a in row)
    reports = run_local(job)
    assert sorted((r.pipeline, r.device) for r in reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # The first step's gradients, on every rank of both pipelines, are those of one process over the global batch.
    diffs = compare(job, reports)
    assert diffs["loss_rel_diff"] < 1e-5 and diffs["max_grad_rel_diff"] < 1e-5, diffs
    # After three AdamW steps the two copies of each stage hold the same weights, bit for bit.
    by_name: dict[str, list[torch.Tensor]] = {}
    for r in reports:
        for name, w in (r.weights or {}).items():
            by_name.setdefault(name, []).append(w)
    copies = 2 * job.schedule.replicas  # the pipelines' copies, and each pipeline's replicas of the stage
    assert all(len(ws) == copies and all(torch.equal(ws[0], w) for w in ws) for ws in by_name.values())
    initial = job.build_layers(list(range(job.extra["num_layers"])))
    moved = [name for name, ws in by_name.items()
             if not torch.equal(ws[0], dict(initial[int(name.split(".")[0])].named_parameters())[
                 name.split(".", 1)[1]])]
    assert len(moved) == len(by_name)  # every weight was trained
    # Each rank keeps parameters P, gradients P and AdamW's two moments 2P of its stages (4-byte floats), and
    # AdamW's step count per parameter (a 4-byte tensor); sharded, a 1/dp share of the first four (a row more
    # where dp does not divide a parameter's first dimension).
    for r in reports:
        mine = [p for i in (i for st in job.schedule.stages_of(r.device) for i in job.layer_stages[st])
                for p in initial[i].parameters()]
        held, steps = sum(p.numel() for p in mine) * 4 * 4, 4 * len(mine)
        if fsdp:
            assert held / 2 <= r.static_bytes - steps <= held / 2 * 1.05, (r.rank, r.static_bytes, held)
        else:
            assert r.static_bytes == held + steps
    # Where each rank's step went: the copies' collectives (DP, or AG and RS, and their waits) apart from the waits on
    # messages, the step's events each counted once (their kinds, as the rank recorded them, in each step read).
    parts = step_parts(reports)
    kept = reports[0].steps.settled(1)
    for r, part in zip(reports, parts, strict=True):
        together = [sum(e.end - e.start for e in r.steps[i].events if e.kind in ("DP", "AG", "RS", "R", "comm"))
                    for i in kept]
        sends = [sum(e.end - e.start for e in r.steps[i].events if e.kind == "send") for i in kept]
        assert part["collectives"] == pytest.approx(statistics.median(together)) and part["collectives"] > 0
        assert part["send wait"] == pytest.approx(statistics.median(sends))
        assert part["runtime"] >= 0 and part["compute"] + part["collectives"] <= part["step"]
    # Each pipeline ran its own shard: the losses of its microbatches differ from the other's.
    last = job.schedule.holders(job.schedule.stages - 1)[0]
    shard = {r.pipeline: r.steps[0].losses for r in reports if r.device == last}
    assert shard[0] != shard[1]


def test_refusals_are_one_line(tmp_path: Path) -> None:
    base = dict(devices=2, dp=2, microbatches=2, steps=1, model="mlp", layers=4, hidden=8, batch=8)
    with pytest.raises(ConfigError, match="does not split into 2 pipelines x 2 microbatches; use a --batch that is "
                                          "a multiple of 4"):
        make_job(RunSpec.flat(schedule="1f1b", **{**base, "batch": 6}))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"and --zero1 shards them: drop --zero1 with --optimizer kfac"):
        make_job(RunSpec.flat(schedule="1f1b", optimizer="kfac", zero1=True, **base))  # type: ignore[arg-type]
    job = make_job(RunSpec.flat(schedule="1f1b", **base))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="has no 0DP on device 0"):
        dataclasses.replace(job, schedule=build("1f1b", 2, 2))
    with pytest.raises(ConfigError, match="the job has one pipeline"):
        dataclasses.replace(job, parallel=Parallel())
    with pytest.raises(ConfigError, match="no 0AG on device 0: add them with "
                                          "pipefold.schedules.dataparallel.with_data_parallel"
                                          r"\(schedule, shard=True\)"):
        dataclasses.replace(job, parallel=Parallel(dp=2, fsdp=True))
    with pytest.raises(ConfigError, match="--fsdp shards each stage across data-parallel pipelines: give --dp 2"):
        make_job(RunSpec.flat(schedule="1f1b", fsdp=True, **{**base, "dp": 1}))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="checkpoints of stages sharded with FSDP are not written yet"):
        make_job(RunSpec.flat(schedule="1f1b", fsdp=True, checkpoint_dir=str(tmp_path), **base))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="drop --zero1"):
        make_job(RunSpec.flat(schedule="1f1b", fsdp=True, zero1=True, **base))  # type: ignore[arg-type]
    sharded = make_job(RunSpec.flat(schedule="1f1b", fsdp=True, **base))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs its DP, but 1f1b has no 0DP on device 0"):
        dataclasses.replace(sharded, parallel=Parallel(dp=2))
    both = sharded.schedule.with_actions([[*row, *(DP(st) for st in sharded.schedule.stages_of(d))]
                                          for d, row in enumerate(sharded.schedule.actions)])
    with pytest.raises(ConfigError, match="has AG actions, which shard the stages"):
        dataclasses.replace(sharded, schedule=both, parallel=Parallel(dp=2))


def test_cli_dp(capsys: pytest.CaptureFixture[str]) -> None:
    from pipefold.cli.main import main

    code = main(["train", "--schedule", "zb-v", "--pp", "2", "--dp", "2", "--model", "mlp", "--layers", "4",
                 "--hidden", "32", "--batch", "16", "-m", "4", "--steps", "2", "--check", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dp"] == 2 and out["max_grad_rel_diff"] < 1e-5 and len(out["busy_s"]) == 2
    assert main(["train", "--pp", "2", "--dp", "0", "--model", "mlp", "--layers", "4", "--batch", "8"]) == 2
    assert "argument --dp: 0 is out of range: give a whole number >= 1" in capsys.readouterr().err


TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun")
def test_two_torchrun_agents_as_two_nodes(tmp_path: Path) -> None:
    """Two torchrun agents on this machine as two nodes (c10d rendezvous on loopback), 2 processes each: dp=2 x pp=2
    with sharded stages (FSDP) trains with the gradients of one process, as on two machines."""
    assert TORCHRUN is not None
    port = free_port()
    argv = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pipefold-test", "-m", "pipefold", "train",
            "--schedule", "1f1b", "--pp", "2", "--dp", "2", "--model", "mlp", "--layers", "4", "--hidden", "32",
            "--batch", "16", "-m", "4", "--steps", "2", "--fsdp", "--check", "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=tmp_path) for _ in range(2)]
    outs = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=240)
            assert agent.returncode == 0, err[-2000:]
            outs.append(out)
    finally:
        for agent in agents:
            agent.kill()
    lines = [line for out in outs for line in out.strip().splitlines() if line.startswith("{")]
    assert len(lines) == 1, outs  # rank 0 reports for everyone, on whichever node it ran
    result = json.loads(lines[0])
    assert result["dp"] == 2 and result["sharding"] == "fsdp" and result["max_grad_rel_diff"] < 1e-5
    assert result["p2p"] == "gloo"  # two nodes: the messages cross the process group, not one machine's sockets
    assert len(result["loss"]) == 2


def test_zero1_shards_the_optimizer_state_and_changes_no_weight() -> None:
    """ZeRO-1 at dp=2 x pp=2 (AdamW): the same weights as without it after three steps (each copy steps half the
    parameters and sends them to the other), and each rank keeps less optimizer state. Without it a rank keeps
    parameters P, gradients P and AdamW's two moments 2P (4P); with it the moments of its share only, about 3P."""
    runs = {}
    for zero1 in (False, True):
        config = RunSpec.flat(schedule="1f1b", devices=2, dp=2, microbatches=2, steps=3, model="mlp", layers=4,
                             hidden=64, batch=32, partition="even", optimizer="adamw", zero1=zero1)
        job = dataclasses.replace(make_job(config), save_weights=True)
        runs[zero1] = sorted(run_local(job), key=lambda r: r.rank)
    for plain, sharded in zip(runs[False], runs[True], strict=True):
        assert plain.weights is not None and sharded.weights is not None
        for name, w in plain.weights.items():
            torch.testing.assert_close(sharded.weights[name], w, rtol=1e-6, atol=1e-7)
        params = sum(w.numel() * w.element_size() for w in plain.weights.values())
        assert plain.static_bytes >= 4 * params
        assert 3 * params <= sharded.static_bytes <= 3.3 * params, (sharded.static_bytes, params)
    with pytest.raises(ConfigError, match="ZeRO-1 shards the optimizer state"):
        make_job(RunSpec.flat(schedule="1f1b", devices=2, microbatches=2, model="mlp", layers=4, hidden=8, batch=8,
                             zero1=True))


def test_fsdp_clips_by_the_norm_over_every_shard() -> None:
    """With --clip, a sharded rank's norm is the sum over every pipeline's shards: the weights after three clipped
    SGD steps equal those of all-reduced copies (whose gradients every rank holds whole), and differ from
    unclipped ones (the clip bit)."""
    runs = {}
    for fsdp, clip in ((False, 0.05), (True, 0.05), (True, None)):
        config = RunSpec.flat(schedule="zb-h1", devices=2, dp=2, microbatches=2, steps=3, model="mlp", layers=4,
                             hidden=64, batch=32, partition="even", optimizer="sgd", lr=0.5, clip=clip, fsdp=fsdp)
        job = dataclasses.replace(make_job(config), save_weights=True)
        runs[fsdp, clip] = {name: w for r in run_local(job) if r.pipeline == 0 for name, w in (r.weights or {}).items()}
    plain, sharded, unclipped = runs[False, 0.05], runs[True, 0.05], runs[True, None]
    assert plain.keys() == sharded.keys() and len(plain) == 16
    for name, w in plain.items():
        torch.testing.assert_close(sharded[name], w, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(unclipped[name], w, rtol=1e-3) for name, w in plain.items())


def _flat_all_reduce(rank: int, init: str, scale: float, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.comm import FlatAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        gen = torch.Generator().manual_seed(rank)
        grads = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen),
                 torch.randn(4, 6, generator=gen).t(),  # not contiguous: reduced by itself, in place
                 torch.randn(2, generator=gen, dtype=torch.float64)]  # another dtype: a buffer of its own
        want = [g * scale for g in grads]
        for w in want:
            dist.all_reduce(w)  # the reference: each tensor scaled, then one call per tensor
        before = [g.untyped_storage().data_ptr() for g in grads]
        reduction = FlatAllReduce(grads, dist.group.WORLD, scale=scale)
        reduction.wait()
        storages = {g.untyped_storage().data_ptr() for g in grads[:2]}
        out.put((rank, [float((g - w).abs().max()) for g, w in zip(grads, want, strict=True)], len(storages),
                 grads[2].untyped_storage().data_ptr() == before[2], reduction.moved,
                 [tuple(g.shape) for g in grads]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_one_all_reduce_of_a_stages_gradients_equals_one_per_tensor(scale: float) -> None:
    """comm.FlatAllReduce: the sums of one call per tensor, each tensor scaled first (the mean over copies: the
    scale is applied on the way into the buffer); the contiguous float32 gradients end up sharing one buffer
    (their old storages freed, ``moved`` their bytes), a non-contiguous one keeps its storage, and another dtype
    gets a buffer of its own."""
    results = run_ranks(_flat_all_reduce, 2, scale)
    assert sorted(r[0] for r in results) == [0, 1]  # every rank reported
    for rank, diffs, shared, kept, moved, shapes in results:
        assert max(diffs) < 1e-6, (rank, diffs)
        assert shared == 1 and kept
        assert moved == (12 + 5) * 4 + 2 * 8  # the float32 pair and the float64 one, not the transposed one
        assert shapes == [(3, 4), (5,), (6, 4), (2,)]


def _flat_broadcast(rank: int, init: str, src: int, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.comm import FlatBroadcast

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3)
    try:
        def tensors(seed: int) -> list[torch.Tensor]:
            gen = torch.Generator().manual_seed(seed)
            return [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen),
                    torch.randn(4, 6, generator=gen).t(),  # not contiguous: broadcast by itself
                    torch.randn(2, generator=gen, dtype=torch.float64)]  # another dtype: a buffer of its own
        mine = tensors(rank)
        want = tensors(rank)
        for w in want:
            dist.broadcast(w, src=src)  # the reference: one call per tensor
        storages = [t.untyped_storage().data_ptr() for t in mine]
        FlatBroadcast(mine, src, dist.group.WORLD).wait()
        out.put((rank, [bool(torch.equal(t, w)) for t, w in zip(mine, want, strict=True)],
                 [t.untyped_storage().data_ptr() for t in mine] == storages, [tuple(t.shape) for t in mine]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("src", [0, 2])
def test_one_flat_broadcast_equals_one_per_tensor(src: int) -> None:
    """comm.FlatBroadcast (ZeRO-1's sharing of a copy's stepped parameters): every rank ends with the source's
    values, bit for bit those of one broadcast per tensor, in the tensors' own storages (a parameter keeps its
    storage), a non-contiguous tensor and another dtype among them; three ranks, the source first or last."""
    results = run_ranks(_flat_broadcast, 3, src)
    assert sorted(r[0] for r in results) == [0, 1, 2]  # every rank reported
    for rank, equal, kept, shapes in results:
        assert all(equal) and kept, (rank, equal, kept)
        assert shapes == [(3, 4), (5,), (6, 4), (2,)]


def _best_spread(sizes: list[int], copies: int) -> int:
    """The least heaviest share over every assignment of ``sizes`` to ``copies`` shares, by brute force: each
    assignment once up to renaming the shares (a size goes to a share used before or to the next new one), as the
    heaviest share does not depend on their names."""
    best = sum(sizes)

    def assign(i: int, loads: list[int]) -> None:
        nonlocal best
        if i == len(sizes):
            best = min(best, max(loads))
            return
        for c in range(min(len(loads) + 1, copies)):
            grown = [*loads, 0] if c == len(loads) else list(loads)
            grown[c] += sizes[i]
            assign(i + 1, grown)

    assign(0, [])
    return best


def test_the_brute_force_spread_is_every_assignments() -> None:
    """The brute force up to renaming against every assignment, named shares and all, on small cases."""
    import itertools
    import random

    rng = random.Random(0)
    for copies in (2, 3):
        for _ in range(5):
            sizes = [rng.choice([1, 7, 64, 300]) for _ in range(6)]
            every = min(max(sum(sizes[i] for i in range(6) if who[i] == c) for c in range(copies))
                        for who in itertools.product(range(copies), repeat=6))
            assert _best_spread(sizes, copies) == every


@pytest.mark.parametrize("copies", [2, 3, 4])
def test_zero1_shares_cover_every_parameter_once_and_balance(copies: int) -> None:
    """ZeRO-1's shares: every parameter in exactly one, and the heaviest share at most the largest parameter above
    the lightest (largest first, each to the lightest share: a brute force over every assignment of eight sizes
    finds the best spread, which greedy may miss by no more than that)."""
    import random

    from pipefold.plan.shares import shares

    rng = random.Random(copies)
    for _ in range(20):
        sizes = [rng.choice([1, 7, 64, 300, 4096]) for _ in range(8)]
        got = shares(sizes, copies)
        assert sorted(i for share in got for i in share) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in share) for share in got]
        best = _best_spread(sizes, copies)
        assert max(loads) - min(loads) <= max(sizes) and max(loads) <= best + max(sizes)
        assert got == shares(sizes, copies)  # the same on every copy

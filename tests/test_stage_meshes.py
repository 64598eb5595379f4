"""A mesh per stage (``--tp 2,1``): each pipeline device's layers split over a tensor-parallel degree of its own,
activations and gradients resharded between devices of different degrees (Alpa's cross-mesh resharding). Checked
against a brute force of the pieces' routes, against one process's gradients on real gloo ranks, and the bytes each
rank sent and all-gathered against the layout's arithmetic: each byte of a message crosses once, each sender of a
mesh of a ranks sends 1/a of it, each receiver of a mesh of b ranks all-gathers (b - 1)/b of it."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from conftest import run_ranks
from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.ir import dependency_graph
from pipefold.runtime.comm import routes
from pipefold.runtime.launch.local import run_local
from pipefold.train.prepare import make_job
from pipefold.train.reference import compare
from pipefold.train.spec import RunSpec

TOLERANCE = 1e-5


def test_routes_cut_each_tensor_once_into_balanced_contiguous_chunks() -> None:
    """For every pair of mesh sizes up to 6: every piece goes once; receiver j's pieces are the j-th of b equal
    contiguous chunks (what it all-gathers); each sender sends the same number of pieces; no sender sends one
    receiver two pieces of a tensor (one tag per tensor and pair suffices)."""
    for a in range(1, 7):
        for b in range(1, 7):
            pieces = routes(a, b)
            n = math.lcm(a, b)
            assert len(pieces) == n
            for j in range(b):
                assert [k for k, (_, r) in enumerate(pieces) if r == j] == list(range(j * n // b, (j + 1) * n // b))
            sent = [sum(1 for s, _ in pieces if s == i) for i in range(a)]
            assert sent == [n // a] * a, (a, b, sent)
            assert len(set(pieces)) == len(pieces), (a, b)


def _spec(schedule: str, model: str, tp: tuple[int, ...], *, dp: int = 1, **more: object) -> RunSpec:
    """One row per microbatch in each pipeline; two layers a stage (the gpt's embedding and head come on top)."""
    sizes = dict(heads=4, seq=16) if model == "gpt" else {}
    stages = len(tp) * (1 if schedule == "1f1b" else 2)
    return RunSpec.flat(schedule=schedule, devices=len(tp), microbatches=4, batch=4 * dp, steps=1, model=model,
                        layers=2 * stages, hidden=48 if 3 in tp else 32, partition="even", optimizer="sgd", tp=tp,
                        dp=dp, check=True, **sizes, **more)


@pytest.mark.parametrize(("schedule", "model", "tp", "more"), [
    ("1f1b", "gpt", (2, 1), {}),                  # into one rank: each of the 2 sends half
    ("1f1b", "gpt", (1, 2), {}),                  # out of one rank: half to each, then an all-gather
    ("zb-v", "mlp", (2, 1), {}),                  # two stages per device, B and W apart
    ("interleaved-1f1b", "mlp", (1, 2), {}),      # two stages per device, looped
    ("1f1b", "mlp", (2, 3, 1), {}),               # lcm(2, 3) = 6 pieces; hidden 48 so that 2 and 3 divide it
    ("1f1b", "gpt", (2, 1), {"dp": 2, "fsdp": True}),  # each device's own (dp, tp) mesh under FSDP
])
def test_a_mesh_per_stage_matches_one_process_and_moves_each_byte_once(schedule: str, model: str,
                                                                      tp: tuple[int, ...],
                                                                      more: dict[str, Any]) -> None:
    job = make_job(_spec(schedule, model, tp, **more))
    assert job.world == more.get("dp", 1) * sum(tp)
    reports = run_local(job)
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE, diff

    # The layout's arithmetic, from the schedule's transfers and each message's size (one microbatch's activation,
    # or its gradient: the same shape), not from the runtime's routes.
    width = 48 if 3 in tp else 32
    message = (16 if model == "gpt" else 1) * width * 4  # one row of seq x width float32
    out_of = [0] * len(tp)  # messages each device sends to another device, and receives
    into = [0] * len(tp)
    transfers = [t for t in dependency_graph(job.schedule).transfers() if t.src != t.dst]
    for t in transfers:
        out_of[t.src] += 1
        into[t.dst] += 1
    sent = {r.rank: r.steps[0].sent for r in reports}  # by global rank
    for r in reports:
        _, device, _ = job.coords(r.rank)
        a = tp[device]
        assert sum(sent[r.rank].values()) == out_of[device] * message // a, (r.rank, sent[r.rank])
        assert r.steps[0].gathered == into[device] * message * (a - 1) // a, (r.rank, r.steps[0].gathered)
    # Each byte crosses once: what a device's ranks send adds up to its messages, not to one copy per receiver, and
    # only to ranks of the devices it sends to.
    for copy in job.meshes():
        for d, ranks in enumerate(copy):
            assert sum(sum(sent[g].values()) for g in ranks) == out_of[d] * message
            assert {job.coords(to)[1] for g in ranks for to in sent[g]} <= {t.dst for t in transfers if t.src == d}


def test_padded_pieces_and_several_tensors_cross_between_meshes() -> None:
    """Links alone on 5 gloo ranks: a mesh of 2 sends a message of two tensors whose sizes no cut of lcm(2, 3) = 6
    divides (7 x 3 float32, 5 float64) to a mesh of 3 and gets a gradient of the same shapes back: every receiver
    has the tensors exactly, and the bytes sent are the padded pieces."""
    seen = sorted(run_ranks(_cross, 5))
    assert len(seen) == 5
    for rank, ok, sent, gathered in seen:
        assert ok, rank
        # 21 floats padded to 24 (4 a piece) and 5 doubles to 6 (1 a piece); 6 pieces: 3 per sender of 2, 2 per
        # receiver of 3; forward from the 2, backward from the 3.
        if rank < 2:
            assert sent == 3 * (4 * 4 + 1 * 8), (rank, sent)
            assert gathered == (24 * 4 + 6 * 8) // 2, (rank, gathered)
        else:
            assert sent == 2 * (4 * 4 + 1 * 8), (rank, sent)
            assert gathered == (24 * 4 + 6 * 8) * 2 // 3, (rank, gathered)


def _cross(rank: int, init: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.comm import BACKWARD, FORWARD, Links, metas_of
    from pipefold.runtime.meter import MemoryMeter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=5)
    try:
        meshes = [[0, 1], [2, 3, 4]]
        device, index = (0, rank) if rank < 2 else (1, rank - 2)
        groups = [dist.new_group(m) for m in meshes]
        links = Links(2, 1, torch.device("cpu"), MemoryMeter(), meshes=meshes, index=index, rank=device,
                      group=groups[device])
        x = (torch.arange(21, dtype=torch.float32).view(7, 3), torch.linspace(0, 1, 5, dtype=torch.float64))
        g = (x[0] * -2, x[1] + 5)
        if device == 0:
            links.send(FORWARD, 1, 0, x, 1)
            got = links.recv(BACKWARD, 0, 0, metas_of(g), 1).wait()
            ok = all(torch.equal(u, v) for u, v in zip(got, g, strict=True))
        else:
            got = links.recv(FORWARD, 1, 0, metas_of(x), 0).wait()
            ok = all(torch.equal(u, v) for u, v in zip(got, x, strict=True))
            links.send(BACKWARD, 0, 0, g, 0)
        links.wait_sends()
        out.put((rank, ok, sum(links.sent.values()), links.gathered))
        links.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("settings", "expected"), [
    (dict(tp=(2, 1, 1), devices=2), "--tp 2,1,1 gives 3 degrees for 2 pipeline devices: give one degree for every "
                                    "device, or one per device (2 of them)"),
    (dict(tp=(2, 1), schedule="chimera", devices=2), "stage 0's replicas sum their gradients rank by rank"),
    (dict(tp=(3, 1), model="gpt", heads=4, seq=16), "--tp 3 splits --heads = 4 unevenly"),
    (dict(tp=(2, 0)), "--tp is the number of tensor-parallel ranks per pipeline device"),
])
def test_bad_meshes_are_one_line(settings: dict[str, Any], expected: str) -> None:
    base: dict[str, Any] = dict(schedule="1f1b", devices=2, microbatches=4, batch=8, partition="even", model="mlp")
    with pytest.raises(ConfigError, match=re.escape(expected)) as info:
        make_job(RunSpec.flat(**{**base, **settings}))
    assert "\n" not in str(info.value)


def test_train_tp_per_device_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--model", "gpt", "--layers", "4", "--hidden", "32", "--heads", "2", "--seq", "16",
                 "--batch", "8", "--devices", "2", "--microbatches", "4", "--tp", "2,1", "--steps", "2", "--check",
                 "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert '"tp": [\n    2,\n    1\n  ]' in captured.out or '"tp": [2, 1]' in captured.out, captured.out[-800:]
    code = main(["train", "--model", "gpt", "--devices", "2", "--tp", "2,x"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "one per device (2,1)" in err, err


def test_the_cost_of_a_message_between_meshes_is_its_pieces_then_the_all_gather() -> None:
    """The simulator's transfer between devices of t ranks each, against its closed form: latency plus a t-th of
    the bytes over one link (the pieces cross at once), plus the receivers' all-gather: a ring's t - 1 steps of
    latency and (t - 1)/t of the bytes, or half the measured all-reduce among t where one was measured."""
    from pipefold.sim.simulate import CostModel

    lat, bw, x = 1e-4, 1e9, 8e6
    for t in (1, 2, 4):
        ring = CostModel(latency=lat, bandwidth=bw, activation_bytes=x, mesh=t)
        assert ring.transfer_time == pytest.approx(lat + x / t / bw + (t - 1) * lat + (t - 1) / t * x / bw)
        fitted = CostModel(latency=lat, bandwidth=bw, activation_bytes=x, mesh=t, allreduce_fits={4: (2e-3, 5e8)})
        gather = (2e-3 + x / 5e8) / 2 if t == 4 else (t - 1) * lat + (t - 1) / t * x / bw
        assert fitted.transfer_time == pytest.approx(lat + x / t / bw + gather)
    with pytest.raises(ConfigError, match="cost mesh is the ranks of each device"):
        CostModel(mesh=0)


def test_checkpoints_move_between_meshes_per_stage(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    """Saved with device 0 on 2 ranks (--tp 2,1), resumed with device 1 on 2 (--tp 1,2) through DCP: the losses equal
    one straight run's at tp 1 within 1e-6 relative, and the model --save-model writes (each split weight gathered
    whole) equals its within 1e-4."""
    import json

    gpt = ["train", "--model", "gpt", "--layers", "4", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "8",
           "--devices", "2", "-m", "4", "--json"]

    def train(*argv: str) -> dict[str, Any]:
        assert main([*gpt, *argv]) == 0
        return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]

    first = train("--tp", "2,1", "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck"))
    then = train("--tp", "1,2", "--steps", "5", "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--save-model",
                 str(tmp_path / "b.pt"))
    straight = train("--steps", "5", "--save-model", str(tmp_path / "c.pt"))
    assert then["first_step"] == 4 and then["tp"] == [1, 2]
    torch.testing.assert_close(first["loss"] + then["loss"], straight["loss"], rtol=1e-6, atol=0)
    resumed, whole = torch.load(tmp_path / "b.pt"), torch.load(tmp_path / "c.pt")
    assert resumed.keys() == whole.keys()
    for name, w in whole.items():
        torch.testing.assert_close(resumed[name], w, rtol=1e-4, atol=1e-5, msg=name)

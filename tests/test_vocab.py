"""Vocabulary Parallelism in the IR, the generators and the simulator: the output layer split by vocabulary over
every device, its passes S and T placed into the schedule.

The placements are checked by a brute force that runs the device rows by the paper's dependencies, written here
again and not read from the graph; the simulator's costs against closed forms and against the same costs given
as a stage override."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import run_ranks
from pipefold import schedules
from pipefold.errors import ConfigError, ScheduleError
from pipefold.ir import BW, VOCAB, Action, F, Kind, Schedule, dependency_graph
from pipefold.ir.kinds import S, T
from pipefold.ir.ref import ScheduleRef
from pipefold.sim.simulate import CostModel, StageOverride, simulate

FAMILIES = [name for name, spec in schedules.REGISTRY.items() if spec.option(VOCAB)]


def _runs(schedule: Schedule) -> bool:
    """Whether the rows run to their end when each action waits for what the paper says (a brute force)."""
    D, M, last = schedule.devices, schedule.microbatches, schedule.stages - 1
    done: set[tuple[str, int, int]] = set()

    def needs(a: Action) -> list[tuple[str, int, int]]:
        if a.kind == Kind.F:
            return [(Kind.F, a.stage - 1, a.microbatch)] if a.stage else []
        if a.kind in (Kind.B, Kind.BW):
            later = [(Kind.B, a.stage + 1, a.microbatch)] if a.stage < last else \
                [(Kind.T, d, a.microbatch) for d in range(D)]
            return [(Kind.F, a.stage, a.microbatch), *later]
        if a.kind == Kind.W:
            return [(Kind.B, a.stage, a.microbatch)]
        if a.kind == Kind.S:
            return [(Kind.F, last, a.microbatch)]
        assert a.kind == Kind.T
        return [(Kind.S, d, a.microbatch) for d in range(D)]

    heads = [0] * D
    moved = True
    while moved:
        moved = False
        for d, row in enumerate(schedule.actions):
            while heads[d] < len(row) and all(n in done for n in needs(row[heads[d]])):
                a = row[heads[d]]
                done.update((k, a.stage, a.microbatch) for k in ((Kind.B, Kind.W) if a.kind == Kind.BW else (a.kind,)))
                heads[d] += 1
                moved = True
    assert len(done) == 3 * schedule.stages * M + 2 * D * M  # each pass once
    return heads == [len(r) for r in schedule.actions]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_places_the_vocabulary_passes_where_they_can_run(name: str) -> None:
    for p, m in itertools.product((1, 2, 3, 4), (1, 2, 3, 5, 8)):
        try:
            plain = schedules.build(name, p, m)
        except ConfigError:
            continue  # a size the family does not take
        split = schedules.build(name, p, m, vocab=1)
        assert split.vocab and not plain.vocab
        assert _runs(split), (name, p, m)
        for d, row in enumerate(split.actions):
            for code in (Kind.S, Kind.T):
                mbs = [a.microbatch for a in row if a.kind == code]
                assert mbs == list(range(m)) and all(a.stage == d for a in row if a.kind == code)
            # the base schedule's own order is kept but for forwards run early
            kept = [a for a in row if a.kind not in (Kind.S, Kind.T)]
            assert sorted(kept) == sorted(plain.actions[d])
            assert [a for a in kept if a.kind != Kind.F] == [a for a in plain.actions[d] if a.kind != Kind.F]
            assert [a for a in kept if a.kind == Kind.F] == [a for a in plain.actions[d] if a.kind == Kind.F]


def _two(rows: list[list[Action]], **options: int) -> Schedule:
    return Schedule("t", 2, 2, 2, (0, 1), rows, {VOCAB: 1, **options})


GOOD = [[F(0, 0), F(0, 1), S(0, 0), T(0, 0), S(0, 1), T(0, 1), BW(0, 0), BW(0, 1)],
        [F(1, 0), S(1, 0), T(1, 0), BW(1, 0), F(1, 1), S(1, 1), T(1, 1), BW(1, 1)]]


@pytest.mark.parametrize(("rows", "options", "says"), [
    (GOOD, {VOCAB: 0}, "does not split it: give the schedule the option vocab=1"),
    ([[F(0, 0), F(0, 1), S(0, 0), T(0, 0), T(0, 1), BW(0, 0), BW(0, 1)], GOOD[1]], {}, "microbatch 1 has no S"),
    ([[F(0, 0), F(0, 1), S(1, 0), T(0, 0), S(0, 1), T(0, 1), BW(0, 0), BW(0, 1)], GOOD[1]], {}, "on device 1"),
    ([[F(0, 0), F(0, 1), S(0, 1), S(0, 0), T(0, 0), T(0, 1), BW(0, 0), BW(0, 1)], GOOD[1]], {},
     "one microbatch order"),
    ([GOOD[0], [S(1, 0), F(1, 0), T(1, 0), BW(1, 0), F(1, 1), S(1, 1), T(1, 1), BW(1, 1)]], {},
     "1S0 comes before 1F0"),
    ([GOOD[0], [F(1, 0), S(1, 0), BW(1, 0), T(1, 0), F(1, 1), S(1, 1), T(1, 1), BW(1, 1)]], {},
     "1BW0 comes before 1T0"),
    ([[F(0, 0), F(0, 1), T(0, 0), S(0, 0), S(0, 1), T(0, 1), BW(0, 0), BW(0, 1)], GOOD[1]], {},
     "0T0 comes before 0S0"),
    ([[F(0, 0), F(0, 1), S(0, 0), S(0, 1), BW(0, 0), T(0, 0), T(0, 1), BW(0, 1)], GOOD[1]], {}, "deadlock"),
])
def test_a_misplaced_vocabulary_pass_is_refused_in_one_line(rows: list[list[Action]], options: dict[str, int],
                                                            says: str) -> None:
    with pytest.raises(ScheduleError) as err:
        dependency_graph(_two(rows, **options))
    assert says in str(err.value).splitlines()[0]
    assert dependency_graph(_two(GOOD))  # the right one passes


def test_the_option_is_checked_where_the_schedule_is_made() -> None:
    with pytest.raises(ScheduleError, match="option vocab is 1"):
        _two(GOOD, **{VOCAB: 2})
    with pytest.raises(ScheduleError, match="3 devices but 2 stages"):
        Schedule("t", 3, 2, 1, (0, 1), [[], [], []], {VOCAB: 1})
    with pytest.raises(ScheduleError, match="do not go together"):
        Schedule("t", 2, 2, 2, (0, 1), GOOD, {VOCAB: 1, "seq_chunks": 2})


def test_families_without_it_say_which_have_it() -> None:
    with pytest.raises(ConfigError) as err:
        schedules.build("chimera", 4, 4, vocab=1)
    assert "v-half" in str(err.value) and "1f1b" in str(err.value)
    with pytest.raises(ConfigError, match="from 0 to 1"):
        schedules.build("1f1b", 4, 4, vocab=2)


def test_files_keep_the_passes_and_a_csv_refuses_them() -> None:
    split = schedules.build("v-half", 4, 8, vocab=1)
    assert Schedule.from_text(split.to_text()) == split
    assert Schedule.from_json(json.loads(json.dumps(split.to_json()))) == split
    with pytest.raises(ScheduleError, match="CSV file holds no option"):
        split.to_csv()


COSTS = dict(f=1.0, b=1.0, w=1.0, vocab_f=0.6, vocab_b=0.6, vocab_w=0.6, vocab_memory=0.5)


@pytest.mark.parametrize(("name", "p"), [("1f1b", 4), ("zb-h1", 3), ("v-half", 4), ("gpipe", 2)])
def test_on_the_last_stage_the_output_layer_costs_what_a_stage_override_says(name: str, p: int) -> None:
    schedule = schedules.build(name, p, 2 * p)
    S_ = schedule.stages
    with_layer = simulate(schedule, CostModel(**COSTS))
    share = p / S_  # a stage is this fraction of a device's share
    over = StageOverride(f=share + 0.6, b=share + 0.6, w=share + 0.6, memory=share + 0.5)
    by_hand = simulate(schedule, CostModel(f=1, b=1, w=1, stage_overrides={S_ - 1: over}))
    assert with_layer.makespan == pytest.approx(by_hand.makespan)
    assert with_layer.peak_memory == pytest.approx(by_hand.peak_memory)


@pytest.mark.parametrize(("name", "p", "m"), [("1f1b", 4, 8), ("zb-h1", 4, 8), ("zb-v", 3, 6), ("v-half", 4, 8),
                                              ("v-min", 4, 12), ("kfkb", 2, 4)])
def test_split_the_layer_costs_each_device_a_devices_th(name: str, p: int, m: int) -> None:
    split = schedules.build(name, p, m, vocab=1)
    result = simulate(split, CostModel(**COSTS))
    plain = simulate(schedules.build(name, p, m), CostModel(f=1, b=1, w=1))
    for d in range(p):  # busy: the stages' work plus m shards' S and T, each a p-th of the layer
        assert result.busy[d] == pytest.approx(plain.busy[d] + m * 1.8 / p)
    # memory: every device's peak is at most its own stages' plus a p-th of the layer's logits for each microbatch
    # it holds between an S and its T (at most m), and the last stage no longer holds the whole layer's
    for d in range(p):
        assert result.peak_memory[d] <= plain.peak_memory[d] * max(1, _ahead_factor(split, d)) + m * 0.5 / p + 1e-9
    assert result.makespan >= m * (3 + 1.8 / p) - 1e-9  # a device's work bound


def _ahead_factor(split: Schedule, d: int) -> float:
    """How many more microbatches than the plain schedule device d may hold (forwards run early): a bound's factor."""
    return 1 + 4 / max(1, len([a for a in split.actions[d] if a.kind == Kind.F]))


@pytest.mark.parametrize(("name", "p", "m"), [("zb-h1", 4, 32), ("zb-v", 4, 32), ("v-half", 4, 32),
                                              ("v-half", 8, 32)])
def test_with_a_split_backward_the_layer_leaves_the_critical_path(name: str, p: int, m: int) -> None:
    """The paper's ratio (an output layer of 2.4 transformer layers over stages of 4): on the last stage it sets
    the pace; split and placed, the step is within 6% of a device's work bound and shorter than before."""
    cost = CostModel(**COSTS)
    plain = simulate(schedules.build(name, p, m), cost)
    split = simulate(schedules.build(name, p, m, vocab=1), cost)
    bound = m * (3 + 1.8 / p)
    assert split.makespan <= 1.06 * bound + 3 * p  # within the work bound and a fill and drain
    assert split.makespan < 0.8 * plain.makespan


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 32), (3, 3)])
def test_1f1b_split_warms_up_with_one_more_forward(p: int, m: int) -> None:
    """1F1B with vocab=1 is 1F1B with one more forward of warm-up on every device (the family's
    ``vocab_warmup``): the passes of the schedule are 1F1B's order of warm-up p-i, so device i holds
    min(m, p-i+1) microbatches at its peak, one more than 1F1B's p-i."""
    from pipefold.schedules.kfkb import one_f_one_b

    split = schedules.build("1f1b", p, m, vocab=1)
    wider = one_f_one_b(p, m, warmup_extra=1)
    assert [[a for a in row if a.kind not in (Kind.S, Kind.T)] for row in split.actions] == \
        [list(row) for row in wider.actions]
    cost = CostModel(f=1.0, b=1.0, w=1.0, memory=1.0)
    assert list(simulate(split, cost).peak_memory) == [min(m, p - i + 1) for i in range(p)]
    assert list(simulate(schedules.build("1f1b", p, m), cost).peak_memory) == [min(m, p - i) for i in range(p)]


def test_the_cli_simulates_it_and_reads_the_costs() -> None:
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pipefold", "simulate", *argv], capture_output=True, text=True,
                              check=False)

    got = run("zb-v", "--devices", "4", "--microbatches", "16", "--vocab", "1", "--vocab-cost", "0.6,0.6,0.6,0.5",
              "--json")
    assert got.returncode == 0, got.stderr
    data = json.loads(got.stdout)
    expected = simulate(schedules.build("zb-v", 4, 16, vocab=1), CostModel(
        vocab_f=0.6, vocab_b=0.6, vocab_w=0.6, vocab_memory=0.5))
    assert data["makespan"] == pytest.approx(expected.makespan, rel=1e-6)
    for argv, says in ((("1f1b", "--vocab-cost", "1,2"), "use F,B,W or F,B,W,MEM"),
                       (("1f1b", "--vocab-cost", "1,2,-1"), "--vocab-cost 1,2,-1"),
                       (("chimera", "--devices", "4", "--vocab", "1"), "chimera")):
        bad = run(*argv)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert says in bad.stderr


# --------------------------------------------------------------------------- the runtime, exact

_SIZE = {"n_layer": 4, "n_embd": 32, "n_head": 4, "block_size": 32, "vocab_size": 67, "dropout": 0.0}
"""A vocabulary of 67 entries: over 2 or 3 devices the last shard is padded."""


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 67, (4, 32), generator=g)
    return x, torch.roll(x, -1, 1)


def _layers() -> list[nn.Module]:
    from pipefold.models.gpt import GPTConfig, build_gpt

    return [layer.double() for layer in build_gpt(GPTConfig(**_SIZE), seed=0)]


def _reference(steps: int) -> tuple[list[float], list[nn.Module], float]:
    from pipefold.models.gpt import gpt_loss

    layers = _layers()
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = _batch(99)
        evaluated = gpt_loss(model(x), y).item()
    return losses, layers, evaluated


def _cut(flat: list[nn.Module], n: int, per: int) -> list[nn.Module]:
    """``flat`` cut into ``n`` stages of ``per`` layers, the rest with the last."""
    return [nn.Sequential(*flat[s * per:(s + 1) * per if s < n - 1 else len(flat)]) for s in range(n)]


def _train(rank: int, init: str, world: int, schedule: str, steps: int, embed: bool, out: Any) -> None:
    import torch.distributed as dist

    from pipefold import Pipeline, VocabShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        if schedule in HAND_MADE:
            built = Schedule.from_text(HAND_MADE[schedule])
        else:
            ref = ScheduleRef.parse(schedule)
            built = schedules.build(ref.name, world, 4, **ref.kwargs)
        layers = _layers()
        head = layers[-1]
        flat = [*layers[:-1], head.ln_f]  # the last stage ends with the final norm; the projection is split
        per = len(flat) // built.stages
        stages = _cut(flat, built.stages, per)
        mine = built.stages_of(rank)
        shard = VocabShard.of(head.lm_head.weight, rank, world)
        embedding = VocabShard.of(layers[0].wte.weight, rank, world) if embed else None
        if embed:
            layers[0].wte = nn.Identity()  # the first stage adds the positions to the embeddings it is given
        pipe = Pipeline({s: stages[s] for s in mine}, built, vocab=shard, embedding=embedding)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            x, y = _batch(step)
            opt.zero_grad()
            losses.append(pipe.step(x, target=y, all_ranks=True))
            opt.step()
        _, evaluated = pipe.forward(_batch(99)[0], target=_batch(99)[1], all_ranks=True)
        weights = {f"{s}": [p.detach().numpy().copy() for p in stages[s].parameters()] for s in mine}
        rows = embedding.weight.detach().numpy().copy() if embedding is not None else None
        out.put((rank, losses, evaluated, weights, shard.weight.detach().numpy().copy(), rows, built.stages))
        pipe.close()
    finally:
        dist.destroy_process_group()


HAND_MADE = {"forward before T": """name: forward-before-t
options: {"vocab": 1}
devices: 2
stages: 2
microbatches: 2
placement: linear
device 0: 0F0 0F1 0S0 0T0 0S1 0T1 0BW0 0BW1
device 1: 1F0 1S0 1F1 1T0 1BW0 1S1 1T1 1BW1
"""}
"""A schedule whose last device sends microbatch 1's output (after its 1F1) before it reduces microbatch 0's
gradient (in its 1T0), where device 0 reduces first: collectives of one kind pair up by order only on groups of
their own."""


@pytest.mark.parametrize(("schedule", "world", "embed"), [
    ("1f1b:vocab=1", 2, False), ("zb-h1:vocab=1", 2, True), ("zb-v:vocab=1", 2, True), ("v-half:vocab=1", 3, True),
    ("gpipe:vocab=1", 3, True), ("forward before T", 2, True)])
def test_a_pipeline_with_the_output_layer_split_trains_as_one_process(schedule: str, world: int,
                                                                      embed: bool) -> None:
    """The GPT stepped through ``Pipeline`` in a user's loop with its output projection (and, with ``embed``, its
    token embedding) split by vocabulary over every rank (67 entries: the last shard padded): losses, the stages'
    weights and each shard's rows after three SGD steps, and the evaluation's loss equal one process (float64)."""
    losses, layers, evaluated = _reference(3)
    got = run_ranks(_train, world, world, schedule, 3, embed)
    head = layers[-1].lm_head.weight.detach().numpy()
    wte = layers[0].wte.weight.detach().numpy()
    flat = [*layers[:-1], layers[-1].ln_f]
    size = -(-67 // world)
    assert len(got) == world
    for rank, got_losses, got_eval, weights, shard, embedded, n_stages in got:
        assert np.allclose(got_losses, losses, rtol=0, atol=1e-10), (got_losses, losses)
        assert abs(got_eval - evaluated) < 1e-10
        rows = head[rank * size:(rank + 1) * size]
        assert np.abs(shard[:len(rows)] - rows).max() < 1e-10
        assert not shard[len(rows):].any()  # padding rows take no gradient
        assert (embedded is not None) == embed
        if embedded is not None:
            rows = wte[rank * size:(rank + 1) * size]
            assert np.abs(embedded[:len(rows)] - rows).max() < 1e-10
            assert not embedded[len(rows):].any()
        stages = _cut(flat, n_stages, len(flat) // n_stages)
        for key, params in weights.items():
            ref = [p.detach().numpy() for name, p in stages[int(key)].named_parameters()
                   if not (embed and name == "0.wte.weight")]  # the embedding's rows are the shards
            assert len(ref) == len(params)
            for a, b in zip(params, ref, strict=True):
                assert np.abs(a - b).max() < 1e-10, key


def _small(seed: int = 0) -> tuple[nn.Embedding, nn.Module, nn.Module, nn.Linear]:
    """An embedding whose entry 3 is padding (nn.Embedding's padding_idx), two layers and an output projection."""
    torch.manual_seed(seed)
    return (nn.Embedding(67, 16, padding_idx=3).double(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()).double(),
            nn.Linear(16, 16).double(), nn.Linear(16, 67, bias=False).double())


def _padded_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    x[:, ::3] = 3  # every third token the padding entry
    return x, y


def _padded(rank: int, init: str, world: int, out: Any) -> None:
    import torch.distributed as dist

    from pipefold import Pipeline, VocabShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        emb, first, second, head = _small()
        embedding = VocabShard.of(emb.weight, rank, world, padding_idx=emb.padding_idx)
        shard = VocabShard.of(head.weight, rank, world)
        pipe = Pipeline({0: first} if rank == 0 else {1: second}, "zb-h1:vocab=1", microbatches=2, vocab=shard,
                        embedding=embedding)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        for step in range(2):
            x, y = _padded_batch(step)
            opt.zero_grad()
            pipe.step(x, target=y)
            opt.step()
        out.put((rank, embedding.weight.detach().numpy().copy()))
        pipe.close()
    finally:
        dist.destroy_process_group()


def test_an_embeddings_padding_entry_takes_no_gradient_split_as_whole() -> None:
    """nn.Embedding's padding_idx, split by vocabulary: its row keeps its weights, as in one process, and every
    other row steps as one process steps it (float64, two SGD steps)."""
    emb, first, second, head = _small()
    before = emb.weight.detach().clone()
    model = nn.Sequential(emb, first, second, head)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        x, y = _padded_batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).reshape(-1, 67), y.reshape(-1)).backward()
        opt.step()
    whole = emb.weight.detach().numpy()
    assert np.array_equal(whole[3], before[3].numpy()) and not np.allclose(whole[4], before[4].numpy())
    got = dict(run_ranks(_padded, 2, 2))
    joined = np.concatenate([got[0], got[1]])[:67]
    assert np.abs(joined - whole).max() < 1e-12


@pytest.mark.parametrize("argv", [
    ["--model", "gpt", "--schedule", "zb-v:vocab=1", "--devices", "2"],
    ["--model", "gpt", "--schedule", "v-half:vocab=1", "--devices", "3", "--layers", "4"],
    ["--model", "gpt", "--schedule", "1f1b:vocab=1", "--devices", "2", "--recompute", "full"],
    ["--hf", "llama", "--schedule", "zb-h1:vocab=1", "--devices", "2"],
])
def test_train_with_the_output_layer_split_checks_against_one_process(capsys: pytest.CaptureFixture[str],
                                                                      argv: list[str]) -> None:
    """``pipefold train --check``: the first step's loss and every gradient, the shards' rows of the projection
    joined, against one process (float32)."""
    from pipefold.cli.main import main

    if "--hf" in argv:
        pytest.importorskip("transformers")
    assert main(["train", *argv, "--microbatches", "4", "--steps", "2", "--check"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("check against one process"))
    loss, grad = (float(x.split()[-1]) for x in line.split(":", 1)[1].split(","))
    assert loss < 1e-5 and grad < 1e-5, line


@pytest.mark.parametrize(("argv", "expected"), [
    (["--model", "mlp"], "the mlp model declares no output projection to split by vocabulary"),
    (["--hf", "gpt2"], "the gpt2 model's lm_head is tied to its embedding"),
    (["--model", "gpt", "--dp", "2"], "does not run with --dp 2 yet"),
    (["--model", "gpt", "--optimizer", "kfac"], "does not run with --optimizer kfac yet"),
    (["--model", "gpt", "--schedule", "dualpipev:vocab=1"], "schedule dualpipev cannot split its output layer"),
    (["--model", "gpt", "--vocab-size", "67"], "the gpt reads its corpus as bytes (ids 0..255), which --vocab-size 67 "
                                               "cannot hold: give --vocab-size 256 or more"),
])
def test_what_train_cannot_split_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                             expected: str) -> None:
    from pipefold.cli.main import main

    if "--hf" in argv:
        pytest.importorskip("transformers")
    schedule = [] if "--schedule" in argv else ["--schedule", "1f1b:vocab=1"]
    assert main(["train", *schedule, *argv, "--devices", "2", "--steps", "1"]) != 0
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err


def _refused(rank: int, init: str, world: int, case: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold import ConfigError, Pipeline, VocabShard
    from pipefold.models.gpt import gpt_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        layers = _layers()
        stage = nn.Sequential(*layers[:3]) if rank == 0 else nn.Sequential(*layers[3:-1], layers[-1].ln_f)
        shard = VocabShard.of(layers[-1].lm_head.weight, rank, world)
        try:
            if case == "no shard":
                Pipeline(stage, "1f1b:vocab=1", loss_fn=gpt_loss, microbatches=2)
            elif case == "shard without the option":
                Pipeline(stage, "1f1b", loss_fn=gpt_loss, vocab=shard, microbatches=2)
            elif case == "another rank's shard":
                Pipeline(stage, "1f1b:vocab=1", vocab=VocabShard.of(layers[-1].lm_head.weight, 1 - rank, world),
                         microbatches=2)
            elif case == "evaluation without targets":
                pipe = Pipeline(stage, "1f1b:vocab=1", vocab=shard, microbatches=2)
                hidden, loss = pipe.forward(_batch(0)[0])
                out.put((rank, None if hidden is None else tuple(hidden.shape), loss))
                return
            elif case == "embedding without the option":
                Pipeline(stage, "1f1b", loss_fn=gpt_loss, microbatches=2,
                         embedding=VocabShard.of(layers[0].wte.weight, rank, world))
            elif case == "embedding of another rank":
                Pipeline(stage, "1f1b:vocab=1", vocab=shard, microbatches=2,
                         embedding=VocabShard.of(layers[0].wte.weight, 1 - rank, world))
            elif case == "embeddings for tokens":
                embedding = VocabShard.of(layers[0].wte.weight, rank, world)
                layers[0].wte = nn.Identity()
                pipe = Pipeline(stage, "1f1b:vocab=1", vocab=shard, microbatches=2, embedding=embedding)
                x, y = _batch(0)
                pipe.step(torch.randn(*x.shape, 32, dtype=torch.float64), target=y)
            elif case == "targets on one rank":
                pipe = Pipeline(stage, "1f1b:vocab=1", vocab=shard, microbatches=2)
                pipe.forward(_batch(0)[0], target=_batch(0)[1] if rank == 1 else None)
            else:  # no targets (on any rank: one that has them would wait for the others)
                pipe = Pipeline(stage, "1f1b:vocab=1", vocab=shard, microbatches=2)
                pipe.step(_batch(0)[0])
            out.put((rank, "ran"))
        except ConfigError as exc:
            out.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("case", "expected"), [
    ("no shard", "give each rank its shard of the output projection"),
    ("shard without the option", "name a schedule with vocab=1"),
    ("another rank's shard", "device 0 of a pipeline of 2 holds vocabulary shard 0 of 2 (got shard 1 of 2)"),
    ("embedding without the option", "embedding= splits the input embedding by vocabulary with the output layer, "
                                     "and 1f1b keeps the output layer on the last stage"),
    ("embedding of another rank", "device 0 of a pipeline of 2 holds embedding shard 0 of 2 (got shard 1 of 2)"),
    ("embeddings for tokens", "give every rank the batch's token ids (integers) as the first input of "
                              "Pipeline.step, got a tensor of torch.float64 for microbatch 0"),
])
def test_what_a_pipeline_cannot_split_is_one_line_on_every_rank(case: str, expected: str) -> None:
    got = dict(run_ranks(_refused, 2, 2, case))
    assert all(expected.replace("device 0", f"device {r}").replace("shard 0 of", f"shard {r} of")
               .replace("shard 1 of 2)", f"shard {1 - r} of 2)") in got[r] for r in (0, 1)), got


def test_an_evaluation_without_targets_gives_the_hidden_states_and_one_with_some_is_refused() -> None:
    got = {r: rest for r, *rest in run_ranks(_refused, 2, 2, "evaluation without targets", timeout=120)}
    assert got[1] == [(4, 32, 32), None] and got[0] == [None, None]  # the last stage's output, no loss
    got = dict(run_ranks(_refused, 2, 2, "targets on one rank", timeout=120))
    assert all("give Pipeline.forward the targets on every rank or on none (1 of 2 ranks gave them)" in got[r]
               for r in (0, 1)), got


def test_a_rank_without_targets_is_told_to_give_them() -> None:
    got = dict(run_ranks(_refused, 2, 2, "no targets", timeout=120))
    assert all("this rank holds a shard of the output layer: give the batch's targets" in got[r] for r in (0, 1))


def test_the_planner_tries_the_split_where_the_costs_price_the_layer() -> None:
    """``plan --memory`` with the output layer priced: every family that can split it is tried split too, and the
    choice is the fastest within the budget among the plain and the split schedules, each simulated on its own."""
    from pipefold.plan.budget import candidates, plan

    cost = CostModel(**COSTS)
    with_split = candidates(4, 8, vocab=True)
    plain = candidates(4, 8)
    assert len(with_split) - len(plain) == sum(1 for name, _ in plain if schedules.get(name).option(VOCAB))
    chosen = plan(4, 8, 4.0, cost)
    assert chosen.best.options.get(VOCAB) == 1
    for name in ("v-half", "zb-v", "zb-h1", "1f1b", "v-min"):
        for options in ({}, {VOCAB: 1}):
            other = simulate(schedules.build(name, 4, 8, **options), cost)
            if max(other.peak_memory) <= 4.0:
                assert chosen.result.makespan <= other.makespan + 1e-9, (name, options)
    assert not any(VOCAB in options for _, options in candidates(4, 8))  # unpriced: the layer stays put


def test_train_says_how_the_vocabulary_pads(capsys: pytest.CaptureFixture[str]) -> None:
    """A vocabulary the devices do not divide is padded, and the summary says so (one that divides: no padding)."""
    from pipefold.cli.main import main

    assert main(["train", "--schedule", "1f1b:vocab=1", "--devices", "3", "--layers", "4", "--vocab-size", "1000",
                 "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert ("output layer and token embedding split by vocabulary: 334 of their 1,000 rows a device (padded with "
            "2 rows to 1,002: 1,000 does not divide over 3; padding is left out of the loss)") in out
    from pipefold.cli.train_cmds import vocab_line

    assert vocab_line(1024, 2) == "output layer split by vocabulary: 512 of its 1,024 rows a device"


def test_train_keeps_a_devices_rows_of_the_embedding_and_the_projection(capsys: pytest.CaptureFixture[str]) -> None:
    """``pipefold train`` with vocab=1 splits the token embedding with the output layer: each rank's weights,
    gradients and Adam's state (16 bytes a parameter, and a 4-byte step count for each tensor) are its stages'
    without either matrix plus its rows of both, V/p x h each (closed form, from the model's own layers)."""
    from pipefold.cli.main import main
    from pipefold.models import make_model

    assert main(["train", "--model", "gpt", "--schedule", "1f1b:vocab=1", "--devices", "2", "--layers", "2",
                 "--vocab-size", "4096", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    layers = make_model("gpt", layers=2, vocab_size=4096).build()
    rows = 4096 // 2 * layers[0].wte.weight.shape[1]
    starts = [*out["boundaries"], len(layers)]
    for rank, static in enumerate(out["static_bytes"]):
        held = [p for layer in layers[starts[rank]:starts[rank + 1]] for name, p in layer.named_parameters()
                if name not in ("wte.weight", "lm_head.weight")]
        assert static == 16 * (sum(p.numel() for p in held) + 2 * rows) + 4 * (len(held) + 2), rank


def test_the_measured_steps_replay_prices_the_vocabulary_passes() -> None:
    """The cost model of a measured step (``step_costs``, what train's "simulated from the measured costs" replays)
    takes each device's S and T as a devices-th of the whole layer: fed it, the simulator gives every device exactly
    its F, B, W, S and T times over the microbatches as busy time (events written here by hand, 2 devices)."""
    from pipefold.runtime.executor import Event, StepStats
    from pipefold.runtime.pipeline import step_costs

    split = schedules.build("zb-h1", 2, 4, vocab=1)
    seconds = {Kind.F: 1.0, Kind.B: 2.0, Kind.W: 0.5, Kind.S: 0.25, Kind.T: 0.75}
    steps = []
    for d, row in enumerate(split.actions):
        st = StepStats(d)
        for a in row:
            st.events.append(Event(str(a), a.kind, 0.0, seconds[a.kind] * (1 + d / 10)))
        steps.append(st)
    cost = step_costs(steps, split)
    median = {k: (v + v * 1.1) / 2 for k, v in seconds.items()}
    assert cost.vocab_f == pytest.approx(2 * median[Kind.S]) and cost.vocab_w == pytest.approx(median[Kind.T])
    result = simulate(split, cost)
    for d in range(2):
        own = {k: v * (1 + d / 10) for k, v in seconds.items()}
        assert result.busy[d] == pytest.approx(4 * (own[Kind.F] + own[Kind.B] + own[Kind.W])
                                               + 4 * (median[Kind.S] + median[Kind.T]))

"""The public Pipeline object inside a user's own loop: exact against one process, on every schedule family."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from conftest import run_ranks
from pipefold.errors import ConfigError

TOL = 1e-5


def _model(n: int, width: int = 8, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]


def _batch(step: int, width: int = 8, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def _reference(n: int, steps: int, lr: float = 0.1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: the whole model, the same loop (SGD, mean loss)."""
    layers = _model(n)
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, init: str, world: int, schedule: str, steps: int, memory: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.pipeline import Pipeline
    from pipefold.schedules import build

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        name, _, opts = schedule.partition(":")
        built = build(name, world, 4, **{k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)})
        layers = _model(built.stages)
        mine = built.stages_of(rank)
        saving: dict[str, Any] = {"recompute": {"recompute": dict.fromkeys(mine, 1)}, "offload": {"offload": (1, 1)},
                                  "activations": {"offload_activations": "all"},
                                  "half": {"offload_activations": 0.5}, "": {}}[memory]
        pipe = Pipeline([layers[s] for s in mine], schedule, microbatches=4, loss_fn=nn.functional.mse_loss,
                        **saving)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            x, y = _batch(step)
            opt.zero_grad()
            losses.append(pipe.step(x, target=y, all_ranks=True))
            opt.step()
        _, loss = pipe.forward(*_batch(99)[:1], target=_batch(99)[1])
        state = {f"{s}.{k}": v.detach().numpy().copy() for s in mine for k, v in layers[s].state_dict().items()}
        out.put((rank, losses, state, loss))
        pipe.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("schedule", "memory"), [
    ("1f1b", ""), ("zb-h1", ""), ("zb-v", ""), ("interleaved-1f1b:v=2", ""), ("chimera", ""), ("dualpipe", ""),
    ("dualpipev", ""), ("v-half", ""), ("kfkb:k=2", ""), ("gpipe", ""), ("zb-v", "recompute"),
    ("1f1b", "recompute"), ("zb-h1", "offload"), ("v-min", "offload"), ("1f1b", "activations"),
    ("zb-v", "activations"), ("dualpipev", "activations"), ("interleaved-1f1b:v=2", "half"), ("gpipe", "half")])
def test_a_users_loop_trains_exactly_as_one_process(schedule: str, memory: str) -> None:
    """Three steps of SGD in a user's loop, then an evaluation (the forwards only): every family's losses and
    weights equal one process's, with stages recomputing their first layer, offloading their layers or offloading
    all or half of their activations too."""
    from pipefold.schedules import build

    world, steps = 2, 3
    name, _, opts = schedule.partition(":")
    stages = build(name, world, 4, **{k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)}).stages
    want_losses, want_state = _reference(stages, steps)
    trained = nn.Sequential(*_model(stages))
    trained.load_state_dict(want_state)
    with torch.no_grad():
        want_eval = nn.functional.mse_loss(trained(_batch(99)[0]), _batch(99)[1]).item()
    got = run_ranks(_train, world, world, schedule, steps, memory)
    assert len(got) == world
    state: dict[str, torch.Tensor] = {}
    evaluated = [loss for _, _, _, loss in got if loss is not None]
    assert evaluated and evaluated == pytest.approx([want_eval] * len(evaluated), abs=TOL)  # the last stage's rank(s)
    for _, losses, part, _ in got:
        assert losses == pytest.approx(want_losses, abs=TOL)
        state.update(part)
    assert sorted(state) == sorted(want_state)
    for k, v in want_state.items():
        torch.testing.assert_close(torch.from_numpy(state[k]), v, atol=TOL, rtol=0)


class _Embed(nn.Module):
    """Stage 0 of a model whose stages pass a dict: hidden states, a mask that needs no gradient, and a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        return {"hidden": self.proj(x) * scale, "mask": mask, "causal": True, "ids": mask.long().cumsum(-1)}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, causal: bool, ids: torch.Tensor) -> dict[str, Any]:
        assert causal is True and ids.dtype == torch.int64
        return {"hidden": torch.tanh(self.lin(hidden)) * mask, "mask": mask, "causal": causal, "ids": ids}


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, causal: bool, ids: torch.Tensor) -> tuple[Any, ...]:
        return self.out(hidden), ids


def _dict_model(n: int) -> list[nn.Module]:
    torch.manual_seed(1)
    return [_Embed(), *(_Block() for _ in range(n - 2)), _Head()]


def _dict_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    logits, ids = output
    return nn.functional.mse_loss(logits, target) + 0.0 * ids.sum()


def _dict_batch(step: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, seq, 8, generator=g)
    mask = (torch.rand(4, seq, 1, generator=g) > 0.2).float()
    return x, mask, torch.randn(4, seq, 8, generator=g)


def _train_dicts(rank: int, init: str, schedule: str, seqs: list[int], out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        from pipefold.runtime.pipeline import resolve_schedule

        built = resolve_schedule(schedule, 2, 2)
        layers = _dict_model(built.stages)
        pipe = Pipeline({s: layers[s] for s in built.stages_of(rank)}, built, loss_fn=_dict_loss)
        losses, grads = [], []
        for step, seq in enumerate(seqs):  # the sequence length changes from step to step
            x, mask, y = _dict_batch(step, seq)
            for p in pipe.parameters():
                p.grad = None
            losses.append(pipe.step(x, mask=mask, scale=0.5, target=y, all_ranks=True))
            grads.append({f"{s}.{k}": p.grad.numpy().copy() for s in built.stages_of(rank)
                          for k, p in layers[s].named_parameters()})
        out.put((rank, losses, grads))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_dicts_masks_flags_and_changing_shapes_travel_between_stages(schedule: str) -> None:
    """A dict of hidden states, a mask needing no gradient, an integer tensor and a Python flag cross the stages;
    the sequence length changes every step; losses and gradients equal one process's."""
    from pipefold.runtime.pipeline import resolve_schedule

    seqs = [5, 3, 7]
    stages = resolve_schedule(schedule, 2, 2).stages
    layers = _dict_model(stages)
    want_losses, want_grads = [], []
    for step, seq in enumerate(seqs):
        x, mask, y = _dict_batch(step, seq)
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        value: Any = layers[0](x, mask=mask, scale=0.5)
        for layer in layers[1:]:
            value = layer(**value)
        loss = _dict_loss(value, y)
        loss.backward()
        want_losses.append(loss.item())
        want_grads.append({f"{s}.{k}": p.grad for s, layer in enumerate(layers) for k, p in layer.named_parameters()})
    got = run_ranks(_train_dicts, 2, schedule, seqs)
    for _, losses, grads in got:
        assert losses == pytest.approx(want_losses, abs=TOL)
        for step, each in enumerate(grads):
            for k, g in each.items():
                torch.testing.assert_close(torch.from_numpy(g), want_grads[step][k], atol=TOL, rtol=0)


def _refusals(rank: int, init: str, folder: str, out: Any) -> None:
    """Each mistake a user can make building or stepping a Pipeline, made on both ranks alike: one line each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold import build
    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from pipefold.ir import save

    layers = _model(2)
    mine = layers[rank]
    loss = nn.functional.mse_loss
    save(build("zb-h1", 4, 4), f"{folder}/four{rank}.json")
    cases: dict[str, Any] = {
        "file-devices": lambda: Pipeline(mine, f"{folder}/four{rank}.json", loss_fn=loss),
        "offload-k": lambda: Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss, offload=(0, 1)),
        "budget-named": lambda: Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss, memory_budget=1e6),
        "devices": lambda: Pipeline(mine, build("1f1b", 4, 4), loss_fn=loss),
        "microbatches": lambda: Pipeline(mine, "1f1b", loss_fn=loss),
        "no-loss": lambda: Pipeline(mine, "1f1b", microbatches=4),
        "count": lambda: Pipeline([mine, mine], "1f1b", microbatches=4, loss_fn=loss),
        "no-weights": lambda: Pipeline(nn.Tanh() if rank == 0 else mine, "zb-h1", microbatches=4, loss_fn=loss),
        "mesh": lambda: Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss,
                                 mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))),
        "unknown": lambda: Pipeline(mine, "2f2b", microbatches=4, loss_fn=loss),
        "file": lambda: Pipeline(mine, "no/such/file.json", microbatches=4, loss_fn=loss),
        "precision": lambda: Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss, precision="bf8"),
        "master-offload": lambda: Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss, precision="bf16-master",
                                           offload=(1, 1)),
        "compile": lambda: Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss, compile="fast"),
        "backend": lambda: Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss, compile=True,
                                    compile_backend="tvm"),
        "share": lambda: Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss, offload_activations=2),
        "both-offloads": lambda: Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss, offload=(1, 1),
                                          offload_activations="all"),
    }
    got = {}
    for name, make in cases.items():
        try:
            make()
            got[name] = None
        except ConfigError as exc:
            got[name] = str(exc)
    pipe = Pipeline(mine, "1f1b", microbatches=4, loss_fn=loss)
    x, y = _batch(0)
    adamw = lambda ps: torch.optim.AdamW(ps)  # noqa: E731
    offloaded = Pipeline(_model(2)[rank], "1f1b", microbatches=4, loss_fn=loss, offload=(1, 1))
    steps = {"no-grad": lambda: _no_grad(pipe.step, x, target=y),
             "rows": lambda: pipe.step(x[:6], target=y[:6]),  # each rank refuses its part: the batch, the target
             "chunks-zero1": lambda: pipe.chunked(adamw, zero1=True),
             "chunks-size": lambda: pipe.chunked(adamw, chunk_size=2),
             "chunks-memory": lambda: pipe.chunked(adamw, device_memory=-1),
             "chunks-small": lambda: pipe.chunked(adamw, chunk_size="100B"),
             "chunks-large": lambda: pipe.chunked(adamw, chunk_size="8MB", device_memory="4MB"),
             "chunks-offload": lambda: offloaded.chunked(adamw),
             "chunks-optimizer": lambda: pipe.chunked(lambda ps: torch.optim.Adafactor(ps))}
    if rank == 1:  # only the rank with the last stage needs the target (the other would start the step)
        steps["target"] = lambda: pipe.step(x)
    for name, call in steps.items():
        try:
            call()
            got[name] = None
        except ConfigError as exc:
            got[name] = str(exc)
    out.put((rank, got))
    dist.destroy_process_group()


def _no_grad(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.no_grad():
        return fn(*args, **kwargs)


def test_mistakes_building_or_stepping_a_pipeline_are_one_line_each(tmp_path: Any) -> None:
    got = dict(run_ranks(_refusals, 2, str(tmp_path)))
    both = ("devices", "microbatches", "count", "mesh", "unknown", "file", "no-grad", "file-devices", "offload-k",
            "budget-named", "precision", "master-offload", "compile", "backend", "share", "both-offloads",
            "chunks-zero1", "chunks-size", "chunks-memory", "chunks-small", "chunks-large", "chunks-offload",
            "chunks-optimizer")
    for rank, lines in got.items():
        for name in both:
            assert lines[name] is not None and "\n" not in lines[name], (rank, name, lines[name])
        assert "4 devices" in lines["devices"] and "2 ranks" in lines["devices"]
        assert "microbatches=N" in lines["microbatches"]
        assert "no_grad" in lines["no-grad"] and "Pipeline.forward" in lines["no-grad"]
        assert "'pp'" in lines["mesh"]
        assert "2f2b" in lines["unknown"]
        assert "schedule file" in lines["file-devices"] and "4 devices" in lines["file-devices"]
        assert "k=1 or more" in lines["offload-k"]
        assert "auto" in lines["budget-named"]
        assert "unknown dtype 'bf8'" in lines["precision"]
        assert "precision='bf16' (autocast)" in lines["master-offload"]
        assert "'split' or 'whole'" in lines["compile"] and "aot_eager" in lines["backend"]
        assert "offload_activations= 2" in lines["share"] and "from 0 to 1" in lines["share"]
        assert "choose one of them" in lines["both-offloads"]
        assert "'dp' dimension" in lines["chunks-zero1"]
        assert "at least 4 (got 2)" in lines["chunks-size"] and "got -1" in lines["chunks-memory"]
        assert "a chunk of 25 elements cannot hold parameter 0 (64 elements)" in lines["chunks-small"]
        assert "offload= stages run without chunks" in lines["chunks-offload"]
        assert "no chunk could ever be on the device" in lines["chunks-large"]
        assert "Adafactor keeps state of other shapes" in lines["chunks-optimizer"]
    assert got[1]["no-loss"] is not None and "loss_fn" in got[1]["no-loss"]
    assert got[0]["no-loss"] is None  # the first rank needs none
    assert got[0]["no-weights"] is not None and "W actions" in got[0]["no-weights"]
    assert got[0]["rows"] is not None and "6 rows" in got[0]["rows"]  # the rank that reads the batch
    assert got[1]["rows"] is not None and "(6, 8)" in got[1]["rows"]  # the rank that reads the target
    assert got[1]["target"] is not None and "target=y" in got[1]["target"]  # the rank that computes the loss


def _mismatch(rank: int, init: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    stage = nn.Linear(8, 6) if rank == 0 else nn.Linear(5, 8)  # 6 features out, 5 expected
    pipe = Pipeline(stage, "1f1b", microbatches=4, loss_fn=nn.functional.mse_loss, action_timeout=20)
    x, y = _batch(0)
    try:
        pipe.step(x, target=y)
        out.put((rank, None))
    except Exception as exc:  # noqa: BLE001 - what each rank ends with is the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def test_a_stage_that_does_not_take_the_previous_output_is_named_with_both_shapes() -> None:
    got = dict(run_ranks(_mismatch, 2, timeout=120))
    line = got[1]
    assert line is not None and line.startswith("ConfigError: stage 1 does not take stage 0's output, (2, 6)")
    assert "\n" not in line
    assert got[0] is not None and got[0].startswith("PeerLost: rank 0: rank 1 stopped while this rank was in ")
    assert "of step 1" in got[0] and "\n" not in got[0]  # the other rank ends too, in one line, not hung


class _Tied(nn.Module):
    """A stage holding a (4, 8) weight that the first and the last stage share, as tied embeddings do."""

    def __init__(self, shared: nn.Parameter, first: bool) -> None:
        super().__init__()
        self.shared, self.first = shared, first
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h + (self.shared.sum(0) if self.first else h @ self.shared.t() @ self.shared)


def _tied_model(stages: int) -> list[nn.Module]:
    torch.manual_seed(3)
    shared = nn.Parameter(torch.randn(4, 8) * 0.3)
    return [_Tied(shared, True), *(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(stages - 2)),
            _Tied(shared, False)]


def _train_clipped(rank: int, init: str, schedule: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.pipeline import Pipeline, resolve_schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    built = resolve_schedule(schedule, 2, 4)
    layers = _tied_model(built.stages)
    mine = built.stages_of(rank)
    pipe = Pipeline({s: layers[s] for s in mine}, built, loss_fn=nn.functional.mse_loss,
                    tied=[{0: "shared", built.stages - 1: "shared"}])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    norms = []
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        pipe.step(x, target=y)
        norms.append(pipe.clip_grad_norm_(0.05))
        opt.step()
    state = {f"{s}.{k}": v.detach().numpy().copy() for s in mine for k, v in layers[s].state_dict().items()}
    out.put((rank, norms, pipe.check().finite, state))
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v", "chimera"])
def test_global_clipping_and_tied_weights_equal_one_process(schedule: str) -> None:
    """The global norm (each stage once, replicas and tied copies once) and clipping equal torch's
    clip_grad_norm_ on the whole model in one process; a weight the first and last stage share trains as one."""
    from pipefold.runtime.pipeline import resolve_schedule

    layers = _tied_model(resolve_schedule(schedule, 2, 4).stages)
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    want = []
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        want.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
    got = run_ranks(_train_clipped, 2, schedule)
    for rank, norms, finite, state in got:
        assert norms == pytest.approx(want, rel=1e-5), rank
        assert finite
        for key, value in state.items():
            s, name = key.split(".", 1)
            torch.testing.assert_close(torch.from_numpy(value), layers[int(s)].state_dict()[name], atol=TOL, rtol=0)


def _reported(rank: int, init: str, folder: str, out: Any) -> None:
    import json

    import torch.distributed as dist

    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    layers = _model(4)
    pipe = Pipeline([layers[s] for s in (rank, 3 - rank)], "zb-v", microbatches=4, loss_fn=nn.functional.mse_loss)
    for step in range(2):
        pipe.step(*_batch(step)[:1], target=_batch(step)[1])
    report = pipe.report()
    if rank == 0:
        report.write_trace(f"{folder}/trace.json")
        with open(f"{folder}/trace.json") as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e["ph"] == "X" and e["cat"] in ("F", "B", "W")]
        from pipefold.runtime.executor import kind_times

        medians = kind_times(report.steps)  # per stage and kind, the median seconds the prediction reads
        work = [sum(medians[a.stage][a.kind] for a in row) for row in report.schedule.actions]
        out.put((report.as_dict(), len(events), report.schedule.num_actions, work, report.stage_bytes))
    dist.destroy_process_group()


def test_the_report_holds_every_action_the_meters_peaks_and_a_prediction(tmp_path: Any) -> None:
    """Every F, B and W of both devices is in the trace; each device's peak and each stage's bytes are the meter's;
    the prediction from the step's own pass times is at least the busiest device's work at those times (a bound
    summed here)."""
    [(numbers, traced, actions, work, stage_bytes)] = run_ranks(_reported, 2, str(tmp_path))
    assert traced == actions  # zb-v: F, B and W of 4 stages x 4 microbatches
    assert all(b > 0 for b in numbers["peak_bytes"])
    assert sorted(stage_bytes) == [0, 1, 2, 3] and all(f > 0 for f, _, _ in stage_bytes.values())
    assert numbers["predicted_s"] >= max(work) * (1 - 1e-9)  # no device finishes before its own work
    assert 0.0 <= numbers["bubble"] < 1.0
    assert numbers["measured_s"] >= max(work) * 0.5  # the step ran those passes (a median may exceed one run)


def _train_dp(rank: int, init: str, zero: bool, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    copy, device = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    layers = _model(2)
    pipe = Pipeline(layers[device], "zb-h1", microbatches=2, loss_fn=nn.functional.mse_loss, mesh=mesh)
    opt = pipe.zero1(lambda ps: torch.optim.Adam(ps, lr=0.01)) if zero else torch.optim.Adam(pipe.parameters(),
                                                                                            lr=0.01)
    norms = []
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        pipe.step(x.chunk(2)[copy], target=y.chunk(2)[copy])  # each copy its half of the batch
        norms.append(pipe.grad_norm())
        opt.step()
    out.put((rank, norms, {f"{device}.{k}": v.detach().numpy().copy() for k, v in layers[device].state_dict().items()}))
    dist.destroy_process_group()


@pytest.mark.parametrize("zero", [False, True], ids=["replicated", "zero1"])
def test_data_parallel_copies_of_a_pipeline_equal_one_process_on_the_whole_batch(zero: bool) -> None:
    """A (dp, pp) mesh of 2 x 2 with plain stage modules: each copy runs half of each batch, the schedule's DP
    actions average the gradients, and every copy's weights and global norm equal one process's, with the
    optimizer replicated or sharded over the copies (ZeRO-1: each steps half of the parameters' Adam state)."""
    layers = _model(2)
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    want = []
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        want.append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()))
        opt.step()
    got = run_ranks(_train_dp, 4, zero)
    assert len(got) == 4
    for rank, norms, state in got:
        assert norms == pytest.approx(want, rel=1e-5), rank
        for key, value in state.items():
            s, name = key.split(".", 1)
            torch.testing.assert_close(torch.from_numpy(value), layers[int(s)].state_dict()[name], atol=TOL, rtol=0)


def test_split_model_balances_the_devices_under_the_schedules_placement() -> None:
    """Six layers of sizes 1..6 (widths) cut for a V shape on two devices: device 0 holds the first and the last
    stage; by parameters the devices' loads are the brute-force best split's."""
    import itertools

    from pipefold.runtime.measure.split import split_model

    widths = [2, 3, 4, 5, 6, 7, 8]
    layers = [nn.Linear(widths[i], widths[i + 1]) for i in range(6)]
    size = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    parts = {d: split_model(layers, "zb-v", devices=2, microbatches=4, device=d) for d in (0, 1)}
    assert sorted(parts[0]) == [0, 3] and sorted(parts[1]) == [1, 2]
    held = {d: [id(layer) for stage in parts[d].values() for layer in stage] for d in (0, 1)}
    load = {d: sum(s for layer, s in zip(layers, size, strict=True) if id(layer) in held[d]) for d in (0, 1)}
    best = min(max(sum(size[:a]) + sum(size[c:]), sum(size[a:c]))
               for a, c in itertools.combinations(range(1, 6), 2) if c >= a + 2)  # stages 1 and 2 not empty
    assert max(load.values()) == best
    with pytest.raises(ConfigError, match="sample="):
        split_model(layers, "1f1b", devices=2, microbatches=4, by="time", device=0)
    timed = split_model(layers, "1f1b", devices=2, microbatches=4, by="time", sample=torch.randn(4, 2), device=1)
    assert list(timed) == [1] and len(timed[1]) >= 1
    with pytest.raises(ConfigError, match="target= and loss_fn="):
        split_model(layers, "zb-v", devices=2, microbatches=4, by="memory", sample=torch.randn(4, 2), device=0)
    by_memory = split_model(layers, "zb-v", devices=2, microbatches=4, by="memory", sample=torch.randn(4, 2),
                            target=torch.randn(4, 8), loss_fn=nn.functional.mse_loss, device=0)
    assert sorted(by_memory) == [0, 3]  # the first and the last stage: the model's first and last layers
    assert by_memory[0][0] is layers[0] and by_memory[3][-1] is layers[-1]
    for wrong in (3, -1, None):  # a device the schedule does not have; None outside a process group of 2
        with pytest.raises(ConfigError, match="device"):
            split_model(layers, "1f1b", devices=2, microbatches=4, device=wrong)


def _train_auto(rank: int, init: str, per_rank: int, budget: float | None, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    layers = _model(2 * per_rank)
    mine = {rank: layers[rank]} if per_rank == 1 else {rank: layers[rank], 3 - rank: layers[3 - rank]}
    try:
        pipe = Pipeline(mine, "auto", microbatches=4, loss_fn=nn.functional.mse_loss, memory_budget=budget)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses, ran = [], []
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            losses.append(pipe.step(x, target=y, all_ranks=True))
            ran.append(pipe.schedule.name)
            opt.step()
        state = {f"{s}.{k}": v.detach().numpy().copy() for s in mine for k, v in layers[s].state_dict().items()}
        out.put((rank, losses, ran, [(p.schedule, p.makespan, p.peak) for p in pipe.plan], pipe.chosen, state))
    except ConfigError as exc:
        out.put((rank, str(exc)))
    dist.destroy_process_group()


@pytest.mark.parametrize("per_rank", [1, 2])
def test_auto_plans_from_the_first_step_and_stays_exact(per_rank: int) -> None:
    """``schedule="auto"``: the first step runs a schedule that splits B and W, every candidate with the placement
    of the stage modules given is predicted from it, the fastest runs from the second step; both ranks choose
    alike and the weights equal one process's throughout."""
    from pipefold.ir import v_placement

    want_losses, want_state = _reference(2 * per_rank, 3)
    got = run_ranks(_train_auto, 2, per_rank, None)
    plans = {rank: (plan, chosen) for rank, _, _, plan, chosen, _ in got}
    assert plans[0][1] == plans[1][1] == plans[0][0][0][0]  # the fastest predicted, the same on both ranks
    names = {spec.split(":")[0] for spec, _, _ in plans[0][0]}
    assert ("zb-v" in names and "1f1b" not in names) if per_rank == 2 else ("1f1b" in names and "zb-v" not in names)
    from pipefold.schedules import build

    for spec, _, _ in plans[0][0]:  # every candidate has the placement of the modules given
        name, _, opts = spec.partition(":")
        built = build(name, 2, 4, **{k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)})
        assert built.placement[0] == ((0, 1) if per_rank == 1 else v_placement(2))
    for _, losses, ran, _, chosen, state in got:
        assert losses == pytest.approx(want_losses, abs=TOL)
        assert ran[1].split(":")[0] == chosen.split(":")[0]
        for key, value in state.items():
            torch.testing.assert_close(torch.from_numpy(value), want_state[key], atol=TOL, rtol=0)


def test_auto_with_a_budget_below_every_schedule_says_the_least_it_needs() -> None:
    got = dict(run_ranks(_train_auto, 2, 1, 1.0))
    for line in got.values():
        assert isinstance(line, str) and "memory budget of 1 bytes" in line and "the least is" in line


class _Checkpointed(nn.Module):
    """A stage that checkpoints its own block with torch's activation checkpointing, as users do."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return x + checkpoint(self.block, x, use_reentrant=False)


def _train_checkpointed(rank: int, init: str, schedule: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(5)
    layers = [_Checkpointed() for _ in range(2)]
    pipe = Pipeline(layers[rank], schedule, microbatches=4, loss_fn=nn.functional.mse_loss)
    grads = []
    for step in range(2):
        x, y = _batch(step)
        pipe.step(x, target=y)
        grads.append({k: p.grad.numpy().copy() for k, p in layers[rank].named_parameters()})
    out.put((rank, grads))
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_users_own_activation_checkpointing_keeps_the_gradients(schedule: str) -> None:
    """torch.utils.checkpoint inside a stage module, with the backward fused (1F1B) and split into B and W
    (ZB-H1): the gradients (accumulated over two steps) equal one process's."""
    torch.manual_seed(5)
    layers = [_Checkpointed() for _ in range(2)]
    model = nn.Sequential(*layers)
    want = []
    for step in range(2):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        want.append([{k: p.grad.clone() for k, p in layer.named_parameters()} for layer in layers])
    for rank, grads in run_ranks(_train_checkpointed, 2, schedule):
        for step, each in enumerate(grads):
            for k, g in each.items():
                torch.testing.assert_close(torch.from_numpy(g), want[step][rank][k], atol=TOL, rtol=0)


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def _train_hf(rank: int, init: str, schedule: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.models.hf import hf_loss
    from pipefold.runtime.measure.split import split_model
    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    stages = split_model(_tiny_llama(), schedule, devices=2, microbatches=2)
    pipe = Pipeline(stages, schedule, microbatches=2, loss_fn=hf_loss)
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    losses = [pipe.step(ids[:, :-1], target=ids[:, 1:], all_ranks=True) for _ in range(2)]
    out.put((rank, losses))
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_split_model_cuts_a_hugging_face_llama_and_trains_it_exactly(schedule: str) -> None:
    """A LlamaForCausalLM object, cut into the schedule's stages by split_model: the loss (accumulated gradients
    make the second step's loss the same) equals the model's own on its logits in one process."""
    pytest.importorskip("transformers")
    from pipefold.models.hf import hf_loss

    model = _tiny_llama()
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    want = hf_loss(model(input_ids=ids[:, :-1]).logits, ids[:, 1:]).item()
    for _, losses in run_ranks(_train_hf, 2, schedule):
        assert losses == pytest.approx([want, want], abs=TOL)


def _split_by_time(rank: int, init: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.measure.split import split_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    layers = [nn.Linear(16, 16) for _ in range(8)]
    stages = split_model(layers, "zb-v", devices=2, microbatches=4, by="time", sample=torch.randn(4, 16))
    out.put((rank, {s: [layers.index(layer) for layer in stage] for s, stage in stages.items()}))
    dist.destroy_process_group()


def test_a_cut_by_measured_time_is_rank_0s_on_every_rank() -> None:
    """Each rank times the layers itself (the times differ), yet the stages the ranks get fit together: every layer
    once, in order."""
    got = dict(run_ranks(_split_by_time, 2))
    stages = {s: part for parts in got.values() for s, part in parts.items()}
    assert sorted(stages) == [0, 1, 2, 3] and sorted(got[0]) == [0, 3] and sorted(got[1]) == [1, 2]
    assert [i for s in range(4) for i in stages[s]] == list(range(8))

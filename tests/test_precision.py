"""Mixed precision and torch.compile in a user's loop: every schedule family against one process running the same
recipe (the same dtype, the same microbatches, the same compiled layers)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from conftest import run_ranks
from pipefold.errors import ConfigError
from pipefold.runtime.precision import LossScaler, Precision

WIDTH, ROWS, M = 16, 8, 4


class Block(nn.Module):
    """A residual block with a norm: autocast keeps the norm in float32 and the products in the low dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _model(n: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(Block(), Block()) for _ in range(n)]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def _one_process(n: int, precision: Precision, steps: int, *, order: list[int] | None = None,
                 compiled: str | None = None, loss_scale: float = 1.0,
                 backend: str = "aot_eager") -> tuple[list[float], dict[str, Any]]:
    """The same recipe in one process: the microbatches' gradients summed (in ``order``), SGD steps on float32
    (master) weights."""
    from pipefold.runtime.compiled import compile_stage

    layers = _model(n)
    if compiled is not None:
        layers = [compile_stage(m, compiled, backend) for m in layers]
    model = nn.Sequential(*layers)
    masters = None
    if precision.master_weights:
        masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
        for p in model.parameters():
            p.data = p.data.to(precision.torch_dtype)
    opt = torch.optim.SGD(masters if masters is not None else model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        grads = [torch.zeros(p.shape) for p in model.parameters()]
        total = 0.0
        for mb in order or range(M):
            xm, ym = x.chunk(M)[mb], y.chunk(M)[mb]
            if precision.master_weights:
                xm = xm.to(precision.torch_dtype)
            ctx = torch.autocast("cpu", dtype=precision.autocast) if precision.autocast else torch.autocast(
                "cpu", enabled=False)
            with ctx:
                loss = _loss(model(xm), ym)
            total += loss.item()
            (loss * (loss_scale / M)).backward()
            for g, p in zip(grads, model.parameters(), strict=True):
                g += p.grad.float()
                p.grad = None
        for g, p in zip(grads, masters if masters is not None else model.parameters(), strict=True):
            p.grad = g / loss_scale
        opt.step()
        if masters is not None:
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m)
        losses.append(total / M)
    weights = masters if masters is not None else list(model.parameters())
    return losses, {"weights": [w.detach().float().clone() for w in weights], "grads": [g / loss_scale for g in grads]}


def _train(rank: int, init: str, world: int, schedule: str, precision: str, compiled: str | None, steps: int,
           memory: str, backend: str, out: Any) -> None:
    import torch.distributed as dist

    from pipefold.runtime.pipeline import Pipeline
    from pipefold.schedules import build

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        name, _, opts = schedule.partition(":")
        built = build(name, world, M, **{k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)})
        layers = _model(built.stages)
        mine = built.stages_of(rank)
        saving: dict[str, Any] = {"recompute": {"recompute": dict.fromkeys(mine, 1)}, "offload": {"offload": (1, 1)},
                                  "": {}}[memory]
        pipe = Pipeline([layers[s] for s in mine], schedule, microbatches=M, loss_fn=_loss,
                        precision=Precision.of(precision), compile=compiled or False, compile_backend=backend,
                        **saving)
        opt = pipe.optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
        losses = []
        grads: dict[str, Any] = {}
        for step in range(steps):
            x, y = _batch(step)
            opt.zero_grad()
            losses.append(pipe.step(x, target=y, all_ranks=True))
            grads = {f"{s}.{i}": (getattr(p, "_pf_master", p).grad.float().numpy().copy())
                     for s in mine for i, p in enumerate(pipe.modules[s].parameters())}
            opt.step()
        weights = {f"{s}.{i}": getattr(p, "_pf_master", p).detach().float().numpy().copy()
                   for s in mine for i, p in enumerate(layers[s].parameters())}
        out.put((rank, losses, grads, weights, [str(p.dtype) for p in layers[mine[0]].parameters()][:1]))
        pipe.close()
    finally:
        dist.destroy_process_group()


def _gathered(results: list[Any], stages: int) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor], set]:
    grads: dict[str, Any] = {}
    weights: dict[str, Any] = {}
    dtypes = set()
    for _, _, g, w, d in results:
        grads.update(g)
        weights.update(w)
        dtypes.update(d)
    per = len([k for k in grads if k.startswith("0.")])
    order = [f"{s}.{i}" for s in range(stages) for i in range(per)]
    return results[0][1], [torch.from_numpy(grads[k]) for k in order], [torch.from_numpy(weights[k]) for k in order], \
        dtypes


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / (y.abs().max() + 1e-12)) for x, y in zip(a, b, strict=True))


def _stages(schedule: str) -> int:
    from pipefold.schedules import build

    name, _, opts = schedule.partition(":")
    return build(name, 2, M, **{k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)}).stages


@pytest.mark.parametrize(("schedule", "precision", "memory"), [
    ("1f1b", "bf16", ""), ("zb-h1", "bf16", ""), ("zb-v", "bf16", ""), ("interleaved-1f1b:v=2", "bf16", ""),
    ("chimera", "bf16", ""), ("dualpipev", "bf16", ""), ("v-half", "bf16", ""), ("gpipe", "fp16", ""),
    ("zb-h1", "fp16", ""), ("1f1b", "bf16-master", ""), ("zb-v", "bf16-master", ""), ("dualpipe", "fp16-master", ""),
    ("zb-v", "bf16", "recompute"), ("1f1b", "fp16", "recompute"), ("zb-h1", "bf16", "offload"),
    ("v-min", "bf16-master", "recompute")])
def test_mixed_precision_equals_one_process_running_the_same_recipe(schedule: str, precision: str,
                                                                    memory: str) -> None:
    """The pipeline's gradients and weights after two steps equal one process running the same recipe (autocast, or
    parameters in the low dtype with float32 masters; fp16 with its loss scale), within what the recipe differs from
    itself when only the order of the microbatches' sums changes."""
    prec = Precision.of(precision)
    stages = _stages(schedule)
    results = run_ranks(_train, 2, 2, schedule, precision, None, 2, memory, "aot_eager")
    losses, grads, weights, dtypes = _gathered(results, stages)
    scale = LossScaler().scale if prec.loss_scale is not None else 1.0
    ref_losses, ref = _one_process(stages, prec, 2, loss_scale=scale)
    _, again = _one_process(stages, prec, 2, order=list(reversed(range(M))), loss_scale=scale)
    tolerance = max(_diff(again["grads"], ref["grads"]), _diff(again["weights"], ref["weights"]), 1e-6)
    assert _diff(grads, ref["grads"]) <= 2 * tolerance
    assert _diff(weights, ref["weights"]) <= 2 * tolerance
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    # It really ran in the low precision: the gradients differ from float32's by far more than that tolerance.
    _, fp32 = _one_process(stages, Precision(), 2)
    assert _diff(grads, fp32["grads"]) > 10 * tolerance
    assert dtypes == ({str(prec.torch_dtype)} if prec.master_weights else {"torch.float32"})


@pytest.mark.parametrize(("schedule", "mode", "memory"), [
    ("1f1b", "split", ""), ("zb-h1", "split", ""), ("zb-v", "split", ""), ("dualpipev", "split", ""),
    ("chimera", "whole", ""), ("zb-h1", "whole", ""), ("v-half", "whole", ""), ("interleaved-1f1b:v=2", "split", ""),
    ("kfkb:k=2", "split", ""), ("gpipe", "whole", ""), ("zb-h1", "split", "recompute"),
    ("zb-v", "whole", "recompute"), ("1f1b", "split", "offload"), ("zb-h1", "whole", "offload")])
def test_compiled_layers_keep_the_split_backward_exact(schedule: str, mode: str, memory: str) -> None:
    """Compiled layers (each mode) on every family, with recomputation and offloading, give one process's
    compiled model's gradients to 1e-5."""
    stages = _stages(schedule)
    results = run_ranks(_train, 2, 2, schedule, "fp32", mode, 2, memory, "aot_eager")
    losses, grads, weights, _ = _gathered(results, stages)
    ref_losses, ref = _one_process(stages, Precision(), 2, compiled=mode)
    assert _diff(grads, ref["grads"]) <= 1e-5
    assert _diff(weights, ref["weights"]) <= 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_inductor_compiled_stages_in_bf16_equal_one_process_running_them() -> None:
    """Inductor's generated kernels (C++ on this CPU), under bf16 autocast, with zero bubble's split backward: the
    pipeline equals one process running the same inductor-compiled model in the same recipe, within the recipe's
    own tolerance (its microbatches summed in another order)."""
    prec = Precision.of("bf16")
    results = run_ranks(_train, 2, 2, "zb-h1", "bf16", "split", 2, "", "inductor")
    losses, grads, weights, _ = _gathered(results, 2)
    ref_losses, ref = _one_process(2, prec, 2, compiled="split", backend="inductor")
    _, again = _one_process(2, prec, 2, compiled="split", backend="inductor", order=list(reversed(range(M))))
    tolerance = max(_diff(again["grads"], ref["grads"]), _diff(again["weights"], ref["weights"]), 1e-6)
    assert _diff(grads, ref["grads"]) <= 2 * tolerance
    assert _diff(weights, ref["weights"]) <= 2 * tolerance
    assert losses == pytest.approx(ref_losses, rel=1e-3)


def test_a_dynamic_loss_scale_backs_off_on_an_overflow_the_same_everywhere() -> None:
    scaler = LossScaler(8.0, interval=2)
    for overflow in (False, True, False, False, False):
        scaler.update(overflow)
    assert (scaler.scale, scaler.skipped, scaler.good) == (8.0, 1, 1)
    fixed = LossScaler(4.0, dynamic=False)
    fixed.update(True)
    assert fixed.scale == 4.0 and fixed.skipped == 1


@pytest.mark.parametrize(("value", "words"), [
    ("bf17", "unknown dtype"), ("bf16-fast", "unknown precision"), ("fp32-master", "master weights"),
    ("int8", "unknown dtype"),
    (torch.float64, "not one pipefold trains in"), (3, "must be a dtype name")])
def test_a_precision_no_run_can_use_is_one_line(value: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        Precision.of(value)
    with pytest.raises(ConfigError, match="loss scale"):
        Precision("fp16", loss_scale="big")
    with pytest.raises(ConfigError, match="from 1 to"):
        Precision("fp16", loss_scale=0.5)
    with pytest.raises(ConfigError, match="meta has no autocast to fp16"):  # a device type torch has no autocast for
        Precision("fp16").check_device(torch.device("meta"))


def test_compile_modes_leave_the_parameters_and_refuse_an_unknown_mode() -> None:
    from pipefold.runtime.compiled import compile_stage

    stage = nn.Sequential(Block(), Block())
    before = [id(p) for p in stage.parameters()]
    compiled = compile_stage(copy.deepcopy(stage), "split", "aot_eager")
    assert len(list(compiled.parameters())) == len(before)
    with pytest.raises(ConfigError, match="unknown compile mode"):
        compile_stage(stage, "fast")
    with pytest.raises(ConfigError, match="unknown compile backend"):
        from pipefold.runtime.compiled import check_compile

        check_compile("tvm", torch.device("cpu"))


def _train_mesh(rank: int, init: str, how: str, out: Any) -> None:
    """A (dp, pp) mesh of 2 x 2: each copy runs half of each batch. ``how``: ``zero1`` (bf16 parameters, float32
    masters sharded over the copies) or ``fsdp`` (FSDP2 stages with a bf16 MixedPrecisionPolicy)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        copy_, device = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
        layers = _model(2)
        stage = layers[device]
        if how == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            fully_shard(stage, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                              reduce_dtype=torch.float32))
            pipe = Pipeline(stage, "1f1b", microbatches=M, loss_fn=_loss, mesh=mesh)
            opt: Any = pipe.optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
        else:
            pipe = Pipeline(stage, "zb-h1", microbatches=M, loss_fn=_loss, mesh=mesh, precision="bf16-master")
            opt = pipe.zero1(lambda ps: torch.optim.SGD(ps, lr=0.1))
        for step in range(2):
            x, y = _batch(step)
            opt.zero_grad()
            pipe.step(x.chunk(2)[copy_], target=y.chunk(2)[copy_])
            opt.step()
        if how == "fsdp":
            weights = [p.full_tensor().detach().float().numpy().copy() for p in stage.parameters()]
        else:
            weights = [p._pf_master.detach().numpy().copy() for p in stage.parameters()]
        out.put((rank, device, weights, str(next(stage.parameters()).dtype)))
        pipe.close()
    finally:
        dist.destroy_process_group()


def _one_process_copies(steps: int) -> list[torch.Tensor]:
    """Two data-parallel copies in one process: each sums its M microbatches' gradients of bf16 parameters in
    float32 (master weights do; FSDP's policy accumulates the unsharded gradient in its reduce_dtype), then the
    copies' mean in float32 and an SGD step on the float32 weights."""
    model = nn.Sequential(*_model(2))
    for _ in range(steps):
        x, y = _batch(_)
        low = copy.deepcopy(model).to(torch.bfloat16)
        sums = []
        for half in range(2):
            grads = [torch.zeros(p.shape) for p in low.parameters()]
            for mb in range(M):
                xm, ym = x.chunk(2)[half].chunk(M)[mb], y.chunk(2)[half].chunk(M)[mb]
                (_loss(low(xm.to(torch.bfloat16)), ym) / M).backward()
                for g, p in zip(grads, low.parameters(), strict=True):
                    g += p.grad
                    p.grad = None
            sums.append([g.float() for g in grads])
        with torch.no_grad():
            for p, a, b in zip(model.parameters(), *sums, strict=True):
                p -= 0.1 * (a + b) / 2
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["zero1", "fsdp"])
def test_data_parallel_copies_in_bf16_equal_one_process(how: str) -> None:
    """bf16 with data-parallel copies: parameters in bf16 with float32 masters sharded by ZeRO-1, and FSDP2 stages
    with their own MixedPrecisionPolicy, driven by the pipeline's gather and reduce-scatter actions; both equal one
    process running the same recipe."""
    got = run_ranks(_train_mesh, 4, how)
    want = _one_process_copies(2)
    per = len(want) // 2
    fp32 = [p.detach() for p in nn.Sequential(*_model(2)).parameters()]
    for _, device, weights, dtype in got:
        assert dtype == ("torch.bfloat16" if how == "zero1" else "torch.float32")  # FSDP's shards stay float32
        mine = want[device * per:(device + 1) * per]
        assert _diff([torch.from_numpy(w) for w in weights], mine) <= 2e-6
        assert _diff([torch.from_numpy(w) for w in weights], fp32[device * per:(device + 1) * per]) > 1e-3


@pytest.fixture
def fresh_dynamo() -> Any:
    """torch.compile's caches emptied: a test process (an xdist worker) has compiled these blocks' code before, under
    other dtypes and modes, and dynamo runs a code eagerly once it has been compiled 8 times (its recompile limit)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph(t: torch.Tensor) -> list[Any]:
    seen, stack, out = set(), [t.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        stack += [c for c, _ in node.next_functions]
    return out


@pytest.mark.parametrize("mode", ["split", "whole"])
def test_a_compiled_region_runs_its_backward_once_and_split_leaves_the_products_to_w(mode: str,
                                                                                    fresh_dynamo: Any) -> None:
    """B then W over compiled layers: every compiled region's backward runs once (in B); with ``split`` the Linears'
    weight gradients are still W's (none after B), with ``whole`` B made them and W only adds."""
    from pipefold.runtime.compiled import compile_stage
    from pipefold.runtime.stage import StageRunner

    torch.manual_seed(0)
    stage = compile_stage(nn.Sequential(Block(), Block()), mode, "aot_eager")
    runner = StageRunner(stage, stage=1)
    x = torch.randn(ROWS, WIDTH)
    out = runner.forward(0, (x,))
    runs: dict[Any, int] = {}
    graph = _graph(runner._passes[0].outputs[0])
    compiled = [n for n in graph if type(n).__name__ == "CompiledFunctionBackward"]
    assert compiled
    handles = [n.register_prehook(lambda g, n=n: runs.__setitem__(n, runs.get(n, 0) + 1)) for n in compiled]
    runner.backward_input(0, (torch.ones_like(out[0]),))
    linears = [m.weight for m in stage.modules() if isinstance(m, nn.Linear)]
    assert all(w.grad is None for w in linears)  # W's, in both modes
    runner.backward_weight(0)
    assert all(w.grad is not None for w in linears)
    assert sorted(runs.values()) == [1] * len(compiled)
    for h in handles:
        h.remove()


class _MyLinear(nn.Linear):
    """A user's own Linear: split mode leaves it out of the compiled regions too."""


class _MyBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.up = _MyLinear(WIDTH, 2 * WIDTH)


@pytest.mark.parametrize("block", [Block, _MyBlock])
def test_the_two_modes_keep_their_own_graphs_in_one_process(block: type[nn.Module], fresh_dynamo: Any) -> None:
    """A layer compiled ``whole`` after one compiled ``split`` (and back) gets its own mode's regions: torch.compile
    keeps one translation of a layer's code for every module of the same types, so the split mode's Linears are a
    type of their own, not an instance's disabled forward."""
    from pipefold.runtime.compiled import compile_stage

    def regions(mode: str) -> int:
        torch.manual_seed(0)
        stage = compile_stage(nn.Sequential(block()), mode, "aot_eager")
        out = stage(torch.randn(ROWS, WIDTH, requires_grad=True))
        return sum(type(n).__name__ == "CompiledFunctionBackward" for n in _graph(out))

    assert [regions(m) for m in ("whole", "split", "whole", "split")] == [1, 3, 1, 3]
    same = nn.Sequential(block())  # one module compiled split, then whole: its Linears go back to their class
    compile_stage(same, "split", "aot_eager")
    again = compile_stage(same, "whole", "aot_eager")
    out = again(torch.randn(ROWS, WIDTH, requires_grad=True))
    assert sum(type(n).__name__ == "CompiledFunctionBackward" for n in _graph(out)) == 1
    assert all(type(m) in (nn.Linear, _MyLinear) for m in same.modules() if isinstance(m, nn.Linear))

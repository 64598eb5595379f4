"""Model-state chunks: the packing, the chunk size and the placement against brute force and closed forms; the
chunked optimizer's weights against the plain optimizer's, bit for bit, wherever its chunks live, in one process,
in a user's Pipeline (pp, and dp x pp with ZeRO-1) and in a run of pipefold train; its bytes against the plain
optimizer's own state."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import run_ranks
from pipefold.errors import ConfigError
from pipefold.plan.chunks import choose_capacity, pack, place, state_bytes

# -- packing, size, placement


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(0, 30))
def test_chunks_hold_consecutive_parameters_each_until_the_next_does_not_fit(sizes: list[int], extra: int) -> None:
    capacity = max(sizes) + extra
    chunks = pack(sizes, capacity)
    assert list(itertools.chain.from_iterable(chunks)) == list(range(len(sizes)))  # each once, in order
    for i, chunk in enumerate(chunks):
        assert chunk and sum(sizes[j] for j in chunk) <= capacity
        if i + 1 < len(chunks):  # closed only because the next parameter did not fit
            assert sum(sizes[j] for j in chunk) + sizes[chunks[i + 1][0]] > capacity


def test_a_chunk_smaller_than_a_parameter_is_refused_with_the_size_that_works() -> None:
    with pytest.raises(ConfigError, match=r"cannot hold parameter 1 \(4,096 elements\): give a chunk size of at "
                                          r"least 4,096 elements \(16,384 bytes"):
        pack([64, 4096, 64], 1000)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=20), st.sets(st.integers(1, 400), min_size=1, max_size=6))
def test_the_chosen_capacity_wastes_the_least_of_the_candidates(sizes: list[int], candidates: set[int]) -> None:
    """Brute force: every candidate's unused room at the chunks' ends, counted here from the packing."""
    chosen = choose_capacity(sizes, sorted(candidates))
    fitting = [c for c in candidates if c >= max(sizes)] or [max(sizes)]

    def unused(c: int) -> int:
        return sum(c - sum(sizes[j] for j in chunk) for chunk in pack(sizes, c))

    assert chosen in fitting
    assert (unused(chosen), chosen) == min((unused(c), c) for c in fitting)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=12), st.integers(0, 3), st.integers(0, 4000))
def test_the_device_keeps_chunks_in_order_while_they_fit(capacities: list[int], states: int, free: int) -> None:
    got = place(capacities, states, free)
    used = left = free
    for n, on in zip(capacities, got.on_device, strict=True):  # a replay of the rule, chunk by chunk
        here = 4 * states * n
        assert on == (here <= left)
        left -= here if on else 0
    used = sum(4 * states * n for n, on in zip(capacities, got.on_device, strict=True) if on)
    assert got.device_bytes == used <= free
    assert got.host_bytes == sum(4 * (states + 2) * n for n, on in zip(capacities, got.on_device, strict=True)
                                 if not on)


def test_equal_chunks_on_the_device_are_as_many_as_the_free_bytes_hold() -> None:
    """The closed form for equal chunks: floor(free / a chunk's state), at most all of them."""
    for free in range(0, 200_001, 7_919):
        got = place([1000] * 20, 2, free)
        assert sum(got.on_device) == min(20, free // state_bytes(1000, 2, host=False))


# -- one process: the chunked optimizer against the plain one


def _model(seed: int = 0, width: int = 12) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 24), nn.GELU(), nn.Linear(24, 24), nn.LayerNorm(24), nn.Linear(24, 4),
                         nn.Linear(4, 4))  # the last one gets no gradient: the loss reads the one before


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
}


def _one_process(make: Any, room: float | None, steps: int = 4) -> tuple[nn.Module, nn.Module, Any, Any]:
    """``room``: the device's free bytes, in chunks' states (None: no limit)."""
    from pipefold.runtime.chunks import ChunkedOptimizer, count_states

    free = None if room is None else room * state_bytes(600, count_states(make), host=False)
    model = _model()
    plain_model = copy.deepcopy(model)
    plain = make(list(plain_model.parameters()))
    chunked = ChunkedOptimizer(list(model.parameters()), make, capacity=600,
                               free=None if free is None else lambda: free)
    for step in range(steps):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, chunked), (plain_model, plain)):
            opt.zero_grad()
            m[:5](x).square().mean().backward()
            opt.step()
        for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
            assert torch.equal(a, b), step
    return model, plain_model, chunked, plain


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("where", ["device", "mixed", "host"])
def test_chunked_steps_are_the_plain_optimizers_bit_for_bit(name: str, where: str) -> None:
    """Four steps of each optimizer with every chunk's state on the device, some of them, or none: the same
    weights as the plain optimizer after each (a parameter without a gradient left alone by both). The bytes the
    chunks hold are the plain optimizer's own state tensors', plus the host chunks' float32 parameters and
    gradients, plus the room at the chunks' ends and for the state of a parameter that has none."""
    make = OPTIMIZERS[name]
    _, _, chunked, plain = _one_process(make, {"device": None, "mixed": 1.5, "host": 0.0}[where])
    mem = chunked.memory()
    states = chunked.states
    assert states == {"adamw": 2, "adam-amsgrad": 3, "sgd-nesterov": 1, "sgd": 0}[name]
    if where == "mixed" and states:
        assert mem.on_device == 1 < mem.chunks
    if where == "host":  # an optimizer without state has nothing to move: its chunks stay
        assert (mem.on_device, mem.device) == ((0, 0) if states else (mem.chunks, 0))
    plain_state = sum(v.numel() * v.element_size() for s in plain.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
    host_used = sum(c.used for c in chunked.mine if not c.on_device)
    # A chunk holds room for the state of a parameter that has none yet (no gradient so far).
    stateless = sum(p.numel() for p in plain.param_groups[0]["params"] if not plain.state.get(p))
    assert stateless == 20 or not states  # the last Linear's
    assert mem.device + mem.host - mem.unused == plain_state + 4 * states * stateless + 8 * host_used
    assert mem == chunked.predicted()  # the planner's formula, from the placement alone


def _with_masters(make: Any, room: float | None, steps: int = 4) -> tuple[Any, Any, list[nn.Parameter]]:
    """``make``'s optimizer over float32 master weights of a bf16 model, plain (precision's own) and in chunks
    that hold the masters (``room``: the device's free bytes, in chunks' masters, gradients and state), three
    microbatches a step: the same bf16 weights and float32 masters after every step."""
    from pipefold.runtime.chunks import ChunkedOptimizer, count_states
    from pipefold.runtime.precision import Masters, PrecisionOptimizer

    chunk = state_bytes(600, count_states(make), host=True)
    free = None if room is None else room * chunk
    models, opts, masters = [], [], []
    for chunked in (False, True):
        model = _model()
        params = list(model.parameters())
        held = Masters(params, torch.bfloat16)
        inner = ((lambda ms, held=held: ChunkedOptimizer(ms, make, capacity=600, masters=held,
                                                          free=None if free is None else lambda: free))
                 if chunked else make)
        models.append(model)
        masters.append(held)
        opts.append(PrecisionOptimizer(inner, params, held, lambda: False))
    for step in range(steps):
        for m, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            for mb in range(3):
                x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * step + mb)).bfloat16()
                m[:5](x).float().square().mean().backward()
            opt.step()
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), step
        for a, b in zip(masters[0].masters, masters[1].masters, strict=True):
            assert torch.equal(a, b), step
    return opts[1].optimizer, opts[0].optimizer, masters[0].masters


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("where", ["device", "mixed", "host"])
def test_chunks_holding_master_weights_step_as_the_plain_masters_bit_for_bit(name: str, where: str) -> None:
    """bf16 parameters with float32 master weights: chunks that hold the masters, their gradients (added in as
    each microbatch's backward makes them) and the state, on the device, some of them, or in host memory, make
    the same masters and bf16 weights as the plain master weights after every step. Their bytes are the plain
    run's float32 masters, gradients and state, plus the room at the chunks' ends; the device holds the 16-bit
    parameters only, besides its own chunks."""
    chunked, plain, masters = _with_masters(OPTIMIZERS[name], {"device": None, "mixed": 1.5, "host": 0.0}[where])
    mem = chunked.memory()
    if where == "mixed":
        assert mem.on_device == 1 < mem.chunks
    if where == "host":
        assert (mem.on_device, mem.device) == (0, 0)
    plain_state = sum(v.numel() * v.element_size() for s in plain.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
    stateless = sum(m.numel() for m in masters if not plain.state.get(m))
    assert stateless == 20 or not chunked.states  # the last Linear's
    elements = sum(m.numel() for m in masters)
    assert mem.device + mem.host - mem.unused == plain_state + 4 * chunked.states * stateless + 8 * elements
    assert mem == chunked.predicted()


def test_master_chunks_refuse_zero1() -> None:
    from pipefold.runtime.chunks import ChunkedOptimizer
    from pipefold.runtime.precision import Masters

    params = list(_model().parameters())
    held = Masters(params, torch.bfloat16)
    with pytest.raises(ConfigError, match="model-state chunks with master weights run without ZeRO-1"):
        ChunkedOptimizer(held.masters, OPTIMIZERS["adamw"], masters=held, group=object())


def test_optimizers_whose_state_is_not_elementwise_are_refused() -> None:
    from pipefold.runtime.chunks import ChunkedOptimizer

    with pytest.raises(ConfigError, match="Adafactor keeps state of other shapes .* such as SGD, Adam and AdamW"):
        ChunkedOptimizer(list(_model().parameters()), lambda ps: torch.optim.Adafactor(ps))


def test_host_memory_too_small_is_refused_before_the_first_step() -> None:
    """With no device room for state, every chunk's state goes to host memory: a host with less than that is
    refused when the optimizer is made, saying how much it needs; with room for all of it on the device, the same
    host is enough."""
    from pipefold.runtime.chunks import ChunkedOptimizer

    params = list(_model().parameters())
    make = OPTIMIZERS["adamw"]
    with pytest.raises(ConfigError, match=r"host memory too small for the model-state chunks: they need at least "
                                          r"\d+\.\d KiB of it \(3 chunks of 600 elements.*, 1000 B is free for them"):
        ChunkedOptimizer(params, make, capacity=600, device_room=0, host_memory=1000)
    ChunkedOptimizer(params, make, capacity=600, device_room=1e9, host_memory=1000)


# -- a user's Pipeline, several ranks


def _layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))) for _ in range(2)]


def _pipelines(rank: int, init: str, world: int, precision: str, out: Any) -> None:
    """Two pipelines over equal copies of the model, one stepped by plain AdamW (ZeRO-1 with dp) and one by
    chunks whose device memory holds one chunk's state above what the plain one's first step held (with master
    weights, one chunk's masters, gradients and state)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipefold.runtime.chunks import left_free
    from pipefold.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        dp = world // 2
        mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "pp")) if dp > 1 else None
        device = mesh["pp"].get_local_rank() if mesh is not None else rank
        copy_ = mesh["dp"].get_local_rank() if mesh is not None else 0
        where = {"mesh": mesh} if mesh is not None else {}
        make = OPTIMIZERS["adamw"]
        pipes, opts = [], []
        for _ in range(2):
            layers = _layers()
            pipes.append(Pipeline(layers[device], "1f1b", microbatches=4, loss_fn=nn.functional.mse_loss,
                                  precision=precision, **where))
        opts.append(pipes[0].zero1(make) if dp > 1 else pipes[0].optimizer(make))
        chunk = 32 * 33  # one Linear's weight and bias: three chunks a stage
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 32, generator=g).chunk(dp)[copy_], torch.randn(16, 32, generator=g).chunk(dp)[copy_]
            for i, pipe in enumerate(pipes):
                if i == 1 and step == 0:  # room for one chunk's state after what the plain step held
                    first = pipes[0].last
                    per = 4 if precision == "bf16-master" else 2  # float32 tensors of a chunk on the device
                    budget = (left_free(0, pipes[1].parameters(), first) * -1) + 1.5 * chunk * 4 * per
                    opts.append(pipe.chunked(make, device_memory=budget, chunk_size=chunk * 4, zero1=dp > 1))
                opts[i].zero_grad()
                pipe.step(x, target=y)
                opts[i].step()
            for a, b in zip(pipes[0].parameters(), pipes[1].parameters(), strict=True):
                assert torch.equal(a, b), (rank, step)
        inner = opts[1].optimizer
        out.put((rank, inner.memory(), [c.on_device for c in inner.mine]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,precision", [(2, "fp32"), (2, "bf16-master"), (4, "fp32")],
                         ids=["pp2", "pp2-bf16-master", "dp2xpp2-zero1"])
def test_a_pipelines_chunked_optimizer_steps_the_plain_ones_weights(world: int, precision: str) -> None:
    """1F1B on two devices (and two data-parallel copies with ZeRO-1, each holding its share of the chunks; and
    bf16 parameters whose float32 masters the chunks hold): after every step the weights equal, bit for bit,
    those the plain optimizer makes; the first step's activation peak decided the placement, one chunk on the
    device and the others in host memory."""
    got = run_ranks(_pipelines, world, world, precision)
    assert len(got) == world
    for rank, mem, placement in got:
        assert placement.count(True) == 1, (rank, placement)
        assert mem.chunks == len(placement) and (mem.host > 0) == (len(placement) > 1)
    # ZeRO-1: the copies of a stage share its three chunks.
    assert sorted(len(p) for _, _, p in got) == ([3, 3] if world == 2 else [1, 1, 2, 2])


# -- pipefold train


def test_a_train_run_with_chunks_ends_with_the_plain_runs_weights_and_less_device_state() -> None:
    """pipefold train's MLP on two devices, AdamW, with the state chunked all on the device (no budget), all in
    host memory (a budget below the parameters), and plain: the same weights, bit for bit, after three steps.
    A rank's device holds the parameters P, the gradients P and AdamW's moments 2P without chunks; with every
    chunk in host memory, P + P."""
    from pipefold.runtime.launch.local import run_local
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    runs = {}
    shape = {"schedule": "1f1b", "devices": 2, "microbatches": 2, "steps": 3, "model": "mlp", "layers": 4,
             "hidden": 64, "batch": 16, "partition": "even", "optimizer": "adamw"}
    for how, extra in (("plain", {}), ("device", {"state_chunks": True}),
                       ("host", {"state_chunks": True, "memory_budget": "200KB", "chunk_size": "128KB"})):
        spec = RunSpec.flat(**shape, **extra)
        job = dataclasses.replace(make_job(spec), save_weights=True)
        runs[how] = sorted(run_local(job), key=lambda r: r.rank)
    for plain, device, host in zip(runs["plain"], runs["device"], runs["host"], strict=True):
        for name, w in plain.weights.items():
            assert torch.equal(device.weights[name], w) and torch.equal(host.weights[name], w), name
        params = sum(w.numel() * w.element_size() for w in plain.weights.values())
        assert plain.static_bytes >= 4 * params and device.static_bytes >= 4 * params
        assert 2 * params <= host.static_bytes < 2.05 * params, (host.static_bytes, params)
        last = host.steps[-1]
        assert last.state_bytes is not None and last.state_bytes[0] == 0 and last.state_bytes[1] >= 4 * params


def test_a_train_run_with_master_chunks_ends_as_plain_master_weights_with_a_ninth_of_the_device_state() -> None:
    """bf16 parameters with float32 master weights, AdamW: plain, and with the masters, their gradients and the
    state all in host-memory chunks. The same weights bit for bit after three steps; the device holds the bf16
    parameters P (2 bytes each) against P + 2P masters + 2P gradients + 4P moments (18 bytes each): 9x less, the
    closed form's (AxoNN reports 4x against 16 bytes a parameter, its 16-bit gradients held too)."""
    from pipefold.runtime.launch.local import run_local
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    runs = {}
    shape = {"schedule": "1f1b", "devices": 2, "microbatches": 2, "steps": 3, "model": "mlp", "layers": 4,
             "hidden": 64, "batch": 16, "partition": "even", "optimizer": "adamw", "dtype": "bf16",
             "master_weights": True}
    for how, extra in (("plain", {}), ("host", {"state_chunks": True, "memory_budget": "200KB",
                                                "chunk_size": "128KB"})):
        job = dataclasses.replace(make_job(RunSpec.flat(**shape, **extra)), save_weights=True)
        runs[how] = sorted(run_local(job), key=lambda r: r.rank)
    for plain, host in zip(runs["plain"], runs["host"], strict=True):
        for name, w in plain.weights.items():
            assert w.dtype == torch.bfloat16 and torch.equal(host.weights[name], w), name
        params = sum(w.numel() * w.element_size() for w in plain.weights.values())
        steps = 4 * len(plain.weights)  # AdamW's step count, a float32 scalar for each parameter
        assert (plain.static_bytes, host.static_bytes) == (9 * params + steps, params)
        last = host.steps[-1]
        assert last.state_bytes is not None and last.state_bytes[0] == 0 and last.state_bytes[1] >= 8 * params


def test_a_chunk_size_below_the_largest_parameter_is_refused_before_any_rank_starts() -> None:
    from pipefold.train.prepare import make_job
    from pipefold.train.spec import RunSpec

    spec = RunSpec.flat(schedule="1f1b", devices=2, microbatches=2, model="mlp", layers=4, hidden=64, batch=16,
                        state_chunks=True, chunk_size="64KB")
    with pytest.raises(ConfigError, match=r"--chunk-size 64,000 holds 16,000 float32 values and the model's largest "
                                          r"parameter has 16,384: give --chunk-size 65536 or more"):
        make_job(spec)


def test_a_chunk_larger_than_the_device_is_refused() -> None:
    from pipefold.train.spec import RunSpec

    with pytest.raises(ConfigError, match="--chunk-size 8,000,000 is more than the device's --memory-budget "
                                          "4,000,000: no chunk could ever be on the device"):
        RunSpec.flat(state_chunks=True, chunk_size="8MB", memory_budget="4MB")

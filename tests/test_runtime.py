"""Real multi-process pipelines over gloo: every schedule's gradients equal one process's."""

from __future__ import annotations

import functools

import pytest
import torch

from pipefold import names
from pipefold.errors import ConfigError
from pipefold.models import GPTConfig, build_gpt_layers, gpt_loss, split_layers
from pipefold.runtime.comm import HEADER, MAX_TENSORS
from pipefold.runtime.launch.job import Job
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.launch.settings import Optimizer
from pipefold.schedules import build
from pipefold.train.prepare import make_job
from pipefold.train.reference import compare, reference_step
from pipefold.train.run import train
from pipefold.train.spec import RunSpec

TOLERANCE = 1e-5


def _layers_for(name: str, p: int) -> int:
    return build(name, p, 2 * p).stages * 2  # two layers per stage


# Every schedule runs on 2 ranks and on 4. On 4 ranks with the MLP, and with the GPT for one schedule of each shape
# (linear, V, V with pairs, replicas); on 2 ranks with the GPT, or with the MLP for those five. That keeps the
# suite's time in bounds: every spawned run costs seconds.
_GPT_ON_4 = ("1f1b", "zb-v", "v-half", "dualpipev", "chimera")
# Variants whose generator another family shares (zb-h: zb-h1/h2's; 1f1b-v: zb-v's; v-zb, v-block: v-min's block
# expansion) run on 2 ranks only.
_SHARED = ("zb-h", "1f1b-v", "v-zb", "v-block")
_EVERY = ([(name, 4, "mlp") for name in names() if name not in _SHARED]
          + [(name, 2, "mlp") for name in _GPT_ON_4]
          + [(name, 2, "gpt") for name in names() if name not in _GPT_ON_4] + [(name, 4, "gpt") for name in _GPT_ON_4])


@pytest.mark.parametrize(("name", "ranks", "model"), _EVERY)
def test_every_schedule_matches_one_process(name: str, ranks: int, model: str) -> None:
    # The GPT's embedding and head count as layers: its blocks are the rest.
    layers = _layers_for(name, ranks) - (2 if model == "gpt" else 0)
    sizes = {"heads": 2, "seq": 8} if model == "gpt" else {}  # an MLP has neither
    cfg = RunSpec.flat(schedule=name, devices=ranks, microbatches=2 * ranks, steps=1, model=model, layers=layers,
                       hidden=16, batch=2 * ranks, partition="even", **sizes)
    job, reports = train(cfg.replace(check=True))
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "v-half"])
@pytest.mark.parametrize("memory", ["recompute", "offload"])
def test_recomputed_and_offloaded_stages_match_one_process(name: str, ranks: int, memory: str) -> None:
    # B frees what W will not read on split-backward schedules (zb-h1, zb-v, v-half), recomputed or offloaded.
    options: dict[str, object] = {"recompute": "full"} if memory == "recompute" else {"offload": (1, 1)}
    cfg = RunSpec.flat(schedule=name, devices=ranks, microbatches=2 * ranks, steps=1, model="gpt",
                      layers=_layers_for(name, ranks), hidden=16, heads=2, seq=8, batch=2 * ranks,
                      partition="even", **options)  # type: ignore[arg-type]
    job, reports = train(cfg.replace(check=True))
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE


def test_gpt_on_v_shape_matches_and_learns() -> None:
    cfg = RunSpec.flat(schedule="zb-v", devices=2, microbatches=4, steps=6, model="gpt", layers=2, hidden=32,
                      heads=4, batch=8, seq=32, lr=3e-3)
    job, reports = train(cfg.replace(check=True))
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE
    losses = [sum(r.steps[i].losses.get(j, 0.0) for r in reports for j in range(4)) / 4 for i in range(6)]
    assert losses[-1] < losses[0]
    assert all(s.peak_activation_bytes > 0 for r in reports for s in r.steps)


def _varying_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence length changes from step to step: metadata must follow."""
    g = torch.Generator().manual_seed(step)
    seq = (8, 16, 12)[step % 3]
    x = torch.randint(0, 256, (8, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_shapes_may_change_between_steps() -> None:
    cfg = GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=16)
    schedule = build("zb-v", 2, 4)
    layer_stages = ((0,), (1,), (2,), (3,))
    for step in (1, 2):  # steps whose shapes differ from the one before
        job = Job(schedule=schedule, layer_stages=layer_stages,
                  build_layers=functools.partial(build_gpt_layers, cfg, seed=3), loss_fn=gpt_loss,
                  batch_at=_varying_batch, steps=step + 1, optimizer=Optimizer(name="sgd", lr=0.0),
                  save_grads_of_step=step,
                  extra={"num_layers": 4})
        reports = run_local(job)
        _, want = reference_step(job, step)
        got = {k: v for r in reports for k, v in (r.grads or {}).items()}
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6)


def test_user_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="has 8 stages but the model has 4 layers, so at most 4 stages: "
                                          "use --devices 2 or fewer"):
        make_job(RunSpec.flat(schedule="v-half", devices=4, model="mlp", layers=4, batch=8))
    from pipefold.models import gpt_loss, mlp_loss

    with pytest.raises(ConfigError, match=r"the target has shape \(8, 3\) but the model's output has \(8, 4\)"):
        mlp_loss(torch.zeros(8, 4), torch.zeros(8, 3))
    with pytest.raises(ConfigError, match=r"give one target token per position, shape \(2, 5\)"):
        gpt_loss(torch.zeros(2, 5, 256), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match="a batch of 10 does not split into 8 microbatches"):
        make_job(RunSpec.flat(schedule="1f1b", devices=2, microbatches=8, model="mlp", layers=4, batch=10))
    # Checked in the launcher, before any rank starts (they used to fail on every rank at once).
    with pytest.raises(ConfigError, match="unknown optimizer 'adam': use sgd, adamw or kfac, or pass a function"):
        make_job(RunSpec.flat(schedule="1f1b", devices=2, model="mlp", layers=4, batch=8, optimizer="adam",
                             partition="even"))


class _Boom(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in stage 2")


def _layers_with_a_bomb(indices: list[int]) -> dict[int, torch.nn.Module]:
    return {i: (_Boom() if i == 2 else torch.nn.Linear(4, 4)) for i in indices}


def test_an_error_on_one_rank_stops_them_all(caplog: pytest.LogCaptureFixture) -> None:
    from pipefold.runtime.launch.job import RankError

    job = Job(schedule=build("1f1b", 4, 4), layer_stages=((0,), (1,), (2,), (3,)), build_layers=_layers_with_a_bomb,
              loss_fn=torch.nn.functional.mse_loss, batch_at=_linear_batch, steps=1)
    with pytest.raises(RankError, match=r"^rank 2 failed in 2F0 of step 1: ValueError: boom in stage 2$") as err:
        run_local(job)
    assert "Traceback" in err.value.details and err.value.rank == 2
    # The error says it all: no warning per terminated rank from torch's spawn around it.
    assert not [r for r in caplog.records if "Terminating process" in r.getMessage()]


def _linear_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)  # every process must see the same batch
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


class _Fork(torch.nn.Linear):
    """Returns two tensors: the next stage receives a tuple."""

    def __init__(self) -> None:
        super().__init__(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h = super().forward(x)
        return h, torch.tanh(h) * 2


class _Join(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(a * b + a)


def _fork_join_layers(indices: list[int]) -> dict[int, torch.nn.Module]:
    out: dict[int, torch.nn.Module] = {}
    for i in indices:
        torch.manual_seed(100 + i)  # the same weights whichever process builds the layer
        out[i] = _Fork() if i % 2 == 0 else _Join()
    return out


def test_tuples_of_tensors_flow_between_stages() -> None:
    job = Job(schedule=build("zb-h1", 2, 4), layer_stages=((0,), (1,)), build_layers=_fork_join_layers,
              loss_fn=torch.nn.functional.mse_loss, batch_at=_linear_batch, steps=1, save_grads_of_step=0,
              extra={"num_layers": 2})
    reports = run_local(job)
    _, want = reference_step(job)
    got = {k: v for r in reports for k, v in (r.grads or {}).items()}
    assert set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_nccl_matches_one_process() -> None:
    cfg = RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, steps=1, model="mlp", layers=4, hidden=16, batch=8)
    job, reports = train(cfg.replace(check=True))
    assert compare(job, reports)["max_grad_rel_diff"] < 1e-4


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def test_global_norm_clipping_and_any_optimizer() -> None:
    """The second step's loss shows the first update: clipped by the norm over all ranks, as in one process."""
    from dataclasses import replace

    cfg = RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, steps=2, model="mlp", layers=4, hidden=8, batch=8)
    job = replace(make_job(cfg), optimizer=Optimizer(name=_sgd, clip=1e-3))
    reports = run_local(job)
    pipe = [sum(sum(r.steps[i].losses.values()) for r in reports) / 4 for i in range(2)]
    n = job.extra["num_layers"]
    layers = job.build_layers(list(range(n)))
    model = torch.nn.Sequential(*(layers[i] for i in range(n)))
    opt = _sgd(list(model.parameters()))
    want = []
    for step in range(2):
        x, y = job.batch_at(step)
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            loss = job.loss_fn(model(xs), ys)
            (loss / 4).backward()
            total += float(loss.detach()) / 4
        want.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
    assert pipe == pytest.approx(want, rel=1e-5)
    assert pipe[1] != pytest.approx(pipe[0], rel=1e-6)  # the step did move the weights


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_offloading_stages_keep_the_gradients(name: str) -> None:
    cfg = RunSpec.flat(schedule=name, devices=2, microbatches=4, steps=1, model="mlp", layers=_layers_for(name, 2) * 2,
                      hidden=16, batch=8, offload=(1, 1))
    job, reports = train(cfg.replace(check=True))
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE
    # Each stage kept one of its layers on the device at a time: 1 layer's bytes per stage.
    layer_bytes = sum(p.numel() * 4 for p in job.build_layers([0])[0].parameters())
    stages_per_rank = job.schedule.stages // job.schedule.devices
    assert all(0 < r.resident_param_bytes <= stages_per_rank * layer_bytes for r in reports)


def test_stages_balanced_by_parameters_keep_the_gradients() -> None:
    from pipefold.models import make_model
    from pipefold.plan.partition import partition
    from pipefold.runtime.measure.profiling import layer_costs

    cfg = RunSpec.flat(schedule="zb-v", devices=2, microbatches=4, steps=1, model="gpt", layers=6, hidden=32, heads=4,
                      batch=8, seq=16, partition="params")
    job, reports = train(cfg.replace(check=True))
    assert compare(job, reports)["max_grad_rel_diff"] < TOLERANCE
    model = make_model("gpt", layers=6, hidden=32, heads=4, batch=2, seq=16)
    want = partition(layer_costs(model.build(), model.batch_at(0)[0], by="params"), 4,
                     placement=job.schedule.placement[0])
    assert [list(s) for s in job.layer_stages] == want.parts
    assert job.layer_stages != tuple(tuple(s) for s in split_layers(8, 4))  # the big head moved the split


def _two_shapes(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 0 and 1 share a sequence length, step 2 has another: headers go out in steps 0 and 2 only."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (8, (8, 8, 12)[step] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.mark.parametrize(("name", "ranks"), [("1f1b", 4), ("interleaved-1f1b", 2), ("looped-bfs", 2), ("kfkb", 4),
                                             ("zb-h2", 4), ("zb-v", 2), ("v-half", 4), ("v-min", 4)])
def test_each_neighbour_receives_in_the_order_it_sends(name: str, ranks: int) -> None:
    # NCCL ignores tags and pairs the messages between two ranks by order alone, so every rank must
    # post a neighbour's receives in exactly the order that neighbour posts its sends: data, gradients
    # and shape headers, in steps with new shapes and without. (gloo matches by tag and would hide a
    # mismatch, so the order is checked here directly, from what each rank posted.)
    schedule = build(name, ranks, 2 * ranks)
    cfg = GPTConfig(n_layer=schedule.stages, n_embd=16, n_head=2, block_size=16)
    layer_stages = tuple(tuple(s) for s in split_layers(cfg.num_layers, schedule.stages))
    job = Job(schedule=schedule, layer_stages=layer_stages, build_layers=functools.partial(build_gpt_layers, cfg),
              loss_fn=gpt_loss, batch_at=_two_shapes, steps=3, log_messages=True)
    reports = run_local(job)
    for step in range(3):
        sent: dict[tuple[int, int], list[int]] = {}
        received: dict[tuple[int, int], list[int]] = {}
        for r in reports:
            for op, peer, tag in r.steps[step].messages:
                link = (r.rank, peer) if op == "send" else (peer, r.rank)
                (sent if op == "send" else received).setdefault(link, []).append(tag)
        assert sent and sent == received
        headers = sum(1 for r in reports for op, _, tag in r.steps[step].messages
                      if op == "send" and tag >= HEADER * schedule.stages * schedule.microbatches * MAX_TENSORS)
        assert (headers > 0) == (step != 1)


@pytest.mark.parametrize(("name", "share"), [("gpipe", "all"), ("zb-v", "all"), ("interleaved-1f1b", 0.5)])
def test_offloaded_activations_keep_the_gradients_and_lower_the_peak(name: str, share: str | float) -> None:
    """The same GPT with and without its activations offloaded: the same gradients as one process, and on the rank
    whose stage keeps the most microbatches (device 0), a lower peak of held bytes, as the simulator predicts."""
    from pipefold.plan.activation_offload import COPY_LIKE_A_FORWARD, offload_fraction

    base = RunSpec.flat(schedule=name, devices=2, microbatches=4, steps=1, model="gpt",
                        layers=_layers_for(name, 2) - 2, hidden=32, heads=2, seq=16, batch=8, partition="even")
    peaks = {}
    for offloaded in (None, share):
        cfg = base.replace(check=True, offload_activations=offloaded)
        job, reports = train(cfg)
        diff = compare(job, reports)
        assert diff["max_grad_rel_diff"] < TOLERANCE and diff["loss_rel_diff"] < TOLERANCE
        assert (job.extra.get("offload_activations") is not None) == (offloaded is not None)
        peaks[offloaded] = {r.device: r.steps[-1].peak_activation_bytes for r in reports}
    predicted = offload_fraction(build(name, 2, 4), 1.0 if share == "all" else float(share), COPY_LIKE_A_FORWARD)
    assert predicted.result.peak_memory[0] < predicted.plain.peak_memory[0]
    assert peaks[share][0] < peaks[None][0]

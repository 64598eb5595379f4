"""Model size before building: parameters exactly (the meta-device model), activations against the runtime's
meter, operations against torch's FlopCounterMode; the limits that use them."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipefold.errors import ConfigError
from pipefold.models import make_model
from pipefold.models.gpt import GPTConfig, _make_layer
from pipefold.models.mlp import MLPBlock, MLPConfig
from pipefold.models.size import (
    MAX_STEP_FLOPS,
    RANK_BYTES,
    Shape,
    activation_bytes,
    check_fits,
    parameters,
    step_flops,
)
from pipefold.runtime.measure.profiling import layer_memory

SHAPES = [Shape(model="gpt", layers=2, hidden=64, heads=4, batch=4, seq=32),
          Shape(model="gpt", layers=3, hidden=128, heads=8, batch=2, seq=128),
          Shape(model="mlp", layers=3, hidden=64, batch=8),
          Shape(model="mlp", layers=2, hidden=256, batch=16)]


@pytest.mark.parametrize("shape", [*SHAPES, Shape(model="gpt", layers=12, hidden=4096, heads=32, seq=2048),
                                   Shape(model="mlp", layers=100, hidden=100_000)])
def test_parameters_are_those_of_the_model_built_on_the_meta_device(shape: Shape) -> None:
    with torch.device("meta"):  # shapes only, nothing allocated: big models count too
        if shape.model == "gpt":
            cfg = GPTConfig(n_layer=shape.layers, n_embd=shape.hidden, n_head=shape.heads, block_size=shape.seq)
            layers = [_make_layer(cfg, i) for i in range(cfg.num_layers)]
        else:
            layers = [MLPBlock(MLPConfig(hidden=shape.hidden, layers=shape.layers)) for _ in range(shape.layers)]
    assert parameters(shape) == sum(p.numel() for layer in layers for p in layer.parameters())


def _model(shape: Shape) -> tuple[list[torch.nn.Module], torch.Tensor, torch.Tensor, object]:
    """The registered model of ``shape``, built through the model interface; its size is ``shape``."""
    model = make_model(shape.model, layers=shape.layers, hidden=shape.hidden, heads=shape.heads, seq=shape.seq,
                       batch=shape.batch)
    assert model.size() == (shape if shape.model == "gpt" else Shape(model="mlp", layers=shape.layers,
                                                                     hidden=shape.hidden, batch=shape.batch))
    x, target = model.batch_at(0)
    assert isinstance(x, torch.Tensor)
    return model.build(), x, target, model.loss


@pytest.mark.parametrize("shape", SHAPES)
def test_estimates_against_the_meter_and_torchs_flop_counter(shape: Shape) -> None:
    layers, x, target, loss_fn = _model(shape)
    assert callable(loss_fn)
    held = sum(h for h, _ in layer_memory(layers, x, loss_fn=loss_fn, target=target))
    assert 0.8 <= activation_bytes(shape, shape.batch) / held <= 1.5
    with FlopCounterMode(display=False) as counter:
        y = x
        for layer in layers:
            y = layer(y)
        loss_fn(y, target).backward()
    assert 0.8 <= step_flops(shape) / counter.get_total_flops() <= 1.3


def test_memory_limit_names_the_need_and_what_fits() -> None:
    shape = Shape(model="gpt", layers=4, hidden=100_000)
    with pytest.raises(ConfigError) as info:
        check_fits(shape, ranks=4, copies=5, available=16 * 2**30, what="training gpt")
    text = str(info.value)
    assert "would need at least" in text and "16.0 GiB available" in text and "--hidden" in text
    largest = int(text.rsplit("--hidden ", 1)[1].split()[0])
    # The suggestion fits and is the largest multiple of the heads that does.
    fits = Shape(model="gpt", layers=4, hidden=largest)
    check_fits(fits, ranks=4, copies=5, available=16 * 2**30)
    with pytest.raises(ConfigError):
        check_fits(Shape(model="gpt", layers=4, hidden=largest + 4), ranks=4, copies=5, available=16 * 2**30)
    with pytest.raises(ConfigError, match="use at most 3 ranks"):
        check_fits(Shape(model="mlp", layers=2, hidden=16), ranks=100, available=3 * RANK_BYTES + 2**20)


def test_flop_limit_names_the_setting_to_shrink() -> None:
    with pytest.raises(ConfigError, match=r"over pipefold's limit of 1e\+13 .*: use --seq (\d+) or less") as info:
        check_fits(Shape(model="gpt", layers=4, hidden=64, seq=100_000), available=2**60)
    seq = int(str(info.value).rsplit("--seq ", 1)[1].split()[0])
    assert step_flops(Shape(model="gpt", layers=4, hidden=64, seq=seq)) <= MAX_STEP_FLOPS
    assert step_flops(Shape(model="gpt", layers=4, hidden=64, seq=seq + 1)) > MAX_STEP_FLOPS

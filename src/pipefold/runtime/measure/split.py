"""Cutting a model into a schedule's stages for a user's script, balanced by what its layers measure.

:func:`split_model` takes an ``nn.Sequential``, a list of layers or a Hugging Face causal LM and returns the stage
modules of one device, each an ``nn.Sequential`` of consecutive layers, ready for
:class:`~pipefold.runtime.pipeline.Pipeline`. The cut is pipefold's partitioner's (:func:`pipefold.plan.partition.
split_by`) over the layers' figures as the profile measures them (:func:`pipefold.runtime.measure.profiling.
split_figures`, the same measurement behind ``pipefold partition``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError
from pipefold.ir import Schedule
from pipefold.plan.choose import resolve_schedule

__all__ = ["split_model"]

_BY = {"parameters": "params", "params": "params", "time": "time", "memory": "memory"}


def split_model(model: nn.Module | Sequence[nn.Module], schedule: str | Schedule | os.PathLike[str], *,
                devices: int, microbatches: int | None = None, by: str = "parameters", sample: Any = None,
                target: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                device: int | None = None) -> dict[int, nn.Module]:
    """Cut a model into the schedule's stages and return those of ``device`` (this rank's, when None and the
    default group's ranks are the pipeline's), ``{stage: nn.Sequential}``.

    ``model``: an ``nn.Sequential``, a list of layers, or a Hugging Face causal LM of a family pipefold knows
    (GPT-2, LLaMA: :func:`pipefold.models.hf.hf_layers`, fed token ids, giving logits). ``by``:

    - ``"parameters"``: each layer's parameter count, balanced over the devices (no run needed);
    - ``"time"``: each layer's F, B and W timed on ``sample`` (one microbatch of the first layer's input), the
      busiest device's time balanced under the schedule's placement (a V shape's device holds two stages);
    - ``"memory"``: also the bytes each layer holds from F to B and from B to W (``target`` and ``loss_fn`` for the
      last layer), the least predicted device peak within 2% of the time-balanced split's time.

    Measured times differ from rank to rank, so by time or memory every rank of the default process group calls it
    at once and takes rank 0's cut (one broadcast); by parameters each rank cuts alike on its own.
    """
    from pipefold.plan.partition import split_by
    from pipefold.runtime.measure.profiling import split_figures

    if isinstance(model, (nn.Sequential, list, tuple, nn.ModuleList)):
        layers = list(model)
    elif hasattr(model, "base_model") and hasattr(getattr(model, "config", None), "model_type"):
        from pipefold.models.hf import hf_layers

        layers = hf_layers(model)  # a Hugging Face causal LM: its embedding, blocks and head as layers
    else:
        raise ConfigError(f"split_model cuts an nn.Sequential, a list of layers or a Hugging Face causal LM, not a "
                          f"{type(model).__name__}: list the model's layers in order")
    if by not in _BY:
        raise ConfigError(f"split_model cuts by 'parameters', 'time' or 'memory', not {by!r}")
    built = resolve_schedule(schedule, devices, microbatches)
    if len(layers) < built.stages:
        raise ConfigError(f"{built.name} on {devices} devices has {built.stages} stages, but the model has "
                          f"{len(layers)} layers: give it at least one layer a stage")
    if built.replicas > 1:
        raise ConfigError(f"{built.name} holds two replicas of the model: cut it for a schedule of one replica "
                          "with the same stages (1f1b for Chimera, zb-v for DualPipeV's placement) and give each "
                          "rank both of its stages")
    here = _device(device, devices)
    if by != "parameters" and sample is None:
        raise ConfigError(f"split_model(by={by!r}) measures each layer: give sample=, one microbatch of the first "
                          "layer's input")
    if by == "memory" and (target is None or loss_fn is None):
        raise ConfigError("split_model(by='memory') measures the last layer with its loss: give target= and loss_fn=")
    kind = _BY[by]
    figures = split_figures(layers, sample if sample is not None else torch.zeros(1), by=kind,
                            loss_fn=loss_fn or _no_loss, target=target)
    parts = split_by(figures, built, kind).parts
    if kind != "params" and dist.is_initialized():
        box = [parts]  # measured times differ from rank to rank: every rank takes rank 0's cut
        dist.broadcast_object_list(box, src=0)
        parts = box[0]
    return {s: nn.Sequential(*(layers[i] for i in parts[s])) for s in built.stages_of(here)}


def _no_loss(*_: Any) -> torch.Tensor:
    raise AssertionError("split_model measured a loss it was not given")


def _device(device: int | None, devices: int) -> int:
    if device is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != devices:
            raise ConfigError(f"split_model cuts for one of {devices} devices, but there are {world} ranks: name this "
                              "rank's device, device=mesh['pp'].get_local_rank()")
        device = dist.get_rank() if dist.is_initialized() else 0
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < devices:
        raise ConfigError(f"device must be one of the pipeline's devices 0..{devices - 1} (got {device!r})")
    return device

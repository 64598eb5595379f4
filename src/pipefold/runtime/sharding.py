"""FSDP for a pipeline stage: torch's ``fully_shard`` driven by the schedule's ``AG`` and ``RS`` actions.

Each data-parallel copy of a stage keeps 1/dp of its parameters (DTensor shards, what the optimizer steps),
their gradients and the optimizer state. FSDP's own hooks would gather before every forward and reduce after
every backward; in a pipeline a stage runs many microbatches' forwards and backwards per step, split into B and
W, so the schedule decides instead (the breadth-first pairing, Lamy-Poirier 2022):

- ``sAG`` starts the all-gather of the stage's parameters (:func:`gather`); its first forward waits for it;
- every B and W accumulates into the gathered parameters' gradients, nothing is reduced meanwhile;
- ``sRS`` reduce-scatters the gradients into the shards' ``.grad`` and frees the gathered parameters
  (:func:`reduce_scatter`): a mean over the copies, as FSDP's default.

Between the two, gradient sync and resharding are off, so FSDP's hooks (where the runner calls the stage
module) only keep its bookkeeping: the actions are the only place where parameters move. The gathered
parameters are the same tensors from step to step (FSDP frees and refills their storage), so a
:class:`~pipefold.runtime.stage.StageRunner` made while they are gathered keeps working on them.

On CUDA, FSDP runs the collectives on streams of their own, beside the compute; on the CPU (gloo) the
reduce-scatter runs in ``RS`` itself and the all-gather beside the actions until the stage's first forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["full", "gather", "gather_on_host", "gathered_bytes", "local", "plain", "reduce_scatter", "shard",
           "sharded_parameters"]


def shard(module: nn.Module, mesh: Any) -> nn.Module:
    """``module`` sharded across the 1-D data-parallel ``mesh`` and gathered, ready for a runner to be made on
    its gathered parameters; from then on only :func:`gather` and :func:`reduce_scatter` move them."""
    from torch.distributed.fsdp import fully_shard

    # One FSDP unit per layer under the stage's: a reduce-scatter then stages one layer's gradients at a time
    # (FSDP copies them into a flat buffer first), not the whole stage's.
    for layer in module.children():
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    # The runner may call the stage's layers rather than the stage module, so FSDP's forward hook may never run:
    # the stage is made FSDP's root here, where that hook would have made it.
    fully_shard.state(module)._lazy_init()  # type: ignore[attr-defined]
    _accumulate(module)
    gather(module).wait()
    return module


def sharded_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The shards of a sharded stage: what its optimizer steps (DTensors), whether gathered or not."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    return [fp.sharded_param for group in _groups(state) for fp in group.fsdp_params]


class _Gathering:
    """The all-gathers of a stage's FSDP units, waited for together."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()


def gather(module: nn.Module) -> _Gathering:
    """Start gathering the stage's parameters (every FSDP unit in it); wait on what it returns before the
    stage's first forward."""
    from torch.distributed.fsdp import FSDPModule

    return _Gathering([m.unshard(async_op=True) for m in module.modules() if isinstance(m, FSDPModule)])


def gathered_bytes(module: nn.Module) -> int:
    """Bytes of the stage's parameters gathered whole and of their gradients (FSDP's unsharded ones): what a copy
    holds beside its shards from the stage's ``AG`` to its ``RS``; call it before the ``RS``."""
    from torch.distributed.fsdp import fully_shard

    total = 0
    for group in _groups(fully_shard.state(module)):  # type: ignore[attr-defined]
        for fp in group.fsdp_params:
            whole = fp.unsharded_param
            total += local(whole).numel() * whole.element_size()
            if whole.grad is not None:
                total += local(whole.grad).numel() * whole.grad.element_size()
    return total


def reduce_scatter(module: nn.Module) -> None:
    """Reduce-scatter the gathered gradients into the shards' ``.grad`` (mean over the copies, added to what is
    there) and free the gathered parameters; then back to accumulating for the next step."""
    from torch.distributed.fsdp import fully_shard

    module.set_is_last_backward(True)  # type: ignore[operator]
    module.set_reshard_after_backward(True)  # type: ignore[operator]
    module.set_requires_gradient_sync(True)  # type: ignore[operator]
    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for group in _groups(state):
        group.post_backward()
    state._root_post_backward_final_callback()  # waits for the reductions, resets FSDP's per-step state
    _accumulate(module)


def _accumulate(module: nn.Module) -> None:
    """Backwards accumulate into the gathered gradients and keep the parameters gathered."""
    module.set_is_last_backward(False)  # type: ignore[operator]
    module.set_reshard_after_backward(False)  # type: ignore[operator]
    module.set_requires_gradient_sync(False)  # type: ignore[operator]


def _groups(state: Any) -> list[Any]:
    """Every FSDP parameter group under ``state``'s root. torch 2.13 keeps a list per module
    (``_fsdp_param_groups``); torch 2.11 one group or None (``_fsdp_param_group``)."""
    out: list[Any] = []
    for each in state._state_ctx.all_states:
        groups = getattr(each, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(each, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        out += groups
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``, a plain tensor with a storage: a DTensor's shard, the result inside a wrapper
    subclass (a functional collective's AsyncCollectiveTensor), ``t`` itself otherwise."""
    while type(t) not in _PLAIN:  # inline: every tensor the meter counts passes here
        flatten = getattr(t, "__tensor_flatten__", None)
        names = flatten()[0] if flatten is not None else ()
        if not names:
            return t
        t = getattr(t, names[0])
    return t


_PLAIN = (torch.Tensor, nn.Parameter)


def plain(t: object) -> bool:
    """Whether ``t`` is a plain tensor or parameter, not a DTensor or another subclass (what :func:`local` returns)."""
    return type(t) in _PLAIN


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for the result of a functional collective still in flight (AsyncCollectiveTensor, what a
    tensor-parallel layer returns after its all-reduce) the plain tensor once it has arrived."""
    wait = getattr(t, "trigger_wait", None)
    return wait() if wait is not None else t


def split_over(p: torch.Tensor, dim: str) -> bool:
    """Whether ``p`` is a DTensor split along its mesh's dimension named ``dim`` (each rank of it holds its own
    part), not replicated along it: a tensor-parallel weight is split over "tp", and with FSDP also over "dp",
    where a norm's weight is split over "dp" only."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return False
    names, placements = mesh.mesh_dim_names or (), getattr(p, "placements", ())
    return any(name == dim and placement.is_shard() for name, placement in zip(names, placements, strict=False))


def tensor_parallel(layers: dict[int, nn.Module], plans: dict[int, dict[str, str]], mesh: Any) -> None:
    """Split each layer in place over the tensor-parallel ``mesh`` by its plan (submodule -> style): torch's
    ``parallelize_module`` with ColwiseParallel ("colwise") and RowwiseParallel ("rowwise"), whose outputs are
    plain tensors again (the colwise part's output is this rank's share of the features, the rowwise part's the
    whole, all-reduced).

    Sequence parallelism (Korthikanti et al.): a layer whose plan has "sequence" modules (torch's
    SequenceParallel: norms, each rank its share of the tokens) takes "colwise-sp" (the tokens gathered before
    the Linear) and "rowwise-sp" (its output reduce-scattered over the tokens instead of all-reduced). Between
    such layers the activations stay split over the tokens; the first of each run of consecutive such layers
    takes its input whole and keeps its share of the tokens, the last gathers its output whole again, so that
    what a stage receives and sends is what it is without sequence parallelism. ``layers`` is one stage's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    styles: dict[str, Callable[[], Any]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                                            "sequence": SequenceParallel,
                                            "colwise-sp": lambda: ColwiseParallel(input_layouts=Shard(1)),
                                            "rowwise-sp": lambda: RowwiseParallel(output_layouts=Shard(1))}
    for index, layer in layers.items():
        plan = plans.get(index)
        if plan:
            parallelize_module(layer, mesh, {name: styles[style]() for name, style in plan.items()})
    split = [i for i in sorted(layers) if "sequence" in plans.get(i, {}).values()]
    for i in split:
        if i - 1 not in split:  # the first of a run: its input whole, this rank keeps its share of the tokens
            parallelize_module(layers[i], mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                                   desired_input_layouts=(Shard(1),),
                                                                   use_local_output=True))
        if i + 1 not in split:  # the last: its output gathered whole
            parallelize_module(layers[i], mesh, PrepareModuleOutput(output_layouts=(Shard(1),),
                                                                    desired_output_layouts=(Replicate(),)))


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``: gathered from every shard for a DTensor (a collective), ``t`` itself otherwise.

    gloo all-reduces GPU tensors but cannot gather them: ranks sharing a GPU died of SIGSEGV in the gather of a
    tensor-parallel gradient, and again when DTensor gathered host copies on the GPU's mesh. There the shards
    meet in host memory through plain ``all_gather`` calls (:func:`gather_on_host`), and the whole goes back to
    the GPU."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.device.type != "cpu" and _gloo(t):
        return gather_on_host(t).to(t.device)
    return t.full_tensor()


def gather_on_host(t: Any) -> torch.Tensor:
    """A DTensor's whole, in host memory, from ``torch.distributed``'s own ``all_gather`` and ``all_reduce`` over
    each mesh dimension's group, last dimension first (the order DTensor shards in, undone). Shards are
    ``torch.chunk``'s pieces, padded to the largest to be gathered. Two mesh dimensions sharding one tensor
    dimension, and partial values to be reduced otherwise than summed, are left to DTensor."""
    import torch.distributed as dist

    mesh, placements = t.device_mesh, t.placements
    sharded = [p.dim for p in placements if p.is_shard()]
    summed = all(getattr(p, "reduce_op", "sum") == "sum" for p in placements if p.is_partial())
    if len(sharded) != len(set(sharded)) or not summed:
        return t.full_tensor().cpu()
    local = t.to_local().detach().cpu()
    for i in reversed(range(mesh.ndim)):
        place, group, n = placements[i], mesh.get_group(i), mesh.size(i)
        if place.is_partial():
            local = local.clone()
            dist.all_reduce(local, group=group)
        elif place.is_shard():
            d, whole = place.dim, t.shape[place.dim]
            piece = -(-whole // n)  # torch.chunk's
            sizes = [max(0, min(piece, whole - k * piece)) for k in range(n)]
            padded = local.new_zeros((*local.shape[:d], piece, *local.shape[d + 1:]))
            padded.narrow(d, 0, local.shape[d]).copy_(local)
            pieces = [torch.empty_like(padded) for _ in range(n)]
            dist.all_gather(pieces, padded, group=group)
            local = torch.cat([p.narrow(d, 0, size) for p, size in zip(pieces, sizes, strict=True)], dim=d)
    return local


def _gloo(t: Any) -> bool:
    import torch.distributed as dist

    mesh = t.device_mesh
    return any(dist.get_backend(mesh.get_group(i)) == "gloo" for i in range(mesh.ndim))

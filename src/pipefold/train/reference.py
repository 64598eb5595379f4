"""The one-process reference a pipelined run is checked against: the same model, initial weights and data, in
one process (``pipefold train --check`` and the tests' exactness checks)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from pipefold.ir import Schedule
from pipefold.runtime.launch.job import Job, RankReport
from pipefold.runtime.stage import Chain, as_tuple, split_batch

__all__ = ["compare", "reference_kfac", "reference_step"]


def reference_step(job: Job, step: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    """One step in one process, from the initial weights, on the device the job's first rank computes on (the
    same GPU), with the job's recipe (its dtype, master weights and loss scale, its compiled layers): mean loss
    over the microbatches and every gradient (float32, on the CPU)."""
    from pipefold.runtime.experts import balanced_stages
    from pipefold.runtime.launch.job import placement

    device = placement(job).device_of(0)
    n = job.extra["num_layers"]
    layers = job.build_layers(list(range(n)))
    model = Chain(*(layers[i] for i in range(n))).to(device)
    if job.devices.compile is not None:
        from pipefold.runtime.compiled import compile_stage
        from pipefold.runtime.launch.tempfolder import keep_compile_cache

        keep_compile_cache()
        model = compile_stage(model, job.devices.compile, job.devices.compile_backend)  # type: ignore[assignment]
    precision = job.devices.precision
    low = precision.torch_dtype if precision.master_weights else None
    if low is not None:
        model.to(low)
    scaler = precision.scaler()
    scale = scaler.scale if scaler is not None else 1.0
    casting = torch.autocast(device.type, dtype=precision.autocast) if precision.autocast is not None else \
        contextlib.nullcontext()
    # The data-parallel copies' microbatches, in order: copy c's j-th is the batch's (c * m + j)-th.
    m = job.schedule.data_microbatches * job.parallel.dp
    x, y = job.batch_at(step)
    xs_all = tuple(t.to(device, low) if low is not None and t.is_floating_point() else t.to(device)
                   for t in as_tuple(x))
    total = 0.0
    # Each parameter once (a weight two layers tie is one tensor under two names), its gradient summed over the
    # microbatches in float32, as master weights sum them.
    named = [(f"{i}.{name}", p) for i in range(n) for name, p in layers[i].named_parameters()]
    unique = list({id(p): p for _, p in named}.values())
    sums: dict[int, torch.Tensor] = {}
    spb, per_copy = job.parallel.spb, job.schedule.data_microbatches
    # A loss over the whole batch (a mixture of experts' load balancing): every microbatch's forward, then one
    # backward of their sum, as the pipeline's stages run them.
    whole = bool(balanced_stages(dict(enumerate(layers[i] for i in range(n)))))
    pending: list[torch.Tensor] = []
    for j, (xs, ys) in enumerate(zip(split_batch(xs_all, m), y.to(device).chunk(m), strict=True)):
        with casting:
            # With SPB, this microbatch's copy backpropagates through its last layers only.
            out = model(*xs) if spb is None else _partial_forward(list(model.children()), xs, n - spb[j // per_copy])
            loss = job.loss_fn(out, ys)
        total += float(loss.detach()) / m
        if whole:
            pending.append(loss * (scale / m))
            if j < m - 1:
                continue
            torch.stack(pending).sum().backward()
        else:
            (loss * (scale / m)).backward()
        for p in unique:
            if p.grad is not None:
                sums[id(p)] = sums[id(p)] + p.grad.float() if id(p) in sums else p.grad.float()
                p.grad = None
    if spb is not None:  # each layer's gradient, the mean over the copies that computed it
        for i in range(n):
            for p in layers[i].parameters():
                if id(p) in sums:
                    sums[id(p)] *= job.parallel.dp / job.parallel.computing(i, n)
    grads = {key: (sums[id(p)] / scale).to("cpu", copy=True) for key, p in named if id(p) in sums}
    return total, grads


def _partial_forward(layers: list[torch.nn.Module], inputs: tuple[Any, ...], without: int) -> Any:
    """The layers one after the other on ``inputs``, the first ``without`` of them without autograd."""
    h: Any = inputs
    for i, layer in enumerate(layers):
        with torch.no_grad() if i < without else contextlib.nullcontext():
            h = layer(*as_tuple(h))
    return h


def reference_kfac(job: Job, steps: int, reports: list[RankReport] | None = None) -> dict[str, torch.Tensor]:
    """``steps`` steps of the job's K-FAC in one process, from the initial weights: every stage's curvature,
    inversions and preconditioning where the job's cycle of schedules puts them (and, with the run's
    ``reports``, the cycles its rank 0 placed again as it ran), then the same optimizer. Returns the weights,
    named as ``RankReport.weights``."""
    from pipefold.ir import Action, Kind
    from pipefold.runtime.curvature import StageCurvature
    from pipefold.runtime.launch.settings import OPTIMIZERS
    from pipefold.runtime.meter import MemoryMeter

    assert job.optimizer.kfac is not None, "reference_kfac needs a K-FAC job"
    n = job.extra["num_layers"]
    layers = job.build_layers(list(range(n)))
    stages = [Chain(*(layers[i] for i in part)) for part in job.layer_stages]
    # The data-parallel copies' microbatches, in order (copy c's j-th is the batch's (c * m + j)-th): one process
    # builds every factor from all of them, as D-KFAC's all-reduce and DP-KFAC's owners do.
    per_copy, dp = job.schedule.microbatches, job.parallel.dp
    m = per_copy * dp
    curv = [StageCurvature(stage, job.optimizer.kfac, m) for stage in stages]
    params = [p for i in range(n) for p in layers[i].parameters()]
    opt = OPTIMIZERS["kfac"](params, lr=job.optimizer.lr)
    cycles: list[tuple[int, tuple[Schedule, ...]]] = [(0, job.cycle or (job.schedule,))]
    if reports is not None and job.refill is not None:
        cycles += [(first, filled.cycle) for r in reports if r.rank == 0 for first, filled in r.decisions]
    kinds = (Kind.KA, Kind.KG, Kind.KI, Kind.KP)
    for step in range(steps):
        first, cycle = max((c for c in cycles if c[0] <= step), key=lambda c: c[0])
        schedule = cycle[(step - first) % len(cycle)]
        # Each stage's K-FAC actions in its device's order (the schedule orders them the same way on every run).
        work = [[Action(a.stage, a.kind, c * per_copy + a.microbatch) if a.kind in (Kind.KA, Kind.KG) else a
                 for a in schedule.actions[schedule.device_of(s)] if a.stage == s and a.kind in kinds
                 for c in (range(dp) if a.kind in (Kind.KA, Kind.KG) else (0,))]
                for s in range(len(stages))]
        for s, c in enumerate(curv):
            c.begin(work[s], s, MemoryMeter())
        x, y = job.batch_at(step)
        for j, (xs, ys) in enumerate(zip(split_batch(x, m), y.chunk(m), strict=True)):
            h: tuple[Any, ...] = xs
            for c, stage in zip(curv, stages, strict=True):
                c.current = j
                h = as_tuple(stage(*h))
                c.current = None
            (job.loss_fn(*h, ys) / m).backward()
        for s, c in enumerate(curv):
            for a in work[s]:
                c.run(a)
        clip = job.optimizer.clip
        if clip is not None:  # as the ranks clip: by the global norm, all-reduced there
            norm = float(sum(p.grad.detach().pow(2).sum() for p in params if p.grad is not None) ** 0.5)
            if norm > clip:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(clip / (norm + 1e-6))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {f"{i}.{name}": p.detach().clone() for i in range(n) for name, p in layers[i].named_parameters()}


def compare(job: Job, reports: list[RankReport]) -> dict[str, float]:
    """Largest relative differences between the pipeline's first step and the single-process reference.

    A stage held by several replicas is compared on every rank that holds it (after their all-reduce).
    """
    ref_loss, ref_grads = reference_step(job)
    losses = [loss for r in reports for loss in r.steps[0].losses.values()]  # every pipeline's microbatches
    pipe_loss = sum(losses) / len(losses)
    got: dict[str, list[torch.Tensor]] = {}
    rows: dict[str, list[tuple[int, int, torch.Tensor]]] = {}  # a projection split by vocabulary: its shards' rows
    for r in reports:
        for name, g in (r.grads or {}).items():
            whole, _, span = name.partition("[")
            if span:
                first, _, end = span.rstrip("]").partition(":")
                rows.setdefault(whole, []).append((int(first), int(end), g))
            else:
                got.setdefault(name, []).append(g)
    for whole, parts in rows.items():  # the shards' rows joined, each row once
        parts.sort(key=lambda part: part[0])
        if [a for a, _, _ in parts] != [0, *[b for _, b, _ in parts[:-1]]]:
            spans = [(a, b) for a, b, _ in parts]
            raise RuntimeError(f"the shards of {whole} do not cover its rows once each: {spans}")
        got.setdefault(whole, []).append(torch.cat([g for _, _, g in parts]))
    if set(got) != set(ref_grads):
        missing = sorted(set(ref_grads) - set(got))[:3]
        raise RuntimeError(f"the pipeline produced no gradient for {missing}")
    worst = 0.0
    for name, g in ref_grads.items():
        denom = float(g.abs().max()) or 1.0
        worst = max([worst] + [float((mine - g).abs().max()) / denom for mine in got[name]])
    return {"loss_rel_diff": abs(pipe_loss - ref_loss) / max(abs(ref_loss), 1e-12), "max_grad_rel_diff": worst,
            "reference_loss": ref_loss}

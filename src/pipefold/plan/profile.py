"""A model's profile on the machine it will train on: what each layer costs, what the link costs, how devices share.

``pipefold profile`` measures, and :mod:`pipefold.plan.budget` reads, three things::

    layers      per layer, one microbatch: F, B, W seconds (medians of repeats on the runtime's own
                stage runner), bytes held after F and between B and W (the runtime's meter),
                parameter bytes, bytes of its output (what a stage boundary after it sends)
    link        one-way time of a message between two gloo ranks: latency + bytes / bandwidth,
                fitted to ping-pongs of 4 KiB .. 4 MiB
    sharing     how much slower a pass runs when k ranks compute at once (k = 1..devices): 1.0
                each on separate accelerators, about k / cores when k processes share fewer cores

The file is JSON (``Profile.save`` / ``Profile.load``) and says which model, at which size, it is.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pipefold.errors import ConfigError

if TYPE_CHECKING:  # measuring needs torch; reading a profile does not (the planner loads without it)
    import torch

__all__ = ["LayerProfile", "Profile", "measure_contention", "measure_layers", "measure_link", "profile_model"]

VERSION = 1
_LINK_SIZES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)

Progress = Callable[[str, int, int], None]
"""Called as ``progress(what, done, total)`` while measuring."""


@dataclass(frozen=True)
class LayerProfile:
    """One layer's costs for one microbatch."""

    f: float
    """Forward seconds."""
    b: float
    """Input-gradient seconds."""
    w: float
    """Weight-gradient seconds."""
    held: int
    """Bytes held from the end of F until the backward: its input and what it saved."""
    held_w: int
    """Bytes held from the end of B until W: what W reads."""
    params: int
    """Parameter bytes."""
    out: int
    """Bytes of its output: what a stage ending with this layer sends (and gets back as a gradient)."""


@dataclass(frozen=True)
class Profile:
    """A model measured on one machine at one microbatch size; the planner's input."""

    train: dict[str, Any]
    """The model and its size as ``pipefold train`` takes them: model, layers, hidden, heads, seq, batch,
    microbatches, optimizer, seed."""
    layers: tuple[LayerProfile, ...]
    latency: float
    """Seconds of a message of no bytes between two ranks."""
    bandwidth: float
    """Bytes per second between two ranks."""
    contention: tuple[float, ...]
    """``contention[k-1]``: how many times longer a pass takes while k ranks compute at once."""
    optimizer_factor: float
    """Optimizer state per parameter, in parameter sizes (AdamW 2, SGD 0)."""
    machine: dict[str, Any] = field(default_factory=dict)
    """Where and when it was measured: host, cores, torch version, device, date, repeats."""

    @property
    def microbatch_rows(self) -> int:
        return int(self.train["batch"]) // int(self.train["microbatches"])

    def static(self, layer: int) -> int:
        """Bytes a layer holds whatever the schedule: weights, gradients, optimizer state."""
        return int(self.layers[layer].params * (2 + self.optimizer_factor))

    def to_dict(self) -> dict[str, Any]:
        return {"version": VERSION, "train": dict(self.train), "layers": [asdict(x) for x in self.layers],
                "link": {"latency": self.latency, "bandwidth": self.bandwidth},
                "contention": list(self.contention), "optimizer_factor": self.optimizer_factor,
                "machine": dict(self.machine)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "the profile") -> Profile:
        """Read :meth:`to_dict`'s form; anything else is one ConfigError naming what is wrong."""
        try:
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ConfigError(f"{where} is not a pipefold profile (version {VERSION}): "
                                  f"make one with pipefold profile -o FILE")
            layers = tuple(LayerProfile(f=float(row["f"]), b=float(row["b"]), w=float(row["w"]), held=int(row["held"]),
                                        held_w=int(row["held_w"]), params=int(row["params"]), out=int(row["out"]))
                           for row in data["layers"])
            link = data["link"]
            out = cls(train=dict(data["train"]), layers=layers, latency=float(link["latency"]),
                      bandwidth=float(link["bandwidth"]), contention=tuple(float(x) for x in data["contention"]),
                      optimizer_factor=float(data["optimizer_factor"]), machine=dict(data.get("machine", {})))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{where} is not a valid pipefold profile ({type(exc).__name__}: {exc}); "
                              f"make one with pipefold profile -o FILE") from None
        out.check(where)
        return out

    def check(self, where: str = "the profile") -> None:
        if not self.layers:
            raise ConfigError(f"{where} has no layers")
        for i, x in enumerate(self.layers):
            values = (x.f, x.b, x.w, x.held, x.held_w, x.params, x.out)
            if not all(math.isfinite(v) and v >= 0 for v in values):
                raise ConfigError(f"{where}: layer {i} has a negative or non-finite figure: {x}")
        if not (math.isfinite(self.latency) and self.latency >= 0 and self.bandwidth > 0):
            raise ConfigError(f"{where}: the link needs latency >= 0 and bandwidth > 0 "
                              f"(got {self.latency}, {self.bandwidth})")
        if not self.contention or not all(math.isfinite(c) and c > 0 for c in self.contention):
            raise ConfigError(f"{where}: contention factors must be positive numbers (got {self.contention})")
        for key in ("model", "batch", "microbatches"):
            if key not in self.train:
                raise ConfigError(f"{where} does not say its model's {key}")

    def save(self, path: str) -> None:
        from pipefold.files import write_json

        write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str) -> Profile:
        from pipefold.files import read_json

        return cls.from_dict(read_json(path, "profile", "give a file written by pipefold profile -o"), path)


# --------------------------------------------------------------------------- layers


def measure_layers(layers: Sequence[torch.nn.Module], sample: Any, target: Any,
                   loss_fn: Callable[..., torch.Tensor], *, microbatches: int = 1, repeats: int = 7,
                   progress: Progress | None = None) -> list[LayerProfile]:
    """Each layer as a stage of its own on the runtime's stage runner, fed the previous layer's output.

    Times are medians of ``repeats`` runs after a warm-up; layers that are the same computation
    (type, parameter shapes, input shapes) share their mean, so timing noise does not tell equal
    blocks apart. Bytes come from :func:`pipefold.plan.partition.layer_memory` (the runtime's meter).
    """
    from pipefold.plan.partition import layer_memory
    from pipefold.runtime.stage import Chain, StageRunner, ones_for

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer (got {repeats!r})")
    held = layer_memory(layers, sample, loss_fn=loss_fn, target=target)
    x: tuple[torch.Tensor, ...] = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
    last = len(layers) - 1
    times: list[tuple[float, float, float]] = []
    outs: list[int] = []
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for i, layer in enumerate(layers):
        if progress is not None:
            progress("layers", i, len(layers))
        same = (type(layer).__qualname__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()),
                tuple(tuple(t.shape) for t in x), i == last, i == 0)
        kinds.setdefault(same, []).append(i)
        loss = loss_fn if i == last else None
        runner = StageRunner(Chain(layer), loss_fn=loss, input_grads=i > 0)
        runs = []
        out: tuple[torch.Tensor, ...] = ()
        for k in range(repeats + 1):
            t0 = time.perf_counter()
            out = runner.forward(k, x, target if loss is not None else None, scale=1.0 / microbatches)
            t1 = time.perf_counter()
            runner.backward_input(k, None if loss is not None else ones_for(out))
            t2 = time.perf_counter()
            runner.backward_weight(k)
            runs.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        layer.zero_grad(set_to_none=True)
        f, b, w = (statistics.median(v) for v in zip(*runs[1:], strict=True))
        times.append((f, b, w))
        outs.append(0 if loss is not None else sum(t.untyped_storage().nbytes() for t in out
                                                  if t.is_floating_point()))
        x = tuple(t.detach() for t in out)
    if progress is not None:
        progress("layers", len(layers), len(layers))
    for group in kinds.values():
        mean = tuple(statistics.fmean(times[i][j] for i in group) for j in range(3))
        for i in group:
            times[i] = mean  # type: ignore[assignment]
    return [LayerProfile(f=t[0], b=t[1], w=t[2], held=int(h), held_w=int(hw),
                         params=sum(p.numel() * p.element_size() for p in layer.parameters()), out=o)
            for t, (h, hw), layer, o in zip(times, held, layers, outs, strict=True)]


# --------------------------------------------------------------------------- the link


def _ping(rank: int, port: int, sizes: Sequence[int], rounds: int, out: Any,
          work: tuple[dict[str, Any], tuple[int, int]] | None = None) -> None:
    """One end of the ping-pong; with ``work``, this process also computes that layer in another thread meanwhile,
    as a rank computes while its messages travel."""
    import threading

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    stop = threading.Event()
    busy = None
    if work is not None:
        once = _layer_loop(*work)

        def compute() -> None:
            k = 0
            while not stop.is_set():
                once(k)
                k += 1

        busy = threading.Thread(target=compute, daemon=True)
        busy.start()
    try:
        result = {}
        for size in sizes:
            buf = torch.zeros(size // 4, dtype=torch.float32)
            trips = []
            for k in range(rounds + 2):
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if k >= 2:  # two warm-ups: connection setup and first allocations
                    trips.append(time.perf_counter() - t0)
            result[size] = statistics.fmean(trips) / 2  # the mean: a transfer that waits for a core counts
        stop.set()
        if busy is not None:
            busy.join()
        if rank == 0:
            out.put(result)
        dist.barrier()
    finally:
        stop.set()
        dist.destroy_process_group()


def measure_link(rounds: int = 20, sizes: Sequence[int] = _LINK_SIZES,
                 load: tuple[dict[str, Any], tuple[int, int], int] | None = None) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) of a gloo link between two local processes: half the mean round trip
    of each size, fitted by least squares to latency + bytes / bandwidth.

    With ``load = (train, (first, end), n)`` the two ends compute those layers of the model in another thread meanwhile,
    and n more processes run it too, as the ranks of a run do: where ranks share cores, a message then waits
    for a core (for gloo's threads at both ends, for the receiver to wake up), and that wait is part of what a
    transfer costs.
    """
    import torch.multiprocessing as mp

    from pipefold.runtime.launch import free_port, process_context, starting, stopped_on_error

    ctx = process_context()
    out = ctx.SimpleQueue()
    helpers: list[Any] = []
    pingers: list[Any] = []
    stop = ctx.Event()
    work = None if load is None else (load[0], load[1])
    with stopped_on_error(helpers), stopped_on_error(pingers):
        if load is not None and load[2] > 0:
            train, layer, n = load
            ready = ctx.Barrier(n + 1)
            helpers += [ctx.Process(target=_load, args=(train, layer, ready, stop)) for _ in range(n)]
            with starting():
                for h in helpers:
                    h.start()
            ready.wait()
        try:
            with starting():
                pings = mp.start_processes(_ping, args=(free_port(), tuple(sizes), rounds, out, work), nprocs=2,
                                           start_method=ctx.get_start_method(), join=False)
                pingers += pings.processes
            while not pings.join():
                pass
            one_way: dict[int, float] = out.get()
        finally:
            stop.set()
            for h in helpers:
                h.join()
    return fit_link(one_way)


def fit_link(one_way: dict[int, float]) -> tuple[float, float]:
    """Least-squares fit of seconds = latency + bytes / bandwidth; latency floored at 0."""
    xs, ys = list(one_way), [one_way[s] for s in one_way]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    if slope <= 0:
        return max(my, 0.0), math.inf
    return max(my - slope * mx, 0.0), 1.0 / slope


# --------------------------------------------------------------------------- sharing the machine


def _layer_loop(train: dict[str, Any], layers: tuple[int, int]) -> Callable[[int], None]:
    """A function running layers ``layers[0]..layers[1]-1`` of the model (a stage's worth) forward and backward on
    one microbatch (one thread)."""
    import torch

    from pipefold.runtime.stage import Chain, StageRunner, ones_for, split_batch
    from pipefold.train.run import TrainConfig, model_of

    torch.set_num_threads(1)
    config = TrainConfig(model=train["model"], layers=train.get("layers"), hidden=train.get("hidden"),
                         heads=train.get("heads"), model_config=train.get("model_config"), seq=train["seq"],
                         batch=train["batch"], microbatches=train["microbatches"], seed=train["seed"])
    model = model_of(config)
    first, end = layers
    built = model.build_layers(range(end))
    with torch.no_grad():  # the stage's input: the layers before it run once
        xs = split_batch(model.batch_at(0)[0], config.microbatches)[0]
        for i in range(first):
            y = Chain(built[i])(*xs)
            xs = y if isinstance(y, tuple) else (y,)
    runner = StageRunner(Chain(*(built[i] for i in range(first, end))), input_grads=first > 0)

    def once(k: int) -> None:
        outs = runner.forward(k, xs)
        runner.backward(k, ones_for(outs))

    for k in range(2):  # warm-up
        once(k)
    return once


def _sharer(train: dict[str, Any], layers: tuple[int, int], conn: Any) -> None:
    """One of the processes sharing the machine: build the layers once, then for each window it is sent (a start on
    the monotonic clock every process reads, and a length), run them from that start for that long and send back
    the time per pass over the window. None ends it."""
    once = _layer_loop(train, layers)
    conn.send("ready")
    while (window := conn.recv()) is not None:
        start, seconds = window
        time.sleep(max(0.0, start - time.monotonic()))
        t0 = time.monotonic()
        laps = 0
        while time.monotonic() - t0 < seconds:  # every process runs the same window, all of it shared
            once(laps)
            laps += 1
        conn.send((time.monotonic() - t0) / laps)


def _load(train: dict[str, Any], layers: tuple[int, int], ready: Any, stop: Any) -> None:
    """Background work while the link is measured: the layers, again and again, until told to stop."""
    once = _layer_loop(train, layers)
    ready.wait()
    k = 0
    while not stop.is_set():
        once(k)
        k += 1


def measure_contention(devices: int, train: dict[str, Any], layers: tuple[int, int], seconds: float = 1.0,
                       rounds: int = 3, laps: int = 40) -> tuple[float, ...]:
    """For k = 1..devices: the time of a stage's worth of layers (forward and backward) while k processes run it at
    once, over the time with one (one thread each, as the runtime's ranks); the median over ``rounds`` rounds of
    k = 1..devices.

    Each process runs the same window and its throughput over the window counts, not single passes: the
    operating system shares cores in slices of milliseconds, so a single pass often runs alone and only the
    throughput shows the sharing. A window is ``laps`` passes of one process alone (at least 0.2 s, at most
    ``seconds``): hundreds of the scheduler's slices. The ``devices`` processes are started once and build the
    layers once; those not in a window wait without computing.
    """
    from multiprocessing.connection import Connection, wait

    from pipefold.runtime.launch import process_context, starting, stopped_on_error

    ctx = process_context()  # as the runtime starts its ranks: from a fork server that has imported torch
    pipes = [ctx.Pipe() for _ in range(devices)]
    procs = [ctx.Process(target=_sharer, args=(train, layers, child)) for _, child in pipes]
    conns = [parent for parent, _ in pipes]

    def answers(ask: list[Connection]) -> list[Any]:
        """One answer from each of ``ask``; a process that ended instead is an error, not a wait forever."""
        got: dict[Connection, Any] = {}
        sentinels = {p.sentinel: p for p in procs}
        while len(got) < len(ask):
            for ready in wait([c for c in ask if c not in got] + list(sentinels)):
                if ready in sentinels:
                    raise RuntimeError(f"a process measuring how ranks share the cores ended "
                                       f"(exit code {sentinels[ready].exitcode})")
                conn = next(c for c in ask if c is ready)
                got[conn] = conn.recv()
        return [got[c] for c in ask]

    def window(k: int, length: float) -> float:
        start = time.monotonic() + 0.02
        for c in conns[:k]:
            c.send((start, length))
        return statistics.fmean(answers(conns[:k]))

    with stopped_on_error(procs):
        with starting():
            for p in procs:
                p.start()
        answers(conns)
        alone = window(1, 0.2)
        length = min(seconds, max(0.2, laps * alone))
        ratios: list[list[float]] = [[] for _ in range(devices)]
        for _ in range(rounds):
            means = [window(k, length) for k in range(1, devices + 1)]
            for k in range(devices):
                ratios[k].append(means[k] / means[0])
        for c in conns:
            c.send(None)
        for p in procs:
            p.join()
    return tuple(max(1.0, statistics.median(r)) for r in ratios)


# --------------------------------------------------------------------------- the whole profile


def profile_model(*, model: str = "gpt", layers: int | None = None, hidden: int | None = None,
                  heads: int | None = None, model_config: str | None = None, seq: int = 64,
                  batch: int = 16, microbatches: int = 8, optimizer: str = "adamw", seed: int = 0,
                  devices: int = 4, repeats: int = 7, link: bool = True, contention: bool = True,
                  progress: Progress | None = None) -> Profile:
    """Measure ``model`` at this size on this machine (see the module's docstring).

    Without ``link`` the link is free (latency 0, infinite bandwidth); without ``contention``
    every rank has a device of its own (factor 1 for any k). ``layers``, ``hidden`` and ``heads`` None: the model's
    defaults; ``model_config``: a Hugging Face model's config.
    """
    import torch

    from pipefold.models.size import check_model
    from pipefold.plan.recompute import OPTIMIZER_STATE
    from pipefold.runtime.stage import split_batch
    from pipefold.train.run import TrainConfig, model_of

    if batch % microbatches:
        raise ConfigError(f"a batch of {batch} does not split into {microbatches} microbatches; "
                          f"use a --batch that is a multiple of {microbatches}")
    if optimizer not in OPTIMIZER_STATE:
        raise ConfigError(f"unknown optimizer {optimizer!r}: use {' or '.join(OPTIMIZER_STATE)}")
    config = TrainConfig(model=model, layers=layers, hidden=hidden, heads=heads, model_config=model_config, seq=seq,
                         batch=batch, microbatches=microbatches, optimizer=optimizer, seed=seed, devices=devices)
    built = model_of(config)
    # The whole model here and, to measure how ranks share the cores, a stage's worth on each of the devices.
    check_model(built, microbatches=microbatches, ranks=devices if contention else 0, copies=2,
                what=f"profiling {model}")
    x, y = built.batch_at(0)
    measured = measure_layers(built.build(), split_batch(x, microbatches)[0], y.chunk(microbatches)[0], built.loss,
                              microbatches=microbatches, repeats=repeats, progress=progress)
    train = {"model": model, "layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "batch": batch,
             "microbatches": microbatches, "optimizer": optimizer, "seed": seed}
    if model_config is not None:
        train["model_config"] = model_config
    # A stage's worth of layers from the heaviest one (a transformer block, not the embedding) stands for a rank's
    # work: its weights and activations, not one layer's, are what the ranks' caches and memory bus share.
    heaviest = max(range(len(measured) - 1), key=lambda i: measured[i].f + measured[i].b + measured[i].w)
    chunk = (heaviest, min(len(measured) - 1, heaviest + max(1, len(measured) // devices)))
    factors: tuple[float, ...] = (1.0,) * devices
    if contention:
        if progress is not None:
            progress("sharing", 0, 1)
        factors = measure_contention(devices, train, chunk)
        if progress is not None:
            progress("sharing", 1, 1)
    latency, bandwidth = 0.0, math.inf
    if link:
        if progress is not None:
            progress("link", 0, 1)
        # Where ranks share cores, the other ranks compute while two of them talk.
        latency, bandwidth = measure_link(load=(train, chunk, max(0, devices - 2)) if contention else None)
        if progress is not None:
            progress("link", 1, 1)
    machine = {"host": platform.node(), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
               "device": "cpu", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": repeats}
    return Profile(train=train, layers=tuple(measured), latency=latency,
                   bandwidth=bandwidth if math.isfinite(bandwidth) else 1e30, contention=factors,
                   optimizer_factor=OPTIMIZER_STATE[optimizer], machine=machine)

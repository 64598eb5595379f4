"""A DLRM trained with Bagpipe on this machine: trainers and an embedding server, each a process of its own
(:mod:`pipefold.runtime.bagpipe`), what ``pipefold bagpipe`` and the benchmark run."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipefold.errors import ConfigError
from pipefold.models.dlrm import DLRM, DLRMConfig, dlrm_batch, dlrm_loss, init_tables
from pipefold.plan.bagpipe import CacheStats, Round, make_cacher, plan_rounds, stats
from pipefold.runtime.bagpipe import EmbeddingServer, RemoteEmbeddings
from pipefold.runtime.launch.processes import process_context, rendezvous, starting, stopped_on_error
from pipefold.sim.network import Network
from pipefold.units import format_bytes

__all__ = ["BagpipeJob", "BagpipeResult", "run_bagpipe", "run_bagpipe_netns"]


@dataclass(frozen=True, kw_only=True)
class BagpipeJob:
    """A DLRM trained by trainers whose tables an embedding server holds."""

    model: DLRMConfig = field(default_factory=DLRMConfig)
    """The model, its tables and its data."""
    steps: int = 20
    """Training steps."""
    policy: str = "oracle"
    """The cache policy: oracle, lru or none (:data:`pipefold.plan.bagpipe.POLICIES`)."""
    cache: int = 200
    """Rows each trainer caches (with ``none``: the rows it may hold, one step's)."""
    lookahead: int = 8
    """Batches the oracle reads ahead of each step (at most ``steps``: the data there is)."""
    ahead: int = 1
    """Steps ahead of its step that a round runs (0 with ``none``)."""
    trainers: int = 1
    """Data-parallel trainers, each computing an equal share of every batch's samples."""
    lr: float = 0.1
    """SGD's learning rate, for the MLPs and the rows."""
    server_memory: int | None = None
    """Bytes the server may hold its tables in (None: no limit)."""
    network: Network | None = None
    """The emulated link between each trainer and the server (None: the machine's own)."""
    netns: Any = None
    """The network namespaces the processes run in (a :class:`~pipefold.runtime.launch.netns.Topology` of
    ``trainers + 1`` ranks, the server last; None: this machine's own network). :func:`run_bagpipe_netns` makes
    one."""
    snapshots: bool = False
    """Report every row and the MLPs' weights after every step (the tests)."""

    def __post_init__(self) -> None:
        cfg = self.model
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(f"a run has 1 or more steps (got {self.steps!r})")
        if self.policy == "none":
            object.__setattr__(self, "ahead", 0)
        if self.policy == "oracle" and self.lookahead > self.steps:
            raise ConfigError(f"a lookahead of {self.lookahead} batches is more than the {self.steps} steps of data: "
                              f"give --lookahead {self.steps} or less")
        if isinstance(self.trainers, bool) or not isinstance(self.trainers, int) or self.trainers < 1 or \
                cfg.batch % self.trainers:
            raise ConfigError(f"{self.trainers!r} trainers cannot share {cfg.batch} samples per step equally: give "
                              "a number of trainers that divides the batch")
        if self.cache > cfg.keys:
            raise ConfigError(f"a cache of {self.cache} rows is larger than the tables' {cfg.keys} rows: give a "
                              "smaller cache")
        table = cfg.keys * cfg.dim * 4
        if self.server_memory is not None and table > self.server_memory:
            raise ConfigError(f"the tables take {format_bytes(table)} and the server holds "
                              f"{format_bytes(self.server_memory)}: give the server more memory or smaller tables")
        if table > (machine := _machine_memory()) // 2:
            raise ConfigError(f"the tables take {format_bytes(table)}, more than half this machine's "
                              f"{format_bytes(machine)} of memory, where the server holds them: give smaller tables")
        if not self.lr > 0:
            raise ConfigError(f"the learning rate is above 0 (got {self.lr!r})")
        make_cacher(self.policy, self.cache, lookahead=self.lookahead, ahead=self.ahead)  # its own checks

    def keys_at(self, step: int) -> list[int]:
        """Every key step ``step`` uses (all trainers' samples)."""
        return dlrm_batch(self.model, step).keys(self.model.rows).reshape(-1).tolist()

    def plan(self) -> list[Round]:
        """The rounds every trainer will carry out (refused in one line where the cache cannot hold them)."""
        cacher = make_cacher(self.policy, self.cache, lookahead=self.lookahead, ahead=self.ahead)
        return plan_rounds(cacher, [self.keys_at(s) for s in range(self.steps)])


def _machine_memory() -> int:
    """Bytes of this machine's physical memory."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass
class BagpipeResult:
    """What a job measured."""

    step_times: list[float]
    """Seconds of each step on the first trainer (its rows gathered to its update done)."""
    losses: list[float]
    """The whole batch's loss at each step."""
    waited: float
    """Seconds the first trainer's steps waited for their rounds."""
    predicted: CacheStats
    """What the plan said the rounds would move."""
    fetched: list[int]
    """Rows the server counted as sent to each trainer."""
    written: list[int]
    """Rows the server counted as written back by each trainer (the final write-back included)."""
    final_writes: int
    """Rows the first trainer wrote back when it closed."""
    snapshots: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    """Per trainer, per step: (every row, the MLPs' weights flattened), where the job asked for them."""
    link_bytes: list[int] = field(default_factory=list)
    """Over network namespaces: the bytes each process's interface sent, as tc counted them (trainers first,
    the server last); empty otherwise."""


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _rank(rank: int, init: str, job: BagpipeJob, out: Any) -> None:
    """Trainer ``rank`` of the job, or the server (the last rank)."""
    cfg, n = job.model, job.trainers
    if job.netns is not None:
        from pipefold.runtime.launch.netns import enter

        enter(job.netns, rank)  # before any socket: the group's connections cross the namespaces' capped links
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=n + 1)
    group = dist.new_group(list(range(n))) if n > 1 else None  # every rank makes it, the server too
    try:
        if rank == n:
            server = EmbeddingServer(init_tables(cfg), range(n))
            server.serve()
            return
        batches = [dlrm_batch(cfg, s) for s in range(job.steps)]  # the data loader's, read ahead
        model = DLRM(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=job.lr)
        cacher = make_cacher(job.policy, job.cache, lookahead=job.lookahead, ahead=job.ahead)
        emb = RemoteEmbeddings(server=n, keys=cfg.keys, dim=cfg.dim, steps=job.steps,
                               keys_at=lambda s: batches[s].keys(cfg.rows).reshape(-1).tolist(), cacher=cacher,
                               lr=job.lr, writer=rank == 0, group=group, network=job.network, link=(rank, n))
        times, losses, snaps = [], [], []
        for s in range(job.steps):
            start = time.perf_counter()
            mine = batches[s].part(rank, n)
            rows = emb.gather(s, mine.keys(cfg.rows))  # (T, b, D)
            loss = dlrm_loss(model(mine.dense, rows), mine.labels, cfg.batch)
            opt.zero_grad()
            loss.backward()
            total = loss.detach().clone()
            if group is not None:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                flat = torch.cat([g.reshape(-1) for g in grads] + [total.reshape(1)])
                dist.all_reduce(flat, group=group)
                torch.nn.utils.vector_to_parameters(flat[:-1], grads)
                total = flat[-1]
            opt.step()
            emb.step()
            times.append(time.perf_counter() - start)
            losses.append(float(total))
            if job.snapshots:
                snaps.append((emb.snapshot().numpy(), _flat(model).numpy()))  # by value, not a shared fd
        final = emb.held if rank == 0 else 0
        fetched, written = emb.close()
        out.put({"rank": rank, "times": times, "losses": losses, "waited": emb.waited, "fetched": fetched,
                 "written": written, "final": final, "snapshots": snaps})
    finally:
        dist.destroy_process_group()


def run_bagpipe(job: BagpipeJob, *, timeout: float = 600.0) -> BagpipeResult:
    """Run ``job`` on this machine: its trainers and its server, each a process of its own."""
    import torch.multiprocessing as mp

    predicted = stats(job.plan())  # refused here, in one line, before any process starts
    ctx = process_context()
    out = ctx.SimpleQueue()
    got: list[dict[str, Any]] = []
    processes: list[Any] = []
    with rendezvous() as init, stopped_on_error(processes):
        with starting():
            procs = mp.start_processes(_rank, args=(init, job, out), nprocs=job.trainers + 1,
                                       start_method=ctx.get_start_method(), join=False)
            processes += procs.processes
        deadline = time.monotonic() + timeout
        while not procs.join(timeout=0.05):
            while not out.empty():
                got.append(out.get())
            if time.monotonic() > deadline:
                raise TimeoutError(f"the bagpipe job was still running after {timeout:g} s")
    while not out.empty():
        got.append(out.get())
    got.sort(key=lambda r: r["rank"])
    first = got[0]
    return BagpipeResult(step_times=first["times"], losses=first["losses"], waited=first["waited"],
                         predicted=predicted, fetched=[r["fetched"] for r in got],
                         written=[r["written"] for r in got], final_writes=first["final"],
                         snapshots=[[(torch.from_numpy(a), torch.from_numpy(b)) for a, b in r["snapshots"]]
                                    for r in got])


def run_bagpipe_netns(job: BagpipeJob, rate: float, *, timeout: float = 600.0) -> BagpipeResult:
    """Run ``job`` with the server and each trainer in a network namespace of its own, what each sends capped by tc
    at ``rate`` bytes per second (:mod:`pipefold.runtime.launch.netns`): the rows cross real veth links and a
    token bucket instead of the emulated ``network``. The result counts the bytes each interface sent."""
    from pipefold.runtime.launch import netns

    reason = netns.unavailable()
    if reason is not None:
        raise ConfigError(f"--netns cannot run here: {reason}; use --network alone to emulate the link in-process")
    with netns.namespaces(job.trainers + 1, rate) as topology:
        result = run_bagpipe(dataclasses.replace(job, netns=topology, network=None), timeout=timeout)
        result.link_bytes = [netns.sent_bytes(topology, r) for r in range(topology.ranks)]
    return result

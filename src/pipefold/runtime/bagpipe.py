"""Bagpipe's runtime: embedding tables held by a server process, trainers that cache their rows ahead of the steps.

The server (:class:`EmbeddingServer`) owns every row. A trainer (:class:`RemoteEmbeddings`) holds a cache of rows and
carries out the rounds a cacher (:mod:`pipefold.plan.bagpipe`) plans from the batches it reads ahead: a background
thread writes the round's evicted rows back and fetches its misses while the steps before it compute, so a step
finds its rows cached and waits only for what the round has not yet brought::

    main thread:   | step s-1 (rows cached) | step s           | step s+1 |
    worker:            | round s+1: write back, fetch | round s+2 ... |      (ahead = 1)

The trainer updates its cached rows itself (plain SGD on the rows a step used) and writes a row back only when it
leaves the cache; :meth:`RemoteEmbeddings.close` writes back the rest. Consistency is strong, as if every step
fetched its rows and wrote them back: a round evicts no row a step still running or about to run uses (the
cacher's pinned rows), so an evicted row's value is final when it is written; one connection carries a trainer's
rounds in order and the server applies a round's writes before it answers its fetches, so a row fetched again
comes back with its last update.

Data-parallel trainers each hold the same cache: they plan from the same whole batches, each computes its share of
the samples, and the gradients of the step's rows are summed over the trainers (as the dense model's are) before
every trainer applies the same update. Only the first trainer writes rows back; the server answers the trainers'
requests in turn (the first's n-th request, then the second's...), so the first's write of a row reaches the
server before any later fetch of it by another.

With a :class:`~pipefold.sim.network.Network`, a round's rows arrive when its request and its reply would over the
emulated link: the request's bytes one way, then the reply's back, each on a :class:`~pipefold.sim.network.Wire` of
the link between the trainer and the server (on the wall clock from the trainer's start), so messages queue behind
each other's bytes and their latencies overlap, as on a real link. The worker goes on with the next round; the step
that needs the round waits until then. A round that neither evicts nor fetches sends nothing (every trainer skips
the same rounds: the server pairs their requests in order).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipefold.errors import ConfigError
from pipefold.plan.bagpipe import Cacher, Round
from pipefold.runtime.clock import wall
from pipefold.sim.network import Network, Wire

__all__ = ["EmbeddingServer", "RemoteEmbeddings"]

_ROUND, _SNAPSHOT, _STOP = 0, 1, 2
_HEAD = 3  # int64 words of a request's header: op, rows written, rows fetched


def _send(t: torch.Tensor, to: int) -> None:
    dist.send(t.contiguous(), to)


def _recv(shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    dist.recv(out, src)
    return out


class EmbeddingServer:
    """The tables' owner: answers its trainers' requests, each trainer's n-th request in turn, until all stop."""

    def __init__(self, tables: torch.Tensor, trainers: Iterable[int]) -> None:
        self.tables = tables
        """(keys, D) every table's rows."""
        self.trainers = list(trainers)
        self.fetched = dict.fromkeys(self.trainers, 0)
        """Rows sent to each trainer."""
        self.written = dict.fromkeys(self.trainers, 0)
        """Rows each trainer wrote back."""

    def serve(self) -> None:
        """Answer until every trainer has stopped."""
        running = list(self.trainers)
        while running:
            running = [t for t in running if self._answer(t)]

    def _answer(self, peer: int) -> bool:
        op, writes, fetches = _recv((_HEAD,), torch.int64, peer).tolist()
        if op == _STOP:
            _send(torch.tensor([self.fetched[peer], self.written[peer]]), peer)
            return False
        if op == _SNAPSHOT:
            _send(self.tables, peer)
            return True
        dim = self.tables.shape[1]
        if writes:  # before the fetches: a row written and fetched again comes back with its update
            ids = _recv((writes,), torch.int64, peer)
            self.tables[ids] = _recv((writes, dim), torch.float32, peer)
            self.written[peer] += writes
        if fetches:
            ids = _recv((fetches,), torch.int64, peer)
            _send(self.tables[ids], peer)
            self.fetched[peer] += fetches
        return True


@dataclass
class _Ready:
    """A round carried out: its plan, and its step's rows (sorted keys) with their slots in the cache."""

    round: Round
    keys: torch.Tensor
    slots: torch.Tensor
    due: float
    """Wall-clock time its rows arrive over the emulated link (already, without one)."""


class RemoteEmbeddings:
    """A trainer's cache of rows of tables a server process holds, run by a cacher over batches it reads ahead.

    In a training loop, step by step in order::

        rows = emb.gather(step, keys)   # (*keys.shape, D), part of autograd's graph
        loss = ...; loss.backward()
        emb.step()                      # SGD on the rows the step used (summed over ``group`` first)

    ``keys_at(s)`` gives every key step ``s`` uses (the whole batch's, where data-parallel trainers share it);
    ``keys`` of :meth:`gather` are this trainer's, all among them. :meth:`close` writes the cache back and says
    what the server counted.
    """

    def __init__(self, *, server: int, keys: int, dim: int, steps: int, keys_at: Callable[[int], Iterable[int]],
                 cacher: Cacher, lr: float, writer: bool = True, group: Any = None,
                 network: Network | None = None, link: tuple[int, int] = (0, 1)) -> None:
        self.server, self.keys, self.dim, self.steps, self.lr = server, keys, dim, steps, lr
        self.cacher, self.writer, self.group = cacher, writer, group
        self._keys_at = keys_at
        self._batches: dict[int, frozenset[int]] = {}
        self._cache = torch.zeros(cacher.capacity, dim)
        self._slot: dict[int, int] = {}
        self._free = list(reversed(range(cacher.capacity)))
        self._link = None if network is None else (Wire(network.conditions(*link)),
                                                    Wire(network.conditions(link[1], link[0])))
        self._origin = wall()
        self._jobs: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._ready: dict[int, _Ready] = {}
        self._answers: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._submitted = 0
        self._step = 0
        self._rows: torch.Tensor | None = None
        self._current: _Ready | None = None
        self.rounds: list[Round] = []
        """The rounds carried out, in order."""
        self.waited = 0.0
        """Seconds the steps waited for their rounds."""
        self._worker = threading.Thread(target=self._work, name="bagpipe-rounds", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------------------------------------- the steps

    def gather(self, step: int, keys: torch.Tensor) -> torch.Tensor:
        """The rows of ``keys`` (int64, any shape) for step ``step``, from the cache once the step's round is done;
        the rounds up to ``ahead`` steps later start now."""
        if step != self._step or self._current is not None:
            raise ConfigError(f"steps gather their rows in order, each once, with step() after each: expected step "
                              f"{self._step}, got {step}")
        if not 0 <= step < self.steps:
            raise ConfigError(f"step {step} is outside the {self.steps} steps the embeddings were planned for")
        while self._submitted <= min(step + self.cacher.ahead, self.steps - 1):
            self._jobs.put(("round", self._submitted))
            self._submitted += 1
        start = time.perf_counter()
        ready = self._wait(lambda: self._ready.pop(step, None))
        while (delay := ready.due - wall()) > 0:
            time.sleep(delay)
        self.waited += time.perf_counter() - start
        flat = keys.reshape(-1)
        pos = torch.searchsorted(ready.keys, flat).clamp(max=len(ready.keys) - 1)
        if not torch.equal(ready.keys[pos], flat):
            with self._cond:
                self._ready[step] = ready  # the step may gather again
            raise ConfigError(f"step {step} asks for rows its batch (keys_at) does not name")
        self._current = ready
        self._rows = self._cache[ready.slots].requires_grad_(True)  # (n, D): a copy, a leaf of its own
        return self._rows[pos].reshape(*keys.shape, self.dim)

    def step(self) -> None:
        """Apply SGD to the step's rows in the cache: each row minus ``lr`` times its gradient (summed over the
        data-parallel ``group`` first)."""
        if self._current is None or self._rows is None:
            raise ConfigError("step() comes after gather() of the step")
        grad = self._rows.grad if self._rows.grad is not None else torch.zeros_like(self._rows)
        if self.group is not None:
            dist.all_reduce(grad, group=self.group)
        with torch.no_grad():
            rows = self._rows.detach().clone()
            rows.add_(grad, alpha=-self.lr)  # as torch.optim.SGD steps a parameter
            self._cache[self._current.slots] = rows
        self._rows, self._current = None, None
        self._step += 1

    @property
    def held(self) -> int:
        """Rows in the cache now."""
        return len(self._slot)

    def snapshot(self) -> torch.Tensor:
        """(keys, D) every row's latest value: the server's tables with the cached rows over them."""
        self._jobs.put(("snapshot", 0))
        answer: torch.Tensor = self._wait(lambda: self._answers.pop("snapshot", None))
        return answer

    def close(self) -> tuple[int, int]:
        """Write every cached row back (the first trainer), stop, and return the rows the server counted as sent to
        this trainer and written back by it."""
        self._jobs.put(("stop", 0))
        counts: tuple[int, int] = self._wait(lambda: self._answers.pop("stop", None))
        self._worker.join()
        return counts

    def _wait(self, take: Callable[[], Any]) -> Any:
        with self._cond:
            while (got := take()) is None:
                if self._error is not None:
                    raise RuntimeError(f"the embeddings' worker failed: {self._error}") from self._error
                self._cond.wait()
            return got

    # ------------------------------------------------------------------------------------------------- the worker

    def _batch(self, s: int) -> frozenset[int]:
        if s not in self._batches:
            self._batches[s] = frozenset(self._keys_at(s))
            self._batches.pop(s - self.cacher.lookahead - self.cacher.ahead - 2, None)
        return self._batches[s]

    def _work(self) -> None:
        try:
            while True:
                what, s = self._jobs.get()
                if what == "round":
                    ready = self._round(s)
                    with self._cond:
                        self._ready[s] = ready
                        self._cond.notify_all()
                    continue
                answer: Any = self._snapshot() if what == "snapshot" else self._stop()
                with self._cond:
                    self._answers[what] = answer
                    self._cond.notify_all()
                if what == "stop":
                    return
        except BaseException as exc:  # the main thread raises it where it waits
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _round(self, s: int) -> _Ready:
        need = self._batch(s)
        future = [self._batch(t) for t in range(s + 1, min(self.steps, s + 1 + self.cacher.lookahead))]
        plan = self.cacher.plan(need, future)
        self.rounds.append(plan)
        gone = [self._slot.pop(k) for k in plan.evict]
        written = self._cache[gone] if gone else self._cache[:0]  # final values: no running step uses them
        self._free += gone
        slots = [self._free.pop() for _ in plan.fetch]
        due = wall()
        fetched = self._cache[:0]
        if plan.evict or plan.fetch:
            fetched, due = self._exchange(_ROUND, plan.evict if self.writer else (), written, plan.fetch)
        if plan.fetch:
            self._cache[slots] = fetched
        self._slot.update(zip(plan.fetch, slots, strict=True))
        keys = sorted(need)
        return _Ready(plan, torch.tensor(keys, dtype=torch.int64),
                      torch.tensor([self._slot[k] for k in keys], dtype=torch.int64), due)

    def _exchange(self, op: int, write: Sequence[int], rows: torch.Tensor, fetch: Sequence[int]
                  ) -> tuple[torch.Tensor, float]:
        """One request to the server and its reply: ``rows`` written to keys ``write``; the rows of ``fetch`` and
        the wall-clock time they arrive over the emulated link."""
        posted = wall()
        _send(torch.tensor([op, len(write), len(fetch)], dtype=torch.int64), self.server)
        if write:
            _send(torch.tensor(write, dtype=torch.int64), self.server)
            _send(rows, self.server)
        out = torch.empty(0, self.dim)
        if fetch:
            _send(torch.tensor(fetch, dtype=torch.int64), self.server)
            out = _recv((len(fetch), self.dim), torch.float32, self.server)
        if self._link is None:
            return out, wall()
        up, down = self._link
        request = 8 * (_HEAD + len(write) + len(fetch)) + 4 * self.dim * len(write)
        arrives = up.send(posted - self._origin, request)
        return out, self._origin + down.send(arrives, 4 * self.dim * len(fetch))

    def _snapshot(self) -> torch.Tensor:
        _send(torch.tensor([_SNAPSHOT, 0, 0], dtype=torch.int64), self.server)
        tables = _recv((self.keys, self.dim), torch.float32, self.server)
        if self._slot:
            keys = list(self._slot)
            tables[keys] = self._cache[[self._slot[k] for k in keys]]
        return tables

    def _stop(self) -> tuple[int, int]:
        keys = sorted(self._slot) if self.writer else []
        rows = self._cache[[self._slot[k] for k in keys]] if keys else self._cache[:0]
        if keys:
            self._exchange(_ROUND, keys, rows, ())
        _send(torch.tensor([_STOP, 0, 0], dtype=torch.int64), self.server)
        fetched, written = _recv((2,), torch.int64, self.server).tolist()
        return int(fetched), int(written)

"""One rank's side of a training step: run its action list, talk to its neighbours, record what happened.

The rank reads the schedule only through the IR: for each action in its list,

    F  (s, j)  input from stage s-1 (local, or received), run, send the output on to stage s+1
    B  (s, j)  gradient from stage s+1 (local, or received), input gradient only, send it to stage s-1
    W  (s, j)  weight gradient from what B kept
    BW (s, j)  both at once

Receives for the next few actions are posted before the current one runs, so
transfers overlap compute; sends are posted and reaped as they complete.
Gradients are scaled by 1/M on the loss, so after the step they equal the
gradients of the mean loss over the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefold.ir import Action, Kind, Schedule
from pipefold.runtime.comm import BACKWARD, FORWARD, Links, Meta, decode_header, metas_of
from pipefold.runtime.stage import MemoryMeter, StageRunner, Tensors

LOOKAHEAD = 3  # actions whose receives are posted ahead of time


@dataclass
class Event:
    """One interval of the measured timeline, in seconds from the step's start."""

    name: str
    kind: str
    start: float
    end: float


@dataclass
class StepStats:
    """What one rank measured during one step."""

    rank: int
    losses: dict[int, float] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    busy: float = 0.0
    wall: float = 0.0
    peak_activation_bytes: int = 0
    """The most bytes held at once: tensors saved for backward, outputs kept, gradients in transit."""
    peak_saved_bytes: int = 0
    """The most bytes held at once for backward alone (saved tensors and kept outputs), without transit."""
    started_at: float = 0.0
    """Wall-clock time (time.time()) of the step's start, to line ranks up in a trace."""
    stage_bytes: dict[int, int] = field(default_factory=dict)
    """Per stage of this rank, the bytes one microbatch's forward saved for backward."""


class RankExecutor:
    """Runs one rank's actions of ``schedule`` on its stage modules, step after step."""

    def __init__(self, schedule: Schedule, rank: int, modules: Mapping[int, nn.Module],
                 loss_fn: Callable[..., torch.Tensor], device: torch.device, *,
                 recompute: Mapping[int, int] | None = None) -> None:
        self.schedule, self.rank, self.device = schedule, rank, device
        self.meter = MemoryMeter()
        last = schedule.stages - 1
        recompute = recompute or {}
        self.runners = {
            s: StageRunner(m, loss_fn=loss_fn if s == last else None, meter=self.meter, recompute=recompute.get(s, 0))
            for s, m in modules.items()
        }
        self.actions = list(schedule.actions[rank])
        self.device_of = schedule.stage_to_device
        self.links = Links(schedule.stages, schedule.microbatches, device)
        self._in_meta: dict[int, tuple[Meta, ...]] = {}  # stage -> metas of its input, when received
        self._out_meta: dict[int, tuple[Meta, ...]] = {}  # stage -> metas of its output
        self._last_shape: Any = None
        self._headers_sent: set[int] = set()  # stages whose input header went out this step
        self._header_recvs: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # stage -> header receive in flight

    def parameters(self) -> list[nn.Parameter]:
        return [p for r in self.runners.values() for p in r.params]

    # -- one step

    def run_step(self, inputs: list[Tensors], targets: list[Any], shape_key: Any) -> StepStats:
        """Run every action of this rank for one batch of microbatches.

        ``inputs`` and ``targets`` are per microbatch (only the ranks holding
        the first and the last stage use them); ``shape_key`` is the same on
        every rank and changes when the batch's shapes do.
        """
        S, M = self.schedule.stages, self.schedule.microbatches
        new_shapes = shape_key != self._last_shape
        self._last_shape = shape_key
        if new_shapes:
            self._in_meta.clear()
            self._headers_sent.clear()
        self._header_recvs.clear()
        self._out_meta.clear()  # recorded afresh by this step's forwards
        stats = StepStats(self.rank)
        local: dict[tuple[int, int, int], Tensors] = {}  # (direction, stage, mb) -> tensors handed over locally
        posted: dict[int, _Pending] = {}  # action index -> its receive, posted ahead
        self.meter.reset_peak()
        peak = 0
        stats.started_at = time.time()
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        for idx, action in enumerate(self.actions):
            for ahead in range(idx, min(idx + LOOKAHEAD, len(self.actions))):
                if ahead not in posted:
                    pending = self._post_recv(self.actions[ahead])
                    if pending is not None:
                        posted[ahead] = pending
            s, mb = action.stage, action.microbatch
            runner = self.runners[s]
            if action.kind is Kind.F:
                x = inputs[mb] if s == 0 else self._take(FORWARD, action, idx, posted, local, clock, stats)
                start = clock()
                out = runner.forward(mb, x, targets[mb] if s == S - 1 else None, scale=1.0 / M)
                stats.events.append(Event(str(action), "F", start, clock()))
                if s < S - 1:
                    self._hand_on(FORWARD, s + 1, mb, out, local, new_shapes)
                else:
                    stats.losses[mb] = float(runner.losses.pop(mb))
            elif action.kind is Kind.W:
                start = clock()
                runner.backward_weight(mb)
                stats.events.append(Event(str(action), "W", start, clock()))
            else:
                dy = None if s == S - 1 else self._take(BACKWARD, action, idx, posted, local, clock, stats)
                start = clock()
                dx = runner.backward_input(mb, dy) if action.kind is Kind.B else runner.backward(mb, dy)
                stats.events.append(Event(str(action), action.kind.value, start, clock()))
                if s > 0 and dx is not None:
                    self._hand_on(BACKWARD, s - 1, mb, dx, local, new_shapes)
            self.links.reap_sends()
            # Activation memory: what the stages keep for backward (saved tensors and their outputs, which
            # forward sends and hand-overs share), plus gradients on their way to the previous stage.
            held = self.meter.current + self.links.bytes_in_flight(BACKWARD) + sum(
                t.untyped_storage().nbytes() for (d, _, _), ts in local.items() if d == BACKWARD for t in ts)
            peak = max(peak, held)
        start = clock()
        self.links.wait_sends()
        stats.events.append(Event("wait sends", "send", start, clock()))
        stats.wall = clock()
        stats.busy = sum(e.end - e.start for e in stats.events if e.kind in ("F", "B", "W", "BW"))
        stats.peak_activation_bytes = max(peak, self.meter.peak)
        stats.peak_saved_bytes = self.meter.peak
        stats.stage_bytes = {s: r.bytes_per_microbatch for s, r in self.runners.items()}
        return stats

    # -- moving tensors

    def _remote_source(self, direction: int, action: Action) -> int | None:
        """The rank that sends this action's input, or None when it is local (or there is none)."""
        s, S = action.stage, self.schedule.stages
        if direction == FORWARD and action.kind is Kind.F and s > 0:
            src = self.device_of[s - 1]
        elif direction == BACKWARD and action.kind in (Kind.B, Kind.BW) and s < S - 1:
            src = self.device_of[s + 1]
        else:
            return None
        return None if src == self.rank else src

    def _post_recv(self, action: Action) -> _Pending | None:
        s, mb = action.stage, action.microbatch
        if (src := self._remote_source(FORWARD, action)) is not None:
            if s in self._in_meta:
                return _Pending(*self.links.recv(FORWARD, s, mb, self._in_meta[s], src))
            if s not in self._header_recvs:
                # Shapes are new: the header comes first. Its receive is posted now; the data's once it is read.
                self._header_recvs[s] = self.links.post_header_recv(s, src)
            return None
        if (src := self._remote_source(BACKWARD, action)) is not None:
            if s not in self._out_meta:
                return None  # this stage has not sent anything on yet this step: post when it has
            # The gradient of what this stage sent on has the shapes of what it sent.
            metas = tuple(m for m in self._out_meta[s] if m.dtype.is_floating_point)
            return _Pending(*self.links.recv(BACKWARD, s, mb, metas, src))
        return None

    def _take(self, direction: int, action: Action, idx: int, posted: dict[int, _Pending],
              local: dict[tuple[int, int, int], Tensors], clock: Callable[[], float], stats: StepStats) -> Tensors:
        s, mb = action.stage, action.microbatch
        key = (direction, s, mb)
        if key in local:
            return local.pop(key)
        start = clock()
        if idx not in posted:
            if direction == FORWARD and s not in self._in_meta:
                work, header = self._header_recvs.pop(s)
                work.wait()
                self._in_meta[s] = decode_header(header)
            pending = self._post_recv(action)
            assert pending is not None
            posted[idx] = pending
        pending = posted.pop(idx)
        for w in pending.works:
            w.wait()
        stats.events.append(Event(f"recv {action}", "recv", start, clock()))
        return pending.tensors

    def _hand_on(self, direction: int, stage: int, mb: int, tensors: Tensors,
                 local: dict[tuple[int, int, int], Tensors], new_shapes: bool) -> None:
        """Give ``tensors`` to ``stage`` (the receiving stage): locally, or by a posted send."""
        if direction == FORWARD:
            self._out_meta[stage - 1] = metas_of(tensors)
        peer = self.device_of[stage]
        if peer == self.rank:
            local[(direction, stage, mb)] = tensors
            return
        if direction == FORWARD and new_shapes and stage not in self._headers_sent:
            self.links.send_header(stage, metas_of(tensors), peer)
            self._headers_sent.add(stage)
        self.links.send(direction, stage, mb, tensors, peer)


@dataclass
class _Pending:
    """A posted receive: its work handles and the buffers it fills."""

    works: list[dist.Work]
    tensors: Tensors

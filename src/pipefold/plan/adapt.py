"""Adaptive kFkB (Ada-Grouper): re-pick k as a shared network changes, under a memory budget.

kFkB groups k microbatches (k forwards, then k backwards), so that the transfers of
one group hide behind the computation of the next, at the price of about k times
the activations in flight. On a link that other jobs preempt, 1F1B (k = 1) stalls on
every transfer; on an idle one a larger k only lengthens the warm-up. So the best k
moves with the network.

Every ``every`` steps the ranks send rank 0 a :func:`summarize` of their last steps:
per stage, the median seconds of its forwards and backwards; per message it sent,
when it was posted and delivered, and per message it received, when it posted the
receive (:func:`link_times` joins the two into each link's service time, see
:mod:`pipefold.runtime.comm`); the time spent waiting on receives; and the bytes held.
Rank 0 :func:`decide`\\ s: for every candidate k it simulates kFkB with those compute
times over links of the observed bandwidth (:func:`pipefold.sim.simulate.simulate` with a
:class:`~pipefold.sim.network.Network`), scales the measured activation peak by the
schedule's own peak in microbatches, and picks the fastest k that fits the budget.
It moves away from the current k only for a predicted gain of more than
``hysteresis``. The runtime switches schedules at step boundaries only, so every
step is a whole kFkB step and the gradients stay exact.

This module is plain Python: it reads what the runtime measured through duck-typed
step statistics and never imports torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.ir import Action, Schedule
from pipefold.sim.network import Conditions, LinkState, Network
from pipefold.sim.simulate import CostModel, StageOverride, simulate

HYSTERESIS = 0.03
"""Leave the current k only for a predicted step at least this fraction shorter."""
TIE = 0.01
"""Predicted steps within this fraction of each other are a tie, which the smaller k wins."""


def candidates(microbatches: int, largest: int | None = None) -> list[int]:
    """The k worth trying: the divisors of the microbatch count (every group whole), up to ``largest``."""
    top = microbatches if largest is None else min(largest, microbatches)
    return [k for k in range(1, top + 1) if microbatches % k == 0]


def build(devices: int, microbatches: int, ks: Sequence[int]) -> tuple[Schedule, ...]:
    """The kFkB schedule of each candidate k (k = 1 is 1F1B's order)."""
    return tuple(schedules.build("kfkb", devices, microbatches, k=k) for k in ks)


def summarize(steps: Sequence[Any], static_bytes: int) -> dict[str, Any]:
    """What one rank sends rank 0 about its last steps (``StepStats``): small, and plain data."""
    compute: dict[str, list[float]] = {}
    for st in steps:
        for e in st.events:
            if e.kind in ("F", "BW", "B", "W"):
                a = Action.parse(e.name)
                compute.setdefault(f"{a.kind} {a.stage}", []).append(e.end - e.start)
    return {
        "rank": steps[-1].rank,
        "compute": {key: statistics.median(v) for key, v in compute.items()},
        "sends": [st.link_samples for st in steps],
        "recv_posted": [st.recv_posted for st in steps],
        "wait": statistics.median(sum(e.end - e.start for e in st.events if e.kind == "recv") for st in steps),
        "busy": statistics.median(st.busy for st in steps),
        "wall": statistics.median(st.wall for st in steps),
        "peak": max(st.peak_activation_bytes for st in steps),
        "static": static_bytes,
    }


def link_times(summaries: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], tuple[float, float]]:
    """Per directed link, (median bytes of a message, median service seconds of one), from every rank's
    :func:`summarize`: a message is served from the latest of its send's posting, its receive's posting
    (the other rank's clock: one machine, or clocks kept in step) and the delivery of the message before
    it on the link, until its delivery.

    Only the messages whose service is the same on a real link and on an emulated one count, when there
    are any: gloo starts a message once its receive is posted, an emulated link's wire starts it at its
    posting (:mod:`pipefold.runtime.comm`). A message is *clean* when its receive was already posted as
    it became ready to go (posted, and the message before it delivered), and the message before it, if
    it queued behind one, was clean too (a late one's delivery is not when the wire came free). A busy
    receiver posts late; the late messages then measure the receiver, not the link."""
    posted = {s["rank"]: s["recv_posted"] for s in summaries}
    out = {}
    for s in summaries:
        src = s["rank"]
        per_link: dict[int, list[tuple[int, float, bool]]] = {}
        for step, sends in enumerate(s["sends"]):
            for dst, samples in sends.items():
                theirs = posted.get(dst, [])
                recv = theirs[step].get(src, {}) if step < len(theirs) else {}
                before, clean_before = -math.inf, True
                for tag, nbytes, sent, done in sorted(samples, key=lambda x: x[3]):
                    ready = max(sent, before)
                    start = max(ready, recv.get(tag, sent))
                    clean = start == ready and (before <= sent or clean_before)
                    per_link.setdefault(dst, []).append((nbytes, max(done - start, 1e-6), clean))
                    before, clean_before = done, clean
        for dst, rows in per_link.items():
            rows = [row for row in rows if row[2]] or rows
            out[(src, dst)] = (statistics.median(b for b, _, _ in rows), statistics.median(t for _, t, _ in rows))
    return out


@dataclass(frozen=True)
class Decision:
    """What rank 0 chose and why."""

    k: int
    predicted: dict[int, float]
    """Per candidate k, its predicted step time (seconds)."""
    peaks: dict[int, list[float]]
    """Per candidate k, each rank's predicted peak bytes (static + activations)."""
    bandwidth: dict[str, float]
    """Per link 'a-b', the observed bandwidth (bytes per second) the prediction used."""
    wait: list[float]
    """Per rank, median seconds per step spent waiting on receives."""
    reason: str = ""
    fits: dict[int, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Policy:
    """Adaptive kFkB for one job: its candidate ks, the memory budget per device, and how eagerly it moves."""

    devices: int
    microbatches: int
    ks: tuple[int, ...]
    budget: float | None = None
    hysteresis: float = HYSTERESIS

    def __post_init__(self) -> None:
        if not self.ks or self.ks[0] != 1:
            raise ConfigError("adaptive kFkB starts at k = 1 (1F1B): give candidates that begin with 1")

    def decide(self, current: int, summaries: Sequence[Mapping[str, Any]]) -> Decision:
        """Choose the next k from every rank's :func:`summarize` of the steps run at ``current``."""
        p, m = self.devices, self.microbatches
        by_rank = sorted(summaries, key=lambda s: s["rank"])
        f = [by_rank[s]["compute"].get(f"F {s}", 0.0) for s in range(p)]
        bw = [by_rank[s]["compute"].get(f"BW {s}", 0.0) for s in range(p)]
        links: dict[tuple[int, int], Conditions] = {}
        seen: dict[str, float] = {}
        nbytes = 0.0
        for (src, dst), (size, seconds) in sorted(link_times(by_rank).items()):
            rate = size / seconds
            links[(src, dst)] = Conditions.constant(LinkState(0.0, rate))
            seen[f"{src}-{dst}"] = rate
            nbytes = max(nbytes, size)
        network = Network(Conditions.constant(LinkState(0.0, float("inf"))), links, name="observed")
        cost = CostModel(stage_overrides={s: StageOverride(f=f[s], b=bw[s], w=0.0, memory=1.0) for s in range(p)},
                         activation_bytes=nbytes)
        sims = {k: simulate(sched, cost, network=network) for k, sched in zip(self.ks, build(p, m, self.ks),
                                                                              strict=True)}
        # What the simulation leaves out (the optimizer step, per-step overheads) is the same for every k.
        measured = statistics.median(s["wall"] for s in by_rank)
        offset = measured - sims[current].makespan
        predicted = {k: sim.makespan + offset for k, sim in sims.items()}
        units_now = sims[current].peak_memory
        peaks = {k: [s["static"] + s["peak"] * (sim.peak_memory[s["rank"]] / max(units_now[s["rank"]], 1e-9))
                     for s in by_rank] for k, sim in sims.items()}
        fits = {k: self.budget is None or max(peaks[k]) <= self.budget for k in self.ks}
        allowed = [k for k in self.ks if fits[k]]
        wait = [float(s["wait"]) for s in by_rank]
        if not allowed:
            return Decision(1, predicted, peaks, seen, wait, "no k fits the memory budget: 1F1B holds the least",
                            fits)
        fastest = min(predicted[k] for k in allowed)
        # Of the ks within TIE of the fastest, the smallest: it holds the least memory.
        best = min(k for k in allowed if predicted[k] <= fastest * (1 + TIE))
        if fits.get(current) and predicted[best] > predicted[current] * (1 - self.hysteresis):
            return Decision(current, predicted, peaks, seen, wait, "within the hysteresis of the current k", fits)
        return Decision(best, predicted, peaks, seen, wait, "fastest that fits", fits)

    def runtime_decide(self, index: int, summaries: list[Any]) -> tuple[int, float | None, Decision]:
        """:meth:`decide` as the runtime's ``Adaptive.decide`` calls it: by index into :attr:`ks`."""
        d = self.decide(self.ks[index], summaries)
        return self.ks.index(d.k), d.predicted[d.k], d

"""Run a training job: locally, one process per device (in network namespaces with ``netns``), or as this process's
rank under torchrun; :func:`run` does all of ``pipefold train``: the plan, the job, the ranks."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipefold.errors import ConfigError
from pipefold.runtime.launch.job import Job, RankReport
from pipefold.runtime.launch.local import run_local
from pipefold.runtime.launch.processes import under_torchrun
from pipefold.runtime.launch.rank import agree
from pipefold.runtime.launch.torchrun import join_torchrun_group, leave_group, run_torchrun, torchrun_activity
from pipefold.train.planned import Planned, resolve
from pipefold.train.prepare import Decisions, make_job
from pipefold.train.spec import RunSpec

__all__ = ["Outcome", "run", "train", "train_torchrun"]

OnStep = Callable[[int, float, float], None]
"""Called on rank 0 after each step with (step number, loss, seconds)."""


@dataclass(frozen=True)
class Outcome:
    """A finished run: what ran and what every rank reported."""

    spec: RunSpec
    """The run (a planned one as its plan resolved it)."""
    job: Job
    reports: list[RankReport]
    """Every rank's report (every data-parallel pipeline's)."""
    planned: Planned | None = None
    """The plan it ran, with its prediction."""


def run(spec: RunSpec, *, on_step: OnStep | None = None, planned: Planned | None = None) -> Outcome | None:
    """Run ``spec`` here, or as this process's rank under torchrun; ``planned``: the run a plan resolved ``spec``
    into (:func:`pipefold.train.planned.resolve`; resolved here when not given). None on a torchrun rank other than
    0 (rank 0 reports for everyone)."""
    if planned is None and spec.planned:
        planned = resolve(spec)
    if planned is not None:
        spec = planned.spec
    if under_torchrun():
        job, gathered = train_torchrun(spec, on_step=on_step)
        return None if gathered is None else Outcome(spec, job, gathered, planned)
    job, reports = train(spec, on_step=on_step, decided=None if planned is None else planned.decided)
    return Outcome(spec, job, reports, planned)


def train(spec: RunSpec, *, on_step: OnStep | None = None,
          decided: Decisions | None = None) -> tuple[Job, list[RankReport]]:
    """Run the job on one local process per device (``spec.check``: keeping the first step's gradients);
    ``decided`` gives the split and recomputation (from a plan) instead of measuring."""
    job = make_job(spec, decided=decided, local=spec.local)
    if spec.links.netns:
        return _run_netns(job, on_step)
    if job.network is not None:
        job = dataclasses.replace(job, origin=time.time())
    return job, run_local(job, on_step)


def _run_netns(job: Job, on_step: OnStep | None) -> tuple[Job, list[RankReport]]:
    """Run ``job`` with each rank in a network namespace: the links capped by tc at the network's fastest
    bandwidth, and its preempted periods made real by flooding the preempted links (both ways).

    What the flood leaves the job is the real, shared bandwidth: the network's busy bandwidth is not used, nor
    its latency (tbf has none to add).
    """
    from pipefold.runtime.launch import netns

    assert job.network is not None
    network = job.network
    reason = netns.unavailable()
    if reason is not None:
        raise ConfigError(f"--netns cannot run here: {reason}; use --network alone to emulate the links in-process")
    p = job.schedule.devices
    rate = network.fastest
    if math.isinf(rate):
        raise ConfigError("--netns needs a network with a finite bandwidth for tc to cap the links at")
    horizon = 24 * 3600.0
    pairs = sorted(network.links) if network.links else [(i, i + 1) for i in range(p - 1)]
    pairs = [(a, b) for a, b in pairs if a < b and max(a, b) < p]
    with netns.namespaces(p, rate) as topology, contextlib.ExitStack() as floods:
        origin = time.time()
        for a, b in pairs:
            periods = network.preempted_periods(a, b, horizon)
            if periods:
                floods.enter_context(netns.Flood(topology, a, b, periods, origin, bidirectional=True))
        job = dataclasses.replace(job, netns=topology, network=None, origin=origin)
        return job, run_local(job, on_step)


def train_torchrun(spec: RunSpec, *, on_step: OnStep | None = None) -> tuple[Job, list[RankReport] | None]:
    """This process's rank of the job, as torchrun started it; rank 0 gets every rank's report.

    Rank 0 measures and decides the split, the recomputation and K-FAC's placement; the others take its
    decisions (measured times differ from process to process, and every rank must run the same steps).
    """
    rank, _ = join_torchrun_group(spec.reliability.action_timeout, spec.devices.device, spec.devices.backend,
                                  compiling=spec.devices.compiling)
    activity = torchrun_activity()
    job = None
    failure: Exception | None = None
    if rank == 0:
        activity.run("preparing the job (measuring the model)", action=False)
        try:
            job = make_job(spec)
            message: tuple[str, Any] = ("ok", ((job.layer_stages, job.extra.get("recompute")),
                                               job.extra.get("pipefisher"), job.checkpoint))
        except ConfigError as exc:
            message = ("error", str(exc))  # the other ranks stop with the same line instead of waiting
        except Exception as exc:  # anything else stops the other ranks too, then surfaces here unchanged
            failure, message = exc, ("crash", f"{type(exc).__name__}: {exc}")
        message = agree(message)
    else:
        activity.wait("preparing the job", "rank 0's split of the model", (0,), action=False)
        message = agree(None)
    status, payload = message
    if status != "ok":
        leave_group()
        if failure is not None:
            raise failure
        if status == "error":
            raise ConfigError(payload)
        raise RuntimeError(f"rank 0 failed while preparing the job: {payload}")
    if job is None:
        job = make_job(spec, decided=payload[0], placed=payload[1], checkpointing=payload[2])
    return job, run_torchrun(job, on_step)

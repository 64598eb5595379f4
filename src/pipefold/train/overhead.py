"""The runtime's own work per message, measured: what a step spends beside its passes and its waits.

A rank's step is its passes, its waits for messages, and the executor's work between them (posting receives and
sends, waiting on them, bookkeeping): a few hundred microseconds per message on a CPU, which the simulator would
leave out and which weighs on layers of a millisecond. It is taken to come with the messages: a weight gradient,
which neither sends nor receives, is taken to cost nothing beside its pass (priced per action instead, a V
schedule's Ws and its turn, which send nothing, made an MLP's step predicted 18-21% too slow).
:func:`measure_overhead` runs the profiled model with 1f1b on as many local ranks as the profile measured (at most one
per layer) for a few steps and returns that work per message a rank sends or receives (:func:`overhead_of`), for the
cost model (:attr:`pipefold.sim.simulate.CostModel.message_overhead`).

Where the ranks share cores that work takes longer, and more than their passes do: 1f1b on 4 ranks of a GPT on this
2-core machine spent 440 to 500 us a message where 2 ranks spent 87 to 92, while its passes took 1.5 to 1.7 times
their CPU time. A run on 2 ranks priced it at 2 ranks' cost on every world. The cost model stretches each action by
the ranks computing beside it (``CostModel.contention``), and this work with it, so the figure is the run's, brought
back to one rank's load by that same run's stretch of its passes (their wall time over their CPU time,
:attr:`pipefold.runtime.executor.Event.cpu`); what remains beyond it (a rank waiting to be woken) stays in.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from pipefold.plan.profile import Profile, Progress
from pipefold.train.spec import RunSpec, profiled_settings

if TYPE_CHECKING:
    from pipefold.runtime.launch.job import Job, RankReport

__all__ = ["OVERHEAD_RUN", "measure_overhead", "overhead_of", "overhead_ranks", "profile_here"]

OVERHEAD_RUN = {"schedule": "1f1b", "devices": 2, "steps": 6}
"""The run timed, on 2 ranks or as many as :func:`measure_overhead` is given: its first step is left out."""
QUICK_STEPS = 3
"""Its steps in a quick profile (``pipefold profile --quick``)."""


def measure_overhead(train: dict[str, Any], devices: int = 2, *, quick: bool = False) -> float:
    """Seconds of the runtime's own work per message a rank sends or receives, at one rank's load: the mean over the
    ranks of :data:`OVERHEAD_RUN` (:data:`QUICK_STEPS` steps with ``quick``) on ``devices`` ranks with the model and
    size ``train`` (a profile's ``train``)."""
    from pipefold.runtime.launch.local import run_local
    from pipefold.train.prepare import make_job

    run = {**OVERHEAD_RUN, "devices": devices, **({"steps": QUICK_STEPS} if quick else {})}
    job = make_job(RunSpec.flat(**profiled_settings(train), **run), local=True)
    return overhead_of(job, run_local(job))


def overhead_ranks(profile: Profile) -> int:
    """On how many ranks :func:`measure_overhead` runs for ``profile``: as many as it measured sharing the cores (its
    contention table: ``-p``), as a run of them will have, but no more than its layers and at least 2."""
    return max(2, min(len(profile.contention), len(profile.layers)))


def overhead_of(job: Job, reports: list[RankReport]) -> float:
    """Seconds of the runtime's own work per message a rank sends or receives in a run of ``job``, at one rank's
    load: each rank's step less its passes and waits (:func:`pipefold.runtime.measure.timeline.step_parts`), over the
    message
    ends of its actions (:meth:`pipefold.ir.Graph.message_ends`) and over its passes' wall time per second of their
    CPU time (1 where the run has no CPU time of them: on a GPU), the mean over the first pipeline's ranks."""
    from pipefold.ir import dependency_graph
    from pipefold.runtime.measure.timeline import step_parts

    reports = sorted((r for r in reports if r.pipeline == 0), key=lambda r: r.rank)
    graph = dependency_graph(job.schedule)
    ends = graph.message_ends()
    per_rank = [int(ends[graph.offsets[r.rank]:graph.offsets[r.rank] + len(job.schedule.actions[r.rank])].sum())
                for r in reports]
    parts = step_parts(reports)
    return statistics.fmean(max(0.0, p["runtime"]) / max(1, n) / _stretch(p) for p, n in zip(parts, per_rank,
                                                                                                 strict=True))


def _stretch(part: dict[str, float]) -> float:
    """How much longer a rank's passes took than their CPU time: the sharing of cores it met (at least 1)."""
    cpu = part.get("compute cpu", 0.0)
    return max(1.0, part["compute"] / cpu) if cpu > 0 else 1.0


def profile_here(*, overhead: bool = True, progress: Progress | None = None, **sizes: Any) -> Profile:
    """The profile of a model on this machine: :func:`pipefold.runtime.measure.profiling.profile_model` with ``sizes``
    (model, layers, ..., devices, link, contention), and with ``overhead`` the runtime's own work per message
    (:func:`measure_overhead`, reported to ``progress`` as part "overhead")."""
    import dataclasses

    from pipefold.runtime.measure.profiling import profile_model

    profile = profile_model(progress=progress, **sizes)
    if not overhead:
        return profile
    if progress is not None:
        progress("overhead", 0, 1)
    overhead_s = measure_overhead(profile.train, overhead_ranks(profile), quick=sizes.get("quick", False))
    profile = dataclasses.replace(profile, message_overhead=overhead_s)
    if progress is not None:
        progress("overhead", 1, 1)
    return profile

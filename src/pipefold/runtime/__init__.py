"""Executing schedules on real models across processes: stage passes, communication, ranks, launch."""

from pipefold.runtime.job import Job, RankError, RankReport, under_torchrun
from pipefold.runtime.local import run_local
from pipefold.runtime.stage import StageRunner
from pipefold.runtime.torchrun import run_torchrun

__all__ = ["Job", "RankError", "RankReport", "StageRunner", "run_local", "run_torchrun", "under_torchrun"]

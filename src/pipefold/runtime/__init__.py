"""Executing schedules on real models across processes: stage passes, communication, ranks, launch."""

from pipefold.runtime.launch import Job, RankError, RankReport, run_local, run_torchrun, under_torchrun
from pipefold.runtime.stage import StageRunner

__all__ = ["Job", "RankError", "RankReport", "StageRunner", "run_local", "run_torchrun", "under_torchrun"]

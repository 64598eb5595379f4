"""Executing schedules on real models across processes: stage passes, communication, ranks, launch.

Import the module that holds what you need (``pipefold.runtime.local.run_local``, ``pipefold.runtime.job.Job``):
this package imports nothing itself, so that its torch-free modules (settings, processes) load without torch."""

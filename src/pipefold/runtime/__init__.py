"""Executing schedules on real models across processes, in three folders by who needs them.

- ``pipefold.runtime``: what a user's own training script runs, the public pipeline object
  (:mod:`pipefold.runtime.pipeline`) and what it stands on: the rank's executor, the passes with the B/W split,
  what travels between stages, communication, the memory meter, sharding, tied weights, numerics.
- ``pipefold.runtime.launch``: starting ranks for ``pipefold train`` (locally, from a fork server, under torchrun,
  in network namespaces), the job they get and their loop, faults, devices and checkpoints.
- ``pipefold.runtime.measure``: running a model to measure it for the planner, and measured timelines.

This package imports nothing itself, so that its torch-free modules (``launch.settings``, ``launch.processes``)
load without torch.
"""

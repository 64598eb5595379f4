"""Launching ranks: the job every rank gets, the trainer's rank loop, ranks on this machine (spawned from a fork
server) and under torchrun, network namespaces, faults, devices and checkpoints. A user's own script needs none
of it (:mod:`pipefold.runtime.pipeline`)."""

"""Training runs, between the command line and the runtime: a run's settings turned into a job for the ranks, the
run itself, the one-process reference it is checked against (:mod:`.run`), and the offloading check
(:mod:`.offload_check`)."""

"""Choosing how to run: a model's measured profile (:mod:`.profile`), balanced stages (:mod:`.partition`),
stage-aware recomputation (:mod:`.recompute`), the memory-budget planner (:mod:`.budget`), kFkB's k under a
changing network (:mod:`.adapt`) and K-FAC's work in the bubbles (:mod:`.pipefisher`). Stands on the schedules,
the simulator and the models; never on the runtime."""

"""Training runs, between the command line and the runtime: one value describing a run (:mod:`.spec`), the job it
becomes for the ranks (:mod:`.prepare`), runs a plan decided (:mod:`.planned`), the run itself (:mod:`.run`), what it
measured against what was predicted (:mod:`.summary`), the one-process reference it is checked against
(:mod:`.reference`), and the offloading check (:mod:`.offload_check`)."""

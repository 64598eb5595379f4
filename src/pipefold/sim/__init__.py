"""Predicting a schedule: a cost model and a schedule give a timeline, bubbles and memory (:mod:`.simulate`), over
links whose speed may change with time (:mod:`.network`), drawn as terminal timelines, figures and traces
(:mod:`.render`). Stands on :mod:`pipefold.ir` only; never imports torch."""

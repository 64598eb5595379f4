"""Measuring: what runs a model to measure it for the planner (profiling) and measured timelines against
predictions (timeline)."""

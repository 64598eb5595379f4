"""pipefold: pipeline-parallel schedules as data, a simulator that predicts them, and tools to draw them."""

from typing import Any

from pipefold.errors import ConfigError, PipefoldError, ScheduleError
from pipefold.ir import Action, Kind, Schedule, validate
from pipefold.schedules import build, names
from pipefold.sim.simulate import CostModel, SimResult, simulate

__version__ = "0.1.0"

_LIBRARY = {"Pipeline": "pipefold.runtime.pipeline", "Check": "pipefold.runtime.pipeline",
            "StepReport": "pipefold.runtime.pipeline", "split_model": "pipefold.runtime.measure.split"}
"""The library a training script uses, loaded (with torch) when first named: ``from pipefold import Pipeline``."""


def __getattr__(name: str) -> Any:
    if name in _LIBRARY:
        import importlib

        return getattr(importlib.import_module(_LIBRARY[name]), name)
    raise AttributeError(f"module 'pipefold' has no attribute {name!r}")

__all__ = [
    "Action",
    "Check",
    "Pipeline",
    "StepReport",
    "split_model",
    "ConfigError",
    "CostModel",
    "Kind",
    "PipefoldError",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "build",
    "names",
    "simulate",
    "validate",
]

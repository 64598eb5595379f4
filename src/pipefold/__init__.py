"""pipefold: pipeline-parallel schedules as data, a simulator that predicts them, and tools to draw them."""

from pipefold.errors import ConfigError, PipefoldError, ScheduleError
from pipefold.ir import Action, Kind, Schedule, validate
from pipefold.schedules import build, names
from pipefold.sim.simulate import CostModel, SimResult, simulate

__version__ = "0.1.0"

__all__ = [
    "Action",
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

"""pipefold: pipeline-parallel schedules as data, a simulator that predicts them, and tools to draw them.

Every name here is loaded when it is first used (``from pipefold import build, Pipeline``), so that importing the
package costs nothing: the ``pipefold`` command starts (:mod:`pipefold._entry`) before its heavy imports, and the
library's torch side loads only with the names that need it.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_NAMES = {
    "ConfigError": "pipefold.errors", "PipefoldError": "pipefold.errors", "ScheduleError": "pipefold.errors",
    "Action": "pipefold.ir", "Kind": "pipefold.ir", "Schedule": "pipefold.ir", "validate": "pipefold.ir",
    "build": "pipefold.schedules", "names": "pipefold.schedules",
    "CostModel": "pipefold.sim.simulate", "SimResult": "pipefold.sim.simulate", "simulate": "pipefold.sim.simulate",
    "Pipeline": "pipefold.runtime.pipeline", "Check": "pipefold.runtime.pipeline",
    "StepReport": "pipefold.runtime.pipeline", "split_model": "pipefold.runtime.measure.split",
    "VocabShard": "pipefold.runtime.vocab", "KFACConfig": "pipefold.runtime.kfac",
}
"""Each name the package offers and the module that holds it."""

if TYPE_CHECKING:
    from pipefold.errors import ConfigError, PipefoldError, ScheduleError
    from pipefold.ir import Action, Kind, Schedule, validate
    from pipefold.schedules import build, names
    from pipefold.sim.simulate import CostModel, SimResult, simulate


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        import importlib

        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module 'pipefold' has no attribute {name!r}")


__all__ = [
    "Action",
    "Check",
    "ConfigError",
    "CostModel",
    "KFACConfig",
    "Kind",
    "Pipeline",
    "PipefoldError",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StepReport",
    "VocabShard",
    "build",
    "names",
    "simulate",
    "split_model",
    "validate",
]

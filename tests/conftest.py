"""Shared test settings."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def build_or_refused(name: str, p: int, m: int, **options: int):  # type: ignore[no-untyped-def]
    """Schedule ``name`` for this shape, or None where its family refuses the shape in one line naming what works
    (Chimera wants even p and a multiple of p microbatches, DualPipe m >= 2p, a V block must not collide...)."""
    from pipefold import ConfigError, build

    try:
        return build(name, p, m, **options)
    except ConfigError as exc:
        text = str(exc)
        assert "\n" not in text, text
        assert any(k in text for k in ("nearest valid", "collision-free", "use --microbatches")), text
        return None

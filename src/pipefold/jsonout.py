"""JSON that every parser reads: non-finite numbers become null, and the object says which they were.

``json.dumps`` writes ``NaN``, ``Infinity`` and ``-Infinity``, which are not JSON (RFC 8259) and which
strict parsers (``jq``, JavaScript's ``JSON.parse``, ``json.loads`` with a ``parse_constant`` that
refuses them) reject. Every ``--json`` output and every JSON file pipefold writes goes through
:func:`dumps`, which follows one convention:

- a float that is NaN or infinite is written as ``null``;
- the top-level object gets a key ``"nonfinite"``: the paths of those values, in document order, each a
  dotted path of keys with ``[i]`` for list positions (``"loss[3]"``, ``"cost.f"``, ``"busy[0]"``), so a
  reader can tell a null that means "not a number" from one that means "none". The key is absent when
  every number is finite. When the top level is a list, each element that is an object and holds a
  non-finite number gets its own ``"nonfinite"`` (paths relative to it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["NONFINITE", "dumps", "finite"]

NONFINITE = "nonfinite"
"""The key that lists where non-finite numbers were replaced by null."""


def finite(obj: Any) -> tuple[Any, list[str]]:
    """``obj`` with every non-finite float replaced by None (mappings and sequences copied as dicts and lists),
    and the paths of what was replaced."""
    paths: list[str] = []
    return _clean(obj, "", paths), paths


def _clean(obj: Any, path: str, paths: list[str]) -> Any:
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        paths.append(path or "$")
        return None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, Mapping):
        return {k: _clean(v, f"{path}.{k}" if path else str(k), paths) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v, f"{path}[{i}]", paths) for i, v in enumerate(obj)]
    return obj  # left to json's own errors


def dumps(obj: Any, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """``obj`` as strict JSON (see the module's docstring): never ``NaN`` or ``Infinity``."""
    if isinstance(obj, list):
        out: Any = [_flagged(item) if isinstance(item, Mapping) else finite(item)[0] for item in obj]
    else:
        out = _flagged(obj) if isinstance(obj, Mapping) else finite(obj)[0]
    return json.dumps(out, indent=indent, sort_keys=sort_keys, allow_nan=False)


def _flagged(obj: Mapping[str, Any]) -> dict[str, Any]:
    clean, paths = finite(obj)
    if paths:
        clean[NONFINITE] = paths
    return dict(clean)

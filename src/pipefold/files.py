"""Writing files so that a failure never destroys what was there: a temporary file beside it, then a rename."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from pipefold.errors import ConfigError

__all__ = ["check_writable", "read_json", "write_text"]


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: readers see the old file or the whole new one, never a part."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".pipefold-", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        os.unlink(tmp)
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        os.unlink(tmp)
        raise


def read_json(path: str, what: str, hint: str) -> Any:
    """The JSON in ``path``, or one ConfigError naming ``what`` could not be read and ``hint`` (how to make one)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not JSON ({exc}); {hint}") from None


def check_writable(path: str, what: str = "output") -> None:
    """Refuse, before any work, a path that cannot be written: a directory, or in a folder that does not exist."""
    if os.path.isdir(path):
        raise ConfigError(f"the {what} file {path} is a directory; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write the {what} file {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"cannot write the {what} file {path}: folder {folder} is not writable")

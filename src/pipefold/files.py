"""Writing files so that a failure never destroys what was there, and checking output paths before any work.

Every file pipefold writes (schedules, profiles, plans, network profiles, Chrome traces, figures) goes
through :func:`atomic`: the bytes go to a temporary file beside the target, are flushed and fsynced,
and only then renamed over it (``os.replace``, atomic on POSIX). Readers see the old file or the whole
new one, never a part; a failure (a full disk, a serializer that raises, Ctrl-C) leaves the old file
byte for byte as it was and removes the temporary file. JSON goes through :mod:`pipefold.jsonout`.

Only a regular file (or a new one) is replaced. A path that names something else is never renamed
over: a character device (``/dev/null``, a terminal) or a FIFO with a reader (``/dev/stdout`` piped)
is written into, as ``open`` would; a FIFO that nobody reads (writing would wait forever), a socket,
a block device or a folder is refused in one line, before any work (:func:`check_writable`).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal, overload

from pipefold.errors import ConfigError

__all__ = ["FIGURE_SUFFIXES", "atomic", "check_figure_path", "check_writable", "read_json", "save_figure",
           "write_bytes", "write_json", "write_text"]

FIGURE_SUFFIXES = (".png", ".svg")
"""The figure formats pipefold draws, chosen by the file's suffix (any case)."""

_PREFIX = ".pipefold-"
_SUFFIX = ".tmp"


@overload
def atomic(path: str | os.PathLike[str], *, binary: Literal[False] = ...) -> contextlib.AbstractContextManager[
    IO[str]]: ...


@overload
def atomic(path: str | os.PathLike[str], *, binary: Literal[True]) -> contextlib.AbstractContextManager[
    IO[bytes]]: ...


def atomic(path: str | os.PathLike[str], *, binary: bool = False) -> contextlib.AbstractContextManager[IO[Any]]:
    """A file handle whose contents replace ``path`` when the ``with`` block ends without an error.

    The handle is a temporary file in ``path``'s folder; at the end it is flushed, fsynced, given the
    permissions the old file had (or a new file's, by the umask) and renamed over ``path``. If the
    block raises, or the write, flush or rename fails, the temporary file is removed and ``path`` is
    left untouched; an ``OSError`` becomes one :class:`~pipefold.errors.ConfigError` naming the path.
    A symbolic link is written through (the file it points to is replaced, the link kept).
    """
    return _atomic(os.fspath(path), binary)


_CHECKED: dict[str, int] = {}
"""Descriptors :func:`check_writable` opened on special files, kept until the write takes them: closing one would
tell a FIFO's reader the stream had ended before anything was written."""


def _special(path: str, what: str = "output") -> int | None:
    """For a path that names an existing file other than a regular one: a descriptor open for writing into it
    (a character device, a FIFO someone reads), or one ConfigError (anything else). None for a regular or
    missing file."""
    held = _CHECKED.pop(os.path.realpath(path), None)
    if held is not None:
        return held
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"the {what} file {path} is a directory: give a file name")
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        try:  # without a reader a FIFO refuses at once here, instead of blocking the write
            fd = os.open(path, os.O_WRONLY | (os.O_NONBLOCK if stat.S_ISFIFO(mode) else 0))
        except OSError as exc:
            why = "no process reads it" if exc.errno == 6 else exc.strerror or str(exc)  # ENXIO
            raise ConfigError(f"cannot write the {what} file {path}: {why}; give a regular file") from None
        if stat.S_ISFIFO(mode):
            os.set_blocking(fd, True)
        return fd
    kind = "socket" if stat.S_ISSOCK(mode) else "block device" if stat.S_ISBLK(mode) else "special file"
    raise ConfigError(f"the {what} file {path} is a {kind}, which pipefold does not write into: give a regular file")


@contextlib.contextmanager
def _atomic(path: str, binary: bool) -> Iterator[IO[Any]]:
    fd = _special(path)
    if fd is not None:  # a device or a FIFO: written into, never replaced
        try:
            with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as fh:
                yield fh
        except OSError as exc:
            raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
        return
    target = os.path.realpath(path)
    folder, name = os.path.split(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{_PREFIX}{name}-", suffix=_SUFFIX, dir=folder)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except OSError as exc:
        _remove(tmp)
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        _remove(tmp)
        raise
    _sync_folder(folder)


def _mode_for(target: str) -> int:
    """The old file's permission bits, or those ``open()`` would give a new file under this umask."""
    try:
        return os.stat(target).st_mode & 0o7777
    except OSError:
        umask = os.umask(0o022)
        os.umask(umask)
        return 0o666 & ~umask


def _remove(tmp: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def _sync_folder(folder: str) -> None:
    """Make the rename itself durable (best effort: some filesystems cannot fsync a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: readers see the old file or the whole new one, never a part."""
    with atomic(path) as fh:
        fh.write(text)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic(path, binary=True) as fh:
        fh.write(data)


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = None) -> None:
    """Write ``obj`` as JSON to ``path`` atomically, non-finite numbers as null (see :mod:`pipefold.jsonout`)."""
    from pipefold.jsonout import dumps

    write_text(path, dumps(obj, indent=indent) + "\n")


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = 150) -> None:
    """Save a matplotlib figure to ``path`` atomically, in the format its suffix names (.png or .svg)."""
    suffix = check_figure_path(path, "figure")
    with atomic(path, binary=True) as fh:
        fig.savefig(fh, format=suffix[1:], dpi=dpi)


def check_figure_path(path: str | os.PathLike[str], what: str) -> str:
    """The suffix of a figure's file name (a figure is written as PNG or SVG, by its suffix), or one ConfigError
    naming ``what`` the figure is."""
    suffix = Path(path).suffix.lower()
    if suffix not in FIGURE_SUFFIXES:
        raise ConfigError(f"cannot write the {what} {path}: use a file name ending in "
                          f"{' or '.join(FIGURE_SUFFIXES)}")
    return suffix


def read_json(path: str, what: str, hint: str) -> Any:
    """The JSON in ``path``, or one ConfigError naming ``what`` could not be read and ``hint`` (how to make one)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not JSON ({exc}); {hint}") from None
    except RecursionError:
        raise ConfigError(f"{path} nests too deeply to be a {what}; {hint}") from None


def shipped_names(folder: Any) -> list[str]:
    """The JSON files a package folder (``importlib.resources``) ships, by name without ``.json``."""
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def read_shipped_or_file(given: str, folder: Any, *, flag: str, what: str, hint: str) -> tuple[Any, str]:
    """The JSON that ``given`` names: one this package ships in ``folder`` (by its name) or a file; and how
    messages name it (``what NAME`` or ``flag PATH``). One ConfigError, ending in ``hint``, for a name that is
    neither, a file that cannot be read, or text that is not JSON."""
    names = shipped_names(folder)
    if given in names:
        return json.loads(folder.joinpath(f"{given}.json").read_text(encoding="utf-8")), f"{what} {given}"
    path = Path(given)
    if not path.is_file():
        raise ConfigError(f"{flag} {given!r} is neither a {what} pipefold ships ({', '.join(names)}) nor a file: "
                          f"{hint}")
    where = f"{flag} {given}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {where}: {err}") from None
    try:
        return json.loads(text), where
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not JSON ({err.msg} at line {err.lineno}): {hint}") from None
    except RecursionError:
        raise ConfigError(f"{where} nests too deeply: {hint}") from None


def check_writable(path: str | os.PathLike[str], what: str = "output", *, figure: bool = False) -> None:
    """Refuse, before any work, a path that cannot be written: a directory, a folder that does not exist or
    cannot take a new file, or (``figure``) a suffix other than .png or .svg. Nothing is left behind."""
    path = os.fspath(path)
    if not path:
        raise ConfigError(f"the {what} file name is empty: give a file name")
    if os.path.isdir(path):
        raise ConfigError(f"the {what} file {path} is a directory: give a file name")
    if figure:
        check_figure_path(path, what)
    fd = _special(path, what)
    if fd is not None:  # a device or a read FIFO: it will be written into, through this descriptor
        _CHECKED[os.path.realpath(path)] = fd
        return
    folder = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write the {what} file {path}: folder {folder} does not exist")
    # Try what the write will do: make a temporary file beside it (os.access says yes to root on read-only
    # places such as /proc, and knows nothing of a full inode table).
    try:
        fd, tmp = tempfile.mkstemp(prefix=_PREFIX, suffix=_SUFFIX, dir=folder)
    except OSError as exc:
        raise ConfigError(f"cannot write the {what} file {path}: folder {folder}: {exc.strerror or exc}") from None
    os.close(fd)
    _remove(tmp)

"""One temporary folder per ``pipefold`` command, for everything temporary that it and the processes it starts
make: its ranks' files and sockets, its process groups' stores, multiprocessing's files (the fork server's socket,
which multiprocessing would put in a ``pymp-*`` folder of its own), torch's error files, and the folder of torch's
compile cache (``torchinductor_<user>``, which torch makes as it imports its compiler, and which stays empty where
nothing is compiled).

The command makes it first thing (:func:`make`), in the user's temporary folder, and points ``TMPDIR`` at it, in
its own process and in every one it starts: their temporary files all land inside. It is removed however the
command ends:

- as the command exits (done, an error, Ctrl-C, SIGTERM), after multiprocessing has removed its own folder inside;
- when the command is killed (``kill -9``), by its fork server, which outlives it by design
  (:mod:`pipefold.runtime.launch._forkserver`): the processes the server forked end as they find the command gone,
  the server kills any that linger and then removes the folder (:func:`owned_by` tells it which folder).

Under torchrun each worker is a command of its own, and its folder goes where torchrun keeps the worker's files
(the folder of its error file): a worker that torchrun kills leaves nothing anywhere else.

A run that compiles keeps torch's compile cache where torch keeps it without pipefold, across runs
(:func:`keep_compile_cache`). A ``TORCHINDUCTOR_CACHE_DIR`` the user sets is left alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from pipefold.runtime.socket_paths import folder_with_room

__all__ = ["FOLDER", "USER_TMPDIR", "keep_compile_cache", "make", "make_if_possible", "owned_by", "remove"]

FOLDER = "PIPEFOLD_TEMP"
"""The environment variable that names the command's folder and the process that made it: ``PID:PATH``."""
USER_TMPDIR = "PIPEFOLD_USER_TMPDIR"
"""The environment variable that keeps the user's own temporary folder, for torch's compile cache."""


def make() -> str:
    """Make this command's temporary folder, point ``TMPDIR`` (and :mod:`tempfile`) at it and make it
    multiprocessing's folder too; it is removed as the process exits. Returns its path.

    Its name is short (``pf-`` and 8 characters): the fork server's socket and the ranks' sockets are made in it,
    and a socket's path has at most 107 bytes. Where the user's temporary folder has so long a path that they
    would not fit, it is made in ``/tmp`` instead (:func:`~pipefold.runtime.socket_paths.folder_with_room`)."""
    from multiprocessing import process, util

    user = tempfile.gettempdir()
    folder = folder_with_room("/listener-12345678", _torchrun_folder())  # multiprocessing's socket, the longest
    os.environ.setdefault(USER_TMPDIR, user)  # a command a pipefold command started keeps the user's, not ours
    os.environ[FOLDER] = f"{os.getpid()}:{folder}"
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    # The folder multiprocessing would make for itself (pymp-*) is this one, one name shorter: a process this one
    # starts gets it with its configuration (multiprocessing.util.get_temp_dir reads it there).
    config = getattr(process.current_process(), "_config", None)
    if isinstance(config, dict):
        config.setdefault("tempdir", folder)
    # After multiprocessing's own folder where it made one all the same (it removes it with exit priority -100,
    # and fails where it is gone already).
    util.Finalize(None, remove, args=(folder,), exitpriority=-101)
    return folder


def make_if_possible() -> None:
    """:func:`make`, or nothing where no folder can be made: a command that needs one says so when it does."""
    with contextlib.suppress(OSError):
        make()


def owned_by(pid: int) -> str | None:
    """The temporary folder of the command whose process is ``pid``, if it made one and this process inherited it
    (its fork server did); else None."""
    owner, _, folder = os.environ.get(FOLDER, "").partition(":")
    return folder if folder and owner == str(pid) else None


def remove(folder: str) -> None:
    """Remove ``folder`` and all it holds; nothing if it is gone."""
    shutil.rmtree(folder, ignore_errors=True)


def keep_compile_cache() -> None:
    """Point torch's compile cache at the folder torch uses without pipefold (``torchinductor_<user>`` in the
    user's temporary folder), where it survives the run, unless the user chose one. Called before compiling: a run
    that compiles nothing makes no such folder. Nothing outside a pipefold command."""
    user = os.environ.get(USER_TMPDIR)
    _, _, ours = os.environ.get(FOLDER, "").partition(":")
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if user is None or not ours or (chosen is not None and not _inside(chosen, ours)):
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return
    before, tempfile.tempdir = tempfile.tempdir, user
    try:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = default_cache_dir()
    finally:
        tempfile.tempdir = before


def _inside(path: str, folder: str) -> bool:
    with contextlib.suppress(ValueError):
        return os.path.commonpath([os.path.abspath(path), os.path.abspath(folder)]) == os.path.abspath(folder)
    return False


def _torchrun_folder() -> str | None:
    """Under torchrun, the folder where torchrun keeps this worker's files (its error file's); else None."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or os.path.abspath(error_file) == os.path.abspath(os.devnull):
        return None
    folder = os.path.dirname(os.path.abspath(error_file))
    return folder if os.path.isdir(folder) else None

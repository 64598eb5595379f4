"""How long a Unix-domain socket's path may be, and whether a folder leaves room for one: the command's temporary
folder (:mod:`pipefold.runtime.launch.tempfolder`, where multiprocessing's fork server listens) and the ranks'
sockets (:mod:`pipefold.runtime.sockets`) both ask, and both make their folders here. Imports nothing of torch:
the command line asks before torch loads."""

from __future__ import annotations

import os
import tempfile

__all__ = ["SOCKET_PATH_MAX", "folder_with_room", "room_for_sockets"]

SOCKET_PATH_MAX = 100
"""The longest socket path pipefold makes: Linux allows 107 bytes, macOS 103."""


def room_for_sockets(folder: str | os.PathLike[str], name: str) -> bool:
    """Whether a socket named ``name`` (its longest form, with a leading separator) fits in ``folder``."""
    return len(os.fsencode(os.fspath(folder))) + len(os.fsencode(name)) <= SOCKET_PATH_MAX


def folder_with_room(name: str, parent: str | None = None) -> str:
    """A new folder (``pf-`` and 8 characters) in ``parent`` (by default the temporary folder) where a socket named
    ``name`` fits, or in ``/tmp`` where that one's path is too long for it."""
    made = tempfile.mkdtemp(prefix="pf-", dir=parent)
    if room_for_sockets(made, name) or not os.path.isdir("/tmp"):
        return made
    os.rmdir(made)
    return tempfile.mkdtemp(prefix="pf-", dir="/tmp")

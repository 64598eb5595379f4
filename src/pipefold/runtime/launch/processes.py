"""Local processes started from this one: how they start (a fork server that has imported torch and the runtime,
where the platform has one), where their process group meets (:func:`rendezvous`), and starting and stopping them
so that a signal or an error never leaves one behind. Used by the ranks' launcher and by the profile's measuring
processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["COMPILER", "free_port", "process_context", "rendezvous", "start_server", "starting", "stopped_on_error",
           "torchrun_on_one_machine", "under_torchrun"]


def free_port() -> int:
    """A port nobody listens on now. Only for a program that takes a port (torchrun's ``--master-port``): between
    this call and the program's bind another process may take it (any connection's own end takes a free port), so
    local process groups meet at :func:`rendezvous` instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def store_in(folder: str | os.PathLike[str]) -> str:
    """The ``init_method`` of a process group of this machine's processes that meet in a file store in ``folder``
    (one group per folder): no port to find free and lose before the group binds it (a start once failed with
    EADDRINUSE when another test's connection took the port in between)."""
    return f"file://{os.path.join(os.fspath(folder), 'store')}"


@contextlib.contextmanager
def rendezvous() -> Iterator[str]:
    """:func:`store_in` a fresh temporary folder, removed when the block ends."""
    with tempfile.TemporaryDirectory(prefix="pipefold-group-") as folder:
        yield store_in(folder)


COMPILER = ("torch._inductor.compile_fx", "torch._dynamo.backends.debugging")
"""What a process's first compiled module imports (torch's compiler, some 600 modules, whichever backend: seconds
of CPU each rank, where the first compile itself takes a fraction of a second): a run that compiles has its ranks'
fork server import them once (``preload`` of :func:`process_context`)."""


def start_server(preload: Sequence[str] = ()) -> None:
    """Start the fork server the local ranks come from now, without waiting for its imports: they run on another
    core while this process goes on (importing torch itself, measuring the model, planning). Nothing where ranks
    are spawned, or once the server runs. Imports no torch: the command line calls it first thing."""
    process_context(preload)


def process_context(preload: Sequence[str] = ()) -> Any:
    """How local ranks start: from a fork server that has imported torch and the runtime once (a rank then starts
    in a fraction of a second instead of importing torch again), where the platform has one; else spawned.

    The server is started by this process's first job (or by :func:`start_server`, earlier) and serves every later
    one; it runs no torch code, so no thread pool or CUDA context is copied into the ranks. ``preload`` adds modules
    for it to import (a model's, such as transformers'): only the first start's count. (The standard library's
    contexts are torch.multiprocessing's: the same objects.)
    """
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # torch._dynamo: what making the first optimizer imports (some 800 modules, seconds per rank otherwise).
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "pipefold.runtime.launch.local",
                                "pipefold.runtime.measure.profiling", *preload, "pipefold.runtime.launch._forkserver"])
    _ensure_server()
    return ctx


SERVER_PARENT = "PIPEFOLD_SERVER_PARENT"
"""The environment variable that tells the fork server which process started it (this one's id): the server
watches it, and cleans up after it when it is gone, even gone before the server has imported its modules
(:mod:`pipefold.runtime.launch._forkserver`)."""


def _ensure_server() -> None:
    """Start the fork server (if it is not running) with SIGINT ignored, which it and its children inherit across
    the server's exec (a block is not inherited: the standard library's spawn clears it): Ctrl-C in a terminal
    reaches every process of its group, and the server, importing torch for seconds, would print a traceback of
    its own. Only this process acts on it. A SIGINT that comes just before is delivered after; one in the few
    milliseconds of the spawn itself is not seen."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        _start_server()
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    came = signal.SIGINT in signal.sigpending()  # ignoring it now would discard it: noted, delivered after
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _start_server()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if before is None else before)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if came:
            signal.raise_signal(signal.SIGINT)


def _start_server() -> None:
    """Start the fork server, if it is not running, with :data:`SERVER_PARENT` in its environment."""
    from multiprocessing import forkserver

    _start_tracker()  # before the server, which would start it as it is
    before = os.environ.get(SERVER_PARENT)
    os.environ[SERVER_PARENT] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ[SERVER_PARENT]
        else:
            os.environ[SERVER_PARENT] = before


QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"
"""The warnings filter multiprocessing's resource tracker starts with (:func:`_start_tracker`)."""


def _start_tracker() -> None:
    """Start multiprocessing's resource tracker, if it is not running, without its warnings. It removes what a
    process killed before it could (a rank the launcher stopped, with the queues of torch's compile workers) left
    registered, which is what it is for, and then warns of "leaked semaphore objects" after the command's own
    line. pipefold's own processes meet over pipes, which leave nothing to remove."""
    from multiprocessing import resource_tracker

    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{before},{QUIET_TRACKER}" if before else QUIET_TRACKER
    try:
        resource_tracker.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = before


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) has set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_on_one_machine() -> bool:
    """Whether torchrun started every rank of the world on this machine (its local world is the whole world)."""
    world = os.environ.get("WORLD_SIZE", "1")
    return os.environ.get("LOCAL_WORLD_SIZE", world) == world


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while processes are started (each is handled when the block ends, by the handler
    that was there): a signal in the middle of ``Process.start()`` would leave a child forked whose pid nobody
    knows, which nobody could stop and which, finding its parent gone, prints a traceback of its own. Used by the
    ranks' launcher and by the profile's helpers; pair it with :func:`stopped_on_error`.

    Both are caught by a handler that only notes them. SIGINT is also blocked, and children forked meanwhile
    inherit the block (those of the fork server ignore it, as the server does: :func:`_ensure_server`), so that
    Ctrl-C in a terminal, which reaches every process of the group, cannot end them half-started, each with a
    traceback (the parent alone acts on it). SIGTERM is not: it is how the parent stops them. multiprocessing's
    resource tracker unblocks both when it starts; it is started before.
    """
    held = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    _start_tracker()
    came: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: came.append(signum)) for sig in held}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one still pending arrives now, and is noted
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if came:
            signal.raise_signal(came[0])  # handled now, as it would have been


@contextlib.contextmanager
def stopped_on_error(processes: Sequence[Any]) -> Iterator[None]:
    """Around the life of helper processes started from the fork server: when the block raises (Ctrl-C, an error),
    every one still running is stopped and waited for before the exception goes on, so that none outlives the
    queues and barriers it was given, and none prints a traceback of its own (a process still unpickling its
    arguments would fail to find them). Used by every command that starts helpers (profile's measurements)."""
    try:
        yield
    except BaseException:
        for p in processes:
            if p.pid is not None and p.exitcode is None:
                p.kill()  # SIGKILL: quiet, wherever it is
        for p in processes:
            if p.pid is not None:
                p.join(5)
        raise

"""The ranks' fork server leaves at once when its parent ends, and so does the ``pipefold`` command: neither
tears down the modules it imported (most of a second with torch), which would keep a reader of their output
waiting. Checked by what teardown would have done: an object's finalizer, which runs in teardown and not after
``os._exit``."""

from __future__ import annotations

import subprocess
import sys

import pytest

FINALIZER = "class Loud:\n    def __del__(self):\n        print('torn down', flush=True)\nkept = Loud()\n"


def test_importing_the_servers_module_skips_teardown() -> None:
    code = FINALIZER + "import pipefold.runtime.launch._forkserver\nprint('done', flush=True)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["done"]


def test_the_command_runs_exit_handlers_and_skips_teardown() -> None:
    code = (FINALIZER + "import atexit, sys\natexit.register(lambda: print('handlers ran', flush=True))\n"
            "sys.argv = ['pipefold', 'simulate', '1f1b', '--json']\nfrom pipefold.cli.main import entry\nentry()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("handlers ran") and "torn down" not in out


def test_without_it_teardown_runs() -> None:  # the reference: the finalizer does print when Python tears down
    out = subprocess.run([sys.executable, "-c", FINALIZER], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["torn", "down"]


def test_the_fork_server_imports_it_last() -> None:
    from multiprocessing import forkserver

    from pipefold.runtime.launch.processes import process_context

    process_context(("some.model",))
    assert forkserver._forkserver._preload_modules[-2:] == ["some.model", "pipefold.runtime.launch._forkserver"]


def test_the_command_flushes_its_output_and_exits_with_its_code() -> None:
    got = subprocess.run([sys.executable, "-m", "pipefold", "simulate", "1f1b", "--json"], capture_output=True,
                         text=True)
    assert got.returncode == 0 and got.stdout.strip().startswith("{") and got.stdout.strip().endswith("}")
    bad = subprocess.run([sys.executable, "-m", "pipefold", "simulate", "nope"], capture_output=True, text=True)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1


def test_the_command_waits_for_threads_still_running() -> None:
    # The thread prints only once the command has printed its JSON (not after a fixed sleep, which a loaded machine
    # outlasts before the command prints): its line comes last only if the command waited for it.
    code = ("import sys, threading\nprinted = threading.Event()\nwrite = sys.stdout.write\n"
            "def seen(text):\n    n = write(text)\n    if text.rstrip().endswith('}'):\n        printed.set()\n"
            "    return n\n"
            "sys.stdout.write = seen\n"
            "threading.Thread(target=lambda: (printed.wait(60), print('thread done', flush=True))).start()\n"
            "sys.argv = ['pipefold', 'simulate', '1f1b', '--json']\nfrom pipefold.cli.main import entry\nentry()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("thread done")


@pytest.mark.parametrize(("sig", "thread"), [("SIGINT", False), ("SIGINT", True), ("SIGTERM", True)],
                         ids=["sigint", "sigint-with-a-thread", "sigterm-with-a-thread"])
def test_a_signal_as_the_command_exits_changes_nothing(sig: str, thread: bool) -> None:
    """SIGINT or SIGTERM to the process while the exit handlers run (the command has finished): no traceback, the
    command's own code. Also while another thread lives (a library's daemon thread): a signal sent to the process
    goes to a thread that does not block it, so blocking it in the main thread alone let it through."""
    live = "import threading\nthreading.Thread(target=lambda: time.sleep(5), daemon=True).start()\n" if thread else ""
    code = ("import atexit, os, signal, sys, time\n" + live +
            f"def late():\n    os.kill(os.getpid(), signal.{sig})\n    time.sleep(0.2)\n    print('handler done')\n"
            "atexit.register(late)\n"
            "sys.argv = ['pipefold', 'simulate', '1f1b', '--json']\nfrom pipefold.cli.main import entry\nentry()\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert got.returncode == 0 and "Traceback" not in got.stderr and got.stdout.strip().endswith("handler done")

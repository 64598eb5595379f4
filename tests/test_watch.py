"""Whom a hung job is blamed on, from the ranks' published activities (the processes' side is in test_faults)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time

from pipefold.runtime.watch import Activity, Hang, SharedBoard, Snapshot, find_hang, process_state


def _snap(rank: int, where: str, *, waits: tuple[int, ...] = (), what: str = "", step: int = 4,
          age: float = 0.0, done: bool = False, action: bool = True) -> Snapshot:
    return Snapshot(rank=rank, pid=100 + rank, host="h", seq=1, beat=1000.0, step=step, where=where,
                    is_action=action, what=what, waits=waits, since=1000.0 - age, done=done)


def _hang(*snaps: Snapshot, frozen: dict[int, str] | None = None, timeout: float = 20.0) -> Hang | None:
    by_rank = {s.rank: s for s in snaps}
    return find_hang(by_rank, {r: s.age for r, s in by_rank.items()}, frozen or {}, timeout)


def test_a_long_wait_for_a_rank_that_makes_progress_is_no_hang() -> None:
    """GPipe's first rank waits for the first gradient while the others run their forwards, one after another."""
    assert _hang(_snap(0, "0B0", waits=(1,), what="a gradient", age=60),
                 _snap(1, "1F7", age=0.5)) is None


def test_the_blame_goes_to_the_end_of_the_chain() -> None:
    hang = _hang(_snap(0, "0B1", waits=(1,), what="a gradient", age=40),
                 _snap(1, "1B1", waits=(2,), what="a gradient", age=30),
                 _snap(2, "2F3", age=25))
    assert hang == Hang(2, "rank 2 hung in 2F3 of step 4: running for 25 s, longer than the action timeout of 20 s "
                           "(--action-timeout)")


def test_a_rank_that_stopped_publishing_is_blamed_with_who_waits_for_it() -> None:
    hang = _hang(_snap(0, "0F2", waits=(1,), what="a gradient", age=21), _snap(1, "1F1", age=25),
                 _snap(2, "2F1", waits=(1,), what="an activation", age=22),
                 frozen={1: "its process is stopped (SIGSTOP or a debugger), no heartbeat for 25 s"})
    assert hang == Hang(1, "rank 1 hung in 1F1 of step 4: its process is stopped (SIGSTOP or a debugger), no "
                           "heartbeat for 25 s; ranks 0, 2 wait for it")


def test_a_cycle_of_waits_blames_the_rank_that_waited_first() -> None:
    hang = _hang(_snap(0, "0B3", waits=(1,), what="a gradient", age=31),
                 _snap(1, "1F4", waits=(0,), what="an activation", age=24))
    assert hang == Hang(0, "rank 0 hung in 0B3 of step 4: waiting for a gradient from rank 1 for 31 s (action "
                           "timeout 20 s)")
    # Not while one of them has waited less than the timeout: snapshots lag, a cycle can be a moment's picture.
    assert _hang(_snap(0, "0B3", waits=(1,), age=31), _snap(1, "1F4", waits=(0,), age=2)) is None


def test_a_collective_is_held_up_by_the_member_that_has_not_come() -> None:
    waiting = [_snap(r, "clipping", waits=tuple(x for x in range(4) if x != r), what="the all-reduce", age=30,
                     action=False) for r in range(3)]
    assert _hang(*waiting, _snap(3, "3W7", age=1)) is None
    hang = _hang(*waiting, _snap(3, "3W7", age=21))
    assert hang is not None and hang.rank == 3


def test_waiting_for_a_rank_that_has_finished() -> None:
    hang = _hang(_snap(0, "0F9", waits=(1,), what="a gradient", age=22),
                 _snap(1, "the end of the job", waits=(0,), age=22, done=True, action=False))
    assert hang is not None and hang.rank == 0 and "waiting for a gradient from rank 1" in hang.line


def test_start_up_gets_at_least_the_default_timeout() -> None:
    """Before the first step (imports, building the layers) a small action timeout does not apply."""
    for before in (0, -1):  # an Activity's step before the first is 0
        assert _hang(_snap(0, "start-up", step=before, age=10, action=False), timeout=3) is None
        hang = _hang(_snap(0, "start-up", step=before, age=25, action=False), timeout=3)
        assert hang is not None and hang.line.startswith("rank 0 hung in start-up: running for 25 s")
    assert Activity(0).snapshot(1).step == 0


def test_the_board_gives_back_what_a_rank_published() -> None:
    board = SharedBoard(multiprocessing.get_context("spawn"), 3)
    assert board.read(1) is None
    activity = Activity(1)
    activity.step = 7
    activity.wait("1B2", "a gradient", (2,))
    for seq in (1, 2, 3):  # both halves of the slot, in turn
        board.publish(activity.snapshot(seq))
        got = board.read(1)
        assert got is not None and (got.seq, got.where, got.waits, got.step) == (seq, "1B2", (2,), 7)
    assert board.read(0) is None and board.read(2) is None


class _SlowBoard:
    """A board whose every publication takes a while (a store call over the network)."""

    def __init__(self) -> None:
        self.published: list[Snapshot] = []

    def publish(self, snap: Snapshot) -> None:
        import time

        time.sleep(0.3)
        self.published.append(snap)


def test_stopping_the_heartbeat_waits_for_its_thread() -> None:
    """A heartbeat thread left inside a store call while the process exits aborted torchrun ranks at exit now and
    then (SIGABRT); stop() returns only once the thread is out, after its last publication."""
    from pipefold.runtime.watch import Heartbeat

    board = _SlowBoard()
    beat = Heartbeat(Activity(0), board, period=0.01).start()  # type: ignore[arg-type]
    import time

    time.sleep(0.35)  # the thread is inside a publication now
    beat.stop()
    assert not beat._thread.is_alive()
    count = len(board.published)
    time.sleep(0.4)
    assert len(board.published) == count  # nothing published after stop() returned


def test_a_rank_stopped_mid_action_is_named_as_stopped_whichever_clock_passes_the_timeout_first() -> None:
    """A rank stopped in the middle of an action: its action's age passes the timeout before its silence does,
    and it is frozen (named as stopped) from then on, not blamed for computing too long. A running rank that is
    past the timeout in its action is not frozen (it computes, and find_hang says so); a stopped rank within the
    timeout is not frozen yet (it may be continued); silence alone past the timeout freezes any rank."""
    import signal
    import subprocess
    import sys

    from pipefold.runtime.watch import frozen_local

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        step = _snap(1, "1F1", age=4.0)
        startup = _snap(1, "start-up", age=4.0, step=-1, action=False)
        assert frozen_local(child.pid, step, silent=1.0, age=4.0, timeout=3.0) is None  # running: computing long
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.time() + 5
        while process_state(child.pid) != "T" and time.time() < deadline:
            time.sleep(0.01)
        why = frozen_local(child.pid, step, silent=1.0, age=4.0, timeout=3.0)
        assert why is not None and why.startswith("its process is stopped"), why
        assert frozen_local(child.pid, step, silent=1.0, age=2.0, timeout=3.0) is None  # within the timeout
        assert frozen_local(child.pid, step, silent=0.1, age=4.0, timeout=3.0) is None  # just published
        assert frozen_local(child.pid, startup, silent=1.0, age=4.0, timeout=3.0) is None  # start-up: 20 s
        assert frozen_local(child.pid, startup, silent=1.0, age=21.0, timeout=3.0) is not None
        hang = find_hang({0: _snap(0, "0F2", waits=(1,), what="an activation", age=4.0), 1: step},
                         {0: 4.0, 1: 4.0}, {1: why}, 3.0)
        assert hang is not None and hang.rank == 1 and "its process is stopped" in hang.line, hang
        assert "rank 0 waits for it" in hang.line, hang.line
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert frozen_local(None, step, silent=3.5, age=4.0, timeout=3.0) == "no heartbeat for 4 s"
    # Silence gets start-up's grace as an activity does: at least the default timeout before the first step,
    # whether the rank has published (start-up) or not yet (None).
    for before in (startup, None):
        assert frozen_local(None, before, silent=3.5, age=3.5, timeout=3.0) is None
        assert frozen_local(None, before, silent=21.0, age=21.0, timeout=3.0) == "no heartbeat for 21 s"


def test_the_first_step_of_compiled_layers_gets_the_compile_grace() -> None:
    """A run that compiles its layers compiles them inside its first passes: in that step an action may last
    COMPILE_GRACE whatever the action timeout; the step after, the timeout holds again. The grace travels with
    the snapshot, as the launcher reads it from the board."""
    from pipefold.runtime.watch import COMPILE_GRACE

    compiling = dataclasses.replace(_snap(0, "0F0", step=1, age=COMPILE_GRACE - 1), grace=COMPILE_GRACE)
    assert _hang(compiling, timeout=2) is None
    hang = _hang(dataclasses.replace(compiling, since=compiling.beat - COMPILE_GRACE - 1), timeout=2)
    assert hang is not None and hang.line.startswith(f"rank 0 hung in 0F0 of step 1: running for "
                                                     f"{COMPILE_GRACE + 1:.0f} s")
    assert _hang(_snap(0, "0F0", step=2, age=3), timeout=2) is not None
    assert Snapshot.from_json(compiling.to_json()) == compiling
    activity = Activity(0)
    activity.grace = COMPILE_GRACE
    assert activity.snapshot(1).grace == COMPILE_GRACE


def test_a_short_action_timeout_does_not_count_a_busy_heartbeat_as_frozen() -> None:
    """Under a 0.3 s action timeout, a rank whose heartbeat was held up for a second (a busy machine) is not
    frozen; silent past SILENCE_MIN it is. The action's own duration is still held to the timeout."""
    from pipefold.runtime.watch import SILENCE_MIN, frozen_local

    s = _snap(0, "the end of the job", step=2, age=1.0, action=False)
    assert frozen_local(None, s, silent=1.0, age=1.0, timeout=0.3) is None
    assert frozen_local(None, s, silent=SILENCE_MIN + 0.5, age=1.0, timeout=0.3) == "no heartbeat for 2 s"
    assert _hang(_snap(0, "0F1", step=2, age=1.0), timeout=0.3) is not None

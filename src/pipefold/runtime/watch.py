"""Watching the ranks of a job: what each one is doing, whether it still makes progress, and whom to blame.

Each rank keeps an :class:`Activity`: what it is doing now (an action such as ``1B3``, or a phase such as
start-up or the optimizer step), since when, and which ranks it waits for (a receive waits for the rank that
sends, a collective for the other members of its group). Setting it costs the rank one tuple per action. A
thread in the rank, the :class:`Heartbeat`, publishes it every :data:`PERIOD` seconds with a count that goes
up each time: locally into shared memory that the launcher reads (:class:`SharedBoard`), under torchrun into
the job's c10d store (:class:`StoreBoard`), where the other ranks read it.

A job is hung when (:func:`find_hang`):

- a rank has published nothing for longer than the action timeout (its process is stopped, or so busy in
  one call that even its heartbeat thread cannot run), or
- following "waits for" from some rank ends at a rank that waits for nobody and has been in its current
  activity for longer than the action timeout (it computes forever), or in a cycle of ranks that have all
  waited for longer than that (each waits for the next: a deadlock).

A rank that waits long for a peer which keeps making progress (GPipe's first rank waiting for the first
gradient) is not hung. The blame goes to the rank at the end of the chain, not to the ranks waiting for it.

Over emulated links (``--network``) each rank also publishes the message each of its links still holds back
(:class:`~pipefold.runtime.slowlinks.Carried`). A hang in which a rank waits for such a message is a slow link,
not a hung rank, and is reported as one (:func:`~pipefold.runtime.slowlinks.slow_line`); a rank that no longer
publishes is reported as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipefold.runtime.slowlinks import Carried, slow_line

PERIOD = 0.1
"""Seconds between two publications of a rank's activity."""
SILENCE_MIN = 2.0
"""The least silence (seconds without a heartbeat) that counts a local rank as frozen, whatever the action
timeout: 20 periods, which a busy machine can take from the heartbeat's thread (a rank holding the interpreter
while it compiles, or waiting for a core) without the rank being stuck."""
DEFAULT_ACTION_TIMEOUT = 20.0
"""Seconds an action (or a phase between actions) may run, or a rank go without a heartbeat, before the job is
taken as hung. With the launcher's checks and the ranks' shutdown it keeps a hang's end under 30 s."""
CARRIED = 8
"""The most held-back messages a snapshot carries (one per link): a snapshot fits in a slot of shared memory."""
PG_MARGIN = 30.0
"""The process group's own timeout is the action timeout plus this: the watch decides first, and a collective
never waits for the 30 minutes that is torch's default."""


COMPILE_GRACE = 600.0
"""How long an activity may last in the first step a rank runs when its layers are compiled: torch.compile
compiles each layer inside its first passes (the forward in the first F, the backward in the first B), which on a
busy CPU takes longer than any action timeout meant for the passes themselves."""


def pg_timeout(action_timeout: float, *, compiling: bool = False) -> float:
    """The timeout to give torch.distributed's process group for a job with this action timeout; where the layers
    are compiled, long enough for a peer's first step (:data:`COMPILE_GRACE`)."""
    return max(action_timeout, COMPILE_GRACE if compiling else 0.0) + PG_MARGIN


@dataclass(frozen=True)
class Snapshot:
    """One publication of a rank's activity."""

    rank: int
    pid: int
    host: str
    seq: int
    """Counts the publications: a count that stops moving is a rank that stopped."""
    beat: float
    """When it was published (the rank's ``time.time()``)."""
    step: int
    """The number of the step it is in (:func:`~pipefold.runtime.history.step_number`: from 1; 0 before the
    first)."""
    where: str
    """An action (``1B3``) or a phase (``start-up``, ``the optimizer step``)."""
    is_action: bool
    what: str
    """What it waits for (``a gradient``, ``the all-reduce of stage 2``), or empty."""
    waits: tuple[int, ...]
    """The ranks it waits for (process-group ranks), or none."""
    since: float
    """When it began ``where`` (the rank's ``time.time()``)."""
    done: bool = False
    """It has finished the job."""
    carrying: tuple[Carried, ...] = ()
    """The messages its emulated links still hold back: the first of each link (at most :data:`CARRIED`)."""
    grace: float = 0.0
    """The least time its activities in this step may take, whatever the action timeout: the first step's one-off
    work (:data:`COMPILE_GRACE`), or 0."""

    @property
    def age(self) -> float:
        """Seconds in its current activity, as of the publication."""
        return self.beat - self.since

    def at(self) -> str:
        """'2F4 of step 3', 'the optimizer step (step 3)', 'start-up'."""
        if self.step < 1:
            return self.where
        return f"{self.where} of step {self.step}" if self.is_action else f"{self.where} (step {self.step})"

    def to_json(self) -> bytes:
        return json.dumps([self.rank, self.pid, self.host, self.seq, self.beat, self.step, self.where,
                           self.is_action, self.what, list(self.waits[:64]), self.since, self.done,
                           [c.to_list() for c in self.carrying[:CARRIED]], self.grace]).encode()

    @staticmethod
    def from_json(data: bytes) -> Snapshot:
        v = json.loads(data)
        return Snapshot(rank=v[0], pid=v[1], host=v[2], seq=v[3], beat=v[4], step=v[5], where=v[6], is_action=v[7],
                        what=v[8], waits=tuple(v[9]), since=v[10], done=v[11],
                        carrying=tuple(Carried.from_list(c) for c in v[12]) if len(v) > 12 else (),
                        grace=v[13] if len(v) > 13 else 0.0)


class Activity:
    """What this rank is doing now; set by the rank's own thread, read by its heartbeat thread.

    Each setter replaces one tuple, so a reader never sees half of an update.
    """

    publisher: Callable[[], None] | None = None
    """Publishes the activity at once (the rank's :class:`Heartbeat` sets it): see :meth:`publish`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.step = 0  # before the first step (steps are numbered from 1)
        self.grace = 0.0
        """The least time an activity of this step may take (:attr:`Snapshot.grace`)."""
        self.done = False
        self._now: tuple[str, bool, str, tuple[int, ...], float] = ("start-up", False, "", (), time.time())
        self.carrying: Callable[[], Sequence[Carried]] | None = None
        """What tells the messages the rank's emulated links hold back (the links of the schedule it runs)."""

    def run(self, where: str, *, action: bool = True) -> None:
        """It runs ``where`` (an action, or a phase with ``action=False``) and waits for nobody."""
        self._now = (where, action, "", (), time.time())

    def wait(self, where: str, what: str, waits: Sequence[int], *, action: bool = True) -> None:
        """In ``where`` it waits for ``what`` from the ranks ``waits``."""
        self._now = (where, action, what, tuple(waits), time.time())

    def resume(self, where: str, *, action: bool = True) -> None:
        """Back to running ``where`` after a wait (its clock starts again: the wait ended)."""
        self._now = (where, action, "", (), time.time())

    def ended_by(self, peer: int, what: str) -> None:
        """What it was doing ended because ``peer`` stopped (its ``what`` lost): recorded as a wait for that rank,
        so that the rank is blamed rather than this one."""
        where, action = self._now[0], self._now[1]
        self._now = (where, action, what, (peer,), time.time())

    def finish(self) -> None:
        self.done = True

    def publish(self) -> None:
        """Publish the activity now, not at the next heartbeat: for a rare phase (a checkpoint's save, its load),
        so that a rank that dies in it at once is reported there, not in what it did before."""
        if self.publisher is not None:
            self.publisher()

    @property
    def current(self) -> tuple[str, bool, str, tuple[int, ...], float]:
        return self._now

    def snapshot(self, seq: int) -> Snapshot:
        where, is_action, what, waits, since = self._now
        carrying: tuple[Carried, ...] = ()
        if self.carrying is not None:
            with contextlib.suppress(Exception):  # links closing as the step ends: nothing held back to tell
                carrying = tuple(self.carrying())[:CARRIED]
        return Snapshot(rank=self.rank, pid=os.getpid(), host=socket.gethostname(), seq=seq, beat=time.time(),
                        step=self.step, where=where, is_action=is_action, what=what, waits=waits, since=since,
                        done=self.done, carrying=carrying, grace=self.grace)


class SharedBoard:
    """Every local rank's latest snapshot, in shared memory made by the launcher before the ranks start.

    Each slot holds a count and two halves; a rank writes the half the next count selects, then the count, so
    a reader (the launcher) gets a whole snapshot even from a rank killed while writing.
    """

    SLOT = 4096
    _HALF = (SLOT - 8) // 2

    def __init__(self, ctx: Any, world: int) -> None:
        self.world = world
        self._mem = ctx.RawArray("B", world * self.SLOT)
        self._seq = 0

    def publish(self, snap: Snapshot) -> None:
        data = snap.to_json()[: self._HALF - 4]
        base = snap.rank * self.SLOT
        view = memoryview(self._mem).cast("B")
        self._seq += 1
        half = base + 8 + (self._seq % 2) * self._HALF
        struct.pack_into("<I", view, half, len(data))
        view[half + 4: half + 4 + len(data)] = data
        struct.pack_into("<Q", view, base, self._seq)

    def read(self, rank: int) -> Snapshot | None:
        """The rank's latest snapshot, or None if it has published none."""
        view = memoryview(self._mem).cast("B")
        base = rank * self.SLOT
        for _ in range(100):
            (seq,) = struct.unpack_from("<Q", view, base)
            if seq == 0:
                return None
            half = base + 8 + (seq % 2) * self._HALF
            (n,) = struct.unpack_from("<I", view, half)
            data = bytes(view[half + 4: half + 4 + n])
            (again,) = struct.unpack_from("<Q", view, base)
            if again in (seq, seq + 1):  # the half read was not being written
                try:
                    return Snapshot.from_json(data)
                except ValueError:
                    pass
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {"world": self.world, "_mem": self._mem, "_seq": 0}


class StoreBoard:
    """Every rank's latest snapshot in the job's c10d store (under torchrun): each rank writes its own key."""

    PREFIX = "pipefold/watch/"

    def __init__(self, store: Any) -> None:
        self.store = store

    def publish(self, snap: Snapshot) -> None:
        self.store.set(f"{self.PREFIX}{snap.rank}", snap.to_json())

    def read(self, rank: int) -> Snapshot | None:
        key = f"{self.PREFIX}{rank}"
        if not self.store.check([key]):
            return None
        return Snapshot.from_json(self.store.get(key))

    def first_to_abort(self) -> bool:
        """True for the first rank to ask: only it prints why the job stops."""
        return int(self.store.add(f"{self.PREFIX}abort", 1)) == 1


class Heartbeat:
    """A thread that publishes the rank's activity every ``period`` seconds, and then runs ``check``."""

    def __init__(self, activity: Activity, board: SharedBoard | StoreBoard, *, period: float = PERIOD,
                 check: Callable[[], None] | None = None) -> None:
        self.activity, self.board, self.period, self.check = activity, board, period, check
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pipefold-heartbeat", daemon=True)
        self._lock = threading.Lock()  # the rank's thread publishes too (Activity.publish)
        activity.publisher = self._publish_now

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        with self._lock:
            self._publish()

    def _publish_now(self) -> None:
        """A beat from the rank's own thread; skipped if the heartbeat's thread holds the board for long (a store
        that does not answer): the rank never waits on its watch."""
        if self._lock.acquire(timeout=self.period):
            try:
                self._publish()
            finally:
                self._lock.release()

    def _publish(self) -> None:
        self.seq += 1
        with contextlib.suppress(Exception):  # a store gone at the job's end: nothing left to tell
            self.board.publish(self.activity.snapshot(self.seq))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.beat()
            if self.check is not None:
                self.check()

    def stop(self) -> None:
        """Stop the thread and wait for it: one left inside a store call while the process exits made the
        process abort (SIGABRT) at exit, now and then, under torchrun."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period + 10.0)


@dataclass(frozen=True)
class Hang:
    """The rank a hung job is blamed on, and the line that says so."""

    rank: int
    line: str


def _waited_by(rank: int, snaps: Mapping[int, Snapshot | None]) -> list[int]:
    return sorted(r for r, s in snaps.items() if s is not None and r != rank and rank in s.waits and not s.done)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _next(s: Snapshot, snaps: Mapping[int, Snapshot | None]) -> int | None:
    """Which of the ranks ``s`` waits for holds it up: in a collective, a member not in the same collective."""
    late = [r for r in s.waits
            if not ((o := snaps.get(r)) is not None and o.waits and o.where == s.where and o.step == s.step)]
    return late[0] if late else None


def limit(s: Snapshot | None, timeout: float) -> float:
    """How long a rank may stay in its current activity: the action timeout, but at least the default one before
    the first step (start-up imports and builds, whatever timeout a test or a user chose for the
    actions), and at least the step's grace where it has one (the first step of compiled layers)."""
    if s is None or s.step < 1:  # steps are numbered from 1: 0 is before the first
        return max(timeout, DEFAULT_ACTION_TIMEOUT)
    return max(timeout, s.grace)


def find_hang(snaps: Mapping[int, Snapshot | None], ages: Mapping[int, float], frozen: Mapping[int, str],
              timeout: float) -> Hang | None:
    """The rank a job is hung on, or None while it makes progress.

    ``snaps``: every rank's latest snapshot (None: never published). ``ages``: seconds each rank has been in
    its current activity (the launcher's clock locally; as published under torchrun). ``frozen``: ranks that
    no longer publish, each with what is known of why ("its process is stopped"); the caller decides that
    (locally: no heartbeat for longer than the timeout). An activity may last :func:`limit`.
    """
    if frozen:
        # A rank that no longer publishes holds up whoever waits for it: blame the most waited for.
        r = max(sorted(frozen), key=lambda f: len(_waited_by(f, snaps)))
        s = snaps.get(r)
        at = s.at() if s is not None else "start-up"
        waiting = _waited_by(r, snaps)
        tail = f"; {_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} for it" if waiting else ""
        return Hang(r, f"rank {r} hung in {at}: {frozen[r]}{tail}")
    for start in sorted(snaps):
        path = [start]
        cycle: list[int] = []
        while True:
            s = snaps[path[-1]]
            if s is None or s.done or not s.waits:
                break
            nxt = _next(s, snaps)
            if nxt is None or nxt not in snaps:
                break
            if nxt in path:  # a cycle: each waits for the next
                cycle = path[path.index(nxt):]
                break
            path.append(nxt)
        if cycle:
            if all(ages[c] > limit(snaps[c], timeout) for c in cycle):
                first = max(cycle, key=lambda c: ages[c])  # the one that has waited longest started it
                rest = cycle[cycle.index(first):] + cycle[:cycle.index(first)]
                return _slow_link(rest, snaps, timeout) or Hang(first, _waiting_line(first, snaps, ages, timeout))
            continue
        end = path[-1]
        if (last := snaps[end]) is not None and last.done:
            if len(path) == 1:
                continue
            end = path[-2]  # it waits for a rank that has finished: nobody will answer
        s = snaps[end]
        if ages[end] <= limit(s, timeout):
            continue
        if s is None:
            return Hang(end, f"rank {end} hung in start-up: nothing heard from it for {ages[end]:.0f} s")
        if s.waits:  # waits for a rank it cannot name as late (all arrived) or one that finished
            return (_slow_link([end, *reversed(path[:-1])], snaps, timeout)
                    or Hang(end, _waiting_line(end, snaps, ages, timeout)))
        return Hang(end, f"rank {end} hung in {s.at()}: running for {ages[end]:.0f} s, longer than the action "
                         f"timeout of {limit(s, timeout):g} s (--action-timeout)")
    return None


def _slow_link(ranks: Sequence[int], snaps: Mapping[int, Snapshot | None], timeout: float) -> Hang | None:
    """The hang as a slow link, where one of ``ranks`` (in this order) waits for a peer whose emulated link to it
    still holds a message back that makes the wait longer than the action timeout; None where none does. Of the
    messages a link holds back, the last to arrive is the one the rank waits for at the latest (a header goes
    ahead of its activation, and may arrive before the wait began: it explains nothing)."""
    for r in ranks:
        s = snaps.get(r)
        if s is None:
            continue
        for q in s.waits:
            sender = snaps.get(q)
            held = max((c for c in sender.carrying if c.dst == r), key=lambda c: c.arrives, default=None) \
                if sender is not None else None
            if held is not None and sender is not None and held.arrives - s.since > timeout:
                return Hang(r, slow_line(r, s.at(), held, s.since, sender.beat, timeout))
    return None


def _waiting_line(rank: int, snaps: Mapping[int, Snapshot | None], ages: Mapping[int, float], timeout: float) -> str:
    s = snaps[rank]
    assert s is not None
    peers = [r for r in s.waits if r != rank]
    whom = _ranks(peers) if peers and len(peers) <= 4 else "its peers"
    what = f"{s.what} from {whom}" if s.what else whom
    return f"rank {rank} hung in {s.at()}: waiting for {what} for {ages[rank]:.0f} s (action timeout {timeout:g} s)"


def process_state(pid: int) -> str | None:
    """The one-letter state of a local process from /proc (R, S, D, T stopped, t traced, Z zombie), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[0] if ")" in text else None


def frozen_local(pid: int | None, s: Snapshot | None, silent: float, age: float, timeout: float) -> str | None:
    """Why a local rank is taken as no longer publishing, or None while it is not.

    ``s``: its latest snapshot (None: never published); ``silent``: seconds since its last heartbeat; ``age``:
    seconds in its current activity. It is frozen once it has been silent for longer than its :func:`limit`
    (the action timeout; before the first step at least the default one: start-up's imports and process group
    can starve the heartbeat's thread for seconds on a loaded machine) and than :data:`SILENCE_MIN`, or once its
    process is stopped (SIGSTOP, a debugger) and its activity has lasted past that limit. The second comes first
    for a rank stopped in the middle of an action: the action began before the last heartbeat, so its age passes
    the limit before its silence does, and the rank must then be named as stopped, not as computing for too long.
    """
    if silent > max(limit(s, timeout), SILENCE_MIN):
        return why_silent(pid, silent)
    stopped = pid is not None and silent > 2 * PERIOD and process_state(pid) in ("T", "t")
    if stopped and age > limit(s, timeout):
        return why_silent(pid, silent)
    return None


def why_silent(pid: int | None, seconds: float) -> str:
    """Why a local rank does not publish, as far as the system says."""
    state = process_state(pid) if pid is not None else None
    if state in ("T", "t"):
        return f"its process is stopped (SIGSTOP or a debugger), no heartbeat for {seconds:.0f} s"
    if state == "D":
        return f"its process is blocked in the kernel, no heartbeat for {seconds:.0f} s"
    return f"no heartbeat for {seconds:.0f} s"


def die_with_parent() -> None:
    """End this process when its parent dies: the kernel's parent-death signal on Linux, else a thread that
    watches the parent's pid. A rank must not train on once its launcher (or torchrun's agent) is gone."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0:  # PR_SET_PDEATHSIG
                if os.getppid() != parent:  # it died before the call
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pipefold-parent", daemon=True).start()


def exit_when_closed(conn: Any) -> None:
    """End this process once the other end of ``conn`` (a pipe only the launcher holds) closes: the launcher is
    gone, even by ``kill -9``. A local rank's parent is the fork server, which lives as long as its children do,
    so the parent-death signal would not do."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            conn.recv_bytes()
        os._exit(1)

    threading.Thread(target=watch, name="pipefold-launcher", daemon=True).start()


def name_process(name: str) -> None:
    """Name this process as ``ps`` and ``/proc/PID/comm`` show it (Linux; 15 characters at most), so that a
    user (or a test) can tell the ranks apart."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME

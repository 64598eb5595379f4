"""Point-to-point messages between the ranks of one machine, over Unix-domain sockets.

gloo's TCP transport costs a hundred microseconds and more a message on one machine: a round trip of 4 KiB between
two processes took 163 us over gloo, 47 us over these sockets and 19 us over a bare Unix socket (2 cores;
``benchmarks/results/p2p.md``). A message crosses gloo's own threads on both sides, and each hop wakes
a thread on cores the ranks' passes share. A pipeline's activations and gradients are small and many, so on one
machine those hops are most of the runtime's cost between passes.

Here each pair of ranks shares one connected stream socket. A message is a header (its tag and byte count) and
its bytes, written by the sender straight from the tensor's memory and read by the receiver straight into the
buffer it posted: one system call each side when the socket's buffer has room, and the receiving rank's own
thread woken by the kernel, no other. A send is written at once when nothing is queued before it on its link;
otherwise (or for what does not fit the socket's buffer) the rest is written in order by whoever waits on it
(the link's thread, :mod:`pipefold.runtime.comm`). A receive reads the link's messages in the order they were
sent until its own has come; one that comes before its receive was posted is kept until it is. A rank that
dies closes its sockets, and its peers' next read or write fails at once, naming it.

The collectives (gradients' all-reduce, FSDP, tensor parallelism) stay on the process group. :func:`open`
connects every pair of the job's ranks (after the process group, which it uses to agree when every rank
listens) and :func:`current` is what :func:`pipefold.runtime.comm` sends with, until :func:`close`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from pipefold.runtime.socket_paths import folder_with_room, room_for_sockets

__all__ = ["LinkLost", "Sockets", "close", "connect", "current", "linked", "lost_peer"]

_HEAD = struct.Struct("<qq")  # tag, bytes


class LinkLost(RuntimeError):
    """The socket to ``peer`` closed: that rank stopped. An error that came from the peer, not from this rank."""

    def __init__(self, peer: int, why: str = "") -> None:
        super().__init__(f"the link to rank {peer} closed{why}: that rank stopped")
        self.peer = peer


def lost_peer(exc: BaseException | None) -> int | None:
    """The rank whose link's loss caused ``exc`` (itself or, through its causes, what it was raised from)."""
    for _ in range(32):  # a chain of causes, not a cycle
        if exc is None:
            return None
        if isinstance(exc, LinkLost):
            return exc.peer
        exc = exc.__cause__ or exc.__context__
    return None


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while the tensor lives)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _Send:
    """A send: written at once where it could be; :meth:`wait` writes the rest, in the link's order."""

    def __init__(self, link: _Link, tensor: torch.Tensor, tag: int) -> None:
        self._link = link
        self._tensor: torch.Tensor | None = tensor  # its memory is read until written
        payload = _bytes_of(tensor)
        self._left: list[memoryview] = [memoryview(_HEAD.pack(tag, len(payload))), payload]
        self.done = link.write_now(self)

    def advance(self, n: int) -> None:
        """``n`` more bytes were written."""
        while n:
            head = self._left[0]
            if n >= len(head):
                n -= len(head)
                self._left.pop(0)
            else:
                self._left[0], n = head[n:], 0
        while self._left and not len(self._left[0]):
            self._left.pop(0)

    @property
    def left(self) -> list[memoryview]:
        return self._left

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        if not self.done:
            self._link.write_rest(self)
            self.done = True
        self._tensor = None
        return True


class _Recv:
    """A posted receive into ``buffer``; :meth:`wait` reads the link until it has come."""

    def __init__(self, link: _Link, buffer: torch.Tensor, tag: int) -> None:
        self._link, self.tag = link, tag
        self.done = False
        link.post(tag, buffer)

    def is_completed(self) -> bool:
        if not self.done and self._link.poll(self.tag):
            self.wait()
        return self.done

    def wait(self) -> bool:
        if not self.done:
            self._link.take(self.tag)
            self.done = True
        return True


class _Link:
    """The socket to one peer: this rank's sends to it, in order, and its messages to this rank."""

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer, self.sock = peer, sock
        self._write = threading.Lock()
        self._unwritten = 0  # sends posted and not wholly written: later ones wait their turn
        self._read = threading.Lock()
        self._posted: dict[int, torch.Tensor] = {}  # tag -> buffer, not yet filled
        self._early: dict[int, bytearray] = {}  # tag -> bytes that came before their receive was posted
        self._arrived: set[int] = set()  # filled buffers not yet taken

    # Sending.
    def write_now(self, send: _Send) -> bool:
        """Write what the socket takes without blocking, if nothing is queued before it; True if all was."""
        with self._write:
            if self._unwritten == 0:
                try:
                    send.advance(self.sock.sendmsg(send.left, [], socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL))
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise self._lost(exc) from exc
                if not send.left:
                    return True
            self._unwritten += 1
            return False

    def write_rest(self, send: _Send) -> None:
        """Write the rest of ``send``, blocking (only the sends before it, in order, are written before)."""
        try:
            while send.left:
                send.advance(self.sock.sendmsg(send.left, [], socket.MSG_NOSIGNAL))
        except OSError as exc:
            raise self._lost(exc) from exc
        finally:
            with self._write:
                self._unwritten -= 1

    # Receiving.
    def post(self, tag: int, buffer: torch.Tensor) -> None:
        with self._read:
            early = self._early.pop(tag, None)
            if early is None:
                self._posted[tag] = buffer
                return
            self._fill(tag, buffer, len(early))
            _bytes_of(buffer)[:] = early
            self._arrived.add(tag)

    def take(self, tag: int) -> None:
        """Return once the message ``tag`` is in its buffer (reading the messages sent before it)."""
        with self._read:
            while tag not in self._arrived:
                self._read_one()
            self._arrived.discard(tag)

    def poll(self, tag: int) -> bool:
        """Whether ``tag`` has come, reading what has come without waiting for more."""
        with self._read:
            while tag not in self._arrived and select.select([self.sock], [], [], 0)[0]:
                self._read_one()
            return tag in self._arrived

    def _read_one(self) -> None:
        tag, n = _HEAD.unpack(self._exactly(memoryview(bytearray(_HEAD.size))))
        buffer = self._posted.pop(tag, None)
        if buffer is None:
            self._early[tag] = bytearray(n)
            self._exactly(memoryview(self._early[tag]))
            return
        self._fill(tag, buffer, n)
        self._exactly(_bytes_of(buffer))
        self._arrived.add(tag)

    def _fill(self, tag: int, buffer: torch.Tensor, n: int) -> None:
        if n != buffer.numel() * buffer.element_size():
            raise RuntimeError(f"rank {self.peer} sent {n} bytes for message {tag}, and its receive expects "
                               f"{buffer.numel() * buffer.element_size()}: the two ranks run different schedules "
                               "or shapes")

    def _exactly(self, view: memoryview) -> memoryview:
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as exc:
                raise self._lost(exc) from exc
            if n == 0:
                raise self._lost(None)
            got += n
        return view

    def _lost(self, exc: OSError | None) -> LinkLost:
        return LinkLost(self.peer, f" ({exc.strerror or exc})" if exc is not None else "")


class Sockets:
    """This rank's links to every other rank of the job, by process-group rank."""

    def __init__(self, links: dict[int, _Link]) -> None:
        self.links = links

    def isend(self, t: torch.Tensor, to: int, tag: int) -> _Send:
        return _Send(self.links[to], t, tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> _Recv:
        return _Recv(self.links[src], t, tag)

    def close(self) -> None:
        for link in self.links.values():
            link.sock.close()


_current: Sockets | None = None


def current() -> Sockets | None:
    """The links :func:`connect` made in this process, if any."""
    return _current


def connect(directory: str | Path) -> Sockets:
    """Connect this rank to every other rank of the default process group through sockets in ``directory`` (a
    folder every rank sees, short enough for a socket's path: 108 bytes). Each rank listens; after a barrier each
    connects to the ranks above it and accepts the ranks below."""
    global _current
    rank, world = dist.get_rank(), dist.get_world_size()
    path = Path(directory) / f"rank-{rank}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(path))
    listener.listen(world)
    dist.barrier()
    links: dict[int, _Link] = {}
    try:
        for peer in range(rank + 1, world):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(os.fspath(Path(directory) / f"rank-{peer}.sock"))
            sock.sendall(struct.pack("<q", rank))
            links[peer] = _Link(peer, sock)
        for _ in range(rank):
            sock, _addr = listener.accept()
            (peer,) = struct.unpack("<q", sock.recv(8, socket.MSG_WAITALL))
            links[peer] = _Link(peer, sock)
    finally:
        listener.close()
        path.unlink(missing_ok=True)
    _current = Sockets(links)
    return _current


@contextlib.contextmanager
def linked(directory: str | Path | None = None) -> Iterator[Sockets]:
    """This rank connected to every other (:func:`connect`) while entered, closed after. Without ``directory``, or
    when its sockets' paths would be too long for the system (108 bytes), rank 0 makes a short one (its name sent
    to the others over the process group) and removes it at the end."""
    made = None
    if directory is None or not room_for_sockets(directory, f"/rank-{dist.get_world_size()}.sock"):
        name = [folder_with_room("/rank-123456.sock") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(name, src=0)
        directory = made = name[0]
    assert directory is not None
    try:
        yield connect(directory)
    finally:
        close()
        if made is not None and dist.get_rank() == 0:
            shutil.rmtree(made, ignore_errors=True)


def close() -> None:
    """Close this process's links (the peers' reads then fail, naming this rank)."""
    global _current
    if _current is not None:
        _current.close()
        _current = None

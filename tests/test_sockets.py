"""The local ranks' sockets (pipefold.runtime.sockets): real processes, a real gloo group beside them, messages
checked bit for bit against what was sent, out of order, larger than a socket's buffer both ways at once, and a
peer that dies."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any

import pytest
import torch

from conftest import run_ranks

# One tensor of each kind a pipeline sends: dtypes without numpy's support too, a scalar, an empty one.
_KINDS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.uint8]


def _tensor(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _start(rank: int, world: int, init: str, directory: str) -> Any:
    import torch.distributed as dist

    from pipefold.runtime import sockets

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    return sockets.connect(directory)


def _exchange(rank: int, init: str, directory: str, out: Any) -> None:
    """Rank 0 sends every kind of tensor, and a large one; rank 1 posts its receives in another order and takes
    them in yet another; both send a tensor larger than the sockets' buffers to each other at once, each send
    finished by a thread as the runtime's links do."""
    import torch.distributed as dist

    from pipefold.runtime import sockets

    links = _start(rank, 2, init, directory)
    peer = 1 - rank
    shapes = [(3, 5), (7,), (), (0, 4), (2, 3, 4), (1,), (64,), (5, 5)]
    sent = [_tensor(i, dtype, shape) for i, (dtype, shape) in enumerate(zip(_KINDS, shapes, strict=True))]
    big = [_tensor(100 + r, torch.float32, (1 << 21,)) for r in range(2)]  # 8 MiB each way
    ok = True
    if rank == 0:
        works = [links.isend(t, 1, tag) for tag, t in enumerate(sent)]
        finisher = threading.Thread(target=lambda: [w.wait() for w in works])
        finisher.start()
        finisher.join()
        ok &= all(w.is_completed() for w in works)
    else:
        bufs = [torch.empty_like(t) for t in sent]
        time.sleep(0.2)  # every message is in the socket before any receive is posted
        order = [5, 0, 7, 1, 2, 4, 3, 6]
        works = {tag: links.irecv(bufs[tag], 0, tag) for tag in order[:4]}
        ok &= works[5].is_completed()  # in the socket already: polling reads 0 to 5 (2 to 4 kept for later)
        works[1].wait()  # reads 0 into its posted buffer on the way; 1's own (posted) after it
        works.update({tag: links.irecv(bufs[tag], 0, tag) for tag in order[4:]})  # came early: copied on posting
        for tag in [7, 3, 0, 6, 5, 2, 1, 4]:  # 1 a second time: done, as gloo's
            works[tag].wait()
        ok &= all(torch.equal(b, t) and b.dtype == t.dtype for b, t in zip(bufs, sent, strict=True))
    # Both ways at once, each larger than a socket's buffer: the sends' rest written by threads.
    got = torch.empty_like(big[peer])
    send = links.isend(big[rank], peer, 99)
    writer = threading.Thread(target=send.wait)
    writer.start()
    links.irecv(got, peer, 99).wait()
    writer.join()
    ok &= torch.equal(got, big[peer])
    dist.barrier()
    sockets.close()
    dist.destroy_process_group()
    out.put((rank, bool(ok)))


def _dies(rank: int, init: str, directory: str, out: Any) -> None:
    """Rank 1 dies with a receive of rank 0 outstanding; rank 0 is told which rank stopped, at once."""
    links = _start(rank, 2, init, directory)
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    from pipefold.runtime.sockets import lost_peer

    try:
        links.irecv(torch.empty(4), 1, 0).wait()
        out.put((rank, "no error"))
    except RuntimeError as exc:
        out.put((rank, f"{exc} after {time.monotonic() - start:.0f} s"))
    try:  # and a send to it fails rather than hangs; re-raised as the runtime's links do, it still names the peer
        try:
            links.isend(torch.zeros(1 << 22), 1, 1).wait()
        except RuntimeError as exc:
            raise RuntimeError(f"a send to rank 1 failed: {exc}") from exc
        out.put((rank, "no error"))
    except RuntimeError as exc:
        out.put((rank, f"{exc.__cause__} (from rank {lost_peer(exc)})"))


def _mismatch(rank: int, init: str, directory: str, out: Any) -> None:
    """A message whose size is not its receive's: one line, naming the sender."""
    import torch.distributed as dist

    links = _start(rank, 2, init, directory)
    if rank == 0:
        links.isend(torch.zeros(6), 1, 3).wait()
    else:
        try:
            links.irecv(torch.empty(4), 0, 3).wait()
            out.put("no error")
        except RuntimeError as exc:
            out.put(str(exc))
    dist.barrier()


def _long_path(rank: int, init: str, directory: str, out: Any) -> None:
    """A folder whose sockets' paths would be too long for the system: the ranks link through a short one instead,
    and remove it at the end."""
    import torch.distributed as dist

    from pipefold.runtime import sockets

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    deep = os.path.join(directory, "x" * 120)
    os.makedirs(deep, exist_ok=True)
    with sockets.linked(deep) as links:
        t = torch.arange(5.0) if rank == 0 else torch.empty(5)
        (links.isend(t, 1, 0) if rank == 0 else links.irecv(t, 0, 0)).wait()
        short = [os.path.dirname(links.links[1 - rank].sock.getsockname() or links.links[1 - rank].sock.getpeername())]
        dist.barrier()
    dist.barrier()
    out.put((rank, t.tolist(), short[0] != deep and not os.path.exists(short[0])))
    dist.destroy_process_group()


def _run(target: Any, nprocs: int = 2) -> list[Any]:
    directory = tempfile.mkdtemp(prefix="pf-")
    try:
        return run_ranks(target, nprocs, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_messages_arrive_exactly_in_any_order() -> None:
    assert sorted(_run(_exchange)) == [(0, True), (1, True)]


def test_a_dead_peer_is_named_at_once() -> None:
    results = [line for _, line in _run(_dies)]
    assert len(results) == 2, results
    recv, send = results
    assert recv.startswith("the link to rank 1 closed") and recv.endswith("after 0 s"), recv
    assert send.startswith("the link to rank 1 closed") and send.endswith("(from rank 1)"), send


def test_a_message_of_the_wrong_size_is_one_line() -> None:
    (line,) = _run(_mismatch)
    assert line == ("rank 0 sent 24 bytes for message 3, and its receive expects 16: the two ranks run different "
                    "schedules or shapes")


@pytest.mark.parametrize("dtype", _KINDS)
def test_bytes_of_a_tensor_are_its_memory(dtype: torch.dtype) -> None:
    """What a send writes is the tensor's own memory, in place: a change to the tensor shows in the view."""
    from pipefold.runtime.sockets import _bytes_of

    t = _tensor(0, dtype, (4, 3))
    view = _bytes_of(t)
    assert bytes(view) == t.numpy().tobytes() if dtype != torch.bfloat16 else len(view) == 24
    t.view(torch.uint8).reshape(-1)[0] ^= 1
    assert view[0] == t.view(torch.uint8).reshape(-1)[0].item()


@pytest.mark.parametrize("p2p", ["sockets", "gloo"])
def test_the_profile_measures_the_link_a_run_sends_over(p2p: str) -> None:
    """``pipefold profile``'s link, over either transport: a latency and a rate from real round trips."""
    from pipefold.runtime.measure.profiling import measure_link

    latency, bandwidth = measure_link(rounds=3, sizes=(4096, 1 << 16, 1 << 20), p2p=p2p)
    assert 0 < latency < 0.1 and bandwidth > 1e6, (latency, bandwidth)


def test_a_folder_too_deep_for_a_socket_path_is_replaced_by_a_short_one() -> None:
    assert sorted(_run(_long_path)) == [(0, [0.0, 1.0, 2.0, 3.0, 4.0], True), (1, [0.0, 1.0, 2.0, 3.0, 4.0], True)]

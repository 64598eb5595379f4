"""Round trips of one message between two local ranks: over gloo, over pipefold's sockets, and over a bare Unix socket.

Two processes, one thread each, bounce a tensor back and forth: rank 0 sends, rank 1 receives it and sends it
back. Three ways, interleaved size by size and repeat by repeat, so that the machine's drift hits all three:

- gloo: ``torch.distributed.isend``/``irecv`` on the process group, the way pipefold's runtime sent before
  ``--p2p sockets`` and still does across machines;
- sockets: :mod:`pipefold.runtime.sockets`, what ``pipefold train`` uses on one machine (``--p2p auto``);
- bare: a Unix-domain socket pair driven with nothing but the standard library (``sendall``/``recv_into`` of the
  same bytes): the floor for a transport of this kind, with no pipefold code in it.

The round trip's median over the repeats, and the one-way rate (bytes over half the round trip). Run:

    python benchmarks/p2p.py                  # 4 KiB to 16 MiB, 5 repeats
    python benchmarks/p2p.py --steps 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from pipefold.errors import run_script
from pipefold.runtime import sockets
from pipefold.runtime.launch.processes import process_context, store_in

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
WAYS = ("gloo", "sockets", "bare")


def _rounds(nbytes: int) -> int:
    """Round trips per timing: about 20 ms of work at gloo's speed, at least 5."""
    return max(5, min(200, (64 << 20) // max(nbytes, 1) // 8))


def _bounce(way: str, rank: int, t: torch.Tensor, links: Any, bare: socket.socket, rounds: int) -> float:
    peer = 1 - rank
    view = sockets._bytes_of(t)  # the tensor's own memory, as pipefold's sockets write and read it
    start = time.perf_counter()
    for _ in range(rounds):
        for sender in (0, 1):
            if way == "bare":
                if rank == sender:
                    bare.sendall(view)
                else:
                    got = 0
                    while got < len(view):
                        got += bare.recv_into(view[got:])
            elif way == "gloo":
                work = dist.isend(t, peer, tag=1) if rank == sender else dist.irecv(t, peer, tag=1)
                assert work is not None
                work.wait()
            else:
                (links.isend(t, peer, 1) if rank == sender else links.irecv(t, peer, 1)).wait()
    return (time.perf_counter() - start) / rounds


def _rank(rank: int, init: str, directory: str, sizes: list[int], repeats: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    path = os.path.join(directory, "bare.sock")
    if rank == 0:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        dist.barrier()
        bare, _ = listener.accept()
        listener.close()
    else:
        dist.barrier()
        bare = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bare.connect(path)
    times: dict[str, dict[int, list[float]]] = {way: {n: [] for n in sizes} for way in WAYS}
    with sockets.linked(directory) as links:
        for _ in range(repeats + 1):  # the first round of each is a warm-up, left out
            for n in sizes:
                t = torch.zeros(n // 4)
                for way in WAYS:
                    dist.barrier()
                    times[way][n].append(_bounce(way, rank, t, links, bare, _rounds(n)))
        dist.barrier()
    bare.close()
    if rank == 0:
        out.put({way: {n: ts[1:] for n, ts in per.items()} for way, per in times.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed repeats of each size and way (default 5)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), metavar="BYTES",
                        help="message sizes in bytes, multiples of 4 (default 4 KiB, 64 KiB, 1 MiB, 16 MiB)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps is the timed repeats: at least 1 (got {args.steps})")
    if any(n < 4 or n % 4 for n in args.sizes):
        parser.error("--sizes are bytes of float32 tensors: multiples of 4, at least 4")
    os.environ["OMP_NUM_THREADS"] = "1"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pf-p2p-") as directory:
        ctx = process_context()  # as the runtime starts its ranks: from a fork server that has imported torch
        out = ctx.SimpleQueue()
        mp.start_processes(_rank, args=(store_in(directory), directory, args.sizes, args.steps, out), nprocs=2,
                           start_method=ctx.get_start_method())
        times = out.get()
    rows = [{"bytes": n, **{f"{way}_us": round(1e6 * statistics.median(times[way][n]), 1) for way in WAYS},
             **{f"{way}_spread_us": [round(1e6 * min(times[way][n]), 1), round(1e6 * max(times[way][n]), 1)]
                for way in WAYS}} for n in args.sizes]
    if args.json:
        print(json.dumps({"repeats": args.steps, "cpus": os.cpu_count(), "torch_version": torch.__version__,
                          "seconds": round(time.perf_counter() - started, 1), "rows": rows}))
        return
    console = Console(markup=False)
    if not console.is_terminal:
        console.width = 120
    table = Table(title=f"round trip of one message between 2 local ranks, median of {args.steps} "
                        "(min..max); one-way rate", title_justify="left")
    for name in ("bytes", *(f"{w} (us)" for w in WAYS), "gloo / sockets", "sockets / bare", "sockets rate"):
        table.add_column(name, justify="right")
    for row in rows:
        n = row["bytes"]
        low_high = {w: row[f"{w}_spread_us"] for w in WAYS}
        cells = [f"{row[f'{w}_us']:,.1f} ({low_high[w][0]:,.0f}..{low_high[w][1]:,.0f})" for w in WAYS]
        table.add_row(f"{n:,}", *cells,
                      f"{row['gloo_us'] / row['sockets_us']:.1f}", f"{row['sockets_us'] / row['bare_us']:.2f}",
                      f"{n / (row['sockets_us'] / 2) / 1e3:,.2f} GB/s")
    console.print(table)
    console.print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    run_script(main)

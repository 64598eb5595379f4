"""Network namespaces on veth links capped by tc: rates measured with plain sockets, gloo across them, cleanup."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pipefold.errors import ConfigError
from pipefold.runtime.launch import netns

REASON = netns.unavailable()
if REASON is not None:
    pytest.skip(f"network namespaces cannot be made here: {REASON}", allow_module_level=True)

RECEIVER = r'''
import socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
conn, _ = server.accept()
n, t0 = 0, None
while True:
    b = conn.recv(1 << 16)
    if not b:
        break
    t0 = t0 or time.time()
    n += len(b)
print(n / (time.time() - t0))
'''
SENDER = r'''
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        time.sleep(0.05)
data = bytes(1 << 16)
for _ in range(int(sys.argv[3])):
    s.sendall(data)
s.close()
'''


def _throughput(t: netns.Topology, src: int, dst: int, mib: int, port: int = 46100) -> float:
    """Bytes per second a plain TCP connection from ``src``'s namespace to ``dst``'s gets, as the receiver saw."""
    recv = subprocess.Popen(["ip", "netns", "exec", t.namespace(dst), sys.executable, "-c", RECEIVER, str(port)],
                            stdout=subprocess.PIPE, text=True)
    subprocess.run(["ip", "netns", "exec", t.namespace(src), sys.executable, "-c", SENDER, t.addresses[dst],
                    str(port), str(mib * 16)], check=True, timeout=60)
    out, _ = recv.communicate(timeout=60)
    return float(out)


def _namespaces() -> set[str]:
    return {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                       check=True).stdout.splitlines() if line}


def test_tbf_caps_each_rank_and_a_flood_preempts_the_link() -> None:
    with netns.namespaces(2, 20e6) as t:
        idle = _throughput(t, 0, 1, 8)
        assert idle == pytest.approx(20e6, rel=0.2)
        with netns.Flood(t, 0, 1, [(0.0, 120.0)], time.time(), streams=2):
            time.sleep(0.5)
            flooded = _throughput(t, 0, 1, 3, port=46101)
        assert flooded < 0.7 * idle
        # The flood is over: the link is idle again.
        assert _throughput(t, 0, 1, 4, port=46102) == pytest.approx(20e6, rel=0.2)


def _gloo_rank(topology: netns.Topology, rank: int, port: int, out: object) -> None:
    import os

    netns.enter(topology, rank)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{topology.addresses[0]}:{port}", rank=rank, world_size=2)
    x = torch.arange(262144, dtype=torch.float32)  # 1 MiB
    if rank == 0:
        start = time.time()
        dist.send(x, 1)
        dist.recv(x, 1)
        out.put(("seconds", time.time() - start))  # type: ignore[attr-defined]
    else:
        y = torch.empty_like(x)
        dist.recv(y, 0)
        out.put(("equal", bool(torch.equal(x, y))))  # type: ignore[attr-defined]
        dist.send(y, 0)
    dist.destroy_process_group()


def test_gloo_crosses_the_capped_links() -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with netns.namespaces(2, 10e6) as t:
        results = ctx.Queue()
        # Rank 0's namespace is new: nothing listens there, any port is free.
        procs = [ctx.Process(target=_gloo_rank, args=(t, r, 29500, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        got = dict(results.get(timeout=5) for _ in range(2))
    assert all(p.exitcode == 0 for p in procs)
    assert got["equal"] is True
    # 1 MiB each way at 10 MB/s: at least 0.2 s over the capped links (on loopback it takes about a millisecond).
    assert got["seconds"] > 2 * 1048576 / 10e6 * 0.9


def test_destroy_leaves_nothing_and_the_context_cleans_up_after_an_error() -> None:
    with pytest.raises(RuntimeError, match="boom"), netns.namespaces(2, 1e6) as t:
        assert {t.namespace(0), t.namespace(1)} <= _namespaces()
        raise RuntimeError("boom")
    assert not {t.namespace(0), t.namespace(1)} & _namespaces()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert t.bridge not in links


def test_stale_topologies_of_dead_processes_are_removed() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pid = int(dead.stdout)
    subprocess.run(["ip", "netns", "add", f"pf{pid}-0"], check=True)
    try:
        assert f"pf{pid}-0" in netns.cleanup_stale()
        assert f"pf{pid}-0" not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", f"pf{pid}-0"], capture_output=True, check=False)


def test_command_line_up_and_down() -> None:
    run = [sys.executable, "-m", "pipefold.runtime.launch.netns"]
    assert subprocess.run([*run, "check"], capture_output=True, text=True).stdout.strip() == "ok"
    up = subprocess.run([*run, "up", "--ranks", "2", "--rate", "8MB/s"], capture_output=True, text=True, check=True)
    prefix = up.stdout.split()[0]
    assert {f"{prefix}-0", f"{prefix}-1"} <= _namespaces()
    subprocess.run([*run, "down", prefix], check=True)
    assert not {f"{prefix}-0", f"{prefix}-1"} & _namespaces()
    bad = subprocess.run([*run, "up", "--ranks", "2", "--rate", "fast"], capture_output=True, text=True)
    assert bad.returncode != 0 and "cannot read the rate" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("text, want", [("40MB/s", 40e6), ("320Mbit", 40e6), ("5e6", 5e6), ("1.5kB", 1500)])
def test_rates(text: str, want: float) -> None:
    assert netns.parse_rate(text) == pytest.approx(want)


def test_a_bad_rate_is_one_line() -> None:
    with pytest.raises(ConfigError, match="cannot read the rate"):
        netns.parse_rate("quick")


def test_train_over_namespaces_is_held_to_the_capped_rate() -> None:
    # Rank 0 sends four 512 KiB activations a step through a tbf of 8 MB/s: at least 0.26 s a step, whatever
    # the socket buffers absorb (their few hundred KiB go at once; the rest waits for tokens).
    from pipefold.train.run import train
    from pipefold.train.spec import RunSpec

    config = RunSpec.flat(schedule="1f1b", devices=2, microbatches=4, steps=3, model="mlp", layers=4, hidden=512,
                         batch=1024, partition="even", optimizer="sgd", network="constant:bandwidth=8MB", netns=True)
    job, reports = train(config)
    assert job.netns is not None and job.network is None
    sent = 4 * 256 * 512 * 4
    for i in (1, 2):
        assert max(r.steps[i].wall for r in reports) > 0.7 * sent / 8e6
    assert not {job.netns.namespace(0), job.netns.namespace(1)} & _namespaces()

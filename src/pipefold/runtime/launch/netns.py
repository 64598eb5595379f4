"""Real network links on one machine: each rank in its own network namespace, capped by tc, preempted by a flood.

A :class:`Topology` of p ranks is p network namespaces, each with one veth link to a bridge in the root
namespace::

    ns pf<pid>-0 [pf0 10.231.X.1] --veth-- +
    ns pf<pid>-1 [pf0 10.231.X.2] --veth-- + bridge pf<pid>br (root namespace)
    ...                                    +

Inside each namespace the interface ``pf0`` sends through a tbf qdisc that caps what the rank sends at
``rate`` bytes per second, whoever it sends to. A rank process calls :func:`enter` before it makes any
socket, so torch.distributed's gloo connections (and its store) cross these links: every byte between
two ranks goes through two veths, a bridge and a token bucket, as on a real network path.

A :class:`Flood` preempts the link between two ranks: during the given periods, TCP connections from
one rank's namespace to the other's send as fast as the token bucket lets them, and the pipeline's own
traffic gets what is left (TCP shares a bottleneck about equally between connections, so with n
flood connections about 1/(n + 1) of the rate). tbf has no delay to add; latency is the machine's.

Everything needs root (or CAP_NET_ADMIN) and the ``ip`` and ``tc`` tools; :func:`unavailable` says in one
line why not where they are missing. Namespaces are named after the creating process, so
:func:`cleanup_stale` can remove those of a process that died without removing its own.

    python -m pipefold.runtime.launch.netns check                     # 'ok', or why not
    python -m pipefold.runtime.launch.netns up --ranks 4 --rate 40MB/s  # a topology to use by hand (torchrun)
    python -m pipefold.runtime.launch.netns down pf1234                # remove it (--stale: every dead one)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pipefold.errors import ConfigError, say

INTERFACE = "pf0"
"""The interface's name inside every namespace (each namespace has its own names)."""
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PREFIX = re.compile(r"^pf(\d+)(?:-\d+|br|h\d+)$")
_unavailable: list[str | None] = []


def _run(*cmd: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command (inside ``netns`` when given); a failure is one ConfigError line."""
    full = ["ip", "netns", "exec", netns, *cmd] if netns else list(cmd)
    done = subprocess.run(full, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise ConfigError(f"`{' '.join(full)}` failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done


def unavailable() -> str | None:
    """None when namespaces, veth links and a tbf qdisc can be made here; else one line saying why."""
    if not _unavailable:
        _unavailable.append(_probe())
    return _unavailable[0]


def _probe() -> str | None:
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} tool is missing (Debian: apt install iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root (or CAP_NET_ADMIN)"
    name = f"pfchk{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "link", "add", "pfchkv0", "netns", name, "type", "veth", "peer", "name", "pfchkv1", "netns", name)
        _run("tc", "qdisc", "add", "dev", "pfchkv0", "root", "tbf", "rate", "8mbit", "burst", "32kb", "latency",
             "50ms", netns=name)
    except ConfigError as exc:
        return f"cannot make a network namespace with a tbf-capped veth link here: {exc}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


@dataclass(frozen=True)
class Topology:
    """Network namespaces joined by a bridge, one per rank; see the module's description."""

    prefix: str
    ranks: int
    addresses: tuple[str, ...]
    interface: str
    rate: float
    """Bytes per second each rank may send (tbf on its interface)."""

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}-{rank}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"


def parse_rate(text: str) -> float:
    """'40MB/s', '40MB', '320Mbit', '5e6' -> bytes per second."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+]?[0-9]+)?)\s*([kmg]?)(b|bit|bps)?(/s)?\s*", text.lower())
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(f"cannot read the rate {text!r}: give bytes per second such as 40MB/s or 5e6, "
                          "or bits such as 320Mbit")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return value / 8 if match.group(3) in ("bit", "bps") else value


def _subnet() -> int:
    """A third octet for 10.231.X.0/24 that no interface of this machine uses."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    for offset in range(250):
        x = (os.getpid() + offset) % 250 + 1
        if f"10.231.{x}." not in used:
            return x
    raise ConfigError("no free subnet 10.231.X.0/24 left for network namespaces; remove some with "
                      "`python -m pipefold.runtime.launch.netns down --stale`")


def create(ranks: int, rate: float, *, burst: int | None = None) -> Topology:
    """Make ``ranks`` namespaces joined by a bridge, each one's sending capped at ``rate`` bytes per second.

    ``burst``: the token bucket's depth in bytes (default: what the rate sends in 4 ms, at least 32 KiB;
    a deeper bucket lets a whole message out at the wire's speed). Anything made is removed again if a
    step fails.
    """
    reason = unavailable()
    if reason is not None:
        raise ConfigError(reason)
    if ranks < 1:
        raise ConfigError(f"a topology needs at least one rank (got {ranks})")
    if not rate > 0:
        raise ConfigError(f"the rate is bytes per second > 0 (got {rate})")
    x = _subnet()
    prefix = f"pf{os.getpid()}"
    topology = Topology(prefix, ranks, tuple(f"10.231.{x}.{r + 1}" for r in range(ranks)), INTERFACE, rate)
    depth = burst if burst is not None else max(32 * 1024, int(rate * 0.004))
    try:
        _run("ip", "link", "add", topology.bridge, "type", "bridge")
        _run("ip", "link", "set", topology.bridge, "up")
        for r in range(ranks):
            ns, host, inner = topology.namespace(r), f"{prefix}h{r}", f"{prefix}n{r}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", host, "master", topology.bridge, "up")
            _run("ip", "link", "set", inner, "name", INTERFACE, netns=ns)
            _run("ip", "addr", "add", f"{topology.addresses[r]}/24", "dev", INTERFACE, netns=ns)
            _run("ip", "link", "set", INTERFACE, "up", netns=ns)
            _run("ip", "link", "set", "lo", "up", netns=ns)
            _run("tc", "qdisc", "add", "dev", INTERFACE, "root", "tbf", "rate", f"{int(rate * 8)}bit", "burst",
                 str(depth), "latency", "20ms", netns=ns)
    except BaseException:
        destroy(topology)
        raise
    return topology


def destroy(topology: Topology) -> None:
    """Remove the topology's namespaces (their veths go with them) and bridge; missing pieces are fine."""
    for r in range(topology.ranks):
        _run("ip", "netns", "del", topology.namespace(r), check=False)
        _run("ip", "link", "del", f"{topology.prefix}h{r}", check=False)
    _run("ip", "link", "del", topology.bridge, check=False)


@contextlib.contextmanager
def namespaces(ranks: int, rate: float, **kw: Any) -> Iterator[Topology]:
    """:func:`create`, then :func:`destroy` whatever happens."""
    topology = create(ranks, rate, **kw)
    try:
        yield topology
    finally:
        destroy(topology)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove the namespaces and bridges of topologies whose creating process is gone; return their names."""
    removed = []
    names = [line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines() if line]
    links = [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", "show", check=False).stdout,
                                             re.M)]
    for name in [*names, *links]:
        match = _PREFIX.match(name)
        if match and not _alive(int(match.group(1))):
            cmd = ("ip", "netns", "del", name) if name in names else ("ip", "link", "del", name)
            if _run(*cmd, check=False).returncode == 0:
                removed.append(name)
    return removed


def enter(topology: Topology, rank: int) -> None:
    """Move the calling thread into ``rank``'s namespace and have gloo use its interface.

    Call it first thing in a fresh process, before any socket or thread exists: threads made later
    inherit the namespace, sockets made earlier stay where they were.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{topology.namespace(rank)}") as fh:
        if libc.setns(fh.fileno(), _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise ConfigError(f"cannot enter network namespace {topology.namespace(rank)}: {os.strerror(err)}")
    os.environ["GLOO_SOCKET_IFNAME"] = topology.interface


def sent_bytes(topology: Topology, rank: int) -> int:
    """Bytes ``rank``'s interface has sent so far, as its tbf qdisc counted them (every packet, headers included)."""
    shown = _run("tc", "-s", "qdisc", "show", "dev", topology.interface, netns=topology.namespace(rank)).stdout
    match = re.search(r"Sent (\d+) bytes", shown)
    if match is None:
        raise ConfigError(f"tc shows no count of the bytes sent in {topology.namespace(rank)}: {shown.strip()!r}")
    return int(match.group(1))


class Flood:
    """Traffic that preempts the link ``src`` -> ``dst`` during the periods ``on`` (seconds from ``origin``, a
    ``time.time()``): ``streams`` TCP connections send as fast as they can; ``bidirectional`` floods
    ``dst`` -> ``src`` too. Runs in subprocesses inside the namespaces; :meth:`stop` ends them."""

    def __init__(self, topology: Topology, src: int, dst: int, on: Sequence[tuple[float, float]], origin: float,
                 *, streams: int = 2, bidirectional: bool = False) -> None:
        for r in (src, dst):
            if not 0 <= r < topology.ranks:
                raise ConfigError(f"rank {r} is not in the topology (ranks 0..{topology.ranks - 1})")
        if src == dst:
            raise ConfigError("a flood needs two different ranks")
        self.topology, self.on, self.origin, self.streams = topology, list(on), origin, streams
        self.pairs = [(src, dst), (dst, src)] if bidirectional else [(src, dst)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, timeout: float = 60.0) -> None:
        """Start the sinks and the floods, and return once each is ready: a sink listening, a flood through to its
        sink. A period that has begun then floods at once, however long the processes took to start on a busy
        machine (a fixed wait once let a measurement finish before the flood's first byte)."""
        periods = ",".join(f"{a:.3f}:{b:.3f}" for a, b in self.on)
        for i, (src, dst) in enumerate(self.pairs):
            port = 47000 + i
            for ns, args in ((self.topology.namespace(dst), ["sink", "--port", str(port)]),
                             (self.topology.namespace(src), ["flood", "--to", self.topology.addresses[dst],
                                                             "--port", str(port), "--on", periods or "0:0",
                                                             "--origin", repr(self.origin),
                                                             "--streams", str(self.streams)])):
                # This file run as a script: ``-m pipefold.runtime.launch.netns`` would import the runtime, and torch.
                proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                self.procs.append(proc)
                self._wait_ready(proc, args[0], timeout)

    def _wait_ready(self, proc: subprocess.Popen[bytes], what: str, timeout: float) -> None:
        """Wait for ``proc`` to print its "ready" line; one error if it ends or stays silent instead."""
        import selectors

        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            line = proc.stdout.readline() if sel.select(timeout) else b""
        if line.strip() != b"ready":
            self.stop()
            raise RuntimeError(f"the {what} of a flood did not start within {timeout:.0f} s (exit code "
                               f"{proc.poll()})")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        self.procs.clear()

    def __enter__(self) -> Flood:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """Have the kernel end this process when the one that started it ends (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _sink(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port), backlog=64)
    print("ready", flush=True)

    def drain(conn: socket.socket) -> None:
        with conn:
            while conn.recv(1 << 16):
                pass

    while True:
        conn, _ = server.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def _flood(to: str, port: int, periods: list[tuple[float, float]], origin: float, streams: int) -> None:
    chunk = bytes(1 << 16)

    def blast(until: float) -> None:
        while time.time() < until:  # (re)connect: the sink may not listen yet
            try:
                with socket.create_connection((to, port), timeout=1) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 17)
                    s.settimeout(0.2)
                    while time.time() < until:
                        with contextlib.suppress(TimeoutError):
                            s.send(chunk)
            except OSError:
                time.sleep(0.05)

    deadline = time.monotonic() + 30
    while True:  # through to the sink once before saying so: the first period then starts on time
        try:
            socket.create_connection((to, port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    print("ready", flush=True)
    for start, end in periods:
        if origin + end <= time.time():
            continue
        time.sleep(max(0.0, origin + start - time.time()))
        workers = [threading.Thread(target=blast, args=(origin + end,), daemon=True) for _ in range(streams)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipefold.runtime.launch.netns",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="say whether namespaces can be made here")
    p = sub.add_parser("up", help="make a topology and print its prefix and addresses")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--rate", required=True, help="bytes per second each rank may send, e.g. 40MB/s or 320Mbit")
    p = sub.add_parser("down", help="remove a topology (by prefix), or with --stale every one whose creator died")
    p.add_argument("prefix", nargs="?")
    p.add_argument("--stale", action="store_true")
    p = sub.add_parser("sink")
    p.add_argument("--port", type=int, required=True)
    p = sub.add_parser("flood")
    p.add_argument("--to", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--on", required=True, help="start:end,... seconds from --origin")
    p.add_argument("--origin", type=float, required=True)
    p.add_argument("--streams", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            reason = unavailable()
            print("ok" if reason is None else reason)
            return 0 if reason is None else 1
        if args.command == "up":
            topology = create(args.ranks, parse_rate(args.rate))
            print(f"{topology.prefix} " + " ".join(topology.addresses))
            say(f"run rank r with: ip netns exec {topology.prefix}-r env GLOO_SOCKET_IFNAME={INTERFACE} ... ; "
                f"remove with: python -m pipefold.runtime.launch.netns down {topology.prefix}")
            return 0
        if args.command == "down":
            if args.stale:
                print(" ".join(cleanup_stale()) or "nothing stale")
                return 0
            if not args.prefix or not re.fullmatch(r"pf\d+", args.prefix):
                raise ConfigError("give the prefix `up` printed (such as pf1234), or --stale")
            names = [n for n in _run("ip", "netns", "list").stdout.split() if n.startswith(args.prefix + "-")]
            ranks = 1 + max((int(n.rsplit("-", 1)[1]) for n in names), default=-1)
            destroy(Topology(args.prefix, ranks, (), INTERFACE, 1.0))
            return 0
        _die_with_parent()
        if args.command == "sink":
            _sink(args.port)
            return 0
        periods = [(float(a), float(b)) for a, b in (x.split(":") for x in args.on.split(","))]
        _flood(args.to, args.port, periods, args.origin, args.streams)
        return 0
    except ConfigError as exc:
        say(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

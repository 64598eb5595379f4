"""Links too slow for the action timeout: a message that cannot arrive in time is a slow link, not a hung rank.

A rank waits for a message at most the action timeout (``--action-timeout``, :mod:`pipefold.runtime.watch`).
Over an emulated link (``--network``, :class:`~pipefold.sim.network.Network`) a message of n bytes put on the
wire in a state of latency L and bandwidth B takes L + n / B, so the network says whether it can arrive in time:

- before the work (:func:`check_network`), where the network makes it certain: a link that carries a stage's
  message and takes longer than the timeout even at its best over the whole profile (its least latency, its
  most bandwidth) is refused in one line, with the timeout or the bandwidth that would do;
- during the run (:class:`Carried`): each rank publishes with its activity the message each of its emulated
  links still holds back, and a hang in which a rank waits for one of them is reported as that slow link
  (:func:`slow_line`): the message's size, the link's latency and bandwidth, how long the transfer takes. A rank
  that stopped or died is reported as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipefold.errors import ConfigError
from pipefold.sim.network import LinkState
from pipefold.units import format_bytes

if TYPE_CHECKING:
    from pipefold.ir import Schedule
    from pipefold.sim.network import Link, Network

__all__ = ["MAX_ACTION_TIMEOUT", "Carried", "advice", "check_network", "slow_line", "stage_messages"]

MAX_ACTION_TIMEOUT = 86400.0
"""The longest action timeout the runtime takes (a day): a message that needs longer never arrives in time."""


@dataclass(frozen=True)
class Carried:
    """A message an emulated link still holds back, as the sending rank publishes it (wall-clock times)."""

    src: int
    """The sending rank."""
    dst: int
    """The receiving rank."""
    what: str
    """'an activation', 'a gradient', 'the shapes of an activation'."""
    nbytes: int
    posted: float
    """When the sender posted it."""
    sent: float
    """When it went on the wire: once the messages before it on the link had left."""
    arrives: float
    latency: float
    """The link's latency when it went on the wire (seconds)."""
    bandwidth: float
    """The link's bandwidth then (bytes per second; inf: no limit)."""

    @property
    def transfer(self) -> float:
        """Seconds from the wire to the receiver: its bytes at the link's bandwidth, then the latency."""
        return self.arrives - self.sent

    def to_list(self) -> list[Any]:
        bandwidth = None if math.isinf(self.bandwidth) else self.bandwidth
        return [self.src, self.dst, self.what, self.nbytes, round(self.posted, 3), round(self.sent, 3),
                round(self.arrives, 3), self.latency, bandwidth]

    @staticmethod
    def from_list(v: list[Any]) -> Carried:
        return Carried(src=v[0], dst=v[1], what=v[2], nbytes=v[3], posted=v[4], sent=v[5], arrives=v[6],
                       latency=v[7], bandwidth=math.inf if v[8] is None else v[8])


def rate(bandwidth: float, *, up: bool = False) -> str:
    """A bandwidth in the units a spec takes, to two decimals or (``up``: what a suggestion needs) rounded up to
    two figures: '1 B/s', '3.28 KB/s', '52 MB/s', 'unlimited'."""
    if math.isinf(bandwidth):
        return "unlimited"
    unit, size = next(((u, n) for u, n in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)) if bandwidth >= n), ("B", 1.0))
    value = bandwidth / size
    return f"{_up(value) if up else round(value, 2):g} {unit}/s"


def seconds(x: float) -> str:
    """'0.25 s', '21.6 s', '32768 s'."""
    return f"{x:.0f} s" if x >= 100 else f"{x:.3g} s"


def _up(x: float) -> float:
    """``x`` rounded up to two significant figures (what a suggestion gives: enough, and easy to type), a
    millionth's excess aside (30.00003 s of latency and bytes asks for 30 s, not 31)."""
    if x <= 0:
        return 0.0
    scale = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / scale * (1 - 1e-6)) * scale


def advice(nbytes: float, latency: float, needed: float, timeout: float) -> str:
    """What would let a message of ``nbytes`` over a link of ``latency`` arrive within the action timeout, when it
    ``needed`` seconds against ``timeout``: a longer timeout (where one is allowed), or a faster link."""
    fixes = [f"raise --action-timeout above {_up(needed):g} s"] if needed <= MAX_ACTION_TIMEOUT else []
    if latency >= timeout:
        fixes.append(f"give the link a latency under {timeout:g} s")
    elif nbytes > 0:
        fixes.append(f"give the link a bandwidth of at least {rate(nbytes / (timeout - latency), up=True)}")
    out = " or ".join(fixes)
    if needed > MAX_ACTION_TIMEOUT:
        out += f" (no --action-timeout is that long: it is at most {MAX_ACTION_TIMEOUT:g} s)"
    return out


def _state(latency: float, bandwidth: float) -> str:
    return f"latency {latency:g} s, bandwidth {rate(bandwidth)}"


def stage_messages(schedule: Schedule, nbytes: int) -> dict[Link, tuple[int, str]]:
    """The links a training step of ``schedule`` certainly uses, each with the message it carries: between the
    devices of microbatch 0's consecutive stages, an activation of ``nbytes`` forward and its gradient back."""
    out: dict[Link, tuple[int, str]] = {}
    for s in range(schedule.stages - 1):
        a, b = schedule.device_of(s, 0), schedule.device_of(s + 1, 0)
        if a != b:
            out.setdefault((a, b), (nbytes, "an activation"))
            if not schedule.is_forward_only:
                out.setdefault((b, a), (nbytes, "a gradient"))
    return out


def check_network(network: Network, timeout: float, messages: Mapping[Link, tuple[int, str]], *, flag: str,
                  latency: bool = True, exact: bool = True) -> None:
    """Refuse, in one line, a network on which some message of ``messages`` (per directed link between devices:
    its bytes and what it is) takes longer than the action timeout ``timeout`` at every moment of the profile:
    the rank that waits for it would be taken as hung. ``flag`` names the network as the user gave it; without
    ``latency`` (network namespaces, which cap the bandwidth alone) only the bytes count, at the network's most
    bandwidth; without ``exact`` the bytes are the least a message has (and the line says "at least")."""
    worst: tuple[float, Link, LinkState, int, str, bool] | None = None
    fastest = max(s.bandwidth for c in (network.default, *network.links.values()) for s in c.states)
    for link, (nbytes, what) in sorted(messages.items()):
        conditions = network.conditions(*link)
        best = conditions.best
        if not latency:
            best = LinkState(0.0, fastest)
        needed = best.carries(nbytes)
        if needed > timeout and (worst is None or needed > worst[0]):
            worst = (needed, link, best, nbytes, what, len(set(conditions.states)) > 1 and latency)
    if worst is None:
        return
    needed, (a, b), best, nbytes, what, varies = worst
    least = "at least " if varies or not exact else ""
    size = f"{what} of {'' if exact else 'at least '}{format_bytes(nbytes)}" if nbytes else what
    state = (f"its least latency {best.latency:g} s and most bandwidth {rate(best.bandwidth)} over the whole "
             "profile" if varies else _state(best.latency, best.bandwidth))
    raise ConfigError(f"{flag} is too slow for --action-timeout {timeout:g}: link {a}->{b} takes {least}"
                      f"{seconds(needed)} to carry {size} ({state}), and a rank waits at most {timeout:g} s for it: "
                      f"{advice(nbytes, best.latency, needed, timeout)}")


def slow_line(rank: int, at: str, carried: Carried, since: float, now: float, timeout: float) -> str:
    """The line of a hang in which rank ``rank``, in ``at`` since ``since``, waits for ``carried``: the link is slow,
    not the rank hung. ``now``: when the sender published it (the times are wall-clock)."""
    c = carried
    queued = c.sent - c.posted
    behind = f", after {queued:.0f} s behind the messages sent before it" if queued >= 1 else ""
    size = f"its {format_bytes(c.nbytes)}" if c.nbytes else "it"
    wait = c.arrives - since
    return (f"rank {rank} waits in {at} for {c.what} from rank {c.src} over a slow link, not a hung rank: the "
            f"emulated link {c.src}->{rank} ({_state(c.latency, c.bandwidth)}) takes {seconds(c.transfer)} to carry "
            f"{size}{behind}, so it arrives in {seconds(max(0.0, c.arrives - now))}, a wait of {seconds(wait)}, "
            f"longer than the action timeout of {timeout:g} s: {advice(c.nbytes, c.latency, wait, timeout)}")

"""Network conditions that change over time: each link's latency and bandwidth, piecewise constant.

A :class:`Network` says, for every directed link between two devices, what its
latency (seconds) and bandwidth (bytes per second) are at each moment of a run,
counted in seconds from the run's start. It is what the simulator predicts
with (:func:`pipefold.sim.simulate.simulate` with ``network=``), what the runtime's
links inject into real transfers (``pipefold train --network``), and what the
network namespaces of ``pipefold train --netns`` emulate with ``tc``.

A link carries one message at a time, in the order sent (a :class:`Wire`): a
message of n bytes leaves once the one before it has left, takes the time its
bytes need at the bandwidth of each moment it spends on the wire, and arrives
one latency later. Three ways to make one:

    Network.constant(latency, bandwidth)                       every link, always
    Network.preemption(seed=..., idle=..., preempted=..., ...)  seeded on/off periods
    Network.load(path)                                         a JSON or CSV profile

Spec strings (the command line) name the same: ``constant:latency=1e-4,bandwidth=50MB``,
``preempt:seed=1,idle=100MB,busy=5MB,on=4,off=4,links=1-2``, or a file path.

Every number is checked, in one line that gives the range that works: a latency is 0 to :data:`MAX_LATENCY`
seconds and a bandwidth above 0 (``inf``: no limit) on any link, a profile's times are finite, a preemption's
periods 1 ms to a day and at most :data:`MAX_PERIODS` of them; a spec or a profile file's bandwidth (bytes per
second) is also :data:`MIN_BANDWIDTH` to :data:`MAX_BANDWIDTH`, where a script may count in any unit.
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipefold.errors import ConfigError
from pipefold.units import MAX_BYTES, parse_bytes

Link = tuple[int, int]
"""A directed link: (sending device, receiving device)."""

MAX_LATENCY = 86400.0
"""The longest latency, in seconds (a day): the longest action timeout the runtime waits for a message, so a link
slower than this never delivers one in time (and the wall clock's sleeps overflow some way beyond it)."""
MIN_BANDWIDTH = 1.0
"""The least bandwidth, in bytes per second: below a byte per second no message of a stage arrives in a day."""
MAX_BANDWIDTH = MAX_BYTES
"""The most bandwidth, in bytes per second, short of ``inf`` (no limit): the most bytes :func:`parse_bytes` reads."""
MAX_PERIODS = 1_000_000
"""The most idle and preempted periods a preemption draws (about a second's work): its duration over the mean
period."""


@dataclass(frozen=True)
class LinkState:
    """A link's latency (seconds) and bandwidth (bytes per second) during one period."""

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        # What any link may be (a script's, in any unit of bytes; the adaptive policy's observed links); what the
        # command line and profile files give is held to the narrower ranges of :func:`check_state`.
        if isinstance(self.latency, bool) or not 0 <= self.latency <= MAX_LATENCY:
            raise ConfigError(f"a link's latency is seconds from 0 to {MAX_LATENCY:g}, a day (got {self.latency!r})")
        if isinstance(self.bandwidth, bool) or not self.bandwidth > 0:
            raise ConfigError(f"a link's bandwidth is bytes per second > 0, or inf for no limit (got "
                              f"{self.bandwidth!r})")

    @property
    def limited(self) -> bool:
        """Whether the bandwidth has a limit (it is not ``inf``)."""
        return not math.isinf(self.bandwidth)

    def carries(self, nbytes: float) -> float:
        """Seconds a message of ``nbytes`` takes over a link in this state: its bytes at the bandwidth, then the
        latency."""
        return self.latency + (nbytes / self.bandwidth if self.limited else 0.0)


def check_state(latency: Any, bandwidth: Any, where: str) -> None:
    """Refuse, in one line naming ``where``, a latency or a bandwidth that a user wrote outside what a link can
    have (the ranges of :data:`MAX_LATENCY`, :data:`MIN_BANDWIDTH`, :data:`MAX_BANDWIDTH`): beyond them the
    emulation breaks (a sleep past the platform's time_t, a message that never arrives) or the number is a
    typo."""
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency <= MAX_LATENCY:
        raise ConfigError(f"{where}: a latency is seconds from 0 to {MAX_LATENCY:g}, a day (got {latency!r})")
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not (
            MIN_BANDWIDTH <= bandwidth <= MAX_BANDWIDTH or bandwidth == math.inf):
        raise ConfigError(f"{where}: a bandwidth is bytes per second from {MIN_BANDWIDTH:g} to {MAX_BANDWIDTH:g}, "
                          f"or inf for no limit (got {bandwidth!r})")


@dataclass(frozen=True)
class Conditions:
    """One link's states over time: ``states[i]`` holds from ``times[i]`` until ``times[i + 1]`` (the last for ever,
    or, with ``period``, the whole pattern repeats every ``period`` seconds)."""

    times: tuple[float, ...]
    states: tuple[LinkState, ...]
    period: float | None = None

    def __post_init__(self) -> None:
        if not self.times or len(self.times) != len(self.states):
            raise ConfigError("a link profile needs one state per start time, at least one")
        if not all(math.isfinite(t) for t in self.times):
            raise ConfigError(f"a link profile's times are finite seconds (got {list(self.times)[:5]})")
        if self.times[0] != 0 or any(b <= a for a, b in itertools.pairwise(self.times)):
            raise ConfigError(f"a link profile's times start at 0 and increase (got {list(self.times)[:5]})")
        if self.period is not None and not (math.isfinite(self.period) and self.period > self.times[-1]):
            raise ConfigError(f"a profile's period must be longer than its last start time {self.times[-1]:g} s "
                              f"(got {self.period!r})")

    @classmethod
    def constant(cls, state: LinkState) -> Conditions:
        return cls((0.0,), (state,))

    @property
    def best(self) -> LinkState:
        """The link at its best over the whole profile: its least latency and its most bandwidth (perhaps of
        different periods). No message takes less than :meth:`LinkState.carries` in this state."""
        return LinkState(min(s.latency for s in self.states), max(s.bandwidth for s in self.states))

    def segment(self, t: float) -> tuple[LinkState, float]:
        """The state at time ``t`` and when it ends (``inf``: never)."""
        base = 0.0
        if self.period is not None and t >= self.period:
            cycles = math.floor(t / self.period)
            base, t = cycles * self.period, t - cycles * self.period
        i = max(bisect.bisect_right(self.times, t) - 1, 0)
        last = self.period if self.period is not None else math.inf
        return self.states[i], base + (self.times[i + 1] if i + 1 < len(self.times) else last)

    def at(self, t: float) -> LinkState:
        return self.segment(t)[0]

    def changes(self, until: float) -> list[tuple[float, LinkState]]:
        """Every (time, state) this link enters before ``until``, from time 0."""
        out: list[tuple[float, LinkState]] = []
        t = 0.0
        while t < until:
            state, end = self.segment(t)
            out.append((t, state))
            t = end
        return out

    def finish(self, start: float, nbytes: float) -> float:
        """When ``nbytes`` put on the wire at ``start`` have all left it, at the bandwidth of each moment."""
        t, left = start, float(nbytes)
        while left > 0:
            state, end = self.segment(t)
            if math.isinf(state.bandwidth):
                return t
            can = (end - t) * state.bandwidth
            if can >= left:
                return t + left / state.bandwidth
            left -= can
            t = end
        return t


@dataclass(frozen=True)
class Network:
    """Per directed link, its conditions over time; links not named follow ``default``."""

    default: Conditions
    links: Mapping[Link, Conditions] = field(default_factory=dict)
    name: str = "network"
    """How the network was made, for reports and figures."""

    @property
    def fastest(self) -> float:
        """The highest bandwidth any link reaches at any time (bytes per second): what a real link is capped at to
        carry this network (tc in network namespaces); inf where a link is unlimited."""
        return max(state.bandwidth for c in (self.default, *self.links.values()) for state in c.states)

    @classmethod
    def constant(cls, latency: float = 0.0, bandwidth: float = math.inf) -> Network:
        bw = "inf" if math.isinf(bandwidth) else f"{bandwidth:g}"
        return cls(Conditions.constant(LinkState(latency, bandwidth)), name=f"constant:latency={latency:g},"
                                                                           f"bandwidth={bw}")

    @classmethod
    def preemption(cls, *, seed: int, idle: LinkState, preempted: LinkState, on: float, off: float,
                   duration: float = 3600.0, links: Sequence[Link] | None = None, start_idle: bool = True
                   ) -> Network:
        """Links that other jobs preempt now and then: idle periods of mean ``off`` seconds alternate with
        preempted ones of mean ``on`` seconds, each length drawn from an exponential distribution with
        ``random.Random(seed)`` (so the same seed gives the same periods). ``links``: the preempted links
        (both directions of each; None: every link); the others stay idle."""
        if not (0.001 <= on <= MAX_LATENCY and 0.001 <= off <= MAX_LATENCY):
            raise ConfigError(f"preemption periods need on and off from 0.001 to {MAX_LATENCY:g} seconds "
                              f"(got on={on}, off={off})")
        if not (duration > 0 and duration / (on + off) * 2 <= MAX_PERIODS):
            raise ConfigError(f"a preemption's duration is seconds > 0 and at most {MAX_PERIODS:g} periods of the "
                              f"mean on and off: up to {MAX_PERIODS * (on + off) / 2:g} s with on={on:g}, off={off:g} "
                              f"(got duration={duration})")
        rng = random.Random(seed)
        times, states = [0.0], [idle if start_idle else preempted]
        t, busy = 0.0, not start_idle
        while t < duration:
            t += max(rng.expovariate(1.0 / (on if busy else off)), 1e-3)
            busy = not busy
            times.append(t)
            states.append(preempted if busy else idle)
        varying = Conditions(tuple(times), tuple(states))
        quiet = Conditions.constant(idle)
        name = (f"preempt:seed={seed},idle={idle.bandwidth:g},busy={preempted.bandwidth:g},on={on:g},off={off:g}"
                + ("" if links is None else ",links=" + "+".join(f"{a}-{b}" for a, b in links)))
        if links is None:
            return cls(varying, name=name)
        named: dict[Link, Conditions] = {}
        for a, b in links:
            named[(a, b)] = named[(b, a)] = varying
        return cls(quiet, named, name=name)

    def conditions(self, src: int, dst: int) -> Conditions:
        return self.links.get((src, dst), self.default)

    def check_devices(self, devices: int) -> None:
        """Refuse, in one line, a network that names a link to a device the run does not have (it would be ignored)."""
        wrong = sorted((a, b) for a, b in self.links if max(a, b) >= devices)
        if wrong:
            a, b = wrong[0]
            raise ConfigError(f"the network {self.name} names link {a}-{b} but the run has devices 0..{devices - 1}: "
                              f"name links between those devices, or run on {max(a, b) + 1} or more")

    def at(self, src: int, dst: int, t: float) -> LinkState:
        return self.conditions(src, dst).at(t)

    def preempted_periods(self, src: int, dst: int, until: float) -> list[tuple[float, float]]:
        """The (start, end) periods before ``until`` when link src -> dst is slower than its fastest state."""
        changes = self.conditions(src, dst).changes(until)
        best = max(s.bandwidth for _, s in changes)
        out = []
        for i, (t, state) in enumerate(changes):
            end = changes[i + 1][0] if i + 1 < len(changes) else until
            if state.bandwidth < best:
                out.append((t, min(end, until)))
        return out

    # -- files

    def to_dict(self) -> dict[str, Any]:
        def rows(c: Conditions) -> list[list[float | None]]:
            return [[t, s.latency, None if math.isinf(s.bandwidth) else s.bandwidth]
                    for t, s in zip(c.times, c.states, strict=True)]

        out: dict[str, Any] = {"kind": "pipefold-network", "version": 1, "name": self.name,
                               "default": rows(self.default),
                               "links": {f"{a}-{b}": rows(c) for (a, b), c in sorted(self.links.items())}}
        periods = {c.period for c in (self.default, *self.links.values())}
        if periods != {None}:
            out["period"] = self.default.period
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "the network profile") -> Network:
        if not isinstance(data, dict) or not isinstance(data.get("default"), list):
            raise ConfigError(f"{where} is not a network profile: expected a JSON object with a 'default' list of "
                              "[time_s, latency_s, bandwidth_bytes_per_s] rows")
        period = data.get("period")
        if period is not None and (isinstance(period, bool) or not isinstance(period, (int, float))):
            raise ConfigError(f"{where}: 'period' must be a number of seconds (got {period!r})")
        default = _conditions(data["default"], period, f"{where} default")
        links_in = data.get("links", {})
        if not isinstance(links_in, dict):
            raise ConfigError(f"{where}: 'links' must map 'a-b' to rows (got {type(links_in).__name__})")
        links = {_link(key, where): _conditions(rows, period, f"{where} link {key}") for key, rows in links_in.items()}
        return cls(default, links, name=str(data.get("name", Path(where).name)))

    def save(self, path: str | Path) -> None:
        from pipefold.files import write_json

        write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> Network:
        """A JSON profile (:meth:`to_dict`) or a CSV with columns time,latency,bandwidth[,link] (link 'a-b', or
        empty for every link; add ``period`` as a row ``# period=20`` to repeat)."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the network profile {str(p)!r}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{str(p)!r} is not a text file: a network profile is JSON or CSV") from None
        if p.suffix.lower() == ".csv":
            return _from_csv(text, str(p))
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{str(p)!r} is not valid JSON ({exc.msg} at line {exc.lineno}); a network profile is "
                              "JSON or a .csv file") from None
        return cls.from_dict(data, str(p))


def _link(key: Any, where: str) -> Link:
    try:
        a, b = (int(x) for x in str(key).split("-"))
    except ValueError:
        raise ConfigError(f"{where}: a link is named 'a-b' with device numbers, such as '1-2' (got {key!r})") from None
    if a == b or a < 0 or b < 0:
        raise ConfigError(f"{where}: link {key!r} must join two different devices")
    return (a, b)


def _number(value: Any, what: str, where: str) -> float:
    """A profile's number: a JSON number or a CSV field; ``inf`` and ``nan`` are read, for the range checks to
    refuse or take."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {what} is a number, not {str(value).lower()}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {what} must be a number (got {value!r})") from None


def _state(latency: Any, bandwidth: Any, where: str) -> LinkState:
    lat = _number(latency, "a latency", where)
    bw = math.inf if bandwidth in (None, "", "inf") else _number(bandwidth, "a bandwidth", where)
    check_state(lat, bw, where)
    return LinkState(lat, bw)


def _conditions(rows: Any, period: float | None, where: str) -> Conditions:
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and len(r) == 3 for r in rows):
        raise ConfigError(f"{where}: expected a list of [time_s, latency_s, bandwidth_bytes_per_s] rows")
    times = tuple(_number(r[0], "a time", f"{where} row {i + 1}") for i, r in enumerate(rows))
    states = tuple(_state(r[1], r[2], f"{where} row {i + 1}") for i, r in enumerate(rows))
    try:
        return Conditions(times, states, period)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _from_csv(text: str, where: str) -> Network:
    period = None
    lines = []
    for line in text.splitlines():
        if line.strip().startswith("#"):
            if "period=" in line:
                try:
                    period = float(line.split("period=", 1)[1].strip())
                except ValueError:
                    raise ConfigError(f"{where}: cannot read the period in {line.strip()!r}") from None
            continue
        lines.append(line)
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    if reader.fieldnames is None or not {"time", "latency", "bandwidth"} <= set(reader.fieldnames):
        raise ConfigError(f"{where}: a CSV network profile has the columns time,latency,bandwidth (and link)")
    by_link: dict[str, list[list[Any]]] = {}
    for row in reader:
        by_link.setdefault((row.get("link") or "").strip(), []).append([row["time"], row["latency"],
                                                                       row["bandwidth"]])
    if "" not in by_link:
        raise ConfigError(f"{where}: give rows with an empty link column: the conditions of every other link")
    data = {"default": by_link.pop(""), "links": by_link, "period": period, "name": Path(where).name}
    return Network.from_dict(data, where)


def parse_network(spec: str) -> Network:
    """A network from the command line: a file, ``constant:latency=S,bandwidth=B``, or
    ``preempt:seed=N,idle=B,busy=B,on=S,off=S[,latency=S][,links=1-2+2-3]`` (B: bytes per second, such as 50MB).
    Each number out of its range (see the module's description) is refused in one line that gives the range."""
    kind, _, rest = spec.partition(":")
    if kind not in ("constant", "preempt"):
        if Path(spec).exists():
            return Network.load(spec)
        raise ConfigError(f"no network profile {spec!r}: give a JSON or CSV file, constant:latency=1e-4,bandwidth=50MB "
                          "or preempt:seed=1,idle=100MB,busy=5MB,on=4,off=4")
    where = f"the network {spec!r}"
    opts: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise ConfigError(f"cannot read {part!r} in {where}: write key=value")
        opts[key.strip()] = value.strip()
    latency = _seconds(opts.pop("latency", "0"), "latency", where)
    if kind == "constant":
        bandwidth = _rate(opts.pop("bandwidth"), "bandwidth", where) if "bandwidth" in opts else math.inf
        if opts:
            raise ConfigError(f"unknown network option {sorted(opts)[0]!r}: constant takes latency and bandwidth")
        check_state(latency, bandwidth, where)
        return Network.constant(latency, bandwidth)
    missing = [key for key in ("idle", "busy") if key not in opts]
    if missing:
        raise ConfigError(f"{where} needs {missing[0]}=... (bytes per second, such as 100MB)")
    links = [_link(x, where) for x in opts.pop("links").split("+")] if "links" in opts else None
    seed_text = opts.pop("seed", "0")
    try:
        seed = int(seed_text)
    except ValueError:
        raise ConfigError(f"{where}: seed is an integer (got {seed_text!r})") from None
    idle, busy = _rate(opts.pop("idle"), "idle", where), _rate(opts.pop("busy"), "busy", where)
    on, off = _seconds(opts.pop("on", "5"), "on", where), _seconds(opts.pop("off", "5"), "off", where)
    duration = _seconds(opts.pop("duration", "3600"), "duration", where)
    if opts:
        raise ConfigError(f"unknown network option {sorted(opts)[0]!r}: preempt takes seed, idle, busy, on, off, "
                          "latency, links and duration")
    check_state(latency, math.inf, where)
    try:
        return Network.preemption(seed=seed, idle=LinkState(latency, idle), preempted=LinkState(latency, busy),
                                  on=on, off=off, duration=duration, links=links)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _seconds(text: str, name: str, where: str) -> float:
    """A spec's number of seconds (its range is checked where it is used)."""
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{where}: {name} is a number of seconds (got {text!r})") from None


def _rate(text: str, name: str, where: str) -> float:
    """A spec's bandwidth: bytes per second as :func:`parse_bytes` reads them (50MB, 1.5e6), or ``inf``."""
    if text.strip().lower() == "inf":
        return math.inf
    try:
        rate = parse_bytes(text, name)
    except ConfigError:
        rate = math.nan
    if not MIN_BANDWIDTH <= rate <= MAX_BANDWIDTH:
        raise ConfigError(f"{where}: {name} is bytes per second from {MIN_BANDWIDTH:g} to {MAX_BANDWIDTH:g}, such as "
                          f"50MB or 1.5e6, or inf for no limit (got {text!r})")
    return rate


class Wire:
    """One link's messages in the order sent: each leaves once the one before has, arrives a latency later."""

    def __init__(self, conditions: Conditions) -> None:
        self.conditions = conditions
        self.free = 0.0
        self.last = 0.0

    def send(self, t: float, nbytes: float) -> float:
        """Put ``nbytes`` on the wire at time ``t``; return when they arrive."""
        start = max(t, self.free)
        self.free = self.conditions.finish(start, nbytes)
        self.last = max(self.last, self.free + self.conditions.at(start).latency)
        return self.last

"""Network conditions over time, and the simulator's links: closed forms and a brute force."""

from __future__ import annotations

import json
import math
import re

import pytest

from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.ir import Schedule, dependency_graph
from pipefold.sim.network import Conditions, LinkState, Network, Wire, parse_network
from pipefold.sim.simulate import CostModel, StageOverride, simulate


def test_finish_at_constant_bandwidth_is_bytes_over_bandwidth() -> None:
    c = Conditions.constant(LinkState(0.0, 100.0))
    assert c.finish(2.0, 250) == pytest.approx(4.5)


def test_finish_across_a_change_of_bandwidth() -> None:
    # 100 B/s until t = 1, then 50 B/s: 150 bytes from t = 0.5 send 50 by t = 1, the other 100 take 2 s more.
    c = Conditions((0.0, 1.0), (LinkState(0.0, 100.0), LinkState(0.0, 50.0)))
    assert c.finish(0.5, 150) == pytest.approx(3.0)


def test_a_period_repeats_the_pattern() -> None:
    c = Conditions((0.0, 1.0), (LinkState(0.0, 10.0), LinkState(0.0, 1.0)), period=3.0)
    assert c.at(0.5).bandwidth == 10 and c.at(1.5).bandwidth == 1 and c.at(3.5).bandwidth == 10
    assert c.at(7.2).bandwidth == 1
    # From t = 2.5: 0.5 s at 1 B/s, then 1 s at 10 B/s: 10.5 bytes end at t = 4.
    assert c.finish(2.5, 10.5) == pytest.approx(4.0)


def test_a_wire_sends_one_message_at_a_time_in_order() -> None:
    wire = Wire(Conditions.constant(LinkState(0.5, 100.0)))
    assert wire.send(0.0, 100) == pytest.approx(1.5)
    assert wire.send(0.0, 100) == pytest.approx(2.5)  # waits for the first to leave the wire
    assert wire.send(10.0, 100) == pytest.approx(11.5)  # an idle wire: no waiting


def test_preemption_is_seeded_and_has_the_mean_periods() -> None:
    idle, busy = LinkState(1e-4, 1e9), LinkState(1e-4, 1e7)
    a = Network.preemption(seed=3, idle=idle, preempted=busy, on=2.0, off=6.0, duration=20000)
    b = Network.preemption(seed=3, idle=idle, preempted=busy, on=2.0, off=6.0, duration=20000)
    assert a.default == b.default
    periods = a.preempted_periods(0, 1, 20000)
    on = [e - s for s, e in periods]
    off = [s2 - e1 for (_, e1), (s2, _) in zip(periods, periods[1:], strict=False)]
    assert statistics_mean(on) == pytest.approx(2.0, rel=0.1)
    assert statistics_mean(off) == pytest.approx(6.0, rel=0.1)
    assert a.at(0, 1, 0.0) == idle  # starts idle


def statistics_mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_preemption_of_named_links_leaves_the_others_idle() -> None:
    net = Network.preemption(seed=0, idle=LinkState(0, 1e9), preempted=LinkState(0, 1e6), on=1, off=1,
                             duration=100, links=[(1, 2)])
    assert net.preempted_periods(1, 2, 100) and net.preempted_periods(2, 1, 100)
    assert net.preempted_periods(0, 1, 100) == []


def test_profile_files_round_trip(tmp_path) -> None:
    net = Network.preemption(seed=1, idle=LinkState(1e-4, 1e9), preempted=LinkState(2e-4, 5e6), on=3, off=4,
                             duration=60, links=[(0, 1)])
    path = tmp_path / "net.json"
    net.save(path)
    back = Network.load(path)
    assert back.default == net.default and dict(back.links) == dict(net.links)
    csv = tmp_path / "net.csv"
    csv.write_text("# period=10\ntime,latency,bandwidth,link\n0,0.001,1e9,\n0,0,1e6,1-2\n5,0,2e6,1-2\n")
    net = Network.load(csv)
    assert net.at(1, 2, 6).bandwidth == 2e6 and net.at(1, 2, 11).bandwidth == 1e6
    assert net.at(0, 1, 6) == LinkState(0.001, 1e9)


@pytest.mark.parametrize("text, words", [
    ("{", "not valid JSON"),
    ('{"default": [[0, 0, 0]]}', "bandwidth"),
    ('{"default": [[1, 0, 5]]}', "start at 0"),
    ('{"default": [[0, 0, 5]], "links": {"a-b": [[0, 0, 1]]}}', "a link is named"),
    ('"x"', "not a network profile"),
])
def test_bad_profiles_are_one_line(tmp_path, text: str, words: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as err:
        Network.load(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec, words", [
    ("preempt:seed=1,idle=1GB", "busy"),
    ("constant:bandwidth=fast", "bandwidth"),
    ("constant:speed=1", "unknown network option"),
    ("nosuchfile.json", "no network profile"),
    ("preempt:idle=1GB,busy=1MB,on=0", "on and off from 0.001"),
])
def test_bad_specs_are_one_line(spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_network(spec)


def test_specs() -> None:
    net = parse_network("constant:latency=0.001,bandwidth=50MB")
    assert net.at(0, 1, 99.0) == LinkState(0.001, 50e6)
    net = parse_network("preempt:seed=2,idle=100MB,busy=5MB,on=4,off=4,links=1-2")
    assert {s.bandwidth for s in net.conditions(1, 2).states} == {100e6, 5e6}
    assert net.conditions(0, 1).states == (LinkState(0.0, 100e6),)


# -- the simulator with a network


@pytest.mark.parametrize("name, opts", [("1f1b", {}), ("kfkb", {"k": 2}), ("gpipe", {}), ("zb-h1", {}),
                                        ("interleaved-1f1b", {}), ("zb-v", {})])
def test_latency_only_network_is_the_plain_transfer_time(name: str, opts: dict[str, int]) -> None:
    s = schedules.build(name, 4, 8, **opts)
    cost = CostModel(f=1.0, b=1.5, w=0.7, latency=0.3)
    plain = simulate(s, cost)
    linked = simulate(s, CostModel(f=1.0, b=1.5, w=0.7, activation_bytes=1e6), network=Network.constant(0.3))
    assert [t for row in linked.timeline for iv in row for t in (iv.start, iv.end)] == pytest.approx(
        [t for row in plain.timeline for iv in row for t in (iv.start, iv.end)])


def _relaxed_makespan(schedule: Schedule, f: float, bw: float, nbytes: float, network: Network,
                      at: float = 0.0) -> float:
    """A brute force: start every action at 0, then repeat until nothing moves: each action starts when its
    device's previous action ended and its inputs arrived; each link sends its messages in the order its
    sender runs them, each leaving once the one before it has left."""
    graph = dependency_graph(schedule)
    rows = schedule.actions
    where = [(d, i) for d, row in enumerate(rows) for i in range(len(row))]
    start = [0.0] * len(where)
    end = [0.0] * len(where)
    dur = [f if rows[d][i].kind == "F" else bw for d, i in where]
    for _ in range(10 * len(where)):
        before = list(end)
        arrive: dict[tuple[int, int], float] = {}
        for (src, dst), wire in _wires(schedule, graph, network):
            last_free, last_arrival = -math.inf, 0.0
            for g in wire:  # the sender's actions in its own order
                leave = max(at + end[g], last_free)
                last_free = network.conditions(src, dst).finish(leave, nbytes)
                last_arrival = max(last_arrival, last_free + network.at(src, dst, leave).latency)
                arrive[(g, dst)] = last_arrival - at
        for g, (d, i) in enumerate(where):
            t = end[g - 1] if i > 0 else 0.0
            for j in graph.inputs[g]:
                t = max(t, end[j] if where[j][0] == d else arrive[(j, d)])
            start[g], end[g] = t, t + dur[g]
        if end == before:
            return max(end)
    raise AssertionError("did not settle")


def _wires(schedule: Schedule, graph, network: Network) -> list[tuple[tuple[int, int], list[int]]]:
    out: dict[tuple[int, int], list[int]] = {}
    where = [d for d, row in enumerate(schedule.actions) for _ in row]
    for g, ins in enumerate(graph.inputs):
        for j in ins:
            if where[j] != where[g]:
                out.setdefault((where[j], where[g]), [])
                if j not in out[(where[j], where[g])]:
                    out[(where[j], where[g])].append(j)
    return [(link, sorted(gs)) for link, gs in out.items()]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("network", [
    Network.constant(0.05, 10.0),
    Network(Conditions((0.0, 3.0, 6.0), (LinkState(0.01, 50.0), LinkState(0.2, 4.0), LinkState(0.01, 50.0)))),
    Network.preemption(seed=5, idle=LinkState(0.0, 40.0), preempted=LinkState(0.0, 3.0), on=1.5, off=2.0,
                       duration=100, links=[(1, 2)]),
])
def test_kfkb_under_a_network_matches_a_brute_force(k: int, network: Network) -> None:
    s = schedules.build("kfkb", 4, 8, k=k)
    cost = CostModel(stage_overrides={i: StageOverride(f=0.5, b=1.0, w=0.0) for i in range(4)}, activation_bytes=10.0)
    for at in (0.0, 2.5):
        got = simulate(s, cost, network=network, at=at).makespan
        assert got == pytest.approx(_relaxed_makespan(s, 0.5, 1.0, 10.0, network, at))


def test_a_slow_link_favours_larger_groups_and_an_idle_one_does_not() -> None:
    cost = CostModel(stage_overrides={i: StageOverride(f=1.0, b=2.0, w=0.0) for i in range(4)}, activation_bytes=1.0)
    slow, idle = Network.constant(0.0, 1 / 1.5), Network.constant(0.0, 1e9)
    spans = {k: simulate(schedules.build("kfkb", 4, 8, k=k), cost, network=slow).makespan for k in (1, 2, 4)}
    assert spans[2] < 0.85 * spans[1]
    # With free links every k has 1F1B's bubble, (p - 1)(f + b): they differ only in memory.
    for k in (1, 2, 4, 8):
        span = simulate(schedules.build("kfkb", 4, 8, k=k), cost, network=idle).makespan
        assert span == pytest.approx((8 + 3) * 3.0, rel=1e-6)


def test_network_json_is_plain(tmp_path) -> None:
    net = Network.constant(1e-3, math.inf)
    data = json.loads(json.dumps(net.to_dict()))
    assert data["default"] == [[0.0, 1e-3, None]]
    assert Network.from_dict(data).at(0, 1, 5.0).bandwidth == math.inf


def test_simulate_cli_takes_a_network(capsys) -> None:
    from pipefold.cli.main import main

    spec = "preempt:seed=1,idle=40MB,busy=6MB,on=20,off=10"
    code = main(["simulate", "kfkb:k=2", "-p", "4", "-m", "8", "--f", "0.04", "--b", "0.08", "--w", "0",
                 "--activation-bytes", "524288", "--network", spec, "--at", "30", "--json"])
    assert code == 0
    got = json.loads(capsys.readouterr().out)["makespan"]
    cost = CostModel(f=0.04, b=0.08, w=0.0, activation_bytes=524288)
    want = simulate(schedules.build("kfkb", 4, 8, k=2), cost, network=parse_network(spec), at=30.0).makespan
    assert got == pytest.approx(want)
    assert main(["simulate", "1f1b", "--at", "3"]) != 0
    assert "--network" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "link"), [
    (["simulate", "1f1b", "-p", "2", "-m", "4", "--network", "examples/profile.json"], "1-2"),
    (["simulate", "1f1b", "-p", "2", "-m", "4", "--network", "preempt:seed=1,idle=10MB,busy=1MB,links=2-3"], "2-3"),
    (["simulate", "zb-v", "-p", "3", "-m", "6", "--network", "preempt:seed=1,idle=10MB,busy=1MB,links=0-1+3-0"],
     "0-3"),
    (["train", "--model", "mlp", "--layers", "4", "--devices", "2", "--microbatches", "4", "--batch", "8",
      "--network", "examples/profile.json"], "1-2"),
])
def test_a_network_naming_a_missing_link_is_refused(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                     argv: list[str], link: str) -> None:
    from pathlib import Path

    from pipefold.cli.main import main

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"names link {link} but the run has devices" in err and len(err.strip().splitlines()) == 1, err


# -- numbers out of range, refused where they are read


@pytest.mark.parametrize("spec, words", [
    ("constant:latency=1e12", "latency is seconds from 0 to 86400"),
    ("constant:latency=1e30", "latency is seconds from 0 to 86400"),
    ("constant:latency=-1", "latency is seconds from 0 to 86400"),
    ("constant:latency=nan", "latency is seconds from 0 to 86400"),
    ("constant:latency=inf", "latency is seconds from 0 to 86400"),
    ("constant:latency=soon", "latency is a number of seconds"),
    ("constant:bandwidth=0", "bandwidth is bytes per second from 1 to 1e+18"),
    ("constant:bandwidth=-5MB", "bandwidth is bytes per second from 1 to 1e+18"),
    ("constant:bandwidth=nan", "bandwidth is bytes per second from 1 to 1e+18"),
    ("constant:bandwidth=0.5", "bandwidth is bytes per second from 1 to 1e+18"),
    ("constant:bandwidth=1e19", "bandwidth is bytes per second from 1 to 1e+18"),
    ("preempt:idle=0,busy=1MB", "idle is bytes per second from 1 to 1e+18"),
    ("preempt:idle=1GB,busy=nan", "busy is bytes per second from 1 to 1e+18"),
    ("preempt:idle=1GB,busy=1MB,latency=1e10", "latency is seconds from 0 to 86400"),
    ("preempt:idle=1GB,busy=1MB,on=inf", "on and off from 0.001 to 86400"),
    ("preempt:idle=1GB,busy=1MB,off=nan", "on and off from 0.001 to 86400"),
    ("preempt:idle=1GB,busy=1MB,on=1e-9", "on and off from 0.001 to 86400"),
    ("preempt:idle=1GB,busy=1MB,duration=inf", "duration is seconds > 0 and at most 1e+06 periods"),
    ("preempt:idle=1GB,busy=1MB,duration=nan", "duration is seconds > 0 and at most 1e+06 periods"),
    ("preempt:idle=1GB,busy=1MB,duration=-1", "duration is seconds > 0 and at most 1e+06 periods"),
    ("preempt:idle=1GB,busy=1MB,on=1,off=1,duration=1e9", "up to 1e+06 s with on=1, off=1"),
    ("preempt:idle=1GB,busy=1MB,seed=1.5", "seed is an integer"),
])
def test_a_spec_number_out_of_range_is_refused_in_one_line(spec: str, words: str) -> None:
    """Each field of constant: and preempt:, each way out of its range (the emulation broke on some: a sleep past
    time_t, a division by zero, a preemption drawn for ever): one line naming the spec and the range."""
    with pytest.raises(ConfigError) as err:
        parse_network(spec)
    line = str(err.value)
    assert words in line and f"the network {spec!r}" in line and "\n" not in line, line


@pytest.mark.parametrize("rows, words", [
    ([[0, 1e12, 100]], "row 1: a latency is seconds from 0 to 86400"),
    ([[0, -0.1, 100]], "row 1: a latency is seconds from 0 to 86400"),
    ([[0, 0, 0]], "row 1: a bandwidth is bytes per second from 1 to 1e+18"),
    ([[0, 0, -3]], "row 1: a bandwidth is bytes per second from 1 to 1e+18"),
    ([[0, 0, "nan"]], "row 1: a bandwidth is bytes per second from 1 to 1e+18"),
    ([[0, 0, 100], [5, 0, 0.25]], "row 2: a bandwidth is bytes per second from 1 to 1e+18"),
    ([[0, 0, 100], ["nan", 0, 100]], "times are finite seconds"),
    ([[0, 0, 100], ["inf", 0, 100]], "times are finite seconds"),
    ([[0, True, 100]], "row 1: a latency is a number, not true"),
])
def test_a_profile_number_out_of_range_is_refused_in_one_line(tmp_path, rows: list, words: str) -> None:
    """The same ranges for every row of a JSON profile and of a CSV one (its link column empty or named)."""
    path = tmp_path / "net.json"
    path.write_text(json.dumps({"default": [[0, 0, 1e9]], "links": {"0-1": rows}}))
    with pytest.raises(ConfigError, match=re.escape(words)) as err:
        Network.load(path)
    assert "link 0-1" in str(err.value) and "\n" not in str(err.value)
    if any(isinstance(x, bool) for r in rows for x in r):
        return  # a CSV has no booleans
    csv = tmp_path / "net.csv"
    csv.write_text("time,latency,bandwidth,link\n0,0,1e9,\n" + "".join(f"{t},{lat},{bw},0-1\n" for t, lat, bw in rows))
    with pytest.raises(ConfigError, match=re.escape(words)):
        Network.load(csv)


def test_the_library_constructors_refuse_what_breaks_the_emulation() -> None:
    """A network built in a script: the latency's range, a bandwidth above 0, a preemption's periods (its duration
    of inf drew periods for ever); a bandwidth below 1 is a script's own unit (the simulator's tests use 2/3)."""
    for latency in (1e10, 1e30, -1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="latency is seconds from 0 to 86400"):
            Network.constant(latency=latency)
    for bandwidth in (0.0, -1.0, math.nan):
        with pytest.raises(ConfigError, match="bandwidth is bytes per second > 0"):
            LinkState(0.0, bandwidth)
    for duration in (math.inf, math.nan, 0.0):
        with pytest.raises(ConfigError, match="at most 1e\\+06 periods"):
            Network.preemption(seed=0, idle=LinkState(0, 1e9), preempted=LinkState(0, 1e6), on=1, off=1,
                               duration=duration)
    with pytest.raises(ConfigError, match="on and off from 0.001 to 86400"):
        Network.preemption(seed=0, idle=LinkState(0, 1e9), preempted=LinkState(0, 1e6), on=math.inf, off=1)
    assert Network.constant(86400, 2 / 3).at(0, 1, 0.0) == LinkState(86400, 2 / 3)  # the ends of the range
    assert parse_network("constant:latency=86400,bandwidth=1").at(0, 1, 0.0) == LinkState(86400, 1.0)
    assert parse_network("constant:bandwidth=inf").at(0, 1, 0.0).bandwidth == math.inf


def test_a_message_takes_at_least_its_bytes_at_the_best_bandwidth_plus_the_least_latency() -> None:
    c = Conditions((0.0, 5.0, 9.0), (LinkState(0.5, 100.0), LinkState(0.1, 50.0), LinkState(2.0, 400.0)))
    assert c.best == LinkState(0.1, 400.0)
    assert c.best.carries(1000) == pytest.approx(0.1 + 1000 / 400)
    assert LinkState(0.25, math.inf).carries(1e9) == 0.25
    # No moment sends 1000 bytes faster than that bound.
    for start in (0.0, 3.0, 4.9, 5.0, 8.0, 9.0, 20.0):
        arrival = c.finish(start, 1000) + c.at(start).latency
        assert arrival - start >= c.best.carries(1000) - 1e-9

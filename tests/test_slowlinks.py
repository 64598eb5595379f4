"""A link too slow for the action timeout is named slow, not hung: refused before the work where the network
makes it certain, reported as a slow link where a rank waits for a message the link still carries. Every
expected time is worked out here by hand from the message's bytes, the bandwidth and the latency."""

from __future__ import annotations

import json
import math
import multiprocessing
import re
from pathlib import Path

import pytest
import torch

from pipefold import build
from pipefold.cli.main import main
from pipefold.errors import ConfigError
from pipefold.models import make_model
from pipefold.models.size import boundary_bytes
from pipefold.runtime import comm
from pipefold.runtime.clock import wall
from pipefold.runtime.comm import Links
from pipefold.runtime.meter import MemoryMeter
from pipefold.runtime.slowlinks import Carried, check_network, stage_messages
from pipefold.runtime.watch import CARRIED, Hang, SharedBoard, Snapshot, find_hang
from pipefold.sim.network import Conditions, LinkState, Network
from test_cli_hostile import one_line_error

TINY = ["--model", "gpt", "--schedule", "1f1b", "--layers", "2", "--hidden", "16", "--batch", "4", "-m", "2",
        "--devices", "2"]
TINY_BYTES = 2 * 64 * 16 * 4
"""What one microbatch of TINY passes between its stages: 4 / 2 rows of 64 tokens of 16 float32 values."""
BOTH_WAYS = {(0, 1): (65536, "an activation"), (1, 0): (65536, "a gradient")}


def _refusal(network: Network, messages: dict, timeout: float = 20.0, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as err:
        check_network(network, timeout, messages, flag="--network N", **kwargs)  # type: ignore[arg-type]
    line = str(err.value)
    assert "\n" not in line and line.startswith("--network N is too slow for --action-timeout"), line
    return line


def _suggested(line: str) -> tuple[float | None, float | None]:
    """The action timeout and the bandwidth (bytes per second) a refusal suggests, read back from its line."""
    timeout = re.search(r"raise --action-timeout above ([0-9.e+]+) s", line)
    rate = re.search(r"bandwidth of at least ([0-9.e+]+) (B|KB|MB|GB)/s", line)
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    return (float(timeout.group(1)) if timeout else None,
            float(rate.group(1)) * scale[rate.group(2)] if rate else None)


# -- before the work


def test_a_bandwidth_too_low_for_the_timeout_is_refused_with_what_would_do() -> None:
    line = _refusal(Network.constant(0.0, 1.0), BOTH_WAYS)
    assert "link 0->1 takes 65536 s to carry an activation of 64.0 KiB (latency 0 s, bandwidth 1 B/s)" in line, line
    timeout, rate = _suggested(line)
    assert timeout is not None and rate is not None
    assert 65536 < timeout <= 65536 * 1.1  # 64 KiB at 1 B/s, rounded up to two figures
    assert 65536 / rate <= 20 < 65536 / (rate * 0.9)  # the least bandwidth that carries it within 20 s, rounded up


def test_latency_alone_longer_than_the_timeout_is_refused() -> None:
    line = _refusal(Network.constant(30.0, 1e9), {(0, 1): (8192, "an activation")})
    assert f"takes {30 + 8192 / 1e9:.3g} s to carry an activation of 8.0 KiB (latency 30 s" in line, line
    assert "give the link a latency under 20 s" in line and "bandwidth of at least" not in line, line
    assert _suggested(line)[0] == 30


def test_latency_and_bytes_together() -> None:
    # 15 s + 32768 B at 5000 B/s = 21.55 s; within 20 s the bytes have 5 s: 6553.6 B/s, suggested as 6.6 KB/s.
    line = _refusal(Network.constant(15.0, 5000.0), {(0, 1): (32768, "an activation")})
    assert "takes 21.6 s to carry an activation of 32.0 KiB (latency 15 s, bandwidth 5 KB/s)" in line, line
    assert _suggested(line) == (22, 6600)


def test_a_message_no_timeout_can_wait_for_says_so() -> None:
    line = _refusal(Network.constant(0.0, 1.0), {(0, 1): (10**6, "an activation")})
    assert "raise --action-timeout" not in line and "no --action-timeout is that long: it is at most 86400 s" in line
    assert _suggested(line)[1] == 10**6 / 20


def test_a_profile_slow_at_every_moment_is_refused_one_slow_only_at_times_is_left_to_the_run() -> None:
    slow = Conditions((0.0, 10.0), (LinkState(0.0, 1.0), LinkState(0.5, 2.0)), period=30.0)
    line = _refusal(Network(slow), BOTH_WAYS)
    # At best 0 s of latency and 2 B/s (of different periods): 65536 / 2 s.
    assert "link 0->1 takes at least 32768 s" in line and "its least latency 0 s and most bandwidth 2 B/s" in line
    sometimes = Conditions((0.0, 10.0), (LinkState(0.0, 1.0), LinkState(0.0, 1e9)))
    check_network(Network(sometimes), 20.0, BOTH_WAYS, flag="--network N")  # fast after 10 s: not certain


def test_the_slowest_link_is_named_in_its_direction() -> None:
    net = Network(Conditions.constant(LinkState(0.0, 1e9)), {(1, 0): Conditions.constant(LinkState(0.0, 100.0))})
    line = _refusal(net, BOTH_WAYS)
    assert f"link 1->0 takes {65536 / 100:.0f} s to carry a gradient of 64.0 KiB" in line, line


def test_network_namespaces_cap_the_bandwidth_alone() -> None:
    """--netns caps each link at the network's most bandwidth; its latency is not emulated."""
    check_network(Network.constant(30.0, 1e9), 20.0, BOTH_WAYS, flag="--network N", latency=False)
    line = _refusal(Network.constant(30.0, 100.0), BOTH_WAYS, latency=False)
    assert f"takes {65536 / 100:.0f} s" in line and "latency 0 s" in line, line


def test_the_links_a_step_certainly_uses() -> None:
    both = {(0, 1), (1, 0)}
    assert set(stage_messages(build("1f1b", 2, 2), 10)) == both
    assert set(stage_messages(build("1f1b", 3, 3), 10)) == both | {(1, 2), (2, 1)}
    v = build("v-half", 2, 2)  # stages 0, 1, 2, 3 on devices 0, 1, 1, 0
    assert [v.device_of(s, 0) for s in range(4)] == [0, 1, 1, 0]
    assert set(stage_messages(v, 10)) == both
    assert stage_messages(build("1f1b", 2, 2), 10)[(0, 1)] == (10, "an activation")
    assert stage_messages(build("1f1b", 2, 2), 10)[(1, 0)] == (10, "a gradient")


@pytest.mark.parametrize("name, args", [("gpt", {"layers": 2, "hidden": 16, "batch": 4}),
                                        ("gpt", {"layers": 2, "hidden": 8, "heads": 2, "batch": 6, "seq": 10}),
                                        ("mlp", {"layers": 2, "hidden": 8, "batch": 4})])
def test_a_messages_bytes_are_what_a_stage_really_passes(name: str, args: dict) -> None:
    """boundary_bytes against the layers' own outputs on the first microbatch (2 of them)."""
    model = make_model(name, **args)
    shape = model.size()
    assert shape is not None
    x, _ = model.batch_at(0)
    mb = x.chunk(2)[0]
    layers = model.build_layers(range(model.num_layers))
    with torch.no_grad():
        for i in range(model.num_layers - 1):  # every boundary but after the last layer, which feeds the loss
            mb = layers[i](mb)
            assert mb.untyped_storage().nbytes() == boundary_bytes(shape, args["batch"] // 2), (name, i)


@pytest.mark.parametrize("argv, words", [
    (["--network", "constant:latency=0,bandwidth=1"],
     f"link 0->1 takes {TINY_BYTES} s to carry an activation of 8.0 KiB (latency 0 s, bandwidth 1 B/s)"),
    (["--network", "constant:latency=25,bandwidth=1e9"], "link 0->1 takes 25 s to carry an activation of 8.0 KiB"),
    (["--network", "constant:latency=0,bandwidth=100", "--action-timeout", "60"],
     f"too slow for --action-timeout 60: link 0->1 takes {TINY_BYTES / 100:.1f} s"),
    (["--network", "preempt:seed=1,idle=300,busy=1,on=4,off=4"], f"link 0->1 takes at least {TINY_BYTES / 300:.1f} s"),
    (["--network", "preempt:seed=1,idle=1GB,busy=1MB,latency=30,links=0-1"],
     "link 0->1 takes at least 30 s to carry an activation of 8.0 KiB"),
    (["--network", "constant:bandwidth=100", "--model", "mlp", "--hidden", "400"],
     f"link 0->1 takes {2 * 400 * 4 / 100:g} s to carry an activation of 3.1 KiB"),
    (["--network", "constant:bandwidth=1", "--dtype", "bf16"],
     f"link 0->1 takes at least {TINY_BYTES // 2} s to carry an activation of at least 4.0 KiB"),
    (["--network", "constant:latency=1e12"], "latency is seconds from 0 to 86400"),
    (["--network", "constant:bandwidth=nan"], "bandwidth is bytes per second from 1 to 1e+18"),
    (["--network", "preempt:idle=1GB,busy=1MB,duration=inf"], "at most 1e+06 periods"),
])
def test_the_command_line_refuses_before_any_rank_starts(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                         words: str) -> None:
    line = one_line_error(capsys, ["train", *TINY, "--steps", "2", *argv])
    assert words in line, line


def test_a_profile_file_slow_at_every_moment_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "slow.json"
    path.write_text(json.dumps({"default": [[0, 0, 1e9]], "links": {"1-0": [[0, 0, 20], [50, 1, 40]]}}))
    line = one_line_error(capsys, ["train", *TINY, "--steps", "2", "--network", str(path)])
    assert f"link 1->0 takes at least {TINY_BYTES / 40:.0f} s to carry a gradient of 8.0 KiB" in line, line
    csv = tmp_path / "slow.csv"
    csv.write_text("time,latency,bandwidth,link\n0,0,1e9,\n0,0,-1,0-1\n")
    line = one_line_error(capsys, ["train", *TINY, "--steps", "2", "--network", str(csv)])
    assert "link 0-1 row 1: a bandwidth is bytes per second from 1 to 1e+18" in line, line


# -- during the run


def _carried(src: int = 0, dst: int = 1, nbytes: int = 8192, bandwidth: float = 100.0, latency: float = 0.0,
             sent: float = 1000.0, posted: float = 1000.0) -> Carried:
    return Carried(src=src, dst=dst, what="an activation", nbytes=nbytes, posted=posted, sent=sent,
                   arrives=sent + latency + nbytes / bandwidth, latency=latency, bandwidth=bandwidth)


def _snap(rank: int, where: str, waits: tuple[int, ...], what: str, age: float,
          carrying: tuple[Carried, ...] = ()) -> Snapshot:
    return Snapshot(rank=rank, pid=100 + rank, host="h", seq=1, beat=1025.0, step=1, where=where, is_action=True,
                    what=what, waits=waits, since=1025.0 - age, carrying=carrying)


def test_a_wait_for_a_message_the_link_still_carries_is_a_slow_link() -> None:
    """1F1B on two ranks: rank 1 waits for the activation that rank 0's link to it holds back (sent at 1000 s,
    8192 B at 100 B/s: 81.92 s), rank 0 for the gradient that needs it."""
    snaps = {0: _snap(0, "0B0", (1,), "a gradient", 24.0, (_carried(),)),
             1: _snap(1, "1F0", (0,), "an activation", 25.0)}
    hang = find_hang(snaps, {0: 24.0, 1: 25.0}, {}, 20.0)
    assert hang is not None and hang.rank == 1
    # Waiting since 1000 s, it arrives at 1081.92 s: in 56.92 s from 1025 s, a wait of 81.92 s.
    assert hang.line == ("rank 1 waits in 1F0 of step 1 for an activation from rank 0 over a slow link, not a hung "
                         "rank: the emulated link 0->1 (latency 0 s, bandwidth 100 B/s) takes 81.9 s to carry its "
                         "8.0 KiB, so it arrives in 56.9 s, a wait of 81.9 s, longer than the action timeout of "
                         "20 s: raise --action-timeout above 82 s or give the link a bandwidth of at least "
                         "410 B/s"), hang.line
    assert 8192 / 410 <= 20 < 8192 / 400  # the bandwidth suggested (409.6 B/s, rounded up), by hand


def test_the_message_named_is_the_last_the_link_holds_back_and_one_due_already_explains_nothing() -> None:
    """A link holding a header (due at once, before the rank began to wait) and the activation behind it: the line
    names the activation; a link holding only the header, due before the wait began, is no slow link (the rank is
    named as waiting), as a negative wait would be no reason."""
    header = Carried(src=0, dst=1, what="the shapes of an activation", nbytes=64, posted=1000.0, sent=1000.0,
                     arrives=1000.0, latency=0.0, bandwidth=1e6)
    for held in ((header, _carried()), (_carried(), header)):
        snaps = {0: _snap(0, "0B0", (1,), "a gradient", 24.0, held), 1: _snap(1, "1F0", (0,), "an activation", 24.9)}
        hang = find_hang(snaps, {0: 24.0, 1: 24.9}, {}, 20.0)
        assert hang is not None and "for an activation from rank 0 over a slow link" in hang.line, hang
    snaps = {0: _snap(0, "0B0", (1,), "a gradient", 24.0, (header,)), 1: _snap(1, "1F0", (0,), "an activation", 24.9)}
    hang = find_hang(snaps, {0: 24.0, 1: 24.9}, {}, 20.0)
    assert hang is not None and "slow link" not in hang.line and "a wait of -" not in hang.line, hang.line


def test_a_message_queued_behind_others_says_so() -> None:
    c = _carried(sent=1010.0, posted=1000.0, bandwidth=1000.0, latency=2.0)  # 10 s behind, then 10.19 s
    snaps = {0: _snap(0, "0B0", (1,), "a gradient", 24.0, (c,)), 1: _snap(1, "1F1", (0,), "an activation", 25.0)}
    hang = find_hang(snaps, {0: 24.0, 1: 25.0}, {}, 20.0)
    assert hang is not None
    assert "(latency 2 s, bandwidth 1 KB/s) takes 10.2 s to carry its 8.0 KiB, after 10 s behind the messages sent " \
           "before it" in hang.line, hang.line


def test_a_stopped_or_plainly_waiting_rank_is_reported_as_before() -> None:
    """The sender stopped (no heartbeat): named as stopped, its held-back message aside; no message held back:
    the plain hung line."""
    snaps = {0: _snap(0, "0B0", (1,), "a gradient", 24.0, (_carried(),)),
             1: _snap(1, "1F0", (0,), "an activation", 25.0)}
    hang = find_hang(snaps, {0: 24.0, 1: 25.0}, {0: "no heartbeat for 21 s"}, 20.0)
    assert hang == Hang(0, "rank 0 hung in 0B0 of step 1: no heartbeat for 21 s; rank 1 waits for it")
    snaps[0] = _snap(0, "0B0", (1,), "a gradient", 24.0)
    hang = find_hang(snaps, {0: 24.0, 1: 25.0}, {}, 20.0)
    assert hang == Hang(1, "rank 1 hung in 1F0 of step 1: waiting for an activation from rank 0 for 25 s (action "
                           "timeout 20 s)")
    # A message held back for another rank is not this wait's.
    snaps[0] = _snap(0, "0B0", (1,), "a gradient", 24.0, (_carried(dst=2),))
    assert find_hang(snaps, {0: 24.0, 1: 25.0}, {}, 20.0) == hang


def test_what_a_link_holds_back_travels_in_a_snapshot() -> None:
    many = tuple(_carried(dst=d, bandwidth=math.inf if d == 3 else 100.0, sent=1.7e9 + 0.123456, posted=1.7e9)
                 for d in range(CARRIED))
    snap = Snapshot(rank=0, pid=1, host="h" * 64, seq=9, beat=1.0, step=3, where="0F1", is_action=True,
                    what="a gradient", waits=tuple(range(64)), since=0.5, carrying=many)
    back = Snapshot.from_json(snap.to_json())
    assert back.carrying == tuple(dataclass_rounded(c) for c in many)
    assert back.carrying[3].bandwidth == math.inf
    board = SharedBoard(multiprocessing.get_context("fork"), 1)
    board.publish(snap)
    assert board.read(0) == back  # the largest snapshot still fits its slot whole
    old = json.loads(snap.to_json())[:12]  # an older rank's snapshot, without the field
    assert Snapshot.from_json(json.dumps(old).encode()).carrying == ()


def dataclass_rounded(c: Carried) -> Carried:
    return Carried.from_list(json.loads(json.dumps(c.to_list())))


def test_a_links_send_is_told_with_its_times() -> None:
    """What the emulated link tells the watch: on the wire when posted (or once the one before has left), its
    bytes at the bandwidth, then the latency, on the wall clock from the network's start."""
    net = Network.constant(0.5, 100.0)
    origin = wall() - 10.0
    links = Links(2, 2, torch.device("cpu"), MemoryMeter(), network=net, rank=0, origin=origin)
    tag = links.tag(comm.FORWARD, 0, 1, 0)
    due, first = links._due(1, 1, tag, 8192, origin + 10.0)
    assert (first.src, first.dst, first.what, first.nbytes) == (0, 1, "an activation", 8192)
    assert first.sent == pytest.approx(origin + 10.0) and due == first.arrives
    assert first.arrives == pytest.approx(origin + 10.0 + 8192 / 100 + 0.5)
    _, second = links._due(1, 1, links.tag(comm.BACKWARD, 1, 0, 0), 100, origin + 11.0)
    assert second.what == "a gradient" and second.sent == pytest.approx(origin + 10.0 + 81.92)  # behind the first
    _, header = links._due(1, 1, links.tag(comm.HEADER, 1, 0, 0), 0, origin + 12.0)
    assert header.what == "the shapes of an activation"
    links.close()


def test_a_send_due_far_away_sleeps_in_naps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A latency of a day, or a profile's slow period, puts a send's due time far away: one sleep that long
    overflowed time_t on some platforms ('timestamp out of range for platform time_t')."""
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        raise InterruptedError

    monkeypatch.setattr(comm.time, "sleep", sleep)
    with pytest.raises(InterruptedError):
        comm._Deferred(torch.zeros(1), 1, 0, wall() + 1e12).post()
    assert naps == [comm._NAP]


def test_a_slow_link_on_real_ranks_is_named_slow(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Two ranks over a link at 100 B/s for its first hour (so not refused before the work: it is fast later): the
    first activation, 8192 B, takes 81.92 s, and rank 1 waits past the 2 s action timeout for it."""
    path = tmp_path / "slow-first.csv"
    path.write_text("time,latency,bandwidth,link\n0,0,100,\n3600,0,1e9,\n")
    code = main(["train", *TINY, "--steps", "2", "--network", str(path), "--action-timeout", "2"])
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.startswith("pipefold train: error:")]
    assert code == 1 and len(lines) == 1, err
    line = lines[0]
    assert line.startswith("pipefold train: error: rank 1 waits in 1F0 of step 1 for an activation from rank 0 over a "
                           "slow link, not a hung rank: "), line
    assert f"link 0->1 (latency 0 s, bandwidth 100 B/s) takes {TINY_BYTES / 100:.3g} s to carry its 8.0 KiB" in line
    assert "hung in" not in line

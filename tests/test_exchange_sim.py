"""The simulator's price of a mixture of experts' all-to-alls (``exchange_f``, ``exchange_b``) and of overlapped
pairs that hide them (``exchange_overlap``), and combined 1F1B, checked against closed forms and against the same
schedule costed with the exchanges folded into the passes."""

from __future__ import annotations

import json

import pytest

from pipefold.errors import ConfigError
from pipefold.schedules import build
from pipefold.sim.simulate import CostModel, StageOverride, simulate


@pytest.mark.parametrize("p", range(1, 7))
def test_combined_1f1b_lasts_as_1f1b_and_holds_twice_its_microbatches(p: int) -> None:
    for m in range(2 * p - 1, 2 * p + 4):
        schedule = build("1f1b", devices=p, microbatches=m, combined=1)
        result = simulate(schedule, CostModel(f=1.0, b=2.0, w=0.0))
        assert result.makespan == pytest.approx((m + p - 1) * 3.0)
        assert result.peak_memory == [min(m, 2 * (p - i)) for i in range(p)]
        pairs = [str(a) for row in schedule.actions for a in row if len(a.passes) > 1]
        assert len(pairs) == sum(max(0, m - (2 * (p - i) - 1)) for i in range(p)), pairs


def test_combined_1f1b_is_refused_in_one_line_where_it_cannot_pair() -> None:
    with pytest.raises(ConfigError, match=r"needs at least 7 microbatches .* use --microbatches 7"):
        build("1f1b", devices=4, microbatches=6, combined=1)
    with pytest.raises(ConfigError, match="drop seq_chunks and vocab, or combined"):
        build("1f1b", devices=2, microbatches=8, combined=1, seq_chunks=2)
    with pytest.raises(ConfigError, match="drop seq_chunks and vocab, or combined"):
        build("1f1b", devices=2, microbatches=8, combined=1, vocab=1)
    with pytest.raises(ConfigError, match="from 0 to 1"):
        build("1f1b", devices=2, microbatches=8, combined=2)


@pytest.mark.parametrize("name,options", [("gpipe", {}), ("1f1b", {}), ("1f1b", {"combined": 1}), ("zb-h1", {}),
                                          ("dualpipev", {}), ("dualpipe", {}), ("interleaved-1f1b", {})])
def test_without_the_overlap_an_exchange_is_compute_time(name: str, options: dict[str, int]) -> None:
    """Not overlapped, a pass's exchanges only lengthen it: the same as a cost model whose f and b include them."""
    schedule = build(name, devices=4, microbatches=8, **options)
    apart = simulate(schedule, CostModel(f=1.0, b=1.5, w=0.7, exchange_f=0.4, exchange_b=0.6))
    folded = simulate(schedule, CostModel(f=1.4, b=2.1, w=0.7))
    assert apart.makespan == pytest.approx(folded.makespan)
    assert apart.peak_memory == pytest.approx(folded.peak_memory)
    # Every F and every backward (B or BW) exposes its exchanges: per device, its passes' count times them.
    for d, row in enumerate(schedule.actions):
        passes = [part for act in row for part in act.passes]
        f = sum(part.kind == "F" for part in passes) * 0.4
        b = sum(part.kind in ("B", "BW") for part in passes) * 0.6
        share = schedule.devices / schedule.stages
        assert apart.exchange_exposed[d] == pytest.approx((f + b) * share)


@pytest.mark.parametrize("xf,xb", [(0.5, 0.5), (2.0, 3.0), (0.0, 4.0), (3.0, 0.0)])
def test_a_pair_lasts_the_longer_of_its_compute_and_its_exchanges(xf: float, xb: float) -> None:
    """One device, combined 1F1B: F0, then m-1 pairs F(j)+BW(j-1), then BW(m-1); a pair that overlaps lasts the
    longest of its compute f + b, its exchanges xf + xb, and each part's own f + xf and b + xb (a part's exchanges
    hide under the other part's compute, not its own), and exposes what it lasts beyond its compute."""
    f, b, m = 1.0, 2.0, 6
    schedule = build("1f1b", devices=1, microbatches=m, combined=1)
    result = simulate(schedule, CostModel(f=f, b=b, w=0.0, exchange_f=xf, exchange_b=xb, exchange_overlap=True))
    pair = max(f + b, xf + xb, f + xf, b + xb)
    assert result.makespan == pytest.approx((f + xf) + (m - 1) * pair + (b + xb))
    assert result.exchange_exposed[0] == pytest.approx(xf + xb + (m - 1) * (pair - f - b))
    plain = simulate(schedule, CostModel(f=f, b=b, w=0.0, exchange_f=xf, exchange_b=xb))
    assert plain.makespan == pytest.approx(m * (f + xf + b + xb))


def test_the_overlap_shortens_dualpipe_and_never_lengthens_a_step() -> None:
    for name, options in (("dualpipev", {}), ("dualpipe", {}), ("1f1b", {"combined": 1}), ("1f1b", {})):
        schedule = build(name, devices=4, microbatches=16, **options)
        costs = {"f": 1.0, "b": 1.0, "w": 1.0, "exchange_f": 0.5, "exchange_b": 0.5}
        on = simulate(schedule, CostModel(**costs, exchange_overlap=True))
        off = simulate(schedule, CostModel(**costs))
        if any(len(a.passes) > 1 for row in schedule.actions for a in row):
            assert on.makespan < off.makespan and sum(on.exchange_exposed) < sum(off.exchange_exposed)
        else:  # no pair: nothing to overlap
            assert on.makespan == off.makespan and on.exchange_exposed == off.exchange_exposed


def test_a_pair_whose_other_part_exchanges_nothing_hides_nothing() -> None:
    """DualPipeV on one device with only stage 1 exchanging: a pair of stage 1's forward and stage 0's backward
    can hide stage 1's exchanges only under stage 0's compute, so with little of that the overlap saves little;
    with the exchanges on both stages it saves more."""
    schedule = build("dualpipev", devices=1, microbatches=8)
    one = {0: StageOverride(f=0.1, b=0.2, w=0.0, exchange_f=0.0, exchange_b=0.0),
           1: StageOverride(f=1.0, b=2.0, w=0.0, exchange_f=1.0, exchange_b=1.0)}
    both = {0: StageOverride(f=0.55, b=1.1, w=0.0, exchange_f=0.5, exchange_b=0.5),
            1: StageOverride(f=0.55, b=1.1, w=0.0, exchange_f=0.5, exchange_b=0.5)}
    saved = {}
    for name, over in (("one", one), ("both", both)):
        on = simulate(schedule, CostModel(stage_overrides=over, exchange_overlap=True)).makespan
        off = simulate(schedule, CostModel(stage_overrides=over)).makespan
        saved[name] = 1 - on / off
    assert 0 <= saved["one"] < 0.1 < saved["both"], saved


def test_a_stage_override_sets_its_own_exchanges() -> None:
    schedule = build("gpipe", devices=2, microbatches=3)
    cost = CostModel(f=1.0, b=1.0, w=0.0, exchange_f=0.25, exchange_b=0.25, stage_overrides={
        1: StageOverride(f=1.0, b=1.0, w=0.0, exchange_f=2.0, exchange_b=0.0)})
    result = simulate(schedule, cost)
    # Stage 0 keeps the model's exchanges (a stage is a device's share here), stage 1 its own.
    assert result.exchange_exposed == pytest.approx((3 * 0.5, 3 * 2.0))
    assert "exchange_exposed" in result.to_dict() and cost.to_dict()["stage_overrides"]["1"]["exchange_f"] == 2.0


def test_simulate_on_the_command_line_prices_and_shows_the_exchanges(capsys: pytest.CaptureFixture[str]) -> None:
    from pipefold.cli.main import main

    base = ["simulate", "dualpipev", "--devices", "4", "--microbatches", "8", "--exchange", "0.5,0.5", "--json"]
    spans = {}
    for extra in ([], ["--exchange-overlap"]):
        assert main([*base, *extra]) == 0
        got = json.loads(capsys.readouterr().out)
        cost = CostModel(exchange_f=0.5, exchange_b=0.5, exchange_overlap=bool(extra))
        expected = simulate(build("dualpipev", devices=4, microbatches=8), cost)
        assert got["makespan"] == pytest.approx(expected.makespan)
        assert got["exchange_exposed"] == pytest.approx(list(expected.exchange_exposed))
        spans[bool(extra)] = got["makespan"]
    assert spans[True] < spans[False]
    assert main(["simulate", "dualpipev", "--devices", "4", "--microbatches", "8", "--exchange", "0.5,0.5"]) == 0
    assert "exposed exchange" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "expected"), [
    (["gpipe", "--exchange", "0.5,0.5", "--exchange-overlap"],
     "--exchange-overlap hides one part's expert all-to-alls under the other's compute in an overlapped pair F+B, "
     "and no schedule here runs one: use dualpipe, dualpipev or 1f1b --combined 1: drop it"),
    (["gpipe", "--exchange", "0.5"], "cannot read --exchange '0.5': give 2 numbers, e.g. 0.5,0.5"),
    (["gpipe", "--exchange", "a,b"], "cannot read --exchange 'a,b': give 2 numbers, e.g. 0.5,0.5"),
    (["gpipe", "--exchange", "-1,2"], "--exchange -1,2: -1.0 is out of range: give a number >= 0"),
    (["1f1b", "--combined", "1", "--devices", "4", "--microbatches", "4"],
     "1f1b:combined=1 on 4 devices needs at least 7 microbatches"),
])
def test_bad_exchange_options_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                           expected: str) -> None:
    from pipefold.cli.main import main

    assert main(["simulate", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err

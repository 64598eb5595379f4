"""Chimera and DualPipe: two replicas in opposite directions, their closed forms and the published figures."""

from __future__ import annotations

from collections import Counter

import pytest

from pipefold import ConfigError, CostModel, Kind, Schedule, SimResult, build, simulate, validate
from pipefold.ir import Action, dumps, linear_placement, reversed_placement
from pipefold.schedules.bidirectional import chimera, dualpipe

EVEN = (2, 4, 6, 8)
# The paper's slot model: a forward and a backward one slot each (a fused BW costs b + w).
SLOTS = CostModel(f=1, b=1, w=0)


def _passes(s: Schedule) -> list[tuple[int, Action]]:
    return [(d, a) for d, row in enumerate(s.actions) for act in row for a in act.passes]


def _check_shape(s: Schedule) -> None:
    """Valid, two opposite replicas, every pass once on its replica's device, one R per holder after its backwards."""
    validate(s)
    p = s.devices
    assert s.placement == (linear_placement(p), reversed_placement(p))
    assert s.stages == p and s.replicas == 2
    assert Counter(s.routes) == {0: s.microbatches // 2, 1: s.microbatches // 2}
    for d in range(p):
        assert s.stages_of(d) == sorted({d, p - 1 - d})
    passes = _passes(s)
    work = [a for _, a in passes if a.microbatch >= 0]
    assert len(work) == len(set(work))
    for d, a in passes:
        if a.microbatch >= 0:
            assert s.device_of(a.stage, a.microbatch) == d
    kinds: dict[tuple[int, int], set[str]] = {}
    for a in work:
        kinds.setdefault((a.stage, a.microbatch), set()).add(a.kind)
    assert set(kinds) == {(st, mb) for st in range(p) for mb in range(s.microbatches)}
    assert all(k in ({Kind.F, Kind.BW}, {Kind.F, Kind.B, Kind.W}) for k in kinds.values())
    # One all-reduce of each stage on each of its two holders, right after that device's last backward of it.
    reduces = [(d, a.stage) for d, a in passes if a.kind == Kind.R]
    assert sorted(reduces) == sorted((d, st) for st in range(p) for d in s.holders(st))
    for row in s.actions:
        for i, act in enumerate(row):
            if act.kind == Kind.R:
                later = [a for x in row[i + 1:] for a in x.passes]
                assert not any(a.stage == act.stage and a.kind in (Kind.W, Kind.BW) for a in later)
                assert any(a.stage == act.stage and a.kind in (Kind.W, Kind.BW) for a in row[i - 1].passes)
    # Text, JSON and CSV forms read back exactly (the CSV infers both replicas and the routes).
    assert Schedule.from_text(s.to_text()) == s
    assert Schedule.from_json(s.to_json()) == s
    assert Schedule.from_json(dumps(s, "json")) == s
    assert Schedule.from_csv(s.to_csv(), name=s.name) == s


# --------------------------------------------------------------------------- Chimera


@pytest.mark.parametrize("p", EVEN)
@pytest.mark.parametrize("units", [1, 2, 3])
def test_chimera_is_valid_and_round_trips(p: int, units: int) -> None:
    s = build("chimera", p, units * p)
    _check_shape(s)
    # Units of p: the first p/2 microbatches of each go down, the next p/2 up.
    assert s.routes == tuple(int(j % p >= p // 2) for j in range(units * p))
    assert {a.kind for _, a in _passes(s)} == {Kind.F, Kind.BW, Kind.R}


# Figure 3 of the paper (p = 4, m = 4), one column per slot, "." a bubble: microbatches 0 and 1 go down
# (stage s on device s), 2 and 3 up (stage s on device 3-s). Written from the paper's construction,
# two 1F1B pipelines of p/2 microbatches merged slot by slot; the all-reduces are not in the figure.
FIGURE_3 = """
0F0 0F1 .   3F2 3BW2 3F3 3BW3 0BW0 .    0BW1
.   1F0 2F2 1F1 2F3  2BW2 1BW0 2BW3 1BW1 .
.   1F2 2F0 1F3 2F1  2BW0 1BW2 2BW1 1BW3 .
0F2 0F3 .   3F0 3BW0 3F1 3BW1 0BW2 .    0BW3
"""


def test_chimera_p4_m4_is_the_papers_figure() -> None:
    grid = [line.split() for line in FIGURE_3.strip().splitlines()]
    s = chimera(4, 4)
    assert [[str(a) for a in row if a.kind != Kind.R] for row in s.actions] == \
        [[c for c in row if c != "."] for row in grid]
    # Run in the paper's slot model, each pass starts in its column and the step takes 10 slots, 2 idle each.
    r = simulate(s, SLOTS)
    for d, row in enumerate(r.timeline):
        assert {str(iv.action): iv.start for iv in row if iv.action.kind != Kind.R} == \
            {c: float(t) for t, c in enumerate(grid[d]) if c != "."}
    assert r.makespan == 10
    assert r.idle == [2.0] * 4
    assert r.peak_memory == [3.0, 4.0, 4.0, 3.0]


def _peak(p: int, d: int) -> int:
    return p // 2 + 1 + min(d, p - 1 - d)


@pytest.mark.parametrize("p", [2, 4, 6, 8, 10, 16])
@pytest.mark.parametrize("units", [1, 2, 3, 4])
def test_chimera_closed_forms(p: int, units: int) -> None:
    m = units * p
    s = chimera(p, m)
    # The paper's slot model (F = BW = one slot): its grid is conflict-free and units fit 2p slots apart, so the
    # step is 2m slots of work plus p-2 bubbles per device (the first unit's ramp up and the last one's ramp
    # down), and the simulator's as-soon-as-possible run of the same order meets it: Table 2's (p-2)/(2m+p-2).
    r = simulate(s, SLOTS)
    assert r.makespan == 2 * m + p - 2
    assert r.bubble_ratio == pytest.approx((p - 2) / (2 * m + p - 2))
    # Unit costs, fused BW = 2F. The critical path: the first up microbatch's p forwards, its backward down
    # to stage 1 (p-1 BWs), then on that device the last down microbatch's backward from stage p-2 to
    # stage 0 (p-1 BWs): p + 4(p-1). Each further unit adds two forwards on device 0 (its last down F,
    # then the unit's first up F at stage p-1) and the same 2(p-1) backward hops: 4p-2. In all
    # 3m + (p-2)(m/p + 1): a backward twice as long as the slot grid allowed adds p-2 idle per unit seam
    # (the paper's intermediate bubbles of direct concatenation).
    r = simulate(s, CostModel())
    assert r.makespan == p + 4 * (p - 1) + (units - 1) * (4 * p - 2) == 3 * m + (p - 2) * (units + 1)
    bubble = (p - 2) * (units + 1)
    assert r.bubble_ratio == pytest.approx(bubble / (3 * m + bubble))
    if units == 1:
        assert r.bubble_ratio == pytest.approx((2 * p - 4) / (5 * p - 4))
    # Memory: device d holds at most p/2 microbatches of each direction and, at its peak (just before its
    # first up backward, device d < p/2), all p/2 of its down ones and d+1 up ones; the mirror for d >= p/2.
    # Units do not stack: a unit's up backwards end before the next unit's up forwards reach the device.
    # The paper's [(p/2+1) M, p M].
    peaks = r.peak_memory
    assert peaks == [_peak(p, d) for d in range(p)]
    assert all(p // 2 + 1 <= x <= p for x in peaks)
    assert simulate(s, SLOTS).peak_memory == peaks  # memory follows the order, not the costs


def _brute_peaks(s: Schedule) -> tuple[list[int], list[int]]:
    """Per device, the most activations held at once and the most of one direction, counted along its list."""
    peaks, per_direction = [], []
    for row in s.actions:
        held = [0, 0]
        top = top_one = 0
        for act in row:
            for a in act.passes:
                if a.microbatch < 0:
                    continue
                route = s.routes[a.microbatch]
                if a.kind == Kind.F:
                    held[route] += 1
                elif a.kind in (Kind.BW, Kind.W):
                    held[route] -= 1
                top, top_one = max(top, sum(held)), max(top_one, *held)
        peaks.append(top)
        per_direction.append(top_one)
    return peaks, per_direction


@pytest.mark.parametrize("p", EVEN)
@pytest.mark.parametrize("units", [1, 2, 3])
def test_chimera_memory_by_brute_force(p: int, units: int) -> None:
    s = chimera(p, units * p)
    peaks, per_direction = _brute_peaks(s)
    assert peaks == [_peak(p, d) for d in range(p)] == simulate(s).peak_memory
    assert max(per_direction) == p // 2  # the paper's limit: p/2 microbatches of each direction in flight


@pytest.mark.parametrize("p", [4, 6, 8])
def test_chimera_runs_no_later_than_the_slot_grid(p: int) -> None:
    """The module docstring's grid, recomputed here: the simulator starts every pass no later than its slot."""
    half = p // 2
    m = 2 * p
    slot: dict[str, int] = {}
    for d in range(p):
        for u in range(m // p):
            o = 2 * p * u
            for k in range(half):
                slot[f"{d}F{p * u + k}"] = o + d + 2 * k
                slot[f"{p - 1 - d}F{p * u + half + k}"] = o + p - 1 - d + 2 * k
                slot[f"{p - 1 - d}BW{p * u + half + k}"] = o + p + d + 2 * k
                slot[f"{d}BW{p * u + k}"] = o + 2 * p - 1 - d + 2 * k
    r = simulate(chimera(p, m), SLOTS)
    for row in r.timeline:
        times = [slot[str(iv.action)] for iv in row if iv.action.kind != Kind.R]
        assert times == sorted(times) and len(set(times)) == len(times)  # the list is the grid's order
        assert all(iv.start <= slot[str(iv.action)] for iv in row if iv.action.kind != Kind.R)


def test_chimera_allreduce_runs_beside_the_passes() -> None:
    """Each R follows its stage's last backward on both holders at the same moment (the schedule is its own
    mirror image), so it waits for nobody; it runs beside the passes after it, and only the last one adds."""
    p, m = 4, 8
    base = simulate(chimera(p, m))
    slow = simulate(chimera(p, m), CostModel(grad_bytes=2.0, bandwidth=1.0))  # an all-reduce of 2 time units

    def passes(r: SimResult) -> list[list[tuple[str, float]]]:
        return [[(str(iv.action), iv.start) for iv in row if iv.action.kind != Kind.R] for row in r.timeline]

    assert passes(slow) == passes(base)
    assert slow.makespan == base.makespan + 2
    for d, row in enumerate(slow.timeline):
        for iv in row:
            if iv.action.kind == Kind.R:
                other = next(x for x in slow.timeline[p - 1 - d] if x.action == iv.action)
                assert (iv.start, iv.end) == (other.start, other.end)


@pytest.mark.parametrize(("p", "m", "message"), [
    (3, 6, "chimera needs an even number of devices (each holds one stage of each of two opposite pipelines), "
           "got 3; nearest valid: 2 or 4"),
    (1, 4, "chimera needs an even number of devices (each holds one stage of each of two opposite pipelines), "
           "got 1; nearest valid: 2"),
    (4, 6, "chimera on 4 devices needs a multiple of 4 microbatches (p/2 each way per unit), got 6; "
           "nearest valid: 4 or 8"),
    (4, 2, "chimera on 4 devices needs a multiple of 4 microbatches (p/2 each way per unit), got 2; "
           "nearest valid: 4"),
    (6, 13, "nearest valid: 12 or 18"),
])
def test_chimera_errors_name_the_nearest_valid_value(p: int, m: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        chimera(p, m)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_chimera_build_checks_the_least_microbatches() -> None:
    with pytest.raises(ConfigError, match="chimera needs at least 4 microbatches on 4 devices"):
        build("chimera", 4, 2)


# --------------------------------------------------------------------------- DualPipe


@pytest.mark.parametrize("p", EVEN)
def test_dualpipe_is_valid_and_round_trips(p: int) -> None:
    for m in (2 * p, 2 * p + 2, 2 * p + 6, 4 * p):
        s = build("dualpipe", p, m)
        _check_shape(s)
        assert s.routes == (0,) * (m // 2) + (1,) * (m // 2)
        pairs = [act for row in s.actions for act in row if act.kind == Kind.FB]
        assert pairs
        # A pair overlaps a forward of one direction with a full backward of the other.
        for act in pairs:
            f, b = act.parts
            assert (f.kind, b.kind) == (Kind.F, Kind.BW)
            assert s.routes[f.microbatch] != s.routes[b.microbatch]


# DeepSeek's DualPipe.step (dualpipe/dualpipe.py) stepped through by hand for 4 ranks and 8 chunks, steps 1-8:
# rank 0 (half_rank 0, down pipeline near): 2 F0 | F0 F1 | B1 W F1 | F0&B1 F1&B0 | B1 F1&B0 | B1 B0(zb) |
# W B0(zb) | W; rank 1 (a middle rank, half_rank 1): F0 F1 F0 F1 | F0, B1 unpaired, F1&B0 | F0&B1 F1&B0 |
# B1 B0 B1(zb) B0(zb) | W W. Ranks 2 and 3 mirror them. Chunk k of the down direction is microbatch k here,
# of the up direction 4 + k; the all-reduces follow each stage's last backward.
DUALPIPE_4_8 = [
    "0F0 0F1 0F2 3F4 3B4 3W4 3F5 0F3+3BW5 3F6+0BW0 3BW6 3F7+0BW1 3BW7 3R 0B2 0W2 0B3 0W3 0R",
    "1F0 2F4 1F1 2F5 1F2 2BW4 2F6+1BW0 1F3+2BW5 2F7+1BW1 2BW6 1BW2 2B7 1B3 2W7 2R 1W3 1R",
    "1F4 2F0 1F5 2F1 1F6 2BW0 2F2+1BW4 1F7+2BW1 2F3+1BW5 2BW2 1BW6 2B3 1B7 2W3 2R 1W7 1R",
    "0F4 0F5 0F6 3F0 3B0 3W0 3F1 0F7+3BW1 3F2+0BW4 3BW2 3F3+0BW5 3BW3 3R 0B6 0W6 0B7 0W7 0R",
]


def test_dualpipe_matches_deepseeks_steps_for_4_ranks() -> None:
    assert [" ".join(map(str, row)) for row in dualpipe(4, 8).actions] == DUALPIPE_4_8


@pytest.mark.parametrize("p", [2, 4, 6, 8, 16])
def test_dualpipe_closed_forms(p: int) -> None:
    for m in (2 * p, 2 * p + 2, 3 * p + p % 4, 4 * p):
        s = dualpipe(p, m)
        fused = simulate(s, CostModel(overlap=True))
        apart = simulate(s, CostModel(overlap=False))
        assert fused.makespan < apart.makespan
        # Unit costs: an overlapped pair costs max(F, BW) = 2 instead of 3.
        assert fused.makespan == 2 * m + 3 * p // 2
        assert apart.makespan == 3 * m + p - 2
        # DeepSeek's README: bubble (PP/2-1)(F&B + B - 3W) with B the full backward: under unit costs the most
        # any device idles; activation memory PP+1 (of one stage's microbatch) on every device.
        for r, fb in ((fused, 2), (apart, 3)):
            assert max(r.idle) == (p // 2 - 1) * (fb + 2 - 3)
            assert r.peak_memory == [p + 1] * p


@pytest.mark.parametrize(("p", "m", "message"), [
    (5, 10, "dualpipe needs an even number of devices (each holds one stage of each of two opposite pipelines), "
            "got 5; nearest valid: 4 or 6"),
    (4, 6, "dualpipe on 4 devices needs at least 8 microbatches (p each way: the end devices run p-1 forwards "
           "before their first overlapped pair), got 6; nearest valid: 8"),
    (4, 9, "dualpipe needs an even number of microbatches (half go each way), got 9; nearest valid: 8 or 10"),
])
def test_dualpipe_errors_name_the_nearest_valid_value(p: int, m: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        dualpipe(p, m)
    assert str(info.value) == message


def test_dualpipe_build_checks_the_least_microbatches() -> None:
    with pytest.raises(ConfigError, match="dualpipe needs at least 8 microbatches on 4 devices"):
        build("dualpipe", 4, 7)

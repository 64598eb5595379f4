"""DualPipeV and interleaved zero bubble: torch's orders exactly, valid, and the closed forms of their memory and time.

torch.distributed.pipelining computes every rank's ``pipeline_order`` when a schedule
is constructed, from the stages' shapes alone; the stages here are stand-ins with
just those attributes, so no process group is needed. Torch's actions map to
pipefold's: F -> F, I (input gradient) -> B, W -> W, B (full backward) -> BW,
OVERLAP_F_B -> an overlapped pair; its empty slots (None) are dropped.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest

from pipefold import ConfigError, CostModel, Schedule, build, simulate, validate
from pipefold.ir import BW, Action, B, F, W, dumps, overlap
from pipefold.schedules import get
from pipefold.schedules.dualpipe_v import dualpipev
from pipefold.schedules.interleaved import group_size, interleaved_zb

torch = pytest.importorskip("torch")
torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

_KINDS = {"F": F, "I": B, "W": W, "B": BW}


def _action(a: Any) -> Action:
    if a.sub_actions:
        return overlap(*map(_action, a.sub_actions))
    return _KINDS[a.computation_type.value](a.stage_index, a.microbatch_index)


def _torch_order(cls: str, p: int, m: int, local: list[int]) -> tuple[tuple[Action, ...], ...]:
    """torch's computation order per rank for p ranks, m microbatches, rank 0 holding stages ``local``."""
    stages = [types.SimpleNamespace(group_size=p, group_rank=0, num_stages=len(local) * p,
                                    submod=torch.nn.Identity(), stage_index=s) for s in local]
    logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.ERROR)
    order = getattr(torch_schedules, cls)(stages, n_microbatches=m, loss_fn=lambda out, target: out).pipeline_order
    return tuple(tuple(_action(a) for a in order[r] if a is not None and a.is_compute_op) for r in range(p))


def _torch_izb(p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...] | None:
    """torch's ScheduleInterleavedZeroBubble, or None for a shape it refuses."""
    try:
        return _torch_order("ScheduleInterleavedZeroBubble", p, m, [c * p for c in range(v)])
    except ValueError as exc:
        assert "multiple of the number of rounds" in str(exc)
        return None


# --------------------------------------------------------------------------- the same orders as torch


@pytest.mark.parametrize("p", range(1, 9))
def test_dualpipev_is_torchs_order(p: int) -> None:
    for m in [*range(2 * p, 4 * p + 2), 6 * p + 1]:
        ours = dualpipev(p, m)
        assert ours.actions == _torch_order("ScheduleDualPipeV", p, m, [0, 2 * p - 1]), (p, m)
    # Below 2p torch refuses, and so does pipefold, naming the fewest that work.
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        _torch_order("ScheduleDualPipeV", p, 2 * p - 1, [0, 2 * p - 1])
    with pytest.raises(ConfigError, match=rf"at least 2p = {2 * p} microbatches on {p} devices \(got {2 * p - 1}\); "
                                          rf"use --microbatches {2 * p} or more"):
        dualpipev(p, 2 * p - 1)


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("p", range(1, 9))
def test_interleaved_zb_is_torchs_order(p: int, v: int) -> None:
    built = refused = 0
    for m in range(1, 3 * p + 3):
        theirs = _torch_izb(p, m, v)
        ours = interleaved_zb(p, m, v)
        if theirs is None:
            # torch wants m a multiple of its rounds; pipefold takes rounds of group_size microbatches
            # (which is torch's round whenever torch builds) and stays valid.
            refused += 1
            validate(ours)
            continue
        built += 1
        assert ours.actions == theirs, (p, m, v)
        assert m // max(1, m // p) == group_size(p, m)  # torch's microbatches per round
    assert built >= 2 * p and (refused > 0) == (p > 1)


# --------------------------------------------------------------------------- valid, complete, round trips


@pytest.mark.parametrize(("name", "p", "ms"), [("dualpipev", p, [*range(2 * p, 3 * p + 2), 5 * p]) for p in range(1, 9)]
                         + [("interleaved-zb", p, [1, 2, 3, p, p + 1, 2 * p - 1, 3 * p, 29]) for p in range(1, 9)])
def test_valid_over_shapes(name: str, p: int, ms: range | list[int]) -> None:
    for m in ms:
        for v in ([1, 2, 3, 5] if name == "interleaved-zb" else [0]):
            s = build(name, p, m, **({"v": v} if v else {}))
            validate(s)
            passes = [a for row in s.actions for act in row for a in act.passes]
            assert len(passes) == len(set(passes)) == 3 * s.stages * m - sum(a.kind == "BW" for a in passes)


@pytest.mark.parametrize(("name", "p", "m", "options"),
                         [("dualpipev", 4, 8, {}), ("dualpipev", 3, 11, {}), ("interleaved-zb", 4, 8, {"v": 2}),
                          ("interleaved-zb", 3, 7, {"v": 3})])
def test_text_json_csv_round_trip(name: str, p: int, m: int, options: dict[str, int]) -> None:
    s = build(name, p, m, **options)
    assert Schedule.from_text(s.to_text()) == s
    assert Schedule.from_json(dumps(s, "json")) == s
    assert Schedule.from_csv(s.to_csv(), name=s.name, options=s.options, placement=s.placement) == s
    if name == "dualpipev":
        assert any("+" in str(a) for a in s.actions[0])  # the overlapped pairs survive as pairs


def test_registry_entries() -> None:
    assert get("dualpipev").min_microbatches(4) == 8
    assert get("interleaved-zb").min_microbatches(4) == 1 and get("interleaved-zb").option("v") is not None
    with pytest.raises(ConfigError, match=r"dualpipev needs at least 8 microbatches on 4 devices \(got 7\)"):
        build("dualpipev", 4, 7)
    with pytest.raises(ConfigError, match="interleaved-zb needs at least 1 device"):
        interleaved_zb(4, 8, 0)


# --------------------------------------------------------------------------- memory and time


@pytest.mark.parametrize("p", range(1, 9))
def test_dualpipev_peak_is_deepseeks_pp_plus_one(p: int) -> None:
    # DeepSeek's DualPipeV keeps PP+1 chunk activations per device for PP = 2p stages: p + 1/2 M,
    # whatever the overlap does to time (an overlapped pair takes its F's activation before its B frees).
    for m in (2 * p, 3 * p + 1):
        for overlapped in (False, True):
            assert simulate(dualpipev(p, m), CostModel(overlap=overlapped)).peak_memory == [p + 0.5] * p


@pytest.mark.parametrize("p", range(1, 9))
def test_dualpipev_closed_form_times(p: int) -> None:
    for m in (2 * p, 2 * p + 1, 4 * p + 3):
        # Unit costs, chunk passes of 1/2: without overlap every device idles p-1 (ZB-V idles (p-1)/2);
        # with it a pair costs its backward alone and the step is 2m + 3p/2.
        plain = simulate(dualpipev(p, m))
        assert plain.makespan == 3 * m + p - 1 and plain.idle == [p - 1] * p
        assert simulate(dualpipev(p, m), CostModel(overlap=True)).makespan == 2 * m + 1.5 * p


@pytest.mark.parametrize(("f", "b", "w"), [(1, 1, 1), (1, 1, 0.5), (2, 2, 1), (1, 1, 0)])
@pytest.mark.parametrize("overlapped", [False, True])
def test_dualpipev_bubble_is_deepseeks_formula(f: float, b: float, w: float, overlapped: bool) -> None:
    # DeepSeek: bubble (PP/2-1)(F&B + B - 3W), PP = 2p stages, per chunk F = f/2, B (full) = (b+w)/2,
    # W = w/2, F&B the overlapped pair. It is the idle time of the idlest device when F = B and W <= F.
    F_, B_, W_ = f / 2, (b + w) / 2, w / 2
    FB = max(F_, B_) if overlapped else F_ + B_
    for p in (2, 3, 4, 8):
        r = simulate(dualpipev(p, 3 * p), CostModel(f=f, b=b, w=w, overlap=overlapped))
        assert max(r.idle) == pytest.approx((p - 1) * (FB + B_ - 3 * W_))


@pytest.mark.parametrize("cost", [CostModel(), CostModel(f=1, b=2, w=1), CostModel(f=2, b=1, w=0.5),
                                  CostModel(latency=0.3), CostModel(f=1, b=1.5, w=0.5, latency=0.1)])
def test_dualpipev_overlap_is_never_slower(cost: CostModel) -> None:
    from dataclasses import replace

    for p, m in [(2, 4), (4, 8), (4, 13), (8, 16), (8, 24)]:
        s = dualpipev(p, m)
        assert simulate(s, replace(cost, overlap=True)).makespan <= simulate(s, cost).makespan


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("p", range(1, 9))
def test_interleaved_zb_closed_forms(p: int, v: int) -> None:
    for m in (1, p, p + 1, 2 * p, 3 * p + 1):
        r = simulate(interleaved_zb(p, m, v))
        g = group_size(p, m)
        # Every device holds (v-1) rounds plus p chunk activations at most: 1F1B's p M when rounds are p.
        assert r.peak_memory == pytest.approx([min(m, (p + (v - 1) * g) / v)] * p)
        if m >= p:
            # The start-up bubble of ZB-H1, (p-1) slots, shrinks with the chunks: (p-1)/v.
            assert r.makespan == pytest.approx(3 * m + (p - 1) / v)


def test_reference_numbers_p4_p8() -> None:
    # The numbers quoted in the docs: unit costs, m = 2p.
    got = {}
    for p in (4, 8):
        for overlapped in (False, True):
            r = simulate(dualpipev(p, 2 * p), CostModel(overlap=overlapped))
            got["dualpipev", p, overlapped] = (r.makespan, round(r.bubble_ratio, 4), max(r.peak_memory))
        r = simulate(interleaved_zb(p, 2 * p))
        got["interleaved-zb", p, False] = (r.makespan, round(r.bubble_ratio, 4), max(r.peak_memory))
    assert got == {
        ("dualpipev", 4, False): (27.0, 0.1111, 4.5), ("dualpipev", 4, True): (22.0, 0.0511, 4.5),
        ("interleaved-zb", 4, False): (25.5, 0.0588, 4.0),
        ("dualpipev", 8, False): (55.0, 0.1273, 8.5), ("dualpipev", 8, True): (44.0, 0.0497, 8.5),
        ("interleaved-zb", 8, False): (51.5, 0.068, 8.0),
    }


def test_dualpipev_keeps_deepseeks_unpaired_turn() -> None:
    # The last device runs its first pair apart, as DeepSeek and torch do; with nothing to hide, pipefold's
    # simulator would find pairing it half a chunk pass faster (the docstring's numbers).
    s = dualpipev(4, 8)
    row = list(s.actions[3])
    k = row.index(F(3, 4))
    assert row[k + 1] == BW(4, 0)
    last = (*row[:k], overlap(row[k], row[k + 1]), *row[k + 2:])
    paired = Schedule("paired", 4, 8, 8, s.placement, (*s.actions[:3], last))
    assert [simulate(x, CostModel(overlap=True)).makespan for x in (s, paired)] == [22.0, 21.5]

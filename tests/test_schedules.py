"""Every registered schedule: valid for any shape, and the closed forms of the papers hold exactly."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import build_or_refused
from pipefold import ConfigError, CostModel, Kind, Schedule, build, names, simulate, validate
from pipefold.ir import dumps
from pipefold.schedules import get

STAGES = st.integers(1, 16)
MICROBATCHES = st.integers(1, 64)


def _options(name: str, p: int, m: int, data: st.DataObject) -> dict[str, int]:
    """Any value of each option from its search space (v from 1, which the planner does not try)."""
    out = {}
    for opt in get(name).options:
        values = [1, *opt.search(p, m)] if opt.name == "v" else list(opt.search(p, m)) or [opt.default]
        out[opt.name] = data.draw(st.sampled_from(values), label=opt.name)
    return out


@pytest.mark.parametrize("name", names())
@given(p=STAGES, m=MICROBATCHES, data=st.data())
def test_every_schedule_is_valid_complete_and_round_trips(name: str, p: int, m: int, data: st.DataObject) -> None:
    options = _options(name, p, m, data)
    s = build_or_refused(name, p, m, **options)
    if s is None:  # e.g. Chimera on an odd p; the message names the nearest valid shape
        return
    validate(s)
    # Every action appears exactly once, and every (stage, microbatch) has F plus B+W or BW.
    flat = [a for row in s.actions for act in row for a in act.passes if a.microbatch >= 0]
    assert len(flat) == len(set(flat))
    per_pass = Counter((a.stage, a.microbatch) for a in flat)
    kinds = {(a.stage, a.microbatch): set() for a in flat}
    for a in flat:
        kinds[(a.stage, a.microbatch)].add(a.kind)
    assert set(per_pass) == {(st_, mb) for st_ in range(s.stages) for mb in range(m)}
    assert all(ks in ({Kind.F, Kind.BW}, {Kind.F, Kind.B, Kind.W}) for ks in kinds.values())
    # Actions sit on the device that holds their stage (for their microbatch's replica); a replicated stage
    # has its gradient all-reduce on each holder.
    assert all(s.device_of(a.stage, a.microbatch) == d for d, row in enumerate(s.actions) for act in row
               for a in act.passes if a.microbatch >= 0)
    reduces = sorted((a.stage, d) for d, row in enumerate(s.actions) for a in row if a.kind == Kind.R)
    assert reduces == sorted((st_, d) for st_ in range(s.stages) if s.replicas > 1 for d in s.holders(st_))
    # Text, JSON and CSV forms read back exactly.
    assert Schedule.from_text(s.to_text()) == s
    assert Schedule.from_json(dumps(s, "json")) == s
    assert Schedule.from_csv(s.to_csv(), name=s.name, options=s.options) == s


@given(p=STAGES, m=MICROBATCHES)
def test_1f1b_closed_form(p: int, m: int) -> None:
    r = simulate(build("1f1b", p, m))
    assert r.makespan == (m + p - 1) * 3
    assert r.peak_memory == [min(m, p - i) for i in range(p)]


@given(p=st.integers(1, 8), m=st.integers(1, 32), f=st.integers(1, 4), b=st.integers(1, 4), w=st.integers(1, 4))
def test_1f1b_closed_form_any_costs(p: int, m: int, f: int, b: int, w: int) -> None:
    r = simulate(build("1f1b", p, m), CostModel(f=f, b=b, w=w))
    assert r.makespan == (m + p - 1) * (f + b + w)


@given(p=STAGES, m=MICROBATCHES)
def test_gpipe_holds_every_microbatch(p: int, m: int) -> None:
    r = simulate(build("gpipe", p, m))
    assert r.peak_memory == [m] * p
    assert r.makespan == (m + p - 1) * 3


@given(p=STAGES, m=MICROBATCHES, k=st.integers(1, 64))
def test_kfkb_peak(p: int, m: int, k: int) -> None:
    r = simulate(build("kfkb", p, m, k=k))
    assert r.peak_memory == [min(m, k * (p - i)) for i in range(p)]


def test_kfkb_ends_are_1f1b_and_gpipe() -> None:
    for p, m in [(4, 8), (3, 7), (5, 2)]:
        assert build("kfkb", p, m, k=1).actions == build("1f1b", p, m).actions
        assert build("kfkb", p, m, k=m).actions == build("gpipe", p, m).actions


@given(p=STAGES, data=st.data())
def test_zb_h1_closed_form(p: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(p, 64), label="m")  # the closed form is for a full pipeline, m >= p
    r = simulate(build("zb-h1", p, m))
    assert r.makespan == 3 * m + (p - 1) * (1 + 1 - 1)
    assert max(r.peak_memory) <= p


@given(p=st.integers(1, 8), data=st.data())
def test_zb_h1_closed_form_unequal_costs(p: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(p, 32), label="m")
    f, b = data.draw(st.integers(1, 4), label="f"), data.draw(st.integers(1, 4), label="b")
    # W no longer than F or B: then each deferred W fits in a gap of the tail (the paper's regime).
    w = data.draw(st.integers(1, min(f, b)), label="w")
    r = simulate(build("zb-h1", p, m), CostModel(f=f, b=b, w=w))
    assert r.makespan == m * (f + b + w) + (p - 1) * (f + b - w)


@given(p=STAGES, m=MICROBATCHES)
def test_zb_h2_memory_about_twice_1f1b(p: int, m: int) -> None:
    r = simulate(build("zb-h2", p, m))
    assert max(r.peak_memory) <= min(m, 2 * p - 1)
    # It never loses to ZB-H1 under unit costs.
    assert r.makespan <= simulate(build("zb-h1", p, m)).makespan


def test_zb_h2_beats_h1_when_w_is_cheap_and_startup_dominates() -> None:
    cost = CostModel(f=1, b=2, w=1)
    h1 = simulate(build("zb-h1", 4, 8), cost)
    h2 = simulate(build("zb-h2", 4, 8), cost)
    assert h2.makespan < h1.makespan


def test_reference_cases_p4_m8() -> None:
    r = simulate(build("1f1b", 4, 8))
    assert (r.makespan, r.peak_memory) == (33, [4, 3, 2, 1])
    r = simulate(build("interleaved-1f1b", 4, 8, v=2))
    assert r.makespan == 28.5
    assert r.peak_memory[0] == 5.5
    r = simulate(build("zb-h1", 4, 8))
    assert r.makespan == 27
    assert max(r.peak_memory) == 4


@given(p=st.integers(2, 8), data=st.data())
def test_interleaving_divides_the_bubble(p: int, data: st.DataObject) -> None:
    v = data.draw(st.integers(1, 4), label="v")
    m = p * data.draw(st.integers(1, 4), label="groups")
    r = simulate(build("interleaved-1f1b", p, m, v=v))
    # Megatron: the bubble of 1F1B, (p-1)(F+B+W), divided by v.
    assert r.makespan == pytest.approx(3 * m + 3 * (p - 1) / v)


@given(p=st.integers(1, 8), m=st.integers(1, 32), v=st.integers(1, 4))
def test_looped_bfs_is_gpipe_like_in_memory(p: int, m: int, v: int) -> None:
    r = simulate(build("looped-bfs", p, m, v=v))
    assert r.peak_memory == pytest.approx([m] * p)


def test_bad_parameters_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="unknown schedule 'nope'; known schedules: gpipe, 1f1b"):
        build("nope", 4, 8)
    with pytest.raises(ConfigError, match="microbatches must be a positive integer"):
        build("1f1b", 4, 0)
    with pytest.raises(ConfigError, match="takes no option 'k'"):
        build("1f1b", 4, 8, k=2)
    with pytest.raises(ConfigError, match=r"must be an integer >= 1 \(got 0\)"):
        build("interleaved-1f1b", 4, 8, v=0)


def test_a_family_with_a_minimum_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from pipefold import schedules

    spec = replace(get("zb-v"), name="needs-2p", min_microbatches=lambda p: 2 * p)
    monkeypatch.setitem(schedules.REGISTRY, "needs-2p", spec)
    with pytest.raises(ConfigError, match=r"needs-2p needs at least 8 microbatches on 4 devices \(got 5\); "
                                          r"use --microbatches 8 or more"):
        build("needs-2p", 4, 5)
    assert build("needs-2p", 4, 8).microbatches == 8


def test_counted_rows_number_the_passes_as_a_plain_walk_of_the_order_does() -> None:
    """The columns builders hand over (``schedules._phases.counted_rows``), against a plain walk of random orders
    with counters: the k-th forward of a stage is its replica's k-th microbatch, so is the k-th backward (B or
    BW), a W takes the oldest B of its stage still without one, an R has no microbatch; passes past the
    replica's microbatches are left out; paired passes make one overlapped action; a W with no B before it, or a
    pair whose second pass is left out, is refused."""
    import collections
    import random

    import numpy as np

    from pipefold.ir import NO_MICROBATCH, Action
    from pipefold.schedules._phases import CODES, counted_rows, phases

    codes = ("F", "B", "W", "BW", "R")
    assert codes == CODES  # the numbers the builders write
    rng = random.Random(7)
    checked = refused = 0
    for _ in range(400):
        devices, m = rng.randint(1, 4), rng.randint(1, 6)
        takes = {(d, s): sorted(rng.sample(range(m + 2), rng.randint(0, m))) for d in range(devices) for s in range(3)}
        use_takes = rng.random() < 0.5
        rows, expected, bad = [], [], False
        for d in range(devices):
            parts = [([(rng.randrange(5), rng.randrange(3)) for _ in range(rng.randint(0, 4))], rng.randint(-1, 5))
                     for _ in range(rng.randint(0, 4))]
            kind, stage, _ = phases(*parts)
            tokens = [tok for pattern, times in parts for _ in range(max(times, 0)) for tok in pattern]
            assert list(zip(kind.tolist(), stage.tolist(), strict=True)) == tokens
            paired = [rng.random() < 0.2 and i + 1 < len(tokens) and tokens[i][0] == 0 and tokens[i + 1][0] in (1, 3)
                      for i in range(len(tokens))]
            for i in range(1, len(paired)):
                paired[i] = paired[i] and not paired[i - 1]
            forwards: collections.Counter[int] = collections.Counter()
            backwards: collections.Counter[int] = collections.Counter()
            pending: dict[int, collections.deque[int]] = collections.defaultdict(collections.deque)
            passes: list[Action | None] = []
            for k, s in tokens:
                if k == 4:
                    passes.append(Action(s, "R", NO_MICROBATCH))
                    continue
                if k == 2:
                    if not pending[s]:
                        bad = True
                        break
                    j = pending[s].popleft()
                elif k == 0:
                    j, forwards[s] = forwards[s], forwards[s] + 1
                else:
                    j, backwards[s] = backwards[s], backwards[s] + 1
                    if k == 1:
                        pending[s].append(j)
                taken = takes[d, s] if use_takes else list(range(m))
                passes.append(Action(s, codes[k], taken[j]) if j < len(taken) else None)
            row: list[Action] = []
            i = 0
            while not bad and i < len(passes):
                if paired[i]:
                    if passes[i] is None or passes[i + 1] is None:
                        bad = True
                        break
                    row.append(Action(-1, "FB", NO_MICROBATCH, (passes[i], passes[i + 1])))  # type: ignore[arg-type]
                    i += 2
                    continue
                if passes[i] is not None:
                    row.append(passes[i])  # type: ignore[arg-type]
                i += 1
            rows.append((kind, stage, np.array(paired, dtype=bool)))
            expected.append(tuple(row))
        try:
            got = counted_rows(rows, m, takes=(lambda d, s, t=takes: t[d, s]) if use_takes else None)
        except ValueError:
            assert bad
            refused += 1
            continue
        assert not bad
        checked += 1
        assert got == tuple(expected) and got.lengths == tuple(map(len, expected))
    assert checked > 100 and refused > 20

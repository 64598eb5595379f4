"""Schedule references: the one reader and writer of ``name:key=value,...``."""

from __future__ import annotations

import pytest

from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.ir.ref import ScheduleRef
from pipefold.plan.budget import candidates


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 6)])
def test_every_candidate_the_planner_names_reads_back_and_builds_the_same_schedule(p: int, m: int) -> None:
    for name, options in candidates(p, m):
        text = str(ScheduleRef.named(name, options))
        back = ScheduleRef.parse(text)
        assert (back.name, back.kwargs) == (name, options)
        assert list(back.kwargs) == list(options)  # the family's order, kept
        try:
            built = schedules.build(back.name, p, m, **back.kwargs)
        except ConfigError:
            continue
        assert str(ScheduleRef.of(built)) == text or built.options != options


def test_text_examples() -> None:
    assert str(ScheduleRef.parse("1f1b")) == "1f1b" and ScheduleRef.parse("1f1b").options == ()
    ref = ScheduleRef.parse("v-block:f0=2,f1=1,b0=4,b1=2,turn=1")
    assert ref.options == (("f0", 2), ("f1", 1), ("b0", 4), ("b1", 2), ("turn", 1))
    assert str(ref) == "v-block:f0=2,f1=1,b0=4,b1=2,turn=1"
    assert ScheduleRef.parse("kfkb:k=4").option("k", 1) == 4 and ScheduleRef.parse("1f1b").option("k", 1) == 1
    assert str(ScheduleRef.parse("kfkb: k=3,")) == "kfkb:k=3"  # spaces round a key and a trailing comma forgiven


@pytest.mark.parametrize(("text", "message"), [
    ("kfkb:k", "use name:key=value"),
    ("kfkb:k=three", "must be an integer"),
    ("kfkb:k=3,v", "cannot read option 'v'"),
])
def test_bad_text_is_one_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ScheduleRef.parse(text)

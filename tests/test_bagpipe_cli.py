"""``pipefold bagpipe``: a run reports what the server moved (no cache: every row of every step; the oracle: fewer,
as its plan says), and each bad input is one line and a non-zero exit."""

from __future__ import annotations

import json

import pytest

from pipefold.cli.main import main
from pipefold.models.dlrm import DLRMConfig
from pipefold.plan.bagpipe import make_cacher, plan_rounds, stats
from pipefold.runtime.launch.bagpipe import BagpipeJob

SMALL = ("--steps", "6", "--rows", "300", "--tables", "2", "--batch", "16", "--json")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_no_cache_fetches_every_row_of_every_step_and_the_oracle_what_its_plan_says(capsys) -> None:  # type: ignore[no-untyped-def]
    cfg = DLRMConfig(tables=2, rows=300, batch=16)
    batches = [set(BagpipeJob(model=cfg).keys_at(s)) for s in range(6)]
    code, out, err = run(capsys, "bagpipe", "--policy", "none", *SMALL)
    assert code == 0, err
    none = json.loads(out)
    assert none["hit_rate"] == 0 and none["rows_fetched"] == sum(map(len, batches))
    assert none["rows_written"] == none["rows_fetched"]  # each step's rows go back, the last at the end
    code, out, err = run(capsys, "bagpipe", "--lookahead", "4", "--cache", "0.1", *SMALL)
    assert code == 0, err
    oracle = json.loads(out)
    want = stats(plan_rounds(make_cacher("oracle", 60, lookahead=4, ahead=1), batches))
    assert oracle["rows_fetched"] == want.fetched < none["rows_fetched"]
    assert oracle["hit_rate"] == round(want.hit_rate, 4) and oracle["first_loss"] == none["first_loss"]


def test_the_table_names_the_cache_and_its_hit_rate(capsys) -> None:  # type: ignore[no-untyped-def]
    code, out, err = run(capsys, "bagpipe", "--policy", "lru", *SMALL[:-1])
    assert code == 0, err
    assert "lru, 30 rows" in out and "hit rate" in out and "median step" in out


@pytest.mark.parametrize(("argv", "says"), [
    (("--lookahead", "10", "--steps", "6"), "more than the 6 steps of data"),
    (("--server-memory", "10KB"), "give the server more memory"),
    (("--tables", "4096", "--rows", "1000000", "--dim", "1024"), "more than half this machine's"),
    (("--cache", "1.5"), "out of range"),
    (("--cache", "0.01", "--rows", "300", "--tables", "2"), "cannot hold"),
    (("--trainers", "3", "--batch", "16"), "cannot share 16 samples"),
    (("--skew", "0.005"), "the skew"),
    (("--network", "constant:latency=-1"), "latency"),
    (("--lookahead", "-1"), "out of range"),
    (("--policy", "lru", "--lookahead", "4"), "--lookahead is how many batches the oracle reads ahead"),
    (("--policy", "none", "--cache", "0.1"), "--cache shapes a cache"),
    (("--policy", "none", "--ahead", "2"), "--ahead shapes a cache"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(capsys, argv: tuple[str, ...], says: str) -> None:  # type: ignore[no-untyped-def]
    code, out, err = run(capsys, "bagpipe", *argv)
    assert code != 0 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err

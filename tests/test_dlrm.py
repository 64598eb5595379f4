"""The DLRM family: its data is a pure function of seed and step with the skew asked for, and its interaction is the
pairwise dot products of the features."""

import pytest
import torch

from pipefold.errors import ConfigError
from pipefold.models.dlrm import DLRM, DLRMConfig, dlrm_batch, dlrm_loss, init_tables, zipf_exponent


def test_batches_are_a_pure_function_of_seed_and_step() -> None:
    cfg = DLRMConfig(rows=500, batch=16)
    a, b = dlrm_batch(cfg, 3), dlrm_batch(DLRMConfig(rows=500, batch=16), 3)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.ids, dlrm_batch(cfg, 4).ids)
    assert not torch.equal(a.ids, dlrm_batch(DLRMConfig(rows=500, batch=16, seed=1), 3).ids)
    assert a.ids.shape == (4, 16) and int(a.ids.min()) >= 0 and int(a.ids.max()) < 500
    assert set(a.labels.tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("skew", [0.5, 0.92])
def test_the_hot_rows_take_the_share_of_accesses_asked_for(skew: float) -> None:
    cfg = DLRMConfig(tables=2, rows=2000, batch=512, skew=skew)
    ids = torch.cat([dlrm_batch(cfg, s).ids for s in range(40)], dim=1)  # (T, 20480)
    for t in range(cfg.tables):
        counts = torch.bincount(ids[t], minlength=cfg.rows)
        top = counts.sort(descending=True).values[:20]  # the 1% most used rows, counted
        assert abs(float(top.sum()) / ids.shape[1] - skew) < 0.02


def test_zipf_exponent_is_uniform_at_no_skew_and_grows_with_it() -> None:
    assert zipf_exponent(1000, 0.01, 0.01) == pytest.approx(0.0, abs=1e-6)
    assert 0 < zipf_exponent(1000, 0.01, 0.5) < zipf_exponent(1000, 0.01, 0.92)


def test_interaction_is_the_pairwise_dots_of_bottom_output_and_rows() -> None:
    cfg = DLRMConfig(tables=3, rows=50, hot=0.1)
    model, tables, batch = DLRM(cfg), init_tables(cfg), dlrm_batch(cfg, 0)
    rows = tables[batch.keys(cfg.rows)]  # (T, B, D)
    x = model.bottom(batch.dense)
    feats = [x, *rows]
    dots = [(feats[i] * feats[j]).sum(1) for i in range(4) for j in range(i + 1, 4)]
    want = model.top(torch.cat([x, torch.stack(dots, 1)], 1)).squeeze(1)
    torch.testing.assert_close(model(batch.dense, rows), want)
    halves = [dlrm_loss(model(p.dense, rows[:, k * 16:(k + 1) * 16]), p.labels, 32)
              for k, p in enumerate((batch.part(0, 2), batch.part(1, 2)))]
    torch.testing.assert_close(halves[0] + halves[1], dlrm_loss(model(batch.dense, rows), batch.labels))


@pytest.mark.parametrize("bad", [{"rows": 0}, {"skew": 1.0}, {"skew": 0.001}, {"hot": 0.0001}])
def test_bad_shapes_are_refused_in_one_line(bad: dict) -> None:
    with pytest.raises(ConfigError) as err:
        DLRMConfig(**bad)
    assert "\n" not in str(err.value)

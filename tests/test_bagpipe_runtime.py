"""Bagpipe's runtime against synchronous remote access and against one process training the whole DLRM: after every
step every row (server and cache merged) and every MLP weight, for several policies, caches, lookaheads and two
data-parallel trainers; and the server's own count of the rows it moved against the plan's."""

import math

import pytest
import torch

from pipefold.errors import ConfigError
from pipefold.models.dlrm import DLRM, DLRMConfig, dlrm_batch, dlrm_loss, init_tables
from pipefold.runtime.launch.bagpipe import BagpipeJob, run_bagpipe
from pipefold.sim.network import Network

CFG = DLRMConfig(tables=3, rows=200, dim=8, batch=16, hot=0.05, skew=0.8)
STEPS, LR = 12, 0.1


def one_process(cfg: DLRMConfig, steps: int, lr: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole model in one process, the tables a dense tensor that SGD steps as a whole (its untouched rows have
    zero gradients): every row and the MLPs' weights after each step."""
    model, tables = DLRM(cfg), init_tables(cfg).requires_grad_(True)
    opt = torch.optim.SGD([*model.parameters(), tables], lr=lr)
    out = []
    for s in range(steps):
        batch = dlrm_batch(cfg, s)
        loss = dlrm_loss(model(batch.dense, tables[batch.keys(cfg.rows)]), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append((tables.detach().clone(), torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    return out


@pytest.fixture(scope="module")
def reference() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return one_process(CFG, STEPS, LR)


@pytest.fixture(scope="module")
def synchronous() -> list[tuple[torch.Tensor, torch.Tensor]]:
    run = run_bagpipe(BagpipeJob(model=CFG, steps=STEPS, policy="none", cache=CFG.keys, lr=LR, snapshots=True))
    assert run.predicted.hits == 0 and run.fetched == [sum(len(set(BagpipeJob(model=CFG).keys_at(s)))
                                                           for s in range(STEPS))]
    return run.snapshots[0]


def assert_same(got: list[tuple[torch.Tensor, torch.Tensor]], want: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    assert len(got) == len(want) == STEPS
    for s, ((rows, mlp), (rows_want, mlp_want)) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(rows, rows_want, rtol=0, atol=1e-6, msg=lambda m, s=s: f"rows after step {s}: {m}")
        torch.testing.assert_close(mlp, mlp_want, rtol=0, atol=1e-6, msg=lambda m, s=s: f"MLPs after step {s}: {m}")


def test_synchronous_access_equals_one_process(synchronous, reference) -> None:  # type: ignore[no-untyped-def]
    assert_same(synchronous, reference)
    assert not torch.equal(reference[-1][0], init_tables(CFG))  # the rows did train


@pytest.mark.parametrize(("policy", "cache", "lookahead", "ahead", "trainers"), [
    ("oracle", 60, 1, 1, 1), ("oracle", 60, 8, 1, 1), ("oracle", 80, 4, 2, 1), ("lru", 60, 1, 1, 1),
    ("oracle", 60, 8, 1, 2), ("lru", 80, 1, 2, 2)])
def test_cached_training_equals_synchronous_access_and_one_process_every_step(  # type: ignore[no-untyped-def]
        synchronous, reference, policy: str, cache: int, lookahead: int, ahead: int, trainers: int) -> None:
    job = BagpipeJob(model=CFG, steps=STEPS, policy=policy, cache=cache, lookahead=lookahead, ahead=ahead,
                     trainers=trainers, lr=LR, snapshots=True)
    run = run_bagpipe(job)
    assert run.predicted.hits > 0 and run.predicted.written > 0  # rows were kept, and rows left
    if policy == "lru":  # and came back, their updates with them
        assert run.predicted.fetched > len(set().union(*(job.keys_at(s) for s in range(STEPS))))
    for snaps in run.snapshots:  # every trainer's view
        assert_same(snaps, synchronous)
        assert_same(snaps, reference)
    # The server's own counts: what the plan said, to every trainer; only the first writes back.
    assert run.fetched == [run.predicted.fetched] * trainers
    assert run.written == [run.predicted.written + run.final_writes] + [0] * (trainers - 1)
    first = dlrm_batch(CFG, 0)
    with torch.no_grad():
        loss = dlrm_loss(DLRM(CFG)(first.dense, init_tables(CFG)[first.keys(CFG.rows)]), first.labels)
    assert math.isclose(run.losses[0], float(loss), rel_tol=1e-6)  # the whole batch's, summed over the trainers


def test_an_emulated_link_delays_each_synchronous_step_and_the_oracle_hides_it() -> None:
    latency = 0.02  # one way: a round trip takes 40 ms
    net = Network.constant(latency=latency)
    steps = 6
    none = run_bagpipe(BagpipeJob(model=CFG, steps=steps, policy="none", cache=CFG.keys, network=net))
    assert min(none.step_times) >= 2 * latency
    oracle = run_bagpipe(BagpipeJob(model=CFG, steps=steps, policy="oracle", cache=150, lookahead=steps,
                                    ahead=3, network=net))
    # Rounds run up to 3 steps early and their latencies overlap on the link: after the first, the steps wait for
    # less than a round trip each, in all.
    assert sum(oracle.step_times[1:]) < sum(none.step_times[1:])


@pytest.mark.parametrize(("given", "says"), [
    ({"lookahead": 30, "steps": 20}, "more than the 20 steps"),
    ({"cache": 601}, "larger than the tables"),
    ({"server_memory": 1000}, "give the server more memory"),
    ({"trainers": 3}, "cannot share 16 samples"),
    ({"cache": 10}, "cannot hold"),
])
def test_bad_jobs_are_refused_in_one_line_before_any_process_starts(given: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as err:
        run_bagpipe(BagpipeJob(model=CFG, **given))
    assert "\n" not in str(err.value)


def _misused(rank: int, init: str, out) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from pipefold.plan.bagpipe import LRUCacher
    from pipefold.runtime.bagpipe import EmbeddingServer, RemoteEmbeddings

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        if rank == 1:
            EmbeddingServer(init_tables(CFG), trainers=[0]).serve()
            return
        batches = [dlrm_batch(CFG, s) for s in range(3)]
        emb = RemoteEmbeddings(server=1, keys=CFG.keys, dim=CFG.dim, steps=3, cacher=LRUCacher(100), lr=LR,
                               keys_at=lambda s: batches[s].keys(CFG.rows).flatten().tolist())
        said = []
        for wrong in (lambda: emb.gather(1, batches[1].keys(CFG.rows)), emb.step,
                      lambda: emb.gather(0, torch.tensor([CFG.keys - 1 - k for k in range(CFG.keys)]))):
            try:
                wrong()
            except ConfigError as exc:
                said.append(str(exc))
        for s in range(3):  # and then trains as if nothing had happened
            emb.gather(s, batches[s].keys(CFG.rows)).sum().backward()
            emb.step()
        out.put((said, emb.close()))
    finally:
        dist.destroy_process_group()


def test_the_library_refuses_steps_out_of_order_and_rows_its_batch_does_not_name() -> None:
    from conftest import run_ranks

    [(said, (fetched, written))] = run_ranks(_misused, 2, timeout=60)
    assert "expected step 0, got 1" in said[0] and "after gather()" in said[1] and "does not name" in said[2]
    rows = [set(dlrm_batch(CFG, s).keys(CFG.rows).flatten().tolist()) for s in range(3)]
    assert fetched == len(set().union(*rows)) == written  # LRU of 100 rows: nothing left before the end

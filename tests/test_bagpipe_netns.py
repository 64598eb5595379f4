"""Bagpipe over real links: the server and each trainer in a network namespace of their own, what each sends capped
by tc. Training is the same as synchronous access and as one process, step by step; the bytes tc counted on each
interface cover the rows the server says it moved; a slow cap holds the steps to it; the command line runs it."""

from __future__ import annotations

import json

import pytest
import torch

from pipefold.models.dlrm import DLRMConfig
from pipefold.runtime.launch import netns
from pipefold.runtime.launch.bagpipe import BagpipeJob, run_bagpipe, run_bagpipe_netns
from test_bagpipe_runtime import CFG, LR, STEPS, assert_same, one_process

REASON = netns.unavailable()
if REASON is not None:
    pytest.skip(f"network namespaces cannot be made here: {REASON}", allow_module_level=True)

RATE = 2e6


@pytest.mark.parametrize(("policy", "cache", "lookahead", "trainers"), [
    ("none", CFG.keys, 1, 1), ("oracle", 60, 8, 1), ("lru", 60, 1, 2)])
def test_training_over_namespaces_is_one_process_every_step(policy: str, cache: int, lookahead: int,
                                                            trainers: int) -> None:
    job = BagpipeJob(model=CFG, steps=STEPS, policy=policy, cache=cache, lookahead=lookahead, trainers=trainers,
                     lr=LR, snapshots=True)
    run = run_bagpipe_netns(job, RATE)
    want = one_process(CFG, STEPS, LR)
    for snaps in run.snapshots:
        assert_same(snaps, want)
    # tc's own count: the server's interface sent at least every row it says it sent (4 bytes a value), each
    # trainer at least the rows it wrote back; packets carry headers and keys besides.
    row = 4 * CFG.dim
    assert len(run.link_bytes) == trainers + 1
    assert run.link_bytes[-1] >= sum(run.fetched) * row
    for t in range(trainers):
        assert run.link_bytes[t] >= run.written[t] * row


def test_a_slow_cap_holds_the_steps_to_it() -> None:
    """No cache, 32 rows of 1 KiB a sample: each step fetches its rows and writes them back across links of
    200 KB/s, so the steps take at least what the server sent (past the token bucket's first 32 KiB) over that
    rate; the same job over this machine's own network takes a fraction of it."""
    cfg = DLRMConfig(tables=4, rows=2000, dim=256, batch=8, skew=0.5)
    job = BagpipeJob(model=cfg, steps=4, policy="none", cache=min(cfg.keys, cfg.tables * cfg.batch))
    rate = 2e5
    capped = run_bagpipe_netns(job, rate)
    floor = (capped.link_bytes[-1] - 32 * 1024) / rate
    assert sum(capped.step_times) >= 0.8 * floor > 0.3
    free = run_bagpipe(job)
    assert sum(free.step_times) < 0.5 * sum(capped.step_times)


def test_the_command_line_runs_over_namespaces_and_refuses_a_network_without_bandwidth(capsys) -> None:  # type: ignore[no-untyped-def]
    from pipefold.cli.main import main

    argv = ["bagpipe", "--netns", "--network", "constant:latency=0,bandwidth=2MB", "--steps", "4", "--lookahead",
            "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["netns"] is True and len(out["link_bytes"]) == 2
    assert out["link_bytes"][-1] >= out["bytes_fetched"]
    assert main(["bagpipe", "--netns", "--steps", "4", "--lookahead", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pipefold bagpipe: error: --netns caps the links at --network's bandwidth: give a network with "
                   "one, such as --network constant:latency=0,bandwidth=2MB"]


def test_no_namespace_is_left_behind() -> None:
    job = BagpipeJob(model=CFG, steps=2, policy="none", cache=CFG.keys)
    before = set(netns._run("ip", "netns", "list").stdout.split())
    run_bagpipe_netns(job, RATE)
    assert set(netns._run("ip", "netns", "list").stdout.split()) <= before
    assert torch.isfinite(torch.tensor(run_bagpipe(job).losses)).all()

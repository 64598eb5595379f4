"""``pipefold bagpipe``: a DLRM trained by a trainer whose embedding tables a server process holds, its rows cached
ahead of the steps (Bagpipe); the step times and what the cache saved."""

from __future__ import annotations

import argparse
import math
import statistics

from rich.console import Console
from rich.table import Table

from pipefold import jsonout
from pipefold.errors import ConfigError
from pipefold.units import format_bytes, parse_bytes


def cmd_bagpipe(args: argparse.Namespace, console: Console) -> None:
    from pipefold.models.dlrm import DLRMConfig
    from pipefold.runtime.launch.bagpipe import BagpipeJob, run_bagpipe, run_bagpipe_netns
    from pipefold.sim.network import parse_network

    cfg = DLRMConfig(tables=args.tables, rows=args.rows, dim=args.dim, batch=args.batch, skew=args.skew,
                     seed=args.seed)
    memory = None if args.server_memory is None else int(parse_bytes(args.server_memory, "--server-memory"))
    # With no cache a trainer holds one step's rows at a time: at most one per table and sample.
    cache = min(cfg.keys, cfg.tables * cfg.batch) if args.policy == "none" else round(args.cache * cfg.keys)
    if cache < 1:
        raise ConfigError(f"--cache {args.cache:g} of {cfg.keys} rows is less than one row: give a larger share")
    network = None if args.network is None else parse_network(args.network)
    rate = None
    if args.netns:
        rate = None if network is None else network.fastest
        if rate is None or math.isinf(rate):
            raise ConfigError("--netns caps the links at --network's bandwidth: give a network with one, such as "
                              "--network constant:latency=0,bandwidth=2MB")
    job = BagpipeJob(model=cfg, steps=args.steps, policy=args.policy, cache=cache, lookahead=args.lookahead,
                     ahead=args.ahead, trainers=args.trainers, lr=args.lr, server_memory=memory, network=network)
    got = run_bagpipe(job) if rate is None else run_bagpipe_netns(job, rate)
    row = 4 * cfg.dim
    out = {"policy": job.policy, "cache_rows": job.cache, "lookahead": job.lookahead, "ahead": job.ahead,
           "trainers": job.trainers, "steps": job.steps, "hit_rate": round(got.predicted.hit_rate, 4),
           "rows_fetched": got.fetched[0], "rows_written": got.written[0], "bytes_fetched": got.fetched[0] * row,
           "first_loss": got.losses[0], "last_loss": got.losses[-1],
           "network": None if job.network is None else job.network.name, "server_memory": memory,
           "netns": args.netns, "link_bytes": got.link_bytes or None,
           "seconds": {"median_step": statistics.median(got.step_times), "waited": round(got.waited, 6)}}
    if args.json:
        print(jsonout.dumps(out))
        return
    table = Table(title=f"pipefold bagpipe: {cfg.tables} tables of {cfg.rows} rows x {cfg.dim}, batch {cfg.batch}, "
                        f"skew {cfg.skew:g}", title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("cache", f"{job.policy}, {job.cache} rows ({format_bytes(job.cache * row)})"
                  + (f", lookahead {job.lookahead}" if job.policy == "oracle" else "") + f", {job.ahead} ahead")
    table.add_row("hit rate", f"{got.predicted.hit_rate:.3f}")
    table.add_row("rows fetched / written back", f"{got.fetched[0]} / {got.written[0]} "
                                                 f"({format_bytes(got.fetched[0] * row)} fetched)")
    if got.link_bytes:
        table.add_row("bytes on the links (tc)", f"{format_bytes(sum(got.link_bytes[:-1]))} to the server, "
                                                 f"{format_bytes(got.link_bytes[-1])} from it")
    table.add_row("median step", f"{statistics.median(got.step_times) * 1e3:.2f} ms")
    table.add_row("waited for rows", f"{got.waited:.3f} s of {sum(got.step_times):.3f} s")
    table.add_row("loss", f"{got.losses[0]:.4f} -> {got.losses[-1]:.4f}")
    console.print(table)

"""Bagpipe's step time: a DLRM whose tables an embedding server holds behind a slow emulated link, trained with no
cache (every step fetches its rows and writes them back), an LRU cache and the lookahead oracle's cache.

Each repeat runs, for every skew, no cache, LRU, and the oracle at every lookahead, one after the other (so the
machine's drift between repeats falls on all alike); a run is one trainer and one server process
(:func:`pipefold.runtime.launch.bagpipe.run_bagpipe`) and its figure the median step after the first. Two checks
that do not come from the cacher: the rows the server counted as sent and written back against what the plan said,
and every plan replayed on plain sets (each round's rows present, nothing pinned evicted, the cache never over its
rows) with the hits counted there.

With ``--netns`` the trainer and the server run in network namespaces of their own, what each sends capped by tc at
the network's bandwidth (real veth links and a token bucket; the network's latency is not added): a third check,
tc's count of the bytes the server's interface sent, at least the rows the server says it sent.

    OMP_NUM_THREADS=1 python benchmarks/bench_bagpipe.py [--skews 0.8,0.92,0.98] [--lookaheads 2,8] [--repeats 3]
    OMP_NUM_THREADS=1 python benchmarks/bench_bagpipe.py --netns --network constant:latency=0,bandwidth=2MB
"""

from __future__ import annotations

import argparse
import statistics
import time

from pipefold.errors import run_script
from pipefold.models.dlrm import DLRMConfig
from pipefold.plan.bagpipe import Round
from pipefold.runtime.launch.bagpipe import BagpipeJob, BagpipeResult, run_bagpipe, run_bagpipe_netns
from pipefold.sim.network import parse_network


def replayed_hits(job: BagpipeJob, rounds: list[Round]) -> int:
    """The rounds carried out on a set, every rule checked; the rows each step found cached, counted there."""
    cached: set[int] = set()
    batches = [set(job.keys_at(s)) for s in range(job.steps)]
    hits = 0
    for s, r in enumerate(rounds):
        pinned = batches[s].union(*batches[max(0, s - job.ahead):s])
        if not set(r.evict) <= cached or set(r.evict) & (pinned - set(r.fetch)):
            raise AssertionError(f"round {s} of {job.policy} evicts a row it does not hold or one a step uses")
        hits += len(batches[s] & (cached - set(r.evict)))
        cached = (cached - set(r.evict)) | set(r.fetch)
        if not batches[s] <= cached or len(cached) > job.cache:
            raise AssertionError(f"after round {s} of {job.policy} the cache lacks a row or holds too many")
    return hits


def run(job: BagpipeJob, rate: float | None = None) -> tuple[float, float, BagpipeResult]:
    """(median step seconds after the first, the replayed hit rate, the result), the server's counts checked; over
    namespaces capped at ``rate`` bytes per second where given, tc's count of the server's bytes checked too."""
    got = run_bagpipe(job) if rate is None else run_bagpipe_netns(job, rate)
    if rate is not None and got.link_bytes[-1] < got.fetched[0] * 4 * job.model.dim:
        raise AssertionError(f"{job.policy}: tc counted {got.link_bytes[-1]} bytes from the server, less than the "
                             f"{got.fetched[0]} rows it says it sent")
    rounds = job.plan()
    if got.fetched != [got.predicted.fetched] or got.written != [got.predicted.written + got.final_writes]:
        raise AssertionError(f"{job.policy}: the server counted {got.fetched} rows fetched and {got.written} "
                             f"written, the plan {got.predicted.fetched} and {got.predicted.written} + "
                             f"{got.final_writes} at the end")
    hits, need = replayed_hits(job, rounds), sum(len(set(job.keys_at(s))) for s in range(job.steps))
    if hits != got.predicted.hits:
        raise AssertionError(f"{job.policy}: the replay counts {hits} hits, the cacher {got.predicted.hits}")
    return statistics.median(got.step_times[1:]), hits / need, got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skews", default="0.8,0.92,0.98", help="shares of accesses on the hottest 1%% of rows")
    ap.add_argument("--lookaheads", default="2,8", help="the oracle's lookaheads (batches)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=20000, help="rows per table")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--cache", type=float, default=0.02, help="share of all rows the trainer caches")
    ap.add_argument("--ahead", type=int, default=2, help="steps ahead a round runs (oracle and LRU)")
    ap.add_argument("--network", default="constant:latency=2e-3,bandwidth=10MB",
                    help="the emulated link between trainer and server")
    ap.add_argument("--netns", action="store_true",
                    help="real links: trainer and server in network namespaces, capped by tc at --network's bandwidth")
    args = ap.parse_args()
    try:
        skews = [float(x) for x in args.skews.split(",")]
        lookaheads = [int(x) for x in args.lookaheads.split(",")]
    except ValueError:
        ap.error(f"--skews takes shares and --lookaheads whole numbers, comma-separated (got {args.skews!r} and "
                 f"{args.lookaheads!r})")
    if args.repeats < 1 or args.steps < 2:
        ap.error("--repeats must be 1 or more and --steps 2 or more")
    network = parse_network(args.network)
    rate = None
    if args.netns:
        rate = network.fastest
        if rate == float("inf"):
            ap.error("--netns caps the links at --network's bandwidth: give a network with one")
    jobs: dict[tuple[float, str], BagpipeJob] = {}
    for skew in skews:
        cfg = DLRMConfig(tables=args.tables, rows=args.rows, dim=args.dim, batch=args.batch, skew=skew)
        cache = round(args.cache * cfg.keys)
        common = {"model": cfg, "steps": args.steps, "network": None if args.netns else network}
        jobs[skew, "none"] = BagpipeJob(policy="none", cache=cfg.tables * cfg.batch, **common)
        jobs[skew, "lru"] = BagpipeJob(policy="lru", cache=cache, ahead=args.ahead, **common)
        for k in sorted({min(k, args.steps) for k in lookaheads}):  # no more batches ahead than there are
            jobs[skew, f"oracle {k}"] = BagpipeJob(policy="oracle", cache=cache, lookahead=k, ahead=args.ahead,
                                                   **common)
    times: dict[tuple[float, str], list[float]] = {key: [] for key in jobs}
    rates: dict[tuple[float, str], float] = {}
    moved: dict[tuple[float, str], int] = {}
    wire: dict[tuple[float, str], int] = {}
    start = time.perf_counter()
    for _ in range(args.repeats):
        for key, job in jobs.items():
            step, hit, got = run(job, rate)
            times[key].append(step)
            rates[key], moved[key] = hit, got.fetched[0]
            wire[key] = got.link_bytes[-1] if got.link_bytes else 0
    print(f"{args.tables} tables of {args.rows} rows x {args.dim}, batch {args.batch}, {args.steps} steps, cache "
          f"{args.cache:g} of the rows, rounds {args.ahead} steps ahead, network {network.name}"
          f"{f' over network namespaces capped at {rate:g} B/s' if rate else ''}; median step ms "
          f"(min-max over {args.repeats} repeats), {time.perf_counter() - start:.0f} s in all")
    print("| skew | policy | hit rate | rows fetched | server bytes (tc) | step ms | none / this |")
    print("|---|---|---|---|---|---|---|")
    for key in jobs:
        skew, policy = key
        med = statistics.median(times[key])
        base = statistics.median(times[skew, "none"])
        print(f"| {skew:g} | {policy} | {rates[key]:.3f} | {moved[key]} | {wire[key] or '-'} | {med * 1e3:.2f} "
              f"({min(times[key]) * 1e3:.2f}-{max(times[key]) * 1e3:.2f}) | {base / med:.2f} |")
    print("checks: the server's counts of rows sent and written equal every plan's; every plan replayed on sets, "
          "its hit rate counted there" + ("; tc's count of the server's bytes covers its rows" if rate else ""))
    return 0


if __name__ == "__main__":
    run_script(main)

"""Which embedding rows a trainer fetches and evicts before each step: Bagpipe's lookahead oracle, LRU, and no cache.

The trainer holds a cache of at most ``capacity`` rows of tables stored elsewhere. Before step s runs, its
*round* s brings in the rows of step s that are not cached (the misses) and, to make room, evicts rows and writes
them back. A round is carried out ``ahead`` steps early, while step s - ahead computes, so it may not evict a row
that a step still running or about to run uses: the rows of steps s - ahead .. s are *pinned*. With ``ahead`` 0 a
round runs between two steps and only step s's rows are pinned::

    round:   s-1  s   s+1              ahead = 1: round s+1 fetches while step s computes
    step:         s-1  s   s+1

The policies differ only in which unpinned rows they evict:

- :class:`OracleCacher` sees the next ``lookahead`` batches (the data loader reads them ahead) and evicts the rows
  needed latest, those not needed inside the window first (Belady's rule within the window): a row needed inside the
  window goes only when every other candidate is needed sooner. With a window over the whole trace it makes the
  fewest misses of any policy.
- :class:`LRUCacher` evicts the rows used least recently.
- :class:`NoCache` keeps nothing: every round writes back all it holds and fetches the whole step (synchronous
  remote access); it runs with ``ahead`` 0.

Each policy is a pure function of the batches it is shown: every data-parallel trainer shown the same batches makes
the same rounds. Pure Python: the planner loads without torch.
"""

from __future__ import annotations

import abc
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipefold.errors import ConfigError

__all__ = ["POLICIES", "Cacher", "CacheStats", "LRUCacher", "NoCache", "OracleCacher", "Round", "make_cacher",
           "plan_rounds", "stats"]


@dataclass(frozen=True)
class Round:
    """What the trainer does before step ``step``: the rows it evicts (writing them back) and the rows it fetches."""

    step: int
    evict: tuple[int, ...]
    """Rows that leave the cache, sorted; their values go back to the server first."""
    fetch: tuple[int, ...]
    """Rows the step needs that are not cached, sorted."""
    hits: int
    """Rows the step needs that are cached already."""

    @property
    def hit_rate(self) -> float:
        """Hits over the rows the step needs."""
        return self.hits / max(1, self.hits + len(self.fetch))

    def bytes_fetched(self, row_bytes: int) -> int:
        """Bytes the round fetches, at ``row_bytes`` a row."""
        return len(self.fetch) * row_bytes


class Cacher(abc.ABC):
    """A policy's state: the rows cached now and the rows of the last ``ahead`` steps (pinned)."""

    name: str
    lookahead = 0
    """Batches after the step that the policy reads."""

    def __init__(self, capacity: int, *, ahead: int = 1) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"a cache holds 1 row or more (got {capacity!r})")
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ConfigError(f"a round runs 0 or more steps ahead (got {ahead!r})")
        self.capacity, self.ahead = capacity, ahead
        self.cached: set[int] = set()
        self._recent: deque[set[int]] = deque(maxlen=ahead or None)
        self._last_use: dict[int, int] = {}
        self._step = 0

    def plan(self, rows: Iterable[int], future: Sequence[Iterable[int]] = ()) -> Round:
        """The next step's round: ``rows`` are the keys the step needs, ``future`` the batches after it that the
        policy may look at (the oracle reads the first ``lookahead``)."""
        need = set(rows)
        pinned = need.union(*self._recent) if self.ahead else need
        if len(pinned) > self.capacity:
            raise ConfigError(f"a cache of {self.capacity} rows cannot hold the {len(pinned)} rows that steps "
                              f"{self._step - len(self._recent)}..{self._step} use together: give it more rows or "
                              "fewer samples per step")
        misses = need - self.cached
        over = len(self.cached) + len(misses) - self.capacity
        evict = self._victims(sorted(self.cached - pinned), over, future) if over > 0 else []
        self.cached.difference_update(evict)
        self.cached |= misses
        for key in need:
            self._last_use[key] = self._step
        if self.ahead:
            self._recent.append(need)
        made = Round(self._step, tuple(sorted(evict)), tuple(sorted(misses)), len(need) - len(misses))
        self._step += 1
        return made

    def recency(self, key: int) -> int:
        """The last step that used ``key`` (-1: none)."""
        return self._last_use.get(key, -1)

    @abc.abstractmethod
    def _victims(self, candidates: list[int], count: int, future: Sequence[Iterable[int]]) -> list[int]:
        """``count`` of the sorted ``candidates`` (cached, unpinned) to evict."""


class OracleCacher(Cacher):
    """Belady's rule within the next ``lookahead`` batches: evict the rows needed latest, the ones not needed in the
    window first; ties go to the least recently used row, then to the lower key."""

    name = "oracle"

    def __init__(self, capacity: int, *, lookahead: int, ahead: int = 1) -> None:
        super().__init__(capacity, ahead=ahead)
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ConfigError(f"the lookahead is 0 or more batches (got {lookahead!r})")
        self.lookahead = lookahead

    def _victims(self, candidates: list[int], count: int, future: Sequence[Iterable[int]]) -> list[int]:
        next_use: dict[int, float] = {}
        for distance, batch in enumerate(future[:self.lookahead], start=1):
            for key in batch:
                next_use.setdefault(key, distance)
        ranked = sorted(candidates, key=lambda k: (-next_use.get(k, math.inf), self.recency(k), k))
        return ranked[:count]


class LRUCacher(Cacher):
    """Evict the rows used least recently (ties: the lower key)."""

    name = "lru"

    def _victims(self, candidates: list[int], count: int, future: Sequence[Iterable[int]]) -> list[int]:
        return sorted(candidates, key=lambda k: (self.recency(k), k))[:count]


class NoCache(Cacher):
    """Synchronous remote access: each round writes back every row held and fetches every row of its step."""

    name = "none"

    def __init__(self, capacity: int, *, ahead: int = 0) -> None:
        if ahead:
            raise ConfigError(f"with no cache a step's rows are fetched when it starts: ahead is 0 (got {ahead!r})")
        super().__init__(capacity, ahead=0)

    def plan(self, rows: Iterable[int], future: Sequence[Iterable[int]] = ()) -> Round:
        need = set(rows)
        if len(need) > self.capacity:
            raise ConfigError(f"a trainer holding {self.capacity} rows cannot hold the {len(need)} rows of step "
                              f"{self._step}: give it more rows or fewer samples per step")
        made = Round(self._step, tuple(sorted(self.cached)), tuple(sorted(need)), 0)
        self.cached = need
        self._step += 1
        return made

    def _victims(self, candidates: list[int], count: int, future: Sequence[Iterable[int]]) -> list[int]:
        raise AssertionError("no cache plans its rounds itself")  # pragma: no cover


POLICIES = ("oracle", "lru", "none")
"""The policies by name, as :func:`make_cacher` and the command line take them."""


def make_cacher(policy: str, capacity: int, *, lookahead: int = 8, ahead: int = 1) -> Cacher:
    """A fresh cacher of ``policy`` (``ahead`` is 0 for ``none`` whatever is given)."""
    if policy == "oracle":
        return OracleCacher(capacity, lookahead=lookahead, ahead=ahead)
    if policy == "lru":
        return LRUCacher(capacity, ahead=ahead)
    if policy == "none":
        return NoCache(capacity)
    raise ConfigError(f"no cache policy {policy!r}: choose one of {', '.join(POLICIES)}")


def plan_rounds(cacher: Cacher, batches: Sequence[Iterable[int]]) -> list[Round]:
    """The rounds of every step of ``batches`` (each the keys its step needs), the policy shown its ``lookahead``
    batches after each step."""
    sets = [set(b) for b in batches]
    k = cacher.lookahead
    return [cacher.plan(sets[s], sets[s + 1:s + 1 + k]) for s in range(len(sets))]


@dataclass(frozen=True)
class CacheStats:
    """What a plan's rounds cost, in rows (times a row's bytes: the bytes each way)."""

    hits: int
    misses: int
    fetched: int
    """Rows fetched (the misses)."""
    written: int
    """Rows written back by the rounds (each evicted row was updated while cached), the final flush not counted."""

    @property
    def hit_rate(self) -> float:
        """Hits over the rows the steps needed."""
        return self.hits / max(1, self.hits + self.misses)


def stats(rounds: Sequence[Round]) -> CacheStats:
    """The total of ``rounds``."""
    hits = sum(r.hits for r in rounds)
    fetched = sum(len(r.fetch) for r in rounds)
    return CacheStats(hits=hits, misses=fetched, fetched=fetched, written=sum(len(r.evict) for r in rounds))

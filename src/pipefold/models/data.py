"""Byte-level text data: the Python standard library's own source as a corpus needing no download, and batches.

Batches are a pure function of (seed, step): every pipeline rank draws the same batch for the
same step without communicating, and a rerun sees the same data.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pipefold.errors import ConfigError
from pipefold.models._build import check_positive_int, generator

__all__ = ["DEFAULT_CAP", "Batches", "Corpus", "load_corpus", "stdlib_source"]

DEFAULT_CAP = 8 << 20
"""Bytes of standard-library source in the default corpus: plenty for small runs, quick to read."""

VAL_FRACTION = 0.1
"""The tail of the corpus held out for validation."""


@dataclass(frozen=True, eq=False)
class Corpus:
    """A byte corpus split into a training head and a validation tail (1-D uint8 tensors, ids 0..255)."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    """Where the bytes came from, for logs."""
    vocab_size: int = 256


def stdlib_source(cap: int = DEFAULT_CAP) -> bytes:
    """The standard library's ``*.py`` files, sorted by relative path and concatenated, cut at ``cap`` bytes."""
    check_positive_int("stdlib_source", "cap", cap)
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    size = 0
    for path in _sources(root):
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= cap:
            break
    if size == 0:
        raise ConfigError(f"no Python source found in the standard library at {root}: "
                          "pass a text file with --data FILE")
    return b"".join(chunks)[:cap]


def _sources(folder: Path) -> Iterator[Path]:
    """The ``*.py`` files under ``folder`` in the order of their relative paths, found lazily (the walk stops where
    the reader does). A folder's entries sorted by name, with a ``/`` after a folder's, visit the files in exactly
    the sorted order of their whole paths. Third-party packages installed next to the standard library differ
    between machines; they are left out."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in sorted(entries, key=lambda e: e.name + "/" if e.is_dir(follow_symlinks=False) else e.name):
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in ("site-packages", "dist-packages"):
                yield from _sources(Path(entry.path))
        elif entry.name.endswith(".py") and entry.is_file():
            yield Path(entry.path)


def _split(data: bytes, source: str) -> Corpus:
    """First 90% for training, last 10% for validation: disjoint, and the same every time."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (N,); owns its copy of the bytes
    n_train = int(len(tokens) * (1 - VAL_FRACTION))
    return Corpus(train=tokens[:n_train], val=tokens[n_train:], source=source)


@functools.lru_cache(maxsize=2)
def _stdlib_corpus(cap: int) -> Corpus:
    """The default corpus, read once per process (a model made again reuses it)."""
    return _split(stdlib_source(cap), f"Python standard library source ({sysconfig.get_paths()['stdlib']})")


def load_corpus(path: str | None = None, *, cap: int = DEFAULT_CAP) -> Corpus:
    """The bytes of the text file at ``path`` (read whole), or by default the standard library's source up to ``cap``.

    ``cap`` applies only to the default corpus: a file the user names is used whole.
    """
    if path is None:
        return _stdlib_corpus(cap)
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read --data file {path!r}: {err.strerror or err}") from None
    if not data:
        raise ConfigError(f"--data file {path!r} is empty: give a text file with some content")
    return _split(data, path)


class Batches:
    """Random (inputs, targets) windows of a token stream, reproducible from (seed, step).

    ``batch_at(step)`` returns two (B, T) int64 tensors; the targets are the inputs shifted one
    token to the left, i.e. each position's next token. Iterating yields steps 0, 1, 2, ...
    """

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int, *, seed: int = 0) -> None:
        check_positive_int("Batches", "batch", batch)
        check_positive_int("Batches", "seq", seq)
        if tokens.dim() != 1:
            raise ConfigError(f"Batches takes a 1-D token tensor (got shape {tuple(tokens.shape)}): pass corpus.train")
        if len(tokens) < seq + 1:
            raise ConfigError(f"corpus of {len(tokens)} tokens is too short for sequences of {seq}: "
                              f"it needs at least seq + 1 = {seq + 1} tokens; use a shorter --seq or a longer file")
        self.tokens = tokens
        self.batch = batch
        self.seq = seq
        self.seed = seed

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of training step ``step``: inputs and targets, each (B, T) int64."""
        gen = generator("batches", self.seed, step)  # a fresh stream per step: no state carried between calls
        starts = torch.randint(0, len(self.tokens) - self.seq, (self.batch,), generator=gen)  # (B,)
        window = starts[:, None] + torch.arange(self.seq + 1)  # (B, T+1) positions
        chunk = self.tokens[window].long()  # (B, T+1)
        return chunk[:, :-1], chunk[:, 1:]  # (B, T), (B, T)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            yield self.batch_at(step)
            step += 1

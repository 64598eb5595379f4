"""Checkpoints of a pipeline run with ``torch.distributed.checkpoint`` (DCP): save, find the newest good one, load.

A checkpoint folder ``D`` holds::

    D/step-00000004/        the state after 4 steps (one checkpoint)
        __0_0.distcp ...    each rank's tensors and objects, as DCP writes them
        .metadata           DCP's index of them
        manifest.json       written last: the step, the run's identity, every file's size and SHA-256
    D/latest                the name of the newest checkpoint, e.g. ``step-00000004``
    D/step-00000006.tmp/    a save in progress, or one a crash interrupted: never read

Every rank saves its own stages' state under global names, so a checkpoint does not depend on how the
layers were split or on how many ranks saved it:

- ``model.<layer>.<name>``: parameters and buffers, named as the plain model ``nn.Sequential(*layers)``
  names them (a stage held by several ranks is written once);
- ``optim.<layer>.<name>.<key>``: the optimizer's state of that parameter (AdamW's moments and step count,
  SGD's momentum);
- ``progress.step``: the steps done, which is also the position in the data (step t trains on batch t);
  ``progress.schedule_index``: the schedule an adaptive job had switched to;
- ``rank<r>.torch``, ``rank<r>.cuda``, ``rank<r>.python``: rank r's random number generators.

A save writes into ``step-N.tmp``; only when every rank has written its part (a barrier) does rank 0 write
the manifest, rename the folder to ``step-N`` and point ``latest`` at it (a temporary file, then a rename).
A crash at any moment so leaves the last good checkpoint as it was. No rank goes on before the commit is
done (a second barrier): a rank that failed in the next step would otherwise have its launcher stop rank 0
in the middle of committing, and the restart would lose a checkpoint whose files were all written.
:func:`find` checks a checkpoint's files against its manifest before using it and skips, with a warning naming
it, one that fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipefold.errors import ConfigError, say
from pipefold.files import write_text
from pipefold.runtime.zero import AnyOptimizer, holding

__all__ = ["FORMAT", "Checkpointing", "Resume", "find", "load", "problem", "save", "step_name"]

FORMAT = "pipefold-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    """The folder name of the checkpoint after ``step`` steps."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class Resume:
    """A good checkpoint to start from: its folder and the steps it had done."""

    path: str
    step: int
    identity: dict[str, Any] = field(default_factory=dict)
    """What the run that saved it was (model, sizes, optimizer), from its manifest."""


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Where and how often a job saves checkpoints, and the one it starts from: made by
    :mod:`pipefold.train.prepare` from a run spec, whose :class:`~pipefold.train.spec.CheckpointSpec` checked the
    settings."""

    directory: str | None = None
    """The checkpoint folder (an absolute path); None: save nothing."""
    every: int | None = None
    """Save after every ``every`` steps; the last step is always saved. None: only the last."""
    resume: Resume | None = None
    """Start from this checkpoint (its step, weights, optimizer state and random state)."""
    identity: dict[str, Any] = field(default_factory=dict)
    """What must match to resume (the model's sizes, the optimizer): written into every manifest."""
    keep_last: int | None = None
    """After each save, remove all but the newest ``keep_last`` checkpoints of the folder. None: keep them all."""

    def due(self, done: int, steps: int) -> bool:
        """Whether to save after ``done`` steps of a run of ``steps``."""
        return self.directory is not None and (done == steps or (self.every is not None and done % self.every == 0))


def warn(message: str) -> None:
    """One warning line on stderr."""
    say(f"pipefold: warning: {message}")


def note(message: str) -> None:
    """One line on stderr saying what the run does (resuming, saving)."""
    say(f"pipefold: {message}")


# -- the launcher's side: finding a good checkpoint


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (raises OSError or ValueError when it cannot be read)."""
    with open(Path(path) / MANIFEST, encoding="utf-8") as fh:
        manifest = json.load(fh)
    if not isinstance(manifest, dict):
        raise ValueError("the manifest is not a JSON object")
    return manifest


def problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the checkpoint at ``path`` (a missing or unreadable manifest, a missing, truncated or
    changed file), or None when every file is as its manifest says."""
    folder = Path(path)
    if not folder.is_dir():
        return "not a folder"
    try:
        manifest = read_manifest(folder)
    except FileNotFoundError:
        return "no manifest.json: the save did not finish"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest.json ({exc})"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')!r}, not {FORMAT}"
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files or not isinstance(manifest.get("step"), int):
        return "the manifest lists no DCP metadata or no step"
    for name, info in sorted(files.items()):
        file = folder / name
        try:
            size = file.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != info.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {info.get('bytes')}"
        if _sha256(file) != info.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest"
    return None


def _steps_in(root: Path) -> list[tuple[int, Path]]:
    """The checkpoints in ``root`` (folders named step-N, not .tmp ones), newest first."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    found = [(int(m.group(1)), p) for p in entries if (m := _STEP.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def _latest(root: Path) -> Path | None:
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return root / name if _STEP.match(name) else None


def find(where: str, *, required: bool = True, warn_skipped: Callable[[str], None] = warn) -> Resume | None:
    """The checkpoint to resume from.

    ``where`` is a checkpoint folder (``D/step-00000004``): that one, or if it is incomplete or corrupt the
    newest good one before it; or a folder of checkpoints (``D``): the one ``D/latest`` names, or if that is
    not good the newest good one. Each checkpoint skipped is reported through ``warn_skipped`` (only when a
    good one is found). With none good: a :class:`ConfigError` in one line when ``required``, else None.
    """
    path = Path(where)
    named = _STEP.match(path.name)
    if named:
        if not path.is_dir():
            raise ConfigError(f"no checkpoint {where}: give one of the step-N folders of a --checkpoint-dir")
        root = path.parent
        candidates = [path] + [p for n, p in _steps_in(root) if n < int(named.group(1))]
    else:
        root = path
        if not root.is_dir():
            if required:
                raise ConfigError(f"no checkpoint folder {where}: give the --checkpoint-dir of an earlier run, or "
                                  "drop --resume to start from the beginning")
            return None
        latest = _latest(root)
        candidates = ([latest] if latest is not None and latest.is_dir() else []) + \
            [p for _, p in _steps_in(root) if p != latest]
    skipped: list[tuple[Path, str]] = []
    for candidate in candidates:
        reason = problem(candidate)
        if reason is None:
            manifest = read_manifest(candidate)
            for bad, why in skipped:
                warn_skipped(f"checkpoint {bad} is incomplete or corrupt ({why}): skipped")
            return Resume(str(candidate), int(manifest["step"]), dict(manifest.get("identity") or {}))
        skipped.append((candidate, reason))
    if not required:
        return None
    if not skipped:
        raise ConfigError(f"no checkpoint to resume from in {root}: drop --resume to start from the beginning")
    bad, why = skipped[0]
    older = " and no older one is good" if len(skipped) > 1 else " and there is no older one"
    raise ConfigError(f"cannot resume: checkpoint {bad} is incomplete or corrupt ({why}){older}; drop --resume to "
                      "start from the beginning")


def check_identity(resume: Resume, identity: dict[str, Any], steps: int) -> None:
    """Refuse, in one line, to resume a checkpoint of another model or optimizer, or one with no steps left."""
    for key, value in identity.items():
        saved = resume.identity.get(key, value)
        if saved != value:
            raise ConfigError(f"checkpoint {resume.path} was saved with {key} {saved}, this run has {value}: resume "
                              f"with the same model and optimizer, or use a new --checkpoint-dir")
    if resume.step >= steps:
        raise ConfigError(f"checkpoint {resume.path} has done {resume.step} steps and the run has {steps}: "
                          f"nothing left to train; give --steps above {resume.step}")


def prepare(directory: str) -> str:
    """Make the checkpoint folder if needed; its absolute path (a ConfigError when it cannot be a folder).

    The rule of every output (:func:`pipefold.files.check_writable`): the folder it goes into must exist. So
    the checkpoint folder itself is made, but not a missing parent (a mistyped path makes no tree)."""
    path = os.path.abspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"the checkpoint folder {directory} is a file; give a folder")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ConfigError(f"cannot make the checkpoint folder {directory}: folder {parent} does not exist")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot make the checkpoint folder {directory}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"cannot write checkpoints into {directory}: the folder is not writable")
    return path


# -- the ranks' side: saving and loading


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in the order its state_dict numbers them."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generators: torch's (CPU and the device's on CUDA) and Python's."""
    cuda = bytes(torch.cuda.get_rng_state(device).tolist()) if device.type == "cuda" else None
    return {"torch": bytes(torch.get_rng_state().tolist()), "cuda": cuda, "python": random.getstate()}


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(torch.tensor(list(state["torch"]), dtype=torch.uint8))
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(torch.tensor(list(state["cuda"]), dtype=torch.uint8), device)
    random.setstate(state["python"])


def save(checkpointing: Checkpointing, step: int, *, model: dict[str, torch.Tensor],
         optimizers: Sequence[AnyOptimizer], names: dict[int, str], progress: dict[str, Any], rank: int,
         device: torch.device, written: Callable[[], None] | None = None,
         committing: Callable[[], None] | None = None) -> str:
    """Every rank's part of the checkpoint after ``step`` steps (call on every rank of the default group).

    ``model``: this rank's parameters and buffers by global name; ``names``: the global name of each of its
    optimizers' parameters, by ``id``; ``progress``: what every rank agrees on. ``written`` is called once this
    rank's files are written, before the checkpoint is committed, and ``committing`` on rank 0 just before it
    commits (test hooks). Returns the checkpoint's path.
    """
    assert checkpointing.directory is not None
    import torch.distributed.checkpoint as dcp

    root = Path(checkpointing.directory)
    final = root / step_name(step)
    tmp = root / f"{final.name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted save of this step left
        tmp.mkdir(parents=True)
    dist.barrier()
    state: dict[str, Any] = {f"model.{name}": t.detach() for name, t in model.items()}
    for opt in holding(optimizers):
        for p in _params(opt):
            for key, value in opt.state.get(p, {}).items():
                state[f"optim.{names[id(p)]}.{key}"] = value
    state["progress"] = dict(progress)
    state[f"rank{rank}"] = rng_state(device)
    dcp.save(state, checkpoint_id=str(tmp))
    if written is not None:
        written()
    dist.barrier()  # every rank's files are written: the checkpoint is complete
    if rank == 0:
        if committing is not None:
            committing()
        _commit(tmp, final, step, checkpointing.identity, dist.get_world_size())
        if checkpointing.keep_last is not None:
            prune(root, checkpointing.keep_last)
    dist.barrier()  # committed: whatever a rank does next cannot lose it
    return str(final)


def prune(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` checkpoints in ``root`` (by step; ``latest``'s is always kept); return
    those removed."""
    steps = [p for _, p in sorted(_steps_in(root), key=lambda item: item[0])]
    latest = _latest(root)
    removed = [p for p in steps[:-keep] if p != latest]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path, step: int, identity: dict[str, Any], world: int) -> None:
    """The manifest (last, listing every file), then the rename, then ``latest``; the debris of old saves removed."""
    files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(tmp.iterdir()) if f.is_file()}
    manifest = {"format": FORMAT, "step": step, "identity": identity, "world_size": world,
                "saved_at": time.time(), "files": files}
    write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    root = final.parent
    old = root / f"{final.name}.old"
    if final.exists():  # the same step saved by an earlier run that resumed from before it
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    write_text(root / LATEST, final.name + "\n")
    _fsync_dir(root)
    for p in root.iterdir():  # interrupted saves and replaced checkpoints
        if p.is_dir() and p.suffix in (".tmp", ".old") and _STEP.match(p.stem):
            shutil.rmtree(p, ignore_errors=True)


def _template(meta: Any, p: torch.Tensor) -> torch.Tensor | None:
    """Where DCP loads a saved optimizer value: shaped like its parameter, split like it too where the parameter is
    a DTensor (a tensor-parallel or FSDP shard: DCP reads this rank's part, whatever split saved it); else whole."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(meta, TensorStorageMetadata):
        return None
    if hasattr(p, "placements") and tuple(meta.size) == tuple(p.shape):
        return torch.zeros_like(p.detach(), dtype=meta.properties.dtype)
    return torch.empty(tuple(meta.size), dtype=meta.properties.dtype)


def load(resume: Resume, *, model: dict[str, torch.Tensor], optimizers: Sequence[AnyOptimizer],
         names: dict[int, str], rank: int, device: torch.device) -> dict[str, Any]:
    """Load this rank's part of ``resume`` in place (call on every rank): the parameters and buffers in ``model``,
    the state of ``optimizers`` (whose parameters ``names`` names by ``id``), this rank's random state.
    Returns the progress (``step``, ``schedule_index``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(resume.path).read_metadata().state_dict_metadata
    state: dict[str, Any] = {}
    for name, t in model.items():
        meta = saved.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise ConfigError(f"checkpoint {resume.path} has no {name}: it was saved from another model")
        if tuple(meta.size) != tuple(t.shape):
            raise ConfigError(f"checkpoint {resume.path} has {name} of shape {tuple(meta.size)}, this model "
                              f"{tuple(t.shape)}: resume with the same model")
        state[f"model.{name}"] = t.detach()
    wanted: dict[str, Any] = {}
    for opt in holding(optimizers):
        for p in _params(opt):
            prefix = f"optim.{names[id(p)]}."
            for key, meta in saved.items():
                if key.startswith(prefix):
                    wanted[key] = _template(meta, p)
    state.update(wanted)
    state["progress"] = {key.split(".", 1)[1]: None for key in saved if key.startswith("progress.")}
    mine = f"rank{rank}"
    rng = {key.split(".", 1)[1]: None for key in saved if key.startswith(mine + ".")}
    if rng:
        state[mine] = rng
    dcp.load(state, checkpoint_id=resume.path)
    for opt in holding(optimizers):
        params = _params(opt)
        per_param = {}
        for i, p in enumerate(params):
            prefix = f"optim.{names[id(p)]}."
            entry = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
            if entry:
                per_param[i] = entry
        # torch's own loading puts each value where the parameter is, in its dtype (a step count stays as saved).
        opt.load_state_dict({"state": per_param, "param_groups": opt.state_dict()["param_groups"]})
    if rng:
        set_rng_state(state[mine], device)
    return dict(state["progress"])

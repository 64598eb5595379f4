"""Checkpoints of a pipeline run with ``torch.distributed.checkpoint`` (DCP): save, find the newest good one, load.

A checkpoint folder ``D`` holds::

    D/step-00000004/        the state after 4 steps (one checkpoint)
        __0_0.distcp ...    each rank's tensors and objects, as DCP writes them
        .metadata           DCP's index of them
        manifest.json       written last: the step, the run's identity, every file's size and SHA-256
    D/latest                the name of the newest checkpoint, e.g. ``step-00000004``
    D/step-00000006.tmp/    a save in progress, or one a crash interrupted: never read
    D/step-00000006.damaged/   a checkpoint that was not good, set aside when a later run saved its step again

Every rank saves its own stages' state under global names, so a checkpoint does not depend on how the
layers were split or on how many ranks saved it:

- ``model.<layer>.<name>``: parameters and buffers, named as the plain model ``nn.Sequential(*layers)``
  names them (a stage held by several ranks is written once);
- ``optim.<layer>.<name>.<key>``: the optimizer's state of that parameter (AdamW's moments and step count,
  SGD's momentum);
- ``progress.step``: the steps done, which is also the position in the data (step t trains on batch t);
  ``progress.schedule_index``: the schedule an adaptive job had switched to;
- ``rank<r>.torch``, ``rank<r>.cuda``, ``rank<r>.python``: rank r's random number generators;
- ``part<r>.step``: the step rank r saved its part at (in rank r's own file);
- ``run.identity``: what the run was (the manifest's ``identity``, as JSON).

A save writes into ``step-N.tmp``; only when every rank has written its part (a barrier) does rank 0 write
the manifest, rename the folder to ``step-N`` and point ``latest`` at it (a temporary file, then a rename).
A crash at any moment so leaves the last good checkpoint as it was. No rank goes on before the commit is
done (a second barrier): a rank that failed in the next step would otherwise have its launcher stop rank 0
in the middle of committing, and the restart would lose a checkpoint whose files were all written.

A checkpoint is good (:func:`problem`) when its files are those its manifest lists (sizes and SHA-256s) and
every fact the manifest states that the saved state holds too agrees with it: the step (the folder's name,
``progress.step``, each rank's ``part<r>.step``), the ranks that saved it (``rank<r>.*``), the run's identity
(``run.identity``), and the files DCP's index reads from. :func:`find` skips, with a warning naming it and
what is wrong, one that is not good, and refuses one named explicitly; nothing is deleted.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipefold.errors import ConfigError, say
from pipefold.files import write_text
from pipefold.runtime.watch import Activity
from pipefold.runtime.zero import AnyOptimizer, holding

__all__ = ["FORMAT", "Checkpointing", "Resume", "find", "load", "problem", "save", "step_name"]

FORMAT = "pipefold-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)$")
_RANK = re.compile(r"^rank(\d+)\.")


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
        if not isinstance(info, dict):
            return f"the manifest gives no size and SHA-256 of {name}"
        file = folder / name
        try:
            size = file.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != info.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {info.get('bytes')}"
        if _sha256(file) != info.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest"
    return disagreement(folder, manifest)


def disagreement(path: str | os.PathLike[str], manifest: dict[str, Any]) -> str | None:
    """What the checkpoint at ``path`` saved that contradicts ``manifest`` (its files already checked against it),
    or None when they agree: the files DCP's index reads from, the ranks that saved it, the step (the folder's
    name, ``progress.step``, each rank's part), the run's identity. A fact an older checkpoint did not save is not
    checked."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(path)
    step, files, world = manifest["step"], manifest["files"], manifest.get("world_size")
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 (whatever DCP raises on a file that is not its index)
        return f"unreadable .metadata ({_first_line(exc)})"
    where: dict[str, str] = {}  # the file of each saved item
    ends: dict[str, int] = {}  # how far into each file the index reads
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str):
            where[index.fqn] = name
            ends[name] = max(ends.get(name, 0), getattr(info, "offset", 0) + getattr(info, "length", 0))
    for name, end in sorted(ends.items()):
        if name not in files:
            return f"DCP's index reads {name}, which the manifest does not list"
        if end > files[name].get("bytes", 0):
            return f"DCP's index reads {name} up to byte {end}, it has {files[name].get('bytes')}"
    keys = set(metadata.state_dict_metadata)
    ranks = sorted({int(m.group(1)) for key in keys if (m := _RANK.match(key))})
    if not isinstance(world, int) or ranks != list(range(world)):
        held = f"the parts of ranks {', '.join(map(str, ranks))}" if ranks else "no rank's part"
        return f"the manifest says {world} ranks saved it, the saved state has {held}"
    if "progress.step" not in keys:
        return "the saved state has no step"
    parts = [f"part{r}.step" for r in ranks if f"part{r}.step" in keys]
    try:
        saved = read_objects(folder, ["progress.step", *parts, *(["run.identity"] if "run.identity" in keys else [])])
    except Exception as exc:  # noqa: BLE001 (a part whose bytes are not what the index says)
        return f"unreadable saved state ({_first_line(exc)})"
    if saved["progress.step"] != step:
        return f"the manifest says step {step}, the saved state step {saved['progress.step']}"
    for key in parts:
        if saved[key] != step:
            return f"{where.get(key)} is a part of step {saved[key]}, the manifest says step {step}"
    named = _STEP.match(folder.name)
    if named and int(named.group(1)) != step:
        return f"the folder is named for step {int(named.group(1))}, its manifest and saved state say step {step}"
    if "run.identity" in saved:
        identity, stated = json.loads(saved["run.identity"]), manifest.get("identity")
        if not isinstance(stated, dict):
            return "the manifest states no identity (model, sizes, optimizer)"
        for key in sorted(set(identity) | set(stated)):
            if identity.get(key) != stated.get(key):
                return f"the manifest says {key} {stated.get(key)}, the saved state {identity.get(key)}"
    return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def read_objects(path: str | os.PathLike[str], keys: Iterable[str]) -> dict[str, Any]:
    """The saved objects (not tensors) ``keys`` (``progress.step``) of the checkpoint at ``path``, read in this
    process alone, whether or not it is in a process group."""
    import torch.distributed.checkpoint as dcp

    nested: dict[str, dict[str, Any]] = {}
    for key in keys:
        head, _, tail = key.partition(".")
        nested.setdefault(head, {})[tail] = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it loads in one process: what is asked
        if "no_dist" in inspect.signature(dcp.load).parameters:
            dcp.load(nested, checkpoint_id=str(path), no_dist=True)
        else:  # torch < 2.5 has it only on the function below
            from torch.distributed.checkpoint import FileSystemReader
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

            _load_state_dict(nested, FileSystemReader(str(path)), no_dist=True)
    return {f"{head}.{tail}": value for head, part in nested.items() for tail, value in part.items()}


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
    """The checkpoint to resume from (see :func:`problem` for what makes one good).

    ``where`` is a checkpoint folder (``D/step-00000004``): that one, refused in one line (a :class:`ConfigError`)
    if it is not good; or a folder of checkpoints (``D``): the one ``D/latest`` names, or if that is not good the
    newest good one. Each checkpoint skipped is reported through ``warn_skipped`` (only when a good one is
    found) and left as it is. With none good: a :class:`ConfigError` in one line when ``required``, else None.
    """
    path = Path(where)
    named = _STEP.match(path.name)
    if named:
        if not path.is_dir():
            raise ConfigError(f"no checkpoint {where}: give one of the step-N folders of a --checkpoint-dir")
        reason = problem(path)
        if reason is not None:
            raise ConfigError(f"cannot resume from checkpoint {where}: it is incomplete or corrupt ({reason}); give "
                              f"another checkpoint, or its folder {path.parent} for the newest good one")
        return _resume(path)
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
            for bad, why in skipped:
                warn_skipped(f"checkpoint {bad} is incomplete or corrupt ({why}): skipped")
            return _resume(candidate)
        skipped.append((candidate, reason))
    if not required:
        return None
    if not skipped:
        raise ConfigError(f"no checkpoint to resume from in {root}: drop --resume to start from the beginning")
    bad, why = skipped[0]
    older = " and no older one is good" if len(skipped) > 1 else " and there is no older one"
    raise ConfigError(f"cannot resume: checkpoint {bad} is incomplete or corrupt ({why}){older}; drop --resume to "
                      "start from the beginning")


def _resume(path: Path) -> Resume:
    """The :class:`Resume` of the good checkpoint at ``path``."""
    manifest = read_manifest(path)
    return Resume(str(path), int(manifest["step"]), dict(manifest.get("identity") or {}))


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
         device: torch.device, activity: Activity | None = None, written: Callable[[], None] | None = None,
         committing: Callable[[], None] | None = None) -> str:
    """Every rank's part of the checkpoint after ``step`` steps (call on every rank of the default group).

    ``model``: this rank's parameters and buffers by global name; ``names``: the global name of each of its
    optimizers' parameters, by ``id``; ``progress``: what every rank agrees on. ``activity`` is told the phase,
    and publishes it at once (:meth:`~pipefold.runtime.watch.Activity.publish`): ``the save of checkpoint
    step-N``, then ``the commit of checkpoint step-N``, so that a rank that dies in it is reported as dying there.
    ``written`` is called once this rank's files are written, before the checkpoint is committed, and
    ``committing`` on rank 0 just before it commits (test hooks). Returns the checkpoint's path.
    """
    assert checkpointing.directory is not None
    import torch.distributed.checkpoint as dcp

    root = Path(checkpointing.directory)
    final = root / step_name(step)
    tmp = root / f"{final.name}.tmp"
    world = dist.get_world_size()
    others = tuple(r for r in range(world) if r != rank)
    saving, commit = f"the save of checkpoint {final.name}", f"the commit of checkpoint {final.name}"
    activity = activity if activity is not None else Activity(rank)
    activity.run(saving, action=False)
    activity.publish()  # now: a rank killed in the save is reported in it, whenever its heartbeat last ran
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted save of this step left
        tmp.mkdir(parents=True)
    activity.wait(saving, "every rank's start of it", others, action=False)
    dist.barrier()
    activity.run(saving, action=False)
    state: dict[str, Any] = {f"model.{name}": t.detach() for name, t in model.items()}
    for opt in holding(optimizers):
        for p in _params(opt):
            for key, value in opt.state.get(p, {}).items():
                state[f"optim.{names[id(p)]}.{key}"] = value
    state["progress"] = dict(progress)
    state[f"rank{rank}"] = rng_state(device)
    state[f"part{rank}"] = {"step": step}
    state["run"] = {"identity": json.dumps(checkpointing.identity, sort_keys=True)}
    dcp.save(state, checkpoint_id=str(tmp))
    if written is not None:
        written()
    activity.wait(saving, "every rank's files", others, action=False)
    dist.barrier()  # every rank's files are written: the checkpoint is complete
    if rank == 0:
        activity.run(commit, action=False)
        activity.publish()
        if committing is not None:
            committing()
        _commit(tmp, final, step, checkpointing.identity, world)
        if checkpointing.keep_last is not None:
            prune(root, checkpointing.keep_last)
    activity.wait(commit, "rank 0's commit" if rank else "every rank", (0,) if rank else others, action=False)
    activity.publish()
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
    """The manifest (last, listing every file), then the rename, then ``latest``; the debris of old saves removed.
    A checkpoint of the same step already there is replaced: removed when good, kept as ``step-N.damaged`` when not
    (with a warning)."""
    files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(tmp.iterdir()) if f.is_file()}
    manifest = {"format": FORMAT, "step": step, "identity": identity, "world_size": world,
                "saved_at": time.time(), "files": files}
    write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    root = final.parent
    old = root / f"{final.name}.old"
    if final.exists():  # the same step saved by an earlier run that resumed from before it
        reason = problem(final)
        if reason is None:
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        else:  # one that resuming skipped: the user's to look at, never removed
            aside = _free(root / f"{final.name}.damaged")
            os.rename(final, aside)
            warn(f"checkpoint {final} is incomplete or corrupt ({reason}): kept as {aside.name}, and replaced")
    os.rename(tmp, final)
    write_text(root / LATEST, final.name + "\n")
    _fsync_dir(root)
    for p in root.iterdir():  # interrupted saves and replaced checkpoints
        if p.is_dir() and p.suffix in (".tmp", ".old") and _STEP.match(p.stem):
            shutil.rmtree(p, ignore_errors=True)


def _free(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... the first that does not exist."""
    n, free = 1, path
    while free.exists():
        n += 1
        free = path.with_name(f"{path.name}-{n}")
    return free


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
         names: dict[int, str], rank: int, device: torch.device, activity: Activity | None = None) -> dict[str, Any]:
    """Load this rank's part of ``resume`` in place (call on every rank): the parameters and buffers in ``model``,
    the state of ``optimizers`` (whose parameters ``names`` names by ``id``), this rank's random state.
    ``activity`` is told the phase (``the load of checkpoint step-N``), for the job's watch. Returns the progress
    (``step``, ``schedule_index``); a ConfigError when its step is not ``resume.step`` (a :class:`Resume` made by
    hand, or a checkpoint changed since :func:`find` checked it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if activity is not None:
        activity.run(f"the load of checkpoint {Path(resume.path).name}", action=False)
        activity.publish()
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
    progress = dict(state["progress"])
    if progress.get("step") != resume.step:
        raise ConfigError(f"checkpoint {resume.path} has done {progress.get('step')} steps, not the {resume.step} "
                          "it was taken for: resume from it with pipefold.runtime.launch.checkpoint.find, which "
                          "checks it")
    return progress

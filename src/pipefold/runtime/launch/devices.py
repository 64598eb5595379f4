"""Where ranks compute and how their tensors cross: the CPU over gloo, a GPU each over NCCL, or one GPU shared.

    device  backend  ranks vs GPUs     what happens
    cpu     gloo     -                 every rank on the CPU; sends and receives are gloo's, tensor to tensor
    cuda    nccl     ranks <= GPUs     rank r on GPU r % GPUs (of its node); NCCL sends GPU tensors directly,
                                       on NCCL's own streams
    cuda    gloo     any               ranks may share a GPU (NCCL refuses two ranks on one device); a tensor
                                       sent is copied into pinned host memory on the rank's communication
                                       stream, crosses by gloo, and is copied back onto the receiver's GPU on
                                       its communication stream (:mod:`pipefold.runtime.comm`)

``auto`` picks: the CUDA device when torch sees a GPU, else the CPU; NCCL when there is a GPU for every
rank of the node, else gloo. An explicit choice that cannot work here (``cuda`` without a GPU, ``nccl`` with
more ranks than GPUs or on the CPU) is a :class:`~pipefold.errors.ConfigError` naming what would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefold.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Placement:
    """The compute device type of every rank and the process group's backend."""

    device: str
    """"cpu" or "cuda"."""
    backend: str
    """"gloo" or "nccl"."""
    gpus: int = 0
    """GPUs torch sees on this node (with ``device`` "cuda")."""

    @property
    def staged(self) -> bool:
        """GPU tensors sent over gloo: staged through pinned host memory."""
        return self.device == "cuda" and self.backend == "gloo"

    def device_of(self, local_rank: int) -> torch.device:
        """The compute device of the rank with this rank on its node."""
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", local_rank % max(1, self.gpus))


def cuda_gpus() -> int:
    """GPUs torch sees (0 without a CUDA build or a driver); does not create a CUDA context."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except (RuntimeError, AssertionError):
        return 0


def place(device: str = "auto", backend: str = "auto", *, ranks: int = 1, gpus: int | None = None) -> Placement:
    """Resolve ``device`` and ``backend`` for ``ranks`` ranks on this node; ``gpus`` defaults to what torch sees."""
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}: use {', '.join(DEVICES)}")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}: use {', '.join(BACKENDS)}")
    if device == "cpu":
        gpus = 0
    elif gpus is None:
        gpus = cuda_gpus()
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cuda" and not gpus:
        raise ConfigError("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False); use "
                          "--device cpu, or a CUDA build of torch on a machine with a GPU")
    if device == "cpu":
        if backend == "nccl":
            raise ConfigError("NCCL moves GPU tensors only: use --backend gloo (or auto) with --device cpu")
        return Placement("cpu", "gloo", 0)
    if backend == "nccl" and ranks > gpus:
        raise ConfigError(f"NCCL needs a GPU per rank, and this node has {ranks} ranks on {gpus} GPU"
                          f"{'s' if gpus > 1 else ''}: use --backend gloo (ranks share the GPUs, tensors staged "
                          f"through host memory) or at most {gpus} rank{'s' if gpus > 1 else ''} per node")
    if backend == "auto":
        backend = "nccl" if ranks <= gpus else "gloo"
    return Placement("cuda", backend, gpus)


def check_sharding(placement: Placement, *, fsdp: bool) -> None:
    """FSDP's collectives (all-gather and reduce-scatter of GPU tensors) do not run over gloo: a rank doing them
    on a shared GPU died of a segmentation fault (H200, torch 2.11). All-reduce, which plain data parallelism and
    ZeRO-1 use, does."""
    if fsdp and placement.staged:
        raise ConfigError("--fsdp on GPUs needs NCCL and a GPU per rank: these ranks share GPUs over gloo, which "
                          "cannot all-gather or reduce-scatter GPU tensors; use --zero1 or plain --dp here, or "
                          "--device cpu")

"""What travels between stages: a tensor, a tuple, or a dict of tensors, with non-tensor values along.

Between ranks only tensors move (:mod:`pipefold.runtime.comm`). A stage's output is flattened with torch's
pytree into its tensors and a :class:`Spec`, the rest: the structure (tuple, dict, nested, a Hugging Face
``ModelOutput``) and the values that are not tensors (``None``, flags, sizes), which pass along unchanged. The
next stage gets the output back whole and is called with it, by one rule:

    a tuple      spread as positional arguments        stage(*out)
    a dict       spread as keyword arguments           stage(**out)
    else         one argument                          stage(out)

The first stage is called with the batch's arguments as given to the step (``step(ids, mask=m)`` ->
``stage(ids_mb, mask=m_mb)``), each tensor cut into microbatches along dimension 0. The spec of a boundary
is sent with the shapes' header (:func:`encode_spec`), so the receiving rank rebuilds what the sending stage
returned. A plain tensor or tuple of tensors needs no spec (``None``): what the runtime always passed.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipefold.errors import ConfigError

__all__ = ["Call", "Spec", "decode_spec", "encode_spec", "flatten", "split_call", "unflatten"]

SPEC_BYTES = 4096
"""The most bytes a boundary's spec may pickle to: it travels in the fixed-size header."""


@dataclass(frozen=True)
class Call:
    """Arguments a stage is called with."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None

    def __call__(self, fn: Any) -> Any:
        return fn(*self.args, **(self.kwargs or {}))


@dataclass(frozen=True)
class Spec:
    """A flattened value's structure and its non-tensor leaves; ``call`` says whether it is a (args, kwargs)
    pair (the batch given to the first stage) rather than one stage's output."""

    tree: Any
    consts: tuple[tuple[int, Any], ...]
    """(leaf position, value) of every leaf that is not a tensor."""
    call: bool = False

    @property
    def tensors(self) -> int:
        return self.tree.num_leaves - len(self.consts)


def _plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        type(value) is tuple and all(isinstance(v, torch.Tensor) for v in value))


def flatten(value: Any, *, call: bool = False) -> tuple[tuple[torch.Tensor, ...], Spec | None]:
    """``value``'s tensors, in order, and its spec (None for a tensor or a tuple of tensors)."""
    if not call and _plain(value):
        return ((value,) if isinstance(value, torch.Tensor) else value), None
    leaves, tree = pytree.tree_flatten(value)
    tensors = tuple(v for v in leaves if isinstance(v, torch.Tensor))
    consts = tuple((i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor))
    return tensors, Spec(tree, consts, call)


def unflatten(spec: Spec | None, tensors: Sequence[torch.Tensor]) -> Any:
    """The value :func:`flatten` took apart (for None: the tensors as a tuple)."""
    if spec is None:
        return tuple(tensors)
    if len(tensors) != spec.tensors:
        raise ValueError(f"expected {spec.tensors} tensors for this structure, got {len(tensors)}")
    consts = dict(spec.consts)
    it = iter(tensors)
    leaves = [consts[i] if i in consts else next(it) for i in range(spec.tree.num_leaves)]
    return pytree.tree_unflatten(leaves, spec.tree)


def as_call(value: Any, spec: Spec | None) -> Call:
    """How a stage is called with ``value``, rebuilt from ``spec`` (see the module's docstring)."""
    if spec is not None and spec.call:
        args, kwargs = value
        return Call(tuple(args), dict(kwargs))
    if isinstance(value, tuple):
        return Call(value)
    if isinstance(value, dict):
        return Call((), dict(value))
    return Call((value,))


def split_call(args: tuple[Any, ...], kwargs: dict[str, Any], parts: int) -> tuple[list[tuple[torch.Tensor, ...]],
                                                                                     Spec]:
    """A batch's arguments as ``parts`` microbatches: each tensor cut along dimension 0 into equal rows; other
    values go to every microbatch as they are. Returns each microbatch's tensors and the spec they share."""
    tensors, spec = flatten((tuple(args), dict(kwargs)), call=True)
    assert spec is not None
    if not tensors:
        raise ConfigError("the batch has no tensor to cut into microbatches: pass the first stage's inputs to the "
                          "step on the rank that holds it")
    rows = {tuple(t.shape[:1]) for t in tensors}
    if any(t.dim() == 0 for t in tensors) or len(rows) != 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ConfigError(f"every tensor of the batch is cut into microbatches along dimension 0, so they need the "
                          f"same number of rows; got shapes {shapes}: expand the ones meant for every row")
    n = tensors[0].shape[0]
    if n % parts:
        raise ConfigError(f"a batch of {n} rows does not split into {parts} equal microbatches: give a batch whose "
                          f"size is a multiple of {parts}, or another number of microbatches")
    cut = [t.chunk(parts) for t in tensors]
    return [tuple(c[j] for c in cut) for j in range(parts)], spec


def encode_spec(spec: Spec | None, where: str) -> bytes:
    """A spec as the bytes that travel in a header (empty for None)."""
    if spec is None:
        return b""
    try:
        data = pickle.dumps(spec)
    except Exception as exc:  # a value that does not pickle
        raise ConfigError(f"{where} passes a value that cannot be sent to another rank ({exc}): pass tensors, "
                          "tuples, dicts and plain Python values") from None
    if len(data) > SPEC_BYTES:
        raise ConfigError(f"{where} passes a structure of {len(data)} bytes besides its tensors, more than the "
                          f"{SPEC_BYTES} a header holds: pass fewer or smaller non-tensor values")
    return data


def decode_spec(data: bytes) -> Spec | None:
    if not data:
        return None
    with warnings.catch_warnings():  # torch 2.13's TreeSpec warns of its own LeafSpec when unpickled
        warnings.simplefilter("ignore", FutureWarning)
        return pickle.loads(data)


def describe(tensors: Sequence[torch.Tensor], spec: Spec | None) -> str:
    """A short account of a boundary's value, for error messages: its shapes (and its keys for a dict)."""
    shapes = [f"{tuple(t.shape)}" + ("" if t.dtype == torch.float32 else f" {str(t.dtype).replace('torch.', '')}")
              for t in tensors]
    if spec is None:
        return shapes[0] if len(shapes) == 1 else "(" + ", ".join(shapes) + ")"
    return repr(unflatten(spec, [_Text(s) for s in shapes]))  # type: ignore[misc]


class _Text(str):
    """A tensor's shape standing in its place in :func:`describe`'s rebuilt value."""

    def __repr__(self) -> str:
        return str(self)

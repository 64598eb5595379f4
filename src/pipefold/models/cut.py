"""Cut a model that is not written as a layer sequence into one, with torch.fx.

Partitioning and the runtime take a flat sequence of layers, each fed the
previous one's output. A model with a ``forward`` of its own (loops, skip
connections, several inputs) becomes one by tracing it and cutting the graph
after given nodes::

    forward   x -> embed -> h0 -> block0 -> h1 -> block1 -> h2 -> head -> y
                     \\_____________________________/  (a skip from embed to head)
    cuts      after "block0"
    segments  [x] -> (h1, e)      (h1, e) -> y         e is passed through segment 0's output

Each segment is a ``torch.fx.GraphModule`` that takes the values live at its
start and returns those live at its end: one tensor, or a tuple when several
values cross the cut (a skip connection). The segments share the model's own
parameters, and applying them in turn computes exactly what the model does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from pipefold.errors import ConfigError

__all__ = ["cut_model", "cut_points"]


def cut_points(model: nn.Module) -> list[str]:
    """Names after which :func:`cut_model` can cut ``model``: its traced nodes, in order."""
    return [n.name for n in _trace(model).graph.nodes if n.op not in ("placeholder", "output")]


def cut_model(model: nn.Module, after: Sequence[str]) -> list[nn.Module]:
    """``model`` as ``len(after) + 1`` segments, cut after each named node (in graph order).

    A name is a traced node's name (see :func:`cut_points`) or the qualified name of a
    submodule the forward calls once, such as ``"blocks.3"``: the cut then comes after its last node.
    """
    gm = _trace(model)
    nodes = list(gm.graph.nodes)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    inputs = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    position = {n: i for i, n in enumerate(body)}
    cuts = sorted({position[_find(gm, name, body)] for name in after})
    if len(cuts) != len(after):
        raise ConfigError(f"cut points name the same node twice: {list(after)}")
    if cuts and cuts[-1] == len(body) - 1:
        raise ConfigError(f"cannot cut after {body[-1].name}, the model's last node: nothing would follow")
    bounds = [0, *(c + 1 for c in cuts), len(body)]
    segments = [body[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    # A value is live after a segment if a later segment (or the output) uses it.
    users_after: list[set[fx.Node]] = []
    later: set[fx.Node] = set(_args_of(output))
    for seg in reversed(segments):
        users_after.append(set(later))
        for n in seg:
            later |= set(_args_of(n))
    users_after.reverse()
    defined: list[fx.Node] = list(inputs)
    live_in = list(inputs)
    out: list[nn.Module] = []
    for k, seg in enumerate(segments):
        defined += seg
        last = k == len(segments) - 1
        live_out = None if last else [n for n in defined if n in users_after[k]]
        out.append(_segment(gm, live_in, seg, live_out, output))
        if live_out is not None:
            live_in = live_out
    return out


def _trace(model: nn.Module) -> fx.GraphModule:
    try:
        return fx.symbolic_trace(model)
    except Exception as exc:  # torch.fx raises many kinds for code it cannot trace
        raise ConfigError(f"cannot trace {type(model).__name__} with torch.fx ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); pass a flat layer list instead"
                          ) from None


def _find(gm: fx.GraphModule, name: str, body: list[fx.Node]) -> fx.Node:
    """The node called ``name``, or the last node of the submodule ``name`` (tracing goes inside it)."""
    inside = [n for n in body if n.op in ("call_module", "get_attr") and isinstance(n.target, str)
              and (n.target == name or n.target.startswith(name + "."))]
    calls = [n for n in inside if n.op == "call_module"]
    times = max((sum(m.target == n.target for m in calls) for n in calls), default=1)
    if times > 1:
        raise ConfigError(f"submodule {name} is called {times} times, so 'after {name}' is ambiguous: name a node "
                          f"that follows the call you mean (pipefold.models.cut.cut_points lists them)")
    by_name = {n.name: n for n in body}
    if name in by_name:
        return by_name[name]
    if inside:
        return inside[-1]
    near = [n.name for n in body][:8]
    raise ConfigError(f"no node or submodule named {name!r} to cut after; nodes start {', '.join(near)}, ... "
                      f"(pipefold.models.cut.cut_points lists them all)")


def _args_of(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)  # type: ignore[func-returns-value]
    return found


def _segment(gm: fx.GraphModule, live_in: list[fx.Node], nodes: list[fx.Node],
             live_out: list[fx.Node] | None, output: fx.Node) -> fx.GraphModule:
    """A GraphModule taking ``live_in`` and returning ``live_out`` (or the model's output for the last)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in live_in:
        env[n] = graph.placeholder(n.name)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    if live_out is None:
        result: Any = fx.node.map_arg(output.args[0], lambda a: env[a])
    else:
        values = [env[n] for n in live_out]
        result = values[0] if len(values) == 1 else tuple(values)
    graph.output(result)
    return fx.GraphModule(gm, graph)

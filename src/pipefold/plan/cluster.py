"""A cluster described in a file: its accelerator, how many of them per node and nodes, and the links inside a
node and between nodes, with the fractions of each peak that real work achieves. The cluster planner
(:mod:`pipefold.plan.cluster_plan`) costs a layout on it without having it.

The file (JSON; ``pipefold plan --cluster FILE``, or the name of one this package ships: ``a100-80gb``,
``h100-sxm``, ``h200``, ``h800``)::

    {"name": ..., "nodes": 64, "devices_per_node": 8,
     "accelerator": {"name": ..., "peak_flops": {"bf16": 989e12, ...}, "memory_bytes": ...,
                     "memory_bandwidth": ..., "usable_memory": 0.95,
                     "matmul_efficiency": [[flops of one matrix product, fraction of peak], ...]},
     "intra_node": {"name": ..., "bandwidth": bytes/s per device each way, "latency": s, "efficiency": 0.8},
     "inter_node": {...the same, per device...},
     "sources": {"what": "where it was published", ...}}

``matmul_efficiency`` is a curve: a product of x floating-point operations runs at the fraction interpolated
(linearly in log x) between the points around it, the first point's below them and the last's above. A link's
``efficiency`` is the fraction of its bandwidth a collective's algorithm achieves (NCCL's bus bandwidth over the
line rate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from pipefold.errors import ConfigError
from pipefold.files import read_shipped_or_file, shipped_names

__all__ = ["Accelerator", "Cluster", "Link", "cluster_to_dict", "load_cluster", "measured_efficiency",
           "shipped_clusters", "shipped_for"]


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    name: str
    peak_flops: dict[str, float]
    """Dense floating-point operations per second by dtype (bf16, fp16, fp8, tf32, fp32)."""
    memory_bytes: float
    memory_bandwidth: float
    matmul_efficiency: tuple[tuple[float, float], ...]
    usable_memory: float = 0.95
    """The fraction of ``memory_bytes`` a training process can hold (the rest: its context, the collectives'
    buffers, the allocator's fragmentation)."""

    def efficiency(self, flops: float) -> float:
        """The fraction of peak a matrix product of ``flops`` operations achieves (the curve, see the module)."""
        points = self.matmul_efficiency
        if flops <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
            if flops <= x1:
                t = (math.log(flops) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return y0 + t * (y1 - y0)
        return points[-1][1]

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ConfigError(f"{self.name} has no peak for {dtype}: it lists {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]


@dataclass(frozen=True, kw_only=True)
class Link:
    name: str
    bandwidth: float
    """Bytes per second per device, each way."""
    latency: float
    efficiency: float = 1.0

    @property
    def achieved(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str
    accelerator: Accelerator
    nodes: int
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"--nodes is the cluster's node count: a whole number >= 1 (got {nodes!r})")
        return replace(self, nodes=nodes)

    def link(self, span: int) -> Link:
        """The link a group of devices ``span`` consecutive ranks wide talks over: the node's own when the group fits
        in a node, the network between nodes otherwise."""
        return self.intra_node if span <= self.devices_per_node else self.inter_node

    def describe(self) -> str:
        a = self.accelerator
        return (f"{self.name}: {self.nodes} x {self.devices_per_node} {a.name} ({a.memory_bytes / 2**30:.0f} GiB, "
                f"{a.peak_flops.get('bf16', 0) / 1e12:.0f} TFLOP/s bf16), {self.intra_node.name} inside a node, "
                f"{self.inter_node.name} between nodes")


def _shipped() -> Any:
    return resources.files("pipefold.plan").joinpath("clusters")


def shipped_clusters() -> list[str]:
    """The cluster files this package ships (``--cluster NAME``)."""
    return shipped_names(_shipped())


def shipped_for(device_name: str) -> str:
    """The shipped cluster file of a GPU by its name (``torch.cuda.get_device_name``): H200, H100, H800, else
    A100."""
    for name, file in (("H200", "h200"), ("H100", "h100-sxm"), ("H800", "h800")):
        if name in device_name:
            return file
    return "a100-80gb"


def _number(data: dict[str, Any], key: str, where: str, *, low: float = 0.0, integer: bool = False,
            high: float = math.inf) -> Any:
    value: Any = data.get(key)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not (low < value <= high) or not math.isfinite(value):
        kind = "a whole number" if integer else "a number"
        bound = f" at most {high:g}" if math.isfinite(high) else ""
        raise ConfigError(f"{where}: {key} must be {kind} > {low:g}{bound} (got {value!r})")
    return value


def _link(data: Any, where: str) -> Link:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be an object with bandwidth, latency and efficiency")
    return Link(name=str(data.get("name", where)), bandwidth=float(_number(data, "bandwidth", where)),
                latency=float(_number(data, "latency", where, low=-1e-300)),
                efficiency=float(_number(data, "efficiency", where, high=1.0)) if "efficiency" in data else 1.0)


def cluster_from_dict(data: Any, where: str) -> Cluster:
    """A cluster from a file's contents, every figure checked (one line naming what is wrong)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} is not a JSON object describing a cluster")
    for key in ("accelerator", "intra_node", "inter_node"):
        if key not in data:
            raise ConfigError(f"{where} has no {key}: a cluster file gives accelerator, nodes, devices_per_node, "
                              "intra_node and inter_node")
    acc = data["accelerator"]
    if not isinstance(acc, dict):
        raise ConfigError(f"{where}: accelerator must be an object")
    peaks = acc.get("peak_flops")
    if not isinstance(peaks, dict) or not peaks or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in peaks.values()):
        raise ConfigError(f"{where}: accelerator.peak_flops must map dtypes to FLOP/s > 0, such as "
                          '{"bf16": 989e12}')
    curve = acc.get("matmul_efficiency")
    try:
        points = tuple((float(x), float(y)) for x, y in curve)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        points = ()
    if not points or any(not (x > 0 and 0 < y <= 1) for x, y in points) or any(
            b[0] <= a[0] for a, b in zip(points, points[1:], strict=False)):
        raise ConfigError(f"{where}: accelerator.matmul_efficiency must be [[flops, fraction], ...] with flops "
                          "rising and fractions in (0, 1]")
    accelerator = Accelerator(
        name=str(acc.get("name", "accelerator")), peak_flops={str(k): float(v) for k, v in peaks.items()},
        memory_bytes=float(_number(acc, "memory_bytes", f"{where}: accelerator")),
        memory_bandwidth=float(_number(acc, "memory_bandwidth", f"{where}: accelerator")),
        usable_memory=float(_number(acc, "usable_memory", f"{where}: accelerator", high=1.0))
        if "usable_memory" in acc else 0.95,
        matmul_efficiency=points)
    sources = data.get("sources", {})
    return Cluster(name=str(data.get("name", where)), accelerator=accelerator,
                   nodes=int(_number(data, "nodes", where, integer=True)) if "nodes" in data else 1,
                   devices_per_node=int(_number(data, "devices_per_node", where, integer=True)),
                   intra_node=_link(data["intra_node"], f"{where}: intra_node"),
                   inter_node=_link(data["inter_node"], f"{where}: inter_node"),
                   sources={str(k): str(v) for k, v in sources.items()} if isinstance(sources, dict) else {})


def load_cluster(given: str) -> Cluster:
    """A cluster: the name of a file this package ships, or a path to one."""
    data, where = read_shipped_or_file(given, _shipped(), flag="--cluster", what="cluster",
                                       hint="give a cluster file (docs/cluster.md)")
    return cluster_from_dict(data, where)


def measured_efficiency(cluster: Cluster, measured: Sequence[tuple[float, float]], dtype: str, where: str) -> Cluster:
    """``cluster`` with its accelerator's matmul efficiency as measured: each (operations, seconds) of one product
    becomes a point, the fraction of the ``dtype`` peak it achieved (:func:`pipefold.runtime.measure.profiling.
    measure_matmuls`); ``where`` says on what, for the file's sources. One line where a product ran faster than
    the peak: the file describes another device."""
    acc = cluster.accelerator
    peak = acc.peak(dtype)
    points = []
    for flops, seconds in sorted(measured):
        rate = flops / seconds
        if rate > peak:
            raise ConfigError(f"a product of {flops:.3g} operations ran at {rate / 1e12:.3g} TFLOP/s, above the "
                              f"{dtype} peak of {acc.name} ({peak / 1e12:.3g}): give a cluster file describing "
                              "this device")
        points.append((flops, float(f"{rate / peak:.4g}")))
    if not points:
        raise ConfigError("nothing was measured: give a larger size range")
    sources = {**cluster.sources, "matmul_efficiency": f"measured: {where}, {dtype} products against the "
                                                       f"{dtype} peak (pipefold calibrate)"}
    return replace(cluster, accelerator=replace(acc, matmul_efficiency=tuple(points)), sources=sources)


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The cluster as its file writes it (what :func:`cluster_from_dict` reads back)."""
    acc = cluster.accelerator

    def link(x: Link) -> dict[str, Any]:
        return {"name": x.name, "bandwidth": x.bandwidth, "latency": x.latency, "efficiency": x.efficiency}

    return {"name": cluster.name, "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node,
            "accelerator": {"name": acc.name, "peak_flops": dict(acc.peak_flops), "memory_bytes": acc.memory_bytes,
                            "memory_bandwidth": acc.memory_bandwidth, "usable_memory": acc.usable_memory,
                            "matmul_efficiency": [list(p) for p in acc.matmul_efficiency]},
            "intra_node": link(cluster.intra_node), "inter_node": link(cluster.inter_node),
            "sources": dict(cluster.sources)}

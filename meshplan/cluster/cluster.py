"""`Cluster`: `nodes` x `gpus_per_node` of one GPU plus the few numbers that depend on the
deployment (scale-up domain size, achieved NIC bandwidth, latencies, memory reserve).

Owns construction and validation (fields left out follow the GPU: meshplan/cluster/topology.py),
the derived sizes and prices, `placement` (how a communicator falls onto scale-up domains),
`replace`, JSON (de)serialisation, the fingerprint and the human-readable description. The GPU
table lives in meshplan/cluster/gpus.py, the named presets in meshplan/cluster/presets.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshplan.cluster.gpus import _norm, cpu_gpu_spec, gpu
from meshplan.cluster.spec import GPUSpec, _check_int, _check_positive
from meshplan.cluster.topology import _DERIVED, _defaults, _divisors, _placement
from meshplan.errors import ConfigError, LayoutError, UnknownNameError

__all__ = ["Cluster", "CLUSTER_JSON_VERSION"]

CLUSTER_JSON_VERSION = 1

_resolve_gpu = gpu   # Cluster.__init__ has a parameter named `gpu`


@dataclass(frozen=True, kw_only=True, init=False, repr=False)
class Cluster:
    """`nodes` x `gpus_per_node` GPUs of one kind, with the deployment's network figures.

    Build one with `Cluster.preset("dgx-h100", nodes=16)` or
    `Cluster(gpu="h100-sxm", num_gpus=16, gpus_per_node=8)` (or `nodes=2`); every field left out
    gets the GPU's default. `dataclasses.fields` / `dataclasses.replace` work; `replace` here also
    re-derives the fields that were still at the old defaults.
    """

    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    scaleup_domain: int        # GPUs per scale-up domain (72 for NVL72: 18 trays of 4)
    nic_gb_s: float            # achieved network busbw per GPU (GB/s)
    net_latency_us: float      # per-hop network latency
    scaleup_latency_us: float  # per-hop scale-up latency
    base_latency_us: float     # per-collective launch/base latency
    memory_reserved_gb: float  # CUDA context + NCCL buffers + allocator fragmentation (see constants)
    name: str

    def __init__(
        self, *, gpu: GPUSpec | str, nodes: int | None = None, gpus_per_node: int | None = None,
        num_gpus: int | None = None, scaleup_domain: int | None = None, nic_gb_s: float | None = None,
        net_latency_us: float | None = None, scaleup_latency_us: float | None = None,
        base_latency_us: float | None = None, memory_reserved_gb: float | None = None,
        name: str | None = None,
    ) -> None:
        for label, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("num_gpus", num_gpus)):
            if value is not None:
                _check_int("cluster", label, value)
        if isinstance(gpu, str) and _norm(gpu) == "cpu":
            # CPU "GPUs" are processes sharing a host: size the per-process spec to the node.
            per_host = gpus_per_node or (num_gpus // (nodes or 1) if num_gpus else 4)
            spec = cpu_gpu_spec(max(1, per_host))
        else:
            spec = _resolve_gpu(gpu)
        if gpus_per_node is None:
            gpus_per_node = spec.node_gpus
            if num_gpus is not None and nodes is None and num_gpus < gpus_per_node:
                gpus_per_node = num_gpus           # part of one server
        if num_gpus is not None:
            if num_gpus % gpus_per_node:
                near = sorted({max(1, num_gpus // gpus_per_node), num_gpus // gpus_per_node + 1})
                raise ConfigError(
                    f"{num_gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes; use "
                    f"num_gpus={' or '.join(str(n * gpus_per_node) for n in near)}, or a "
                    f"gpus_per_node dividing {num_gpus}: {_divisors(num_gpus)}")
            if nodes is not None and nodes * gpus_per_node != num_gpus:
                raise ConfigError(f"nodes={nodes} x gpus_per_node={gpus_per_node} is "
                                  f"{nodes * gpus_per_node} GPUs, not num_gpus={num_gpus}; give one of them")
            nodes = num_gpus // gpus_per_node
        nodes = 1 if nodes is None else nodes
        given = dict(scaleup_domain=scaleup_domain, nic_gb_s=nic_gb_s, net_latency_us=net_latency_us,
                     scaleup_latency_us=scaleup_latency_us, base_latency_us=base_latency_us,
                     memory_reserved_gb=memory_reserved_gb, name=name)
        values = _defaults(spec, gpus_per_node, nodes * gpus_per_node)
        values.update({k: v for k, v in given.items() if v is not None})
        for key, value in dict(gpu=spec, nodes=nodes, gpus_per_node=gpus_per_node, **values).items():
            object.__setattr__(self, key, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, GPUSpec):
            raise ConfigError(f"cluster gpu must be a GPUSpec or a GPU id, got {self.gpu!r}")
        where = f"cluster {self.name!r}"
        for label in ("nodes", "gpus_per_node", "scaleup_domain"):
            _check_int(where, label, getattr(self, label))
        _check_positive(where, "nic_gb_s", self.nic_gb_s)
        for label in ("net_latency_us", "scaleup_latency_us", "base_latency_us", "memory_reserved_gb"):
            _check_positive(where, label, getattr(self, label), allow_zero=True)
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"{where}: name must be a non-empty string")
        if self.memory_reserved_gb >= self.gpu.hbm_gb:
            raise ConfigError(f"{where}: memory_reserved_gb={self.memory_reserved_gb:g} leaves nothing "
                              f"of the {self.gpu.hbm_gb:g} GB on a {self.gpu.id}")
        self._check_domain(where)

    def _check_domain(self, where: str) -> None:
        d, gpn, n, g = self.scaleup_domain, self.gpus_per_node, self.num_gpus, self.gpu
        if d > g.scaleup_domain:
            raise ConfigError(f"{where}: scaleup_domain={d} exceeds the {g.scaleup_domain}-GPU "
                              f"{g.scaleup} domain of a {g.id}")
        if d <= gpn:
            if gpn % d:
                ok = [x for x in _divisors(gpn) if x <= g.scaleup_domain]
                raise ConfigError(f"{where}: scale-up domains of {d} GPUs do not tile a {gpn}-GPU "
                                  f"node; use scaleup_domain in {ok}")
            return
        if g.scaleup_domain <= g.node_gpus:
            raise ConfigError(f"{where}: a {g.id} {g.scaleup} domain cannot span nodes, but "
                              f"scaleup_domain={d} > gpus_per_node={gpn}; use at most {gpn}")
        if d % gpn or n % d:
            ok = [x for x in _divisors(n) if x % gpn == 0 and x <= g.scaleup_domain]
            per_rack = g.scaleup_domain // gpn
            raise ConfigError(
                f"{where}: {n} GPUs in {self.nodes} nodes of {gpn} do not split into whole "
                f"{d}-GPU scale-up domains; use a multiple of {per_rack} nodes (or at most {per_rack}), "
                f"or set scaleup_domain to one of {ok}")

    # ---- derived sizes ----
    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_memory_gb(self) -> float:
        return self.gpu.hbm_gb - self.memory_reserved_gb

    @property
    def num_domains(self) -> int:
        return self.num_gpus // self.scaleup_domain

    @property
    def price_usd_per_hour(self) -> float | None:
        """On-demand price of the whole cluster, or None where the GPU has no price."""
        p = self.gpu.price_usd_per_hour
        return None if p is None else p * self.num_gpus

    def placement(self, group_size: int, stride: int) -> tuple[int, int]:
        """How a communicator falls onto scale-up domains: (ranks_per_domain, domains_spanned).

        The communicator has `group_size` ranks, `stride` ranks apart in node-major rank order
        (a mesh axis whose inner axes multiply to `stride`), and the world is tiled by such groups.
        When the groups line up with the domains (stride a multiple of the domain, or groups that
        fill whole domains, or fit inside one), every group puts exactly `ranks_per_domain` ranks
        in each of `domains_spanned` domains, and the product is `group_size`. Otherwise groups
        differ; the answer is then the worst case over all groups, for costing the slowest one:
        the most domains any group touches, and the fewest ranks any group has in one domain
        (the ranks whose links carry the traffic leaving it), so the product is below group_size.

        dgx-h100 x 16 nodes: (8, 1) -> (8, 1); (16, 1) -> (8, 2); (4, 8) -> (1, 4); (4, 2) -> (4, 1).
        """
        for label, value in (("group_size", group_size), ("stride", stride)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"placement: {label} must be a positive whole number, got {value!r}")
        span = group_size * stride
        if self.num_gpus % span:
            raise LayoutError(
                f"a group of {group_size} ranks {stride} apart spans {span} ranks, which does not "
                f"divide the {self.num_gpus} GPUs of cluster {self.name!r}; group_size x stride must "
                f"be one of {_divisors(self.num_gpus)}")
        return _placement(self.num_gpus, self.scaleup_domain, group_size, stride)

    # ---- construction helpers ----
    @classmethod
    def preset(cls, name: str, nodes: int | None = None, **options: Any) -> Cluster:
        """A named cluster: `Cluster.preset("dgx-h100", nodes=16)`; see `Cluster.presets()`.

        Options: `num_gpus` instead of `nodes`, `nproc` for local-cpu, and any Cluster field.
        """
        from meshplan.cluster.presets import PRESETS   # presets.py builds Clusters: import at call
        key = _norm(name) if isinstance(name, str) else name
        if key not in PRESETS:
            raise UnknownNameError("cluster preset", name, list(PRESETS))
        allowed = {"num_gpus", *_DERIVED, "gpus_per_node"} | ({"nproc"} if key == "local-cpu" else set())
        bad = sorted(set(options) - allowed)
        if bad:
            raise ConfigError(f"preset {key!r} does not take {bad}; it takes nodes and "
                              f"{', '.join(sorted(allowed))}")
        return PRESETS[key](nodes=nodes, **options)

    @staticmethod
    def presets() -> list[str]:
        from meshplan.cluster.presets import PRESETS   # presets.py builds Clusters: import at call
        return sorted(PRESETS)

    def replace(self, **changes: Any) -> Cluster:
        """A copy with `changes`; fields still at their defaults follow a new gpu / shape."""
        old = _defaults(self.gpu, self.gpus_per_node, self.num_gpus)
        kwargs: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if "num_gpus" in changes and "nodes" not in changes:
            del kwargs["nodes"]
        if "gpu" in changes and "name" not in changes and _resolve_gpu(changes["gpu"]) != self.gpu:
            kwargs["name"] = None   # a preset's name describes its old GPU
        if "gpu" not in changes and self.gpu == cpu_gpu_spec(self.gpu.node_gpus):
            kwargs["gpu"] = "cpu"   # the per-process CPU spec follows the new process count
        for key in _DERIVED:
            if key not in changes and kwargs[key] == old[key]:
                kwargs[key] = None
        kwargs.update(changes)
        return Cluster(**kwargs)

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["gpu"] = self.gpu.to_dict()
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps({"version": CLUSTER_JSON_VERSION, "kind": "meshplan.Cluster",
                           "cluster": self.to_dict()}, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"cluster JSON does not parse: {exc}") from None
        if not isinstance(doc, dict) or "cluster" not in doc:
            raise ConfigError("cluster JSON must be an object with 'version' and 'cluster' keys "
                              "(as written by Cluster.to_json)")
        if doc.get("version") != CLUSTER_JSON_VERSION:
            raise ConfigError(f"cluster JSON version {doc.get('version')!r} is not supported; this "
                              f"meshplan reads version {CLUSTER_JSON_VERSION}")
        data = doc["cluster"]
        if not isinstance(data, dict) or not isinstance(data.get("gpu"), dict):
            raise ConfigError("cluster JSON: 'cluster' must be an object with a 'gpu' object")
        data = dict(data, gpu=GPUSpec.from_dict(data["gpu"]))
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ConfigError(f"cluster JSON fields {sorted(data)} differ from {sorted(names)}")
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        return cls.from_json(Path(path).read_text())

    def fingerprint(self) -> str:
        """12 hex digits identifying the performance-relevant content (names and sources excluded)."""
        data = self.to_dict()
        del data["name"]
        for key in ("name", "sources", "price_source"):
            del data["gpu"][key]
        # the host link and host memory price only activation offloading: left out so that plans
        # saved before these figures existed still match their cluster
        for key in ("host_link_gb_s", "host_mem_gb"):
            data["gpu"].pop(key, None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]

    def __repr__(self) -> str:
        parts = [f"gpu={self.gpu.id!r}"] + [f"{f.name}={getattr(self, f.name)!r}"
                                             for f in dataclasses.fields(self) if f.name != "gpu"]
        return f"Cluster({', '.join(parts)})"

    def describe(self) -> str:
        """A few human-readable lines (for the CLI and reports)."""
        g = self.gpu
        fp8 = f", FP8 {g.fp8_tflops:g}" if g.fp8_tflops else ""
        price = self.price_usd_per_hour
        return "\n".join([
            f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} {g.name} = {self.num_gpus} GPUs",
            f"  compute  BF16 {g.bf16_tflops:g} TFLOPS dense{fp8} (GEMM efficiency {g.gemm_efficiency:.2f})",
            f"  memory   {g.hbm_gb:.4g} GB at {g.hbm_tb_s:.3g} TB/s, {self.usable_memory_gb:.1f} GB usable",
            f"  scale-up {g.scaleup}, {self.num_domains} domain(s) of {self.scaleup_domain}, "
            f"busbw {g.scaleup_busbw_gb_s:.3g} GB/s",
            f"  network  {self.nic_gb_s:.3g} GB/s busbw per GPU",
            "  price    " + (f"${price:,.2f}/h on demand" if price is not None else "unknown"),
        ])

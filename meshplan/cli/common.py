"""Argument helpers the subcommands share."""

from __future__ import annotations

from meshplan.cluster import Cluster
from meshplan.errors import MeshplanError

__all__ = ["parse_layout", "cluster_from_args"]

_LAYOUT_INT = ("tp", "cp", "ep", "etp", "pp", "vp", "dp", "zero", "mbs")


def parse_layout(text: str) -> dict:
    """'tp=8,pp=4,recompute=full' -> dict (ints where the key is a degree)."""
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise MeshplanError(f"layout item {part!r} is not key=value (e.g. --layout tp=8,pp=4,dp=2)")
        k, v = (s.strip() for s in part.split("=", 1))
        if k in _LAYOUT_INT:
            try:
                out[k] = int(v)
            except ValueError:
                raise MeshplanError(f"layout {k}={v!r}: must be an integer") from None
        elif k in ("sp", "tp_comm_overlap", "flash_attention", "offload_activations"):
            out[k] = v.lower() in ("1", "true", "yes", "on")
        elif k == "recompute" and v.isdigit():
            out[k] = int(v)
        else:
            out[k] = v
    return out


def cluster_from_args(args):
    if args.cluster.endswith(".json"):
        return Cluster.load(args.cluster)
    opts = {}
    if args.nodes is not None:
        if args.nodes < 1:
            raise MeshplanError(f"--nodes must be >= 1, got {args.nodes}")
        opts["nodes"] = args.nodes
    return Cluster.preset(args.cluster, **opts)

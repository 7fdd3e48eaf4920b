"""A lower bound on a candidate mesh's step time, from its layers' costs alone: the search costs
candidates cheapest bound first and stops where no candidate left can matter (search.py).

For a mesh (tp, cp, ep, etp, pp, vp, dp, schedule, ...) and any micro-batch size and recompute
policy the search would try, the step is at least the pipeline's busy + bubble time of its ranks'
forward + backward work (`Device.pipeline_lower_bound`) plus the exposed pipeline p2p time. The
ranks' work together is at least: each layer's cheapest forward + backward (+ recompute) time under
the policies on offer, the embedding and the output layer + loss, and the unfused gradient
accumulation of every weight the pipeline holds. Every other term of the step (data-parallel and
optimizer time, FP8 casts, overheads) is non-negative. The costs are the estimate's own numbers,
read from the cost model's tables (`cost_models.tables`: `layer_table`, cached across the search,
`edge_costs`, `pipeline_p2p_s`, `pipeline_floor_s`, `grad_accumulation_s`), so the bound is exact
arithmetic, not a model; tests/planner/test_search_bound.py checks it against every estimate of
several searches.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from meshplan.cost_models.tables import (
    edge_costs,
    grad_accumulation_s,
    layer_table,
    pipeline_floor_s,
    pipeline_p2p_s,
)
from meshplan.errors import MeshplanError
from meshplan.ir.layout import Layout
from meshplan.ir.profile import ModelProfile

__all__ = ["MeshBound", "policies_of"]

# layout fields the per-layer costs do not see (LayerTable.key): candidates differing only in these
# share one layer sum
_PIPELINE_FIELDS = frozenset({"pp", "vp", "dp", "zero", "schedule", "stage_layers", "fsdp_shard",
                              "reshard_after_forward", "mbs", "recompute"})


def policies_of(recompute_options: Iterable) -> tuple[str, ...]:
    """The per-layer recompute policies `recompute_options` (Layout.recompute values) apply: a
    number N recomputes N layers fully and none of the others (Layout.recompute_policy)."""
    out: list[str] = []
    for rc in recompute_options:
        for pol in ((rc,) if isinstance(rc, str) else ("full", "none")):
            if pol not in out:
                out.append(pol)
    return tuple(out)


class MeshBound:
    """`bound(cand, mbss)`: the least step time any estimate of candidate `cand` (a Layout or a
    layout dict; its mbs and recompute are ignored) can have over the micro-batch sizes `mbss`, this
    search's precisions and recompute policies."""

    def __init__(self, profile: ModelProfile, cluster, *, seq_len: int, global_batch: int,
                 precisions: tuple[str, ...], policies: tuple[str, ...], fp8_modules: frozenset | None, stack):
        self.profile, self.cluster, self.seq_len, self.global_batch = profile, cluster, seq_len, global_batch
        self.precisions, self.policies, self.fp8_modules, self.stack = precisions, policies, fp8_modules, stack
        self._sums: dict[tuple, float] = {}

    def __call__(self, cand: Layout | Mapping[str, Any], mbss: list[int]) -> float:
        if isinstance(cand, Layout):
            cand = cand.to_dict()
        try:
            lay = Layout.from_dict(dict(cand, mbs=1, recompute="none"))
            key = tuple(sorted((k, v) for k, v in cand.items() if k not in _PIPELINE_FIELDS
                               and not isinstance(v, (list, dict))))
            acc = 0.0
            if lay.zero < 3 and not (lay.grad_accum_fusion and self.stack.grad_accum_fusion):
                # every micro-batch adds each weight gradient into the buffer (ranks.rank_work); the
                # pass is linear in the weights, so the ranks' passes add up to one over all of them
                acc = grad_accumulation_s(self._layer_params(lay), lay, self.stack, self.cluster)
            best = math.inf
            for precision in self.precisions:
                for mbs in mbss:
                    total, tokens = self._layer_sum(key, cand, mbs, precision)
                    m = self.global_batch // (lay.dp * mbs)
                    # the exposed pipeline p2p, its host work included
                    pp_exposed = pipeline_p2p_s(self.profile, self.cluster, lay, m, tokens, self.stack)[0]
                    best = min(best, pipeline_floor_s(self.cluster, lay, m, total + acc) + pp_exposed)
            return best
        except MeshplanError:
            return 0.0      # the estimate will say what is wrong; never prune on it

    def _layer_params(self, lay: Layout) -> float:
        """Weights the pipeline's ranks hold in their transformer layers, one TP / EP shard."""
        n = 0.0
        for b in self.profile.layer_blocks():
            folded = sum(li.params for li in b.linears if li.role == "shared_folded")
            n += (b.params - b.expert_params - folded) / lay.tp + folded + b.expert_params / (lay.ep * lay.etp)
        return n

    def _layer_sum(self, key: tuple, cand: Mapping[str, Any], mbs: int, precision: str) -> tuple[float, float]:
        """(the least forward + backward seconds of all the pipeline's ranks together for one
        micro-batch of `mbs`: each layer's cheapest policy, the embedding and the output layer + loss;
        the tokens of that micro-batch on one GPU)."""
        k = (key, mbs, precision)
        hit = self._sums.get(k)
        if hit is None:
            lay = Layout.from_dict(dict(cand, mbs=mbs, recompute="none"))
            fp8 = precision == "fp8"
            table = layer_table(self.profile, self.cluster, lay, seq_len=self.seq_len, precision=precision,
                                fp8_modules=self.fp8_modules if fp8 else None, stack=self.stack)
            count: dict[tuple, list[int]] = {}
            for i in range(self.profile.num_layers):
                count.setdefault(table.layer_key(i), []).append(i)
            total = 0.0
            for layers in count.values():
                costs = [table.cost(layers[0], pol) for pol in self.policies]
                total += len(layers) * min(c.fwd_s + c.bwd_s + c.recompute_s for c in costs)
            # the edges: embedding forward e + backward 2e on the first rank, output layer + loss
            # forward g + ce and backward 2g + ce on the last
            edge = edge_costs(self.profile, table)
            hit = self._sums[k] = (total + 3 * edge.embedding_fwd_s + 3 * edge.head_gemm_fwd_s + 2 * edge.loss_s,
                                   table.ctx.tokens)
        return hit

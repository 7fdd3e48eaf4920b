"""What Muon (Layout.optimizer="muon", train/muon.py) costs beyond AdamW: state, step buffers,
the owner exchange and the Newton-Schulz matrix products. Pure functions of sizes and geometry.

State (bytes per parameter of the optimizer shard):
  hidden matrices    fp32 master + fp32 momentum = 8   (AdamW: 12, or 8 with bf16 moments)
  the rest           AdamW in the same optimizer: embedding, output head, final norm
                     (per-block norms, biases and routers are < 0.1% of a block: priced as matrices)

Step buffers (transient, after backward, when the activations are gone): the runtime holds, in
fp32, at most three copies of the rank's matrix shards at once (owners are balanced by size, so a
rank owns about as many elements as it holds): the shard of G + mu * B, its packed copy and the
received pieces while gathering; the inputs, the pieces and the updates while orthogonalising; the
updates, their packed slices and the received slices while scattering back. Plus one matrix's
Newton-Schulz workspace. They add to the peak only where they exceed the activations.

Communication per step: every rank sends its matrix shards to their owners and receives its
slices of the updates back: two all-to-alls of 4 bytes per shard element over the group the
matrices are sharded over (tp x the optimizer's data-parallel shard for dense weights, edp for
experts). The first is exposed (the step waits for it before Newton-Schulz). The second runs
into the next forward (the runtime's default, overlap_update): one message per layer, posted in
forward order at the end of the step, layer j's waited for just before layer j runs, or one
layer earlier under FSDP, whose pre-forward all-gathers the next layer's shards (explicit
prefetch). With g layers on the rank, u = the exchange / g per layer and f = the rank's forward /
g per layer, layer j's slices are in after (j + 1) u and needed after max(0, j - ahead) f:
exposed = max over j of ((j + 1) u - max(0, j - ahead) f) (`muon_update_exposed`), (1 + ahead) u
when a layer's forward outlasts its message, the whole exchange less the forward of the layers
before the last when it does not. The forward's own traffic on the same links (FSDP's
all-gathers) is not charged against it: where the forward is link-bound this is optimistic.

Newton-Schulz: 5 iterations of X X^T (2 k^2 l), (X X^T)^2 (2 k^3) and the product with X
(2 k^2 l) for a k x l matrix (k <= l): (4 + 2 k / l) k numel FLOPs each; priced with k = hidden
and k / l = 1 (attention projections are square; MLP and expert matrices have k / l < 1 and
sometimes k < hidden, so this is an upper bound of at most ~1.5x) on the owner's whole matrices.
"""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import Group, collective_time

__all__ = ["MUON_MATRIX_BYTES", "MUON_STEP_COPIES", "adamw_params", "muon_state_extra_bytes",
           "muon_step_bytes", "muon_comm_time", "muon_update_exposed", "muon_ns_flops"]

MUON_MATRIX_BYTES = K.FP32 + K.FP32         # fp32 master weights + momentum buffer
MUON_STEP_COPIES = 3                        # fp32 copies of the matrix shard during the step (above)
NS_STEPS = 5
_NS_FLOPS_PER_KN = 6                        # (4 + 2 k / l) at k = l


def adamw_params(profile, r: int, p: int) -> float:
    """Parameters of pipeline rank `r` (of `p`) that Muon leaves to AdamW, before TP: the token
    embedding (first rank), the output head and final norm (last rank)."""
    n = profile.embedding_params if r == 0 else 0.0
    if r == p - 1:
        head = profile.head_params or (profile.embedding_params if profile.tied_embeddings and p > 1 else 0)
        n += head + profile.other_params
    return float(n)


def muon_state_extra_bytes(adamw_local: float, adam_bytes: float) -> float:
    """Bytes to add when every parameter was priced at MUON_MATRIX_BYTES: the AdamW part's
    (adam_bytes - 8) per parameter of the rank's optimizer shard of it."""
    return max(0.0, adam_bytes - MUON_MATRIX_BYTES) * adamw_local


def muon_step_bytes(matrix_local: float, largest_matrix: float) -> float:
    """Transient bytes of one Muon step on a rank holding `matrix_local` matrix elements (its
    shards) whose largest whole matrix has `largest_matrix` elements (NS workspace: X, X X^T and
    its square, in fp32, with X X^T at most the matrix's size)."""
    return K.FP32 * (MUON_STEP_COPIES * matrix_local + 3 * largest_matrix)


def muon_comm_time(dense_local: float, expert_local: float, dense_group: Group, expert_group: Group,
                   cluster) -> float:
    """Seconds of one of the two exchanges per step (to the owners, or back to the shards)."""
    return collective_time("all_to_all", K.FP32 * dense_local, dense_group, cluster) + \
        collective_time("all_to_all", K.FP32 * expert_local, expert_group, cluster)


def muon_update_exposed(update_s: float, forward_s: float, layers: int, ahead: int = 0) -> float:
    """Seconds of the update exchange (`update_s`, all of it) that the next forward (`forward_s`
    over `layers` layers, one message each) cannot hide, when a layer's message is needed `ahead`
    layers before the layer itself runs (module docstring). One layer or none: all of it."""
    if layers <= 1 or update_s <= 0:
        return max(0.0, update_s)
    u, f = update_s / layers, max(0.0, forward_s) / layers
    # (j + 1) u - max(0, j - ahead) f is linear in j past `ahead`: its maximum is at j = ahead or the last layer
    candidates = [min(ahead, layers - 1), layers - 1]
    return max((j + 1) * u - max(0, j - ahead) * f for j in candidates)


def muon_ns_flops(matrix_local: float, hidden: int) -> float:
    """Newton-Schulz FLOPs of a rank owning about `matrix_local` matrix elements (upper bound)."""
    return NS_STEPS * _NS_FLOPS_PER_KN * hidden * matrix_local


# ---- one pipeline rank (estimate.py calls these with its RankWork) ---------------------------

def _shards(w, r: int, profile, L) -> tuple[float, float, float]:
    """(dense matrix, expert matrix, AdamW) elements of rank r's optimizer shard."""
    d = max(1, L.shard)
    e = max(1, L.edp) if L.zero >= 1 else 1
    adamw = adamw_params(profile, r, L.pp) / L.tp
    return max(0.0, w.dparams - adamw) / d, w.eparams / e, adamw / d


def muon_rank_memory(w, r: int, profile, blocks, L, *, adam_bytes: float, activations: float) -> dict[str, float]:
    """Bytes to add to rank r's memory (priced at MUON_MATRIX_BYTES for every parameter): the
    AdamW part's extra state ("optimizer"), and the step's buffers where they exceed the
    activations, which are freed by then ("optimizer_step")."""
    dense, expert, adamw = _shards(w, r, profile, L)
    largest = max((li.in_features * li.out_features for i in w.layers for li in blocks[i].linears), default=0)
    step = muon_step_bytes(dense + expert, largest)
    return {"optimizer": muon_state_extra_bytes(adamw, adam_bytes), "optimizer_step": max(0.0, step - activations)}


def muon_rank_time(w, r: int, profile, L, cluster, *, dense_group: Group, expert_group: Group,
                   matmul_flops_s: float) -> tuple[float, float, float]:
    """(exchange seconds, of them exposed, Newton-Schulz seconds) of rank r's Muon step: the
    gradient exchange is exposed, the update exchange only where the next forward (w.t_f, one
    micro-batch over the rank's layers) cannot hide it; FSDP (a sharded optimizer) prefetches one
    layer ahead."""
    dense, expert, _ = _shards(w, r, profile, L)
    one = muon_comm_time(dense, expert, dense_group, expert_group if L.zero >= 1 else Group(1, 1, 1), cluster)
    ahead = 1 if L.zero >= 1 and max(1, L.shard) > 1 else 0
    return 2 * one, one + muon_update_exposed(one, w.t_f, len(w.layers), ahead), \
        muon_ns_flops(dense + expert, profile.hidden) / matmul_flops_s

"""The contract between planner, cost model and runtime at the scale plans are made for: with
torch's fake process group, `parallelize` runs real plans at their real world size in one
process on the meta device, and the parameters each rank then holds must be what the cost
model charged that rank for (its optimizer state: fp32 master + Adam moments per held
parameter), within 5%. Ranks 0 and world-1 are checked (first and last pipeline stage). The
cases are planned and checked in two processes side by side (planning is CPU-bound and
single-threaded); each test reads its case's rows.

The same processes measure what one micro-batch's forward keeps for backward on a rank
(activations, logits; fake_world.kept_for_backward) against what the estimate charges
(fake_world.charged_for_backward); see docs/runtime.md, "Activation and logits memory per rank"."""

from __future__ import annotations

import pytest

import fake_world
import meshplan as mp

CASES = [
    ("llama3-70b", 8, 8192, 512),          # 64 ranks
    ("llama3-70b", 64, 8192, 1024),        # 512 ranks
    ("llama3-405b", 256, 8192, 2048),      # 2048 ranks
    ("qwen3-235b-a22b", 32, 4096, 1024),   # 256 ranks, expert parallel
    ("deepseek-v3", 32, 4096, 1024),       # 256 ranks, expert parallel
]


# what one micro-batch's forward keeps for backward (fake_world.kept_for_backward, meta device)
# against what the estimate charges per micro-batch (fake_world.charged_for_backward), at real
# scale where activations and logits dominate memory: (model, nodes, seq_len, global_batch,
# fixed layout keys, rank). Every case's logits are vocab-parallel (tp > 1), which runs the same
# on every device; at tp = 1 the plan prices the fused linear + cross-entropy kernel, which the
# CPU build runs eagerly.
MEMORY_CASES = [
    # TP8 + SP at 128k, one data-parallel rank (mixed precision by autocast), 16 layers recomputed
    ("memory", "llama3-8b", 1, 131072, 8, (("dp", 1), ("tp", 8)), 0),
    # TP8 + SP, 4 pipeline ranks, selective recompute, FSDP2 over dp=2: the last stage (logits)
    ("memory", "llama3-70b", 8, 8192, 512, (("tp", 8), ("pp", 4), ("recompute", "selective")), -1),
    # ring CP over 2 ranks x TP8 at 128k
    ("memory", "llama3-8b", 2, 131072, 16, (("cp", 2), ("tp", 8)), 0),
    # FSDP2 (ZeRO-3) over dp=4 x TP2
    ("memory", "llama3-8b", 1, 8192, 64, (("tp", 2), ("pp", 1), ("zero", 3)), 0),
]


def _measure_case(case) -> dict:
    _, model, nodes, seq_len, global_batch, fixed, rank = case
    return fake_world.measure(model, mp.Cluster.preset("dgx-h100", nodes=nodes), seq_len=seq_len,
                              global_batch=global_batch, fixed=dict(fixed), rank=rank)


def _check_case(case) -> list[dict]:
    if case[0] == "memory":
        return _measure_case(case)
    model, nodes, seq_len, global_batch = case
    # DeepSeek-V3 with its MTP depth: the last rank holds the MTP block, experts sharded by EP
    return fake_world.check(model, mp.Cluster.preset("dgx-h100", nodes=nodes), seq_len=seq_len,
                            global_batch=global_batch)


@pytest.fixture(scope="module")
def contract_rows():
    from worlds import in_processes
    cases = CASES + MEMORY_CASES
    return dict(zip(cases, in_processes(_check_case, cases)))


@pytest.mark.slow
@pytest.mark.parametrize("model, nodes, seq_len, global_batch", CASES)
def test_rank_holds_what_the_cost_model_charged(contract_rows, model, nodes, seq_len, global_batch):
    r = contract_rows[(model, nodes, seq_len, global_batch)]
    assert "error" not in r, f"{r['error']}\n{r['tb']}"
    rows = r["ok"]
    for row in rows:
        assert row["error"] <= 0.05, row
    if model in ("qwen3-235b-a22b", "deepseek-v3"):
        assert " ep" in rows[0]["layout"] and "ep1 " not in rows[0]["layout"] + " ", rows[0]


def _memory_row(contract_rows, case):
    r = contract_rows[case]
    assert "error" not in r, f"{r['error']}\n{r['tb']}"
    return r["ok"]


@pytest.mark.slow
@pytest.mark.parametrize("case", MEMORY_CASES, ids=lambda c: f"{c[1]}-{c[3]}-{dict(c[5])}")
def test_logits_are_what_the_cost_model_charged(contract_rows, case):
    """The logits tensor the loss sees plus what the loss keeps (vocab-parallel: its fp32 softmax
    slice) on the last stage, against head_activation_bytes: bf16 logits + fp32 softmax, / tp."""
    row = _memory_row(contract_rows, case)
    kept, charged = row["kept"], row["charged"]
    if not charged["logits"]:
        assert kept["logits"] == 0, row
        return
    assert abs(kept["logits"] - charged["logits"]) <= 0.10 * charged["logits"], row


# where the runtime and the plan's charge part by more than 10%, per case (docs/runtime.md,
# "Activation and logits memory per rank", says why): the measured ratio, expected to fail until
# the cost model or the runtime closes it; moving more than 5% from it either way is a change to
# explain. None today: every case must hold within 10% (the selective case since the meshplan stack
# prices its selective as the runtime's checkpointing runs it, ir.stack.Stack.selective_sac).
KNOWN_GAP: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("case", MEMORY_CASES, ids=lambda c: f"{c[1]}-{c[3]}-{dict(c[5])}")
def test_activations_are_what_the_cost_model_charged(contract_rows, case):
    """One micro-batch's forward on the rank keeps (every stage chunk it holds) what the estimate
    charges per micro-batch: (activations - logits - one recomputed layer) / micro-batches in flight,
    within 10%; or, for a case with a known gap, that gap (within 5% of it)."""
    row = _memory_row(contract_rows, case)
    ratio = row["kept"]["activations"] / row["charged"]["per_mb"]
    if abs(ratio - 1) <= 0.10:
        return
    assert case in KNOWN_GAP, (f"the runtime keeps {ratio:.3f}x the activations the plan charges; "
                               "it must be within 10%", row)
    assert abs(ratio / KNOWN_GAP[case] - 1) <= 0.05, (
        f"the runtime keeps {ratio:.3f}x the activations the plan charges, not the known {KNOWN_GAP[case]}x", row)
    pytest.xfail(f"the runtime keeps {ratio:.2f}x the activations the plan charges (docs/runtime.md, "
                 "'Activation and logits memory per rank')")


@pytest.mark.slow
def test_ring_attention_holds_no_score_block_at_128k(contract_rows):
    """Ring CP at 128k: no tensor of the rank's forward is as large as one (query chunk, key chunk)
    block of fp32 scores, let alone the rank's queries against every key."""
    case = MEMORY_CASES[2]
    row = _memory_row(contract_rows, case)
    cp, tp, seq = 2, 8, case[3]
    heads = 32 // tp                              # llama3-8b's query heads on one TP rank
    block = 4 * heads * (seq // (2 * cp)) ** 2
    assert 0 < row["kept"]["largest_in_blocks"] < block / 8, (row["kept"]["largest_in_blocks"], block)


def test_meta_measurement_keeps_what_a_real_cpu_forward_keeps():
    """The meta stand-ins (autocast's casts, the CPU flash kernel for attention) keep, byte for
    byte, what a real forward under torch.autocast on the CPU keeps (grouped K/V heads, bf16)."""
    import torch
    torch.manual_seed(0)
    real = mp.models.build("tiny-llama", device="cpu", seq_len=256)
    real.init_weights()
    ids = torch.randint(0, real.config.vocab, (2, 256))
    kept = fake_world.forward_kept(real, ids, torch.bfloat16)
    meta = fake_world.forward_kept(mp.models.build("tiny-llama", device="meta", seq_len=256), ids.to("meta"),
                                   torch.bfloat16)
    assert real.config.kv_heads < real.config.heads and kept > 0
    assert meta == kept


def test_sequence_parallel_keeps_the_shard_for_backward(monkeypatch):
    """TP2 + SP (meta device, fake process group): each block's attention and feed-forward keep the
    sequence shard of their gathered input for backward (runtime/sp_saved.py), not the gathered
    whole-sequence tensor: a block keeps 2 x (whole - shard) bytes less than with the gathered
    tensor saved (bf16 under autocast: one cast of the shared input)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import numerics
    from meshplan.runtime import sp_saved
    from meshplan.runtime.parallel import parallelize
    seq, tp = 64, 2
    plan = numerics.plan_for("tiny-llama", tp, (("dp", 1), ("mbs", 2), ("pp", 1), ("sp", True), ("tp", tp)), seq, 4)
    assert plan.sequence_parallel and plan.layout.recompute == "none"

    def per_block(keep: bool) -> dict:
        if not keep:
            monkeypatch.setattr(sp_saved.ShardKeeper, "gathered", lambda self, shard, whole: None)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
        try:
            pm = parallelize(mp.models.build("tiny-llama", device="meta", seq_len=seq), plan, materialize=False)
            return fake_world.kept_for_backward(pm, plan)["by_block"]
        finally:
            dist.destroy_process_group()
    kept, gathered = per_block(True), per_block(False)
    whole = plan.layout.mbs * seq * mp.models.build("tiny-llama", device="meta", seq_len=seq).config.hidden * 2
    blocks = [k for k in kept if k.startswith("layers.")]
    assert len(blocks) == 4 and kept["stage"] == gathered["stage"]
    for b in blocks:
        assert gathered[b] - kept[b] == 2 * (whole - whole // tp), (b, kept[b], gathered[b])


def test_runtime_pattern_placements_match_single_device():
    """When the sharding ILP's dataflow is one the runtime does not run, the planner falls back to
    the runtime's role-based pattern (meshplan.ir.support.TP_ROLE_PLACEMENT, attention on local
    heads); that fallback must itself be exact: TP2 + SP against the single-device model."""
    import dataclasses

    import numerics
    from meshplan.planner.build import placements_for
    from meshplan.train.spawn import run_ranks
    seq, batch = 32, 8
    plan = numerics.plan_for("tiny-llama", 2, (("sp", True), ("tp", 2)), seq, batch)
    prof = mp.profile(mp.models.build("tiny-llama", seq_len=seq, device="meta"), seq_len=seq)
    role_based = placements_for(prof, plan.layout)          # no cluster: the role path
    assert any(v == "heads" for v in role_based.values()) and role_based != plan.placements
    case = dict(model="tiny-llama", seq_len=seq, global_batch=batch,
                plan=dataclasses.replace(plan, placements=role_based))
    for r in run_ranks(2, numerics.equivalence, case, timeout_s=180):
        assert "error" not in r, r


def test_one_rank_under_autocast_keeps_a_bf16_stream_and_only_the_kernels_inputs():
    """Mixed precision by autocast (one data-parallel rank, no FSDP): the embeddings' output is
    cast to bf16 (ddp.cast_embeddings), so the residual stream and what the norms keep are bf16;
    the norms and SwiGLU keep only their inputs (kernels.lean), no fp32 activation-sized tensor
    is saved for backward. The step computes what the single-device model computes under
    torch.autocast with its embedding's output in bf16 (loss and gradients, bf16 tolerances)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import numerics
    from meshplan.runtime.parallel import parallelize
    seq, batch = 32, 4
    plan = numerics.plan_for("tiny-llama", 1, (("dp", 1), ("pp", 1), ("tp", 1)), seq, batch)
    model = numerics.build_model("tiny-llama", seq_len=seq)
    ref = copy.deepcopy(model)
    x, y = numerics.batch(batch, seq)
    saved: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        pm = parallelize(model, plan, compute_dtype=torch.bfloat16, fused_kernels=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = pm.forward_backward(x, y)
        grads = pm.full_grads()
    finally:
        dist.destroy_process_group()
    cfg = ref.config
    norms = [n for n, m in ref.named_modules() if isinstance(m, torch.nn.RMSNorm)]
    assert pm.autocast_dtype == torch.bfloat16 and set(norms) <= set(pm.lean_modules), pm.lean_modules
    wide = [s for s in saved if s[0] == torch.float32 and len(s[1]) > 1 and s[1][-1] in (cfg.hidden, cfg.ffn_hidden)
            and s[1][0] in (batch, batch * seq)]
    assert not wide, f"fp32 activations saved for backward: {wide}"
    assert (torch.bfloat16, (batch, seq, cfg.hidden)) in saved
    ref.tok_embeddings.register_forward_hook(lambda m, a, out: out.to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = numerics.reference_loss(ref, x, y)
    ref_loss.backward()
    torch.testing.assert_close(loss, float(ref_loss.detach()), rtol=2e-2, atol=2e-2)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=5e-2, atol=5e-3, msg=lambda m, n=n: f"grad {n}: {m}")

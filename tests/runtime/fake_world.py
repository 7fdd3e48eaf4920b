"""Run `parallelize` for a real plan at its real world size in one process (torch's fake process
group: collectives are no-ops, the model stays on the meta device), and count what one rank holds."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.utils._python_dispatch
import torch.utils._pytree


def local_state(model, plan, rank: int) -> dict:
    """Parameters this rank holds after `parallelize` (elements), and its pipeline rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplan.runtime.parallel import parallelize
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        pm = parallelize(model, plan, materialize=False)
        held = 0
        for st in pm.stages:
            for p in st.parameters():
                held += (p.to_local() if hasattr(p, "to_local") else p).numel()
        pp_rank = pm.mesh["pp"].get_local_rank()
    finally:
        dist.destroy_process_group()
    return {"params": held, "pp_rank": pp_rank}


def predicted_optimizer_bytes(plan, pp_rank: int) -> float:
    """The cost model's optimizer state (fp32 master + Adam moments) on pipeline rank `pp_rank`."""
    return plan.estimate.memory_by_stage[pp_rank]["optimizer"] * 2**30


def optimizer_bytes_per_param(plan) -> int:
    return 4 + 2 * (2 if plan.layout.optimizer_dtype == "bf16" else 4)


def check(model_name: str, cluster, *, seq_len: int, global_batch: int, ranks=(0, -1), fixed=None,
          tol: float = 0.05, overrides: dict | None = None) -> list[dict]:
    import meshplan as mp
    overrides = overrides or {}
    model = mp.models.build(model_name, device="meta", **overrides)
    plan = mp.plan(model, cluster, seq_len=seq_len, global_batch=global_batch, fixed=fixed)
    out = []
    for r in ranks:
        rank = r % plan.world_size
        got = local_state(mp.models.build(model_name, device="meta", **overrides), plan, rank)
        runtime = got["params"] * optimizer_bytes_per_param(plan)
        predicted = predicted_optimizer_bytes(plan, got["pp_rank"])
        out.append(dict(model=model_name, world=plan.world_size, layout=plan.layout.short(),
                        rank=rank, runtime_gb=runtime / 1e9, predicted_gb=predicted / 1e9,
                        error=abs(runtime - predicted) / predicted))
    return out


# ---- the plan matrix: every plan the planner returns must be accepted by the runtime ---------
def hf_model(kind: str, *, device: str = "meta", seq_len: int = 4096):
    """Small transformers models of the families users bring, built from configs (no download)."""
    import transformers as tf
    common = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
                  max_position_embeddings=seq_len, tie_word_embeddings=False, pad_token_id=0)
    cfgs = {
        "hf-llama": lambda: tf.LlamaConfig(intermediate_size=384, num_key_value_heads=4, **common),
        "hf-qwen2": lambda: tf.Qwen2Config(intermediate_size=384, num_key_value_heads=4, **common),
        "hf-mistral": lambda: tf.MistralConfig(intermediate_size=384, num_key_value_heads=4, **common),
        "hf-phi3": lambda: tf.Phi3Config(intermediate_size=384, num_key_value_heads=8, **common),
        "hf-gpt2": lambda: tf.GPT2Config(vocab_size=512, n_embd=128, n_layer=4, n_head=8, n_positions=seq_len,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "hf-mixtral": lambda: tf.MixtralConfig(intermediate_size=256, num_key_value_heads=4, num_local_experts=4,
                                               num_experts_per_tok=2, **common),
        "hf-qwen2-moe": lambda: tf.Qwen2MoeConfig(intermediate_size=256, moe_intermediate_size=128,
                                                  shared_expert_intermediate_size=256, num_experts=4,
                                                  num_experts_per_tok=2, num_key_value_heads=4, **common),
    }
    cfg = cfgs[kind]()
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = False
    return model


def user_model(device: str = "meta"):
    """examples/my_model.py: a user's GPT with a fused QKV projection."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "examples" / "my_model.py"
    spec = importlib.util.spec_from_file_location("my_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with torch.device(device):
        return mod.build()


def build(kind: str, seq_len: int):
    import meshplan as mp
    if kind.startswith("hf-"):
        return hf_model(kind, seq_len=seq_len)
    if kind == "my_model":
        return user_model()
    return mp.models.build(kind, device="meta", **({"seq_len": seq_len} if kind.startswith("tiny") else {}))


def accepted(kind: str, cluster, *, seq_len: int, global_batch: int) -> dict:
    """Plan `kind` for `cluster`; run `parallelize` for rank 0 at the plan's world size (fake
    process group, meta device). {"status": "accepted"|"no plan"|"refused", ...}."""
    import meshplan as mp
    from meshplan.errors import MeshplanError
    try:
        plan = mp.plan(build(kind, seq_len), cluster, seq_len=seq_len, global_batch=global_batch)
    except MeshplanError as e:        # nothing fits / nothing runs: a clean answer, not a contract break
        return {"status": "no plan", "why": str(e)[:200]}
    layout = plan.layout.short()
    try:
        local_state(build(kind, seq_len), plan, 0)
    except Exception as e:  # noqa: BLE001 - any refusal or crash is a contract break
        return {"status": "refused", "layout": layout, "why": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"status": "accepted", "layout": layout}


# ---- small plans run a real training step on gloo ---------------------------------------------

def step_model(kind: str, seq_len: int):
    """`kind` built on the CPU with seeded initial weights (the same on every rank and in the test)."""
    import meshplan as mp
    torch.manual_seed(0)
    if kind.startswith("hf-"):
        return hf_model(kind, device="cpu", seq_len=seq_len)
    if kind == "my_model":
        return user_model("cpu")
    model = mp.models.build(kind, device="cpu", seq_len=seq_len)
    model.init_weights()
    return model


def step_run(rank: int, world: int, cases: list) -> dict:
    """One forward/backward of each (name, kind, plan, seq_len, x, y) case on this group; losses by
    name (a case that raised: {"error", "tb"}, see worlds.each_case)."""
    from meshplan.runtime.parallel import parallelize
    from worlds import each_case

    def one(name, case):
        _, kind, plan, seq_len, x, y = case
        pm = parallelize(step_model(kind, seq_len), plan, compute_dtype=None, fused_kernels=False)
        return pm.forward_backward(x, y)
    return each_case(rank, {c[0]: c for c in cases}, one)


if __name__ == "__main__":      # the full matrix, one JSON line per case and a summary
    import collections
    import json
    import time

    import meshplan as mp
    models = ["tiny-llama", "tiny-gpt", "tiny-moe", "llama3-8b", "llama3-70b", "mixtral-8x7b", "hf-llama",
              "hf-qwen2", "hf-mistral", "hf-phi3", "hf-gpt2", "hf-mixtral", "hf-qwen2-moe", "my_model"]
    clusters = {"local-cpu-4": lambda: mp.Cluster.preset("local-cpu"),
                "local-cpu-8": lambda: mp.Cluster.preset("local-cpu", nproc=8),
                "dgx-h100x1": lambda: mp.Cluster.preset("dgx-h100", nodes=1),
                "dgx-h100x8": lambda: mp.Cluster.preset("dgx-h100", nodes=8),
                "dgx-h100x64": lambda: mp.Cluster.preset("dgx-h100", nodes=64),
                "gb200-nvl72": lambda: mp.Cluster.preset("gb200-nvl72", nodes=18)}
    counts = collections.Counter()
    for m in models:
        for name, make in clusters.items():
            for seq in (4096, 32768, 131072):
                t0 = time.time()
                cl = make()
                r = accepted(m, cl, seq_len=seq, global_batch=max(64, cl.num_gpus))
                counts[r["status"]] += 1
                print(json.dumps(dict(model=m, cluster=name, seq=seq, s=round(time.time() - t0, 1), **r)), flush=True)
    print(f"{sum(counts.values())} cases: {dict(counts)}")


# ---- what one rank's forward keeps for backward, measured on the meta device ----------------------
# The storages every op of one micro-batch's forward creates are recorded (a dispatch mode, weak
# references only); what is still alive after the forward and the loss is what the rank holds
# until that micro-batch's backward: tensors autograd saved, checkpoint inputs, selective
# checkpointing's saved outputs, each pipeline chunk's output, the logits. Each storage is counted
# once (views share it) at its size after the forward (FSDP2 frees a resharded weight by resizing
# its storage to 0). Parameters and their compute copies are weights, not activations.
# One micro-batch is measured; the cost model charges per micro-batch times the micro-batches in
# flight at the rank's peak (charged_for_backward splits its figure the same way).
#
# What the CPU build runs that the meta device does not, stood in for while measuring:
# - autocast: torch.autocast("cpu") does not cast meta tensors, so under the runtime's autocast
#   path (no FSDP: pm.autocast_dtype) the matmul-family ops get their floating inputs cast to
#   the compute dtype here, as autocast casts them (everything else runs in the dtype it gets);
# - fused attention: scaled_dot_product_attention on meta takes the math path (it materialises
#   the scores); here it runs aten's CPU flash kernel, what the CPU build dispatches to (it keeps
#   q, k, v, the output and the fp32 log-sum-exp, as FlashAttention does on the GPU). The ring
#   attention of CP refuses meta tensors at its device check and the fake group cannot send meta
#   tensors: its autograd Function (the runtime's own) runs with bare receive buffers;
# - FSDP2 gathers through its device's streams into buffers on its mesh's device (the CPU): its
#   buffers are put on meta and its streams are the CPU's (_fsdp_on_meta).
# It measures the eager runtime: where the runtime compiles blocks (CUDA), inductor's partitioner
# chooses what a block saves.

def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Weak references to the storage of every tensor an op creates, with the module (block,
    head, loss) running when it was created; the largest single output (a transient's size)."""

    def __init__(self, params: set[int] = frozenset()):
        super().__init__()
        self.params = params                    # storages of the parameters
        self.copies: set[int] = set()           # storages of casts of parameters (autocast's copies)
        self.created: dict[int, tuple] = {}     # StorageImpl address -> (weak ref, where)
        self.where = "stage"
        self.largest: dict[str, int] = {}       # where -> bytes of the largest tensor one op created

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            # a data-dependent check (the loss's label validation): meta tensors have no values;
            # the measurement's labels are valid, so the check's "nothing wrong" answer
            return False if args[0].dtype == torch.bool else 0
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and _local(args[0]).untyped_storage()._cdata in self.params:
            self.copies.add(_local(out).untyped_storage()._cdata)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = _local(t).untyped_storage()
                self.largest[self.where] = max(self.largest.get(self.where, 0), s.nbytes())
                if s._cdata not in self.created:
                    self.created[s._cdata] = (s._weak_ref(), self.where)
        return out

    def alive(self, exclude: set[int]) -> dict[str, int]:
        """Bytes still held, by where they were created (storages in `exclude` left out)."""
        held: dict[str, int] = {}
        for key, (ref, where) in self.created.items():
            s = torch.UntypedStorage._new_with_weak_ptr(ref)
            if s is not None and key not in exclude:
                held[where] = held.get(where, 0) + s.nbytes()
        return held

    def release(self) -> None:
        for ref, _ in self.created.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self.created.clear()


_LOW_PRECISION = None


def _low_precision_ops():
    """The autocast lower-precision ops a transformer's forward calls (torch.autocast's CUDA and
    CPU lists agree on these)."""
    global _LOW_PRECISION
    if _LOW_PRECISION is None:
        import torch.nn.functional as F
        _LOW_PRECISION = {F.linear, torch.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm, torch.addmm,
                          torch.baddbmm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm,
                          F.scaled_dot_product_attention}
    return _LOW_PRECISION


class _MetaStandIns(torch.overrides.TorchFunctionMode):
    """Autocast's casts (dtype None: no autocast) and the CPU flash kernel for attention, on meta."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def _cast(self, t):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != self.dtype):
            return t
        return t.to(self.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import torch.nn.functional as F
        kwargs = kwargs or {}
        if self.dtype is not None and func in _low_precision_ops():
            args = tuple(self._cast(a) for a in args)
            kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        if func is F.scaled_dot_product_attention and args[0].device.type == "meta":
            from meshplan.runtime.context_parallel import _sdpa_args
            q, k, v, mask, dropout_p, is_causal, scale, _ = _sdpa_args(*args, **kwargs)
            if mask is None:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, dropout_p, is_causal, scale=scale)[0]
        return func(*args, **kwargs)


def _meta_ring_attention(q, k, v, group, *, is_causal=True, scale=None, enable_gqa=False):
    from meshplan.runtime import context_parallel as cp
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return cp._RingAttention.apply(q, k, v, cp._Ring(group), bool(is_causal), float(scale))


def _meta_block_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _meta_start_shift(self, t, tag):
    # the fake group has no meta backend for send/receive: the receive buffer is what is measured
    return torch.empty_like(t.contiguous()), []


@contextlib.contextmanager
def ring_on_meta():
    """The runtime's ring attention on meta tensors: its autograd Function as is, each block on
    the CPU flash kernel's meta implementation, the K/V shifts as bare receive buffers."""
    from unittest import mock

    from meshplan.runtime import context_parallel as cp
    with mock.patch.object(cp, "ring_attention", _meta_ring_attention), \
            mock.patch.object(cp, "_block_forward", _meta_block_forward), \
            mock.patch.object(cp._Ring, "start_shift", _meta_start_shift):
        yield


def kept_for_backward(pm, plan) -> dict:
    """Bytes one micro-batch's forward on this rank keeps until its backward (meta device, fake
    process group: nothing is allocated). Every local stage runs (a later stage gets the hidden
    state its predecessor sends: (mbs, seq/cp [/tp under SP], hidden) in the parameters' dtype); the
    last stage's logits go through the runtime's own loss (`ParallelModel._summed_loss`).
    {"activations": bytes kept by the stages' forward, "logits": the logits tensor plus what the
    loss keeps, "by_block": activations by block FQN ("stage": outside any block), "largest_op":
    the largest tensor one op created (a transient's size), "largest_in_blocks": the same inside
    the transformer blocks, "weights": compute copies of parameters kept after the forward
    (autocast's casts, FSDP2's gathered weights where it does not reshard after forward)}."""
    L, mesh = plan.layout, plan.mesh
    tokens = plan.seq_len // mesh.get("cp", 1)
    param_keys = {_local(p).untyped_storage()._cdata for st in pm.stages for p in st.parameters()}
    rec = _Recorder(param_keys)
    stand_ins = _MetaStandIns(pm.autocast_dtype)
    hooks = []
    buffer_keys: set[int] = set()     # the model's state (rotary tables), not activations
    for st in pm.stages:
        for mod in st.modules():        # derived tables (rotary) are built on the host: meta here
            for k, b in mod._buffers.items():
                if b is not None and b.device.type != "meta":
                    mod._buffers[k] = b.to("meta")
                if mod._buffers[k] is not None:
                    buffer_keys.add(_local(mod._buffers[k]).untyped_storage()._cdata)
        blocks = st.layers.named_children() if isinstance(getattr(st, "layers", None), torch.nn.Module) else ()
        for name, mod in blocks:
            hooks.append(mod.register_forward_pre_hook(functools.partial(_enter, rec, f"layers.{name}")))
            hooks.append(mod.register_forward_hook(functools.partial(_leave, rec)))
    out, sent = None, []
    try:
        with _fsdp_on_meta(pm), ring_on_meta(), rec:
            for spec, st in zip(pm.specs, pm.stages):
                if spec.is_first:
                    x = torch.zeros(L.mbs, tokens, dtype=torch.long, device="meta")
                else:
                    # the residual stream crosses stages in the compute dtype (FSDP2's parameters,
                    # or autocast's with the embeddings cast: ddp.cast_embeddings)
                    rows = tokens // (L.tp if plan.sequence_parallel and L.tp > 1 else 1)
                    dtype = _stream_dtype(pm, st)
                    x = torch.zeros(L.mbs, rows, _hidden(st), dtype=dtype, device="meta", requires_grad=True)
                rec.where = "stage"
                with stand_ins:
                    out = st(x)
                out = _local(out[0] if isinstance(out, tuple) else out)
                if not spec.is_last:
                    # held until this chunk's backward (the schedule keeps each chunk's output): it
                    # keeps the chunk's autograd graph, and with it what the chunk saved, alive
                    sent.append(out)
                    out = None
            loss = None
            if out is not None:
                rec.where = "loss"
                y = torch.zeros(L.mbs, tokens, dtype=torch.long, device="meta")
                loss = pm._summed_loss(out, y)
        logits_key = _local(out).untyped_storage()._cdata if out is not None else None
        exclude = param_keys | rec.copies | buffer_keys
        exclude |= {_local(p).untyped_storage()._cdata for st in pm.stages for p in st.parameters()}
        held = rec.alive(exclude | ({logits_key} if logits_key is not None else set()))
        logits = (_local(out).untyped_storage().nbytes() + held.pop("loss", 0)) if out is not None else 0
        weights = sum(rec.alive(buffer_keys).values()) - sum(held.values()) - logits
        in_blocks = [v for k, v in rec.largest.items() if k not in ("stage", "loss")]
        result = {"activations": sum(held.values()), "logits": logits, "by_block": held,
                  "largest_op": max(rec.largest.values()), "largest_in_blocks": max(in_blocks, default=0),
                  "weights": max(0, weights)}
        del loss, out, sent
    finally:
        for h in hooks:
            h.remove()
        rec.release()
    return result


def _stream_dtype(pm, stage) -> torch.dtype:
    """The dtype of the hidden state a stage receives: autocast's, FSDP2's parameter dtype, or the
    parameters' own."""
    if pm.autocast_dtype is not None:
        return pm.autocast_dtype
    for mod in stage.modules():
        state = mod._get_fsdp_state() if hasattr(mod, "_get_fsdp_state") else None
        policy = getattr(state, "_mp_policy", None)
        if policy is not None and policy.param_dtype is not None:
            return policy.param_dtype
    return next(p for p in stage.parameters() if p.is_floating_point()).dtype


def forward_kept(model, input_ids, dtype) -> int:
    """Bytes one forward of a single-device `model` keeps for backward, its output and parameter
    copies left out: under torch.autocast(dtype) for CPU tensors, with the meta stand-ins
    (autocast's casts, the CPU flash kernel) for meta tensors. The check of the stand-ins: both
    must give the same bytes."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    rec = _Recorder(params)
    meta = input_ids.device.type == "meta"
    ctx = _MetaStandIns(dtype) if meta else torch.autocast("cpu", dtype=dtype)
    try:
        with rec, ctx:
            out = model(input_ids)
        kept = sum(rec.alive(params | rec.copies | {out.untyped_storage()._cdata}).values())
        del out
    finally:
        rec.release()
    return kept


def _enter(rec, name, _module, _args):
    rec.where = name


def _leave(rec, _module, _args, _out):
    rec.where = "stage"


def _hidden(stage) -> int:
    cfg = getattr(stage, "config", None)
    return int(getattr(cfg, "hidden", None) or cfg.hidden_size)


def charged_for_backward(plan, profile, cluster, pp_rank: int) -> dict:
    """What the plan's estimate charges pipeline rank `pp_rank` for activations and logits (bytes),
    split as the cost model composes it (cost_models.estimate._activation_bytes):
    activations = per_mb x held + largest_full + logits, with `held` the micro-batches in flight
    at the rank's peak (cost_models.pipeline.in_flight), `largest_full` one fully recomputed
    layer rebuilt in backward (a transient of the backward, not kept by any forward) and `logits`
    the output layer + loss of one micro-batch on the last stage (head_activation_bytes)."""
    from meshplan.cost_models.estimate import layer_table
    from meshplan.cost_models.pipeline import in_flight
    from meshplan.cost_models.ranks import head_activation_bytes, rank_layers
    from meshplan.ir.estimate import GB
    L = plan.layout
    tokens = L.mbs * plan.seq_len / L.cp
    held = in_flight(L.schedule, plan.num_microbatches, L.pp, L.vp, pp_rank)
    layers = rank_layers(L.stage_layers or [profile.num_layers // L.pp] * L.pp, L.pp)[pp_rank]
    table = layer_table(profile, cluster, L, seq_len=plan.seq_len, stack=plan.estimate.stack or None)
    full = [i for j, i in enumerate(layers) if L.recompute_policy(j) == "full"]
    largest_full = max((table.act(i, "none") for i in full), default=0.0)
    logits = head_activation_bytes(profile, tokens, L.tp) if pp_rank == L.pp - 1 else 0.0
    total = plan.estimate.memory_by_stage[pp_rank]["activations"] * GB
    return {"total": total, "held": held, "largest_full": largest_full, "logits": logits,
            "per_mb": (total - logits - largest_full) / held}


def measure(model_name: str, cluster, *, seq_len: int, global_batch: int, fixed=None, rank: int = 0) -> dict:
    """Plan `model_name` (built for `seq_len`), parallelize rank `rank` at the plan's world size on
    the meta device and compare what one micro-batch's forward keeps (kept_for_backward) with
    what the estimate charges that rank per micro-batch (charged_for_backward). Bytes."""
    import meshplan as mp
    from meshplan.runtime.parallel import parallelize
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def build():
        return mp.models.build(model_name, device="meta", seq_len=seq_len)

    plan = mp.plan(build(), cluster, seq_len=seq_len, global_batch=global_batch, fixed=fixed)
    rank %= plan.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        pm = parallelize(build(), plan, materialize=False)
        pp_rank = pm.mesh["pp"].get_local_rank()
        params = sum(_local(p).numel() for st in pm.stages for p in st.parameters())
        kept = kept_for_backward(pm, plan)
    finally:
        dist.destroy_process_group()
    charged = charged_for_backward(plan, mp.profile(build(), seq_len=seq_len), cluster, pp_rank)
    kept.pop("by_block")
    return {"model": model_name, "layout": plan.layout.short(), "world": plan.world_size, "rank": rank,
            "pp_rank": pp_rank, "params": params, "memory": dict(plan.estimate.memory_by_stage[pp_rank]),
            "kept": kept, "charged": charged}


@contextlib.contextmanager
def _fsdp_on_meta(pm):
    """FSDP2 gathers into buffers on its mesh's device (the CPU here) through that device's
    streams, and refuses meta parameters at its first forward (a guard against training
    uninitialised weights). For the measurement its gather buffers are put on the meta device and
    its streams are the CPU's (no-ops), so the gathers and frees run as they do on a GPU."""
    from unittest import mock

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group
    meta = torch.device("meta")
    for st in pm.stages:
        for mod in st.modules():
            state = mod._get_fsdp_state() if hasattr(mod, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None) if state is not None else None
            if group is not None:
                group.device = meta
                for fp in group.fsdp_params:
                    fp.device = meta
    handle = _fsdp_collectives._get_device_handle

    def cpu_for_meta(device_type: str = "cuda"):
        return handle("cpu" if device_type == "meta" else device_type)

    with mock.patch.object(_fsdp_param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None), \
            mock.patch.object(_fsdp_collectives, "_get_device_handle", cpu_for_meta), \
            mock.patch.object(_fsdp_param_group, "_get_device_handle", cpu_for_meta):
        yield

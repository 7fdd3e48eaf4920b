"""Check the cost model against measured runs (meshplan/data/published_runs.csv).

For each row meshplan can express: build the model (meshplan.models on the meta device, traced;
or the analytic profile with `traced=False`), the cluster and the published layout, run
`estimate`, convert the prediction to the row's own metric and FLOP convention, and compare.

Normalisation rules (data/README.md), applied per SOURCE, never per row:
- Megatron SC'21 (Narayanan et al.; Table 1 and both halves of Table 2, PTD-P and ZeRO-3), MT-NLG,
  BLOOM: "TFLOP/s" is Eq. 3 of SC'21, 96*B*s*L*h^2*(1 + s/6h + V/16Lh), which counts the recompute
  forward (hardware FLOPs). The paper computes its ZeRO-3 baselines with the same formula, so the
  DeepSpeed ZeRO-3 rows of Table 2 are converted with it too.
- Megatron-Core README (2024), NeMo 24.07: model FLOPs of Megatron's formula at that time, with
  core attention counted in full (not causal-halved).
- Megatron-MoE-ModelZoo (2025): Megatron's current formula, causal attention halved.
- Megatron-Bridge's GPT-OSS rows (25.11, 26.04.01): the count their TFLOP/s imply, every layer's
  attention full causal (the sliding window ignored) and the gated experts as two matrices
  (`_bridge_window_flops`).
- MosaicML llm-foundry MFU: 3*(2*params*s + 4*L*h*s^2) per sequence over the dense BF16 peak, where
  `params` is the model's NumParams (tied embedding counted once, learned position table included).
- Korthikanti et al.: measured step time, compared directly.
Unstated settings get the source's documented default: no SP and no flash attention before 2022
(SC'21, MT-NLG, BLOOM, Korthikanti "full" rows), micro-batch 1, vocabulary 51200 for Megatron GPT
rows without one, the distributed optimizer (zero=1) for NeMo / Megatron-Core 2024+, plain DDP
(zero=0) for 2021 Megatron; TP communication overlap (userbuffers) for NeMo 24.07, whose
performance recipes enable it on H100; an unstated recompute is full for pre-2022 Megatron (the only kind it had), otherwise the cheapest of none / selective / full that
fits by meshplan's own memory model; an unstated interleaving degree is 1, except SC'21 Table 1, whose micro-batch and interleaving
come from the paper's launch script (Megatron-LM examples/sc21/run_table_1.sh).
Stack mechanisms, per source: MosaicML's MPT benchmarks ran llm-foundry's Triton flash attention;
NeMo 1.x performance recipes reduce gradients in bf16
(distributed_fused_adam grad_sync_dtype: bf16); rows whose notes name DeepEP dispatch MoE tokens
with node deduplication; "FSDP on" in the Megatron-MoE-ModelZoo is Megatron-FSDP; DeepSpeed's 2021
ZeRO-3 gathers per sub-module, without flash attention and with full recompute (the only kind then);
2021 Megatron-LM (SC'21) and Megatron-DeepSpeed (MT-NLG, BLOOM) add every micro-batch's gradients into
the gradient buffer in a separate pass (no gradient-accumulation fusion, `stack_options`); a precision
cell naming an FP8 recipe ("fp8 (blockwise)") selects that recipe.
Rows that give no layout at all (strong-scaling summaries, OPT) cannot be expressed and are skipped.

Layering: this module sits with the cost model and imports only the model's own floor (meshplan.ir,
meshplan.cluster, meshplan.errors). Building a row's model is the caller's: `run_row` takes the
function that turns a model config into a ModelProfile (`profile_fn`) and the preset lookup that
fills fields a row leaves empty (`preset`); benchmarks/validate_published.py passes meshplan's
traced or analytic builders and meshplan.models.config.
"""

from __future__ import annotations

import csv
import hashlib
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from meshplan.cluster import Cluster
from meshplan.cluster.constants import EDR100_BUSBW_GB_S
from meshplan.cost_models.context import for_stack
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.flops import model_flops_per_step
from meshplan.errors import MeshplanError
from meshplan.ir.stack import Stack
from meshplan.ir.layout import Layout, split_layers
from meshplan.ir.precision import Precision
from meshplan.cost_models.published_configs import (BRIDGE_PERF_CONFIGS, BRIDGE_PERF_MODEL, NEMO_LAUNCHER_ATTN_KERNEL,
                                                     NEMO_LAUNCHER_CONFIGS)

__all__ = ["Row", "load_rows", "run_row", "RowResult", "split_of", "DEFAULT_CSV", "EQ3_FAMILIES", "stack_options", "row_cluster", "stack_of"]

# shipped with the package (meshplan/data, identical to the project's shared data folder)
DEFAULT_CSV = Path(__file__).resolve().parents[1] / "data" / "published_runs.csv"

_GPU = (("grand teton", "h100-sxm-96gb-500w"), ("gb200", "gb200"), ("a100", "a100-80gb"), ("h100", "h100-sxm"),
        ("h200", "h200"), ("b200", "b200"))
# model-name fragments -> meshplan preset supplying fields the CSV leaves empty (head_dim, vocab)
_PRESET_FILL = (("qwen3-235b", "qwen3-235b-a22b"), ("qwen3-30b", "qwen3-30b-a3b"),
                ("mixtral 8x22b", "mixtral-8x22b"), ("mixtral 8x7b", "mixtral-8x7b"),
                ("llama3-70b", "llama3-70b"), ("llama3-8b", "llama3-8b"), ("deepseek-v3", "deepseek-v3"),
                # the NeMo Llama 2 rows give no vocabulary: Llama 2's is 32000 (its tokenizer)
                ("llama2-7b", "llama2-7b"), ("llama2-13b", "llama2-13b"), ("llama2-70b", "llama2-70b"),
                # Megatron-Bridge's recipe names
                ("qwen3_30b_a3b", "qwen3-30b-a3b"), ("qwen3_235b_a22b", "qwen3-235b-a22b"),
                ("deepseekv3", "deepseek-v3"), ("llama3_70b", "llama3-70b"), ("llama3.1_405b", "llama3-405b"),
                ("llama3_8b", "llama3-8b"),
                ("llama 3.1 8b", "llama3-8b"), ("llama 3.1 70b", "llama3-70b"), ("llama 3.1 405b", "llama3-405b"),
                # GPT-OSS: sliding windows, sinks and attention biases come only from the preset
                ("gpt oss 120b", "gpt-oss-120b"), ("gpt-oss-120b", "gpt-oss-120b"), ("gpt oss 20b", "gpt-oss-20b"),
                ("gpt-oss-20b", "gpt-oss-20b"))


@dataclass
class Row:
    id: str
    source: str
    raw: dict[str, str]

    def get(self, key: str) -> str:
        return (self.raw.get(key) or "").strip()

    def num(self, key: str) -> int | None:
        v = self.get(key)
        try:
            return int(float(v)) if v else None
        except ValueError:
            return None

    @property
    def family(self) -> str:
        """Source family, which decides conventions."""
        i = self.id
        if "deepspeed" in self.get("zero").lower() and "zero-3" in self.get("zero").lower():
            # DeepSpeed's 2021 ZeRO-3 (SC'21 Table 2): a runtime meshplan does not model (see split_of)
            return "deepspeed-zero3"
        for prefix in ("megatron-sc21", "mcore-readme", "korthikanti", "bloom", "opt", "mtnlg", "nemo2407",
                       "nemo-longseq", "modelzoo", "mosaic", "torchtitan"):
            if i.startswith(prefix):
                return prefix
        if i.startswith("mb-"):
            return "megatron-bridge"
        return "other"


@dataclass
class RowResult:
    row: Row
    metric: str
    measured: float
    predicted: float | None = None
    skipped: str = ""
    fits: bool = True
    layout: dict[str, Any] = field(default_factory=dict)
    estimate: Any = None

    @property
    def error(self) -> float | None:
        if self.predicted is None:
            return None
        return (self.predicted - self.measured) / self.measured


def load_rows(path: Path | str = DEFAULT_CSV) -> list[Row]:
    with open(path, newline="") as f:
        return [Row(id=r["id"], source=r["source"], raw=r) for r in csv.DictReader(f)]


# Sources never used to fit constants (still estimated, converted with their source's convention
# and reported on their own line): DeepSpeed's 2021 ZeRO-3 (SC'21 Table 2). In every row each GPU
# runs one micro-batch per step; doubling the GPUs at a fixed global batch halves the compute per GPU
# but not the step time (175B: 66.7 s at 768 and at 1536 GPUs; 530B: 180 s at 1120, 184 s at 2240;
# Eq. 3 over the stated TFLOP/s), so the step is the parameter traffic (a gather for the forward,
# again for the recomputed forward and backward, a reduce-scatter: at least 3 x 2 bytes x params per
# GPU) at ~16-18 GB/s per GPU, below the 25 GB/s HDR NIC each A100 has, with little overlap.
# meshplan's ZeRO-3 collectives (NCCL rings over the 8 rails of a node, prefetched) move the same
# bytes at ~60-70 GB/s, so its predictions are 23-122% high; fitting overlap constants to these rows
# would distort every other.
NOT_FITTED = ("deepspeed-zero3",)


def split_of(row_id: str, family: str = "") -> str:
    """Deterministic fit/test split by a hash of the row id (about one third fit)."""
    if family in NOT_FITTED:
        return "test"
    return "fit" if int(hashlib.sha1(row_id.encode()).hexdigest(), 16) % 3 == 0 else "test"


def _gpu(row: Row) -> str | None:
    g = row.get("gpu").lower()
    if "96gb" in g and "500w" in g:
        return "h100-sxm-96gb-500w"      # torchtitan's power-capped HBM2e H100s
    for frag, gid in _GPU:
        if frag in g:
            return gid
    return None


# Network busbw per GPU where a source's cluster is not its GPU's usual server (cluster.gpus):
# BLOOM trained on Jean Zay, "8 GPUs per node Using NVLink 4 inter-gpu connects, 4 OmniPath links"
# (bigscience/bloom model card, Hardware), 100 Gb/s Omni-Path, so half a 100 Gb/s link per GPU where a
# DGX A100 has a 200 Gb/s HDR NIC per GPU; a 100 Gb/s link at the nccl-tests rate of cluster.constants
_NETWORK_GB_S = {"bloom": 4 * EDR100_BUSBW_GB_S / 8}

def row_cluster(row: Row) -> Cluster | None:
    """The cluster a row ran on: its GPU and count, 8 GPUs per server, the source's network where it
    is not the GPU's usual server's (_NETWORK_GB_S). None where the row does not name them."""
    gpu, n = _gpu(row), row.num("num_gpus")
    if not (gpu and n):
        return None
    return Cluster(gpu=gpu, num_gpus=n, gpus_per_node=min(8, n), nic_gb_s=_NETWORK_GB_S.get(row.family))


# Families by the software stack that ran them (meshplan.ir.stack presets)
_STACK_OF = {"megatron-sc21": "megatron-2021", "korthikanti": "megatron-2021", "mtnlg": "megatron-deepspeed",
             "bloom": "megatron-deepspeed", "opt": "megatron-2021", "deepspeed-zero3": "megatron-2021",
             "mcore-readme": "megatron-core", "nemo2407": "megatron-core", "nemo-longseq": "megatron-core",
             "modelzoo": "megatron-core", "megatron-bridge": "megatron-core", "mosaic": "llm-foundry",
             "torchtitan": "torchtitan"}


def stack_of(row: Row) -> Stack:
    """The software stack a row ran on, with the run's own switches (meshplan.ir.stack):
    - Megatron-LM 2021-22 (SC'21, MT-NLG, BLOOM's Megatron-DeepSpeed): no flash attention, gradient
      accumulation unfused (_UNFUSED_GRAD_ACCUMULATION); Korthikanti et al. (May 2022) ran after the
      fusion landed (commit 83b1e42f30, on by default), still without flash attention.
    - torchtitan: torch.compile only where the run names it (Table 1/3 "fsdp" rows ran eager).
    - NeMo 1.x (24.03, 24.07): Apex's DistributedFusedAdam, no fp32 main weights (master_weights).
    - Megatron-Bridge: FP8 parameters under its FP8 precision recipes (fp8_param_gather)."""
    fam = row.family
    st = Stack.preset(_STACK_OF.get(fam, "reference"))
    if fam in ("megatron-sc21", "korthikanti", "mtnlg", "bloom", "opt", "deepspeed-zero3"):
        st = st.replace(grad_accum_fusion=fam not in _UNFUSED_GRAD_ACCUMULATION)
    if fam == "torchtitan":
        text = (row.id + " " + row.get("notes")).lower()
        st = st.replace(compile="compile" in text)
    if fam in ("nemo2407", "nemo-longseq"):   # Apex's DistributedFusedAdam over the bf16 model (megatron_amp_O2)
        st = st.replace(master_weights="remainders")
    if fam == "megatron-bridge":
        # Bridge's FP8 precision recipes keep the parameters in FP8: bf16_with_fp8_current_scaling_mixed
        # and bf16_with_mxfp8_mixed set fp8_param_gather=True (src/megatron/bridge/training/
        # mixed_precision.py, v0.2.0 through v0.4.2: the 25.11 and 26.04 containers)
        st = st.replace(fp8_param_gather=("tensorwise", "mxfp8"))
    return st


def model_config(row: Row, preset: Callable[[str], Any] | None = None) -> dict[str, Any] | None:
    """meshplan model config for the row (None when the architecture is not given). `preset(name)`
    returns a meshplan preset config (meshplan.models.config) whose fields fill what the row leaves
    empty (head_dim, vocab, ...); without it those rows come back incomplete or None. The model a
    matching performance config trains (BRIDGE_PERF_MODEL) overrides it."""
    cfg = _row_model(row, preset)
    return {**cfg, **BRIDGE_PERF_MODEL.get(row.id, {})} if cfg else cfg


def _row_model(row: Row, preset: Callable[[str], Any] | None) -> dict[str, Any] | None:
    L, h, a = row.num("layers"), row.num("hidden"), row.num("heads")
    fam = row.family
    name = row.get("model").lower()
    preset_name = None
    for frag, p in _PRESET_FILL:
        if frag in name:
            preset_name = p
    if not (L and h and a):
        # Megatron-Bridge rows name the recipe's model: its architecture is meshplan's preset of it
        # (every field from the preset, checked against the row's layers/hidden where it gives them)
        if preset_name is None or preset is None:
            return None
        pc = preset(preset_name)
        if (L and L != pc.layers) or (h and h != pc.hidden):
            return None
        return _preset_config(pc)
    if L and h and preset_name and preset is not None and fam in ("torchtitan", "megatron-bridge"):
        pc = preset(preset_name)
        if (pc.layers, pc.hidden) == (L, h):
            return _preset_config(pc)
    cfg: dict[str, Any] = {"layers": L, "hidden": h, "heads": a, "kv_heads": row.num("kv_heads") or a}
    # GPT-OSS is a SwiGLU / RMSNorm MoE (OpenAI gpt-oss model card), not a GPT-3-style model
    gpt_style = fam in ("megatron-sc21", "mcore-readme", "korthikanti", "bloom", "mtnlg", "mosaic") or \
        (name.startswith(("gpt", "nemotron")) and not name.startswith(("gpt oss", "gpt-oss")))
    if gpt_style:
        cfg.update(family="gpt", ffn_hidden=row.num("ffn") or 4 * h, activation="gelu", norm="layernorm",
                   position="rope" if fam == "mcore-readme" else "learned", bias=True)
        if name.startswith("nemotron"):
            # NeMo's NemotronConfig (nemo/collections/llm/gpt/model/nemotron.py, the rows' source):
            # rotary positions, no linear biases, untied output layer, squared-ReLU MLP (a non-gated
            # two-matrix MLP, priced like GELU's); the Nemotron tokenizer's 256,000-token vocabulary
            # (Nemotron-4 15B report, arXiv 2402.16819, Sec. 2)
            cfg.update(position="rope", bias=False, tie_embeddings=False, vocab=256000)
        if fam == "mosaic":
            # The benchmarked MPTs (llm-foundry v0.3.0, scripts/train/yamls/pretrain/mpt-*.yaml at
            # b2a43a147, the commit that wrote the H100 tables) set only d_model/n_heads/n_layers/
            # expansion_ratio/vocab and attn_impl, so MPTConfig's defaults hold: learned_pos_emb=True
            # (a max_seq_len x d_model table), alibi=False, no_bias=False, and the output layer reuses
            # the token embedding. Their NumParams column (which the MFU formula uses) counts exactly
            # that model, e.g. 30B at seq 2048: 48*12*7168^2 + 50368*7168 + 2048*7168 + 626*7168.
            cfg.update(tie_embeddings=True, seq_len=row.num("seq"))
    else:
        cfg.update(family="llama", ffn_hidden=row.num("ffn"), activation="swiglu", norm="rmsnorm")
    cfg["vocab"] = row.num("vocab") or cfg.get("vocab")
    if row.num("moe_experts"):
        cfg.update(family="moe", experts=row.num("moe_experts"), topk=row.num("moe_topk"),
                   moe_ffn_hidden=row.num("moe_ffn"))
    if preset_name and preset is not None:
        pc = preset(preset_name)
        for key in ("head_dim", "vocab", "shared_experts", "dense_layers", "ffn_hidden", "kv_heads"):
            if not cfg.get(key) and getattr(pc, key, None):
                cfg[key] = getattr(pc, key)
        cfg["head_dim"] = pc.head_dim
        if getattr(pc, "attention", "gqa") == "mla":       # the CSV has no MLA columns
            cfg.update({k: getattr(pc, k) for k in _MLA_PRESET_KEYS})
    if not cfg.get("vocab"):
        if gpt_style:
            cfg["vocab"] = 51200      # Megatron GPT-2 BPE vocabulary padded (SC'21, Korthikanti)
        else:
            return None
    if not cfg.get("ffn_hidden"):
        return None
    return cfg


_PRESET_KEYS = ("family", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab", "experts",
                "topk", "moe_ffn_hidden", "shared_experts", "dense_layers", "norm", "activation", "tie_embeddings")


_MLA_PRESET_KEYS = ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _preset_config(pc) -> dict[str, Any]:
    """A model config (the keys model_config gives) from a meshplan preset's ModelConfig."""
    cfg = {k: getattr(pc, k) for k in _PRESET_KEYS}
    if getattr(pc, "attention", "gqa") == "mla":
        cfg.update({k: getattr(pc, k) for k in _MLA_PRESET_KEYS})
    if not cfg["experts"]:
        for k in ("experts", "topk", "moe_ffn_hidden", "shared_experts", "dense_layers"):
            cfg.pop(k)
    if pc.family != "gpt" and pc.bias:
        cfg["bias"] = True              # GPT-OSS's attention biases
    if pc.sliding_window or pc.attention_sinks:
        cfg.update(sliding_window=pc.sliding_window, sliding_window_pattern=pc.sliding_window_pattern,
                   attention_sinks=pc.attention_sinks)
    return cfg


def _layout(row: Row, cfg: dict[str, Any], n: int) -> dict[str, Any] | str:
    fam = row.family
    tp, pp, cp, vp = row.num("tp"), row.num("pp"), row.num("cp") or 1, row.num("vp") or 1
    notes = row.get("notes")
    zero_txt = row.get("zero").lower()
    if tp is None and pp is None:
        mps = re.search(r"model-parallel size (\d+)", notes)
        if mps:   # SC'21 Table 2 gives only the model-parallel size; Table 1 uses TP=8 within a node
            tp, pp = 8, int(mps.group(1)) // 8
        elif "zero-3" in zero_txt or "fsdp" in zero_txt and "fsdp-only" in notes.lower():
            tp, pp = 1, 1
        else:
            return "no parallel layout given"
    tp, pp = tp or 1, pp or 1
    if n % (tp * pp * cp):
        return f"tp*pp*cp = {tp * pp * cp} does not divide {n} GPUs"
    dp = n // (tp * pp * cp)
    if "zero-3" in zero_txt or "full_shard" in zero_txt or zero_txt.startswith(("fsdp", "megatron-fsdp")):
        zero = 3
    elif "zero-1" in zero_txt or "distributed" in zero_txt:
        zero = 1
    elif fam in ("megatron-sc21", "korthikanti", "mtnlg"):
        zero = 0 if fam != "mtnlg" else 1
    else:
        zero = 1
    rc_txt = row.get("recompute").lower()
    recompute = "full" if rc_txt.startswith("full") else "selective" if rc_txt.startswith("selective") else \
        "none" if rc_txt.startswith("none") else None
    if recompute == "selective" and "norm" in rc_txt and "act" in rc_txt:
        # Megatron-Core --recompute-modules layernorm moe_act: the Layout policy "norm_act" (norms and
        # routed experts' activation re-run; cost_models.layer.NORM_ACT), not Korthikanti's selective
        recompute = "norm_act"
    elif recompute == "selective" and "norm" in rc_txt and "moe" in rc_txt:
        recompute = "norm_moe"       # --recompute-modules layernorm moe: the whole MoE layer re-run
    elif recompute == "selective" and fam == "torchtitan":
        recompute = "op_sac"         # torchtitan's "selective" is its op-level SAC
    if recompute is None and fam in ("megatron-sc21", "mtnlg", "bloom", "deepspeed-zero3"):
        recompute = "full"   # Megatron / Megatron-DeepSpeed before 2022 had only full activation recomputation
    old = fam in ("megatron-sc21", "mtnlg", "bloom") or (fam == "korthikanti" and "no seq" in rc_txt)
    sp = tp > 1 and not old
    flash = fam not in ("megatron-sc21", "mtnlg", "bloom", "korthikanti", "opt")
    flash = flash and fam != "deepspeed-zero3"      # 2021, before flash attention
    mbs = row.num("mbs") or 1
    if fam == "megatron-sc21" and "Table 1" in row.source and not row.num("mbs") and not row.num("vp"):
        # Table 1 runs: micro-batch and interleaving from the paper's own launch script
        mbs, vp = _SC21_TABLE1.get((cfg["layers"], cfg["hidden"], tp, pp), (mbs, vp))
    elif fam == "megatron-sc21" and "Table 1 530B config" in row.get("model") and not row.num("vp"):
        # Table 2's PTD-P runs of the Table 1 530B model split it as Table 1 does (model-parallel size
        # 280 = tp8 x pp35) and ran its interleaving too: their fitted pipeline overhead is 28.6
        # micro-batch slots (validate_published's scaling series), fewer than the 34 that a
        # non-interleaved 1F1B on 35 stages idles at the least
        vp = _SC21_TABLE1.get((cfg["layers"], cfg["hidden"], tp, pp), (mbs, vp))[1]
    if fam == "torchtitan" and pp > 1:
        # torchtitan as benchmarked (2024, parallelize_llama.py / pipeline_llama.py): the local batch is
        # split into experimental.pipeline_parallel_microbatches micro-batches, by default the PP
        # degree; interleaved 1F1B ran two stages per rank (derived from the layer split)
        mbs = max(1, (row.num("mbs") or 1) // pp)
        if "interleaved" in row.id:
            vp = 2
    asynctp = "asynctp" in (row.id + notes).lower().replace(" ", "").replace("-", "")
    lay = dict(tp=tp, pp=pp, cp=cp, vp=vp, dp=dp, zero=zero, mbs=mbs, sp=sp, flash_attention=flash,
               tp_comm_overlap="--tp-comm-overlap" in notes or fam in ("nemo2407", "nemo-longseq") or asynctp)
    if fam == "torchtitan" and cp > 1:
        lay["cp_comm_type"] = "all_gather"     # PyTorch context_parallel's default all-gather rotation
    if fam == "torchtitan" and pp > 1:
        # with PP, torchtitan's FSDP keeps the gathered weights after forward ("do not reshard after
        # forward to avoid per-microbatch all-gathers", parallelize_llama.py of that time)
        lay["reshard_after_forward"] = False
    _add_stack_fields(lay, row, cfg)
    for k, v in {**BRIDGE_PERF_CONFIGS.get(row.id, {}), **NEMO_LAUNCHER_CONFIGS.get(row.id, {})}.items():
        if k == "recompute" and recompute:
            continue                  # the row's own statement wins
        lay[k] = v
    if recompute:
        lay["recompute"] = recompute
    return lay




def _add_stack_fields(lay: dict[str, Any], row: Row, cfg: dict[str, Any]) -> None:
    """The layout fields that describe the row's software stack rather than its parallel degrees:
    gradient dtype, attention kernel, ZeRO-3 flavour, uneven stage split, EP and its dispatcher."""
    fam, notes = row.family, row.get("notes")
    pp, vp = lay["pp"], lay["vp"]
    if fam in ("nemo2407", "nemo-longseq"):
        # NeMo 1.x performance recipes: distributed_fused_adam with grad_sync_dtype: bf16, whose
        # contiguous gradient buffer is then bf16 (NeMo-Framework-Launcher conf/training/gpt3/
        # *_fp8_performance.yaml, optim.grad_sync_dtype)
        lay["grad_dtype"] = "bf16"
        lay["attn_kernel"] = NEMO_LAUNCHER_ATTN_KERNEL
    if fam == "megatron-bridge":    # every Bridge LLM pretraining perf config: grad_reduce_in_fp32 = False
        lay["grad_dtype"] = "bf16"  # (scripts/performance/configs/*/*_llm_pretrain.py, v0.2.0-v0.4.2)
    if lay["zero"] == 3:
        if fam == "deepspeed-zero3":
            lay["fsdp_impl"] = "deepspeed"
        elif fam == "modelzoo" or "megatron-fsdp" in row.get("zero").lower():   # Megatron-Core's own FSDP
            lay["fsdp_impl"] = "megatron"
    if cfg["layers"] % (pp * vp):
        # the run split layers unevenly (e.g. BLOOM: 70 layers + 2 embedding stages on pp=12)
        lay["stage_layers"] = split_layers(cfg["layers"], pp * vp)
    if cfg.get("experts"):
        lay["ep"] = row.num("ep") or 1
        lay["etp"] = row.num("etp") or 1
        if "deepep" in notes.lower():
            lay["moe_dispatcher"] = "deepep"
        cap = _moe_capacity(notes)
        if cap is not None and "moe_capacity_factor" in {f.name for f in fields(Layout)}:
            lay["moe_capacity_factor"] = cap


def _moe_capacity(notes: str) -> float | None:
    """The MoE routing a row's notes name, as a capacity factor (cost_models.layer.moe_load_factor):
    a capacity factor c with padding (--moe-expert-capacity-factor c --moe-pad-expert-input-to-
    capacity) pads every expert to c times its mean rows; None (dropless) otherwise. Megatron's forced
    balance (--moe-router-force-load-balancing; "forced-balance", "force-balanced" in the notes) is
    dropless too: it draws random router logits and dispatches as usual (router.py
    apply_random_logits), priced as tokens routed independently (the megatron-core stack's
    Stack.forced_balance)."""
    m = re.search(r"capacity factor ([0-9.]+) with padding", notes.lower())
    return float(m.group(1)) if m else None


# Stacks that add each micro-batch's weight gradients into the gradient buffer in a separate pass
# (meshplan.cost_models.compute.grad_accumulation_time): Megatron-LM before commit 83b1e42f30
# (2022-02-13, "gradient accumulation fusion") did it in a per-parameter backward hook
# (`param.main_grad.add_(param.grad.data)`, megatron/model/distributed.py), which the SC'21 runs
# (April 2021) used; Megatron-DeepSpeed (MT-NLG 2021, BLOOM 2022) forked that Megatron and accumulates
# through DeepSpeed's engine (BLOOM: BF16_Optimizer's fp32 high-precision gradients), also unfused.
# Korthikanti et al. (May 2022) ran Megatron-LM after the fusion landed (on by default); Megatron-Core,
# NeMo and Transformer Engine fuse it (gradient_accumulation_fusion / fuse_wgrad_accumulation).
_UNFUSED_GRAD_ACCUMULATION = ("megatron-sc21", "mtnlg", "bloom", "deepspeed-zero3")


def stack_options(row: Row) -> dict[str, Any]:
    """Layout fields that describe the row's software stack rather than its parallel layout: the
    FP8 recipe where the precision column names one. Unnamed, it is the one the stack ran: NeMo 1.x
    (24.03, 24.07) Transformer Engine's delayed scaling (its only recipe in TE 1.x; NeMo-Framework-
    Launcher's training configs set fp8_amax_history_len 1024 / fp8_amax_compute_algo max), Megatron-
    Bridge's H100 rows current scaling (its *_FP8_CS_* performance configs), torchtitan torchao's
    tensorwise. The rest of the stack (attention kernel, gradient-accumulation fusion, compile) is
    `stack_of`."""
    opts: dict[str, Any] = {}
    prec = row.get("precision").lower()
    for recipe in ("mxfp8", "blockwise", "rowwise"):
        if "fp8" in prec and recipe in prec.replace("block-wise", "blockwise").replace("row-wise", "rowwise"):
            opts["fp8_recipe"] = recipe
            break
    else:
        if "fp8" in prec and row.family in ("nemo2407", "nemo-longseq"):
            opts["fp8_recipe"] = "delayed"
    return opts


# SC'21 Table 1 launch settings, keyed by (layers, hidden, tp, pp): (micro-batch, chunks per pipeline
# rank), from NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (MBS and
# --num-layers-per-virtual-pipeline-stage: 76B 5 of 15 layers per rank -> vp 3, 145B 5 of 10 -> 2,
# 310B 3 of 6 -> 2, 530B 1 of 3 -> 3).
_SC21_TABLE1 = {
    (24, 2304, 1, 1): (16, 1), (30, 3072, 2, 1): (16, 1), (36, 4096, 4, 1): (16, 1),
    (40, 6144, 8, 1): (8, 1), (48, 8192, 8, 2): (4, 1), (60, 10240, 8, 4): (2, 3),
    (80, 12288, 8, 8): (2, 2), (96, 16384, 8, 16): (1, 2), (105, 20480, 8, 35): (1, 3),
    (128, 25600, 8, 64): (1, 1),
}


# Sources whose TFLOP/s are SC'21 Eq. 3 (hardware FLOPs with the recompute forward): the SC'21 paper
# itself, including its DeepSpeed ZeRO-3 baselines (Table 2 reports both schemes with one formula),
# MT-NLG (126 TFLOP/s = Eq. 3 at 60.1 s/iteration, GBS 1920, V 51200) and BLOOM ("4*2 coefficient").
EQ3_FAMILIES = ("megatron-sc21", "deepspeed-zero3", "mtnlg", "bloom")


def _megatron_eq3(cfg: dict[str, Any], s: int, B: int) -> float:
    L, h, V = cfg["layers"], cfg["hidden"], cfg["vocab"]
    return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def _bridge_window_flops(cfg: dict[str, Any], s: int, B: int) -> float:
    """Model FLOPs of a step as Megatron-Bridge's performance summaries (25.11, 26.04.01) report them
    for GPT-OSS: every layer's core attention counted as full causal attention (s/2 keys per query,
    the sliding window ignored) and each expert's gated MLP as two h x ffn matrices, plus Q/K/V/O
    and the logits, times 3. It reproduces the published 158 TFLOP/s at 5824 tokens/s/GPU and 153 at
    5630 (27.13 and 27.18 GFLOP per token; this count gives 27.16). The current Megatron-Bridge
    formula (src/megatron/bridge/training/utils/flop_utils.py, num_floating_point_operations:
    `swa_context` = w - w(w-1)/2s keys on the windowed layers, gated MLPs as 3 matrices) gives
    32.6 GFLOP per token, 20% more than those tables: they predate it."""
    L, h, V = cfg["layers"], cfg["hidden"], cfg["vocab"]
    q, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    width = cfg.get("moe_ffn_hidden") or cfg["ffn_hidden"]
    mlp = (cfg.get("topk") or 1) * 2 * h * width
    per_layer = h * (q + 2 * kv) + q * h + mlp + q * s / 2 * 2      # multiply-adds per token
    return 6.0 * B * s * (L * per_layer + h * V)


def _convert(row: Row, est, prof, cfg: dict[str, Any], n: int, peak_tflops: float) -> float:
    """The prediction in the row's metric and FLOP convention."""
    metric = row.get("metric")
    s, B = est.seq_len, est.global_batch
    t = est.step_time_s
    fam = row.family
    if metric == "step_time_s":
        return t
    if metric == "tokens_per_sec_per_gpu":
        return est.tokens_per_s_per_gpu
    if fam in EQ3_FAMILIES:
        return _megatron_eq3(cfg, s, B) / t / n / 1e12
    if fam == "mosaic":
        per_seq = 3 * (2 * prof.total_params * s + 4 * cfg["layers"] * cfg["hidden"] * s * s)
        return per_seq * B / t / n / (peak_tflops * 1e12) * 100
    if fam == "megatron-bridge" and cfg.get("sliding_window"):
        return _bridge_window_flops(cfg, s, B) / t / n / 1e12
    # The Model Zoo and Megatron-Bridge count core attention causal (half the score matrix): Bridge's
    # training/utils/flop_utils.py (v0.2.x on: "Only half of the attention matrix is non-zero", in its
    # GQA and its latent-attention branches). The summaries' own tokens/s agree on every row: Llama 3
    # 8B at 8k, 744 TFLOP/s at 14451 tokens/s = 51.5 GFLOP/token (causal 51.5, whole 57.9); Qwen3-30B-A3B
    # 23.0 (causal 23.0, whole 27.8); DeepSeek-V3 with its MTP layer 259.6 (causal 260.0, whole 291.2)
    causal = fam in ("modelzoo", "megatron-bridge")
    flops = model_flops_per_step(prof, s, B, causal_half=causal)
    tflops = flops / t / n / 1e12
    if metric == "mfu_pct":
        return tflops / peak_tflops * 100
    return tflops


def run_row(row: Row, profile_fn: Callable[[dict[str, Any]], Any], *, preset: Callable[[str], Any] | None = None,
            profiles: dict | None = None, fitted=None) -> RowResult:
    """Estimate one row. `profile_fn(cfg)` builds the ModelProfile of a model config; `preset` fills
    architecture fields from meshplan's presets (see model_config); `profiles` caches profiles by
    architecture across rows; `fitted` the fitted constants to price with (constants.Fitted; None:
    the shipped fit)."""
    metric, value = row.get("metric"), row.get("value")
    res = RowResult(row=row, metric=metric, measured=float(value) if value else float("nan"))
    gpu, n = _gpu(row), row.num("num_gpus")
    s, B = row.num("seq"), row.num("gbs")
    if row.family == "torchtitan":
        # the benchmark tables state the local batch and not always the sequence: torchtitan's
        # train_configs/llama3_*.toml (the tables' commit) train at seq_len 8192, and the global
        # batch is the local batch on each data-parallel rank (derived, as the notes say)
        s = s or 8192
        if not B and row.num("mbs") and row.num("dp"):
            local = re.search(r"local batch (\d+)", row.get("notes"))
            B = (int(local.group(1)) if local else row.num("mbs")) * row.num("dp")
    cfg = model_config(row, preset)
    if not (gpu and n and s and B):
        res.skipped = "GPU, GPU count, sequence length or global batch not given"
        return res
    if cfg is None:
        res.skipped = "architecture not given"
        return res
    lay = _layout(row, cfg, n)
    if isinstance(lay, str):
        res.skipped = lay
        return res
    prec_txt = row.get("precision").lower()
    precision = Precision.FP8 if "fp8" in prec_txt or "float8" in prec_txt else Precision.BF16
    stack = stack_of(row)
    key = repr(sorted(cfg.items()))
    profiles = profiles if profiles is not None else {}
    if key not in profiles:
        profiles[key] = profile_fn(cfg)
    prof = for_stack(profiles[key], stack)       # the stack's own kernels, not meshplan's fused ones
    cluster = row_cluster(row)
    lay = {**lay, **stack_options(row)}     # the software stack's conventions are layout fields
    candidates = [lay] if "recompute" in lay else [dict(lay, recompute=r) for r in ("none", "selective", "full")]
    for cand in candidates:
        try:
            est = estimate_profile(prof, cluster, cand, seq_len=s, global_batch=B, precision=precision,
                                   stack=stack, fitted=fitted)
        except MeshplanError as e:
            res.skipped = f"layout rejected: {e}"
            return res
        if est.fits:
            break
    res.layout, res.estimate, res.fits = cand, est, est.fits
    res.predicted = _convert(row, est, prof, cfg, n, cluster.gpu.bf16_tflops)
    return res

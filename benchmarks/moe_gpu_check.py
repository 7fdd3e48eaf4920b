"""GPU check of the MoE fast paths (needs a Hopper GPU): `torch._grouped_mm` expert GEMMs
against the per-expert loop (forward, dx, dw; then fwd+bwd time), the fused Triton router
swapped into an MoE, and the fp32 expert bias under a bf16 model.

    python benchmarks/moe_gpu_check.py          # 8 experts;  G=64 python ... for 64

H100 80GB, torch 2.11, bf16, K=1024, N=2048 (2026-11-24): identical outputs; fwd+bwd
1.41 ms grouped vs 1.94 ms loop with 8 experts (4k rows), 2.28 vs 9.37 ms with 64 experts.
"""
import torch, time, sys
sys.path.insert(0, ".")
import importlib; gm = importlib.import_module("meshplan.models.grouped_mm")
print(torch.__version__, torch.cuda.get_device_name(), hasattr(torch, "_grouped_mm"))
torch.manual_seed(0)
import os
G, K, N = int(os.environ.get("G", "8")), 1024, 2048
counts = (torch.tensor([0, 700, 300, 1000, 96, 0, 1000, 900]) if G == 8
          else torch.randint(0, 256, (G,), generator=torch.Generator().manual_seed(0)))
offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
M = int(counts.sum())
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
print("supported", gm.torch_grouped_mm_supported(x, w))
def run(flag):
    gm.USE_TORCH_GROUPED_MM = flag
    x.grad = w.grad = None
    y = gm.grouped_mm(x, w, offs)
    g = torch.randn_like(y, generator=None)
    torch.manual_seed(1); g = torch.randn(y.shape, device="cuda", dtype=y.dtype)
    y.backward(g)
    return y.float(), x.grad.float(), w.grad.float()
fast, loop = run(True), run(False)
for name, a, b in zip(("y", "dx", "dw"), fast, loop):
    err = (a - b).abs().max().item() / (b.abs().max().item() + 1e-9)
    print(name, "rel err", err); assert err < 2e-2, name
for flag in (True, False):
    gm.USE_TORCH_GROUPED_MM = flag
    for _ in range(3): run(flag)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): run(flag)
    torch.cuda.synchronize(); print("grouped" if flag else "loop", (time.perf_counter() - t) / 20 * 1e3, "ms fwd+bwd")
# router kernel swap on GPU (Triton)
from meshplan.models import ModelConfig
from meshplan.models.moe import MoE
from meshplan.runtime.fused import apply_router_kernel
gm.USE_TORCH_GROUPED_MM = True
cfg = ModelConfig(family="moe", layers=1, hidden=256, heads=4, vocab=64, experts=8, topk=2, moe_ffn_hidden=128,
                  moe_aux_loss_coeff=0.01, moe_expert_bias=True)
h = torch.nn.Module(); h.moe = MoE(cfg).cuda()
for p in h.moe.parameters(): torch.nn.init.normal_(p, std=0.05)
ref = MoE(cfg).cuda(); ref.load_state_dict(h.moe.state_dict())
print("router kernel swapped:", apply_router_kernel(h))
xx = torch.randn(4, 64, 256, device="cuda")
a, b = h.moe(xx), ref(xx)
print("moe out max diff", (a - b).abs().max().item(), h.moe.tokens_per_expert.tolist() == ref.tokens_per_expert.tolist())
hb = h.moe.to(torch.bfloat16); print("bias dtype after bf16", hb.expert_bias.dtype)
out = hb(xx.bfloat16()); out.float().square().mean().backward(); print("bf16 MoE fwd/bwd ok", out.dtype)

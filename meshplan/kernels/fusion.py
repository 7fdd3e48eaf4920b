"""What each fused kernel saves in HBM traffic, for the planner and cost model (pure Python).

Each entry of FUSIONS says which eager op pattern the kernel replaces and gives a function of
the shapes returning the HBM bytes saved per forward + backward pass against unfused PyTorch
eager. The counts follow one rule: every eager op reads its inputs from HBM once and writes its
outputs once (no cache reuse between ops; small tensors such as weights, cos/sin tables and
per-row statistics are ignored). `b` is the activation dtype's bytes (2 for bf16); eager
upcasts to fp32 where the HF/PyTorch code does (4 bytes). N is the number of activation
elements named in each derivation. These are estimates for ranking plans, not measurements:
benchmarks/kernels.py measures the real kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshplan.errors import ConfigError, UnknownNameError

__all__ = ["Fusion", "FUSIONS", "bytes_saved", "default_chunk_size", "linear_cross_entropy_memory_bytes",
           "DEFAULT_CHUNK_LOGITS_BYTES"]

FP32 = 4


def _check(**sizes: float) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{name} must be a non-negative number, got {value!r}")


def rms_norm_bytes_saved(*, tokens: int, hidden: int, dtype_bytes: int = 2) -> float:
    """HF LlamaRMSNorm eager, N = tokens * hidden, per element:
    fwd: x.to(fp32) b+4 | pow 8 | mean 4 | x*rstd 8 | .to(dtype) 4+b | weight*y 2b  = 28 + 4b
    bwd: weight*y 6b (dy*w and dy*y then reduce) | .to 4+b | x*rstd 24 (g*rstd, g*x, reduce)
         | mean 4 | pow 12 | path add 12 | .to(fp32) 4+b                             = 60 + 8b
    fused: fwd reads x, writes y = 2b; bwd reads dy, x, writes dx = 3b
    """
    _check(tokens=tokens, hidden=hidden, dtype_bytes=dtype_bytes)
    b = dtype_bytes
    return tokens * hidden * ((28 + 4 * b) + (60 + 8 * b) - 5 * b)


def rms_norm_residual_bytes_saved(*, tokens: int, hidden: int, dtype_bytes: int = 2) -> float:
    """RMSNorm plus the residual add before it. The eager add reads 2 and writes 1 tensor (3b)
    and its backward adds the incoming residual gradient to the norm's dx (3b); fused, the add
    costs one extra read (residual) and write (new residual) forward and one read (dres)
    backward = 3b, so the add saves 3b per element on top of the norm's own saving."""
    _check(tokens=tokens, hidden=hidden, dtype_bytes=dtype_bytes)
    return rms_norm_bytes_saved(tokens=tokens, hidden=hidden, dtype_bytes=dtype_bytes) + \
        tokens * hidden * 3 * dtype_bytes


def swiglu_bytes_saved(*, tokens: int, ffn_hidden: int, dtype_bytes: int = 2) -> float:
    """F.silu(gate) * up in the activation dtype, N = tokens * ffn_hidden, per element:
    fwd: silu r1 w1 | mul r2 w1                                      = 5b   (fused 3b)
    bwd: mul -> d silu-out r2 w1, d up r2 w1 | silu bwd r2 w1          = 9b   (fused r3 w2 = 5b)
    """
    _check(tokens=tokens, ffn_hidden=ffn_hidden, dtype_bytes=dtype_bytes)
    return tokens * ffn_hidden * ((5 - 3) + (9 - 5)) * dtype_bytes


def rope_bytes_saved(*, tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                     dtype_bytes: int = 2) -> float:
    """HF apply_rotary_pos_emb, q*cos + rotate_half(q)*sin, per element of q and of k:
    fwd: q*cos r1 w1 | neg of half r.5 w.5 | cat r1 w1 | *sin r1 w1 | add r2 w1      = 10b
    bwd: *sin r1 w1 | cat/neg slices r.5 w.5 + r.5 w.5 | g*cos r1 w1 | path add r2 w1 = 9b
    fused: r1 w1 each way                                                           = 4b
    """
    _check(tokens=tokens, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
           dtype_bytes=dtype_bytes)
    return tokens * (q_heads + kv_heads) * head_dim * (10 + 9 - 4) * dtype_bytes


def linear_cross_entropy_bytes_saved(*, tokens: int, vocab: int, dtype_bytes: int = 2) -> float:
    """lm_head matmul + F.cross_entropy(logits.float()), N = tokens * vocab (the logits):
    eager: matmul writes b | .float() r b w 4 | log_softmax r4 w4 | nll bwd + log_softmax bwd
           r8 w4 | .to(dtype) r4 w b | dlogits read by the two backward matmuls 2b  = 5b + 28
    fused: matmul writes b | kernel pass 1 reads b, pass 2 reads b and writes b | two matmuls
           read 2b                                                                 = 6b
    (The larger win is memory: the fused op holds one chunk of logits, not N of them.)
    """
    _check(tokens=tokens, vocab=vocab, dtype_bytes=dtype_bytes)
    b = dtype_bytes
    return tokens * vocab * ((5 * b + 28) - 6 * b)


def moe_unpermute_bytes_saved(*, tokens: int, hidden: int, top_k: int,
                              dtype_bytes: int = 2) -> float:
    """(expert_out[row_map] * w[..., None]).sum(1), N = tokens * top_k * hidden:
    fwd: gather r1 w1 | *w r1 w1 | sum r1 w(1/k)            ~ 6b   (fused r1 w(1/k) ~ 1b)
    bwd: sum bwd expand w1 | *w bwd r2 w1 (dx) + r2 w1 (dw) | gather bwd (index_add) r1 w1
                                                            = 10b  (fused: r1 (dy) r1 w1 = 3b)
    The permute itself is one gather both ways in eager and fused alike: no saving.
    """
    _check(tokens=tokens, hidden=hidden, top_k=top_k, dtype_bytes=dtype_bytes)
    return tokens * top_k * hidden * ((6 - 1) + (10 - 3)) * dtype_bytes


# Default chunk of the fused linear + cross-entropy: the largest power of two of tokens whose
# logits fit in this many bytes. 256 MiB holds 1024 tokens of a 128k vocabulary in bf16: large
# enough for an efficient GEMM (M = 1024), small next to the 2 GiB that the full logits of 8192
# tokens take.
DEFAULT_CHUNK_LOGITS_BYTES = 256 * 2**20


def default_chunk_size(tokens: int, vocab: int, itemsize: int) -> int:
    """Tokens per chunk of fused_linear_cross_entropy (a power of two, at most next_pow2(tokens))."""
    fit = max(1, DEFAULT_CHUNK_LOGITS_BYTES // max(1, vocab * itemsize))
    chunk = 1 << (fit.bit_length() - 1)  # round down to a power of two
    return max(1, min(chunk, 1 << (max(int(tokens), 1) - 1).bit_length()))


def linear_cross_entropy_memory_bytes(*, tokens: int, vocab: int, hidden: int,
                                      dtype_bytes: int = 2) -> float:
    """Memory the fused output layer + loss holds from forward to backward: one chunk of logits
    plus the gradients it computes during the forward (grad_hidden T x h, grad_weight V x h),
    against the eager (T x V) logits kept for backward plus their fp32 softmax."""
    _check(tokens=tokens, vocab=vocab, hidden=hidden, dtype_bytes=dtype_bytes)
    chunk = default_chunk_size(int(tokens), int(vocab), dtype_bytes)
    return (min(chunk, tokens) * vocab + tokens * hidden + vocab * hidden) * dtype_bytes


@dataclass(frozen=True, kw_only=True)
class Fusion:
    name: str
    kernel: str              # the meshplan.kernels function
    replaces: str            # the eager op pattern, in words
    bytes_saved: Callable[..., float]

    def __post_init__(self) -> None:
        if not self.name or not self.kernel or not self.replaces:
            raise ConfigError("Fusion needs a name, a kernel and a description")


FUSIONS: dict[str, Fusion] = {f.name: f for f in (
    Fusion(name="rms_norm", kernel="rms_norm", bytes_saved=rms_norm_bytes_saved,
           replaces="upcast, square, mean, rsqrt, scale, downcast, weight multiply"),
    Fusion(name="rms_norm_residual", kernel="rms_norm_residual",
           bytes_saved=rms_norm_residual_bytes_saved,
           replaces="residual add followed by the RMSNorm op chain"),
    Fusion(name="swiglu", kernel="swiglu", bytes_saved=swiglu_bytes_saved,
           replaces="silu(gate) then multiply by up (and the split of a fused gate/up output)"),
    Fusion(name="rope", kernel="rope", bytes_saved=rope_bytes_saved,
           replaces="q*cos + rotate_half(q)*sin (slice, negate, concat, 2 muls, add) on q and k"),
    Fusion(name="linear_cross_entropy", kernel="fused_linear_cross_entropy",
           bytes_saved=linear_cross_entropy_bytes_saved,
           replaces="lm_head matmul, fp32 upcast, log_softmax, nll_loss over full T x V logits"),
    Fusion(name="moe_unpermute", kernel="moe_unpermute", bytes_saved=moe_unpermute_bytes_saved,
           replaces="gather expert outputs by token, scale by routing weights, sum the k copies"),
)}


def bytes_saved(name: str, **shape: int) -> float:
    """HBM bytes saved per forward + backward by fusion `name`; shape keywords as its function."""
    if name not in FUSIONS:
        raise UnknownNameError("fusion", name, list(FUSIONS))
    try:
        return FUSIONS[name].bytes_saved(**shape)
    except TypeError as exc:  # wrong keywords: say which ones the fusion takes
        import inspect

        params = ", ".join(inspect.signature(FUSIONS[name].bytes_saved).parameters)
        raise ConfigError(f"fusion {name!r} takes keywords ({params}); "
                          f"got {sorted(shape)}") from exc

"""Compile every Triton kernel for an H100 (sm_90) without a GPU: python compile_sm90.py.

The interpreter accepts code that the real compiler rejects (e.g. reading a non-constexpr
global), so CI also runs Triton's real front end and LLVM/ptxas back end on each kernel with
representative bf16 signatures and launch constants. Needs TRITON_INTERPRET unset. Prints one
line per kernel and exits 1 if any fails.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_sm90.py needs TRITON_INTERPRET unset")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from meshplan.kernels import _linear_ce_triton as ce  # noqa: E402
from meshplan.kernels import _moe_triton as mo  # noqa: E402
from meshplan.kernels import _rmsnorm_triton as rn  # noqa: E402
from meshplan.kernels import _rope_triton as rp  # noqa: E402
from meshplan.kernels import _swiglu_triton as sw  # noqa: E402

BF = "*bf16"
TARGET = GPUTarget("cuda", 90, 32)  # H100: compute capability 9.0, warp size 32

CASES = [
    (rn._rmsnorm_fwd, dict(X=BF, R=BF, W=BF, Y=BF, H=BF, RSTD="*fp32", eps="fp32"),
     dict(HAS_RESIDUAL=True, BLOCK_M=1, BLOCK_N=4096)),
    (rn._rmsnorm_bwd, dict(DY=BF, DH=BF, X=BF, W=BF, RSTD="*fp32", DX=BF, DW_PARTIAL="*fp32"),
     dict(HAS_DH=True, BLOCK_M=2, BLOCK_N=4096)),
    (sw._swiglu_fwd, dict(G=BF, U=BF, O=BF), dict(BLOCK_M=8, BLOCK_F=1024)),
    (sw._swiglu_bwd, dict(DO=BF, G=BF, U=BF, DG=BF, DU=BF), dict(BLOCK_M=8, BLOCK_F=1024)),
    *[(rp._rope, dict(Q=BF, K=BF, QO=BF, KO=BF, COS="*fp32", SIN="*fp32"),
       dict(INTERLEAVED=inter, BACKWARD=bwd, BLOCK_S=64, BLOCK_D=128))
      for inter in (False, True) for bwd in (False, True)],
    *[(ce._ce_chunk, dict(LOGITS=BF, stride="i64", LABELS="*i64", LOSS="*fp32", SCALE="*fp32",
                          eps="fp32"),
       dict(HAS_SMOOTHING=smooth, COMPUTE_GRAD=grad, BLOCK_R=1, BLOCK_V=4096))
      for smooth, grad in ((True, True), (False, False))],
    *[(mo._route_fwd, dict(Z=BF, BIAS="*fp32", W="*fp32", IDX="*i64", PSUM="*fp32"),
       dict(K=2, SIGMOID=sig, HAS_BIAS=sig, BLOCK_T=32, BLOCK_E=8, BLOCK_K=2))
      for sig in (False, True)],
    *[(mo._route_bwd, dict(Z=BF, IDX="*i64", W="*fp32", DW="*fp32", DPSUM="*fp32", DZ=BF),
       dict(K=2, SIGMOID=sig, BLOCK_T=32, BLOCK_E=8)) for sig in (False, True)],
    (mo._gather_rows, dict(SRC=BF, FROM="*i64", DST=BF), dict(BLOCK_N=8, BLOCK_H=1024)),
    (mo._gather_sum, dict(SRC=BF, ROW_MAP="*i64", WEIGHT="*fp32", DST=BF),
     dict(K=2, HAS_WEIGHT=True, BLOCK_T=8, BLOCK_H=1024)),
    (mo._unpermute_bwd, dict(DY=BF, EXP=BF, FROM="*i64", WEIGHT="*fp32", DEXP=BF,
                             DWEIGHT="*fp32"), dict(BLOCK_N=8, BLOCK_H=1024)),
]


def compile_one(fn, types: dict[str, str], consts: dict[str, object]) -> None:
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                   options={"num_warps": 8})


def main() -> int:
    failed = 0
    for fn, types, consts in CASES:
        try:
            compile_one(fn, types, consts)
            print(f"ok   {fn.__name__} {consts}")
        except Exception as exc:  # report every kernel, then fail once
            failed += 1
            print(f"FAIL {fn.__name__} {consts}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

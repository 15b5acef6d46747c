"""Downcasts inside Triton kernels that round the same way on the GPU and in the interpreter.

Why: a kernel that promises the torch reference's rounding must round fp32 to bf16 to nearest-even, as
torch does. Compiled, ``.to(tl.bfloat16)`` does; Triton's interpreter (3.9, the CPU tests' only way to run
a kernel) truncates instead, so a bit-exact kernel failed its CPU test by one ulp in half the elements.
Rounding the fp32 bits first (add 0x7FFF plus the kept bit's parity, clear the low half) makes the cast
exact on both. fp16 and fp32 casts round to nearest-even in both already.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def downcast(x, dtype: tl.constexpr):
    """fp32 ``x`` to ``dtype``, rounded to nearest-even (NaN stays NaN, overflow goes to infinity)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)

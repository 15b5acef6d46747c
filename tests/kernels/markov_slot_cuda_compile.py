"""Compile every kernel of kvspec_kernels/markov_slot.py for sm_90 (H100/H200) ahead of time, down to a cubin,
without a GPU; print each kernel's name as it compiles. Run by tests/kernels/test_markov_slot.py in a process
without TRITON_INTERPRET, as tests/kernels/nucleus_cuda_compile.py is for the nucleus kernels. Why: the
interpreter runs ``tl.math.div_rn`` and the bool loads as numpy: it cannot say whether CUDA takes them, nor
whether the division stays correctly rounded (checked here in the PTX).
Not a test module (no ``test_`` prefix)."""
from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kvspec_kernels.markov_slot as m

I = "i32"
KERNELS = [
    *[(m._logits, dict(base_ptr=f"*{b}", bias_ptr=f"*{b}", t_ptr="*fp32", out_ptr="*fp32", vocab=I, stride_base=I,
                       stride_bias=I, stride_t=I, stride_o=I), dict(CHUNK=m.CHUNK, HAS_BIAS=has))
      for b, has in (("bf16", True), ("fp32", False))],
    (m._stats, dict(base_ptr="*bf16", bias_ptr="*bf16", t_ptr="*fp32", stats_ptr="*fp32", vocab=I, stride_base=I,
                    stride_bias=I, stride_t=I), dict(CHUNK=m.CHUNK, HAS_BIAS=True)),
    (m._write, dict(base_ptr="*bf16", bias_ptr="*bf16", t_ptr="*fp32", greedy_ptr="*i1", stats_ptr="*fp32",
                    out_ptr="*fp32", sums_ptr="*fp32", vocab=I, stride_base=I, stride_bias=I, stride_t=I, stride_g=I,
                    stride_o=I, chunks=I), dict(CHUNK=m.CHUNK, BLOCK_S=64, HAS_BIAS=True)),
]

if __name__ == "__main__":
    for fn, args, consts in KERNELS:
        source = ASTSource(fn=fn, signature={**args, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert compiled.asm["cubin"], fn.__name__
        # every kernel divides by the temperature (``_x``): correctly rounded, as torch divides; the only other
        # division, ``_write``'s 1 / total of the softmax, may be approximate (no bit identity asked of it)
        ptx = compiled.asm["ptx"]
        assert "div.rn.f32" in ptx, fn.__name__
        assert fn is m._write or not any(a in ptx for a in ("div.full", "div.approx", "rcp.approx")), fn.__name__
        print(fn.__name__, flush=True)

"""Compile every kernel of kvspec_kernels/nucleus.py for sm_90 (the H200) ahead of time, down to a cubin,
without a GPU; print each kernel's name as it compiles. Run by tests/kernels/test_nucleus.py in a process
without TRITON_INTERPRET (under the interpreter, ``@triton.jit`` gives functions the compiler cannot take).
Not a test module (no ``test_`` prefix)."""
from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kvspec_kernels.nucleus as n

P, I = "*fp32", "i32"
META = dict(NC=n.NC, STEP=n.STEP, FINE=n.FINE, NB=n.NB, BLOCK_S=64)
ROW = dict(logits_ptr=P, top_p_ptr=P, coarse_ptr=P, fine_ptr=P, out_ptr=P, vocab=I, stride_l=I, stride_o=I, chunks=I)
KERNELS = [
    (n._coarse_ladder, dict(logits_ptr=P, coarse_ptr=P, vocab=I, stride_l=I),
     dict(CHUNK=n.CHUNK, SUB=n.SUB, NC=n.NC, STEP=n.STEP, FINE=n.FINE)),
    *[(n._fine_ladder, dict(logits_ptr=P, top_p_ptr=P, coarse_ptr=P, fine_ptr=P, vocab=I, stride_l=I, chunks=I),
       dict(CHUNK=n.CHUNK, SUB=n.SUB, COUNTS=counts, **META)) for counts in (True, False)],
    (n._rounded_write, ROW, dict(CHUNK=n.CHUNK, **META)),
    (n._compact, ROW, dict(CHUNK=n.CHUNK, SUB=n.SUB, **META)),
    (n._search, dict(top_p_ptr=P, coarse_ptr=P, fine_ptr=P, out_ptr=P, cut_ptr=P, stride_o=I, chunks=I),
     dict(SEARCH_BLOCK=n.SEARCH_BLOCK, **META)),
    (n._write, dict(logits_ptr=P, coarse_ptr=P, cut_ptr=P, out_ptr=P, vocab=I, stride_l=I, stride_o=I, chunks=I),
     dict(CHUNK=n.CHUNK, NC=n.NC, BLOCK_S=64)),
]

if __name__ == "__main__":
    for fn, args, consts in KERNELS:
        source = ASTSource(fn=fn, signature={**args, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert compiled.asm["cubin"], fn.__name__
        print(fn.__name__, flush=True)

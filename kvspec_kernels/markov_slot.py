"""One slot of the DSpark drafter's Markov loop, fused: logits, distribution and draw in three launches.

Why: the Markov loop samples γ = 7 slots left to right, and per slot the torch path made ~6 passes over
[B, V] fp32 (an up-front fp32 copy of the whole base, the bias add, the temperature division, softmax, a copy
into the output, then the draw's chunk sums): on an H100 at B = 128 (V = 151,936) the loop cost 4.15 ms a
round, ~11% of it, against the DSpark paper's <= 1.3%. Here the two model-dtype inputs (the slot's base
logits and the caller's low-rank bias) are read twice and the fp32 probabilities written once.

Per row, ``x = (base + bias) / T`` in fp32: the add and an IEEE correctly rounded division (``div_rn``;
Triton's ``/`` on fp32 is an approximate division on GPUs), so ``slot_logits`` is bit-identical to the torch
formula. ``x`` is never stored by ``plain_slot``: each pass recomputes it.

- ``slot_logits`` (top-k / top-p rows, whose own kernels follow): one launch, ``_logits``, grid
  ``(rows, chunks of CHUNK tokens)``, writes ``x``.
- ``plain_slot`` (unfiltered and greedy rows): ``_stats`` (grid ``(rows, chunks)``) keeps each chunk's max
  of ``x``, its mass ``Σ exp(x - chunk max)`` and the first index of its max; ``_write`` (same grid)
  combines its row's chunk stats (every program the same arithmetic, so all agree) into the row's max,
  mass and argmax, writes its chunk of the softmax (a sampled row) or of the one-hot at the argmax (a greedy
  row) and the sum of the values it wrote; ``kvspec_kernels.inverse_cdf._pick`` (one program per row) then
  draws from the written row with those sums, by the shared inverse-CDF rule. A greedy row's one-hot has
  exactly one chunk sum of 1 and a CDF of 0 before the argmax and 1 from it on, so the rule yields the
  argmax for any uniform in [0, 1]: its token comes from the same pick, no separate write.

The draft graphs (specd/engine/draft_graphs.py) and the eager ``SlotSampler`` (specd/drafter/base.py) both call
these, so a captured round and its eager reference give the same bits on either device. ``KVSPEC_MARKOV_SLOT=0``
sends CUDA tensors to the torch references (kvspec_kernels/dispatch.py). Written without a GPU (session 51):
interpreted against the references, compiled for sm_90 ahead of time with the division checked in the PTX
(tests/kernels/markov_slot_cuda_compile.py); ``bash bench/gpu/session.sh markov`` checks and times them on one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.alignment import aligned
from kvspec_kernels.dispatch import markov_slot_kernels
from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.inverse_cdf import CHUNK, _pick, draw_ref

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def slot_logits(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """base: [R, V] bf16/fp16/fp32, vocabulary dimension contiguous, any row stride (a slot's view
    ``logits[:, k]``); bias: [R, V] float (vocabulary contiguous) or None; temperature: [R] fp32 > 0;
    out: [R, V] fp32 (vocabulary contiguous) or None (allocated). Returns ``out`` holding
    ``(base.float() + bias.float()) / temperature[:, None]``, bit for bit."""
    fn = slot_logits_triton if markov_slot_kernels(base.device) else slot_logits_ref
    return fn(base, bias, temperature, out)


def plain_slot(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor, uniforms: torch.Tensor,
               greedy: torch.Tensor, out: torch.Tensor, any_sampled: bool = True, any_greedy: bool = True
               ) -> torch.Tensor:
    """A slot of unfiltered and greedy rows. base/bias/temperature as ``slot_logits``; uniforms: [R] fp32 in
    [0, 1), any stride (a column ``u[:, k]``); greedy: [R] bool; out: [R, V] fp32, vocabulary contiguous, any
    row stride (a slot's view ``probs[:, k]``). Writes ``softmax(x)`` into a sampled row of ``out`` and the
    one-hot at ``argmax(x)`` (its first index) into a greedy row; returns tokens [R] int64: a sampled row's
    inverse-CDF draw at its uniform (kvspec_kernels/inverse_cdf.py's rule), a greedy row's argmax.
    ``any_sampled`` / ``any_greedy``: False when the caller knows on the host that no row is sampled / greedy;
    the reference then skips the softmax and the draw / the one-hot (the CPU's drafts), the kernels ignore
    them (their passes serve both)."""
    if markov_slot_kernels(base.device):
        return plain_slot_triton(base, bias, temperature, uniforms, greedy, out)
    return plain_slot_ref(base, bias, temperature, uniforms, greedy, out, any_sampled, any_greedy)


def slot_logits_ref(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    _check_logits_args(base, bias, temperature, out)
    x = _logits_ref(base, bias, temperature)
    return x if out is None else out.copy_(x)


def _logits_ref(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor) -> torch.Tensor:
    """``slot_logits_ref``'s formula on checked arguments (``plain_slot_ref`` checks its own once)."""
    x = base.float() if bias is None else base.float() + bias.float()
    return x / temperature[:, None]


def plain_slot_ref(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor, uniforms: torch.Tensor,
                   greedy: torch.Tensor, out: torch.Tensor, any_sampled: bool = True, any_greedy: bool = True
                   ) -> torch.Tensor:
    _check_plain_args(base, bias, temperature, uniforms, greedy, out)
    x = _logits_ref(base, bias, temperature)
    if not any_sampled:                       # every row greedy (the caller's host knowledge): no softmax, no draw
        argmax = x.argmax(dim=1)
        out.zero_().scatter_(1, argmax[:, None], 1.0)
        return argmax
    probs = torch.softmax(x, dim=1)
    drawn = draw_ref(probs, uniforms)
    if not any_greedy:                        # every row sampled: no argmax, no one-hot
        out.copy_(probs)
        return drawn
    argmax = x.argmax(dim=1)
    one_hot = torch.zeros_like(probs).scatter_(1, argmax[:, None], 1.0)
    out.copy_(torch.where(greedy[:, None], one_hot, probs))
    return torch.where(greedy, argmax, drawn)


def slot_logits_triton(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """One launch, no host synchronisation (capturable in a CUDA graph)."""
    _check_logits_args(base, bias, temperature, out)
    temperature = aligned(temperature)      # kvspec_kernels/alignment.py; base, bias and out are big: never copied
    rows, vocab = base.shape
    if out is None:
        out = torch.empty((rows, vocab), dtype=torch.float32, device=base.device)
    if rows == 0:
        return out
    bias_arg, stride_b = (base, 0) if bias is None else (bias, bias.stride(0))
    _logits[(rows, triton.cdiv(vocab, CHUNK))](base, bias_arg, temperature, out, vocab, base.stride(0), stride_b,
                                               temperature.stride(0), out.stride(0), CHUNK=CHUNK,
                                               HAS_BIAS=bias is not None, num_warps=8)
    return out


def plain_slot_triton(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
                      uniforms: torch.Tensor, greedy: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Three launches (``_stats``, ``_write``, ``_pick``), no host synchronisation (capturable in a CUDA
    graph); misaligned small arguments are copied first (kvspec_kernels/alignment.py)."""
    _check_plain_args(base, bias, temperature, uniforms, greedy, out)
    temperature, uniforms, greedy = aligned(temperature), aligned(uniforms), aligned(greedy)
    rows, vocab = base.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=base.device)
    if rows == 0:
        return tokens
    chunks = triton.cdiv(vocab, CHUNK)
    block_s = triton.next_power_of_2(chunks)
    stats = torch.empty((rows, chunks, 3), dtype=torch.float32, device=base.device)   # max, mass, first argmax
    sums = torch.empty((rows, chunks), dtype=torch.float32, device=base.device)      # of the written values
    bias_arg, stride_b = (base, 0) if bias is None else (bias, bias.stride(0))
    common = (vocab, base.stride(0), stride_b, temperature.stride(0))
    _stats[(rows, chunks)](base, bias_arg, temperature, stats, *common, CHUNK=CHUNK, HAS_BIAS=bias is not None,
                           num_warps=8)
    _write[(rows, chunks)](base, bias_arg, temperature, greedy, stats, out, sums, *common, greedy.stride(0),
                           out.stride(0), chunks, CHUNK=CHUNK, BLOCK_S=block_s, HAS_BIAS=bias is not None,
                           num_warps=8)
    _pick[(rows,)](out, uniforms, sums, tokens, vocab, out.stride(0), uniforms.stride(0), chunks,
                   CHUNK=CHUNK, BLOCK_S=block_s, num_warps=8)
    return tokens


def _check_logits_args(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
                       out: torch.Tensor | None) -> None:
    if base.dim() != 2 or base.dtype not in _INPUT_DTYPES or base.shape[1] == 0:
        raise KernelArgumentError(f"base must be [R, V>0] bf16, fp16 or fp32, got {tuple(base.shape)} {base.dtype}")
    if base.stride(1) != 1:
        raise KernelArgumentError("the vocabulary dimension of base must be contiguous")
    shape = tuple(base.shape)
    if bias is not None:
        if tuple(bias.shape) != shape or bias.dtype not in _INPUT_DTYPES:
            raise KernelArgumentError(f"bias must be {list(shape)} bf16, fp16 or fp32, got {tuple(bias.shape)} "
                                      f"{bias.dtype}")
        if bias.stride(1) != 1:
            raise KernelArgumentError("the vocabulary dimension of bias must be contiguous")
    if tuple(temperature.shape) != shape[:1] or temperature.dtype != torch.float32:
        raise KernelArgumentError(f"temperature must be [{shape[0]}] fp32, got {tuple(temperature.shape)} "
                                  f"{temperature.dtype}")
    if out is not None:
        if tuple(out.shape) != shape or out.dtype != torch.float32:
            raise KernelArgumentError(f"out must be {list(shape)} fp32, got {tuple(out.shape)} {out.dtype}")
        if out.stride(1) != 1:
            raise KernelArgumentError("the vocabulary dimension of out must be contiguous")
    for name, t in (("bias", bias), ("temperature", temperature), ("out", out)):
        if t is not None and t.device != base.device:
            raise KernelArgumentError(f"base on {base.device}, {name} on {t.device}")


def _check_plain_args(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
                      uniforms: torch.Tensor, greedy: torch.Tensor, out: torch.Tensor) -> None:
    if out is None:
        raise KernelArgumentError("plain_slot writes into out: pass an [R, V] fp32 tensor")
    _check_logits_args(base, bias, temperature, out)
    rows = base.shape[0]
    if tuple(uniforms.shape) != (rows,) or uniforms.dtype != torch.float32:
        raise KernelArgumentError(f"uniforms must be [{rows}] fp32, got {tuple(uniforms.shape)} {uniforms.dtype}")
    if tuple(greedy.shape) != (rows,) or greedy.dtype != torch.bool:
        raise KernelArgumentError(f"greedy must be [{rows}] bool, got {tuple(greedy.shape)} {greedy.dtype}")
    for name, t in (("uniforms", uniforms), ("greedy", greedy)):
        if t.device != base.device:
            raise KernelArgumentError(f"base on {base.device}, {name} on {t.device}")


@triton.jit
def _x(base_ptr, bias_ptr, t, row, idx, inside, stride_base, stride_bias, HAS_BIAS: tl.constexpr):
    """x = (base + bias) / T in fp32, rounded as torch rounds it; -inf outside the row."""
    x = tl.load(base_ptr + row * stride_base + idx, mask=inside, other=float("-inf")).to(tl.float32)
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + row * stride_bias + idx, mask=inside, other=0.0).to(tl.float32)
    return tl.math.div_rn(x, t)


# the small arguments' strides are 1 in the engine but any in a caller's view: not specialised, one build
@triton.jit(do_not_specialize=["stride_t"])
def _logits(base_ptr, bias_ptr, t_ptr, out_ptr, vocab, stride_base, stride_bias, stride_t, stride_o,
            CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    inside = idx < vocab
    x = _x(base_ptr, bias_ptr, tl.load(t_ptr + row * stride_t), row, idx, inside, stride_base, stride_bias, HAS_BIAS)
    tl.store(out_ptr + row * stride_o + idx, x, mask=inside)


@triton.jit(do_not_specialize=["stride_t"])
def _stats(base_ptr, bias_ptr, t_ptr, stats_ptr, vocab, stride_base, stride_bias, stride_t,
           CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """stats[row, chunk] = (max of x, Σ exp(x - that max) over finite x, first index of the max as a float:
    exact below 2^24)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inside = idx < vocab
    x = _x(base_ptr, bias_ptr, tl.load(t_ptr + row * stride_t), row, idx, inside, stride_base, stride_bias, HAS_BIAS)
    top = tl.max(x, 0)
    # an all -inf chunk (top = -inf) is shifted by 0, not by -inf (-inf - -inf is NaN): its mass is 0
    mass = tl.sum(tl.exp(x - tl.where(top > float("-inf"), top, 0.0)), 0)
    first = tl.min(tl.where(inside & (x == top), idx, vocab), 0)
    at = stats_ptr + (row * tl.num_programs(1) + c) * 3
    tl.store(at, top)
    tl.store(at + 1, mass)
    tl.store(at + 2, first.to(tl.float32))


@triton.jit(do_not_specialize=["stride_t", "stride_g"])
def _write(base_ptr, bias_ptr, t_ptr, greedy_ptr, stats_ptr, out_ptr, sums_ptr, vocab, stride_base, stride_bias,
           stride_t, stride_g, stride_o, chunks, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A chunk of the row's softmax (sampled) or one-hot at the first argmax (greedy), and the chunk's sum of
    what it wrote (``_pick`` reads those instead of summing the written row again). A sampled row of -inf
    only writes zeros (torch's softmax gives NaN) and so draws token V - 1; a greedy one takes token 0, as
    torch.argmax does."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    real = s < chunks
    at = stats_ptr + (row * chunks + s) * 3
    chunk_top = tl.load(at, mask=real, other=float("-inf"))
    chunk_mass = tl.load(at + 1, mask=real, other=0.0)
    chunk_first = tl.load(at + 2, mask=real, other=float("inf"))
    top = tl.max(chunk_top, 0)
    shift = tl.where(top > float("-inf"), top, 0.0)                 # as in _stats
    total = tl.sum(chunk_mass * tl.exp(chunk_top - shift), 0)
    argmax = tl.min(tl.where(real & (chunk_top == top), chunk_first, float("inf")), 0).to(tl.int32)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inside = idx < vocab
    x = _x(base_ptr, bias_ptr, tl.load(t_ptr + row * stride_t), row, idx, inside, stride_base, stride_bias, HAS_BIAS)
    soft = tl.where(x > float("-inf"), tl.exp(x - shift) * (1.0 / total), 0.0)     # (a row of -inf: total 0)
    one_hot = tl.where(idx == argmax, 1.0, 0.0)
    p = tl.where(tl.load(greedy_ptr + row * stride_g) != 0, one_hot, soft)
    tl.store(out_ptr + row * stride_o + idx, p, mask=inside)
    tl.store(sums_ptr + row * chunks + c, tl.sum(tl.where(inside, p, 0.0), 0))

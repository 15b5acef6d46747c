"""Check every kernel against its torch reference on realistic CUDA shapes, and time it.

    python -m bench.kernels_gpu --out kernels_gpu.json

Shapes: Qwen2.5-0.5B (14 query heads, 2 KV heads, head_dim 64, 24 layers) and Qwen3-8B (32, 8,
128, 36 layers), bf16, block size 16, per-layer views of a [N, L, 2, bs, Hkv, D] pool with
permuted block tables. ``median_us`` is GPU time: a CUDA graph replays the kernel over enough
rotated inputs (other layers, other blocks) that the working set is at least twice the 60 MB L2,
and the median replay is divided by the number of calls (``triton.testing.do_bench_cudagraph``).
``eager_us`` is one eager call through ``triton.testing.do_bench``: at decode sizes it is the
Python launch overhead, which is why the engine captures decode steps in CUDA graphs. Decode
attention reports achieved bandwidth (K/V bytes read plus q and out) against the 4.3 TB/s copy
bandwidth measured on the H200. Without CUDA it writes a "skipped" record.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from kvspec_kernels.block_copy import gather_blocks_ref, gather_blocks_triton, scatter_blocks_ref, scatter_blocks_triton
from kvspec_kernels.kv_append import append_kv_ref, append_kv_triton
from kvspec_kernels.paged_attention import paged_attention_ref, paged_attention_triton
from kvspec_kernels.rejection_sample import rejection_sample_ref, rejection_sample_triton
from kvspec_kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kvspec_kernels.rotary import rotary_ref, rotary_triton

HBM_BYTES_PER_S = 4.3e12  # device-to-device copy on the benchmark H200 (DESIGN.md section 10)
BLOCK_SIZE = 16
MODELS = {
    "qwen2.5-0.5b": dict(num_q_heads=14, num_kv_heads=2, head_dim=64, num_layers=24, hidden=896),
    "qwen3-8b": dict(num_q_heads=32, num_kv_heads=8, head_dim=128, num_layers=36, hidden=4096),
}
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXTS = (512, 4096)
SPLIT_SWEEP = (1, 4, 16)
BLOCK_WORDS_SWEEP = (512, 1024, 4096)
L2_BYTES = 60 * 2**20
MAX_ROTATIONS = 512
BF16_TOL = 2e-2
FP32_TOL = 1e-4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only the prefill tile-size sweep (sweep_prefill; about a minute on the H200)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        _write(args.out, {"skipped": "CUDA is not available"})
        print("skipped: CUDA is not available")
        return 0
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": _triton_version(), "hbm_bytes_per_s": HBM_BYTES_PER_S, "records": []}
    records = results["records"]
    if args.prefill_sweep:
        for model, shape in MODELS.items():
            records += sweep_prefill(model, shape)
            _write(args.out, results)   # after each model: a call cut by its timeout keeps what finished
        failed = [r for r in records if r.get("ok") is False]
        print(f"{len(records)} sweep records, {len(failed)} outputs off the default's -> {args.out}")
        return 1 if failed else 0
    for model, shape in MODELS.items():
        pool = _make_pool(max(DECODE_BATCHES) * max(DECODE_CONTEXTS) // BLOCK_SIZE + 64, shape)
        records += check_attention(model, shape, pool)
        records += time_decode(model, shape, pool)
        records += time_prefill(model, shape, pool)
        records += check_append(model, shape, pool)
        records += check_norm_rotary(model, shape)
        del pool
        torch.cuda.empty_cache()
    records += check_block_copy()
    records += check_rejection_sample()
    _write(args.out, results)
    failed = [r for r in records if r.get("ok") is False]
    print(f"{len(records)} records, {len(failed)} failed checks -> {args.out}")
    return 1 if failed else 0


def _make_pool(num_blocks: int, shape: dict) -> torch.Tensor:
    """[N, L, 2, bs, Hkv, D] bf16, random."""
    dims = (num_blocks, shape["num_layers"], 2, BLOCK_SIZE, shape["num_kv_heads"], shape["head_dim"])
    return torch.randn(dims, device="cuda", dtype=torch.bfloat16)


def _batch(shape: dict, pool: torch.Tensor, q_lens: list[int], seq_lens: list[int], dtype=torch.bfloat16,
           layer: int = 1):
    """Queries and metadata for one ragged batch over one layer of the pool (permuted block ids)."""
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    ids = torch.randperm(pool.shape[0], device="cuda")[: sum(need)].int()
    tables = torch.zeros((len(seq_lens), max(need)), dtype=torch.int32, device="cuda")
    for b, start in enumerate(torch.tensor([0] + need).cumsum(0)[:-1].tolist()):
        tables[b, : need[b]] = ids[start:start + need[b]]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), shape["num_q_heads"], shape["head_dim"], device="cuda", dtype=dtype)
    k_pool, v_pool = pool[:, layer, 0], pool[:, layer, 1]  # the strided views, not copies
    if dtype != pool.dtype:
        k_pool, v_pool = k_pool.to(dtype), v_pool.to(dtype)
    return q, k_pool, v_pool, tables, cu, lens


def check_attention(model: str, shape: dict, pool: torch.Tensor) -> list[dict]:
    """Decode, verify, prefill over a cached prefix and a sliding window, against the reference."""
    cases = {
        "decode": ([1] * 4, [700, 33, 4096, 1], None, torch.bfloat16),
        "verify": ([8, 8, 3], [900, 64, 4000], None, torch.bfloat16),
        "prefill_cached_prefix": ([200, 1, 37], [1000, 5, 37], None, torch.bfloat16),
        "window_512": ([1, 16, 300], [3000, 700, 900], 512, torch.bfloat16),
        "verify_fp32": ([4, 2], [300, 2000], None, torch.float32),
    }
    records = []
    for name, (q_lens, seq_lens, window, dtype) in cases.items():
        q, k_pool, v_pool, tables, cu, lens = _batch(shape, pool, q_lens, seq_lens, dtype)
        scale = shape["head_dim"] ** -0.5
        want = paged_attention_ref(q, k_pool, v_pool, tables, cu, lens, scale, window).float()
        for splits in (None, 4):
            got = paged_attention_triton(q, k_pool, v_pool, tables, cu, lens, scale, window, num_splits=splits)
            err = (got.float() - want).abs().max().item()
            tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
            records.append({"kernel": "paged_attention", "check": name, "model": model, "num_splits": splits,
                            "max_abs_err": err, "ok": err <= tol})
    return records


def time_decode(model: str, shape: dict, pool: torch.Tensor) -> list[dict]:
    records = []
    scale = shape["head_dim"] ** -0.5
    kv_bytes_per_token = 2 * shape["num_kv_heads"] * shape["head_dim"] * pool.element_size()
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            moved = batch * context * kv_bytes_per_token + 2 * batch * shape["num_q_heads"] * shape["head_dim"] * 2
            inputs = [_batch(shape, pool, [1] * batch, [context] * batch, layer=r % pool.shape[1])
                      for r in range(_rotations(moved))]
            for splits in (None,) + SPLIT_SWEEP:
                calls = [lambda a=a: paged_attention_triton(*a, scale, max_q_len=1, num_splits=splits)
                         for a in inputs]
                us = _bench_graph(calls)
                records.append({"kernel": "paged_attention", "timing": "decode", "model": model, "batch": batch,
                                "context": context, "num_splits": splits or "auto", "median_us": us,
                                "eager_us": _bench(calls[0]) * 1e3, "rotations": len(calls), "bytes": moved,
                                "tb_per_s": moved / us / 1e6, "fraction_of_hbm": moved / (us * 1e-6) / HBM_BYTES_PER_S})
            del inputs
    return records


def prefill_flops(q_len: int, context: int, shape: dict) -> float:
    """Causal attention of ``q_len`` new tokens ending a ``context``-token sequence: query i sees
    (context - q_len + i + 1) keys; 2 matmuls of 2*D flops per (query, key, head)."""
    pairs = q_len * (context - q_len) + q_len * (q_len + 1) / 2
    return 4 * pairs * shape["head_dim"] * shape["num_q_heads"]


def time_prefill(model: str, shape: dict, pool: torch.Tensor) -> list[dict]:
    """One 2048-token prompt on a 2048-token cached prefix: compute-bound, reported in TFLOP/s."""
    q_len, context = 2048, 4096
    q, k_pool, v_pool, tables, cu, lens = _batch(shape, pool, [q_len], [context])
    scale = shape["head_dim"] ** -0.5
    ms = _bench(lambda: paged_attention_triton(q, k_pool, v_pool, tables, cu, lens, scale, max_q_len=q_len))
    flops = prefill_flops(q_len, context, shape)
    return [{"kernel": "paged_attention", "timing": "prefill", "model": model, "q_len": q_len, "context": context,
             "median_us": ms * 1e3, "tflop_per_s": flops / ms / 1e9}]


PREFILL_SWEEP = ((2048, 4096), (8192, 16384))      # (new tokens, KV length): issue 7's long agentic prefills
SWEEP_BLOCK_M = (64, 128, 256)
SWEEP_WARPS = (4, 8)


def sweep_prefill(model: str, shape: dict) -> list[dict]:
    """Prefill attention by tile size (``max_block_m``) and warps, one long prompt on a cached prefix.
    Why: with GQA 7 the default 64-row tile holds 9 query tokens, so each K/V tile is re-read once per 9
    new tokens; a bigger tile reads it less often but needs more registers. Each setting's output is
    compared with the default's (the default is checked against the reference in check_attention)."""
    out = []
    scale = shape["head_dim"] ** -0.5
    for q_len, context in PREFILL_SWEEP:
        pool = _make_pool(-(-context // BLOCK_SIZE) + 64, shape)
        q, k_pool, v_pool, tables, cu, lens = _batch(shape, pool, [q_len], [context])
        base = paged_attention_triton(q, k_pool, v_pool, tables, cu, lens, scale, max_q_len=q_len)
        flops = prefill_flops(q_len, context, shape)
        for block_m in SWEEP_BLOCK_M:
            for warps in SWEEP_WARPS:
                rec = {"kernel": "paged_attention", "timing": "prefill_sweep", "model": model, "q_len": q_len,
                       "context": context, "max_block_m": block_m, "num_warps": warps}
                try:
                    def fn(bm=block_m, w=warps):
                        return paged_attention_triton(q, k_pool, v_pool, tables, cu, lens, scale, max_q_len=q_len,
                                                      max_block_m=bm, num_warps=w)
                    diff = (fn().float() - base.float()).abs().max().item()
                    ms = _bench(fn)
                    rec.update(median_us=ms * 1e3, tflop_per_s=flops / ms / 1e9, max_abs_diff_vs_default=diff,
                               ok=diff <= BF16_TOL)
                except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result too
                    rec.update(error=f"{type(e).__name__}: {e}"[:300])
                out.append(rec)
                print(rec, flush=True)
        del pool
        torch.cuda.empty_cache()
    return out


def check_append(model: str, shape: dict, pool: torch.Tensor) -> list[dict]:
    records = []
    for tokens in (32, 2048):
        dims = (tokens, shape["num_kv_heads"], shape["head_dim"])
        k = torch.randn(dims, device="cuda", dtype=pool.dtype)
        v = torch.randn(dims, device="cuda", dtype=pool.dtype)
        slots = torch.randperm(pool.shape[0] * BLOCK_SIZE, device="cuda")[:tokens]
        want = pool[:, 2].clone()
        append_kv_ref(k, v, want[:, 0], want[:, 1], slots)
        append_kv_triton(k, v, pool[:, 2, 0], pool[:, 2, 1], slots)
        ok = torch.equal(pool[:, 2], want)
        del want
        moved = 4 * k.numel() * k.element_size()  # read k, v; write k, v
        calls = [lambda layer=layer: append_kv_triton(k, v, pool[:, layer, 0], pool[:, layer, 1], slots)
                 for layer in range(pool.shape[1])]
        us = _bench_graph(calls)
        records.append({"kernel": "append_kv", "model": model, "tokens": tokens, "ok": ok, "median_us": us,
                        "eager_us": _bench(calls[0]) * 1e3, "tb_per_s": moved / us / 1e6})
    return records


def check_norm_rotary(model: str, shape: dict) -> list[dict]:
    """The one-launch RMSNorm and rotary (session 14; the default since session 15) against their torch
    references in bf16: the largest difference in output ulps, the fraction identical, and the GPU µs of
    one call of each in a graph (the references' several launches against one)."""
    records = []
    for tokens in (16, 2048):
        x = torch.randn(tokens, shape["hidden"], device="cuda", dtype=torch.bfloat16)
        w = (torch.rand(shape["hidden"], device="cuda") + 0.5).to(torch.bfloat16)
        q = torch.randn(tokens, shape["num_q_heads"], shape["head_dim"], device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(tokens, device="cuda", dtype=torch.float32)[:, None]
        freqs = pos * (1e6 ** (-torch.arange(0, shape["head_dim"], 2, device="cuda") / shape["head_dim"]))[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        cases = {"rms_norm": (lambda: rms_norm_triton(x, w, 1e-6), lambda: rms_norm_ref(x, w, 1e-6)),
                 "rotary": (lambda: rotary_triton(q, cos, sin), lambda: rotary_ref(q, cos, sin))}
        for name, (fused, ref) in cases.items():
            got, want = fused(), ref()
            scale = torch.maximum(got.float().abs(), want.float().abs()).clamp_min(1e-30)
            ulps = ((got.float() - want.float()).abs() / (scale * torch.finfo(torch.bfloat16).eps)).max().item()
            # RMSNorm rounds twice, like its reference: x / rms(x) to bf16, then w times that to bf16. The
            # fp32 statistic's sum order may move the first rounding by one ulp, and w (here up to 1.5)
            # times one ulp rounds to at most two of the output: H200, session 15, 2048 rows: 1.7 ulps
            # (two, at a mantissa of ~1.17) in 5 of 1.8 M outputs. Rotary rounds once: bit-exact.
            bound = 2.0 if name == "rms_norm" else 1.0
            records.append({"kernel": name, "model": model, "tokens": tokens, "ok": ulps <= bound, "max_ulps": ulps,
                            "identical_fraction": (got == want).float().mean().item(),
                            "median_us": _bench_graph([fused]), "reference_us": _bench_graph([ref])})
    return records


def check_block_copy() -> list[dict]:
    """Tier moves of Qwen-0.5B blocks (24 layers x 2 x 16 x 2 x 64 bf16 = 196,608 bytes)."""
    block_bytes, num_blocks, moved_blocks = 196_608, 4096, 256
    pool = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8, device="cuda")
    ids = torch.randperm(num_blocks, device="cuda")[:moved_blocks]
    got = gather_blocks_triton(pool, ids)
    ok_gather = torch.equal(got, gather_blocks_ref(pool, ids))
    src = torch.randint(0, 255, (moved_blocks, block_bytes), dtype=torch.uint8, device="cuda")
    want = pool.clone()
    scatter_blocks_ref(want, ids, src)
    scatter_blocks_triton(pool, ids, src)
    ok_scatter = torch.equal(pool, want)
    moved = 2 * moved_blocks * block_bytes
    records = []
    for words in BLOCK_WORDS_SWEEP:
        for name, ok, fn in (("gather_blocks", ok_gather, lambda: gather_blocks_triton(pool, ids, block_words=words)),
                             ("scatter_blocks", ok_scatter,
                              lambda: scatter_blocks_triton(pool, ids, src, block_words=words))):
            us = _bench_graph([fn])
            records.append({"kernel": name, "blocks": moved_blocks, "block_bytes": block_bytes, "ok": ok,
                            "block_words": words, "median_us": us, "tb_per_s": moved / us / 1e6})
    for name, fn in (("gather_blocks_ref", lambda: gather_blocks_ref(pool, ids)),
                     ("scatter_blocks_ref", lambda: scatter_blocks_ref(pool, ids, src))):
        us = _bench_graph([fn])
        records.append({"kernel": name, "blocks": moved_blocks, "block_bytes": block_bytes, "median_us": us,
                        "tb_per_s": moved / us / 1e6})
    return records


def check_rejection_sample() -> list[dict]:
    """Qwen vocabulary, 7 drafts, batches 1, 8 and 32: agreement with the reference and time, with the
    vocabulary passes split into parts (the default, ``vocab_splits``) and in one program a row (``splits=1``,
    the kernel's layout until session 46), in the same call."""
    records = []
    for batch in (1, 8, 32):
        k_max, vocab = 7, 151_936
        target = torch.softmax(torch.randn(batch, k_max + 1, vocab, device="cuda") * 3, -1)
        draft = torch.softmax(torch.randn(batch, k_max, vocab, device="cuda") * 3, -1)
        draft = torch.where(torch.rand(batch, k_max, 1, device="cuda") < 0.7, target[:, :k_max], draft)
        tokens = torch.multinomial(draft.flatten(0, 1), 1).view(batch, k_max)
        num_draft = torch.randint(0, k_max + 1, (batch,), device="cuda", dtype=torch.int32)
        uniforms, bonus = torch.rand(batch, k_max, device="cuda"), torch.rand(batch, device="cuda")
        args = (target, draft, tokens, num_draft, uniforms, bonus)
        want_len, want_out = rejection_sample_ref(*args)
        ref_eager_us = _bench(lambda: rejection_sample_ref(*args)) * 1e3     # one timing for both layouts' records
        for splits in (None, 1):
            got_len, got_out = rejection_sample_triton(*args, splits=splits)
            mismatched_rows = int(((got_out != want_out).any(1) | (got_len != want_len)).sum())
            records.append({"kernel": "rejection_sample" if splits is None else "rejection_sample_one_part",
                            "batch": batch, "k": k_max, "vocab": vocab,
                            "mismatched_rows": mismatched_rows, "ok": mismatched_rows == 0,
                            "median_us": _bench_graph([lambda: rejection_sample_triton(*args, splits=splits)]),
                            "eager_us": _bench(lambda: rejection_sample_triton(*args, splits=splits)) * 1e3,
                            "ref_eager_us": ref_eager_us})
    return records


def _bench(fn) -> float:
    """Median milliseconds of one eager call (launch overhead included)."""
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median")


def _bench_graph(calls: list) -> float:
    """Median GPU microseconds per call, the calls captured back to back in one CUDA graph."""
    import triton.testing

    def run_all():
        for call in calls:
            call()

    return triton.testing.do_bench_cudagraph(run_all, return_mode="median") * 1e3 / len(calls)


def _rotations(bytes_per_call: int) -> int:
    """Distinct inputs per graph so the replayed working set is at least twice the L2."""
    return max(1, min(MAX_ROTATIONS, -(-2 * L2_BYTES // bytes_per_call)))


def _triton_version() -> str:
    import triton

    return triton.__version__


def _write(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

"""What the sampling transform costs on the GPU, by rows: the sorted top-p reference against the
exact and the rounded (draft) kernels of kvspec_kernels/nucleus.py, and the cumsum draw against
kvspec_kernels/inverse_cdf.py, eager and replayed from a CUDA graph, beside softmax and torch.topk.

    python -m bench.sampling_cost --out sampling_cost.json            # CUDA
    python -m bench.sampling_cost --tiny --out /tmp/s.json            # CPU smoke test (reference only)
    git show acf227e:kvspec_kernels/nucleus.py > /tmp/one_level.py   # the one-level ladder (before session 31)
    python -m bench.sampling_cost --out s.json --against /tmp/one_level.py   # both versions' kernels, one run

Why: run AD (session 10) showed a plain step 0.6-1.7 ms slower on the four top-p workloads than on the
greedy one, and a draft round 1.5-7 ms slower; this separates the transform from the rest of a step.
Logits are synthetic (no model needed): Zipf-shaped rows, ``-a * ln(rank)`` over a random permutation of
the vocabulary, scaled by 1 / temperature, with ``a`` spread so that nuclei run from a handful of
tokens to thousands; the JSON records each row set's nucleus sizes. Each cell is the median of
``--repeats`` timings (CUDA events), host launch time measured apart (no sync).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from kvspec_kernels.inverse_cdf import draw_ref, draw_triton
from kvspec_kernels.nucleus import (bucket_nucleus_probs_ref, bucket_nucleus_probs_triton, nucleus_probs_ref,
                             nucleus_probs_triton)
from specd.engine.keyed_graphs import capture_graph

VOCAB = 151936


def zipf_logits(rows: int, vocab: int, device: str, seed: int = 0, a_range: tuple[float, float] = (0.9, 2.2)
                ) -> torch.Tensor:
    """[rows, vocab] fp32: row i is -a_i * ln(rank) over a random permutation, a_i spread over ``a_range``
    (the default: top-p 0.9 nuclei from 72k tokens down to 4; 1.3-3.0: from ~650 down to 2)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = a_range
    a = torch.linspace(lo, hi, rows) if rows > 1 else torch.tensor([max(lo, 1.3)])
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    out = torch.empty(rows, vocab)
    for i in range(rows):
        out[i, torch.randperm(vocab, generator=g)] = -a[i] * torch.log(rank)
    return out.to(device)


def _time(fn, repeats: int, cuda: bool) -> dict:
    """Median ms of ``fn()`` end to end and of its host launch time alone."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    total, host = [], []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            host.append((time.perf_counter() - t0) * 1e3)
            end.synchronize()
            total.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            total.append((time.perf_counter() - t0) * 1e3)
    out = {"ms_p50": statistics.median(total), "ms_p90": sorted(total)[int(0.9 * (len(total) - 1))]}
    if host:
        out["host_ms_p50"] = statistics.median(host)
    return out


def _graphed(fn):
    """fn captured in a CUDA graph: returns the replay."""
    return capture_graph(fn, None).replay


def load_against(path: Path):
    """Another version of kvspec_kernels/nucleus.py as a module of its own (``--against``), e.g. the file at
    an older commit (`git show COMMIT:kvspec_kernels/nucleus.py > F`), so both are timed in one run."""
    if not path.is_file():
        raise SystemExit(f"--against: no file {path}")
    spec = importlib.util.spec_from_file_location("nucleus_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("nucleus_probs_triton", "bucket_nucleus_probs_triton"):
        if not callable(getattr(module, name, None)):
            raise SystemExit(f"--against: {path} has no {name}")
    return module


def compare_against(rec: dict, logits: torch.Tensor, p: torch.Tensor, ref: torch.Tensor, against, timed) -> None:
    """Add to ``rec`` (which holds this tree's ``kernel_graph`` and ``rounded_graph`` timings) the other
    version's kernels on the same rows: its rows off the sorted reference, its timings, and this tree's
    over its. ``timed(fn)``: a timing of ``fn`` (measure: replayed from a CUDA graph). This tree's kernels
    are timed once more after the other's, so each ratio's numerator is the mean of two timings that
    bracket its denominator (a drift during the record cancels to first order)."""
    other = against.nucleus_probs_triton(logits, p)
    rec["against_rows_with_other_kept_set"] = int(((other > 0) != (ref > 0)).any(1).sum())
    rec["against_kernel_graph"] = timed(lambda: against.nucleus_probs_triton(logits, p))
    rec["against_rounded_graph"] = timed(lambda: against.bucket_nucleus_probs_triton(logits, p))
    rec["kernel_graph_again"] = timed(lambda: nucleus_probs_triton(logits, p))
    rec["rounded_graph_again"] = timed(lambda: bucket_nucleus_probs_triton(logits, p))
    for name in ("kernel", "rounded"):
        mine = (rec[f"{name}_graph"]["ms_p50"] + rec[f"{name}_graph_again"]["ms_p50"]) / 2
        rec[f"{name}_over_against_graph"] = mine / rec[f"against_{name}_graph"]["ms_p50"]


def measure(rows_list: list[int], vocab: int, device: str, repeats: int, top_p: float,
            a_range: tuple[float, float] = (0.9, 2.2), against=None) -> list[dict]:
    cuda = device.startswith("cuda")
    records = []
    for rows in rows_list:
        logits = zipf_logits(rows, vocab, device, a_range=a_range)
        p = torch.full((rows,), top_p, device=device)
        ref = nucleus_probs_ref(logits, p)
        u = torch.rand(rows, device=device)
        rounded = bucket_nucleus_probs_ref(logits, p)
        rec = {"rows": rows, "vocab": vocab, "top_p": top_p,
               "nucleus_sizes": sorted((ref > 0).sum(1).tolist()),
               "rounded_nucleus_sizes": sorted((rounded > 0).sum(1).tolist()),
               "rounded_extra_mass_p50": float(torch.where(ref > 0, 0.0, rounded).sum(1).median()),
               "sorted_ref": _time(lambda: nucleus_probs_ref(logits, p), repeats, cuda),
               "softmax": _time(lambda: torch.softmax(logits, dim=1), repeats, cuda),
               "draw_cumsum": _time(lambda: draw_ref(ref, u), repeats, cuda),
               "topk_64": _time(lambda: torch.topk(logits, 64, dim=1), repeats, cuda),
               "topk_1024": _time(lambda: torch.topk(logits, 1024, dim=1), repeats, cuda)}
        if cuda:
            got = nucleus_probs_triton(logits, p)
            rec["kernel_rows_with_other_kept_set"] = int(((got > 0) != (ref > 0)).any(1).sum())
            rec["kernel_max_abs_diff"] = float((got - ref).abs().max())
            rec["draw_kernel"] = _time(lambda: draw_triton(ref, u), repeats, cuda)
            rec["draw_kernel_graph"] = _time(_graphed(lambda: draw_triton(ref, u)), repeats, cuda)
            rec["draw_cumsum_graph"] = _time(_graphed(lambda: draw_ref(ref, u)), repeats, cuda)
            rec["draw_same_tokens"] = bool(torch.equal(draw_triton(ref, u), draw_ref(ref, u)))
            rec["kernel"] = _time(lambda: nucleus_probs_triton(logits, p), repeats, cuda)
            rec["sorted_ref_graph"] = _time(_graphed(lambda: nucleus_probs_ref(logits, p)), repeats, cuda)
            rec["kernel_graph"] = _time(_graphed(lambda: nucleus_probs_triton(logits, p)), repeats, cuda)
            got = bucket_nucleus_probs_triton(logits, p)
            rec["rounded_rows_with_other_kept_set"] = int(((got > 0) != (rounded > 0)).any(1).sum())
            rec["rounded"] = _time(lambda: bucket_nucleus_probs_triton(logits, p), repeats, cuda)
            rec["rounded_graph"] = _time(_graphed(lambda: bucket_nucleus_probs_triton(logits, p)), repeats, cuda)
            if against is not None:      # the other version's kernels on the same rows, in the same run
                compare_against(rec, logits, p, ref, against,
                                lambda fn: _time(_graphed(fn), repeats, cuda))     # noqa: B023 (called at once)
            rec["kernel_speedup_eager"] = rec["sorted_ref"]["ms_p50"] / rec["kernel"]["ms_p50"]
            rec["kernel_speedup_graph"] = rec["sorted_ref_graph"]["ms_p50"] / rec["kernel_graph"]["ms_p50"]
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--rows", default="1,4,8,32,64,256", help="row counts to time (comma-separated)")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--zipf-a", default="0.9,2.2",
                    help="the rows' Zipf exponents, LO,HI (0.9,2.2: nuclei up to 72k tokens; 1.3,3.0: up to ~650)")
    ap.add_argument("--tiny", action="store_true", help="CPU, vocabulary 4,096, 3 repeats (a smoke test)")
    ap.add_argument("--against", type=Path, default=None,
                    help="another version of kvspec_kernels/nucleus.py (e.g. `git show COMMIT:kvspec_kernels/"
                         "nucleus.py > F`): its kernels are timed beside this tree's on the same rows (CUDA)")
    args = ap.parse_args(argv)
    against = load_against(args.against) if args.against is not None else None
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    vocab = 4096 if args.tiny else VOCAB
    repeats = 3 if args.tiny else args.repeats
    rows = [int(r) for r in args.rows.split(",")]
    a_range = tuple(float(a) for a in args.zipf_a.split(","))
    records = measure(rows, vocab, device, repeats, args.top_p, a_range, against)
    for r in records:
        print(f"rows {r['rows']:4d}  sorted {r['sorted_ref']['ms_p50']:.3f} ms"
              + (f"  exact {r['kernel']['ms_p50']:.3f}  rounded {r['rounded']['ms_p50']:.3f}  |  in a graph: sorted "
                 f"{r['sorted_ref_graph']['ms_p50']:.3f}  exact {r['kernel_graph']['ms_p50']:.3f}  rounded "
                 f"{r['rounded_graph']['ms_p50']:.3f}  |  rows off the reference: exact "
                 f"{r['kernel_rows_with_other_kept_set']}, rounded {r['rounded_rows_with_other_kept_set']}  |  draw: "
                 f"cumsum {r['draw_cumsum_graph']['ms_p50']:.3f}  kernel {r['draw_kernel_graph']['ms_p50']:.3f} in a "
                 f"graph, same tokens {r['draw_same_tokens']}"
                 if "kernel" in r else "")
              + (f"  |  against {args.against}: exact {r['against_kernel_graph']['ms_p50']:.3f}  rounded "
                 f"{r['against_rounded_graph']['ms_p50']:.3f} in a graph ({r['kernel_over_against_graph']:.2f}x, "
                 f"{r['rounded_over_against_graph']:.2f}x), rows off the reference "
                 f"{r['against_rows_with_other_kept_set']}" if "against_kernel_graph" in r else ""), flush=True)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "zipf_a": list(a_range), "against": None if args.against is None else str(args.against)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the time of an eager (non-graph) forward goes, on a random-weight model of a real shape.

    python -m bench.gpu_profile --shape qwen2.5-0.5b --out DIR
    python -m bench.gpu_profile --draft-round --out DIR          # one speculative round's pieces
    python -m bench.gpu_profile --draft-round --tiny --out DIR   # the same at toy sizes (CPU smoke test)

Why: on the H200 an eager forward of Qwen2.5-0.5B cost ~30 ms whatever the token count (13 or 4,096),
while a decode step replayed from a CUDA graph cost 2.8 ms. This separates host launch time from GPU
time, counts launches, and times one Triton launch and one tiny aten op on the machine's CPU.
Weights are random: timing does not depend on their values, so no upload is needed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specd.engine.paged_backend import PagedAttentionBackend, StepMetadata
from specd.loader.random_weights import SHAPES as MODEL_SHAPES
from specd.models.config import ModelConfig
from specd.models.decoder import DecoderModel
from specd.sampling_params import SamplingParams

SHAPES = {  # the published shapes live with the random-weights loader; "tiny" is this profile's CPU smoke size
    "qwen2.5-0.5b": MODEL_SHAPES["qwen2.5-0.5b"],
    "qwen3-8b": MODEL_SHAPES["qwen3-8b"],
    "tiny": dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=2048),
}
BLOCK = 16


def random_model(shape: str, device: str = "cuda", dtype=torch.bfloat16) -> DecoderModel:
    cfg = ModelConfig(**SHAPES[shape])
    with torch.device(device):
        model = DecoderModel(cfg).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.eval()


def pool_for(cfg: ModelConfig, blocks: int, device: str, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(blocks, cfg.num_layers, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype)


def one_seq_meta(num_new: int, context: int, device: str) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
    total = context + num_new
    nblocks = -(-total // BLOCK)
    slots = torch.arange(context, total, device=device)
    meta = StepMetadata(slot_mapping=slots, block_tables=torch.arange(nblocks, dtype=torch.int32, device=device)[None],
                        cu_q_lens=torch.tensor([0, num_new], dtype=torch.int32, device=device),
                        seq_lens=torch.tensor([total], dtype=torch.int32, device=device), max_q_len=num_new)
    ids = torch.randint(0, 1000, (num_new,), device=device)
    return ids, torch.arange(context, total, device=device), meta


def rows_step(rows: list[tuple[int, int]]):
    """A step of one sequence per (cached tokens, new tokens) row, each in blocks of its own after the
    previous row's, with made-up token ids (timing does not depend on them)."""
    from specd.engine.cuda_graphs import HostStep

    ids, pos, slots, cu, seq_lens, tables = [], [], [], [0], [], []
    base = 0
    for i, (start, q) in enumerate(rows):
        n = -(-(start + q) // BLOCK)
        table = list(range(base, base + n))
        base += n
        ids += [(7 * i + j) % 1000 for j in range(q)]
        pos += list(range(start, start + q))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + q)]
        cu.append(cu[-1] + q)
        seq_lens.append(start + q)
        tables.append(table)
    return HostStep(ids, pos, slots, cu, seq_lens, tables, max(q for _, q in rows))


def time_forward(model, backend, ids, pos, meta, repeats: int = 10) -> dict:
    backend.set_step(meta)
    with torch.inference_mode():
        for _ in range(2):
            model.logits(model(ids, pos, backend).hidden[-1:])
        torch.cuda.synchronize()
        host, total = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.logits(model(ids, pos, backend).hidden[-1:])
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
    return {"host_launch_ms_p50": statistics.median(host), "total_ms_p50": statistics.median(total),
            "total_ms": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--graphs-only", action="store_true", help="only check and time the CUDA-graph step path")
    ap.add_argument("--draft-round", action="store_true",
                    help="time a speculative round's pieces (block forward, Markov loop eager vs graph, verify)")
    ap.add_argument("--tiny", action="store_true", help="--draft-round at toy sizes; runs on the CPU")
    ap.add_argument("--batches", default="1,8,32", help="--draft-round batch sizes")
    ap.add_argument("--context", type=int, default=512, help="--draft-round: drafter context tokens per request")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.draft_round:
        profile_draft_round("tiny" if args.tiny else args.shape, [int(b) for b in args.batches.split(",")], args.out,
                            context=args.context)
        return 0
    dev = "cuda"
    model = random_model(args.shape, dev)
    cfg = model.config
    pool = pool_for(cfg, 600, dev)
    backend = PagedAttentionBackend(pool, cfg.attn_scale)
    res: dict = {"shape": args.shape, "device": torch.cuda.get_device_name()}
    if args.graphs_only:
        graph_check(model, pool_for(cfg, 1400, dev), args.out)
        return 0
    for n, ctx in ((1, 512), (8, 512), (13, 4096), (512, 0), (4096, 0)):
        res[f"forward_T{n}_ctx{ctx}"] = time_forward(model, backend, *one_seq_meta(n, ctx, dev))
        print(n, ctx, {k: v for k, v in res[f"forward_T{n}_ctx{ctx}"].items() if k != "total_ms"}, flush=True)

    # per-op host costs on this CPU
    x = torch.zeros(8, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    res["aten_add_launch_us"] = (time.perf_counter() - t0) / 2000 * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        x.view(2, 4)
    res["aten_view_us"] = (time.perf_counter() - t0) / 2000 * 1e6
    import kvspec_kernels as kernels
    k = torch.zeros(1, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=torch.bfloat16)
    kp = pool[:, 0, 0]
    vp = pool[:, 0, 1]
    sl = torch.tensor([3], device=dev)
    kernels.append_kv(k, k, kp, vp, sl)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(500):
        kernels.append_kv(k, k, kp, vp, sl)
    res["triton_append_kv_launch_us"] = (time.perf_counter() - t0) / 500 * 1e6
    torch.cuda.synchronize()
    ids, pos, meta = one_seq_meta(13, 4096, dev)
    q = torch.zeros(13, cfg.num_heads, cfg.head_dim, device=dev, dtype=torch.bfloat16)
    kernels.paged_attention(q, kp, vp, meta.block_tables, meta.cu_q_lens, meta.seq_lens, 0.1, max_q_len=13)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(500):
        kernels.paged_attention(q, kp, vp, meta.block_tables, meta.cu_q_lens, meta.seq_lens, 0.1, max_q_len=13)
    res["triton_paged_attention_launch_us"] = (time.perf_counter() - t0) / 500 * 1e6
    print({k: v for k, v in res.items() if k.endswith("us")}, flush=True)

    from torch.profiler import ProfilerActivity, profile
    backend.set_step(meta)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.logits(model(ids, pos, backend).hidden[-1:])
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    (args.out / f"profile-{args.shape}.txt").write_text(table)
    print(table[:6000])
    res["profile_op_calls"] = sum(e.count for e in prof.key_averages())
    (args.out / f"profile-{args.shape}.json").write_text(json.dumps(res, indent=1))
    return 0



def graph_check(model, pool, out: Path) -> dict:
    """StepGraphs against the eager path on the same random model: equal outputs, and the time of a
    replayed step (decode B=1/32, verify 32×8, drafting decode with captured layers, a 13-token and a
    2,048-token prefill)."""
    from specd.engine.cuda_graphs import StepGraphs, graph_key

    cfg = model.config
    backend = PagedAttentionBackend(pool, cfg.attn_scale)
    max_blocks = pool.shape[0]
    graphs = StepGraphs(model, backend, 32, 2048 + 32 * 7, max_blocks, torch.device("cuda"))
    ctx = 512

    def step(q_lens: list[int]):
        return rows_step([(ctx, q) for q in q_lens])

    cases = {"decode_b1": [1], "decode_b32": [1] * 32, "verify_32x8": [8] * 32, "verify_ragged": [8, 3, 1, 6] * 4,
             "prefill_13": [13], "prefill_2048": [2048]}
    res: dict = {}
    for name, q_lens in cases.items():
        if sum(-(-(ctx + q) // BLOCK) for q in q_lens) > pool.shape[0]:
            continue
        capture = (1, 11, 22) if name == "verify_ragged" else ()
        st = step(q_lens)
        key = graph_key(len(st.ids), len(st.seq_lens), st.max_q_len, 32, graphs.max_tokens, capture)
        from specd.engine.model_runner import device_inputs
        inputs = device_inputs(st, [], torch.device("cuda"))
        with torch.inference_mode():
            backend.set_step(inputs.meta)
            ref = model(inputs.input_ids, inputs.positions, backend, capture_layers=list(capture))
            ref_h = ref.hidden.clone()
            ref_c = [c.clone() for c in ref.captured]
            h, c = graphs.run(st, key)
            torch.cuda.synchronize()
            diff = (h.float() - ref_h.float()).abs().max().item()
            cdiff = max([(a.float() - b.float()).abs().max().item() for a, b in zip(c, ref_c)] or [0.0])
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                graphs.run(st, key)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            eager = []
            for _ in range(5):
                t0 = time.perf_counter()
                backend.set_step(device_inputs(st, [], torch.device("cuda")).meta)
                model(inputs.input_ids, inputs.positions, backend, capture_layers=list(capture))
                torch.cuda.synchronize()
                eager.append((time.perf_counter() - t0) * 1e3)
        res[name] = {"key": str(key), "max_abs_diff_hidden": diff, "max_abs_diff_captured": cdiff,
                     "graph_ms_p50": statistics.median(times), "eager_ms_p50": statistics.median(eager)}
        print(name, res[name], flush=True)
    (out / "graphs.json").write_text(json.dumps(res, indent=1))
    return res


# -- one speculative round's pieces (issue 6 item 4) -----------------------------------------------------

def profile_draft_round(shape: str, batches: list[int], out: Path, gamma: int = 7, context: int = 512) -> dict:
    """Host and device ms of a round's pieces on a random target of ``shape`` with a random dspark
    drafter: the block forward eager and from its graph (specd/engine/block_graphs.py, with its largest
    hidden difference), the Markov loop + sampling + confidence head eager and from the draft
    graph (specd/engine/draft_graphs.py; on the CPU the same static function without a graph), and
    verification: the former per-sequence loop, the vectorized one (``verify``: the argmax chain where
    every row is greedy) and the rejection sampler it stands in for there; and the context projection of
    γ + 1 new features per request eager and from its graph (specd/engine/absorb_graphs.py, with its
    largest K/V difference). Also checks the graph
    against the eager reference (equal tokens, largest probability difference). Writes
    ``draft_round-<shape>.json``; runs on the CPU (``tiny``: the CI smoke test)."""
    from specd.drafter import DrafterConfig, build_drafter
    from specd.drafter.base import BlockOut
    from specd.engine.absorb_graphs import AbsorbGraphs
    from specd.engine.block_graphs import BlockGraphs
    from specd.engine.draft_graphs import DraftGraphs
    from specd.engine.speculation import VerifyInputs, verify, verify_prepared

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if shape == "tiny":
        context = min(context, 32)
    model = random_model(shape, str(dev), dtype)
    torch.manual_seed(0)
    rank = 16 if shape == "tiny" else 256
    drafter = build_drafter(DrafterConfig.for_target(model.config, "dspark", gamma=gamma, num_layers=1,
                                                     markov_rank=rank), model).to(dev, dtype).eval()
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.02)
    graphs = DraftGraphs(drafter, max(batches), dev, replay_eagerly=dev.type != "cuda")
    blocks = BlockGraphs(drafter, max(batches), max(2048, context + 1), dev, replay_eagerly=dev.type != "cuda",
                         pool=graphs.pool)
    absorbs = AbsorbGraphs(drafter, max(batches) * (gamma + 1), dev, replay_eagerly=dev.type != "cuda",
                           pool=graphs.pool)
    settings = {"greedy": SamplingParams(temperature=0.0), "T1": SamplingParams(temperature=1.0),
                "T0.7-k20-p0.9": SamplingParams(temperature=0.7, top_k=20, top_p=0.9)}
    res: dict = {"shape": shape, "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(),
                 "gamma": gamma, "context": context, "markov_rank": rank, "graphs": dev.type == "cuda",
                 "block_graph_static_kv_mib": blocks.memory_bytes / 2 ** 20}
    with torch.inference_mode():
        for b in batches:
            contexts = drafter.contexts_of([torch.randn(context, model.config.hidden_size, device=dev, dtype=dtype)
                                            for _ in range(b)])
            last = [(7 * i) % model.config.vocab_size for i in range(b)]
            for name, sp in settings.items():
                params = [sp] * b
                gens = lambda: [torch.Generator().manual_seed(i) for i in range(b)]   # noqa: E731
                hidden = drafter.draft_hidden(contexts, last)
                eager = lambda: drafter.sample_drafts(BlockOut(drafter.heads.logits(hidden), hidden), last,  # noqa: E731
                                                      params, gens())
                graph = lambda: graphs.run(drafter, hidden, last, params, gens())   # noqa: E731
                row = {"block_forward": _timed(lambda: drafter.draft_hidden(contexts, last), dev),
                       "block_forward_graph": _timed(lambda: blocks.run(drafter, contexts, last), dev),
                       "markov_eager": _timed(eager, dev), "markov_graph": _timed(graph, dev)}
                row.update(_block_identity(drafter, blocks, graphs, contexts, last, hidden, params, gens))
                want, got = eager(), graph()
                row["graph_tokens_equal_fraction"] = (want.tokens == got.tokens).float().mean().item()
                row["graph_max_abs_probs_diff"] = (want.probs - got.probs).abs().max().item()
                row["graph_max_abs_confidence_diff"] = (want.confidence - got.confidence).abs().max().item()
                logits = torch.randn(b * (gamma + 1), model.config.vocab_size, device=dev) * 2
                drafts = _drafts_of(got)
                starts = [i * (gamma + 1) for i in range(b)]
                row["verify_per_sequence"] = _timed(lambda: verify_per_sequence(
                    [logits[s: s + gamma + 1] for s in starts], drafts, params, gens()), dev)
                row["verify_vectorized"] = _timed(lambda: verify(logits, starts, drafts, params, gens()), dev)
                # the rejection sampler whatever the settings: for greedy rows ``verify`` takes the argmax
                # chain (specd/engine/greedy_verify.py), and this is the path it replaced
                row["verify_rejection"] = _timed(lambda: verify_prepared(logits, VerifyInputs.of(
                    starts, drafts, params, gens(), model.config.vocab_size, dev)), dev)
                row.update(_absorb_rows(drafter, absorbs, b, gamma + 1, dev, dtype))
                res[f"b{b}_{name}"] = row
                print(b, name, {k: (v["host_ms_p50"], v["total_ms_p50"]) if isinstance(v, dict) else v
                                for k, v in row.items()}, flush=True)
                # rewritten after every row: a run its timeout cuts still leaves the batches it finished
                (out / f"draft_round-{shape}.json").write_text(json.dumps(res, indent=1))
    return res


def _absorb_rows(drafter, absorbs, b: int, m: int, dev: torch.device, dtype: torch.dtype) -> dict:
    """The context projection of m new features for each of b requests (a drafting step's accepted tokens),
    eager and from the graph, and the largest K/V difference between the contexts the two fill."""
    d = drafter.config.hidden_size
    held = [torch.randn(16, d, device=dev, dtype=dtype) for _ in range(b)]
    new = [torch.randn(m, d, device=dev, dtype=dtype) for _ in range(b)]
    sink = drafter.contexts_of(held)       # grows by m a call: the timed calls append, as drafting steps do
    out = {"absorb_eager": _timed(lambda: drafter.absorb_many(sink, new), dev),
           "absorb_graph": _timed(lambda: drafter.absorb_many(sink, new, graphs=absorbs), dev)}
    eager, graph = drafter.contexts_of(held), drafter.contexts_of(held)
    drafter.absorb_many(eager, new)
    drafter.absorb_many(graph, new, graphs=absorbs)
    out["absorb_graph_max_abs_kv_diff"] = max(
        (x.float() - y.float()).abs().max().item()
        for a, c in zip(eager, graph) for layer in range(a.num_layers) for x, y in zip(a.layer(layer), c.layer(layer)))
    return out


def _block_identity(drafter, blocks, graphs, contexts, last, hidden, params, gens) -> dict:
    """The graph block forward against the eager one: the largest hidden difference, and how many draft
    tokens the round gives from each (equal unless the rounding moves a draw across a boundary)."""
    got = blocks.run(drafter, contexts, last).clone()
    from_graph = graphs.run(drafter, got, last, params, gens()).tokens.clone()
    from_eager = graphs.run(drafter, hidden, last, params, gens()).tokens
    return {"block_graph_max_abs_hidden_diff": (got.float() - hidden.float()).abs().max().item(),
            "block_graph_tokens_equal_fraction": (from_graph == from_eager).float().mean().item(),
            "block_graph_key": str(blocks.key(contexts))}


def _timed(fn, dev: torch.device, repeats: int = 10) -> dict:
    """host_ms: until ``fn`` returns (launch time on CUDA); total_ms: until the device is done too."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    host, total = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return {"host_ms_p50": statistics.median(host), "total_ms_p50": statistics.median(total)}


def _drafts_of(out) -> list:
    from specd.engine.speculation import Draft

    tokens = out.tokens.tolist()
    return [Draft(t, origin=(out.probs, j)) for j, t in enumerate(tokens)]


def verify_per_sequence(logits, drafts, params, generators):
    """The verification this repository had before the vectorized one (the baseline of the timing):
    per sequence a target_probs call, a draft-row copy and a token upload, then one kernel."""
    import kvspec_kernels as kernels
    from specd.engine.sampler import draw_uniforms
    from specd.engine.speculation import target_probs

    s, k_max = len(drafts), max(len(d.tokens) for d in drafts)
    vocab, dev = logits[0].shape[1], logits[0].device
    p_t = torch.zeros(s, k_max + 1, vocab, device=dev)
    p_d = torch.zeros(s, k_max, vocab, device=dev)
    toks = torch.zeros(s, k_max, dtype=torch.int64, device=dev)
    for i, (lg, d, p) in enumerate(zip(logits, drafts, params)):
        k = len(d.tokens)
        p_t[i, : k + 1] = target_probs(lg, p)
        p_d[i, :k] = d.origin[0][d.origin[1], :k]
        toks[i, :k] = torch.tensor(d.tokens, device=dev)
    num = torch.tensor([len(d.tokens) for d in drafts], dtype=torch.int32, device=dev)
    u = draw_uniforms(generators, k_max + 1).to(dev)
    accepted, out = kernels.rejection_sample(p_t, p_d, toks, num, u[:, :k_max].contiguous(), u[:, k_max].contiguous())
    return [row[: a + 1] for row, a in zip(out.tolist(), accepted.tolist())]


if __name__ == "__main__":
    raise SystemExit(main())

"""A sliding-window model (window 32, block 16, 4 layers alternating local/global, random weights) served
through the engine with a real kvd: prefix hits across the full and swa cache groups give the tokens of
recomputing, the swa group keeps only the blocks some prefix end still needs, and a hit whose swa
blocks are gone is shortened to the longest end every group can serve."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.kvd_process import KvdProcess
from client.kvd_client import KvdClient
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.loader import load_model
from specd.sampling_params import SamplingParams
from tests.greedy_runs import greedy_run as run

pytestmark = pytest.mark.slow

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"
WINDOW, BS, VOCAB = 32, 16, 97


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, max_position_embeddings=512, use_sliding_window=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2)
    path = tmp_path_factory.mktemp("hybrid")
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    _, tok = load_model(STORIES, dtype="float32", device="cpu")
    tok.inner.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def engine(path, run_dir=None) -> SpecEngine:
    torch.set_num_threads(1)
    return SpecEngine.from_config(EngineConfig(model=path, device="cpu", dtype="float32", block_size=BS,
                                               num_local_blocks=96, cuda_graphs=False, kvd_run_dir=run_dir))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def swa_stats(run_dir) -> tuple[dict, dict, dict]:
    with KvdClient(run_dir) as c:
        st = c.stats()
    return st["groups"]["full"], st["groups"]["swa"], st


def test_hybrid_prefix_hits_match_recompute_and_swa_keeps_only_windows(checkpoint, tmp_path):
    local = engine(checkpoint)
    with KvdProcess(tmp_path / "kvd", gpu_blocks=96, dram_blocks=0, max_groups=2) as kvd:
        cached = engine(checkpoint, kvd.run_dir)
        assert cached.layout.hybrid and cached.source.connected
        assert [(g.name, g.layers, g.tail_blocks) for g in cached.layout.groups()] == [
            ("full", (1, 3), None), ("swa", (0, 2), 2)]
        a = tokens(150, 1)
        got_a, ua = run(cached, "a", a)
        assert got_a == run(local, "a", a)[0] and ua.cached_tokens == 0
        # (a) the next turn of the conversation: a long prefix hit across both groups
        b = a + got_a + tokens(30, 2)
        got_b, ub = run(cached, "b", b)
        assert ub.cached_tokens == 9 * BS                       # A's 157 computed tokens: 9 full blocks
        assert got_b == run(local, "b", b)[0]
        # (b) count what is stored once the engine is idle (its reserve lease still held passed blocks)
        cached.blocks.release_reserve()
        cached.source.settle()       # the release is posted: wait for kvd's answer, so the stats query on
        full, swa, st = swa_stats(kvd.run_dir)   # another connection cannot overtake it (it flaked under load)
        ends = (len(b) + 8 - 1) // BS                            # B's chain end: its full blocks
        assert full["blocks"] == ends and swa["blocks"] == 2 < full["blocks"]
        assert st["window_drops"] >= ends - 2
        # (c) D recomputes a shorter prefix (its swa blocks behind B's window are gone) and leaves
        # swa blocks 4, 5; C's full hit is 9 blocks but only the end at 6 has its swa window
        d = a[:97]
        got_d, ud = run(cached, "d", d, max_tokens=2)
        assert ud.cached_tokens == 0 and got_d == run(local, "d", d, max_tokens=2)[0]
        c = a[:9 * BS] + tokens(40, 3)
        got_c, uc = run(cached, "c", c)
        assert uc.cached_tokens == 6 * BS
        assert got_c == run(local, "c", c)[0]


def test_a_long_sequence_gives_back_its_swa_blocks_behind_the_window(checkpoint, tmp_path):
    """While a sequence grows from 150 to 270 tokens, its full group holds every block but its swa group
    gives each block back once no future query can see it (the GPU working set stays near W/bs)."""
    with KvdProcess(tmp_path / "kvd", gpu_blocks=96, dram_blocks=0, max_groups=2) as kvd:
        eng = engine(checkpoint, kvd.run_dir)
        want = run(engine(checkpoint), "x", tokens(150, 1), max_tokens=120)[0]
        eng.add_request(Request("x", tokens(150, 1), SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)))
        got, seen = [], []
        while eng.has_work():
            for out in eng.step():
                got += out.token_ids
            seq = eng._seqs.get("x")
            if seq is not None and len(seq.output_ids) % 30 == 0:
                full, swa, _ = swa_stats(kvd.run_dir)
                dead = (seq.num_computed_tokens - WINDOW + 1) // BS
                seen.append((full["tiers"]["gpu"]["used_blocks"], swa["tiers"]["gpu"]["used_blocks"], dead))
        assert got == want
        assert len(seen) == 3 and seen[-1][2] >= 12
        tail = eng.layout.groups()[1].tail_blocks
        for full_used, swa_used, dead in seen:   # given back: every dead block but the chain end's window,
            assert full_used - swa_used >= dead - tail > 0   # which stays published (a servable end)

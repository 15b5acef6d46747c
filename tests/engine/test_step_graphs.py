"""The padded step path behind the CUDA graphs (specd/engine/cuda_graphs.py), on the CPU.

CUDA graphs need a GPU, but what can go wrong in them is the padding: rows padded up to a bucket,
sequence slots with empty query blocks, slots of -1, block tables wider than the step's. StepGraphs
with ``replay_eagerly`` runs exactly those padded static buffers through the model without capturing,
so these tests compare it with the unpadded eager path on the real stories260K target.
"""
from __future__ import annotations

import collections

import pytest
import torch

from specd.engine.config import EngineConfig
from specd.engine.cuda_graphs import DECODE_BUCKETS, GraphKey, StepGraphs, graph_key
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.sampling_params import SamplingParams

PROMPTS = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the"]


def test_graph_key_buckets():
    assert graph_key(3, 3, 1, 32, 2272, ()) == GraphKey(4, 1, ())                 # decode: batch bucket
    assert graph_key(32, 32, 1, 32, 2272, ()) == GraphKey(32, 1, ())
    assert graph_key(33, 33, 1, 32, 2272, ()) is None                             # more sequences than slots
    assert graph_key(20, 3, 8, 32, 2272, (1, 2)) == GraphKey(32, 8, (1, 2))        # verify: token bucket, q 8
    assert graph_key(20, 3, 5, 32, 2272, ()) == GraphKey(32, 8, ())
    assert graph_key(600, 2, 590, 32, 2272, ()) == GraphKey(768, 768, ())         # prefill: q bound = bucket
    assert graph_key(3000, 2, 2990, 32, 2272, ()) is None                         # beyond the step budget
    assert graph_key(9, 9, 1, 8, 2272, ()) is None
    assert graph_key(9, 4, 2, 8, 2272, ()) == GraphKey(16, 2, ())                 # 16 tokens, 8 sequence slots
    assert all(a < b for a, b in zip(DECODE_BUCKETS, DECODE_BUCKETS[1:]))


def _engine(padded: bool, **kw):
    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=16, num_local_blocks=1024, max_num_batched_tokens=64,
                                                 **kw))
    if padded:
        runner = engine.runner
        runner.graphs = StepGraphs(engine.model, runner.backend, 16, 64 + 16 * 7, 64, engine.device,
                                   replay_eagerly=True)
    return engine


def _generate(engine, prompts, params, spec="none"):
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", engine.tokenizer.encode(p), params, speculation=spec))
    got: dict[str, list[int]] = collections.defaultdict(list)
    while engine.has_work():
        for out in engine.step():
            got[out.id] += out.token_ids
    return [got[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("spec", ["none", "ngram", "dspark"])
def test_padded_steps_give_the_same_tokens(spec):
    kw = {}
    if spec == "dspark":
        from pathlib import Path
        kw = {"drafter": Path(__file__).resolve().parents[2] / "models/drafters/stories260K-dspark"}
    prompts = [PROMPTS[i % 3] + " " * (i // 3) for i in range(5)]   # 5: pads to buckets 8 (decode) / 48.. (verify)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = _generate(_engine(False, **kw), prompts, params, spec)
    padded = _engine(True, **kw)
    got = _generate(padded, prompts, params, spec)
    assert got == want
    assert padded.runner.graphs.replays > 0
    keys = set(padded.runner.graphs.graphs)
    assert any(k.q_bound == 1 for k in keys) and any(k.q_bound > 1 for k in keys)
    if spec == "dspark":
        assert any(k.capture for k in keys)            # feature-capturing steps went through the padded path


def test_padded_path_leaves_other_rows_of_the_pool_alone():
    """Padded tokens carry slot -1: after a padded step, no pool block outside the sequences' own
    tables was written."""
    engine = _engine(True)
    pool_view = engine.runner.backend.pool_view
    before = pool_view.clone()
    _generate(engine, PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=4))
    changed = (pool_view != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed, "the steps wrote no KV at all"
    assert len(changed) <= 3 * 4                     # 3 prompts of < 4 blocks each (bs 16, ~12 tokens + 4)


def test_write_tables_equals_a_tensor_per_row():
    """The graph and eager paths write block tables through array('i') + frombuffer (3× cheaper than
    torch.tensor of a list): the same int32 rows, entries past a row left as they were."""
    from specd.engine.cuda_graphs import write_tables

    rng = torch.Generator().manual_seed(0)
    tables = [torch.randint(0, 2**31 - 1, (n,), generator=rng).tolist() for n in (5, 0, 300, 1)]
    dst = torch.full((4, 300), -7, dtype=torch.int32)
    want = dst.clone()
    for i, row in enumerate(tables):
        want[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    write_tables(dst, tables)
    assert torch.equal(dst, want)

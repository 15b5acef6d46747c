"""The target's answers from the serving engine: continuous batching over a private paged pool, and on
the GPU a CUDA graph for every step shape.

Why: the eager harness (``specd.drafter.data.generate``) launches every kernel of every forward from
the host, ~20 ms per step on the H200 whatever the batch (docs/benchmarks.md, "Where an eager
forward's time goes"), and its batches run until their longest answer ends. The engine replays each
decode step as one graph (~3-5 ms at batch 32-128) and refills a finished sequence's slot at once.

The engine is built around the model the caller already loaded (no second load of the GGUF), with a
local block pool (no kvd), speculation off, and requests that carry the harness's settings:

- each prompt samples with its own generator seeded ``seed + i``, drawing one uniform per sampled
  token through ``specd.engine.sampler.sample``, exactly as the harness does; so the same seeds give
  the same answers on the same device, and the answers equal the harness's wherever the two forwards'
  logits round alike (paged vs padded attention: on fp32 CPU they agree; in bf16/TF32 a rare token
  sits on a sampling boundary, after which that answer differs, from the same distribution);
- stops are the caller's ``stop_ids`` only (``ignore_eos`` + ``stop_token_ids``), the stop token kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from specd.engine.block_source import local_source
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.kv_layout import KVLayout
from specd.engine.request import Request
from specd.sampling_params import SamplingParams

MAX_NUM_SEQS = 128              # decode batch: graphs up to 128 rows cost ~3-5 ms per step on the H200
MAX_NUM_BATCHED_TOKENS = 4096   # prefill chunk: Qwen-0.5B's forward is GPU-bound well before 4k tokens
BLOCK_SIZE = 16


class AnswerError(RuntimeError):
    """The engine could not answer a prompt (its KV does not fit the pool)."""


@dataclass(frozen=True)
class _IdsOnlyTokenizer:
    """What the engine reads of a tokenizer, without text. The engine detokenizes every output token
    (re-decoding the whole answer, for stop strings and streamed text): training data needs only ids,
    and on Qwen that decode would cost more host time per step than the graph replay."""

    name: str
    stop_ids: frozenset[int] = frozenset()

    @staticmethod
    def decode(ids: Sequence[int]) -> str:
        return ""


class EngineAnswers:
    """Answers prompts with one SpecEngine kept across calls (graphs are captured once).

    ``capacity``: prompt + answer tokens of the longest sequence; the pool holds ``max_num_seqs`` of
    them, so no sequence is ever preempted (preemption is correct, only slower)."""

    def __init__(self, model, capacity: int, max_num_seqs: int = MAX_NUM_SEQS,
                 max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS):
        device = next(model.parameters()).device
        mc = model.config
        dtype = model.embed_tokens.weight.dtype
        layout = KVLayout(mc.num_layers, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim, dtype, mc.layer_windows)
        blocks = max_num_seqs * (-(-min(capacity, mc.max_position_embeddings) // BLOCK_SIZE) + 1)
        config = EngineConfig(device=device.type, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max(max_num_batched_tokens, 16), num_local_blocks=blocks,
                              speculation="none")
        self.engine = SpecEngine(model, _IdsOnlyTokenizer(f"answers-{mc.fingerprint}"), config,
                                 local_source(blocks, layout, device), layout, device, model_name="answers")
        self.engine.spec_gate = None          # nothing drafts: the gate would only count steps

    def __call__(self, prompts: Sequence, seed: int, stop_ids: frozenset[int],
                 progress: bool = True) -> list[list[int]]:
        """prompts: ``specd.drafter.data.Prompt``s -> their answers (without the prompt), in order."""
        engine = self.engine
        stops = sorted(stop_ids)
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                    max_tokens=p.max_new_tokens, seed=seed + i, ignore_eos=True,
                                    stop_token_ids=stops)
            engine.add_request(Request(str(i), list(p.ids), params, speculation="none"))
        answers: list[list[int]] = [[] for _ in prompts]
        with tqdm(total=len(prompts), desc="target answers (engine)", disable=not progress) as bar:
            while engine.has_work():
                for out in engine.step():
                    answers[int(out.id)] += out.token_ids
                    if out.finish_reason == "error":
                        raise AnswerError(f"prompt {out.id}: {out.error}")
                    bar.update(out.finished)
        return answers


@torch.no_grad()
def engine_generate(model, prompts: Sequence, seed: int, stop_ids: frozenset[int],
                    max_num_seqs: int = MAX_NUM_SEQS, progress: bool = True) -> list[list[int]]:
    """One-shot form of ``EngineAnswers`` (the pool sized for these prompts)."""
    capacity = max((len(p.ids) + p.max_new_tokens for p in prompts), default=1)
    return EngineAnswers(model, capacity, max_num_seqs)(prompts, seed, stop_ids, progress)

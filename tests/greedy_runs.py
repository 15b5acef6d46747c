"""Shared by the engine tests: continuations of prompts through a live engine, so a fast path (a replayed
graph, speculation) and the reference (eager, plain decoding) can be compared token for token or by
distribution."""
from __future__ import annotations

from specd.engine.request import Request
from specd.sampling_params import SamplingParams

STORY_PROMPTS = ("Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the")


def greedy_outputs(engine, tag: str, prompts=STORY_PROMPTS, max_tokens: int = 24,
                   speculation: str | None = None) -> dict[str, list[int]]:
    """Run every prompt to ``max_tokens`` greedy tokens in one batch (``speculation``: the requests'
    method, None the deployment's); returns prompt index -> token ids."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"{tag}{i}", engine.tokenizer.encode(p),
                                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                   speculation=speculation))
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.id[len(tag):], []).extend(out.token_ids)
    return got


def batch_outputs(engine, tag: str, prompts: list[str], params: SamplingParams | list[SamplingParams],
                  speculation: str | None = None) -> list[list[int]]:
    """Queue every prompt (``params``: one setting for all, or one each) and step the engine until it is
    idle; returns each prompt's token ids, in order. ``max_num_seqs`` decides how many share a step."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, each)):
        engine.add_request(Request(f"{tag}{i}", engine.tokenizer.encode(p), sp, speculation=speculation))
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.id, []).extend(out.token_ids)
    return [got.get(f"{tag}{i}", []) for i in range(len(prompts))]


def greedy_run(engine, rid: str, prompt: list[int], max_tokens: int = 8):
    """One greedy request run alone to ``max_tokens``: (token ids, final usage); fails on any error output."""
    engine.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    ids, usage = [], None
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            ids += out.token_ids
            usage = out.usage or usage
    return ids, usage

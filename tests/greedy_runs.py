"""Shared by the graph-path tests: greedy continuations of a few prompts through a live engine, so a fast
path (a replayed graph) and the eager reference can be compared token for token."""
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

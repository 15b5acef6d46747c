"""Full-stack replay of a Mooncake trace: each trace request becomes one token-id prompt sent through specd.

bench/mooncake.py reads the trace and turns a hash id into a fixed block of token ids (equal ids, equal
blocks). Here a request's prompt is its hash ids' blocks concatenated, scaled down to the served model:

- a trace block stands for 512 tokens; here it becomes ``tokens_per_hash`` tokens (``--tokens-per-hash``),
  so a 512-token model still sees a multi-block prefix structure;
- the prompt length is the trace's ``input_length`` scaled the same way (the last block may be partial);
- token ids are taken modulo the model's vocabulary (mooncake.py draws them from Qwen's 151,936);
- the prompt is cut so prompt + answer fit the context (``max_model_len - max_tokens``); equal leading
  hash ids still give equal leading tokens, so the trace's prefix sharing survives the cut;
- the answer length is the trace's ``output_length``, capped by ``max_tokens``, with EOS ignored so the
  replay generates the lengths the trace asks for.

Arrival times are the trace's timestamps (ms) and are used by ``--arrivals recorded``; with the default
closed loop only the order matters. Used by ``python -m bench serve --trace FILE``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specd.loader.random_weights import is_random_dir

from bench.loadgen import TurnRequest
from bench.mooncake import TRACE_BLOCK_TOKENS, TraceRequest, block_tokens, read_trace


class TraceError(ValueError):
    """The trace cannot be replayed on this model (context too small, unknown vocabulary)."""


@dataclass(frozen=True)
class TraceScript:
    """One trace request as a one-turn script with a token-id prompt."""

    id: str
    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int

    def num_turns(self) -> int:
        return 1

    def think_time_s(self, turn: int) -> float:
        return 0.0

    def request(self, turn: int, answers: list[str]) -> TurnRequest:
        return TurnRequest(params={"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True},
                           prompt=list(self.prompt_ids))


def prompt_ids(req: TraceRequest, tokens_per_hash: int, vocab: int, limit: int) -> list[int]:
    """The scaled-down prompt of one request: its blocks' tokens mod ``vocab``, as long as its scaled
    ``input_length``, at most ``limit`` tokens."""
    limit = min(limit, -(-req.input_length * tokens_per_hash // TRACE_BLOCK_TOKENS))
    ids: list[int] = []
    for hid in req.hash_ids:
        if len(ids) >= limit:
            break
        ids.extend(t % vocab for t in block_tokens(hid, tokens_per_hash))
    return ids[:limit]


def trace_scripts(requests: list[TraceRequest], *, tokens_per_hash: int, vocab: int, max_model_len: int,
                  max_tokens: int) -> list[TraceScript]:
    """Scripts for every request, in trace order; ids are the request's line index."""
    out = []
    for i, req in enumerate(requests):
        answer = max(1, min(req.output_length, max_tokens))
        limit = max_model_len - answer - 1
        if limit < 1:
            raise TraceError(f"a context of {max_model_len} tokens leaves no room for a prompt "
                             f"and {answer} answer tokens")
        out.append(TraceScript(f"trace-{i:06d}", req.timestamp_ms / 1000.0,
                               tuple(prompt_ids(req, tokens_per_hash, vocab, limit)), answer))
    return out


def model_vocab_size(model: Path) -> int:
    """The vocabulary of a GGUF file (its token list), a random-weights directory (its tokenizer's, which is what
    the GGUF it came from had) or an HF directory (config.json), without loading weights."""
    model = Path(model)
    if is_random_dir(model):
        import tokenizers

        return tokenizers.Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    if model.is_dir():
        return int(json.loads((model / "config.json").read_text())["vocab_size"])
    import gguf

    field = gguf.GGUFReader(model).fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise TraceError(f"{model} has no tokenizer.ggml.tokens: cannot tell its vocabulary")
    return len(field.data)


def load_trace_scripts(path: Path, *, limit: int | None, model: Path, tokens_per_hash: int, max_model_len: int,
                       max_tokens: int) -> list[TraceScript]:
    return trace_scripts(read_trace(path, limit), tokens_per_hash=tokens_per_hash, vocab=model_vocab_size(model),
                         max_model_len=max_model_len, max_tokens=max_tokens)

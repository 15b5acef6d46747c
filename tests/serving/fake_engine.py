"""A stand-in for SpecEngine with the same methods: it echoes the prompt back one token per step.

Deterministic, so tests can assert exact text; it mimics kvd's prefix cache at block granularity
(``cached_tokens``) and records aborts, so cancel/disconnect tests can check that blocks were freed.
"""
from __future__ import annotations

import threading
import time

from specd.engine.errors import EngineError
from specd.engine.request import Request, RequestOutput, Usage

BOS, EOS, OFFSET = 1, 2, 3
BLOCK = 4


class FakeTokenizer:
    """Byte-level: token = byte + 3; ids 1 and 2 are BOS and EOS."""

    eos_id = EOS
    vocab_size = 256 + OFFSET

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return ([BOS] if add_bos in (None, True) else []) + [b + OFFSET for b in text.encode()]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def decode(self, ids: list[int]) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


class FakeEngine:
    """Echo engine. ``step_delay_s`` slows steps so a test can cancel mid-stream."""

    model_name = "fake-echo"

    def __init__(self, max_model_len: int = 256, step_delay_s: float = 0.0):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.step_delay_s = step_delay_s
        self.fail_next_step = False
        self.aborted: list[str] = []
        self.added: list[Request] = []
        self._running: dict[str, dict] = {}
        self._seen_blocks: set[tuple[int, ...]] = set()
        self._totals = {"tokens_generated_total": 0, "prompt_tokens_total": 0, "cached_tokens_total": 0}
        self.lock = threading.Lock()  # tests read aborted/added from another thread

    def add_request(self, request: Request) -> None:
        ids = request.prompt_ids
        if not ids:
            raise EngineError("empty_prompt", "the prompt has no tokens")
        if len(ids) >= self.max_model_len:
            raise EngineError("prompt_too_long", f"{len(ids)} prompt tokens, context is {self.max_model_len}")
        if request.id in self._running:
            raise EngineError("duplicate_id", request.id)
        echo = [t for t in ids if t >= OFFSET] or [OFFSET + ord("x")]
        cached = self._cached_prefix(ids)
        with self.lock:
            self.added.append(request)
        self._running[request.id] = {"req": request, "echo": echo, "n": 0, "cached": cached,
                                     "t0": time.monotonic(), "ttft": None}
        self._totals["prompt_tokens_total"] += len(ids)
        self._totals["cached_tokens_total"] += cached

    def _cached_prefix(self, ids: list[int]) -> int:
        """Full blocks of this prompt seen before, as kvd would serve them; then remember them."""
        full = len(ids) // BLOCK * BLOCK
        blocks = [tuple(ids[:end]) for end in range(BLOCK, full + 1, BLOCK)]
        hit = 0
        for block in blocks:
            if block not in self._seen_blocks:
                break
            hit += BLOCK
        self._seen_blocks.update(blocks)
        return hit

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.aborted.append(request_id)
        self._running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected engine failure")
        time.sleep(self.step_delay_s)
        return [self._advance(rid, st) for rid, st in list(self._running.items())]

    def _advance(self, rid: str, st: dict) -> RequestOutput:
        req: Request = st["req"]
        token = st["echo"][st["n"] % len(st["echo"])]
        st["n"] += 1
        if st["ttft"] is None:
            st["ttft"] = time.monotonic() - st["t0"]
        self._totals["tokens_generated_total"] += 1
        out = RequestOutput(id=rid, token_ids=[token], text=self.tokenizer.decode([token]))
        if st["n"] >= req.params.max_tokens:
            del self._running[rid]
            out.finished, out.finish_reason = True, "length"
            out.usage = Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=st["n"],
                              cached_tokens=st["cached"], ttft_s=st["ttft"])
        return out

    def stats(self) -> dict[str, float | int]:
        return {"requests_running": len(self._running), "kvd_connected": 0, **self._totals}

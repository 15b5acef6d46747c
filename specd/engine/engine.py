"""SpecEngine: continuous-batching generation over paged KV leased from kvd. Pure logic: the
server (specd/server.py) owns sockets and threads and calls ``add_request`` / ``step``.
"""
from __future__ import annotations

import logging
import time

import torch

from kvd.hashing import namespace_root
from specd.engine import sampler
from specd.engine.block_manager import BlockManager
from specd.engine.block_source import BlockSource, LocalBlockSource
from specd.engine.config import EngineConfig
from specd.engine.detokenizer import Detokenizer
from specd.engine.errors import EngineError
from specd.engine.hints import SessionHints
from specd.engine.kv_layout import KVLayout
from specd.engine.model_runner import ModelRunner
from specd.engine.request import Request, RequestOutput
from specd.engine.scheduler import ScheduledSeq, Scheduler
from specd.engine.sequence import Sequence, SeqStatus
from specd.loader import load_model, resolve_device, resolve_dtype

log = logging.getLogger("specd.engine")

RECONNECT_EVERY_S = 2.0


class SpecEngine:
    def __init__(self, model, tokenizer, config: EngineConfig, source: BlockSource, layout: KVLayout,
                 device: torch.device, model_name: str):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.layout = layout
        self.model_name = model_name
        self.max_model_len = min(config.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings)
        self.root = namespace_root(
            model.config.fingerprint, tokenizer.name, str(layout.dtype), layout.describe(),
            layout.block_size, "", config.tenant_salt,
        )
        self._stop_ids = frozenset(tokenizer.stop_ids)   # EOS and end-of-turn tokens
        self._seqs: dict[str, Sequence] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._counters = dict(requests_total=0, requests_finished=0, requests_aborted=0, prompt_tokens_total=0,
                              cached_tokens_total=0, tokens_generated_total=0, steps_total=0,
                              schedule_seconds_total=0.0, forward_seconds_total=0.0, output_seconds_total=0.0,
                              commit_seconds_total=0.0)
        self._last_reconnect_s = 0.0
        self.hints = SessionHints(layout.block_size)
        self._attach(source)

    def _attach(self, source: BlockSource) -> None:
        self.source = source
        self.blocks = BlockManager(source, self.layout.block_size, self.root)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.layout, source.pool, self.device,
                                  max_batch=self.config.max_num_seqs, max_model_len=self.max_model_len,
                                  cuda_graphs=self.config.cuda_graphs)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig) -> "SpecEngine":
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        model, tokenizer = load_model(config.model, dtype=dtype, device=device)
        mc = model.config
        layout = KVLayout(mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        source = cls._make_source(config, layout, device)
        return cls(model, tokenizer, config, source, layout, device, model_name=config.model.name)

    @staticmethod
    def _make_source(config: EngineConfig, layout: KVLayout, device: torch.device) -> BlockSource:
        if config.kvd_run_dir is not None:
            from specd.engine.kvd_source import KvdBlockSource, KvdUnavailable

            try:
                return KvdBlockSource.connect(config.kvd_run_dir, layout, device)
            except KvdUnavailable as exc:
                log.warning("kvd unavailable (%s): serving without the shared cache", exc)
        return LocalBlockSource(config.num_local_blocks, layout.block_bytes, device)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise EngineError("empty_prompt", "the prompt has no tokens")
        if n >= self.max_model_len:
            raise EngineError("prompt_too_long",
                              f"prompt has {n} tokens; the context is {self.max_model_len} (one is needed to answer)")
        if request.id in self._seqs:
            raise EngineError("duplicate_id", f"request id {request.id!r} is already running")
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_ids):
            raise EngineError("bad_request", f"token ids must be in [0, {vocab})")
        if not request.arrival_s:
            request.arrival_s = time.monotonic()
        gen = None
        if request.params.seed is not None:
            gen = torch.Generator().manual_seed(request.params.seed)
        seq = Sequence(request, Detokenizer(self.tokenizer.decode, request.params.stop), gen)
        self._seqs[request.id] = seq
        self.scheduler.add(seq)
        self._counters["requests_total"] += 1
        self._counters["prompt_tokens_total"] += n

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        self._finish(seq, "abort")
        self._counters["requests_aborted"] += 1

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_outputs)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._maybe_reconnect()
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        outputs, self._pending_outputs = self._pending_outputs, []
        if not batch:
            self._fail_unschedulable(outputs)
            return outputs
        t1 = time.perf_counter()
        logits = self.runner.run(batch)
        sampling = [s for s in batch if s.samples]
        seqs = [s.seq for s in sampling]
        tokens = sampler.sample(logits, [q.request.params for q in seqs], [q.generator for q in seqs]).tolist()
        t2 = time.perf_counter()
        for s in batch:
            s.seq.num_computed_tokens += s.num_tokens
        now = time.monotonic()
        for seq, tok in zip(seqs, tokens):
            outputs.append(self._append_token(seq, tok, now))
        t3 = time.perf_counter()
        for s in batch:
            if s.seq.status is SeqStatus.RUNNING:
                self.blocks.commit_full(s.seq)
        t4 = time.perf_counter()
        c = self._counters
        c["steps_total"] += 1
        c["schedule_seconds_total"] += t1 - t0          # includes kvd lookups and allocations
        c["forward_seconds_total"] += t2 - t1           # model + sampling, synchronised by .tolist()
        c["output_seconds_total"] += t3 - t2            # detokenize, stop checks, finishing
        c["commit_seconds_total"] += t4 - t3            # publishing full blocks to kvd
        return outputs

    def _maybe_reconnect(self) -> None:
        """(Re-)attach to kvd after an outage or a start without it, at a moment when no sequence
        holds a block, so no block table ever spans two pools."""
        if self.config.kvd_run_dir is None or self.source.connected or self.scheduler.running:
            return
        now = time.monotonic()
        if now - self._last_reconnect_s < RECONNECT_EVERY_S:
            return
        self._last_reconnect_s = now
        from specd.engine.kvd_source import PROBE_TIMEOUT_S, KvdBlockSource, KvdUnavailable

        try:
            fresh = KvdBlockSource.connect(self.config.kvd_run_dir, self.layout, self.device, PROBE_TIMEOUT_S)
        except (KvdUnavailable, OSError):
            return
        self.blocks.release_reserve()
        waiting = list(self.scheduler.waiting)
        for seq in waiting:
            self.blocks.free(seq)
            seq.num_computed_tokens = 0
        if hasattr(self.source, "close"):
            self.source.close()
        self._attach(fresh)
        for seq in waiting:
            self.scheduler.add(seq)
        log.info("kvd attached: the shared prefix cache is on")

    def _append_token(self, seq: Sequence, tok: int, now: float) -> RequestOutput:
        params = seq.request.params
        if seq.first_token_s is None:
            seq.first_token_s = now
            self._counters["cached_tokens_total"] += seq.num_cached_tokens
        self._counters["tokens_generated_total"] += 1
        out = RequestOutput(seq.id)
        is_stop_token = (tok in self._stop_ids and not params.ignore_eos) or tok in params.stop_token_ids
        seq.output_ids.append(tok)
        out.token_ids = [tok]
        if is_stop_token:
            reason = "stop"
        else:
            out.text = seq.detok.add(tok)
            if seq.detok.stopped:
                reason = "stop"
            elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            else:
                return out
        out.text += seq.detok.finish() if not seq.detok.stopped else ""
        self._finish(seq, reason)
        out.finished, out.finish_reason, out.usage = True, reason, seq.usage()
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Commit what is complete, release every lease, forget the sequence."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.blocks.commit_full(seq)
        self.scheduler.remove(seq)
        req = seq.request
        self.blocks.extend_hashes(seq)
        hints = self.hints.release_hints(seq.hashes, req.prefix_kinds, req.session, req.arrival_s,
                                         time.monotonic(), req.expected_return_s)
        self.blocks.free(seq, hints)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._seqs.pop(seq.id, None)
        self._counters["requests_finished"] += 1

    def _fail_unschedulable(self, outputs: list[RequestOutput]) -> None:
        """Nothing ran although requests wait: the head one cannot fit in the whole pool."""
        if self.scheduler.running or not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        self._finish(seq, "error")
        outputs.append(RequestOutput(seq.id, finished=True, finish_reason="error", usage=seq.usage(),
                                     error="the KV pool is too small for this prompt"))

    def stats(self) -> dict[str, float | int]:
        return {
            **self._counters,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "preemptions_total": self.scheduler.num_preemptions,
            "kvd_connected": int(self.source.connected),
            "free_blocks": self.source.num_free(),
        }

"""CUDA graphs for decode steps, one per bucketed batch size.

Why: a decode step of a small model is a few hundred tiny kernels; at batch 1 the launch overhead,
not HBM bandwidth, sets the speed. A graph replays the whole step with one launch. Batches are
padded up to the next bucket: padded rows write nowhere (slot -1) and attend to one stale slot, and
their logits are dropped.
"""
from __future__ import annotations

import torch

from specd.engine.paged_backend import PagedAttentionBackend, StepMetadata

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class DecodeGraphs:
    def __init__(self, model, backend: PagedAttentionBackend, max_batch: int, max_blocks: int, device: torch.device):
        self.model = model
        self.backend = backend
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        n = self.buckets[-1]
        self.max_blocks = max_blocks
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.cu_q_lens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def _meta(self, b: int) -> StepMetadata:
        return StepMetadata(self.slots[:b], self.block_tables[:b], self.cu_q_lens[: b + 1], self.seq_lens[:b], 1)

    def _forward(self, b: int) -> torch.Tensor:
        self.backend.set_step(self._meta(b))
        out = self.model(self.input_ids[:b], self.positions[:b], self.backend)
        return self.model.logits(out.hidden)

    @torch.inference_mode()
    def capture_all(self) -> None:
        for b in reversed(self.buckets):          # largest first, so smaller graphs reuse its memory
            self.capture(b)

    @torch.inference_mode()
    def capture(self, b: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):                     # warm up: Triton compiles, allocator settles
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(b)
        self.graphs[b] = (graph, logits)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """One decode step (every row has one query token). Returns logits [B, vocab]."""
        b = input_ids.shape[0]
        nb = self.bucket(b)
        if nb not in self.graphs:
            self.capture(nb)
        width = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.slots[b:nb].fill_(-1)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:nb].fill_(1)
        graph, logits = self.graphs[nb]
        graph.replay()
        return logits[:b]

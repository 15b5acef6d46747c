"""Attention over several cache groups: each layer reads the pool and block tables of its group.

Why a module of its own: ``PagedAttentionBackend`` (specd/engine/paged_backend.py) and ``ModelRunner``
(specd/engine/model_runner.py) serve the one-group layout every real model uses today and are being
reworked for CUDA graphs; a model with sliding-window layers plugs in here instead. The contract with
the kernels is unchanged: every layer gets a per-layer pool view ``[N, bs, Hkv, D]`` of *its* group's
pool, plus that group's block tables and slot mapping; positions, ``cu_q_lens`` and ``seq_lens`` are
shared (every group's table covers the same token blocks).

To wire it into ModelRunner itself (what ``HybridRunner`` does by subclassing): build one
``(slot_mapping, block_tables)`` per secondary group from ``blocks.tables(seq)`` for the step's batch,
and hand them to ``GroupedPagedBackend.set_groups`` before the forward. CUDA graphs are not captured for
hybrid models yet (the graphs would need one table buffer per group).
"""
from __future__ import annotations

from typing import Sequence

import torch

import kvspec_kernels as kernels
from specd.engine.kv_layout import KVLayout
from specd.engine.model_runner import ModelRunner
from specd.engine.paged_backend import PagedAttentionBackend
from specd.engine.scheduler import ScheduledSeq


class GroupedPagedBackend(PagedAttentionBackend):
    def __init__(self, layout: KVLayout, pools: dict[str, torch.Tensor], scale: float,
                 windows: Sequence[int | None]):
        groups = layout.groups()
        self.primary = groups[0].name
        # layer -> (group, [N, L_g, 2, bs, Hkv, D] view of its pool, index within the group)
        self.where = {layer: (g.name, g.layout.view(pools[g.name]), i) for g in groups for i, layer in enumerate(g.layers)}
        super().__init__(groups[0].layout.view(pools[self.primary]), scale, windows)
        self.group_meta: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_groups(self, meta: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Per secondary group: (slot_mapping [T] int64, block_tables [B, max_blocks] int32)."""
        self.group_meta = meta

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        meta = self.meta
        group, view, i = self.where[layer]
        slots, tables = (meta.slot_mapping, meta.block_tables) if group == self.primary else self.group_meta[group]
        k_pool, v_pool = view[:, i, 0], view[:, i, 1]
        kernels.append_kv(k, v, k_pool, v_pool, slots)
        return kernels.paged_attention(
            q, k_pool, v_pool, tables, meta.cu_q_lens, meta.seq_lens, self.scale,
            sliding_window=self.windows[layer], max_q_len=meta.max_q_len,
        )


class HybridRunner(ModelRunner):
    """ModelRunner for a layout with several cache groups (no CUDA graphs yet)."""

    def __init__(self, model, layout: KVLayout, pools: dict[str, torch.Tensor], blocks, device: torch.device,
                 max_batch: int = 32, max_model_len: int = 2048):
        primary = layout.groups()[0]
        super().__init__(model, primary.layout, pools[primary.name], device, max_batch, max_model_len,
                         cuda_graphs=False)
        self.backend = GroupedPagedBackend(layout, pools, model.config.attn_scale, model.config.layer_windows)
        self.blocks = blocks          # HybridBlockManager: the per-group tables

    def run(self, batch: list[ScheduledSeq], capture_layers: tuple[int, ...] = ()):
        """ModelRunner.run, with the secondary groups' slot mappings and tables set first."""
        self.backend.set_groups(self.group_inputs(batch))
        return super().run(batch, capture_layers)

    def group_inputs(self, batch: list[ScheduledSeq]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per secondary group: (slot_mapping [T] int64, block_tables [B, max_blocks] int32), token
        order as in ``host_step`` (each sequence's scheduled tokens, then its draft)."""
        bs = self.layout.block_size
        per_group: dict[str, tuple[list[int], list[list[int]]]] = {}
        for sched in batch:
            seq, start = sched.seq, sched.seq.num_computed_tokens
            n = sched.num_tokens + sched.num_draft
            for g, table in self.blocks.tables(seq).items():
                if g == self.backend.primary:
                    continue
                slots, tables = per_group.setdefault(g, ([], []))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
                tables.append(list(table))
        out = {}
        for g, (slots, tables) in per_group.items():
            width = max(len(t) for t in tables)
            padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
            out[g] = (torch.tensor(slots, dtype=torch.int64, device=self.device), padded.to(self.device))
        return out


def hybrid_engine_parts(engine, source) -> tuple:
    """(blocks, scheduler, runner) of a SpecEngine whose layout has several cache groups."""
    from specd.engine.hybrid_blocks import HybridBlockManager
    from specd.engine.scheduler import Scheduler

    cfg = engine.config
    blocks = HybridBlockManager(source, engine.layout, engine.root)
    runner = HybridRunner(engine.model, engine.layout, source.pools, blocks, engine.device,
                          max_batch=cfg.max_num_seqs, max_model_len=engine.max_model_len)
    scheduler = Scheduler(blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                          prefill_order=cfg.prefill_order, starve_s=cfg.prefill_starve_s)
    return blocks, scheduler, runner

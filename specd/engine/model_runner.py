"""Turns a scheduled step into one flat forward pass over the paged pool.

All sequences' tokens are concatenated ([T]); ragged per-sequence lengths travel as ``cu_q_lens``,
so there is no padding. Logits are computed only for the rows that sample.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.engine.kv_layout import KVLayout
from specd.engine.paged_backend import PagedAttentionBackend, StepMetadata
from specd.engine.scheduler import ScheduledSeq


@dataclass
class StepInputs:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    meta: StepMetadata
    sample_rows: torch.Tensor    # [S] int64: index into T of each sampling sequence's last token


class ModelRunner:
    def __init__(self, model, layout: KVLayout, pool: torch.Tensor, device: torch.device,
                 max_batch: int = 32, max_model_len: int = 2048, cuda_graphs: bool = True):
        self.model = model
        self.layout = layout
        self.device = device
        cfg = model.config
        self.backend = PagedAttentionBackend(
            layout.view(pool), scale=cfg.attn_scale, windows=cfg.layer_windows
        )
        self.graphs = None
        if cuda_graphs and device.type == "cuda":
            from specd.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-max_model_len // layout.block_size)
            self.graphs = DecodeGraphs(model, self.backend, max_batch, max_blocks, device)
            self.graphs.capture_all()

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        bs = self.layout.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        max_blocks = max(len(s.seq.block_table) for s in batch)
        tables = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for i, sched in enumerate(batch):
            seq, start = sched.seq, sched.seq.num_computed_tokens
            toks = seq.all_ids[start : start + sched.num_tokens] + (sched.draft.tokens if sched.draft else [])
            n = len(toks)
            ids.extend(toks)
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            if sched.samples:
                sample_rows.extend(range(cu[-1] - 1 - sched.num_draft, cu[-1]))   # verify rows + the last
        dev = self.device
        meta = StepMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_q_len=max(s.num_tokens + s.num_draft for s in batch),
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        )

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], capture_layers: tuple[int, ...] = ()):
        """Returns (logits, captured). logits: fp32, for the sampling sequences in batch order: one
        row each, or ``num_draft + 1`` rows for a sequence that verifies drafts. captured: the outputs
        of ``capture_layers`` for every token of the step ([T, d] each), or None."""
        inputs = self.prepare(batch)
        if self.graphs is not None and inputs.meta.max_q_len == 1 and not capture_layers:
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta), None
        self.backend.set_step(inputs.meta)
        out = self.model(inputs.input_ids, inputs.positions, self.backend, capture_layers=list(capture_layers))
        return self.model.logits(out.hidden[inputs.sample_rows]), (out.captured if capture_layers else None)

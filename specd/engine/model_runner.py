"""Turns a scheduled step into one flat forward pass over the paged pool.

All sequences' tokens are concatenated ([T]); ragged per-sequence lengths travel as ``cu_q_lens``,
so the eager path has no padding. On CUDA every step shape that fits a bucket (decode, verify,
feature-capturing decode, prefill chunks) replays a CUDA graph (specd/engine/cuda_graphs.py): eager
forwards cost ~20 ms of host launch time on the H200 whatever their size. Logits are computed only for
the rows that sample, outside the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.engine.cuda_graphs import GraphKey, HostStep, StepGraphs, graph_key, plain_keys, write_tables
from specd.engine.kv_layout import KVLayout
from specd.engine.paged_backend import PagedAttentionBackend, StepMetadata
from specd.engine.scheduler import ScheduledSeq


@dataclass
class StepInputs:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    meta: StepMetadata
    sample_rows: torch.Tensor    # [S] int64: index into T of each sampling sequence's last token


def host_step(batch: list[ScheduledSeq], block_size: int) -> tuple[HostStep, list[int]]:
    """(the step's unpadded inputs, the sampling rows): a sequence that samples contributes its last
    row, plus its draft rows when it verifies."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    for sched in batch:
        seq, start = sched.seq, sched.seq.num_computed_tokens
        toks = seq.ids(start, start + sched.num_tokens) + (sched.draft.tokens if sched.draft else [])
        n = len(toks)
        ids.extend(toks)
        pos.extend(range(start, start + n))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        cu.append(cu[-1] + n)
        seq_lens.append(start + n)
        tables.append(list(table))
        if sched.samples:
            sample_rows.extend(range(cu[-1] - 1 - sched.num_draft, cu[-1]))   # verify rows + the last
    max_q = max(s.num_tokens + s.num_draft for s in batch)
    return HostStep(ids, pos, slots, cu, seq_lens, tables, max_q), sample_rows


def device_inputs(step: HostStep, sample_rows: list[int], device: torch.device) -> StepInputs:
    """The eager path's tensors: exact sizes, no padding."""
    width = max(len(t) for t in step.tables)
    tables = torch.zeros(len(step.tables), width, dtype=torch.int32)
    write_tables(tables, step.tables)
    meta = StepMetadata(
        slot_mapping=torch.tensor(step.slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        cu_q_lens=torch.tensor(step.cu_q_lens, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
        max_q_len=step.max_q_len,
    )
    return StepInputs(
        input_ids=torch.tensor(step.ids, dtype=torch.int64, device=device),
        positions=torch.tensor(step.positions, dtype=torch.int64, device=device),
        meta=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
    )


class ModelRunner:
    def __init__(self, model, layout: KVLayout, pool: torch.Tensor, device: torch.device,
                 max_batch: int = 32, max_model_len: int = 2048, cuda_graphs: bool = True,
                 max_num_batched_tokens: int = 2048, num_speculative_tokens: int = 7):
        self.model = model
        self.layout = layout
        self.device = device
        cfg = model.config
        self.backend = PagedAttentionBackend(
            layout.view(pool), scale=cfg.attn_scale, windows=cfg.layer_windows
        )
        self.graphs: StepGraphs | None = None
        self.eager_steps = 0
        self.max_batch = max_batch
        # the step budget graphs are bucketed under (StepGraphs.max_tokens): kept on the CPU too, so the
        # keys a step would replay can be computed without a GPU (``step_key``)
        self.max_tokens = max(max_num_batched_tokens + max_batch * num_speculative_tokens, max_batch)
        if cuda_graphs and device.type == "cuda":
            max_blocks = -(-max_model_len // layout.block_size)
            self.graphs = StepGraphs(model, self.backend, max_batch, self.max_tokens, max_blocks, device)
            self.graphs.warm(plain_keys(max_batch, self.graphs.max_tokens))

    def step_key(self, step: HostStep, capture: tuple[int, ...]) -> GraphKey | None:
        """The graph this step replays (None: eager), by the same rule as StepGraphs, with or without a GPU."""
        if self.graphs is not None:
            return self.graphs.key(step, capture)
        return graph_key(len(step.ids), len(step.seq_lens), step.max_q_len, self.max_batch, self.max_tokens, capture)

    def warm(self, keys: list[GraphKey]) -> int:
        """Capture these step shapes now (no-op without graphs). Returns how many were new."""
        return self.graphs.warm(keys) if self.graphs is not None else 0

    @property
    def graph_captures(self) -> int:
        return self.graphs.captures if self.graphs is not None else 0

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], capture_layers: tuple[int, ...] = ()):
        """Returns (logits, captured). logits: fp32, for the sampling sequences in batch order: one
        row each, or ``num_draft + 1`` rows for a sequence that verifies drafts. captured: the outputs
        of ``capture_layers`` for every token of the step ([T, d] each), or None."""
        step, sample_rows = host_step(batch, self.layout.block_size)
        capture = tuple(capture_layers)
        key = self.graphs.key(step, capture) if self.graphs is not None else None
        if self.graphs is not None and self.graphs.can_run(key):
            # uploaded before the replay: after it, only device work is launched (see sampler.SamplePlan)
            rows = torch.tensor(sample_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            hidden, captured = self.graphs.run(step, key)
            return self.model.logits(hidden[rows]), (captured if capture else None)
        self.eager_steps += 1
        inputs = device_inputs(step, sample_rows, self.device)
        self.backend.set_step(inputs.meta)
        out = self.model(inputs.input_ids, inputs.positions, self.backend, capture_layers=list(capture))
        return self.model.logits(out.hidden[inputs.sample_rows]), (out.captured if capture else None)

    def dummy_verify_forward(self, gamma: int, context: int):
        """A callable B -> one step shaped like a verify step of B tokens (rows of 1 + γ tokens after
        ``context`` cached tokens; longer rows when B exceeds max_seqs rows), through the same path
        (graph or eager) real steps take, for ``SpsProfile.measure``. It writes no KV (slots -1) and
        reads garbage from block 0 onwards."""
        max_seqs = self.graphs.max_seqs if self.graphs is not None else None

        @torch.inference_mode()
        def forward(b: int) -> object:
            row = gamma + 1
            if max_seqs is not None and -(-b // row) > max_seqs:
                row = -(-b // max_seqs)        # a step this large mixes in prefill chunks: longer rows
            n_blocks = -(-(context + row) // self.layout.block_size)
            q_lens = [row] * (b // row) + ([b % row] if b % row else [])
            pos = [p for q in q_lens for p in range(context, context + q)]
            cu = [0]
            for q in q_lens:
                cu.append(cu[-1] + q)
            step = HostStep([0] * b, pos, [-1] * b, cu, [context + q for q in q_lens],
                            [list(range(n_blocks))] * len(q_lens), max(q_lens))
            key = self.graphs.key(step, ()) if self.graphs is not None else None
            if self.graphs is not None and self.graphs.can_run(key):
                hidden, _ = self.graphs.run(step, key)
                return self.model.logits(hidden)
            inputs = device_inputs(step, list(range(b)), self.device)
            self.backend.set_step(inputs.meta)
            return self.model.logits(self.model(inputs.input_ids, inputs.positions, self.backend).hidden)
        return forward

"""Which proposer serves a speculation method. Built lazily, once per engine and method."""
from __future__ import annotations

import hashlib
import json
import os

import torch

from specd.engine.errors import EngineError
from specd.engine.speculation import Draft, Proposer


class NgramProposer:
    """Prompt lookup (specd.drafter.ngram). Its proposals are deterministic, so they travel without
    probabilities (one-hot), which keeps a [k, vocab] tensor per sequence off the hot path."""

    method = "ngram"
    capture_layers: tuple[int, ...] = ()
    has_confidence = False
    proposes_cheaply = True     # a lookup on the host: the gate decides after it, on the drafts it found

    def __init__(self, drafter):
        self.drafter = drafter
        self.max_tokens = drafter.config.gamma    # the longest proposal it can make (requests may ask for fewer)

    def propose(self, seqs, limits) -> list[Draft]:
        """Each sequence's proposal from its own incremental index (specd/drafter/ngram_index.py: the
        drafter's ``propose`` is the reference it matches), kept on the sequence."""
        from specd.drafter.ngram_index import NgramIndex   # lazily, as every drafter module here

        cfg = self.drafter.config
        drafts = []
        for seq, k in zip(seqs, limits):
            index = seq.ngram_index
            if index is None:
                index = seq.ngram_index = NgramIndex(cfg.ngram_max, cfg.gamma, cfg.vocab_size)
            index.sync(seq.request.prompt_ids, seq.output_ids)
            drafts.append(Draft(index.propose()[:k]))
        return drafts


class FeatureProposer:
    """A trained drafter (dspark, dflash, eagle3) reading the target's hidden states.

    Each sequence's fused features of newly computed tokens (``Sequence.draft_feats``, appended after
    every forward) are projected once into its drafter context K/V (``Sequence.draft_ctx``, a
    specd.drafter.context_cache.DraftContext) at the next proposal, so a draft costs O(new tokens)
    plus one padded gather, not O(context) projections. After a prefix hit the features start at the
    first computed token. The context of the cached prefix then comes from kvd's draft group when it
    holds every hit block (``prefix_cache``, specd/engine/draft_cache.py); otherwise the context is
    shifted to start at position 0, which RoPE makes exact for every distance the drafter attends over
    (only the cached context itself is missing to it), and ``DraftContext.offset`` records the gap.

    Drafts travel as rows of the proposal's batched probabilities (``Draft.origin``), so verification
    stacks them without a copy per sequence; on CUDA the block forward, the Markov loop, sampling and
    confidence head replay from graphs (``rounds``)."""

    def __init__(self, drafter, method: str, temperatures: list[float] | None = None, weights_sha256: str = "",
                 rounds=None):
        self.drafter = drafter
        self.rounds = rounds                # a DraftGraphs (CUDA, block drafters): the sampling round replayed
        self.method = method
        self.temperatures = temperatures    # STS per-position temperatures of the confidence head, if fitted
        self.weights_sha256 = weights_sha256    # of the checkpoint: part of the draft group's namespace
        self.prefix_cache = None            # a DraftCache when kvd keeps this drafter's context blocks
        self.capture_layers = tuple(drafter.config.target_layers)
        self.max_tokens = drafter.config.gamma                       # one block: a request may verify fewer
        self.has_confidence = bool(getattr(drafter.config, "confidence", False))

    def warm_rounds(self) -> int:
        """Capture the common draft rounds now (draft_graphs.warm_keys); 0 without draft graphs."""
        if self.rounds is None:
            return 0
        blocks, absorbs = self.rounds.blocks, self.rounds.absorbs
        fresh = 0 if blocks is None else blocks.warm(self.drafter, blocks.warm_keys())
        fresh += 0 if absorbs is None else absorbs.warm(self.drafter, absorbs.warm_keys())
        return fresh + self.rounds.warm(self.drafter, self.rounds.warm_keys())

    @property
    def round_captures(self) -> int:
        """Draft-round and block-forward graphs captured so far (0 without draft graphs)."""
        if self.rounds is None:
            return 0
        return self.rounds.captures + sum(g.captures for g in (self.rounds.blocks, self.rounds.absorbs) if g is not None)

    @torch.inference_mode()
    def fuse(self, captured):
        return self.drafter.fuse(list(captured))

    @torch.inference_mode()
    def propose(self, seqs, limits) -> list[Draft]:
        """One batched draft round for the sequences that are ready and have room to draft (limit > 0).
        A sequence with no room (its next token is its last under max_tokens or the context) drafts
        nothing: H100, session 47 (run FA), such rounds were the dspark-g7 rows' 'capture' steps, a full
        round (~1.1 ms of schedule phase at c = 1) whose drafts were cut to 0 tokens, 4 a run on coding
        c = 1 and 7 on creative. It finishes this step; its features stay pending, for the draft cache to absorb
        when it publishes the finished context (where kvd keeps drafter contexts)."""
        ready = [i for i, s in enumerate(seqs) if limits[i] > 0 and self._ready(s)]
        drafts = [Draft([]) for _ in seqs]
        if not ready:
            return drafts
        chosen = [seqs[i] for i in ready]
        self._absorb_all(chosen)
        extra = {"rounds": self.rounds} if self.rounds is not None else {}
        out = self.drafter.draft_contexts([s.draft_ctx for s in chosen], [s.draft_feats for s in chosen],
                                          [s.last_id for s in chosen], [s.request.params for s in chosen],
                                          [s.generator for s in chosen], **extra)
        tokens = out.tokens.tolist()                                  # the round's one device-to-host copy
        conf = None if out.confidence is None else out.confidence.float().tolist()
        for j, i in enumerate(ready):
            k = max(0, min(limits[i], len(tokens[j])))
            drafts[i] = Draft(tokens[j][:k], None, None if conf is None else conf[j][:k], origin=(out.probs, j))
        return drafts

    def _ready(self, seq) -> bool:
        """Features arrived since the last draft, or (for drafters that keep nothing raw) a context."""
        if seq.draft_feats is None:
            return False
        if len(seq.draft_feats):
            return True
        return seq.draft_ctx is not None and seq.draft_ctx.n > 0 and not self.drafter.keeps_tail

    @torch.inference_mode()
    def absorb(self, seq) -> None:
        """Absorb whatever features a sequence with a context still holds (a finished sequence's last
        step, so its context covers every computed block before it is published)."""
        if seq.draft_ctx is not None and seq.draft_feats is not None and len(seq.draft_feats):
            self._absorb(seq)

    @torch.inference_mode()
    def absorb_before_rest(self, seqs) -> bool:
        """Absorb the unabsorbed features of sequences about to rest (``GateSteps._rest``), so their
        contexts end where the rest begins: a later probe or resumption then drafts from a context that
        lacks only the rested positions, and a request resting from its first decode step keeps its
        prompt. One batched projection, once per rest, not per resting step. Only for drafters that keep
        nothing raw (``absorb_many``, no ``keeps_tail``); EAGLE-3 pairs a kept feature with the next
        token, which a gap would make wrong, so its features are still dropped. Returns whether it ran
        the drafter (the step is then no gate sample)."""
        if getattr(self.drafter, "absorb_many", None) is None or self.drafter.keeps_tail:
            return False
        pending = [s for s in seqs if s.draft_feats is not None and len(s.draft_feats)]
        if pending:
            self._absorb_all(pending)
        return bool(pending)

    def _absorb_all(self, seqs) -> None:
        """``_absorb`` for every sequence of a round in one batched projection: block drafters'
        ``absorb_many``, EAGLE-3's ``absorb_pairs`` (it pairs each feature with the token after it)."""
        pairs = getattr(self.drafter, "absorb_pairs", None)
        if pairs is not None:
            after = [self._tokens_after(s, self._open_context(s)) for s in seqs]
            for s, rest in zip(seqs, pairs([s.draft_ctx for s in seqs], [s.draft_feats for s in seqs], after)):
                s.draft_feats = rest
            return
        many = getattr(self.drafter, "absorb_many", None)
        if many is None:
            for s in seqs:
                self._absorb(s)
            return
        for s in seqs:
            self._open_context(s)
        graphs = None if self.rounds is None else self.rounds.absorbs
        extra = {"graphs": graphs} if graphs is not None else {}
        for s, rest in zip(seqs, many([s.draft_ctx for s in seqs], [s.draft_feats for s in seqs], **extra)):
            s.draft_feats = rest

    def _absorb(self, seq) -> None:
        """Move the sequence's new features into its drafter context (K/V projected once, kept in
        ``seq.draft_ctx``); ``seq.draft_feats`` keeps only what the drafter still needs raw."""
        feats = seq.draft_feats
        after = self._tokens_after(seq, self._open_context(seq))
        seq.draft_feats = self.drafter.absorb(seq.draft_ctx, feats, after)

    @staticmethod
    def _tokens_after(seq, first: int):
        """The token after each of the sequence's new features (positions ``first`` on): what EAGLE-3 pairs
        each feature with; block drafters ignore it."""
        return torch.tensor(seq.ids(first + 1, seq.num_computed_tokens + 1), dtype=torch.int64)

    def _open_context(self, seq) -> int:
        """The absolute position of ``seq.draft_feats[0]``, after giving the sequence its drafter context
        if it has none yet."""
        first = seq.num_computed_tokens - len(seq.draft_feats)
        if seq.draft_ctx is None:
            seq.draft_ctx = self._first_context(seq, first)
        return first

    def _first_context(self, seq, first: int):
        """The context of positions < ``first`` (the cached prefix) from kvd, else an empty one shifted
        to start at ``first``."""
        restored = self.prefix_cache.restore(seq, first) if self.prefix_cache is not None and first else None
        if restored is not None:
            return restored
        ctx = self.drafter.new_context()
        ctx.offset = first
        return ctx


NGRAM_MAX_TOKENS = 32     # prompt lookup proposes up to this many; each request's γ truncates (EngineConfig's bound)


def load_proposer(method: str, config, model) -> Proposer:
    if method == "ngram":
        from specd.drafter.config import DrafterConfig
        from specd.drafter.ngram import NgramDrafter

        dc = DrafterConfig.for_target(model.config, "ngram", gamma=NGRAM_MAX_TOKENS)
        return NgramProposer(NgramDrafter(dc))
    where = config.drafter_for(method)
    if where is None:
        raise EngineError("bad_request", f"speculation method {method!r} needs a trained drafter "
                                         "(EngineConfig.drafters / --drafters METHOD=DIR, or --drafter DIR)")
    from specd.drafter.base import load_drafter

    path = where / "drafter.safetensors" if where.is_dir() else where
    drafter = load_drafter(path, target=model, device=next(model.parameters()).device)
    if drafter.config.method != method:
        raise EngineError("bad_request", f"the drafter at {where} is {drafter.config.method!r}, not {method!r}")
    drafter.to(next(model.parameters()).dtype).eval()
    weights_sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    calibration = path.parent / "calibration.json"
    temps = json.loads(calibration.read_text())["temperatures"] if calibration.is_file() else None
    max_len = min(config.max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
    return FeatureProposer(drafter, method, temps, weights_sha256, draft_rounds(drafter, config, max_len))


def draft_rounds(drafter, config, max_len: int):
    """CUDA graphs for a block drafter's round on the GPU, when the deployment keeps CUDA graphs on: the
    block forward per (batch, context-length) bucket (specd/engine/block_graphs.py), the sampling round
    (specd/engine/draft_graphs.py) and the context projection of new features per token bucket
    (specd/engine/absorb_graphs.py), in one graph pool. None elsewhere (the eager reference: the CPU path).
    ``max_len``: the engine's context limit (the largest context bucket). ``KVSPEC_ABSORB_GRAPHS=0`` keeps
    the projection eager with the other graphs on: it is the newest of them (session 29), so a deployment
    can turn it off alone, and a benchmark can set it beside the eager path. EAGLE-3 drafts in γ sequential
    steps, replayed from specd/engine/eagle3_graphs.py (session 41; ``KVSPEC_EAGLE3_GRAPHS=0`` keeps them
    eager, as before)."""
    device = drafter.fc.weight.device
    if device.type != "cuda" or not config.cuda_graphs:
        return None
    if drafter.config.method == "eagle3":         # γ sequential steps: its own graphs (eagle3_graphs.py)
        if os.environ.get("KVSPEC_EAGLE3_GRAPHS", "1") == "0":
            return None
        from specd.engine.eagle3_graphs import Eagle3Graphs

        return Eagle3Graphs(drafter, config.max_num_seqs, max_len, device)
    if not hasattr(drafter, "sample_drafts"):
        return None
    from specd.engine.absorb_graphs import AbsorbGraphs
    from specd.engine.block_graphs import BlockGraphs
    from specd.engine.draft_graphs import DraftGraphs

    rounds = DraftGraphs(drafter, config.max_num_seqs, device)
    rounds.blocks = BlockGraphs(drafter, config.max_num_seqs, max_len, device, pool=rounds.pool, out=rounds.hidden)
    if os.environ.get("KVSPEC_ABSORB_GRAPHS", "1") != "0":
        rounds.absorbs = AbsorbGraphs(drafter, config.max_num_batched_tokens, device, pool=rounds.pool)
    return rounds

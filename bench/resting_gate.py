"""A spec gate that never lets a request draft: the ``dspark-resting`` row of ``bench speedup``.

Why: on the H200 (session 15, run AU) scheduled dspark rested every step of knowledge at c = 32 (no
drafting step, no prompt captured) and still ran 0.96x `none`: plain steps 3.19 against 2.85 ms, prompt
steps 8.50 against 7.93. On the CPU the resting steps run the same path as `none`'s
(tests/engine/rest_capture_probe.py), so the cost is on the device and has to be seen there. That cell
rested only because four workloads before it had taught the gate to; this gate rests from the first step,
so one workload at one load reproduces the condition in a short run, and ``--torch-profile`` can set its
kernels beside `none`'s. The engine's side of the gate runs as it does for a resting cell: the full
question at the first step of a run of decode steps, the steady rest (``rests_again``, then its leases)
after it, every step reported to ``observe`` (a leased one when its lease ends). Not a serving setting: a
deployment that wants no drafting asks for `none`.
"""
from __future__ import annotations

from specd.engine.spec_gate import LEASE_STEPS, Acceptance, SpecGate, load_bucket


class RestingGate(SpecGate):
    """``SpecGate`` with every drafting answer "no": no exploration of drafting, no class exploration, no
    probe, no resumption; what it measures (both arms' reports) is kept as usual."""

    @staticmethod
    def explores(record: Acceptance) -> bool:
        return False

    def should_draft(self, method: str, sequences: int, measured: bool = True,
                     requests: list[Acceptance] | None = None, verify: int | None = None, copies: int = 1,
                     caps: list[int] | None = None) -> bool:
        if measured:
            cell = self._cell(method, sequences)
            cell.rest_admitted = self.admitted    # ``rests_again`` answers for these requests from now on
            return self._drafts(cell, "winner", False)
        return False

    def rests_again(self, method: str, sequences: int, subset: bool = False) -> bool:
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or cell.rest_admitted != self.admitted:
            return False                      # a new request: ask in full (``should_draft``), as the real gate
        self._drafts(cell, "winner", False)
        return True

    def rest_lease(self, method: str, sequences: int, most: int = LEASE_STEPS, found: bool = False) -> int:
        """The steady rest takes leases as the real gate's does between probes (``SpecGate.rest_lease``);
        no probe ever comes here, so every lease is the longest (``most``: a rest span's). ``found``: a
        cheap proposer's asked rest (``GateSteps._lease_found``), leased alike."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None:
            return 0
        cell.lease_basis = cell.basis
        return most

    def join_rest(self, method: str, sequences: int, requests: list[Acceptance]) -> bool:
        """New requests join the rest of a cell that has rested (``SpecGate.join_rest``), so a carried rest and
        a rest span go on through admissions as the real gate's do in a resting cell. Until session 33 this
        gate kept no rest bound, so ``SpecGate.join_rest`` refused every join: the row's prompt steps ended
        its carried rests and each admission its span (stories260K, c = 4, a closed loop of 32 requests: 125
        span steps of 200 against 188 now, 150 rested without a walk against 196)."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or cell.rest_admitted < 0:      # never asked in full: no rest to join
            return False
        cell.rest_admitted = self.admitted
        return True

    def rejoin_rest(self, method: str, sequences: int) -> bool:
        return self.join_rest(method, sequences, [])

    def exploring(self, method: str) -> list[int]:
        return []                             # nothing to explore: no extra warm-ups (``finish_exploring``)

    def resumes(self, method: str, sequences: int, requests: list[Acceptance]) -> bool:
        return False

    def drafts_beside_prompts(self, method: str, sequences: int, requests: list[Acceptance],
                              verify: int | None = None) -> bool:
        return False

    def probe_next(self, method: str, sequences: int) -> bool:
        return False

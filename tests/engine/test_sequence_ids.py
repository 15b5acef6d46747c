"""``Sequence.ids`` and ``last_id`` read the token stream without building ``all_ids`` (the step's hot
paths: host_step, extend_hashes, the drafter's context): they must equal slices of it."""
from __future__ import annotations

import random

from specd.engine.request import Request
from specd.engine.sequence import Sequence
from specd.sampling_params import SamplingParams


def test_ids_equal_slices_of_all_ids():
    rng = random.Random(0)
    for _ in range(200):
        seq = Sequence(Request("r", [rng.randrange(50) for _ in range(rng.randint(1, 30))],
                               SamplingParams(max_tokens=64)), None, None)
        seq.output_ids = [rng.randrange(50) for _ in range(rng.randint(0, 30))]
        whole = seq.all_ids
        start = rng.randint(0, len(whole))
        end = rng.randint(start, len(whole))
        assert seq.ids(start, end) == whole[start:end]
        assert seq.last_id == whole[-1]

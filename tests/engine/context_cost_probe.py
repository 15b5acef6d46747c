"""Host cost per decode step that grows with the context: host_step and extend_hashes for 32 sequences
of 10k tokens (docs/design/interfaces.md, "Engine").

    python -m tests.engine.context_cost_probe
"""
import time, statistics
from specd.engine.request import Request
from specd.engine.sequence import Sequence
from specd.engine.scheduler import ScheduledSeq
from specd.engine.model_runner import host_step
from specd.engine.block_manager import BlockManager
from specd.sampling_params import SamplingParams
seqs = []
for i in range(32):
    s = Sequence(Request(f"r{i}", list(range(10000 + i)), SamplingParams(max_tokens=64)), None, None)
    s.output_ids = list(range(20))
    s.num_computed_tokens = s.num_tokens - 1
    s.block_table = list(range((s.num_tokens + 15) // 16))
    seqs.append(s)
batch = [ScheduledSeq(s, 1) for s in seqs]
ts = []
for _ in range(200):
    t = time.perf_counter(); host_step(batch, 16); ts.append(time.perf_counter() - t)
print("host_step 32 x 10k context: median %.3f ms" % (1e3 * statistics.median(ts)))

class NoSource(BlockManager):
    def __init__(self):              # extend_hashes needs only the block size and the hash root
        self.block_size, self.root = 16, b"r" * 16


bm = NoSource()
for s in seqs:
    bm.extend_hashes(s)
ts = []
for step in range(200):
    for s in seqs:
        s.output_ids.append(step)
    t = time.perf_counter()
    for s in seqs:
        bm.extend_hashes(s)
    ts.append(time.perf_counter() - t)
print("extend_hashes 32 x 10k, one new token each: median %.3f ms" % (1e3 * statistics.median(ts)))

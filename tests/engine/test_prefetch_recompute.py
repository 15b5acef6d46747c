"""The prefetch budget end to end (stories260K, real kvd with an NVMe tier): a prompt whose cached blocks
were demoted to NVMe is recomputed when kvd is told NVMe is absurdly slow, promoted when it is fast, and
the output is the same as without any cache either way; kvctl stats shows the decisions. With the default
``skip_unpaid_nvme`` a slow NVMe is not even written (the engine's lookups carry its recompute price)."""
from __future__ import annotations

import json

import pytest
import torch

from bench.kvd_process import KvdProcess
from client import kvctl
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from tests.greedy_runs import greedy_run as run

pytestmark = pytest.mark.slow

BLOCK_BYTES = 5 * 2 * 16 * 4 * 8 * 4      # stories260K: L * 2 * bs * Hkv * D * fp32


def prompts(vocab: int) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(5)
    first = torch.randint(3, vocab, (150,), generator=g).tolist()
    flood = [torch.randint(3, vocab, (150,), generator=g).tolist() for _ in range(2)]
    return first, flood


@pytest.mark.parametrize("nvme_gbps,recomputed,skip_unpaid", [(1e-9, True, False), (100.0, False, True),
                                                              (1e-9, True, True)])
def test_slow_nvme_hit_is_recomputed_with_the_same_output(tmp_path, capsys, nvme_gbps, recomputed, skip_unpaid):
    torch.set_num_threads(1)
    local = SpecEngine.from_config(EngineConfig(cuda_graphs=False))
    with KvdProcess(tmp_path / "kvd", gpu_bytes=28 * BLOCK_BYTES, dram_blocks=0, nvme_blocks=64,
                    nvme_dir=tmp_path / "nvme", policy="lru-offload", max_groups=1,
                    promote_nvme_gbps=nvme_gbps, skip_unpaid_nvme=skip_unpaid) as kvd:
        eng = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir, cuda_graphs=False))
        first, flood = prompts(eng.model.config.vocab_size)
        want, _ = run(local, "w", first)
        assert run(eng, "a", first)[0] == want                   # prefills 150 tokens: the rate is measured
        assert eng.source.prefill.block_seconds() is not None
        for i, p in enumerate(flood):                              # pushes the first prompt's blocks to NVMe
            run(eng, f"f{i}", p)
        got, usage = run(eng, "b", first)
        assert got == want                                         # the cache never changes the output
        assert kvctl.main(["--run-dir", str(kvd.run_dir), "stats", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
    group = stats["groups"]["full"]
    if recomputed and skip_unpaid:      # never written: the flood's victims were dropped, not sent to NVMe
        assert group["nvme_pays"] is False and group["nvme_unpaid_drops"] > 0
        assert stats["demote_nvme_blocks"] == 0 and stats["prefetch_promoted_blocks"] == 0
        assert usage.cached_tokens < 9 * 16
    elif recomputed:
        assert group["nvme_pays"] is True and stats["demote_nvme_blocks"] > 0
        assert stats["prefetch_recompute_lookups"] >= 1 and stats["prefetch_promoted_blocks"] == 0
        assert usage.cached_tokens < 9 * 16
    else:
        assert stats["prefetch_recompute_lookups"] == 0 and stats["prefetch_promoted_blocks"] > 0
        assert usage.cached_tokens == 9 * 16

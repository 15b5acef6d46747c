"""The one typed config of kvd.

Precedence, highest first: overrides (CLI flags, one per field) > environment (``KVD_<FIELD>``,
upper case) > TOML file > defaults. Why one model: every knob is documented and validated in one
place, and no other module reads ``os.environ``.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import ByteSize, BaseModel, ConfigDict, Field, ValidationError, model_validator

MiB = 1 << 20
GiB = 1 << 30


class KvdConfig(BaseModel):
    """kvd settings. Capacity bytes are divided among cache groups as they attach: each group gets
    ``<tier>_bytes // max_groups`` (so a later attach never shrinks a pool a client already mapped);
    a ``<tier>_blocks`` override gives every group exactly that many blocks instead."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run_dir: Path = Field(
        default=Path("/run/kvd"),
        description="Directory of the sockets (kvd.sock, kvd-admin.sock); $KVD_RUN_DIR sets it.",
    )
    gpu_bytes: ByteSize = Field(
        default=256 * MiB, ge=0, description="Bytes of the GPU pool (or its /dev/shm stand-in), all groups; accepts 8GiB, 512MiB, 8G."
    )
    dram_bytes: ByteSize = Field(
        default=1 * GiB, ge=0, description="Bytes of the DRAM tier (POSIX shared memory), all groups; 0 disables it."
    )
    nvme_bytes: ByteSize = Field(
        default=4 * GiB, ge=0, description="Bytes of the NVMe slab files, all groups; 0 disables the tier."
    )
    nvme_dir: Path | None = Field(
        default=None,
        description="Directory of the NVMe slab files and their index; None disables the NVMe tier. "
        "It must survive restarts for persistence (for example /var/lib/kvd/nvme).",
    )
    policy: Literal["reuse", "lru", "lru-offload"] = Field(
        default="reuse",
        description="Eviction policy: 'reuse' (reuse-aware, tiered), 'lru' (vLLM-like, GPU only), "
        "'lru-offload' (LMCache-like: LRU, evicted GPU blocks go to DRAM).",
    )
    lease_ttl_s: float = Field(
        default=30.0, gt=0, description="A lease not renewed by a heartbeat within this time is reclaimed."
    )
    heartbeat_s: float = Field(
        default=5.0, gt=0, description="Interval at which clients are told to heartbeat (must be < lease_ttl_s)."
    )
    half_life_s: float = Field(
        default=300.0, gt=0, description="Half-life of a block's temperature (decayed access count); 300 s maximised the reuse policy's hit rate on the Mooncake conversation trace (150-1200 s tried)."
    )
    admission: Literal["none", "seen-twice", "not-dead"] = Field(
        default="not-dead",
        description="Gate for DRAM/NVMe under the reuse policy: 'seen-twice' admits blocks accessed twice; "
        "'not-dead' also admits once-seen blocks unless known dead (kvd/admission.py has the measurement).",
    )
    frequency_per_session: bool = Field(
        default=True,
        description="A lookup by the session that last released a block refreshes its recency but does not add "
        "to its access count: a session re-reading its own history is one user, not several. Counting every "
        "lookup let long sessions' early blocks outlive other sessions' live prefixes "
        "(docs/design/eviction.md, 'Per-session frequency').",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Where the GPU pool lives: 'auto' = CUDA if available, else shared memory."
    )
    socket_mode: int = Field(default=0o660, ge=0, le=0o777, description="Permission bits of the sockets.")
    max_groups: int = Field(
        default=2, ge=1, description="Number of cache groups the capacity is divided into (full + draft)."
    )
    gpu_blocks: int | None = Field(
        default=None, ge=1, description="Override: GPU blocks per group (ignores gpu_bytes); for benchmarks."
    )
    dram_blocks: int | None = Field(default=None, ge=0, description="Override: DRAM blocks per group.")
    nvme_blocks: int | None = Field(default=None, ge=0, description="Override: NVMe blocks per group.")
    promote_dram_gbps: float = Field(
        default=10.0, gt=0, description="Starting estimate of the DRAM->GPU promotion rate (GB/s); measured copies "
        "replace it (EWMA). The prefetch budget compares it with the client's prefill rate.",
    )
    promote_nvme_gbps: float = Field(
        default=1.5, gt=0, description="Starting estimate of the NVMe->GPU promotion rate (GB/s), as above.",
    )
    skip_unpaid_nvme: bool = Field(
        default=True, description="Write a block to NVMe only while promoting it back (the measured NVMe rate) is "
        "predicted cheaper than the client's recompute price from its lookups; otherwise the victims of the tier above "
        "NVMe are dropped (nvme_unpaid_drops). Off: NVMe takes every admitted victim.",
    )
    gil_switch_ms: float = Field(
        default=0.5, gt=0, le=100,
        description="Python's thread switch interval in the kvd daemon (sys.setswitchinterval, ms; Python's default "
        "is 5). kvd's server loop, cleaner and mover threads share the GIL; the mover gives it up inside each copy "
        "call and waited up to a switch interval to get it back: on the H200 a 760 MB promotion took 547 ms to "
        "issue beside a GIL-busy thread at 5 ms and 34 ms at 0.5 ms (15 ms with one batched copy call). Set by the "
        "daemon (kvd/__main__.py), not by an embedded KvdCore.",
    )
    gc_freeze: bool = Field(
        default=True,
        description="Once the daemon is up, freeze the start-up heap (torch, the tiers, imports) out of Python's "
        "garbage-collector passes, so a full pass does not walk it while requests wait (kvd/gc_pauses.py; specd "
        "does the same). The passes that remain are counted in stats (server.gc). Off: the default collector.",
    )
    move_workers: int = Field(
        default=1,
        ge=0,
        description="Threads that run promotions (tier copies); 0 runs them, and the cleaner's demotions, inside "
        "tick()/wait_ready() (deterministic tests); > 0 also starts the cleaner thread.",
    )
    clean_low: float = Field(
        default=0.03, ge=0, lt=1,
        description="Low watermark of the background cleaner, as a fraction of a tier's blocks (at least one block): "
        "when fewer slots are free, the cleaner demotes policy victims one tier down, off the request path.",
    )
    clean_high: float = Field(
        default=0.06, ge=0, lt=1,
        description="High watermark: the cleaner stops once this fraction of the tier is free (the reserve that "
        "absorbs a burst of allocations without any request waiting for a copy).",
    )
    clean_min_blocks: int = Field(
        default=512, ge=0,
        description="Each tier's cleaner reserve (high watermark) holds at least this many blocks, at most a quarter "
        "of the tier (the low mark is then half of it); the tier below the GPU gets it too, so that it takes a GPU "
        "refill's demotions without spilling. A promotion needs one free GPU slot per block, and a long "
        "turn's hit is ~600 blocks of 16 tokens whatever the model; a 0.06 share of a small pool of big blocks (an 8B "
        "model's 2,750 blocks of 2.36 MB) is 165, so lookups waited on the cleaner with the engine blocked "
        "behind them (docs/design/kvd.md, \"A GPU reserve in blocks\").",
    )
    clean_batch: int = Field(
        default=32, ge=1,
        description="Blocks the cleaner copies per batch (one lock round trip, one NVMe index append per batch).",
    )
    pressure_wait_ms: float = Field(
        default=50.0, ge=0,
        description="When a request needs a GPU slot, none is free and the next victim would be demoted: wait up to "
        "this long (kvd's lock released) for the cleaner to free one, then drop the victim (a pressure drop); 0 "
        "drops at once. Only with a cleaner thread (move_workers > 0). Why waiting: docs/design/kvd.md.",
    )

    @model_validator(mode="after")
    def _heartbeat_below_ttl(self) -> "KvdConfig":
        if self.heartbeat_s >= self.lease_ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be below lease_ttl_s ({self.lease_ttl_s})")
        if self.clean_low > self.clean_high:
            raise ValueError(f"clean_low ({self.clean_low}) must not exceed clean_high ({self.clean_high})")
        return self

    @classmethod
    def load(
        cls,
        toml_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> "KvdConfig":
        """Merge file < env < overrides; ``None`` values in overrides mean 'flag not given'.

        Raises ValueError (pydantic ValidationError) on an unknown field or a bad value."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        if toml_path is not None:
            with open(toml_path, "rb") as f:
                values.update(tomllib.load(f))
        values.update(_from_env(env))
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.model_validate(values)

    def blocks_for(self, tier_bytes: int, override: int | None, block_bytes: int) -> int:
        """A group's block count in one tier (the division rule in the class docstring)."""
        if override is not None:
            return override
        return (tier_bytes // self.max_groups) // block_bytes


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """``KVD_<FIELD>`` for every field; pydantic parses the strings (socket_mode accepts '0o660')."""
    out: dict[str, Any] = {}
    for name in KvdConfig.model_fields:
        raw = env.get(f"KVD_{name.upper()}")
        if raw is None:
            continue
        out[name] = int(raw, 0) if name == "socket_mode" else raw
    return out


__all__ = ["KvdConfig", "ValidationError"]

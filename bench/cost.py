"""Serving cost per million output tokens, from measured throughput and the GPU-hour price.

cost = price per GPU-hour x GPUs x wall hours / output tokens x 1e6. The run's GPUs are billed for the
whole wall time, busy or idle, which is how a rented node is paid for.
"""
from __future__ import annotations

GPU_HOUR_USD = 3.99  # the price the product's claims are stated at (an H200 on demand)


def cost_per_million_output_tokens(output_tokens: int, wall_time_s: float, gpus: int,
                                   gpu_hour_usd: float = GPU_HOUR_USD) -> float:
    if output_tokens <= 0 or wall_time_s <= 0 or gpus <= 0:
        raise ValueError("output_tokens, wall_time_s and gpus must be positive")
    return gpu_hour_usd * gpus * (wall_time_s / 3600.0) / output_tokens * 1e6

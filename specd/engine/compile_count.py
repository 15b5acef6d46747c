"""Triton kernels compiled (or loaded from Triton's disk cache) by this process so far.

Why: a step in which a Triton kernel is built for a new specialisation lasts ~0.3-1 s once on the H200,
and the engine must not take it as a sample of what a step costs (the spec gate, the scheduler's
overhead estimate), exactly as it already skips steps that captured a CUDA graph. Compiles inside a
capture were already excluded; this counts the ones outside (eager paths: a drafter's absorb, a verify
that no graph covers). Triton reports each build through ``triton.knobs.runtime.jit_post_compile_hook``
(Triton ≥ 3.4); the counter chains any hook set before it. Where Triton has no such hook, or runs in
the interpreter (no compiles), the count stays 0 and nothing else changes.
"""
from __future__ import annotations

_count = 0
_installed = False


def install() -> bool:
    """Start counting (idempotent). False where this Triton cannot report compiles."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
        runtime = knobs.runtime
    except (ImportError, AttributeError):
        return False
    if not hasattr(runtime, "jit_post_compile_hook"):
        return False
    previous = runtime.jit_post_compile_hook

    def counted(*args, **kwargs):
        global _count
        _count += 1
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = counted
    _installed = True
    return True


def compiles() -> int:
    """Triton compiles seen since ``install`` (0 before it, or without the hook)."""
    return _count

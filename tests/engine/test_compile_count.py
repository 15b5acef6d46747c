"""The Triton compile counter: counts through Triton's post-compile hook and chains a hook set before it."""
from __future__ import annotations

import pytest

from specd.engine import compile_count

knobs = pytest.importorskip("triton.knobs")


def test_counts_compiles_and_keeps_an_earlier_hook(monkeypatch):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda *a, **k: seen.append(k.get("key")))
    monkeypatch.setattr(compile_count, "_installed", False)
    monkeypatch.setattr(compile_count, "_count", 0)
    assert compile_count.install() and compile_count.install()      # idempotent: one hook, not two
    hook = knobs.runtime.jit_post_compile_hook
    hook(key="a", repr="k[a]", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    hook(key="b", repr="k[b]", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    assert compile_count.compiles() == 2
    assert seen == ["a", "b"]                                      # the earlier hook still runs


def test_without_the_hook_nothing_is_counted(monkeypatch):
    """An older Triton (no knobs.runtime.jit_post_compile_hook): no count, and no error."""
    import types

    import triton

    monkeypatch.setattr(triton, "knobs", types.SimpleNamespace(runtime=types.SimpleNamespace()))
    monkeypatch.setattr(compile_count, "_installed", False)
    monkeypatch.setattr(compile_count, "_count", 0)
    assert not compile_count.install()
    assert compile_count.compiles() == 0

"""Session hints: block kinds from prefix spans, return-time learning, chat boundaries, and the hints
reaching a real kvd from the engine."""
from __future__ import annotations

import pytest

from kvd.types import BlockHash, BlockKind
from specd.engine.hints import (DEFAULT_CLASS, ReturnTimeModel, SessionHints, block_kinds, chat_prefix_kinds,
                                common_prefix_len, session_class)
from specd.tokenizer import Tokenizer

S, T, C = BlockKind.SYSTEM, BlockKind.TOOL_SCHEMA, BlockKind.CONVERSATION


def hashes(n: int) -> list[BlockHash]:
    return [BlockHash(bytes([i]) * 16) for i in range(n)]


def test_block_kinds_follow_whole_blocks_inside_the_spans():
    hs = hashes(6)
    # system = tokens [0, 40), tools = [40, 70): block 2 ([32, 48)) straddles -> shared, so TOOL_SCHEMA
    kinds = block_kinds(hs, [(40, S), (30, T)], 16)
    assert [kinds[h] for h in hs] == [S, S, T, T, C, C]
    assert [block_kinds(hs, None, 16)[h] for h in hs] == [C] * 6
    only_tools = block_kinds(hs, [(33, T)], 16)
    assert [only_tools[h] for h in hs] == [T, T, C, C, C, C]


def test_session_class_is_the_last_shared_block():
    hs = hashes(4)
    assert session_class(block_kinds(hs, [(40, S)], 16), hs) == hs[1].hex()
    assert session_class(block_kinds(hs, None, 16), hs) == DEFAULT_CLASS


def test_return_time_learns_per_session_then_per_class():
    m = ReturnTimeModel(default_s=30.0)
    assert m.turn_finished("a", "app", arrival_s=0.0, now=1.0) == 30.0      # nothing seen: default
    assert m.turn_finished("a", "app", arrival_s=11.0, now=12.0) == 10.0    # gap 11 - 1
    assert m.turn_finished("a", "app", arrival_s=32.0, now=33.0) == 15.0    # EWMA(0.5) of 10, 20
    # a new session of the same application starts from the class median, another class from the default
    assert m.turn_finished("b", "app", arrival_s=40.0, now=41.0) == 15.0
    assert m.turn_finished("c", "other", arrival_s=40.0, now=41.0) == 30.0


def test_return_time_model_forgets_the_oldest_sessions():
    m = ReturnTimeModel(default_s=5.0, max_sessions=2)
    for s in "abc":
        m.turn_finished(s, "x", 0.0, 1.0)
    m.turn_finished("a", "x", arrival_s=3.0, now=4.0)   # "a" was forgotten: no gap observed
    assert m.expected("a") == 5.0 and m.expected("c") == 5.0


def test_release_hints_shape_and_client_override():
    sh = SessionHints(16, ReturnTimeModel(default_s=7.0))
    hs = hashes(3)
    assert sh.release_hints([], None, None, 0.0, 1.0) is None
    h = sh.release_hints(hs, [(32, S)], "s1", 0.0, 1.0)
    assert h["session"] == "s1" and h["turn_end"] is True and h["expected_return_s"] == 7.0
    assert h["kinds"] == {bytes(hs[0]): int(S), bytes(hs[1]): int(S), bytes(hs[2]): int(C)}
    assert sh.release_hints(hs, None, "s2", 0.0, 1.0, expected_return_s=99999.0)["expected_return_s"] == 3600.0
    assert "session" not in sh.release_hints(hs, None, None, 0.0, 1.0)


TOOLS_TEMPLATE = (  # Qwen-like: tools rendered inside the system turn, after the system text
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<s>{{ m.content }}"
    "{%- if tools %} Tools: {% for t in tools %}{{ t.function.name }}: {{ t.function.description }}. {% endfor %}{% endif -%}"
    "</s>\n"
    "{%- else -%}{{ m.role }}: {{ m.content }}\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}"
)


@pytest.fixture(scope="module")
def stories_tokenizer() -> Tokenizer:
    from specd.engine.config import DEFAULT_MODEL
    from specd.loader import load_model

    return load_model(DEFAULT_MODEL, dtype="float32", device="cpu")[1]


def test_chat_prefix_kinds_on_the_fallback_template(stories_tokenizer):
    tok = stories_tokenizer
    system = "Once upon a time there was a kind teacher who told stories to children every day."
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me about the dog."}]
    ids = tok.encode_chat(msgs)
    spans = chat_prefix_kinds(tok.encode_chat, msgs, ids)
    assert spans is not None and spans[0][1] == S and len(spans) == 1
    n = spans[0][0]
    assert tok.decode(ids[:n]).startswith(system[:60]) and n <= len(tok.encode_chat(msgs[:1], False))
    # another user turn after the same system prompt shares exactly that span
    other = tok.encode_chat([msgs[0], {"role": "user", "content": "A cat sat."}])
    assert common_prefix_len(ids, other) >= n
    assert chat_prefix_kinds(tok.encode_chat, msgs[1:], tok.encode_chat(msgs[1:]), None) is None


def test_chat_prefix_kinds_finds_the_tools_span(stories_tokenizer):
    tok = Tokenizer(stories_tokenizer.inner, stories_tokenizer.bos_id, stories_tokenizer.eos_id,
                    add_bos=True, chat_template=TOOLS_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file from the disk"}},
             {"type": "function", "function": {"name": "run_tests", "description": "Run the unit tests"}}]
    msgs = [{"role": "system", "content": "You are a careful coding agent."}, {"role": "user", "content": "Fix it."}]
    ids = tok.encode_chat(msgs, tools=tools)
    spans = chat_prefix_kinds(tok.encode_chat, msgs, ids, tools)
    assert [k for _, k in spans] == [S, T]
    sys_n, tool_n = spans[0][0], spans[1][0]
    assert "coding agent" in tok.decode(ids[:sys_n]) and "Tools" not in tok.decode(ids[:sys_n])
    assert "run_tests: Run the unit tests" in tok.decode(ids[: sys_n + tool_n])
    assert "Fix it" not in tok.decode(ids[: sys_n + tool_n])


@pytest.mark.slow
def test_engine_sends_kinds_and_expected_return_to_kvd(tmp_path):
    from bench.kvd_process import KvdProcess
    from client.kvd_client import KvdClient
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine
    from specd.engine.request import Request
    from specd.sampling_params import SamplingParams

    with KvdProcess(tmp_path / "kvd", gpu_bytes=8 << 20, dram_bytes=0, policy="reuse") as kvd:
        engine = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir))
        prompt = engine.tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play "
                                         "outside in the park with her dog and her friends every single day.")
        engine.add_request(Request("r1", prompt, SamplingParams(temperature=0.0, max_tokens=4), session="sess-1",
                                   prefix_kinds=[(32, int(S))], expected_return_s=120.0))
        while engine.has_work():
            engine.step()
        engine.source.settle()       # the release carrying the hints is posted: wait for kvd's answer, so
        with KvdClient(kvd.run_dir) as c:    # this other connection's query cannot overtake it (it flaked)
            kinds = {b["kind"] for b in c.top(100)}
            sessions = {s["session"]: s for s in c.sessions()}
        assert "system" in kinds and "conversation" in kinds
        s = sessions["sess-1"]
        assert s["expected_return_at"] - s["last_seen"] == pytest.approx(120.0, abs=1.0)

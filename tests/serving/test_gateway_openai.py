"""The HTTP gateway as users call it: the official `openai` client against a specd process.

The process is the real specd (CLI, IPC server, gateway, uvicorn) with the fake echo engine, so the
expected text is exact; tests/serving/test_specd_stories.py repeats the key checks on the real model.
"""
from __future__ import annotations

import json
import time

import openai
import pytest
import specd_process

from client.specd_client import SpecdClient

pytestmark = pytest.mark.slow
MODEL = "fake-echo"


@pytest.fixture(scope="module")
def specd():
    sp = specd_process.start(["tests/serving/fake_specd.py", "0.002", "--max-model-len", "64"])
    yield sp
    specd_process.stop(sp)


@pytest.fixture(scope="module")
def oai(specd):
    return openai.OpenAI(base_url=specd.base_url + "/v1", api_key="unused", max_retries=0, timeout=10)


def test_models_lists_the_served_model(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_with_text_prompt(oai):
    out = oai.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
    assert out.choices[0].text == "hello"
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (6, 5, 11)


def test_completion_with_token_id_prompt(oai):
    out = oai.completions.create(model=MODEL, prompt=[ord(c) + 3 for c in "tok"], max_tokens=3)
    assert out.choices[0].text == "tok" and out.usage.prompt_tokens == 3


def test_repeated_prompt_reports_cached_tokens(oai):
    prompt = "a shared system prompt"
    first = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 20  # 23 prompt tokens -> 5 full 4-token blocks


def test_chat_completion(oai):
    out = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == "<user>"
    assert out.object == "chat.completion" and out.usage.completion_tokens == 6


def test_streaming_completion_with_usage(oai):
    chunks = list(oai.completions.create(model=MODEL, prompt="stream", max_tokens=6, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "stream"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_streaming_chat(oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "yo"}],
                                              max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "<use"
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, code", [
    ({"prompt": ""}, "empty_prompt"),
    ({"prompt": "x" * 100}, "context_length_exceeded"),
    ({"prompt": "x", "temperature": -1}, "invalid_value"),
    ({"prompt": "x", "top_p": 1.5}, "invalid_value"),
    ({"prompt": "x", "n": 2}, "unsupported_value"),
    ({"prompt": ["a", "b"]}, "unsupported_value"),
    ({"prompt": "x", "extra_body": {"frobnicate": True}}, "unknown_parameter"),
])
def test_bad_completion_requests_are_400(oai, kwargs, code):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, max_tokens=2, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["code"] == code


def test_streamed_bad_request_is_400_not_a_broken_stream(oai):
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="", max_tokens=2, stream=True)


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_malformed_bodies(specd):
    status, text = specd_process.http_call(specd.base_url + "/v1/chat/completions", {"model": MODEL})
    assert status == 422 and json.loads(text)["error"]["param"] == "messages"
    status, text = specd_process.http_call(specd.base_url + "/v1/completions", b"{nope")
    assert status == 400 and json.loads(text)["error"]["code"] == "invalid_json"


def test_client_disconnect_mid_stream_frees_the_request(specd):
    body = {"model": MODEL, "prompt": "never ending", "max_tokens": 5000, "stream": True}
    lines = specd_process.read_stream_then_hang_up(specd.base_url, "/v1/completions", body, lines=2)
    assert all(line.startswith("data: ") for line in lines)
    with SpecdClient(specd.run_dir, timeout_s=5) as c:
        deadline = time.monotonic() + 5
        while c.stats()["requests_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = c.stats()
    assert stats["requests_running"] == 0
    assert stats["ipc_cancels_total"] >= 1
    assert stats["tokens_generated_total"] < 5000


def test_metrics_scrape(specd, oai):
    oai.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    status, text = specd_process.http_call(specd.base_url + "/metrics")
    assert status == 200
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert samples['specd_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert samples['specd_requests_total{endpoint="/v1/completions",status="400"}'] >= 1
    assert samples["specd_time_to_first_token_seconds_count"] >= 1
    assert samples["specd_inter_token_latency_seconds_count"] >= 2
    assert samples["specd_generation_tokens_total"] >= 3
    assert samples["specd_engine_up"] == 1 and samples["specd_kvd_connected"] == 0
    assert 'specd_engine_stat{name="tokens_generated_total"}' in samples

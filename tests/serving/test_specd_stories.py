"""The whole stack on the real engine: `python -m specd` serving the bundled stories260K on the CPU,
called through the official `openai` client and through the IPC client library."""
from __future__ import annotations

import importlib.util
import tempfile
import time

import openai
import pytest
import specd_process

from client.specd_client import SpecdClient

pytestmark = pytest.mark.slow
MODEL = "stories260K.gguf"
# Greedy from BOS, from ../shared/data/README.md (SentencePiece decode drops the leading space).
REFERENCE = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
             "One day, she saw a big, red ball. She wanted to play with it, but it was too high")
HAVE_KVD_SOURCE = importlib.util.find_spec("specd.engine.kvd_source") is not None


@pytest.fixture(scope="module")
def specd():
    argv = ["-m", "specd", "--model", "models/stories260K.gguf", "--max-model-len", "128"]
    if HAVE_KVD_SOURCE:  # a kvd run dir where no kvd runs: specd must serve without the cache
        argv += ["--kvd-run-dir", tempfile.mkdtemp(prefix="kvd-absent-", dir="/tmp")]
    sp = specd_process.start(argv, ready_timeout_s=120)
    yield sp
    specd_process.stop(sp)


@pytest.fixture(scope="module")
def oai(specd):
    return openai.OpenAI(base_url=specd.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_greedy_from_bos_reproduces_the_reference_text(oai):
    out = oai.completions.create(model=MODEL, prompt=[1], max_tokens=40, temperature=0)
    text = out.choices[0].text.strip()
    assert len(text) > 80 and REFERENCE.startswith(text)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (1, 40)


def test_text_prompt_continues_the_story(oai):
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert out.choices[0].text.strip().startswith("One day, she saw")


def test_streamed_chat_matches_the_unstreamed_one(oai):
    msgs = [{"role": "user", "content": "Tell me about a dog."}]
    full = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content and streamed
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("prompt, code", [
    ("", "empty_prompt"),
    ("the dog ran " * 100, "context_length_exceeded"),
    ([1, 100000], "bad_request"),
])
def test_bad_prompts_are_400(oai, prompt, code):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert info.value.body["code"] == code


def test_ipc_client_and_cancel_frees_the_request(specd):
    with SpecdClient(specd.run_dir, timeout_s=30) as client:
        result = client.generate([1], max_tokens=12, temperature=0)
        assert REFERENCE.startswith(result.text.strip()) and result.finish_reason == "length"
        before = client.stats()["requests_aborted"]
        for i, _ in enumerate(client.stream([1], max_tokens=100, temperature=0)):
            if i == 2:
                break
        deadline = time.monotonic() + 10
        while client.stats()["requests_aborted"] == before and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = client.stats()
    assert stats["requests_aborted"] == before + 1
    assert stats["requests_running"] == 0 and stats["ipc_requests_in_flight"] == 0


@pytest.mark.skipif(not HAVE_KVD_SOURCE, reason="specd.engine.kvd_source has not landed yet")
def test_serves_without_kvd_and_says_so(specd, oai):
    oai.completions.create(model=MODEL, prompt=[1], max_tokens=2)
    status, text = specd_process.http_call(specd.base_url + "/metrics")
    assert status == 200 and "specd_kvd_connected 0.0" in text
    assert "kvd unavailable" in specd.log()


def test_metrics_count_real_tokens(specd, oai):
    oai.completions.create(model=MODEL, prompt=[1], max_tokens=5, temperature=0)
    status, text = specd_process.http_call(specd.base_url + "/metrics")
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert status == 200
    assert samples["specd_generation_tokens_total"] >= 5
    assert samples["specd_time_to_first_token_seconds_count"] >= 1
    assert samples['specd_engine_stat{name="tokens_generated_total"}'] >= 5
    # the start-up heap is frozen out of the collector's passes (gc_freeze, on by default), and the passes
    # since are counted by generation
    assert samples['specd_engine_stat{name="gc_frozen_objects"}'] > 10_000
    assert all(f'specd_engine_stat{{name="gc_gen{g}_passes_total"}}' in samples for g in (0, 1, 2))


def test_speculation_is_chosen_per_request_and_reported_in_usage(oai):
    prompt = "Tom said: the cat sat on the mat. The cat sat on the mat. The cat sat on the"
    plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                   extra_body={"speculation": {"method": "none"}})
    fast = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"speculation": {"method": "ngram"}})
    assert fast.choices[0].text == plain.choices[0].text          # greedy: speculation changes nothing
    assert plain.usage.speculation == {"verifications": 0, "drafted_tokens": 0, "accepted_tokens": 0}
    spec = fast.usage.speculation
    assert spec["verifications"] > 0 and 0 < spec["accepted_tokens"] <= spec["drafted_tokens"]
    # auto: this deployment has no dspark drafter, so its one candidate is ngram, and usage says so
    auto = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"speculation": {"method": "auto"}})
    assert auto.choices[0].text == plain.choices[0].text
    assert auto.usage.speculation["method"] == "ngram"
    with pytest.raises(openai.BadRequestError):   # auto picks the schedule itself
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                               extra_body={"speculation": {"method": "auto", "schedule": "fixed"}})


def test_unknown_or_unavailable_speculation_is_a_400(oai):
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={"speculation": {"method": "magic"}})
    with pytest.raises(openai.BadRequestError):   # dspark needs a drafter this deployment does not have
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={"speculation": {"method": "dspark"}})

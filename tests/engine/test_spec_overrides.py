"""Per-request speculation overrides (method, schedule, γ) and several drafters in one engine:
bad values are refused with typed errors at every edge, and a fixed-γ request verifies γ drafts."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from specd import protocol
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.errors import EngineError
from specd.engine.request import Request
from specd.openai_schema import CompletionRequest
from specd.sampling_params import SamplingParams, SpeculationParams

DRAFTER = Path(__file__).resolve().parents[2] / "models" / "drafters" / "stories260K-dspark"
PROMPTS = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the"]


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.from_config(EngineConfig(max_num_seqs=16, num_local_blocks=1024,
                                               drafters=f"dspark={DRAFTER}", speculation="none"))


def _request(engine, rid: str, max_tokens: int = 24, **fields) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, engine.tokenizer.encode(PROMPTS[len(rid) % len(PROMPTS)]), params, **fields)


def _run_recording_drafts(engine) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Run to the end; returns the tokens and the verified draft lengths of every request."""
    lengths: dict[str, list[int]] = {}
    run = engine.runner.run

    def recording(batch, capture=()):
        for s in batch:
            if s.samples and s.num_tokens == 1:
                lengths.setdefault(s.seq.id, []).append(s.num_draft)
        return run(batch, capture)

    engine.runner.run = recording
    tokens: dict[str, list[int]] = {}
    try:
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.id, []).extend(out.token_ids)
    finally:
        engine.runner.run = run
    return tokens, lengths


def test_drafters_flag_form_and_unknown_method():
    cfg = EngineConfig(drafters="dspark=/a, eagle3=/b")
    assert cfg.drafter_for("dspark") == Path("/a") and cfg.drafter_for("eagle3") == Path("/b")
    assert cfg.drafter_for("dflash") is None
    assert EngineConfig(drafter=Path("/c"), drafters={"dspark": "/a"}).drafter_for("dflash") == Path("/c")
    with pytest.raises(ValidationError):
        EngineConfig(drafters="ngram=/a")          # ngram needs no drafter: a typo, not a setting
    with pytest.raises(ValidationError):
        EngineConfig(drafters="dspark")


@pytest.mark.parametrize("fields, words", [
    ({"speculation": "dspark", "spec_schedule": "sometimes"}, "schedule"),
    ({"speculation": "dspark", "num_speculative_tokens": 0}, "positive"),
    ({"speculation": "dspark", "num_speculative_tokens": 8}, "exceeds"),          # the drafter's block is 7
    ({"speculation": "none", "spec_schedule": "fixed"}, "needs a speculation method"),
    ({"num_speculative_tokens": 3}, "needs a speculation method"),                  # deployment default: none
    ({"speculation": "ngram", "spec_schedule": "confidence"}, "confidence head"),
    ({"speculation": "dflash"}, "needs a trained drafter"),
    ({"speculation": "medusa"}, "unknown speculation method"),
], ids=["schedule", "gamma0", "gamma-past-block", "none+schedule", "default-none+gamma", "ngram-confidence",
        "no-dflash-drafter", "unknown-method"])
def test_bad_overrides_are_refused_at_admission(engine, fields, words):
    with pytest.raises(EngineError, match=words) as info:
        engine.add_request(_request(engine, "bad", **fields))
    assert info.value.code == "bad_request"
    assert not engine.has_work()


def test_fixed_gamma_request_verifies_gamma_drafts_beside_a_scheduled_one(engine):
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(f"p{i}", engine.tokenizer.encode(p),
                                   SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))
    plain, _ = _run_recording_drafts(engine)
    for i, p in enumerate(PROMPTS):
        fields = {"speculation": "dspark", "spec_schedule": "fixed", "num_speculative_tokens": 3} if i != 1 else \
                 {"speculation": "dspark"}                                           # the confidence scheduler
        engine.add_request(Request(f"s{i}", engine.tokenizer.encode(p),
                                   SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), **fields))
    before = engine.stats()["spec_scheduled_requests_total"]
    tokens, lengths = _run_recording_drafts(engine)
    scheduled = engine.stats()["spec_scheduled_requests_total"] - before
    for i in (0, 2):
        steps = lengths[f"s{i}"][1:]                   # the first decode step has no features yet
        assert steps and all(n == 3 for n in steps[:-2]), steps     # the tail may be cut by max_tokens
        assert all(n <= 3 for n in steps)
    assert 0 < scheduled <= len(lengths["s1"])        # only the confidence request went through the scheduler
    assert [tokens[f"s{i}"] for i in range(3)] == [plain[f"p{i}"] for i in range(3)]   # greedy: still exact


def test_speculation_params_validation():
    assert SpeculationParams(method="dspark", schedule="fixed", num_speculative_tokens=7).request_fields() == {
        "speculation": "dspark", "spec_schedule": "fixed", "num_speculative_tokens": 7}
    for bad in ({"method": "none", "num_speculative_tokens": 2}, {"schedule": "always"},
                {"num_speculative_tokens": 33}, {"method": "dspark", "gamma": 3}):
        with pytest.raises(ValidationError):
            SpeculationParams(**bad)


def test_ipc_generate_takes_a_method_or_a_map():
    short = protocol.decode_request(protocol.pack(protocol.generate_request(1, prompt="x", speculation="ngram")))
    assert short.speculation == SpeculationParams(method="ngram")
    full = protocol.decode_request(protocol.pack(protocol.generate_request(
        2, prompt="x", speculation={"method": "dspark", "schedule": "fixed", "num_speculative_tokens": 5})))
    assert full.speculation.request_fields()["num_speculative_tokens"] == 5
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode_request(protocol.pack(protocol.generate_request(
            3, prompt="x", speculation={"method": "dspark", "schedule": "later"})))
    assert info.value.code == "bad_request" and info.value.msg_id == 3


def test_http_body_speculation_field():
    body = {"model": "m", "prompt": "x", "speculation": {"method": "dflash", "schedule": "fixed",
                                                          "num_speculative_tokens": 4}}
    assert CompletionRequest.model_validate(body).speculation.num_speculative_tokens == 4
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({**body, "speculation": {"method": "none", "schedule": "fixed"}})


def test_admission_keeps_each_settings_answer_while_the_proposer_is_the_same(engine):
    """``SpecEngine._admit_speculation`` keeps a request's method and gate key per speculation settings: the
    kept answers are the full check's, a bad setting is still refused (an unhashable γ too, as a typed
    error, and γ = True or 1.0 after γ = 1 was kept: equal keys, other types), and a proposer swapped in is
    asked again."""
    settings = [({}, ("none", None)), ({"speculation": "dspark"}, ("dspark", "dspark")),
                ({"speculation": "dspark", "spec_schedule": "gated", "num_speculative_tokens": 3}, ("dspark", "dspark_gated")),
                ({"speculation": "dspark", "spec_schedule": "fixed", "num_speculative_tokens": 3}, ("dspark", None)),
                ({"speculation": "ngram"}, ("ngram", None)),
                ({"speculation": "ngram", "spec_schedule": "gated"}, ("ngram", "ngram_gated"))]
    for turn in range(2):                        # asked in full, then kept
        for i, (fields, want) in enumerate(settings):
            engine.add_request(_request(engine, f"k{turn}{i}", 2, **fields))
            seq = engine._seqs[f"k{turn}{i}"]
            assert (seq.method, seq.gate_key) == want, fields
    engine.add_request(_request(engine, "one", 2, speculation="dspark", spec_schedule="fixed", num_speculative_tokens=1))
    for fields, words in [({"speculation": "dspark", "spec_schedule": "fixed", "num_speculative_tokens": 8}, "exceeds"),
                          ({"speculation": "dspark", "num_speculative_tokens": [3]}, "positive integer"),
                          ({"speculation": "dspark", "spec_schedule": "fixed", "num_speculative_tokens": True}, "positive integer"),
                          ({"speculation": "dspark", "spec_schedule": "fixed", "num_speculative_tokens": 1.0}, "positive integer")]:
        with pytest.raises(EngineError, match=words):
            engine.add_request(_request(engine, "bad", **fields))

    class NoConfidence:                          # the same drafter without a confidence head
        has_confidence = False

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    real = engine._proposers["dspark"]
    engine._proposers["dspark"] = NoConfidence(real)
    try:
        engine.add_request(_request(engine, "swapped", 2, speculation="dspark"))
        assert engine._seqs["swapped"].gate_key is None            # not gated: nothing to schedule it by
        with pytest.raises(EngineError, match="confidence head"):
            engine.add_request(_request(engine, "bad", speculation="dspark", spec_schedule="confidence"))
        for rid in [f"k{t}{i}" for t in range(2) for i in range(len(settings))] + ["one", "swapped"]:
            engine.abort(rid)
    finally:
        engine._proposers["dspark"] = real
    assert not engine.has_work()

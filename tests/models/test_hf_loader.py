"""HF-directory loader: small random Llama / Qwen2 / Qwen3 checkpoints written by transformers
(safetensors, one file or sharded) load into our model and give transformers' logits."""
from __future__ import annotations

import json

import pytest
import torch

from specd.loader import load_model
from specd.loader.hf import load_hf_model
from specd.models import ContiguousKV, UnsupportedModelError

ATOL = 1e-4  # fp32, random weights of std 0.02 x 4 (logits ~1): only summation order may differ
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _build(arch: str, **overrides):
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[arch]
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    torch.manual_seed(0)
    ref = cls(cfg_cls(**{**SMALL, **overrides})).eval()
    with torch.no_grad():  # transformers zero-inits biases and ones-inits norms: randomise so they matter
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return ref


def _save(ref, path, shard: bool, stories_tok) -> None:
    ref.save_pretrained(path, max_shard_size="60KB" if shard else "1GB")
    stories_tok.inner.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True,
        "chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
    }))


CASES = [
    ("qwen3", dict(head_dim=24, tie_word_embeddings=False), False),   # q/k norm, head_dim != hidden/heads
    ("qwen3", dict(tie_word_embeddings=True), True),                  # tied + sharded
    ("qwen2", dict(tie_word_embeddings=True), False),                 # q/k/v bias, tied
    ("llama", dict(attention_bias=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}), True),
]


@torch.no_grad()
@pytest.mark.parametrize("arch,overrides,shard", CASES, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(CASES)])
def test_random_checkpoint_logits_match_transformers(tmp_path, stories, arch, overrides, shard):
    ref = _build(arch, **overrides)
    _save(ref, tmp_path, shard, stories[1])
    assert shard == (len(list(tmp_path.glob("*.safetensors"))) > 1)
    model, tok = load_model(tmp_path, dtype="float32", device="cpu")
    assert model.config.arch == arch and model.config.tie_word_embeddings == ref.config.tie_word_embeddings
    assert model.config.rope_type == overrides.get("rope_parameters", {}).get("rope_type", "default")
    ids = torch.randint(0, SMALL["vocab_size"], (11,), generator=torch.Generator().manual_seed(1))
    theirs = ref(ids[None]).logits[0]
    kv = ContiguousKV(model.config.num_layers)
    full = model.logits(model(ids, kv.begin([("s", 11)]), kv).hidden)
    kv2 = ContiguousKV(model.config.num_layers)
    steps = [model.logits(model(ids[:5], kv2.begin([("s", 5)]), kv2).hidden)]
    steps += [model.logits(model(ids[i:i + 1], kv2.begin([("s", 1)]), kv2).hidden) for i in range(5, 11)]
    assert theirs.abs().max() > 0.1                       # the comparison is not vacuous
    assert (full - theirs).abs().max().item() < ATOL
    assert (torch.cat(steps) - theirs).abs().max().item() < ATOL
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.add_bos
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant]"


def test_fingerprint_is_stable_and_sees_weights(tmp_path, stories):
    ref = _build("qwen2")
    _save(ref, tmp_path / "a", False, stories[1])
    a1, a2 = load_hf_model(tmp_path / "a").config.fingerprint, load_hf_model(tmp_path / "a").config.fingerprint
    with torch.no_grad():
        ref.model.norm.weight.add_(1.0)
    _save(ref, tmp_path / "b", False, stories[1])
    assert a1 == a2 and len(a1) == 32
    assert load_hf_model(tmp_path / "b").config.fingerprint != a1


def test_unsupported_rope_scaling_is_refused(tmp_path, stories):
    ref = _build("llama")
    _save(ref, tmp_path, False, stories[1])
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_hf_model(tmp_path)

"""save_drafter/load_drafter round trip, and DeepSpec checkpoints (their key layout) loading strictly."""
import json

import pytest
import torch

from specd.drafter import (DrafterConfig, DrafterError, build_drafter, load_deepspec_state_dict, load_drafter,
                           save_drafter)
from specd.sampling_params import SamplingParams


def deepspec_dspark_keys(c) -> dict[str, tuple[int, ...]]:
    """Qwen3DSparkModel's state dict (deepspec/modeling/dspark/qwen3/modeling.py @ afdfa7c), by hand:
    attention_bias=False, markov_head_type='vanilla', confidence_head_with_markov=True."""
    d, hq, hkv, hd, f, v, r = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                               c.vocab_size, c.markov_rank)
    keys = {"embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "norm.weight": (d,),
            "fc.weight": (d, len(c.target_layers) * d), "hidden_norm.weight": (d,)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        keys.update({p + "self_attn.q_proj.weight": (hq * hd, d), p + "self_attn.k_proj.weight": (hkv * hd, d),
                     p + "self_attn.v_proj.weight": (hkv * hd, d), p + "self_attn.o_proj.weight": (d, hq * hd),
                     p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                     p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                     p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                     p + "post_attention_layernorm.weight": (d,)})
    if r:
        keys.update({"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)})
    if c.confidence:
        keys.update({"confidence_head.proj.weight": (1, d + r), "confidence_head.proj.bias": (1,)})
    return keys


def deepspec_eagle3_keys(c) -> dict[str, tuple[int, ...]]:
    """Qwen3Eagle3Model's state dict (deepspec/modeling/eagle3/qwen3/modeling.py): q/k/v read 2d."""
    d, hq, hkv, hd, f, v = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size
    p = "layers.0."
    return {"embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "norm.weight": (d,),
            "fc.weight": (d, len(c.target_layers) * d),
            p + "self_attn.q_proj.weight": (hq * hd, 2 * d), p + "self_attn.k_proj.weight": (hkv * hd, 2 * d),
            p + "self_attn.v_proj.weight": (hkv * hd, 2 * d), p + "self_attn.o_proj.weight": (d, hq * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f),
            p + "hidden_norm.weight": (d,), p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,)}


@pytest.mark.parametrize("method,layout", [("dspark", deepspec_dspark_keys), ("dflash", deepspec_dspark_keys),
                                           ("eagle3", deepspec_eagle3_keys)])
def test_deepspec_state_dict_loads_strictly(target, method, layout, make_drafter):
    drafter = make_drafter(target[0], method)
    state = {k: torch.randn(shape) for k, shape in layout(drafter.config).items()}
    load_deepspec_state_dict(drafter, state)
    own = drafter.state_dict()
    assert set(own) == set(state) - {"embed_tokens.weight", "lm_head.weight"}
    assert all(torch.equal(own[k], state[k]) for k in own)
    del state["fc.weight"]
    with pytest.raises(RuntimeError, match="fc.weight"):
        load_deepspec_state_dict(drafter, state)


def test_deepspec_embedding_of_another_target_is_refused(target, make_drafter):
    drafter = make_drafter(target[0], "dflash")
    state = {k: torch.randn(s) for k, s in deepspec_dspark_keys(drafter.config).items()}
    state["lm_head.weight"] = torch.randn(1000, 64)
    with pytest.raises(DrafterError):
        load_deepspec_state_dict(drafter, state)


@pytest.mark.parametrize("method", ["dspark", "eagle3", "ngram"])
def test_save_load_round_trip(target, tokens, tmp_path, method, make_drafter, fused):
    model, _ = target
    ngram = build_drafter(DrafterConfig.for_target(model.config, "ngram"))
    drafter = ngram if method == "ngram" else make_drafter(model, method)
    path = tmp_path / "drafter.safetensors"
    save_drafter(drafter, path, {"steps": 12, "sts": [1.0, 1.1]})
    loaded = load_drafter(path, target=model)
    assert loaded.config == drafter.config and loaded.meta == {"steps": 12, "sts": [1.0, 1.1]}
    assert json.loads(path.with_suffix(".json").read_text())["config"]["method"] == method
    if method == "ngram":
        assert loaded.propose([1, 2, 1]) == drafter.propose([1, 2, 1])
        return
    saved = drafter.state_dict()
    assert "embed_tokens.weight" not in saved and "lm_head.weight" not in saved
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())
    feats = fused(drafter, model, tokens)
    args = ([feats[:8]], [int(tokens[8])], [SamplingParams(temperature=0)], [None])
    kw = {"ctx_tokens": [tokens[:8]]} if method == "eagle3" else {}
    assert torch.equal(loaded.draft(*args, **kw).tokens, drafter.draft(*args, **kw).tokens)
    unattached = load_drafter(path)
    with pytest.raises(DrafterError):
        unattached.draft(*args, **kw)

"""transformers' implementation holding *our* loaded weights: the reference our model code is
checked against (same weights, so any difference is the model code, not the loader's dequantization)."""
from __future__ import annotations

import torch


def to_transformers(model):
    """An equivalent ``*ForCausalLM`` (Llama, Qwen2 or Qwen3) on the model's device and dtype."""
    import transformers

    c = model.config
    kinds = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    cfg_name, cls_name = kinds[c.arch]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
    )
    param = next(model.parameters())
    ref = getattr(transformers, cls_name)(cfg).to(device=param.device, dtype=param.dtype)
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in model.state_dict().items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    bad = [m for m in missing if "rotary" not in m and not (c.tie_word_embeddings and m == "lm_head.weight")]
    if unexpected or bad:
        raise RuntimeError(f"weights do not map onto transformers: missing {bad}, unexpected {unexpected}")
    return ref.eval()

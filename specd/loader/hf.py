"""Load a Hugging Face model directory: config.json, *.safetensors (sharded or not), tokenizer.json.

Supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM. Both config spellings are read:
transformers 4.x (`rope_theta`, `rope_scaling`, `max_window_layers`) and 5.x (`rope_parameters`,
`layer_types`).
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import tokenizers
import torch
from safetensors import safe_open
from torch import Tensor

from specd.loader.weights import CheckpointError, fill_model, sample_file
from specd.models.config import ModelConfig, UnsupportedModelError, fingerprint_of
from specd.models.decoder import DecoderModel, empty_model
from specd.tokenizer import Tokenizer

_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# transformers' attention layer types we implement; "attention" is its legacy name for full attention.
_FULL, _SLIDING = ("full_attention", "attention"), "sliding_attention"


def _arch(cfg: dict[str, Any]) -> str:
    for name in cfg.get("architectures") or []:
        if name in _ARCHS:
            return _ARCHS[name]
    if cfg.get("model_type") in _ARCHS.values():
        return cfg["model_type"]
    raise UnsupportedModelError(f"architecture {cfg.get('architectures') or cfg.get('model_type')} not supported (have {sorted(_ARCHS)})")


def _rope(cfg: dict[str, Any]) -> tuple[float, str, float]:
    """(theta, rope_type, factor) from either config spelling."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ("default", "linear"):
        raise UnsupportedModelError(f"rope scaling {kind!r} is not implemented (have default, linear)")
    return theta, kind, float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0


def _layer_types(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """transformers 5 writes `layer_types`; older Qwen configs imply them: layers >= max_window_layers slide."""
    types = cfg.get("layer_types")
    if types is None:
        first_sliding = int(cfg.get("max_window_layers", num_layers))
        return [_SLIDING if i >= first_sliding else _FULL[0] for i in range(num_layers)]
    if len(types) != num_layers:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {*_FULL, _SLIDING})
    if unknown:
        raise UnsupportedModelError(f"attention layer types {unknown} are not implemented (have full and sliding)")
    return types


def _layer_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """One window per layer, as transformers' Qwen2/Qwen3 resolve it.

    The window applies only when `use_sliding_window` is true and `sliding_window` is set; the shipped
    Qwen2.5 configs carry a `sliding_window` with `use_sliding_window: false`, which is full attention.
    Llama in transformers has no sliding window, so a Llama config asking for one is refused.
    """
    types = _layer_types(cfg, num_layers)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if arch == "llama" and (cfg.get("use_sliding_window") or _SLIDING in (cfg.get("layer_types") or [])):
        raise UnsupportedModelError("sliding-window attention is not implemented for llama")
    if window is None:
        return (None,) * num_layers
    if int(window) < 1:
        raise UnsupportedModelError(f"sliding_window {window} must be positive")
    return tuple(int(window) if t == _SLIDING else None for t in types)


def hf_config(cfg: dict[str, Any], has_lm_head: bool) -> ModelConfig:
    arch = _arch(cfg)
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise UnsupportedModelError("only bias-free SwiGLU (silu) MLPs are implemented")
    theta, rope_type, factor = _rope(cfg)
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_type=rope_type,
        rope_factor=factor,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=attention_bias if arch != "qwen2" else False,
        qk_norm=arch == "qwen3",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or not has_lm_head,
        layer_windows=_layer_windows(cfg, arch, int(cfg["num_hidden_layers"])),
    )


def _shards(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {root}")
    return files


def _header(path: Path) -> bytes:
    """The safetensors JSON header: names, dtypes, shapes and offsets of every tensor."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


def _tensor_table(files: list[Path]) -> list[tuple[str, tuple[int, ...], str]]:
    table = []
    for path in files:
        for name, info in json.loads(_header(path)).items():
            if name != "__metadata__":
                table.append((name, tuple(info["shape"]), info["dtype"]))
    return table


def _tensors(files: list[Path], config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> Iterator[tuple[str, Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = key.removeprefix("model.")
                if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                yield name, f.get_tensor(key).to(device=device, dtype=dtype)


def load_hf_model(root: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DecoderModel:
    root = Path(root)
    files = _shards(root)
    table = _tensor_table(files)
    config = hf_config(json.loads((root / "config.json").read_text()), any(n == "lm_head.weight" for n, _, _ in table))
    content = b"".join(_header(p) + sample_file(p, 8 + len(_header(p))) for p in files)
    config = replace(config, fingerprint=fingerprint_of(config, table, content))
    model = empty_model(config, device)
    fill_model(model, _tensors(files, config, dtype, device))
    return model


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(root: Path, tcfg: dict[str, Any]) -> str | None:
    """transformers >= 4.43 may save the template to chat_template.jinja instead of the config."""
    if (root / "chat_template.jinja").exists():
        return (root / "chat_template.jinja").read_text()
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _generation_eos(root: Path) -> list[int]:
    path = root / "generation_config.json"
    if not path.exists():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def load_hf_tokenizer(root: str | os.PathLike) -> Tokenizer:
    root = Path(root)
    inner = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    tcfg_path = root / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.exists() else {}
    bos = _token_content(tcfg.get("bos_token"))
    eos = _token_content(tcfg.get("eos_token"))
    bos_id = inner.token_to_id(bos) if bos else None
    eos_id = inner.token_to_id(eos) if eos else None
    add_bos = tcfg.get("add_bos_token")
    if add_bos is None:  # fall back to what the file's own post-processor does
        probe = inner.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
    return Tokenizer(inner, bos_id, eos_id, stop_ids=_generation_eos(root), add_bos=bool(add_bos), chat_template=_chat_template(root, tcfg))


def load_hf(root: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> tuple[DecoderModel, Tokenizer]:
    return load_hf_model(root, dtype, device), load_hf_tokenizer(root)

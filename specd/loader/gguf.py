"""Load a GGUF file (llama / qwen2 / qwen3 architectures) into a DecoderModel and a Tokenizer.

The header is parsed by specd.loader.gguf_file (fast); quantized tensors are dequantized with `gguf.quants.dequantize` (numpy, vectorised over blocks) in a
thread pool: numpy releases the GIL inside its kernels, so the big tensors dequantize in parallel.

Llama-architecture GGUF files store Q and K rows permuted for the interleaved (GPT-J) RoPE pairing
(llama.cpp's converter does this for "llama" only); `unpermute_qk` restores the HF layout so the one
rotate-half RoPE in specd/models is right. qwen2 / qwen3 files are not permuted.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Iterator

import gguf
import numpy as np
import torch
from torch import Tensor

from specd.loader.gguf_file import GGUFFile, TensorInfo
from specd.loader.gguf_vocab import gpt2_tokenizer, spm_tokenizer
from specd.loader.weights import fill_model, sample_file
from specd.models.config import ModelConfig, UnsupportedModelError, fingerprint_of
from specd.models.decoder import DecoderModel, empty_model
from specd.tokenizer import Tokenizer

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
_PERMUTED_ARCHS = {"llama"}
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> our (HF without "model.") parameter name."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in our model")


def gguf_config(reader: GGUFFile) -> ModelConfig:
    arch = reader.get("general.architecture")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError("GGUF rope_freqs (Llama 3.1 rope scaling) is not implemented")
    k = lambda key, default=None: reader.get(f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = int(k("embedding_length")), int(k("attention.head_count"))
    head_dim = int(k("attention.key_length", hidden // heads))
    if int(k("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError("partial rotary (rope.dimension_count < head_dim) is not implemented")
    rope_type = k("rope.scaling.type", "none")
    if rope_type not in ("none", "linear"):
        raise UnsupportedModelError(f"GGUF rope scaling {rope_type!r} is not implemented")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return ModelConfig(
        arch=arch,
        vocab_size=int(embd.shape[0]),
        hidden_size=hidden,
        intermediate_size=int(k("feed_forward_length")),
        num_layers=int(k("block_count")),
        num_heads=heads,
        num_kv_heads=int(k("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(k("attention.layer_norm_rms_epsilon")),
        rope_theta=float(k("rope.freq_base", 10000.0)),
        rope_type="linear" if rope_type == "linear" else "default",
        rope_factor=float(k("rope.scaling.factor", 1.0)) if rope_type == "linear" else 1.0,
        max_position_embeddings=int(k("context_length", 2048)),
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        tie_word_embeddings="output.weight" not in names,
    )


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """w: [n_heads * D, ...] in llama.cpp's interleaved row order -> HF rotate-half row order.

    llama.cpp's converter applied reshape(H, 2, D/2, ...).swapaxes(1, 2); this is its inverse.
    """
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(reader: GGUFFile, t: TensorInfo) -> np.ndarray:
    """One GGUF tensor -> writable float32 ndarray in numpy (row-major, [out, in]) order."""
    array = gguf.quants.dequantize(reader.raw(t), t.qtype).reshape(t.shape)
    return array if array.flags.writeable else array.copy()  # F32 comes back as a read-only memmap view


def gguf_tensors(reader: GGUFFile, config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> Iterator[tuple[str, Tensor]]:
    """(our name, tensor in `dtype` on `device`) for every tensor, dequantized in parallel."""
    tensors = sorted(reader.tensors, key=lambda t: -int(t.n_elements))  # big first: better load balance
    workers = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        for t, array in zip(tensors, pool.map(lambda t: dequantize(reader, t), tensors)):
            name = hf_name(t.name)
            value = torch.from_numpy(array)
            if config.arch in _PERMUTED_ARCHS and ".q_proj." in name:
                value = unpermute_qk(value, config.num_heads)
            elif config.arch in _PERMUTED_ARCHS and ".k_proj." in name:
                value = unpermute_qk(value, config.num_kv_heads)
            yield name, value.to(device=device, dtype=dtype)


def gguf_fingerprint(path: str | os.PathLike, reader: GGUFFile, config: ModelConfig) -> str:
    """Architecture + tensor table + (header and metadata bytes, file size, 16 sampled data chunks)."""
    with open(path, "rb") as f:
        header = f.read(reader.data_offset)
    table = [(t.name, t.shape, t.qtype.name) for t in reader.tensors]
    return fingerprint_of(config, table, header + sample_file(path, reader.data_offset))


def gguf_tokenizer(reader: GGUFFile) -> Tokenizer:
    kind = reader.get("tokenizer.ggml.model")
    tokens = reader.get("tokenizer.ggml.tokens")
    types = reader.get("tokenizer.ggml.token_type")
    if kind == "llama":
        inner = spm_tokenizer(tokens, reader.get("tokenizer.ggml.scores"), types, bool(reader.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos_default = True
    elif kind == "gpt2":
        inner = gpt2_tokenizer(tokens, types, reader.get("tokenizer.ggml.merges"), reader.get("tokenizer.ggml.pre", "default"))
        add_bos_default = False
    else:
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} not supported (have llama, gpt2)")
    special = {t for t, ty in zip(tokens, types) if ty == 3}
    stops = [reader.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    stops += [tokens.index(t) for t in _END_OF_TURN if t in special]
    return Tokenizer(
        inner,
        bos_id=_valid_id(reader.get("tokenizer.ggml.bos_token_id"), len(tokens)),
        eos_id=_valid_id(reader.get("tokenizer.ggml.eos_token_id"), len(tokens)),
        stop_ids=[i for i in stops if _valid_id(i, len(tokens)) is not None],
        add_bos=bool(reader.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=reader.get("tokenizer.chat_template"),
    )


def _valid_id(token_id: int | None, vocab: int) -> int | None:
    """GGUF writes 2**32-1 for "no such token" (stories260K's pad/sep): treat it as absent."""
    return token_id if token_id is not None and 0 <= token_id < vocab else None


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> tuple[DecoderModel, Tokenizer]:
    reader = GGUFFile(path)
    config = gguf_config(reader)
    config = replace(config, fingerprint=gguf_fingerprint(path, reader, config))
    model = empty_model(config, device)
    fill_model(model, gguf_tensors(reader, config, dtype, device))
    return model, gguf_tokenizer(reader)

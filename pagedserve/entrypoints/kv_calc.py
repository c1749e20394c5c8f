"""`pagedserve kv-calc`: KV-cache bytes per token and per context, from a model's shape.

Per token, every layer stores one key and one value vector per KV head:
    2 x layers x kv_heads x head_dim x bytes per element.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pagedserve.kv.sizes import kv_bytes_per_token

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class KVShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int

    def bytes_per_token(self, dtype: str) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, DTYPE_BYTES[dtype])


PRESETS = {
    s.name: s
    for s in [
        KVShape("llama-3-8b", 32, 8, 128, 8192),
        KVShape("llama-3-70b", 80, 8, 128, 8192),
        KVShape("llama-2-7b", 32, 32, 128, 4096),
        KVShape("mistral-7b", 32, 8, 128, 32768),
        KVShape("qwen2.5-7b", 28, 4, 128, 32768),
        KVShape("opt-13b", 40, 40, 128, 2048),  # the vLLM paper's example: 800 KB per token
        KVShape("smollm2-135m", 30, 3, 64, 8192),  # the embedded default model
    ]
}


def shape_from_hf_config(config: dict, name: str) -> KVShape:
    heads = config["num_attention_heads"]
    return KVShape(
        name=name,
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        max_context=config.get("max_position_embeddings", 2048),
    )


def resolve_shape(model: str) -> KVShape:
    """A preset name, a config.json file, or a Hugging Face model directory."""
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"unknown model {model!r}: give a preset ({', '.join(PRESETS)}), a config.json or a model directory")
    with open(path) as f:
        return shape_from_hf_config(json.load(f), model)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def report(shape: KVShape, dtype: str, tokens: int | None) -> str:
    tokens = tokens or shape.max_context
    per_token = shape.bytes_per_token(dtype)
    return "\n".join(
        [
            f"model: {shape.name} ({shape.num_layers} layers x {shape.num_kv_heads} KV heads x head dim {shape.head_dim}, {dtype})",
            f"KV bytes per token: {per_token:,} ({human_bytes(per_token)})",
            f"KV bytes for {tokens:,} tokens: {per_token * tokens:,} ({human_bytes(per_token * tokens)})",
        ]
    )

"""`pagedserve kv-calc`: KV-cache bytes per token and per context, from a model's shape.

Per token, every layer stores one key and one value vector per KV head:
    2 x layers x kv_heads x head_dim x bytes per element.

With tensor parallelism over N ranks each rank's pool holds max(1, kv_heads // N) KV heads (copies
when N > kv_heads, as vLLM does), so the same memory per device holds more tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pagedserve.kv.sizes import kv_bytes_per_token
from pagedserve.models.sharding import check_split, kv_heads_per_rank  # the engine's own size rule (no torch)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class KVShape:
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    intermediate_size: int | None = None  # the MLP width; None when the config does not say

    def bytes_per_token(self, dtype: str, tp_size: int = 1) -> int:
        """Per rank: each of `tp_size` ranks stores only its own KV heads."""
        kv_heads = kv_heads_per_rank(self.num_kv_heads, tp_size)
        return kv_bytes_per_token(self.num_layers, kv_heads, self.head_dim, DTYPE_BYTES[dtype])


PRESETS = {
    s.name: s
    for s in [
        KVShape("llama-3-8b", 32, 32, 8, 128, 8192, 14336),
        KVShape("llama-3-70b", 80, 64, 8, 128, 8192, 28672),
        KVShape("llama-2-7b", 32, 32, 32, 128, 4096, 11008),
        KVShape("mistral-7b", 32, 32, 8, 128, 32768, 14336),
        KVShape("qwen2.5-7b", 28, 28, 4, 128, 32768, 18944),
        KVShape("opt-13b", 40, 40, 40, 128, 2048, 20480),  # the vLLM paper's example: 800 KB per token
        KVShape("smollm2-135m", 30, 9, 3, 64, 8192, 1536),  # the embedded default model
    ]
}


def shape_from_hf_config(config: dict, name: str) -> KVShape:
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal checkpoint (Gemma 3): its language model's shape
    heads = config["num_attention_heads"]
    return KVShape(
        name=name,
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        max_context=config.get("max_position_embeddings", 2048),
        intermediate_size=config.get("intermediate_size") or config.get("ffn_dim"),  # ffn_dim: OPT
    )


def shape_from_gguf(path: str) -> KVShape:
    """A GGUF's shape, from its metadata (llama.cpp's keys: <arch>.block_count, ...)."""
    fields = gguf_fields(path)
    arch = fields["general.architecture"]
    heads = fields[f"{arch}.attention.head_count"]
    return KVShape(
        name=os.path.basename(path), num_layers=fields[f"{arch}.block_count"], num_heads=heads,
        num_kv_heads=fields.get(f"{arch}.attention.head_count_kv") or heads,
        head_dim=fields.get(f"{arch}.attention.key_length") or fields[f"{arch}.embedding_length"] // heads,
        max_context=fields.get(f"{arch}.context_length", 2048),
        intermediate_size=fields.get(f"{arch}.feed_forward_length"),
    )


def gguf_fields(path: str) -> dict:
    """A GGUF's scalar metadata (strings and numbers), without reading its tensors."""
    from gguf import GGUFReader, GGUFValueType

    fields = {}
    for name, field in GGUFReader(path).fields.items():
        if len(field.types) == 1 and field.types[0] != GGUFValueType.ARRAY:
            value = field.parts[field.data[0]]
            fields[name] = value.tobytes().decode() if field.types[0] == GGUFValueType.STRING else value.item()
    return fields


def weight_bytes(model: str) -> dict[str, int]:
    """Bytes of a checkpoint's weights by format (a GGUF's tensor types, a safetensors dtype), as
    stored: what pagedserve holds with quantization="auto" (a GGUF) or "none" in that dtype."""
    sizes: dict[str, int] = {}
    if model.endswith(".gguf"):
        from gguf import GGUFReader

        for tensor in GGUFReader(model).tensors:
            sizes[tensor.tensor_type.name] = sizes.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
        return sizes
    for name in sorted(os.listdir(model)) if os.path.isdir(model) else []:
        if name.endswith(".safetensors"):
            with open(os.path.join(model, name), "rb") as f:  # the JSON header gives every tensor's extent
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for key, info in header.items():
                if key != "__metadata__":
                    start, end = info["data_offsets"]
                    sizes[info["dtype"]] = sizes.get(info["dtype"], 0) + end - start
    return sizes


def weights_line(model: str) -> str | None:
    sizes = weight_bytes(model)
    if not sizes:
        return None
    parts = ", ".join(f"{kind} {human_bytes(n)}" for kind, n in sorted(sizes.items(), key=lambda kv: -kv[1]))
    return f"weights: {human_bytes(sum(sizes.values()))} ({parts})"


def resolve_shape(model: str) -> KVShape:
    """A preset name, a config.json file, a Hugging Face model directory, or a GGUF file."""
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    if model.endswith(".gguf") and os.path.isfile(model):
        return shape_from_gguf(model)
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


def report(shape: KVShape, dtype: str, tokens: int | None, tp_size: int = 1,
           memory_bytes: int | None = None) -> str:
    """`memory_bytes`: the KV pool on each device (default with tp_size > 1: what TP=1 needs for
    `tokens`, so the pool line shows what splitting gains at the same memory)."""
    check_split(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, tp_size)
    tokens = tokens or shape.max_context
    per_token = shape.bytes_per_token(dtype)
    lines = [
        f"model: {shape.name} ({shape.num_layers} layers x {shape.num_kv_heads} KV heads x head dim {shape.head_dim}, {dtype})",
        f"KV bytes per token: {per_token:,} ({human_bytes(per_token)})",
        f"KV bytes for {tokens:,} tokens: {per_token * tokens:,} ({human_bytes(per_token * tokens)})",
    ]
    if tp_size > 1:
        kv_heads = kv_heads_per_rank(shape.num_kv_heads, tp_size)
        rank_per_token = shape.bytes_per_token(dtype, tp_size)
        line = f"tensor parallel {tp_size}: {kv_heads} KV head{'s' if kv_heads > 1 else ''} per rank"
        if tp_size > shape.num_kv_heads:
            line += (f", replicated: each of the {shape.num_kv_heads} KV heads is copied on "
                     f"{tp_size // shape.num_kv_heads} ranks")
        lines += [line, f"KV bytes per token per rank: {rank_per_token:,} ({human_bytes(rank_per_token)})"]
        memory_bytes = memory_bytes or per_token * tokens
    if memory_bytes:
        held = memory_bytes // shape.bytes_per_token(dtype, tp_size)
        line = f"KV pool of {memory_bytes:,} bytes ({human_bytes(memory_bytes)}) per device holds {held:,} tokens"
        if tp_size > 1:
            gain = shape.num_kv_heads / kv_heads_per_rank(shape.num_kv_heads, tp_size)
            line += f" ({gain:g}x TP=1's {memory_bytes // per_token:,})"
        lines.append(line)
    return "\n".join(lines)

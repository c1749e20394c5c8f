"""`pagedserve kv-calc`: KV-cache bytes per token and per context, from a model's shape.

Per token, every layer stores one key and one value vector per KV head:
    2 x layers x kv_heads x head_dim x bytes per element.

With tensor parallelism over N ranks each rank's pool holds max(1, kv_heads // N) KV heads (copies
when N > kv_heads, as vLLM does), so the same memory per device holds more tokens.

A model whose layers mix full attention and sliding windows (read from config.json as transformers
reads it: `layer_types` with `sliding_window`; Mistral's window on every layer; Qwen2/3's
`use_sliding_window` from layer `max_window_layers` on; Gemma 3's `text_config`) needs less: per
request, a full layer keeps every token and a sliding layer its window and the block being written
(`kv_tokens_kept`), which is what the engine's KV cache groups hold. The report gives that per layer
kind, next to the uniform figure (every layer keeps every token).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pagedserve.kv.groups import KVLayout
from pagedserve.kv.sizes import kv_bytes_per_token, kv_tokens_kept
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
    # One entry per layer: its sliding window, or None for full attention. Empty: every layer full.
    layer_windows: tuple[int | None, ...] = ()

    def bytes_per_token(self, dtype: str, tp_size: int = 1) -> int:
        """Per rank: each of `tp_size` ranks stores only its own KV heads."""
        return self.num_layers * self.bytes_per_layer_token(dtype, tp_size)

    def bytes_per_layer_token(self, dtype: str, tp_size: int = 1) -> int:
        kv_heads = kv_heads_per_rank(self.num_kv_heads, tp_size)
        return kv_bytes_per_token(1, kv_heads, self.head_dim, DTYPE_BYTES[dtype])

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    def layer_kinds(self) -> dict[int | None, int]:
        """Layers per window (None: full attention), kinds in order of first appearance."""
        kinds: dict[int | None, int] = {}
        for window in self.layer_windows or (None,) * self.num_layers:
            kinds[window] = kinds.get(window, 0) + 1
        return kinds

    def bytes_per_request(self, dtype: str, num_tokens: int, block_size: int, tp_size: int = 1) -> int:
        """K/V that one request of `num_tokens` tokens keeps (per rank): every token in a full layer,
        the window and one block in a sliding layer."""
        per_layer = self.bytes_per_layer_token(dtype, tp_size)
        return per_layer * sum(layers * kv_tokens_kept(num_tokens, window, block_size)
                               for window, layers in self.layer_kinds().items())


def _every_sixth_full(num_layers: int) -> tuple[int | None, ...]:
    return tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(num_layers))


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
        # Mixing full and sliding-window layers: 5 sliding (window 1,024) to 1 full; alternating 128 and full
        KVShape("gemma-3-27b", 62, 32, 16, 128, 131072, 21504, _every_sixth_full(62)),
        KVShape("gpt-oss-20b", 24, 64, 8, 64, 131072, 2880, (128, None) * 12),
    ]
}

# What transformers' config classes assume for keys a config.json leaves out, where the KV size
# depends on them (Gemma 3's published configs leave out most of their text model's).
_DEFAULTS = {
    "gemma3_text": {"num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 131072,
                    "sliding_window": 4096, "sliding_window_pattern": 6},
    "qwen2": {"use_sliding_window": False, "max_window_layers": 28},
    "qwen3": {"use_sliding_window": False, "max_window_layers": 28},
    "qwen2_moe": {"use_sliding_window": False, "max_window_layers": 28},
    "qwen3_moe": {"use_sliding_window": False, "max_window_layers": 28},
}


def text_model_config(config: dict) -> dict:
    """The keys that describe the decoder: a multimodal config's `text_config` (Gemma 3), with the
    defaults its model type assumes."""
    text = config.get("text_config") or config
    if config.get("model_type") == "gemma3" and "model_type" not in text:
        text = {**text, "model_type": "gemma3_text"}
    return {**_DEFAULTS.get(text.get("model_type"), {}), **text}


def layer_windows(config: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) as transformers reads the (text) config;
    () when every layer attends fully."""
    num_layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if "use_sliding_window" in config:  # Qwen2/3: no window unless asked for, then from max_window_layers on
        if not config["use_sliding_window"]:
            window = None
        elif types is None:
            types = ["sliding_attention" if i >= config["max_window_layers"] else "full_attention"
                     for i in range(num_layers)]
    elif types is None and "sliding_window_pattern" in config:  # Gemma 3: every pattern-th layer is full
        pattern = config["sliding_window_pattern"]
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if window is None:
        return ()
    if types is None:  # Mistral: the window on every layer
        return (window,) * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def shape_from_hf_config(config: dict, name: str) -> KVShape:
    config = text_model_config(config)
    heads = config["num_attention_heads"]
    return KVShape(
        name=name,
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        max_context=config.get("max_position_embeddings", 2048),
        intermediate_size=config.get("intermediate_size") or config.get("ffn_dim"),  # ffn_dim: OPT
        layer_windows=layer_windows(config),
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


DEFAULT_BLOCK_SIZE = 16  # the engine's (EngineConfig.block_size): a sliding layer keeps one block past its window


def report(shape: KVShape, dtype: str, tokens: int | None, tp_size: int = 1,
           memory_bytes: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> str:
    """`memory_bytes`: the KV pool on each device (default with tp_size > 1: what TP=1 needs for
    `tokens`, so the pool line shows what splitting gains at the same memory). A model with
    sliding-window layers is reported per layer kind (`_windowed_report`)."""
    check_split(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, tp_size)
    tokens = tokens or shape.max_context
    if shape.windowed:
        return _windowed_report(shape, dtype, tokens, tp_size, memory_bytes, block_size)
    per_token = shape.bytes_per_token(dtype)
    lines = [
        _model_line(shape, dtype),
        f"KV bytes per token: {per_token:,} ({human_bytes(per_token)})",
        f"KV bytes for {tokens:,} tokens: {per_token * tokens:,} ({human_bytes(per_token * tokens)})",
    ]
    if tp_size > 1:
        lines += _tensor_parallel_lines(shape, dtype, tp_size)
        memory_bytes = memory_bytes or per_token * tokens
    if memory_bytes:
        held = memory_bytes // shape.bytes_per_token(dtype, tp_size)
        line = f"KV pool of {memory_bytes:,} bytes ({human_bytes(memory_bytes)}) per device holds {held:,} tokens"
        if tp_size > 1:
            line += f" ({_tp_gain(shape, tp_size):g}x TP=1's {memory_bytes // per_token:,})"
        lines.append(line)
    return "\n".join(lines)


def _windowed_report(shape: KVShape, dtype: str, tokens: int, tp_size: int, memory_bytes: int | None,
                     block_size: int) -> str:
    """Per request of `tokens` tokens: each layer kind's K/V, their total (what the engine's KV cache
    groups hold, but for the rounding to whole blocks) and the uniform figure; the requests a pool holds
    each way."""
    per_layer, per_token = shape.bytes_per_layer_token(dtype), shape.bytes_per_token(dtype)
    kinds = shape.layer_kinds()
    layers = ", ".join(f"{n} full attention" if w is None else f"{n} sliding (window {w:,})" for w, n in kinds.items())
    lines = [
        _model_line(shape, dtype),
        f"layers: {layers}; KV cache groups: {KVLayout.of(shape.layer_windows).summary()}",
        f"KV bytes per token, every layer: {per_token:,} ({human_bytes(per_token)})",
        f"KV bytes per request of {tokens:,} tokens, by layer kind (a sliding layer keeps its window and the block "
        f"being written, of {block_size} tokens):",
    ]
    for window, n in kinds.items():
        kept = kv_tokens_kept(tokens, window, block_size)
        kind = "full attention" if window is None else f"sliding {window:,}"
        lines.append(f"  {kind}: {n} layers x {kept:,} tokens = {n * kept * per_layer:,} "
                     f"({human_bytes(n * kept * per_layer)})")
    total, uniform = shape.bytes_per_request(dtype, tokens, block_size), per_token * tokens
    lines.append(f"  total: {total:,} ({human_bytes(total)}); uniform (every layer keeps every token): {uniform:,} "
                 f"({human_bytes(uniform)}), {uniform / total:.2f}x as much")
    rank_total = shape.bytes_per_request(dtype, tokens, block_size, tp_size)
    if tp_size > 1:
        lines += _tensor_parallel_lines(shape, dtype, tp_size)
        lines.append(f"KV bytes per request per rank: {rank_total:,} ({human_bytes(rank_total)})")
        memory_bytes = memory_bytes or total
    if memory_bytes:
        held = memory_bytes // rank_total
        uniform_held = memory_bytes // (shape.bytes_per_token(dtype, tp_size) * tokens)
        line = (f"KV pool of {memory_bytes:,} bytes ({human_bytes(memory_bytes)}) per device holds {held:,} "
                f"requests of {tokens:,} tokens ({held * tokens:,} tokens)")
        if tp_size > 1:
            line += f" ({_tp_gain(shape, tp_size):g}x TP=1's {memory_bytes // total:,})"
        lines.append(line + f"; as a uniform pool {uniform_held:,} ({uniform_held * tokens:,} tokens)")
    return "\n".join(lines)


def _model_line(shape: KVShape, dtype: str) -> str:
    return (f"model: {shape.name} ({shape.num_layers} layers x {shape.num_kv_heads} KV heads x head dim "
            f"{shape.head_dim}, {dtype})")


def _tensor_parallel_lines(shape: KVShape, dtype: str, tp_size: int) -> list[str]:
    kv_heads = kv_heads_per_rank(shape.num_kv_heads, tp_size)
    rank_per_token = shape.bytes_per_token(dtype, tp_size)
    line = f"tensor parallel {tp_size}: {kv_heads} KV head{'s' if kv_heads > 1 else ''} per rank"
    if tp_size > shape.num_kv_heads:
        line += (f", replicated: each of the {shape.num_kv_heads} KV heads is copied on "
                 f"{tp_size // shape.num_kv_heads} ranks")
    return [line, f"KV bytes per token per rank: {rank_per_token:,} ({human_bytes(rank_per_token)})"]


def _tp_gain(shape: KVShape, tp_size: int) -> float:
    """How many times TP=1's tokens the same memory per device holds."""
    return shape.num_kv_heads / kv_heads_per_rank(shape.num_kv_heads, tp_size)

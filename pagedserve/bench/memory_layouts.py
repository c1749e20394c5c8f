"""`pagedserve bench memory --part layouts`: the KV memory of models that mix layer kinds.

For real layer layouts (transformers' config classes with the published shapes; no weights), one
KV budget in bytes is filled with requests of one context length, through the real
`KVCacheManager`: once with the model's KV cache groups (sliding windows free their blocks), once
as a uniform pool (every layer keeps every token; windows only masked). Each request is computed
`chunk` tokens a step up to its context, then decodes `decode` tokens; requests are admitted while
blocks last. Reported per layout and context: requests resident, KV bytes held per request, the
ideal (full layers x context + sliding layers x (window + one block)) and each group's waste.

Pure bookkeeping: no tensor is allocated, so a 128k context of Gemma-3-27B runs in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.kv import KVCacheManager
from pagedserve.kv.groups import KVLayout
from pagedserve.kv.sizes import kv_tokens_kept


@dataclass(frozen=True)
class LayerLayout:
    """What the memory depends on: each layer's window (None: full) and its K/V bytes per token."""

    name: str
    windows: tuple[int | None, ...]
    kv_bytes_per_layer_token: int


def _from_hf(name: str, make: Callable[[], object], dtype_bytes: int = 2) -> LayerLayout:
    config = make()
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] \
        * config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return LayerLayout(name, tuple(window if t == "sliding_attention" else None for t in types),
                       2 * config.num_key_value_heads * head_dim * dtype_bytes)


def real_layouts() -> list[LayerLayout]:
    """Published shapes, bfloat16 K/V."""
    from transformers import Gemma3TextConfig, GptOssConfig, MistralConfig

    return [
        _from_hf("Gemma-3-27B", lambda: Gemma3TextConfig(
            num_hidden_layers=62, sliding_window=1024, num_key_value_heads=16, head_dim=128, num_attention_heads=32,
            hidden_size=5376, layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(62)])),
        _from_hf("gpt-oss-20b", lambda: GptOssConfig(num_hidden_layers=24, sliding_window=128,
                                                     num_key_value_heads=8, head_dim=64)),
        _from_hf("Mistral-7B, 4k window", lambda: MistralConfig(num_hidden_layers=32, sliding_window=4096,
                                                               num_key_value_heads=8, head_dim=128)),
    ]


@dataclass
class Fill:
    """Requests resident when a budget is filled at one context length."""

    resident: int
    bytes_per_request: float
    group_waste: list[float]  # per group (one entry for a uniform pool)


def fill(layout: LayerLayout, uniform: bool, budget_bytes: int, context: int, block_size: int, chunk: int,
         decode: int) -> Fill:
    """Admit requests of `context` tokens (each computed `chunk` tokens a step, oldest first, then
    decoding `decode` tokens) until the pool cannot take another; the figures at that point."""
    kv_layout = KVLayout.uniform(len(layout.windows)) if uniform else KVLayout.of(layout.windows)
    block_bytes = kv_layout.layers_per_block * layout.kv_bytes_per_layer_token * block_size
    manager = KVCacheManager(budget_bytes // block_bytes, block_size, enable_prefix_caching=False,
                             windows=kv_layout.windows)
    total = context + decode
    if kv_layout.blocks_per_request(total, block_size, chunk) > manager.pool.num_blocks:
        return Fill(0, 0.0, [0.0] * kv_layout.num_groups)
    rid = 0
    while True:  # one more request, run to its end; stop at the first that does not fit
        if manager.admit(rid, [0] * total, num_new_tokens=min(chunk, total)) is None:
            break
        done = min(chunk, total)
        fits = True
        while done < total:
            n = min(chunk if done < context else 1, total - done)
            if manager.grow(rid, n) is None:
                fits = False
                break
            done += n
        if not fits:
            manager.free(rid)
            break
        rid += 1
    used = manager.pool.num_used * block_bytes
    waste = [g.waste for g in manager.group_stats()]
    return Fill(rid, used / rid if rid else 0.0, waste)


def ideal_bytes(layout: LayerLayout, context: int, block_size: int) -> int:
    """K/V a request of `context` tokens must keep: every token in a full layer, the window and one
    block in a sliding one."""
    return layout.kv_bytes_per_layer_token * sum(kv_tokens_kept(context, w, block_size) for w in layout.windows)


def run_layouts_bench(budget_bytes: int = 64 << 30, contexts: tuple[int, ...] = (8192, 32768, 131072),
                      block_size: int = 16, chunk: int = 2048, decode: int = 256,
                      layouts: list[LayerLayout] | None = None) -> list[dict]:
    rows = []
    for layout in layouts or real_layouts():
        for context in contexts:
            grouped = fill(layout, False, budget_bytes, context, block_size, chunk, decode)
            uniform = fill(layout, True, budget_bytes, context, block_size, chunk, decode)
            ideal = ideal_bytes(layout, context + decode, block_size)
            rows.append({
                "model": layout.name, "context": context, "groups": KVLayout.of(layout.windows).num_groups,
                "resident": grouped.resident, "uniform_resident": uniform.resident,
                "bytes_per_request": grouped.bytes_per_request, "uniform_bytes_per_request": uniform.bytes_per_request,
                "ideal_bytes_per_request": ideal, "max_group_waste": max(grouped.group_waste),
                "ideal_resident": budget_bytes // ideal,
            })
    return rows


def layouts_table(rows: list[dict], budget_bytes: int) -> str:
    lines = [f"KV budget {budget_bytes / 2**30:.0f} GiB (bfloat16 K/V); requests of the context, then 256 decoded "
             "tokens, computed 2,048 tokens a step",
             "",
             "| model | context | groups | requests resident | uniform pool | x uniform | KV per request | "
             "ideal | x ideal | worst group waste |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["resident"] / r["uniform_resident"] if r["uniform_resident"] else float("inf")
        lines.append(
            f"| {r['model']} | {r['context'] // 1024}k | {r['groups']} | {r['resident']} | {r['uniform_resident']} | "
            f"{ratio:.2f}x | {r['bytes_per_request'] / 2**20:,.0f} MiB | {r['ideal_bytes_per_request'] / 2**20:,.0f} MiB"
            f" | {r['bytes_per_request'] / r['ideal_bytes_per_request']:.3f} | {r['max_group_waste']:.1%} |")
    return "\n".join(lines)

"""`pagedserve kv-calc` for models that mix full attention and sliding windows: the layer kinds read
from config.json as transformers reads them (checked against transformers' own config classes and
the engine's ModelConfig), the K/V per request per layer kind next to the uniform figure, and the
requests a pool holds; the per-kind figure against what the engine's KV cache groups really hold."""

from __future__ import annotations

import json

import pytest
from transformers import Gemma3Config, GptOssConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedserve.entrypoints.cli import main
from pagedserve.entrypoints.kv_calc import resolve_shape
from pagedserve.kv import KVCacheManager
from pagedserve.kv.groups import KVLayout
from pagedserve.kv.sizes import kv_tokens_kept
from pagedserve.models.config import ModelConfig

DIMS = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=128, max_position_embeddings=256)

# config.json as written by hand or by the hub's checkpoints, and the transformers class that reads it.
CONFIGS = {
    "qwen3 layer_types": (Qwen3Config, dict(DIMS, model_type="qwen3", num_hidden_layers=3, sliding_window=8,
                                            use_sliding_window=True,
                                            layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # no layer_types: the window from layer max_window_layers on
    "qwen2 max_window_layers": (Qwen2Config, dict(DIMS, model_type="qwen2", num_hidden_layers=4, sliding_window=16,
                                                  use_sliding_window=True, max_window_layers=1)),
    # Qwen2.5's published configs: a window given but not used
    "qwen2 window off": (Qwen2Config, dict(DIMS, model_type="qwen2", num_hidden_layers=4, sliding_window=131072,
                                           use_sliding_window=False, max_window_layers=2)),
    "mistral": (MistralConfig, dict(DIMS, model_type="mistral", num_hidden_layers=3, sliding_window=32)),
    "gpt-oss": (GptOssConfig, dict(DIMS, model_type="gpt_oss", num_hidden_layers=4, sliding_window=128,
                                   layer_types=["sliding_attention", "full_attention"] * 2)),
    # Gemma 3's published multimodal config: a sparse text_config (heads, context and pattern by default)
    "gemma3 sparse text_config": (Gemma3Config, dict(model_type="gemma3", text_config=dict(
        model_type="gemma3_text", num_hidden_layers=8, hidden_size=64, sliding_window=512))),
    "gemma3 old pattern": (Gemma3Config, dict(model_type="gemma3", text_config=dict(
        model_type="gemma3_text", num_hidden_layers=6, hidden_size=64, sliding_window=4, sliding_window_pattern=3))),
}


def _expected(hf) -> tuple[int | None, ...]:
    """Each layer's window from a transformers config object (() when every layer is full)."""
    window, types = hf.sliding_window, getattr(hf, "layer_types", None)
    if window is None:
        return ()
    windows = tuple(window if t == "sliding_attention" else None for t in types) if types \
        else (window,) * hf.num_hidden_layers
    return windows if any(w is not None for w in windows) else ()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_kinds_are_read_as_transformers_reads_the_config(name, tmp_path):
    cls, config = CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = resolve_shape(str(tmp_path))
    hf = cls(**config)
    text = getattr(hf, "text_config", hf)
    assert shape.layer_windows == _expected(text)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.max_context) == (
        text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, text.head_dim,
        text.max_position_embeddings)
    if config["model_type"] in ("qwen2", "qwen3", "mistral"):  # what the engine itself reads
        assert shape.layer_windows == ModelConfig.from_hf_config(hf).sliding_windows


def test_every_kind_of_config_that_is_windowed_is_seen_as_windowed(tmp_path):
    """The cases above are not all trivially empty: each style names a window somewhere but the one turned off."""
    windowed = {}
    for name, (_, config) in CONFIGS.items():
        (tmp_path / "config.json").write_text(json.dumps(config))
        windowed[name] = resolve_shape(str(tmp_path)).windowed
    assert windowed == {name: name != "qwen2 window off" for name in CONFIGS}


def _kv_calc(capsys, *args: str) -> str:
    main(["kv-calc", *args])
    return capsys.readouterr().out


def _write(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_hybrid_model_is_reported_per_layer_kind_next_to_the_uniform_figure(capsys, tmp_path):
    model = _write(tmp_path, CONFIGS["qwen3 layer_types"][1])
    out = _kv_calc(capsys, "--model", model, "--dtype", "float32", "--tokens", "100",
                   "--kv-cache-memory-bytes", "100000")
    # one layer's token: 2 x 2 KV heads x 16 x 4 bytes = 256; a sliding layer keeps 8 + 16 of the 100 tokens
    assert "layers: 2 sliding (window 8), 1 full attention; KV cache groups: 3 groups of 1 layer: 2 x sliding 8, " \
           "1 x full" in out
    assert "KV bytes per token, every layer: 768" in out
    assert "  sliding 8: 2 layers x 24 tokens = 12,288 (12.00 KiB)" in out
    assert "  full attention: 1 layers x 100 tokens = 25,600 (25.00 KiB)" in out
    assert "  total: 37,888 (37.00 KiB); uniform (every layer keeps every token): 76,800 (75.00 KiB), 2.03x" in out
    assert "holds 2 requests of 100 tokens (200 tokens); as a uniform pool 1 (100 tokens)" in out
    # A context inside the window: every layer keeps every token, the totals agree.
    short = _kv_calc(capsys, "--model", model, "--dtype", "float32", "--tokens", "6")
    assert "  sliding 8: 2 layers x 6 tokens = 3,072" in short and "  total: 4,608 (4.50 KiB); uniform (every " \
           "layer keeps every token): 4,608 (4.50 KiB), 1.00x" in short
    # The block size is the engine's: one block past the window.
    assert "  sliding 8: 2 layers x 40 tokens" in _kv_calc(capsys, "--model", model, "--tokens", "100",
                                                         "--block-size", "32")


def test_a_config_whose_window_is_off_keeps_the_one_kind_report(capsys, tmp_path):
    off = _kv_calc(capsys, "--model", _write(tmp_path, CONFIGS["qwen2 window off"][1]), "--tokens", "100")
    plain = {k: v for k, v in CONFIGS["qwen2 window off"][1].items() if "window" not in k}
    assert off == _kv_calc(capsys, "--model", _write(tmp_path, plain), "--tokens", "100")
    assert "KV bytes for 100 tokens: 51,200" in off and "sliding" not in off


def test_gemma_3_27b_at_128k_holds_six_requests_in_64_gib_where_a_uniform_pool_holds_one(capsys):
    out = _kv_calc(capsys, "--model", "gemma-3-27b", "--kv-cache-memory-bytes", str(64 << 30))
    per_layer_token = 2 * 16 * 128 * 2
    total = (10 * 131072 + 52 * (1024 + 16)) * per_layer_token
    assert f"  total: {total:,} " in out and total == 11_180_441_600
    assert f"holds {(64 << 30) // total} requests of 131,072 tokens" in out and (64 << 30) // total == 6
    assert "as a uniform pool 1 (131,072 tokens)" in out  # 62 layers x 128k x 8 KiB = 62 GiB


def test_tensor_parallel_splits_a_hybrid_models_request_too(capsys):
    tp1 = _kv_calc(capsys, "--model", "gpt-oss-20b", "--tokens", "8192")
    tp2 = _kv_calc(capsys, "--model", "gpt-oss-20b", "--tokens", "8192", "--tensor-parallel-size", "2")
    total = (12 * 8192 + 12 * 144) * 2 * 8 * 64 * 2
    assert f"  total: {total:,} " in tp1 and "per rank" not in tp1
    assert f"KV bytes per request per rank: {total // 2:,}" in tp2
    assert "holds 2 requests of 8,192 tokens (16,384 tokens) (2x TP=1's 1)" in tp2


def test_layer_types_of_the_wrong_length_is_a_clear_error(tmp_path):
    config = dict(CONFIGS["gpt-oss"][1], layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(SystemExit, match="layer_types has 2 entries for 4 layers"):
        main(["kv-calc", "--model", _write(tmp_path, config)])


@pytest.mark.parametrize("block", [3, 4])
@pytest.mark.parametrize("tokens", [5, 37, 100])
def test_the_per_kind_figure_is_what_the_engines_groups_hold_within_a_block(tokens, block, tmp_path):
    """A request computed whole, then decoded one token a step: at its last step each of the engine's
    groups holds the tokens kv-calc counts for its kind, to within one block (the engine holds whole
    blocks, from the one the window starts in)."""
    shape = resolve_shape(_write(tmp_path, CONFIGS["qwen3 layer_types"][1]))
    layout = KVLayout.of(shape.layer_windows)
    kv = KVCacheManager(200, block, enable_prefix_caching=False, windows=layout.windows)
    prompt = max(1, tokens - 10)
    assert kv.admit("r", [0] * prompt) == 0
    for _ in range(tokens - prompt):
        assert kv.grow("r", 1) is not None
    held = [sum(1 for b in blocks if b is not None) * block for blocks in kv._tables["r"].groups]
    for g, group in enumerate(layout.groups):
        wanted = kv_tokens_kept(tokens, group.window, block)
        assert wanted - block <= held[g] < wanted + block, (g, held, wanted)
    per_layer = shape.bytes_per_layer_token("float32")
    assert shape.bytes_per_request("float32", tokens, block) == per_layer * sum(
        len(group.layers) * kv_tokens_kept(tokens, group.window, block) for group in layout.groups)

import dataclasses
import json
import os

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.entrypoints.kv_calc import human_bytes, resolve_shape, weight_bytes


def test_llama_3_8b_full_context_in_bf16(capsys):
    main(["kv-calc", "--model", "llama-3-8b", "--dtype", "bfloat16", "--tokens", "8192"])
    out = capsys.readouterr().out
    assert "KV bytes for 8,192 tokens: 1,073,741,824" in out
    assert "KV bytes per token: 131,072" in out


def test_embedded_model_preset_defaults_to_its_context(capsys):
    main(["kv-calc", "--model", "smollm2-135m", "--dtype", "float32"])
    # 2 x 30 layers x 3 KV heads x 64 x 4 bytes = 46,080 per token
    assert "KV bytes for 8,192 tokens: 377,487,360" in capsys.readouterr().out


def test_reads_a_config_json_or_a_model_directory(tmp_path):
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 256, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for where in (tmp_path, tmp_path / "config.json"):
        shape = resolve_shape(str(where))
        assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (4, 8, 32)  # MHA, head_dim derived
        assert shape.bytes_per_token("float16") == 2 * 4 * 8 * 32 * 2


def test_a_multimodal_config_gives_its_language_models_shape(tmp_path):
    text = {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_size": 2560, "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                      "vision_config": {"num_attention_heads": 16}}))
    shape = resolve_shape(str(tmp_path))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.max_context) == (6, 4, 256, 131072)


def test_unknown_model_is_a_clear_error(capsys):
    with pytest.raises(SystemExit, match="llama-3-8b"):
        main(["kv-calc", "--model", "no-such-model"])


def _tokens_held(out: str) -> int:
    line = next(line for line in out.splitlines() if line.startswith("KV pool of"))
    return int(line.split(" holds ")[1].split()[0].replace(",", ""))


def _kv_calc(capsys, *args: str) -> str:
    main(["kv-calc", *args])
    return capsys.readouterr().out


def test_tensor_parallel_size_1_leaves_the_report_unchanged(capsys):
    plain = _kv_calc(capsys, "--model", "smollm2-135m")
    assert _kv_calc(capsys, "--model", "smollm2-135m", "--tensor-parallel-size", "1") == plain
    assert "tensor parallel" not in plain and "KV pool" not in plain


def test_embedded_model_at_tp_3_holds_3x_the_tokens_per_device(capsys):
    memory = ["--model", "smollm2-135m", "--kv-cache-memory-bytes", str(1 << 30)]
    tp1 = _tokens_held(_kv_calc(capsys, *memory))
    out = _kv_calc(capsys, *memory, "--tensor-parallel-size", "3")
    assert "1 KV head per rank" in out and "replicated" not in out
    assert "KV bytes per token per rank: 7,680" in out  # 2 x 30 layers x 1 KV head x 64 x 2 bytes
    # 1 GiB is not a multiple of a token's bytes: both counts round down
    assert _tokens_held(out) // 3 == tp1 == (1 << 30) // 23040
    # without --kv-cache-memory-bytes: the memory TP=1 needs for the model's context
    default = _kv_calc(capsys, "--model", "smollm2-135m", "--tensor-parallel-size", "3")
    assert "holds 24,576 tokens (3x TP=1's 8,192)" in default


def test_kv_heads_replicated_past_their_count_hold_only_kv_heads_x(capsys, tmp_path):
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
              "intermediate_size": 1024, "max_position_embeddings": 1024}
    (tmp_path / "config.json").write_text(json.dumps(config))
    memory = ["--model", str(tmp_path), "--kv-cache-memory-bytes", str(64 * 2 * 4 * 2 * 2 * 1000)]
    tp1 = _tokens_held(_kv_calc(capsys, *memory))
    out = _kv_calc(capsys, *memory, "--tensor-parallel-size", "4")
    assert "1 KV head per rank, replicated" in out
    assert (tp1, _tokens_held(out)) == (1000, 2000)  # 4 ranks, but only 2 KV heads to split


def test_tp_size_that_does_not_split_the_model_names_the_accepted_sizes():
    with pytest.raises(SystemExit, match="tensor_parallel_size=2 .*it accepts 1, 3$"):
        main(["kv-calc", "--model", "smollm2-135m", "--tensor-parallel-size", "2"])


@pytest.mark.slow
def test_a_gguf_gives_its_shape_and_its_weight_bytes_by_format(capsys, embedded_path):
    assert resolve_shape(embedded_path) == dataclasses.replace(resolve_shape("smollm2-135m"),
                                                               name=os.path.basename(embedded_path))
    out = _kv_calc(capsys, "--model", embedded_path)
    assert "KV bytes per token: 23,040" in out
    sizes = weight_bytes(embedded_path)
    assert set(sizes) == {"Q4_1", "Q8_0", "F32"}
    assert sizes["Q8_0"] == 49152 * 576 // 32 * 34  # the embedding table: 34 bytes per block of 32
    assert f"weights: {human_bytes(sum(sizes.values()))} (Q4_1 " in out


def test_a_safetensors_directory_gives_its_weight_bytes_by_dtype(tiny_checkpoint):
    path, model = tiny_checkpoint("llama")
    assert weight_bytes(str(path)) == {"F32": sum(p.numel() * 4 for p in model.state_dict().values())}

import json

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.entrypoints.kv_calc import resolve_shape


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


def test_unknown_model_is_a_clear_error(capsys):
    with pytest.raises(SystemExit, match="llama-3-8b"):
        main(["kv-calc", "--model", "no-such-model"])

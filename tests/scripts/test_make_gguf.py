"""scripts/make_gguf.py writes GGUFs that transformers, pagedserve (and llama.cpp) read as the model
they came from: checked on make_random_model.py's tiny shape."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_gguf import permute_rotary_rows, tensor_type, write_gguf  # noqa: E402
from make_random_model import SHAPES, write_random_model  # noqa: E402

TYPES = ["Q8_0", "Q4_0", "Q4_1"]
PROMPT = [{"role": "user", "content": "Hello there, how are you? Write me a poem about <|im_end|> tokens."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """The tiny random model (float32 safetensors) and a GGUF of it in each type."""
    folder = tmp_path_factory.mktemp("tiny")
    write_random_model(str(folder), "tiny", dtype="float32", seed=0)
    # Apart from the Hugging Face files, which transformers would read in place of the GGUF's chat template.
    ggufs = tmp_path_factory.mktemp("ggufs")
    files = {t: ggufs / f"tiny-{t.lower()}.gguf" for t in TYPES}
    for gguf_type, path in files.items():
        write_gguf(folder, path, gguf_type)
    return folder, files


@pytest.fixture(scope="module")
def hf_model(tiny):
    """transformers' float32 load of the tiny GGUF of a type (each read once: a read takes seconds)."""
    _, files = tiny

    @functools.cache
    def load(gguf_type: str):
        path = files[gguf_type]
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()

    return load


def _unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's rotary row order, written apart from the script's permutation."""
    head_dim = weights.shape[0] // n_head
    return weights.reshape(n_head, head_dim // 2, 2, -1).transpose(0, 2, 1, 3).reshape(weights.shape)


def _gguf_weights(path: Path, source_names: list[str]) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    """Each tensor as gguf-py dequantizes it, under its source name and in the source's row order."""
    shape = SHAPES["tiny"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, shape["num_hidden_layers"])
    source_name = {names.get_name(name, try_suffixes=(".weight",)): name for name in source_names}
    out = {}
    for tensor in GGUFReader(path).tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name:
            weights = _unpermute(weights, shape["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            weights = _unpermute(weights, shape["num_key_value_heads"])
        out[source_name[tensor.name]] = (weights, tensor.tensor_type)
    return out


def _step_bound(source: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """One quantization step of each 32-weight block: no stored value may be further from its source."""
    blocks = source.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    step = {GGMLQuantizationType.Q8_0: amax / 127, GGMLQuantizationType.Q4_0: amax / 8,
            GGMLQuantizationType.Q4_1: (blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)) / 15,
            GGMLQuantizationType.F32: 0 * amax}[qtype]
    return np.broadcast_to(step * 1.01 + 1e-7, blocks.shape).reshape(source.shape)


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", TYPES)
def test_transformers_reads_the_gguf_as_the_dequantized_source(tiny, hf_model, gguf_type):
    folder, files = tiny
    path = files[gguf_type]
    model = hf_model(gguf_type)
    loaded = {name: p.detach().numpy() for name, p in model.state_dict().items()}
    source = {name: t.numpy() for name, t in load_file(folder / "model.safetensors").items()}
    stored = _gguf_weights(path, list(source))

    assert not model.config.tie_word_embeddings  # the tiny shape is untied: output.weight was written
    assert set(loaded) == set(stored) == set(source)
    types = {qtype for _, qtype in stored.values()}
    assert types == {GGMLQuantizationType.F32, GGMLQuantizationType[gguf_type]}
    for name, (weights, qtype) in stored.items():
        np.testing.assert_array_equal(loaded[name], weights, err_msg=name)
        assert (qtype == GGMLQuantizationType.F32) == name.endswith("norm.weight"), name
        error = np.abs(weights - source[name])
        assert (error <= _step_bound(source[name], qtype)).all(), f"{name}: {error.max()}"


@pytest.mark.slow
def test_pagedserve_greedy_matches_transformers_on_the_gguf(tiny, hf_model, monkeypatch, tmp_path):
    from pagedserve import LLM, SamplingParams
    from pagedserve.models import gguf_cache

    # A GGUF cache of its own: the conversion runs as on a first start, and the user's cache is left alone.
    monkeypatch.setattr(gguf_cache, "cache_root", lambda: tmp_path / "gguf")
    folder, files = tiny
    path = files["Q4_0"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        generated = hf_model("Q4_0").generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    expected = generated[0, len(ids):].tolist()

    llm = LLM(model=str(path), quantization="none", dtype="float32", kv_cache_memory_bytes=1 << 24)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    assert len(set(expected)) > 1  # a continuation that varies, so agreement means something
    assert list(got) == expected


@pytest.mark.slow
def test_tokenizer_read_from_the_gguf_encodes_as_the_source(tiny):
    folder, files = tiny
    source = AutoTokenizer.from_pretrained(folder)
    read_back = AutoTokenizer.from_pretrained(files["Q8_0"].parent, gguf_file=files["Q8_0"].name)
    text = source.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    text += " 3.3 3..3 — ünïcödé 我想在apple工作 🦙🦙\n\n  indented"
    assert source.encode(text, add_special_tokens=False)[:3] == [1, 9690, 198]  # special tokens count as one
    assert read_back.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False)
    assert read_back.chat_template == source.chat_template
    assert (read_back.bos_token_id, read_back.eos_token_id) == (source.bos_token_id, source.eos_token_id)


@pytest.mark.slow
def test_vocabulary_fields_equal_those_llama_cpp_wrote_for_the_same_tokenizer(tiny, embedded_path):
    """The embedded SmolLM2 GGUF was written by llama.cpp's converter from the tokenizer the random
    models carry: every tokenizer field must come out the same."""
    _, files = tiny
    ours, theirs = GGUFReader(files["Q8_0"]).fields, GGUFReader(embedded_path).fields
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                "tokenizer.chat_template"):
        assert ours[key].contents() == theirs[key].contents(), key


def test_tensor_types_follow_llama_cpp():
    matrix, ragged, norm = np.zeros((8, 64), np.float32), np.zeros((8, 40), np.float32), np.ones(64, np.float32)
    assert tensor_type(matrix, GGMLQuantizationType.Q4_0) == GGMLQuantizationType.Q4_0
    assert tensor_type(ragged, GGMLQuantizationType.Q4_0) == GGMLQuantizationType.F16  # rows not in blocks of 32
    assert tensor_type(norm, GGMLQuantizationType.Q8_0) == GGMLQuantizationType.F32


def test_rotary_permutation_interleaves_the_halves_of_each_head():
    rows = np.arange(8, dtype=np.float32)[:, None]  # two heads of head_dim 4: halves (0,1 | 2,3), (4,5 | 6,7)
    assert permute_rotary_rows(rows, n_head=2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    np.testing.assert_array_equal(_unpermute(permute_rotary_rows(rows, 2), 2), rows)


def test_refuses_a_checkpoint_it_would_convert_wrong(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, attention_bias=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="biases"):
        write_gguf(tmp_path, tmp_path / "x.gguf", "Q8_0")


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", TYPES)
def test_pagedserve_runs_the_gguf_as_stored(tiny, gguf_type, monkeypatch, tmp_path, paged_harness):
    """quantization="auto" keeps every matrix in the file's type (the untied LM head too) and
    computes what the dequantized path computes, to float32 rounding."""
    from pagedserve.models.loader import load_model

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    path = str(tiny[1][gguf_type])
    quantized, config = load_model(path, quantization="auto")
    dense, _ = load_model(path, quantization="none")
    assert quantized.lm_head.quantized.formats == [gguf_type]
    assert quantized.model.embed_tokens.quantized.formats == [gguf_type]
    assert quantized.model.layers[1].mlp.down_proj.quantized.formats == [gguf_type]
    prompt = list(range(3, 40))
    ours = paged_harness(quantized, config, 16, 8).step([(0, prompt)])[0]
    ref = paged_harness(dense, config, 16, 8).step([(0, prompt)])[0]
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)

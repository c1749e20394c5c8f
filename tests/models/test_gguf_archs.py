"""Gemma 3 and Phi-3 GGUF files, written here as llama.cpp's converter lays them out (gguf-py's
names and quantizers; a Gemma's norms stored as 1 + w, a Phi-3's q|k|v and gate|up fused), loaded
with their quantized tensors run natively and dequantized, against transformers' own load of the
same file; and the files whose metadata we cannot honour, refused by name."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, Phi3Config

from pagedserve.models.layers import Linear
from pagedserve.models.loader import load_model
from tests.conftest import randomize_
from tests.models.test_llama import TOL, hf_logits, run_in_chunks

GEMMA3 = dict(hidden_size=32, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, vocab_size=128, max_position_embeddings=256, sliding_window=8, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)  # query_pre_attn_scalar: the default 256, as transformers reads a GGUF
PHI3 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=None)
TYPES = ["F32", "Q8_0", "Q4_0"]


def source_model(arch: str, rope_factor: float | None = None) -> torch.nn.Module:
    """A tiny random transformers model; a Gemma 3 with its full-attention RoPE scaled linearly by
    rope_factor (its sliding layers unscaled, as Gemma 3 4B and larger are)."""
    if arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": 1e6}
        if rope_factor is not None:
            full = {"rope_type": "linear", "factor": rope_factor, "rope_theta": 1e6}
        config = Gemma3TextConfig(**GEMMA3, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": full})
        model = Gemma3ForCausalLM(config)
    else:
        model = AutoModelForCausalLM.from_config(Phi3Config(**PHI3))
    randomize_(model, seed=3)
    return model.float().eval()


def write_gguf(model: torch.nn.Module, out: Path, gguf_type: str, *, rope_scaling: tuple[str, float] | None = None,
               rope_dims: int | None = None, extra_tensors: tuple[str, ...] = (), kv_heads: int | None = None) -> Path:
    """`model` as a GGUF of its architecture (gguf-py's constants), matrices in gguf_type."""
    c = model.config
    arch = gguf.MODEL_ARCH.GEMMA3 if c.model_type == "gemma3_text" else gguf.MODEL_ARCH.PHI3
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(kv_heads or c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)  # without one, transformers' Phi-3 config keeps its default 32000, past this vocabulary
    if arch == gguf.MODEL_ARCH.GEMMA3:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(c.sliding_window)
        w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    else:
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_rope_dimension_count(rope_dims or head_dim)
    if rope_scaling is not None:
        w.add_string(f"{w.arch}.rope.scaling.type", rope_scaling[0])
        w.add_rope_scaling_factor(rope_scaling[1])
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    wanted = gguf.GGMLQuantizationType[gguf_type]
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        array = tensor.numpy().astype(np.float32)
        if arch == gguf.MODEL_ARCH.GEMMA3 and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp's converter stores a Gemma's (1 + w) norm weights with the 1 added
        qtype = wanted if array.ndim == 2 else gguf.GGMLQuantizationType.F32
        w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for name in extra_tensors:
        w.add_tensor(name, np.ones(head_dim // 2, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_gguf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))


TOKENS = torch.randint(3, 128, (26,), generator=torch.Generator().manual_seed(1)).tolist()
CHUNKS = [5, 1, 7, 3] + [1] * 10  # prefill in pieces past the sliding window, then decode steps


def ours(path: Path, quantization: str, paged_harness) -> tuple[torch.Tensor, torch.nn.Module]:
    model, config = load_model(str(path), quantization=quantization)
    return run_in_chunks(paged_harness(model, config, block_size=4, num_blocks=32), TOKENS, CHUNKS), model


@pytest.mark.parametrize("gguf_type", TYPES)
@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_gguf_runs_quantized_and_agrees_with_transformers_gguf_load(arch, gguf_type, tmp_path, paged_harness):
    source = source_model(arch)
    path = write_gguf(source, tmp_path / f"{arch}-{gguf_type}.gguf", gguf_type)
    hf = hf_gguf_model(path)
    ref = hf_logits(hf, TOKENS)
    if gguf_type == "F32":  # the file holds the source model exactly: transformers reads it back as it was
        assert (ref - hf_logits(source, TOKENS)).abs().max().item() < TOL
    assert ref.std() > 0.1
    native, model = ours(path, "auto", paged_harness)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    if gguf_type != "F32":  # every projection (Phi-3's fused ones cut by rows) kept as stored
        assert linears and all(m.weight is None for m in linears)
        assert {f for m in linears for f in m.quantized.formats} == {gguf_type}
    assert (native - ref).abs().max().item() < TOL
    dequantized, _ = ours(path, "none", paged_harness)
    assert (dequantized - ref).abs().max().item() < TOL


@pytest.mark.parametrize("gguf_type", ["F32", "Q8_0"])
def test_gemma3_gguf_scales_its_full_attention_rope_as_stored(gguf_type, tmp_path, paged_harness):
    """transformers' GGUF config drops gemma3.rope.scaling.*; the reference is the source config
    (linear factor on the full-attention layers) holding the weights transformers read from the file."""
    source = source_model("gemma3", rope_factor=4.0)
    path = write_gguf(source, tmp_path / "scaled.gguf", gguf_type, rope_scaling=("linear", 4.0))
    reference = Gemma3ForCausalLM(source.config).float().eval()
    reference.load_state_dict(hf_gguf_model(path).state_dict())
    ref = hf_logits(reference, TOKENS)
    unscaled = source_model("gemma3")
    unscaled.load_state_dict(reference.state_dict())
    assert (ref - hf_logits(unscaled, TOKENS)).abs().max().item() > 1e-2  # the scaling matters at these positions
    for quantization in ("auto", "none"):
        logits, _ = ours(path, quantization, paged_harness)
        assert (logits - ref).abs().max().item() < TOL, quantization


def test_greedy_of_a_quantized_phi3_gguf_matches_transformers(tmp_path, paged_harness):
    path = write_gguf(source_model("phi3"), tmp_path / "phi3.gguf", "Q4_0")
    hf = hf_gguf_model(path)
    model, config = load_model(str(path), quantization="auto")
    prompt = TOKENS[:9]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                               max_new_tokens=20, do_sample=False, eos_token_id=None)[0, 9:].tolist()
    assert paged_harness(model, config, block_size=4, num_blocks=32).greedy([prompt], max_new_tokens=20, chunk=4)[0] == expected


@pytest.mark.parametrize("make, match", [
    (lambda m, p: write_gguf(m["phi3"], p, "Q8_0", rope_dims=12), r"rotates 12 of each head's 16 dims"),
    (lambda m, p: write_gguf(m["phi3"], p, "Q8_0", extra_tensors=("rope_factors_long.weight",)),
     r"LongRoPE factors \(rope_factors_long\.weight\)"),
    (lambda m, p: write_gguf(m["gemma3"], p, "Q8_0", rope_scaling=("yarn", 4.0)), r"rope scaling 'yarn'"),
])
def test_gguf_metadata_we_cannot_honour_is_refused(make, match, tmp_path):
    path = make({"phi3": source_model("phi3"), "gemma3": source_model("gemma3")}, tmp_path / "bad.gguf")
    for quantization in ("auto", "none"):
        with pytest.raises(ValueError, match=match):
            load_model(str(path), quantization=quantization)


def test_a_fused_tensor_that_disagrees_with_the_heads_is_named(tmp_path):
    path = write_gguf(source_model("phi3"), tmp_path / "bad.gguf", "Q8_0", kv_heads=1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight' has 128 rows"):
        load_model(str(path), quantization="auto")


def test_tensor_parallel_ranks_cut_a_phi3_ggufs_fused_tensors_still_quantized(tmp_path):
    """Each rank's fused qkv_proj / gate_up_proj is its rows of the whole model's q, k, v (gate, up)."""
    from pagedserve.distributed.group import TPGroup
    from pagedserve.models.llama import DecoderForCausalLM
    from pagedserve.models.loader import _checked_gguf_reader, load_config
    from pagedserve.models.quantized_loader import gguf_tensors, split_quantized

    path = str(write_gguf(source_model("phi3"), tmp_path / "phi3.gguf", "Q8_0"))
    config, reader = load_config(path), _checked_gguf_reader()(path)
    names = DecoderForCausalLM.meta(config).checkpoint_targets().keys()
    whole, _ = split_quantized(DecoderForCausalLM.meta(config), gguf_tensors(reader, config, names))
    qkv, gate_up = "model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"
    q, k, v = whole[qkv].dequantize().split([64, 32, 32])
    gate, up = whole[gate_up].dequantize().chunk(2)
    for rank in range(2):
        shard, _ = split_quantized(DecoderForCausalLM.meta(config, TPGroup(rank, 2)), gguf_tensors(reader, config, names))
        assert shard[qkv].formats == ["Q8_0"]
        assert torch.equal(shard[qkv].dequantize(), torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]]))
        assert torch.equal(shard[gate_up].dequantize(), torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))

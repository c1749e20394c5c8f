"""Gemma 4's text model (Gemma4ForCausalLM) against transformers: sliding and full layers of
different head sizes and KV heads, K = V on the full layers, KV-shared last layers (one of each
type, with double-wide MLPs), per-layer embeddings, layer scalars, proportional RoPE."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma4TextConfig

from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import load_model
from tests.conftest import randomize_
from tests.models.test_llama import TOL, hf_greedy, hf_logits, run_in_chunks

GEMMA4_TEXT = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    sliding_window=8, num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=128, final_logit_softcapping=30.0, max_position_embeddings=256,
    pad_token_id=0, bos_token_id=2, eos_token_id=1,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 10000.0}},
)


def test_model_config_of_a_gemma4_text_config():
    config = ModelConfig.from_hf_config(Gemma4TextConfig(**GEMMA4_TEXT))
    assert config.architecture == "Gemma4ForCausalLM"
    assert config.sliding_windows == (8, None, 8, 8, None)
    assert config.layer_head_dims == (16, 32, 16, 16, 32) and config.layer_kv_heads == (2, 1, 2, 2, 1)
    assert config.kv_sources == (0, 1, 2, 2, 1) and config.num_cache_layers == 3
    assert config.k_eq_v_layers == (False, True, False, False, True)
    assert config.layer_intermediate_sizes == (64, 64, 64, 128, 128)
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 1.0}
    assert config.sliding_rope_theta == 100.0 and config.attention_scale == 1.0
    # Pages of the two shapes: one uniform table over the three cache layers, each buffer its own shape.
    assert config.kv_layout().num_groups == 1 and config.kv_layout().layers_per_block == 3
    assert config.kv_buffer_shapes() == [(2, 16), (1, 32), (2, 16)]
    assert config.kv_bytes_per_token(torch.float32) == 2 * 4 * (32 + 32 + 32)


@pytest.mark.parametrize("setting, message", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16), "enable_moe_block"),
    (dict(use_bidirectional_attention="vision"), "use_bidirectional_attention"),
    (dict(vocab_size_per_layer_input=64), "vocab_size_per_layer_input"),
])
def test_gemma4_variants_we_cannot_run_are_refused(setting, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(Gemma4TextConfig(**{**GEMMA4_TEXT, **setting}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma4")
    hf = AutoModelForCausalLM.from_config(Gemma4TextConfig(**GEMMA4_TEXT), attn_implementation="eager",
                                          dtype=torch.float32)
    randomize_(hf, seed=5)
    with torch.no_grad():  # buffers randomize_ leaves at one
        for i, layer in enumerate(hf.model.layers):
            layer.layer_scalar.fill_(0.7 + 0.15 * i)
    hf.eval().save_pretrained(path, safe_serialization=True)
    return path, hf


def test_gemma4_logits_and_greedy_match_transformers(checkpoint, paged_harness):
    path, hf = checkpoint
    model, config = load_model(str(path))
    assert config.num_cache_layers == 3
    tokens = torch.randint(3, config.vocab_size - 3, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = run_in_chunks(paged_harness(model, config, block_size=4, num_blocks=32), tokens, [5, 1, 7, 3] + [1] * 14)
    ref = hf_logits(hf, tokens)
    assert ref.std() > 0.1
    assert (ours - ref).abs().max().item() < TOL
    prompts = [tokens[:9], tokens[3:17]]
    ours_greedy = paged_harness(model, config, block_size=4, num_blocks=64).greedy(prompts, 20, chunk=4)
    assert ours_greedy == [hf_greedy(hf, p, 20) for p in prompts]

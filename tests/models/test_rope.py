"""Each RoPE variant against transformers: its frequencies and attention factor against
transformers' own ROPE_INIT_FUNCTIONS, its cos/sin table against transformers' rotary module, and a
tiny model's logits against the transformers model with that rope. LongRoPE's long factors (which
transformers chooses per forward, by the longest position in it) are checked where a forward's
choice and this engine's per-position one agree: a cached sequence decoded past the original
length, one token per forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config, SmolLM3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagedserve.models.config import ModelConfig
from pagedserve.models.layers import RotaryEmbedding, rope_inv_freq
from pagedserve.models.loader import load_model
from tests.conftest import randomize_
from tests.models.test_llama import TOL, hf_logits, run_in_chunks

DIMS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.2, 4.0]  # one factor per frequency of a 16-dim head
LONG = [1.0, 1.8, 3.5, 6.0, 9.0, 14.0, 20.0, 28.0]

ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-options": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16,
                     "beta_slow": 2, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 1.0},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "attention_factor": 0.8},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                 "original_max_position_embeddings": 64},
    "longrope-factor": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 2.0,
                        "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def llama_config(rope: str, **overrides) -> LlamaConfig:
    return LlamaConfig(**(DIMS | overrides), rope_parameters={"rope_theta": 10000.0, **ROPES[rope]})


def tiny_model(config, tmp_path, seed: int = 0):
    """(transformers' model of `config` with random weights, ours loaded from its checkpoint)."""
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(hf, seed)
    hf.eval().save_pretrained(tmp_path, safe_serialization=True)
    return hf, load_model(str(tmp_path))


@pytest.mark.parametrize("rope", ROPES)
def test_frequencies_and_attention_factor_are_transformers(rope):
    hf = llama_config(rope)
    config = ModelConfig.from_hf_config(hf)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[ROPES[rope]["rope_type"]](hf)
    assert torch.equal(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), inv_freq)
    assert config.rope_scaling.get("attention_factor", 1.0) == attention_factor
    if rope.startswith("longrope"):  # transformers' set for a sequence past the original length
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, seq_len=65)
        assert torch.equal(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, long=True), long)
        assert not torch.equal(long, inv_freq)
    if rope != "dynamic":  # dynamic: the plain frequencies up to max_position_embeddings
        assert not torch.equal(inv_freq, rope_inv_freq(config.head_dim, config.rope_theta))


def test_dynamic_is_transformers_to_the_last_bit_where_its_base_rounds():
    """factor * max / max - (factor - 1) is not exactly 1 here: the NTK base moves off theta by
    rounding, and so do transformers' frequencies."""
    hf = llama_config("dynamic", max_position_embeddings=100)
    hf.rope_parameters["factor"] = 1.7
    config = ModelConfig.from_hf_config(hf)
    assert torch.equal(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling),
                       ROPE_INIT_FUNCTIONS["dynamic"](hf)[0])


@pytest.mark.parametrize("rope", ROPES)
def test_each_position_s_cos_and_sin_are_transformers(rope):
    """Our table's row p against transformers' rotary module run on positions that include p: all
    of them at once (short factors) below the original length, those from it on past it."""
    hf = llama_config(rope)
    config = ModelConfig.from_hf_config(hf)
    ours = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    theirs = LlamaRotaryEmbedding(hf)
    original = hf.rope_parameters.get("original_max_position_embeddings", 256)
    for first, last in ((0, original), (original, 256)) if rope.startswith("longrope") else ((0, 256),):
        positions = torch.arange(first, last)[None]
        cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
        half = config.head_dim // 2
        assert torch.equal(ours.cos[first:last], cos[0, :, :half]) and torch.equal(cos[..., :half], cos[..., half:])
        assert torch.equal(ours.sin[first:last], sin[0, :, :half])


@pytest.mark.parametrize("rope", ["linear", "dynamic", "yarn", "yarn-mscale", "yarn-attention-factor", "longrope"])
def test_a_model_with_each_rope_gives_transformers_logits(rope, tmp_path, paged_harness):
    hf, (model, config) = tiny_model(llama_config(rope), tmp_path)
    tokens = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(4)).tolist()  # within 64
    ours = run_in_chunks(paged_harness(model, config, block_size=4, num_blocks=16), tokens, [9, 14, 1, 16])
    ref = hf_logits(hf, tokens)
    assert (ours - ref).abs().max().item() < TOL
    assert ref.std() > 0.1


def test_longrope_past_the_original_length_is_transformers_cached_decode(tiny_checkpoint, paged_harness):
    """Phi-3 (12 of 16 dims rotated) with its K cached, decoded one token per forward from position
    60 to 80: transformers takes the long factors in each forward past position 63 (its longest
    position + 1 exceeds 64), for that token only, as our table does by position. (Its generate
    would instead run the whole sequence again with the long factors.)"""
    path, hf = tiny_checkpoint("phi3")
    model, config = load_model(str(path))
    tokens = torch.randint(3, 128, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    harness = paged_harness(model, config, block_size=4, num_blocks=32)
    ours = run_in_chunks(harness, tokens, [60] + [1] * 20)
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:60]]), use_cache=True)
        ref, cache = [out.logits[0]], out.cache
        for token in tokens[60:]:
            out = hf(torch.tensor([[token]]), cache=cache, use_cache=True)
            ref.append(out.logits[0])
            cache = out.cache
    ref = torch.cat(ref)
    assert (ours - ref).abs().max().item() < TOL
    # and the long factors made a difference: one forward of all 80 uses them everywhere
    assert (hf_logits(hf, tokens)[-1] - ref[-1]).abs().max().item() > 1e-2


@pytest.mark.parametrize("variant", ["phi4", "phi4-mini"])
def test_phi_4_shapes_give_transformers_logits(variant, tmp_path, paged_harness):
    """Phi-4 (plain RoPE over whole heads, untied) and Phi-4-mini (3/4 of each head rotated,
    LongRoPE, tied embeddings) as transformers' Phi3Config describes them."""
    if variant == "phi4":
        hf_config = Phi3Config(**DIMS, pad_token_id=None)
    else:
        hf_config = Phi3Config(**DIMS, pad_token_id=None, partial_rotary_factor=0.75, tie_word_embeddings=True,
                               original_max_position_embeddings=64,
                               rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                "short_factor": SHORT[:6], "long_factor": LONG[:6]})
    hf, (model, config) = tiny_model(hf_config, tmp_path, seed=1)
    assert config.rotary_dim == (None if variant == "phi4" else 12)
    tokens = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    ours = run_in_chunks(paged_harness(model, config, block_size=4, num_blocks=16), tokens, [17, 1, 22])
    assert (ours - hf_logits(hf, tokens)).abs().max().item() < TOL


def test_smollm3_s_default_layers_skip_rope_every_fourth(tmp_path, paged_harness):
    hf, (model, config) = tiny_model(SmolLM3Config(**(DIMS | {"num_hidden_layers": 4}), pad_token_id=None), tmp_path)
    assert config.rope_layers == (True, True, True, False)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [True, True, True, False]
    tokens = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = run_in_chunks(paged_harness(model, config, block_size=4, num_blocks=16), tokens, [13, 17])
    assert (ours - hf_logits(hf, tokens)).abs().max().item() < TOL


def test_what_the_rotary_code_cannot_run_is_refused():
    with pytest.raises(ValueError, match="partial rotary.*phi3 only, not llama"):
        ModelConfig.from_hf_config(LlamaConfig(**DIMS, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                         "partial_rotary_factor": 0.5}))
    with pytest.raises(ValueError, match="rotates 9 dims"):  # 16 * 0.6: an odd rotated width
        ModelConfig.from_hf_config(Phi3Config(**DIMS, pad_token_id=None, partial_rotary_factor=0.6))
    short = llama_config("longrope")
    short.rope_parameters["short_factor"] = SHORT[:5]
    with pytest.raises(ValueError, match="short_factor has 5 entries, not one per rotary frequency \\(8\\)"):
        ModelConfig.from_hf_config(short)
    ambiguous = SmolLM3Config(**DIMS, pad_token_id=None, sliding_window=8, layer_types=["full_attention",
                                                                                        "sliding_attention"])
    with pytest.raises(ValueError, match="use_sliding_window is false is ambiguous"):
        ModelConfig.from_hf_config(ambiguous)

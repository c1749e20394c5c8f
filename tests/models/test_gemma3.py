"""Gemma 3 beyond the arch-parametrized tests (conftest's "gemma3" runs those): what its config
becomes, the variants refused, and a multimodal Gemma3ForConditionalGeneration checkpoint whose
language model runs against transformers' text-only forward of the whole model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import load_config, load_model
from tests.conftest import GEMMA3_TEXT, randomize_
from tests.models.test_llama import TOL, hf_greedy, hf_logits, run_in_chunks


def test_model_config_of_a_gemma3_text_config():
    config = ModelConfig.from_hf_config(Gemma3TextConfig(**GEMMA3_TEXT))
    assert (config.architecture, config.model_type) == ("Gemma3ForCausalLM", "gemma3_text")
    assert config.sliding_windows == (8, None, 8, None)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.qk_norm and config.tie_word_embeddings
    assert config.norm_unit_offset and config.sandwich_norms
    assert config.embed_scale == 32**0.5 and config.attention_scale == 24**-0.5
    assert config.final_logit_softcapping == 8.0
    assert (config.rope_theta, config.rope_scaling) == (10000.0, {"rope_type": "linear", "factor": 4.0})
    assert (config.sliding_rope_theta, config.sliding_rope_scaling) == (100.0, None)
    assert [config.layer_uses_sliding_rope(i) for i in range(4)] == [True, False, True, False]
    hash(config)


def test_transformers_defaults_give_gemma3s_two_rope_bases():
    """A config.json of the Hub's kind (rope_theta and rope_local_base_freq, no rope_parameters)."""
    hf = Gemma3TextConfig(num_hidden_layers=6, rope_theta=1e6, rope_local_base_freq=1e4,
                          rope_scaling={"rope_type": "linear", "factor": 8.0})
    config = ModelConfig.from_hf_config(hf)
    assert (config.rope_theta, config.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (config.sliding_rope_theta, config.sliding_rope_scaling) == (1e4, None)
    assert config.sliding_windows == (4096,) * 5 + (None,)  # 5 sliding : 1 full


@pytest.mark.parametrize("setting, message", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(hidden_activation="gelu"), "hidden_act 'gelu'"),
])
def test_gemma3_variants_we_cannot_run_are_refused(setting, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(Gemma3TextConfig(**{**GEMMA3_TEXT, **setting}))


def tiny_multimodal():
    """A Gemma3ForConditionalGeneration with the tiny text model and a tiny SigLIP tower."""
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    config = Gemma3Config(text_config=Gemma3TextConfig(**GEMMA3_TEXT).to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=127, boi_token_index=125, eoi_token_index=126)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed=11)
    return model.eval()


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-multimodal")
    model = tiny_multimodal()
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def test_the_text_part_of_a_multimodal_checkpoint_matches_transformers(multimodal_checkpoint, paged_harness):
    path, hf = multimodal_checkpoint
    names = load_file(str(path / "model.safetensors")).keys()
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("language_model.") for n in names)
    model, config = load_model(str(path))
    assert (config.architecture, config.model_type, config.num_layers) == ("Gemma3ForConditionalGeneration",
                                                                          "gemma3", 4)
    assert config.tie_word_embeddings and model.lm_head is None
    # transformers' multimodal class does not soft-cap its logits, though its text config sets a cap.
    assert json.loads((path / "config.json").read_text())["text_config"]["final_logit_softcapping"] == 8.0
    assert config.final_logit_softcapping is None
    tokens = torch.randint(3, config.vocab_size - 3, (26,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = run_in_chunks(paged_harness(model, config, block_size=4, num_blocks=32), tokens, [5, 1, 7, 3] + [1] * 10)
    ref = hf_logits(hf, tokens)
    assert (ours - ref).abs().max().item() < TOL
    assert ref.std() > 0.1 and ref.abs().max() > 8.0  # uncapped: past the text config's cap
    prompt = tokens[:9]
    assert paged_harness(model, config, block_size=4, num_blocks=32).greedy([prompt], 24, chunk=4)[0] == \
        hf_greedy(hf, prompt, 24)


def test_a_multimodal_checkpoint_under_transformers_module_names_loads_the_same(multimodal_checkpoint, tmp_path):
    """Some transformers 4 versions saved the model's module names (model.language_model.*,
    model.vision_tower.*, lm_head) rather than the Hub's (language_model.model.*)."""
    path, _ = multimodal_checkpoint
    renamed = {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        for old, new in (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = tensor
    renamed["lm_head.weight"] = renamed["model.language_model.embed_tokens.weight"].clone()  # a stored tied copy
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    first, _ = load_model(str(path))
    second, config = load_model(str(tmp_path))
    assert dataclasses.asdict(config) == dataclasses.asdict(load_config(str(path)))
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name

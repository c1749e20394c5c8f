"""Attention sinks in the model (ModelConfig.attention_sinks): each layer's `self_attn.sinks` is
loaded from the checkpoint, sharded by heads, kept float32, and reaches attention. The reference
is a transformers decoder of the tiny configs whose attention is transformers' own gpt-oss eager
attention (sinks included), with each layer given a `sinks` parameter as gpt-oss has."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
from transformers.masking_utils import eager_mask
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager_attention

from pagedserve.distributed.group import TPGroup
from pagedserve.models.config import ModelConfig
from pagedserve.models.llama import DecoderForCausalLM
from pagedserve.models.loader import load_weights
from pagedserve.ops import cpu_attention
from tests.conftest import TINY_CONFIGS, randomize_

TOL = 1e-4
WITH_SINKS = "eager_with_sinks"  # the attention implementation the reference runs

AttentionInterface.register(WITH_SINKS, gpt_oss_eager_attention)
AttentionMaskInterface.register(WITH_SINKS, eager_mask)


def reference_with_sinks(arch: str, seed: int = 0) -> torch.nn.Module:
    """The tiny `arch` in transformers with random weights and random sinks of both signs."""
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), attn_implementation=WITH_SINKS,
                                             dtype=torch.float32)
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        layer.self_attn.sinks = torch.nn.Parameter(torch.randn(model.config.num_attention_heads, generator=gen) * 3)
    return model.eval()


def ours(hf: torch.nn.Module, dtype: torch.dtype = torch.float32, tp: TPGroup | None = None):
    config = dataclasses.replace(ModelConfig.from_hf_config(hf.config), attention_sinks=True)
    net = DecoderForCausalLM.empty(config, dtype, "cpu", tp)
    load_weights(net, hf.state_dict().items())
    return net.requires_grad_(False).eval(), config


@pytest.mark.parametrize("path", ["kernels", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])  # all full; all windowed (8); one windowed layer
def test_sinks_match_transformers(arch, path, paged_harness, monkeypatch):
    if path == "sdpa":
        monkeypatch.setattr(cpu_attention, "load", lambda: None)
    hf = reference_with_sinks(arch)
    model, config = ours(hf)
    tokens = torch.randint(3, config.vocab_size, (26,), generator=torch.Generator().manual_seed(1)).tolist()
    harness = paged_harness(model, config, block_size=4, num_blocks=32)
    chunks, out, done = [5, 1, 7, 3] + [1] * 10, [], 0  # prompt chunks across blocks and windows, then decodes
    for n in chunks:
        out += harness.step([("r", tokens[done:done + n])])
        done += n
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
        hf.config._attn_implementation = "eager"  # the same model without its sinks
        plain = hf(torch.tensor([tokens])).logits[0]
    assert (torch.cat(out) - ref).abs().max().item() < TOL
    assert (plain - ref).abs().max().item() > 0.05  # the sinks change the logits


def test_sinks_stay_float32_and_are_sharded_by_heads():
    hf = reference_with_sinks("llama")
    full = [layer.self_attn.sinks.detach() for layer in hf.model.layers]
    model, config = ours(hf, dtype=torch.bfloat16)
    for layer, sinks in zip(model.model.layers, full):
        assert layer.self_attn.sinks.dtype == torch.float32 and torch.equal(layer.self_attn.sinks, sinks)
        assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
    for rank in range(2):  # 4 heads: rank r holds heads 2r, 2r + 1
        shard, _ = ours(hf, tp=TPGroup(rank, 2))
        for layer, sinks in zip(shard.model.layers, full):
            assert torch.equal(layer.self_attn.sinks, sinks[2 * rank: 2 * rank + 2])
    # Without the flag there is no such parameter, and a checkpoint that has one is refused.
    plain = DecoderForCausalLM.empty(dataclasses.replace(config, attention_sinks=False), torch.float32, "cpu")
    assert plain.model.layers[0].self_attn.sinks is None
    assert not any("sinks" in name for name in plain.checkpoint_targets())
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.sinks' has no place"):
        load_weights(plain, hf.state_dict().items())

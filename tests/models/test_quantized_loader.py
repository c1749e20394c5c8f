"""Models whose weights stay quantized: the embedded GGUF as stored, float checkpoints quantized to
int8 / int4, against the dequantized ("none") path they must agree with."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.distributed.group import TPGroup
from pagedserve.models import quantized_loader
from pagedserve.models.layers import Linear
from pagedserve.models.loader import _checked_gguf_reader, load_config, load_model
from pagedserve.models.quantized import quantize_int4, quantize_int8
from pagedserve.models.quantized_loader import gguf_tensors, split_quantized
from pagedserve.models.llama import DecoderForCausalLM

QUESTIONS = ["What is the capital of France?", "Name three prime numbers.", "Write a haiku about memory pages.",
             "What is 12 times 12?", "Who wrote Hamlet?", "Give me a synonym for happy.",
             "What colour is the sky on a clear day?", "Translate 'good morning' into French.",
             "List the days of the week.", "Why do leaves change colour in autumn?"]


@pytest.fixture(scope="module")
def quantized_model():
    return load_model(quantization="auto")


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    return [list(embedded_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                        tokenize=True)["input_ids"]) for q in QUESTIONS]


def test_the_embedded_gguf_keeps_its_formats_and_its_size(quantized_model, embedded_model):
    model, _ = quantized_model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None for m in linears)
    assert {f for m in linears for f in m.quantized.formats} == {"Q4_1"}
    assert model.model.embed_tokens.quantized.formats == ["Q8_0"]  # also the (tied) LM head
    held = sum(t.nbytes for t in model.state_dict().values())
    dense = sum(t.nbytes for t in embedded_model[0].state_dict().values())
    assert held < 105e6 and dense > 500e6  # the GGUF is 98 MB; float32 540 MB


def test_logits_and_greedy_agree_with_the_dequantized_path(quantized_model, embedded_model, prompts, paged_harness):
    """The same weights (bit for bit) summed in another order: logits within 1e-3, and greedy
    output identical on at least 9 of the 10 prompts."""
    (qmodel, config), (dmodel, _) = quantized_model, embedded_model
    worst = 0.0
    for i, prompt in enumerate(prompts[:4]):
        q = paged_harness(qmodel, config, 16, 16, seed=i).step([(0, prompt)])[0]
        d = paged_harness(dmodel, config, 16, 16, seed=i).step([(0, prompt)])[0]
        worst = max(worst, (q - d).abs().max().item())
    assert worst < 1e-3, worst
    params = SamplingParams(max_tokens=16, temperature=0)
    greedy = {}
    for quantization in ("auto", "none"):
        llm = LLM(quantization=quantization, num_kv_blocks=128)
        greedy[quantization] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        llm.shutdown()
    assert sum(a == b for a, b in zip(greedy["auto"], greedy["none"])) >= 9


def test_a_corrupt_quantized_tensor_is_named(tmp_path, embedded_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    damaged = tmp_path / "damaged.gguf"
    shutil.copy(embedded_path, damaged)
    tensor = next(t for t in _checked_gguf_reader()(str(damaged)).tensors if t.name == "blk.3.ffn_up.weight")
    with open(damaged, "r+b") as f:  # the first block's scale d: a float16 NaN
        f.seek(tensor.data_offset)
        f.write(np.array([np.nan], np.float16).tobytes())
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_up\.weight.*corrupt"):
        load_model(str(damaged), quantization="auto")


def test_tensor_parallel_ranks_hold_whole_groups_of_the_stored_tensors(embedded_path):
    """Each rank's quantized weights are exactly its slice of the whole model's (row-parallel
    layers cut between groups of 32 input features)."""
    config = load_config(embedded_path)
    reader = _checked_gguf_reader()(embedded_path)
    names = DecoderForCausalLM.meta(config).checkpoint_targets().keys()
    whole, _ = split_quantized(DecoderForCausalLM.meta(config), gguf_tensors(reader, config, names))
    layers = ["model.layers.2.self_attn.o_proj", "model.layers.2.mlp.down_proj", "model.layers.2.self_attn.qkv_proj"]
    full = {path: whole[path].dequantize() for path in layers}
    for rank in range(3):
        tp = TPGroup(rank, 3)
        shard, _ = split_quantized(DecoderForCausalLM.meta(config, tp), gguf_tensors(reader, config, names))
        o, down = shard[layers[0]].dequantize(), shard[layers[1]].dequantize()
        assert torch.equal(o, full[layers[0]].chunk(3, dim=1)[rank])
        assert torch.equal(down, full[layers[1]].chunk(3, dim=1)[rank])
        q, k, v = full[layers[2]].split([576, 192, 192])
        assert torch.equal(shard[layers[2]].dequantize(), torch.cat([q.chunk(3)[rank], k.chunk(3)[rank], v.chunk(3)[rank]]))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_float_checkpoints_quantized_at_load_compute_with_their_dequantized_weights(method, arch, tiny_checkpoint,
                                                                                     paged_harness, monkeypatch,
                                                                                     tmp_path):
    """The quantized model's logits equal those of the float path holding the same (dequantized)
    weights, to float32 rounding; a second load reads the packed weights from the cache."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    path, _ = tiny_checkpoint(arch)
    qmodel, config = load_model(str(path), quantization=method)
    dmodel, _ = load_model(str(path), quantization="none")
    quantize = {"int8": quantize_int8, "int4": quantize_int4}[method]
    for module in dmodel.modules():
        if isinstance(module, Linear) and module is not dmodel.lm_head:
            module.weight.data = torch.from_numpy(quantize(module.weight).dequantize())
    prompt = list(range(3, 40))
    q = paged_harness(qmodel, config, 16, 8).step([(0, prompt)])[0]
    d = paged_harness(dmodel, config, 16, 8).step([(0, prompt)])[0]
    torch.testing.assert_close(q, d, rtol=1e-4, atol=1e-4)

    def refuse(*args):
        raise AssertionError("quantized again: the cache was not used")

    monkeypatch.setattr(quantized_loader, f"quantize_{method}", refuse)
    again, _ = load_model(str(path), quantization=method)
    assert torch.equal(paged_harness(again, config, 16, 8).step([(0, prompt)])[0], q)


def test_int4_refuses_a_model_whose_widths_do_not_divide_into_groups(tmp_path):
    config = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match=r"int4.*model\.layers\.0\..*groups of 32"):
        load_model(str(tmp_path), quantization="int4")


def test_quantization_that_the_checkpoint_cannot_have_is_refused(embedded_path):
    with pytest.raises(ValueError, match="quantizes a float checkpoint"):
        load_model(embedded_path, quantization="int4")
    with pytest.raises(ValueError, match="auto, none, int8 or int4"):
        load_model(embedded_path, quantization="q4")

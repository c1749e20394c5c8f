"""Multi-LoRA serving end to end, on the embedded SmolLM2 in float32: each adapter's greedy output
equals transformers + PEFT with the adapter merged, token for token, inside batches that mix
adapters and the base model, under preemption and slot turnover; adapters never share KV; bad
adapters are ValueErrors before anything runs; nothing leaks."""

import pytest
import torch

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from tests.lora.lora_fixtures import EMBEDDED_ADAPTERS, merged_reference

MAX_TOKENS = 16
QUESTIONS = ["Write a haiku about the sea.", "What is the capital of France?", "List three fruits.",
             "Explain in two sentences why the sky is blue.", "Who wrote Romeo and Juliet?"]
ADAPTERS = list(EMBEDDED_ADAPTERS)  # 4 adapters: ranks 4, 8, 16; all, attention-only, MLP-only rsLoRA targets
# (prompt index, adapter name or None): every adapter twice, the base model twice.
BATCH = [(0, "r8"), (1, None), (2, "r16"), (0, "r4-qv"), (3, "r8-mlp-rslora"), (4, "r8"), (0, None),
         (1, "r16"), (2, "r4-qv"), (4, "r8-mlp-rslora")]


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    texts = [embedded_tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                    add_generation_prompt=True) for q in QUESTIONS]
    return [embedded_tokenizer.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def adapters(embedded_adapter):
    return {name: LoRARequest(name, i + 1, str(embedded_adapter(name))) for i, name in enumerate(ADAPTERS)}


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        ids_t = torch.tensor([ids])
        seq = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=2)
    return seq[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def reference(embedded_hf_model, embedded_adapter, prompts):
    """(prompt index, adapter name or None) -> transformers' greedy tokens, with PEFT's merged weights
    for an adapter."""
    out = {}
    for name in [None, *ADAPTERS]:
        model = embedded_hf_model if name is None else merged_reference(embedded_hf_model, embedded_adapter(name))
        for p, _ in {(p, a) for p, a in BATCH if a == name} | {(0, name)}:
            out[p, name] = hf_greedy(model, prompts[p])
    return out


@pytest.fixture(scope="module")
def lora_model():
    """A copy of the embedded model for the LoRA engines (an engine with LoRA takes its model's linear
    layers for its slots: the session's shared copy stays without)."""
    from pagedserve.models.loader import load_model

    return load_model()


def make_llm(model, tokenizer, **overrides) -> LLM:
    from pagedserve.lora.layers import detach

    detach(model[0])  # the previous test's engine is gone: its slots go with it
    settings = dict(num_kv_blocks=256, max_model_len=512, enable_lora=True, max_loras=4, max_lora_rank=16) | overrides
    return LLM.from_engine(LLMEngine(EngineConfig(**settings), model=model, tokenizer=tokenizer))


def generate(llm, prompts, batch, adapters):
    outputs = llm.generate([{"prompt_token_ids": prompts[p]} for p, _ in batch],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False,
                           lora_request=[None if a is None else adapters[a] for _, a in batch])
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_all_free(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_the_adapters_change_the_output(reference):
    # Guards the comparisons: every adapter's reply to prompt 0 differs from the base model's.
    assert all(reference[0, name] != reference[0, None] for name in ADAPTERS)


def test_a_batch_mixing_four_adapters_and_the_base_matches_transformers_with_peft(
        lora_model, embedded_tokenizer, prompts, adapters, reference):
    llm = make_llm(lora_model, embedded_tokenizer)
    assert generate(llm, prompts, BATCH, adapters) == [reference[key] for key in BATCH]
    assert_all_free(llm)


@pytest.mark.slow
def test_preemption_and_slot_turnover_do_not_change_outputs(lora_model, embedded_tokenizer, prompts, adapters,
                                                            reference):
    # Two slots for four adapters: requests wait for a slot and adapters are copied in again; a pool
    # of a few requests' worth preempts.
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    llm = make_llm(lora_model, embedded_tokenizer, max_loras=2, num_kv_blocks=3 * -(-longest // 16),
                   max_model_len=longest + 16, enable_prefix_caching=False)
    assert generate(llm, prompts, BATCH, adapters) == [reference[key] for key in BATCH]
    assert llm.llm_engine.num_preemptions > 0
    assert_all_free(llm)


def test_the_same_prompt_under_two_adapters_gets_each_its_own_output(lora_model, embedded_tokenizer, prompts,
                                                                     adapters, reference):
    llm = make_llm(lora_model, embedded_tokenizer)
    cached = []
    for name in ("r8", "r16", None, "r8"):  # one after another: each finds the others' blocks cached
        (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                              use_tqdm=False, lora_request=None if name is None else adapters[name])
        assert list(out.outputs[0].token_ids) == reference[0, name]
        cached.append(out.num_cached_tokens)
    # Only the second r8 request is served from the cache: K/V under one adapter is never another's.
    assert cached[:3] == [0, 0, 0] and cached[3] == len(prompts[0]) // 16 * 16
    assert_all_free(llm)


def test_bad_adapters_are_value_errors_before_anything_runs(lora_model, embedded_tokenizer, prompts, adapters,
                                                             tmp_path):
    llm = make_llm(lora_model, embedded_tokenizer, max_lora_rank=8)
    with pytest.raises(ValueError, match="max_lora_rank"):
        generate(llm, prompts, [(0, None), (1, "r16")], adapters)
    with pytest.raises(ValueError, match="no-such-dir"):
        llm.generate("Hi", lora_request=LoRARequest("missing", 9, str(tmp_path / "no-such-dir")))
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate(["Hi", "Ho"], lora_request=[adapters["r8"]])
    assert_all_free(llm)
    off = LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=512), model=lora_model,
                                    tokenizer=embedded_tokenizer))
    with pytest.raises(ValueError, match="enable_lora"):
        off.generate("Hi", lora_request=adapters["r8"])


def test_parallel_samples_share_their_adapter(lora_model, embedded_tokenizer, prompts, adapters, reference):
    llm = make_llm(lora_model, embedded_tokenizer)
    (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0),
                          use_tqdm=False, lora_request=adapters["r16"])
    assert [list(o.token_ids) for o in out.outputs] == [reference[0, "r16"]] * 3
    assert_all_free(llm)


def test_an_adapter_removed_then_given_another_path_serves_the_new_one(lora_model, embedded_tokenizer, prompts,
                                                                      adapters, reference):
    llm = make_llm(lora_model, embedded_tokenizer)
    first = LoRARequest("mine", 7, adapters["r8"].lora_path)
    assert generate(llm, prompts, [(0, "mine")], {"mine": first}) == [reference[0, "r8"]]
    assert llm.remove_lora(7) and 7 not in llm.list_loras()
    second = LoRARequest("mine", 7, adapters["r16"].lora_path)
    assert generate(llm, prompts, [(0, "mine")], {"mine": second}) == [reference[0, "r16"]]
    assert_all_free(llm)


# ---- with the engine's other features, on a tiny model --------------------------------------------

TINY_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, tiny_adapter):
    """The tiny Llama's path, its transformers model, two adapters, and prompts that repeat
    themselves (n-gram drafts find matches)."""
    path, hf_model = tiny_checkpoint("llama")
    adapters = [LoRARequest("r4", 1, str(tiny_adapter("r4"))), LoRARequest("rs", 2, str(tiny_adapter("r8-rslora")))]
    gen = torch.Generator().manual_seed(3)
    prompts = []
    for n in (6, 9, 13):
        chunk = torch.randint(3, hf_model.config.vocab_size, (n,), generator=gen).tolist()
        prompts.append(chunk * 3)
    return path, hf_model, adapters, prompts


def tiny_reference(tiny, per_prompt, prompts=None):
    from tests.models.test_llama import hf_greedy

    _, hf_model, _, tiny_prompts = tiny
    prompts = prompts or tiny_prompts
    merged = {a: merged_reference(hf_model, a.lora_path) for a in set(per_prompt) if a is not None}
    return [hf_greedy(hf_model if a is None else merged[a], p, TINY_TOKENS) for p, a in zip(prompts, per_prompt)]


def tiny_generate(llm, prompts, per_prompt):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=TINY_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False,
                           lora_request=per_prompt)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("speculation", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                                         {"method": "suffix", "num_speculative_tokens": 3}])
def test_speculation_verifies_drafts_under_each_requests_adapter(tiny, embedded_tokenizer, speculation):
    path, _, adapters, prompts = tiny
    per_prompt = [adapters[0], None, adapters[1]]
    llm = LLM.from_engine(LLMEngine(EngineConfig(
        model=str(path), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, max_model_len=128,
        speculative_config=speculation), tokenizer=embedded_tokenizer))
    assert tiny_generate(llm, prompts, per_prompt) == tiny_reference(tiny, per_prompt)
    assert llm.get_metrics()["spec_num_draft_tokens"] > 0
    assert_all_free(llm)


def test_the_kv_tier_keeps_each_adapters_blocks_apart_across_a_restart(tiny, embedded_tokenizer, tmp_path):
    path, _, adapters, prompts = tiny
    settings = dict(model=str(path), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64,
                    max_model_len=128, kv_offload_dir=str(tmp_path))
    with LLM.from_engine(LLMEngine(EngineConfig(**settings), tokenizer=embedded_tokenizer)) as first:
        tiny_generate(first, prompts[2:], [adapters[0]])  # its blocks go to the tier at shutdown
    llm = LLM.from_engine(LLMEngine(EngineConfig(**settings), tokenizer=embedded_tokenizer))
    want = tiny_reference(tiny, [None, adapters[1], adapters[0]], [prompts[2]] * 3)
    for a, expected in zip((None, adapters[1], adapters[0]), want):
        (out,) = llm.generate([{"prompt_token_ids": prompts[2]}],
                              SamplingParams(max_tokens=TINY_TOKENS, temperature=0.0, ignore_eos=True),
                              use_tqdm=False, lora_request=a)
        assert list(out.outputs[0].token_ids) == expected
        # Only the request under the adapter that wrote the blocks reads them back.
        assert (out.num_cached_tokens > 0) == (a is adapters[0])
    assert_all_free(llm)

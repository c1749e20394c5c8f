"""The engine on the real embedded model: exact against transformers whatever the batch, the block
size, the pool (preemption), the prefix cache or the token budget; and nothing leaks."""

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams

MAX_TOKENS = 24
SYSTEM = "You are a helpful assistant. Answer briefly and accurately, in plain English sentences."
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, as if I were ten years old.",
    "List three fruits.",
    "What is 12 times 7? Show the multiplication step by step and then give the final number.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into French, Spanish and German, one per line, with no other text.",
]


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    """Chat prompts of different lengths that share a system prompt, as token ids."""
    texts = [embedded_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    return [embedded_tokenizer.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def reference(embedded_hf_model, prompts):
    """transformers' greedy generate on each prompt alone."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            ids_t = torch.tensor([ids])  # pad id 2 is also <|im_end|>: the mask must be explicit
            seq = embedded_hf_model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=MAX_TOKENS,
                                             do_sample=False, pad_token_id=2)
        out.append(seq[0, len(ids):].tolist())
    return out


def make_llm(embedded_model, embedded_tokenizer, **overrides) -> LLM:
    settings = dict(num_kv_blocks=256, max_model_len=1024) | overrides
    engine = LLMEngine(EngineConfig(**settings), model=embedded_model, tokenizer=embedded_tokenizer)
    return LLM.from_engine(engine)


def generate_ids(llm, prompts, **params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(**({"max_tokens": MAX_TOKENS, "temperature": 0.0} | params)), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_free(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert all(b.ref_count == 0 for b in engine.kv.pool.blocks)


@pytest.fixture(scope="module")
def llm(embedded_model, embedded_tokenizer):
    return make_llm(embedded_model, embedded_tokenizer)


def test_reference_ends_with_eos_for_some_prompts(reference):
    # Guards the comparison: a mix of natural stops and length cut-offs.
    assert any(r[-1] == 2 and len(r) < MAX_TOKENS for r in reference)
    assert any(len(r) == MAX_TOKENS for r in reference)


def test_greedy_batch_matches_transformers(llm, prompts, reference):
    assert generate_ids(llm, prompts) == reference
    assert_all_free(llm)


@pytest.mark.parametrize("block_size", [pytest.param(1, marks=pytest.mark.slow), 32])
def test_block_size_does_not_change_outputs(embedded_model, embedded_tokenizer, prompts, reference, block_size):
    llm = make_llm(embedded_model, embedded_tokenizer, block_size=block_size, num_kv_blocks=4096 // block_size)
    assert generate_ids(llm, prompts) == reference
    assert_all_free(llm)


@pytest.mark.slow
def test_preemption_and_recompute_do_not_change_outputs(embedded_model, embedded_tokenizer, prompts, reference):
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    llm = make_llm(embedded_model, embedded_tokenizer, num_kv_blocks=-(-longest // 16) + 2, max_model_len=longest + 16,
                   enable_prefix_caching=False)
    assert generate_ids(llm, prompts) == reference
    assert llm.llm_engine.num_preemptions > 0
    assert_all_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_and_off(embedded_model, embedded_tokenizer, prompts, reference, caching):
    llm = make_llm(embedded_model, embedded_tokenizer, enable_prefix_caching=caching)
    # Run the first prompt alone, so the shared system prompt is cached before the rest arrive.
    assert generate_ids(llm, prompts[:1]) == reference[:1]
    assert generate_ids(llm, prompts[1:]) == reference[1:]
    hits = llm.get_metrics()["prefix_cache_hits"]
    assert hits > 0 if caching else hits == 0
    assert_all_free(llm)


@pytest.mark.slow
def test_warm_up_step_changes_no_output_and_counts_nothing(embedded_model, embedded_tokenizer, prompts, reference):
    # A budget of 1,100 tokens warms up as prompts of 512, 512 and 76 over blocks 0-68: the
    # blocks the requests are then given, holding the warm-up's keys and values.
    llm = make_llm(embedded_model, embedded_tokenizer, max_num_batched_tokens=1100)
    core = llm.llm_engine.core
    core.warm_up()
    assert core.stats.num_steps == core.stats.num_prompt_tokens == 0
    assert llm.get_metrics()["prefix_cache_queries"] == 0
    assert_all_free(llm)
    assert generate_ids(llm, prompts) == reference
    assert_all_free(llm)
    # Once requests have used the pool, free blocks may hold cached prefixes: no more warm-ups.
    assert llm.llm_engine.kv.pool.num_cached_free > 0
    with pytest.raises(RuntimeError, match="before the first request"):
        core.warm_up()


@pytest.mark.slow
def test_reset_prefix_cache_makes_the_next_run_cold(embedded_model, embedded_tokenizer, prompts, reference):
    llm = make_llm(embedded_model, embedded_tokenizer)
    assert generate_ids(llm, prompts[:1]) == reference[:1]
    hits = llm.get_metrics()["prefix_cache_hits"]
    assert generate_ids(llm, prompts[:1]) == reference[:1]
    assert llm.get_metrics()["prefix_cache_hits"] > hits  # the prompt's full blocks were found
    hits = llm.get_metrics()["prefix_cache_hits"]
    assert llm.reset_prefix_cache()
    assert generate_ids(llm, prompts[:1]) == reference[:1]
    assert llm.get_metrics()["prefix_cache_hits"] == hits
    # Not while a request holds blocks.
    llm.llm_engine.add_request("busy", prompts[0])
    llm.llm_engine.step()
    assert not llm.reset_prefix_cache()
    llm.llm_engine.abort_request("busy")
    assert_all_free(llm)


@pytest.mark.slow
def test_small_token_budget_chunks_every_prompt(embedded_model, embedded_tokenizer, prompts, reference):
    llm = make_llm(embedded_model, embedded_tokenizer, max_num_batched_tokens=7)
    assert min(len(p) for p in prompts) > 7
    assert generate_ids(llm, prompts) == reference
    assert_all_free(llm)


@pytest.mark.slow
def test_requests_join_while_others_are_mid_generation(embedded_model, embedded_tokenizer, prompts, reference):
    llm = make_llm(embedded_model, embedded_tokenizer)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = {}
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], params)
    for step in range(40):
        if step in (3, 9):  # two waves join a running batch
            for i in range(4, 6) if step == 3 else range(6, 8):
                engine.add_request(f"r{i}", prompts[i], params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert [results[f"r{i}"] for i in range(8)] == reference
    assert_all_free(llm)


@pytest.mark.slow
def test_request_metrics_time_the_queue_the_prompt_and_the_decode(embedded_model, embedded_tokenizer, prompts):
    # One request at a time: the second waits in the queue until the first has finished.
    llm = make_llm(embedded_model, embedded_tokenizer, max_num_seqs=1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first, second = llm.generate([{"prompt_token_ids": prompts[3]}, {"prompt_token_ids": prompts[4]}], params,
                                 use_tqdm=False)
    for out in (first, second):
        m = out.metrics
        assert m["arrival_time"] <= m["first_scheduled_time"] < m["first_token_time"] <= m["finish_time"]
    assert second.metrics["first_scheduled_time"] >= first.metrics["finish_time"]
    assert first.metrics["first_scheduled_time"] - first.metrics["arrival_time"] < (
        second.metrics["first_scheduled_time"] - second.metrics["arrival_time"])
    assert_all_free(llm)
    # Parallel samples fork from the first one after its prompt; the request keeps its admission.
    two = make_llm(embedded_model, embedded_tokenizer)
    out = two.generate([{"prompt_token_ids": prompts[5]}], SamplingParams(n=2, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    assert len(out.outputs) == 2
    assert m["arrival_time"] <= m["first_scheduled_time"] < m["first_token_time"] <= m["finish_time"]
    assert_all_free(two)


@pytest.mark.slow
def test_seeded_sampling_is_the_same_alone_and_in_any_batch(llm, prompts):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate([{"prompt_token_ids": prompts[1]}], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.2)
    batch = [{"prompt_token_ids": p} for p in (prompts[0], prompts[2], prompts[1], prompts[3])]
    mixed = llm.generate(batch, [others, others, seeded, others], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    # And the seed matters.
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99)
    assert llm.generate([{"prompt_token_ids": prompts[1]}], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_all_free(llm)


@pytest.mark.slow
def test_parallel_samples_share_the_prompt_blocks(embedded_model, embedded_tokenizer, prompts):
    prompt = prompts[1]
    assert len(prompt) % 16  # its last block is part-full, so the first write into it must copy
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    shared = make_llm(embedded_model, embedded_tokenizer, enable_prefix_caching=False)
    out = shared.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 12 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    separate = make_llm(embedded_model, embedded_tokenizer, enable_prefix_caching=False)
    single = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    separate.generate([{"prompt_token_ids": prompt}] * 4, single, use_tqdm=False)
    m_shared, m_separate = shared.get_metrics(), separate.get_metrics()
    assert m_shared["kv_peak_used_blocks"] < m_separate["kv_peak_used_blocks"]
    assert m_shared["cow_copies"] == 3  # 3 of the 4 samples copy it; the last writer keeps it
    assert m_separate["cow_copies"] == 0
    assert_all_free(shared)
    assert_all_free(separate)


def test_max_tokens_and_length_finish(llm, prompts):
    out = llm.generate([{"prompt_token_ids": prompts[3]}], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"


def test_stop_token_ids(llm, prompts, reference):
    ref = reference[3]
    out = llm.generate([{"prompt_token_ids": prompts[3]}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[ref[4]]), use_tqdm=False)
    o = out[0].outputs[0]
    first = ref.index(ref[4])
    assert o.token_ids == ref[: first + 1]  # the stop token is kept in the ids
    assert (o.finish_reason, o.stop_reason) == ("stop", ref[4])
    tok = llm.get_tokenizer()
    assert o.text == tok.decode(ref[:first], skip_special_tokens=True)  # but not in the text


def test_stop_strings_across_token_boundaries(llm, prompts, reference):
    tok = llm.get_tokenizer()
    full = tok.decode(reference[3], skip_special_tokens=True)
    stop = full[10:16]  # a piece that very likely straddles tokens
    assert stop.strip() and full.count(stop) == 1
    o = llm.generate([{"prompt_token_ids": prompts[3]}],
                     SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert o.text == full[:10]
    assert (o.finish_reason, o.stop_reason) == ("stop", stop)
    kept = llm.generate([{"prompt_token_ids": prompts[3]}],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[:16]


def test_min_tokens_and_ignore_eos(llm, prompts, reference):
    i = next(i for i, r in enumerate(reference) if r[-1] == 2 and len(r) < MAX_TOKENS)
    natural = len(reference[i])
    o = llm.generate([{"prompt_token_ids": prompts[i]}],
                     SamplingParams(max_tokens=natural + 6, min_tokens=natural + 3, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) >= natural + 3
    assert 2 not in o.token_ids[: natural + 3]
    o = llm.generate([{"prompt_token_ids": prompts[i]}],
                     SamplingParams(max_tokens=natural + 4, ignore_eos=True, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == natural + 4 and o.finish_reason == "length"
    assert o.token_ids[:natural] == reference[i]


def test_logprobs_match_transformers(llm, prompts, embedded_hf_model):
    o = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=6, temperature=0, logprobs=3),
                     use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == len(o.token_ids) == 6
    ids = torch.tensor([prompts[1] + o.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(embedded_hf_model(ids).logits[0, len(prompts[1]) - 1 : -1].float(), dim=-1)
    cumulative = 0.0
    for step, (token, entry) in enumerate(zip(o.token_ids, o.logprobs)):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        top = ref[step].topk(3)
        assert list(entry)[:1] == [token] and {t for t in entry} >= set(top.indices.tolist())
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[step, t].item(), abs=1e-3)
        cumulative += entry[token].logprob
    assert o.cumulative_logprob == pytest.approx(cumulative)


@pytest.mark.slow
def test_abort_mid_generation_frees_everything(llm, prompts):
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"a{i}", prompts[i], SamplingParams(max_tokens=30, ignore_eos=True, n=2 if i == 1 else 1))
    for _ in range(4):
        engine.step()
    assert engine.kv.pool.num_used > 0
    engine.abort_request("a1")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"a0", "a2"}
    assert_all_free(llm)


def test_bad_requests_raise_value_errors(llm, prompts):
    engine = llm.llm_engine
    too_long = [1] * (engine.max_model_len + 1)
    with pytest.raises(ValueError, match=rf"{engine.max_model_len + 1}.*{engine.max_model_len}"):
        llm.generate([{"prompt_token_ids": too_long}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([{"prompt_token_ids": [10**7]}], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**6], min_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi"], SamplingParams(temperature=-1.0), use_tqdm=False)
    # A bad prompt in a batch leaves nothing behind, and the engine keeps serving.
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert_all_free(llm)
    assert llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_free(llm)


def test_config_errors_are_clear(embedded_model, embedded_tokenizer):
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(embedded_model, embedded_tokenizer, num_kv_blocks=4, max_model_len=1024)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)


def test_streamed_text_only_grows_and_ends_as_the_final_text(llm, prompts, reference):
    """Text held back while it could still be the start of a stop string is never sent early."""
    tok = llm.get_tokenizer()
    full = tok.decode(reference[3], skip_special_tokens=True)
    stop = full[10:16]
    engine = llm.llm_engine
    engine.add_request("s", prompts[3], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[stop]))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step() if o.request_id == "s"]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full[:10]
    assert not any(stop[:3] in t for t in texts)


@pytest.fixture(autouse=True)
def shared_engine_is_clean_after_each_test(request):
    yield
    if "llm" in request.fixturenames:
        assert_all_free(request.getfixturevalue("llm"))

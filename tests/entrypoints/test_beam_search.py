"""Beam search above the engine finds transformers' best beams, shares the prompt's blocks through
the prefix cache, runs in a pool too small for all its beams at once, and fails cleanly."""

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.models.loader import load_model
from pagedserve.sampling_params import BeamSearchParams, ParameterError


def assert_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, embedded_tokenizer):
    path, hf_model = tiny_checkpoint("llama")
    engine = LLMEngine(EngineConfig(num_kv_blocks=128, block_size=4, max_model_len=256), model=load_model(str(path)),
                       tokenizer=embedded_tokenizer)  # ids < 128 decode fine with the real tokenizer
    return LLM.from_engine(engine), hf_model


@pytest.mark.parametrize("width", [2, 4])
def test_best_beams_match_transformers(tiny, width):
    llm, hf_model = tiny
    prompts = [[5, 17, 33, 8, 90, 61, 12], [44, 3, 101]]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                    max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                                    length_penalty=1.0, early_stopping=False, output_scores=True,
                                    return_dict_in_generate=True)
        assert len(out.sequences) == width
        assert out.sequences[0].tokens == ref.sequences[0].tolist()
        assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
        # transformers' beam score is the cumulative logprob / generated length.
        assert out.sequences[0].cum_logprob / 10 == pytest.approx(ref.sequences_scores[0].item(), abs=1e-4)
    engine = llm.llm_engine
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert_all_free(engine)
    assert engine.kv_stats().prefix_hits > 0  # the beams' requests found their shared blocks cached


def test_beam_search_validates(tiny):
    for bad in [dict(beam_width=0), dict(beam_width=2**62), dict(beam_width=2.0), dict(max_tokens=0),
                dict(temperature=0.5), dict(ignore_eos=1), dict(length_penalty=float("nan")),
                dict(length_penalty=1e6), dict(length_penalty=-51)]:
        with pytest.raises(ParameterError) as e:
            BeamSearchParams(**(dict(beam_width=2, max_tokens=4) | bad))
        assert e.value.param == next(iter(bad))
    with pytest.raises(ValueError, match="logprobs"):  # 2 x width candidates exceed the vocabulary of 128
        tiny[0].beam_search([{"prompt_token_ids": [5, 6]}], BeamSearchParams(beam_width=65, max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        tiny[0].beam_search([{"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=4))


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("llama")
    return load_model(str(path)), hf_model


def beam_llm(tiny_llama, tokenizer, num_kv_blocks: int, **overrides) -> LLM:
    config = EngineConfig(**(dict(num_kv_blocks=num_kv_blocks, block_size=4, max_model_len=24) | overrides))
    return LLM.from_engine(LLMEngine(config, model=tiny_llama[0], tokenizer=tokenizer))


# Pools too small for every beam at once (these livelocked when beams lived in the scheduler: beams
# waiting for their search held the blocks their siblings needed).
TIGHT_BEAMS = [
    (6, 16, 2, [[74, 56, 24, 103, 33, 3, 31, 123], [86, 22]]),
    (7, 4, 4, [[96, 84], [42, 121, 41, 89, 125, 97, 113], [42, 104, 52, 64, 40, 89, 18, 77], [94, 16]]),
    (8, 8, 3, [[39, 113, 62, 62, 92, 74], [92, 62, 51, 13, 96]]),
    (10, 2048, 4, [[5, 17, 33, 8, 90, 61, 12], [44, 3, 101], [7, 7, 9, 120, 1, 64]]),
]


@pytest.mark.parametrize(("num_blocks", "budget", "width", "prompts"), TIGHT_BEAMS)
def test_beam_search_in_a_pool_too_small_for_all_its_beams(tiny_llama, embedded_tokenizer, num_blocks, budget,
                                                           width, prompts):
    params = BeamSearchParams(beam_width=width, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts]
    roomy_llm = beam_llm(tiny_llama, embedded_tokenizer, 256)
    roomy = roomy_llm.beam_search(prompts, params)
    assert roomy_llm.llm_engine.stats.peak_used_blocks > num_blocks  # the beams do not fit the tight pool at once
    tight = beam_llm(tiny_llama, embedded_tokenizer, num_blocks, max_num_batched_tokens=budget)
    outputs = tight.beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in outputs] == [[s.tokens for s in o.sequences] for o in roomy]
    assert_all_free(tight.llm_engine)


def test_a_beam_that_breaks_the_step_fails_its_search_cleanly(tiny_llama, embedded_tokenizer):
    llm = beam_llm(tiny_llama, embedded_tokenizer, 64)
    engine = llm.llm_engine
    real = engine.runner.execute

    def execute(plan, rows, spans):
        if any(str(r.group_id).startswith("beam-") and r.num_tokens > 9 for r in plan.requests):
            raise RuntimeError("injected fault")
        return real(plan, rows, spans)

    engine.runner.execute = execute
    with pytest.raises(RuntimeError, match="failed on a beam"):
        llm.beam_search([{"prompt_token_ids": TIGHT_BEAMS[3][3][0]}], BeamSearchParams(beam_width=2, max_tokens=8))
    assert_all_free(engine)


def test_a_model_with_several_eos_ids_still_keeps_width_live_beams(tiny_llama, embedded_tokenizer):
    """With more EOS ids than 2 x width - width candidates could hold, each beam's request asks for
    (1 + number of EOS ids) x width candidates, as transformers keeps (with 2 x width, the top
    candidates of a beam could all be EOS); the search still returns `width` hypotheses, and an
    EOS never continues a live beam."""
    llm = beam_llm(tiny_llama, embedded_tokenizer, 256)
    prompt = [{"prompt_token_ids": [5, 17, 33, 8]}]
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    plain = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))[0]
    # Make the three most likely first tokens of the plain run's beams EOS ids.
    first = {s.tokens[4] for s in plain.sequences}
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = set(range(112, 128)) - first  # many EOS ids, none of them the plain run's first tokens
    num_eos = len(engine.eos_token_ids)
    try:
        seen = []
        real = engine.add_request

        def add_request(request_id, prompt_ids, params_, **kwargs):
            seen.append(params_.logprobs)
            return real(request_id, prompt_ids, params_, **kwargs)

        engine.add_request = add_request
        out = llm.beam_search(prompt, params)[0]
    finally:
        engine.eos_token_ids = saved
        del engine.add_request
    assert set(seen) == {(1 + num_eos) * 2}
    assert len(out.sequences) == 2
    assert all(t not in range(112, 128) or t in first for s in out.sequences for t in s.tokens[4:-1])


def test_beams_under_a_lora_adapter_match_transformers_with_peft(tiny_checkpoint, tiny_adapter, embedded_tokenizer):
    from pagedserve.lora.request import LoRARequest
    from tests.lora.lora_fixtures import merged_reference

    path, hf_model = tiny_checkpoint("llama")
    adapter = LoRARequest("r4", 1, str(tiny_adapter("r4")))
    merged = merged_reference(hf_model, adapter.lora_path)
    engine = LLMEngine(EngineConfig(num_kv_blocks=128, block_size=4, max_model_len=256, enable_lora=True,
                                    max_lora_rank=4), model=load_model(str(path)), tokenizer=embedded_tokenizer)
    prompts = [[5, 17, 33, 8, 90, 61, 12], [44, 3, 101]]
    outputs = LLM.from_engine(engine).beam_search([{"prompt_token_ids": p} for p in prompts],
                                                  BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True),
                                                  lora_request=[adapter, None])
    for prompt, out, model in zip(prompts, outputs, (merged, hf_model)):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, max_new_tokens=8,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, length_penalty=1.0,
                                 early_stopping=False)
        assert [s.tokens for s in out.sequences] == ref.tolist()
    assert_all_free(engine)

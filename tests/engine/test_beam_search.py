"""Beam search shares blocks between beams and finds transformers' best beam."""

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.beam_search import BeamSearchParams
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.models.loader import load_model


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
    assert engine.kv_stats().cow_copies > 0  # beams forked from one parent copied its last block


def test_beam_search_validates(tiny):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        tiny[0].beam_search([{"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=4))

"""A real server with speculative decoding (n-gram), through the openai client: streamed and whole
outputs equal the offline engine's without speculation, stop strings cut a several-token step where
they match, and /metrics counts drafts and acceptance per position, as vLLM names them."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
from server_harness import MODEL, Server, assert_all_free, serve_engine

from pagedserve.config import EngineConfig
from pagedserve.core.messages import CoreStats, SpecDecodeStats
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.cli import build_parser, engine_kwargs
from pagedserve.kv import KVCacheManager
from pagedserve.sampling_params import SamplingParams

TEXT = ("Paged attention keeps the KV cache in fixed-size blocks. Each request has a block table that "
        "maps its logical blocks to physical blocks anywhere in the pool.")
PROMPT = f"Repeat this text exactly:\n{TEXT}\nRepeated:\n{TEXT[:40]}"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'


@pytest.fixture(scope="module")
def spec_server(embedded_model, embedded_tokenizer) -> Iterator[Server]:
    engine = LLMEngine(EngineConfig(num_kv_blocks=512, max_model_len=2048, speculative_config=SPEC),
                       model=embedded_model, tokenizer=embedded_tokenizer)
    with serve_engine(engine) as server:
        yield server


def offline_text(offline, **params) -> str:
    return offline.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


def test_streamed_and_whole_outputs_equal_those_without_speculation(spec_server, offline):
    expected = offline_text(offline, max_tokens=48, temperature=0)
    client = spec_server.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0)
    assert whole.choices[0].text == expected
    chunks = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48,
                                                                     temperature=0, stream=True)]
    assert "".join(chunks) == expected
    assert any(len(spec_server.engine.tokenizer.encode(c, add_special_tokens=False)) > 1 for c in chunks)
    m = spec_server.wait_idle()
    assert m["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert m["vllm:spec_decode_num_draft_tokens_total"] >= m["vllm:spec_decode_num_accepted_tokens_total"]
    per_position = [m[f"vllm:spec_decode_num_accepted_tokens_per_pos_total:{j}"] for j in range(4)]
    assert sum(per_position) == m["vllm:spec_decode_num_accepted_tokens_total"]
    assert m["vllm:spec_decode_num_drafts_total"] >= per_position[0] > 0
    assert_all_free(m)


def test_a_stop_string_inside_a_speculative_step_ends_the_output_there(spec_server, offline):
    stop = ["logical"]
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=48, temperature=0, stop=stop),
                                use_tqdm=False)[0].outputs[0]
    assert expected.finish_reason == "stop"
    reply = spec_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0,
                                                    stop=stop, logprobs=1)
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, "stop")
    assert len(choice.logprobs.tokens) == len(expected.token_ids)  # the tokens after the stop are dropped
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert_all_free(spec_server.wait_idle())


def test_the_command_line_takes_a_speculative_config():
    args = build_parser().parse_args(["serve", "--speculative-config", SPEC])
    config = EngineConfig(**engine_kwargs(args))
    assert (config.speculative_config.method, config.speculative_config.num_speculative_tokens) == ("ngram", 4)
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "k": 1}')


def test_the_core_process_sends_the_spec_figures():
    stats = CoreStats(1, 0, KVCacheManager(4).stats(), 0, SpecDecodeStats(3, 9, 5, [3, 2, 0]))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=CoreStats)
    assert decoded.spec == stats.spec
    assert decoded.spec.plus(stats.spec).accepted_per_position == [6, 4, 0]

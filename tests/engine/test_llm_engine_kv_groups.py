"""Models whose layers keep K/V differently (full attention and sliding windows) through the whole
engine: greedy output equals transformers' past several windows with every feature that moves
blocks (chunked prefill, the prefix cache, preemption, n > 1 with copy-on-write, ngram
speculation), the sliding groups hold only their windows, and every block is free after a run."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.kv.sizes import cdiv
from pagedserve.sampling_params import SamplingParams
from tests.conftest import randomize_

WINDOW, BLOCK = 8, 4
MAX_TOKENS = 40  # five windows past the prompt
DIMS = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
HYBRID = {
    # two sliding layers to one full: groups of one layer each (2 sliding, 1 full)
    "qwen3": lambda: Qwen3Config(**DIMS, head_dim=16, num_hidden_layers=3, sliding_window=WINDOW, use_sliding_window=True,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # full, sliding, sliding, full: groups of two layers, decode steps replayed in C where it can
    "qwen2": lambda: Qwen2Config(**DIMS, num_hidden_layers=4, sliding_window=WINDOW, use_sliding_window=True,
                                 layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                              "full_attention"]),
    # a window on every layer: one sliding group
    "mistral": lambda: MistralConfig(**DIMS, num_hidden_layers=2, sliding_window=WINDOW),
}


@pytest.fixture(scope="module", params=list(HYBRID))
def hybrid(request, tmp_path_factory):
    """(checkpoint path, transformers model) of a tiny windowed model."""
    path = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    model = AutoModelForCausalLM.from_config(HYBRID[request.param](), attn_implementation="eager",
                                             dtype=torch.float32)
    randomize_(model, seed=11)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path, model


def prompts() -> list[list[int]]:
    """Prompts sharing a 16-token opening (prefix-cache hits), of lengths crossing windows."""
    gen = torch.Generator().manual_seed(5)
    opening = torch.randint(3, 128, (16,), generator=gen).tolist()
    return [opening + torch.randint(3, 128, (n,), generator=gen).tolist() for n in (3, 21, 9, 30)]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(hybrid):
    return [hf_greedy(hybrid[1], p) for p in prompts()]


def make_llm(path, tokenizer, **settings) -> LLM:
    config = EngineConfig(model=str(path), block_size=BLOCK, max_num_seqs=4, max_model_len=128,
                          **({"num_kv_blocks": 160} | settings))
    return LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))


def generate(llm, **params) -> list[list[list[int]]]:
    sampling = SamplingParams(**({"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True} | params))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], sampling, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_all_free(llm) -> None:
    kv = llm.llm_engine.kv
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.pool.num_blocks and all(b.ref_count == 0 for b in kv.pool.blocks)


@pytest.mark.parametrize("settings", [
    dict(),  # whole prompts
    dict(max_num_batched_tokens=8),  # chunked prefill: chunks of at most a window
    dict(num_kv_blocks="one request and a bit", max_num_batched_tokens=16),  # a pool this small preempts
    dict(enable_prefix_caching=False),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}),
], ids=["whole", "chunked", "preempting", "no-prefix-cache", "ngram"])
def test_greedy_output_matches_transformers(hybrid, reference, embedded_tokenizer, settings):
    if "num_kv_blocks" in settings:  # the longest request alone, plus two blocks
        from pagedserve.models.loader import load_config

        layout = load_config(str(hybrid[0])).kv_layout()
        settings = settings | {"num_kv_blocks": layout.blocks_per_request(128, BLOCK, 16) + 2}
    llm = make_llm(hybrid[0], embedded_tokenizer, **settings)
    assert [out[0] for out in generate(llm)] == reference
    assert len({t for seq in reference for t in seq}) > 10  # varied output
    if "num_kv_blocks" in settings:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    # Run again: the prefix cache now serves the openings and the second prompt's windows.
    assert [out[0] for out in generate(llm)] == reference
    assert_all_free(llm)


def test_decode_steps_of_several_groups_replay_where_the_c_kernels_run(embedded_tokenizer, tmp_path):
    from pagedserve.worker.fast_paths import DECODE_REPLAY
    from tests.worker.test_fast_paths import replays_here

    path = tmp_path / "qwen2"
    model = AutoModelForCausalLM.from_config(HYBRID["qwen2"](), attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed=11)
    model.eval().save_pretrained(path, safe_serialization=True)
    llm = make_llm(path, embedded_tokenizer)
    assert llm.llm_engine.kv.num_groups == 2
    if replays_here():
        assert llm.fast_paths()[DECODE_REPLAY] is None
        assert llm.llm_engine.runner.decode_graphs is not None
    assert [out[0] for out in generate(llm)] == [hf_greedy(model, p) for p in prompts()]
    assert_all_free(llm)


def test_parallel_samples_share_then_copy_on_write(hybrid, reference, embedded_tokenizer):
    llm = make_llm(hybrid[0], embedded_tokenizer)
    for samples, ref in zip(generate(llm, n=3), reference):
        assert samples == [ref] * 3
    assert llm.llm_engine.kv.stats().cow_copies > 0
    assert_all_free(llm)


def test_sliding_groups_hold_only_their_windows(hybrid, embedded_tokenizer):
    """At every step of a long decode, a sliding group holds the blocks its window reads and the one
    being written: far fewer than a full group's; the uniform layout (windows masked only) holds every
    block in one table and gives the same tokens."""
    llm = make_llm(hybrid[0], embedded_tokenizer)
    engine = llm.llm_engine
    kv = engine.kv
    engine.add_request("long", prompts()[3],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    most = [0] * kv.num_groups
    while engine.has_unfinished_requests():
        engine.step()
        for table in kv._tables.values():  # the one request's
            for g, blocks in enumerate(table.groups):  # None: behind the window
                most[g] = max(most[g], sum(1 for b in blocks if b is not None))
    total = len(prompts()[3]) + MAX_TOKENS
    for g, window in enumerate(kv.windows):
        if window is None:
            assert most[g] >= cdiv(total - 2, BLOCK)  # (seen after a step: the last one frees the request)
        else:  # the window's blocks and the block being written (the whole prompt's, on its first step)
            assert most[g] <= max(cdiv(len(prompts()[3]), BLOCK), cdiv(window - 1, BLOCK) + 1)
    assert any(w is not None for w in kv.windows)
    uniform = make_llm(hybrid[0], embedded_tokenizer, disable_hybrid_kv_cache=True)
    assert uniform.llm_engine.kv.windows == (None,)
    assert generate(uniform) == generate(llm)
    assert_all_free(llm)


def test_the_kv_tier_stores_and_loads_every_group(hybrid, reference, embedded_tokenizer, tmp_path):
    """A second engine on the same tier directory reads the first one's blocks back, for every group,
    and gives the same tokens."""
    settings = dict(kv_offload_dir=str(tmp_path / "tier"), kv_offload_policy="write_through")
    with make_llm(hybrid[0], embedded_tokenizer, **settings) as first:
        assert [out[0] for out in generate(first)] == reference
    with make_llm(hybrid[0], embedded_tokenizer, **settings) as second:
        assert [out[0] for out in generate(second)] == reference
        assert second.get_metrics()["kv_offload_loaded_blocks"] > 0
        assert_all_free(second)


def test_bfloat16_gives_the_tokens_of_the_uniform_layout(hybrid, embedded_tokenizer):
    """The groups change where K/V live, never the numbers: bfloat16 output equals that of one table
    per request with windows only masked."""
    grouped = make_llm(hybrid[0], embedded_tokenizer, dtype="bfloat16")
    uniform = make_llm(hybrid[0], embedded_tokenizer, dtype="bfloat16", disable_hybrid_kv_cache=True)
    assert generate(grouped) == generate(uniform)
    assert_all_free(grouped)

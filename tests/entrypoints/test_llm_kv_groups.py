"""What a model with KV cache groups shows of them: `LLM.get_metrics()`'s per-group figures, checked
at every step against the engine's block tables walked, and the startup log's line describing the pool."""

from __future__ import annotations

import logging

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams

BLOCK = 4


def windowed_llm(path, tokenizer, **settings) -> LLM:
    config = EngineConfig(model=str(path), block_size=BLOCK, max_num_seqs=4, max_model_len=128,
                          **({"num_kv_blocks": 160} | settings))
    return LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))


def walked_groups(llm) -> list[tuple[int, float]]:
    """(blocks in use, waste) of each group from the requests' tables: distinct blocks, and the share
    of their slots that hold no token."""
    kv = llm.llm_engine.kv
    held: list[dict[int, int]] = [{} for _ in kv.windows]
    for table in kv._tables.values():
        for g, blocks in enumerate(table.groups):
            for i, block in enumerate(blocks):
                if block is not None:
                    held[g][block.block_id] = max(held[g].get(block.block_id, 0),
                                                  min(BLOCK, table.num_tokens - i * BLOCK))
    return [(len(h), 1.0 - sum(h.values()) / (len(h) * BLOCK) if h else 0.0) for h in held]


def test_get_metrics_gives_each_groups_window_blocks_and_waste(windowed_checkpoint, embedded_tokenizer):
    llm = windowed_llm(windowed_checkpoint[0], embedded_tokenizer)
    engine = llm.llm_engine
    metrics = llm.get_metrics()
    # layers sliding, full, sliding: the sliding kind first (its first layer comes first), one layer a group
    assert metrics["kv_groups"] == 3
    assert [metrics[f"kv_group_{g}_window"] for g in range(3)] == [8, 8, 0]
    assert [metrics[f"kv_group_{g}_used_blocks"] for g in range(3)] == [0, 0, 0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 33)), params)  # 30 tokens
    engine.add_request("b", list(range(3, 14)), params)  # 11 tokens: its first block is a's (a prefix hit)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        metrics = llm.get_metrics()
        walked = walked_groups(llm)
        for g, (used, waste) in enumerate(walked):
            assert metrics[f"kv_group_{g}_used_blocks"] == used, (steps, g, walked)
            assert metrics[f"kv_group_{g}_waste"] == pytest.approx(waste), (steps, g, walked)
        assert sum(metrics[f"kv_group_{g}_used_blocks"] for g in range(3)) == metrics["kv_used_blocks"]
        # Past the prompts' step (whole prompts held), two requests of a window of 8 and the block being written
        if steps >= 2 and engine.has_unfinished_requests():
            assert all(metrics[f"kv_group_{g}_used_blocks"] <= 2 * 3 for g in (0, 1)), metrics
    assert steps > 20
    assert metrics["kv_group_2_used_blocks"] == 0 and metrics["kv_group_2_waste"] == 0.0


def test_a_model_of_one_kind_has_one_full_group(tiny_checkpoint, embedded_tokenizer):
    path, _ = tiny_checkpoint("llama")
    llm = LLM.from_engine(LLMEngine(EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=64,
                                                 max_model_len=128), tokenizer=embedded_tokenizer))
    engine = llm.llm_engine
    engine.add_request("a", list(range(3, 23)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt
    engine.step()  # its first token's K/V: 21 slots in 6 blocks
    metrics = llm.get_metrics()
    assert metrics["kv_groups"] == 1 and metrics["kv_group_0_window"] == 0
    assert metrics["kv_group_0_used_blocks"] == metrics["kv_used_blocks"] == 6
    assert metrics["kv_group_0_waste"] == pytest.approx(1 - 21 / 24)
    assert "kv_group_1_window" not in metrics


def pool_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pagedserve.core.engine_core" and r.getMessage().startswith("KV pool:")]


@pytest.mark.parametrize("settings, line", [
    # one layer's token of a block: 2 x 2 KV heads x 16 x 4 bytes = 256 B; 160 x 4 x 256 = 160 KiB.
    # A request of 128 tokens computed whole holds all 32 blocks in each group.
    (dict(), "KV pool: 160 blocks of 4 tokens (160.0 KiB): 3 groups of 1 layer: 2 x sliding 8, 1 x full; "
             "a request of max_model_len (128) holds 96 blocks"),
    # 8 tokens a step: a sliding group holds its window's 7 earlier positions and the step's 8, 4 blocks,
    # and one more for the window's start: 5 (so 32 + 2 x 5)
    (dict(max_num_batched_tokens=8),
     "KV pool: 160 blocks of 4 tokens (160.0 KiB): 3 groups of 1 layer: 2 x sliding 8, 1 x full; "
     "a request of max_model_len (128) holds 42 blocks"),
    # one full group of all 3 layers: 3 x 256 B a slot
    (dict(disable_hybrid_kv_cache=True),
     "KV pool: 160 blocks of 4 tokens (480.0 KiB): 1 group of 3 layers: 1 x full (sliding windows only masked: "
     "disable_hybrid_kv_cache); a request of max_model_len (128) holds 32 blocks"),
], ids=["whole", "chunked", "uniform"])
def test_the_startup_log_describes_the_pool_and_its_groups(windowed_checkpoint, embedded_tokenizer, caplog,
                                                           settings, line):
    with caplog.at_level(logging.INFO, logger="pagedserve.core.engine_core"):
        windowed_llm(windowed_checkpoint[0], embedded_tokenizer, **settings)
    assert pool_lines(caplog) == [line]


def test_the_startup_log_of_a_model_of_one_kind(tiny_checkpoint, embedded_tokenizer, caplog):
    path, _ = tiny_checkpoint("llama")  # 2 layers x 2 KV heads x 16 (64 / 4 heads) x 4 bytes x 2 = 512 B a slot
    with caplog.at_level(logging.INFO, logger="pagedserve.core.engine_core"):
        LLMEngine(EngineConfig(model=str(path), block_size=16, num_kv_blocks=4096), tokenizer=embedded_tokenizer)
    assert pool_lines(caplog) == ["KV pool: 4,096 blocks of 16 tokens (32.0 MiB): 1 group of 2 layers: 1 x full; "
                                  "a request of max_model_len (256) holds 16 blocks"]

"""/metrics on a real server for a model with KV cache groups: blocks in use per group, labelled with the
group and its window, adding up to the pool's used blocks at every scrape; the sliding groups hold
their windows while the full group holds the whole request."""

from __future__ import annotations

import threading
import time

import pytest
from server_harness import MODEL, assert_all_free, read_metrics, serve_engine

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.kv.sizes import cdiv

pytestmark = pytest.mark.slow

BLOCK, PROMPT = 4, 40
GROUPS = {"0:8": "sliding", "1:8": "sliding", "2:0": "full"}  # "<group>:<window>" as read_metrics names labels


def group_used(m: dict[str, float]) -> dict[str, float]:
    return {labels: m[f"pagedserve:kv_cache_group_used_blocks:{labels}"] for labels in GROUPS}


def test_metrics_give_each_groups_blocks_in_use(windowed_checkpoint, embedded_tokenizer):
    engine = LLMEngine(EngineConfig(model=str(windowed_checkpoint[0]), block_size=BLOCK, num_kv_blocks=160,
                                    max_model_len=128), tokenizer=embedded_tokenizer)
    with serve_engine(engine) as server:
        idle = server.metrics()
        assert group_used(idle) == {labels: 0 for labels in GROUPS}
        done, failures = threading.Event(), []

        def run():
            try:
                server.client().completions.create(model=MODEL, prompt=list(range(3, 3 + PROMPT)), max_tokens=80,
                                                   temperature=0, extra_body={"ignore_eos": True})
            except Exception as e:  # reported below
                failures.append(e)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        seen = 0
        while not done.is_set():
            m = read_metrics(server.url)
            used = group_used(m)
            # One snapshot: the groups add up to the pool's blocks in use
            assert sum(used.values()) == m["pagedserve:kv_cache_total_blocks"] - m["pagedserve:kv_cache_free_blocks"]
            generated = m["vllm:generation_tokens_total"]
            if m["vllm:num_requests_running"] == 1 and generated >= 2:  # past the step of the whole prompt
                assert used["0:8"] <= cdiv(8 - 1, BLOCK) + 1 and used["1:8"] <= cdiv(8 - 1, BLOCK) + 1, used
                assert used["2:0"] >= cdiv(PROMPT + generated - 1, BLOCK), (used, generated)
                seen += 1
            time.sleep(0.005)
        assert not failures, failures
        assert seen > 0, "no scrape caught the request decoding"
        end = server.wait_idle()
        assert_all_free(end)
        assert group_used(end) == {labels: 0 for labels in GROUPS}

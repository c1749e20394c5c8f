"""The draft model of speculative decoding: greedy outputs equal those without speculation, whether
the draft agrees with the model (the model itself) or not (random weights), through chunked prefill,
preemption, the prefix cache and n > 1; its K/V counts in the pool; a draft that does not share the
model's tokenizer is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.llm import LLM
from pagedserve.models.loader import embedded_model_path
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.draft_runner import DraftRunner
from tests.conftest import randomize_

PROMPTS = ["The capital of France is", "Write a short poem about paged memory and blocks.",
           "Count: 1, 2, 3, 4, 5, 6,", "Repeat after me: the quick brown fox jumps over the lazy dog. Again:"]
PARAMS = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, embedded_tokenizer) -> str:
    """A two-layer Llama with random weights and the embedded model's tokenizer: its drafts are mostly wrong."""
    path = tmp_path_factory.mktemp("random-draft")
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, vocab_size=49152, max_position_embeddings=2048, bos_token_id=1,
                    eos_token_id=2, tie_word_embeddings=True), dtype=torch.float32)
    randomize_(model, seed=3)
    model.eval().save_pretrained(path, safe_serialization=True)
    embedded_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def expected():
    with LLM(num_kv_blocks=256, max_model_len=512) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize(("draft", "settings"), [
    ("itself", dict(max_num_batched_tokens=8, block_size=4)),  # chunked prefill, drafts across block boundaries
    ("random", dict(num_kv_blocks=12, block_size=8, max_model_len=48)),  # preemptions
])
def test_greedy_outputs_equal_those_without_speculation(expected, random_draft, draft, settings):
    model = embedded_model_path() if draft == "itself" else random_draft
    config = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    with LLM(speculative_config=config, **({"num_kv_blocks": 256, "max_model_len": 512} | settings)) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        metrics = llm.get_metrics()
        assert metrics["spec_num_draft_tokens"] > 0
        if draft == "itself":  # the same model drafts what it then says, nearly always
            assert metrics["spec_acceptance_rate"] > 0.9
        if "num_kv_blocks" in settings and settings["num_kv_blocks"] < 20:
            assert metrics["preemptions"] > 0
        # The prefix cache and n > 1 on the same engine: forks and hits start the draft mid-request.
        again = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0, n=2), use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in again] == [[e, e] for e in expected[:2]]
        stats = llm.llm_engine.kv.stats()
        assert stats.used_blocks == 0


def test_the_draft_holds_its_share_of_every_block(random_draft):
    budget = 46080 * 16 * 100  # 100 blocks of the model's K/V alone (float32)
    with LLM(kv_cache_memory_bytes=budget) as plain:
        without = plain.llm_engine.core.num_blocks
    with LLM(kv_cache_memory_bytes=budget,
             speculative_config={"method": "draft_model", "model": random_draft, "num_speculative_tokens": 2}) as llm:
        core = llm.llm_engine.core
        draft = core.executor.draft
        per_token = core.model_config.kv_bytes_per_token(core.config.kv_torch_dtype)
        draft_per_token = draft.kv_bytes_per_token(core.config.kv_torch_dtype)
        assert core.num_blocks == budget // ((per_token + draft_per_token) * core.config.block_size) < without
        assert draft.runner.kv_caches[0].k.shape[0] == core.num_blocks


class _Tokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_a_draft_with_another_tokenizer_or_vocabulary_is_refused(odd_checkpoint):
    config = EngineConfig(speculative_config={"method": "draft_model", "model": "draft", "num_speculative_tokens": 2})
    vocabularies = {"draft": {"a": 0, "b": 1}, None: {"a": 0, "c": 1}}
    with pytest.raises(ValueError, match="does not share the model's tokenizer"):
        DraftRunner(config, None, tokenizer_of=lambda model: _Tokenizer(vocabularies[model]))
    # Same tokenizer, one more row in the vocabulary (the odd checkpoint's 49,153).
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(speculative_config={"method": "draft_model", "model": str(odd_checkpoint[0]), "num_speculative_tokens": 2})

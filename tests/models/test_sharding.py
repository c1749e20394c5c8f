"""Which heads, rows and columns each rank holds: every weight is covered exactly once (KV heads
once per replica), each rank's q heads find their KV head locally, and the shards loaded from a
checkpoint put back together give the whole weights."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.distributed.group import TPGroup
from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import load_config, load_model
from pagedserve.models.sharding import TPShard, accepted_tp_sizes, check_tp_size


def config(heads: int, kv_heads: int, intermediate: int = 96, vocab: int = 128) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", num_layers=1, hidden_size=64,
        intermediate_size=intermediate, num_heads=heads, num_kv_heads=kv_heads, head_dim=16, vocab_size=vocab,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
        qk_norm=False, tie_word_embeddings=False, bos_token_id=None, eos_token_ids=())


def test_the_embedded_model_splits_in_one_or_three():
    embedded = load_config()
    assert accepted_tp_sizes(embedded) == [1, 3]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* 9 attention heads .*; it accepts 1, 3"):
        check_tp_size(embedded, 2)


@given(st.sampled_from([(4, 1), (4, 2), (4, 4), (8, 2), (12, 4), (16, 8), (6, 3), (9, 3)]),
       st.integers(1, 16), st.integers(1, 300))
def test_every_rank_holds_its_heads_and_vocabulary_rows(shape, size, vocab):
    heads, kv_heads = shape
    c = config(heads, kv_heads, intermediate=16 * 9 * 5 * 7, vocab=vocab)
    if size not in accepted_tp_sizes(c):
        with pytest.raises(ValueError, match="accepts"):
            TPShard.of(c, 0, size)
        return
    shards = [TPShard.of(c, r, size) for r in range(size)]
    group = heads // kv_heads  # q heads per KV head
    for s in shards:
        assert s.num_heads * size == heads
        for h in range(s.num_heads):  # each local q head's KV head is among this rank's
            kv = (s.rank * s.num_heads + h) // group
            assert s.kv_head_start <= kv < s.kv_head_start + s.num_kv_heads
            assert kv == s.kv_head_start + h // (s.num_heads // s.num_kv_heads)
    held = [s.kv_head_start + i for s in shards for i in range(s.num_kv_heads)]
    assert sorted(set(held)) == list(range(kv_heads))  # every KV head somewhere,
    assert len(held) == max(size, kv_heads)  # and copied only as often as ranks outnumber KV heads
    rows = [t for s in shards for t in range(s.vocab_start, s.vocab_start + s.real_vocab_rows(vocab))]
    assert rows == list(range(vocab))


@pytest.mark.parametrize("arch", ["llama3", "phi3"])  # biases and tied embeddings; q|k|v and gate|up stored fused
def test_shards_read_from_a_checkpoint_add_up_to_the_whole(arch, tiny_checkpoint):
    """Each rank's shard, read slice by slice from safetensors, put back together along the split
    dimension, equals the weights loaded whole."""
    path, _ = tiny_checkpoint(arch)
    whole, c = load_model(str(path))
    shards = [load_model(str(path), tp=TPGroup(rank, 2))[0] for rank in range(2)]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for name, full in whole.named_parameters():
        parts = [dict(s.named_parameters())[name] for s in shards]
        if "qkv_proj" in name:  # q, k, v each split by heads
            pieces = [p.split([q // 2, kv // 2, kv // 2]) for p in parts]
            joined = torch.cat([torch.cat([p[i] for p in pieces]) for i in range(3)])
        elif "gate_up_proj" in name:
            pieces = [p.chunk(2) for p in parts]
            joined = torch.cat([torch.cat([p[i] for p in pieces]) for i in range(2)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            joined = torch.cat(parts, dim=1)
        elif "embed_tokens" in name or name.startswith("lm_head"):  # vocabulary rows
            joined = torch.cat(parts)[: c.vocab_size]
        else:  # norms, and row-parallel biases (added once, after the all-reduce)
            assert all(torch.equal(p, full) for p in parts), name
            continue
        assert torch.equal(joined, full), name

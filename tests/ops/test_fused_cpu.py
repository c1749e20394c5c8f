"""The fused CPU ops (ops/fused_cpu.py, csrc/fused_ops.c) against torch's arithmetic for the
same steps, written out here, in float32 and bfloat16; and a whole model with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.ops import fused_cpu

DTYPES = [torch.float32, torch.bfloat16]


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.fixture(autouse=True)
def built():
    assert fused_cpu.load() is not None, "the fused ops must build wherever the tests run"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 elements: past the threading threshold
def test_rms_norm_and_its_residual_add(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    added = x + res  # torch's sum, rounded to the dtype
    s = added.float()
    expected = weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    residual = res.clone()
    out = fused_cpu.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, added)  # the sum, written in place
    plain = fused_cpu.rms_norm(added, weight, 1e-5)
    assert torch.equal(out, plain) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6)
    else:  # the sum's order can move a value across a rounding boundary: one step, rarely
        ulps = bf16_ulps(out, expected)
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(0)
    gate_up = (4 * torch.randn(70, 2 * 1536, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's far ends
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = fused_cpu.silu_and_mul(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:
        ulps = bf16_ulps(out, expected)
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 48])  # the whole head; a partial rotary's first 3/4
def test_rotary_in_place_on_views_of_the_fused_qkv_output(dtype, rotary_dim):
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, n = 9, 3, 64, 33
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(n, rotary_dim // 2, generator=gen) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def reference(x):  # the half-split rotation of the first rotary_dim dims, each product rounded as torch does
        x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
        c, s = cos[:, None], sin[:, None]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., rotary_dim:]), dim=-1)

    q = qkv[:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    expected_q, expected_k = reference(q.clone()), reference(k.clone())
    assert fused_cpu.rotary_(q, cos, sin) is q and fused_cpu.rotary_(k, cos, sin) is k
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)  # no fused multiply-add: exact
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


# qwen3: q/k norms on strided views; phi3: a partial rotary (12 of 16 dims)
@pytest.mark.parametrize("which", ["embedded", "qwen3", "phi3"])
def test_a_model_with_and_without_the_fused_ops(which, embedded_model, tiny_checkpoint, monkeypatch):
    from pagedserve.attention import get_backend
    from pagedserve.attention.kv_cache import allocate_kv_cache
    from pagedserve.models.loader import load_model

    model, config = embedded_model if which == "embedded" else load_model(str(tiny_checkpoint(which)[0]))
    tokens = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))

    def logits():
        caches = allocate_kv_cache(config.num_layers, 3, 16, config.num_kv_heads, config.head_dim, torch.float32)
        md = get_backend("torch").build_metadata([[0, 1, 2]], [0], [40], 16)
        return model.compute_logits(model(tokens, md.positions, caches, md))

    fused = logits()
    monkeypatch.setattr(fused_cpu, "available", lambda x: False)
    unfused = logits()
    torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 600])  # 600 rows of 2 KiB: past the threading threshold
def test_row_gathers_and_scatters_copy_as_indexing_does(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    table = torch.randn(1000, 512, generator=gen).to(dtype)
    picks = torch.randint(1000, (rows,), generator=gen)
    assert torch.equal(fused_cpu.gather_rows(table, picks), table[picks])
    # Scatter from strided rows (K of a fused qkv output) into distinct slots.
    qkv = torch.randn(rows, 3, 4, 64, generator=gen).to(dtype)
    slots = torch.randperm(1000, generator=gen)[:rows]
    cache, expected = torch.zeros(1000, 4, 64, dtype=dtype), torch.zeros(1000, 4, 64, dtype=dtype)
    fused_cpu.scatter_rows_(cache, slots, qkv[:, 1])
    expected[slots] = qkv[:, 1]
    assert torch.equal(cache, expected)


def test_row_indices_outside_the_table_are_an_index_error_and_write_nothing():
    table, cache = torch.randn(10, 8), torch.zeros(10, 8)
    with pytest.raises(IndexError):
        fused_cpu.gather_rows(table, torch.tensor([3, 10]))
    with pytest.raises(IndexError):
        fused_cpu.gather_rows(table, torch.tensor([-1]))
    with pytest.raises(IndexError):
        fused_cpu.scatter_rows_(cache, torch.tensor([2, 11]), torch.ones(2, 8))
    assert not cache.any()


def test_an_embedding_lookup_of_a_token_outside_the_vocabulary_is_an_index_error(embedded_model):
    model, config = embedded_model
    with pytest.raises(IndexError):
        model.model.embed_tokens(torch.tensor([5, config.vocab_size]))

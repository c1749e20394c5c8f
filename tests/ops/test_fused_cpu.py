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


def reference_norm(x: torch.Tensor, weight: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    """Llama's RMSNorm (scaled by weight in the dtype), or Gemma's (by 1 + weight in float32)."""
    s = x.float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def assert_rounding_close(out: torch.Tensor, expected: torch.Tensor, tol: float = 2e-6) -> None:
    """Equal up to the order of a float32 sum: a few float32 ulps, or in bfloat16 one step, rarely."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    else:  # the sum's order can move a value across a rounding boundary: one step, rarely
        ulps = bf16_ulps(out, expected)
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.01


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 elements: past the threading threshold
def test_rms_norm_and_its_residual_add(dtype, rows, unit_offset):
    gen = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
    weight = ((0 if unit_offset else 1) + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    added = x + res  # torch's sum, rounded to the dtype
    expected = reference_norm(added, weight, unit_offset)

    residual = res.clone()
    out = fused_cpu.rms_norm(x, weight, 1e-5, residual, unit_offset)
    assert torch.equal(residual, added)  # the sum, written in place
    plain = fused_cpu.rms_norm(added, weight, 1e-5, unit_offset=unit_offset)
    assert torch.equal(out, plain) and out.dtype == dtype
    assert_rounding_close(out, expected)
    # The two forms differ (a weight of w is not one of 1 + w): the flag is read.
    assert not torch.equal(fused_cpu.rms_norm(added, weight, 1e-5, unit_offset=not unit_offset), out)


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 40])  # 40 x 12 heads x 128: past the threading threshold
def test_rms_norm_of_each_head_in_place_on_views_of_the_fused_qkv_output(dtype, n, unit_offset):
    gen = torch.Generator().manual_seed(n)
    heads, kv_heads, dim = 12, 4, 128
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    weight = ((0 if unit_offset else 1) + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    q = qkv[:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    rest = qkv[:, (heads + kv_heads) * dim :].clone()
    expected_q, expected_k = reference_norm(q, weight, unit_offset), reference_norm(k, weight, unit_offset)
    assert fused_cpu.rms_norm_heads_(q, weight, 1e-5, unit_offset) is q
    assert fused_cpu.rms_norm_heads_(k, weight, 1e-5, unit_offset) is k
    assert_rounding_close(q, expected_q)
    assert_rounding_close(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], rest)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(0)
    gate_up = (4 * torch.randn(70, 2 * 1536, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's far ends
    gate, up = gate_up.chunk(2, dim=-1)
    assert_rounding_close(fused_cpu.act_and_mul(gate_up, "silu"), F.silu(gate) * up, tol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype):
    gen = torch.Generator().manual_seed(0)
    gate_up = (4 * torch.randn(70, 2 * 1536, generator=gen)).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -1e20, 1e20])  # exp's far ends, x^3 overflowing
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    out = fused_cpu.act_and_mul(gate_up, "gelu_pytorch_tanh")
    # torch computes 0.5 x (1 + tanh(u)), whose sum cancels for gate below about -3 (it is 0 below
    # about -5, where tanh rounds to -1); the kernel's x / (1 + exp(-2u)) keeps those digits. So:
    # torch's values to rounding where it has them, and everywhere as close to the exact value.
    digits = gate >= -3
    assert digits.float().mean() > 0.7
    assert_rounding_close(out[digits], expected[digits], tol=1e-6)
    g, u = gate.double(), up.double()
    exact = g / (1 + torch.exp(-2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * u
    # Of the value: bfloat16's rounding of the result; in float32, u's rounding, which exp(-2u)
    # turns into ~2^-20 of the value (torch's 1 + tanh(u) is off by up to all of it, below -3).
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-18
    assert ((out.double() - exact).abs() <= (expected.double() - exact).abs() + ulp * exact.abs() + 1e-30).all()


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


# qwen3: q/k norms on strided views; phi3: a partial rotary (12 of 16 dims); gemma3: (1 + w) norms,
# GELU, the scaled embedding
@pytest.mark.parametrize("which", ["embedded", "qwen3", "phi3", "gemma3"])
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 80])  # 80 rows of 640: past the threading threshold
def test_a_scaled_row_gather_multiplies_as_torch_does(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    table = torch.randn(1000, 640, generator=gen).to(dtype)
    picks = torch.randint(1000, (rows,), generator=gen)
    scale = torch.tensor(640**0.5).to(dtype)  # 25.25 in bfloat16, as transformers rounds it
    assert torch.equal(fused_cpu.gather_scaled_rows(table, picks, scale.item()), table[picks] * scale)
    with pytest.raises(IndexError):
        fused_cpu.gather_scaled_rows(table, torch.tensor([3, 1000]), scale.item())


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

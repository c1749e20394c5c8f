"""The hot-path paged attention (attention/sdpa.py) against the oracle (attention/torch_ref.py) on
random mixed steps: same outputs, same cache contents, with decodes in the C kernel or in SDPA
groups, whatever the grouping, with and without sinks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.attention import kv_cache, sdpa, torch_ref
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.ops import cpu_attention


@st.composite
def steps(draw):
    """A mixed step: per request (tokens already cached, new tokens), decodes of varied lengths
    (several decode groups), layout choices, up to two sliding windows (as models that mix
    full and windowed layers use on one metadata), and sinks or none."""
    reqs = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(2, 12)), max_size=4))
    reqs += draw(st.lists(st.tuples(st.integers(0, 90), st.just(1)), min_size=1, max_size=12))
    order = draw(st.permutations(range(len(reqs))))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    kv_heads, group = draw(st.sampled_from([(1, 4), (2, 2), (4, 1), (2, 3), (3, 3)]))
    windows = draw(st.lists(st.sampled_from([None, 1, 5, 17]), min_size=1, max_size=2))
    max_keys = draw(st.sampled_from([16, 64, sdpa.DECODE_GROUP_MAX_KEYS]))
    sink_scale = draw(st.sampled_from([None, 1.0, 4.0, 40.0]))  # normal logits times this
    seed = draw(st.integers(0, 2**16))
    return [reqs[i] for i in order], block_size, kv_heads, group, windows, max_keys, sink_scale, seed


def random_step(reqs, block_size, kv_heads, heads, dim, gen):
    """Block tables over a shuffled pool whose cached slots hold random K/V, and the new q/k/v."""
    seq_lens = [c + n for c, n in reqs]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used:used + n])
        used += n
    [(k_cache, v_cache, _)] = kv_cache.allocate_kv_cache(1, num_blocks, block_size, kv_heads, dim, torch.float32)
    for table, (computed, _) in zip(tables, reqs):
        for t in range(computed):
            k_cache[table[t // block_size], t % block_size] = torch.randn(kv_heads, dim, generator=gen)
            v_cache[table[t // block_size], t % block_size] = torch.randn(kv_heads, dim, generator=gen)
    num_tokens = sum(n for _, n in reqs)
    q = torch.randn(num_tokens, heads, dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    return tables, k_cache, v_cache, q, k, v


@pytest.mark.slow
@pytest.mark.parametrize("decode_path", ["kernel", "sdpa"])
@settings(max_examples=60, deadline=None)
@given(step=steps())
def test_sdpa_matches_the_oracle(decode_path, step):
    reqs, block_size, kv_heads, group, windows, max_keys, sink_scale, seed = step
    gen = torch.Generator().manual_seed(seed)
    tables, k_cache, v_cache, q, k, v = random_step(reqs, block_size, kv_heads, kv_heads * group, 16, gen)
    sinks = None if sink_scale is None else torch.randn(kv_heads * group, generator=gen) * sink_scale
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sdpa, "DECODE_GROUP_MAX_KEYS", max_keys)
        md = sdpa.SdpaBackend().build_metadata(tables, [c for c, _ in reqs], [n for _, n in reqs], block_size)
        if decode_path == "sdpa":
            mp.setattr(cpu_attention, "load", lambda: None)
        else:
            assert cpu_attention.load() is not None, "the C kernel must build wherever the tests run"
            assert cpu_attention.supports(q, k_cache)
        run_step(q, k, v, k_cache, v_cache, md, tables, reqs, windows, sinks)


def run_step(q, k, v, k_cache, v_cache, md, tables, reqs, windows, sinks=None):
    block_size = md.block_size
    ref_md = AttentionMetadata.build(tables, [c for c, _ in reqs], [n for _, n in reqs], block_size)
    assert sum(len(g.token_indices) for g in md.decode_groups) == md.num_decodes
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    # Several "layers" on one metadata: masks built by the first are reused by the others.
    for window in windows + windows:
        out = sdpa.paged_attention(q, k, v, k_cache, v_cache, md, 0.3, window, sinks=sinks)
        expected = torch_ref.paged_attention(q, k, v, ref_k, ref_v, ref_md, 0.3, window, sinks=sinks)
        assert (out - expected).abs().max().item() < 1e-5
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_decode_groups_by_hand(monkeypatch):
    # Decodes with contexts 40, 6, 33, 30, 1 (block size 4), plus one 3-token prefill.
    seq_lens = [40, 6, 33, 3, 30, 1]
    new = [1, 1, 1, 3, 1, 1]
    tables = [list(range(10 * i, 10 * i + -(-s // 4))) for i, s in enumerate(seq_lens)]
    md = sdpa.SdpaBackend().build_metadata(tables, [s - n for s, n in zip(seq_lens, new)], new, block_size=4)
    # Longest first; a group ends where a context drops below 0.8 x the group's longest.
    groups = [(g.token_indices.tolist(), g.seq_lens.tolist(), g.num_blocks) for g in md.decode_groups]
    assert groups == [([0, 2], [40, 33], 10), ([6], [30], 8), ([1], [6], 2), ([7], [1], 1)]
    assert md.decode_groups[0].block_ids.tolist() == tables[0] + tables[2] + [0]  # padded with block 0
    # The cap on keys per group splits long runs of similar lengths.
    monkeypatch.setattr(sdpa, "DECODE_GROUP_MAX_KEYS", 70)
    md = sdpa.SdpaBackend().build_metadata(tables, [s - n for s, n in zip(seq_lens, new)], new, block_size=4)
    assert [g.token_indices.tolist() for g in md.decode_groups] == [[0], [2, 6], [1], [7]]


@pytest.mark.parametrize("sinks", [None, torch.tensor([2.0, -1.0, 0.25, 6.0, -20.0, 1.0])])
@pytest.mark.parametrize("path", ["kernel", "fused"])
@pytest.mark.parametrize("computed, window", [(0, None), (0, 5), (23, None), (23, 7)])
def test_bfloat16_prompts_on_both_paths(monkeypatch, path, computed, window, sinks):
    # A bfloat16 prompt (whole, or a chunk behind cached tokens) in the C prefill kernel or in
    # torch's fused attention agrees with the float32 oracle to bfloat16's rounding (the float32
    # sinks too: SDPA's bias rounds them to bfloat16, which these are).
    if path == "fused":
        monkeypatch.setattr(cpu_attention, "load", lambda: None)
    gen = torch.Generator().manual_seed(computed)
    reqs = [(computed, 19), (30, 1)]
    tables, k_cache, v_cache, q, k, v = random_step(reqs, 4, 2, 6, 16, gen)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_md = AttentionMetadata.build(tables, [c for c, _ in reqs], [n for _, n in reqs], 4)
    expected = torch_ref.paged_attention(q, k, v, ref_k, ref_v, ref_md, 0.3, window, sinks=sinks)
    bf16 = [t.to(torch.bfloat16) for t in (q, k, v, k_cache, v_cache)]
    md = sdpa.SdpaBackend().build_metadata(tables, [c for c, _ in reqs], [n for _, n in reqs], 4)
    out = sdpa.paged_attention(*bf16, md, 0.3, window, sinks=sinks)
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max().item() < 0.05


def test_sdpa_outputs_in_any_memory_layout(monkeypatch):
    # CUDA's SDPA kernels may return their output with strides that a view cannot merge (its
    # heads not adjacent in memory); the torch path must take any layout of the same values.
    fused = torch.nn.functional.scaled_dot_product_attention

    def scattered(*args, **kwargs):
        o = fused(*args, **kwargs)
        return o.transpose(-3, -2).contiguous().transpose(-3, -2)  # same values, heads not adjacent

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", scattered)
    monkeypatch.setattr(cpu_attention, "load", lambda: None)  # decodes and chunks through SDPA
    gen = torch.Generator().manual_seed(0)
    reqs = [(23, 5), (30, 1), (9, 1)]  # a chunk behind cached tokens, and two decodes
    tables, k_cache, v_cache, q, k, v = random_step(reqs, 4, 2, 6, 16, gen)
    md = sdpa.SdpaBackend().build_metadata(tables, [c for c, _ in reqs], [n for _, n in reqs], 4)
    run_step(q, k, v, k_cache, v_cache, md, tables, reqs, [None, 5])
    run_step(q, k, v, k_cache, v_cache, md, tables, reqs, [None, 5], torch.linspace(-3, 3, 6))


@pytest.mark.parametrize("sink", [-1e4, 1e4])
def test_sinks_at_the_extremes(monkeypatch, sink):
    # A sink far below every score takes no mass (plain attention); one far above takes all of it
    # (outputs 0), with no NaN or inf on either path, however long the prompt (the fallback runs it
    # in runs of new tokens when its bias would be large).
    monkeypatch.setattr(sdpa, "SINK_BIAS_MAX_ELEMENTS", 6 * 40 * 3)  # runs of 2 to 6 new tokens
    gen = torch.Generator().manual_seed(5)
    reqs = [(9, 31), (0, 17), (30, 1), (3, 1)]
    tables, k_cache, v_cache, q, k, v = random_step(reqs, 4, 2, 6, 16, gen)
    sinks = torch.full((6,), sink)
    ref_md = AttentionMetadata.build(tables, [c for c, _ in reqs], [n for _, n in reqs], 4)
    plain = torch_ref.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), ref_md, 0.3, 5)
    for path in ("kernel", "sdpa"):
        with monkeypatch.context() as mp:
            if path == "sdpa":
                mp.setattr(cpu_attention, "load", lambda: None)
            md = sdpa.SdpaBackend().build_metadata(tables, [c for c, _ in reqs], [n for _, n in reqs], 4)
            out = sdpa.paged_attention(q, k, v, k_cache, v_cache, md, 0.3, 5, sinks=sinks)
        assert out.isfinite().all()
        assert (out - (plain if sink < 0 else torch.zeros_like(plain))).abs().max().item() < 1e-5, path

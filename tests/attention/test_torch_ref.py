"""The oracle (attention/torch_ref.py): paged attention against dense attention (paging changes
where K/V live, never the result), with and without sinks (against transformers' gpt-oss eager
attention too), and it shares no code with the backends it checks."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager_attention

from pagedserve.attention.kv_cache import allocate_kv_cache
from pagedserve.attention.metadata import AttentionMetadata, BatchedDecodeMetadata
from pagedserve.attention import torch_ref
from pagedserve.attention.torch_ref import paged_attention

ROOT = Path(__file__).resolve().parents[2]


def dense_attention(q, k, v, context_len: int, scale: float, window: int | None, sinks=None) -> torch.Tensor:
    """Textbook attention for one request in float64: q [new, H, D] at the last positions of a
    context k, v [context_len, KVH, D]; sinks [H]: one more logit per head, with no value."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(context_len - q.shape[0], context_len)[:, None]
    k_pos = torch.arange(context_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    probs = scores.softmax(-1)[..., :context_len]
    return torch.einsum("hqk,khd->qhd", probs, v)


@st.composite
def batches(draw):
    """A mixed step: per request (tokens already cached, new tokens), plus layout choices."""
    reqs = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6))
    # Make sure decodes (1 new token with context) appear often.
    reqs += draw(st.lists(st.tuples(st.integers(1, 40), st.just(1)), max_size=3))
    order = draw(st.permutations(range(len(reqs))))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    kv_heads, group = draw(st.sampled_from([(1, 4), (2, 2), (4, 1), (2, 3)]))
    window = draw(st.sampled_from([None, None, 1, 5]))
    # Sinks: none, or normal logits times this (x 40: some heads all sink, some with none to speak of)
    sink_scale = draw(st.sampled_from([None, None, 1.0, 4.0, 40.0]))
    seed = draw(st.integers(0, 2**16))
    return [reqs[i] for i in order], block_size, kv_heads, group, window, sink_scale, seed


@settings(max_examples=60, deadline=None)
@given(batches())
def test_paged_matches_dense(batch):
    reqs, block_size, kv_heads, group, window, sink_scale, seed = batch
    gen = torch.Generator().manual_seed(seed)
    heads, dim = kv_heads * group, 8
    sinks = None if sink_scale is None else torch.randn(heads, generator=gen) * sink_scale
    seq_lens = [c + n for c, n in reqs]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3  # three blocks nobody owns: they must stay untouched
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used:used + n])
        used += n
    [(k_cache, v_cache, _)] = allocate_kv_cache(1, num_blocks, block_size, kv_heads, dim, torch.float32, "cpu")

    # Full-context K/V per request; the cached part is written straight into its blocks.
    ks = [torch.randn(s, kv_heads, dim, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, kv_heads, dim, generator=gen) for s in seq_lens]
    for table, (computed, _), k, v in zip(tables, reqs, ks, vs):
        for t in range(computed):
            k_cache[table[t // block_size], t % block_size] = k[t]
            v_cache[table[t // block_size], t % block_size] = v[t]
    qs = [torch.randn(n, heads, dim, generator=gen) for _, n in reqs]

    md = AttentionMetadata.build(tables, [c for c, _ in reqs], [n for _, n in reqs], block_size, "cpu")
    new_k = torch.cat([k[c:] for k, (c, _) in zip(ks, reqs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(vs, reqs)])
    out = paged_attention(torch.cat(qs), new_k, new_v, k_cache, v_cache, md, 0.3, window, sinks=sinks)

    expected = torch.cat([dense_attention(q, k, v, s, 0.3, window, sinks) for q, k, v, s in zip(qs, ks, vs, seq_lens)])
    assert (out.double() - expected).abs().max().item() < 1e-5
    # Every request's whole context now sits in its blocks; unowned blocks are still zero.
    for table, k, v, s in zip(tables, ks, vs, seq_lens):
        assert torch.equal(k_cache[table].flatten(0, 1)[:s], k)
        assert torch.equal(v_cache[table].flatten(0, 1)[:s], v)
    spare = perm[used:]
    assert not k_cache[spare].any() and not v_cache[spare].any()


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("cached", [0, 13])
def test_sinks_as_transformers_gpt_oss_eager_attention(cached, window):
    """The oracle with sinks against transformers' own gpt-oss eager attention, in float32: one
    request's new tokens (a whole prompt, or a chunk behind cached tokens) over its context, GQA,
    with an additive causal (and windowed) mask as transformers builds it, sinks of both signs."""
    gen = torch.Generator().manual_seed(cached)
    kv_heads, group, dim, new, block_size = 2, 3, 16, 9, 4
    heads, context = kv_heads * group, cached + new
    q = torch.randn(new, heads, dim, generator=gen) * 2
    k, v = torch.randn(context, kv_heads, dim, generator=gen), torch.randn(context, kv_heads, dim, generator=gen)
    sinks = torch.tensor([3.0, -2.0, 0.5, 9.0, -30.0, 1.5])
    table = torch.randperm(8, generator=gen)[: -(-context // block_size)].tolist()
    [(k_cache, v_cache, _)] = allocate_kv_cache(1, 8, block_size, kv_heads, dim, torch.float32, "cpu")
    for t in range(cached):
        k_cache[table[t // block_size], t % block_size] = k[t]
        v_cache[table[t // block_size], t % block_size] = v[t]
    md = AttentionMetadata.build([table], [cached], [new], block_size, "cpu")
    out = paged_attention(q, k[cached:], v[cached:], k_cache, v_cache, md, dim**-0.5, window, sinks=sinks)

    q_pos, k_pos = torch.arange(cached, context)[:, None], torch.arange(context)[None, :]
    allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=group, training=False)
    expected, _ = gpt_oss_eager_attention(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], mask[None, None], dim**-0.5)
    assert (out - expected[0]).abs().max().item() < 1e-5
    # The sinks matter here: without them the result is another
    plain = paged_attention(q, k[cached:], v[cached:], k_cache.clone(), v_cache.clone(), md, dim**-0.5, window)
    assert (plain - expected[0]).abs().max().item() > 0.1


def test_metadata_by_hand():
    # Request 0 decodes its 6th token; request 1 prefills 3 tokens; request 2 is a 1-token prompt.
    md = BatchedDecodeMetadata.build([[3, 7, 9], [5], [2]], [5, 0, 0], [1, 3, 1], block_size=4)
    assert md.slot_mapping.tolist() == [7 * 4 + 1, 20, 21, 22, 8]
    assert md.positions.tolist() == [5, 0, 1, 2, 0]
    assert md.block_tables.tolist() == [[3, 7], [5, 0], [2, 0]]  # trimmed to need, padded with 0
    assert md.seq_lens.tolist() == [6, 3, 1]
    assert md.query_start_loc.tolist() == [0, 1, 4, 5]
    assert md.logits_indices.tolist() == [0, 3, 4]
    assert md.decode_token_indices.tolist() == [0, 4]
    assert md.decode_block_tables.tolist() == [[3, 7], [2, 0]]
    assert md.decode_seq_lens.tolist() == [6, 1]
    assert md.prefill_req_indices == [1]
    assert (md.num_tokens, md.num_reqs, md.num_decodes, md.max_query_len, md.max_seq_len) == (5, 3, 2, 3, 6)


@pytest.mark.parametrize(
    "tables, computed, new, match",
    [
        ([[0]], [4], [1], "need 2 blocks"),  # 5 tokens, block size 4
        ([[0]], [0], [0], "at least one new token"),
        ([[0], [1]], [0], [1, 1], "one block table"),
        ([], [], [], "at least one request"),
    ],
)
def test_metadata_rejects_inconsistent_steps(tables, computed, new, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(tables, computed, new, block_size=4)


# What the oracle may import from pagedserve: fp8 rounding and the step's inputs, nothing that computes attention.
ORACLE_MAY_IMPORT = {"pagedserve.attention.kv_quant", "pagedserve.attention.metadata"}


def imported_modules(source: str) -> set[str]:
    """Every module an `import` or `from ... import` in source names, the names imported from a
    package counted as its submodules (`from pagedserve.attention import sdpa` -> ...attention.sdpa)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def test_the_oracle_imports_no_backend_code():
    imported = imported_modules(inspect.getsource(torch_ref))
    ours = {m for m in imported if m.startswith(("pagedserve", "."))}
    # `from pagedserve.attention.kv_quant import quantize` names ...kv_quant.quantize too: not a module.
    stray = {m for m in ours if not any(m == ok or m.startswith(ok + ".") for ok in ORACLE_MAY_IMPORT)}
    assert not stray, f"torch_ref must not use production attention code: {sorted(stray)}"
    assert {"pagedserve.attention.kv_quant", "pagedserve.attention.metadata"} <= imported  # the check sees imports
    assert imported_modules("from pagedserve.attention import sdpa\nimport pagedserve.attention.kv_cache") >= {
        "pagedserve.attention.sdpa", "pagedserve.attention.kv_cache"}


def test_importing_the_oracle_loads_no_backend():
    """At run time too: importing torch_ref (and the package it sits in) loads no backend module."""
    code = ("import sys, pagedserve.attention.torch_ref; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('pagedserve.attention'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = set(result.stdout.split())
    assert "pagedserve.attention.torch_ref" in loaded
    assert loaded <= {"pagedserve.attention", "pagedserve.attention.torch_ref"} | ORACLE_MAY_IMPORT, loaded

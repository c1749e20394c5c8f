"""The decode-graph path (worker/cuda_graphs.py) without a GPU: the static buffers, the padding and
the Triton kernels it relies on run eagerly (capture=False) under Triton's interpreter; capture
itself needs CUDA (scripts/gpu_check.py)."""

from __future__ import annotations

import torch

from pagedserve.attention import get_backend
from pagedserve.attention.kv_cache import KVCache, allocate_kv_cache
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.models.loader import load_model
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.cuda_graphs import DecodeGraphs, capture_sizes


def test_capture_sizes_cover_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(300)[-2:] == [288, 320]
    assert capture_sizes(5000)[-1] == 5000  # beyond the list: one graph of exactly max_num_seqs


def triton_md(tables, computed, new, block_size):
    return get_backend("triton").build_metadata(tables, computed, new, block_size)


def test_padded_decode_changes_no_real_row(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")  # GQA, q/k norm, a sliding-window layer
    model, config = load_model(str(path))
    with torch.inference_mode():
        check_padded_decode(model, config)


def check_padded_decode(model, config):
    block_size, lens = 8, [5, 11, 17, 3, 9]
    caches = allocate_kv_cache(config.num_layers, 40, block_size, config.num_kv_heads, config.head_dim, torch.float32)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [perm[4 * i: 4 * i + 4] for i in range(len(lens))]
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(config.vocab_size, (sum(lens),), generator=gen)
    md = triton_md(tables, [0] * len(lens), lens, block_size)
    model(prompt_ids, md.positions, caches, md)

    decode = triton_md(tables, lens, [1] * len(lens), block_size)
    ids = torch.randint(config.vocab_size, (len(lens),), generator=gen)
    ref_caches = [KVCache(c.k.clone(), c.v.clone(), c.scales) for c in caches]
    expected = model(ids, decode.positions, ref_caches, decode)

    graphs = DecodeGraphs(model, caches, [1, 2, 4, 8], max_blocks=6, block_size=block_size,
                          backend=get_backend("triton"), device=torch.device("cpu"), capture=False)
    # Stale buffers, as a larger earlier step leaves them.
    graphs.block_tables.random_(0, 40, generator=gen)
    graphs.positions.fill_(7)
    graphs.slot_mapping.fill_(3)
    graphs.seq_lens.fill_(30)
    assert graphs.can_run(decode) and not graphs.can_run(md)
    got = graphs.run(ids, decode)  # 5 decodes run as 8: three padded rows
    assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-5
    for cache, ref in zip(caches, ref_caches):  # the padded rows wrote no slot
        assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)


def test_an_engine_on_the_triton_backend_gives_the_torch_backends_tokens(tiny_checkpoint, embedded_tokenizer):
    # A tiny model: the interpreter runs every kernel program in Python (the embedded model's
    # shapes are test_triton_paged's), yet the engine's whole path: prompts, then decode steps
    # through the graphs' static buffers (sizes 1, 2, 4), run eagerly.
    path, _ = tiny_checkpoint("llama")
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 128, (n,), generator=gen).tolist()} for n in (5, 21, 40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def make_llm(**options) -> LLM:
        config = EngineConfig(model=str(path), num_kv_blocks=64, **options)
        return LLM.from_engine(LLMEngine(config, tokenizer=embedded_tokenizer))

    with make_llm(attention_backend="torch") as torch_llm:
        expected = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, params, use_tqdm=False)]
    with make_llm(attention_backend="triton", max_num_seqs=3) as triton_llm:
        engine = triton_llm.llm_engine
        assert engine.config.attention_backend == "triton"
        runner = engine.runner
        runner.capture_decode_graphs(engine.max_model_len, capture=False)
        graph_steps = []
        run = runner.decode_graphs.run
        runner.decode_graphs.run = lambda ids, md: graph_steps.append(md.num_reqs) or run(ids, md)
        got = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params, use_tqdm=False)]
        assert runner.decode_graphs.sizes == [1, 2, 4] and 3 in graph_steps  # 3 decodes padded to 4
        assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert got == expected

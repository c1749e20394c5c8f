"""CPU decode replays (worker/cpu_graphs.py): a replay computes bit for bit what the eager forward
computes, for any number of requests up to its size and over stale buffers; a forward that does
anything outside the C kernels is not recorded; the intermediates share one arena; a weight
written after the recording ends the replays; an engine's greedy output is the same with and
without them; and recording imports no torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedserve.attention import get_backend
from pagedserve.attention.kv_cache import KVCache, allocate_kv_cache
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.lora.layers import attach, load_slot
from pagedserve.models.loader import load_model
from pagedserve.ops import cpu_attention, cpu_linear, native
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker import cpu_graphs
from pagedserve.worker.cpu_graphs import CpuDecodeGraph, NotRecordable, _Watch
from tests.lora.test_layers import adapters_for
from tests.models.test_attention_sinks import ours, reference_with_sinks

BLOCK, NUM_BLOCKS, MAX_BLOCKS = 8, 48, 6


def torch_md(tables, computed, new):
    return get_backend("torch").build_metadata(tables, computed, new, BLOCK)


def graph_over(model, caches, size=8):
    return CpuDecodeGraph.build(model, caches, size, MAX_BLOCKS, BLOCK, get_backend("torch"))


def prefilled(model, config, lens, dtype, seed=0):
    """Caches holding prompts of `lens` tokens (blocks in random order, block 0 left free), and their tables."""
    caches = allocate_kv_cache(config.num_layers, NUM_BLOCKS, BLOCK, config.num_kv_heads, config.head_dim, dtype)
    gen = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    tables = [perm[MAX_BLOCKS * i: MAX_BLOCKS * (i + 1)] for i in range(len(lens))]
    md = torch_md(tables, [0] * len(lens), lens)
    model(torch.randint(config.vocab_size, (sum(lens),), generator=gen), md.positions, caches, md)
    return caches, tables


def copies(caches):
    return [KVCache(c.k.clone(), c.v.clone(), c.scales) for c in caches]


def expected_recordable(arch: str, dtype: torch.dtype) -> bool:
    """Every matmul of a step must have the C kernel for that dtype (every architecture's other
    steps have theirs: q/k norms, Gemma's norms, activation and embedding scale included)."""
    x, w = torch.zeros(1, 64, dtype=dtype), torch.zeros(64, 64, dtype=dtype)
    return cpu_linear.supports(x, w)


# A replay is a recording of C calls, so it exists only where every matmul has its C kernel
# (csrc/linear.c: AVX-512, or AVX2 with FMA); elsewhere `build` refuses to record, as the tests above
# and below check.
needs_replays = pytest.mark.skipif(not expected_recordable("llama", torch.float32),
                                   reason="this CPU has no C float32 matmul (csrc/linear.c needs AVX-512 or AVX2): no replays")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replays_equal_the_eager_forward_bit_for_bit(arch, dtype, tiny_checkpoint):
    path, _ = tiny_checkpoint(arch)
    model, config = load_model(str(path), dtype=dtype)
    lens = [5, 11, 17, 3, 9, 30]
    with torch.inference_mode():
        caches, tables = prefilled(model, config, lens, dtype)
        before = copies(caches)
        graph = graph_over(model, caches)
        if not expected_recordable(arch, dtype):
            assert graph is None
            return
        assert graph is not None
        for cache, ref in zip(caches, before):  # recording put back what it wrote
            assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)
        gen = torch.Generator().manual_seed(1)
        # All six requests, then three of them, then one: each time over the buffers the last left.
        for rows in ([0, 1, 2, 3, 4, 5], [4, 0, 2], [3]):
            md = torch_md([tables[r] for r in rows], [lens[r] for r in rows], [1] * len(rows))
            ids = torch.randint(config.vocab_size, (len(rows),), generator=gen)
            reference = copies(caches)
            expected = model(ids, md.positions, reference, md)
            assert graph.can_run(md)
            got = graph.run(ids, md)
            assert got.dtype == dtype and torch.equal(got, expected)
            for cache, ref in zip(caches, reference):  # the same K/V written into the same slots
                assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)
            for r in rows:
                lens[r] += 1


@needs_replays
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replays_add_each_rows_lora_delta_bit_for_bit(dtype, tiny_checkpoint):
    """The deltas are C calls like the others: recorded once, replayed with the slots each step sets,
    and with the weights a slot holds at the time (a load writes in place)."""
    model, config = load_model(str(tiny_checkpoint("llama")[0]), dtype=dtype)
    if not expected_recordable("llama", dtype):
        pytest.skip(f"no C matmul for {dtype} here")
    batch = attach(model, num_slots=3, max_rank=16, capacity=128)
    adapters = adapters_for(model, 16)
    for slot, weights in enumerate(adapters[:2]):
        load_slot(model, slot, weights)
    lens = [5, 11, 17, 3, 9, 30]
    with torch.inference_mode():
        batch.set([0] * sum(lens))
        caches, tables = prefilled(model, config, lens, dtype)
        graph = graph_over(model, caches)
        assert graph is not None
        kind = cpu_graphs.KINDS["lora_add"][0]
        assert sum(call.kind == kind for call in graph.calls) == 4 * config.num_layers
        gen = torch.Generator().manual_seed(1)
        steps = [([0, 1, 2, 3, 4, 5], [0, 1, -1, 2, 0, 1]), ([4, 0, 2], [1, -1, 1]), ([3, 5], [2, 0]), ([1], [-1])]
        for i, (rows, slots) in enumerate(steps):
            if i == 2:
                load_slot(model, 2, adapters[0])  # after the recording: the replay reads it
            md = torch_md([tables[r] for r in rows], [lens[r] for r in rows], [1] * len(rows))
            ids = torch.randint(config.vocab_size, (len(rows),), generator=gen)
            batch.clear()
            base = model(ids, md.positions, copies(caches), md)
            batch.set(slots)
            reference = copies(caches)
            expected = model(ids, md.positions, reference, md)
            got = graph.run(ids, md)
            assert torch.equal(got, expected)
            for cache, ref in zip(caches, reference):
                assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)
            for r, slot in enumerate(slots):  # a row with an adapter moved; a base row, or an empty slot's, did not
                assert torch.equal(got[r], base[r]) == (slot < 0 or (slot == 2 and i < 2))
            for r in rows:
                lens[r] += 1


@needs_replays
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replays_with_sinks_equal_the_eager_forward_bit_for_bit(dtype):
    """A layer's sinks are a pointer of its decode attention call: recorded, replayed as they are."""
    model, config = ours(reference_with_sinks("llama"), dtype)
    if not expected_recordable("llama", dtype):
        pytest.skip(f"no C matmul for {dtype} here")
    lens = [5, 11, 17, 3]
    with torch.inference_mode():
        caches, tables = prefilled(model, config, lens, dtype)
        graph = graph_over(model, caches)
        assert graph is not None
        kind = cpu_graphs.KINDS["paged_decode_attention"][0]
        assert [call.ints[19] for call in graph.calls if call.kind == kind] == [
            layer.self_attn.sinks.data_ptr() for layer in model.model.layers]
        md = torch_md(tables, lens, [1] * len(lens))
        ids = torch.randint(config.vocab_size, (len(lens),), generator=torch.Generator().manual_seed(1))
        reference = copies(caches)
        expected = model(ids, md.positions, reference, md)
        assert torch.equal(graph.run(ids, md), expected)
        for cache, ref in zip(caches, reference):
            assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)


def test_replays_call_each_kernel_with_the_parameters_it_is_loaded_with():
    """csrc/replay.c casts each recorded function to a type of its own: that type's parameters must
    be the ones the kernel's ctypes declaration (and so the recording) gives, or the replay passes
    its arguments in the wrong places (the compiler cannot see across the cast)."""
    import ctypes
    import re

    from pagedserve.models import quantized
    from pagedserve.ops import fused_cpu, lora_cpu

    libraries = [cpu_linear.load(), fused_cpu.load(), cpu_attention.load(), quantized.load(), lora_cpu.load()]
    assert all(lib is not None for lib in libraries)
    source = (native.CSRC / "replay.c").read_text()
    typedefs = {name: params for name, params in re.findall(r"typedef \w+ (\w+)_fn\(([^)]*)\);", source)}

    def c_kind(param: str) -> str:
        param = param.strip()
        if "*" in param:
            return "pointer"
        return {"int64_t": "i64", "int": "i32", "float": "float"}[param.replace("const ", "")]

    def ctypes_kind(t) -> str:
        if t is ctypes.c_void_p:
            return "pointer"
        return "float" if t is ctypes.c_float else f"i{8 * ctypes.sizeof(t)}"

    for name in cpu_graphs.KINDS:
        fn = next(getattr(lib, name) for lib in libraries if hasattr(lib, name))
        typedef = name if name in typedefs else next(t for t in typedefs if name.endswith("_" + t))
        assert [c_kind(p) for p in typedefs[typedef].split(",")] == [ctypes_kind(t) for t in fn.argtypes], name


@needs_replays
def test_what_a_replay_cannot_run(tiny_checkpoint):
    model, config = load_model(str(tiny_checkpoint("llama")[0]))
    with torch.inference_mode():
        caches, tables = prefilled(model, config, [5, 40, 3], torch.float32)
        graph = graph_over(model, caches, size=2)
    assert graph.can_run(torch_md(tables[:2], [5, 40], [1, 1]))
    assert not graph.can_run(torch_md(tables[:2], [5, 40], [2, 1]))  # a prompt token
    assert not graph.can_run(torch_md(tables, [5, 40, 3], [1, 1, 1]))  # more requests than its size
    assert not graph.can_run(torch_md([tables[1] + [0] * 4], [70], [1]))  # a table wider than its buffers


@needs_replays
def test_a_weight_written_after_the_recording_ends_the_replays(tiny_checkpoint):
    model, config = load_model(str(tiny_checkpoint("llama")[0]))
    with torch.inference_mode():
        caches, tables = prefilled(model, config, [5, 7], torch.float32)
        graph = graph_over(model, caches)
        md = torch_md(tables, [5, 7], [1, 1])
        assert graph.can_run(md)
        model.model.layers[1].mlp.down_proj.weight.mul_(2)
        assert not graph.can_run(md)


@needs_replays
def test_a_replay_in_the_checked_build_refuses_a_block_id_outside_the_pool(tiny_checkpoint, monkeypatch):
    checked = cpu_attention.load(tuple(native.build_flags("paged_attention", checks=True)))
    monkeypatch.setattr(cpu_attention, "load", lambda: checked)  # the recording notes the checked kernel
    model, config = load_model(str(tiny_checkpoint("llama")[0]))
    with torch.inference_mode():
        caches, tables = prefilled(model, config, [5, 20], torch.float32)
        graph = graph_over(model, caches)
        ids = torch.tensor([1, 2])
        graph.run(ids, torch_md(tables, [5, 20], [1, 1]))
        tables[1][0] = NUM_BLOCKS  # one past the pool's last block, in a block the step only reads
        with pytest.raises(RuntimeError, match=r"\(paged_decode_attention\) failed"):
            graph.run(ids, torch_md(tables, [5, 20], [1, 1]))


def test_forward_work_outside_the_kernels_is_not_recorded(tiny_checkpoint, monkeypatch):
    model, config = load_model(str(tiny_checkpoint("llama")[0]))
    norm = model.model.norm
    monkeypatch.setattr(norm, "forward", lambda x, residual: (norm.norm(x + residual), x + residual))  # torch ops
    caches = allocate_kv_cache(config.num_layers, NUM_BLOCKS, BLOCK, config.num_kv_heads, config.head_dim,
                               torch.float32)
    assert graph_over(model, caches) is None


def test_the_watch_lets_through_allocations_and_views_only():
    x = torch.zeros(4, 6)
    with _Watch() as watch:
        y = torch.empty(3)
        x.view(6, 4)
        x[1:3].split([2, 4], dim=1)
    assert [t.data_ptr() for t in watch.allocations] == [y.data_ptr()]
    for work in (lambda: x.add_(1), lambda: x + 1, lambda: x[0, 0].item(), lambda: x.t().contiguous()):
        with pytest.raises(NotRecordable), _Watch():
            work()


@needs_replays
def test_the_intermediates_share_one_arena(embedded_model):
    model, config = embedded_model
    caches = allocate_kv_cache(config.num_layers, 64, 16, config.num_kv_heads, config.head_dim, torch.float32)
    with torch.inference_mode():
        graph = CpuDecodeGraph.build(model, caches, 128, 8, 16, get_backend("torch"))
    rows, floats = 128, 4
    # Every layer allocates at least its fused q/k/v output and its gate/up output for each row,
    # and the largest of those must fit in the arena whole.
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    gate_up = 2 * config.intermediate_size
    assert graph.intermediate_bytes >= config.num_layers * rows * (qkv + gate_up) * floats
    assert graph.arena.numel() >= rows * gate_up * floats
    # Shared: the arena holds less than one layer's share of what the forward allocated.
    assert graph.arena.numel() < graph.intermediate_bytes / config.num_layers


@pytest.mark.slow
def test_an_engine_gives_the_same_tokens_with_and_without_replays(monkeypatch):
    prompts = [list(range(10 + i, 40 + 5 * i)) for i in range(6)]
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    runs, replayed = [], []
    real_run = CpuDecodeGraph.run

    def counted(self, input_ids, md):
        replayed.append(md.num_reqs)
        return real_run(self, input_ids, md)

    monkeypatch.setattr(cpu_graphs.CpuDecodeGraph, "run", counted)
    recordable = expected_recordable("llama", torch.float32)
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(enforce_eager=eager, max_num_seqs=4))
        assert (engine.runner.decode_graphs is None) == (eager or not recordable)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        runs.append(done)
        assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks  # nothing leaks
    assert runs[0] == runs[1] and len(runs[0]) == 6
    if recordable:
        assert len(replayed) > 20 and set(replayed) >= {1, 4}
    else:
        assert not replayed


@pytest.mark.slow
def test_an_engine_that_records_its_decode_steps_never_imports_dynamo():
    """torch._dynamo takes about 0.65 s to import, and nothing on CPU compiles: building an engine
    (model on the meta device, RoPE table, decode recording where the CPU allows one) and serving a request leaves it
    unimported (a fresh process, so that no other test's import counts)."""
    code = ("import sys; from pagedserve.engine.llm_engine import LLMEngine; "
            "from pagedserve.config import EngineConfig; from pagedserve.sampling_params import SamplingParams; "
            "engine = LLMEngine(EngineConfig()); "
            f"assert (engine.runner.decode_graphs is not None) == {expected_recordable('llama', torch.float32)}; "
            "engine.add_request('0', [1, 2, 3], "
            "SamplingParams(max_tokens=4)); [engine.step() for _ in range(4)]; "
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

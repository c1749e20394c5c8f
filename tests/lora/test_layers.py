"""The adapters' slots on the model (lora/layers.py): a stack's delta in torch and in C against a
per-row float64 reference and against each other; the per-token slots' buffer; a model whose
tokens use different adapters (and none) in one step against copies of it with each adapter merged
into the weights; clearing a slot; and how long loading one takes."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from pagedserve.lora.layers import LoRABatch, LoRAStack, attach, clear_slot, detach, load_slot
from pagedserve.models.loader import load_model
from pagedserve.ops import lora_cpu
from tests.ops.test_lora_cpu import CASES, assert_close, random_adapters, reference

DTYPES = [torch.float32, torch.bfloat16]
FUSED = {"qkv_proj": ("self_attn", 3), "o_proj": ("self_attn", 1), "gate_up_proj": ("mlp", 2),
         "down_proj": ("mlp", 1)}


@dataclass
class Weights:
    """LoRAWeights' fields (lora/weights.py), built here: (layer, fused module) -> per part (A, B) or None."""

    path: str
    rank: int
    modules: dict[tuple[int, str], list[tuple[Tensor, Tensor] | None]]


def stack_with(adapters, in_features, widths, rank, dtype, capacity=400, num_slots=4) -> LoRAStack:
    stack = LoRAStack(LoRABatch(capacity, num_slots, "cpu"), in_features, widths, rank, dtype)
    for slot, adapter in enumerate(adapters):
        stack.set_slot(slot, adapter)
    return stack


def delta_both_ways(stack: LoRAStack, x: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
    """(out + delta) by the C kernel, and by the torch path."""
    by_kernel, by_torch = out.clone(), out.clone()
    assert stack.use_kernel
    stack.add_to(x, by_kernel)
    stack.use_kernel = False
    try:
        stack.add_to(x, by_torch)
    finally:
        stack.use_kernel = True
    return by_kernel, by_torch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [0, 1, 9, 300])
def test_torch_and_c_paths_match_the_reference_and_each_other(dtype, case, rows):
    in_features, widths, ranks, max_rank = CASES[case]
    adapters = random_adapters(in_features, widths, ranks, dtype, seed=rows)
    stack = stack_with(adapters, in_features, widths, max_rank, dtype)
    gen = torch.Generator().manual_seed(rows)
    slots = torch.randint(-1, 4, (rows,), generator=gen).tolist()  # slot 3 holds no adapter
    stack.batch.set(slots)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    out = torch.randn(rows, sum(widths), generator=gen).to(dtype)
    by_kernel, by_torch = delta_both_ways(stack, x, out)
    expected, magnitude = reference(x, out, slots, adapters, widths)
    assert_close(by_kernel, expected, magnitude, in_features + max_rank)
    if dtype == torch.float32:
        assert_close(by_torch, expected, magnitude, in_features + max_rank)
        # and so to each other: within the sum of their bounds
        bound = 2 * (in_features + max_rank + 2) * 2.0**-24 * magnitude
        assert ((by_kernel.double() - by_torch.double()).abs() <= bound).all()
    else:  # torch rounds x A^T and the delta to bfloat16 before the sum: a few steps of 2^-8
        excess = (by_torch.double() - expected).abs() - 2.0**-6 * magnitude
        assert (excess <= 0).all(), excess.max()
        assert ((by_kernel.double() - by_torch.double()).abs() <= 2.0**-6 * magnitude + 2.0**-8 * expected.abs()).all()
    base = [r for r, s in enumerate(slots) if s in (-1, 3)]
    assert torch.equal(by_kernel[base], out[base]) and torch.equal(by_torch[base], out[base])


def test_a_stack_reads_the_first_rows_of_the_batch():
    """x's rows are the batch's first: a set of 8 serves a call of 5 rows, and rows past a set are -1."""
    in_features, widths, ranks, max_rank = CASES["q k v"]
    adapters = random_adapters(in_features, widths, ranks, torch.float32, seed=1)
    stack = stack_with(adapters, in_features, widths, max_rank, torch.float32)
    stack.batch.set([0, 1, 2, 0, 1, 2, 0, 1])
    stack.batch.set([2, -1, 1, 0, 2])
    x, out = torch.randn(8, in_features), torch.randn(8, 80)
    by_kernel, by_torch = delta_both_ways(stack, x, out)
    expected, magnitude = reference(x, out, [2, -1, 1, 0, 2, -1, -1, -1], adapters, widths)
    for got in (by_kernel, by_torch):
        assert_close(got, expected, magnitude, in_features + max_rank)
    assert torch.equal(by_kernel[5:], out[5:]) and torch.equal(by_torch[5:], out[5:])


def test_the_batch_keeps_its_buffer_and_refuses_what_does_not_fit():
    batch = LoRABatch(6, 3, "cpu")
    address = batch.slots.data_ptr()
    batch.set([0, 2, -1, 1])
    assert batch.slots.tolist() == [0, 2, -1, 1, -1, -1]
    batch.clear(2)
    assert batch.slots.tolist() == [-1, -1, -1, 1, -1, -1] and batch.groups(6).dest.tolist() == [3]
    batch.set([1] * 6)
    batch.clear()
    assert batch.slots.tolist() == [-1] * 6 and batch.groups(6) is None
    for bad in ([0] * 7, [3], [-2]):
        with pytest.raises(ValueError):
            batch.set(bad)
    assert batch.slots.data_ptr() == address


def test_a_slot_that_does_not_fit_is_refused_and_left_as_it_was():
    in_features, widths, ranks, max_rank = CASES["gate up"]
    adapters = random_adapters(in_features, widths, ranks, torch.float32, seed=2)
    stack = stack_with(adapters, in_features, widths, max_rank, torch.float32)
    at, bt, ranks_before = stack.at.clone(), stack.bt.clone(), stack.ranks.clone()
    a, b = adapters[0][0]
    for parts in ([(a, b)],  # one part of two
                  [(a, b), (a[:, 1:], b)],  # A narrower than the inputs
                  [(a, b), (torch.zeros(17, in_features), torch.zeros(130, 17))]):  # past the max rank
        with pytest.raises(ValueError):
            stack.set_slot(0, parts)
    with pytest.raises(ValueError):
        stack.set_slot(4, None)  # no such slot
    assert torch.equal(stack.at, at) and torch.equal(stack.bt, bt) and torch.equal(stack.ranks, ranks_before)


def test_the_cpu_kernel_off_sends_stacks_to_torch(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNEL", "0")
    lora_cpu.load.cache_clear()
    try:
        stack = LoRAStack(LoRABatch(4, 2, "cpu"), 8, (8,), 4, torch.float32)
        assert not stack.use_kernel
    finally:
        monkeypatch.delenv("PAGEDSERVE_CPU_KERNEL")
        lora_cpu.load.cache_clear()
    assert LoRAStack(LoRABatch(4, 2, "cpu"), 8, (8,), 4, torch.float32).use_kernel
    assert not LoRAStack(LoRABatch(4, 2, "cpu"), 8, (8,), 4, torch.float16).use_kernel


# --- on a model ---------------------------------------------------------------------------------

def fused_linear(model, layer: int, name: str):
    return getattr(getattr(model.model.layers[layer], FUSED[name][0]), name)


def part_widths(model, layer: int, name: str) -> tuple[int, ...]:
    attn, hidden, inter = model.model.layers[layer].self_attn, model.config.hidden_size, model.shard.intermediate_size
    return {"qkv_proj": (attn.q_size, attn.kv_size, attn.kv_size), "o_proj": (hidden,), "gate_up_proj": (inter, inter),
            "down_proj": (hidden,)}[name]


def random_weights(model, targets: dict[str, int], layers: list[int], seed: int) -> Weights:
    """An adapter on `layers` with `targets` {fused module: rank per part, 0 for a part left alone},
    its values large enough to move the logits well past the comparison's tolerance."""
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for i in layers:
        for name, part_ranks in targets.items():
            linear = fused_linear(model, i, name)
            parts = []
            for rank, width in zip(part_ranks, part_widths(model, i, name)):
                if rank == 0:
                    parts.append(None)
                    continue
                a = torch.randn(rank, linear.in_features, generator=gen) / linear.in_features**0.5
                parts.append((a, torch.randn(width, rank, generator=gen) * 0.3))
            modules[(i, name)] = parts
    return Weights(f"random-{seed}", max(max(r) for r in targets.values()), modules)


def merged_into(model, weights: Weights):
    """`model` with W + B @ A in each fused linear's part columns, as PEFT's merge computes it."""
    with torch.no_grad():
        for (i, name), parts in weights.modules.items():
            weight, start = fused_linear(model, i, name).weight, 0
            for width, part in zip(part_widths(model, i, name), parts):
                if part is not None:
                    weight[start:start + width] += part[1] @ part[0]
                start += width
    return model


def adapters_for(model, max_rank: int) -> list[Weights]:
    """Three adapters: every projection at the max rank; q and v only, at a lower rank; one layer's MLP."""
    layers = list(range(len(model.model.layers)))
    return [random_weights(model, {"qkv_proj": [max_rank] * 3, "o_proj": [max_rank], "gate_up_proj": [max_rank] * 2,
                                   "down_proj": [max_rank]}, layers, seed=10),
            random_weights(model, {"qkv_proj": [5, 0, 5]}, layers, seed=11),
            random_weights(model, {"gate_up_proj": [3, 7], "down_proj": [4]}, layers[-1:], seed=12)]


def step(harness, requests: list[tuple[object, list[int], int]]) -> list[Tensor]:
    """One forward of the requests (name, tokens, slot) together, each token in its request's slot."""
    batch = getattr(harness.model, "lora_batch", None)
    if batch is not None:
        batch.set([slot for _, tokens, slot in requests for _ in tokens])
    return harness.step([(name, tokens) for name, tokens, _ in requests])


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_tokens_of_each_adapter_get_the_merged_models_logits(path, tiny_checkpoint, paged_harness):
    checkpoint = str(tiny_checkpoint("llama")[0])
    model, config = load_model(checkpoint)
    attach(model, num_slots=4, max_rank=16, capacity=64)
    adapters = adapters_for(model, 16)
    for slot, weights in enumerate(adapters):
        load_slot(model, slot, weights)
    if path == "torch":
        for layer in model.model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                linear.lora.use_kernel = False
    gen = torch.Generator().manual_seed(3)
    prompts = {name: torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()
               for name, n in (("a", 7), ("b", 5), ("c", 9), ("base", 6), ("a2", 4))}
    slot_of = {"a": 0, "b": 1, "c": 2, "base": -1, "a2": 0}
    harness = paged_harness(model, config, block_size=4, num_blocks=64)
    # A prefill step of all five, then two decode steps: every token in its request's slot.
    steps = [[(n, prompts[n], slot_of[n]) for n in prompts]]
    got = dict(zip(prompts, step(harness, steps[0])))
    decodes = {n: [int(got[n][-1].argmax())] for n in prompts}
    more = step(harness, [(n, decodes[n], slot_of[n]) for n in prompts])

    plain = paged_harness(load_model(checkpoint)[0], config, block_size=4, num_blocks=64)
    base_rows = step(plain, [(n, prompts[n], -1) for n in prompts])
    base_more = step(plain, [(n, decodes[n], -1) for n in prompts])
    for name, slot in slot_of.items():
        i = list(prompts).index(name)
        if slot < 0:  # the base model's rows: exactly the plain model's
            assert torch.equal(got[name], base_rows[i]) and torch.equal(more[i], base_more[i])
            continue
        merged = paged_harness(merged_into(load_model(checkpoint)[0], adapters[slot]), config, 4, 64)
        expected = step(merged, [(name, prompts[name], -1)])[0]
        expected_more = step(merged, [(name, decodes[name], -1)])[0]
        assert (got[name] - expected).abs().max() < 1e-4
        assert (more[i] - expected_more).abs().max() < 1e-4
        assert (got[name] - base_rows[i]).abs().max() > 0.05  # the adapter changed the logits


def test_a_cleared_slot_gives_the_base_models_output(tiny_checkpoint, paged_harness):
    checkpoint = str(tiny_checkpoint("llama")[0])
    model, config = load_model(checkpoint)
    attach(model, num_slots=2, max_rank=8, capacity=32)
    for slot, weights in enumerate(adapters_for(model, 8)[:2]):
        load_slot(model, slot, weights)
    tokens = torch.randint(3, config.vocab_size, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    requests = [("x", tokens, 0), ("y", tokens, 1)]
    plain = step(paged_harness(load_model(checkpoint)[0], config, 4, 32), requests)
    with_both = step(paged_harness(model, config, 4, 32), requests)
    assert all((w - p).abs().max() > 0.05 for w, p in zip(with_both, plain))
    clear_slot(model, 0)
    cleared = step(paged_harness(model, config, 4, 32), requests)
    assert torch.equal(cleared[0], plain[0]) and torch.equal(cleared[1], with_both[1])


def test_attach_once_and_adapters_that_do_not_fit(tiny_checkpoint):
    model, _ = load_model(str(tiny_checkpoint("llama")[0]))
    batch = attach(model, num_slots=2, max_rank=8, capacity=16)
    assert model.lora_batch is batch
    qkv = model.model.layers[0].self_attn.qkv_proj.lora
    assert qkv.part_widths == (64, 32, 32) and qkv.in_features == 64 and qkv.batch is batch
    assert model.model.layers[1].mlp.down_proj.lora.part_widths == (64,)
    assert model.model.layers[1].mlp.down_proj.lora.in_features == 96
    with pytest.raises(ValueError, match="already"):
        attach(model, 2, 8, 16)
    good = adapters_for(model, 8)[0]
    load_slot(model, 1, good)
    before = qkv.at.clone()
    too_deep = adapters_for(model, 16)[0]  # rank 16 on stacks of 8
    elsewhere = Weights("x", 4, {(7, "qkv_proj"): good.modules[(0, "qkv_proj")]})  # a layer the model lacks
    for weights in (too_deep, elsewhere):
        with pytest.raises(ValueError):
            load_slot(model, 1, weights)
    assert torch.equal(qkv.at, before)  # nothing written
    with pytest.raises(ValueError):
        load_slot(model, 2, good)
    detach(model)
    assert model.lora_batch is None and model.model.layers[0].self_attn.qkv_proj.lora is None
    with pytest.raises(ValueError, match="no LoRA slots"):
        clear_slot(model, 0)


@pytest.mark.timing
def test_loading_an_adapter_into_a_slot_is_fast(embedded_model, capsys):
    """Rank 16 on all seven projections of the embedded model's 30 layers: well under 100 ms."""
    model, _ = embedded_model
    attach(model, num_slots=8, max_rank=16, capacity=256)
    try:
        targets = {"qkv_proj": [16] * 3, "o_proj": [16], "gate_up_proj": [16] * 2, "down_proj": [16]}
        weights = random_weights(model, targets, list(range(len(model.model.layers))), seed=5)
        seconds = []
        for slot in range(3):
            start = time.perf_counter()
            load_slot(model, slot, weights)
            seconds.append(time.perf_counter() - start)
        with capsys.disabled():
            print(f"\nload_slot: {min(seconds) * 1e3:.1f} ms")
        assert min(seconds) < 0.1
    finally:
        detach(model)

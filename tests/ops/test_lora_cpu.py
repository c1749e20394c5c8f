"""The batched LoRA delta on CPU (ops/lora_cpu.py, csrc/lora.c) against a per-row float64 reference
written here: mixed slots and base rows, ranks below the stack's, parts of unequal widths and parts
an adapter leaves alone, from no row to more rows than threads, float32 and bfloat16; a row's delta
does not depend on the other rows or on the number of threads."""

from __future__ import annotations

import pytest
import torch

from pagedserve.ops import lora_cpu

DTYPES = [torch.float32, torch.bfloat16]
# Adapter parts: (A [rank, in], B [width, rank]) per part of a fused linear, None where it has none.
Adapter = list[tuple[torch.Tensor, torch.Tensor] | None]


@pytest.fixture(autouse=True)
def built():
    assert lora_cpu.load() is not None, "the LoRA kernel must build wherever the tests run"


def random_adapters(in_features: int, widths: tuple[int, ...], ranks: list[list[int]], dtype: torch.dtype,
                    seed: int) -> list[Adapter]:
    """One adapter per entry of `ranks` (its rank per part, 0: the part is not targeted), values
    rounded to `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    return [[None if r == 0 else ((torch.randn(r, in_features, generator=gen) / in_features**0.5).to(dtype),
                                  torch.randn(w, r, generator=gen).to(dtype))
             for r, w in zip(part_ranks, widths)] for part_ranks in ranks]


def reference(x: torch.Tensor, out: torch.Tensor, slots: list[int], adapters: list[Adapter],
              widths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out + each row's delta, a bound on the magnitude of its sums) in float64, one row and one
    part at a time; a slot past `adapters` holds none."""
    expected, magnitude = out.double().clone(), out.double().abs()
    for r, s in enumerate(slots):
        if not 0 <= s < len(adapters):
            continue
        col = 0
        for part, width in zip(adapters[s], widths):
            if part is not None:
                a, b = part[0].double(), part[1].double()
                expected[r, col:col + width] += (x[r].double() @ a.T) @ b.T
                magnitude[r, col:col + width] += (x[r].double().abs() @ a.abs().T) @ b.abs().T
            col += width
    return expected, magnitude


def pack(adapters: list[Adapter], in_features: int, widths: tuple[int, ...], num_slots: int, rank_dim: int,
         dtype: torch.dtype):
    """The kernel's layout (csrc/lora.c): at [slots, parts, in, R], bt [slots, R, out], ranks, part ends."""
    at = torch.zeros(num_slots, len(widths), in_features, rank_dim, dtype=dtype)
    bt = torch.zeros(num_slots, rank_dim, sum(widths), dtype=dtype)
    ranks = torch.zeros(num_slots, len(widths), dtype=torch.int64)
    ends = torch.tensor(widths).cumsum(0)
    for s, adapter in enumerate(adapters):
        for p, part in enumerate(adapter):
            if part is not None:
                a, b = part
                at[s, p, :, :a.shape[0]] = a.T
                bt[s, :a.shape[0], ends[p] - widths[p]:ends[p]] = b.T
                ranks[s, p] = a.shape[0]
    return at, bt, ranks, ends


def assert_close(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, terms: int) -> None:
    """Within a float32 sum of `terms` products per value, and for bfloat16 the final rounding."""
    bound = (terms + 2) * 2.0**-24 * magnitude
    if got.dtype == torch.bfloat16:
        bound += 2.0**-8 * expected.abs()
    excess = (got.double() - expected).abs() - bound
    assert (excess <= 0).all(), excess.max()


def run(x, out, slots, adapters, widths, num_slots, rank_dim):
    at, bt, ranks, ends = pack(adapters, x.shape[1], widths, num_slots, rank_dim, x.dtype)
    slot_buffer = torch.tensor(slots + [3] * 5, dtype=torch.int64)  # past the rows: never read
    lora_cpu.lora_add(x, out, slot_buffer, at, bt, ranks, ends)


CASES = {  # in_features, part widths, per adapter its rank per part, the stack's rank dimension
    "one part": (96, (80,), [[16], [5], [32]], 32),
    "q k v": (37, (48, 16, 16), [[8, 8, 8], [3, 0, 17], [32, 32, 1]], 32),
    "gate up": (64, (130, 130), [[16, 16], [0, 4], [9, 0]], 16),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [0, 1, 9, 300])
def test_matches_a_per_row_reference(dtype, case, rows):
    in_features, widths, ranks, rank_dim = CASES[case]
    adapters = random_adapters(in_features, widths, ranks, dtype, seed=rows)
    gen = torch.Generator().manual_seed(100 + rows)
    slots = torch.randint(-1, len(adapters) + 1, (rows,), generator=gen).tolist()  # slot 3 holds nothing
    if rows == 1:
        slots = [1]
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    out = torch.randn(rows, sum(widths), generator=gen).to(dtype)
    got = out.clone()
    run(x, got, slots, adapters, widths, 4, rank_dim)
    expected, magnitude = reference(x, out, slots, adapters, widths)
    assert_close(got, expected, magnitude, in_features + rank_dim)
    base = [r for r, s in enumerate(slots) if s in (-1, 3)]
    assert torch.equal(got[base], out[base])  # the base model's rows, and an empty slot's, untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_shapes(dtype):
    """The embedded model's q/k/v (576 | 192 | 192) at rank 16, 32 rows over 8 adapters."""
    widths, rows = (576, 192, 192), 32
    adapters = random_adapters(576, widths, [[16, 16, 16]] * 8, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    slots = [r % 9 - 1 for r in range(rows)]
    x, out = torch.randn(rows, 576, generator=gen).to(dtype), torch.randn(rows, 960, generator=gen).to(dtype)
    got = out.clone()
    run(x, got, slots, adapters, widths, 8, 16)
    expected, magnitude = reference(x, out, slots, adapters, widths)
    assert_close(got, expected, magnitude, 576 + 16)


def test_rows_of_a_strided_output_and_nothing_past_them():
    widths = (24, 8)
    adapters = random_adapters(16, widths, [[4, 4]], torch.float32, seed=3)
    x = torch.randn(5, 16)
    wide = torch.randn(5, 40)
    out = wide[:, :32]  # rows 40 apart
    before = wide.clone()
    run(x, out, [0] * 5, adapters, widths, 1, 16)
    expected, magnitude = reference(x, before[:, :32], [0] * 5, adapters, widths)
    assert_close(out, expected, magnitude, 16 + 16)
    assert torch.equal(wide[:, 32:], before[:, 32:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_delta_alone_in_any_batch_and_on_any_number_of_threads(dtype):
    in_features, widths, ranks, rank_dim = CASES["q k v"]
    adapters = random_adapters(in_features, widths, ranks, dtype, seed=4)
    gen = torch.Generator().manual_seed(5)
    slots = torch.randint(-1, 3, (50,), generator=gen).tolist()
    x, out = torch.randn(50, in_features, generator=gen).to(dtype), torch.randn(50, 80, generator=gen).to(dtype)
    together = out.clone()
    run(x, together, slots, adapters, widths, 3, rank_dim)
    for r in (0, 17, 49):  # alone: a tile of one row
        alone = out[r:r + 1].clone()
        run(x[r:r + 1], alone, slots[r:r + 1], adapters, widths, 3, rank_dim)
        assert torch.equal(alone[0], together[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = out.clone()
        run(x, one, slots, adapters, widths, 3, rank_dim)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, together)


def test_a_slot_outside_the_stack_is_refused_and_nothing_is_written():
    widths = (8,)
    adapters = random_adapters(8, widths, [[4], [4]], torch.float32, seed=6)
    x, out = torch.randn(3, 8), torch.randn(3, 8)
    for bad in (2, -2):
        got = out.clone()
        with pytest.raises(ValueError, match="outside"):
            run(x, got, [0, bad, 1], adapters, widths, 2, 16)
        assert torch.equal(got, out)


def test_available_on_cpu_in_float32_and_bfloat16_only():
    assert lora_cpu.available("cpu", torch.float32) and lora_cpu.available("cpu", torch.bfloat16)
    assert not lora_cpu.available("cpu", torch.float16) and not lora_cpu.available("meta", torch.float32)
